"""Energies and their updates: closed forms equal jax.grad, Φ is exact, masking is safe."""

import logging
import math
import os
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import np_rope, quadrature_phi_silu, tiny_config

from cem_jax import energies, energy_checks, preflight, updates
from cem_jax.energies import (
    EnergyAux,
    apply_rope,
    interaction_energy,
    interaction_fused_update,
    make_mask,
)

B, T, D, H, DH, F = 2, 9, 16, 2, 8, 24


def _rel(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _attention_inputs(seed, diag=False):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  y = jax.random.normal(ks[0], (B, T, D))
  c = jax.random.normal(ks[1], (B, T, D))
  params = {
      "w_q": 0.4 * jax.random.normal(ks[2], (D, H, DH)),
      "w_k": 0.4 * jax.random.normal(ks[3], (D, H, DH)),
      "eta": jnp.array([1.0, 0.6]),
      "beta": jnp.array([DH**-0.5, 0.5]),
  }
  if diag:
    params["diag"] = 0.3 * jax.random.normal(ks[4], (H, D))
  return y, c, params


def _aux(mask, rope, form="bilinear", plain=False):
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  return EnergyAux(mask=mask, positions=pos, rope_theta=10_000.0 if rope else None,
                   diagonal_form=form, is_plain_causal=plain)


SEGMENTS = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1, 0, 0, 0]])


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("diag", ["none", "bilinear", "distance"])
@pytest.mark.parametrize("masking", ["causal", "segments", "strict"])
def test_attention_autodiff_equals_fused(rope, diag, masking):
  seed = zlib.crc32(f"{rope}-{diag}-{masking}".encode())  # fixed across runs, unlike hash()
  y, c, params = _attention_inputs(seed=seed, diag=diag != "none")
  if masking == "causal":
    aux = _aux(make_mask(None, T, B), rope, diag if diag != "none" else "bilinear", plain=True)
  else:
    seg = SEGMENTS if masking == "segments" else None
    aux = _aux(make_mask(seg, T, B, strict=masking == "strict"), rope,
               diag if diag != "none" else "bilinear")
  autodiff = updates.autodiff_update(interaction_energy)(y, c, params, aux)
  fused = interaction_fused_update(y, c, params, aux)
  assert _rel(fused, autodiff) <= 1e-5


@pytest.mark.parametrize("potential", sorted(energies.POTENTIALS))
def test_mlp_autodiff_equals_fused(potential):
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  y, x = jax.random.normal(ks[0], (B, T, D)), jax.random.normal(ks[1], (B, T, D))
  params = {"w": 0.4 * jax.random.normal(ks[2], (D, F)),
            "g": 0.4 * jax.random.normal(ks[3], (D, F)), "eta": jnp.array(0.8)}
  energy, fused = energies.make_gated_energy(potential)
  assert _rel(fused(y, x, params), updates.autodiff_update(energy)(y, x, params, None)) <= 1e-5


def test_attention_update_is_attention_with_tied_weights():
  """-∇E at y = c is dot_product_attention(q, k, v=k, causal) @ W_Qᵀ (no RoPE, η = 1)."""
  y, _, params = _attention_inputs(seed=5)
  params["eta"] = jnp.ones((H,))
  params["beta"] = jnp.full((H,), DH**-0.5)
  q = jnp.einsum("btd,dhk->bthk", y, params["w_q"])
  k = jnp.einsum("btd,dhk->bthk", y, params["w_k"])
  out = jax.nn.dot_product_attention(q, k, k, is_causal=True)
  expected = jnp.einsum("bthk,dhk->btd", out, params["w_q"])
  got = updates.autodiff_update(interaction_energy)(y, y, params,
                                                    _aux(make_mask(None, T, B), rope=False))
  assert _rel(got, expected) <= 1e-5


def _np_interaction(y, c, params, mask, pos, form, key_pos=None):
  """CEM_MATH.md §1 in float64: ``E = -Σ_{b,i,k} (η_k/β_k) log Σ_{j∈N(i)} exp(β_k s_kij)`` and
  ``-∇_y E``, from the formulas (not the code): RoPE on (queries at ``pos``, keys at
  ``key_pos``, default ``pos``), rows seeing no key give 0."""
  y, c = np.asarray(y, np.float64), np.asarray(c, np.float64)
  p = {n: np.asarray(a, np.float64) for n, a in params.items()}
  mask = np.asarray(mask, bool)[:, None]  # [b, 1, i, j]
  q = np_rope(np.einsum("bid,dhe->bihe", y, p["w_q"]), pos)
  k = np_rope(np.einsum("bjd,dhe->bjhe", c, p["w_k"]), pos if key_pos is None else key_pos)
  s = np.einsum("bihe,bjhe->bhij", q, k)
  if form != "none":
    dg = p["diag"]
    s = s + np.einsum("bid,hd,bjd->bhij", y, dg, c)
    if form == "distance":  # -½ Σ_m d_m (y_m - c_jm)² = cross - ½ Σ d y² - ½ Σ d c²
      s = s - 0.5 * (np.einsum("bid,hd->bhi", y * y, dg)[..., None]
                     + np.einsum("bjd,hd->bhj", c * c, dg)[:, :, None])
  bs = s * p["beta"][:, None, None]
  top = np.max(np.where(mask, bs, -np.inf), axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  e = np.where(mask, np.exp(bs - top), 0.0)
  total = e.sum(-1)
  seen = total > 0
  lse = np.where(seen, top[..., 0] + np.log(np.where(seen, total, 1.0)), 0.0)
  energy = -np.sum(lse * (p["eta"] / p["beta"])[:, None])
  a = e / np.where(seen, total, 1.0)[..., None]  # softmax over N(i); 0 on a row seeing none
  agg = np_rope(np.einsum("bhij,bjhe->bihe", a, k), pos, inverse=True)
  update = np.einsum("bihe,dhe->bid", agg * p["eta"][:, None], p["w_q"])
  if form != "none":
    cagg = np.einsum("bhij,bjd->bihd", a, c)
    if form == "distance":
      cagg = cagg - y[:, :, None] * seen.transpose(0, 2, 1)[..., None]
    update = update + np.einsum("bihd,hd->bid", cagg * p["eta"][:, None], p["diag"])
  return energy, update


# block 4 of 9 keys: three blocks, the last padded; 0: the dense scores.
@pytest.mark.parametrize("block,form", [(0, "none"), (0, "distance"), (4, "none"),
                                        (4, "bilinear"), (4, "distance")])
def test_interaction_energy_and_its_gradient_equal_the_float64_maths(block, form):
  """The energy's value and -∇_y E against CEM_MATH.md §1 in float64, dense and over key
  blocks, with RoPE, documents, padding and strict causality (rows that see no key), at a
  temperature β ≠ 1/√d_h and step sizes η ≠ 1. Fused = autodiff tests cannot see a wrong
  value (a missing 1/β, a row constant not scaled by β), only a wrong gradient."""
  y, c, params = _attention_inputs(seed=zlib.crc32(f"value-{block}-{form}".encode()),
                                   diag=form != "none")
  mask = make_mask(SEGMENTS, T, B, strict=True)
  aux = _aux(mask, rope=True, form="bilinear" if form == "none" else form)
  aux = aux.replace(energy_block_size=block)
  want_e, want_u = _np_interaction(y, c, params, mask, aux.positions, form)
  got_e, grad = jax.jit(jax.value_and_grad(interaction_energy))(y, c, params, aux)
  assert abs(float(got_e) - want_e) <= 1e-5 * abs(want_e), (float(got_e), want_e)
  assert _rel(-grad, want_u) <= 1e-5


def test_new_tokens_against_a_cached_context_equal_the_float64_maths():
  """Cached decoding: ``y`` holds 3 new tokens at positions 5, 6, 7 and the context the 9
  cached positions 0..8 (8 not yet visible). RoPE turns each key by its own position
  (``aux.key_positions``), each query by its; in training the two are one array, so only a
  context longer than ``y`` tells them apart. Energy, autodiff and fused updates against
  CEM_MATH.md §1 in float64, distance diagonal included."""
  _, c, params = _attention_inputs(seed=17, diag=True)
  y = jax.random.normal(jax.random.PRNGKey(18), (B, 3, D))
  query, keys = jnp.arange(5, 8), jnp.arange(T)
  aux = EnergyAux(mask=jnp.broadcast_to(keys[None, :] <= query[:, None], (B, 3, T)),
                  positions=jnp.broadcast_to(query, (B, 3)),
                  key_positions=jnp.broadcast_to(keys, (B, T)), rope_theta=10_000.0,
                  diagonal_form="distance")
  want_e, want_u = _np_interaction(y, c, params, aux.mask, aux.positions, "distance",
                                   key_pos=aux.key_positions)
  got_e, grad = jax.jit(jax.value_and_grad(interaction_energy))(y, c, params, aux)
  assert abs(float(got_e) - want_e) <= 1e-5 * abs(want_e), (float(got_e), want_e)
  assert _rel(-grad, want_u) <= 1e-5
  assert _rel(jax.jit(interaction_fused_update)(y, c, params, aux), want_u) <= 1e-5


def test_phi_silu_matches_quadrature():
  z32 = np.concatenate([np.linspace(-30, 30, 240), [1e-4, -1e-4, 1e-2, -0.7, 1.999, 2.001]])
  z32 = z32.astype(np.float32)
  ref = quadrature_phi_silu(z32)
  got = np.asarray(energies.phi_silu(jnp.asarray(z32)), np.float64)
  assert np.max(np.abs(got - ref) / np.abs(ref)) <= 1e-6
  assert float(energies.phi_silu(jnp.float32(0.0))) == 0.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_phi_silu_at_infinity_is_its_limit_not_nan(dtype):
  # Φ(z) = ∫_0^z t·σ(t) dt: Φ(-inf) = ∫_0^∞ s / (1 + e^s) ds = η(2) = π²/12, and
  # Φ(z) = z²/2 - π²/12 + O(z e^-z) grows without bound (-inf·softplus(-inf) gave NaN for
  # both). Large finite z on the way there, against the float64 quadrature.
  with jax.enable_x64(dtype == jnp.float64):
    got = np.asarray(energies.phi_silu(jnp.asarray([-np.inf, np.inf, np.nan], dtype)),
                     np.float64)
    far = np.asarray(energies.phi_silu(jnp.asarray([-60.0, 60.0], dtype)), np.float64)
  assert got[1] == np.inf and np.isnan(got[2])
  rtol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
  np.testing.assert_allclose(got[0], math.pi**2 / 12, rtol=rtol)
  np.testing.assert_allclose(far, quadrature_phi_silu([-60.0, 60.0]), rtol=rtol)
  np.testing.assert_allclose(quadrature_phi_silu([-60.0]), math.pi**2 / 12, rtol=1e-12)


def test_phi_derivatives_match_finite_differences():
  """Φ' and Φ'' (the custom JVP, differentiated once and twice) against float64 central
  differences of an independent Φ, and of phi_silu's own primal: a JVP rule that disagrees
  with the function it belongs to, or with the maths, fails here."""
  z = np.concatenate([np.linspace(-12.0, 12.0, 49), [-2.0, 2.0, 1.999, 2.001, 1e-3]])
  with jax.enable_x64(True):
    zj = jnp.asarray(z, jnp.float64)
    first = np.asarray(jax.vmap(jax.grad(energies.phi_silu))(zj))
    second = np.asarray(jax.vmap(jax.grad(jax.grad(energies.phi_silu)))(zj))
    own = np.asarray(energies.phi_silu(jnp.stack([zj - 1e-4, zj + 1e-4])))
    # The primal that the JVP rule returns (jax.value_and_grad, jax.jvp), not phi_silu's own.
    value = np.asarray(jax.vmap(jax.value_and_grad(energies.phi_silu))(zj)[0])
  h1, h2 = 1e-4, 1e-3
  fd1 = (quadrature_phi_silu(z + h1) - quadrature_phi_silu(z - h1)) / (2 * h1)
  fd2 = (quadrature_phi_silu(z + h2) - 2 * quadrature_phi_silu(z)
         + quadrature_phi_silu(z - h2)) / h2**2
  np.testing.assert_allclose(first, fd1, rtol=1e-7, atol=1e-9)
  np.testing.assert_allclose(second, fd2, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(first, (own[1] - own[0]) / (2 * 1e-4), rtol=1e-7, atol=1e-9)
  np.testing.assert_allclose(value, quadrature_phi_silu(z), rtol=1e-9, atol=1e-12)
  z32 = jnp.linspace(-12.0, 12.0, 97)  # float32, the training dtype: finite to third order
  assert bool(jnp.all(jnp.isfinite(jax.vmap(jax.grad(jax.grad(jax.grad(energies.phi_silu))))(
      z32))))


@pytest.mark.parametrize("potential", ["gelu", "relu", "relu2"])
def test_other_potentials_differentiate_to_their_activation(potential):
  phi, act = energies.POTENTIALS[potential]
  z = jnp.linspace(-4.0, 4.0, 81)
  np.testing.assert_allclose(jax.vmap(jax.grad(phi))(z), act(z), rtol=1e-5, atol=1e-6)
  assert abs(float(phi(jnp.float32(0.0)))) < 1e-7


def test_an_unknown_potential_is_refused_with_the_allowed_names():
  with pytest.raises(KeyError, match=r"unknown potential 'swish'; allowed: \['gelu', 'relu', "
                                     r"'relu2', 'silu'\]"):
    energies.make_gated_energy("swish")


@pytest.mark.parametrize("potential", ["silu", "gelu", "relu", "relu2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_potentials_run_in_half_precision_and_keep_the_dtype(potential, dtype):
  # A bf16 model evaluates Φ in bf16; jax.scipy.stats.norm takes no half precision, so
  # phi_gelu computes in float32 and casts back, like phi_silu.
  phi, act = energies.POTENTIALS[potential]
  z = jnp.linspace(-4.0, 4.0, 33)
  half = phi(z.astype(dtype))
  assert half.dtype == dtype
  np.testing.assert_allclose(np.asarray(half, np.float32), np.asarray(phi(z)), rtol=1e-2,
                             atol=1e-2)
  grad = jax.vmap(jax.grad(phi))(z.astype(dtype))
  assert grad.dtype == dtype
  np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(act(z)), rtol=2e-2,
                             atol=2e-2)


def test_bfloat16_mlp_energy_evaluates_the_potential_in_float32():
  # bf16 inputs whose products are exact in bf16 (multiples of 1/8, few terms): the pre-
  # activations are exact, so only Φ's own precision is left. The energy (the trace eval
  # reports) must form Φ in float32; Φ = relu³/3 rounded to bf16 is off by ~1e-3.
  rng = np.random.default_rng(8)
  y, x = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 1.5], size=(2, 1, 3, 4))
  w, g = rng.choice([-1.0, -0.75, -0.25, 0.25, 0.5, 1.0], size=(2, 4, 8))
  want = -0.8 * np.sum((x @ g) * np.maximum(y @ w, 0.0) ** 3 / 3.0)
  energy, _ = energies.make_gated_energy("relu2")
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
  got = jax.jit(energy)(bf(y), bf(x), {"w": bf(w), "g": bf(g), "eta": jnp.float32(0.8)})
  assert got.dtype == jnp.float32
  assert abs(float(got) - want) <= 1e-5 * abs(want), (float(got), want)


@pytest.mark.parametrize("mode", ["autodiff", "fused"])
def test_empty_rows_update_zero_and_derivatives_finite(mode):
  """A padded query row / position 0 under strict causality sees no key: update exactly 0."""
  y, c, params = _attention_inputs(seed=7, diag=True)
  seg = SEGMENTS
  aux = _aux(make_mask(seg, T, B, strict=True), rope=True)
  empty = ~np.asarray(jnp.any(aux.mask, axis=-1))  # [B, T]
  assert empty[0, 0] and empty[1, 8] and empty[0, 3]
  spec = energies.get("softmax", "attention")
  update_fn = updates.resolve_update(spec, mode)
  out = update_fn(y, c, params, aux)
  assert np.all(np.asarray(out)[empty] == 0.0)
  assert bool(jnp.all(jnp.isfinite(out)))

  def loss(p, y_):
    return jnp.sum(update_fn(y_, c, p, aux) ** 2)

  g_params, g_y = jax.grad(loss, argnums=(0, 1))(params, y)
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g_params))
  assert bool(jnp.all(jnp.isfinite(g_y)))
  # second order through the energy itself (Hessian-vector product)
  hvp = jax.jvp(jax.grad(lambda y_: interaction_energy(y_, c, params, aux)), (y,),
                (jnp.ones_like(y),))[1]
  assert bool(jnp.all(jnp.isfinite(hvp)))


