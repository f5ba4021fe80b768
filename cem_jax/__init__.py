"""cem_jax: Transformer layers derived by Causal Energy Minimization, in JAX and Flax NNX.

Data flows config → data → model (energies → updates → layers) → train → tables.
"""

__version__ = "0.1.0"
