"""Tests of cem_jax.data: sources and split rule, TFDS builder, tokenizer, packing, batches."""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import io
import json
import os
import queue
import re
import socket
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from conftest import closed_port, fake_catalog

from cem_jax.config import get_default_config
from cem_jax.data import (
  EvalWindows,
  TrainBatches,
  Windows,
  build_data,
  builtin,
  make_batch,
  pack,
  packing,
  read_documents,
  resolve_files,
  shuffled_positions,
  split_documents,
  text_splits,
  tfds_catalog,
)
from cem_jax.data import text as text_lib
from cem_jax.data import tokenizer as tokenizer_lib

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SHARED_FILES = ("tinyshakespeare.txt", "warpeace.txt", "wikitext2_test.txt",
                "wikitext2_valid.txt")
needs_shared = pytest.mark.usefixtures("shared_data")  # fails, not skips, without the corpora


def _config(**data):
  config = get_default_config()
  config.data.builtin = "pydoc"  # the default adds docstrings; pydoc alone keeps tests fast
  config.data.seq_len = 32
  config.data.vocab_size = 512
  config.train.batch_size = 8
  for key, value in data.items():
    setattr(config.data, key, value)
  return config


def _write(path: Path, text: str) -> Path:
  path.write_bytes(text.encode("utf-8"))
  return path


@pytest.fixture(scope="module")
def pydoc_tokenizer():
  train, _ = split_documents(builtin.pydoc_topics(), 0.1)
  return tokenizer_lib.Tokenizer(tokenizer_lib.train_model(train, 512))


def _corpus_text(lines: int = 400, tag: str = "") -> str:
  words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
  return "".join(
      f"{tag}line {i}: " + " ".join(words[(i * j) % len(words)] for j in range(1, 9)) + ".\n"
      for i in range(lines)
  )


# ---- split rule and sources -------------------------------------------------------------------


def test_split_rule_reconstructs_and_cuts_at_line_start():
  docs = [f"doc {k}\n" + "".join(f"line {k}.{i}\n" for i in range(k + 3)) for k in range(20)]
  train, validation = split_documents(docs, 0.25)
  assert (train, validation) == split_documents(list(docs), 0.25)  # deterministic
  assert "".join(train) + "".join(validation) == "".join(docs)
  joined = "\n\n".join(docs)
  # Validation is a suffix of the joined corpus; the cut lies at a line start.
  assert joined.endswith("\n\n".join(validation))
  assert train[-1].endswith("\n")
  frac = sum(map(len, validation)) / sum(map(len, docs))
  assert 0.2 < frac < 0.3
  # The document holding the cut is split into head (train) and tail (validation).
  k = len(train) - 1
  assert train[-1] + validation[0] == docs[k] and train[:-1] == docs[:k]
  assert validation[1:] == docs[k + 1 :]


def test_split_rule_single_document_and_bad_fraction():
  doc = "".join(f"row {i}\n" for i in range(1000))
  train, validation = split_documents([doc], 0.1)
  assert len(train) == len(validation) == 1 and train[0] + validation[0] == doc
  assert validation[0].startswith("row ") and train[0].endswith("\n")
  assert abs(len(validation[0]) / len(doc) - 0.1) < 0.01
  for bad in (0.0, -0.1, 0.6, float("nan")):
    with pytest.raises(ValueError, match=r"^data\.validation_fraction=.*; allowed: a finite "
                                         r"number, 0 < value <= 0\.5$"):
      split_documents([doc], bad)
  with pytest.raises(ValueError, match="empty validation split"):
    split_documents(["no newline at all " * 10], 0.1)


def test_the_split_cut_counts_the_separators_and_splits_no_document_at_a_document_start():
  # "ab\n\ncd\nef" is 9 characters: the cut, int(9 * 0.5) = 4, is the first character of the
  # second document, a line start, so no document is split. (Without the separator's 2
  # characters the cut would be 3, inside "cd", and move to "ef".)
  assert split_documents(["ab", "cd\nef"], 0.5) == (["ab"], ["cd\nef"])


def test_a_cut_that_falls_on_a_line_start_stays_there():
  # 16 characters, fraction 0.3125 (exact in binary): the cut, 16 * 0.6875 = 11, is the first
  # character of "xy", a line start, so it is not moved on to the start of the next line.
  assert split_documents(["abcdefghij\nxy\nz\n"], 0.3125) == (["abcdefghij\n"], ["xy\nz\n"])
  # One character earlier, inside the line "abcdefghij\n": moved to the start of "xy" too.
  assert split_documents(["abcdefghij\nxy\nz\n"], 0.375) == (["abcdefghij\n"], ["xy\nz\n"])
  # 16 * 0.71875 = 11.5: the cut is int(11.5) = 11, the start of "xy" (rounded to 12, inside
  # "xy", it would move on to "z").
  assert split_documents(["abcdefghij\nxy\nz\n"], 0.28125) == (["abcdefghij\n"], ["xy\nz\n"])


def test_pydoc_source(tmp_path):
  splits = text_splits(_config().data)
  topics = builtin.pydoc_topics()
  assert 70 <= len(topics) <= 90
  assert splits.source.startswith("builtin: pydoc")
  assert "".join(splits.train) + "".join(splits.validation) == "".join(topics)
  assert splits.characters == len("".join(topics))
  # In sorted-key order, the order the byte 4-gram reference of the README reads them in.
  from pydoc_data import topics as pydoc_data
  assert (topics[0], topics[-1]) == (pydoc_data.topics[min(pydoc_data.topics)],
                                     pydoc_data.topics[max(pydoc_data.topics)])
  assert "\n\n".join(topics).endswith("\n\n".join(splits.validation))
  frac = sum(map(len, splits.validation)) / sum(map(len, topics))
  assert 0.09 < frac < 0.11
  assert text_splits(_config().data) == splits


def test_docstrings_source_is_deterministic():
  first = builtin.stdlib_docstrings()
  assert len(first) > 100 and sum(map(len, first)) > 500_000
  assert builtin.stdlib_docstrings() == first
  with pytest.raises(ValueError, match="data.builtin='nope'"):
    builtin.builtin_documents("nope")


def test_docstrings_leave_out_test_demo_and_gui_packages():
  names = [name for name, _ in builtin._module_files()]
  assert "json" in names and "json.decoder" in names and "email.mime.text" in names
  skipped = {"test", "tests", "idlelib", "idle_test", "turtledemo", "lib2to3", "ensurepip", "this"}
  assert not [n for n in names if skipped & set(n.split("."))]
  # Private modules (_pyio, _strptime, ...) neither: the corpus is the public library's.
  assert not [n for n in names if any(part.startswith("_") for part in n.split("."))]


def test_docstrings_of_a_file_are_one_document_joined_by_blank_lines(tmp_path, monkeypatch):
  path = tmp_path / "m.py"
  path.write_text('"""Module m."""\n\nclass A:\n  """Class A."""\n\n  def f(self):\n'
                  '    """Method f.\n\n    More."""\n\n\ndef g():\n  pass\n')
  bare = tmp_path / "n.py"  # no docstring at all: no document, not an empty one
  bare.write_text("def h():\n  return 1\n")
  monkeypatch.setattr(builtin, "_module_files", lambda: [("m", path), ("n", bare)])
  assert builtin.stdlib_docstrings() == ["Module m.\n\nClass A.\n\nMethod f.\n\nMore."]


def test_the_builtin_source_is_identified_by_the_python_that_ships_it(monkeypatch):
  # The builtin corpus is the installed Python's text: another Python is another dataset.
  import sys

  from cem_jax.data import shard_writer, sources

  config = _config().data
  before = sources.source_identity(config)
  monkeypatch.setattr(sys, "version", sys.version + " (another build)")
  after = sources.source_identity(config)
  assert after != before
  assert shard_writer.fingerprint(config, after) != shard_writer.fingerprint(config, before)


def test_the_source_identity_of_each_kind_is_what_its_docstring_says(tmp_path):
  # Taken without reading the text: an unknown built-in name is refused here, not identified as
  # nothing; the split of local files is part of their identity.
  from cem_jax.data import sources

  path = _write(tmp_path / "a.txt", "alpha\n").resolve()
  assert sources.source_identity(_config(files=os.fspath(path), validation_fraction=0.25).data) == {
      "kind": "files", "validation_fraction": 0.25,
      "files": [{"path": os.fspath(path), "size": 6,
                 "sha256": hashlib.sha256(b"alpha\n").hexdigest()}]}
  catalog = _config(tfds_name="lm1b", tfds_data_dir="/d", tfds_text_key="body",
                    tfds_train_split="train[:9]", tfds_eval_split="test").data
  assert sources.source_identity(catalog) == {
      "kind": "tfds", "name": "lm1b", "data_dir": "/d", "text_key": "body",
      "train_split": "train[:9]", "eval_split": "test"}
  with pytest.raises(ValueError, match=r"^data\.builtin='nope' is not one of "):
    sources.source_identity(_config(builtin="nope").data)


