"""The training loop: state, jitted step, periodic eval, metrics and checkpoints.

One clear path (nanodo-style): build data → build the mesh → initialise ``params`` (sharded, by
``jax.jit`` with ``out_shardings``) and split off the ``graphdef`` → ``jax.jit`` a pure train
step over ``(params, opt_state, batch)`` with in/out shardings and donation → evaluate, log and
checkpoint at step boundaries. One process or many (``jax.distributed``): every process runs
this same loop on global ``jax.Array``s and feeds only its own rows of each batch. The data
order is a pure function of the step, so the checkpointed step *is* the data position and a
resumed run sees exactly the same batches.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from cem_jax import config as config_lib
from cem_jax import data as data_lib
from cem_jax import sharding as sharding_lib
from cem_jax.checkpoint import Checkpointer
from cem_jax.files import atomic_write_json
from cem_jax.layers import DECAYED_PARAM_NAMES
from cem_jax.metrics import MetricsWriter, read_metrics
from cem_jax.model import DecoderLM, count_params
from cem_jax.version import NUMERICS_VERSION

# ---------------------------------------------------------------------------------------------
# Optimizer


def _param_name(path) -> str:
  """The variable's own name: the last dict/attribute key of its path (not ``value``)."""
  names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
  names = [n for n in names if n and n != "value"]
  return names[-1] if names else ""


def decay_mask(params):
  """True for parameters weight decay applies to: chosen by *name*, never by rank."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: _param_name(path) in DECAYED_PARAM_NAMES, params
  )


def make_schedule(cfg: ml_collections.ConfigDict):
  """The learning rate of each update: ``schedule(count)`` for the update made after ``count``
  applied updates (optax's count, 0 for the first).

  Update ``k = count + 1`` uses ``peak * k / warmup_steps`` while ``k <= warmup_steps`` (so the
  first update already moves the weights, and update ``warmup_steps`` uses the peak
  ``train.learning_rate``), then a cosine decay reaching ``peak * min_learning_rate_ratio`` at
  update ``train.num_steps``. ``warmup_steps = 0``: the cosine from the first update.
  """
  base = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=cfg.learning_rate,
      warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.num_steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.min_learning_rate_ratio,
  )
  # optax's schedule gives init_value (0) at count 0: shift by one so update k gets base(k).
  return lambda count: base(count + 1)


def applied_updates(opt_state) -> jax.Array:
  """Updates applied so far (int32 ``[]``): the count of the learning-rate schedule's state,
  which a skipped non-finite update (``optax.apply_if_finite``) does not advance."""
  is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
  states = [x for x in jax.tree.leaves(opt_state, is_leaf=is_sched) if is_sched(x)]
  if len(states) != 1:
    raise ValueError(f"expected one learning-rate schedule in the optimizer state, found "
                     f"{len(states)}; build the optimizer with make_optimizer")
  return states[0].count


def make_optimizer(cfg: ml_collections.ConfigDict):
  """AdamW with global-norm clipping; updates with a non-finite gradient are skipped.

  Returns ``(tx, schedule)``. ``optax.apply_if_finite`` keeps the parameters unchanged on a
  NaN/Inf gradient and counts it; the loop stops after ``train.max_consecutive_nonfinite``.
  """
  schedule = make_schedule(cfg)
  inner = optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                  mask=decay_mask),
  )
  # apply_if_finite would let updates through after this many in a row; the loop stops first.
  return optax.apply_if_finite(inner, cfg.max_consecutive_nonfinite + 1), schedule


# ---------------------------------------------------------------------------------------------
# Loss


def weighted_cross_entropy(logits, targets, weights):
  """Sum of ``-log p(target)`` over weighted positions, and the sum of weights.

  Args:
    logits: ``[batch, seq_len, vocab_size]`` float32.
    targets: ``[batch, seq_len]`` int.
    weights: ``[batch, seq_len]`` float32 (0 for targets across a document boundary or padding).
  Returns:
    ``(loss_sum, weight_sum)``, float32 scalars, loss in nats.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * weights), jnp.sum(weights)


# ---------------------------------------------------------------------------------------------
# Sharded state


