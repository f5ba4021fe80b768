"""The training loop: start-up, the step loop, periodic eval, metrics and checkpoints.

One clear path (nanodo-style): build data → build the mesh → initialise ``params`` (sharded, by
``jax.jit`` with ``out_shardings``) and split off the ``graphdef`` → ``jax.jit`` a pure train
step over ``(params, opt_state, batch)`` with in/out shardings and donation → evaluate, log and
checkpoint at step boundaries. One process or many (``jax.distributed``): every process runs
this same loop on global ``jax.Array``s and feeds only its own rows of each batch. The data
order is a pure function of the step, so the checkpointed step *is* the data position and a
resumed run sees exactly the same batches.

The optimizer lives in :mod:`cem_jax.optim`, the loss, state and jitted steps in
:mod:`cem_jax.steps`; this module only runs them: :func:`_start_up` checks and builds
everything (a :class:`Run`), :class:`_Loop` holds the state that changes step by step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time

if __name__ == "__main__":
  # Run as a program this module imported its dependencies and ended with status 0, nothing
  # trained, which reads as a finished run: the program is cem_jax.main. Before jax's import
  # (seconds), so the mistake costs none.
  sys.exit("error: cem_jax.train is the training loop, not a program: train with "
           "python -m cem_jax.main --config=FILE --workdir=DIR (README, 'Run a config')")

import jax
import ml_collections
import numpy as np
from absl import logging

from cem_jax import axes, energies, errors, memory, preflight, runs, signals
from cem_jax import config as config_lib
from cem_jax import data as data_lib
from cem_jax import sharding as sharding_lib
from cem_jax import steps as steps_lib
from cem_jax import workdir as workdir_lib
from cem_jax.checkpoint import Checkpointer
from cem_jax.distributed import sync_processes
from cem_jax.files import atomic_write_json
from cem_jax.metrics import MetricsWriter, read_metrics, tensorboard_dir
from cem_jax.model_stats import count_params, flops_per_token, peak_flops
from cem_jax.optim import make_optimizer
from cem_jax.profiling import StepProfiler, step_marker
from cem_jax.version import NUMERICS_VERSION


def _format_eta(seconds: float) -> str:
  """``seconds`` as ``H:MM:SS`` (whole seconds; a negative estimate reads ``0:00:00``)."""
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def data_parallel_devices(config: ml_collections.ConfigDict,
                          device_count: int | None = None) -> int:
  """Devices the global batch is split over (``mesh.data × mesh.fsdp`` under the default rules)
  of ``device_count`` devices (default: all processes' ``jax.device_count()``; ``aot`` passes
  a target's); checks the mesh first (:func:`axes.check_config`).

  ``mesh.data = -1`` takes the devices left over by ``mesh.fsdp × mesh.tensor``.

  Raises:
    ValueError: one line naming the field, the value and what is allowed: mesh sizes that do
      not multiply to the device count; ``train.batch_size`` or ``eval.batch_size`` not
      divisible by the data-parallel devices; ``mesh.tensor`` (or ``mesh.fsdp``) not dividing
      ``model.num_heads``, ``model.mlp_dim`` (``model.d_model``).
  """
  count = jax.device_count() if device_count is None else device_count
  return axes.data_parallel_size(config.mesh, axes.check_config(config, count))


# The schedule passing over the training tokens this many times or more gets a warning: from the
# second pass on the model can fit the training text itself, and held-out loss may rise.
EPOCHS_WARNING = 2.0

_clock = time.perf_counter  # seconds, for train/tokens_per_sec and the ETA (a test replaces it)


def epochs(config: ml_collections.ConfigDict, train_windows: int) -> float:
  """Passes of the schedule over the training windows: ``num_steps × batch_size / windows``."""
  return config.train.num_steps * config.train.batch_size / max(train_windows, 1)


def _finite(value) -> bool:
  return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def best_eval(evals: list[dict]) -> dict:
  """``eval/best_loss``, ``eval/best_bits_per_byte`` and ``eval/best_step`` (its step) of the
  eval line with the lowest finite ``eval/loss``, the earliest such line on a tie (e.g. two
  evals with only skipped steps between them); ``{}`` without such a line. The running loop
  keeps its best with this function too, so a resumed run names the same best step.

  Non-finite values (a live ``nan``, or the ``null`` that ``metrics.jsonl`` stores for one) are
  never the best: ``x < nan`` is always false, so a NaN once best would stay best, and
  ``best_eval.json`` would hold a ``NaN`` that is not JSON."""
  evals = [m for m in evals if _finite(m.get("eval/loss")) and _finite(m.get("eval/bits_per_byte"))]
  if not evals:
    return {}
  best = min(evals, key=lambda m: (m["eval/loss"], m["step"]))
  return {"eval/best_loss": best["eval/loss"],
          "eval/best_bits_per_byte": best["eval/bits_per_byte"], "eval/best_step": best["step"]}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains ``config`` in ``workdir``, resuming from its newest intact checkpoint; a fresh
  start with ``checkpoint.load_parameters_from`` set takes another run's parameters and starts
  its optimizer, step, schedule and data order afresh (:func:`cem_jax.runs.open_parameters_source`).

  Start-up checks everything (config, devices, workdir, data, checkpoint) before it writes
  ``workdir/config.json`` or ``metrics.jsonl``; if it (or opening those) fails, the checkpoints
  are closed and, if ``workdir`` did not exist before, it is removed again, so no failed start
  looks like a run.

  Writes ``workdir/config.json`` (resolved config), ``workdir/metrics.jsonl`` (train lines every
  ``train.log_every_steps``, eval lines every ``train.eval_every_steps`` and at the end; on
  resume, lines after the restored step are dropped first) and ``workdir/checkpoints/``
  (every ``checkpoint.every_steps``, at the end and on SIGTERM; see :mod:`cem_jax.checkpoint`).

  A checkpoint holds params, optimizer state and metadata (step, data position, seed, resolved
  config, the sha256 of the tokenizer and token streams: a resume on other data is refused).
  The data position *is* the step (batches are a pure function of the step) and the
  seed only matters at initialisation (there is no dropout or other randomness in training),
  so a resumed run continues exactly as an uninterrupted one.

  SIGTERM (preemption) is honoured at the next step boundary: save, wait for the save, return;
  after the last step it lets the last save commit. During start-up (single process), which
  has nothing to save, it raises :class:`cem_jax.cli.Terminated` after the clean-up of a failed
  start (``main``: one line, then the process ends by SIGTERM).

  It logs (and writes as ``data/epochs`` in the step-0 line) how many times the schedule passes
  over the training windows, with a warning from :data:`EPOCHS_WARNING` passes on, and keeps the
  best eval beside the last: ``eval/best_*`` in every eval line and ``workdir/best_eval.json``.

  Returns:
    The last eval metrics (``eval/loss`` etc.) with the best so far (``eval/best_loss``,
    ``eval/best_bits_per_byte``, ``eval/best_step``); ``{}`` if preempted before any eval.

  Raises:
    ValueError: another run training in ``workdir`` (:func:`cem_jax.workdir.exclusive`);
      invalid config, data, devices, workdir or checkpoint (one line naming the
      field/file, the value and the fix; :class:`cem_jax.checkpoint.CheckpointError` for
      checkpoints that are all damaged or do not fit the model); a checkpoint trained on other
      data or as another model (a ``model.*`` key changed, other than
      :data:`cem_jax.config.RESUME_MAY_CHANGE`, or a user energy's file edited);
      ``metrics.jsonl`` damaged before its last line (see :func:`cem_jax.metrics.read_metrics`);
      a ``checkpoint.load_parameters_from`` that cannot be this run's parameters (as
      :func:`cem_jax.runs.open_parameters_source`, :func:`cem_jax.runs.check_source_tokenizer`).
    FloatingPointError: ``train.max_consecutive_nonfinite`` consecutive non-finite steps (or
      non-finite parameters at a save); nothing from those steps is saved.
  """
  # SIGTERM: during start-up, which has nothing to save, it stops it at once (cleaned up like
  # any failed start); from the loop on it is the flag the loop saves at.
  with contextlib.ExitStack() as held, workdir_lib.Preemption() as preemption:
    run = _start_up(config, workdir, held)  # held: the workdir, for this run alone
    try:
      loop = _Loop(run)
    except BaseException:
      _undo_start(run.ckpt, workdir, run.created)
      raise
    try:
      preemption.loop_starts()
      for step in range(run.start_step, loop.num_steps):
        if loop.step(step, preemption):
          break
      # Still under the SIGTERM flag: a SIGTERM now lets the last save (asynchronous) commit
      # and the run end with status 0, instead of killing it with that save half written.
      loop.close()
    except BaseException:
      loop.abort()
      # A SIGTERM landing after the loop's set-up but before loop_starts took it as the flag
      # is a cli.Terminated whose line says a new workdir is removed: it was left as a run.
      if preemption.starting and run.created:
        workdir_lib.remove_failed_start(workdir, run.created)
      raise
    return loop.last_eval


@dataclasses.dataclass
class Run:
  """What :func:`_start_up` checked and built: everything the loop needs, nothing it changes.

  ``params`` and ``opt_state`` are the restored ones on resume (else freshly initialised,
  ``params`` replaced by the source's with ``checkpoint.load_parameters_from``);
  ``resume`` is the restored checkpoint's step (None for a fresh start) and ``meta`` its
  metadata; ``start_step`` the first step to run (0 or ``resume``); ``created`` the folders this
  start made, deepest first (``workdir`` and those above it; removed again if the start fails;
  empty if ``workdir`` was there); ``energies`` the user
  energies' source digests (:func:`cem_jax.energies.energy_digests`), saved with
  every checkpoint; ``parameters_from`` where the parameters started from
  (``checkpoint.load_parameters_from``: :attr:`cem_jax.runs.CheckpointMeta.parameters_from`,
  the source's record at a fresh start, the checkpoint's on resume), saved with every
  checkpoint.
  """

  config: ml_collections.ConfigDict
  workdir: str
  data: object
  tx: object
  schedule: object
  graphdef: object
  params: object
  opt_state: object
  shardings: steps_lib.StateShardings
  model: object
  ckpt: Checkpointer
  start_step: int = 0
  resume: int | None = None
  meta: runs.CheckpointMeta | None = None
  created: tuple[str, ...] = ()
  energies: dict = dataclasses.field(default_factory=dict)
  parameters_from: dict | None = None


def _start_up(config: ml_collections.ConfigDict, workdir: str,
              held: contextlib.ExitStack) -> Run:
  """Validates ``config`` and the devices, prepares ``workdir``, checks the newest intact
  checkpoint's numerics version and model (before anything is built: a refused resume costs
  seconds, not a data build and a model's initialisation), builds the data, the optimizer and
  the sharded state, checks the checkpoint's data and restores it. Without a checkpoint, with
  ``checkpoint.load_parameters_from`` set, the source's step, model and vocabulary are checked
  before the data are built, its tokenizer after, both before anything compiles, and its
  parameters replace the initialised ones (:func:`_load_parameters`).

  Nothing is written to ``workdir`` but the data it prepares (removed again if the checkpoint
  or the source refuses them); if anything fails and ``workdir`` did not exist before, it is
  removed again but for the prepared tokens in ``WORKDIR/data``, and so are the empty folders
  above it that this start made (:func:`_undo_start`).
  ``workdir`` is held for this run (:func:`cem_jax.workdir.exclusive`) until ``held`` closes.

  Raises:
    ValueError: as :func:`train_and_evaluate`.
  """
  _check_before_start(config)
  created = _claim_workdir(config, workdir, held)
  prepared = workdir_lib.prepared_folders(workdir)
  ckpt = source = None
  try:
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                        every_steps=config.checkpoint.every_steps,
                        async_save=config.checkpoint.async_save)
    resume = ckpt.restorable_step()
    energies_now = energies.energy_digests(config)
    # Checked before the data and the model are built: a refusal would otherwise come after
    # reading or preparing the data (minutes at corpus scale) and initialising, for nothing.
    saved = None if resume is None else _checked_meta(ckpt, resume, config, energies_now)
    # A fresh start only: a fine-tune preempted after its first save resumes its own step.
    if resume is None and config.checkpoint.load_parameters_from:
      source = runs.open_parameters_source(config, workdir)
    data = workdir_lib.build_data_once(config, workdir)
    if source is not None:  # before anything compiles
      runs.check_source_tokenizer(source, data, workdir, prepared)
    tx, schedule = make_optimizer(config.train)
    graphdef, params, opt_state, shardings, model = steps_lib.init_state(
        config, data.tokenizer.vocab_size, tx)
    run = Run(config=config, workdir=workdir, data=data, tx=tx, schedule=schedule,
              graphdef=graphdef, params=params, opt_state=opt_state, shardings=shardings,
              model=model, ckpt=ckpt, created=created, energies=energies_now, resume=resume)
    if resume is not None:
      _restore(run, saved, prepared)
    elif source is not None:
      _load_parameters(run, source)
  except BaseException:
    _undo_start(ckpt, workdir, created)
    raise
  finally:
    if source is not None:
      source.close()
  return run


