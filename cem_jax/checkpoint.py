"""A thin wrapper over Orbax's ``CheckpointManager``: save, find and restore train states.

A checkpoint step holds two items: ``state`` (params and optimizer state, saved with
``StandardSave``) and ``meta`` (JSON: step, data position, RNG seed and the resolved config).
Restores go through an abstract target built on the current devices, so a checkpoint can be
read onto another mesh or device count.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves and restores ``{'params', 'opt_state'}`` plus JSON metadata under ``DIR/checkpoints``.

  Args:
    directory: the checkpoint folder (created if missing).
    keep: how many of the newest steps to keep.
    async_save: save in a background thread (``wait()`` before reading or exiting).
  """

  def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=async_save,
        create=True,
        cleanup_tmp_directories=True,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    """The newest finished step, or None."""
    return self.manager.latest_step()

  def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
    """Saves ``state`` (a pytree of arrays) and ``meta`` (JSON-able) at ``step``."""
    return self.manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                meta=ocp.args.JsonSave(meta)),
        force=force,
    )

  def restore(self, step: int, abstract_state):
    """Restores ``(state, meta)`` at ``step`` onto ``abstract_state``'s shapes and shardings."""
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    out = self.manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                meta=ocp.args.JsonRestore()),
    )
    return out["state"], out["meta"]

  def wait(self):
    """Blocks until pending asynchronous saves are finished."""
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()
