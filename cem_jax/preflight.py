"""Start-up checks of a resolved config: ``check`` before data, devices or compilation, and
``check_machine`` once the devices are known, still before the data is built.

:func:`cem_jax.config.validate` holds the config's own rules and imports no jax. The checks
that need the model code live here, so that the config module never imports it (data flows
config -> model, never back): the attention kernel the config asks for
(:func:`cem_jax.attention.resolve` with ``platform=None``; what the machine decides,
``check_machine``) and the configured energies (:mod:`cem_jax.energy_checks`).
"""

from __future__ import annotations

import jax
import ml_collections

from cem_jax import attention, axes, energy_checks
from cem_jax import config as config_lib


def check(config: ml_collections.ConfigDict, saved_run: bool = False) -> None:
  """Checks a resolved config before anything is built: :func:`cem_jax.config.validate`, the
  attention kernel, and for CEM blocks the energies (a user's closed-form update is evaluated
  numerically against ``jax.grad``: 1-2 s, more at large ``d_model``). ``saved_run``: the
  config of a saved run read to evaluate or sample it, where what a user energy computes is
  warned about, not refused (:func:`cem_jax.energy_checks.validate_energies`).

  Raises:
    ValueError: one line naming the field, its value and what is allowed.
  """
  config_lib.validate(config)
  if config.model.block == "cem":
    # First: an explicit kernel that no layer calls is refused here, whatever else is wrong
    # with it (its dtype, its seq_len) would be beside the point.
    energy_checks.validate_energies(config, saved_run)
  _attention_kernel(config, platform=None)


def check_machine(config: ml_collections.ConfigDict, platform: str | None = None) -> None:
  """What this machine decides, once its devices may be touched (after
  ``jax.distributed.initialize``) and before the data is built, so that a run that cannot
  start trains no tokenizer and writes no shards first: the attention kernel the config asks
  for on ``platform``, ``jax.default_backend()`` if None (``cudnn`` off a GPU, ``splash`` off
  a TPU, a head too wide for this GPU's cuDNN).

  Raises:
    ValueError: one line naming ``model.attention_impl``, its value and why it cannot run.
  """
  _attention_kernel(config, platform=jax.default_backend() if platform is None else platform)


def _attention_kernel(config: ml_collections.ConfigDict, platform: str | None) -> None:
  m = config.model
  attention.resolve(m.attention_impl, platform=platform, dtype=m.dtype,
                    head_dim=axes.head_dim_of(m), augmented_head_dim=axes.augmented_head_dim(m),
                    seq_len=config.data.seq_len)
