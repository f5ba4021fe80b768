"""Writing a prepared dataset: ``prepare(data_config, out_dir)`` and ``prepared_for``.

``prepare`` trains (or loads) the tokenizer and writes, in ``out_dir``, the files
:mod:`cem_jax.data.prepared` describes and reads (the format lives there).

Shards are defined by the input: the text of a split, cut into pieces of at most
``packing.ENCODE_PIECE_CHARS`` characters exactly as the in-memory path encodes it, is grouped
into shards of about ``shard_chars`` characters. Each shard is encoded and written on its own
(in ``workers`` processes), to a temporary name then renamed, so a killed prepare leaves only
whole shards and no manifest; running it again skips every shard whose sidecar matches and
writes the rest, and with a complete, intact manifest it is a no-op. A prepare that fails
before its first shard (bad input) removes what it wrote, and what a killed one left before its
first shard gives way to a prepare of other input, so neither blocks the re-run.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from array_record.python import array_record_module
from tqdm import tqdm

from cem_jax import cpus, errors, signals
from cem_jax.data import packing, sources
from cem_jax.data import tokenizer as tokenizer_lib
from cem_jax.data.prepared import (
    FORMAT_VERSION,
    MANIFEST,
    RECORD_TOKENS,
    SPEC_KEYS,
    SPLITS,
    TOKENIZER,
    PreparedData,
    shard_name,
    token_dtype,
)
from cem_jax.files import (
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    hold_folder,
    sha256_file,
    temporary_of,
)

# About 16 MB of text per shard: a few seconds of encoding, so a killed prepare loses little
# and the shards of a large corpus keep every worker busy.
SHARD_CHARS = 1 << 24
# Below this many characters the text is encoded in this process: starting workers would
# take longer than the encoding (the tiny default corpus is ~1.8M characters).
POOL_MIN_CHARS = 1 << 23
# group_size:1 makes every record directly addressable (random access reads one record).
WRITER_OPTIONS = "group_size:1"
PROGRESS = "prepare.json"


def _sha256_bytes(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _write_json(path: Path, obj) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  # indent=1, sorted keys, no final newline: byte for byte the manifests written so far.
  atomic_write_json(path, obj, indent=1, sort_keys=True)


def fingerprint(data_config, identity: dict) -> str:
  """Returns a 16-hex-digit hash of the source identity, the defining ``data`` keys (the given
  tokenizer by content) and the format: equal fingerprints mean the same prepared data."""
  spec = {k: data_config[k] for k in SPEC_KEYS}
  if data_config.tokenizer:
    path = Path(os.path.expanduser(data_config.tokenizer))
    spec["tokenizer"] = sha256_file(path) if path.is_file() else os.fspath(path)
  # How a tokenizer is trained and the text cut for encoding also decide the tokens.
  how = [tokenizer_lib.TRAINER_SETTINGS, tokenizer_lib.TRAIN_CHUNK_CHARS,
         tokenizer_lib.MAX_TRAIN_CHARS, packing.ENCODE_PIECE_CHARS]
  blob = json.dumps([FORMAT_VERSION, RECORD_TOKENS, spec, identity, how], sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _shard_tasks(docs: Iterable[str], split: str, shard_chars: int) -> Iterator[dict]:
  """Groups the split's encode pieces (``packing.encode_pieces`` of each document) into shards."""
  pieces, ends, size, index = [], [], 0, 0
  for doc in docs:
    doc_pieces = packing.encode_pieces(doc) or [""]
    for j, piece in enumerate(doc_pieces):
      pieces.append(piece)
      ends.append(j == len(doc_pieces) - 1)
      size += len(piece)
      if size >= shard_chars:
        yield {"split": split, "index": index, "pieces": pieces, "ends": ends}
        pieces, ends, size, index = [], [], 0, index + 1
  if pieces:
    yield {"split": split, "index": index, "pieces": pieces, "ends": ends}


def _task_hash(task: dict) -> str:
  h = hashlib.sha256()
  for piece, end in zip(task["pieces"], task["ends"], strict=True):
    data = piece.encode("utf-8")
    h.update(len(data).to_bytes(8, "little") + bytes([end]))
    h.update(data)
  return h.hexdigest()


