"""Table "end_to_end": Llama against CEM models, with a parameter-matched Llama.

    python -m cem_jax.tables --table=end_to_end --scale=tiny --seeds=3 --workdir=results/tiny

Rows:
  llama:         Llama block (4d² + 3df per layer).
  cem:           CEM tied attention + tied MLP (2d² + 2df per layer).
  cem_full:      CEM + per-head diagonal + T = 2 (fixed context) + diagonal+rank-8
                 preconditioners.
  llama_matched: Llama with the CEM row's per-layer parameters (narrower SwiGLU).
Measured at tiny scale (2026-12-03, numerics version 3, 3 seeds, 400 steps on War and Peace,
2 CPU cores; results/tiny/end_to_end.md, discussion in docs/REPRODUCING.md): eval loss in
nats/token (mean), then the difference to llama paired by seed (mean ± spread):
  llama           3.909   0
  cem             4.124   +0.215 ± 0.373
  cem_full        4.629   +0.721 ± 0.109
  llama_matched   4.356   +0.448 ± 0.262
With the input embedding times sqrt(d_model) (``--set=model.embed_scale=11.313708498984761
--workdir=results/tiny_scaled``; the early plateau gone; docs/REPRODUCING.md,
end_to_end_scaled): cem 0.20 behind llama and 0.16 behind llama_matched in every seed.
Trained 1600 steps instead (``--set=train.num_steps=1600 --rows=llama,cem,llama_matched
--seeds=3``, end_to_end_1600): cem still 0.18 ± 0.01 behind llama, 0.13 behind llama_matched,
in every seed.
"""

from cem_jax import scales


def _llama(c):
  c.model.block = "llama"


def _cem(c):
  c.model.block = "cem"


def _cem_full(c):
  _cem(c)
  c.model.diagonal = "per_head"
  c.model.num_steps = 2
  c.model.precond = "both"
  c.model.precond_rank = 8


def _llama_matched(c):
  _llama(c)
  d, f = c.model.d_model, c.model.mlp_dim
  c.model.mlp_dim = scales.matched_llama_mlp_dim(d, 2 * d * d + 2 * d * f)


ROWS = {"llama": _llama, "cem": _cem, "cem_full": _cem_full, "llama_matched": _llama_matched}


def get_config(arg: str = "cem"):
  """``arg``: ``ROW`` or ``ROW,SCALE`` (``ROW`` in :data:`ROWS`, ``SCALE`` ``tiny`` by default:
  :func:`cem_jax.scales.parse_arg`); left out: ``'cem'`` (``cem_jax.main`` logs it)."""
  row, scale = scales.parse_arg(arg, ROWS, "end_to_end")
  c = scales.base_config(scale)
  ROWS[row](c)
  return c
