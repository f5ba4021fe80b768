"""Neighbours of CEM: momentum / Nesterov inner optimisers, the sphere manifold, shared depth.

The reference for every inner rule is a float64 NumPy iteration written from the maths in
``cem_jax/inner.py``'s docstring, driven by a quadratic user energy so that the update
``-∇E = -A y`` is known in closed form.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import force_fields, tiny_config
from flax import nnx

from cem_jax import energies, inner, preflight, steps, summary, train
from cem_jax.config import get_default_config
from cem_jax.layers.cem import padding_energy
from cem_jax.layers.common import softplus_inverse
from cem_jax.metrics import energy_trace, read_metrics
from cem_jax.model import DecoderLM
from cem_jax.model_stats import count_params

D, H, F, B, N, V = 16, 2, 24, 2, 6, 40

# Quadratic energies through the public 'module:function' path. norm_mode='none' makes the
# update exactly -∇_y E = -A y - 0.1 c S, with c the context held fixed: attention
# A = 0.1 I + W Wᵀ, S = W Wᵀ, W = w_q as [d, h·dh]; MLP A = 0.1 I + ½ w wᵀ, S = w wᵀ. The
# c-term makes the update depend on where the context comes from (attention: the layer's
# input; MLP: the gate, the point its update is evaluated at); the term in c alone moves only
# the energy's value (the energy trace).
QUADRATIC = '''
import jax
import jax.numpy as jnp
def att(y, context, params, aux):
  w = params["w_q"].reshape(y.shape[-1], -1)
  return (0.5 * jnp.sum(jnp.square(y @ w)) + 0.05 * jnp.sum(jnp.square(y))
          + 0.1 * jnp.sum(y * (context @ w @ w.T)) + 0.01 * jnp.sum(jnp.square(context)))
def mlp(y, context, params, aux):
  w = params["w"]
  return (0.25 * jnp.sum(jnp.square(y @ w)) + 0.05 * jnp.sum(jnp.square(y))
          + 0.1 * jnp.sum(y * (context @ w @ w.T)) + 0.01 * jnp.sum(jnp.square(context)))
def att_offset(y, context, params, aux):  # a constant per token: not 0 at y = context = 0
  return att(y, context, params, aux) + 0.3 * y.shape[0] * y.shape[1]
def mlp_softplus(y, context, params, aux):  # sigmoid(0) * softplus(0) = ln(2) / 2 per unit
  gate = jax.nn.sigmoid(context @ params["g"])
  return -params["eta"] * jnp.sum(gate * jax.nn.softplus(y @ params["w"]))
'''


def model_cfg(**overrides):
  cfg = get_default_config().model
  cfg.d_model, cfg.num_heads, cfg.mlp_dim, cfg.num_layers = D, H, F, 3
  cfg.init_std = 0.1
  for k, v in overrides.items():
    cfg[k] = v
  return cfg


def _tokens(seed=0):
  return jax.random.randint(jax.random.PRNGKey(seed), (B, N), 0, V)


def _set_momenta(model, values):
  for block, mu in zip(model.blocks, values, strict=True):
    block.momentum[...] = jnp.asarray(math.log(mu / (1 - mu)), jnp.float32)


# ---- momentum 0 is gd ------------------------------------------------------------------------

@pytest.mark.parametrize("split", ["lie_trotter", "joint"])
@pytest.mark.parametrize("opt", ["heavy_ball", "nesterov"])
def test_momentum_zero_gives_gd_logits_bit_for_bit(opt, split):
  tokens = _tokens(1)
  gd = DecoderLM(model_cfg(split=split, num_steps=2), V, rngs=nnx.Rngs(0))
  mom = DecoderLM(model_cfg(split=split, num_steps=2, inner_optimizer=opt), V,
                  rngs=nnx.Rngs(0))
  # Training moves the parameters; compare away from the initial values.
  gd_params = jax.tree.map(lambda p: p * 1.3 + 0.01, nnx.state(gd, nnx.Param))
  nnx.update(gd, gd_params)
  for block in mom.blocks:
    block.momentum[...] = jnp.asarray(-jnp.inf)  # sigmoid(-inf) = 0 exactly
  nnx.update(mom, gd_params)
  want = np.asarray(gd(tokens))
  np.testing.assert_array_equal(np.asarray(mom(tokens)), want)
  for block in mom.blocks:
    block.momentum[...] = jnp.asarray(0.0)  # μ = 0.5: the velocity now matters
  assert np.max(np.abs(np.asarray(mom(tokens)) - want)) > 1e-3


# ---- float64 NumPy reference of every rule ---------------------------------------------------

def _np_retract(z):
  return math.sqrt(z.shape[-1]) * z / np.linalg.norm(z, axis=-1, keepdims=True)


def _np_tangent(y, u):
  return u - np.sum(y * u, -1, keepdims=True) / np.sum(y * y, -1, keepdims=True) * y


def _reference_logits(model, tokens, opt, manifold, steps, mus, split="lie_trotter"):
  """The rules of cem_jax/inner.py in float64 NumPy, layer by layer, sub-step by sub-step
  (the joint split: one inner step with the sum of both updates at one point)."""
  f64 = lambda a: np.asarray(a, np.float64)
  emb = f64(model.embedding[...])
  y = emb[np.asarray(tokens)]
  v = np.zeros_like(y)
  sphere = manifold == "sphere"
  num_layers = model.cfg.num_layers
  for layer in range(num_layers):
    block = model.blocks[layer % len(model.blocks)]
    w = f64(block.attn.w_q[...]).reshape(D, -1)
    a_att = 0.1 * np.eye(D) + w @ w.T
    wm = f64(block.mlp.w[...])
    a_mlp = 0.1 * np.eye(D) + 0.5 * wm @ wm.T
    mu = mus[layer % len(mus)]
    if sphere:
      y = _np_retract(y)
    layer_input = y  # the attention's fixed context
    att, mlp = (a_att, w @ w.T, "att"), (a_mlp, wm @ wm.T, "mlp")
    groups = [(att, mlp)] if split == "joint" else [(att,), (mlp,)]
    for _ in range(steps):
      for group in groups:
        z = y + mu * v if opt == "nesterov" else y
        if sphere and opt == "nesterov":
          z = _np_retract(z)
        u = 0.0
        for a, s, sub in group:
          context = layer_input if sub == "att" else z  # the MLP's gate: where u is evaluated
          u = u - z @ a - 0.1 * context @ s  # A, S symmetric
        if sphere:
          u = _np_tangent(y, u)
        if opt == "gd":
          y = y + u
        else:
          v = mu * v + u
          y = y + v
        if sphere:
          y = _np_retract(y)
          if opt != "gd":
            v = _np_tangent(y, v)
  scale = f64(model.final_norm.scale[...])
  g = y / np.sqrt(np.mean(y * y, -1, keepdims=True) + model.cfg.norm_eps) * scale
  return g @ emb.T


RULES = [("gd", "sphere", 3, "lie_trotter"), ("heavy_ball", "euclidean", 3, "lie_trotter"),
         ("nesterov", "euclidean", 3, "lie_trotter"), ("nesterov", "euclidean", 1, "joint"),
         ("heavy_ball", "sphere", 3, "lie_trotter"), ("nesterov", "sphere", 3, "joint")]


@pytest.mark.parametrize("opt,manifold,unique,split", RULES, ids=lambda v: str(v))
def test_inner_rules_match_a_float64_numpy_iteration(tmp_path, opt, manifold, unique, split):
  """Quadratic energies with a context term, 3 layers × T = 2 × 2 sub-steps (one joint step
  with split='joint'); per-layer momenta 0.3/0.6/0.8 set by hand (one shared momentum with
  G = 1: 0.3 from model.momentum_init): the velocity crosses steps, sub-steps and layers."""
  (tmp_path / "quad.py").write_text(QUADRATIC)
  mus = [0.3, 0.6, 0.8][:unique]
  momentum_init = {"momentum_init": mus[0]} if opt != "gd" and unique == 1 else {}
  cfg = model_cfg(attention_energy=f"{tmp_path}/quad.py:att",
                  mlp_energy=f"{tmp_path}/quad.py:mlp", norm_mode="none", learn_eta=False,
                  num_steps=2, inner_optimizer=opt, manifold=manifold, rope=False,
                  num_unique_blocks=unique, init_std=0.12, split=split, **momentum_init)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(3))
  model.embedding[...] = 2.0 * model.embedding[...] + 0.05  # not on the sphere to begin with
  if opt != "gd" and unique > 1:
    _set_momenta(model, mus)
  tokens = _tokens(2)
  got = np.asarray(model(tokens))
  want = _reference_logits(model, tokens, opt, manifold, 2, mus, split)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("document_mask", [True, False])
@pytest.mark.parametrize("energy", ["builtin", "user", "user_offset"])
def test_padding_enters_no_energy_of_the_trace_user_energies_included(
    tmp_path, energy, document_mask):
  """The energy trace sums over the real tokens: a window padded at its tail, batched with a
  row of padding alone, gives the trace of its real prefix alone, with or without the
  document mask. The quadratic user energies are not 0 at a padding token's state, so this
  holds only because padding is evaluated at y = context = 0; the log-sum-exp of a padded
  query is 0 only if it sees no key (model.document_mask=False sees them through the causal
  mask: the trace then grew with eval.batch_size); energies with a constant per token
  ('user_offset') need that constant taken off per padding token."""
  (tmp_path / "quad.py").write_text(QUADRATIC)
  names = {"user": ("att", "mlp"), "user_offset": ("att_offset", "mlp_softplus")}
  user = dict(attention_energy=f"{tmp_path}/quad.py:{names[energy][0]}",
              mlp_energy=f"{tmp_path}/quad.py:{names[energy][1]}") if energy in names else {}
  cfg = model_cfg(num_steps=2, rope=False, document_mask=document_mask, **user)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(5))
  nnx.update(model, jax.tree.map(lambda p: p * 1.3 + 0.01, nnx.state(model, nnx.Param)))
  tokens, real = _tokens(3), 4
  segment_ids = jnp.stack([jnp.arange(N) < real, jnp.zeros(N, bool)]).astype(jnp.int32)
  _, padded = model(tokens, segment_ids, trace=True)
  _, prefix = model(tokens[:1, :real], segment_ids[:1, :real], trace=True)
  got, want = jax.tree.leaves(padded), jax.tree.leaves(prefix)
  assert len(got) == len(want) == 3 * 2 * 4  # layers x steps x (att, mlp) x (before, after)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)



_ATTENTION_OPTIONS = [dict(), dict(rope=False, strict_causal=True, learn_beta=True),
                      dict(diagonal="per_head"), dict(diagonal="shared", diagonal_form="distance"),
                      dict(energy_block_size=4)]


@pytest.mark.parametrize("kind,name", [(k, n) for k in ("attention", "mlp")
                                       for n in energies.names(k) if energies.get(n, k).builtin])
def test_every_builtin_energy_is_zero_at_a_padding_token(kind, name):
  """CEMBlock._energy leaves the padding term out for built-in energies, which holds only if
  each is exactly 0 at a padding token (y = context = 0, seeing no key), under every option
  the energy reads (diagonals, RoPE, strict causality, learned β, blocks), at parameters away
  from their initial values."""
  spec = energies.get(name, kind)
  for options in _ATTENTION_OPTIONS if kind == "attention" else [dict()]:
    cfg = model_cfg(num_steps=2, **{f"{kind}_energy": name}, **options)
    model = DecoderLM(cfg, V, rngs=nnx.Rngs(7))
    nnx.update(model, jax.tree.map(lambda p: p * 1.7 + 0.3, nnx.state(model, nnx.Param)))
    block = model.layer_blocks()[0]
    part = block.attn if kind == "attention" else block.mlp
    for t in range(2):
      got = padding_energy(spec.energy, part.energy_params(t, jnp.float32),
                           model.make_aux(None, B, N), D, jnp.float32, jnp.float32)
      assert float(got) == 0.0, (name, options, t, float(got))

# ---- the sphere ------------------------------------------------------------------------------

@pytest.mark.parametrize("opt", ["gd", "nesterov"])
def test_sphere_keeps_every_token_on_the_sphere(opt):
  """Softmax + SiLU energies, prenorm, T = 2, trained-looking parameters: after every layer
  every token has norm √d_model to 1e-5 (relative)."""
  cfg = model_cfg(manifold="sphere", inner_optimizer=opt, num_steps=2, precond="both",
                  precond_rank=2)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(4))
  nnx.update(model, jax.tree.map(lambda p: p * 1.5 + 0.02, nnx.state(model, nnx.Param)))
  tokens = _tokens(3)
  aux = model.make_aux(None, B, N)
  x = jnp.take(model.embedding[...], tokens, axis=0)
  v = None
  for block in model.layer_blocks():
    out = block(x, aux, velocity=v)
    x, v = out.y, out.velocity  # velocity None with 'gd'
    radius = np.linalg.norm(np.asarray(x, np.float64), axis=-1) / math.sqrt(D)
    np.testing.assert_allclose(radius, 1.0, atol=1e-5)
    if v is not None:  # the velocity was transported: tangent at the new point
      dots = np.sum(np.asarray(x) * np.asarray(v), -1) / np.linalg.norm(np.asarray(v), axis=-1)
      assert np.max(np.abs(dots)) < 1e-4 * math.sqrt(D)


def test_hand_computed_riemannian_step():
  """inner.apply on one token of R^3: y = (√3, 0, 0)/… on the sphere of radius √3."""
  r = math.sqrt(3.0)
  y = jnp.array([[r, 0.0, 0.0]])
  u = jnp.array([[0.5, 0.3, -0.4]])
  # Tangent part (0, 0.3, -0.4); y + it = (√3, 0.3, -0.4), norm √3.25; retract to radius √3.
  want = np.array([r, 0.3, -0.4]) * r / math.sqrt(3.25)
  got, v = inner.apply(y, None, u, None, "gd", "sphere")
  np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-6)
  assert v is None
  got, v = inner.apply(y, jnp.zeros_like(y), u, jnp.float32(0.5), "heavy_ball", "sphere")
  np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-6)
  # v = (0, .3, -.4) transported to the new point y' by projection.
  v_want = np.array([0.0, 0.3, -0.4]) - np.dot(want, [0.0, 0.3, -0.4]) / 3.0 * want
  np.testing.assert_allclose(np.asarray(v)[0], v_want, rtol=1e-5, atol=1e-7)


# ---- shared depth ----------------------------------------------------------------------------

def test_unique_blocks_equal_to_num_layers_is_todays_model():
  tokens = _tokens(4)
  today = DecoderLM(model_cfg(), V, rngs=nnx.Rngs(5))
  full = DecoderLM(model_cfg(num_unique_blocks=3), V, rngs=nnx.Rngs(5))
  a, b = nnx.state(today, nnx.Param), nnx.state(full, nnx.Param)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  np.testing.assert_array_equal(np.asarray(today(tokens)), np.asarray(full(tokens)))
  assert len({id(b) for b in full.layer_blocks()}) == 3


@pytest.mark.parametrize("block", ["cem", "llama"])
def test_one_unique_block_has_one_blocks_parameters_and_is_applied_every_layer(block):
  cfg = model_cfg(block=block, num_unique_blocks=1, num_layers=4)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(6))
  assert len(model.blocks) == 1
  one_block = count_params(model.blocks[0])
  assert count_params(model) == V * D + D + one_block  # embedding, final norm, one block
  tokens = _tokens(5)
  x = jnp.take(model.embedding[...], tokens, axis=0)
  aux = model.make_aux(None, B, N)
  for _ in range(4):
    x = model.blocks[0](x, aux)[0]
  want = model.final_norm(x) @ model.embedding[...].T
  np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_cached_decoding_with_momentum_sphere_and_shared_depth():
  cfg = model_cfg(inner_optimizer="nesterov", manifold="sphere", num_unique_blocks=1,
                  num_steps=2)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(7))
  tokens = _tokens(6)
  full = model(tokens)
  cache = model.init_cache(B, N)
  assert len(cache) == cfg.num_layers
  prefill, cache = model(tokens[:, :3], cache=cache, index=0)
  np.testing.assert_allclose(prefill, full[:, :3], atol=1e-5)
  for i in range(3, N):
    logits, cache = model(tokens[:, i:i + 1], cache=cache, index=i)
    np.testing.assert_allclose(logits[:, 0], full[:, i], atol=1e-5)


def test_shared_sphere_model_trains_restores_and_descends_its_energy(shared_data, tmp_path):
  """G = 1 on the sphere, T = 2: the loss drops over 40 steps, the checkpoint restores, inspect
  reports 1 unique block over 2 layers, and on the trained model with small step sizes
  (η = 0.02) every sub-step of every layer lowers its energy in eval's energy trace."""
  from cem_jax import runs

  # Windows of 32 tokens and one eval, at the end, untraced (the trace read is of the model
  # changed below): the loss still drops by 0.9 (measured).
  cfg = tiny_config("cem", **{"model.num_unique_blocks": 1, "model.manifold": "sphere",
                              "model.num_steps": 2, "train.num_steps": 40, "data.seq_len": 32,
                              "train.eval_every_steps": 40, "eval.energy_trace": False,
                              "checkpoint.every_steps": 40,
                              "data.files": str(shared_data / "tinyshakespeare.txt")})
  train.train_and_evaluate(cfg, str(tmp_path))
  losses = [m["train/loss"] for m in read_metrics(str(tmp_path)) if "train/loss" in m]
  assert losses[-1] < losses[0] - 0.5, losses
  s = summary.summary(cfg, vocab_size=512)
  assert (s["unique_blocks"], s["num_layers"]) == (1, 2)
  config, data, graphdef, params, step = runs.load_run(str(tmp_path))
  assert step == 40
  model = nnx.merge(graphdef, params)
  for block in model.blocks:
    block.attn.eta[...] = jnp.full_like(block.attn.eta[...], softplus_inverse(0.02))
    block.mlp.eta[...] = jnp.full_like(block.mlp.eta[...], softplus_inverse(0.02))
  graphdef, params = nnx.split(model, nnx.Param)
  eval_step = steps.make_eval_step(graphdef, None, True)
  config.eval.max_batches = 2
  trace = energy_trace(steps.eval_loop(eval_step, params, data, config))
  assert sorted(trace) == [0, 1]
  for layer, parts in trace.items():
    for part in ("att", "mlp"):
      values = parts[part]  # before step 1, after step 1, after step 2
      assert len(values) == 3
      assert all(b < a for a, b in zip(values, values[1:], strict=False)), (layer, part, values)


