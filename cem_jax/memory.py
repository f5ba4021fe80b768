"""Device memory of a compiled step, and the start-up check that the training and eval steps
fit.

A training config too large for the accelerator (``data.seq_len``, ``train.batch_size``,
``model.d_model``...) used to end in XLA's out-of-memory traceback at the first step, or at
compile time on TPU. :func:`compile_within_memory` compiles the step ahead of time, logs its
footprint per device and, where the backend reports the device's limit (GPU, TPU; not CPU),
refuses a step that needs more with one line naming the config values to change; on a CPU it
refuses one that needs more than the host's memory and swap, or than it can give now. The
compiled program is the one the first call uses (jax shares the compilation between
``lower(...).compile()`` and the call), so the check costs no second compile.
"""

from __future__ import annotations

import math

import jax
import ml_collections
from absl import logging

from cem_jax import errors

GIB = 2**30

# The absl status code XLA gives every out-of-memory error (compile time on TPU, run time on
# GPU): a code, not the message's wording.
_OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"


def _is_out_of_memory(e: Exception) -> bool:
  """The runtime error's status code (``error_code_string``; a jaxlib without it puts the
  code's name first in the message)."""
  code = getattr(e, "error_code_string", None)
  return code == _OUT_OF_MEMORY if code is not None else str(e).startswith(_OUT_OF_MEMORY)


def footprint_bytes(compiled) -> int | None:
  """A compiled program's device memory per device, in bytes: arguments + outputs + XLA
  temporaries − buffers aliased (donated inputs reused as outputs), from XLA's memory
  analysis of the (partitioned) program.

  Read from the program rather than the allocator's ``peak_bytes_in_use``, a process-wide
  high-water mark that would carry the largest earlier program into every later one. None
  where the backend does not report it.
  """
  try:
    mem = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - not every backend implements it
    return None
  if mem is None:
    return None
  return int(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
             - mem.alias_size_in_bytes)


def _meminfo(*fields: str) -> int | None:
  """The sum of Linux's ``/proc/meminfo`` ``fields``, in bytes; None where one is missing."""
  found = {}
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        name, _, rest = line.partition(":")
        if name in fields:
          found[name] = int(rest.split()[0]) * 1024  # kB
  except (OSError, ValueError, IndexError):
    return None
  return sum(found.values()) if len(found) == len(fields) else None


def host_available_bytes() -> int | None:
  """The memory this machine can give new allocations now, in bytes: what it has free without
  swapping (Linux's ``MemAvailable``, reclaimable caches included) and its free swap
  (``SwapFree``); None where they are not reported."""
  return _meminfo("MemAvailable", "SwapFree")


def host_total_bytes() -> int | None:
  """All the memory this machine could give a process, in bytes: its RAM and swap (Linux's
  ``MemTotal`` + ``SwapTotal``); None where it is not reported."""
  return _meminfo("MemTotal", "SwapTotal")


