"""What every energy receives besides ``y``, ``context`` and ``params``.

The signature of an energy (built-in or user-defined) is::

    energy(y, context, params, aux) -> scalar

- ``y``: ``[batch, seq_len, d_model]`` float, the update variable (CEM_MATH.md "Notation").
- ``context``: ``[batch, context_len, d_model]`` float, held fixed: the update differentiates
  ``y`` only. ``context_len = seq_len`` in training; in cached decoding ``y`` holds the new
  tokens and the attention slot's context the whole cache (``aux.mask``'s last axis).
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

import functools

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
    segment_ids: ``[batch, seq_len]`` int document ids (0 = padding) that ``mask`` was built
      from, or None: kernels that take segment ids (splash) use them instead of ``mask``.
    is_causal: True when ``mask`` is the causal triangle (strict if ``strict_causal``)
      restricted to ``segment_ids`` (training; False when decoding against a cache) (static).
    strict_causal: ``N(i) = {j < i}`` (static).
    attention_impl: the attention kernel of fused updates: ``'xla'``, ``'cudnn'`` or
      ``'splash'`` (resolved by :func:`cem_jax.attention.resolve`, static).
    attention_partition: ``(batch mesh axes, heads mesh axes)`` for a kernel that runs per
      device under ``shard_map`` (splash); None: the default rules' (static).
    attention_interpret: run splash in Pallas's interpret mode; None: off a TPU (this
      machine's backend), False when compiling for a TPU from another machine (static).
    energy_block_size: query and key block of the interaction energy's online log-sum-exp
      (:func:`blockwise_logsumexp`); 0 = dense scores (static).
  """

  mask: jax.Array
  positions: jax.Array
  key_positions: jax.Array | None = None
  rope_theta: float | None = flax.struct.field(pytree_node=False, default=10_000.0)
  diagonal_form: str = flax.struct.field(pytree_node=False, default="bilinear")
  is_plain_causal: bool = flax.struct.field(pytree_node=False, default=False)
  real: jax.Array | None = None
  segment_ids: jax.Array | None = None
  is_causal: bool = flax.struct.field(pytree_node=False, default=False)
  strict_causal: bool = flax.struct.field(pytree_node=False, default=False)
  attention_impl: str = flax.struct.field(pytree_node=False, default="xla")
  attention_partition: tuple | None = flax.struct.field(pytree_node=False, default=None)
  attention_interpret: bool | None = flax.struct.field(pytree_node=False, default=None)
  energy_block_size: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def context_positions(self) -> jax.Array:
    """Positions of the context tokens (``key_positions``, else ``positions``)."""
    return self.positions if self.key_positions is None else self.key_positions


