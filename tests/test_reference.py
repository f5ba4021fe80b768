"""cem_jax against an independent float64 NumPy reference written from CEM_MATH.md §1-5.

The ``ref_*`` functions import nothing from cem_jax: they spell the maths out position by
position and head by head (explicit RoPE rotation matrices, an explicit softmax, dense P,
Φ by quadrature), so they share no code, layout or trick (augmented heads, ``is_causal``,
``jax.grad``) with the library. The tests feed both the same random, non-initial values
(η ≠ 1, β ≠ 1/√d_h, nonzero diagonals, P ≠ I with rank > 0, RMSNorm scales ≠ 1) and compare
the library in float32, through both its fused and its autodiff paths, with the reference
to ~1e-5 relative (of the largest reference entry).

If a test here fails after a change, the change altered what a layer computes, not just how:
an energy, an update, a mask, RoPE, the preconditioner or the order of Algorithm 1. Find which
reference the failing test names and decide whether the maths was meant to change; if it was,
change CEM_MATH.md and the reference together.
"""

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cem_jax import energies, updates
from cem_jax.config import get_default_config
from cem_jax.layers import CEMBlock, LlamaBlock
from cem_jax.model import DecoderLM, training_aux

B, N, D, H, F = 2, 8, 16, 2, 24  # batch, seq_len, d_model, num_heads, mlp_dim
DH = D // H
TOL = 1e-5
# Two packed documents and a padded tail: rows 0, 3 (strict) and the padding see no key.
SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 0, 0, 0]])


def _rng(name: str) -> np.random.Generator:
  """A generator seeded by a fixed function of ``name`` (crc32, not ``hash``)."""
  return np.random.default_rng(zlib.crc32(name.encode()))


def _rel(got, ref) -> float:
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


# ---------------------------------------------------------------------------------------------
# The reference (float64 NumPy; nothing from cem_jax).


def softplus(v):
  return np.logaddexp(0.0, v)


def ref_rms_norm(x, scale, eps):
  """RMSNorm: ``x / sqrt(mean(x²) + eps) · scale`` over the last axis."""
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def ref_rms_norm_vjp(x, scale, eps, v):
  """``J(x)ᵀ v`` for ``g = ref_rms_norm(x)``: ``∂g_m/∂x_n = s_m (δ_mn / r - x_m x_n / (d r³))``."""
  d = x.shape[-1]
  r = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return scale * v / r - x * np.sum(v * scale * x, axis=-1, keepdims=True) / (d * r**3)


def ref_rope_matrix(position, dim, theta):
  """The RoPE rotation ``R_i``: pair ``(m, m + dim/2)`` turned by ``i · theta^(-2m/dim)``."""
  half = dim // 2
  r = np.zeros((dim, dim))
  for m in range(half):
    angle = position * theta ** (-2.0 * m / dim)
    r[m, m] = r[m + half, m + half] = math.cos(angle)
    r[m, m + half] = -math.sin(angle)
    r[m + half, m] = math.sin(angle)
  return r


def ref_mask(segment_ids, batch, n, strict):
  """``N(i)``: ``j <= i`` (``j < i`` if strict), same document, neither token padding (0)."""
  mask = np.zeros((batch, n, n), bool)
  for b in range(batch):
    for i in range(n):
      for j in range(n):
        visible = j < i if strict else j <= i
        if segment_ids is not None:
          visible = visible and segment_ids[b, i] == segment_ids[b, j] and segment_ids[b, i] > 0
        mask[b, i, j] = visible
  return mask


def ref_attention(y, c, w_q, w_k, eta, beta, diag, form, mask, q_pos, k_pos, theta):
  """The interaction energy and its update ``-∇_y E`` (CEM_MATH.md §1).

  ``E = -Σ_{b,i,k} (η_k/β_k) log Σ_{j∈N(i)} exp(β_k s_k(y_i, c_j))`` with
  ``s_k = <R_i W_Qk y, R_j W_Kk c>`` plus ``Σ_m d_km y_m c_m`` (bilinear) or
  ``-½ Σ_m d_km (y_m - c_m)²`` (distance); ``-∇_{y_i} E = Σ_k η_k Σ_j a_ij ∇_y s_k``.
  Shapes: ``y [b, t, d]``, ``c [b, s, d]``, ``w_q, w_k [d, h, dh]``, ``diag [h, d]`` or None,
  ``mask [b, t, s]``. Returns ``(energy, update)``; a row with no visible key adds 0 to both.
  """
  batch, t, d = y.shape
  heads, dh = w_q.shape[1], w_q.shape[2]
  energy, update = 0.0, np.zeros_like(y)
  for b in range(batch):
    for i in range(t):
      visible = np.flatnonzero(mask[b, i])
      if visible.size == 0:
        continue
      for k in range(heads):
        wq, wk = w_q[:, k, :].T, w_k[:, k, :].T  # W_Qk, W_Kk: [dh, d]
        rot_i = ref_rope_matrix(q_pos[b, i], dh, theta) if theta else np.eye(dh)
        q = rot_i @ wq @ y[b, i]
        keys = np.stack([(ref_rope_matrix(k_pos[b, j], dh, theta) if theta else np.eye(dh))
                         @ wk @ c[b, j] for j in visible])  # rotated keys [n, dh]
        scores = keys @ q
        grads = keys @ rot_i @ wq  # row j: ∇_y <R_i W_Q y, k_j> = W_Qᵀ R_iᵀ k_j
        if diag is not None:
          ctx = c[b, visible]
          if form == "bilinear":
            scores = scores + ctx @ (diag[k] * y[b, i])
            grads = grads + diag[k] * ctx
          else:
            scores = scores - 0.5 * np.sum(diag[k] * (y[b, i] - ctx) ** 2, axis=-1)
            grads = grads + diag[k] * (ctx - y[b, i])
        z = beta[k] * scores
        lse = z.max() + np.log(np.sum(np.exp(z - z.max())))
        energy -= eta[k] / beta[k] * lse
        update[b, i] += eta[k] * np.exp(z - lse) @ grads
  return energy, update


