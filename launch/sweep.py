"""Expand a config file's sweep into runs and launch the ones not finished yet.

    python launch/sweep.py --config=experiments/lr_sweep.py --workdir=/tmp/lr_sweep
    python launch/sweep.py --config=experiments/lr_sweep.py --workdir=/mnt/shared/lr_sweep \\
        --launcher=tpu_pod --tpu=my-v4-32 --zone=us-central2-b

The config file defines ``get_sweep(arg)`` (or ``get_sweep()``) beside ``get_config``: a list
of override dicts such as ``{"train.learning_rate": 3e-3, "model.block": "llama"}`` (an optional
``"name"`` entry names the run). Run ``i`` trains in ``WORKDIR/NAME`` (default name: its
overrides, ``train.learning_rate=0.003,model.block=llama``, each value as its config field's
type reads it: ``1`` or ``'1e0'`` for a float field is ``1.0``, one run under one name) with

    python -m cem_jax.main --config=FILE[:ARG] --workdir=WORKDIR/NAME --config.KEY=VALUE ... EXTRA

where ``EXTRA`` is everything after ``--``. Runs go one after the other: ``--launcher=local``
(default) on this machine (``--num_processes`` > 1: through ``launch/local.py``),
``--launcher=tpu_pod`` through ``launch/tpu_pod.py`` on every worker of a pod (the code is
copied before the first run, and again before the next after a failed run; ``WORKDIR``
absolute). ``EXTRA`` may not set a key the sweep sets (it would win in every run).

Before the first run starts, every run's config is checked by the config's own rules
(``cem_jax.config.validate``, as ``main`` does first): a value ``main`` would refuse in the
last run is a one-line error naming it, not a failure after the runs before it have trained.

A run is finished, and skipped, when ``WORKDIR/NAME/metrics.jsonl`` has its final eval line
(``step`` == ``train.num_steps``) and ``WORKDIR/NAME/checkpoints/<train.num_steps>`` exists.
An unfinished run resumes from its checkpoint. A run folder holding a checkpoint of a run
started with another config (its ``config.json``: another file arg, override or ``EXTRA``
flag; ``cem_jax.workdir.check_same_run``) is a one-line error, neither skipped nor resumed as
a mix of the two. (On a pod, a ``WORKDIR`` not visible here cannot
be checked: finished runs then start, find their final checkpoint and stop.) ``--dry_run``
prints, per run, ``skip NAME (finished)`` or the exact command. At the end the sweep prints
its runs as a table, best eval loss first (:func:`summary`). Exit status: 0 if every run
finished, else 1 (failed runs are listed).

SIGTERM or SIGINT to the sweep is passed on to the run training (``main`` saves at its next
step boundary on SIGTERM), and the sweep stops after it with status 128 + the signal; the
same command resumes. If the sweep itself is killed (``kill -9``), its run gets SIGTERM (on
Linux), so no run trains on without it.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys

import numpy as np
import options  # beside this script: python runs it with its folder first on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, "launch")


def load_config_module(spec: str):
  """``FILE[:ARG]`` → ``(module, ARG)``, ARG None without the colon (``FILE:`` is ``''``, as
  ``main``'s ml_collections reads it: the sweep ran get_config() and printed runs that main
  then refused one by one); the module is imported from its path."""
  path, colon, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise SystemExit(f"error: --config={spec!r}: no such file {path!r}")
  if REPO not in sys.path:
    sys.path.insert(0, REPO)  # experiment files import cem_jax.config
  from cem_jax.errors import one_line

  module_spec = importlib.util.spec_from_file_location("sweep_config", path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:  # noqa: BLE001 - the user's file: one line, not our traceback
    raise SystemExit(f"error: --config={spec!r}: {path}: {one_line(e)}") from None
  return module, (arg if colon else None)


def _call(fn, arg):
  """``fn()`` or ``fn(arg)``, a function of the config file (``get_config``, ``get_sweep``).

  Raises:
    SystemExit: what it raised, in one line naming the function.
  """
  from cem_jax.errors import one_line

  try:
    return fn() if arg is None else fn(arg)
  except Exception as e:  # noqa: BLE001 - the user's file: one line, not our traceback
    raise SystemExit(f"error: {fn.__name__}() raised {one_line(e)}") from None


def format_value(value) -> str:
  """A Python value as ``--config.KEY=`` text that ml_collections parses back to it; a numpy
  scalar (say from ``np.logspace``) as the Python number it holds."""
  if isinstance(value, np.generic):
    value = value.item()  # repr would give 'np.float64(0.001)', which no flag parses
  return value if isinstance(value, str) else repr(value)


def run_name(overrides: dict) -> str:
  """Default run name: ``key=value`` pairs, characters unsafe in a folder name replaced."""
  text = ",".join(f"{k}={format_value(v)}" for k, v in overrides.items()) or "default"
  return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)


def normalised(overrides: dict, fields: dict, where: str) -> dict:
  """``overrides`` with each value of a bool, int or float field of the config (``fields``:
  its flat dict) as ``main`` parses it from its flag (``1`` for a float field is ``1.0``,
  ``'1e-3'`` is ``0.001``): one run gets one name, not one per spelling of its value. Values
  of other fields and keys the config lacks (``main`` names them) are left as given.

  Raises:
    SystemExit: a value the field's type refuses, one line naming ``where``, the key and what
      is allowed.
  """
  from cem_jax import cli

  out = {}
  for key, value in overrides.items():
    try:
      numeric = key in fields and type(fields[key]) in (bool, int, float)
      out[key] = (cli.parse_value(f"{where}: {key}", format_value(value), fields[key])
                  if numeric else value)
    except ValueError as e:
      raise SystemExit(f"error: {e}") from None
  return out


def expand(module, arg) -> list[tuple[str, dict]]:
  """The sweep as ``[(name, overrides)]``, values as the config's field types read them
  (:func:`normalised`).

  Raises:
    SystemExit: no ``get_sweep``, one that raises or returns no list of runs, a malformed
      entry or value, a name that is not a folder name, two runs with the same name, or no
      ``get_config``, or one that returns no config.
  """
  if not hasattr(module, "get_sweep"):
    raise SystemExit("error: the config file has no get_sweep(); define one returning a list "
                     "of override dicts, e.g. [{'train.learning_rate': 1e-3}, ...]")
  entries = _call(module.get_sweep, arg)
  import ml_collections

  from cem_jax import config as config_lib

  if not hasattr(module, "get_config"):  # main needs it too: each run is this config
    raise SystemExit("error: the config file has no get_config(); define one returning the "
                     "config the sweep's runs override (e.g. cem_jax.config.get_default_config()"
                     " with your changes)")
  config = _call(module.get_config, arg)
  if not isinstance(config, ml_collections.ConfigDict):
    raise SystemExit(f"error: get_config() returned a {type(config).__name__}; allowed: an "
                     "ml_collections.ConfigDict (e.g. cem_jax.config.get_default_config() "
                     "with your changes)")
  fields = config_lib.flat(config)
  if not isinstance(entries, (list, tuple)) or not entries:
    raise SystemExit(f"error: get_sweep() returned {entries!r}; allowed: a non-empty list of "
                     "dicts of 'group.key': value overrides")
  runs, seen = [], set()
  for i, entry in enumerate(entries):
    if not isinstance(entry, dict):
      raise SystemExit(f"error: get_sweep() entry {i} is {entry!r}; allowed: a dict of "
                       "'group.key': value overrides")
    overrides = normalised({k: v for k, v in entry.items() if k != "name"}, fields,
                           f"get_sweep() entry {i}")
    name = str(entry.get("name") or run_name(overrides))
    if name in (".", "..") or "/" in name or os.sep in name:
      raise SystemExit(f"error: get_sweep() entry {i} has name {name!r}; allowed: a folder "
                       "name inside --workdir (no '/', not '.' or '..')")
    if name in seen:
      raise SystemExit(f"error: get_sweep() has two runs named {name!r}; give one a 'name'")
    seen.add(name)
    runs.append((name, overrides))
  return runs


def num_steps(module, arg, overrides: dict, extra: list[str]) -> int:
  """``train.num_steps`` of a run: the config, then its overrides, then ``EXTRA`` flags."""
  config = _call(module.get_config, arg)
  steps = overrides.get("train.num_steps", config.train.num_steps)
  for a in extra:
    if a.startswith("--config.train.num_steps="):
      steps = a.split("=", 1)[1]
  try:
    return int(str(steps))  # an int or its digits; not 10.5, True or 'ten'
  except ValueError:
    raise SystemExit(f"error: train.num_steps={steps!r}; allowed: an int >= 1") from None


def is_finished(run_dir: str, steps: int) -> bool:
  """The run's final eval line (``cem_jax.metrics.has_final_eval``) and final checkpoint both
  exist."""
  from cem_jax import metrics  # REPO is on sys.path once the config is loaded

  # The step's folder as cem_jax.integrity.step_dir names it, not read from there: integrity
  # loads Orbax and jax (3 s), which a sweep of new runs never needs.
  if not os.path.isdir(os.path.join(run_dir, "checkpoints", str(steps))):
    return False
  try:
    return metrics.has_final_eval(run_dir, steps)
  except (OSError, ValueError) as e:  # a damaged metrics.jsonl: the run needs a look
    raise SystemExit(f"error: run {run_dir!r}: {e}") from e


def check_same_run(spec: str, run_dir: str, overrides: dict, extra: list[str]) -> None:
  """Refuses ``run_dir`` when it holds a checkpoint of a run started with a config other than
  the one this sweep gives it (``cem_jax.workdir.check_same_run``): the file's config, its
  overrides and ``EXTRA``'s ``--config.KEY=VALUE`` flags, parsed by ``main``'s own parser. A
  finished run of another config is then not skipped as this one, nor an unfinished one
  resumed as a mix of the two. Flags that do not parse are left to ``main`` to report.

  Raises:
    SystemExit: one line naming the run folder, the keys that differ and the fix.
  """
  if not os.path.isdir(os.path.join(run_dir, "checkpoints")):
    return  # nothing to resume or skip: spares the parse
  from cem_jax import energies, workdir

  config = run_config(spec, run_dir, overrides, extra)
  try:
    if config is None:
      return
    energies.absolute_paths(config.model)
  except Exception:  # noqa: BLE001 - main parses the same flags and reports them in one line
    return
  try:
    workdir.check_same_run(run_dir, config)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None


def run_config(spec: str, run_dir: str, overrides: dict, extra: list[str]):
  """The config ``main`` reads for a run: the file's, its overrides and ``EXTRA``'s
  ``--config.KEY=VALUE`` flags, parsed by ``main``'s own parser; None when they do not parse
  (``main`` reports that in one line)."""
  from absl import flags
  from ml_collections import config_flags

  argv = ["sweep", *(a for a in main_args(spec, run_dir, overrides, extra)
                     if a.startswith(("--config=", "--config.")))]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True,
                                  sys_argv=argv)
  try:
    values(argv)
    return values.config
  except Exception:  # noqa: BLE001 - main parses the same flags and reports them in one line
    return None


def check_configs(spec: str, workdir: str, runs: list[tuple[str, dict]],
                  extra: list[str]) -> None:
  """Refuses the sweep before its first run when a run's config breaks the config's own rules
  (``cem_jax.config.validate``, jax-free, as ``main`` checks first): a bad value in the 5th of
  5 runs failed only once the four before it had trained.

  Raises:
    SystemExit: one line naming the run and the field, its value and what is allowed.
  """
  from cem_jax import config as config_lib

  for name, overrides in runs:
    config = run_config(spec, os.path.join(workdir, name), overrides, extra)
    if config is None:
      continue
    try:
      config_lib.validate(config)
    except ValueError as e:
      raise SystemExit(f"error: run {name}: {e}; no run was started") from None


def main_args(config: str, run_dir: str, overrides: dict, extra: list[str]) -> list[str]:
  return [f"--config={config}", f"--workdir={run_dir}",
          *(f"--config.{k}={format_value(v)}" for k, v in overrides.items()), *extra]


@functools.cache
def _local():
  """``launch/local.py`` as a module (a script beside this one, not a package)."""
  spec = importlib.util.spec_from_file_location("launch_local", os.path.join(LAUNCH, "local.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _ended(code: int) -> str:
  """A run's Popen return code in words: a negative one is the signal that ended it."""
  return f"signal {-code}" if code < 0 else f"exit status {code}"


