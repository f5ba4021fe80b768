"""The loop reports how many epochs its schedule covers and keeps the best eval."""

import json
import logging
import math
import os
import types

import jax
import pytest
from conftest import tiny_config, write_metrics

from cem_jax import optim, steps, train
from cem_jax.data import pipeline
from cem_jax.metrics import read_metrics
from cem_jax.profiling import StepProfiler


def test_epochs_are_logged_and_warned_and_the_best_eval_is_kept(shared_data, tmp_path, caplog,
                                                                monkeypatch):
  text = (shared_data / "tinyshakespeare.txt").read_text()[:6_000]
  (tmp_path / "small.txt").write_text(text)
  cfg = tiny_config("llama", **{
      "model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64, "model.num_layers": 1,
      "data.files": str(tmp_path / "small.txt"), "data.seq_len": 32, "data.vocab_size": 384,
      "train.batch_size": 16, "train.num_steps": 22, "train.warmup_steps": 2,
      "train.learning_rate": 3e-2, "train.eval_every_steps": 8, "train.log_every_steps": 8,
      "checkpoint.every_steps": 8, "eval.max_batches": 2})
  workdir = tmp_path / "run"
  read, real_batch = [], pipeline.TrainBatches.batch

  def recording_batch(self, step, *args, **kwargs):
    read.append(step)
    return real_batch(self, step, *args, **kwargs)

  monkeypatch.setattr(pipeline.TrainBatches, "batch", recording_batch)
  with caplog.at_level(logging.INFO):
    final = train.train_and_evaluate(cfg, str(workdir))
  assert read == list(range(22))  # step s (0-based) trains on batch s: none skipped or repeated
  lines = read_metrics(str(workdir))
  # 22 steps, intervals 8: the final step, off the intervals, is still logged, evaluated (what
  # the run returns and tables read as its result) and saved.
  assert [m["step"] for m in lines if "train/loss" in m] == [8, 16, 22]
  assert [m["step"] for m in lines if "eval/loss" in m] == [8, 16, 22]
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()
                if p.name.isdigit()) == [8, 16, 22]
  windows = lines[0]["data/train_windows"]
  want = 22 * 16 / windows
  assert want >= train.EPOCHS_WARNING  # the setup passes over the text several times
  assert lines[0]["data/epochs"] == pytest.approx(want)
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any(f"{want:.1f} times" in m and "eval/best_" in m for m in warned), warned
  evals = [m for m in lines if "eval/loss" in m]
  best = min(evals, key=lambda m: m["eval/loss"])
  expected = {"eval/best_loss": best["eval/loss"],
              "eval/best_bits_per_byte": best["eval/bits_per_byte"],
              "eval/best_step": best["step"]}
  assert {k: final[k] for k in expected} == expected
  assert final["eval/loss"] == evals[-1]["eval/loss"]
  assert json.loads((workdir / "best_eval.json").read_text()) == expected
  for i, m in enumerate(evals):  # every eval line carries the best up to itself
    assert m["eval/best_loss"] == min(e["eval/loss"] for e in evals[:i + 1])


def test_no_warning_below_two_epochs():
  cfg = tiny_config("llama")
  assert train.epochs(cfg, 8 * 30) == 1.0
  assert train.best_eval([]) == {}
  assert train.best_eval([{"step": 5, "eval/loss": 2.0, "eval/bits_per_byte": 1.0},
                          {"step": 9, "eval/loss": 2.5, "eval/bits_per_byte": 1.2}]) == {
      "eval/best_loss": 2.0, "eval/best_bits_per_byte": 1.0, "eval/best_step": 5}


def test_on_a_tie_the_earliest_eval_is_the_best_live_and_on_resume(tmp_path, monkeypatch):
  # Equal eval losses (updates all skipped between two evals) name the earliest step, in the
  # running loop and when a resume rebuilds the best from metrics.jsonl.
  line = lambda step, loss: {"step": step, "eval/loss": loss, "eval/bits_per_byte": loss}  # noqa: E731
  assert train.best_eval([line(5, 2.0), line(9, 2.0), line(12, 3.0)])["eval/best_step"] == 5
  assert train.best_eval([line(9, 2.0), line(5, 2.0)])["eval/best_step"] == 5
  real_eval_loop = steps.eval_loop

  def constant(*args, **kwargs):
    return {**real_eval_loop(*args, **kwargs), "eval/loss": 2.0, "eval/bits_per_byte": 1.0}

  monkeypatch.setattr(steps, "eval_loop", constant)
  cfg = tiny_config("llama", **{"train.num_steps": 6, "train.eval_every_steps": 2,
                                "train.log_every_steps": 2, "eval.max_batches": 1})
  workdir = tmp_path / "run"
  final = train.train_and_evaluate(cfg, str(workdir))
  assert final["eval/best_step"] == 2
  assert json.loads((workdir / "best_eval.json").read_text())["eval/best_step"] == 2
  assert [m["eval/best_step"] for m in read_metrics(str(workdir)) if "eval/loss" in m] == [2] * 3



