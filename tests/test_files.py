"""files.py: the one atomic write (a reader sees the old file or the new one, nothing else)."""

import errno
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cem_jax import files


def test_atomic_write_json_writes_the_requested_format(tmp_path):
  path = tmp_path / "a.json"
  files.atomic_write_json(path, {"b": 1, "a": [1, 2]}, indent=1, sort_keys=True)
  assert path.read_bytes() == b'{\n "a": [\n  1,\n  2\n ],\n "b": 1\n}'
  files.atomic_write_json(path, {"b": 1, "a": 2})  # defaults: indent 2, keys as given
  assert path.read_bytes() == b'{\n  "b": 1,\n  "a": 2\n}'
  assert os.listdir(tmp_path) == ["a.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path, monkeypatch):
  path = tmp_path / "a.bin"
  path.write_bytes(b"old")
  with pytest.raises(TypeError):
    files.atomic_write_json(path, {"x": object()})
  def fail(src, dst):
    raise OSError("disk full")
  monkeypatch.setattr(files.os, "replace", fail)
  with pytest.raises(OSError, match="disk full"):
    files.atomic_write_bytes(path, b"new")
  assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["a.bin"]


def test_the_data_is_on_disk_before_the_rename(tmp_path, monkeypatch):
  # Renamed before its data is flushed, a power cut can leave the new name on an empty or
  # partial file (the rename is journaled, the data not yet written): what atomic writes
  # exist to rule out. The fsync must reach the temporary file, then the rename.
  events = []
  real_fsync, real_replace = os.fsync, os.replace

  def fsync(fd):
    events.append(("fsync", os.fstat(fd).st_ino))
    real_fsync(fd)

  def replace(src, dst):
    events.append(("replace", os.stat(src).st_ino, os.fspath(dst)))
    real_replace(src, dst)

  monkeypatch.setattr(files.os, "fsync", fsync)
  monkeypatch.setattr(files.os, "replace", replace)
  files.atomic_write_bytes(tmp_path / "a.bin", b"data")
  inode = (tmp_path / "a.bin").stat().st_ino
  assert events == [("fsync", inode), ("replace", inode, os.fspath(tmp_path / "a.bin"))]


def test_a_file_that_cannot_be_opened_is_reported_as_itself(tmp_path, monkeypatch):
  # The clean-up of a temporary file never created must not replace the error that stopped
  # it (a PermissionError said as FileNotFoundError of a name the user never gave). A
  # read-only folder refuses nothing to root, as tests may run: the open refuses here.
  def refuse(name, mode="r", *args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied", name)

  monkeypatch.setattr(files, "open", refuse, raising=False)
  with pytest.raises(PermissionError):
    files.atomic_write_bytes(tmp_path / "a.bin", b"x")
  assert os.listdir(tmp_path) == []


def test_text_is_utf8_and_a_relative_path_is_in_the_working_directory(tmp_path, monkeypatch):
  # A bare file name has no folder part: its folder is the working directory, not "".
  monkeypatch.chdir(tmp_path)
  files.atomic_write_text("a.txt", "caf\u00e9 \u2713")
  assert (tmp_path / "a.txt").read_bytes() == "caf\u00e9 \u2713".encode("utf-8")


def test_a_missing_folder_is_an_error_not_created(tmp_path):
  # Each error names the path asked for (not the temporary file beside it).
  target = tmp_path / "no" / "a.bin"
  with pytest.raises(FileNotFoundError) as e:
    files.atomic_write_bytes(target, b"x")
  assert str(e.value) == f"[Errno 2] no folder {tmp_path / 'no'} to write into: '{target}'"
  assert os.listdir(tmp_path) == []
  (tmp_path / "d").mkdir()
  with pytest.raises(IsADirectoryError) as e:
    files.atomic_write_text(tmp_path / "d", "x")
  assert str(e.value) == f"[Errno 21] a folder is in the way of the file: '{tmp_path / 'd'}'"
  assert os.listdir(tmp_path / "d") == []


def test_temporary_of_recognises_the_temporaries_of_both_writers(tmp_path, monkeypatch):
  made = []
  real_replace = os.replace

  def replace(src, dst):
    # Beside its target: a rename across file systems is a copy, not atomic.
    assert os.path.dirname(src) == os.path.dirname(os.fspath(dst)), (src, dst)
    made.append(os.path.basename(src))
    real_replace(src, dst)

  monkeypatch.setattr(files.os, "replace", replace)
  files.atomic_write_json(tmp_path / "a.json", {"a": 1})
  with files.atomic_writer(tmp_path / "b.txt") as f:
    f.write(b"streamed")
  with files.atomic_path(tmp_path / "c.bin") as name:
    with open(name, "wb") as f:
      f.write(b"by name")
  assert [files.temporary_of(name) for name in made] == ["a.json", "b.txt", "c.bin"]
  assert (tmp_path / "c.bin").read_bytes() == b"by name"
  assert files.temporary_of(tmp_path / made[0]) == "a.json"
  for name in ["a.json", "a.json.tmp", "a.json.12.0123456789ab.tmp.bak",
               "a.json.x.0123456789ab.tmp", "a.json.12.0123456789.tmp", ".12.0123456789ab.tmp",
               "a.json..0123456789ab.tmp"]:
    assert files.temporary_of(name) is None, name
  assert (tmp_path / "b.txt").read_bytes() == b"streamed"


def test_atomic_writer_keeps_the_old_file_on_an_exception(tmp_path):
  path = tmp_path / "a.bin"
  path.write_bytes(b"old")
  with pytest.raises(KeyboardInterrupt):
    with files.atomic_writer(path) as f:
      f.write(b"half")
      raise KeyboardInterrupt
  assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["a.bin"]
  with pytest.raises(FileNotFoundError):
    with files.atomic_writer(tmp_path / "no" / "a.bin"):
      pass
  with pytest.raises(KeyboardInterrupt):
    with files.atomic_path(path) as name:
      with open(name, "wb") as f:
        f.write(b"half")
      raise KeyboardInterrupt
  assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["a.bin"]
  with pytest.raises(FileNotFoundError):  # nothing written at the name: path unchanged
    with files.atomic_path(path):
      pass
  assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["a.bin"]


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="POSIX file-size limit")
@pytest.mark.parametrize("size", [100, 1 << 20])  # fails at the close's flush; at the write
def test_a_write_that_fills_the_disk_names_the_file_and_leaves_it_unchanged(tmp_path, size):
  # A full disk (here a file-size limit: EFBIG where ENOSPC would be) fails the write or the
  # close with an OSError of no file name: main's one line read "error: [Errno 28] No space
  # left on device" when best_eval.json found its tmpfs full.
  import resource

  path = tmp_path / "best_eval.json"
  path.write_bytes(b"old")
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the process is killed
  try:
    resource.setrlimit(resource.RLIMIT_FSIZE, (10, hard))
    with pytest.raises(OSError) as raised:
      files.atomic_write_bytes(path, b"x" * size)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, xfsz)
  assert raised.value.errno == errno.EFBIG and raised.value.filename == os.fspath(path)
  assert str(raised.value).endswith(f": {os.fspath(path)!r}")
  assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["best_eval.json"]


