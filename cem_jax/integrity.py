"""Checkpoint integrity: sha256 digests of every saved step, verified before a restore.

The only module that knows Orbax's file names. Layout under a checkpoint folder ``DIR``::

    <step>/                      one Orbax step (written and committed by Orbax)
    digests/<step>.json          sha256 and size of every file of step <step>
    rejected/<step>.<time_ns>/   damaged steps moved aside on resume (kept for inspection)
    deleting/<step>/             old steps Orbax has let go (``keep``), until removed

Why: Orbax lists any integer-named folder as a finished step, so an emptied, truncated or
bit-flipped step would be restored (or crash the restore).

The commit protocol. After Orbax has written and finalized a step's files but *before* it
commits the step (the ``post_finalization_callback`` of ``AsyncOptions``), process 0 calls
:func:`write_digest`, which hashes every file of the step and writes ``digests/<step>.json``;
so a committed step always has its digest, and a digest without a step (killed between the two)
is harmless. Two files are excluded because the commit itself writes them afterwards:
``_CHECKPOINT_METADATA`` (gets a commit timestamp) and the top-level ``commit_success.txt``; the
latter's presence is checked instead (it is the commit marker where rename is not atomic). On
resume, :func:`newest_intact` verifies steps newest first; a damaged one is reported
(``logging.warning`` naming the step and the file) and moved to ``rejected/`` so the run can
save that step number again, and the newest intact step is used. If steps exist but none is
intact, :class:`CheckpointError` says so. Verification reads every file once (about 1 GB/s of
sha256 per core). With several processes only process 0 verifies and moves; the others take
its answer (verifying too, each would read the whole checkpoint, and race process 0's move).
"""

from __future__ import annotations

import glob
import json
import os
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from cem_jax.files import atomic_write_json, sha256_file

DIGEST_DIR = "digests"
REJECTED_DIR = "rejected"
# Where Orbax moves an old step it lets go (CheckpointManagerOptions.todelete_subdir): one
# rename, so that a process killed while the step is removed (a second Ctrl-C while the last save
# commits) leaves no half-deleted step among the finished ones, only files in here.
DELETING_DIR = "deleting"
# Orbax's file names (orbax.checkpoint's commit protocol): the marker of a committed step where
# rename is not atomic, the per-step metadata the commit rewrites (Orbax exports no name for
# it; tests/test_checkpoint.py saves and verifies real steps), and the suffix of a step folder
# that is still being written.
COMMIT_MARKER = ocp.path.atomicity.COMMIT_SUCCESS_FILE
_NOT_DIGESTED = ("_CHECKPOINT_METADATA", COMMIT_MARKER)
_TMP_SUFFIX = ocp.path.atomicity.TMP_DIR_SUFFIX


class CheckpointError(ValueError):
  """A checkpoint cannot be used (none intact, or it does not fit the model/optimizer) or
  cannot be saved (no room on its disk, or its save failed).

  A ``ValueError`` so that the command line reports it as bad input (one line, exit status 1).
  """


def step_dir(directory: str, step: int) -> str:
  """Orbax's folder of checkpoint ``step`` in ``directory``."""
  return os.path.join(directory, str(step))


def step_of_dir(path: str) -> tuple[str, int] | None:
  """``(directory, step)`` of ``path`` when its name is a step's folder as :func:`step_dir`
  names it (all digits; a trailing separator ignored), else None. The name alone is read."""
  directory, name = os.path.split(os.path.normpath(path))
  return (directory, int(name)) if name.isdigit() else None


def step_folders(directory: str) -> set[int]:
  """The steps whose folders ``directory`` (a run's ``checkpoints/``) holds now, committed or
  not (:func:`step_dir`'s all-digit names: an in-flight save's ``STEP`` + ``_TMP_SUFFIX``
  folder and :data:`DIGEST_DIR` are none); empty if it does not exist or is a file (for
  :class:`cem_jax.checkpoint.Checkpointer` to refuse in its own line)."""
  try:
    return {int(name) for name in os.listdir(directory) if name.isdigit()}
  except (FileNotFoundError, NotADirectoryError):
    return set()


def digest_path(directory: str, step: int) -> str:
  """The sha256 digest file of checkpoint ``step`` (written once the step's files are final,
  before Orbax commits it: the module docstring)."""
  return os.path.join(directory, DIGEST_DIR, f"{step}.json")


