"""Atomic file writes: a reader sees the old file or the new one, never half of either.

The data goes to a temporary file in the same folder (so the rename stays on one filesystem),
is flushed to disk, and is renamed over ``path`` (``os.replace``, atomic on POSIX and Windows).
A failed write removes its temporary file and leaves ``path`` as it was.
"""

from __future__ import annotations

import json
import os
import uuid


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
  """Writes ``data`` to ``path`` atomically; the folder must exist.

  Raises:
    OSError: the folder is missing or not writable (``path`` is then unchanged).
  """
  path = os.fspath(path)
  # A unique name (not tempfile.mkstemp): concurrent writers never share a temporary file, and
  # the file gets the usual permissions (umask), not mkstemp's owner-only 0600.
  tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
  try:
    with open(tmp, "xb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.remove(tmp)
    except FileNotFoundError:
      pass
    raise


def atomic_write_json(path: str | os.PathLike, obj, *, indent: int = 2,
                      sort_keys: bool = False) -> None:
  """Writes ``json.dumps(obj, indent=indent, sort_keys=sort_keys)`` (UTF-8, no trailing newline)
  to ``path`` atomically; the folder must exist.

  Raises:
    TypeError: ``obj`` is not JSON-serialisable (nothing is written).
    OSError: as :func:`atomic_write_bytes`.
  """
  atomic_write_bytes(path, json.dumps(obj, indent=indent, sort_keys=sort_keys).encode())
