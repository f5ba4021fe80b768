"""Table "mlp": the tied gated CEM MLP against SwiGLU (attention = Llama MHA in all).

    python -m cem_jax.tables --table=mlp --scale=tiny --seeds=3 --workdir=results/tiny

Rows:
  swiglu:         SwiGLU, 3·d·f parameters.
  cem_tied:       CEM tied MLP (W_down = W_gateᵀ, separate gate G), 2·d·f.
  swiglu_matched: SwiGLU narrowed to the tied MLP's parameters (f' = 2f/3).
  cem_widened:    CEM MLP widened to SwiGLU's parameters (f' = 3f/2).
Measured at tiny scale (2026-12-03, numerics version 3, 3 seeds, 400 steps on War and Peace,
2 CPU cores; results/tiny/mlp.md, discussion in docs/REPRODUCING.md): eval loss in nats/token
(mean), then the difference to swiglu paired by seed (mean ± spread):
  swiglu          3.909   0
  cem_tied        4.494   +0.585 ± 0.333
  swiglu_matched  4.076   +0.167 ± 0.072
  cem_widened     4.277   +0.368 ± 0.187
With the input embedding times sqrt(d_model) (``--set=model.embed_scale=11.313708498984761
--workdir=results/tiny_scaled``; the early plateau gone; docs/REPRODUCING.md, mlp_scaled):
cem_tied nearly level with swiglu (+0.021 ± 0.023, behind in every seed) with a third fewer MLP
parameters. Trained 1600 steps instead (``--set=train.num_steps=1600
--rows=swiglu,cem_tied,swiglu_matched --seeds=3 --workdir=results/tiny_scaled_1600``,
mlp_1600): cem_tied still +0.031 ± 0.012 behind swiglu in every seed, 0.01-0.04 at every eval
from step 800.
"""

from cem_jax import scales


def _swiglu(c):
  c.model.block = "llama"


def _cem_tied(c):
  c.model.block = "cem"
  c.model.cem_attention = False


def _swiglu_matched(c):
  _swiglu(c)
  c.model.mlp_dim = round(2 * c.model.mlp_dim / 3)


def _cem_widened(c):
  _cem_tied(c)
  c.model.mlp_dim = round(3 * c.model.mlp_dim / 2)


ROWS = {"swiglu": _swiglu, "cem_tied": _cem_tied, "swiglu_matched": _swiglu_matched,
        "cem_widened": _cem_widened}


def get_config(arg: str = "cem_tied"):
  """``arg``: ``ROW`` or ``ROW,SCALE`` (``ROW`` in :data:`ROWS`, ``SCALE`` ``tiny`` by default:
  :func:`cem_jax.scales.parse_arg`); left out: ``'cem_tied'`` (``cem_jax.main`` logs it)."""
  row, scale = scales.parse_arg(arg, ROWS, "mlp")
  c = scales.base_config(scale)
  ROWS[row](c)
  return c