def ref_activation(name, z):
  if name == "silu":
    return z / (1.0 + np.exp(-z))
  if name == "gelu":
    return 0.5 * z * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
  if name == "relu":
    return np.maximum(z, 0.0)
  if name == "relu2":
    return np.maximum(z, 0.0) ** 2
  raise ValueError(name)


_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(200)


def ref_phi(name, z):
  """``Φ(z) = ∫_0^z activation`` by 200-point Gauss-Legendre quadrature (float64)."""
  z = np.asarray(z, np.float64)
  s = z[..., None] * (_GL_NODES + 1.0) / 2.0
  return z / 2.0 * np.sum(_GL_WEIGHTS * ref_activation(name, s), axis=-1)


def ref_mlp(y, x, w, g, eta, name):
  """``E = -η Σ (G x)_m Φ((W y)_m)`` and ``-∇_y E = η Wᵀ(Φ'(W y) ⊙ G x)`` (CEM_MATH.md §2).

  ``y, x [b, t, d]``, ``w, g [d, f]``; the gate reads ``x`` (the conditioning input).
  """
  pre, gate = y @ w, x @ g
  return -eta * np.sum(gate * ref_phi(name, pre)), eta * (ref_activation(name, pre) * gate) @ w.T


def ref_precondition(v, p, u, eps):
  """``P v`` with the dense ``P = diag(softplus(p) + eps) + U Uᵀ`` (CEM_MATH.md §3)."""
  matrix = np.diag(softplus(p) + eps)
  if u is not None:
    matrix = matrix + u @ u.T
  return np.einsum("mn,...n->...m", matrix, v)


def ref_block(x, prm, cfg, mask, pos):
  """One CEM layer, Algorithm 1 of CEM_MATH.md §4, from the parameters in ``prm``.

  ``prm``: ``'attn.w_q'``-style names -> float64 arrays (the block's raw parameters);
  ``cfg``: the model config (options only). Returns ``y [b, n, d]``.
  """
  eps, h = cfg.norm_eps, cfg.num_heads
  dh = cfg.d_model // h
  theta = cfg.rope_theta if cfg.rope else None

  def view(name, v):
    return v if cfg.norm_mode == "none" else ref_rms_norm(v, prm[f"{name}.scale"], eps)

  def pick(name, t, per_step):  # per-step copies: step t uses copy t, beyond the last the last
    # How many copies there are is the config's (eta_per_step, precond_shared), not read off
    # the library's array: a layer that made the wrong number would otherwise pass.
    arr = prm[name]
    copies = cfg.num_steps if per_step else 1
    assert arr.shape[0] == copies, (name, arr.shape, copies)
    return arr[min(t, copies - 1)]

  def step(update_fn, sub, y, t):  # sub: 'attention' or 'mlp'
    norm = "norm_att" if sub == "attention" else "norm_mlp"
    if cfg.norm_mode == "chain":
      u = ref_rms_norm_vjp(y, prm[f"{norm}.scale"], eps,
                           update_fn(ref_rms_norm(y, prm[f"{norm}.scale"], eps)))
    else:
      u = update_fn(view(norm, y))
    if cfg.precond in (sub, "both"):
      pc = "precond_att" if sub == "attention" else "precond_mlp"
      per_step = not cfg.precond_shared
      u = ref_precondition(u, pick(f"{pc}.p", t, per_step),
                           pick(f"{pc}.u", t, per_step) if cfg.precond_rank else None,
                           cfg.precond_eps)
    return u

  def att(y, ctx, t):
    eta = softplus(pick("attn.eta", t, cfg.eta_per_step)) if cfg.learn_eta else np.ones(h)
    beta = softplus(prm["attn.beta"]) if cfg.learn_beta else np.full(h, dh**-0.5)
    diag = None
    if cfg.diagonal != "none":
      diag = np.broadcast_to(prm["attn.diag"], (h, cfg.d_model))

    def update_fn(g):
      return ref_attention(g, ctx, prm["attn.w_q"], prm["attn.w_k"], eta, beta, diag,
                           cfg.diagonal_form, mask, pos, pos, theta)[1]

    return step(update_fn, "attention", y, t)

  def mlp(y, gate, t):
    eta = softplus(pick("mlp.eta", t, cfg.eta_per_step)) if cfg.learn_eta else 1.0

    def update_fn(g):
      return ref_mlp(g, gate, prm["mlp.w"], prm["mlp.g"], eta, cfg.mlp_energy)[1]

    return step(update_fn, "mlp", y, t)

  context = view("norm_att", x)
  y = x
  for t in range(cfg.num_steps):
    if cfg.context == "coevolve" and t > 0:
      context = view("norm_att", y)
    if cfg.split == "joint":
      gate = view("norm_mlp", x if cfg.mlp_condition == "layer" else y)
      y = y + att(y, context, t) + mlp(y, gate, t)
    else:
      y = y + att(y, context, t)
      gate = view("norm_mlp", x if cfg.mlp_condition == "layer" else y)
      y = y + mlp(y, gate, t)
  return y