def test_a_files_source_names_its_first_five_files(tmp_path):
  names = [f"{c}.txt" for c in "abcdef"]
  for name in names:
    _write(tmp_path / name, f"text of {name}\n" * 20)
  five = text_splits(_config(files=",".join(os.fspath(tmp_path / n) for n in names[:5])).data)
  assert five.source == "files: 5 (a.txt, b.txt, c.txt, d.txt, e.txt)"
  six = text_splits(_config(files=os.fspath(tmp_path / "*.txt")).data)
  assert six.source == "files: 6 (a.txt, b.txt, c.txt, d.txt, e.txt, ...)"


def test_file_decoding_normalises_bom_and_line_ends(tmp_path):
  path = tmp_path / "a.txt"
  path.write_bytes(codecs.BOM_UTF8 + "caf\u00e9\r\nline two\rthree\n".encode())
  assert read_documents([path]) == ["caf\u00e9\nline two\nthree\n"]


def _decoded(data: bytes) -> str | int:
  """The text of a file's bytes by the module docstring's rule, or the file offset of its first
  bad byte: the reference ``read_text`` is checked against."""
  bom = codecs.BOM_UTF8 if data.startswith(codecs.BOM_UTF8) else b""
  try:
    text = data[len(bom):].decode("utf-8")
  except UnicodeDecodeError as e:
    return len(bom) + e.start
  return text.replace("\r\n", "\n").replace("\r", "\n")


def test_file_text_read_a_block_at_a_time_equals_the_whole_file_decoded(tmp_path):
  # Blocks of 1..7 bytes cut every CRLF, multi-byte character and BOM somewhere.
  rng = np.random.default_rng(0)
  parts = [b"a", b" ", b"\n", b"\r", b"\r\n", "\u00e9".encode(), "\u20ac".encode(),
           "\U0001d11e".encode(), codecs.BOM_UTF8]
  bad = [b"\xff", b"\xe2\x82", b"\xc3(", b"\x80"]
  path = tmp_path / "t.txt"
  cases = [b"", codecs.BOM_UTF8, codecs.BOM_UTF8[:2], b"\r", b"\r\n\r"]
  for i in range(300):
    data = b"".join(parts[j] for j in rng.integers(0, len(parts), rng.integers(0, 40)))
    if i % 3 == 0:
      data = codecs.BOM_UTF8 + data
    if i % 4 == 1:
      at = int(rng.integers(0, len(data) + 1))
      data = data[:at] + bad[i % len(bad)] + data[at:]
    cases.append(data)
  for data in cases:
    path.write_bytes(data)
    want = _decoded(data)
    for block in (1, 2, 3, 4, 5, 7, None):
      if isinstance(want, str):
        pieces = list(text_lib.read_text(path, block_bytes=block))
        assert "".join(pieces) == want, (data, block)
        assert all(0 < len(t) <= max(block or text_lib.READ_BLOCK_BYTES, 3) for t in pieces)
      else:
        with pytest.raises(ValueError, match=rf"t\.txt: not UTF-8 text: byte 0x{data[want]:02x} "
                                             rf"at byte offset {want} \("):
          list(text_lib.read_text(path, block_bytes=block))


def test_file_text_changed_since_identified_or_during_its_read_is_an_error(tmp_path):
  path = _write(tmp_path / "a.txt", "one\ntwo\nthree\n")
  stamp = text_lib.file_stamp(path)
  changed = rf"^data\.files: {re.escape(str(path))} changed while its text was being read"
  reading = text_lib.read_text(path, stamp, block_bytes=4)
  assert next(reading) == "one\n"
  with path.open("a") as f:
    f.write("four\n")
  with pytest.raises(ValueError, match=changed):  # found at the next block, not at the end
    next(reading)
  with pytest.raises(ValueError, match=changed):  # found when opened: nothing is yielded
    next(text_lib.read_text(path, stamp))
  digest = hashlib.sha256()
  assert "".join(text_lib.read_text(path, text_lib.file_stamp(path), digest, 3)) == (
      "one\ntwo\nthree\nfour\n")
  assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
  # The same size and the old modification time set back (cp -p, then mv): still found.
  stamp, before = text_lib.file_stamp(path), path.stat()
  replacement = _write(tmp_path / "b.txt", "ONE\nTWO\nTHREE\nFOUR\n")
  os.utime(replacement, ns=(before.st_atime_ns, before.st_mtime_ns))
  os.replace(replacement, path)
  assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
  with pytest.raises(ValueError, match=changed):
    next(text_lib.read_text(path, stamp))
  if os.path.exists("/proc/cpuinfo"):  # a size of 0 on disk, text when read: not "changed"
    assert "".join(text_lib.read_text("/proc/cpuinfo"))


def test_file_errors(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match=r"glob '.*nothing\*\.txt' matches no file$"):
    resolve_files(f"{tmp_path}/nothing*.txt")
  monkeypatch.chdir(tmp_path)  # a relative glob names the folder it was looked for from
  with pytest.raises(ValueError) as e:
    resolve_files("../data/*.txt")
  assert str(e.value) == (f"data.files: glob '../data/*.txt' matches no file (relative to the "
                          f"working directory {tmp_path})")
  with pytest.raises(ValueError) as e:  # a folder: the files in it, not the folder
    resolve_files(f"{tmp_path}/")
  assert str(e.value) == (f"data.files: glob '{tmp_path}/' matches no file ('{tmp_path}/' is a "
                          f"folder; allowed: globs of files, e.g. '{tmp_path}/*.txt')")
  bad = tmp_path / "bad.txt"
  bad.write_bytes(codecs.BOM_UTF8 + b"hello\nwor\xffld\n")
  with pytest.raises(ValueError, match=r"bad\.txt: not UTF-8 .*byte 0xff at byte offset 12"):
    read_documents([bad])
  empty, blank = tmp_path / "empty.txt", _write(tmp_path / "blank.txt", " \n\t\n")
  empty.write_bytes(b"")
  with pytest.raises(ValueError, match=r"corpus is empty.*empty\.txt.*blank\.txt"):
    read_documents([empty, blank])
  # The same errors come out of the full pipeline, before anything is written.
  config = _config(files=os.fspath(bad))
  with pytest.raises(ValueError, match="offset 12"):
    build_data(config, tmp_path / "wd")
  assert not list((tmp_path / "wd").rglob("*.array_record*"))


def test_glob_order_and_dedup(tmp_path):
  for name in ("b.txt", "a.txt", "c.md"):
    _write(tmp_path / name, name)
  paths = resolve_files(f"{tmp_path}/*.md, {tmp_path}/*.txt,{tmp_path}/a.txt")
  assert [p.name for p in paths] == ["c.md", "a.txt", "b.txt"]


# ---- TFDS ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _probed_server():
  """A local server for the network probe that accepts connections and answers no handshake:
  yields ``(address, accepted)``, where ``accepted`` gets the server's end of each connection."""
  accepted, stop = queue.Queue(), threading.Event()
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)

    def serve():
      while not stop.is_set():
        try:
          accepted.put(server.accept()[0])
        except OSError:  # a timeout: look at stop again
          pass

    thread = threading.Thread(target=serve, name="probed-server")
    thread.start()
    try:
      yield server.getsockname(), accepted
    finally:
      stop.set()
      thread.join()
      while not accepted.empty():
        accepted.get().close()


def _new_threads(before: set) -> list[str]:
  return sorted(t.name for t in threading.enumerate()
                if t not in before and t.name != "probed-server")


def _closed_by_peer(conn: socket.socket) -> bool:
  """Whether the other end of ``conn`` has closed: reads to its end (EOF or a reset); False
  if it is still open 60 s on (never reached while the probe is waited for)."""
  conn.settimeout(60)
  try:
    while conn.recv(65536):
      pass
  except ConnectionResetError:
    return True
  except TimeoutError:
    return False
  return True


def test_tfds_catalog_offline_fails_fast(tmp_path, monkeypatch):
  # Without the probe, TFDS itself is asked for a dataset that is not prepared: it downloads,
  # and offline retries for minutes. The probe goes (only) to the local stand-in for the TFDS
  # host, which answers no handshake, and TFDS is never asked for anything.
  import tensorflow_datasets as tfds

  asked = []
  monkeypatch.setattr(tfds, "builder", lambda *a, **k: asked.append(a) or 1 / 0)
  before = set(threading.enumerate())
  with _probed_server() as (address, accepted):
    monkeypatch.setattr(tfds_catalog, "PROBE_ADDRESS", address)
    config = _config(tfds_name="tiny_shakespeare", tfds_data_dir=os.fspath(tmp_path / "tfds"))
    with pytest.raises(ConnectionError) as info:
      build_data(config, tmp_path / "wd")
    assert accepted.qsize() == 1 and asked == []
    assert _new_threads(before) == []  # nothing of the probe left to wake at the exit
  message = str(info.value)
  assert "\n" not in message
  assert "data.tfds_name='tiny_shakespeare' is not prepared in" in message
  assert f"no verified TLS connection to {address[0]}:{address[1]}" in message
  assert "no network" in message and "data.files" in message


