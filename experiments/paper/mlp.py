"""Table "mlp": the tied gated CEM MLP against SwiGLU (attention = Llama MHA in all).

    python -m cem_jax.tables --table=mlp --scale=tiny --seeds=3 --workdir=results/tiny

Rows:
  swiglu:         SwiGLU, 3·d·f parameters.
  cem_tied:       CEM tied MLP (W_down = W_gateᵀ, separate gate G), 2·d·f.
  swiglu_matched: SwiGLU narrowed to the tied MLP's parameters (f' = 2f/3).
  cem_widened:    CEM MLP widened to SwiGLU's parameters (f' = 3f/2).
Measured results: results/tiny/mlp.md.
"""

from cem_jax import scales as common


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
  row, scale = common.parse_arg(arg, ROWS, "mlp")
  c = common.base_config(scale)
  ROWS[row](c)
  return c
