"""Training: real short runs lower eval loss, decay goes by name, the CLI works end to end."""

import gzip
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import pytest
from conftest import counting_sigint_handlers, program_json, subprocess_env, tiny_config
from flax import nnx

from cem_jax import model_stats, optim, steps, train
from cem_jax.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("block", ["cem", "llama"])
def test_short_training_on_real_text_lowers_eval_loss(block, shared_data, tmp_path):
  cfg = tiny_config(block, **{"data.files": str(shared_data / "tinyshakespeare.txt")})
  final = train.train_and_evaluate(cfg, str(tmp_path))
  lines = read_metrics(str(tmp_path))
  evals = [m for m in lines if "eval/loss" in m]
  assert [m["step"] for m in evals] == [10, 20, 30]
  # Well below the uniform predictor (ln 512 = 6.24 nats), and still falling after step 10
  # (measured: 5.49 at step 10, 5.26 at 30; the warm-up moves the weights from the first update,
  # so step 10 is already far down).
  assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] - 0.15
  assert evals[-1]["eval/loss"] < math.log(512) - 0.8
  assert final["eval/loss"] == evals[-1]["eval/loss"]
  trains = [m for m in lines if "train/loss" in m]
  assert all(k in trains[0] for k in ("train/learning_rate", "train/tokens_per_sec"))
  assert {"eval/perplexity", "eval/bits_per_byte"} <= set(evals[-1])
  resolved = json.load(open(tmp_path / "config.json"))
  assert resolved["model"]["block"] == block
  assert os.path.isdir(tmp_path / "checkpoints" / "30")


def test_weight_decay_goes_by_name_not_rank():
  """Norm scales, step sizes and diagonals are never decayed, whatever their rank."""
  cfg = tiny_config("cem", **{"model.diagonal": "per_head", "model.precond": "both",
                              "model.precond_rank": 2, "model.num_steps": 2,
                              "model.eta_per_step": True, "model.precond_shared": False})
  model = steps.build_model(cfg, 64)
  _, params = nnx.split(model, nnx.Param)
  mask = optim.decay_mask(params)
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
  decayed = sorted(k for k, v in flat.items() if v)
  kept = sorted(k for k, v in flat.items() if not v)
  assert all(any(f"['{n}']" in k for n in ("w_q", "w_k", "w", "g", "embedding")) for k in decayed)
  # Every weight matrix of the CEM layers decays: the tied attention's two, the MLP's two.
  names = {model_stats.param_name(p) for p, v in jax.tree_util.tree_leaves_with_path(mask) if v}
  assert names == {"w_q", "w_k", "w", "g", "embedding"}
  llama = nnx.split(steps.build_model(tiny_config("llama", **{"model.tie_embeddings": False}),
                                      64), nnx.Param)[1]
  llama_mask = jax.tree_util.tree_leaves_with_path(optim.decay_mask(llama))
  assert {model_stats.param_name(p) for p, v in llama_mask if v} == {
      "w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down", "embedding", "lm_head"}
  assert {model_stats.param_name(p) for p, v in llama_mask if not v} == {"scale"}
  for name in ("scale", "eta", "diag", "'p'", "'u'"):
    assert any(name in k for k in kept), name
    assert not any(name in k for k in decayed), name
  # Rank-2 parameters that must not be decayed exist (per-step eta, per-head diagonal, P).
  leaves = jax.tree_util.tree_leaves_with_path(params)
  shapes = {jax.tree_util.keystr(p): v.shape for p, v in leaves}
  assert any(len(shapes[k]) >= 2 for k in kept)
  # Stacking the norm scales (as a scanned model would) does not change the decision.
  stacked = {"blocks": {"norm_att": {"scale": jnp.ones((3, 64))}}, "w_q": jnp.ones((64, 4, 16))}
  assert optim.decay_mask(stacked) == {"blocks": {"norm_att": {"scale": False}}, "w_q": True}


