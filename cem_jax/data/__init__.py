"""Data pipeline: text sources, SentencePiece tokenizer, prepared ArrayRecord shards, packing.

Entry point: ``build_data(config, workdir) -> Data``. Flow: ``sources.text_splits`` (builtin
corpus, local files, or a TFDS catalog dataset) -> tokenizer (trained on the train split) ->
``shard_writer.prepare`` (each split's token stream in ArrayRecord shards, once) ->
``prepared.StreamWindows`` (EOS-separated documents in windows with segment ids, read by
position) -> ``TrainBatches`` (pure function of the step) and ``EvalWindows``.
``build_data_in_memory`` and ``packing.pack`` are the in-memory reference of the same result.
"""

from cem_jax.data.packing import Windows, encode_documents, make_batch, pack
from cem_jax.data.pipeline import (
    Data,
    EvalWindows,
    TrainBatches,
    build_data,
    build_data_in_memory,
    check_given_files,
    check_same_data,
    data_identity,
    require_shuffle,
    shuffled_positions,
)
from cem_jax.data.prepared import PreparedData, StreamWindows
from cem_jax.data.shard_writer import prepare
from cem_jax.data.sources import TextSplits, text_splits
from cem_jax.data.text import normalize_newlines, read_documents, resolve_files, split_documents
from cem_jax.data.tokenizer import Tokenizer, load_tokenizer, train_model

__all__ = [
    "Data",
    "EvalWindows",
    "TextSplits",
    "Tokenizer",
    "TrainBatches",
    "Windows",
    "PreparedData",
    "StreamWindows",
    "build_data",
    "build_data_in_memory",
    "check_given_files",
    "check_same_data",
    "data_identity",
    "encode_documents",
    "load_tokenizer",
    "make_batch",
    "normalize_newlines",
    "pack",
    "prepare",
    "read_documents",
    "require_shuffle",
    "resolve_files",
    "shuffled_positions",
    "split_documents",
    "text_splits",
    "train_model",
]
