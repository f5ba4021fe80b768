"""What every ``python -m cem_jax.*`` program shares: one-line flag errors, config loading,
library log filtering.

The standard (README): bad input gives ``error: ...`` on one line naming the flag or file, the
value and what is allowed, and exit status 1 — never a traceback for a typo.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import inspect
import os
import signal
import sys
import threading

import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from cem_jax import errors, files, signals

CONFIG_FLAG = "config"
# The flags define_config_flag makes belong to the program that calls it: --help lists them
# with the program's own (absl lists the main module's key flags).
flags.disclaim_key_flags()


def define_config_flag() -> None:
  """Defines ``--config`` (an ml_collections config file, ``FILE[:ARG]``, with
  ``--config.KEY=VALUE`` overrides) under the name :func:`parse_flags`' one-line errors read."""
  config_flags.DEFINE_config_file(CONFIG_FLAG, None, "Experiment config file[:arg].",
                                  lock_config=True)


def define_attention_impl_flag(choices) -> None:
  """Defines ``--attention_impl`` of the tools that load a run (evaluate, sample:
  :func:`cem_jax.runs.load_run`'s ``attention_impl``), one of ``choices``
  (``config.ATTENTION_IMPLEMENTATIONS``). Here, not beside ``load_run``: a tool defines its
  flags without importing jax, so that a bad flag is refused in a fraction of a second."""
  flags.DEFINE_enum("attention_impl", None, choices,
                    "The attention kernel to run the model with (default: the run's own "
                    "model.attention_impl), e.g. auto on a CPU for a run trained with cudnn.")


# The flags each program marked required (:func:`require`), for parse_flags' one line.
_REQUIRED: list[str] = []


def require(*names: str) -> None:
  """``flags.mark_flags_as_required(names)``, and a left-out one is one line from
  :func:`parse_flags` (``--NAME is required: HELP``) instead of absl's ``Flag --NAME must have
  a value other than None``."""
  flags.mark_flags_as_required(list(names))
  _REQUIRED.extend(n for n in names if n not in _REQUIRED)


def _missing_required() -> str | None:
  """The first required flag left out, as ``--NAME is required: HELP``; None if none is, or
  if parsing failed before absl's checks of the values (an unknown flag, a value absl refuses:
  that flag's own error is the one to tell; a required flag is None then whether given or not).
  """
  if not flags.FLAGS.is_parsed():  # absl marks the flags parsed just before it checks them
    return None
  for name in _REQUIRED:
    flag = flags.FLAGS[name]
    if flag.value is None:
      return f"--{name} is required: {flag.help.rstrip('.')}"
  return None


def no_extra_args(argv: list[str]) -> None:
  """Refuses positional arguments (absl passes them on in ``argv[1:]``: a flag missing its
  ``--``, or a space in a flag's value, would otherwise be dropped without a word).

  One ``error: ...`` line and exit status 1, as every other bad flag: an ``app.UsageError``
  made absl print the program's whole usage (30-50 lines) above the one line that mattered.

  Raises:
    SystemExit: status 1, after ``error: unexpected arguments: ARGS; allowed: ...`` on stderr.
  """
  if len(argv) > 1:
    _fail(f"unexpected arguments: {' '.join(argv[1:])}; allowed: only --NAME=VALUE flags "
          "(a flag missing its --, or a space in a value not quoted?)")


def script_args(argv: list[str], doc: str | None, usage: str) -> list[str]:
  """The positional arguments of a script that takes no flags (``python experiments/X.py ARG
  ...``): ``-h`` or ``--help`` prints ``doc`` (the script's docstring) and exits with status 0;
  any other argument that starts with ``-`` is one ``error: ...`` line naming it and ``usage``,
  status 1. Such an argument was taken as a value: ``attention_kernels.py --help`` ran the
  benchmark and wrote its JSON to a file named ``--help``.

  Raises:
    SystemExit: 0 after the help, 1 after the error line.
  """
  args = argv[1:]
  if any(a in ("-h", "--help") for a in args):
    print((doc or usage).strip())
    sys.exit(0)
  flagged = [a for a in args if a.startswith("-") and a != "-"]
  if flagged:
    _fail(f"unexpected flag {flagged[0]!r}; allowed: {usage} (positional arguments; --help "
          "for more)")
  return args


