"""Compile a config's training and eval steps for a machine this one is not, and check that
they fit its devices: ``python -m cem_jax.aot --config=CFG --target=v5e:16x16``.

Before a run takes a TPU slice or a GPU node, this compiles the steps ``cem_jax.main`` would
compile there, with the config's mesh over the target's devices and the attention kernel
chosen for the target's platform, and checks each step's memory per device (XLA's memory
analysis, as ``main``'s start-up check does on the device itself) against the device's
memory. Nothing runs and nothing is allocated: the devices are XLA's descriptions of them
(deviceless ahead-of-time compilation, ``jax.experimental.topologies``; MaxText's
``train_compile.py`` does the same for TPUs).

Targets:
  - a TPU slice as libtpu names it, e.g. ``v4:2x2x2``, ``v5e:16x16``, ``v5p:2x2x2``: needs
    libtpu (``pip install "jax[tpu]==<this jax's version>"``), which installs on a machine
    without a TPU;
  - ``h100`` or ``h200``, with ``:N`` GPUs in one node (default 1), e.g. ``h200:8``: needs
    jax's CUDA plugin (``pip install "jax[cuda12]==<this jax's version>"``, ~6.4 GB, in a
    venv of its own: the plugin then looks for a GPU at every start).

Exit status 0 when both steps fit; 1 with a one-line ``error: ...`` for bad input, a target
this jax cannot compile for, or a step that does not fit (naming what to change, as
``main`` would).
"""

from __future__ import annotations

import dataclasses
import os
import re

from absl import app, flags, logging

from cem_jax import cli, errors
from cem_jax import config as config_lib

GiB = 2**30

# HBM per chip of the TPUs libtpu describes (``device_kind``), as Google Cloud lists them.
TPU_MEMORY_BYTES = {"TPU v4": 32 * GiB, "TPU v5 lite": 16 * GiB, "TPU v5": 95 * GiB,
                    "TPU v5p": 95 * GiB, "TPU v6 lite": 32 * GiB}

# The GPUs as XLA's compiler sees them: openxla's gpu_specs/h100_sxm.txtpb, and the H200 (SXM,
# 141 GB HBM3e) as the H100 with its memory size and bandwidth. The figures steer XLA's fusion
# heuristics and the memory check; the cuDNN and CUDA versions are the jax-cuda12 wheels'.
_GPU_SPEC = """
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{name}"
"""
# Memory per GPU in bytes (what the device reports), the one figure the check and the
# description share.
GPU_MEMORY_BYTES = {"h100": 84978434048, "h200": 150110011392}
GPU_TARGET_CONFIGS = {
    "h100": _GPU_SPEC.format(bandwidth=3352320000000, memory=GPU_MEMORY_BYTES["h100"],
                             name="NVIDIA H100 80GB HBM3"),
    "h200": _GPU_SPEC.format(bandwidth=4800000000000, memory=GPU_MEMORY_BYTES["h200"],
                             name="NVIDIA H200"),
}


@dataclasses.dataclass(frozen=True)
class Target:
  """Devices to compile for. ``platform``: ``'tpu'`` or ``'gpu'``; ``memory_bytes``: what one
  device may hold (a GPU's: the share jax preallocates, ``XLA_PYTHON_CLIENT_MEM_FRACTION``,
  0.75 by default); ``kind``: the devices' ``device_kind``."""

  devices: list
  platform: str
  memory_bytes: int
  kind: str


def target_devices(target: str) -> Target:
  """The devices of ``target`` (the module docstring's forms), described, not attached.

  Raises:
    ValueError: one line naming ``--target``: an unknown form, a GPU count < 1, a TPU this
      libtpu does not know or whose memory is not in :data:`TPU_MEMORY_BYTES`, or no libtpu or
      CUDA plugin installed; or naming ``XLA_PYTHON_CLIENT_MEM_FRACTION``, not in (0, 1].
  """
  name, _, count = target.partition(":")
  if name.lower() in GPU_TARGET_CONFIGS:  # H100 as the GPU names itself, not a TPU to look up
    name = name.lower()
    if count and not (count.isdigit() and int(count) >= 1):
      raise ValueError(f"--target={target}: the GPU count {count!r}; allowed: an int >= 1")
    given = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    try:
      fraction = float(given)
    except ValueError:
      fraction = -1.0
    if not 0 < fraction <= 1:
      raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={given!r}; allowed: a number in "
                       "(0, 1], the share of a GPU's memory jax takes (default 0.75)")
    # The plugin checks the driver's CUDA version when it loads; a CPU machine has no driver.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    devices = _topology(target, "cuda", topology=f"1x1x{int(count or 1)}",
                        target_config=GPU_TARGET_CONFIGS[name])
    return Target(devices, "gpu", int(fraction * GPU_MEMORY_BYTES[name]),
                  devices[0].device_kind)
  # Every TPU generation is named v<digit>...; another name (b200:8) is not worth installing
  # libtpu to be told so.
  if not count or not re.fullmatch(r"v\d+[a-z]*", name, re.IGNORECASE):
    raise ValueError(f"--target={target}; allowed: a TPU slice as libtpu names it "
                     f"(e.g. v5e:16x16), or {', '.join(GPU_TARGET_CONFIGS)}[:N]")
  # jax runs a v4 or v5p chip's two TensorCores as one device (megacore); libtpu describes
  # them as two unless asked (v4:2x2x2: 16 devices of 32 GiB each, for 8 chips of 32 GiB).
  megacore = {"chip_config_name": "megacore"} if name in ("v4", "v5p") else {}
  devices = _topology(target, "tpu", topology_name=target, **megacore)
  kind = devices[0].device_kind
  if kind not in TPU_MEMORY_BYTES:
    raise ValueError(f"--target={target}: no memory size known for {kind!r}; known: "
                     f"{', '.join(TPU_MEMORY_BYTES)} (cem_jax.aot.TPU_MEMORY_BYTES)")
  return Target(devices, "tpu", TPU_MEMORY_BYTES[kind], kind)


