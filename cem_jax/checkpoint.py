"""A thin wrapper over Orbax's ``CheckpointManager``: save, verify, find and restore train states.

Layout of ``DIR/checkpoints`` (``DIR`` = ``--workdir``)::

    <step>/            one Orbax step, two items:
      state/           params and optimizer state (``StandardSave``: OCDBT/zarr arrays)
      meta/            JSON: step, data position, RNG seed, resolved config
    digests/<step>.json  sha256 and size of every file of step <step> (see below)
    rejected/<step>.<time_ns>/  damaged steps moved aside on resume (kept for inspection)

What Orbax does and this module does not repeat: asynchronous writes, atomic commit (a step is
written to ``<step>.orbax-checkpoint-tmp*`` and renamed when complete; leftovers of a killed
save are removed when the manager starts), keeping the newest ``keep`` steps, and restoring onto
whatever shardings the abstract target names (so a checkpoint reads onto another mesh or device
count).

What it adds: **integrity**. Orbax lists any integer-named folder as a finished step, so an
emptied, truncated or bit-flipped step would be restored (or crash the restore). After Orbax
has written and finalized a step's files but *before* it commits the step (the
``post_finalization_callback`` of ``AsyncOptions``), process 0 hashes every file of the step
and writes ``digests/<step>.json``; so a committed step always has its digest, and a digest
without a step (killed between the two) is harmless. Two files are excluded because the commit
itself writes them afterwards: ``_CHECKPOINT_METADATA`` (gets a commit timestamp) and the
top-level ``commit_success.txt``; the latter's presence is checked instead (it is the commit
marker where rename is not atomic). On resume, steps are verified newest first; a damaged one is
reported (``logging.warning`` naming the step and the file) and moved to ``rejected/`` so the
run can save that step number again, and the newest intact step is used. If steps exist but
none is intact, :class:`CheckpointError` says so. Verification reads every file once (about
1 GB/s of sha256 per core).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time

import jax
import orbax.checkpoint as ocp
from absl import logging

DIGEST_DIR = "digests"
REJECTED_DIR = "rejected"
COMMIT_MARKER = "commit_success.txt"
# Written by the commit after the digest is taken (see the module docstring).
_NOT_DIGESTED = ("_CHECKPOINT_METADATA", COMMIT_MARKER)
_HASH_CHUNK = 1 << 20


class CheckpointError(ValueError):
  """A checkpoint cannot be used: none intact, or it does not fit the model/optimizer.

  A ``ValueError`` so that the command line reports it as bad input (one line, exit status 1).
  """


def _file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_HASH_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def _step_files(step_dir: str) -> list[str]:
  """Relative paths (``/``-separated, sorted) of the files under ``step_dir``, minus the two the
  commit writes."""
  out = []
  for root, _, files in os.walk(step_dir):
    for name in files:
      rel = os.path.relpath(os.path.join(root, name), step_dir).replace(os.sep, "/")
      if rel not in _NOT_DIGESTED:
        out.append(rel)
  return sorted(out)


def compute_digest(step_dir: str) -> dict[str, dict]:
  """Returns ``{relative path: {"size": bytes, "sha256": hex}}`` for the files of a step folder."""
  out = {}
  for rel in _step_files(step_dir):
    path = os.path.join(step_dir, rel)
    out[rel] = {"size": os.path.getsize(path), "sha256": _file_sha256(path)}
  return out


def _write_json_atomic(path: str, obj) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _flat_arrays(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  """``{"a/b/0/c": (shape, dtype)}`` in Orbax's own key format, for trees and metadata alike."""
  flat = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(tree, keep_empty_nodes=True), sep="/")
  return {k: (tuple(v.shape), str(v.dtype)) for k, v in flat.items() if hasattr(v, "shape")}


def _listing(items: list[str], limit: int = 6) -> str:
  shown = ", ".join(items[:limit])
  return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


