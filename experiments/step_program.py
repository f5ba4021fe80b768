"""What XLA makes of one bench training step, without running it: reductions, FLOPs, bytes.

Lowers ``cem_jax.bench``'s training step of a variant at the gpu125m shapes (12 layers,
d_model 768, 12 heads, mlp 2048, vocab 32768, bf16) and prints, from the program alone:

- ``reductions over activations``: ``stablehlo.reduce`` ops of the program as jax writes it
  (before XLA's passes) whose operand has a ``seq_len``-sized dimension; each reads a
  ``[batch, seq_len, ...]`` tensor once more on any backend unless XLA fuses it away;
- ``flops`` and ``bytes accessed``: XLA's cost analysis of the program compiled for this
  machine (on a CPU, the CPU's fusion decisions: a proxy for a GPU's, not its figure).

    python experiments/step_program.py [VARIANT] [SEQ_LEN] [TOKENS_PER_BATCH]
    python experiments/step_program.py cem_fused 1024 2048      # ~30 s on 2 CPU cores

Measured on 2 CPU cores (jax 0.10.2, 2026-12-04), at seq_len 1024 with 2,048 tokens:

| program | reductions over activations | GB accessed |
|---|---:|---:|
| cem_fused, η scaling the activations (main at 366cd9f) | 274 | 56.91 |
| cem_fused, η scaling the output weights (42bc1f4) | 250 | 56.34 |
| cem_fused, each norm of each point once (fa0fa08) | 154 | 55.43 |
| llama | 154 | 60.06 |
"""

from __future__ import annotations

import re
import sys

from cem_jax import bench


def main(variant: str = "cem_fused", seq_len: int = 1024, tokens_per_batch: int = 2048):
  if variant not in bench.VARIANTS:
    raise SystemExit(f"variant={variant!r}; allowed: {', '.join(bench.VARIANTS)}")
  preset = dict(bench.PRESETS["gpu125m"], tokens_per_batch=tokens_per_batch)
  if tokens_per_batch < seq_len:
    raise SystemExit(f"tokens_per_batch={tokens_per_batch} < seq_len={seq_len}: no row fits")
  cfg = bench._model_config(preset, bench.VARIANTS[variant], seq_len, preset["d_model"])
  _, step, params, opt_state, batch = bench.train_step_inputs(cfg, preset["vocab_size"],
                                                              abstract=True)
  lowered = step.lower(params, opt_state, batch)
  reductions = 0
  for line in lowered.as_text().splitlines():
    shape = re.search(r"stablehlo\.reduce.*?tensor<([0-9x]+)x[a-z0-9]+>", line)
    if shape and str(seq_len) in shape.group(1).split("x"):
      reductions += 1
  cost = lowered.compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  print(f"{variant} at seq_len {seq_len}, {tokens_per_batch} tokens: {reductions} reductions "
        f"over activations, {cost['flops'] / 1e9:.1f} GFLOP, "
        f"{cost['bytes accessed'] / 1e9:.2f} GB accessed")


if __name__ == "__main__":
  args = sys.argv[1:]
  main(*(args[:1] + [int(a) for a in args[1:3]]))
