"""checkpoint.load_parameters_from: a fresh run starts from another run's parameters with a
fresh optimizer, step and schedule; a run with a checkpoint of its own resumes it instead; a
source that cannot be this run's parameters is one line before anything compiles.

One tiny source run (4 steps, checkpoints at steps 2 and 4) is shared by the module. The
source's arrays are read back here with Orbax's own PyTreeCheckpointer, not through the code
under test.
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import textwrap
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import count_compiles, program_json, tiny_config, tool_runs
from flax import nnx

from cem_jax import integrity, runs, summary, tables, train
from cem_jax import steps as steps_lib
from cem_jax.metrics import read_metrics

FIELD = "checkpoint.load_parameters_from"

# Small and quick: width 32 on 32-token windows, no energy trace, synchronous saves.
SMALL = {"model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64, "data.seq_len": 32,
         "train.num_steps": 4, "train.warmup_steps": 2, "train.learning_rate": 1e-2,
         "train.eval_every_steps": 4, "train.log_every_steps": 1, "eval.max_batches": 1,
         "eval.energy_trace": False, "checkpoint.every_steps": 2,
         "checkpoint.async_save": False}


def _config(**overrides):
  return tiny_config(**{**SMALL, **overrides})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """The source run's folder: 4 steps, checkpoints 2 and 4."""
  workdir = tmp_path_factory.mktemp("source") / "run"
  train.train_and_evaluate(_config(), str(workdir))
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [
      "2", "4"]
  return workdir


def _saved_params(step_dir) -> dict[str, np.ndarray]:
  """``{"a/b/c": array}`` of a step's parameters, read by Orbax's plain PyTree reader."""
  with warnings.catch_warnings():  # Orbax: no sharding given, it reads the saved one
    warnings.simplefilter("ignore", UserWarning)
    tree = ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, "state"))
  flat = ocp.tree.to_flat_dict(tree["params"], sep="/")
  return {k: np.asarray(v) for k, v in flat.items()}


def _params(params) -> dict[str, np.ndarray]:
  """A live ``nnx.State`` of Params in the same key format."""
  tree = ocp.tree.serialize_tree(params, keep_empty_nodes=True)
  return {k: np.asarray(v) for k, v in ocp.tree.to_flat_dict(tree, sep="/").items()}


def _one_device_target(cfg):
  """``cfg``'s parameters as shapes on this process's first device (nothing initialised)."""
  params = nnx.split(nnx.eval_shape(lambda: steps_lib.build_model(cfg, cfg.data.vocab_size)),
                     nnx.Param)[1]
  return runs.restore_target(params)["params"]


