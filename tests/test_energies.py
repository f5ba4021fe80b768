"""Energies and their updates: closed forms equal jax.grad, Φ is exact, masking is safe."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import quadrature_phi_silu

from cem_jax import energies, updates
from cem_jax.energies import EnergyAux, interaction_energy, interaction_fused_update, make_mask

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


def test_phi_silu_matches_quadrature():
  z32 = np.concatenate([np.linspace(-30, 30, 240), [1e-4, -1e-4, 1e-2, -0.7, 1.999, 2.001]])
  z32 = z32.astype(np.float32)
  ref = quadrature_phi_silu(z32)
  got = np.asarray(energies.phi_silu(jnp.asarray(z32)), np.float64)
  assert np.max(np.abs(got - ref) / np.abs(ref)) <= 1e-6
  assert float(energies.phi_silu(jnp.float32(0.0))) == 0.0


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
  h1, h2 = 1e-4, 1e-3
  fd1 = (quadrature_phi_silu(z + h1) - quadrature_phi_silu(z - h1)) / (2 * h1)
  fd2 = (quadrature_phi_silu(z + h2) - 2 * quadrature_phi_silu(z)
         + quadrature_phi_silu(z - h2)) / h2**2
  np.testing.assert_allclose(first, fd1, rtol=1e-7, atol=1e-9)
  np.testing.assert_allclose(second, fd2, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(first, (own[1] - own[0]) / (2 * 1e-4), rtol=1e-7, atol=1e-9)
  z32 = jnp.linspace(-12.0, 12.0, 97)  # float32, the training dtype: finite to third order
  assert bool(jnp.all(jnp.isfinite(jax.vmap(jax.grad(jax.grad(jax.grad(energies.phi_silu))))(
      z32))))


@pytest.mark.parametrize("potential", ["gelu", "relu", "relu2"])
def test_other_potentials_differentiate_to_their_activation(potential):
  phi, act = energies.POTENTIALS[potential]
  z = jnp.linspace(-4.0, 4.0, 81)
  np.testing.assert_allclose(jax.vmap(jax.grad(phi))(z), act(z), rtol=1e-5, atol=1e-6)
  assert abs(float(phi(jnp.float32(0.0)))) < 1e-7


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
  g = jax.grad(lambda s: jnp.sum(energies.masked_logsumexp(s, mask)))(scores)
  h = jax.hessian(lambda s: jnp.sum(energies.masked_logsumexp(s, mask)))(scores)
  assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.all(jnp.isfinite(h)))
  np.testing.assert_array_equal(np.asarray(g)[1], 0.0)


def test_registry_lookup_and_errors():
  assert energies.get("softmax", "attention").fused_update is not None
  assert set(energies.names("mlp")) >= {"silu", "gelu", "relu", "relu2"}
  with pytest.raises(ValueError, match="model.mlp_energy='nope' is not a registered mlp"):
    energies.get("nope", "mlp", "model.mlp_energy")
  with pytest.raises(ValueError, match="is a attention energy, not a mlp energy"):
    energies.get("softmax", "mlp")
  with pytest.raises(ValueError, match="cannot import module"):
    energies.get("no_such_module_xyz:energy", "attention")
  with pytest.raises(ValueError, match="has no closed-form update"):
    updates.resolve_update(energies.EnergySpec("u", "mlp", lambda *a: 0.0), "fused")


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

