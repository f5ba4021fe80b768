"""The attention entry point, kernel choice, blockwise energy and bf16 scores.

Every kernel that runs on CPU (XLA; Pallas splash attention in interpret mode) is checked
against a float64 NumPy reference written from the maths (attention, its gradient, the
interaction energy and its closed-form negative gradient, CEM_MATH.md section 1), with packed
documents, padding, strict causality, RoPE and the decoding mask.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cem_jax import attention, masks, preflight, updates
from cem_jax.energies import (
  EnergyAux,
  blockwise_logsumexp,
  interaction_energy,
  interaction_fused_update,
  make_mask,
)
from cem_jax.masks import mask_block
from cem_jax.model import DecoderLM
from tests.conftest import np_rope, tiny_config

TOL = 1e-5


# ---- float64 NumPy reference ----------------------------------------------------------------

def np_softmax(s, mask):
  s = np.where(mask, s, -np.inf)
  top = np.max(s, axis=-1, keepdims=True)
  top = np.where(np.isfinite(top), top, 0.0)
  p = np.where(mask, np.exp(s - top), 0.0)
  den = p.sum(-1, keepdims=True)
  lse = np.where(den[..., 0] > 0, top[..., 0] + np.log(np.where(den > 0, den, 1.0))[..., 0], 0)
  return p / np.where(den > 0, den, 1.0), lse


def np_attention(q, k, v, mask, scale, cot):
  """Output and the gradients (dq, dk, dv) of ``sum(out * cot)``; empty rows give 0."""
  q, k, v, cot = (np.asarray(x, np.float64) for x in (q, k, v, cot))
  m = np.asarray(mask, bool)[:, None]
  p, _ = np_softmax(np.einsum("bthe,bshe->bhts", q, k) * scale, m)
  out = np.einsum("bhts,bshe->bthe", p, v)
  dp = np.einsum("bthe,bshe->bhts", cot, v)
  ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
  dq = scale * np.einsum("bhts,bshe->bthe", ds, k)
  dk = scale * np.einsum("bhts,bthe->bshe", ds, q)
  dv = np.einsum("bhts,bthe->bshe", p, cot)
  return out, dq, dk, dv


def np_energy_and_update(y, c, params, mask, pos, rope, form=None):
  """The interaction energy and its negative gradient ``-∇_y E`` in closed form."""
  y, c = np.asarray(y, np.float64), np.asarray(c, np.float64)
  p = {n: np.asarray(a, np.float64) for n, a in params.items()}
  q = np.einsum("btd,dhk->bthk", y, p["w_q"])
  k = np.einsum("bsd,dhk->bshk", c, p["w_k"])
  if rope:
    q, k = np_rope(q, pos, 10_000.0), np_rope(k, pos, 10_000.0)
  s = np.einsum("bthk,bshk->bhts", q, k)
  if form is not None:
    d = p["diag"]
    s = s + np.einsum("btd,hd,bsd->bhts", y, d, c)
    if form == "distance":
      s = s - 0.5 * (np.einsum("btd,hd->bht", y * y, d)[..., None]
                     + np.einsum("bsd,hd->bhs", c * c, d)[:, :, None])
  beta, eta = p["beta"], p["eta"]
  a, lse = np_softmax(s * beta[:, None, None], np.asarray(mask, bool)[:, None])
  energy = -np.sum(lse * (eta / beta)[:, None])
  agg = np.einsum("bhts,bshk->bthk", a, k)
  if rope:
    agg = np_rope(agg, pos, 10_000.0, inverse=True)
  update = np.einsum("bthk,dhk->btd", agg * eta[:, None], p["w_q"])
  if form is not None:
    cagg = np.einsum("bhts,bsd->bthd", a, c)
    if form == "distance":
      cagg = cagg - y[:, :, None] * np.asarray(mask, bool).any(-1)[..., None, None]
    update = update + np.einsum("bthd,hd->btd", cagg * eta[:, None], p["diag"])
  return energy, update


def rel(a, ref):
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


# ---- shared inputs --------------------------------------------------------------------------

B, T, H, E = 2, 128, 2, 16
# Document 1 ends at 40, 2 at 97, then padding; row 2 is one document and padding.
SEGMENTS = np.zeros((B, T), np.int32)
SEGMENTS[0, :40], SEGMENTS[0, 40:97], SEGMENTS[1, :70] = 1, 2, 1
# Ids need not be contiguous runs or increase: document 1 comes back after document 2 (rows
# 60.. see 0..39); in row 2 the smallest id starts at 30, between two runs of 3, no padding.
RETURNING = SEGMENTS.copy()
RETURNING[0, 60:97] = 1
RETURNING[1, :30], RETURNING[1, 30:70], RETURNING[1, 70:] = 3, 1, 3


def _qkv(seed):
  r = np.random.default_rng(seed)
  return [jnp.asarray(r.normal(size=(B, T, H, E)), jnp.float32) for _ in range(4)]


def _structure(kind):
  """(kwargs for dot_product_attention, dense mask) of one mask structure; ``<kind>/alone``:
  the structure without the dense mask (the kernel works out the visible rows itself)."""
  if kind.endswith("/alone"):
    kwargs, mask = _structure(kind.removesuffix("/alone"))
    return {k: v for k, v in kwargs.items() if k != "mask"}, mask
  seg = jnp.asarray(SEGMENTS)
  if kind == "strict":
    return dict(is_causal=True, strict_causal=True), np.asarray(make_mask(None, T, B, strict=True))
  if kind == "causal":
    return dict(is_causal=True), np.asarray(make_mask(None, T, B))
  if kind == "documents":
    mask = make_mask(seg, T, B)
    return dict(is_causal=True, segment_ids=seg, mask=mask), np.asarray(mask)
  if kind == "strict_returning":
    seg = jnp.asarray(RETURNING)
    kind = "strict_documents"
  if kind == "strict_documents":
    mask = make_mask(seg, T, B, strict=True)
    return (dict(is_causal=True, strict_causal=True, segment_ids=seg, mask=mask),
            np.asarray(mask))
  assert kind == "decode"  # 3 new tokens at positions 50.. against a 128-slot cache
  q_pos = 50 + np.arange(3)
  mask = np.broadcast_to(np.arange(T)[None, :] <= q_pos[:, None], (B, 3, T))
  return dict(mask=jnp.asarray(mask)), mask


CASES = [("xla", "causal"), ("xla", "documents"), ("xla", "strict_documents"),
         ("xla", "decode"), ("splash", "causal"), ("splash", "documents"),
         ("splash", "strict_documents")]
# The structure alone (no dense mask): the kernel builds the mask or takes segment ids, and
# the entry point works out which rows see no key (masks.visible_rows without a mask).
CASES += [(impl, kind + "/alone") for impl in ("xla", "splash")
          for kind in ("strict", "documents", "strict_documents", "strict_returning")]


@pytest.mark.parametrize("impl,kind", CASES)
def test_entry_point_and_its_gradient_equal_the_float64_reference(impl, kind):
  q, k, v, cot = _qkv(seed=len(impl) * 10 + len(kind))
  kwargs, mask = _structure(kind)
  if kind == "decode":
    q, cot = q[:, 50:53], cot[:, 50:53]
  scale = 0.3

  def f(q, k, v):
    return attention.dot_product_attention(q, k, v, scale=scale, implementation=impl,
                                           **kwargs)

  out, vjp = jax.vjp(f, q, k, v)
  grads = vjp(cot)
  ref = np_attention(q, k, v, mask, scale, cot)
  for name, got, want in zip(["out", "dq", "dk", "dv"], (out, *grads), ref, strict=True):
    assert np.all(np.isfinite(np.asarray(got))), name
    assert rel(got, want) <= TOL, (name, rel(got, want))
  empty = ~mask.any(-1)
  if empty.any():  # padded rows and a document's first token under strict causality
    assert np.all(np.asarray(out)[empty] == 0.0)


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_with_causal_structure_the_empty_rows_come_from_it_not_from_the_mask(impl):
  # Splash reads no dense mask: were the rows taken from it, an n x n array would live on
  # (under remat, a residual of every layer) for a row-wise test the segment ids answer.
  # A mask that sees everything must not un-zero the padded rows.
  q, k, v, _ = _qkv(seed=11)
  kwargs, mask = _structure("documents")
  everything = jnp.ones((B, T, T), bool)
  out = attention.dot_product_attention(q, k, v, scale=0.3, implementation=impl,
                                        **{**kwargs, "mask": everything})
  assert np.all(np.asarray(out)[~mask.any(-1)] == 0.0)
  if impl == "splash":  # the kernel takes the segment ids: the output is the reference's
    ref = np_attention(q, k, v, mask, 0.3, np.zeros_like(q))[0]
    assert rel(out, ref) <= TOL


def _attention_params(seed, d, heads, dh, diag=False):
  r = np.random.default_rng(seed)
  p = {"w_q": jnp.asarray(0.4 * r.normal(size=(d, heads, dh)), jnp.float32),
       "w_k": jnp.asarray(0.4 * r.normal(size=(d, heads, dh)), jnp.float32),
       "eta": jnp.asarray([1.0, 0.6][:heads], jnp.float32),
       "beta": jnp.asarray([dh**-0.5, 0.5][:heads], jnp.float32)}
  if diag:
    p["diag"] = jnp.asarray(0.3 * r.normal(size=(heads, d)), jnp.float32)
  return p


def _training_aux(kind, impl="xla", rope=True, block=0, form="bilinear"):
  seg = jnp.asarray(SEGMENTS)
  strict = kind == "strict_documents"
  use_seg = seg if kind != "causal" else None
  return EnergyAux(mask=make_mask(use_seg, T, B, strict=strict),
                   positions=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
                   rope_theta=10_000.0 if rope else None, diagonal_form=form,
                   is_plain_causal=kind == "causal", segment_ids=use_seg, is_causal=True,
                   strict_causal=strict, attention_impl=impl, energy_block_size=block)


# "causal": plain causal structure (model.document_mask=False), the update's is_causal-only
# kernel call; without it scale=1 could be lost there unseen (both kernels changed alike).
@pytest.mark.parametrize("impl,kind", [("xla", "documents"), ("splash", "documents"),
                                       ("splash", "strict_documents"), ("xla", "causal"),
                                       ("splash", "causal")])
def test_fused_cem_update_with_each_kernel_equals_the_reference_gradient(impl, kind):
  d = 16
  r = np.random.default_rng(7)
  y, c = (jnp.asarray(r.normal(size=(B, T, d)), jnp.float32) for _ in range(2))
  params = _attention_params(8, d, H, 8)
  aux = _training_aux(kind, impl)
  update = interaction_fused_update(y, c, params, aux)
  _, want = np_energy_and_update(y, c, params, aux.mask, aux.positions, rope=True)
  assert rel(update, want) <= TOL
  assert np.all(np.asarray(update)[~np.asarray(aux.mask).any(-1)] == 0.0)
  if impl != "xla":  # training differentiates the update: the kernel's VJP must agree too
    def loss(p, a):
      return jnp.sum(interaction_fused_update(y, c, p, a) * c)

    g_kernel = jax.grad(loss)(params, aux)
    g_xla = jax.grad(loss)(params, aux.replace(attention_impl="xla"))
    for name in ("w_q", "w_k", "eta"):
      assert rel(g_kernel[name], g_xla[name]) <= TOL, name


@pytest.mark.parametrize("block", ["llama", "cem"])
def test_blocks_give_the_same_output_with_splash_as_with_xla(block):
  cfg = tiny_config(block, **{"model.d_model": 32, "model.num_heads": 2}).model
  model = DecoderLM(cfg, 64, rngs=nnx.Rngs(0))
  seg = jnp.asarray(SEGMENTS)
  aux = model.make_aux(seg, B, T)
  assert aux.attention_impl == "xla"  # auto on CPU
  x = jax.random.normal(jax.random.PRNGKey(0), (B, T, 32))
  ref = model.blocks[0](x, aux)[0]
  got = model.blocks[0](x, aux.replace(attention_impl="splash"))[0]
  assert rel(got, ref) <= TOL


# ---- kernel choice -------------------------------------------------------------------------

def test_auto_is_xla_on_cpu_and_logs_one_line_with_the_reason(caplog):
  from cem_jax import model as model_lib

  model_lib._LOGGED.clear()
  with caplog.at_level(logging.INFO, logger="absl"):
    m = DecoderLM(tiny_config("llama").model, 64, rngs=nnx.Rngs(0))
    DecoderLM(tiny_config("llama").model, 64, rngs=nnx.Rngs(1))  # same choice: no new line
  assert m.attention_impl == "xla" and "cpu" in m.attention_reason
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention:")]
  assert lines == ["attention: xla (auto: platform cpu has no flash kernel here, XLA "
                   "attention); cached decoding: xla"]


@pytest.mark.parametrize("form,width", [("bilinear", 16 + 64), ("distance", 16 + 64 + 1)])
def test_a_diagonal_model_stays_on_xla_and_its_log_line_says_it_is_the_augmented_head(
    caplog, form, width):
  # Issue 12: the per-head diagonal's augmented head (d_h + d + 1) is beyond flash head
  # sizes; the model keeps it on XLA on every platform and says so in its one log line (not
  # "cpu has no flash kernel", which would hide that a GPU would not run cuDNN for it either).
  # d_model 64, 4 heads: d_h 16.
  from cem_jax import model as model_lib

  cfg = tiny_config("cem", **{"model.diagonal": "per_head", "model.diagonal_form": form,
                              "model.dtype": "bfloat16"}).model
  model_lib._LOGGED.clear()
  with caplog.at_level(logging.INFO, logger="absl"):
    m = DecoderLM(cfg, 64, rngs=nnx.Rngs(0))
  why = (f"auto: the CEM diagonal attends with one augmented head of width {width} (d_h + "
         "d_model, + 1 in the distance form), beyond flash kernels' head sizes")
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention:")]
  assert lines == [f"attention: xla ({why}); cached decoding: xla"]
  for platform in ("gpu", "tpu"):  # bf16, head_dim 16: cuDNN / splash would take Llama's
    assert model_lib.resolve_attention(cfg, m.blocks, platform=platform) == ("xla", why)
  cfg.attention_impl = "cudnn"  # explicit: refused when the model is built, not at trace
  with pytest.raises(ValueError, match=rf"^model.attention_impl='cudnn' cannot run: .*"
                                       rf"augmented head of width {width} "):
    model_lib.resolve_attention(cfg, m.blocks, platform="gpu")


@pytest.mark.parametrize("platform,dtype,extra,want", [
    ("gpu", "bfloat16", {}, "cudnn"),
    ("gpu", "float32", {}, "xla"),
    ("gpu", "bfloat16", {"augmented_head_dim": 8 + 32 + 1}, "xla"),
    ("gpu", "bfloat16", {"head_dim": 12}, "xla"),
    ("tpu", "bfloat16", {}, "splash"),
    ("tpu", "float32", {"seq_len": 100}, "xla"),
    ("tpu", "bfloat16", {"augmented_head_dim": 8 + 32 + 1}, "xla"),
    ("cpu", "bfloat16", {}, "xla"),
])
def test_auto_picks_the_fastest_kernel_the_platform_allows(platform, dtype, extra, want):
  kwargs = {"head_dim": 64, **extra}
  impl, reason = attention.resolve("auto", platform=platform, dtype=dtype, **kwargs)
  assert impl == want and reason.startswith("auto:")
  if "augmented_head_dim" in extra:  # said as such, not as a flash kernel's refusal
    assert reason.startswith("auto: the CEM diagonal attends with one augmented head"), reason


@pytest.mark.parametrize("capability,limit", [("8.0", 128), ("8.9", 128), ("9.0", 256),
                                              ("10.0", 256)])
def test_cudnn_head_dims_up_to_the_limit_run_and_hopper_on_allows_256(monkeypatch, capability,
                                                                      limit):
  # The limit itself is allowed, explicitly and under 'auto'; one step of 8 beyond it is not.
  from types import SimpleNamespace

  gpu = SimpleNamespace(compute_capability=capability)  # what jax.devices()[0] says on a GPU
  monkeypatch.setattr(jax, "devices", lambda *a: [gpu])
  assert attention.cudnn_max_head_dim("gpu") == limit
  for requested in ("cudnn", "auto"):
    assert attention.resolve(requested, platform="gpu", dtype="bfloat16",
                             head_dim=limit)[0] == "cudnn"
  assert attention.resolve("auto", platform="gpu", dtype="bfloat16",
                           head_dim=limit + 8)[0] == "xla"
  with pytest.raises(ValueError, match=f"head_dim={limit + 8} must be a multiple of 8 and "
                                       f"<= {limit}$"):
    attention.resolve("cudnn", platform="gpu", dtype="bfloat16", head_dim=limit + 8)


def test_validation_without_a_machine_allows_what_some_gpu_runs_and_refuses_unknown_names():
  # platform None (config validation, before jax starts): Hopper's 256 is possible.
  assert attention.resolve("cudnn", platform=None, dtype="bfloat16", head_dim=256) == (
      "cudnn", "explicit")
  with pytest.raises(ValueError, match="head_dim=264 must be a multiple of 8 and <= 256$"):
    attention.resolve("cudnn", platform=None, dtype="bfloat16", head_dim=264)
  # float32: before the machine is known the refusal names the GPU too (a CPU user reads this
  # line first); once it is known, the platform's own problem says it, once.
  with pytest.raises(ValueError, match=r"cannot run: it needs model.dtype=bfloat16 \(cuDNN "
                                       r"flash attention, an NVIDIA GPU kernel, has no float32\)$"):
    attention.resolve("cudnn", platform=None, dtype="float32", head_dim=64)
  with pytest.raises(ValueError, match=r"cannot run: it needs an NVIDIA GPU, this machine's "
                                       r"platform is cpu \(use 'auto' or 'xla' here\); it needs "
                                       r"model.dtype=bfloat16 \(cuDNN flash attention has no "
                                       r"float32\)$"):
    attention.resolve("cudnn", platform="cpu", dtype="float32", head_dim=64)
  # resolve is public (tools, tests call it without config.validate): it checks the name.
  with pytest.raises(ValueError, match=r"^model.attention_impl='flash'; allowed: auto, xla, "
                                       r"cudnn, splash$"):
    attention.resolve("flash", platform="cpu", dtype="float32", head_dim=64)


def test_cudnn_takes_every_head_dim_multiple_of_8_and_off_a_gpu_the_limit_is_128():
  assert attention.resolve("cudnn", platform=None, dtype="bfloat16", head_dim=72) == (
      "cudnn", "explicit")
  with pytest.raises(ValueError, match="head_dim=68 must be a multiple of 8 and <= 256$"):
    attention.resolve("cudnn", platform=None, dtype="bfloat16", head_dim=68)
  assert attention.cudnn_max_head_dim("cpu") == attention.cudnn_max_head_dim("tpu") == 128


@pytest.mark.parametrize("impl,platform,words", [
    ("cudnn", "tpu", "it needs an NVIDIA GPU, this machine's platform is tpu"),
    ("splash", "gpu", "splash attention is a TPU kernel, this machine's platform is gpu"),
    ("splash", "tpu", "the CEM diagonal attends with one augmented head of width 41")])
def test_a_kernel_of_the_other_accelerator_or_for_the_augmented_head_is_refused(
    impl, platform, words):
  wide = {"augmented_head_dim": 41} if "augmented" in words else {}
  with pytest.raises(ValueError, match=rf"^model.attention_impl='{impl}' cannot run: {words}"):
    attention.resolve(impl, platform=platform, dtype="bfloat16", head_dim=8, seq_len=128,
                      **wide)


def test_splash_at_a_length_not_a_multiple_of_128_is_a_one_line_error():
  q = jnp.zeros((1, 64, 1, 8))
  with pytest.raises(ValueError, match=r"^attention_impl='splash': seq_len=64 must be a "
                                       r"multiple of 128$"):
    attention.dot_product_attention(q, q, q, scale=1.0, implementation="splash",
                                    is_causal=True)


def test_rows_with_no_visible_key_are_zero_when_the_kernel_leaves_them_nan(monkeypatch):
  # cuDNN may leave an empty row non-finite: the entry point selects zeros, not multiplies.
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda q, k, v, **kw: jnp.full(q.shape, jnp.nan, q.dtype))
  seg = jnp.asarray([[1, 1, 2, 2, 0, 0, 0, 0]], jnp.int32)
  q = jnp.ones((1, 8, 1, 8))
  out = attention.dot_product_attention(q, q, q, scale=1.0, implementation="cudnn",
                                        mask=make_mask(seg, 8, 1), is_causal=True,
                                        segment_ids=seg)
  assert np.all(np.asarray(out)[0, 4:] == 0.0)


def test_an_autodiff_cem_update_says_it_calls_no_kernel_and_whose_gradient_it_is():
  from cem_jax.model import resolve_attention

  cfg = tiny_config("cem", **{"model.update_mode": "autodiff", "model.dtype": "bfloat16"})
  blocks = DecoderLM(cfg.model, 64, rngs=nnx.Rngs(0)).blocks
  assert resolve_attention(cfg.model, blocks, platform="gpu") == (
      "xla", "no attention kernel: the CEM update is jax.grad of the energy 'softmax' "
      "(model.update_mode='autodiff', model.energy_block_size=0)")


def test_the_model_picks_splash_on_tpu_and_lays_it_out_by_the_mesh_rules():
  from cem_jax.model import resolve_attention
  from cem_jax.steps import build_model

  cfg = tiny_config("llama", **{"model.dtype": "bfloat16"})
  blocks = DecoderLM(cfg.model, 64, rngs=nnx.Rngs(0)).blocks
  assert resolve_attention(cfg.model, blocks, platform="tpu")[0] == "splash"
  # Rows over the mesh axes of 'batch', heads over those of 'heads' (splash runs per device in
  # shard_map; tests/test_sharding.py runs it on a 2 x 1 x 2 mesh).
  assert build_model(cfg, 64).make_aux(None, 2, 128).attention_partition == (
      ("data", "fsdp"), ("tensor",))
  cfg.mesh.rules = [["batch", "data"], ["heads", None]]
  assert build_model(cfg, 64).make_aux(None, 2, 128).attention_partition == (("data",), ())


@pytest.mark.parametrize("impl,bad,good,multiple", [("splash", 64, 128, 128),
                                                     ("cudnn", 63, 64, 2)])
def test_a_kernel_at_a_length_it_cannot_take_fails_if_asked_for_and_is_xla_under_auto(
    impl, bad, good, multiple):
  # cuDNN: jax's training rule always passes a bias operand, and cuDNN with a bias needs even
  # lengths; an odd seq_len on a GPU was a traceback at the first compile.
  from cem_jax import model as model_lib

  cfg = tiny_config("llama", **{"model.attention_impl": impl}).model
  with pytest.raises(ValueError, match=rf"^model.attention_impl='{impl}' cannot run: "
                                       rf"seq_len={bad} must be a multiple of {multiple} "
                                       r"\(use 'auto', which runs XLA there, or 'xla'\)$"):
    model_lib.training_aux(cfg, None, 2, bad, impl)
  assert model_lib.training_aux(cfg, None, 2, good, impl).attention_impl == impl
  cfg.attention_impl = "auto"
  assert model_lib.training_aux(cfg, None, 2, bad, impl).attention_impl == "xla"
  assert model_lib.training_aux(cfg, None, 2, good, impl).attention_impl == impl
  platform = {"splash": "tpu", "cudnn": "gpu"}[impl]
  assert attention.resolve("auto", platform=platform, dtype="bfloat16", head_dim=64,
                           seq_len=bad)[0] == "xla"
  assert attention.resolve("auto", platform=platform, dtype="bfloat16", head_dim=64,
                           seq_len=good)[0] == impl


@pytest.mark.parametrize("kind,causal", [("documents", True), ("strict_documents", True),
                                         ("decode", False)])
def test_cudnn_gets_its_causal_mask_beside_a_document_mask(monkeypatch, kind, causal):
  # Without is_causal, jax's cuDNN call takes no causal mask type and computes all n x n
  # tiles for a document mask; decoding against a cache is not causal (t != s).
  calls = []
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda q, k, v, **kw: calls.append(kw) or q)
  q, k, v, _ = _qkv(seed=3)
  kwargs, mask = _structure(kind)
  attention.dot_product_attention(q[:, :3] if kind == "decode" else q, k, v, scale=0.3,
                                  implementation="cudnn", **kwargs)
  (kw,) = calls
  assert kw["implementation"] == "cudnn" and kw["is_causal"] is causal
  assert np.array_equal(np.asarray(kw["mask"])[:, 0], mask)


@pytest.mark.parametrize("overrides,match", [
    ({"model.attention_impl": "cudnn"}, r"needs model.dtype=bfloat16 \(cuDNN flash "
     r"attention, an NVIDIA GPU kernel, has no float32\)$"),
    ({"model.attention_impl": "cudnn", "model.dtype": "bfloat16", "model.diagonal": "per_head"},
     "augmented head of width 80 \\(d_h \\+ d_model"),
    ({"model.attention_impl": "splash", "data.seq_len": 64}, "data.seq_len=64 must be a "
     "multiple of 128"),
    ({"model.attention_impl": "cudnn", "model.dtype": "bfloat16", "model.head_dim": 12},
     "head_dim=12 must be a multiple of 8"),  # the explicit head width, not d_model / heads
    ({"model.attention_impl": "cudnn", "model.dtype": "bfloat16", "data.seq_len": 63},
     "data.seq_len=63 must be a multiple of 2$"),
    ({"model.attention_impl": "flash"}, "allowed: auto, xla, cudnn, splash"),
    ({"model.energy_block_size": 64}, "model.energy_block_size=64 has no effect on the fused"),
    ({"model.attention_impl": "cudnn", "model.dtype": "bfloat16",
      "model.update_mode": "autodiff"}, "has no effect: the CEM attention update is jax.grad"),
    # Said first: changing the dtype (or seq_len) for a kernel that is never called is no fix.
    ({"model.attention_impl": "cudnn", "model.update_mode": "autodiff"}, "has no effect: "),
    ({"model.attention_impl": "splash", "model.update_mode": "autodiff"}, "has no effect: "),
])
def test_impossible_explicit_choices_fail_config_validation_in_one_line(overrides, match):
  with pytest.raises(ValueError, match=match) as e:
    preflight.check(tiny_config("cem", **overrides))
  assert "\n" not in str(e.value) and str(e.value).startswith("model.")


@pytest.mark.parametrize("overrides,match", [
    ({"model.attention_impl": "cudnn", "model.dtype": "bfloat16"}, "platform is cpu"),
    ({"model.attention_impl": "splash", "data.seq_len": 128}, "platform is cpu"),
    ({"model.attention_impl": "cudnn", "model.dtype": "bfloat16",
      "model.update_mode": "autodiff"}, "has no effect"),
])
def test_impossible_explicit_choices_fail_when_the_model_is_built(overrides, match):
  cfg = tiny_config("cem", **overrides)
  if "model.update_mode" not in overrides:
    preflight.check(cfg)  # machine-independent checks pass: the machine decides
  with pytest.raises(ValueError, match=match) as e:
    DecoderLM(cfg.model, 64, rngs=nnx.Rngs(0))
  assert "\n" not in str(e.value) and "model.attention_impl=" in str(e.value)


@pytest.mark.parametrize("overrides", [
    {"model.attention_impl": "cudnn", "model.dtype": "bfloat16"},
    {"model.attention_impl": "splash", "data.seq_len": 128},
])
def test_a_kernel_this_machine_cannot_run_is_refused_before_the_data_is_built(tmp_path,
                                                                                overrides):
  # In an existing workdir: no tokenizer trained and no shards written for a run that cannot
  # start, and the error says what to use instead.
  from cem_jax import train

  workdir = tmp_path / "w"
  workdir.mkdir()
  with pytest.raises(ValueError, match=r"^model\.attention_impl='(cudnn|splash)' cannot run: .*"
                     r"platform is cpu \(use 'auto' or 'xla' here\)$"):
    train.train_and_evaluate(tiny_config("cem", **overrides), str(workdir))
  assert list(workdir.iterdir()) == []


def test_the_machine_check_judges_the_platform_it_is_given_not_this_ones():
  # python -m cem_jax.aot checks a TPU or GPU target's kernel from a CPU machine: the target's
  # platform decides, as jax.default_backend() does when none is given.
  splash = tiny_config("llama", **{"model.attention_impl": "splash", "data.seq_len": 128})
  preflight.check_machine(splash, platform="tpu")
  with pytest.raises(ValueError, match=r"splash attention is a TPU kernel, this machine's "
                                       r"platform is gpu "):
    preflight.check_machine(splash, platform="gpu")
  with pytest.raises(ValueError, match=r"platform is cpu "):
    preflight.check_machine(splash)


def test_the_start_up_check_runs_the_configs_own_rules_first():
  # preflight.check is what programs call: config.validate's rules are part of it.
  with pytest.raises(ValueError, match=r"^model.precond_rank=2 has no effect with "
                                       r"model.precond='none'"):
    preflight.check(tiny_config("cem", **{"model.precond_rank": 2}))


# ---- blockwise (online) log-sum-exp --------------------------------------------------------

# 48 does not divide 128: padded keys and queries; 0: the dense scores
# (model.energy_block_size's default). queries: fewer than the keys (as a decoding step's) from
# row 40 on, 5 (no block of 16 or 48 divides them) or 1; row 40 of batch row 0 starts document
# 2 and sees nothing (strict causality).
# made: the mask given as a function of the block's indices (masks.mask_block), as training
# gives it, instead of the [b, t, s] array; at 48 its padded keys must stay invisible (not
# strict: the last real query would see them).
@pytest.mark.parametrize("block_size,queries,made,strict", [
    (16, T, False, True), (48, T, False, True), (128, T, False, True), (0, T, False, True),
    (16, 5, False, True), (48, 5, False, True), (48, 1, False, True), (0, 5, False, True),
    (16, T, True, True), (48, T, True, True), (0, T, True, True), (48, T, True, False)])
def test_blockwise_logsumexp_and_gradient_equal_the_reference(block_size, queries, made, strict):
  q, k, _, _ = _qkv(seed=3)
  rows = slice(0, T) if queries == T else slice(40, 40 + queries)
  q = q[:, rows]
  segments = RETURNING if not strict else SEGMENTS  # no padding: the last query is real
  mask = np.asarray(make_mask(jnp.asarray(segments), T, B, strict=strict))[:, rows]
  scale = jnp.asarray([0.25, 0.4])
  given = jnp.asarray(mask)
  if made:
    given = functools.partial(mask_block, jnp.asarray(segments), batch=B, strict=strict)

  def f(q, k):
    return blockwise_logsumexp(q, k, given, block_size, scale)

  lse, vjp = jax.vjp(f, q, k)
  g = np.random.default_rng(4).normal(size=(B, H, queries))  # cotangent of lse
  dq, dk = vjp(jnp.asarray(g, jnp.float32))
  s = np.einsum("bthe,bshe->bhts", np.float64(q), np.float64(k)) * np.float64(scale)[:, None,
                                                                                     None]
  p, want = np_softmax(s, mask[:, None])
  ds = p * g[..., None]
  want_dq = np.einsum("bhts,bshe->bthe", ds * np.float64(scale)[:, None, None], np.float64(k))
  want_dk = np.einsum("bhts,bthe->bshe", ds * np.float64(scale)[:, None, None], np.float64(q))
  assert rel(lse, want) <= TOL
  assert rel(dq, want_dq) <= TOL and rel(dk, want_dk) <= TOL
  empty = ~mask.any(-1)  # [b, t]: padding and each document's first token
  assert empty.sum() > 0
  assert np.all(np.asarray(lse).transpose(0, 2, 1)[empty] == 0.0)
  assert np.all(np.asarray(dq)[empty] == 0.0) and np.all(np.isfinite(np.asarray(dk)))


def test_blockwise_logsumexp_of_masked_keys_far_above_the_visible_ones_has_finite_gradients():
  # A masked (future) key scoring 120 above a row's visible maximum: exp(120) overflows float32.
  # Masked entries are excluded before the exponential, so their gradient is 0, not 0 * inf.
  # Row 0 under strict causality sees no key (its shift is 0, its masked scores 60 and 80).
  q = np.array([[1.0, 0.5], [1.0, -0.5], [0.8, 0.3], [1.2, 0.1]])[None, :, None, :]
  k = np.array([[-40.0, 1.0], [60.0, -2.0], [80.0, 0.5], [-35.0, 3.0]])[None, :, None, :]
  mask = np.array([[[False] * 4, [True, False, False, False], [True, True, False, False],
                    [True, False, True, False]]])
  g = np.array([[[0.7, -1.3, 0.4, 2.1]]])  # cotangent of lse [b, h, t]

  def f(q, k):
    return blockwise_logsumexp(q, k, jnp.asarray(mask), 3, 1.0)  # 3 keys a block: one padded

  @jax.jit  # one compilation (eager, each op of the scan compiles on its own)
  def value_and_vjp(q, k, g):
    lse, vjp = jax.vjp(f, q, k)
    return (lse, *vjp(g))

  lse, dq, dk = value_and_vjp(*(jnp.asarray(a, jnp.float32) for a in (q, k, g)))
  p, want = np_softmax(np.einsum("bthe,bshe->bhts", q, k), mask[:, None])
  ds = p * g[..., None]
  for got, ref in ((lse, want), (dq, np.einsum("bhts,bshe->bthe", ds, k)),
                   (dk, np.einsum("bhts,bthe->bshe", ds, q))):
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-6, atol=1e-6)


def test_blockwise_distance_energy_under_strict_causality_equals_the_reference():
  # The distance form's per-query constant -½ Σ d y² enters only rows that see a key: under
  # strict causality a document's first token sees none, though later queries see its key
  # (the rows are the mask's query axis, not its key axis). Small; the mask built in NumPy.
  b, t, d, h, dh = 2, 7, 6, 2, 4
  r = np.random.default_rng(21)
  y, c = (jnp.asarray(r.normal(size=(b, t, d)), jnp.float32) for _ in range(2))
  params = _attention_params(22, d, h, dh, diag=True)
  seg = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 2, 0, 0]])
  pos = np.arange(t)
  mask = ((pos[None, :] < pos[:, None]) & (seg[:, :, None] == seg[:, None, :])
          & (seg[:, :, None] > 0))
  aux = EnergyAux(mask=jnp.asarray(mask), positions=jnp.zeros((b, t), jnp.int32),
                  rope_theta=None, diagonal_form="distance", energy_block_size=3)
  want_e, want_u = np_energy_and_update(y, c, params, mask, None, rope=False, form="distance")
  # One compilation (eager, each op of the scan compiles on its own: seconds).
  got_e, grad = jax.jit(jax.value_and_grad(interaction_energy))(y, c, params, aux)
  assert abs(float(got_e) - want_e) <= TOL * abs(want_e)
  assert rel(-grad, want_u) <= TOL


@pytest.mark.parametrize("strict", [False, True])
def test_visible_rows_from_the_structure_are_the_rows_of_the_numpy_mask_that_see_a_key(strict):
  # Training's distance-form energy takes the rows that see a key from the structure
  # (visible_rows without a mask), never from a [b, t, t] mask. Each row's answer against a
  # NumPy mask: padding, a document's first token under strict causality (also one whose id
  # comes back later in the window), position 0 and 1. Fails with position 1 taken for a first
  # token, with the first tokens of later documents left in, or with a returning document's
  # second run taken for a new first token.
  seg = np.array([[1, 1, 1, 2, 2, 2, 0, 0],
                  [3, 3, 1, 1, 3, 3, 2, 0],
                  [5, 5, 5, 5, 5, 5, 5, 5],
                  [0, 0, 4, 4, 0, 4, 4, 1]], np.int32)
  b, t = seg.shape
  pos = np.arange(t)
  causal = pos[None, :] < pos[:, None] if strict else pos[None, :] <= pos[:, None]
  mask = causal & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
  got = masks.visible_rows(None, is_causal=True, strict=strict, segment_ids=jnp.asarray(seg),
                           shape=(b, t))
  np.testing.assert_array_equal(np.asarray(got), mask.any(-1))
  # Without documents: only position 0 under strict causality sees nothing.
  got = masks.visible_rows(None, is_causal=True, strict=strict, segment_ids=None, shape=(b, t))
  want = np.broadcast_to(pos > 0 if strict else pos >= 0, (b, t))
  assert (got is None and not strict) or np.array_equal(np.asarray(got), want)


@pytest.mark.parametrize("block_size", [-1, -128])
def test_blockwise_logsumexp_refuses_a_negative_block_size_in_one_line(block_size):
  q = np.zeros((1, 4, 1, 2), np.float32)
  with pytest.raises(ValueError, match=rf"^block_size={block_size}; allowed: 0 \(dense "
                     r"scores\) or an int >= 1$"):
    blockwise_logsumexp(q, q, np.ones((1, 4, 4), bool), block_size)


@pytest.mark.parametrize("kind,form", [("documents", None), ("strict_documents", None),
                                       ("causal", "bilinear"), ("documents", "distance")])
def test_blockwise_energy_and_its_autodiff_update_equal_the_reference(kind, form):
  d = 16
  r = np.random.default_rng(11)
  y, c = (jnp.asarray(r.normal(size=(B, T, d)), jnp.float32) for _ in range(2))
  params = _attention_params(12, d, H, 8, diag=form is not None)
  aux = _training_aux(kind, block=32, form=form or "bilinear")
  want_e, want_u = np_energy_and_update(y, c, params, aux.mask, aux.positions, rope=True,
                                        form=form)
  got_e = interaction_energy(y, c, params, aux)
  got_u = updates.autodiff_update(interaction_energy)(y, c, params, aux)
  assert abs(float(got_e) - want_e) <= TOL * abs(want_e)
  assert rel(got_u, want_u) <= TOL
  assert np.all(np.asarray(got_u)[~np.asarray(aux.mask).any(-1)] == 0.0)
  # Training differentiates the update (second derivatives of the energy): same as dense.
  def loss(p, a):
    return jnp.sum(updates.autodiff_update(interaction_energy)(y, c, p, a) * c)

  g_block = jax.grad(loss)(params, aux)
  g_dense = jax.grad(loss)(params, aux.replace(energy_block_size=0))
  for name in params:
    assert rel(g_block[name], g_dense[name]) <= 1e-4, name
    assert np.all(np.isfinite(np.asarray(g_block[name])))


def _grad_temp_bytes(n, block, training=False):
  """XLA's temp bytes of jax.grad of the energy in y (the autodiff update); ``training``:
  of a training step's gradient through that update (second derivatives of the energy)."""
  d, h = 32, 4
  y = jax.ShapeDtypeStruct((1, n, d), jnp.float32)
  params = {"w_q": jax.ShapeDtypeStruct((d, h, 8), jnp.float32),
            "w_k": jax.ShapeDtypeStruct((d, h, 8), jnp.float32),
            "eta": jax.ShapeDtypeStruct((h,), jnp.float32),
            "beta": jax.ShapeDtypeStruct((h,), jnp.float32)}

  def grad(y, p):
    aux = EnergyAux(mask=make_mask(None, n, 1), positions=jnp.zeros((1, n), jnp.int32),
                    rope_theta=None, energy_block_size=block)
    return jax.grad(interaction_energy)(y, y, p, aux)

  if training:
    step = jax.grad(lambda y, p: jnp.sum(jnp.sin(grad(y, p))), argnums=(0, 1))
    return jax.jit(step).lower(y, params).compile().memory_analysis().temp_size_in_bytes
  return jax.jit(grad).lower(y, params).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("training", [False, True], ids=["update", "training_step"])
