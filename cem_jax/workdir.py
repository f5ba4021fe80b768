"""What the loop needs around it: a writable workdir held by one run at a time, the data built
once across processes (and removed again if a resume refuses them), a failed start's folder
removed again but for its prepared tokens, the last eval read back from ``metrics.jsonl``,
SIGTERM as a flag and Ctrl-C held back where it must wait; for the
tools that resume or skip runs by their folder, whether a folder holds a run of another
config. Nothing here builds a model or runs a step.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time

import jax
import ml_collections
import numpy as np

from cem_jax import cli, energies, errors, integrity
from cem_jax import config as config_lib
from cem_jax import data as data_lib
from cem_jax.files import hold_folder, read_json
from cem_jax.metrics import metrics_path, read_metrics


def build_data_once(config: ml_collections.ConfigDict, workdir: str):
  """``data.build_data``; with several processes, process 0 first (it prepares the tokens
  into ``WORKDIR/data`` unless ``data.prepared_dir`` is set; the others then open them
  instead of racing to write them).

  Raises:
    ValueError: as ``build_data``; on processes other than 0 also when process 0 failed.
  """
  if jax.process_count() == 1:
    return data_lib.build_data(config, workdir)
  from jax.experimental import multihost_utils

  data, error = None, None
  if jax.process_index() == 0:
    try:
      data = data_lib.build_data(config, workdir)
    except (ValueError, OSError, RuntimeError) as e:
      error = e
  # A collective every process joins, so a failure on process 0 stops the others too.
  ok = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
  if error is not None:
    raise error
  if not ok:
    raise ValueError("process 0 could not build the data (see its error); nothing trained")
  # Process 0 has just verified every file's sha256: the others check sizes only (each hash
  # is a read of the whole corpus, from storage all hosts share).
  return data if data is not None else data_lib.build_data(config, workdir, verify=False)


_SEEN_BY_ALL = ".processes_see_this_"  # + process 0's token: a file in WORKDIR for a moment


def _lock(f) -> None:
  """An exclusive ``flock`` on the open file ``f`` (waits for it); none where the filesystem
  or the OS has none: its start's file is then not told from a killed start's."""
  if os.name == "posix":
    import fcntl  # POSIX only

    with contextlib.suppress(OSError):
      fcntl.flock(f, fcntl.LOCK_EX)


def remove_killed_starts_files(workdir: str) -> None:
  """Removes from ``workdir`` the files of :func:`check_processes_agree` that a start killed
  while it held one (``kill -9``) left behind: one a start, never removed. The file of a start
  under way (another run's, refused later by :func:`exclusive`) is locked by its process 0 and
  stays, as does one not written yet (empty) and every one where ``flock`` is missing."""
  if os.name != "posix":
    return
  import fcntl  # POSIX only

  for name in os.listdir(workdir):
    if not name.startswith(_SEEN_BY_ALL):
      continue
    path = os.path.join(workdir, name)
    # Gone meanwhile, held by its start, not a lockable file: left as it is.
    with contextlib.suppress(OSError), open(path) as f:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
      if f.read():
        os.remove(path)


def config_digest(config: ml_collections.ConfigDict) -> bytes:
  """The sha256 of ``config``'s JSON (keys sorted, paths as given): as hex, the
  ``config_digest`` a table's ``result.json`` records (committed results included:
  tests/test_tables.py pins it to them, so the formula must not change). Processes compare
  :func:`processes_digest` instead, which does not see where each host keeps the code."""
  return hashlib.sha256(json.dumps(json.loads(config.to_json()), sort_keys=True).encode()
                        ).digest()


def processes_digest(config: ml_collections.ConfigDict) -> bytes:
  """A sha256 of ``config`` as the run sees it: equal on processes given the same one. Its
  values (keys sorted), a user energy file by file name (:func:`cem_jax.config.
  energy_file_name`) and its source's digest (:func:`cem_jax.energies.energy_digests`), not
  by its path: ``main`` makes that path absolute, and hosts (or a TPU pod's workers) keep
  their copies of the code at paths of their own.

  Raises:
    ValueError: an energy that cannot be loaded (``preflight.check`` has refused it before).
  """
  values = config_lib.flat(config)
  for key in config_lib.ENERGY_KEYS:
    values[key] = config_lib.energy_file_name(values[key])
  seen = {"config": values, "energies": energies.energy_digests(config)}
  return hashlib.sha256(json.dumps(seen, sort_keys=True).encode()).digest()


def process_mismatch(workdir: str, config: ml_collections.ConfigDict, digest0: bytes,
                     token: str, wait_s: float = 5.0) -> int:
  """What this process finds against process 0's ``digest0`` (:func:`processes_digest`) and the
  file process 0 wrote in ``workdir`` (named and holding ``token``): 0 the same, 1 another
  config, 2 not that file (``workdir`` is not the folder process 0 writes in); 3 (given by
  :func:`check_processes_agree`, not here) process 0 could not write it. Waits up to
  ``wait_s`` for the file (a network mount may show it late)."""
  if processes_digest(config) != digest0:
    return 1
  path = os.path.join(workdir, _SEEN_BY_ALL + token)
  deadline = time.monotonic() + wait_s
  while True:
    try:
      with open(path) as f:
        if f.read() == token:
          return 0
    except OSError:
      pass
    if time.monotonic() >= deadline:
      return 2
    time.sleep(0.2)


def check_processes_agree(config: ml_collections.ConfigDict, workdir: str) -> None:
  """With several processes, checks that all were given process 0's config (as the run sees
  it, :func:`processes_digest`: wherever each host keeps the code) and see the files it writes
  in ``workdir`` (storage all hosts share, at the path each was given). Without
  this, a process on another config fails in a collective or trains another model's shards,
  and one whose ``workdir`` is another folder (a path on its host's own disk, a typo) hangs
  in the first checkpoint until Orbax's 600 s timeout, as process 0 does at its end.

  Every process calls it after :func:`prepare_workdir`; all raise together, also when process
  0 cannot write its file (a full disk, where the probe's empty file still fit): it raised
  alone, and the others waited in the broadcast for it. Process 0 first removes the files
  that killed starts left (:func:`remove_killed_starts_files`), also in a single-process run.

  Raises:
    ValueError: one line naming the first process that differs and what to fix.
  """
  if jax.process_index() == 0:
    remove_killed_starts_files(workdir)
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  token, path, unwritten, held = "", None, None, None
  if jax.process_index() == 0:
    token = os.urandom(8).hex()
    path = os.path.join(workdir, _SEEN_BY_ALL + token)
    try:
      # Open and locked until removed: what tells it from a killed start's file.
      held = open(path, "w")
      _lock(held)
      held.write(token)
      held.flush()
    except OSError as e:  # a full disk (the probe's empty file fit): all still join, and stop
      token, unwritten = "", e
  try:
    # Written before the broadcast: every process joins it only once process 0 has written.
    shared = np.frombuffer(processes_digest(config) + token.encode().ljust(16), np.uint8)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(shared), np.uint8).tobytes()
    theirs = shared[32:].decode().strip()
    code = process_mismatch(workdir, config, shared[:32], theirs) if theirs else 3
    codes = np.asarray(multihost_utils.process_allgather(np.int32(code))).reshape(-1)
  finally:
    if path is not None:
      with contextlib.suppress(OSError):
        os.remove(path)
    if held is not None:
      with contextlib.suppress(OSError):  # a full disk: nothing of it is kept anyway
        held.close()
  bad = [(i, int(c)) for i, c in enumerate(codes) if c]
  if not bad:
    return
  i, c = bad[0]
  if c == 3:
    why = f" ({unwritten.strerror or unwritten})" if unwritten is not None else ""
    raise ValueError(f"--workdir={workdir!r}: process 0 could not write a file there{why}; "
                     "allowed: a writable folder with free space")
  if c == 1:
    raise ValueError(f"process {i} was given another config than process 0 (its --config or "
                     "--config.* flags, or a config or energy file that differs on its "
                     "host); allowed: the same command on every process")
  raise ValueError(f"--workdir={workdir!r}: process {i} does not see the files process 0 "
                   "writes there; allowed: a folder on storage every process shares, given "
                   "by a path that names it on every host (not a host's own disk)")


def prepared_folders(workdir: str) -> frozenset[str] | None:
  """The names in ``WORKDIR/data`` (the datasets prepared there); None if it does not exist."""
  try:
    return frozenset(os.listdir(os.path.join(workdir, "data")))
  except FileNotFoundError:
    return None


def remove_prepared_since(workdir: str, before: frozenset[str] | None) -> None:
  """Removes, on process 0 (which prepares), what ``WORKDIR/data`` gained since ``before`` (a
  :func:`prepared_folders` taken earlier), ``WORKDIR/data`` itself if it was not there. For a
  resume refused for other data: only a run of this workdir would read a dataset in it, and
  its checkpoint refuses that one, so it would stay as dead weight (a corpus's tokens)."""
  if jax.process_index() != 0:
    return
  data = os.path.join(workdir, "data")
  if before is None:
    shutil.rmtree(data, ignore_errors=True)
    return
  for name in (prepared_folders(workdir) or frozenset()) - before:
    shutil.rmtree(os.path.join(data, name), ignore_errors=True)


def remove_failed_start(workdir: str, made: tuple[str, ...] = ()) -> None:
  """Removes ``workdir``, which a start that failed had created, but for the tokens prepared in
  ``WORKDIR/data``, so that no failed start looks like a run; then those of the folders above
  it in ``made`` (:func:`prepare_workdir`'s, deepest first) that are empty. The tokens are kept
  because they are valid whatever failed (a prepare removes what it cannot finish itself) and
  the next start of this workdir reuses them: at corpus scale a failure after the data (a
  seq_len too long, a step too large, Ctrl-C while compiling) would otherwise cost the whole
  tokenization again. What cannot be removed stays."""
  data = os.path.join(workdir, "data")
  if not (os.path.isdir(data) and os.listdir(data)):
    shutil.rmtree(workdir, ignore_errors=True)
    remove_empty_folders(made)
    return
  for name in set(os.listdir(workdir)) - {"data"}:
    path = os.path.join(workdir, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      with contextlib.suppress(OSError):
        os.remove(path)


def remove_empty_folders(folders: tuple[str, ...]) -> None:
  """Removes each of ``folders`` (deepest first) that is empty: ``rmdir`` only, so never one that
  holds something, also what another process put there meanwhile."""
  for folder in folders:
    with contextlib.suppress(OSError):
      os.rmdir(folder)


def prepare_workdir(workdir: str) -> tuple[str, ...]:
  """Creates ``workdir`` if needed and checks that files can be written in it.

  Returns the folders this call made, deepest first (``workdir`` and the missing folders above
  it, as real paths), empty if ``workdir`` was there: a failed start-up removes them again
  (:func:`remove_failed_start`). When it cannot be made whole or written, they are removed
  here, if still empty.

  Raises:
    ValueError: it cannot be created or written, is not a UTF-8 path, is a URL
      (``gs://...``), or has what Orbax's writer misreads: a ``[...]`` (a glob pattern) or a
      ``gs:/`` (one line naming ``--workdir`` and the reason).
  """
  try:
    os.path.abspath(workdir).encode("utf-8")
  except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8
    # ArrayRecord's and Orbax's writers take UTF-8 paths only: found out before anything exists.
    raise ValueError(f"--workdir={workdir!r} is not a UTF-8 path; choose another --workdir"
                     ) from None
  if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", workdir):
    # os.makedirs made ./gs:/bucket/run, and tensorboardX's import of google-cloud-storage for
    # its own gs:// writer failed after the data and the compilation, in a traceback.
    raise ValueError(f"--workdir={workdir!r} is a URL; allowed: a folder of this machine's "
                     "file system (a bucket mounted there, e.g. with gcsfuse, on a pod)")
  absolute = os.path.abspath(workdir)
  # Orbax's array writer rewrites every 'gs:/' in a path to 'gs://' (a Cloud Storage URL):
  # under .../logs:/run the first save failed, after checkpoint.every_steps steps.
  if "gs:/" in absolute + "/":
    raise ValueError(f"--workdir={workdir!r}: Orbax's checkpoint writer reads the 'gs:/' in "
                     f"its path {absolute!r} as a Cloud Storage URL and its first save would "
                     "fail; choose a --workdir without a folder name ending in 'gs:'")
  # Orbax finds a step's per-process arrays by globbing below the step's folder, the folder's
  # path part of the pattern: under a path that does not match itself ('[1]' matches '1') it
  # found none, merged nothing, and every checkpoint saved was unreadable at the first resume.
  if not fnmatch.fnmatchcase(absolute, absolute):
    raise ValueError(f"--workdir={workdir!r}: its '[...]' is a glob pattern to Orbax's "
                     "checkpoint writer, which would save checkpoints no resume can read; "
                     "choose a --workdir without '[' and ']' (or rename the folder)")
  # What makedirs will make, deepest first. realpath, not abspath: the kernel resolves a symlink
  # before a '..' after it (link/../w is w beside link's target), abspath drops both.
  missing, path = [], os.path.realpath(workdir)
  while not os.path.lexists(path):
    missing.append(path)
    path = os.path.dirname(path)
  try:
    os.makedirs(workdir, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=workdir, prefix=".write_probe")
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    remove_empty_folders(tuple(missing))
    raise ValueError(
        f"--workdir={workdir!r} is not a writable folder ({e.strerror or e}: "
        f"{e.filename or workdir}); choose another --workdir or fix its permissions"
    ) from None
  return tuple(missing)


@contextlib.contextmanager
def exclusive(workdir: str):
  """Holds ``workdir`` for one training run while the block runs: an exclusive ``flock`` on
  the folder itself (no lock file is left behind), taken by process 0 only (the processes of
  one run share the folder), released when the block ends or the process dies (also
  ``kill -9``). Two runs in one folder would each append to ``metrics.jsonl`` and save over
  the other's checkpoints, and both exit 0. A filesystem without ``flock`` (some network
  mounts) holds no lock, with a warning; neither does Windows.

  Raises:
    ValueError: another process holds ``workdir`` (one line naming it and the fix).
  """
  if jax.process_index() != 0:
    yield
    return
  with hold_folder(workdir, f"--workdir={workdir!r} is in use: another run is training in it "
                   "(a second main, tables or sweep on the same folder); wait for it to end, or "
                   "choose another --workdir", f"--workdir={workdir}", "a second run"):
    yield


def config_changes(workdir: str, config: ml_collections.ConfigDict) -> list[str] | None:
  """How the run in ``workdir`` (its ``config.json``) differs from ``config`` as a training
  run, as :func:`cem_jax.config.run_changes` says; None when it has no ``config.json``.

  Raises:
    ValueError: ``config.json`` is not valid JSON, or not a JSON object (one line naming it).
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return None
  saved = read_json(path, "delete that run to train it again")
  config_lib.check_saved(saved, path)
  return config_lib.run_changes(saved, config)


def check_same_run(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Refuses a run folder that holds a checkpoint of a run started with a config other than
  ``config`` (:func:`config_changes`), for the tools that resume or skip runs by their folder
  (``tables``, ``launch/sweep.py``): resumed, it would continue the other run's schedule and
  settings as this config's (``main`` only logs such changes); skipped as finished, it would
  stand for a run it is not. A folder with no checkpoint yet starts over and is not refused.

  Raises:
    ValueError: one line naming the folder, the keys that differ and the fix.
  """
  if not integrity.step_folders(os.path.join(workdir, "checkpoints")):
    return
  changes = config_changes(workdir, config)
  if changes:
    raise ValueError(f"{workdir} holds a run started with another config "
                     f"({errors.first_three(changes, '; ')}); it is "
                     "not this run and resuming it would mix the two: use the command that "
                     "started it, a new --workdir, or delete that run to train it again")


class Preemption:
  """Turns SIGTERM (a preemption notice) into a flag the loop checks at each step boundary.

  Entered before start-up, which has nothing to save: there (until :meth:`loop_starts`) a
  SIGTERM raises :class:`cem_jax.cli.Terminated` (:data:`cem_jax.cli.TERMINATED_IN_START_UP`),
  so that start-up's clean-up runs and ``main`` says so in one line. It was the default action: the
  process ended at once, silently (status 143), a new workdir left with an empty
  ``checkpoints/``. The flag is set there too: a Terminated that Python drops (raised in a
  ``gc`` callback or a ``__del__`` of a job whose SIGINT is ignored, where
  :func:`cem_jax.cli.interrupted` does not send it again) or that a library swallows lets
  start-up go on, and the loop then saves at its first step boundary.

  Only for single-process runs started from the main thread: with several processes every
  process must save at the same step, which Orbax's ``reached_preemption`` (JAX's preemption
  sync point) decides instead.
  """

  def __init__(self):
    self.requested = False
    self.starting = True
    self._previous = None

  def loop_starts(self) -> None:
    """From here a SIGTERM is the flag (start-up is over)."""
    self.starting = False

  def __enter__(self):
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    # First: should the Terminated be dropped, the SIGTERM is still honoured (it was forgotten
    # and the run trained to its end).
    self.requested = True  # nothing else: a signal handler may interrupt anything
    if self.starting:
      raise cli.Terminated(cli.TERMINATED_IN_START_UP)

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def last_eval_in(workdir: str) -> dict:
  """The last eval line of ``workdir/metrics.jsonl`` without its ``step``; ``{}`` if none."""
  if not os.path.exists(metrics_path(workdir)):
    return {}
  evals = [m for m in read_metrics(workdir) if "eval/loss" in m]
  return {k: v for k, v in evals[-1].items() if k != "step"} if evals else {}