def _sidecar(out_dir: Path, split: str, index: int) -> Path:
  return out_dir / f"{split}-{index:05d}.json"


_worker_tokenizer: tokenizer_lib.Tokenizer | None = None


def _init_worker(model: bytes) -> None:
  global _worker_tokenizer
  _worker_tokenizer = tokenizer_lib.Tokenizer(model)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@contextlib.contextmanager
def _sigint_ignored():
  """SIGINT ignored while the block starts processes, which then keep it ignored. A terminal's
  Ctrl-C goes to the whole process group: each worker printed a KeyboardInterrupt traceback
  before the parent's one line. The parent alone handles it; leaving the pool's block
  terminates the workers. Only the main thread may set a handler: elsewhere a no-op."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def _init_pool_worker(model: bytes, parent: int) -> None:
  """``_init_worker`` in a pool's worker process, which dies with ``parent`` (Linux).

  A worker outliving a killed prepare (``kill -9`` ends the parent only) would go on writing
  shards into a folder whose lock died with the parent: into a re-run's work, or another
  config's. Elsewhere the workers still end once their current shard is written.
  """
  if sys.platform.startswith("linux"):
    try:
      libc = ctypes.CDLL(None, use_errno=True)
      libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
      pass
    if os.getppid() != parent:  # died before the signal was asked for
      os.kill(os.getpid(), signal.SIGKILL)
  _init_worker(model)


def _encode_and_write(job: tuple[dict, str, str, str]) -> dict:
  """Encodes one shard task and writes it atomically with its sidecar; returns the sidecar."""
  task, out_dir, dtype, tok_sha = job
  tok = _worker_tokenizer
  out_dir = Path(out_dir)
  with_bytes = task["split"] == "validation"
  ids_parts, byte_parts = [], []
  eos = np.array([tok.eos_id], np.int32)
  for piece, end in zip(task["pieces"], task["ends"], strict=True):
    if with_bytes:
      ids, nbytes = tok.encode_with_bytes(piece)
      byte_parts += [nbytes] + ([np.zeros(1, np.int32)] if end else [])
    else:
      ids = np.asarray(tok.encode(piece), np.int32)
    ids_parts += [ids] + ([eos] if end else [])
  ids = np.concatenate(ids_parts).astype(dtype)
  nbytes = np.concatenate(byte_parts).astype("<u4") if with_bytes else None
  name = shard_name(task["split"], task["index"])
  path = out_dir / name
  with atomic_path(path) as tmp:
    try:
      writer = array_record_module.ArrayRecordWriter(tmp, WRITER_OPTIONS)
      for start in range(0, len(ids), RECORD_TOKENS):
        record = ids[start:start + RECORD_TOKENS].tobytes()
        if nbytes is not None:
          record += nbytes[start:start + RECORD_TOKENS].tobytes()
        writer.write(record)
      writer.close()
    except RuntimeError as e:
      # ArrayRecord's one exception type for a failed write (a full disk): an OSError naming
      # the shard is a one-line error; a RuntimeError was a traceback through the pool.
      raise OSError(f"{path}: cannot be written ({errors.first_line(e)})") from None
    digest = sha256_file(tmp)
  meta = _task_fields(task) | {
      "tokens": int(len(ids)), "records": -(-len(ids) // RECORD_TOKENS),
      "size": path.stat().st_size, "sha256": digest, "tokenizer_sha256": tok_sha,
  }
  _write_json(_sidecar(out_dir, task["split"], task["index"]), meta)
  return meta


def _task_fields(task: dict) -> dict:
  """The sidecar fields that follow from a shard task's text alone."""
  return {"file": shard_name(task["split"], task["index"]), "text_sha256": _task_hash(task),
          "documents": int(sum(task["ends"])), "characters": int(sum(map(len, task["pieces"]))),
          "bytes": int(sum(len(piece.encode("utf-8")) for piece in task["pieces"]))}


# The sidecar fields counted from the shard as written (``_encode_and_write``).
_COUNTED = frozenset({"tokens", "records", "size", "sha256"})