def check_given(name: str, value: str | None, allowed: str) -> None:
  """Refuses a string flag given empty (``--out=``): absl hands ``''`` on, which a program read
  as the flag left out (bench's ``--out``: no JSON written) or as the working directory
  (``os.path.join('', ...)``: evaluate read ``./config.json``). None (left out) passes.

  Raises:
    ValueError: ``--NAME is empty; allowed: ALLOWED``.
  """
  if value == "":
    raise ValueError(f"--{name} is empty; allowed: {allowed}")


def check_folder(name: str, path: str | None, allowed: str) -> None:
  """Refuses a folder flag that is empty (:func:`check_given`) or names no folder, before a
  program imports jax or reads anything there. None (left out) passes.

  Raises:
    ValueError: ``--NAME=PATH: no such folder; allowed: ALLOWED`` (or ``is not a folder``).
  """
  check_given(name, path, allowed)
  if path is not None and not os.path.isdir(path):
    what = "is not a folder" if os.path.exists(path) else "no such folder"
    raise ValueError(f"--{name}={path}: {what}; allowed: {allowed}")


# What a run leaves in its --workdir (cem_jax.train, workdir, metrics, and the tools that read
# a run: evaluate, plot, tables): any one of them makes a folder a run's. Here, not in
# cem_jax.workdir, which loads jax: main checks its --workdir before jax loads.
RUN_ENTRIES = frozenset({
    "config.json", "metrics.jsonl", "checkpoints", "data", "tensorboard", "best_eval.json",
    "result.json", "plots", "test_time_steps.md", "test_time_steps.json",
    "test_time_steps.png"})


def check_workdir(path: str) -> None:
  """Refuses a ``--workdir`` that is a folder holding files, none of them a run's
  (:data:`RUN_ENTRIES`, or an atomic write's leftover of one): ``main --workdir=.`` in this
  repository, or a folder of sources or notes, was filled with a run's files beside them. An
  empty or missing folder (a new run), one holding a run (to resume, or a finished run to
  re-run), and one holding only hidden entries (``.``: a killed start's files, a file
  manager's) pass; so does a path that is no folder, for :func:`cem_jax.workdir.
  prepare_workdir` to refuse.

  Raises:
    ValueError: ``--workdir=PATH holds no run (found: A, B, C, and N more); allowed: ...``.
  """
  try:
    names = sorted(n for n in os.listdir(path) if not n.startswith("."))
  except (FileNotFoundError, NotADirectoryError):
    return
  except OSError as e:
    raise ValueError(f"--workdir={path}: cannot list it ({e.strerror or e}); allowed: a "
                     "folder this user can read and write") from None
  if not names or any(n in RUN_ENTRIES or files.temporary_of(n) in RUN_ENTRIES
                      for n in names):
    return
  raise ValueError(f"--workdir={path} holds no run (found: {errors.first_three(names)}); "
                   "allowed: an empty or new folder, or the --workdir of a run to resume "
                   "(with its config.json, checkpoints/ or data/)")


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(1)


@contextlib.contextmanager
def user_errors(*also: type[BaseException]):
  """Reports bad input as ``error: MESSAGE`` on stderr and exit status 1, the standard above.

  Bad input is a ValueError (a value: config field, flag, file contents) or an OSError (a
  file, folder or the network: missing, unreadable, unreachable); ``also`` adds a program's
  own, e.g. FloatingPointError for a training run that diverged. Anything else is a bug and
  keeps its traceback.
  """
  try:
    yield
  except (ValueError, OSError, *also) as e:
    _fail(str(e))


