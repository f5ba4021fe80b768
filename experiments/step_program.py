"""What XLA makes of one bench training step, without running it: reductions, FLOPs, bytes,
and, compiled for an H200 on a machine without one, the GPU kernels.

Lowers ``cem_jax.bench``'s training step of a variant at the gpu125m shapes (12 layers,
d_model 768, 12 heads, mlp 2048, vocab 32768, bf16) and prints, from the program alone:

- ``reductions over activations``: ``stablehlo.reduce`` ops of the program as jax writes it
  (before XLA's passes) whose operand has a ``seq_len``-sized dimension; each reads a
  ``[batch, seq_len, ...]`` tensor once more on any backend unless XLA fuses it away;
- target ``cpu`` (default): ``flops`` and ``bytes accessed``, XLA's cost analysis of the
  program compiled for this machine (the CPU's fusion decisions: a proxy for a GPU's);
- target ``h200``: the program XLA compiles for an H200 (deviceless ahead-of-time
  compilation, ``jax.experimental.topologies``), the attention kernel chosen as on the GPU
  (cuDNN), XLA's memory for the step (what ``bench`` reports as ``peak_memory_mb``), and a
  table of its kernels (:func:`gpu_kernels`): matmuls, attention, the other kernels of the
  forward and backward passes, the update, and the largest kernels; then one middle layer's
  kernels each way (:func:`one_layer`) and the count of kernels under 1 MB by kind (each
  costs a launch whatever its size).

    python experiments/step_program.py [VARIANT] [SEQ_LEN] [TOKENS_PER_BATCH] [TARGET]
    python experiments/step_program.py cem_fused 1024 2048          # ~15 s on 2 CPU cores
    python experiments/step_program.py llama 1024 16384 h200        # ~15 s; needs the plugin

The ``h200`` target needs jax's CUDA plugin, which a CPU machine can install but not use
otherwise (~6.4 GB, ~2.5 minutes; keep it out of the project's venv). From the repository's
root, with a venv path of your own::

    v=$(python -c 'import jax; print(jax.__version__)')     # in the project's venv: 0.10.2
    python3 -m venv ../cem_gpu_venv && . ../cem_gpu_venv/bin/activate
    pip install -e . "jax[cuda12]==$v" && python experiments/step_program.py llama 1024 16384 h200

The last row of each variant in the tables below is the code as it stands.

No GPU runs anything: XLA cannot autotune, so its matmul choices are its defaults, and its
version is this machine's jax, not the GPU image's. The kernels' bytes are those of their
results and operands (an operand read only through gathers and slices: what those produce;
a scatter into an operand in place: its updates), an upper bound on their traffic.
Neither is a time; they show where a step's memory traffic goes and how a change moves it,
for the next measurement on the device to confirm.

Measured on 2 CPU cores (jax 0.10.2, 2026-12-04), at seq_len 1024 with 2,048 tokens:

| program | reductions over activations | GB accessed |
|---|---:|---:|
| cem_fused, η scaling the activations (main at 366cd9f) | 274 | 56.91 |
| cem_fused, η scaling the output weights (42bc1f4) | 250 | 56.34 |
| cem_fused, each norm of each point once (fa0fa08) | 154 | 55.43 |
| llama (fa0fa08) | 154 | 60.06 |
| cem_fused, the loss's gradient in one pass (d3b81ad) | 154 | 54.36 |
| llama (d3b81ad) | 154 | 58.99 |

Compiled for an H200 (jax 0.10.2 with jax-cuda12-plugin 0.10.2, 2026-12-04), seq_len 1024,
16,384 tokens; GB of operands and results, TFLOP of the matmuls (docs/PERFORMANCE.md):

| program | kernels | GB | matmul TFLOP | XLA memory |
|---|---:|---:|---:|---:|
| llama, target's logit gathered by autodiff (de3aef2) | 995 | 62.29 | 10.823 | 9.98 GiB |
| llama, masked sum (0102ad8) | 995 | 60.16 | 10.823 | |
| llama, gathered with an elementwise gradient (d3b81ad) | 993 | 57.99 | 10.823 | 8.98 GiB |
| cem_fused, de3aef2 | 980 | 60.53 | 10.128 | 9.59 GiB |
| cem_fused, d3b81ad | 978 | 56.23 | 10.128 | 8.59 GiB |

At seq_len 4096 every figure is the same (flash attention keeps no seq_len² scores; the H200
measured llama's 10.0 GiB at both on 2026-12-04, with the code of de3aef2's loss).
"""

from __future__ import annotations

import collections
import math
import re
import sys

TARGETS = ("cpu", "h200")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z\-]*)\((.*?)\)(, .*)?$")
# Instructions that launch no kernel of their own.
_NO_KERNEL = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "iota",
              "after-all", "partition-id", "replica-id"}


