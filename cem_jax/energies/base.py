"""What every energy receives besides ``y``, ``context`` and ``params``.

The signature of an energy (built-in or user-defined) is::

    energy(y, context, params, aux) -> scalar

- ``y``: ``[batch, seq_len, d_model]`` float, the update variable (CEM_MATH.md "Notation").
- ``context``: ``[batch, seq_len, d_model]`` float, held fixed: the update differentiates
  ``y`` only.
- ``params``: a dict of arrays supplied by the layer that owns the energy (see
  ``cem_jax.layers``): the attention slot gets ``w_q``, ``w_k`` (``[d_model, num_heads,
  head_dim]``), ``eta``, ``beta`` (``[num_heads]``, positive) and, with a diagonal,
  ``diag`` (``[num_heads, d_model]``); the MLP slot gets ``w``, ``g`` (``[d_model, mlp_dim]``)
  and ``eta`` (``[]``).
- ``aux``: :class:`EnergyAux`, the causal structure (mask, positions) and static options.

The energy returns the *sum* over batch and positions of the per-position energies
``E_i(y_i | c)``. The sum is separable in the ``y_i``, so one ``jax.grad`` gives every
position's update at once and causality follows from the mask alone.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class EnergyAux:
  """Causal structure and static options shared by all energies of a layer.

  Attributes:
    mask: ``[batch, seq_len, context_len]`` bool (``context_len = seq_len`` in training);
      ``mask[b, i, j]`` is True when query ``i`` may see key ``j`` (causal, same document,
      not padding). Rows may be all False (a padded query, or position 0 with
      ``strict_causal``): their energy and update are exactly 0.
    positions: ``[batch, seq_len]`` int32 positions of the queries (``y``), used by RoPE.
    key_positions: ``[batch, context_len]`` int32 positions of the context (keys), or None
      when they are ``positions`` (training; in cached decoding ``y`` holds the new tokens and
      ``context`` the whole cache). Read them through :attr:`context_positions`.
    rope_theta: RoPE base; ``None`` turns RoPE off (static).
    diagonal_form: ``'bilinear'`` or ``'distance'`` (static, CEM_MATH.md section 1).
    is_plain_causal: True when ``mask`` is exactly the lower triangle ``j <= i`` with no
      segments or padding, so fused kernels may use ``is_causal=True`` (static).
    real: ``[batch, seq_len]`` bool, True where the query holds a real token (not padding),
      or None when all do. Only the layers' energy trace reads it (to sum over real tokens);
      energies need not.
  """

  mask: jax.Array
  positions: jax.Array
  key_positions: jax.Array | None = None
  rope_theta: float | None = flax.struct.field(pytree_node=False, default=10_000.0)
  diagonal_form: str = flax.struct.field(pytree_node=False, default="bilinear")
  is_plain_causal: bool = flax.struct.field(pytree_node=False, default=False)
  real: jax.Array | None = None

  @property
  def context_positions(self) -> jax.Array:
    """Positions of the context tokens (``key_positions``, else ``positions``)."""
    return self.positions if self.key_positions is None else self.key_positions


def make_mask(
    segment_ids: jax.Array | None,
    seq_len: int,
    batch: int,
    *,
    strict: bool = False,
) -> jax.Array:
  """Builds the causal visibility mask ``[batch, seq_len, seq_len]`` (bool).

  ``j <= i`` (``j < i`` if ``strict``), restricted to ``segment_ids[i] == segment_ids[j]``
  and ``segment_ids > 0`` (0 marks padding) when ``segment_ids`` (``[batch, seq_len]`` int)
  is given. Source: CEM_MATH.md sections 1 and 7.
  """
  i = jnp.arange(seq_len)[:, None]
  j = jnp.arange(seq_len)[None, :]
  causal = (j < i) if strict else (j <= i)
  mask = jnp.broadcast_to(causal, (batch, seq_len, seq_len))
  if segment_ids is not None:
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids[:, :, None] > 0) & (segment_ids[:, None, :] > 0)
    mask = mask & same & real
  return mask


def masked_logsumexp(scores: jax.Array, mask: jax.Array) -> jax.Array:
  """``log Σ_j exp(scores[..., j])`` over visible ``j``; exactly 0 for a row with none.

  Unlike ``jax.nn.logsumexp(where=...)`` this has finite first and second derivatives on an
  all-masked row (jax#6811: ``grad`` of an all ``-inf`` row is NaN), and unlike a finite
  ``-1e9`` fill it never lets a masked entry contribute (CEM_MATH.md section 7).

  Args:
    scores: ``[..., n]`` float.
    mask: bool, broadcastable to ``scores``.
  Returns:
    ``[...]`` float, same dtype as ``scores``.
  """
  mask = jnp.broadcast_to(mask, scores.shape)
  safe = jnp.where(mask, scores, 0.0)
  row_max = jax.lax.stop_gradient(jnp.max(jnp.where(mask, safe, -jnp.inf), axis=-1))
  any_visible = jnp.any(mask, axis=-1)
  row_max = jnp.where(any_visible, row_max, 0.0)
  total = jnp.sum(jnp.where(mask, jnp.exp(safe - row_max[..., None]), 0.0), axis=-1)
  total = jnp.where(any_visible, total, 1.0)
  return jnp.where(any_visible, row_max + jnp.log(total), 0.0)