def _topology(target: str, platform: str, **kwargs) -> list:
  import jax
  from jax.experimental import topologies

  wheel = {"tpu": "jax[tpu]", "cuda": "jax[cuda12]"}[platform]
  try:
    return list(topologies.get_topology_desc(platform=platform, **kwargs).devices)
  except jax.errors.JaxRuntimeError as e:  # the plugin is there and refuses the target
    raise ValueError(f"--target={target}: {platform} cannot describe it "
                     f"({errors.one_line(e)})") from None
  except (NotImplementedError, RuntimeError):  # no plugin for the platform
    raise ValueError(f"--target={target} needs {wheel}=={jax.__version__} installed (a "
                     "machine without the device can install it); this jax has no "
                     f"{platform} plugin") from None


def compile_for(config, target: Target, vocab_size: int | None = None) -> dict:
  """Compiles ``config``'s training and eval steps for ``target`` and checks their memory.

  Args:
    config: a resolved config (``cem_jax.config``).
    target: :func:`target_devices`'s.
    vocab_size: the tokenizer's vocabulary size; default ``data.vocab_size``.
  Returns:
    ``{'devices', 'kind', 'mesh', 'attention', 'train_bytes', 'eval_bytes', 'limit_bytes'}``:
    bytes per device (XLA's memory analysis; the eval step's with the optimizer state held
    beside it), the device's limit, the mesh's shape and the attention kernel chosen.
  Raises:
    ValueError: one line: an invalid config, a mesh that does not fit the devices, or a step
      that does not fit a device (naming what to change).
  """
  import jax
  import numpy as np

  from cem_jax import memory, optim, preflight, sharding, steps, train

  preflight.check(config)
  preflight.check_machine(config, platform=target.platform)
  data_parallel = train.data_parallel_devices(config, len(target.devices))
  vocab = config_lib.vocab_size(config, vocab_size)
  mesh = sharding.make_mesh(config.mesh, target.devices)
  tx, schedule = optim.make_optimizer(config.train)
  graphdef, params, opt_state, shardings, model = steps.abstract_state(
      config, vocab, tx, mesh, platform=target.platform)
  kernel, _ = model.kernel_at(config.data.seq_len)
  train_step, eval_step = train.make_steps(config, graphdef, tx, shardings, schedule)
  guard = jax.ShapeDtypeStruct((), np.int32, sharding=shardings.replicated)
  compiled = train.compile_steps(config, train_step, eval_step, params, opt_state, guard,
                                 shardings.batch, data_parallel,
                                 limit_bytes=target.memory_bytes)
  need = [memory.footprint_bytes(c) for c in compiled]
  return {"devices": len(target.devices), "kind": target.kind, "mesh": dict(mesh.shape),
          "attention": kernel, "train_bytes": need[0],
          "eval_bytes": need[1] + memory.resident_bytes(opt_state),
          "limit_bytes": target.memory_bytes}


def main(argv):
  cli.no_extra_args(argv)
  fl = flags.FLAGS
  logging.set_verbosity(logging.WARNING)
  cli.quiet_libraries()
  with cli.user_errors():
    if fl.vocab_size is not None:  # before jax describes the target
      config_lib.check_flag("--vocab_size", "data.vocab_size", fl.vocab_size)
    config = cli.load_config()
    target = target_devices(fl.target)
    r = compile_for(config, target, fl.vocab_size)
  print(f"{fl.target}: {r['devices']} × {r['kind']}, mesh {r['mesh']}, attention "
        f"{r['attention']}")
  for what in ("train", "eval"):
    print(f"the {what} step: {r[what + '_bytes'] / GiB:.2f} GiB per device of "
          f"{r['limit_bytes'] / GiB:.2f} GiB: fits")


if __name__ == "__main__":
  # Flags are defined only when run as a program, so other tools can import the functions.
  cli.define_config_flag()
  flags.DEFINE_string("target", None, "The devices to compile for: a TPU slice (e.g. "
                      "v5e:16x16) or h100/h200[:N] (module docstring).")
  flags.DEFINE_integer("vocab_size", None, "The tokenizer's size (default: data.vocab_size).")
  cli.require("config", "target")
  app.run(main, flags_parser=cli.parse_flags)
