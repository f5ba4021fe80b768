"""bf16 attention kernels against the float64 reference: cuDNN on a GPU, XLA everywhere.

The CPU suite checks every kernel that runs on a CPU to 1e-5 in float32 (test_attention.py);
cuDNN flash attention runs only on an NVIDIA GPU and only in bf16/fp16, so its cases skip
elsewhere and run in the device check of docs/PERFORMANCE.md ("The run to do"):

    bash .device/run.sh python3 -m pytest -q tests/test_gpu_kernels.py

The XLA cases run in CI: they show that the same comparison passes for a correct kernel at
bf16's tolerance, so a cuDNN failure is the kernel's (or our call's), not the test's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cem_jax import attention
from cem_jax.energies import interaction_fused_update
from tests.test_attention import (
  B,
  T,
  _attention_params,
  _qkv,
  _structure,
  _training_aux,
  np_attention,
  np_energy_and_update,
  rel,
)

# bf16 keeps 8 significant bits (relative rounding 2⁻⁹ ≈ 0.002 per element); the kernels sum
# 128 terms in float32 and round the output once more: 2e-2 of the largest value is a few
# roundings, far below what a wrong mask, scale or transposed operand gives (order 1).
BF16_TOL = 2e-2
GPU = jax.default_backend() == "gpu"
IMPLS = ["xla", pytest.param("cudnn", marks=pytest.mark.skipif(
    not GPU, reason="cuDNN flash attention needs an NVIDIA GPU"))]


def _bf16(*xs):
  return [x.astype(jnp.bfloat16) for x in xs]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["causal", "documents", "strict_documents", "strict_returning"])
def test_bf16_attention_and_its_gradient_equal_the_float64_reference(impl, kind):
  q, k, v, cot = _bf16(*_qkv(seed=20 + len(kind)))
  kwargs, mask = _structure(kind)
  scale = 0.3

  def f(q, k, v):
    return attention.dot_product_attention(q, k, v, scale=scale, implementation=impl,
                                           **kwargs)

  out, vjp = jax.vjp(f, q, k, v)
  grads = vjp(cot)
  # The reference reads the same bf16-rounded inputs, in float64.
  ref = np_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), mask, scale,
                     np.asarray(cot, np.float64))
  for name, got, want in zip(["out", "dq", "dk", "dv"], (out, *grads), ref, strict=True):
    assert got.dtype == jnp.bfloat16, name
    assert np.all(np.isfinite(np.asarray(got, np.float32))), name  # empty rows too
    assert rel(got, want) <= BF16_TOL, (name, rel(got, want))
  empty = ~mask.any(-1)
  if empty.any():  # padding, and each document's first token under strict causality
    assert np.all(np.asarray(out, np.float32)[empty] == 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_fused_cem_update_equals_the_reference_gradient_of_the_energy(impl):
  d = 16
  r = np.random.default_rng(7)
  y, c = _bf16(*(jnp.asarray(r.normal(size=(B, T, d)), jnp.float32) for _ in range(2)))
  params = {n: p.astype(jnp.bfloat16) for n, p in _attention_params(8, d, 2, 8).items()}
  aux = _training_aux("documents", impl)
  update = interaction_fused_update(y, c, params, aux)
  _, want = np_energy_and_update(
      y.astype(jnp.float32), c.astype(jnp.float32),
      {n: p.astype(jnp.float32) for n, p in params.items()}, aux.mask, aux.positions,
      rope=True)
  assert update.dtype == jnp.bfloat16
  assert rel(update, want) <= BF16_TOL, rel(update, want)
  assert np.all(np.asarray(update, np.float32)[~np.asarray(aux.mask).any(-1)] == 0.0)
