"""Evaluate a trained run at other recursive step counts (test-time steps, no retraining).

    python -m cem_jax.evaluate --workdir=DIR --num_steps=1,2,3,4 [--batch_size=ROWS]

Loads the newest checkpoint with the config saved in it (the trained T included), the run's
prepared data and tokenizer, then evaluates the validation split with every CEM layer running
``T_eval`` steps. Writes ``DIR/test_time_steps.{md,json,png}``: perplexity, bits per byte, the
held-out tokens scored and the final energy (the sum over layers of the attention + MLP energy
after the last step, mean per token) per ``T_eval``. Steps beyond the trained T reuse the last
step's parameters (per-step step sizes or preconditioners). ``--batch_size`` replaces the
run's ``eval.batch_size``, e.g. on a host smaller than the one the run was trained on: the
whole split's figures do not depend on it (``--max_batches`` counts batches of it).
"""

from __future__ import annotations

import json
import os

from absl import app, flags, logging

from cem_jax import cli
from cem_jax import config as config_lib
from cem_jax.files import atomic_write_text, saved_figure


def test_time_steps(workdir: str, steps: list[int], max_batches: int = -1,
                    attention_impl: str | None = None,
                    batch_size: int | None = None) -> list[dict]:
  """Evaluates ``workdir``'s model for each ``T_eval`` in ``steps``; returns one row each.

  Row keys: ``T_eval``, ``eval/loss`` (nats/token), ``eval/perplexity``,
  ``eval/bits_per_byte``, ``eval/tokens`` (held-out tokens scored: ``max_batches`` -1 scores
  the whole split), ``final_energy`` (after the last step, summed over layers and over
  the CEM sub-layers the model has, mean per token; None when it has none), ``step`` (the
  checkpoint's training step) and ``T_trained`` (the ``model.num_steps`` the checkpoint was
  trained with, from the config saved in it). ``batch_size``: the rows of an eval batch (None:
  the run's ``eval.batch_size``).

  Raises:
    ValueError: the run is not a CEM model, ``steps`` not as :func:`check_steps` allows,
      ``batch_size`` not as ``eval.batch_size`` allows, or the eval batch does not fit this
      host's memory and swap (:func:`cem_jax.train.check_batch_fits`, before the data and the
      parameters are made), or a ``T_eval``'s compiled eval step does not fit the device's
      memory (on a CPU the host's memory and swap: :func:`cem_jax.train.compile_eval_step`,
      before any batch is evaluated); each one line naming ``--batch_size`` (or
      ``eval.batch_size`` without it) and its value.
    FileNotFoundError, CheckpointError, ValueError: as :func:`cem_jax.runs.load_run`.
  """
  from cem_jax import runs, train
  from cem_jax import steps as steps_lib
  from cem_jax.metrics import final_energy

  check_steps(steps)  # before seconds of loading
  if batch_size is not None:
    config_lib.check_flag("--batch_size", "eval.batch_size", batch_size)

  advice = ("give evaluate a smaller --batch_size (the whole split's figures do not depend on "
            "it)")

  def require_cem(config):
    if config.model.block != "cem":
      raise ValueError(f"model.block={config.model.block!r}: test-time steps need a CEM "
                       "model")
    if batch_size is not None:  # in the config load_run returns, which the eval below reads
      config.eval.batch_size = batch_size
    # Before the data and the parameters are made: an eval batch larger than this host
    # ended in a MemoryError traceback or the kernel's kill (exit status 137). The advice (also
    # the device check's below) is evaluate's flag: the run's config is not this command's
    # to change.
    train.check_batch_fits(config, "eval.batch_size", advice=advice)

  config, data, graphdef, params, step = runs.load_run(workdir, require=require_cem,
                                                       attention_impl=attention_impl)
  config.eval.max_batches = max_batches
  field = "eval.batch_size" if batch_size is None else "--batch_size"
  # Every T_eval's step compiled and checked against the device's memory (on a CPU the host's)
  # before any batch is evaluated: a batch too large for the device ended in XLA's
  # out-of-memory traceback at its first batch, after the evals of the T_evals before it.
  compiled = [train.compile_eval_step(
      config, steps_lib.make_eval_step(graphdef, t_eval, True,
                                       loss_block_size=config.train.loss_block_size),
      params, what=f"the eval step of T_eval={t_eval} at {field}={config.eval.batch_size}",
      advice=advice) for t_eval in steps]
  rows = []
  for t_eval, eval_step in zip(steps, compiled, strict=True):
    metrics = steps_lib.eval_loop(eval_step, params, data, config)
    rows.append({"T_eval": t_eval, "step": step, "T_trained": config.model.num_steps,
                 "final_energy": final_energy(metrics),
                 **{k: metrics[k] for k in ("eval/loss", "eval/perplexity",
                                            "eval/bits_per_byte", "eval/tokens")}})
  return rows