class Checkpointer:
  """Saves and restores a train state (a pytree of arrays) plus JSON metadata, verified.

  Args:
    directory: the checkpoint folder (``DIR/checkpoints``; created if missing).
    keep: how many of the newest steps Orbax keeps (``checkpoint.keep``, >= 1).
    every_steps: save interval (``checkpoint.every_steps``): :meth:`should_save` is true on
      multiples of it (and at a multi-host preemption sync point).
    async_save: False waits for each save to finish before :meth:`save` returns.
    read_only: for tools that only restore (e.g. evaluating a run that may still be training):
      nothing is created, cleaned up or moved aside; damaged steps are only skipped.
  """

  def __init__(self, directory: str, keep: int = 3, every_steps: int = 1,
               async_save: bool = True, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    self.async_save = async_save
    self.read_only = read_only
    self._saving_step: int | None = None
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
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
        # must not remove the folder of a save in progress.
        cleanup_tmp_directories=not read_only,
        read_only=read_only,
    )
    # Handlers named up front so that a fresh process can read a step's tree metadata.
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()},
    )

  # -- paths ------------------------------------------------------------------------------------

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def digest_path(self, step: int) -> str:
    return os.path.join(self.directory, DIGEST_DIR, f"{step}.json")

  # -- saving -----------------------------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Steps Orbax considers finished (committed), oldest first; not verified."""
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest step Orbax considers finished, or None; not verified (see ``restorable_step``)."""
    return self.manager.latest_step()

  def should_save(self, step: int) -> bool:
    """True if ``step`` is a save step by ``every_steps`` (or a multi-host preemption point)."""
    return self.manager.should_save(step)

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    """Starts saving ``state`` (a pytree of arrays) and ``meta`` (JSON-able) at ``step``.

    Returns False without saving when ``step`` is already saved or (``force`` False) is not a
    save step. The caller may keep training while the arrays are written; call :meth:`wait`
    before exiting.
    """
    if step in self.manager.all_steps():
      return False
    if not force and not self.should_save(step):
      return False
    # Orbax would wait for the previous save anyway; waiting here first lets the digest hook know
    # which step it is finalizing, and prunes digests of steps Orbax has since deleted.
    self.wait()
    self._saving_step = step
    saved = self.manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                meta=ocp.args.JsonSave(meta)),
        force=True,
    )
    if not self.async_save:
      self.wait()
    return saved

  def _write_digest(self) -> None:
    """Orbax's post-finalization hook: digests the step about to be committed (process 0)."""
    step = self._saving_step
    if step is None or jax.process_index() != 0:
      return
    # Before the commit the step is still in its temporary folder (atomic-rename filesystems);
    # where commits use a marker file instead, it is already in its final folder.
    tmp = sorted(glob.glob(glob.escape(self.step_dir(step)) + ".orbax-checkpoint-tmp*"),
                 key=os.path.getmtime)
    folder = tmp[-1] if tmp else self.step_dir(step)
    os.makedirs(os.path.join(self.directory, DIGEST_DIR), exist_ok=True)
    _write_json_atomic(self.digest_path(step), {
        "step": step, "algorithm": "sha256", "excluded": list(_NOT_DIGESTED),
        "files": compute_digest(folder),
    })

  def _prune_digests(self) -> None:
    """Removes digests of steps Orbax has deleted (``keep``); never the one being saved."""
    if jax.process_index() != 0:
      return
    folder = os.path.join(self.directory, DIGEST_DIR)
    if not os.path.isdir(folder):
      return
    steps = set(self.manager.all_steps())
    newest = max(steps, default=-1)
    for name in os.listdir(folder):
      stem = name.removesuffix(".json")
      if stem.isdigit() and int(stem) not in steps and int(stem) < newest:
        os.remove(os.path.join(folder, name))

  # -- verifying --------------------------------------------------------------------------------

  def verify(self, step: int) -> list[str]:
    """Checks step ``step`` against its digest; returns its problems (empty list = intact).

    Each problem is one short phrase naming the file, e.g. ``"state/manifest.ocdbt: 0 bytes,
    digest says 115 (truncated)"``.
    """
    folder = self.step_dir(step)
    if not os.path.isdir(folder):
      return [f"{folder}: no such folder"]
    if not os.listdir(folder):
      return [f"{folder}: empty folder"]
    problems = []
    if not os.path.isfile(os.path.join(folder, COMMIT_MARKER)):
      problems.append(f"{folder}/{COMMIT_MARKER}: missing (the save did not finish)")
    digest_path = self.digest_path(step)
    try:
      with open(digest_path) as f:
        files = json.load(f)["files"]
    except FileNotFoundError:
      return problems + [f"{digest_path}: missing (the save did not finish)"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      return problems + [f"{digest_path}: unreadable ({type(e).__name__})"]
    for rel, want in sorted(files.items()):
      path = os.path.join(folder, rel)
      if not os.path.isfile(path):
        problems.append(f"{path}: missing")
        continue
      size = os.path.getsize(path)
      if size != want["size"]:
        kind = "truncated" if size < want["size"] else "grown"
        problems.append(f"{path}: {size} bytes, digest says {want['size']} ({kind})")
      elif _file_sha256(path) != want["sha256"]:
        problems.append(f"{path}: sha256 differs from {digest_path} (damaged)")
    return problems

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
    steps = sorted(self.manager.all_steps(), reverse=True)
    rejected = {}
    for step in steps:
      problems = self.verify(step)
      if not problems:
        break
      rejected[step] = problems
      logging.warning("checkpoint step %d is damaged, not restoring it: %s", step,
                      "; ".join(problems))
    else:
      if steps:
        summary = "; ".join(f"step {s}: {p[0]}" for s, p in rejected.items())
        raise CheckpointError(
            f"{self.directory}: no intact checkpoint ({summary}); move the folder away to "
            "start over, or restore a backup"
        )
      return None
    if rejected and not self.read_only:
      self._move_aside(sorted(rejected))
    return step

  def _move_aside(self, steps: list[int]) -> None:
    if jax.process_index() == 0:
      target = os.path.join(self.directory, REJECTED_DIR)
      os.makedirs(target, exist_ok=True)
      for step in steps:
        dest = os.path.join(target, f"{step}.{time.time_ns()}")
        os.replace(self.step_dir(step), dest)
        if os.path.exists(self.digest_path(step)):
          os.replace(self.digest_path(step), dest + ".digest.json")
        logging.warning("moved damaged checkpoint step %d to %s", step, dest)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices("cem_jax.checkpoint.move_aside")
    self.manager.reload()

  # -- restoring --------------------------------------------------------------------------------

  def check_compatible(self, step: int, target) -> None:
    """Compares step ``step``'s saved tree (keys, shapes, dtypes) with ``target``'s.

    Raises:
      CheckpointError: one line naming the keys missing on either side and those whose shape or
        dtype differ (e.g. a changed ``model.d_model`` or optax chain).
    """
    saved = _flat_arrays(self.manager.item_metadata(step)["state"].tree)
    want = _flat_arrays(target)
    # Parameters first: a changed model shows there, its optimizer moments only repeat it.
    order = lambda k: (not k.startswith("params/"), k)
    missing = sorted(set(want) - set(saved), key=order)
    extra = sorted(set(saved) - set(want), key=order)
    differ = sorted((k for k in set(want) & set(saved) if want[k] != saved[k]), key=order)
    if not (missing or extra or differ):
      return
    parts = []
    if differ:
      parts.append("shape/dtype differ: " + _listing(
          [f"{k} saved {saved[k][0]} {saved[k][1]} vs now {want[k][0]} {want[k][1]}"
           for k in differ]))
    if missing:
      parts.append("not in checkpoint: " + _listing([f"{k} {want[k][0]}" for k in missing]))
    if extra:
      parts.append("only in checkpoint: " + _listing([f"{k} {saved[k][0]}" for k in extra]))
    raise CheckpointError(
        f"checkpoint step {step} in {self.directory} does not fit the model/optimizer of this "
        f"config: {'; '.join(parts)}; resume with the config it was saved with (its meta/ item "
        "or config.json) or use a new --workdir"
    )

  def restore(self, step: int, target) -> tuple[object, dict]:
    """Restores ``(state, meta)`` of step ``step`` onto ``target``.

    Args:
      step: a step (normally ``restorable_step()``).
      target: a pytree like the saved state, of ``jax.Array`` or ``jax.ShapeDtypeStruct``
        (with ``sharding``) leaves, built on the *current* devices: the restored arrays get its
        structure (e.g. optax's state types, not plain dicts), shapes, dtypes and shardings.

    Returns:
      ``(state, meta)``: the state with ``target``'s structure and the saved JSON metadata.

    Raises:
      CheckpointError: the saved tree does not fit ``target`` (see ``check_compatible``).
    """
    self.check_compatible(step, target)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    out = self.manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                meta=ocp.args.JsonRestore()),
    )
    return out["state"], out["meta"]

  def wait(self) -> None:
    """Blocks until pending saves are committed (raising their errors); prunes old digests."""
    self.manager.wait_until_finished()
    self.manager.check_for_errors()
    self._prune_digests()

  def close(self) -> None:
    self.wait()
    self.manager.close()
