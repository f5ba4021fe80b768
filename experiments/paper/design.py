"""Table "design": the full CEM block (tied attention + tied MLP) across the design space.

    python -m cem_jax.tables --table=design --scale=tiny --seeds=3 --workdir=results/tiny

Rows:
  t1:              one step (the tied block).
  t2_fixed:        T = 2, context fixed at the layer input (keys computed once).
  t2_coevolve:     T = 2, context recomputed from the current state at step 2.
  t1_precond_diag: T = 1 with a diagonal preconditioner on both sub-steps (rank 0).
  t1_precond_dlr:  T = 1 with diagonal + rank-8 preconditioners.
Diagnostics of recursion (issue 17: why is T = 2 worse than T = 1 at tiny scale?):
  t2_eta_half:     t2_fixed with every step size starting at 1/T = 0.5 (model.eta_init), so
                   that the two steps together move a token as far as t1's one step at init.
  t2_eta_per_step: t2_fixed with a separate learned step size per step (model.eta_per_step).
  t2_lr_half:      t2_fixed at half the learning rate.
  t1_lr_half:      t1 at half the learning rate (the control for t2_lr_half).
  t1_eta_half:     t1 with its step sizes starting at 0.5 (the control for t2_eta_half: is it
                   the smaller step or the recursion?).
  t2_joint_eta_half: t2_eta_half with a joint step (model.split='joint': one step on
                   E_att + E_mlp, both gradients at the same point) instead of Lie–Trotter's
                   attention-then-MLP, whose sub-steps partly undo each other.
  t1_joint_eta_half: t1_eta_half with a joint step (the control for t2_joint_eta_half).
Every row logs the energy trace at each eval (eval.energy_trace): the energies before and after
each sub-step of each layer, so one can see whether each inner step lowers its energy.
Measured at tiny scale (2026-12-03, numerics version 3, 3 seeds, 400 steps on War and Peace,
2 CPU cores: 5–6.5 min a T = 1 run and 9–11.5 min a T = 2 run when idle, ~5 h in all;
results/tiny/design.md and design_recursion.md, discussion in docs/REPRODUCING.md): eval
loss in nats/token (mean), then the difference to t1 paired by seed (mean ± std):
  t1                 4.123   0
  t2_fixed           4.461   +0.338 ± 0.216
  t2_coevolve        4.407   +0.283 ± 0.124
  t1_precond_diag    4.026   -0.098 ± 0.116
  t1_precond_dlr     4.141   +0.018 ± 0.170
  t2_eta_half        4.014   -0.110 ± 0.152
  t2_eta_per_step    4.500   +0.376 ± 0.218
  t2_lr_half         4.351   +0.228 ± 0.214
  t1_lr_half         4.217   +0.094 ± 0.180
  t1_eta_half        4.150   +0.026 ± 0.436
  t2_joint_eta_half  3.899   -0.225 ± 0.156
  t1_joint_eta_half  3.840   -0.284 ± 0.151
(T = 2 trails T = 1 in every seed; starting η at 1/2 helps T = 2 in every seed; the joint
split helps both T in every seed, by ~0.1 (T = 1 seed 1 by 0.66: its control sat on the early
plateau); at equal η and under the joint split T = 2 still trails T = 1 by +0.06 in every
seed, as under version 2. Version 2's "half the learning rate helps" did not hold on the new
data order; the preconditioners stay undecided.)
With the input embedding times sqrt(d_model) (``--set=model.embed_scale=11.313708498984761
--workdir=results/tiny_scaled``; the early plateau gone; docs/REPRODUCING.md, design_scaled):
t2_fixed ahead of t1 in every seed (−0.064 ± 0.025), the diagonal preconditioner too, by less
(−0.040 ± 0.026). Starting η at 1/T, one η per step and the joint split each move T = 2 by
less than 0.04; half the learning rate costs both T ~0.2 in every seed; t2_joint_eta_half has
the lowest mean (3.881, level with t2_fixed). Trained 1600 steps instead
(``--set=train.num_steps=1600 --rows=t1,t2_fixed,t1_precond_diag --seeds=3
--workdir=results/tiny_scaled_1600``, design_1600): t2_fixed still ahead in every seed, by less
(−0.021 ± 0.013); the diagonal preconditioner level or a little ahead (−0.009 ± 0.010).
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


def _t2_eta_half(c):
  _t2_fixed(c)
  c.model.eta_init = 1.0 / c.model.num_steps


def _t2_eta_per_step(c):
  _t2_fixed(c)
  c.model.eta_per_step = True


def _t2_lr_half(c):
  _t2_fixed(c)
  c.train.learning_rate /= 2


def _t1_lr_half(c):
  _t1(c)
  c.train.learning_rate /= 2


def _t1_eta_half(c):
  _t1(c)
  c.model.eta_init = 0.5


def _t2_joint_eta_half(c):
  _t2_eta_half(c)
  c.model.split = "joint"


def _t1_joint_eta_half(c):
  _t1_eta_half(c)
  c.model.split = "joint"


ROWS = {"t1": _t1, "t2_fixed": _t2_fixed, "t2_coevolve": _t2_coevolve,
        "t1_precond_diag": _precond_diag, "t1_precond_dlr": _precond_dlr,
        "t2_eta_half": _t2_eta_half, "t2_eta_per_step": _t2_eta_per_step,
        "t2_lr_half": _t2_lr_half, "t1_lr_half": _t1_lr_half, "t1_eta_half": _t1_eta_half,
        "t2_joint_eta_half": _t2_joint_eta_half, "t1_joint_eta_half": _t1_joint_eta_half}


def get_config(arg: str = "t1"):
  """``arg``: ``ROW`` or ``ROW,SCALE`` (``ROW`` in :data:`ROWS`, ``SCALE`` ``tiny`` by default:
  :func:`cem_jax.scales.parse_arg`); left out: ``'t1'`` (``cem_jax.main`` logs it)."""
  row, scale = scales.parse_arg(arg, ROWS, "design")
  c = scales.base_config(scale)
  ROWS[row](c)
  c.eval.energy_trace = True
  return c
