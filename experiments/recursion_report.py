"""Why is T = 2 worse than T = 1 at tiny scale? The design table's runs, read three ways.

    python experiments/recursion_report.py --workdir=results/tiny \
        --out=results/tiny/design_recursion.md

Reads ``WORKDIR/design/ROW/seedS`` (``python -m cem_jax.tables --table=design``; every row logs
its energy trace) and prints markdown:

1. Eval loss per seed and the difference to ``t1`` and to ``t2_fixed``, paired by seed (same
   initialisation and data order), so each diagnostic row is compared with the row it changes.
2. Energy descent at the last eval: for each recursive step and sub-layer, the change of its
   own energy over the sub-step (after − before, nats-free energy units per token, mean over
   layers and seeds) and how many of the layer × seed sub-steps lower it; and how far the
   other sub-step between two steps moves each energy (step t+1's "before" minus step t's
   "after": the MLP step moves the attention energy, the next attention step the MLP energy,
   and with a co-evolving context the recomputed keys too; with the Lie–Trotter split each
   sub-step descends its own energy, not the sum).
3. The learned step sizes η = softplus(raw) at the end of training (mean over layers, heads
   and seeds), per step where the row has one per step; read from the runs' newest
   checkpoints (git-ignored, so only where the runs were trained: the table names the seeds
   it read, and says "n/a" where none is at hand).

Without ``--out`` the report goes to stdout. ``--out=FILE`` writes it atomically and refuses
to replace an existing FILE with one whose η rows are "n/a": on a fresh clone the checkpoints
are missing, and the committed η values would be lost.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import sys

from absl import app, flags, logging

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from cem_jax.metrics import energy_steps, read_metrics  # noqa: E402

ROWS = ("t1", "t2_fixed", "t2_eta_half", "t1_eta_half", "t2_joint_eta_half",
        "t1_joint_eta_half", "t2_eta_per_step", "t2_lr_half", "t1_lr_half", "t2_coevolve",
        "t1_precond_diag", "t1_precond_dlr")


def _seeds(workdir: str, row: str) -> list[str]:
  base = os.path.join(workdir, "design", row)
  if not os.path.isdir(base):
    return []
  return sorted(os.path.join(base, s) for s in os.listdir(base)
                if re.fullmatch(r"seed\d+", s) and
                os.path.exists(os.path.join(base, s, "result.json")))


def _last_eval(run: str) -> dict:
  """The run's last eval line, its loss nan where metrics.jsonl holds null (not finite).

  Raises:
    ValueError: the run has no eval line.
  """
  evals = [m for m in read_metrics(run) if "eval/loss" in m]
  if not evals:
    raise ValueError(f"{run}/metrics.jsonl has no eval line; train that run again")
  last = evals[-1]
  return {**last, "eval/loss": math.nan if last["eval/loss"] is None else last["eval/loss"]}


def _energies(line: dict) -> dict:
  """``{(layer, step, part): (before, after)}`` (steps from 1) from one eval line; sub-steps
  whose energy was not finite (null) are left out."""
  return {(layer, t + 1, part): pair for layer, parts in energy_steps(line).items()
          for part, pairs in parts.items() for t, pair in enumerate(pairs)
          if None not in pair}


def _fmt(values: list[float]) -> str:
  if not values:
    return "–"
  mean = statistics.fmean(values)
  return f"{mean:+.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:+.3f}"


def loss_table(workdir: str) -> list[str]:
  losses = {row: {os.path.basename(r): _last_eval(r)["eval/loss"] for r in _seeds(workdir, row)}
            for row in ROWS}
  seeds = sorted({s for v in losses.values() for s in v})
  lines = ["| row | " + " | ".join(f"eval loss {s}" for s in seeds)
           + " | Δ vs t1 (paired) | Δ vs t2_fixed (paired) |",
           "|---|" + "---:|" * (len(seeds) + 2)]
  for row in ROWS:
    if not losses[row]:
      continue
    cells = [f"{losses[row][s]:.4f}" if s in losses[row] else "–" for s in seeds]
    deltas = []
    for base in ("t1", "t2_fixed"):
      paired = [losses[row][s] - losses[base][s] for s in seeds
                if s in losses[row] and s in losses[base]]
      deltas.append("0" if row == base else _fmt(paired))
    lines.append(f"| {row} | " + " | ".join(cells + deltas) + " |")
  return lines


def energy_table(workdir: str) -> list[str]:
  lines = ["| row | att step 1 | att step 2 | MLP step 1 | MLP step 2 | sub-steps lowering "
           "their energy | att energy moved between steps | MLP energy moved between steps |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for row in ROWS:
    runs = _seeds(workdir, row)
    if not runs:
      continue
    change: dict = {}
    lowered = total = 0
    undone: dict = {"att": [], "mlp": []}
    for run in runs:
      e = _energies(_last_eval(run))
      for (layer, step, part), (before, after) in e.items():
        change.setdefault((part, step), []).append(after - before)
        lowered += after < before
        total += 1
        nxt = e.get((layer, step + 1, part))
        if nxt is not None:
          undone[part].append(nxt[0] - after)
    if not total:
      continue
    cells = [f"{statistics.fmean(change[p, s]):+.2f}" if (p, s) in change else "–"
             for p in ("att", "mlp") for s in (1, 2)]
    moved = [f"{statistics.fmean(undone[p]):+.2f}" if undone[p] else "–" for p in ("att", "mlp")]
    lines.append(f"| {row} | " + " | ".join(cells) + f" | {lowered}/{total} | "
                 + " | ".join(moved) + " |")
  return lines


def eta_table(workdir: str) -> list[str]:
  """The learned η per row, mean over layers, heads and the seeds whose checkpoints are here
  (named in the last column; "n/a" when none is)."""
  import jax
  import numpy as np

  from cem_jax.runs import load_run

  lines = ["| row | attention η (step 1, step 2) | MLP η (step 1, step 2) | seeds |",
           "|---|---|---|---|"]
  for row in ROWS:
    runs = _seeds(workdir, row)
    if not runs:
      continue
    per_part: dict = {"attn": [], "mlp": []}
    read = []
    for run in runs:
      try:
        _, _, _, params, _ = load_run(run)
      except (FileNotFoundError, ValueError):  # no checkpoint here (git keeps none)
        continue
      read.append(os.path.basename(run))
      for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if "eta" in keys:
          part = "attn" if "attn" in keys else "mlp"
          eta = np.asarray(jax.nn.softplus(leaf))  # [copies, heads] or [copies]
          per_part[part].append(eta.reshape(eta.shape[0], -1).mean(axis=1))
    if not read:
      lines.append(f"| {row} | n/a | n/a | – |")
      continue
    cells = []
    for part in ("attn", "mlp"):
      if not per_part[part]:  # no learned η in this part (a Llama or standard sub-layer)
        cells.append("–")
        continue
      stacked = np.stack(per_part[part])  # [layers × seeds, copies]
      cells.append(", ".join(f"{v:.3f}" for v in stacked.mean(axis=0)))
    lines.append(f"| {row} | " + " | ".join(cells) + f" | {', '.join(read)} |")
  return lines


def report(workdir: str) -> tuple[str, list[str]]:
  """The markdown report of ``workdir``'s design runs and the rows whose η is "n/a"."""
  etas = eta_table(workdir)
  missing = [line.split("|")[1].strip() for line in etas if "| n/a |" in line]
  text = "\n".join([
      f"Recursion diagnostics of the design table ({workdir}/design), "
      "from `python experiments/recursion_report.py`.\n",
      "## Eval loss (nats/token), paired by seed\n",
      *loss_table(workdir),
      "\n## Energy descent at the last eval (change of each sub-step's own energy, per "
      "token, mean over layers and seeds)\n",
      *energy_table(workdir),
      "\n## Learned step sizes at the end of training (mean over layers, heads and the seeds "
      "whose checkpoints were at hand; one value where η is shared across steps)\n",
      *etas]) + "\n"
  return text, missing


