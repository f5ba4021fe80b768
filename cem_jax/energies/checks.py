"""Start-up checks of the configured energies: they exist, return a float scalar and have the
requested update mode — found by abstract evaluation (``jax.eval_shape``), before anything is
compiled. Called by :func:`cem_jax.config.validate` for CEM blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cem_jax import axes, energies, updates


def validate_energies(config) -> None:
  """Looks up both energies and checks, by abstract evaluation (no compilation), that each
  returns a scalar float and that the chosen update mode exists for it.

  Raises:
    ValueError: unknown energy, no closed form for ``update_mode='fused'``, or an energy that
      returns a non-scalar or non-float value.
  """
  m = config.model
  d, h = m.d_model, m.num_heads
  dh = axes.head_dim_of(m)
  b, t = 1, 4
  y = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
  aux = energies.EnergyAux(
      mask=jnp.tril(jnp.ones((b, t, t), bool)),
      positions=jnp.zeros((b, t), jnp.int32),
      rope_theta=m.rope_theta if m.rope else None,
      diagonal_form=m.diagonal_form,
  )
  att_params = {
      "w_q": jax.ShapeDtypeStruct((d, h, dh), jnp.float32),
      "w_k": jax.ShapeDtypeStruct((d, h, dh), jnp.float32),
      "eta": jax.ShapeDtypeStruct((h,), jnp.float32),
      "beta": jax.ShapeDtypeStruct((h,), jnp.float32),
  }
  if m.diagonal != "none":
    att_params["diag"] = jax.ShapeDtypeStruct((h, d), jnp.float32)
  mlp_params = {
      "w": jax.ShapeDtypeStruct((d, m.mlp_dim), jnp.float32),
      "g": jax.ShapeDtypeStruct((d, m.mlp_dim), jnp.float32),
      "eta": jax.ShapeDtypeStruct((), jnp.float32),
  }
  slots = []
  if m.cem_attention:
    slots.append(("model.attention_energy", "attention", att_params))
  if m.cem_mlp:
    slots.append(("model.mlp_energy", "mlp", mlp_params))
  for field, kind, params in slots:
    spec = energies.get(m[field.split(".")[1]], kind, field)
    update = updates.resolve_update(spec, m.update_mode)
    if kind == "attention" and m.energy_block_size > 0 and update is spec.fused_update:
      raise ValueError(
          f"model.energy_block_size={m.energy_block_size} has no effect on the fused update "
          f"of {spec.name!r} (it changes how jax.grad of the energy is computed); set "
          "model.update_mode='autodiff' or model.energy_block_size=0")
    try:
      out = jax.eval_shape(lambda y_, p_, s=spec: s.energy(y_, y_, p_, aux), y, params)
    except Exception as e:  # the user's function failed on valid shapes: say whose it is
      raise ValueError(f"{field}={spec.name!r} failed on [batch, seq_len, d_model] inputs: "
                       f"{type(e).__name__}: {e}") from e
    if not hasattr(out, "shape") or out.shape != ():
      shape = getattr(out, "shape", type(out).__name__)
      raise ValueError(f"{field}={spec.name!r} returns shape {shape}; an energy must return "
                       "a scalar (sum over batch and positions)")
    if not jnp.issubdtype(out.dtype, jnp.floating):
      raise ValueError(f"{field}={spec.name!r} returns dtype {out.dtype}; an energy must "
                       "return a float scalar")
