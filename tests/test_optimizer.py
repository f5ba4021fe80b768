"""The learning-rate schedule and the rate the loop logs, against the formula."""

import math

import jax
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

from cem_jax import optim, steps

V = 64


def _cfg(**train_overrides):
  c = tiny_config("llama", **{"model.d_model": 16, "model.num_heads": 2, "model.mlp_dim": 32,
                              "model.num_layers": 1, "data.seq_len": 8})
  c.train.learning_rate, c.train.warmup_steps, c.train.num_steps = 1e-2, 4, 20
  c.train.min_learning_rate_ratio = 0.1
  for k, v in train_overrides.items():
    c.train[k] = v
  return c


def _expected_lr(k, peak=1e-2, warmup=4, total=20, ratio=0.1):
  """The rate of update k (1-based) from the maths: linear to the peak at update ``warmup``,
  then cosine to ``ratio * peak`` at update ``total``."""
  if k <= warmup:
    return peak * k / warmup
  frac = (k - warmup) / (total - warmup)
  return ratio * peak + (peak - ratio * peak) * 0.5 * (1 + math.cos(math.pi * frac))


@pytest.mark.parametrize("k", [1, 2, 4, 5, 12, 20])
def test_schedule_follows_the_formula_from_the_first_update(k):
  _, schedule = optim.make_optimizer(_cfg().train)
  assert float(schedule(k - 1)) == pytest.approx(_expected_lr(k), rel=1e-6)
  assert float(schedule(0)) > 0.0


def _setup(cfg):
  model = steps.build_model(cfg, V)
  graphdef, params = nnx.split(model, nnx.Param)
  tx, schedule = optim.make_optimizer(cfg.train)
  step = steps.make_train_step(graphdef, tx, cfg.train.max_consecutive_nonfinite,
                               schedule=schedule)
  return params, tx.init(params), step


def _batch(seed, nan=False):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (2, 9)).astype(np.int32)
  weights = np.ones((2, 8), np.float32)
  if nan:
    weights[0, 0] = np.nan  # a non-finite loss and gradient: the update is skipped
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "segment_ids": np.ones((2, 8), np.int32), "weights": weights}


def test_the_first_update_moves_the_weights_by_the_first_rate():
  params, opt_state, step = _setup(_cfg())
  before = jax.tree.map(np.asarray, params)
  params, _, m = step(params, opt_state, _batch(0))
  assert float(m["learning_rate"]) == pytest.approx(1e-2 / 4, rel=1e-6)
  # Adam's first update is lr * g / (|g| + eps) = ±lr where g != 0; RMSNorm scales are not
  # decayed, so they move by exactly the first rate.
  scale = np.asarray(params["final_norm"]["scale"][...]) - before["final_norm"]["scale"][...]
  np.testing.assert_allclose(np.abs(scale), 1e-2 / 4, rtol=1e-3)


def test_after_a_skipped_update_the_logged_rate_is_the_applied_one():
  params, opt_state, step = _setup(_cfg())
  logged = []
  for i in range(6):
    params, opt_state, m = step(params, opt_state, _batch(i, nan=(i == 1)))
    logged.append(float(m["learning_rate"]))
  assert int(m["nonfinite_total"]) == 1
  # updates 1, 3, 4, 5, 6 were applied as the 1st..5th: update 3 used the 2nd rate, not the 3rd
  expected = [_expected_lr(1), _expected_lr(2), _expected_lr(2), _expected_lr(3),
              _expected_lr(4), _expected_lr(5)]
  np.testing.assert_allclose(logged, expected, rtol=1e-6)
  assert int(optim.applied_updates(opt_state)) == 5
