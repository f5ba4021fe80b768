"""files.py: the one atomic write (a reader sees the old file or the new one, nothing else)."""

import os

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


def test_a_missing_folder_is_an_error_not_created(tmp_path):
  with pytest.raises(FileNotFoundError):
    files.atomic_write_bytes(tmp_path / "no" / "a.bin", b"x")
  assert os.listdir(tmp_path) == []