def test_masked_logsumexp_all_masked_row():
  scores = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  mask = jnp.array([[True, False, True], [False, False, False]])
  out = energies.masked_logsumexp(scores, mask)
  np.testing.assert_allclose(out[0], np.log(np.exp(1.0) + np.exp(3.0)), rtol=1e-6)
  assert float(out[1]) == 0.0
  # No NaN even in between (jax_debug_nans raises on one), so that a user hunting NaNs with
  # it is not stopped here: without the guard on the row's sum, log's cotangent at the empty
  # row's 0 is 0/0, a NaN that the masks then drop.
  with jax.debug_nans(True):
    g = jax.grad(lambda s: jnp.sum(energies.masked_logsumexp(s, mask)))(scores)
    h = jax.hessian(lambda s: jnp.sum(energies.masked_logsumexp(s, mask)))(scores)
  assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.all(jnp.isfinite(h)))
  np.testing.assert_array_equal(np.asarray(g)[1], 0.0)


def test_masked_logsumexp_of_scores_far_below_zero_shifts_by_the_visible_max():
  # Scores far below 0 beside a masked entry: exp(-200) underflows float32, so the shift must be
  # the max over the visible entries (-200), not one that counts the masked entry.
  scores = jnp.array([[-200.0, -201.0, 5.0], [-1000.0, -1000.5, -999.0]])
  mask = jnp.array([[True, True, False], [True, True, True]])
  want = [-200.0 + np.log1p(np.exp(-1.0)), -999.0 + np.log(1.0 + np.exp(-1.0) + np.exp(-1.5))]
  np.testing.assert_allclose(np.asarray(energies.masked_logsumexp(scores, mask)), want,
                             rtol=1e-6)
  g = jax.grad(lambda s: jnp.sum(energies.masked_logsumexp(s, mask)))(scores)
  e = np.exp(-1.0)
  np.testing.assert_allclose(np.asarray(g)[0], [1 / (1 + e), e / (1 + e), 0.0], rtol=1e-5)


def test_registry_lookup_and_errors():
  assert energies.get("softmax", "attention").fused_update is not None
  assert set(energies.names("mlp")) >= {"silu", "gelu", "relu", "relu2"}
  # Each slot lists its own kind only (the "allowed:" of an unknown name quotes it).
  assert "softmax" not in energies.names("mlp") and "softmax" in energies.names("attention")
  assert not set(energies.POTENTIALS) & set(energies.names("attention"))
  with pytest.raises(ValueError, match="model.mlp_energy='nope' is not a registered mlp"):
    energies.get("nope", "mlp", "model.mlp_energy")
  # evaluate, sample and tables reload a run in a fresh process: a name registered from Python
  # in the training process is unknown there, and the error says why and what to use instead.
  with pytest.raises(ValueError, match=r"exists only in the process that registered it: a run "
                                       r"that evaluate, sample or tables reload must be "
                                       r"trained with the energy named by its "
                                       r"'file\.py:function'\)$"):
    energies.get("nope", "attention", "model.attention_energy")
  with pytest.raises(ValueError, match="'softmax' is an attention energy, not an mlp energy$"):
    energies.get("softmax", "mlp")
  with pytest.raises(ValueError, match="'silu' is an mlp energy, not an attention energy$"):
    energies.get("silu", "attention")
  with pytest.raises(ValueError, match="cannot import module"):
    energies.get("no_such_module_xyz:energy", "attention")
  # The "allowed:" of an unknown name lists the energies of its own slot only.
  for kind, own, other in [("mlp", set(energies.POTENTIALS), {"softmax"}),
                           ("attention", {"softmax"}, set(energies.POTENTIALS))]:
    with pytest.raises(ValueError, match="allowed: ") as e:
      energies.get("nope", kind)
    allowed = set(str(e.value).split("allowed: ")[1].split(", or a ")[0].split(", "))
    assert own <= allowed and not other & allowed, str(e.value)
  with pytest.raises(ValueError, match="has no closed-form update"):
    updates.resolve_update(energies.EnergySpec("u", "mlp", lambda *a: 0.0), "fused")


def test_a_user_energy_path_or_name_that_cannot_serve_is_one_line(tmp_path):
  # The config's value names the field, the file and what is missing; a name taken or a kind
  # that is no slot is refused at registration; a closed form is used only where it is callable.
  missing = tmp_path / "nope.py"
  with pytest.raises(ValueError, match=rf"^model\.attention_energy='{missing}:e': file "
                                       rf"{missing} does not exist$"):
    energies.get(f"{missing}:e", "attention", "model.attention_energy")
  user = tmp_path / "user.py"
  user.write_text("energy = 3\ndef quad(y, context, params, aux):\n  return (y * y).sum()\n"
                  "quad_fused_update = 'not a function'\n")
  with pytest.raises(ValueError, match=rf"^model\.mlp_energy='{user}:energy': module "
                                       rf"'{user}' has no function 'energy' \('energy' is int; "
                                       r"its functions: quad\)$"):
    energies.get(f"{user}:energy", "mlp", "model.mlp_energy")
  with pytest.raises(ValueError, match=rf"^model\.mlp_energy='{user}:qaud': module "
                                       rf"'{user}' has no function 'qaud' \(its functions: "
                                       r"quad\)$"):  # a misspelt name: what to write instead
    energies.get(f"{user}:qaud", "mlp", "model.mlp_energy")
  with pytest.raises(ValueError, match=r"^model\.mlp_energy='__main__:energy': module "
                                       r"'__main__' has no function 'energy' \(__main__ is the "
                                       r"program running, .*; name a function of a script by "
                                       r"its 'file\.py:function'\)$"):
    energies.get("__main__:energy", "mlp", "model.mlp_energy")
  spec = energies.get(f"{user}:quad", "mlp", "model.mlp_energy")
  assert spec.fused_update is None and float(spec.energy(jnp.ones(3), None, {}, None)) == 3.0
  with pytest.raises(ValueError, match=r"^model\.update_mode='closed'; allowed: fused, "
                                       r"autodiff, auto$"):
    updates.resolve_update(spec, "closed", "model.update_mode")
  with pytest.raises(ValueError, match=r"^energy name 'softmax' is already registered$"):
    energies.register("softmax", "attention", lambda *a: 0.0)
  with pytest.raises(ValueError, match=r"^energy kind='ffn'; allowed: attention, mlp$"):
    energies.register("test_unused_name", "ffn", lambda *a: 0.0)
  assert "test_unused_name" not in energies.names()


def test_start_up_relative_error_of_a_zero_reference_is_zero_or_infinite():
  # An update that is exactly 0 (an energy that ignores y) matches a zero closed form: 0, not
  # 0/0 = NaN, which the check would refuse; any other closed form is infinitely wrong.
  zero, other = np.zeros((2, 3)), np.array([[0.0, 1e-9, 0.0], [0.0, 0.0, 0.0]])
  assert energy_checks._relative_error(zero, zero) == 0.0
  assert energy_checks._relative_error(other, zero) == np.inf
  want = np.array([[1.0, -4.0, 2.0], [0.5, 0.0, 3.0]])
  assert energy_checks._relative_error(want + other, want) == pytest.approx(1e-9 / 4.0)


def test_auto_uses_the_closed_form_where_one_exists_and_jax_grad_elsewhere():
  # model.update_mode's default: the fused update of a built-in energy (no autodiff pass).
  spec = energies.get("softmax", "attention")
  assert updates.resolve_update(spec, "auto") is spec.fused_update
  half_square = energies.EnergySpec("u", "mlp", _half_square)
  y = jnp.array([1.0, -2.0, 3.0])
  np.testing.assert_array_equal(updates.resolve_update(half_square, "auto")(y, None, None, None),
                                -y)  # -∇(|y|²/2) = -y


