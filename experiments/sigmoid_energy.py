"""A user-defined energy: sigmoid attention as the gradient of a softplus interaction energy.

This file is the worked example of "Swap an energy" (README). Nothing here is registered or
compiled by hand: the config names the function and ``jax.grad`` derives the update.

    E(y | c) = - Σ_i Σ_k (η_k / β_k) Σ_{j ∈ N(i)} softplus(β_k s_ij + b_i),
    s_ij = <R_i W_Qk y_i, R_j W_Kk c_j>,   b_i = -log |N(i)|

so ``-∇_y E = Σ_k η_k W_Qkᵀ R_iᵀ Σ_j σ(β_k s_ij + b_i) R_j W_Kk c_j``: sigmoid attention with
tied weights, where each key contributes independently (no softmax normalisation). The bias
``b_i`` keeps the total weight near 1 at initialisation, as in sigmoid-attention practice.

Train it (minutes on 2 CPU cores)::

    python -m cem_jax.main --config=experiments/design.py:sigmoid --workdir=/tmp/sigmoid
"""

import jax
import jax.numpy as jnp

from cem_jax.energies import apply_rope


def energy(y, context, params, aux):
  """Softplus interaction energy; shapes as every energy (``cem_jax.energies.base``).

  Args:
    y: ``[batch, seq_len, d_model]``; context: ``[batch, context_len, d_model]`` (the whole
      cache in cached decoding).
    params: ``w_q``, ``w_k`` ``[d_model, num_heads, head_dim]``, ``eta``, ``beta``
      ``[num_heads]``.
    aux: ``aux.mask`` ``[batch, seq_len, context_len]``, ``aux.positions``,
      ``aux.context_positions``, ``aux.rope_theta``.
  Returns:
    ``[]`` float32, summed over batch, positions and heads.
  """
  q = jnp.einsum("btd,dhk->bthk", y, params["w_q"])
  k = jnp.einsum("bsd,dhk->bshk", context, params["w_k"])
  if aux.rope_theta is not None:
    q = apply_rope(q, aux.positions, aux.rope_theta)
    k = apply_rope(k, aux.context_positions, aux.rope_theta)
  beta, eta = params["beta"], params["eta"]
  scores = jnp.einsum("bthk,bshk->bhts", q, k) * beta[None, :, None, None]
  visible = jnp.sum(aux.mask, axis=-1)  # |N(i)|, [batch, seq_len]
  bias = -jnp.log(jnp.maximum(visible, 1)).astype(scores.dtype)[:, None, :, None]
  per_pair = jnp.where(aux.mask[:, None], jax.nn.softplus(scores + bias), 0.0)
  return -jnp.sum(jnp.sum(per_pair, axis=(2, 3)) * (eta / beta)[None, :])