def test_each_eval_line_and_the_result_hold_their_own_eval_beside_the_best(tmp_path,
                                                                           monkeypatch):
  # Evals of 2, 1 and 3 nats at steps 2, 4 and 6: the last is not the best, so a line (or the
  # returned result, which tables write to result.json) holding the best's loss in place of
  # its own fails here; a run whose loss only falls could not tell them apart.
  losses = iter([2.0, 1.0, 3.0])
  real_eval_loop = steps.eval_loop

  def scripted(*args, **kwargs):
    loss = next(losses)
    return {**real_eval_loop(*args, **kwargs), "eval/loss": loss, "eval/bits_per_byte": loss / 2}

  monkeypatch.setattr(steps, "eval_loop", scripted)
  cfg = tiny_config("llama", **{"model.d_model": 16, "model.num_heads": 2, "model.mlp_dim": 32,
                                "model.num_layers": 1, "train.num_steps": 6,
                                "train.eval_every_steps": 2, "train.log_every_steps": 2,
                                "checkpoint.every_steps": 6, "eval.max_batches": 1})
  final = train.train_and_evaluate(cfg, str(tmp_path / "run"))
  evals = [(m["step"], m["eval/loss"], m["eval/bits_per_byte"], m["eval/best_loss"],
            m["eval/best_bits_per_byte"], m["eval/best_step"])
           for m in read_metrics(str(tmp_path / "run")) if "eval/loss" in m]
  assert evals == [(2, 2.0, 1.0, 2.0, 1.0, 2), (4, 1.0, 0.5, 1.0, 0.5, 4),
                   (6, 3.0, 1.5, 1.0, 0.5, 4)]
  assert (final["eval/loss"], final["eval/bits_per_byte"], final["eval/best_loss"],
          final["eval/best_bits_per_byte"], final["eval/best_step"]) == (3.0, 1.5, 1.0, 0.5, 4)

def test_a_non_finite_eval_is_never_the_best():
  nan, inf = float("nan"), float("inf")
  line = lambda step, loss: {"step": step, "eval/loss": loss, "eval/bits_per_byte": loss}  # noqa: E731
  # A live NaN (the running loop) and a null (read back from metrics.jsonl) alike.
  assert train.best_eval([line(5, nan), line(9, 3.0), line(12, None), line(15, -inf)]) == {
      "eval/best_loss": 3.0, "eval/best_bits_per_byte": 3.0, "eval/best_step": 9}
  assert train.best_eval([line(5, nan)]) == {}


def test_a_nan_first_eval_neither_sticks_as_best_nor_reaches_best_eval_json(
    tmp_path, monkeypatch):
  real_eval_loop, calls = steps.eval_loop, []

  def nan_first(*args, **kwargs):  # the first eval diverges, the later ones do not
    out = real_eval_loop(*args, **kwargs)
    calls.append(out)
    if len(calls) == 1:
      out = {**out, "eval/loss": math.nan, "eval/perplexity": math.nan,
             "eval/bits_per_byte": math.nan}
    return out

  monkeypatch.setattr(steps, "eval_loop", nan_first)
  cfg = tiny_config("llama", **{"train.num_steps": 4, "train.eval_every_steps": 2,
                                "train.log_every_steps": 2, "eval.max_batches": 1})
  workdir = tmp_path / "run"
  final = train.train_and_evaluate(cfg, str(workdir))
  assert len(calls) == 2
  expected = {"eval/best_loss": final["eval/loss"],
              "eval/best_bits_per_byte": final["eval/bits_per_byte"], "eval/best_step": 4}
  assert math.isfinite(final["eval/loss"]) and {k: final[k] for k in expected} == expected
  text = (workdir / "best_eval.json").read_text()
  assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON {c}")) == expected
  first = [m for m in read_metrics(str(workdir)) if "eval/loss" in m][0]
  assert first["eval/loss"] is None and "eval/best_loss" not in first


def test_best_eval_json_is_replaced_whole_or_left_as_it_was(tmp_path, monkeypatch):
  # A reader (tables, a user) sees the old best or the new one: a write that fails (a full
  # disk) leaves the old file, never a cut-short one.
  from cem_jax import files

  monkeypatch.setattr(steps, "eval_loop", lambda *args: {
      "eval/loss": 1.0, "eval/perplexity": math.e, "eval/bits_per_byte": 0.5})
  lines = []
  run = types.SimpleNamespace(workdir=str(tmp_path), data=None, config=None, shardings=None)
  loop = types.SimpleNamespace(run=run, eval_step=None, params=None, best={}, is_main=True,
                               writer=types.SimpleNamespace(write=lambda *a: lines.append(a)))
  train._Loop.eval(loop, 4)
  best = {"eval/best_loss": 1.0, "eval/best_bits_per_byte": 0.5, "eval/best_step": 4}
  assert json.loads((tmp_path / "best_eval.json").read_text()) == best and len(lines) == 1
  before = (tmp_path / "best_eval.json").read_bytes()

  def full_disk(src, dst):
    raise OSError("No space left on device")

  monkeypatch.setattr(files.os, "replace", full_disk)
  loop.best = {}
  with pytest.raises(OSError, match="No space left on device"):
    train._Loop.eval(loop, 6)
  assert (tmp_path / "best_eval.json").read_bytes() == before


