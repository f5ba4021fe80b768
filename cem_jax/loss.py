"""The output layer and the language-modelling loss: logits from the final hidden state, and the
weighted cross-entropy, at once or over blocks of positions.

At the paper's scale the logits are one of the largest activations of the step: 256 x 1024
tokens x 32,768 entries are 32 GiB per float32 copy, and the backward pass keeps more than one
(with a flash attention kernel, which keeps no seq_len² scores, they are the largest).
:func:`blockwise_cross_entropy` makes the logits of one block of positions at a time and makes
them again in the backward pass (``jax.checkpoint`` in a ``lax.scan``), so only
``[batch, block, vocab_size]`` of them live at once; its value and gradients equal those of
the whole-sequence loss up to float summation order (tests/test_loss.py, against float64
NumPy).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from cem_jax.config import check_loss_block_size

# exp(80) ~ 5.5e34 is far above any trained or untrained model's perplexity (a uniform
# guess over 65,536 pieces is e^11.1), and exp(710) overflows a float64.
PERPLEXITY_CAP_NATS = 80.0


def perplexity(loss: float) -> float:
  """``exp(loss)`` of a mean loss in nats/token (a Python float), ``loss`` capped at
  :data:`PERPLEXITY_CAP_NATS`: finite for a diverged model, where ``math.exp`` would raise
  ``OverflowError``. ``eval/perplexity`` and the tables' ``perplexity`` column."""
  return math.exp(min(loss, PERPLEXITY_CAP_NATS))


def output_logits(hidden: jax.Array, head: jax.Array) -> jax.Array:
  """The output layer.

  Args:
    hidden: ``[..., d_model]``, the final (normalised) hidden state in the compute dtype.
    head: ``[d_model, vocab_size]`` in the compute dtype (the tied embedding transposed, or
      the untied output matrix).
  Returns:
    ``[..., vocab_size]`` float32 logits: the product of the compute-dtype operands
    accumulated and written in float32 (``preferred_element_type``), never rounded to bf16
    on the way (a bf16 logit near 10 is only good to 0.06; MaxText's ``logits_dot_in_fp32``).
    The gradient's two products take the float32 cotangent cast to the compute dtype, as a
    bf16 product cast to float32 would: left to autodiff they would multiply float32 by bf16,
    which a GPU runs as a float32 product. Both are accumulated in float32 and returned in
    the operands' dtypes. Float32 (or wider) operands take the plain product: the same
    numbers as before this rule existed.
  """
  if jnp.promote_types(hidden.dtype, head.dtype).itemsize >= 4:
    return (hidden @ head).astype(jnp.float32)
  return _output_logits(hidden, head)


@jax.custom_vjp
def _output_logits(hidden, head):
  return jnp.matmul(hidden, head, preferred_element_type=jnp.float32)


def _output_logits_fwd(hidden, head):
  return _output_logits(hidden, head), (hidden, head)


def _output_logits_bwd(residuals, g):
  hidden, head = residuals
  g = g.astype(hidden.dtype)
  d_hidden = jnp.matmul(g, head.T, preferred_element_type=jnp.float32)
  d_head = jnp.einsum("...v,...d->dv", g, hidden, preferred_element_type=jnp.float32)
  return d_hidden.astype(hidden.dtype), d_head.astype(head.dtype)


_output_logits.defvjp(_output_logits_fwd, _output_logits_bwd)


