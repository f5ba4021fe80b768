"""The optimizer against the formulas: the learning-rate schedule, the rate the loop logs, and
AdamW with clipping and masked weight decay."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


@pytest.mark.parametrize("warmup, total", [(0, 20), (20, 20), (25, 20), (19, 20), (4, 5)])
def test_schedule_follows_the_formula_at_every_update_for_any_warmup(warmup, total):
  # warmup 0: the cosine from the first update; a warmup as long as the run (or longer, which
  # validation allows) is a linear ramp that never decays, not an error from optax.
  cfg = _cfg(warmup_steps=warmup, num_steps=total).train
  _, schedule = optim.make_optimizer(cfg)
  got = [float(schedule(k - 1)) for k in range(1, total + 1)]
  want = [_expected_lr(k, warmup=warmup, total=total) for k in range(1, total + 1)]
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_applied_updates_needs_exactly_one_schedule_in_the_state():
  # Two schedules (an optimizer wrapped in another) would make the count ambiguous.
  tx, _ = optim.make_optimizer(_cfg().train)
  params = {"w": jnp.ones(3)}
  assert int(optim.applied_updates(tx.init(params))) == 0
  for state, found in ((optax.chain(tx, tx).init(params), 2), (optax.sgd(0.1).init(params), 0)):
    with pytest.raises(ValueError) as e:
      optim.applied_updates(state)
    assert str(e.value) == (f"expected one learning-rate schedule in the optimizer state, found "
                            f"{found}; build the optimizer with make_optimizer")


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
  params, opt_state, m = step(params, opt_state, _batch(0))
  assert float(m["learning_rate"]) == pytest.approx(1e-2 / 4, rel=1e-6)
  # Adam's first update is lr * g / (|g| + eps) = ±lr where g != 0; RMSNorm scales are not
  # decayed, so they move by exactly the first rate.
  scale = np.asarray(params["final_norm"]["scale"][...]) - before["final_norm"]["scale"][...]
  np.testing.assert_allclose(np.abs(scale), 1e-2 / 4, rtol=1e-3)
  # A batch of padding alone (no weighted token) is a finite step of loss 0, not a skipped one.
  padding = dict(_batch(1), weights=np.zeros((2, 8), np.float32))
  _, _, m = step(params, opt_state, padding)
  assert (float(m["loss"]), float(m["grad_norm"]), int(m["nonfinite_total"])) == (0.0, 0.0, 0)


def test_after_a_skipped_update_the_logged_rate_is_the_applied_one():
  params, opt_state, step = _setup(_cfg(max_consecutive_nonfinite=2))
  logged, guard, counts = [], np.int32(0), []
  for i in range(6):
    params, opt_state, m = step(params, opt_state, _batch(i, nan=(i == 1)), guard,
                                np.int32(i + 1))
    logged.append(float(m["learning_rate"]))
    guard = m["nonfinite_guard"]
    counts.append((int(m["nonfinite_total"]), int(m["nonfinite_consecutive"])))
  assert int(m["nonfinite_total"]) == 1
  # updates 1, 3, 4, 5, 6 were applied as the 1st..5th: update 3 used the 2nd rate, not the 3rd
  expected = [_expected_lr(1), _expected_lr(2), _expected_lr(2), _expected_lr(3),
              _expected_lr(4), _expected_lr(5)]
  np.testing.assert_allclose(logged, expected, rtol=1e-6)
  assert int(optim.applied_updates(opt_state)) == 5
  # Updates 7, 8, 9 non-finite: the guard becomes 8, where two in a row were first reached, and
  # stays there (the loop reads it at its next log or save).
  assert int(guard) == 0
  for i in range(6, 9):
    params, opt_state, m = step(params, opt_state, _batch(i, nan=True), guard, np.int32(i + 1))
    guard = m["nonfinite_guard"]
    counts.append((int(m["nonfinite_total"]), int(m["nonfinite_consecutive"])))
  assert int(guard) == 8
  # Per update (total skipped so far, skipped in a row): a finite update ends the run of
  # failures, not the total.
  assert counts == [(0, 0), (1, 1), (1, 0), (1, 0), (1, 0), (1, 0), (2, 1), (3, 2), (4, 3)]


def test_three_updates_equal_adamw_with_clipping_in_float64():
  """make_optimizer against AdamW written out (Loshchilov & Hutter 2019; optax's eps = 1e-8
  outside the root): the global norm clipped to train.grad_clip, Adam's bias-corrected
  moments, decoupled weight decay on the decayed names only (w_q yes, a norm scale no), each
  scaled by the rate of its update."""
  cfg = _cfg(weight_decay=0.3, b1=0.8, b2=0.95, grad_clip=1.0).train
  tx, _ = optim.make_optimizer(cfg)
  rng = np.random.default_rng(0)
  params = {"w_q": rng.standard_normal((3, 4)), "scale": rng.standard_normal(4)}
  grads = [{k: s * rng.standard_normal(v.shape) for k, v in params.items()}
           for s in (0.05, 3.0, 0.2)]  # the second is clipped, the others are not
  got = jax.tree.map(lambda x: jax.numpy.asarray(x, jax.numpy.float32), params)
  state = tx.init(got)
  want = {k: v.copy() for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v2 = {k: np.zeros_like(v) for k, v in params.items()}
  for k, g in enumerate(grads, start=1):
    updates, state = tx.update(jax.tree.map(jax.numpy.asarray, g), state, got)
    got = jax.tree.map(lambda p, u: p + u, got, updates)
    norm = math.sqrt(sum(float(np.sum(x * x)) for x in g.values()))
    clip = min(1.0, cfg.grad_clip / norm)
    for name in want:
      gi = g[name] * clip
      m[name] = cfg.b1 * m[name] + (1 - cfg.b1) * gi
      v2[name] = cfg.b2 * v2[name] + (1 - cfg.b2) * gi * gi
      adam = (m[name] / (1 - cfg.b1**k)) / (np.sqrt(v2[name] / (1 - cfg.b2**k)) + 1e-8)
      decay = cfg.weight_decay * want[name] if name == "w_q" else 0.0
      want[name] = want[name] - _expected_lr(k) * (adam + decay)
  for name in want:
    np.testing.assert_allclose(np.asarray(got[name], np.float64), want[name], rtol=1e-5,
                               atol=1e-6)


def test_k_consecutive_nonfinite_updates_and_one_more_leave_the_parameters_unchanged():
  # The loop stops after train.max_consecutive_nonfinite non-finite steps in a row, at its next
  # log or save: apply_if_finite must still be skipping them until then (one more at least).
  tx, _ = optim.make_optimizer(tiny_config("llama", **{"train.max_consecutive_nonfinite": 2}).train)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  for _ in range(3):
    updates, state = tx.update({"w": jnp.full(3, jnp.nan)}, state, params)
    params = optax.apply_updates(params, updates)
  assert np.array_equal(np.asarray(params["w"]), np.ones(3))
  assert int(state.notfinite_count) == 3