def resident_bytes(tree) -> int:
  """Bytes per device of the arrays in ``tree`` (one shard each; an array's shards are
  equal): what stays on the device beside a program that does not take it, e.g. the optimizer
  state during an eval."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if hasattr(x, "sharding") else x.shape
    total += math.prod(shape) * x.dtype.itemsize
  return total


def check_state_fits(params, opt_state, config: ml_collections.ConfigDict,
                     limit_bytes: int | None = None) -> None:
  """Refuses parameters and optimizer state larger than one device's memory, from their
  shapes on their shardings (``jax.ShapeDtypeStruct`` s), before they are made: made first,
  they failed in XLA (a RESOURCE_EXHAUSTED traceback; past 2**64 random bits a lowering
  error), or the kernel killed the process, before :func:`compile_within_memory` could speak.
  ``limit_bytes`` as there (None: :func:`device_limit_bytes`; on CPU the state on all of
  this process's devices that hold it, from its shardings, against the host's memory and
  swap).

  Raises:
    ValueError: one line naming both sizes, the limit and the config values to change.
  """
  params_bytes, opt_bytes = resident_bytes(params), resident_bytes(opt_state)
  need = params_bytes + opt_bytes
  limit = device_limit_bytes() if limit_bytes is None else limit_bytes
  where = "per device, the device allows"
  on_host = _host_need(need, limit, _devices_holding((params, opt_state)))
  if on_host is not None:
    need, limit = on_host, host_total_bytes()
    where = "on this host's CPU devices, more than its memory and swap,"
  if limit is None or need <= limit:
    return
  m = config.model
  sizes = _sizes(params_bytes, opt_bytes, need, limit)
  raise ValueError(
      f"the parameters ({sizes[0]}) and optimizer state ({sizes[1]}) need {sizes[2]} {where} "
      f"{sizes[3]}: shard over more devices (mesh.fsdp={config.mesh.fsdp}) or make the model "
      f"smaller (model.d_model={m.d_model}, model.mlp_dim={m.mlp_dim}, "
      f"model.num_layers={m.num_layers}, data.vocab_size={config.data.vocab_size})")


def _host_need(per_device: int, limit: int | None, devices: int) -> int | None:
  """What ``per_device`` bytes on each of ``devices`` of this process's devices take from the
  host's memory, where that memory is the limit: with no device limit (``limit`` None) on CPU
  devices, which share the host's RAM and swap and whose allocations no allocator caps (each
  holds its own copy of a replicated array), ``per_device`` times ``devices``; None elsewhere
  (``limit`` applies to ``per_device``)."""
  if limit is not None or jax.local_devices()[0].platform != "cpu":
    return None
  return per_device * devices


def _local_devices(shardings) -> int:
  """How many of this process's devices the ``shardings`` (``jax.sharding.Sharding`` s) place
  arrays on: those a program's or a state's bytes per device are held on. At least 1: arrays
  without a sharding (NumPy, a ``jax.ShapeDtypeStruct`` without one) go to one device."""
  here = jax.process_index()
  devices = {d for s in shardings for d in s.device_set
             if getattr(d, "process_index", here) == here}
  return max(len(devices), 1)


def _devices_holding(tree) -> int:
  """:func:`_local_devices` of the arrays or ``jax.ShapeDtypeStruct`` s of ``tree``."""
  return _local_devices([x.sharding for x in jax.tree.leaves(tree)
                         if getattr(x, "sharding", None) is not None])


def device_limit_bytes(device: jax.Device | None = None) -> int | None:
  """The memory the backend lets one device's programs use (``memory_stats()['bytes_limit']``,
  bytes), for ``device`` (default: this process's first); None where it reports none (CPU)."""
  device = device if device is not None else jax.local_devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 - not every backend implements it
    return None
  limit = (stats or {}).get("bytes_limit")
  return int(limit) if limit else None


def _sizes(*nbytes: int) -> list[str]:
  """Byte counts in one unit (GiB from 1 GiB on, else MiB), exact where they would read
  alike."""
  gib = max(nbytes) >= GIB
  out = [f"{n / GIB:.2f} GiB" if gib else f"{n / 2**20:.1f} MiB" for n in nbytes]
  return out if len(set(out)) == len(out) else [f"{n} bytes" for n in nbytes]


def _smaller_loss_blocks(config: ml_collections.ConfigDict) -> str:
  """The advice to make the logits in (smaller) blocks, or '' when no block size would do."""
  t, d = config.train, config.data
  # The largest divisor of seq_len up to 256 below the block in use (0: the whole sequence);
  # not under 8 positions, where the scan's steps would cost more than the logits save.
  below = min(t.loss_block_size or d.seq_len, 257)
  block = next((b for b in range(below - 1, 7, -1) if d.seq_len % b == 0), None)
  return (f"set train.loss_block_size={block} (now {t.loss_block_size}; the logits of "
          f"{block} positions at a time), " if block else "")


def eval_advice(config: ml_collections.ConfigDict, data_parallel: int = 1) -> str:
  """What to change when the eval step does not fit (:func:`compile_within_memory`'s
  ``advice``): a smaller ``eval.batch_size`` (about half, still a multiple of the
  ``data_parallel`` devices; left out at the smallest), the logits in blocks, fsdp."""
  bs = config.eval.batch_size
  half = (bs // 2) // data_parallel * data_parallel
  smaller = f"lower eval.batch_size={bs} to {half}, " if half >= data_parallel else ""
  return (f"{smaller}{_smaller_loss_blocks(config)}or shard over more devices "
          f"(mesh.fsdp={config.mesh.fsdp})")


def _what_to_change(config: ml_collections.ConfigDict, data_parallel: int) -> str:
  """What to change when the training step does not fit (:func:`compile_within_memory`'s
  default ``advice``): more gradient accumulation steps (left out where no larger count gives
  each of the ``data_parallel`` devices whole microbatches), full remat (unless set), the
  logits in blocks, fsdp, a shorter sequence or a smaller batch."""
  t, d, m = config.train, config.data, config.model
  k = t.gradient_accumulation_steps
  # The next k that still gives every data-parallel device whole microbatches.
  more = next((j for j in range(k + 1, t.batch_size + 1)
               if t.batch_size % (j * data_parallel) == 0), None)
  accumulate = (f"raise train.gradient_accumulation_steps={k} to {more} (the same batch in "
                "smaller pieces), " if more else "")
  remat = "" if m.remat == "full" else f"set model.remat='full' (now {m.remat!r}), "
  return (f"{accumulate}{remat}{_smaller_loss_blocks(config)}shard over more devices "
          f"(mesh.fsdp={config.mesh.fsdp}), or lower data.seq_len={d.seq_len} or "
          f"train.batch_size={t.batch_size}")


def compile_within_memory(jitted, args: tuple, config: ml_collections.ConfigDict, *,
                          what: str = "the training step", limit_bytes: int | None = None,
                          data_parallel: int = 1, advice: str | None = None,
                          resident: int = 0, resident_what: str = ""):
  """Compiles ``jitted(*args)`` ahead of time and checks that it fits one device.

  Args:
    jitted: a ``jax.jit`` function (e.g. :func:`cem_jax.steps.make_train_step`'s).
    args: its arguments, arrays or ``jax.ShapeDtypeStruct`` s with the shardings of the calls
      to come (so the calls reuse this compilation).
    config: the run's config, for the fields the error names.
    what: the program's name in the log line and the error.
    limit_bytes: the device's limit in bytes; None (default) reads :func:`device_limit_bytes`
      (none on CPU: the footprint on all of this process's devices the program runs on, from
      its shardings, is compared with the host's memory and swap, :func:`host_total_bytes`,
      refused beyond it, and with what it can give now, :func:`host_available_bytes`, refused
      beyond that too).
    data_parallel: the devices the batch is split over (which gradient accumulation steps
      the error may suggest: each device's rows must split into whole microbatches).
    advice: what the error says to change; None (default): the training step's (gradient
      accumulation, remat, loss blocks, fsdp, seq_len, batch size); :func:`eval_advice` for
      the eval step.
    resident: bytes per device that stay on the device while the program runs without
      being its arguments (:func:`resident_bytes` of the optimizer state, for the eval
      step), added to its footprint; ``resident_what`` names them in the log and the error.
  Returns:
    The compiled program (``jax.stages.Compiled``).
  Raises:
    ValueError: one line, when XLA's memory analysis of the program exceeds the limit (on a
      CPU the host's memory and swap, or what it can give now), or when XLA itself runs out
      of memory compiling it, naming the footprint, the limit and the config values to change.
  """
  limit = device_limit_bytes() if limit_bytes is None else limit_bytes
  if advice is None:
    advice = _what_to_change(config, data_parallel)
  try:
    compiled = jitted.lower(*args).compile()
  except jax.errors.JaxRuntimeError as e:
    if not _is_out_of_memory(e):
      raise
    raise ValueError(f"{what} does not fit in device memory (XLA: {errors.first_line(e)[:200]}): "
                     f"{advice}") from e
  need = footprint_bytes(compiled)
  if need is None:
    return compiled
  need += resident
  held = f", with {_sizes(resident)[0]} of {resident_what} held beside it" if resident else ""
  of = f" of {_sizes(need, limit)[1]}" if limit else ""
  logging.info("%s: %s per device%s (XLA memory analysis: arguments, outputs and "
               "temporaries%s)", what, _sizes(need)[0], of, held)
  if limit and need > limit:
    needs, allows = _sizes(need, limit)
    raise ValueError(f"{what} needs {needs} per device (XLA memory analysis{held}), the "
                     f"device allows {allows}: {advice}")
  # The program's devices, not all of this process's: python -m cem_jax.evaluate runs its eval
  # step on one device however many forced host devices the process has.
  on_host = _host_need(need, limit, _local_devices(
      jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))))
  if on_host is not None:
    _check_host_memory(what, on_host, advice)
  return compiled


