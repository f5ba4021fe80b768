"""Plain-text helpers shared by every source: file decoding, globbing and the split rule.

Text normalisation, applied to every local file:
  * a leading UTF-8 byte-order mark is dropped (``utf-8-sig`` semantics);
  * CRLF and lone CR line ends become LF.
Nothing else is changed (no Unicode normalisation, no whitespace stripping), so the text the
model sees is byte-for-byte the file minus those two conventions. TFDS catalog text gets the
second only (``tfds_catalog.CatalogTexts``): a BOM at the start of an example is kept, as it
always was, so that prepared tokens and fingerprints stay as they are.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from cem_jax.config import check_range

# The separator the split rule (and the byte n-gram reference tool) puts between documents.
DOC_SEPARATOR = "\n\n"


def normalize_newlines(text: str) -> str:
  """Returns ``text`` with CRLF and lone CR line ends replaced by LF."""
  return text.replace("\r\n", "\n").replace("\r", "\n")


# Files are decoded this many bytes at a time: a pass over a corpus of one multi-GB file holds
# one block of its text and one document of the split, not the file. (On a 520 MB file, 1 MiB
# blocks were faster than 4 or 16 MiB ones, and held 15 MB against 60 and 240.)
READ_BLOCK_BYTES = 1 << 20


def file_stamp(path: str | os.PathLike | int) -> tuple[int, int, int]:
  """``(size in bytes, modification time, status change time)`` (times in ns) of a file path
  or open descriptor: what ``read_text`` compares to find a file changed since it was
  identified.

  Raises:
    OSError: the file cannot be found or its status read.
  """
  # The change time as well: an edit that keeps the size and sets the old modification time
  # back (``cp -p`` then ``mv``, ``touch -r``) moves it, and no user can set it. Not the inode:
  # FUSE file systems (without use_ino) may number a file anew between two opens.
  st = os.stat(path)
  return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def read_text(path: str | os.PathLike, stamp: tuple[int, int, int] | None = None,
              digest=None, block_bytes: int | None = None) -> Iterator[str]:
  """Yields the text of file ``path``, decoded and normalised (see the module docstring), in
  non-empty pieces of at most ``max(block_bytes, 3)`` characters (3: a BOM is read whole);
  ``''.join`` of them is the whole text. One block is in memory at a time.

  Args:
    path: the file.
    stamp: its ``file_stamp`` when it was identified: a file found otherwise when opened, or
      changed during its read (checked at every block), is an error. None: checked only
      during the read.
    digest: a ``hashlib`` object, updated with every byte of the file (a BOM included).
    block_bytes: bytes read and decoded at a time (>= 1; default ``READ_BLOCK_BYTES``).

  Raises:
    ValueError: one line naming ``path``: the byte offset in the file (a BOM counted) of the
      first byte that is not valid UTF-8, or the file changed.
    OSError: the file cannot be read.
  """
  block_bytes = block_bytes or READ_BLOCK_BYTES
  decoder = codecs.getincrementaldecoder("utf-8")()
  with open(path, "rb") as f:
    opened = file_stamp(f.fileno())
    if stamp is not None and opened != stamp:
      raise ValueError(_changed(path))
    offset, cr = 0, False  # bytes given to the decoder; the last piece ended in a CR
    while True:
      # The BOM is stripped by hand, not by 'utf-8-sig', so error offsets count its bytes.
      data = f.read(max(block_bytes, len(codecs.BOM_UTF8)) if offset == 0 else block_bytes)
      # Stamps, not the bytes read against the size: /proc and some FUSE files report a size
      # their content does not have. Checked at every block (an fstat per MiB), so an edit
      # stops an encoding pass at once, not after the rest of the file has been encoded.
      if file_stamp(f.fileno()) != opened:
        raise ValueError(_changed(path))
      if digest is not None:
        digest.update(data)
      end = not data
      if offset == 0 and data.startswith(codecs.BOM_UTF8):
        offset, data = len(codecs.BOM_UTF8), data[len(codecs.BOM_UTF8):]
      held = len(decoder.getstate()[0])  # bytes of a character cut by the last block
      try:
        text = decoder.decode(data, final=end)
      except UnicodeDecodeError as e:  # e.object: the held bytes, then ``data``
        raise ValueError(
            f"{os.fspath(path)}: not UTF-8 text: byte 0x{e.object[e.start]:02x} at byte offset "
            f"{offset - held + e.start} ({e.reason}); convert the file to UTF-8") from None
      offset += len(data)
      if text:
        if cr and text[0] == "\n":  # the LF of a CRLF cut by the block boundary
          text = text[1:]
        cr = text.endswith("\r")
        if text:
          yield normalize_newlines(text)
      if end:
        break


def resolve_files(files: str) -> list[Path]:
  """Expands ``data.files``, a comma-separated list of globs, into absolute file paths.

  Each glob's matches are sorted; globs keep the order they are listed in (the corpus order,
  in which chunks are numbered for the held-out split); a file matched twice is kept at its
  first place.
  ``~`` is expanded and ``**`` matches directories recursively. Directories are skipped.

  Raises:
    ValueError: ``files`` names no glob, or a glob matches no file (the message names it).
  """
  patterns = [p.strip() for p in files.split(",") if p.strip()]
  if not patterns:
    raise ValueError(f"data.files={files!r} names no file glob")
  paths: list[Path] = []
  seen: set[Path] = set()
  for pattern in patterns:
    matches = sorted(
        Path(m).resolve()
        for m in glob.glob(os.path.expanduser(pattern), recursive=True)
        if os.path.isfile(m)
    )
    if not matches:
      folder = os.path.isdir(os.path.expanduser(pattern))
      hint = (f" ({pattern!r} is a folder; allowed: globs of files, e.g. "
              f"{os.path.join(pattern, '*.txt')!r})" if folder else "")
      if not os.path.isabs(os.path.expanduser(pattern)):  # e.g. ../shared/data run elsewhere
        hint += f" (relative to the working directory {os.getcwd()})"
      raise ValueError(f"data.files: glob {pattern!r} matches no file{hint}")
    for path in matches:
      if path not in seen:
        seen.add(path)
        paths.append(path)
  return paths


def read_documents(paths: Sequence[Path]) -> list[str]:
  """Reads each file as one document (decoded and normalised, see the module docstring).

  Raises:
    ValueError: a file is not UTF-8 (names file and byte offset), or every file is empty or
      whitespace only (names the files).
    OSError: a file cannot be read.
  """
  docs = ["".join(read_text(p)) for p in paths]
  _check_has_text(any(doc.strip() for doc in docs), paths)
  return docs


def _changed(path: str | os.PathLike) -> str:
  return (f"data.files: {os.fspath(path)} changed while its text was being read; run again "
          "once the files are final")


def _check_has_text(has_text: bool, paths: Sequence[Path]) -> None:
  if not has_text:
    names = ", ".join(os.fspath(p) for p in paths)
    raise ValueError(f"data.files: the corpus is empty (only empty or whitespace files): {names}; "
                     "point data.files at files with text")


def split_documents(
    docs: Sequence[str], validation_fraction: float
) -> tuple[list[str], list[str]]:
  """Splits documents into train and validation by the one split rule of this package.

  The documents, joined by ``"\\n\\n"``, are cut at ``1 - validation_fraction`` of the
  characters (``int(total * (1 - fraction))``), the cut then moved forward to the start of the
  next line. Documents before the cut go to train, after it to validation; the document that
  contains the cut is split in two (head to train, tail to validation). A cut that falls in a
  separator splits no document. Empty documents are dropped (they hold no text). So
  ``''.join(train) + ''.join(validation) == ''.join(docs)``.

  Args:
    docs: documents in their canonical order.
    validation_fraction: fraction of characters held out, in (0, 0.5].

  Returns:
    ``(train_docs, validation_docs)``, both non-empty lists of non-empty strings.

  Raises:
    ValueError: the fraction is not a number in (0, 0.5] (:func:`cem_jax.config.check_range`),
      or the rule leaves either split empty (tiny corpus or no line break after the cut); the
      message names ``data.validation_fraction``.
  """
  check_range("data.validation_fraction", validation_fraction)
  sep = len(DOC_SEPARATOR)
  total = sum(len(d) for d in docs) + sep * max(len(docs) - 1, 0)
  cut = int(total * (1.0 - validation_fraction))
  start = 0
  train: list[str] = list(docs)
  validation: list[str] = []
  for k, doc in enumerate(docs):
    if cut < start + len(doc) + sep:
      q = cut - start
      if q < len(doc) and q > 0 and doc[q - 1] != "\n":
        newline = doc.find("\n", q)
        q = len(doc) if newline < 0 else newline + 1
      q = min(q, len(doc))
      head, tail = doc[:q], doc[q:]
      train = list(docs[:k]) + ([head] if head else [])
      validation = ([tail] if tail else []) + list(docs[k + 1 :])
      break
    start += len(doc) + sep
  train = [d for d in train if d]
  validation = [d for d in validation if d]
  if not train or not validation:
    raise ValueError(
        f"data.validation_fraction={validation_fraction} leaves an empty "
        f"{'train' if not train else 'validation'} split of a {total}-character corpus "
        "(too small, or no line break after the cut); use more text or another fraction"
    )
  return train, validation


# Held-out chunks of local files are at most this many characters: long enough for many
# windows of context, short enough that the held-out text samples the whole corpus.
HOLDOUT_CHUNK_CHARS = 16 * 1024


def cut_at_breaks(doc: str, size: int) -> list[str]:
  """Cuts ``doc`` into pieces of at most ``size`` characters, each ending after the window's
  last paragraph break (``'\\n\\n'``) that ends before its last character, else after its
  last newline, else at ``size``;
  ``''.join(result) == doc`` (``[]`` for an empty ``doc``). The held-out chunks and the
  pieces a document is encoded in (``packing.encode_pieces``) are cut by this rule."""
  return _cut(doc, size, final=True)[0]


def _cut(doc: str, size: int, final: bool) -> tuple[list[str], str]:
  """``(pieces, rest)``: ``cut_at_breaks`` of ``doc`` when ``final``; otherwise of a text that
  continues after ``doc``, so only the pieces whose window ends inside ``doc`` (``rest``, at
  most ``size`` characters, is where the next piece starts)."""
  pieces = []
  start = 0
  while start < len(doc):
    end = start + size
    if end < len(doc):
      cut = doc.rfind("\n\n", start, end - 1)
      cut = cut + 2 if cut >= start else doc.rfind("\n", start, end) + 1
      end = cut if cut > start else end
    elif not final:
      break
    pieces.append(doc[start:end])
    start = end
  return pieces, doc[start:]


def _cut_stream(texts: Iterable[str], size: int) -> Iterator[str]:
  """``cut_at_breaks(''.join(texts), size)``, holding one of ``texts`` and one piece at a time."""
  rest = ""
  for text in texts:
    pieces, rest = _cut(rest + text, size, final=False)
    yield from pieces
  yield from cut_at_breaks(rest, size)


def interleave_split(
    docs: Sequence[str], validation_fraction: float
) -> tuple[list[str], list[str]]:
  """Splits documents into train and validation by holding out every k-th chunk.

  The rule for local files (``data.files``), so the held-out text samples the whole corpus
  rather than its tail (the licence text of many e-texts): every document is cut by
  ``cut_at_breaks`` into chunks of at most ``size = min(HOLDOUT_CHUNK_CHARS, ceil(total /
  (4 k)))`` characters, ``total`` the characters of all documents and ``k =
  round(1 / validation_fraction)``, so every corpus has at least ~4 held-out chunks. Chunks
  are numbered across the corpus from 0; chunk ``c`` is held out when ``c % k == k - 1``.
  Each held-out chunk is one validation document; the consecutive training chunks of a
  document stay one training document. About ``1 / k`` of the characters are held out.
  ``interleave_split_files`` is the same split of files, read a block at a time.

  Args:
    docs: documents in their canonical order.
    validation_fraction: in (0, 0.5].

  Returns:
    ``(train_docs, validation_docs)``, both non-empty lists of non-empty strings, in corpus
    order.

  Raises:
    ValueError: the fraction is not a number in (0, 0.5] (:func:`cem_jax.config.check_range`),
      or either split is empty (corpus too small); the message names
      ``data.validation_fraction``.
  """
  k, size = _interleave_rule(sum(len(d) for d in docs), validation_fraction)
  train: list[str] = []
  validation: list[str] = []
  for held_out, doc in _interleave((cut_at_breaks(d, size) for d in docs), k):
    (validation if held_out else train).append(doc)
  if not validation:
    _refuse_empty_validation(docs, validation_fraction, k, size)
  return train, validation


def interleave_split_files(
    paths: Sequence[Path], validation_fraction: float, sha256s: Sequence[str] | None = None
) -> tuple[Iterable[str], Iterable[str]]:
  """``interleave_split(read_documents(paths), validation_fraction)`` without the corpus in
  memory: each split is a re-iterable that reads the files again on every pass, one block of
  one file at a time (``read_text``), so a pass holds a block and a document of the split,
  not the corpus; a corpus of one multi-GB file included. Both splits carry
  ``corpus_characters``, the characters of the two together, counted here.

  The files are read once here, to count their characters (the chunk size depends on the
  total), to raise every error of the eager split before any work starts, and to check them
  against ``sha256s`` (each file's, when it was identified; ``sources.source_identity``). A
  later pass that finds a file of another size, modification or change time raises: a file
  edited between passes would otherwise mix two texts (a tokenizer of one, shards of the
  other, held-out text in the training split).

  Raises:
    As ``read_documents`` and ``interleave_split``.
    ValueError: a file differs from its ``sha256s`` entry, or changed since (here, or on a
      later pass); one line naming it.
    OSError: a file cannot be read (here, or on a later pass).
  """
  k, _ = _interleave_rule(0, validation_fraction)  # a bad fraction fails before any file is read
  if abs(1.0 / k - validation_fraction) > 0.02 * validation_fraction:
    # 0.4 holds out every 2nd chunk (round(2.5) == 2): half the text, not the 40% asked for;
    # 0.33's third is what was meant (within 2%: no warning).
    logging.getLogger(__name__).warning(
        "data.validation_fraction=%s holds out every %s chunk of the files: %.1f%% of the text "
        "(the fraction is 1/k for a whole k = round(1 / fraction)); set %.4g for exactly that",
        validation_fraction, _ordinal(k), 100.0 / k, 1.0 / k)
  total, has_text, stamps = 0, False, []
  for i, p in enumerate(paths):
    stamps.append(file_stamp(p))
    digest = hashlib.sha256() if sha256s is not None else None
    for text in read_text(p, stamps[-1], digest):
      total += len(text)
      has_text = has_text or not text.isspace()
    if digest is not None and digest.hexdigest() != sha256s[i]:
      raise ValueError(_changed(p))
  _check_has_text(has_text, paths)
  k, size = _interleave_rule(total, validation_fraction)
  train = _InterleavedFiles(tuple(paths), tuple(stamps), k, size, total, held_out=False)
  validation = _InterleavedFiles(tuple(paths), tuple(stamps), k, size, total, held_out=True)
  # Chunks never exceed ``size`` characters, so a corpus has at least total / size >= 2k of
  # them, and so a held-out chunk, once total >= 4k; only smaller corpora need counting.
  if total < 4 * k and not any(True for _ in validation):
    docs = ["".join(read_text(p, stamp)) for p, stamp in zip(paths, stamps, strict=True)]
    _refuse_empty_validation(docs, validation_fraction, k, size)
  return train, validation


class _InterleavedFiles:
  """One split of ``interleave_split_files``: iterating it reads the files afresh."""

  def __init__(self, paths: tuple[Path, ...], stamps: tuple[tuple, ...], k: int, size: int,
               corpus_characters: int, held_out: bool):
    self.paths, self.stamps, self.k, self.size = paths, stamps, k, size
    self.corpus_characters, self.held_out = corpus_characters, held_out

  def __iter__(self) -> Iterator[str]:
    chunked = (_cut_stream(read_text(p, stamp), self.size)
               for p, stamp in zip(self.paths, self.stamps, strict=True))
    for held_out, doc in _interleave(chunked, self.k):
      if held_out == self.held_out:
        yield doc


def _interleave_rule(total: int, validation_fraction: float) -> tuple[int, int]:
  """``(k, size)`` of ``interleave_split`` for a corpus of ``total`` characters."""
  check_range("data.validation_fraction", validation_fraction)
  k = round(1.0 / validation_fraction)
  return k, max(1, min(HOLDOUT_CHUNK_CHARS, -(-total // (4 * k))))


def _interleave(chunked: Iterable[Iterable[str]], k: int) -> Iterator[tuple[bool, str]]:
  """Yields ``(held_out, document)`` of ``interleave_split`` in corpus order, from the chunks
  of each document."""
  c = 0
  for chunks in chunked:
    run: list[str] = []
    for chunk in chunks:
      if c % k == k - 1:
        if run:
          yield False, "".join(run)
          run = []
        yield True, chunk
      else:
        run.append(chunk)
      c += 1
    if run:
      yield False, "".join(run)


def _ordinal(k: int) -> str:
  """``k`` as an English ordinal: 2nd, 3rd, 10th, 11th, 21st."""
  suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
  return f"{k}{suffix}"


def _refuse_empty_validation(docs: Sequence[str], validation_fraction: float, k: int,
                             size: int) -> None:
  # k >= 2, so chunk 0 trains: only the held-out split can be empty.
  total = sum(len(d) for d in docs)
  chunks = sum(len(cut_at_breaks(d, size)) for d in docs)
  raise ValueError(
      f"data.validation_fraction={validation_fraction} leaves an empty validation split of a "
      f"{total}-character corpus (every {_ordinal(k)} of its {chunks} chunks is held out); use "
      "more text or another fraction"
  )
