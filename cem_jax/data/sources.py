"""Choosing the text source from the ``data`` config and returning its train/validation split.

Sources, by precedence: ``data.files`` (local files, through the TFDS array_record builder),
``data.tfds_name`` (a TFDS catalog dataset with its own splits), else ``data.builtin``. The
builtin and files sources are split by ``text.split_documents`` (for ``pydoc+docstrings`` only
the pydoc topics are split: validation is their tail, the docstrings are all training text).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from cem_jax.data import builtin, tfds_catalog, tfds_local
from cem_jax.data import text as text_lib


@dataclasses.dataclass(frozen=True)
class TextSplits:
  """Documents of both splits, in their canonical order.

  Attributes:
    train: training documents (str).
    validation: validation documents (str).
    source: a one-line human description of where the text came from.
  """

  train: list[str]
  validation: list[str]
  source: str


def text_splits(data_config, workdir: str | os.PathLike) -> TextSplits:
  """Returns the train/validation documents the ``data`` config selects.

  Local files are prepared as a TFDS dataset in ``WORKDIR/tfds`` (reused while the files are
  unchanged); the built-in corpus is read directly; catalog datasets are read from
  ``data.tfds_data_dir``.

  Raises:
    ValueError: bad config values or input files (messages name the field or file).
    RuntimeError: a catalog dataset is not prepared and there is no network.
  """
  if data_config.files and data_config.tfds_name:
    raise ValueError(
        f"data.files={data_config.files!r} and data.tfds_name={data_config.tfds_name!r} are "
        "both set; set only one"
    )
  if data_config.files:
    paths = text_lib.resolve_files(data_config.files)
    train, validation, dataset_dir = tfds_local.load_local_files(
        paths, data_config.validation_fraction, Path(workdir) / "tfds"
    )
    names = ", ".join(p.name for p in paths[:5]) + (", ..." if len(paths) > 5 else "")
    return TextSplits(train, validation, f"files: {len(paths)} ({names}) via {dataset_dir}")
  if data_config.tfds_name:
    train, validation, source = tfds_catalog.load_catalog(
        data_config.tfds_name, data_config.tfds_data_dir, data_config.tfds_text_key,
        data_config.tfds_train_split, data_config.tfds_eval_split,
    )
    return TextSplits(train, validation, source)
  docs = builtin.builtin_documents(data_config.builtin)
  if data_config.builtin == "pydoc+docstrings":
    # The held-out text stays the tail of the pydoc topics, the text the byte 4-gram reference
    # is scored on; the stdlib docstrings only add training text.
    topics = builtin.pydoc_topics()
    train, validation = text_lib.split_documents(topics, data_config.validation_fraction)
    train = docs[len(topics):] + train
  else:
    train, validation = text_lib.split_documents(docs, data_config.validation_fraction)
  return TextSplits(train, validation, f"builtin: {data_config.builtin} ({len(docs)} documents)")
