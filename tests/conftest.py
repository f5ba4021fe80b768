"""Shared fixtures: where the shared corpora live and a tiny training config."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


# Less XLA optimisation and XLA's older CPU code emitters: the tests' tiny programs compile
# several times faster (a train step 3-4x with the emitters alone: CEM on 2 x 2 x 2 devices 3.9
# -> 1.2 s of CPU, Llama 2.6 -> 0.65). The optimisation level took a third off the suite; the
# emitters in its own process too (not only in the programs it starts) another fifth (2 cores,
# 2026-12-07: 15 min 34 s -> 12 min 14 s). What the tests check does not move: these change the
# code emitted, not the maths, the layouts or the memory plans, and test_golden.py checks the
# golden numbers once more as training compiles them (no flag set), to rel 1e-5. XLA_FLAGS
# that set their own --xla_backend_optimization_level (say =3) test at that level instead.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                "--xla_cpu_use_fusion_emitters=false")
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def pytest_configure(config):
  """The session's XLA flags (``FAST_COMPILE``) and one persistent jax compilation cache for
  the whole session: its workers (pytest-xdist) and the programs tests start inherit both.
  Many tests compile the same tiny programs; a cached executable is the same program, so no
  number changes. The cache is removed at the end of the session."""
  if "PYTEST_XDIST_WORKER" in os.environ:
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_backend_optimization_level" not in flags:
    os.environ["XLA_FLAGS"] = " ".join([*flags.split(), *FAST_COMPILE])
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return
  config._cem_jax_cache = tempfile.mkdtemp(prefix="cem_jax_jit_cache_")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=config._cem_jax_cache,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def pytest_unconfigure(config):
  cache = getattr(config, "_cem_jax_cache", None)
  if cache:
    shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_pytest_folder(tmp_path_factory):
  """This process's temporary files go to the session's pytest folder, which pytest rotates:
  TFDS leaves an empty ``/tmp/tmp*tfds`` folder each time it builds an unprepared dataset."""
  saved = tempfile.tempdir
  tempfile.tempdir = os.fspath(tmp_path_factory.mktemp("tempfile"))
  yield
  tempfile.tempdir = saved


def subprocess_env(devices: int = 1, **extra: str) -> dict:
  """The environment for a program a test starts: this session's (its XLA flags and
  compilation cache), on the CPU with ``devices`` forced host devices, plus the environment
  variables ``extra``."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith(_DEVICE_COUNT_FLAG)]
  flags.append(f"{_DEVICE_COUNT_FLAG}={devices}")
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags), **extra)


def as_in_a_terminal(cmd: list[str]) -> list[str]:
  """``cmd`` (a program and its arguments) started with SIGINT and SIGTERM at their defaults,
  as a terminal's foreground job has them, whatever pytest's are: a command started in the
  background by a non-interactive shell (``nohup bash .ci/run &``) inherits SIGINT ignored, and
  Python keeps it so. A small Python sets them and becomes ``cmd`` (exec: the same pid); not
  Popen's ``preexec_fn``, which runs Python in a fork of the test process, which jax's threads
  make unsafe."""
  return [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
          "signal.SIG_DFL); signal.signal(signal.SIGTERM, signal.SIG_DFL); "
          "os.execv(sys.argv[1], sys.argv[1:])", *cmd]


# ``python -c RUN_MODULE_REPORTING_JAX MODULE ARGS...`` runs ``python -m MODULE ARGS...`` (runpy,
# as -m does) and prints its exit status and which of jax and flax it imported, e.g. ``1 []``:
# for the tools' refusals that must come before jax's seconds of start-up.
RUN_MODULE_REPORTING_JAX = (
    "import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n"
    "  runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
    "except SystemExit as e:\n"
    "  print(e.code, sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax'}))")


def program_json(args: list[str], devices: int, timeout: float = 120, **run_kwargs):
  """Runs ``python *args`` on ``devices`` forced CPU devices (:func:`subprocess_env`) and
  returns the JSON its last line of stdout holds; a failed run
  fails the test with its stderr's tail."""
  proc = subprocess.run([sys.executable, *args], env=subprocess_env(devices),
                        capture_output=True, text=True, timeout=timeout, **run_kwargs)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


