"""A trained run read back: the metadata every checkpoint holds (:class:`CheckpointMeta`), the
one refusal of a checkpoint or a table's result that is not the run a config describes, and a
run loaded for the tools (``evaluate``, ``sample``, ``inspect --workdir``, ``experiments/``).

``train`` saves and resumes through it. Nothing here trains; loading a run may prepare its
tokens in ``WORKDIR/data``, removed again if its checkpoint refuses them.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from cem_jax import checkpoint as checkpoint_lib
from cem_jax import config as config_lib
from cem_jax import data as data_lib
from cem_jax import energies, integrity, preflight
from cem_jax import steps as steps_lib
from cem_jax import workdir as workdir_lib
from cem_jax.data.prepared import TOKENIZER as TOKENIZER_FILE
from cem_jax.files import read_json, sha256_file
from cem_jax.version import NUMERICS_VERSION


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
  """The JSON metadata saved beside a checkpoint's arrays (:meth:`to_dict` gives the keys on
  disk, unchanged since checkpoints first held them, so every checkpoint saved so far loads).

  The defaults are what metadata that predates a field stands for: ``numerics_version`` and
  ``energy_digest_version`` 1 (saved before either was recorded); ``config`` None (saved
  before checkpoints held their config: ``config.json`` has it); ``data`` and ``energies``
  None (not recorded: not checked).

  Attributes:
    step: the step saved, also the data position (batches are a pure function of the step).
    seed: ``config.seed``.
    config: the resolved config (``config.to_dict()``).
    numerics_version: :data:`cem_jax.version.NUMERICS_VERSION` of the code that trained it.
    data: the tokens trained on (``Data.identity``).
    energies: the user energies' digests (:func:`cem_jax.energies.energy_digests`); a table's
      ``result.json`` calls them ``energy_digests`` (:func:`result_record`).
    energy_digest_version: the digest version ``energies`` were taken with.
    parameters_from: where the run's parameters started from, if not from its seed
      (``checkpoint.load_parameters_from``, :func:`open_parameters_source`): ``{"checkpoint":
      the step folder, "step": its step, "digest_sha256": the sha256 of its integrity digest
      file, or None}``; carried into every later checkpoint of the run.
  """

  step: int | None = None
  seed: int | None = None
  config: dict | None = None
  numerics_version: int = 1
  data: dict | None = None
  energies: dict | None = None
  energy_digest_version: int = 1
  parameters_from: dict | None = None

  @classmethod
  def saved_now(cls, step: int, seed: int, resolved: dict, data: dict | None,
                digests: dict, parameters_from: dict | None = None) -> CheckpointMeta:
    """What this code saves at ``step`` of the run of ``resolved`` (``config.to_dict()``)."""
    return cls(step=step, seed=seed, config=resolved,
               numerics_version=NUMERICS_VERSION, data=data, energies=digests,
               energy_digest_version=energies.DIGEST_VERSION, parameters_from=parameters_from)

  def to_dict(self) -> dict:
    return {"step": self.step, "data_position": self.step, "seed": self.seed,
            "config": self.config, "numerics_version": self.numerics_version,
            "data": self.data, "energies": self.energies,
            "energy_digest_version": self.energy_digest_version,
            "parameters_from": self.parameters_from}

  @classmethod
  def from_dict(cls, meta: dict, where: str = "a checkpoint") -> CheckpointMeta:
    """``meta`` as a checkpoint holds it; keys it lacks take the defaults, keys this code does
    not know are left out. A version written as a string of digits is read as its integer.

    Raises:
      ValueError: one line naming ``where``: ``meta`` is not an object, or a field is not of
        its type (an integer version or step, an object for ``config``, ``data``, ``energies``).
    """
    if not isinstance(meta, dict):
      raise ValueError(f"{where}: damaged metadata: a {type(meta).__name__}, not an object")
    known = {f.name for f in dataclasses.fields(cls)}
    fields = {k: v for k, v in meta.items() if k in known}
    for key in ("numerics_version", "energy_digest_version", "step", "seed"):
      value = fields.get(key)
      if isinstance(value, str) and value.isdigit():
        fields[key] = value = int(value)
      if key in fields and not (isinstance(value, int) and not isinstance(value, bool)
                                and value >= 0 or value is None and key in ("step", "seed")):
        raise ValueError(f"{where}: damaged metadata: {key}={value!r}; allowed: an integer "
                         ">= 0")
    for key in ("config", "data", "energies", "parameters_from"):
      if fields.get(key) is not None and not isinstance(fields[key], dict):
        raise ValueError(f"{where}: damaged metadata: {key} is a {type(fields[key]).__name__}, "
                         "not an object")
    return cls(**fields)


def read_meta(ckpt: checkpoint_lib.Checkpointer, step: int) -> CheckpointMeta:
  """The metadata of ``ckpt``'s checkpoint ``step``, without its arrays.

  Raises:
    ValueError: damaged metadata (one line naming the checkpoint's folder,
      :meth:`CheckpointMeta.from_dict`), or a ``step`` other than the folder's (hand-edited, or
      a step folder copied under another number: its arrays are another step's).
  """
  where = f"checkpoint {ckpt.step_dir(step)}"
  meta = CheckpointMeta.from_dict(ckpt.read_meta(step), where)
  if meta.step not in (None, step):
    raise ValueError(f"{where}: damaged metadata: step={meta.step}, saved as step {step}")
  return meta


def numerics_version_of(record: dict) -> int:
  """The numerics version a run's record states (a table's ``result.json``, the first line of
  its ``metrics.jsonl``): :data:`cem_jax.version.NUMERICS_VERSION` of the code that trained it;
  none recorded: 1, as for a checkpoint (:class:`CheckpointMeta`).

  Raises:
    ValueError, TypeError: a recorded version that is not an integer.
  """
  return int(record.get("numerics_version", CheckpointMeta.numerics_version))


def result_record(result: dict) -> CheckpointMeta:
  """A table's ``result.json`` as the record of the run it holds: its ``energy_digests`` and
  ``energy_digest_version`` (written together from the first: one lacking the version is
  compared at this code's) and its ``numerics_version`` (none: 1)."""
  return CheckpointMeta(numerics_version=numerics_version_of(result),
                        energies=result.get("energy_digests"),
                        energy_digest_version=result.get("energy_digest_version",
                                                         energies.DIGEST_VERSION))


def edited_energies(meta: CheckpointMeta, config, where: str,
                    now: dict | None = None) -> list[str]:
  """The user energies of ``config`` edited since the run of ``meta`` recorded them, one line
  each (:func:`cem_jax.energies.changed_energies`; ``now``: ``config``'s digests if already
  taken; ``where``: the checkpoint or file of the record, for the error).

  Raises:
    ValueError: ``where`` records a digest version this code does not know.
  """
  return energies.changed_energies(meta.energies, meta.energy_digest_version, config, now,
                                   where)


def refuse_other_run(meta: CheckpointMeta, config: ml_collections.ConfigDict, checkpoint: str,
                     energies_now: dict | None = None) -> None:
  """Refuses to resume the checkpoint in folder ``checkpoint`` (metadata ``meta``) as the run
  of ``config``: trained under another numerics version, the rest of the run would see
  another data order and other eval windows, and ``tables`` would count the mix as a run of
  this version; as another model (a ``model.*`` key other than
  :data:`cem_jax.config.RESUME_MAY_CHANGE`, :func:`cem_jax.config.model_changes`, or a user
  energy edited since; ``energies_now``: ``config``'s digests if already taken), parameters
  of the same shapes would train on under another energy, mask or step rule without an error.
  A checkpoint without a config (saved before they held one) is compared by its energies.

  Raises:
    ValueError: one line naming the checkpoint and both numerics versions, or every changed
      ``model.*`` key or energy; or as :func:`edited_energies`.
  """
  if meta.numerics_version != NUMERICS_VERSION:
    raise ValueError(
        f"checkpoint {checkpoint} was trained under numerics version {meta.numerics_version}, "
        f"this code is version {NUMERICS_VERSION} (cem_jax/version.py says what changed): "
        "resumed, the run would mix the two; finish it with the code it started with, or "
        "train in a new --workdir")
  changes = [] if meta.config is None else config_lib.model_changes(meta.config, config)
  changes += edited_energies(meta, config, f"checkpoint {checkpoint}", energies_now)
  if changes:
    raise ValueError(f"checkpoint {checkpoint} is another model ({', '.join(changes)}): "
                     "resume with the model it was trained as, or train in a new --workdir")


def refuse_edited_energies(meta: CheckpointMeta, config, checkpoint: str, fix: str) -> None:
  """Refuses to load the checkpoint in folder ``checkpoint`` (metadata ``meta``) as ``config``
  when a user energy was edited since it was saved: its parameters under the edited energy
  are a model nobody trained. ``fix``: what the tool's user should do.

  Raises:
    ValueError: one line naming the checkpoint, the energies and ``fix``; or as
      :func:`edited_energies`.
  """
  changed = edited_energies(meta, config, f"checkpoint {checkpoint}")
  if changed:
    raise ValueError(f"checkpoint {checkpoint} was trained with another version of its energy "
                     f"({', '.join(changed)}): {fix}")


def check_data(meta: CheckpointMeta, data, checkpoint: str, workdir: str,
               prepared_before: frozenset[str] | None) -> None:
  """Refuses ``data`` if they are not the tokens the checkpoint in folder ``checkpoint`` was
  trained on (:func:`cem_jax.data.check_same_data`), after removing what ``WORKDIR/data``
  gained since ``prepared_before`` (:func:`cem_jax.workdir.prepared_folders` taken before the
  data were built): only a run of this workdir would read those tokens, and its checkpoint
  refuses them.

  Raises:
    ValueError: as :func:`cem_jax.data.check_same_data`.
  """
  try:
    data_lib.check_same_data(meta.data, data.identity, checkpoint)
  except ValueError:
    workdir_lib.remove_prepared_since(workdir, prepared_before)
    raise


def run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config of the run in ``workdir``, from its ``config.json``
  (:func:`cem_jax.config.from_saved`).

  Raises:
    ValueError: no readable ``config.json`` there, or one with fields this version does not
      know (one line naming the file).
  """
  path = _config_json(workdir)
  return config_lib.from_saved(read_json(path, "restore it from the run's command"), path)


def _config_json(workdir: str) -> str:
  """The path of ``workdir``'s ``config.json``, which every run's folder holds.

  Raises:
    ValueError: there is none (one line naming ``--workdir``).
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"--workdir={workdir}: no config.json (not a run's folder, or its start "
                     "failed); give the folder main trained in")
  return path


