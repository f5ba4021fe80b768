"""Packing tokenized documents into fixed-length windows with document segment ids.

Each document's ids are followed by EOS; the documents are concatenated in order and cut into
non-overlapping windows of ``seq_len + 1`` tokens (one extra so inputs and targets are shifted
views of one window). ``segment_ids`` number the documents inside each window from 1, EOS
belonging to the document it ends; 0 marks padding. A target is weighted only when it is in
the same document as its input, so no loss term crosses a document boundary (the first token
of each document is never a weighted target, EOS always is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from cem_jax.config import check_int
from cem_jax.data import text
from cem_jax.data.tokenizer import Tokenizer

# Documents are encoded in pieces of at most this many characters (cut at a paragraph or line
# break) so that one huge file is still encoded on all cores.
ENCODE_PIECE_CHARS = 1 << 16
# Pieces handed to SentencePiece per call: large enough to keep its threads busy, small enough
# for the progress bar to move.
ENCODE_GROUP = 64


@dataclasses.dataclass(frozen=True)
class Windows:
  """Packed windows of one split.

  Attributes:
    tokens: int32 ``[num_windows, seq_len + 1]`` token ids (pad id where padded).
    segment_ids: int32, same shape; 1-based document index within each window, 0 = padding.
    nbytes: int32, same shape, the UTF-8 bytes of text each token stands for (EOS and padding
      0), or None when not packed (``pack(..., doc_bytes=None)``).
  """

  tokens: np.ndarray
  segment_ids: np.ndarray
  nbytes: np.ndarray | None = None

  @property
  def has_bytes(self) -> bool:
    return self.nbytes is not None

  def rows(self, idx) -> dict[str, np.ndarray | None]:
    """Returns windows ``idx`` (an int array or a slice): ``tokens``, ``segment_ids`` and
    ``nbytes`` (None without bytes), ``[len(idx), seq_len + 1]``."""
    return {"tokens": self.tokens[idx], "segment_ids": self.segment_ids[idx],
            "nbytes": None if self.nbytes is None else self.nbytes[idx]}

  @property
  def num_windows(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def seq_len(self) -> int:
    return int(self.tokens.shape[1]) - 1


def encode_pieces(doc: str) -> list[str]:
  """Splits ``doc`` into the pieces it is encoded in: at most ``ENCODE_PIECE_CHARS``
  characters each, cut after the last blank line (else newline) before the limit when there
  is one (:func:`cem_jax.data.text.cut_at_breaks`). Joined, they give ``doc`` back; ``[]``
  for an empty document.

  The in-memory and prepared paths both encode these pieces, so they tokenize a document the
  same way.
  """
  return text.cut_at_breaks(doc, ENCODE_PIECE_CHARS)


def encode_documents(tok: Tokenizer, docs: Sequence[str], desc: str = "encode"
                     ) -> list[np.ndarray]:
  # The in-memory reference of the prepared path (``shard_writer.py`` encodes the same pieces).
  """Returns each document's ids (int32 ``[n_i]``, no EOS), encoded in parallel.

  A long document is encoded in paragraph-aligned pieces; decoding the result still gives the
  document back exactly (the split can only change how a piece boundary is tokenized). Shows a
  progress bar (characters, ETA) labelled ``desc`` when stderr is a terminal.
  """
  pieces, owner = [], []
  for i, doc in enumerate(docs):
    for piece in encode_pieces(doc):
      pieces.append(piece)
      owner.append(i)
  per_doc: list[list[np.ndarray]] = [[] for _ in docs]
  with tqdm(total=sum(map(len, pieces)), desc=desc, unit="char", unit_scale=True,
            disable=None, leave=False) as bar:
    for start in range(0, len(pieces), ENCODE_GROUP):
      group = pieces[start:start + ENCODE_GROUP]
      for i, ids in zip(owner[start:start + ENCODE_GROUP], tok.encode_batch(group),
                        strict=True):
        per_doc[i].append(np.asarray(ids, np.int32))
      bar.update(sum(map(len, group)))
  return [np.concatenate(p) if p else np.zeros(0, np.int32) for p in per_doc]


def count_windows(num_tokens: int, seq_len: int, *, keep_tail: bool, split: str) -> int:
  """Number of windows of ``seq_len + 1`` tokens a split of ``num_tokens`` tokens (EOS
  included) packs into: full windows only (``keep_tail=False``, train), or with the padded
  tail (``keep_tail=True``, validation).

  Raises:
    ValueError: ``seq_len`` not what ``data.seq_len`` allows (an int >= 2,
      :func:`cem_jax.config.check_int`), or the split yields no window with a weighted target
      (one line naming ``data.seq_len``, its value, ``split`` and the tokens available).
  """
  check_int("data.seq_len", seq_len)
  width = seq_len + 1
  num = num_tokens // width if not keep_tail else -(-num_tokens // width)
  # A padded tail needs two real tokens to hold one weighted target.
  if num == 0 or (keep_tail and num_tokens < 2):
    what = ("one full train window needs seq_len + 1 tokens" if not keep_tail
            else "it needs at least 2 tokens")
    raise ValueError(
        f"data.seq_len={seq_len} is too long for the {split} split: it has {num_tokens} tokens "
        f"(EOS included) and {what}; lower data.seq_len or use more text"
    )
  return num


def pack(doc_ids: Sequence[np.ndarray], seq_len: int, eos_id: int, pad_id: int, *,
         keep_tail: bool, split: str, doc_bytes: Sequence[np.ndarray] | None = None
         ) -> Windows:
  """Packs tokenized documents into windows of ``seq_len + 1`` tokens.

  Args:
    doc_ids: each document's token ids, without EOS.
    seq_len: model sequence length (``data.seq_len``, an int >= 2).
    eos_id, pad_id: tokenizer ids.
    keep_tail: False (train) drops the final partial window; True (validation) keeps it,
      padded with ``pad_id`` and segment 0.
    split: split name, for error messages.
    doc_bytes: optional, each document's per-token UTF-8 bytes (as ``doc_ids``), packed
      alongside into ``Windows.nbytes``.

  Returns:
    ``Windows`` with int32 ``[num_windows, seq_len + 1]`` arrays.

  Raises:
    ValueError: as :func:`count_windows`: ``seq_len`` not an int >= 2, or the split yields
      no window with a weighted target (one line naming ``data.seq_len``).
  """
  lengths = np.array([len(d) + 1 for d in doc_ids], np.int64)
  num = count_windows(int(lengths.sum()), seq_len, keep_tail=keep_tail, split=split)
  width = seq_len + 1
  flat = np.full(int(lengths.sum()), eos_id, np.int32)
  ends = np.cumsum(lengths)
  flat_bytes = np.zeros(len(flat), np.int32)
  for ids, end, n in zip(doc_ids, ends, lengths, strict=True):
    flat[end - n : end - 1] = ids
  for nb, end, n in zip(doc_bytes or (), ends, lengths, strict=False):
    flat_bytes[end - n : end - 1] = nb
  doc_index = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
  total = num * width
  tokens = np.full(total, pad_id, np.int32)
  segments = np.zeros(total, np.int64)
  used = min(total, len(flat))
  tokens[:used] = flat[:used]
  segments[:used] = doc_index[:used]
  nbytes = np.zeros(total, np.int32)
  nbytes[:used] = flat_bytes[:used]
  tokens = tokens.reshape(num, width)
  segments = segments.reshape(num, width)
  # Documents are consecutive, so subtracting each window's first document numbers them 1..k.
  segment_ids = np.where(
      np.arange(total).reshape(num, width) < used, segments - segments[:, :1] + 1, 0
  ).astype(np.int32)
  return Windows(tokens=tokens, segment_ids=segment_ids,
                 nbytes=nbytes.reshape(num, width) if doc_bytes is not None else None)


def make_batch(tokens: np.ndarray, segment_ids: np.ndarray, nbytes: np.ndarray | None = None
               ) -> dict[str, np.ndarray]:
  """Turns windows ``[b, seq_len + 1]`` into a model batch of ``[b, seq_len]`` arrays.

  Returns:
    ``inputs`` (int32, tokens[:, :-1]), ``targets`` (int32, tokens[:, 1:]), ``segment_ids``
    (int32, of the inputs), ``weights`` (float32: 1 where the target is in the same
    non-padding document as its input, else 0) and, when ``nbytes`` is given,
    ``target_bytes`` (float32, the UTF-8 bytes of text each target stands for).
  """
  seg_in, seg_out = segment_ids[:, :-1], segment_ids[:, 1:]
  batch = {
      "inputs": np.ascontiguousarray(tokens[:, :-1], np.int32),
      "targets": np.ascontiguousarray(tokens[:, 1:], np.int32),
      "segment_ids": np.ascontiguousarray(seg_in, np.int32),
      "weights": ((seg_in == seg_out) & (seg_out > 0)).astype(np.float32),
  }
  if nbytes is not None:
    batch["target_bytes"] = np.ascontiguousarray(nbytes[:, 1:], np.float32)
  return batch
