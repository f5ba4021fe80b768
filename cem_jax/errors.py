"""One-line wording of an exception, for log lines and start-up errors.

JAX, XLA and parser errors run over many lines; a log line or a one-line error quotes only the
exception's type and one line of its message. None of these raise, whatever the message
(an empty one included). :func:`first_three` shortens a list of names for such a line.
"""

from __future__ import annotations


def _lines(e: BaseException) -> list[str]:
  return [line.strip() for line in str(e).splitlines() if line.strip()]


def first_line(e: BaseException) -> str:
  """The first non-blank line of ``e``'s message, stripped; the type's name when the message is
  blank (e.g. ``first_line(ValueError("bad\\n  detail")) == 'bad'``)."""
  lines = _lines(e)
  return lines[0] if lines else type(e).__name__


def last_line(e: BaseException) -> str:
  """The last non-blank line of ``e``'s message, stripped (where a chained or wrapped error
  states its cause); the type's name when the message is blank."""
  lines = _lines(e)
  return lines[-1] if lines else type(e).__name__


def one_line(e: BaseException) -> str:
  """``'Type: first non-blank line of the message'``, or ``'Type'`` when the message is empty
  (e.g. ``one_line(ValueError("bad\\n  detail")) == 'ValueError: bad'``)."""
  lines = _lines(e)
  return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def first_three(items: list[str], sep: str = ", ") -> str:
  """``items`` for a one-line message: the first three joined by ``sep``, then how many more
  (e.g. ``first_three(["a", "b", "c", "d", "e"]) == 'a, b, c, and 2 more'``; ``sep="; "`` for
  items that hold commas themselves)."""
  shown = sep.join(items[:3])
  return shown + (f"{sep}and {len(items) - 3} more" if len(items) > 3 else "")