# ---- validation ------------------------------------------------------------------------------

INVALID = [
    ({"model.inner_optimizer": "adam"}, r"model.inner_optimizer='adam'; allowed: gd, heavy_"),
    ({"model.manifold": "torus"}, r"model.manifold='torus'; allowed: euclidean, sphere"),
    ({"model.num_unique_blocks": 0}, r"model.num_unique_blocks=0; allowed: -1"),
    ({"model.num_unique_blocks": 3}, r"model.num_unique_blocks=3; allowed: -1 .* 1..2"),
    ({"model.num_layers": 4, "model.num_unique_blocks": 3},
     r"model.num_unique_blocks=3 does not divide model.num_layers=4 .*; allowed: -1 .* 1, 2, 4$"),
    ({"model.inner_optimizer": "nesterov", "model.momentum_init": 1.0},
     r"model.momentum_init=1.0; allowed: a finite number, 0 < value < 1"),
    ({"model.momentum_init": 0.9},
     r"model.momentum_init=0.9 has no effect with model.inner_optimizer='gd' .*leave it at 0.5"),
    ({"model.block": "llama", "model.inner_optimizer": "heavy_ball"},
     r"model.inner_optimizer='heavy_ball' applies to CEM blocks only"),
    ({"model.block": "llama", "model.manifold": "sphere"},
     r"model.manifold='sphere' applies to CEM blocks only"),
]


