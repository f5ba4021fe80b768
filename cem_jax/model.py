"""The decoder language model: embedding → blocks → final RMSNorm → LM head."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from flax import nnx
from jax.sharding import PartitionSpec

from cem_jax import attention, energies, model_stats
from cem_jax.axes import DEFAULT_RULES, augmented_head_dim, dividing_axes, head_dim_of, mesh_axes_of
from cem_jax.config import BLOCKS, allowed_int, is_allowed_int, shown
from cem_jax.energies import EnergyAux
from cem_jax.layers import DTYPES, CEMBlock, LlamaBlock, RMSNorm
from cem_jax.layers.common import param
from cem_jax.loss import output_logits
from cem_jax.masks import make_mask

BLOCK_TYPES = {"cem": CEMBlock, "llama": LlamaBlock}
# model.remat -> jax.checkpoint policy: 'full' saves nothing, 'dots' keeps matmul outputs
# ('none' skips remat altogether).
CHECKPOINT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
# The names are config's (validated there); tests/test_config_checks.py keeps the two in step.
_LOGGED: set[str] = set()  # one log line per distinct attention choice, not per model copy


def _log_once(line: str) -> None:
  if line not in _LOGGED:
    _LOGGED.add(line)
    logging.info("%s", line)


def _weight_laid_out(weight: jax.Array, spec) -> jax.Array:
  """``weight`` constrained to ``spec(mesh shape)`` (a ``PartitionSpec``) under a mesh of
  several devices in context; as it is otherwise.

  A weight outside a trace on one device (a model built off the mesh and called op by op
  under ``jax.set_mesh``) is returned as it is too: nothing of it is split, and jax refuses to
  constrain such an array to a mesh ("must be a NamedSharding").
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return weight
  # A traced weight has no concrete sharding (getattr gives None): it is constrained.
  if isinstance(getattr(weight, "sharding", None), jax.sharding.SingleDeviceSharding):
    return weight
  return jax.lax.with_sharding_constraint(weight, spec(dict(mesh.shape)))


def known_flops_per_token(model_config, vocab_size: int, seq_len: int) -> float | None:
  """Forward FLOPs per token of a model of ``model_config`` (:func:`cem_jax.model_stats.
  flops_per_token`, the analytic count of the built-in energies), or None where its energies
  are not all built-in (:func:`cem_jax.energies.only_builtins`): a user energy's own
  operations are not modelled, and the built-ins' figure would pass for its.

  Raises:
    ValueError: an unknown energy name.
  """
  if not energies.only_builtins(model_config):
    return None
  return model_stats.flops_per_token(model_config, vocab_size, seq_len)


def resolve_attention(cfg, blocks, platform: str | None = None) -> tuple[str, str]:
  """The attention kernel of a model and why (:func:`cem_jax.attention.resolve`).

  Args:
    cfg: the ``model`` config group.
    blocks: the model's blocks (they know whether the CEM update is fused).
    platform: ``jax.default_backend()`` if None.
  Returns:
    ``(implementation, reason)``: ``'xla'``, ``'cudnn'`` or ``'splash'``, and one line why.
  Raises:
    ValueError: an explicit ``model.attention_impl`` that cannot run here, or 'cudnn' or
      'splash' that no layer would use (an autodiff CEM update calls no attention kernel;
      'xla' is accepted there: XLA computes its gradient).
  """
  platform = jax.default_backend() if platform is None else platform
  block = blocks[0]
  if isinstance(block, CEMBlock) and block.att_spec is not None:
    fused = block.att_update is block.att_spec.fused_update
    check_kernel_is_called(cfg, fused)
    if not fused:
      return "xla", ("no attention kernel: the CEM update is jax.grad of the energy "
                     f"{block.att_spec.name!r} (model.update_mode={cfg.update_mode!r}, "
                     f"model.energy_block_size={cfg.energy_block_size})")
  return attention.resolve(cfg.attention_impl, platform=platform, dtype=cfg.dtype,
                           head_dim=head_dim_of(cfg), augmented_head_dim=augmented_head_dim(cfg))