def test_blockwise_energy_gradient_memory_grows_linearly_not_quadratically(training):
  # XLA's own memory analysis of the compiled gradient (not a timing): 4x the sequence.
  # The training step differentiates jax.grad of the energy once more: with key blocks alone,
  # its backward kept every query's residuals per key block (measured 3.6x less than dense,
  # still ~n^1.8: 1.9 -> 53 MB from 256 to 2048 tokens); query blocks checkpointed too
  # keep one query block's at a time (0.65 -> 3.1 MB).
  dense = _grad_temp_bytes(1024, 0, training) / _grad_temp_bytes(256, 0, training)
  blockwise = _grad_temp_bytes(1024, 128, training) / _grad_temp_bytes(256, 128, training)
  assert dense > 10, dense  # the [b, h, n, n] scores
  assert blockwise < 6, blockwise


def _model_forward_temp_bytes(n, block):
  cfg = tiny_config("cem", **{"model.update_mode": "autodiff", "model.energy_block_size": block,
                              "model.d_model": 32, "model.num_heads": 2, "model.num_layers": 1,
                              "model.num_steps": 1, "data.seq_len": n}).model
  graphdef, params = nnx.split(DecoderLM(cfg, 64, rngs=nnx.Rngs(0)), nnx.Param)
  tokens = jax.ShapeDtypeStruct((1, n), jnp.int32)
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
  return forward.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def test_model_energy_block_size_reaches_the_energy_of_a_model():
  # The helper's memory test above builds its own aux: model.energy_block_size dropped on the
  # way to the training aux (equal values, n^2 memory) passed every test. A CEM model with the
  # autodiff update (jax.grad of the energy in its forward pass), XLA's memory analysis at 4x
  # the sequence. Measured (CPU, jax 0.10.2): dense 1.12 -> 16.9 MB (15x), blocks of 64
  # 0.43 -> 1.70 MB (4.0x; 0.61 -> 3.2 MB, 5.2x, with key blocks only and the [1, n, n] bool
  # mask read by the energy; 5.7x with query blocks and that mask).
  dense = _model_forward_temp_bytes(1024, 0)
  blockwise = _model_forward_temp_bytes(1024, 64)
  assert dense / _model_forward_temp_bytes(256, 0) > 10
  assert blockwise / _model_forward_temp_bytes(256, 64) < 5
  assert blockwise < dense / 3, (blockwise, dense)