def test_the_rate_leaves_out_evals_and_saves_and_mfu_is_the_model_flops_over_the_peak(
    tmp_path, monkeypatch):
  # A fake clock: every reading is one second later, and an eval takes 1000 s more. Counted in,
  # the evals would put each interval over 1000 s.
  from cem_jax import model_stats

  now = [0.0]

  def clock():
    now[0] += 1.0
    return now[0]

  real_eval = steps.eval_loop

  def slow_eval(*args, **kwargs):
    now[0] += 1000.0
    return real_eval(*args, **kwargs)

  def slow_trace(*args, **kwargs):  # the profiler's start and its writing: 1000 s each
    now[0] += 1000.0

  monkeypatch.setattr(train, "_clock", clock)
  monkeypatch.setattr(steps, "eval_loop", slow_eval)
  monkeypatch.setattr(jax.profiler, "start_trace", slow_trace)
  monkeypatch.setattr(jax.profiler, "stop_trace", slow_trace)
  monkeypatch.setattr(train, "peak_flops", lambda devices: 1e9 * len(devices))  # CPU: none
  cfg = tiny_config("cem", **{"model.num_layers": 1, "train.num_steps": 6,
                              "train.log_every_steps": 2, "train.eval_every_steps": 2,
                              "checkpoint.every_steps": 2, "train.profile_steps": 2,
                              "train.profile_first_step": 3, "eval.num_steps": 2})
  train.train_and_evaluate(cfg, str(tmp_path / "w"))
  written = read_metrics(str(tmp_path / "w"))
  # The evals run eval.num_steps = 2 recursive steps (test-time steps) where training runs 1.
  assert [m["step"] for m in written if "eval/energy/layer0/step2/att_after" in m
          and "eval/energy/layer0/step3/att_after" not in m] == [2, 4, 6]
  lines = [m for m in written if "train/loss" in m]
  tokens_per_step = 8 * 64
  flops = 3 * tokens_per_step * model_stats.flops_per_token(cfg.model, 512, 64)
  assert [m["step"] for m in lines] == [2, 4, 6]
  for m in lines:
    # 2 steps over a few fake seconds (the clock's own readings), never over 1000.
    assert 2 * tokens_per_step / 10 < m["train/tokens_per_sec"] <= 2 * tokens_per_step, m
    steps_per_s = m["train/tokens_per_sec"] / tokens_per_step
    assert m["train/mfu"] == pytest.approx(steps_per_s * flops / (1e9 * jax.device_count()),
                                           rel=1e-12)
  # Without a known peak (a CPU) there is no train/mfu: test_train.py's command-line run.



def test_the_mfu_peak_is_that_of_every_device_of_the_run_not_the_first(monkeypatch):
  # train/mfu divides by the peak of all the global batch's devices: over the first one's it
  # read 8x too high on 8 GPUs. The training test above has one CPU device (the first is all
  # of them), so three H200s are stood in.
  h200 = types.SimpleNamespace(device_kind="NVIDIA H200")
  monkeypatch.setattr(train.jax, "devices", lambda: [h200] * 3)
  assert train._mfu_peak(tiny_config("llama")) == 3 * 989e12

def test_no_mfu_for_a_model_whose_flops_are_not_modelled(tmp_path, monkeypatch):
  # A user energy's operations are not in model_stats' count: its MFU would be the built-in's.
  monkeypatch.setattr(train, "peak_flops", lambda devices: 1e9 * len(devices))
  assert train._mfu_peak(tiny_config("cem")) == 1e9 * jax.device_count()
  assert train._mfu_peak(tiny_config("llama")) == 1e9 * jax.device_count()
  (tmp_path / "mine.py").write_text("import jax.numpy as jnp\n\n\ndef gate(y, context, params, "
                                    "aux):\n  return jnp.sum(y * y) * params['eta']\n")
  assert train._mfu_peak(tiny_config("cem", **{
      "model.mlp_energy": f"{tmp_path}/mine.py:gate"})) is None
  monkeypatch.setattr(train, "peak_flops", lambda devices: None)  # a CPU
  assert train._mfu_peak(tiny_config("cem")) is None


def test_the_rate_of_every_log_line_is_the_steps_of_its_own_interval(tmp_path, monkeypatch):
  # A clock that only training moves: each step takes exactly 1 s, each eval 1000 s (off the
  # clock), reading it takes none. Every log line's interval is then log_every_steps seconds
  # of log_every_steps steps: 1 step/s, tokens_per_sec = batch x seq_len, on every line, not
  # only the first (steps since the start over the last interval's seconds grow line by line).
  # The other values of a line are those its own step returned, its rate the schedule's after
  # step - 1 updates.
  now, returned = [0.0], {}
  real_step, real_eval = steps.make_train_step, steps.eval_loop

  def make_train_step(*args, **kwargs):
    step = real_step(*args, **kwargs)

    def one_second(*a):
      now[0] += 1.0
      out = step(*a)
      returned[int(a[-1])] = jax.device_get(out[2])  # by the step number the loop passes
      return out
    one_second.lower = step.lower  # the start-up compile
    return one_second

  def slow_eval(*args, **kwargs):
    now[0] += 1000.0
    return real_eval(*args, **kwargs)

  monkeypatch.setattr(train, "_clock", lambda: now[0])
  monkeypatch.setattr(steps, "make_train_step", make_train_step)
  monkeypatch.setattr(steps, "eval_loop", slow_eval)
  cfg = tiny_config("llama", **{"model.num_layers": 1, "train.num_steps": 6,
                                "train.log_every_steps": 2, "train.eval_every_steps": 1,
                                "eval.max_batches": 1})
  final = train.train_and_evaluate(cfg, str(tmp_path / "w"))  # its last eval
  written = read_metrics(str(tmp_path / "w"))
  lines = [m for m in written if "train/loss" in m]
  assert [(m["step"], m["train/tokens_per_sec"]) for m in lines] == [
      (2, 8 * 64.0), (4, 8 * 64.0), (6, 8 * 64.0)]
  schedule = optim.make_schedule(cfg.train)
  for m in lines:
    got = returned[m["step"]]
    assert (m["train/loss"], m["train/grad_norm"], m["train/learning_rate"]) == (
        float(got["loss"]), float(got["grad_norm"]), float(got["learning_rate"]))
    assert m["train/learning_rate"] == float(schedule(m["step"] - 1))
  assert sorted(returned) == list(range(1, 7))
  assert final == {k: v for k, v in written[-1].items() if k != "step"}