def _script_unless_hung(when: str, script: str, *args: str) -> subprocess.CompletedProcess:
  """``python -c script *args`` in a process of its own (a hang must not hang the suite),
  finished with status 0; a test failure saying what it had written if it ran 300 s."""
  try:
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO}, capture_output=True,
                          text=True, timeout=300)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"hung {when}, having said {e.stdout!r} {e.stderr!r}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _run_cli(args, cwd, **kwargs):
  return subprocess.run([sys.executable, "-m", "cem_jax.main", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=600, **kwargs)


def test_cli_trains_and_writes_the_contract_files(tmp_path, shared_data):
  workdir = tmp_path / "w"
  overrides = [
      "--config.model.d_model=32", "--config.model.mlp_dim=64", "--config.model.num_layers=1",
      "--config.data.seq_len=32", "--config.data.vocab_size=512", "--config.train.num_steps=6",
      "--config.train.batch_size=4", "--config.train.eval_every_steps=3",
      "--config.eval.max_batches=2", f"--config.data.files={shared_data / 'wikitext2_valid.txt'}",
      "--config.train.profile_steps=2", "--config.train.profile_first_step=4",
  ]
  env = subprocess_env()
  proc = _run_cli([f"--config={REPO}/experiments/tiny.py", f"--workdir={workdir}", *overrides],
                  cwd=tmp_path, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The profiler's trace of steps 4 and 5, beside the TensorBoard scalars: each step marked.
  traces = list((workdir / "tensorboard" / "plugins" / "profile").glob("*/perfetto_trace.json.gz"))
  assert len(traces) == 1, proc.stderr[-3000:]
  with gzip.open(traces[0]) as f:
    events = json.load(f)["traceEvents"]
  assert sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train") == [4, 5]
  assert f"profile: trace of steps 4..5 written under {workdir / 'tensorboard'}" in proc.stderr
  # Its device-time summary: a CPU trace has no device process, and the log says so.
  assert ("profile: no kernel summary (ValueError: " in proc.stderr
          and "no device kernels in the trace (processes: /host:CPU" in proc.stderr)
  metrics = read_metrics(str(workdir))
  assert metrics[-1]["step"] == 6 and "eval/bits_per_byte" in metrics[-1]
  # A CPU has no known peak: a rate, no MFU (made up otherwise).
  logged = [m for m in metrics if "train/loss" in m]
  assert logged and all("train/tokens_per_sec" in m and "train/mfu" not in m for m in logged)
  assert json.load(open(workdir / "config.json"))["data"]["seq_len"] == 32
  assert (workdir / "checkpoints" / "6").is_dir()
  # The default 50 warmup updates never end in 6: said once, with the highest rate reached.
  assert ("train.warmup_steps=50 > train.num_steps=6: the learning rate never reaches "
          "train.learning_rate=0.003 (at most 0.00036)") in proc.stderr
  # The same command again: the run is finished, nothing is trained, appended or added to
  # TensorBoard, and the schedule it will not run is not described.
  events = sorted(p.name for p in (workdir / "tensorboard").iterdir())
  again = _run_cli([f"--config={REPO}/experiments/tiny.py", f"--workdir={workdir}",
                    *overrides], cwd=tmp_path, env=env)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "the run is already finished (train.num_steps=6): nothing to train" in again.stderr
  assert read_metrics(str(workdir)) == metrics
  assert sorted(p.name for p in (workdir / "tensorboard").iterdir()) == events
  assert "training windows" not in again.stderr and "warmup_steps" not in again.stderr
  assert ("profile: steps 4..5 (train.profile_first_step, train.profile_steps) ran before this "
          "start at step 6: no trace") in again.stderr
  assert len(list((workdir / "tensorboard" / "plugins" / "profile").iterdir())) == 1


def test_cli_config_typo_fails_before_training(tmp_path):
  proc = _run_cli([f"--config={REPO}/experiments/tiny.py", f"--workdir={tmp_path / 'w'}",
                   "--config.model.dmodel=64"], cwd=tmp_path)
  assert proc.returncode != 0
  assert "dmodel" in proc.stderr
  assert not (tmp_path / "w").exists()


def test_cli_bad_choice_is_one_clear_line(tmp_path):
  proc = _run_cli([f"--config={REPO}/experiments/tiny.py", f"--workdir={tmp_path / 'w'}",
                   "--config.model.block=gpt"], cwd=tmp_path)
  assert proc.returncode == 1
  assert "error: model.block='gpt'; allowed: cem, llama" in proc.stderr
  assert not (tmp_path / "w").exists()


def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  from cem_jax.metrics import MetricsWriter

  writer = MetricsWriter(str(tmp_path))
  writer.write(10, {"train/loss": 2.5, "train/learning_rate": 1e-3, "data/source": "x"})
  writer.write(20, {"train/loss": 2.0, "eval/energy/layer0/step1/att_after": -3.0})
  writer.close()
  events = EventAccumulator(str(tmp_path / "tensorboard"))
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, 2.5), (20, 2.0)]
  assert events.Scalars("eval/energy/layer0/step1/att_after")[0].value == -3.0
  assert "data/source" not in events.Tags()["scalars"]
  assert read_metrics(str(tmp_path))[1]["step"] == 20


def test_a_save_first_puts_the_metrics_lines_on_the_disk(tmp_path, monkeypatch):
  """A crash of the machine keeps Orbax's synced checkpoint of step s but may lose the
  flushed, unsynced lines up to s: the resume then went on with those steps missing (adv60).
  _Loop.save fsyncs metrics.jsonl (MetricsWriter.sync) before it starts the save."""
  import types

  from cem_jax.metrics import MetricsWriter

  events = []
  real_fsync = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", fd)), real_fsync(fd)))
  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write(5, {"train/loss": 2.5})
  writer.sync()
  assert events == [("fsync", writer._file.fileno())]
  events.clear()

  class Checkpoints:
    def save(self, step, state, meta, force):
      events.append(("save", step))
      return True

  loop = object.__new__(train._Loop)
  loop.guard, loop.max_bad = jnp.zeros((), jnp.int32), 3
  loop.params, loop.opt_state = {"w": jnp.ones(2)}, {}
  loop.resolved, loop.save_left, loop.last_saved, loop.writer = {}, False, None, writer
  loop.run = types.SimpleNamespace(config=types.SimpleNamespace(seed=0), energies={},
                                   parameters_from=None,
                                   data=types.SimpleNamespace(identity={}), ckpt=Checkpoints())
  loop.save(5, force=False)
  assert events == [("fsync", writer._file.fileno()), ("save", 5)]
  assert loop.last_saved == 5
  writer.close()
  writer.sync()  # closed: nothing to put on the disk