def test_network_probe_gives_up_and_leaves_nothing_running(tmp_path, monkeypatch):
  # A server that answers no handshake, and no server: unreachable, and the probe's connection
  # is closed by the time the call returns.
  before = set(threading.enumerate())
  with _probed_server() as (address, accepted):
    assert not tfds_catalog.network_reachable(address, timeout=0.5)
    assert _closed_by_peer(accepted.get(timeout=60))
  assert not tfds_catalog.network_reachable(("127.0.0.1", closed_port()), timeout=0.5)
  assert _new_threads(before) == []
  # A probe that hangs, as a DNS lookup can (no socket timeout bounds one), here or in the
  # child Python the probe runs in: it is given up on and nothing of it is left running. In a
  # thread of this process, as it was, it outlived the call, and could wake while the
  # interpreter exited and abort it ("terminate called ...", "FATAL: exception not rethrown").
  release, pid_file = threading.Event(), tmp_path / "probe.pid"
  monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: release.wait(600) and [])
  monkeypatch.setattr(tfds_catalog, "_PROBE", "import os, sys, time; open(sys.argv[1] + "
                      "'.pid', 'w').write(str(os.getpid())); time.sleep(600)", raising=False)
  try:
    assert not tfds_catalog.network_reachable((os.fspath(tmp_path / "probe"), 443), timeout=0.5)
    assert _new_threads(before) == []
    with pytest.raises(ProcessLookupError):  # killed, and reaped
      os.kill(int(pid_file.read_text()), 0)
  finally:
    release.set()


def test_tfds_catalog_reads_a_prepared_dataset_offline(tmp_path, monkeypatch):
  monkeypatch.setattr(tfds_catalog, "PROBE_ADDRESS", ("127.0.0.1", closed_port()))
  train = [_corpus_text(100, "t"), "second\r\ndoc\n"]
  validation = [_corpus_text(20, "v")]
  name = fake_catalog(tmp_path / "tfds", train, validation)
  config = _config(tfds_name=name, tfds_data_dir=os.fspath(tmp_path / "tfds"))
  splits = text_splits(config.data)
  assert (list(splits.train), list(splits.validation)) == (
      [train[0], "second\ndoc\n"], validation)
  assert list(splits.train) == list(splits.train)  # re-iterable
  assert splits.source.startswith(f"tfds:{name}")
  assert splits.characters is None  # unknown without a pass over the catalog
  config.data.tfds_text_key = "body"
  with pytest.raises(ValueError, match=r"data\.tfds_text_key='body' is not a feature"):
    text_splits(config.data)
  config.data.tfds_text_key = "text"
  config.data.tfds_eval_split = "test"
  with pytest.raises(ValueError, match=r"data\.tfds_eval_split='test': no such split"):
    text_splits(config.data)
  with pytest.raises(ValueError, match="set only one"):
    text_splits(_config(tfds_name=name, files="x.txt").data)


def test_catalog_texts_read_the_configured_feature():
  source = [{"text": "not this", "body": b"first\r\nline\n"}, {"text": "nor this", "body": "x"}]
  assert list(tfds_catalog.CatalogTexts(source, "body")) == ["first\nline\n", "x"]
  # A BOM is kept: only local files drop theirs (text.py), and prepared catalog data have it.
  assert list(tfds_catalog.CatalogTexts([{"text": "\ufeffa\r\n"}], "text")) == ["\ufeffa\n"]


def test_prepared_dir_is_the_newest_prepared_version(tmp_path):
  for version in ("1.0.0", "1.10.0", "1.2.0", "2.0.0"):
    (tmp_path / "ds" / version).mkdir(parents=True)
    if version != "2.0.0":  # not prepared: no dataset_info.json
      (tmp_path / "ds" / version / "dataset_info.json").write_text("{}")
  assert tfds_catalog.prepared_dir("ds", tmp_path) == tmp_path / "ds" / "1.10.0"
  assert tfds_catalog.prepared_dir("ds:1.0.0", tmp_path) == tmp_path / "ds" / "1.0.0"


def test_prepared_dir_takes_only_a_prepared_version_of_one_config(tmp_path):
  def prepared(*parts):
    (tmp_path.joinpath(*parts)).mkdir(parents=True)
    (tmp_path.joinpath(*parts) / "dataset_info.json").write_text("{}")

  prepared("ds", "cfg", "1.0.0")
  prepared("ds", "cfg", "3.0")  # not a version (x.y.z): never taken
  (tmp_path / "ds" / "cfg" / "2.0.0").mkdir()  # not prepared
  assert tfds_catalog.prepared_dir("ds", tmp_path) == tmp_path / "ds" / "cfg" / "1.0.0"
  assert tfds_catalog.prepared_dir("ds/cfg:2.0.0", tmp_path) is None
  assert tfds_catalog.prepared_dir("ds/cfg:1.0.0", tmp_path) == tmp_path / "ds" / "cfg" / "1.0.0"
  # A second prepared config: 'ds' names neither of them.
  prepared("ds", "other", "1.0.0")
  assert tfds_catalog.prepared_dir("ds", tmp_path) is None
  assert tfds_catalog.prepared_dir("ds/other", tmp_path) == tmp_path / "ds" / "other" / "1.0.0"


def test_tfds_catalog_splits_and_formats_are_checked_before_reading(tmp_path, monkeypatch):
  monkeypatch.setattr(tfds_catalog, "PROBE_ADDRESS", ("127.0.0.1", closed_port()))
  data_dir = tmp_path / "tfds"
  name = fake_catalog(data_dir, ["t0", "t1", "t2", "t3"], ["v0"])
  config = _config(tfds_name=name, tfds_data_dir=os.fspath(data_dir))
  config.data.tfds_train_split = "train[:50%]+validation"
  assert list(text_splits(config.data).train) == ["t0", "t1", "v0"]
  config.data.tfds_train_split = "tarin"  # the train split's errors name its own field
  with pytest.raises(ValueError, match=r"^data\.tfds_train_split='tarin': no such split of "):
    text_splits(config.data)
  config.data.tfds_train_split = "train"
  for split, pattern in [
      ("test", r"data\.tfds_eval_split='test': no such split of '.*'; it has "
               r"\['train', 'validation'\]"),
      ("train+tset", r"data\.tfds_eval_split='train\+tset': no such split of '.*'; it has "),
      # Every name of the spec is checked, not only the first (a slice is not a name).
      ("validation[:1]+tset", r"data\.tfds_eval_split='validation\[:1\]\+tset': no such split "
                              r"of '.*'; it has "),
      # Known names, but a slice TFDS refuses: its syntax, or more examples than there are.
      ("validation[:5x]", r"data\.tfds_eval_split='validation\[:5x\]' is not a valid split of "
                          r"'.*': \S"),
      ("validation[:10]", r"data\.tfds_eval_split='validation\[:10\]' is not a valid split of "
                          r"'.*': \S"),
      # Found only when the source is sized, or refused by TFDS as not implemented.
      ("validation[5:2]", r"data\.tfds_eval_split='validation\[5:2\]' is not a valid split of "
                          r"'.*': \S"),
      ("all[:50%]", r"data\.tfds_eval_split='all\[:50%\]' is not a valid split of '.*': \S"),
  ]:
    config.data.tfds_eval_split = split
    with pytest.raises(ValueError, match=f"^{pattern}") as e:
      text_splits(config.data)
    assert "\n" not in str(e.value)
  config.data.tfds_eval_split = "validation"
  # Prepared in a format without random access (TFRecord needs TensorFlow to write, so the
  # dataset's info says it).
  (info_file,) = data_dir.rglob("dataset_info.json")
  info = json.loads(info_file.read_text())
  info_file.write_text(json.dumps({**info, "fileFormat": "tfrecord"}))
  with pytest.raises(ValueError, match=rf"^data\.tfds_name='{name}' is prepared in .* as "
                                       r"\['tfrecord'\]; reading it needs array_record"):
    text_splits(config.data)
  # Not a catalog dataset, though a folder of that name looks prepared.
  (data_dir / "no_such_dataset" / "1.0.0").mkdir(parents=True)
  (data_dir / "no_such_dataset" / "1.0.0" / "dataset_info.json").write_text("{}")
  config.data.tfds_name = "no_such_dataset"
  with pytest.raises(ValueError, match=r"^data\.tfds_name='no_such_dataset' is not a TFDS "
                                       r"catalog dataset known here"):
    text_splits(config.data)


# ---- tokenizer ---------------------------------------------------------------------------------