def _done(out_dir: Path, task: dict, tok_sha: str, dtype: str) -> dict | None:
  """The sidecar of an intact, already written shard of ``task``, or None.

  The sidecar is trusted only where it is checked: its text fields against the task's text,
  its size and sha256 against the shard, and its token and record counts against the records
  ArrayRecord reads there (as ``prepared.TokenStream`` checks them). A sidecar damaged in any
  of them (not an object, a field missing, a count off by one) has its shard written again:
  taken as it is, it would put its counts in the manifest, and the next start would refuse the
  folder after every re-run of prepare.
  """
  side = _sidecar(out_dir, task["split"], task["index"])
  try:
    meta = json.loads(side.read_text())
    want = _task_fields(task) | {"tokenizer_sha256": tok_sha}
    if (not isinstance(meta, dict) or set(meta) != set(want) | _COUNTED
        or any(type(meta[k]) is not type(v) or meta[k] != v for k, v in want.items())
        or any(type(meta[k]) is not int for k in ("tokens", "records", "size"))):
      return None
    path = out_dir / meta["file"]
    if path.stat().st_size != meta["size"] or sha256_file(path) != meta["sha256"]:
      return None
    tokens, records = meta["tokens"], meta["records"]
    width = np.dtype(dtype).itemsize + (4 if task["split"] == "validation" else 0)
    reader = array_record_module.ArrayRecordReader(os.fspath(path))
    try:
      if reader.num_records() != records:
        return None
      last = reader.read([records - 1])[0]
    finally:
      reader.close()
  except (OSError, ValueError, RuntimeError):  # unreadable or not JSON; not an ArrayRecord file
    return None
  return meta if len(last) == (tokens - (records - 1) * RECORD_TOKENS) * width else None


def _tokenizer(data_config, splits: sources.TextSplits, out_dir: Path, fp: str
               ) -> tuple[tokenizer_lib.Tokenizer, bytes, bool]:
  path = out_dir / TOKENIZER
  recorded = _saved_field(out_dir / PROGRESS, "tokenizer_sha256")
  if data_config.tokenizer:
    given = tokenizer_lib.load_tokenizer(data_config.tokenizer, data_config.vocab_size)
    model = given.path.read_bytes()
    trained = False
  elif path.is_file() and sha256_file(path) == recorded:
    # An interrupted prepare of the same fingerprint trained it already. Only the model it
    # recorded: one damaged since (or left by an older cem_jax) is trained again, never used.
    model, trained = path.read_bytes(), True
  else:
    model = tokenizer_lib.train_model(splits.train, data_config.vocab_size,
                                      data_config.tokenizer_model_type)
    trained = True
  if not path.is_file() or path.read_bytes() != model:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, model)
  if trained and recorded != _sha256_bytes(model):
    _write_progress(out_dir, fp, _sha256_bytes(model))
  return tokenizer_lib.Tokenizer(model, path=path), model, trained


def _holds_data(out_dir: Path) -> bool:
  """Whether ``out_dir`` holds what a re-run keeps: a manifest, a finished shard or sidecar."""
  prefixes = tuple(f"{split}-" for split in SPLITS)
  return any(p.name == MANIFEST or (p.name.startswith(prefixes)
                                    and p.suffix in (".array_record", ".json"))
             for p in out_dir.iterdir())


def _remove_leftovers(out_dir: Path, *, progress: bool, tokenizer: bool) -> None:
  """Removes the temporaries of writes killed before their rename (shards, sidecars, the
  manifest, the tokenizer, ``prepare.json``) and, as asked, ``prepare.json`` and the
  tokenizer. Other files are not ours: they stay. One prepare writes a folder at a time."""
  for path in out_dir.iterdir():
    name = path.name
    # (``.array_record.tmp<pid>``: a shard's temporary before it was an atomic_path)
    if (temporary_of(name) is not None or ".array_record.tmp" in name
        or (progress and name == PROGRESS) or (tokenizer and name == TOKENIZER)):
      path.unlink(missing_ok=True)


def _saved_field(path: Path, key: str) -> str | None:
  """The string ``path`` (``prepare.json`` or the manifest) records under ``key``, or None:
  missing, unreadable, or not a JSON object with a string there."""
  try:
    saved = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  value = saved.get(key) if isinstance(saved, dict) else None
  return value if isinstance(value, str) else None


