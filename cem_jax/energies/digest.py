"""What pins a user energy's code: the texts its source digest hashes, taken once per process.

A run records :func:`cem_jax.energies.source_digest` in every checkpoint and every ``tables``
result, so that resuming or reusing after the energy was edited (another energy under the same
name) is refused. Version 1 hashed the function's source alone: an edited ``TAU = 2.0`` in the
same file trained another energy without a word. Version 2 (:data:`DIGEST_VERSION`) also
hashes what the function reads (:func:`texts`).

The texts are taken when the energy is first looked up (:func:`pin`, called by
``registry.get`` and ``registry.register``), before anything traces it: a module-level memo
that tracing fills, or the file edited while a table runs (Python keeps the module it
imported; ``inspect.getsource`` would read the new file), would otherwise give another digest
for the same running code.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect

import jax
import numpy as np
from absl import logging

from cem_jax import errors

# 1: the source of the energy and its closed form; 2: also what they read (see texts()).
DIGEST_VERSION = 2
_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_MAX_DEPTH = 24  # nested containers, objects and helpers; deeper is marked, not followed
# {id(fn): (fn, {version: texts or None})}: fn kept alive, so that its id is not reused.
_PINNED: dict[int, tuple[object, dict[int, list[str] | None]]] = {}


def pin(fn) -> None:
  """Takes ``fn``'s texts of both versions now, once per function object and process."""
  if fn is None or id(fn) in _PINNED:
    return
  source = _source_of(fn)
  v1 = None if source is None else [source]
  try:
    v2 = None if source is None else _texts_of(fn, _home_module(fn), set(), 0)
  except Exception as e:  # an object that refuses to be read: its source still pins it
    logging.warning("cannot read what %r reads (%s); its digest covers its source only", fn,
                    errors.one_line(e))
    v2 = v1
  _PINNED[id(fn)] = (fn, {1: v1, DIGEST_VERSION: v2})


def texts(fn, version: int = DIGEST_VERSION) -> list[str] | None:
  """The texts that pin ``fn`` (taken by :func:`pin` if not yet), or None where Python keeps
  no source of it (``exec``, a notebook cell).

  Version 1: the source, through ``functools.partial``, ``__wrapped__`` (``jax.jit``,
  ``functools.wraps``), ``jax.custom_jvp``/``custom_vjp`` and callable objects (their class).
  Version 2: the source; the arguments of a ``functools.partial``; the rules of a
  ``jax.custom_jvp``/``custom_vjp``; defaults, closure cells and the module-level values the
  function reads (by name, in it and in the functions, lambdas and comprehensions it
  defines): numbers, strings, NumPy and jax arrays (PRNG keys by their key data), containers
  of them, and objects, classes and functions of the same module, followed recursively
  (a callable object's ``__call__``, an instance's fields). Values of other modules (jax,
  NumPy, a helper file) count by name only: an upgrade of jax must not refuse a resume, and
  an edit inside a helper file is not caught.

  Raises:
    ValueError: ``version`` not 1 or 2.
  """
  if version not in (1, DIGEST_VERSION):
    raise ValueError(f"energy digest version={version!r}; allowed: 1, {DIGEST_VERSION}")
  pin(fn)
  return _PINNED[id(fn)][1][version]


def _source_of(fn) -> str | None:
  """The source text of a function, through ``functools.partial``, decorators that keep
  ``__wrapped__``, ``jax.custom_jvp``/``custom_vjp`` and ``jax.jit`` wrappers and callable
  objects (their class); None where Python keeps none (``exec``, a notebook cell, C code)."""
  fn = _innermost(fn)
  if not (inspect.isfunction(fn) or inspect.ismethod(fn)) and callable(fn):
    fn = type(fn)
  try:
    return inspect.getsource(fn)
  except (OSError, TypeError):
    return None


def _innermost(fn):
  for _ in range(16):  # wrappers of wrappers, but never an endless chain
    inner = _wrapped(fn)
    if inner is None or inner is fn:
      break
    fn = inner
  return fn


def _wrapped(fn):
  """What ``fn`` wraps (a partial's function, a custom_jvp/vjp's, ``__wrapped__``), or None."""
  if isinstance(fn, functools.partial):
    return fn.func
  if isinstance(fn, jax.custom_jvp | jax.custom_vjp):
    return fn.fun
  if inspect.isfunction(fn):
    return fn.__dict__.get("__wrapped__")  # functools.wraps; not a catch-all __getattr__
  try:
    return object.__getattribute__(fn, "__wrapped__")  # jax.jit's wrapper
  except AttributeError:
    return None


