"""Device mesh from the config, logical-axis rules (MaxText style) and sharded inputs.

Model code names the axes of every parameter with *logical* names (``embed``, ``heads``,
``head_dim``, ``mlp``, ``vocab``); the config's ``mesh.rules`` map them to the mesh axes
``data``, ``fsdp`` and ``tensor``. Batches (logical ``batch``) are sharded over
``('data', 'fsdp')``. The same code runs on one device, many devices of one process and many
processes (``jax.distributed``): every array is a global ``jax.Array`` with a ``NamedSharding``.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cem_jax import config as config_lib

MESH_AXES = ("data", "fsdp", "tensor")
LOGICAL_AXES = ("batch", "embed", "heads", "head_dim", "mlp", "vocab")

# logical axis -> mesh axis (or None: replicated, or a tuple of mesh axes); the default of the
# config's mesh.rules.
DEFAULT_RULES = config_lib.DEFAULT_MESH_RULES


def mesh_shape(mesh_config, num_devices: int) -> tuple[int, int, int]:
  """Resolves ``mesh.data``, ``mesh.fsdp``, ``mesh.tensor`` (one may be -1 = the rest).

  Raises:
    ValueError: more than one -1, a size < 1, or sizes whose product is not the device count.
  """
  sizes = [mesh_config[a] for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, sizes, strict=True))}: at most one "
                     "may be -1")
  for axis, size in zip(MESH_AXES, sizes, strict=True):
    if size != -1 and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
      raise ValueError(f"mesh.{axis}={size!r}; allowed: an int >= 1 or -1 (the rest)")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, sizes, strict=True))} do not divide "
                       f"the {num_devices} devices; allowed: sizes whose product divides "
                       f"{num_devices} (the -1 axis takes the rest)")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"mesh.data*mesh.fsdp*mesh.tensor = {'*'.join(map(str, sizes))} = "
                     f"{math.prod(sizes)}, but there are {num_devices} devices; allowed: sizes "
                     f"whose product is {num_devices} (one of them may be -1 = the rest)")
  return tuple(sizes)


def make_mesh(mesh_config, devices=None) -> Mesh:
  """A ``Mesh`` with axes ``('data', 'fsdp', 'tensor')`` over ``devices`` (default: all).

  Built with ``jax.make_mesh``-style device ordering and *Auto* axis types (DESIGN.md: the
  Explicit default breaks sharded matmuls of ordinary code).
  """
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_config, len(devices))
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  if devices is jax.devices() or len(devices) == len(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def logical_to_spec(logical_axes, rules=DEFAULT_RULES) -> PartitionSpec:
  """``('embed', 'mlp')`` → ``PartitionSpec('fsdp', 'tensor')`` under ``rules``.

  A mesh axis is used at most once per spec (a later logical axis mapping to an already used
  mesh axis is replicated instead), as ``NamedSharding`` requires.
  """
  table = dict(rules)
  used, out = set(), []
  for name in logical_axes:
    target = table.get(name) if name is not None else None
    names = (target,) if isinstance(target, str) else tuple(target or ())
    names = tuple(n for n in names if n not in used)
    used.update(names)
    out.append(None if not names else names[0] if len(names) == 1 else names)
  return PartitionSpec(*out)


def param_specs(state, rules=DEFAULT_RULES, mesh: Mesh | None = None):
  """A pytree like ``state`` (an ``nnx.State`` of Params) of ``PartitionSpec``s.

  With ``mesh``, a dimension whose size the mesh axes do not divide (e.g. the vocabulary of a
  loaded tokenizer) is replicated instead, with a warning: ``jax.jit`` rejects uneven shardings.
  :func:`check_config` rejects such sizes for the dimensions the config sets.
  """
  from flax import nnx

  def spec(path, variable):
    axes = variable.get_metadata().get("logical_axes")
    if axes is None:
      return PartitionSpec()
    out = logical_to_spec(axes, rules)
    if mesh is None:
      return out
    fitted = []
    shape = variable.get_value().shape
    for dim, entry in zip(shape, tuple(out) + (None,) * len(shape), strict=False):
      names = (entry,) if isinstance(entry, str) else tuple(entry or ())
      if dim % math.prod(mesh.shape[n] for n in names):
        logging.warning("%s: dimension of size %d is not divisible by mesh axes %s; replicated",
                        jax.tree_util.keystr(path), dim, names)
        entry = None
      fitted.append(entry)
    return PartitionSpec(*fitted)

  return jax.tree_util.tree_map_with_path(spec, state,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable))


def named_shardings(specs, mesh: Mesh):
  """``PartitionSpec`` pytree → ``NamedSharding`` pytree on ``mesh``."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


# ---------------------------------------------------------------------------------------------
# Rules and start-up checks


def rules_from_config(mesh_config) -> tuple:
  """``mesh.rules`` as a tuple of ``(logical, None | mesh_axis | tuple of mesh_axes)``.

  Lists (from ``config.json``) become tuples. A missing ``mesh.rules`` gives ``DEFAULT_RULES``.

  Raises:
    ValueError: a malformed pair, an unknown logical axis or an unknown mesh axis (one line).
  """
  raw = mesh_config.get("rules", None) if hasattr(mesh_config, "get") else None
  if raw is None:
    return DEFAULT_RULES
  out = []
  for pair in raw:
    if isinstance(pair, str) or len(pair) != 2 or not isinstance(pair[0], str):
      raise ValueError(f"mesh.rules entry {pair!r}; allowed: a pair (logical_axis, mesh_axis or "
                       "None or a tuple of mesh axes)")
    logical, target = pair
    if logical not in LOGICAL_AXES:
      raise ValueError(f"mesh.rules names logical axis {logical!r}; allowed: "
                       f"{', '.join(LOGICAL_AXES)}")
    names = (target,) if isinstance(target, str) else tuple(target or ())
    bad = [n for n in names if n not in MESH_AXES]
    if bad:
      raise ValueError(f"mesh.rules maps {logical!r} to {bad[0]!r}; allowed mesh axes: "
                       f"{', '.join(MESH_AXES)} (or None: replicated)")
    out.append((logical, None if not names else names[0] if len(names) == 1 else names))
  return tuple(out)


