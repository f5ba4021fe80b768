"""Inner update rules: how a layer applies an energy's update to the token states.

CEM (CEM_MATH.md §4) moves the token state ``y`` by plain gradient steps, ``y ← y + u(y)``
with ``u = P(-η ∇E)`` the sub-step's update (``cem_jax.updates``). Its neighbours change
the rule, not the energies:

``model.inner_optimizer``
  - ``'gd'`` (default): ``y ← y + u(y)``.
  - ``'heavy_ball'`` (Polyak): ``v ← μ v + u(y);  y ← y + v``.
  - ``'nesterov'``: the update is evaluated at the look-ahead point,
    ``v ← μ v + u(y + μ v);  y ← y + v`` (Nesterov 1983, in Sutskever et al.'s 2013
    velocity form; summed as ``y + μ v + u``, see :func:`apply`). YuriiFormer (Zimin,
    Polyanskiy, Rigollet, arXiv 2601.23236) reads a GPT block as Lie–Trotter-split
    gradient descent on an interaction + potential energy and accelerates it with a
    Nesterov-style velocity carried from layer to layer; where exactly it places the
    look-ahead inside the split is not reproduced here (ours is stated below).

  ``μ = sigmoid(m)`` is learned, one per block (``model.momentum_init``, 0.5 by default:
  ``m = 0``, where the sigmoid's slope is largest so μ moves either way fastest, and where a
  velocity's weight halves at every sub-step: with η ≈ 1 at initialisation a μ near 1
  would multiply the effective step by ~1/(1 - μ) and blow the residual stream up).

  How the velocity meets the recursion and the split: the velocity ``v`` (``[batch,
  seq_len, d_model]``, zero at the embeddings) is one state carried through every energy
  sub-step of every recursive step of every layer. With the Lie–Trotter split each sub-step
  (attention, then MLP) is one momentum step with its own update ``u``, so the velocity
  entering the MLP sub-step already holds the attention update; with the joint split one
  momentum step uses ``u = u_att + u_mlp``, both evaluated at the same (look-ahead) point.
  With μ = 0 every rule is ``gd``: ``0·v + u = u`` and ``y + 0·v = y`` exactly.

``model.manifold``
  - ``'euclidean'`` (default): the rules above.
  - ``'sphere'``: tokens live on the sphere of radius ``r = √d_model`` (RMS 1, the scale an
    RMSNorm produces), as in Hyper-SET (Hu, Zou, Xu, arXiv 2502.11646). Each sub-step is a
    Riemannian step: the update is projected onto the tangent space at ``y``,
    ``P_y(u) = u - (⟨y, u⟩ / r²) y``, and the new point retracted back onto the sphere,
    ``R(z) = r z / ‖z‖``. With momentum,
    ``v ← μ v + P_y(u);  y' ← R(y + v);  v ← P_{y'}(v)`` (the velocity is transported to the
    new point by projection), and Nesterov's look-ahead point is ``R(y + μ v)``. Embeddings
    enter the sphere by ``R`` at the first block.

All functions are pure ``jnp``; shapes ``[..., d_model]``; dtypes follow ``y``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cem_jax.config import INNER_OPTIMIZERS, MANIFOLDS

__all__ = ["INNER_OPTIMIZERS", "MANIFOLDS", "apply", "has_velocity", "lookahead", "momentum",
           "project_tangent", "retract"]


def has_velocity(optimizer: str) -> bool:
  """True when ``optimizer`` carries a velocity (everything but ``'gd'``)."""
  return optimizer != "gd"


def retract(z: jax.Array) -> jax.Array:
  """``R(z) = √d · z / ‖z‖`` over the last axis (computed in float32), dtype of ``z``.

  A zero vector stays zero (its direction is undefined; RMSNorm's epsilon plays the same role).
  """
  z32 = z.astype(jnp.float32)
  sq = jnp.sum(z32 * z32, axis=-1, keepdims=True)
  scale = jnp.sqrt(jnp.float32(z.shape[-1])) * jax.lax.rsqrt(jnp.maximum(sq, 1e-30))
  return (z32 * scale).astype(z.dtype)


def project_tangent(y: jax.Array, u: jax.Array) -> jax.Array:
  """``P_y(u) = u - (⟨y, u⟩ / ‖y‖²) y``: the component of ``u`` tangent to the sphere at ``y``.

  ``‖y‖²`` is measured rather than assumed to be ``d_model``, so rounding in ``y`` does not
  leave a radial residue. Same shape and dtype as ``u``.
  """
  y32, u32 = y.astype(jnp.float32), u.astype(jnp.float32)
  coef = jnp.sum(y32 * u32, -1, keepdims=True) / jnp.maximum(
      jnp.sum(y32 * y32, -1, keepdims=True), 1e-30)
  return (u32 - coef * y32).astype(u.dtype)


def momentum(raw: jax.Array) -> jax.Array:
  """``μ = sigmoid(raw)`` in (0, 1), float32 (``raw = -inf`` gives exactly 0)."""
  return jax.nn.sigmoid(raw.astype(jnp.float32))


def lookahead(y: jax.Array, v: jax.Array | None, mu: jax.Array | None, optimizer: str,
              manifold: str) -> jax.Array:
  """Where the sub-step's update is evaluated: ``y``, or Nesterov's ``y + μ v`` (sphere:
  ``R(y + μ v)``)."""
  if optimizer != "nesterov":
    return y
  z = y + mu.astype(y.dtype) * v
  return retract(z) if manifold == "sphere" else z


def apply(y: jax.Array, v: jax.Array | None, u, mu: jax.Array | None,
          optimizer: str, manifold: str) -> tuple[jax.Array, jax.Array | None]:
  """One inner step with the update ``u``; returns ``(y', v')`` (``v'`` None for ``gd``).

  Args:
    y: ``[..., d_model]`` current state (on the sphere when ``manifold='sphere'``).
    v: velocity like ``y`` (tangent at ``y`` on the sphere), or None for ``gd``.
    u: the sub-step's update (``P(-η∇E)``, evaluated at :func:`lookahead`), like ``y``; or a
      tuple of updates whose sum is the update (the joint split: ``(u_att, u_mlp)``).
    mu: momentum ``[]`` float32 in [0, 1), or None for ``gd``.
    optimizer, manifold: see the module docstring.

  On the euclidean manifold the momentum step is summed as ``y' = ((y + μv) + u_1) + u_2``,
  equal to ``y + v'`` in exact arithmetic and, at μ = 0, the very sum ``gd`` computes
  (``(y + u_1) + u_2``): momentum 0 reproduces ``gd`` bit for bit.
  """
  parts = tuple(u) if isinstance(u, (tuple, list)) else (u,)
  if manifold == "sphere":
    total = parts[0]
    for p in parts[1:]:
      total = total + p
    total = project_tangent(y, total)
    if optimizer == "gd":
      return retract(y + total), None
    v = mu.astype(y.dtype) * v + total
    y = retract(y + v)
    return y, project_tangent(y, v)
  if optimizer == "gd":
    for p in parts:
      y = y + p
    return y, None
  mv = mu.astype(y.dtype) * v
  v, y = mv, y + mv
  for p in parts:
    v, y = v + p, y + p
  return y, v
