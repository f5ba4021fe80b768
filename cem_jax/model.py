"""The decoder language model: embedding → blocks → final RMSNorm → LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from cem_jax.energies import EnergyAux, make_mask
from cem_jax.layers import DTYPES, CEMBlock, LlamaBlock, RMSNorm
from cem_jax.layers.common import param

BLOCK_TYPES = {"cem": CEMBlock, "llama": LlamaBlock}
# model.remat -> jax.checkpoint policy: 'full' saves nothing, 'dots' keeps matmul outputs.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class DecoderLM(nnx.Module):
  """A decoder-only LM whose blocks are CEM layers or Llama blocks (``model.block``).

  Parameters: ``embedding`` ``[vocab_size, d_model]``; ``blocks``; ``final_norm``; and,
  unless ``model.tie_embeddings``, ``lm_head`` ``[d_model, vocab_size]``.

  Args:
    cfg: the ``model`` config group (``cem_jax.config``).
    vocab_size: number of token ids (the tokenizer's, ``data.vocab_size``).
    rngs: ``nnx.Rngs`` with a ``params`` stream.
  Raises:
    ValueError: unknown ``model.block``, or an energy/update option the layers reject.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, vocab_size: int, *, rngs: nnx.Rngs):
    cfg = ml_collections.FrozenConfigDict(cfg)
    if cfg.block not in BLOCK_TYPES:
      raise ValueError(f"model.block={cfg.block!r}; allowed: {', '.join(BLOCK_TYPES)}")
    self.cfg = cfg
    self.dtype = DTYPES[cfg.dtype]
    pdt = DTYPES[cfg.param_dtype]
    self.embedding = param(rngs, (vocab_size, cfg.d_model), cfg.init_std,
                           ("vocab", "embed"), pdt)
    block_cls = BLOCK_TYPES[cfg.block]
    self.blocks = nnx.List([block_cls(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    if not cfg.tie_embeddings:
      self.lm_head = param(rngs, (cfg.d_model, vocab_size), cfg.init_std,
                           ("embed", "vocab"), pdt)

  def make_aux(self, segment_ids: jax.Array | None, batch: int, seq_len: int) -> EnergyAux:
    """Mask and positions for a ``[batch, seq_len]`` input (segment 0 = padding)."""
    cfg = self.cfg
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    return EnergyAux(
        mask=make_mask(segment_ids, seq_len, batch, strict=cfg.strict_causal),
        positions=positions,
        rope_theta=cfg.rope_theta if cfg.rope else None,
        diagonal_form=cfg.diagonal_form,
        is_plain_causal=segment_ids is None and not cfg.strict_causal,
    )

  def __call__(
      self,
      tokens: jax.Array,
      segment_ids: jax.Array | None = None,
      *,
      num_steps: int | None = None,
      trace: bool = False,
  ):
    """Next-token logits.

    Args:
      tokens: ``[batch, seq_len]`` int token ids.
      segment_ids: ``[batch, seq_len]`` int document ids (tokens attend within their
        document only; 0 = padding), or None for one causal sequence.
      num_steps: recursive steps per CEM layer at this call (default ``model.num_steps``).
      trace: also return the energy trace, a list over layers of the block's trace.
    Returns:
      ``logits`` ``[batch, seq_len, vocab_size]`` float32, and with ``trace`` a tuple
      ``(logits, traces)``.
    """
    b, t = tokens.shape
    aux = self.make_aux(segment_ids, b, t)
    x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)
    def run_block(block, x):
      return block(x, aux, num_steps=num_steps, trace=trace)

    if self.cfg.remat != "none":  # recompute activations in the backward pass, per block
      run_block = nnx.remat(run_block, policy=REMAT_POLICIES[self.cfg.remat])
    traces = []
    for block in self.blocks:
      x, rec = run_block(block, x)
      traces.append(rec)
    x = self.final_norm(x)
    if self.cfg.tie_embeddings:
      head = self.embedding[...].astype(self.dtype).T
    else:
      head = self.lm_head[...].astype(self.dtype)
    logits = (x @ head).astype(jnp.float32)
    return (logits, traces) if trace else logits


def count_params(module: nnx.Module) -> int:
  """Number of scalar parameters (``nnx.Param``) in ``module``."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))
