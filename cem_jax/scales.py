"""Scales and data shared by the paper-table configs in ``experiments/paper/``.

Each table file there defines ``ROWS`` (row name → a function editing the config) and
``get_config(arg)`` with ``arg = "ROW"`` or ``"ROW,SCALE"`` (scale ``tiny`` by default).

Scales:
  tiny:  d_model 128, 4 layers, 4 heads, mlp_dim 512, seq_len 128, batch 16, 400 steps on
         War and Peace (../shared/data/warpeace.txt, every 10th chunk held out): ~3 min a row on
         2 CPU cores.
  gpu:   d_model 512, 8 layers, 8 heads, mlp_dim 1376, seq_len 512, vocab 8192, batch 256
         (131,072 tokens a step), 768 steps = 100.7M tokens a row, bf16, 1 seed: 19.7M
         parameters in a CEM row (15.5M non-embedding), 29.5M in Llama (25.3M). Sized for
         one table in one H200 run with the fast attention path: at 30% MFU of 989 TFLOP/s
         (training = 3x model_stats.flops_per_token) a T = 1 CEM row trains in ~64 s, T = 2 in
         ~118 s; design's five headline rows ~430 s, end_to_end's four ~435 s (cem_full's
         diagonal attention, on XLA, ~250 s of it), plus compilation and evaluation: about
         8-9 minutes a table. An estimate: not measured yet. Needs a corpus of >= 100M
         tokens (``tables --set=data.prepared_dir=DIR``); War and Peace would be ~120 passes.
         Command: ``experiments/gpu_tables.sh``.
  small: d_model 512, 8 layers, 8 heads, mlp_dim 1376, seq_len 512, batch 64, 6,000 steps
         (~200M tokens): ~25M non-embedding Llama parameters, under an hour a row on one GPU.
  paper: d_model 768, 12 layers, 12 heads, mlp_dim 2048, seq_len 1024, global batch 256,
         20,000 steps (5.2B tokens; a Chinchilla-style ~40 tokens/parameter budget for
         ~125M), for a TPU pod slice or a multi-GPU node; on one GPU with
         ``--set=train.gradient_accumulation_steps=2`` (compiled for an H200 by
         ``cem_jax.aot``: 62.3 GiB per step, 105.4 GiB without; XLA's CPU analysis, an upper
         estimate, gives 694-710 GiB without; docs/REPRODUCING.md).
gpu, small and paper read ``data.prepared_dir``, ``data.files`` or ``data.tfds_name`` given on
the command line (``python -m cem_jax.tables --set=data.prepared_dir=DIR``, e.g. a prepared
dump of a web-text corpus); they default to War and Peace only so that every row builds.
"""

import os

from cem_jax.config import get_default_config

# ../shared/data beside the repository (read there, never copied in).
_SHARED = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data"))
TABLE_TEXT = os.path.join(_SHARED, "warpeace.txt")

# scale -> (model, data, train, eval) sizes; the rest of the config is the defaults.
_SIZES = {
    "tiny": ({"d_model": 128, "num_layers": 4, "num_heads": 4, "mlp_dim": 512},
             {"seq_len": 128, "vocab_size": 1024},
             {"batch_size": 16, "num_steps": 400, "warmup_steps": 40, "learning_rate": 3e-3,
              "eval_every_steps": 100},
             {"max_batches": 40}),
    "gpu": ({"d_model": 512, "num_layers": 8, "num_heads": 8, "mlp_dim": 1376,
             "dtype": "bfloat16"},
            {"seq_len": 512, "vocab_size": 8192},
            {"batch_size": 256, "num_steps": 768, "warmup_steps": 80, "learning_rate": 2e-3,
             "eval_every_steps": 256},
            {"max_batches": 50}),
    "small": ({"d_model": 512, "num_layers": 8, "num_heads": 8, "mlp_dim": 1376,
               "dtype": "bfloat16"},
              {"seq_len": 512, "vocab_size": 8192},
              {"batch_size": 64, "num_steps": 6000, "warmup_steps": 300, "learning_rate": 1e-3,
               "eval_every_steps": 500},
              {"max_batches": 50}),
    "paper": ({"d_model": 768, "num_layers": 12, "num_heads": 12, "mlp_dim": 2048,
               "dtype": "bfloat16"},
              {"seq_len": 1024, "vocab_size": 32768},
              {"batch_size": 256, "num_steps": 20000, "warmup_steps": 1000,
               "learning_rate": 6e-4, "eval_every_steps": 1000},
              {"max_batches": 100}),
}
SCALES = tuple(_SIZES)


def parse_arg(arg: str, rows, table: str) -> tuple[str, str]:
  """``"ROW[,SCALE]"`` → ``(row, scale)``; raises ValueError naming the allowed values."""
  row, _, scale = arg.partition(",")
  scale = scale or "tiny"
  if row not in rows:
    raise ValueError(f"experiments/paper/{table}.py:{row}; allowed rows: {', '.join(rows)}")
  if scale not in SCALES:
    raise ValueError(f"experiments/paper/{table}.py:{arg}; allowed scales: "
                     f"{', '.join(SCALES)}")
  return row, scale


def base_config(scale: str):
  """The config every row of every table starts from at ``scale`` (one of :data:`SCALES`)."""
  c = get_default_config()
  c.data.files = TABLE_TEXT
  for group, sizes in zip((c.model, c.data, c.train, c.eval), _SIZES[scale], strict=True):
    group.update(sizes)
  c.checkpoint.every_steps = max(c.train.num_steps // 4, 1)
  c.eval.energy_trace = False
  return c


def matched_llama_mlp_dim(d_model: int, target_params_per_layer: int) -> int:
  """SwiGLU width f' such that a Llama layer has ``target`` params: 4d² + 3d·f' = target
  (the parameter-matched baseline of CEM_MATH.md §6)."""
  return max(1, round((target_params_per_layer - 4 * d_model * d_model) / (3 * d_model)))