def _write_progress(out_dir: Path, fp: str, tokenizer_sha256: str | None = None) -> None:
  """``prepare.json``: the folder's fingerprint and, once trained here, the tokenizer's
  sha256 (a re-run reuses only that tokenizer)."""
  progress = {"fingerprint": fp, "format_version": FORMAT_VERSION}
  if tokenizer_sha256 is not None:
    progress["tokenizer_sha256"] = tokenizer_sha256
  _write_json(out_dir / PROGRESS, progress)


def _named(out_dir: Path, flag: str) -> str:
  return f"{flag}={os.fspath(out_dir)}" if flag else os.fspath(out_dir)


def _fix(flag: str, fix: str) -> str:
  # A folder main chose (WORKDIR/data/<fingerprint>) is main's to fill: the user's fix is to
  # remove it, not to choose another.
  return fix if flag else "remove it and start again: it is prepared anew"


def _exclusive(out_dir: Path, flag: str):
  """Holds ``out_dir`` for one prepare (:func:`cem_jax.files.hold_folder`): two prepares of
  other configs in one folder would each write shards over the other's and both report their
  own dataset.

  Raises:
    ValueError: another process holds ``out_dir``, or removed it while this one waited for it
      (one line naming the folder and the fix).
  """
  return hold_folder(
      out_dir, f"{_named(out_dir, flag)} is in use: another process is preparing data in it (a "
      "second prepare, or a main preparing its data); wait for it to end and run again (with "
      "the same config and text the run again has nothing left to do)",
      _named(out_dir, flag), "a second prepare")


def _claim(out_dir: Path, fp: str, flag: str) -> bool:
  """Makes the existing folder ``out_dir`` the folder of fingerprint ``fp``: empty, already
  ``fp``'s, or left by a prepare of other input that failed or was killed before its first
  shard (nothing in it is worth keeping). A damaged or lost ``prepare.json`` beside an intact
  manifest of ``fp`` is written again. Returns whether ``prepare.json`` was written now (the
  folder claimed afresh). ``flag``: as ``prepare``'s.

  Raises:
    ValueError: ``out_dir`` holds another dataset, holds shards beside a damaged
      ``prepare.json`` and no intact manifest, is not empty and holds no prepared dataset, or
      cannot be written in (read-only, no permission, full).
  """
  progress = out_dir / PROGRESS
  previous = _saved_field(progress, "fingerprint")
  if previous is None and (out_dir / MANIFEST).is_file():
    # prepare.json damaged or lost: the manifest names the dataset.
    previous = _saved_field(out_dir / MANIFEST, "fingerprint")
    if previous == fp:
      _write_progress(out_dir, fp)
  if previous == fp:  # a re-run: keep the work, not the temporaries of killed writes
    _remove_leftovers(out_dir, progress=False, tokenizer=False)
    return False
  if previous is not None or progress.is_file():
    if _holds_data(out_dir):
      if previous is None:
        raise ValueError(
            f"{_named(out_dir, flag)}: {os.fspath(progress)} is damaged (not a JSON object "
            "with a fingerprint) and no intact manifest tells which dataset this is; "
            f"{_fix(flag, 'choose another folder or delete it')}")
      raise ValueError(
          f"{_named(out_dir, flag)} holds another dataset (fingerprint {previous}, this "
          f"config and text: {fp}); {_fix(flag, 'choose another folder or delete it')}")
    logging.getLogger(__name__).info(
        "%s holds no shard of the dataset %s: preparing %s there instead", out_dir, previous, fp)
    # Its tokenizer was trained on other input: it must not be reused.
    _remove_leftovers(out_dir, progress=True, tokenizer=True)
  elif any(out_dir.iterdir()):
    raise ValueError(f"{_named(out_dir, flag)} is not empty and holds no prepared dataset; "
                     f"{_fix(flag, 'choose an empty or new folder')}")
  try:
    _write_progress(out_dir, fp)
  except OSError as e:  # the first write: a read-only folder was OSError's line naming a .tmp
    raise ValueError(f"{_named(out_dir, flag)}: cannot write in the folder ({e.strerror}); "
                     f"{_fix(flag, 'choose a folder you can write in')}") from None
  return True