def ref_llama_block(x, prm, cfg, mask, pos):
  """The pre-norm Llama block ``h = x + attn(norm(x)); h + W_down(silu(W_gate z) ⊙ W_up z)``,
  ``z = norm(h)``, with untied ``W_Q, W_K, W_V, W_O``, RoPE on ``q`` and ``k`` only and
  ``1/√d_h`` scaling; a query row with no visible key outputs 0."""
  heads, dh = prm["attn.w_q"].shape[1:]
  theta = cfg.rope_theta if cfg.rope else None
  z = ref_rms_norm(x, prm["norm_att.scale"], cfg.norm_eps)
  att = np.zeros_like(x)
  for b in range(x.shape[0]):
    for i in range(x.shape[1]):
      visible = np.flatnonzero(mask[b, i])
      if visible.size == 0:
        continue
      for k in range(heads):
        rot = [ref_rope_matrix(pos[b, j], dh, theta) if theta else np.eye(dh)
               for j in range(x.shape[1])]
        q = rot[i] @ prm["attn.w_q"][:, k, :].T @ z[b, i]
        keys = np.stack([rot[j] @ prm["attn.w_k"][:, k, :].T @ z[b, j] for j in visible])
        values = z[b, visible] @ prm["attn.w_v"][:, k, :]
        scores = keys @ q / math.sqrt(dh)
        a = np.exp(scores - scores.max())
        att[b, i] += (a / a.sum()) @ values @ prm["attn.w_o"][k]
  h = x + att
  z = ref_rms_norm(h, prm["norm_mlp.scale"], cfg.norm_eps)
  return h + (ref_activation("silu", z @ prm["mlp.w_gate"]) * (z @ prm["mlp.w_up"])) @ (
      prm["mlp.w_down"])