def check_host_batch(field: str, global_rows: int, rows: int, row_bytes: int,
                     seq_len: int, advice: str | None = None) -> None:
  """Refuses a batch (``field``, ``train.batch_size`` or ``eval.batch_size``, of
  ``global_rows`` rows) whose host arrays cannot fit this machine: this process's ``rows`` of
  it (the other processes' rows are never on this host) times ``row_bytes`` each (the NumPy
  arrays the data pipeline hands the devices; its temporaries come on top, so this is a lower
  bound) beyond the host's memory and swap, or what it can give now
  (:func:`_check_host_memory`). Checked at start-up: such a batch ended at the first step in a
  MemoryError traceback from the data pipeline, or the kernel's kill (exit status 137).
  ``advice``: what the refusal says to change (None: ``field`` or ``data.seq_len``).

  Raises:
    ValueError: one line naming ``field``, its value, the bytes needed and the host's.
  """
  _check_host_memory(
      f"{field}={global_rows}", rows * row_bytes,
      advice or f"lower {field}={global_rows} or data.seq_len={seq_len}",
      where=f"on this host (this process's {rows} rows of the batch, {row_bytes} bytes each "
            "in NumPy)")


def attention_scores_bytes(config: ml_collections.ConfigDict, rows: int) -> int | None:
  """A lower bound of what a step over ``rows`` windows of ``data.seq_len`` tokens takes on a
  CPU host, known before compiling it: one layer's attention scores, ``rows * num_heads *
  seq_len**2`` numbers of ``model.dtype``'s width, which the XLA kernel (a CPU's only one)
  makes whole. XLA's analysis of the compiled step counts these and far more (13 times this at
  seq_len 24576 on experiments/tiny.py), but it takes a compile of 10-30 s first. None for a
  model that need not make them: a CEM block whose attention energy is not the built-in
  ``'softmax'`` (a user's may make anything) or is evaluated in blocks
  (``model.energy_block_size``)."""
  m = config.model
  dense = (m.block == "llama" or not m.cem_attention
           or (m.attention_energy == "softmax" and not m.energy_block_size))
  if not dense:
    return None
  itemsize = 2 if m.dtype == "bfloat16" else 4
  return rows * m.num_heads * config.data.seq_len**2 * itemsize