def newest_meta(workdir: str) -> tuple[str | None, CheckpointMeta]:
  """``(folder, metadata)`` of the newest intact checkpoint in ``workdir``, read without
  touching the run (it may be training); ``(None, CheckpointMeta())`` without one. A step the
  run prunes while it is chosen or read is chosen again, as :func:`load_run` does.

  Raises:
    CheckpointError: checkpoints exist but none is intact; the run pruned every step chosen
      (as :func:`load_run`).
  """
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return None, CheckpointMeta()
  ckpt = _reader(directory)
  try:
    step, meta = _read_newest(ckpt, workdir, lambda step: read_meta(ckpt, step))
  finally:
    ckpt.close()
  return (None, CheckpointMeta()) if step is None else (ckpt.step_dir(step), meta)


# When a reader gives up on a run that prunes each step it chooses before it is read (a run
# still training with checkpoint.keep=1 deletes each step as soon as the next one commits,
# every step with checkpoint.every_steps=1): after PRUNED_TRIES steps in a row *and*
# PRUNED_SECONDS. Each try costs about one restore (0.2-0.4 s for the tests' tiny model on a
# CPU); beside such a run, 2 readers on 2 busy cores needed up to 12 tries a load, so a bound
# of tries alone (20: 5-8 s) gave up on a reader that wins within seconds more. A read slower
# than every save never wins: it says so after the seconds.
PRUNED_TRIES = 20
PRUNED_SECONDS = 30.0


