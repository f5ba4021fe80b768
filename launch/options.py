"""What the launch scripts' option parsers share: no abbreviations, and an unknown option named
in one line with the allowed ones. Standard library only, as every launch script."""

from __future__ import annotations

import argparse
import difflib
import os


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


# The cem_jax config fields whose values are paths (tests/test_launch.py checks the list
# against cem_jax/config.py); an energy only as 'file.py:function'. A launcher whose processes
# run in another folder reads a relative one there.
PATH_FIELDS = ("data.files", "data.tfds_data_dir", "data.tokenizer", "data.prepared_dir",
               "checkpoint.load_parameters_from", "model.attention_energy", "model.mlp_energy")


def relative_paths(main_args: list[str]) -> list[tuple[str, str]]:
  """``(option, path)`` for each relative path that ``main_args`` (``cem_jax.main``'s
  arguments) give a :data:`PATH_FIELDS` field, as ``--config.FIELD=VALUE`` or
  ``--config.FIELD VALUE``: each of ``data.files``' comma-separated globs, the file of a
  ``file.py:function`` energy. Absolute paths and ``~`` (expanded by cem_jax where it runs)
  are not relative; neither is ``''`` nor an energy's registry or module name."""
  found = []
  for i, arg in enumerate(main_args):
    flag, eq, value = arg.partition("=")
    field = flag[len("--config."):] if flag.startswith("--config.") else None
    if field not in PATH_FIELDS:
      continue
    if not eq:  # absl also takes the value as the next argument
      if i + 1 >= len(main_args) or main_args[i + 1].startswith("--"):
        continue
      arg, value = f"{flag} {main_args[i + 1]}", main_args[i + 1]
    if field.endswith("_energy"):
      module, sep, _ = value.rpartition(":")
      paths = [module] if sep and module.endswith(".py") else []
    else:
      paths = value.split(",") if field == "data.files" else [value]
    found += [(arg, p) for p in paths
              if p and not os.path.isabs(p) and not (p == "~" or p.startswith("~/"))]
  return found
