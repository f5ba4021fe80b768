"""Options in combination and at non-initial parameters, where the single-option tests cannot
tell a swapped or misplaced term: cached decoding with perturbed norms and beyond the trained
T, G < L shared blocks, an untied head, a Nesterov block's energy trace, the chain-rule norm with
a per-step preconditioner (against test_reference's float64 Algorithm 1), the sphere's tangent
projection off the sphere, a file energy imported once (Mutation testing, round 6), and cached
decoding of a strict-causal distance-form model, fused and blockwise autodiff (campaign C)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_reference as R
from flax import nnx
from test_neighbours import QUADRATIC, B, D, N, V, model_cfg  # its sizes and config

from cem_jax.model import DecoderLM


def _tokens(seed=0, n=N):
  return jax.random.randint(jax.random.PRNGKey(seed), (B, n), 0, V)


def _perturb(model, seed):
  """Every parameter moved off its initial value (norm scales != 1, eta != init, ...)."""
  state = nnx.state(model, nnx.Param)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  leaves = [p * (1.0 + 0.3 * jax.random.normal(k, p.shape)) + 0.02 * jax.random.normal(k, p.shape)
            for p, k in zip(leaves, keys, strict=True)]
  nnx.update(model, jax.tree.unflatten(tree, leaves))


# ---- shared depth: layer l runs blocks[l % G] (cyclic), not blocks grouped -------------------
# Mutation: model.py layer_blocks `blocks[i % G]` -> `blocks[i * G // L]` (every existing test has
# G = 1 or G = L, where cyclic and grouped reuse coincide).

@pytest.mark.parametrize("block", ["cem", "llama"])
def test_two_unique_blocks_over_four_layers_cycle_in_order(block):
  cfg = model_cfg(block=block, num_unique_blocks=2, num_layers=4)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(8))
  _perturb(model, 1)
  assert [id(b) for b in model.layer_blocks()] == [id(model.blocks[i]) for i in (0, 1, 0, 1)]
  tokens = _tokens(7)
  x = jnp.take(model.embedding[...], tokens, axis=0)
  aux = model.make_aux(None, B, N)
  for i in (0, 1, 0, 1):
    x = model.blocks[i](x, aux)[0]
  want = model.final_norm(x) @ model.embedding[...].T
  np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(want), rtol=1e-5, atol=1e-5)


# ---- cached decoding at non-initial parameters -----------------------------------------------
# Mutation: llama.py LlamaBlock cached branch `norm_mlp(h)` -> `norm_att(h)` (the sample tests
# decode at initial parameters, where both RMSNorm scales are 1 and such swaps are invisible).

@pytest.mark.parametrize("case", [dict(block="llama", embed_scale=2.0),
                                  dict(block="cem", num_steps=2, context="coevolve",
                                       diagonal="per_head", precond="both", precond_rank=2,
                                       learn_beta=True, eta_per_step=True)],
                         ids=["llama", "cem-coevolve"])
def test_cached_decoding_matches_full_forward_at_random_parameters(case):
  cfg = model_cfg(num_layers=2, **case)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(9))
  _perturb(model, 2)
  tokens = _tokens(8, n=8)
  full = np.asarray(model(tokens))
  cache = model.init_cache(B, 8)
  prefill, cache = model(tokens[:, :3], cache=cache, index=0)
  np.testing.assert_allclose(np.asarray(prefill), full[:, :3], rtol=1e-5, atol=1e-5)
  for i in range(3, 8):
    logits, cache = model(tokens[:, i:i + 1], cache=cache, index=i)
    np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, i], rtol=1e-5, atol=1e-5)


# ---- cached decoding without RoPE, against the float64 reference -----------------------------
# Mutation (round 9): model.py decoding_aux `rope_theta=cfg.rope_theta if cfg.rope else None`
# -> `cfg.rope_theta` (every cached-decoding test runs with RoPE on, where the two agree).

def _cached_decoding_error(cfg, name: str) -> float:
  """Relative error of a model's logits decoded with the cache (a 3-token prefill, then one
  token at a time into an ``R.N``-slot cache) against test_reference's float64 Algorithm 1,
  at parameters and tokens seeded by ``name``."""
  vocab, n = 13, R.N
  model = DecoderLM(cfg, vocab, rngs=nnx.Rngs(0))
  prm = R.randomize(model, name)
  tokens = R._rng(name + "-tokens").integers(0, vocab, (R.B, n))
  mask = R.ref_mask(None, R.B, n, strict=cfg.strict_causal)
  pos = np.broadcast_to(np.arange(n), (R.B, n))
  x = prm["embedding"][tokens]
  for layer in range(cfg.num_layers):
    prefix = f"blocks.{layer}."
    x = R.ref_block(x, {k[len(prefix):]: v for k, v in prm.items() if k.startswith(prefix)},
                    cfg, mask, pos)
  ref = R.ref_rms_norm(x, prm["final_norm.scale"], cfg.norm_eps) @ prm["embedding"].T
  graphdef, params = nnx.split(model)

  @jax.jit  # op by op, the autodiff-blockwise case took ~5x longer (each call re-traces its grad)
  def decode(params, cache, tokens, index):
    return nnx.merge(graphdef, params)(tokens, cache=cache, index=index)

  cache = model.init_cache(R.B, n)
  got, cache = decode(params, cache, jnp.asarray(tokens[:, :3]), 0)
  got = [np.asarray(got)]
  for i in range(3, n):  # one compiled program for every single-token step: index is traced
    logits, cache = decode(params, cache, jnp.asarray(tokens[:, i:i + 1]), i)
    got.append(np.asarray(logits))
  return R._rel(np.concatenate(got, axis=1), ref)


def test_cached_decoding_without_rope_matches_the_float64_reference():
  cfg = R.block_cfg(num_layers=2, num_steps=2, rope=False, diagonal="per_head",
                    precond="attention", precond_rank=2)
  assert _cached_decoding_error(cfg, "decode-no-rope") <= 2 * R.TOL


# ---- the energy trace under Nesterov records E at the state y, not at the look-ahead --------
# Mutation: cem.py _att_delta `self._energy(..., y, ...)` -> `(..., at, ...)` (no test traces a
# momentum block with a nonzero incoming velocity).

# The energies: test_neighbours.QUADRATIC's att and mlp.


def _np_quad(y, c, w, half):
  """The QUADRATIC energies in float64: ``half`` = 0.5 (att) or 0.25 (mlp)."""
  return (half * np.sum((y @ w) ** 2) + 0.05 * np.sum(y * y)
          + 0.1 * np.sum(y * (c @ w @ w.T)) + 0.01 * np.sum(c * c))


@pytest.mark.parametrize("split", ["lie_trotter", "joint"])
def test_nesterov_energy_trace_is_taken_at_the_state_not_the_lookahead(tmp_path, split):
  from cem_jax.layers import CEMBlock

  (tmp_path / "quad.py").write_text(QUADRATIC)
  cfg = model_cfg(attention_energy=f"{tmp_path}/quad.py:att",
                  mlp_energy=f"{tmp_path}/quad.py:mlp", norm_mode="none", learn_eta=False,
                  rope=False, num_steps=2, inner_optimizer="nesterov", momentum_init=0.6,
                  split=split, init_std=0.12)
  block = CEMBlock(cfg, rngs=nnx.Rngs(3))
  k1, k2 = jax.random.split(jax.random.PRNGKey(4))
  x = jax.random.normal(k1, (B, N, D))
  v0 = 0.7 * jax.random.normal(k2, (B, N, D))  # a velocity from an earlier layer
  aux = DecoderLM(cfg, V, rngs=nnx.Rngs(0)).make_aux(None, B, N)
  trace = block(x, aux, trace=True, velocity=v0).trace
  w = np.asarray(block.attn.w_q[...], np.float64).reshape(D, -1)
  x64 = np.asarray(x, np.float64)
  want = _np_quad(x64, x64, w, 0.5)  # E_att(y = x | c = x) before the first sub-step
  np.testing.assert_allclose(float(trace[0]["att_before"]), want, rtol=1e-5)
  # E_mlp before the MLP's first (sub-)step: at the state y, with the gate at the look-ahead.
  mu, v = 0.6, np.asarray(v0, np.float64)
  wm = np.asarray(block.mlp.w[...], np.float64)
  z = x64 + mu * v
  if split == "joint":
    y, gate = x64, z
  else:  # one Nesterov step on E_att: u = -∇E_att(z | x) = -(0.1 z + z W Wᵀ + 0.1 x W Wᵀ)
    v = mu * v - (0.1 * z + z @ w @ w.T + 0.1 * x64 @ w @ w.T)
    y = x64 + v
    gate = y + mu * v
  np.testing.assert_allclose(float(trace[0]["mlp_before"]), _np_quad(y, gate, wm, 0.25),
                             rtol=1e-4)


# ---- chain-rule norm mode together with a preconditioner -------------------------------------
# Mutation: cem.py _step applying P before the RMSNorm pullback (P Jᵀ vs Jᵀ P): no reference case
# combines norm_mode='chain' with model.precond. Reuses test_reference's float64 Algorithm 1.

@pytest.mark.parametrize("update_mode", ["fused", "autodiff"])
def test_chain_norm_with_per_step_preconditioner_matches_reference(update_mode):
  from cem_jax.layers import CEMBlock

  options = dict(num_steps=2, norm_mode="chain", precond="both", precond_rank=2,
                 precond_shared=False, eta_per_step=True, diagonal="per_head")
  x = R._rng("proposed-chain-precond-x").standard_normal((R.B, R.N, R.D))
  cfg = R.block_cfg(update_mode=update_mode, **options)
  block = CEMBlock(cfg, rngs=nnx.Rngs(0))
  prm = R.randomize(block, "proposed-chain-precond")
  aux = DecoderLM(cfg, 11, rngs=nnx.Rngs(0)).make_aux(jnp.asarray(R.SEGMENTS), R.B, R.N)
  got = np.asarray(block(jnp.asarray(x, jnp.float32), aux)[0], np.float64)
  ref = R.ref_block(x, prm, cfg, R.ref_mask(R.SEGMENTS, R.B, R.N, False),
                    np.broadcast_to(np.arange(R.N), (R.B, R.N)))
  assert R._rel(got - x, ref - x) <= 2 * R.TOL


# ---- decoding a co-evolving context at test-time steps beyond T -----------------------------
# Mutation: cem.py init_cache `copies = steps if coevolve` -> `copies = cfg.num_steps if coevolve`
# (the cache then has T slots; slot t >= T is read clamped and written nowhere). The sample
# tests run num_steps > T in decoding only with the standard attention.

def test_coevolve_cached_decoding_at_more_steps_than_trained():
  cfg = model_cfg(num_layers=2, num_steps=2, context="coevolve", diagonal="per_head")
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(10))
  _perturb(model, 3)
  tokens = _tokens(9, n=7)
  full = np.asarray(model(tokens, num_steps=4))
  cache = model.init_cache(B, 7, num_steps=4)
  prefill, cache = model(tokens[:, :3], cache=cache, index=0, num_steps=4)
  np.testing.assert_allclose(np.asarray(prefill), full[:, :3], rtol=1e-5, atol=1e-5)
  for i in range(3, 7):
    logits, cache = model(tokens[:, i:i + 1], cache=cache, index=i, num_steps=4)
    np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, i], rtol=1e-5, atol=1e-5)


# ---- untied output head ----------------------------------------------------------------------
# Mutation: model.py output_head returning the embedding even when model.tie_embeddings=False.

@pytest.mark.parametrize("block", ["cem", "llama"])
def test_untied_head_reads_lm_head_not_the_embedding(block):
  cfg = model_cfg(block=block, num_layers=2, tie_embeddings=False)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(11))
  _perturb(model, 4)
  tokens = _tokens(10)
  hidden = np.asarray(model(tokens, hidden=True), np.float64)
  want = hidden @ np.asarray(model.lm_head[...], np.float64)
  np.testing.assert_allclose(np.asarray(model(tokens)), want, rtol=1e-5, atol=1e-5)
  assert np.max(np.abs(hidden @ np.asarray(model.embedding[...], np.float64).T - want)) > 1e-2


# ---- embed_scale: the input embedding only, every block --------------------------------------
# Mutations: model.py applying model.embed_scale only for CEM blocks, also to an untied lm_head,
# or truncated to an int (test_reference's decoder case is tied CEM at 3.0, the cached decoding
# case compares a Llama model with itself).

@pytest.mark.parametrize("block", ["cem", "llama"])
def test_embed_scale_is_the_embedding_table_scaled_under_an_untied_head(block):
  scale = 2.5
  cfg = model_cfg(block=block, num_layers=2, tie_embeddings=False)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(11))
  _perturb(model, 4)
  scaled = DecoderLM(model_cfg(block=block, num_layers=2, tie_embeddings=False,
                               embed_scale=scale), V, rngs=nnx.Rngs(11))
  nnx.update(scaled, nnx.state(model, nnx.Param))
  tokens = _tokens(10)
  model.embedding[...] = model.embedding[...] * scale  # the head (lm_head) is untouched
  want = np.asarray(model(tokens))
  np.testing.assert_allclose(np.asarray(scaled(tokens)), want, rtol=1e-5, atol=1e-5)
  model.embedding[...] = model.embedding[...] / scale
  assert np.max(np.abs(np.asarray(model(tokens)) - want)) > 1e-2  # the scale shows


# ---- project_tangent measures ‖y‖² (documented) ----------------------------------------------
# Mutation: inner.py project_tangent dividing by d_model instead of the measured ‖y‖² (inside the
# model y is always on the sphere, where the two agree to float32 rounding: this pins the
# function's documented contract for any y).

def test_project_tangent_measures_the_norm_of_y():
  from cem_jax import inner

  rng = np.random.default_rng(21)
  y = 3.0 * rng.standard_normal((4, 5, D))  # far off the sphere of radius √D
  u = rng.standard_normal((4, 5, D))
  want = u - np.sum(y * u, -1, keepdims=True) / np.sum(y * y, -1, keepdims=True) * y
  got = np.asarray(inner.project_tangent(jnp.asarray(y, jnp.float32), jnp.asarray(u, jnp.float32)),
                   np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.max(np.abs(np.sum(got * y, -1))) < 1e-4


# ---- a 'file.py:function' energy is imported once per process --------------------------------
# Mutation: registry.py _import dropping the sys.modules lookup (the file is then re-executed on
# every get(): a module that registers a name at import fails the second time, and every
# lookup returns a new function object, so jit caches keyed on it never hit).

def test_a_file_energy_is_imported_once_and_returns_the_same_function(tmp_path):
  import uuid

  from cem_jax import energies

  name = f"proposed_once_{uuid.uuid4().hex[:8]}"
  path = tmp_path / "once.py"
  path.write_text(
      "from cem_jax import energies\n"
      "def energy(y, context, params, aux):\n"
      "  return 0.5 * (y * y).sum()\n"
      f"energies.register({name!r}, 'attention', energy)\n")
  first = energies.get(f"{path}:energy", "attention")
  second = energies.get(f"{path}:energy", "attention")  # no 'already registered' error
  assert first.energy is second.energy
  assert energies.get(name, "attention").energy is first.energy


# ---- cached decoding with the distance-form diagonal, against the float64 reference ----------
# Mutations (campaign C): model.py decoding_aux dropping `diagonal_form=cfg.diagonal_form` (the
# decoding aux then says 'bilinear'; every cached-decoding test ran the default bilinear form,
# where the two agree), and base.py blockwise_logsumexp sizing its running max and sum by the
# keys (s) instead of the queries (t) (equal in training; no test decoded with
# model.energy_block_size > 0). Strict causality: the prefill's first query sees no key, and
# the distance form's -y term must stay off that row in decoding as in training. Block size 3
# does not divide the 8-slot cache: the padded key block is exercised too.

@pytest.mark.parametrize("update", [dict(), dict(update_mode="autodiff", energy_block_size=3)],
                         ids=["fused", "autodiff-blockwise"])
def test_cached_decoding_with_the_distance_diagonal_matches_the_float64_reference(update):
  cfg = R.block_cfg(num_layers=2, num_steps=2, diagonal="per_head", diagonal_form="distance",
                    strict_causal=True, precond="attention", precond_rank=2, **update)
  assert _cached_decoding_error(cfg, "decode-distance") <= 2 * R.TOL
