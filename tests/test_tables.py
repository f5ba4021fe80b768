"""Paper tables: every row builds with the right parameter counts; the runner resumes."""

import csv
import hashlib
import json
import math
import os
import shutil

import numpy as np
import pytest
from conftest import tiny_config, write_metrics

from cem_jax import energies, model_stats, tables, train
from cem_jax.version import NUMERICS_VERSION

D, L, F, H = 128, 4, 512, 4  # the tiny scale


def _counts(table, row):
  module = tables.load_table(table)
  return tables.parameter_counts(tables.row_config(module, row, "tiny", 0))


@pytest.mark.parametrize("table", ["attention", "mlp", "design", "end_to_end"])
def test_every_row_builds_at_tiny_scale(table):
  module = tables.load_table(table)
  for row in module.ROWS:
    cfg = tables.row_config(module, row, "tiny", 0)
    counts = tables.parameter_counts(cfg)
    assert counts["params"] > counts["non_embedding_params"] > 0, row
    # docs/DESIGN_SPACE.md: the paper tables turn the energy trace off, except design, whose
    # diagnostic rows read it.
    assert cfg.eval.energy_trace == (table == "design"), row


def test_attention_table_parameter_counts():
  assert _counts("attention", "llama_mha")["attention_params"] == L * 4 * D * D
  assert _counts("attention", "cem_tied")["attention_params"] == L * (2 * D * D + H)
  assert _counts("attention", "cem_tied_diag")["attention_params"] == L * (2 * D * D + H + H * D)
  tied = _counts("attention", "cem_tied")["attention_params"]
  matched = _counts("attention", "llama_matched")["attention_params"]
  assert abs(matched / tied - 1) <= 0.02
  # the MLP is the same SwiGLU in every row of this table
  assert {_counts("attention", r)["mlp_params"] for r in
          ("llama_mha", "cem_tied", "llama_matched")} == {L * 3 * D * F}


def test_mlp_table_parameter_counts():
  swiglu = _counts("mlp", "swiglu")["mlp_params"]
  tied = _counts("mlp", "cem_tied")["mlp_params"]
  assert swiglu == L * 3 * D * F and tied == L * (2 * D * F + 1)
  assert abs(_counts("mlp", "swiglu_matched")["mlp_params"] / tied - 1) <= 0.02
  assert abs(_counts("mlp", "cem_widened")["mlp_params"] / swiglu - 1) <= 0.02
  assert {_counts("mlp", r)["attention_params"] for r in ("swiglu", "cem_tied")} == {
      L * 4 * D * D}


def test_design_and_end_to_end_parameter_counts():
  t1 = _counts("design", "t1")["non_embedding_params"]
  assert _counts("design", "t2_fixed")["non_embedding_params"] == t1  # shared across steps
  assert _counts("design", "t1_precond_dlr")["non_embedding_params"] == t1 + L * 2 * (D + D * 8)
  cem = _counts("end_to_end", "cem")["non_embedding_params"]
  llama = _counts("end_to_end", "llama")["non_embedding_params"]
  assert llama > 1.4 * cem
  assert abs(_counts("end_to_end", "llama_matched")["non_embedding_params"] / cem - 1) <= 0.02


@pytest.mark.parametrize("table", ["attention", "mlp", "design", "end_to_end", "neighbours"])
def test_every_row_builds_at_gpu_scale(table):
  module = tables.load_table(table)
  for row in module.ROWS:
    cfg = tables.row_config(module, row, "gpu", 0)
    assert tables.parameter_counts(cfg)["non_embedding_params"] > 0, row


def test_gpu_scale_sizes():
  """The gpu scale (issue 17): 20-30M parameters, >= 100M training tokens a row."""
  d, layers, f, h, vocab = 512, 8, 1376, 8, 8192
  module = tables.load_table("end_to_end")
  cem = tables.parameter_counts(tables.row_config(module, "cem", "gpu", 0))
  llama = tables.parameter_counts(tables.row_config(module, "llama", "gpu", 0))
  norms = (2 * layers + 1) * d
  assert cem["attention_params"] == layers * (2 * d * d + h)  # W_Q, W_K and η per head
  assert cem["mlp_params"] == layers * (2 * d * f + 1)
  assert cem["non_embedding_params"] == cem["attention_params"] + cem["mlp_params"] + norms
  assert cem["params"] == cem["non_embedding_params"] + vocab * d  # tied read-out
  assert llama["non_embedding_params"] == layers * (4 * d * d + 3 * d * f) + norms
  assert 19e6 < cem["params"] < llama["params"] < 30e6
  cfg = tables.row_config(module, "cem", "gpu", 0)
  tokens = cfg.train.num_steps * cfg.train.batch_size * cfg.data.seq_len
  assert tokens >= 100e6 and cfg.model.dtype == "bfloat16"


def test_overrides_parse_to_the_keys_type_and_bad_ones_are_one_line_errors():
  assert tables.parse_overrides(["data.prepared_dir=/d", "train.learning_rate=1e-3",
                                 "train.num_steps=7", "model.rope=false", "data.files=",
                                 "model.tie_embeddings=0", "model.document_mask=1"]) == {
      "data.prepared_dir": "/d", "train.learning_rate": 1e-3, "train.num_steps": 7,
      "model.rope": False, "data.files": "", "model.tie_embeddings": False,
      "model.document_mask": True}
  for pair, message in [("data.prepared_dir", r"allowed: KEY=VALUE"),
                        ("data.prepard_dir=/d", r"no config key 'data.prepard_dir'; did you "
                                                r"mean data.prepared_dir"),
                        ("train.lr=1e-3", r"no config key 'train.lr'; did you mean "
                                          r"train.learning_rate\?$"),
                        ("lr=1e-3", r"no config key 'lr'; did you mean train.learning_rate\?$"),
                        ("model.warmup_steps=3", r"did you mean train.warmup_steps, "),
                        ("train.num_steps=1.5", r"^--set=train.num_steps=1.5; allowed: an "
                                                r"integer$"),
                        ("model.rope=maybe", r"^--set=model.rope=maybe; allowed: true or "
                                             r"false$"),
                        ("mesh.rules=abc", r"mesh.rules is a list; --set takes numbers")]:
    with pytest.raises(ValueError, match=message):
      tables.parse_overrides([pair])


def test_unknown_rows_are_a_one_line_error():
  module = tables.load_table("design")
  assert tables._rows_flag(module, "t2_fixed,t1") == ["t2_fixed", "t1"]
  assert tables._rows_flag(module, None) is None
  with pytest.raises(ValueError, match=r"--rows='t1,t3': not rows of the table: t3; allowed: "):
    tables._rows_flag(module, "t1,t3")
  with pytest.raises(ValueError, match=r"--rows='t1,t2_fixed,t1': t1 given twice"):
    tables._rows_flag(module, "t1,t2_fixed,t1")
  with pytest.raises(ValueError, match=r"--rows=' , ': not rows of the table: none"):
    tables._rows_flag(module, " , ")
  with pytest.raises(ValueError, match=r"--rows='': not rows of the table: none"):
    tables._rows_flag(module, "")  # given empty: not "every row"


def test_the_header_command_writes_the_same_table_again():
  # Every flag that chose the runs is in it (--rows too), quoted for a shell.
  assert tables.command_line("design", "gpu", 1, "/runs/a b", 2, ["t1", "t2_fixed"],
                             ["data.files=/d/x y.txt", "train.learning_rate=1e-3"]) == (
      "python -m cem_jax.tables --table=design --scale=gpu --seeds=1 '--workdir=/runs/a b' "
      "--steps=2 --rows=t1,t2_fixed '--set=data.files=/d/x y.txt' --set=train.learning_rate=1e-3")
  assert tables.command_line("mlp", "tiny", 3, "results/tiny", None, None, []) == (
      "python -m cem_jax.tables --table=mlp --scale=tiny --seeds=3 --workdir=results/tiny")


def test_a_table_config_without_a_scale_is_the_tiny_scale():
  # --config=experiments/paper/design.py:t1 (no ',SCALE') trains the CPU-sized row.
  module = tables.load_table("design")
  assert module.get_config("t1").to_dict() == module.get_config("t1,tiny").to_dict()
  assert (module.get_config("t1").model.d_model, module.get_config("t1").train.batch_size) == (
      D, 16)


def test_a_table_arg_names_the_allowed_rows_and_scales():
  """A typo in ``--config=experiments/paper/TABLE.py:ROW,SCALE`` is one line naming what is
  allowed, not a KeyError from inside the table file."""
  from cem_jax import scales

  rows = {"t1": None, "t2": None}
  assert scales.parse_arg("t2", rows, "design") == ("t2", "tiny")
  assert scales.parse_arg("t1,gpu", rows, "design") == ("t1", "gpu")
  with pytest.raises(ValueError, match=r"^experiments/paper/design\.py:t3; allowed rows: "
                     r"t1, t2$"):
    scales.parse_arg("t3,gpu", rows, "design")
  with pytest.raises(ValueError, match=r"^experiments/paper/design\.py:t1,huge; allowed "
                     r"scales: tiny, gpu, small, paper$"):
    scales.parse_arg("t1,huge", rows, "design")


def test_the_matched_llama_width_is_the_nearest_one_and_at_least_one():
  """4d² + 3d·f' = target solved by hand at d = 2 (4d² = 16, 3d = 6). The tables' own sizes
  solve exactly, so only off-grid targets tell the nearest width from a floor or a ceiling."""
  from cem_jax.scales import matched_llama_mlp_dim

  assert matched_llama_mlp_dim(2, 16 + 6 * 5) == 5
  assert matched_llama_mlp_dim(2, 16 + 6 * 5 + 2) == 5  # f' = 5.33 (a ceiling says 6)
  assert matched_llama_mlp_dim(2, 16 + 6 * 5 + 4) == 6  # f' = 5.67 (a floor says 5)
  assert matched_llama_mlp_dim(2, 10) == 1  # under the attention's 16: no negative width


