"""CEM and Llama layers: the central equivalence, causality, parameter counts, fused = autodiff."""

import itertools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import np_rope
from flax import nnx

from cem_jax.config import get_default_config
from cem_jax.layers import CEMBlock, LlamaBlock
from cem_jax.model import DecoderLM
from cem_jax.model_stats import count_params

D, H, F, B, T, V = 32, 4, 48, 2, 12, 50


def model_cfg(**overrides):
  cfg = get_default_config().model
  cfg.d_model, cfg.num_heads, cfg.mlp_dim, cfg.num_layers = D, H, F, 2
  cfg.init_std = 0.2
  for k, v in overrides.items():
    cfg[k] = v
  return cfg


def _x(seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, T, D))


def _rel(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def tie_llama_to_cem(llama: LlamaBlock, cem: CEMBlock) -> None:
  """W_Q, W_K from CEM; W_V = W_K, W_O = W_Qᵀ; W_gate = W, W_up = G, W_down = Wᵀ."""
  llama.attn.w_q[...] = cem.attn.w_q[...]
  llama.attn.w_k[...] = cem.attn.w_k[...]
  llama.attn.w_v[...] = cem.attn.w_k[...]
  llama.attn.w_o[...] = jnp.transpose(cem.attn.w_q[...], (1, 2, 0))
  llama.mlp.w_gate[...] = cem.mlp.w[...]
  llama.mlp.w_up[...] = cem.mlp.g[...]
  llama.mlp.w_down[...] = cem.mlp.w[...].T


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("update_mode", ["fused", "autodiff"])
def test_cem_block_one_step_equals_tied_llama_block(segments, update_mode):
  cfg = model_cfg(rope=False, update_mode=update_mode)
  cem = CEMBlock(cfg, rngs=nnx.Rngs(0))
  llama = LlamaBlock(cfg, rngs=nnx.Rngs(1))
  tie_llama_to_cem(llama, cem)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(0))
  seg = jnp.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3]) if segments else None
  aux = model.make_aux(seg, B, T)
  x = _x()
  y_cem = cem(x, aux).y
  y_llama = llama(x, aux).y
  assert _rel(y_cem, y_llama) <= 1e-5