def _step_files(folder: str) -> list[str]:
  """Relative paths (``/``-separated, sorted) of the files under ``folder``, minus the two the
  commit writes."""
  out = []
  for root, _, files in os.walk(folder):
    for name in files:
      rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
      if rel not in _NOT_DIGESTED:
        out.append(rel)
  return sorted(out)


def compute_digest(folder: str) -> dict[str, dict]:
  """Returns ``{relative path: {"size": bytes, "sha256": hex}}`` for the files of a step folder."""
  out = {}
  for rel in _step_files(folder):
    path = os.path.join(folder, rel)
    out[rel] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
  return out


def write_digest(directory: str, step: int) -> None:
  """Digests step ``step``, finalized but not yet committed, into ``digests/<step>.json``.

  Call it from Orbax's ``post_finalization_callback`` (process 0 only; other processes return).
  """
  if jax.process_index() != 0:
    return
  # Before the commit the step is still in its temporary folder (atomic-rename filesystems);
  # where commits use a marker file instead, it is already in its final folder.
  tmp = sorted(glob.glob(glob.escape(step_dir(directory, step)) + _TMP_SUFFIX + "*"),
               key=os.path.getmtime)
  folder = tmp[-1] if tmp else step_dir(directory, step)
  os.makedirs(os.path.join(directory, DIGEST_DIR), exist_ok=True)
  atomic_write_json(digest_path(directory, step), {
      "step": step, "algorithm": "sha256", "excluded": list(_NOT_DIGESTED),
      "files": compute_digest(folder),
  }, indent=1, sort_keys=True)


def prune_digests(directory: str, steps) -> None:
  """Removes digests of steps not in ``steps`` (those Orbax has deleted: ``keep``), except any
  newer than the newest of ``steps`` (a save in progress). Process 0 only."""
  if jax.process_index() != 0:
    return
  folder = os.path.join(directory, DIGEST_DIR)
  if not os.path.isdir(folder):
    return
  steps = set(steps)
  newest = max(steps, default=-1)
  for name in os.listdir(folder):
    stem = name.removesuffix(".json")
    if stem.isdigit() and int(stem) not in steps and int(stem) < newest:
      os.remove(os.path.join(folder, name))


def _digest_damage(files) -> str | None:
  """What is wrong with a digest's ``files`` (as :func:`write_digest` writes it), or None.

  A hand-edited digest must make its step damaged, not crash the resume: every entry needs a
  size and a sha256, and a committed step has files, so an empty digest checks nothing.
  """
  if not isinstance(files, dict):
    return f"'files' is {json.dumps(files)[:40]}, not an object of files"
  if not files:
    return "'files' lists no file"
  for rel, want in sorted(files.items()):
    if os.path.isabs(rel) or ".." in rel.split("/"):
      return f"{rel!r} is outside the step folder"
    if not isinstance(want, dict):
      return f"{rel!r} has {json.dumps(want)[:40]}, not an object"
    size, sha = want.get("size"), want.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
      return f"{rel!r} has no valid 'size' (an int >= 0)"
    if not isinstance(sha, str) or len(sha) != 64:
      return f"{rel!r} has no valid 'sha256' (64 hex digits)"
  return None


