"""Benchmark: the analytic FLOP formula agrees with XLA; the benchmark runs end to end."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import RUN_MODULE_REPORTING_JAX, subprocess_env, tool_runs
from flax import nnx

from cem_jax import bench, memory, model_stats, profiling
from cem_jax import model as model_lib
from cem_jax import steps as steps_lib
from cem_jax.model import DecoderLM


def _xla_flops_per_token(model_cfg, vocab: int, n: int) -> float:
  """XLA's cost analysis of the forward pass of 2 sequences of ``n`` tokens, per token."""
  model = DecoderLM(model_cfg, vocab, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
  cost = forward.lower(params, jnp.zeros((2, n), jnp.int32)).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"] / (2 * n)


@pytest.mark.parametrize("variant", sorted(bench.VARIANTS))
def test_analytic_flops_match_xla_cost_analysis(variant):
  preset = dict(bench.PRESETS["tiny"], d_model=256, num_heads=4, mlp_dim=1024)
  n, vocab = 128, 512
  cfg = bench.model_config(preset, bench.VARIANTS[variant], n, 256)
  xla_per_token = _xla_flops_per_token(cfg.model, vocab, n)
  analytic = model_stats.flops_per_token(cfg.model, vocab, n)
  assert abs(analytic / xla_per_token - 1.0) <= 0.10, (analytic, xla_per_token)


# Block options outside bench.VARIANTS that change the FLOPs (the tables train them): a narrow
# MLP so that the attention term weighs enough for a wrong count to leave the 10% band.
@pytest.mark.parametrize("overrides", [
    dict(block="cem", cem_attention=False),
    dict(block="cem", cem_attention=False, num_steps=2),
    dict(block="cem", cem_mlp=False, num_steps=2, context="coevolve"),
    dict(block="cem", diagonal="per_head", diagonal_form="distance"),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items() if k != "block"))
def test_analytic_flops_match_xla_for_the_tables_block_options(overrides):
  preset = dict(bench.PRESETS["tiny"], d_model=256, num_heads=4, mlp_dim=64)
  n, vocab = 128, 64
  cfg = bench.model_config(preset, overrides, n, 256)
  xla_per_token = _xla_flops_per_token(cfg.model, vocab, n)
  analytic = model_stats.flops_per_token(cfg.model, vocab, n)
  assert abs(analytic / xla_per_token - 1.0) <= 0.10, (analytic, xla_per_token)


@pytest.mark.parametrize("overrides", [
    dict(block="llama"),
    dict(block="cem", update_mode="fused"),
    dict(block="cem", update_mode="fused", diagonal="per_head", diagonal_form="distance"),
    dict(block="cem", update_mode="fused", cem_mlp=False, context="coevolve"),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_analytic_flops_terms_match_xla_one_size_at_a_time(overrides):
  """What a 10% band on the total misses, a term worth a few percent (the score product
  counted once, the output layer or a co-evolving context's keys left out): the FLOPs per
  token that a longer sequence, a larger vocabulary and (CEM) one more recursive step add,
  each within 5% of what they add to XLA's count."""
  preset = dict(bench.PRESETS["tiny"], d_model=256, num_heads=4, mlp_dim=256)
  base = dict(n=128, vocab=512, num_steps=1)
  changes = [dict(n=256), dict(vocab=1024)]
  if overrides["block"] == "cem":
    changes.append(dict(num_steps=2))

  def both(n, vocab, num_steps):
    cfg = bench.model_config(preset, dict(overrides, num_steps=num_steps), n, 256).model
    return model_stats.flops_per_token(cfg, vocab, n), _xla_flops_per_token(cfg, vocab, n)

  analytic0, xla0 = both(**base)
  for change in changes:
    analytic, xla = both(**dict(base, **change))
    assert abs((analytic - analytic0) / (xla - xla0) - 1.0) <= 0.05, (change, analytic - analytic0,
                                                                      xla - xla0)


@pytest.mark.parametrize("form", ["bilinear", "distance"])
def test_augmented_head_dim_is_the_width_of_the_augmented_head(form):
  """axes.augmented_head_dim (the config checks, the kernel choice and the FLOP count use it)
  against the width of the q̃ the energy actually builds."""
  import numpy as np

  from cem_jax.axes import augmented_head_dim
  from cem_jax.config import get_default_config
  from cem_jax.energies import interaction

  m = get_default_config().model
  m.d_model, m.num_heads, m.diagonal, m.diagonal_form = 24, 3, "per_head", form
  b, t, h, dh = 1, 5, 3, 8
  rng = np.random.default_rng(0)
  y, c = (jnp.asarray(rng.normal(size=(b, t, 24)), jnp.float32) for _ in range(2))
  q, k = (jnp.asarray(rng.normal(size=(b, t, h, dh)), jnp.float32) for _ in range(2))
  diag = jnp.asarray(rng.normal(size=(h, 24)), jnp.float32)
  q_aug, k_aug, _ = interaction._augmented_head(y, c, q, k, diag, form)
  assert augmented_head_dim(m) == q_aug.shape[-1] == k_aug.shape[-1]
  m.cem_attention = False
  assert augmented_head_dim(m) is None


def test_benchmark_runs_end_to_end_at_a_tiny_shape(tmp_path, monkeypatch, capsys):
  tiny = dict(bench.PRESETS["tiny"], seq_lens=[32], widths=[32], d_model=32, num_layers=1,
              mlp_dim=64, tokens_per_batch=64, steps=2, warmup=1)
  monkeypatch.setitem(bench.PRESETS, "tiny", tiny)
  for name in bench.ENVIRONMENT[1:]:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")  # read, not used, on a CPU
  out = tmp_path / "bench.json"
  with pytest.raises(ValueError, match=r"^train\.loss_block_size=5 does not divide "
                     r"data\.seq_len=32"):  # before any row is measured
    bench.run("tiny", ["llama"], str(out), loss_block_size=5)
  assert not out.exists()
  built, real = [], steps_lib.make_train_step

  def spy(*args, **kwargs):
    built.append(kwargs.get("loss_block_size"))
    return real(*args, **kwargs)

  monkeypatch.setattr(steps_lib, "make_train_step", spy)
  # --profile_dir: traced steps come after the timed ones (no clock reading inside a trace)
  events, real_clock = [], bench.time.perf_counter
  real_start, real_stop = jax.profiler.start_trace, jax.profiler.stop_trace

  def clock():
    events.append("clock")
    return real_clock()

  def start(*args, **kwargs):
    events.append("trace")
    return real_start(*args, **kwargs)

  def stop():
    events.append("written")
    return real_stop()

  # An aid never stops the work it watches: a summary failing otherwise than with a ValueError
  # (a TypeError, a MemoryError) lost the row's timing to "error".
  real_summary = profiling.kernel_summary

  def summary(trace_dir, steps):
    if trace_dir.endswith("cem_fused_32_32"):
      raise MemoryError("trace too large")
    return real_summary(trace_dir, steps)

  monkeypatch.setattr(profiling, "kernel_summary", summary)
  monkeypatch.setattr(bench.time, "perf_counter", clock)
  monkeypatch.setattr(jax.profiler, "start_trace", start)
  monkeypatch.setattr(jax.profiler, "stop_trace", stop)
  rows = bench.run("tiny", ["llama", "cem_fused", "cem_autodiff"], str(out),
                   document_mask=False, loss_block_size=8, profile_dir=str(tmp_path / "prof"))
  monkeypatch.setattr(bench.time, "perf_counter", real_clock)
  assert built == [8, 8, 8]  # the rows measure the step they say they do
  traced = "".join("t" if e == "trace" else "w" if e == "written" else "c" for e in events)
  assert traced.count("t") == 3 and all("c" not in part.split("w")[0]
                                        for part in traced.split("t")[1:]), traced
  for r in rows:
    assert r["profile"] == str(tmp_path / "prof" / f"{r['variant']}_32_32")
    # A CPU trace has no device process: the row says so and keeps its figures.
    assert ("MemoryError: trace too large" if r["variant"] == "cem_fused" else
            "no device kernels in the trace (processes: /host:CPU") in r["kernels_error"], r
    assert "kernels" not in r and "error" not in r
    found = list((tmp_path / "prof" / f"{r['variant']}_32_32").rglob("perfetto_trace.json.gz"))
    assert len(found) == 1, r
    with gzip.open(found[0]) as f:
      marks = [e for e in json.load(f)["traceEvents"] if e.get("name") == "train"]
    assert sorted(int(e["args"]["step_num"]) for e in marks) == [1, 2]
  printed = capsys.readouterr().out
  assert "| variant | attention | seq_len |" in printed
  assert "| cem_autodiff | xla | 32 | 32 |" in printed
  assert [r["variant"] for r in rows] == ["llama", "cem_fused", "cem_autodiff"]
  for r in rows:
    assert r["document_mask"] is False and r["peak_memory_mb"] > 0 and r["loss_block_size"] == 8
    assert r["attention"] == "xla"
    assert ("jax.grad" if r["variant"] == "cem_autodiff" else "cpu") in r["attention_reason"]
    assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["compile_s"] > 0
    assert r["flops_per_token"] == model_stats.flops_per_token(
        bench.model_config(tiny, bench.VARIANTS[r["variant"]], 32, 32).model, 512, 32)
  saved = json.load(open(out))
  assert saved["preset"] == "tiny" and len(saved["rows"]) == 3 and saved["complete"] is True
  # The flags the rows were compiled under (conftest sets the optimisation level) and the
  # memory share set above; unset variables are left out.
  flags = os.environ["XLA_FLAGS"]
  assert "--xla_backend_optimization_level" in flags
  assert saved["environment"] == {"XLA_FLAGS": flags, "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}
  assert f"XLA_FLAGS={flags!r}, XLA_PYTHON_CLIENT_MEM_FRACTION='.5'" in printed.splitlines()[0]


def test_a_trace_that_fails_costs_no_row_its_figures(tmp_path, monkeypatch):
  # A full disk while writing one row's trace, then a profiler jax leaves busy: every row
  # keeps its figures and says why it has no trace.
  tiny = dict(bench.PRESETS["tiny"], seq_lens=[32], widths=[32], d_model=32, num_layers=1,
              mlp_dim=64, tokens_per_batch=64, steps=2, warmup=1)
  monkeypatch.setitem(bench.PRESETS, "tiny", tiny)
  calls = []

  def start(*args, **kwargs):
    calls.append("start")
    if len(calls) > 1:
      raise RuntimeError("Profile has already been started.")

  def stop():
    raise OSError("No space left on device")

  monkeypatch.setattr(jax.profiler, "start_trace", start)
  monkeypatch.setattr(jax.profiler, "stop_trace", stop)
  rows = bench.run("tiny", ["llama", "cem_fused"], str(tmp_path / "b.json"),
                   profile_dir=str(tmp_path / "prof"))
  assert [r["profile_error"] for r in rows] == [
      "OSError: No space left on device", "RuntimeError: Profile has already been started."]
  assert not any("kernels" in r or "kernels_error" in r for r in rows)  # no trace to read
  assert all("error" not in r and r["step_ms"] > 0 for r in rows)


def test_a_sweep_stopped_midway_keeps_the_rows_it_measured(tmp_path, monkeypatch, capsys):
  # A lent GPU's time limit kills the sweep: what it measured must already be in --out.
  calls = []

  def fake_bench_one(config, vocab_size, steps, warmup, profile_dir=None):
    calls.append(config.model.block)
    if len(calls) == 3:
      raise KeyboardInterrupt  # stands in for the kill
    return {"attention": "xla", "step_ms": float(len(calls))}

  monkeypatch.setattr(bench, "bench_one", fake_bench_one)
  out = tmp_path / "bench.json"
  with pytest.raises(KeyboardInterrupt):
    bench.run("tiny", ["llama", "cem_fused"], str(out))

  saved = json.load(open(out))
  assert saved["complete"] is False
  # Variant by variant: the cut sweep has both seq_lens of llama, not one of each variant.
  assert [(r["variant"], r["seq_len"], r["step_ms"]) for r in saved["rows"]] == [
      ("llama", 64, 1.0), ("llama", 128, 2.0)]
  assert all(r["wall_s"] >= 0 for r in saved["rows"])


def _the_run_to_do() -> list[dict[str, str]]:
  """The flags of each bench command in docs/PERFORMANCE.md's "The run to do", and under
  ``env`` the variables set before it (``NAME=value bash .device/run.sh ...``)."""
  import pathlib
  import shlex

  doc = (pathlib.Path(__file__).parents[1] / "docs" / "PERFORMANCE.md").read_text()
  section = doc[doc.index("### The run to do"):]
  section = section[:section.index("Commit the JSON files")].replace("\\\n", " ")
  runs = []
  for line in section.splitlines():
    words = shlex.split(line) if "python3 -m cem_jax.bench" in line else []
    if words:
      flags = words[words.index("cem_jax.bench") + 1:]
      assert all(f.startswith("--") and "=" in f for f in flags), line
      env = dict(w.split("=", 1) for w in words[:words.index("bash")])
      runs.append({**dict(f[2:].split("=", 1) for f in flags), "env": env})
  return runs


def test_the_documented_gpu_run_resolves_its_kernels_and_sizes():
  # Issue 12's one H200 call must not be spent on a config error: every row of the documented
  # commands passes the start-up checks, and on a GPU 'auto' picks cuDNN for every row but the
  # diagonal's (its augmented head is beyond flash head sizes); Llama has ~110M parameters (the
  # tied CEM layers fewer).
  from cem_jax import model as model_lib
  from cem_jax import preflight
  from cem_jax.model_stats import count_params

  runs = _the_run_to_do()
  # The measurement issue 12 asks for: 'auto' kernels (cuDNN), each preset's own mask setting,
  # under the recommended XLA flag; then llama and cem_fused again with a trace.
  assert [sorted(r) for r in runs] == [["env", "out", "preset", "variants"],
                                       ["env", "out", "preset", "profile_dir", "variants"]]
  assert [r["preset"] for r in runs] == ["gpu125m", "gpu125m"]
  assert [sorted(r["env"]) for r in runs] == [["XLA_FLAGS"], ["XLA_FLAGS"]]
  assert len({r["out"] for r in runs}) == 2  # no file overwritten
  for preset, variants in ((r["preset"], r["variants"].split(",")) for r in runs):
    p = bench.PRESETS[preset]
    assert p["dtype"] == "bfloat16" and p["seq_lens"] == [1024, 4096]
    for name in variants:
      for n in p["seq_lens"]:
        cfg = bench.model_config(p, bench.VARIANTS[name], n, p["d_model"])
        assert cfg.train.batch_size * n == p["tokens_per_batch"], (preset, name, n)
        preflight.check(cfg)
        model = nnx.eval_shape(lambda c=cfg, v=p["vocab_size"]: DecoderLM(
            c.model, v, rngs=nnx.Rngs(0)))
        impl, reason = model_lib.resolve_attention(cfg.model, model.blocks, platform="gpu")
        if name == "cem_fused_diag":
          assert impl == "xla" and "augmented head" in reason, (name, reason)
        else:
          assert impl == "cudnn", (preset, name, n, reason)
        if name.startswith("llama"):
          assert 100e6 < count_params(model) < 130e6, (name, count_params(model))


def test_the_xla_flags_of_the_documented_gpu_run_are_known_to_xla():
  # XLA aborts the process on an unknown flag in XLA_FLAGS: a typo would cost the device call.
  # GPU flags are parsed on every backend, so this CPU jaxlib knows them too.
  import subprocess
  import sys

  for env in (r["env"] for r in _the_run_to_do() if r["env"]):
    proc = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0)"],
                          env=dict(os.environ, JAX_PLATFORMS="cpu", **env),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (env, proc.stderr[-300:])


def test_a_row_that_fails_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
  # On the one GPU call, a kernel that refuses one shape must not cost the other rows.
  calls = []

  def fake_bench_one(config, vocab_size, steps, warmup, profile_dir=None):
    calls.append(config.model.block)
    if len(calls) == 2:
      raise ValueError("cuDNN refused this shape\nsecond line")
    return {"attention": "xla", "step_ms": float(len(calls)), "params": 1, "compile_s": 1.0,
            "tokens_per_s": 1.0, "flops_per_token": 1.0, "mfu": None, "peak_memory_mb": None}

  monkeypatch.setattr(bench, "bench_one", fake_bench_one)
  out = tmp_path / "bench.json"
  with pytest.raises(bench.RowsFailed) as e:
    bench.run("tiny", ["llama", "cem_fused"], str(out))
  assert str(e.value) == ("1 of 6 rows failed: llama at seq_len 128, d_model 64: "
                          "ValueError: cuDNN refused this shape")

  saved = json.load(open(out))
  assert saved["complete"] is True and saved["failed"] == 1 and len(calls) == 6
  assert [r.get("step_ms") for r in saved["rows"]] == [1.0, None, 3.0, 4.0, 5.0, 6.0]
  assert saved["rows"][1]["error"] == "ValueError: cuDNN refused this shape"
  printed = capsys.readouterr().out
  assert "| llama | failed: ValueError: cuDNN refused this shape | 128 |" in printed
  # The table reads by shape (the JSON keeps the order the rows ran in).
  table = [line.split(" | ")[:3] for line in printed.splitlines()
           if line.startswith(("| llama |", "| cem_fused |"))]
  assert [(v[2:], n) for v, _, n in table] == [
      ("llama", "64"), ("cem_fused", "64"), ("llama", "128"), ("cem_fused", "128"),
      ("llama", "64"), ("cem_fused", "64")]
  # A failed row keeps every column of the header, so that markdown reads it as a table row.
  lines = [line for line in printed.splitlines() if line.startswith("|")]
  assert {line.count("|") for line in lines} == {14}, lines


def test_document_mask_overrides_the_preset_but_not_a_variant_that_sets_its_own(monkeypatch,
                                                                              capsys):
  import types

  def fake_bench_one(config, vocab_size, steps, warmup, profile_dir=None):
    return {"attention": "xla", "step_ms": 1.0, "params": 1, "compile_s": 1.0,
            "tokens_per_s": 1.0, "flops_per_token": 1.0, "mfu": None, "peak_memory_mb": None}

  monkeypatch.setattr(bench, "bench_one", fake_bench_one)
  rows = bench.run("tiny", ["llama", "llama_docs"], document_mask=False)  # the preset's: True
  assert {(r["variant"], r["document_mask"]) for r in rows} == {("llama", False),
                                                                ("llama_docs", True)}
  # Given with only variants that set their own, it would change no row: refused, no row run.
  for mask in (False, True):
    with pytest.raises(ValueError) as e:
      bench.run("tiny", ["llama_docs", "cem_fused_docs"], document_mask=mask)
    assert str(e.value) == (f"--document_mask={str(mask).lower()} has no effect on "
                            "--variants=llama_docs,cem_fused_docs: each sets its own "
                            "model.document_mask; leave it out, or add a variant that does not "
                            "set it (e.g. llama)")
  assert {r["document_mask"] for r in bench.run("tiny", ["llama_docs"])} == {True}  # its own
  # --document_mask=false reaches run() as False, =true as True, none as None (the preset's).
  given = []
  monkeypatch.setattr(bench, "run", lambda *args: given.append(args[3]))
  for flag in ("false", "true", None):
    fl = types.SimpleNamespace(preset="tiny", variants=["llama"], out=None, profile_dir=None,
                               document_mask=flag, attention_impl=None, loss_block_size=0)
    monkeypatch.setattr(bench, "flags", types.SimpleNamespace(FLAGS=fl))
    bench.main(["bench"])
  assert given == [False, True, None]
  # A sweep with failed rows ends with exit status 1 and one line, after the others' figures.

  def failed(*args):
    raise bench.RowsFailed("1 of 3 rows failed: llama at seq_len 64, d_model 64: OOM")

  monkeypatch.setattr(bench, "run", failed)
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    bench.main(["bench"])
  assert e.value.code == 1
  assert capsys.readouterr().err == (
      "error: 1 of 3 rows failed: llama at seq_len 64, d_model 64: OOM\n")


# ---- the figures of a row and the table's ratios ---------------------------------------------


@pytest.mark.parametrize("preset", sorted(bench.PRESETS))
def test_every_row_of_a_preset_holds_its_tokens_per_batch(preset):
  p = bench.PRESETS[preset]
  for n in p["seq_lens"]:
    config = bench.model_config(p, bench.VARIANTS["llama"], n, p["d_model"])
    assert config.train.batch_size * config.data.seq_len == p["tokens_per_batch"], (preset, n)


class _StandInModel(nnx.Module):
  """What bench_one reads off a model: its parameters and the kernel it chose."""

  def __init__(self, model_cfg, vocab_size, rngs, platform=None):
    del model_cfg, vocab_size, rngs, platform
    self.w = nnx.Param(jnp.zeros((3,)))
    self.attention_impl, self.attention_reason = "xla", "stand-in"

  def kernel_at(self, seq_len):
    del seq_len
    return self.attention_impl, self.attention_reason


def _stand_in_step(monkeypatch, step) -> None:
  """bench_one builds _StandInModel and compiles to ``step`` (nothing real to build or
  compile); its shardings, read by the memory check beside the footprint, are empty."""
  step.input_shardings = step.output_shardings = ()
  compiled = type("Lowered", (), {"compile": lambda self: step})()
  fake = type("Step", (), {"lower": lambda self, *a: compiled})()
  monkeypatch.setattr(steps_lib, "make_train_step", lambda *a, **k: fake)
  monkeypatch.setattr(model_lib, "DecoderLM", _StandInModel)


def test_a_row_reports_the_tokens_of_its_batch_and_mfu_of_three_forward_passes(monkeypatch,
                                                                               tmp_path):
  # The figures' arithmetic, on a stand-in model and step (nothing real to build or compile)
  # and a clock that advances 0.5 s a reading: every step takes 0.5 s.
  tiny = dict(bench.PRESETS["tiny"], d_model=32, num_layers=1, mlp_dim=64, tokens_per_batch=64)
  config = bench.model_config(tiny, bench.VARIANTS["llama"], 32, 32)  # 2 rows of 32 tokens
  now = [0.0]

  def step(p, o, b):  # every step takes 0.5 s of the clock
    now[0] += 0.5
    return p, o, {"loss": jnp.float32(1.0)}

  _stand_in_step(monkeypatch, step)
  monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
  monkeypatch.setattr(model_stats, "peak_flops", lambda: 1e9)
  r = bench.bench_one(config, 512, steps=3, warmup=1)
  # Llama, L=1, d=32, f=64, n=32, V=512: L(8d² + 6df + 4nd) + 2dV
  assert r["flops_per_token"] == 8 * 32**2 + 6 * 32 * 64 + 4 * 32 * 32 + 2 * 32 * 512
  assert r["step_ms"] == 500.0 and r["tokens_per_s"] == 64 / 0.5
  # A training step is forward + backward: 3x the forward FLOPs of each of the 64 tokens.
  assert r["tflops_per_s"] == pytest.approx(3 * 57344 * 64 / 0.5 / 1e12)
  assert r["mfu"] == pytest.approx(3 * 57344 * 64 / 0.5 / 1e9)
  # A user energy's operations are not modelled: no FLOPs, TFLOP/s or MFU, rather than the
  # built-in's.
  (tmp_path / "mine.py").write_text("import jax.numpy as jnp\n\n\ndef gate(y, context, params, "
                                    "aux):\n  return jnp.sum(y * y) * params['eta']\n")
  config = bench.model_config(tiny, bench.VARIANTS["cem_fused"], 32, 32)
  config.model.mlp_energy = f"{tmp_path}/mine.py:gate"
  r = bench.bench_one(config, 512, steps=3, warmup=1)
  assert (r["flops_per_token"], r["tflops_per_s"], r["mfu"]) == (None, None, None)
  assert "| n/a | n/a |" in bench.format_table([{**r, "variant": "mine", "seq_len": 32,
                                                  "d_model": 32}])


def test_a_row_times_steps_back_to_back_after_warmup_in_mib_with_a_null_nan_loss(monkeypatch):
  # A clock moved by the steps themselves: warm-up 1 s; waited for one by one 2, 3 and 10 s
  # (median 3 s); then back to back 4, 4 and 7 s (mean 5 s: the figure).
  import numpy as np

  tiny = dict(bench.PRESETS["tiny"], d_model=32, num_layers=1, mlp_dim=64, tokens_per_batch=64)
  config = bench.model_config(tiny, bench.VARIANTS["llama"], 32, 32)
  now, durations = [0.0], iter([1.0, 2.0, 3.0, 10.0, 4.0, 4.0, 7.0])

  def step(p, o, b):
    now[0] += next(durations)
    return p, o, {"loss": jnp.float32(jnp.nan)}

  _stand_in_step(monkeypatch, step)
  monkeypatch.setattr(memory, "footprint_bytes", lambda c: 3 * 2**20)
  batches = []
  make_batch = bench.make_batch
  monkeypatch.setattr(bench, "make_batch",
                      lambda t, s: batches.append(np.asarray(s)) or make_batch(t, s))
  monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
  r = bench.bench_one(config, 512, steps=3, warmup=1)
  assert r["step_ms"] == 5000.0 and r["step_ms_synced"] == 3000.0
  assert r["tokens_per_s"] == 64 / 5.0
  assert r["peak_memory_mb"] == 3.0  # MiB
  assert r["loss"] is None and json.dumps(r, allow_nan=False)
  # DOCUMENTS_PER_WINDOW equal documents, ids 1..4, in every row of the window.
  (segment_ids,) = batches
  assert bench.DOCUMENTS_PER_WINDOW == 4 and set(np.unique(segment_ids)) == {1, 2, 3, 4}


def test_a_row_whose_step_does_not_fit_the_host_is_refused_before_its_first_step(monkeypatch):
  # --preset=gpu125m on a CPU: its 1024-token row's step needs 43 GiB (XLA's analysis); on a
  # 24 GiB host the first step had the kernel kill the whole sweep (exit status 137, no line).
  tiny = dict(bench.PRESETS["tiny"], d_model=32, num_layers=1, mlp_dim=64, tokens_per_batch=64)
  config = bench.model_config(tiny, bench.VARIANTS["llama"], 32, 32)
  ran = []

  def step(p, o, b):
    ran.append(1)
    return p, o, {"loss": jnp.float32(1.0)}

  _stand_in_step(monkeypatch, step)
  monkeypatch.setattr(memory, "footprint_bytes", lambda c: 43 * 2**30)
  monkeypatch.setattr(memory, "device_limit_bytes", lambda device=None: None)
  monkeypatch.setattr(memory, "host_total_bytes", lambda: 24 * 2**30)
  with pytest.raises(ValueError) as e:
    bench.bench_one(config, 512, steps=3, warmup=1)
  assert str(e.value) == (
      "the training step at seq_len 32, batch 2, d_model 32 needs 43.00 GiB on this host's CPU "
      "devices (XLA memory analysis), more than its 24.00 GiB of memory and swap: run a smaller "
      "--preset on this machine, or give --loss_block_size (now 0) to make the logits in blocks")
  assert ran == []  # refused before any step
  monkeypatch.setattr(memory, "host_total_bytes", lambda: 64 * 2**30)
  monkeypatch.setattr(memory, "host_available_bytes", lambda: 64 * 2**30)
  assert bench.bench_one(config, 512, steps=3, warmup=1)["peak_memory_mb"] == 43 * 1024
  assert len(ran) == 3 + 1 + 3  # steps waited for, warm-up, back to back


def test_abstract_step_inputs_hold_no_arrays_and_lower_to_the_concrete_program():
  # experiments/step_program.py lowers the 125M step on a laptop: shapes only, same program.
  tiny = dict(bench.PRESETS["tiny"], d_model=32, num_layers=1, mlp_dim=64, tokens_per_batch=64)
  config = bench.model_config(tiny, bench.VARIANTS["cem_fused"], 32, 32)
  _, step, params, opt_state, batch = bench.train_step_inputs(config, 64, abstract=True)
  leaves = jax.tree.leaves((params, opt_state))
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  _, _, *concrete = bench.train_step_inputs(config, 64)
  assert step.lower(params, opt_state, batch).as_text() == step.lower(*concrete).as_text()


def test_a_row_waits_for_the_device_work_of_the_steps_it_times(monkeypatch):
  # jax dispatches a step and returns at once; the device's 0.5 s of work ends at a wait. A
  # clock read before the steps' work is waited for would time their dispatch (here 0 s).
  tiny = dict(bench.PRESETS["tiny"], d_model=32, num_layers=1, mlp_dim=64, tokens_per_batch=64)
  config = bench.model_config(tiny, bench.VARIANTS["llama"], 32, 32)
  now, queued = [0.0], [0.0]

  def step(p, o, b):
    queued[0] += 0.5
    return p, o, {"loss": jnp.float32(1.0)}

  def wait(tree):
    now[0], queued[0] = now[0] + queued[0], 0.0
    return tree

  _stand_in_step(monkeypatch, step)
  monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
  monkeypatch.setattr(jax, "block_until_ready", wait)
  r = bench.bench_one(config, 512, steps=3, warmup=1)
  assert r["step_ms"] == 500.0 and r["step_ms_synced"] == 500.0


def test_a_width_sweep_scales_heads_and_mlp_and_a_variant_keeps_its_document_mask():
  c = bench.model_config(bench.PRESETS["tiny"], bench.VARIANTS["llama"], 64, 128).model
  assert (c.d_model, c.num_heads, c.mlp_dim) == (128, 8, 512)  # head_dim 16 at every width
  gpu = bench.PRESETS["gpu125m"]  # document_mask False; the *_docs variants set True
  assert bench.model_config(gpu, bench.VARIANTS["llama_docs"], 1024, 768).model.document_mask
  assert not bench.model_config(gpu, bench.VARIANTS["llama"], 1024, 768).model.document_mask


def _row(variant: str, seq_len: int, step_ms: float) -> dict:
  return {"variant": variant, "attention": "xla", "seq_len": seq_len, "d_model": 32,
          "params": 1e6, "compile_s": 1.0, "step_ms": step_ms, "tokens_per_s": 1.0,
          "flops_per_token": 1e9, "mfu": None, "peak_memory_mb": None}


def test_the_ratios_are_each_row_step_time_over_llama_and_cem_fused_at_its_shape():
  rows = [_row("llama", 64, 10.0), _row("cem_fused", 64, 30.0), _row("cem_autodiff", 64, 60.0),
          _row("llama", 128, 40.0), _row("cem_autodiff", 128, 80.0)]
  rows[0].update(mfu=0.123, peak_memory_mb=512.4)
  cells = {}
  for line in bench.format_table(rows).splitlines()[2:]:
    c = [x.strip() for x in line.split("|")[1:-1]]
    cells[c[0], c[2]] = c[-2:]  # (variant, seq_len): [x llama, x cem_fused]
    if (c[0], c[2]) == ("llama", "64"):
      assert c[9:11] == ["12.3%", "512"]  # MFU in percent, peak memory in MiB
      assert (c[4], c[8]) == ("1.00M", "1.0000")  # 10⁶ parameters (not 2²⁰), 10⁹ FLOPs
    elif c[0] == "cem_fused":
      assert c[9:11] == ["n/a", "n/a"]  # not known: said, not 0
  assert cells["cem_autodiff", "64"] == ["6.00", "2.00"]  # slower than llama reads > 1
  assert cells["cem_fused", "64"] == ["3.00", "1.00"]
  assert cells["cem_autodiff", "128"] == ["2.00", ""]  # no cem_fused row at seq_len 128


def test_analytic_flops_of_the_standard_attention_in_a_cem_block_by_hand():
  """model.cem_attention=False: every recursive step runs Llama's attention, 8d² + 4n·H·d_h
  (full n×n score and value products, no key term), and the tied MLP's 6df
  (model_stats docstring); a CEM attention counts its keys once and 4d² + 4n·H·d_h a step."""
  from cem_jax.config import get_default_config

  cfg = get_default_config().model
  cfg.d_model, cfg.num_heads, cfg.mlp_dim, cfg.num_layers, cfg.num_steps = 32, 2, 64, 3, 2
  d, f, n, vocab = 32, 64, 40, 100
  cfg.cem_attention = False
  assert model_stats.flops_per_token(cfg, vocab, n) == (
      3 * 2 * (8 * d * d + 4 * n * d + 6 * d * f) + 2 * d * vocab)
  cfg.cem_attention = True
  assert model_stats.flops_per_token(cfg, vocab, n) == 3 * (
      2 * d * d + 2 * (4 * d * d + 4 * n * d + 6 * d * f)) + 2 * d * vocab


def test_analytic_flops_of_coevolve_diagonal_and_an_explicit_head_width_by_hand():
  """Terms that the XLA comparisons' bands cannot resolve, counted from the model_stats
  docstring with small integers: a co-evolving context's keys at every step (2d·H·d_h each, not
  once), the augmented head's width d̃ (d_h + d, + 1 in the distance form: one column in 41),
  and an explicit model.head_dim with H·d_h ≠ d (each projection is d·H·d_h, not d²; the
  XLA tests only build H·d_h = d)."""
  from cem_jax import model_stats
  from cem_jax.config import get_default_config

  cfg = get_default_config().model
  cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim = 32, 2, 8, 64
  cfg.num_layers, cfg.num_steps = 3, 2
  d, hd, f, n, vocab = 32, 2 * 8, 64, 40, 100  # hd = H·d_h = 16, half of d

  def flops():
    return model_stats.flops_per_token(cfg, vocab, n)

  cfg.block = "llama"
  assert flops() == 3 * (8 * d * hd + 6 * d * f + 4 * n * hd) + 2 * d * vocab
  cfg.block = "cem"
  step = 4 * d * hd + 6 * d * f  # W_Q y, W_Qᵀ o and the MLP, at each of the T = 2 steps
  assert flops() == 3 * (2 * d * hd + 2 * (step + 4 * n * hd)) + 2 * d * vocab
  cfg.context = "coevolve"  # W_K c again at every step
  assert flops() == 3 * (2 * 2 * d * hd + 2 * (step + 4 * n * hd)) + 2 * d * vocab
  cfg.context, cfg.diagonal = "fixed", "per_head"
  for form, width in (("bilinear", 8 + d), ("distance", 8 + d + 1)):
    cfg.diagonal_form = form  # scores and values over H heads of width d̃
    assert flops() == 3 * (2 * d * hd + 2 * (step + 4 * n * 2 * width)) + 2 * d * vocab, form


_BAD_ARGUMENTS = [
    (["--variants=llama,gpt"], "--variants=gpt; allowed: one or more of llama, "),
    (["--variants=llama,cem_fused,llama"],
     "--variants=llama,cem_fused,llama: llama given twice; allowed: each variant once"),
    (["--out={tmp}/missing/b.json"], "--out={tmp}/missing/b.json: folder {tmp}/missing does "
                                     "not exist"),
    (["--out={tmp}"], "--out={tmp} is a folder; give the JSON file's path"),
    # A folder that cannot hold a file: found after the first row's compile and steps (minutes
    # on a GPU), as "No such file or directory: '/proc/b.json.PID.HEX.tmp'".
    (["--out=/proc/b.json"], "--out=/proc/b.json: cannot write a file in /proc ("),
    (["--profile_dir={tmp}/f"], "--profile_dir={tmp}/f is a file; give a folder (created if "
                                "missing)"),
]


@pytest.fixture(scope="module")
def bench_refusals(tmp_path_factory):
  """``(folder, {case: (exit status, stdout, stderr)})`` of ``python -m cem_jax.bench
  --preset=tiny`` for each of ``_BAD_ARGUMENTS``, in one interpreter (one start-up for all);
  ``folder`` holds the file ``f`` and stands for ``{tmp}``."""
  tmp = tmp_path_factory.mktemp("bench_args")
  (tmp / "f").write_text("")
  cases = [["--preset=tiny", *(a.format(tmp=tmp) for a in args)] for args, _ in _BAD_ARGUMENTS]
  return tmp, dict(enumerate(tool_runs("bench", cases)))


@pytest.mark.parametrize("case", range(len(_BAD_ARGUMENTS)),
                         ids=[str(args) for args, _ in _BAD_ARGUMENTS])
def test_bad_arguments_are_refused_before_any_row_runs(bench_refusals, case):
  tmp, runs = bench_refusals
  code, out, err, _ = runs[case]
  error = _BAD_ARGUMENTS[case][1]
  assert code == 1 and out == ""
  assert err.strip().splitlines()[-1].startswith("error: " + error.format(tmp=tmp)), err[-500:]


@pytest.mark.parametrize("args, expected", [
    (["--variant=llama"], "error: Unknown command line flag 'variant'. Did you mean: variants ?"),
    (["--preset=huge"],
     "error: flag --preset=huge: value should be one of <tiny|cpu|gpu125m|gpu125m_64k>"),
    (["--variants=gpt"], "error: --variants=gpt; allowed: one or more of llama, cem_fused, "
                         "cem_autodiff, cem_fused_T2, cem_fused_diag, cem_autodiff_blocks, "
                         "llama_docs, cem_fused_docs"),
    (["--loss_block_size=-1"], "error: --loss_block_size=-1; allowed: an int >= 0"),
    (["--document_mask=true", "--variants=llama_docs"],
     "error: --document_mask=true has no effect on --variants=llama_docs: each sets its own "
     "model.document_mask; leave it out, or add a variant that does not set it (e.g. llama)"),
])
def test_bad_flags_are_refused_before_jax_is_imported(args, expected):
  # A mistyped flag or value cost jax's import (3 s of CPU) before its one line; now 0.3 s.
  # Mutation: bench importing jax (or cem_jax.model) at its top again printed "1 ['jax']"
  # for every case.
  proc = subprocess.run([sys.executable, "-c", RUN_MODULE_REPORTING_JAX, "cem_jax.bench",
                         *args], cwd=Path(__file__).resolve().parents[1],
                        env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert proc.stdout.strip() == "1 []", proc.stdout[-2000:] + proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [expected]


# Each measured table in docs/PERFORMANCE.md and the JSON it was copied from: (the heading of
# its section, its index among that section's tables, the JSON). A new measurement adds its
# tables here, so that what the docs claim stays what `bench` wrote.
_B2B = ("### Measured with back-to-back timing (H200, jax 0.11.2, 2026-12-04, main at e57afa6; "
        "issue 12)")
_DOC_TABLES = [
    ("## CPU, tiny shapes (2026-11-30)", 0, "cpu_tiny.json"),
    ("### Measured with the kernels `auto` picks (H200, jax 0.11.2, 2026-12-04; issue 12)",
     0, "gpu125m_h200_2026-12-04.json"),
    ("### Measured with the kernels `auto` picks (H200, jax 0.11.2, 2026-12-04; issue 12)",
     1, "gpu125m_64k_h200_2026-12-04.json"),
    *((_B2B, i, f"gpu125m{name}_h200_2026-12-04b.json") for i, name in enumerate(
        ["", "_64k", "_llama_profiled", "_no_triton_gemm", "_xla_flags_base", "_xla_flags_lt",
         "_xla_flags_cb", "_xla_flags_ltcb"])),
]

# A column's heading -> its figure from a JSON row (``rows``: the rows of that shape by variant).
_DOC_COLUMNS = {
    "params": lambda r, rows: r["params"] / 1e6,
    "compile s": lambda r, rows: r["compile_s"],
    "step ms": lambda r, rows: r["step_ms"],
    "waited ms": lambda r, rows: r["step_ms_synced"],
    "tokens/s": lambda r, rows: r["tokens_per_s"],
    "GFLOP/token": lambda r, rows: r["flops_per_token"] / 1e9,
    "MFU": lambda r, rows: None if r["mfu"] is None else 100 * r["mfu"],
    "peak MB": lambda r, rows: r["peak_memory_mb"],
    "XLA memory": lambda r, rows: r["peak_memory_mb"] / 1024,  # MiB in the JSON, GiB here
    "× llama": lambda r, rows: r["step_ms"] / rows["llama"]["step_ms"],
    "× cem_fused": lambda r, rows: r["step_ms"] / rows["cem_fused"]["step_ms"],
}


def _doc_tables(doc: str, heading: str) -> list[list[dict[str, str]]]:
  """The markdown tables of the section under ``heading``: a list of rows, each a dict."""
  import re

  start = doc.index(heading + "\n")
  level = heading.split(" ")[0]
  end = re.search(rf"^#{{1,{len(level)}}} ", doc[start + len(heading):], re.M)
  section = doc[start:start + len(heading) + end.start()] if end else doc[start:]
  tables, lines = [], []
  for line in section.splitlines() + [""]:
    if line.startswith("|"):
      lines.append([c.strip() for c in line.strip().strip("|").split("|")])
    elif lines:
      head, body = lines[0], [c for c in lines[1:] if not set("".join(c)) <= set("-: ")]
      tables.append([dict(zip(head, c, strict=True)) for c in body])
      lines = []
  return tables


@pytest.mark.parametrize("heading,index,name", _DOC_TABLES)
def test_the_tables_in_performance_md_are_the_figures_of_their_json(heading, index, name):
  import pathlib

  root = pathlib.Path(__file__).parents[1]
  table = _doc_tables((root / "docs" / "PERFORMANCE.md").read_text(), heading)[index]
  measured = json.loads((root / "results" / "bench" / name).read_text())["rows"]
  by_shape = {}
  for r in measured:
    by_shape.setdefault((r["seq_len"], r["d_model"]), {})[r["variant"]] = r
  assert table and {c for c in table[0] if c in _DOC_COLUMNS} >= {"step ms", "MFU"}, table[:1]
  for row in table:
    shape = (int(row["seq_len"]), int(row.get("d_model", measured[0]["d_model"])))
    rows = by_shape[shape]
    r = rows[row["variant"]]
    if "attention" in row:
      assert row["attention"].split(" ")[0] == r["attention"], (row, r["attention"])
    for column, figure in _DOC_COLUMNS.items():
      if column not in row:
        continue
      _assert_printed(row[column], figure(r, rows), (name, row["variant"], shape, column))


def _assert_printed(text: str, want: float | None, where) -> None:
  """``text`` (a table cell: ``1,234.5``, ``40.1%``, ``110.12M``, ``10.0 GiB`` or ``n/a``) is
  ``want`` rounded to the digits printed."""
  import re

  if want is None:
    assert text == "n/a", (where, text)
    return
  number = re.fullmatch(r"([\d,]+)(?:\.(\d+))?M?%?(?: GiB)?", text)
  assert number, (where, text)
  half_ulp = 0.5 * 10.0 ** -len(number.group(2) or "")
  got = float(number.group(1).replace(",", "") + "." + (number.group(2) or "0"))
  assert abs(got - want) <= half_ulp * (1 + 1e-9), (where, text, want)


def test_the_attention_kernel_table_in_performance_md_is_its_json():
  # experiments/attention_kernels.py writes its own rows (one attention call, not a step).
  import pathlib

  root = pathlib.Path(__file__).parents[1]
  table = _doc_tables((root / "docs" / "PERFORMANCE.md").read_text(),
                      "### Packed documents: a Pallas kernel with segment ids (H200, jax 0.11.2, "
                      "2026-12-04)")[0]
  measured = json.loads(
      (root / "results" / "bench" / "attention_docs_h200_2026-12-04b.json").read_text())
  by = {(r["impl"], r["shape"][1]): r for r in measured}
  assert len(table) == len(measured) == len(by)
  for row in table:
    r = by[(row["kernel"], int(row["seq_len"]))]
    causal = by[("cudnn_causal", r["shape"][1])]["ms_fwd_bwd"]
    for column, want in (("fwd+bwd ms", r["ms_fwd_bwd"]),
                         ("× cudnn_causal", r["ms_fwd_bwd"] / causal),
                         ("max error", r["max_err_vs_xla"]),
                         ("gradient error", r["grad_rel_err"])):
      _assert_printed(row[column], want, (row["kernel"], row["seq_len"], column))


def test_the_step_is_built_for_the_platform_named_not_only_this_machines():
  # experiments/step_program.py compiles the step for an H200 on a CPU: the model must pick
  # the GPU's kernel (cuDNN, for bf16 and head_dim 64) although this machine has none.
  tiny = dict(bench.PRESETS["tiny"], d_model=64, num_layers=1, mlp_dim=64, tokens_per_batch=64)
  config = bench.model_config(tiny, bench.VARIANTS["cem_fused"], 32, 64)
  config.model.dtype = "bfloat16"
  chosen = {platform: bench.train_step_inputs(config, 64, abstract=True,
                                              platform=platform)[0].attention_impl
            for platform in (None, "gpu", "tpu")}
  assert chosen == {None: "xla", "gpu": "cudnn", "tpu": "splash"}, chosen


def test_a_row_names_the_kernel_its_step_runs_not_the_one_the_model_chose(monkeypatch):
  # A model built for a GPU picks cuDNN; at an odd seq_len 'auto' runs XLA's attention in its
  # steps (cuDNN needs an even length), and the row must say XLA. XLA's kernel compiles here.
  tiny = dict(bench.PRESETS["tiny"], d_model=64, num_layers=1, mlp_dim=64, tokens_per_batch=66)
  config = bench.model_config(tiny, bench.VARIANTS["cem_fused"], 33, 64)
  config.model.dtype = "bfloat16"
  inputs = bench.train_step_inputs
  monkeypatch.setattr(bench, "train_step_inputs",
                      lambda c, v: inputs(c, v, platform="gpu"))
  r = bench.bench_one(config, 64, steps=1, warmup=0)
  assert r["attention"] == "xla", r["attention"]
  assert r["attention_reason"] == "auto: cudnn needs a multiple of 2", r["attention_reason"]
  config.data.seq_len, config.train.batch_size = 32, 2
  model = inputs(config, 64, abstract=True, platform="gpu")[0]
  assert model.kernel_at(32) == ("cudnn", model.attention_reason)
  config.model.attention_impl = "cudnn"
  model = inputs(config, 64, abstract=True, platform="gpu")[0]
  with pytest.raises(ValueError, match=r"^model.attention_impl='cudnn' cannot run: seq_len=33 "
                     r"must be a multiple of 2 \(use 'auto', which runs XLA there, or 'xla'\)$"):
    model.kernel_at(33)


_STEP_PROGRAM = Path(__file__).resolve().parents[1] / "experiments" / "step_program.py"

# A compiled GPU module as XLA prints it, cut down: a gemm fusion (bf16 [64,32] x [32,16] ->
# f32), a cuDNN attention call, a forward and a backward elementwise fusion, a fusion that
# reads a slice of its operand, one that scatters into its operand, an update fusion, and
# instructions that launch nothing.
_GPU_HLO = """HloModule jit_step, is_scheduled=true

%gemm_fusion_dot.1_computation (parameter_0: bf16[64,32], parameter_1: bf16[32,16]) -> f32[64,16] {
  %parameter_0 = bf16[64,32]{1,0} parameter(0)
  %parameter_1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,16]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_slice (param_0: f32[64,16], param_1: s32[8]) -> f32[8] {
  %param_0 = f32[64,16]{1,0} parameter(0)
  %bitcast.1 = f32[1024]{0} bitcast(%param_0)
  %slice.1 = f32[8]{0} slice(%bitcast.1), slice={[0:8]}
  %param_1 = s32[8]{0} parameter(1)
  %convert.2 = f32[8]{0} convert(%param_1)
  ROOT %add.1 = f32[8]{0} add(%slice.1, %convert.2)
}

%fused_scatter (param_0: f32[64,16], param_1: s32[8,2], param_2: f32[8]) -> f32[64,16] {
  %param_0 = f32[64,16]{1,0} parameter(0)
  %param_1 = s32[8,2]{1,0} parameter(1)
  %param_2 = f32[8]{0} parameter(2)
  ROOT %scatter.1 = f32[64,16]{1,0} scatter(%param_0, %param_1, %param_2), update_window_dims={}, inserted_window_dims={0,1}, scatter_dims_to_operand_dims={0,1}, index_vector_dim=1, to_apply=%add
}

%fused_exp (param_0: f32[64,16]) -> bf16[64,16] {
  %param_0 = f32[64,16]{1,0} parameter(0)
  %exp.1 = f32[64,16]{1,0} exponential(%param_0)
  ROOT %convert.1 = bf16[64,16]{1,0} convert(%exp.1)
}

ENTRY %main.9 (a: bf16[64,32], b: bf16[32,16], w: f32[16], ids: s32[8], pairs: s32[8,2]) -> (bf16[64,16], f32[16]) {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %w = f32[16]{0} parameter(2), metadata={op_name="w"}
  %gemm_fusion_dot.1 = f32[64,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.1_computation, metadata={op_name="jit(step)/jvp(btd,df->btf)/dot_general"}
  %loop_exp_fusion = bf16[64,16]{1,0} fusion(%gemm_fusion_dot.1), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(step)/jvp()/exp"}
  %ids = s32[8]{0} parameter(3)
  %picked = f32[8]{0} fusion(%gemm_fusion_dot.1, %ids), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(step)/jvp()/add"}
  %pairs = s32[8,2]{1,0} parameter(4)
  %scattered = f32[64,16]{1,0} fusion(%gemm_fusion_dot.1, %pairs, %picked), kind=kInput, calls=%fused_scatter, metadata={op_name="jit(step)/transpose(jvp())/scatter-add"}
  %attn = (bf16[2,8,4,16]{3,2,1,0}, f32[2,4,8]{2,1,0}, u8[0]{0}) custom-call(%loop_exp_fusion, %loop_exp_fusion), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/jvp()/dot_product_attention"}
  %gte = bf16[2,8,4,16]{3,2,1,0} get-tuple-element(%attn), index=0
  %back = bf16[64,16]{1,0} fusion(%gte), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(step)/transpose(jvp())/mul"}
  %update = f32[16]{0} fusion(%w, %w), kind=kLoop, calls=%fused_exp, metadata={op_name="jit(step)/sub"}
  ROOT %out = (bf16[64,16]{1,0}, f32[16]{0}) tuple(%back, %update)
}
"""  # noqa: E501 (XLA's lines, as printed)


def test_gpu_kernels_reads_kinds_bytes_and_matmul_flops_off_a_compiled_module():
  import importlib.util

  spec = importlib.util.spec_from_file_location("step_program", _STEP_PROGRAM)
  program = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(program)
  assert program.array_bytes("(bf16[2,3]{1,0}, f32[4]{0}, u8[0]{0})") == 2 * 6 + 4 * 4
  got = [(k["name"], k["kind"], k["bytes"], k["flops"]) for k in program.gpu_kernels(_GPU_HLO)]
  attention = 2 * 2 * 8 * 4 * 16 + 4 * 2 * 4 * 8 + 2 * (2 * 64 * 16)
  assert got == [
      ("gemm_fusion_dot.1", "matmul", 2 * 64 * 32 + 2 * 32 * 16 + 4 * 64 * 16, 2 * 64 * 16 * 32),
      ("loop_exp_fusion", "forward", 4 * 64 * 16 + 2 * 64 * 16, 0),
      ("picked", "forward", 4 * 8 + 4 * 8 + 4 * 8, 0),  # reads 8 of the 1024 floats
      ("scattered", "backward", 4 * 8 + 4 * 8 * 2 + 4 * 8 + 4 * 8, 0),  # updates 8 in place
      ("attn", "attention", attention, 0),
      ("back", "backward", 2 * 2 * 8 * 4 * 16 + 2 * 64 * 16, 0),
      ("update", "update", 3 * 4 * 16, 0)]
  with pytest.raises(ValueError, match="^no ENTRY computation in the HLO text$"):
    program.gpu_kernels("HloModule m\n")


# An index operand is read whole (not as what the slice or gather produces); a cuBLAS gemm
# call and an unfused dot are matmuls with their FLOPs.
_GPU_HLO_INDICES_AND_CUBLAS = """HloModule m

%fused_ds (param_0: f32[1024,1024], param_1: s32[]) -> f32[8,1024] {
  %param_0 = f32[1024,1024]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = f32[8,1024]{1,0} dynamic-slice(%param_0, %param_1, %c), dynamic_slice_sizes={8,1024}
}

%fused_gather (param_0: f32[1024,1024], param_1: s32[8,1]) -> f32[8,1024] {
  %param_0 = f32[1024,1024]{1,0} parameter(0)
  %param_1 = s32[8,1]{1,0} parameter(1)
  ROOT %g = f32[8,1024]{1,0} gather(%param_0, %param_1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,1024}
}

ENTRY %main (a: f32[1024,1024], i: s32[], ids: s32[8,1], h: bf16[64,768], w: bf16[768,512], x: f32[64,32]) -> f32[8,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %ids = s32[8,1]{1,0} parameter(2)
  %h = bf16[64,768]{1,0} parameter(3)
  %w = bf16[768,512]{1,0} parameter(4)
  %x = f32[64,32]{1,0} parameter(5)
  %ds = f32[8,1024]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused_ds, metadata={op_name="jit(step)/jvp()/dynamic_slice"}
  %gat = f32[8,1024]{1,0} fusion(%a, %ids), kind=kLoop, calls=%fused_gather, metadata={op_name="jit(step)/jvp()/gather"}
  %gemm = (bf16[64,512]{1,0}, s8[1024]{0}) custom-call(%h, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/jvp()/dot_general"}, backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %dot = f32[64,64]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(step)/jvp()/dot_general"}
  ROOT %r = f32[8,1024]{1,0} add(%ds, %gat), metadata={op_name="jit(step)/jvp()/add"}
}
"""  # noqa: E501 (XLA's lines, as printed)


def test_gpu_kernels_reads_index_operands_whole_and_counts_cublas_and_dot_flops():
  import importlib.util

  spec = importlib.util.spec_from_file_location("step_program", _STEP_PROGRAM)
  program = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(program)
  got = [(k["name"], k["kind"], k["bytes"], k["flops"])
         for k in program.gpu_kernels(_GPU_HLO_INDICES_AND_CUBLAS)]
  rows = 4 * 8 * 1024  # what the slice and the gather produce, and read of %a
  assert got == [
      ("ds", "forward", rows + rows + 4, 0),  # the start index: 4 bytes, not the slice's
      ("gat", "forward", rows + rows + 4 * 8, 0),  # the indices: 32 bytes
      ("gemm", "matmul", 2 * 64 * 512 + 1024 + 2 * 64 * 768 + 2 * 768 * 512, 2 * 64 * 512 * 768),
      ("dot", "matmul", 4 * 64 * 64 + 2 * 4 * 64 * 32, 2 * 64 * 64 * 32),
      ("r", "forward", 3 * rows, 0)]


def test_one_layer_takes_the_kernels_between_two_layers_attention_calls_each_way():
  import importlib.util

  spec = importlib.util.spec_from_file_location("step_program", _STEP_PROGRAM)
  program = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(program)
  # 3 layers: forward attention calls a0 a1 a2, then the backward's in reverse: b2 b1 b0.
  names = ["embed", "a0", "f0", "a1", "f1", "a2", "f2", "loss",
           "b2", "g2", "b1", "g1", "b0", "g0", "update"]
  kernels = [{"name": n, "kind": "attention" if n[0] in "ab" and n[1:].isdigit() else "other",
              "bytes": 1} for n in names]
  got = {part: [k["name"] for k in ks] for part, ks in program.one_layer(kernels, 1).items()}
  assert got == {"forward": ["a1", "f1"], "backward": ["b2", "g2"]}
  got = {part: [k["name"] for k in ks] for part, ks in program.one_layer(kernels, 0).items()}
  assert got == {"forward": ["a0", "f0"], "backward": ["b1", "g1"]}
  with pytest.raises(ValueError, match=r"^layer=2; allowed: 0\.\.1$"):
    program.one_layer(kernels, 2)
  with pytest.raises(ValueError, match=r"^5 attention calls; expected two per layer$"):
    program.one_layer(kernels[:-3], 0)


def test_step_program_refuses_bad_arguments_in_one_line_before_lowering_anything():
  """A SEQ_LEN that is not an integer, or not >= 1, was a traceback; a TOKENS_PER_BATCH that
  is not a multiple of SEQ_LEN lowered a step of fewer tokens than its line printed (seq_len
  1000, 2048 tokens: 2 windows, 2,000 tokens, printed as 2048); a fifth argument was ignored."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("step_program", _STEP_PROGRAM)
  program = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(program)
  assert program.parse_args([]) == ()
  assert program.parse_args(["llama", "1024", "16384", "h200"]) == ("llama", 1024, 16384, "h200")
  with pytest.raises(SystemExit, match=r"^SEQ_LEN='abc'; allowed: an integer >= 1 \(usage"):
    program.parse_args(["cem_fused", "abc"])
  with pytest.raises(SystemExit, match=r"^TOKENS_PER_BATCH='2k'; allowed: an integer >= 1"):
    program.parse_args(["cem_fused", "1024", "2k"])
  with pytest.raises(SystemExit, match=r"^5 arguments \(cem_fused 1024 2048 cpu extra\); usage"):
    program.parse_args(["cem_fused", "1024", "2048", "cpu", "extra"])
  for seq_len, tokens in ((0, 2048), (-4, 2048), (1000, 2048), (2048, 1024)):
    with pytest.raises(SystemExit, match=rf"^SEQ_LEN={seq_len} TOKENS_PER_BATCH={tokens}; "
                       "allowed: SEQ_LEN >= 1 and TOKENS_PER_BATCH a multiple of it"):
      program.main("cem_fused", seq_len, tokens)
  program.check_shape(1024, 16384)  # whole windows pass