@needs_shared
@pytest.mark.parametrize("name", SHARED_FILES)
def test_tokenizer_exact_round_trip_on_shared_files(name):
  (doc,) = read_documents(resolve_files(os.fspath(SHARED_DATA / name)))
  train, _ = split_documents([doc], 0.1)
  tok = tokenizer_lib.Tokenizer(tokenizer_lib.train_model(train, 1024))
  assert tok.vocab_size == 1024
  ids = np.concatenate(packing.encode_documents(tok, [doc]))
  assert tok.decode(ids) == doc
  assert int(tok.token_bytes[ids].sum()) == len(doc.encode("utf-8"))
  if name == "warpeace.txt":
    raw = (SHARED_DATA / name).read_bytes()
    assert raw.startswith(codecs.BOM_UTF8) and b"\r\n" in raw
    assert "\r" not in doc and "\ufeff" not in doc
    assert doc == raw[3:].decode("utf-8").replace("\r\n", "\n")
    head = doc[:3000] + doc[107_000:108_000] + " caf\u00e9 \u2606 \u30ce \u03c9 \u2014 \u2581!"
    assert any(ord(c) > 127 for c in head)
    head_ids = tok.encode(head)
    assert tok.decode(head_ids) == head
    assert int(tok.token_bytes[head_ids].sum()) == len(head.encode("utf-8"))


def test_tokenizer_round_trips_awkward_text(pydoc_tokenizer):
  tok = pydoc_tokenizer
  text = "a \u2581 b\x00c\x01\U0001f600 \t\n\n\n  \u2581\u2581x\u00a0y\u200bz \n"
  assert tok.decode(tok.encode(text)) == text
  assert int(tok.token_bytes[tok.encode(text)].sum()) == len(text.encode("utf-8"))
  assert tok.token_bytes[tok.eos_id] == 0 and tok.token_bytes[tok.pad_id] == 0
  assert tok.token_bytes.dtype == np.int32 and tok.token_bytes.shape == (tok.vocab_size,)
  assert tok.token_bytes[tok.encode("\u00e9")].tolist() in ([1, 1], [2])
  assert (tok.pad_id, tok.eos_id) == (0, 1)


def test_encode_batch_encodes_a_literal_meta_space_as_encode_does(pydoc_tokenizer):
  # The in-memory reference encodes training text in batches, the prepared path one piece at a
  # time: both must give a literal '\u2581' its three byte pieces.
  tok = pydoc_tokenizer
  texts = ["a \u2581 b\n", "plain text\n", "\u2581\u2581x", ""]
  batch = tok.encode_batch(texts)
  assert [list(ids) for ids in batch] == [list(tok.encode(t)) for t in texts]
  assert tok.decode(batch[0]) == texts[0]


def test_encode_batch_runs_one_thread_per_usable_cpu(pydoc_tokenizer, monkeypatch):
  # SentencePiece's own count (num_threads=-1) is the host's CPUs, ignoring a container's quota.
  seen = []
  real = spm.SentencePieceProcessor.encode
  monkeypatch.setattr(spm.SentencePieceProcessor, "encode",
                      lambda self, *a, **kw: seen.append(kw.get("num_threads")) or
                      real(self, *a, **kw))
  monkeypatch.setattr(tokenizer_lib.cpus, "usable", lambda: 3)
  texts = ["plain text\n", "more text", ""]
  assert pydoc_tokenizer.encode_batch(texts) == [pydoc_tokenizer.encode(t) for t in texts]
  assert seen[0] == 3


def test_a_tokenizer_without_a_pad_piece_pads_with_eos():
  writer = io.BytesIO()  # SentencePiece's default ids: unk 0, bos 1, eos 2, no pad
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(["hello world\n"] * 3), model_writer=writer, vocab_size=40,
      hard_vocab_limit=False, minloglevel=2)
  tok = tokenizer_lib.Tokenizer(writer.getvalue())
  assert (tok.eos_id, tok.pad_id) == (2, 2)


def test_the_tokenizer_is_trained_on_one_thread(monkeypatch):
  # SentencePiece's model depends on its thread count: one thread, the same model everywhere.
  seen = {}
  real = tokenizer_lib.spm.SentencePieceTrainer.train
  monkeypatch.setattr(tokenizer_lib.spm.SentencePieceTrainer, "train",
                      lambda **kwargs: seen.update(kwargs) or real(**kwargs))
  tokenizer_lib.train_model(["hello world\n"] * 3, 268)
  assert seen["num_threads"] == 1


def test_tokenizer_training_is_deterministic():
  train, _ = split_documents(builtin.pydoc_topics(), 0.1)
  assert tokenizer_lib.train_model(train, 512) == tokenizer_lib.train_model(train, 512)
  assert tokenizer_lib.train_model(train, 600) != tokenizer_lib.train_model(train, 512)


def test_tokenizer_training_chunks_end_after_the_last_newline_or_space(monkeypatch):
  monkeypatch.setattr(tokenizer_lib, "TRAIN_CHUNK_CHARS", 10)
  docs = ["ab\ncd\nefgh\nij", "aaa bbb ccc ddd", "abcdefghijkl"]
  assert list(tokenizer_lib._chunks(docs)) == [
      "ab\ncd\n", "efgh\nij",  # after the last newline of the first 10 characters
      "aaa bbb ", "ccc ddd",  # no newline: after the last space
      "abcdefghij", "kl"]  # neither: at 10 characters


def test_tokenizer_training_sample_is_every_kth_chunk_up_to_the_limit(monkeypatch):
  # 9 documents of one 10-character chunk, 25 characters allowed: every ceil(90 / 25) = 4th.
  monkeypatch.setattr(tokenizer_lib, "TRAIN_CHUNK_CHARS", 10)
  monkeypatch.setattr(tokenizer_lib, "MAX_TRAIN_CHARS", 25)
  docs = [f"document{i}\n" for i in range(9)]
  assert tokenizer_lib._training_chunks(docs) == [docs[0], docs[4], docs[8]]
  assert tokenizer_lib._training_chunks(docs[:2]) == docs[:2]  # under the limit: all of it


def test_tokenizer_trains_on_chunks_of_multibyte_text():
  # ~2,000-character chunks of Cyrillic are ~3,700 UTF-8 bytes: none may be skipped as too
  # long, or the tokenizer learns no word of the text.
  words = "привет мир язык модель текст слово".split()
  text = "".join(" ".join(words[(i * j) % 6] for j in range(1, 8)) + "\n" for i in range(300))
  tok = tokenizer_lib.Tokenizer(tokenizer_lib.train_model([text], 330))
  assert len(tok.encode("привет мир")) <= 3
  assert tok.decode(tok.encode(text)) == text


def test_tokenizer_errors(tmp_path):
  with pytest.raises(ValueError, match=r"data\.vocab_size=5000 is too large.*maximum allowed is "
                                       r"\d+$"):
    tokenizer_lib.train_model(["hello world, a tiny corpus.\nsecond line\n"] * 3, 5000)
  with pytest.raises(ValueError, match=r"data\.vocab_size=100 is too small.*minimum"):
    tokenizer_lib.train_model(["hello world\n"], 100)
  with pytest.raises(ValueError, match="data.tokenizer_model_type='wordpiece'"):
    tokenizer_lib.train_model(["hello world\n"], 300, "wordpiece")
  missing = tmp_path / "nope.model"
  with pytest.raises(FileNotFoundError, match=r"data\.tokenizer='.*nope\.model': no such file"):
    build_data(_config(tokenizer=os.fspath(missing)), tmp_path / "wd")
  # A folder is there, but is not a model file: "no such file" would send the user looking.
  with pytest.raises(ValueError) as info:
    build_data(_config(tokenizer=os.fspath(tmp_path)), tmp_path / "wd")
  assert str(info.value) == (f"data.tokenizer={os.fspath(tmp_path)!r} is a folder; give a "
                             "SentencePiece .model file, or data.tokenizer='' to train one")


def test_tokenizer_vocab_too_small_is_found_before_training(monkeypatch):
  # Tab, NUL, CR/LF at a chunk's end, '<s>' and '<0x41>' (piece names), ' ' and '\u2581' (one
  # character to SentencePiece), and a chunk with U+2585 (skipped): each is counted as
  # SentencePiece counts it, so the minimum is exact.
  docs = ["a\tb\x00c d\u2581e <s> f<0x41>\r\n", "g\u2585h\n", "\n\n"]
  tok = tokenizer_lib.Tokenizer(tokenizer_lib.train_model(docs, 268))
  assert tok.vocab_size == 268  # 4 special + 256 bytes + a b c d e f \t \u2581

  def train_not_called(**kwargs):
    raise AssertionError("SentencePiece was called")

  monkeypatch.setattr(tokenizer_lib.spm.SentencePieceTrainer, "train", train_not_called)
  with pytest.raises(ValueError, match=r"^data\.vocab_size=267 is too small: the minimum allowed "
                                       r"is 268 \(4 special"):
    tokenizer_lib.train_model(docs, 267)