def test_preconditioner_keeps_the_dtype_of_a_bfloat16_update():
  # The layer keeps p and U in float32 and the update in model.dtype: P v must not promote
  # the residual stream to float32.
  rng = np.random.default_rng(5)
  v, p, u = rng.normal(size=(2, 3, D)), rng.normal(size=D), 0.5 * rng.normal(size=(D, 3))
  want = (np.logaddexp(0.0, p) + 1e-3) * v + (v @ u) @ u.T
  for low_rank in (u, None):
    got = updates.precondition(jnp.asarray(v, jnp.bfloat16), jnp.asarray(p, jnp.float32),
                               None if low_rank is None else jnp.asarray(u, jnp.float32), 1e-3)
    assert got.dtype == jnp.bfloat16
    ref = want if low_rank is not None else (np.logaddexp(0.0, p) + 1e-3) * v
    assert _rel(np.asarray(got, np.float64), ref) <= 2e-2


def test_preconditioner_is_positive_definite():
  for seed in range(5):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    p = 3.0 * jax.random.normal(k1, (D,))
    u = jax.random.normal(k2, (D, 3))
    matrix = jax.vmap(lambda v, p=p, u=u: updates.precondition(v, p, u, 1e-3))(jnp.eye(D)).T
    np.testing.assert_allclose(matrix, matrix.T, atol=1e-5)
    assert float(jnp.min(jnp.linalg.eigvalsh(matrix))) > 0.0
    v = jax.random.normal(k3, (D,))
    np.testing.assert_allclose(updates.precondition(v, p, u, 1e-3), matrix @ v, rtol=1e-5,
                               atol=1e-5)


