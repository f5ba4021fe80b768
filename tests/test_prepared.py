"""Tests of the prepared (ArrayRecord) data path: equality with the in-memory reference, the
held-out split, exact bytes, interrupted and damaged preparations, fit to the config."""

from __future__ import annotations

import codecs
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from conftest import (
  RUN_MODULE_REPORTING_JAX,
  closed_port,
  fake_catalog,
  subprocess_env,
  tiny_config,
)

from cem_jax import cpus, files
from cem_jax.config import get_default_config
from cem_jax.data import build_data, build_data_in_memory, prepared, read_documents, shard_writer
from cem_jax.data import text as text_lib

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
REPO = Path(__file__).resolve().parents[1]
needs_shared = pytest.mark.usefixtures("shared_data")


def _config(**data):
  config = get_default_config()
  config.data.builtin = "pydoc"
  config.data.seq_len, config.data.vocab_size = 32, 512
  config.train.batch_size = 8
  for key, value in data.items():
    setattr(config.data, key, value)
  return config


def _text(lines: int, tag: str = "") -> str:
  words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
  return "".join(f"{tag}line {i}: " + " ".join(words[(i * j) % 12] for j in range(1, 9)) + ".\n"
                 for i in range(lines))


def _assert_same_data(a, b, steps=(0, 1, 17)):
  assert a.stats() | {"source": ""} == b.stats() | {"source": ""}
  for step in steps:
    x, y = a.train.batch(step), b.train.batch(step)
    assert x.keys() == y.keys()
    for key in x:
      assert np.array_equal(x[key], y[key]), (step, key)
  evals = list(zip(a.eval_batches(16), b.eval_batches(16), strict=True))
  for x, y in evals:
    assert x.keys() == y.keys() == {"inputs", "targets", "segment_ids", "weights", "target_bytes"}
    for key in x:
      assert np.array_equal(x[key], y[key]), key


# ---- equality with the in-memory reference ----------------------------------------------------


@needs_shared
def test_prepared_batches_equal_in_memory_batches_on_war_and_peace(tmp_path):
  config = _config(files=os.fspath(SHARED_DATA / "warpeace.txt"), seq_len=128, vocab_size=1024)
  config.train.batch_size = 16
  data = build_data(config, tmp_path / "wd")
  reference = build_data_in_memory(config)
  _assert_same_data(data, reference, steps=(0, 5, 500))  # 500: past the first epoch
  # Exact bytes: the split's text bytes, counted from the text.
  (doc,) = read_documents([SHARED_DATA / "warpeace.txt"])
  train, validation = text_lib.interleave_split([doc], 0.1)
  assert data.eval_bytes == sum(len(t.encode()) for t in validation)
  assert data.train_bytes + data.eval_bytes == len(doc.encode())


def test_prepared_from_a_multi_shard_stream_equals_in_memory(tmp_path):
  # Several shards per split and documents longer than one encode piece: windows cross
  # records, shards and documents.
  docs = [_text(3000, "a"), _text(200, "b"), _text(1500, "c")]
  paths = []
  for i, doc in enumerate(docs):
    paths.append(tmp_path / f"{i}.txt")
    paths[-1].write_text(doc)
  config = _config(files=",".join(os.fspath(p) for p in paths), vocab_size=300)
  out = shard_writer.prepare(config.data, tmp_path / "prep", shard_chars=20_000)
  manifest = json.loads((out / "manifest.json").read_text())
  # The bytes of every manifest and sidecar written so far: indent 1, sorted keys, no newline.
  for name in ["manifest.json", "prepare.json", "train-00000.json"]:
    text = (out / name).read_text()
    assert text == json.dumps(json.loads(text), indent=1, sort_keys=True), name
  assert len(manifest["splits"]["train"]["shards"]) >= 5
  assert len(manifest["splits"]["validation"]["shards"]) >= 1
  config.data.prepared_dir = os.fspath(out)
  _assert_same_data(build_data(config, tmp_path / "wd"), build_data_in_memory(config),
                    steps=(0, 3, 40, 41))
  assert not (tmp_path / "wd" / "data").exists()  # read from prepared_dir only


def test_prepared_from_a_streamed_tfds_catalog_equals_in_memory(tmp_path, monkeypatch):
  from cem_jax.data import tfds_catalog

  monkeypatch.setattr(tfds_catalog, "PROBE_ADDRESS", ("127.0.0.1", closed_port()))
  name = fake_catalog(tmp_path / "tfds", [_text(300, "t"), _text(200, "u")], [_text(80, "v")])
  config = _config(tfds_name=name, tfds_data_dir=os.fspath(tmp_path / "tfds"), vocab_size=300)
  _assert_same_data(build_data(config, tmp_path / "wd"), build_data_in_memory(config))
  # Prepared from 'train': a config asking for another split (or feature) of the catalog is
  # other data, not silently served this one.
  out = shard_writer.prepare(config.data, tmp_path / "p")
  for key, value in (("tfds_train_split", "train[:25%]"), ("tfds_eval_split", "train"),
                     ("tfds_text_key", "body")):
    with pytest.raises(ValueError, match=rf"^data\.{key}='{re.escape(value)}' does not fit "
                                         r"data\.prepared_dir=.*, prepared with '"):
      build_data(_config(tfds_name=name, prepared_dir=os.fspath(out), vocab_size=300,
                         **{key: value}), tmp_path / "wd2")


# ---- held-out split ---------------------------------------------------------------------------


