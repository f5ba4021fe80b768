"""The element-wise gated energy: a tied gated MLP (CEM_MATH.md section 2).

::

    E_mlp(y | x) = - η Σ_i Σ_m (G x_i)_m Φ((W y_i)_m),      Φ' = activation, Φ(0) = 0
    -∇_y E_mlp   = η Wᵀ (activation(W y) ⊙ G x)

At ``y = x`` this is SwiGLU (for Φ' = SiLU) with ``W_gate = W``, ``W_up = G``,
``W_down = Wᵀ``: 2·d·f parameters instead of 3·d·f. The gate input ``x`` is the
conditioning input (the ``context`` argument), not ``y``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cem_jax.energies.base import EnergyAux

_PI2_12 = math.pi**2 / 12.0


# Cephes' spence.c (the coefficients of jax.scipy.special.spence): spence(x) = -w P(w) / Q(w),
# w = x - 1, for 0.5 <= x <= 1.5.
_SPENCE_P = (4.65128586073990045278e-5, 7.31589045238094711071e-3, 1.33847639578309018650e-1,
             8.79691311754530315341e-1, 2.71149851196553469920e0, 4.25697156008121755724e0,
             3.29771340985225106936e0, 1.00000000000000000126e0)
_SPENCE_Q = (6.90990488912553276999e-4, 2.54043763932544379113e-2, 2.82974860602568089943e-1,
             1.41172597751831069617e0, 3.63800533345137075418e0, 5.03278880143316990390e0,
             3.54771340985225096217e0, 9.99999999999999998740e-1)


def _spence_near_one(x):
  """``spence(x)`` for ``1 <= x <= 1.5``, the branch ``jax.scipy.special.spence`` takes there,
  with the same operations. Not spence itself: its ``jnp.piecewise`` evaluates every branch for
  every element and sorts them out with cumulative sums; with it Φ_silu of ``[8, 512, 1024]``
  float32 took 527 CPU ms and 1.17 GB on CPU, 37 ms and 0.05 GB without it and with the
  quadrature summed term by term (the energy trace's cost, docs/PERFORMANCE.md)."""
  w = x - 1.0
  p, q = (jnp.asarray(c, w.dtype) for c in (_SPENCE_P, _SPENCE_Q))
  return -w * jnp.polyval(p, w) / jnp.polyval(q, w)


def _phi_silu_neg(z):
  """Φ_silu on z <= -2: z·softplus(z) + Li₂(-e^z) + π²/12, with Li₂(-u) = spence(1 + u)
  (1 <= 1 + u <= 1 + e⁻²)."""
  return z * jax.nn.softplus(z) + _spence_near_one(1.0 + jnp.exp(z)) + _PI2_12


# 12-point Gauss-Legendre nodes/weights on [0, 1] for Φ near 0, where the closed form
# cancels (three O(1) terms summing to ~z²/4 lose ~1e-5 relative accuracy in float32).
_GL_X, _GL_W = np.polynomial.legendre.leggauss(12)
_GL_X, _GL_W = (_GL_X + 1.0) / 2.0, _GL_W / 2.0
_SMALL = 2.0


@jax.custom_jvp
def phi_silu(z: jax.Array) -> jax.Array:
  """The SiLU potential ``Φ(z) = ∫_0^z silu``, element-wise: same shape and dtype as ``z``
  (bf16/f16 are computed in float32; float64 stays float64).

  ``Φ(z) = z·softplus(z) + Li₂(-e^z) + π²/12`` (CEM_MATH.md §2), evaluated stably: for
  ``|z| > 2`` only ``Li₂(-e^{-|z|})`` is used (via ``Φ(z) + Φ(-z) = z²/2``); for
  ``|z| <= 2``, where that sum cancels, Gauss-Legendre quadrature of ``silu`` on ``[0, z]``
  (12 nodes: exact to float precision for this analytic integrand). ``jax.grad`` of that
  differentiates the quadrature and the rational approximation rather than ``Φ`` (through
  ``jax.scipy.special.spence`` it was NaN), hence the custom JVP whose tangent ``silu(z)·ż``
  is itself differentiable: ``Φ' = silu`` and ``Φ'' = silu'`` exactly, to any order.
  At ``z = ±inf`` it returns the limits: ``Φ(-inf) = π²/12`` (``∫_0^∞ s/(1+e^s) ds``),
  ``Φ(inf) = inf``; NaN stays NaN.
  """
  z = jnp.asarray(z)
  compute = z.astype(jnp.promote_types(z.dtype, jnp.float32))
  # ±inf is clipped to the largest finite value, where z·softplus(z) is -max·0 = 0, not
  # -inf·0 = NaN: Φ(-inf) = π²/12 and Φ(inf) = inf - π²/12 = inf, the true limits. Finite
  # inputs are unchanged, bit for bit.
  neg = _phi_silu_neg(-jnp.clip(jnp.abs(compute), _SMALL, jnp.finfo(compute.dtype).max))
  large = jnp.where(compute > 0, 0.5 * compute * compute - neg, neg)
  small_z = jnp.clip(compute, -_SMALL, _SMALL)
  # One term per node, summed in order: then XLA's CPU backend fuses all of Φ into one loop;
  # reduced over an extra [..., 12] axis, it took 178 CPU ms instead of 37 (as above).
  quadrature = None
  for node, weight in zip(_GL_X.tolist(), _GL_W.tolist(), strict=True):
    term = weight * jax.nn.silu(small_z * node)
    quadrature = term if quadrature is None else quadrature + term
  small = small_z * quadrature
  return jnp.where(jnp.abs(compute) > _SMALL, large, small).astype(z.dtype)


@phi_silu.defjvp
def _phi_silu_jvp(primals, tangents):
  (z,), (z_dot,) = primals, tangents
  return phi_silu(z), jax.nn.silu(z) * z_dot


def phi_gelu(z: jax.Array) -> jax.Array:
  """The (exact, erf) GELU potential ``Φ(z) = ½(z²-1)·N(z) + ½ z φ(z) + ¼``; ``Φ' = gelu``.

  Element-wise, same shape and dtype as ``z`` (bf16/f16 are computed in float32, which
  ``jax.scipy.stats.norm`` needs; CEM_MATH.md §2)."""
  z = jnp.asarray(z)
  x = z.astype(jnp.promote_types(z.dtype, jnp.float32))
  cdf = jax.scipy.stats.norm.cdf(x)
  pdf = jax.scipy.stats.norm.pdf(x)
  return (0.5 * (x * x - 1.0) * cdf + 0.5 * x * pdf + 0.25).astype(z.dtype)


def phi_relu(z: jax.Array) -> jax.Array:
  """``Φ(z) = ½ relu(z)²``; ``Φ' = relu``. Element-wise, same shape and dtype as ``z``."""
  return 0.5 * jnp.square(jax.nn.relu(z))


def phi_relu2(z: jax.Array) -> jax.Array:
  """``Φ(z) = relu(z)³ / 3``; ``Φ' = relu(z)²`` (squared ReLU). Element-wise, same shape and
  dtype as ``z``."""
  return jax.nn.relu(z) ** 3 / 3.0


# name -> (potential Φ, its derivative Φ' = the MLP activation)
POTENTIALS: dict[str, tuple[Callable, Callable]] = {
    "silu": (phi_silu, jax.nn.silu),
    "gelu": (phi_gelu, lambda z: jax.nn.gelu(z, approximate=False)),
    "relu": (phi_relu, jax.nn.relu),
    "relu2": (phi_relu2, lambda z: jnp.square(jax.nn.relu(z))),
}


def make_gated_energy(potential: str) -> tuple[Callable, Callable]:
  """Returns ``(energy, fused_update)`` for the gated element-wise energy with ``potential``.

  ``energy(y, context, params, aux) -> []`` float32 and ``fused_update(...) ->
  [batch, seq_len, d_model]``; ``params``: ``w``, ``g``: ``[d_model, mlp_dim]``, ``eta``:
  ``[]``. ``aux`` is unused (the energy is per position).

  Raises:
    KeyError: unknown potential (allowed: ``POTENTIALS``).
  """
  if potential not in POTENTIALS:
    raise KeyError(f"unknown potential {potential!r}; allowed: {sorted(POTENTIALS)}")
  phi, act = POTENTIALS[potential]

  def energy(y, context, params, aux: EnergyAux | None = None):
    del aux
    pre = jnp.einsum("btd,df->btf", y, params["w"]).astype(jnp.float32)
    gate = jnp.einsum("btd,df->btf", context, params["g"]).astype(jnp.float32)
    return -params["eta"].astype(jnp.float32) * jnp.sum(gate * phi(pre))

  def fused_update(y, context, params, aux: EnergyAux | None = None):
    del aux
    pre = jnp.einsum("btd,df->btf", y, params["w"])
    gate = jnp.einsum("btd,df->btf", context, params["g"])
    # η scales the [d_model, mlp_dim] readout, not the [batch, seq_len, mlp_dim] hidden
    # activations: the same product, with its multiply and its gradient's reduction over the
    # weight instead of every token; η·W is formed in float32 and rounded once.
    wide = jnp.promote_types(params["w"].dtype, jnp.float32)
    readout = (params["w"].astype(wide) * params["eta"].astype(wide)).astype(params["w"].dtype)
    return jnp.einsum("btf,df->btd", act(pre) * gate, readout).astype(y.dtype)

  energy.__name__ = f"gated_{potential}_energy"
  fused_update.__name__ = f"gated_{potential}_fused_update"
  return energy, fused_update
