"""The pieces the loop runs: the model factory, the sharded state, the jitted train and eval
steps (their loss: :mod:`cem_jax.loss`), and the eval loop over the validation split.

Data flows config → data → model → optim → steps → train (the loop) → tools: nothing here
reads a workdir, writes metrics or saves checkpoints.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from cem_jax import axes, energies, memory
from cem_jax import config as config_lib
from cem_jax import sharding as sharding_lib
from cem_jax.loss import blockwise_cross_entropy, perplexity
from cem_jax.model import DecoderLM
from cem_jax.optim import applied_updates

# ---------------------------------------------------------------------------------------------
# Model and sharded state


def build_model(config, vocab_size: int, platform: str | None = None,
                key: jax.Array | None = None) -> DecoderLM:
  """The model of ``config.model`` with ``vocab_size`` tokens, for ``platform``
  (``DecoderLM``'s: this machine's if None), initialised from ``key`` (a typed PRNG key
  array, traced or not) or, if None, from ``config.seed`` (``jax.random.key(config.seed)``:
  :func:`seed_key_data`)."""
  return DecoderLM(config.model, vocab_size,
                   rngs=nnx.Rngs(params=config.seed if key is None else key),
                   rules=axes.rules_from_config(config.mesh), platform=platform)


def seed_key_data(seed: int) -> np.ndarray:
  """The raw bits of ``jax.random.key(seed)`` (what ``nnx.Rngs(params=seed)`` starts from):
  ``uint32 [2]`` under the default threefry implementation, a NumPy array, so that every
  process passes the same value to a jitted function on a mesh of all processes' devices."""
  return np.asarray(jax.random.key_data(jax.random.key(seed)))


