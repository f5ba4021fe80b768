"""Local text files as a TFDS dataset (array_record), prepared once per corpus version.

The files are read, normalised and split (``text.split_documents``), then written by a
``tfds.core.GeneratorBasedBuilder`` with ``file_format='array_record'`` under a data dir such
as ``WORKDIR/tfds``, and read back with ``tfds.data_source``. No TensorFlow is needed.

The builder config name is a hash of the resolved paths, sizes and modification times of the
files (plus the validation fraction and this module's format version), so an edited file gets
a new config and is prepared again while an unchanged corpus is reused as is. Each example is
one chunk of at most ``CHUNK_CHARS`` characters (cut after a newline where there is one) with
``doc_id`` and ``chunk`` features, so documents come back whole and in order.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds

from cem_jax.data import text as text_lib

CHUNK_CHARS = 64 * 1024
SPLITS = ("train", "validation")
# Bump when the examples' layout or the text normalisation changes: old preparations then
# stop matching instead of being read with the wrong meaning.
FORMAT_VERSION = 1

# Number of times this process ran TFDS preparation; lets tests tell reuse from re-preparing.
prepare_count = 0


def corpus_key(paths: Sequence[Path], validation_fraction: float) -> str:
  """Returns a 16-hex-digit key of (resolved path, size, mtime_ns) of each file, the split
  fraction and ``FORMAT_VERSION``. Raises OSError if a file cannot be stat'ed."""
  items = []
  for path in paths:
    st = os.stat(path)
    items.append([os.fspath(Path(path).resolve()), st.st_size, st.st_mtime_ns])
  blob = json.dumps([FORMAT_VERSION, repr(float(validation_fraction)), items])
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def chunk_text(doc: str, size: int = CHUNK_CHARS) -> list[str]:
  """Cuts ``doc`` into pieces of at most ``size`` characters, each ending after a newline when
  the window has one; ``''.join(result) == doc``."""
  pieces = []
  start = 0
  while start < len(doc):
    end = start + size
    if end < len(doc):
      newline = doc.rfind("\n", start, end)
      if newline >= start:
        end = newline + 1
    pieces.append(doc[start:end])
    start = end
  return pieces


class LocalTextFiles(tfds.core.GeneratorBasedBuilder):
  """Chunks of local text files; one builder config per corpus version (see module doc)."""

  VERSION = tfds.core.Version("1.0.0")

  def __init__(self, *, splits: dict[str, list[str]] | None = None, **kwargs):
    # The documents are passed in already read and split, so that bad input fails with our
    # own message before TFDS starts writing, and the files are read only once.
    self._documents = splits
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description="Local UTF-8 text files, chunked; see cem_jax/data/tfds_local.py.",
        features=tfds.features.FeaturesDict(
            {"text": tfds.features.Text(), "doc_id": np.int32, "chunk": np.int32}
        ),
        disable_shuffling=True,  # keep documents in corpus order
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    if self._documents is None:
      raise RuntimeError("LocalTextFiles needs its documents (splits=...) to prepare")
    return {split: self._generate_examples(self._documents[split]) for split in SPLITS}

  def _generate_examples(self, docs: list[str]) -> Iterator[tuple[str, dict]]:
    for doc_id, doc in enumerate(docs):
      for chunk, piece in enumerate(chunk_text(doc)):
        yield f"{doc_id:09d}_{chunk:09d}", {"text": piece, "doc_id": doc_id, "chunk": chunk}

  # TFDS prints these with termcolor on stdout; route them to logging instead.
  def _log_download_bytes(self) -> None:
    logging.getLogger(__name__).info("preparing %s in %s", self.name, self.data_dir)

  def _log_download_done(self) -> None:
    logging.getLogger(__name__).info("prepared %s in %s", self.name, self.data_dir)


@contextlib.contextmanager
def quiet_tfds() -> Iterator[None]:
  """Silences TFDS's info/warning logs (e.g. 'custom data configuration') for the duration of
  the block, and shows its progress bars (examples written, ETA) only when stderr is a
  terminal; restores the previous settings afterwards."""
  from tensorflow_datasets.core.utils import tqdm_utils  # private, hence the guard below

  absl_logger = logging.getLogger("absl")
  old_level = absl_logger.level
  old_active = getattr(tqdm_utils, "_active", True)
  absl_logger.setLevel(logging.ERROR)
  tfds.display_progress_bar(sys.stderr.isatty())
  try:
    yield
  finally:
    tfds.display_progress_bar(old_active)
    absl_logger.setLevel(old_level)


def _read_split(name: str, split: str, data_dir: Path) -> list[str]:
  source = tfds.data_source(name, split=split, data_dir=os.fspath(data_dir), download=False)
  examples = [source[i] for i in range(len(source))]
  examples.sort(key=lambda ex: (int(ex["doc_id"]), int(ex["chunk"])))
  docs: list[list[str]] = []
  last = None
  for ex in examples:
    piece = ex["text"]
    piece = piece.decode("utf-8") if isinstance(piece, bytes) else str(piece)
    if ex["doc_id"] != last:
      docs.append([])
      last = ex["doc_id"]
    docs[-1].append(piece)
  return ["".join(parts) for parts in docs]


def load_local_files(
    paths: Sequence[Path], validation_fraction: float, data_dir: str | os.PathLike
) -> tuple[list[str], list[str], Path]:
  """Returns the (train, validation) documents of local files, via a prepared TFDS dataset.

  Prepares ``local_text_files/<corpus_key>`` under ``data_dir`` unless that exact corpus
  version is already there, then reads both splits back with ``tfds.data_source``.

  Args:
    paths: the files in corpus order (``text.resolve_files``).
    validation_fraction: as ``text.split_documents``.
    data_dir: TFDS data dir, created if missing.

  Returns:
    ``(train_docs, validation_docs, dataset_dir)``; the documents as ``text.split_documents``
    returns them for the files' normalised text.

  Raises:
    ValueError: bad files or fraction (see ``text.read_documents``, ``text.split_documents``).
  """
  global prepare_count
  data_dir = Path(data_dir)
  config = tfds.core.BuilderConfig(
      name=f"c{corpus_key(paths, validation_fraction)}",
      description="; ".join(os.fspath(p) for p in paths)[:1000],
  )
  with quiet_tfds():
    builder = LocalTextFiles(data_dir=os.fspath(data_dir), config=config,
                             file_format="array_record")
    if not builder.is_prepared():
      train, validation = text_lib.split_documents(
          text_lib.read_documents(paths), validation_fraction
      )
      builder = LocalTextFiles(
          splits={"train": train, "validation": validation},
          data_dir=os.fspath(data_dir), config=config, file_format="array_record",
      )
      try:
        builder.download_and_prepare()
        prepare_count += 1
      except Exception:
        # Another process sharing the workdir may have prepared the same version first.
        if not builder.is_prepared():
          raise
    name = f"{builder.name}/{config.name}:{builder.version}"
    docs = {split: _read_split(name, split, data_dir) for split in SPLITS}
  return docs["train"], docs["validation"], Path(builder.data_dir)
