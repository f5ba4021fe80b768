"""Prepared datasets: the format, and reading it (``PreparedData``, ``StreamWindows``).

A prepared folder (written by :func:`cem_jax.data.shard_writer.prepare`) holds:

* ``tokenizer.model`` -- the SentencePiece model;
* ``{split}-{i:05d}.array_record`` -- shard ``i`` of split ``train`` / ``validation``: the
  token stream of that split's documents (each followed by EOS, as ``packing.pack``
  concatenates them), cut into records of ``RECORD_TOKENS`` tokens, little-endian
  ``token_dtype`` (``<u2`` for vocabularies up to 65,536, else ``<u4``). Validation records
  carry after their tokens the UTF-8 bytes of the text each token stands for (``<u4``,
  ``Tokenizer.encode_with_bytes``; EOS 0), the bits-per-byte denominators;
* ``{split}-{i:05d}.json`` -- the shard's sidecar (its token, record and byte counts, sha256
  and the hash of the text it encodes), written after the shard;
* ``prepare.json`` -- the fingerprint of the config and source text being prepared;
* ``manifest.json`` -- written last: sources (paths, sizes, sha256), the data config,
  tokenizer sha256, and per split the documents, tokens, exact UTF-8 bytes of the text and
  the shard list with checksums.

``PreparedData`` opens such a folder (checking the manifest's structure, every shard's size
and sha256 against it, and it against the tokenizer's vocabulary and the records ArrayRecord
counts in each shard) and serves windows of ``seq_len + 1`` tokens by position: window ``w``
is stream tokens ``[w (seq_len + 1), (w + 1) (seq_len + 1))``, read from the one or two records
holding them by ``ArrayRecordDataSource`` random access; segment ids follow from the EOS
positions.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import resource
from pathlib import Path

import numpy as np
from array_record.python import array_record_data_source, array_record_module

from cem_jax import errors
from cem_jax.data import packing, sources
from cem_jax.data import tokenizer as tokenizer_lib
from cem_jax.files import hold_folder, sha256_file

FORMAT_VERSION = 1
SPLITS = ("train", "validation")
RECORD_TOKENS = 1024
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.model"
# The data config keys that define a prepared dataset (seq_len, shuffle_seed do not).
SPEC_KEYS = ("files", "tfds_name", "tfds_data_dir", "tfds_text_key", "tfds_train_split",
             "tfds_eval_split", "builtin", "validation_fraction", "vocab_size", "tokenizer",
             "tokenizer_model_type")


class BadPreparedData(ValueError):
  """A prepared folder that cannot be read as it is: damaged (its files disagree with its
  manifest or with each other) or in another format version.

  ``str(error)`` is ``what`` then ``remedy``. The default remedy is for a folder the user
  prepared (``data.prepared_dir``); a caller that prepared the folder itself gives its own
  with :meth:`with_remedy` (``main`` rebuilds ``WORKDIR/data/<fingerprint>`` once removed).
  """

  REPREPARE = "run prepare again to rebuild it"

  def __init__(self, what: str, remedy: str = REPREPARE):
    super().__init__(f"{what}; {remedy}")
    self.what = what

  def with_remedy(self, remedy: str) -> BadPreparedData:
    """The same error with ``remedy`` (one clause, e.g. which folder to remove) as its fix."""
    return BadPreparedData(self.what, remedy)


def shard_name(split: str, index: int) -> str:
  """The file name of shard ``index`` of ``split``: ``{split}-{index:05d}.array_record``."""
  return f"{split}-{index:05d}.array_record"


def token_dtype(vocab_size: int) -> str:
  """The stored token type (little-endian numpy dtype string) for a vocabulary size."""
  return "<u2" if vocab_size <= 1 << 16 else "<u4"


# What readers take from a manifest, with its JSON types: ``{key: schema}`` an object,
# ``[schema]`` a list of them, ``object`` any value.
_SHARD_SCHEMA = {"file": str, "tokens": int, "records": int, "size": int, "sha256": str}
_SPLIT_SCHEMA = {"documents": int, "tokens": int, "characters": int, "bytes": int,
                 "fields": [str], "shards": [_SHARD_SCHEMA]}
_MANIFEST_SCHEMA = {
    "fingerprint": str, "source": str, "sources": {"kind": str},
    "config": dict.fromkeys(SPEC_KEYS, object),
    "tokenizer": {"file": str, "sha256": str, "vocab_size": int, "eos_id": int, "pad_id": int,
                  "trained_here": bool},
    "token_dtype": str, "splits": dict.fromkeys(SPLITS, _SPLIT_SCHEMA),
}
_JSON_TYPES = {str: "a string", int: "an integer", bool: "true or false"}


def _schema_error(value, schema, where: str) -> str | None:
  """The first place where ``value`` departs from ``schema``, as one phrase, or None."""
  if isinstance(schema, dict):
    if not isinstance(value, dict):
      return f"{where} is {json.dumps(value)[:40]}, not an object"
    for key, sub in schema.items():
      name = f"{where}.{key}" if where else key
      if key not in value:
        return f"{name} is missing"
      if error := _schema_error(value[key], sub, name):
        return error
    return None
  if isinstance(schema, list):
    if not isinstance(value, list):
      return f"{where} is {json.dumps(value)[:40]}, not a list"
    for i, item in enumerate(value):
      if error := _schema_error(item, schema[0], f"{where}[{i}]"):
        return error
    return None
  # bool is an int to Python, not to JSON.
  if schema is not object and (not isinstance(value, schema) or (
      schema is int and isinstance(value, bool))):
    return f"{where} is {json.dumps(value)[:40]}, not {_JSON_TYPES[schema]}"
  return None


def _manifest_error(manifest: dict) -> str | None:
  """What makes a manifest (of the current format) unlike any that prepare writes, or None:
  its structure, file names and token counts, checked without opening a shard."""
  if error := _schema_error(manifest, _MANIFEST_SCHEMA, ""):
    return error
  if manifest["sources"]["kind"] == "files" and (
      error := _schema_error(manifest["sources"], {"files": [{"path": str}]}, "sources")):
    return error
  tok = manifest["tokenizer"]
  if tok["file"] != TOKENIZER:
    return f"tokenizer.file is {tok['file']!r}, prepare writes {TOKENIZER!r}"
  if tok["vocab_size"] < 1:
    return f"tokenizer.vocab_size is {tok['vocab_size']}, not >= 1"
  if manifest["token_dtype"] != token_dtype(tok["vocab_size"]):
    return (f"token_dtype is {manifest['token_dtype']!r}, prepare writes "
            f"{token_dtype(tok['vocab_size'])!r} for vocab_size {tok['vocab_size']}")
  for split in SPLITS:
    info, where = manifest["splits"][split], f"splits.{split}"
    fields = ["tokens", "bytes"] if split == "validation" else ["tokens"]
    if info["fields"] != fields:
      return f"{where}.fields is {info['fields']}, prepare writes {fields}"
    if not info["shards"]:
      return f"{where}.shards is empty"
    for i, shard in enumerate(info["shards"]):
      name, tokens = shard_name(split, i), shard["tokens"]
      if shard["file"] != name:
        return f"{where}.shards[{i}].file is {shard['file']!r}, prepare writes {name!r}"
      # Records of RECORD_TOKENS tokens, the last one partial: the reader relies on it.
      if tokens < 0 or shard["records"] != -(-tokens // RECORD_TOKENS):
        return (f"{where}.shards[{i}] ({name}) has {tokens} tokens in {shard['records']} "
                f"records of {RECORD_TOKENS}")
    total = sum(shard["tokens"] for shard in info["shards"])
    if info["tokens"] != total:
      return f"{where}.tokens is {info['tokens']}, its shards hold {total}"
  return None


@dataclasses.dataclass(frozen=True)
class _WholeFile:
  """An ``ArrayRecordDataSource`` file instruction: all ``take`` records of ``filename``."""
  filename: str
  take: int
  skip: int = 0

  @property
  def examples_in_shard(self) -> int:
    return self.take


class TokenStream:
  """One split's token stream (and, for validation, per-token text bytes), read by position.

  Args:
    directory: the prepared folder.
    info: the split's manifest entry (as ``PreparedData.open_manifest`` checks it).
    dtype: the manifest's ``token_dtype``.

  Raises:
    BadPreparedData: a shard's records, as ArrayRecord counts them, or the length of its last
      record disagree with the manifest (one line naming the folder and the shard).
    RuntimeError: a shard is not an ArrayRecord file.
  """

  def __init__(self, directory: Path, info: dict, dtype: str):
    self.num_tokens = int(info["tokens"])
    self.has_bytes = "bytes" in info["fields"]
    self._dtype = np.dtype(dtype)
    self._record = RECORD_TOKENS
    shards = info["shards"]
    self._tok_off = np.cumsum([0] + [s["tokens"] for s in shards]).tolist()
    self._rec_off = np.cumsum([0] + [s["records"] for s in shards]).tolist()
    files = []
    for s in shards:
      path = os.fspath(directory / s["file"])
      reader = array_record_module.ArrayRecordReader(path)
      records = reader.num_records()
      reader.close()
      if records != s["records"]:
        raise BadPreparedData(f"{directory}: inconsistent prepared data: {s['file']} holds "
                              f"{records} records, {MANIFEST} says {s['records']}")
      files.append(_WholeFile(path, records))
    # Counted here once, so the source need not open every file again to count.
    self._source = array_record_data_source.ArrayRecordDataSource(files)
    # The last record of each shard holds the rest of its tokens: its length checks the
    # manifest's token count and token_dtype against what was written.
    width = self._dtype.itemsize + (4 if self.has_bytes else 0)
    last = [(s, self._rec_off[i + 1] - 1) for i, s in enumerate(shards) if s["records"]]
    for (s, _), data in zip(last, self._source.__getitems__([r for _, r in last]),
                            strict=True):
      want = (s["tokens"] - (s["records"] - 1) * RECORD_TOKENS) * width
      if len(data) != want:
        raise BadPreparedData(
            f"{directory}: inconsistent prepared data: the last record of {s['file']} has "
            f"{len(data)} bytes, {MANIFEST} says {want} ({s['tokens']} tokens of "
            f"{self._dtype.str}{' and <u4 bytes' if self.has_bytes else ''})")

  def _record_of(self, pos: int) -> tuple[int, int, int]:
    """(global record index, offset in it, tokens left in it) of stream position ``pos``."""
    s = bisect.bisect_right(self._tok_off, pos) - 1
    local = pos - self._tok_off[s]
    r, off = divmod(local, self._record)
    left = min(self._record, self._tok_off[s + 1] - self._tok_off[s] - r * self._record) - off
    return self._rec_off[s] + r, off, left

  def read(self, starts: np.ndarray, length: int, fill: int
           ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Returns ``(tokens, nbytes, valid)`` of rows ``stream[start : start + length]`` for each
    of ``starts`` (int ``[rows]``, token offsets into the split's stream).

    ``tokens``: int32 ``[rows, length]``, ``fill`` past the end of the stream; ``nbytes``:
    int32 likewise (0 past the end), None for a split without bytes; ``valid``: int64
    ``[rows]``, the real tokens per row.
    """
    plan = []
    for start in np.asarray(starts, np.int64).tolist():
      pos, end, row = start, min(start + length, self.num_tokens), []
      while pos < end:
        rec, off, left = self._record_of(pos)
        take = min(left, end - pos)
        row.append((rec, off, take))
        pos += take
      plan.append(row)
    wanted = sorted({rec for row in plan for rec, _, _ in row})
    raw = dict(zip(wanted, self._source.__getitems__(wanted), strict=True)) if wanted else {}
    rows = len(plan)
    tokens = np.full((rows, length), fill, np.int32)
    nbytes = np.zeros((rows, length), np.int32) if self.has_bytes else None
    valid = np.zeros(rows, np.int64)
    decoded: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
    for i, row in enumerate(plan):
      at = 0
      for rec, off, take in row:
        if rec not in decoded:
          data = raw[rec]
          if self.has_bytes:
            n = len(data) // (self._dtype.itemsize + 4)
            decoded[rec] = (np.frombuffer(data, self._dtype, n),
                            np.frombuffer(data, "<u4", n, offset=n * self._dtype.itemsize))
          else:
            decoded[rec] = (np.frombuffer(data, self._dtype), None)
        t, b = decoded[rec]
        tokens[i, at:at + take] = t[off:off + take]
        if nbytes is not None:
          nbytes[i, at:at + take] = b[off:off + take]
        at += take
      valid[i] = at
    return tokens, nbytes, valid