class Terminated(BaseException):
  """SIGTERM at a point where a program stops at once instead of saving (``train``'s start-up,
  :class:`cem_jax.workdir.Preemption`): what a ``finally`` and ``except BaseException`` clean up
  runs, then :func:`interrupted` ends the program. Its message says what was kept and what
  the same command then does. Not a KeyboardInterrupt: nobody pressed Ctrl-C."""


# Said by main (interrupted) after "terminated (SIGTERM): " for a SIGTERM before training's
# first step: before train's handler is set (cem_jax.signals.Held: main's imports, flags,
# config file, the processes' meeting, jax's import and backend start) or in train's start-up
# (cem_jax.workdir.Preemption).
TERMINATED_IN_START_UP = (
    "during start-up, before the first step: nothing trained or saved; a --workdir this start "
    "created is removed but for the tokens prepared in WORKDIR/data; the same command starts "
    "again (from the newest checkpoint in --workdir, if any)")


def _no_interrupt_traceback(kind, value, tb) -> None:
  if not issubclass(kind, KeyboardInterrupt | Terminated):
    sys.__excepthook__(kind, value, tb)


@contextlib.contextmanager
def interrupted(what_now: str):
  """Ctrl-C (SIGINT, a KeyboardInterrupt) as one line, ``interrupted (Ctrl-C): WHAT_NOW``, on
  stderr instead of a traceback through jax's internals that reads like a crash.

  The process ends as Python ends it on Ctrl-C (cleanup and atexit first, then death by
  SIGINT: status 130 in a shell, -2 to ``subprocess``), so launchers and sweeps see the same
  status as before, but without the interpreter's teardown (:func:`cem_jax.signals.die_by`).
  Only the traceback of a KeyboardInterrupt is dropped (``sys.excepthook``); any other
  exception keeps its own.

  A :class:`Terminated` (SIGTERM where the program cannot save, raised by the program's own
  handler) is the same, as ``terminated (SIGTERM): MESSAGE``, its own message, and the process
  ends by SIGTERM (status 143 in a shell, -15 to ``subprocess``).

  Python's Ctrl-C handler raises wherever the main thread is, also inside code whose
  exceptions Python prints and drops ("Exception ignored in ..."): a ``gc`` callback (jax's
  runs at every collection), a ``__del__``, a ``weakref`` callback; the program went on (3 of
  3 Ctrl-Cs while data was prepared). Python hands every such exception to
  ``sys.unraisablehook``: the one installed here (:func:`_unraisable`) sends a dropped Ctrl-C
  (or SIGTERM) again once that code has returned. A SIGINT ignored (a shell's background
  job) or handled by someone else stays theirs.
  """
  hook = None
  if (threading.current_thread() is threading.main_thread()
      and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    hook, sys.unraisablehook = sys.unraisablehook, functools.partial(_unraisable,
                                                                      sys.unraisablehook)
  try:
    yield
    if hook is not None and _cancel_redelivery():
      # A Ctrl-C dropped just before the block ended: delivered here, not as a traceback
      # wherever the program is once the hook before is back.
      raise KeyboardInterrupt
  except KeyboardInterrupt:
    sys.excepthook = _no_interrupt_traceback
    signals.die_interrupted(what_now)
    raise
  except Terminated as e:
    print(f"terminated (SIGTERM): {e}", file=sys.stderr)
    sys.excepthook = _no_interrupt_traceback
    signals.die_by(signal.SIGTERM)
    raise
  finally:
    if hook is not None:
      sys.unraisablehook = hook


# Seconds after which a Ctrl-C that landed where an exception is dropped is delivered again.
_REDELIVER_S = 0.05

# The redeliveries not yet sent (:func:`_redeliver`).
_pending: list[threading.Timer] = []


def _redeliver(signum: int) -> None:
  """Sends ``signum`` to this process again in :data:`_REDELIVER_S`, from a thread."""
  timer = threading.Timer(_REDELIVER_S, os.kill, (os.getpid(), signum))
  timer.daemon = True
  _pending.append(timer)
  timer.start()


def _cancel_redelivery() -> bool:
  """Cancels the redeliveries not yet sent; whether there was one."""
  waiting = [t for t in _pending if t.is_alive()]
  _pending.clear()
  for t in waiting:
    t.cancel()
  return bool(waiting)


def _unraisable(hook, unraisable) -> None:
  """``sys.unraisablehook`` under :func:`interrupted`: a KeyboardInterrupt (or
  :class:`Terminated`) Python drops (raised in a ``gc`` callback, a ``__del__``, a ``weakref``
  callback) is delivered again (:func:`_redeliver`: SIGINT, or SIGTERM), without the
  "Exception ignored" traceback; anything else goes to ``hook``, the hook before."""
  kind = unraisable.exc_type
  if kind is not None and issubclass(kind, KeyboardInterrupt | Terminated):
    _redeliver(signal.SIGTERM if issubclass(kind, Terminated) else signal.SIGINT)
    return
  hook(unraisable)


def _config_module(path: str):
  """The config file ``path`` run as a module of its own, as ml_collections runs it; None if
  it is no ``.py`` file. Raises what its code raises."""
  module_spec = importlib.util.spec_from_file_location("cem_jax_cli_config", path)
  if module_spec is None:
    return None
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def default_config_arg(spec: str | None = None) -> str | None:
  """The arg that the config file ``spec`` (``--config``'s ``FILE[:ARG]``; None: the parsed
  ``--config`` flag's) built its config with when ``spec`` names none: its ``get_config``'s
  default (``experiments/design.py``: ``'t2'``); None when ``spec`` has ``:ARG`` or
  ``get_config`` has no default. ``main`` logs it: a variant the user did not name was trained
  silently. Runs the file's module code once more (as :func:`parse_flags` does on an error)."""
  if spec is None:
    spec = flags.FLAGS[CONFIG_FLAG].config_filename
  path, colon, _ = spec.partition(":")
  if colon:
    return None
  module = _config_module(path)
  get_config = getattr(module, "get_config", None)
  if not callable(get_config):
    return None
  params = list(inspect.signature(get_config).parameters.values())
  if not params or params[0].default is inspect.Parameter.empty:
    return None
  return params[0].default


def _run_config_file(spec: str):
  """Runs the config file ``FILE[:ARG]`` by itself, as ml_collections does.

  Returns ``(config, None)``, or ``(None, one line naming the file)`` when it raises: the
  cause of ml_collections rejecting ``--config``, found without reading its message.
  """
  path, colon, arg = spec.partition(":")
  try:
    module = _config_module(path)
    if module is None:  # not a .py file, e.g. a run's config.json
      return None, (f"--{CONFIG_FLAG}={spec}: not a Python file; allowed: a .py file whose "
                    "get_config() returns the config (e.g. experiments/tiny.py), optionally "
                    "with :ARG for get_config(ARG)")
    if not callable(getattr(module, "get_config", None)):  # was "module 'cem_jax_cli_config'
      # has no attribute 'get_config'", naming a module the user never wrote
      return None, (f"--{CONFIG_FLAG}={spec}: defines no get_config(); allowed: a .py file "
                    "whose get_config() returns the config (e.g. experiments/tiny.py)")
    # FILE: passes '' as ml_collections does (get_config('')): left out, the file's error
    # for it was not found here and ml_collections' multi-line one was cut to its first line.
    return module.get_config(*([arg] if colon else [])), None
  except Exception as e:  # the user's file: any exception is its message to the user
    message = errors.last_line(e)
    return None, (message if path in message else f"--{CONFIG_FLAG}={spec}: {message}")


def _run_config_files(given: list[str]):
  """:func:`_run_config_file` of each ``--config=FILE[:ARG]`` given, in order, as absl parses
  every occurrence: ``(the last one's config, None)`` or ``(None, the first failure)``."""
  config = None
  for arg in given:
    config, cause = _run_config_file(arg.split("=", 1)[1])
    if cause is not None:
      return None, cause
  return config, None


def _overrides(argv):
  """``(name as given, KEY, VALUE or None, negated)`` of each ``--config.KEY[=VALUE]`` in
  ``argv``, in every spelling absl reads: one dash or two, and ``--noconfig.KEY`` (a bool set
  false)."""
  for arg in argv[1:]:
    body = arg[2:] if arg.startswith("--") else arg[1:] if arg.startswith("-") else ""
    name, sep, value = body.partition("=")
    negated = name.startswith(f"no{CONFIG_FLAG}.")
    name = name[2:] if negated else name
    if name.startswith(f"{CONFIG_FLAG}."):
      yield arg.partition("=")[0], name[len(CONFIG_FLAG) + 1:], value if sep else None, negated


def _flat_keys(node, prefix: str = "") -> list[str]:
  """The dotted keys of the values (not the groups) of a nested config (``config.flat``'s
  keys, which this stage-0 module may not import)."""
  out = []
  for k in node.keys():
    out += (_flat_keys(node[k], f"{prefix}{k}.") if hasattr(node[k], "keys")
            else [f"{prefix}{k}"])
  return out


def _unknown_override(config, argv) -> str | None:
  """The first ``--config.KEY=VALUE`` whose KEY is not a field of ``config``, as one line with
  the closest group or field (:func:`closest_keys`; None when every KEY exists)."""
  for name, key, _, _ in _overrides(argv):
    node, path = config, CONFIG_FLAG
    parts = key.split(".")
    for i, part in enumerate(parts):
      if not hasattr(node, "keys"):
        return f"{name}: the config has no field {part!r}; {path} is a value, not a group"
      if part not in node.keys():
        groups = [k for k in node.keys() if hasattr(node[k], "keys")]
        close_groups = closest(part, groups) if i < len(parts) - 1 else []
        if close_groups:  # --config.trian.num_steps
          hint = f"did you mean {' or '.join(map(repr, close_groups))}?"
        else:
          close = closest_keys(key, _flat_keys(config))
          hint = (f"did you mean {' or '.join(f'--{CONFIG_FLAG}.{k}' for k in close)}?"
                  if close else "see cem_jax/config.py for the fields")
        return f"{name}: the config has no field {part!r}; {hint}"
      node, path = node[part], f"{path}.{part}"
  return None


# Field types whose overrides absl parses, each with what a value must be. bool first: a bool is
# an int too.
_OVERRIDE_PARSERS = ((bool, "true or false", flags.BooleanParser()),
                     (int, "an integer", flags.IntegerParser()),
                     (float, "a number", flags.FloatParser()))


def parse_value(name: str, text: str, current):
  """``text`` as a value of the type of ``current`` (a config field's value): bools, ints and
  floats as absl parses a ``--config.KEY=VALUE`` override (bools: true/false, t/f, 1/0, any
  case); anything else as the text itself.

  Raises:
    ValueError: ``"{name}={text}; allowed: an integer"`` (or a number, true or false).
  """
  for kind, allowed, parser in _OVERRIDE_PARSERS:
    if type(current) is kind:
      try:
        return parser.parse(text)
      except ValueError:
        raise ValueError(f"{name}={text}; allowed: {allowed}") from None
  return text


def closest(name: str, options) -> list[str]:
  """Up to 3 of ``options`` a misspelt ``name`` most likely meant: those whose words'
  initials it is (``lr``: ``learning_rate``), then those it begins (``batch``:
  ``batch_size``), then difflib's close matches."""
  options = list(options)
  initials = [o for o in options if "_" in o and "".join(w[:1] for w in o.split("_")) == name]
  begun = [o for o in options if o.startswith(name) and o != name] if len(name) >= 3 else []
  found = initials + begun + difflib.get_close_matches(name, options, n=3)
  return list(dict.fromkeys(found))[:3]


def closest_keys(key: str, keys) -> list[str]:
  """Up to 3 of the dotted ``keys`` a misspelt dotted ``key`` most likely meant: the field of
  that name in another group (``model.warmup_steps``: ``train.warmup_steps``), then the
  :func:`closest` fields of its own group (``train.lr``: ``train.learning_rate``), else of any
  group (``lr``: ``train.learning_rate``)."""
  keys = list(keys)
  group, _, leaf = key.rpartition(".")
  leaves = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == group]
  close = ([k for k in keys if k.rpartition(".")[2] == leaf]
           + [f"{group}.{k}" if group else k for k in closest(leaf, leaves)])[:3]
  if not close:
    by_leaf = {k.rpartition(".")[2]: k for k in keys}
    close = [by_leaf[k] for k in closest(leaf, by_leaf)]
  return close