def _check_before_start(config: ml_collections.ConfigDict) -> None:
  """What :func:`_start_up` checks before it touches the workdir: the config
  (:func:`cem_jax.preflight.check`), the mesh against the devices, the machine, the batches
  against the host's memory (:func:`_check_batches_fit`), and that the training order's
  shuffle can be imported; warns of an energy a reload could not find.

  Raises:
    ValueError, ModuleNotFoundError: as those checks (one line naming the field).
  """
  preflight.check(config)
  _warn_unreloadable(config)
  data_parallel_devices(config)
  preflight.check_machine(config)
  _check_batches_fit(config)
  data_lib.require_shuffle()


def _check_batches_fit(config: ml_collections.ConfigDict) -> None:
  """Refuses a training or eval batch whose host arrays cannot fit this machine
  (:func:`memory.check_host_batch`), or, on a CPU, whose attention scores cannot
  (:func:`memory.check_attention_scores`), before the workdir, the data or the state are made
  and before anything compiles. Only this process's rows count: the block of every global
  batch its devices hold on the run's mesh (:func:`cem_jax.sharding.process_slice`), as the
  loop reads them.

  Raises:
    ValueError: one line naming ``train.batch_size`` or ``eval.batch_size``, its value (and
      ``data.seq_len``'s), the bytes needed and the host's memory and swap.
  """
  batch = sharding_lib.batch_sharding(sharding_lib.make_mesh(config.mesh),
                                      axes.rules_from_config(config.mesh))
  local = {}
  for field, rows in (("train.batch_size", config.train.batch_size),
                      ("eval.batch_size", config.eval.batch_size)):
    _, blocks = sharding_lib.process_slice(batch, rows)
    check_batch_fits(config, field, blocks)
    local[field] = rows // blocks
  if jax.default_backend() != "cpu":  # a device's limit: compile_within_memory's check
    return
  # Before the data and the compile: the attention scores of one training microbatch, and of
  # an eval batch, which the host's memory cannot hold.
  t, seq_len = config.train, config.data.seq_len
  k = t.gradient_accumulation_steps
  memory.check_attention_scores(
      config, "train.batch_size", local["train.batch_size"], local["train.batch_size"] // k,
      f"lower data.seq_len={seq_len} or train.batch_size={t.batch_size}, or raise "
      f"train.gradient_accumulation_steps={k} (the same batch in smaller pieces)")
  memory.check_attention_scores(
      config, "eval.batch_size", local["eval.batch_size"], local["eval.batch_size"],
      f"lower data.seq_len={seq_len} or eval.batch_size={config.eval.batch_size}")


