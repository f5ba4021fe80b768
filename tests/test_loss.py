"""The output layer and cross-entropy over blocks of positions (``train.loss_block_size``).

The reference is the loss and its gradients written out in float64 NumPy from the maths:
``nll = logsumexp(h W) - (h W)[target]``, ``d/dh = w (softmax - onehot) W^T`` and
``d/dW = h^T w (softmax - onehot)``. The whole train step with blocks is checked against the
loss spelled out from the model's logits in ``test_accumulation.py``.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import program_json, tiny_config
from flax import nnx

from cem_jax import config as config_lib
from cem_jax import loss, memory, steps

B, N, D, V = 3, 16, 5, 11


def _inputs():
  rng = np.random.default_rng(11)
  hidden = rng.normal(size=(B, N, D)).astype(np.float32)
  head = (0.7 * rng.normal(size=(D, V))).astype(np.float32)
  targets = rng.integers(0, V, (B, N)).astype(np.int32)
  weights = np.ones((B, N), np.float32)
  weights[1, 5:] = 0.0  # padding, and a document boundary
  weights[2, 9] = 0.0
  return hidden, head, targets, weights


def _reference(hidden, head, targets, weights):
  """(loss_sum, d loss_sum / d hidden, d loss_sum / d head) in float64."""
  h, w_out = hidden.astype(np.float64), head.astype(np.float64)
  logits = h @ w_out
  m = logits.max(-1, keepdims=True)
  lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
  picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  loss_sum = np.sum(weights * (lse - picked))
  delta = np.exp(logits - lse[..., None])  # softmax
  delta[np.arange(B)[:, None], np.arange(N)[None, :], targets] -= 1.0
  delta *= weights[..., None]
  return loss_sum, delta @ w_out.T, np.einsum("bnd,bnv->dv", h, delta)


@pytest.mark.parametrize("block_size", [0, 1, 2, 8])  # 0: the whole sequence at once
def test_blockwise_loss_and_gradients_equal_the_float64_maths(block_size):
  hidden, head, targets, weights = _inputs()
  want, want_dh, want_dw = _reference(hidden, head, targets, weights)

  def f(h, w):
    return loss.blockwise_cross_entropy(h, w, targets, weights, block_size)

  (got, weight_sum), (dh, dw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
      hidden, head)
  assert float(weight_sum) == weights.sum()
  np.testing.assert_allclose(float(got), want, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(dh), want_dh, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-6)


def test_a_target_outside_the_vocabulary_makes_the_loss_nan():
  # No logit to take: a finite loss would hide the bad token (a gather out of range was NaN;
  # a masked sum would silently pick 0).
  hidden, head, targets, weights = _inputs()
  for bad in (V, V + 3, -1):
    t = targets.copy()
    t[0, 2] = bad
    got = loss.blockwise_cross_entropy(hidden, head, t, weights)[0]
    assert np.isnan(float(got)), bad
  assert np.isfinite(float(loss.blockwise_cross_entropy(hidden, head, targets, weights)[0]))


def test_the_logits_gradient_is_elementwise_with_no_scatter():
  # The target's logit is gathered, but its gradient is g where the index is the target, one
  # elementwise expression XLA fuses into the pass that writes the logits' gradient; autodiff
  # of the gather gives a scatter, and the softmax's part of the gradient then takes a
  # float32 pass of its own (4.3 GB more traffic per 16k tokens at vocab 32k).
  _, _, targets, weights = _inputs()
  logits = np.random.default_rng(2).normal(size=(B, N, V)).astype(np.float32)
  jaxpr = jax.make_jaxpr(jax.grad(
      lambda x: loss.weighted_cross_entropy(x, targets, weights)[0]))(logits)
  text = str(jaxpr)  # nested jaxprs (jnp's own jit-wrapped functions) included
  assert re.search(r"\bscatter[-a-z]*\[", text) is None, text
  # The gradient it gives instead, against the maths: d target_logit / d logits is one-hot.
  g = np.random.default_rng(3).normal(size=(B, N)).astype(np.float32)
  _, pullback = jax.vjp(lambda x: loss.target_logit(x, targets), logits)
  want = g[..., None] * (np.arange(V) == targets[..., None])
  np.testing.assert_array_equal(np.asarray(pullback(g)[0]), want)


@pytest.mark.parametrize("dtype, vocab, values", [
    (np.int8, 300, [0, 5, 127, -1, -100]),  # arange(300, int8) wraps: 0 and 256 both "hit"
    (np.uint8, 300, [0, 5, 255]),
    (np.int16, 40000, [0, 32767, -1, -2]),  # where(t < 0, 40000, t) wraps to a valid index
    (np.uint16, 70000, [0, 5, 65535]),
    (np.uint32, 11, [0, 10, 11, 2**32 - 1]),  # 2**32 - 1 must not wrap to the last logit
])
def test_target_logit_of_narrow_or_unsigned_targets_is_the_one_hot_maths(dtype, vocab, values):
  logits = np.random.default_rng(4).normal(size=(len(values), vocab)).astype(np.float32)
  targets = np.array(values).astype(dtype)
  want, want_grad = np.full(len(values), np.nan, np.float32), np.zeros_like(logits)
  for i, v in enumerate(values):
    if 0 <= v < vocab:
      want[i], want_grad[i, v] = logits[i, v], 1.0
  value, pullback = jax.vjp(lambda x: loss.target_logit(x, jnp.asarray(targets)), logits)
  np.testing.assert_array_equal(np.asarray(value), want)
  np.testing.assert_array_equal(np.asarray(pullback(np.ones(len(values), np.float32))[0]),
                                want_grad)


def test_a_block_size_that_does_not_divide_is_one_line():
  hidden, head, targets, weights = _inputs()
  with pytest.raises(ValueError, match=r"^train\.loss_block_size=5 does not divide "
                     r"data\.seq_len=16; allowed: 0 \(all positions at once\) or a divisor"):
    loss.blockwise_cross_entropy(hidden, head, targets, weights, 5)
  with pytest.raises(ValueError, match=r"^train\.loss_block_size=-1; allowed: an int >= 0"):
    loss.blockwise_cross_entropy(hidden, head, targets, weights, -1)
  numpy_int = loss.blockwise_cross_entropy(hidden, head, targets, weights, np.int64(4))[0]
  assert float(numpy_int) == float(loss.blockwise_cross_entropy(hidden, head, targets, weights,
                                                                4)[0])
  cfg = tiny_config("cem", **{"data.seq_len": 32, "train.loss_block_size": 12})
  with pytest.raises(ValueError) as e:
    config_lib.validate(cfg)
  assert str(e.value) == ("train.loss_block_size=12 does not divide data.seq_len=32; allowed: 0 "
                          "(all positions at once) or a divisor of data.seq_len")


def test_the_eval_step_sums_the_loss_of_the_models_logits_in_blocks():
  cfg = tiny_config("cem", **{"model.num_layers": 1, "data.seq_len": N})
  graphdef, params = nnx.split(steps.build_model(cfg, V), nnx.Param)
  _, _, targets, weights = _inputs()
  rng = np.random.default_rng(5)
  batch = {"inputs": rng.integers(0, V, (B, N)).astype(np.int32), "targets": targets,
           "segment_ids": np.ones((B, N), np.int32), "weights": weights,
           "target_bytes": np.full((B, N), 2.0, np.float32)}
  logits = np.asarray(nnx.merge(graphdef, params)(batch["inputs"], batch["segment_ids"]),
                      np.float64)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  want = np.sum(weights * (lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]))
  out = steps.make_eval_step(graphdef, None, loss_block_size=4)(params, batch)
  np.testing.assert_allclose(float(out["loss_sum"]), want, rtol=1e-5)
  assert float(out["weight_sum"]) == weights.sum()


def test_blocks_keep_one_blocks_logits_in_memory():
  # Vocabulary-dominated: 8 x 256 positions x 4096 logits are 32 MiB per float32 copy.
  cfg = tiny_config("llama", **{"model.num_layers": 1, "data.seq_len": 256})
  graphdef, params = nnx.split(steps.build_model(cfg, 4096), nnx.Param)
  tx = optax.apply_if_finite(optax.adamw(1e-3), 10)
  spec = jax.ShapeDtypeStruct((8, 256), jnp.int32)
  batch = {"inputs": spec, "targets": spec, "segment_ids": spec,
           "weights": jax.ShapeDtypeStruct((8, 256), jnp.float32)}
  need = {b: memory.footprint_bytes(steps.make_train_step(graphdef, tx, loss_block_size=b)
                                    .lower(params, tx.init(params), batch).compile())
          for b in (0, 32)}
  # Measured: 54 MiB vs 136 MiB (2026-12-06; 200 MiB before the loss stopped writing
  # log_softmax's [batch, seq_len, vocab_size] copy, 105 MiB before the target's logit took an
  # elementwise gradient, which costs this CPU backend a copy that the H200's program saves).
  assert need[32] < 0.6 * need[0], need
  assert need[0] < 4.5 * 2**25, need  # < 4.5 float32 copies of the logits (log_softmax: 6.2)
  batch["target_bytes"] = batch["weights"]
  need = {b: memory.footprint_bytes(steps.make_eval_step(graphdef, None, loss_block_size=b)
                                    .lower(params, batch).compile()) for b in (0, 32)}
  assert need[32] < 0.9 * need[0], need  # measured: 27.2 MiB vs 33.7 MiB (attention's rest)


_ROWS_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
sys.path.insert(0, sys.argv[1])
from collectives import results
from cem_jax import loss
mesh = jax.make_mesh((4,), ("data",))
rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
grad = jax.jit(jax.value_and_grad(
    lambda h, w, t, m: loss.blockwise_cross_entropy(h, w, t, m, 8)[0], argnums=(0, 1)),
    in_shardings=(rows, whole, rows, rows))
f32, i32 = jnp.float32, jnp.int32
args = (jax.ShapeDtypeStruct((8, 32, 6), f32), jax.ShapeDtypeStruct((6, 20), f32),
        jax.ShapeDtypeStruct((8, 32), i32), jax.ShapeDtypeStruct((8, 32), f32))
print(json.dumps(sorted(set(results(grad.lower(*args).compile().as_text())))))
"""