def test_design_diagnostic_rows_change_what_they_say():
  module = tables.load_table("design")
  cfg = {row: tables.row_config(module, row, "tiny", 0) for row in module.ROWS}
  assert all(c.eval.energy_trace for c in cfg.values())
  assert cfg["t2_eta_half"].model.eta_init == 1 / cfg["t2_eta_half"].model.num_steps == 0.5
  assert cfg["t2_eta_per_step"].model.eta_per_step and cfg["t2_fixed"].model.eta_init == 1.0
  assert cfg["t1_eta_half"].model.eta_init == 0.5 and cfg["t1_eta_half"].model.num_steps == 1
  for t in (1, 2):  # the joint rows differ from their Lie–Trotter rows in the split alone
    joint, trotter = cfg[f"t{t}_joint_eta_half"].model, cfg[f"t{t}_eta_half"].model
    assert joint.split == "joint" and trotter.split == "lie_trotter"
    assert {**joint.to_dict(), "split": "lie_trotter"} == trotter.to_dict()
  for half, full in (("t2_lr_half", "t2_fixed"), ("t1_lr_half", "t1")):
    assert cfg[half].train.learning_rate == cfg[full].train.learning_rate / 2
    assert cfg[half].model.to_dict() == cfg[full].model.to_dict()


def test_each_seed_is_its_own_initialisation_and_data_order():
  module = tables.load_table("design")
  cfgs = [tables.row_config(module, "t1", "tiny", seed) for seed in (0, 2)]
  assert [(c.seed, c.data.shuffle_seed) for c in cfgs] == [(0, 0), (2, 2)]


def test_every_run_is_checked_before_any_trains():
  design, end_to_end = tables.load_table("design"), tables.load_table("end_to_end")
  # the rows differ in the learning rate: overriding it would merge t2_lr_half into t2_fixed
  with pytest.raises(ValueError, match=r"--set=train.learning_rate=\.\.\. overrides what the "
                     r"rows set themselves \(row 't2_lr_half': train.learning_rate=0.0015\)"):
    tables.check_runs(design, "tiny", 1, overrides={"train.learning_rate": 1e-3})
  # only the rows that run are compared: one table's rows retrained with a key they share
  neighbours = tables.load_table("neighbours")
  scale = {"model.embed_scale": 11.3}
  with pytest.raises(ValueError, match=r"\(row 'cem_shared_scaled': model.embed_scale=11.31"):
    tables.check_runs(neighbours, "tiny", 1, overrides=scale)
  with pytest.raises(ValueError, match=r"\(row 'cem_shared_scaled': model.embed_scale=11.31"):
    tables.check_runs(neighbours, "tiny", 1, rows=["cem", "cem_shared", "cem_shared_scaled"],
                      overrides=scale)
  tables.check_runs(neighbours, "tiny", 1, rows=["cem", "cem_shared"], overrides=scale)
  tables.check_runs(design, "tiny", 1, rows=["t1", "t2_fixed"],
                    overrides={"train.learning_rate": 1e-3})
  # valid for the CEM rows, refused for the Llama ones: one line before anything trains
  with pytest.raises(ValueError, match=r"^row 'llama': model.eta_init=0.5 applies to CEM"):
    tables.check_runs(end_to_end, "gpu", 1, overrides={"model.eta_init": 0.5})
  # valid overrides, checked as far as the data: the folder is not there
  with pytest.raises(ValueError,
                     match=r"^row 'llama': data.prepared_dir=/d does not exist; allowed"):
    tables.check_runs(end_to_end, "gpu", 1, overrides={"data.prepared_dir": "/d",
                                                       "data.files": ""})


@pytest.mark.parametrize("key, value, steps, by", [
    ("seed", 7, None, "--seeds (run S has seed S)"),
    ("data.shuffle_seed", 9, 20, "--seeds (run S has seed S)"),
    ("train.num_steps", 50, 20, "--steps=20"),
])
def test_a_set_key_that_the_runner_sets_itself_is_refused_not_ignored(key, value, steps, by,
                                                                     tmp_path):
  # row_config sets the seeds (and --steps the length) after the --set values: the run, and the
  # table's header command, would say 7 where every run was trained with its own seed.
  module = tables.load_table("attention")
  with pytest.raises(ValueError) as e:
    tables.check_runs(module, "tiny", 1, steps, overrides={key: value})
  assert str(e.value) == f"--set={key}=... is set for every run by {by}; leave it out"
  # A data.prepared_dir that is not there: refused before any folder is made.
  with pytest.raises(ValueError, match=r"^row 'llama_mha': data.prepared_dir=.*/nothing does "
                                       r"not exist"):
    tables.run_table(module, "attention", "tiny", 1, str(tmp_path / "w"), steps,
                     overrides={"data.prepared_dir": str(tmp_path / "nothing")})
  assert not (tmp_path / "w").exists()
  # Refused before the --workdir is made: no empty folder left behind.
  with pytest.raises(ValueError, match="leave it out$"):
    tables.run_table(module, "attention", "tiny", 1, str(tmp_path / "w"), steps,
                     overrides={key: value})
  assert not (tmp_path / "w").exists()
  if key == "train.num_steps":  # without --steps, --set is how a table's length changes
    tables.check_runs(module, "tiny", 1, overrides={key: value})


TOY = '''
from cem_jax.config import get_default_config

def _small(c, block):
  c.model.block = block
  c.model.d_model, c.model.num_heads, c.model.mlp_dim, c.model.num_layers = 32, 2, 64, 1
  c.data.seq_len, c.data.vocab_size, c.data.files = 32, 512, FILES
  c.train.batch_size, c.train.num_steps, c.train.warmup_steps = 4, 5, 1
  c.train.eval_every_steps, c.train.log_every_steps, c.eval.max_batches = 5, 1, 2

ROWS = {"llama": lambda c: _small(c, "llama"), "cem": lambda c: _small(c, "cem")}

def get_config(arg):
  row, _, scale = arg.partition(",")
  c = get_default_config()
  ROWS[row](c)
  return c
'''


def _toy_table(tmp_path, shared_data):
  """The 2-row toy table above, written to ``tmp_path/toy.py`` and loaded."""
  toy = tmp_path / "toy.py"
  toy.write_text(TOY.replace("FILES", repr(str(shared_data / "wikitext2_test.txt"))))
  return tables.load_table(str(toy))


def test_runner_writes_the_three_files_and_reruns_nothing(tmp_path, shared_data, monkeypatch,
                                                          caplog):
  module = _toy_table(tmp_path, shared_data)
  workdir = str(tmp_path / "out")
  results = tables.run_table(module, "toy", "tiny", 2, workdir)
  assert sorted((r["row"], r["seed"]) for r in results) == [
      ("cem", 0), ("cem", 1), ("llama", 0), ("llama", 1)]
  # Built-in energies only: the record is empty (a user energy's is tested below).
  assert all(r["energy_digests"] == {} and r["energy_digest_version"] == energies.DIGEST_VERSION
             for r in results)
  rows = tables.aggregate(module, "tiny", results)
  paths = tables.write_outputs(workdir, "toy", rows,
                               tables.eval_curves(workdir, "toy", module, 2), "toy table")
  assert [os.path.basename(p) for p in paths] == ["toy.md", "toy.csv", "toy.png"]
  with open(paths[1]) as f:
    records = list(csv.DictReader(f))
  assert list(records[0]) == tables.COLUMNS
  assert [r["row"] for r in records] == ["llama", "cem"]
  assert all(int(r["seeds"]) == 2 and float(r["eval_loss_std"]) > 0 for r in records)
  assert float(records[0]["delta_loss_mean"]) == 0.0  # the first row is the baseline
  losses = {(r["row"], r["seed"]): r["eval/loss"] for r in results}
  paired = [losses["cem", s] - losses["llama", s] for s in (0, 1)]
  assert float(records[1]["delta_loss_mean"]) == pytest.approx(sum(paired) / 2)
  assert "| llama |" in open(paths[0]).read()
  # Rebuilt another day from the same runs: the committed .md is not touched (only its date
  # would change); other figures are written with the new date.
  dated = lambda day: f"Table toy, scale tiny, 2 seed(s), written 2026-12-{day} (cpu); command: x"
  curves = tables.eval_curves(workdir, "toy", module, 2)
  tables.write_outputs(workdir, "toy", rows, curves, dated("03"))
  before = os.stat(paths[0]).st_mtime_ns
  tables.write_outputs(workdir, "toy", rows, curves, dated("04"))
  assert open(paths[0]).read().startswith(dated("03") + "\n")
  assert os.stat(paths[0]).st_mtime_ns == before
  tables.write_outputs(workdir, "toy", rows[:1], curves, dated("04"))
  assert open(paths[0]).read().startswith(dated("04") + "\n")
  assert "| cem |" not in open(paths[0]).read()
  tables.write_outputs(workdir, "toy", rows, curves, "toy table")

  def no_training(*args, **kwargs):
    raise AssertionError("a finished run was trained again")

  monkeypatch.setattr(train, "train_and_evaluate", no_training)
  again = tables.run_table(module, "toy", "tiny", 2, workdir)
  assert again == results
  # Fewer seeds than were finished: said, since the table would leave seed 1 out.
  caplog.clear()
  assert len(tables.run_table(module, "toy", "tiny", 1, workdir)) == 2
  assert "table toy: rows llama, cem have a finished seed 1 in " in caplog.text
  assert "give --seeds=2 or more to include it" in caplog.text
  # another table with the same rows reuses the finished runs (same resolved config); a killed
  # run of the same config in a row's folder is moved aside (evaluate there would load it)
  partial = tables.run_dir(workdir, "toy_again", "llama", 0)
  os.makedirs(os.path.join(partial, "checkpoints", "1"))
  with open(os.path.join(partial, "config.json"), "w") as f:
    f.write(tables.row_config(module, "llama", "tiny", 0).to_json())
  other = tables.run_table(module, "toy_again", "tiny", 2, workdir)
  assert sorted(os.listdir(partial)) == ["metrics.jsonl", "result.json"]
  assert sorted(os.listdir(partial + ".partial")) == ["checkpoints", "config.json"]
  assert [{k: v for k, v in r.items() if k != "reused_from"} for r in other] == results
  assert all(r["reused_from"] == os.path.join("..", "..", "..", "toy", r["row"], f"seed{r['seed']}")
             for r in other)
  assert tables.eval_curves(workdir, "toy_again", module, 2) == tables.eval_curves(
      workdir, "toy", module, 2)
  # a run trained before a config key existed (its default = the old behaviour) still counts
  run = os.path.join(workdir, "toy", "cem", "seed0")
  saved = json.load(open(os.path.join(run, "config.json")))
  del saved["model"]["document_mask"]
  saved["train"]["profile_steps"] = 3  # a run that was profiled computed the same numbers
  json.dump(saved, open(os.path.join(run, "config.json"), "w"))
  result = json.load(open(os.path.join(run, "result.json")))
  json.dump({**result, "config_digest": "older code"}, open(os.path.join(run, "result.json"), "w"))
  assert tables.run_table(module, "toy", "tiny", 2, workdir)[2]["eval/loss"] == result["eval/loss"]


