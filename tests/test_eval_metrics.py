"""Eval metrics (loss, bits per byte, perplexity, energy trace) are totals over real tokens,
equal to a float64 reference and the same for any eval.batch_size."""

import math
import types

import jax
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

from cem_jax import steps as steps_lib
from cem_jax.data import packing
from cem_jax.data.pipeline import EvalWindows
from cem_jax.metrics import energy_trace

V, N = 61, 16


def _setup():
  cfg = tiny_config("cem", **{"model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 48,
                              "model.num_layers": 2, "model.num_steps": 2,
                              "data.seq_len": N, "eval.max_batches": -1})
  model = steps_lib.build_model(cfg, V)
  graphdef, params = nnx.split(model, nnx.Param)
  # non-initial parameters: every leaf moved off its init value (in NumPy: jax would compile
  # a program per leaf shape for the same noise)
  noise = np.random.default_rng(7)
  params = jax.tree.map(lambda x: jax.numpy.asarray(
      np.asarray(x) + 0.05 * noise.standard_normal(x.shape).astype(x.dtype)), params)
  rng = np.random.default_rng(3)
  docs = [rng.integers(2, V, size=n).astype(np.int32) for n in (23, 9, 40, 5, 17)]
  # 1 to 4 UTF-8 bytes per token (EvalWindows needs per-token bytes for bits per byte).
  doc_bytes = [rng.integers(1, 5, size=len(d)).astype(np.int32) for d in docs]
  windows = packing.pack(docs, N, eos_id=1, pad_id=0, keep_tail=True, split="validation",
                         doc_bytes=doc_bytes)
  data = types.SimpleNamespace(eval_batches=EvalWindows(windows, 0).batches)
  return cfg, graphdef, params, data, windows