# The tool's __main__ block runs once; app.run runs main once per case, its flags reset
# between them. Its signals set as a terminal leaves them, whatever pytest's are.
_TOOL_CASES = """
import contextlib, io, json, runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
from absl import app, flags
tool, cases = sys.argv[1], json.load(sys.stdin)
out, real_run = [], app.run
def run_cases(main, argv=None, flags_parser=None):
  for args in cases:
    if flags.FLAGS.is_parsed():
      flags.FLAGS.unparse_flags()
    out_, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out_), contextlib.redirect_stderr(err):
      try:
        real_run(main, argv=[tool, *args], flags_parser=flags_parser)
        code = 0
      except SystemExit as e:
        code = e.code
    loaded = sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax'})
    out.append([code, out_.getvalue(), err.getvalue(), loaded])
app.run = run_cases
runpy.run_module(f"cem_jax.{tool}", run_name="__main__")
print(json.dumps(out))
"""


def tool_runs(tool: str, cases: list[list[str]]) -> list[tuple[int, str, str, list[str]]]:
  """``(exit status, stdout, stderr, loaded)`` of ``python -m cem_jax.TOOL`` for each of
  ``cases`` (its arguments), in one interpreter (one jax start-up for all cases of a tool that
  imports it): its ``__main__`` block runs once, ``app.run`` runs ``main`` once per case.
  ``loaded``: which of jax and flax the interpreter had imported once the case ended (by then or
  by an earlier case: a refusal that comes before them has ``[]``)."""
  proc = subprocess.run([sys.executable, "-c", _TOOL_CASES, tool], input=json.dumps(cases),
                        cwd=Path(__file__).resolve().parents[1], env=subprocess_env(),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [tuple(r) for r in json.loads(proc.stdout.splitlines()[-1])]


def count_compiles():
  """A ``collections.Counter`` of the executables jax makes from here on (compiled, or read
  from the persistent cache), by function name (``'jit(step)'``): for programs that check
  what is compiled again, not how long it takes."""
  import collections

  import jax

  made = collections.Counter()
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, secs, fun_name=None, **_: made.update(
          [fun_name] if event == "/jax/core/compile/backend_compile_duration" else []))
  return made


def float_collectives(hlo_text: str, *dims: int) -> list[str]:
  """``'kind result'`` of each collective in a compiled program's HLO text whose result is a
  float array with a shape starting with ``dims``: e.g. ``(8, 32)``, a batch's 8 rows of 32
  positions brought whole onto a device. Parsed by ``experiments/collectives.py``."""
  sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
  import collectives

  shape = re.compile(r"(f32|bf16)\[" + ",".join(map(str, dims)) + r"[,\]]")
  return [f"{kind} {result}" for kind, result in collectives.results(hlo_text)
          if shape.search(result)]


@pytest.fixture(autouse=True)
def _steps_compiled_afresh():
  """Each test compiles its own steps: ``cem_jax.steps`` caches the jitted steps per config for
  a process's later runs, so a test that patches what a step traces (a loss, a kernel) would
  otherwise run, or leave behind, a program an earlier test of the same config compiled."""
  steps = sys.modules.get("cem_jax.steps")
  if steps is not None:
    steps.forget_compiled()


@pytest.fixture
def shared_data() -> Path:
  if not SHARED_DATA.is_dir():
    pytest.fail(f"shared corpora not found at {SHARED_DATA} (expected ../shared/data)")
  return SHARED_DATA


def quadrature_phi_silu(z):
  """Φ(z) = ∫_0^z silu in float64 by 400-point Gauss-Legendre quadrature: a reference for
  ``energies.phi_silu`` that shares none of its code (closed form, custom JVP)."""
  z = np.asarray(z, np.float64)
  nodes, weights = np.polynomial.legendre.leggauss(400)
  s = z[..., None] * (nodes + 1.0) / 2.0
  return z / 2.0 * np.sum(weights * s / (1.0 + np.exp(-s)), axis=-1)


def np_rope(x, pos, theta=10_000.0, inverse=False):
  """RoFormer's rotation (arXiv:2104.09864) in the rotate-half layout, float64, from the
  formula: pair ``(m, m + h/2)`` of ``x`` ``[b, t, heads, h]`` turned by ``pos · theta^(-2m/h)``
  (``pos`` ``[b, t]``; ``inverse``: by minus that angle). A reference for ``apply_rope``."""
  x = np.asarray(x, np.float64)
  half = x.shape[-1] // 2
  angle = np.asarray(pos, np.float64)[:, :, None, None] * theta ** (-2.0 * np.arange(half)
                                                                     / x.shape[-1])
  sin, cos = np.sin(angle), np.cos(angle)
  sin = -sin if inverse else sin
  a, b = x[..., :half], x[..., half:]
  return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def tiny_config(block: str = "cem", **overrides):
  """A config that trains in seconds: d_model 64, 2 layers, seq_len 64, batch 8."""
  from cem_jax.config import get_default_config

  c = get_default_config()
  c.model.block = block
  c.model.d_model, c.model.num_heads, c.model.mlp_dim, c.model.num_layers = 64, 4, 128, 2
  c.data.seq_len, c.data.vocab_size = 64, 512
  c.data.builtin = "pydoc"  # the smaller built-in corpus keeps tests fast
  c.train.batch_size, c.train.num_steps, c.train.warmup_steps = 8, 30, 5
  c.train.eval_every_steps, c.train.log_every_steps = 10, 5
  c.eval.batch_size, c.eval.max_batches = 16, 4
  c.checkpoint.every_steps = 100
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  if (c.data.files or c.data.tfds_name) and "data.builtin" not in overrides:
    c.data.builtin = get_default_config().data.builtin  # not read: validation refuses it
  return c


