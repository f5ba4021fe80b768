"""Rotary position embeddings (RoPE), shared by the energies and the Llama baseline."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(
    x: jax.Array, positions: jax.Array, theta: float, *, inverse: bool = False
) -> jax.Array:
  """Rotates pairs ``(x[..., m], x[..., m + head_dim/2])`` by ``positions · theta^(-2m/head_dim)``.

  RoFormer (Su et al. 2021, arXiv:2104.09864) in the rotate-half layout of GPT-NeoX and Llama.

  Args:
    x: ``[batch, seq_len, num_heads, head_dim]``; ``head_dim`` must be even.
    positions: ``[batch, seq_len]`` int.
    theta: the RoPE base (10 000 in Llama).
    inverse: rotate by the negative angle. ``apply_rope(apply_rope(x, p), p, inverse=True)``
      is ``x``; the CEM attention update un-rotates its aggregate this way (CEM_MATH.md
      section 1, "RoPE").
  Returns:
    An array like ``x`` (same dtype; computed in float32, or float64 for float64 ``x``).
  Raises:
    ValueError: if ``head_dim`` is odd.
  """
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
  half = head_dim // 2
  # float32 at least (bfloat16 angles of positions in the thousands are off by whole radians);
  # float64 inputs stay float64, so float64 references are not limited to float32 rounding.
  compute = jnp.promote_types(x.dtype, jnp.float32)
  freq = theta ** (-jnp.arange(half, dtype=compute) * 2.0 / head_dim)
  angle = positions.astype(compute)[:, :, None, None] * freq  # [b, t, 1, half]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  if inverse:
    sin = -sin
  x1, x2 = x[..., :half].astype(compute), x[..., half:].astype(compute)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
