"""Plots of a run: ``python -m cem_jax.plot --workdir=DIR`` writes ``DIR/plots/*.png``.

- ``loss.png``: train and eval loss (nats/token) against the step.
- ``energy.png`` (CEM models with ``eval.energy_trace``): the newest eval's energy trace —
  for each layer, every sub-step's mean per-token energy as a solid segment from before to
  after its update, and a dotted jump to the next sub-step's "before" (another sub-step or a
  recomputed context moves the state in between). A descending segment is the layer doing
  what CEM says it does (CEM_MATH.md §4).
"""

from __future__ import annotations

import glob
import os

from absl import app, flags

from cem_jax import cli
from cem_jax.files import saved_figure
from cem_jax.metrics import energy_steps, metrics_path, read_metrics


def plot_losses(metrics: list[dict], path: str, title: str = "") -> None:
  """Train/eval loss curves to ``path`` (PNG)."""
  # None: a non-finite value (metrics.jsonl writes it as null); a gap in the curve.
  train = [(m["step"], m["train/loss"]) for m in metrics if m.get("train/loss") is not None]
  evals = [(m["step"], m["eval/loss"]) for m in metrics if m.get("eval/loss") is not None]
  bpb = [m["eval/bits_per_byte"] for m in metrics if "eval/bits_per_byte" in m]
  with saved_figure(path, figsize=(6, 4)) as (_, ax):
    if train:
      ax.plot(*zip(*train, strict=True), label="train", alpha=0.7)
    if evals:
      final = "" if not bpb else (" (last: not finite)" if bpb[-1] is None
                                  else f" (last: {bpb[-1]:.4f} bits/byte)")
      ax.plot(*zip(*evals, strict=True), "o-", label="eval" + final)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


def plot_energy(steps: dict[int, dict[str, list[tuple[float, float]]]], path: str,
                title: str = "") -> None:
  """Each sub-step's energy before and after it, per layer and recursive step, one panel per
  sub-layer (``steps`` from :func:`cem_jax.metrics.energy_steps`). Solid segments are the
  sub-steps; dotted ones join step t's end to step t+1's start, where the other sub-step
  (or a recomputed context) has moved the energy."""
  with saved_figure(path, ncols=2, figsize=(10, 4)) as (fig, axes):
    for ax, part, name in zip(axes, ("att", "mlp"), ("attention energy", "MLP energy"),
                              strict=True):
      _draw_energy_steps(ax, steps, part, name)
    fig.suptitle(title)


def _draw_energy_steps(ax, steps: dict, part: str, name: str) -> None:
  count = 0
  for layer, parts in steps.items():
    pairs = parts.get(part, [])
    count = max(count, len(pairs))
    color = None
    for t, (before, after) in enumerate(pairs):
      line, = ax.plot([2 * t, 2 * t + 1], [before, after], "o-", color=color,
                      label=f"layer {layer}" if t == 0 else None)
      color = line.get_color()
      if t + 1 < len(pairs):
        ax.plot([2 * t + 1, 2 * t + 2], [after, pairs[t + 1][0]], ":", color=color)
  ticks = [f"t={t} {w}" for t in range(1, count + 1) for w in ("before", "after")]
  ax.set_xticks(range(len(ticks)), ticks, fontsize=8)
  ax.set_ylabel(f"{name} (one layer, mean per token)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)


def plot_run(workdir: str) -> list[str]:
  """Writes the plots of ``workdir``; returns their paths.

  Raises:
    FileNotFoundError: ``workdir/metrics.jsonl`` does not exist (naming a run inside when
      ``workdir`` is a sweep's or a table's folder of runs).
    ValueError: ``workdir`` or ``workdir/plots`` is a file; ``metrics.jsonl`` holds no losses
      yet, none that is finite, or a damaged line before the last.
  """
  if os.path.isfile(workdir):  # else "no metrics.jsonl" would send the user to train there
    raise ValueError(f"--workdir={workdir} is a file; give a run's folder (holds metrics.jsonl)")
  if not os.path.exists(metrics_path(workdir)):
    # A table's or a sweep's folder holds runs: "train there first" sent the user to train in it.
    runs_in = (os.path.join(glob.escape(workdir), "*"),  # a sweep's WORKDIR/RUN
               os.path.join(glob.escape(workdir), "*", "*", "*"))  # a table's TABLE/ROW/SEED
    inside = sorted(p for pattern in runs_in for p in glob.glob(metrics_path(pattern)))
    if inside:
      raise FileNotFoundError(f"--workdir={workdir}: no metrics.jsonl; it is a folder of "
                              f"{len(inside)} runs: give one run's folder, e.g. "
                              f"--workdir={os.path.dirname(inside[0])}")
    raise FileNotFoundError(f"--workdir={workdir}: no metrics.jsonl (train there first)")
  metrics = read_metrics(workdir)
  if not any("train/loss" in m or "eval/loss" in m for m in metrics):
    raise ValueError(f"--workdir={workdir}: metrics.jsonl has no losses yet (the first is "
                     "logged after train.log_every_steps steps)")
  if all(m.get("train/loss") is None and m.get("eval/loss") is None for m in metrics):
    raise ValueError(f"--workdir={workdir}: every loss in metrics.jsonl is null (not finite: "
                     "the run diverged from its start); nothing to plot")
  out_dir = os.path.join(workdir, "plots")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ValueError(f"--workdir={workdir}: {out_dir} is a file, in the way of the plots' "
                     "folder; move it away")
  os.makedirs(out_dir, exist_ok=True)
  written = [os.path.join(out_dir, "loss.png")]
  plot_losses(metrics, written[0], os.path.abspath(workdir))
  evals = [m for m in metrics if "eval/loss" in m and energy_steps(m)]
  if evals:
    written.append(os.path.join(out_dir, "energy.png"))
    plot_energy(energy_steps(evals[-1]), written[1], f"energy trace at step {evals[-1]['step']}")
  return written


def main(argv):
  cli.no_extra_args(argv)
  with cli.user_errors():
    cli.check_folder("workdir", flags.FLAGS.workdir, "a run's folder")
    for path in plot_run(flags.FLAGS.workdir):
      print(path)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so other tools can import the functions.
  flags.DEFINE_string("workdir", None, "A run's folder (holds metrics.jsonl).")
  cli.require("workdir")
  app.run(main, flags_parser=cli.parse_flags)
