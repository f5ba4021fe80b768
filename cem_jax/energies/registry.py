"""Energies by name: built-ins, user registrations and ``'module:function'`` paths."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable

import jax
from absl import logging

from cem_jax import config as config_lib
from cem_jax import errors
from cem_jax.energies import digest, elementwise, interaction
from cem_jax.energies.digest import DIGEST_VERSION

KINDS = ("attention", "mlp")
# Errors name a kind with its article; both are read with a vowel sound ("an em-el-pee").
_A = {"attention": "an attention", "mlp": "an mlp"}


@dataclasses.dataclass(frozen=True)
class EnergySpec:
  """An energy for one slot of a CEM block.

  Attributes:
    name: registry name or ``'module:function'`` path.
    kind: ``'attention'`` (gets the attention parameters, context = keys) or ``'mlp'``
      (gets the MLP parameters, context = gate input).
    energy: ``energy(y, context, params, aux) -> []`` (see ``cem_jax.energies.base``).
    fused_update: closed-form ``-∇_y energy`` with the same arguments, or None (then the
      update is derived by ``jax.grad``).
    builtin: True for the energies cem_jax registers itself, whose closed forms
      tests/test_energies.py verifies; every other closed form is compared with ``jax.grad``
      of its energy at start-up (:func:`cem_jax.energy_checks.validate_energies`).
  """

  name: str
  kind: str
  energy: Callable
  fused_update: Callable | None = None
  builtin: bool = False


_REGISTRY: dict[str, EnergySpec] = {}


def register(name: str, kind: str, energy: Callable, fused_update: Callable | None = None):
  """Registers ``energy`` under ``name`` for slot ``kind``; returns its :class:`EnergySpec`.

  The name lives in this process only: training can use it when the config file (``--config``)
  or a script registers it first, but ``evaluate``, ``sample`` and ``tables`` reload the run
  in a fresh process, where the name is unknown. Name the energy by a ``'file.py:function'``
  path to reload the run. A ``fused_update`` must equal ``-jax.grad(energy)`` w.r.t. ``y``;
  start-up checks it numerically (:mod:`cem_jax.energy_checks`).

  Raises:
    ValueError: ``kind`` not in ``KINDS`` or ``name`` already taken.
  """
  return _register(name, kind, energy, fused_update, builtin=False)


def _register(name, kind, energy, fused_update, *, builtin: bool) -> EnergySpec:
  if kind not in KINDS:
    raise ValueError(f"energy kind={kind!r}; allowed: {', '.join(KINDS)}")
  if name in _REGISTRY:
    raise ValueError(f"energy name {name!r} is already registered")
  spec = EnergySpec(name, kind, energy, fused_update, builtin)
  if not builtin:  # what it reads, before anything traces it (cem_jax.energies.digest)
    digest.pin(energy)
    digest.pin(fused_update)
  _REGISTRY[name] = spec
  return spec


def _import(module_name: str, where: str):
  """Imports ``package.module`` or a ``path/to/file.py`` (relative to the working directory).

  Raises:
    ValueError: one line naming ``where``: no such file or module, an import that fails, or
      one that changes ``jax_enable_x64`` (the flag is set back).
  """
  x64 = jax.config.jax_enable_x64
  try:
    module = _import_module(module_name, where)
  finally:  # also when the import fails after turning it on: the process goes on (tests, notebooks)
    changed = jax.config.jax_enable_x64 != x64
    if changed:
      jax.config.update("jax_enable_x64", x64)
  if changed:
    # Every array the run makes would change its default dtype (int64 tokens, float64
    # constants): the numbers and memory of another program.
    sys.modules.pop(module.__name__, None)
    raise ValueError(f"{where}: importing {module_name} set jax_enable_x64="
                     f"{not x64}, which would change the default dtype of every array in the "
                     "run; remove the jax.config.update from it (an energy gets y and its "
                     "parameters in model.dtype)")
  return module


def _import_module(module_name: str, where: str):
  if module_name.endswith(".py"):
    path = os.path.abspath(module_name)
    if not os.path.isfile(path):
      raise ValueError(f"{where}: file {path} does not exist")
    unique = "cem_jax_user_energy_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if unique in sys.modules:
      return sys.modules[unique]
    spec = importlib.util.spec_from_file_location(unique, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[unique] = module
    try:
      spec.loader.exec_module(module)
    except Exception as e:
      del sys.modules[unique]
      raise ValueError(f"{where}: importing {path} failed: {errors.one_line(e)}") from e
    return module
  try:
    return importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"{where}: cannot import module {module_name!r} "
                     f"({errors.first_line(e)})") from e


# In cem_jax.config (no jax there: tables resolves its rows' configs before jax's import);
# named here too, beside the lookup of the names they rewrite.
absolute_name = config_lib.absolute_energy_name
absolute_paths = config_lib.absolute_energy_paths


def names(kind: str | None = None) -> list[str]:
  """Registered names (of one ``kind`` if given), sorted."""
  return sorted(n for n, s in _REGISTRY.items() if kind is None or s.kind == kind)


def _functions_hint(module, fn_name: str, found) -> str:
  """What the module has instead, for a misspelt or non-function name: the type of what
  ``fn_name`` is, and the module's own public functions (not its imports, not closed forms)."""
  own = sorted(n for n, v in vars(module).items()
               if inspect.isfunction(v) and v.__module__ == module.__name__
               and not n.startswith("_") and not n.endswith("_fused_update"))
  parts = [f"{fn_name!r} is {type(found).__name__}"] if found is not None else []
  parts.append(f"its functions: {', '.join(own)}" if own else "it defines no function")
  return f" ({'; '.join(parts)})"