def check_batch_fits(config: ml_collections.ConfigDict, field: str, blocks: int = 1,
                     advice: str | None = None) -> None:
  """Refuses ``field``'s batch (``train.batch_size`` or ``eval.batch_size``, the latter with
  its ``target_bytes``) when this process's ``1 / blocks`` of its rows cannot fit this host's
  memory and swap (:func:`memory.check_host_batch`). ``blocks`` 1 (default): this process
  reads every row, as ``python -m cem_jax.evaluate`` does (``steps.eval_loop`` without
  shardings). ``advice``: what the refusal says to change (None: ``field`` or
  ``data.seq_len``).

  Raises:
    ValueError: one line naming ``field``, its value, the bytes needed and the host's memory
      and swap.
  """
  group, key = field.split(".")
  global_rows = config[group][key]
  row_bytes = config.data.seq_len * sum(
      v.dtype.itemsize for v in _batch_probe(field == "eval.batch_size").values())
  memory.check_host_batch(field, global_rows, global_rows // blocks, row_bytes,
                          config.data.seq_len, advice)


def _claim_workdir(config: ml_collections.ConfigDict, workdir: str,
                   held: contextlib.ExitStack) -> tuple[str, ...]:
  """Makes ``workdir`` if missing, checks that every process was given the same config and
  workdir, and holds it for this run (:func:`cem_jax.workdir.exclusive`) until ``held``
  closes. Returns the folders this start made (:func:`cem_jax.workdir.prepare_workdir`;
  removed again, still empty, if the check of the processes fails: they disagree, or a
  SIGTERM, Ctrl-C or runtime error ends the wait).

  Raises:
    ValueError: as :func:`cem_jax.workdir.prepare_workdir`,
      :func:`cem_jax.workdir.check_processes_agree` and :func:`cem_jax.workdir.exclusive`.
  """
  created = workdir_lib.prepare_workdir(workdir)
  try:
    workdir_lib.check_processes_agree(config, workdir)
  except BaseException:  # also SIGTERM or Ctrl-C while several processes wait for each other
    if created:  # nothing in it yet: as the command found it
      workdir_lib.remove_failed_start(workdir, created)
    raise
  held.enter_context(workdir_lib.exclusive(workdir))  # kept by the caller until the run ends
  return created


