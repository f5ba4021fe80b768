"""SentencePiece tokenizer: training with an exact round trip, caching, and a small wrapper.

Settings for ``decode(encode(text)) == text`` on any string:
  * identity normalisation, no dummy prefix, extra whitespace kept, whitespace-only pieces
    allowed, ``byte_fallback`` (any character outside the vocabulary becomes UTF-8 byte pieces
    ``<0xNN>``, so there is never an unknown token);
  * newlines: SentencePiece treats ``'\\n'`` as an ordinary character. It is trained on
    chunks of ~2,000 characters cut after a newline, so newlines stay inside the training
    "sentences" and pieces such as ``'\\n\\n'`` or ``'.\\n'`` are learned;
  * SentencePiece stores a space as ``'▁'`` (U+2581) and so decodes a literal ``'▁'`` in the
    text as a space. ``Tokenizer.encode`` therefore emits that character's three byte pieces
    instead, which decode back to ``'▁'``.
Special ids: pad 0, eos 1, bos 2, unk 3 (unk is never produced). Training uses one thread,
because SentencePiece's result depends on the thread count: the same corpus always gives the
byte-identical model. A model given by ``data.tokenizer`` is used as it is: its round trip is
only as exact as its own settings.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from cem_jax.files import atomic_write_bytes

MODEL_TYPES = ("bpe", "unigram")
TRAIN_CHUNK_CHARS = 2000
# Training text beyond this many characters is subsampled (every k-th chunk): a larger sample
# barely changes a vocabulary of a few thousand pieces and keeps training to seconds.
MAX_TRAIN_CHARS = 20_000_000
_META_SPACE = "\u2581"

TRAINER_SETTINGS = {
    "normalization_rule_name": "identity",
    "byte_fallback": True,
    "add_dummy_prefix": False,
    "remove_extra_whitespaces": False,
    "allow_whitespace_only_pieces": True,
    "split_digits": False,
    "character_coverage": 1.0,
    "max_sentence_length": 4 * 4 * TRAIN_CHUNK_CHARS,  # bytes; a chunk is <= 4 bytes/char
    "pad_id": 0,
    "eos_id": 1,
    "bos_id": 2,
    "unk_id": 3,
    "num_threads": 1,
}
# Part of the cache key: change it when the training procedure changes.
_TRAINING_VERSION = 1


class Tokenizer:
  """A SentencePiece model with the few methods the pipeline needs.

  Attributes:
    vocab_size: number of pieces (ids are in ``[0, vocab_size)``).
    eos_id, pad_id, bos_id: ids appended after each document / used for padding / unused by
      this pipeline. A model without a pad piece pads with ``eos_id``.
    token_bytes: int32 array ``[vocab_size]``, the number of UTF-8 bytes each id decodes to:
      byte pieces 1, ``'▁'`` counts as one space byte, control and unknown pieces 0. Summed
      over an encoding it gives the text's UTF-8 length (bits-per-byte denominators).
    path: the .model file, or None when built from bytes.
  """

  def __init__(self, model_proto: bytes, path: str | os.PathLike | None = None):
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    self.path = Path(path) if path is not None else None
    self.vocab_size = int(self._sp.get_piece_size())
    self.eos_id = int(self._sp.eos_id())
    self.bos_id = int(self._sp.bos_id())
    # Padded positions carry weight 0, so EOS is as good a pad as any.
    self.pad_id = int(self._sp.pad_id()) if self._sp.pad_id() >= 0 else self.eos_id
    self.token_bytes = self._token_bytes()
    meta_bytes = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _META_SPACE.encode()]
    unk = self._sp.unk_id()
    self._meta_space_ids = meta_bytes if unk not in meta_bytes else None

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> Tokenizer:
    """Loads a SentencePiece ``.model`` file. Raises OSError if unreadable, RuntimeError if
    not a SentencePiece model."""
    return cls(Path(path).read_bytes(), path=path)

  def _token_bytes(self) -> np.ndarray:
    sp = self._sp
    out = np.zeros(self.vocab_size, np.int32)
    for i in range(self.vocab_size):
      if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
        continue
      if sp.is_byte(i):
        out[i] = 1
      else:
        out[i] = len(sp.id_to_piece(i).replace(_META_SPACE, " ").encode("utf-8"))
    return out

  def encode(self, text: str) -> list[int]:
    """Returns the ids of ``text`` (no BOS/EOS added)."""
    if _META_SPACE not in text or self._meta_space_ids is None:
      return self._sp.encode(text)
    parts = text.split(_META_SPACE)
    ids = list(self._sp.encode(parts[0]))
    for part in parts[1:]:
      ids.extend(self._meta_space_ids)
      ids.extend(self._sp.encode(part))
    return ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Returns ``[encode(t) for t in texts]``, encoding in parallel where possible."""
    plain = [i for i, t in enumerate(texts) if _META_SPACE not in t]
    out: list[list[int] | None] = [None] * len(texts)
    for i, ids in zip(plain, self._sp.encode([texts[i] for i in plain], num_threads=-1),
                      strict=True):
      out[i] = ids
    for i, t in enumerate(texts):
      if out[i] is None:
        out[i] = self.encode(t)
    return out  # type: ignore[return-value]

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Returns the text of ``ids`` (control ids such as EOS/pad decode to '')."""
    return self._sp.decode([int(i) for i in ids])

  def id_to_piece(self, i: int) -> str:
    """Returns the piece string of id ``i`` (e.g. ``'▁the'``, ``'<0x0A>'``, ``'</s>'``)."""
    return self._sp.id_to_piece(int(i))


def _training_chunks(docs: Sequence[str]) -> list[str]:
  chunks = []
  for doc in docs:
    start = 0
    while start < len(doc):
      end = start + TRAIN_CHUNK_CHARS
      if end < len(doc):
        cut = doc.rfind("\n", start, end)
        if cut < start:
          cut = doc.rfind(" ", start, end)
        if cut >= start:
          end = cut + 1
      chunks.append(doc[start:end])
      start = end
  total = sum(len(c) for c in chunks)
  if total > MAX_TRAIN_CHARS:
    chunks = chunks[:: -(-total // MAX_TRAIN_CHARS)]
  return chunks


def cache_key(docs: Sequence[str], vocab_size: int, model_type: str) -> str:
  """Returns a 16-hex-digit hash of the training text, vocabulary size, model type and
  trainer settings: the name of the cached model."""
  h = hashlib.sha256()
  h.update(json.dumps([_TRAINING_VERSION, vocab_size, model_type, TRAINER_SETTINGS,
                       TRAIN_CHUNK_CHARS, MAX_TRAIN_CHARS]).encode())
  for doc in docs:
    data = doc.encode("utf-8")
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
  return h.hexdigest()[:16]


_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_LOW = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def train_model(docs: Sequence[str], vocab_size: int, model_type: str = "bpe") -> bytes:
  """Trains a SentencePiece model on ``docs`` in memory; returns the serialized model.

  Raises:
    ValueError: ``model_type`` unknown, or ``vocab_size`` too large or too small for the
      corpus (one line naming ``data.vocab_size``, the value and the limit).
  """
  if model_type not in MODEL_TYPES:
    raise ValueError(f"data.tokenizer_model_type={model_type!r} is not one of {MODEL_TYPES}")
  chunks = _training_chunks(docs)
  writer = io.BytesIO()
  start = time.perf_counter()
  # SentencePiece reads every chunk before it trains, and has no progress callback for the
  # training itself: the bar covers the reading, the log lines time the whole.
  logging.getLogger(__name__).info(
      "training a %d-piece %s tokenizer on %d characters", vocab_size, model_type,
      sum(map(len, chunks)))
  try:
    with tqdm(chunks, desc=f"tokenizer: read text ({model_type} {vocab_size})",
              unit="chunk", disable=None, leave=False) as reading:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(reading), model_writer=writer, vocab_size=vocab_size,
          model_type=model_type, minloglevel=2, **TRAINER_SETTINGS,
      )
  except RuntimeError as e:
    msg = str(e)
    if m := _TOO_HIGH.search(msg):
      raise ValueError(
          f"data.vocab_size={vocab_size} is too large for this training text "
          f"({sum(map(len, chunks))} characters, {model_type}): the maximum allowed is "
          f"{m.group(2)}"
      ) from None
    if m := _TOO_LOW.search(msg):
      raise ValueError(
          f"data.vocab_size={vocab_size} is too small: the minimum allowed is {m.group(2)} "
          "(4 special + 256 byte pieces + every distinct character of the training text)"
      ) from None
    raise
  logging.getLogger(__name__).info("tokenizer trained in %.1f s", time.perf_counter() - start)
  return writer.getvalue()


def train_or_load(docs: Sequence[str], vocab_size: int, model_type: str,
                  cache_dir: str | os.PathLike) -> Tokenizer:
  """Returns the tokenizer trained on ``docs``, reusing ``cache_dir/spm_<type>_<vocab>_<key>``
  ``.model`` when it exists and training (then writing it atomically) when it does not.

  Raises:
    ValueError: as ``train_model``.
  """
  key = cache_key(docs, vocab_size, model_type)
  path = Path(cache_dir) / f"spm_{model_type}_{vocab_size}_{key}.model"
  if path.is_file():
    return Tokenizer.from_file(path)
  model = train_model(docs, vocab_size, model_type)
  path.parent.mkdir(parents=True, exist_ok=True)
  atomic_write_bytes(path, model)
  return Tokenizer(model, path=path)


def load_tokenizer(path: str | os.PathLike, vocab_size: int) -> Tokenizer:
  """Loads the ``data.tokenizer`` model file and checks it against ``data.vocab_size``.

  Raises:
    FileNotFoundError: the file does not exist (one line naming ``data.tokenizer``).
    ValueError: its vocabulary size differs from ``vocab_size``, it has no EOS piece, or it is
      not a SentencePiece model.
  """
  path = Path(os.path.expanduser(os.fspath(path)))
  if not path.is_file():
    raise FileNotFoundError(f"data.tokenizer={os.fspath(path)!r}: no such file; give a "
                            "SentencePiece .model file, or data.tokenizer='' to train one")
  try:
    tok = Tokenizer.from_file(path)
  except RuntimeError as e:
    raise ValueError(f"data.tokenizer={os.fspath(path)!r} is not a SentencePiece model: "
                     f"{str(e).splitlines()[0]}") from None
  if tok.vocab_size != vocab_size:
    raise ValueError(f"data.tokenizer={os.fspath(path)!r} has {tok.vocab_size} pieces but "
                     f"data.vocab_size={vocab_size}; they must be equal")
  if tok.eos_id < 0:
    raise ValueError(f"data.tokenizer={os.fspath(path)!r} has no EOS piece (eos_id=-1)")
  return tok


def tokenizer_for(data_config, train_docs: Sequence[str], workdir: str | os.PathLike
                  ) -> Tokenizer:
  """Returns the tokenizer the ``data`` config asks for: ``data.tokenizer`` if set, else one
  trained on ``train_docs`` and cached in ``WORKDIR/tokenizer/``. Raises as
  ``load_tokenizer`` / ``train_model``."""
  if data_config.tokenizer:
    return load_tokenizer(data_config.tokenizer, data_config.vocab_size)
  return train_or_load(train_docs, data_config.vocab_size, data_config.tokenizer_model_type,
                       Path(workdir) / "tokenizer")