# User energies with closed forms (``<function>_fused_update``), written by hand.
USER_FUSED = '''
import jax
import jax.numpy as jnp
from jax.scipy.special import spence

from cem_jax.energies import apply_rope, blockwise_logsumexp, interaction_energy


def _qk(y, context, params):
  return (jnp.einsum("btd,dhk->bthk", y, params["w_q"]),
          jnp.einsum("bsd,dhk->bshk", context, params["w_k"]))


def _scores(y, context, params, aux):
  q, k = _qk(y, context, params)
  if aux.rope_theta is not None:
    q = apply_rope(q, aux.positions, aux.rope_theta)
    k = apply_rope(k, aux.context_positions, aux.rope_theta)
  s = jnp.einsum("bthk,bshk->bhts", q, k) * params["beta"][:, None, None]
  return jnp.where(aux.mask[:, None], s, 0.0), k


def quad(y, context, params, aux):  # the README's quadratic energy, with RoPE
  s, _ = _scores(y, context, params, aux)
  n = jnp.maximum(aux.mask.sum(-1), 1)[:, None, :]
  return -0.5 * jnp.sum(params["eta"][:, None] * jnp.sum(s**2, -1) / n)


def _quad_update(y, context, params, aux, n, eta):
  # -dE/dq_th = eta_h beta_h / n_t sum_s s_hts k_sh; y enters q through W_Q and R_t
  s, k = _scores(y, context, params, aux)
  coef = (eta * params["beta"])[None, :, None, None] / n[:, None, :, None]
  dq = jnp.einsum("bhts,bshk->bthk", s * coef, k)
  if aux.rope_theta is not None:
    dq = apply_rope(dq, aux.positions, aux.rope_theta, inverse=True)
  return jnp.einsum("bthk,dhk->btd", dq, params["w_q"])


def quad_fused_update(y, context, params, aux):
  n = jnp.maximum(aux.mask.sum(-1), 1)
  return _quad_update(y, context, params, aux, n, params["eta"])


zero, noeta, causal_n, summed, nanned = quad, quad, quad, quad, quad
eta_swapped, beta_swapped = quad, quad


def inf_on_empty_rows(y, context, params, aux):  # the update finite, the value +inf
  s, _ = _scores(y, context, params, aux)
  lse = jax.nn.logsumexp(jnp.where(aux.mask[:, None], s, -jnp.inf), axis=-1)
  return -jnp.sum(params["eta"][:, None] * lse)


def _pre_x_log_x(y, context, params, aux, safe):  # Φ(h) = h log|h|: 0 at h = 0 in the limit
  pre, gate = _pre_gate(y, context, params)
  if safe:
    pre = jnp.where(pre == 0, 0.0, pre * jnp.log(jnp.where(pre == 0, 1.0, jnp.abs(pre))))
  else:
    pre = pre * jnp.log(jnp.abs(pre))
  return -params["eta"] * jnp.sum(gate * pre)


def x_log_x(y, context, params, aux):  # NaN (0 log 0) at y = 0 alone
  return _pre_x_log_x(y, context, params, aux, safe=False)


def x_log_x_safe(y, context, params, aux):
  return _pre_x_log_x(y, context, params, aux, safe=True)


@jax.custom_jvp
def _softplus_twice(h):  # softplus with a derivative rule off by a factor 2
  return jax.nn.softplus(h)


@_softplus_twice.defjvp
def _softplus_twice_jvp(primals, tangents):
  (h,), (dh,) = primals, tangents
  return _softplus_twice(h), 2.0 * jax.nn.sigmoid(h) * dh


def wrong_rule(y, context, params, aux):
  pre, gate = _pre_gate(y, context, params)
  return -params["eta"] * jnp.sum(gate * _softplus_twice(pre))


wrong_rule_agreeing = wrong_rule


@jax.custom_jvp
def _softplus_flat(h):  # softplus with a derivative rule that drops the derivative
  return jax.nn.softplus(h)


@_softplus_flat.defjvp
def _softplus_flat_jvp(primals, tangents):
  (h,), (dh,) = primals, tangents
  return _softplus_flat(h), 0.0 * dh


def zero_rule(y, context, params, aux):  # jax.grad is exactly 0, the value is not constant
  pre, gate = _pre_gate(y, context, params)
  return -params["eta"] * jnp.sum(gate * _softplus_flat(pre))


def y_free(y, context, params, aux):  # does not depend on y: its update is rightly 0
  pre, gate = _pre_gate(context, context, params)
  return -params["eta"] * jnp.sum(jnp.tanh(gate) * pre)


def wrong_rule_agreeing_fused_update(y, context, params, aux):  # agrees with jax.grad, wrongly
  pre, gate = _pre_gate(y, context, params)
  return 2.0 * params["eta"] * jnp.einsum("btf,df->btd", gate * jax.nn.sigmoid(pre),
                                          params["w"])


def own_key_error(y, context, params, aux):  # a KeyError of the energy's own
  return {"bilinear": 1.0}["distance"] * quad(y, context, params, aux)


def softmax_copy(y, context, params, aux):  # the built-in energy under a user's name
  return interaction_energy(y, context, params, aux)


def nan_when_decoding(y, context, params, aux):  # finite while training, NaN against a cache
  bad = jnp.nan if context.shape[1] > y.shape[1] else 0.0
  return quad(y, context, params, aux) + bad * jnp.sum(y)


def zero_fused_update(y, context, params, aux):
  return jnp.zeros_like(y)


def nanned_fused_update(y, context, params, aux):  # NaN is no number close to the gradient
  return quad_fused_update(y, context, params, aux) * jnp.nan


def summed_fused_update(y, context, params, aux):  # [b, t, 1]: broadcasts, but is not y's shape
  return jnp.sum(quad_fused_update(y, context, params, aux), -1, keepdims=True)


def noeta_fused_update(y, context, params, aux):  # forgets that the energy carries eta
  n = jnp.maximum(aux.mask.sum(-1), 1)
  return _quad_update(y, context, params, aux, n, 1.0)


def eta_swapped_fused_update(y, context, params, aux):  # each head steps with another's eta
  n = jnp.maximum(aux.mask.sum(-1), 1)
  return _quad_update(y, context, params, aux, n, params["eta"][::-1])


def beta_swapped_fused_update(y, context, params, aux):  # each head scaled by another's beta
  n = jnp.maximum(aux.mask.sum(-1), 1)
  swapped = dict(params, beta=params["beta"][::-1])
  return _quad_update(y, context, swapped, aux, n, params["eta"])


def causal_n_fused_update(y, context, params, aux):  # counts keys as if context were y
  n = jnp.broadcast_to(jnp.arange(1, y.shape[1] + 1), y.shape[:2])
  return _quad_update(y, context, params, aux, n, params["eta"])


def _pre_gate(y, context, params):
  return (jnp.einsum("btd,df->btf", y, params["w"]),
          jnp.einsum("btd,df->btf", context, params["g"]))


def gate_quad(y, context, params, aux):  # E = -eta/2 sum (G x) (W y)^2
  pre, gate = _pre_gate(y, context, params)
  return -0.5 * params["eta"] * jnp.sum(gate * pre**2)


def gate_quad_fused_update(y, context, params, aux):  # eta W (G x * W y)
  pre, gate = _pre_gate(y, context, params)
  return params["eta"] * jnp.einsum("btf,df->btd", gate * pre, params["w"])


def tril_of_context(y, context, params, aux):  # right shapes, wrong rows when decoding
  q, k = _qk(y, context, params)
  s = jnp.einsum("bthk,bshk->bhts", q, k)
  n = context.shape[1]
  mask = jnp.tril(jnp.ones((n, n), bool))[:y.shape[1]]
  return -0.5 * jnp.einsum("h,bhts->", params["eta"], jnp.where(mask, s, 0.0) ** 2)


def rope_from_arange(y, context, params, aux):  # positions 0.. whatever the tokens' are
  q, k = _qk(y, context, params)
  q = apply_rope(q, jnp.broadcast_to(jnp.arange(y.shape[1]), y.shape[:2]), 10_000.0)
  k = apply_rope(k, jnp.broadcast_to(jnp.arange(context.shape[1]), context.shape[:2]), 10_000.0)
  s = jnp.where(aux.mask[:, None], jnp.einsum("bthk,bshk->bhts", q, k), 0.0)
  return -0.5 * jnp.einsum("h,bhts->", params["eta"], s**2)


def no_mask(y, context, params, aux):  # sees every key: the future too, in training
  q, k = _qk(y, context, params)
  return -0.5 * jnp.einsum("h,bhts->", params["eta"], jnp.einsum("bthk,bshk->bhts", q, k) ** 2)


def lookahead(y, context, params, aux):  # query i reads y_(i+1): the future, in training
  ahead = jnp.concatenate([y[:, 1:], jnp.zeros_like(y[:, :1])], axis=1)
  s, _ = _scores(y + jax.lax.stop_gradient(ahead), context, params, aux)
  return -0.5 * jnp.einsum("h,bhts->", params["eta"], s**2)


def across_documents(y, context, params, aux):  # causal by position, blind to documents
  q, k = _qk(y, context, params)
  causal = aux.context_positions[:, None, :] <= aux.positions[:, :, None]
  s = jnp.where(causal[:, None], jnp.einsum("bthk,bshk->bhts", q, k), 0.0)
  return -0.5 * jnp.einsum("h,bhts->", params["eta"], s**2)


def peek_next_key(y, context, params, aux):  # an off-by-one causal mask: key i + 1 too
  q, k = _qk(y, context, params)
  ahead = aux.context_positions[:, None, :] <= aux.positions[:, :, None] + 1
  s = jnp.where(ahead[:, None], jnp.einsum("bthk,bshk->bhts", q, k), 0.0)
  return -0.5 * jnp.einsum("h,bhts->", params["eta"], s**2)


def dilated(y, context, params, aux):  # keys every 8 back, written so that 8 ahead is one too
  s, _ = _scores(y, context, params, aux)
  d = aux.positions[:, :, None] - aux.context_positions[:, None, :]
  q, k = _qk(y, context, params)
  extra = jnp.where(((d % 8 == 0) & (d != 0))[:, None], jnp.einsum("bthk,bshk->bhts", q, k), 0.0)
  return -0.5 * jnp.einsum("h,bhts->", params["eta"], s**2 + extra**2)


def nan_when_long(y, context, params, aux):  # finite on the short layouts, NaN at seq_len 64
  s, _ = _scores(y, context, params, aux)
  scale = jnp.nan if y.shape[1] > 16 else 1.0
  return -0.5 * scale * jnp.einsum("h,bhts->", params["eta"], s**2)


def late_peek(y, context, params, aux):  # from position 40 on, a query sees the next key too
  q, k = _qk(y, context, params)
  d = aux.positions[:, :, None] - aux.context_positions[:, None, :]
  sees = aux.mask | ((d == -1) & (aux.positions[:, :, None] >= 40))
  s = jnp.where(sees[:, None], jnp.einsum("bthk,bshk->bhts", q, k), 0.0)
  return -0.5 * jnp.einsum("h,bhts->", params["eta"], s**2)


def global_max(y, context, params, aux):  # causal in exact arithmetic; one max over all scores
  s, _ = _scores(y, context, params, aux)
  top = jnp.max(jnp.where(aux.mask[:, None], s, -jnp.inf))
  e = jnp.where(aux.mask[:, None], jnp.exp(s - top), 0.0)
  lse = jnp.log(jnp.maximum(e.sum(-1), 1e-30)) + top
  return -jnp.sum(params["eta"][:, None] * lse)


def small_leak(y, context, params, aux):  # causal, plus 1e-4 of the next key
  s, _ = _scores(y, context, params, aux)
  q, k = _qk(y, context, params)
  leak = jnp.sum(q[:, :-1] * k[:, 1:])
  return -0.5 * jnp.einsum("h,bhts->", params["eta"], s**2) - 1e-4 * leak


def gate_far_ahead(y, context, params, aux):  # token i's gate is token i + 8's state
  ahead = jnp.concatenate([context[:, 8:], jnp.zeros_like(context[:, :8])], axis=1)
  gate = jax.nn.sigmoid(ahead @ params["g"])
  return -0.5 * jnp.sum(params["eta"] * (y @ params["w"]) ** 2 * gate)


def no_eta(y, context, params, aux):  # the quadratic energy without its step size
  s, _ = _scores(y, context, params, aux)
  return -0.5 * jnp.sum(s**2)


def no_beta(y, context, params, aux):  # the quadratic energy at temperature 1
  q, k = _qk(y, context, params)
  s = jnp.where(aux.mask[:, None], jnp.einsum("bthk,bshk->bhts", q, k), 0.0)
  return -0.5 * jnp.einsum("h,bhts->", params["eta"], s**2)


def prod_over_keys(y, context, params, aux):  # log of a product: inf once a row sees ~40 keys
  s, _ = _scores(y, context, params, aux)
  f = jnp.where(aux.mask[:, None], 10.0 + jax.nn.sigmoid(s), 1.0)
  return -jnp.einsum("h,bht->", params["eta"], jnp.log(jnp.prod(f, axis=-1)))


def unshifted_exp(y, context, params, aux):  # exp(30 s) with no max shift: overflows
  s, _ = _scores(y, context, params, aux)
  e = jnp.where(aux.mask[:, None], jnp.exp(30.0 * s), 0.0)
  return -jnp.einsum("h,bht->", params["eta"], jnp.log(e.sum(-1) + 1e-30) / 30.0)


def mlp_no_eta(y, context, params, aux):
  return -0.5 * jnp.sum((y @ params["w"]) ** 2 * jax.nn.sigmoid(context @ params["g"]))


def across_real_documents(y, context, params, aux):  # leaves padding out, not other documents
  q, k = _qk(y, context, params)
  mask = aux.context_positions[:, None, :] <= aux.positions[:, :, None]
  if aux.segment_ids is not None:
    real = aux.segment_ids > 0
    mask = mask & real[:, :, None] & real[:, None, :]
  s = jnp.where(mask[:, None], jnp.einsum("bthk,bshk->bhts", q, k), 0.0)
  return -0.5 * jnp.einsum("h,bhts->", params["eta"], s**2)


def mean_over_keys(y, context, params, aux):  # averages over context's length, not N(i)
  s, _ = _scores(y, context, params, aux)
  return -0.5 * jnp.sum(params["eta"][:, None] * jnp.mean(s**2, -1))


def product_mask(y, context, params, aux):  # log Σ mask·exp(s): log 0 on a row seeing no key
  q, k = _qk(y, context, params)
  s = jnp.einsum("bthk,bshk->bhts", q, k) * params["beta"][:, None, None]
  total = jnp.sum(aux.mask[:, None] * jnp.exp(s), -1)
  lse = jnp.where(jnp.any(aux.mask, -1)[:, None], jnp.log(total), 0.0)  # a finite energy
  return -jnp.sum((params["eta"] / params["beta"])[:, None] * lse)


def spence_phi(y, context, params, aux):  # the SiLU potential without its custom JVP
  pre, gate = _pre_gate(y, context, params)
  phi = pre * jax.nn.softplus(pre) + spence(1.0 + jnp.exp(pre)) + jnp.pi**2 / 12
  return -params["eta"] * jnp.sum(gate * phi)


def spence_phi_fused_update(y, context, params, aux):  # right: eta W (silu(W y) * G x)
  pre, gate = _pre_gate(y, context, params)
  return params["eta"] * jnp.einsum("btf,df->btd", jax.nn.silu(pre) * gate, params["w"])


def stopped(y, context, params, aux):  # y behind stop_gradient: jax.grad is 0, the update not
  return quad(jax.lax.stop_gradient(y), context, params, aux)


def stopped_fused_update(y, context, params, aux):
  return quad_fused_update(y, context, params, aux)


stopped_zero = stopped


def stopped_zero_fused_update(y, context, params, aux):  # agrees with jax.grad: both are 0
  return jnp.zeros_like(y)


def gate_ahead(y, context, params, aux):  # token i's gate reads c_i + c_(i+1)
  ahead = jnp.concatenate([context[:, 1:], jnp.zeros_like(context[:, :1])], axis=1)
  gate = jnp.einsum("btd,df->btf", context + ahead, params["g"])
  return -params["eta"] * jnp.sum(gate * jnp.tanh(jnp.einsum("btd,df->btf", y, params["w"])))


def gate_batch_mean(y, context, params, aux):  # an MLP energy mixing batch rows
  gate = jnp.einsum("btd,df->btf", context - jnp.mean(context, axis=0), params["g"])
  return -params["eta"] * jnp.sum(gate * jnp.tanh(jnp.einsum("btd,df->btf", y, params["w"])))


def gate_cumsum(y, context, params, aux):  # an MLP energy mixing tokens
  gate = jnp.cumsum(jnp.einsum("btd,df->btf", context, params["g"]), axis=1)
  return -params["eta"] * jnp.sum(gate * jnp.tanh(jnp.einsum("btd,df->btf", y, params["w"])))


def gate_own_window(y, context, params, aux):  # an MLP energy masking by y's own length
  sees = jnp.tril(jnp.ones((y.shape[1], y.shape[1]), bool)) & aux.mask
  h = jnp.einsum("btd,df->btf", y, params["w"]) * jnp.sum(sees, -1)[..., None]
  return -params["eta"] * jnp.sum(jnp.tanh(h))


# An exact closed form (jax.grad itself) of an energy that mixes tokens: the fused check passes,
# the causal one must still refuse it.
cumsum_exact = gate_cumsum


def cumsum_exact_fused_update(y, context, params, aux):
  return -jax.grad(gate_cumsum)(y, context, params, aux)


def _lse(y, context, params, mask, block_size):  # block_size 0: the dense scores
  q, k = _qk(y, context, params)
  lse = blockwise_logsumexp(q, k, mask, block_size, params["beta"])
  return -jnp.sum(params["eta"][None, :, None] * lse)


def lse_blocks(y, context, params, aux):  # reads aux.energy_block_size (dense when 0)
  return _lse(y, context, params, aux.mask, aux.energy_block_size)


def lse_long_only(y, context, params, aux):  # blocks only at 64 keys or more
  if context.shape[1] < 64:
    return _lse(y, context, params, aux.mask, 0)
  assert aux.energy_block_size % 8 == 0, "energy_block_size must be a multiple of 8"
  return _lse(y, context, params, aux.mask, aux.energy_block_size)


def lse_dense(y, context, params, aux):  # the same energy, blind to aux.energy_block_size
  return _lse(y, context, params, aux.mask, 0)


def f32_only(y, context, params, aux):  # lax.mul takes no mixed dtypes: bf16 inputs fail
  pre, gate = _pre_gate(y, context, params)
  return jax.lax.mul(jnp.sum(gate * jnp.tanh(pre)), -params["eta"])


def bf16_only(y, context, params, aux):  # runs in a bfloat16 model, not in float32
  pre, gate = _pre_gate(y, context, params)
  value = jax.lax.mul(jnp.sum(gate * jnp.tanh(pre)), -params["eta"].astype(jnp.bfloat16))
  return value.astype(jnp.float32)  # a bfloat16 value is refused before the numerical checks


def eta_on_batch(y, context, params, aux):  # eta [heads] put on the batch axis of [b, h, t]
  q = jnp.einsum("btd,dhk->bthk", y, params["w_q"])
  return -jnp.sum(params["eta"][:, None, None] * jnp.sum(q * q, -1).transpose(0, 2, 1))


def per_row(y, context, params, aux):  # one energy per batch row: [batch], not a scalar
  return -0.5 * jnp.sum(y * y, axis=(1, 2))


def diag_quad(y, context, params, aux):  # quad plus the diagonal's bilinear term, squared
  s = -2.0 * quad(y, context, params, aux)
  cross = jnp.einsum("btd,hd,bsd->bhts", y, params["diag"], context)
  n = jnp.maximum(aux.mask.sum(-1), 1)[:, None, :]
  t = jnp.sum(jnp.where(aux.mask[:, None], cross, 0.0) ** 2, -1) / n
  return -0.5 * (s + jnp.sum(params["eta"][:, None] * t))


def diag_quad_fused_update(y, context, params, aux):  # forgets the diagonal's term
  return quad_fused_update(y, context, params, aux)


def floored(y, context, params, aux):  # y through jnp.floor: jax.grad is 0 everywhere
  pre, gate = _pre_gate(y, context, params)
  return -params["eta"] * jnp.sum(gate * jnp.floor(pre))


def doc_starts(y, context, params, aux):  # quad, doubled on each document's first token
  # jax.Array's .at on aux.segment_ids: the model hands the energy a traced array
  s, _ = _scores(y, context, params, aux)
  n = jnp.maximum(aux.mask.sum(-1), 1)[:, None, :]
  per_query = jnp.sum(params["eta"][:, None] * jnp.sum(s**2, -1) / n, 1)  # [batch, t]
  if aux.segment_ids is not None:
    seg = aux.segment_ids
    per_query = per_query * (1 + seg.at[:, 1:].set(seg[:, 1:] != seg[:, :-1]).at[:, 0].set(1))
  return -0.5 * jnp.sum(per_query)


def tril(y, context, params, aux):  # builds its own mask of y's length
  q, k = _qk(y, context, params)
  s = jnp.einsum("bthk,bshk->bhts", q, k)
  t = y.shape[1]
  return -0.5 * jnp.sum(jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, 0.0) ** 2)
'''


def _user_config(tmp_path, **fields):
  path = tmp_path / "user_fused.py"
  path.write_text(USER_FUSED)
  return tiny_config("cem", **{f"model.{k}": (f"{path}:{v}" if k.endswith("_energy") else v)
                               for k, v in fields.items()})


def _refusal(cfg) -> str:
  with pytest.raises(ValueError) as err:
    preflight.check(cfg)
  assert "\n" not in str(err.value)
  return str(err.value)


def test_a_model_counts_as_built_in_only_where_every_energy_it_uses_is(tmp_path):
  # What FLOPs and MFU (tables, bench, train/mfu) are known for: a user energy's operations
  # are not modelled.
  assert energies.only_builtins(tiny_config("llama").model)
  assert energies.only_builtins(tiny_config("cem", **{"model.mlp_energy": "relu2"}).model)
  for slot in ("attention", "mlp"):
    cfg = _user_config(tmp_path, **{f"{slot}_energy": "quad" if slot == "attention" else
                                    "gate_cumsum"})
    assert not energies.only_builtins(cfg.model), slot
    cfg.model[f"cem_{slot}"] = False  # that sub-layer is Llama's: its energy unused
    assert energies.only_builtins(cfg.model), slot
  cfg = _user_config(tmp_path, attention_energy="quad")
  cfg.model.block = "llama"
  assert energies.only_builtins(cfg.model)