@pytest.mark.parametrize("overrides,message", INVALID, ids=lambda v: str(v)[:50])
def test_invalid_neighbour_options_fail_at_start_up(overrides, message):
  cfg = tiny_config("cem")
  force_fields(cfg, overrides)
  with pytest.raises(ValueError, match=message):
    preflight.check(cfg)


# ---- the example configs and the table -------------------------------------------------------

def test_neighbours_table_rows_build_with_the_expected_parameter_counts():
  from cem_jax import tables

  module = tables.load_table("neighbours")
  counts = {row: tables.parameter_counts(tables.row_config(module, row, "tiny", 0))
            for row in module.ROWS}
  layers = 4  # tiny scale
  cem = counts["cem"]["non_embedding_params"]
  assert counts["yuriiformer"]["non_embedding_params"] == cem + layers  # one μ per layer
  shared = counts["cem_shared"]["non_embedding_params"]
  assert counts["hyperset"]["non_embedding_params"] == shared
  assert counts["energy_transformer"]["non_embedding_params"] == shared
  assert counts["cem_shared_joint"]["non_embedding_params"] == shared
  assert counts["cem_shared_scaled"]["non_embedding_params"] == shared  # a factor, no parameter
  scaled = tables.row_config(module, "cem_shared_scaled", "tiny", 0).model
  assert scaled.embed_scale == math.sqrt(128) and scaled.split == "lie_trotter"
  final_norm = 128
  assert shared - final_norm == (cem - final_norm) // layers  # one block instead of four
  assert abs(counts["llama_matched"]["non_embedding_params"] / cem - 1) <= 0.02
  # the cem and llama_matched rows are end_to_end's rows: the table reuses those runs
  e2e = tables.load_table("end_to_end")
  for row in ("cem", "llama_matched"):
    assert tables.config_digest(tables.row_config(module, row, "tiny", 0)) == (
        tables.config_digest(tables.row_config(e2e, row, "tiny", 0)))