def _assert_same(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_fresh_start_takes_the_source_steps_parameters_with_a_fresh_optimizer(source,
                                                                                 tmp_path):
  step2 = source / "checkpoints" / "2"
  want = _saved_params(step2)
  # The step named, not the newest (step 4), nor the seed's initialisation.
  newest = _saved_params(source / "checkpoints" / "4")
  assert any(not np.array_equal(want[k], newest[k]) for k in want)
  cfg = _config(**{FIELD: str(step2)})
  with contextlib.ExitStack() as held:
    run = train._start_up(cfg, str(tmp_path / "ft"), held)
    try:
      _assert_same(_params(run.params), want)
      # Every leaf on this run's sharding (NamedSharding on its mesh), not the reader's.
      leaves, shardings = jax.tree.leaves(run.params), jax.tree.leaves(run.shardings.params)
      assert len(leaves) == len(shardings)
      assert all(leaf.sharding == s for leaf, s in zip(leaves, shardings, strict=True))
      assert run.start_step == 0 and run.resume is None
      fresh = run.tx.init(run.params)
      for got, init in zip(jax.tree.leaves(run.opt_state), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(got, init)
      moments = [x for x in jax.tree.leaves(run.opt_state) if np.issubdtype(x.dtype, np.floating)]
      assert moments and all(not np.any(np.asarray(m)) for m in moments)
      digest = hashlib.sha256((source / "checkpoints" / "digests" / "2.json").read_bytes())
      assert run.parameters_from == {"checkpoint": str(step2), "step": 2,
                                     "digest_sha256": digest.hexdigest()}
    finally:
      run.ckpt.close()


def _losses(workdir) -> dict[str, dict[int, float]]:
  """``{"train/loss": {step: loss}, "eval/loss": {step: loss}}`` of a run's metrics.jsonl."""
  lines = read_metrics(str(workdir))
  return {key: {m["step"]: m[key] for m in lines if key in m}
          for key in ("train/loss", "eval/loss")}


def test_fine_tune_lowers_the_loss_and_a_killed_one_resumes_its_own_step(source, tmp_path,
                                                                         caplog, monkeypatch):
  workdir = tmp_path / "ft"
  cfg = _config(**{FIELD: str(source)})  # the run's folder: its newest step, 4
  train.train_and_evaluate(cfg, str(workdir))
  theirs, ours = _losses(source), _losses(workdir)
  # Its first step starts from the source's step-4 parameters, not from the seed's
  # initialisation (the source's own first step), and four more steps lower the loss.
  # Measured: train loss at step 1 5.70 against 6.24, eval loss at step 4 5.66 against 5.97.
  assert ours["train/loss"][1] < theirs["train/loss"][1] - 0.1
  assert ours["eval/loss"][4] < theirs["eval/loss"][4] - 0.1
  meta = json.loads((workdir / "checkpoints" / "4" / "meta" / "metadata").read_text())
  assert meta["parameters_from"]["checkpoint"] == str(source / "checkpoints" / "4")
  uninterrupted = _saved_params(workdir / "checkpoints" / "4")

  # Killed after its step-2 save: what a kill leaves is step 2 (step 4 never written). The
  # field, changed meanwhile to a folder that is not there, is not read at all: the run
  # resumes its own step 2, and its record still names the source it started from.
  shutil.rmtree(workdir / "checkpoints" / "4")
  (workdir / "checkpoints" / "digests" / "4.json").unlink()
  gone = str(tmp_path / "gone")
  with caplog.at_level(logging.INFO):
    train.train_and_evaluate(_config(**{FIELD: gone}), str(workdir))
  assert f"{FIELD}={gone!r} is ignored: the run resumes" in caplog.text
  _assert_same(_saved_params(workdir / "checkpoints" / "4"), uninterrupted)
  meta = json.loads((workdir / "checkpoints" / "4" / "meta" / "metadata").read_text())
  assert meta["parameters_from"]["checkpoint"] == str(source / "checkpoints" / "4")
  digest = hashlib.sha256((source / "checkpoints" / "digests" / "4.json").read_bytes())
  assert summary.parameters_from_line(runs.newest_meta(str(workdir))[1]) == (
      f"parameters from: {source / 'checkpoints' / '4'} (step 4, digest sha256 "
      f"{digest.hexdigest()[:16]})")
  assert summary.parameters_from_line(runs.newest_meta(str(source))[1]) is None
  # inspect --workdir ends with that line, and prints none for a run from its seed.
  (code, out, err, _), (code0, out0, err0, _) = tool_runs(
      "inspect", [[f"--workdir={workdir}"], [f"--workdir={source}"]])
  assert code is None and code0 is None, err + err0  # app.run: sys.exit(main()) of None
  assert out.rstrip("\n").endswith("\n" + summary.parameters_from_line(
      runs.newest_meta(str(workdir))[1])), out
  assert "parameters from:" not in out0, out0
  # A table's result.json of this (resumed) run records the source it started from.
  monkeypatch.setattr(train, "train_and_evaluate", lambda cfg, out: {
      k: v for k, v in read_metrics(out)[-1].items() if k.startswith("eval/")})
  result = tables._trained_result("t", str(workdir), cfg, "row", 0, tables.config_digest(cfg))
  assert result["parameters_from"] == {"checkpoint": str(source / "checkpoints" / "4"),
                                       "step": 4, "digest_sha256": digest.hexdigest()}


def test_a_table_reuses_a_run_only_if_started_from_the_same_source_step(source, tmp_path):
  # One path, several steps: a run's folder names its newest step, which moves on as that run
  # trains; the config (and its digest) stays the same.
  copy = tmp_path / "base"
  shutil.copytree(source, copy)
  cfg = _config(**{FIELD: str(copy)})
  run = tmp_path / "w" / "toy" / "row" / "seed0"
  run.mkdir(parents=True)
  (run / "config.json").write_text(cfg.to_json())
  digest = tables.config_digest(cfg)

  def started_from(step, digest_file=None):
    digest_file = digest_file or copy / "checkpoints" / "digests" / f"{step}.json"
    return {"checkpoint": str(copy / "checkpoints" / str(step)), "step": step,
            "digest_sha256": hashlib.sha256(digest_file.read_bytes()).hexdigest()}

  def reused(parameters_from) -> bool:
    result = {"row": "row", "seed": 0, "eval/loss": 3.0, "eval/bits_per_byte": 1.5,
              "tokens_per_sec": 1.0, "config_digest": digest,
              "numerics_version": runs.NUMERICS_VERSION, **parameters_from}
    (run / "result.json").write_text(json.dumps(result))
    return tables._finished_run(str(tmp_path / "w"), digest, cfg) == str(run)

  assert reused({"parameters_from": started_from(4)})
  assert not reused({"parameters_from": started_from(2)})
  assert not reused({})  # recorded before result.json held it: unknown, trained again
  # Same step, another digest (the step saved again after a restart).
  assert not reused({"parameters_from": started_from(
      4, copy / "checkpoints" / "digests" / "2.json")})


# In a program of its own on 2 forced CPU devices: the start-up of a run of the source's model
# with its parameters sharded over mesh.fsdp=2 (the source trained on 1 device), which then
# saves them as its step 1 (a source saved on 2 devices, for the test to load on 1).
_TWO_DEVICES = textwrap.dedent("""
    import contextlib, json, os, signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.path.insert(0, {tests!r})
    import jax
    import numpy as np
    from cem_jax import runs, train
    from test_finetune import FIELD, _config, _params, _saved_params
    source, workdir = sys.argv[1:]
    cfg = _config(**{{FIELD: source, "mesh.fsdp": 2}})
    with contextlib.ExitStack() as held:
      run = train._start_up(cfg, workdir, held)
      try:
        got = _params(run.params)
        want = _saved_params(os.path.join(source, "checkpoints", "4"))
        same = sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
        sharded = sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(run.params))
        meta = runs.CheckpointMeta.saved_now(1, cfg.seed, cfg.to_dict(), run.data.identity,
                                             run.energies, run.parameters_from)
        run.ckpt.save(1, {{"params": run.params, "opt_state": run.opt_state}}, meta.to_dict(),
                      force=True)
      finally:
        run.ckpt.close()
    print(json.dumps({{"devices": jax.device_count(), "same": same, "sharded": sharded}}))
""")


def test_parameters_move_between_one_and_two_devices(source, tmp_path):
  script = tmp_path / "two.py"
  script.write_text(_TWO_DEVICES.format(tests=str(Path(__file__).resolve().parent)))
  workdir = tmp_path / "ft"
  shutil.copytree(source / "data", workdir / "data")  # its tokens: no tokenizer trained again
  out = program_json([str(script), str(source), str(workdir)], 2,
                     cwd=Path(__file__).resolve().parents[1])
  assert out["devices"] == 2 and out["same"] and out["sharded"] > 0, out
  # Saved sharded over 2 devices, read here onto this process's one device.
  cfg = _config(**{FIELD: str(workdir)})
  opened = runs.open_parameters_source(cfg)
  try:
    assert opened.step == 1
    loaded = runs.load_parameters(opened, _one_device_target(cfg))
  finally:
    opened.close()
  assert {leaf.sharding.num_devices for leaf in jax.tree.leaves(loaded)} == {1}
  _assert_same(_params(loaded), _saved_params(source / "checkpoints" / "4"))


def _refusal(cfg, workdir, exists: bool = False) -> str:
  """The one-line ValueError of a start of ``cfg`` in ``workdir``, which is left as it was:
  not there, or (``exists``) an empty folder made here."""
  if exists:
    workdir.mkdir()
  assert not os.path.exists(workdir) or exists
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(cfg, str(workdir))
  if exists:
    assert os.listdir(workdir) == []
  else:
    assert not os.path.exists(workdir), os.listdir(workdir)
  message = str(e.value)
  assert "\n" not in message and message.startswith(f"{FIELD}="), message
  return message


def test_a_source_without_an_intact_checkpoint_is_one_line_and_creates_nothing(source,
                                                                                tmp_path):
  empty = tmp_path / "empty"
  (empty / "checkpoints").mkdir(parents=True)
  # A digit-named folder outside a checkpoints folder (no digests/ beside it) is no step.
  (tmp_path / "plain" / "3").mkdir(parents=True)
  (tmp_path / "file").write_text("")
  damaged = tmp_path / "damaged"
  shutil.copytree(source / "checkpoints", damaged / "checkpoints")
  manifest = damaged / "checkpoints" / "2" / "state" / "manifest.ocdbt"
  manifest.write_bytes(manifest.read_bytes()[:-1])
  (damaged / "checkpoints" / "7").mkdir()  # a save cut short: never committed
  ruined = tmp_path / "ruined"  # a run whose only step is damaged
  shutil.copytree(damaged / "checkpoints", ruined / "checkpoints",
                  ignore=lambda folder, names: {"4", "7", "4.json"} & set(names))
  cases = {
      tmp_path / "missing": "no such folder",
      tmp_path / "file": ": not a folder;",
      tmp_path / "plain": "neither a run's folder",
      tmp_path / "plain" / "3": "neither a run's folder",
      empty: f"no checkpoint in {empty / 'checkpoints'}",
      ruined: f"no intact checkpoint in {ruined / 'checkpoints'} \\(the warnings above",
      damaged / "checkpoints" / "2": "a damaged step \\(.*/2/state/manifest.ocdbt: .*truncated",
      damaged / "checkpoints" / "7": "a damaged step \\(.*/7: empty folder\\)",
  }
  for i, (path, problem) in enumerate(cases.items()):
    message = _refusal(_config(**{FIELD: str(path)}), tmp_path / f"w{i}")
    assert message.startswith(f"{FIELD}={str(path)!r}: ")
    assert re.search(problem, message), message
    assert message.endswith(runs.PARAMETERS_FROM_ALLOWED)
  # The run's own --workdir (or its checkpoints folder), at its fresh start: the cause named.
  for own, path in ((tmp_path / "own0", tmp_path / "own0"),
                    (tmp_path / "own1", tmp_path / "own1" / "checkpoints")):
    message = _refusal(_config(**{FIELD: str(path)}), own, exists=own == path)
    assert message == (f"{FIELD}={str(path)!r}: that is this run's own --workdir ({own}), "
                       "which a fresh run cannot start from (it holds no checkpoint of its own "
                       f"yet); {runs.PARAMETERS_FROM_ALLOWED}")


def test_a_source_of_other_shapes_or_tokens_is_one_line_naming_what_differs(source, tmp_path):
  saved = _saved_params(source / "checkpoints" / "4")
  # A wider MLP (64 -> 96, no other size is 64): the first parameter path in sorted order
  # whose shape differs, with both shapes.
  made = count_compiles()
  message = _refusal(_config(**{FIELD: str(source), "model.mlp_dim": 96}), tmp_path / "a")
  assert not made, made  # refused before the parameters' initialiser or a step compiled
  first = min(k for k in saved if 64 in saved[k].shape)
  want = tuple(96 if n == 64 else n for n in saved[first].shape)
  assert (f"another model: parameter params/{first} is {saved[first].shape} float32 in step 4 "
          f"({source / 'checkpoints' / '4'}), {want} float32 in this config's model") in message
  # Another structure: a parameter the source does not have.
  message = _refusal(_config(**{FIELD: str(source), "model.diagonal": "per_head"}),
                     tmp_path / "b")
  assert ("parameter params/blocks/0/attn/diag/value is absent in step 4 "
          f"({source / 'checkpoints' / '4'}), (2, 32) float32 in this config's model (2 "
          "parameters differ)") in message
  # Another vocabulary: named as such, before the data are built.
  message = _refusal(_config(**{FIELD: str(source), "data.vocab_size": 256}), tmp_path / "c")
  assert "was trained with data.vocab_size=512, this run has data.vocab_size=256" in message
  # The same vocabulary size from another tokenizer: the data are built in the (existing,
  # empty) workdir, then removed again.
  message = _refusal(_config(**{FIELD: str(source), "data.tokenizer_model_type": "unigram"}),
                     tmp_path / "d", exists=True)
  tokenizer = next((source / "data").glob("*/tokenizer.model"))
  assert "was trained with another tokenizer" in message
  assert f"set data.tokenizer={tokenizer}" in message


def test_model_fields_that_change_no_shape_are_allowed_and_logged(source, caplog):
  cfg = _config(**{FIELD: str(source / "checkpoints" / "4"), "model.num_steps": 2})
  with caplog.at_level(logging.WARNING):
    opened = runs.open_parameters_source(cfg)
  opened.close()
  assert opened.step == 4
  assert "change no parameter shape (allowed): model.num_steps: 1 -> 2" in caplog.text


def test_a_source_step_deleted_before_it_is_read_is_one_line(source, tmp_path):
  # A source still training prunes its old steps: the step chosen at start-up may be gone by
  # the time the parameters are read, after the data were built.
  copy = tmp_path / "source"
  shutil.copytree(source / "checkpoints", copy / "checkpoints")
  cfg = _config(**{FIELD: str(copy / "checkpoints" / "2")})
  opened = runs.open_parameters_source(cfg)
  try:
    shutil.rmtree(copy / "checkpoints" / "2")
    with pytest.raises(ValueError) as e:
      runs.load_parameters(opened, _one_device_target(cfg))
  finally:
    opened.close()
  assert str(e.value) == (
      f"{FIELD}={str(copy / 'checkpoints' / '2')!r}: step 2 ({copy / 'checkpoints' / '2'}) was "
      "deleted while this run started (a run still training keeps only its newest "
      "checkpoint.keep steps); name a step folder it keeps, or start again once it has stopped")


def test_the_path_may_be_relative_to_the_cwd_start_with_a_tilde_or_end_in_a_slash(
    source, tmp_path, monkeypatch):
  # A source still training: a save in progress (Orbax's temporary folder) and a step folder
  # not yet committed are neither chosen nor touched by the reader.
  home = tmp_path / "home"
  checkpoints = home / "base" / "checkpoints"
  shutil.copytree(source / "checkpoints", checkpoints)
  saving = checkpoints / "6.orbax-checkpoint-tmp-1796690457"
  shutil.copytree(checkpoints / "4" / "state", saving / "state")
  (checkpoints / "8").mkdir()
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.chdir(home)
  cases = {"~/base": 4, "base/checkpoints/2/": 2, "~/base/checkpoints/": 4, "./base/": 4}
  for given, step in cases.items():
    opened = runs.open_parameters_source(_config(**{FIELD: given}))
    opened.close()
    assert (opened.step, opened.record["checkpoint"]) == (step, str(checkpoints / str(step))), given
  assert sorted(os.listdir(saving)) == ["state"] and os.listdir(checkpoints / "8") == []


def test_a_step_folder_whose_metadata_is_damaged_or_another_steps_is_one_line(source, tmp_path):
  # Each with a digest that matches (a step folder copied under another number with its
  # digest; metadata rewritten, then digested): only the metadata itself tells.
  renamed = tmp_path / "renamed" / "checkpoints"
  (renamed / "digests").mkdir(parents=True)
  shutil.copytree(source / "checkpoints" / "4", renamed / "2")
  shutil.copy(source / "checkpoints" / "digests" / "4.json", renamed / "digests" / "2.json")
  listed = tmp_path / "listed" / "checkpoints"
  shutil.copytree(source / "checkpoints", listed)
  (listed / "4" / "meta" / "metadata").write_text("[4]")
  integrity.write_digest(str(listed), 4)
  cases = {renamed / "2": f"checkpoint {renamed / '2'}: damaged metadata: step=4, saved as step 2",
           listed.parent: f"checkpoint {listed / '4'}: damaged metadata: a list, not an object"}
  for i, (path, problem) in enumerate(cases.items()):
    message = _refusal(_config(**{FIELD: str(path)}), tmp_path / f"w{i}")
    assert message == f"{FIELD}={str(path)!r}: {problem}; {runs.PARAMETERS_FROM_ALLOWED}"
  # inspect --workdir reads the same metadata the same way.
  with pytest.raises(ValueError, match=f"^{re.escape(cases[renamed / '2'])}$"):
    runs.newest_meta(str(renamed.parent))


def test_other_text_under_the_sources_tokenizer_is_what_a_fine_tune_is_for(source, tmp_path,
                                                                          caplog):
  # The README's command: another file, tokenized by the source's tokenizer.model.
  text = tmp_path / "other.txt"
  text.write_text(Path(json.__file__).read_text() + Path(shutil.__file__).read_text())
  tokenizer = next((source / "data").glob("*/tokenizer.model"))
  cfg = _config(**{FIELD: str(source), "data.files": str(text), "data.tokenizer": str(tokenizer)})
  with caplog.at_level(logging.INFO), contextlib.ExitStack() as held:
    run = train._start_up(cfg, str(tmp_path / "ft"), held)
    try:
      _assert_same(_params(run.params), _saved_params(source / "checkpoints" / "4"))
      assert run.parameters_from["step"] == 4 and run.start_step == 0
    finally:
      run.ckpt.close()
  assert (f"this run trains on other text than {source / 'checkpoints' / '4'} did (under the "
          "same tokenizer)") in caplog.text


def test_with_several_processes_a_source_one_of_them_does_not_see_is_refused_by_all(
    source, monkeypatch):
  # A folder on process 0's own disk: process 1 refused it alone, and process 0 waited for it
  # in the choice of the step's collective until JAX's timeout.
  from jax.experimental import multihost_utils

  gathered = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x: gathered.append(int(x)) or np.array([1, 0], np.int32))
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all",
                      lambda x: pytest.fail("a process went on to choose the step"))
  problems = {0: (str(source), "process 1 of 2 sees no folder there (a path on one host's own "
                  "disk?); it must be one every process sees at that path"),
              1: (str(source / "elsewhere"), "no such folder")}
  for index, (given, problem) in problems.items():
    monkeypatch.setattr(jax, "process_index", lambda index=index: index)
    with pytest.raises(ValueError) as e:
      runs.open_parameters_source(_config(**{FIELD: given}))
    assert str(e.value) == f"{FIELD}={given!r}: {problem}; {runs.PARAMETERS_FROM_ALLOWED}"
  assert gathered == [1, 0]  # each joined the gathering once, before refusing