def test_an_eval_or_save_between_logs_waits_for_the_queued_steps_before_its_clock_starts(
    tmp_path, monkeypatch):
  # jax dispatches steps asynchronously: an eval that started its clock at once would wait
  # for the queued steps on its own clock, and that training time would be left out of
  # train/tokens_per_sec (measured by a review: 2-8x too high with evals between logs).
  events = []
  real_clock, real_wait, real_eval = train._clock, jax.block_until_ready, steps.eval_loop

  def clock():
    events.append("clock")
    return real_clock()

  def wait(tree):
    events.append("wait")
    return real_wait(tree)

  def evaluate(*args, **kwargs):
    events.append("eval")
    return real_eval(*args, **kwargs)

  real_step = steps.make_train_step

  def make_train_step(*args, **kwargs):
    step = real_step(*args, **kwargs)

    def counted(*a):
      events.append("step")
      return step(*a)
    counted.lower = step.lower  # the start-up compile
    return counted

  def tracer(name):
    return lambda *args, **kwargs: events.append(name)

  monkeypatch.setattr(train, "_clock", clock)
  monkeypatch.setattr(jax, "block_until_ready", wait)
  monkeypatch.setattr(steps, "eval_loop", evaluate)
  monkeypatch.setattr(steps, "make_train_step", make_train_step)
  monkeypatch.setattr(jax.profiler, "start_trace", tracer("trace"))
  monkeypatch.setattr(jax.profiler, "stop_trace", tracer("written"))
  real_ckpt_wait = train.Checkpointer.wait

  def ckpt_wait(self):
    events.append("saves written")
    return real_ckpt_wait(self)

  monkeypatch.setattr(train.Checkpointer, "wait", ckpt_wait)
  real_save = train.Checkpointer.save

  def save(self, *args, **kwargs):
    events.append("save")
    return real_save(self, *args, **kwargs)

  monkeypatch.setattr(train.Checkpointer, "save", save)
  cfg = tiny_config("llama", **{"model.num_layers": 1, "train.num_steps": 6,
                                "train.log_every_steps": 4, "train.eval_every_steps": 3,
                                "checkpoint.every_steps": 5, "eval.max_batches": 1,
                                "train.profile_steps": 4, "train.profile_first_step": 2})
  train.train_and_evaluate(cfg, str(tmp_path / "w"))
  evals = [i for i, e in enumerate(events) if e == "eval"]
  assert len(evals) == 2  # steps 3 and 6
  for i in evals:
    assert events[i - 2:i] == ["wait", "clock"], events
  # The saves (steps 5 and 6) and the trace's start and writing too: every clock start outside
  # a log follows a wait.
  starts = [i for i, e in enumerate(events) if e == "clock"]
  assert sum(events[i - 1] == "wait" for i in starts) == 6, events  # 2 evals, 2 saves, trace
  # The trace holds steps 2..5, and their device work: it is written after a wait. It starts
  # after the steps and checkpoint writes before it, and holds the eval of step 3 and the
  # save of its last step 5, which starts before the writing (a preemption's save would too).
  trace = [e for e in events
           if e in ("step", "trace", "written", "wait", "saves written", "eval", "save")]
  first, last = trace.index("trace"), trace.index("written")
  assert trace[:first].count("step") == 1 and trace[first:last].count("step") == 4, trace
  assert trace[first - 2:first] == ["wait", "saves written"], trace
  assert trace[last - 1] == "wait", trace
  assert trace[first:last].count("eval") == 1 and trace[first:last].count("save") == 1, trace


def test_a_trace_that_cannot_start_or_be_written_costs_the_run_nothing(monkeypatch, caplog):
  from cem_jax.profiling import StepProfiler

  def fail(*args, **kwargs):
    raise RuntimeError("Profile has already been started.")

  def full_disk():
    raise OSError("No space left on device")

  monkeypatch.setattr(jax.profiler, "start_trace", fail)
  profiler = StepProfiler("/tmp/unused", first=2, num_steps=2, start_step=0)
  assert not profiler.starts_at(1) and profiler.starts_at(2)
  profiler.start()  # logged; the window still opens and closes, with no trace
  assert "could not start the trace of steps 2..3" in caplog.text and profiler.stops_at(3)
  profiler.stop(3)
  monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: None)
  monkeypatch.setattr(jax.profiler, "stop_trace", full_disk)
  profiler = StepProfiler("/tmp/unused", first=2, num_steps=2, start_step=0)
  profiler.start()
  profiler.stop(3)
  assert ("could not write the trace of steps 2..3 into /tmp/unused (OSError: No space left "
          "on device); training goes on") in caplog.text
  # Another process keeps the window (its clock pauses with process 0's) and traces nothing.
  monkeypatch.setattr(jax.profiler, "start_trace", fail)
  other = StepProfiler("/tmp/unused", first=2, num_steps=2, start_step=1, trace=False)
  assert other.starts_at(2)
  other.start()
  assert other.stops_at(3)
  other.stop(3)
  assert caplog.text.count("could not start the trace") == 1  # the other never tried
  # A trace that did not start is not stopped: that would stop (and write) a trace the user
  # runs around the training.
  stops = []
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: stops.append("stopped"))
  profiler = StepProfiler("/tmp/unused", first=2, num_steps=2, start_step=0)
  profiler.start()
  profiler.stop(3)
  assert stops == []


def test_a_one_step_window_opens_and_closes_at_that_step():
  one = StepProfiler("/tmp/unused", first=3, num_steps=1, start_step=0, trace=False)
  assert [s for s in range(1, 6) if one.starts_at(s)] == [3]
  one.start()
  assert [s for s in range(1, 6) if one.stops_at(s)] == [3]


def test_a_profiler_error_is_reported_by_its_first_line(monkeypatch):
  from cem_jax import profiling

  def fail(*args, **kwargs):
    raise RuntimeError("first line\nsecond line")

  monkeypatch.setattr(jax.profiler, "start_trace", fail)
  assert profiling.start_trace("/tmp/unused") == "RuntimeError: first line"