def _unparsable_override(config, argv) -> str | None:
  """The first ``--config.KEY=VALUE`` whose VALUE is not of KEY's type in ``config`` (a bool,
  int or float field), or ``--noconfig.KEY`` of a field that is not a bool or with a value,
  as one line saying what is allowed (None when every value parses)."""
  for name, key, value, negated in _overrides(argv):
    field = config
    for part in key.split("."):
      field = field[part] if hasattr(field, "keys") and part in field.keys() else None
    if negated and (value is not None or type(field) is not bool):
      return (f"{name}{'' if value is None else '=' + value}; allowed: --no{CONFIG_FLAG}.KEY "
              f"alone, for a field that is true or false (--{CONFIG_FLAG}.{key}=VALUE sets "
              "any field)")
    if value is not None:
      try:
        parse_value(name, value, field)
      except ValueError as e:
        return str(e)
  return None


def _config_cause(given: list[str], argv) -> str | None:
  """Why the ``--config`` flags failed, as one line, found by checking their values: a config
  file of ``given`` (the ``--config=FILE[:ARG]`` arguments) that fails by itself
  (:func:`_run_config_files`), else a ``--config.KEY`` override of ``argv`` with an unknown KEY
  or a VALUE of the wrong type; None when none of these is the cause."""
  config, cause = _run_config_files(given)
  if config is not None:
    cause = _unknown_override(config, argv) or _unparsable_override(config, argv)
  return cause