def test_interleave_split_holds_out_every_kth_chunk():
  docs = [_text(400, "a"), _text(900, "b"), _text(50, "c")]
  train, validation = text_lib.interleave_split(docs, 0.2)
  assert (train, validation) == text_lib.interleave_split(list(docs), 0.2)
  total = sum(map(len, docs))
  size = min(text_lib.HOLDOUT_CHUNK_CHARS, -(-total // 20))
  chunks = [c for d in docs for c in text_lib.cut_at_breaks(d, size)]
  assert validation == chunks[4::5]
  # Training keeps each document's consecutive chunks together, in order.
  assert "".join(train) == "".join(c for i, c in enumerate(chunks) if i % 5 != 4)
  assert all(len({line[0] for line in t.splitlines()}) == 1 for t in train)  # one document
  assert len(train) > len(docs)  # held-out chunks cut documents
  frac = sum(map(len, validation)) / total
  assert 0.17 < frac < 0.23
  # Held-out text comes from the whole corpus, not its tail.
  assert any("aline" in v for v in validation) and any("bline" in v for v in validation)
  with pytest.raises(ValueError, match=r"^data\.validation_fraction=0\.6; allowed: a finite "
                                       r"number, 0 < value <= 0\.5$"):
    text_lib.interleave_split(docs, 0.6)
  with pytest.raises(ValueError, match="empty validation split"):
    text_lib.interleave_split(["x"], 0.1)


# chunk size 1, ~2.5K, 16K (the cap); characters, not bytes (a BOM, CRLF, 2-byte characters)
@pytest.mark.parametrize("lines", [3, 400, 9000])
def test_interleave_split_files_reads_one_file_at_a_time(tmp_path, monkeypatch, lines):
  crlf = "\ufeff" + _text(lines // 2 + 1, "\u03b2" * 30).replace("\n", "\r\n")
  texts = [_text(lines, "a"), "", crlf, _text(lines, "c")]
  paths = []
  for i, t in enumerate(texts):
    paths.append(tmp_path / f"f{i}.txt")
    paths[-1].write_bytes(t.encode("utf-8"))
  want = text_lib.interleave_split(read_documents(paths), 0.1)
  reads = []
  read_text = text_lib.read_text
  monkeypatch.setattr(text_lib, "read_text",
                      lambda path, *a: reads.append(Path(path).name) or read_text(path, *a))
  train, validation = text_lib.interleave_split_files(paths, 0.1)
  assert reads == [p.name for p in paths]  # counted once, before any pass
  assert train.corpus_characters == validation.corpus_characters == sum(
      map(len, read_documents(paths)))
  reads.clear()
  next(iter(train))
  assert reads == ["f0.txt"]  # a pass holds one file, not the corpus
  for _ in range(2):  # re-iterable: every pass reads every file again, nothing is kept
    reads.clear()
    assert (list(train), list(validation)) == want
    assert reads == [p.name for p in paths] * 2


def test_chunks_cut_from_a_stream_of_texts_equal_those_of_the_whole_text():
  rng = np.random.default_rng(1)
  for _ in range(300):
    text = "".join(rng.choice(["ab", "c ", "\n", "\n\n", "xyz"], rng.integers(0, 60)))
    cuts = np.sort(rng.integers(0, len(text) + 1, rng.integers(0, 6)))
    texts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for size in (1, 2, 3, 5, 8):
      assert list(text_lib._cut_stream(texts, size)) == text_lib.cut_at_breaks(text, size)


def _cut_by_the_rule(doc, size):
  # cut_at_breaks written from its docstring, a character at a time: a window of `size`
  # characters ends after its last paragraph break whose second newline is not the window's
  # last character, else after its last newline, else at `size`; the final window is kept whole.
  pieces, start = [], 0
  while start < len(doc):
    end = start + size
    if end < len(doc):
      paragraph = [p for p in range(start + 2, end) if doc[p - 2:p] == "\n\n"]
      line = [p for p in range(start + 1, end + 1) if doc[p - 1] == "\n"]
      end = max(paragraph) if paragraph else max(line) if line else end
    else:
      end = len(doc)
    pieces.append(doc[start:end])
    start = end
  return pieces


def test_cut_at_breaks_follows_its_rule_with_breaks_at_every_place_in_a_window():
  rng = np.random.default_rng(2)
  # By hand: a paragraph break at the window's start is a cut; an earlier paragraph break
  # wins over a later newline; no break in the window cuts at `size`.
  assert text_lib.cut_at_breaks("\n\nabc\nxy", 6) == ["\n\n", "abc\nxy"]
  assert text_lib.cut_at_breaks("a\n\nb\ncdefgh", 6) == ["a\n\n", "b\n", "cdefgh"]
  assert text_lib.cut_at_breaks("ab\n\n\ncdefgh", 6) == ["ab\n\n\n", "cdefgh"]
  assert text_lib.cut_at_breaks("abcdefgh", 3) == ["abc", "def", "gh"]
  assert text_lib.cut_at_breaks("", 4) == []
  for _ in range(400):
    doc = "".join(rng.choice(["a", "bc", "\n", "\n\n", "\n\n\n"], rng.integers(0, 40)))
    for size in (1, 2, 3, 4, 7):
      pieces = text_lib.cut_at_breaks(doc, size)
      assert pieces == _cut_by_the_rule(doc, size), (doc, size)
      assert "".join(pieces) == doc and all(0 < len(p) <= size for p in pieces)


def test_a_shard_closes_once_its_pieces_reach_shard_chars(monkeypatch):
  from cem_jax.data import packing

  monkeypatch.setattr(packing, "ENCODE_PIECE_CHARS", 3)
  docs = ["abc", "de", "fg", "", "h\nijkl", "m"]
  tasks = list(shard_writer._shard_tasks(docs, "train", 3))
  # "abc" reaches 3 alone; "de" + "fg" passes it; the empty document is one empty piece;
  # "h\nijkl" is encoded as "h\n", "ijk", "l" (cut at its newline, then at 3).
  want = [(["abc"], [True]), (["de", "fg"], [True, True]), (["", "h\n", "ijk"],
          [True, False, False]), (["l", "m"], [True, True])]
  assert [(t["pieces"], t["ends"]) for t in tasks] == want
  assert [t["index"] for t in tasks] == [0, 1, 2, 3]
  assert {t["split"] for t in tasks} == {"train"}


def test_a_corpus_of_one_large_file_is_split_a_block_at_a_time(tmp_path, monkeypatch):
  import tracemalloc

  # 4 MB in one file, with CRLFs and 2-byte characters cut by the 64 KiB blocks.
  text = _text(25_000, "\u03b2").replace("\n", "\r\n") + _text(25_000, "a")
  path = tmp_path / "one.txt"
  path.write_bytes(codecs.BOM_UTF8 + text.encode("utf-8"))
  want = text_lib.interleave_split([text.replace("\r\n", "\n")], 0.1)
  monkeypatch.setattr(text_lib, "READ_BLOCK_BYTES", 1 << 16)
  train, validation = text_lib.interleave_split_files([path], 0.1)
  tracemalloc.start()
  try:
    got = [sum(map(len, split)) for split in (train, validation)]  # one pass each, nothing kept
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert got == [sum(map(len, split)) for split in want]
  # A block, a training document (9 chunks of 16K characters) and its copies: 1.1 MB. The
  # file alone is 4.2 MB, its text 5.6 MB as a str.
  assert peak < 2_000_000, peak
  assert (list(train), list(validation)) == want


def test_a_file_changed_between_passes_is_an_error_not_a_mix(tmp_path):
  # Read ~7 times by a prepare: edited in between, the tokenizer would be of one text and the
  # shards of another, and held-out text could move into the training split.
  paths = [tmp_path / "a.txt", tmp_path / "b.txt"]
  paths[0].write_text(_text(300, "a"))
  paths[1].write_text(_text(300, "b"))
  sha = [files.sha256_file(p) for p in paths]
  train, validation = text_lib.interleave_split_files(paths, 0.1, sha)
  assert list(train) and list(validation)
  before = paths[1].stat().st_mtime_ns
  paths[1].write_text(_text(300, "b") + "one more line\n")
  os.utime(paths[1], ns=(before + 10**9, before + 10**9))  # a coarse clock still moves
  changed = (rf"^data\.files: {re.escape(str(paths[1]))} changed while its text was being "
             r"read; run again once the files are final$")
  with pytest.raises(ValueError, match=changed):
    list(validation)
  with pytest.raises(ValueError, match=changed):  # no longer the text that was identified
    text_lib.interleave_split_files(paths, 0.1, sha)


def test_interleave_split_files_fails_as_the_split_of_the_text(tmp_path):
  def files(*texts):
    paths = [tmp_path / f"g{i}.txt" for i in range(len(texts))]
    for p, t in zip(paths, texts, strict=True):
      p.write_bytes(t)
    return paths

  with pytest.raises(ValueError, match=r"^data\.validation_fraction=0\.6; allowed: a finite "
                                       r"number, 0 < value <= 0\.5$"):
    text_lib.interleave_split_files([tmp_path / "missing.txt"], 0.6)  # before any read
  with pytest.raises(ValueError, match=r"g1\.txt: not UTF-8 text: byte 0xff at byte offset 2"):
    text_lib.interleave_split_files(files(b"ok", b"ab\xff"), 0.1)
  with pytest.raises(ValueError, match=r"the corpus is empty"):
    text_lib.interleave_split_files(files(b"", b" \n"), 0.1)
  for text in (b"x", b"abcdefghi", b"abcdefghij"):  # 10 characters: chunk 9 is held out
    paths = files(text)
    try:
      want = text_lib.interleave_split(read_documents(paths), 0.1)
    except ValueError as e:
      with pytest.raises(ValueError, match=f"^{re.escape(str(e))}$"):
        text_lib.interleave_split_files(paths, 0.1)
    else:
      assert [list(s) for s in text_lib.interleave_split_files(paths, 0.1)] == list(want)


@needs_shared
def test_war_and_peace_held_out_text_is_not_its_tail():
  (doc,) = read_documents([SHARED_DATA / "warpeace.txt"])
  train, validation = text_lib.interleave_split([doc], 0.1)
  assert 0.08 < sum(map(len, validation)) / len(doc) < 0.12
  assert len(validation) >= 15
  tail = doc[int(0.9 * len(doc)):]
  assert sum(len(v) for v in validation if v in tail) < 0.2 * sum(map(len, validation))


# ---- exact bytes with unknown pieces (issue 14 item 9) ------------------------------------------


def test_bits_per_byte_denominator_counts_the_text_with_an_unk_tokenizer(tmp_path):
  train_text = _text(400)
  model = tmp_path / "unk.model"
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(train_text.splitlines(keepends=True)), model_prefix=os.fspath(
          tmp_path / "unk"), vocab_size=80, model_type="bpe", character_coverage=1.0,
      byte_fallback=False, minloglevel=2, num_threads=1)
  corpus = tmp_path / "c.txt"
  # Characters the tokenizer never saw: each becomes <unk>, worth 1-4 bytes of text.
  corpus.write_text("".join(f"{line} caf\u00e9 \u30ce\u30ce \U0001f600!\n"
                            for line in _text(300).splitlines()))
  config = _config(files=os.fspath(corpus), tokenizer=os.fspath(model), vocab_size=80)
  data = build_data(config, tmp_path / "wd")
  tok = data.tokenizer
  (doc,) = read_documents([corpus])
  _, validation = text_lib.interleave_split([doc], 0.1)
  true_bytes = sum(len(v.encode()) for v in validation)
  assert data.eval_bytes == true_bytes
  rows = data.eval.windows.rows(np.arange(data.eval_windows))
  assert int(rows["nbytes"].sum()) == true_bytes
  ids = rows["tokens"][rows["segment_ids"] > 0]
  assert (ids == tok._sp.unk_id()).sum() > 100
  piece_bytes = int(tok.token_bytes[ids].sum())
  assert piece_bytes < true_bytes  # what the old denominator counted
  # Every unknown piece carries the bytes of the characters it replaced.
  ids, nbytes = tok.encode_with_bytes("ab \u30ce\u30ce\U0001f600 caf\u00e9\n")
  assert int(nbytes.sum()) == len("ab \u30ce\u30ce\U0001f600 caf\u00e9\n".encode())
  assert 10 in nbytes[ids == tok._sp.unk_id()]  # '\u30ce\u30ce\U0001f600': one <unk>, 10 bytes


# ---- interrupted, repeated and damaged preparations ---------------------------------------------


def _shard_sums(out: Path) -> dict[str, str]:
  return {p.name: files.sha256_file(p) for p in sorted(out.glob("*.array_record"))}


_KILLED_AFTER_FIRST_SHARD = """
import os, signal, sys
sys.path.insert(0, "tests")
from cem_jax.data import shard_writer
from test_prepared import _config
original = shard_writer._encode_and_write
def write_then_die(job):
  meta = original(job)
  os.kill(os.getpid(), signal.SIGKILL)
shard_writer._encode_and_write = write_then_die
shard_writer.prepare(_config(files=sys.argv[1], vocab_size=300).data, sys.argv[2],
                     shard_chars=20_000, workers=1)
"""


def test_killed_prepare_then_rerun_equals_an_uninterrupted_one(tmp_path):
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(3000, "a") + "\n\n" + _text(2000, "b"))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  killed = subprocess.run(
      [sys.executable, "-c", _KILLED_AFTER_FIRST_SHARD, os.fspath(corpus),
       os.fspath(tmp_path / "a")], cwd=REPO, env={**os.environ, "PYTHONPATH": os.fspath(REPO)},
      capture_output=True, text=True, timeout=300)
  assert killed.returncode == -9, killed.stderr[-2000:]
  assert list((tmp_path / "a").glob("*.array_record")) and not (tmp_path / "a" /
                                                                  "manifest.json").exists()
  first = _shard_sums(tmp_path / "a")
  assert len(first) == 1
  kept = {p: p.stat().st_mtime_ns for p in (tmp_path / "a").glob("train-00000.*")}
  with pytest.raises(ValueError, match=r"no manifest\.json.*prepare did not finish"):
    prepared.PreparedData.open(tmp_path / "a")
  # What writes killed before their rename leave (a shard, its sidecar; an older cem_jax's).
  for name in ("train-00001.array_record.4321.0123456789ab.tmp",
               "train-00001.json.4321.abcdef012345.tmp", "train-00002.array_record.tmp4321"):
    (tmp_path / "a" / name).write_bytes(b"half")
  shard_writer.prepare(config.data, tmp_path / "a", shard_chars=20_000)
  shard_writer.prepare(config.data, tmp_path / "b", shard_chars=20_000)
  assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(
      p.name for p in (tmp_path / "b").iterdir())
  sums = _shard_sums(tmp_path / "a")
  assert len(sums) >= 3 and sums == _shard_sums(tmp_path / "b")
  assert {k: sums[k] for k in first} == first
  assert {p: p.stat().st_mtime_ns for p in kept} == kept  # the finished shard was not redone
  manifest_a = json.loads((tmp_path / "a" / "manifest.json").read_text())
  assert manifest_a == json.loads((tmp_path / "b" / "manifest.json").read_text())
  # Complete: running again is a no-op.
  mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "a").iterdir()}
  shard_writer.prepare(config.data, tmp_path / "a", shard_chars=20_000)
  assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a").iterdir()} == mtimes
  # Another config into the same folder is refused.
  with pytest.raises(ValueError, match=r"--out=.* holds another dataset"):
    shard_writer.prepare(_config(files=os.fspath(corpus), vocab_size=320).data, tmp_path / "a")


def test_a_prepare_failing_after_its_first_shard_keeps_its_work_for_the_rerun(tmp_path,
                                                                              monkeypatch):
  # A full disk at the third shard: an error, not a kill. The finished shards, the trained
  # tokenizer and prepare.json stay, so the re-run (the disk freed) finishes the job instead of
  # refusing a folder that "holds no prepared dataset".
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(2000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  real, written = shard_writer._encode_and_write, []

  def disk_full_at_the_third_shard(job):
    if len(written) == 2:
      raise OSError(28, "No space left on device")
    meta = real(job)
    written.append(meta["file"])
    return meta

  monkeypatch.setattr(shard_writer, "_encode_and_write", disk_full_at_the_third_shard)
  with pytest.raises(OSError, match="No space left"):
    shard_writer.prepare(config.data, tmp_path / "a", shard_chars=20_000)
  monkeypatch.setattr(shard_writer, "_encode_and_write", real)
  assert written == ["train-00000.array_record", "train-00001.array_record"]
  kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").iterdir()}
  assert {"prepare.json", "tokenizer.model", *written} <= set(kept)
  shard_writer.prepare(config.data, tmp_path / "a", shard_chars=20_000)
  shard_writer.prepare(config.data, tmp_path / "b", shard_chars=20_000)
  assert _shard_sums(tmp_path / "a") == _shard_sums(tmp_path / "b")
  assert {n: (tmp_path / "a" / n).stat().st_mtime_ns for n in written} == {
      n: kept[n] for n in written}  # the finished shards were not redone
  prepared.PreparedData.open(tmp_path / "a")


def test_a_shard_arrayrecord_cannot_write_is_one_line_naming_the_shard(tmp_path, monkeypatch):
  # On a full disk (a 600 KiB tmpfs) ArrayRecord's writer raises a RuntimeError at close():
  # it went through the pool as a traceback out of prepare and training alike. Now an OSError
  # naming the shard (main and prepare print an OSError as one line); no temporary file left.
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(300))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  real = shard_writer.array_record_module.ArrayRecordWriter

  class FullDisk:
    def __init__(self, path, options):
      self._writer = real(path, options)
      self._path = path

    def write(self, record):
      self._writer.write(record)

    def close(self):
      self._writer.close()
      raise RuntimeError(f"write() failed: No space left on device; writing {self._path}; at "
                         "byte 593920; Failed to close chunk_writer")

  monkeypatch.setattr(shard_writer.array_record_module, "ArrayRecordWriter", FullDisk)
  out = tmp_path / "p"
  with pytest.raises(OSError) as raised:
    shard_writer.prepare(config.data, out, workers=1)
  message = str(raised.value)
  assert message.startswith(f"{out / 'train-00000.array_record'}: cannot be written (write() "
                            "failed: No space left on device; writing "), message
  assert "\n" not in message
  assert not out.exists()  # its first shard failed: nothing of it to keep


def test_a_shard_sidecar_hash_tells_apart_other_pieces_and_other_document_ends():
  # A re-run keeps a shard whose sidecar has its task's hash: the same characters cut into
  # other pieces, or with documents ending elsewhere (EOS), are other tokens.
  def task_hash(pieces, ends):
    return shard_writer._task_hash({"pieces": pieces, "ends": ends})

  base = task_hash(["ab", "c"], [False, True])
  assert task_hash(["ab", "c"], [False, True]) == base
  others = [task_hash(["a", "bc"], [False, True]), task_hash(["ab", "c"], [True, True]),
            task_hash(["abc"], [True]), task_hash(["a", "b"], [False, False]),
            task_hash(["a\x00b"], [False])]  # a NUL in the text is no piece boundary
  assert len({base, *others}) == 6


