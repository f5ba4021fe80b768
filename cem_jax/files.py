"""Atomic file writes: a reader sees the old file or the new one, never half of either.

The data goes to a temporary file in the same folder (so the rename stays on one filesystem),
is flushed to disk, and is renamed over ``path`` (``os.replace``, atomic on POSIX and Windows).
A failed write removes its temporary file and leaves ``path`` as it was; a killed one leaves
it, and :func:`temporary_of` recognises it. :func:`atomic_path` does the same for a writer
that opens the file by name. :func:`sha256_file` hashes a file of any size; :func:`read_json`
reads back what the writers wrote, a damaged file as one line; :func:`saved_figure` draws and
saves a matplotlib figure the same way; :func:`hold_folder` keeps a
folder for one process (a training run's workdir, a prepare's output).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import re
import uuid
from collections.abc import Iterator
from typing import BinaryIO


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
  """Writes ``data`` to ``path`` atomically; the folder must exist.

  Raises:
    OSError: the folder is missing or not writable, or its disk is full (``path`` is then
      unchanged), naming ``path``.
  """
  with atomic_writer(path) as f:
    f.write(data)


def atomic_write_json(path: str | os.PathLike, obj, *, indent: int = 2,
                      sort_keys: bool = False) -> None:
  """Writes ``json.dumps(obj, indent=indent, sort_keys=sort_keys)`` (UTF-8, no trailing newline)
  to ``path`` atomically; the folder must exist.

  Raises:
    TypeError: ``obj`` is not JSON-serialisable (nothing is written).
    OSError: as :func:`atomic_write_bytes`.
  """
  atomic_write_bytes(path, json.dumps(obj, indent=indent, sort_keys=sort_keys).encode())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
  """Writes ``text`` (UTF-8) to ``path`` atomically; the folder must exist.

  Raises:
    OSError: as :func:`atomic_write_bytes`.
  """
  atomic_write_bytes(path, text.encode())


def atomic_save_figure(fig, path: str | os.PathLike, *, dpi: int = 120) -> None:
  """Saves a matplotlib figure to ``path`` atomically, in the format its extension names
  (``.png``, ``.pdf``, ``.svg``); the folder must exist.

  Raises:
    ValueError: matplotlib does not know the extension's format (nothing is written).
    OSError: as :func:`atomic_write_bytes`.
  """
  buf = io.BytesIO()
  fig.savefig(buf, format=os.path.splitext(os.fspath(path))[1].lstrip(".") or None, dpi=dpi)
  atomic_write_bytes(path, buf.getvalue())


@contextlib.contextmanager
def saved_figure(path: str | os.PathLike, **subplots_kw) -> Iterator[tuple]:
  """``with saved_figure("loss.png", figsize=(6, 4)) as (fig, ax):`` draws on
  ``plt.subplots(**subplots_kw)`` (matplotlib's file-only Agg backend: no display on servers
  and CI); leaving the block lays the figure out, saves it with :func:`atomic_save_figure` and
  closes it. A block that raises saves nothing and still closes the figure.

  Raises:
    ValueError, OSError: as :func:`atomic_save_figure`.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(**subplots_kw)
  try:
    yield fig, axes
    fig.tight_layout()
    atomic_save_figure(fig, path)
  finally:
    plt.close(fig)


# The name atomic_writer gives its temporary file, ``<path>.<pid>.<12 hex digits>.tmp``;
# tests/test_files.py checks that this pattern recognises the names it makes.
_TEMPORARY_NAME = re.compile(r"(.+)\.[0-9]+\.[0-9a-f]{12}\.tmp")


def _temporary_name(path: str) -> str:
  """A new temporary file name for an atomic write of ``path`` (:data:`_TEMPORARY_NAME`).
  Unique (not tempfile.mkstemp): concurrent writers never share a temporary file, and the file
  gets the usual permissions (umask), not mkstemp's owner-only 0600."""
  return f"{path}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"


def temporary_of(name: str | os.PathLike) -> str | None:
  """Returns the name of the file that the temporary file ``name`` of an atomic write was to
  replace (a writer killed before the rename leaves it behind), or None when ``name`` is not
  such a temporary file. Only the last component counts:
  ``temporary_of('d/a.json.12.0123456789ab.tmp') == 'a.json'``.
  """
  match = _TEMPORARY_NAME.fullmatch(os.path.basename(os.fspath(name)))
  return match.group(1) if match else None


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
  """A binary file whose contents replace ``path`` atomically when the ``with`` block ends
  without an exception (also for data too large to hold in memory); the folder must exist.
  The temporary file is removed on an exception, and ``path`` is then unchanged.

  Raises:
    OSError: as :func:`atomic_write_bytes`.
  """
  with atomic_path(path) as tmp, open(tmp, "xb") as f:
    yield f