# Run by the test below in a process of its own (a hang must not hang the suite). A signal
# whose handler raises lands, as Python runs handlers, right after the C call before it: in
# tensorboardX's queue put, just after a threading.Condition's lock is taken, where the
# exception leaves the lock taken (seen in 352 of 752 real SIGINTs sent at random to a loop of
# `with condition: pass`). The signal is sent to the process (as a terminal's Ctrl-C is: Linux
# hands it to the main thread) there, at the k-th such entry in the thread that runs
# tensorboardX's calls of MetricsWriter.write then close, for each k, once or twice (the
# second, the way out of a call that hangs, is not held): deterministic, no race.
_SIGNAL_IN_THE_WRITERS_HANDSHAKE = """
import json, os, signal, sys, threading
import tensorboardX
from cem_jax.metrics import MetricsWriter

class Terminated(BaseException):  # train's start-up SIGTERM (cli.Terminated)
  pass

def terminated(signum, frame):
  raise Terminated

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
signal.signal(signal.SIGTERM, terminated)
enter, add_scalar, armed, callers = threading.Condition.__enter__, None, [], set()
set_handler, handled = signal.signal, threading.Semaphore(0)

def counting(signum, handler):  # the handlers cem_jax.signals sets say when they have run
  if getattr(handler, "__module__", None) == "cem_jax.signals":
    inner = handler

    def handler(signum, frame):
      handled.release()
      return inner(signum, frame)
  return set_handler(signum, handler)

signal.signal = counting

def enter_then_signal(self):
  taken = enter(self)
  if armed and threading.get_ident() in callers:
    armed[0] -= 1
    if armed[0] == 0:
      for _ in range(armed[2]):
        os.kill(os.getpid(), armed[1])
        # Seen by the main thread before the next is sent: two sent before it runs its
        # handler are one (conftest.counting_sigint_handlers).
        if not handled.acquire(timeout=120):
          raise AssertionError("no handler of cem_jax.signals ran for the signal")
  return taken

def recording(self, *args, **kwargs):
  callers.add(threading.get_ident())
  return add_scalar(self, *args, **kwargs)

threading.Condition.__enter__ = enter_then_signal
add_scalar, tensorboardX.SummaryWriter.add_scalar = tensorboardX.SummaryWriter.add_scalar, recording

def run(workdir, k, signum, times):
  writer = MetricsWriter(workdir, hold=(signal.SIGINT, signal.SIGTERM))
  writer.write(1, {"train/loss": 2.0})
  armed[:] = [k, signum, times]
  raised = []
  try:
    writer.write(2, {"train/loss": 1.0})
    writer.close()
  except (KeyboardInterrupt, Terminated) as e:
    raised.append(type(e).__name__)
  entries = k - armed[0]
  armed.clear()
  writer.close()  # again, as train's abort does after the loop's close was interrupted
  return entries, raised

entries, _ = run(sys.argv[1] + "/count", 10**6, signal.SIGINT, 1)
print(json.dumps({"entries": entries}), flush=True)
for signum in (signal.SIGINT, signal.SIGTERM):
  for times in (1, 2):
    for k in range(1, entries + 1):
      raised = run(f"{sys.argv[1]}/{signum.name}{times}.{k}", k, signum, times)[1]
      print(json.dumps({"k": k, "signal": signum.name, "times": times, "raised": raised}),
            flush=True)
"""


