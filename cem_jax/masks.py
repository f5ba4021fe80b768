"""The causal visibility structure, in one place for the energies and the attention kernels.

A query ``i`` sees key ``j`` when ``j <= i`` (``j < i`` with ``strict``), both lie in the same
document and neither is padding (segment id 0). Source: CEM_MATH.md sections 1 and 7.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
  index = jnp.arange(seq_len)
  return mask_block(segment_ids, index, index, batch, strict=strict)


def mask_block(segment_ids: jax.Array | None, rows: jax.Array, cols: jax.Array, batch: int,
               *, strict: bool = False) -> jax.Array:
  """``make_mask(segment_ids, seq_len, batch, strict=strict)[:, rows][:, :, cols]`` without
  the ``seq_len x seq_len`` mask: ``[batch, len(rows), len(cols)]`` bool, for a kernel that
  visits the mask one block at a time (:func:`cem_jax.energies.blockwise_logsumexp`).

  Args:
    segment_ids: ``[batch, seq_len]`` int, or None (no documents, no padding).
    rows, cols: ``[m]`` and ``[n]`` int query and key positions in ``[0, seq_len)``.
    batch: rows of the batch (used when ``segment_ids`` is None).
    strict: ``j < i`` instead of ``j <= i``.
  Returns:
    ``[batch, len(rows), len(cols)]`` bool, True where query ``rows[a]`` sees key ``cols[c]``.
  Source: CEM_MATH.md sections 1 and 7 (as :func:`make_mask`).
  """
  i, j = rows[:, None], cols[None, :]
  causal = (j < i) if strict else (j <= i)
  mask = jnp.broadcast_to(causal, (batch, rows.shape[0], cols.shape[0]))
  if segment_ids is not None:
    seg_i, seg_j = segment_ids[:, rows], segment_ids[:, cols]
    # Same document and not padding: seg_j > 0 with seg_i == seg_j implies seg_i > 0.
    mask = mask & (seg_i[:, :, None] == seg_j[:, None, :]) & (seg_j[:, None, :] > 0)
  return mask


def visible_rows(mask: jax.Array | None, *, is_causal: bool, strict: bool,
                 segment_ids: jax.Array | None, shape: tuple[int, int]) -> jax.Array | None:
  """``[batch, t]`` bool: queries with at least one visible key (None: every one).

  From ``mask`` (``[batch, t, context_len]`` bool) when given, else from the structure
  (``is_causal``, ``strict``, ``segment_ids`` ``[batch, t]`` int) without building the
  ``t x t`` mask. ``shape`` is ``(batch, t)``.
  """
  if mask is not None:
    return jnp.any(mask, axis=-1)
  b, t = shape
  rows = jnp.ones((b, t), bool)
  if strict:
    rows = rows & (jnp.arange(t) > 0)[None]
  if segment_ids is not None:
    rows = rows & (segment_ids > 0)
    if strict:  # a document's first token sees nothing before it
      rows = rows & ~_first_of_its_id(segment_ids)
  return None if (is_causal and not strict and segment_ids is None) else rows


def _first_of_its_id(ids: jax.Array) -> jax.Array:
  """``[batch, t]`` bool: True where ``ids`` (``[batch, t]`` int) holds an id for the first
  time in its row. Ids need not form contiguous runs (a document may come back later in a
  window); a stable sort keeps this O(t log t), where comparing with the previous position
  would hold only for runs."""
  order = jnp.argsort(ids, axis=-1, stable=True)
  ranked = jnp.take_along_axis(ids, order, axis=-1)
  first = jnp.concatenate([jnp.ones_like(ranked[:, :1], bool), ranked[:, 1:] != ranked[:, :-1]],
                          axis=-1)
  return jnp.take_along_axis(first, jnp.argsort(order, axis=-1), axis=-1)