def load_run(workdir: str, require=None, attention_impl: str | None = None):
  """Returns ``(config, data, graphdef, params, step)`` of the newest checkpoint in ``workdir``.

  The model is rebuilt from the config saved *in that checkpoint*, not from
  ``config.json``, which every start that trains rewrites (a run still training may be past
  that checkpoint, or the file edited by hand). Fields missing from an older run's config take
  today's defaults. The parameters alone are restored (the optimizer state beside them is
  neither read nor allocated), as soon as that config is known (the model's
  shapes take its ``data.vocab_size``, which every tokenizer it may have trained with has):
  a run still training (``checkpoint.keep`` 1, a save each step) may prune the chosen step at
  any moment, so the time between choosing it and reading it is the config's checks and the
  restore (on a try after a pruning, the reads alone: :func:`_restore_step`), not the data's
  build (a tokenizer trained, seconds); a step pruned while it was
  chosen or before it was read is chosen again, the newest, until :data:`PRUNED_TRIES` in a
  row and :data:`PRUNED_SECONDS` (:func:`_read_newest`), what Orbax reported of its read
  dropped (:class:`cem_jax.checkpoint.HeldReads`). The
  data are then the tokens the checkpoint records it was trained on, read from the run's
  ``data.prepared_dir`` or its ``data/`` folder, so the raw text (and a given tokenizer file)
  may have moved; otherwise they are built from the config, and must be the tokens the
  checkpoint records. ``require``, if given, is called with the checkpoint's config before
  the parameters and the data are read, to refuse a run at once by raising ValueError.
  ``attention_impl`` replaces the run's ``model.attention_impl`` (None: the run's own), e.g.
  'auto' to evaluate on a CPU a run trained with 'cudnn' on a GPU: the kernel computes the
  same function and holds no parameter (``config.RESUME_MAY_CHANGE``). A user energy the
  start-up checks refuse for what it computes (a look-ahead, a closed form that is not its
  gradient, ...: :class:`cem_jax.energy_checks.EnergyRefusal`) is named in a warning and the
  run is read: it was trained so, perhaps before the check existed, and evaluating it is how
  to see what that did; resuming it is refused, as training is.

  Raises:
    FileNotFoundError: no checkpoint in ``workdir``.
    CheckpointError: checkpoints exist but none is intact; the run pruned each step chosen
      in a row, at least :data:`PRUNED_TRIES` over :data:`PRUNED_SECONDS`, before it was read
      (one line naming ``workdir``, the tries and seconds, the first and last step, and what
      to do).
    ValueError: no ``config.json`` in ``workdir`` (as :func:`run_config`); the saved config
      has fields this version of cem_jax does not know, or fails validation (a user energy
      that cannot be imported, or fails in a layout the model calls it with); a user energy was
      edited since the checkpoint was saved (:func:`refuse_edited_energies`); the data are not
      those the checkpoint was trained on.
  """
  path = _config_json(workdir)
  # Read-only: the run may still be training here; its in-flight saves must not be touched.
  ckpt = _reader(os.path.join(workdir, "checkpoints"))
  built = {}  # what the tries of this load share (_restore_step)
  try:
    step, restored = _read_newest(ckpt, workdir, lambda step: _restore_step(
        ckpt, step, path, require, attention_impl, built))
  finally:
    ckpt.close()
  if step is None:  # found before the data are built (a tokenizer trained for nothing)
    raise FileNotFoundError(f"--workdir={workdir}: no checkpoint in {ckpt.directory}")
  meta, config, graphdef, params = restored
  return config, _data_of(config, meta, workdir, ckpt.step_dir(step)), graphdef, params, step


