"""One attention entry point for the Llama block, the CEM fused update and cached decoding.

:func:`dot_product_attention` takes ``q``, ``k``, ``v`` ``[batch, seq, heads, head_dim]``, a
scale and the mask as *structure* (plain causal, strict causal, segment ids, or a dense
visibility mask for what has no structure, e.g. decoding against a cache), and dispatches to
one kept kernel:

- ``'xla'``: ``jax.nn.dot_product_attention(implementation='xla')``. Any platform and dtype;
  materialises the ``[batch, heads, n, n]`` scores. (``implementation=None`` is this path in
  jax today, so ``is_causal=True`` alone never reaches cuDNN.)
- ``'cudnn'``: ``jax.nn.dot_product_attention(implementation='cudnn')``, cuDNN flash
  attention on NVIDIA GPUs; bf16/fp16 only, head_dim a multiple of 8 and at most 128 (256 on
  Hopper or later), an even training sequence length. Plain causal attention uses cuDNN's
  causal mask (no n x n array); no public jax API hands segment ids to cuDNN, so a document
  mask goes in as a dense ``[batch, 1, n, n]`` boolean mask that jax turns into an additive
  bias, beside cuDNN's causal mask (so the tiles above the diagonal are still skipped).
- ``'splash'``: Pallas splash attention on TPU
  (``jax.experimental.pallas.ops.tpu.splash_attention``): causal or strict-causal mask as
  structure, documents as segment ids (no n x n array); sequence length a multiple of 128.
  XLA cannot partition a Pallas call, so over several devices it runs inside
  ``jax.shard_map`` on the mesh in context (``jax.set_mesh``; the train and eval steps set the
  abstract mesh):
  rows over the mesh axes of the ``batch`` logical axis, heads over those of ``heads``
  (MaxText's layout; ``partition``).

:func:`resolve` turns ``model.attention_impl`` (``'auto'`` or an explicit name) into the
kernel a model uses and the reason, or raises a one-line ``ValueError`` for a choice that
cannot run. It never falls back silently. A query row with no visible key outputs exactly 0
on every path (CEM_MATH.md section 7).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from cem_jax.axes import DEFAULT_RULES, dividing_axes, mesh_axes_of
from cem_jax.config import ATTENTION_IMPLEMENTATIONS as IMPLEMENTATIONS
from cem_jax.masks import make_mask, visible_rows

SPLASH_BLOCK = 128  # splash tiles the sequence in blocks of (a multiple of) 128
# What a kernel needs the training sequence length to be a multiple of. cuDNN: jax's training
# rule always hands cuDNN a bias operand (an empty one when there is no mask), and cuDNN's
# flash attention with a bias needs even lengths (jax's check_is_flash_attention).
SEQ_MULTIPLE = {"splash": SPLASH_BLOCK, "cudnn": 2}


def partition_of(rules=DEFAULT_RULES) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """``(batch mesh axes, heads mesh axes)`` of logical-axis ``rules`` (``mesh.rules``): where
  a kernel that runs per device (splash, under ``shard_map``) puts rows and heads."""
  table = dict(rules)
  return mesh_axes_of(table.get("batch")), mesh_axes_of(table.get("heads"))


def cudnn_max_head_dim(platform: str | None) -> int:
  """cuDNN flash attention's head_dim limit: 256 on Hopper (compute capability 9.0) or
  later, 128 before; 128 when no GPU is visible (the conservative limit)."""
  if platform != "gpu":
    return 128
  capability = getattr(jax.devices()[0], "compute_capability", "0.0")
  return 256 if tuple(int(x) for x in capability.split(".")[:2]) >= (9, 0) else 128


def resolve(requested: str, *, platform: str | None, dtype: str, head_dim: int,
            augmented_head_dim: int | None = None,
            seq_len: int | None = None) -> tuple[str, str]:
  """Chooses the attention kernel for one model.

  Args:
    requested: ``model.attention_impl``: ``'auto'``, ``'xla'``, ``'cudnn'`` or ``'splash'``.
    platform: ``jax.default_backend()`` (``'cpu'``, ``'gpu'``, ``'tpu'``), or None to check
      only what does not depend on the machine (config validation, before jax starts).
    dtype: ``model.dtype`` (``'float32'`` or ``'bfloat16'``).
    head_dim: the attention head width.
    augmented_head_dim: with the CEM diagonal, the width of the augmented head the fused
      update attends with, ``d_h + d_model`` (+ 1 in the distance form); None without one.
    seq_len: the training sequence length if known (``SEQ_MULTIPLE``: splash needs a
      multiple of 128, cuDNN an even length).
  Returns:
    ``(implementation, reason)``, the implementation one of ``'xla'``, ``'cudnn'``,
    ``'splash'``; ``('auto', ...)`` for ``'auto'`` with ``platform`` None (chosen when the
    model is built, on its machine).
  Raises:
    ValueError: one line naming ``model.attention_impl``, the value and why it cannot run.
  """
  # Public and reached without config.validate (tests, tools), so it checks its own input.
  if requested not in IMPLEMENTATIONS:
    raise ValueError(f"model.attention_impl={requested!r}; allowed: "
                     f"{', '.join(IMPLEMENTATIONS)}")
  width = head_dim if augmented_head_dim is None else augmented_head_dim
  why_wide = None
  if augmented_head_dim is not None:
    why_wide = (f"the CEM diagonal attends with one augmented head of width "
                f"{augmented_head_dim} (d_h + d_model, + 1 in the distance form), beyond "
                "flash kernels' head sizes")
  if requested == "xla":
    return "xla", "explicit"
  if requested in ("cudnn", "splash"):
    problems = (_cudnn_problems(platform, dtype, width, why_wide, seq_len)
                if requested == "cudnn" else _splash_problems(platform, seq_len, why_wide))
    if problems:
      raise ValueError(f"model.attention_impl={requested!r} cannot run: {'; '.join(problems)}")
    return requested, "explicit"
  # auto: the fastest kernel the platform, dtype, head size and mask allow.
  if platform is None:
    return "auto", "resolved when the model is built"
  if why_wide is not None:
    return "xla", "auto: " + why_wide
  if platform == "gpu":
    problems = _cudnn_problems(platform, dtype, width, why_wide, seq_len)
    if problems:
      return "xla", f"auto: GPU, but cuDNN flash attention cannot run: {'; '.join(problems)}"
    return "cudnn", f"auto: GPU, {dtype}, head_dim={width}: cuDNN flash attention"
  if platform == "tpu":
    problems = _splash_problems(platform, seq_len, why_wide)
    if problems:
      return "xla", f"auto: TPU, but splash attention cannot run: {'; '.join(problems)}"
    return "splash", f"auto: TPU, head_dim={width}: Pallas splash attention"
  return "xla", f"auto: platform {platform} has no flash kernel here, XLA attention"


def _elsewhere(platform: str) -> str:
  return f"this machine's platform is {platform} (use 'auto' or 'xla' here)"


def _seq_len_problems(implementation: str, seq_len: int | None) -> list[str]:
  multiple = SEQ_MULTIPLE[implementation]
  if seq_len is None or seq_len % multiple == 0:
    return []
  return [f"data.seq_len={seq_len} must be a multiple of {multiple}"]


def _cudnn_problems(platform: str | None, dtype: str, width: int, why_wide: str | None,
                    seq_len: int | None) -> list[str]:
  """Why cuDNN flash attention cannot run (``[]``: it can); ``platform`` None: on some GPU."""
  problems = []
  if platform is not None and platform != "gpu":
    problems.append(f"it needs an NVIDIA GPU, {_elsewhere(platform)}")
  if dtype not in ("bfloat16", "float16"):
    # Before the machine is known (preflight.check) this is the one line a CPU user reads,
    # who should not switch to bfloat16 only to learn of the GPU next: it names the GPU too.
    kernel = "cuDNN flash attention" + (", an NVIDIA GPU kernel," if platform is None else "")
    problems.append(f"it needs model.dtype=bfloat16 ({kernel} has no {dtype})")
  limit = cudnn_max_head_dim(platform) if platform is not None else 256
  if why_wide is not None:
    problems.append(why_wide + "; use 'xla' or model.diagonal='none'")
  elif width % 8 or width > limit:
    problems.append(f"head_dim={width} must be a multiple of 8 and <= {limit}")
  return problems + _seq_len_problems("cudnn", seq_len)


def _splash_problems(platform: str | None, seq_len: int | None,
                     why_wide: str | None) -> list[str]:
  """Why splash attention cannot run (``[]``: it can); ``platform`` None: on some TPU."""
  problems = []
  if platform is not None and platform != "tpu":
    problems.append(f"splash attention is a TPU kernel, {_elsewhere(platform)}")
  if why_wide is not None:
    problems.append(why_wide + "; use 'xla' or model.diagonal='none'")
  return problems + _seq_len_problems("splash", seq_len)


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    implementation: str = "xla",
    mask: jax.Array | None = None,
    is_causal: bool = False,
    strict_causal: bool = False,
    segment_ids: jax.Array | None = None,
    interpret: bool | None = None,
    partition: tuple[tuple[str, ...], tuple[str, ...]] | None = None,
) -> jax.Array:
  """``softmax(scale · q kᵀ, visible) v`` per head with the mask given as structure.

  Args:
    q: ``[batch, t, heads, head_dim]`` queries.
    k: ``[batch, s, heads, head_dim]`` keys.
    v: ``[batch, s, heads, head_dim_v]`` values (``head_dim_v = head_dim`` except for 'xla').
    scale: multiplies the scores (the CEM fused update folds β into ``q`` and passes 1).
    implementation: ``'xla'``, ``'cudnn'`` or ``'splash'`` (a resolved name, see
      :func:`resolve`).
    mask: ``[batch, t, s]`` bool, True where query ``i`` may see key ``j``: the full truth,
      used by 'xla' and 'cudnn' whenever the structure below is not plain causal (training
      with documents or strict causality, decoding against a cache). None only with
      ``is_causal``.
    is_causal: the mask is exactly ``j <= i`` (``j < i`` with ``strict_causal``) restricted
      to ``segment_ids``, with ``t == s``.
    strict_causal: ``N(i) = {j < i}`` (CEM_MATH.md section 1).
    segment_ids: ``[batch, t]`` int document ids, 0 = padding (tokens see their own document
      only), for kernels that take them (splash); needs ``is_causal``.
    interpret: run Pallas kernels in interpret mode; None: off TPU only (so the CPU tests run
      the splash kernel's own code; a model never picks splash off TPU, see :func:`resolve`).
    partition: ``(batch mesh axes, heads mesh axes)`` (:func:`partition_of` of ``mesh.rules``;
      None: the default rules'). Used by 'splash' under a mesh in context of more than
      one device; an axis that does not divide its dimension is left out (replicated).
  Returns:
    ``[batch, t, heads, head_dim_v]`` in ``q.dtype``; rows with no visible key are exactly 0.
  Raises:
    ValueError: an unknown implementation, or a structure it cannot take (e.g. 'splash'
      without ``is_causal``, a sequence length not a multiple of 128).
  """
  b, t = q.shape[0], q.shape[1]
  plain = is_causal and not strict_causal and segment_ids is None
  if mask is None and not is_causal:
    raise ValueError("dot_product_attention needs a mask or is_causal=True")
  if implementation == "xla" or implementation == "cudnn":
    impl = implementation
    if plain:
      out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                         implementation=impl)
    else:
      if mask is None:
        mask = make_mask(segment_ids, t, b, strict=strict_causal)
      # is_causal with the mask (which lies inside the causal triangle): cuDNN then skips
      # the tiles above the diagonal instead of computing all n x n of them.
      out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                         is_causal=is_causal, implementation=impl)
  elif implementation == "splash":
    if not is_causal:
      raise ValueError("attention_impl='splash' takes causal structure (is_causal=True with "
                       "segment ids); a dense mask (e.g. decoding) needs 'xla'")
    if t % SPLASH_BLOCK:
      raise ValueError(f"attention_impl='splash': seq_len={t} must be a multiple of "
                       f"{SPLASH_BLOCK}")
    if interpret is None:
      interpret = jax.default_backend() != "tpu"
    out = _splash_partitioned(q * jnp.asarray(scale, q.dtype), k, v, strict_causal,
                              segment_ids, interpret, partition or partition_of())
  else:
    raise ValueError(f"attention implementation={implementation!r}; allowed: xla, cudnn, "
                     "splash (resolve 'auto' with cem_jax.attention.resolve)")
  # With causal structure the rows come from it, O(batch x t): splash would otherwise read
  # the n x n mask only here (and under remat keep it as a residual of every layer).
  rows = visible_rows(None if is_causal else mask, is_causal=is_causal, strict=strict_causal,
                      segment_ids=segment_ids, shape=(b, t))
  if rows is not None:
    # where, not a product: a kernel may leave an empty row non-finite.
    out = jnp.where(rows[:, :, None, None], out, jnp.zeros((), out.dtype))
  return out.astype(q.dtype)


@functools.lru_cache(maxsize=32)
def _splash_kernel(t: int, heads: int, strict: bool, interpret: bool):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  block = max(b for b in (512, 256, 128) if t % b == 0)
  sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                        block_q_dq=block, block_kv_dq=block)
  causal = sa.CausalMask((t, t), offset=-1 if strict else 0)
  # Concrete mask tables, whatever trace first asks for them: the kernel is cached and shared by
  # later traces (jit, shard_map), which must not see another trace's tracers.
  with jax.ensure_compile_time_eval():
    return sa.make_splash_mha(sa.MultiHeadMask([causal] * heads), block_sizes=sizes,
                              head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash(q, k, v, strict: bool, segment_ids, interpret: bool, kernel=None):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  b, t, h, _ = q.shape
  if kernel is None:
    kernel = _splash_kernel(t, h, strict, interpret)
  # splash is per example and head-major: [heads, seq, head_dim].
  qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
  if segment_ids is None:
    out = jax.vmap(kernel)(qh, kh, vh)
  else:
    seg = segment_ids.astype(jnp.int32)
    out = jax.vmap(lambda a, b_, c, s: kernel(a, b_, c, segment_ids=sa.SegmentIds(s, s)))(
        qh, kh, vh, seg)
  return jnp.swapaxes(out, 1, 2)


def rows_and_heads_spec(shape, partition, mesh_shape: dict) -> PartitionSpec:
  """Where ``[batch, seq, heads, head_dim]`` activations of ``shape`` go on a mesh of
  ``mesh_shape`` (``{axis: devices}``): rows over ``partition``'s batch mesh axes, heads over
  its heads mesh axes, each only where they divide the dimension (``axes.dividing_axes``). A
  mesh axis splits at most one dimension (as ``sharding.logical_to_spec``): rows win."""
  rows = dividing_axes(partition[0], shape[0], mesh_shape)
  heads = dividing_axes(tuple(a for a in partition[1] if a not in (rows or ())), shape[2],
                        mesh_shape)
  return PartitionSpec(rows, None, heads, None)


def heads_laid_out(x: jax.Array, partition=None) -> jax.Array:
  """``x`` ``[batch, seq, heads, head_dim]`` constrained to :func:`rows_and_heads_spec` under a
  multi-device mesh in context (unchanged otherwise); ``partition`` as
  :func:`dot_product_attention`'s (None: the default rules')."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  spec = rows_and_heads_spec(x.shape, partition or partition_of(), dict(mesh.shape))
  return jax.lax.with_sharding_constraint(x, spec)


def _splash_partitioned(q, k, v, strict: bool, segment_ids, interpret: bool, partition):
  """:func:`_splash` per device under ``shard_map`` when a multi-device mesh is set."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return _splash(q, k, v, strict, segment_ids, interpret)
  h = q.shape[2]
  spec = rows_and_heads_spec(q.shape, partition, dict(mesh.shape))
  rows, heads = spec[0], mesh_axes_of(spec[2])  # the spec keeps a lone axis as its name
  # The kernel (cached) is built here, outside shard_map: inside, its mask tables would belong
  # to that shard_map's trace and manual mesh, and a later trace (eager, another mesh) fails.
  local_heads = h // math.prod(mesh.shape[a] for a in heads)
  kernel = _splash_kernel(q.shape[1], local_heads, strict, interpret)
  if segment_ids is None:
    fn = functools.partial(_splash, strict=strict, segment_ids=None, interpret=interpret,
                           kernel=kernel)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q, k, v)

  def fn(q, k, v, seg):
    return _splash(q, k, v, strict, seg, interpret, kernel)

  return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, PartitionSpec(rows, None)),
                       out_specs=spec, check_vma=False)(q, k, v, segment_ids)