@dataclasses.dataclass(frozen=True)
class StateShardings:
  """Where everything lives on the mesh.

  Attributes:
    mesh: the ``('data', 'fsdp', 'tensor')`` mesh of all processes' devices.
    params: ``NamedSharding`` per Param (a prefix tree of the params ``nnx.State``).
    opt_state: the same for the optimizer state (moments like their params, counts replicated).
    batch: ``[batch, seq_len]`` arrays, rows over the data-parallel axes.
    replicated: scalars (metrics, the non-finite guard).
  """

  mesh: jax.sharding.Mesh
  params: object
  opt_state: object
  batch: jax.sharding.NamedSharding
  replicated: jax.sharding.NamedSharding

  def process_slice(self, global_rows: int) -> tuple[int, int]:
    """``(index, count)``: this process reads block ``index`` of ``count`` of every batch."""
    return sharding_lib.process_slice(self.batch, global_rows)

  def global_batch(self, local: dict, global_rows: int) -> dict:
    """This process's rows → global arrays ``[global_rows, seq_len]`` on the mesh."""
    return sharding_lib.global_batch(local, self.batch, global_rows)


def init_state(config: ml_collections.ConfigDict, vocab_size: int, tx, mesh=None):
  """Initialises params and optimizer state directly in their shards on ``mesh``.

  The model is built inside ``jax.jit`` with ``out_shardings`` (its shapes come from
  ``nnx.eval_shape``), so no process ever holds a full copy: each device computes only its
  shards. The values are :func:`build_model`'s for any mesh (same seed, same random bits; the
  compiled arithmetic may differ in the last bit: ≤ 1e-8 measured).

  Args:
    config: resolved config (``model``, ``seed``, ``mesh.rules``).
    vocab_size: the tokenizer's vocabulary size.
    tx: the optax optimizer (:func:`make_optimizer`).
    mesh: default ``sharding.make_mesh(config.mesh)`` over all processes' devices.
  Returns:
    ``(graphdef, params, opt_state, shardings, abstract_model)``: ``params`` an ``nnx.State``
    of Params, ``shardings`` a :class:`StateShardings`.
  Raises:
    ValueError: a mesh that does not fit the devices, or bad ``mesh.rules``.
  """
  mesh = sharding_lib.make_mesh(config.mesh) if mesh is None else mesh
  rules = sharding_lib.rules_from_config(config.mesh)
  abstract_model = nnx.eval_shape(lambda: build_model(config, vocab_size))
  graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
  param_sh = sharding_lib.param_shardings(abstract_params, mesh, rules)
  params = jax.jit(lambda: nnx.state(build_model(config, vocab_size), nnx.Param),
                   out_shardings=param_sh)()
  opt_sh = sharding_lib.opt_state_shardings(tx, jax.eval_shape(tx.init, abstract_params),
                                            param_sh, mesh)
  opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
  shardings = StateShardings(mesh=mesh, params=param_sh, opt_state=opt_sh,
                             batch=sharding_lib.batch_sharding(mesh, rules),
                             replicated=sharding_lib.replicated(mesh))
  return graphdef, params, opt_state, shardings, abstract_model


# ---------------------------------------------------------------------------------------------
# Steps


