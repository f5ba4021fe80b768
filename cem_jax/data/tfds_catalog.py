"""Text from a TFDS catalog dataset (``data.tfds_name``), read by random access
(``DatasetBuilder.as_data_source``, which needs the array_record or parquet format).

A dataset already prepared (in array_record format) in the data dir is read without any
network access. Otherwise TFDS would have to download it, and without a network
``tfds.load``/``data_source`` retry for minutes before failing; so a TLS connection to the TFDS
host is tried first, with a short timeout, and its failure is reported at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cem_jax.data import text as text_lib

# Host TFDS downloads from (and its metadata bucket); tests point this at a closed port.
PROBE_ADDRESS = ("storage.googleapis.com", 443)
PROBE_TIMEOUT_S = 3.0


# The probe, run in a child Python (network_reachable): exit status 0 when the handshake succeeds.
_PROBE = """
import socket, ssl, sys
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
  with socket.create_connection((host, port), timeout=timeout) as sock:
    with ssl.create_default_context().wrap_socket(sock, server_hostname=host):
      pass
except OSError:  # ssl.SSLError and socket timeouts too
  sys.exit(1)
"""


def network_reachable(address: tuple[str, int] | None = None,
                      timeout: float = PROBE_TIMEOUT_S) -> bool:
  """Returns whether a verified TLS connection to ``address`` (None: :data:`PROBE_ADDRESS`, read
  at the call) succeeds within ~``timeout`` s.

  A bare TCP connect is not enough: intercepting proxies accept connections to any address.
  The TLS handshake must present a valid certificate for the host. The attempt runs in a child
  Python, killed (and waited for) after ``timeout + 1`` s whatever the network does: a DNS
  lookup, which ``socket`` timeouts do not bound, or a server that trickles its handshake, can
  outlast any timeout, and in a thread of this process (as it was) the probe outlived the call
  and could wake during the interpreter's exit, aborting it ("terminate called ...", "FATAL:
  exception not rethrown"). Nothing of the probe is left running when this returns.
  """
  host, port = PROBE_ADDRESS if address is None else address
  try:
    done = subprocess.run(
        [sys.executable, "-I", "-c", _PROBE, str(host), str(port), str(timeout)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        timeout=timeout + 1.0, check=False)
  except subprocess.TimeoutExpired:  # run() has killed the child and reaped it
    return False
  return done.returncode == 0


def default_data_dir() -> Path:
  """TFDS's default data dir: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``."""
  return Path(os.path.expanduser(os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets")))


def _version_key(name: str) -> tuple[int, ...] | None:
  parts = name.split(".")
  if len(parts) != 3 or not all(p.isdigit() for p in parts):
    return None
  return tuple(int(p) for p in parts)


def _versions(directory: Path) -> list[Path]:
  if not directory.is_dir():
    return []
  return [v for v in directory.iterdir() if v.is_dir() and _version_key(v.name)]


def prepared_dir(name: str, data_dir: Path) -> Path | None:
  """Returns the directory of an already prepared ``name`` ('ds[/config][:version]') under
  ``data_dir`` (the newest version if none is given), or None. Only looks at the filesystem,
  so it never touches the network."""
  base_name, _, version = name.partition(":")
  base = data_dir / base_name
  if version:
    candidates = [base / version]
  else:
    candidates = _versions(base)
    if not candidates and "/" not in base_name and base.is_dir():
      # 'ds' whose default config is prepared: accept it when exactly one config is there.
      configs = [d for d in base.iterdir() if _versions(d)]
      candidates = _versions(configs[0]) if len(configs) == 1 else []
    candidates.sort(key=lambda v: _version_key(v.name), reverse=True)
  for candidate in candidates:
    if (candidate / "dataset_info.json").is_file():
      return candidate
  return None


class CatalogTexts:
  """The ``text_key`` feature of every example of a TFDS data source, as documents (str,
  newlines normalised), in the source's order. Re-iterable; each pass reads the examples one
  at a time, so a split larger than memory streams through."""

  def __init__(self, source, text_key: str):
    self._source = source
    self._key = text_key

  def __len__(self) -> int:
    return len(self._source)

  def __iter__(self):
    for i in range(len(self._source)):
      value = self._source[i][self._key]
      value = value.decode("utf-8") if isinstance(value, bytes) else str(value)
      yield text_lib.normalize_newlines(value)


def _joined(error: Exception) -> str:
  # TFDS's split and preparation errors run on after their first line with what they read
  # (the slice, the bounds): all of it, on one line.
  return " ".join(str(error).split()) or type(error).__name__


def _split_names(split: str) -> list[str]:
  """The split names of a TFDS split spec: names joined by '+', each maybe sliced, e.g.
  ``'train[:80%]+validation'``."""
  return [part.split("[", 1)[0].strip() for part in split.split("+")]


def _read_texts(name: str, split: str, data_dir: Path, text_key: str, download: bool,
                field: str) -> CatalogTexts:
  # Here, not at module level: every program start would pay its import (~0.4 s) for the
  # few runs that read a catalog dataset.
  import tensorflow_datasets as tfds

  try:
    builder = tfds.builder(name, data_dir=os.fspath(data_dir))
  except tfds.core.DatasetNotFoundError:
    raise ValueError(
        f"data.tfds_name={name!r} is not a TFDS catalog dataset known here (or its builder "
        "needs TensorFlow/Beam): prepare it elsewhere in array_record format"
    ) from None
  try:
    if download and not builder.is_prepared():
      builder.download_and_prepare(file_format=tfds.core.FileFormat.ARRAY_RECORD)
  except ValueError as e:
    raise ValueError(f"data.tfds_name={name!r} in {data_dir}: {_joined(e)}") from None
  if not builder.is_prepared():
    raise ValueError(f"data.tfds_name={name!r}: version {builder.version} is not prepared in "
                     f"{data_dir}; prepare it (file_format='array_record') or set "
                     "data.tfds_data_dir")
  formats = builder.info.available_file_formats()
  if not formats & tfds.core.FileFormat.with_random_access():
    held = sorted(f.value for f in formats) or "no file format"
    raise ValueError(
        f"data.tfds_name={name!r} is prepared in {builder.data_dir} as {held}; reading it "
        "needs array_record: prepare it again with file_format='array_record' in another "
        "data.tfds_data_dir")
  known = sorted(builder.info.splits)
  unknown = [s for s in _split_names(split) if s not in known and s != tfds.Split.ALL]
  if unknown:
    raise ValueError(f"{field}={split!r}: no such split of {name!r}; it has {known}")
  try:
    source = builder.as_data_source(split=split)
    size = len(source)  # a reversed slice ("train[5:2]") fails only here
  except (ValueError, NotImplementedError) as e:  # the slice: its syntax, its bounds, or
    # a slice TFDS does not take ("all[:50%]")
    raise ValueError(f"{field}={split!r} is not a valid split of {name!r}: "
                     f"{_joined(e)}") from None
  if size == 0:
    raise ValueError(f"{field}={split!r}: split of {name!r} is empty")
  example = source[0]
  if text_key not in example:
    raise ValueError(
        f"data.tfds_text_key={text_key!r} is not a feature of {name!r}; it has "
        f"{sorted(example)}"
    )
  return CatalogTexts(source, text_key)


def load_catalog(name: str, data_dir: str, text_key: str, train_split: str,
                 eval_split: str) -> tuple[CatalogTexts, CatalogTexts, str]:
  """Returns (train documents, eval documents, description) of TFDS dataset ``name``.

  The documents are read lazily (``CatalogTexts``). Each example's ``text_key`` feature is
  one document, in the data source's order, newlines normalised. ``data_dir`` '' means
  TFDS's default. A dataset not yet prepared there is downloaded and prepared
  (array_record) by TFDS when the network is reachable.

  Raises:
    ConnectionError: not prepared and no network (one line, within ~4 s; an OSError, so the
      programs report it as bad input).
    ValueError: unknown dataset, split or text key, a split spec TFDS refuses, or a dataset
      prepared in a format without random access (one line naming the config field).
  """
  root = Path(os.path.expanduser(data_dir)) if data_dir else default_data_dir()
  found = prepared_dir(name, root)
  if found is None and not network_reachable():
    raise ConnectionError(
        f"data.tfds_name={name!r} is not prepared in {root} and there is no network: "
        f"no verified TLS connection to {PROBE_ADDRESS[0]}:{PROBE_ADDRESS[1]}; use data.files "
        "or prepare it elsewhere (file_format='array_record') and set data.tfds_data_dir"
    )
  download = found is None
  train = _read_texts(name, train_split, root, text_key, download, "data.tfds_train_split")
  evals = _read_texts(name, eval_split, root, text_key, False, "data.tfds_eval_split")
  return train, evals, f"tfds:{name}[{train_split}|{eval_split}] in {found or root}"