def test_rows_and_overrides_reach_the_runs_and_the_table(tmp_path, shared_data):
  module = _toy_table(tmp_path, shared_data)
  workdir = str(tmp_path / "out")
  overrides = {"train.learning_rate": 1e-3}
  results = tables.run_table(module, "toy", "tiny", 1, workdir, rows=["cem"],
                             overrides=overrides)
  assert [(r["row"], r["seed"]) for r in results] == [("cem", 0)]
  assert not os.path.exists(os.path.join(workdir, "toy", "llama"))
  saved = json.load(open(os.path.join(workdir, "toy", "cem", "seed0", "config.json")))
  assert saved["train"]["learning_rate"] == 1e-3
  rows = tables.aggregate(module, "tiny", results, rows=["cem"], overrides=overrides)
  assert [r["row"] for r in rows] == ["cem"] and rows[0]["delta_loss_mean"] == 0.0
  # the table shows every row finished with this command's config; cem is the first one here
  assert tables.finished_results(module, "toy", "tiny", 2, workdir,
                                 overrides=overrides) == results
  assert tables.finished_results(module, "toy", "tiny", 1, workdir) == []  # another config
  assert [r["row"] for r in tables.aggregate(module, "tiny", results)] == ["cem"]
  assert tables.aggregate(module, "tiny", []) == []  # nothing finished yet: no row, no error
  assert list(tables.eval_curves(workdir, "toy", module, 1, ["cem"])) == ["cem"]
  # a value one row refuses stops the table before any row trains
  fresh = str(tmp_path / "fresh")
  with pytest.raises(ValueError, match=r"^row 'llama': model.eta_init=0.5 applies to CEM"):
    tables.run_table(module, "toy", "tiny", 1, fresh, rows=["cem", "llama"],
                     overrides={"model.eta_init": 0.5})
  assert not os.path.exists(os.path.join(fresh, "toy"))
  # the same run without the override is another config: refused, not silently reused
  with pytest.raises(ValueError, match="was trained with another config"):
    tables.run_table(module, "toy", "tiny", 1, workdir, rows=["cem"])


def test_unknown_table_is_a_clear_error():
  with pytest.raises(ValueError, match="--table='nope': no file .*known tables: attention"):
    tables.load_table("nope")


@pytest.mark.parametrize("name", ["table.txt", "folder.py"])
def test_a_table_path_that_is_no_python_file_says_so(tmp_path, name):
  # Was "no file table.txt.py" for a table.txt that is there, and "no file" for a folder.
  path = tmp_path / name
  path.mkdir() if name == "folder.py" else path.write_text("ROWS = {}\n")
  with pytest.raises(ValueError) as e:
    tables.load_table(str(path))
  known = ", ".join(sorted(f[:-3] for f in os.listdir(tables.PAPER_DIR) if f.endswith(".py")))
  assert "attention" in known
  assert str(e.value) == (f"--table={str(path)!r} is not a .py file; allowed: a table's name "
                          f"({known}) or the path of a .py file defining ROWS and "
                          "get_config(arg)")


def test_a_table_file_whose_code_raises_is_one_line_naming_it(tmp_path):
  # --table=PATH is the user's file: an import it lacks, or a bug in its get_config, was a
  # traceback (only a SyntaxError was one line).
  path = tmp_path / "mine.py"
  path.write_text("import no_such_module_here\n")
  with pytest.raises(ValueError) as e:
    tables.load_table(str(path))
  assert str(e.value) == (f"--table='{path}': {path}: ModuleNotFoundError: No module named "
                          "'no_such_module_here'")
  path.write_text('ROWS = {"a": None}\n\ndef get_config(arg):\n  return undefined_name\n')
  module = tables.load_table(str(path))
  with pytest.raises(ValueError) as e:
    tables.check_runs(module, "tiny", 1)
  assert str(e.value) == (f"{path}: get_config('a,tiny') raised NameError: name "
                          "'undefined_name' is not defined")


def test_a_table_file_listing_a_row_twice_or_no_row_name_is_one_line(tmp_path):
  # ROWS = ["llama", "cem", "llama"] trained llama once and showed it twice, each with both
  # seeds counted twice (seeds 4, its std over the duplicates: 0.577 for losses 3 and 4).
  path = tmp_path / "mine.py"
  allowed = ("allowed: a dict or list of row names, each once, none empty or holding ',' or "
             "'/'")
  for rows, said in ((["llama", "cem", "llama"], "ROWS has 'llama' listed twice"),
                     (["a,b", "c", "c"], "ROWS has 'c' listed twice; 'a,b' not a row name"),
                     (["x/y", ""], "ROWS has 'x/y', '' not a row name"),
                     ([], "ROWS=[]"), ("llama", "ROWS='llama'")):
    path.write_text(f"ROWS = {rows!r}\n\ndef get_config(arg):\n  return None\n")
    with pytest.raises(ValueError) as e:
      tables.load_table(str(path))
    assert str(e.value) == f"--table='{path}': {path}: {said}; {allowed}", rows
  path.write_text('ROWS = ("a", "b")\n\ndef get_config(arg):\n  return None\n')
  assert tables.load_table(str(path)).ROWS == ("a", "b")


def test_a_tables_own_value_error_is_its_message_unwrapped():
  # get_config's ValueError is already one line for the user (scales.parse_arg's, naming what
  # is allowed); only another exception, a bug in the file, is wrapped with the file's name.
  module = tables.load_table("attention")
  with pytest.raises(ValueError) as e:
    tables.row_config(module, "llama_mha", "huge", 0)
  assert str(e.value) == ("experiments/paper/attention.py:llama_mha,huge; allowed scales: "
                          "tiny, gpu, small, paper")


def test_a_damaged_result_is_a_clear_error_not_a_crash(tmp_path, shared_data):
  module = _toy_table(tmp_path, shared_data)
  bad = tmp_path / "out" / "toy" / "llama" / "seed0" / "result.json"
  bad.parent.mkdir(parents=True)
  bad.write_text('{"row": "llama", "eval/lo')  # cut short by hand
  with pytest.raises(ValueError, match=r"seed0/result.json is not valid JSON .*delete it"):
    tables.run_table(module, "toy", "tiny", 1, str(tmp_path / "out"))
  # Valid JSON without a result's keys (say, written by another tool): named, not a KeyError.
  bad.write_text('{"row": "llama", "seed": 0, "eval/loss": 3.0}')
  with pytest.raises(ValueError, match=r"seed0/result.json lacks eval/bits_per_byte, "
                     r"tokens_per_sec, config_digest; delete it"):
    tables._read_result(str(bad))
  bad.write_text("[]")
  with pytest.raises(ValueError, match=r"seed0/result.json lacks all; delete it"):
    tables._read_result(str(bad))
  # Every key there but of another type (edited by hand): named, not a TypeError in the mean.
  bad.write_text(json.dumps({"row": "llama", "seed": "0", "eval/loss": "3.0",
                             "eval/bits_per_byte": None, "tokens_per_sec": True,
                             "config_digest": "x"}))
  with pytest.raises(ValueError) as e:
    tables._read_result(str(bad))
  assert str(e.value) == (
      f"{bad} has eval/loss='3.0', eval/bits_per_byte=None, tokens_per_sec=True, seed='0'; "
      "allowed: a string row, an integer seed and finite numbers; delete it to train that run "
      "again")
  # The energy record edited by hand: named, not an AttributeError when it is compared.
  for digests in (["x"], {"model.attention_energy": 1}):
    bad.write_text(json.dumps({"row": "llama", "seed": 0, "eval/loss": 3.0,
                               "eval/bits_per_byte": 1.5, "tokens_per_sec": 1.0,
                               "config_digest": "x", "energy_digests": digests}))
    with pytest.raises(ValueError) as e:
      tables._read_result(str(bad))
    assert str(e.value) == (f"{bad} has energy_digests={digests!r}; allowed: an object of "
                            "strings; delete it to train that run again")


def test_a_result_with_integer_numbers_is_read_and_a_bool_seed_or_a_number_row_refused(
    tmp_path):
  # An integer is a number (a result rounded or written by hand); True is not a seed (it would
  # pair with seed 1), nor 3 a row (it would match no row of the table).
  path = tmp_path / "result.json"
  good = {"row": "llama", "seed": 0, "eval/loss": 3, "eval/bits_per_byte": 1.5,
          "tokens_per_sec": 1000, "config_digest": "x"}
  path.write_text(json.dumps(good))
  assert tables._read_result(str(path)) == good
  for bad, shown in (({"seed": True}, "seed=True"), ({"row": 3}, "row=3")):
    path.write_text(json.dumps({**good, **bad}))
    with pytest.raises(ValueError) as e:
      tables._read_result(str(path))
    assert str(e.value) == (f"{path} has {shown}; allowed: a string row, an integer seed and "
                            "finite numbers; delete it to train that run again")


def test_a_result_from_another_config_is_not_reused_silently(tmp_path, shared_data):
  module = _toy_table(tmp_path, shared_data)
  stale = tmp_path / "out" / "toy" / "llama" / "seed0" / "result.json"
  stale.parent.mkdir(parents=True)
  stale.write_text(json.dumps({"row": "llama", "seed": 0, "eval/loss": 3.0,
                               "eval/bits_per_byte": 1.5, "tokens_per_sec": 1.0,
                               "config_digest": "from --steps=3",
                               "numerics_version": NUMERICS_VERSION}))
  with pytest.raises(ValueError, match=r"seed0/result.json was trained with another config"):
    tables.run_table(module, "toy", "tiny", 1, str(tmp_path / "out"))