class _PrunedEachStep(checkpoint_lib.CheckpointError):
  """:func:`_read_newest` gave up: the run pruned each step it chose before it was read."""


def _read_newest(ckpt, workdir: str, read):
  """``(step, read(step))`` of ``ckpt``'s newest intact step, ``(None, None)`` if it has
  none; a step pruned while it is chosen or read (by a run still training in ``workdir``) is
  chosen again, the newest, until :data:`PRUNED_TRIES` in a row and :data:`PRUNED_SECONDS`,
  what Orbax reported of each pruned read dropped (:class:`cem_jax.checkpoint.HeldReads`).

  Raises:
    CheckpointError: every step chosen was pruned (one line naming ``workdir``, the tries and
      the seconds, the first and last step, and what to do), or none is intact.
    what ``read`` raises for a step still there, as it is.
  """
  pruned, started = [], time.monotonic()

  def again(step: int, error: Exception) -> None:
    """Records ``step`` as pruned while chosen or read: raises ``error``'s one line once the
    tries and the seconds are spent."""
    pruned.append(step)
    seconds = time.monotonic() - started
    if len(pruned) >= PRUNED_TRIES and seconds >= PRUNED_SECONDS:
      raise _PrunedEachStep(
          f"--workdir={workdir}: the run pruned each of the {len(pruned)} steps chosen in "
          f"a row over {seconds:.1f} s (the first step {pruned[0]}, the last {pruned[-1]}) "
          "before it could be read: a run still training keeps only its newest "
          "checkpoint.keep steps and saves faster than they are read here; read it once it "
          "has stopped, or train with --config.checkpoint.keep=2 or more") from error
    held.drop()

  # What Orbax reports of a read that a pruning cut (up to a hundred lines of tracebacks) is
  # dropped when the newest step is read again; what the last read reported, if it fails too,
  # or a read that fails otherwise, is shown with its error.
  with checkpoint_lib.HeldReads() as held:
    while True:
      listed = integrity.step_folders(ckpt.directory)
      # A step pruned while it was chosen fails as it happens to: Orbax's FileNotFoundError
      # (its metadata gone), no step listed, or, its folder gone while it was verified, none
      # is intact (keep=1); told by a step folder listed before being gone now.
      try:
        step = ckpt.restorable_step()  # the newest *verified* step
      except (checkpoint_lib.CheckpointError, OSError) as e:
        gone = listed - integrity.step_folders(ckpt.directory)
        if not gone:
          raise
        again(max(gone), e)
        continue
      if step is None:
        gone = listed - integrity.step_folders(ckpt.directory)
        if not gone:
          return None, None
        again(max(gone), FileNotFoundError(f"no checkpoint in {ckpt.directory}"))
        continue
      try:
        return step, read(step)
      # Any type: a step deleted part way through its read fails in Orbax as it happens to
      # (a FileNotFoundError, tensorstore's ValueError, an AttributeError on metadata it found
      # missing); told by the step's folder being gone, never by the wording.
      except Exception as e:
        if os.path.isdir(ckpt.step_dir(step)):
          raise
        again(step, e)


