"""Evaluate a trained run at other recursive step counts (test-time steps, no retraining).

    python -m cem_jax.evaluate --workdir=DIR --num_steps=1,2,3,4

Loads the newest checkpoint with the config saved in it (the trained T included), the run's
prepared data and tokenizer, then evaluates the validation split with every CEM layer running
``T_eval`` steps. Writes ``DIR/test_time_steps.{md,json,png}``: perplexity, bits per byte, the
held-out tokens scored and the final energy (the sum over layers of the attention + MLP energy
after the last step, mean per token) per ``T_eval``. Steps beyond the trained T reuse the last
step's parameters (per-step step sizes or preconditioners).
"""

from __future__ import annotations

import glob
import os

from absl import app, flags, logging

from cem_jax import cli
from cem_jax.files import atomic_write_json, atomic_write_text, read_json, saved_figure


def load_run(workdir: str, require=None, attention_impl: str | None = None):
  """Returns ``(config, data, graphdef, params, step)`` of the newest checkpoint in ``workdir``.

  The model is rebuilt from the config saved *in that checkpoint*, not from
  ``config.json``, which every start that trains rewrites (a run still training may be past
  that checkpoint, or the file edited by hand). Fields missing from an older run's config take
  today's defaults. The data are the tokens the checkpoint records it was trained on, read
  from the run's ``data.prepared_dir`` or its ``data/`` folder, so the raw text (and a given
  tokenizer file) may have moved; otherwise they are built from the config, and must be the
  tokens the checkpoint records. ``require``, if given, is called with the checkpoint's
  config before the data and the model are built (seconds), to refuse a run at once by
  raising ValueError. ``attention_impl`` replaces the run's ``model.attention_impl`` (None:
  the run's own), e.g. 'auto' to evaluate on a CPU a run trained with 'cudnn' on a GPU: the
  kernel computes the same function and holds no parameter (``config.RESUME_MAY_CHANGE``).

  Raises:
    FileNotFoundError: no ``config.json`` or no checkpoint in ``workdir``.
    CheckpointError: checkpoints exist but none is intact.
    ValueError: the saved config has fields this version of cem_jax does not know, or fails
      validation; a user energy was edited since the checkpoint was saved
      (:func:`cem_jax.energies.changed_energies`); the data are not those the checkpoint
      was trained on.
  """
  from cem_jax.checkpoint import Checkpointer

  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"--workdir={workdir}: no config.json (not a cem_jax run)")
  # Read-only: the run may still be training here; its in-flight saves must not be touched.
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False, read_only=True)
  try:
    # A run still training may prune the step chosen while the data and model are built:
    # then the newest step is chosen again.
    for attempt in range(3):
      step = ckpt.restorable_step()  # the newest *verified* step
      if step is None:  # found before the data are built (a tokenizer trained for nothing)
        raise FileNotFoundError(f"--workdir={workdir}: no checkpoint in {ckpt.directory}")
      try:
        config, data, graphdef, params = _build_from(ckpt, step, path, workdir, require,
                                                     attention_impl)
        break
      except (OSError, ValueError):
        if attempt == 2 or os.path.isdir(ckpt.step_dir(step)):
          raise
  finally:
    ckpt.close()
  return config, data, graphdef, params, step


def _build_from(ckpt, step: int, config_json: str, workdir: str, require=None,
                attention_impl: str | None = None):
  """``load_run`` for one step: ``(config, data, graphdef, params)``."""
  from flax import nnx

  from cem_jax import config as config_lib
  from cem_jax import data as data_lib
  from cem_jax import energies, optim, preflight
  from cem_jax import steps as steps_lib
  from cem_jax import workdir as workdir_lib

  meta = ckpt.read_meta(step)
  saved = meta.get("config")
  where = f"checkpoint {ckpt.step_dir(step)}"
  if saved is None:  # saved before checkpoints held their config
    where = config_json
    saved = read_json(config_json, "restore it from the run's command")
  config = config_lib.from_saved(saved, where)
  if attention_impl is not None:
    config.model.attention_impl = attention_impl
  preflight.check(config)
  changed = energies.changed_energies(meta.get("energies"),
                                    meta.get("energy_digest_version", 1), config, None,
                                    f"checkpoint {ckpt.step_dir(step)}")
  if changed:  # the same parameters under another energy: numbers of a model never trained
    raise ValueError(f"{where} was trained with another version of its energy "
                     f"({', '.join(changed)}): load it with the energy it was trained with")
  if require is not None:
    require(config)
  found = _prepared_data_of(workdir, config.data.prepared_dir, meta.get("data"))
  if found:
    # The tokens the checkpoint was trained on: the raw text and a given tokenizer file need
    # not be where they were (or exist at all).
    d = config.data
    d.prepared_dir, d.files, d.tfds_name, d.tokenizer = found, "", "", ""
  held = workdir_lib.prepared_folders(workdir)
  data = data_lib.build_data(config, workdir)
  try:
    data_lib.check_same_data(meta.get("data"), data.identity, ckpt.step_dir(step))
  except ValueError:
    workdir_lib.remove_prepared_since(workdir, held)
    raise
  model = steps_lib.build_model(config, data.tokenizer.vocab_size)
  graphdef, params = nnx.split(model, nnx.Param)
  tx, _ = optim.make_optimizer(config.train)
  state, _ = ckpt.restore(step, {"params": params, "opt_state": tx.init(params)})
  return config, data, graphdef, state["params"]