def run_one(cmd: list[str], env: dict) -> tuple[int, int | None]:
  """Runs one run's command to its end, passing SIGTERM and SIGINT on to it; the run gets
  SIGTERM if the sweep dies (``launch/local.py``'s ``dying_with_parent``).

  Returns:
    ``(exit status, the signal the sweep got while it ran, or None)``.
  """
  got, run, early = [], [], []

  def forward(signum, frame):
    del frame
    got.append(signum)
    if run:
      run[0].send_signal(signum)
    else:  # the run is not started yet: passed on once it is
      early.append(signum)

  # Installed before the run starts: a signal between its start and here ended the sweep
  # (SIGTERM) or raised KeyboardInterrupt in it (SIGINT) instead of reaching the run.
  previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    # Its own session: a terminal's Ctrl-C reaches the run once, passed on by the sweep.
    run.append(subprocess.Popen(_local().dying_with_parent(cmd, signal.SIGTERM), env=env,
                                start_new_session=True))
    # A signal handled from here on goes to the run from forward itself, not into early.
    for signum in early:
      run[0].send_signal(signum)
    return run[0].wait(), (got[0] if got else None)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def run_command(args: argparse.Namespace, mains: list[str], first: bool) -> list[str]:
  """The command that trains one run with the chosen launcher."""
  if args.launcher == "tpu_pod":
    pod = [sys.executable, os.path.join(LAUNCH, "tpu_pod.py"), f"--tpu={args.tpu}",
           f"--zone={args.zone}", *([f"--project={args.project}"] if args.project else [])]
    if not first:
      pod.append("--no_sync")  # the code and venv were set up before the first run
    return [*pod, "--", *mains]
  python = [sys.executable, "-m", "cem_jax.main", *mains]
  if args.num_processes > 1:
    return [sys.executable, os.path.join(LAUNCH, "local.py"),
            f"--num_processes={args.num_processes}",
            f"--devices_per_process={args.devices_per_process}", "--", *python]
  return python


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  own, after = options.split_at_dashes(argv)
  parser = options.script_parser(__doc__)
  parser.add_argument("--config", required=True, help="experiment file[:arg] with get_sweep()")
  parser.add_argument("--workdir", required=True, help="one sub-folder per run")
  parser.add_argument("--launcher", choices=("local", "tpu_pod"), default="local")
  parser.add_argument("--num_processes", type=int, default=1, help="local: processes per run")
  parser.add_argument("--devices_per_process", type=int, default=1,
                      help="local, several processes: forced CPU devices per process")
  parser.add_argument("--tpu", default="", help="tpu_pod: TPU VM name")
  parser.add_argument("--zone", default="", help="tpu_pod: zone")
  parser.add_argument("--project", default="", help="tpu_pod: project")
  parser.add_argument("--dry_run", action="store_true", help="print what would run")
  args = parser.parse_args(own)
  if args.launcher == "tpu_pod" and not (args.tpu and args.zone):
    parser.error("--launcher=tpu_pod needs --tpu=NAME and --zone=ZONE")
  if args.num_processes < 1:
    parser.error(f"--num_processes={args.num_processes}; allowed: an int >= 1")
  # Each launcher reads only its own options (run_command): another's would be ignored.
  if args.launcher == "local":
    for name in ("tpu", "zone", "project"):
      if getattr(args, name):
        parser.error(f"--{name}={getattr(args, name)!r} applies to --launcher=tpu_pod only; "
                     "leave it out with --launcher=local")
  else:
    for name in ("num_processes", "devices_per_process"):
      if getattr(args, name) != 1:
        parser.error(f"--{name}={getattr(args, name)} applies to --launcher=local only (a pod "
                     "runs one process per worker, on its own devices); leave it out")
  if args.devices_per_process < 1:
    parser.error(f"--devices_per_process={args.devices_per_process}; allowed: an int >= 1")
  if args.devices_per_process != 1 and args.num_processes == 1:
    # One process is a plain cem_jax.main, whose devices launch/local.py does not set.
    parser.error(f"--devices_per_process={args.devices_per_process} has no effect with "
                 "--num_processes=1 (one plain process on this machine's devices); allowed: 1, "
                 "or --num_processes >= 2")
  extra = after or []
  for flag in ("--workdir", "--config"):
    if any(a == flag or a.startswith(flag + "=") for a in extra):
      parser.error(f"{flag} after -- would give every run the same one; give it before --")
  for a in extra:
    if a.startswith("--config.") and "=" not in a:
      # The sweep reads train.num_steps and compares configs from KEY=VALUE words only: a
      # value in the next word was missed, and a run of the file's num_steps skipped as done.
      parser.error(f"{a} after -- without =VALUE; allowed: {a}=VALUE, one word")
  if args.launcher == "tpu_pod" and not os.path.isabs(args.workdir):
    parser.error(f"--workdir={args.workdir!r} with --launcher=tpu_pod; allowed: an absolute "
                 "path every worker sees (a shared mount): a relative one is a folder on each "
                 "worker's own disk")
  return args, extra


