"""Benchmark: the analytic FLOP formula agrees with XLA; the benchmark runs end to end."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from cem_jax import bench
from cem_jax.model import DecoderLM


@pytest.mark.parametrize("variant", sorted(bench.VARIANTS))
def test_analytic_flops_match_xla_cost_analysis(variant):
  preset = dict(bench.PRESETS["tiny"], d_model=256, num_heads=4, mlp_dim=1024)
  n, vocab = 128, 512
  cfg = bench._model_config(preset, bench.VARIANTS[variant], n, 256)
  model = DecoderLM(cfg.model, vocab, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
  cost = forward.lower(params, jnp.zeros((2, n), jnp.int32)).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  xla_per_token = cost["flops"] / (2 * n)
  analytic = bench.flops_per_token(cfg.model, vocab, n)
  assert abs(analytic / xla_per_token - 1.0) <= 0.10, (analytic, xla_per_token)
