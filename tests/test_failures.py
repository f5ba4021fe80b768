"""Bad input and failing runs: one clear line, a non-zero exit, nothing misleading left behind.

Each case of the catalogue checks the message (field or file, value, fix), that it is one line,
and that a workdir that did not exist before is not left behind (so no ``config.json``,
``metrics.jsonl`` or ``checkpoints/`` can be mistaken for a run). A few go through the command
line; the rest call ``train_and_evaluate`` directly (the same code, without a new process).
Also here: the non-finite guard, and regression tests reduced from public bug reports.
"""

import collections
import errno
import importlib.util
import io
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from conftest import (
    RUN_MODULE_REPORTING_JAX,
    as_in_a_terminal,
    closed_port,
    program_json,
    quadrature_phi_silu,
    subprocess_env,
    tiny_config,
)
from flax import nnx
from ml_collections import config_flags

from cem_jax import (
    cli,
    energies,
    energy_checks,
    errors,
    integrity,
    memory,
    optim,
    preflight,
    runs,
    sharding,
    signals,
    steps,
    summary,
    train,
)
from cem_jax import config as config_lib
from cem_jax import data as data_lib
from cem_jax import workdir as workdir_lib
from cem_jax.checkpoint import Checkpointer
from cem_jax.data import pipeline
from cem_jax.metrics import read_metrics
from cem_jax.version import NUMERICS_VERSION

REPO = Path(__file__).resolve().parents[1]
CONFIG_FILE = """
from cem_jax.config import get_default_config


def get_config():
  return get_default_config()
"""