def verify(directory: str, step: int) -> list[str]:
  """Checks step ``step`` against its digest; returns its problems (empty list = intact).

  Each problem is one short phrase naming the file, e.g. ``"state/manifest.ocdbt: 0 bytes,
  digest says 115 (truncated)"``.
  """
  folder = step_dir(directory, step)
  if not os.path.isdir(folder):
    return [f"{folder}: no such folder"]
  if not os.listdir(folder):
    return [f"{folder}: empty folder"]
  problems = []
  if not os.path.isfile(os.path.join(folder, COMMIT_MARKER)):
    problems.append(f"{folder}/{COMMIT_MARKER}: missing (the save did not finish)")
  path_of_digest = digest_path(directory, step)
  try:
    with open(path_of_digest) as f:
      files = json.load(f)["files"]
  except FileNotFoundError:
    return problems + [f"{path_of_digest}: missing (the save did not finish)"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    return problems + [f"{path_of_digest}: unreadable ({type(e).__name__})"]
  damage = _digest_damage(files)
  if damage:
    return problems + [f"{path_of_digest}: damaged digest ({damage})"]
  for rel, want in sorted(files.items()):
    path = os.path.join(folder, rel)
    if not os.path.isfile(path):
      problems.append(f"{path}: missing")
      continue
    size = os.path.getsize(path)
    if size != want["size"]:
      kind = "truncated" if size < want["size"] else "grown"
      problems.append(f"{path}: {size} bytes, digest says {want['size']} ({kind})")
    elif sha256_file(path) != want["sha256"]:
      problems.append(f"{path}: sha256 differs from {path_of_digest} (damaged)")
  return problems


def newest_intact(directory: str, steps, read_only: bool) -> int | None:
  """The newest intact step of ``steps`` (Orbax's finished steps), or None when it is empty.

  Newer damaged steps are reported with ``logging.warning`` (step and file) and, unless
  ``read_only``, moved to ``rejected/`` (:func:`move_aside`), so that training can save those
  step numbers again. A step whose folder is gone once verified (pruned by a run still saving
  there, beside which a reader lists steps) is not damaged: skipped, with a warning that says
  so only when not ``read_only`` (a resume: no run prunes beside it). With
  several processes, process 0 does this (with its own ``steps``) and every process returns
  its answer once the move is done; all must call it.

  Raises:
    CheckpointError: steps exist but none is intact (one line listing each step's first
      problem and the fix; on the other processes, one line pointing to process 0's).
    OSError: a damaged step could not be moved (on the other processes: CheckpointError).
  """
  if jax.process_count() == 1:
    return _newest_intact(directory, steps, read_only)
  from jax.experimental import multihost_utils

  step, error = None, None
  if jax.process_index() == 0:
    try:
      step = _newest_intact(directory, steps, read_only)
    except (CheckpointError, OSError) as e:
      error = e
  # -2: process 0 failed; -1: no step. A collective every process joins, after the move.
  answer = -2 if error is not None else (-1 if step is None else step)
  answer = int(multihost_utils.broadcast_one_to_all(np.int32(answer)))
  if error is not None:
    raise error
  if answer == -2:
    raise CheckpointError(f"{directory}: process 0 found no checkpoint to restore (see its "
                          "error); nothing restored")
  return None if answer == -1 else answer


def _newest_intact(directory: str, steps, read_only: bool) -> int | None:
  """:func:`newest_intact` on this process alone."""
  steps = sorted(steps, reverse=True)
  rejected, first = {}, {}
  for step in steps:
    problems = verify(directory, step)
    if not problems:
      break
    if not os.path.isdir(step_dir(directory, step)):
      # Listed, gone now: pruned (checkpoint.keep) by the run saving here while it was
      # verified, its files missing or its folder with them (a reader beside a run still
      # training). Nothing is wrong with it: no warning that calls it damaged, nothing to move.
      first[step] = "gone since it was listed (pruned by a run saving there, or removed)"
      if not read_only:  # the run resuming is the one that saves here: another removed it
        logging.warning("checkpoint step %d was removed while it was verified (by another "
                        "process?), not restoring it", step)
      continue
    rejected[step] = problems
    first[step] = problems[0]
    logging.warning("checkpoint step %d is damaged, not restoring it: %s", step,
                    "; ".join(problems))
  else:
    if steps:
      summary = "; ".join(f"step {s}: {p}" for s, p in first.items())
      raise CheckpointError(
          f"{directory}: no intact checkpoint ({summary}); move the folder away to "
          "start over, or restore a backup"
      )
    return None
  if rejected and not read_only:
    move_aside(directory, sorted(rejected))
  return step


def move_aside(directory: str, steps: list[int]) -> None:
  """Moves steps ``steps`` and their digests to ``rejected/`` (one process: process 0, see
  :func:`newest_intact`)."""
  target = os.path.join(directory, REJECTED_DIR)
  os.makedirs(target, exist_ok=True)
  for step in steps:
    dest = os.path.join(target, f"{step}.{time.time_ns()}")
    os.replace(step_dir(directory, step), dest)
    if os.path.exists(digest_path(directory, step)):
      os.replace(digest_path(directory, step), dest + ".digest.json")
    logging.warning("moved damaged checkpoint step %d to %s", step, dest)