def test_tokenizer_errors_do_not_depend_on_sentencepiece_wording(monkeypatch):
  real_train = tokenizer_lib.spm.SentencePieceTrainer.train

  def reworded(**kwargs):
    try:
      return real_train(**kwargs)
    except RuntimeError:
      raise RuntimeError("some other wording\nover two lines") from None

  monkeypatch.setattr(tokenizer_lib.spm.SentencePieceTrainer, "train", reworded)
  docs = ["hello world, a tiny corpus.\nsecond line\n"] * 3
  with pytest.raises(ValueError, match=r"^data\.vocab_size=5000 is too large for this training "
                                       r"text \(120 characters, bpe\): the maximum allowed is "
                                       r"(\d+)$") as e:
    tokenizer_lib.train_model(docs, 5000)
  most = int(e.value.args[0].rsplit(" ", 1)[1])
  assert tokenizer_lib.Tokenizer(tokenizer_lib.train_model(docs, most)).vocab_size == most
  # A failure that is not about the vocabulary's size (the trainer fails whatever the limit):
  # one line, SentencePiece's message as it is.
  def failing(**kwargs):
    raise RuntimeError("some other wording\nover two lines")

  monkeypatch.setattr(tokenizer_lib.spm.SentencePieceTrainer, "train", failing)
  with pytest.raises(ValueError, match=r"^data\.vocab_size=300, data\.tokenizer_model_type="
                                       r"'unigram': SentencePiece cannot train on this text "
                                       r"\(120 characters\): some other wording over two lines$"):
    tokenizer_lib.train_model(docs, 300, "unigram")
  # Every chunk holds U+2585, which SentencePiece skips: said before it is called.
  with pytest.raises(ValueError, match=r"^every tokenizer training chunk of the text holds "
                                       r"U\+2585"):
    tokenizer_lib.train_model(["a \u2585 b\n", "\u2585\u2585\n"], 300, "unigram")


def test_given_tokenizer_is_used_and_checked(tmp_path):
  data = build_data(_config(), tmp_path / "wd")
  path = os.fspath(data.tokenizer.path)
  assert data.tokenizer.path.parent.parent == tmp_path / "wd" / "data"
  again = build_data(_config(tokenizer=path), tmp_path / "other")
  assert np.array_equal(again.train.batch(3)["inputs"], data.train.batch(3)["inputs"])
  assert again.tokenizer.path.read_bytes() == data.tokenizer.path.read_bytes()
  with pytest.raises(ValueError, match=r"has 512 pieces but data\.vocab_size=1024"):
    build_data(_config(tokenizer=path, vocab_size=1024), tmp_path / "other")


def test_a_given_tokenizer_without_eos_is_refused(tmp_path):
  # Documents are separated by EOS: a model without one (eos_id -1) would write id -1.
  writer = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(["hello world\n"] * 3), model_writer=writer, vocab_size=268,
      hard_vocab_limit=False, minloglevel=2, **{**tokenizer_lib.TRAINER_SETTINGS, "eos_id": -1})
  path = tmp_path / "no_eos.model"
  path.write_bytes(writer.getvalue())
  size = spm.SentencePieceProcessor(model_file=os.fspath(path)).get_piece_size()
  with pytest.raises(ValueError, match=r"no_eos\.model' has no EOS piece \(eos_id=-1\)$"):
    tokenizer_lib.load_tokenizer(path, size)


def test_an_empty_model_is_not_a_tokenizer():
  # SentencePiece reads no bytes as no model: 0 pieces, every id 0, a C++ log line each.
  with pytest.raises(RuntimeError, match=r"^an empty model \(0 bytes\)$"):
    tokenizer_lib.Tokenizer(b"")


# ---- packing -------------------------------------------------------------------------------


EOS, PAD = 1, 0


def _distinct_docs(lengths):
  # Document k holds ids 1000 * (k + 1) + j: each id names its document.
  return [np.arange(n, dtype=np.int32) + 1000 * (k + 1) for k, n in enumerate(lengths)]


@pytest.mark.parametrize("keep_tail", [False, True])
def test_no_weighted_target_crosses_a_document_boundary(keep_tail):
  lengths = [5, 1, 12, 3, 30, 2, 7, 9]
  windows = pack(_distinct_docs(lengths), 7, EOS, PAD, keep_tail=keep_tail, split="test")
  assert windows.tokens.shape[1] == 8 and windows.tokens.dtype == np.int32
  batch = make_batch(windows.tokens, windows.segment_ids)
  inputs, targets, weights = batch["inputs"], batch["targets"], batch["weights"]
  assert batch["segment_ids"].dtype == np.int32 and weights.dtype == np.float32

  def doc_of(t):
    return t // 1000  # EOS and PAD map to 0
  # Independent rule: weighted iff the input is a document token and the target continues
  # that document or is the EOS that ends it.
  expected = (doc_of(inputs) > 0) & (
      (doc_of(targets) == doc_of(inputs)) | (targets == EOS))
  assert np.array_equal(weights.astype(bool), expected)
  # Every pair inside a document that lies in one window is weighted.
  flat = windows.tokens.reshape(-1)
  total = sum(lengths) + len(lengths)
  assert np.array_equal(flat[: min(total, flat.size)],
                        np.concatenate([np.append(d, EOS) for d in _distinct_docs(lengths)])
                        [: flat.size])
  if keep_tail:
    assert windows.tokens.size >= total and (flat[total:] == PAD).all()
    assert (windows.segment_ids.reshape(-1)[total:] == 0).all()
    # A document of n tokens has n weighted pairs, less those cut by a window boundary.
    starts = np.cumsum([0] + [n + 1 for n in lengths[:-1]])
    assert weights.sum() == sum(
        1 for s, n in zip(starts, lengths, strict=True) for p in range(s, s + n)
        if (p + 1) % 8)
  seg = windows.segment_ids
  assert (seg[:, 0] == 1).all() and (np.diff(seg, axis=1)[seg[:, 1:] > 0] >= 0).all()


def test_packed_real_documents_have_eos_between_them(pydoc_tokenizer):
  tok = pydoc_tokenizer
  docs = ["First document.\n", "Second, with caf\u00e9.\n", "Third\n\n"] * 5
  ids = packing.encode_documents(tok, docs)
  windows = pack(ids, 16, tok.eos_id, tok.pad_id, keep_tail=True, split="validation")
  flat = windows.tokens.reshape(-1)
  seg_flat = windows.segment_ids.reshape(-1)
  eos_positions = np.flatnonzero(flat == tok.eos_id)
  assert len(eos_positions) == len(docs)
  assert eos_positions.tolist() == (np.cumsum([len(i) + 1 for i in ids]) - 1).tolist()
  text = "".join(tok.decode(flat[a + 1 : b]) for a, b in
                 zip(np.r_[-1, eos_positions[:-1]], eos_positions, strict=True))
  assert text == "".join(docs)
  batch = make_batch(windows.tokens, windows.segment_ids)
  # A target right after an EOS starts a new document: never weighted.
  assert (batch["weights"][batch["inputs"] == tok.eos_id] == 0).all()
  assert (batch["weights"][batch["targets"] == tok.eos_id] == 1).all()
  assert seg_flat.max() >= 2


def test_a_batch_numbers_each_input_by_the_document_it_is_in():
  # The document mask reads the batch's segment_ids: an EOS input is in the document it ends,
  # so the next document never attends to it; padding is segment 0.
  windows = pack(_distinct_docs([2, 3]), 7, EOS, PAD, keep_tail=True, split="validation")
  assert windows.tokens.tolist() == [[1000, 1001, EOS, 2000, 2001, 2002, EOS, PAD]]
  batch = make_batch(windows.tokens, windows.segment_ids)
  assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2, 2]]
  assert batch["weights"].tolist() == [[1, 1, 0, 1, 1, 1, 0]]


def test_target_bytes_are_the_bytes_of_each_target():
  lengths = [3, 5, 2]
  docs = _distinct_docs(lengths)
  doc_bytes = [np.arange(n, dtype=np.int32) % 4 + 1 for n in lengths]  # 1 to 4 bytes a token
  windows = pack(docs, 4, EOS, PAD, keep_tail=True, split="validation", doc_bytes=doc_bytes)
  batch = make_batch(windows.tokens, windows.segment_ids, windows.nbytes)
  of_id = {int(i): int(b) for ids, nb in zip(docs, doc_bytes, strict=True)
           for i, b in zip(ids, nb, strict=True)}  # EOS and PAD: 0 bytes
  want = np.vectorize(lambda t: of_id.get(int(t), 0))(batch["targets"])
  assert batch["target_bytes"].dtype == np.float32
  assert np.array_equal(batch["target_bytes"], want)


def test_a_train_split_of_whole_windows_keeps_its_last_window():
  assert packing.count_windows(10, 4, keep_tail=False, split="train") == 2
  windows = pack(_distinct_docs([4, 4]), 4, EOS, PAD, keep_tail=False, split="train")
  assert windows.tokens.tolist() == [[1000, 1001, 1002, 1003, EOS], [2000, 2001, 2002, 2003, EOS]]
  # Kept tail or not, whole windows get no window of padding after them (nothing to predict).
  assert packing.count_windows(10, 4, keep_tail=True, split="validation") == 2
  kept = pack(_distinct_docs([4, 4]), 4, EOS, PAD, keep_tail=True, split="validation")
  assert kept.tokens.tolist() == windows.tokens.tolist()
  assert packing.count_windows(11, 4, keep_tail=True, split="validation") == 3  # 1 token more