def main(argv):
  from cem_jax import cli

  cli.no_extra_args(argv)  # e.g. a report path given without --out= was dropped
  from cem_jax.files import atomic_write_bytes

  cli.quiet_libraries(logging.logging.ERROR)  # Orbax: "read only" per checkpoint
  workdir, out = flags.FLAGS.workdir, flags.FLAGS.out
  with cli.user_errors():
    if not any(_seeds(workdir, row) for row in ROWS):
      raise ValueError(f"--workdir={workdir}: no finished design runs in {workdir}/design "
                       "(python -m cem_jax.tables --table=design ...)")
    text, missing = report(workdir)
    if not out:
      print(text, end="")
      return
    if missing and os.path.exists(out):
      raise ValueError(f"--out={out} exists and rows {', '.join(missing)} have no checkpoint "
                       f"in {workdir}/design (git-ignored: train them first), so their η "
                       "would become n/a; write elsewhere or leave --out out")
    atomic_write_bytes(out, text.encode())
    print(out)


if __name__ == "__main__":
  flags.DEFINE_string("workdir", "results/tiny", "The table's --workdir.")
  flags.DEFINE_string("out", None, "Write the report here (atomically) instead of stdout.")
  from cem_jax import cli

  app.run(main, flags_parser=cli.parse_flags)  # --help: status 0, bad flags: one line
