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

import io
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from cem_jax import cpus
from cem_jax.config import TOKENIZER_MODEL_TYPES as MODEL_TYPES

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
    if not model_proto:
      # SentencePiece takes no bytes for no model: a processor of 0 pieces, whose ids read
      # as 0 with a C++ log line each ("Model is not initialized").
      raise RuntimeError("an empty model (0 bytes)")
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

  def encode_with_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(ids, nbytes)``, int32 ``[n]`` each: ``encode(text)`` and the UTF-8 bytes of
    ``text`` each id stands for, counted from the text itself: ``nbytes.sum() ==
    len(text.encode('utf-8'))`` whatever the pieces (an unknown piece covers the bytes of the
    characters it replaced; text a normalising model drops counts for the id before it).

    Piece lengths (``token_bytes``) are used when they add up to the text's length; otherwise
    SentencePiece's byte offsets of each id in the text assign every byte to the id whose
    span starts at or before it.
    """
    ids = np.asarray(self.encode(text), np.int32)
    size = len(text.encode("utf-8"))
    nbytes = self.token_bytes[ids]
    if int(nbytes.sum()) == size or len(ids) == 0:
      return ids, nbytes.astype(np.int32)
    begins = np.zeros(len(ids) + 1, np.int64)
    begins[-1] = size
    parts = text.split(_META_SPACE) if self._meta_space_ids is not None else [text]
    pos, offset = 0, 0
    for j, part in enumerate(parts):
      if j:  # the three byte pieces of a literal '▁' (see ``encode``)
        begins[pos:pos + 3] = offset + np.arange(3)
        pos, offset = pos + 3, offset + 3
      proto = self._sp.encode(part, return_type="proto")
      n = len(proto.pieces)
      begins[pos:pos + n] = [offset + p.begin for p in proto.pieces]
      pos, offset = pos + n, offset + len(part.encode("utf-8"))
    begins[0] = 0  # bytes no piece covers at the start belong to the first id
    return ids, np.diff(begins).astype(np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Returns ``[encode(t) for t in texts]``, encoding in parallel where possible."""
    plain = [i for i, t in enumerate(texts) if _META_SPACE not in t]
    out: list[list[int] | None] = [None] * len(texts)
    # SentencePiece's own count (num_threads=-1) is the host's CPUs, blind to a CPU quota.
    encoded = self._sp.encode([texts[i] for i in plain], num_threads=cpus.usable())
    for i, ids in zip(plain, encoded, strict=True):
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


def _chunks(docs: Iterable[str]) -> Iterator[str]:
  """``docs`` cut into SentencePiece's training sentences of at most ``TRAIN_CHUNK_CHARS``
  characters, each ending after its window's last newline, else its last space, else at the
  limit (``''.join`` of a document's chunks is the document). Not
  :func:`cem_jax.data.text.cut_at_breaks`, which prefers paragraph breaks and never cuts at a
  space: another rule here changes the sample, and with it a trained tokenizer's pieces."""
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
      yield doc[start:end]
      start = end


def _training_chunks(docs: Iterable[str]) -> list[str]:
  """The training sample: ``docs`` cut into chunks of at most ``TRAIN_CHUNK_CHARS`` characters
  (:func:`_chunks`), every k-th chunk kept when they hold more than ``MAX_TRAIN_CHARS``. ``docs`` is
  read twice (total, then sample), so an iterable that re-reads a large corpus on each pass
  never holds more than the sample."""
  total = sum(len(doc) for doc in docs)
  stride = -(-total // MAX_TRAIN_CHARS) if total > MAX_TRAIN_CHARS else 1
  return [c for i, c in enumerate(_chunks(docs)) if i % stride == 0]


# What SentencePiece (0.2) leaves out when it counts the characters a vocabulary must hold:
# the Python sentence iterator drops each sentence's trailing CR/LF; a sentence holding U+2585
# (its mark for a character left out of the vocabulary) is skipped; the text of a special or
# byte piece (``<s>``, ``<0x41>``, ...) is replaced by a boundary; NUL is dropped; a space is
# stored as U+2581, so the two are one character. (Checked against 0.2.3 by
# tests/test_data.py. A version that counts otherwise refuses through train_model's generic
# error, with its own message.)
_UNK_MARK = "\u2585"
_META_PIECES = re.compile(r"<0x[0-9A-F]{2}>|<pad>|<unk>|</s>|<s>")


def _required_pieces(chunks: Iterable[str]) -> int:
  """The smallest vocabulary SentencePiece accepts for training on ``chunks`` with
  ``TRAINER_SETTINGS``: the special pieces, the 256 byte pieces and one piece per distinct
  character of the text (as SentencePiece counts them, see ``_UNK_MARK``)."""
  chars: set[str] = set()
  for chunk in chunks:
    if _UNK_MARK in chunk:
      continue
    chunk = chunk.rstrip("\r\n")
    chars.update(_META_PIECES.sub("", chunk) if "<" in chunk else chunk)
  if " " in chars:
    chars.add(_META_SPACE)
  chars -= {" ", "\0"}
  special = sum(TRAINER_SETTINGS[k] >= 0 for k in ("pad_id", "eos_id", "bos_id", "unk_id"))
  return special + (256 if TRAINER_SETTINGS["byte_fallback"] else 0) + len(chars)


def _train(chunks: Iterable[str], vocab_size: int, model_type: str, **settings) -> bytes:
  writer = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(chunks), model_writer=writer, vocab_size=vocab_size,
      model_type=model_type, minloglevel=2, **TRAINER_SETTINGS, **settings,
  )
  return writer.getvalue()