def _count_primitive(jaxpr, name: str) -> int:
  """Equations of primitive ``name`` in ``jaxpr`` and every jaxpr nested in its equations."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _count_primitive(sub, name)
  return count


# RMSNorms a block's training gradient applies, from the maths (each norm of each point once):
# T=1 has norm_att(x) (context and query) and norm_mlp(y) (gate and input under
# mlp_condition='step'; with 'layer' and the joint split both are norm_mlp(x)), as a Llama
# block has; each later step adds the query's norm_att(y) (under 'coevolve' also its context)
# and the MLP's norm_mlp(y).
@pytest.mark.parametrize("overrides, norms", [
    (dict(block="llama"), 2),
    (dict(), 2),
    (dict(update_mode="autodiff"), 2),
    (dict(split="joint", mlp_condition="layer"), 2),
    (dict(inner_optimizer="heavy_ball"), 2),
    (dict(inner_optimizer="nesterov"), 3),  # its query sits at the look-ahead, not at x
    (dict(num_steps=2), 4),
    (dict(num_steps=2, context="coevolve"), 4),
])
def test_a_block_normalises_each_point_once(overrides, norms):
  """Where two uses see the same point (the attention's context and query at its first
  step, the MLP's gate and input), the norm is applied once, so the backward pass
  differentiates it once: two copies cost a CEM layer 2 RMSNorm backward passes over
  [batch, seq_len, d_model] more than a Llama layer (equal values either way)."""
  cfg = model_cfg(**overrides)
  block = (LlamaBlock if cfg.block == "llama" else CEMBlock)(cfg, rngs=nnx.Rngs(0))
  aux = DecoderLM(cfg, V, rngs=nnx.Rngs(0)).make_aux(None, B, T)
  graphdef, state = nnx.split(block)

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x, aux)[0] ** 2)

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, _x()).jaxpr
  assert _count_primitive(jaxpr, "rsqrt") == norms


CAUSAL_CASES = [
    dict(block="llama"),
    dict(block="cem"),
    dict(block="cem", num_steps=2, diagonal="per_head", precond="both", precond_rank=2),
    dict(block="cem", num_steps=2, context="coevolve", update_mode="autodiff",
         norm_mode="chain", split="joint", diagonal="shared", diagonal_form="distance"),
]


@pytest.mark.parametrize("case", CAUSAL_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_changing_a_later_token_leaves_earlier_outputs_unchanged(case):
  cfg = model_cfg(**case)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(0))
  if cfg.diagonal != "none":  # diagonals start at 0; make them matter
    for blk in model.blocks:
      blk.attn.diag[...] = 0.3 * jnp.ones_like(blk.attn.diag[...])
  tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, V)
  base = model(tokens)
  for j in (3, 7, T - 1):
    changed = tokens.at[:, j].set((tokens[:, j] + 1) % V)
    out = model(changed)
    np.testing.assert_array_equal(np.asarray(out[:, :j]), np.asarray(base[:, :j]))
    assert not np.array_equal(np.asarray(out[:, j]), np.asarray(base[:, j]))


def test_parameter_counts_read_off_the_built_models():
  d, f = D, F
  cem = CEMBlock(model_cfg(learn_eta=False), rngs=nnx.Rngs(0))
  llama = LlamaBlock(model_cfg(), rngs=nnx.Rngs(0))
  assert count_params(cem.attn) == 2 * d * d
  assert count_params(llama.attn) == 4 * d * d
  assert count_params(cem.mlp) == 2 * d * f
  assert count_params(llama.mlp) == 3 * d * f
  with_eta = CEMBlock(model_cfg(), rngs=nnx.Rngs(0))
  assert count_params(with_eta.attn) == 2 * d * d + H  # one step size per head
  assert count_params(with_eta.mlp) == 2 * d * f + 1
  diag = CEMBlock(model_cfg(diagonal="per_head", learn_eta=False), rngs=nnx.Rngs(0))
  assert count_params(diag.attn) == 2 * d * d + H * d
  pre = CEMBlock(model_cfg(precond="both", precond_rank=3, learn_eta=False), rngs=nnx.Rngs(0))
  assert count_params(pre) - count_params(cem) == 2 * (d + d * 3)


COMBOS = list(itertools.product(
    [("none", "bilinear"), ("per_head", "bilinear"), ("per_head", "distance"),
     ("shared", "bilinear"), ("shared", "distance")],
    [False, True],  # rope
    [1, 2],  # num_steps
    ["none", "both"],  # preconditioner
))


@pytest.mark.parametrize("diag,rope,steps,precond", COMBOS)
def test_block_autodiff_equals_fused(diag, rope, steps, precond):
  kw = dict(diagonal=diag[0], diagonal_form=diag[1], rope=rope, num_steps=steps,
            precond=precond, precond_rank=2 if precond != "none" else 0)
  fused = CEMBlock(model_cfg(update_mode="fused", **kw), rngs=nnx.Rngs(0))
  auto = CEMBlock(model_cfg(update_mode="autodiff", **kw), rngs=nnx.Rngs(0))
  if diag[0] != "none":
    for blk in (fused, auto):
      blk.attn.diag[...] = 0.2 * jax.random.normal(jax.random.PRNGKey(4), blk.attn.diag.shape)
  if precond != "none":
    for blk in (fused, auto):
      for pc in (blk.precond_att, blk.precond_mlp):
        pc.u[...] = 0.3 * jax.random.normal(jax.random.PRNGKey(5), pc.u.shape)
  aux = DecoderLM(model_cfg(rope=rope), V, rngs=nnx.Rngs(0)).make_aux(None, B, T)
  x = _x(1)
  assert _rel(fused(x, aux)[0], auto(x, aux)[0]) <= 1e-5


@pytest.mark.parametrize("block_kw", [dict(), dict(num_steps=2, diagonal="per_head")])
def test_training_gradients_autodiff_equal_fused(block_kw):
  """The update is differentiated by training: both paths give the same parameter gradients."""
  tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, V)
  grads = []
  for mode in ("fused", "autodiff"):
    model = DecoderLM(model_cfg(update_mode=mode, **block_kw), V, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p, graphdef=graphdef):
      logits = nnx.merge(graphdef, p)(tokens)
      return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    grads.append(jax.jit(jax.grad(loss))(params))  # one program: eager runs op by op
  for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_params_do_not_grow_with_steps_and_two_steps_equal_two_explicit_steps():
  one = CEMBlock(model_cfg(num_steps=1), rngs=nnx.Rngs(0))
  two = CEMBlock(model_cfg(num_steps=2), rngs=nnx.Rngs(0))
  assert count_params(one) == count_params(two)
  aux = DecoderLM(model_cfg(), V, rngs=nnx.Rngs(0)).make_aux(None, B, T)
  x = _x(2)
  # With a fixed context the second step still attends to the layer input's keys; with a
  # co-evolving context, two steps equal applying the one-step block twice.
  co = CEMBlock(model_cfg(num_steps=2, context="coevolve"), rngs=nnx.Rngs(0))
  twice = one(one(x, aux)[0], aux)[0]
  np.testing.assert_allclose(co(x, aux)[0], twice, rtol=1e-5, atol=1e-6)
  assert _rel(two(x, aux)[0], twice) > 1e-4


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_policies_leave_loss_and_gradients_unchanged(remat):
  tokens = jax.random.randint(jax.random.PRNGKey(3), (B, T), 0, V)
  results = []
  for policy in ("none", remat):
    model = DecoderLM(model_cfg(remat=policy, num_steps=2), V, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p, graphdef=graphdef):
      logits = nnx.merge(graphdef, p)(tokens)
      return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 1])

    results.append(jax.jit(jax.value_and_grad(loss))(params))
  np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("block_kw", [dict(), dict(num_steps=2, diagonal="per_head")])
def test_bfloat16_fused_equals_autodiff_within_bf16_tolerance(block_kw):
  """bf16 compute, f32 params: the two update paths agree to bf16 precision (~3 digits)."""
  x = _x(9)
  outs = []
  for mode in ("fused", "autodiff"):
    cfg = model_cfg(update_mode=mode, dtype="bfloat16", **block_kw)
    block = CEMBlock(cfg, rngs=nnx.Rngs(0))
    if block_kw:
      block.attn.diag[...] = 0.2 * jnp.ones_like(block.attn.diag[...])
    aux = DecoderLM(cfg, V, rngs=nnx.Rngs(0)).make_aux(None, B, T)
    y = block(x, aux).y
    assert y.dtype == jnp.bfloat16 and block.attn.w_q[...].dtype == jnp.float32
    outs.append(y.astype(jnp.float32) - x.astype(jnp.bfloat16).astype(jnp.float32))
  assert _rel(outs[0], outs[1]) <= 3e-2  # compares the updates y - x, not y


@pytest.mark.parametrize("block_kw", [dict(block="llama"), dict(block="cem"),
                                      dict(block="cem", update_mode="autodiff")])
def test_document_mask_false_is_plain_causal_attention_over_the_window(block_kw):
  """model.document_mask=False ignores segment ids (is_causal kernels); True keeps the second
  document from seeing the first, which changes its logits and only its logits."""
  tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, V)
  segments = jnp.where(jnp.arange(T) < 5, 1, 2)[None].repeat(B, 0)  # two documents
  masked = DecoderLM(model_cfg(**block_kw), V, rngs=nnx.Rngs(0))
  plain = DecoderLM(model_cfg(document_mask=False, **block_kw), V, rngs=nnx.Rngs(0))
  assert plain.make_aux(None, B, T).is_plain_causal
  np.testing.assert_array_equal(np.asarray(plain(tokens, segments)), np.asarray(plain(tokens)))
  np.testing.assert_allclose(np.asarray(plain(tokens)), np.asarray(masked(tokens)),
                             rtol=1e-5, atol=1e-6)  # same weights; one is_causal, one mask
  with_docs = np.asarray(masked(tokens, segments))
  np.testing.assert_allclose(with_docs[:, :5], np.asarray(plain(tokens))[:, :5],
                             rtol=1e-5, atol=1e-6)
  assert np.max(np.abs(with_docs[:, 5:] - np.asarray(plain(tokens))[:, 5:])) > 1e-3


def _np_rmsnorm(v, scale, eps):
  return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * scale


def _np_precondition(v, p, u, eps):
  """``P v`` with ``P = diag(softplus(p) + eps) + U Uᵀ`` (CEM_MATH.md §3), float64."""
  return (np.logaddexp(0.0, p) + eps) * v + (v @ u) @ u.T


def _np_rmsnorm_pullback(v, w, scale, eps):
  """``Jᵀ w`` with ``J`` the Jacobian of ``g = _np_rmsnorm(v, scale, eps)`` at ``v``, float64:
  ``g_a = s_a v_a / r``, ``r = √(mean(v²) + eps)``, so ``∂g_a/∂v_b = s_a (δ_ab / r -
  v_a v_b / (d r³))`` (``norm_mode='chain'``: the update is ``-∇_v E(norm(v))``)."""
  r2 = np.mean(v * v, axis=-1, keepdims=True) + eps
  sw = scale * w
  return sw / np.sqrt(r2) - v * np.sum(sw * v, axis=-1, keepdims=True) / (v.shape[-1] * r2 ** 1.5)


def _np_retract(z):
  """``R(z) = √d z / ‖z‖``: back onto the sphere of radius √d_model (cem_jax.inner)."""
  return np.sqrt(z.shape[-1]) * z / np.linalg.norm(z, axis=-1, keepdims=True)


def _np_tangent(y, u):
  """``P_y(u) = u - (⟨y, u⟩ / ‖y‖²) y``: the part of ``u`` tangent to the sphere at ``y``."""
  return u - np.sum(y * u, -1, keepdims=True) / np.sum(y * y, -1, keepdims=True) * y


def _np_cem_block(block, cfg, x, steps, velocity=None):
  """CEM_MATH.md §4 Algorithm 1 in float64 NumPy, written from the maths (§1-§5 and the rules
  of cem_jax.inner's docstring), under every option of ``cfg`` but the energies:

  - ``context``: 'fixed' keys from ``norm_att(x)`` for every step; 'coevolve' from
    ``norm_att`` of the state entering each step (after the previous step's MLP sub-step).
  - ``split``: 'lie_trotter' attention then MLP, the MLP at the state after attention;
    'joint' one step with ``u_att(y) + u_mlp(y)``, both at the state entering the step.
  - ``mlp_condition``: the gate input, 'step' ``norm_mlp`` of the point the MLP update is
    taken at; 'layer' ``norm_mlp(x)`` for every step.
  - ``strict_causal``: position i sees j < i (the first token nothing: its update is 0);
    ``learn_beta``: β_k = softplus(raw β_k) in the scores, η = 1 (``learn_eta`` False).
  - ``rope``: ``q_i = R_i W_Q g``, ``k_j = R_j W_K c_j`` (positions 0..n-1); the gradient of
    ``<q_i, k_j>`` w.r.t. ``g`` is ``W_Qᵀ R_iᵀ k_j``: the rotated keys are the values and the
    aggregate turns back by ``-i`` (``R_iᵀ = R_{-i}``) before ``W_Qᵀ``.
  - ``diagonal`` (``d_k``, 'shared': one row for every head): 'bilinear' scores gain
    ``Σ_m d_km g_m c_jm`` and the update ``η_k d_k ⊙ Σ_j a_ij c_j``; 'distance' scores gain
    ``-½ Σ_m d_km (g_m - c_jm)²`` and the update ``η_k d_k ⊙ Σ_j a_ij (c_j - g)`` (0 on a row
    that sees no key).
  - ``norm_mode``: 'prenorm' ``-∇_g E`` at ``g = norm(y)`` is the update; 'chain' it is
    pulled back through the norm's Jacobian at y (then P); 'none' ``g = y``, the context
    ``x`` and the gate ``y`` (or ``x``) un-normalised.
  - ``inner_optimizer``, ``manifold``: each sub-step (the joint split: one for both) is
    'gd' ``y ← y + u``; 'heavy_ball' ``v ← μ v + u; y ← y + v``; 'nesterov' the same with
    ``u`` (and the gate of mlp_condition='step') at ``y + μ v``; μ = sigmoid(raw). 'sphere':
    x retracted first, ``u → P_y(u)``, ``y ← R(y + u)`` or ``R(y + v)`` and then
    ``v ← P_y(v)`` at the new y; Nesterov's point ``R(y + μ v)``. ``velocity``: the incoming
    v (None: zeros).
  - ``cem_attention`` / ``cem_mlp`` False: that sub-step is the standard untied sub-layer of
    ``norm(y)`` (its own keys from the current state, no η, no P, no chain rule) as the update.

  Per-step parameters (η, P) of step t are those of step min(t, T - 1): steps beyond the
  trained T reuse the LAST trained step's (CEMBlock's docstring).

  Returns ``(y, v)``: float64 ``[batch, seq_len, d_model]``; v None under 'gd'."""
  # energies (and a compute dtype) this reference does not model must not pass silently
  modelled = dict(attention_energy="softmax", mlp_energy="silu", dtype="float32")
  assert {k: cfg[k] for k in modelled} == modelled, "an option this reference does not model"
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  # copy of step t: 0 when shared (one copy), else min(t, T - 1)
  at = lambda copies, t: copies[min(t, cfg.num_steps - 1) if len(copies) > 1 else 0]  # noqa: E731
  wq, wk = f64(block.attn.w_q[...]), f64(block.attn.w_k[...])
  eta = lambda sub, one: (np.logaddexp(0.0, f64(sub.eta[...])) if cfg.learn_eta  # noqa: E731
                          else np.ones((1,) + one))
  if cfg.cem_attention:
    eta_att = eta(block.attn, (wq.shape[1],))  # [copies, H]
    beta = (np.logaddexp(0.0, f64(block.attn.beta[...])) if cfg.learn_beta
            else np.full(wq.shape[1], 1.0 / np.sqrt(wq.shape[-1])))  # [H]
    diag = (None if cfg.diagonal == "none"
            else np.broadcast_to(f64(block.attn.diag[...]), (wq.shape[1], wq.shape[0])))
  if cfg.cem_mlp:
    w, g = f64(block.mlp.w[...]), f64(block.mlp.g[...])
    eta_mlp = eta(block.mlp, ())  # [copies]
  s_att, s_mlp = f64(block.norm_att.scale[...]), f64(block.norm_mlp.scale[...])
  eps = cfg.norm_eps
  pre = {}
  for name in ("att", "mlp"):
    pc = getattr(block, f"precond_{name}")
    pre[name] = None if pc is None else (f64(pc.p[...]), f64(pc.u[...]), pc.eps)

  def apply_p(name, v, t):
    if pre[name] is None:
      return v
    p, u, pc_eps = pre[name]
    return _np_precondition(v, at(p, t), at(u, t), pc_eps)

  def view(scale, v):
    return v if cfg.norm_mode == "none" else _np_rmsnorm(v, scale, eps)

  def descend(scale, v, minus_grad_g):  # -∇_g E at g = view(v) -> the residual update
    return (_np_rmsnorm_pullback(v, minus_grad_g, scale, eps) if cfg.norm_mode == "chain"
            else minus_grad_g)

  x = f64(x)
  n = x.shape[1]
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  visible = j < i if cfg.strict_causal else j <= i  # [i, j]
  pos = np.broadcast_to(np.arange(n), x.shape[:2])
  rotate = ((lambda a, inverse=False: np_rope(a, pos, cfg.rope_theta, inverse)) if cfg.rope
            else (lambda a, inverse=False: a))

  def att_update(v, ctx, t):
    if not cfg.cem_attention:
      mask = np.broadcast_to(visible, (v.shape[0], n, n))
      return _np_llama_attention(block.attn, view(s_att, v), mask,
                                 pos if cfg.rope else None, cfg.rope_theta if cfg.rope else None)
    gv = view(s_att, v)
    q = rotate(np.einsum("bid,dhe->bihe", gv, wq))
    keys = rotate(np.einsum("bjd,dhe->bjhe", ctx, wk))
    scores = np.einsum("bihe,bjhe->bhij", q, keys)
    if diag is not None:
      scores = scores + np.einsum("bid,hd,bjd->bhij", gv, diag, ctx)
      if cfg.diagonal_form == "distance":
        scores = scores - 0.5 * (np.einsum("bid,hd->bhi", gv * gv, diag)[..., None]
                                 + np.einsum("bjd,hd->bhj", ctx * ctx, diag)[:, :, None])
    scores = beta[:, None, None] * scores
    top = np.max(np.where(visible, scores, -np.inf), -1, keepdims=True)
    shifted = scores - np.where(visible.any(-1)[:, None], top, 0.0)
    a = np.exp(np.where(visible, shifted, -np.inf))
    a /= np.maximum(a.sum(-1, keepdims=True), 1e-300)  # a row that sees no key: a = 0
    heads = rotate(np.einsum("bhij,bjhe->bihe", a, keys), inverse=True)
    u = np.einsum("bihe,dhe->bid", heads * at(eta_att, t)[:, None], wq)
    if diag is not None:
      pulled = np.einsum("bhij,bjd->bihd", a, ctx)  # Σ_j a_ij c_j
      if cfg.diagonal_form == "distance":  # Σ_j a_ij (c_j - g) = Σ_j a_ij c_j - g Σ_j a_ij
        pulled = pulled - np.einsum("bhij->bih", a)[..., None] * gv[:, :, None]
      u = u + np.einsum("bihd,hd->bid", pulled, diag * at(eta_att, t)[:, None])
    return apply_p("att", descend(s_att, v, u), t)

  def mlp_update(v, t):
    gm = view(s_mlp, v)
    if not cfg.cem_mlp:
      return _np_swiglu(block.mlp, gm)
    gate = view(s_mlp, x) if cfg.mlp_condition == "layer" else gm
    pre_act = gm @ w
    hidden = pre_act / (1.0 + np.exp(-pre_act)) * (gate @ g)
    return apply_p("mlp", descend(s_mlp, v, at(eta_mlp, t) * hidden @ w.T), t)

  opt, sphere = cfg.inner_optimizer, cfg.manifold == "sphere"
  mu = None if opt == "gd" else 1.0 / (1.0 + np.exp(-f64(block.momentum[...])))

  def lookahead(y, v):
    if opt != "nesterov":
      return y
    return _np_retract(y + mu * v) if sphere else y + mu * v

  def inner_step(y, v, u):
    if sphere:
      u = _np_tangent(y, u)
    if opt == "gd":
      return (_np_retract(y + u) if sphere else y + u), None
    v = mu * v + u
    y = _np_retract(y + v) if sphere else y + v
    return y, (_np_tangent(y, v) if sphere else v)

  if sphere:
    x = _np_retract(x)
  y = x.copy()
  v = None if opt == "gd" else (np.zeros_like(x) if velocity is None else f64(velocity))
  for t in range(steps):
    ctx = view(s_att, y if cfg.context == "coevolve" else x)
    if cfg.split == "joint":
      z = lookahead(y, v)
      y, v = inner_step(y, v, att_update(z, ctx, t) + mlp_update(z, t))
    else:
      y, v = inner_step(y, v, att_update(lookahead(y, v), ctx, t))
      y, v = inner_step(y, v, mlp_update(lookahead(y, v), t))
  return y, v


def _np_llama_attention(attn, xn, mask, pos, theta):
  """The untied attention ``W_O(softmax(q kᵀ/√d_h) v)`` of the normalised ``xn`` in float64:
  RoPE on queries and keys (none with ``theta=None``); a query row with no visible key
  (``mask`` ``[batch, i, j]``) attends to nothing (0)."""
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  q = np.einsum("bid,dhe->bihe", xn, f64(attn.w_q[...]))
  k = np.einsum("bjd,dhe->bjhe", xn, f64(attn.w_k[...]))
  if theta is not None:
    q, k = np_rope(q, pos, theta), np_rope(k, pos, theta)
  v = np.einsum("bjd,dhe->bjhe", xn, f64(attn.w_v[...]))
  s = np.einsum("bihe,bjhe->bhij", q, k) / np.sqrt(q.shape[-1])
  seen = np.asarray(mask, bool)[:, None]
  e = np.where(seen, np.exp(s - np.max(np.where(seen, s, -np.inf), -1, keepdims=True)), 0.0)
  p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
  return np.einsum("bihe,hed->bid", np.einsum("bhij,bjhe->bihe", p, v), f64(attn.w_o[...]))


def _np_swiglu(mlp, hn):
  """SwiGLU ``W_down(silu(W_gate hn) ⊙ W_up hn)`` in float64."""
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  gate = hn @ f64(mlp.w_gate[...])
  return (gate / (1.0 + np.exp(-gate)) * (hn @ f64(mlp.w_up[...]))) @ f64(mlp.w_down[...])


def _np_llama_block(block, x, mask, pos, theta):
  """The pre-norm Llama block ``h = x + attn(norm(x)); y = h + mlp(norm(h))`` in float64 from
  its definition (:func:`_np_llama_attention`, :func:`_np_swiglu`)."""
  x = np.asarray(x, np.float64)
  scale = lambda norm: np.asarray(norm.scale[...], np.float64)  # noqa: E731
  h = x + _np_llama_attention(block.attn, _np_rmsnorm(x, scale(block.norm_att),
                                                      block.norm_att.eps), mask, pos, theta)
  return h + _np_swiglu(block.mlp, _np_rmsnorm(h, scale(block.norm_mlp), block.norm_mlp.eps))


def test_llama_block_with_rope_equals_the_float64_definition():
  """The baseline's own check with RoPE on (the tied CEM = Llama equivalence holds only
  without it: the CEM update's value is the rotated key), documents and padding, random norm
  scales."""
  cfg = model_cfg(block="llama", rope=True, rope_theta=500.0)
  block = LlamaBlock(cfg, rngs=nnx.Rngs(3))
  for norm, key in ((block.norm_att, 16), (block.norm_mlp, 17)):
    norm.scale[...] = 1.0 + 0.3 * jax.random.normal(jax.random.PRNGKey(key), (D,))
  seg = jnp.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])
  aux = DecoderLM(cfg, V, rngs=nnx.Rngs(0)).make_aux(seg, B, T)
  x = _x(7)
  want = _np_llama_block(block, x, aux.mask, aux.positions, 500.0)
  got = nnx.jit(lambda b, x: b(x, aux).y)(block, x)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def _perturb_every_param(block, seed, scale=0.25):
  """Adds deterministic normal(0, scale) noise to every parameter of ``block``: at
  initialisation the two norms' scales are equal (a swapped norm passes), diagonals are 0 and
  step sizes and preconditioners identical across heads, steps and sub-layers."""
  state = nnx.state(block, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  moved = [v + scale * jax.random.normal(k, v.shape, v.dtype) for v, k in zip(leaves, keys,
                                                                             strict=True)]
  nnx.update(block, jax.tree.unflatten(treedef, moved))


# T = 2 (per-step η and P) wherever the options differ between steps: a fixed and a
# co-evolving context, a layer and a step gate are the same at the first step.
OPTION_CASES = {
    "layer_gate": dict(mlp_condition="layer"),
    "layer_gate_t2": dict(mlp_condition="layer", num_steps=2),
    "coevolve_t2": dict(context="coevolve", num_steps=2),
    "coevolve_layer_gate_t2": dict(context="coevolve", mlp_condition="layer", num_steps=2),
    "joint_t2": dict(split="joint", num_steps=2),
    "joint_layer_gate_t2": dict(split="joint", mlp_condition="layer", num_steps=2),
    "joint_coevolve_t2": dict(split="joint", context="coevolve", num_steps=2),
    "strict_layer_gate": dict(strict_causal=True, mlp_condition="layer"),
    "strict_learn_beta_coevolve_t2": dict(strict_causal=True, learn_beta=True, learn_eta=False,
                                          eta_per_step=False, context="coevolve", num_steps=2),
    # the controls: a standard sub-layer inside the recursive block (its keys from the
    # current state at every step, no step size, no preconditioner)
    "llama_attention_layer_gate_t2": dict(cem_attention=False, mlp_condition="layer",
                                          num_steps=2, precond="mlp"),
    "llama_attention_joint_t2": dict(cem_attention=False, split="joint", num_steps=2,
                                     precond="mlp"),
    "llama_mlp_coevolve_t2": dict(cem_mlp=False, context="coevolve", num_steps=2,
                                  precond="attention"),
    # the attention energy's options (CEM_MATH.md §1) and the norm's (§5); rope_theta 50 turns
    # every frequency pair by a visible angle within T = 12 positions
    "rope_coevolve_t2": dict(rope=True, rope_theta=50.0, context="coevolve", num_steps=2),
    "per_head_bilinear_rope": dict(diagonal="per_head", rope=True, rope_theta=50.0),
    "per_head_distance_strict_t2": dict(diagonal="per_head", diagonal_form="distance",
                                        strict_causal=True, num_steps=2),
    "shared_distance_joint": dict(diagonal="shared", diagonal_form="distance", split="joint"),
    "chain_t2": dict(norm_mode="chain", num_steps=2),
    "none_layer_gate": dict(norm_mode="none", mlp_condition="layer"),
}


@pytest.mark.parametrize("update_mode", ["fused", "autodiff"])
@pytest.mark.parametrize("case", OPTION_CASES.values(), ids=OPTION_CASES.keys())
def test_context_gate_and_split_options_equal_the_float64_algorithm(case, update_mode):
  """model.mlp_condition, model.context, model.split, the standard sub-layers of
  model.cem_attention/cem_mlp=False, RoPE, the diagonals and model.norm_mode against the
  float64 Algorithm 1 (_np_cem_block) at non-initial parameters: every weight, norm scale,
  diagonal, per-step η and P moved, so the attention's and the MLP's norms differ and each
  step has its own η and P. A gate or context through the wrong norm or from the wrong state,
  a dropped residual, an un-rotation the wrong way, a diagonal term's sign or η, a chain rule
  applied after P instead of before fail here (the tied-Llama equivalence runs only the
  defaults at initial norm scales)."""
  options = dict(rope=False, update_mode=update_mode, eta_per_step=True, precond="both",
                 precond_rank=2, precond_shared=False)
  cfg = model_cfg(**(options | case))
  block = CEMBlock(cfg, rngs=nnx.Rngs(0))
  _perturb_every_param(block, 21)
  aux = DecoderLM(cfg, V, rngs=nnx.Rngs(0)).make_aux(None, B, T)
  x = _x(10)
  got = nnx.jit(lambda b, x: b(x, aux).y)(block, x)  # eager: several times the time
  _assert_float32_close(got, _np_cem_block(block, cfg, x, cfg.num_steps)[0])


def _assert_float32_close(got, want):
  """``got`` (float32) equals the float64 ``want`` up to float32 rounding: 1e-4 relative, or
  1e-5 of ``want``'s largest entry. An entry near 0 is a difference of terms as large as the
  largest (updates of norm ~50 here, from perturbed weights), each rounded to ε₃₂ ≈ 6e-8 and
  summed over d_model, heads and steps; measured ≤ 9e-7 of the largest entry at every case."""
  want = np.asarray(want, np.float64)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4,
                             atol=1e-5 * np.max(np.abs(want)))


# Non-quadratic energies (the softmax attention, the SiLU MLP) under the inner update rules
# of cem_jax.inner: each a T = 2 or joint case, with an incoming velocity that is not 0.
MOMENTUM_CASES = {
    "heavy_ball_t2": dict(inner_optimizer="heavy_ball", num_steps=2),
    "heavy_ball_joint_layer_gate_t2": dict(inner_optimizer="heavy_ball", split="joint",
                                           mlp_condition="layer", num_steps=2),
    "nesterov_t2": dict(inner_optimizer="nesterov", num_steps=2),
    "sphere_gd_t2": dict(manifold="sphere", num_steps=2),
    "sphere_heavy_ball_coevolve_t2": dict(manifold="sphere", inner_optimizer="heavy_ball",
                                          context="coevolve", num_steps=2),
    "sphere_nesterov_joint": dict(manifold="sphere", inner_optimizer="nesterov", split="joint"),
}


@pytest.mark.parametrize("case", MOMENTUM_CASES.values(), ids=MOMENTUM_CASES.keys())
def test_momentum_and_sphere_steps_equal_the_float64_algorithm(case):
  """model.inner_optimizer (heavy_ball, nesterov) and model.manifold='sphere' on the
  attention and MLP energies against the float64 Algorithm 1 (_np_cem_block), at perturbed
  parameters (μ = sigmoid(raw) away from ½) and a random incoming velocity (tangent at R(x) on
  the sphere): the output state and the velocity handed to the next layer. A momentum
  coefficient off, a velocity not carried from one sub-step to the next, a point not
  retracted or a velocity not re-projected onto the sphere fail here (tests/test_neighbours.py
  checks the rules on quadratic energies only)."""
  options = dict(rope=False, eta_per_step=True, precond="both", precond_rank=2,
                 precond_shared=False)
  cfg = model_cfg(**(options | case))
  block = CEMBlock(cfg, rngs=nnx.Rngs(0))
  _perturb_every_param(block, 22)
  aux = DecoderLM(cfg, V, rngs=nnx.Rngs(0)).make_aux(None, B, T)
  x = _x(11)
  v0 = 0.5 * np.asarray(jax.random.normal(jax.random.PRNGKey(12), x.shape), np.float64)
  if cfg.manifold == "sphere":
    v0 = _np_tangent(_np_retract(np.asarray(x, np.float64)), v0)
  out = nnx.jit(lambda b, x, v: b(x, aux, velocity=v))(block, x, jnp.asarray(v0, jnp.float32))
  want_y, want_v = _np_cem_block(block, cfg, x, cfg.num_steps, velocity=v0)
  _assert_float32_close(out.y, want_y)
  assert (out.velocity is None) == (want_v is None)
  if want_v is not None:
    _assert_float32_close(out.velocity, want_v)


@pytest.mark.parametrize("case", [dict(), dict(inner_optimizer="heavy_ball", manifold="sphere")],
                         ids=["gd", "sphere_heavy_ball"])
def test_shared_blocks_run_cyclically_as_the_float64_algorithm(case):
  """model.num_unique_blocks=2 of num_layers=4: layer l runs blocks[l % 2] (DecoderLM's
  docstring), each block perturbed differently, against the float64 chain embedding ->
  _np_cem_block of blocks 0, 1, 0, 1 (the velocity carried from layer to layer, zero at the
  embeddings) -> final norm. A block index l // G, or a velocity restarted per layer, fails."""
  cfg = model_cfg(num_layers=4, num_unique_blocks=2, rope=False, **case)
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(0))
  assert len(model.blocks) == 2
  _perturb_every_param(model, 23)
  tokens = jax.random.randint(jax.random.PRNGKey(24), (B, T), 0, V)
  got = nnx.jit(lambda m, t: m(t, hidden=True))(model, tokens)
  h, v = np.asarray(model.embedding[...], np.float64)[np.asarray(tokens)], None
  for layer in range(cfg.num_layers):
    h, v = _np_cem_block(model.blocks[layer % 2], cfg, h, cfg.num_steps, velocity=v)
  want = _np_rmsnorm(h, np.asarray(model.final_norm.scale[...], np.float64), cfg.norm_eps)
  _assert_float32_close(got, want)


GRADIENT_CASES = {
    "rope_fused": dict(rope=True, rope_theta=50.0, update_mode="fused"),
    "per_head_distance_autodiff": dict(diagonal="per_head", diagonal_form="distance",
                                       update_mode="autodiff"),
    "chain_coevolve_t2": dict(norm_mode="chain", context="coevolve", num_steps=2),
    "sphere_nesterov": dict(manifold="sphere", inner_optimizer="nesterov"),
}


@pytest.mark.parametrize("case", GRADIENT_CASES.values(), ids=GRADIENT_CASES.keys())
def test_input_gradient_equals_the_float64_algorithms_finite_difference(case):
  """What training differentiates: ``⟨∇_x Σ r ⊙ y(x), δ⟩`` (random r, δ) by jax.grad through
  the block against the float64 central difference of _np_cem_block along δ (step 1e-4: its
  error, measured against steps 1e-3 and 1e-5, ≤ 1e-7 of Σ|terms|). Catches what the forward
  value does not show, e.g. the context cut off from the gradient by a stop_gradient."""
  options = dict(rope=False, precond="both", precond_rank=2)
  cfg = model_cfg(**(options | case))
  block = CEMBlock(cfg, rngs=nnx.Rngs(0))
  _perturb_every_param(block, 25)
  aux = DecoderLM(cfg, V, rngs=nnx.Rngs(0)).make_aux(None, B, T)
  x = _x(13)
  kr, kd = jax.random.split(jax.random.PRNGKey(26))
  r = np.asarray(jax.random.normal(kr, x.shape), np.float64)
  delta = np.asarray(jax.random.normal(kd, x.shape), np.float64)
  graphdef, state = nnx.split(block)
  grad = jax.jit(jax.grad(lambda x: jnp.sum(nnx.merge(graphdef, state)(x, aux).y
                                            * jnp.asarray(r, jnp.float32))))(x)
  terms = np.asarray(grad, np.float64) * delta
  x64, h = np.asarray(x, np.float64), 1e-4
  loss = lambda x: np.sum(_np_cem_block(block, cfg, x, cfg.num_steps)[0] * r)  # noqa: E731
  want = (loss(x64 + h * delta) - loss(x64 - h * delta)) / (2 * h)
  # float32: each term rounded, the sum cancels: the scale is Σ|terms|, not the sum
  assert abs(terms.sum() - want) <= 1e-5 * np.abs(terms).sum(), (terms.sum(), want)


PER_STEP_CASES = {
    "eta_per_step": dict(eta_per_step=True),
    "precond_per_step": dict(precond="both", precond_rank=2, precond_shared=False),
    "both_per_step": dict(eta_per_step=True, precond="both", precond_rank=2,
                          precond_shared=False),
}


@pytest.mark.parametrize("steps", [2, 3, 4])
@pytest.mark.parametrize("case", PER_STEP_CASES.values(), ids=PER_STEP_CASES.keys())
def test_test_time_steps_beyond_t_reuse_the_last_steps_parameters(case, steps):
  """T=2 trained, run at T_eval=2..4: steps 3, 4 use step 2's η and P (documented), checked
  against a float64 NumPy Algorithm 1 with distinct random per-step η, P and norm scales."""
  cfg = model_cfg(rope=False, num_steps=2, **case)
  block = CEMBlock(cfg, rngs=nnx.Rngs(0))
  ks = iter(jax.random.split(jax.random.PRNGKey(11), 12))
  rand = lambda shape, s: s * jax.random.normal(next(ks), shape)  # noqa: E731
  block.attn.eta[...] = rand(block.attn.eta.shape, 0.8)
  block.mlp.eta[...] = rand(block.mlp.eta.shape, 0.8)
  block.norm_att.scale[...] = 1.0 + rand((D,), 0.2)
  block.norm_mlp.scale[...] = 1.0 + rand((D,), 0.2)
  for pc in (block.precond_att, block.precond_mlp):
    if pc is not None:
      pc.p[...] = rand(pc.p.shape, 1.0)
      pc.u[...] = rand(pc.u.shape, 0.3)
  aux = DecoderLM(cfg, V, rngs=nnx.Rngs(0)).make_aux(None, B, T)
  x = _x(3)
  y = block(x, aux, num_steps=steps).y
  np.testing.assert_allclose(np.asarray(y), _np_cem_block(block, cfg, x, steps)[0],
                             rtol=1e-4, atol=1e-5)


def test_per_step_preconditioner_beyond_t_is_the_last_steps():
  """Preconditioner with one P per step (model.precond_shared=False, T=2): step t applies
  P_{min(t, T-1)}, checked against the float64 NumPy P v with distinct random P_1, P_2."""
  cfg = model_cfg(num_steps=2, precond="both", precond_rank=3, precond_shared=False)
  pc = CEMBlock(cfg, rngs=nnx.Rngs(0)).precond_att
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(12), 3)
  pc.p[...] = jax.random.normal(k1, pc.p.shape)
  pc.u[...] = 0.5 * jax.random.normal(k2, pc.u.shape)
  v = jax.random.normal(k3, (B, T, D))
  p, u = np.asarray(pc.p[...], np.float64), np.asarray(pc.u[...], np.float64)
  assert p.shape == (2, D)
  for step, used in [(0, 0), (1, 1), (2, 1), (3, 1), (4, 1)]:
    want = _np_precondition(np.asarray(v, np.float64), p[used], u[used], cfg.precond_eps)
    np.testing.assert_allclose(np.asarray(pc(v, step)), want, rtol=1e-5, atol=1e-6)