def test_builtin_energies_are_flagged_and_user_ones_are_not(tmp_path):
  assert energies.get("softmax", "attention").builtin
  assert all(energies.get(n, "mlp").builtin for n in energies.POTENTIALS)
  # Built-ins are pinned by these tests and NUMERICS_VERSION, not by a digest of their source:
  # one would refuse to resume every run after any edit of cem_jax.
  assert all(energies.source_digest(n, k) is None for n, k in [("softmax", "attention")] + [
      (p, "mlp") for p in energies.POTENTIALS])
  cfg = _user_config(tmp_path, attention_energy="quad")
  spec = energies.get(cfg.model.attention_energy, "attention")
  assert spec.fused_update is not None and not spec.builtin
  assert len(energies.source_digest(cfg.model.attention_energy, "attention")) == 64
  name = "test_user_registered_energy"
  try:
    assert not energies.register(name, "mlp", lambda *a: 0.0).builtin
  finally:
    energies.registry._REGISTRY.pop(name, None)


@pytest.mark.parametrize("fields", [
    {"attention_energy": "quad"},
    {"attention_energy": "quad", "rope": False, "document_mask": False, "update_mode": "fused"},
    {"mlp_energy": "gate_quad"},
], ids=["attention", "attention_plain", "mlp"])
def test_correct_user_fused_update_passes_start_up(tmp_path, fields):
  """A closed form computed by hand equals -jax.grad(energy): accepted (and used)."""
  preflight.check(_user_config(tmp_path, **fields))


def test_a_nan_user_fused_update_is_refused_by_the_value_check(tmp_path):
  message = _refusal(_user_config(tmp_path, attention_energy="nanned"))
  assert "its fused update nanned_fused_update is not -jax.grad(energy) w.r.t. y: max " \
         "relative error nan > 0.001" in message, message


def test_a_user_fused_update_not_shaped_like_y_is_refused_by_its_shape(tmp_path):
  message = _refusal(_user_config(tmp_path, attention_energy="summed"))
  assert re.search(r"its fused update summed_fused_update returns shape \(\d+, \d+, 1\), dtype "
                   r"float32 on .*a float array shaped like y$", message), message


@pytest.mark.parametrize("name", ["zero", "noeta", "eta_swapped", "beta_swapped"])
def test_wrong_user_fused_update_is_refused_at_start_up(tmp_path, name):
  """A closed form that is not -∇_y energy used to train silently (zeros: a model without
  attention); now config.validate refuses it with the error it measured."""
  cfg = _user_config(tmp_path, attention_energy=name)
  message = _refusal(cfg)
  assert message.startswith(
      f"model.attention_energy='{tmp_path}/user_fused.py:{name}': its fused update "
      f"{name}_fused_update is not -jax.grad(energy) w.r.t. y: max relative error ")
  error = re.search(r"max relative error (\S+) > 0.001 on \[batch, seq_len, d_model\] random "
                    r"float32 inputs", message)
  assert float(error.group(1)) == {  # the check's η and β differ per head: a swap shows
      "zero": 1.0, "noeta": pytest.approx(0.3, abs=0.25),
      "eta_swapped": pytest.approx(0.086, rel=0.1), "beta_swapped": pytest.approx(0.82, rel=0.1),
  }[name]
  assert "model.update_mode='autodiff'" in message
  with cfg.unlocked():
    cfg.model.update_mode = "autodiff"  # the closed form is then never called
  preflight.check(cfg)


def test_user_fused_update_wrong_only_in_its_diagonal_term_is_refused(tmp_path):
  """The start-up check draws a nonzero diagonal (of either sign): with the layer's initial
  d = 0 a closed form that forgets the diagonal's term would pass it."""
  message = _refusal(_user_config(tmp_path, attention_energy="diag_quad", diagonal="per_head"))
  assert "diag_quad_fused_update is not -jax.grad(energy) w.r.t. y" in message, message


def test_user_fused_update_wrong_only_in_cached_decoding_is_refused(tmp_path):
  """Right for a plain causal window, wrong when y is the new tokens against a longer cache."""
  message = _refusal(_user_config(tmp_path, attention_energy="causal_n", document_mask=False))
  assert "causal_n_fused_update is not -jax.grad(energy)" in message
  assert "as in cached decoding (python -m cem_jax.sample)" in message


def test_wrong_fused_update_registered_from_python_is_refused():
  energy, fused = energies.make_gated_energy("relu")
  name = "test_half_relu"
  try:
    energies.register(name, "mlp", energy, lambda *a: 0.5 * fused(*a))
    message = _refusal(tiny_config("cem", **{"model.mlp_energy": name}))
  finally:
    energies.registry._REGISTRY.pop(name, None)
  assert message.startswith(f"model.mlp_energy='{name}': its fused update <lambda> is not")
  assert "max relative error 0.5 >" in message


def test_energy_with_its_own_causal_mask_is_refused_at_start_up(tmp_path):
  """jnp.tril of y's length passed start-up (y and context of equal length) and crashed
  `sample` (y = new tokens, context = the whole cache) with a message not naming the energy."""
  message = _refusal(_user_config(tmp_path, attention_energy="tril"))
  assert message.startswith(
      f"model.attention_energy='{tmp_path}/user_fused.py:tril' failed on inputs with context "
      "longer than y, as in cached decoding (python -m cem_jax.sample) (y [1, 2, 64], "
      "context [1, 8, 64], aux.mask [1, 2, 8]): ValueError: Incompatible shapes")
  assert "build masks from aux.mask" in message


def test_an_mlp_energy_failing_in_cached_decoding_is_told_the_mask_is_wider_than_y(tmp_path):
  # An MLP's context is y's own tokens in both layouts: what differs when decoding is aux.mask.
  message = _refusal(_user_config(tmp_path, mlp_energy="gate_own_window"))
  assert message.startswith(
      f"model.mlp_energy='{tmp_path}/user_fused.py:gate_own_window' failed on inputs with "
      "aux.mask wider than y, as in cached decoding (python -m cem_jax.sample) (y [1, 2, 64], "
      "context [1, 2, 64], aux.mask [1, 2, 8]): "), message


def test_energy_broadcasting_an_axis_against_the_batch_names_the_shapes(tmp_path):
  # [heads, 1, 1] against [batch, heads, t] passes the shape checks' batch of 1 and fails
  # only at the numerical checks' batch of 2: the line says which y that was.
  message = _refusal(_user_config(tmp_path, attention_energy="eta_on_batch"))
  assert message.startswith(
      f"model.attention_energy='{tmp_path}/user_fused.py:eta_on_batch': its update failed on "
      "random float32 inputs, y [2, 7, 64] [batch, seq_len, d_model] (batch 2: the shape "
      "checks ran batch 1): TypeError: "), message


def test_energy_of_one_value_per_batch_row_is_refused_at_start_up(tmp_path):
  # jax.grad needs a scalar: a [batch] energy (one axis, unlike test_design's [batch, seq])
  # would pass start-up and fail when the train step compiles.
  message = _refusal(_user_config(tmp_path, attention_energy="per_row"))
  assert message == (f"model.attention_energy='{tmp_path}/user_fused.py:per_row' returns shape "
                     "(1,) for y of shape [1, 4, 64] ([batch, seq_len, d_model]); an energy must "
                     "return a scalar (sum over batch and positions)")


def test_energy_block_size_an_energy_never_reads_is_refused(tmp_path):
  """model.energy_block_size reaches energies only through aux: one that ignores it kept
  quadratic memory under jax.grad, silently. An energy reading it in any way passes: one
  treating 0 as one block of all keys, one blocking only at the training length (64 here)
  and checking the size itself; and the built-in."""
  blocks = {"update_mode": "autodiff", "energy_block_size": 64, "rope": False}
  message = _refusal(_user_config(tmp_path, attention_energy="lse_dense", **blocks))
  assert message == (
      f"model.energy_block_size=64 has no effect on model.attention_energy='{tmp_path}/"
      "user_fused.py:lse_dense': neither the energy nor its gradient reads "
      "aux.energy_block_size (pass it to cem_jax.energies.blockwise_logsumexp for memory "
      "linear in seq_len); set model.energy_block_size=0")
  for size in (1, 2, 64):
    preflight.check(_user_config(tmp_path, attention_energy="lse_blocks",
                                 **dict(blocks, energy_block_size=size)))
  preflight.check(_user_config(tmp_path, attention_energy="lse_long_only", **blocks))
  preflight.check(_user_config(tmp_path, **blocks))  # the built-in softmax energy


def test_energy_that_fails_in_the_models_dtype_is_refused_at_start_up(tmp_path):
  """The layer hands an energy its weights, y and context in model.dtype (eta, beta float32).
  The abstract checks ran in float32 only, so an energy failing on bfloat16 passed start-up
  and failed when the train step compiled, after the data was prepared, as a traceback."""
  preflight.check(_user_config(tmp_path, mlp_energy="f32_only"))  # float32: fine
  message = _refusal(_user_config(tmp_path, mlp_energy="f32_only", dtype="bfloat16"))
  assert message.startswith(
      f"model.mlp_energy='{tmp_path}/user_fused.py:f32_only' failed on [batch, seq_len, "
      "d_model] bfloat16 inputs (model.dtype): TypeError: ")
  assert "bfloat16" in message.split("TypeError: ")[1]
  # The numerical checks run in float32: an energy that only runs in bfloat16 is refused,
  # saying so.
  message = _refusal(_user_config(tmp_path, mlp_energy="bf16_only", dtype="bfloat16"))
  assert message.startswith(
      f"model.mlp_energy='{tmp_path}/user_fused.py:bf16_only': its update failed on random "
      "float32 inputs, y [2, 7, 64] [batch, seq_len, d_model] (batch 2: the shape checks ran "
      "batch 1) (the numerical start-up checks run in float32 whatever model.dtype; "
      "write the energy for any float dtype, e.g. cast constants with y.dtype): TypeError: ")


@pytest.mark.parametrize("slot,name,extra", [
    ("attention", "tril_of_context", {}), ("attention", "tril_of_context", {"strict_causal": True}),
    ("attention", "rope_from_arange", {"rope": False}), ("attention", "no_mask", {}),
    ("attention", "lookahead", {}), ("mlp", "gate_cumsum", {}), ("mlp", "gate_ahead", {}),
    ("attention", "peek_next_key", {"document_mask": False}),
    ("attention", "mean_over_keys", {"document_mask": False})])
def test_energy_that_decodes_differently_from_training_is_refused(tmp_path, slot, name, extra):
  """Right shapes, so the abstract checks passed, but the update of the new tokens against a
  cache differs from training's for the same tokens: sampling was silently wrong (a non-causal
  energy also trained on the future)."""
  message = _refusal(_user_config(tmp_path, **{f"{slot}_energy": name}, **extra))
  assert message.startswith(
      f"model.{slot}_energy='{tmp_path}/user_fused.py:{name}': its update reads tokens after "
      "its own, or a mask, length or positions not taken from aux: for 2 new tokens at "
      "positions 3.. against a 8-slot cache, as in cached decoding (python -m cem_jax.sample), "
      "it differs from the training-layout update of the same tokens: max relative error ")
  assert ("build masks from aux.mask" if slot == "attention" else "per-token terms") in message


@pytest.mark.parametrize("slot,name,extra,rows", [
    ("attention", "product_mask", {}, "with documents and padding (model.document_mask), on "
     "rows that see no key only"),
    ("attention", "product_mask", {"document_mask": False, "strict_causal": True},
     "on rows that see no key only"),
    ("mlp", "spence_phi", {"update_mode": "autodiff"}, "")])
