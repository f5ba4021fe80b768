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

from cem_jax.axes import DEFAULT_RULES, MESH_AXES, mesh_axes_of, mesh_shape


def make_mesh(mesh_config, devices=None) -> Mesh:
  """A ``Mesh`` with axes ``('data', 'fsdp', 'tensor')`` over ``devices`` (default: all).

  Built with *Auto* axis types (DESIGN.md: the Explicit default breaks sharded matmuls of
  ordinary code). Over every device ``jax.make_mesh`` chooses their order (topology-aware, so
  the order of ``devices`` is not kept); a subset is laid out in the order given.

  Raises:
    ValueError: as :func:`cem_jax.axes.mesh_shape` (the mesh sizes do not multiply to the
      number of devices, naming the ``mesh`` fields).
  """
  every = jax.devices()
  devices = every if devices is None else list(devices)
  shape = mesh_shape(mesh_config, len(devices))
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  # The same devices, not only as many, nor as many with the same ids and platform: a
  # target's described devices (cem_jax.aot) are not this machine's even where their ids and
  # platform are (a v6e:2x2 target described on a v5e-4 machine, h100:8 on an H200 node).
  if len(devices) == len(every) and set(devices) == set(every):
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
    names = tuple(n for n in mesh_axes_of(target) if n not in used)
    used.update(names)
    out.append(None if not names else names[0] if len(names) == 1 else names)
  return PartitionSpec(*out)


def param_specs(state, rules=DEFAULT_RULES, mesh: Mesh | None = None):
  """A pytree like ``state`` (an ``nnx.State`` of Params) of ``PartitionSpec``s.

  With ``mesh``, a dimension whose size the mesh axes do not divide (e.g. the vocabulary of a
  loaded tokenizer) is replicated instead, with a warning: ``jax.jit`` rejects uneven shardings.
  :func:`cem_jax.axes.check_config` rejects such sizes for the dimensions the config sets.
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
      names = mesh_axes_of(entry)
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
# Shardings of the train state and of batches


def replicated(mesh: Mesh) -> NamedSharding:
  """A full copy on every device of ``mesh`` (``PartitionSpec()``)."""
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

  Reads the devices' row ranges, never a row at a time: it runs at start-up for any
  ``global_rows`` (``train.batch_size=10**9`` once filled a set of 10**9 rows: a MemoryError
  before the batch's memory check could speak).
  """
  spans = sorted({index[0].indices(global_rows)[:2]
                  for index in sharding.addressable_devices_indices_map((global_rows,)).values()})
  lo, hi = spans[0][0], spans[0][0]
  for start, stop in spans:
    if start > hi:  # a gap: the rows held are not one block
      return 0, 1
    hi = max(hi, stop)
  size = hi - lo
  if global_rows % size == 0 and lo % size == 0:
    return lo // size, global_rows // size
  return 0, 1


def global_batch(local: dict, sharding: NamedSharding, global_rows: int) -> dict:
  """This process's rows (``process_slice``'s block) → global ``jax.Array``s ``[global_rows,
  ...]`` sharded by ``sharding``; no process ever holds another's rows."""
  return {k: jax.make_array_from_process_local_data(sharding, v, (global_rows, *v.shape[1:]))
          for k, v in local.items()}
