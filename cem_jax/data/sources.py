"""Choosing the text source from the ``data`` config and returning its train/validation split.

Sources, by precedence: ``data.files`` (local files), ``data.tfds_name`` (a TFDS catalog
dataset with its own splits), else ``data.builtin``. Local files are split by
``text.interleave_split_files`` (every k-th chunk held out; read a block at a time); the
builtin corpus by ``text.split_documents`` (for ``pydoc+docstrings`` only the pydoc topics
are split: validation is their tail, the text the byte 4-gram reference of the README is
scored on; the docstrings are all training text). Catalog splits are read lazily, one
example at a time.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterable

from cem_jax.config import BUILTINS
from cem_jax.data import builtin, tfds_catalog
from cem_jax.data import text as text_lib
from cem_jax.files import sha256_file


@dataclasses.dataclass(frozen=True)
class TextSplits:
  """Documents of both splits, in their canonical order.

  Attributes:
    train: training documents (str): a list, or for local files and catalog datasets a
      re-iterable that reads the split afresh on each pass.
    validation: validation documents, likewise.
    source: a one-line human description of where the text came from.
    identity: JSON-able description of the exact text (file paths with sizes and sha256, the
      catalog dataset, or the builtin corpus and Python version), for the prepared manifest.
    characters: the characters of both splits together, or None where only a pass over them
      would tell (catalog datasets).
  """

  train: Iterable[str]
  validation: Iterable[str]
  source: str
  identity: dict
  characters: int | None


def source_identity(data_config) -> dict:
  """Returns what identifies the text the ``data`` config selects, without reading it whole:
  ``{'kind': 'files', 'files': [{'path', 'size', 'sha256'}], 'validation_fraction'}``,
  ``{'kind': 'tfds', 'name', 'data_dir', 'text_key', 'train_split', 'eval_split'}`` or
  ``{'kind': 'builtin', 'name', 'python', 'validation_fraction'}``. Files are hashed (~1 s/GB).

  Raises:
    ValueError: both ``data.files`` and ``data.tfds_name`` set, or a glob matches no file.
  """
  d = data_config
  if d.files and d.tfds_name:
    raise ValueError(f"data.files={d.files!r} and data.tfds_name={d.tfds_name!r} are both set; "
                     "set only one")
  if d.files:
    paths = text_lib.resolve_files(d.files)
    return {"kind": "files", "validation_fraction": float(d.validation_fraction),
            "files": [{"path": os.fspath(p), "size": os.path.getsize(p),
                       "sha256": sha256_file(p)} for p in paths]}
  if d.tfds_name:
    return {"kind": "tfds", "name": d.tfds_name, "data_dir": d.tfds_data_dir,
            "text_key": d.tfds_text_key, "train_split": d.tfds_train_split,
            "eval_split": d.tfds_eval_split}
  # The identity is taken without reading the text, so an unknown name (a config that skipped
  # config.validate) would otherwise give an identity of nothing.
  if d.builtin not in BUILTINS:
    raise ValueError(f"data.builtin={d.builtin!r} is not one of {BUILTINS}")
  # The builtin text depends only on the installed Python (see builtin.py).
  return {"kind": "builtin", "name": d.builtin, "python": sys.version,
          "validation_fraction": float(d.validation_fraction)}


def text_splits(data_config) -> TextSplits:
  """Returns the train/validation documents the ``data`` config selects.

  Raises:
    ValueError: bad config values or input files (messages name the field or file).
    ConnectionError: a catalog dataset is not prepared and there is no network.
  """
  identity = source_identity(data_config)
  if identity["kind"] == "files":
    paths = [f["path"] for f in identity["files"]]
    train, validation = text_lib.interleave_split_files(
        paths, data_config.validation_fraction, [f["sha256"] for f in identity["files"]])
    names = ", ".join(os.path.basename(p) for p in paths[:5]) + (", ..." if len(paths) > 5
                                                                 else "")
    return TextSplits(train, validation, f"files: {len(paths)} ({names})", identity,
                      train.corpus_characters)
  if identity["kind"] == "tfds":
    train, validation, source = tfds_catalog.load_catalog(
        data_config.tfds_name, data_config.tfds_data_dir, data_config.tfds_text_key,
        data_config.tfds_train_split, data_config.tfds_eval_split,
    )
    return TextSplits(train, validation, source, identity, None)
  docs = builtin.builtin_documents(data_config.builtin)
  if data_config.builtin == "pydoc+docstrings":
    topics = builtin.pydoc_topics()
    train, validation = text_lib.split_documents(topics, data_config.validation_fraction)
    train = docs[len(topics):] + train
  else:
    train, validation = text_lib.split_documents(docs, data_config.validation_fraction)
  return TextSplits(train, validation, f"builtin: {data_config.builtin} ({len(docs)} documents)",
                    identity, sum(map(len, train)) + sum(map(len, validation)))