def array_bytes(type_text: str) -> int:
  """Bytes of every array in an HLO type (``bf16[16,64]{1,0}``, or a tuple of them)."""
  return sum(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
             for dtype, dims in _ARRAY.findall(type_text))


def _computations(hlo_text: str) -> dict[str, list[str]]:
  """``{name: instruction lines}`` of an HLO module's text; the entry is ``'ENTRY'``."""
  out, lines = {}, None
  for line in hlo_text.splitlines():
    header = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
    if header:
      lines = out["ENTRY" if header.group(1) else header.group(2)] = []
    elif line.startswith("}"):
      lines = None
    elif lines is not None and line.startswith("  "):
      lines.append(line.strip())
  return out


def _instructions(lines: list[str]) -> dict[str, tuple[str, str, str, str]]:
  """``{name: (type, opcode, operands, attributes)}``."""
  out = {}
  for line in lines:
    m = _INSTRUCTION.match(line)
    if m:
      out[m.group(1)] = (m.group(2), m.group(3), m.group(4), m.group(5) or "")
  return out


def _dot_flops(table: dict, type_text: str, operands: str, attributes: str) -> int:
  """2 x output size x contracted size of a ``dot``, or of a cuBLAS gemm call (its dimension
  numbers in the backend config; its result a tuple whose first array is the product)."""
  lhs = table[re.findall(r"%([\w.\-]+)", operands)[0]][0]
  lhs_dims = [int(d) for d in _ARRAY.search(lhs).group(2).split(",") if d]
  contracting = re.search(r'lhs_contracting_dim(?:s=\{([0-9,]*)\}|ensions":\[([0-9",]*)\])',
                          attributes)
  dims = (contracting.group(1) or contracting.group(2) or "").replace('"', "")
  k = math.prod(lhs_dims[int(i)] for i in dims.split(",") if i)
  out = [int(d) for d in _ARRAY.search(type_text).group(2).split(",") if d]
  return 2 * math.prod(out) * k


def _matmul_flops(lines: list[str]) -> int:
  """2 x output size x contracted size, summed over a computation's ``dot`` instructions."""
  table = _instructions(lines)
  return sum(_dot_flops(table, type_text, operands, attributes)
             for type_text, opcode, operands, attributes in table.values() if opcode == "dot")


def _bytes_read(lines: list[str]) -> dict[int, int]:
  """``{parameter number: bytes}`` for a fused computation's parameters that it reads only
  in part, through gathers and slices (and bitcasts): the bytes those produce."""
  table = _instructions(lines)
  users = collections.defaultdict(list)
  for name, (_, _, operands, _) in table.items():
    for operand in re.findall(r"%([\w.\-]+)", operands):
      users[operand].append(name)

  def partial_read(name):  # bytes read through gathers and slices, or None: all of it
    total = 0
    for user in users[name]:
      opcode = table[user][1]
      first = re.findall(r"%([\w.\-]+)", table[user][2])[0]
      if opcode == "bitcast":
        part = partial_read(user)
      elif opcode in ("gather", "slice", "dynamic-slice") and first == name:  # not the indices
        part = array_bytes(table[user][0])
      else:
        return None
      if part is None:
        return None
      total += part
    return total

  out = {}
  for name, (_, opcode, operands, _) in table.items():
    if opcode == "parameter" and users[name]:
      part = partial_read(name)
      if part is not None:
        out[int(operands)] = part
  return out


def _in_place_scatter(lines: list[str]) -> tuple[int, int] | None:
  """``(parameter number, bytes of the updates)`` when a fused computation's result is a
  scatter into one of its parameters, which XLA updates in place; None otherwise."""
  table = _instructions(lines)
  root = next((line for line in lines if line.startswith("ROOT ")), None)
  m = _INSTRUCTION.match(root) if root else None
  if not m or m.group(3) != "scatter":
    return None
  operand, _, updates = re.findall(r"%([\w.\-]+)", m.group(4))[:3]
  if table[operand][1] != "parameter":
    return None
  return int(table[operand][2]), array_bytes(table[updates][0])