def _checked_meta(ckpt: Checkpointer, resume: int, config: ml_collections.ConfigDict,
                  energies_now: dict) -> runs.CheckpointMeta:
  """The metadata of checkpoint step ``resume``, checked to be that step's and to come from
  this run: the same numerics version and model (:func:`cem_jax.runs.refuse_other_run`).

  Raises:
    ValueError: damaged metadata, or a checkpoint of another run (as
      :func:`cem_jax.runs.refuse_other_run`).
  """
  saved = runs.read_meta(ckpt, resume)  # its step checked against the folder's there
  runs.refuse_other_run(saved, config, ckpt.step_dir(resume), energies_now)
  return saved


def _restore(run: Run, saved: runs.CheckpointMeta, prepared: frozenset[str] | None) -> None:
  """Restores checkpoint step ``run.resume`` into ``run`` (its params, optimizer state, meta
  and start step) after checking that it was trained on ``run.data``
  (:func:`cem_jax.runs.check_data`: if not, what ``WORKDIR/data`` gained since ``prepared``
  is removed first).

  Raises:
    ValueError, CheckpointError: as :func:`cem_jax.runs.check_data` and
      :meth:`cem_jax.checkpoint.Checkpointer.restore`.
  """
  ckpt, resume = run.ckpt, run.resume
  runs.check_data(saved, run.data, ckpt.step_dir(resume), run.workdir, prepared)
  # The target is the freshly initialised state on the current devices: the restore takes
  # its structure (optax's state types) and shardings, whatever the saving run used.
  state, _ = ckpt.restore(resume, {"params": run.params, "opt_state": run.opt_state})
  run.meta, run.params, run.opt_state = saved, state["params"], state["opt_state"]
  run.parameters_from = saved.parameters_from
  # The step Orbax saved the arrays under (its metadata's step checked against it above);
  # the data position is a function of it.
  run.start_step = resume


def _load_parameters(run: Run, source: runs.ParametersSource) -> None:
  """Replaces ``run``'s freshly initialised parameters with ``source``'s, on the same
  shardings; the optimizer state (zero moments, step count 0), the step and so the schedule
  and the data order stay those of a fresh start.

  Raises:
    ValueError, CheckpointError: as :func:`cem_jax.runs.load_parameters`.
  """
  run.params = runs.load_parameters(source, run.params)
  run.parameters_from = source.record
  logging.info("parameters from %s (step %d, checkpoint.load_parameters_from); optimizer, "
               "schedule and data order start at step 0", source.record["checkpoint"],
               source.step)


def make_steps(config: ml_collections.ConfigDict, graphdef, tx, shardings, schedule):
  """The run's jitted ``(train_step, eval_step)`` (:func:`cem_jax.steps.make_train_step`,
  :func:`cem_jax.steps.make_eval_step`) with the config's non-finite guard, gradient
  accumulation, loss blocks, eval steps and energy trace.

  Raises:
    ValueError: ``train.gradient_accumulation_steps`` not an int >= 1 (one line).
  """
  t = config.train
  train_step = steps_lib.make_train_step(graphdef, tx, t.max_consecutive_nonfinite, shardings,
                                         schedule, t.gradient_accumulation_steps,
                                         t.loss_block_size)
  eval_num_steps = None if config.eval.num_steps < 0 else config.eval.num_steps
  trace = config.eval.energy_trace and config.model.block == "cem"
  eval_step = steps_lib.make_eval_step(graphdef, eval_num_steps, trace, shardings,
                                       t.loss_block_size)
  return train_step, eval_step


def compile_steps(config: ml_collections.ConfigDict, train_step, eval_step, params, opt_state,
                  guard, batch_sharding, data_parallel: int, limit_bytes: int | None = None):
  """Compiles the training and eval steps for the calls to come (they reuse the
  compilations) and checks that each fits one device (:func:`memory.compile_within_memory`):
  a step too large is a one-line error before any step runs, and an eval step too large one
  before hours of training end at the first eval.

  Args:
    config: the run's config.
    train_step, eval_step: :func:`make_steps`'s.
    params, opt_state: the state, arrays or ``jax.ShapeDtypeStruct`` s on their shardings.
    guard: the non-finite guard (int32 ``[]``, replicated), or its ``ShapeDtypeStruct``.
    batch_sharding: the batches' sharding.
    data_parallel: the devices the batch is split over.
    limit_bytes: a device's memory; None: this machine's device's limit.
  Returns:
    ``(train_compiled, eval_compiled)``.
  Raises:
    ValueError: one line, a step that does not fit (naming what to change).
  """
  seq_len = config.data.seq_len
  train_compiled = memory.compile_within_memory(
      train_step, (params, opt_state, _batch_spec(config.train.batch_size, seq_len,
                                                  batch_sharding), guard, np.int32(0)),
      config, limit_bytes=limit_bytes, data_parallel=data_parallel)
  # The optimizer state stays on the device through an eval: counted beside the step.
  eval_compiled = compile_eval_step(
      config, eval_step, params, batch_sharding, limit_bytes=limit_bytes,
      advice=memory.eval_advice(config, data_parallel),
      resident=memory.resident_bytes(opt_state), resident_what="optimizer state")
  return train_compiled, eval_compiled


