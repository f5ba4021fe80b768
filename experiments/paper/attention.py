"""Table "attention": weight-tied CEM attention against Llama attention (MLP = SwiGLU in all).

    python -m cem_jax.tables --table=attention --scale=tiny --seeds=3 --workdir=results/tiny

Rows:
  llama_mha:     Llama MHA, 4d² attention parameters.
  cem_tied:      CEM tied attention (W_V = W_K, W_O = W_Qᵀ, learned per-head η), 2d².
  cem_tied_diag: + a per-head diagonal (diagonal-plus-low-rank interaction), 2d² + H·d.
  llama_matched: Llama MHA with the tied row's parameter count (head_dim halved: 2d²).
Single row: ``python -m cem_jax.main --config=experiments/paper/attention.py:cem_tied,tiny``.
Measured at tiny scale (2026-12-03, numerics version 3, 3 seeds, 400 steps on War and Peace,
2 CPU cores; results/tiny/attention.md, discussion in docs/REPRODUCING.md): eval loss in
nats/token (mean), then the difference to llama_mha paired by seed (mean ± spread):
  llama_mha       3.909   0
  cem_tied        3.955   +0.046 ± 0.227
  cem_tied_diag   3.953   +0.044 ± 0.239
  llama_matched   3.674   −0.235 ± 0.227
With the input embedding times sqrt(d_model) (``--set=model.embed_scale=11.313708498984761
--workdir=results/tiny_scaled``; the early plateau gone; docs/REPRODUCING.md, attention_scaled):
tied 0.16 behind llama_mha in every seed, llama_matched level with it (+0.005 ± 0.033).
Trained 1600 steps instead (``--set=train.num_steps=1600 --rows=llama_mha,cem_tied,llama_matched
--seeds=3 --workdir=results/tiny_scaled_1600``, attention_1600): tied +0.123 ± 0.036 behind
llama_mha in every seed, narrowing slowly after step 400; llama_matched +0.020 ± 0.015.
"""

from cem_jax import scales


def _llama(c):
  c.model.block = "llama"


def _cem_tied(c):
  c.model.block = "cem"
  c.model.cem_mlp = False


def _cem_tied_diag(c):
  _cem_tied(c)
  c.model.diagonal = "per_head"


def _llama_matched(c):
  c.model.block = "llama"
  c.model.head_dim = c.model.d_model // c.model.num_heads // 2


ROWS = {"llama_mha": _llama, "cem_tied": _cem_tied, "cem_tied_diag": _cem_tied_diag,
        "llama_matched": _llama_matched}


def get_config(arg: str = "cem_tied"):
  """``arg``: ``ROW`` or ``ROW,SCALE`` (``ROW`` in :data:`ROWS`, ``SCALE`` ``tiny`` by default:
  :func:`cem_jax.scales.parse_arg`); left out: ``'cem_tied'`` (``cem_jax.main`` logs it)."""
  row, scale = scales.parse_arg(arg, ROWS, "attention")
  c = scales.base_config(scale)
  ROWS[row](c)
  return c