def test_a_signal_inside_tensorboards_handshake_neither_hangs_the_run_nor_loses_a_line(
    tmp_path):
  # A Ctrl-C just after a checkpoint save hung a run for good (2 of 31 tries): it landed in
  # tensorboardX's queue put, which left its lock taken, and the close of train's abort (or
  # tensorboardX's atexit) then waited for that lock for ever. Holding the signal until
  # tensorboardX's call returned still let a second one land there, and hang. tensorboardX's
  # calls now run in a thread of their own (signals.Calls), which no handler interrupts: a
  # signal is raised once, in the main thread's wait, and every line and event is written,
  # also after two. Fails (hangs at the first entry, twice) with the calls run in the main
  # thread again.
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  proc = _script_unless_hung("after a signal inside tensorboardX's calls",
                             _SIGNAL_IN_THE_WRITERS_HANDSHAKE, str(tmp_path))  # 3 s
  lines = [json.loads(line) for line in proc.stdout.splitlines()]
  # write's event put; close's stop put and queue close: each a place a signal hung it.
  assert lines[0]["entries"] >= 3, lines[0]
  assert len(lines) == 1 + 4 * lines[0]["entries"]
  for line in lines[1:]:
    want = "KeyboardInterrupt" if line["signal"] == "SIGINT" else "Terminated"
    assert line["raised"] == [want], line  # held, then raised once, not lost
    workdir = tmp_path / f"{line['signal']}{line['times']}.{line['k']}"
    events = EventAccumulator(str(workdir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2], line
    assert [m["step"] for m in read_metrics(str(workdir))] == [1, 2], line


def test_a_second_ctrl_c_stops_the_wait_for_tensorboards_call_at_once_and_says_so(
    tmp_path, monkeypatch, caplog):
  # One Ctrl-C during tensorboardX's call waits for it to return; a second is the way out of
  # a writer that hangs (a disk that stopped answering), with one line naming the folder whose
  # last events may then be missing. The call goes on in its thread, and the close after it.
  # The handler is put back either way.
  import logging

  import tensorboardX

  from cem_jax.metrics import MetricsWriter, tensorboard_dir

  # Each Ctrl-C waits for the handler cem_jax.signals set (held's) to have run: two sent
  # before the main thread runs its handler are one (conftest.counting_sigint_handlers).
  counting, handled = counting_sigint_handlers()
  monkeypatch.setattr(signal, "signal", counting)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
  try:
    writer = MetricsWriter(str(tmp_path))
    flush, ctrl_cs, returned = tensorboardX.SummaryWriter.flush, [1], []
    went_on = threading.Event()

    def ctrl_c_inside(self):
      for _ in range(ctrl_cs[0]):
        os.kill(os.getpid(), signal.SIGINT)  # to the process, as a terminal sends it
        assert handled.acquire(timeout=120)  # seen by the main thread: the next is another
      if ctrl_cs[0] == 2:
        went_on.wait(timeout=120)  # hangs until the main thread has stopped waiting
      flush(self)
      returned.append(ctrl_cs[0])

    monkeypatch.setattr(tensorboardX.SummaryWriter, "flush", ctrl_c_inside)
    with caplog.at_level(logging.WARNING):
      with pytest.raises(KeyboardInterrupt):
        writer.write(1, {"train/loss": 2.0})
      assert returned == [1] and not caplog.records
      ctrl_cs[0] = 2
      with pytest.raises(KeyboardInterrupt):
        writer.write(2, {"train/loss": 1.0})
    assert returned == [1]
    went_on.set()
    assert [r.getMessage() for r in caplog.records] == [
        f"TensorBoard events in {tensorboard_dir(str(tmp_path))} may lack the last ones: its "
        "writer was stopped part way (KeyboardInterrupt); metrics.jsonl has every line"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    writer.close()  # no Ctrl-C; after the call left running
    assert returned == [1, 2]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert [m["step"] for m in read_metrics(str(tmp_path))] == [1, 2]
  finally:
    signal.signal(signal.SIGINT, previous)


# Run by the test below in a process of its own (a hang must not hang the suite): writes line
# after line (up to sys.argv[2]) while tensorboardX's writer thread dies at its first event (its
# file's write raises, as a full disk's would), then, once that thread is gone, closes.
_DEAD_TENSORBOARD_THREAD = """
import errno, json, signal, sys, threading, time
import tensorboardX.event_file_writer
from cem_jax.metrics import MetricsWriter

signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)

def full(self, event):
  raise OSError(errno.ENOSPC, "No space left on device")

writer = MetricsWriter(sys.argv[1])
tensorboardX.event_file_writer.EventsWriter.write_event = full  # its first event was written
out = {}
try:
  for step in range(1, int(sys.argv[2]) + 1):
    writer.write(step, {"train/loss": 2.0, "train/learning_rate": 1e-3})
except OSError as e:
  out["write"] = [step, str(e)]
while any(type(t).__module__.startswith("tensorboardX") for t in threading.enumerate()):
  time.sleep(0.01)
try:
  writer.close()
except OSError as e:
  out["close"] = str(e)
print(json.dumps(out), flush=True)
"""


def test_a_dead_tensorboard_writer_thread_is_one_line_naming_its_folder_not_a_hang(tmp_path):
  # tensorboardX hands each event to its writer thread through a queue of 10: once that
  # thread had died (what it raised printed by Python, then nothing), the 11th event waited
  # for ever, and the run hung in its 3rd log line without a word of why. Fails (hangs) with
  # the thread's check dropped and tensorboardX's default queue.
  from cem_jax.metrics import tensorboard_dir

  proc = _script_unless_hung("with tensorboardX's thread dead", _DEAD_TENSORBOARD_THREAD,
                             str(tmp_path), "100")  # 2 s
  out = json.loads(proc.stdout.splitlines()[-1])
  step, error = out["write"]
  said = (f"TensorBoard events in {tensorboard_dir(str(tmp_path))}: tensorboardX's writer "
          f"thread died (OSError: [Errno 28] No space left on device, found writing step "
          f"{step}); its last events are lost, metrics.jsonl has every line; fix the cause (a "
          "full disk?) and resume")
  assert error == said
  assert "close" not in out  # said once, by the write (the abort's close would repeat it)
  assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr  # in it
  assert [m["step"] for m in read_metrics(str(tmp_path))] == list(range(1, step + 1))
  # Found dead by the close (one write, before the thread took its event): the close says it.
  proc = subprocess.run([sys.executable, "-c", _DEAD_TENSORBOARD_THREAD,
                         str(tmp_path / "at_close"), "1"], cwd=REPO,
                        env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout.splitlines()[-1]) == {"close": said.replace(
      f", found writing step {step}", "").replace(str(tmp_path), str(tmp_path / "at_close"))}


def test_what_kills_another_thread_still_goes_to_the_hook_before(tmp_path, monkeypatch):
  # The writer keeps what kills tensorboardX's threads for its one line; any other thread's
  # exception is reported as before it was made.
  from cem_jax.metrics import MetricsWriter

  seen = []
  monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
  writer = MetricsWriter(str(tmp_path))
  failing = threading.Thread(target=lambda: 1 / 0)
  failing.start()
  failing.join()
  writer.write(1, {"train/loss": 2.0})
  writer.close()
  assert [type(e) for e in seen] == [ZeroDivisionError]


def test_writers_one_after_another_leave_the_thread_hook_as_they_found_it(tmp_path,
                                                                          monkeypatch):
  # Runs in one process (tables' seeds) each open a writer. The hook that keeps tensorboardX's
  # threads' exceptions was installed for good, and each later writer under a hook put over
  # it took that one as the hook before: a hook that hands on to the one it replaced (a
  # logging set-up's, between two runs) and ours then called each other until RecursionError,
  # and that thread's error was never shown. Mutations: the close not putting the hook back
  # (the hook after close is not the one before); one shared hook-before for every install
  # (RecursionError, the user's hook called ~500 times).
  from cem_jax.metrics import MetricsWriter

  seen = []
  before = lambda args: seen.append(("before", type(args.exc_value)))  # noqa: E731
  monkeypatch.setattr(threading, "excepthook", before)

  def fail_in_a_thread():
    failing = threading.Thread(target=lambda: 1 / 0)
    failing.start()
    failing.join()

  first = MetricsWriter(str(tmp_path / "a"))
  second = MetricsWriter(str(tmp_path / "b"))  # open at once: one hook, held twice
  assert threading.excepthook is not before and threading.excepthook.prev is before
  first.close()
  assert threading.excepthook.prev is before
  second.close()
  assert threading.excepthook is before
  fail_in_a_thread()
  assert seen == [("before", ZeroDivisionError)]

  # A hook installed over a writer's, handing on to it, then a later run's writer.
  seen.clear()
  third = MetricsWriter(str(tmp_path / "c"))
  ours = threading.excepthook

  def theirs(args):
    seen.append(("theirs", type(args.exc_value)))
    ours(args)

  threading.excepthook = theirs
  third.close()  # theirs is on top: ours stays under it, handing everything on
  fourth = MetricsWriter(str(tmp_path / "d"))
  fail_in_a_thread()
  fourth.close()
  assert threading.excepthook is theirs
  assert seen == [("theirs", ZeroDivisionError), ("before", ZeroDivisionError)]


def test_a_resume_rewrites_the_steps_after_its_checkpoint_in_both_logs(tmp_path):
  # Lines past the restored step never happened: metrics.jsonl drops them and TensorBoard
  # purges them, so each step shows once, with the resumed run's value; a run killed before
  # its first checkpoint (truncate_after_step=-1) starts both over.
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  from cem_jax.metrics import MetricsWriter

  def run(first, truncate):
    time.sleep(1.1)  # event files are named by the second: a real start takes longer
    writer = MetricsWriter(str(tmp_path), truncate_after_step=truncate)
    for step in range(first, 5):
      writer.write(step, {"train/loss": float(10 * (truncate or 0) + step)})
    writer.close()

  def losses():
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    return ([(m["step"], m["train/loss"]) for m in read_metrics(str(tmp_path))],
            [(e.step, e.value) for e in events.Scalars("train/loss")])

  run(1, None)
  run(3, 2)  # resumed at step 2: steps 3 and 4 again
  want = [(1, 1.0), (2, 2.0), (3, 23.0), (4, 24.0)]
  assert losses() == (want, want)
  run(1, -1)  # killed before any checkpoint: everything again
  want = [(s, float(s - 10)) for s in range(1, 5)]
  assert losses() == (want, want)


def test_non_finite_metrics_are_strict_json_null(tmp_path):
  from cem_jax.metrics import MetricsWriter

  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write(3, {"train/loss": float("nan"), "train/grad_norm": float("inf"), "x": 1.5})
  writer.close()
  line = (tmp_path / "metrics.jsonl").read_text()
  assert json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON {c}")) == {
      "step": 3, "train/loss": None, "train/grad_norm": None, "x": 1.5}
  assert read_metrics(str(tmp_path)) == [json.loads(line)]


def _metrics_file(tmp_path, text: str):
  (tmp_path / "metrics.jsonl").write_text(text)
  return tmp_path / "metrics.jsonl"


def test_resume_drops_a_cut_short_last_line_with_a_warning(tmp_path, caplog):
  import logging

  from cem_jax.metrics import MetricsWriter

  good = '{"step": 1, "train/loss": 2.5}\n{"step": 2, "train/loss": 2.0}\n'
  path = _metrics_file(tmp_path, good + '{"step": 3, "train/lo')  # killed mid-write
  with caplog.at_level(logging.WARNING):
    writer = MetricsWriter(str(tmp_path), truncate_after_step=2, tensorboard=False)
  assert path.read_text() == good
  assert any("cut-short last line" in r.getMessage() and "step" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]
  writer.write(3, {"train/loss": 1.5})
  writer.close()
  assert [m["step"] for m in read_metrics(str(tmp_path))] == [1, 2, 3]


@pytest.mark.parametrize("damage, error", [
    ('{"step": 2, "tr\n', r"metrics\.jsonl:2 is not valid JSON \(.*\): '\{\"step\": 2, \"tr'; "),
    ('{"train/loss": 2.0}\n', r"metrics\.jsonl:2 is not a JSON object with an integer \"step\": "),
    # Python's json reads NaN, no other parser does; the writer writes null (plot drew an empty
    # figure of NaN losses, and its legend "last: nan").
    ('{"step": 2, "train/loss": NaN}\n', r"metrics\.jsonl:2 is not valid JSON \(NaN is not "
     r"JSON; a non-finite value is written as null\): "),
    ('{"step": 2, "train/loss": -Infinity}\n', r"metrics\.jsonl:2 is not valid JSON "
     r"\(-Infinity is not JSON"),
    # Hand edits json reads as values: plot drew a string loss as a category axis, and a
    # string bits/byte was a traceback-free but file-less "Unknown format code 'f'".
    ('{"step": 2, "train/loss": "2.0"}\n', r"metrics\.jsonl:2: \"train/loss\" is \"2\.0\"; "
     r"allowed: a finite number, or null"),
    ('{"step": 2, "eval/loss": 2.0, "eval/bits_per_byte": true}\n',
     r"metrics\.jsonl:2: \"eval/bits_per_byte\" is true; allowed: "),
    ('{"step": 2, "train/loss": 1e400}\n', r"metrics\.jsonl:2: \"train/loss\" is Infinity; "),
    ('{"step": 2, "eval/loss": [2.0]}\n', r"metrics\.jsonl:2: \"eval/loss\" is \[2\.0\]; "),
    # Two runs' lines in one file (the writer's steps only rise, one train and one eval line a
    # step): plot drew a zigzag, a table's curve averaged both into the same steps.
    ('{"step": 0, "train/loss": 2.0}\n', r"metrics\.jsonl:2: step 0 after step 1; allowed: "
     r"steps in the order the run wrote them \(two runs' lines in one file\?\); repair"),
    ('{"step": 1, "eval/loss": 2.0, "train/loss": 2.0}\n', r"metrics\.jsonl:2: step 1 again "
     r"with 'train/loss'; allowed: one train and one eval line a step"),
], ids=["not JSON", "no step", "NaN", "-Infinity", "string loss", "bool bpb", "1e400", "list",
        "step back", "step again"])
def test_resume_refuses_a_damaged_line_before_the_last_as_read_metrics_does(
    tmp_path, damage, error):
  from cem_jax.metrics import MetricsWriter

  text = '{"step": 1, "train/loss": 2.5}\n' + damage + '{"step": 3, "train/loss": 1.5}\n'
  path = _metrics_file(tmp_path, text)
  for read in (lambda: read_metrics(str(tmp_path)),
               lambda: MetricsWriter(str(tmp_path), truncate_after_step=3, tensorboard=False)):
    with pytest.raises(ValueError, match=error) as e:
      read()
    assert "\n" not in str(e.value)
  assert path.read_text() == text  # the evidence is left as it was


def test_a_metrics_file_that_is_a_folder_is_one_line_saying_what_to_do(tmp_path):
  # plot printed "[Errno 21] Is a directory: ..." and a resume the same, naming no remedy.
  from cem_jax.metrics import MetricsWriter

  (tmp_path / "metrics.jsonl").mkdir()
  for read in (lambda: read_metrics(str(tmp_path)),
               lambda: MetricsWriter(str(tmp_path), truncate_after_step=3, tensorboard=False)):
    with pytest.raises(ValueError, match=r"metrics\.jsonl is a folder; allowed: the run's "
                       r"metrics file \(one JSON object a line\); move the folder away$"):
      read()


def test_a_writer_whose_file_cannot_be_opened_closes_tensorboards_writer_first(tmp_path):
  # MetricsWriter starts TensorBoard's writer before it opens metrics.jsonl: a file that could
  # not be opened left that writer's thread and its Calls thread running for the interpreter's
  # exit (where a daemon thread woken aborts the process: signals.Calls.stop), and the thread
  # hook held. Fails with the open's error not closing the writer.
  from cem_jax.metrics import MetricsWriter

  hook, before = threading.excepthook, set(threading.enumerate())
  (tmp_path / "metrics.jsonl").mkdir()  # open(..., "a") fails; no resume: no read before it
  with pytest.raises(IsADirectoryError):
    MetricsWriter(str(tmp_path))
  left = [t for t in threading.enumerate() if t not in before and (
      t.name.startswith("cem_jax.metrics") or type(t).__module__.split(".")[0] == "tensorboardX")]
  assert left == [] and threading.excepthook is hook


def test_a_whole_last_line_that_is_not_json_is_damage_not_a_kill(tmp_path):
  # A kill cuts only the line being written, before its newline: a last line with its newline
  # that does not parse was damaged later, and is refused as an earlier one is.
  _metrics_file(tmp_path, '{"step": 1, "train/loss": 2.5}\n{"step": 2, "tr\n')
  with pytest.raises(ValueError, match=r"metrics\.jsonl:2 is not valid JSON "):
    read_metrics(str(tmp_path))


def test_metrics_bytes_that_are_not_utf8_are_damage_inside_and_a_cut_at_the_end(tmp_path):
  """A kill can cut the last line inside a multi-byte character (dropped, as a torn line);
  undecodable bytes before it are damage: one line naming the file and line, and a refused
  resume writes nothing (no TensorBoard folder either)."""
  from cem_jax.metrics import MetricsWriter

  path = tmp_path / "metrics.jsonl"
  good = '{"step": 1, "note": "caf\u00e9"}\n'.encode()
  path.write_bytes(good + '{"step": 2, "note": "caf\u00e9'.encode()[:-1])
  assert read_metrics(str(tmp_path)) == [{"step": 1, "note": "caf\u00e9"}]
  bad = good + b'{"step": 2, "x": "\xff\xfe"}\n' + b'{"step": 3}\n'
  path.write_bytes(bad)
  for read in (lambda: read_metrics(str(tmp_path)),
               lambda: MetricsWriter(str(tmp_path), truncate_after_step=3)):
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2 is not UTF-8 \(") as e:
      read()
    assert "\n" not in str(e.value)
  assert path.read_bytes() == bad and sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_a_disabled_writer_writes_and_truncates_nothing_and_an_enabled_one_flushes_each_line(
    tmp_path, monkeypatch):
  # Processes other than 0 open a disabled writer on the same metrics.jsonl: it must neither
  # rewrite the file (a resume's truncation) nor add lines or event files. Process 0's lines
  # are readable at once (a reader, or a kill, must not lose the buffered ones).
  from cem_jax import files
  from cem_jax.metrics import MetricsWriter

  text = '{"step": 1, "train/loss": 2.5}\n{"step": 2, "train/loss": 2.0}\n'
  path = _metrics_file(tmp_path, text)
  other = MetricsWriter(str(tmp_path), enabled=False, truncate_after_step=1)
  other.write(2, {"train/loss": 1.0})
  other.close()
  assert path.read_text() == text and sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]
  writer = MetricsWriter(str(tmp_path), truncate_after_step=2, tensorboard=False)
  writer.write(3, {"train/loss": 1.5})
  assert [m["step"] for m in read_metrics(str(tmp_path))] == [1, 2, 3]  # before close
  writer.close()

  # The truncation replaces the file whole: a failure (a full disk) leaves it as it was.
  def fail(src, dst):
    raise OSError("No space left on device")

  before = path.read_text()
  monkeypatch.setattr(files.os, "replace", fail)
  with pytest.raises(OSError, match="No space left on device"):
    MetricsWriter(str(tmp_path), truncate_after_step=1, tensorboard=False)
  assert path.read_text() == before


def test_a_metrics_line_or_event_that_cannot_be_written_names_its_file(tmp_path, monkeypatch):
  # A full disk raises "[Errno 28] No space left on device" with no file name: the run's
  # one-line error must say what could not be written.
  import errno

  from cem_jax.metrics import MetricsWriter, tensorboard_dir

  class Full:
    def __init__(self, real):
      self.real = real

    def __getattr__(self, name):
      return getattr(self.real, name)

    def flush(self):
      raise OSError(errno.ENOSPC, "No space left on device")

  writer = MetricsWriter(str(tmp_path))
  writer._file = Full(writer._file)
  with pytest.raises(OSError) as e:
    writer.write(1, {"train/loss": 2.0})
  assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "metrics.jsonl"))
  writer._file = writer._file.real
  writer._tb = Full(writer._tb)
  with pytest.raises(OSError) as e:
    writer.write(2, {"train/loss": 2.0})
  assert (e.value.errno, e.value.filename) == (errno.ENOSPC, tensorboard_dir(str(tmp_path)))
  writer._tb = writer._tb.real
  writer.close()