@pytest.fixture
def texts(tmp_path, shared_data) -> Path:
  folder = tmp_path / "texts"
  folder.mkdir()
  (folder / "empty.txt").write_text("\n   \n\n")
  (folder / "latin1.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
  (folder / "small.txt").write_text((shared_data / "tinyshakespeare.txt").read_text()[:3000])
  return folder


def _run_cli(args, env=None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "cem_jax.main", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def _last_line(proc) -> str:
  return proc.stderr.strip().splitlines()[-1]


def _assert_nothing_left(workdir: Path, existed: bool = False, prepared: bool = False) -> None:
  """No run in ``workdir``: a new one removed, but for the tokens its start prepared
  (``prepared``: kept for the next start, finished)."""
  if not existed and not prepared:
    assert not workdir.exists(), sorted(os.listdir(workdir))
    return
  if not existed:
    assert sorted(os.listdir(workdir)) == ["data"]
    (folder,) = (workdir / "data").iterdir()
    assert (folder / "manifest.json").is_file()
    return
  for name in ("config.json", "metrics.jsonl", "checkpoints"):
    assert not (workdir / name).exists(), name


# ---------------------------------------------------------------------------------------------
# Config: parse time.


def _parse(tmp_path, *args):
  """Parses flags as ``python -m cem_jax.main`` does; returns the resolved config."""
  path = tmp_path / "cfg.py"
  path.write_text(CONFIG_FILE)
  argv = ["prog", f"--config={path}", *args]
  values = flags.FlagValues()
  # The overrides are read from argv when --config is parsed (sys.argv by default).
  holder = config_flags.DEFINE_config_file("config", None, "", flag_values=values,
                                           lock_config=True, sys_argv=argv)
  values(argv)
  return holder.value


def test_python_m_cem_jax_train_is_refused_naming_main(tmp_path):
  """The loop's module run as a program trained nothing and ended with status 0, a finished
  run to a script (adv60): one line naming cem_jax.main, status 1, no workdir made."""
  workdir = tmp_path / "w"
  proc = subprocess.run(as_in_a_terminal([sys.executable, "-m", "cem_jax.train",
                                          "--config=experiments/tiny.py", f"--workdir={workdir}"]),
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr
  assert proc.stderr.strip().splitlines() == [
      "error: cem_jax.train is the training loop, not a program: train with python -m "
      "cem_jax.main --config=FILE --workdir=DIR (README, 'Run a config')"]
  assert not workdir.exists()


def test_every_config_field_is_overridable_from_the_command_line(tmp_path):
  """No field defaults to None (ml_collections cannot parse a value for a None field): an
  'unset' field has a typed sentinel ('' or -1), so it can still be set on the command line."""
  flat = config_lib.get_default_config().to_dict()

  def leaves(d, prefix=""):
    for k, v in d.items():
      yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]

  assert [k for k, v in leaves(flat) if v is None] == []
  cfg = _parse(tmp_path, "--config.data.tokenizer=/some/spm.model", "--config.eval.num_steps=3",
               "--config.mesh.data=2", "--config.data.files=a.txt,b.txt")
  assert (cfg.data.tokenizer, cfg.eval.num_steps, cfg.mesh.data) == ("/some/spm.model", 3, 2)
  assert cfg.data.files == "a.txt,b.txt"


@pytest.mark.parametrize("arg, field", [("--config.train.num_steps=ten", "num_steps"),
                                        ("--config.train.batch_size=1.5", "batch_size"),
                                        ("--config.model.rope=maybe", "rope"),
                                        ("--config.train.numsteps=10", "numsteps")])
def test_config_typos_and_wrong_types_fail_at_parse_time(tmp_path, arg, field):
  # A typo surfaces as ml_collections' AttributeError; main.py turns it into one line.
  with pytest.raises((flags.Error, AttributeError), match=field):
    _parse(tmp_path, arg)


@pytest.mark.parametrize("arg, expected", [
    ("--config.train.batch_size=eight",
     "error: --config.train.batch_size=eight; allowed: an integer"),
    ("--config.train.batchsize=8",
     "error: --config.train.batchsize: the config has no field 'batchsize'; did you mean "
     "--config.train.batch_size?"),
    ("--config=experiments/nope.py",
     "error: --config=experiments/nope.py: cannot load it ([Errno 2] No such file or directory: "
     "'experiments/nope.py'); paths are relative to the working directory"),
    ("--config=experiments/tiny:llama",  # the .py left out
     "error: --config=experiments/tiny:llama: cannot load it ([Errno 2] No such file or "
     "directory: 'experiments/tiny'); did you mean experiments/tiny.py? paths are relative to "
     "the working directory"),
    ("--config=experiments/tiny.py:gpt",
     "error: experiments/tiny.py:gpt; allowed args: cem, llama"),
])
def test_cli_config_errors_exit_before_anything_is_written(tmp_path, arg, expected):
  (tmp_path / "cfg.py").write_text(CONFIG_FILE)
  config = [] if arg.startswith("--config=") else [f"--config={tmp_path / 'cfg.py'}"]
  proc = _run_cli([*config, f"--workdir={tmp_path / 'w'}", arg])
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [expected]  # one line, said once
  _assert_nothing_left(tmp_path / "w")


@pytest.mark.parametrize("body,args,expected", [
    ("def get_config():\n  return undefined_name\n", [],
     "name 'undefined_name' is not defined"),
    ("def get_config(:\n  pass\n", [], "invalid syntax (cfg.py, line 1)"),
    ("import no_such_module\n", [], "No module named 'no_such_module'"),
    ("def get_config():\n  return {'model': {}}\n", [],
     "get_config() returned a dict; allowed: an ml_collections.ConfigDict (e.g. "
     "cem_jax.config.get_default_config() with your changes)"),
    (None, ["--config.model.num_layers=2"], "[Errno 2] No such file or directory: "),
])
def test_a_config_file_that_cannot_run_is_one_line_with_or_without_overrides(tmp_path, body,
                                                                             args, expected):
  path = tmp_path / "cfg.py"
  if body is not None:
    path.write_text(body)
  proc = _run_cli([f"--config={path}", f"--workdir={tmp_path / 'w'}", *args])
  assert proc.returncode == 1
  (line,) = proc.stderr.strip().splitlines()  # no traceback
  assert line.startswith("error: ") and str(path) in line and expected in line, line
  assert line.count(str(path)) == 1, line  # named once: not again before a message naming it
  _assert_nothing_left(tmp_path / "w")


def test_a_config_file_given_with_one_dash_that_cannot_run_is_one_line(tmp_path):
  # absl reads -config=FILE as --config=FILE: its failure is named the same way.
  path = tmp_path / "cfg.py"
  path.write_text("def get_config():\n  return undefined_name\n")
  proc = _run_cli([f"-config={path}", f"--workdir={tmp_path / 'w'}"])
  assert proc.returncode == 1
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith("error: ") and str(path) in line, line
  assert "name 'undefined_name' is not defined" in line, line


def test_a_misspelt_override_is_named_wherever_it_stands_on_the_command_line():
  config = config_lib.get_default_config()
  for argv in (["main.py", "--config.trian.num_steps=5", "--config=c.py"],
               ["main.py", "--config=c.py", "--workdir=w", "--config.trian.num_steps=5"]):
    assert cli._unknown_override(config, argv) == (
        "--config.trian.num_steps: the config has no field 'trian'; did you mean 'train'?")
  assert cli._unknown_override(config, ["main.py", "--config.seed.x=1"]) == (
      "--config.seed.x: the config has no field 'x'; config.seed is a value, not a group")
  for arg in ("-config.model.rop=1", "--noconfig.model.rop"):  # absl's other spellings
    assert cli._unknown_override(config, ["main.py", arg]) == (
        f"{arg.split('=')[0]}: the config has no field 'rop'; did you mean "
        "--config.model.rope or --config.model.rope_theta?")
  assert cli._unknown_override(config, ["main.py", "--config.train.lr=1"]) == (
      "--config.train.lr: the config has no field 'lr'; did you mean "
      "--config.train.learning_rate?")
  assert cli._unknown_override(config, ["main.py", "--config.train.batch=1"]) == (
      "--config.train.batch: the config has no field 'batch'; did you mean "
      "--config.train.batch_size?")
  assert cli._unknown_override(config, ["main.py", "--config.train.warm=1"]) == (  # no difflib
      "--config.train.warm: the config has no field 'warm'; did you mean "
      "--config.train.warmup_steps?")
  # The field in another group, or without its group, as tables --set suggests it.
  assert cli._unknown_override(config, ["main.py", "--config.model.warmup_steps=1"]) == (
      "--config.model.warmup_steps: the config has no field 'warmup_steps'; did you mean "
      "--config.train.warmup_steps or --config.model.num_steps or --config.model.norm_eps?")
  assert cli._unknown_override(config, ["main.py", "--config.lr=1"]) == (
      "--config.lr: the config has no field 'lr'; did you mean --config.train.learning_rate?")
  assert cli._unknown_override(config, ["main.py", "--config.train.qqqq=1"]) == (
      "--config.train.qqqq: the config has no field 'qqqq'; see cem_jax/config.py for the "
      "fields")  # nothing close to suggest


def test_an_override_of_the_wrong_type_says_what_is_allowed():
  # absl's own words were Python's: "invalid literal for int() with base 10: 'abc'", or a
  # tuple for a bool.
  config = config_lib.get_default_config()
  cases = {"--config.train.num_steps=abc": "an integer",
           "--config.train.num_steps=10.5": "an integer",
           "--config.model.num_heads=": "an integer",
           "--config.train.learning_rate=fast": "a number",
           "--config.model.rope=maybe": "true or false"}
  for arg, allowed in cases.items():
    argv = ["main.py", "--config=c.py", "--config.seed=3", arg, "--config.train.num_steps=5"]
    assert cli._unparsable_override(config, argv) == f"{arg}; allowed: {allowed}"
  for arg in ("--config.train.num_steps=7", "--config.train.learning_rate=3",
              "--config.model.rope=false", "--config.data.files=abc", "--config.trian.x=1",
              "--noconfig.model.rope", "-config.seed=2", "--config.data.files=a=b"):
    assert cli._unparsable_override(config, ["main.py", arg]) is None, arg
  # absl's other spellings: one dash, and --noconfig.KEY for a bool (which takes no value).
  assert cli._unparsable_override(config, ["main.py", "-config.train.num_steps=abc"]) == (
      "-config.train.num_steps=abc; allowed: an integer")
  for arg in ("--noconfig.model.rope=1", "--noconfig.train.num_steps"):
    key = arg.split("=")[0][len("--noconfig."):]
    assert cli._unparsable_override(config, ["main.py", arg]) == (
        f"{arg}; allowed: --noconfig.KEY alone, for a field that is true or false "
        f"(--config.{key}=VALUE sets any field)")


def test_a_config_that_is_not_a_python_file_is_one_line(tmp_path):
  # A run's config.json as --config: ml_collections finds no loader for it, and the message
  # was "'NoneType' object has no attribute 'loader'".
  path = tmp_path / "config.json"
  path.write_text(config_lib.get_default_config().to_json())
  proc = _run_cli([f"--config={path}", f"--workdir={tmp_path / 'w'}",
                   "--config.train.num_steps=abc"])
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      f"error: --config={path}: not a Python file; allowed: a .py file whose get_config() "
      "returns the config (e.g. experiments/tiny.py), optionally with :ARG for get_config(ARG)"]
  _assert_nothing_left(tmp_path / "w")


def test_a_config_file_without_get_config_or_given_an_empty_arg_is_one_line(tmp_path):
  # A script of experiments/ (collapse.py) as --config named "module 'cem_jax_cli_config'";
  # tiny.py: (an empty ARG) was ml_collections' "Error whilst parsing config file:", cut there.
  path = tmp_path / "script.py"
  path.write_text("X = 1\n")
  assert cli._run_config_file(str(path)) == (None, (
      f"--config={path}: defines no get_config(); allowed: a .py file whose get_config() "
      "returns the config (e.g. experiments/tiny.py)"))
  tiny = os.path.join(REPO, "experiments", "tiny.py")
  config, cause = cli._run_config_file(f"{tiny}:")
  assert config is None and cause.endswith("experiments/tiny.py:; allowed args: cem, llama")
  assert cli._run_config_file(tiny)[0].model.block == "cem"


def test_library_info_records_are_dropped_and_ours_and_their_warnings_kept():
  rec = lambda path, level: logging.LogRecord("x", level, path, 1, "m", None, None)  # noqa: E731
  quiet = cli.QuietLibraries(logging.WARNING)
  assert not quiet.filter(rec("/site-packages/orbax/checkpoint/x.py", logging.INFO))
  assert not quiet.filter(rec("/site-packages/tensorflow_datasets/core/x.py", logging.INFO))
  assert quiet.filter(rec("/site-packages/orbax/checkpoint/x.py", logging.WARNING))
  assert quiet.filter(rec("/repo/cem_jax/train.py", logging.INFO))


def test_quiet_libraries_filters_what_absl_writes(monkeypatch):
  # Records pass absl's handler, then the inner one that writes them; which of the two runs
  # filters differs between absl versions: installed on both, the library INFO lines never
  # come out whichever it is, and warnings and our own INFO lines do.
  from absl import logging as absl_logging

  handler = absl_logging.get_absl_handler()
  for h in (handler, handler.python_handler):
    monkeypatch.setattr(h, "filters", list(h.filters))  # the filters installed here go again
  written = []
  monkeypatch.setattr(handler.python_handler, "emit", lambda r: written.append(r.getMessage()))
  cli.quiet_libraries()
  for path, level, message in [("/site-packages/orbax/checkpoint/x.py", logging.INFO, "o-info"),
                               ("/site-packages/orbax/checkpoint/x.py", logging.WARNING, "o-warn"),
                               ("/repo/cem_jax/train.py", logging.INFO, "our-info")]:
    handler.handle(logging.LogRecord("x", level, path, 1, message, None, None))
  assert written == ["o-warn", "our-info"]


def test_a_library_error_is_one_line_without_its_traceback(monkeypatch):
  # A full disk during an asynchronous save: each of Orbax's threads logs an ERROR with its
  # traceback (about 300 lines before the run's one-line "error: ..."). Kept, one line each,
  # with the exception's type and first line; our own records keep their tracebacks.
  import sys

  from absl import logging as absl_logging

  handler = absl_logging.get_absl_handler()
  for h in (handler, handler.python_handler):
    monkeypatch.setattr(h, "filters", list(h.filters))
  written = []
  monkeypatch.setattr(handler.python_handler, "emit",
                      lambda r: written.append(handler.python_handler.format(r)))
  cli.quiet_libraries()
  try:
    raise ValueError("RESOURCE_EXHAUSTED: Error writing\n  more detail")
  except ValueError:
    exc_info = sys.exc_info()
  for path in ("/site-packages/orbax/checkpoint/_src/futures/future.py",
               "/repo/cem_jax/train.py"):
    handler.handle(logging.LogRecord("x", logging.ERROR, path, 1, "thread %s failed",
                                     ("save",), exc_info))
  orbax, ours = written
  assert orbax.endswith("thread save failed [ValueError: RESOURCE_EXHAUSTED: Error writing]")
  assert "\n" not in orbax and "Traceback" not in orbax
  assert "Traceback" in ours


def test_an_aborted_run_reports_what_its_close_fails_with_in_one_line_and_raises_nothing(
    caplog):
  # A full disk stops the run (the error it re-raises); the pending save and the metrics'
  # close then fail too: one line each, no traceback, and neither replaces the first error.
  import types

  def fail(error):
    def close():
      raise error
    return close

  loop = types.SimpleNamespace(
      done=3, save_left=False, profiler=types.SimpleNamespace(stop=lambda done: None),
      run=types.SimpleNamespace(ckpt=types.SimpleNamespace(close=fail(ValueError(
          "RESOURCE_EXHAUSTED: Error writing\n  at ...")))),
      writer=types.SimpleNamespace(path="/w/metrics.jsonl", close=fail(OSError(
          28, "No space left on device", "/w/tensorboard"))))
  with caplog.at_level(logging.ERROR):
    train._Loop.abort(loop)
  assert [(r.getMessage(), r.exc_info) for r in caplog.records] == [
      ("could not finish the pending checkpoint save: ValueError: RESOURCE_EXHAUSTED: Error "
       "writing", None),
      ("could not close the metrics of /w: OSError: [Errno 28] No space left on device: "
       "'/w/tensorboard'", None)]


def test_one_line_of_a_cause_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
  # A config file's exception can span lines (a chained message, a note): its last line says
  # what went wrong; one without a message is named by its type.
  assert errors.last_line(ValueError("while loading:\n\n  x must be > 0  \n")) == "x must be > 0"
  assert errors.last_line(KeyError()) == "KeyError"
  # Neither a config file nor a misspelt field failed: a bug, shown with its traceback.
  def bug(argv):
    raise RuntimeError("a bug")

  monkeypatch.setattr(cli.flags, "FLAGS", bug)
  with pytest.raises(RuntimeError, match="^a bug$"):
    cli.parse_flags(["prog", "--workdir=w"])
  assert capsys.readouterr().err == ""


def test_validation_names_field_value_and_what_is_allowed():
  cfg = tiny_config("cem")
  cfg.mesh.data = 0
  with pytest.raises(ValueError, match=r"^mesh\.data=0; allowed: -1 \(the devices left over\) "
                                       r"or an int >= 1$"):
    preflight.check(cfg)
  cfg = tiny_config("cem", **{"checkpoint.keep": 0})
  with pytest.raises(ValueError, match=r"^checkpoint\.keep=0; allowed: an int >= 1$"):
    preflight.check(cfg)
  cfg = tiny_config("cem", **{"eval.max_batches": 0})
  with pytest.raises(ValueError, match=r"^eval\.max_batches=0; allowed: -1 \(the whole split\) "
                                       r"or an int >= 1$"):
    preflight.check(cfg)
  cfg = tiny_config("cem", **{"mesh.fsdp": -1})  # mesh.data is -1 by default
  with pytest.raises(ValueError, match=r"^mesh\.data=-1 and mesh\.fsdp=-1: at most one mesh "
                                       r"size may be -1"):
    preflight.check(cfg)
  preflight.check(tiny_config("cem", **{"mesh.fsdp": -1, "mesh.data": 1}))


@pytest.mark.parametrize("tool, args, expected", [
    ("evaluate", ["--num_steps="],
     "error: --num_steps=; allowed: comma-separated values, each an int >= 1 and < 2**8 "
     "(every step is unrolled into the compiled program) and at most once"),
    ("evaluate", ["--num_steps=1,0"],
     "error: --num_steps=1,0; allowed: comma-separated values, each an int >= 1 and < 2**8 "
     "(every step is unrolled into the compiled program) and at most once"),
    ("evaluate", ["--num_steps=1,2,1"],  # else T = 1 evaluated twice, two equal rows
     "error: --num_steps=1,2,1; allowed: comma-separated values, each an int >= 1 and < 2**8 "
     "(every step is unrolled into the compiled program) and at most once"),
    ("evaluate", ["--max_batches=0"],
     "error: --max_batches=0; allowed: -1 (the whole split) or an int >= 1"),
    ("sample", ["--prompt="], "error: --prompt is empty; give at least one character"),
    ("sample", ["--prompt=The", "--temperature=nan"],
     "error: --temperature=nan; allowed: 0 (greedy) or a finite number > 0"),
    ("sample", ["--prompt=The", "--temperature=inf"],
     "error: --temperature=inf; allowed: 0 (greedy) or a finite number > 0"),
    ("sample", ["--prompt=The", "--top_k=-3"],
     "error: --top_k=-3; allowed: 0 (off) or 1..vocab_size"),
    ("sample", ["--prompt=The", "--temperature=0", "--top_k=3"],
     "error: --top_k=3 --top_p=1.0 have no effect with --temperature=0 (greedy); leave them at "
     "0 and 1"),
    ("sample", ["--prompt=The", "--temperature=0", "--seed=7"],
     "error: --seed=7 has no effect with --temperature=0 (greedy): the most likely token is "
     "taken; leave --seed out"),
])
def test_tool_flags_are_checked_before_the_run_is_loaded(tmp_path, tool, args, expected):
  # The workdir does not exist: the flag error must come first, alone, on one line, and
  # before jax or flax is imported (jax's start-up took 4 s of CPU; the error 0.3 s).
  # Mutation: sample importing jax at its top again printed '1 ['jax']' for its cases.
  proc = subprocess.run([sys.executable, "-c", RUN_MODULE_REPORTING_JAX, f"cem_jax.{tool}",
                         f"--workdir={tmp_path / 'nothing'}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert proc.stdout.strip() == "1 []", proc.stdout[-2000:] + proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [expected]


@pytest.mark.parametrize("message, want, first, last", [
    ("RESOURCE_EXHAUSTED: 2 GiB\n  at op 7\n", "ValueError: RESOURCE_EXHAUSTED: 2 GiB",
     "RESOURCE_EXHAUSTED: 2 GiB", "at op 7"),
    ("\n   \n  first real line  \nsecond\n \n", "ValueError: first real line", "first real line",
     "second"),
    ("", "ValueError", "ValueError", "ValueError"),
    (" \n\t\n", "ValueError", "ValueError", "ValueError"),
])
def test_an_exception_is_quoted_as_its_type_and_first_non_blank_line(message, want, first, last):
  """What every log line and start-up error quotes of a library's many-line error; an empty
  message (which `str(e).splitlines()[0]` would turn into an IndexError) gives the type."""
  assert errors.one_line(ValueError(message)) == want
  assert errors.first_line(ValueError(message)) == first
  assert errors.last_line(ValueError(message)) == last


def test_user_errors_reports_bad_input_on_one_line_and_keeps_bugs(capsys):
  # Every program wraps its work in cli.user_errors: no network for a TFDS catalog dataset is
  # a ConnectionError (an OSError), a diverged run a FloatingPointError where asked for.
  for error, also in [(ConnectionError("data.tfds_name='lm1b' is not prepared"), ()),
                      (FileNotFoundError("--workdir=/x: no checkpoint"), ()),
                      (FloatingPointError("loss is nan at step 3"), (FloatingPointError,))]:
    with pytest.raises(SystemExit) as info:
      with cli.user_errors(*also):
        raise error
    assert info.value.code == 1
    assert capsys.readouterr().err == f"error: {error}\n"
  for bug, also in [(RuntimeError("a bug"), ()), (FloatingPointError("a bug"), ())]:
    with pytest.raises(type(bug)):
      with cli.user_errors(*also):
        raise bug


def test_ctrl_c_is_one_line_and_still_ends_the_process_by_sigint():
  # The exit status stays Python's for Ctrl-C (death by SIGINT after cleanup): launch/sweep.py
  # and launch/local.py read it. Only the KeyboardInterrupt's traceback goes.
  # The interpreter's teardown is skipped (a Ctrl-C landing in XLA's compile crashed it with a
  # segfault, status 139): an object's finalizer that teardown would run does not.
  code = textwrap.dedent("""
      import atexit, sys
      from cem_jax import cli

      class Torn:
        def __del__(self):
          print("torn down", file=sys.stderr)

      kept = Torn()
      atexit.register(lambda: print("cleanup ran", file=sys.stderr))
      with cli.interrupted("what to do now"):
        print("written before")  # buffered (a pipe): flushed, though teardown is skipped
        try:
          raise KeyboardInterrupt
        finally:
          print("finally ran", file=sys.stderr)
  """)
  buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                        text=True, timeout=120, env=buffered)
  assert proc.returncode == -signal.SIGINT
  assert proc.stderr == "finally ran\ninterrupted (Ctrl-C): what to do now\ncleanup ran\n"
  assert proc.stdout == "written before\n"
  bug = subprocess.run([sys.executable, "-c", code.replace("raise KeyboardInterrupt",
                                                           "raise RuntimeError('a bug')")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
  assert bug.returncode == 1 and "Traceback" in bug.stderr and "interrupted" not in bug.stderr


_DROPPED_CTRL_C = """
import gc, signal, sys, time, weakref
from cem_jax import cli

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
def landing(*_):
  signal.raise_signal(signal.SIGINT)  # handled here, where Python drops what is raised
def failing(*_):
  raise RuntimeError("a bug in a callback")
class O:
  pass
class Landing:
  def __del__(self):
    landing()
sent = []
def collecting(phase, info):
  if phase == "start" and not sent:
    sent.append(1)
    landing()
with cli.interrupted("what to do now"):
  o = O(); keep = weakref.ref(o, failing); del o
  print("went on after the bug", file=sys.stderr)
  WHERE
  for _ in range(LOOPS):  # 5 s: the Ctrl-C comes back within a tenth of that
    time.sleep(0.01)
time.sleep(2)
print("went on", file=sys.stderr)
"""


@pytest.mark.parametrize("where,loops", [
    ("gc.callbacks.append(collecting); gc.collect()", 500),  # jax has one, run at every collection
    ("o = O(); keep = weakref.ref(o, landing); del o", 500),  # jax caches on weak references
    ("o = O(); keep = weakref.finalize(o, landing, 0); del o", 500),
    ("o = Landing(); del o", 0),  # a __del__ as the block ends
])
def test_a_ctrl_c_that_python_drops_still_stops_the_program_in_one_line(where, loops):
  # Python runs its Ctrl-C handler wherever the main thread is, also where it prints what is
  # raised as "Exception ignored in ..." and goes on: a run whose data was being prepared
  # trained to its end (3 Ctrl-Cs of 3 landed in jax's gc callback). It must stop the program
  # as any Ctrl-C does, also one dropped as the block ends (sent again 50 ms later, it came
  # after the hook before was back: a traceback). Another exception there is still reported by
  # the hook before, and the program goes on.
  code = _DROPPED_CTRL_C.replace("WHERE", where).replace("LOOPS", str(loops))
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == -signal.SIGINT, proc.stderr[-2000:]
  assert proc.stderr.endswith("went on after the bug\ninterrupted (Ctrl-C): what to do now\n")
  assert "RuntimeError: a bug in a callback" in proc.stderr
  assert "KeyboardInterrupt" not in proc.stderr


def test_interrupted_puts_back_the_handlers_it_replaced_also_nested(monkeypatch):
  from cem_jax import cli

  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  old = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    hook = sys.unraisablehook
    with cli.interrupted("outer"):
      # Python's Ctrl-C handler stays; the hook where Python drops exceptions is replaced.
      assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
      outer = sys.unraisablehook
      assert outer is not hook
      with cli.interrupted("inner"):  # nested: its own, the outer one's back after it
        assert sys.unraisablehook not in (hook, outer)
      assert sys.unraisablehook is outer
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert sys.unraisablehook is hook
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's: left alone
    with cli.interrupted("ignored"):
      assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and sys.unraisablehook is hook
  finally:
    signal.signal(signal.SIGINT, old)


# ---------------------------------------------------------------------------------------------
# Data and workdir: start-up, through train_and_evaluate.


def _data_case(name, texts: Path):
  """(config overrides, exception type, regex of the message) of catalogue case ``name``."""
  return {
      "empty corpus": ({"data.files": str(texts / "empty.txt")}, ValueError,
                       r"^data\.files: the corpus is empty .*empty\.txt; point data\.files at "),
      "not UTF-8": ({"data.files": str(texts / "latin1.txt")}, ValueError,
                    r"latin1\.txt: not UTF-8 text: byte 0xe9 at byte offset 3 .*; convert the "
                    r"file to UTF-8$"),
      "vocab too large": ({"data.files": str(texts / "small.txt"), "data.vocab_size": 5000},
                          ValueError, r"^data\.vocab_size=5000 is too large for this training "
                                      r"text .*: the maximum allowed is \d+$"),
      "seq_len too long": ({"data.files": str(texts / "small.txt"), "data.vocab_size": 400,
                            "data.seq_len": 5000}, ValueError,
                           r"^data\.seq_len=5000 is too long for the train split: .*; lower "
                           r"data\.seq_len or use more text$"),
      "missing tokenizer": ({"data.tokenizer": str(texts / "nope.model")}, FileNotFoundError,
                            r"^data\.tokenizer='.*nope\.model': no such file; give a "
                            r"SentencePiece \.model file, or data\.tokenizer='' to train one$"),
      "glob matches nothing": ({"data.files": str(texts / "missing*.txt")}, ValueError,
                               r"^data\.files: glob '.*missing\*\.txt' matches no file$"),
  }[name]


@pytest.mark.parametrize("name", ["empty corpus", "not UTF-8", "vocab too large",
                                  "seq_len too long", "missing tokenizer",
                                  "glob matches nothing"])
@pytest.mark.parametrize("existed", [False, True], ids=["new workdir", "existing workdir"])
def test_bad_data_is_one_line_and_leaves_no_run(name, existed, texts, tmp_path):
  overrides, error, pattern = _data_case(name, texts)
  workdir = tmp_path / "w"
  if existed:
    workdir.mkdir()
  with pytest.raises(error, match=pattern) as e:
    train.train_and_evaluate(tiny_config("llama", **overrides), str(workdir))
  assert "\n" not in str(e.value)
  _assert_nothing_left(workdir, existed, prepared=name == "seq_len too long")


@pytest.mark.parametrize("existed", [False, True], ids=["new workdir", "existing workdir"])
def test_a_start_failing_after_start_up_closes_the_checkpoints_and_leaves_no_run(
    existed, tmp_path, monkeypatch):
  # Opening metrics.jsonl comes after _start_up: a full disk there must undo the start too.
  closed = []
  close = Checkpointer.close
  monkeypatch.setattr(Checkpointer, "close", lambda self: (closed.append(self), close(self))[1])

  def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(train, "MetricsWriter", full_disk)
  workdir = tmp_path / "w"
  if existed:
    workdir.mkdir()
  with pytest.raises(OSError, match="No space left on device"):
    train.train_and_evaluate(tiny_config("llama", **{"train.num_steps": 2}), str(workdir))
  assert len(closed) == 1
  _assert_nothing_left(workdir, existed, prepared=True)


@pytest.fixture
def sigterm_kills():
  """SIGTERM's default action (the process killed) stood in for, without killing pytest, by a
  handler that raises; the handler before is put back after the test. Yields that handler."""

  class Killed(Exception):
    pass

  def default_action(signum, frame):
    raise Killed

  previous = signal.signal(signal.SIGTERM, default_action)
  yield default_action
  signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_while_the_last_save_commits_lets_it_commit_and_the_run_end(tmp_path,
                                                                          monkeypatch,
                                                                          sigterm_kills):
  # The last step's save is asynchronous: the loop ends, then close() waits for it. A SIGTERM
  # there (a preemption notice) must not kill the run with that save half written (the
  # default action, outside the loop's SIGTERM flag): the save commits, the run returns.
  close = Checkpointer.close

  def close_after_sigterm(self):
    signal.raise_signal(signal.SIGTERM)
    close(self)

  monkeypatch.setattr(Checkpointer, "close", close_after_sigterm)
  final = train.train_and_evaluate(tiny_config("llama", **{"train.num_steps": 2}),
                                   str(tmp_path / "w"))
  assert "eval/loss" in final
  monkeypatch.setattr(Checkpointer, "close", close)
  ckpt = Checkpointer(str(tmp_path / "w" / "checkpoints"))
  assert ckpt.restorable_step() == 2 and ckpt.verify(2) == []
  ckpt.close()


def test_a_ctrl_c_while_the_last_save_commits_stops_the_run_after_it_without_a_failure(
    tmp_path, monkeypatch, caplog):
  # The loop has ended; close waits in Orbax for the last save's commit. A Ctrl-C landing
  # there was reported as the save failing (Orbax's "Save Finalize thread ... failed", with a
  # KeyboardInterrupt traceback), and Orbax dropped the step from its list. Held until the
  # commit, it stops the run after it. Deterministic: the commit waits until the run waits
  # for it, and the Ctrl-C comes as the run's wait begins, sent to the thread that joins Orbax's
  # for the main one (signals.Calls), where the kernel may deliver a process's signal.
  import threading

  waiting, armed, sent = threading.Event(), [], []
  write_digest, join, close = Checkpointer._write_digest, threading.Thread.join, Checkpointer.close

  def digest_when_waited_for(self):  # Orbax's finalize thread, after the commit
    waiting.wait(timeout=60)
    write_digest(self)

  def armed_close(self):
    armed.append(True)
    close(self)

  def ctrl_c_then_join(self, *args, **kwargs):
    if armed and not sent and threading.current_thread().name == "cem_jax.checkpoint wait":
      sent.append(self.name)
      waiting.set()
      signal.raise_signal(signal.SIGINT)
    return join(self, *args, **kwargs)

  monkeypatch.setattr(Checkpointer, "_write_digest", digest_when_waited_for)
  monkeypatch.setattr(Checkpointer, "close", armed_close)
  monkeypatch.setattr(threading.Thread, "join", ctrl_c_then_join)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
  try:
    with caplog.at_level(logging.ERROR), pytest.raises(KeyboardInterrupt):
      train.train_and_evaluate(tiny_config("llama", **{"train.num_steps": 2}),
                               str(tmp_path / "w"))
  finally:
    signal.signal(signal.SIGINT, previous)
    waiting.set()
  assert sent == ["save_finalize"], sent  # Orbax's thread, the run's wait for its last save
  assert [r.getMessage() for r in caplog.records] == []
  monkeypatch.setattr(Checkpointer, "_write_digest", write_digest)
  monkeypatch.setattr(Checkpointer, "close", close)
  ckpt = Checkpointer(str(tmp_path / "w" / "checkpoints"))
  assert ckpt.restorable_step() == 2 and ckpt.verify(2) == []
  ckpt.close()


# main training steps 1..FINAL, saving each and keeping one. The moment a thread other than the
# main one (Orbax's finalize thread, after the last save's commit) has made step FINAL - 1 stop
# being intact (a file of it removed, or the folder moved), that thread sends Ctrl-C again and
# again, as a user pressing it while the run seems stuck, and goes no further: the deletion is
# cut there when the process ends. SIGINT and SIGTERM at a terminal's dispositions (CI runs
# under nohup).
_CTRL_C_WHILE_AN_OLD_STEP_GOES = """
import os, runpy, signal, sys, threading, time
from cem_jax import integrity

signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
checkpoints, final = os.path.realpath(sys.argv[1]), int(sys.argv[2])
cut = []

def cutting(fn):
  def call(path, *args, **kwargs):
    out = fn(path, *args, **kwargs)
    if (not cut and threading.current_thread() is not threading.main_thread()
        and os.path.isdir(checkpoints) and integrity.verify(checkpoints, final - 1)
        and integrity.verify(checkpoints, final) == []):
      cut.append(fn.__name__)
      print("cut after", fn.__name__, file=sys.stderr, flush=True)
      for _ in range(600):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
    return out
  return call

for name in ("unlink", "remove", "rmdir", "rename", "replace"):
  setattr(os, name, cutting(getattr(os, name)))
sys.argv = ["main", *sys.argv[3:]]
runpy.run_module("cem_jax.main", run_name="__main__")
"""


def _tiny_llama_main_args(workdir, *more: str) -> list[str]:
  """``cem_jax.main``'s flags for a 1-layer Llama on pydoc (seconds a step on CPU), then
  ``more``."""
  return [f"--workdir={workdir}", "--config=experiments/tiny.py:llama",
          "--config.model.d_model=32", "--config.model.mlp_dim=64",
          "--config.model.num_layers=1", "--config.model.num_heads=2",
          "--config.data.seq_len=32", "--config.data.vocab_size=512",
          "--config.data.builtin=pydoc", "--config.train.batch_size=4",
          "--config.eval.max_batches=2", *more]


def test_ctrl_c_while_orbax_removes_an_old_step_leaves_only_whole_steps_and_resumes(tmp_path):
  # Orbax removes the steps past checkpoint.keep file by file in its finalize thread, after the
  # last save's commit. A second Ctrl-C there (the first is held: signals.held) left a step
  # folder half deleted, still listed as a finished step: Python 3.11's Thread.join,
  # interrupted, takes the thread for finished, so the abort's wait returned at once and the
  # process ended with the removal cut. Orbax now moves the step out of the listing in one
  # rename (checkpoint.DELETING_DIR) before removing it. Fails with todelete_subdir dropped.
  workdir = tmp_path / "w"
  args = _tiny_llama_main_args(workdir, "--config.train.eval_every_steps=3",
                               "--config.checkpoint.every_steps=1", "--config.checkpoint.keep=1")
  proc = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_AN_OLD_STEP_GOES,
                         str(workdir / "checkpoints"), "3", *args,
                         "--config.train.num_steps=3"],
                        cwd=REPO, env=subprocess_env(1), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == -signal.SIGINT, proc.stderr[-3000:]
  assert "\ncut after " in proc.stderr, proc.stderr[-3000:]
  reader = Checkpointer(str(workdir / "checkpoints"), read_only=True)
  listed = reader.all_steps()
  reader.close()
  assert 3 in listed
  assert {step: integrity.verify(str(workdir / "checkpoints"), step) for step in listed} == {
      step: [] for step in listed}
  # The same command, two steps more: resumed from step 3, nothing found damaged, and what
  # Orbax let go is removed.
  again = subprocess.run([sys.executable, "-m", "cem_jax.main", *args,
                          "--config.train.num_steps=5"],
                         cwd=REPO, env=subprocess_env(1), capture_output=True, text=True,
                         timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "resumed from " + str(workdir / "checkpoints" / "3") in again.stderr
  assert "damaged" not in again.stderr
  assert sorted(os.listdir(workdir / "checkpoints")) == ["5", "digests"]
  assert [m["step"] for m in read_metrics(str(workdir)) if "eval/loss" in m] == [3, 5]


# main training steps 1..2 whose last save never commits: the digest hook (Orbax's finalize
# thread, before the commit) hangs, as on a disk that stopped answering, after it has sent
# Ctrl-C twice, either to the process, as a terminal sends it, or to its own thread
# (pthread_kill), where the kernel may deliver a process's signal. No fixed sleeps, which a
# loaded machine may outlast: the first is sent once the main thread waits for the save
# (signals.Calls.run under Loop.wait_for_save), the second once the main thread has run the
# first's handler (held's, counted: two signals before the main thread runs its handler are
# one). SIGINT and SIGTERM at a terminal's dispositions (CI runs under nohup).
_TWO_CTRL_CS_IN_A_SAVE_THAT_HANGS = """
import os, runpy, signal, sys, threading, time
from cem_jax import integrity

signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
to_thread = sys.argv[1] == "thread"
sys.path.append("tests")  # run from the repository's root
from conftest import counting_sigint_handlers

signal.signal, handled = counting_sigint_handlers()

def waiting_for_the_save():
  names, frame = [], sys._current_frames().get(threading.main_thread().ident)
  while frame is not None:
    names.append((frame.f_code.co_name, os.path.basename(frame.f_code.co_filename)))
    frame = frame.f_back
  return ("wait_for_save", "train.py") in names and ("run", "signals.py") in names

def hangs(directory, step):
  while not waiting_for_the_save():
    time.sleep(0.05)
  for _ in range(2):
    if to_thread:
      signal.pthread_kill(threading.get_ident(), signal.SIGINT)
    else:
      os.kill(os.getpid(), signal.SIGINT)
    handled.acquire()
  print("two Ctrl-Cs sent", file=sys.stderr, flush=True)
  threading.Event().wait()

integrity.write_digest = hangs
sys.argv = ["main", *sys.argv[2:]]
runpy.run_module("cem_jax.main", run_name="__main__")
"""


@pytest.mark.parametrize("sent_to", ["process", "thread"])
def test_a_second_ctrl_c_ends_a_run_whose_last_save_hangs(sent_to, tmp_path):
  # The second Ctrl-C is the way out of a save that hangs (signals.held). It got the run out of
  # the loop's wait, then the abort waited for that save again, for ever (in Orbax's close:
  # Python 3.11's Thread.join, interrupted, had taken the finalize thread for finished); and a
  # Ctrl-C the kernel gave another thread never woke the main thread's blocking join at all.
  # Fails (hangs until the timeout) with the abort waiting again, or with the wait for the save
  # a blocking one in the main thread (the signal sent to a thread).
  workdir = tmp_path / "w"
  args = _tiny_llama_main_args(workdir, "--config.train.num_steps=2")
  try:
    proc = subprocess.run([sys.executable, "-c", _TWO_CTRL_CS_IN_A_SAVE_THAT_HANGS, sent_to,
                           *args], cwd=REPO, env=subprocess_env(1), capture_output=True,
                          text=True, timeout=300)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"hung after two Ctrl-Cs in a save that hangs, having said {e.stderr!r}")
  assert proc.returncode == -signal.SIGINT, proc.stderr[-3000:]
  assert "two Ctrl-Cs sent" in proc.stderr, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.splitlines()[-1].startswith("interrupted (Ctrl-C): "), proc.stderr[-3000:]
  assert ("] checkpoint save left unfinished by a second Ctrl-C: a rerun resumes from the newest "
          f"step intact in {workdir / 'checkpoints'}\n") in proc.stderr, proc.stderr[-3000:]
  metrics = read_metrics(str(workdir))  # step 2's train and eval lines: closed by the run
  assert [m["step"] for m in metrics] == [0, 2, 2] and "eval/loss" in metrics[-1]
  assert not (workdir / "checkpoints" / "2").exists()


@pytest.mark.parametrize("at_step", [1, 2])
def test_a_sigterm_in_the_last_step_says_the_run_is_finished_not_to_resume_it(
    at_step, tmp_path, monkeypatch, caplog, sigterm_kills):
  # A SIGTERM during the last step's eval saves that step, which is the end of the run: the
  # line told the user to rerun the command to resume, and the rerun trained nothing.
  evaluate = train._Loop.eval

  def eval_then_sigterm(self, done):
    evaluate(self, done)
    if done == at_step:
      signal.raise_signal(signal.SIGTERM)

  monkeypatch.setattr(train._Loop, "eval", eval_then_sigterm)
  config = tiny_config("llama", **{"train.num_steps": 2, "train.eval_every_steps": 1})
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(config, str(tmp_path / "w"))
  preempted = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
  assert len(preempted) == 1, preempted
  if at_step == 2:
    assert "in the last step: saved the final step 2" in preempted[0]
    assert "the run is finished" in preempted[0] and "resume" not in preempted[0]
  else:  # stopped early: the rerun resumes it
    assert "saved step 1" in preempted[0] and "rerun the same command to resume" in preempted[0]


@pytest.mark.parametrize("existed, when", [(False, "initialising"), (True, "initialising"),
                                           (False, "as the loop starts"),
                                           (False, "claiming the workdir"),
                                           (True, "claiming the workdir")])
def test_a_sigterm_during_start_up_stops_it_as_a_failed_start_and_says_so(existed, when,
                                                                          tmp_path, monkeypatch,
                                                                          sigterm_kills):
  # Start-up has nothing to save: SIGTERM there was the default action, the process gone at
  # once without a word (status 143), a new workdir left with an empty checkpoints/. Now it
  # raises cli.Terminated (main: one line, then death by SIGTERM) after start-up's clean-up.
  # Also when it lands after the loop's set-up, before the loop takes SIGTERM as its flag: a
  # new workdir was left (checkpoints/, config.json, metrics.jsonl), though the line said
  # removed (found reviewing 42c522d for a SIGTERM between start-up and loop_starts).
  def sigterm_first(fn):
    def call(*args, **kwargs):
      signal.raise_signal(signal.SIGTERM)
      return fn(*args, **kwargs)
    return call

  # Also while the processes check that they agree (with several, a wait for every host): a
  # new workdir was left, empty, though the line said removed (adversary adv54 on dba8536's
  # _claim_workdir, which removed it on a ValueError only).
  if when == "initialising":  # after the data, before the loop
    monkeypatch.setattr(steps, "init_state", sigterm_first(steps.init_state))
  elif when == "claiming the workdir":  # before the data
    monkeypatch.setattr(workdir_lib, "check_processes_agree",
                        sigterm_first(workdir_lib.check_processes_agree))
  else:
    monkeypatch.setattr(workdir_lib.Preemption, "loop_starts",
                        sigterm_first(workdir_lib.Preemption.loop_starts))
  workdir = tmp_path / "w"
  if existed:
    workdir.mkdir()
  with pytest.raises(cli.Terminated) as raised:
    train.train_and_evaluate(tiny_config("llama", **{"train.num_steps": 2}), str(workdir))
  assert signal.getsignal(signal.SIGTERM) is sigterm_kills  # put back
  assert str(raised.value).startswith("during start-up, before the first step: nothing "
                                      "trained or saved; a --workdir this start created is "
                                      "removed but for the tokens prepared in WORKDIR/data")
  _assert_nothing_left(workdir, existed, prepared=when != "claiming the workdir")


def test_a_sigterm_during_start_up_waits_for_tensorboards_call_to_return(tmp_path, monkeypatch,
                                                                        sigterm_kills):
  # Start-up's SIGTERM raises (cli.Terminated) where it lands: inside tensorboardX (the step-0
  # line) it can leave the writer's queue lock taken and the clean-up's close hanging for ever
  # (test_train's handshake test). Held until tensorboardX's call returns, it stops the start
  # as anywhere else.
  import tensorboardX

  add_scalar, returned = tensorboardX.SummaryWriter.add_scalar, []

  def sigterm_inside(self, tag, *args, **kwargs):
    if not returned:
      signal.raise_signal(signal.SIGTERM)
    add_scalar(self, tag, *args, **kwargs)
    returned.append(tag)

  monkeypatch.setattr(tensorboardX.SummaryWriter, "add_scalar", sigterm_inside)
  workdir = tmp_path / "w"
  with pytest.raises(cli.Terminated, match="^during start-up, before the first step"):
    train.train_and_evaluate(tiny_config("llama", **{"train.num_steps": 2}), str(workdir))
  assert "params/total" in returned and "data/epochs" in returned  # the whole step-0 line
  _assert_nothing_left(workdir, prepared=True)


def test_a_second_ctrl_c_out_of_a_pending_save_still_closes_the_metrics():
  # The second Ctrl-C is the way out of a save that hangs (signals.held): the
  # metrics are closed all the same, TensorBoard's last events written by the run, not left
  # to tensorboardX's atexit.
  def interrupted():
    raise KeyboardInterrupt

  closed = []
  loop = types.SimpleNamespace(
      done=3, save_left=False, profiler=types.SimpleNamespace(stop=lambda done: None),
      run=types.SimpleNamespace(ckpt=types.SimpleNamespace(close=interrupted)),
      writer=types.SimpleNamespace(path="/w/metrics.jsonl", close=lambda: closed.append(1)))
  with pytest.raises(KeyboardInterrupt):
    train._Loop.abort(loop)
  assert closed == [1]


def test_terminated_is_one_line_and_ends_the_process_by_sigterm():
  # As a Ctrl-C: clean-up and atexit run, no traceback, and the status a SIGTERM gives.
  code = textwrap.dedent("""
      import atexit, sys
      from cem_jax import cli

      atexit.register(lambda: print("cleanup ran", file=sys.stderr))
      with cli.interrupted("what to do after a Ctrl-C"):
        try:
          raise cli.Terminated("what was kept")
        finally:
          print("finally ran", file=sys.stderr)
  """)
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == -signal.SIGTERM
  assert proc.stderr == "finally ran\nterminated (SIGTERM): what was kept\ncleanup ran\n"


# main with a SIGTERM sent while it imports jax (from the import system's first look for a jax
# module, so at the same point every time), both signals at their default disposition, as a
# terminal's job has them, whatever the job running pytest inherited (CI runs under nohup).
_SIGTERM_IN_IMPORT = """
import runpy, signal, sys

signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)

class SigtermAtJax:
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("jax", "jaxlib"):
      sys.meta_path.remove(self)
      signal.raise_signal(signal.SIGTERM)
    return None

sys.meta_path.insert(0, SigtermAtJax())
sys.argv = ["main", "--config=experiments/tiny.py", "--workdir=" + sys.argv[1]]
runpy.run_module("cem_jax.main", run_name="__main__")
"""


def test_a_sigterm_while_main_imports_jax_is_the_start_up_line(tmp_path):
  # It was the default action: the process gone without a word (143), before train set its
  # handler (workdir.Preemption).
  proc = subprocess.run([sys.executable, "-c", _SIGTERM_IN_IMPORT, str(tmp_path / "w")],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
  assert proc.stderr == f"terminated (SIGTERM): {cli.TERMINATED_IN_START_UP}\n"
  assert not (tmp_path / "w").exists()


# main with a signal sent at a chosen point of its start-up (sys.argv[1]), before train sets its
# handler: while absl is first looked for (main's imports), while the config file runs (the
# flags), as jax's backend starts (its first jax.process_count), or while process 0 of two
# waits for the other inside jax.distributed.initialize's C++ (the other never comes). Sent
# (sys.argv[6]) to the main thread, or to the thread that sends it, where the kernel may deliver
# a process's signal (only the wait for the other sends from a thread of its own). SIGINT and
# SIGTERM at their default disposition, as a terminal's job has them (CI runs under nohup).
_SIGNAL_IN_START_UP = """
import atexit, importlib.machinery, linecache, runpy, signal, sys, threading, time

signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
atexit.register(lambda: print("jax imported:", "jax" in sys.modules))
where, workdir, config, port, signum = sys.argv[1:5] + [getattr(signal, sys.argv[5])]
to = threading.main_thread if sys.argv[6] == "main thread" else threading.current_thread

def send():
  signal.pthread_kill(to().ident, signum)

def sending_first(fn):
  def call(*args, **kwargs):
    send()
    return fn(*args, **kwargs)
  return call

def send_once_connecting(ident):
  # The thread ident holds the GIL (the switch interval below) until it blocks: once its line is
  # the client's connect, it is inside it, in C++, waiting for the other process.
  while True:
    time.sleep(0.001)
    frame = sys._current_frames()[ident]
    if ".connect()" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
      return send()

def watched(initialize):
  def call(*args, **kwargs):
    threading.Thread(target=send_once_connecting, args=(threading.get_ident(),),
                     daemon=True).start()
    return initialize(*args, **kwargs)
  return call

def patch(module):
  if where == "as the backend starts":
    module.process_count = sending_first(module.process_count)
  if where == "waiting for the other process":
    import jax.distributed
    sys.setswitchinterval(1000)
    jax.distributed.initialize = watched(jax.distributed.initialize)

class At:
  def find_spec(self, name, path=None, target=None):
    if where == "importing absl" and name == "absl":
      sys.meta_path.remove(self)
      send()
    if name != "jax":
      return None
    sys.meta_path.remove(self)
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    exec_module = spec.loader.exec_module
    spec.loader.exec_module = lambda module: (exec_module(module), patch(module))
    return spec

sys.meta_path.insert(0, At())
sys.argv = ["main", "--config=" + config, "--workdir=" + workdir]
if where == "waiting for the other process":
  sys.argv += ["--coordinator_address=127.0.0.1:" + port, "--num_processes=2", "--process_id=0"]
runpy.run_module("cem_jax.main", run_name="__main__")
"""


@pytest.mark.parametrize("where, signame, to", [
    ("importing absl", "SIGTERM", "main thread"), ("importing absl", "SIGINT", "main thread"),
    ("running the config file", "SIGTERM", "main thread"),
    ("running the config file", "SIGINT", "main thread"),
    ("as the backend starts", "SIGTERM", "main thread"),
    ("waiting for the other process", "SIGTERM", "main thread"),
    ("waiting for the other process", "SIGINT", "main thread"),
    ("waiting for the other process", "SIGTERM", "another thread"),
    ("waiting for the other process", "SIGINT", "another thread")])
def test_a_signal_before_train_sets_its_handler_is_the_start_up_line(where, signame, to,
                                                                      tmp_path):
  # Before train's handler (workdir.Preemption) SIGTERM was the default action, the process
  # gone without a word (143): in main's imports, while the flags and the config file were
  # read, as jax's backend started (in Preemption.__enter__, before its handler was set), and
  # while the processes met in jax.distributed.initialize. Waiting for the others, in C++ until
  # the runtime's 300 s timeout and its abort, Ctrl-C did nothing at all. Ctrl-C in the
  # imports (absl, ml_collections) or while the config file ran, before main's cli.interrupted,
  # was a KeyboardInterrupt traceback (adversary start56). The wait for the others stops also
  # for a signal the kernel gave another thread: a blocking join there never woke (fails, the
  # 120 s timeout, with the join back).
  config = tmp_path / "config.py"
  config.write_text(textwrap.dedent(f"""
      import runpy, signal

      def get_config():
        if {where == "running the config file"}:
          signal.raise_signal(signal.{signame})
        return runpy.run_path({str(REPO / "experiments" / "tiny.py")!r})["get_config"]()
  """))
  workdir = tmp_path / "w"
  proc = subprocess.run([sys.executable, "-c", _SIGNAL_IN_START_UP, where, str(workdir),
                         str(config), str(closed_port()), signame, to], cwd=REPO,
                        env=subprocess_env(1), capture_output=True, text=True, timeout=120)
  signum = getattr(signal, signame)
  assert proc.returncode == -signum, proc.stderr[-2000:]
  line = (f"terminated (SIGTERM): {cli.TERMINATED_IN_START_UP}" if signum == signal.SIGTERM
          else "interrupted (Ctrl-C): stopped at once (no save of its own); the same command "
               "resumes from the newest checkpoint in --workdir (checkpoint.every_steps)")
  if where != "waiting for the other process":
    assert proc.stderr == line + "\n"
    # Stopped before jax's import (seconds) where the signal came before it.
    assert proc.stdout == f"jax imported: {where == 'as the backend starts'}\n"
  else:  # after jax's log lines of the meeting; nothing from a shut-down of its runtime
    assert proc.stderr.endswith("\n" + line + "\n"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "shutting down" not in proc.stderr, proc.stderr
  assert not workdir.exists()


# main whose processes met (one, with a coordinator: the same jax.distributed.initialize), with
# train a stand-in that sends itself a SIGTERM.
_SIGTERM_ONCE_MET = """
import runpy, signal, sys
import cem_jax.train

signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)

def train_and_evaluate(config, workdir):
  signal.raise_signal(signal.SIGTERM)
  print("went on", file=sys.stderr)

cem_jax.train.train_and_evaluate = train_and_evaluate
sys.argv = ["main", "--config=experiments/tiny.py", "--workdir=" + sys.argv[1],
            "--coordinator_address=127.0.0.1:" + sys.argv[2], "--num_processes=1",
            "--process_id=0"]
runpy.run_module("cem_jax.main", run_name="__main__")
"""


def test_once_the_processes_met_main_leaves_sigterm_to_jax(tmp_path):
  # jax.distributed.initialize sets JAX's preemption notifier below Python's SIGTERM handler
  # (with several processes the loop saves at its sync point, Orbax's reached_preemption);
  # Python still reports main's held handler. Main restoring the default action when it
  # stops holding SIGTERM took it from JAX: the process died (143).
  proc = subprocess.run([sys.executable, "-c", _SIGTERM_ONCE_MET, str(tmp_path / "w"),
                         str(closed_port())], cwd=REPO, env=subprocess_env(1),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stderr.endswith("went on\n")


def test_a_signal_the_kernel_gives_another_thread_stops_the_wait_for_a_call_at_once():
  # signals.Calls: the main thread waits for a call in another thread. A blocking wait there
  # woke for a signal only where the kernel delivered it to the main thread; one sent to
  # another thread (pthread_kill here, as the kernel may deliver a process's Ctrl-C) was seen
  # when the call ended. The call goes on after the wait is stopped, and the calls stay in
  # order, each in the same thread. Fails (the call returned first, after its 60 s) with a
  # blocking acquire.
  go, seen = threading.Event(), []

  def blocked():
    seen.append(threading.current_thread().name)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
    go.wait(timeout=60)
    seen.append("returned")

  def failing():
    seen.append(threading.current_thread().name)
    raise ZeroDivisionError("in the call")

  calls = signals.Calls("the calls")
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
  try:
    with pytest.raises(KeyboardInterrupt):
      calls.run(blocked)
  finally:
    signal.signal(signal.SIGINT, previous)
  assert seen == ["the calls"]  # the call still waits
  go.set()
  with pytest.raises(ZeroDivisionError, match="^in the call$") as raised:
    calls.run(failing)
  assert seen == ["the calls", "returned", "the calls"]
  assert raised.traceback[-1].name == "failing"
  assert calls.run(lambda a, b: a + b, 1, 2) == 3
  first = calls.run(threading.current_thread)
  calls.stop()
  # Ended when stop returns: a daemon thread still waking as the interpreter exits aborted the
  # process (a resumed run that had nothing to train, in about 1 of 2 ends).
  assert not first.is_alive()
  again = calls.run(threading.current_thread)  # a call after the stop starts another
  assert again is not first and again.name == "the calls"
  calls.stop()
  assert not again.is_alive()
  # A call whose wait was interrupted goes on: stop does not wait for it.
  go.clear()
  with pytest.raises(KeyboardInterrupt):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
      calls.run(blocked)
    finally:
      signal.signal(signal.SIGINT, previous)
  calls.stop()
  assert seen[-1] == "the calls"  # stop returned while the call still waits (no clock read)
  go.set()


def test_held_sigterm_stops_where_asked_and_leaves_a_taken_sigterm_alone(monkeypatch):
  # Raised where it landed, inside jaxlib's extension initialisation, it crashed the process:
  # held, it stops where the program asks (stop_if_sent, release), or at once in a wait
  # (raising). Released without restoring (JAX's notifier may hold SIGTERM below Python's
  # handler), the handler left in place does the default action.
  previous = signal.getsignal(signal.SIGTERM)
  ended = []
  monkeypatch.setattr(signals, "end_by", ended.append)
  stop = cli.Terminated("what now")
  try:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    held = signals.Held()
    held.stop_if_sent(stop)  # nothing sent
    signal.raise_signal(signal.SIGTERM)
    assert held.sent
    with pytest.raises(cli.Terminated, match="^what now$"):
      held.stop_if_sent(stop)
    with pytest.raises(cli.Terminated, match="^what now$"):
      held.release(stop)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    held, ran = signals.Held(), []
    with pytest.raises(cli.Terminated, match="^what now$"):
      with held.raising(stop):
        signal.raise_signal(signal.SIGTERM)
        ran.append("the rest of the block")
    assert ran == [] and held.sent
    with pytest.raises(cli.Terminated, match="^what now$"):
      held.release(stop)
    held = signals.Held()
    with held.raising(stop):
      pass
    signal.raise_signal(signal.SIGTERM)  # after the block: held again
    with pytest.raises(cli.Terminated, match="^what now$"):
      held.release(stop, restore=False)
    handler = signal.getsignal(signal.SIGTERM)
    assert handler == held._handle and ended == []
    signal.raise_signal(signal.SIGTERM)
    assert ended == [signal.SIGTERM]

    for taken in (signal.SIG_IGN, lambda signum, frame: None):
      signal.signal(signal.SIGTERM, taken)
      held = signals.Held()
      assert signal.getsignal(signal.SIGTERM) is taken
      signal.raise_signal(signal.SIGTERM)
      held.release(stop)
      assert signal.getsignal(signal.SIGTERM) is taken and not held.sent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signals.Held(take=False).release(stop)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
  finally:
    signal.signal(signal.SIGTERM, previous)


_DROPPED_SIGTERM = """
import gc, signal, sys, time
from cem_jax import cli, workdir

if sys.argv[1] == "background":
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's `main ... &` (nohup) has it
else:  # as a terminal has it, whatever the job running pytest inherited (CI under nohup)
  signal.signal(signal.SIGINT, signal.default_int_handler)
sent = []
def collecting(phase, info):  # jax has one, run at every collection
  if phase == "start" and not sent:
    sent.append(1)
    signal.raise_signal(signal.SIGTERM)  # handled here, where Python drops what is raised
with cli.interrupted("what to do now"):
  with workdir.Preemption() as preemption:  # start-up
    gc.callbacks.append(collecting)
    gc.collect()
    for _ in range(int(float(sys.argv[2]) * 100)):  # a SIGTERM sent again ends it here
      time.sleep(0.01)
    preemption.loop_starts()
    print(f"the loop saves at its first step boundary: {preemption.requested}", file=sys.stderr)
"""


@pytest.mark.parametrize("job", ["foreground", "background"])
def test_a_sigterm_that_python_drops_during_start_up_is_not_forgotten(job):
  # The SIGTERM handler raises cli.Terminated during start-up; raised in jax's gc callback
  # Python prints it ("Exception ignored in ...") and goes on. In a terminal cli.interrupted
  # sends the SIGTERM again: the start-up stops. A background job ignores SIGINT, and there
  # cli.interrupted sends nothing again: the SIGTERM was forgotten and the run trained to its
  # end (status 0); now the flag is set first, and the loop saves at its first step boundary.
  # How long start-up goes on after the SIGTERM: in a terminal 5 s, a ceiling (the SIGTERM
  # sent again ends it within a tenth of that); in the background 1 s, 20 times the delay of a
  # SIGTERM sent again (cli._REDELIVER_S), which none may be: it would end the process.
  seconds = 5 if job == "foreground" else 20 * cli._REDELIVER_S
  proc = subprocess.run([sys.executable, "-c", _DROPPED_SIGTERM, job, str(seconds)], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  if job == "foreground":
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    assert proc.stderr == f"terminated (SIGTERM): {cli.TERMINATED_IN_START_UP}\n"
  else:
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.endswith("the loop saves at its first step boundary: True\n")


def test_a_failed_start_leaves_no_orbax_thread_behind_to_fail(tmp_path, monkeypatch):
  # A start that fails right after opening the checkpoints removes the new workdir. Orbax's
  # temporary-folder clean-up ran in a thread that close() does not wait for, and listed the
  # removed folder about 1 time in 3 here: an orbax traceback after the one-line error. Looped,
  # as one start rarely shows it.
  errors = []
  handler = logging.Handler(logging.ERROR)
  handler.emit = errors.append
  logging.getLogger().addHandler(handler)

  def bad_data(*args, **kwargs):
    raise ValueError("data.vocab_size=512 does not fit")

  monkeypatch.setattr(train.workdir_lib, "build_data_once", bad_data)
  config = tiny_config("llama")
  try:
    for i in range(30):
      with pytest.raises(ValueError, match="does not fit"):
        train.train_and_evaluate(config, str(tmp_path / f"w{i}"))
      assert not (tmp_path / f"w{i}").exists()
    time.sleep(0.5)  # a thread still running would log by now
  finally:
    logging.getLogger().removeHandler(handler)
  assert [r.getMessage()[:200] for r in errors] == []


def test_resume_on_other_data_is_refused_and_keeps_the_run(shared_data, tmp_path):
  # Editing the text between runs retrains the BPE: the checkpoint's embeddings would train
  # on other token ids without a word. The checkpoint records what it was trained on.
  text = tmp_path / "text.txt"
  text.write_text((shared_data / "tinyshakespeare.txt").read_text()[:150_000])
  workdir = tmp_path / "w"
  # The model and steps of the numerics-version and step-metadata tests below (one compile
  # for the session's cache): a 1-layer Llama, 512 tokens, which 150 kB of text make.
  cfg = lambda steps: tiny_config("llama", **{  # noqa: E731
      "data.files": str(text), "model.num_layers": 1, "train.num_steps": steps,
      "checkpoint.every_steps": 2, "train.eval_every_steps": 2})
  train.train_and_evaluate(cfg(2), str(workdir))
  before = read_metrics(str(workdir))
  prepared = sorted(os.listdir(workdir / "data"))
  text.write_text(text.read_text().replace("the", "THE"))
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(cfg(4), str(workdir))
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith(f"checkpoint {workdir / 'checkpoints' / '2'} was trained on other "
                            "data (tokenizer_sha256 ")
  assert "train_sha256" in message and message.endswith("train in a new --workdir")
  assert read_metrics(str(workdir)) == before and (workdir / "checkpoints" / "2").is_dir()
  # The edited text was prepared (its tokens are what the check compares), then removed: no
  # run of this workdir could read it.
  assert sorted(os.listdir(workdir / "data")) == prepared and len(prepared) == 1
  # evaluate finds the tokens the checkpoint was trained on without the text; with them gone,
  # it prepares the edited text, refuses it and removes it too.
  assert runs.load_run(str(workdir))[4] == 2
  shutil.move(workdir / "data" / prepared[0], tmp_path / "kept")
  with pytest.raises(ValueError, match="was trained on other data"):
    runs.load_run(str(workdir))
  assert os.listdir(workdir / "data") == []
  shutil.move(tmp_path / "kept", workdir / "data" / prepared[0])
  # The text as it was: the run resumes.
  text.write_text((shared_data / "tinyshakespeare.txt").read_text()[:150_000])
  train.train_and_evaluate(cfg(4), str(workdir))
  assert read_metrics(str(workdir))[-1]["step"] == 4


# How the step is computed (kernel, precision, rematerialisation, energy blocks) or only how
# a fresh model is initialised: a resume may change them (spelled out, not read from the code).
@pytest.mark.parametrize("key", ["model.attention_impl", "model.dtype", "model.remat",
                                 "model.energy_block_size", "model.init_std", "model.eta_init",
                                 "model.momentum_init"])
def test_every_key_a_resume_may_change_is_no_model_change(key):
  now = tiny_config("cem", **{"model.inner_optimizer": "heavy_ball"})
  saved = now.to_dict()
  field = key.split(".")[1]
  old = now.model[field]
  now.model[field] = (old + "_other" if isinstance(old, str) else
                      not old if isinstance(old, bool) else old * 2 + 1)
  assert config_lib.model_changes(saved, now) == []
  assert config_lib.model_changes(saved, tiny_config("cem", **{"model.d_model": 32})) != []


def test_model_changes_compares_the_model_a_config_makes():
  now = tiny_config("cem")
  saved = now.to_dict()
  del saved["model"]["manifold"]  # a checkpoint saved before the key existed
  saved["model"]["removed_since"] = 3  # a key this version no longer has
  assert config_lib.model_changes(saved, now) == []
  now.model.manifold = "sphere"
  assert config_lib.model_changes(saved, now) == ["model.manifold: 'euclidean' -> 'sphere'"]
  now.model.manifold, now.model.dtype, now.train.learning_rate = "euclidean", "bfloat16", 1.0
  assert config_lib.model_changes(saved, now) == []  # precision and training are no model key
  # Two spellings of one model: -1 sizes, the same energy file from another checkout.
  saved["model"].update(head_dim=-1, num_unique_blocks=-1,
                        mlp_energy="/old/checkout/experiments/e.py:energy")
  now.model.head_dim, now.model.num_unique_blocks = 16, 2
  now.model.mlp_energy = "/new/place/experiments/e.py:energy"
  assert config_lib.model_changes(saved, now) == []
  now.model.head_dim, now.model.mlp_energy = 8, "/new/place/experiments/e.py:other"
  assert config_lib.model_changes(saved, now) == [
      "model.head_dim: 16 -> 8", "model.mlp_energy: 'e.py:energy' -> 'e.py:other'"]
  now.model.head_dim, now.model.mlp_energy = 16, "e.py:energy"
  now.model.update_mode = "autodiff"  # a user's closed form is checked by its values only
  assert config_lib.model_changes(saved, now) == ["model.update_mode: 'auto' -> 'autodiff'"]
  # Values every forward pass reads define the model (only init-time values may change).
  now.model.update_mode, now.model.rope_theta, now.model.norm_eps = "auto", 500.0, 1e-3
  assert [c.split(":")[0] for c in config_lib.model_changes(saved, now)] == [
      "model.norm_eps", "model.rope_theta"]
  # A size left at -1 in both follows the key the user changed, which alone is named.
  m = saved["model"]
  now.model.norm_eps, now.model.rope_theta = m["norm_eps"], m["rope_theta"]
  now.model.head_dim, now.model.num_unique_blocks = -1, -1
  now.model.num_layers, now.model.num_heads = 4, 8  # head_dim 16 -> 8, unique blocks 2 -> 4
  assert config_lib.model_changes(saved, now) == ["model.num_heads: 4 -> 8",
                                                  "model.num_layers: 2 -> 4"]
  now.model.num_unique_blocks = 4  # set, it is named: 2 (-1 then) -> 4
  assert "model.num_unique_blocks: 2 -> 4" in config_lib.model_changes(saved, now)


@pytest.mark.parametrize("key,value", [
    ("num_steps", 2), ("strict_causal", True), ("document_mask", False), ("rope", False),
    ("context", "coevolve"), ("split", "joint"), ("mlp_condition", "layer"),
    ("norm_mode", "chain"), ("manifold", "sphere"), ("mlp_energy", "gelu")])
def test_a_model_key_that_leaves_every_parameter_shape_is_still_a_model_change(key, value):
  # Such a checkpoint restores without a shape error (T = 2 reuses T = 1's step parameters):
  # only model_changes stops a resume that would train it on as another model.
  saved, now = tiny_config("cem"), tiny_config("cem", **{f"model.{key}": value})
  assert config_lib.model_changes(saved.to_dict(), now) == [
      f"model.{key}: {saved.model[key]!r} -> {value!r}"]


USER_ENERGY = """
from cem_jax.energies import interaction_energy


def energy(y, context, params, aux):
  return {scale} * interaction_energy(y, context, params, aux)
"""


def _refused_before_the_data_is_built(*args, **kwargs):
  # A refused resume must not first build the data (reading or preparing it: minutes at
  # corpus scale).
  raise AssertionError("the data was built before the checkpoint was refused")


def test_a_checkpoint_whose_metadata_names_another_step_is_refused_before_the_data(
    tmp_path, monkeypatch):
  # The resume starts at the step Orbax saved the arrays under; metadata naming another step is
  # damaged (hand-edited, or copied from another step), not a data position to trust.
  workdir = tmp_path / "w"
  cfg = lambda steps: tiny_config("llama", **{  # noqa: E731
      "model.num_layers": 1, "train.num_steps": steps, "checkpoint.every_steps": 2,
      "train.eval_every_steps": 2})
  train.train_and_evaluate(cfg(2), str(workdir))
  real = train.Checkpointer.read_meta
  monkeypatch.setattr(train.Checkpointer, "read_meta",
                      lambda self, step: {**real(self, step), "step": 5})
  monkeypatch.setattr(train.workdir_lib, "build_data_once", _refused_before_the_data_is_built)
  checkpoint = workdir / "checkpoints" / "2"
  with pytest.raises(ValueError, match=f"^checkpoint {re.escape(str(checkpoint))}: damaged "
                     "metadata: step=5, saved as step 2$"):
    train.train_and_evaluate(cfg(4), str(workdir))


def test_resume_under_another_numerics_version_is_refused_and_keeps_the_run(tmp_path,
                                                                            monkeypatch):
  # Version 3 changed the data order: a version-2 run resumed by it would train some windows
  # of the epoch twice and others never, and be counted by tables as a version-3 run.
  workdir = tmp_path / "w"
  cfg = lambda steps: tiny_config("llama", **{  # noqa: E731
      "model.num_layers": 1, "train.num_steps": steps, "checkpoint.every_steps": 2,
      "train.eval_every_steps": 2})
  def code_of_version(version):  # train writes it in metrics, runs in checkpoints and checks it
    for module in (train, runs):
      monkeypatch.setattr(module, "NUMERICS_VERSION", version)

  code_of_version(NUMERICS_VERSION - 1)
  train.train_and_evaluate(cfg(2), str(workdir))
  before = read_metrics(str(workdir))
  code_of_version(NUMERICS_VERSION)
  checkpoint = workdir / "checkpoints" / "2"
  with monkeypatch.context() as m, pytest.raises(ValueError, match=(
      f"^checkpoint {re.escape(str(checkpoint))} was trained under numerics version "
      f"{NUMERICS_VERSION - 1}, this code is version {NUMERICS_VERSION} \\(cem_jax/version.py "
      r"says what changed\): resumed, the run would mix the two; finish it with the code it "
      r"started with, or train in a new --workdir$")):
    m.setattr(train.workdir_lib, "build_data_once", _refused_before_the_data_is_built)
    train.train_and_evaluate(cfg(4), str(workdir))
  assert read_metrics(str(workdir)) == before and checkpoint.is_dir()
  code_of_version(NUMERICS_VERSION - 1)
  read, real_batch = [], pipeline.TrainBatches.batch

  def recording_batch(self, step, *args, **kwargs):
    read.append(step)
    return real_batch(self, step, *args, **kwargs)

  monkeypatch.setattr(pipeline.TrainBatches, "batch", recording_batch)
  train.train_and_evaluate(cfg(4), str(workdir))  # the code it started with finishes it
  assert read_metrics(str(workdir))[-1]["step"] == 4
  assert read == [2, 3]  # from the checkpointed step on: none skipped or repeated


def test_a_checkpoint_of_a_newer_or_of_no_numerics_version_is_refused_too():
  # A checkpoint of newer code (a downgraded checkout) mixes two versions as an older one
  # does; one without a numerics_version predates the constant: version 1.
  cfg = tiny_config("llama")
  refuse = lambda saved: runs.refuse_other_run(runs.CheckpointMeta.from_dict(saved), cfg, "ck")
  refuse({"numerics_version": NUMERICS_VERSION})  # resumed
  for saved, version in (({"numerics_version": NUMERICS_VERSION + 1}, NUMERICS_VERSION + 1),
                         ({}, 1)):
    with pytest.raises(ValueError, match=f"^checkpoint ck was trained under numerics version "
                                         f"{version}, this code is version {NUMERICS_VERSION} "):
      refuse(saved)


def test_resume_as_another_model_is_refused_and_keeps_the_run(tmp_path, caplog, monkeypatch):
  # Parameters of the same shapes restore into another model without an error: a changed
  # mask, energy or energy file would train on as if nothing had changed, its metrics mixed
  # with the old. The same file elsewhere (another checkout, another machine) is the same.
  first, moved = tmp_path / "a" / "e.py", tmp_path / "b" / "e.py"
  for path in (first, moved):
    path.parent.mkdir()
    path.write_text(USER_ENERGY.format(scale="1.0"))
  workdir = tmp_path / "w"
  cfg = lambda steps, path, **more: tiny_config("cem", **{  # noqa: E731
      "model.num_layers": 1, "model.attention_energy": f"{path}:energy",
      "train.num_steps": steps, "checkpoint.every_steps": 2, "train.eval_every_steps": 2,
      **more})
  train.train_and_evaluate(cfg(2, first), str(workdir))
  before = read_metrics(str(workdir))
  checkpoint = workdir / "checkpoints" / "2"
  first.write_text(USER_ENERGY.format(scale="2.0"))  # the same path, another function
  # As a new process would meet it: imported and pinned again (once a process each).
  monkeypatch.delitem(sys.modules, energies.get(f"{first}:energy", "attention").energy.__module__)
  monkeypatch.setattr(energies.digest, "_PINNED", {})
  with monkeypatch.context() as m, pytest.raises(ValueError) as e:
    m.setattr(train.workdir_lib, "build_data_once", _refused_before_the_data_is_built)
    train.train_and_evaluate(cfg(4, first, **{"model.strict_causal": True,
                                              "model.mlp_energy": "relu2"}), str(workdir))
  message = str(e.value)
  assert message.startswith(f"checkpoint {checkpoint} is another model (model.mlp_energy: "
                            "'silu' -> 'relu2', model.strict_causal: False -> True, "
                            "model.attention_energy: its source, or a constant or helper it "
                            "reads, changed (sha256 ")
  assert message.endswith("): resume with the model it was trained as, or train in a new "
                          "--workdir") and "\n" not in message
  assert read_metrics(str(workdir)) == before and checkpoint.is_dir()
  # The file as it was, moved, and what only initialisation reads (the restore replaces it)
  # may change: the resume trains on, with the first run's steps (compiled: cached).
  # The profiler stands in: the window is what is under test here, and jax's own stop_trace
  # has crashed a CPU process once, which in this process would take the pytest worker down
  # (test_train traces for real, in a process of its own).
  monkeypatch.setattr(jax.profiler, "start_trace", lambda *args, **kwargs: None)
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
  with caplog.at_level(logging.INFO):
    train.train_and_evaluate(cfg(4, moved, **{"model.init_std": 0.01, "model.eta_init": 0.5,
                                              "train.profile_steps": 2,
                                              "train.profile_first_step": 2}), str(workdir))
  assert read_metrics(str(workdir))[-1]["step"] == 4
  # Said as what it is: the others in a warning (a compute-only change in an info line: below).
  said = _said_against_the_checkpoint(caplog)
  assert "INFO" not in said
  assert said["WARNING"].startswith("config differs from the checkpoint's: "
                                    "model.attention_energy: ")
  assert "model.init_std: 0.02 -> 0.01" in said["WARNING"]
  # A trace changes nothing computed; its window 2..3 is traced from the resumed step 2 on.
  assert "profile" not in said["WARNING"]
  assert any(r.getMessage().startswith("profile: trace of steps 3..3 written under ")
             for r in caplog.records)
  # Re-run when finished, computing it otherwise (the memory policy, the loss in blocks): the
  # state is restored into the model so computed and the change said as compute-only in an
  # info line; nothing trains, config.json stays the one the run trained with. (Trained on,
  # the two steps would be compiled again for seconds, through the same check and restore.)
  trained_with = (workdir / "config.json").read_bytes()
  caplog.clear()
  with caplog.at_level(logging.INFO):
    train.train_and_evaluate(cfg(4, moved, **{"model.remat": "full",
                                              "train.loss_block_size": 16}), str(workdir))
  said = _said_against_the_checkpoint(caplog)
  assert said["INFO"] == ("computed differently from the checkpoint's run (the same numbers "
                          "up to float rounding): model.remat: 'none' -> 'full', "
                          "train.loss_block_size: 0 -> 16")
  assert "remat" not in said["WARNING"]
  assert any(r.getMessage().startswith(f"resumed from {workdir / 'checkpoints' / '4'} at step 4")
             for r in caplog.records)
  assert (workdir / "config.json").read_bytes() == trained_with


def _said_against_the_checkpoint(caplog) -> dict[str, str]:
  """What a resume said of its config against the checkpoint's, by log level."""
  return {r.levelname: r.getMessage() for r in caplog.records
          if "from the checkpoint's" in r.getMessage()}


def _scaled_energy(y, context, params, aux, scale=1.0):
  return scale * energies.interaction_energy(y, context, params, aux)


class _CallableEnergy:
  def __call__(self, y, context, params, aux):
    return energies.interaction_energy(y, context, params, aux)


DIGESTED = """
import functools

import jax
import jax.numpy as jnp
import numpy as np

TAU = {tau}
WEIGHTS = np.array([1.0, {w}])
UNUSED = {unused}


def _helper(x):
  return x * TAU  # {comment}


def energy(y, context, params, aux):
  return jnp.sum(_helper(y) ** 2) * WEIGHTS.sum()  # {note}


def other(y, context, params, aux):  # reads none of the constants
  return jnp.sum(y ** 2)


def _make(scale):
  def made(y, context, params, aux):
    return scale * jnp.sum(y ** 2)
  return made


made = _make({scale})
scaled = functools.partial(lambda y, context, params, aux, s: s * jnp.sum(y), s={scale})


@jax.custom_jvp
def _smooth(x):
  return jnp.sum(x ** 2)


@_smooth.defjvp
def _smooth_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return _smooth(x), jnp.sum({rule} * x * t)


def ruled(y, context, params, aux):
  return _smooth(y)
"""


def test_source_digest_pins_the_constants_helpers_and_rules_an_energy_reads(tmp_path):
  # Resuming after TAU = 2.0 became 0.25 trained another energy without a word: the digest
  # held the function's source alone. Each module is a new file: a path imports once.
  base = {"tau": "2.0", "w": "3.0", "unused": "1", "comment": "a", "scale": "2.0",
          "rule": "2.0", "note": "a"}
  names = ("energy", "other", "made", "scaled", "ruled")

  def digests(version=energies.DIGEST_VERSION, **edit):
    path = tmp_path / f"e{len(list(tmp_path.iterdir()))}.py"
    path.write_text(DIGESTED.format(**{**base, **edit}))
    return {n: energies.source_digest(f"{path}:{n}", "attention", version=version)
            for n in names}

  first = digests()
  assert first == digests() and len(set(first.values())) == len(names)
  changed = lambda **edit: {n for n, d in digests(**edit).items() if d != first[n]}  # noqa: E731
  assert changed(tau="0.25") == {"energy"}  # a constant read by a helper it calls
  assert changed(w="4.0") == {"energy"}  # a NumPy array it reads
  assert changed(comment="b") == changed(note="b") == {"energy"}  # the helper's, its source
  assert changed(scale="3.0") == {"made", "scaled"}  # a closure cell, a partial's keyword
  assert changed(rule="3.0") == {"ruled"}  # a custom_jvp's rule
  assert changed(unused="2") == set()  # what no energy reads
  # Version 1 (checkpoints saved before the constants counted) pins the source alone.
  v1 = digests(version=1)
  assert v1 == digests(version=1, tau="0.25") != first
  with pytest.raises(ValueError, match=r"^energy digest version=3; allowed: 1, 2$"):
    energies.source_digest(f"{tmp_path / 'e0.py'}:energy", "attention", version=3)


READS = """
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

MEMO = {{}}  # filled when traced: not an edit
KEY = jax.random.key({key})
SCALE = {scale_value}
NAMES = np.array(["a", {name!r}], dtype=object)
LOOP = [1]
LOOP.append(LOOP)


def _sq(x):
  return x ** {power}


ACTS = {{"sq": _sq}}


@dataclasses.dataclass(frozen=True)
class Hp:
  tau: float = 1.0


HP = Hp(tau={tau})
WORDS = frozenset({{"alpha", "beta", "gamma"}})  # iterated in another order by each process


FACTOR = {factor}


class Energy:
  def __call__(self, y, context, params, aux):
    return FACTOR * jnp.sum(y ** 2)


class Anything:
  def __getattr__(self, name):  # answers every attribute
    return self


ANY = Anything()


def _base(y, context, params, aux, phi, scale, helper):
  return scale * jnp.sum(phi(helper(y)))


def energy(y, context, params, aux):
  MEMO[y.shape] = MEMO.get(y.shape, 0) + 1
  noise = jax.random.normal(KEY, y.shape[-1:])
  return jnp.sum(ACTS["sq"](y) * HP.tau * SCALE) + 0.0 * jnp.sum(noise) + 0 * len(NAMES) + (
      0 * len(LOOP)) + 0 * (ANY is None) + 0 * len(WORDS)


called = Energy()
mixed = functools.partial(_base, phi=jnp.tanh, scale={scale}, helper=_sq)
"""


def test_what_an_energy_reads_through_containers_objects_and_partials_is_pinned(tmp_path):
  # An adversarial review's cases: each edit below went unnoticed, or the digest crashed
  # (a PRNG key), recursed without end (a list holding itself, an object answering every
  # attribute) or changed with nothing edited (a memo that tracing fills).
  base = {"key": "0", "scale": "2.0", "scale_value": "np.float64(2.0)", "name": "b",
          "power": "2", "tau": "2.0", "factor": "1.0"}
  names = ("energy", "called", "mixed")

  def digests(traced=False, **edit):
    path = tmp_path / f"r{len(list(tmp_path.iterdir()))}.py"
    path.write_text(READS.format(**{**base, **edit}))
    if traced:  # as preflight and training do before a tables run records the digest
      y = jnp.ones((1, 3, 4))
      energies.get(f"{path}:energy", "attention").energy(y, y, {}, None)  # fills MEMO
    return {n: energies.source_digest(f"{path}:{n}", "attention") for n in names}

  first = digests()
  assert first == digests(traced=True) and all(first.values())
  changed = lambda **edit: {n for n, d in digests(**edit).items() if d != first[n]}  # noqa: E731
  assert changed(key="1") == {"energy"}  # a PRNG key, by its key data
  assert changed(name="c") == {"energy"}  # an object array, by its elements
  assert changed(power="3") == {"energy", "mixed"}  # a helper in a dict; a partial's helper
  assert changed(tau="3.0") == {"energy"}  # a frozen dataclass's field
  assert changed(factor="2.0") == {"called"}  # a callable object's __call__
  assert changed(scale_value="np.float64(3.0)") == {"energy"}  # a NumPy scalar
  assert changed(scale="3.0") == {"mixed"}  # a partial's number
  # A NumPy scalar counts by value, as a 0-d array (its repr changed with NumPy 2).
  assert changed(scale_value="np.array(2.0)") == set()
  # Another process (another hash seed: a set's order) gives the same digests.
  path = tmp_path / "r0.py"
  proc = subprocess.run(
      [sys.executable, "-c", "from cem_jax import energies; print([energies.source_digest("
       f"'{path}:' + n, 'attention') for n in {names!r}])"],
      capture_output=True, text=True, timeout=300, env=subprocess_env(PYTHONHASHSEED="7"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip().splitlines()[-1] == repr([first[n] for n in names])


DEFAULTS_AND_NESTED = """
import jax.numpy as jnp

SCALE = {scale}
KW_SCALE = {kw_scale}
TAU = {tau}


def by_default(y, context, params, aux, scale=SCALE):
  return scale * jnp.sum(y ** 2)


def by_keyword(y, context, params, aux, *, scale=KW_SCALE):
  return scale * jnp.sum(y ** 2)


def in_a_lambda(y, context, params, aux):
  f = lambda x: TAU * x  # noqa: E731
  return jnp.sum(f(y) ** 2)


def in_a_generator(y, context, params, aux):
  return sum(jnp.sum(t * y ** 2) for t in (TAU,))


def _c(x):
  return x * DEEP


def _b(x):
  return _c(x)


def _a(x):
  return _b(x)


DEEP = {deep}


def in_a_chain(y, context, params, aux):  # DEEP is read 4 helpers down
  return jnp.sum(_a(y) ** 2)
"""


def test_defaults_and_the_names_a_lambda_or_generator_reads_are_pinned(tmp_path):
  # None of these edits changes a function's own source: a default is evaluated where the
  # function is defined (SCALE is not among the names its code reads), and a lambda's or a
  # generator's names are those of its own code object, a constant of the function's code.
  base = {"scale": "2.0", "kw_scale": "2.0", "tau": "2.0", "deep": "2.0"}
  names = ("by_default", "by_keyword", "in_a_lambda", "in_a_generator", "in_a_chain")

  def digests(**edit):
    path = tmp_path / f"d{len(list(tmp_path.iterdir()))}.py"
    path.write_text(DEFAULTS_AND_NESTED.format(**{**base, **edit}))
    return {n: energies.source_digest(f"{path}:{n}", "attention") for n in names}

  first = digests()
  assert first == digests() and len(set(first.values())) == len(names)
  changed = lambda **edit: {n for n, d in digests(**edit).items() if d != first[n]}  # noqa: E731
  assert changed(scale="3.0") == {"by_default"}  # __defaults__
  assert changed(kw_scale="3.0") == {"by_keyword"}  # __kwdefaults__
  assert changed(tau="3.0") == {"in_a_lambda", "in_a_generator"}  # nested code's names
  assert changed(deep="3.0") == {"in_a_chain"}  # helpers of helpers, to a depth


def test_a_function_of_another_module_counts_by_name_only(tmp_path, monkeypatch):
  import importlib.util

  # An upgrade of jax (or an edit of a helper file) must not refuse a resume: what an energy
  # reads from another module is pinned by its name, not its source. The same energy file
  # text, read once against each of two versions of the helper module, has one digest.
  energy = ("import jax.numpy as jnp\nfrom cem_jax_digest_helper import smooth\n\n\n"
            "def energy(y, context, params, aux):\n  return jnp.sum(smooth(y))\n")
  found = []
  for i, body in enumerate(("x ** 2", "x ** 4")):
    helper = tmp_path / f"v{i}" / "cem_jax_digest_helper.py"  # a file: its source is read
    helper.parent.mkdir()
    helper.write_text(f"def smooth(x):\n  return {body}\n")
    spec = importlib.util.spec_from_file_location("cem_jax_digest_helper", helper)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "cem_jax_digest_helper", module)
    path = tmp_path / f"h{i}.py"
    path.write_text(energy)
    found.append(energies.source_digest(f"{path}:energy", "attention"))
  assert found[0] is not None and found[0] == found[1]


def test_a_checkpoint_of_the_first_digest_version_resumes_unless_the_function_changed(
    tmp_path):
  # Checkpoints saved before version 2 hold source-only digests: compared as such, the same
  # function resumes (its constants unchecked, as then); an edited one is still refused.
  # (A function reading no constant or helper has the same digest in both versions.)
  fields = {"w": "3.0", "unused": "1", "comment": "a", "scale": "2.0", "rule": "2.0"}

  def config(name, tau="2.0", note="a"):
    path = tmp_path / f"{name}.py"
    path.write_text(DIGESTED.format(**{**fields, "tau": tau, "note": note}))
    return tiny_config("cem", **{"model.attention_energy": f"{path}:energy"})

  def refuse(saved, config, digests, checkpoint):
    meta = runs.CheckpointMeta.from_dict({**saved, "numerics_version": NUMERICS_VERSION})
    runs.refuse_other_run(meta, config, checkpoint, digests)

  cfg = config("e")
  old = {"energies": energies.energy_digests(cfg, 1)}
  assert old["energies"] != energies.energy_digests(cfg)
  for saved in (old, {**old, "energy_digest_version": 1}):
    refuse(saved, cfg, energies.energy_digests(cfg), "ck")
  tau = config("tau", tau="0.25")  # not seen by a version-1 digest
  refuse(old, tau, energies.energy_digests(tau), "ck")
  edited = config("edited", note="b")
  with pytest.raises(ValueError, match=r"^checkpoint ck is another model \(model.attention_"
                                       r"energy: its source, or a constant or helper it reads, "
                                       r"changed \(sha256 "):
    refuse(old, edited, energies.energy_digests(edited), "ck")
  # A version-2 checkpoint is compared by version 2: the edited constant is refused.
  new = {"energies": energies.energy_digests(cfg), "energy_digest_version": 2}
  refuse(new, cfg, energies.energy_digests(cfg), "ck")
  with pytest.raises(ValueError, match=r"^checkpoint ck is another model \(model.attention_"
                                       r"energy: its source, or a constant or helper it reads, "
                                       r"changed \(sha256 "):
    refuse(new, tau, energies.energy_digests(tau), "ck")
  # A checkpoint of newer code (a digest version this code does not know): said, naming it.
  with pytest.raises(ValueError, match=r"^checkpoint ck records energy digests of version 3, "
                                       r"this code knows 1 and 2: load it with the code that "
                                       r"saved it$"):
    refuse({**new, "energy_digest_version": 3}, cfg, energies.energy_digests(cfg), "ck")


STOPPED_ENERGY = """
import jax

from cem_jax.energies import interaction_energy


def energy(y, context, params, aux):  # y behind stop_gradient: its update is 0
  return interaction_energy(jax.lax.stop_gradient(y), context, params, aux)
"""


def test_a_run_whose_energy_a_check_now_refuses_is_read_with_a_warning_and_not_resumed(
    tmp_path, monkeypatch, caplog):
  # load_run runs the start-up checks: a run trained before a check existed (here the one of
  # a zero update, which passed this energy) could not be evaluated or sampled at all. Its
  # parameters were trained with the energy; reading them is said in a warning, training on
  # is refused.
  path = tmp_path / "e.py"
  path.write_text(STOPPED_ENERGY)
  workdir = tmp_path / "w"
  cfg = lambda steps: tiny_config("cem", **{  # noqa: E731
      "model.num_layers": 1, "model.attention_energy": f"{path}:energy",
      "model.learn_eta": False, "train.num_steps": steps, "checkpoint.every_steps": 2,
      "train.eval_every_steps": 2})
  with monkeypatch.context() as m:  # the checks before the zero-update one was added
    m.setattr(energy_checks, "_check_zero_update", lambda *args: None)
    train.train_and_evaluate(cfg(2), str(workdir))
  refusal = (f"model.attention_energy='{path}:energy': its update (jax.grad of the energy) is "
             "0 on random float32 inputs, but the energy's value changes with y: ")
  with caplog.at_level(logging.WARNING):
    assert runs.load_run(str(workdir))[-1] == 2
  said = [r.getMessage() for r in caplog.records if "saved run" in r.getMessage()]
  assert len(said) == 1 and said[0].startswith(refusal), said
  assert said[0].endswith("(a start-up check that training refuses; this saved run is read "
                          "anyway)") and "\n" not in said[0]
  with monkeypatch.context() as m, pytest.raises(ValueError, match=re.escape(refusal)):
    m.setattr(train.workdir_lib, "build_data_once", _refused_before_the_data_is_built)
    train.train_and_evaluate(cfg(4), str(workdir))


def test_evaluating_a_run_whose_energy_was_edited_since_is_refused(tmp_path, monkeypatch):
  # evaluate and sample loaded the checkpoint's parameters under the edited energy without a
  # word: numbers of a model nobody trained.
  path = tmp_path / "e.py"
  path.write_text(USER_ENERGY.format(scale="1.0"))
  workdir = tmp_path / "w"
  train.train_and_evaluate(tiny_config("cem", **{
      "model.num_layers": 1, "model.attention_energy": f"{path}:energy",
      "train.num_steps": 2, "checkpoint.every_steps": 2, "train.eval_every_steps": 2}),
      str(workdir))
  assert runs.load_run(str(workdir))[-1] == 2  # unedited: loads
  summary.check_energies_unedited(str(workdir), runs.run_config(str(workdir)))
  path.write_text(USER_ENERGY.format(scale="2.0"))
  # As a new process would meet it: imported and pinned again (once a process each).
  monkeypatch.delitem(sys.modules, energies.get(f"{path}:energy", "attention").energy.__module__)
  monkeypatch.setattr(energies.digest, "_PINNED", {})
  checkpoint = re.escape(str(workdir / "checkpoints" / "2"))
  with pytest.raises(ValueError, match=(
      rf"^checkpoint {checkpoint} was trained with another version of its energy \(model\."
      r"attention_energy: its source, or a constant or helper it reads, changed \(sha256 "
      r"[0-9a-f]{12} -> [0-9a-f]{12}\)\): load it with the energy it was trained with$")):
    runs.load_run(str(workdir))
  # inspect --workdir too: its summary would describe a model never trained.
  with pytest.raises(ValueError, match=(
      rf"^checkpoint {checkpoint} was trained with another version of its energy \(model\."
      r"attention_energy: .*\): the summary would describe a model never trained; restore the "
      r"energy it was trained with$")):
    summary.check_energies_unedited(str(workdir), runs.run_config(str(workdir)))


def test_training_with_a_registered_name_says_the_run_cannot_be_reloaded(tmp_path, caplog):
  # evaluate, sample and tables reload a run in a fresh process, where the name is unknown:
  # said when training starts, not found out at the first evaluate. So is a script's own
  # '__main__:energy', which trained without a word and which evaluate then looked up in
  # itself ("module '__main__' has no function 'energy'"; found training from a script).
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    train._warn_unreloadable(tiny_config("cem", **{"model.mlp_energy": "__main__:energy"}))
  assert [r.getMessage() for r in caplog.records] == [
      "model.mlp_energy='__main__:energy' is a function of the program running: evaluate and "
      "sample, programs of their own, cannot reload this run; name the energy by its "
      "'file.py:function' to reload it"]
  path = tmp_path / "e.py"
  path.write_text(USER_ENERGY.format(scale="1.0"))
  energies.register("test_reload_name", "attention", _scaled_energy)
  try:
    for name, warned in (("test_reload_name", True), ("softmax", False),
                         (f"{path}:energy", False)):
      caplog.clear()
      with caplog.at_level(logging.WARNING):
        train._warn_unreloadable(tiny_config("cem", **{"model.attention_energy": name}))
      said = [r.getMessage() for r in caplog.records]
      assert said == ([f"model.attention_energy='{name}' is a name registered in this process: "
                       "evaluate and sample cannot reload this run (tables only through a table "
                       "file that registers it); name the energy by its 'file.py:function' to "
                       "reload it"] if warned else []), name
    # The slot not in use is not looked at (a Llama, or cem_attention=False).
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      train._warn_unreloadable(tiny_config("cem", **{"model.attention_energy":
                                                     "test_reload_name",
                                                     "model.cem_attention": False}))
    assert not caplog.records
  finally:
    energies.registry._REGISTRY.pop("test_reload_name", None)


def test_source_digest_pins_wrapped_energies_and_says_when_it_cannot(caplog):
  import functools
  namespace = {}
  exec("def no_file(y, context, params, aux):\n  return 0.0 * y.sum()", namespace)  # noqa: S102
  wrapped = {
      "plain": _scaled_energy,
      "partial": functools.partial(_scaled_energy, scale=2.0),
      "custom_jvp": jax.custom_jvp(_scaled_energy),
      "jit": jax.jit(_scaled_energy),
      "object": _CallableEnergy(),
      "lambda": lambda y, context, params, aux: _scaled_energy(y, context, params, aux),
      "exec": namespace["no_file"],
  }
  digests = {}
  try:
    for kind, fn in wrapped.items():
      energies.register(f"digest_{kind}", "attention", fn)
      with caplog.at_level(logging.WARNING):
        digests[kind] = energies.source_digest(f"digest_{kind}", "attention")
  finally:
    for kind in wrapped:
      energies.registry._REGISTRY.pop(f"digest_{kind}", None)
  assert digests["exec"] is None and "keeps no source" in caplog.text
  pinned = {k: v for k, v in digests.items() if k != "exec"}
  assert all(pinned.values())
  # jax.jit computes the function it wraps: the same digest; the partial's scale=2.0 and the
  # custom_jvp's rules (none here) are part of the energy; so is the object's class.
  assert pinned["jit"] == pinned["plain"]
  assert len({pinned[k] for k in ("plain", "partial", "custom_jvp", "object", "lambda")}) == 5
  assert energies.source_digest("softmax", "attention") is None  # built-in: pinned by tests


def test_evaluate_rebuilds_the_model_the_checkpoint_was_saved_from(shared_data, tmp_path):
  # config.json is rewritten by every start that trains, and can be edited by hand: evaluate
  # must build the model the checkpoint holds, not the one config.json describes.
  import json

  from cem_jax import evaluate

  text, workdir = tmp_path / "text.txt", tmp_path / "w"
  # A copy to move away; 200 kB of it, as the BPE trains and the tokens are written twice.
  text.write_text((shared_data / "wikitext2_valid.txt").read_text()[:200_000])
  # One layer: the checkpoint's model is what is under test, not its depth (its steps are then
  # the device-limit test's, compiled once for the session).
  cfg = tiny_config("cem", **{"model.num_layers": 1, "train.num_steps": 4,
                              "train.eval_every_steps": 4, "data.files": str(text)})
  train.train_and_evaluate(cfg, str(workdir))
  trained = [m for m in read_metrics(str(workdir)) if "eval/loss" in m][-1]["eval/loss"]
  path = workdir / "config.json"
  saved = json.loads(path.read_text())
  saved["model"]["strict_causal"] = True
  path.write_text(json.dumps(saved))
  # And the raw text is gone: the checkpoint's own tokens in WORKDIR/data still serve. (One
  # evaluate for both: either read wrong fails it, another model by its loss, the text by
  # its absence.)
  original = text.read_text()
  text.unlink()
  row = evaluate.test_time_steps(str(workdir), [1], max_batches=cfg.eval.max_batches)[0]
  assert row["step"] == 4
  np.testing.assert_allclose(row["eval/loss"], trained, rtol=1e-6)
  # Those tokens deleted and other text under the same name: not the model's data.
  shutil.rmtree(workdir / "data")
  text.write_text(original.replace("the", "THE"))
  with pytest.raises(ValueError, match=r"^checkpoint .*/checkpoints/4 was trained on other "
                                       r"data \(tokenizer_sha256 "):
    evaluate.test_time_steps(str(workdir), [1], max_batches=cfg.eval.max_batches)


def test_cli_empty_corpus(texts, tmp_path):
  # A new workdir deep under an empty folder that was there: the folders the start made above
  # the workdir were left behind, empty (adversary start56's a/b); the one that was there stays.
  (tmp_path / "cfg.py").write_text(CONFIG_FILE)
  (tmp_path / "x").mkdir()
  workdir = tmp_path / "x" / "a" / "b" / "w"
  proc = _run_cli([f"--config={tmp_path / 'cfg.py'}", f"--workdir={workdir}",
                   f"--config.data.files={texts / 'empty.txt'}"])
  assert proc.returncode == 1
  assert _last_line(proc).startswith("error: data.files: the corpus is empty")
  assert os.listdir(tmp_path / "x") == []


@pytest.mark.parametrize("failing", ["check_processes_agree", "build_data_once"])
def test_a_failed_start_removes_the_empty_folders_it_made_above_the_workdir(failing, tmp_path,
                                                                          monkeypatch):
  # Only the empty ones it made: not x, which was there (empty), nor a, where something else
  # put a file meanwhile. Failing while the processes agree (_claim_workdir) or after, at the
  # data (_undo_start): both left x/a/b behind.
  def failing_after_a_file_in_a(*args, **kwargs):
    (tmp_path / "x" / "a" / "other.txt").write_text("not this start's")
    raise ValueError("refused")

  monkeypatch.setattr(workdir_lib, failing, failing_after_a_file_in_a)
  (tmp_path / "x").mkdir()
  with pytest.raises(ValueError, match="^refused$"):
    train.train_and_evaluate(tiny_config("llama"), str(tmp_path / "x" / "a" / "b" / "w"))
  assert sorted(os.listdir(tmp_path / "x")) == ["a"]
  assert sorted(os.listdir(tmp_path / "x" / "a")) == ["other.txt"]


def test_a_workdir_that_is_new_empty_or_a_run_passes(tmp_path):
  cli.check_workdir(str(tmp_path / "new"))  # made later by prepare_workdir
  cli.check_workdir(str(tmp_path))  # empty
  (tmp_path / "file").write_text("x")
  cli.check_workdir(str(tmp_path / "file"))  # no folder: prepare_workdir's one line
  hidden = tmp_path / "hidden"
  hidden.mkdir()
  (hidden / ".processes_see_this_0123").write_text("")  # a killed start's: no file of the user
  cli.check_workdir(str(hidden))
  # A run beside the user's notes; the prepared tokens a failed start keeps; a killed write's
  # temporary config.json (files.temporary_of).
  for entry in ("config.json", "checkpoints/", "data/", "metrics.jsonl",
                "config.json.12.0123456789ab.tmp"):
    run = tmp_path / entry.replace(".", "_").strip("/")
    run.mkdir()
    (run / "notes.txt").write_text("x")
    (run / entry).mkdir() if entry.endswith("/") else (run / entry).write_text("{}")
    cli.check_workdir(str(run))
  (hidden / "notes.txt").write_text("x")  # hidden entries never make it a run's
  with pytest.raises(ValueError, match=r"holds no run \(found: notes.txt\); allowed: "):
    cli.check_workdir(str(hidden))


def test_a_workdir_of_other_files_names_the_first_three_sorted_and_counts_the_rest(
    tmp_path, monkeypatch):
  for names, found in ((["d.py", "b.py", "c.py", "a.py"], "a.py, b.py, c.py, and 1 more"),
                       (["e", "d", "c", "b", "a"], "a, b, c, and 2 more"),
                       (["c", "a", "b"], "a, b, c")):
    folder = tmp_path / str(len(names))
    folder.mkdir()
    for name in names:
      (folder / name).write_text("x")
    with pytest.raises(ValueError) as e:
      cli.check_workdir(str(folder))
    assert str(e.value).startswith(f"--workdir={folder} holds no run (found: {found}); ")

  def refuse(path):
    raise PermissionError(errno.EACCES, "Permission denied", path)

  monkeypatch.setattr(cli.os, "listdir", refuse)  # root reads any folder: refused here
  with pytest.raises(ValueError) as e:
    cli.check_workdir(str(tmp_path))
  assert str(e.value) == (f"--workdir={tmp_path}: cannot list it (Permission denied); allowed: "
                          "a folder this user can read and write")


def test_main_says_which_default_arg_a_config_file_trains(tmp_path):
  # `--config=experiments/design.py` trained its 't2' without a word (adv: a newcomer's first
  # run of the design file took it for the whole design space).
  # main up to the training loop, which is replaced: what it says before training starts.
  code = ("import runpy, signal, sys\nfrom cem_jax import train\n"
          "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
          "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
          "train.train_and_evaluate = lambda config, workdir: None\n"
          f"sys.argv = ['main', '--config=experiments/design.py', '--workdir={tmp_path / 'w'}']\n"
          "runpy.run_module('cem_jax.main', run_name='__main__')\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  said = [ln for ln in proc.stderr.splitlines() if "default arg" in ln]
  assert len(said) == 1 and said[0].endswith(
      "--config=experiments/design.py: get_config's default arg 't2' (choose one with "
      "--config=experiments/design.py:ARG)"), proc.stderr
  # Named, or a file whose get_config takes no arg: no such line.
  assert cli.default_config_arg("experiments/design.py:precond") is None
  (tmp_path / "plain.py").write_text("def get_config():\n  return None\n")
  assert cli.default_config_arg(str(tmp_path / "plain.py")) is None
  # Every config file with a default arg names it in get_config's docstring.
  for path in sorted([*REPO.glob("experiments/*.py"), *REPO.glob("experiments/paper/*.py")]):
    if "def get_config(" not in path.read_text():  # a script, not a config file
      continue
    default = cli.default_config_arg(str(path))
    if default is not None:
      spec = importlib.util.spec_from_file_location("config_file", path)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      assert repr(default) in (module.get_config.__doc__ or ""), path


def test_cli_unwritable_workdir(tmp_path):
  (tmp_path / "cfg.py").write_text(CONFIG_FILE)
  (tmp_path / "a_file").write_text("not a folder")
  workdir = tmp_path / "a_file" / "w"
  proc = _run_cli([f"--config={tmp_path / 'cfg.py'}", f"--workdir={workdir}"])
  assert proc.returncode == 1
  line = _last_line(proc)
  assert line.startswith(f"error: --workdir='{workdir}' is not a writable folder (")
  assert line.endswith("; choose another --workdir or fix its permissions")
  assert (tmp_path / "a_file").read_text() == "not a folder"


# What follows "unexpected arguments: ARGS" (cli.no_extra_args): what is allowed, and the likely
# slip.
STRAY_ARGS = ("; allowed: only --NAME=VALUE flags (a flag missing its --, or a space in a value "
              "not quoted?)")


def test_main_passes_its_flags_on_and_reports_a_diverged_run_in_one_line(tmp_path, monkeypatch,
                                                                         capsys):
  # main itself, in this process (a program started per case costs seconds): importing it
  # defines no flags, so its FLAGS, the distributed start and the training are stand-ins.
  from cem_jax import distributed
  from cem_jax import main as main_lib

  with pytest.raises(SystemExit) as stopped:
    main_lib.main(["main", "extra"])
  assert stopped.value.code == 1
  assert capsys.readouterr().err == f"error: unexpected arguments: extra{STRAY_ARGS}\n"
  workdir = os.fspath(tmp_path / "w")
  given = types.SimpleNamespace(distributed="on", coordinator_address="host:1234",
                                num_processes=3, process_id=2, workdir=workdir)
  monkeypatch.setattr(main_lib, "flags", types.SimpleNamespace(FLAGS=given))
  monkeypatch.setattr(main_lib.logging, "set_verbosity", lambda level: None)
  monkeypatch.setattr(cli, "quiet_libraries", lambda: None)
  calls = []
  monkeypatch.setattr(distributed, "initialize", lambda *args: calls.append(args))
  config = tiny_config("cem")
  config.model.attention_energy = "my/e.py:energy"  # relative: saved absolute
  monkeypatch.setattr(cli, "load_config", lambda: config)
  monkeypatch.setattr(cli, "default_config_arg", lambda: None)  # reads the --config flag

  def diverge(cfg, where):
    calls.append((cfg.model.attention_energy, where))
    raise FloatingPointError("non-finite loss or gradient in 3 consecutive steps")

  monkeypatch.setattr(train, "train_and_evaluate", diverge)
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit) as e:
    main_lib.main(["main"])
  assert e.value.code == 1
  assert capsys.readouterr().err == "error: non-finite loss or gradient in 3 consecutive steps\n"
  assert calls == [("on", "host:1234", 3, 2, workdir),  # the workdir: named to a second start
                   (f"{tmp_path}/my/e.py:energy", workdir)]


def test_cli_batch_not_divisible_by_data_parallel_devices(tmp_path):
  (tmp_path / "cfg.py").write_text(CONFIG_FILE)
  workdir = tmp_path / "w"
  proc = _run_cli([f"--config={tmp_path / 'cfg.py'}", f"--workdir={workdir}",
                   "--config.train.batch_size=6"], env=subprocess_env(4))
  assert proc.returncode == 1
  line = _last_line(proc)
  assert line.startswith("error: train.batch_size=6 is not divisible by the 4 data-parallel "
                         "devices (4 devices, ")
  assert line.endswith("; use a multiple of 4, e.g. 8")
  _assert_nothing_left(workdir)


def test_eval_padding_rows_have_zero_weight(shared_data, tmp_path):
  """The last eval batch is filled with zero-weight rows: any eval batch size gives the same
  metrics, over exactly the split's predicted tokens."""
  text = (shared_data / "tinyshakespeare.txt").read_text()[:40_000]
  (tmp_path / "eval.txt").write_text(text)
  cfg = tiny_config("llama", **{"data.files": str(tmp_path / "eval.txt"), "data.seq_len": 32,
                                "model.d_model": 32, "model.mlp_dim": 64, "model.num_heads": 2,
                                "model.num_layers": 1, "eval.max_batches": -1})
  data = data_lib.build_data(cfg, str(tmp_path / "w"))
  padded = next(b for b in (8, 7, 5, 3) if data.eval.num_windows % b)  # last batch padded
  assert data.eval.num_windows > padded
  graphdef, params = nnx.split(steps.build_model(cfg, data.tokenizer.vocab_size), nnx.Param)
  step = steps.make_eval_step(graphdef, None)
  results = {}
  for bs in (1, padded):
    cfg.eval.batch_size = bs
    results[bs] = steps.eval_loop(step, params, data, cfg)
  assert results[1]["eval/tokens"] == results[padded]["eval/tokens"] == data.eval.total_weight()
  for key in ("eval/loss", "eval/bits_per_byte"):
    np.testing.assert_allclose(results[padded][key], results[1][key], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Non-finite steps.


def test_nonfinite_steps_are_skipped_counted_and_k_in_a_row_stop_the_run(
    shared_data, tmp_path, monkeypatch):
  """NaN loss at step 3 (isolated) and at steps 6, 7, 8 (K = 3 in a row), then finite again.
  The guard is checked only at log/save steps (every 5): the run of three must still be caught
  at step 10, naming steps 6..8, with nothing saved after step 5."""
  bad = {3, 6, 7, 8}  # 1-based step numbers, as in metrics.jsonl
  real_batch = pipeline.TrainBatches.batch

  def batch(self, step, process_index=0, process_count=1):
    out = real_batch(self, step, process_index, process_count)
    if step + 1 in bad:
      out = dict(out, weights=np.full_like(out["weights"], np.nan))
    return out

  monkeypatch.setattr(pipeline.TrainBatches, "batch", batch)
  cfg = tiny_config("llama", **{"data.files": str(shared_data / "wikitext2_valid.txt"),
                                "model.d_model": 32, "model.mlp_dim": 64, "model.num_heads": 2,
                                "model.num_layers": 1, "data.seq_len": 32,
                                "train.batch_size": 4, "train.num_steps": 12,
                                "train.log_every_steps": 5, "train.eval_every_steps": 100,
                                "train.max_consecutive_nonfinite": 3,
                                "checkpoint.every_steps": 5, "eval.max_batches": 1})
  with pytest.raises(FloatingPointError) as e:
    train.train_and_evaluate(cfg, str(tmp_path))
  msg = str(e.value)
  assert "\n" not in msg
  assert msg.startswith("non-finite loss or gradient in 3 consecutive steps, steps 6..8 "
                        "(train.max_consecutive_nonfinite=3)")
  assert msg.endswith("; last checkpoint: step 5; lower train.learning_rate or raise "
                      "train.warmup_steps")
  lines = [m for m in read_metrics(str(tmp_path)) if "train/loss" in m]
  assert [m["step"] for m in lines] == [5]
  assert lines[0]["train/nonfinite_steps"] == 1  # step 3, skipped and counted

  ckpt = Checkpointer(str(tmp_path / "checkpoints"))
  assert ckpt.all_steps() == [5]
  # The state's shapes as the run laid them out (no model built: nothing to compute).
  tx = optim.make_optimizer(cfg.train)[0]
  _, params, opt_state, _, _ = steps.abstract_state(cfg, 512, tx,
                                                    sharding.make_mesh(cfg.mesh))
  state, meta = ckpt.restore(5, {"params": params, "opt_state": opt_state})
  ckpt.close()
  assert meta["step"] == 5
  assert bool(steps.all_finite(state))
  opt = state["opt_state"]
  assert int(opt.total_notfinite) == 1 and int(opt.notfinite_count) == 0
  # The inner (Adam, schedule) counters count applied updates only: 4 of the 5 steps.
  counts = [int(v) for p, v in jax.tree_util.tree_leaves_with_path(opt.inner_state)
            if jax.tree_util.keystr(p).endswith(".count")]
  assert counts and set(counts) == {4}


def test_a_save_after_k_nonfinite_steps_or_of_non_finite_parameters_is_refused():
  # A save between logs (checkpoint.every_steps off log_every_steps) checks the guard itself:
  # the log after it would name a checkpoint of the failed steps as the last one. Parameters
  # that are not all finite (one leaf is enough) are never saved either.
  saved = []
  run = types.SimpleNamespace(config=types.SimpleNamespace(seed=0), data=types.SimpleNamespace(
      identity={}), energies={}, parameters_from=None,
      ckpt=types.SimpleNamespace(save=lambda *a, **k: saved.append(a)))

  def loop(guard, params):
    loop = types.SimpleNamespace(run=run, guard=np.int32(guard), max_bad=3, last_saved=5,
                                 params=params, opt_state={}, resolved={},
                                 writer=types.SimpleNamespace(sync=lambda: None))
    loop.check_guard = lambda: train._Loop.check_guard(loop)
    loop.saved_text = lambda: train._Loop.saved_text(loop)
    loop.leaving_the_save = lambda: train._Loop.leaving_the_save(loop)
    return loop

  finite = {"w": jnp.ones(2), "b": jnp.zeros(2)}
  with pytest.raises(FloatingPointError, match=r"^non-finite loss or gradient in 3 consecutive "
                                               r"steps, steps 6\.\.8 .*; last checkpoint: step 5;"):
    train._Loop.save(loop(8, finite), 10, force=False)
  with pytest.raises(FloatingPointError, match=r"^non-finite parameters or optimizer state at "
                                               r"step 10, not saved; last checkpoint: step 5;"):
    train._Loop.save(loop(0, {**finite, "b": jnp.array([0.0, np.inf])}), 10, force=False)
  assert saved == []
  train._Loop.save(loop(0, finite), 10, force=False)
  assert [a[0] for a in saved] == [10] and saved[0][2]["step"] == 10


# ---------------------------------------------------------------------------------------------
# Reduced from public bug reports.


def test_custom_jvp_potential_has_the_plain_hessian():
  """A ``custom_jvp`` rule is differentiated again for second derivatives; a rule whose tangent
  is not itself differentiable (or ``jax.grad`` through ``spence``, NaN) would give a Hessian
  that differs from the plain function's. Φ_silu's must be silu' (central differences of an
  independent Φ) in both second-order modes, and
  Hessian-vector products through the MLP energy must be finite and match finite differences
  of the closed-form update."""
  z = np.concatenate([np.linspace(-30.0, 30.0, 61), [-2.0, 2.0, 1.999, 2.001, 1e-4]])
  h = 1e-3  # Φ'' from float64 central differences of an independent Φ (quadrature)
  silu_prime = (quadrature_phi_silu(z + h) - 2 * quadrature_phi_silu(z)
                + quadrature_phi_silu(z - h)) / h**2
  # Forward-over-reverse (jax.hessian) and reverse-over-reverse, in float32.
  for second in (jax.hessian, lambda g: jax.grad(jax.grad(g))):
    got = jax.vmap(second(energies.phi_silu))(jnp.asarray(z, jnp.float32))
    np.testing.assert_allclose(got, silu_prime, rtol=1e-5, atol=1e-6)

  energy, fused_update = energies.make_gated_energy("silu")
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)  # numpy: eager jax.random would compile op by op
    d, f = 8, 16
    params = {"w": jnp.asarray(rng.standard_normal((d, f)) / 3),
              "g": jnp.asarray(rng.standard_normal((d, f)) / 3), "eta": jnp.float64(0.7)}
    y, ctx, v = (jnp.asarray(rng.standard_normal((2, 3, d))) for _ in range(3))
    grad = jax.grad(lambda y_: energy(y_, ctx, params))
    hvp = jax.jit(lambda y_, v_: jax.jvp(grad, (y_,), (v_,))[1])(y, v)
    assert bool(jnp.all(jnp.isfinite(hvp)))
    eps = 1e-4  # -∇E is the fused update (float64 throughout): central differences of it
    fd = -(fused_update(y + eps * v, ctx, params) - fused_update(y - eps * v, ctx, params)) / (
        2 * eps)
    # The energy itself runs in float32 (by design), so agreement is to float32 precision.
    np.testing.assert_allclose(np.asarray(hvp), np.asarray(fd), rtol=2e-4, atol=2e-5)


# ---- the training step too large for the device ------------------------------------------


def test_footprint_counts_arguments_outputs_and_temporaries_once_with_donation():
  from cem_jax import memory

  mib, x = 2**20, jax.ShapeDtypeStruct((1024, 1024), jnp.float32)  # 4 MiB each
  f = lambda a, b: (a * 2, b.sum())  # noqa: E731
  plain = memory.footprint_bytes(jax.jit(f).lower(x, x).compile())
  donated = memory.footprint_bytes(jax.jit(f, donate_argnums=0).lower(x, x).compile())
  assert 12 * mib <= plain < 12 * mib + 1024  # two 4 MiB arguments, one 4 MiB output
  assert 8 * mib <= donated < 8 * mib + 1024  # the output reuses the donated argument
  # A temporary: a @ a, 4 MiB, lives between the two products.
  chained = memory.footprint_bytes(jax.jit(lambda a: (a @ a).T @ a).lower(x).compile())
  assert 12 * mib <= chained < 12 * mib + 1024


def test_a_training_step_over_the_device_limit_is_refused_at_start_up(tmp_path, monkeypatch,
                                                                        caplog):
  # The check compiles the step for the loop's own arguments, which reuse it: one compile (a
  # spec off by a dtype or a sharding would compile twice, doubling start-up at 125M on a
  # GPU), none for a finished run. Counted from jax's compile log, whose wording a jax
  # upgrade may change: then fix the count here. It is logged for an executable the
  # persistent compilation cache holds too (jax wraps compile-or-load in it), so the count is
  # the same warm or cold and the session's cache stays on (off, the refused starts below
  # compiled both steps again).
  from cem_jax import memory

  def compiles(name):
    return sum(f"Finished XLA compilation of jit({name})" in r.getMessage()
               for r in caplog.records)

  cfg = tiny_config("cem", **{"model.num_layers": 1, "train.num_steps": 2})
  need, real = {}, memory.compile_within_memory

  def against(train_offset, eval_offset=0):  # device limits of each step's footprint + offset
    def check(jitted, args, config, **kw):
      what = kw.get("what", "the training step")
      # Compiled here first; the check's own compile is then the same (cached) program. The
      # eval step counts the optimizer state held beside it: AdamW's two moments of every
      # parameter (and its counters).
      param_bytes = sum(x.nbytes for x in jax.tree.leaves(args[0]))
      resident = kw.get("resident", 0)
      assert (what == "the training step") == (resident == 0)
      assert resident == 0 or 2 * param_bytes <= resident < 2 * param_bytes + 256, resident
      need[what] = memory.footprint_bytes(jitted.lower(*args).compile()) + resident
      need[what, "resident"] = resident
      need[what, "call"] = (jitted, args, config)
      offset = train_offset if what == "the training step" else eval_offset
      return real(jitted, args, config, **{**kw, "limit_bytes": need[what] + offset})
    return check

  workdir = tmp_path / "w"
  monkeypatch.setattr(memory, "compile_within_memory", against(0))  # exactly large enough
  jax.config.update("jax_log_compiles", True)
  try:
    with caplog.at_level(logging.WARNING):
      train.train_and_evaluate(cfg, str(workdir))
      assert read_metrics(str(workdir))[-1]["step"] == 2
      assert (compiles("step"), compiles("eval_step")) == (1, 1)  # the eval at step 2 too
      caplog.clear()
      train.train_and_evaluate(cfg, str(workdir))  # finished: nothing to train or compile
      assert (compiles("step"), compiles("eval_step")) == (0, 0)
  finally:
    jax.config.update("jax_log_compiles", False)
  monkeypatch.setattr(memory, "compile_within_memory", against(-1))  # one byte too small
  fresh = tmp_path / "fresh"
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(cfg, str(fresh))
  step = need["the training step"]
  assert str(e.value) == (  # sizes that would read alike in MiB, in bytes
      f"the training step needs {step} bytes per device (XLA memory analysis), the "
      f"device allows {step - 1} bytes: raise "
      "train.gradient_accumulation_steps=1 to 2 (the same batch in smaller pieces), set "
      "model.remat='full' (now 'none'), set train.loss_block_size=32 (now 0; the logits of "
      "32 positions at a time), shard over more devices (mesh.fsdp=1), or lower "
      "data.seq_len=64 or train.batch_size=8")
  _assert_nothing_left(fresh, prepared=True)  # but for the tokens: a smaller step reuses them
  # The eval step too, at start-up, not at the first eval after hours of training.
  monkeypatch.setattr(memory, "compile_within_memory", against(0, -1))
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(cfg, str(fresh))
  step, held = need["the eval step"], memory._sizes(need["the eval step", "resident"])[0]
  assert str(e.value) == (
      f"the eval step needs {step} bytes per device (XLA memory analysis, with {held} of "
      f"optimizer state held beside it), the device allows {step - 1} bytes: lower "
      "eval.batch_size=16 to 8, set train.loss_block_size=32 (now 0; the logits of 32 "
      "positions at a time), or shard over more devices (mesh.fsdp=1)")
  _assert_nothing_left(fresh, prepared=True)
  # Without a limit given, the device's own is read (none on CPU: nothing refused).
  monkeypatch.setattr(memory, "device_limit_bytes", lambda device=None: 1)
  with pytest.raises(ValueError, match=r"^the training step needs .* allows 0\.0 MiB: "):
    real(*need["the training step", "call"])


def test_a_cpu_step_larger_than_the_host_or_than_it_can_give_now_is_refused(monkeypatch):
  # A CPU reports no device limit: a step over the host's free memory was killed by the kernel
  # (exit status 137) at its first step with no word; beyond what it had free (the other
  # processes' memory counting) it was only warned about, and died that way.
  from cem_jax import memory

  assert 0 < memory.host_available_bytes() <= memory.host_total_bytes()  # Linux's meminfo
  double = jax.jit(lambda x: x * 2)
  x = jnp.ones((4096,), jnp.float32)
  need = memory.footprint_bytes(double.lower(x).compile())  # on one device
  # More than the host's memory and swap: refused, as a GPU's limit (it ended in XLA's
  # traceback at the first step, e.g. 3352 GiB for seq_len 32768).
  monkeypatch.setattr(memory, "host_total_bytes", lambda: need - 1)
  with pytest.raises(ValueError, match=(
      rf"^the training step needs {need} bytes on this host's CPU devices \(XLA memory "
      rf"analysis\), more than its {need - 1} bytes of memory and swap: lower it$")):
    memory.compile_within_memory(double, (x,), tiny_config("llama"), advice="lower it")
  monkeypatch.setattr(memory, "host_total_bytes", lambda: None)
  for free, refused in ((need - 1, True), (need, False), (None, False)):
    monkeypatch.setattr(memory, "host_available_bytes", lambda free=free: free)
    if refused:
      with pytest.raises(ValueError) as e:
        memory.compile_within_memory(double, (x,), tiny_config("llama"), advice="lower it")
      assert str(e.value) == (
          f"the training step needs {need} bytes on this host's CPU devices (XLA memory "
          f"analysis), more than the {need - 1} bytes it can give now (MemAvailable + "
          "SwapFree; the rest is other processes'): lower it")
    else:
      memory.compile_within_memory(double, (x,), tiny_config("llama"), advice="lower it")


class _Compiled(Exception):
  """Raised by a stand-in for memory.compile_within_memory once it has what a test reads."""


def _train_footprint(cfg, workdir: Path, monkeypatch) -> int:
  """XLA's memory analysis of ``cfg``'s compiled training step (its host bytes on CPU), from
  the start-up of a real run stopped there."""
  from cem_jax import memory

  got = []

  def compiled_then_stop(jitted, args, config, **kwargs):
    got.append(memory.footprint_bytes(jitted.lower(*args).compile()))
    raise _Compiled

  monkeypatch.setattr(memory, "compile_within_memory", compiled_then_stop)
  with pytest.raises(_Compiled):
    train.train_and_evaluate(cfg, str(workdir))
  monkeypatch.undo()
  return got[0]


def test_the_attention_scores_bound_is_below_xlas_analysis_for_every_dense_model(
    tmp_path, monkeypatch):
  # The start-up refusal before compiling (check_attention_scores) must never refuse a step
  # that fits: its bytes are a lower bound of what XLA's analysis of the compiled step counts
  # (checked after the compile), at a seq_len where the scores are most of it. Each model kind
  # the bound covers, and none for the blocked energy, whose memory is linear in seq_len.
  from cem_jax import memory

  small = {"model.d_model": 32, "model.num_heads": 4, "model.mlp_dim": 64,
           "model.num_layers": 1, "data.seq_len": 512, "train.batch_size": 2,
           "eval.batch_size": 2}
  for i, (block, extra) in enumerate([("llama", {}), ("cem", {}),
                                      ("cem", {"model.cem_attention": False})]):
    cfg = tiny_config(block, **small, **extra)
    bound = memory.attention_scores_bytes(cfg, 2)
    assert bound == 2 * 4 * 512**2 * 4  # rows x heads x seq_len^2 x float32
    footprint = _train_footprint(cfg, tmp_path / f"w{i}", monkeypatch)
    assert bound <= footprint, (block, extra, bound, footprint)
  assert memory.attention_scores_bytes(tiny_config("cem", **{"model.dtype": "bfloat16"}),
                                       1) == 4 * 64**2 * 2
  assert memory.attention_scores_bytes(tiny_config("cem", **{"model.energy_block_size": 16}),
                                       2) is None


def test_attention_scores_too_large_for_the_host_are_refused_before_the_data_or_a_compile(
    tmp_path, monkeypatch):
  # experiments/tiny.py at data.seq_len=24576 was refused only after its training step's 16-30 s
  # compile (XLA's analysis: 1890 GiB); one layer's attention scores alone (144 GiB) show it at
  # once. Nothing is built, compiled or left; a host with exactly enough goes on.
  from cem_jax import memory

  def no_compile(*args, **kwargs):
    raise AssertionError("compiled")

  cfg = tiny_config("llama", **{"train.gradient_accumulation_steps": 2})  # seq_len 64
  train_need, eval_need = 4 * 4 * 64**2 * 4, 16 * 4 * 64**2 * 4  # microbatch 4 of 8; eval 16
  monkeypatch.setattr(memory, "compile_within_memory", no_compile)
  monkeypatch.setattr(data_lib, "build_data", no_compile)
  monkeypatch.setattr(memory, "host_available_bytes", lambda: None)
  monkeypatch.setattr(memory, "host_total_bytes", lambda: train_need - 1)
  fresh = tmp_path / "fresh"
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(cfg, str(fresh))
  assert str(e.value) == (
      f"data.seq_len=64 with train.batch_size=8 needs {train_need} bytes on this host for one "
      "layer's attention scores alone, before compiling (4 of this process's 8 rows at once x 4 "
      f"heads x 64^2, float32), more than its {train_need - 1} bytes of memory and swap: lower "
      "data.seq_len=64 or train.batch_size=8, or raise train.gradient_accumulation_steps=2 "
      "(the same batch in smaller pieces)")
  _assert_nothing_left(fresh)
  monkeypatch.setattr(memory, "host_total_bytes", lambda: eval_need - 1)
  with pytest.raises(ValueError, match=(
      rf"^data.seq_len=64 with eval.batch_size=16 needs {eval_need} bytes on this host for one "
      r"layer's attention scores alone, before compiling \(16 of this process's 16 rows at once"
      r" x 4 heads x 64\^2, float32\), more than its \d+ bytes of memory and swap: lower "
      r"data.seq_len=64 or eval.batch_size=16$")):
    train._check_batches_fit(cfg)
  monkeypatch.setattr(memory, "host_total_bytes", lambda: eval_need)  # exactly enough
  train._check_batches_fit(cfg)
  monkeypatch.setattr(memory, "host_available_bytes", lambda: eval_need - 1)  # not free now
  with pytest.raises(ValueError, match=r"eval.batch_size=16 .* it can give now \(MemAvailable"):
    train._check_batches_fit(cfg)


HOST_DEVICES_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from cem_jax import memory
from cem_jax.config import get_default_config

memory.host_available_bytes = lambda: None  # only the refusal by the total is read
cfg = get_default_config()
devices = jax.devices()


def placed(n, where):
  # float32 [n] with no sharding, on one device, or on a mesh of k devices (replicated or split)
  if where == "numpy":
    return np.ones((n,), np.float32)
  if where == "device 3":
    return jax.ShapeDtypeStruct((n,), jnp.float32,
                                sharding=jax.sharding.SingleDeviceSharding(devices[3]))
  k, spec = where.split()
  mesh = Mesh(np.array(devices[:int(k)]), ("d",))
  return jax.ShapeDtypeStruct((n,), jnp.float32,
                              sharding=NamedSharding(mesh, P() if spec == "replicated" else P("d")))


def fits(check, host):
  memory.host_total_bytes = lambda: host
  try:
    check()
    return True
  except ValueError:
    return False


double = jax.jit(lambda x: x * 2)
out = {}
for where in ("numpy", "device 3", "2 replicated", "2 split", "4 replicated", "4 split"):
  x = placed(4096, where)
  one = memory.footprint_bytes(double.lower(x).compile())
  step = lambda: memory.compile_within_memory(double, (x,), cfg, advice="lower it")
  params, opt_state = placed(256, where), placed(512, where)
  state_one = memory.resident_bytes((params, opt_state))
  state = lambda: memory.check_state_fits(params, opt_state, cfg)
  out[where] = {
      "step_bytes": one, "state_bytes": state_one,
      # The smallest host (memory and swap) each check lets through, in bytes per device.
      "step_fits": [fits(step, k * one + d) for k in (1, 2, 4) for d in (-1, 0)],
      "state_fits": [fits(state, k * state_one + d) for k in (1, 2, 4) for d in (-1, 0)],
      # A device limit given (a GPU's, a TPU's) is per device: the host is not read.
      "limited": [fits(lambda: memory.compile_within_memory(
          double, (x,), cfg, advice="lower it", limit_bytes=one + d), 0) for d in (-1, 0)],
  }
print(json.dumps(out))
"""


def test_the_cpu_memory_checks_count_the_devices_a_program_or_state_is_on_against_the_host():
  # CPU devices share the host's memory, and each holds its own copy of a replicated array:
  # the step's check and the state's compare the bytes per device (XLA's memory analysis of
  # the partitioned program; the state's shards) times the devices of this process the
  # program or state is placed on with the host's memory and swap. Not times every device of
  # the process: python -m cem_jax.evaluate's one-device eval step under 4 forced host devices
  # was counted 4 times. Per device: float32 [4096] in and out, 32768 bytes whole, a half or a
  # quarter of it split over 2 or 4 devices; the state 1024 + 2048 bytes whole.
  # Mutation: jax.local_device_count() as the multiplier (as it was) let "numpy", "device 3"
  # and the 2-device placements through only at 4 times their bytes.
  runs = program_json(["-c", HOST_DEVICES_SCRIPT], 4, timeout=120, cwd=REPO)
  on = {"numpy": 1, "device 3": 1, "2 replicated": 2, "2 split": 2, "4 replicated": 4,
        "4 split": 4}
  assert sorted(runs) == sorted(on)
  for where, rec in runs.items():
    devices = on[where]
    split = where.endswith("split")
    assert rec["step_bytes"] == 32768 // (devices if split else 1), (where, rec)
    assert rec["state_bytes"] == 3072 // (devices if split else 1), (where, rec)
    # Through at exactly the devices' bytes (k = devices, d = 0), refused a byte below.
    want = [k > devices or (k == devices and d == 0) for k in (1, 2, 4) for d in (-1, 0)]
    assert rec["step_fits"] == want and rec["state_fits"] == want, (where, rec)
    assert rec["limited"] == [False, True], (where, rec)


def test_a_batch_too_large_for_the_host_is_refused_at_start_up_counting_this_process_rows(
    tmp_path, monkeypatch):
  # train.batch_size=10**9 on tiny.py passed the config's checks, then ended in a MemoryError
  # traceback at start-up (process_slice filled a set of 10**9 rows) or the kernel's kill
  # (exit status 137). Refused now before the workdir, the data or the state are made.
  from cem_jax import sharding

  monkeypatch.setattr(memory, "host_available_bytes", lambda: None)  # free now: not read
  # The attention scores' bound (larger here than the batches) has tests of its own.
  monkeypatch.setattr(memory, "attention_scores_bytes", lambda config, rows: None)
  cfg = tiny_config("llama")  # seq_len 64, train batch 8, eval batch 16
  # Per position: inputs, targets, segment_ids (int32) and weights (float32); eval batches
  # also target_bytes (float32).
  train_need, eval_need = 8 * 64 * 16, 16 * 64 * 20
  fresh = tmp_path / "fresh"
  for field, rows, need in (("train.batch_size", 8, train_need),
                            ("eval.batch_size", 16, eval_need)):
    monkeypatch.setattr(memory, "host_total_bytes", lambda need=need: need - 1)
    with pytest.raises(ValueError) as e:
      train.train_and_evaluate(cfg, str(fresh))
    assert str(e.value) == (
        f"{field}={rows} needs {need} bytes on this host (this process's {rows} rows of "
        f"the batch, {need // rows} bytes each in NumPy), more than its {need - 1} bytes of "
        f"memory and swap: lower {field}={rows} or data.seq_len=64")
    _assert_nothing_left(fresh)
  monkeypatch.setattr(memory, "host_total_bytes", lambda: eval_need)
  train._check_batches_fit(cfg)  # exactly enough
  # One process of 4 holds a quarter of every batch: only its rows count, not the batch's.
  monkeypatch.setattr(sharding, "process_slice", lambda batch, rows: (1, 4))
  monkeypatch.setattr(memory, "host_total_bytes", lambda: eval_need // 4)
  train._check_batches_fit(cfg)
  monkeypatch.setattr(memory, "host_total_bytes", lambda: eval_need // 4 - 1)
  with pytest.raises(ValueError, match=rf"^eval.batch_size=16 needs {eval_need // 4} bytes on "
                     r"this host \(this process's 4 rows of the batch, "):
    train._check_batches_fit(cfg)
  # Absurd sizes against this machine's real memory; no row is ever listed.
  monkeypatch.undo()
  cfg.train.batch_size = 10**23
  with pytest.raises(ValueError, match=rf"^train.batch_size={10**23} needs \d+\.\d\d GiB on this "
                     rf"host \(this process's {10**23} rows of the batch, 1024 bytes each in "
                     r"NumPy\), more than its \d+\.\d\d GiB of memory and swap: lower "):
    train._check_batches_fit(cfg)


def test_a_model_too_large_for_memory_is_refused_before_its_parameters_are_made(monkeypatch):
  # Made first, the parameters failed in XLA (d_model=2**40: a NotImplementedError traceback
  # lowering the random init) or were killed for memory, before any step's memory check.
  from cem_jax import memory, optim, steps

  cfg = tiny_config("llama")  # d 64, mlp 128, 2 layers; vocabulary 512 below
  d, f, layers, vocab = 64, 128, 2, 512
  n = vocab * d + layers * (4 * d * d + 3 * d * f + 2 * d) + d  # tied: 115,008
  # float32 parameters, AdamW's two moments; the optimizer's few scalars well under 256 bytes
  need = 3 * 4 * n
  tx, _ = optim.make_optimizer(cfg.train)
  monkeypatch.setattr(memory, "device_limit_bytes", lambda device=None: need - 1)
  with pytest.raises(ValueError) as e:
    steps.init_state(cfg, vocab, tx)
  # need and the limit read alike in MiB: every size in bytes
  got = re.fullmatch(
      rf"the parameters \({4 * n} bytes\) and optimizer state \((\d+) bytes\) need (\d+) "
      rf"bytes per device, the device allows {need - 1} bytes: shard over more devices "
      r"\(mesh.fsdp=1\) or make the model smaller \(model.d_model=64, model.mlp_dim=128, "
      r"model.num_layers=2, data.vocab_size=512\)", str(e.value))
  assert got, str(e.value)
  assert 8 * n <= int(got[1]) < 8 * n + 256 and int(got[2]) == 4 * n + int(got[1])
  monkeypatch.setattr(memory, "device_limit_bytes", lambda device=None: need + 256)
  params = steps.init_state(cfg, vocab, tx)[1]
  assert sum(x.size for x in jax.tree.leaves(params)) == n
  # Absurd sizes are refused from their shapes alone, on CPU against the host's memory.
  monkeypatch.setattr(memory, "device_limit_bytes", lambda device=None: None)
  cfg = tiny_config("llama", **{"model.d_model": 2**40, "model.num_heads": 1,
                                "model.rope": False})
  with pytest.raises(ValueError, match=r"^the parameters \(.* GiB\) and optimizer state .* on "
                     r"this host's CPU devices, more than its memory and swap, .*d_model=1099"):
    steps.init_state(cfg, vocab, tx)


def test_xla_out_of_memory_at_compile_time_is_one_line_and_other_errors_pass():
  # TPU runs out of memory while compiling: XLA's status code, not its wording, is matched. A
  # real one: this CPU cannot allocate 2^50 bytes (refused before anything is allocated).
  from cem_jax import memory

  class Failing:
    def __init__(self, message=None):
      self.message = message

    def lower(self, *args):
      return self

    def compile(self):
      if self.message is None:
        jax.jit(lambda: jnp.zeros((2**48,), jnp.float32))()
      raise jax.errors.JaxRuntimeError(self.message)

  cfg = tiny_config("llama")
  with pytest.raises(ValueError) as e:
    memory.compile_within_memory(Failing(), (), cfg)
  xla, advice = str(e.value).split("): ")  # XLA's own words in between
  assert "\n" not in str(e.value)
  assert xla.startswith("the training step does not fit in device memory (XLA: "
                        "RESOURCE_EXHAUSTED: ")
  assert advice == (
      "raise train.gradient_accumulation_steps=1 to 2 (the same batch in smaller pieces), set "
      "model.remat='full' (now 'none'), set train.loss_block_size=32 (now 0; the logits of 32 "
      "positions at a time), shard over more devices (mesh.fsdp=1), or lower data.seq_len=64 "
      "or train.batch_size=8")
  # Nothing to suggest that cannot run (8 rows over 8 devices leave no room for
  # microbatches) or is already set.
  cfg.model.remat, cfg.train.loss_block_size = "full", 8
  with pytest.raises(ValueError) as e:
    memory.compile_within_memory(Failing(), (), cfg, data_parallel=8)
  assert str(e.value).endswith("): shard over more devices (mesh.fsdp=1), or lower "
                               "data.seq_len=64 or train.batch_size=8")
  # Smaller blocks than the ones in use; any divisor of seq_len (from 8 positions on).
  cfg.train.loss_block_size = 32
  assert "set train.loss_block_size=16 (now 32; " in memory._what_to_change(cfg, 8)
  cfg.train.loss_block_size, cfg.data.seq_len = 0, 48
  assert "set train.loss_block_size=24 (now 0; " in memory._what_to_change(cfg, 8)
  # The eval step's: half the eval batch on whole devices, none below one row per device.
  cfg.eval.batch_size = 32
  assert memory.eval_advice(cfg, 8).startswith("lower eval.batch_size=32 to 16, ")
  cfg.eval.batch_size = 8
  assert memory.eval_advice(cfg, 8).startswith("set train.loss_block_size=")
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: other"):
    memory.compile_within_memory(Failing("INTERNAL: other"), (), cfg)
  # The code decides, not the wording (an error made in Python has the code UNKNOWN).
  with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED: in words only"):
    memory.compile_within_memory(Failing("RESOURCE_EXHAUSTED: in words only"), (), cfg)


def test_the_eval_advice_halves_the_eval_batch_onto_whole_devices():
  cfg = tiny_config("llama")
  cfg.eval.batch_size = 40  # half is 20 rows: 16 on 8 devices (2 each), not 20
  assert memory.eval_advice(cfg, 8).startswith("lower eval.batch_size=40 to 16, ")
  cfg.eval.batch_size = 24
  assert memory.eval_advice(cfg, 8).startswith("lower eval.batch_size=24 to 8, ")


def test_sizes_read_in_gib_from_one_gib_in_mib_below_and_in_bytes_where_alike():
  gib, mib = 2**30, 2**20
  assert memory._sizes(3 * gib, 80 * gib) == ["3.00 GiB", "80.00 GiB"]
  assert memory._sizes(5 * mib, 1023 * mib) == ["5.0 MiB", "1023.0 MiB"]
  assert memory._sizes(mib, mib + 1) == ["1048576 bytes", "1048577 bytes"]


def test_the_loss_block_advice_is_the_largest_divisor_up_to_256_below_the_block_in_use():
  cfg = tiny_config("llama")
  cfg.data.seq_len, cfg.train.loss_block_size = 1024, 0
  assert "set train.loss_block_size=256 (now 0; " in memory._what_to_change(cfg, 1)
  cfg.data.seq_len, cfg.train.loss_block_size = 64, 16
  assert "set train.loss_block_size=8 (now 16; " in memory._what_to_change(cfg, 1)
  cfg.train.loss_block_size = 8  # not under 8 positions
  assert "loss_block_size=" not in memory._what_to_change(cfg, 1).split("or lower")[0]
  # Any remat policy but 'full' keeps activations that 'full' would recompute.
  cfg.model.remat = "dots"
  assert "set model.remat='full' (now 'dots'), " in memory._what_to_change(cfg, 1)


def test_the_footprint_log_line_names_the_need_and_the_limit(caplog):
  x = jax.ShapeDtypeStruct((512, 512), jnp.float32)  # 1 MiB in, 1 MiB out
  with caplog.at_level(logging.INFO):
    memory.compile_within_memory(jax.jit(lambda a: a * 2), (x,), tiny_config("llama"),
                                 limit_bytes=2**30)
  (line,) = [r.getMessage() for r in caplog.records if "per device" in r.getMessage()]
  assert line.startswith("the training step: 2.0 MiB per device of 1.00 GiB (XLA memory ")


def test_the_device_limit_is_the_backends_bytes_limit_and_none_where_it_reports_none():
  device = lambda stats: types.SimpleNamespace(memory_stats=lambda: stats)  # noqa: E731
  assert memory.device_limit_bytes(device({"bytes_limit": 2**34, "bytes_in_use": 5})) == 2**34
  # The limit the allocator enforces, not what it could reserve beyond it (GPU stats have both).
  assert memory.device_limit_bytes(device({"bytes_limit": 2**34, "bytes_reservable_limit":
                                           2**35, "bytes_in_use": 5})) == 2**34
  assert memory.device_limit_bytes(device(None)) is None  # CPU
  assert memory.device_limit_bytes(device({})) is None


def test_host_memory_is_meminfos_figures_in_kib_and_none_where_one_is_missing(monkeypatch):
  # /proc/meminfo's "kB" are KiB: 1000 would undercount a 64 GiB host by 1.6 GiB, and a step
  # that does not fit would pass. Its sums need every field they name.
  meminfo = {"all": "MemTotal:       16384 kB\nMemFree:          512 kB\n"
                    "MemAvailable:    4096 kB\nSwapTotal:       2048 kB\n"
                    "SwapFree:        1024 kB\n",
             "no swap lines": "MemTotal:       16384 kB\nMemAvailable:    4096 kB\n"}
  for name, text in meminfo.items():
    monkeypatch.setattr(memory, "open", lambda path, text=text, **kw: (
        io.StringIO(text) if path == "/proc/meminfo" else open(path, **kw)), raising=False)
    full = name == "all"
    assert memory.host_available_bytes() == ((4096 + 1024) * 1024 if full else None), name
    assert memory.host_total_bytes() == ((16384 + 2048) * 1024 if full else None), name
  monkeypatch.undo()
  # This machine's, against the file read here.
  fields = {}
  with open("/proc/meminfo", encoding="ascii") as f:
    for line in f:
      key, _, rest = line.partition(":")
      fields[key] = int(rest.split()[0]) * 1024
  assert memory.host_total_bytes() == fields["MemTotal"] + fields["SwapTotal"]


def test_the_cpu_checks_count_only_this_process_devices_and_at_least_one():
  # Another process's devices hold their shards in that host's memory, not this one's.
  here = jax.process_index()
  device = collections.namedtuple("Device", "id process_index")
  mixed = types.SimpleNamespace(device_set={device(0, here), device(1, here),
                                            device(2, here + 1), device(3, here + 1)})
  assert memory._local_devices([mixed]) == 2
  assert memory._local_devices([]) == 1  # NumPy arrays: one device


def test_only_cpu_devices_without_a_limit_are_judged_against_the_hosts_memory(monkeypatch):
  # CPU devices share the host's RAM (each its own copy of a replicated array); an accelerator
  # that reports no limit keeps its arrays in its own memory, not the host's.
  assert memory._host_need(100, None, 3) == 300  # this machine's CPU devices
  assert memory._host_need(100, 2**30, 3) is None  # a device limit applies per device
  monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [types.SimpleNamespace(
      platform="gpu")])
  assert memory._host_need(100, None, 3) is None


def test_an_error_is_out_of_memory_by_its_status_code_not_a_mention():
  # A jaxlib without error_code_string puts the code's name first in the message; an error of
  # another code that quotes the words (e.g. in a nested cause) is not one.
  assert memory._is_out_of_memory(Exception("RESOURCE_EXHAUSTED: Out of memory allocating"))
  assert not memory._is_out_of_memory(Exception("INTERNAL: RESOURCE_EXHAUSTED in a callee"))
  coded = Exception("no code in the text")
  coded.error_code_string = "RESOURCE_EXHAUSTED"
  assert memory._is_out_of_memory(coded)
  coded.error_code_string = "INTERNAL"
  assert not memory._is_out_of_memory(coded)


def test_resident_bytes_count_one_device_shard_of_each_array():
  # A [8, 4] float32 array split in 4 along its rows holds 2 x 4 x 4 bytes on each device.
  sharded = types.SimpleNamespace(shape=(8, 4), dtype=np.dtype(np.float32),
                                  sharding=types.SimpleNamespace(shard_shape=lambda s: (2, 4)))
  plain = np.zeros((3,), np.int64)  # no sharding: all of it
  assert memory.resident_bytes({"a": sharded, "b": plain}) == 2 * 4 * 4 + 3 * 8


def test_a_key_the_checkpoint_predates_is_compared_at_its_default(caplog):
  import types

  now = tiny_config("cem")
  old = now.to_dict()
  del old["train"]["loss_block_size"]  # a checkpoint saved before the key existed
  ckpt = types.SimpleNamespace(step_dir=lambda step: f"ckpt/{step}")
  run = types.SimpleNamespace(resume=2, start_step=2, meta=runs.CheckpointMeta(config=old),
                              config=now, ckpt=ckpt)
  with caplog.at_level(logging.INFO):
    train._log_resume(run, now.to_dict())
  assert not [r for r in caplog.records if "from the checkpoint's" in r.getMessage()]
  now.train.loss_block_size = 16
  with caplog.at_level(logging.INFO):
    train._log_resume(run, now.to_dict())
  assert [r.getMessage() for r in caplog.records if "from the checkpoint's" in r.getMessage()
          ] == ["computed differently from the checkpoint's run (the same numbers up to float "
                "rounding): train.loss_block_size: 0 -> 16"]


def test_a_resume_logs_each_changed_key_but_what_only_observes(caplog):
  import types

  now = tiny_config("cem", **{"data.files": "/old/a.txt"})
  old = now.to_dict()
  old["train"]["retired_key"] = 5  # a key removed since the checkpoint was saved
  old["train"]["retired_text"] = "(none)"  # removed too: not the same as no value
  ckpt = types.SimpleNamespace(step_dir=lambda step: f"ckpt/{step}")
  run = types.SimpleNamespace(resume=2, start_step=2, meta=runs.CheckpointMeta(config=old),
                              config=now, ckpt=ckpt)
  now.train.learning_rate = 0.001
  # which steps record a trace: computes nothing, not mentioned
  now.train.profile_steps, now.train.profile_first_step = 2, 7
  now.data.files = "/new/a.txt"  # a resume names every field that differs, paths included
  now.model.remat = "full"
  with caplog.at_level(logging.INFO):
    train._log_resume(run, now.to_dict())
  said = {r.levelname: r.getMessage() for r in caplog.records
          if "from the checkpoint's" in r.getMessage()}
  assert said == {
      "INFO": "computed differently from the checkpoint's run (the same numbers up to float "
              "rounding): model.remat: 'none' -> 'full'",
      "WARNING": "config differs from the checkpoint's: data.files: '/old/a.txt' -> "
                 "'/new/a.txt', train.learning_rate: 0.003 -> 0.001, train.retired_key: 5 -> "
                 "(none), train.retired_text: '(none)' -> (none)"}


def test_the_accumulation_advice_goes_up_to_one_row_per_microbatch():
  # batch 8 on one device, 4 microbatches: 5, 6 and 7 do not divide 8 rows; 8 (one row each)
  # does. On 8 devices nothing is left to suggest.
  cfg = tiny_config("llama", **{"train.gradient_accumulation_steps": 4})
  assert memory._what_to_change(cfg, 1).startswith(
      "raise train.gradient_accumulation_steps=4 to 8 (the same batch in smaller pieces), ")
  assert "gradient_accumulation_steps" not in memory._what_to_change(cfg, 8)


def test_an_out_of_memory_error_is_quoted_by_its_first_line(monkeypatch):
  # XLA's out-of-memory errors (TPU compiles) list the allocations over many lines.
  class Failing:
    def lower(self, *args):
      return self

    def compile(self):
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: 9.5G of 8G hbm\n  alloc 1: 4G\n")

  monkeypatch.setattr(memory, "_is_out_of_memory", lambda e: True)  # Python's code: UNKNOWN
  with pytest.raises(ValueError) as e:
    memory.compile_within_memory(Failing(), (), tiny_config("llama"))
  assert str(e.value).startswith("the training step does not fit in device memory (XLA: "
                                 "RESOURCE_EXHAUSTED: 9.5G of 8G hbm): raise ")
  assert "\n" not in str(e.value)


def test_a_numerics_version_saved_as_a_string_of_this_version_resumes():
  # Mutation (adversary s50): CheckpointMeta.from_dict without int() of numerics_version: a
  # hand-edited or string-typed "3" was refused as another version (3 != '3').
  meta = runs.CheckpointMeta.from_dict({"step": 4, "numerics_version": str(NUMERICS_VERSION)})
  assert meta.numerics_version == NUMERICS_VERSION
  runs.refuse_other_run(meta, tiny_config("cem"), "ck")  # no config, no energies: resumes
  with pytest.raises(ValueError, match="trained under numerics version 1, "):
    runs.refuse_other_run(runs.CheckpointMeta.from_dict({"numerics_version": "1"}),
                          tiny_config("cem"), "ck")


def test_a_positional_script_answers_help_and_refuses_a_flag(capsys):
  # experiments/attention_kernels.py took `--help` as its OUT path: it ran the benchmark and
  # wrote a file named --help; collectives.py looked for XLA dumps in a folder "--help".
  usage = "python experiments/x.py [OUT.json]"
  assert cli.script_args(["x.py", "a.json", "-"], "Doc.", usage) == ["a.json", "-"]
  for given in ("-h", "--help"):
    with pytest.raises(SystemExit) as stopped:
      cli.script_args(["x.py", "a.json", given], "  What x does.\n", usage)
    assert stopped.value.code == 0
    assert capsys.readouterr() == ("What x does.\n", "")
  with pytest.raises(SystemExit) as stopped:
    cli.script_args(["x.py", "--out=a.json", "-v"], "Doc.", usage)
  assert stopped.value.code == 1
  assert capsys.readouterr().err == (f"error: unexpected flag '--out=a.json'; allowed: {usage} "
                                     "(positional arguments; --help for more)\n")
  with pytest.raises(SystemExit) as stopped:  # one dash is a flag too, not a file name
    cli.script_args(["x.py", "a.json", "-v"], "Doc.", usage)
  assert (stopped.value.code, capsys.readouterr().err) == (
      1, f"error: unexpected flag '-v'; allowed: {usage} (positional arguments; --help for more)\n")


def test_closest_puts_initials_first_then_prefixes_and_gives_at_most_three():
  # Written out by hand: initials of the words, then names the misspelling begins (3+ letters).
  assert cli.closest("lr", ["lrate", "learning_rate", "warmup"]) == ["learning_rate"]
  assert cli.closest("bat", ["batch_a", "batch_b", "batch_c", "batch_d"]) == [
      "batch_a", "batch_b", "batch_c"]
  assert cli.closest("bat", ["batch", "big_a_t"]) == ["big_a_t", "batch"]  # initials first
  assert cli.closest("ba", ["bacon", "zzz"]) == []  # two letters begin too much to suggest


@pytest.mark.parametrize("tool", ["summary", "evaluate", "sample", "tables", "plot", "bench"])
def test_every_tool_refuses_stray_arguments(tool, capsys):
  # absl hands positional arguments to main: a flag missing its "--" (`workdir=w`) or a space
  # inside a value was dropped without a word.
  import importlib

  with pytest.raises(SystemExit) as stopped:
    importlib.import_module(f"cem_jax.{tool}").main(["prog", "workdir=w"])
  assert stopped.value.code == 1
  # One line: an absl UsageError printed the tool's whole usage (30-50 lines) above it.
  assert capsys.readouterr().err == f"error: unexpected arguments: workdir=w{STRAY_ARGS}\n"


@pytest.mark.parametrize("meta, message", [
    ({"numerics_version": "abc"}, "numerics_version='abc'; allowed: an integer >= 0"),
    ({"numerics_version": None}, "numerics_version=None; allowed: an integer >= 0"),
    ({"numerics_version": 3.7}, "numerics_version=3.7; allowed: an integer >= 0"),
    ({"step": "four"}, "step='four'; allowed: an integer >= 0"),
    ({"step": -1}, "step=-1; allowed: an integer >= 0"),  # a hand edit: no step is negative
    ({"numerics_version": -3}, "numerics_version=-3; allowed: an integer >= 0"),
    ({"energy_digest_version": True}, "energy_digest_version=True; allowed: an integer >= 0"),
    ({"config": [1]}, "config is a list, not an object"),
    ({"energies": "x"}, "energies is a str, not an object"),
    ({"parameters_from": 3}, "parameters_from is a int, not an object"),
    ([], "a list, not an object"),
])
def test_damaged_checkpoint_metadata_is_one_line_naming_the_checkpoint(meta, message):
  # A hand-edited or damaged meta JSON: "invalid literal for int()" without the checkpoint's
  # name, a TypeError traceback for null, 3.7 resumed as version 3, AttributeError tracebacks.
  with pytest.raises(ValueError) as e:
    runs.CheckpointMeta.from_dict(meta, "checkpoint WD/checkpoints/4")
  assert str(e.value) == f"checkpoint WD/checkpoints/4: damaged metadata: {message}"


def test_a_result_json_without_a_digest_version_is_compared_at_this_codes(tmp_path):
  # Mutation (adversary s50): runs.result_record taking a missing energy_digest_version as 1:
  # a table's result.json of an unedited user energy then counted as edited (or the reverse).
  path = tmp_path / "e.py"
  path.write_text("import jax.numpy as jnp\n\n\ndef energy(y, context, params, aux):\n"
                  "  return -0.5 * jnp.sum(params['eta'] * y ** 2)\n")
  cfg = tiny_config("cem", **{"model.mlp_energy": f"{path}:energy"})
  digests = energies.energy_digests(cfg)
  record = runs.result_record({"energy_digests": digests})
  assert record.energy_digest_version == energies.DIGEST_VERSION
  assert record.numerics_version == 1  # a result.json without one: version 1
  assert runs.edited_energies(record, cfg, "result.json") == []


def test_a_user_energy_the_record_lacks_or_that_is_gone_now_counts_as_changed(tmp_path):
  # A record names the user energies of its run; one that a slot uses now but the record
  # lacks (a record without a config to compare, e.g. a result.json) is not the energy that
  # run trained with, and neither is one recorded that is now a built-in.
  path = tmp_path / "e.py"
  path.write_text("import jax.numpy as jnp\n\n\ndef energy(y, context, params, aux):\n"
                  "  return -0.5 * jnp.sum(params['eta'] * y ** 2)\n")
  both = tiny_config("cem", **{"model.mlp_energy": f"{path}:energy",
                               "model.attention_energy": f"{path}:energy"})
  now = energies.energy_digests(both)
  assert sorted(now) == ["model.attention_energy", "model.mlp_energy"]
  only_mlp = {"model.mlp_energy": now["model.mlp_energy"]}
  version = energies.DIGEST_VERSION
  short = now["model.attention_energy"][:12]
  assert energies.changed_energies(only_mlp, version, both, None, "r.json") == [
      f"model.attention_energy: its source, or a constant or helper it reads, changed (sha256 "
      f"none -> {short})"]
  mlp_builtin = tiny_config("cem", **{"model.attention_energy": f"{path}:energy"})
  assert energies.changed_energies(now, version, mlp_builtin, None, "r.json") == [
      f"model.mlp_energy: its source, or a constant or helper it reads, changed (sha256 "
      f"{now['model.mlp_energy'][:12]} -> none)"]
  assert energies.changed_energies(now, version, both, None, "r.json") == []
  assert energies.changed_energies({}, version, both, None, "r.json") == []  # not recorded


def test_a_failed_start_removes_all_but_its_prepared_tokens(tmp_path):
  # Mutation (adversary s50): workdir.remove_failed_start leaving config.json, metrics and
  # checkpoints behind when tokens were prepared (a failed start that looks like a run).
  from cem_jax import workdir as workdir_lib

  run = tmp_path / "w"
  (run / "data" / "abc").mkdir(parents=True)
  (run / "data" / "abc" / "manifest.json").write_text("{}")
  (run / "checkpoints" / "2").mkdir(parents=True)
  (run / "config.json").write_text("{}")
  (run / "metrics.jsonl").write_text("")
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep.txt").write_text("x")
  (run / "link").symlink_to(outside)
  workdir_lib.remove_failed_start(str(run))
  assert sorted(os.listdir(run)) == ["data"]
  assert (run / "data" / "abc" / "manifest.json").is_file()
  assert (outside / "keep.txt").is_file()  # the link removed, not what it points to
  bare = tmp_path / "bare"
  (bare / "data").mkdir(parents=True)  # no tokens prepared: nothing worth keeping
  (bare / "config.json").write_text("{}")
  workdir_lib.remove_failed_start(str(bare))
  assert not bare.exists()
