"""Learning-rate sweep of the tiny CEM and Llama models: 6 runs, one folder each.

Command (runs one after the other; a finished run is skipped, an interrupted one resumes)::

    python launch/sweep.py --config=experiments/lr_sweep.py --workdir=/tmp/lr_sweep

Runs: ``model.block`` in (cem, llama) x ``train.learning_rate`` in (1e-3, 3e-3, 1e-2), each
the tiny model of ``experiments/tiny.py`` for ``train.num_steps`` = 300 (the main job runs
1000). ``--config=experiments/lr_sweep.py:short`` makes them 20 steps, 2 of warm-up (a smoke
test of the launcher).

Expected result: six folders ``/tmp/lr_sweep/model.block=...,train.learning_rate=...`` with
``metrics.jsonl`` and a final checkpoint; rerunning the command prints ``skip ...`` six times.
"""

from cem_jax.config import get_default_config

BLOCKS = ("cem", "llama")
LEARNING_RATES = (1e-3, 3e-3, 1e-2)


def get_config(arg: str = "full"):
  """``arg``: ``'full'`` (300 steps; the default) or ``'short'`` (20, 2 of warm-up, eval at the
  end only)."""
  if arg not in ("full", "short"):
    raise ValueError(f"experiments/lr_sweep.py:{arg}; allowed args: full, short")
  c = get_default_config()
  c.train.num_steps = 300 if arg == "full" else 20
  if arg == "short":
    c.train.eval_every_steps = c.train.num_steps
    c.train.warmup_steps = 2
    c.eval.max_batches = 2
  return c


def get_sweep(arg: str = "full"):
  """The runs: a list of ``{'group.key': value}`` overrides of :func:`get_config`."""
  del arg  # the same grid for every length
  return [{"model.block": block, "train.learning_rate": lr}
          for block in BLOCKS for lr in LEARNING_RATES]