def test_a_rerun_with_another_shard_size_writes_what_a_fresh_prepare_does(tmp_path):
  # Killed before its manifest, then run with another shard_chars (the same fingerprint): the
  # shards of the same index hold other text, so none may be kept.
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(1000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  shard_writer.prepare(config.data, tmp_path / "a", shard_chars=20_000)
  (tmp_path / "a" / prepared.MANIFEST).unlink()
  shard_writer.prepare(config.data, tmp_path / "a", shard_chars=10_000)
  shard_writer.prepare(config.data, tmp_path / "b", shard_chars=10_000)
  assert _shard_sums(tmp_path / "a") == _shard_sums(tmp_path / "b")
  assert json.loads((tmp_path / "a" / prepared.MANIFEST).read_text()) == json.loads(
      (tmp_path / "b" / prepared.MANIFEST).read_text())


def test_a_rerun_never_keeps_shards_encoded_by_another_tokenizer(tmp_path):
  # A tokenizer.model replaced (or damaged) in a prepared folder: the re-run must not serve the
  # old shards under it; every token decodes to the split's text with the folder's tokenizer.
  from cem_jax.data import tokenizer as tokenizer_lib

  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(1000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  out = shard_writer.prepare(config.data, tmp_path / "p", shard_chars=20_000)
  (out / "tokenizer.model").write_bytes(tokenizer_lib.train_model([_text(400, "x")], 300))
  shard_writer.prepare(config.data, out, shard_chars=20_000)
  data = prepared.PreparedData.open(out)
  train, _ = text_lib.interleave_split(read_documents([corpus]), 0.1)
  stream = data.streams["train"]
  tokens, _, _ = stream.read(np.array([0]), stream.num_tokens, 0)
  assert data.tokenizer.decode(tokens[0]) == "".join(train)


def test_a_rerun_whose_tokenizer_trains_differently_encodes_every_shard_again(tmp_path,
                                                                               monkeypatch):
  # prepare.json lost and tokenizer.model damaged: the re-run trains the tokenizer again, and a
  # SentencePiece of another version may train another one from the same text. Shards whose
  # text is unchanged were encoded by the old tokenizer: kept, they would decode to other text.
  from cem_jax.data import tokenizer as tokenizer_lib

  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(1000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  out = shard_writer.prepare(config.data, tmp_path / "p", shard_chars=20_000)
  other = tokenizer_lib.train_model([_text(400, "x")], 300)
  (out / shard_writer.PROGRESS).unlink()
  (out / "tokenizer.model").write_bytes(b"damaged")
  monkeypatch.setattr(tokenizer_lib, "train_model", lambda docs, vocab_size, model_type: other)
  shard_writer.prepare(config.data, out, shard_chars=20_000)
  data = prepared.PreparedData.open(out)
  assert (out / "tokenizer.model").read_bytes() == other
  train, _ = text_lib.interleave_split(read_documents([corpus]), 0.1)
  stream = data.streams["train"]
  tokens, _, _ = stream.read(np.array([0]), stream.num_tokens, 0)
  assert data.tokenizer.decode(tokens[0]) == "".join(train)


def _inline_pool(started=None, eager=False):
  """A stand-in for ``multiprocessing``'s pool that encodes in this process (no process
  starts): records each pool's size in ``started``; ``eager`` takes every job before the
  first result comes back, as a real pool does."""
  class Pool:
    def __init__(self, size, initializer, initargs):
      if started is not None:
        started.append(size)
      # Not the pool's initializer: it ties a worker process's life to its parent's, and here
      # the worker is this process.
      shard_writer._init_worker(initargs[0])

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      return False

    def imap(self, fn, jobs):
      return _Results(map(fn, list(jobs) if eager else jobs))

  return Pool


class _Results:
  """What a pool's ``imap`` returns, as prepare reads it: ``next(timeout)``."""

  def __init__(self, results):
    self._results = results

  def next(self, timeout=None):
    return next(self._results)


def test_a_rerun_in_workers_lists_the_shards_in_order(tmp_path, monkeypatch):
  # A pool takes every job before the first result comes back: the shards kept are collected
  # before those written again, and the manifest must still list them in order.
  monkeypatch.setattr(shard_writer.multiprocessing, "get_context",
                      lambda method: type("Context", (), {"Pool": _inline_pool(eager=True)}))
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(1000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  out = shard_writer.prepare(config.data, tmp_path / "p", shard_chars=20_000)
  want = json.loads((out / prepared.MANIFEST).read_text())
  (out / prepared.MANIFEST).unlink()
  (out / "train-00000.array_record").unlink()
  shard_writer.prepare(config.data, out, shard_chars=20_000, workers=2)
  assert json.loads((out / prepared.MANIFEST).read_text()) == want
  prepared.PreparedData.open(out)


def test_damaged_shard_is_a_one_line_error_naming_the_file(tmp_path):
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(2000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  out = shard_writer.prepare(config.data, tmp_path / "p", shard_chars=20_000)
  config.data.prepared_dir = os.fspath(out)
  build_data(config, tmp_path / "wd")
  shard = sorted(out.glob("train-*.array_record"))[1]
  data = bytearray(shard.read_bytes())
  data[len(data) // 2] ^= 0xFF
  shard.write_bytes(bytes(data))
  with pytest.raises(ValueError) as info:
    build_data(config, tmp_path / "wd")
  assert str(info.value).startswith(f"{shard}: damaged prepared data: sha256")
  assert str(info.value).endswith("; run prepare again to rebuild it")
  assert "\n" not in str(info.value)
  # A peer process verified: sizes only, so the damage shows only where the reader trips.
  with pytest.raises(ValueError, match=rf"^{out}: damaged prepared data: "):
    build_data(config, tmp_path / "wd", verify=False)
  shard.write_bytes(bytes(data[:100]))
  with pytest.raises(ValueError, match=rf"^{shard}: damaged prepared data: 100 bytes"):
    build_data(config, tmp_path / "wd")
  shard.unlink()
  with pytest.raises(ValueError, match=rf"^{shard}: damaged prepared data: cannot read"):
    build_data(config, tmp_path / "wd")
  # prepare rebuilds exactly the damaged shard.
  config.data.prepared_dir = ""
  shard_writer.prepare(config.data, out, shard_chars=20_000)
  config.data.prepared_dir = os.fspath(out)
  build_data(config, tmp_path / "wd")


def test_a_damaged_folder_that_training_prepared_names_the_folder_to_remove(tmp_path):
  # WORKDIR/data/<fingerprint> was made by build_data, not by a prepare the user ran: the
  # remedy is to remove it, so that the next start prepares it anew.
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(2000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  workdir = tmp_path / "wd"
  build_data(config, workdir)
  (folder,) = (workdir / "data").iterdir()
  shard = sorted(folder.glob("train-*.array_record"))[0]
  size = shard.stat().st_size
  shard.write_bytes(shard.read_bytes()[:100])
  with pytest.raises(prepared.BadPreparedData) as info:
    build_data(config, workdir)
  assert str(info.value) == (f"{shard}: damaged prepared data: 100 bytes, the manifest says "
                             f"{size}; remove {folder} and start again: it is prepared anew")
  shutil.rmtree(folder)
  assert build_data(config, workdir).train_tokens > 0


def _bad_tokenizer(tmp_path: Path) -> dict:
  (tmp_path / "bad.model").write_bytes(b"not a sentencepiece model")
  return {"tokenizer": os.fspath(tmp_path / "bad.model")}


@pytest.mark.parametrize("bad", [
    pytest.param(lambda p: p.write_bytes(_text(2000).encode() + b"\xff"), id="not-utf8"),
    pytest.param(lambda p: p.write_bytes(b""), id="empty"),
    pytest.param(lambda p: p.write_bytes(b" \n\t\n\n  "), id="whitespace"),
    pytest.param("tokenizer", id="bad-tokenizer"),
])
@pytest.mark.parametrize("folder", ["new", "empty"])
def test_a_failed_prepare_leaves_nothing_that_blocks_the_rerun(bad, folder, tmp_path):
  corpus, out = tmp_path / "c.txt", tmp_path / "out"
  corpus.write_text(_text(2000))
  if folder == "empty":
    out.mkdir()
  extra = {}
  if bad == "tokenizer":
    extra = _bad_tokenizer(tmp_path)
  else:
    bad(corpus)
  with pytest.raises(ValueError):
    shard_writer.prepare(_config(files=os.fspath(corpus), vocab_size=300, **extra).data, out)
  # Nothing left: the folder is gone if the prepare made it, else empty again.
  assert (list(out.iterdir()) == []) if folder == "empty" else not out.exists()
  corpus.write_text(_text(2000))  # the input fixed
  shard_writer.prepare(_config(files=os.fspath(corpus), vocab_size=300).data, out)
  prepared.PreparedData.open(out)


def test_a_prepare_killed_before_its_first_shard_gives_way_to_other_input(tmp_path):
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(2000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  reference = shard_writer.prepare(config.data, tmp_path / "ref")
  # What a prepare of other text killed after training its tokenizer leaves: its prepare.json,
  # its tokenizer (that must not be reused) and the temporary file of its first shard.
  out = tmp_path / "out"
  out.mkdir()
  (out / "prepare.json").write_text(json.dumps({"fingerprint": "0123456789abcdef",
                                                "format_version": 1}))
  (out / "tokenizer.model").write_bytes(b"the tokenizer of other text")
  (out / "train-00000.array_record.4321.0123456789ab.tmp").write_bytes(b"half a shard")
  (out / "train-00001.array_record.tmp1234").write_bytes(b"half a shard (older cem_jax)")
  # And the temporary files of its atomic writes killed before the rename; a file that only
  # looks like one is not ours: it stays.
  (out / "prepare.json.4321.0123456789ab.tmp").write_text("{")
  (out / "tokenizer.model.4321.abcdef012345.tmp").write_bytes(b"half a tokenizer")
  (out / "tokenizer.model.backup.tmp").write_bytes(b"someone's copy")
  shard_writer.prepare(config.data, out)
  assert sorted(p.name for p in out.iterdir()) == sorted(
      [p.name for p in reference.iterdir()] + ["tokenizer.model.backup.tmp"])
  assert _shard_sums(out) == _shard_sums(reference)
  # With a finished shard, it holds another dataset: refused, as before.
  other = _config(files=os.fspath(corpus), vocab_size=320)
  with pytest.raises(ValueError, match=r"^--out=.* holds another dataset"):
    shard_writer.prepare(other.data, out)


def test_out_that_is_a_file_is_a_one_line_error_naming_the_flag(tmp_path):
  corpus, afile = tmp_path / "c.txt", tmp_path / "afile"
  corpus.write_text(_text(200))
  afile.write_text("x")
  config = _config(files=os.fspath(corpus), vocab_size=300)
  with pytest.raises(ValueError, match=rf"^--out={afile} is a file; "):
    shard_writer.prepare(config.data, afile)
  with pytest.raises(ValueError, match=rf"^--out={afile / 'sub'}: cannot create the folder"):
    shard_writer.prepare(config.data, afile / "sub")
  assert afile.read_text() == "x"


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_out_that_cannot_be_written_in_is_a_one_line_error_naming_the_flag(tmp_path, monkeypatch,
                                                                           code):
  # A read-only folder (which root's permissions cannot make: a read-only mount, here its
  # errors) or a full disk at the first write: was OSError's line naming a temporary file.
  corpus, kept, new = tmp_path / "c.txt", tmp_path / "kept", tmp_path / "new"
  corpus.write_text(_text(200))
  kept.mkdir()
  config = _config(files=os.fspath(corpus), vocab_size=300)

  def cannot_write(path, *args, **kwargs):
    raise OSError(code, os.strerror(code), f"{path}.123.abc.tmp")

  monkeypatch.setattr(shard_writer, "atomic_write_json", cannot_write)
  for out in (kept, new):
    with pytest.raises(ValueError) as e:
      shard_writer.prepare(config.data, out)
    assert str(e.value) == (f"--out={out}: cannot write in the folder ({os.strerror(code)}); "
                            "choose a folder you can write in")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "kept"]  # new: removed again
  assert not any(kept.iterdir())


def test_out_holding_other_files_is_refused_and_left_as_it_was(tmp_path):
  # A folder of the user's own (no manifest, no prepare.json, no shard): nothing is written
  # into it or removed from it.
  corpus, out = tmp_path / "c.txt", tmp_path / "mine"
  corpus.write_text(_text(200))
  out.mkdir()
  (out / "notes.txt").write_text("keep")
  config = _config(files=os.fspath(corpus), vocab_size=300)
  with pytest.raises(ValueError, match=rf"^--out={out} is not empty and holds no prepared "
                                       r"dataset; choose an empty or new folder$"):
    shard_writer.prepare(config.data, out)
  assert [p.name for p in out.iterdir()] == ["notes.txt"]
  assert (out / "notes.txt").read_text() == "keep"
  with pytest.raises(ValueError, match=r"^data\.files=' , ' names no file glob$"):
    text_lib.resolve_files(" , ")


def _fingerprint(config) -> str:
  return shard_writer.fingerprint(config.data,
                                  shard_writer.sources.source_identity(config.data))


@contextlib.contextmanager
def _locked(folder: Path):
  """``folder`` flock'ed as another process's prepare holds it (flock locks of two opens
  exclude each other in one process too)."""
  import fcntl  # POSIX only

  fd = os.open(folder, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    yield
  finally:
    os.close(fd)


@pytest.mark.skipif(os.name != "posix", reason="flock is POSIX")
def test_a_second_prepare_in_a_folder_being_prepared_is_refused(tmp_path, monkeypatch):
  # Two prepares of other configs in one folder each wrote over the other's shards and both
  # reported their own dataset: the second one started while the first is at work is refused.
  a, b = tmp_path / "a.txt", tmp_path / "b.txt"
  a.write_text(_text(2000, "a"))
  b.write_text(_text(2000, "b"))
  config_a = _config(files=os.fspath(a), vocab_size=300)
  config_b = _config(files=os.fspath(b), vocab_size=300)
  out = tmp_path / "p"
  in_use = (rf"^--out={re.escape(os.fspath(out))} is in use: another process is preparing data "
            r"in it \(a second prepare, or a main preparing its data\); wait for it to end and "
            r"run again \(with the same config and text the run again has nothing left to do\)$")
  original, refused = shard_writer._prepare, []

  def second_prepare_meanwhile(*args):
    if not refused:  # once: let through, the second prepare would come back here
      refused.append("tried")
      with pytest.raises(ValueError, match=in_use):
        shard_writer.prepare(config_b.data, out)
    return original(*args)

  monkeypatch.setattr(shard_writer, "_prepare", second_prepare_meanwhile)
  shard_writer.prepare(config_a.data, out)
  monkeypatch.undo()
  assert len(refused) == 1
  assert prepared.PreparedData.open(out).manifest["fingerprint"] == _fingerprint(config_a)
  # Held before anything is read or written: a folder held by another process is left as it is.
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  with _locked(fresh), pytest.raises(ValueError, match=in_use.replace(
      re.escape(os.fspath(out)), re.escape(os.fspath(fresh)))):
    shard_writer.prepare(config_b.data, fresh)
  assert not any(fresh.iterdir())
  # Opened just before the prepare holding it failed and removed the folder it made: the lock
  # then taken is on a folder that is gone.
  gone, real_open = tmp_path / "gone", os.open

  def open_then_removed(path, *args, **kwargs):
    fd = real_open(path, *args, **kwargs)
    if Path(path) == gone:
      os.rmdir(gone)
    return fd

  monkeypatch.setattr(os, "open", open_then_removed)
  with pytest.raises(ValueError, match=in_use.replace(re.escape(os.fspath(out)),
                                                      re.escape(os.fspath(gone)))):
    shard_writer.prepare(config_b.data, gone)
  monkeypatch.undo()
  assert not gone.exists()
  # main's own folder, WORKDIR/data/<fingerprint>, is named without prepare's flag.
  folder = tmp_path / "wd" / "data" / _fingerprint(config_b)
  folder.mkdir(parents=True)
  with _locked(folder), pytest.raises(ValueError, match=rf"^{re.escape(os.fspath(folder))} is "
                                                       r"in use: another process"):
    build_data(config_b, tmp_path / "wd")
  # A run reading it as data.prepared_dir meanwhile is told to wait, not to prepare again.
  with _locked(fresh), pytest.raises(ValueError, match=(
      rf"^data.prepared_dir={re.escape(os.fspath(fresh))}: no manifest.json yet: another "
      r"process is preparing it; wait for it to end$")):
    build_data(_config(prepared_dir=os.fspath(fresh), vocab_size=300), tmp_path / "wd2")
  with pytest.raises(ValueError, match=r"no manifest.json \(not a prepared dataset"):
    build_data(_config(prepared_dir=os.fspath(fresh), vocab_size=300), tmp_path / "wd2")
  # A folder that is not there (a typo) says so, not that a file in it is missing.
  for missing, what in ((tmp_path / "nope", "does not exist"), (tmp_path / "f", "is not a folder")):
    if what == "is not a folder":
      missing.write_text("x")
    with pytest.raises(ValueError, match=rf"^data.prepared_dir={re.escape(os.fspath(missing))} "
                                         rf"{what}; allowed: a folder python -m cem_jax.prepare"):
      build_data(_config(prepared_dir=os.fspath(missing), vocab_size=300), tmp_path / "wd2")
  # Released, the same folders prepare as usual.
  assert shard_writer.prepare(config_b.data, fresh) == fresh
  assert build_data(config_b, tmp_path / "wd").train_tokens > 0


_SLOW_SHARD = """
import os, pathlib, signal, time
def write(job):
  ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  mine = pathlib.Path({pids!r}, str(os.getpid()))
  mine.with_name("." + mine.name).write_text(str(ignored))
  os.replace(mine.with_name("." + mine.name), mine)  # listed whole or not at all
  time.sleep(60)
  mine.with_name("slept-" + mine.name).write_text("")  # lived through its shard: not stopped
"""

_PREPARE_WITH_SLOW_WORKERS = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
sys.path[:0] = ["tests", sys.argv[3]]
import slow_shard
from cem_jax.data import shard_writer
from test_prepared import _config
shard_writer._encode_and_write = slow_shard.write
shard_writer.prepare(_config(files=sys.argv[1], vocab_size=300).data, sys.argv[2],
                     shard_chars=20_000, workers=2)
"""


def _alive(pid: int) -> bool:
  try:
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return False
  return state not in ("Z", "X")  # a zombie is dead, only not reaped by its new parent


def _all_dead_within(seconds: float, pids: list[int]) -> bool:
  deadline = time.monotonic() + seconds
  while any(map(_alive, pids)) and time.monotonic() < deadline:
    time.sleep(0.1)
  return not any(map(_alive, pids))


def _stopped_in_their_shard(pids_dir: Path, workers: list[int]) -> bool:
  """Whether each ``_SLOW_SHARD`` worker is dead (waited for up to 120 s: a loaded machine
  is slow) without having lived through its 60 s shard: ended by the one who stopped it, not
  a slow deadline's guess."""
  return (_all_dead_within(120, workers)
          and not any((pids_dir / f"slept-{pid}").exists() for pid in workers))


def _slow_shards(tmp_path):
  """``(corpus, pids)``: a text of several shards, and the folder where each worker of
  ``_PREPARE_WITH_SLOW_WORKERS`` (``slow_shard.py``, written here) lists its pid."""
  corpus, pids = tmp_path / "c.txt", tmp_path / "pids"
  corpus.write_text(_text(3000))
  pids.mkdir()
  (tmp_path / "slow_shard.py").write_text(_SLOW_SHARD.format(pids=os.fspath(pids)))
  return corpus, pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_kill_9_of_prepare_ends_its_workers(tmp_path):
  # Workers that outlived a killed prepare went on writing shards into the folder, whose lock
  # died with it. Here each worker sleeps in its first shard: alive 60 s unless it dies with
  # its parent.
  corpus, pids = _slow_shards(tmp_path)
  proc = subprocess.Popen(
      [sys.executable, "-c", _PREPARE_WITH_SLOW_WORKERS, os.fspath(corpus),
       os.fspath(tmp_path / "p"), os.fspath(tmp_path)], cwd=REPO,
      env={**os.environ, "PYTHONPATH": os.fspath(REPO)}, stderr=subprocess.PIPE)
  workers = []
  try:
    deadline = time.monotonic() + 120
    while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
      time.sleep(0.1)
      workers = [int(p.name) for p in pids.iterdir() if p.name.isdigit()]
    assert len(workers) == 2, proc.stderr.read().decode()[-2000:] if proc.poll() else workers
    assert all(map(_alive, workers))
    # A terminal's Ctrl-C reaches the whole process group: the workers leave it to the parent
    # (each printed a KeyboardInterrupt traceback).
    assert [(pids / str(pid)).read_text() for pid in workers] == ["True", "True"]
    proc.kill()
    proc.wait()
    assert _stopped_in_their_shard(pids, workers)
  finally:
    proc.kill()
    proc.wait()
    for pid in workers:
      with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


# The Ctrl-C the kernel gives one of the pool's threads, not the main thread (pthread_kill here).
_CTRL_C_TO_ANOTHER_THREAD = """
import os, signal, threading, time
from pathlib import Path
def send():
  while len([p for p in Path(os.environ["PIDS"]).iterdir() if p.name.isdigit()]) < 2:
    time.sleep(0.1)
  signal.pthread_kill(threading.get_ident(), signal.SIGINT)
threading.Thread(target=send, daemon=True).start()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_ctrl_c_another_thread_gets_stops_prepare_at_once(tmp_path):
  # prepare waited for the pool's next shard in a blocking next(): a Ctrl-C the kernel gave
  # another thread woke it only when the shard being encoded was written (60 s here: a worker
  # then lives through its shard; fails so with the blocking wait back). No clock is read.
  corpus, pids = _slow_shards(tmp_path)
  script = _PREPARE_WITH_SLOW_WORKERS.replace(
      "import slow_shard\n", "import slow_shard\n" + _CTRL_C_TO_ANOTHER_THREAD)
  assert script != _PREPARE_WITH_SLOW_WORKERS
  proc = subprocess.run(
      [sys.executable, "-c", script, os.fspath(corpus), os.fspath(tmp_path / "p"),
       os.fspath(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300,
      env={**os.environ, "PYTHONPATH": os.fspath(REPO), "PIDS": os.fspath(pids)})
  assert "KeyboardInterrupt" in proc.stderr, proc.stderr[-2000:]
  assert proc.returncode != 0
  workers = [int(p.name) for p in pids.iterdir() if p.name.isdigit()]
  assert len(workers) == 2 and _stopped_in_their_shard(pids, workers), proc.stderr[-2000:]


def test_workdir_folder_of_another_fingerprint_is_refused(tmp_path):
  # WORKDIR/data/<fingerprint> copied (or moved) there by hand holds another text: trained
  # from, it would pass for the text data.files names.
  a, b = tmp_path / "a.txt", tmp_path / "b.txt"
  a.write_text(_text(2000, "a"))
  b.write_text(_text(2000, "b"))
  config_a = _config(files=os.fspath(a), vocab_size=300)
  config_b = _config(files=os.fspath(b), vocab_size=300)
  fp_a, fp_b = _fingerprint(config_a), _fingerprint(config_b)
  assert fp_a != fp_b
  build_data(config_a, tmp_path / "wd")
  folder = tmp_path / "wd" / "data" / fp_b
  shutil.copytree(tmp_path / "wd" / "data" / fp_a, folder)
  with pytest.raises(ValueError) as info:
    build_data(config_b, tmp_path / "wd")
  assert str(info.value) == (f"{folder} holds another dataset (fingerprint {fp_a}, this config "
                             f"and text: {fp_b}): it was not prepared here; remove it and start "
                             "again: it is prepared anew")
  shutil.rmtree(folder)
  data = build_data(config_b, tmp_path / "wd")
  assert "bline" in data.tokenizer.decode(data.train.batch(0)["inputs"].ravel())
  # A manifest with no fingerprint, or not a string, is damaged, not another dataset: named
  # as such by PreparedData.open, not as "another dataset (fingerprint None)".
  manifest = folder / prepared.MANIFEST
  saved = json.loads(manifest.read_text())
  for value, what in ((None, "fingerprint is missing"), (7, "fingerprint is 7, not a string")):
    manifest.write_text(json.dumps({k: v for k, v in saved.items() if k != "fingerprint"}
                                   | ({} if value is None else {"fingerprint": value})))
    with pytest.raises(prepared.BadPreparedData) as info:
      build_data(config_b, tmp_path / "wd")
    assert str(info.value) == (f"{manifest}: damaged manifest: {what}; remove {folder} and "
                               "start again: it is prepared anew")


def test_workdir_folder_holding_other_files_names_the_folder_not_a_flag(tmp_path):
  # main has no --out: its own folder is named as it is, and the fix is to remove it.
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(200))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  folder = tmp_path / "wd" / "data" / _fingerprint(config)
  folder.mkdir(parents=True)
  (folder / "notes.txt").write_text("x")
  with pytest.raises(ValueError) as info:
    build_data(config, tmp_path / "wd")
  assert str(info.value) == (f"{folder} is not empty and holds no prepared dataset; remove it "
                             "and start again: it is prepared anew")


@pytest.fixture(scope="module")
def prepared_300(tmp_path_factory) -> Path:
  root = tmp_path_factory.mktemp("prepared_300")
  (root / "c.txt").write_text(_text(2000))
  return shard_writer.prepare(_config(files=os.fspath(root / "c.txt"), vocab_size=300).data,
                          root / "p", shard_chars=20_000)


def _edit_shard(split: str, i: int, tokens: int, records: int = 0):
  def edit(m):
    m["splits"][split]["shards"][i]["tokens"] += tokens
    m["splits"][split]["shards"][i]["records"] += records
    m["splits"][split]["tokens"] += tokens
    return m
  return edit


def test_the_fingerprint_follows_everything_that_decides_the_tokens(prepared_300, monkeypatch):
  # Another trainer setting, training sample or encode cut gives other tokens: a folder
  # prepared before must not be reused for them.
  from cem_jax.data import packing
  from cem_jax.data import tokenizer as tokenizer_lib

  config = _config(files="c.txt", vocab_size=300).data
  identity = {"files": "sha"}
  base = shard_writer.fingerprint(config, identity)
  assert shard_writer.fingerprint(config, identity) == base
  for module, name in [(tokenizer_lib, "TRAIN_CHUNK_CHARS"), (tokenizer_lib, "MAX_TRAIN_CHARS"),
                       (packing, "ENCODE_PIECE_CHARS"), (shard_writer, "FORMAT_VERSION"),
                       (shard_writer, "RECORD_TOKENS")]:
    with monkeypatch.context() as m:
      m.setattr(module, name, getattr(module, name) + 1)
      assert shard_writer.fingerprint(config, identity) != base, name
  with monkeypatch.context() as m:
    m.setattr(tokenizer_lib, "TRAINER_SETTINGS", {**tokenizer_lib.TRAINER_SETTINGS, "x": 1})
    assert shard_writer.fingerprint(config, identity) != base
  assert shard_writer.fingerprint(config, {"files": "other"}) != base
  # The manifest records the shard size it was prepared with.
  assert json.loads((prepared_300 / "manifest.json").read_text())["shard_chars"] == 20_000


def test_the_fingerprint_follows_every_key_that_defines_the_data():
  import copy

  config = _config(files="c.txt", vocab_size=300).data
  identity = {"files": "sha"}
  base = shard_writer.fingerprint(config, identity)
  for key in prepared.SPEC_KEYS:
    other = copy.deepcopy(config)
    value = other[key]
    other[key] = (value / 2 if isinstance(value, float) else value + 1 if isinstance(value, int)
                  else value + "x")
    assert shard_writer.fingerprint(other, identity) != base, key


def _set(m, keys, value):
  *path, last = keys
  for key in path:
    m = m[key]
  if value is None:
    del m[last]
  else:
    m[last] = value


@pytest.mark.parametrize("edit,vocab,message", [
    pytest.param(lambda m: [], 300, r"/manifest\.json: damaged manifest: it is \[\]", id="list"),
    # Records of another length are another format: the reader's offsets assume 1024 tokens.
    pytest.param(lambda m: _set(m, ["record_tokens"], 2048), 300,
                 r"/manifest\.json: format 1 with 2048-token records; this version reads "
                 r"format 1 with 1024;", id="record-tokens"),
    pytest.param(lambda m: _set(m, ["record_tokens"], "1024"), 300,
                 r"/manifest\.json: damaged manifest: record_tokens is \"1024\", not an "
                 "integer", id="record-tokens-a-string"),
    pytest.param(lambda m: _set(m, ["format_version"], None), 300,
                 r"/manifest\.json: damaged manifest: format_version is missing",
                 id="no-format"),
    pytest.param(lambda m: {}, 300, r"/manifest\.json: damaged manifest: format_version is "
                 "missing", id="empty-object"),
    pytest.param(lambda m: _set(m, ["tokenizer"], None), 300,
                 r"/manifest\.json: damaged manifest: tokenizer is missing", id="no-tokenizer"),
    pytest.param(lambda m: _set(m, ["splits", "train", "shards", 0, "size"], "9"), 300,
                 r"/manifest\.json: damaged manifest: splits\.train\.shards\[0\]\.size is \"9\", "
                 "not an integer", id="size-a-string"),
    pytest.param(lambda m: _set(m, ["splits", "validation", "tokens"], 10**6), 300,
                 r"/manifest\.json: damaged manifest: splits\.validation\.tokens is 1000000, "
                 r"its shards hold \d+", id="split-tokens"),
    pytest.param(lambda m: _set(m, ["splits", "train", "tokens"],
                                m["splits"]["train"]["tokens"] - 1), 300,
                 r"/manifest\.json: damaged manifest: splits\.train\.tokens is \d+, "
                 r"its shards hold \d+", id="split-tokens-fewer"),
    pytest.param(lambda m: _set(m, ["token_dtype"], "<u4"), 300,
                 r"/manifest\.json: damaged manifest: token_dtype is '<u4', prepare writes '<u2' "
                 "for vocab_size 300", id="token-dtype"),
    pytest.param(lambda m: _set(m, ["tokenizer", "vocab_size"], 301), 301,
                 r": inconsistent prepared data: tokenizer\.model has vocab_size 300, "
                 r"manifest\.json says 301", id="vocab-size"),
    pytest.param(_edit_shard("train", 1, 5), 300,
                 r": inconsistent prepared data: the last record of train-00001\.array_record "
                 r"has \d+ bytes, manifest\.json says", id="shard-tokens"),
    pytest.param(_edit_shard("validation", 0, -3), 300,
                 r": inconsistent prepared data: the last record of validation-00000\.array_record",
                 id="validation-shard-tokens"),
    pytest.param(_edit_shard("train", 0, 1024, 1), 300,
                 r": inconsistent prepared data: train-00000\.array_record holds \d+ records, "
                 r"manifest\.json says", id="shard-records"),
    # Each rule of the manifest's own check, before any shard is opened. The records of a
    # shard follow from its tokens (1024 a record, the last one partial): the reader's index
    # arithmetic relies on it, so a count off by one is refused here, not read.
    pytest.param(_edit_shard("train", 0, 0, 1), 300,
                 r"/manifest\.json: damaged manifest: splits\.train\.shards\[0\] "
                 r"\(train-00000\.array_record\) has \d+ tokens in \d+ records of 1024",
                 id="records-not-from-tokens"),
    pytest.param(lambda m: _set(m, ["splits", "train", "shards", 0], {
                     **m["splits"]["train"]["shards"][0], "tokens": -5, "records": 0}), 300,
                 r"/manifest\.json: damaged manifest: splits\.train\.shards\[0\] "
                 r"\(train-00000\.array_record\) has -5 tokens in 0 records", id="tokens<0"),
    pytest.param(lambda m: _set(m, ["splits"], []), 300,
                 r"/manifest\.json: damaged manifest: splits is \[\], not an object",
                 id="splits-list"),
    pytest.param(lambda m: _set(m, ["splits", "train", "shards"], {}), 300,
                 r"/manifest\.json: damaged manifest: splits\.train\.shards is \{\}, not a list",
                 id="shards-object"),
    pytest.param(lambda m: _set(m, ["splits", "train", "shards"], []), 300,
                 r"/manifest\.json: damaged manifest: splits\.train\.shards is empty",
                 id="shards-empty"),
    pytest.param(lambda m: _set(m, ["splits", "train", "shards", 1, "file"],
                                "train-00000.array_record"), 300,
                 r"/manifest\.json: damaged manifest: splits\.train\.shards\[1\]\.file is "
                 r"'train-00000\.array_record', prepare writes 'train-00001\.array_record'",
                 id="shard-file"),
    pytest.param(lambda m: _set(m, ["splits", "train", "shards", 0, "records"], True), 300,
                 r"/manifest\.json: damaged manifest: splits\.train\.shards\[0\]\.records is "
                 r"true, not an integer", id="records-bool"),
    pytest.param(lambda m: _set(m, ["splits", "validation", "fields"], ["tokens"]), 300,
                 r"/manifest\.json: damaged manifest: splits\.validation\.fields is \['tokens'\], "
                 r"prepare writes \['tokens', 'bytes'\]", id="validation-fields"),
    pytest.param(lambda m: _set(m, ["tokenizer", "file"], "other.model"), 300,
                 r"/manifest\.json: damaged manifest: tokenizer\.file is 'other\.model', prepare "
                 r"writes 'tokenizer\.model'", id="tokenizer-file"),
    pytest.param(lambda m: _set(m, ["tokenizer", "vocab_size"], 0), 300,
                 r"/manifest\.json: damaged manifest: tokenizer\.vocab_size is 0, not >= 1",
                 id="vocab-size-0"),
    pytest.param(lambda m: _set(m, ["sources", "files", 0, "path"], 7), 300,
                 r"/manifest\.json: damaged manifest: sources\.files\[0\]\.path is 7, not a "
                 r"string", id="source-path"),
    # The ids the manifest records for the tokenizer must be the tokenizer's own.
    *(pytest.param(lambda m, key=key: _set(m, ["tokenizer", key], m["tokenizer"][key] + 1), 300,
                   rf": inconsistent prepared data: tokenizer\.model has {key} \d+, "
                   rf"manifest\.json says \d+", id=f"tokenizer-{key}")
      for key in ("eos_id", "pad_id")),
])
def test_a_hand_edited_manifest_is_a_one_line_error_naming_the_folder(
    edit, vocab, message, prepared_300, tmp_path):
  out = tmp_path / "p"
  shutil.copytree(prepared_300, out)
  manifest_path = out / "manifest.json"
  manifest = json.loads(manifest_path.read_text())
  edited = edit(manifest)  # a new manifest, or None for one edited in place
  manifest = manifest if edited is None else edited
  manifest_path.write_text(json.dumps(manifest))
  config = _config(prepared_dir=os.fspath(out), vocab_size=vocab)
  with pytest.raises(ValueError) as info:
    build_data(config, tmp_path / "wd")
  assert re.match(re.escape(os.fspath(out)) + message, str(info.value)), str(info.value)
  assert str(info.value).endswith("; run prepare again to rebuild it")
  assert "\n" not in str(info.value)
  # prepare rebuilds the manifest (the shards are intact: kept).
  sums = _shard_sums(out)
  shard_writer.prepare(_config(files=os.fspath(prepared_300.parent / "c.txt"), vocab_size=300).data,
                   out, shard_chars=20_000)
  assert json.loads(manifest_path.read_text()) == json.loads(
      (prepared_300 / "manifest.json").read_text())
  assert _shard_sums(out) == sums
  build_data(_config(prepared_dir=os.fspath(out), vocab_size=300), tmp_path / "wd")


def test_prepared_dir_must_fit_the_config(tmp_path):
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(2000))
  other = tmp_path / "d.txt"
  other.write_text(_text(2000, "x"))
  out = shard_writer.prepare(_config(files=os.fspath(corpus), vocab_size=300).data, tmp_path / "p")
  base = {"prepared_dir": os.fspath(out), "vocab_size": 300}
  data = build_data(_config(**base, seq_len=16), tmp_path / "wd")  # source from the folder
  assert data.train.seq_len == 16 and "c.txt" in data.source
  for field, value, message in (
      ("vocab_size", 320, r"data\.vocab_size=320 does not fit data\.prepared_dir=.*300"),
      ("files", os.fspath(other), r"data\.files='.*d\.txt' does not fit"),
      ("validation_fraction", 0.2, r"data\.validation_fraction=0\.2 does not fit"),
  ):
    with pytest.raises(ValueError, match=message):
      build_data(_config(**{**base, field: value}), tmp_path / "wd")
  with pytest.raises(ValueError, match=r"nothing does not exist; allowed: a folder"):
    build_data(_config(prepared_dir=os.fspath(tmp_path / "nothing")), tmp_path / "wd")


def test_prepared_dir_refuses_a_named_file_edited_since(tmp_path):
  # The same path with other contents trained on the old tokens without a word.
  corpus = tmp_path / "c.txt"
  text = _text(2000)
  corpus.write_text(text)
  out = shard_writer.prepare(_config(files=os.fspath(corpus), vocab_size=300).data, tmp_path / "p")
  config = _config(prepared_dir=os.fspath(out), files=os.fspath(corpus), vocab_size=300)
  build_data(config, tmp_path / "wd")
  then = f"{len(text)} bytes, sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]}"
  for edited in (text + "one more line.\n", text.replace("alpha", "omega")):  # the same size too
    corpus.write_text(edited)
    now = f"{len(edited)} bytes, sha256 {hashlib.sha256(edited.encode()).hexdigest()[:12]}"
    with pytest.raises(ValueError, match=(
        rf"^data\.files: {re.escape(os.fspath(corpus))} changed since data\.prepared_dir="
        rf"{re.escape(os.fspath(out))} was prepared from it \({then}; now {now}\); prepare "
        r"again, or leave data\.files empty to train on the prepared tokens$")):
      build_data(config, tmp_path / "wd")
  build_data(_config(prepared_dir=os.fspath(out), vocab_size=300), tmp_path / "wd")
  # A process whose peer verified the files (verify=False) compares their sizes only: a read
  # of the whole corpus per host at every start otherwise.
  manifest = prepared.PreparedData.open_manifest(out)
  prepared.check_fits(manifest, config.data, out, verify=False)  # same size, other text
  corpus.write_text(text + "one more line.\n")
  with pytest.raises(ValueError, match=r"changed since .*\(\d+ bytes, sha256 [0-9a-f]{12}; now "
                                       r"\d+ bytes, sha256 [0-9a-f]{12}\)"):
    prepared.check_fits(manifest, config.data, out, verify=False)


def test_workdir_preparation_is_reused_and_follows_edits(tmp_path, caplog):
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(2000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  build_data(config, tmp_path / "wd")
  (first,) = (tmp_path / "wd" / "data").iterdir()
  mtimes = {p: p.stat().st_mtime_ns for p in first.iterdir()}
  build_data(config, tmp_path / "wd")
  assert {p: p.stat().st_mtime_ns for p in first.iterdir()} == mtimes
  edited = _text(2100)
  corpus.write_text(edited)
  with caplog.at_level(logging.INFO):
    build_data(config, tmp_path / "wd")
  assert len(list((tmp_path / "wd" / "data").iterdir())) == 2
  # The folder of the text before the edit stays, and is named once at each start.
  assert (f"{tmp_path / 'wd' / 'data'} also holds 1 prepared dataset(s) this config does not "
          f"read ({first.name}: of an earlier text or tokenizer setting)") in caplog.text
  corpus.write_text(edited.replace("alpha", "omega"))  # other text, the same size
  assert corpus.stat().st_size == len(edited)
  data = build_data(config, tmp_path / "wd")
  assert len(list((tmp_path / "wd" / "data").iterdir())) == 3
  assert "omega" in data.tokenizer.decode(data.train.batch(0)["inputs"].ravel())


# ---- processes read disjoint rows ---------------------------------------------------------------


def test_two_processes_read_disjoint_rows_that_make_the_one_process_batch(tmp_path):
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(3000))
  data = build_data(_config(files=os.fspath(corpus), vocab_size=300), tmp_path / "wd")
  train = data.train
  for step in (0, 9, 31):
    parts = [train.window_indices(step, i, 2) for i in range(2)]
    assert not set(parts[0].tolist()) & set(parts[1].tolist())
    assert np.array_equal(np.concatenate(parts), train.window_indices(step))
    whole = train.batch(step)
    halves = [train.batch(step, i, 2) for i in range(2)]
    for key in whole:
      assert np.array_equal(np.concatenate([h[key] for h in halves]), whole[key])


# ---- the command line -------------------------------------------------------------------------


def test_prepare_cli_then_main_from_prepared_dir(tmp_path):
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(2000))
  (tmp_path / "cfg.py").write_text(
      "from tests.conftest import tiny_config\n"
      "def get_config():\n"
      "  c = tiny_config('llama', **{'data.vocab_size': 300, 'data.seq_len': 32,\n"
      "                  'train.num_steps': 2, 'model.d_model': 32, 'model.mlp_dim': 64,\n"
      "                  'model.num_heads': 2, 'model.num_layers': 1, 'eval.max_batches': 1})\n"
      "  return c\n")
  env = {**os.environ, "PYTHONPATH": os.fspath(REPO)}
  prep = [sys.executable, "-m", "cem_jax.prepare", f"--config={tmp_path / 'cfg.py'}",
          f"--config.data.files={corpus}", "--config.data.builtin=pydoc+docstrings",
          f"--out={tmp_path / 'p'}"]
  done = subprocess.run(prep, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert f"prepared {tmp_path / 'p'}; train with --config.data.prepared_dir=" in done.stdout
  assert "validation: " in done.stdout and " tokens in 1 shards" in done.stdout
  # --out refused, in this process (a program each cost ~2 s): prepare's main reports what
  # run raises as one 'error:' line with exit status 1, checked by the validation cases below.
  from cem_jax import prepare as prepare_cli

  config = tiny_config("llama", **{"data.vocab_size": 300, "data.seq_len": 32,
                                   "data.files": str(corpus),
                                   "data.builtin": "pydoc+docstrings"})
  with pytest.raises(ValueError, match=rf"^--out={tmp_path} is not empty"):
    prepare_cli.run(config, str(tmp_path))
  with pytest.raises(ValueError) as afile:
    prepare_cli.run(config, str(corpus))
  assert str(afile.value) == f"--out={corpus} is a file; choose a new or empty folder"
  run = subprocess.run(
      [sys.executable, "-m", "cem_jax.main", f"--config={tmp_path / 'cfg.py'}",
       f"--workdir={tmp_path / 'w'}", f"--config.data.prepared_dir={tmp_path / 'p'}"],
      cwd=REPO, env=subprocess_env(PYTHONPATH=os.fspath(REPO)),
      capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-2000:]
  assert not (tmp_path / "w" / "data").exists()
  first = json.loads((tmp_path / "w" / "metrics.jsonl").read_text().splitlines()[0])
  assert first["data/source"].endswith(f"via {tmp_path / 'p'}")


@pytest.mark.parametrize("override, message", [
    ("--config.data.validation_fraction=0.7",
     "error: data.validation_fraction=0.7; allowed: a finite number, 0 < value <= 0.5"),
    ("--config.data.vocab_size=4", "error: data.vocab_size=4; allowed: an int >= 8 and < 2**31"),
    ("--config.data.tokenizer_model_type=unigram",  # with data.tokenizer set: ignored
     "error: data.tokenizer_model_type='unigram' has no effect with data.tokenizer set (the "
     "given model is used as it is, not trained); leave it at 'bpe'"),
    ("--config.data.tfds_text_key=body",  # without data.tfds_name: ignored
     "error: data.tfds_text_key='body' has no effect without data.tfds_name; leave it at "
     "'text'"),
    ("--config.model.d_model=66",  # a model main cannot build: its data would go unused
     "error: model.d_model=66 is not divisible by model.num_heads=4; change one or set "
     "model.head_dim"),
    ("--config.data.files=/nonexistent_cem_jax/*.txt",  # was refused after jax loaded
     "error: data.files: glob '/nonexistent_cem_jax/*.txt' matches no file"),
], ids=["validation-fraction", "vocab-size", "ignored-model-type", "ignored-tfds-key",
        "model", "files-glob"])
def test_prepare_cli_validates_the_config_first_and_writes_nothing(override, message, tmp_path):
  # prepare checks the config as main does: data prepared from a config main rejects, or with
  # an option it silently ignores, would be a wasted and misleading preparation. Refused
  # before jax loads (0.5 s of CPU; 3 s with jax's start-up).
  # Mutation: prepare.run without its own config_lib.validate first printed '1 ['flax', 'jax']'.
  corpus, out = tmp_path / "c.txt", tmp_path / "p"
  corpus.write_text(_text(2000))
  spm.SentencePieceTrainer.train(
      input=os.fspath(corpus), model_prefix=os.fspath(tmp_path / "tok"), vocab_size=300,
      model_type="bpe", minloglevel=2, num_threads=1)
  (tmp_path / "cfg.py").write_text(
      "from tests.conftest import tiny_config\n"
      "def get_config():\n"
      "  return tiny_config('llama', **{'data.vocab_size': 300, 'data.seq_len': 32,\n"
      f"                                 'data.files': {os.fspath(corpus)!r}}})\n")
  given = [f"--config.data.tokenizer={tmp_path / 'tok.model'}"] if "model_type" in override else []
  before = sorted(p.name for p in tmp_path.iterdir())
  proc = subprocess.run(
      [sys.executable, "-c", RUN_MODULE_REPORTING_JAX, "cem_jax.prepare",
       f"--config={tmp_path / 'cfg.py'}", *given, override, f"--out={out}"], cwd=REPO,
      env={**os.environ, "PYTHONPATH": os.fspath(REPO)}, capture_output=True, text=True,
      timeout=300)
  assert (proc.stdout.strip(), proc.stderr.strip().splitlines()[-1:]) == ("1 []", [message]), (
      proc.stdout[-500:] + proc.stderr[-2000:])
  assert sorted(p.name for p in tmp_path.iterdir()) == before  # no --out folder, nothing else


def test_prepare_refuses_its_own_flags_and_passes_workers_on(tmp_path, monkeypatch, capsys):
  # prepare's own checks and output, in this process (each program started above costs
  # seconds). Importing cem_jax.prepare defines no flags: main's are defined only when it
  # runs as a program, so this worker's absl flags stay as they were.
  from absl import flags

  from cem_jax import prepare as prepare_cli

  assert "out" not in flags.FLAGS and "workers" not in flags.FLAGS
  config, out, given = tiny_config("llama"), tmp_path / "p", []
  monkeypatch.setattr(cpus, "usable", lambda: 3)  # --workers=2 allowed, 4 not, on any machine
  monkeypatch.setattr(shard_writer, "prepare",
                      lambda data, path, workers=None: (given.append(workers), path)[1])
  monkeypatch.setattr(prepared.PreparedData, "open_manifest", lambda path, verify=True: {
      "splits": {"train": {"documents": 2, "bytes": 10, "tokens": 5, "shards": ["a", "b"]}}})

  with pytest.raises(SystemExit) as stopped:
    prepare_cli.main(["prepare", "extra"])
  assert stopped.value.code == 1
  assert capsys.readouterr().err.startswith("error: unexpected arguments: extra; allowed: ")
  for n, prepared_dir, error in [
      (0, "", "--workers=0; allowed: an int >= 1"),
      (4, "", "--workers=4; allowed: 1..3 (the CPUs this process may use: encoding is "
              "CPU-bound, more processes only take memory)"),
      (None, str(tmp_path), f"data.prepared_dir={str(tmp_path)!r}: prepare writes to --out; "
                            "leave data.prepared_dir unset here")]:
    config.data.prepared_dir = prepared_dir
    with pytest.raises(ValueError) as e:
      prepare_cli.run(config, out, n)
    assert str(e.value) == error
  config.data.prepared_dir = ""
  assert given == []  # nothing prepared for a refused command line
  prepare_cli.run(config, out, 2)
  assert given == [2]  # --workers reaches the encoder
  prepare_cli.run(config, out, 3)  # every usable CPU is allowed, not one fewer
  assert given == [2, 3]
  capsys.readouterr()
  prepare_cli.run(config, out, 2)
  assert capsys.readouterr().out == (
      "train: 2 documents, 10 bytes of text, 5 tokens in 2 shards\n"
      f"prepared {out}; train with --config.data.prepared_dir={out}\n")
  # A folder with a space: the flag it prints is one shell word, ready to paste (unquoted,
  # the shell split it and main read a prepared_dir of the text before the space).
  spaced = tmp_path / "my data ü"
  prepare_cli.run(config, spaced, 2)
  hint = capsys.readouterr().out.splitlines()[-1].split("; train with ")[1]
  assert shlex.split(hint) == [f"--config.data.prepared_dir={spaced}"]


def test_the_open_files_limit_is_raised_for_the_shards_or_the_hard_limit_named(monkeypatch):
  # Every shard's reader stays open: past ~1,000 shards (~17 GB of text) a soft limit of 1024
  # made the data unreadable, reported as damage.
  import resource

  calls = []
  monkeypatch.setattr(resource, "setrlimit", lambda kind, limits: calls.append(limits))
  for soft, hard, want in ((1024, 4096, [(3256, 4096)]), (1024, resource.RLIM_INFINITY,
                           [(3256, resource.RLIM_INFINITY)]), (8192, 8192, [])):
    calls.clear()
    monkeypatch.setattr(resource, "getrlimit", lambda kind, s=soft, h=hard: (s, h))
    prepared.allow_open_files(3000, Path("/d"))
    assert calls == want, (soft, hard)
  for hard in (2048, 3100):  # 3100 holds the shards, not the other files beside them
    monkeypatch.setattr(resource, "getrlimit", lambda kind, h=hard: (1024, h))
    with pytest.raises(ValueError, match=rf"^/d: 3000 shards stay open while reading, but this "
                                         rf"process may open {hard} files \(hard limit\); raise "
                                         r"it \(ulimit -Hn 3256\)"):
      prepared.allow_open_files(3000, Path("/d"))


def test_processes_other_than_0_open_the_data_process_0_verified_by_sizes(monkeypatch):
  import jax
  from jax.experimental import multihost_utils

  from cem_jax import data as data_lib
  from cem_jax import workdir

  seen = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: 1)
  monkeypatch.setattr(data_lib, "build_data",
                      lambda c, w, verify=True: seen.append(verify) or "data")
  for index in (0, 1):
    monkeypatch.setattr(jax, "process_index", lambda i=index: i)
    workdir.build_data_once(None, "w")
  assert seen == [True, False]
  # Process 0 failing still joins the collective (the others wait in it) and raises its own
  # error; the others, told so, stop instead of building the data themselves.
  sent = []

  def cannot_build(config, workdir, verify=True):
    raise OSError(f"process {jax.process_index()} built the data")

  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all",
                      lambda x: sent.append(int(x)) or 0)
  monkeypatch.setattr(data_lib, "build_data", cannot_build)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  with pytest.raises(OSError, match="^process 0 built the data$"):
    workdir.build_data_once(None, "w")
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  with pytest.raises(ValueError, match="^process 0 could not build the data"):
    workdir.build_data_once(None, "w")
  assert sent == [0, 1]


def _flip_a_bit(shard) -> None:
  """A bit flip: riegeli's chunk hash fails when the shard is read."""
  data = bytearray(shard.read_bytes())
  data[len(data) // 2] ^= 0xFF
  shard.write_bytes(bytes(data))


def _rewrite_one_token(shard) -> None:
  """One token changed and the shard written again as ArrayRecord: it reads cleanly and keeps
  its size, records and last record's length."""
  from array_record.python import array_record_module

  reader = array_record_module.ArrayRecordReader(os.fspath(shard))
  records = reader.read(list(range(reader.num_records())))
  reader.close()
  first = np.frombuffer(records[0], "<u2").copy()
  first[0] = (first[0] + 1) % 300
  writer = array_record_module.ArrayRecordWriter(os.fspath(shard), shard_writer.WRITER_OPTIONS)
  for record in [first.tobytes(), *records[1:]]:
    writer.write(record)
  writer.close()


@pytest.mark.parametrize("damage", [_flip_a_bit, _rewrite_one_token],
                         ids=["bit_flip", "valid_records"])
def test_prepare_rebuilds_a_shard_damaged_in_place(tmp_path, damage):
  # Damage that keeps the shard's size: only its sha256 tells a re-run to encode it again.
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(2000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  out = shard_writer.prepare(config.data, tmp_path / "p", shard_chars=20_000)
  shard = sorted(out.glob("train-*.array_record"))[1]
  good = shard.read_bytes()
  damage(shard)
  assert shard.read_bytes() != good and shard.stat().st_size == len(good)
  shard_writer.prepare(config.data, out, shard_chars=20_000)
  assert shard.read_bytes() == good
  config.data.prepared_dir = os.fspath(out)
  build_data(config, tmp_path / "wd")


def test_prepare_rebuilds_a_damaged_trained_tokenizer(tmp_path):
  # "run prepare again to rebuild it": the re-run used to load the damaged tokenizer.model it
  # had trained (a bit flip: SentencePiece or a UnicodeDecodeError failed every re-run).
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(1000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  out = shard_writer.prepare(config.data, tmp_path / "p", shard_chars=20_000)
  model = out / "tokenizer.model"
  good, sums = model.read_bytes(), _shard_sums(out)
  data = bytearray(good)
  data[len(data) // 2] ^= 0xFF
  model.write_bytes(bytes(data))
  with pytest.raises(prepared.BadPreparedData, match=r"tokenizer\.model: damaged prepared data"):
    prepared.PreparedData.open(out)
  shard_writer.prepare(config.data, out, shard_chars=20_000)
  assert model.read_bytes() == good and _shard_sums(out) == sums
  prepared.PreparedData.open(out)


def test_a_rerun_with_fewer_shards_leaves_no_shard_the_manifest_does_not_list(tmp_path):
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(1000))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  shard_writer.prepare(config.data, tmp_path / "a", shard_chars=10_000)
  (tmp_path / "a" / prepared.MANIFEST).unlink()  # killed before its manifest
  shard_writer.prepare(config.data, tmp_path / "a", shard_chars=20_000)
  shard_writer.prepare(config.data, tmp_path / "b", shard_chars=20_000)
  assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(
      p.name for p in (tmp_path / "b").iterdir())
  assert _shard_sums(tmp_path / "a") == _shard_sums(tmp_path / "b")


def test_a_damaged_or_lost_prepare_json_is_named_and_a_complete_folder_still_opens(tmp_path):
  # prepare.json holds the fingerprint a re-run checks: damaged (a bit flip, a hand edit) or
  # lost, the folder used to be refused as "another dataset (fingerprint None)" or as holding
  # no prepared dataset, though its manifest names this one.
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(300))
  config = _config(files=os.fspath(corpus), vocab_size=300)
  out = shard_writer.prepare(config.data, tmp_path / "p", shard_chars=20_000)
  progress, sums = out / "prepare.json", _shard_sums(out)
  for damage in ("{not json", "[]", '{"format_version": 1}', None):
    if damage is None:
      progress.unlink()
    else:
      progress.write_text(damage)
    shard_writer.prepare(config.data, out, shard_chars=20_000)  # the manifest says: this one
    assert _shard_sums(out) == sums
    assert json.loads(progress.read_text())["fingerprint"] == prepared.PreparedData.open(
        out).manifest["fingerprint"]
  # Without a manifest nothing tells which dataset the shards are: refused, naming the file.
  (out / "manifest.json").unlink()
  progress.write_text("{not json")
  with pytest.raises(ValueError, match="^" + re.escape(f"--out={out}: {progress} is damaged")):
    shard_writer.prepare(config.data, out, shard_chars=20_000)


def test_a_shard_of_whole_records_counts_them_as_arrayrecord_does(prepared_300, tmp_path):
  # 1024 empty documents: 1024 EOS, exactly one full record (and 1025: two records).
  from array_record.python import array_record_module

  shard_writer._init_worker((prepared_300 / "tokenizer.model").read_bytes())
  for docs, records in ((prepared.RECORD_TOKENS, 1), (prepared.RECORD_TOKENS + 1, 2)):
    out = tmp_path / str(docs)
    shutil.copytree(prepared_300, out)
    task = {"split": "train", "index": 0, "pieces": [""] * docs, "ends": [True] * docs}
    meta = shard_writer._encode_and_write((task, os.fspath(out), "<u2", "0" * 64))
    reader = array_record_module.ArrayRecordReader(os.fspath(out / meta["file"]))
    assert (meta["tokens"], meta["records"], reader.num_records()) == (docs, records, records)
    reader.close()
    # The reader takes that shard as its train split: a last record that is full is no damage.
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["splits"]["train"]["tokens"] = docs
    manifest["splits"]["train"]["shards"] = [{k: meta[k] for k in ("file", "tokens", "records",
                                                                   "size", "sha256")}]
    (out / "manifest.json").write_text(json.dumps(manifest))
    data = prepared.PreparedData.open(out)
    tokens, _, valid = data.streams["train"].read(np.array([docs - 3, docs - 1]), 3, -1)
    eos = data.tokenizer.eos_id
    assert tokens.tolist() == [[eos] * 3, [eos, -1, -1]] and valid.tolist() == [3, 1]


def test_a_sidecar_one_whole_record_short_of_its_shard_is_not_taken(prepared_300, tmp_path):
  # 2048 empty documents: two full records. A sidecar that says one record of 1024 tokens
  # agrees with the shard's size, sha256 and the length of the record it names as the last;
  # only ArrayRecord's count of records tells it from the shard.
  shard_writer._init_worker((prepared_300 / "tokenizer.model").read_bytes())
  docs = 2 * prepared.RECORD_TOKENS
  task = {"split": "train", "index": 0, "pieces": [""] * docs, "ends": [True] * docs}
  meta = shard_writer._encode_and_write((task, os.fspath(tmp_path), "<u2", "0" * 64))
  assert (meta["tokens"], meta["records"]) == (docs, 2)
  assert shard_writer._done(tmp_path, task, "0" * 64, "<u2") == meta
  sidecar = tmp_path / "train-00000.json"
  sidecar.write_text(json.dumps(meta | {"tokens": docs - prepared.RECORD_TOKENS, "records": 1}))
  assert shard_writer._done(tmp_path, task, "0" * 64, "<u2") is None


@pytest.mark.parametrize("vocab,dtype", [(8, "<u2"), (65_535, "<u2"), (65_536, "<u2"),
                                         (65_537, "<u4"), (100_000, "<u4"), (1 << 20, "<u4")])
def test_the_token_dtype_holds_every_id_of_the_vocabulary(vocab, dtype):
  # Ids are 0..vocab-1: two bytes hold them up to a vocabulary of 2**16 = 65,536 (the format:
  # '<u2' up to 65,536 pieces), above it the largest ids would wrap to small ones silently.
  assert prepared.token_dtype(vocab) == dtype
  ids = np.array([0, 1, vocab // 2, vocab - 1], np.int64)
  assert np.array_equal(ids.astype(prepared.token_dtype(vocab)).astype(np.int64), ids)


def test_builtin_prepared_dir_must_have_the_same_validation_fraction(prepared_300):
  # check_fits on a builtin source (no data.files, no catalog): the held-out fraction decides
  # the split, so another one is other data.
  manifest = json.loads((prepared_300 / "manifest.json").read_text())
  manifest["sources"] = {"kind": "builtin", "name": "pydoc"}
  manifest["config"].update(files="", builtin="pydoc", validation_fraction=0.1)
  prepared.check_fits(manifest, _config(vocab_size=300, validation_fraction=0.1).data,
                      prepared_300)
  with pytest.raises(ValueError, match=r"data\.validation_fraction=0\.2 does not fit"):
    prepared.check_fits(manifest, _config(vocab_size=300, validation_fraction=0.2).data,
                        prepared_300)
  with pytest.raises(ValueError, match=r"^data\.builtin='pydoc\+docstrings' does not fit .*, "
                                       r"prepared with 'pydoc'"):
    prepared.check_fits(manifest, _config(vocab_size=300, builtin="pydoc+docstrings").data,
                        prepared_300)


def test_a_prepared_dir_must_have_the_tokenizer_of_the_config(prepared_300, tmp_path):
  # Its model type, when the tokenizer was trained there; the given tokenizer, by content.
  manifest = json.loads((prepared_300 / "manifest.json").read_text())
  prepared.check_fits(manifest, _config(vocab_size=300).data, prepared_300)
  with pytest.raises(ValueError, match=r"^data\.tokenizer_model_type='unigram' does not fit "
                                       r"data\.prepared_dir=.*, prepared with 'bpe'"):
    prepared.check_fits(manifest, _config(vocab_size=300, tokenizer_model_type="unigram").data,
                        prepared_300)
  same, other = tmp_path / "same.model", tmp_path / "other.model"
  shutil.copy(prepared_300 / "tokenizer.model", same)
  other.write_bytes(same.read_bytes() + b" ")
  prepared.check_fits(manifest, _config(vocab_size=300, tokenizer=os.fspath(same)).data,
                      prepared_300)
  with pytest.raises(ValueError, match=r"^data\.tokenizer='.*other\.model' does not fit .*, "
                                       r"prepared with 'a trained tokenizer'"):
    prepared.check_fits(manifest, _config(vocab_size=300, tokenizer=os.fspath(other)).data,
                        prepared_300)
  # A folder prepared with a given tokenizer: the config's model type trains nothing, so any fits.
  manifest["tokenizer"]["trained_here"] = False
  manifest["config"]["tokenizer"] = os.fspath(same)
  prepared.check_fits(manifest, _config(vocab_size=300, tokenizer_model_type="unigram").data,
                      prepared_300)


def test_another_valid_tokenizer_in_a_prepared_folder_is_damage(prepared_300, tmp_path):
  # Its vocabulary and special ids agree with the manifest: only its sha256 tells.
  from cem_jax.data import tokenizer as tokenizer_lib

  out = tmp_path / "p"
  shutil.copytree(prepared_300, out)
  (out / "tokenizer.model").write_bytes(tokenizer_lib.train_model([_text(400, "x")], 300))
  with pytest.raises(prepared.BadPreparedData, match=rf"^{out}/tokenizer\.model: damaged "
                                                     r"prepared data: sha256 differs"):
    prepared.PreparedData.open(out)


def test_workdir_preparation_follows_an_edited_tokenizer_file(tmp_path):
  # data.tokenizer names a file: WORKDIR/data/<fingerprint> must follow its content, not its
  # path, or tokens of the old model would be trained under the new one's ids.
  from cem_jax.data import tokenizer as tokenizer_lib

  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(2000))
  model = tmp_path / "tok.model"
  model.write_bytes(tokenizer_lib.train_model([_text(2000)], 300))
  config = _config(files=os.fspath(corpus), vocab_size=300, tokenizer=os.fspath(model))
  first = build_data(config, tmp_path / "wd")
  model.write_bytes(tokenizer_lib.train_model([_text(2000, "x")], 300))
  second = build_data(config, tmp_path / "wd")
  assert len(list((tmp_path / "wd" / "data").iterdir())) == 2
  assert second.identity["tokenizer_sha256"] == files.sha256_file(model)
  assert second.identity["tokenizer_sha256"] != first.identity["tokenizer_sha256"]


def test_interleave_split_chunk_size_by_hand():
  """41 characters, no line break, fraction 0.1: k = 10, chunks of ceil(41 / 40) = 2
  characters (21 chunks); chunks 9 and 19 are held out."""
  doc = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNO"
  assert len(doc) == 41
  train, validation = text_lib.interleave_split([doc], 0.1)
  assert validation == [doc[18:20], doc[38:40]]
  assert train == [doc[:18], doc[20:38], doc[40:]]


def test_interleave_split_rounds_one_over_the_fraction():
  """Fraction 0.15: k = round(1 / 0.15) = 7, not 6; 56 characters, no line break: chunks of
  ceil(56 / 28) = 2 characters, chunks 6, 13, 20 and 27 held out."""
  doc = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123"
  train, validation = text_lib.interleave_split([doc], 0.15)
  assert validation == [doc[12:14], doc[26:28], doc[40:42], doc[54:56]]
  assert train == [doc[:12], doc[14:26], doc[28:40], doc[42:54]]


def test_prepare_starts_one_worker_per_usable_cpu_by_default(tmp_path, monkeypatch):
  # The shards do not depend on the count; a pod host's 100+ CPUs used to get 2 workers. How
  # the usable CPUs are counted is tests/test_cpus.py's.
  monkeypatch.setattr(cpus, "usable", lambda: 3)
  started = []

  monkeypatch.setattr(shard_writer.multiprocessing, "get_context",
                      lambda method: type("Context", (), {"Pool": _inline_pool(started)}))
  corpus = tmp_path / "c.txt"
  corpus.write_text(_text(400, "a"))  # ~30K characters
  config = _config(files=os.fspath(corpus), vocab_size=300)
  shard_writer.prepare(config.data, tmp_path / "small", shard_chars=5000)
  assert started == []  # below POOL_MIN_CHARS: this process alone
  monkeypatch.setattr(shard_writer, "POOL_MIN_CHARS", 0)
  shard_writer.prepare(config.data, tmp_path / "large", shard_chars=5000)
  assert started == [3]
  assert (tmp_path / "large" / prepared.MANIFEST).is_file()
  shard_writer.prepare(config.data, tmp_path / "two", shard_chars=20_000)
  assert started == [3, 2]  # no more workers than shards


def test_the_manifest_counts_characters_and_utf8_bytes_of_each_split_apart(tmp_path):
  # Text with 2- and 3-byte characters, so characters and bytes differ; counted by hand from
  # the split the rule makes (interleave_split of the files' text), per split and in total.
  lines = "".join(f"caf\u00e9 {i} \u6f22\u5b57 na\u00efve r\u00e9sum\u00e9.\n" for i in range(400))
  paths = []
  for i, doc in enumerate([lines, _text(300, "x")]):
    paths.append(tmp_path / f"{i}.txt")
    paths[-1].write_text(doc, encoding="utf-8")
  config = _config(files=",".join(os.fspath(p) for p in paths), vocab_size=300)
  out = shard_writer.prepare(config.data, tmp_path / "prep", shard_chars=5_000)
  manifest = json.loads((out / "manifest.json").read_text())
  train, validation = text_lib.interleave_split(read_documents(paths),
                                                config.data.validation_fraction)
  for split, docs in (("train", train), ("validation", validation)):
    info = manifest["splits"][split]
    assert info["characters"] == sum(len(d) for d in docs), split
    assert info["bytes"] == sum(len(d.encode("utf-8")) for d in docs), split
    assert info["documents"] == len(docs), split
    assert info["bytes"] > info["characters"], split  # the test text is not ASCII


def test_a_vocabulary_above_65536_is_stored_in_4_bytes_and_read_back(tmp_path):
  # The '<u4' format end to end: ids above 65,535 written, read back by position and decoded
  # to the text. A reader that took every record as '<u2' (or a writer that cast to it) would
  # wrap those ids to small ones silently; the last-record length check alone does not see it.
  pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
  proto = pb.ModelProto.FromString(shard_writer.tokenizer_lib.train_model([_text(300)], 300))
  extra = 65_537 + 3 - len(proto.pieces)  # 65,540 pieces: the top ids need 17 bits
  for i in range(extra):  # user-defined pieces, matched whole wherever they occur in the text
    proto.pieces.add(piece=f"Q{i:05d}Q", score=0.0, type=pb.ModelProto.SentencePiece.USER_DEFINED)
  model = tmp_path / "big.model"
  model.write_bytes(proto.SerializeToString())
  top = [f"Q{i:05d}Q" for i in range(extra - 3, extra)]  # ids 65,537..65,539
  text = "".join(f"line {i}: {top[i % 3]} alpha {i % 7} beta\n" for i in range(3000))
  (tmp_path / "c.txt").write_text(text)
  config = _config(files=os.fspath(tmp_path / "c.txt"), vocab_size=65_540, seq_len=40,
                   tokenizer=os.fspath(model))
  out = shard_writer.prepare(config.data, tmp_path / "p")
  manifest = json.loads((out / "manifest.json").read_text())
  assert manifest["token_dtype"] == "<u4"
  config.data.prepared_dir = os.fspath(out)
  data = build_data(config, tmp_path / "wd")
  tok = data.tokenizer
  top_ids = {tok._sp.piece_to_id(p) for p in top}
  assert top_ids == {65_537, 65_538, 65_539}
  for windows in (data.train.windows, data.eval.windows):
    rows = windows.rows(np.arange(windows.num_windows))
    assert top_ids <= set(np.unique(rows["tokens"]).tolist())
    assert rows["tokens"].max() < 65_540
  # Every held-out document decodes to its text: the ids were read back as written.
  tokens = data.eval.windows.rows(np.arange(data.eval.num_windows))["tokens"]
  segments = data.eval.windows.rows(np.arange(data.eval.num_windows))["segment_ids"]
  stream = tokens[segments > 0]
  ends = np.flatnonzero(stream == tok.eos_id)
  docs = [tok.decode(d) for d in np.split(stream, ends + 1)[:-1]]
  _, validation = text_lib.interleave_split([text], 0.1)
  assert docs == validation
  _assert_same_data(data, build_data_in_memory(config))


def _sidecar_edit(key, value):
  def edit(meta):
    meta[key] = value(meta[key]) if callable(value) else value
    return meta
  return edit


@pytest.mark.parametrize("split,damage", [
    ("train", lambda m: []),  # valid JSON, not an object: was a TypeError traceback
    ("train", lambda m: {k: v for k, v in m.items() if k != "characters"}),  # was a KeyError
    ("train", _sidecar_edit("tokens", lambda t: t + 1)),
    ("train", _sidecar_edit("records", lambda r: r + 1)),
    ("train", _sidecar_edit("size", "big")),
    ("validation", _sidecar_edit("bytes", lambda b: b + 7)),
    ("validation", _sidecar_edit("documents", lambda d: d + 1)),
    ("validation", _sidecar_edit("tokens", lambda t: t - 1)),
    # Equal as numbers, not as JSON: 2.0 went into the manifest, which every start refuses.
    ("validation", _sidecar_edit("documents", float)),
    ("train", _sidecar_edit("characters", float)),
], ids=["list", "no-characters", "tokens+1", "records+1", "size-str", "bytes+7", "documents+1",
        "tokens-1", "documents-float", "characters-float"])
def test_a_rerun_writes_again_the_shard_of_a_damaged_sidecar(prepared_300, tmp_path, split,
                                                              damage):
  # A re-run took an intact shard's sidecar on its text hash, tokenizer, size and sha256 alone:
  # its counts went into the manifest as they were. A token count off by one made every start
  # refuse the folder ("run prepare again to rebuild it") and every re-run write the same
  # manifest again; wrong bytes or documents were the manifest's silently.
  out = tmp_path / "p"
  shutil.copytree(prepared_300, out)
  (out / "manifest.json").unlink()
  sidecar = out / f"{split}-00000.json"
  sidecar.write_text(json.dumps(damage(json.loads(sidecar.read_text()))))
  config = _config(files=os.fspath(prepared_300.parent / "c.txt"), vocab_size=300)
  shard_writer.prepare(config.data, out, shard_chars=20_000)
  for path in sorted(prepared_300.iterdir()):  # byte for byte an uninterrupted prepare
    assert (out / path.name).read_bytes() == path.read_bytes(), path.name
  assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in prepared_300.iterdir())
  prepared.PreparedData.open(out)


@pytest.mark.parametrize("fraction,every", [(0.5, "2nd"), (1 / 3, "3rd"), (0.1, "10th"),
                                            (1 / 11, "11th"), (1 / 21, "21st"),
                                            (1 / 22, "22nd"), (1 / 23, "23rd")])
def test_an_empty_validation_split_names_the_held_out_chunks_in_english(fraction, every):
  with pytest.raises(ValueError, match=rf"^data\.validation_fraction=.* leaves an empty "
                                       rf"validation split of a 1-character corpus \(every "
                                       rf"{every} of its 1 chunks is held out\); use more text"):
    text_lib.interleave_split(["x"], fraction)


def test_a_glob_of_the_prepared_dir_that_matches_other_files_names_one(tmp_path):
  # The same data.files glob as prepared, now matching a file more or less, was refused as
  # "data.files='GLOB' does not fit ..., prepared with 'GLOB'": the glob twice, no file named.
  folder = tmp_path / "texts"
  folder.mkdir()
  (folder / "a.txt").write_text(_text(1500, "a"))
  (folder / "c.txt").write_text(_text(1500, "c"))
  glob = os.fspath(folder / "*.txt")
  config = _config(files=glob, vocab_size=300)
  config.data.prepared_dir = os.fspath(shard_writer.prepare(config.data, tmp_path / "p"))
  build_data(config, tmp_path / "wd")
  (folder / "b.txt").write_text("more\n")
  with pytest.raises(ValueError) as info:
    build_data(config, tmp_path / "wd")
  assert str(info.value) == (
      f"data.files={glob!r} matches other files than data.prepared_dir={tmp_path / 'p'} was "
      f"prepared from (it now also matches {folder / 'b.txt'}; files now: 3, then: 2); prepare "
      "again, or leave data.files empty to train on the prepared tokens")
  (folder / "b.txt").unlink()
  (folder / "c.txt").unlink()
  with pytest.raises(ValueError, match=rf"\(it no longer matches {re.escape(os.fspath(folder))}"
                                       r"/c\.txt; files now: 1, then: 2\)"):
    build_data(config, tmp_path / "wd")


@pytest.mark.parametrize("fraction,warning", [
    (0.1, None), (0.2, None), (0.5, None), (1 / 3, None), (0.3333, None), (0.33, None),
    (0.05, None), (0.101, None),
    (0.4, "holds out every 2nd chunk of the files: 50.0% of the text"),
    (0.3, "holds out every 3rd chunk of the files: 33.3% of the text"),
    (0.15, "holds out every 7th chunk of the files: 14.3% of the text"),
])
def test_a_fraction_that_is_not_one_over_a_whole_number_is_named_with_what_is_held_out(
    tmp_path, caplog, fraction, warning):
  # Local files hold out every k-th chunk, k = round(1 / fraction): 0.4 held out half the text
  # (round(2.5) == 2) without a word.
  path = tmp_path / "c.txt"
  path.write_text(_text(400))
  with caplog.at_level(logging.WARNING, logger="cem_jax.data.text"):
    train, validation = text_lib.interleave_split_files([path], fraction)
  k = round(1 / fraction)
  chunks = text_lib.cut_at_breaks(path.read_text(), train.size)
  assert list(validation) == chunks[k - 1::k]  # what the warning says is what is held out
  messages = [r.getMessage() for r in caplog.records if r.name == "cem_jax.data.text"]
  if warning is None:
    assert messages == []
  else:
    assert messages == [f"data.validation_fraction={fraction} {warning} (the fraction is 1/k "
                        f"for a whole k = round(1 / fraction)); set {1 / k:.4g} for exactly that"]


def test_the_manifest_lists_shards_by_index_past_five_digits():
  # shard_name pads to 5 digits; as text "train-100000" sorts before "train-99999".
  names = [prepared.shard_name("train", i) for i in (100000, 2, 99999, 10)]
  meta = lambda name: {"file": name, "tokens": 1, "records": 1, "size": 1, "sha256": "",
                       "documents": 1, "characters": 1, "bytes": 1}
  info = shard_writer._split_info({s: [meta(n) for n in names] for s in ("train", "validation")},
                                  "text")
  assert [m["file"] for m in info["train"]["shards"]] == [
      prepared.shard_name("train", i) for i in (2, 10, 99999, 100000)]