def _home_module(fn) -> str | None:
  """The module whose objects count as the energy's own: the innermost function's."""
  fn = _innermost(fn)
  owner = fn if inspect.isfunction(fn) or inspect.isclass(fn) else type(fn)
  return getattr(owner, "__module__", None)


def _texts_of(value, module, seen: set, depth: int) -> list[str]:
  """The texts of one value the energy reads (:func:`texts`, version 2)."""
  if depth > _MAX_DEPTH:
    return ["<deeper than the digest follows>"]
  if isinstance(value, np.generic | np.ndarray | jax.Array):
    return [_array_text(value, module, seen, depth)]
  if isinstance(value, _PLAIN):
    return [f"{type(value).__name__}:{value!r}"]
  if inspect.ismodule(value):
    return [f"module:{value.__name__}"]
  key = id(value)
  if key in seen:
    return ["<seen>"]
  seen.add(key)
  follow = functools.partial(_texts_of, module=module, seen=seen, depth=depth + 1)
  if isinstance(value, tuple | list | set | frozenset):
    items = ["\x1f".join(follow(v)) for v in value]
    items = sorted(items) if isinstance(value, set | frozenset) else items
    return [f"{type(value).__name__}:[{', '.join(items)}]"]
  if isinstance(value, dict):
    items = sorted(f"{chr(31).join(follow(k))}: {chr(31).join(follow(v))}"
                   for k, v in value.items())
    return [f"dict:{{{', '.join(items)}}}"]
  if isinstance(value, functools.partial):
    return (["partial"] + follow(value.func) + [t for a in value.args for t in follow(a)]
            + [t for k, v in sorted(value.keywords.items()) for t in [k, *follow(v)]])
  if isinstance(value, jax.custom_jvp | jax.custom_vjp):
    rules = [getattr(value, a, None) for a in ("fun", "jvp", "fwd", "bwd")]
    return [f"{type(value).__name__}:{value.nondiff_argnums}"] + [
        t for rule in rules if rule is not None for t in follow(rule)]
  wrapped = _wrapped(value)
  if wrapped is not None and wrapped is not value:
    return follow(wrapped)
  owner = (value.__func__ if inspect.ismethod(value) else value
           if inspect.isfunction(value) or inspect.isclass(value) else type(value))
  if getattr(owner, "__module__", None) != module:  # another module's: by name only
    name = getattr(value, "__name__", None)  # a str, unless __getattr__ answers anything
    return [f"ref:{name if isinstance(name, str) else type(value).__name__}"]
  if inspect.ismethod(value):
    return follow(value.__func__) + follow(value.__self__)
  if inspect.isclass(value):
    return [_source_text(value)]
  if not inspect.isfunction(value):  # an instance of a class of this module
    fields = ([(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
              if dataclasses.is_dataclass(value) else sorted(vars(value).items())
              if hasattr(value, "__dict__") else [])
    call = [type(value).__call__] if callable(value) else []
    return follow(type(value)) + [t for k, v in fields for t in [k, *follow(v)]] + [
        t for c in call for t in follow(c)]
  out = [_source_text(value)]
  cells = [c.cell_contents for c in value.__closure__ or () if _cell_filled(c)]
  read = [value.__globals__[n] for n in _names_read(value.__code__) if n in value.__globals__]
  for v in [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values(), *cells, *read]:
    out += follow(v)
  return out


def _source_text(obj) -> str:
  try:
    return inspect.getsource(obj)
  except (OSError, TypeError):
    return f"<no source of {getattr(obj, '__qualname__', obj)!r}>"


def _array_text(value, module, seen, depth) -> str:
  """An array's dtype, shape and bytes' sha256 (a PRNG key's by its key data; an object
  array's by its elements); its dtype and shape only where its values cannot be read here
  (an array spread over other hosts)."""
  try:
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype,
                                                               jax.dtypes.prng_key):
      value = jax.random.key_data(value)
    a = np.asarray(value)
  except Exception:  # not addressable from this process
    return f"array:{value.dtype}:{value.shape}:unread"
  if a.dtype == object:
    items = [t for v in a.flat for t in _texts_of(v, module, seen, depth + 1)]
    return f"array:object:{a.shape}:[{', '.join(items)}]"
  digest = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
  return f"array:{a.dtype}:{a.shape}:{digest}"


def _names_read(code) -> list[str]:
  """The global (and attribute) names ``code`` and the functions, lambdas and comprehensions
  defined in it read, in order, once each."""
  names = list(code.co_names)
  for const in code.co_consts:
    if inspect.iscode(const):
      names += _names_read(const)
  return list(dict.fromkeys(names))


def _cell_filled(cell) -> bool:
  try:
    cell.cell_contents  # noqa: B018
  except ValueError:  # a closure variable not assigned yet
    return False
  return True