def _prepared_data_of(workdir: str, prepared_dir: str, identity: dict | None) -> str | None:
  """The prepared folder whose tokens are ``identity`` (a checkpoint's record of what it was
  trained on): the run's ``data.prepared_dir`` or one under ``WORKDIR/data``; None if none."""
  from cem_jax.data import PreparedData, data_identity

  if not identity:
    return None
  candidates = sorted(glob.glob(os.path.join(workdir, "data", "*")))
  if prepared_dir:
    candidates.insert(0, os.path.expanduser(prepared_dir))
  for folder in candidates:
    try:
      # Sizes only: build_data verifies every sha256 of the folder it opens.
      if data_identity(PreparedData.open_manifest(folder, verify=False)) == identity:
        return folder
    except ValueError:
      continue  # not a (complete, intact) prepared folder: not the one
  return None


def test_time_steps(workdir: str, steps: list[int], max_batches: int = -1,
                    attention_impl: str | None = None) -> list[dict]:
  """Evaluates ``workdir``'s model for each ``T_eval`` in ``steps``; returns one row each.

  Row keys: ``T_eval``, ``eval/loss`` (nats/token), ``eval/perplexity``,
  ``eval/bits_per_byte``, ``eval/tokens`` (held-out tokens scored: ``max_batches`` -1 scores
  the whole split), ``final_energy`` (after the last step, summed over layers and over
  the CEM sub-layers the model has, mean per token; None when it has none), ``step`` (the
  checkpoint's training step) and ``T_trained`` (the ``model.num_steps`` the checkpoint was
  trained with, from the config saved in it).

  Raises:
    ValueError: the run is not a CEM model, or a ``T_eval`` < 1.
    FileNotFoundError, CheckpointError, ValueError: as :func:`load_run`.
  """
  from cem_jax import steps as steps_lib
  from cem_jax.metrics import final_energy

  for t_eval in steps:  # before seconds of loading
    if t_eval < 1:
      raise ValueError(f"--num_steps={t_eval}; allowed: integers >= 1")

  def require_cem(config):
    if config.model.block != "cem":
      raise ValueError(f"model.block={config.model.block!r}: test-time steps need a CEM "
                       "model")

  config, data, graphdef, params, step = load_run(workdir, require=require_cem,
                                                  attention_impl=attention_impl)
  config.eval.max_batches = max_batches
  rows = []
  for t_eval in steps:
    eval_step = steps_lib.make_eval_step(graphdef, t_eval, True,
                                         loss_block_size=config.train.loss_block_size)
    metrics = steps_lib.eval_loop(eval_step, params, data, config)
    rows.append({"T_eval": t_eval, "step": step, "T_trained": config.model.num_steps,
                 "final_energy": final_energy(metrics),
                 **{k: metrics[k] for k in ("eval/loss", "eval/perplexity",
                                            "eval/bits_per_byte", "eval/tokens")}})
  return rows


def write_report(workdir: str, rows: list[dict], trained_steps: int) -> list[str]:
  """Writes ``test_time_steps.{md,json,png}`` in ``workdir``; returns the paths."""
  base = os.path.join(workdir, "test_time_steps")
  atomic_write_json(base + ".json", rows)
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
  atomic_write_text(base + ".md", "\n".join(lines) + "\n")
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
  return [base + ext for ext in (".md", ".json", ".png")]


def define_attention_impl_flag() -> None:
  """``--attention_impl`` of the tools that load a run (evaluate, sample)."""
  from cem_jax.config import ATTENTION_IMPLEMENTATIONS

  flags.DEFINE_enum("attention_impl", None, ATTENTION_IMPLEMENTATIONS,
                    "The attention kernel to run the model with (default: the run's own "
                    "model.attention_impl), e.g. auto on a CPU for a run trained with cudnn.")


def main(argv):
  del argv
  fl = flags.FLAGS
  # Orbax warns that a read-only manager is read-only; our own warnings (a damaged newest
  # checkpoint) still show.
  cli.quiet_libraries(logging.logging.ERROR)  # a Python logging level
  with cli.user_errors():
    # Checked before anything is loaded: a typo must not cost a model build and an eval.
    try:
      steps = [int(s) for s in fl.num_steps]
    except ValueError:
      steps = []
    if not steps or min(steps) < 1 or len(set(steps)) < len(steps):
      raise ValueError(f"--num_steps={','.join(fl.num_steps)}; allowed: comma-separated "
                       "integers >= 1, each at most once")
    if fl.max_batches < 1 and fl.max_batches != -1:
      raise ValueError(f"--max_batches={fl.max_batches}; allowed: -1 (all) or an int >= 1")
    rows = test_time_steps(fl.workdir, steps, fl.max_batches, fl.attention_impl)
    # From the checkpoint's own config: config.json may be edited, or newer than the step.
    paths = write_report(fl.workdir, rows, rows[0]["T_trained"])
  print(open(paths[0]).read())
  print("\n".join(paths))


if __name__ == "__main__":
  # Flags are defined only when run as a program, so other tools can import the functions.
  flags.DEFINE_string("workdir", None, "A finished (or checkpointed) run's folder.")
  flags.DEFINE_list("num_steps", ["1", "2", "3", "4"], "T_eval values.")
  flags.DEFINE_integer("max_batches", -1, "Eval batches (-1: all).")
  define_attention_impl_flag()
  flags.mark_flag_as_required("workdir")
  app.run(main, flags_parser=cli.parse_flags)