def test_seq_len_longer_than_the_data(tmp_path):
  with pytest.raises(ValueError, match=r"data\.seq_len=50 is too long for the train split: "
                                       r"it has 13 tokens"):
    pack(_distinct_docs([5, 6]), 50, EOS, PAD, keep_tail=False, split="train")
  short = pack(_distinct_docs([5, 6]), 50, EOS, PAD, keep_tail=True, split="validation")
  assert short.num_windows == 1
  small = _write(tmp_path / "small.txt", _corpus_text(20))
  with pytest.raises(ValueError, match=r"data\.seq_len=2000 is too long for the train split: "
                                       r"it has \d+ tokens"):
    build_data(_config(files=os.fspath(small), seq_len=2000, vocab_size=300), tmp_path / "wd")


def test_a_window_length_is_refused_as_the_config_refuses_it():
  # seq_len 0 would make windows of one token: no input/target pair in any of them. Packing
  # names data.seq_len, so it holds that field's rule (config.check_int), 1 refused too.
  for keep_tail in (False, True):
    for seq_len in (0, 1, 4.0):
      with pytest.raises(ValueError) as e:
        packing.count_windows(10, seq_len, keep_tail=keep_tail, split="train")
      assert str(e.value) == f"data.seq_len={seq_len}; allowed: an int >= 2"
    assert packing.count_windows(10, 2, keep_tail=keep_tail, split="train") == 3 + keep_tail


# ---- batches -------------------------------------------------------------------------------


def _numbered_windows(n: int, seq_len: int = 4) -> Windows:
  # Window i is filled with id i + 2 (one document per window), so rows name their window.
  tokens = np.repeat(np.arange(n, dtype=np.int32)[:, None] + 2, seq_len + 1, axis=1)
  return Windows(tokens=tokens, segment_ids=np.ones_like(tokens))


def test_train_batches_are_a_pure_function_of_step():
  windows = _numbered_windows(50)
  a, b = TrainBatches(windows, 8, shuffle_seed=3), TrainBatches(windows, 8, shuffle_seed=3)
  for step in (0, 7, 123, 5):
    x, y = a.batch(step), b.batch(step)
    assert x.keys() == {"inputs", "targets", "segment_ids", "weights"}
    for key in x:
      assert np.array_equal(x[key], y[key]) and np.array_equal(x[key], a.batch(step)[key])
    assert x["inputs"].shape == (8, 4) and x["weights"].dtype == np.float32
  assert not np.array_equal(a.batch(0)["inputs"], TrainBatches(windows, 8, 4).batch(0)["inputs"])


def test_train_batches_split_across_processes():
  batches = TrainBatches(_numbered_windows(50), 12, shuffle_seed=0)
  for step in (0, 4, 9):
    whole = batches.batch(step)
    for count in (2, 3, 4):
      parts = [batches.batch(step, i, count) for i in range(count)]
      for key in whole:
        assert np.array_equal(np.concatenate([p[key] for p in parts]), whole[key])
  with pytest.raises(ValueError, match=r"^train\.batch_size=12 is not divisible by the process "
                                       r"count 5; allowed: a multiple of 5$"):
    batches.batch(0, 0, 5)


def test_batches_refuse_bad_arguments_naming_them():
  windows = _numbered_windows(10)
  for kwargs, message in (({"batch_size": 0, "shuffle_seed": 0},
                           "train.batch_size=0; allowed: an int >= 1"),
                          ({"batch_size": 2.0, "shuffle_seed": 0},
                           "train.batch_size=2.0; allowed: an int >= 1"),
                          ({"batch_size": 2, "shuffle_seed": -1},
                           "data.shuffle_seed=-1; allowed: an int >= 0 and < 2**63"),
                          ({"batch_size": 2, "shuffle_seed": 2**63},
                           f"data.shuffle_seed={2**63}; allowed: an int >= 0 and < 2**63")):
    with pytest.raises(ValueError) as e:
      TrainBatches(windows, **kwargs)
    assert str(e.value) == message
  batches = TrainBatches(windows, 4, shuffle_seed=0)
  with pytest.raises(ValueError) as e:
    batches.window_indices(-1)  # would read epoch -1
  assert str(e.value) == "step=-1; allowed: an int >= 0"
  for index, count in ((2, 2), (-1, 2), (0, 0)):
    with pytest.raises(ValueError) as e:
      batches.window_indices(0, index, count)
    assert str(e.value) == f"process_index={index} must be in [0, {count})"
  docs = _distinct_docs([6, 6])
  evals = EvalWindows(pack(docs, 4, EOS, PAD, keep_tail=True, split="validation",
                           doc_bytes=[np.ones_like(d) for d in docs]), PAD)
  with pytest.raises(ValueError) as e:
    next(evals.batches(5, 0, 2))  # two processes cannot share 5 rows equally
  assert str(e.value) == ("eval.batch_size=5 is not divisible by the process count 2; allowed: "
                          "a multiple of 2")
  with pytest.raises(ValueError) as e:
    next(evals.batches(0))
  assert str(e.value) == "eval.batch_size=0; allowed: an int >= 1"


def test_eval_padding_rows_hold_the_pad_id_and_no_weight_or_bytes():
  pad = 3  # not 0, so a row of zeros is not taken for padding
  docs = _distinct_docs([5, 9])  # 16 tokens with EOS: 4 windows of 5
  windows = pack(docs, 4, EOS, pad, keep_tail=True, split="validation",
                 doc_bytes=[np.full_like(d, 2) for d in docs])
  (batch,) = EvalWindows(windows, pad).batches(8)
  n = windows.num_windows
  assert n == 4
  for key in ("inputs", "targets"):
    assert (batch[key][n:] == pad).all()
  for key in ("segment_ids", "weights", "target_bytes"):
    assert (batch[key][n:] == 0).all(), key
  # 14 document tokens at 2 bytes, less the two that open a window (flat positions 0 and 10)
  assert batch["target_bytes"][:n].sum() == 2 * (14 - 2)


def test_every_window_once_per_epoch():
  n, batch = 50, 8
  batches = TrainBatches(_numbered_windows(n), batch, shuffle_seed=1)
  seen = np.concatenate([batches.batch(s)["inputs"][:, 0] - 2 for s in range(0, 19)])
  epochs = [seen[e * n : (e + 1) * n] for e in range(3)]
  for order in epochs[:3]:
    assert sorted(order.tolist()) == list(range(n))
  assert not np.array_equal(epochs[0], epochs[1])
  assert not np.array_equal(epochs[0], np.arange(n))


@pytest.mark.parametrize("n", [1, 2, 3, 50, 1000, 2**16, 2**16 + 1])
def test_each_epoch_is_a_permutation_of_the_windows(n):
  # 2**16 + 1 windows: grain's index_shuffle alone never draws the last one (its cipher block
  # is one bit short when max_index is an even power of two >= 2**16) and draws another twice.
  sizes = types.SimpleNamespace(num_windows=n, seq_len=4)
  batches = TrainBatches(sizes, n, shuffle_seed=5)  # one step = one epoch
  first, second = batches.window_indices(0), batches.window_indices(1)
  for order in (first, second):
    assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(n))
  if n >= 50:
    assert not np.array_equal(first, second)
    # far from the identity: position and window are about uncorrelated
    assert abs(np.corrcoef(np.arange(n), first)[0, 1]) < 0.3


def test_the_shuffle_is_keyed_by_seed_and_epoch_apart():
  # grain keys epoch e of seed s with s + e; ours must not make seed 1's first epoch seed 0's
  # second (two seeds of a table would share most of their data order).
  n = 200
  order = {(s, e): shuffled_positions(np.arange(n), n, s, e) for s in (0, 1) for e in (0, 1)}
  keys = list(order)
  for i, a in enumerate(keys):
    for b in keys[i + 1:]:
      assert np.mean(order[a] == order[b]) < 0.1, (a, b)
  # only the positions asked for are computed; any shape is kept
  some = np.array([[3, 7], [199, 0]])
  assert np.array_equal(shuffled_positions(some, n, 1, 1), order[(1, 1)][some])


def test_neighbouring_rows_are_independent_and_the_order_is_pinned():
  # grain's default of 4 rounds gives rows 2k and 2k + 1 bits that always, or never, agree
  # (flip probability 0 or 1); at 6 some still flip with 0.33. A fair order flips each with 1/2.
  n = 2**20 - 5
  pos = np.arange(0, 8000, 2)
  a, b = shuffled_positions(pos, n, 0, 0), shuffled_positions(pos + 1, n, 0, 0)
  flips = [np.mean((a >> bit & 1) != (b >> bit & 1)) for bit in range(20)]
  assert 0.44 < min(flips) and max(flips) < 0.56, np.round(flips, 3)
  # The order is part of the numerics (cem_jax/version.py): a change of grain, of its rounds or
  # of the seed derivation fails here, not silently mid-run.
  assert shuffled_positions(np.arange(8), 1000, 0, 0).tolist() == [
      587, 804, 824, 669, 426, 718, 961, 3]
  assert shuffled_positions(np.arange(4), 2**16 + 1, 3, 2).tolist() == [
      18760, 59949, 20832, 48690]
  assert shuffled_positions(np.array([0, 10**8 - 1]), 10**8, 7, 0).tolist() == [
      84370068, 65067752]