# ---- bf16 --------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["bilinear", "distance"])
def test_bf16_diagonal_scores_are_formed_in_float32(form):
  # bf16 inputs, rounded once; the float64 reference starts from the same rounded values.
  # y = c as at a layer's first step (g = norm(x) = c), where the distance form's
  # cross - ½(Σd·y² + Σd·c²) cancels. Measured (max-normalised error of the update):
  # scores formed in bf16 (before) 1.1e-2 / 1.3e-2 fused, 2.4e-2 / 2.3e-2 autodiff;
  # in float32 (now) 6.9e-3 / 8.6e-3 and 7.3e-3 / 8.6e-3, the level of the model without a
  # diagonal (8.0e-3 fused, 5.7e-3 autodiff: bf16 projections and output).
  d = 32
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  y = bf(np.random.default_rng(5).normal(size=(B, T, d)))
  params = _attention_params(6, d, H, 8, diag=True)
  params["diag"] = jnp.abs(params["diag"]) / 0.3
  params = {n: (bf(a) if n not in ("eta", "beta") else a) for n, a in params.items()}
  aux = _training_aux("documents", rope=False, form=form)
  f64 = {n: np.asarray(a.astype(jnp.float32), np.float64) for n, a in params.items()}
  y64 = np.asarray(y.astype(jnp.float32), np.float64)
  _, want = np_energy_and_update(y64, y64, f64, aux.mask, aux.positions, rope=False,
                                 form=form)
  fused = interaction_fused_update(y, y, params, aux).astype(jnp.float32)
  autodiff = updates.autodiff_update(interaction_energy)(y, y, params, aux)
  assert rel(fused, want) <= 1e-2, rel(fused, want)
  assert rel(autodiff.astype(jnp.float32), want) <= 1e-2, rel(autodiff.astype(jnp.float32),
                                                              want)