def test_a_result_from_another_config_names_the_keys_that_differ(tmp_path):
  # "was trained with another config (e.g. another --steps or --scale, ...)" left the user to
  # diff two config.json files: the refusal names the keys, as a resume refusal does.
  run = tmp_path / "seed0"
  run.mkdir()
  (run / "config.json").write_text(tiny_config("llama", **{"train.num_steps": 2}).to_json())
  path = run / "result.json"
  path.write_text(json.dumps({"row": "llama", "seed": 0, "eval/loss": 3.0,
                              "eval/bits_per_byte": 1.5, "tokens_per_sec": 1.0,
                              "config_digest": "of --steps=2",
                              "numerics_version": NUMERICS_VERSION}))
  now = tiny_config("llama", **{"train.num_steps": 3, "train.learning_rate": 1e-3})
  with pytest.raises(ValueError) as e:
    tables._read_result(str(path), "of --steps=3", now)
  assert str(e.value) == (f"{path} was trained with another config (train.learning_rate: 0.003 "
                          "-> 0.001; train.num_steps: 2 -> 3); use a new --workdir, or delete "
                          "that run to train it again")
  assert tables._read_result(str(path), "of --steps=2", now)["row"] == "llama"  # same digest
  (run / "config.json").unlink()  # nothing to compare with: the digests alone refuse it
  with pytest.raises(ValueError, match=r"another config \(e.g. another --steps or --scale, "):
    tables._read_result(str(path), "of --steps=3", now)


def test_an_unfinished_run_from_another_config_is_refused_not_resumed_as_a_mix(tmp_path,
                                                                              shared_data,
                                                                              monkeypatch):
  # A row killed with --steps=60 (checkpoint at step 20), rerun with --steps=30: resuming would
  # continue a 60-step schedule as a 30-step one and record it as the 30-step run's result.
  module = _toy_table(tmp_path, shared_data)
  workdir = tmp_path / "out"
  run = workdir / "toy" / "llama" / "seed0"
  (run / "checkpoints" / "20").mkdir(parents=True)
  started = tables.row_config(module, "llama", "tiny", 0, steps=60)
  (run / "config.json").write_text(started.to_json())
  trained = []
  monkeypatch.setattr(train, "train_and_evaluate", lambda cfg, out: trained.append(out))
  with pytest.raises(ValueError) as e:
    tables.run_table(module, "toy", "tiny", 1, str(workdir), steps=30, rows=["llama"])
  assert str(e.value).startswith(
      f"{run} holds a run started with another config (")
  assert "train.num_steps: 60 -> 30" in str(e.value) and "\n" not in str(e.value)
  assert str(e.value).endswith("use the command that started it, a new --workdir, or delete "
                               "that run to train it again")
  assert trained == [] and not (run / "result.json").exists()
  # Only the remaining steps would differ in a run differing in a compute-only key: resumed.
  computed = tables.row_config(module, "llama", "tiny", 0, steps=30)
  computed.train.gradient_accumulation_steps = 2
  (run / "config.json").write_text(computed.to_json())
  assert tables.run_table(module, "toy", "tiny", 1, str(workdir), steps=30,
                          rows=["llama"]) is None  # the stand-in wrote no final eval
  # Killed before its first checkpoint, the run starts over: nothing would be mixed.
  (run / "config.json").write_text(started.to_json())
  (run / "checkpoints" / "20").rmdir()
  tables.run_table(module, "toy", "tiny", 1, str(workdir), steps=30, rows=["llama"])
  assert trained == [str(run), str(run)]


def test_reusing_a_run_moves_the_rows_unfinished_run_beside_one_moved_aside_before(
    tmp_path, monkeypatch):
  # The row's folder holds a killed run of this config and seed0.partial one from an earlier
  # reuse: both are kept (seed0.partial.2), and the folder holds the reused result only.
  toy = tmp_path / "toy.py"
  toy.write_text(TOY.replace("FILES", "''"))
  module = tables.load_table(str(toy))
  workdir = tmp_path / "out"
  cfg = tables.row_config(module, "llama", "tiny", 0)
  finished = workdir / "toy" / "llama" / "seed0"
  finished.mkdir(parents=True)
  (finished / "config.json").write_text(cfg.to_json())
  write_metrics(finished, [{"step": cfg.train.num_steps, "eval/loss": 3.0}])
  (finished / "result.json").write_text(json.dumps({
      "row": "llama", "seed": 0, "eval/loss": 3.0, "eval/bits_per_byte": 1.5,
      "tokens_per_sec": 1.0, "config_digest": tables.config_digest(cfg),
      "numerics_version": NUMERICS_VERSION}))
  row = workdir / "again" / "llama" / "seed0"
  for folder in (row.parent / "seed0.partial", row):
    (folder / "checkpoints" / "1").mkdir(parents=True)
    (folder / "config.json").write_text(cfg.to_json())
  (row.parent / "seed0.partial" / "earlier").write_text("")
  monkeypatch.setattr(train, "train_and_evaluate",
                      lambda *args: pytest.fail("a reusable run was trained"))
  [result] = tables.run_table(module, "again", "tiny", 1, str(workdir), rows=["llama"])
  assert result["reused_from"] == os.path.join("..", "..", "..", "toy", "llama", "seed0")
  assert sorted(os.listdir(row.parent)) == ["seed0", "seed0.partial", "seed0.partial.2"]
  assert sorted(os.listdir(row)) == ["metrics.jsonl", "result.json"]
  assert sorted(os.listdir(row.parent / "seed0.partial")) == [
      "checkpoints", "config.json", "earlier"]
  assert sorted(os.listdir(row.parent / "seed0.partial.2")) == ["checkpoints", "config.json"]


def _write_finished_run(workdir, row: str, config):
  """``workdir/toy/row/seed0`` with ``config.json`` and a ``result.json`` of ``config`` that
  records neither its text nor its energies (as runs from before those records); returns the
  folder and the result."""
  run = workdir / "toy" / row / "seed0"
  run.mkdir(parents=True)
  (run / "config.json").write_text(config.to_json())
  result = {"row": row, "seed": 0, "eval/loss": 3.0, "eval/bits_per_byte": 1.5,
            "tokens_per_sec": 1.0, "config_digest": tables.config_digest(config),
            "numerics_version": NUMERICS_VERSION}
  (run / "result.json").write_text(json.dumps(result))
  return run, result


def _assert_not_reused(run, digest: str, config, message: str) -> None:
  """The finished run in ``run`` (``WORKDIR/toy/ROW/seed0``) is refused for ``config``:
  reading its result names why (``message``, a pattern), and no finished run is found."""
  with pytest.raises(ValueError, match=message):
    tables._read_result(str(run / "result.json"), digest, config)
  assert tables._finished_run(str(run.parents[2]), digest, config) is None


def test_a_result_on_other_text_under_the_same_file_name_is_not_reused(tmp_path):
  # Two corpora named corpus.txt: the config names data.files by file name (so that runs
  # trained in another checkout count); the record of what was read tells them apart.
  for name, text in (("a", "the first corpus\n" * 50), ("b", "another text\n" * 50),
                     ("c", "the first corpus\n" * 50)):
    (tmp_path / name).mkdir()
    (tmp_path / name / "corpus.txt").write_text(text)
  trained = tiny_config("llama", **{"data.files": str(tmp_path / "a" / "corpus.txt")})
  run, result = _write_finished_run(tmp_path / "w", "llama", trained)
  assert tables.source_record(trained)["files"] == [
      {"path": "corpus.txt", "size": 850,
       "sha256": hashlib.sha256(("the first corpus\n" * 50).encode()).hexdigest()}]
  now = {d: tiny_config("llama", **{"data.files": str(tmp_path / d / "corpus.txt")})
         for d in "bc"}
  # Without a record (a run from before it): judged by its config, by file name.
  tables._read_result(str(run / "result.json"), "another digest", now["b"])
  result["data_source"] = tables.source_record(trained)
  (run / "result.json").write_text(json.dumps(result))
  _assert_not_reused(run, "another digest", now["b"], r"seed0/result.json was trained on other "
                     r"text \(data.files with sha256 \['[0-9a-f]{12}'\], now \['")
  # The same text in another folder is the same data.
  tables._read_result(str(run / "result.json"), "another digest", now["c"])
  assert tables._finished_run(str(tmp_path / "w"), "another digest", now["c"]) == str(run)


def test_a_result_on_other_prepared_tokens_in_the_same_folder_is_not_reused(tmp_path):
  # A run trained from data.prepared_dir recorded the built-in corpus (the config's unused
  # data.builtin) as its text: the folder prepared again from another text, a second command
  # reused the old numbers.
  from cem_jax.data import shard_writer

  texts = {name: "".join(f"{name} line {i}: " + " ".join(str(i * j % 97) for j in range(9))
                         + ".\n" for i in range(400)) for name in ("first", "second")}
  for name, text in texts.items():
    (tmp_path / f"{name}.txt").write_text(text)
  folder = tmp_path / "prepared"

  def prepare(name):
    shutil.rmtree(folder, ignore_errors=True)
    config = tiny_config("llama", **{"data.files": str(tmp_path / f"{name}.txt")})
    shard_writer.prepare(config.data, folder)

  prepare("first")
  trained = tiny_config("llama", **{"data.prepared_dir": str(folder)})
  run, result = _write_finished_run(tmp_path / "w", "llama", trained)
  result["data_source"] = tables.source_record(trained)
  (run / "result.json").write_text(json.dumps(result))
  manifest = json.loads((folder / "manifest.json").read_text())
  assert result["data_source"] == {
      "kind": "prepared", "tokenizer_sha256": manifest["tokenizer"]["sha256"],
      "train_sha256": hashlib.sha256("\n".join(
          s["sha256"] for s in manifest["splits"]["train"]["shards"]).encode()).hexdigest(),
      "validation_sha256": hashlib.sha256("\n".join(
          s["sha256"] for s in manifest["splits"]["validation"]["shards"]).encode()).hexdigest()}
  path, digest = str(run / "result.json"), tables.config_digest(trained)
  tables._read_result(path, digest, trained)
  assert tables._finished_run(str(tmp_path / "w"), digest, trained) == str(run)
  prepare("second")
  tables._source_record.cache_clear()  # a new command
  _assert_not_reused(run, digest, trained, (
      r"seed0/result.json was trained on other text \(data.prepared_dir with tokenizer_sha256 "
      r"[0-9a-f]{12} -> [0-9a-f]{12}, train_sha256 [0-9a-f]{12} -> [0-9a-f]{12}, "
      r"validation_sha256 [0-9a-f]{12} -> [0-9a-f]{12}\); use a new --workdir"))


