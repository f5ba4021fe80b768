"""Parameter helpers, RMSNorm and the blocks' return type shared by the CEM and Llama layers."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from cem_jax import config

# config.DTYPES is the one list of names (config must stay jax-free); this maps them to jnp.
DTYPES = {name: getattr(jnp, name) for name in config.DTYPES}

# Parameters whose name is in this set are weight-decayed; everything else (norm scales, step
# sizes, temperatures, diagonals, preconditioners) never is. Decay goes by name, not by rank,
# so stacking layers cannot change what is decayed.
DECAYED_PARAM_NAMES = frozenset(
    {"w_q", "w_k", "w_v", "w_o", "w", "g", "w_gate", "w_up", "w_down", "embedding", "lm_head"}
)


class BlockOut(NamedTuple):
  """What every block's ``__call__`` returns, whatever options it ran with.

  ``y``: ``[batch, seq_len, d_model]`` in ``model.dtype``; ``trace``: the energy trace, a list
  with one dict per recursive step (empty without ``trace=True``, and always for a Llama
  block); ``cache``: the updated decoding cache (the block's ``init_cache`` layout), None when
  not decoding; ``velocity``: ``[batch, seq_len, d_model]``, the momentum carried to the next
  layer, None without ``model.inner_optimizer`` heavy_ball or nesterov.
  """

  y: jax.Array
  trace: list
  cache: dict | None = None
  velocity: jax.Array | None = None


def param(rngs: nnx.Rngs, shape, std: float, logical_axes, dtype=jnp.float32) -> nnx.Param:
  """A normal(0, std) parameter annotated with logical axis names (``sharding.py`` maps them)."""
  value = std * jax.random.normal(rngs.params(), shape, dtype)
  return nnx.Param(value, logical_axes=tuple(logical_axes))


def const_param(value, logical_axes, dtype=jnp.float32) -> nnx.Param:
  """An ``nnx.Param`` holding ``value`` (array-like) in ``dtype``, with its logical axes."""
  return nnx.Param(jnp.asarray(value, dtype), logical_axes=tuple(logical_axes))


def softplus_inverse(x: float) -> float:
  """``y`` with ``softplus(y) == x`` for ``x > 0``."""
  # log(e^x - 1) = x + log(1 - e^-x): no overflow for large x. Plain Python: also valid
  # under nnx.eval_shape.
  return x + math.log(-math.expm1(-x))


class RMSNorm(nnx.Module):
  """RMSNorm ``x / sqrt(mean(x²) + eps) · scale`` over the last axis, computed in float32
  (Zhang & Sennrich 2019, arXiv:1910.07467).

  Input ``[..., d_model]`` in any float dtype; output in the same dtype. ``scale`` starts at 1.
  """

  def __init__(self, d_model: int, eps: float, param_dtype=jnp.float32):
    self.scale = const_param(jnp.ones((d_model,)), ("embed",), param_dtype)
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * inv * self.scale[...].astype(jnp.float32)).astype(x.dtype)
