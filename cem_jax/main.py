"""Train a model: ``python -m cem_jax.main --config=experiments/tiny.py --workdir=DIR``.

Any config key can be overridden: ``--config.model.num_layers=2 --config.data.files=a.txt``.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file[:arg].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for metrics, config and checkpoints.")
flags.mark_flags_as_required(["config", "workdir"])


class _QuietLibraries(logging.logging.Filter):
  """Drops INFO chatter of Orbax/TFDS (dozens of lines per checkpoint); keeps their warnings."""

  def filter(self, record):
    noisy = "orbax" in record.pathname or "tensorflow_datasets" in record.pathname
    return not noisy or record.levelno >= logging.logging.WARNING


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from cem_jax import train  # after flag parsing: a bad flag fails before jax loads

  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(_QuietLibraries())
  try:
    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ValueError, FileNotFoundError, FloatingPointError, PermissionError) as e:
    logging.error("%s", e)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