def check_kernel_is_called(cfg, fused: bool) -> None:
  """Refuses an explicit kernel (``model.attention_impl`` 'cudnn' or 'splash') that no layer
  would call: a CEM attention update that is not fused (``jax.grad`` of the energy) calls no
  attention kernel. 'xla' is accepted: XLA computes that gradient, as it does every op.

  Args:
    cfg: the ``model`` config group of a model with the CEM attention.
    fused: whether its attention update is the energy's closed form.
  Raises:
    ValueError: one line naming ``model.attention_impl`` and ``model.update_mode``.
  """
  if not fused and cfg.attention_impl not in ("auto", "xla"):
    raise ValueError(
        f"model.attention_impl={cfg.attention_impl!r} has no effect: the CEM attention update "
        f"is jax.grad of {cfg.attention_energy!r} (model.update_mode={cfg.update_mode!r}), "
        "which calls no attention kernel; use 'auto' or 'xla' (memory: "
        "model.energy_block_size)")


def kernel_at(requested: str, kernel: str, seq_len: int) -> tuple[str, str | None]:
  """The kernel a model runs at one sequence length: the one it resolved, or XLA's under
  'auto' where that kernel cannot take ``seq_len`` (``attention.SEQ_MULTIPLE``: splash a
  multiple of 128, cuDNN an even length). The one rule for the training and eval steps,
  ``aot`` and ``bench`` alike.

  Args:
    requested: ``model.attention_impl`` as configured (``'auto'`` or an explicit name).
    kernel: the model's resolved kernel (``DecoderLM.attention_impl``).
    seq_len: the sequence length of the step's input, in tokens.
  Returns:
    ``(kernel, None)`` where ``kernel`` takes ``seq_len``; ``('xla', why)`` under 'auto'
    where it does not, ``why`` one line.
  Raises:
    ValueError: an explicit kernel at a ``seq_len`` it cannot take (one line).
  """
  multiple = attention.SEQ_MULTIPLE.get(kernel)
  if not multiple or seq_len % multiple == 0:
    return kernel, None
  if requested != "auto":
    raise ValueError(f"model.attention_impl={kernel!r} cannot run: seq_len={seq_len} must "
                     f"be a multiple of {multiple} (use 'auto', which runs XLA there, or 'xla')")
  return "xla", f"auto: {kernel} needs a multiple of {multiple}"


def training_aux(
    cfg: ml_collections.ConfigDict,
    segment_ids: jax.Array | None,
    batch: int,
    seq_len: int,
    attention_impl: str = "xla",
    attention_partition: tuple | None = None,
    attention_interpret: bool | None = None,
) -> EnergyAux:
  """The aux of a ``[batch, seq_len]`` training or eval input: causal mask (documents and
  padding from ``segment_ids``, ``[batch, seq_len]`` int, 0 = padding), positions ``0..``,
  the model's static options and the attention kernel (``attention_impl``, resolved).

  Raises:
    ValueError: an explicit ``model.attention_impl`` at a ``seq_len`` its kernel cannot take
      (``attention.SEQ_MULTIPLE``: splash a multiple of 128, cuDNN an even one; under 'auto'
      the kernel becomes 'xla', logged once).
  """
  positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
  impl, why = kernel_at(cfg.attention_impl, attention_impl, seq_len)
  if why is not None:
    _log_once(f"attention: xla at seq_len={seq_len} ({why})")
  return EnergyAux(
      mask=make_mask(segment_ids, seq_len, batch, strict=cfg.strict_causal),
      positions=positions,
      rope_theta=cfg.rope_theta if cfg.rope else None,
      diagonal_form=cfg.diagonal_form,
      is_plain_causal=segment_ids is None and not cfg.strict_causal,
      segment_ids=segment_ids,
      is_causal=True,
      strict_causal=cfg.strict_causal,
      attention_impl=impl,
      attention_partition=attention_partition,
      attention_interpret=attention_interpret,
      energy_block_size=cfg.energy_block_size,
  )