def test_a_run_resumed_inside_the_window_traces_the_rest_of_it(caplog):
  # Window 2..5, resumed after step 3: steps 4 and 5 are traced; after step 5: nothing.
  rest = StepProfiler("/tmp/unused", first=2, num_steps=4, start_step=3, trace=False)
  assert [s for s in range(1, 8) if rest.starts_at(s)] == [4]
  rest.start()
  assert [s for s in range(1, 8) if rest.stops_at(s)] == [5]
  with caplog.at_level(logging.INFO):
    after = StepProfiler("/tmp/unused", first=2, num_steps=4, start_step=5)
  assert not any(after.starts_at(s) for s in range(1, 8))
  assert "steps 2..5 (train.profile_first_step, train.profile_steps) ran before" in caplog.text


def test_an_error_inside_the_window_still_writes_the_trace(monkeypatch):
  # The trace of the steps before an error may show why: abort writes it, then closes.
  events = []
  monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: events.append("start"))
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: events.append("written"))
  profiler = StepProfiler("/tmp/unused", first=2, num_steps=4, start_step=0)
  profiler.start()
  closer = lambda what: types.SimpleNamespace(close=lambda: events.append(what))  # noqa: E731
  loop = types.SimpleNamespace(profiler=profiler, done=3, save_left=False,
                               writer=closer("metrics closed"),
                               run=types.SimpleNamespace(ckpt=closer("checkpoints closed")))
  train._Loop.abort(loop)
  assert events == ["start", "written", "checkpoints closed", "metrics closed"]


def test_the_peak_is_that_of_every_device_and_unknown_if_any_is_unknown(monkeypatch):
  from cem_jax import model_stats

  h200, cpu = (types.SimpleNamespace(device_kind=k) for k in ("NVIDIA H200", "cpu"))
  assert model_stats.peak_flops([h200] * 8) == 8 * 989e12
  assert model_stats.peak_flops(h200) == 989e12
  assert model_stats.peak_flops([h200, cpu]) is None and model_stats.peak_flops([cpu]) is None
  # NVIDIA's A100 data sheet: 312 TFLOP/s dense bf16 (624 is with 2:4 sparsity).
  a100 = types.SimpleNamespace(device_kind="NVIDIA A100-SXM4-80GB")
  assert model_stats.peak_flops(a100) == 312e12
  # By default: this process's first device, not all of them.
  monkeypatch.setattr(model_stats.jax, "local_devices", lambda: [h200] * 8)
  assert model_stats.peak_flops() == 989e12
  # A TPU under each name jax reports for it (a v5p chip says "TPU v5").
  for kinds, peak in ((("TPU v5", "TPU v5p"), 459e12), (("TPU v5 lite", "TPU v5e"), 197e12),
                      (("TPU v6 lite", "TPU v6e"), 918e12)):
    for kind in kinds:
      assert model_stats.peak_flops(types.SimpleNamespace(device_kind=kind)) == peak, kind
  # Every other listed kind against its data sheet's dense bf16 figure, so that none is the
  # sparse one or missing (a missing kind silently leaves MFU empty): H100 SXM 989 TFLOP/s
  # (1979 with 2:4 sparsity), A100 312 at either memory size, TPU v4 275.
  for kind, peak in (("NVIDIA H100", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                     ("NVIDIA A100-SXM4-40GB", 312e12), ("TPU v4", 275e12)):
    assert model_stats.peak_flops(types.SimpleNamespace(device_kind=kind)) == peak, kind
  assert model_stats.peak_flops([]) is None  # no devices: no peak, not 0 FLOP/s


# An earlier run's metrics.jsonl: a step-0 line and evals at steps 10, 20 and 30.
_EARLIER_METRICS = [{"step": 0, "params/total": 7},
                    {"step": 10, "eval/loss": 2.0, "eval/bits_per_byte": 1.0},
                    {"step": 20, "eval/loss": 2.5, "eval/bits_per_byte": 1.2},
                    {"step": 30, "eval/loss": 1.0, "eval/bits_per_byte": 0.5}]


def _open_metrics_at(start: int, workdir, lines=_EARLIER_METRICS, best_eval=None):
  """train._open_metrics of a 40-step run resumed at ``start`` in a new ``workdir`` holding
  ``lines`` (and ``best_eval`` as best_eval.json): its (best, last_eval)."""
  workdir.mkdir()
  write_metrics(workdir, lines)
  if best_eval is not None:
    (workdir / "best_eval.json").write_text(json.dumps(best_eval))
  cfg = tiny_config("llama", **{"train.num_steps": 40})
  run = types.SimpleNamespace(workdir=str(workdir), start_step=start, config=cfg, model=None,
                              data=types.SimpleNamespace(stats=lambda: {"train_windows": 999}))
  writer, best, last_eval = train._open_metrics(run, cfg.to_dict(), True)
  writer.close()
  return best, last_eval


def test_metrics_jsonl_on_a_fresh_start_and_on_resume(tmp_path, monkeypatch):
  # What _open_metrics keeps of an earlier run's metrics.jsonl: on resume at step s its lines up
  # to s and the best eval among them; on a fresh start (killed before its first checkpoint)
  # none of them, so no step appears twice.
  monkeypatch.setattr(train, "count_params", lambda model: 7)
  old = _EARLIER_METRICS

  def open_at(start: int, workdir):
    best, last_eval = _open_metrics_at(start, workdir)
    return read_metrics(str(workdir)), best, last_eval

  kept, best, last_eval = open_at(20, tmp_path / "resumed")
  assert [m["step"] for m in kept] == [0, 10, 20]
  assert best == {"eval/best_loss": 2.0, "eval/best_bits_per_byte": 1.0, "eval/best_step": 10}
  assert last_eval == {}  # the run goes on: its evals are to come
  kept, best, last_eval = open_at(0, tmp_path / "fresh")
  assert [m["step"] for m in kept] == [0] and "data/epochs" in kept[0]
  assert best == {} and last_eval == {}
  kept, _, _ = open_at(1, tmp_path / "one")  # resumed at step 1: the step-0 line is kept once
  assert [m["step"] for m in kept] == [0]
  # A finished run (the checkpoint at train.num_steps) run again: the run's result is its last
  # eval line, and nothing is rewritten or added (no config.json, no TensorBoard events).
  kept, _, last_eval = open_at(40, tmp_path / "finished")
  assert kept == old and last_eval == {"eval/loss": 1.0, "eval/bits_per_byte": 0.5}
  assert sorted(os.listdir(tmp_path / "finished")) == ["metrics.jsonl"]


def test_best_eval_json_names_no_eval_past_the_restored_step(tmp_path, monkeypatch):
  # A run killed after its step-30 eval but before checkpoint 30 committed (or whose checkpoint
  # 30 was damaged and set aside) resumes at 20: the step-30 eval never happened now, so
  # best_eval.json must not keep naming it (a resumed run that stops before its next eval, by
  # SIGTERM or a divergence, would leave it beside a metrics.jsonl without that eval).
  monkeypatch.setattr(train, "count_params", lambda model: 7)
  old = _EARLIER_METRICS
  stale = {"eval/best_loss": 1.0, "eval/best_bits_per_byte": 0.5, "eval/best_step": 30}

  def open_at(start: int, name: str, lines=old):
    best, _ = _open_metrics_at(start, tmp_path / name, lines, best_eval=stale)
    path = tmp_path / name / "best_eval.json"
    return best, (json.loads(path.read_text()) if path.exists() else None)

  best, written = open_at(20, "resumed")
  assert best == written == {"eval/best_loss": 2.0, "eval/best_bits_per_byte": 1.0,
                             "eval/best_step": 10}
  # Resumed before any eval, or started over (killed before its first checkpoint): no best.
  assert open_at(5, "no_eval_yet") == ({}, None)
  assert open_at(0, "fresh") == ({}, None)
  # A finished run run again rewrites nothing, best_eval.json included.
  assert open_at(40, "finished", old + [{"step": 40, "eval/loss": 3.0,
                                          "eval/bits_per_byte": 2.0}])[1] == stale


def _write_trace(folder, events):
  import gzip

  path = folder / "plugins" / "profile" / "2026_12_04_18_00_00" / "perfetto_trace.json.gz"
  path.parent.mkdir(parents=True)
  with gzip.open(path, "wt") as f:
    json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)