def test_a_result_of_an_energy_edited_since_is_not_reused(tmp_path, monkeypatch):
  # A row's energy file edited between two table commands (a constant the energy reads, here)
  # has the same config: without the record, the second command printed the old numbers.
  energy = tmp_path / "mine.py"
  source = ("import jax.numpy as jnp\nTAU = {}\n\n\ndef energy(y, context, params, aux):\n"
            "  return TAU * jnp.sum(y ** 2)\n")
  energy.write_text(source.format("2.0"))
  trained = tiny_config("cem", **{"model.attention_energy": f"{energy}:energy"})
  run, result = _write_finished_run(tmp_path / "w", "cem", trained)
  path, digest = str(run / "result.json"), tables.config_digest(trained)
  now = tiny_config("cem", **{"model.attention_energy": f"{energy}:energy"})
  # Without a record (a run from before it): judged by its config.
  tables._read_result(path, digest, now)
  result["energy_digests"] = energies.energy_digests(trained)
  result["energy_digest_version"] = energies.DIGEST_VERSION
  (run / "result.json").write_text(json.dumps(result))
  tables._read_result(path, digest, now)
  assert tables._finished_run(str(tmp_path / "w"), digest, now) == str(run)
  # The file edited, as a new process would import it (a path is imported, and what its
  # energy reads is pinned, once a process).
  module_globals = energies.get(f"{energy}:energy", "attention").energy.__globals__
  monkeypatch.setitem(module_globals, "TAU", 0.25)
  monkeypatch.setattr(energies.digest, "_PINNED", {})
  _assert_not_reused(run, digest, now, (
      r"seed0/result.json was trained with another version of its energy \(model.attention_"
      r"energy: its source, or a constant or helper it reads, changed \(sha256 [0-9a-f]{12} -> "
      r"[0-9a-f]{12}\)\); use a new --workdir, or delete that run to train it again$"))
  # A result of newer code (a digest version this code does not know): said, naming the file.
  result["energy_digest_version"] = energies.DIGEST_VERSION + 1
  (run / "result.json").write_text(json.dumps(result))
  with pytest.raises(ValueError, match=(
      rf"seed0/result.json records energy digests of version {energies.DIGEST_VERSION + 1}, "
      rf"this code knows 1 and {energies.DIGEST_VERSION}: load it with the code that saved it$")):
    tables._read_result(path, digest, now)


def test_a_run_from_older_numerics_is_retrained_not_reused(tmp_path, shared_data, monkeypatch,
                                                           caplog):
  import logging

  from cem_jax.version import NUMERICS_VERSION

  module = _toy_table(tmp_path, shared_data)
  workdir = tmp_path / "out"
  trained = []

  def fake_training(cfg, out):  # writes what a finished run leaves behind, in no time
    trained.append(out)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
      f.write(json.dumps({"step": 5, "train/tokens_per_sec": 1.0}) + "\n")
      f.write(json.dumps({"step": 5, "eval/loss": 2.0, "eval/bits_per_byte": 1.0}) + "\n")
    return {"eval/loss": 2.0, "eval/bits_per_byte": 1.0}

  monkeypatch.setattr(train, "train_and_evaluate", fake_training)
  first = tables.run_table(module, "toy", "tiny", 1, str(workdir))
  assert len(trained) == 2 and all(r["numerics_version"] == NUMERICS_VERSION for r in first)
  # the same rows again: current numerics, nothing retrained; another table reuses them
  tables.run_table(module, "toy", "tiny", 1, str(workdir))
  tables.run_table(module, "toy_again", "tiny", 1, str(workdir))
  assert len(trained) == 2
  # a finished run from before versioning (no numerics_version: version 1)
  run = workdir / "toy" / "cem" / "seed0"
  result = json.loads((run / "result.json").read_text())
  del result["numerics_version"]
  (run / "result.json").write_text(json.dumps({**result, "eval/loss": 9.0}))
  shutil_marker = run / "old_checkpoint_marker"
  shutil_marker.write_text("x")
  with caplog.at_level(logging.INFO):
    again = tables.run_table(module, "toy", "tiny", 1, str(workdir))
  assert trained[2:] == [str(run)]  # trained again, from an empty folder
  assert not (run / "old_checkpoint_marker").exists()
  assert (workdir / "toy" / "cem" / "seed0.numerics_v1" / "old_checkpoint_marker").exists()
  assert [r["eval/loss"] for r in again] == [2.0, 2.0]
  assert any(f"numerics version 1, now {NUMERICS_VERSION}" in r.getMessage()
             for r in caplog.records)
  # a version-1 run elsewhere is never reused by another table
  other = workdir / "toy_again" / "llama" / "seed0"
  src = workdir / "toy" / "llama" / "seed0"
  result = json.loads((src / "result.json").read_text())
  del result["numerics_version"]
  (src / "result.json").write_text(json.dumps(result))
  (other / "result.json").unlink()
  tables.run_table(module, "toy_again", "tiny", 1, str(workdir))
  assert trained[3:] == [str(other)]
  # a version-1 run that reused a run since retrained (its config no longer there to compare):
  # moved aside and trained again, not refused as "another config"
  reused = workdir / "toy_third" / "llama" / "seed0"
  reused.mkdir(parents=True)
  (reused / "result.json").write_text(json.dumps(
      {**result, "config_digest": "v1 digest", "reused_from": "../../../gone/llama/seed0"}))
  tables.run_table(module, "toy_third", "tiny", 1, str(workdir), rows=["llama"])
  assert (workdir / "toy_third" / "llama" / "seed0.numerics_v1" / "result.json").exists()
  now = json.loads((reused / "result.json").read_text())
  assert now["numerics_version"] == NUMERICS_VERSION and now["config_digest"] != "v1 digest"
  # an unfinished run of an older version (no result.json; its first metrics line says the
  # version): its resume would be refused, so it is moved aside whatever its config, not
  # refused as another config's run (here a finished run of the same config is reused in its
  # place)
  unfinished = workdir / "toy_third" / "cem" / "seed0"
  (unfinished / "checkpoints" / "3").mkdir(parents=True)
  (unfinished / "config.json").write_text(
      tables.row_config(module, "cem", "tiny", 0, steps=60).to_json())
  (unfinished / "metrics.jsonl").write_text(
      json.dumps({"step": 0, "numerics_version": NUMERICS_VERSION - 1}) + "\n")
  stale = workdir / "toy_third" / "cem" / f"seed0.numerics_v{NUMERICS_VERSION - 1}"
  stale.mkdir()  # moved aside before (finished with the older code, and met again)
  tables.run_table(module, "toy_third", "tiny", 1, str(workdir), rows=["cem"])
  assert (stale.parent / f"{stale.name}.2" / "metrics.jsonl").exists()
  assert json.loads((unfinished / "result.json").read_text())["numerics_version"] == (
      NUMERICS_VERSION)
  # an unfinished run of this version (its first line says so, later lines need not) is
  # resumed in its folder, not moved aside
  current = workdir / "toy_fourth" / "llama" / "seed0"
  current.mkdir(parents=True)
  (current / "metrics.jsonl").write_text(
      json.dumps({"step": 0, "numerics_version": NUMERICS_VERSION}) + "\n"
      + json.dumps({"step": 2, "train/loss": 3.0}) + "\n")
  tables.run_table(module, "toy_fourth", "tiny", 1, str(workdir), rows=["llama"])
  assert not list(current.parent.glob("seed0.numerics_v*"))


def test_a_preempted_run_writes_no_result_and_stops_the_table(tmp_path, shared_data,
                                                               monkeypatch):
  module = _toy_table(tmp_path, shared_data)
  workdir = tmp_path / "out"
  trained = []

  def preempted_training(cfg, out):  # SIGTERM after step 4 of 5: evals at 2 and 4, no final
    trained.append(out)  # one (an eval a step short of the end is not the final eval)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
      for step in (2, 4):
        f.write(json.dumps({"step": step, "eval/loss": 4.0, "eval/bits_per_byte": 2.0}) + "\n")
    return {"eval/loss": 4.0, "eval/bits_per_byte": 2.0}

  monkeypatch.setattr(train, "train_and_evaluate", preempted_training)
  assert tables.run_table(module, "toy", "tiny", 1, str(workdir)) is None
  assert len(trained) == 1  # the table stopped at the preempted run
  assert not (workdir / "toy" / "llama" / "seed0" / "result.json").exists()


def test_the_table_of_finished_runs_leaves_out_older_numerics_and_pairs_by_seed(tmp_path):
  # Results written by hand (no training): the toy rows on the built-in corpus.
  toy = tmp_path / "toy.py"
  toy.write_text(TOY.replace("FILES", "''"))
  module = tables.load_table(str(toy))
  workdir = str(tmp_path / "out")
  losses = {("llama", 0): 3.0, ("llama", 1): 2.0, ("cem", 0): 2.5, ("cem", 1): 2.25}
  for (row, seed), loss in losses.items():
    out = tables.run_dir(workdir, "toy", row, seed)
    os.makedirs(out)
    version = NUMERICS_VERSION - ((row, seed) == ("cem", 1))  # one run of older numerics
    tables._write_json(os.path.join(out, "result.json"), {
        "row": row, "seed": seed, "eval/loss": loss, "eval/bits_per_byte": 1.0,
        "tokens_per_sec": 1.0, "numerics_version": version,
        "config_digest": tables.config_digest(tables.row_config(module, row, "tiny", seed))})
  results = tables.finished_results(module, "toy", "tiny", 2, workdir)
  assert [(r["row"], r["seed"]) for r in results] == [("llama", 0), ("llama", 1), ("cem", 0)]
  rows = tables.aggregate(module, "tiny", results)
  # the first row is the baseline, paired by seed: cem seed 0 against llama seed 0 only
  assert [(r["row"], r["delta_loss_mean"], r["seeds"]) for r in rows] == [
      ("llama", 0.0, 2), ("cem", -0.5, 1)]
  # A damaged result (the table of --rows=llama reads cem's too): one line, as when the runs
  # are trained, not the row left out of the table without a word.
  damaged = os.path.join(tables.run_dir(workdir, "toy", "cem", 0), "result.json")
  with open(damaged, "w") as f:
    f.write('{"row": "cem", "eval/lo')
  with pytest.raises(ValueError, match=r"seed0/result.json is not valid JSON .*; delete it"):
    tables.finished_results(module, "toy", "tiny", 2, workdir)