def check_can_write(path: str | os.PathLike) -> None:
  """Creates and removes a temporary file beside ``path`` as an atomic write of ``path``
  would (:func:`atomic_path`), so that a program that writes ``path`` only after minutes of
  work (a benchmark's first row) finds an unwritable folder at its start. ``path`` itself is
  not touched.

  Raises:
    OSError: the folder is missing, read-only or cannot hold files (e.g. ``/proc``), naming
      the temporary file.
  """
  tmp = _temporary_name(os.fspath(path))
  with open(tmp, "xb"):
    pass
  os.remove(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
  """The name of a temporary file, for a writer that opens files by name (e.g. an
  ``ArrayRecordWriter``): when the ``with`` block ends without an exception, the file written
  there is flushed to disk and replaces ``path`` atomically; on an exception it is removed
  and ``path`` is unchanged. The folder must exist; the block must close the file.

  Raises:
    OSError: as :func:`atomic_write_bytes`, or nothing was written at the name; one without a
      file name (a full disk's ``ENOSPC``, a file-size limit's ``EFBIG``) gets ``path``.
  """
  path = os.fspath(path)
  # Said of the path asked for, not of the temporary file a failed open would name.
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    raise FileNotFoundError(errno.ENOENT, f"no folder {folder} to write into", path)
  if os.path.isdir(path):
    raise IsADirectoryError(errno.EISDIR, "a folder is in the way of the file", path)
  tmp = _temporary_name(path)
  try:
    with naming(path):  # a full disk fails the write or the close with no file name
      yield tmp
      with open(tmp, "r+b") as f:  # writable: Windows' fsync needs write access
        os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.remove(tmp)
    except FileNotFoundError:
      pass
    raise


@contextlib.contextmanager
def naming(path: str | os.PathLike):
  """An ``OSError`` of the block without a file name (a full disk's ``[Errno 28] No space left
  on device``, a file-size limit's ``EFBIG``) is raised again with ``path``: the one-line error
  then says what could not be written.

  Raises:
    OSError: the block's, with ``path`` where it had no file name.
  """
  try:
    yield
  except OSError as e:
    if e.filename is not None or e.errno is None:
      raise
    raise OSError(e.errno, e.strerror, os.fspath(path)) from e


def read_json(path: str | os.PathLike, fix: str):
  """The JSON value in ``path`` (a run's ``config.json`` or ``result.json``).

  Raises:
    ValueError: it is not valid UTF-8 JSON: one line naming ``path``, the parser's reason and
      ``fix`` (what the user can do about it).
    OSError: it cannot be opened (e.g. FileNotFoundError).
  """
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
    raise ValueError(f"{os.fspath(path)} is not valid JSON ({e}); {fix}") from None


def sha256_file(path: str | os.PathLike) -> str:
  """Returns the sha256 of the file at ``path`` as 64 hex digits, reading 1 MiB at a time.

  Raises:
    OSError: the file cannot be read.
  """
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(1 << 20):
      h.update(block)
  return h.hexdigest()


_COMMAND_CHARS = 200  # of a holder's command line, in an error's one line


def flock_holders(fd: int) -> str:
  """Who else holds a ``flock`` on the file open as ``fd``: ``"pid N (COMMAND LINE)"`` for each
  other process ``/proc/locks`` lists, joined by ", " ('' where there is no ``/proc/locks``
  (not Linux), the holder is on another host, or only this process holds it)."""
  st = os.fstat(fd)
  key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
  try:
    with open("/proc/locks", encoding="ascii", errors="replace") as f:
      rows = [line.split() for line in f]
  except OSError:
    return ""
  pids = sorted({int(r[4]) for r in rows if len(r) > 5 and r[1] == "FLOCK" and r[5] == key
                 and r[4].isdigit() and int(r[4]) != os.getpid()})  # a waiter's row has '->'
  held = []
  for pid in pids:
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        command = " ".join(f.read().decode("utf-8", "replace").replace("\0", " ").split())
    except OSError:  # ended since
      continue
    if len(command) > _COMMAND_CHARS:
      command = command[:_COMMAND_CHARS - 3] + "..."
    held.append(f"pid {pid} ({command})")
  return ", ".join(held)


@contextlib.contextmanager
def hold_folder(path: str | os.PathLike, in_use: str, name: str, what: str):
  """Holds the existing folder ``path`` for this process while the block runs: an exclusive
  ``flock`` on the folder itself (no lock file is left behind), released when the block ends
  or the process dies (also ``kill -9``). A filesystem without ``flock`` (some network mounts)
  holds no lock, with a warning naming ``name`` (e.g. ``--workdir=DIR``) and ``what`` would not
  be refused (e.g. ``a second run``); neither does Windows.

  Raises:
    ValueError: ``in_use``, when another process holds the folder (followed by ``"; held by
      pid N (COMMAND LINE)"`` where :func:`flock_holders` finds it), or removed it while this
      one waited for it (a start that failed removes the folder it made, and a lock then taken
      is on a folder that is gone).
  """
  if os.name != "posix":
    yield
    return
  import fcntl  # POSIX only

  fd = os.open(path, os.O_RDONLY)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      try:
        held = os.path.samestat(os.fstat(fd), os.stat(path))
      except FileNotFoundError:
        held = False
      if not held:
        raise BlockingIOError(errno.EWOULDBLOCK, "removed")
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        logging.getLogger(__name__).warning(
            "%s cannot be locked (%s): %s started in it would not be refused", name,
            e.strerror or e, what)
      else:
        holders = flock_holders(fd)
        raise ValueError(f"{in_use}; held by {holders}" if holders else in_use) from None
    yield
  finally:
    os.close(fd)