def _axes_of(logical: str, rules) -> tuple[str, ...]:
  target = dict(rules).get(logical)
  return (target,) if isinstance(target, str) else tuple(target or ())


def check_config(config, num_devices: int) -> dict[str, int]:
  """Checks the mesh of ``config`` against the devices and the model/batch sizes.

  Returns the resolved mesh sizes ``{'data': d, 'fsdp': f, 'tensor': t}``.

  Raises:
    ValueError: one line naming the field, its value and what is allowed, for: mesh sizes that
      do not multiply to ``num_devices``; ``train.batch_size`` or ``eval.batch_size`` not
      divisible by the data-parallel size (the mesh axes of ``batch``, data × fsdp by default);
      ``model.num_heads``, ``model.mlp_dim``, ``model.d_model`` or the head dimension not
      divisible by the mesh axes ``mesh.rules`` shards them over (tensor; fsdp for d_model).
  """
  sizes = dict(zip(MESH_AXES, mesh_shape(config.mesh, num_devices), strict=True))
  rules = rules_from_config(config.mesh)
  m = config.model
  head_dim = m.head_dim if m.head_dim > 0 else m.d_model // m.num_heads
  dims = {"heads": ("model.num_heads", m.num_heads), "mlp": ("model.mlp_dim", m.mlp_dim),
          "embed": ("model.d_model", m.d_model), "head_dim": ("model.head_dim", head_dim)}
  for logical, (field, size) in dims.items():
    axes = _axes_of(logical, rules)
    n = math.prod(sizes[a] for a in axes)
    if size % n:
      over = " x ".join(f"mesh.{a}={sizes[a]}" for a in axes)
      raise ValueError(f"{field}={size} is not divisible by {over} (mesh.rules shards "
                       f"{logical!r} over {'x'.join(axes)}); allowed: a {'x'.join(axes)} size "
                       f"dividing {size}")
  axes = _axes_of("batch", rules)
  dp = math.prod(sizes[a] for a in axes)
  names = " x ".join(f"mesh.{a}" for a in axes) or "(none: mesh.rules replicates batch)"
  values = " x ".join(str(sizes[a]) for a in axes) or "1"
  for field in ("train.batch_size", "eval.batch_size"):
    group, key = field.split(".")
    bs = config[group][key]
    if bs % dp:
      raise ValueError(f"{field}={bs} is not divisible by the {dp} data-parallel devices "
                       f"({num_devices} devices, {names} = {values}); use a multiple of {dp}, "
                       f"e.g. {-(-bs // dp) * dp}")
  return sizes


# ---------------------------------------------------------------------------------------------
# Shardings of the train state and of batches


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
  """Sharding of ``[batch, seq_len]`` arrays: rows over the mesh axes of ``batch``."""
  return NamedSharding(mesh, logical_to_spec(("batch", None), rules))


def param_shardings(abstract_params, mesh: Mesh, rules=DEFAULT_RULES):
  """``NamedSharding`` per Param of ``abstract_params`` (an ``nnx.State``, e.g. from
  ``nnx.eval_shape``); a prefix tree of the state usable as ``jax.jit`` ``out_shardings``."""
  return named_shardings(param_specs(abstract_params, rules, mesh), mesh)


def opt_state_shardings(tx, abstract_opt_state, shardings_of_params, mesh: Mesh):
  """Shardings for ``tx``'s state: every copy of the parameter tree inside it (Adam's moments)
  is sharded like the parameters, everything else (counts, flags) is replicated."""
  import optax
  from flax import nnx

  return optax.tree_map_params(
      tx, lambda _, sharding: sharding, abstract_opt_state, shardings_of_params,
      transform_non_params=lambda _: replicated(mesh),
      is_leaf=lambda x: isinstance(x, nnx.Variable))


def process_slice(sharding: NamedSharding, global_rows: int) -> tuple[int, int]:
  """Which rows of a ``[global_rows, ...]`` batch this process's devices hold.

  Returns ``(index, count)``: the process needs block ``index`` of ``count`` equal blocks
  (the data pipeline's ``process_index, process_count``). When its devices hold rows that are
  not one such block (an unusual device order), ``(0, 1)``: read the whole batch.
  """
  rows = set()
  for index in sharding.addressable_devices_indices_map((global_rows,)).values():
    rows.update(range(*index[0].indices(global_rows)))
  lo, hi = min(rows), max(rows) + 1
  size = hi - lo
  if len(rows) == size and global_rows % size == 0 and lo % size == 0:
    return lo // size, global_rows // size
  return 0, 1


def global_batch(local: dict, sharding: NamedSharding, global_rows: int) -> dict:
  """This process's rows (``process_slice``'s block) → global ``jax.Array``s ``[global_rows,
  ...]`` sharded by ``sharding``; no process ever holds another's rows."""
  return {k: jax.make_array_from_process_local_data(sharding, v, (global_rows, *v.shape[1:]))
          for k, v in local.items()}