def gpu_kernels(hlo_text: str) -> list[dict]:
  """The kernels the entry computation of a compiled GPU HLO module launches, in order.

  Args:
    hlo_text: ``compiled.as_text()`` of a program compiled for a GPU.
  Returns:
    One dict per instruction of the entry computation that runs a kernel (a fusion, a custom
    call, or an unfused op; control flow counts once, its body not expanded): ``name``;
    ``kind``: ``'matmul'`` (a gemm fusion, or a cuBLAS call), ``'attention'`` (a cuDNN
    attention call), ``'forward'``, ``'backward'`` (ops that jax traced in ``transpose(jvp``,
    the gradient), ``'update'`` (the rest: the optimizer) or ``'control flow'``; ``bytes``:
    of its operands and results, whole (an upper bound on its memory traffic); ``flops``: of
    the matmuls in it (2 per multiply-add); ``op``: jax's name of the op it came from.
  Raises:
    ValueError: the text has no entry computation.
  """
  computations = _computations(hlo_text)
  if "ENTRY" not in computations:
    raise ValueError("no ENTRY computation in the HLO text")
  entry = _instructions(computations["ENTRY"])
  out = []
  for name, (type_text, opcode, operands, attributes) in entry.items():
    if opcode in _NO_KERNEL:
      continue
    op = re.search(r'op_name="([^"]*)"', attributes)
    op = op.group(1) if op else ""
    called = re.search(r"calls=%([\w.\-]+)", attributes)
    target = re.search(r'custom_call_target="([^"]+)"', attributes)
    flops = _matmul_flops(computations.get(called.group(1), [])) if called else 0
    if opcode == "dot" or (target and re.search(r"cublas.*(gemm|matmul)", target.group(1))):
      flops = _dot_flops(entry, type_text, operands, attributes)
    if opcode in ("while", "conditional", "call"):
      kind = "control flow"
    elif (target and "cudnn$fmha" in target.group(1)):
      kind = "attention"
    elif flops or opcode == "dot" or (target and "cublas" in target.group(1)):
      kind = "matmul"
    elif "transpose(jvp" in op:
      kind = "backward"
    elif "jvp(" in op:
      kind = "forward"
    else:
      kind = "update"
    names = [n for n in re.findall(r"%([\w.\-]+)", operands) if n in entry]
    body = computations.get(called.group(1), []) if called else []
    read, written = _bytes_read(body), array_bytes(type_text)
    scatter = _in_place_scatter(body)
    if scatter is not None:  # the result is the operand, updated where the indices say
      read[scatter[0]], written = scatter[1], scatter[1]
    size = written + sum(read.get(i, array_bytes(entry[n][0])) for i, n in enumerate(names))
    out.append({"name": name, "kind": kind, "bytes": size, "flops": flops, "op": op})
  return out


def print_gpu_kernels(kernels: list[dict], largest: int = 8) -> None:
  """Prints the kernels by kind, then the ``largest`` by bytes."""
  by_kind = collections.defaultdict(lambda: [0, 0, 0])
  for k in kernels:
    row = by_kind[k["kind"]]
    row[0], row[1], row[2] = row[0] + 1, row[1] + k["bytes"], row[2] + k["flops"]
  print("| kind | kernels | GB | TFLOP |\n|---|---:|---:|---:|")
  for kind, (n, size, flops) in sorted(by_kind.items()):
    print(f"| {kind} | {n} | {size / 1e9:.2f} | {flops / 1e12:.3f} |")
  print(f"| all | {len(kernels)} | {sum(k['bytes'] for k in kernels) / 1e9:.2f} | "
        f"{sum(k['flops'] for k in kernels) / 1e12:.3f} |")
  print(f"\nlargest {largest} kernels by bytes:")
  for k in sorted(kernels, key=lambda k: -k["bytes"])[:largest]:
    print(f"  {k['bytes'] / 1e9:6.2f} GB  {k['kind']:9s} {k['name']}  ({k['op']})")


def one_layer(kernels: list[dict], layer: int) -> dict[str, list[dict]]:
  """One layer's worth of kernels of each pass, as :func:`gpu_kernels` lists them.

  Forward: from layer ``layer``'s attention call up to layer ``layer + 1``'s (its output
  projection and MLP, the next layer's norm and projections). Backward: the gradient of the
  same ops, between the two layers' attention backward calls (the backward pass runs the
  layers in reverse: of the program's ``2 L`` attention calls, the ``L + j``-th is layer
  ``L - 1 - j``'s backward). Kernels the scheduler runs inside a range count there, e.g. the
  optimizer's reductions of a gradient as soon as it exists.

  Args:
    kernels: ``gpu_kernels`` of a step of ``L`` layers, one attention call each way.
    layer: 0 .. L - 2 (the last layer has no next attention call to end it).
  Returns:
    ``{"forward": [...], "backward": [...]}``.
  Raises:
    ValueError: the attention calls are not two per layer, or ``layer`` is out of range.
  """
  calls = [i for i, k in enumerate(kernels) if k["kind"] == "attention"]
  if not calls or len(calls) % 2:
    raise ValueError(f"{len(calls)} attention calls; expected two per layer")
  num_layers = len(calls) // 2
  if not 0 <= layer < num_layers - 1:
    raise ValueError(f"layer={layer}; allowed: 0..{num_layers - 2}")
  back = num_layers + (num_layers - 1 - layer)
  return {"forward": kernels[calls[layer]:calls[layer + 1]],
          "backward": kernels[calls[back - 1]:calls[back]]}