def prepare(data_config, out_dir: str | os.PathLike, *, shard_chars: int = SHARD_CHARS,
            workers: int | None = None, flag: str = "--out") -> Path:
  """Prepares the data of ``data_config`` in ``out_dir`` (see the module docstring).

  A prepare that fails before its first shard removes what it wrote (so a re-run with fixed
  input finds no trace of it); a killed one leaves its work to the next run of the same input,
  and to a run of other input only when it wrote no shard.

  Args:
    data_config: the ``data`` group of a resolved config.
    out_dir: the dataset folder; created if missing. A folder holding another dataset
      (another fingerprint) is refused; what a prepare of other input left before its first
      shard is replaced.
    shard_chars: characters of text per shard (recorded in the manifest).
    workers: encoding processes; None = ``cpus.usable()`` (the usable CPUs), at most one
      per ``shard_chars`` of text, for corpora of at least ``POOL_MIN_CHARS`` characters (and
      catalog datasets, whose size is not known beforehand), else this process alone. Each
      holds one shard's text and tokens, about 100 MB.
    flag: how errors name ``out_dir``: ``--out=DIR`` (prepare's command line), or, with
      ``flag=""``, the folder alone with its removal as the fix (main's
      ``WORKDIR/data/<fingerprint>``, a folder the user did not name).

  Returns:
    ``out_dir`` as a Path.

  Raises:
    ValueError: bad config values or input (one line naming the field or file), or
      ``out_dir`` is a file, cannot be created or written in, holds another dataset, is not
      empty and holds no prepared dataset, or another process is preparing data in it.
    ConnectionError: a TFDS catalog dataset is not prepared and there is no network.
    FileNotFoundError: ``data.tokenizer`` names no file.
  """
  log = logging.getLogger(__name__)
  out_dir = Path(os.path.expanduser(os.fspath(out_dir)))
  if out_dir.exists() and not out_dir.is_dir():
    raise ValueError(f"{_named(out_dir, flag)} is a file; "
                     f"{_fix(flag, 'choose a new or empty folder')}")
  identity = sources.source_identity(data_config)
  fp = fingerprint(data_config, identity)
  manifest_path = out_dir / MANIFEST
  made_dir = not out_dir.exists()
  try:
    out_dir.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f"{_named(out_dir, flag)}: cannot create the folder ({e.strerror}); "
                     f"{_fix(flag, 'choose a folder that can be created')}") from None

  def remove_if_made_and_empty() -> None:
    if made_dir and not any(out_dir.iterdir()):
      out_dir.rmdir()

  with _exclusive(out_dir, flag):
    try:
      made_progress = _claim(out_dir, fp, flag)
    except ValueError:  # a new folder whose first write failed (a full disk): nothing in it
      remove_if_made_and_empty()
      raise
    if manifest_path.is_file():
      try:
        PreparedData.open(out_dir)
        log.info("prepared data in %s is complete and intact: nothing to do", out_dir)
        return out_dir
      except ValueError as e:
        log.warning("%s; preparing the damaged part again", e)
        manifest_path.unlink()
    made_tokenizer = not (out_dir / TOKENIZER).exists()
    try:
      return _prepare(data_config, out_dir, identity, fp, shard_chars, workers)
    except Exception:
      # Failed (bad input, a full disk) before its first shard: what it wrote would only block
      # the re-run with fixed input (another fingerprint). Interrupts are not failures: like a
      # kill they leave the work (a trained tokenizer) to the next run.
      if not _holds_data(out_dir):
        _remove_leftovers(out_dir, progress=made_progress, tokenizer=made_tokenizer)
        remove_if_made_and_empty()
      raise


