"""Table "design": the full CEM block (tied attention + tied MLP) across the design space.

    python -m cem_jax.tables --table=design --scale=tiny --seeds=2 --workdir=results/tiny

Rows:
  t1:              one step (the tied block).
  t2_fixed:        T = 2, context fixed at the layer input (keys computed once).
  t2_coevolve:     T = 2, context recomputed from the current state at step 2.
  t1_precond_diag: T = 1 with a diagonal preconditioner on both sub-steps (rank 0).
  t1_precond_dlr:  T = 1 with diagonal + rank-8 preconditioners.
Measured at tiny scale (2026-11-30, 2 seeds, 400 steps on War and Peace, 2 CPU cores;
results/tiny/design.md, discussion in docs/REPRODUCING.md): eval loss in nats/token (mean),
then the difference to t1 paired by seed (mean ± spread):
  t1               4.593   0
  t2_fixed         4.872   +0.278 ± 0.062
  t2_coevolve      5.041   +0.448 ± 0.090
  t1_precond_diag  4.298   -0.296 ± 0.065
  t1_precond_dlr   4.419   -0.174 ± 0.106
"""

from cem_jax import scales


def _t1(c):
  c.model.block = "cem"


def _t2_fixed(c):
  _t1(c)
  c.model.num_steps = 2


def _t2_coevolve(c):
  _t2_fixed(c)
  c.model.context = "coevolve"


def _precond_diag(c):
  _t1(c)
  c.model.precond = "both"


def _precond_dlr(c):
  _precond_diag(c)
  c.model.precond_rank = 8


ROWS = {"t1": _t1, "t2_fixed": _t2_fixed, "t2_coevolve": _t2_coevolve,
        "t1_precond_diag": _precond_diag, "t1_precond_dlr": _precond_dlr}


def get_config(arg: str = "t1"):
  row, scale = scales.parse_arg(arg, ROWS, "design")
  c = scales.base_config(scale)
  ROWS[row](c)
  return c
