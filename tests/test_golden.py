"""Golden numbers: loss and gradient norm of a tiny CEM and a tiny Llama model over the first
train steps, pinned.

The train step is the real one (``optim.make_optimizer``, ``steps.init_state``,
``steps.make_train_step``) on fixed synthetic token batches (a pure function of the step,
independent of any corpus, tokenizer or held-out split), so only the model, the loss, the
optimizer and the schedule decide these numbers.

If this test fails, the numbers an unchanged config trains to have changed. Either that is a
bug (a refactor that was meant to change nothing changed the maths), or a deliberate numerics
change: then bump ``NUMERICS_VERSION`` in ``cem_jax/version.py`` (saying what changed, so that
``python -m cem_jax.tables`` retrains old runs instead of reusing them) and re-pin with
``GOLDEN_PRINT=1 python -m pytest tests/test_golden.py -s``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config

from cem_jax import optim, steps
from cem_jax.version import NUMERICS_VERSION

V, N, B = 97, 16, 4
STEPS = 6  # metrics of step k: loss and gradient at the parameters after k - 1 updates

CONFIGS = {
    "cem": {"model.num_steps": 2, "model.diagonal": "per_head", "model.precond": "both",
            "model.precond_rank": 2},
    "llama": {},
}

# (numerics version, model) -> {step: (loss, grad_norm)}: steps 1 (initial parameters),
# 2 (after one update) and 6 (after five updates). Version 3 changed only the data order and
# the eval windows, not these fixed batches: its numbers are version 2's.
GOLDEN = {
    (3, "cem"): {1: (4.5659284591674805, 1.6355526447296143),
                 2: (4.592813968658447, 1.8160977363586426),
                 6: (4.600702285766602, 1.3772908449172974)},
    (3, "llama"): {1: (4.573606491088867, 1.0723673105239868),
                   2: (4.592437744140625, 1.0996721982955933),
                   6: (4.62600040435791, 1.09440016746521)},
}


def _batch(step):
  rng = np.random.default_rng(1000 + step)
  tokens = rng.integers(0, V, (B, N + 1)).astype(np.int32)
  segments = np.ones((B, N), np.int32)
  segments[1, N // 2:] = 2  # a document boundary: its target is not weighted
  weights = np.ones((B, N), np.float32)
  weights[1, N // 2 - 1] = 0.0
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
          "weights": weights}


def _run(block):
  overrides = {"model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64,
               "model.num_layers": 2, "data.seq_len": N, "train.batch_size": B,
               "train.num_steps": 20, "train.warmup_steps": 3, "train.learning_rate": 1e-2,
               "mesh.data": 1}
  cfg = tiny_config(block, **overrides, **CONFIGS[block])
  tx, schedule = optim.make_optimizer(cfg.train)
  graphdef, params, opt_state, shardings, _ = steps.init_state(cfg, V, tx)
  step = steps.make_train_step(graphdef, tx, cfg.train.max_consecutive_nonfinite, shardings,
                               schedule)
  out = {}
  for k in range(1, STEPS + 1):
    batch = shardings.global_batch(_batch(k), B)
    params, opt_state, m = step(params, opt_state, batch, np.int32(0), np.int32(k))
    out[k] = (float(m["loss"]), float(m["grad_norm"]))
  return out


def _check(block, got, compiled):
  want = GOLDEN.get((NUMERICS_VERSION, block))
  assert want, (f"no golden numbers for numerics version {NUMERICS_VERSION}: pin them with "
                "GOLDEN_PRINT=1 python -m pytest tests/test_golden.py -s")
  for k, (loss, grad_norm) in want.items():
    assert got[k][0] == pytest.approx(loss, rel=1e-5) and got[k][1] == pytest.approx(
        grad_norm, rel=1e-5), (
        f"{block} step {k}, {compiled}: (loss, grad_norm) = {got[k]}, pinned "
        f"{(loss, grad_norm)} for numerics version {NUMERICS_VERSION}. An unchanged config now "
        "trains to different numbers: a bug if this change was meant to keep the numerics; if "
        "it is a deliberate numerics change, bump NUMERICS_VERSION in cem_jax/version.py (say "
        "what changed) and re-pin (see this file's docstring)")


@pytest.mark.parametrize("block", list(CONFIGS))
def test_golden_loss_and_grad_norm(block):
  got = _run(block)
  if os.environ.get("GOLDEN_PRINT"):
    print(f"\n    ({NUMERICS_VERSION}, {block!r}): "
          f"{ {k: got[k] for k in (1, 2, STEPS)} },")
  _check(block, got, "compiled as the suite compiles")


TRAINING_COMPILE_SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import test_golden
print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS"),
                  "runs": {"cem": test_golden._run("cem")}}))
"""


def test_golden_numbers_hold_as_training_compiles_them():
  # The suite compiles with less optimisation and XLA's older CPU code emitters
  # (conftest.FAST_COMPILE), for speed; a run of main compiles with XLA's defaults. The same
  # numbers both ways are what lets the rest of the suite stand for training. The CEM model
  # only, whose step runs the same kinds of ops as Llama's (the attention kernel, RMSNorm,
  # AdamW) and its energies besides: 16 s of CPU here, and Llama's would be another 14.
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
  tests = Path(__file__).resolve().parent
  proc = subprocess.run([sys.executable, "-c", TRAINING_COMPILE_SCRIPT, str(tests)],
                        env=dict(env, JAX_PLATFORMS="cpu"), cwd=tests.parent,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["xla_flags"] is None  # XLA's defaults
  for block, got in out["runs"].items():
    _check(block, {int(k): v for k, v in got.items()}, "compiled as training compiles")
