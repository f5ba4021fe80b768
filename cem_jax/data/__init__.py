"""Data pipeline: text sources, TFDS local-files builder, SentencePiece tokenizer, packing.

Entry point: ``build_data(config, workdir) -> Data``. Flow: ``sources.text_splits`` (builtin
corpus, local files via TFDS array_record, or a TFDS catalog dataset) -> tokenizer (trained on
the train split, cached) -> ``packing`` (EOS-separated documents in windows with segment ids)
-> ``TrainBatches`` (pure function of the step) and ``EvalWindows``.
"""

from cem_jax.data.packing import Windows, encode_documents, make_batch, pack
from cem_jax.data.pipeline import Data, EvalWindows, TrainBatches, build_data
from cem_jax.data.sources import TextSplits, text_splits
from cem_jax.data.text import normalize_newlines, read_documents, resolve_files, split_documents
from cem_jax.data.tokenizer import Tokenizer, load_tokenizer, train_or_load

__all__ = [
    "Data",
    "EvalWindows",
    "TextSplits",
    "Tokenizer",
    "TrainBatches",
    "Windows",
    "build_data",
    "encode_documents",
    "load_tokenizer",
    "make_batch",
    "normalize_newlines",
    "pack",
    "read_documents",
    "resolve_files",
    "split_documents",
    "text_splits",
    "train_or_load",
]