def _h200_sharding():
  import jax

  from cem_jax import aot

  try:
    devices = aot.target_devices("h200").devices
  except ValueError as e:
    raise SystemExit(str(e)) from None
  return jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("d",)),
                                    jax.sharding.PartitionSpec())


USAGE = "python experiments/step_program.py [VARIANT] [SEQ_LEN] [TOKENS_PER_BATCH] [TARGET]"


def check_shape(seq_len: int, tokens_per_batch: int) -> None:
  """Raises SystemExit (one line) unless ``tokens_per_batch`` is a whole number (>= 1) of
  ``seq_len``-token windows: bench's batch is ``tokens_per_batch // seq_len`` windows, so any
  other count would lower a step of fewer tokens than the line printed names."""
  if seq_len < 1 or tokens_per_batch < seq_len or tokens_per_batch % seq_len:
    raise SystemExit(f"SEQ_LEN={seq_len} TOKENS_PER_BATCH={tokens_per_batch}; allowed: "
                     "SEQ_LEN >= 1 and TOKENS_PER_BATCH a multiple of it (whole windows)")


def parse_args(args: list[str]) -> tuple:
  """``(variant, seq_len, tokens_per_batch, target)`` from the command line's arguments, the
  defaults of :func:`main` for those left out.

  Raises:
    SystemExit: more than 4 arguments, or SEQ_LEN / TOKENS_PER_BATCH not an integer (one line
      naming it and what is allowed).
  """
  if len(args) > 4:
    raise SystemExit(f"{len(args)} arguments ({' '.join(args)}); usage: {USAGE}")
  out = list(args[:1])
  for name, value in zip(("SEQ_LEN", "TOKENS_PER_BATCH"), args[1:3], strict=False):
    try:
      out.append(int(value))
    except ValueError:
      raise SystemExit(f"{name}={value!r}; allowed: an integer >= 1 (usage: {USAGE})") from None
  return tuple(out + args[3:4])


def main(variant: str = "cem_fused", seq_len: int = 1024, tokens_per_batch: int = 2048,
         target: str = "cpu"):
  if target not in TARGETS:
    raise SystemExit(f"target={target!r}; allowed: {', '.join(TARGETS)}")
  import jax

  from cem_jax import bench, memory

  if variant not in bench.VARIANTS:
    raise SystemExit(f"variant={variant!r}; allowed: {', '.join(bench.VARIANTS)}")
  check_shape(seq_len, tokens_per_batch)
  preset = dict(bench.PRESETS["gpu125m"], tokens_per_batch=tokens_per_batch)
  cfg = bench.model_config(preset, bench.VARIANTS[variant], seq_len, preset["d_model"])
  sharding = _h200_sharding() if target == "h200" else None
  _, step, params, opt_state, batch = bench.train_step_inputs(
      cfg, preset["vocab_size"], abstract=True, platform="gpu" if sharding else None)
  args = (params, opt_state, batch)
  if sharding is not None:
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        args)
  lowered = step.lower(*args)
  reductions = 0
  for line in lowered.as_text().splitlines():
    shape = re.search(r"stablehlo\.reduce.*?tensor<([0-9x]+)x[a-z0-9]+>", line)
    if shape and str(seq_len) in shape.group(1).split("x"):
      reductions += 1
  compiled = lowered.compile()
  print(f"{variant} at seq_len {seq_len}, {tokens_per_batch} tokens, for {target}: "
        f"{reductions} reductions over activations")
  if sharding is not None:
    # The figure bench reports as peak_memory_mb, here without the device.
    print(f"XLA memory: {memory.footprint_bytes(compiled) / 2**30:.2f} GiB")
    kernels = gpu_kernels(compiled.as_text())
    print_gpu_kernels(kernels)
    layer = cfg.model.num_layers // 2
    for part, ks in one_layer(kernels, layer).items():
      print(f"layer {layer}'s {part} pass: {len(ks)} kernels, "
            f"{sum(k['bytes'] for k in ks) / 1e9:.2f} GB")
    small = collections.Counter(k["kind"] for k in kernels if k["bytes"] < 1e6)
    print(f"kernels under 1 MB: {sum(small.values())} ("
          + ", ".join(f"{kind} {n}" for kind, n in sorted(small.items())) + ")")
    return
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  print(f"{cost['flops'] / 1e9:.1f} GFLOP, {cost['bytes accessed'] / 1e9:.2f} GB accessed")


if __name__ == "__main__":
  from cem_jax import cli

  main(*parse_args(cli.script_args(sys.argv, __doc__, USAGE)))