def train_model(docs: Iterable[str], vocab_size: int, model_type: str = "bpe") -> bytes:
  """Trains a SentencePiece model on ``docs`` (a re-iterable; only the sample of
  ``_training_chunks`` is held in memory); returns the serialized model.

  Raises:
    ValueError: ``model_type`` unknown, ``vocab_size`` too large or too small for the corpus
      (one line naming ``data.vocab_size``, the value and the limit), or SentencePiece fails
      to train on the text for another reason (one line naming ``data.vocab_size`` and
      ``data.tokenizer_model_type``, with SentencePiece's message).
  """
  if model_type not in MODEL_TYPES:
    raise ValueError(f"data.tokenizer_model_type={model_type!r} is not one of {MODEL_TYPES}")
  chunks = _training_chunks(docs)
  characters = sum(map(len, chunks))
  marked = sum(_UNK_MARK in c for c in chunks)
  if marked and marked == len(chunks):
    raise ValueError(
        f"every tokenizer training chunk of the text holds U+2585 ('{_UNK_MARK}'), and "
        "SentencePiece skips such chunks, so nothing is left to train on; replace that "
        "character in the text or give a trained data.tokenizer")
  if marked:
    logging.getLogger(__name__).warning(
        "%d of %d tokenizer training chunks hold U+2585 ('%s') and are skipped by "
        "SentencePiece; their characters may become byte pieces", marked, len(chunks), _UNK_MARK)
  minimum = _required_pieces(chunks)
  if vocab_size < minimum:
    raise ValueError(
        f"data.vocab_size={vocab_size} is too small: the minimum allowed is {minimum} "
        "(4 special + 256 byte pieces + every distinct character of the training text)")
  start = time.perf_counter()
  # SentencePiece reads every chunk before it trains, and has no progress callback for the
  # training itself: the bar covers the reading, the log lines time the whole.
  logging.getLogger(__name__).info(
      "training a %d-piece %s tokenizer on %d characters", vocab_size, model_type, characters)
  try:
    with tqdm(chunks, desc=f"tokenizer: read text ({model_type} {vocab_size})",
              unit="chunk", disable=None, leave=False) as reading:
      model = _train(reading, vocab_size, model_type)
  except RuntimeError as e:  # SentencePiece's one exception type for every failure
    # How many pieces the text supports is known only once trained: BPE stops when no pair is
    # left to merge, unigram when pruning leaves fewer pieces. Trained again without the hard
    # limit, SentencePiece returns the largest vocabulary it can make, so the limit comes from
    # a model, not from the wording of its error.
    try:
      most = spm.SentencePieceProcessor(
          model_proto=_train(chunks, vocab_size, model_type, hard_vocab_limit=False)
      ).get_piece_size()
    except RuntimeError:
      most = vocab_size
    if most < vocab_size:
      raise ValueError(
          f"data.vocab_size={vocab_size} is too large for this training text "
          f"({characters} characters, {model_type}): the maximum allowed is {most}") from None
    raise ValueError(
        f"data.vocab_size={vocab_size}, data.tokenizer_model_type={model_type!r}: SentencePiece "
        f"cannot train on this text ({characters} characters): {' '.join(str(e).split())}"
    ) from None
  logging.getLogger(__name__).info("tokenizer trained in %.1f s", time.perf_counter() - start)
  return model


def tokenizer_file(path: str | os.PathLike) -> Path:
  """The ``data.tokenizer`` path (``~`` expanded) once it names a file, not yet read: what
  :func:`load_tokenizer` opens, checked alone by ``main`` before jax loads.

  Raises:
    FileNotFoundError: no such file (one line naming ``data.tokenizer``).
    ValueError: it is a folder or an empty file.
  """
  path = Path(os.path.expanduser(os.fspath(path)))
  if path.is_dir():
    raise ValueError(f"data.tokenizer={os.fspath(path)!r} is a folder; give a SentencePiece "
                     ".model file, or data.tokenizer='' to train one")
  if not path.is_file():
    raise FileNotFoundError(f"data.tokenizer={os.fspath(path)!r}: no such file; give a "
                            "SentencePiece .model file, or data.tokenizer='' to train one")
  if path.stat().st_size == 0:  # was "has 0 pieces but data.vocab_size=N", after the text
    raise ValueError(f"data.tokenizer={os.fspath(path)!r} is empty (0 bytes); give a "
                     "SentencePiece .model file, or data.tokenizer='' to train one")
  return path


def load_tokenizer(path: str | os.PathLike, vocab_size: int) -> Tokenizer:
  """Loads the ``data.tokenizer`` model file and checks it against ``data.vocab_size``.

  Raises:
    FileNotFoundError: the file does not exist (one line naming ``data.tokenizer``).
    ValueError: it is a folder, its vocabulary size differs from ``vocab_size``, it has no EOS
      piece, or it is not a SentencePiece model.
  """
  path = tokenizer_file(path)
  try:
    tok = Tokenizer.from_file(path)
  except RuntimeError:
    # sentencepiece's own text names its C++ source line, not the file or the fix.
    raise ValueError(f"data.tokenizer={os.fspath(path)!r} is not a SentencePiece model (it "
                     "does not parse as one); give a SentencePiece .model file, or "
                     "data.tokenizer='' to train one") from None
  if tok.vocab_size != vocab_size:
    raise ValueError(f"data.tokenizer={os.fspath(path)!r} has {tok.vocab_size} pieces but "
                     f"data.vocab_size={vocab_size}; they must be equal")
  if tok.eos_id < 0:
    raise ValueError(f"data.tokenizer={os.fspath(path)!r} has no EOS piece (eos_id=-1)")
  return tok