def test_sha256_file_is_the_digest_of_the_whole_file(tmp_path):
  data = os.urandom(3 * (1 << 20) + 17)  # more than one block, the last one partial
  (tmp_path / "f").write_bytes(data)
  assert files.sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()
  (tmp_path / "empty").write_bytes(b"")
  assert files.sha256_file(os.fspath(tmp_path / "empty")) == hashlib.sha256(b"").hexdigest()
  with pytest.raises(FileNotFoundError):
    files.sha256_file(tmp_path / "missing")


def test_atomic_save_figure_writes_the_extension_format_or_nothing(tmp_path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(2, 1))
  ax.plot([0, 1], [1, 0])
  files.atomic_save_figure(fig, tmp_path / "a.png", dpi=50)
  files.atomic_save_figure(fig, tmp_path / "a.svg")
  png = (tmp_path / "a.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  # The dpi asked for: 2 x 1 inches at 50 dots per inch (IHDR's width and height).
  assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (100, 50)
  assert b"<svg" in (tmp_path / "a.svg").read_bytes()[:500]
  with pytest.raises(ValueError):
    files.atomic_save_figure(fig, tmp_path / "a.nosuchformat")
  plt.close(fig)
  assert sorted(os.listdir(tmp_path)) == ["a.png", "a.svg"]


def test_saved_figure_saves_on_leaving_and_closes_the_figure_either_way(tmp_path):
  import matplotlib.pyplot as plt

  with files.saved_figure(tmp_path / "a.png", ncols=2, figsize=(2, 1)) as (fig, (left, right)):
    left.plot([0, 1], [1, 0])
    assert plt.fignum_exists(fig.number)
  assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert not plt.fignum_exists(fig.number)  # closed: a sweep drawing many would leak them
  with pytest.raises(RuntimeError, match="drawing failed"):
    with files.saved_figure(tmp_path / "b.png") as (fig, _):
      raise RuntimeError("drawing failed")
  assert not plt.fignum_exists(fig.number)
  assert sorted(os.listdir(tmp_path)) == ["a.png"]  # a failed drawing writes nothing


def test_read_json_reads_what_the_writer_wrote_and_names_a_damaged_file_in_one_line(tmp_path):
  path = tmp_path / "result.json"
  files.atomic_write_json(path, {"eval/loss": 3.5, "row": "ü"})
  assert files.read_json(path, "delete it") == {"eval/loss": 3.5, "row": "ü"}
  for damage, reason in ((b'{"eval/lo', "Unterminated string"),
                         (b'{"row": "\xff"}', "can't decode byte 0xff")):
    path.write_bytes(damage)  # cut short by a kill of an older writer, or overwritten
    with pytest.raises(ValueError) as e:
      files.read_json(path, "delete it to train that run again")
    message = str(e.value)
    assert message.startswith(f"{path} is not valid JSON (") and reason in message
    assert message.endswith("); delete it to train that run again") and "\n" not in message
  with pytest.raises(FileNotFoundError):
    files.read_json(tmp_path / "missing.json", "x")


def test_read_json_reads_utf8_under_any_locale(tmp_path):
  # JSON is UTF-8; a result.json edited by hand holds "ü" as its two bytes. Read with the
  # locale's encoding (a C or a Windows locale) it would be a decode error or mojibake.
  path = tmp_path / "result.json"
  path.write_bytes('{"row": "ü"}'.encode())
  env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
  code = f"from cem_jax import files; print(ascii(files.read_json({str(path)!r}, 'x')))"
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        cwd=Path(files.__file__).parents[1])
  assert (proc.returncode, proc.stdout) == (0, "{'row': '\\xfc'}\n"), proc.stderr


def test_check_can_write_leaves_nothing_and_refuses_a_missing_folder(tmp_path):
  # It creates and removes a temporary file: one left behind would be a stray .tmp in every
  # benchmark's output folder, and the target itself is never touched.
  (tmp_path / "out.json").write_bytes(b"old")
  files.check_can_write(tmp_path / "out.json")
  assert os.listdir(tmp_path) == ["out.json"] and (tmp_path / "out.json").read_bytes() == b"old"
  with pytest.raises(FileNotFoundError):
    files.check_can_write(tmp_path / "no" / "out.json")
  assert os.listdir(tmp_path) == ["out.json"]


def test_atomic_save_figure_defaults_to_120_dots_per_inch(tmp_path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, _ = plt.subplots(figsize=(2, 1))
  files.atomic_save_figure(fig, tmp_path / "a.png")
  plt.close(fig)
  png = (tmp_path / "a.png").read_bytes()
  assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (240, 120)