# absl's help flags (absl.app's HelpFlag, HelpshortFlag, HelpfullFlag, HelpXMLFlag, with -? for
# --help): each prints the usage to stdout and exits with status 1.
_HELP_FLAGS = ("help", "?", "helpshort", "helpfull", "helpxml")


def _asks_for_help(argv) -> bool:
  """Whether ``argv`` (before a ``--``) names one of absl's help flags, in any spelling absl
  reads (one dash or two, with or without ``=VALUE``): with a status-1 exit while the flags
  are parsed, the usage it printed (a help flag set false prints nothing and exits nowhere)."""
  for arg in argv[1:]:
    if arg == "--":
      return False
    dashes = len(arg) - len(arg.lstrip("-"))
    if dashes in (1, 2) and arg[dashes:].partition("=")[0] in _HELP_FLAGS:
      return True
  return False


def parse_flags(argv):
  """absl flag parsing with one-line errors; pass as ``app.run(main, flags_parser=...)``.

  ``--help`` (and absl's ``-?``, ``--helpshort``, ``--helpfull``, ``--helpxml``) prints the usage
  to stdout, as absl does, and exits with status 0: absl's 1 read as a failure to scripts and
  CI steps that check a tool's help (``python -m cem_jax.main --help && ...``).

  Covers: a required flag left out (:func:`require`), a bad flag value (absl's own message,
  first line), a ``--config`` file that is
  missing, not a ``.py`` file, or whose code or ``get_config`` raises (its message, naming the
  file), a ``--config.KEY=VALUE`` whose value is not of the field's type (what is allowed),
  and a misspelt ``--config.KEY`` override (the field that does not exist and the closest
  one).
  The causes are found by checking the values (running the config file, looking the keys
  up), not by reading the libraries' message texts.
  """
  given = [a for a in argv[1:] if a.lstrip("-").startswith(f"{CONFIG_FLAG}=")
           and len(a) - len(a.lstrip("-")) in (1, 2)]
  try:
    return flags.FLAGS(argv)
  except SystemExit as e:
    if e.code == 1 and _asks_for_help(argv):  # the usage was printed: asked for, not a failure
      sys.exit(0)
    raise
  except flags.Error as e:
    # ml_collections loads the file while parsing each --config: run the files by themselves to
    # learn whether one fails and why (None: they load, the error is another flag's).
    _fail(_config_cause(given, argv) or _missing_required() or errors.first_line(e))
  except Exception:
    # ml_collections lets what the config file's get_config raises (a NameError, an
    # ImportError, a SyntaxError...) escape unwrapped, and a missing file surfaces as an
    # OSError when an override is applied; it applies --config.KEY overrides by attribute
    # lookup, so a missing field is an AttributeError or KeyError.
    cause = _config_cause(given, argv)
    if cause is None:
      raise  # neither the file nor a misspelt field: a bug, keep the traceback
    _fail(cause)