def test_reference_updates_are_the_gradients_of_the_reference_energies():
  """The reference's closed forms are -∇ of its energies (central differences, float64)."""
  rng = _rng("reference-self-check")
  b, t, d, h, dh, f = 1, 4, 6, 2, 4, 5
  y, c = rng.standard_normal((b, t, d)), rng.standard_normal((b, t, d))
  w_q, w_k = 0.5 * rng.standard_normal((2, d, h, dh))
  eta, beta, diag = np.array([0.7, 1.3]), np.array([0.4, 0.9]), 0.5 * rng.standard_normal((h, d))
  mask = ref_mask(np.array([[1, 1, 2, 2]]), b, t, strict=False)
  pos = np.array([[0, 3, 5, 6]])
  w, g = 0.6 * rng.standard_normal((2, d, f))

  def energies_and_updates(y_):
    out = [ref_attention(y_, c, w_q, w_k, eta, beta, diag, form, mask, pos, pos, 10.0)
           for form in ("bilinear", "distance")]
    return out + [ref_mlp(y_, c, w, g, 0.8, name) for name in ("silu", "gelu", "relu2")]

  analytic = [u for _, u in energies_and_updates(y)]
  numeric = [np.zeros_like(y) for _ in analytic]
  step = 1e-5
  for idx in np.ndindex(y.shape):
    dy = np.zeros_like(y)
    dy[idx] = step
    plus, minus = energies_and_updates(y + dy), energies_and_updates(y - dy)
    for n, (ep, em) in enumerate(zip(plus, minus, strict=True)):
      numeric[n][idx] = -(ep[0] - em[0]) / (2 * step)
  for a, n in zip(analytic, numeric, strict=True):
    np.testing.assert_allclose(a, n, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Energies and updates.


def _attention_case(name, diag_form, rope):
  rng = _rng(name)
  params = {
      "w_q": 0.4 * rng.standard_normal((D, H, DH)),
      "w_k": 0.4 * rng.standard_normal((D, H, DH)),
      "eta": rng.uniform(0.4, 1.6, H),
      "beta": rng.uniform(0.2, 0.7, H),
  }
  if diag_form != "none":
    params["diag"] = 0.4 * rng.standard_normal((H, D))
  theta = 100.0 if rope else None  # a small base turns every pair of dimensions visibly
  return rng.standard_normal((B, N, D)), rng.standard_normal((B, N, D)), params, theta


MASKINGS = ["causal", "segments", "strict_segments", "decode"]


@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("diag_form", ["none", "bilinear", "distance"])
@pytest.mark.parametrize("rope", [False, True])
def test_attention_energy_and_update_match_reference(masking, diag_form, rope):
  y, c, params, theta = _attention_case(f"attention-{masking}-{diag_form}-{rope}", diag_form,
                                        rope)
  q_pos = k_pos = np.broadcast_to(np.arange(N), (B, N))
  form = "bilinear" if diag_form == "none" else diag_form
  if masking == "decode":  # cached decoding: the last 3 tokens query the whole context
    y, q_pos = y[:, -3:], q_pos[:, -3:]
    ref_m = q_pos[:, :, None] >= k_pos[:, None, :]
    lib_mask, plain = jnp.asarray(ref_m), False
  else:
    seg = None if masking == "causal" else SEGMENTS
    strict = masking == "strict_segments"
    ref_m = ref_mask(seg, B, N, strict)
    lib_mask = energies.make_mask(None if seg is None else jnp.asarray(seg), N, B, strict=strict)
    plain = masking == "causal"
  ref_e, ref_u = ref_attention(y, c, params["w_q"], params["w_k"], params["eta"],
                               params["beta"], params.get("diag"), form, ref_m, q_pos, k_pos,
                               theta)
  aux = energies.EnergyAux(mask=lib_mask, positions=jnp.asarray(q_pos, jnp.int32),
                           key_positions=jnp.asarray(k_pos, jnp.int32), rope_theta=theta,
                           diagonal_form=form, is_plain_causal=plain)
  args = (jnp.asarray(y, jnp.float32), jnp.asarray(c, jnp.float32),
          {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}, aux)
  spec = energies.get("softmax", "attention")
  assert abs(float(spec.energy(*args)) - ref_e) / abs(ref_e) <= TOL
  for mode in ("fused", "autodiff"):
    got = updates.resolve_update(spec, mode)(*args)
    assert _rel(got, ref_u) <= TOL, mode
    empty = ~ref_m.any(-1)
    assert np.all(np.asarray(got)[empty] == 0.0), mode


@pytest.mark.parametrize("mode,block_size", [("fused", 0), ("autodiff", 0), ("autodiff", 4)])
def test_attention_update_derivatives_in_every_input_match_reference(mode, block_size):
  """Training differentiates the update w.r.t. the context and every weight (the context is
  held fixed only in that the energy is differentiated in ``y``): each directional derivative
  of the update, fused or ``jax.grad`` of the energy (dense or blockwise), equals float64
  central differences of ``ref_attention``. A ``stop_gradient`` on the keys or the context in
  ``_project`` changes no update, nor any check comparing the two paths; nor does one on the
  context in the energy's diagonal term, and tests/test_layers.py's comparison of the two
  paths' training gradients starts from the diagonal's initial 0, where that term has none."""
  y, c, params, theta = _attention_case("attention-derivatives", "distance", rope=True)
  rng = _rng("attention-derivatives-directions")
  ref_m = ref_mask(SEGMENTS, B, N, strict=True)
  pos = np.broadcast_to(np.arange(N), (B, N))
  primals = {"y": y, "c": c, **params}
  names = list(primals)  # y, c, w_q, w_k, eta, beta, diag: one direction each

  def ref_update(p):
    return ref_attention(p["y"], p["c"], p["w_q"], p["w_k"], p["eta"], p["beta"], p["diag"],
                         "distance", ref_m, pos, pos, theta)[1]

  step, want = 1e-5, []
  directions = {n: np.zeros((len(names),) + np.shape(v)) for n, v in primals.items()}
  for i, name in enumerate(names):
    directions[name][i] = rng.standard_normal(np.shape(primals[name]))
    plus = {n: v + step * directions[n][i] for n, v in primals.items()}
    minus = {n: v - step * directions[n][i] for n, v in primals.items()}
    want.append((ref_update(plus) - ref_update(minus)) / (2 * step))
  aux = energies.EnergyAux(mask=jnp.asarray(ref_m), positions=jnp.asarray(pos, jnp.int32),
                           rope_theta=theta, diagonal_form="distance", strict_causal=True,
                           energy_block_size=block_size)
  update = updates.resolve_update(energies.get("softmax", "attention"), mode)

  def derivative(t):
    def f(p):
      return update(p["y"], p["c"], {n: p[n] for n in params}, aux)
    return jax.jvp(f, ({n: jnp.asarray(v, jnp.float32) for n, v in primals.items()},), (t,))[1]

  got = jax.jit(jax.vmap(derivative))({n: jnp.asarray(v, jnp.float32)
                                       for n, v in directions.items()})
  for i, name in enumerate(names):
    assert _rel(got[i], want[i]) <= TOL, (name, _rel(got[i], want[i]))


@pytest.mark.parametrize("potential", sorted(energies.POTENTIALS))
def test_mlp_energy_and_update_match_reference(potential):
  rng = _rng(f"mlp-{potential}")
  y, x = 1.5 * rng.standard_normal((2, B, N, D))
  params = {"w": 0.5 * rng.standard_normal((D, F)), "g": 0.5 * rng.standard_normal((D, F)),
            "eta": np.float64(0.73)}
  ref_e, ref_u = ref_mlp(y, x, params["w"], params["g"], params["eta"], potential)
  spec = energies.get(potential, "mlp")
  args = (jnp.asarray(y, jnp.float32), jnp.asarray(x, jnp.float32),
          {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}, None)
  assert abs(float(spec.energy(*args)) - ref_e) / abs(ref_e) <= TOL
  for mode in ("fused", "autodiff"):
    assert _rel(updates.resolve_update(spec, mode)(*args), ref_u) <= TOL, mode


def test_precondition_matches_dense_reference():
  rng = _rng("precondition")
  v = rng.standard_normal((B, N, D))
  p, u = rng.standard_normal(D), 0.5 * rng.standard_normal((D, 3))
  for eps, low_rank in ((1e-3, u), (0.05, u), (0.05, None)):
    got = updates.precondition(jnp.asarray(v, jnp.float32), jnp.asarray(p, jnp.float32),
                               None if low_rank is None else jnp.asarray(low_rank, jnp.float32),
                               eps)
    assert _rel(got, ref_precondition(v, p, low_rank, eps)) <= TOL


def test_preconditioner_diagonal_of_a_bfloat16_update_is_computed_in_float32():
  """``softplus(p) + eps`` comes from the float32 ``p`` in float32 and is rounded to bfloat16
  once, then multiplies the bf16 update: each entry is within 2 bf16 ulps of the float64
  reference at the same (bf16) update (measured 1.35). With softplus evaluated in bfloat16
  it is off by 3.0."""
  rng = _rng("precondition-bf16")
  d, eps = 256, 1e-3
  v = jnp.asarray(rng.standard_normal((64, d)), jnp.bfloat16)
  p = jnp.asarray(2.0 * rng.standard_normal(d), jnp.float32)
  got = updates.precondition(v, p, None, eps)
  assert got.dtype == jnp.bfloat16
  ref = ref_precondition(np.asarray(v.astype(jnp.float32), np.float64), np.asarray(p, np.float64),
                         None, eps)
  ulp = 2.0 ** (np.floor(np.log2(np.abs(ref))) - 7)  # bfloat16: 8 significant bits
  err = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - ref) / ulp
  assert err.max() <= 2.0, err.max()


def test_rms_norm_of_bfloat16_input_is_computed_in_float32_and_rounded_once():
  """RMSNorm upcasts to float32 and rounds to bfloat16 once, at the end: every output lies
  within half a bfloat16 ulp (plus float32 noise) of the float64 reference at the same
  (bfloat16) input. Computed in bfloat16 throughout it is off by ~2 ulps."""
  from cem_jax.layers.common import RMSNorm

  rng = _rng("rms-norm-bf16")
  d, eps = 256, 1e-6
  x = jnp.asarray(3.0 * rng.standard_normal((64, d)), jnp.bfloat16)
  norm = RMSNorm(d, eps)
  norm.scale[...] = jnp.asarray(1.0 + 0.3 * rng.standard_normal(d), jnp.float32)
  got = norm(x)
  assert got.dtype == jnp.bfloat16
  ref = ref_rms_norm(np.asarray(x.astype(jnp.float32), np.float64),
                     np.asarray(norm.scale[...], np.float64), eps)
  ulp = 2.0 ** (np.floor(np.log2(np.abs(ref))) - 7)  # bfloat16: 8 significant bits
  err = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - ref) / ulp
  assert err.max() <= 0.51, err.max()


