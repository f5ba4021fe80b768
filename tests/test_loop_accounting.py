"""The loop reports how many epochs its schedule covers and keeps the best eval."""

import json
import logging

import pytest
from conftest import tiny_config

from cem_jax import train
from cem_jax.metrics import read_metrics


def test_epochs_are_logged_and_warned_and_the_best_eval_is_kept(shared_data, tmp_path, caplog):
  text = (shared_data / "tinyshakespeare.txt").read_text()[:6_000]
  (tmp_path / "small.txt").write_text(text)
  cfg = tiny_config("llama", **{
      "model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64, "model.num_layers": 1,
      "data.files": str(tmp_path / "small.txt"), "data.seq_len": 32, "data.vocab_size": 384,
      "train.batch_size": 16, "train.num_steps": 24, "train.warmup_steps": 2,
      "train.learning_rate": 3e-2, "train.eval_every_steps": 8, "train.log_every_steps": 8,
      "eval.max_batches": 2})
  workdir = tmp_path / "run"
  with caplog.at_level(logging.INFO):
    final = train.train_and_evaluate(cfg, str(workdir))
  lines = read_metrics(str(workdir))
  windows = lines[0]["data/train_windows"]
  want = 24 * 16 / windows
  assert want >= train.EPOCHS_WARNING  # the setup passes over the text several times
  assert lines[0]["data/epochs"] == pytest.approx(want)
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any(f"{want:.1f} times" in m and "eval/best_" in m for m in warned), warned
  evals = [m for m in lines if "eval/loss" in m]
  best = min(evals, key=lambda m: m["eval/loss"])
  expected = {"eval/best_loss": best["eval/loss"],
              "eval/best_bits_per_byte": best["eval/bits_per_byte"],
              "eval/best_step": best["step"]}
  assert {k: final[k] for k in expected} == expected
  assert final["eval/loss"] == evals[-1]["eval/loss"]
  assert json.loads((workdir / "best_eval.json").read_text()) == expected
  for i, m in enumerate(evals):  # every eval line carries the best up to itself
    assert m["eval/best_loss"] == min(e["eval/loss"] for e in evals[:i + 1])


def test_no_warning_below_two_epochs():
  cfg = tiny_config("llama")
  assert train.epochs(cfg, 8 * 30) == 1.0
  assert train.best_eval([]) == {}
  assert train.best_eval([{"step": 5, "eval/loss": 2.0, "eval/bits_per_byte": 1.0},
                          {"step": 9, "eval/loss": 2.5, "eval/bits_per_byte": 1.2}]) == {
      "eval/best_loss": 2.0, "eval/best_bits_per_byte": 1.0, "eval/best_step": 5}