def decoding_aux(cfg: ml_collections.ConfigDict, batch: int, num_new: int, max_len: int,
                 index) -> EnergyAux:
  """The aux of ``num_new`` new tokens at positions ``index..`` (int or traced int32 scalar)
  against a ``max_len`` cache: mask ``[batch, num_new, max_len]``, key positions ``0..``.

  Decoding attends through the same entry point with a dense mask, always on 'xla' (said in
  the model's log line): the offset ``index`` is traced, splash masks are static and
  block-aligned, and cuDNN would take the mask as a dense bias on a memory-bound step with no
  measured gain.
  """
  query = index + jnp.arange(num_new, dtype=jnp.int32)
  keys = jnp.arange(max_len, dtype=jnp.int32)
  visible = keys[None, :] < query[:, None] if cfg.strict_causal else (
      keys[None, :] <= query[:, None])
  return EnergyAux(
      mask=jnp.broadcast_to(visible, (batch, num_new, max_len)),
      positions=jnp.broadcast_to(query, (batch, num_new)),
      key_positions=jnp.broadcast_to(keys, (batch, max_len)),
      rope_theta=cfg.rope_theta if cfg.rope else None,
      diagonal_form=cfg.diagonal_form,
      strict_causal=cfg.strict_causal,
      attention_impl="xla",
      energy_block_size=cfg.energy_block_size,
  )


@flax.struct.dataclass
class DecodeCache:
  """A decoding cache (:meth:`DecoderLM.init_cache`): ``layers``, one block cache per layer
  (the block's ``init_cache`` layout), and ``max_len``, the positions it holds.

  ``max_len`` is static (part of the tree structure, not a leaf), so a jitted step knows the
  decoding mask's width without reading it off a leaf whose axes depend on the block kind.
  """

  layers: tuple
  max_len: int = flax.struct.field(pytree_node=False)

  def __len__(self) -> int:
    return len(self.layers)