# ---------------------------------------------------------------------------------------------
# One CEM block, built from the config, at random non-initial parameters.


def block_cfg(**overrides):
  cfg = get_default_config().model
  cfg.d_model, cfg.num_heads, cfg.mlp_dim, cfg.num_layers = D, H, F, 1
  for key, value in overrides.items():
    cfg[key] = value
  return cfg


def _random_value(name, shape, rng):
  """A non-initial value for each kind of parameter (fails on a parameter it does not know)."""
  leaf = name.rsplit(".", 1)[-1]
  noise = rng.standard_normal(shape)
  values = {
      "scale": lambda: 1.0 + 0.3 * noise,  # RMSNorm scales
      "eta": lambda: 0.6 * noise,  # raw step sizes: softplus in ~(0.3, 1.5)
      "beta": lambda: math.log(math.expm1(DH**-0.5)) + 0.3 * noise,
      "diag": lambda: 0.4 * noise,
      "p": lambda: 0.6 * noise,  # raw preconditioner diagonal
      "u": lambda: 0.3 * noise,
      "momentum": lambda: 0.5 + noise,  # raw: mu = sigmoid, around 0.6
      "w_q": lambda: 0.35 * noise,
      "w_k": lambda: 0.35 * noise,
      "w": lambda: 0.35 * noise,
      "g": lambda: 0.35 * noise,
      "embedding": lambda: noise,
      **{name: lambda: 0.35 * noise for name in ("w_v", "w_o", "w_gate", "w_up", "w_down")},
  }
  if leaf not in values:
    raise AssertionError(f"parameter {name} is new: give it a random value here and add it to "
                         "the reference")
  return values[leaf]()


def randomize(module, name):
  """Sets every ``nnx.Param`` of ``module`` to a random non-initial value; returns them as
  float64 NumPy arrays by dotted path (``'attn.w_q'``)."""
  rng = _rng(name)
  out = {}
  for path, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Param):
      key = ".".join(map(str, path))
      value = _random_value(key, node[...].shape, rng)
      node[...] = jnp.asarray(value, node[...].dtype)
      out[key] = np.asarray(node[...], np.float64)  # what the library holds (float32)
  return out


BLOCK_CASES = {
    "T1": dict(),
    "T1-distance-precond_att": dict(diagonal="per_head", diagonal_form="distance",
                                    precond="attention", precond_rank=3),
    "T2-fixed-per_step-layer-gelu": dict(
        num_steps=2, eta_per_step=True, precond="both", precond_rank=2, precond_shared=False,
        diagonal="per_head", mlp_condition="layer", mlp_energy="gelu"),
    "T2-coevolve-joint-shared_distance": dict(
        num_steps=2, context="coevolve", split="joint", diagonal="shared",
        diagonal_form="distance", precond="mlp", precond_rank=1, precond_eps=0.05),
    "T2-coevolve-learn_beta-strict-segments": dict(
        num_steps=2, context="coevolve", learn_beta=True, learn_eta=False, strict_causal=True,
        diagonal="per_head", precond="both", precond_rank=2, segments=True),
    "T2-fixed-joint-chain-segments": dict(
        num_steps=2, split="joint", norm_mode="chain", eta_per_step=True, diagonal="shared",
        segments=True, mlp_energy="relu2"),
    "T2-fixed-none-norm-no_rope": dict(num_steps=2, norm_mode="none", rope=False,
                                       diagonal="per_head", precond="both", precond_rank=1),
    # strict causality without documents (its own kernel structure); an epsilon that counts
    "T1-strict-norm_eps": dict(strict_causal=True, norm_eps=0.5),
}


@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_cem_block_matches_reference(case):
  options = dict(BLOCK_CASES[case])
  segments = SEGMENTS if options.pop("segments", False) else None
  x = _rng(f"block-x-{case}").standard_normal((B, N, D))
  if options.get("norm_mode") == "none":
    x = 0.3 * x  # no norm: keep the energy's inputs at the scale the others see
  results = {}
  prm = None
  for mode in ("fused", "autodiff"):
    cfg = block_cfg(update_mode=mode, **options)
    block = CEMBlock(cfg, rngs=nnx.Rngs(0))
    prm = randomize(block, f"block-{case}")
    aux = DecoderLM(cfg, 11, rngs=nnx.Rngs(0)).make_aux(
        None if segments is None else jnp.asarray(segments), B, N)
    results[mode] = block(jnp.asarray(x, jnp.float32), aux)[0]
  cfg = block_cfg(**options)
  ref = ref_block(x, prm, cfg, ref_mask(segments, B, N, cfg.strict_causal),
                  np.broadcast_to(np.arange(N), (B, N)))
  for mode, got in results.items():
    # Compare the updates y - x: y itself is dominated by the residual x.
    assert _rel(np.asarray(got, np.float64) - x, ref - x) <= 2 * TOL, mode