class StreamWindows:
  """Packed windows of ``seq_len + 1`` tokens over a ``TokenStream``, like ``packing.pack``.

  Args:
    stream: the split's tokens.
    seq_len: ``data.seq_len``.
    eos_id, pad_id: tokenizer ids.
    keep_tail: as ``packing.pack`` (False for train, True for validation).
    split: split name, for errors.

  Raises:
    ValueError: as ``packing.pack`` when the split holds no window.
  """

  def __init__(self, stream: TokenStream, seq_len: int, eos_id: int, pad_id: int, *,
               keep_tail: bool, split: str):
    self.num_windows = packing.count_windows(stream.num_tokens, seq_len, keep_tail=keep_tail,
                                             split=split)
    self.stream, self.eos_id, self.pad_id = stream, int(eos_id), int(pad_id)
    self.width = seq_len + 1

  @property
  def seq_len(self) -> int:
    return self.width - 1

  @property
  def has_bytes(self) -> bool:
    return self.stream.has_bytes

  def rows(self, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Windows ``idx`` as ``packing.Windows.rows`` returns them."""
    idx = np.asarray(idx, np.int64)
    tokens, nbytes, valid = self.stream.read(idx * self.width, self.width, self.pad_id)
    pos = np.arange(self.width)
    real = pos[None, :] < valid[:, None]
    # EOS ends its document: positions after k EOS of the window are in its (k+1)-th document.
    eos_before = np.cumsum(tokens == self.eos_id, axis=1) - (tokens == self.eos_id)
    segment_ids = np.where(real, eos_before + 1, 0).astype(np.int32)
    return {"tokens": tokens, "segment_ids": segment_ids, "nbytes": nbytes}


def manifest_file(directory: str | os.PathLike) -> Path:
  """The manifest's path in a ``data.prepared_dir`` (``~`` expanded) once the folder has one,
  not yet read: what :meth:`PreparedData.open_manifest` reads, checked alone by ``main`` before
  jax loads.

  Raises:
    ValueError: no such folder, or no manifest in it (one line naming the folder and what to
      do).
  """
  directory = Path(os.path.expanduser(os.fspath(directory)))
  path = directory / MANIFEST
  if not directory.is_dir():
    what = "is not a folder" if directory.exists() else "does not exist"
    raise ValueError(f"data.prepared_dir={os.fspath(directory)} {what}; allowed: a folder "
                     "python -m cem_jax.prepare --out=DIR wrote (or leave it empty)")
  if not path.is_file():
    if _being_prepared(directory):
      raise ValueError(f"data.prepared_dir={os.fspath(directory)}: no {MANIFEST} yet: "
                       "another process is preparing it; wait for it to end")
    raise ValueError(
        f"data.prepared_dir={os.fspath(directory)}: no {MANIFEST} (not a prepared dataset, "
        "or its prepare did not finish); run python -m cem_jax.prepare --out=DIR again")
  return path


class PreparedData:
  """A prepared folder opened for reading: its manifest, tokenizer and split streams."""

  def __init__(self, directory: Path, manifest: dict):
    """Loads the tokenizer and the streams of a manifest that ``open_manifest`` returned.

    Raises:
      BadPreparedData: the tokenizer or a shard disagrees with the manifest (one line naming
        the folder and what disagrees).
      RuntimeError: the tokenizer or a shard is not a file of its kind.
    """
    self.directory = directory
    self.manifest = manifest
    self.tokenizer = tokenizer_lib.Tokenizer.from_file(directory / manifest["tokenizer"]["file"])
    for key in ("vocab_size", "eos_id", "pad_id"):
      ours, theirs = getattr(self.tokenizer, key), manifest["tokenizer"][key]
      if ours != theirs:
        raise BadPreparedData(f"{directory}: inconsistent prepared data: {TOKENIZER} has {key} "
                              f"{ours}, {MANIFEST} says {theirs}")
    self.streams = {split: TokenStream(directory, manifest["splits"][split],
                                       manifest["token_dtype"]) for split in SPLITS}

  @staticmethod
  def open_manifest(directory: str | os.PathLike, verify: bool = True) -> dict:
    """Reads ``directory``'s manifest and checks that every file it lists is there, of its
    size and (``verify``) sha256.

    Raises:
      ValueError: no such folder, or no manifest in it (one line naming the folder and what to
        do).
      BadPreparedData: a damaged file or one of another format version (one line naming it
        and what to do); a manifest unlike any that prepare writes (its structure, names,
        token counts) is damaged.
    """
    path = manifest_file(directory)
    directory = path.parent
    try:
      manifest = json.loads(path.read_text())
    except ValueError as e:
      raise BadPreparedData(f"{path} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
      raise BadPreparedData(
          f"{path}: damaged manifest: it is {json.dumps(manifest)[:40]}, not an object")
    # Missing or not ints (a hand edit, another program's JSON), they were named as another
    # format: "format None with None-token records", or for the string "1024" "with
    # 1024-token records; this version reads format 1 with 1024".
    if error := _schema_error(manifest, {"format_version": int}, ""):
      raise BadPreparedData(f"{path}: damaged manifest: {error}")
    if manifest["format_version"] == FORMAT_VERSION and (
        error := _schema_error(manifest, {"record_tokens": int}, "")):
      raise BadPreparedData(f"{path}: damaged manifest: {error}")
    if manifest["format_version"] != FORMAT_VERSION or manifest[
        "record_tokens"] != RECORD_TOKENS:
      raise BadPreparedData(
          f"{path}: format {manifest.get('format_version')} with {manifest.get('record_tokens')}"
          f"-token records; this version reads format {FORMAT_VERSION} with {RECORD_TOKENS}")
    if error := _manifest_error(manifest):
      raise BadPreparedData(f"{path}: damaged manifest: {error}")
    files = [(manifest["tokenizer"]["file"], None, manifest["tokenizer"]["sha256"])]
    for split in SPLITS:
      files += [(s["file"], s["size"], s["sha256"]) for s in manifest["splits"][split]["shards"]]
    for name, size, sha in files:
      f = directory / name
      try:
        actual = f.stat().st_size
      except OSError as e:
        raise BadPreparedData(
            f"{f}: damaged prepared data: cannot read it ({e.strerror})") from None
      if size is not None and actual != size:
        raise BadPreparedData(f"{f}: damaged prepared data: {actual} bytes, the manifest says "
                              f"{size}")
      if verify and sha256_file(f) != sha:
        raise BadPreparedData(f"{f}: damaged prepared data: sha256 differs from the manifest's")
    return manifest

  @classmethod
  def open(cls, directory: str | os.PathLike, data_config=None,
           verify: bool = True) -> PreparedData:
    """Opens a prepared folder; with ``data_config`` checks that it fits (see ``check_fits``).
    ``verify=False`` checks the files' sizes, not their sha256: for a process whose peer has
    just verified the same folder (at corpus scale each hash is a read of every shard).
    Every shard stays open while the data are read: the soft limit of open files is raised
    towards the hard one where it is too low.

    Raises:
      ValueError: no manifest, a dataset not made for the config (one line naming the
        folder or field), or more shards than this process may open.
      BadPreparedData: a damaged manifest/shard/tokenizer, one that disagrees with the
        manifest, or another format version (one line naming the file or folder).
    """
    directory = Path(os.path.expanduser(os.fspath(directory)))
    manifest = cls.open_manifest(directory, verify=verify)
    if data_config is not None:
      check_fits(manifest, data_config, directory, verify)
    allow_open_files(sum(len(manifest["splits"][s]["shards"]) for s in SPLITS), directory)
    try:
      return cls(directory, manifest)
    except RuntimeError as e:  # array_record/sentencepiece reading a file that is not theirs
      raise BadPreparedData(
          f"{directory}: damaged prepared data: {errors.first_line(e)}") from None

OPEN_FILES_BESIDE_SHARDS = 256  # checkpoints, logs, sockets, jax's own files


def allow_open_files(shards: int, directory: Path) -> None:
  """Raises this process's soft limit of open files (``RLIMIT_NOFILE``) so that ``shards``
  readers fit beside ``OPEN_FILES_BESIDE_SHARDS`` others, up to the hard limit (a common soft
  limit of 1024 is ~17 GB of text in shards).

  Raises:
    ValueError: the hard limit is too low (one line naming the folder, the counts and the fix).
  """
  need = shards + OPEN_FILES_BESIDE_SHARDS
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft == resource.RLIM_INFINITY or soft >= need:
    return
  if hard != resource.RLIM_INFINITY and hard < need:
    raise ValueError(f"{directory}: {shards} shards stay open while reading, but this process "
                     f"may open {hard} files (hard limit); raise it (ulimit -Hn {need})")
  resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _being_prepared(directory: Path) -> bool:
  """Whether another process holds ``directory`` (a prepare writing it:
  :func:`cem_jax.files.hold_folder`)."""
  if not directory.is_dir():
    return False
  try:
    with hold_folder(directory, "held", os.fspath(directory), "a prepare"):
      return False
  except ValueError:
    return True


def check_fits(manifest: dict, data_config, directory: Path, verify: bool = True) -> None:
  """Checks that a prepared manifest fits the ``data`` config: equal ``vocab_size``, the same
  given tokenizer (by sha256), and the same source where the config names one (``data.files``
  or ``data.tfds_name`` left empty take the prepared dataset's; given ``data.files`` must be
  the same paths with the same contents, by size and (``verify``) sha256, ~1 s/GB; a
  catalog's splits and text feature must match; ``validation_fraction`` and
  the trained tokenizer's model type must match). ``seq_len`` and ``shuffle_seed`` do not
  matter: windows are cut when read.

  Raises:
    ValueError: one line naming the field, both values and the folder.
  """
  d, saved = data_config, manifest["config"]
  where = f"data.prepared_dir={os.fspath(directory)}"

  def mismatch(field, ours, theirs):
    return ValueError(f"data.{field}={ours!r} does not fit {where}, prepared with {theirs!r}; "
                      f"use the same value or prepare again")

  if manifest["tokenizer"]["vocab_size"] != d.vocab_size:
    raise mismatch("vocab_size", d.vocab_size, manifest["tokenizer"]["vocab_size"])
  if d.tokenizer:
    path = Path(os.path.expanduser(d.tokenizer))
    sha = sha256_file(path) if path.is_file() else "missing"
    if sha != manifest["tokenizer"]["sha256"]:
      raise mismatch("tokenizer", d.tokenizer, saved["tokenizer"] or "a trained tokenizer")
  elif manifest["tokenizer"]["trained_here"] and (
      d.tokenizer_model_type != saved["tokenizer_model_type"]):
    raise mismatch("tokenizer_model_type", d.tokenizer_model_type, saved["tokenizer_model_type"])
  kind = manifest["sources"]["kind"]
  if d.files:
    ours = [os.fspath(p) for p in sources.text_lib.resolve_files(d.files)]
    theirs = [f["path"] for f in manifest["sources"].get("files", [])]
    if ours != theirs and d.files == saved["files"] and kind == "files":
      # The same globs matching other files: the message names a file, not the glob twice.
      gained, lost = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
      what = (f"it now also matches {gained[0]}" if gained else
              f"it no longer matches {lost[0]}" if lost else "it matches them in another order")
      raise ValueError(f"data.files={d.files!r} matches other files than {where} was prepared "
                       f"from ({what}; files now: {len(ours)}, then: {len(theirs)}); prepare "
                       "again, or leave data.files empty to train on the prepared tokens")
    if ours != theirs:
      raise mismatch("files", d.files, saved["files"] or f"a {kind} source")
    # The same paths with other contents (a file edited since) would train on the old tokens.
    for record in manifest["sources"]["files"]:
      path, then = record["path"], (record.get("size"), record.get("sha256"))
      # Unverified (a peer process just hashed the same files), the size alone.
      now = (os.path.getsize(path), sha256_file(path) if verify else then[1])
      if now != then:
        raise ValueError(f"data.files: {path} changed since {where} was prepared from it "
                         f"({then[0]} bytes, sha256 {str(then[1])[:12]}; now {now[0]} bytes, "
                         f"sha256 {now[1][:12]}); prepare again, or leave data.files empty to "
                         "train on the prepared tokens")
  if d.tfds_name and d.tfds_name != saved["tfds_name"]:
    raise mismatch("tfds_name", d.tfds_name, saved["tfds_name"] or f"a {kind} source")
  if d.tfds_name:  # the splits and the feature are the catalog source's data too
    for key in ("tfds_train_split", "tfds_eval_split", "tfds_text_key"):
      if d[key] != saved[key]:
        raise mismatch(key, d[key], saved[key])
  if not d.files and not d.tfds_name and kind == "builtin" and d.builtin != saved["builtin"]:
    raise mismatch("builtin", d.builtin, saved["builtin"])
  if kind != "tfds" and d.validation_fraction != saved["validation_fraction"]:
    raise mismatch("validation_fraction", d.validation_fraction, saved["validation_fraction"])