def compile_eval_step(config: ml_collections.ConfigDict, eval_step, params,
                      batch_sharding=None, *, advice: str, what: str = "the eval step",
                      **within):
  """Compiles ``eval_step(params, batch)`` for batches of ``eval.batch_size`` windows of
  ``data.seq_len`` (with ``target_bytes``, on ``batch_sharding``; None: uncommitted, as
  ``python -m cem_jax.evaluate`` feeds NumPy batches) and checks that it fits one device
  (:func:`memory.compile_within_memory`, with ``advice``, ``what`` and ``within``'s keywords:
  ``limit_bytes``, ``resident``, ``resident_what``). ``advice`` is required: the default there
  is the training step's. Returns the compiled program (``jax.stages.Compiled``), which the
  calls to come use.

  Raises:
    ValueError: one line, a step that does not fit (naming ``what`` and the advice).
  """
  batch = _batch_spec(config.eval.batch_size, config.data.seq_len, batch_sharding,
                      target_bytes=True)
  return memory.compile_within_memory(eval_step, (params, batch), config, what=what,
                                      advice=advice, **within)


def _batch_spec(rows: int, seq_len: int, sharding, *, target_bytes: bool = False) -> dict:
  """A global batch of ``[rows, seq_len]`` as ``jax.ShapeDtypeStruct`` s on ``sharding``, with
  the keys and dtypes of ``data.make_batch`` (read from it, so the ahead-of-time compiles
  cannot drift from the batches the loop feeds); ``target_bytes`` as eval batches have it."""
  return {key: jax.ShapeDtypeStruct((rows, seq_len), value.dtype, sharding=sharding)
          for key, value in _batch_probe(target_bytes).items()}


def _batch_probe(target_bytes: bool) -> dict[str, np.ndarray]:
  """A one-position batch from ``data.make_batch``: its keys and dtypes, those of every batch
  the loop feeds (``target_bytes`` as eval batches have it)."""
  return data_lib.make_batch(np.zeros((1, 2), np.int32), np.ones((1, 2), np.int32),
                             np.ones((1, 2), np.int32) if target_bytes else None)


def _warn_unreloadable(config: ml_collections.ConfigDict) -> None:
  """Says, once at start-up, that a run whose energy is a name registered in this process
  (:func:`cem_jax.energies.register`) or a function of ``__main__`` (a script's own) cannot be
  reloaded: ``evaluate`` and ``sample`` start a fresh process, where the name is unknown and
  ``__main__`` is themselves (``tables`` too, unless its table file registers the name)."""
  m = config.model
  if m.block != "cem":
    return
  for kind, used in (("attention", m.cem_attention), ("mlp", m.cem_mlp)):
    name = m[f"{kind}_energy"]
    if used and name.startswith("__main__:"):
      logging.warning("model.%s_energy=%r is a function of the program running: evaluate and "
                      "sample, programs of their own, cannot reload this run; name the energy "
                      "by its 'file.py:function' to reload it", kind, name)
    elif used and ":" not in name and not energies.get(name, kind).builtin:
      logging.warning("model.%s_energy=%r is a name registered in this process: evaluate "
                      "and sample cannot reload this run (tables only through a table file "
                      "that registers it); name the energy by its 'file.py:function' to "
                      "reload it", kind, name)


def _mfu_peak(config: ml_collections.ConfigDict) -> float | None:
  """The peak FLOP/s that ``train/mfu`` divides by: every process's devices' (the global
  batch's; :func:`cem_jax.model_stats.peak_flops`), None where it is not known (a CPU) or the
  model's FLOPs are not (a user energy: :func:`cem_jax.energies.only_builtins`), so that no
  MFU is logged rather than a wrong one."""
  peak = peak_flops(jax.devices())
  if peak and not energies.only_builtins(config.model):
    logging.info("train/mfu is not logged: a user energy's FLOPs are not modelled")
    return None
  return peak


def _throughput_units(config: ml_collections.ConfigDict, vocab_size: int
                      ) -> tuple[int, float, float | None]:
  """``(tokens_per_step, flops_per_step, peak_flops)``: what ``train/tokens_per_sec`` and
  ``train/mfu`` count a step in. ``flops_per_step`` is the model FLOPs of one training step
  (3x the forward's); ``peak_flops`` the devices' peak (:func:`_mfu_peak`), None where it or
  the model's FLOPs are not known (a CPU, a user energy): no MFU rather than a wrong one."""
  tokens_per_step = config.train.batch_size * config.data.seq_len
  flops_per_step = 3 * tokens_per_step * flops_per_token(config.model, vocab_size,
                                                         config.data.seq_len)
  return tokens_per_step, flops_per_step, _mfu_peak(config)


def _rows_of_this_process(shardings: steps_lib.StateShardings, global_rows: int
                          ) -> tuple[int, int]:
  """``(block, blocks)``: this process reads rows block ``block`` of ``blocks`` of every
  global batch of ``global_rows`` rows (:meth:`cem_jax.steps.StateShardings.process_slice`);
  logs it with the mesh."""
  block, blocks = shardings.process_slice(global_rows)
  logging.info("mesh %s over %d devices of %d processes; process %d reads rows block %d of "
               "%d of every global batch", dict(shardings.mesh.shape), jax.device_count(),
               jax.process_count(), jax.process_index(), block, blocks)
  return block, blocks