@pytest.mark.parametrize("embed_scale", [1.0, 3.0])
def test_decoder_lm_matches_reference(embed_scale):
  """Embedding (times ``embed_scale``) -> two CEM layers (T=2) -> final RMSNorm -> tied LM
  head, unscaled, with packed documents."""
  vocab = 13
  cfg = block_cfg(num_layers=2, num_steps=2, diagonal="per_head", precond="both",
                  precond_rank=2, context="coevolve", embed_scale=embed_scale)
  model = DecoderLM(cfg, vocab, rngs=nnx.Rngs(0))
  prm = randomize(model, "decoder")
  tokens = _rng("decoder-tokens").integers(0, vocab, (B, N))
  logits = model(jnp.asarray(tokens), jnp.asarray(SEGMENTS))
  mask = ref_mask(SEGMENTS, B, N, strict=False)
  pos = np.broadcast_to(np.arange(N), (B, N))
  x = embed_scale * prm["embedding"][tokens]
  for layer in range(cfg.num_layers):
    prefix = f"blocks.{layer}."
    x = ref_block(x, {k[len(prefix):]: v for k, v in prm.items() if k.startswith(prefix)}, cfg,
                  mask, pos)
  ref = ref_rms_norm(x, prm["final_norm.scale"], cfg.norm_eps) @ prm["embedding"].T
  assert _rel(logits, ref) <= 2 * TOL


def test_llama_block_matches_reference_and_with_rope_is_not_the_tied_cem_step():
  """The baseline at random weights. With W_V = W_K and W_O = W_Qᵀ and no RoPE it is the CEM
  step (test_layers); with RoPE it is not: the CEM step uses the rotated key as value and
  un-rotates the aggregate (CEM_MATH.md §1)."""
  cfg = block_cfg(block="llama")
  block = LlamaBlock(cfg, rngs=nnx.Rngs(0))
  prm = randomize(block, "llama")
  aux = DecoderLM(cfg, 11, rngs=nnx.Rngs(0)).make_aux(jnp.asarray(SEGMENTS), B, N)
  x = _rng("llama-x").standard_normal((B, N, D))
  mask, pos = ref_mask(SEGMENTS, B, N, strict=False), np.broadcast_to(np.arange(N), (B, N))
  ref = ref_llama_block(x, prm, cfg, mask, pos)
  got = block(jnp.asarray(x, jnp.float32), aux)[0]
  assert _rel(np.asarray(got, np.float64) - x, ref - x) <= 2 * TOL
  # The same weights, tied, as a CEM step (η = 1, P = I): the reference says how far apart.
  tied = {"norm_att.scale": prm["norm_att.scale"], "norm_mlp.scale": prm["norm_mlp.scale"],
          "attn.w_q": prm["attn.w_q"], "attn.w_k": prm["attn.w_k"],
          "attn.w_v": prm["attn.w_k"], "attn.w_o": np.transpose(prm["attn.w_q"], (1, 2, 0)),
          "mlp.w_gate": prm["mlp.w_gate"], "mlp.w_up": prm["mlp.w_up"],
          "mlp.w_down": prm["mlp.w_gate"].T}
  cem = {**tied, "mlp.w": prm["mlp.w_gate"], "mlp.g": prm["mlp.w_up"]}
  cem_cfg = block_cfg(learn_eta=False)
  cem_ref = ref_block(x, cem, cem_cfg, mask, pos)
  assert _rel(ref_llama_block(x, tied, cfg, mask, pos) - x, cem_ref - x) > 1e-2
  no_rope = block_cfg(rope=False)
  np.testing.assert_allclose(ref_llama_block(x, tied, no_rope, mask, pos),
                             ref_block(x, cem, block_cfg(rope=False, learn_eta=False), mask, pos),
                             rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding,context", [("none", "fixed"), ("left and inside", "fixed"),
                                             ("none", "coevolve")])
def test_energy_trace_matches_reference(padding, context):
  """The energy trace (``trace=True``) against the reference, sub-step by sub-step, T = 2,
  Lie–Trotter: ``att_after`` is E_att right after the attention sub-step (before the MLP's),
  ``mlp_before``/``mlp_after`` E_mlp with the step's gate held fixed, each summed over tokens.

  With padding (``aux.real``) and ``model.document_mask=False``, the updates see every token
  through the causal mask, the trace sums over the real tokens only: a real query sees no
  padding key. Packing pads only at a window's tail, where causality alone hides padding, so
  padding before real tokens is the case that tells (a caller's own ``segment_ids``).

  With ``model.context='coevolve'`` each step's energies (``att_after`` included) are taken
  against that step's context, ``norm_att`` of the state the step starts from."""
  cfg = block_cfg(num_steps=2, rope=False, context=context)  # no RoPE: a faster reference
  block = CEMBlock(cfg, rngs=nnx.Rngs(0))
  prm = randomize(block, "trace")
  x = _rng("trace-x").standard_normal((B, N, D))
  aux = training_aux(cfg, None, B, N)
  real = np.ones((B, N), bool)
  if padding != "none":
    real[0, :2] = real[1, 3] = False
    aux = aux.replace(real=jnp.asarray(real))
  trace = jax.jit(lambda v: block(v, aux, trace=True))(jnp.asarray(x, jnp.float32)).trace
  mask, pos = ref_mask(None, B, N, False), np.broadcast_to(np.arange(N), (B, N))
  traced = mask & real[:, :, None] & real[:, None, :]
  eps, dh = cfg.norm_eps, D // H
  beta = np.full(H, dh**-0.5)

  def rms(name, v):
    return ref_rms_norm(v, prm[f"{name}.scale"], eps)

  def att(y, ctx, t, visible=mask):
    eta = softplus(prm["attn.eta"][min(t, prm["attn.eta"].shape[0] - 1)])
    return ref_attention(rms("norm_att", y), ctx, prm["attn.w_q"], prm["attn.w_k"], eta, beta,
                         None, "bilinear", visible, pos, pos, None)

  def mlp(y, gate, t):
    eta = softplus(prm["mlp.eta"][min(t, prm["mlp.eta"].shape[0] - 1)])
    return ref_mlp(rms("norm_mlp", y), gate, prm["mlp.w"], prm["mlp.g"], eta, cfg.mlp_energy)

  def att_energy(y, ctx, t):
    return att(y, ctx, t, traced)[0]

  def mlp_energy(y, gate, t):  # element-wise: the real tokens alone, as one row
    return mlp(y[real][None], gate[real][None], t)[0]

  context, y = rms("norm_att", x), x
  assert len(trace) == 2
  for t, rec in enumerate(trace):
    if cfg.context == "coevolve" and t > 0:
      context = rms("norm_att", y)
    want = {"att_before": att_energy(y, context, t)}
    y = y + att(y, context, t)[1]
    want["att_after"] = att_energy(y, context, t)
    gate = rms("norm_mlp", y)  # model.mlp_condition='step'
    want["mlp_before"] = mlp_energy(y, gate, t)
    y = y + mlp(y, gate, t)[1]
    want["mlp_after"] = mlp_energy(y, gate, t)
    assert set(rec) == set(want)
    for key, value in want.items():
      assert abs(float(rec[key]) - value) <= 2 * TOL * abs(value), (t, key, float(rec[key]), value)