def _process(pid, name, threads):
  meta = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}]
  return meta + [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                  "args": {"name": line}} for tid, line in threads.items()]


def _kernel(pid, tid, name, ts, dur):
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


@pytest.mark.parametrize("name, kind", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64", "attention"),
    ("mha_forward", "attention"),  # Pallas's Triton attention (experiments/attention_kernels.py)
    ("mha_backward_dkdv", "attention"),
    ("splash_mha_fwd_no_residuals", "attention"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("gemm_fusion_dot_3", "matmul"),  # XLA's Triton GEMM
    ("convolution.12", "matmul"),  # a TPU's matmuls are convolutions
    ("ncclDevKernel_AllGather_RING_LL", "collective"),
    ("all-reduce.4", "collective"),
    ("reduce-scatter-start.1", "collective"),
    ("MemcpyD2D", "copy"),
    ("copy.7", "copy"),
    ("loop_multiply_fusion", "other"),
    ("input_reduce_fusion_2", "other"),
])
def test_a_kernel_is_classified_by_its_name(name, kind):
  from cem_jax import profiling

  assert profiling.kernel_kind(name) == kind


def test_the_kernel_summary_sums_a_gpu_trace_by_kind_per_step(tmp_path):
  from cem_jax import profiling

  _write_trace(tmp_path, _gpu_trace())
  got = profiling.kernel_summary(str(tmp_path), steps=2, top=2)
  # busy: [0, 160] + [300, 320] + [400, 410] + [500, 540] = 230 µs; span 0..540.
  assert got["ms_per_step"] == {"attention": 0.025, "matmul": 0.05, "collective": 0.01,
                                "copy": 0.005, "other": 0.04, "busy": 0.115, "span": 0.27}
  assert got["kernels_per_step"] == 3.0
  assert got["top"] == [["nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 0.05],
                        ["loop_multiply_fusion", 0.04]]


def test_the_kernel_summary_of_several_devices_is_per_device(tmp_path):
  # 8 GPUs must not read as 8x the step: each device's own timeline, then the mean.
  from cem_jax import profiling

  second = _process(4, "/device:GPU:1", {40: "Stream #13(Compute)"}) + [
      _kernel(4, 40, "sm90_xmma_gemm_bf16bf16_bf16f32", 0, 300)]  # busy and span 0..300
  _write_trace(tmp_path, _gpu_trace() + second)
  got = profiling.kernel_summary(str(tmp_path), steps=1)
  # GPU:0 as in the test above (2 steps' worth in one here): busy 230, span 540 µs.
  assert got["ms_per_step"] == {"attention": 0.025, "matmul": 0.2, "collective": 0.01,
                                "copy": 0.005, "other": 0.04, "busy": 0.265, "span": 0.42}
  assert got["devices"] == 2 and got["kernels_per_step"] == 3.5


@pytest.mark.parametrize("num_steps, line", [
    # The window's 2 steps (4..5) divide the trace's times.
    (2, "attention 0.025, matmul 0.050, collective 0.010, copy 0.005, other 0.040; busy 0.115 "
        "of a 0.270 span, 3 kernels"),
    # Window 4..4 stopped after step 4: one step traced, the whole trace's times over 1 step
    # (twice the figures of the 2-step window; 6 device kernels).
    (1, "attention 0.050, matmul 0.100, collective 0.020, copy 0.010, other 0.080; busy 0.230 "
        "of a 0.540 span, 6 kernels"),
])
def test_a_training_trace_logs_its_kernel_summary(num_steps, line, tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: None)
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: _write_trace(tmp_path, _gpu_trace()))
  window = StepProfiler(str(tmp_path), first=4, num_steps=num_steps, start_step=0)
  window.start()
  with caplog.at_level(logging.INFO):
    window.stop(3 + num_steps)
  assert f"profile: device time per step, ms: {line}" in caplog.text


