"""How the launch scripts end: with ``main``'s status, and quietly when whoever read their
output has gone (``--dry_run | head -1``)."""

from __future__ import annotations

import os
import sys


def run(main) -> None:
  """``sys.exit(main(sys.argv[1:]))``; a reader that closed the pipe early ends the script
  with status 1 and no traceback, as Python's documentation advises for SIGPIPE (its note on
  SIGPIPE in the ``signal`` module's page). Each script prints only while none of its runs
  is going (before it starts one, after it ended), so none is left behind."""
  try:
    code = main(sys.argv[1:])
    sys.stdout.flush()  # here, not at exit, where a closed pipe would print a second error
  except BrokenPipeError:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)
  sys.exit(code)