@pytest.mark.parametrize("split", ["lie_trotter", "joint"])
def test_nesterov_block_and_its_trace_match_reference(split):
  """A pre-norm block with ``inner_optimizer='nesterov'`` (T = 2, an incoming velocity) against
  the float64 reference of ``cem_jax/inner.py``'s rule: each sub-step's update is evaluated at
  the look-ahead ``z = y + μ v`` (query ``norm_att(z)``; the MLP's gate and input
  ``norm_mlp(z)``), ``v ← μ v + u``, ``y ← y + v``; the joint split makes one such step with
  both updates at one ``z``. The trace records each energy at ``y`` (before and after the
  sub-step), not at the look-ahead. tests/test_neighbours.py checks the rules without a norm
  (quadratic energies); here the norms and the built-in energies are on."""
  cfg = block_cfg(num_steps=2, rope=False, inner_optimizer="nesterov", split=split)
  block = CEMBlock(cfg, rngs=nnx.Rngs(0))
  prm = randomize(block, f"nesterov-{split}")
  rng = _rng(f"nesterov-x-{split}")
  x, v0 = rng.standard_normal((B, N, D)), 0.3 * rng.standard_normal((B, N, D))
  aux = training_aux(cfg, None, B, N)
  got, trace, _, v_got = jax.jit(lambda a, b: block(a, aux, trace=True, velocity=b))(
      jnp.asarray(x, jnp.float32), jnp.asarray(v0, jnp.float32))  # BlockOut, no cache
  mask, pos = ref_mask(None, B, N, False), np.broadcast_to(np.arange(N), (B, N))
  eps, beta = cfg.norm_eps, np.full(H, (D // H) ** -0.5)
  mu = 1.0 / (1.0 + math.exp(-prm["momentum"]))

  def rms(name, v):
    return ref_rms_norm(v, prm[f"{name}.scale"], eps)

  def att(y, ctx, t):  # (energy, update) at y
    return ref_attention(rms("norm_att", y), ctx, prm["attn.w_q"], prm["attn.w_k"],
                         softplus(prm["attn.eta"][0]), beta, None, "bilinear", mask, pos, pos,
                         None)

  def mlp(y, gate):
    return ref_mlp(rms("norm_mlp", y), gate, prm["mlp.w"], prm["mlp.g"],
                   softplus(prm["mlp.eta"][0]), cfg.mlp_energy)

  context, y, v = rms("norm_att", x), x, v0
  assert len(trace) == 2
  for rec in trace:
    want = {"att_before": att(y, context, 0)[0]}
    z = y + mu * v
    if split == "joint":
      gate = rms("norm_mlp", z)
      want["mlp_before"] = mlp(y, gate)[0]
      v = mu * v + att(z, context, 0)[1] + mlp(z, gate)[1]
      y = y + v
      want["att_after"] = att(y, context, 0)[0]  # one step: after both updates
    else:
      v = mu * v + att(z, context, 0)[1]
      y = y + v
      want["att_after"] = att(y, context, 0)[0]
      z = y + mu * v
      gate = rms("norm_mlp", z)
      want["mlp_before"] = mlp(y, gate)[0]
      v = mu * v + mlp(z, gate)[1]
      y = y + v
    want["mlp_after"] = mlp(y, gate)[0]
    assert set(rec) == set(want)
    for key, value in want.items():
      assert abs(float(rec[key]) - value) <= 2 * TOL * abs(value), (key, float(rec[key]), value)
  assert _rel(np.asarray(got, np.float64) - x, y - x) <= 2 * TOL
  assert _rel(v_got, v) <= 2 * TOL


# ---------------------------------------------------------------------------------------------
# bfloat16: the step size η scales the output weights, formed in float32 and rounded once.


def _bf16_round(a):
  """``a`` rounded to bfloat16, back as float64 NumPy (inputs both sides start from)."""
  return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("case", ["attention", "attention-diagonal", "mlp"])
def test_bf16_step_size_gradients_match_reference(case):
  """Training differentiates the fused update w.r.t. η. With bf16 compute, η·W (the attention's
  ``W_Qᵀ`` per head, the MLP's ``Wᵀ``) is formed in float32 and rounded once, and the
  diagonal's η·d stays float32, so η's gradient is a float32 sum over the weights. Against the
  float64 reference ``∂/∂η_k Σ cot·u = Σ cot·u_k`` at the same bf16 inputs (a cotangent along
  the update, so the sum is coherent and its rounding averages out) it is off by 1.2e-3,
  2.9e-4 (a diagonal with small W_Q, W_K: the diagonal's term dominates) and 8.6e-5 (MLP);
  with η·W or η·d formed in bf16 (η cast to bf16, the product's gradient summed in bf16) by
  1.6e-2, 9.6e-3 and 1.4e-2. Rounding η alone to bf16 before the float32 product moves values by one
  more bf16 rounding of η, the order of the rounding of η·W itself: not measurable here, nor
  a loss. (With a diagonal the augmented head runs in float32, W_Q's η included.)"""
  rng = _rng(f"bf16-eta-gradient-{case}")
  d, h, dh, f = 64, 4, 16, 96
  y, c = (_bf16_round(rng.standard_normal((B, N, d))) for _ in range(2))
  noise = rng.standard_normal((B, N, d))
  mask, pos = ref_mask(None, B, N, strict=False), np.broadcast_to(np.arange(N), (B, N))
  if case == "mlp":
    params = {"w": _bf16_round(rng.standard_normal((d, f)) / 8),
              "g": _bf16_round(rng.standard_normal((d, f)) / 8),
              "eta": np.float64(np.float32(0.77))}
    name, kind, aux, tol = "silu", "mlp", None, 2e-3

    def ref_update(eta):
      return ref_mlp(y, c, params["w"], params["g"], eta, "silu")[1]
  else:
    scale = 8 if case == "attention" else 32
    params = {"w_q": _bf16_round(rng.standard_normal((d, h, dh)) / scale),
              "w_k": _bf16_round(rng.standard_normal((d, h, dh)) / scale),
              "eta": np.float32(rng.uniform(0.5, 1.5, h)).astype(np.float64),
              "beta": np.float32(rng.uniform(0.2, 0.4, h)).astype(np.float64)}
    if case == "attention-diagonal":
      params["diag"] = _bf16_round(0.5 * rng.standard_normal((h, d)))
    name, kind, tol = "softmax", "attention", 5e-3 if case == "attention" else 3e-3
    aux = energies.EnergyAux(mask=jnp.asarray(mask), positions=jnp.asarray(pos, jnp.int32),
                             rope_theta=100.0, is_plain_causal=True, is_causal=True)

    def ref_update(eta):
      return ref_attention(y, c, params["w_q"], params["w_k"], eta, params["beta"],
                           params.get("diag"), "bilinear", mask, pos, pos, 100.0)[1]

  ref_u = ref_update(params["eta"])
  cot = jnp.asarray(ref_u / np.std(ref_u) + 0.5 * noise, jnp.float32)
  lib = {k: jnp.asarray(v, jnp.float32 if k in ("eta", "beta") else jnp.bfloat16)
         for k, v in params.items()}  # weights in bf16, as a bf16 layer passes them
  fused = energies.get(name, kind).fused_update
  ybf, cbf = jnp.asarray(y, jnp.bfloat16), jnp.asarray(c, jnp.bfloat16)

  def loss(eta):
    return jnp.sum(fused(ybf, cbf, {**lib, "eta": eta}, aux).astype(jnp.float32) * cot)

  got = jax.grad(loss)(lib["eta"])
  cot = np.asarray(cot, np.float64)
  if kind == "mlp":
    want = np.sum(cot * ref_update(1.0))
  else:
    want = np.array([np.sum(cot * ref_update(np.eye(h)[k])) for k in range(h)])
  assert _rel(got, want) <= tol, _rel(got, want)


def test_bf16_learned_temperature_gradient_matches_reference():
  """With ``model.learn_beta`` training differentiates the fused update w.r.t. β. With bf16
  compute β·q is formed in float32 and rounded once, so β's gradient is a float32 sum over the
  tokens: against float64 central differences of the reference at the same bf16 inputs (a
  cotangent along the update, as above) it is off by 3.2e-3 (at most 6.9e-3 over five seeds).
  With β rounded to bf16 and multiplied into the bf16 queries, the gradient summed and returned
  in bf16, it was off by 3.6e-2 (at least 2.5e-2)."""
  rng = _rng("bf16-beta-gradient")
  b, n, d, h, dh = 4, 16, 64, 4, 16  # enough tokens that a bf16 sum over them shows
  y, c = (_bf16_round(rng.standard_normal((b, n, d))) for _ in range(2))
  noise = rng.standard_normal((b, n, d))
  mask, pos = ref_mask(None, b, n, strict=False), np.broadcast_to(np.arange(n), (b, n))
  params = {"w_q": _bf16_round(rng.standard_normal((d, h, dh)) / 4),
            "w_k": _bf16_round(rng.standard_normal((d, h, dh)) / 4),
            "eta": np.float32(rng.uniform(0.5, 1.5, h)).astype(np.float64),
            "beta": np.float32(rng.uniform(0.2, 0.4, h)).astype(np.float64)}
  aux = energies.EnergyAux(mask=jnp.asarray(mask), positions=jnp.asarray(pos, jnp.int32),
                           rope_theta=100.0, is_plain_causal=True, is_causal=True)

  def ref_update(beta):
    return ref_attention(y, c, params["w_q"], params["w_k"], params["eta"], beta, None,
                         "bilinear", mask, pos, pos, 100.0)[1]

  ref_u = ref_update(params["beta"])
  cot = np.asarray(jnp.asarray(ref_u / np.std(ref_u) + 0.5 * noise, jnp.float32), np.float64)
  step, want = 1e-5, []
  for k in range(h):
    e = step * np.eye(h)[k]
    want.append(np.sum(cot * (ref_update(params["beta"] + e) - ref_update(params["beta"] - e)))
                / (2 * step))
  lib = {k: jnp.asarray(v, jnp.float32 if k in ("eta", "beta") else jnp.bfloat16)
         for k, v in params.items()}
  fused = energies.get("softmax", "attention").fused_update
  ybf, cbf = jnp.asarray(y, jnp.bfloat16), jnp.asarray(c, jnp.bfloat16)

  def loss(beta):
    return jnp.sum(fused(ybf, cbf, {**lib, "beta": beta}, aux).astype(jnp.float32)
                   * jnp.asarray(cot, jnp.float32))

  got = jax.grad(loss)(lib["beta"])
  assert _rel(got, np.array(want)) <= 1e-2, _rel(got, np.array(want))