def masked_logsumexp(scores: jax.Array, mask: jax.Array) -> jax.Array:
  """``log Σ_j exp(scores[..., j])`` over visible ``j``; exactly 0 for a row with none.

  Unlike ``jax.nn.logsumexp(where=...)`` this has finite first and second derivatives on an
  all-masked row (jax#6811: ``grad`` of an all ``-inf`` row is NaN; here no NaN arises even in
  between, so ``jax_debug_nans`` passes), and unlike a finite
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


def blockwise_logsumexp(q: jax.Array, k: jax.Array, mask, block_size: int,
                        scale: jax.Array | float = 1.0) -> jax.Array:
  """``log Σ_j exp(scale_h q_i · k_j)`` over visible keys, one block at a time (online).

  Equal to ``masked_logsumexp(scale * einsum('bthe,bshe->bhts', q, k), mask[:, None])`` (tested to
  1e-5 in float32, gradients included; a row with no visible key gives exactly 0 and a zero
  gradient), but ``jax.grad`` keeps only running maxima and sums per block instead of the
  ``[batch, heads, t, s]`` scores: a ``lax.scan`` over query blocks of a ``lax.scan`` over
  key blocks, both bodies ``jax.checkpoint``-ed (memory-efficient attention, Rabe & Staats
  2021, arXiv:2112.05682, applied to an energy), so a second derivative (a training step
  through ``jax.grad`` of the energy) also needs memory linear in ``t``. Use it in a user
  energy whose scores are a dot product: fold temperatures into ``q``, extra score terms into
  extra columns of ``q`` and ``k``, and add per-query constants outside
  (``lse(s + a_i) = lse(s) + a_i``).

  Args:
    q: ``[batch, t, heads, e]`` float; the scores are formed in float32
      (``preferred_element_type``) whatever its dtype.
    k: ``[batch, s, heads, e]``, same dtype as ``q``.
    mask: ``[batch, t, s]`` bool, True where query ``i`` sees key ``j``; or a function of
      ``(rows, cols)`` (``[m]`` and ``[n]`` int32 query and key indices, in range) giving that
      mask's ``[batch, m, n]`` block (:func:`cem_jax.masks.mask_block`), so that no
      ``[batch, t, s]`` array is built (with ``block_size`` 0 it is called once, for all).
    block_size: keys and queries per block (>= 1; at most ``s`` keys and ``t`` queries are
      used; ``s`` is padded with invisible keys, ``t`` with rows sliced off, to multiples),
      or 0 for the dense ``[batch, heads, t, s]`` scores at once (``model.energy_block_size``'s
      default: an energy passes ``aux.energy_block_size`` on and follows the setting).
    scale: a float or ``[heads]`` float32 inverse temperature, applied to the float32 scores.
  Returns:
    ``[batch, heads, t]`` float32.
  Raises:
    ValueError: ``block_size`` < 0.
  """
  if block_size < 0:
    raise ValueError(f"block_size={block_size}; allowed: 0 (dense scores) or an int >= 1")
  b, t, h, e = q.shape
  s = k.shape[1]
  scale = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (h,))[None, :, None, None]
  if block_size == 0:
    if callable(mask):
      mask = mask(jnp.arange(t), jnp.arange(s))
    scores = jnp.einsum("bthe,bshe->bhts", q, k, preferred_element_type=jnp.float32)
    return masked_logsumexp(scores * scale, mask[:, None])
  # Never pad a short sequence (a decoding step's one query) up to one long block.
  bq, bk = min(block_size, t), min(block_size, s)
  nq, nb = -(-t // bq), -(-s // bk)
  pad_q, pad = nq * bq - t, nb * bk - s
  if pad or pad_q:  # invisible keys; query rows that see nothing (0, sliced off below)
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q = jnp.pad(q, ((0, 0), (0, pad_q), (0, 0), (0, 0)))
    if not callable(mask):
      mask = jnp.pad(mask, ((0, 0), (0, pad_q), (0, pad)))
  k_blocks = jnp.moveaxis(k.reshape(b, nb, bk, h, e), 1, 0)
  q_blocks = jnp.moveaxis(q.reshape(b, nq, bq, h, e), 1, 0)

  def block_mask(iq, ik):  # [b, bq, bk] of query block iq and key block ik, where it is used
    if not callable(mask):
      return jax.lax.dynamic_slice(mask, (0, iq * bq, ik * bk), (b, bq, bk))
    rows, cols = iq * bq + jnp.arange(bq), ik * bk + jnp.arange(bk)
    inside = (rows < t)[:, None] & (cols < s)[None, :]
    return mask(jnp.minimum(rows, t - 1), jnp.minimum(cols, s - 1)) & inside[None]

  @jax.checkpoint
  def key_block(qb, iq, carry, xs):
    run_max, run_sum = carry  # [b, h, bq]: max over visible keys so far (-inf: none), Σ exp
    kb, ik = xs
    scores = jnp.einsum("bthe,bshe->bhts", qb, kb, preferred_element_type=jnp.float32)
    scores = scores * scale
    mb = block_mask(iq, ik)[:, None]
    # The shift is a constant for the gradient (softmax = exp(s - lse) either way).
    blk_max = jax.lax.stop_gradient(jnp.max(jnp.where(mb, scores, -jnp.inf), axis=-1))
    new_max = jnp.maximum(run_max, blk_max)
    shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    # exp(-inf) = 0 and its derivative too: masked entries can never give NaN gradients.
    p = jnp.exp(jnp.where(mb, scores - shift[..., None], -jnp.inf))
    rescale = jnp.exp(jnp.where(jnp.isfinite(run_max), run_max - shift, -jnp.inf))
    return (new_max, run_sum * rescale + jnp.sum(p, axis=-1)), None

  # Query blocks too, each checkpointed: a second derivative (a training step through
  # jax.grad of the energy) then keeps one query block's per-key-block residuals at a time,
  # not every query's (memory ~linear in seq_len, measured in tests/test_attention.py).
  @jax.checkpoint
  def query_block(_, xs):
    qb, iq = xs
    init = (jnp.full((b, h, bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, h, bq), jnp.float32))
    (run_max, run_sum), _ = jax.lax.scan(functools.partial(key_block, qb, iq), init,
                                         (k_blocks, jnp.arange(nb)))
    any_visible = jnp.isfinite(run_max)
    shift = jnp.where(any_visible, run_max, 0.0)
    return None, jnp.where(any_visible, shift + jnp.log(jnp.where(any_visible, run_sum, 1.0)), 0.0)

  _, lse = jax.lax.scan(query_block, None, (q_blocks, jnp.arange(nq)))  # [nq, b, h, bq]
  return jnp.moveaxis(lse, 0, 2).reshape(b, h, nq * bq)[..., :t]
