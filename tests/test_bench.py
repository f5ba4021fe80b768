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


def test_benchmark_runs_end_to_end_at_a_tiny_shape(tmp_path, monkeypatch, capsys):
  tiny = dict(bench.PRESETS["tiny"], seq_lens=[32], widths=[32], d_model=32, num_layers=1,
              mlp_dim=64, tokens_per_batch=64, steps=2, warmup=1)
  monkeypatch.setitem(bench.PRESETS, "tiny", tiny)
  out = tmp_path / "bench.json"
  rows = bench.run("tiny", ["llama", "cem_fused", "cem_autodiff"], str(out),
                   document_mask=False)
  printed = capsys.readouterr().out
  assert "| variant | attention | seq_len |" in printed
  assert "| cem_autodiff | xla | 32 | 32 |" in printed
  assert [r["variant"] for r in rows] == ["llama", "cem_fused", "cem_autodiff"]
  for r in rows:
    assert r["document_mask"] is False and r["peak_memory_mb"] > 0
    assert r["attention"] == "xla"
    assert ("jax.grad" if r["variant"] == "cem_autodiff" else "cpu") in r["attention_reason"]
    assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["compile_s"] > 0
    assert r["flops_per_token"] == bench.flops_per_token(
        bench._model_config(tiny, bench.VARIANTS[r["variant"]], 32, 32).model, 512, 32)
  import json

  saved = json.load(open(out))
  assert saved["preset"] == "tiny" and len(saved["rows"]) == 3