def test_per_step_attention_eta_beyond_t_is_the_last_steps():
  """model.eta_per_step=True, T=2: the attention η of step t >= T is softplus(raw[T-1])."""
  cfg = model_cfg(num_steps=2, eta_per_step=True)
  attn = CEMBlock(cfg, rngs=nnx.Rngs(0)).attn
  attn.eta[...] = jax.random.normal(jax.random.PRNGKey(13), attn.eta.shape)
  raw = np.asarray(attn.eta[...], np.float64)
  assert raw.shape == (2, H)
  for step, used in [(0, 0), (1, 1), (2, 1), (3, 1), (5, 1)]:
    np.testing.assert_allclose(np.asarray(attn.energy_params(step, jnp.float32)["eta"]),
                               np.logaddexp(0.0, raw[used]), rtol=1e-6)


def test_the_aux_positions_a_user_energy_reads_are_absolute_token_positions():
  # The built-ins see only i - j (RoPE), so shifting every position passed every other test;
  # EnergyAux.positions is public, and a user energy may read absolute positions.
  from cem_jax.model import decoding_aux, training_aux
  cfg = get_default_config().model
  segment_ids = jnp.asarray([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]], jnp.int32)
  for ids in (None, segment_ids):
    aux = training_aux(cfg, ids, 2, 6)
    np.testing.assert_array_equal(np.asarray(aux.positions), np.tile(np.arange(6), (2, 1)))
    np.testing.assert_array_equal(np.asarray(aux.context_positions), np.asarray(aux.positions))
  aux = decoding_aux(cfg, 2, 3, 8, 4)  # 3 new tokens at positions 4, 5, 6 of an 8-slot cache
  np.testing.assert_array_equal(np.broadcast_to(np.asarray(aux.positions), (2, 3)),
                                np.tile([4, 5, 6], (2, 1)))
  np.testing.assert_array_equal(np.broadcast_to(np.asarray(aux.context_positions), (2, 8)),
                                np.tile(np.arange(8), (2, 1)))