@dataclasses.dataclass(frozen=True, eq=False)
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

  def _key(self) -> tuple:
    # The trees as their structure and NamedShardings (hashable, equal by mesh and spec): an
    # nnx.State is neither hashable nor compared by value.
    return (self.mesh, _TreeKey.of(self.params), _TreeKey.of(self.opt_state), self.batch,
            self.replicated)

  def __eq__(self, other) -> bool:
    """Equal where every sharding is: the jitted steps are cached on them
    (:func:`make_train_step`)."""
    return isinstance(other, StateShardings) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

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
  compiled arithmetic may differ in the last bit: ≤ 1e-8 measured). The seed's key is the
  jitted initialiser's argument, not a constant of its program: another seed of the same
  model on the same mesh in one process runs the executable compiled for the first
  (:func:`_params_initialiser`), and its values are those of the program with the seed
  compiled in, bit for bit.

  Args:
    config: resolved config (``model``, ``seed``, ``mesh.rules``).
    vocab_size: the tokenizer's vocabulary size.
    tx: the optax optimizer (:func:`cem_jax.optim.make_optimizer`).
    mesh: default ``sharding.make_mesh(config.mesh)`` over all processes' devices.
  Returns:
    ``(graphdef, params, opt_state, shardings, abstract_model)``: ``params`` an ``nnx.State``
    of Params, ``shardings`` a :class:`StateShardings`.
  Raises:
    ValueError: a mesh that does not fit the devices, bad ``mesh.rules``, or parameters and
      optimizer state larger than a device (:func:`cem_jax.memory.check_state_fits`).
  """
  mesh = sharding_lib.make_mesh(config.mesh) if mesh is None else mesh
  graphdef, shardings, abstract_model, make_params, make_opt_state = _state_builders(
      config, vocab_size, tx, mesh)
  seed = seed_key_data(config.seed)
  shapes = jax.eval_shape(make_params, seed)
  memory.check_state_fits(shapes, jax.eval_shape(make_opt_state, shapes), config)
  params = make_params(seed)
  return graphdef, params, make_opt_state(params), shardings, abstract_model


def abstract_state(config: ml_collections.ConfigDict, vocab_size: int, tx, mesh,
                   platform: str | None = None):
  """:func:`init_state`'s state as shapes only, each ``jax.ShapeDtypeStruct`` on its sharding:
  enough to compile the steps for ``mesh``, whose devices need not be this machine's (e.g.
  a TPU slice's, :mod:`cem_jax.aot`); nothing is allocated.

  Args:
    config, vocab_size, tx: as :func:`init_state`.
    mesh: the mesh of the devices the state will live on.
    platform: the platform the model is built for (:func:`build_model`).
  Returns:
    ``(graphdef, params, opt_state, shardings, abstract_model)``, as :func:`init_state`.
  Raises:
    ValueError: bad ``mesh.rules``.
  """
  graphdef, shardings, abstract_model, make_params, make_opt_state = _state_builders(
      config, vocab_size, tx, mesh, platform)
  params = jax.eval_shape(make_params, seed_key_data(config.seed))
  return graphdef, params, jax.eval_shape(make_opt_state, params), shardings, abstract_model


def _state_builders(config, vocab_size: int, tx, mesh, platform: str | None = None):
  """The graphdef, shardings and abstract model, and the jitted functions that make the
  params and the optimizer state in their shards (called by :func:`init_state`, traced for
  shapes only by :func:`abstract_state`)."""
  rules = axes.rules_from_config(config.mesh)
  abstract_model = nnx.eval_shape(lambda: build_model(config, vocab_size, platform))
  graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
  param_sh = sharding_lib.param_shardings(abstract_params, mesh, rules)
  opt_sh = sharding_lib.opt_state_shardings(tx, jax.eval_shape(tx.init, abstract_params),
                                            param_sh, mesh)
  shardings = StateShardings(mesh=mesh, params=param_sh, opt_state=opt_sh,
                             batch=sharding_lib.batch_sharding(mesh, rules),
                             replicated=sharding_lib.replicated(mesh))
  make_params = _params_initialiser(config, vocab_size, platform, mesh, param_sh)
  return (graphdef, shardings, abstract_model, make_params,
          _opt_state_initialiser(tx, _TreeKey.of(opt_sh)))


@dataclasses.dataclass(frozen=True)
class _TreeKey:
  """A pytree of hashable leaves (shardings) as a hashable value: its structure and leaves."""

  treedef: object
  leaves: tuple

  @classmethod
  def of(cls, tree) -> _TreeKey:
    leaves, treedef = jax.tree.flatten(tree)
    return cls(treedef, tuple(leaves))

  def tree(self):
    return jax.tree.unflatten(self.treedef, self.leaves)


# The compiled programs of the runs of one config in one process (tables' --seeds) are made
# once: the jitted functions below are cached on everything their programs close over, which
# is their arguments (each built from them alone), so the key cannot miss one. Bounded:
# tables build many models in one process, and each entry holds its executables.
_KEPT = 8


@functools.lru_cache(maxsize=_KEPT)
def _opt_state_initialiser(tx, opt_sh: _TreeKey):
  """The jitted ``tx.init(params) -> opt_state`` with ``out_shardings`` ``opt_sh``, one per
  optimizer (by identity: :func:`cem_jax.optim.make_optimizer` gives one per ``train``
  group) and shardings."""
  return jax.jit(tx.init, out_shardings=opt_sh.tree())


def forget_compiled() -> None:
  """Drops the cached jitted initialisers and steps (and with them their executables): the
  next runs compile afresh, as the first in a process does (tests that patch what a step
  traces)."""
  _INITIALISERS.clear()
  for cached in (_opt_state_initialiser, _train_step, _eval_step):
    cached.cache_clear()


# The jitted initialisers of the last few models, by everything their program depends on but
# the seed, whose key is their argument: the runs of one model that differ only in seed in one
# process (tables' --seeds) run the executable the first compiled. Bounded: tables build many
# models in one process, and each entry holds its executable.
_INITIALISERS: collections.OrderedDict = collections.OrderedDict()
_INITIALISERS_KEPT = 8


def _params_initialiser(config, vocab_size: int, platform: str | None, mesh, param_sh):
  """The jitted ``make_params(key_data) -> params`` (``key_data``: :func:`seed_key_data`'s)
  of :func:`build_model` with ``out_shardings=param_sh``, one per model config, mesh rules,
  vocabulary size, platform and mesh (``param_sh`` follows from them)."""
  model_key = json.dumps(config_lib.flat(config.model), sort_keys=True)
  cache_key = (model_key, axes.rules_from_config(config.mesh), vocab_size, platform, mesh)
  make_params = _INITIALISERS.pop(cache_key, None)
  if make_params is None:
    # A copy: the program is traced at the first call and again if jax drops its trace, and
    # a caller may change its config in between (tables edit one per row).
    frozen = config.copy_and_resolve_references()

    def init_params(key_data):
      model = build_model(frozen, vocab_size, platform, key=jax.random.wrap_key_data(key_data))
      return nnx.state(model, nnx.Param)

    make_params = jax.jit(init_params, out_shardings=param_sh)
  _INITIALISERS[cache_key] = make_params
  while len(_INITIALISERS) > _INITIALISERS_KEPT:
    _INITIALISERS.popitem(last=False)
  return make_params


# ---------------------------------------------------------------------------------------------
# Steps


def make_train_step(graphdef, tx, max_consecutive_nonfinite: int | None = None,
                    shardings: StateShardings | None = None, schedule=None,
                    gradient_accumulation_steps: int = 1, loss_block_size: int = 0):
  """Returns the jitted ``step(params, opt_state, batch, guard=0, done=0) -> (params, opt_state,
  metrics)``; ``params`` and ``opt_state`` are donated.

  Calls with equal arguments (``graphdef`` and ``shardings`` by value, ``tx`` and ``schedule``
  by identity: :func:`cem_jax.optim.make_optimizer` gives one per ``train`` group) return the
  same jitted function, so another run of one config in one process (tables' seeds) runs the
  programs compiled for the first; :func:`forget_compiled` drops them. A model with a user's
  energy gets a step traced afresh at every call (:func:`_cacheable`).

  The loss is the token-weighted mean of ``-log p(target)`` over the whole batch (nats). With
  ``gradient_accumulation_steps`` k > 1 the batch runs as k microbatches of ``batch / k``
  rows (microbatch i: rows i, i + k, i + 2k, ..., so each device splits its own rows) in a
  ``lax.scan``; each contributes its loss sum over the whole batch's weight, so the summed
  gradient is the one-pass gradient, whatever the padding of each microbatch. (Not
  ``optax.MultiSteps``: it averages per-call mean losses, unequal when the microbatches hold
  different numbers of weighted tokens, and spreads one update over k calls of the loop.)
  With ``loss_block_size`` b > 0 the logits are made b positions at a time
  (:func:`cem_jax.loss.blockwise_cross_entropy`; ``train.loss_block_size``).

  With ``shardings`` the step is compiled for them (params and optimizer state stay sharded
  as given, the batch is split over its data-parallel axes, the metrics are replicated) and
  runs under ``shardings.mesh``'s abstract mesh; without, for the inputs' own placement (one
  device).

  ``batch``: ``inputs``, ``targets``, ``segment_ids`` (int32) and ``weights`` (float32), each
  ``[batch, seq_len]`` (``cem_jax.data.packing.make_batch``). ``metrics`` (float32 or int32
  ``[]``): ``loss`` (nats/token), ``grad_norm``, ``nonfinite_total`` (skipped updates so
  far, optax's count), ``nonfinite_consecutive``, ``nonfinite_guard`` and, with ``schedule``
  (:func:`cem_jax.optim.make_optimizer`'s), ``learning_rate``: the rate of this update,
  ``schedule`` at the updates applied before it (a skipped update does not count, so after
  one the rate is not a step ahead; on the skipped step itself it is the rate that was not
  applied).

  The guard (int32 ``[]``): pass the previous step's ``metrics["nonfinite_guard"]`` as ``guard``
  and this update's step number (the ``step`` of its metrics line) as ``done``. It becomes the
  first ``done`` at which ``max_consecutive_nonfinite`` updates in a row had a non-finite loss
  or gradient, and then stays; 0 = never (and always 0 when ``max_consecutive_nonfinite`` is
  None). It lives on the device so the loop need not fetch anything every step (that would
  stall asynchronous dispatch) yet cannot miss a run of failures that ended between checks.

  Raises:
    ValueError: ``gradient_accumulation_steps`` is not an int >= 1 (one line naming
      ``train.gradient_accumulation_steps``).
  """
  # A direct caller need not have run config.validate: 0 would divide the rows by zero when
  # the step is traced, far from the value that caused it.
  config_lib.check_int("train.gradient_accumulation_steps", gradient_accumulation_steps)
  make = _train_step if _cacheable(graphdef) else _train_step.__wrapped__
  return make(graphdef, tx, max_consecutive_nonfinite, shardings, schedule,
              gradient_accumulation_steps, loss_block_size)


def _cacheable(graphdef) -> bool:
  """Whether ``graphdef``'s steps may be cached: its energies are all built-in.

  A user's energy (registered, or a ``'file.py:function'``) may read Python state that its
  function object does not carry: a module global or a closed-over dict changed between two
  runs of one process (a script, a table file setting a row's knob) is the same function, the
  same graphdef, and a cached step would run the value it was first traced with. No key can
  hold what arbitrary Python reads, so those steps are traced afresh, as every run's were
  before the cache (one without a closed form was anyway: its jax.grad update is a new closure
  per model). The built-in energies read only their arguments.
  """
  attributes = getattr(graphdef, "attributes", None)
  if attributes is None:  # another flax's layout: nothing known, nothing kept
    return False
  specs = [getattr(value, "value", None) for _, value in attributes]
  return all(s.builtin for s in specs if isinstance(s, energies.EnergySpec))


# typed: 1 and 1.0 (or True) are different constants in the program.
@functools.lru_cache(maxsize=_KEPT, typed=True)
def _train_step(graphdef, tx, max_consecutive_nonfinite, shardings, schedule,
                gradient_accumulation_steps, loss_block_size):
  """:func:`make_train_step`'s step, one per argument values: ``graphdef`` by value (the
  model's structure and static attributes, its energies among them), ``tx`` and ``schedule``
  by identity, ``shardings`` by value."""
  value_and_grad = _batch_value_and_grad(graphdef, gradient_accumulation_steps, shardings,
                                         loss_block_size)

  @functools.partial(jax.jit, donate_argnums=(0, 1), **_train_step_placement(shardings))
  def step(params, opt_state, batch, guard=0, done=0):
    loss, grads = value_and_grad(params, batch)
    lr = None if schedule is None else schedule(applied_updates(opt_state))
    # A NaN/Inf loss or gradient: apply_if_finite (make_optimizer) leaves params and moments
    # unchanged and counts it.
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    guard = _next_guard(guard, done, opt_state.notfinite_count, max_consecutive_nonfinite)
    return params, opt_state, _train_metrics(loss, grads, opt_state, guard, lr)

  return step if shardings is None else _UnderMesh(step, shardings.mesh)


def _loss_sums(graphdef, params, batch: dict, loss_block_size: int, num_steps: int | None = None,
               trace: bool = False):
  """The model's summed loss over ``batch`` (:func:`make_train_step`'s keys):
  ``(loss_sum, weight_sum, traces)``, float32 ``[]`` sums of ``-log p(target)`` (nats) and of
  the weights, and the energy trace (:class:`cem_jax.layers.CEMBlock`; None unless
  ``trace``). ``num_steps``: the CEM layers' recursive steps (None: the model's own).

  Raises:
    ValueError: ``loss_block_size`` negative or not dividing ``seq_len``
      (:func:`cem_jax.loss.blockwise_cross_entropy`).
  """
  model = nnx.merge(graphdef, params)
  outputs = model(batch["inputs"], batch["segment_ids"], num_steps=num_steps, trace=trace,
                  hidden=True)
  hidden, traces = outputs if trace else (outputs, None)
  loss_sum, weight_sum = blockwise_cross_entropy(hidden, model.output_head(), batch["targets"],
                                                 batch["weights"], loss_block_size)
  return loss_sum, weight_sum, traces


def _batch_value_and_grad(graphdef, k: int, shardings: StateShardings | None,
                          loss_block_size: int):
  """``value_and_grad(params, batch) -> (loss, grads)`` of the batch's token-weighted mean
  loss (float32 ``[]``, nats/token; ``grads`` like ``params``), in ``k`` microbatches
  (:func:`make_train_step`) summed in a ``lax.scan`` when ``k`` > 1."""

  def loss_fn(params, batch, total_weight):
    # Over the whole batch's weight, not the microbatch's: the microbatches' losses then sum to
    # the batch mean, however unevenly the padding falls.
    return _loss_sums(graphdef, params, batch, loss_block_size)[0] / total_weight

  def value_and_grad(params, batch):
    total_weight = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
    if k == 1:
      return jax.value_and_grad(loss_fn)(params, batch, total_weight)

    def accumulate(carry, micro):
      loss, grads = jax.value_and_grad(loss_fn)(params, micro, total_weight)
      return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    if shardings is not None:  # the summed gradient lives where its parameter does
      zeros = (zeros[0], jax.lax.with_sharding_constraint(zeros[1], shardings.params))
    return jax.lax.scan(accumulate, zeros, _microbatches(batch, k, shardings))[0]

  return value_and_grad


def _microbatches(batch: dict, k: int, shardings: StateShardings | None) -> dict:
  """Each ``[rows, seq_len]`` array of ``batch`` as ``[k, rows / k, seq_len]``: microbatch i
  holds rows i, i + k, ..., so that each device splits the rows it holds (with
  ``shardings``, the pieces stay on the batch's data-parallel axes) and no row moves."""
  def split(x):
    x = jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)
    if shardings is None:
      return x
    spec = PartitionSpec(None, *shardings.batch.spec)
    return jax.lax.with_sharding_constraint(x, NamedSharding(shardings.mesh, spec))
  return jax.tree.map(split, batch)


def _train_step_placement(shardings: StateShardings | None) -> dict:
  """``jax.jit``'s ``in_shardings`` and ``out_shardings`` for :func:`make_train_step`'s
  ``step`` on ``shardings`` (``{}`` without: the inputs' own placement)."""
  if shardings is None:
    return {}
  s = shardings
  return {"in_shardings": (s.params, s.opt_state, s.batch, s.replicated, s.replicated),
          "out_shardings": (s.params, s.opt_state, s.replicated)}


def _next_guard(guard, done, consecutive, max_consecutive_nonfinite: int | None) -> jax.Array:
  """The non-finite guard after update ``done`` (int32 ``[]``, :func:`make_train_step`):
  ``done`` the first time ``consecutive`` (optax's count of non-finite updates in a row)
  reaches ``max_consecutive_nonfinite``, else ``guard`` unchanged (always, when that is
  None)."""
  guard = jnp.asarray(guard, jnp.int32)
  if max_consecutive_nonfinite is None:
    return guard
  hit = (guard == 0) & (consecutive >= max_consecutive_nonfinite)
  return jnp.where(hit, jnp.asarray(done, jnp.int32), guard)


def _train_metrics(loss, grads, opt_state, guard, lr) -> dict:
  """:func:`make_train_step`'s ``metrics`` (float32 or int32 ``[]`` each); ``learning_rate``
  only where there is a schedule (``lr`` not None)."""
  metrics = {
      "loss": loss,
      "grad_norm": optax.tree.norm(grads),
      "nonfinite_total": opt_state.total_notfinite,
      "nonfinite_consecutive": opt_state.notfinite_count,
      "nonfinite_guard": guard,
  }
  if lr is not None:
    metrics["learning_rate"] = jnp.asarray(lr, jnp.float32)
  return metrics


def make_eval_step(graphdef, num_steps: int | None, energy_trace: bool = False,
                   shardings: StateShardings | None = None, loss_block_size: int = 0):
  """Returns the jitted ``eval_step(params, batch) -> dict`` of sums over the batch.

  With ``shardings`` the batch is split over the data-parallel axes and the sums (reduced over
  every device, so over every process's rows) come back replicated.

  Keys: ``loss_sum`` (nats), ``weight_sum`` (predicted tokens), ``byte_sum`` (the UTF-8
  bytes of the text they stand for, the batch's ``target_bytes``, counted from the text when
  the data was prepared, so unknown pieces count their real bytes) and, with
  ``energy_trace``, ``energy`` (per layer, per step: the energies before/after each sub-step
  summed over the real input tokens, see :class:`cem_jax.layers.CEMBlock`) and ``token_sum``
  (the number of those tokens, ``segment_ids > 0``).
  ``num_steps`` overrides the recursive steps T of every CEM layer (test-time steps);
  ``loss_block_size`` as in :func:`make_train_step`. One jitted function per argument values
  (cached as :func:`make_train_step`'s).
  """
  make = _eval_step if _cacheable(graphdef) else _eval_step.__wrapped__
  return make(graphdef, num_steps, energy_trace, shardings, loss_block_size)


@functools.lru_cache(maxsize=_KEPT, typed=True)
def _eval_step(graphdef, num_steps, energy_trace, shardings, loss_block_size):
  """:func:`make_eval_step`'s step, one per argument values."""
  jit_kwargs = {}
  if shardings is not None:
    jit_kwargs = {"in_shardings": (shardings.params, shardings.batch),
                  "out_shardings": shardings.replicated}

  @functools.partial(jax.jit, **jit_kwargs)
  def eval_step(params, batch):
    loss_sum, weight_sum, traces = _loss_sums(graphdef, params, batch, loss_block_size,
                                              num_steps, energy_trace)
    byte_sum = jnp.sum(batch["target_bytes"] * batch["weights"])
    out = {"loss_sum": loss_sum, "weight_sum": weight_sum, "byte_sum": byte_sum}
    if energy_trace:
      out["energy"] = traces
      out["token_sum"] = jnp.sum(batch["segment_ids"] > 0).astype(jnp.float32)
    return out

  return eval_step if shardings is None else _UnderMesh(eval_step, shardings.mesh)


class _UnderMesh:
  """A jitted step called and lowered under ``mesh``'s abstract mesh
  (``jax.sharding.use_abstract_mesh``): a kernel that XLA cannot partition (splash attention,
  a Pallas call) reads the mesh there to run per device in ``shard_map``. The abstract mesh,
  not ``jax.set_mesh``: arrays made while the step is traced (splash's mask tables) then stay
  on this machine's default device instead of going to the mesh's, which fails for devices
  jax only describes (``cem_jax.aot``). Called and lowered alike, so the calls reuse the
  start-up compilation. A mesh the caller set (``jax.set_mesh``, an abstract mesh of another
  size) is put aside for the call: its concrete mesh would take those arrays to its devices
  again, and ``use_abstract_mesh`` refuses to change a mesh's size."""

  def __init__(self, step, mesh):
    self.step, self.mesh = step, mesh
    functools.update_wrapper(self, step)

  @contextlib.contextmanager
  def _under_mesh(self):
    try:
      outer = not (jax.sharding.get_mesh().empty and jax.sharding.get_abstract_mesh().empty)
    except ValueError:  # inside a jit trace, where no mesh can be set (nor cleared)
      outer = False
    with (jax.set_mesh(None) if outer else contextlib.nullcontext()), \
        jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
      yield

  def __call__(self, *args, **kwargs):
    with self._under_mesh():
      return self.step(*args, **kwargs)

  def lower(self, *args, **kwargs):
    with self._under_mesh():
      return self.step.lower(*args, **kwargs)


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


def eval_loop(eval_step, params, data, cfg, shardings: StateShardings | None = None) -> dict:
  """Runs ``eval_step`` over the validation split; returns ``eval/...`` metrics.

  Every per-token metric is a total over all evaluated batches divided by the total count,
  never a mean of per-batch means, so none depends on ``eval.batch_size`` (or on the padding
  that fills the last batch): ``eval/loss`` is nats per predicted token, ``eval/perplexity``
  its exponential, ``eval/bits_per_byte`` the total bits over the UTF-8 bytes of the predicted
  tokens, and the energy trace (when ``eval_step`` makes it) the energy per real input token.

  With ``shardings`` (and an ``eval_step`` made with them) each process reads only its rows of
  every global eval batch; ``eval_step`` sums over all of them on the devices, so every
  process gets the same totals, equal to one process's up to float summation order.

  Reads ``eval.max_batches`` batches of windows spread evenly over the split (-1: the whole
  split; ``EvalWindows.batches``). ``eval/perplexity`` is ``exp(min(loss, 80))``
  (:func:`cem_jax.loss.perplexity`: finite for a diverged model); ``eval/tokens`` is the number
  of predicted tokens evaluated.

  Raises:
    ValueError: ``eval.batch_size`` not divisible by the process count, or ``eval.max_batches``
      neither -1 nor >= 1 (:meth:`EvalWindows.batches`, one line naming the field).
  """
  bs = cfg.eval.batch_size
  index, count = (0, 1) if shardings is None else shardings.process_slice(bs)
  totals = {"loss_sum": 0.0, "weight_sum": 0.0, "byte_sum": 0.0}
  energy_sum, tokens = None, 0.0
  for batch in data.eval_batches(bs, index, count, cfg.eval.max_batches):
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
      "eval/perplexity": perplexity(loss),
      "eval/bits_per_byte": totals["loss_sum"] / math.log(2) / max(totals["byte_sum"], 1.0),
      "eval/tokens": int(totals["weight_sum"]),
  }
  if energy_sum is not None:
    metrics.update(energy_metrics(jax.tree.map(lambda a: a / max(tokens, 1.0), energy_sum)))
  return metrics


@jax.jit
def all_finite(tree) -> jax.Array:
  """True (bool ``[]``) if every float leaf of ``tree`` is finite (checked before a save)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
