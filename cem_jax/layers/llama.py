"""The Llama-style baseline block: RMSNorm, RoPE, untied Q/K/V/O, SwiGLU, no biases."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from cem_jax import attention
from cem_jax.axes import head_dim_of
from cem_jax.energies import EnergyAux, apply_rope
from cem_jax.layers.common import DTYPES, BlockOut, RMSNorm, param


class LlamaAttention(nnx.Module):
  """Causal multi-head attention, 4·d_model·num_heads·head_dim parameters.

  ``w_q``, ``w_k``, ``w_v``: ``[d_model, num_heads, head_dim]``; ``w_o``: ``[num_heads,
  head_dim, d_model]``. Call ``(x [batch, seq_len, d_model], aux) -> [batch, seq_len,
  d_model]``; a query row with no visible key outputs exactly 0 (as the CEM update does).
  The kernel is ``aux.attention_impl`` (:mod:`cem_jax.attention`).
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, h, dh = cfg.d_model, cfg.num_heads, head_dim_of(cfg)
    pdt = DTYPES[cfg.param_dtype]
    self.head_dim = dh
    self.w_q = param(rngs, (d, h, dh), cfg.init_std, ("embed", "heads", "head_dim"), pdt)
    self.w_k = param(rngs, (d, h, dh), cfg.init_std, ("embed", "heads", "head_dim"), pdt)
    self.w_v = param(rngs, (d, h, dh), cfg.init_std, ("embed", "heads", "head_dim"), pdt)
    self.w_o = param(rngs, (h, dh, d), cfg.init_std, ("heads", "head_dim", "embed"), pdt)

  def __call__(self, x: jax.Array, aux: EnergyAux, cache: dict | None = None,
               index: jax.Array | int = 0):
    """Attention output ``[batch, seq_len, d_model]``; with ``cache`` (``k``, ``v``:
    ``[batch, max_len, num_heads, head_dim]``) the new keys/values are written at ``index``
    and ``(output, cache)`` is returned."""
    dt = x.dtype
    q = jnp.einsum("btd,dhk->bthk", x, self.w_q[...].astype(dt))
    k = jnp.einsum("btd,dhk->bthk", x, self.w_k[...].astype(dt))
    v = jnp.einsum("btd,dhk->bthk", x, self.w_v[...].astype(dt))
    if aux.rope_theta is not None:
      q = apply_rope(q, aux.positions, aux.rope_theta)
      k = apply_rope(k, aux.positions, aux.rope_theta)
    if cache is not None:
      start = (0, index, 0, 0)
      cache = {"k": jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), start),
               "v": jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), start)}
      k, v = cache["k"].astype(dt), cache["v"].astype(dt)
    scale = 1.0 / math.sqrt(self.head_dim)
    if aux.is_plain_causal:
      o = attention.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                          implementation=aux.attention_impl,
                                          partition=aux.attention_partition,
                                          interpret=aux.attention_interpret)
    else:
      o = attention.dot_product_attention(
          q, k, v, scale=scale, implementation=aux.attention_impl, mask=aux.mask,
          is_causal=aux.is_causal, strict_causal=aux.strict_causal,
          segment_ids=aux.segment_ids, partition=aux.attention_partition,
          interpret=aux.attention_interpret)
    out = jnp.einsum("bthk,hkd->btd", o, self.w_o[...].astype(dt))
    return out if cache is None else (out, cache)

  def init_cache(self, batch: int, max_len: int, dtype) -> dict:
    """``{'k', 'v'}``: zeros ``[batch, max_len, num_heads, head_dim]`` in ``dtype``."""
    shape = (batch, max_len, self.w_k.shape[1], self.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


class SwiGLU(nnx.Module):
  """``W_down (silu(W_gate x) ⊙ W_up x)``, 3·d_model·mlp_dim parameters (Shazeer 2020,
  arXiv:2002.05202).

  ``w_gate``, ``w_up``: ``[d_model, mlp_dim]``; ``w_down``: ``[mlp_dim, d_model]``.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.mlp_dim
    pdt = DTYPES[cfg.param_dtype]
    self.w_gate = param(rngs, (d, f), cfg.init_std, ("embed", "mlp"), pdt)
    self.w_up = param(rngs, (d, f), cfg.init_std, ("embed", "mlp"), pdt)
    self.w_down = param(rngs, (f, d), cfg.init_std, ("mlp", "embed"), pdt)

  def __call__(self, x: jax.Array) -> jax.Array:
    dt = x.dtype
    hidden = jax.nn.silu(x @ self.w_gate[...].astype(dt)) * (x @ self.w_up[...].astype(dt))
    return hidden @ self.w_down[...].astype(dt)


class LlamaBlock(nnx.Module):
  """Pre-norm block ``h = x + attn(norm(x)); y = h + mlp(norm(h))``.

  Same call signature as :class:`cem_jax.layers.CEMBlock`; ``num_steps``, ``trace`` and
  ``velocity`` are accepted for a uniform interface (the block has no energy: the trace is
  empty; no momentum: the velocity is None). The decoding cache holds the rotated keys and
  the values of every layer.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    pdt = DTYPES[cfg.param_dtype]
    self.dtype = DTYPES[cfg.dtype]
    self.norm_att = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    self.norm_mlp = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    self.attn = LlamaAttention(cfg, rngs=rngs)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def __call__(self, x, aux, num_steps: int | None = None, trace: bool = False,
               cache: dict | None = None, index: jax.Array | int = 0,
               velocity: jax.Array | None = None) -> BlockOut:
    """``BlockOut(y, [], cache)``: ``y`` ``[batch, seq_len, d_model]`` in ``model.dtype``
    from ``x`` of that shape. With ``cache`` (:meth:`init_cache`: ``{'k', 'v'}``, ``[batch,
    max_len, num_heads, head_dim]`` in ``model.dtype``) ``x`` holds the new tokens at
    positions ``index, index+1, ...``, whose keys and values are written into the returned
    cache (None without one)."""
    del num_steps, trace, velocity
    x = x.astype(self.dtype)
    if cache is None:
      h = x + self.attn(self.norm_att(x), aux)
      return BlockOut(h + self.mlp(self.norm_mlp(h)), [])
    a, cache = self.attn(self.norm_att(x), aux, cache, index)
    h = x + a
    return BlockOut(h + self.mlp(self.norm_mlp(h)), [], cache)

  def init_cache(self, batch: int, max_len: int, num_steps: int | None = None) -> dict:
    """Empty key/value cache for decoding up to ``max_len`` tokens: ``{'k', 'v'}``, zeros
    ``[batch, max_len, num_heads, head_dim]`` in ``model.dtype``."""
    del num_steps
    return self.attn.init_cache(batch, max_len, self.dtype)