def test_the_statistics_of_a_row_and_its_curve_against_numpy(tmp_path):
  # Results and metrics written by hand: sample std (n - 1), perplexity exp(mean loss), the
  # curve the mean over seeds at each step.
  toy = tmp_path / "toy.py"
  toy.write_text(TOY.replace("FILES", "''"))
  module = tables.load_table(str(toy))
  workdir = str(tmp_path / "out")
  # cem's mean (2.2167) is not its median (2.25): a median would be read as the mean
  loss = {"llama": np.array([3.0, 2.0, 2.6]), "cem": np.array([2.5, 2.25, 1.9])}
  bpb = {"llama": np.array([1.5, 1.1, 1.2]), "cem": np.array([1.0, 0.9, 1.3])}
  results = []
  for row in ("llama", "cem"):
    for seed in range(3):
      results.append({"row": row, "seed": seed, "eval/loss": float(loss[row][seed]),
                      "eval/bits_per_byte": float(bpb[row][seed]),
                      "tokens_per_sec": 10.0 * (seed + 1) ** 2})  # mean 46.7, median 40
      out = tables.run_dir(workdir, "toy", row, seed)
      os.makedirs(out)
      with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        # step 15: seed 0 diverged (a null loss), the curve is the mean of the others
        for step, value in ((5, 4.0 + seed), (10, float(loss[row][seed])),
                            (15, 3.0 + seed if seed else None)):
          f.write(json.dumps({"step": step, "eval/loss": value}) + "\n")
  rows = {r["row"]: r for r in tables.aggregate(module, "tiny", results)}
  delta = loss["cem"] - loss["llama"]
  want = {"eval_loss_mean": loss["cem"].mean(), "eval_loss_std": loss["cem"].std(ddof=1),
          "delta_loss_mean": delta.mean(), "delta_loss_std": delta.std(ddof=1),
          "perplexity": np.exp(loss["cem"].mean()), "bits_per_byte_mean": bpb["cem"].mean(),
          "bits_per_byte_std": bpb["cem"].std(ddof=1), "tokens_per_sec": 140 / 3, "seeds": 3}
  np.testing.assert_allclose([rows["cem"][k] for k in want], list(want.values()), rtol=1e-12)
  assert rows["llama"]["delta_loss_mean"] == rows["llama"]["delta_loss_std"] == 0.0
  curves = tables.eval_curves(workdir, "toy", module, 3)
  np.testing.assert_allclose(np.array(curves["cem"]),
                             [[5, 5.0], [10, loss["cem"].mean()], [15, 4.5]], rtol=1e-12)


def _result(row: str, seed: int, loss: float) -> dict:
  return {"row": row, "seed": seed, "eval/loss": loss, "eval/bits_per_byte": 1.0,
          "tokens_per_sec": 1.0}


def test_a_rows_delta_pairs_only_the_seeds_the_baseline_has(tmp_path):
  # aggregate's docstring: the paired Δ is over the seeds both rows have. A seed the baseline
  # lacks is left out (not a KeyError); a row sharing none has no Δ (nan), not a made-up 0.
  toy = tmp_path / "toy.py"
  toy.write_text(TOY.replace("FILES", "''"))
  module = tables.load_table(str(toy))
  rows = tables.aggregate(module, "tiny", [_result("llama", 0, 3.0), _result("cem", 0, 2.5),
                                           _result("cem", 1, 1.0)])
  assert [(r["row"], r["delta_loss_mean"], r["delta_loss_std"], r["seeds"]) for r in rows] == [
      ("llama", 0.0, 0.0, 1), ("cem", -0.5, 0.0, 2)]
  assert [r["paired_seeds"] for r in rows] == [1, 1]
  # Its Markdown cell: one paired seed has no spread ("± 0.0000" read as none), and says so.
  paths = tables.write_outputs(str(tmp_path), "t", rows, {"cem": [(1, 2.0)]}, "header")
  assert open(paths[0]).read().splitlines()[5].split(" | ")[7] == "-0.5000 (1 of 2 seeds)"
  # TABLE.csv's columns named here, not read back from tables.COLUMNS: a column dropped
  # there would pass a comparison with itself
  assert csv.DictReader(open(paths[1])).fieldnames == [
      "row", "params", "non_embedding_params", "attention_params", "mlp_params",
      "flops_per_token", "eval_loss_mean", "eval_loss_std", "delta_loss_mean", "delta_loss_std",
      "perplexity", "bits_per_byte_mean", "bits_per_byte_std", "tokens_per_sec", "seeds"]
  assert list(csv.DictReader(open(paths[1])))[1].keys() == set(tables.COLUMNS)
  _, cem = tables.aggregate(module, "tiny", [_result("llama", 1, 3.0), _result("cem", 0, 2.5)])
  assert math.isnan(cem["delta_loss_mean"]) and cem["delta_loss_std"] == 0.0
  paths = tables.write_outputs(str(tmp_path), "t", [_, cem], {"cem": [(1, 2.0)]}, "header")
  assert open(paths[0]).read().splitlines()[5].split(" | ")[7] == "n/a (no seed in common)"


def test_a_diverged_rows_perplexity_is_capped_as_eval_perplexity_not_an_overflow(tmp_path):
  # A finished run whose final eval is 800 nats/token (a diverged model with finite
  # parameters): math.exp(800) raised OverflowError and no table was written.
  toy = tmp_path / "toy.py"
  toy.write_text(TOY.replace("FILES", "''"))
  module = tables.load_table(str(toy))
  rows = tables.aggregate(module, "tiny", [_result("llama", 0, 3.0), _result("cem", 0, 800.0)])
  assert rows[0]["perplexity"] == pytest.approx(math.exp(3.0), rel=1e-12)
  assert rows[1]["perplexity"] == math.exp(80.0) and rows[1]["eval_loss_mean"] == 800.0


def test_the_markdown_rows_units_signs_and_spreads_by_hand(tmp_path):
  # The committed TABLE.md figures: parameters in millions (10⁶, not 2²⁰), FLOPs in GFLOP
  # (10⁹), the paired Δ with its sign, "± std" only over several seeds, whole tokens/s.
  two = {"row": "cem", "params": 1_234_567, "non_embedding_params": 1_000_000,
         "attention_params": 250_000, "mlp_params": 500_000, "flops_per_token": 2.5e8,
         "eval_loss_mean": 3.0, "eval_loss_std": 0.1, "delta_loss_mean": -0.05,
         "delta_loss_std": 0.02, "perplexity": 20.0855, "bits_per_byte_mean": 1.5,
         "bits_per_byte_std": 0.03, "tokens_per_sec": 1234.4, "seeds": 2}
  one = {**two, "row": "one", "delta_loss_mean": 0.05, "seeds": 1}
  paths = tables.write_outputs(str(tmp_path), "t", [two, one], {"cem": [(1, 3.0)]}, "header")
  assert open(paths[0]).read().splitlines()[4:] == [
      "| cem | 1.235M | 1.000M | 0.250M | 0.500M | 0.2500 | 3.0000 ± 0.1000 | -0.0500 ± 0.0200 "
      "| 20.09 | 1.5000 ± 0.0300 | 1234 |",
      "| one | 1.235M | 1.000M | 0.250M | 0.500M | 0.2500 | 3.0000 | +0.0500 | 20.09 | 1.5000 "
      "| 1234 |"]
  # A row with a user energy: its FLOPs are not known, said under the table.
  mine = {**one, "row": "mine", "flops_per_token": None}
  paths = tables.write_outputs(str(tmp_path), "t", [two, mine], {"cem": [(1, 3.0)]}, "header")
  assert open(paths[0]).read().splitlines()[5:] == [
      "| mine | 1.235M | 1.000M | 0.250M | 0.500M | n/a | 3.0000 | +0.0500 | 20.09 | 1.5000 "
      "| 1234 |", "",
      "GFLOP/token n/a: a row with a user energy, whose own operations the analytic count "
      "(cem_jax.model_stats) does not model."]
  assert open(paths[1]).read().splitlines()[2].split(",")[5] == ""


def test_a_rows_rate_leaves_out_the_first_log_and_its_loss_is_the_last_eval(tmp_path, shared_data,
                                                                             monkeypatch):
  module = _toy_table(tmp_path, shared_data)

  def trained(cfg, out):  # the first log's rate is the warm-up: left out of the median
    os.makedirs(out, exist_ok=True)
    # the last eval (what result.json and the table report), and an earlier better one
    final = {"eval/loss": 3.0, "eval/bits_per_byte": 1.5, "eval/best_loss": 2.5,
             "eval/best_bits_per_byte": 1.25, "eval/best_step": 3}
    # cem logs once (say --steps below train.log_every_steps): that rate is all there is.
    # llama's rates after the first: median 90, mean 70 (a mean would follow one slow log).
    logs = {"llama": ((1, 1.0), (2, 100.0), (3, 90.0), (4, 20.0)), "cem": ((3, 50.0),)}
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
      for step, rate in logs[cfg.model.block]:
        f.write(json.dumps({"step": step, "train/tokens_per_sec": rate}) + "\n")
      f.write(json.dumps({"step": cfg.train.num_steps, **final}) + "\n")
    return final

  monkeypatch.setattr(train, "train_and_evaluate", trained)
  results = tables.run_table(module, "toy", "tiny", 1, str(tmp_path / "out"))
  assert [r["tokens_per_sec"] for r in results] == [90.0, 50.0]
  assert [(r["eval/loss"], r["eval/bits_per_byte"]) for r in results] == [(3.0, 1.5)] * 2