def _reader(directory: str) -> checkpoint_lib.Checkpointer:
  """A read-only Checkpointer of ``directory``, made again while a step Orbax lists as it
  starts is pruned meanwhile (its FileNotFoundError, a step's metadata gone, as
  :func:`_read_newest` finds it), up to :data:`PRUNED_TRIES` times."""
  for _ in range(PRUNED_TRIES - 1):
    listed = integrity.step_folders(directory)
    try:
      return checkpoint_lib.Checkpointer(directory, async_save=False, read_only=True)
    except OSError:
      if not listed - integrity.step_folders(directory):
        raise
  return checkpoint_lib.Checkpointer(directory, async_save=False, read_only=True)


def _restore_step(ckpt, step: int, config_json: str, require=None,
                  attention_impl: str | None = None, built: dict | None = None):
  """``(meta, config, graphdef, params)`` of ``ckpt``'s step ``step``, without the data.

  ``built``: a dict :func:`load_run` keeps across its tries, holding the config, the model's
  shapes and the restore target of the step it read last, taken again (its checks passed)
  for a step saved with the same config and energies, as a run's steps are: a try after a
  pruning is then two reads, the window a run still training can cut again (building the
  model's shapes took 0.02-0.16 s of a 0.2-0.4 s try beside a keep=1 run)."""
  meta = read_meta(ckpt, step)
  saved, where = meta.config, f"checkpoint {ckpt.step_dir(step)}"
  if saved is None:  # saved before checkpoints held their config
    where = config_json
    saved = read_json(config_json, "restore it from the run's command")
  key = json.dumps([saved, meta.energies, meta.energy_digest_version], sort_keys=True)
  if built is not None and built.get("key") == key:
    config, graphdef, target = built["value"]
  else:
    config = config_lib.from_saved(saved, where)
    if attention_impl is not None:
      config.model.attention_impl = attention_impl
    preflight.check(config, saved_run=True)
    refuse_edited_energies(meta, config, ckpt.step_dir(step),
                           "load it with the energy it was trained with")
    if require is not None:
      require(config)
    # The model as shapes only: the restore needs no initial values (building the model and
    # its optimizer state eagerly took seconds, only to be overwritten).
    graphdef, params = nnx.split(nnx.eval_shape(
        lambda: steps_lib.build_model(config, config.data.vocab_size)), nnx.Param)
    target = restore_target(params)
    if built is not None:
      built.update(key=key, value=(config, graphdef, target))
  # The parameters alone: the optimizer state (Adam's two moments, twice their size) is
  # neither read nor allocated, and need not fit this config's optimizer.
  state, _ = ckpt.restore(step, target, partial=True)
  return meta, config, graphdef, state["params"]


def _data_of(config, meta: CheckpointMeta, workdir: str, checkpoint: str):
  """The data of the run of ``config`` whose checkpoint in folder ``checkpoint`` (metadata
  ``meta``) :func:`load_run` restored: the tokens it records, or those built from ``config``
  (whose ``data`` it may point at the prepared folder found)."""
  found = _prepared_data_of(workdir, config.data.prepared_dir, meta.data)
  if found:
    # The tokens the checkpoint was trained on: the raw text and a given tokenizer file need
    # not be where they were (or exist at all).
    d = config.data
    d.prepared_dir, d.files, d.tfds_name, d.tokenizer = found, "", "", ""
  held = workdir_lib.prepared_folders(workdir)
  data = data_lib.build_data(config, workdir)
  check_data(meta, data, checkpoint, workdir, held)
  return data