class DecoderLM(nnx.Module):
  """A decoder-only LM whose blocks are CEM layers or Llama blocks (``model.block``).

  Parameters: ``embedding`` ``[vocab_size, d_model]``; ``blocks``; ``final_norm``; and,
  unless ``model.tie_embeddings``, ``lm_head`` ``[d_model, vocab_size]``.
  A token enters as its embedding row times ``model.embed_scale`` (1 by default; Gemma's
  ``sqrt(d_model)``); the output layer (the embedding transposed when tied) is not scaled.

  Shared depth: ``blocks`` holds ``G = model.num_unique_blocks`` blocks (-1: one per layer)
  and layer ``l`` of ``model.num_layers`` runs ``blocks[l % G]`` (Universal-Transformer /
  MoEUT-style cyclic reuse; :meth:`layer_blocks`), so depth costs compute, not parameters.
  With a momentum ``model.inner_optimizer`` the velocity starts at zero at the embeddings and
  is carried from each layer to the next (``cem_jax.inner``).

  Args:
    cfg: the ``model`` config group (``cem_jax.config``).
    vocab_size: number of token ids (the tokenizer's, ``data.vocab_size``).
    rngs: ``nnx.Rngs`` with a ``params`` stream.
    rules: the logical-axis rules (``mesh.rules``, :func:`cem_jax.axes.rules_from_config`);
      they tell a kernel that runs per device (splash) how rows and heads are laid out.
    platform: the platform the model will run on (``'cpu'``, ``'gpu'``, ``'tpu'``): this
      machine's ``jax.default_backend()`` if None; another to compile ahead of time for a
      device this machine lacks (``experiments/step_program.py``'s H200 program).
  The attention kernel (``model.attention_impl``, :mod:`cem_jax.attention`) is resolved here,
  once, and logged in one line with the reason; ``attention_impl`` and ``attention_reason``
  hold it.

  Raises:
    ValueError: unknown ``model.block``, an energy/update option the layers reject, or an
      explicit ``model.attention_impl`` that cannot run on this machine with this model.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, vocab_size: int, *, rngs: nnx.Rngs,
               rules=DEFAULT_RULES, platform: str | None = None):
    cfg = ml_collections.FrozenConfigDict(cfg)
    # Public and built directly (tests, tools) without config.validate: check the one choice
    # that would otherwise surface as a bare KeyError.
    if cfg.block not in BLOCKS:
      raise ValueError(f"model.block={cfg.block!r}; allowed: {', '.join(BLOCKS)}")
    self.cfg = cfg
    self.dtype = DTYPES[cfg.dtype]
    pdt = DTYPES[cfg.param_dtype]
    self.embedding = param(rngs, (vocab_size, cfg.d_model), cfg.init_std,
                           ("vocab", "embed"), pdt)
    block_cls = BLOCK_TYPES[cfg.block]
    unique = cfg.num_unique_blocks if cfg.num_unique_blocks > 0 else cfg.num_layers
    self.blocks = nnx.List([block_cls(cfg, rngs=rngs) for _ in range(unique)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    self.attention_impl, self.attention_reason = resolve_attention(cfg, self.blocks, platform)
    # Splash runs interpreted off a TPU; a model built for a TPU elsewhere runs the kernel.
    self.attention_interpret = None if platform is None else platform != "tpu"
    self.attention_partition = attention.partition_of(rules)
    # Where the vocabulary of the lookup's table and of the output layer is split: the
    # rule's mesh axes that do not split the rows (batch), all of them if their product divides
    # the vocabulary, else none (dividing_axes).
    self.vocab_axes = tuple(a for a in mesh_axes_of(dict(rules).get("vocab"))
                            if a not in self.attention_partition[0])
    _log_once(f"attention: {self.attention_impl} ({self.attention_reason}); cached "
              "decoding: xla")
    if not cfg.tie_embeddings:
      self.lm_head = param(rngs, (cfg.d_model, vocab_size), cfg.init_std,
                           ("embed", "vocab"), pdt)

  def kernel_at(self, seq_len: int) -> tuple[str, str]:
    """``(kernel, reason)``: the attention kernel this model's steps run at ``seq_len``
    (:func:`kernel_at`) and why. Raises ValueError as :func:`kernel_at` does."""
    kernel, why = kernel_at(self.cfg.attention_impl, self.attention_impl, seq_len)
    return kernel, self.attention_reason if why is None else why

  def make_aux(self, segment_ids: jax.Array | None, batch: int, seq_len: int) -> EnergyAux:
    """:func:`training_aux` with this model's kernel and partition."""
    return training_aux(self.cfg, segment_ids, batch, seq_len, self.attention_impl,
                        self.attention_partition, self.attention_interpret)

  def make_decode_aux(self, batch: int, num_new: int, max_len: int, index) -> EnergyAux:
    """:func:`decoding_aux` for this model's config."""
    return decoding_aux(self.cfg, batch, num_new, max_len, index)

  def _rows_over_devices(self, x: jax.Array) -> jax.Array:
    """``x`` ``[batch, seq, d_model]`` constrained to rows over the ``batch`` mesh axes (data
    x fsdp by default), under a mesh in context (``jax.set_mesh``, or the abstract mesh the train
    and eval steps run under).

    Without it XLA may follow the parameters' fsdp sharding into the activations and run every
    token on every device (measured: 8 CPU devices as fsdp=8, the training step's dots were
    [4096, 512] on each device, 2.2x the memory of data=8). A batch the axes do not divide
    (decoding one sequence) is left as it is.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
      return x
    batch_axes = self.attention_partition[0]  # the mesh axes of the rules' `batch` axis
    rows = dividing_axes(batch_axes, x.shape[0], dict(mesh.shape))
    if rows is None:
      return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(rows, *([None] * (x.ndim - 1))))

  def embed(self, tokens: jax.Array) -> jax.Array:
    """The blocks' input: ``tokens`` ``[batch, seq_len]`` int ids -> their embedding rows times
    ``model.embed_scale``, ``[batch, seq_len, d_model]`` in the compute dtype, rows over the
    batch mesh axes under a mesh."""
    x = jnp.take(self._table_for_lookup(), tokens, axis=0).astype(self.dtype)
    if self.cfg.embed_scale != 1.0:  # at 1.0 the program is the one before the option existed
      x = x * jnp.asarray(self.cfg.embed_scale, self.dtype)
    return self._rows_over_devices(x)

  def _table_for_lookup(self) -> jax.Array:
    """The embedding ``[vocab_size, d_model]`` with ``d_model`` whole on every device and the
    vocabulary split over :attr:`vocab_axes` (tensor by default), under a mesh in context, for
    the token lookup.

    FSDP splits the table's ``d_model`` over the fsdp axis, which also splits the rows. A
    lookup into the table as laid out gives every device all rows' embeddings for its share of
    ``d_model``, from which XLA reaches the rows' split badly: it logs an "involuntary full
    rematerialization" on every mesh with data and fsdp both > 1, and on CPU gathered the whole
    batch's embeddings onto every device (``tests/test_sharding.py``). Gathering the table's
    ``d_model`` first, as FSDP gathers every weight before use, keeps the lookup on each
    device's own rows; the vocabulary stays split over tensor, so a large one need not be
    gathered. Not over an axis that also splits the rows, where ``mesh.rules`` puts it there
    (``vocab`` on fsdp or data): a lookup into a table so split made XLA sum the whole batch's
    embeddings over every device (``vocab`` on ``('fsdp', 'tensor')``, 1 x 4 x 2).
    Measured (paper-scale Llama training step, compiled ahead of time: docs/PERFORMANCE.md,
    "Sharded steps"): its collectives return 21% fewer bytes on v5e-16 as 4 x 4 x 1, 15% fewer
    on an H200:8 as 2 x 4 x 1, 5.5% more (for 1.1 GiB less memory) on v5e-16 as 1 x 16 x 1.
    """
    table = self.embedding[...]
    return _weight_laid_out(table, lambda mesh_shape: PartitionSpec(
        dividing_axes(self.vocab_axes, table.shape[0], mesh_shape), None))

  def layer_blocks(self) -> list:
    """The block each of the ``model.num_layers`` layers runs: ``blocks[l % G]``."""
    return [self.blocks[i % len(self.blocks)] for i in range(self.cfg.num_layers)]

  def init_cache(self, batch: int, max_len: int, num_steps: int | None = None) -> DecodeCache:
    """An empty :class:`DecodeCache` for up to ``max_len`` positions, one entry per layer,
    every leaf zeros in ``model.dtype``:

    - Llama block: ``{'k', 'v'}``, each ``[batch, max_len, num_heads, head_dim]``;
    - CEM block with CEM attention: ``{'context'}``, ``[copies, batch, max_len, d_model]``
      (copies: 1 with ``model.context='fixed'``, else ``num_steps``);
    - CEM block with the standard attention (``model.cem_attention=False``): ``{'k', 'v'}``,
      each ``[num_steps, batch, max_len, num_heads, head_dim]``.

    ``num_steps``: the recursive steps the decoding calls will run (default
    ``model.num_steps``); pass the same to :meth:`__call__`, which refuses a cache made for
    other steps.

    Raises:
      ValueError: ``batch`` or ``max_len`` < 1, or ``num_steps`` not as
        :func:`check_num_steps` allows.
    """
    check_num_steps(num_steps)
    if batch < 1 or max_len < 1:
      raise ValueError(f"DecoderLM.init_cache: batch={batch}, max_len={max_len}; allowed: "
                       ">= 1 each")
    return DecodeCache(tuple(block.init_cache(batch, max_len, num_steps)
                             for block in self.layer_blocks()), max_len)

  def __call__(
      self,
      tokens: jax.Array,
      segment_ids: jax.Array | None = None,
      *,
      num_steps: int | None = None,
      trace: bool = False,
      cache: DecodeCache | None = None,
      index: jax.Array | int = 0,
      hidden: bool = False,
  ):
    """Next-token logits.

    Args:
      tokens: ``[batch, seq_len]`` int token ids.
      segment_ids: ``[batch, seq_len]`` int document ids (tokens attend within their
        document only; 0 = padding), or None for one causal sequence. Ignored when
        ``model.document_mask`` is False (plain causal attention over the window).
      num_steps: recursive steps per CEM layer at this call (default ``model.num_steps``).
      trace: also return the energy trace, a list over layers of the block's trace: energies
        summed over the real tokens (``segment_ids > 0``; all tokens without segment ids).
      cache: a :class:`DecodeCache` from :meth:`init_cache` (at the same ``num_steps``):
        ``tokens`` are then the new tokens at positions ``index, index+1, ...`` (prefill: the
        prompt at 0; then one at a time).
      index: where the new tokens go in the cache (int or int32 scalar).
      hidden: return the final normalised hidden state ``[batch, seq_len, d_model]`` (compute
        dtype) in place of the logits, for a loss that makes the logits itself
        (``cem_jax.loss.blockwise_cross_entropy`` with :meth:`output_head`).
    Returns:
      ``logits`` ``[batch, seq_len, vocab_size]`` float32; with ``trace`` a tuple
      ``(logits, traces)``; with ``cache`` a tuple ``(logits, cache)``, the cache updated
      (decoding is one document per row: ``segment_ids`` is refused).
    Raises:
      ValueError: ``trace`` or ``segment_ids`` with ``cache`` (cached decoding keeps no
        energy trace, and is one document per row);
        ``num_steps`` not as :func:`check_num_steps` allows; a cache that does not fit the
        call (its ``max_len`` too short for the tokens at a concrete ``index``, or made for
        another batch, ``num_steps`` or dtype).
      TypeError: ``cache`` not a :class:`DecodeCache`.
    """
    if cache is not None and not isinstance(cache, DecodeCache):
      raise TypeError(f"DecoderLM: cache is a {type(cache).__name__}; pass the DecodeCache "
                      "that init_cache returns")
    if segment_ids is not None and cache is not None:
      # Decoding attends over one document: padding or documents in the ids would be ignored.
      raise ValueError("DecoderLM: segment_ids with a decoding cache; cached decoding is one "
                       "document per row (pass segment_ids=None)")
    if trace and cache is not None:
      raise ValueError("DecoderLM: trace=True with a decoding cache; cached decoding keeps no "
                       "energy trace (evaluate the full sequence with trace=True instead)")
    check_num_steps(num_steps)
    b, t = tokens.shape
    if cache is not None:
      self._check_cache(cache, b, t, index, num_steps)
    if cache is None:
      aux = self.make_aux(segment_ids if self.cfg.document_mask else None, b, t)
      if segment_ids is not None:  # padding is known even when attention ignores documents
        aux = aux.replace(real=segment_ids > 0)
    else:
      aux = self.make_decode_aux(b, t, cache.max_len, index)
    x = self.embed(tokens)

    def run_block(block, x, block_cache, velocity):
      return block(x, aux, num_steps=num_steps, trace=trace, cache=block_cache, index=index,
                   velocity=velocity)

    if self.cfg.remat != "none":  # recompute activations in the backward pass, per block
      run_block = nnx.remat(run_block, policy=CHECKPOINT_POLICIES[self.cfg.remat])
    traces, new_cache = [], []
    momentum = self.cfg.block == "cem" and self.cfg.inner_optimizer != "gd"
    velocity = jnp.zeros_like(x) if momentum else None
    for i, block in enumerate(self.layer_blocks()):
      out = run_block(block, x, None if cache is None else cache.layers[i], velocity)
      x, velocity = self._rows_over_devices(out.y), out.velocity
      traces.append(out.trace)
      new_cache.append(out.cache)
    x = self.final_norm(x)
    out = x if hidden else output_logits(x, self.output_head())
    if cache is not None:
      return out, DecodeCache(tuple(new_cache), cache.max_len)
    return (out, traces) if trace else out

  def _check_cache(self, cache: DecodeCache, batch: int, num_new: int, index,
                   num_steps: int | None) -> None:
    """Refuses a call that the cache does not fit, which would otherwise decode wrong tokens
    without an error: ``dynamic_update_slice`` clamps a write past ``max_len`` onto the last
    slots, and a recursive step beyond the cache's copies reads the last copy and writes none.
    ``index`` is checked where it is concrete (a traced one is the caller's to keep in range).

    Raises:
      ValueError: one line naming what does not fit and what would.
    """
    if num_new > cache.max_len:
      raise ValueError(f"DecoderLM: {num_new} new tokens exceed the cache's "
                       f"max_len={cache.max_len}; make it with init_cache(batch, max_len >= "
                       f"{num_new})")
    if not isinstance(index, jax.core.Tracer):
      i = int(index)
      if not 0 <= i <= cache.max_len - num_new:
        raise ValueError(f"DecoderLM: index={i} for {num_new} new tokens in a cache of "
                         f"max_len={cache.max_len}; allowed: 0..{cache.max_len - num_new}")
    want = jax.eval_shape(lambda: self.init_cache(batch, cache.max_len, num_steps))
    if len(cache.layers) != len(want.layers):
      raise ValueError(f"DecoderLM: the cache holds {len(cache.layers)} layers, this model "
                       f"runs {len(want.layers)}; make it with this model's init_cache")
    for layer, (got, need) in enumerate(zip(cache.layers, want.layers, strict=True)):
      got_shapes = {k: (tuple(v.shape), jnp.dtype(v.dtype)) for k, v in got.items()}
      need_shapes = {k: (tuple(v.shape), jnp.dtype(v.dtype)) for k, v in need.items()}
      if got_shapes != need_shapes:
        steps = self.cfg.num_steps if num_steps is None else num_steps
        raise ValueError(
            f"DecoderLM: the cache does not fit this call (batch={batch}, num_steps={steps}): "
            f"layer {layer} holds {_shapes(got_shapes)}, the call needs "
            f"{_shapes(need_shapes)}; make it with init_cache(batch, max_len, num_steps) at "
            "the num_steps of the calls")

  def output_head(self) -> jax.Array:
    """The output layer's matrix ``[d_model, vocab_size]`` in the compute dtype: the embedding
    transposed (``model.tie_embeddings``) or ``lm_head``. Logits are
    ``cem_jax.loss.output_logits(hidden, output_head())``.

    Under a mesh its vocabulary is split over :attr:`vocab_axes`: the mesh axes of the rules'
    ``vocab`` that do not split the rows (``batch``), if their product divides it (else it is
    whole); its ``d_model`` as XLA likes. ``mesh.rules`` may put the vocabulary on fsdp or
    data, where the rows are: an output layer laid out that way made XLA all-gather the whole
    batch's hidden states onto every device for the logits (``tests/test_sharding.py``).
    Those axes are gathered before use instead, as FSDP gathers every weight, also where the
    rows are not split (decoding one sequence). Under the default rules (vocabulary over
    tensor) the programs are unchanged.
    """
    if self.cfg.tie_embeddings:
      head = self.embedding[...].astype(self.dtype).T
    else:
      head = self.lm_head[...].astype(self.dtype)
    return _weight_laid_out(head, lambda mesh_shape: PartitionSpec(
        PartitionSpec.UNCONSTRAINED, dividing_axes(self.vocab_axes, head.shape[1],
                                                   mesh_shape)))


def check_num_steps(num_steps) -> None:
  """Refuses a ``num_steps`` override that breaks ``model.num_steps``'s rule (an int >= 1 and
  below its bound, :func:`cem_jax.config.is_allowed_int`): 0 steps would leave every CEM layer
  the identity without a word, 10**9 would be traced for ever. None (``model.num_steps``
  itself) passes.

  Raises:
    ValueError: one line naming ``num_steps``, the value and what is allowed.
  """
  if num_steps is not None and not is_allowed_int("model.num_steps", num_steps):
    raise ValueError(f"DecoderLM: num_steps={shown(num_steps)}; allowed: "
                     f"{allowed_int('model.num_steps')} (None: model.num_steps)")


def _shapes(leaves: dict) -> str:
  return ", ".join(f"{k} {list(shape)} {dtype}" for k, (shape, dtype) in sorted(leaves.items()))


def abstract_model(model_cfg: ml_collections.ConfigDict, vocab_size: int, *,
                   rules=DEFAULT_RULES, platform: str | None = None) -> DecoderLM:
  """``DecoderLM`` built as shapes only (``nnx.eval_shape``: no parameter is allocated), for
  what the parameters' names, shapes and counts and the kernel choice need.

  Raises:
    ValueError: what ``DecoderLM`` raises (e.g. an explicit attention kernel this platform
      cannot run), one line.
  """
  return nnx.eval_shape(lambda: DecoderLM(model_cfg, vocab_size, rngs=nnx.Rngs(0), rules=rules,
                                          platform=platform))