@pytest.mark.parametrize("mesh_shape,partition,local_heads", [
    ((2, 2), (("data",), ("tensor",)), 2),  # 4 heads over tensor=2
    ((1, 4), (("data",), ("tensor",)), 1),
    ((4, 1), (("data",), ("tensor",)), 4),  # tensor=1 splits nothing
    # rows stay whole (data x tensor = 4 does not divide 2 rows, and no part of the axes is
    # taken: axes.dividing_axes), so heads take tensor
    ((2, 2), (("data", "tensor"), ("tensor",)), 2),
])
def test_the_splash_kernel_is_built_for_the_heads_one_device_holds(monkeypatch, mesh_shape,
                                                                   partition, local_heads):
  # Inside shard_map each device sees its own heads; a kernel built for all of them has a
  # mask per head it never gets (interpret mode tolerates that, so the values cannot tell).
  # The abstract mesh needs no devices: the build is recorded, then the trace stops.
  from jax.sharding import AbstractMesh, AxisType

  built = []

  class Built(Exception):
    pass

  def spy(t, heads, strict, interpret):
    built.append((t, heads))
    raise Built

  monkeypatch.setattr(attention, "_splash_kernel", spy)
  mesh = AbstractMesh(mesh_shape, ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
  q = jax.ShapeDtypeStruct((2, 128, 4, 8), jnp.float32)
  with jax.sharding.use_abstract_mesh(mesh), pytest.raises(Built):
    jax.eval_shape(lambda q: attention.dot_product_attention(
        q, q, q, scale=1.0, implementation="splash", is_causal=True, partition=partition), q)
  assert built == [(128, local_heads)]


def test_a_mesh_axis_that_splits_the_rows_is_not_given_to_the_heads_too():
  # A mesh axis may split one dimension only (a PartitionSpec naming it twice is invalid):
  # with rules that map both batch and heads to it, the rows take it where it divides them
  # and the heads only where the rows stay whole.
  from jax.sharding import PartitionSpec

  partition, mesh_shape = (("data", "tensor"), ("tensor",)), {"data": 2, "tensor": 2}
  assert attention.rows_and_heads_spec((4, 128, 4, 8), partition, mesh_shape) == (
      PartitionSpec(("data", "tensor"), None, None, None))
  assert attention.rows_and_heads_spec((2, 128, 4, 8), partition, mesh_shape) == (
      PartitionSpec(None, None, ("tensor",), None))


@pytest.mark.parametrize("impl", ["xla", "cudnn", "splash"])
def test_no_mask_and_no_causal_structure_is_a_one_line_error(impl):
  # Without either there is nothing to say which keys a query sees: no kernel may guess one
  # (the XLA path would otherwise build a plain causal mask from segment_ids=None).
  q = jnp.zeros((1, 128, 1, 8))
  with pytest.raises(ValueError, match=r"^dot_product_attention needs a mask or "
                                       r"is_causal=True$"):
    attention.dot_product_attention(q, q, q, scale=1.0, implementation=impl)


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_bfloat16_inputs_give_a_bfloat16_output_near_the_float64_reference(impl):
  # The output is in q's dtype on every path: a float32 one would upcast the rest of a
  # bfloat16 layer (its matmuls, its activations' memory) without a word.
  q, k, v, _ = (x.astype(jnp.bfloat16) for x in _qkv(seed=5))
  kwargs, mask = _structure("documents")
  out = attention.dot_product_attention(q, k, v, scale=0.3, implementation=impl, **kwargs)
  assert out.dtype == jnp.bfloat16
  ref = np_attention(*(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)), mask, 0.3,
                     np.zeros(q.shape))[0]
  assert rel(out.astype(jnp.float32), ref) <= 2e-2
