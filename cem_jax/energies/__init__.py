"""Energies as pure functions ``E(y, context, params, aux) -> scalar`` (no Flax, no state).

See :mod:`cem_jax.energies.base` for the signature and shapes and the helpers a user energy
builds on (:func:`masked_logsumexp`, finite on rows that see no key, and
:func:`blockwise_logsumexp`, its online form for long sequences), :mod:`.interaction` for the
log-sum-exp attention energy, :mod:`.elementwise` for the gated MLP energy and its potentials,
and :mod:`.registry` for looking energies up by name.
"""

from cem_jax.energies.base import EnergyAux, blockwise_logsumexp, masked_logsumexp
from cem_jax.energies.elementwise import POTENTIALS, make_gated_energy, phi_silu
from cem_jax.energies.interaction import fused_update as interaction_fused_update
from cem_jax.energies.interaction import interaction_energy
from cem_jax.energies.registry import (
    DIGEST_VERSION,
    EnergySpec,
    absolute_name,
    absolute_paths,
    changed_energies,
    energy_digests,
    get,
    names,
    only_builtins,
    register,
    source_digest,
)
from cem_jax.energies.rope import apply_rope
from cem_jax.masks import make_mask  # public here too: a user energy's one import

__all__ = [
    "DIGEST_VERSION",
    "EnergyAux",
    "EnergySpec",
    "POTENTIALS",
    "absolute_name",
    "absolute_paths",
    "apply_rope",
    "blockwise_logsumexp",
    "changed_energies",
    "energy_digests",
    "get",
    "interaction_energy",
    "interaction_fused_update",
    "make_gated_energy",
    "make_mask",
    "masked_logsumexp",
    "names",
    "only_builtins",
    "phi_silu",
    "register",
    "source_digest",
]
