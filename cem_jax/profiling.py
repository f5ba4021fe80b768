"""A trace of a window of training steps with the jax profiler (``train.profile_steps``).

Where the step time goes (kernels, collectives, host gaps, the input pipeline) is read off a
trace, not off ``train/tokens_per_sec``. Process 0 traces ``train.profile_steps`` steps from
``train.profile_first_step`` on with :func:`jax.profiler.start_trace` into
``WORKDIR/tensorboard`` (TensorBoard's profile-plugin layout: a folder
``plugins/profile/<time the trace was written>/`` with ``<host>.xplane.pb`` for the plugin and
``perfetto_trace.json.gz`` for https://ui.perfetto.dev). The loop marks each step's dispatch on
the host (:func:`step_marker`: ``StepTraceAnnotation("train", step_num=step)``); the device work
of a step follows its mark asynchronously. The window holds everything its steps do: reading
their batches, and an eval or a checkpoint save due at one of them. The trace's start (after
the steps and checkpoint writes before it have finished) and its writing (after the last
step's save, so that a preemption's save is committed first) are left out of
``train/tokens_per_sec``.
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
import re

import jax
from absl import logging

from cem_jax.errors import one_line

STEP_NAME = "train"  # the name of every step's mark in a trace (Perfetto, TensorBoard)


def step_marker(step: int) -> jax.profiler.StepTraceAnnotation:
  """The host-side mark of training step ``step`` (1-based) in a trace: a context manager
  around the step's dispatch, named :data:`STEP_NAME` with ``step_num=step``. Costs nothing
  when no trace is running."""
  return jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step)


def start_trace(log_dir: str) -> str | None:
  """Starts a jax profiler trace into ``log_dir`` (with ``perfetto_trace.json.gz``). Returns
  None, or one line saying why it could not start (another trace is running in this
  process): a trace is an aid, never a reason to stop the work it watches."""
  try:
    jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
  except Exception as e:  # noqa: BLE001 - reported to the caller as one line
    return one_line(e)
  return None


def stop_trace() -> str | None:
  """Stops the running trace and writes it. Returns None, or one line saying why it could
  not be written (a full disk, a path that is a file); jax may then keep this process's
  profiler busy, so that later traces cannot start (each says so)."""
  try:
    jax.profiler.stop_trace()
  except Exception as e:  # noqa: BLE001 - reported to the caller as one line
    return one_line(e)
  return None


class StepProfiler:
  """Where the window of steps ``first .. first + num_steps - 1`` (1-based, as the log counts
  them) starts and stops, on every process; the trace itself on process 0.

  Args:
    log_dir: where :func:`jax.profiler.start_trace` writes (``metrics.tensorboard_dir``).
    first: ``train.profile_first_step``.
    num_steps: ``train.profile_steps``; 0 = no window.
    start_step: the steps already done (a resumed run traces the rest of its window, or
      nothing if the window ran before the resume; logged).
    trace: whether this process writes the trace (process 0). Every process keeps the
      window, so that all of them pause their clocks while process 0 writes.
  """

  def __init__(self, log_dir: str, first: int, num_steps: int, start_step: int,
               trace: bool = True):
    self.log_dir = log_dir
    self.last = first + num_steps - 1
    self.first = max(first, start_step + 1)
    self.window = num_steps > 0 and self.first <= self.last
    self.trace = trace
    self.open = False
    if trace and num_steps > 0:
      if self.window:
        logging.info("profile: steps %d..%d will be traced into %s", self.first, self.last,
                     log_dir)
      else:
        logging.info("profile: steps %d..%d (train.profile_first_step, train.profile_steps) "
                     "ran before this start at step %d: no trace", first, self.last,
                     start_step)

  def starts_at(self, step: int) -> bool:
    """Whether the window opens before step ``step`` (1-based) runs."""
    return self.window and not self.open and step == self.first

  def stops_at(self, step: int) -> bool:
    """Whether the window closes after step ``step`` (1-based) has run."""
    return self.open and step == self.last

  def start(self) -> None:
    """Opens the window; on process 0 starts the trace. A trace that cannot start (another
    one already running in this process, e.g. a user's around the training) is logged as an
    error and training goes on without it."""
    self.open = True
    if not self.trace:
      return
    error = start_trace(self.log_dir)
    if error:
      self.trace = False
      logging.error("profile: could not start the trace of steps %d..%d (%s); training goes "
                    "on without it", self.first, self.last, error)

  def stop(self, through: int) -> None:
    """Closes the window, if open; on process 0 writes the trace of the steps up to
    ``through`` (the last step run: ``last``, or less when the run stops inside the window).
    The loop waits for the traced steps first when the window closes as planned; on an error
    it writes what the profiler has. A trace that cannot be written (a full disk) is logged
    as an error: the training goes on, and this process's profiler may stay unusable (jax
    does not reset it)."""
    if not self.open:
      return
    self.open = False
    if not self.trace:
      return
    error = stop_trace()
    if error:
      logging.error("profile: could not write the trace of steps %d..%d into %s (%s); "
                    "training goes on", self.first, through, self.log_dir, error)
      return
    logging.info("profile: trace of steps %d..%d written under %s (TensorBoard's profile "
                 "plugin, or perfetto_trace.json.gz at https://ui.perfetto.dev)", self.first,
                 through, self.log_dir)
    if through < self.first:  # stopped before the window's first step finished (abort)
      logging.info("profile: no kernel summary (no step of the window finished)")
      return
    try:
      summary = kernel_summary(self.log_dir, through - self.first + 1)
    except Exception as e:  # noqa: BLE001 - an aid: a CPU trace has no device kernels
      logging.info("profile: no kernel summary (%s)", one_line(e))
      return
    ms = summary["ms_per_step"]
    each = f" (the mean of {summary['devices']} devices)" if summary["devices"] > 1 else ""
    logging.info("profile: device time per step%s, ms: %s; busy %.3f of a %.3f span, %.0f "
                 "kernels", each, ", ".join(f"{kind} {ms[kind]:.3f}" for kind in ms
                                            if kind not in ("busy", "span")),
                 ms["busy"], ms["span"], summary["kernels_per_step"])


# What a device kernel is, by its name (first match wins; the rest is "other": XLA's fusions of
# element-wise work and reductions). cuBLAS on Hopper names its kernels nvjet_* or *xmma_gemm*;
# XLA's Triton GEMMs are *gemm_fusion*; cuDNN's flash attention is cudnn_*_sdpa_*; Pallas's
# attention kernels are mha_* (GPU) and splash_* (TPU).
KERNEL_KINDS = (
    ("attention", re.compile(r"cudnn|mha|sdpa|flash|attention|splash", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|convolution", re.I)),
    ("collective", re.compile(r"nccl|all-reduce|all_reduce|all-gather|all_gather|"
                              r"reduce-scatter|reduce_scatter|all-to-all|collective", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def kernel_kind(name: str) -> str:
  """The kind of a device kernel named ``name``: the first of :data:`KERNEL_KINDS` whose
  pattern it contains (case-insensitive), else ``'other'``."""
  return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def kernel_summary(trace_dir: str, steps: int, top: int = 10) -> dict:
  """Where the device time of a trace goes: kernel time per step by kind, from the newest
  ``perfetto_trace.json.gz`` under ``trace_dir`` (:func:`start_trace`'s layout).

  The kernels are the complete events of the device processes (``/device:...``) on their
  stream lines (GPU: ``Stream #...``), or on ``XLA Ops`` where there are none (TPU); other
  lines of a device (modules, steps) would count the same time twice.

  Args:
    trace_dir: a folder holding a trace (searched recursively).
    steps: how many steps the trace holds; every figure is divided by it.
    top: how many of the longest kernels (by total time) to list.
  Returns:
    ``{"ms_per_step": {kind: ms, ..., "busy": ms, "span": ms}, "kernels_per_step": float,
    "devices": int, "top": [[name, ms per step], ...]}``, kinds as :data:`KERNEL_KINDS` plus
    ``other``; ``busy``: the time at least one kernel runs (overlaps counted once), ``span``:
    first kernel start to last kernel end; milliseconds per step and per device (the mean
    over the ``devices`` that ran kernels), rounded to 1 ns.
  Raises:
    ValueError: ``steps`` < 1 or ``top`` < 0; no trace under ``trace_dir`` (the one written
      last is read); one that is not gzip'd JSON (cut short) or holds odd events (a kernel
      without a finite duration >= 0); or no device kernels in it (a CPU run has no device
      process), naming what the trace holds.
  """
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(f"kernel_summary: steps={steps!r}; allowed: an integer >= 1 (the steps "
                     "the trace holds)")
  if isinstance(top, bool) or not isinstance(top, int) or top < 0:
    raise ValueError(f"kernel_summary: top={top!r}; allowed: an integer >= 0")
  paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  if not paths:
    raise ValueError(f"no perfetto_trace.json.gz under {trace_dir}")
  # The one written last, as jax picks the folder it writes into: the folders are named by
  # local time, which does not order traces across time zones or a DST change.
  path = max(paths, key=os.path.getmtime)
  try:
    return _summary(path, steps, top)
  except ValueError:
    raise
  except Exception as e:  # noqa: BLE001 - odd events (an unhashable pid, deep nesting)
    raise ValueError(f"{path}: not a readable trace ({one_line(e)})") from e


def _summary(path: str, steps: int, top: int) -> dict:
  try:
    with gzip.open(path) as f:
      events = [e for e in json.load(f)["traceEvents"] if isinstance(e, dict)]
  except ValueError as e:  # not JSON; kernel_summary words every other failure the same way
    raise ValueError(f"{path}: not a readable trace ({one_line(e)})") from e
  meta = [e for e in events if e.get("ph") == "M" and isinstance(e.get("args"), dict)]
  processes = {e.get("pid"): str(e["args"].get("name", "")) for e in meta
               if e.get("name") == "process_name"}
  lines = {(e.get("pid"), e.get("tid")): str(e["args"].get("name", "")) for e in meta
           if e.get("name") == "thread_name" and e.get("pid") in processes
           and processes[e.get("pid")].startswith("/device:")}
  if not lines:
    raise ValueError(f"{path}: no device kernels in the trace (processes: "
                     f"{', '.join(sorted(set(processes.values()))) or 'none'})")
  keep = {k for k, name in lines.items() if name.startswith("Stream")}
  keep = keep or {k for k, name in lines.items() if name == "XLA Ops"}
  kernels = [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in keep]
  for e in kernels:
    for key in ("ts", "dur"):
      value = e.get(key)
      if (isinstance(value, bool) or not isinstance(value, (int, float))
          or not math.isfinite(value) or (key == "dur" and value < 0)):
        raise ValueError(f"{path}: kernel {str(e.get('name', ''))[:80]!r} has {key}={value!r}; "
                         f"allowed: a finite number of microseconds{', >= 0' * (key == 'dur')}")
  if not kernels:
    raise ValueError(f"{path}: no kernels on a device's stream or XLA Ops lines (lines: "
                     f"{', '.join(sorted(set(lines.values())))})")
  per_kind = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
  per_name: dict[str, float] = {}
  for e in kernels:
    name = str(e.get("name", ""))
    kind = kernel_kind(name)
    per_kind[kind] += e["dur"]
    per_name[name] = per_name.get(name, 0.0) + e["dur"]
  devices = sorted({e.get("pid") for e in kernels}, key=str)
  busy = span = 0.0
  for pid in devices:  # each device's own timeline: overlaps count once, devices add up
    mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels if e.get("pid") == pid)
    end = None
    for start, stop in mine:
      if end is None or start >= end:
        busy += stop - start
        end = stop
      elif stop > end:
        busy += stop - end
        end = stop
    span += max(stop for _, stop in mine) - mine[0][0]
  per = len(devices) * steps  # figures per device and step
  ms = lambda us: round(us / 1e3 / per, 6)  # trace times are microseconds
  longest = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
  return {"ms_per_step": {k: ms(v) for k, v in per_kind.items()} | {"busy": ms(busy),
                                                                      "span": ms(span)},
          "kernels_per_step": len(kernels) / per, "devices": len(devices),
          "top": [[name, ms(us)] for name, us in longest]}