def restore_target(params) -> dict:
  """``{'params': params}`` (an ``nnx.State`` of Params as shapes only: ``nnx.eval_shape`` of
  the model) as ``jax.ShapeDtypeStruct`` leaves on this process's first device, where a built
  model's arrays were: the target :meth:`cem_jax.checkpoint.Checkpointer.restore` reads a
  step's parameters onto (``partial``: its optimizer state left on disk), with nothing
  initialised, allocated or compiled."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return {"params": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), params)}


def _prepared_data_of(workdir: str, prepared_dir: str, identity: dict | None) -> str | None:
  """The prepared folder whose tokens are ``identity`` (a checkpoint's record of what it was
  trained on): the run's ``data.prepared_dir`` or one under ``WORKDIR/data``; None if none."""
  if not identity:
    return None
  candidates = sorted(glob.glob(os.path.join(workdir, "data", "*")))
  if prepared_dir:
    candidates.insert(0, os.path.expanduser(prepared_dir))
  for folder in candidates:
    try:
      # Sizes only: build_data verifies every sha256 of the folder it opens.
      if data_lib.data_identity(data_lib.PreparedData.open_manifest(folder, verify=False)
                                ) == identity:
        return folder
    except ValueError:
      continue  # not a (complete, intact) prepared folder: not the one
  return None


# What checkpoint.load_parameters_from may name, as each of its refusals ends.
PARAMETERS_FROM_ALLOWED = ("allowed: another run's --workdir (its newest intact checkpoint) or "
                           "one of its step folders (WORKDIR/checkpoints/<step>), of the same "
                           "parameter shapes and tokenizer; '' to initialise from seed")


@dataclasses.dataclass
class ParametersSource:
  """A checkpoint step checked to start a fresh run's parameters from
  (:func:`open_parameters_source`).

  Attributes:
    ckpt: the read-only Checkpointer of its checkpoints folder (:meth:`close` it).
    step: the step.
    meta: its metadata.
    record: what the run's checkpoints record of it (``CheckpointMeta.parameters_from``).
    field: ``checkpoint.load_parameters_from=...`` as the refusals name it.
  """

  ckpt: checkpoint_lib.Checkpointer
  step: int
  meta: CheckpointMeta
  record: dict
  field: str

  def close(self) -> None:
    self.ckpt.close()


def _source_folder(path: str) -> tuple[str | None, int | None]:
  """``(checkpoints folder, step)`` that ``path`` (absolute, a folder) names: a run's folder
  (its ``checkpoints/``, step None: the newest intact), one step folder of a checkpoints
  folder (one holding ``digests/``), or such a checkpoints folder itself (step None);
  ``(None, None)`` for anything else."""
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return os.path.join(path, "checkpoints"), None
  named = integrity.step_of_dir(path)
  if named and os.path.isdir(os.path.join(named[0], checkpoint_lib.DIGEST_DIR)):
    return named
  if os.path.isdir(os.path.join(path, checkpoint_lib.DIGEST_DIR)):
    return path, None
  return None, None