def make_train_step(graphdef, tx, max_consecutive_nonfinite: int | None = None,
                    shardings: StateShardings | None = None, schedule=None):
  """Returns the jitted ``step(params, opt_state, batch, guard=0, done=0) -> (params, opt_state,
  metrics)``; ``params`` and ``opt_state`` are donated.

  With ``shardings`` the step is compiled for them (params and optimizer state stay sharded
  as given, the batch is split over its data-parallel axes, the metrics are replicated);
  without, for the inputs' own placement (one device).

  ``metrics``: ``loss`` (nats/token), ``grad_norm``, ``nonfinite_total`` (skipped updates so
  far, optax's count), ``nonfinite_consecutive``, ``nonfinite_guard`` and, with ``schedule``
  (:func:`make_optimizer`'s), ``learning_rate``: the rate of this update, ``schedule`` at the
  updates applied before it (a skipped update does not count, so after one the rate is not a
  step ahead; on the skipped step itself it is the rate that was not applied).

  The guard (int32 ``[]``): pass the previous step's ``metrics["nonfinite_guard"]`` as ``guard``
  and this update's step number (the ``step`` of its metrics line) as ``done``. It becomes the
  first ``done`` at which ``max_consecutive_nonfinite`` updates in a row had a non-finite loss
  or gradient, and then stays; 0 = never (and always 0 when ``max_consecutive_nonfinite`` is
  None). It lives on the device so the loop need not fetch anything every step (that would
  stall asynchronous dispatch) yet cannot miss a run of failures that ended between checks.
  """

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    logits = model(batch["inputs"], batch["segment_ids"])
    loss_sum, weight_sum = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    return loss_sum / jnp.maximum(weight_sum, 1.0)

  jit_kwargs = {}
  if shardings is not None:
    s = shardings
    jit_kwargs = {"in_shardings": (s.params, s.opt_state, s.batch, s.replicated, s.replicated),
                  "out_shardings": (s.params, s.opt_state, s.replicated)}

  @functools.partial(jax.jit, donate_argnums=(0, 1), **jit_kwargs)
  def step(params, opt_state, batch, guard=0, done=0):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    lr = None if schedule is None else schedule(applied_updates(opt_state))
    # A NaN/Inf loss or gradient: apply_if_finite (make_optimizer) leaves params and moments
    # unchanged and counts it.
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    guard = jnp.asarray(guard, jnp.int32)
    if max_consecutive_nonfinite is not None:
      hit = (guard == 0) & (opt_state.notfinite_count >= max_consecutive_nonfinite)
      guard = jnp.where(hit, jnp.asarray(done, jnp.int32), guard)
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "nonfinite_total": opt_state.total_notfinite,
        "nonfinite_consecutive": opt_state.notfinite_count,
        "nonfinite_guard": guard,
    }
    if lr is not None:
      metrics["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return params, opt_state, metrics

  return step


def make_eval_step(graphdef, token_bytes: np.ndarray, num_steps: int | None,
                   energy_trace: bool = False, shardings: StateShardings | None = None):
  """Returns the jitted ``eval_step(params, batch) -> dict`` of sums over the batch.

  With ``shardings`` the batch is split over the data-parallel axes and the sums (reduced over
  every device, so over every process's rows) come back replicated.

  Keys: ``loss_sum`` (nats), ``weight_sum`` (predicted tokens), ``byte_sum`` (their UTF-8
  bytes) and, with ``energy_trace``, ``energy`` (per layer, per step: the energies before/after
  each sub-step summed over the real input tokens, see :class:`cem_jax.layers.CEMBlock`) and
  ``token_sum`` (the number of those tokens, ``segment_ids > 0``).
  ``num_steps`` overrides the recursive steps T of every CEM layer (test-time steps).
  """
  token_bytes = np.asarray(token_bytes, np.float32)  # a constant of the compiled step
  jit_kwargs = {}
  if shardings is not None:
    jit_kwargs = {"in_shardings": (shardings.params, shardings.batch),
                  "out_shardings": shardings.replicated}

  @functools.partial(jax.jit, **jit_kwargs)
  def eval_step(params, batch):
    model = nnx.merge(graphdef, params)
    outputs = model(batch["inputs"], batch["segment_ids"], num_steps=num_steps,
                    trace=energy_trace)
    logits, traces = outputs if energy_trace else (outputs, None)
    loss_sum, weight_sum = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    byte_sum = jnp.sum(jnp.asarray(token_bytes)[batch["targets"]] * batch["weights"])
    out = {"loss_sum": loss_sum, "weight_sum": weight_sum, "byte_sum": byte_sum}
    if energy_trace:
      out["energy"] = traces
      out["token_sum"] = jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32)
    return out

  return eval_step


def energy_metrics(traces) -> dict:
  """Flattens a model's energy trace into ``eval/energy/layer{l}/step{t}/{att,mlp}_{before,after}``.

  ``traces``: list over layers of lists over steps of dicts of scalars (energy per token).
  """
  out = {}
  for layer, steps in enumerate(traces):
    for t, rec in enumerate(steps):
      for key, value in rec.items():
        out[f"eval/energy/layer{layer}/step{t + 1}/{key}"] = float(value)
  return out


