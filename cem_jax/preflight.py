"""Start-up checks of a resolved config, before data, devices or compilation: ``check``.

:func:`cem_jax.config.validate` holds the config's own rules and imports no jax. The checks
that need the model code live here, so that the config module never imports it (data flows
config -> model, never back): the attention kernel the config asks for
(:func:`cem_jax.attention.resolve` with ``platform=None``; what the machine decides is checked
when the model is built) and the configured energies (:mod:`cem_jax.energy_checks`).
"""

from __future__ import annotations

import ml_collections

from cem_jax import attention, axes, energy_checks
from cem_jax import config as config_lib


def check(config: ml_collections.ConfigDict) -> None:
  """Checks a resolved config before anything is built: :func:`cem_jax.config.validate`, the
  attention kernel, and for CEM blocks the energies (a user's closed-form update is evaluated
  numerically against ``jax.grad``: 1-2 s, more at large ``d_model``).

  Raises:
    ValueError: one line naming the field, its value and what is allowed.
  """
  config_lib.validate(config)
  m = config.model
  attention.resolve(m.attention_impl, platform=None, dtype=m.dtype,
                    head_dim=axes.head_dim_of(m), augmented_head_dim=axes.augmented_head_dim(m),
                    seq_len=config.data.seq_len)
  if m.block == "cem":
    energy_checks.validate_energies(config)
