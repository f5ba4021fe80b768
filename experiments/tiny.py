"""Tiny CEM (or Llama) language model on the built-in corpus: minutes on 2 CPU cores.

Command (CEM; the main job of the README)::

    python -m cem_jax.main --config=experiments/tiny.py --workdir=/tmp/w

Llama baseline: ``--config=experiments/tiny.py:llama``. Another text:
``--config.data.files=../shared/data/tinyshakespeare.txt``.

Expected result: filled in below from measured runs.
"""

from cem_jax.config import get_default_config


def get_config(arg: str = "cem"):
  """``arg``: ``'cem'`` (default) or ``'llama'``; the sizes are the defaults of cem_jax.config."""
  if arg not in ("cem", "llama"):
    raise ValueError(f"experiments/tiny.py:{arg}; allowed args: cem, llama")
  c = get_default_config()
  c.model.block = arg
  return c