def test_a_run_whose_final_eval_is_not_finite_is_refused_not_recorded_as_nan(tmp_path,
                                                                            shared_data,
                                                                            monkeypatch):
  # Finite parameters, a NaN final eval (bf16 logits overflowing): result.json held NaN (not
  # JSON), and every later table command ended in statistics.stdev's AttributeError traceback.
  module = _toy_table(tmp_path, shared_data)
  out = tmp_path / "out"

  def trained(cfg, run):
    os.makedirs(run, exist_ok=True)
    final = {"eval/loss": 3.0 + cfg.seed, "eval/bits_per_byte": 1.5}
    if cfg.model.block == "cem" and cfg.seed == 1:
      final["eval/loss"] = math.nan
    shown = {k: None if math.isnan(v) else v for k, v in final.items()}  # as the writer does
    write_metrics(run, [{"step": cfg.train.num_steps, "train/tokens_per_sec": 9.0},
                        {"step": cfg.train.num_steps, **shown}])
    return final

  monkeypatch.setattr(train, "train_and_evaluate", trained)
  run = tables.run_dir(str(out), "toy", "cem", 1)
  with pytest.raises(FloatingPointError) as e:
    tables.run_table(module, "toy", "tiny", 2, str(out))
  assert str(e.value) == (
      "table toy: row cem seed 1: its final eval at step 5 is not finite (eval/loss=nan); no "
      f"result.json written; lower train.learning_rate (or change the row), then delete {run} "
      "to train it again")
  assert not os.path.exists(os.path.join(run, "result.json"))
  # One written so by older code (json.dumps writes NaN, json.load reads it): named in one
  # line, not a traceback from the row's statistics.
  for value, shown in ((math.nan, "nan"), (math.inf, "inf")):
    with open(os.path.join(run, "result.json"), "w") as f:
      json.dump({"row": "cem", "seed": 1, "eval/loss": value, "eval/bits_per_byte": 1.5,
                 "tokens_per_sec": 1.0, "config_digest": "x"}, f)
    with pytest.raises(ValueError) as e:
      tables.finished_results(module, "toy", "tiny", 2, str(out))
    assert str(e.value) == (f"{run}/result.json has eval/loss={shown}; allowed: a string row, "
                            "an integer seed and finite numbers; delete it to train that run "
                            "again")


def test_row_config_saves_a_set_energy_file_absolute(tmp_path, monkeypatch):
  """`--set=model.mlp_energy=my.py:fn` from some folder: the run's config (which evaluate and
  sample reload, from anywhere) must name the file absolutely, as main does."""
  monkeypatch.chdir(tmp_path)
  module = tables.load_table("mlp")
  cfg = tables.row_config(module, "cem_tied", "tiny", 0,
                          overrides={"model.mlp_energy": "my.py:gate"})
  assert cfg.model.mlp_energy == f"{tmp_path}/my.py:gate"
  assert cfg.model.attention_energy == "softmax"


def test_a_row_with_a_user_energy_has_no_flops_figure(tmp_path):
  # The analytic count is of the built-in energies: a user energy's row showed the built-in's.
  (tmp_path / "my.py").write_text("import jax.numpy as jnp\n\n\ndef gate(y, context, params, "
                                  "aux):\n  return jnp.sum(y * y) * params['eta']\n")
  module = tables.load_table("mlp")
  overrides = {"model.mlp_energy": f"{tmp_path}/my.py:gate"}
  rows = tables.aggregate(module, "tiny", [_result("cem_tied", 0, 3.0)], rows=["cem_tied"],
                          overrides=overrides)
  assert rows[0]["flops_per_token"] is None
  (row,) = tables.aggregate(module, "tiny", [_result("cem_tied", 0, 3.0)], rows=["cem_tied"])
  cfg = tables.row_config(module, "cem_tied", "tiny", 0)
  assert row["flops_per_token"] == model_stats.flops_per_token(cfg.model, cfg.data.vocab_size,
                                                               cfg.data.seq_len) > 0


def test_a_finished_run_counts_for_a_row_that_only_computes_it_differently(tmp_path):
  # E.g. --set=train.gradient_accumulation_steps=4 for a scale that does not fit one device.
  from cem_jax.config import get_default_config

  (tmp_path / "config.json").write_text(get_default_config().to_json())
  now = get_default_config()
  now.train.gradient_accumulation_steps, now.model.remat = 4, "full"
  now.model.attention_impl, now.model.energy_block_size = "xla", 64
  assert tables._same_config(str(tmp_path), now)
  now.train.learning_rate = 1e-3
  assert not tables._same_config(str(tmp_path), now)


def test_a_run_predating_a_key_counts_only_with_that_key_at_its_default(tmp_path):
  # A key added since the run was trained: the run stands for the new config only where the key
  # keeps its default (the old behaviour), never for a row that sets it.
  saved = tiny_config("llama").to_dict()
  del saved["train"]["min_learning_rate_ratio"]  # the run predates the key
  (tmp_path / "config.json").write_text(json.dumps(saved))
  assert tables._same_config(str(tmp_path), tiny_config("llama"))
  assert not tables._same_config(
      str(tmp_path), tiny_config("llama", **{"train.min_learning_rate_ratio": 0.5}))
  # A key the run had and the defaults no longer have (an option since removed): what it chose
  # cannot be told to be today's behaviour, so the run does not count.
  saved = tiny_config("llama").to_dict()
  saved["train"]["removed_option"] = 1
  (tmp_path / "config.json").write_text(json.dumps(saved))
  assert not tables._same_config(str(tmp_path), tiny_config("llama"))


def _table_flags(monkeypatch, out, table="design", seeds=1, **values):
  """tables.main's flags as a stand-in FlagValues (its own are defined only when it runs as a
  program): ``--table``, ``--workdir`` (``out``), ``--seeds``, the rest at their defaults, then
  ``values`` set on them."""
  from absl import flags

  fv = flags.FlagValues()
  for name, default in (("table", table), ("scale", "tiny"), ("workdir", str(out)),
                        ("rows", None)):
    flags.DEFINE_string(name, default, "", flag_values=fv)
  flags.DEFINE_integer("seeds", seeds, "", flag_values=fv)
  flags.DEFINE_integer("steps", None, "", flag_values=fv)
  flags.DEFINE_multi_string("set", [], "", flag_values=fv)
  fv(["tables"])
  for name, value in values.items():
    fv[name].value = value
  monkeypatch.setattr(flags, "FLAGS", fv)


def test_a_diverged_run_or_damaged_curve_is_one_line_from_the_command(tmp_path, monkeypatch,
                                                                      capsys):
  # tables.main on stand-ins: a run that diverges (FloatingPointError, as train raises it) and
  # a damaged metrics line met while drawing the curves end in one line, exit status 1.
  _table_flags(monkeypatch, tmp_path)

  def diverge(*args):
    raise FloatingPointError("train/loss is not finite at step 3 of row t1")

  monkeypatch.setattr(tables, "run_table", diverge)
  with pytest.raises(SystemExit) as e:
    tables.main([])
  assert e.value.code == 1
  assert capsys.readouterr().err == "error: train/loss is not finite at step 3 of row t1\n"

  def damaged(*args):
    raise ValueError("seed0/metrics.jsonl:2 is not valid JSON")

  monkeypatch.setattr(tables, "run_table", lambda *args: [])
  monkeypatch.setattr(tables, "aggregate", lambda *args: [])
  monkeypatch.setattr(tables, "eval_curves", damaged)
  with pytest.raises(SystemExit):
    tables.main([])
  assert capsys.readouterr().err == "error: seed0/metrics.jsonl:2 is not valid JSON\n"


def test_the_tables_curves_are_of_the_runs_in_the_table_only(tmp_path, monkeypatch, capsys):
  # A row's seed 1 killed mid-run (no result.json) is not in the table's figures: its curve
  # must not be averaged into the row's plotted mean either (tables.main, stand-in flags).
  toy = tmp_path / "toy.py"
  toy.write_text(TOY.replace("FILES", "''"))
  workdir = tmp_path / "out"
  for seed, loss in ((0, 3.0), (1, 9.0)):
    (workdir / "toy" / "llama" / f"seed{seed}").mkdir(parents=True)
    write_metrics(workdir / "toy" / "llama" / f"seed{seed}",
                  [{"step": 5, "eval/loss": loss, "eval/bits_per_byte": 1.0}])
  result = {"row": "llama", "seed": 0, "eval/loss": 3.0, "eval/bits_per_byte": 1.0,
            "tokens_per_sec": 1.0, "config_digest": "x", "numerics_version": NUMERICS_VERSION}
  _table_flags(monkeypatch, workdir, table=str(toy), seeds=2)
  monkeypatch.setattr(tables, "run_table", lambda *args: [result])
  drawn = []

  def write_outputs(workdir, table, rows, curves, header, seeds=None, missing=()):
    drawn.append(curves)
    (tmp_path / "toy.md").write_text(header)
    return [str(tmp_path / "toy.md")]

  monkeypatch.setattr(tables, "write_outputs", write_outputs)
  tables.main([])
  assert drawn == [{"llama": [(5, 3.0)]}]  # not (5, 6.0), the mean with the killed seed


def test_a_table_of_a_partial_set_of_runs_says_which_seeds_and_rows_it_lacks(tmp_path,
                                                                            monkeypatch):
  # --rows=llama --seeds=3 shows every row finished in the workdir: cem with 1 of its 3 seeds
  # read "2.5000" under a "3 seed(s)" header, and a row with no finished run just was not there.
  toy = tmp_path / "toy.py"
  toy.write_text(TOY.replace("FILES", "''"))
  module = tables.load_table(str(toy))
  workdir = tmp_path / "out"
  losses = {("llama", 0): 3.0, ("llama", 1): 2.0, ("llama", 2): 2.6, ("cem", 0): 2.5}
  for (row, seed), loss in losses.items():
    out = tables.run_dir(str(workdir), "toy", row, seed)
    os.makedirs(out)
    write_metrics(out, [{"step": 5, "eval/loss": loss}])
    tables._write_json(os.path.join(out, "result.json"), {
        "row": row, "seed": seed, "eval/loss": loss, "eval/bits_per_byte": 1.0,
        "tokens_per_sec": 1.0, "numerics_version": NUMERICS_VERSION,
        "config_digest": tables.config_digest(tables.row_config(module, row, "tiny", seed))})
  _table_flags(monkeypatch, workdir, table=str(toy), seeds=3, rows="llama")
  monkeypatch.setattr(tables, "run_table", lambda *args: [])  # finished: nothing to train
  tables.main([])
  md = (workdir / "toy.md").read_text().splitlines()
  assert [line.split(" | ")[6] for line in md[4:6]] == ["2.5333 ± 0.5033",
                                                        "2.5000 (1 of 3 seeds)"]
  assert len(md) == 6  # every row there: no note under the table
  shutil.rmtree(tables.run_dir(str(workdir), "toy", "cem", 0))
  tables.main([])
  md = (workdir / "toy.md").read_text().splitlines()
  assert md[4:] == [md[4], "", f"Not in the table (no run finished with this command's config "
                    f"in {workdir}): cem."]


