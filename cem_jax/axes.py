"""Logical axes, their mesh rules, mesh sizes and the head dimension: plain Python, no jax.

The one place for the layout facts that both the config checks (:mod:`cem_jax.config`, which
must not import jax) and the device code (:mod:`cem_jax.sharding`) need. Model code names the
axes of every parameter with *logical* names (``embed``, ``heads``, ``head_dim``, ``mlp``,
``vocab``, and ``batch`` for inputs); ``mesh.rules`` maps them to the mesh axes ``data``,
``fsdp`` and ``tensor`` (MaxText's logical-axis rules).
"""

from __future__ import annotations

import math

MESH_AXES = ("data", "fsdp", "tensor")
LOGICAL_AXES = ("batch", "embed", "heads", "head_dim", "mlp", "vocab")

# mesh.rules default: logical axis (named in the model code) -> mesh axis, None (replicated) or
# a tuple of mesh axes. FSDP shards the model dimension of every matrix, tensor parallelism the
# heads, the MLP width and the vocabulary; batches are split over data x fsdp.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


def head_dim_of(model_config) -> int:
  """``model.head_dim``, or ``model.d_model // model.num_heads`` when it is -1 (not > 0)."""
  m = model_config
  return m.head_dim if m.head_dim > 0 else m.d_model // m.num_heads


def augmented_head_dim(model_config) -> int | None:
  """Width of the CEM per-head diagonal's augmented head, ``q̃ = [q, d⊙y(, -½)]``: ``head_dim
  + d_model``, ``+ 1`` in the distance form (``energies/interaction.py``); None when the model
  has no such head (Llama, ``model.cem_attention=False`` or ``model.diagonal='none'``)."""
  m = model_config
  if m.block != "cem" or not m.cem_attention or m.diagonal == "none":
    return None
  return head_dim_of(m) + m.d_model + (m.diagonal_form == "distance")


def rules_from_config(mesh_config) -> tuple:
  """``mesh.rules`` as a tuple of ``(logical, None | mesh_axis | tuple of mesh_axes)``.

  Lists (from ``config.json``) become tuples. A missing ``mesh.rules`` gives ``DEFAULT_RULES``.

  Raises:
    ValueError: a malformed pair, an unknown or repeated logical axis, or an unknown or
      repeated mesh axis (one line).
  """
  raw = mesh_config.get("rules", None) if hasattr(mesh_config, "get") else None
  if raw is None:
    return DEFAULT_RULES
  if not isinstance(raw, (tuple, list)):
    raise ValueError(f"mesh.rules={raw!r}; allowed: a tuple of (logical_axis, mesh_axis or None "
                     "or a tuple of mesh axes) pairs")
  out, seen = [], set()
  for pair in raw:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], str):
      raise ValueError(f"mesh.rules entry {pair!r}; allowed: a pair (logical_axis, mesh_axis or "
                       "None or a tuple of mesh axes)")
    logical, target = pair
    if logical not in LOGICAL_AXES:
      raise ValueError(f"mesh.rules names logical axis {logical!r}; allowed: "
                       f"{', '.join(LOGICAL_AXES)}")
    if logical in seen:  # else the last rule would win silently
      raise ValueError(f"mesh.rules gives logical axis {logical!r} twice; allowed: one rule "
                       "per logical axis")
    seen.add(logical)
    names = mesh_axes_of(target)
    bad = [n for n in names if n not in MESH_AXES]
    if bad:
      raise ValueError(f"mesh.rules maps {logical!r} to {bad[0]!r}; allowed mesh axes: "
                       f"{', '.join(MESH_AXES)} (or None: replicated)")
    if len(set(names)) < len(names):  # a NamedSharding uses a mesh axis once
      raise ValueError(f"mesh.rules maps {logical!r} to {target!r}, a mesh axis twice; allowed: "
                       "each mesh axis at most once per rule")
    out.append((logical, None if not names else names[0] if len(names) == 1 else names))
  return tuple(out)


def mesh_axes_of(target) -> tuple[str, ...]:
  """A rule's target (``None``, a mesh axis or a tuple of them) as a tuple of mesh axes."""
  return (target,) if isinstance(target, str) else tuple(target or ())


def dividing_axes(axes: tuple[str, ...], size: int, mesh_shape: dict) -> tuple[str, ...] | None:
  """The mesh axes of ``axes`` that the mesh has (``mesh_shape``: ``{axis: devices}``), if
  their product divides ``size`` (a dimension's length): where to split that dimension; None
  when none fit (the dimension stays whole)."""
  axes = tuple(a for a in axes if a in mesh_shape)
  return axes if axes and size % math.prod(mesh_shape[a] for a in axes) == 0 else None