def check_steps(steps: list) -> None:
  """The rule of ``--num_steps`` (``T_eval`` values): one or more values, each one
  ``model.num_steps`` allows (an int >= 1 and below its bound,
  :func:`cem_jax.config.is_allowed_int`), each at most once (T_eval = 0 would run no CEM step;
  10**9 would be traced for ever; a repeat, the same evaluation twice).

  Raises:
    ValueError: one line naming every value and what is allowed.
  """
  if (not steps or len(set(steps)) < len(steps)
      or not all(config_lib.is_allowed_int("model.num_steps", t) for t in steps)):
    typed = ",".join(t if isinstance(t, str) else config_lib.shown(t) for t in steps)
    raise ValueError(f"--num_steps={typed}; allowed: comma-separated "
                     f"values, each {config_lib.allowed_int('model.num_steps')} and at most "
                     "once")


def report_paths(workdir: str) -> list[str]:
  """``workdir/test_time_steps.{md,json,png}``, the files :func:`write_report` writes.

  Raises:
    ValueError: one of them is a folder (found before an evaluation that could not be saved).
  """
  paths = [os.path.join(workdir, "test_time_steps" + ext) for ext in (".md", ".json", ".png")]
  for path in paths:
    if os.path.isdir(path):
      raise ValueError(f"--workdir={workdir}: {path} is a folder, in the way of the report; "
                       "move it away")
  return paths


def write_report(workdir: str, rows: list[dict], trained_steps: int) -> list[str]:
  """Writes ``test_time_steps.{md,json,png}`` in ``workdir``; returns the paths.

  Each file is written atomically, the figure first and the JSON last: a report that fails
  (a value the figure or JSON cannot hold, a folder in the way) leaves the previous JSON, not a
  new table beside an old or missing figure.

  Raises:
    ValueError: as :func:`report_paths`.
  """
  paths = report_paths(workdir)
  base = os.path.join(workdir, "test_time_steps")
  lines = [
      f"Test-time steps for a model trained with T = {trained_steps} "
      f"(checkpoint step {rows[0]['step']}; {rows[0]['eval/tokens']:,} held-out tokens a row).",
      "",
      "| T_eval | eval loss (nats) | perplexity | bits/byte | final energy (Σ layers, per token) |",
      "|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(f"| {r['T_eval']} | {r['eval/loss']:.4f} | {r['eval/perplexity']:.2f} | "
                 f"{r['eval/bits_per_byte']:.4f} | " +
                 ("n/a" if r["final_energy"] is None else f"{r['final_energy']:.4f}") + " |")
  json_text = json.dumps(rows, indent=2)  # TypeError before anything is written
  ts = [r["T_eval"] for r in rows]
  with saved_figure(base + ".png", ncols=2, figsize=(9, 3.5)) as (_, (a1, a2)):
    a1.plot(ts, [r["eval/perplexity"] for r in rows], "o-")
    a1.set_xlabel("T_eval")
    a1.set_ylabel("eval perplexity")
    a1.axvline(trained_steps, ls="--", c="gray", label="trained T")
    a1.legend()
    a2.plot(ts, [float("nan") if r["final_energy"] is None else r["final_energy"] for r in rows],
            "o-", c="C1")
    a2.set_xlabel("T_eval")
    a2.set_ylabel("final energy (sum over layers, per token)")
    for ax in (a1, a2):
      ax.set_xticks(ts)
      ax.grid(alpha=0.3)
  atomic_write_text(base + ".md", "\n".join(lines) + "\n")
  atomic_write_text(base + ".json", json_text)
  return paths


def main(argv):
  cli.no_extra_args(argv)
  fl = flags.FLAGS
  # Orbax warns that a read-only manager is read-only; our own warnings (a damaged newest
  # checkpoint) still show.
  cli.quiet_libraries(logging.logging.ERROR)  # a Python logging level
  with cli.user_errors():
    # Checked before anything is loaded: a typo must not cost a model build and an eval.
    try:
      steps = [int(s) for s in fl.num_steps]
    except ValueError:
      steps = list(fl.num_steps)  # as typed: check_steps refuses them by name
    check_steps(steps)
    config_lib.check_flag("--max_batches", "eval.max_batches", fl.max_batches)
    if fl.batch_size is not None:
      config_lib.check_flag("--batch_size", "eval.batch_size", fl.batch_size)
    cli.check_folder("workdir", fl.workdir, "a trained run's folder")
    report_paths(fl.workdir)  # a folder in the way: said before the evaluation, not after
    rows = test_time_steps(fl.workdir, steps, fl.max_batches, fl.attention_impl,
                           fl.batch_size)
    # From the checkpoint's own config: config.json may be edited, or newer than the step.
    paths = write_report(fl.workdir, rows, rows[0]["T_trained"])
  print(open(paths[0]).read())
  print("\n".join(paths))


if __name__ == "__main__":
  # Flags are defined only when run as a program, so other tools can import the functions.
  flags.DEFINE_string("workdir", None, "A finished (or checkpointed) run's folder.")
  flags.DEFINE_list("num_steps", ["1", "2", "3", "4"], "T_eval values.")
  flags.DEFINE_integer("max_batches", -1, "Eval batches (-1: all).")
  flags.DEFINE_integer("batch_size", None, "Rows of an eval batch (default: the run's "
                       "eval.batch_size; the whole split's figures do not depend on it).")
  cli.define_attention_impl_flag(config_lib.ATTENTION_IMPLEMENTATIONS)
  cli.require("workdir")
  app.run(main, flags_parser=cli.parse_flags)