def _prepare(data_config, out_dir: Path, identity: dict, fp: str, shard_chars: int,
             workers: int | None) -> Path:
  """``prepare``'s work in a claimed folder without a valid manifest."""
  start = time.perf_counter()
  splits = sources.text_splits(data_config)
  tok, model, trained = _tokenizer(data_config, splits, out_dir, fp)
  tok_sha = _sha256_bytes(model)
  dtype = token_dtype(tok.vocab_size)
  workers = _worker_count(splits.characters, shard_chars, workers)
  results = _encode_shards(splits, out_dir, model, tok_sha, dtype, shard_chars, workers)
  seconds = time.perf_counter() - start
  split_info = _split_info(results, splits.source)
  tokenizer = {"file": TOKENIZER, "sha256": tok_sha, "vocab_size": tok.vocab_size,
               "eos_id": tok.eos_id, "pad_id": tok.pad_id, "trained_here": trained}
  manifest = _manifest(data_config, fp, splits.source, identity, tokenizer, dtype, shard_chars,
                       split_info)
  _remove_unlisted(out_dir, split_info)
  _write_json(out_dir / MANIFEST, manifest)
  text_mb = sum(i["bytes"] for i in split_info.values()) / 1e6
  logging.getLogger(__name__).info(
      "prepared %s in %s: %.1f MB of text, %d train / %d validation tokens in %.1f s "
      "(%.1f MB/s, workers: %d)", splits.source, out_dir, text_mb,
      split_info["train"]["tokens"], split_info["validation"]["tokens"], seconds,
      text_mb / max(seconds, 1e-9), workers)
  return out_dir