def check_mesh_sizes(mesh_config) -> None:
  """Checks ``mesh.data``, ``mesh.fsdp``, ``mesh.tensor`` without the devices: each an int
  >= 1 or -1 (the devices left over), at most one -1.

  Raises:
    ValueError: one line naming the field, its value and what is allowed.
  """
  rest = []
  for axis in MESH_AXES:
    size = mesh_config[axis]
    if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
      raise ValueError(f"mesh.{axis}={size!r}; allowed: -1 (the devices left over) or an "
                       "int >= 1")
    rest += [f"mesh.{axis}=-1"] if size == -1 else []
  if len(rest) > 1:
    raise ValueError(f"{' and '.join(rest)}: at most one mesh size may be -1 (the devices "
                     "left over); give the others as ints (mesh.data defaults to -1)")


def mesh_shape(mesh_config, num_devices: int) -> tuple[int, int, int]:
  """Resolves ``mesh.data``, ``mesh.fsdp``, ``mesh.tensor`` (one may be -1 = the rest).

  Raises:
    ValueError: as :func:`check_mesh_sizes`, or sizes whose product is not the device count.
  """
  check_mesh_sizes(mesh_config)
  sizes = [mesh_config[a] for a in MESH_AXES]
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


def data_parallel_size(mesh_config, sizes: dict[str, int]) -> int:
  """The devices a batch is split over: the product of ``sizes`` (resolved mesh sizes, as
  :func:`check_config` returns them) over the mesh axes of the ``batch`` rule."""
  batch_axes = mesh_axes_of(dict(rules_from_config(mesh_config)).get("batch"))
  return math.prod(sizes[a] for a in batch_axes)


def check_config(config, num_devices: int) -> dict[str, int]:
  """Checks the mesh of ``config`` against the devices and the model/batch sizes.

  Returns the resolved mesh sizes ``{'data': d, 'fsdp': f, 'tensor': t}``.

  Raises:
    ValueError: one line naming the field, its value and what is allowed, for: mesh sizes that
      do not multiply to ``num_devices``; ``train.batch_size`` or ``eval.batch_size`` not
      divisible by the data-parallel size (the mesh axes of ``batch``, data × fsdp by default),
      or ``train.batch_size`` by that size × ``train.gradient_accumulation_steps``;
      ``model.num_heads``, ``model.mlp_dim``, ``model.d_model`` or the head dimension not
      divisible by the mesh axes ``mesh.rules`` shards them over (tensor; fsdp for d_model).
  """
  sizes = dict(zip(MESH_AXES, mesh_shape(config.mesh, num_devices), strict=True))
  rules = dict(rules_from_config(config.mesh))
  m = config.model
  dims = {"heads": ("model.num_heads", m.num_heads), "mlp": ("model.mlp_dim", m.mlp_dim),
          "embed": ("model.d_model", m.d_model), "head_dim": ("model.head_dim", head_dim_of(m))}
  for logical, (field, size) in dims.items():
    axes = mesh_axes_of(rules.get(logical))
    n = math.prod(sizes[a] for a in axes)
    if size % n:
      over = " x ".join(f"mesh.{a}={sizes[a]}" for a in axes)
      raise ValueError(f"{field}={size} is not divisible by {over} (mesh.rules shards "
                       f"{logical!r} over {' x '.join(axes)}); allowed: a {' x '.join(axes)} size "
                       f"dividing {size}")
  axes = mesh_axes_of(rules.get("batch"))
  dp = data_parallel_size(config.mesh, sizes)
  names = " x ".join(f"mesh.{a}" for a in axes) or "(none: mesh.rules replicates batch)"
  values = " x ".join(str(sizes[a]) for a in axes) or "1"
  for field in ("train.batch_size", "eval.batch_size"):
    group, key = field.split(".")
    bs = config[group][key]
    if bs % dp:
      raise ValueError(f"{field}={bs} is not divisible by the {dp} data-parallel devices "
                       f"({num_devices} devices, {names} = {values}); use a multiple of {dp}, "
                       f"e.g. {-(-bs // dp) * dp}")
  k = config.train.gradient_accumulation_steps
  if k > 1 and config.train.batch_size % (k * dp):
    # Every device splits its own rows into the k microbatches: no rows move between devices.
    bs = config.train.batch_size
    raise ValueError(f"train.batch_size={bs} is not divisible by "
                     f"train.gradient_accumulation_steps={k} x the {dp} data-parallel devices "
                     f"({names} = {values}); use a multiple of {k * dp}, e.g. "
                     f"{-(-bs // (k * dp)) * k * dp}")
  return sizes
