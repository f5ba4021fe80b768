"""One-line wording of an exception, for log lines and start-up errors.

JAX, XLA and parser errors run over many lines; a log line or a one-line error quotes only the
exception's type and the first line of its message.
"""

from __future__ import annotations


def one_line(e: BaseException) -> str:
  """``'Type: first non-blank line of the message'``, or ``'Type'`` when the message is empty
  (e.g. ``one_line(ValueError("bad\\n  detail")) == 'ValueError: bad'``)."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
