"""Signals held back: SIGTERM from a program's first line until the program can stop on it
(:class:`Held`), and Ctrl-C or SIGTERM around a block that must not be cut in two (:func:`held`);
and waits of the main thread that a signal still reaches (:class:`Calls`).

``python -m cem_jax.main`` sets its own SIGTERM handler (train's
:class:`cem_jax.workdir.Preemption`) seconds after it starts: after its imports, the flags and
the config file, the config checks, jax's import, the meeting of the processes
(``jax.distributed.initialize``, with several) and the start of jax's backend. Until then a
SIGTERM was its default action: the process gone at once without a word (status 143). Held
from main's first line, it is recorded and main stops where it can, with its one start-up line.

Only the standard library: :class:`Held` is made before absl and ml_collections load (0.2 s).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import signal
import sys
import threading

# The longest a signal's handler waits for the main thread to see it while that thread waits for
# a call (Calls.run).
SIGNAL_CHECK_SECS = 0.1


class Calls:
  """Runs calls, one at a time and in order, in a daemon thread of its own, for a caller in the
  main thread that must stay reachable by signals while it waits: a call into tensorboardX
  (:class:`cem_jax.metrics.MetricsWriter`), Orbax's wait for a save to commit
  (:meth:`cem_jax.checkpoint.Checkpointer.wait`), the meeting of the processes
  (:func:`cem_jax.distributed.initialize`).

  The caller waits on a plain lock the call's thread releases, in slices of
  :data:`SIGNAL_CHECK_SECS` seconds. Python runs a signal's handler when the main thread next
  runs Python; a blocking wait (a lock's acquire, ``Thread.join``, ``queue.Queue.get``, a wait in
  C++) wakes for a signal only where the kernel delivered it to the waiting thread, while a
  process's signal (Ctrl-C, ``kill``) may go to any of its threads: the second Ctrl-C, the way
  out of a wait that hangs, waited for the wait to end. A handler's exception raised in the
  wait leaves nothing taken (inside tensorboardX's queue put it left a lock taken, and the run
  hung), and the call goes on in its thread, before the next one starts. One thread for all
  calls: Orbax raises a failed save once per thread that waits for it.

  Args:
    name: the thread's name (in a stack dump).
  """

  def __init__(self, name: str):
    self._name = name
    self._jobs = None  # the queue of the thread serving it: started by the first call
    self._thread: threading.Thread | None = None
    self._busy = False  # the last call handed over is not seen ended (its wait interrupted)

  @staticmethod
  def _serve(jobs) -> None:
    while (job := jobs.get()) is not None:
      job()

  def run(self, call, *args):
    """Returns ``call(*args)`` run in the thread.

    Raises:
      what ``call`` raised, with its traceback; what a signal's handler raises while the
      caller waits (KeyboardInterrupt): the call then goes on, what it returns is dropped.
    """
    if self._jobs is None:  # in this order: interrupted, the next call starts one again
      jobs = queue.SimpleQueue()  # C: a put is whole or not made
      thread = threading.Thread(target=self._serve, args=(jobs,), name=self._name, daemon=True)
      thread.start()
      self._jobs, self._thread = jobs, thread
    done, out = threading.Lock(), []
    done.acquire()

    def job():
      try:
        out.append((True, call(*args)))
      except BaseException as e:  # noqa: BLE001 (handed to the waiting caller)
        out.append((False, e))
      finally:
        done.release()

    self._busy = True
    self._jobs.put(job)
    while not done.acquire(timeout=SIGNAL_CHECK_SECS):
      pass
    self._busy = False  # the queue is served in order: every call handed over has ended
    ok, value = out[0]
    if not ok:
      raise value
    return value

  def stop(self) -> None:
    """Ends the thread after the calls already handed to it; a later call starts another.

    Waits (in slices, as :meth:`run`) for the thread to end unless a call whose wait was
    interrupted may still run in it. A daemon thread that wakes while the interpreter exits is
    ended inside C++ frames, and the process aborted ("FATAL: exception not rethrown", status
    134): a run resumed at its last step did, in about 1 of 2 ends, when it let go of the
    thread of its checkpoint's read just before it exited.
    """
    jobs, thread, self._jobs, self._thread = self._jobs, self._thread, None, None
    if jobs is None:
      return
    jobs.put(None)
    if not self._busy:  # else the call goes on, as run() says
      while thread.is_alive():
        thread.join(timeout=SIGNAL_CHECK_SECS)


class Held:
  """SIGTERM recorded (:attr:`sent`) from here until :meth:`release`, for code with nothing to
  save that a SIGTERM would otherwise end at once, silently.

  Recorded, not raised where it lands: raised inside the initialisation of an extension module
  (``jaxlib._jax`` calls back into Python) it crashed the process (a segmentation fault, or an
  ImportError traceback, in 3 of 30 SIGTERMs sent 0.55-1.1 s into ``main``). The program stops
  at points of its choosing (:meth:`stop_if_sent`), or at once where it waits in Python
  (:meth:`raising`). ``take`` False, a SIGTERM ignored or handled by someone else when made,
  or outside the main thread (where no handler can be set): nothing is held, nothing changes.
  """

  def __init__(self, take: bool = True):
    self.sent = False
    self._stop = None  # raised at once by the handler (raising)
    self._released = False
    self._taken = (take and threading.current_thread() is threading.main_thread()
                   and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    if self._taken:
      signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del frame
    if self._released:  # left in place by release(restore=False)
      end_by(signum)
    self.sent = True  # first: should what is raised next be dropped, the SIGTERM is not
    if self._stop is not None:
      raise self._stop

  def stop_if_sent(self, stop: BaseException) -> None:
    """Raises ``stop`` (``cem_jax.cli.Terminated``) if a SIGTERM was held."""
    if self.sent:
      raise stop

  @contextlib.contextmanager
  def raising(self, stop: BaseException):
    """A SIGTERM held before or in the block raises ``stop`` at once, for a block whose main
    thread waits in Python (:func:`cem_jax.distributed.initialize`)."""
    self.stop_if_sent(stop)
    self._stop = stop
    try:
      yield
    finally:
      self._stop = None

  def release(self, stop: BaseException, restore: bool = True) -> None:
    """Holds no more: SIGTERM's default action again (``restore``), then
    :meth:`stop_if_sent`. ``restore`` False, for when someone may have set their own handler
    below Python's since (JAX's preemption notifier, set by ``jax.distributed.initialize``
    with ``signal()``: Python still reports this one): the handler stays, and does the default
    action if it is still called."""
    if self._taken and not self._released:
      self._released = True
      if restore:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    self.stop_if_sent(stop)


def end_by(signum: int) -> None:
  """Ends the process by ``signum`` (SIGINT, SIGTERM) now, its default action: what a shell
  (128 + signum) and ``subprocess`` (-signum) read as a death by it."""
  signal.signal(signum, signal.SIG_DFL)
  os.kill(os.getpid(), signum)


def die_by(signum: int) -> None:
  """Runs the ``atexit`` functions (TensorBoard's flush, jax's clean-up), then ends the process
  by ``signum`` (SIGINT, SIGTERM) at once (:func:`end_by`), without the interpreter's teardown:
  a Ctrl-C landing while XLA compiles left it state whose teardown crashed ("Fatal Python
  error: Segmentation fault", status 139, in 4 tries of 4 on a CPU). Returns, for the caller to
  re-raise and Python to end as usual, where this Python lacks CPython's
  ``atexit._run_exitfuncs`` or signals (not POSIX)."""
  run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
  if run_exitfuncs is None or os.name != "posix":
    return
  run_exitfuncs()
  sys.stdout.flush()
  sys.stderr.flush()
  end_by(signum)


def die_interrupted(what_now: str) -> None:
  """Ctrl-C's one line, ``interrupted (Ctrl-C): WHAT_NOW`` on stderr, then death by SIGINT
  (:func:`die_by`: status 130 in a shell, -2 to ``subprocess``). Returns where :func:`die_by`
  does, for the caller to re-raise the KeyboardInterrupt. What :func:`cem_jax.cli.interrupted`
  does with one, and ``main`` with one while absl loads, before ``cli`` can be imported."""
  print(f"interrupted (Ctrl-C): {what_now}", file=sys.stderr)
  die_by(signal.SIGINT)


@contextlib.contextmanager
def held(signums: tuple[int, ...] = (signal.SIGINT,)):
  """Holds ``signums`` (SIGINT, SIGTERM) until the block ends, then sends each one that came to
  the handler it had (Python's Ctrl-C handler: a KeyboardInterrupt), for a block that a signal's
  exception must not cut in two.

  The blocks: starting an asynchronous checkpoint save (interrupted there, Orbax was left half
  way through starting its writer threads, one of which then failed with a traceback) and
  waiting for one to commit (Orbax reported the save as failed and forgot its step); the wait
  for every call into tensorboardX, which runs in a thread of its own
  (:class:`Calls`: inside it, a Ctrl-C could leave a lock of its queue taken
  and the run hung), so that its events are written before the program stops.

  A second one of a signal held goes to its handler at once: the way out of a block that hangs
  (a save waiting for a process that died, a disk that stopped answering). A block that raises
  drops what was held: its own exception already stops the program. Nothing is held outside
  the main thread (no handler can be set there, and handlers run only in the main thread), nor
  a signal whose handler was set outside Python (``signal.getsignal`` None: it could not be
  put back, e.g. JAX's preemption notifier).
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  got, previous = [], {}

  def hold(signum, frame):
    del frame
    if signum in got:
      got.remove(signum)  # sent now, not again after the block
      signal.signal(signum, previous[signum])
      signal.raise_signal(signum)
    else:
      got.append(signum)

  try:
    for signum in signums:
      handler = signal.getsignal(signum)
      if handler is not None:
        previous[signum] = handler  # first: hold may need it as soon as it is set
        signal.signal(signum, hold)
    yield
  except BaseException:
    got.clear()
    raise
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
    for signum in got:
      signal.raise_signal(signum)