def test_example_config_names_its_allowed_args():
  import importlib.util
  import os

  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "experiments", "neighbours.py")
  spec = importlib.util.spec_from_file_location("neighbours_example", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("hyperset")
  assert (c.model.manifold, c.model.num_unique_blocks) == ("sphere", 1)
  preflight.check(c)
  with pytest.raises(ValueError, match=r"experiments/neighbours.py:nope; allowed: .*yuriiformer"):
    module.get_config("nope")


def test_retract_keeps_a_zero_vector_zero():
  """inner.retract: a zero vector (no direction) stays exactly 0, never NaN; any other vector
  goes to radius √d."""
  z = jnp.asarray([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 0.0]], jnp.float32)
  got = np.asarray(inner.retract(z), np.float64)
  np.testing.assert_array_equal(got[0], 0.0)
  np.testing.assert_allclose(np.linalg.norm(got[1]), 2.0, rtol=1e-6)
  np.testing.assert_allclose(got[1], np.asarray(z[1]) * 2.0 / np.linalg.norm(z[1]), rtol=1e-6)


def test_the_tangent_projection_measures_the_norm_and_gd_sums_the_updates_in_order():
  """inner.project_tangent off the sphere (‖y‖² measured, not d_model): ⟨y, P_y(u)⟩ = 0,
  against float64 NumPy; inner.apply's gd step with the joint split's two updates is
  ``(y + u_1) + u_2``."""
  rng = np.random.default_rng(0)
  y, u, u2 = (rng.normal(size=(3, 8)) for _ in range(3))
  y[0] *= 3.0  # far from radius √8
  got = np.asarray(inner.project_tangent(jnp.asarray(y, jnp.float32),
                                         jnp.asarray(u, jnp.float32)), np.float64)
  np.testing.assert_allclose(got, _np_tangent(y, u), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.sum(got * y, -1), 0.0, atol=1e-4)
  f32 = [jnp.asarray(a, jnp.float32) for a in (y, u, u2)]
  got, v = inner.apply(f32[0], None, (f32[1], f32[2]), None, "gd", "euclidean")
  assert v is None
  np.testing.assert_array_equal(np.asarray(got), np.asarray((f32[0] + f32[1]) + f32[2]))
