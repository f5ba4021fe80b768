"""The causal multi-head interaction (log-sum-exp) energy: weight-tied attention.

CEM_MATH.md section 1::

    E_att(y | c) = - Σ_i Σ_k (η_k / β_k) log Σ_{j ∈ N(i)} exp(β_k s_k(y_i, c_j))
    s_k(y, c)    = <R_i W_Qk y, R_j W_Kk c>                     (+ diagonal term)

Its negative gradient is causal multi-head attention with ``W_V = W_K`` and ``W_O = W_Qᵀ``,
which :func:`fused_update` computes in closed form through
:func:`cem_jax.attention.dot_product_attention` (query ``β q``, key ``k``, value ``k``, scale 1;
the kernel is ``aux.attention_impl``). The per-head step size ``η_k`` weights each head's
energy, so ``-∇E`` already carries it.

Diagonal-plus-low-rank (``A_k = diag(d_k) + W_Qkᵀ W_Kk``):
  - bilinear: ``s += Σ_m d_km y_m c_jm``; update gains ``η_k d_k ⊙ Σ_j a_ij c_j``;
  - distance: ``s += -½ Σ_m d_km (y_m - c_jm)²``; update gains ``η_k d_k ⊙ (Σ_j a_ij c_j - y)``.
The fused form uses one augmented head ``q̃ = [q, d⊙y, -½]``, ``k̃ = ṽ = [k, c, Σ d c²]``
(the last column only for the distance form). That head is wider than flash kernels allow,
so a diagonal always runs on XLA, in float32: with bf16 compute the distance form's
``cross - ½(Σd·y² + Σd·c²)`` cancels, and bf16 rounding of each term gave 1.7e-2 relative
error. For the same reason the energy forms every score with float32 accumulation and output
(``preferred_element_type``) and the diagonal terms from float32 inputs.

With ``aux.energy_block_size > 0`` the energy is evaluated by
:func:`cem_jax.energies.base.blockwise_logsumexp` over query and key blocks, so ``jax.grad`` of
it (the autodiff update), and a training step through that, need memory linear in seq_len
instead of the ``[batch, heads, n, n]`` scores; same value and gradient as the dense form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cem_jax import attention
from cem_jax.energies.base import EnergyAux, blockwise_logsumexp, masked_logsumexp
from cem_jax.energies.rope import apply_rope
from cem_jax.masks import mask_block, visible_rows


def _project(y, context, params, aux):
  q = jnp.einsum("btd,dhk->bthk", y, params["w_q"])
  k = jnp.einsum("bsd,dhk->bshk", context, params["w_k"])
  if aux.rope_theta is not None:
    q = apply_rope(q, aux.positions, aux.rope_theta)
    k = apply_rope(k, aux.context_positions, aux.rope_theta)
  return q, k


def interaction_energy(y: jax.Array, context: jax.Array, params: dict, aux: EnergyAux):
  """Total interaction energy (a scalar, float32 accumulation).

  Args:
    y: ``[batch, seq_len, d_model]`` update variable (queries).
    context: ``[batch, context_len, d_model]`` fixed context (keys; ``context_len =
      seq_len`` in training, the cache length when decoding).
    params: ``w_q``, ``w_k``: ``[d_model, num_heads, head_dim]``; ``eta``, ``beta``:
      ``[num_heads]``; optional ``diag``: ``[num_heads, d_model]``.
    aux: mask, positions, RoPE, diagonal form and ``energy_block_size``
      (:class:`EnergyAux`).
  Returns:
    ``[]`` float32: ``Σ_{b,i,k} -(η_k/β_k) lse_k(b, i)``; rows with no visible key give 0.
    CEM_MATH.md section 1, each head weighted by its step size η_k (its "Step size" note).
  Raises:
    ValueError: ``aux.diagonal_form`` not 'bilinear' or 'distance' (with a diagonal).
  """
  if aux.energy_block_size > 0:
    return _blockwise_energy(y, context, params, aux)
  q, k = _project(y, context, params, aux)
  scores = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32)
  diag = params.get("diag")
  if diag is not None:
    y32, c32, d32 = (a.astype(jnp.float32) for a in (y, context, diag))
    cross = jnp.einsum("btd,hd,bsd->bhts", y32, d32, c32)
    if aux.diagonal_form == "bilinear":
      scores = scores + cross
    elif aux.diagonal_form == "distance":
      y_sq = jnp.einsum("btd,hd->bht", y32 * y32, d32)[..., :, None]
      c_sq = jnp.einsum("bsd,hd->bhs", c32 * c32, d32)[..., None, :]
      scores = scores + cross - 0.5 * (y_sq + c_sq)
    else:
      raise ValueError(f"diagonal_form={aux.diagonal_form!r}; allowed: bilinear, distance")
  beta = params["beta"].astype(jnp.float32)
  scores = scores * beta[None, :, None, None]
  lse = masked_logsumexp(scores, aux.mask[:, None, :, :])  # [b, h, t]
  weight = params["eta"].astype(jnp.float32) / beta
  return -jnp.sum(lse * weight[None, :, None])


def _augmented_head(y, context, q, k, diag, form):
  """``q̃ = [q, d⊙y, -½]``, ``k̃ = [k, c, Σ d c²]`` in float32 (module docstring), and the
  per-query constant ``-½ Σ d y²`` of the distance form (``[b, h, t]``, or None)."""
  b, t, d = y.shape
  num_heads = q.shape[2]
  y32, c32, d32 = (a.astype(jnp.float32) for a in (y, context, diag))
  q_parts = [q.astype(jnp.float32), y32[:, :, None, :] * d32[None, None]]
  k_parts = [k.astype(jnp.float32),
             jnp.broadcast_to(c32[:, :, None, :], (b, context.shape[1], num_heads, d))]
  row_const = None
  if form == "distance":
    q_parts.append(jnp.full((b, t, num_heads, 1), -0.5, jnp.float32))
    k_parts.append(jnp.einsum("bsd,hd->bsh", c32 * c32, d32)[..., None])
    row_const = -0.5 * jnp.einsum("btd,hd->bht", y32 * y32, d32)
  elif form != "bilinear":
    raise ValueError(f"diagonal_form={form!r}; allowed: bilinear, distance")
  return jnp.concatenate(q_parts, axis=-1), jnp.concatenate(k_parts, axis=-1), row_const


def _blockwise_energy(y, context, params, aux):
  q, k = _project(y, context, params, aux)
  beta = params["beta"].astype(jnp.float32)
  row_const = None
  diag = params.get("diag")
  if diag is not None:
    q, k, row_const = _augmented_head(y, context, q, k, diag, aux.diagonal_form)
  mask = aux.mask
  if aux.is_causal:  # training: each block made from the documents, aux.mask left unread
    mask = functools.partial(mask_block, aux.segment_ids, batch=y.shape[0],
                             strict=aux.strict_causal)
  lse = blockwise_logsumexp(q, k, mask, aux.energy_block_size, beta)  # [b, h, t]
  if row_const is not None:  # lse(s + a_i) = lse(s) + a_i on rows that see a key
    visible = visible_rows(None if aux.is_causal else aux.mask, is_causal=aux.is_causal,
                           strict=aux.strict_causal, segment_ids=aux.segment_ids,
                           shape=y.shape[:2])
    if visible is not None:
      row_const = jnp.where(visible[:, None, :], row_const, 0.0)
    lse = lse + beta[None, :, None] * row_const
  weight = params["eta"].astype(jnp.float32) / beta
  return -jnp.sum(lse * weight[None, :, None])


def fused_update(y: jax.Array, context: jax.Array, params: dict, aux: EnergyAux):
  """``-∇_y interaction_energy`` in closed form (attention with ``v = k``, ``W_O = W_Qᵀ``).

  Same arguments as :func:`interaction_energy`; the attention kernel is
  ``aux.attention_impl`` (a diagonal needs ``'xla'``). Returns ``[batch, seq_len, d_model]``
  in ``y.dtype``; rows with no visible key are exactly 0. Equal to the autodiff gradient
  (tested to 1e-5 relative in float32).

  Raises:
    ValueError: a diagonal with ``aux.attention_impl`` other than ``'xla'``, or an unknown
      ``aux.diagonal_form``; and as :func:`cem_jax.attention.dot_product_attention` (e.g.
      'splash' at a length that is not a multiple of 128).
  """
  q, k = _project(y, context, params, aux)
  head_dim = q.shape[3]
  diag = params.get("diag")
  impl = aux.attention_impl
  if diag is not None:
    if impl != "xla":
      width = head_dim + y.shape[-1] + (aux.diagonal_form == "distance")
      raise ValueError(f"attention_impl={impl!r} cannot take the CEM per-head diagonal's "
                       f"augmented head (width {width}); use 'xla'")
    # Heads and rows pinned where the rules put them, around the widening and on the kernel's
    # output: with `batch` and `heads` on one mesh axis (mesh.rules batch -> (data, tensor),
    # heads -> tensor) XLA kept the heads on it, and with one row per device (2 x 2 x 2, or
    # a microbatch) half the rows' updates and the gradients were wrong (CPU, jax 0.10.2,
    # GSPMD and Shardy alike; tests/test_sharding.py).
    q, k = (attention.heads_laid_out(a, aux.attention_partition) for a in (q, k))
    q, k, _ = _augmented_head(y, context, q, k, diag, aux.diagonal_form)
    q, k = (attention.heads_laid_out(a, aux.attention_partition) for a in (q, k))
    # The -½ Σ d y² row constant leaves the softmax unchanged.
  beta = params["beta"].astype(jnp.float32)
  eta = params["eta"].astype(jnp.float32)
  # Per-head inverse temperature, so scale=1. β·q is formed in float32 and rounded once: with
  # β cast to bf16 first, a learned β's gradient was a bf16 sum over every token, returned as
  # a bf16 number (3.6e-2 off the float64 maths; tests/test_reference.py). Float32 q: as before.
  q = (q.astype(jnp.promote_types(q.dtype, jnp.float32)) * beta[None, None, :, None]
       ).astype(q.dtype)
  if aux.is_plain_causal:
    out = attention.dot_product_attention(q, k, k, scale=1.0, implementation=impl,
                                          is_causal=True, partition=aux.attention_partition,
                                          interpret=aux.attention_interpret)
  else:
    out = attention.dot_product_attention(
        q, k, k, scale=1.0, implementation=impl, mask=aux.mask, is_causal=aux.is_causal,
        strict_causal=aux.strict_causal, segment_ids=aux.segment_ids,
        partition=aux.attention_partition, interpret=aux.attention_interpret)
  if diag is not None:
    out = attention.heads_laid_out(out, aux.attention_partition)
  o = out[..., :head_dim]
  if aux.rope_theta is not None:
    o = apply_rope(o, aux.positions, aux.rope_theta, inverse=True)
  dt = o.dtype
  # η scales the [d_model, heads, head_dim] output weight, not the [batch, seq_len, heads,
  # head_dim] output: the same product, with its multiply and its gradient's reduction over
  # the weight instead of every token. η·W_Q is formed in float32 and rounded once to dt
  # (η itself is not rounded to bf16 first).
  wide = jnp.promote_types(dt, jnp.float32)
  w_out = (params["w_q"].astype(wide) * eta.astype(wide)[None, :, None]).astype(dt)
  update = jnp.einsum("bthk,dhk->btd", o, w_out)
  if diag is not None:
    agg = out[..., head_dim : head_dim + y.shape[-1]]  # Σ_j a_ij c_j   [b, t, h, d] (f32)
    if aux.diagonal_form == "distance":  # -y_i, on the rows that see a key (the others: 0)
      rows = visible_rows(aux.mask, is_causal=aux.is_causal, strict=aux.strict_causal,
                          segment_ids=aux.segment_ids, shape=y.shape[:2])
      y32 = y.astype(jnp.float32)
      agg = agg - (y32 if rows is None else y32 * rows[..., None])[:, :, None, :]
    update = update + jnp.einsum("bthd,hd->btd", agg,
                                 diag.astype(jnp.float32) * eta[:, None])  # η on the weight
  # The kernel's output is exactly 0 on a row with no visible key, so is the update there.
  return update.astype(y.dtype)