def evaluate(eval_step, params, data, cfg, shardings: StateShardings | None = None) -> dict:
  """Runs ``eval_step`` over the validation split; returns ``eval/...`` metrics.

  Every per-token metric is a total over all evaluated batches divided by the total count,
  never a mean of per-batch means, so none depends on ``eval.batch_size`` (or on the padding
  that fills the last batch): ``eval/loss`` is nats per predicted token, ``eval/perplexity``
  its exponential, ``eval/bits_per_byte`` the total bits over the UTF-8 bytes of the predicted
  tokens, and the energy trace (when ``eval_step`` makes it) the energy per real input token.

  With ``shardings`` (and an ``eval_step`` made with them) each process reads only its rows of
  every global eval batch; ``eval_step`` sums over all of them on the devices, so every
  process gets the same totals, equal to one process's up to float summation order.
  """
  bs = cfg.eval.batch_size
  index, count = (0, 1) if shardings is None else shardings.process_slice(bs)
  totals = {"loss_sum": 0.0, "weight_sum": 0.0, "byte_sum": 0.0}
  energy_sum, tokens = None, 0.0
  for i, batch in enumerate(data.eval_batches(bs, index, count)):
    if 0 <= cfg.eval.max_batches <= i:
      break
    if shardings is not None:
      batch = shardings.global_batch(batch, bs)
    out = jax.device_get(eval_step(params, batch))
    for k in totals:
      totals[k] += float(out[k])
    if "energy" in out:
      energy = jax.tree.map(np.float64, out["energy"])
      energy_sum = energy if energy_sum is None else jax.tree.map(
          lambda a, b: a + b, energy_sum, energy)
      tokens += float(out["token_sum"])
  loss = totals["loss_sum"] / max(totals["weight_sum"], 1.0)
  metrics = {
      "eval/loss": loss,
      "eval/perplexity": math.exp(min(loss, 80.0)),
      "eval/bits_per_byte": totals["loss_sum"] / math.log(2) / max(totals["byte_sum"], 1.0),
      "eval/tokens": int(totals["weight_sum"]),
  }
  if energy_sum is not None:
    metrics.update(energy_metrics(jax.tree.map(lambda a: a / max(tokens, 1.0), energy_sum)))
  return metrics


# ---------------------------------------------------------------------------------------------
# The loop


def build_model(config, vocab_size: int) -> DecoderLM:
  """The model of ``config.model`` with ``vocab_size`` tokens, initialised from ``config.seed``."""
  return DecoderLM(config.model, vocab_size, rngs=nnx.Rngs(params=config.seed))


def _format_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def data_parallel_devices(config: ml_collections.ConfigDict) -> int:
  """Devices the global batch is split over (``mesh.data × mesh.fsdp`` under the default rules)
  of all processes' ``jax.device_count()``; checks the mesh first (:func:`sharding.check_config`).

  ``mesh.data = -1`` takes the devices left over by ``mesh.fsdp × mesh.tensor``.

  Raises:
    ValueError: one line naming the field, the value and what is allowed: mesh sizes that do
      not multiply to the device count; ``train.batch_size`` or ``eval.batch_size`` not
      divisible by the data-parallel devices; ``mesh.tensor`` (or ``mesh.fsdp``) not dividing
      ``model.num_heads``, ``model.mlp_dim`` (``model.d_model``).
  """
  sizes = sharding_lib.check_config(config, jax.device_count())
  batch_axes = dict(sharding_lib.rules_from_config(config.mesh)).get("batch")
  names = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
  return math.prod(sizes[n] for n in names)


