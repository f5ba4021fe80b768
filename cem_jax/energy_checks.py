"""Start-up checks of the configured energies, run by :func:`cem_jax.preflight.check` for CEM
blocks before anything is compiled for training:

- each energy, and the fused update when it is the one used, is evaluated abstractly
  (``jax.eval_shape``), with inputs and weights in ``model.dtype`` as the layer passes them,
  on both layouts the model calls it with: training (``y`` and
  ``context`` of equal length) and cached decoding (``y`` the new tokens, ``context`` and
  ``aux.mask``'s key axis the whole cache), and must return a float32 or float64 scalar (the
  update: an array shaped like ``y``);
- a fused update not built into cem_jax (``<function>_fused_update`` next to a
  ``'file.py:function'`` energy, or one given to :func:`cem_jax.energies.register`) is
  evaluated on small random inputs and compared with ``-jax.grad(energy)`` w.r.t. ``y``: a
  wrong closed form would otherwise train without an error;
- an energy not built into cem_jax is evaluated numerically (:func:`_causal_values`): the
  update the model uses (closed form or ``jax.grad``) for new tokens against a longer cache
  must equal the training-layout update of the same tokens, and with ``model.document_mask`` a
  row's last document's update must not change with the documents before it; an energy that
  builds its own mask or RoPE positions, ignores ``aux.mask``, looks ahead or crosses
  documents fails, and so does an update that moves at all (:data:`LOOK_AHEAD_RTOL`) when only
  later tokens of a document of ``data.seq_len`` tokens (up to 1024) change; so does an update
  that is not finite (NaN or inf) in either layout, padding
  and rows that see no key included, an energy whose value is not finite there or at a
  padding token (``y = context = 0``, seeing no key, as the energy trace takes it off), an
  energy whose update ignores a configured diagonal (``params['diag']``), and an update whose
  slope along itself is not that of the energy's value (central differences,
  :data:`SLOPE_RTOL`: a wrong ``jax.custom_jvp`` rule or a ``stop_gradient`` on ``y``), or
  that is 0 while the energy's value changes along a random direction
  (:data:`ZERO_UPDATE_RTOL`: a rule or a ``stop_gradient`` that drops the derivative);
- an attention energy not built into cem_jax, under ``model.rope=True``, that computes the same
  at any ``aux.rope_theta`` (:func:`_check_rope_read`): a ``model.rope_theta`` other than the
  default is refused (it would train the same model), the default's RoPE said to have no effect.
Built-ins (``EnergySpec.builtin``) skip the numerical checks: tests/test_energies.py verifies
them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from cem_jax import energies, updates
from cem_jax.config import get_default_config
from cem_jax.errors import one_line
from cem_jax.layers import CEMMLP, DTYPES, CEMAttention
from cem_jax.layers.cem import padding_energy
from cem_jax.model import check_kernel_is_called, decoding_aux, training_aux

# The abstract training layout; an energy's wrong-shape error quotes it (e.g. "(1, 4)").
_ABSTRACT_BATCH, _ABSTRACT_SEQ = 1, 4
# The numerical check: few tokens, so its cost is compiling the two functions (1-2 s on a
# shared 2-core CPU; the weights are full size: ~4-11 s at d_model 4096); two rows so that,
# with model.document_mask, one holds two documents and the other padding (masked keys and
# empty rows are exercised).
_NUMERIC_BATCH, _NUMERIC_SEQ = 2, 6
# Cached decoding: the prompt's prefill writes several new tokens into a longer cache, so
# y has 2 rows against 8 keys (one new token would hide a mask of y's length: [1, 1]
# broadcasts against any key axis).
_DECODE_NEW, _DECODE_INDEX, _DECODE_CACHE = 2, 3, 8
# The look-ahead check runs one document of data.seq_len tokens, up to this many: an energy
# reading a token d places ahead shows for any d below it (a dilated pattern written
# `d % 8 == 0` also holds at d = -8, which the short layouts above cannot see).
_LOOK_AHEAD_SEQ = 1024
# A causal energy gives the earlier rows bit for bit (masked keys add exact zeros); this leaves
# room for one that is causal in exact arithmetic but rounds through later tokens (a max over
# every key), while a look-ahead term 1e-4 the size of the update shows.
LOOK_AHEAD_RTOL = 1e-5
# A correct float32 closed form agrees with jax.grad to ~1e-6; a missing term or factor
# (η, a head, RoPE) is off by O(1).
FUSED_RTOL = 1e-3
# The energy's slope along its own update (unit RMS), by central differences of its value a
# step of _SLOPE_STEP each way, against the update's: smooth energies agree to ~2e-4 (float32
# rounding of the value; d_model 128 and 1024), a gradient with kinks to ~2e-4 (|h|) and ~6e-3
# (a hard max over keys); a derivative rule off by a factor 2 is off by 0.5. (Along a random
# direction a hard max gave 6e-2 and a factor 2 only 0.2-0.4: not a check.)
SLOPE_RTOL = 5e-2
_SLOPE_STEP = 1e-3
# An update that is 0 has no direction to take the slope along: then the energy's value must
# not change a random unit-RMS step either way (a step the size of y itself, so that any
# dependence on y shows, a step function's too). An energy that does not read y gives the same
# value bit for bit; this leaves float32 rounding room through a sum of terms ~100 times the
# value, while a stop_gradient on y moves a quadratic energy's value by O(1) of itself.
ZERO_UPDATE_RTOL = 1e-5
# The numerical checks' programs run a few times on a few tokens, so compiling them is their
# cost: XLA's backend optimisation level 0 compiles them about 40% faster (1.26 -> 0.78 s for
# the training layout of a user attention energy at d_model 64 on a shared 2-core CPU), and
# every comparison is between runs of one program. Their float32 rounding is not the default
# level's: the slope check's relative errors move by up to 20x (8.7e-7 -> 1.7e-5, against
# 5e-2), and a look-ahead made of rounding alone (a max over all positions) by ~10x (1.5e-4 ->
# 1.4e-3), so such a leak close to LOOK_AHEAD_RTOL can flip (the README's quadratic energy plus
# 0.01 of that max: 4.8e-6, passed, at the default level; 3.2e-5, refused, here). Causal
# energies give 0 at both levels. The test suite runs at this level too (tests/conftest.py
# FAST_COMPILE), so the checks users get are the ones tested.
_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                     "xla_llvm_disable_expensive_passes": True}


def _jit(fn):
  """``jax.jit`` at :data:`_COMPILER_OPTIONS` where the checks run on the CPU (they are the CPU
  backend's LLVM options); plain where a process has no CPU backend (``JAX_PLATFORMS=tpu``),
  so no accelerator compiler is handed options it was never tested with."""
  options = _COMPILER_OPTIONS if _cpu_device() is not None else None
  return jax.jit(fn, compiler_options=options)
_DECODING = "as in cached decoding (python -m cem_jax.sample)"
_PER_TOKEN_HINT = ("an MLP energy must be a sum of per-token terms (token i's gate input is "
                   "context[:, i], its own state)")
_MASK_HINT = ("build masks from aux.mask (not jnp.tril of y's length), reduce over keys only "
              "where it is True (no mean or norm over the whole context or the batch), and "
              "take RoPE angles from aux.positions (y) and aux.context_positions (context)")


def _float32_note(m) -> str:
  """What to add to a numerical check's failure in a model that is not float32: the
  numerical checks compare in float32 whatever ``model.dtype`` is, so an energy must run in it."""
  if m.dtype == "float32":
    return ""
  return (" (the numerical start-up checks run in float32 whatever model.dtype; write the "
          "energy for any float dtype, e.g. cast constants with y.dtype)")


class EnergyRefusal(ValueError):
  """A start-up check's refusal of what an energy computes, not of whether it runs: a closed
  form that is not ``-jax.grad``, an update that looks ahead, crosses documents, is not finite
  or is not the energy's slope, a configured parameter or block size it never reads. Training
  refuses it; reading a saved run names it in a warning (:func:`validate_energies`)."""


def validate_energies(config, saved_run: bool = False) -> None:
  """Looks up both energies and checks them (module docstring): abstract evaluation in the
  training and cached-decoding layouts; a numerical comparison of a user's fused update with
  ``-jax.grad(energy)``.

  ``saved_run``: the config is a saved run's, read to evaluate or sample it
  (:func:`cem_jax.runs.load_run`): an :class:`EnergyRefusal` is logged as a warning (one line
  naming the field, the energy and the check) and that slot's remaining checks are skipped.
  The run's parameters were trained with the energy (before a check existed, or under an older
  one), so they can still be evaluated; resuming the run trains, and is refused.

  Raises:
    ValueError: one line naming the config field: unknown energy; no closed form for
      ``update_mode='fused'``; ``attention_impl`` 'cudnn' or 'splash' with an attention update
      that calls no kernel; ``energy_block_size`` with a fused update; an energy or fused
      update that fails, or returns the wrong shape or dtype, in either layout, or a user's
      that fails on the numerical checks' random float32 inputs.
    EnergyRefusal: (a ValueError; with ``saved_run`` a warning) one line naming the config
      field: ``energy_block_size`` with an energy that does not read
      ``aux.energy_block_size``; a user's fused update whose maximum relative error against
      ``-jax.grad(energy)`` exceeds :data:`FUSED_RTOL` (or whose reference gradient is not
      finite); a user's energy whose update in the cached-decoding layout departs from the
      training layout's by more, or changes with other documents or batch rows, whose update
      or value is not finite in either layout, whose update moves when only later tokens
      change (:data:`LOOK_AHEAD_RTOL`), whose update does not change with ``params['diag']``
      under ``model.diagonal`` (``'eta'``, ``'beta'`` under ``model.learn_eta``,
      ``learn_beta``), whose value at a padding token is not finite, whose update's slope
      along itself is not the energy's (:data:`SLOPE_RTOL`), or whose update is 0 while its
      value changes with ``y`` (:data:`ZERO_UPDATE_RTOL`); ``model.rope_theta`` other than the
      default with a user's attention energy that computes the same at any
      ``aux.rope_theta`` (:func:`_check_rope_read`).
  """
  m = config.model
  slots = []
  if m.cem_attention:
    slots.append(("model.attention_energy", "attention"))
  if m.cem_mlp:
    slots.append(("model.mlp_energy", "mlp"))
  for field, kind in slots:
    spec = energies.get(m[field.split(".")[1]], kind, field)
    update = updates.resolve_update(spec, m.update_mode)
    fused = update is spec.fused_update
    if kind == "attention":
      check_kernel_is_called(m, fused)
    if kind == "attention" and m.energy_block_size > 0 and fused:
      raise ValueError(
          f"model.energy_block_size={m.energy_block_size} has no effect on the fused update "
          f"of {spec.name!r} (it changes how jax.grad of the energy is computed); set "
          "model.update_mode='autodiff' or model.energy_block_size=0")
    try:
      _check_slot(field, kind, spec, update, m, config.data.seq_len)
    except EnergyRefusal as e:
      if not saved_run:
        raise
      logging.warning("%s (a start-up check that training refuses; this saved run is read "
                      "anyway)", e)


def _check_slot(field, kind, spec, update, m, seq_len: int) -> None:
  """:func:`validate_energies`' checks of one slot's energy, once it is looked up and its
  update chosen."""
  fused = update is spec.fused_update
  # The abstract checks see the dtypes the layer hands the energy (model.dtype); the
  # numerical ones compare in float32, where a correct closed form agrees to ~1e-6.
  shapes = _param_shapes(kind, m, DTYPES[m.dtype])
  for decoding in (False, True):
    seq = _DECODE_NEW if decoding else _ABSTRACT_SEQ
    aux = _abstract_aux(m, _ABSTRACT_BATCH, seq, decoding)
    y, context = _abstract_inputs(kind, m, _ABSTRACT_BATCH, seq, aux)
    _check_energy_shape(field, spec, y, context, shapes, aux, decoding)
    if fused:
      _check_update_shape(field, spec, y, context, shapes, aux, decoding)
  if kind == "attention" and m.energy_block_size > 0 and not spec.builtin:
    _check_block_size_read(field, spec, m, shapes, seq_len)
  if kind == "attention" and m.rope and not spec.builtin:
    _check_rope_read(field, spec, m, shapes)
  numeric = _param_shapes(kind, m, jnp.float32)
  if fused and not spec.builtin:
    _check_fused_values(field, spec, kind, m, numeric)
  if not spec.builtin:
    _causal_values(field, spec, kind, m, numeric, update, seq_len)


def _fn_name(fn) -> str:
  return getattr(fn, "__name__", type(fn).__name__)


def _param_shapes(kind: str, m, dtype) -> dict:
  """The ``params`` dict the slot's layer hands its energy, as ``jax.ShapeDtypeStruct``s:
  ``energy_params`` of :class:`~cem_jax.layers.CEMAttention` or
  :class:`~cem_jax.layers.CEMMLP` built from ``m`` (the ``model`` config group) and traced
  abstractly (no arrays are made), so a parameter a layer adds is checked here too. Weights in
  ``dtype``, ``eta`` and ``beta`` float32."""
  layer = CEMAttention if kind == "attention" else CEMMLP
  return jax.eval_shape(lambda: layer(m, rngs=nnx.Rngs(0)).energy_params(0, dtype))


@functools.cache
def _every_param_key() -> frozenset[str]:
  """Every key either slot's params can have: both layers' with a diagonal configured (the
  keys depend on no other option)."""
  m = get_default_config().model
  m.diagonal = "shared"
  return frozenset(key for kind in ("attention", "mlp")
                   for key in _param_shapes(kind, m, jnp.float32))


def _segment_ids(batch: int, seq: int) -> np.ndarray:
  """``[batch, seq]`` int32 (``seq >= 4``): two documents split in the middle in row 0; in the
  other rows two documents split elsewhere, then one padding token (rows with different masks,
  documents, padding; with ``strict_causal``, rows that see nothing)."""
  half = seq // 2
  rows = [[1] * half + [2] * (seq - half)] + [[1] * (seq - 3) + [2] * 2 + [0]] * (batch - 1)
  return np.asarray(rows, np.int32)


def _aux(m, batch: int, seq: int, decoding: bool) -> energies.EnergyAux:
  """The aux the model builds (:func:`cem_jax.model.training_aux` with documents and padding
  when ``model.document_mask``, as in training; :func:`cem_jax.model.decoding_aux`), on the
  'xla' kernel: the checks run before the devices are known."""
  if decoding:
    return decoding_aux(m, batch, seq, _DECODE_CACHE, _DECODE_INDEX)
  if not m.document_mask:
    return training_aux(m, None, batch, seq)
  segment_ids = jnp.asarray(_segment_ids(batch, seq))
  return training_aux(m, segment_ids, batch, seq).replace(real=segment_ids > 0)


def _abstract_aux(m, batch: int, seq: int, decoding: bool) -> energies.EnergyAux:
  """:func:`_aux` as ``jax.ShapeDtypeStruct`` arrays (its static fields as they are): traced,
  as the model's aux always is, and without the dozen small programs that building its masks
  eagerly compiles."""
  return jax.eval_shape(functools.partial(_aux, m, batch, seq, decoding))


def _context_len(kind: str, aux) -> int:
  """The attention context is every key (the whole cache when decoding); the MLP's gate input
  is the state of the same tokens as ``y``."""
  return aux.mask.shape[-1] if kind == "attention" else aux.mask.shape[1]


def _abstract_inputs(kind, m, batch, seq, aux):
  """``y`` and ``context`` as the layer passes them: in ``model.dtype``."""
  dtype = DTYPES[m.dtype]
  y = jax.ShapeDtypeStruct((batch, seq, m.d_model), dtype)
  context = jax.ShapeDtypeStruct((batch, _context_len(kind, aux), m.d_model), dtype)
  return y, context


def _where(y, context, aux, decoding: bool, inputs: str = "inputs") -> str:
  """How the inputs looked, for an error message (shapes only in the decoding layout, the one
  users do not expect)."""
  if not decoding:
    if inputs == "inputs" and y.dtype != jnp.float32:
      inputs = f"{jnp.dtype(y.dtype).name} inputs (model.dtype)"
    return f"[batch, seq_len, d_model] {inputs}"
  shapes = f"y {list(y.shape)}, context {list(context.shape)}, aux.mask {list(aux.mask.shape)}"
  longer = "context longer than y" if context.shape[1] > y.shape[1] else "aux.mask wider than y"
  return f"{inputs} with {longer}, {_DECODING} ({shapes})"


def _evaluate_shape(field, spec, fn, what, y, context, shapes, aux, decoding):
  try:
    return jax.eval_shape(fn, y, context, shapes, aux)
  except Exception as e:  # the user's function failed on valid shapes: say whose it is
    hint = f"; {_MASK_HINT}" if decoding else ""
    if isinstance(e, KeyError) and e.args and e.args[0] in _every_param_key() - set(shapes):
      # e.g. an attention energy named in the MLP slot, or 'diag' without model.diagonal
      hint = (f"; {field}'s params have the keys {', '.join(sorted(shapes))} (an attention "
              "energy gets w_q, w_k, eta, beta and diag when configured; an MLP energy w, g, "
              "eta)")
    elif isinstance(e, KeyError) and e.args and e.args[0] not in shapes:  # e.g. params["w_v"]
      # Not known to be a params lookup (any dict raises the same), hence the "if".
      hint = (f"; if {e.args[0]!r} is meant as a key of params: {field}'s params have the "
              f"keys {', '.join(sorted(shapes))}")
    raise ValueError(f"{field}={spec.name!r}{what} failed on {_where(y, context, aux, decoding)}"
                     f": {one_line(e)}{hint}") from e


def _check_energy_shape(field, spec, y, context, shapes, aux, decoding):
  out = _evaluate_shape(field, spec, spec.energy, "", y, context, shapes, aux, decoding)
  # The probe's shapes, not the config's batch: a [batch] energy shows as (1,), which reads
  # as the batch axis only beside y's own shape.
  where = (f" on {_where(y, context, aux, decoding)}" if decoding
           else f" for y of shape {list(y.shape)} ([batch, seq_len, d_model])")
  if not hasattr(out, "shape") or out.shape != ():
    shape = getattr(out, "shape", type(out).__name__)
    raise ValueError(f"{field}={spec.name!r} returns shape {shape}{where}; an energy must "
                     "return a scalar (sum over batch and positions)")
  if not jnp.issubdtype(out.dtype, jnp.floating):
    raise ValueError(f"{field}={spec.name!r} returns dtype {out.dtype}{where}; an energy must "
                     "return a float scalar")
  if jnp.finfo(out.dtype).bits < 32:
    # A bfloat16 value keeps ~3 digits: the energy trace and the slope check's central
    # differences would read rounding, and the latter refused it as a wrong gradient.
    raise ValueError(f"{field}={spec.name!r} returns dtype {out.dtype}{where}; an energy must "
                     "return a float32 (or float64) scalar: accumulate in float32, e.g. "
                     "preferred_element_type=jnp.float32 or .astype(jnp.float32) before the sum")


# _WatchedAux counts reads of energy_block_size while "on" (only inside the traced energy, not
# while jax flattens the arguments of the probe itself).
_BLOCK_SIZE_WATCH = {"on": False, "reads": 0}


@flax.struct.dataclass
class _WatchedAux(energies.EnergyAux):
  """An :class:`EnergyAux` that counts reads of ``energy_block_size``: by the energy, its
  gradient, or jax flattening an aux the energy passes on (all count as reading it)."""

  def __getattribute__(self, name):
    if name == "energy_block_size" and _BLOCK_SIZE_WATCH["on"]:
      _BLOCK_SIZE_WATCH["reads"] += 1
    return super().__getattribute__(name)


def _check_block_size_read(field, spec, m, shapes, seq_len: int):
  """Refuses ``model.energy_block_size`` when neither the energy nor its gradient (what the
  autodiff update runs) reads ``aux.energy_block_size``, traced abstractly (no arrays are
  made) at the training layout of ``data.seq_len`` (an energy may read it only at long
  lengths): memory would stay quadratic in seq_len. Any read counts, so an energy using the
  size in any way passes."""
  small = _abstract_aux(m, 1, _ABSTRACT_SEQ, False)  # the static fields; arrays at seq_len

  def at_seq_len(x):
    return jax.ShapeDtypeStruct((1,) + (seq_len,) * (len(x.shape) - 1), x.dtype)

  watched = _WatchedAux(**{
      f.name: at_seq_len(v) if isinstance(v, jax.ShapeDtypeStruct) else v
      for f in dataclasses.fields(small) for v in [getattr(small, f.name)]})
  y, context = _abstract_inputs("attention", m, 1, seq_len, watched)

  def gradient(y_, c_, p_, aux_):
    _BLOCK_SIZE_WATCH["on"] = True
    try:
      return jax.grad(spec.energy)(y_, c_, p_, aux_)
    finally:
      _BLOCK_SIZE_WATCH["on"] = False

  _BLOCK_SIZE_WATCH["reads"] = 0
  try:
    jax.eval_shape(gradient, y, context, shapes, watched)
  except Exception as e:  # the energy failed at the training length, not at 4 tokens
    raise ValueError(f"{field}={spec.name!r}: jax.grad of the energy failed on [batch, "
                     f"seq_len, d_model] inputs at data.seq_len={seq_len}: {one_line(e)}"
                     ) from e
  if not _BLOCK_SIZE_WATCH["reads"]:
    raise EnergyRefusal(
        f"model.energy_block_size={m.energy_block_size} has no effect on {field}="
        f"{spec.name!r}: neither the energy nor its gradient reads aux.energy_block_size "
        "(pass it to cem_jax.energies.blockwise_logsumexp for memory linear in seq_len); set "
        "model.energy_block_size=0")


def _same_at_another_rope_theta(spec, m, shapes) -> bool:
  """Whether the energy computes the same at another ``aux.rope_theta`` (half
  ``model.rope_theta``): its program traced abstractly (``jax.make_jaxpr``, nothing compiled or
  run) is the same, constants included. A base it uses shows as a literal or a constant (or
  other operations) that differ; an energy that only tests it against None computes the same."""
  aux = _abstract_aux(m, _ABSTRACT_BATCH, _ABSTRACT_SEQ, False)
  y, context = _abstract_inputs("attention", m, _ABSTRACT_BATCH, _ABSTRACT_SEQ, aux)

  def program(theta):
    closed = jax.make_jaxpr(spec.energy)(y, context, shapes, aux.replace(rope_theta=theta))
    return str(closed.jaxpr), [np.asarray(c) for c in closed.consts]

  (text, consts), (other_text, other_consts) = program(m.rope_theta), program(m.rope_theta / 2)
  return text == other_text and len(consts) == len(other_consts) and all(
      a.shape == b.shape and np.array_equal(a, b) for a, b in zip(consts, other_consts,
                                                                   strict=True))


def _check_rope_read(field, spec, m, shapes) -> None:
  """A user's attention energy under ``model.rope=True`` that computes the same at any
  ``aux.rope_theta`` (:func:`_same_at_another_rope_theta`) applies no RoPE of the config's: a
  ``model.rope_theta`` other than the default would train the same model as the default, and
  is refused; at the default, that ``model.rope=True`` has no effect on it is said in a warning
  (the README's quadratic energy sees order through ``aux.mask`` alone, as it says).

  Raises:
    EnergyRefusal: one line naming ``model.rope_theta``, its value, the field and the energy.
  """
  if not _same_at_another_rope_theta(spec, m, shapes):
    return
  default = get_default_config().model.rope_theta
  rotate = ("rotate queries and keys with cem_jax.energies.apply_rope at aux.rope_theta "
            "(README, Swap an energy)")
  if m.rope_theta != default:
    raise EnergyRefusal(
        f"model.rope_theta={m.rope_theta!r} has no effect on {field}={spec.name!r}: the energy "
        f"computes the same at any aux.rope_theta; {rotate}, or leave model.rope_theta at "
        f"{default!r}")
  logging.warning("model.rope=True has no effect on %s=%r: the energy computes the same at any "
                  "aux.rope_theta; %s if that is not meant, or set model.rope=False", field,
                  spec.name, rotate)


def _check_update_shape(field, spec, y, context, shapes, aux, decoding):
  what = f": its fused update {_fn_name(spec.fused_update)}"
  out = _evaluate_shape(field, spec, spec.fused_update, what, y, context, shapes, aux,
                        decoding)
  shape = getattr(out, "shape", type(out).__name__)
  if shape != y.shape or not jnp.issubdtype(out.dtype, jnp.floating):
    raise ValueError(f"{field}={spec.name!r}{what} returns shape {shape}, dtype "
                     f"{getattr(out, 'dtype', None)} on {_where(y, context, aux, decoding)}; it "
                     "must return -∇_y energy: a float array shaped like y")


def _random_params(shapes: dict, rng: np.random.Generator) -> dict:
  """Random, non-initial parameters at the scale training sees: weights ~ N(0, 1/d_model)
  (scores of order 1 for unit-RMS inputs), η and β spread per head (an update that drops or
  mixes up a head's η or β is caught), a diagonal of either sign. NumPy draws and casts
  them: each shape would cost jax.random, or a cast by jnp, a compilation."""
  out = {}
  for name, s in sorted(shapes.items()):
    if name in ("eta", "beta"):
      v = rng.uniform(0.5, 1.5, s.shape)
      if name == "beta":  # around the default 1/sqrt(head_dim)
        v = v / math.sqrt(shapes["w_q"].shape[-1])
    elif name == "diag":
      v = 0.3 * rng.standard_normal(s.shape, np.float32) / math.sqrt(s.shape[-1])
    else:  # w_q, w_k, w, g: [d_model, ...]; float32 draws: full-size weights at large d_model
      v = rng.standard_normal(s.shape, np.float32) / math.sqrt(s.shape[0])
    out[name] = jnp.asarray(np.asarray(v, s.dtype))
  return out


def _cpu_device():
  """CPU when present: the same float32 arithmetic on every machine (no TF32 or bf16 passes
  of accelerator matmuls), and no accelerator memory taken before the model is placed."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


def _check_fused_values(field, spec, kind, m, shapes):
  """Compares ``spec.fused_update`` with ``-jax.grad(spec.energy)`` w.r.t. ``y``, in float32, on
  random unit-RMS inputs, in the training and the cached-decoding layout."""
  name = _fn_name(spec.fused_update)
  reference = updates.autodiff_update(spec.energy)

  with jax.default_device(_cpu_device()), jax.default_matmul_precision("highest"):
    rng = np.random.default_rng(0)
    params = _random_params(shapes, rng)
    for decoding in (False, True):
      seq = _DECODE_NEW if decoding else _NUMERIC_SEQ

      # One compilation per layout for both (compiling dominates the cost at these sizes), the
      # aux built in it as the model builds it.
      @_jit
      def both(y, context, params, seq=seq, decoding=decoding):
        aux = _aux(m, _NUMERIC_BATCH, seq, decoding)
        return spec.fused_update(y, context, params, aux), reference(y, context, params, aux)

      aux = _abstract_aux(m, _NUMERIC_BATCH, seq, decoding)
      y = rng.standard_normal((_NUMERIC_BATCH, seq, m.d_model)).astype(np.float32)
      context = rng.standard_normal(
          (_NUMERIC_BATCH, _context_len(kind, aux), m.d_model)).astype(np.float32)
      where = _where(y, context, aux, decoding, "random float32 inputs")
      try:
        got, want = (np.asarray(a, np.float64) for a in both(y, context, params))
      except Exception as e:  # the shape checks ran both functions' code already: rare
        raise ValueError(f"{field}={spec.name!r}: its fused update {name} or jax.grad of the "
                         f"energy failed on {where}{_float32_note(m)}: {one_line(e)}") from e
      if not np.all(np.isfinite(want)):
        raise EnergyRefusal(
            f"{field}={spec.name!r}: -jax.grad(energy) w.r.t. y is not finite on {where}, so "
            f"its fused update {name} cannot be checked against it; make the energy's gradient "
            "finite (e.g. with jax.custom_jvp) or set model.update_mode='autodiff'")
      rel = _relative_error(got, want)
      if not rel <= FUSED_RTOL:  # also NaN
        raise EnergyRefusal(
            f"{field}={spec.name!r}: its fused update {name} is not -jax.grad(energy) w.r.t. "
            f"y: max relative error {rel:.3g} > {FUSED_RTOL:g} on {where}; it must return "
            "exactly -∇_y energy (η included: the energy carries the step size, the layer "
            "adds only the preconditioner); fix it, remove it, or set "
            "model.update_mode='autodiff'")


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
  """``max |got - want| / max |want|``; with ``want`` all zeros: 0 if ``got`` is too, else inf."""
  scale = np.max(np.abs(want))
  err = np.max(np.abs(got - want))
  return err / scale if scale > 0 else (0.0 if err == 0 else math.inf)


def _causal_values(field, spec, kind, m, shapes, update, seq_len: int):
  """Runs the update the model uses on random float32 inputs in layouts that a causal,
  per-document energy cannot tell apart (:func:`_layouts`), and refuses the energy where they
  differ:

  - cached decoding: the new tokens against a cache whose slots past them hold other values
    than training's later tokens, against the rows of those tokens in a training layout that
    runs past them (a mask or RoPE positions not taken from ``aux``, a non-causal energy, an
    update looking ahead);
  - training layouts before and after the tokens of all but each row's last document change
    (with ``model.document_mask``: rows of different documents and padding), or without
    documents all of row 1: that document's, or row 0's, update must not (an energy crossing
    documents or mixing batch rows);
  - one document of ``data.seq_len`` tokens (up to :data:`_LOOK_AHEAD_SEQ`) before and after
    the tokens after a split change: the rows before it must not move, to
    :data:`LOOK_AHEAD_RTOL` (a look-ahead of any distance, however small;
    :func:`_check_no_look_ahead`).

  Before those, in this order: an update or energy value that is not finite in any layout,
  an update that is 0 while the energy's value changes with ``y``
  (:func:`_check_zero_update`: every parameter would count as unread), and a configured
  diagonal the update does not read. After them: an energy value that is not
  finite at a padding token (``y = context = 0``, seeing no key, as the energy trace takes it
  off), and an update whose slope along itself is not the energy's (:func:`_check_slopes`).
  """
  with jax.default_device(_cpu_device()), jax.default_matmul_precision("highest"):
    runs = _layouts(field, spec, kind, m, shapes, update)
    _check_finite(field, spec, kind, m, update, runs)
  _check_zero_update(field, spec, update, runs)
  _check_diag_read(field, spec, m, runs)
  _check_learned_read(field, spec, m, runs)
  _warn_unread_weights(field, spec, shapes, runs)
  _check_decode_matches(field, spec, kind, runs)
  _check_rows_independent(field, spec, kind, m, runs)
  with jax.default_device(_cpu_device()), jax.default_matmul_precision("highest"):
    _check_no_look_ahead(field, spec, kind, m, shapes, update, seq_len)
  _check_padding_finite(field, spec, runs)
  _check_slopes(field, spec, update, runs)


def _training_run(spec, update, m, batch: int, seq: int):
  """``(y, context, params, segment_ids) -> (update, energy)`` in the training layout, ``y``
  and ``context`` ``[batch, seq, d_model]``, ``segment_ids`` ``[batch, seq]`` int32 or None:
  the update the model uses and the value of ``spec.energy`` (what ``eval.energy_trace``
  logs) as one jitted program, so that the pair costs one compile."""

  @_jit
  def train(y, context, params, segment_ids):
    aux = training_aux(m, segment_ids, batch, seq)
    return update(y, context, params, aux), spec.energy(y, context, params, aux)

  return train


def _check_no_look_ahead(field, spec, kind, m, shapes, update, seq_len: int) -> None:
  """Refuses an update whose rows move when only later tokens change, in one document of
  ``min(data.seq_len, _LOOK_AHEAD_SEQ)`` tokens: the three rows of the batch keep their first
  half, their first token and all but their last token, and ``y`` and ``context`` change
  everywhere after that. A look-ahead of any distance below the length shows, however small
  the weights make it (:data:`LOOK_AHEAD_RTOL`, not the float32 tolerance of the other
  layouts), and so does one only late tokens make (the last row).

  Raises:
    ValueError: one line naming the field, the split and the relative error.
  """
  seq, batch = min(seq_len, _LOOK_AHEAD_SEQ), 3
  splits = (max(seq // 2, 1), 1, seq - 1)
  keep = np.arange(seq)[None, :] < np.asarray(splits)[:, None]
  # An argument, not a closed-over NumPy array: the energy gets aux.segment_ids as the model
  # hands it, a traced jax array (whose .at a NumPy array lacks).
  one = np.ones((batch, seq), np.int32) if m.document_mask else None
  train = _training_run(spec, update, m, batch, seq)
  rng = np.random.default_rng(2)
  params = _random_params(shapes, rng)
  y, context, other, other_context = (
      rng.standard_normal((batch, seq, m.d_model)).astype(np.float32) for _ in range(4))
  later = ~keep[:, :, None]
  try:
    before, e_before = (np.asarray(a, np.float64) for a in train(y, context, params, one))
    after, e_after = (np.asarray(a, np.float64) for a in train(
        np.where(later, other, y), np.where(later, other_context, context), params, one))
  except Exception as e:
    raise ValueError(f"{field}={spec.name!r}: its update failed on random float32 inputs of "
                     f"{seq} tokens{_float32_note(m)}: {one_line(e)}") from e
  for values in (before, after):
    if not np.all(np.isfinite(values)):
      raise _not_finite(field, spec, kind, m, update, values, None, False)
  for energy in (e_before, e_after):  # e.g. a product or an unshifted exp over many keys
    if not np.isfinite(energy):
      raise EnergyRefusal(
          f"{field}={spec.name!r}: the energy's value is {energy} on random float32 inputs of "
          f"{seq} tokens (one document of data.seq_len, up to {_LOOK_AHEAD_SEQ}){_float32_note(m)}"
          ", though it is finite on shorter ones; an energy must be finite at the training "
          "length: sum logs instead of multiplying over keys, and shift exponentials by a "
          "per-row max (cem_jax.energies.masked_logsumexp)")
  rel = _relative_error(after[keep], before[keep])
  if not rel <= LOOK_AHEAD_RTOL:  # also NaN
    hint = _PER_TOKEN_HINT if kind == "mlp" else (
        f"{_MASK_HINT}; a stabilising max taken over all positions does it too, through float32 "
        "rounding in its gradient: take it per query row, put it under jax.lax.stop_gradient, "
        "or use cem_jax.energies.masked_logsumexp")
    raise EnergyRefusal(
        f"{field}={spec.name!r}: its update reads tokens after its own: in one document of "
        f"{seq} tokens, the updates before position k change when only the tokens from k on "
        f"change (k = {', '.join(map(str, splits))} in three rows): max relative error "
        f"{rel:.3g} > {LOOK_AHEAD_RTOL:g}; {hint}")


@dataclasses.dataclass(frozen=True)
class _Runs:
  """What :func:`_layouts` computed, float64: each update ``[batch, rows, d_model]`` and the
  energy's value ``[]`` with it."""

  trained: np.ndarray  # training layout, each row one document
  e_trained: np.ndarray
  decoded: np.ndarray  # the new tokens against the longer cache
  e_decoded: np.ndarray
  before: np.ndarray  # training layout with documents and padding (or without documents)
  e_before: np.ndarray
  after: np.ndarray  # the same after the tokens outside `keep` changed
  e_after: np.ndarray
  keep: np.ndarray  # [batch, seq] bool: each row's last document (without documents: row 0)
  segment_ids: np.ndarray | None  # of `before` and `after`; None without model.document_mask
  unread: frozenset[str]  # the parameters the update does not change with
  e_padding: np.ndarray  # the energy of one padding token (layers.cem.padding_energy)
  # the energy's slope along the update of `trained` (central differences) and the update's,
  # or None for a zero update
  slopes: tuple[float, float] | None
  # for a zero update only: the energy at y - r, y and y + r (y of `trained`, r random of unit
  # RMS); None otherwise
  across: tuple[float, float, float] | None


def _layouts(field, spec, kind, m, shapes, update) -> _Runs:
  """The update ``update`` and the value of ``spec.energy`` on random float32 inputs in each
  layout :func:`_causal_values` compares, two compiled functions in all (CPU, highest matmul
  precision: the caller's context).

  Raises:
    ValueError: the update or energy failed on them.
  """
  new, index, cache = _DECODE_NEW, _DECODE_INDEX, _DECODE_CACHE
  batch = _NUMERIC_BATCH
  # Training runs past the new tokens but is shorter than the cache: an energy reading the
  # context's length (not aux.mask) sees another number in each layout.
  seq = cache - 1
  segment_ids = _segment_ids(batch, seq)
  train = _training_run(spec, update, m, batch, seq)

  # The update, the energy's value and a padding token's energy: one compile.
  @_jit
  def decode(y, context, params):
    aux = decoding_aux(m, batch, new, cache, index)
    return (update(y, context, params, aux), spec.energy(y, context, params, aux),
            padding_energy(spec.energy, params, aux, m.d_model, jnp.float32, jnp.float32))

  def values(out):
    return tuple(np.asarray(a, np.float64) for a in out)

  rng = np.random.default_rng(1)
  params = _random_params(shapes, rng)
  # Inputs in NumPy: each eager jnp operation on them would compile a program of its own.
  normal = lambda n: rng.standard_normal((batch, n, m.d_model)).astype(np.float32)
  y, context, other = normal(seq), normal(seq), normal(cache)
  rows = slice(index, index + new)
  # The cache holds the training context up to the new tokens, other values after them;
  # the MLP's gate input is the state of the new tokens themselves.
  cached = np.concatenate([context[:, :index + new], other[:, index + new:]], axis=1)
  # What must not move when the rest changes: each row's last document, or without
  # documents, row 0 when row 1 changes (rows are independent examples).
  if m.document_mask:
    keep, seg = segment_ids == segment_ids.max(axis=1, keepdims=True), segment_ids
  else:
    keep, seg = np.arange(batch)[:, None] == np.zeros((1, seq), int), None
  change = ~keep[:, :, None]
  try:
    # One document, as decoding sees it (segment ids when training has them: one compile).
    one = np.ones((batch, seq), np.int32) if m.document_mask else None
    trained, e_trained = values(train(y, context, params, one))
    energy_at = lambda y_: values(train(y_, context, params, one))[1]  # noqa: E731
    slopes = _slopes(energy_at, y, trained)
    across = None if slopes is not None else _across(energy_at, y, e_trained)
    decoded, e_decoded, e_padding = values(decode(
        y[:, rows], cached if kind == "attention" else context[:, rows], params))
    before, e_before = values(train(y, context, params, seg))
    after, e_after = values(train(np.where(change, other[:, :seq], y),
                                  np.where(change, -other[:, :seq], context), params, seg))
    # Each parameter the update does not change with (another draw of it alone): a learned
    # eta or beta unread trains on a zero gradient, a diagonal or a weight for nothing.
    fresh = _random_params(shapes, rng)
    unread = frozenset(name for name in params if np.array_equal(before, values(train(
        y, context, {**params, name: fresh[name]}, seg))[0]))
  except Exception as e:
    # The shape checks ran this code on one row: what fails here is mostly an axis that
    # broadcast against the batch of 1 (e.g. eta[:, None, None] against [batch, heads, t]).
    raise ValueError(f"{field}={spec.name!r}: its update failed on random float32 inputs, y "
                     f"{list(y.shape)} [batch, seq_len, d_model] (batch {batch}: the shape "
                     f"checks ran batch 1){_float32_note(m)}: {one_line(e)}") from e
  return _Runs(trained, e_trained, decoded, e_decoded, before, e_before, after, e_after, keep,
               seg, unread, e_padding, slopes, across)


def _slopes(energy_at, y, update: np.ndarray) -> tuple[float, float] | None:
  """The energy's slope along ``update`` scaled to unit RMS, by central differences of its
  value (``energy_at``: float64 at a ``y``), and ``-update · direction``, what it must equal
  when ``update = -∇_y E``; None for a zero update (no direction)."""
  rms = math.sqrt(np.mean(update**2))
  if rms == 0:
    return None
  step = (_SLOPE_STEP * update / rms).astype(np.float32)
  with np.errstate(invalid="ignore"):  # inf - inf: a value _check_finite refuses first
    slope = (energy_at(y + step) - energy_at(y - step)) / (2 * _SLOPE_STEP)
  direction = step.astype(np.float64) / _SLOPE_STEP  # the float32 one the energy saw
  return float(slope), -float(np.sum(update * direction))


def _across(energy_at, y: np.ndarray, e_at_y: np.ndarray) -> tuple[float, float, float]:
  """The energy (``energy_at``: float64 at a ``y``) at ``y - r``, ``y`` (``e_at_y``) and
  ``y + r``, ``r`` a fixed random direction of unit RMS: where the update is 0 (no direction
  of its own), whether the energy's value changes with ``y`` at all."""
  r = np.random.default_rng(3).standard_normal(y.shape).astype(np.float32)
  r /= np.sqrt(np.mean(np.square(r, dtype=np.float64))).astype(np.float32)
  with np.errstate(invalid="ignore", over="ignore"):
    return float(energy_at(y - r)), float(e_at_y), float(energy_at(y + r))


def _update_name(spec, update) -> str:
  return (f"fused update {_fn_name(update)}" if update is spec.fused_update else
          "update (jax.grad of the energy)")


def _check_finite(field, spec, kind, m, update, runs: _Runs) -> None:
  """Refuses an update, then an energy value, that is not finite in a layout of ``runs``.

  A NaN or inf update is no layout mismatch: this says what it is (the comparisons would call
  it one, or, on rows they do not compare (padding), let it train to a NaN loss).
  """
  for found, segments in ((runs.trained, None), (runs.before, runs.segment_ids),
                          (runs.after, runs.segment_ids), (runs.decoded, None)):
    if not np.all(np.isfinite(found)):
      raise _not_finite(field, spec, kind, m, update, found, segments, found is runs.decoded)
  documents = ("[batch, seq_len, d_model] inputs with documents and padding"
               if m.document_mask else "[batch, seq_len, d_model] inputs")
  for energy, where in ((runs.e_trained, "[batch, seq_len, d_model] inputs"),
                        (runs.e_before, documents), (runs.e_after, documents),
                        (runs.e_decoded, f"new tokens against a longer cache, {_DECODING}")):
    if not np.isfinite(energy):
      raise EnergyRefusal(
          f"{field}={spec.name!r}: the energy's value is {energy} on random float32 {where}"
          f"{_float32_note(m)}, though its update is finite; an energy must be finite "
          "(eval.energy_trace logs it): on rows that see no key use "
          "cem_jax.energies.masked_logsumexp (exactly 0 there), not jax.nn.logsumexp of "
          "scores masked with -inf")


def _check_padding_finite(field, spec, runs: _Runs) -> None:
  if not np.isfinite(runs.e_padding):
    raise EnergyRefusal(
        f"{field}={spec.name!r}: the energy's value at a padding token (y = context = 0, "
        f"seeing no key) is {runs.e_padding}; the energy trace (eval.energy_trace, python -m "
        "cem_jax.evaluate) takes it off per padding token (0 times it without padding), so "
        "every trace would be NaN: make the energy finite at 0 (e.g. x * log|x| as "
        "jnp.where(x == 0, 0.0, x * jnp.log(jnp.where(x == 0, 1.0, jnp.abs(x)))))")


def _check_zero_update(field, spec, update, runs: _Runs) -> None:
  """Refuses an update that is 0 while the energy's value changes with ``y``
  (:data:`ZERO_UPDATE_RTOL`): ``jax.grad`` through a ``stop_gradient`` on ``y``, or a
  ``jax.custom_jvp`` rule dropping the derivative, is exactly 0, and the slope check has no
  direction to compare along. An energy that does not depend on ``y`` passes (its update is
  rightly 0)."""
  if runs.across is None:
    return
  minus, at, plus = runs.across
  rel = _relative_error(np.array([minus, plus]), np.array([at, at]))
  if not rel <= ZERO_UPDATE_RTOL:  # also NaN
    raise EnergyRefusal(
        f"{field}={spec.name!r}: its {_update_name(spec, update)} is 0 on random float32 "
        "inputs, but the energy's value changes with y: "
        f"{minus:.6g}, {at:.6g}, {plus:.6g} at y - r, y, y + r (r random, unit RMS; relative "
        f"change {rel:.3g} > {ZERO_UPDATE_RTOL:g}), so the update is not -∇_y of it; check a "
        "jax.custom_jvp/custom_vjp rule, or a jax.lax.stop_gradient on y, in it (y read only "
        "through a step function, e.g. jnp.round or jnp.floor, has a gradient of 0 too: the "
        "layer would never move y)")


def _check_slopes(field, spec, update, runs: _Runs) -> None:
  """Refuses an update that is not ``-∇_y E`` of the energy's own value along the update
  itself: ``jax.grad`` follows a ``jax.custom_jvp``/``custom_vjp`` rule or a ``stop_gradient``
  however wrong, and a closed form is compared with ``jax.grad`` alone. An error orthogonal to
  the update (``δ · u = 0``) does not show here."""
  if runs.slopes is None:
    return
  slope, want = runs.slopes
  rel = abs(slope - want) / abs(want)
  if not rel <= SLOPE_RTOL:  # also NaN
    raise EnergyRefusal(
        f"{field}={spec.name!r}: its {_update_name(spec, update)} is not -∇_y of the energy's "
        "value: along the "
        f"update, central differences of the energy give the slope {slope:.6g}, the update "
        f"{want:.6g} (relative error {rel:.3g} > {SLOPE_RTOL:g}); check a jax.custom_jvp/"
        "custom_vjp rule, or a jax.lax.stop_gradient on y, in it")


# The learned scalars an energy must read: (config key, what it is, how to read it).
_LEARNED = {"eta": ("learn_eta", "the learned step size",
                    "multiply the energy by it (the energy carries the step size)"),
            "beta": ("learn_beta", "the learned inverse temperature", "read it in the energy")}


def _check_learned_read(field, spec, m, runs: _Runs) -> None:
  for name, (key, what, fix) in _LEARNED.items():
    if getattr(m, key) and name in runs.unread:
      raise EnergyRefusal(
          f"model.{key}=True has no effect on {field}={spec.name!r}: its update does not "
          f"change with params[{name!r}], {what}, which would train on a zero gradient; "
          f"{fix} or set model.{key}=False")


def _warn_unread_weights(field, spec, shapes, runs: _Runs) -> None:
  # No config key drops a weight: said, not refused.
  weights = sorted(runs.unread - {"eta", "beta", "diag"})
  if weights:
    count = sum(math.prod(shapes[name].shape) for name in weights)
    logging.warning(
        "%s=%r never reads %s: its update does not change with them, and their %s parameters "
        "a layer train on weight decay alone (and count in params/total); read them in the "
        "energy if that is not meant", field, spec.name,
        ", ".join(f"params[{name!r}]" for name in weights), f"{count:,}")


def _check_diag_read(field, spec, m, runs: _Runs) -> None:
  if "diag" in runs.unread:
    raise EnergyRefusal(
        f"model.diagonal={m.diagonal!r} has no effect on {field}={spec.name!r}: its update "
        "does not change with params['diag'] ([num_heads, d_model]); read it in the energy "
        "or set model.diagonal='none'")


def _check_decode_matches(field, spec, kind, runs: _Runs) -> None:
  """The new tokens' update against the cache must be the training layout's of their rows."""
  new, index, cache = _DECODE_NEW, _DECODE_INDEX, _DECODE_CACHE
  rel = _relative_error(runs.decoded, runs.trained[:, index:index + new])
  if not rel <= FUSED_RTOL:  # also NaN
    raise _layout_mismatch(
        field, spec, kind, f"reads tokens after its own, or a mask, length or positions not "
        f"taken from aux: for {new} new tokens at positions {index}.. against a {cache}-slot "
        f"cache, {_DECODING}, it differs from the training-layout update of the same tokens",
        rel)


def _check_rows_independent(field, spec, kind, m, runs: _Runs) -> None:
  """What ``runs.keep`` marks must not move when the other tokens change."""
  rel = _relative_error(runs.after[runs.keep], runs.before[runs.keep])
  if not rel <= FUSED_RTOL:
    raise _layout_mismatch(
        field, spec, kind, "of a row's last document changes when the tokens of the documents "
        "(or padding) before it change, as in training with model.document_mask"
        if m.document_mask else "of one batch row changes when another row's tokens change "
        "(rows are independent examples)", rel)


def _layout_mismatch(field, spec, kind, what: str, rel: float) -> EnergyRefusal:
  hint = _MASK_HINT if kind == "attention" else _PER_TOKEN_HINT
  return EnergyRefusal(f"{field}={spec.name!r}: its update {what}: max relative error "
                    f"{rel:.3g} > {FUSED_RTOL:g}; {hint}")


def _not_finite(field, spec, kind, m, update, values, segment_ids, decoding) -> EnergyRefusal:
  """The refusal of an update with NaN or inf entries (``values``: ``[batch, rows, d_model]``
  in the training layout of ``segment_ids``, or the cached-decoding one), saying for attention
  whether only the rows that see no key have them."""
  what = _update_name(spec, update)
  if decoding:
    where = f"new tokens against a longer cache, {_DECODING}"
  else:
    where = "[batch, seq_len, d_model] inputs" + (
        " with documents and padding (model.document_mask)" if segment_ids is not None else "")
  if kind == "attention":
    hint = ("the update must be finite, and 0 on a row that sees no key: mask scores with "
            "jnp.where, not by multiplying them or their exponentials (CEM_MATH.md section 7)")
    if not decoding:
      batch, seq = values.shape[:2]
      sees = np.asarray(jnp.any(training_aux(m, segment_ids, batch, seq).mask, axis=-1))
      if not np.any(sees & ~np.all(np.isfinite(values), axis=-1)):
        where += (", on rows that see no key only (padding, or a document's first token with "
                  "model.strict_causal)")
      else:  # rows that see keys: masking is not (only) the cause
        hint += ("; on rows that see keys, an exponential not shifted by its row's max "
                 "overflows: use cem_jax.energies.masked_logsumexp")
  else:
    hint = ("the update must be finite: give a function whose jax.grad is NaN (e.g. "
            "jax.scipy.special.spence) a jax.custom_jvp (CEM_MATH.md section 2)")
  return EnergyRefusal(f"{field}={spec.name!r}: its {what} is not finite (NaN or inf) on random "
                    f"float32 {where}{_float32_note(m)}; {hint}")