def test_a_run_of_the_table_without_an_eval_loss_in_its_metrics_is_one_line(tmp_path):
  # A finished run (result.json) whose metrics.jsonl is gone, empty or all null: its row's
  # plotted mean would silently leave it out; a run not in the table is left out as before.
  toy = tmp_path / "toy.py"
  toy.write_text(TOY.replace("FILES", "''"))
  module = tables.load_table(str(toy))
  workdir = str(tmp_path / "out")
  run = tmp_path / "out" / "toy" / "llama" / "seed0"
  run.mkdir(parents=True)
  message = (f"{run / 'metrics.jsonl'} has no eval loss, but the table shows that run (its "
             "result.json); restore it, or delete the run to train it again")
  for lines in (None, [], [{"step": 5, "train/loss": 3.0}, {"step": 5, "eval/loss": None}]):
    if lines is not None:
      write_metrics(run, lines)
    with pytest.raises(ValueError) as e:
      tables.eval_curves(workdir, "toy", module, 1, ["llama"], {("llama", 0)})
    assert str(e.value) == message
    assert tables.eval_curves(workdir, "toy", module, 1, ["llama"], set()) == {"llama": []}
  write_metrics(run, [{"step": 5, "eval/loss": 3.0}])
  assert tables.eval_curves(workdir, "toy", module, 1, ["llama"], {("llama", 0)}) == {
      "llama": [(5, 3.0)]}
  # Without runs: every seed with a metrics.jsonl (seed 1 never started: left out, no error).
  assert tables.eval_curves(workdir, "toy", module, 2, ["llama"]) == {"llama": [(5, 3.0)]}


def test_bad_seeds_steps_or_workdir_are_refused_before_any_run(tmp_path, monkeypatch, capsys):
  # One line naming the flag and exit status 1 before anything trains (a --seeds=0 table would
  # be empty; a file as --workdir would end in a bare OS error): tables.main, stand-in flags.
  (tmp_path / "file").write_text("")
  monkeypatch.setattr(tables, "run_table", lambda *args: pytest.fail("a run started"))
  for name, value, error in (
      ("seeds", 0, "--seeds=0; allowed: an int >= 1"),
      ("steps", 0, "--steps=0; allowed: an int >= 1 and < 2**31"),
      ("workdir", str(tmp_path / "file"),
       f"--workdir={tmp_path / 'file'} is a file; give a folder (created if missing)")):
    _table_flags(monkeypatch, tmp_path / "out", **{name: value})
    with pytest.raises(SystemExit) as e:
      tables.main([])
    assert (e.value.code, capsys.readouterr().err) == (1, f"error: {error}\n"), name


def _md_tables(text: str) -> list[list[list[str]]]:
  """Every markdown table in ``text``: a list of rows of cells, the separator row left out."""
  found, rows = [], []
  for line in text.splitlines() + [""]:
    if line.startswith("|"):
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if not all(set(c) <= set("-:") for c in cells):
        rows.append(cells)
    elif rows:
      found.append(rows)
      rows = []
  return found


def _numbers(cell: str) -> list[float]:
  """``"−0.079 ± 0.123"`` -> ``[-0.079, 0.123]``; ``"2.168"`` -> ``[2.168]``."""
  return [float(part) for part in cell.replace("−", "-").split("±")]


def test_reproducing_md_quotes_the_committed_tables():
  """Each table section of docs/REPRODUCING.md (``### NAME (`results/SCALE/TABLE.md`...``)
  opens with a summary of that table, typed by hand: every row it lists must be in the
  committed table with the same parameter counts and FLOPs and the same eval loss, Δ and bits
  per byte to the 3 decimals it quotes."""
  import re
  from pathlib import Path

  root = Path(__file__).resolve().parents[1]
  doc = (root / "docs" / "REPRODUCING.md").read_text()
  sections = re.findall(r"^### (\w+) \(`(results/\w+/\w+\.md)`[^\n]*\n(.*?)(?=^### |\Z)", doc,
                        re.M | re.S)
  assert {name for name, _, _ in sections} >= {"attention", "mlp", "end_to_end", "design",
                                               "neighbours"}
  column = {"non-emb. params": "non-emb.", "attention params": "attention",
            "MLP params": "MLP", "GFLOP/token": "GFLOP/token", "eval loss": "eval loss",
            "bits/byte": "bits/byte"}
  checked = 0
  for name, path, body in sections:
    quoted = _md_tables(body)[0]
    committed = _md_tables((root / path).read_text())[0]
    heads = committed[0]
    rows = {r[0]: dict(zip(heads, r, strict=True)) for r in committed[1:]}
    for row in quoted[1:]:
      where = f"docs/REPRODUCING.md, {name}, row {row[0]}"
      assert row[0] in rows, f"{where}: not in {path}"
      got = rows[row[0]]
      for head, cell in zip(quoted[0], row, strict=True):
        if head == "row":
          continue
        if head.startswith("Δ vs "):
          base = head.split()[2]
          want = got[f"Δ loss vs {base} (paired)"]
        else:
          want = got[column[head]]
        if head in ("non-emb. params", "attention params", "MLP params", "GFLOP/token"):
          assert cell == want, f"{where}, {head}: {cell} quoted, {want} in {path}"
        else:  # 3 decimals quoted of the table's 4; a mean alone, or a mean ± std
          quoted_numbers, table_numbers = _numbers(cell), _numbers(want)
          pairs = list(zip(quoted_numbers, table_numbers, strict=False))
          assert len(quoted_numbers) <= len(table_numbers) and all(
              abs(a - b) <= 5e-4 + 1e-9 for a, b in pairs), (  # correctly rounded
              f"{where}, {head}: {cell} quoted, {want} in {path}")
        checked += 1
  assert checked >= 100  # every section's table was read


def test_config_digest_is_the_one_the_committed_results_record():
  """A table reuses a finished run by its ``result.json``'s ``config_digest``; a digest formula
  that drifted (the copy in tables.py beside workdir.config_digest did) would retrain every
  committed run. Each committed run's digest is recomputed here from its ``config.json`` by
  hand (sha256 of the JSON with keys sorted) and through ``tables.config_digest``."""
  from pathlib import Path

  import ml_collections

  root = Path(__file__).resolve().parents[1]
  checked = 0
  for path in sorted((root / "results").glob("*/*/*/seed*/result.json")):
    result = json.loads(path.read_text())
    if "reused_from" in result:  # its digest is the run it reuses
      continue
    saved = json.loads((path.parent / "config.json").read_text())
    by_hand = hashlib.sha256(json.dumps(saved, sort_keys=True).encode()).hexdigest()
    assert result["config_digest"] == by_hand, path
    assert tables.config_digest(ml_collections.ConfigDict(saved)) == by_hand, path
    checked += 1
  assert checked >= 100  # the committed tiny tables


def test_aggregate_of_results_of_no_row_asked_for_is_no_rows():
  # Mutation (adversary s50): aggregate without its `if not names: return []`; [] alone does not
  # reach names[0] (the comprehension over no results never reads it), results of a row not
  # asked for do: an IndexError.
  import types

  module = types.SimpleNamespace(ROWS=["cem", "llama"])
  results = [{"row": "llama", "seed": 0, "eval/loss": 3.0}]
  assert tables.aggregate(module, "tiny", results, rows=["cem"]) == []


def test_gpu_tables_checks_of_two_corpora_train_in_folders_of_their_own(tmp_path):
  # Both checks once shared /tmp/cem_gpu_tables_check/tiny_steps2, where the second corpus's
  # runs (another data.prepared_dir in their config) were refused as another config.
  import subprocess
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  stub = tmp_path / "bin"
  stub.mkdir()
  # Stands in for python3 -m cem_jax.tables: records its --workdir, writes the table files.
  (stub / "python3").write_text(
      '#!/bin/sh\nfor a in "$@"; do case "$a" in --workdir=*) w="${a#--workdir=}";; '
      '--table=*) t="${a#--table=}";; esac; done\n'
      'echo "$w" >> "$LOG"; touch "$w/$t.md" "$w/$t.csv" "$w/$t.png"\n')
  (stub / "python3").chmod(0o755)
  seen = []
  for corpus in ("a", "b"):
    (tmp_path / corpus).mkdir()
    (tmp_path / corpus / "manifest.json").write_text("{}")
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", SCALE="tiny", STEPS="2",
               TMPDIR=str(tmp_path / "tmp"), LOG=str(tmp_path / "log"))
    env.pop("WORKDIR", None)
    proc = subprocess.run(["bash", os.path.join(repo, "experiments", "gpu_tables.sh"),
                           str(tmp_path / corpus), str(tmp_path / f"out_{corpus}"), "mlp"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    key = hashlib.sha256(str(tmp_path / corpus).encode()).hexdigest()[:8]
    seen.append(str(tmp_path / "tmp" / "cem_gpu_tables_check" / f"tiny_steps2_{key}"))
  assert (tmp_path / "log").read_text().split() == seen and seen[0] != seen[1]


def test_check_runs_checks_the_first_and_last_seed_of_each_row(monkeypatch):
  # A run's seed sets only seed and data.shuffle_seed (ranges): --seeds=10**21 was checked seed
  # by seed, for ever, before anything was said. The seeds each row's config was checked with:
  module = tables.load_table("mlp")
  checked, row_config = [], tables.row_config

  def counted(module, row, scale, seed, *args):
    checked.append(seed)
    assert len(checked) < 100, "check_runs went through the seeds one by one"
    return row_config(module, row, scale, seed, *args)

  monkeypatch.setattr(tables, "row_config", counted)
  tables.check_runs(module, "tiny", 2**63)
  rows = len(module.ROWS)
  assert checked == [0] * rows + [0, 2**63 - 1] * rows  # each row's own, then each row's
  del checked[:]
  tables.check_runs(module, "tiny", 1)
  assert checked == [0] * rows * 2
  del checked[:]
  with pytest.raises(ValueError, match=r"^row '\w+': seed=9223372036854775808; allowed: an int "
                                       r">= 0 and < 2\*\*63$"):
    tables.check_runs(module, "tiny", 2**63 + 1)