def open_parameters_source(config: ml_collections.ConfigDict,
                           workdir: str | None = None) -> ParametersSource:
  """Opens and checks the checkpoint ``config.checkpoint.load_parameters_from`` names, for a
  fresh run of ``config`` to start from its parameters: the step (the newest intact one of a
  run's folder, or the step folder given, verified against its digest), its metadata, its
  ``data.vocab_size`` and every parameter's path, shape and dtype against this config's model
  (built as shapes only: nothing is read, allocated or compiled). ``model.*`` fields that
  differ and change no shape (``model.num_steps``, an energy, ``attention_impl``...) are
  logged, as is another numerics version. The tokenizer is checked once the data are built
  (:func:`check_source_tokenizer`); the parameters are read by :func:`load_parameters`.

  Args:
    config: the run's config.
    workdir: the run's own ``--workdir``, if any: a source inside it is refused as such (at a
      fresh start it holds no checkpoint yet).

  Returns:
    A :class:`ParametersSource` (the caller closes it).

  Raises:
    ValueError: one line naming ``checkpoint.load_parameters_from``, the path, the problem and
      what is allowed: the run's own ``workdir`` (or a folder in it); no such folder (with
      several processes: on any of them, all raising together); neither a run's folder nor a
      step folder; no checkpoint there, none intact, or the step folder given damaged or not
      committed; the step folder given deleted while it was read, or (a run's folder) each
      newest step pruned before it was read, as :func:`load_run` gives up (a source still training);
      another ``data.vocab_size``; the first parameter path whose shape or dtype differs (or
      that only one side has), with both; damaged metadata (not an object, a field of another
      type, or a ``step`` other than its folder's).
  """
  given = config.checkpoint.load_parameters_from
  field = f"checkpoint.load_parameters_from={given!r}"

  def refuse(problem: str):
    raise ValueError(f"{field}: {problem}; {PARAMETERS_FROM_ALLOWED}")

  path = os.path.abspath(os.path.expanduser(given))
  seen = os.path.isdir(path)
  if jax.process_count() > 1:
    # Before any other refusal: a process that refused alone left the others waiting in the
    # first collective (the choice of the step, the data) until JAX's timeout.
    from jax.experimental import multihost_utils

    seen_by = np.asarray(multihost_utils.process_allgather(np.int32(seen))).reshape(-1)
    if seen and not seen_by.all():
      refuse(f"process {int(np.argmin(seen_by))} of {len(seen_by)} sees no folder there (a "
             "path on one host's own disk?); it must be one every process sees at that path")
  if workdir is not None:
    own = os.path.realpath(workdir)
    if os.path.commonpath([os.path.realpath(path), own]) == own:
      refuse(f"that is this run's own --workdir ({workdir}), which a fresh run cannot start "
             "from (it holds no checkpoint of its own yet)")
  if not seen:
    refuse("no such folder" if not os.path.lexists(path) else "not a folder")
  directory, step = _source_folder(path)
  if directory is None:
    refuse("neither a run's folder (it holds no checkpoints/) nor a checkpoint step folder")
  ckpt = _reader(directory)

  def read(step: int) -> tuple[CheckpointMeta, dict]:
    try:
      meta = read_meta(ckpt, step)
    except ValueError as e:  # read_meta's one line, naming the step's folder
      refuse(str(e))
    _check_source_model(config, ckpt, step, meta, refuse)
    digest = integrity.digest_path(directory, step)
    return meta, {"checkpoint": ckpt.step_dir(step), "step": step,
                  "digest_sha256": sha256_file(digest) if os.path.isfile(digest) else None}

  try:
    if step is None:
      # A source still training prunes its old steps: one pruned while it is chosen or read
      # is chosen again, the newest (as load_run reads a run), not a raw error of Orbax's.
      try:
        step, read_back = _read_newest(ckpt, os.path.dirname(directory), read)
      except _PrunedEachStep as e:
        refuse(str(e))
      except checkpoint_lib.CheckpointError:  # restorable_step warned of each step's damage
        refuse(f"no intact checkpoint in {directory} (the warnings above name each step's "
               "problem)")
      if step is None:
        refuse(f"no checkpoint in {directory}")
    else:  # checked against its digest (a save cut short, emptied, truncated, flipped)
      problems = ckpt.verify(step)
      if problems:
        refuse(f"a damaged step ({problems[0]})")
      try:
        read_back = read(step)
      except Exception:  # any type, as _read_newest tells a pruning: by the folder gone
        if os.path.isdir(ckpt.step_dir(step)):
          raise
        refuse(f"step {step} ({ckpt.step_dir(step)}) was deleted while it was read (a run "
               "still training keeps only its newest checkpoint.keep steps); name a step "
               "folder it keeps, or start again once it has stopped")
    meta, record = read_back
  except BaseException:
    ckpt.close()
    raise
  return ParametersSource(ckpt=ckpt, step=step, meta=meta, record=record, field=field)


def _shape_text(entry: tuple | None) -> str:
  return "absent" if entry is None else f"{entry[0]} {entry[1]}"


def _check_source_model(config: ml_collections.ConfigDict, ckpt, step: int,
                        meta: CheckpointMeta, refuse) -> None:
  """Refuses (``refuse(problem)``) step ``step`` of ``ckpt`` (metadata ``meta``) as the
  parameters of ``config``'s model: another ``data.vocab_size``, or a parameter of another
  path, shape or dtype (the first in path order, with both sides); logs the model fields that
  differ but change no shape."""
  where = ckpt.step_dir(step)
  if meta.config is not None:
    vocab = config_lib.with_defaults(meta.config)["data.vocab_size"]
    if vocab != config.data.vocab_size:
      refuse(f"step {step} ({where}) was trained with data.vocab_size={vocab}, this run has "
             f"data.vocab_size={config.data.vocab_size} (its embeddings would mean other "
             "tokens)")
  _, params = nnx.split(nnx.eval_shape(
      lambda: steps_lib.build_model(config, config.data.vocab_size)), nnx.Param)
  want = checkpoint_lib.flat_arrays(restore_target(params))
  saved = {k: v for k, v in ckpt.saved_arrays(step).items() if k.split("/")[0] == "params"}
  differ = [k for k in sorted(set(want) | set(saved)) if want.get(k) != saved.get(k)]
  if differ:
    first = differ[0]
    more = f" ({len(differ)} parameters differ)" if len(differ) > 1 else ""
    refuse(f"another model: parameter {first} is {_shape_text(saved.get(first))} in step "
           f"{step} ({where}), {_shape_text(want.get(first))} in this config's model{more}")
  changes = [] if meta.config is None else config_lib.model_changes(meta.config, config)
  changes += edited_energies(meta, config, f"checkpoint {where}")
  if changes:
    logging.warning("checkpoint.load_parameters_from: this run's model differs from that of "
                    "%s in fields that change no parameter shape (allowed): %s", where,
                    ", ".join(changes))
  if meta.numerics_version != NUMERICS_VERSION:
    logging.info("checkpoint.load_parameters_from: %s was trained under numerics version %d, "
                 "this code is version %d", where, meta.numerics_version, NUMERICS_VERSION)