def get(name: str, kind: str, field: str = "energy") -> EnergySpec:
  """Looks up ``name`` for slot ``kind``.

  ``name`` is a registry name, ``'package.module:function'`` or ``'path/to/file.py:function'``
  (relative to the working directory). A path names a plain function
  ``energy(y, context, params, aux) -> scalar``; if the module also defines
  ``<function>_fused_update(y, context, params, aux)``, that is the closed form: it must
  return ``-jax.grad(energy)`` w.r.t. ``y`` (``η`` included, since the energy carries it), and
  :func:`cem_jax.energy_checks.validate_energies` refuses one that does not.

  Args:
    name: what the config says.
    kind: the slot, ``'attention'`` or ``'mlp'``.
    field: the config field, for error messages (e.g. ``'model.attention_energy'``).
  Raises:
    ValueError: unknown name, unimportable path, or an energy registered for the other slot.
  """
  if ":" in name:
    module_name, _, fn_name = name.rpartition(":")
    module = _import(module_name, f"{field}={name!r}")
    fn = getattr(module, fn_name, None)
    if not callable(fn):
      # '__main__' is whichever program runs: the script that trained is not it in evaluate.
      hint = (f" (__main__ is the program running, {getattr(module, '__file__', 'no file')}; "
              "name a function of a script by its 'file.py:function')"
              if module_name == "__main__" else _functions_hint(module, fn_name, fn))
      raise ValueError(f"{field}={name!r}: module {module_name!r} has no function {fn_name!r}"
                       f"{hint}")
    fused = getattr(module, f"{fn_name}_fused_update", None)
    fused = fused if callable(fused) else None
    digest.pin(fn)  # what it reads, before anything traces it (cem_jax.energies.digest)
    digest.pin(fused)
    return EnergySpec(name, kind, fn, fused)
  spec = _REGISTRY.get(name)
  if spec is None:
    raise ValueError(
        f"{field}={name!r} is not a registered {kind} energy; allowed: "
        f"{', '.join(names(kind))}, or a 'package.module:function' or 'path/to/file.py:function'"
        " (a name from cem_jax.energies.register exists only in the process that registered "
        "it: a run that evaluate, sample or tables reload must be trained with the energy "
        "named by its 'file.py:function')"
    )
  if spec.kind != kind:
    raise ValueError(f"{field}={name!r} is {_A[spec.kind]} energy, not {_A[kind]} energy")
  return spec


def only_builtins(model_config) -> bool:
  """True when every energy a model of ``model_config`` uses is a built-in (a Llama block
  uses none): the energies whose operations :func:`cem_jax.model_stats.flops_per_token`
  counts. A user energy's own operations are not modelled, so FLOPs and MFU of its model are
  not known.

  Raises:
    ValueError: an unknown energy name (as :func:`get`).
  """
  m = model_config
  if m.block != "cem":
    return True
  slots = [("attention", m.cem_attention), ("mlp", m.cem_mlp)]
  return all(get(m[f"{kind}_energy"], kind, f"model.{kind}_energy").builtin
             for kind, used in slots if used)