RUNS_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from conftest import count_compiles, tiny_config
from cem_jax import steps, train
from cem_jax.metrics import read_metrics

made = count_compiles()
STEPS = ("jit(init)", "jit(step)", "jit(eval_step)")
SEED = {"seed": 1, "data.shuffle_seed": 1}
RUNS = {"first": {}, "seed": SEED, "learning_rate": {**SEED, "train.learning_rate": 6e-3},
        "seq_len": {**SEED, "data.seq_len": 32}}


def run(name, workdir):
  cfg = tiny_config("cem", **{"model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64,
                              "model.num_layers": 1, "data.seq_len": 16,
                              "train.num_steps": 3, "train.warmup_steps": 1,
                              "train.log_every_steps": 1, "train.eval_every_steps": 3,
                              "eval.max_batches": 2, **RUNS[name]})
  before = dict(made)
  train.train_and_evaluate(cfg, workdir)
  lines = [{k: v for k, v in m.items() if k.startswith(("train/loss", "train/grad_norm",
                                                         "train/learning_rate", "eval/loss"))}
           for m in read_metrics(workdir)]
  return {"compiles": [made[f] - before.get(f, 0) for f in STEPS],
          "metrics": [m for m in lines if m]}


out = {"cached": {name: run(name, f"{sys.argv[2]}/{name}") for name in RUNS}}
# Each again, every cached program dropped first: the uncached path, compiled for it alone.
out["fresh"] = {}
for name in RUNS:
  steps.forget_compiled()
  out["fresh"][name] = run(name, f"{sys.argv[2]}/fresh_{name}")
