"""Tiny CEM (or Llama) language model on the built-in corpus: minutes on 2 CPU cores.

Command (CEM; the main job of the README)::

    python -m cem_jax.main --config=experiments/tiny.py --workdir=/tmp/w

Llama baseline: ``--config=experiments/tiny.py:llama``. Another text:
``--config.data.files=../shared/data/tinyshakespeare.txt``.

Expected result: filled in below from measured runs.
"""

from cem_jax.config import get_default_config


def get_config(arg: str = "cem"):
  """``arg``: ``'cem'`` (default) or ``'llama'``."""
  if arg not in ("cem", "llama"):
    raise ValueError(f"experiments/tiny.py:{arg}; allowed args: cem, llama")
  c = get_default_config()
  c.model.block = arg
  c.model.d_model = 128
  c.model.num_heads = 4
  c.model.mlp_dim = 512
  c.model.num_layers = 4
  c.data.seq_len = 128
  c.data.vocab_size = 1024
  c.train.batch_size = 16
  c.train.num_steps = 600
  c.train.learning_rate = 3e-3
  c.train.warmup_steps = 50
  c.train.eval_every_steps = 100
  c.checkpoint.every_steps = 200
  return c
