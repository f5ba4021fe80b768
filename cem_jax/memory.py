"""Device memory of a compiled step, and the start-up check that the training step fits.

A training config too large for the accelerator (``data.seq_len``, ``train.batch_size``,
``model.d_model``...) used to end in XLA's out-of-memory traceback at the first step, or at
compile time on TPU. :func:`compile_within_memory` compiles the step ahead of time, logs its
footprint per device and, where the backend reports the device's limit (GPU, TPU; not CPU),
refuses a step that needs more with one line naming the config values to change. The
compiled program is the one the first call uses (jax shares the compilation between
``lower(...).compile()`` and the call), so the check costs no second compile.
"""

from __future__ import annotations

import jax
import ml_collections
from absl import logging

GIB = 2**30

# The absl status code XLA gives every out-of-memory error (compile time on TPU, run time on
# GPU): a code, not the message's wording.
_OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"


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


def _size(nbytes: int) -> str:
  return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _what_to_change(config: ml_collections.ConfigDict) -> str:
  t, d, m = config.train, config.data, config.model
  remat = "" if m.remat == "full" else f"set model.remat='full' (now {m.remat!r}), "
  return (f"raise train.gradient_accumulation_steps={t.gradient_accumulation_steps} (the same "
          f"batch in smaller pieces), {remat}shard over more devices "
          f"(mesh.fsdp={config.mesh.fsdp}), or lower data.seq_len={d.seq_len} or "
          f"train.batch_size={t.batch_size}")


def compile_within_memory(jitted, args: tuple, config: ml_collections.ConfigDict, *,
                          what: str = "the training step", limit_bytes: int | None = None):
  """Compiles ``jitted(*args)`` ahead of time and checks that it fits one device.

  Args:
    jitted: a ``jax.jit`` function (e.g. :func:`cem_jax.steps.make_train_step`'s).
    args: its arguments, arrays or ``jax.ShapeDtypeStruct`` s with the shardings of the calls
      to come (so the calls reuse this compilation).
    config: the run's config, for the fields the error names.
    what: the program's name in the log line and the error.
    limit_bytes: the device's limit in bytes; None (default) reads :func:`device_limit_bytes`
      (none on CPU: nothing is checked, the footprint is only logged).
  Returns:
    The compiled program (``jax.stages.Compiled``).
  Raises:
    ValueError: one line, when XLA's memory analysis of the program exceeds the limit, or
      when XLA itself runs out of memory compiling it, naming the footprint, the limit and the
      config values to change.
  """
  limit = device_limit_bytes() if limit_bytes is None else limit_bytes
  try:
    compiled = jitted.lower(*args).compile()
  except jax.errors.JaxRuntimeError as e:
    if not str(e).startswith(_OUT_OF_MEMORY):
      raise
    first = str(e).splitlines()[0][:200]
    raise ValueError(f"{what} does not fit in device memory (XLA: {first}): "
                     f"{_what_to_change(config)}") from e
  need = footprint_bytes(compiled)
  if need is not None:
    of = f" of {_size(limit)}" if limit else ""
    logging.info("%s: %s per device%s (XLA memory analysis: arguments, outputs and "
                 "temporaries)", what, _size(need), of)
  if need is not None and limit and need > limit:
    raise ValueError(f"{what} needs {_size(need)} per device (XLA memory analysis), the "
                     f"device allows {_size(limit)}: {_what_to_change(config)}")
  return compiled
