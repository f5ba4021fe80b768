"""``metrics.jsonl`` (one JSON object per line, each with ``step``: DESIGN.md's contract) and,
beside it, TensorBoard event files in ``WORKDIR/tensorboard`` with the same scalars."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
import weakref

from absl import logging

from cem_jax import errors, signals
from cem_jax.files import atomic_write_bytes, naming


def metrics_path(workdir: str) -> str:
  """``WORKDIR/metrics.jsonl``: the run's metric lines (:class:`MetricsWriter`,
  :func:`read_metrics`), for every module that reads or copies them."""
  return os.path.join(workdir, "metrics.jsonl")


def tensorboard_dir(workdir: str) -> str:
  """``WORKDIR/tensorboard``: the scalars' event files and the profiler's traces
  (:mod:`cem_jax.profiling`), so one ``tensorboard --logdir`` shows both."""
  return os.path.join(workdir, "tensorboard")


class MetricsWriter:
  """Appends metric lines to ``WORKDIR/metrics.jsonl`` (only where ``enabled``: process 0).

  Args:
    workdir: the run's folder.
    enabled: False on processes other than 0, which then write nothing.
    truncate_after_step: on resume, lines with a larger ``step`` (written by a run that died
      after its last checkpoint) are dropped so the file never shows a step twice; TensorBoard
      is told to purge its events after that step too.
    tensorboard: also write the numeric values as TensorBoard scalars.
    hold: the signals held while the run waits for TensorBoard's writer
      (:func:`cem_jax.signals.held`): delivered when its call returns; a second one stops the
      wait at once, the call going on in its thread (:class:`cem_jax.signals.Calls`).
      Add SIGTERM where its Python handler may raise (train's start-up,
      :class:`cem_jax.workdir.Preemption`), never where a handler set below Python's has it
      (JAX's preemption notifier in a multi-process run): replaced, it would be lost.

  Raises:
    ValueError: with ``truncate_after_step``, a damaged line before the last one, as
      :func:`read_metrics` (a cut-short last line is dropped with a warning).
  """

  # TensorBoard events a writer may hold for its thread: enough that a put never waits (at 10,
  # tensorboardX's default, a write waited for ever once that thread had died), each one a
  # scalar of a few dozen bytes.
  _QUEUE = 1 << 16

  def __init__(self, workdir: str, enabled: bool = True, truncate_after_step: int | None = None,
               tensorboard: bool = True, hold: tuple[int, ...] = (signal.SIGINT,)):
    self.path = metrics_path(workdir)
    self.enabled = enabled
    self._hold = hold
    self._file = None
    self._tb = None
    self._calls = None
    self._hook = None  # the _Hook held while TensorBoard's writer is open
    self._tb_threads = []  # tensorboardX's own (its writer's), told dead by is_alive
    self._said_dead = False
    if not enabled:
      return
    kept = None
    if truncate_after_step is not None and os.path.exists(self.path):
      # Read by read_metrics' own parser, before anything is written: a file it would refuse
      # is refused here too (instead of losing its damaged lines without a word), and a
      # refused resume leaves the run as it was.
      lines, torn = _parse_metrics(self.path)
      if torn is not None:
        logging.warning("%s: dropped its cut-short last line (a kill mid-write): %.80r",
                        self.path, torn)
      kept = "".join(text + "\n" for text, m in lines if m["step"] <= truncate_after_step)
    if tensorboard:
      from tensorboardX import SummaryWriter  # imported here: only process 0 writes events

      # TensorBoard purges the events at and after purge_step: those after the kept step.
      purge = None if truncate_after_step is None else truncate_after_step + 1
      logdir = tensorboard_dir(workdir)

      def start():
        before = set(threading.enumerate())
        writer = SummaryWriter(logdir, purge_step=purge, max_queue=self._QUEUE)
        # Told by the package that defines them: tensorboardX names none of its threads.
        self._tb_threads = [t for t in threading.enumerate() if t not in before
                            and type(t).__module__.split(".")[0] == "tensorboardX"]
        _watch(self._tb_threads)
        return writer

      self._calls = signals.Calls("cem_jax.metrics TensorBoard")
      self._hook = _Hook.hold()
      try:
        self._tb = self._tensorboard(logdir, start)
      except BaseException:
        self._calls.stop()
        self._release_hook()
        raise
    try:
      if kept is not None:
        atomic_write_bytes(self.path, kept.encode())
      self._file = open(self.path, "a")
    except BaseException:
      # TensorBoard's writer is open: closed (its thread and Calls' ended, the hook let go),
      # not left to the interpreter's exit. What its close raises too would hide this error.
      try:
        self.close()
      except Exception:  # noqa: BLE001, S110
        pass
      raise

  def write(self, step: int, metrics: dict) -> None:
    """Writes ``{"step": step, **metrics}`` as one line and flushes it.

    A non-finite float (the loss of a skipped step) is written as ``null``: strict JSON, which
    every parser reads (Python's ``NaN`` literal is not JSON). TensorBoard gets the value.

    Raises:
      OSError: the line or the events cannot be written (a full disk), naming the file or the
        TensorBoard folder; tensorboardX's writer thread has died: one line naming the folder
        and what killed it (not printed by Python when it died).
      KeyboardInterrupt: a Ctrl-C held while TensorBoard's writer ran (see ``hold``), raised
        once the line and the events are written.
    """
    if self._file is None:
      return
    line = {k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in {"step": int(step), **metrics}.items()}
    with naming(self.path):
      self._file.write(json.dumps(line, allow_nan=False) + "\n")
      self._file.flush()
    if self._tb is not None:
      tb = self._tb

      def add():
        for key, value in metrics.items():
          if isinstance(value, int | float) and not isinstance(value, bool):
            self._check_alive(tb.logdir, step)  # each: a dead one would take them for ever
            tb.add_scalar(key, value, int(step))
        tb.flush()

      self._tensorboard(tb.logdir, add)

  def sync(self) -> None:
    """Puts the lines written so far on the disk (``fsync``); nothing where disabled or closed.

    Called before a checkpoint is saved: a flushed line survives a kill of the process, not a
    crash of the machine (power, a VM's reset), which could keep Orbax's synced checkpoint of
    step s and lose the lines up to s still in the page cache; the resume then went on from s
    with those steps missing from the file, their cut-short last line taken for a kill's.

    Raises:
      OSError: naming the file.
    """
    if self._file is None:
      return
    with naming(self.path):
      os.fsync(self._file.fileno())

  def close(self) -> None:
    """Closes ``metrics.jsonl``, then TensorBoard's writer (its events written, its thread
    stopped), also when the first fails; a second call does nothing.

    Raises:
      OSError: as :meth:`write` (a dead writer thread only if no write raised it).
      KeyboardInterrupt: as :meth:`write`, once both are closed.
    """
    file, self._file = self._file, None
    tb, self._tb = self._tb, None
    try:
      if file is not None:
        with naming(self.path):
          file.close()
    finally:
      if tb is not None:
        def close():
          # Its thread dead, the events are lost; the close puts its stop in the queue (room
          # there: _QUEUE) and frees the file, and tensorboardX's atexit then does nothing.
          # Said once: a write that found it dead has raised it (the run's error).
          dead = [t for t in self._tb_threads if not t.is_alive()]
          tb.close()
          if dead and not self._said_dead:
            self._check_alive(tb.logdir, None, dead)

        try:
          self._tensorboard(tb.logdir, close)
        finally:
          self._calls.stop()
          self._release_hook()

  def _release_hook(self) -> None:
    hook, self._hook = self._hook, None
    if hook is not None:
      hook.release()

  def _check_alive(self, logdir: str, step: int | None, dead=None) -> None:
    """Raises the OSError of a tensorboardX writer thread that died, naming what killed it,
    instead of handing it more events."""
    dead = dead or [t for t in self._tb_threads if not t.is_alive()]
    if dead:
      self._said_dead = True
      at = "" if step is None else f", found writing step {step}"
      why = [errors.one_line(_died_of[t]) for t in dead if _died_of.get(t) is not None]
      raise OSError(f"TensorBoard events in {logdir}: tensorboardX's writer thread died "
                    f"({why[0] if why else 'no error reported'}{at}); its last events are "
                    "lost, metrics.jsonl has every line; fix the cause (a full disk?) and "
                    "resume")

  def _tensorboard(self, logdir: str, call):
    """Runs ``call``, a call into tensorboardX, in a thread of its own
    (:class:`cem_jax.signals.Calls`), with ``hold``'s signals held while the run waits for it
    (:func:`cem_jax.signals.held`), an OSError named (:func:`cem_jax.files.naming`), and a
    warning naming ``logdir`` when the wait is cut short by a signal (a second Ctrl-C: the way
    out of a writer that hangs), the call's events then perhaps missing. Returns what ``call``
    returns."""
    with naming(logdir), signals.held(self._hold):
      try:
        return self._calls.run(call)
      except BaseException as e:
        if not isinstance(e, Exception):
          logging.warning("TensorBoard events in %s may lack the last ones: its writer was "
                          "stopped part way (%s); metrics.jsonl has every line", logdir,
                          type(e).__name__)
        raise


# tensorboardX's writer threads (MetricsWriter's) -> what killed one (None while it runs):
# told by a _Hook, which keeps it from printing a traceback the run's one line then says.
_died_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _watch(threads) -> None:
  """Records what kills ``threads`` (:data:`_died_of`) instead of Python printing it, while a
  :class:`_Hook` is held."""
  for thread in threads:
    _died_of[thread] = None


class _Hook:
  """A ``threading.excepthook`` that keeps the exceptions of :data:`_died_of`'s threads and
  hands every other thread's to ``prev``, the hook it replaced.

  Held by each open MetricsWriter and put back (``prev`` again) when the last lets go, so runs
  one after another in a process (tables' seeds) leave the hook as they found it. Each keeps
  its own ``prev``: a hook someone installed over this one, handing on to it, is never
  handed to again by a later one (the one ``prev`` for all made ours and theirs call each
  other until RecursionError).
  """

  top = None  # the _Hook installed last, while threading.excepthook is it

  def __init__(self, prev):
    self.prev, self.holders = prev, 0

  def __call__(self, args) -> None:
    if args.thread is not None and args.thread in _died_of:
      _died_of[args.thread] = args.exc_value
    else:
      self.prev(args)

  @classmethod
  def hold(cls) -> _Hook:
    """The hook on top (installed now if another is: first, or put over ours since), held."""
    if cls.top is None or threading.excepthook is not cls.top:
      cls.top = cls(threading.excepthook)
      threading.excepthook = cls.top
    cls.top.holders += 1
    return cls.top

  def release(self) -> None:
    """Lets go; the last holder puts back the hook it replaced, unless another was put over
    it (that one hands on to this, which then hands everything on)."""
    self.holders -= 1
    if self.holders == 0 and threading.excepthook is self:
      threading.excepthook = self.prev
      type(self).top = None


def read_metrics(workdir: str) -> list[dict]:
  """All lines of ``WORKDIR/metrics.jsonl`` as dicts.

  A last line without its newline that is not JSON (a run still writing, or killed mid-write)
  is skipped.

  Raises:
    ValueError: an earlier line is not a JSON object (``NaN`` and ``Infinity`` are not JSON)
      with an integer ``step`` and ``train/*`` and ``eval/*`` values that are finite numbers
      or null, or its step is below the line before's, or repeats a key of the lines before
      at the same step (two runs' lines in one file); one line naming the file, the line
      number and its text or key.
  """
  lines, _ = _parse_metrics(metrics_path(workdir))
  return [m for _, m in lines]


def has_final_eval(workdir: str, num_steps: int) -> bool:
  """Whether ``WORKDIR/metrics.jsonl`` holds the eval line of step ``num_steps``: a run
  trained to its end (a preempted or killed one has none); False without the file.

  Raises:
    ValueError: as :func:`read_metrics`.
  """
  if not os.path.isfile(metrics_path(workdir)):
    return False
  return any(m["step"] == num_steps and "eval/loss" in m for m in read_metrics(workdir))


def _not_json(name: str):
  # Python's json reads NaN and Infinity, which no other parser does; the writer writes null
  # for them, so one in the file is damage, not a value to plot.
  raise ValueError(f"{name} is not JSON; a non-finite value is written as null")


def _parse_metrics(path: str) -> tuple[list[tuple[str, dict]], str | None]:
  """The one parser of ``metrics.jsonl``, for readers and the resuming writer alike.

  Returns ``([(text, line), ...], torn)``: each line's text (without its newline) and its dict,
  blank lines skipped, and ``torn`` the cut-short last line (no newline and not JSON) that was
  left out, or None. Only the last line can be torn: the writer writes a whole line with its
  newline at once, so anything earlier that does not parse is damage, not a kill.

  Raises:
    ValueError: as :func:`read_metrics`.
  """
  if os.path.isdir(path):  # else "[Errno 21] Is a directory", saying nothing of what to do
    raise ValueError(f"{path} is a folder; allowed: the run's metrics file (one JSON object a "
                     "line); move the folder away")
  with open(path, "rb") as f:
    raw = f.read().split(b"\n")
  out = []
  for i, data in enumerate(raw):
    last = i == len(raw) - 1  # no newline after it
    try:
      text = data.decode("utf-8")
    except UnicodeDecodeError as e:  # a kill inside a multi-byte character, or damage
      if last:
        return out, data.decode("utf-8", "replace")
      raise ValueError(f"{path}:{i + 1} is not UTF-8 ({e.reason} at byte {e.start}): "
                       f"{data[:80]!r}; repair or delete that line") from None
    if not text.strip():
      continue
    try:
      line = json.loads(text, parse_constant=_not_json)
    except ValueError as e:  # json.JSONDecodeError, or _not_json's
      if last:
        return out, text
      raise ValueError(f"{path}:{i + 1} is not valid JSON ({e}): {text[:80]!r}; every line "
                       "but a cut-short last one must be a JSON object with a \"step\"; "
                       "repair or delete that line") from None
    step = line.get("step") if isinstance(line, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
      raise ValueError(f"{path}:{i + 1} is not a JSON object with an integer \"step\": "
                       f"{text[:80]!r}; repair or delete that line")
    key = _not_a_figure(line)
    if key is not None:
      raise ValueError(f"{path}:{i + 1}: \"{key}\" is {json.dumps(line[key])[:40]}; allowed: "
                       "a finite number, or null (a value that was not finite); repair or "
                       "delete that line")
    if out and step < out[-1][1]["step"]:
      # The writer's steps only rise (a resume drops the lines after its checkpoint first):
      # a step going back is two runs' lines in one file, which a plot drew as a zigzag and
      # a table's curve averaged into the same steps.
      raise ValueError(f"{path}:{i + 1}: step {step} after step {out[-1][1]['step']}; allowed: "
                       "steps in the order the run wrote them (two runs' lines in one file?); "
                       "repair or delete the lines out of order")
    seen = set()
    for _, m in reversed(out):  # the lines of this step: the last ones, steps only rising
      if m["step"] != step:
        break
      seen |= m.keys()
    again = sorted(k for k in line if k != "step" and k in seen)
    if again:  # the writer logs a step's train line and its eval line once each
      raise ValueError(f"{path}:{i + 1}: step {step} again with {again[0]!r}; allowed: one "
                       "train and one eval line a step (two runs' lines in one file?); repair "
                       "or delete the repeated line")
    out.append((text, line))
  return out, None


def _not_a_figure(line: dict) -> str | None:
  """The first ``train/*`` or ``eval/*`` key of ``line`` whose value is not a finite number or
  null, or None. The writer writes only those there; a string, a bool or a list is a hand edit
  that plot drew as a category axis, and ``1e400`` (json reads inf) a loss no run logs."""
  for key, value in line.items():
    if not key.startswith(("train/", "eval/")) or value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int | float):
      return key
    if isinstance(value, float) and not math.isfinite(value):
      return key
  return None


_ENERGY_KEY = re.compile(r"eval/energy/layer(\d+)/step(\d+)/(att|mlp)_(before|after)")


def energy_steps(metrics_line: dict) -> dict[int, dict[str, list[tuple[float, float]]]]:
  """``{layer: {'att': [(before, after) of step 1, of step 2, ...], 'mlp': [...]}}`` from one
  eval line of ``metrics.jsonl`` (energies per real token); empty without an energy trace.

  Each pair is one sub-step's own energy before and after it (None where the line holds
  null, a value that was not finite, or lacks the key). Between two steps the other
  sub-step moves the state, so step 2's ``before`` need not equal step 1's ``after`` (with
  the Lie–Trotter split the MLP step may raise the attention energy again)."""
  found: dict[int, dict[str, dict[int, dict[str, float]]]] = {}
  for key, value in metrics_line.items():
    m = _ENERGY_KEY.fullmatch(key)
    if m:
      layer, step, part, when = int(m[1]), int(m[2]), m[3], m[4]
      found.setdefault(layer, {}).setdefault(part, {}).setdefault(step, {})[when] = value
  # .get: a half missing from a cut or hand-edited line is None, like a non-finite value.
  return {layer: {part: [(steps[s].get("before"), steps[s].get("after")) for s in sorted(steps)]
                  for part, steps in parts.items()}
          for layer, parts in sorted(found.items())}


def energy_trace(metrics_line: dict) -> dict[int, dict[str, list[float]]]:
  """``{layer: {'att': [before step 1, after step 1, after step 2, ...], 'mlp': [...]}}``
  from one eval line; empty when the line has no energy trace. A chain of "after" values:
  for whether each step lowers its own energy, use :func:`energy_steps`."""
  return {layer: {part: [pairs[0][0]] + [after for _, after in pairs]
                  for part, pairs in parts.items()}
          for layer, parts in energy_steps(metrics_line).items()}


def final_energy(metrics_line: dict) -> float | None:
  """The energy after the last step, summed over layers and over the CEM sub-layers the line
  has (each a mean per token); None when the line has no energy trace (a Llama model, or
  ``eval.energy_trace`` off) or when one of them is not finite (null). What ``evaluate``'s
  test-time-steps table reports."""
  trace = energy_trace(metrics_line)
  last = [chain[-1] for parts in trace.values() for chain in parts.values()]
  return None if not last or None in last else sum(last)