def test_a_source_step_pruned_while_it_is_chosen_is_chosen_again_or_one_line(source, tmp_path,
                                                                             monkeypatch):
  # A source still training prunes the step chosen before its metadata is read (beside one
  # with checkpoint.keep=1, starts failed with Orbax's FileNotFoundError or TensorStore's
  # ValueError of many lines): a run's folder chooses again, the newest left; a step folder
  # named is one line.
  copy = tmp_path / "source"
  shutil.copytree(source / "checkpoints", copy / "checkpoints")
  real = runs.read_meta

  def pruned_once(ckpt, step):
    if step == 4 and (copy / "checkpoints" / "4").exists():
      shutil.rmtree(copy / "checkpoints" / "4")
      (copy / "checkpoints" / "digests" / "4.json").unlink()
      raise FileNotFoundError(f"{ckpt.step_dir(4)}/meta: no such file")  # as Orbax's
    return real(ckpt, step)

  monkeypatch.setattr(runs, "read_meta", pruned_once)
  opened = runs.open_parameters_source(_config(**{FIELD: str(copy)}))
  opened.close()
  assert (opened.step, opened.record["checkpoint"]) == (2, str(copy / "checkpoints" / "2"))
  shutil.copytree(source / "checkpoints" / "4", copy / "checkpoints" / "4")
  named = str(copy / "checkpoints" / "4")
  shutil.copy(source / "checkpoints" / "digests" / "4.json", copy / "checkpoints" / "digests")
  with pytest.raises(ValueError) as e:
    runs.open_parameters_source(_config(**{FIELD: named}))
  assert str(e.value) == (
      f"{FIELD}={named!r}: step 4 ({named}) was deleted while it was read (a run still training "
      "keeps only its newest checkpoint.keep steps); name a step folder it keeps, or start "
      f"again once it has stopped; {runs.PARAMETERS_FROM_ALLOWED}")
  # A run's folder whose every chosen step was pruned: _read_newest's own line (what to do),
  # not "no intact checkpoint", which would send one looking for damage.
  def pruned_each(ckpt, workdir, read):
    raise runs._PrunedEachStep(f"--workdir={workdir}: the run pruned each step")

  monkeypatch.setattr(runs, "_read_newest", pruned_each)
  with pytest.raises(ValueError) as e:
    runs.open_parameters_source(_config(**{FIELD: str(copy)}))
  assert str(e.value) == (f"{FIELD}={str(copy)!r}: --workdir={copy}: the run pruned each step; "
                          f"{runs.PARAMETERS_FROM_ALLOWED}")