def _undo_start(ckpt: Checkpointer | None, workdir: str, created: tuple[str, ...]) -> None:
  """After a failed start: closes ``ckpt``, removes its folder if this start created it (the
  start opens it before building the data) and, if this start created ``workdir``, the rest
  and the empty folders above it this start made (``created``,
  :func:`cem_jax.workdir.remove_failed_start`). The caller re-raises the error that caused
  it."""
  try:
    if ckpt is not None:
      ckpt.close()
      if ckpt.created:  # only then is no Orbax clean-up thread listing it (Checkpointer)
        with contextlib.suppress(OSError):
          os.rmdir(ckpt.directory)
  finally:  # a close that fails too must not leave the new workdir behind
    if created:
      workdir_lib.remove_failed_start(workdir, created)


def _log_resume(run: Run, resolved: dict) -> None:
  """Logs the step resumed from and every config field that differs from the checkpoint's."""
  if run.resume is None:
    return
  changed = config_lib.changes(run.meta.config or {}, resolved, config_lib.OBSERVE_ONLY)
  logging.info("resumed from %s at step %d", run.ckpt.step_dir(run.resume), run.start_step)
  if run.config.checkpoint.load_parameters_from:
    logging.info("checkpoint.load_parameters_from=%r is ignored: the run resumes from its own "
                 "checkpoint (read at a fresh start only)",
                 run.config.checkpoint.load_parameters_from)
  if run.start_step >= run.config.train.num_steps:
    logging.info("the run is already finished (train.num_steps=%d): nothing to train; raise "
                 "train.num_steps to train on", run.config.train.num_steps)
  compute = [t for k, t in changed.items() if k in config_lib.COMPUTE_ONLY]
  if compute:  # how the step is computed, not its numbers
    logging.info("computed differently from the checkpoint's run (the same numbers up to "
                 "float rounding): %s", ", ".join(compute))
  other = [t for k, t in changed.items() if k not in config_lib.COMPUTE_ONLY]
  if other:
    logging.warning("config differs from the checkpoint's: %s", ", ".join(other))


def _open_metrics(run: Run, resolved: dict, is_main: bool) -> tuple[MetricsWriter, dict, dict]:
  """Writes ``config.json`` and opens ``metrics.jsonl`` (the step-0 line on a fresh start);
  logs the schedule (:func:`_log_schedule`); rewrites ``best_eval.json`` from the eval lines
  kept (removed when none), so that it names no eval past the restored step. Returns
  ``(writer, best, last_eval)``: the best
  eval kept on resume, and the last one if the run is already finished (else ``{}``); the
  writer is closed if this fails. A finished run re-run trains nothing: its ``config.json``
  stays the one it trained with, no TensorBoard event file is added and no schedule logged.

  Raises:
    ValueError: ``metrics.jsonl`` is damaged before its last line (see :class:`MetricsWriter`).
  """
  done_before = run.start_step >= run.config.train.num_steps
  # SIGTERM held too where workdir.Preemption's handler has it (one process), which raises in
  # start-up, now; with several, JAX's preemption notifier has it, below Python's handler.
  hold = (signal.SIGINT, signal.SIGTERM) if jax.process_count() == 1 else (signal.SIGINT,)
  # A run killed before its first checkpoint starts over: drop its step-0 line too. First, so
  # that a damaged metrics.jsonl is refused before config.json is rewritten.
  writer = MetricsWriter(run.workdir, enabled=is_main,
                         truncate_after_step=run.start_step if run.start_step > 0 else -1,
                         tensorboard=not done_before, hold=hold)
  try:
    if is_main and not done_before:
      atomic_write_json(os.path.join(run.workdir, "config.json"), resolved, sort_keys=True)
    config, workdir, data = run.config, run.workdir, run.data
    passes = epochs(config, data.stats()["train_windows"])
    if run.start_step == 0:
      stats = {f"data/{k}": v for k, v in data.stats().items()}
      writer.write(0, {"params/total": count_params(run.model), **stats, "data/epochs": passes,
                       "numerics_version": NUMERICS_VERSION})
    if not done_before:
      _log_schedule(config.train, data.stats()["train_windows"], passes, is_main)
    # On resume: the eval lines kept (those up to the restored step) hold the best so far.
    resumed_metrics = is_main and run.start_step > 0 and os.path.exists(writer.path)
    best = best_eval(read_metrics(workdir)) if resumed_metrics else {}
    if is_main and not done_before:
      # best_eval.json may name an eval past the restored step (written before a kill, or
      # before a damaged newer checkpoint was set aside): that eval never happened now.
      _write_best_eval(workdir, best)
    # Read after the writer dropped the lines past the restored step: those never happened.
    last_eval = workdir_lib.last_eval_in(workdir) if done_before else {}
  except BaseException:
    writer.close()
    raise
  return writer, best, last_eval


def _write_best_eval(workdir: str, best: dict) -> None:
  """Replaces ``workdir/best_eval.json`` with ``best`` (:func:`best_eval`'s), whole; removes it
  when ``best`` is ``{}`` (no finite eval kept)."""
  path = os.path.join(workdir, "best_eval.json")
  if best:
    atomic_write_json(path, best, sort_keys=True)
  else:
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)


def _log_schedule(t: ml_collections.ConfigDict, train_windows: int, passes: float,
                  is_main: bool) -> None:
  """Logs how many times the schedule of ``t`` (``config.train``) passes over the
  ``train_windows``, warns (on process 0) from :data:`EPOCHS_WARNING` passes on and of a
  warm-up longer than the run."""
  logging.info("the schedule passes over the %d training windows %.2f times (epochs)",
               train_windows, passes)
  if passes >= EPOCHS_WARNING and is_main:
    logging.warning(
        "train.num_steps=%d x train.batch_size=%d passes over the %d training windows %.1f "
        "times: held-out loss may rise after the first epochs (eval/best_* keeps the best "
        "eval); use more data or fewer steps", t.num_steps, t.batch_size, train_windows,
        passes)
  if t.warmup_steps > t.num_steps and is_main:
    logging.warning(
        "train.warmup_steps=%d > train.num_steps=%d: the learning rate never reaches "
        "train.learning_rate=%g (at most %g); lower train.warmup_steps for a short run",
        t.warmup_steps, t.num_steps, t.learning_rate,
        t.learning_rate * t.num_steps / max(t.warmup_steps, 1))