def _reference(graphdef, params, windows):
  """Per window, the model on its real prefix alone (no padding anywhere), energies and
  losses summed in float64 over all windows and divided by the token counts. A target is
  token i + 1 of a window, predicted from token i of the same document; bits per byte are
  its nats / ln 2 over its UTF-8 bytes (``windows.nbytes``), perplexity e^(mean nats).
  Returns ``(energies, eval/loss, eval/bits_per_byte, eval/perplexity)``."""
  # jitted: two distinct prefix lengths compile twice, where eager runs op by op per length
  forward = jax.jit(lambda p, x, s: nnx.merge(graphdef, p)(x, s, trace=True))
  energy, tokens, loss, targets, nbytes = {}, 0, 0.0, 0.0, 0.0
  for tok, seg, byt in zip(windows.tokens, windows.segment_ids, windows.nbytes, strict=True):
    # Not make_batch (which the eval step uses): input i is token i, with its own document.
    n = int((seg[:-1] > 0).sum())  # padding is only at the tail
    logits, traces = forward(params, tok[None, :n], seg[None, :n])
    for layer, steps in enumerate(traces):
      for t, rec in enumerate(steps):
        for key, value in rec.items():
          name = f"eval/energy/layer{layer}/step{t + 1}/{key}"
          energy[name] = energy.get(name, 0.0) + float(value)
    tokens += n
    logits = np.asarray(logits[0], np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    w = ((seg[1:n + 1] == seg[:n]) & (seg[1:n + 1] > 0)).astype(np.float64)
    nll = -logp[np.arange(n), tok[1:n + 1]]
    loss += float((nll * w).sum())
    targets += float(w.sum())
    nbytes += float((byt[1:n + 1] * w).sum())
  return ({k: v / tokens for k, v in energy.items()}, loss / targets,
          loss / np.log(2.0) / nbytes, np.exp(loss / targets))


def test_eval_metrics_equal_the_float64_reference_for_any_eval_batch_size():
  cfg, graphdef, params, data, windows = _setup()
  step = steps_lib.make_eval_step(graphdef, None, energy_trace=True)
  energy_ref, loss_ref, bpb_ref, perplexity_ref = _reference(graphdef, params, windows)
  results = {}
  for bs in (1, 4, 8):  # 8 > the number of windows: one batch, mostly padding rows
    cfg.eval.batch_size = bs
    results[bs] = steps_lib.eval_loop(step, params, data, cfg)
  assert windows.num_windows < 8 and windows.num_windows % 4
  for bs, metrics in results.items():
    got = {k: v for k, v in metrics.items() if k.startswith("eval/energy/")}
    assert sorted(got) == sorted(energy_ref), bs
    for key, want in energy_ref.items():
      assert got[key] == pytest.approx(want, rel=1e-4, abs=1e-5), (bs, key)
    assert metrics["eval/loss"] == pytest.approx(loss_ref, rel=1e-5), bs
    assert metrics["eval/bits_per_byte"] == pytest.approx(bpb_ref, rel=1e-5), bs
    assert metrics["eval/perplexity"] == pytest.approx(perplexity_ref, rel=1e-5), bs
  assert len(energy_trace(results[1])) == 2


def test_energy_steps_keep_each_sub_steps_own_before_and_after():
  from cem_jax.metrics import energy_steps, energy_trace, final_energy

  line = {"step": 5, "eval/loss": 1.0}
  values = {(0, 1, "att"): (-1.0, -3.0), (0, 2, "att"): (-2.0, -2.5),  # the MLP step raised it
            (0, 1, "mlp"): (4.0, 1.0), (0, 2, "mlp"): (2.0, 0.5), (1, 1, "att"): (0.0, -1.0),
            (1, 2, "att"): (-0.5, -1.75), (1, 1, "mlp"): (1.0, 0.0), (1, 2, "mlp"): (0.5, 0.25)}
  for (layer, step, part), (before, after) in values.items():
    line[f"eval/energy/layer{layer}/step{step}/{part}_before"] = before
    line[f"eval/energy/layer{layer}/step{step}/{part}_after"] = after
  steps = energy_steps(line)
  assert steps[0]["att"] == [(-1.0, -3.0), (-2.0, -2.5)]
  assert steps[1]["mlp"] == [(1.0, 0.0), (0.5, 0.25)]
  assert energy_trace(line)[0]["att"] == [-1.0, -3.0, -2.5]
  # after each sub-layer's last step, summed: -2.5 + 0.5 (layer 0), -1.75 + 0.25 (layer 1);
  # no single term (nor one layer's) equals the sum
  assert final_energy(line) == pytest.approx(-3.5)
  assert energy_steps({"step": 5, "eval/loss": 1.0}) == {}
  # A half missing (a cut or hand-edited line) is None, as a non-finite (null) value is.
  assert energy_steps({"eval/energy/layer0/step1/att_before": 2.0}) == {0: {"att": [(2.0, None)]}}
  assert final_energy({"eval/energy/layer0/step1/att_before": 2.0}) is None
  assert final_energy({"step": 5, "eval/loss": 1.0}) is None  # no trace: a Llama model
  # steps and layers in numeric order whatever the key order (step10 after step9)
  many = {"eval/loss": 1.0}
  for step in reversed(range(1, 12)):
    for layer in (10, 2):
      many[f"eval/energy/layer{layer}/step{step}/att_before"] = float(step)
      many[f"eval/energy/layer{layer}/step{step}/att_after"] = step - 0.5
  got = energy_steps(many)
  assert list(got) == [2, 10] and got[10]["att"] == [(s, s - 0.5) for s in range(1, 12)]


def test_the_eval_loop_reads_max_batches_and_caps_the_perplexity():
  # A stand-in eval step (a diverged model: 800 nats per token) over five batches.
  seen = []

  def eval_step(params, batch):
    seen.append(batch["i"])
    return {"loss_sum": 8000.0, "weight_sum": 10.0, "byte_sum": 20.0}

  def eval_batches(bs, index, count, max_batches):  # EvalWindows.batches picks the windows
    return ({"i": i} for i in range(5 if max_batches == -1 else max_batches))

  data = types.SimpleNamespace(eval_batches=eval_batches)
  for max_batches, want in ((2, [0, 1]), (-1, [0, 1, 2, 3, 4])):
    seen.clear()
    m = steps_lib.eval_loop(eval_step, None, data, tiny_config(**{"eval.max_batches": max_batches}))
    assert seen == want
    assert m["eval/loss"] == 800.0 and m["eval/tokens"] == 10 * len(want)
    assert m["eval/perplexity"] == math.exp(80.0)  # exp(800) overflows a float
    assert m["eval/bits_per_byte"] == pytest.approx(800.0 / 2.0 / math.log(2))


def test_the_sharded_eval_loop_reads_this_process_block_and_makes_each_batch_global():
  # Process 2 of 4 (its devices hold rows 4..5 of every global batch of 8): it must read
  # block 2 of 4 of every eval batch and hand each to the step as the global [8, ...] batch.
  calls = []

  class Shardings:  # stand-in for steps.StateShardings
    def process_slice(self, rows):
      calls.append(("slice", rows))
      return 2, 4

    def global_batch(self, local, rows):
      return {"local": local["i"], "rows": rows}

  def eval_batches(bs, index, count, max_batches):
    calls.append(("read", bs, index, count, max_batches))
    return ({"i": i} for i in range(3))

  def eval_step(params, batch):
    calls.append(("step", batch))
    return {"loss_sum": 1.0, "weight_sum": 1.0, "byte_sum": 1.0}

  cfg = tiny_config(**{"eval.batch_size": 8, "eval.max_batches": 3})
  steps_lib.eval_loop(eval_step, None, types.SimpleNamespace(eval_batches=eval_batches), cfg,
                      Shardings())
  assert calls == [("slice", 8), ("read", 8, 2, 4, 3)] + [
      ("step", {"local": i, "rows": 8}) for i in range(3)]