def source_digest(name: str, kind: str, field: str = "energy", version: int = DIGEST_VERSION
                  ) -> str | None:
  """sha256 of what pins energy ``name``'s function and its closed form: their source, and
  (``version`` 2, the default) the arguments, defaults, closure cells, module-level
  constants and same-module helpers they read (:func:`cem_jax.energies.digest.texts`, taken
  when the energy was first looked up in this process; not the whole file: a config file that
  registers an energy may change its other settings, and one file may hold several
  energies). None for a built-in energy (cem_jax's own code, pinned by
  its tests and ``NUMERICS_VERSION``) and for a function whose source Python does not keep
  (``exec``, a notebook cell; logged).

  A run records it in every checkpoint, so that resuming after the energy was edited (another
  energy under the same name) is refused. ``version`` 1 (the source alone) checks checkpoints
  saved before version 2. Helpers from other modules are not included.

  Raises:
    ValueError: as :func:`get`; ``version`` not 1 or 2.
  """
  spec = get(name, kind, field)
  if spec.builtin:
    return None
  found = hashlib.sha256()
  for fn in (spec.energy, spec.fused_update):
    if fn is None:
      continue
    pinned = digest.texts(fn, version)
    if pinned is None:
      logging.warning("%s=%r: Python keeps no source of %r; a resumed run cannot check that "
                      "it is the function the checkpoint was trained with", field, name, fn)
      return None
    found.update(hashlib.sha256("\0".join(pinned).encode()).digest())
  return found.hexdigest()


def energy_digests(config, version: int | None = None) -> dict[str, str]:
  """``{config field: sha256}`` of the user energies a CEM model uses (:func:`source_digest`
  of digest ``version``, default the current ``DIGEST_VERSION``; built-ins have none), as
  checkpoints and ``tables``' results record them.

  Raises:
    ValueError: an unknown energy name or digest version.
  """
  m = config.model
  if m.block != "cem":
    return {}
  slots = [("attention", m.cem_attention), ("mlp", m.cem_mlp)]
  version = DIGEST_VERSION if version is None else version
  found = {f"model.{kind}_energy": source_digest(m[f"{kind}_energy"], kind,
                                                  f"model.{kind}_energy", version)
           for kind, used in slots if used}
  return {k: v for k, v in found.items() if v is not None}


def changed_energies(recorded: dict | None, version: int, config, now: dict | None,
                     where: str) -> list[str]:
  """The user energies of ``config`` edited since a run recorded their digests (its function
  or closed form, or a constant or helper they read), one
  ``"model.X_energy: its source, or a constant or helper it reads, changed (sha256 a -> b)"``
  each. ``recorded``: the run's ``{config field: sha256}`` (None or empty: saved before
  digests were recorded, judged by its config alone); ``version``: the digest version it was
  taken with (1 compares the functions' source alone); ``now``: this process's
  :func:`energy_digests` of ``config`` (None: computed here); ``where``: the checkpoint or file
  that holds the record, for the error.

  Raises:
    ValueError: ``where`` records a digest version this code does not know.
  """
  if not recorded:
    return []
  if version not in (1, DIGEST_VERSION):
    raise ValueError(f"{where} records energy digests of version {version!r}, this code knows "
                     f"1 and {DIGEST_VERSION}: load it with the code that saved it")
  if now is None or version != DIGEST_VERSION:
    now = energy_digests(config, version)
  short = lambda digest: "none" if digest is None else digest[:12]
  return [f"{k}: its source, or a constant or helper it reads, changed (sha256 "
          f"{short(recorded.get(k))} -> {short(now.get(k))})"
          for k in sorted(set(recorded) | set(now)) if recorded.get(k) != now.get(k)]


_register("softmax", "attention", interaction.interaction_energy, interaction.fused_update,
          builtin=True)
for _potential in elementwise.POTENTIALS:
  _register(_potential, "mlp", *elementwise.make_gated_energy(_potential), builtin=True)