def _worker_count(total: int | None, shard_chars: int, workers: int | None) -> int:
  """``workers``, or when None: 1 for a corpus of known size under ``POOL_MIN_CHARS``
  characters (``total``; None for a catalog dataset), else ``cpus.usable()`` (shards are
  defined by the input, so the count never changes what is written), at most one per shard."""
  if workers is not None:
    return workers
  if total is not None and total < POOL_MIN_CHARS:
    return 1
  workers = cpus.usable()
  if total is not None:  # one shard at a time each: no more workers than shards
    workers = max(1, min(workers, -(-total // shard_chars)))
  return workers


def _encode_shards(splits, out_dir: Path, model: bytes, tok_sha: str, dtype: str,
                   shard_chars: int, workers: int) -> dict[str, list[dict]]:
  """Encodes and writes every shard of ``splits`` not already in ``out_dir`` for this tokenizer
  (``tok_sha``; :func:`_done` reads those back), in a pool of ``workers`` processes or, with
  1, in this one. Returns ``{split: [shard metadata]}``, in the order the shards finished."""
  docs = {"train": splits.train, "validation": splits.validation}
  results: dict[str, list[dict]] = {s: [] for s in SPLITS}

  def jobs() -> Iterator[tuple[dict, str, str, str]]:
    for split in SPLITS:
      for task in _shard_tasks(docs[split], split, shard_chars):
        meta = _done(out_dir, task, tok_sha, dtype)
        if meta is not None:
          results[split].append(meta)
          bar.update(meta["characters"])
          continue
        yield task, os.fspath(out_dir), dtype, tok_sha

  with tqdm(total=splits.characters, desc="prepare: encode", unit="char", unit_scale=True,
            disable=None, leave=False) as bar, contextlib.ExitStack() as stack:
    if workers > 1:
      # spawn, not fork: the caller may already run JAX's threads.
      with _sigint_ignored():
        pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(
            workers, initializer=_init_pool_worker, initargs=(model, os.getpid())))
      done = _in_slices(pool.imap(_encode_and_write, jobs()))
    else:
      _init_worker(model)
      done = map(_encode_and_write, jobs())
    for meta in done:
      split = meta["file"].split("-")[0]
      results[split].append(meta)
      bar.update(meta["characters"])
  return results


def _in_slices(results) -> Iterator:
  """A pool's ``imap`` results, waited for in :data:`cem_jax.signals.SIGNAL_CHECK_SECS` slices:
  a blocking ``next()`` woke for a Ctrl-C only where the kernel delivered it to the main
  thread, while the pool's own threads may get it (then prepare went on until the shard being
  encoded was written)."""
  while True:
    try:
      yield results.next(timeout=signals.SIGNAL_CHECK_SECS)
    except multiprocessing.TimeoutError:
      continue
    except StopIteration:
      return


def _split_info(results: dict[str, list[dict]], source: str) -> dict[str, dict]:
  """The manifest's ``splits``: per split its totals, fields and shards in file order.

  Raises:
    ValueError: a split without tokens (``source`` names the text).
  """
  split_info = {}
  for split in SPLITS:
    # By index: "train-100000" sorts before "train-99999" as text (shard_name pads to 5 digits).
    shards = sorted(results[split], key=lambda m: (len(m["file"]), m["file"]))
    if not shards or not sum(m["tokens"] for m in shards):
      raise ValueError(f"the {split} split of {source} is empty; use more text")
    split_info[split] = {
        "documents": sum(m["documents"] for m in shards),
        "tokens": sum(m["tokens"] for m in shards),
        "characters": sum(m["characters"] for m in shards),
        "bytes": sum(m["bytes"] for m in shards),
        "fields": ["tokens", "bytes"] if split == "validation" else ["tokens"],
        "shards": [{k: m[k] for k in ("file", "tokens", "records", "size", "sha256")}
                   for m in shards],
    }
  return split_info


def _manifest(data_config, fp: str, source: str, identity: dict, tokenizer: dict, dtype: str,
              shard_chars: int, split_info: dict) -> dict:
  """The manifest of a prepared folder (``prepared.PreparedData`` reads it)."""
  return {
      "format_version": FORMAT_VERSION,
      "fingerprint": fp,
      "source": source,
      "sources": identity,
      "config": {k: data_config[k] for k in SPEC_KEYS},
      "tokenizer": tokenizer,
      "token_dtype": dtype,
      "record_tokens": RECORD_TOKENS,
      "shard_chars": shard_chars,
      "splits": split_info,
  }


def _remove_unlisted(out_dir: Path, split_info: dict) -> None:
  """Removes the shards (and their metadata) numbered past the last one ``split_info`` lists.

  A killed prepare with a smaller ``shard_chars`` leaves them; they are not data of this
  manifest, and the folder must hold what it lists.
  """
  for split in SPLITS:
    for path in out_dir.iterdir():
      index = re.fullmatch(rf"{split}-(\d+)\.(array_record|json)", path.name)
      if (index and int(index.group(1)) >= len(split_info[split]["shards"])
          and path.is_file()):
        path.unlink()


def prepared_for(data_config, workdir: str | os.PathLike) -> Path:
  """Returns the folder of the config's prepared data: ``data.prepared_dir`` when set, else
  ``WORKDIR/data/<fingerprint>``, prepared there first unless complete (an edited file or
  another tokenizer setting gets a new fingerprint, so it is prepared again).

  Raises:
    As ``prepare``; ValueError also when ``WORKDIR/data/<fingerprint>`` holds a manifest of
    another fingerprint (one line naming the folder, both fingerprints and the fix).
  """
  if data_config.prepared_dir:
    return Path(os.path.expanduser(data_config.prepared_dir))
  identity = sources.source_identity(data_config)
  fp = fingerprint(data_config, identity)
  out = Path(workdir) / "data" / fp
  if not (out / MANIFEST).is_file():
    prepare(data_config, out, flag="")
  # The folder's name is the only link between the config and its data: one copied or moved
  # there by hand would train on its own text as this config's. A manifest unreadable or
  # without a fingerprint is left to PreparedData.open, which names the damage.
  theirs = _saved_field(out / MANIFEST, "fingerprint")
  if theirs is not None and theirs != fp:
    raise ValueError(f"{out} holds another dataset (fingerprint {theirs}, this config and "
                     f"text: {fp}): it was not prepared here; remove it and start again: it "
                     "is prepared anew")
  # Left by an earlier text or tokenizer setting (an edit before the first checkpoint, a
  # failed start fixed by another setting): nothing removes them, and at corpus scale they
  # are gigabytes.
  others = sorted(p.name for p in out.parent.iterdir() if p.is_dir() and p.name != fp)
  if others:
    logging.getLogger(__name__).info(
        "%s also holds %d prepared dataset(s) this config does not read (%s: of an earlier "
        "text or tokenizer setting); remove them to free the space, unless you go back to it",
        out.parent, len(others), ", ".join(others))
  return out