def test_blocks_run_along_the_sequence_so_rows_stay_on_their_devices():
  # Rows over 4 devices: each device makes its own rows' blocks, and the only collectives are
  # the sums over devices of the loss and of the head's gradient. Blocks cut across rows
  # ([n / b, batch, b] instead of [batch, n / b, b]: the same loss, bit for bit) made XLA
  # all-gather the whole batch's hidden states, targets and weights onto every device.
  found = program_json(["-c", _ROWS_SCRIPT, str(Path(__file__).resolve().parents[1] /
                                                "experiments")], 4)
  assert found and all(kind == "all-reduce" and re.fullmatch(r"f32\[(6,20|20,6)?\]\S*", shape)
                       for kind, shape in found), found


def test_in_bfloat16_the_heads_gradient_is_summed_over_blocks_in_float32():
  # Summed in bf16, each of the 64 blocks' partial sums is rounded: 0.95% off the float64 maths
  # at blocks of 4 (1.3% at 2) where the whole sequence at once is 0.21% off. Summed in
  # float32: 0.26%.
  b, n, d, v = 2, 256, 32, 128
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(b, n, d)), jnp.bfloat16)
  head = jnp.asarray(0.2 * rng.normal(size=(d, v)), jnp.bfloat16)
  targets = rng.integers(0, v, (b, n)).astype(np.int32)
  weights = np.ones((b, n), np.float32)
  h, w = np.asarray(hidden, np.float64), np.asarray(head, np.float64)
  logits = h @ w
  delta = np.exp(logits - logits.max(-1, keepdims=True))
  delta /= delta.sum(-1, keepdims=True)
  delta[np.arange(b)[:, None], np.arange(n)[None, :], targets] -= 1.0
  want = np.einsum("bnd,bnv->dv", h, delta)

  def error(block_size):
    grad = jax.grad(lambda w: loss.blockwise_cross_entropy(hidden, w, targets, weights,
                                                           block_size)[0])(head)
    assert grad.dtype == jnp.bfloat16
    return np.linalg.norm(np.asarray(grad, np.float64) - want) / np.linalg.norm(want)

  assert loss.output_logits(hidden, head).dtype == jnp.float32  # log_softmax in float32
  whole = error(0)
  assert whole < 0.005
  for block_size in (4, 2):
    assert error(block_size) < 1.5 * whole, (block_size, error(block_size), whole)


