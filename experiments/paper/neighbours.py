"""Table "neighbours": CEM against its neighbours (inner optimiser, manifold, shared depth).

    python -m cem_jax.tables --table=neighbours --scale=tiny --seeds=3 --workdir=results/tiny

Rows:
  cem:                CEM tied attention + tied MLP, gradient steps (end_to_end's ``cem``).
  yuriiformer:        + Nesterov momentum carried across layers (experiments/neighbours.py).
  hyperset:           tokens on the sphere, one block shared by all layers, MLP energy with
                      the potential Φ = ½relu² (``mlp_energy='relu'``).
  energy_transformer: joint step on attention + Hopfield energy with the same potential
                      (``relu``), one shared block.
  llama_matched:      Llama with CEM's per-layer parameters (end_to_end's ``llama_matched``).
  cem_shared:         CEM with one block shared by all layers: the shared-depth control for
                      hyperset and energy_transformer (same parameters as they have).
  cem_shared_joint:   cem_shared with the joint step (``model.split='joint'``): one step on
                      attention + MLP energy, as energy_transformer takes, with CEM's SiLU
                      potential; separates the split from the potential in the shared rows.
  cem_shared_scaled:  cem_shared with the input embedding times sqrt(d_model)
                      (``model.embed_scale``, Gemma's): the first layer's updates no longer
                      bury the token (experiments/collapse.py), so the Lie–Trotter split trains.
The neighbour rows are the configs of ``experiments/neighbours.py`` (``get_config``).
Measured at tiny scale: see results/tiny/neighbours.md and docs/REPRODUCING.md.
With the input embedding times sqrt(d_model) (``--set=model.embed_scale=11.313708498984761
--workdir=results/tiny_scaled``; the early plateau gone; docs/REPRODUCING.md,
neighbours_scaled): yuriiformer ahead of cem in every seed (−0.043 ± 0.014); energy_transformer
level with cem (+0.018 ± 0.034).
"""

import importlib.util
import math
import os

from cem_jax import scales


def _load_neighbours():
  """``experiments/neighbours.py``, the one place the neighbour configs are written."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "neighbours.py")
  spec = importlib.util.spec_from_file_location("cem_experiments_neighbours", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_NEIGHBOURS = _load_neighbours()


def _cem(c):
  c.model.block = "cem"


def _llama_matched(c):
  c.model.block = "llama"
  d, f = c.model.d_model, c.model.mlp_dim
  c.model.mlp_dim = scales.matched_llama_mlp_dim(d, 2 * d * d + 2 * d * f)


def _cem_shared(c):
  _cem(c)
  c.model.num_unique_blocks = 1


def _cem_shared_joint(c):
  _cem_shared(c)
  c.model.split = "joint"


def _cem_shared_scaled(c):
  _cem_shared(c)
  c.model.embed_scale = math.sqrt(c.model.d_model)


ROWS = {"cem": _cem, **_NEIGHBOURS.VARIANTS, "llama_matched": _llama_matched,
        "cem_shared": _cem_shared, "cem_shared_joint": _cem_shared_joint,
        "cem_shared_scaled": _cem_shared_scaled}


def get_config(arg: str = "cem"):
  """``arg``: ``ROW`` or ``ROW,SCALE`` (``ROW`` in :data:`ROWS`, ``SCALE`` ``tiny`` by default:
  :func:`cem_jax.scales.parse_arg`); left out: ``'cem'`` (``cem_jax.main`` logs it)."""
  row, scale = scales.parse_arg(arg, ROWS, "neighbours")
  c = scales.base_config(scale)
  ROWS[row](c)
  return c