class _Loop:
  """The state that changes from step to step (params, optimizer state, the non-finite guard,
  the last checkpoint saved, the best eval, the log timer) and what the loop does with it."""

  def __init__(self, run: Run):
    self.run = run
    config = run.config
    self.params, self.opt_state = run.params, run.opt_state
    self.is_main = jax.process_index() == 0
    self.resolved = config.to_dict()
    cfg_t = config.train
    self.max_bad = cfg_t.max_consecutive_nonfinite
    self.train_step, self.eval_step = make_steps(config, run.graphdef, run.tx, run.shardings,
                                                 run.schedule)
    self.num_steps = cfg_t.num_steps
    self.global_rows = cfg_t.batch_size
    self.tokens_per_step, self.flops_per_step, self.peak_flops = _throughput_units(
        config, run.data.tokenizer.vocab_size)
    self.block, self.blocks = _rows_of_this_process(run.shardings, self.global_rows)
    self.guard = jax.make_array_from_process_local_data(run.shardings.replicated,
                                                        np.zeros((), np.int32))
    self._compile_ahead()
    self.last_saved = run.resume
    _log_resume(run, self.resolved)
    self.profiler = StepProfiler(tensorboard_dir(run.workdir), cfg_t.profile_first_step,
                                 cfg_t.profile_steps, run.start_step, trace=self.is_main)
    self.done = run.start_step  # the last step run
    # Last: the writer is the only thing here to close, and nothing after it can fail.
    self.writer, self.best, self.last_eval = _open_metrics(run, self.resolved, self.is_main)
    self.t_start = self.t_log = _clock()
    self.step_at_log = run.start_step
    self.paused = 0.0  # seconds of evals and saves since the last log: not training time
    self.save_left = False  # a save the user stopped waiting for (leaving_the_save)

  def _compile_ahead(self) -> None:
    """Compiles the steps now, for the shapes and shardings of the calls to come (they reuse
    them): a step too large for the device is a one-line error before any step runs, and an
    eval step too large one before hours of training end at the first eval. A finished run
    (re-run to find its last checkpoint) runs neither: nothing to compile.

    Raises:
      ValueError: as :func:`compile_steps`.
    """
    run = self.run
    if run.start_step < run.config.train.num_steps:
      compile_steps(run.config, self.train_step, self.eval_step, self.params, self.opt_state,
                    self.guard, run.shardings.batch, data_parallel_devices(run.config))

  def step(self, step: int, preemption: workdir_lib.Preemption) -> bool:
    """Runs step ``step`` (0-based) with its log, eval and save; True if preempted (saved)."""
    run, cfg_t = self.run, self.run.config.train
    done = step + 1
    if self.profiler.starts_at(done):
      with self.off_the_clock():  # the steps and checkpoint writes before it stay out of it
        self.wait_for_save()
        self.profiler.start()
    batch = run.shardings.global_batch(run.data.train.batch(step, self.block, self.blocks),
                                       self.global_rows)
    with step_marker(done):
      self.params, self.opt_state, m = self.train_step(self.params, self.opt_state, batch,
                                                       self.guard, np.int32(done))
    self.guard = m["nonfinite_guard"]
    self.done = done
    if done % cfg_t.log_every_steps == 0 or done == self.num_steps:
      self.log(done, m)
    if done % cfg_t.eval_every_steps == 0 or done == self.num_steps:
      with self.off_the_clock():
        self.eval(done)
    preempted = preemption.requested or (
        jax.process_count() > 1 and run.ckpt.manager.reached_preemption(done))
    if preempted or done == self.num_steps or run.ckpt.should_save(done):
      with self.off_the_clock():
        self.save(done, force=preempted or done == self.num_steps)
    if preempted:
      self.wait_for_save()
      if done == self.num_steps:  # a rerun would only say so: there is nothing to resume
        logging.warning("preempted (SIGTERM) in the last step: saved the final step %d in %s; "
                        "the run is finished", done, run.ckpt.directory)
      else:
        logging.warning("preempted (SIGTERM): saved step %d in %s; rerun the same command to "
                        "resume", done, run.ckpt.directory)
    # Last, after the step's eval and save (in the trace; a preemption's save is committed
    # before the seconds of writing a trace).
    if self.profiler.stops_at(done):
      with self.off_the_clock():  # waits for the traced steps: their device work is in it
        self.profiler.stop(done)
        sync_processes("cem_jax.profile")  # the others wait for process 0's writing here
    return preempted

  @contextlib.contextmanager
  def off_the_clock(self):
    """Leaves the time of the block (an eval, a save) out of ``train/tokens_per_sec``. The
    steps queued before it (jax dispatches them asynchronously) finish first, on the clock:
    they are training time, which the block would otherwise wait for on its own clock."""
    jax.block_until_ready(self.params)
    t0 = _clock()
    try:
      yield
    finally:
      self.paused += _clock() - t0

  def saved_text(self) -> str:
    """The last checkpoint saved, as the non-finite errors name it (what a rerun resumes)."""
    if self.last_saved is None:
      return "no checkpoint saved"
    return f"last checkpoint: step {self.last_saved}"

  def check_guard(self) -> None:
    """Raises FloatingPointError if the device-side guard saw a run of non-finite steps."""
    hit, max_bad = int(jax.device_get(self.guard)), self.max_bad
    if hit:
      raise FloatingPointError(
          f"non-finite loss or gradient in {max_bad} consecutive steps, steps "
          f"{hit - max_bad + 1}..{hit} (train.max_consecutive_nonfinite={max_bad}); "
          f"{self.saved_text()}; lower train.learning_rate or raise train.warmup_steps"
      )

  def log(self, done: int, m: dict) -> None:
    """Writes the train metrics line of step ``done`` and logs progress."""
    self.check_guard()
    m = jax.device_get(m)  # waits for the step: the interval ends when its work does
    now = _clock()
    seconds = max(now - self.t_log - self.paused, 1e-9)
    steps_per_s = (done - self.step_at_log) / seconds
    line = {
        "train/loss": float(m["loss"]),
        "train/grad_norm": float(m["grad_norm"]),
        "train/learning_rate": float(m["learning_rate"]),
        "train/tokens_per_sec": steps_per_s * self.tokens_per_step,
        "train/nonfinite_steps": int(m["nonfinite_total"]),
    }
    mfu = ""
    if self.peak_flops:
      line["train/mfu"] = steps_per_s * self.flops_per_step / self.peak_flops
      mfu = f"  MFU {100 * line['train/mfu']:.1f}%"
    self.writer.write(done, line)
    eta = ((now - self.t_start) / max(done - self.run.start_step, 1)
           * (self.num_steps - done))
    logging.info("step %d/%d  loss %.4f  %.0f tok/s%s  ETA %s", done, self.num_steps,
                 float(m["loss"]), line["train/tokens_per_sec"], mfu, _format_eta(eta))
    self.t_log, self.step_at_log, self.paused = now, done, 0.0

  def eval(self, done: int) -> None:
    """Evaluates at step ``done``; updates the best eval and writes both."""
    run = self.run
    last_eval = steps_lib.eval_loop(self.eval_step, self.params, run.data, run.config,
                                    run.shardings)
    before = [{"step": self.best["eval/best_step"], "eval/loss": self.best["eval/best_loss"],
               "eval/bits_per_byte": self.best["eval/best_bits_per_byte"]}] if self.best else []
    self.best = best_eval([*before, {**last_eval, "step": done}])  # NaN: never the best
    self.last_eval = {**last_eval, **self.best}
    self.writer.write(done, self.last_eval)
    if self.is_main:
      _write_best_eval(run.workdir, self.best)
    logging.info("eval at step %d: loss %.4f  ppl %.2f  bits/byte %.4f", done,
                 self.last_eval["eval/loss"], self.last_eval["eval/perplexity"],
                 self.last_eval["eval/bits_per_byte"])

  def save(self, done: int, force: bool) -> None:
    """Saves step ``done`` if it is due (or ``force``) after checking it is finite."""
    self.check_guard()
    state = {"params": self.params, "opt_state": self.opt_state}
    if not bool(jax.device_get(steps_lib.all_finite(state))):
      raise FloatingPointError(
          f"non-finite parameters or optimizer state at step {done}, not saved; "
          f"{self.saved_text()}; lower train.learning_rate"
      )
    meta = runs.CheckpointMeta.saved_now(done, self.run.config.seed, self.resolved,
                                         self.run.data.identity, self.run.energies,
                                         self.run.parameters_from).to_dict()
    self.writer.sync()  # first: no checkpoint of step done without its lines on the disk
    with signals.held(), self.leaving_the_save():
      saved = self.run.ckpt.save(done, state, meta, force=force)
    if saved:
      self.last_saved = done

  def wait_for_save(self, close: bool = False) -> None:
    """Waits for the pending save (and, ``close``, closes the checkpoints), with Ctrl-C held
    until then (:func:`cem_jax.signals.held`; a second one at once). Landing inside
    Orbax's wait, a Ctrl-C was reported as the save failing ("Save Finalize thread ...
    failed", with a traceback), and Orbax forgot the step it was committing."""
    with signals.held(), self.leaving_the_save():
      if close:
        self.run.ckpt.close()
      else:
        self.run.ckpt.wait()

  @contextlib.contextmanager
  def leaving_the_save(self):
    """A signal's exception out of the block's wait for a pending save (the second Ctrl-C, the
    way out of a save that hangs: the first is held) marks the save left (``save_left``):
    :meth:`abort` does not wait for it again."""
    try:
      yield
    except Exception:
      raise
    except BaseException:
      self.save_left = True
      raise

  def abort(self) -> None:
    """On an error: saves already started passed the checks, so let them commit first (not a
    save a second Ctrl-C left, :meth:`leaving_the_save`); a trace in progress is written (it
    may show why)."""
    self.profiler.stop(self.done)  # never raises: a trace it cannot write is logged
    # The original error matters more: what these raise (the same full disk, say) is one line
    # each, not a traceback through Orbax's threads, and does not replace it.
    try:
      if self.save_left:  # waiting again would need a third Ctrl-C
        logging.warning("checkpoint save left unfinished by a second Ctrl-C: a rerun resumes "
                        "from the newest step intact in %s", self.run.ckpt.directory)
      else:
        self.run.ckpt.close()
    except Exception as e:  # noqa: BLE001
      logging.error("could not finish the pending checkpoint save: %s", errors.one_line(e))
    finally:  # also after a second Ctrl-C, the way out of a save that hangs
      try:
        self.writer.close()
      except Exception as e:  # noqa: BLE001
        # The writer closes metrics.jsonl and TensorBoard's events: its error names the one.
        logging.error("could not close the metrics of %s: %s", os.path.dirname(self.writer.path),
                      errors.one_line(e))

  def close(self) -> None:
    """After the last step: the trace, the pending save and the metrics finish, in order."""
    self.profiler.stop(self.done)  # a run preempted inside the window
    self.wait_for_save(close=True)
    self.writer.close()
