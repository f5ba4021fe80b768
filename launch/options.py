"""What the launch scripts' option parsers share: no abbreviations, and an unknown option named
in one line with the allowed ones. Standard library only, as every launch script."""

from __future__ import annotations

import argparse
import difflib


class Parser(argparse.ArgumentParser):
  """``argparse.ArgumentParser`` (``allow_abbrev=False``) that refuses an option it does not
  define before anything else is checked: ``sweep.py --workdr=DIR`` was reported as
  "the following arguments are required: --workdir", naming the flag that was given correctly
  and not the one misspelt, and ``--work=DIR`` was taken as ``--workdir``.

  Parsing stops with status 2 and argparse's usage, its last line
  ``PROG: error: unknown option '--workdr'; did you mean --workdir? allowed: --config, ...``.
  Only the arguments handed to it are read: a script passes those before its ``--``.
  """

  def __init__(self, **kwargs):
    self._known: list[str] = []  # before super().__init__, which adds -h/--help
    super().__init__(allow_abbrev=False, **kwargs)

  def add_argument(self, *args, **kwargs):
    action = super().add_argument(*args, **kwargs)
    self._known.extend(action.option_strings)
    return action

  def parse_known_args(self, args=None, namespace=None):
    for arg in args or ():
      name = arg.partition("=")[0]
      # A value of an option may start with '-' too (--port -1): argparse itself reads a
      # '-' and a digit as a negative number, and those are left to it.
      if (arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit() and arg != "--"
          and name not in self._known):
        close = difflib.get_close_matches(name, self._known, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        self.error(f"unknown option {name!r}; {hint}allowed: "
                   f"{', '.join(k for k in self._known if k.startswith('--'))}")
    return super().parse_known_args(args, namespace)


def script_parser(doc: str, **kwargs) -> Parser:
  """A launch script's :class:`Parser`: the first paragraph of its docstring ``doc`` as the
  description, printed by ``--help`` as written; ``kwargs`` as ``argparse.ArgumentParser``'s."""
  return Parser(description=doc.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def split_at_dashes(argv: list[str]) -> tuple[list[str], list[str] | None]:
  """``argv`` split at its first ``--``: the script's own arguments before it, those it hands
  on after it (None where there is no ``--``)."""
  if "--" not in argv:
    return list(argv), None
  split = argv.index("--")
  return argv[:split], argv[split + 1:]