def check_attention_scores(config: ml_collections.ConfigDict, field: str, rows: int,
                           per_call: int, advice: str) -> None:
  """Refuses, before anything is compiled, a step whose attention scores alone
  (:func:`attention_scores_bytes` of ``per_call`` rows: this process's ``rows`` of ``field``'s
  batch, or of one microbatch) cannot fit this host (:func:`_check_host_memory`): at seq_len
  24576 the check after the compile came 16-30 s into the start. Nothing where the bound is
  unknown.

  Raises:
    ValueError: one line naming ``data.seq_len``, ``field``, the bytes and the host's.
  """
  need = attention_scores_bytes(config, per_call)
  if need is None:
    return
  m = config.model
  group, key = field.split(".")
  _check_host_memory(
      f"data.seq_len={config.data.seq_len} with {field}={config[group][key]}", need, advice,
      where=f"on this host for one layer's attention scores alone, before compiling ({per_call} "
            f"of this process's {rows} rows at once x {m.num_heads} heads x "
            f"{config.data.seq_len}^2, {m.dtype})")


def _check_host_memory(what: str, need: int, advice: str,
                       where: str = "on this host's CPU devices (XLA memory analysis)") -> None:
  """Refuses ``need`` bytes (a program's footprint on every CPU device of this process it
  runs on, or the host arrays ``where`` names) beyond the host's RAM and swap, or beyond what
  it can give now (:func:`host_available_bytes`: free memory, reclaimable caches and free
  swap). Such a run was killed by the kernel at its first step (exit status 137) without a
  word; beyond the free memory only a warning was logged, and a step between the two (the
  other processes' memory counts) died that way. ``need`` is a lower bound (XLA's analysis
  of a CPU program; the process's own arrays and the runtime's come on top), so nothing that
  fits is refused.

  Raises:
    ValueError: one line naming what needs the memory, how much, the host's and what to
      change.
  """
  total = host_total_bytes()
  if total is not None and need > total:
    needs, has = _sizes(need, total)
    raise ValueError(f"{what} needs {needs} {where}, more than its {has} of memory and swap: "
                     f"{advice}")
  free = host_available_bytes()
  if free is not None and need > free:
    needs, has = _sizes(need, free)
    raise ValueError(f"{what} needs {needs} {where}, more than the {has} it can give now "
                     f"(MemAvailable + SwapFree; the rest is other processes'): {advice}")