def test_energy_whose_update_is_not_finite_is_refused_at_start_up(tmp_path, slot, name, extra,
                                                                   rows):
  """A NaN update only where no row was compared (padding, a document's first token under
  strict causality) passed start-up and trained to a NaN loss at the first step; NaN
  everywhere was refused as a cached-decoding mismatch, with a hint about masks."""
  message = _refusal(_user_config(tmp_path, **{f"{slot}_energy": name}, **extra))
  assert message.startswith(
      f"model.{slot}_energy='{tmp_path}/user_fused.py:{name}': its update (jax.grad of the "
      "energy) is not finite (NaN or inf) on random float32 [batch, seq_len, d_model] inputs"
      + (f" {rows}" if rows.startswith("with") else f", {rows}" if rows else ";")), message
  assert ("jnp.where" if slot == "attention" else "jax.custom_jvp") in message
  # Without empty rows (no documents, no strict causality), masking by a product is finite.
  if slot == "attention" and extra:
    preflight.check(_user_config(tmp_path, attention_energy=name, document_mask=False))


@pytest.mark.parametrize("extra,where", [
    ({}, "[batch, seq_len, d_model] inputs with documents and padding"),
    ({"document_mask": False, "strict_causal": True}, "[batch, seq_len, d_model] inputs")])
def test_an_energy_whose_value_is_not_finite_is_refused_at_start_up(tmp_path, extra, where):
  """jax.nn.logsumexp of -inf-masked scores: a finite update (jnp.where keeps the gradient
  of empty rows 0) but a +inf energy on rows that see no key, which eval.energy_trace logged
  as a missing value without a word."""
  message = _refusal(_user_config(tmp_path, attention_energy="inf_on_empty_rows", **extra))
  assert message.startswith(
      f"model.attention_energy='{tmp_path}/user_fused.py:inf_on_empty_rows': the energy's "
      f"value is inf on random float32 {where}, though its update is finite; an energy must "
      "be finite (eval.energy_trace logs it): on rows that see no key use "
      "cem_jax.energies.masked_logsumexp"), message
  # Every row sees a key, but the energy trace takes off a padding token that sees none:
  # accepted, this logged every attention trace as null (found training it 2 steps).
  message = _refusal(_user_config(tmp_path, attention_energy="inf_on_empty_rows",
                                  document_mask=False))
  assert "the energy's value at a padding token (y = context = 0, seeing no key) is inf" in (
      message), message


def test_an_energy_not_finite_at_zero_is_refused_at_start_up(tmp_path):
  """h log|h| is NaN at h = 0 only, which random inputs never reach, but the energy trace
  takes off a padding token's energy at y = 0 (times 0 without padding): every MLP trace of
  the run was null, found training it 4 steps."""
  message = _refusal(_user_config(tmp_path, mlp_energy="x_log_x"))
  assert message.startswith(
      f"model.mlp_energy='{tmp_path}/user_fused.py:x_log_x': the energy's value at a padding "
      "token (y = context = 0, seeing no key) is nan; the energy trace (eval.energy_trace, "
      "python -m cem_jax.evaluate) takes it off per padding token"), message
  preflight.check(_user_config(tmp_path, mlp_energy="x_log_x_safe"))


@pytest.mark.parametrize("name,what", [
    ("wrong_rule", "update (jax.grad of the energy)"),
    ("wrong_rule_agreeing", "fused update wrong_rule_agreeing_fused_update")])
def test_an_update_that_is_not_the_gradient_of_the_energys_value_is_refused(tmp_path, name,
                                                                             what):
  """A jax.custom_jvp rule off by a factor 2: jax.grad follows it, and a closed form that
  agrees with jax.grad passed the fused check, so both trained as CEM updates that are not
  -∇E (found writing one, as the not-finite refusal's hint suggests)."""
  message = _refusal(_user_config(tmp_path, mlp_energy=name))
  assert message.startswith(
      f"model.mlp_energy='{tmp_path}/user_fused.py:{name}': its {what} is not -∇_y of the "
      "energy's value: along the update, central differences of the energy give the slope "), (
      message)
  slope, want = map(float, re.findall(r"slope (\S+), the update (\S+) ", message)[0])
  assert want == pytest.approx(2 * slope, rel=1e-3)  # the rule's factor 2


@pytest.mark.parametrize("name,extra,what", [
    ("stopped", {"update_mode": "autodiff", "learn_eta": False},
     "update (jax.grad of the energy)"),
    ("zero_rule", {}, "update (jax.grad of the energy)"),
    ("floored", {}, "update (jax.grad of the energy)"),
    ("stopped_zero", {"learn_eta": False}, "fused update stopped_zero_fused_update")])
def test_an_update_that_is_zero_while_the_energy_changes_is_refused(tmp_path, name, extra,
                                                                     what):
  """y behind stop_gradient, or a jax.custom_jvp rule that drops the derivative: the update
  is exactly 0, so the slope check compared 0 with 0 and passed it (a closed form of 0 agrees
  with jax.grad too), training a layer that does nothing; with model.learn_eta the refusal
  blamed an unread eta. An energy that does not depend on y is rightly 0 and passes."""
  slot = "attention" if name.startswith("stopped") else "mlp"
  message = _refusal(_user_config(tmp_path, **{f"{slot}_energy": name}, **extra))
  assert message.startswith(
      f"model.{slot}_energy='{tmp_path}/user_fused.py:{name}': its {what} is 0 on random "
      "float32 inputs, but the energy's value changes with y: "), message
  values = re.search(r"y: (\S+), (\S+), (\S+) at y - r, y, y \+ r", message).groups()
  minus, at, plus = map(float, values)
  change = max(abs(minus - at), abs(plus - at)) / abs(at)
  assert change > 0.01  # a step the size of y moves these energies by O(1) of themselves
  assert f"relative change {change:.3g} > 1e-05" in message
  # The cause when there is no rule or stop_gradient: a step function of y (here jnp.floor).
  assert message.endswith("(y read only through a step function, e.g. jnp.round or jnp.floor, "
                          "has a gradient of 0 too: the layer would never move y)"), message
  if name == "zero_rule":
    preflight.check(_user_config(tmp_path, mlp_energy="y_free", learn_eta=False))


def test_a_saved_runs_energy_is_warned_about_what_it_computes_and_refused_if_it_fails(
    tmp_path, caplog):
  """Reading a saved run (runs.load_run: evaluate, sample), a refusal of what a user energy
  computes is a warning naming the energy and the check, in both slots; an energy that fails
  in a layout the model calls it with is still refused: the model could not run it."""
  cfg = _user_config(tmp_path, attention_energy="no_eta", mlp_energy="gate_cumsum")
  refusal = _refusal(cfg)
  assert refusal.startswith("model.learn_eta=True has no effect on model.attention_energy=")
  with caplog.at_level(logging.WARNING):
    preflight.check(cfg, saved_run=True)
  said = [r.getMessage() for r in caplog.records if "saved run" in r.getMessage()]
  assert said[0] == (f"{refusal} (a start-up check that training refuses; this saved run is "
                     "read anyway)")
  assert len(said) == 2 and said[1].startswith(
      f"model.mlp_energy='{tmp_path}/user_fused.py:gate_cumsum': its update reads tokens after "
      "its own"), said
  with pytest.raises(ValueError, match=r"user_fused.py:tril' failed on inputs with context "
                                       r"longer than y, as in cached decoding"):
    preflight.check(_user_config(tmp_path, attention_energy="tril"), saved_run=True)


def test_every_check_hands_the_energy_jax_arrays_in_aux(tmp_path):
  """The model's aux holds jax arrays (traced): an energy may use their jax-only methods
  (``.at``). The look-ahead check built aux.segment_ids from a NumPy array and refused this
  causal energy with "'numpy.ndarray' object has no attribute 'at'"."""
  preflight.check(_user_config(tmp_path, attention_energy="doc_starts"))  # document_mask on


@pytest.mark.parametrize("diagonal", ["per_head", "shared"])
def test_a_diagonal_the_energy_never_reads_is_refused_at_start_up(tmp_path, diagonal):
  """model.diagonal adds params['diag'] to the attention slot: an energy that ignores it
  trained the diagonal's parameters for nothing, silently (as energy_block_size was)."""
  message = _refusal(_user_config(tmp_path, attention_energy="quad", diagonal=diagonal))
  assert message == (
      f"model.diagonal='{diagonal}' has no effect on model.attention_energy='{tmp_path}/"
      "user_fused.py:quad': its update does not change with params['diag'] ([num_heads, "
      "d_model]); read it in the energy or set model.diagonal='none'")
  preflight.check(_user_config(tmp_path, attention_energy="softmax_copy", diagonal=diagonal))


@pytest.mark.parametrize("slot,name", [("attention", "no_eta"), ("mlp", "mlp_no_eta")])
def test_a_learned_step_size_the_energy_never_reads_is_refused_at_start_up(tmp_path, slot, name):
  """The energy carries the step size: one that ignores params['eta'] trained eta on a zero
  gradient without a word; with model.learn_eta=False (eta fixed) it is accepted."""
  message = _refusal(_user_config(tmp_path, **{f"{slot}_energy": name}))
  assert message == (
      f"model.learn_eta=True has no effect on model.{slot}_energy='{tmp_path}/user_fused.py:"
      f"{name}': its update does not change with params['eta'], the learned step size, which "
      "would train on a zero gradient; multiply the energy by it (the energy carries the step "
      "size) or set model.learn_eta=False")
  preflight.check(_user_config(tmp_path, **{f"{slot}_energy": name}, learn_eta=False))


def test_a_learned_temperature_the_energy_never_reads_is_refused_at_start_up(tmp_path):
  """model.learn_beta adds a learned params['beta']: an energy at a fixed temperature trained
  it on a zero gradient without a word (as params['eta'] was)."""
  message = _refusal(_user_config(tmp_path, attention_energy="no_beta", learn_beta=True,
                                  learn_eta=False))
  assert message == (
      f"model.learn_beta=True has no effect on model.attention_energy='{tmp_path}/"
      "user_fused.py:no_beta': its update does not change with params['beta'], the learned "
      "inverse temperature, which would train on a zero gradient; read it in the energy or "
      "set model.learn_beta=False")
  preflight.check(_user_config(tmp_path, attention_energy="no_beta"))
  preflight.check(_user_config(tmp_path, attention_energy="quad", learn_beta=True,
                               learn_eta=False))


def test_an_energy_not_finite_only_at_the_training_length_is_refused_at_start_up(tmp_path):
  """A product over keys is finite on the short layouts but inf over data.seq_len tokens:
  start-up passed it (only the update was checked there) and training stopped on a
  non-finite loss with a hint to lower the learning rate."""
  message = _refusal(_user_config(tmp_path, attention_energy="prod_over_keys"))
  assert message.startswith(
      f"model.attention_energy='{tmp_path}/user_fused.py:prod_over_keys': the energy's value "
      "is -inf on random float32 inputs of 64 tokens (one document of data.seq_len"), message
  assert "sum logs instead of multiplying over keys" in message
  cfg = _user_config(tmp_path, attention_energy="prod_over_keys")
  cfg.data.seq_len = 16
  preflight.check(cfg)


def test_an_update_not_finite_on_rows_that_see_keys_names_the_overflow(tmp_path):
  """exp(30 s) without a max shift overflows on rows that see keys; the refusal only said to
  mask with jnp.where, which this energy already did."""
  message = _refusal(_user_config(tmp_path, attention_energy="unshifted_exp"))
  assert "is not finite (NaN or inf)" in message, message
  assert message.endswith(
      "; on rows that see keys, an exponential not shifted by its row's max overflows: use "
      "cem_jax.energies.masked_logsumexp"), message


def test_an_energy_module_that_turns_on_64_bit_jax_is_refused_and_the_flag_set_back(tmp_path):
  """Importing it switched the whole run to 64-bit defaults (int64 tokens, float64
  constants) without a word; the refusal leaves the process as it was."""
  path = tmp_path / "x64.py"
  path.write_text("import jax\nimport jax.numpy as jnp\n\njax.config.update('jax_enable_x64', "
                  "True)\n\n\ndef energy(y, context, params, aux):\n"
                  "  return -0.5 * params['eta'] * jnp.sum(y ** 2)\n")
  assert not jax.config.jax_enable_x64
  message = _refusal(tiny_config("cem", **{"model.mlp_energy": f"{path}:energy"}))
  assert message == (f"model.mlp_energy='{path}:energy': importing {path} set "
                     "jax_enable_x64=True, which would change the default dtype of every array "
                     "in the run; remove the jax.config.update from it (an energy gets y and "
                     "its parameters in model.dtype)")
  assert not jax.config.jax_enable_x64
  # One that fails to import after turning it on leaves the process as it was too.
  path.write_text("import jax\njax.config.update('jax_enable_x64', True)\nraise ImportError('x')\n")
  message = _refusal(tiny_config("cem", **{"model.mlp_energy": f"{path}:energy"}))
  assert "importing" in message and "failed: ImportError: x" in message, message
  assert not jax.config.jax_enable_x64


