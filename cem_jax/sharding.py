"""Device mesh from the config and logical-axis rules (MaxText style).

Model code names the axes of every parameter with *logical* names (``embed``, ``heads``,
``head_dim``, ``mlp``, ``vocab``); the config's ``mesh.rules`` map them to the mesh axes
``data``, ``fsdp`` and ``tensor``. Batches are sharded over ``('data', 'fsdp')``.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or None: replicated). FSDP shards the model dimension of every
# matrix; tensor parallelism shards heads, the MLP width and the vocabulary.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


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
                       f"the {num_devices} devices")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"mesh.data*mesh.fsdp*mesh.tensor = {'*'.join(map(str, sizes))} = "
                     f"{math.prod(sizes)}, but there are {num_devices} devices")
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


def param_specs(state, rules=DEFAULT_RULES):
  """A pytree like ``state`` (an ``nnx.State`` of Params) of ``PartitionSpec``s."""
  from flax import nnx

  def spec(variable):
    axes = variable.get_metadata().get("logical_axes")
    if axes is None:
      return PartitionSpec()
    return logical_to_spec(axes, rules)

  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def named_shardings(specs, mesh: Mesh):
  """``PartitionSpec`` pytree → ``NamedSharding`` pytree on ``mesh``."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))