def check_source_tokenizer(source: ParametersSource, data, workdir: str,
                           prepared_before: frozenset[str] | None) -> None:
  """Refuses ``source`` for a run on ``data`` when its step was trained with another
  tokenizer (its embeddings would mean other tokens), after removing what ``WORKDIR/data``
  gained since ``prepared_before`` (as :func:`check_data`). Other text under the same
  tokenizer is the point of fine-tuning: logged. A source that recorded no data is not
  checked.

  Raises:
    ValueError: one line naming ``checkpoint.load_parameters_from``, both tokenizers' sha256
      prefixes and, where the source's folder holds it, the tokenizer file to give as
      ``data.tokenizer``.
  """
  saved, now = source.meta.data or {}, data.identity or {}
  theirs, ours = saved.get("tokenizer_sha256"), now.get("tokenizer_sha256")
  if theirs and ours and theirs != ours:
    workdir_lib.remove_prepared_since(workdir, prepared_before)
    found = _tokenizer_file(source, theirs)
    fix = (f"set data.tokenizer={found} (the source's)" if found else
           "set data.tokenizer to the tokenizer file the source trained with")
    raise ValueError(
        f"{source.field}: step {source.step} ({source.record['checkpoint']}) was trained with "
        f"another tokenizer (tokenizer_sha256 {theirs[:12]}, this run's {ours[:12]}): its "
        f"embeddings would mean other tokens; {fix}; {PARAMETERS_FROM_ALLOWED}")
  if saved and any(saved.get(k) != now.get(k) for k in ("train_sha256", "validation_sha256")):
    logging.info("checkpoint.load_parameters_from: this run trains on other text than %s "
                 "did (under the same tokenizer)", source.record["checkpoint"])


def _tokenizer_file(source: ParametersSource, sha256: str) -> str | None:
  """The tokenizer file of sha256 ``sha256`` in the source run's prepared data (its
  ``data.prepared_dir`` or ``WORKDIR/data/*``), None if none there."""
  workdir = os.path.dirname(source.ckpt.directory)
  prepared = (config_lib.with_defaults(source.meta.config or {})["data.prepared_dir"],)
  for folder in [*filter(None, prepared), *sorted(glob.glob(os.path.join(workdir, "data", "*")))]:
    path = os.path.join(os.path.expanduser(folder), TOKENIZER_FILE)
    try:
      if sha256_file(path) == sha256:
        return path
    except OSError:
      continue
  return None


def load_parameters(source: ParametersSource, params):
  """The parameters of ``source``'s step, read onto ``params``' shardings (an ``nnx.State``
  of this run's freshly initialised Params: the mesh may differ from the source's); its
  optimizer state is neither read nor allocated (:meth:`cem_jax.checkpoint.Checkpointer.
  restore` with ``partial``, as :func:`load_run` reads).

  Raises:
    ValueError: the step was deleted since :func:`open_parameters_source` chose it (a source
      run still training prunes its steps past ``checkpoint.keep``): one line naming
      ``checkpoint.load_parameters_from`` and what to do.
    CheckpointError: the step no longer fits (as ``Checkpointer.check_compatible``).
  """
  try:
    state, _ = source.ckpt.restore(source.step, {"params": params}, partial=True)
  # Any type: a step deleted under its read fails in Orbax as it happens to; told by its
  # folder being gone (as _read_newest tells it), never by the wording.
  except Exception as e:
    if os.path.isdir(source.record["checkpoint"]):
      raise
    raise ValueError(
        f"{source.field}: step {source.step} ({source.record['checkpoint']}) was deleted while "
        "this run started (a run still training keeps only its newest checkpoint.keep steps); "
        "name a step folder it keeps, or start again once it has stopped") from e
  return state["params"]