# A CEM run of T = 2 with energy-traced evals, for the tests that read a trained T's evals
# (test_design's trace and test-time steps, test_tools' evaluate report): one config, so the
# second of them to run in a session compiles nothing of its training (the persistent
# compilation cache). Width 32 on 32-token windows: a traced eval runs slowly at the tests'
# XLA level; two layers, so that the trace sums over layers.
TRACED_T2 = {"model.num_steps": 2, "model.d_model": 32, "model.num_heads": 2,
             "model.mlp_dim": 64, "data.seq_len": 32, "train.num_steps": 4,
             "train.eval_every_steps": 4, "eval.max_batches": 2}


def force_fields(config, overrides: dict) -> None:
  """Sets dotted ``overrides`` on ``config`` past ConfigDict's type check, as a hand-edited
  config file or a command line could, so validation itself can be tested on bad values."""
  with config.unlocked():
    for key, value in overrides.items():
      group, _, leaf = key.rpartition(".")
      (config[group] if group else config).__dict__["_fields"][leaf] = value


def write_metrics(folder, lines: list[dict]) -> None:
  """``folder/metrics.jsonl`` holding ``lines``, one JSON object a line, as the loop writes it."""
  (Path(folder) / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))


def counting_sigint_handlers():
  """Returns ``(counting, handled)``: ``counting`` stands in for ``signal.signal`` and makes
  each SIGINT handler cem_jax.signals sets release ``handled`` when it runs; other handlers are
  set as given (compared by identity). Two signals sent before the main thread runs its handler
  are one: a test's second Ctrl-C waits on ``handled`` for the first's, not a fixed sleep a
  loaded machine may outlast."""
  set_handler, handled = signal.signal, threading.Semaphore(0)

  def counting(signum, handler):
    if signum == signal.SIGINT and getattr(handler, "__module__", None) == "cem_jax.signals":
      inner = handler

      def handler(signum, frame):
        handled.release()
        return inner(signum, frame)
    return set_handler(signum, handler)

  return counting, handled


def drop_exceptions(message: str, thread: str) -> None:
  """Makes Python drop a RuntimeError ``"{message}dropped in the {where} thread"`` from a
  ``__del__`` twice, as a library's threads and collected coroutines do: first in a thread
  named ``thread`` (where it ends), then in the main thread; ``sys.unraisablehook`` gets each."""
  import threading

  class Dropped:
    def __init__(self, where):
      self.where = where

    def __del__(self):
      raise RuntimeError(f"{message}dropped in the {self.where} thread")

  worker = threading.Thread(target=lambda: Dropped(thread))
  worker.start()
  worker.join()
  Dropped("main")


def closed_port() -> int:
  """A local TCP port nothing listens on (an offline stand-in for a network address)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


_FAKE_CATALOG = None


def fake_catalog(data_dir: Path, train: list[str], validation: list[str]) -> str:
  """Prepares a stand-in TFDS catalog dataset (array_record, feature ``text``, splits
  ``train``/``validation``, documents in the given order) in ``data_dir``; returns its name.
  Offline; the builder class is registered with TFDS once per session."""
  global _FAKE_CATALOG
  import tensorflow_datasets as tfds

  if _FAKE_CATALOG is None:
    class FakeCatalog(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version("1.0.0")
      TEXTS: dict = {}

      def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {"text": tfds.features.Text()}), disable_shuffling=True)

      def _split_generators(self, dl_manager):
        return {split: self._generate_examples(texts) for split, texts in self.TEXTS.items()}

      def _generate_examples(self, texts):
        for i, text in enumerate(texts):
          yield f"{i:06d}", {"text": text}

    _FAKE_CATALOG = FakeCatalog
  _FAKE_CATALOG.TEXTS = {"train": train, "validation": validation}
  builder = _FAKE_CATALOG(data_dir=os.fspath(data_dir), file_format="array_record")
  builder.download_and_prepare()
  return builder.name