def test_an_energy_in_the_wrong_slot_names_the_slots_parameters(tmp_path):
  # A key of the other slot's params gets the slot hint; any other key (maybe of the energy's
  # own dict) the keys params has.
  message = _refusal(_user_config(tmp_path, attention_energy="own_key_error"))
  assert message.endswith("failed on [batch, seq_len, d_model] inputs: KeyError: 'distance'; "
                          "if 'distance' is meant as a key of params: model.attention_energy's "
                          "params have the keys beta, eta, w_k, w_q")
  message = _refusal(_user_config(tmp_path, mlp_energy="quad"))
  assert message == (
      f"model.mlp_energy='{tmp_path}/user_fused.py:quad' failed on [batch, seq_len, d_model] "
      "inputs: KeyError: 'w_q'; model.mlp_energy's params have the keys eta, g, w (an "
      "attention energy gets w_q, w_k, eta, beta and diag when configured; an MLP energy w, "
      "g, eta)")
  # 'diag' without model.diagonal: a key of the slot when configured, said so.
  message = _refusal(_user_config(tmp_path, attention_energy="diag_quad"))
  assert message.endswith(
      "inputs: KeyError: 'diag'; model.attention_energy's params have the keys beta, eta, w_k, "
      "w_q (an attention energy gets w_q, w_k, eta, beta and diag when configured; an MLP "
      "energy w, g, eta)"), message


def test_an_update_not_finite_only_in_cached_decoding_is_refused_as_not_finite(tmp_path):
  """Finite in every training layout, NaN for new tokens against a longer cache: the refusal
  says the update is not finite there, not that decoding departs from training (a NaN
  relative error would read as a layout mismatch and point at the masks)."""
  message = _refusal(_user_config(tmp_path, attention_energy="nan_when_decoding"))
  assert message.startswith(
      f"model.attention_energy='{tmp_path}/user_fused.py:nan_when_decoding': its update "
      "(jax.grad of the energy) is not finite (NaN or inf) on random float32 new tokens "
      "against a longer cache, as in cached decoding (python -m cem_jax.sample); the update "
      "must be finite"), message


def test_a_fused_update_whose_energy_has_no_finite_gradient_is_refused_as_uncheckable(tmp_path):
  """A right closed form of an energy jax.grad cannot differentiate (Φ_silu through spence,
  CEM_MATH.md section 2) cannot be verified: refused, saying why, not as a wrong closed form."""
  message = _refusal(_user_config(tmp_path, mlp_energy="spence_phi"))
  assert message.startswith(
      f"model.mlp_energy='{tmp_path}/user_fused.py:spence_phi': -jax.grad(energy) w.r.t. y is "
      "not finite on [batch, seq_len, d_model] random float32 inputs, so its fused update "
      "spence_phi_fused_update cannot be checked against it; make the energy's gradient "
      "finite (e.g. with jax.custom_jvp)"), message


def test_a_fused_update_of_an_energy_whose_gradient_is_zero_is_refused(tmp_path):
  """y behind stop_gradient: jax.grad of the energy is exactly 0 and the closed form is not,
  an infinite relative error (a zero reference must not make every update pass)."""
  message = _refusal(_user_config(tmp_path, attention_energy="stopped"))
  assert message.startswith(
      f"model.attention_energy='{tmp_path}/user_fused.py:stopped': its fused update "
      "stopped_fused_update is not -jax.grad(energy) w.r.t. y: max relative error inf > "
      "0.001"), message


def test_an_energy_with_an_exact_closed_form_is_checked_for_causality_too(tmp_path):
  message = _refusal(_user_config(tmp_path, mlp_energy="cumsum_exact"))
  assert message.startswith(
      f"model.mlp_energy='{tmp_path}/user_fused.py:cumsum_exact': its update reads tokens after "
      "its own, or a mask, length or positions not taken from aux: for 2 new tokens at "
      "positions 3.. against a 8-slot cache")


@pytest.mark.parametrize("slot,name,extra", [
    ("attention", "dilated", {}), ("attention", "dilated", {"document_mask": False}),
    ("attention", "small_leak", {}), ("mlp", "gate_far_ahead", {}),
    ("attention", "late_peek", {}), ("attention", "global_max", {})])
def test_an_energy_that_reads_tokens_far_ahead_or_a_little_is_refused(tmp_path, slot, name,
                                                                       extra):
  """The short layouts above see 4 tokens ahead at most, at a float32 tolerance of 1e-3: keys 8
  places back written as `d % 8 == 0` (true at d = -8 too), a gate 8 tokens ahead, or a
  next-key term 1e-4 the size of the rest passed start-up and trained a non-causal model. One
  document of data.seq_len tokens, whose earlier rows must not move at all, refuses them."""
  message = _refusal(_user_config(tmp_path, **{f"{slot}_energy": name}, **extra))
  assert message.startswith(
      f"model.{slot}_energy='{tmp_path}/user_fused.py:{name}': its update reads tokens after "
      "its own: in one document of 64 tokens, the updates before position k change when only "
      "the tokens from k on change (k = 32, 1, 63 in three rows): max relative error "), message
  assert ("build masks from aux.mask" if slot == "attention" else "per-token terms") in message
  if slot == "attention":  # float32 rounding through a max over all positions is a cause too
    assert message.endswith("a stabilising max taken over all positions does it too, through "
                            "float32 rounding in its gradient: take it per query row, put it "
                            "under jax.lax.stop_gradient, or use "
                            "cem_jax.energies.masked_logsumexp"), message


def test_an_update_not_finite_only_at_the_training_length_is_refused_as_not_finite(tmp_path):
  message = _refusal(_user_config(tmp_path, attention_energy="nan_when_long"))
  assert message.startswith(
      f"model.attention_energy='{tmp_path}/user_fused.py:nan_when_long': its update (jax.grad "
      "of the energy) is not finite (NaN or inf) on random float32 [batch, seq_len, d_model] "
      "inputs; the update must be finite"), message


def test_energy_that_crosses_documents_is_refused(tmp_path):
  """Causal by position but blind to documents: in training with packed documents it attends
  across them, and nothing else differs."""
  message = _refusal(_user_config(tmp_path, attention_energy="across_documents"))
  assert message.startswith(
      f"model.attention_energy='{tmp_path}/user_fused.py:across_documents': its update of a "
      "row's last document changes when the tokens of the documents (or padding) before it "
      "change, as in training with model.document_mask: max relative error ")
  preflight.check(_user_config(tmp_path, attention_energy="across_documents",
                               document_mask=False))  # right without documents
  # Padding left out but other documents not: the rows' last documents still see them.
  message = _refusal(_user_config(tmp_path, attention_energy="across_real_documents"))
  assert message.startswith(
      f"model.attention_energy='{tmp_path}/user_fused.py:across_real_documents': its update of "
      "a row's last document changes when the tokens of the documents (or padding) before it "
      "change, as in training with model.document_mask: max relative error ")


def test_energy_that_mixes_batch_rows_is_refused(tmp_path):
  message = _refusal(_user_config(tmp_path, mlp_energy="gate_batch_mean", document_mask=False))
  assert message.startswith(
      f"model.mlp_energy='{tmp_path}/user_fused.py:gate_batch_mean': its update of one batch "
      "row changes when another row's tokens change (rows are independent examples): max "
      "relative error ")


@pytest.mark.parametrize("energy", ["softmax", "sigmoid"])
@pytest.mark.parametrize("mode", ["auto", "autodiff"])
def test_builtin_and_example_energies_pass_start_up(energy, mode):
  if energy == "sigmoid":
    energy = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "experiments", "sigmoid_energy.py") + ":energy"
  for potential in energies.POTENTIALS:
    preflight.check(tiny_config("cem", **{
        "model.attention_energy": energy, "model.mlp_energy": potential,
        "model.update_mode": mode, "model.strict_causal": potential == "relu"}))


