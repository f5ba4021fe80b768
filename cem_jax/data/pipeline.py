"""Batches for training and evaluation, and ``build_data``, the entry point of the package.

Windows come from a prepared dataset (``prepared.StreamWindows``, read by position from
ArrayRecord shards) or, as the in-memory reference, from ``packing.pack`` (``Windows``): both
offer ``num_windows``, ``seq_len``, ``has_bytes`` and ``rows(idx)``.

Training batches are a pure function of ``(shuffle_seed, step)``: global example ``g`` of
step ``s`` is ``s * batch_size + g``; it lies in epoch ``g // num_windows`` at position
``g % num_windows``, and that position's window is ``shuffled_positions`` of it: grain's
``index_shuffle``, a keyed permutation computed index by index, so no epoch's order is ever
held in memory and it does not depend on numpy's random streams. Resuming at any step
therefore needs no iterator state, and every window is seen once per epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Iterator

import numpy as np

from cem_jax.config import check_int, check_minus_one_or_positive
from cem_jax.data import packing, shard_writer, sources
from cem_jax.data import prepared as prepared_lib
from cem_jax.data import text as text_lib
from cem_jax.data import tokenizer as tokenizer_lib

# Rounds of grain's cipher. Its default, 4 (MapDataset.shuffle's), mixes too little: the
# windows at positions 2k and 2k + 1 agree in some bits of their index always and in others
# never, so a batch holds e.g. exactly as many windows from each half of the split. At 6 some
# bits still flip with probability 0.33; at 8 every bit flips with 0.48-0.52 (measured at
# 2**20 - 5 windows), for 5 us per window instead of 4.
ROUNDS = 8


def _epoch_seed(shuffle_seed: int, epoch: int) -> int:
  # grain's MapDataset.shuffle keys epoch e with seed + e, so seed 1's first epoch would be
  # seed 0's second; a hash keeps the runs of different seeds apart. 32 bits: the cipher's key.
  digest = hashlib.sha256(f"cem_jax.shuffle/{shuffle_seed}/{epoch}".encode()).digest()
  return int.from_bytes(digest[:4], "little")


def shuffled_positions(positions: np.ndarray, num_windows: int, shuffle_seed: int,
                       epoch: int) -> np.ndarray:
  """Maps positions of epoch ``epoch`` to windows: a permutation of ``[0, num_windows)``
  keyed by ``(shuffle_seed, epoch)``, evaluated only at ``positions`` (int, each in
  ``[0, num_windows)``); returns int64 of the same shape. Memory and time are linear in
  ``len(positions)`` (~5 us each from 2**16 windows up), not in ``num_windows``.

  The permutation is ``grain.experimental.index_shuffle`` (a Simon cipher of ``ROUNDS``
  rounds, cycle-walked into the range). grain sizes the cipher's block as
  ``ceil(log2(max_index))`` bits, rounded up to even and at least 16: one bit short when
  ``max_index`` is an even power of two of 2**16 or more, where window ``max_index`` is never
  drawn and another one twice (``num_windows = 65537`` drops a window every epoch). Whenever
  ``num_windows - 1`` is a power of two, one index more, ``[0, num_windows]``, is shuffled
  and walked past, which is again a permutation of ``[0, num_windows)``. The 16-bit block
  makes small splits slow: about ``2**16 / num_windows`` cipher calls per window (a 512-row
  batch of 1,000 windows ~30 ms, of 5,000 ~8 ms).

  Source: grain's ``index_shuffle.cc`` (Simon, Beaulieu et al. 2013, keyed by
  ``std::seed_seq``); cycle walking, Black & Rogaway, "Ciphers with arbitrary finite
  domains" (2002).

  Raises:
    ModuleNotFoundError: grain cannot be imported (training checks this at start-up,
      ``require_shuffle``).
  """
  # Imported here: the offline GPU image has no grain, and bench never shuffles.
  from grain.experimental import index_shuffle

  n = int(num_windows)
  top = n if (n - 1) & (n - 2) == 0 else n - 1  # n - 1 a power of two (or 0): one more
  seed = _epoch_seed(shuffle_seed, epoch)
  flat = np.asarray(positions, np.int64).reshape(-1)
  out = np.empty(flat.shape, np.int64)
  for k, p in enumerate(flat.tolist()):
    j = index_shuffle(p, max_index=top, seed=seed, rounds=ROUNDS)
    while j >= n:
      j = index_shuffle(j, max_index=top, seed=seed, rounds=ROUNDS)
    out[k] = j
  return out.reshape(np.shape(positions))


def require_shuffle() -> None:
  """Imports the shuffle's library now: training calls it at start-up, so that a machine
  without grain (the offline GPU image) fails before the data is prepared and the steps
  compiled, not at the first batch. Evaluation never shuffles and does not call it.

  Raises:
    ModuleNotFoundError: one line: grain (or a package it needs) cannot be imported.
  """
  try:
    from grain.experimental import index_shuffle  # noqa: F401
  except ImportError as e:
    raise ModuleNotFoundError(
        f"grain cannot be imported ({e}): the training order is "
        "grain.experimental.index_shuffle; pip install 'grain>=0.2.18' (offline: carry its "
        "wheels, docs/PERFORMANCE.md)") from e


class TrainBatches:
  """Shuffled training batches of packed windows, indexed by step.

  Args:
    windows: the packed train split (``packing.Windows`` or ``prepared.StreamWindows``).
    batch_size: global batch size (``train.batch_size``), in sequences.
    shuffle_seed: ``data.shuffle_seed``.

  Raises:
    ValueError: ``batch_size`` or ``shuffle_seed`` not what its config field allows
      (:func:`cem_jax.config.check_int`: an int >= 1; an int >= 0 and < 2**63), one line
      naming the field.
  """

  def __init__(self, windows, batch_size: int, shuffle_seed: int):
    check_int("train.batch_size", batch_size)
    check_int("data.shuffle_seed", shuffle_seed)
    self.windows = windows
    self.batch_size = int(batch_size)
    self.shuffle_seed = int(shuffle_seed)

  @property
  def num_windows(self) -> int:
    return self.windows.num_windows

  @property
  def seq_len(self) -> int:
    return self.windows.seq_len

  def window_indices(self, step: int, process_index: int = 0, process_count: int = 1
                     ) -> np.ndarray:
    """Returns the window indices (int64 ``[batch_size // process_count]``) of this process's
    rows of step ``step``'s global batch.

    Raises:
      ValueError: ``step`` < 0, ``process_index`` not in ``[0, process_count)``, or
        ``batch_size`` not divisible by ``process_count``.
    """
    if step < 0:
      raise ValueError(f"step={step}; allowed: an int >= 0")
    if process_count < 1 or not 0 <= process_index < process_count:
      raise ValueError(f"process_index={process_index} must be in [0, {process_count})")
    if self.batch_size % process_count:
      raise ValueError(f"train.batch_size={self.batch_size} is not divisible by the process "
                       f"count {process_count}; allowed: a multiple of {process_count}")
    local = self.batch_size // process_count
    g = step * self.batch_size + process_index * local + np.arange(local, dtype=np.int64)
    epochs, positions = np.divmod(g, self.num_windows)
    out = np.empty(local, np.int64)
    for epoch in np.unique(epochs):
      sel = epochs == epoch
      out[sel] = shuffled_positions(positions[sel], self.num_windows, self.shuffle_seed,
                                    int(epoch))
    return out

  def batch(self, step: int, process_index: int = 0, process_count: int = 1
            ) -> dict[str, np.ndarray]:
    """Returns this process's part of step ``step``'s batch.

    Process ``i`` of ``n`` gets rows ``[i * local, (i + 1) * local)`` of the global batch,
    ``local = batch_size // n``; concatenated in process order they are the 1-process batch.

    Returns:
      ``inputs``, ``targets``, ``segment_ids`` (int32) and ``weights`` (float32), each
      ``[local, seq_len]``; see ``packing.make_batch``.

    Raises:
      ValueError: ``step`` < 0, bad process index, or ``train.batch_size`` not divisible by
        ``process_count``.
    """
    rows = self.windows.rows(self.window_indices(step, process_index, process_count))
    return packing.make_batch(rows["tokens"], rows["segment_ids"])


class EvalWindows:
  """The whole validation split as windows in order, served as padded batches.

  Args:
    windows: the packed validation split, with per-token bytes (``has_bytes``).
    pad_id: the tokenizer's pad id.

  Raises:
    ValueError: ``windows`` carry no per-token bytes (bits per byte would have no exact
      denominator).
  """

  def __init__(self, windows, pad_id: int):
    if not windows.has_bytes:
      raise ValueError("validation windows need per-token text bytes (pack(..., doc_bytes=...)"
                       " or a prepared validation split) for bits per byte")
    self.windows = windows
    self.pad_id = int(pad_id)

  @property
  def num_windows(self) -> int:
    return self.windows.num_windows

  def total_weight(self) -> float:
    """Number of weighted targets in the split (the sum of all eval batches' weights)."""
    total = 0.0
    for start in range(0, self.num_windows, 256):
      seg = self.windows.rows(np.arange(start, min(start + 256, self.num_windows)))[
          "segment_ids"]
      total += float(((seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] > 0)).sum())
    return total

  def num_batches(self, batch_size: int) -> int:
    return -(-self.num_windows // batch_size)

  def batches(self, batch_size: int, process_index: int = 0, process_count: int = 1,
              max_batches: int = -1) -> Iterator[dict[str, np.ndarray]]:
    """Yields this process's part of each global eval batch of ``batch_size`` windows.

    With ``max_batches`` -1 (or at least ``num_batches``), all windows are visited once, in
    order, and the last global batch is filled up to ``batch_size`` with padding rows (pad
    ids, segment 0, weight 0), so every batch has the same shape and the summed weights equal
    ``total_weight()``. Otherwise ``max_batches * batch_size`` windows spread evenly over the
    split are read, window ``floor(i * num_windows / (max_batches * batch_size))`` for
    each ``i``: a held-out split is the text's files in order, so its first windows would be
    its first few files.

    Yields:
      dicts as ``TrainBatches.batch`` plus ``target_bytes`` (float32, the UTF-8 bytes of text
      each target stands for, from the text itself), arrays
      ``[batch_size // process_count, seq_len]``.

    Raises:
      ValueError: ``batch_size`` not an int >= 1 (:func:`cem_jax.config.check_int`) or not
        divisible by ``process_count`` (naming ``eval.batch_size``), or ``max_batches``
        neither -1 nor >= 1 (naming ``eval.max_batches``).
    """
    check_int("eval.batch_size", batch_size)
    if batch_size % process_count:
      raise ValueError(f"eval.batch_size={batch_size} is not divisible by the process count "
                       f"{process_count}; allowed: a multiple of {process_count}")
    check_minus_one_or_positive("eval.max_batches", max_batches)
    n = self.num_windows
    if max_batches == -1 or max_batches * batch_size >= n:
      num_batches, picks = self.num_batches(batch_size), np.arange(n, dtype=np.int64)
    else:
      num_batches = max_batches
      total = max_batches * batch_size
      picks = np.arange(total, dtype=np.int64) * n // total
    local = batch_size // process_count
    for b in range(num_batches):
      start = b * batch_size + process_index * local
      idx = picks[start:start + local]
      rows = self.windows.rows(idx)
      tok, seg, nb = rows["tokens"], rows["segment_ids"], rows["nbytes"]
      missing = local - len(idx)
      if missing:
        width = self.windows.seq_len + 1
        tok = np.concatenate([tok, np.full((missing, width), self.pad_id, np.int32)])
        seg = np.concatenate([seg, np.zeros((missing, width), np.int32)])
        nb = np.concatenate([nb, np.zeros((missing, width), np.int32)])
      yield packing.make_batch(tok, seg, nb)


@dataclasses.dataclass(frozen=True)
class Data:
  """Everything the training loop needs from the data side.

  Attributes:
    train: training batches by step.
    eval: validation windows (``eval.batches(batch_size)``).
    tokenizer: the tokenizer.
    source: one-line description of the text source.
    train_documents, eval_documents: number of documents per split.
    train_tokens, eval_tokens: tokens per split, one EOS per document included.
    train_bytes, eval_bytes: UTF-8 bytes of the split's text (no separators), counted from
      the text.
    train_windows, eval_windows: number of packed windows (eval: padded tail included).
    identity: what a checkpoint must have been trained on to be resumed with these data:
      ``{"tokenizer_sha256", "train_sha256", "validation_sha256"}`` (the token streams by
      their shards' sha256); None for the in-memory reference.
  """

  train: TrainBatches
  eval: EvalWindows
  tokenizer: tokenizer_lib.Tokenizer
  source: str
  train_documents: int
  eval_documents: int
  train_tokens: int
  eval_tokens: int
  train_bytes: int
  eval_bytes: int
  identity: dict[str, str] | None = None

  @property
  def train_windows(self) -> int:
    return self.train.num_windows

  @property
  def eval_windows(self) -> int:
    return self.eval.num_windows

  def eval_batches(self, batch_size: int, process_index: int = 0, process_count: int = 1,
                   max_batches: int = -1) -> Iterator[dict[str, np.ndarray]]:
    """Same as ``self.eval.batches``."""
    return self.eval.batches(batch_size, process_index, process_count, max_batches)

  def stats(self) -> dict[str, int | str]:
    """The counts above as a flat dict (for logs and ``metrics.jsonl``)."""
    return {
        "source": self.source,
        "vocab_size": self.tokenizer.vocab_size,
        "train_documents": self.train_documents, "eval_documents": self.eval_documents,
        "train_tokens": self.train_tokens, "eval_tokens": self.eval_tokens,
        "train_bytes": self.train_bytes, "eval_bytes": self.eval_bytes,
        "train_windows": self.train_windows, "eval_windows": self.eval_windows,
    }


def check_given_files(data_config) -> None:
  """Refuses a ``data.prepared_dir`` with no manifest or, without one, a ``data.tokenizer`` that
  is no SentencePiece model of ``data.vocab_size`` pieces with an EOS piece, and a
  ``data.files`` glob that matches no file: what :func:`build_data` would
  refuse after jax loaded (a misspelt path cost ~10 s) or the text was read, checked first
  (``main`` checks them before jax loads). With ``data.prepared_dir`` the given tokenizer is
  compared with the folder's when it is opened (``prepared.check_fits``); the files given
  beside it are read there too (their sha256 against the manifest's), so they must exist.

  Raises:
    ValueError, FileNotFoundError: as :func:`cem_jax.data.prepared.manifest_file`,
      :func:`cem_jax.data.tokenizer.load_tokenizer` and
      :func:`cem_jax.data.text.resolve_files` (one line).
  """
  if data_config.prepared_dir:
    prepared_lib.manifest_file(data_config.prepared_dir)
  elif data_config.tokenizer:
    # Read, not only found: a file that is no model, or of another vocab_size, was refused
    # after jax loaded and the text was read (~30 s on busy cores).
    tokenizer_lib.load_tokenizer(data_config.tokenizer, data_config.vocab_size)
  if data_config.files:
    text_lib.resolve_files(data_config.files)


def build_data(config, workdir: str | os.PathLike, verify: bool = True) -> Data:
  """Builds the data of an experiment from its resolved config.

  Reads ``config.data`` (source, split, tokenizer, ``seq_len``, ``shuffle_seed``,
  ``prepared_dir``) and ``config.train.batch_size``. Trains from the prepared dataset in
  ``data.prepared_dir``, or, when that is '', from ``WORKDIR/data/<fingerprint>``, prepared
  there first (``shard_writer.prepare``) unless it already is. No raw text is read when the
  prepared data is there. ``verify``: check the prepared files' sha256 (False: sizes only,
  see ``PreparedData.open``).

  Raises:
    ValueError: bad config values or inputs, a prepared dataset that does not fit the config
      or is damaged (one line naming the field or file, and for a damaged
      ``WORKDIR/data/<fingerprint>`` the folder to remove).
    FileNotFoundError: ``data.tokenizer`` does not exist.
    ConnectionError: a TFDS catalog dataset is not prepared and there is no network.
  """
  d = config.data
  start = time.perf_counter()
  directory = shard_writer.prepared_for(d, workdir)
  try:
    ds = prepared_lib.PreparedData.open(directory, d if d.prepared_dir else None, verify=verify)
  except prepared_lib.BadPreparedData as e:
    if d.prepared_dir:
      raise
    # The user never ran prepare for this folder: training made it, and makes it again.
    raise e.with_remedy(f"remove {directory} and start again: it is prepared anew") from None
  tok, info = ds.tokenizer, ds.manifest["splits"]
  logging.getLogger(__name__).info(
      "data: %s (%d train / %d validation tokens) ready in %.2f s", directory,
      info["train"]["tokens"], info["validation"]["tokens"], time.perf_counter() - start)
  train_windows = prepared_lib.StreamWindows(ds.streams["train"], d.seq_len, tok.eos_id,
                                             tok.pad_id, keep_tail=False, split="train")
  eval_windows = prepared_lib.StreamWindows(ds.streams["validation"], d.seq_len, tok.eos_id,
                                            tok.pad_id, keep_tail=True, split="validation")
  return Data(
      train=TrainBatches(train_windows, config.train.batch_size, d.shuffle_seed),
      eval=EvalWindows(eval_windows, tok.pad_id),
      tokenizer=tok,
      source=f"{ds.manifest['source']} via {directory}",
      train_documents=info["train"]["documents"],
      eval_documents=info["validation"]["documents"],
      train_tokens=info["train"]["tokens"],
      eval_tokens=info["validation"]["tokens"],
      train_bytes=info["train"]["bytes"],
      eval_bytes=info["validation"]["bytes"],
      identity=data_identity(ds.manifest),
  )


def data_identity(manifest: dict) -> dict[str, str]:
  """``Data.identity`` of a prepared dataset's manifest: tokenizer and token streams by
  sha256 (not by folder or source path, so the same tokens prepared elsewhere are the same
  data)."""
  def streams(split: str) -> str:
    shards = "\n".join(s["sha256"] for s in manifest["splits"][split]["shards"])
    return hashlib.sha256(shards.encode()).hexdigest()

  return {"tokenizer_sha256": manifest["tokenizer"]["sha256"],
          "train_sha256": streams("train"), "validation_sha256": streams("validation")}


def check_same_data(saved: dict | None, now: dict | None, checkpoint: str) -> None:
  """Refuses a checkpoint on other tokens than it was trained on: new ids under old
  embeddings would train (or be evaluated) silently, as if nothing had changed, e.g. after
  the text was edited and the BPE retrained. ``saved``: the checkpoint's record
  (``meta["data"]``); ``now``: ``Data.identity``; either None skips the check (a checkpoint
  saved before they recorded their data, or the in-memory reference). The identity is the
  shards' sha256: the same tokens written by another array_record version would differ.

  Raises:
    ValueError: one line naming the checkpoint and what differs (sha256 prefixes).
  """
  if saved is None or now is None:
    return
  changed = [f"{k} {str(saved.get(k))[:12]} -> {v[:12]}" for k, v in now.items()
             if saved.get(k) != v]
  if changed:
    raise ValueError(f"checkpoint {checkpoint} was trained on other data ({', '.join(changed)}):"
                     " the text or the tokenizer changed since; use the data it was trained "
                     "on, or train in a new --workdir")


def build_data_in_memory(config) -> Data:
  """The reference of ``build_data``: the same splits, tokenizer rule and packing, built in
  memory from the raw text (``data.tokenizer`` or a tokenizer trained on the train split,
  not cached). Used by tests to pin the prepared path token for token.

  Raises:
    As ``build_data``.
  """
  d = config.data
  splits = sources.text_splits(d)
  train_docs, eval_docs = list(splits.train), list(splits.validation)
  tok = (tokenizer_lib.load_tokenizer(d.tokenizer, d.vocab_size) if d.tokenizer else
         tokenizer_lib.Tokenizer(tokenizer_lib.train_model(train_docs, d.vocab_size,
                                                           d.tokenizer_model_type)))
  train_ids = packing.encode_documents(tok, train_docs, "encode train")
  eval_enc = []
  for doc in eval_docs:  # in the pieces the prepared path encodes
    parts = [tok.encode_with_bytes(piece) for piece in packing.encode_pieces(doc)]
    eval_enc.append((np.concatenate([p[0] for p in parts] or [np.zeros(0, np.int32)]),
                     np.concatenate([p[1] for p in parts] or [np.zeros(0, np.int32)])))
  train_windows = packing.pack(train_ids, d.seq_len, tok.eos_id, tok.pad_id, keep_tail=False,
                               split="train")
  eval_windows = packing.pack([e[0] for e in eval_enc], d.seq_len, tok.eos_id, tok.pad_id,
                              keep_tail=True, split="validation",
                              doc_bytes=[e[1] for e in eval_enc])
  return Data(
      train=TrainBatches(train_windows, config.train.batch_size, d.shuffle_seed),
      eval=EvalWindows(eval_windows, tok.pad_id),
      tokenizer=tok,
      source=splits.source,
      train_documents=len(train_docs),
      eval_documents=len(eval_docs),
      train_tokens=sum(len(i) + 1 for i in train_ids),
      eval_tokens=sum(len(e[0]) + 1 for e in eval_enc),
      train_bytes=sum(len(t.encode("utf-8")) for t in train_docs),
      eval_bytes=sum(len(t.encode("utf-8")) for t in eval_docs),
  )