def check_extra(runs: list[tuple[str, dict]], extra: list[str]) -> None:
  """Refuses an ``EXTRA`` ``--config.KEY=VALUE`` for a key the sweep sets: coming after the
  run's own flag it would win, and every run would train with the one value under a name
  that says another.

  Raises:
    SystemExit: one line naming the flag and the runs that set the key.
  """
  for a in extra:
    if not a.startswith("--config."):
      continue
    key = a[len("--config."):].partition("=")[0]
    setting = [name for name, overrides in runs if key in overrides]
    if setting:
      raise SystemExit(f"error: {a} after -- overrides {key}, which get_sweep() sets per run "
                       f"({len(setting)} of {len(runs)} runs, e.g. {setting[0]!r}); allowed: "
                       "after --, only keys the sweep does not set")


def main(argv: list[str]) -> int:
  args, extra = parse_args(argv)
  module, arg = load_config_module(args.config)
  runs = expand(module, arg)
  check_extra(runs, extra)
  check_configs(args.config, args.workdir, runs, extra)
  failed, first = [], True
  for name, overrides in runs:
    run_dir = os.path.join(args.workdir, name)
    steps = num_steps(module, arg, overrides, extra)
    check_same_run(args.config, run_dir, overrides, extra)
    if is_finished(run_dir, steps):
      print(f"skip {name} (finished: step {steps})", flush=True)
      continue
    cmd = run_command(args, main_args(args.config, run_dir, overrides, extra), first)
    # On a pod the code is copied with the first run, and again with the run after a failed
    # one: that may have failed copying it (its exit status does not say which step failed).
    first = False
    print(("" if args.dry_run else "+ ") + shlex.join(cmd), flush=True)
    if args.dry_run:
      continue
    # Paths stay relative to the caller's folder; cem_jax imports even when not pip-installed.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p))
    code, got = run_one(cmd, env)
    if got is not None:
      print(f"launch/sweep.py: got signal {got}; run {name} stopped with {_ended(code)}, "
            "the sweep with it: run the same command to resume", file=sys.stderr)
      return 128 + got
    if code:
      print(f"launch/sweep.py: run {name} failed with {_ended(code)}", file=sys.stderr)
      failed.append(name)
      first = True
  if not args.dry_run:
    print(summary(args.workdir, [name for name, _ in runs]), flush=True)
  if failed:
    print(f"launch/sweep.py: {len(failed)} of {len(runs)} runs failed: {', '.join(failed)}",
          file=sys.stderr)
    return 1
  return 0


