"""A thin wrapper over Orbax's ``CheckpointManager``: save, verify, find and restore train states.

Layout of ``DIR/checkpoints`` (``DIR`` = ``--workdir``)::

    <step>/            one Orbax step, two items:
      state/           params and optimizer state (``StandardSave``: OCDBT/zarr arrays)
      meta/            JSON: step, data position, RNG seed, resolved config, data identity
    digests/<step>.json  sha256 and size of every file of step <step> (see below)
    rejected/<step>.<time_ns>/  damaged steps moved aside on resume (kept for inspection)
    deleting/<step>/    an old step Orbax let go (``keep``), removed by the next wait or start

What Orbax does and this module does not repeat: asynchronous writes, atomic commit (a step is
written to a temporary folder and renamed when complete; leftovers of a killed save are removed
when the manager starts), keeping the newest ``keep`` steps, and restoring onto whatever
shardings the abstract target names (so a checkpoint reads onto another mesh or device count).

What it adds: **integrity**, run by :mod:`cem_jax.integrity` (the only module that knows
Orbax's file names): every step gets a sha256 digest before Orbax commits it, and on resume the
newest step whose files match their digest is restored; damaged newer steps are reported and
moved to ``rejected/``. This module only wires that in (the digest hook, the list of steps) and
checks that a step fits the model before restoring it. A reader (``read_only``: evaluate,
sample) restores the parameters alone (:meth:`Checkpointer.restore` with ``partial``): the
optimizer state beside them in ``state/`` is neither read nor allocated (the digest check still
reads every file of the step once).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import sys
import threading
import warnings

import jax
import orbax.checkpoint as ocp

from cem_jax import errors, integrity, signals
from cem_jax.integrity import (
    COMMIT_MARKER,
    DELETING_DIR,
    DIGEST_DIR,
    REJECTED_DIR,
    CheckpointError,
)

__all__ = ["COMMIT_MARKER", "DELETING_DIR", "DIGEST_DIR", "REJECTED_DIR", "CheckpointError",
           "Checkpointer", "HeldReads", "flat_arrays"]


def flat_arrays(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  """``{"a/b/0/c": (shape, dtype)}`` of a pytree's arrays (or ``jax.ShapeDtypeStruct`` s) in
  Orbax's own key format, as :meth:`Checkpointer.saved_arrays` names a step's."""
  flat = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(tree, keep_empty_nodes=True), sep="/")
  return {k: (tuple(v.shape), str(v.dtype)) for k, v in flat.items() if hasattr(v, "shape")}


def _mib(size: int) -> str:
  return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size} bytes"


def _free_text(directory: str) -> str:
  """``'; 1.2 MiB free on its disk'``, or nothing where the folder is gone."""
  try:
    return f"; {_mib(shutil.disk_usage(directory).free)} free on its disk"
  except OSError:
    return ""


# Orbax's package folder: what its modules log is told apart by the file it comes from.
_ORBAX_DIR = os.path.join(os.path.dirname(os.path.dirname(ocp.__file__)), "")


class _HeldReports(logging.Filter):
  """What Orbax, and the asyncio loops its writes run on, report while a save is pending:
  ERROR records (one from each writer thread that fails, a "never retrieved" for each failed
  write) and the exceptions Python drops in their threads' callbacks ("Event loop is closed"),
  with their tracebacks. A failed save is one line, :meth:`Checkpointer.wait`'s
  CheckpointError with its cause chained: these told the same failure again, 25 lines (8 KB of
  tracebacks and temporary files' paths) before and after it when the disk filled during
  step 2's save of ``experiments/tiny.py``. Told apart by where they come from (Orbax's files,
  the ``asyncio`` logger, a thread other than the main one), never by their wording.

  Orbax's record of a Ctrl-C in a wait for the save (a KeyboardInterrupt, told by its type) is
  dropped at once: it said the save failed, and the save committed.

  Held from the save's start. Handed on as they came if the save is committed. If it fails,
  dropped, and so is what comes later (:func:`_drop_after_failure`): the writes under way when
  the failure is found go on in Orbax's threads and fail in their turn, some reported only as
  the interpreter exits (7 "never retrieved" tracebacks after the run's line in 1 run of 3).
  """

  _LOGGERS = ("absl", "asyncio")  # Orbax logs through absl's logger

  def __init__(self, level: int = logging.ERROR, main_thread: bool = False):
    """``level``: the least a record held is (a read's warnings too, :class:`HeldReads`);
    ``main_thread``: an exception of type Exception dropped in the main thread is held too
    (a read's coroutines, collected there), a signal's (KeyboardInterrupt) never is."""
    super().__init__()
    self._level = level
    self._main_thread = main_thread
    self._records = []
    self._unraisable = []
    self._hook = None

  def start(self) -> None:
    for name in self._LOGGERS:
      logging.getLogger(name).addFilter(self)
    self._hook, sys.unraisablehook = sys.unraisablehook, self._hold

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < self._level or not (
        record.name == "asyncio" or record.pathname.startswith(_ORBAX_DIR)):
      return True
    stopped = record.exc_info[1] if record.exc_info else None
    if stopped is not None and not isinstance(stopped, Exception):
      # A Ctrl-C (or a cli.Terminated) raised in the main thread's wait: Orbax logs it as
      # "Save Finalize thread (save_finalize) failed. [KeyboardInterrupt]", though the save
      # goes on and commits; the program says the interrupt in its own line.
      return False
    self._records.append(record)
    return False

  def _hold(self, unraisable) -> None:
    if threading.current_thread() is threading.main_thread() and not (
        self._main_thread and isinstance(unraisable.exc_value, Exception)):
      self._hook(unraisable)  # e.g. a Ctrl-C dropped in a gc callback: cli.interrupted sends it
      return
    # Not the object: kept after the hook returns, one being finalized would live again. Of
    # the type Python gave (not a namespace): CPython's own hook takes no other, and raised
    # TypeError where end() handed it on, in place of the exception the block raised.
    self._unraisable.append(type(unraisable)((
        unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback,
        unraisable.err_msg, None)))

  def forget(self) -> None:
    """Drops what was held so far and goes on holding. Without a ``gc.collect()`` (0.2 s in
    a test process, as long as a tiny step's read): what a failed read left to collect is
    held when it is collected."""
    self._records, self._unraisable = [], []

  def end(self, hand_on: bool) -> None:
    """Holds no more; ``hand_on``: what was held goes where it would have gone, else it is
    dropped, and first what gc can free is (a failed write's future or a cut read's
    coroutines report themselves then: :func:`_collect`)."""
    if not hand_on:
      _collect()
    for name in self._LOGGERS:
      logging.getLogger(name).removeFilter(self)
    if sys.unraisablehook == self._hold:
      sys.unraisablehook = self._hook
    records, unraisable = self._records, self._unraisable
    self._records, self._unraisable = [], []
    if hand_on:
      for record in records:
        logging.getLogger(record.name).handle(record)
      for args in unraisable:
        sys.unraisablehook(args)


def _collect() -> None:
  """``gc.collect()``. Python's RuntimeWarning that a coroutine was never awaited, for each of
  Orbax's that it frees (a cut read's: printed on stderr by the next Checkpointer, the one
  report :class:`_HeldReports` does not hold, being a warning), is dropped, told by the
  coroutine's file; any other warning it raises is shown (recorded under the filters in
  force, shown once recorded)."""
  with warnings.catch_warnings(record=True) as caught:
    gc.collect()
  for w in caught:
    code = getattr(w.source, "cr_code", None)
    if code is None or not code.co_filename.startswith(_ORBAX_DIR):
      warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


# The reports of the last failed save, dropped until the process ends or a Checkpointer is made
# (a new run: late reports of the old one, if any, are shown again).
_dropping: _HeldReports | None = None


def _drop_after_failure(held: _HeldReports | None) -> None:
  """Keeps dropping ``held``, a failed save's reports (:class:`_HeldReports`)."""
  global _dropping
  _stop_dropping()
  _dropping = held


def _stop_dropping() -> None:
  global _dropping
  if _dropping is not None:
    _dropping.end(hand_on=False)
    _dropping = None


class HeldReads:
  """What Orbax, and the asyncio loops and TensorStore threads its reads run on, report while
  the block reads steps (:meth:`Checkpointer.restore`, :meth:`Checkpointer.read_meta`), held
  for a reader that reads again when a read fails for a reason it expected:
  :func:`cem_jax.runs.load_run`, whose chosen step a run still training pruned while it was read.
  Such a read reported it in up to a hundred lines ("Event loop is closed" and "Encountered
  error while reading array index" tracebacks, asyncio's "never retrieved", Orbax's warning
  that an item "could not be restored") before a retry read the next step without a fault.

  Held: Orbax's records of WARNING and above, asyncio's, and the exceptions Python drops in
  any thread (a signal's, KeyboardInterrupt, excepted: it goes through at once); told apart as
  :class:`_HeldReports` tells them, never by their wording. :meth:`drop` drops what the failed
  read reported. At the end of the block, what is held is handed on as it came if the block
  raised (the read that failed last, or one that failed otherwise: the reports explain it) or
  nothing was dropped; if the block ends after a :meth:`drop`, what the dropped reads left is
  collected first (:func:`_collect`: their coroutines, futures and tasks report as they are
  freed), then all of it is dropped, and what comes later is shown. Measured beside a run
  with ``checkpoint.keep=1``: every late report of 45 loads that dropped reads came as their
  garbage was collected (60 "Encountered error while reading array index", an asyncio "never
  retrieved", and the "never awaited" warnings), none in the second after the block. Before,
  the drop lasted until the next :class:`Checkpointer`, for ``evaluate`` and ``sample`` the
  rest of the process: an exception Python dropped in any thread, the program's own, was
  lost with them.

  Use: ``with HeldReads() as held: ... held.drop() ...``; in the main thread.
  """

  def __init__(self):
    self._held = _HeldReports(logging.WARNING, main_thread=True)
    self._dropped = False

  def __enter__(self) -> HeldReads:
    self._held.start()
    return self

  def drop(self) -> None:
    """Drops what was reported so far (a failed read that will be made again)."""
    self._held.forget()
    self._dropped = True

  def __exit__(self, exc_type, exc, tb) -> None:
    self._held.end(hand_on=exc_type is not None or not self._dropped)


class Checkpointer:
  """Saves and restores a train state (a pytree of arrays) plus JSON metadata, verified.

  Args:
    directory: the checkpoint folder (``DIR/checkpoints``; created if missing).
    keep: how many of the newest steps Orbax keeps (``checkpoint.keep``, >= 1).
    every_steps: save interval (``checkpoint.every_steps``): :meth:`should_save` is true on
      multiples of it (and at a multi-host preemption sync point).
    async_save: False waits for each save to finish before :meth:`save` returns.
    read_only: for tools that only restore (e.g. evaluating a run that may still be training):
      nothing is created, cleaned up or moved aside; damaged steps are only skipped; a part of
      a state can be restored alone (:meth:`restore` with ``partial``).

  Attributes:
    created: True if ``directory`` did not exist and this Checkpointer created it.

  Raises:
    ValueError: ``directory`` is there and is not a folder (a file, a broken link).
  """

  def __init__(self, directory: str, keep: int = 3, every_steps: int = 1,
               async_save: bool = True, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
      # Orbax's own error was "[Errno 20] Not a directory: '.../checkpoints/deleting'".
      raise ValueError(f"{self.directory} is not a folder; allowed: the run's checkpoints "
                       "folder (one subfolder a saved step); move it away")
    # True if this Checkpointer makes the folder: a failed start may then remove it again.
    self.created = not read_only and not os.path.isdir(self.directory)
    self.async_save = async_save
    self.read_only = read_only
    self._saving_step: int | None = None
    _stop_dropping()
    self._held: _HeldReports | None = None  # what Orbax reports while a save is pending
    # A save's failure, as wait() raised it (the message only: the exception would keep what
    # its cause's traceback holds alive, a failed write's future among them).
    self._failed: str | None = None
    self._waits = signals.Calls("cem_jax.checkpoint wait")  # the waits for Orbax's threads
    # The reads (restore, read_meta), in a thread of their own: a read that hangs (a disk that
    # stopped answering) must not hold back close()'s wait, queued behind it, after the signal
    # that stopped the wait for it.
    self._reads = signals.Calls("cem_jax.checkpoint read")
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        # A reader keeps and saves nothing (Orbax warns when read_only meets other values).
        max_to_keep=None if read_only else keep,
        save_interval_steps=0 if read_only else 1,
        # Not Orbax's default policy: that one also saves the first step of every fresh run.
        save_decision_policy=policies.AnySavePolicy([
            policies.FixedIntervalPolicy(every_steps),
            policies.PreemptionCheckpointingPolicy(),
        ]),
        # Always the async checkpointer: the digest hook exists only there. A synchronous save
        # is an async one followed by a wait.
        enable_async_checkpointing=True,
        async_options=ocp.AsyncOptions(post_finalization_callback=self._write_digest),
        create=not read_only,
        # A killed save's temporary folder is removed when a training run starts; a reader
        # must not remove the folder of a save in progress. A new folder holds none, and
        # Orbax's clean-up thread (which ``close`` does not wait for) would race a failed
        # start's removal of it.
        cleanup_tmp_directories=not read_only and not self.created,
        # An old step is let go by one rename, never left half deleted (the module docstring).
        todelete_subdir=None if read_only else DELETING_DIR,
        read_only=read_only,
    )
    # Handlers named up front so that a fresh process can read a step's tree metadata. A
    # reader reads the state's files (StandardSave's) with the PyTree handler StandardSave
    # writes through: its PyTreeRestore can leave items out (partial_restore), the Standard
    # handler's cannot.
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": (ocp.PyTreeCheckpointHandler() if read_only
                                 else ocp.StandardCheckpointHandler()),
                       "meta": ocp.JsonCheckpointHandler()},
    )
    self._remove_let_go()  # those a process that ended before removing them left

  # -- paths and steps --------------------------------------------------------------------------

  def step_dir(self, step: int) -> str:
    """The folder of checkpoint ``step`` (:func:`cem_jax.integrity.step_dir`)."""
    return integrity.step_dir(self.directory, step)

  def all_steps(self) -> list[int]:
    """Steps Orbax considers finished (committed), oldest first; not verified."""
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest step Orbax considers finished, or None; not verified (see ``restorable_step``)."""
    return self.manager.latest_step()

  # -- saving -----------------------------------------------------------------------------------

  def should_save(self, step: int) -> bool:
    """True if ``step`` is a save step by ``every_steps`` (or a multi-host preemption point)."""
    return self.manager.should_save(step)

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    """Starts saving ``state`` (a pytree of arrays) and ``meta`` (JSON-able) at ``step``.

    Returns False without saving when ``step`` is already saved or (``force`` False) is not a
    save step. The caller may keep training while the arrays are written; call :meth:`wait`
    before exiting.

    Raises:
      CheckpointError: no room for the step on the folder's disk (single-process runs, from
        the second save: checked before Orbax writes anything, :meth:`_check_room`), or the
        previous asynchronous save failed (re-raised by :meth:`wait` before this one starts;
        one failed with a bug, raised by :meth:`wait` as its own exception, is refused so);
        one line naming the folder and what to do.
    """
    if self._failed is not None:
      raise CheckpointError(self._failed)
    if step in self.manager.all_steps():
      return False
    if not force and not self.should_save(step):
      return False
    # Orbax would wait for the previous save anyway, in manager.save, in this thread: a join no
    # Ctrl-C the kernel gives another thread wakes. Waiting here first (signals.Calls) leaves it
    # nothing to wait for, lets the digest hook know which step it is finalizing, and prunes
    # digests of steps Orbax has since deleted.
    self.wait()
    self._check_room(step)
    self._saving_step = step
    self._held = _HeldReports()
    self._held.start()
    saved = self.manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                meta=ocp.args.JsonSave(meta)),
        force=True,
    )
    if not self.async_save:
      self.wait()
    return saved

  def _check_room(self, step: int) -> None:
    """Refuses a save its disk has no room for, before Orbax starts: one that fails part way has
    trained on to the next save for nothing (what Orbax's threads report of it is held back,
    :class:`_HeldReports`, and the failure said by :meth:`wait`). The room is the newest saved
    step's size on disk, what the same state took last time: Orbax compresses each array (zstd),
    so the arrays' own bytes overstate it (float32 weights take ~95% of theirs, bfloat16 ~84%,
    an optimizer's zero moments ~3%) and refused saves that fit. The first save has no step to
    measure and is not checked; one that does not fit fails in Orbax, reported by :meth:`wait`,
    as does a later one grown past its predecessor. Single-process runs only: processes that
    read the free space at different moments could disagree, and one that starts a save waits
    for the others for ever."""
    if jax.process_count() != 1:
      return
    steps = self.manager.all_steps()
    if not steps:
      return
    newest = max(steps)
    try:
      took = sum(os.path.getsize(os.path.join(root, name))
                 for root, _, names in os.walk(self.step_dir(newest)) for name in names)
      free = shutil.disk_usage(self.directory).free
    except OSError:  # a folder removed under the run: Orbax's save says so, wrapped by wait()
      return
    if free < took:
      raise CheckpointError(
          f"no room for checkpoint step {step} in {self.directory}: it takes about "
          f"{_mib(took)} (step {newest} took that on disk), its disk has {_mib(free)} free; "
          f"{self._what_now()}")

  def _what_now(self) -> str:
    """What to do after a save failed: the steps before it are untouched (Orbax writes a
    step into a folder of its own and deletes old steps only after a save commits)."""
    steps = self.manager.all_steps()
    resume = (f"resumes from step {max(steps)}, the newest saved" if steps else
              "starts again (no step was saved)")
    return f"make room there (or fix the folder), then the same command {resume}"

  def _write_digest(self) -> None:
    """Orbax's post-finalization hook: digests the step about to be committed."""
    if self._saving_step is not None:
      integrity.write_digest(self.directory, self._saving_step)

  # -- verifying --------------------------------------------------------------------------------

  def verify(self, step: int) -> list[str]:
    """Checks step ``step`` against its digest; returns its problems (empty list = intact).

    Each problem is one short phrase naming the file, e.g. ``"state/manifest.ocdbt: 0 bytes,
    digest says 115 (truncated)"``.
    """
    return integrity.verify(self.directory, step)

  def restorable_step(self) -> int | None:
    """The newest intact step, or None when there is no step at all.

    Newer damaged steps are reported with ``logging.warning`` (step and file) and moved to
    ``rejected/`` (process 0; not when ``read_only``), so that training can save those step
    numbers again.

    Raises:
      CheckpointError: steps exist but none is intact (one line listing each step's first
        problem and the fix).
    """
    self.manager.reload()  # the folder may have changed since the manager started
    steps = self.manager.all_steps()
    step = integrity.newest_intact(self.directory, steps, self.read_only)
    if step is not None and not self.read_only and step != max(steps, default=step):
      self.manager.reload()  # damaged newer steps were moved aside
    return step

  # -- restoring --------------------------------------------------------------------------------

  def saved_arrays(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"params/...": (shape, dtype), "opt_state/...": ...}`` of step ``step``'s arrays, from
    its metadata (no array is read), keyed as :func:`flat_arrays` keys a tree."""
    return flat_arrays(self.manager.item_metadata(step)["state"].tree)

  def check_compatible(self, step: int, target, partial: bool = False) -> None:
    """Compares step ``step``'s saved tree (keys, shapes, dtypes) with ``target``'s; with
    ``partial``, only the saved items ``target`` (a dict) has (e.g. ``params``).

    Raises:
      CheckpointError: one line naming the keys missing on either side and those whose shape or
        dtype differ (e.g. a changed ``model.d_model`` or optax chain).
    """
    saved, want = self.saved_arrays(step), flat_arrays(target)
    if partial:
      saved = {k: v for k, v in saved.items() if k.split("/")[0] in target}
    # Parameters first: a changed model shows there, its optimizer moments only repeat it.
    order = lambda k: (not k.startswith("params/"), k)
    missing = sorted(set(want) - set(saved), key=order)
    extra = sorted(set(saved) - set(want), key=order)
    differ = sorted((k for k in set(want) & set(saved) if want[k] != saved[k]), key=order)
    if not (missing or extra or differ):
      return
    parts = []
    if differ:
      parts.append("shape/dtype differ: " + errors.first_three(
          [f"{k} saved {saved[k][0]} {saved[k][1]} vs now {want[k][0]} {want[k][1]}"
           for k in differ]))
    if missing:
      parts.append("not in checkpoint: " + errors.first_three(
          [f"{k} {want[k][0]}" for k in missing]))
    if extra:
      parts.append("only in checkpoint: " + errors.first_three(
          [f"{k} {saved[k][0]}" for k in extra]))
    raise CheckpointError(
        f"checkpoint step {step} in {self.directory} does not fit the model/optimizer of this "
        f"config: {'; '.join(parts)}; resume with the config it was saved with (its meta/ item "
        "or config.json) or use a new --workdir"
    )

  def restore(self, step: int, target, partial: bool = False) -> tuple[object, dict]:
    """Restores ``(state, meta)`` of step ``step`` onto ``target``.

    Args:
      step: a step (normally ``restorable_step()``).
      target: a pytree like the saved state, of ``jax.Array`` or ``jax.ShapeDtypeStruct``
        (with ``sharding``) leaves, built on the *current* devices: the restored arrays get its
        structure (e.g. optax's state types, not plain dicts), shapes, dtypes and shardings.
      partial: ``target`` is a dict of some of the saved items (``{'params': ...}``): only
        those are checked and read, the others (the optimizer state) are left on disk, neither
        read nor allocated. Only a ``read_only`` Checkpointer restores a part.

    Returns:
      ``(state, meta)``: the state with ``target``'s structure and the saved JSON metadata.

    The read runs in a thread of its own (:class:`cem_jax.signals.Calls`): Orbax's restore
    waits in C++ (TensorStore), where a Ctrl-C or SIGTERM the kernel gave another thread, or
    even this one, ran its handler only once the read returned, minutes for a large step on a
    slow disk, never for one that hangs; this thread waits in slices a signal's handler runs
    between, and a handler's exception stops the wait at once, the read going on in its
    thread, its result dropped.

    Raises:
      CheckpointError: the saved tree does not fit ``target`` (see ``check_compatible``).
      ValueError: ``partial`` on a Checkpointer that is not ``read_only`` (a bug).
      what a signal's handler raises while it waits (KeyboardInterrupt,
        :class:`cem_jax.cli.Terminated`).
    """
    if partial and not self.read_only:
      raise ValueError("a partial restore needs a read_only Checkpointer (its PyTree handler)")
    self.check_compatible(step, target, partial)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    if self.read_only:
      state = ocp.args.PyTreeRestore(
          item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
          partial_restore=partial)
    else:
      state = ocp.args.StandardRestore(abstract)
    out = self._read(step, ocp.args.Composite(state=state, meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def read_meta(self, step: int) -> dict:
    """The JSON metadata of step ``step`` alone (step, seed, resolved config, data identity),
    without its arrays: what a reader needs to rebuild the model it was saved from. Read as
    :meth:`restore` reads, a signal's exception stopping the wait."""
    return self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def _read(self, step: int, args):
    """Orbax's restore of ``step`` with ``args``, waited for in slices (:meth:`restore`)."""
    return self._reads.run(lambda: self.manager.restore(step, args=args))

  def wait(self) -> None:
    """Blocks until pending saves are committed; prunes old digests. After a failed save,
    which it raised, nothing: Orbax raises that failure again at each of its waits.

    What Orbax reported while the save was pending (:class:`_HeldReports`) is handed on now if
    it was committed; if it failed, that and what comes later is dropped.

    A signal's exception while it waits (a Ctrl-C, also one the kernel gave another thread)
    stops the wait at once, the save going on in Orbax's threads.

    Raises:
      CheckpointError: a pending save failed (a full disk, a folder removed under it): one line
        naming the step, the folder, the cause's first line and what to do; the cause chained.
      Exception: a pending save failed for another reason (a bug): its own exception. Like a
        CheckpointError, raised once: :meth:`save` then refuses (one line naming it).
      KeyboardInterrupt: a Ctrl-C's, raised while it waits.
    """
    if self._failed is not None:
      return
    held, self._held = self._held, None
    step = "" if self._saving_step is None else f" step {self._saving_step}"
    try:
      # In a thread of its own (signals.Calls): Orbax joins its finalize thread, a wait no
      # Ctrl-C sent to another thread wakes, and a Ctrl-C that interrupts the join makes Python
      # 3.11 take that thread for finished (a later wait returned at once).
      self._waits.run(self.manager.wait_until_finished)
      self.manager.check_for_errors()
    # What a disk or a folder raises (tensorstore's errors are ValueErrors), as main's
    # bad-input errors are; anything else is a bug and keeps its traceback.
    except (OSError, ValueError) as e:
      self._failed = (
          f"checkpoint{step} could not be saved in {self.directory} ({errors.one_line(e)}"
          f"{_free_text(self.directory)}); {self._what_now()}")
      _drop_after_failure(held)
      raise CheckpointError(self._failed) from e
    except Exception as e:
      # A bug: its own exception, with its traceback, and what Orbax reported of it. Recorded
      # all the same: Orbax raises it again once in each thread that waits, the main thread's
      # wait inside the next manager.save among them (that save then not made).
      self._failed = (f"checkpoint{step} could not be saved in {self.directory}: its save "
                      f"failed with {errors.one_line(e)} (raised before, with its traceback); "
                      "no save starts after a failed one")
      if held is not None:
        held.end(hand_on=True)
      raise
    except BaseException:  # a signal's: the save goes on in Orbax's threads
      if held is not None:
        held.end(hand_on=True)
      raise
    if held is not None:
      held.end(hand_on=True)
    integrity.prune_digests(self.directory, self.manager.all_steps())
    self._remove_let_go()

  def _remove_let_go(self) -> None:
    """Removes ``deleting/``, the old steps Orbax let go (renamed there by the process that
    deletes: process 0), when no save is pending: there, a removal cut short leaves files that
    no listing of steps reads. A reader removes nothing.

    Raises:
      OSError: a file there cannot be removed (naming it).
    """
    if self.read_only or jax.process_index() != 0:
      return
    try:
      shutil.rmtree(os.path.join(self.directory, DELETING_DIR))
    except FileNotFoundError:  # nothing let go since
      pass

  def close(self) -> None:
    """Waits for a pending asynchronous save (:meth:`wait`: a failed one raised once), then
    closes the Orbax manager. The threads of its waits and reads end either way, also when the
    wait raises: one left idle was woken while the interpreter exited, and aborted the process
    (:meth:`cem_jax.signals.Calls.stop`)."""
    try:
      self.wait()
      try:
        self._waits.run(self.manager.close)  # it waits for Orbax's threads again
      except (OSError, ValueError):
        if self._failed is None:
          raise  # else Orbax's wait raising the failure wait() raised once, again
    finally:
      self._waits.stop()
      self._reads.stop()
