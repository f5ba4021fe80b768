"""Packed documents on a GPU: is there a kernel that takes segment ids and beats cuDNN's bias?

Times one attention call, forward plus backward (``jax.value_and_grad`` of ``Σ out ⊙ g``), at
the shapes of ``cem_jax.bench --preset=gpu125m`` (16,384 tokens: 16 x 1024 and 4 x 4096; 12
heads of 64; bf16; 4 equal documents per window) for:

- ``cudnn_causal``: ``jax.nn.dot_product_attention(implementation='cudnn', is_causal=True)``,
  the plain causal step (``model.document_mask=False``);
- ``cudnn_docs``: the same with the ``[batch, 1, n, n]`` document mask, which jax hands
  cuDNN as an additive bias (what ``attention_impl='cudnn'`` runs with documents);
- ``pallas_docs*``: jax's Pallas GPU (Triton) flash attention,
  ``jax.experimental.pallas.ops.gpu.attention.mha``, which takes **segment ids** (no n x n
  array), at its default block sizes and three others (``_q_k_dkv``); ``pallas_causal``
  without segment ids;
- ``xla_docs``: the XLA path, the reference the errors are taken against.

Columns of each JSON row: ``shape`` ``[batch, seq_len, heads, head_dim]``, ``impl``,
``ms_fwd_bwd`` (mean of 20 calls dispatched back to back, waited for once), and for the document
rows the largest absolute error of the output and the largest error of the three gradients
relative to their largest entry, both against ``xla_docs`` (bf16 inputs).

    python experiments/attention_kernels.py OUT.json     # on a GPU; on a CPU: a tiny shape,
                                                         # Pallas in interpret mode (a check)

Measured on an H200 (jax 0.11.2, 2026-12-04, `results/bench/attention_docs_h200_2026-12-04b.json`,
docs/PERFORMANCE.md "Packed documents: Pallas segment ids"): the Pallas kernel with segment
ids is no faster than cuDNN with the bias (0.64 vs 0.65 ms at 1024, 1.93 vs 1.82 ms at 4096 at
its best block sizes), and jax 0.11 deprecates that module in favour of tokamax.
"""

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as pa


def measure(b: int, t: int, h: int, d: int, interp: bool) -> list[dict]:
  """The rows of one shape ``[batch, seq_len, heads, head_dim]`` (module docstring)."""
  rows = []
  kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
  dt = jnp.bfloat16
  q = jax.random.normal(kq, (b, t, h, d), dt)
  k = jax.random.normal(kk, (b, t, h, d), dt)
  v = jax.random.normal(kv, (b, t, h, d), dt)
  g = jax.random.normal(kg, (b, t, h, d), dt)
  seg = jnp.repeat(jnp.arange(1, 5, dtype=jnp.int32), t // 4)[None].repeat(b, 0)
  tri = jnp.tril(jnp.ones((t, t), bool))
  mask = (seg[:, :, None] == seg[:, None, :]) & tri
  scale = d ** -0.5
  impls = {
      "xla_docs": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, mask=mask[:, None], scale=scale, is_causal=True, implementation="xla"),
      "pallas_docs": lambda q, k, v: pa.mha(q, k, v, seg, sm_scale=scale, causal=True,
                                            interpret=interp),
      "pallas_causal": lambda q, k, v: pa.mha(q, k, v, None, sm_scale=scale, causal=True,
                                              interpret=interp),
  }
  if not interp:
    impls["cudnn_causal"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, implementation="cudnn")
    impls["cudnn_docs"] = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=mask[:, None], scale=scale, is_causal=True, implementation="cudnn")
    for bq, bk, bd in [(64, 64, 32), (128, 64, 64), (64, 128, 64)]:
      bs = pa.BlockSizes(block_q=bq, block_k=bk, block_q_dkv=bd, block_kv_dkv=bd,
                         block_q_dq=bd, block_kv_dq=bd)
      impls[f"pallas_docs_{bq}_{bk}_{bd}"] = functools.partial(
          lambda bs, q, k, v: pa.mha(q, k, v, seg, sm_scale=scale, causal=True,
                                     block_sizes=bs), bs)
  ref = None
  for name, f in impls.items():
    def loss(q, k, v, f=f):
      return jnp.sum(f(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    try:
      r = step(q, k, v)
      jax.block_until_ready(r)
    except Exception as e:  # a block size this GPU cannot take: recorded, the sweep goes on
      print(json.dumps(dict(shape=[b, t, h, d], impl=name, error=str(e)[:300])))
      continue
    n = 3 if interp else 20
    t0 = time.perf_counter()
    for _ in range(n):
      r2 = step(q, k, v)
    jax.block_until_ready(r2)
    ms = (time.perf_counter() - t0) / n * 1e3
    fwd = jax.jit(f)(q, k, v).astype(jnp.float32)
    if name == "xla_docs":  # the reference (first); if it failed, no row has errors
      ref = (fwd, [x.astype(jnp.float32) for x in r[1]])
    docs = "docs" in name and ref is not None
    err = float(jnp.max(jnp.abs(fwd - ref[0]))) if docs else None
    gerr = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b_))) / float(jnp.max(jnp.abs(b_)))
               for a, b_ in zip(r[1], ref[1], strict=True)) if docs else None
    row = dict(shape=[b, t, h, d], impl=name, ms_fwd_bwd=round(ms, 3), max_err_vs_xla=err,
               grad_rel_err=gerr)
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def main(argv: list[str]) -> None:
  interp = jax.default_backend() == "cpu"
  shapes = [(2, 256, 2, 64)] if interp else [(16, 1024, 12, 64), (4, 4096, 12, 64)]
  out = [row for shape in shapes for row in measure(*shape, interp)]
  if len(argv) > 1:
    with open(argv[1], "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  from cem_jax import cli

  main([sys.argv[0], *cli.script_args(sys.argv, __doc__,
                                      "python experiments/attention_kernels.py [OUT.json]")])