def load_config(name: str = "config"):
  """The config of a ``config_flags`` flag, or a one-line ValueError naming the file.

  ml_collections defers a missing or unreadable config file to the first attribute access
  (a multi-line ``IOError``); this surfaces it at once.

  Raises:
    ValueError: the config file cannot be loaded: one line naming ``--{name}``, the file and
      the cause.
  """
  holder = flags.FLAGS[name]
  config = holder.value
  try:
    config.get("model")
  except OSError as e:
    cause = e.__cause__ if e.__cause__ is not None else e
    detail = errors.last_line(cause)
    path = holder.config_filename.partition(":")[0]
    hint = (f"did you mean {path}.py? " if not path.endswith(".py")
            and os.path.isfile(f"{path}.py") else "")
    raise ValueError(f"--{name}={holder.config_filename}: cannot load it ({detail}); {hint}"
                     "paths are relative to the working directory") from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ValueError(f"--{name}={holder.config_filename}: get_config() returned a "
                     f"{type(config).__name__}; allowed: an ml_collections.ConfigDict (e.g. "
                     "cem_jax.config.get_default_config() with your changes)")
  return config


class QuietLibraries(logging.logging.Filter):
  """Drops Orbax/TFDS records below ``level``, a Python ``logging`` level (not absl's
  verbosity numbers): dozens of INFO lines per checkpoint. Their records kept lose the
  traceback they carry (its exception's type and first line stay, after the message): an
  Orbax thread's failure, a traceback of dozens of lines (those of a failing save are held
  back by :class:`cem_jax.checkpoint.Checkpointer`, its one-line error said instead)."""

  def __init__(self, level: int):
    super().__init__()
    self.level = level

  def filter(self, record):
    noisy = "orbax" in record.pathname or "tensorflow_datasets" in record.pathname
    if not noisy:
      return True
    if record.levelno < self.level:
      return False
    if record.exc_info and record.exc_info[1] is not None:
      record.msg = f"{record.getMessage()} [{errors.one_line(record.exc_info[1])}]"
      record.args = None
    record.exc_info = record.exc_text = None
    return True


def quiet_libraries(level: int = logging.logging.WARNING) -> None:
  """Installs :class:`QuietLibraries` on absl's handler (our own records all pass)."""
  handler = logging.get_absl_handler()
  # absl-py 2.5's ABSLHandler.handle() runs its own filters before forwarding; the inner
  # handler gets the filter too, so that a version forwarding unfiltered stays quiet.
  for h in (handler, handler.python_handler):
    h.addFilter(QuietLibraries(level))