# Blocks: the forward product, its recomputation in the backward pass and the two gradient
# products (the head is cast back to bf16 from its float32 copy inside each block).
@pytest.mark.parametrize("block_size,products", [(0, 3), (4, 4)])
def test_bf16_logits_are_accumulated_and_kept_in_float32(block_size, products):
  # Logits of magnitude ~10 from bf16 operands: rounded to bf16 they would be off by up to
  # 2^-9 of their size (~0.02); accumulated in float32 they match the float64 product of the
  # same bf16 operands to float32 rounding.
  rng = np.random.default_rng(3)
  hidden = jnp.asarray(rng.normal(size=(2, 8, 64)), jnp.bfloat16)
  head = jnp.asarray(1.2 * rng.normal(size=(64, 50)), jnp.bfloat16)
  got = loss.output_logits(hidden, head)
  want = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64)
  assert got.dtype == jnp.float32 and np.abs(want).max() > 20
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=2e-4)
  # The gradient's products multiply bf16 by bf16 (float32 by bf16 runs as a float32 product
  # on a GPU), and the gradients come back in bf16.
  targets = rng.integers(0, 50, (2, 8)).astype(np.int32)
  f = lambda h, w: loss.blockwise_cross_entropy(h, w, targets, np.ones((2, 8), np.float32),
                                              block_size)[0]
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(hidden, head)
  dots = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
  bf16 = {jnp.dtype(jnp.bfloat16)}
  assert len(dots) == products and all({v.aval.dtype for v in e.invars} == bf16 for e in dots), [
      [v.aval.dtype for v in e.invars] for e in dots]
  assert all(g.dtype == jnp.bfloat16 for g in jax.grad(f, argnums=(0, 1))(hidden, head))