def target_logit(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Each position's logit of its target, with an elementwise gradient.

  The value is a gather, which reads one entry per position. Its gradient, left to autodiff,
  is a scatter into zeros, which kept the softmax's part of the logits' gradient in a float32
  copy of its own: one more pass over the logits. Here it is ``g`` where the vocabulary index
  is the target, an elementwise expression that XLA fuses into the one pass writing the
  logits' gradient: the loss's kernels over the logits in the gpu125m step compiled for an
  H200 move 12.1 GB per 16k tokens instead of 16.4 (``experiments/step_program.py``,
  docs/PERFORMANCE.md).

  Reverse mode only (a ``jax.custom_vjp``): ``jax.grad`` and ``jax.vjp`` work, to any order;
  ``jax.jvp``, ``jax.jacfwd`` and ``jax.hessian`` raise.

  Args:
    logits: ``[..., vocab_size]`` float.
    targets: ``[...]`` int of any width, signed or not.
  Returns:
    ``[...]``, the logits' dtype: ``logits[..., target]``, NaN for a target outside
    ``[0, vocab_size)`` (negative ones included: no index wraps around), whose gradient is 0.
  """
  targets = jnp.asarray(targets)
  # A signed index type that holds vocab_size: in int8 the indices past 127 wrap (a gradient
  # at two of them) and so does ``where(targets < 0, vocab_size, ...)`` (a finite logit for a
  # negative target); an unsigned target past 2**31 would wrap to a valid index in the gather.
  targets = targets.astype(jnp.int64 if targets.dtype.itemsize == 8 else jnp.int32)
  return _target_logit(logits.shape[-1], logits, targets)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _target_logit(vocab_size, logits, targets):
  index = jnp.where(targets < 0, vocab_size, targets)[..., None]
  return jnp.take_along_axis(logits, index, axis=-1, mode="fill", fill_value=jnp.nan)[..., 0]


def _target_logit_fwd(vocab_size, logits, targets):
  return _target_logit(vocab_size, logits, targets), targets


def _target_logit_bwd(vocab_size, targets, g):
  hit = jnp.arange(vocab_size, dtype=targets.dtype) == targets[..., None]
  return jnp.where(hit, g[..., None], jnp.zeros((), g.dtype)), None


_target_logit.defvjp(_target_logit_fwd, _target_logit_bwd)


def weighted_cross_entropy(logits, targets, weights):
  """Sum of ``-log p(target)`` over weighted positions, and the sum of weights.

  Args:
    logits: ``[batch, seq_len, vocab_size]`` float32.
    targets: ``[batch, seq_len]`` int, in ``[0, vocab_size)``; another value makes the loss
      NaN (a wrong finite loss would go unnoticed).
    weights: ``[batch, seq_len]`` float32 (0 for targets across a document boundary or padding).
  Returns:
    ``(loss_sum, weight_sum)``, float32 scalars, loss in nats.
  """
  logits = logits.astype(jnp.float32)
  # log Z - logit[target], not log_softmax: the [batch, seq_len, vocab_size] log-probabilities
  # are never written (XLA's memory for the step fell from 6.2 to 3.3 float32 copies of the
  # logits, tests/test_loss.py), and the gradient (softmax - one-hot) comes from the logits.
  nll = jax.nn.logsumexp(logits, axis=-1) - target_logit(logits, targets)
  return jnp.sum(nll * weights), jnp.sum(weights)


def blockwise_cross_entropy(hidden, head, targets, weights, block_size: int = 0):
  """:func:`weighted_cross_entropy` of :func:`output_logits` ``(hidden, head)``, made over
  blocks of ``block_size`` positions so that only one block's logits exist at a time.

  Each block's logits are recomputed in the backward pass (``jax.checkpoint``): memory for the
  logits falls from ``batch x seq_len x vocab_size`` to ``batch x block_size x vocab_size``
  floats, for one more output-layer product (2 x d_model x vocab_size FLOPs per token: 6.5%
  of the 125M Llama's training step at vocab 32,768, ``model_stats.flops_per_token``). Blocks
  run along the sequence, so rows stay where the batch sharding put them. The head's gradient
  is summed over the blocks in float32 whatever the compute dtype (one float32 copy of the
  head; summed in bf16 it was 0.95% off the float64 maths at 64 blocks, against 0.21% for
  the whole sequence at once).

  Args:
    hidden: ``[batch, seq_len, d_model]``, the final hidden state (compute dtype).
    head: ``[d_model, vocab_size]`` (compute dtype).
    targets: ``[batch, seq_len]`` int.
    weights: ``[batch, seq_len]`` float32.
    block_size: positions per block; 0 (or ``seq_len``) = the whole sequence at once.
  Returns:
    ``(loss_sum, weight_sum)``, float32 scalars, loss in nats.
  Raises:
    ValueError: ``block_size`` negative, or not dividing ``seq_len``
      (:func:`cem_jax.config.check_loss_block_size`).
  """
  b, n = targets.shape
  check_loss_block_size(block_size, n)
  block_size = int(block_size)
  if block_size == 0 or block_size == n:
    return weighted_cross_entropy(output_logits(hidden, head), targets, weights)

  def blocks(x):  # [b, n, ...] -> [n / block, b, block, ...]
    return jnp.moveaxis(x.reshape(b, n // block_size, block_size, *x.shape[2:]), 1, 0)

  # The scan sums the head's gradient over the blocks in the dtype it closes over: float32,
  # cast to the compute dtype inside, so that bf16 does not round every partial sum.
  head32 = head.astype(jnp.float32)

  @jax.checkpoint
  def one_block(h, t, w):
    return weighted_cross_entropy(output_logits(h, head32.astype(head.dtype)), t, w)[0]

  def add(total, xs):
    return total + one_block(*xs), None

  total = jax.lax.scan(add, jnp.zeros((), jnp.float32),
                       (blocks(hidden), blocks(targets), blocks(weights)))[0]
  return total, jnp.sum(weights)