def summary(workdir: str, names: list[str]) -> str:
  """The sweep's runs as a Markdown table, best first: each run's best eval
  (``best_eval.json``: loss in nats/token, bits per byte, its step); a run without one (not
  evaluated yet, failed, or a ``WORKDIR`` this machine does not see) last, as n/a."""
  rows = []
  for name in names:
    try:
      with open(os.path.join(workdir, name, "best_eval.json"), encoding="utf-8") as f:
        best = json.load(f)
      row = (best["eval/best_loss"], best["eval/best_bits_per_byte"], best["eval/best_step"])
    except (OSError, ValueError, KeyError, TypeError):
      row = None
    if row is not None and not _is_eval(*row):
      # A damaged file (a string, a null, a NaN): n/a, not a TypeError after every run, nor
      # a NaN sorted wherever the sort left it.
      row = None
    rows.append((name, row))
  rows.sort(key=lambda r: (r[1] is None, r[1][0] if r[1] else 0.0))
  lines = ["| run | best eval loss | bits/byte | at step |", "|---|---:|---:|---:|"]
  for name, row in rows:
    lines.append(f"| {name} | n/a | n/a | n/a |" if row is None else
                 f"| {name} | {row[0]:.4f} | {row[1]:.4f} | {row[2]} |")
  return "\n".join(lines)


def _is_eval(loss, bits_per_byte, step) -> bool:
  """Whether ``best_eval.json``'s three values are what train writes: finite numbers, an int
  step."""
  numbers = all(isinstance(v, int | float) and not isinstance(v, bool)
                and np.isfinite(v) for v in (loss, bits_per_byte))
  return numbers and isinstance(step, int) and not isinstance(step, bool)


if __name__ == "__main__":
  import exits  # beside this script, which python runs with its folder first on sys.path
  exits.run(main)