def _gpu_trace():
  """A GPU trace as jax writes it: a host process, a device with two streams and a derived
  "XLA Ops" line repeating the kernels. Times in µs, over 2 steps; the expected figures are
  worked by hand in the test above."""
  events = _process(1, "/host:CPU", {10: "python"}) + _process(
      2, "/device:GPU:0", {20: "Stream #13(Compute)", 21: "Stream #14(Compute)", 22: "XLA Ops"})
  events += [
      _kernel(1, 10, "gemm on the host thread", 0, 999),  # not a device kernel
      _kernel(2, 20, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 0, 100),  # matmul 0..100
      _kernel(2, 20, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 100, 50),  # ..150
      _kernel(2, 21, "loop_multiply_fusion", 120, 40),  # other, overlaps: busy until 160
      _kernel(2, 20, "ncclDevKernel_AllReduce_Sum_bf16", 300, 20),  # collective 300..320
      _kernel(2, 21, "MemcpyD2D", 400, 10),  # copy 400..410
      _kernel(2, 21, "loop_multiply_fusion", 500, 40),  # other 500..540
      _kernel(2, 22, "dot.1", 0, 540),  # the derived line: counted nowhere
  ]
  return events


def test_the_kernel_summary_reads_xla_ops_without_streams_and_refuses_a_trace_without_a_device(
    tmp_path):
  from cem_jax import profiling

  tpu = tmp_path / "tpu"
  _write_trace(tpu, _process(3, "/device:TPU:0", {1: "XLA Modules", 2: "XLA Ops"}) + [
      _kernel(3, 1, "jit_train_step", 0, 90),  # the module around its ops: not counted
      _kernel(3, 2, "splash_mha_fwd", 0, 30), _kernel(3, 2, "fusion.3", 30, 60)])
  got = profiling.kernel_summary(str(tpu), steps=1)
  assert got["ms_per_step"]["attention"] == 0.03 and got["ms_per_step"]["other"] == 0.06
  assert got["ms_per_step"]["busy"] == 0.09 and got["kernels_per_step"] == 2
  cpu = tmp_path / "cpu"
  _write_trace(cpu, _process(1, "/host:CPU", {10: "python"}) + [_kernel(1, 10, "step", 0, 5)])
  with pytest.raises(ValueError, match=r"no device kernels in the trace \(processes: /host:CPU\)"):
    profiling.kernel_summary(str(cpu), steps=1)
  with pytest.raises(ValueError, match="no perfetto_trace.json.gz under"):
    profiling.kernel_summary(str(tmp_path / "none"), steps=1)
  cut = tmp_path / "cut"
  _write_trace(cut, _gpu_trace())
  (path,) = cut.rglob("perfetto_trace.json.gz")
  path.write_bytes(path.read_bytes()[:40])  # a trace whose writing was cut short
  with pytest.raises(ValueError, match=r"perfetto_trace.json.gz: not a readable trace \("):
    profiling.kernel_summary(str(cut), steps=1)



def test_the_kernel_summary_refuses_bad_steps_and_a_window_stopped_before_its_first_step(
    tmp_path, monkeypatch, caplog):
  from cem_jax import profiling

  _write_trace(tmp_path, _gpu_trace())
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match=rf"steps={bad!r}; allowed: an integer >= 1"):
      profiling.kernel_summary(str(tmp_path), steps=bad)
  with pytest.raises(ValueError, match=r"top=-1; allowed: an integer >= 0"):
    profiling.kernel_summary(str(tmp_path), steps=1, top=-1)
  # A run that fails in the window's first step stops it at the step before (abort): no step
  # was traced, which the log says (was: "no kernel summary (ZeroDivisionError: ...)").
  monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: None)
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
  window = StepProfiler(str(tmp_path), first=4, num_steps=2, start_step=0)
  window.start()
  with caplog.at_level(logging.INFO):
    window.stop(3)
  assert "no kernel summary (no step of the window finished)" in caplog.text
  assert "ZeroDivisionError" not in caplog.text


def test_the_kernel_summary_reads_the_trace_written_last_not_the_last_folder_name(tmp_path):
  # The folders are named by local time: a resume in another time zone (or after a DST change)
  # writes a folder whose name sorts first. jax writes into the newest by mtime; so must we.
  from cem_jax import profiling

  _write_trace(tmp_path, _gpu_trace())
  (old,) = tmp_path.rglob("perfetto_trace.json.gz")
  os.rename(old.parent, old.parent.parent / "2026_12_05_09_00_00")  # a later-sorting name
  os.utime(old.parent.parent / "2026_12_05_09_00_00" / old.name, (1, 1))
  new = tmp_path / "plugins" / "profile" / "2026_12_04_07_00_00" / "perfetto_trace.json.gz"
  new.parent.mkdir()
  import gzip
  with gzip.open(new, "wt") as f:
    json.dump({"traceEvents": _process(2, "/device:GPU:0", {20: "Stream #13(Compute)"}) + [
        _kernel(2, 20, "the_new_trace_gemm", 0, 10)]}, f)
  assert profiling.kernel_summary(str(tmp_path), steps=1)["top"] == [["the_new_trace_gemm",
                                                                      0.01]]


