"""What a sharded step sends between devices: the collectives of the programs XLA compiled.

Reads the optimised HLO that XLA writes with ``--xla_dump_to`` and prints, for each training
(``jit_step``) and eval (``jit_eval_step``) program, each kind of collective (all-gather,
all-reduce, reduce-scatter, all-to-all, collective-permute): how many instructions and the
MiB of their results summed (a tuple's elements summed; an asynchronous one counted once).
Each instruction counts once: one inside a loop (gradient accumulation, the loss over
blocks) runs once per trip, so compare programs of the same loops. A size, not a time.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*" \\
        python -m cem_jax.aot --config=experiments/paper/attention.py:llama_mha,paper \\
        --target=h200:8 --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2
    python experiments/collectives.py /tmp/dump

(``cem_jax.aot`` needs jax's CUDA plugin for ``h200``, or libtpu for a TPU slice: see its
docstring. A CPU run of ``cem_jax.main`` with ``--xla_force_host_platform_device_count=8``
dumps its programs the same way.) Measured 2026-12-05 (jax 0.10.2, its CUDA plugin and libtpu
0.0.42.1): "Sharded steps: what the devices send each other" in docs/PERFORMANCE.md.
"""

import glob
import os
import re
import sys

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
# An instruction's definition starts `%name = ` (after `ROOT ` at a computation's root); other
# lines (a "from instruction" note, metadata quoting one) do not.
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = ")
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_OPEN, _CLOSE = "([{", ")]}"


def _split_top_level(text: str) -> list[str]:
  """``text`` cut at the commas outside every bracket: a tuple shape's elements, once its
  outer parentheses are removed."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    depth += (ch in _OPEN) - (ch in _CLOSE)
    if ch == "," and depth == 0:
      parts.append(text[start:i].strip())
      start = i + 1
  return parts + [text[start:].strip()]


def _closing(text: str) -> int:
  """Where the bracket that opens ``text`` closes (its last index if it never does)."""
  depth = 0
  for i, ch in enumerate(text):
    depth += (ch in _OPEN) - (ch in _CLOSE)
    if depth == 0:
      return i
  return len(text) - 1


def _result_and_opcode(line: str) -> tuple[str, str] | None:
  """``(result shape text, opcode)`` of an instruction's definition; None for other lines."""
  m = _DEFINITION.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):  # a tuple: up to its closing parenthesis
    end = _closing(rest)
    result, after = rest[:end + 1], rest[end + 1:]
  else:
    result, _, after = rest.partition(" ")
  opcode = re.match(r"\s*([\w\-]+)\(", after)
  return (result, opcode.group(1)) if opcode else None


def _bytes(shape_text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(shape_text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES[dtype]
  return total


def results(hlo_text: str) -> list[tuple[str, str]]:
  """``(kind, result shape text)`` of each collective instruction of one program's optimised
  HLO text, in order.

  An asynchronous all-gather or collective-permute (``-start``) returns ``(operands,
  results)``: its results are the second element. An all-reduce's start returns its result;
  reduce-scatter and all-to-all run asynchronously as calls of a computation whose root is
  the synchronous instruction, counted there. ``-done`` instructions are not counted again.
  """
  out = []
  for line in hlo_text.splitlines():
    parsed = _result_and_opcode(line)
    if parsed is None:
      continue
    result, opcode = parsed
    kind = opcode.removesuffix("-start")
    if kind not in KINDS:
      continue
    if opcode.endswith("-start") and kind in ("all-gather", "collective-permute"):
      result = _split_top_level(result[1:-1])[-1]
    out.append((kind, result))
  return out


def collectives(hlo_text: str) -> dict:
  """``{kind: (instructions, bytes of their results)}`` of one program's optimised HLO text
  (:func:`results`)."""
  out = {}
  for kind, result in results(hlo_text):
    count, total = out.get(kind, (0, 0))
    out[kind] = (count + 1, total + _bytes(result))
  return out


def main(dump_dir: str) -> None:
  paths = sorted(p for p in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
                 if re.search(r"\.jit_(eval_)?step\.", os.path.basename(p)))
  if not paths:
    sys.exit(f"error: no jit_step or jit_eval_step program after optimisations in {dump_dir} "
             "(run with --xla_dump_to, --xla_dump_hlo_as_text, as the docstring says)")
  print("| program | " + " | ".join(KINDS) + " | MiB in all |")
  print("|---|" + "---:|" * (len(KINDS) + 1))
  for path in paths:
    with open(path) as f:
      found = collectives(f.read())
    cells = [f"{found[k][0]} × {found[k][1] / 2**20:.1f}" if k in found else "" for k in KINDS]
    total = sum(b for _, b in found.values()) / 2**20
    program = "eval" if ".jit_eval_step." in path else "train"
    print(f"| {program} ({os.path.basename(path).split('.')[0]}) | " + " | ".join(cells)
          + f" | {total:.1f} |")


if __name__ == "__main__":
  from cem_jax import cli

  usage = "python experiments/collectives.py XLA_DUMP_DIR"
  args = cli.script_args(sys.argv, __doc__, usage)
  if len(args) != 1:
    sys.exit(f"usage: {usage}")
  main(args[0])