def _equations(jaxpr):
  """Every equation of ``jaxpr``, those of the jaxprs inside it (jit, custom_vjp) included."""
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _equations(inner)


def test_blocks_run_along_the_sequence_whatever_the_batch():
  """Blocks are blocks of positions (all rows at once), not of rows: with batch 2 and 16 blocks
  the gradient's memory holds one [2, 32, V] block of logits, not a row's [512, V]."""
  def need(block):
    def f(h, w):
      return loss.blockwise_cross_entropy(h, w, targets, weights, block)[0]

    return memory.footprint_bytes(jax.jit(jax.grad(f, argnums=(0, 1))).lower(hidden, head)
                                  .compile())

  hidden = jax.ShapeDtypeStruct((2, 512, 32), jnp.float32)
  head = jax.ShapeDtypeStruct((32, 4096), jnp.float32)
  targets, weights = jnp.zeros((2, 512), jnp.int32), jnp.ones((2, 512), jnp.float32)
  # one float32 copy of the logits: 16 MiB whole, 1 MiB a block (8 MiB a row)
  assert need(32) < 0.25 * need(0), (need(32), need(0))


def test_weighted_cross_entropy_sums_fractional_weights():
  """``weight_sum`` is the sum of the weights, not a count of the nonzero ones (the function is
  public and documents float32 weights)."""
  hidden, head, targets, weights = _inputs()
  weights = 0.5 * weights
  loss_sum, weight_sum = loss.weighted_cross_entropy(hidden @ head, targets, weights)
  assert float(weight_sum) == pytest.approx(float(weights.sum()), rel=1e-6)
  assert float(loss_sum) == pytest.approx(_reference(hidden, head, targets, weights)[0], rel=1e-5)


@pytest.mark.parametrize("block_size", [0, 4])
def test_in_bfloat16_the_hidden_states_gradient_is_the_float64_maths(block_size):
  """The bf16 output layer's custom VJP gives the hidden state ``w (softmax - onehot) Wᵀ``
  (everything below the LM head trains on it), not only the head its gradient."""
  rng = np.random.default_rng(5)
  hidden = jnp.asarray(rng.normal(size=(B, N, D)), jnp.bfloat16)
  head = jnp.asarray(0.7 * rng.normal(size=(D, V)), jnp.bfloat16)
  _, _, targets, weights = _inputs()
  want = _reference(np.asarray(hidden, np.float64), np.asarray(head, np.float64), targets,
                    weights)[1]
  got = jax.grad(lambda h: loss.blockwise_cross_entropy(h, head, targets, weights,
                                                        block_size)[0])(hidden)
  assert got.dtype == jnp.bfloat16
  err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
  assert err < 0.01, err


def test_perplexity_is_exp_of_the_loss_capped_at_80_nats():
  assert loss.perplexity(2.5) == pytest.approx(np.exp(np.float64(2.5)), rel=1e-15)
  assert loss.perplexity(800.0) == loss.perplexity(80.0) == pytest.approx(np.exp(80.0))