print(json.dumps(out))
"""


def test_another_run_of_one_config_reuses_the_compiled_steps_and_others_do_not(tmp_path):
  # The optimizer state's initialiser and the train and eval steps are cached per config in
  # a process (tables' --seeds): another seed makes no executable of them, while a learning
  # rate (a constant of the step's schedule) and a sequence length (the step's shapes) are
  # programs of their own; each run's losses, gradient norms, rates and eval losses are bit
  # for bit those of its steps compiled afresh. Counted: the executables jax makes, not time.
  # Mutations: the step caches dropped (a jit per call) made the second seed compile 3;
  # make_optimizer's key without the learning rate (the first run's optimizer reused) gave
  # the learning-rate run the first run's rates and losses.
  runs = program_json(["-c", RUNS_SCRIPT, os.path.join(REPO, "tests"), str(tmp_path)], 1,
                      timeout=300)
  cached, fresh = runs["cached"], runs["fresh"]
  assert cached["first"]["compiles"] == [1, 1, 1], cached
  assert cached["seed"]["compiles"] == [0, 0, 0], cached
  # A new optimizer: its state's initialiser and the train step; the eval step reads no rate.
  assert cached["learning_rate"]["compiles"] == [1, 1, 0], cached
  assert cached["seq_len"]["compiles"] == [0, 1, 1], cached
  for name, rec in cached.items():
    assert len(rec["metrics"]) == 4 and rec["metrics"] == fresh[name]["metrics"], name
  # The runs differ where their configs do (the comparison above could not miss a mix-up).
  first, seed, lr = (cached[n]["metrics"] for n in ("first", "seed", "learning_rate"))
  assert first[0]["train/loss"] != seed[0]["train/loss"]
  assert lr[0]["train/loss"] == seed[0]["train/loss"]  # same seed, before any update
  assert lr[0]["train/learning_rate"] == 2 * seed[0]["train/learning_rate"]


# A user energy that reads Python state its function object does not carry (a table file or
# a script setting a knob between runs): the built-in interaction energy times KNOB["scale"],
# with its closed form (a stable function: an autodiff update is a new closure per model).
KNOB = {"scale": 1.0}
KNOB_ENERGY = "test_train_knob_energy"


def _knob_energy(y, context, params, aux):
  from cem_jax.energies import interaction
  return KNOB["scale"] * interaction.interaction_energy(y, context, params, aux)


def _knob_energy_fused(y, context, params, aux):
  from cem_jax.energies import interaction
  return KNOB["scale"] * interaction.fused_update(y, context, params, aux)


def test_a_user_energy_reading_python_state_gets_steps_traced_for_each_run(monkeypatch):
  # Two runs of one config in one process, a user energy's global changed between them: the
  # same graphdef, so the step cache gave the second run the program traced with the first
  # value (its losses those of scale 1 while the energy said 4). Each run's train and eval
  # losses must be those of its steps compiled afresh for the value it ran with.
  # Mutation: make_train_step/make_eval_step caching every graphdef (steps._cacheable always
  # True) gave the scale-4 run the scale-1 losses.
  import numpy as np

  from cem_jax import energies
  from cem_jax.data.packing import make_batch
  if KNOB_ENERGY not in energies.names():
    energies.register(KNOB_ENERGY, "attention", _knob_energy, _knob_energy_fused)
  monkeypatch.setitem(KNOB, "scale", 1.0)
  cfg = tiny_config("cem", **{"model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64,
                              "model.num_layers": 1, "model.num_steps": 2,
                              "model.attention_energy": KNOB_ENERGY, "data.seq_len": 16})
  tx, _ = optim.make_optimizer(cfg.train)
  graphdef, params, opt_state, shardings, _ = steps.init_state(cfg, 512, tx)
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 512, (8, 17), dtype=np.int32)
  batch = make_batch(tokens, np.ones((8, 17), np.int32), np.full((8, 17), 3.0, np.float32))
  batch = shardings.global_batch(batch, 8)

  def losses():
    train_step = steps.make_train_step(graphdef, tx, shardings=shardings)
    eval_step = steps.make_eval_step(graphdef, None, shardings=shardings)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # the train step donates its inputs
    _, _, metrics = train_step(copy(params), copy(opt_state), batch, 0, 0)
    return float(metrics["loss"]), float(eval_step(params, batch)["loss_sum"])

  first = losses()
  KNOB["scale"] = 4.0
  second = losses()
  steps.forget_compiled()
  fresh = losses()
  assert second == fresh
  assert second[0] != first[0] and second[1] != first[1]  # the knob changes the losses
