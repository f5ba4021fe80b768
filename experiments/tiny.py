"""Tiny CEM (or Llama) language model on the built-in corpus: ~8 minutes on 2 CPU cores.

Command (CEM; the main job of the README)::

    python -m cem_jax.main --config=experiments/tiny.py --workdir=/tmp/w

Llama baseline: ``--config=experiments/tiny.py:llama``. Another text:
``--config.data.files=../shared/data/tinyshakespeare.txt``.

Model: d_model 128, 4 layers, 4 heads (head_dim 32), mlp_dim 512, RoPE, tied embeddings,
1024-piece BPE; CEM 0.79M parameters (tied attention + tied MLP), Llama 1.18M. Training:
1000 steps × 16 sequences × 128 tokens, AdamW 3e-3, 50 warm-up steps, cosine to 10%.
Data: CPython's pydoc topics + stdlib docstrings (offline); held out: the last 10% of the
pydoc topics, the text the byte 4-gram reference (``../shared/tools/ngram_bpb.py pydoc``:
2.06 bits/byte, fitted on the first 90% of the topics) is scored on.

Measured 2026-11-30 under numerics version 1 (cem_jax/version.py). The CEM main job alone
on a 2-core CPU, fresh clone: 488 s wall, final
eval bits/byte 1.7318 (step 500: 1.921). The other rows ran while other jobs shared the CPU
(same losses, longer wall times):

| run | eval bits/byte at step 1000 | reference |
|---|---|---|
| CEM, built-in corpus | 1.732 | byte 4-gram 2.06; bar 1.9 |
| Llama, built-in corpus | 1.595 | |
| CEM, tinyshakespeare | 2.290 | byte 4-gram 2.51; bar 2.35 |
| Llama, tinyshakespeare | 2.172 | |

On pydoc topics alone (``--config.data.builtin=pydoc``) the same model overfits after ~500
steps (CEM best 1.836 at step 500, Llama 1.685), hence the docstrings.
"""

from cem_jax.config import get_default_config


def get_config(arg: str = "cem"):
  """``arg``: ``'cem'`` (default) or ``'llama'``; the sizes are the defaults of cem_jax.config."""
  if arg not in ("cem", "llama"):
    raise ValueError(f"experiments/tiny.py:{arg}; allowed args: cem, llama")
  c = get_default_config()
  c.model.block = arg
  return c
