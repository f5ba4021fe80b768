"""The CEM design space on the built-in corpus (CEM_MATH.md §1, §3, §4): one arg per variant.

Commands (1000 steps each: ~10 min on 2 idle CPU cores, ~15 min for t2, more when other jobs
share them; for a quick look, as in the README, add
``--config.train.num_steps=100 --config.train.eval_every_steps=50``; eval lines carry energy
traces)::

    python -m cem_jax.main --config=experiments/design.py:diagonal --workdir=/tmp/diag
    python -m cem_jax.main --config=experiments/design.py:precond  --workdir=/tmp/precond
    python -m cem_jax.main --config=experiments/design.py:t2       --workdir=/tmp/t2
    python -m cem_jax.main --config=experiments/design.py:sigmoid  --workdir=/tmp/sigmoid

Then plot energy descent and loss curves with ``python -m cem_jax.plot --workdir=/tmp/t2``
and evaluate a T = 2 model at other step counts with
``python -m cem_jax.evaluate --workdir=/tmp/t2 --num_steps=1,2,3,4``.

Variants (all tied attention + tied MLP, the tiny model of ``experiments/tiny.py``):
  diagonal: per-head diagonal-plus-low-rank interaction, bilinear form.
  precond:  preconditioner P = diagonal + rank 8 on both sub-steps, shared across steps
            (the interaction itself has no diagonal here).
  t2:       T = 2 recursive steps with a fixed context (keys computed once).
  sigmoid:  a user-defined softplus energy (experiments/sigmoid_energy.py), updates by jax.grad.

Measured results: see docs/DESIGN_SPACE.md (filled from the runs above).
"""

import os

from cem_jax.config import get_default_config

VARIANTS = ("diagonal", "precond", "t2", "sigmoid")


def get_config(arg: str = "t2"):
  """``arg``: one of :data:`VARIANTS`; left out (``--config=experiments/design.py``): ``'t2'``
  (``cem_jax.main`` logs the default it trains)."""
  if arg not in VARIANTS:
    raise ValueError(f"experiments/design.py:{arg}; allowed args: {', '.join(VARIANTS)}")
  c = get_default_config()
  m = c.model
  if arg == "diagonal":
    m.diagonal = "per_head"
  elif arg == "precond":
    m.precond = "both"
    m.precond_rank = 8
  elif arg == "t2":
    m.num_steps = 2
  elif arg == "sigmoid":
    here = os.path.dirname(os.path.abspath(__file__))
    m.attention_energy = os.path.join(here, "sigmoid_energy.py") + ":energy"
  return c