def _build_data_once(config: ml_collections.ConfigDict, workdir: str):
  """``data.build_data``; with several processes, process 0 first (it fills the workdir's
  tokenizer and TFDS caches, which the others then load instead of racing to write them).

  Raises:
    ValueError: as ``build_data``; on processes other than 0 also when process 0 failed.
  """
  if jax.process_count() == 1:
    return data_lib.build_data(config, workdir)
  from jax.experimental import multihost_utils

  data, error = None, None
  if jax.process_index() == 0:
    try:
      data = data_lib.build_data(config, workdir)
    except (ValueError, OSError, RuntimeError) as e:
      error = e
  # A collective every process joins, so a failure on process 0 stops the others too.
  ok = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
  if error is not None:
    raise error
  if not ok:
    raise ValueError("process 0 could not build the data (see its error); nothing trained")
  return data if data is not None else data_lib.build_data(config, workdir)


def _prepare_workdir(workdir: str) -> bool:
  """Creates ``workdir`` if needed and checks that files can be written in it.

  Returns True if this call created it (so a failed start-up can remove it again).

  Raises:
    ValueError: it cannot be created or written (one line naming ``--workdir`` and the reason).
  """
  created = not os.path.isdir(workdir)
  try:
    os.makedirs(workdir, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=workdir, prefix=".write_probe")
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise ValueError(
        f"--workdir={workdir!r} is not a writable folder ({e.strerror or e}: "
        f"{e.filename or workdir}); choose another --workdir or fix its permissions"
    ) from None
  return created


def _flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


class _Preemption:
  """Turns SIGTERM (a preemption notice) into a flag the loop checks at each step boundary.

  Only for single-process runs started from the main thread: with several processes every
  process must save at the same step, which Orbax's ``reached_preemption`` (JAX's preemption
  sync point) decides instead.
  """

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True  # nothing else: a signal handler may interrupt anything

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _last_eval(workdir: str) -> dict:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return {}
  evals = [m for m in read_metrics(workdir) if "eval/loss" in m]
  return {k: v for k, v in evals[-1].items() if k != "step"} if evals else {}


# The schedule passing over the training tokens this many times or more gets a warning: from the
# second pass on the model can fit the training text itself, and held-out loss may rise.
EPOCHS_WARNING = 2.0


def epochs(config: ml_collections.ConfigDict, train_windows: int) -> float:
  """Passes of the schedule over the training windows: ``num_steps × batch_size / windows``."""
  return config.train.num_steps * config.train.batch_size / max(train_windows, 1)