def test_without_grain_training_fails_at_start_up_and_the_data_still_builds(monkeypatch,
                                                                          tmp_path):
  # The offline GPU image has no grain: training fails before it prepares or compiles
  # anything, not at the first batch; building the data (evaluate, sample) needs no grain.
  import sys

  from conftest import tiny_config

  from cem_jax import train
  for name in ("grain", "grain.experimental"):
    monkeypatch.setitem(sys.modules, name, None)
  batches = TrainBatches(_numbered_windows(5), 2, shuffle_seed=0)
  with pytest.raises(ModuleNotFoundError, match=r"^grain cannot be imported \(.*\): the "
                                                r"training order is grain\.experimental\."
                                                r"index_shuffle; pip install 'grain>=0\.2\.18'"):
    train.train_and_evaluate(tiny_config("llama"), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()
  with pytest.raises(ModuleNotFoundError):  # only its first batch would have said so
    batches.batch(0)


def test_the_eval_subset_is_spread_over_the_split():
  lengths = [4] * 40  # 40 one-window documents of 5 tokens (EOS included) -> window i = doc i
  docs = _distinct_docs(lengths)
  windows = pack(docs, 4, EOS, PAD, keep_tail=True, split="validation",
                 doc_bytes=[np.ones_like(d) for d in docs])
  evals = EvalWindows(windows, PAD)
  n = windows.num_windows
  first_tokens = {int(windows.tokens[i, 0]): i for i in range(n)}
  assert len(first_tokens) == n  # every window is named by its first token

  def read(batch_size, count, max_batches):
    got = []
    for parts in zip(*(evals.batches(batch_size, i, count, max_batches) for i in range(count)),
                     strict=True):
      got += [first_tokens[int(t)] for p in parts
              for t, seg in zip(p["inputs"][:, 0], p["segment_ids"][:, 0], strict=True) if seg]
    return got

  for batch_size, count, max_batches in ((4, 1, 3), (6, 2, 2), (5, 1, 1)):
    total = batch_size * max_batches
    want = [i * n // total for i in range(total)]
    assert read(batch_size, count, max_batches) == want
    assert want[-1] >= n - n // total - 1  # reaches the end of the split
  whole = list(range(n))
  assert read(4, 2, -1)[:n] == whole and read(4, 1, 100)[:n] == whole
  for bad in (0, -2, 2.5, True):  # config.validate's rule for the field
    with pytest.raises(ValueError, match=rf"^eval.max_batches={bad}; allowed: -1 \(the whole "
                                         r"split\) or an int >= 1$"):
      next(evals.batches(4, 0, 1, bad))


def test_eval_padding_keeps_total_weight():
  lengths = [5, 1, 12, 3, 30, 2, 7, 9, 20]
  docs = _distinct_docs(lengths)
  windows = pack(docs, 5, EOS, PAD, keep_tail=True, split="validation",
                 doc_bytes=[np.ones_like(d) for d in docs])
  with pytest.raises(ValueError, match="per-token text bytes"):
    EvalWindows(pack(docs, 5, EOS, PAD, keep_tail=True, split="validation"), PAD)
  evals = EvalWindows(windows, PAD)
  direct = make_batch(windows.tokens, windows.segment_ids)["weights"].sum()
  assert evals.total_weight() == direct > 0
  for batch_size, count in ((4, 1), (4, 2), (6, 3), (64, 1)):
    shards = [list(evals.batches(batch_size, i, count)) for i in range(count)]
    assert all(len(s) == evals.num_batches(batch_size) for s in shards)
    total = sum(b["weights"].sum() for s in shards for b in s)
    assert total == direct
    assert all(b["inputs"].shape == (batch_size // count, 5) for s in shards for b in s)
  last = list(evals.batches(64))[-1]
  pad_rows = last["segment_ids"][windows.num_windows :]
  assert (pad_rows == 0).all() and (last["weights"][windows.num_windows :] == 0).all()
  assert np.array_equal(last["inputs"][: windows.num_windows], windows.tokens[:, :-1])


# ---- build_data --------------------------------------------------------------------------------


def test_pydoc_plus_docstrings_holds_out_the_pydoc_tail_only(tmp_path):
  both = text_splits(_config(builtin="pydoc+docstrings").data)
  pydoc = text_splits(_config().data)
  assert both.validation == pydoc.validation
  docstrings = builtin.stdlib_docstrings()
  assert both.train == docstrings + pydoc.train
  assert sum(map(len, both.train)) > 3 * sum(map(len, pydoc.train))


def test_build_data_on_pydoc(tmp_path):
  data = build_data(_config(seq_len=64, shuffle_seed=3), tmp_path)
  stats = data.stats()
  assert stats["train_documents"] + stats["eval_documents"] in (79, 80)
  assert data.train_windows == (data.train_tokens // 65)
  assert data.eval_windows == -(-data.eval_tokens // 65)
  assert data.train_bytes > 8 * data.eval_bytes
  batch = data.train.batch(0)
  assert batch["inputs"].shape == (8, 64)
  assert np.array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
  assert batch["weights"].sum() > 0.9 * batch["weights"].size
  # Bits-per-byte denominators: the bytes of all eval targets plus first tokens equal the text.
  ev = data.eval.windows.rows(np.arange(data.eval_windows))
  assert int(ev["nbytes"].sum()) == data.eval_bytes
  eval_weight = sum(b["weights"].sum() for b in data.eval_batches(32))
  assert eval_weight == data.eval.total_weight()
  # The order is data.shuffle_seed's (config.seed is 0): step 0 reads positions 0..7 of epoch 0.
  assert data.train.window_indices(0).tolist() == shuffled_positions(
      np.arange(8), data.train_windows, 3, 0).tolist()


def test_data_benchmark_writes_its_corpus_atomically_and_reads_manifests_checked(
    tmp_path, monkeypatch):
  from cem_jax.data import benchmark

  shared, folder = tmp_path / "shared", tmp_path / "c"
  shared.mkdir()
  folder.mkdir()
  (shared / "a.txt").write_text("".join(f"line {i} " + "x" * 2000 + "\n" for i in range(5)))
  (shared / "b.txt").write_text("\n  \n\t\n")  # blank lines are no text: left out
  out = folder / "corpus.txt"
  n = benchmark.make_corpus(shared, out, 1)
  assert 10**6 <= n < 10**6 + 2008 and out.stat().st_size == n, n  # MB, to the line
  first = out.read_bytes()
  lines = first.splitlines()  # every repetition of the 5 lines is shuffled again
  assert all(line.startswith(b"line ") for line in lines)
  assert len({tuple(lines[i:i + 5]) for i in range(0, len(lines) - 4, 5)}) > 1
  assert os.listdir(folder) == ["corpus.txt"]
  # The same arguments give the same bytes; another seed another order.
  again, other = folder / "again.txt", folder / "other.txt"
  benchmark.make_corpus(shared, again, 1)
  benchmark.make_corpus(shared, other, 1, seed=1)
  assert again.read_bytes() == first and other.read_bytes() != first
  again.unlink()
  other.unlink()

  def full_disk(fd):
    raise OSError("disk full")

  with monkeypatch.context() as m:
    m.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="^disk full$"):  # flushed to disk before the rename
      benchmark.make_corpus(shared, out, 1, seed=1)
  assert out.read_bytes() == first and os.listdir(folder) == ["corpus.txt"]
  for run in (benchmark._first_step, benchmark._pipeline):
    error = re.escape(f"data.prepared_dir={folder}: no manifest.json")
    with pytest.raises(ValueError, match=error):
      run(os.fspath(folder), *([] if run is benchmark._first_step else [2, 8, 1]))


def test_data_benchmark_first_step_fails_with_the_runs_status_and_counts_rss_in_gb(
    tmp_path, monkeypatch, capsys):
  import resource
  import subprocess
  import sys

  from cem_jax.data import benchmark, prepared

  monkeypatch.setattr(prepared.PreparedData, "open_manifest", staticmethod(
      lambda directory, verify=True: {"tokenizer": {"vocab_size": 300},
                                      "config": {"validation_fraction": 0.1}}))
  popen = subprocess.Popen
  failing = [sys.executable, "-c", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)"]
  started = []
  monkeypatch.setattr(subprocess, "Popen",
                      lambda cmd, **kwargs: started.append(cmd) or popen(failing, **kwargs))
  with pytest.raises(RuntimeError, match=r"^the 5-step run failed \(exit 3\): "):
    benchmark._first_step(os.fspath(tmp_path))
  # The run reads the prepared folder with its manifest's vocabulary and split, and logs every
  # step: the "step 1/5" line it times is not written otherwise.
  (cmd,) = started
  assert cmd[1:4] == ["-m", "cem_jax.main", f"--config={benchmark.REPO}/experiments/tiny.py"]
  assert cmd[5:] == [f"--config.data.prepared_dir={tmp_path}", "--config.data.vocab_size=300",
                     "--config.data.validation_fraction=0.1", "--config.train.num_steps=5",
                     "--config.train.log_every_steps=1", "--config.train.eval_every_steps=1000",
                     "--config.eval.max_batches=1"]
  assert capsys.readouterr().err == "boom\n"  # the run's last words
  # Linux counts ru_maxrss in KiB: 2,000,000 KiB are 2.048 GB.
  monkeypatch.setattr(resource, "getrusage",
                      lambda who: types.SimpleNamespace(ru_maxrss=2_000_000))
  assert benchmark._peak_rss_gb(resource.RUSAGE_SELF) == pytest.approx(2.048)


def test_data_identity_changes_with_each_split_and_the_tokenizer():
  # A checkpoint is refused on other tokens: the identity must follow every part of the data,
  # the validation stream included (an eval on other validation tokens is another result).
  from cem_jax.data import check_same_data, data_identity

  def manifest(tok, train, validation):
    return {"tokenizer": {"sha256": tok},
            "splits": {"train": {"shards": [{"sha256": s} for s in train]},
                       "validation": {"shards": [{"sha256": s} for s in validation]}}}

  base = data_identity(manifest("t" * 64, ["a" * 64, "b" * 64], ["v" * 64]))
  assert set(base) == {"tokenizer_sha256", "train_sha256", "validation_sha256"}
  edits = {"tokenizer_sha256": manifest("u" * 64, ["a" * 64, "b" * 64], ["v" * 64]),
           "train_sha256": manifest("t" * 64, ["a" * 64, "c" * 64], ["v" * 64]),
           "validation_sha256": manifest("t" * 64, ["a" * 64, "b" * 64], ["w" * 64])}
  for key, edited in edits.items():
    now = data_identity(edited)
    assert {k for k in base if base[k] != now[k]} == {key}, key
    with pytest.raises(ValueError, match=rf"trained on other data \({key} "):
      check_same_data(base, now, "ckpt/7")
  check_same_data(base, dict(base), "ckpt/7")  # the same data: accepted


def test_a_validation_split_of_one_token_is_refused():
  """A padded tail needs two real tokens to hold one weighted target (count_windows)."""
  assert packing.count_windows(2, 8, keep_tail=True, split="validation") == 1
  with pytest.raises(ValueError, match=r"data\.seq_len=8 is too long for the validation split: "
                                       r"it has 1 tokens"):
    packing.count_windows(1, 8, keep_tail=True, split="validation")
  with pytest.raises(ValueError, match="too long for the validation split"):
    pack([np.zeros(0, np.int32)], 8, EOS, PAD, keep_tail=True, split="validation")


def test_docstrings_are_read_from_the_standard_library_only(tmp_path, monkeypatch):
  """A same-named module earlier on sys.path (here antigravity.py) does not change the corpus."""
  import sysconfig

  (tmp_path / "antigravity.py").write_text('"""Not the standard library."""\n')
  monkeypatch.syspath_prepend(os.fspath(tmp_path))
  files = dict(builtin._module_files())
  stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
  assert all(path.is_relative_to(stdlib) for path in files.values())
  assert "json" in files


def _normalising_tokenizer(path: Path, **settings):
  """A tokenizer of SentencePiece's default settings (which normalise the text), trained on a
  short text and loaded as a given ``data.tokenizer``."""
  writer = io.BytesIO()
  settings = {"vocab_size": 40, **settings}
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(["hello world, a small text\n"] * 20), model_writer=writer,
      hard_vocab_limit=False, minloglevel=2, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      **settings)
  path.write_bytes(writer.getvalue())
  size = spm.SentencePieceProcessor(model_file=os.fspath(path)).get_piece_size()
  return tokenizer_lib.load_tokenizer(path, size)


def test_a_normalising_tokenizer_still_counts_every_byte_of_the_text(tmp_path):
  # SentencePiece's defaults drop leading, trailing and repeated spaces: the dropped bytes still
  # count (bits per byte divides by the text's bytes), for the id next to them.
  tok = _normalising_tokenizer(tmp_path / "default.model")
  for text in ["   hello  world  ", "  é hello", "hello"]:
    ids, nbytes = tok.encode_with_bytes(text)
    assert nbytes.sum() == len(text.encode("utf-8")), text
    assert len(ids) == len(nbytes) and (nbytes >= 0).all()


def test_a_literal_meta_space_in_normalised_text_is_three_bytes_between_its_parts(tmp_path):
  # A literal '▁' (U+2581, 3 UTF-8 bytes) is encoded as its three byte pieces between the
  # encodings of the text around it; where normalisation drops bytes (the repeated spaces here),
  # each id's bytes come from the offsets, and the parts' offsets start after the '▁' bytes.
  # 256 byte pieces besides the text's own.
  tok = _normalising_tokenizer(tmp_path / "bytes.model", byte_fallback=True, vocab_size=300)
  parts = ["hello    world", "a    small", "text"]
  ids, nbytes = tok.encode_with_bytes("\u2581".join(parts))
  assert int(tok.token_bytes[ids].sum()) != len("\u2581".join(parts).encode())  # normalised
  want_ids, want_bytes = [], []
  for i, part in enumerate(parts):
    if i:
      want_ids += [tok._sp.piece_to_id(f"<0x{b:02X}>") for b in "\u2581".encode()]
      want_bytes += [1, 1, 1]
    part_ids, part_bytes = tok.encode_with_bytes(part)
    want_ids += part_ids.tolist()
    want_bytes += part_bytes.tolist()
  assert ids.tolist() == want_ids
  assert nbytes.tolist() == want_bytes


@pytest.mark.parametrize("args,error", [
    (["--mode=pipeline"], "--mode=pipeline needs --prepared_dir=FOLDER (made by --mode=prepare)"),
    (["--mode=first_step"], "--mode=first_step needs --prepared_dir=FOLDER (made by "
                            "--mode=prepare)"),
    (["--mode=corpus"], "--mode=corpus needs --out=FILE"),
    (["--mode=prepare", "--files={tmp}/*.txt"], "--mode=prepare needs --files and --out"),
    (["--mode=corpus", "--out={tmp}/c.txt", "--shared={tmp}"], "--shared={tmp} holds no *.txt "
                                                                "file"),
    (["--mode=pipeline", "--prepared_dir={tmp}", "--batch_size=0"],
     "--batch_size=0; allowed: an int >= 1"),
])
def test_data_benchmark_refuses_bad_arguments_in_one_line(tmp_path, args, error):
  import subprocess
  import sys

  proc = subprocess.run([sys.executable, "-m", "cem_jax.data.benchmark",
                         *(a.format(tmp=tmp_path) for a in args)], cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [f"error: {error.format(tmp=tmp_path)}"]


# Its signals as a terminal leaves them, whatever pytest's are (not Popen's preexec_fn: a fork
# of the test process, which jax's threads make unsafe).
_BENCHMARK_AS_IN_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.signal(signal.SIGTERM, signal.SIG_DFL); sys.argv[0] = 'benchmark'; "
    "runpy.run_module('cem_jax.data.benchmark', run_name='__main__')")


def _benchmark_error(cwd: Path, *args: str) -> tuple[int, str]:
  """``(exit status, last stderr line)`` of ``python -m cem_jax.data.benchmark ARGS``."""
  import subprocess
  import sys

  proc = subprocess.run([sys.executable, "-c", _BENCHMARK_AS_IN_A_TERMINAL, *args], cwd=cwd,
                        capture_output=True, text=True, timeout=120)
  return proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]


def test_data_benchmark_refuses_a_batch_larger_than_the_host_before_reading_data(tmp_path):
  # --batch_size=10**12 was numpy's MemoryError traceback (or the kernel's kill) at the first
  # batch. The folder does not exist: the refusal comes before the data is opened.
  from cem_jax import memory

  rows, row_bytes = 10**12, 1024 * 16  # inputs, targets, segment_ids, weights: 4 bytes each
  needs, has = memory._sizes(rows * row_bytes, memory.host_total_bytes())
  assert _benchmark_error(tmp_path, "--mode=pipeline", f"--prepared_dir={tmp_path / 'none'}",
                          f"--batch_size={rows}") == (1, (
      f"error: --batch_size={rows} needs {needs} on this host (this process's {rows} rows of "
      f"the batch, {row_bytes} bytes each in NumPy), more than its {has} of memory and swap: "
      f"lower --batch_size={rows} or --seq_len=1024"))


def test_data_benchmark_refuses_a_corpus_larger_than_the_free_disk(tmp_path):
  # --megabytes=10**9 wrote until the disk was full (every other user's disk too), then failed.
  (tmp_path / "a.txt").write_text("some text\n")
  out = tmp_path / "new" / "corpus.txt"  # its folder not made yet: the disk above it counts
  code, line = _benchmark_error(tmp_path, "--mode=corpus", f"--shared={tmp_path}",
                                f"--out={out}", "--megabytes=1000000000")
  assert code == 1 and re.fullmatch(
      r"error: --megabytes=1000000000 is more than the \d+ MB free on the disk of "
      rf"{re.escape(str(out))}; lower it or write --out elsewhere", line), line
  assert sorted(os.listdir(tmp_path)) == ["a.txt"]