def test_rope_keeps_float64_inputs_in_float64():
  """A float64 reference through apply_rope must not be rounded to float32 (it was: 1e-8
  errors that capped float64 checks of user energies at float32 accuracy)."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(1, 5, 2, 8))
  pos = np.array([[0, 1, 7, 100, 3000]])
  half = 4
  angle = pos[:, :, None, None] * 10_000.0 ** (-np.arange(half) * 2.0 / 8)
  x1, x2 = x[..., :half], x[..., half:]
  want = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                         x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)
  with jax.enable_x64(True):
    got = apply_rope(jnp.asarray(x), jnp.asarray(pos), 10_000.0)
    back = apply_rope(got, jnp.asarray(pos), 10_000.0, inverse=True)
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(back), x, rtol=0, atol=1e-12)
  assert apply_rope(jnp.asarray(x, jnp.bfloat16), jnp.asarray(pos), 10_000.0).dtype == (
      jnp.bfloat16)


@pytest.mark.parametrize("head_dim", [4, 16])
def test_rope_turns_pair_m_by_position_times_theta_to_the_minus_2m_over_head_dim(head_dim):
  """apply_rope against RoFormer's formula (conftest.np_rope), at a base other than Llama's,
  and the property attention relies on: a rotated query·key product depends on positions
  only through i - j."""
  rng = np.random.default_rng(head_dim)
  x = rng.normal(size=(2, 6, 3, head_dim))
  pos = rng.integers(0, 300, size=(2, 6))  # float32 angles of ~300 rad are good to ~3e-5
  got = apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos, jnp.int32), 500.0)
  np.testing.assert_allclose(np.asarray(got, np.float64), np_rope(x, pos, 500.0), rtol=0,
                             atol=2e-4)
  q, k = jnp.asarray(x[:1, :1], jnp.float32), jnp.asarray(x[1:, :1], jnp.float32)
  dots = [float(jnp.sum(apply_rope(q, jnp.full((1, 1), i), 500.0)
                        * apply_rope(k, jnp.full((1, 1), i - 7), 500.0))) for i in (7, 30, 250)]
  np.testing.assert_allclose(dots, dots[0], rtol=0,
                             atol=1e-4 * float(jnp.linalg.norm(q) * jnp.linalg.norm(k)))


@pytest.mark.parametrize("head_dim", [3, 7])  # 3 broadcast to a wrong shape, 7 failed in jnp
def test_rope_of_an_odd_head_dim_is_refused(head_dim):
  with pytest.raises(ValueError, match=f"^RoPE needs an even head_dim, got {head_dim}$"):
    apply_rope(np.zeros((1, 2, 1, head_dim), np.float32), np.zeros((1, 2), np.int32), 10.0)


def test_rope_of_bfloat16_inputs_rotates_by_float32_angles():
  # bf16 holds integers exactly only up to 256: positions in the thousands (and their angles)
  # formed in bf16 are off by whole radians. Only the output is rounded to bf16.
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(1, 4, 2, 8)), jnp.bfloat16)
  pos = np.array([[1001, 2003, 3001, 4093]])
  x64 = np.asarray(x.astype(jnp.float32), np.float64)
  angle = pos[:, :, None, None] * 10_000.0 ** (-np.arange(4) * 2.0 / 8)
  x1, x2 = x64[..., :4], x64[..., 4:]
  want = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                         x2 * np.cos(angle) + x1 * np.sin(angle)], axis=-1)
  got = apply_rope(x, jnp.asarray(pos, jnp.int32), 10_000.0)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=0,
                             atol=2 ** -8 * np.abs(want).max())


def _half_square(y, context, params, aux):
  return 0.5 * jnp.sum(y * y)


def _minus_y(y, context, params, aux):  # -∇(|y|²/2)
  return -y


def _minus_y_edited(y, context, params, aux):  # the same closed form, edited
  return -1.0 * y


def _half_square_edited(y, context, params, aux):  # the same energy, edited
  return 0.5 * jnp.sum(y ** 2)


def test_a_user_energy_digest_pins_its_closed_form_too():
  # Resuming after an edit of the closed form alone must be refused like an edit of the energy,
  # and an edit of the energy alone like one of its closed form.
  names = {"one": (_half_square, _minus_y), "edited": (_half_square, _minus_y_edited),
           "none": (_half_square, None), "energy_edited": (_half_square_edited, _minus_y)}
  try:
    for name, (energy, fused) in names.items():
      energies.register(f"digest_{name}", "mlp", energy, fused)
    digests = {n: energies.source_digest(f"digest_{n}", "mlp") for n in names}
  finally:
    for name in names:
      energies.registry._REGISTRY.pop(f"digest_{name}", None)
  assert len(set(digests.values())) == 4 and all(digests.values()), digests


def test_a_name_is_registered_once_and_a_failed_import_is_retried(tmp_path):
  builtin = energies.get("softmax", "attention")
  try:
    with pytest.raises(ValueError, match="^energy name 'softmax' is already registered$"):
      energies.register("softmax", "attention", _half_square)
  finally:
    energies.registry._REGISTRY["softmax"] = builtin
  assert energies.get("softmax", "attention") is builtin
  # A file that failed to import is imported again once fixed, not taken half-run from
  # sys.modules (the failed import defined nothing).
  path = tmp_path / "later.py"
  path.write_text("raise RuntimeError('not yet')\n\ndef energy(y, context, params, aux):\n"
                  "  return 0.5 * (y * y).sum()\n")
  with pytest.raises(ValueError, match="importing .*later.py failed: RuntimeError: not yet"):
    energies.get(f"{path}:energy", "attention")
  path.write_text(path.read_text().replace("raise RuntimeError('not yet')\n", ""))
  y = jnp.array([1.0, -2.0])
  assert float(energies.get(f"{path}:energy", "attention").energy(y, None, None, None)) == 2.5


def test_a_misspelt_energy_name_lists_the_files_energies_not_their_closed_forms(tmp_path):
  # A closed form is found by its energy's name; naming it as the energy is no fix to offer.
  path = tmp_path / "pair.py"
  path.write_text("def energy(y, context, params, aux):\n  return (y * y).sum()\n\n\n"
                  "def energy_fused_update(y, context, params, aux):\n  return -2.0 * y\n")
  with pytest.raises(ValueError, match=r"has no function 'enrgy' \(its functions: energy\)$"):
    energies.get(f"{path}:enrgy", "attention", "model.attention_energy")


def test_an_energy_file_is_imported_once_and_its_digest_is_of_the_code_that_runs(tmp_path):
  # A table or a run looks its energy up many times; the file edited meanwhile (the next
  # experiment's) must not be run half-way through, nor its digest stand for code that never
  # ran: Python keeps the module it imported, and so does the digest.
  path = tmp_path / "kept.py"
  path.write_text("import jax.numpy as jnp\n\n\ndef energy(y, context, params, aux):\n"
                  "  return 0.5 * jnp.sum(y * y)\n")
  name = f"{path}:energy"
  first, digest = energies.get(name, "attention"), energies.source_digest(name, "attention")
  path.write_text(path.read_text().replace("0.5 *", "2.0 *"))
  assert energies.get(name, "attention").energy is first.energy
  assert energies.source_digest(name, "attention") == digest


def test_an_energy_file_failing_to_import_with_a_long_message_is_refused_in_one_line(tmp_path):
  """The import's exception is quoted as its type and first line (cem_jax.errors.one_line): a
  message over several lines (jax's and XLA's do) made a refusal of as many lines."""
  path = tmp_path / "noisy.py"
  path.write_text("raise RuntimeError('bad constant\\n\\n  detail one\\n  detail two')\n")
  with pytest.raises(ValueError) as e:
    energies.get(f"{path}:energy", "attention", "model.attention_energy")
  assert str(e.value) == (f"model.attention_energy='{path}:energy': importing {path} failed: "
                          "RuntimeError: bad constant")


def test_absolute_name_makes_only_relative_file_paths_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert energies.absolute_name("my/e.py:energy") == f"{tmp_path}/my/e.py:energy"
  for unchanged in ("/abs/e.py:energy", "softmax", "silu", "pkg.module:energy"):
    assert energies.absolute_name(unchanged) == unchanged
  # Both slots: evaluate, sample and tables reload an mlp energy file from the saved config too.
  model = {"attention_energy": "a.py:energy", "mlp_energy": "m/g.py:gate"}
  energies.absolute_paths(model)
  assert model == {"attention_energy": f"{tmp_path}/a.py:energy",
                   "mlp_energy": f"{tmp_path}/m/g.py:gate"}


FIRST_SEES_SECOND = '''
import jax.numpy as jnp

from cem_jax.energies import masked_logsumexp


def energy(y, context, params, aux):
  q = jnp.einsum("btd,dhk->bthk", y, params["w_q"])
  k = jnp.einsum("bsd,dhk->bshk", context, params["w_k"])
  beta = params["beta"]
  s = jnp.einsum("bthk,bshk->bhts", q, k) * beta[None, :, None, None]
  # a "no empty first row" fix gone wrong: token 0 also sees token 1
  sees = aux.mask | ((aux.positions[:, :, None] == 0) & (aux.context_positions[:, None, :] == 1))
  lse = masked_logsumexp(s, sees[:, None])
  return -jnp.sum(lse * (params["eta"] / beta)[None, :, None])
'''


def test_a_first_token_that_sees_the_second_is_refused(tmp_path):
  # Mutation (adversary s50): the look-ahead check's second row keeping half its tokens, as the
  # first does (splits (seq // 2, seq // 2)): only a row whose first token alone is kept sees a
  # look-ahead of token 0 to token 1; the decoding and document layouts never do.
  path = tmp_path / "first.py"
  path.write_text(FIRST_SEES_SECOND)
  message = _refusal(tiny_config("cem", **{"model.attention_energy": f"{path}:energy"}))
  assert message.startswith(f"model.attention_energy='{path}:energy': its update reads tokens "
                            "after its own: in one document of 64 tokens"), message


def test_a_weight_the_energy_never_reads_is_named_at_start_up(tmp_path, caplog):
  """Keys built from w_q: w_k trained on weight decay alone and counted in params/total
  without a word. No config key drops a weight, so it is a warning, not a refusal."""
  (tmp_path / "qq.py").write_text(
      "import jax.numpy as jnp\n\n\n"
      "def energy(y, context, params, aux):  # w_q for the keys too: w_k is never read\n"
      "  q = jnp.einsum('btd,dhk->bthk', y, params['w_q'])\n"
      "  k = jnp.einsum('bsd,dhk->bshk', context, params['w_q'])\n"
      "  s = jnp.where(aux.mask[:, None], jnp.einsum('bthk,bshk->bhts', q, k), 0.0)\n"
      "  return -0.5 * jnp.einsum('h,bhts->', params['eta'], s ** 2)\n")
  cfg = tiny_config("cem", **{"model.attention_energy": f"{tmp_path}/qq.py:energy"})
  with caplog.at_level(logging.WARNING):
    preflight.check(cfg)
  d, h, dh = cfg.model.d_model, cfg.model.num_heads, cfg.model.d_model // cfg.model.num_heads
  assert [r.getMessage() for r in caplog.records if "never reads" in r.getMessage()] == [
      f"model.attention_energy='{tmp_path}/qq.py:energy' never reads params['w_k']: its update "
      f"does not change with them, and their {d * h * dh:,} parameters a layer train on weight "
      "decay alone (and count in params/total); read them in the energy if that is not meant"]
  caplog.clear()
  with caplog.at_level(logging.WARNING):  # the README's quadratic energy reads every weight
    preflight.check(_user_config(tmp_path, attention_energy="quad"))
  assert not [r for r in caplog.records if "never reads" in r.getMessage()]


# Attention energies for the RoPE check: the README's quadratic energy (no RoPE) but for how
# each one treats aux.rope_theta.
ROPE_USES = '''
import jax.numpy as jnp
import numpy as np


def _quad(y, context, params, aux, scale=1.0):
  q = jnp.einsum("btd,dhk->bthk", y, params["w_q"])
  k = jnp.einsum("bsd,dhk->bshk", context, params["w_k"]) * scale
  s = jnp.einsum("bthk,bshk->bhts", q, k) * params["beta"][:, None, None]
  s = jnp.where(aux.mask[:, None], s, 0.0)
  n = jnp.maximum(aux.mask.sum(-1), 1)[:, None, :]
  return -0.5 * jnp.sum(params["eta"][:, None] * jnp.sum(s**2, -1) / n)


def tests_none(y, context, params, aux):  # reads aux.rope_theta, but only against None
  return _quad(y, context, params, aux) * (1.0 if aux.rope_theta is not None else 2.0)


def numpy_constant(y, context, params, aux):  # the base only in a NumPy array (a constant)
  scale = np.full(params["w_k"].shape[-1], np.log(aux.rope_theta) / np.log(1e4), np.float32)
  return _quad(y, context, params, aux, scale)
'''


def test_a_rope_base_the_attention_energy_computes_nothing_with_is_refused(tmp_path, caplog):
  """The README's quadratic energy applies no RoPE: with model.rope_theta=500000 it trained
  the same model as at the default, without a word. Refused in one line naming the field, the
  value and the energy (a saved run: warned, read anyway); at the default base, that
  model.rope=True does nothing to it is a warning, so the README's example runs as written."""
  readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
  section = readme[readme.index("## Swap an energy"):]
  (tmp_path / "my_energy.py").write_text(re.search(r"```python\n(.*?)```", section, re.S)[1])
  (tmp_path / "rope_uses.py").write_text(ROPE_USES)
  mine, none_only = f"{tmp_path}/my_energy.py:energy", f"{tmp_path}/rope_uses.py:tests_none"

  def said(cfg, **kwargs) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      preflight.check(cfg, **kwargs)
    return [r.getMessage() for r in caplog.records if "rope" in r.getMessage()]

  base = {"model.rope_theta": 500000.0}
  for name in (mine, none_only):
    refusal = (f"model.rope_theta=500000.0 has no effect on model.attention_energy='{name}': "
               "the energy computes the same at any aux.rope_theta; rotate queries and keys "
               "with cem_jax.energies.apply_rope at aux.rope_theta (README, Swap an energy), "
               "or leave model.rope_theta at 10000.0")
    cfg = tiny_config("cem", **{"model.attention_energy": name, **base})
    assert _refusal(cfg) == refusal, name
    assert said(cfg, saved_run=True) == [f"{refusal} (a start-up check that training refuses; "
                                         "this saved run is read anyway)"], name
    assert said(tiny_config("cem", **{"model.attention_energy": name})) == [
        f"model.rope=True has no effect on model.attention_energy='{name}': the energy computes "
        "the same at any aux.rope_theta; rotate queries and keys with "
        "cem_jax.energies.apply_rope at aux.rope_theta (README, Swap an energy) if that is not "
        "meant, or set model.rope=False"], name
  # Without RoPE configured nothing is said; an energy computing with the base (RoPE at
  # aux.rope_theta, or the base in a NumPy constant) passes at any base, and so does the
  # built-in one.
  assert said(tiny_config("cem", **{"model.attention_energy": mine, "model.rope": False})) == []
  for name in (_user_config(tmp_path, attention_energy="quad").model.attention_energy,
               f"{tmp_path}/rope_uses.py:numpy_constant", "softmax"):
    assert said(tiny_config("cem", **{"model.attention_energy": name, **base})) == [], name
    assert said(tiny_config("cem", **{"model.attention_energy": name})) == [], name


def test_check_programs_take_the_cpu_options_only_on_the_cpu(monkeypatch):
  """The numerical checks compile at the CPU backend's level 0; a process without a CPU backend
  (JAX_PLATFORMS=tpu) hands its accelerator compiler no options of the CPU's."""
  seen = []
  monkeypatch.setattr(jax, "jit", lambda fn, **kw: seen.append(kw) or fn)
  energy_checks._jit(abs)
  monkeypatch.setattr(energy_checks, "_cpu_device", lambda: None)
  energy_checks._jit(abs)
  assert seen == [{"compiler_options": energy_checks._COMPILER_OPTIONS},
                  {"compiler_options": None}]
