"""What every ``python -m cem_jax.*`` program shares: one-line flag errors, config loading,
library log filtering.

The standard (README): bad input gives ``error: ...`` on one line naming the flag or file, the
value and what is allowed, and exit status 1 — never a traceback for a typo.
"""

from __future__ import annotations

import re
import sys

from absl import flags, logging


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(1)


def parse_flags(argv):
  """absl flag parsing with one-line errors; pass as ``app.run(main, flags_parser=...)``.

  Covers: a bad flag value (absl's own message, first line), a ``--config`` file whose
  ``get_config`` raises (the exception's last line), and a misspelt ``--config.KEY`` override
  (ml_collections raises a bare ``AttributeError``/``KeyError``).
  """
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    text = str(e)
    if "Error whilst parsing config file" in text:
      last = [line.strip() for line in text.splitlines() if line.strip()][-1]
      last = re.sub(r"^\w+Error: ", "", last)
      given = [a for a in argv[1:] if a.startswith("--config=")]
      _fail(last if given and given[0][len("--config="):].split(":")[0] in last
            else f"{given[0] if given else '--config'}: {last}")
    _fail(text.splitlines()[0])
  except (AttributeError, KeyError) as e:
    text = str(e)
    name = re.search(r"'(\w+)", text)
    name = name.group(1) if name else text
    hint = re.search(r'Did you mean "(\w+)"', text)
    hint = f"did you mean {hint.group(1)!r}?" if hint else "see cem_jax/config.py for the fields"
    bad = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--config.") and
           name in a.split("=", 1)[0].split(".")]
    where = bad[0] if bad else "--config"
    _fail(f"{where}: the config has no field {name!r}; {hint}")


def load_config(name: str = "config"):
  """The config of a ``config_flags`` flag, or a one-line ValueError naming the file.

  ml_collections defers a missing or unreadable config file to the first attribute access
  (a multi-line ``IOError``); this surfaces it at once.
  """
  holder = flags.FLAGS[name]
  config = holder.value
  try:
    config.get("model")
  except OSError as e:
    cause = e.__cause__ if e.__cause__ is not None else e
    detail = [line.strip() for line in str(cause).splitlines() if line.strip()][-1]
    raise ValueError(f"--{name}={holder.config_filename}: cannot load it ({detail}); paths "
                     "are relative to the working directory") from None
  return config


class QuietLibraries(logging.logging.Filter):
  """Drops Orbax/TFDS records below ``level``, a Python ``logging`` level (not absl's
  verbosity numbers): dozens of INFO lines per checkpoint."""

  def __init__(self, level: int):
    super().__init__()
    self.level = level

  def filter(self, record):
    noisy = "orbax" in record.pathname or "tensorflow_datasets" in record.pathname
    return not noisy or record.levelno >= self.level


def quiet_libraries(level: int = logging.logging.WARNING) -> None:
  """Installs :class:`QuietLibraries` on absl's handler (our own records all pass)."""
  handler = logging.get_absl_handler()
  # ABSLHandler.handle() forwards to its inner handler without running its own filters.
  for h in (handler, handler.python_handler):
    h.addFilter(QuietLibraries(level))
