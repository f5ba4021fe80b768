"""Gradient accumulation (``train.gradient_accumulation_steps``): the same update of the same
batch in smaller pieces, in less memory.

The reference is the loss written out here from its definition (the token-weighted mean of
``-log p(target)`` over the whole batch) and its ``jax.grad``; the step's update with plain SGD
(learning rate 1/2) is minus half that gradient. Multi-device meshes are in ``test_sharding.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_config
from flax import nnx

from cem_jax import axes, memory, steps, train
from cem_jax import config as config_lib
from cem_jax.metrics import read_metrics

V, N, B = 97, 16, 8


def _batch():
  rng = np.random.default_rng(7)
  tokens = rng.integers(0, V, (B, N + 1)).astype(np.int32)
  segments = np.ones((B, N), np.int32)
  segments[2, N // 2:] = 2
  weights = np.ones((B, N), np.float32)
  # Odd rows nearly all padding: with k = 2, microbatch 1 (rows 1, 3, 5, 7) holds 8 weighted
  # tokens and microbatch 0 holds 64 (k = 4: 16, 2, 16, 2), so a mean of per-microbatch means
  # is not the batch mean.
  weights[1::2, 2:] = 0.0
  segments[1::2, 3:] = 0
  # Weights are float32: a half-weighted target counts half in the mean (a count of the
  # weighted targets would count it whole).
  weights[0, :4] = 0.5
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
          "weights": weights}


def _reference_loss(graphdef, params, batch):
  logits = nnx.merge(graphdef, params)(batch["inputs"], batch["segment_ids"])
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  return jnp.sum(nll * batch["weights"]) / jnp.sum(batch["weights"])


# Llama also makes its logits in blocks of 4 positions (train.loss_block_size; the loss alone
# against float64 NumPy in test_loss.py).
# k = 1 (no accumulation) is the same weighted mean, over a batch with padding.
@pytest.mark.parametrize("block,k,loss_block", [("cem", 4, 0), ("llama", 2, 4), ("llama", 1, 0)])
def test_the_accumulated_update_is_minus_the_gradient_of_the_whole_batch_mean(block, k,
                                                                             loss_block,
                                                                             monkeypatch):
  cfg = tiny_config(block, **{"model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64,
                              "model.num_layers": 1, "data.seq_len": N})
  graphdef, params = nnx.split(steps.build_model(cfg, V), nnx.Param)
  # Away from the initial values (learned step sizes, norms and preconditioners not at 1).
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  params = jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(r, x.shape, x.dtype)
                                        for x, r in zip(leaves, keys, strict=True)])
  batch = _batch()
  # jitted (eager would dispatch op by op): the same maths, one program
  loss, grads = jax.jit(jax.value_and_grad(_reference_loss, argnums=1), static_argnums=0)(
      graphdef, params, batch)
  w = batch["weights"]
  means = [np.sum(w[i::k]) for i in range(k)]
  assert k == 1 or max(means) > 4 * min(means)  # microbatches of very different token counts

  # Rate 1/2: the update is not the gradient, so grad_norm must be the gradient's own.
  tx = optax.apply_if_finite(optax.sgd(0.5), 10)
  seen = []  # the targets of each microbatch, in the order the step runs them
  loss_of = steps.blockwise_cross_entropy

  def recorded(hidden, head, targets, *args):
    jax.debug.callback(lambda t: seen.append(np.asarray(t)), targets)
    return loss_of(hidden, head, targets, *args)

  monkeypatch.setattr(steps, "blockwise_cross_entropy", recorded)
  step = steps.make_train_step(graphdef, tx, gradient_accumulation_steps=k,
                               loss_block_size=loss_block)
  kept = jax.tree.map(jnp.copy, params)
  new, _, metrics = step(params, tx.init(kept), batch)
  # microbatch i holds rows i, i + k, ...: on a mesh, every device splits its own rows
  np.testing.assert_array_equal(np.stack(seen), [batch["targets"][i::k] for i in range(k)])
  np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=2e-6)
  np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grads)),
                             rtol=2e-5)
  for got, before, g in zip(jax.tree.leaves(new), jax.tree.leaves(kept), jax.tree.leaves(grads),
                            strict=True):
    scale = float(jnp.max(jnp.abs(g))) + 1e-12
    np.testing.assert_allclose(np.asarray(before - got) / scale, np.asarray(g) / 2 / scale,
                               atol=2e-5)


def test_each_microbatch_holds_a_kth_of_the_activations():
  cfg = tiny_config("cem", **{"model.num_layers": 1, "data.seq_len": 256,
                              "train.batch_size": 16})
  graphdef, params = nnx.split(steps.build_model(cfg, 512), nnx.Param)
  tx = optax.apply_if_finite(optax.adamw(1e-3), 10)
  spec = lambda dtype: jax.ShapeDtypeStruct((16, 256), dtype)  # noqa: E731
  batch = {"inputs": spec(np.int32), "targets": spec(np.int32), "segment_ids": spec(np.int32),
           "weights": spec(np.float32)}
  need = {k: memory.footprint_bytes(steps.make_train_step(
      graphdef, tx, gradient_accumulation_steps=k).lower(params, tx.init(params), batch)
      .compile()) for k in (1, 4)}
  assert need[4] < 0.35 * need[1], need  # measured: 25.4 MiB vs 96.2 MiB (2026-12-06)


def test_a_batch_the_microbatches_do_not_divide_is_one_line():
  cfg = tiny_config("cem", **{"train.batch_size": 6, "train.gradient_accumulation_steps": 4})
  with pytest.raises(ValueError) as e:
    config_lib.validate(cfg)
  assert str(e.value) == ("train.batch_size=6 is not divisible by "
                          "train.gradient_accumulation_steps=4; each microbatch has "
                          "batch_size / gradient_accumulation_steps rows")
  # Each device splits its own rows: 8 rows over 4 data-parallel devices cannot make 4 pieces.
  cfg = tiny_config("cem", **{"train.batch_size": 8, "train.gradient_accumulation_steps": 4,
                              "eval.batch_size": 8})
  with pytest.raises(ValueError) as e:
    axes.check_config(cfg, 4)
  assert str(e.value) == ("train.batch_size=8 is not divisible by "
                          "train.gradient_accumulation_steps=4 x the 4 data-parallel devices "
                          "(mesh.data x mesh.fsdp = 4 x 1); use a multiple of 16, e.g. 16")
  axes.check_config(cfg, 2)
  with pytest.raises(ValueError,
                     match=r"^train\.gradient_accumulation_steps=0; allowed: an int >= 1$"):
    config_lib.validate(tiny_config("cem", **{"train.gradient_accumulation_steps": 0}))


@pytest.mark.parametrize("k", [0, -2, True, 1.5, 2.0])
def test_the_train_step_refuses_an_accumulation_count_that_is_not_an_int_of_at_least_one(k):
  # A direct caller need not have run config.validate: 0 would divide the rows by zero when
  # the step is traced, far from the value that caused it.
  with pytest.raises(ValueError) as e:
    steps.make_train_step(None, None, gradient_accumulation_steps=k)
  assert str(e.value) == f"train.gradient_accumulation_steps={k!r}; allowed: an int >= 1"


def test_the_loop_trains_with_the_configured_accumulation_and_loss_blocks(tmp_path,
                                                                         monkeypatch):
  # The loop passes the keys to its (sharded) steps; the sharded step's losses equal one pass
  # on 8 devices in test_sharding.py.
  import inspect

  built = []

  def spy(real, *keys):
    def make(*args, **kwargs):
      bound = inspect.signature(real).bind(*args, **kwargs)
      bound.apply_defaults()
      built.append(tuple(bound.arguments[k] for k in keys))
      return real(*args, **kwargs)
    return make

  monkeypatch.setattr(steps, "make_train_step", spy(
      steps.make_train_step, "gradient_accumulation_steps", "loss_block_size"))
  monkeypatch.setattr(steps, "make_eval_step", spy(steps.make_eval_step, "loss_block_size"))
  cfg = tiny_config("llama", **{"model.num_layers": 1, "train.num_steps": 2,
                                "train.log_every_steps": 1, "train.eval_every_steps": 2,
                                "train.gradient_accumulation_steps": 4,
                                "train.loss_block_size": 8})
  train.train_and_evaluate(cfg, str(tmp_path / "w"))
  losses = [m["train/loss"] for m in read_metrics(str(tmp_path / "w")) if "train/loss" in m]
  assert built == [(4, 8), (8,)] and len(losses) == 2 and all(np.isfinite(losses))


@pytest.mark.parametrize("k", [1, 2])
def test_a_batch_with_no_weighted_target_is_a_zero_loss_not_a_skipped_update(k):
  # Every target at a document boundary (a window of empty documents: EOS after EOS) weighs
  # 0. The mean over no tokens is taken as 0 with a zero gradient; 0/0 made the loss NaN, and
  # apply_if_finite counted a non-finite step (enough of them stop the run as diverged).
  cfg = tiny_config("llama", **{"model.d_model": 16, "model.num_heads": 2, "model.mlp_dim": 32,
                                "model.num_layers": 1, "data.seq_len": N})
  graphdef, params = nnx.split(steps.build_model(cfg, V), nnx.Param)
  batch = dict(_batch(), weights=np.zeros((B, N), np.float32))
  tx = optax.apply_if_finite(optax.sgd(0.5), 10)
  kept = jax.tree.map(jnp.copy, params)
  step = steps.make_train_step(graphdef, tx, gradient_accumulation_steps=k)
  new, opt_state, metrics = step(params, tx.init(kept), batch)
  assert float(metrics["loss"]) == 0.0 and float(metrics["grad_norm"]) == 0.0
  assert int(metrics["nonfinite_total"]) == 0
  for got, before in zip(jax.tree.leaves(new), jax.tree.leaves(kept), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(before))
