"""Updates derived from energies: ``-∇_y E(y | context)`` and the preconditioner ``P`` the layer
applies to it (CEM_MATH.md sections 1-5). CEM_MATH's ``-η P ∇_y E`` has the step size ``η``
inside ``E`` here: the energy carries it (``params['eta']``), the update adds none.

The context is held fixed in the sense of CEM: the update differentiates the ``y`` argument
only (``jax.grad(..., argnums=0)``). It is *not* wrapped in ``stop_gradient``: the training
loss still differentiates the update with respect to the context and the parameters, exactly
as it does the closed form, so autodiff and fused updates train identically.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from cem_jax.energies import EnergySpec

UpdateFn = Callable[..., jax.Array]


def autodiff_update(energy: Callable) -> UpdateFn:
  """``(y, context, params, aux) -> -∇_y energy(y, context, params, aux)``, same shape as y."""

  def update(y, context, params, aux):
    return -jax.grad(energy, argnums=0)(y, context, params, aux).astype(y.dtype)

  return update


def resolve_update(spec: EnergySpec, mode: str, field: str = "model.update_mode") -> UpdateFn:
  """Chooses how the update of ``spec`` is computed.

  Args:
    spec: the energy.
    mode: ``'fused'`` (closed form; error if the energy has none), ``'autodiff'``
      (``jax.grad``) or ``'auto'`` (fused where one exists, else autodiff).
    field: config field named in errors.
  Raises:
    ValueError: unknown mode, or ``'fused'`` for an energy without a closed form.
  """
  if mode == "autodiff" or (mode == "auto" and spec.fused_update is None):
    return autodiff_update(spec.energy)
  if mode in ("fused", "auto"):
    if spec.fused_update is None:
      raise ValueError(
          f"{field}='fused' but energy {spec.name!r} has no closed-form update; "
          "use 'autodiff' or 'auto'"
      )
    return spec.fused_update
  raise ValueError(f"{field}={mode!r}; allowed: fused, autodiff, auto")


def precondition(v: jax.Array, p: jax.Array, u: jax.Array | None, eps: float) -> jax.Array:
  """Applies ``P = diag(softplus(p) + eps) + U Uᵀ`` to ``v`` in O(d·r) (CEM_MATH.md §3).

  Args:
    v: ``[..., d_model]``.
    p: ``[d_model]`` raw diagonal (softplus keeps it positive).
    u: ``[d_model, rank]`` or None (diagonal only).
    eps: floor added to the diagonal; with it ``P`` is positive definite for any ``p``, ``U``.
  Returns:
    ``P v``, shape and dtype of ``v``.
  """
  out = (jax.nn.softplus(p.astype(jnp.float32)) + eps).astype(v.dtype) * v
  if u is not None:
    u = u.astype(v.dtype)
    out = out + (v @ u) @ u.T
  return out