def test_learned_beta_and_preconditioner_start_at_their_documented_values():
  """At initialisation a learned β is the fixed β, 1/√d_h (CEM_MATH.md §1), and a
  preconditioner is the identity, softplus(p) + eps = 1 (§3): with U = 0 (rank 0) P v = v, so
  the block equals the block without them."""
  cfg = model_cfg(learn_beta=True, learn_eta=False, precond="both", precond_rank=0)
  block = CEMBlock(cfg, rngs=nnx.Rngs(0))
  beta = np.asarray(block.attn.energy_params(0, jnp.float32)["beta"])
  np.testing.assert_allclose(beta, np.full(H, (D // H) ** -0.5), rtol=1e-6)
  v = _x(5)
  for pc in (block.precond_att, block.precond_mlp):
    np.testing.assert_allclose(np.asarray(pc(v, 0)), np.asarray(v), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("diagonal", ["per_head", "shared"])
def test_a_diagonal_starts_at_zero_and_each_head_reads_its_own(diagonal):
  """CEM_MATH.md §1: ``d_k = 0`` at initialisation (a block with a diagonal starts as the block
  without one); once trained, 'per_head' hands head k its own row and 'shared' hands every
  head the same vector."""
  attn = CEMBlock(model_cfg(diagonal=diagonal), rngs=nnx.Rngs(0)).attn
  shape = (H, D) if diagonal == "per_head" else (D,)
  assert attn.diag.shape == shape
  np.testing.assert_array_equal(np.asarray(attn.diag[...]), np.zeros(shape))
  trained = jax.random.normal(jax.random.PRNGKey(14), shape)
  attn.diag[...] = trained
  np.testing.assert_array_equal(np.asarray(attn.energy_params(1, jnp.float32)["diag"]),
                                np.broadcast_to(np.asarray(trained), (H, D)))


PROBE_ENERGY = '''
import jax.numpy as jnp


def probe(y, context, params, aux):
  """Per token i: 1 + 2·(keys i sees) + Σ_m (y_im + ½)² + 3 Σ_m (c_im - ¼)², summed. Not 0 at
  a padding token (y = c = 0, no key): 1 + d/4 + 3d/16."""
  seen = jnp.sum(aux.mask, axis=-1)
  return jnp.sum(1.0 + 2.0 * seen + jnp.sum((y + 0.5) ** 2, -1)
                 + 3.0 * jnp.sum((context - 0.25) ** 2, -1))
'''


@pytest.mark.parametrize("document_mask", [True, False])
def test_energy_trace_of_a_padded_batch_is_the_sum_over_its_real_tokens(tmp_path, document_mask):
  """CEMBlock._energy sums a user energy over the real tokens: padding is evaluated at
  y = c = 0 seeing no key, seen by none, and what one such token contributes (padding_energy)
  is taken off per padding token. Checked with an energy that is not 0 at padding and reads
  the mask, against the float64 sum over the real tokens alone; padding leads row 2, so real
  queries would see padded keys under document_mask=False without the key mask."""
  path = tmp_path / "probe.py"
  path.write_text(PROBE_ENERGY)
  cfg = model_cfg(attention_energy=f"{path}:probe", document_mask=document_mask)
  block = CEMBlock(cfg, rngs=nnx.Rngs(0))
  block.norm_att.scale[...] = 1.0 + 0.3 * jax.random.normal(jax.random.PRNGKey(15), (D,))
  seg = np.array([[1] * 5 + [2] * 4 + [0] * 3, [0] * 3 + [1] * 9])
  real = seg > 0
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(0))
  aux = model.make_aux(jnp.asarray(seg) if document_mask else None, B, T)
  aux = aux.replace(real=jnp.asarray(real))  # as DecoderLM does
  x = _x(6)
  got = float(nnx.jit(lambda b, x: b(x, aux, trace=True).trace)(block, x)[0]["att_before"])
  view = _np_rmsnorm(np.asarray(x, np.float64), np.asarray(block.norm_att.scale[...]),
                     cfg.norm_eps)
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  sees = (j <= i) & real[:, :, None] & real[:, None, :]
  if document_mask:
    sees &= seg[:, :, None] == seg[:, None, :]
  per_token = (1.0 + 2.0 * sees.sum(-1) + np.sum((view + 0.5) ** 2, -1)
               + 3.0 * np.sum((view - 0.25) ** 2, -1))
  want = per_token[real].sum()
  assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_energy_trace_of_one_step_equals_the_float64_energies():
  """The trace's four energies against CEM_MATH.md §1, §2 and §4 in float64, at random norm
  scales and step sizes: E_att of norm_att(y) against the fixed context norm_att(x), before
  and after the attention step; E_mlp (ReLU potential, Φ = ½relu²) of norm_mlp(y) gated by
  norm_mlp of the state entering the MLP step, before and after it."""
  cfg = model_cfg(rope=False, mlp_energy="relu")
  block = CEMBlock(cfg, rngs=nnx.Rngs(0))
  ks = jax.random.split(jax.random.PRNGKey(19), 4)
  block.norm_att.scale[...] = 1.0 + 0.3 * jax.random.normal(ks[0], (D,))
  block.norm_mlp.scale[...] = 1.0 + 0.3 * jax.random.normal(ks[1], (D,))
  block.attn.eta[...] = 0.8 * jax.random.normal(ks[2], block.attn.eta.shape)
  block.mlp.eta[...] = 0.8 * jax.random.normal(ks[3], block.mlp.eta.shape)
  x = _x(8)
  aux = DecoderLM(cfg, V, rngs=nnx.Rngs(0)).make_aux(None, B, T)
  trace = nnx.jit(lambda b, x: b(x, aux, trace=True).trace)(block, x)  # eager: 4x the time

  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  wq, wk, w, g = (f64(a[...]) for a in (block.attn.w_q, block.attn.w_k, block.mlp.w,
                                           block.mlp.g))
  eta_att, eta_mlp = np.logaddexp(0.0, f64(block.attn.eta[...])[0]), np.logaddexp(
      0.0, f64(block.mlp.eta[...])[0])
  norm_att = lambda v: _np_rmsnorm(v, f64(block.norm_att.scale[...]), cfg.norm_eps)  # noqa: E731
  norm_mlp = lambda v: _np_rmsnorm(v, f64(block.norm_mlp.scale[...]), cfg.norm_eps)  # noqa: E731
  beta = 1.0 / np.sqrt(D // H)
  keys = np.einsum("bjd,dhe->bjhe", norm_att(f64(x)), wk)
  causal = np.arange(T)[None, :] <= np.arange(T)[:, None]

  def attention(v):  # (E_att, -∇_g E_att) at g = norm_att(v)
    s = beta * np.einsum("bihe,bjhe->bhij", np.einsum("bid,dhe->bihe", norm_att(v), wq), keys)
    s = np.where(causal, s, -np.inf)
    top = s.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(s - top).sum(-1))
    a = np.exp(s - lse[..., None])
    heads = np.einsum("bhij,bjhe->bihe", a, keys) * eta_att[:, None]
    return -np.sum(lse * (eta_att / beta)[:, None]), np.einsum("bihe,dhe->bid", heads, wq)

  def mlp(v, gate):  # (E_mlp, -∇_g E_mlp) at g = norm_mlp(v)
    pre, up = norm_mlp(v) @ w, gate @ g
    return -eta_mlp * np.sum(up * 0.5 * np.maximum(pre, 0) ** 2), eta_mlp * (
        np.maximum(pre, 0) * up) @ w.T

  att_before, u = attention(f64(x))
  y1 = f64(x) + u
  gate = norm_mlp(y1)
  mlp_before, u = mlp(y1, gate)
  y2 = y1 + u
  want = {"att_before": att_before, "att_after": attention(y1)[0], "mlp_before": mlp_before,
          "mlp_after": mlp(y2, gate)[0]}
  got = {k: float(v) for k, v in trace[0].items()}
  assert got.keys() == want.keys()
  for key in want:
    assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), (key, got[key], want[key])