def best_eval(evals: list[dict]) -> dict:
  """``eval/best_loss``, ``eval/best_bits_per_byte`` and ``eval/best_step`` (its step) of the
  eval line with the lowest ``eval/loss``; ``{}`` without eval lines."""
  evals = [m for m in evals if "eval/loss" in m]
  if not evals:
    return {}
  best = min(evals, key=lambda m: (m["eval/loss"], m["step"]))
  return {"eval/best_loss": best["eval/loss"],
          "eval/best_bits_per_byte": best["eval/bits_per_byte"], "eval/best_step": best["step"]}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains ``config`` in ``workdir``, resuming from its newest intact checkpoint.

  Start-up checks everything (config, devices, workdir, data, checkpoint) before it writes
  ``workdir/config.json`` or ``metrics.jsonl``; if it fails and ``workdir`` did not exist
  before, ``workdir`` is removed again, so no failed start looks like a run.

  Writes ``workdir/config.json`` (resolved config), ``workdir/metrics.jsonl`` (train lines every
  ``train.log_every_steps``, eval lines every ``train.eval_every_steps`` and at the end; on
  resume, lines after the restored step are dropped first) and ``workdir/checkpoints/``
  (every ``checkpoint.every_steps``, at the end and on SIGTERM; see :mod:`cem_jax.checkpoint`).

  A checkpoint holds params, optimizer state and metadata (step, data position, seed, resolved
  config). The data position *is* the step (batches are a pure function of the step) and the
  seed only matters at initialisation (there is no dropout or other randomness in training),
  so a resumed run continues exactly as an uninterrupted one.

  SIGTERM (preemption) is honoured at the next step boundary: save, wait for the save, return.

  It logs (and writes as ``data/epochs`` in the step-0 line) how many times the schedule passes
  over the training windows, with a warning from :data:`EPOCHS_WARNING` passes on, and keeps the
  best eval beside the last: ``eval/best_*`` in every eval line and ``workdir/best_eval.json``.

  Returns:
    The last eval metrics (``eval/loss`` etc.) with the best so far (``eval/best_loss``,
    ``eval/best_bits_per_byte``, ``eval/best_step``); ``{}`` if preempted before any eval.

  Raises:
    ValueError: invalid config, data, devices, workdir or checkpoint (one line naming the
      field/file, the value and the fix; :class:`cem_jax.checkpoint.CheckpointError` for
      checkpoints that are all damaged or do not fit the model).
    FloatingPointError: ``train.max_consecutive_nonfinite`` consecutive non-finite steps (or
      non-finite parameters at a save); nothing from those steps is saved.
  """
  config_lib.validate(config)
  data_parallel_devices(config)
  created = _prepare_workdir(workdir)
  ckpt = None
  try:
    data = _build_data_once(config, workdir)
    tx, schedule = make_optimizer(config.train)
    graphdef, params, opt_state, shardings, model = init_state(
        config, data.tokenizer.vocab_size, tx)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                        every_steps=config.checkpoint.every_steps,
                        async_save=config.checkpoint.async_save)
    start_step = 0
    resume = ckpt.restorable_step()
    if resume is not None:
      # The target is the freshly initialised state on the current devices: the restore takes
      # its structure (optax's state types) and shardings, whatever the saving run used.
      state, meta = ckpt.restore(resume, {"params": params, "opt_state": opt_state})
      params, opt_state = state["params"], state["opt_state"]
      start_step = int(meta["step"])
  except BaseException:
    if ckpt is not None:
      ckpt.close()
    if created:
      shutil.rmtree(workdir, ignore_errors=True)
    raise

  is_main = jax.process_index() == 0
  resolved = config.to_dict()
  if resume is not None:
    # Through JSON, as the checkpoint stored it: tuples (mesh.rules) come back as lists.
    saved, now = _flatten(meta.get("config", {})), _flatten(json.loads(json.dumps(resolved)))
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    logging.info("resumed from %s at step %d", ckpt.step_dir(resume), start_step)
    if changed:
      logging.warning("config differs from the checkpoint's: %s",
                      ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed))
  if is_main:
    atomic_write_json(os.path.join(workdir, "config.json"), resolved, sort_keys=True)
  # A run killed before its first checkpoint starts over: drop its step-0 line too.
  writer = MetricsWriter(workdir, enabled=is_main,
                         truncate_after_step=start_step if start_step > 0 else -1)
  passes = epochs(config, data.stats()["train_windows"])
  if start_step == 0:
    stats = {f"data/{k}": v for k, v in data.stats().items()}
    writer.write(0, {"params/total": count_params(model), **stats, "data/epochs": passes,
                     "numerics_version": NUMERICS_VERSION})
  logging.info("the schedule passes over the training tokens %.2f times (epochs)", passes)
  if passes >= EPOCHS_WARNING and is_main:
    logging.warning(
        "train.num_steps=%d x train.batch_size=%d passes over the %d training windows %.1f "
        "times: held-out loss may rise after the first epochs (eval/best_* keeps the best "
        "eval); use more data or fewer steps", config.train.num_steps,
        config.train.batch_size, data.stats()["train_windows"], passes)
  # On resume: the eval lines kept (those up to the restored step) hold the best so far.
  resumed_metrics = is_main and start_step > 0 and os.path.exists(writer.path)
  best = best_eval(read_metrics(workdir)) if resumed_metrics else {}

  cfg_t = config.train
  max_bad = cfg_t.max_consecutive_nonfinite
  train_step = make_train_step(graphdef, tx, max_bad, shardings, schedule)
  eval_num_steps = None if config.eval.num_steps < 0 else config.eval.num_steps
  trace = config.eval.energy_trace and config.model.block == "cem"
  eval_step = make_eval_step(graphdef, data.tokenizer.token_bytes, eval_num_steps, trace,
                             shardings)
  num_steps = cfg_t.num_steps
  global_rows = cfg_t.batch_size
  tokens_per_step = global_rows * config.data.seq_len
  block, blocks = shardings.process_slice(global_rows)
  logging.info("mesh %s over %d devices of %d processes; process %d reads rows block %d of %d "
               "of every global batch", dict(shardings.mesh.shape), jax.device_count(),
               jax.process_count(), jax.process_index(), block, blocks)
  guard = jax.make_array_from_process_local_data(shardings.replicated, np.zeros((), np.int32))
  last_saved = resume

  def saved_text() -> str:
    return "no checkpoint saved" if last_saved is None else f"last checkpoint: step {last_saved}"

  def check_guard():
    hit = int(jax.device_get(guard))
    if hit:
      raise FloatingPointError(
          f"non-finite loss or gradient in {max_bad} consecutive steps, steps "
          f"{hit - max_bad + 1}..{hit} (train.max_consecutive_nonfinite={max_bad}); "
          f"{saved_text()}; lower train.learning_rate or raise train.warmup_steps"
      )

  def save(done: int, force: bool) -> None:
    nonlocal last_saved
    check_guard()
    state = {"params": params, "opt_state": opt_state}
    if not bool(jax.device_get(_all_finite(state))):
      raise FloatingPointError(
          f"non-finite parameters or optimizer state at step {done}, not saved; "
          f"{saved_text()}; lower train.learning_rate"
      )
    meta = {"step": done, "data_position": done, "seed": config.seed, "config": resolved,
            "numerics_version": NUMERICS_VERSION}
    if ckpt.save(done, state, meta, force=force):
      last_saved = done

  last_eval = _last_eval(workdir) if start_step >= num_steps else {}
  t_start = t_log = time.perf_counter()
  step_at_log = start_step
  try:
    with _Preemption() as preemption:
      for step in range(start_step, num_steps):
        batch = shardings.global_batch(data.train.batch(step, block, blocks), global_rows)
        done = step + 1
        params, opt_state, m = train_step(params, opt_state, batch, guard, np.int32(done))
        guard = m["nonfinite_guard"]
        if done % cfg_t.log_every_steps == 0 or done == num_steps:
          check_guard()
          m = jax.device_get(m)
          now = time.perf_counter()
          rate = (done - step_at_log) * tokens_per_step / max(now - t_log, 1e-9)
          writer.write(done, {
              "train/loss": float(m["loss"]),
              "train/grad_norm": float(m["grad_norm"]),
              "train/learning_rate": float(m["learning_rate"]),
              "train/tokens_per_sec": rate,
              "train/nonfinite_steps": int(m["nonfinite_total"]),
          })
          eta = (now - t_start) / max(done - start_step, 1) * (num_steps - done)
          logging.info("step %d/%d  loss %.4f  %.0f tok/s  ETA %s", done, num_steps,
                       float(m["loss"]), rate, _format_eta(eta))
          t_log, step_at_log = now, done
        if done % cfg_t.eval_every_steps == 0 or done == num_steps:
          last_eval = evaluate(eval_step, params, data, config, shardings)
          if not best or last_eval["eval/loss"] < best["eval/best_loss"]:
            best = best_eval([{**last_eval, "step": done}])
          last_eval = {**last_eval, **best}
          writer.write(done, last_eval)
          if is_main:
            atomic_write_json(os.path.join(workdir, "best_eval.json"), best, sort_keys=True)
          logging.info("eval at step %d: loss %.4f  ppl %.2f  bits/byte %.4f", done,
                       last_eval["eval/loss"], last_eval["eval/perplexity"],
                       last_eval["eval/bits_per_byte"])
        preempted = preemption.requested or (
            jax.process_count() > 1 and ckpt.manager.reached_preemption(done))
        if preempted or done == num_steps or ckpt.should_save(done):
          save(done, force=preempted or done == num_steps)
        if preempted:
          ckpt.wait()
          logging.warning("preempted (SIGTERM): saved step %d in %s; rerun the same command to "
                          "resume", done, ckpt.directory)
          break
  except BaseException:
    # Saves already started passed the checks: let them commit before the error propagates.
    try:
      ckpt.close()
    except Exception:  # noqa: BLE001 - the original error matters more
      logging.exception("could not finish the pending checkpoint save")
    writer.close()
    raise
  ckpt.close()
  writer.close()
  return last_eval