def test_the_kernel_summary_is_per_device_and_odd_events_are_one_value_error(tmp_path):
  from cem_jax import profiling

  # Two GPUs running the same kernels at the same times: per device, the figures of one.
  two = _gpu_trace() + [dict(e, pid=5) for e in _gpu_trace() if e.get("pid") == 2]
  two = [dict(e, args={"name": "/device:GPU:1"}) if e.get("pid") == 5 and
         e.get("name") == "process_name" else e for e in two]
  _write_trace(tmp_path / "two", two)
  got = profiling.kernel_summary(str(tmp_path / "two"), steps=2)
  assert got["devices"] == 2 and got["kernels_per_step"] == 3.0
  assert got["ms_per_step"] == {"attention": 0.025, "matmul": 0.05, "collective": 0.01,
                                "copy": 0.005, "other": 0.04, "busy": 0.115, "span": 0.27}
  odd = {"negative": (dict(_kernel(2, 20, "k", 0, -5)), r"kernel 'k' has dur=-5; allowed"),
         "nan": (dict(_kernel(2, 20, "k", 0, float("nan"))), r"kernel 'k' has dur=nan; allow"),
         "bool": (dict(_kernel(2, 20, "k", True, 5)), r"kernel 'k' has ts=True; allowed"),
         "list pid": ({"ph": "X", "pid": [2], "tid": 20, "name": "k", "ts": 0, "dur": 1},
                      r"not a readable trace \(TypeError: unhashable")}
  for name, (event, message) in odd.items():
    _write_trace(tmp_path / name, _gpu_trace() + [event])
    with pytest.raises(ValueError, match=r"perfetto_trace.json.gz: " + message):
      profiling.kernel_summary(str(tmp_path / name), steps=1)


def test_the_first_rate_after_a_resume_counts_only_the_steps_run_since_the_resume(
    tmp_path, monkeypatch):
  # A clock that only training moves (1 s a step). A run checkpointed at step 2 and resumed to
  # step 4 has run 2 steps in the 2 s of its first log interval: 1 step/s, batch x seq_len
  # tokens/s, not the 4 steps since step 0 (a rate twice the real one).
  now = [0.0]
  real_step = steps.make_train_step

  def make_train_step(*args, **kwargs):
    step = real_step(*args, **kwargs)

    def one_second(*a):
      now[0] += 1.0
      return step(*a)
    one_second.lower = step.lower
    return one_second

  monkeypatch.setattr(train, "_clock", lambda: now[0])
  monkeypatch.setattr(steps, "make_train_step", make_train_step)
  workdir = str(tmp_path / "w")
  for num_steps in (2, 4):
    cfg = tiny_config("llama", **{"model.num_layers": 1, "train.num_steps": num_steps,
                                  "train.log_every_steps": 2, "train.eval_every_steps": 100,
                                  "eval.max_batches": 1})
    train.train_and_evaluate(cfg, workdir)
  lines = [m for m in read_metrics(workdir) if "train/loss" in m]
  assert [(m["step"], m["train/tokens_per_sec"]) for m in lines] == [
      (2, 8 * 64.0), (4, 8 * 64.0)]


def test_the_epochs_warning_starts_at_exactly_two_passes(caplog):
  # "from EPOCHS_WARNING passes on": 30 steps x 8 rows over 120 windows is 2.0 passes, warned;
  # over 121 windows (1.98 passes) not. Counted by hand: 240 / 120 = 2, 240 / 121 < 2.
  cfg = tiny_config("llama")
  for windows, warned in ((120, True), (121, False)):
    caplog.clear()
    passes = train.epochs(cfg, windows)
    assert passes == 240 / windows
    with caplog.at_level(logging.WARNING):
      train._log_schedule(cfg.train, windows, passes, True)
    assert any("passes over the" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records) == warned, windows


def test_a_window_that_never_opened_stops_no_trace(monkeypatch):
  # The loop closes the profiler at the end of every run (and on an error): a run without a
  # window, or one that ends before its window, must not stop a trace the user runs around the
  # training (nor log that it could not write one).
  stops = []
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: stops.append("stopped"))
  for profiler in (StepProfiler("/tmp/unused", first=1, num_steps=0, start_step=0),
                   StepProfiler("/tmp/unused", first=5, num_steps=2, start_step=0)):
    profiler.stop(3)
  assert stops == []


def test_the_span_ends_with_the_kernel_that_ends_last_not_the_one_that_starts_last(tmp_path):
  from cem_jax import profiling

  # Two streams: a long GEMM from 10 to 510 µs; the kernel that starts last ends at 250.
  _write_trace(tmp_path, _process(2, "/device:GPU:0", {20: "Stream #13(Compute)",
                                                       21: "Stream #14(Compute)"}) + [
      _kernel(2, 20, "loop_fusion", 0, 100), _kernel(2, 21, "nvjet_gemm", 10, 500),
      _kernel(2, 20, "loop_fusion", 200, 50)])
  got = profiling.kernel_summary(str(tmp_path), steps=1)
  assert got["ms_per_step"]["span"] == 0.51 and got["ms_per_step"]["busy"] == 0.51
