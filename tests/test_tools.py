"""Inspection and sharding rules: counts equal the built model; specs follow the rules."""

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import pytest
from conftest import (
  RUN_MODULE_REPORTING_JAX,
  TRACED_T2,
  drop_exceptions,
  program_json,
  subprocess_env,
  tiny_config,
  tool_runs,
  write_metrics,
)
from flax import nnx
from jax.sharding import PartitionSpec as P

from cem_jax import axes, cli, files, integrity, plot, preflight, runs, sharding, signals
from cem_jax import config as config_lib
from cem_jax import summary as summary_lib
from cem_jax import workdir as workdir_lib
from cem_jax.model import DecoderLM
from cem_jax.model_stats import count_params
from cem_jax.workdir import (
  Preemption,
  exclusive,
  last_eval_in,
  prepare_workdir,
  prepared_folders,
  remove_prepared_since,
)


@pytest.mark.parametrize("overrides", [
    {"model.block": "llama"},
    {"model.block": "cem", "model.diagonal": "per_head", "model.precond": "both",
     "model.precond_rank": 4, "model.num_steps": 2, "model.tie_embeddings": False},
])
def test_inspect_totals_equal_the_built_model(overrides):
  cfg = tiny_config(**overrides)
  s = summary_lib.summary(cfg, vocab_size=300)
  built = DecoderLM(cfg.model, 300, rngs=nnx.Rngs(0))
  assert s["totals"]["params"] == count_params(built)
  assert sum(r["count"] for r in s["rows"]) == count_params(built)
  assert s["totals"]["attention"] == sum(count_params(b.attn) for b in built.blocks)
  assert s["totals"]["mlp"] == sum(count_params(b.mlp) for b in built.blocks)
  embedding = 300 * cfg.model.d_model * (1 if cfg.model.tie_embeddings else 2)
  assert s["totals"]["non_embedding"] == count_params(built) - embedding
  # A training token costs forward + backward: 3x the forward FLOPs.
  assert s["flops_per_token"]["train"] == 3 * s["flops_per_token"]["forward"]
  if cfg.model.block == "llama":  # L(8d² + 6df + 4nd) + 2dV, d=64, f=128, n=64, L=2, V=300
    forward = 2 * (8 * 64**2 + 6 * 64 * 128 + 4 * 64 * 64) + 2 * 64 * 300
    assert s["flops_per_token"]["forward"] == forward


@pytest.mark.parametrize("tool", ["sample", "evaluate"])
def test_the_tools_that_load_a_run_list_attention_impl_in_their_help(tool):
  # Defined once in cli (for its caller), or absl's --help would leave it out of a tool's own.
  proc = subprocess.run([sys.executable, "-m", f"cem_jax.{tool}", "--help"],
                        capture_output=True, text=True, timeout=300)
  own = proc.stdout.split("Try --helpfull")[0]
  assert "--attention_impl: <auto|xla|cudnn|splash>: The attention kernel" in own, own[-1500:]


def test_help_exits_0_with_the_usage_on_stdout():
  # absl's help flags exit with status 1, which read as a failure (`main --help && ...`).
  # First --help=false, which asks for no help: the left-out flags are still refused (later,
  # the flags a help left parsed stay set in this one interpreter).
  cases = [["--help=false"], ["--help"], ["-?"], ["--helpshort"], ["--helpfull"],
           ["-help=true"], ["--config=experiments/tiny.py", "--help"]]
  results = tool_runs("main", cases)
  for args, (code, out, err, loaded) in zip(cases[1:], results[1:], strict=True):
    assert code == 0 and err == "" and loaded == [], (args, code, err[-1500:], loaded)
    assert "--workdir: Folder for metrics" in out, (args, out[-1500:])
  code, out, err, _ = results[0]
  assert code == 1 and out == "" and err.startswith("error: --config is required"), (code, err)
  # The experiments' absl scripts parse with cli's parser too.
  proc = subprocess.run([sys.executable, "experiments/collapse.py", "--help"],
                        capture_output=True, text=True, timeout=300, env=subprocess_env(),
                        cwd=Path(__file__).resolve().parents[1])
  assert proc.returncode == 0 and "--workdir: A training run's" in proc.stdout, proc.stderr


def test_inspect_cli_prints_the_summary():
  proc = subprocess.run([sys.executable, "-m", "cem_jax.inspect",
                         "--config=experiments/tiny.py:llama"], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "parameters: 1,180,800 total" in proc.stdout
  assert "['blocks'][0]['attn']['w_o']" in proc.stdout
  # Under its old name too, --help lists summary's own flags (absl lists the main module's).
  proc = subprocess.run([sys.executable, "-m", "cem_jax.inspect", "--help"], capture_output=True,
                        text=True, timeout=300)
  assert "--config: Experiment config file" in proc.stdout, proc.stdout[-2000:]
  # ... and its description is summary's (run as the main module), not the shim's docstring.
  assert proc.stdout.startswith("Model summary without training: "), proc.stdout[:500]
  assert "--vocab_size: Vocabulary size" in proc.stdout
  assert "--num_devices: Lay the mesh out" in proc.stdout


def test_a_tool_run_as_a_script_says_to_run_it_as_a_module():
  # python cem_jax/main.py puts cem_jax/ first on sys.path, where the inspect shim hid Python's
  # inspect: "cannot import name 'CO_GENERATOR' from 'inspect'".
  proc = subprocess.run([sys.executable, "cem_jax/main.py", "--help"], capture_output=True,
                        text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
  assert proc.returncode == 1
  assert ("cem_jax/inspect.py was imported as Python's inspect, because a cem_jax file was run "
          "as a script (python cem_jax/main.py); run it as a module: python -m cem_jax.main"
          ) in proc.stderr.splitlines()[-1], proc.stderr[-2000:]


def test_inspect_a_trained_run_from_its_config_json(tmp_path):
  # A newcomer's `inspect --workdir=RUN` was "Unknown command line flag 'workdir'", and a run's
  # config.json as --config a Python error.
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  saved = tiny_config("llama", **{"model.num_layers": 3})
  (run / "config.json").write_text(saved.to_json())
  config = runs.run_config(str(run))
  assert config.model.num_layers == 3 and config_lib.flat(config) == config_lib.flat(saved)
  proc = subprocess.run([sys.executable, "-m", "cem_jax.inspect", f"--workdir={run}",
                         "--vocab_size=300"], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  # The table is the output: no line of Orbax's about the checkpoint manager it opened.
  assert "checkpoint_manager" not in proc.stderr, proc.stderr[-2000:]
  totals = summary_lib.summary(saved, 300)["totals"]
  assert f"parameters: {totals['params']:,} total" in proc.stdout
  assert "blocks: 3 unique, 3 layers" in proc.stdout
  # A key the run predates keeps its default; one this version does not know is refused.
  (run / "config.json").write_text(json.dumps({**saved.to_dict(), "extra": 1}))
  with pytest.raises(ValueError, match=rf"^{run}/config.json: config fields extra are unknown "
                                       r"to this version of cem_jax; use the version that "
                                       r"trained it$"):
    runs.run_config(str(run))
  # Valid JSON of another shape, or a value of another type (edited by hand): one line naming
  # the file, not an AttributeError or ml_collections' TypeError traceback.
  bad_type = {**saved.to_dict(), "model": {**saved.model.to_dict(), "d_model": "big"}}
  for text, said in (("[]", " holds a JSON list, not a config; allowed: the JSON object of "
                            "config groups a run saves"),
                     (json.dumps(bad_type), ": Could not override field 'd_model'")):
    (run / "config.json").write_text(text)
    with pytest.raises(ValueError) as e:
      runs.run_config(str(run))
    assert str(e.value).startswith(f"{run}/config.json{said}") and "\n" not in str(e.value)
  # The table and sweep tools' check of a run folder (its config.json against the run's).
  (run / "config.json").write_text("[]")
  (run / "checkpoints" / "5").mkdir()  # a run started: its config is checked
  with pytest.raises(ValueError, match=rf"^{run}/config.json holds a JSON list, not a config"):
    workdir_lib.check_same_run(str(run), saved)
  # One rule for every tool that reads a run: inspect's config, evaluate's and sample's load.
  for read in (runs.run_config, runs.load_run):
    with pytest.raises(ValueError, match=rf"^--workdir={tmp_path}: no config.json \(not a "
                                         r"run's folder, or its start failed\)"):
      read(str(tmp_path))
  for args in ([], [f"--workdir={run}", "--config=experiments/tiny.py"]):
    proc = subprocess.run([sys.executable, "-m", "cem_jax.inspect", *args], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: give one of --config=FILE.py (a config to inspect) or --workdir=DIR (a trained "
        "run's config.json)")


def test_inspect_names_each_energy_and_its_update(tmp_path):
  # A newcomer checks an energy with inspect: it runs the start-up checks, and says which
  # update each slot uses, and no FLOPs where a user energy's are not known.
  path = tmp_path / "mine.py"
  path.write_text("import jax.numpy as jnp\n\n\ndef energy(y, context, params, aux):\n"
                  "  return 0.5 * params['eta'] * jnp.sum(y ** 2)\n")
  cases = [({}, ["model.attention_energy='softmax': update by closed form (built-in, "
                 "verified by tests/test_energies.py)",
                 "model.mlp_energy='silu': update by closed form (built-in, verified by "
                 "tests/test_energies.py)"]),
           ({"model.update_mode": "autodiff", "model.cem_attention": False},
            ["model.mlp_energy='silu': update by jax.grad (built-in, verified by "
             "tests/test_energies.py)"]),
           ({"model.mlp_energy": f"{path}:energy"},
            ["model.attention_energy='softmax': update by closed form (built-in, verified by "
             "tests/test_energies.py)",
             f"model.mlp_energy='{path}:energy': update by jax.grad (a user energy: the "
             "start-up checks passed)"])]
  for overrides, want in cases:
    lines = summary_lib.format_summary(summary_lib.summary(tiny_config("cem", **overrides),
                                                           300)).splitlines()
    flops = next(x for x in lines if x.startswith("FLOPs"))
    assert lines[lines.index(flops) + 1:] == want
    # The analytic count is of the built-in energies: none for a user energy's model.
    assert (flops == "FLOPs per token: n/a (a user energy's own operations are not modelled)"
            ) == ("model.mlp_energy" in overrides), flops
  assert summary_lib.summary(tiny_config("llama"), 300)["energies"] == []


def test_inspect_rows_and_text_name_axes_sharding_blocks_and_flops():
  s = summary_lib.summary(tiny_config("llama"), vocab_size=300)
  rows = {r["path"]: r for r in s["rows"]}
  # The embedding's axes (vocab, embed) lie over (tensor, fsdp) by the default rules.
  assert rows["['embedding']"]["logical_axes"] == ("vocab", "embed")
  assert rows["['embedding']"]["spec"] == str(P("tensor", "fsdp"))
  assert rows["['blocks'][0]['attn']['w_q']"]["spec"] == str(P("fsdp", "tensor", None))
  lines = summary_lib.format_summary(s).splitlines()
  assert "blocks: 2 unique, 2 layers" in lines
  # L(8d² + 6df + 4nd) + 2dV = 235,008 forward FLOPs a token (d=64, f=128, n=64, L=2, V=300);
  # a training token 3x that: 705,024.
  assert lines[-2:] == ["FLOPs per token: 0.24 M forward, 0.71 M per training token",
                        "energies: none (no CEM sub-layer)"]
  shared = summary_lib.summary(tiny_config("llama", **{"model.num_unique_blocks": 1}), 300)
  assert "blocks: 1 unique, 2 layers (layer l runs block l % 1)" in (
      summary_lib.format_summary(shared).splitlines())
  # d=64, f=128, L=2, V=300, tied: attention 4d² a layer, MLP 3df, norms d (2 a layer + 1).
  assert (f"parameters: {2 * 4 * 64**2 + 2 * 3 * 64 * 128 + 5 * 64 + 300 * 64:,} total, "
          f"{2 * 4 * 64**2 + 2 * 3 * 64 * 128 + 5 * 64:,} non-embedding, {2 * 4 * 64**2:,} "
          f"attention, {2 * 3 * 64 * 128:,} MLP") in lines


def test_inspect_refuses_what_main_would_refuse():
  with pytest.raises(ValueError, match=r"^--vocab_size=0; allowed: an int >= 8 and < 2\*\*31$"):
    summary_lib.summary(tiny_config("llama"), vocab_size=0)
  cfg = tiny_config("llama", **{"mesh.data": 8, "train.batch_size": 12})
  with pytest.raises(ValueError, match=r"^train.batch_size=12 is not divisible by the 8 "):
    summary_lib.summary(cfg, vocab_size=300, devices=[jax.devices()[0]] * 8)


def test_inspect_lays_a_pod_mesh_out_without_its_devices():
  # 8 devices on a 1-device machine: the abstract mesh gives main's specs and checks.
  cfg = tiny_config("llama", **{"mesh.fsdp": 4, "mesh.tensor": 2, "model.num_heads": 2})
  s = summary_lib.summary(cfg, vocab_size=300, num_devices=8)
  assert s["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
  rows = {r["path"]: r for r in s["rows"]}
  assert rows["['blocks'][0]['attn']['w_q']"]["spec"] == str(P("fsdp", "tensor", None))
  # vocab 300 over tensor=2 divides; 301 does not: replicated, as on real devices.
  assert rows["['embedding']"]["spec"] == str(P("tensor", "fsdp"))
  odd = {r["path"]: r for r in summary_lib.summary(cfg, 301, num_devices=8)["rows"]}
  assert odd["['embedding']"]["spec"] == str(P(None, "fsdp"))
  with pytest.raises(ValueError, match=r"^mesh sizes \{'data': -1, 'fsdp': 4, 'tensor': 2\} "
                                       r"do not divide the 4 devices"):
    summary_lib.summary(cfg, vocab_size=300, num_devices=4)
  with pytest.raises(ValueError, match=r"^--num_devices=0; allowed: an int >= 1"):
    summary_lib.summary(cfg, vocab_size=300, num_devices=0)


@pytest.mark.parametrize("impl, dtype", [("cudnn", "bfloat16"), ("splash", "float32")])
def test_inspect_lays_out_a_gpu_or_tpu_pods_explicit_kernel_config_on_any_machine(impl, dtype):
  # Whether cudnn or splash runs is the pod's machine's to say (main checks it there); the
  # parameters do not depend on the kernel, so --num_devices reads the layout anywhere.
  cfg = tiny_config("llama", **{"model.attention_impl": impl, "model.dtype": dtype,
                                "data.seq_len": 128, "mesh.fsdp": 4})
  s = summary_lib.summary(cfg, vocab_size=300, num_devices=8)
  assert s["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
  assert s["totals"] == summary_lib.summary(
      tiny_config("llama", **{"data.seq_len": 128, "mesh.fsdp": 4}), 300, num_devices=8)["totals"]
  # What no machine could run is still refused.
  cfg.model.dtype, cfg.data.seq_len = "float32", 64
  with pytest.raises(ValueError, match=rf"^model.attention_impl='{impl}' cannot run: "):
    summary_lib.summary(cfg, vocab_size=300, num_devices=8)


def test_logical_rules_to_partition_specs():
  assert sharding.logical_to_spec(("embed", "heads", "head_dim")) == P("fsdp", "tensor", None)
  assert sharding.logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")
  assert sharding.logical_to_spec(("batch", None)) == P(("data", "fsdp"), None)
  # a mesh axis is used once per spec: the second 'tensor' user is replicated
  assert sharding.logical_to_spec(("heads", "mlp")) == P("tensor", None)


def test_a_config_file_error_is_one_line_naming_the_file(tmp_path):
  # The file's own message, prefixed with the flag unless it already names the file; before
  # jax is imported (0.5 s of CPU, 3 s with jax's start-up).
  # Mutation: summary importing jax at its top again printed '1 ['jax']'.
  path = tmp_path / "cfg.py"
  path.write_text("def get_config(arg='x'):\n  raise KeyError(f'no preset {arg}')\n")
  proc = subprocess.run([sys.executable, "-c", RUN_MODULE_REPORTING_JAX, "cem_jax.inspect",
                         f"--config={path}:big"], capture_output=True, text=True, timeout=300)
  assert (proc.stdout.strip(), proc.stderr.strip()) == (
      "1 []", f"error: --config={path}:big: 'no preset big'")
  # absl parses every --config given: the one that fails is explained, first or last, whether
  # get_config raises a KeyError (escapes ml_collections) or a ValueError (wrapped by it).
  # Every tool parses its flags with the same cli.parse_flags; these go through main.
  tiny = Path(__file__).resolve().parents[1] / "experiments" / "tiny.py"
  for given, want in (([f"--config={path}:big", f"--config={tiny}"],
                       f"error: --config={path}:big: 'no preset big'"),
                      ([f"--config={tiny}", f"--config={tiny}:lama"],
                       f"error: --config={tiny}:lama: experiments/tiny.py:lama; allowed "
                       "args: cem, llama")):
    proc = subprocess.run([sys.executable, "-m", "cem_jax.main", *given,
                           f"--workdir={tmp_path / 'w'}"], capture_output=True, text=True,
                          timeout=300)
    assert (proc.returncode, proc.stderr.strip()) == (1, want)
  assert not (tmp_path / "w").exists()


def test_mesh_shape_resolution_and_errors():
  cfg = tiny_config().mesh
  cfg.data, cfg.fsdp, cfg.tensor = -1, 2, 2
  assert axes.mesh_shape(cfg, 8) == (2, 2, 2)
  cfg.data = 3
  with pytest.raises(ValueError, match=r"= 3\*2\*2 = 12, but there are 8 devices"):
    axes.mesh_shape(cfg, 8)
  cfg.data, cfg.fsdp = -1, -1
  # The same wording as config.validate: both go through axes.check_mesh_sizes.
  with pytest.raises(ValueError, match=r"^mesh\.data=-1 and mesh\.fsdp=-1: at most one mesh "
                     r"size may be -1"):
    axes.mesh_shape(cfg, 8)


def test_one_head_dim_rule_for_validation_mesh_checks_and_parameters():
  from cem_jax import axes

  # d_model 64, 4 heads: -1 means 64 // 4 = 16; an explicit head_dim wins.
  assert axes.head_dim_of(tiny_config().model) == 16
  assert axes.head_dim_of(tiny_config(**{"model.head_dim": 6}).model) == 6
  with pytest.raises(ValueError, match=r"^model\.head_dim=5 must be even with model\.rope"):
    preflight.check(tiny_config(**{"model.head_dim": 5}))
  # d_model 66 over 4 heads: refused only when head_dim is derived from them.
  preflight.check(tiny_config(**{"model.d_model": 66, "model.head_dim": 8}))
  with pytest.raises(ValueError, match=r"^model\.d_model=66 is not divisible by "
                     r"model\.num_heads=4; change one or set model\.head_dim$"):
    preflight.check(tiny_config(**{"model.d_model": 66}))
  # A derived head_dim names the fields the user set.
  with pytest.raises(ValueError, match=r"^model\.head_dim=25 \(model\.d_model=100 // "
                     r"model\.num_heads=4\) must be even"):
    preflight.check(tiny_config(**{"model.d_model": 100}))
  rules = (*axes.DEFAULT_RULES[:3], ("head_dim", "tensor"), *axes.DEFAULT_RULES[4:])
  cfg = tiny_config(**{"model.head_dim": 6, "mesh.tensor": 4, "mesh.rules": rules})
  with pytest.raises(ValueError, match=r"^model\.head_dim=6 is not divisible by mesh\.tensor=4"):
    axes.check_config(cfg, 4)
  model = nnx.eval_shape(lambda: DecoderLM(tiny_config(**{"model.head_dim": 6}).model, 32,
                                           rngs=nnx.Rngs(0)))
  assert model.blocks[0].attn.w_q.shape == (64, 4, 6)


def test_read_metrics_skips_a_cut_short_last_line_and_names_a_damaged_one(tmp_path):
  from cem_jax.metrics import read_metrics

  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.5}\n{"step": 2, "tr')
  assert read_metrics(str(tmp_path)) == [{"step": 1, "train/loss": 2.5}]
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "tr\n{"step": 2, "train/loss": 2.0}\n')
  with pytest.raises(ValueError, match=r"metrics\.jsonl:1 is not valid JSON"):
    read_metrics(str(tmp_path))


def test_recursion_report_never_replaces_eta_values_it_cannot_read(tmp_path):
  # The committed design runs keep no checkpoints (git-ignored), so their η cannot be read:
  # --out must then refuse to overwrite an existing report, and write a new one with "n/a".
  root = Path(__file__).resolve().parents[1]
  if any((root / "results/tiny/design").glob("*/seed*/checkpoints")):
    pytest.skip("this checkout holds trained design runs")
  existing = tmp_path / "existing.md"
  existing.write_text("the committed report\n")
  cmd = [sys.executable, "experiments/recursion_report.py", "--workdir=results/tiny"]
  proc = subprocess.run([*cmd, f"--out={existing}"], cwd=root, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 1
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: --out={existing} exists and rows t1, t2_fixed, ")
  assert "η would become n/a" in last
  assert existing.read_text() == "the committed report\n"
  fresh = tmp_path / "fresh.md"
  proc = subprocess.run([*cmd, f"--out={fresh}"], cwd=root, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = fresh.read_text()
  assert "| t1 | n/a | n/a |" in text and "## Eval loss (nats/token), paired by seed" in text
  assert not list((root / "results/tiny/design").glob("*/seed*/data"))  # nothing prepared


@pytest.mark.parametrize("script", ["recursion_report", "collapse"])
def test_an_experiment_script_refuses_an_argument_without_its_flag(tmp_path, script):
  # `recursion_report.py --workdir=results/tiny report.md` (no --out=) printed the report to
  # stdout and wrote no file, without a word; collapse.py dropped a flag missing its --.
  root = Path(__file__).resolve().parents[1]
  stray = tmp_path / "report.md"
  proc = subprocess.run([sys.executable, f"experiments/{script}.py",
                         f"--workdir={root / 'results/tiny'}", str(stray)], cwd=root,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stdout[-500:]
  assert proc.stderr.strip().splitlines() == [  # one line, not absl's usage above it
      f"error: unexpected arguments: {stray}; allowed: only --NAME=VALUE flags (a flag missing "
      "its --, or a space in a value not quoted?)"]
  assert not stray.exists()


@pytest.fixture(scope="module")
def traced_t2_run(tmp_path_factory):
  """``(workdir, config)`` of a CEM run of ``TRACED_T2`` trained once for the module's
  evaluate tests, which read its checkpoint (one edits its config.json, which evaluate does
  not read)."""
  from cem_jax import train

  workdir = tmp_path_factory.mktemp("traced_t2") / "w"
  cfg = tiny_config("cem", **TRACED_T2)
  train.train_and_evaluate(cfg, str(workdir))
  return workdir, cfg


def test_evaluate_reports_the_trained_steps_of_the_checkpoint_not_config_json(traced_t2_run):
  # Every start rewrites config.json, also one that changed model.num_steps and trained
  # nothing: the report's trained T must be the one the checkpoint was trained with.
  workdir, cfg = traced_t2_run
  saved = json.loads((workdir / "config.json").read_text())
  saved["model"]["num_steps"] = 5
  (workdir / "config.json").write_text(json.dumps(saved))
  proc = subprocess.run([sys.executable, "-m", "cem_jax.evaluate", f"--workdir={workdir}",
                         "--num_steps=1", "--max_batches=1", "--batch_size=3"],
                        env=subprocess_env(), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = (workdir / "test_time_steps.md").read_text()
  assert report.startswith("Test-time steps for a model trained with T = 2 "), report
  rows = json.loads((workdir / "test_time_steps.json").read_text())
  assert [r["T_trained"] for r in rows] == [2]
  # one batch of --batch_size=3 windows, not of the run's eval.batch_size (16)
  assert rows[0]["eval/tokens"] == 3 * cfg.data.seq_len


def test_evaluate_refuses_an_eval_step_too_large_for_the_device_before_any_batch(
    traced_t2_run, monkeypatch, capsys):
  # evaluate checked the eval batch's host arrays, never its step's device memory:
  # --batch_size=1000000 on a tiny run ended in XLA's out-of-memory traceback (92 GB asked)
  # at the first batch. Now each T_eval's compiled step is checked as training's are (on a
  # CPU against the host's memory and swap, here made 1 MiB: the NumPy batches of 16 or 40
  # windows, 10 or 25 KiB, pass the host batch check; their steps, with the parameters and
  # the logits, do not), before any batch is evaluated: eval_loop fails the test if called.
  from absl import flags

  from cem_jax import evaluate, memory
  from cem_jax import steps as steps_lib

  workdir, _ = traced_t2_run
  fv = flags.FlagValues()
  flags.DEFINE_string("workdir", None, "", flag_values=fv)
  flags.DEFINE_list("num_steps", ["1", "2", "3", "4"], "", flag_values=fv)
  flags.DEFINE_integer("max_batches", -1, "", flag_values=fv)
  flags.DEFINE_integer("batch_size", None, "", flag_values=fv)
  flags.DEFINE_string("attention_impl", None, "", flag_values=fv)
  monkeypatch.setattr(flags, "FLAGS", fv)
  limit = 2**20
  monkeypatch.setattr(memory, "host_total_bytes", lambda: limit)
  monkeypatch.setattr(memory, "host_available_bytes", lambda: None)  # free now: not read
  monkeypatch.setattr(steps_lib, "eval_loop",
                      lambda *args: pytest.fail("a batch was evaluated"))
  for args, field in (([], "eval.batch_size=16"), (["--batch_size=40"], "--batch_size=40")):
    fv.unparse_flags()
    fv(["evaluate", f"--workdir={workdir}", "--num_steps=2,1", *args])
    with pytest.raises(SystemExit) as e:
      evaluate.main(["evaluate"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    got = re.fullmatch(
        rf"error: the eval step of T_eval=2 at {field} needs ([0-9.]+) MiB on this host's CPU "
        r"devices \(XLA memory analysis\), more than its 1.0 MiB of memory and swap: give "
        r"evaluate a smaller --batch_size \(the whole split's figures do not depend on it\)\n",
        err)
    assert got and float(got[1]) > limit / 2**20, err


def test_the_energy_plot_is_of_the_newest_eval(tmp_path, monkeypatch):
  key = "eval/energy/layer0/step1/att_{}".format
  lines = [{"step": 5, "train/loss": 3.0},
           {"step": 10, "eval/loss": 2.5, key("before"): 1.0, key("after"): 0.5},
           {"step": 20, "eval/loss": 2.0, key("before"): 0.4, key("after"): 0.2}]
  write_metrics(tmp_path, lines)
  drawn = []
  monkeypatch.setattr(plot, "plot_energy", lambda *args: drawn.append(args))
  plot.plot_run(str(tmp_path))
  assert drawn == [({0: {"att": [(0.4, 0.2)]}}, str(tmp_path / "plots" / "energy.png"),
                    "energy trace at step 20")]


def test_the_loss_plot_labels_the_newest_bits_per_byte(tmp_path, monkeypatch):
  lines = [{"step": 5, "train/loss": 3.0},
           {"step": 10, "eval/loss": 2.5, "eval/bits_per_byte": 2.0},
           {"step": 20, "eval/loss": 2.0, "eval/bits_per_byte": 1.5}]
  write_metrics(tmp_path, lines)
  figures = []
  monkeypatch.setattr(files, "atomic_save_figure", lambda fig, path: figures.append(fig))
  plot.plot_run(str(tmp_path))
  (fig,) = figures
  labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  assert labels == ["train", "eval (last: 1.5000 bits/byte)"]


def test_the_loss_plot_of_a_run_whose_last_eval_is_not_finite_or_that_has_only_evals(
    tmp_path, monkeypatch):
  figures = []
  monkeypatch.setattr(files, "atomic_save_figure", lambda fig, path: figures.append(fig))
  # metrics.jsonl writes a non-finite value as null.
  write_metrics(tmp_path, [{"step": 10, "eval/loss": 2.5, "eval/bits_per_byte": 2.0},
                           {"step": 20, "eval/loss": None, "eval/bits_per_byte": None}])
  assert plot.plot_run(str(tmp_path)) == [str(tmp_path / "plots" / "loss.png")]
  labels = [t.get_text() for t in figures[-1].axes[0].get_legend().get_texts()]
  assert labels == ["eval (last: not finite)"]
  assert [list(line.get_ydata()) for line in figures[-1].axes[0].lines] == [[2.5]]  # no null
  write_metrics(tmp_path, [{"step": 10, "eval/loss": 2.5}])
  assert plot.plot_run(str(tmp_path)) == [str(tmp_path / "plots" / "loss.png")]
  write_metrics(tmp_path, [{"step": 10, "train/loss": None}, {"step": 10, "eval/loss": None}])
  with pytest.raises(ValueError, match=r"every loss in metrics.jsonl is null \(not finite"):
    plot.plot_run(str(tmp_path))
  assert [list(line.get_ydata()) for line in figures[-1].axes[0].lines] == [[2.5]]
  # A null train loss is a gap in the train curve too.
  write_metrics(tmp_path, [{"step": 5, "train/loss": 3.0}, {"step": 6, "train/loss": None},
                           {"step": 10, "eval/loss": 2.5}])
  plot.plot_run(str(tmp_path))
  assert [list(line.get_ydata()) for line in figures[-1].axes[0].lines] == [[3.0], [2.5]]


def test_plot_refuses_a_folder_without_metrics_or_without_losses(tmp_path):
  # The one-line errors of plot_run's docstring, naming the fix, not a bare OSError or the
  # "every loss is null" message of a run that diverged.
  with pytest.raises(FileNotFoundError, match=r"no metrics\.jsonl \(train there first\)$"):
    plot.plot_run(str(tmp_path))
  # A table's folder (TABLE/ROW/seedS) or a sweep's (NAME): named as a folder of runs, one
  # given, not "train there first".
  for top, folders in (("tables", ["toy/b/seed0", "toy/a/seed1", "toy/a/seed0"]),
                       ("sweep", ["lr=0.3", "lr=0.1"])):
    for run in folders:
      (tmp_path / top / run).mkdir(parents=True)
      write_metrics(tmp_path / top / run, [{"step": 5, "eval/loss": 3.0}])
    with pytest.raises(FileNotFoundError) as e:
      plot.plot_run(str(tmp_path / top))
    assert str(e.value) == (f"--workdir={tmp_path / top}: no metrics.jsonl; it is a folder of "
                            f"{len(folders)} runs: give one run's folder, e.g. "
                            f"--workdir={tmp_path / top / min(folders)}")
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ValueError) as e:
    plot.plot_run(str(tmp_path / "a_file"))
  assert str(e.value) == (f"--workdir={tmp_path / 'a_file'} is a file; give a run's folder "
                          "(holds metrics.jsonl)")
  write_metrics(tmp_path, [{"step": 0, "train/loss": 5.0}])
  (tmp_path / "plots").write_text("not a folder")  # was "[Errno 17] File exists: ..."
  with pytest.raises(ValueError, match=rf"^--workdir={tmp_path}: {tmp_path}/plots is a file, "
                     r"in the way of the plots' folder; move it away$"):
    plot.plot_run(str(tmp_path))
  write_metrics(tmp_path, [{"step": 0, "params/total": 7}])
  with pytest.raises(ValueError, match=r"metrics\.jsonl has no losses yet \(the first is logged "
                     r"after train\.log_every_steps steps\)$"):
    plot.plot_run(str(tmp_path))


def test_the_energy_plot_joins_each_steps_end_to_the_next_steps_start(monkeypatch):
  figures = []
  monkeypatch.setattr(files, "atomic_save_figure", lambda fig, path: figures.append(fig))
  plot.plot_energy({0: {"att": [(4.0, 3.0), (2.5, 2.0)], "mlp": [(1.0, 0.5)]}}, "x.png")
  att, mlp = figures[0].axes
  # Solid sub-steps at x = 2t, 2t + 1; the dotted segment from step 1's end to step 2's start.
  assert [(list(line.get_xdata()), list(line.get_ydata()), line.get_linestyle())
          for line in att.lines] == [([0, 1], [4.0, 3.0], "-"), ([1, 2], [3.0, 2.5], ":"),
                                     ([2, 3], [2.5, 2.0], "-")]
  assert [t.get_text() for t in att.get_xticklabels()] == [
      "t=1 before", "t=1 after", "t=2 before", "t=2 after"]
  assert [(list(line.get_xdata()), list(line.get_ydata())) for line in mlp.lines] == [
      ([0, 1], [1.0, 0.5])]
  # A layer is one colour, its dotted jumps too: the jump belongs to the layer it leaves.
  assert len({line.get_color() for line in att.lines}) == 1


def test_the_plots_put_steps_on_x_and_name_their_units(tmp_path, monkeypatch):
  # Written from the metrics by hand: each point at its logged step, the loss in nats/token.
  figures = []
  monkeypatch.setattr(files, "atomic_save_figure", lambda fig, path: figures.append(fig))
  write_metrics(tmp_path, [{"step": 5, "train/loss": 3.0}, {"step": 7, "train/loss": 2.8},
                           {"step": 10, "eval/loss": 2.5}])
  plot.plot_run(str(tmp_path))
  ax = figures[-1].axes[0]
  assert [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines] == [
      ([5, 7], [3.0, 2.8]), ([10], [2.5])]
  assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "loss (nats/token)")
  plot.plot_energy({0: {"att": [(4.0, 3.0), (2.5, 2.0)], "mlp": [(1.0, 0.5)]},
                   1: {"att": [(1.0, 0.5)]}}, "x.png")
  att, mlp = figures[-1].axes
  assert att.get_ylabel() == "attention energy (one layer, mean per token)"
  assert mlp.get_ylabel() == "MLP energy (one layer, mean per token)"
  # One legend entry a layer, not one a sub-step.
  assert [t.get_text() for t in att.get_legend().get_texts()] == ["layer 0", "layer 1"]


def test_the_test_time_report_holds_every_row_as_given(tmp_path):
  from cem_jax import evaluate

  rows = [{"T_eval": 1, "step": 30, "T_trained": 2, "final_energy": -1.5, "eval/loss": 2.0,
           "eval/perplexity": 7.389056, "eval/bits_per_byte": 0.9, "eval/tokens": 12345},
          {"T_eval": 4, "step": 30, "T_trained": 2, "final_energy": None, "eval/loss": 1.5,
           "eval/perplexity": 4.481689, "eval/bits_per_byte": 0.8, "eval/tokens": 12345}]
  paths = evaluate.write_report(str(tmp_path), rows, trained_steps=2)
  assert paths == [str(tmp_path / f"test_time_steps{ext}") for ext in (".md", ".json", ".png")]
  # The tokens scored: a quick look (--max_batches=2) is not taken for the whole split's figures.
  assert (tmp_path / "test_time_steps.md").read_text().splitlines() == [
      "Test-time steps for a model trained with T = 2 (checkpoint step 30; 12,345 held-out "
      "tokens a row).",
      "",
      "| T_eval | eval loss (nats) | perplexity | bits/byte | final energy (Σ layers, per token) |",
      "|---:|---:|---:|---:|---:|",
      "| 1 | 2.0000 | 7.39 | 0.9000 | -1.5000 |",
      "| 4 | 1.5000 | 4.48 | 0.8000 | n/a |"]
  assert json.loads((tmp_path / "test_time_steps.json").read_text()) == rows
  assert os.path.getsize(paths[2]) > 0


def test_the_test_time_figure_marks_the_trained_t_and_a_failed_report_keeps_the_old_one(
    tmp_path, monkeypatch):
  """The figure: perplexity and final energy (a gap where there is none) against T_eval, the
  dashed line at the trained T (not at a T_eval). A report that cannot be written (a value
  JSON cannot hold) leaves the previous test_time_steps.json whole, with no temporary file."""
  import math

  from cem_jax import evaluate

  rows = [{"T_eval": 1, "step": 30, "T_trained": 3, "final_energy": -1.5, "eval/loss": 2.0,
           "eval/perplexity": 7.389056, "eval/bits_per_byte": 0.9, "eval/tokens": 10},
          {"T_eval": 4, "step": 30, "T_trained": 3, "final_energy": None, "eval/loss": 1.5,
           "eval/perplexity": 4.481689, "eval/bits_per_byte": 0.8, "eval/tokens": 10}]
  evaluate.write_report(str(tmp_path), rows, trained_steps=3)
  before = (tmp_path / "test_time_steps.json").read_bytes()
  figures = []
  with monkeypatch.context() as m:
    m.setattr(files, "atomic_save_figure", lambda fig, path: figures.append(fig))
    evaluate.write_report(str(tmp_path), rows, trained_steps=3)
  ppl, energy = figures[0].axes
  assert [(list(line.get_xdata()), list(line.get_ydata())) for line in ppl.lines] == [
      ([1, 4], [7.389056, 4.481689]), ([3, 3], [0, 1])]  # the curve, then the trained T
  assert ppl.lines[1].get_linestyle() == "--"
  (curve,) = energy.lines
  assert list(curve.get_xdata()) == [1, 4] and curve.get_ydata()[0] == -1.5
  assert math.isnan(curve.get_ydata()[1])
  with pytest.raises(TypeError):
    evaluate.write_report(str(tmp_path), [{**rows[0], "final_energy": object()}], 3)
  assert (tmp_path / "test_time_steps.json").read_bytes() == before
  assert sorted(os.listdir(tmp_path)) == [f"test_time_steps{ext}" for ext in (".json", ".md",
                                                                               ".png")]
  # The table and the JSON go through the atomic writer (the figure: saved_figure's).
  written = []
  with monkeypatch.context() as m:
    m.setattr(evaluate, "atomic_write_text", lambda path, text: written.append(path))
    evaluate.write_report(str(tmp_path), rows, trained_steps=3)
  assert sorted(written) == [str(tmp_path / "test_time_steps.json"),
                             str(tmp_path / "test_time_steps.md")]
  # A folder in the way of the figure: nothing of the new report is written (the table and
  # JSON were, beside the old figure), and the command says so before evaluating anything.
  other = tmp_path / "other"
  (other / "test_time_steps.png").mkdir(parents=True)
  want = (rf"^--workdir={other}: {other}/test_time_steps\.png is a folder, in the way of the "
          r"report; move it away$")
  with pytest.raises(ValueError, match=want):
    evaluate.write_report(str(other), rows, trained_steps=3)
  assert os.listdir(other) == ["test_time_steps.png"]
  proc = subprocess.run([sys.executable, "-m", "cem_jax.evaluate", f"--workdir={other}"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == "error: " + want[1:-1].replace("\\", "")


def test_test_time_steps_evaluate_max_batches_at_every_t(monkeypatch):
  # --max_batches, not the run's own eval.max_batches, bounds each T_eval's eval.
  from cem_jax import evaluate, train
  from cem_jax import steps as steps_lib

  cfg = tiny_config("cem", **{"model.num_steps": 2, "eval.max_batches": 4})
  def load_run(workdir, require, attention_impl):
    assert attention_impl == "xla"  # passed on
    require(cfg)
    with pytest.raises(ValueError, match=r"^model.block='llama': test-time steps need a CEM "
                                         r"model$"):
      require(tiny_config("llama"))
    return cfg, "data", "graph", "params", 30

  monkeypatch.setattr(runs, "load_run", load_run)
  monkeypatch.setattr(steps_lib, "make_eval_step",
                      lambda graphdef, t, trace, loss_block_size: (t, trace))
  monkeypatch.setattr(train, "compile_eval_step", lambda config, step, params, **kw: step)
  seen = []

  def eval_loop(step, params, data, config):
    t, trace = step
    seen.append((t, config.eval.max_batches))
    # a step made with the energy trace reports one layer's: att + mlp after step t is -3t
    energy = {f"eval/energy/layer0/step{s}/{part}_{when}": -float(s) * (2 if part == "att" else 1)
              for s in range(1, t + 1) for part in ("att", "mlp") for when in ("before", "after")
              if trace}
    return {"eval/loss": float(t), "eval/perplexity": 1.0, "eval/bits_per_byte": 0.5,
            "eval/tokens": 64 * t, **energy}

  monkeypatch.setattr(steps_lib, "eval_loop", eval_loop)
  rows = evaluate.test_time_steps("w", [1, 3], max_batches=2, attention_impl="xla")
  assert seen == [(1, 2), (3, 2)]
  assert [(r["T_eval"], r["eval/loss"], r["step"], r["T_trained"], r["eval/tokens"],
           r["final_energy"]) for r in rows] == [(1, 1.0, 30, 2, 64, -3.0),
                                                  (3, 3.0, 30, 2, 192, -9.0)]


def test_evaluate_refuses_an_eval_batch_too_large_for_the_host_before_data_or_state(
    monkeypatch):
  # A saved run's eval.batch_size passed at training on another machine, or never read
  # against this one: evaluate built the data and state, then ended in a MemoryError
  # traceback or the kernel's kill. Refused as training's start-up refuses it (one process
  # reads every row here), from the checkpoint's config, before the data are built; the
  # advice is evaluate's --batch_size (lowering the run's eval.batch_size, as training's
  # refusal says, was not this command's to do: it reads the checkpoint's config).
  from cem_jax import evaluate, memory, train
  from cem_jax import steps as steps_lib

  built, evaluated = [], []

  def load_run(workdir, require, attention_impl):
    cfg = tiny_config("cem", **{"eval.batch_size": 16})  # seq_len 64
    require(cfg)
    built.append(workdir)  # where load_run builds the data and the parameters
    return cfg, "data", "graph", "params", 30

  def eval_loop(eval_step, params, data, config):
    evaluated.append(config.eval.batch_size)
    return {"eval/loss": 1.0, "eval/perplexity": 2.7, "eval/bits_per_byte": 0.5,
            "eval/tokens": 1}

  monkeypatch.setattr(runs, "load_run", load_run)
  monkeypatch.setattr(steps_lib, "make_eval_step", lambda *args, **kwargs: None)
  monkeypatch.setattr(train, "compile_eval_step", lambda *args, **kwargs: None)
  monkeypatch.setattr(steps_lib, "eval_loop", eval_loop)
  monkeypatch.setattr(memory, "host_available_bytes", lambda: None)  # free now: not read
  row = 64 * 20  # inputs, targets, segment_ids (int32), weights, target_bytes (float32)
  monkeypatch.setattr(memory, "host_total_bytes", lambda: 16 * row - 1)
  for batch_size, rows in ((None, 16), (16, 16), (17, 17)):
    with pytest.raises(ValueError) as e:
      evaluate.test_time_steps("w", [1], batch_size=batch_size)
    assert str(e.value) == (
        f"eval.batch_size={rows} needs {rows * row} bytes on this host (this process's {rows} "
        f"rows of the batch, {row} bytes each in NumPy), more than its {16 * row - 1} bytes of "
        "memory and swap: give evaluate a smaller --batch_size (the whole split's figures do "
        "not depend on it)")
  assert built == [] and evaluated == []
  assert [r["T_eval"] for r in evaluate.test_time_steps("w", [1], batch_size=15)] == [1]
  assert built == ["w"] and evaluated == [15]
  monkeypatch.setattr(memory, "host_total_bytes", lambda: 16 * row)  # exactly enough
  assert [r["T_eval"] for r in evaluate.test_time_steps("w", [1])] == [1]
  assert built == ["w", "w"] and evaluated == [15, 16]  # the run's own without the flag
  for bad, shown in ((0, "0"), (2.0, "2.0"), (True, "True"), (-(10**5000), "a negative int of "
                                                                        "5001 digits")):
    with pytest.raises(ValueError) as e:  # before the run is loaded
      evaluate.test_time_steps("w", [1], batch_size=bad)
    assert str(e.value) == f"--batch_size={shown}; allowed: an int >= 1"
  with pytest.raises(ValueError) as e:  # its rule as a config's: at most 4300 digits
    evaluate.test_time_steps("w", [1], batch_size=10**5000)
  assert str(e.value).startswith("--batch_size=an int of 5001 digits; allowed: an int of at "
                                 "most 4300 digits")
  assert built == ["w", "w"]


@pytest.mark.parametrize("counts, shown", [([0], "0"), ([2, 0], "2,0"), ([-1, 3], "-1,3"),
                                           ([2, 2], "2,2"), ([], ""), ([True], "True"),
                                           ([1, 2**8], "1,256"), ([10**9], "1000000000")])
def test_a_test_time_step_count_below_one_or_repeated_is_refused_before_the_run_is_loaded(
    monkeypatch, counts, shown):
  # T_eval = 0 would evaluate a model whose CEM layers run no step, 10**9 one traced for ever
  # (the steps are unrolled); the refusal must come before the seconds of loading a
  # checkpoint and its data. The function and the command line (below) hold one rule.
  from cem_jax import evaluate

  def load_run(*args, **kwargs):
    raise AssertionError("the run was loaded before its step counts were checked")

  monkeypatch.setattr(runs, "load_run", load_run)
  with pytest.raises(ValueError) as e:
    evaluate.test_time_steps("w", counts)
  assert str(e.value) == (f"--num_steps={shown}; allowed: comma-separated values, each an int "
                          ">= 1 and < 2**8 (every step is unrolled into the compiled program) "
                          "and at most once")


def test_every_step_count_check_holds_model_num_steps_rule(monkeypatch):
  # T_eval values, a DecoderLM num_steps override, eval.num_steps and the config field are one
  # quantity, a number of recursive steps: a change of the rule in config reaches all four.
  from cem_jax import evaluate, model
  monkeypatch.setitem(config_lib._MINIMUMS, "model.num_steps", 2)
  monkeypatch.setitem(config_lib._BELOW, "model.num_steps", (5, "5 (why)"))
  checks = {"--num_steps": lambda t: evaluate.check_steps([3, t]),
            "DecoderLM: num_steps": model.check_num_steps,
            "eval.num_steps": lambda t: config_lib.check_minus_one_or_positive(
                "eval.num_steps", t),
            "model.num_steps": lambda t: config_lib.check_int("model.num_steps", t)}
  for name, check in checks.items():
    check(2)
    check(4)
    for bad in (1, 2.0, True, 5):
      with pytest.raises(ValueError, match=rf"^{name}=.*; allowed: .*an int >= 2 and < 5 "
                                           r"\(why\)"):
        check(bad)
    # past int -> str's 4300 digits, by its digit count (repr raised in the refusal's place)
    with pytest.raises(ValueError, match=rf"^{name}=(3,)?an int of 5001 digits; allowed: "):
      check(10**5000)


def test_evaluate_refuses_step_counts_that_are_not_integers_by_the_values_typed(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "cem_jax.evaluate", f"--workdir={tmp_path}",
                         "--num_steps=1,two"], capture_output=True, text=True, timeout=120,
                        env=subprocess_env())
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: --num_steps=1,two; allowed: comma-separated values, each an int >= 1 and < 2**8 "
      "(every step is unrolled into the compiled program) and at most once")


class _ReaderStandIn:
  """A read-only Checkpointer as :func:`cem_jax.runs.load_run` uses it, stood in for: the
  tests below say which step ``restorable_step`` names and what its read does."""

  def __init__(self, directory, **kwargs):
    self.directory = directory

  def step_dir(self, step):
    return os.path.join(self.directory, str(step))

  def close(self):
    pass


@pytest.mark.parametrize("tick", [1.0, 10.0])
def test_a_run_that_prunes_every_step_chosen_is_a_one_line_error_after_the_tries_and_seconds(
    tmp_path, monkeypatch, tick):
  # A run still training with checkpoint.keep=1 may prune each step load_run chooses before it
  # is read: it chooses the newest again until PRUNED_TRIES in a row *and* PRUNED_SECONDS have
  # passed (a clock that ticks 1 s a try: 30 tries; 10 s a try: 20), then says so in one line
  # naming the tries and seconds (not the last pruned step's Orbax error). 20 tries alone
  # (5-8 s) gave up on readers beside such a run that needed up to 12 on 2 busy cores. A failure
  # of a step still there is no pruning: raised at once, as it is.
  import types

  from cem_jax import checkpoint, runs

  chosen, clock = [], [0.0]

  class Training(_ReaderStandIn):  # each step it names is gone by the time it is read
    def restorable_step(self):
      chosen.append(7 + len(chosen))
      clock[0] += tick
      return chosen[-1]

  def restore_step(ckpt, step, *args):
    raise AttributeError(f"{ckpt.step_dir(step)}: pruned while read")  # any type

  (tmp_path / "config.json").write_text("{}")
  monkeypatch.setattr(checkpoint, "Checkpointer", Training)
  monkeypatch.setattr(runs, "_restore_step", restore_step)
  monkeypatch.setattr(runs, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
  assert (runs.PRUNED_TRIES, runs.PRUNED_SECONDS) == (20, 30.0)
  tries = 30 if tick == 1.0 else 20
  with pytest.raises(checkpoint.CheckpointError) as e:
    runs.load_run(str(tmp_path))
  assert str(e.value) == (
      f"--workdir={tmp_path}: the run pruned each of the {tries} steps chosen in a row over "
      f"{tries * tick:.1f} s (the first step 7, the last {7 + tries - 1}) before it could be "
      "read: a run still training keeps only its newest checkpoint.keep steps and saves faster "
      "than they are read here; read it once it has stopped, or train with "
      "--config.checkpoint.keep=2 or more")
  assert chosen == list(range(7, 7 + tries))
  assert isinstance(e.value.__cause__, AttributeError)
  chosen.clear()
  (tmp_path / "checkpoints" / "7").mkdir(parents=True)  # there: its own error, at once
  with pytest.raises(AttributeError, match=r"/checkpoints/7: pruned while read$"):
    runs.load_run(str(tmp_path))
  assert chosen == [7]


def test_steps_pruned_together_while_one_is_chosen_count_as_the_newest(tmp_path, monkeypatch):
  # keep=1 beside a save every step: the folders of two steps may go while one is chosen; the
  # step chosen was the newest of them, and the error's first and last steps name those.
  import types

  from cem_jax import checkpoint

  checkpoints, clock, pair = tmp_path / "checkpoints", [0.0], [10]
  for step in (10, 11):
    (checkpoints / str(step)).mkdir(parents=True)

  class Training(_ReaderStandIn):  # both steps listed are pruned, two newer ones saved
    def restorable_step(self):
      clock[0] += 10.0
      for step in (pair[0], pair[0] + 1):
        (checkpoints / str(step)).rmdir()
        (checkpoints / str(step + 2)).mkdir()
      pair[0] += 2
      raise checkpoint.CheckpointError("no intact step")

  monkeypatch.setattr(checkpoint, "Checkpointer", Training)
  monkeypatch.setattr(runs, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(checkpoint.CheckpointError, match=r"each of the 20 steps chosen in a row "
                                                      r"over 200.0 s \(the first step 11, the "
                                                      r"last 49\)"):
    runs.load_run(str(tmp_path))


def test_the_step_folders_are_the_all_digit_names_only(tmp_path):
  # What tells a pruned step: Orbax's in-flight saves ("4.orbax-checkpoint-tmp-17") and other
  # files beside the steps are no step (int() of one would fail the read of a run mid-save).
  assert integrity.step_folders(str(tmp_path / "none")) == set()
  for name in ("3", "12", "4.orbax-checkpoint-tmp-17", "tmp", "digests"):
    (tmp_path / name).mkdir()
  assert integrity.step_folders(str(tmp_path)) == {3, 12}
  (tmp_path / "file").write_text("")  # a checkpoints path that is a file: no step either
  assert integrity.step_folders(str(tmp_path / "file")) == set()


def test_load_runs_tries_build_the_model_again_only_for_another_config(tmp_path, monkeypatch):
  # A try after a pruning takes the config, shapes and target of the step before when it was
  # saved with the same config and energies (its checks passed): its window is two reads.
  # Step 3, saved with another config (a resume that changed train.num_steps), is checked and
  # built again: require sees it, and its shapes are its own.
  from cem_jax import checkpoint
  from cem_jax import steps as steps_lib

  checkpoints, chosen, required, builds = tmp_path / "checkpoints", [], [], []
  checkpoints.mkdir()
  saved = {step: tiny_config("llama", **{"train.num_steps": 4 if step < 3 else 6}).to_dict()
           for step in (1, 2, 3)}

  class Training(_ReaderStandIn):  # steps 1 and 2 are pruned as they are restored
    def restorable_step(self):
      chosen.append(len(chosen) + 1)
      (checkpoints / str(chosen[-1])).mkdir()
      return chosen[-1]

    def read_meta(self, step):
      return {"step": step, "config": saved[step]}

    def restore(self, step, target, partial=False):
      if step < 3:
        (checkpoints / str(step)).rmdir()
        raise FileNotFoundError(f"{self.step_dir(step)}: pruned")
      return {"params": target["params"]}, {}

  real_build = steps_lib.build_model
  monkeypatch.setattr(steps_lib, "build_model", lambda *a: builds.append(1) or real_build(*a))
  monkeypatch.setattr(checkpoint, "Checkpointer", Training)
  monkeypatch.setattr(runs, "_data_of", lambda *args: "data")
  (tmp_path / "config.json").write_text("{}")
  config, _, _, params, step = runs.load_run(
      str(tmp_path), require=lambda c: required.append(c.train.num_steps))
  assert (step, chosen, required, len(builds)) == (3, [1, 2, 3], [4, 6], 2)
  assert config.train.num_steps == 6 and params is not None


def test_newest_meta_chooses_again_a_step_pruned_while_it_is_read(tmp_path, monkeypatch):
  # inspect --workdir reads the newest checkpoint's metadata (summary.check_energies_unedited)
  # beside a run that may still be training: a step pruned (checkpoint.keep=1) between being
  # chosen and its metadata read was Orbax's FileNotFoundError, a traceback, where load_run
  # chose again. Now chosen again as load_run does; a step still there that fails is raised
  # at once; no step at all is (None, CheckpointMeta()).
  from cem_jax import checkpoint

  checkpoints, chosen = tmp_path / "checkpoints", []
  checkpoints.mkdir()

  class Training(_ReaderStandIn):  # the first two steps it names are pruned as they are read
    def restorable_step(self):
      if not chosen and not any(checkpoints.iterdir()):
        return None
      chosen.append(len(chosen) + 1)
      (checkpoints / str(chosen[-1])).mkdir()
      return chosen[-1]

    def read_meta(self, step):
      if len(chosen) < 3:
        (checkpoints / str(step)).rmdir()
        raise FileNotFoundError(f"{self.step_dir(step)}/meta: no such file")
      return {"step": step, "seed": 5, "numerics_version": 2}

  monkeypatch.setattr(checkpoint, "Checkpointer", Training)
  assert runs.newest_meta(str(tmp_path)) == (None, runs.CheckpointMeta())
  (checkpoints / "0").mkdir()
  assert runs.newest_meta(str(tmp_path)) == (
      str(checkpoints / "3"), runs.CheckpointMeta(step=3, seed=5, numerics_version=2))
  assert chosen == [1, 2, 3]
  chosen.clear()
  monkeypatch.setattr(Training, "read_meta", lambda self, step: [step])  # there, damaged
  with pytest.raises(ValueError, match=r"/checkpoints/1: damaged metadata: a list, not an "):
    runs.newest_meta(str(tmp_path))
  assert chosen == [1]


def _report_as_a_cut_read(what: str) -> None:
  """What Orbax's read of a step a pruning cuts reports, stood in for, each kind naming
  ``what``: Orbax's warning (an item "could not be restored"), asyncio's "never retrieved",
  an exception Python drops in a TensorStore thread ("Event loop is closed") and one it drops
  in the main thread (a read's coroutine, collected there)."""
  import asyncio
  import logging

  from cem_jax import checkpoint

  logging.getLogger("absl").handle(logging.LogRecord(
      "absl", logging.WARNING, os.path.join(checkpoint._ORBAX_DIR, "checkpoint", "x.py"), 1,
      f"{what}: could not be restored", None, None))
  logging.getLogger("asyncio").handle(logging.LogRecord(
      "asyncio", logging.ERROR, asyncio.base_events.__file__, 1,
      f"{what}: never retrieved", None, None))
  drop_exceptions(f"{what}: ", "tensorstore")


async def not_orbaxs():
  pass


def _garbage_of_a_cut_read(what: str) -> None:
  """What Orbax's read of a step a pruning cuts leaves to collect, stood in for: in a reference
  cycle (freed by gc alone), a coroutine of Orbax's never awaited (Python's RuntimeWarning
  when freed), one of another file, and an object whose ``__del__`` raises (Python drops it
  in the thread that collects it)."""
  from cem_jax import checkpoint

  orbaxs = {}
  exec(compile("async def read():\n  pass\n", os.path.join(checkpoint._ORBAX_DIR, "x.py"),
               "exec"), orbaxs)

  class Cycle:
    def __del__(self):
      raise RuntimeError(f"{what}: freed")

  cycle = Cycle()
  cycle.cycle, cycle.coroutines = cycle, (orbaxs["read"](), not_orbaxs())


@pytest.mark.parametrize("last", ["read", "pruned", "failed"])
def test_what_orbax_reports_of_a_read_cut_by_pruning_is_dropped_when_the_step_is_read_again(
    tmp_path, monkeypatch, caplog, last):
  # A read of a step that the run still training (checkpoint.keep=1) pruned meanwhile: up to a
  # hundred lines of Orbax's and TensorStore's tracebacks ("Event loop is closed", ...) on
  # stderr, then load_run read the newest step fine. Dropped now, with what the reads left to
  # collect ("read": their coroutines, futures and tasks, each report as it is freed; Orbax's
  # coroutines never awaited were a RuntimeWarning each at the next Checkpointer); shown with
  # the error when the last read fails: every chosen step pruned ("pruned": only the last
  # read's), or a step still there ("failed"). What comes after the block is shown: the drop
  # lasted until the next Checkpointer, and a report of the program's own ("later") was lost.
  import gc
  import logging
  import types
  import warnings

  from cem_jax import checkpoint

  real_checkpointer = checkpoint.Checkpointer
  chosen, dropped = [], []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(str(u.exc_value)))
  pruned_reads = {"read": 2, "pruned": runs.PRUNED_TRIES, "failed": 1}[last]

  class Training(_ReaderStandIn):  # each step it names is pruned while read, then one stays
    def restorable_step(self):
      chosen.append(len(chosen) + 1)
      if len(chosen) > pruned_reads:
        os.makedirs(self.step_dir(chosen[-1]))
      return chosen[-1]

  def restore_step(ckpt, step, *args):
    _report_as_a_cut_read(f"read {step}")
    if last == "read":
      _garbage_of_a_cut_read(f"read {step}")
    if not os.path.isdir(ckpt.step_dir(step)) or last == "failed":
      raise ValueError(f"read {step} failed")
    return types.SimpleNamespace(), "config", "graphdef", "params"

  (tmp_path / "config.json").write_text("{}")
  monkeypatch.setattr(checkpoint, "Checkpointer", Training)
  monkeypatch.setattr(runs, "_restore_step", restore_step)
  monkeypatch.setattr(runs, "_data_of", lambda *args: "data")
  monkeypatch.setattr(runs, "PRUNED_SECONDS", 0.0)  # gives up after the tries alone
  gc.disable()  # the reads' garbage is freed where load_run collects it, not before
  try:
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as warned:
      warnings.simplefilter("always")
      if last == "read":
        assert runs.load_run(str(tmp_path))[4] == 3
      else:
        with pytest.raises((checkpoint.CheckpointError, ValueError)):
          runs.load_run(str(tmp_path))
      gc.collect()  # as Python's own collection may: nothing of the reads left to free
      _report_as_a_cut_read("later")
      monkeypatch.setattr(checkpoint, "Checkpointer", real_checkpointer)
      checkpoint.Checkpointer(str(tmp_path / "next")).close()
      _report_as_a_cut_read("after a new Checkpointer")
  finally:
    gc.enable()
  # A coroutine of another file that the collection frees is not Orbax's: its warning stays.
  assert [str(w.message) for w in warned] == (
      ["coroutine 'not_orbaxs' was never awaited"] * 3 if last == "read" else [])
  shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
           and r.getMessage().endswith(("could not be restored", "never retrieved"))]
  kinds = lambda what: [f"{what}: could not be restored", f"{what}: never retrieved"]
  threads = lambda what: [f"{what}: dropped in the tensorstore thread",
                          f"{what}: dropped in the main thread"]
  after = "after a new Checkpointer"
  if last == "read":  # nothing of reads 1 to 3; what came after them
    assert shown == kinds("later") + kinds(after)
    assert dropped == threads("later") + threads(after)
  else:  # the last read's, as it came, and what comes later
    final = f"read {chosen[-1]}"
    assert len(chosen) == (runs.PRUNED_TRIES if last == "pruned" else 2)
    assert shown == kinds(final) + kinds("later") + kinds(after)
    assert dropped == threads(final) + threads("later") + threads(after)


@pytest.mark.parametrize("error", [FileNotFoundError, "CheckpointError", None])
def test_a_step_pruned_while_load_run_chooses_it_is_chosen_again(tmp_path, monkeypatch, error):
  # Beside a run training with checkpoint.keep=1 and every_steps=1, 5 loads of ~250 failed
  # while the newest step was chosen, before any read: Orbax's FileNotFoundError (the step's
  # metadata gone), the step's files gone while verified ("no intact checkpoint"), or no step
  # listed ("no checkpoint"); also as Orbax listed the steps when load_run opened the
  # folder (the same FileNotFoundError). Chosen again as a step pruned while read is. An
  # error with no step gone is raised at once.
  from cem_jax import checkpoint

  checkpoints, calls, opened = tmp_path / "checkpoints", [], []
  (checkpoints / "0").mkdir(parents=True)
  (checkpoints / "1").mkdir()
  error = checkpoint.CheckpointError if error == "CheckpointError" else error

  class Training(_ReaderStandIn):  # prunes the newest step as it is chosen, twice
    def __init__(self, directory, **kwargs):
      super().__init__(directory)
      opened.append(directory)
      if len(opened) == 1:  # as Orbax lists the steps
        (checkpoints / "0").rmdir()
        raise FileNotFoundError(f"{directory}/0")

    def restorable_step(self):
      calls.append(len(calls) + 1)
      if calls[-1] < 3:
        (checkpoints / str(calls[-1] + 1)).mkdir()
        (checkpoints / str(calls[-1])).rmdir()
        if error is None:
          return None
        raise error(f"step {calls[-1]} gone")
      if calls[-1] == 4:
        if error is None:
          return None
        raise error("damaged, nothing gone")
      return calls[-1]

  (tmp_path / "config.json").write_text("{}")
  monkeypatch.setattr(checkpoint, "Checkpointer", Training)
  monkeypatch.setattr(runs, "_restore_step", lambda *args: (None, "config", "g", "params"))
  monkeypatch.setattr(runs, "_data_of", lambda *args: "data")
  assert runs.load_run(str(tmp_path))[4] == 3 and calls == [1, 2, 3] and len(opened) == 2
  with pytest.raises(error or FileNotFoundError,
                     match=(f"^--workdir={tmp_path}: no checkpoint in {checkpoints}$"
                            if error is None else "^damaged, nothing gone$")):
    runs.load_run(str(tmp_path))
  assert calls == [1, 2, 3, 4]


@pytest.mark.parametrize("in_checkpoint", [True, False])
def test_a_saved_config_with_fields_unknown_here_is_refused_naming_them_and_where(
    tmp_path, in_checkpoint):
  # A run of a newer cem_jax: its unknown fields would otherwise be added to the config and the
  # model built without them, silently another model.

  saved = {"model": {"d_model": 32, "new_width": 3}, "train": {"new_rate": 0.1}}
  config_json = tmp_path / "config.json"
  config_json.write_text(json.dumps(saved))

  class Saved:
    def read_meta(self, step):
      return {"config": saved} if in_checkpoint else {}

    def step_dir(self, step):
      return str(tmp_path / "checkpoints" / str(step))

  def require(config):
    raise AssertionError("the unknown fields reached the config")

  where = f"checkpoint {tmp_path}/checkpoints/4" if in_checkpoint else str(config_json)
  with pytest.raises(ValueError) as e:
    runs._restore_step(Saved(), 4, str(config_json), require)
  assert str(e.value) == (f"{where}: config fields model.new_width, train.new_rate are unknown "
                          "to this version of cem_jax; use the version that trained it")


def test_a_damaged_config_json_of_a_run_without_a_config_in_its_checkpoint_is_one_line(
    tmp_path):
  # Runs saved before checkpoints held their config are built from config.json: damaged, it is
  # named with what to do (its command wrote it), not a traceback of the JSON parser.

  config_json = tmp_path / "config.json"
  config_json.write_text('{"model": {"d_mod')

  class Saved:
    def read_meta(self, step):
      return {}

    def step_dir(self, step):
      return str(tmp_path / "checkpoints" / str(step))

  with pytest.raises(ValueError) as e:
    runs._restore_step(Saved(), 4, str(config_json))
  assert str(e.value).startswith(f"{config_json} is not valid JSON (")
  assert str(e.value).endswith("); restore it from the run's command")


def test_last_eval_in_is_the_final_eval_line(tmp_path):
  # What a re-run of a finished run returns: its last eval, not its first.
  assert last_eval_in(str(tmp_path)) == {}
  lines = [{"step": 0, "params/total": 10},
           {"step": 10, "eval/loss": 3.0, "eval/bits_per_byte": 2.0},
           {"step": 20, "train/loss": 2.5},
           {"step": 20, "eval/loss": 2.0, "eval/bits_per_byte": 1.5}]
  write_metrics(tmp_path, lines)
  assert last_eval_in(str(tmp_path)) == {"eval/loss": 2.0, "eval/bits_per_byte": 1.5}


def test_preparing_a_workdir_says_whether_it_made_it_and_leaves_nothing_in_it(tmp_path):
  workdir = tmp_path / "w"
  assert prepare_workdir(str(workdir)) and not prepare_workdir(str(workdir))
  assert os.listdir(workdir) == []  # the write probe is removed
  # Bytes that are not UTF-8 (a surrogate from the shell): ArrayRecord's writer would fail
  # on the path later; refused before anything is made.
  bad = str(tmp_path / "x\udcffy")
  with pytest.raises(ValueError, match=r"^--workdir='.*x\\udcffy' is not a UTF-8 path; "):
    prepare_workdir(bad)
  assert sorted(os.listdir(tmp_path)) == ["w"]
  # Orbax globs below a step's folder: under '[1]' (which matches '1') it merged no arrays,
  # and the first resume found none (adv60). Refused before anything is made; '*', '?' and a
  # lone '[' match themselves and are kept.
  for name in ("br[1]", "a[b]c/w"):
    with pytest.raises(ValueError) as e:
      prepare_workdir(str(tmp_path / name))
    assert str(e.value) == (
        f"--workdir='{tmp_path / name}': its '[...]' is a glob pattern to Orbax's checkpoint "
        "writer, which would save checkpoints no resume can read; choose a --workdir without "
        "'[' and ']' (or rename the folder)")
  assert sorted(os.listdir(tmp_path)) == ["w"]
  # A URL made ./gs:/b/run and ended in tensorboardX's ImportError traceback; a folder
  # named 'logs:' failed the first save (Orbax writes its 'gs:/' as 'gs://').
  for url in ("gs://b/run", "s3://b/run"):
    with pytest.raises(ValueError) as e:
      prepare_workdir(url)
    assert str(e.value) == (f"--workdir='{url}' is a URL; allowed: a folder of this machine's "
                            "file system (a bucket mounted there, e.g. with gcsfuse, on a pod)")
  for name in ("logs:/run", "logs:"):
    with pytest.raises(ValueError) as e:
      prepare_workdir(str(tmp_path / name))
    assert str(e.value) == (
        f"--workdir='{tmp_path / name}': Orbax's checkpoint writer reads the 'gs:/' in its "
        f"path '{tmp_path / name}' as a Cloud Storage URL and its first save would fail; "
        "choose a --workdir without a folder name ending in 'gs:'")
  assert sorted(os.listdir(tmp_path)) == ["w"]
  for name in ("st*r?", "br[", "col:on", "gs", "a:/b"):
    assert prepare_workdir(str(tmp_path / name))
    shutil.rmtree(tmp_path / name)
  # A path through a file: the message names the folder that could not be made, and why.
  (tmp_path / "a_file").write_text("x")
  nested = tmp_path / "a_file" / "w" / "sub"
  with pytest.raises(ValueError) as e:
    prepare_workdir(str(nested))
  assert str(e.value) == (
      f"--workdir='{nested}' is not a writable folder (Not a directory: "
      f"{tmp_path / 'a_file' / 'w'}); choose another --workdir or fix its permissions")


def test_a_failed_write_probe_removes_the_folders_prepare_workdir_made_and_only_those(
    tmp_path, monkeypatch):
  # A folder made and then found unwritable (a full disk, no inodes) was left behind, empty,
  # looking like a run's workdir; what was there before must stay, contents and all.
  from cem_jax import workdir as workdir_lib

  def full_disk(dir, prefix):
    raise OSError(errno.ENOSPC, "No space left on device", os.path.join(dir, prefix))

  monkeypatch.setattr(workdir_lib.tempfile, "mkstemp", full_disk)
  old, empty = tmp_path / "old", tmp_path / "empty"
  old.mkdir()
  empty.mkdir()
  (old / "kept.txt").write_text("x")
  for workdir, probe_in in ((old / "new" / "newer" / "w", None), (old, old), (empty, empty)):
    probe_in = probe_in or workdir
    with pytest.raises(ValueError) as e:
      prepare_workdir(str(workdir))
    assert str(e.value) == (
        f"--workdir='{workdir}' is not a writable folder (No space left on device: "
        f"{probe_in / '.write_probe'}); choose another --workdir or fix its permissions")
    assert sorted(os.listdir(tmp_path)) == ["empty", "old"]
    assert os.listdir(old) == ["kept.txt"] and os.listdir(empty) == []
  # Through a symlink and '..': the folders made are beside the link's target, not the link.
  (tmp_path / "old" / "sub").mkdir()
  (tmp_path / "link").symlink_to(tmp_path / "old" / "sub")
  with pytest.raises(ValueError, match="No space left on device"):
    prepare_workdir(str(tmp_path / "link" / ".." / "new" / "w"))
  assert sorted(os.listdir(old)) == ["kept.txt", "sub"] and os.listdir(old / "sub") == []
  assert sorted(os.listdir(tmp_path)) == ["empty", "link", "old"]
  monkeypatch.undo()
  assert prepare_workdir(str(old / "new" / "w"))  # writable again: made as before


def test_a_workdir_trains_one_run_at_a_time_and_a_killed_holder_frees_it(tmp_path):
  # Two runs in one folder (a second main, or two tables commands reaching the same row) each
  # appended to metrics.jsonl and saved over the other's checkpoints, and both exited 0.
  from cem_jax import train

  workdir = tmp_path / "w"
  workdir.mkdir()
  busy = (f"--workdir='{workdir}' is in use: another run is training in it (a second main, "
          "tables or sweep on the same folder); wait for it to end, or choose another --workdir")
  with exclusive(str(workdir)):
    with pytest.raises(ValueError) as e, exclusive(str(workdir)):
      pass
    assert str(e.value) == busy
    with pytest.raises(ValueError) as e:  # refused before it reads or writes anything
      train.train_and_evaluate(tiny_config(), str(workdir))
    assert str(e.value) == busy and os.listdir(workdir) == []
  with exclusive(str(workdir)):  # released at the end of the block, and no lock file left
    assert os.listdir(workdir) == []
  # A holder killed with SIGKILL leaves no stale lock behind.
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from cem_jax.workdir import exclusive\n"
       f"with exclusive({str(workdir)!r}):\n  print('held', flush=True); time.sleep(60)"],
      stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(ValueError) as e, exclusive(str(workdir)):
      pass
    # The one line names who holds it (Linux's /proc/locks), its command on one line.
    if os.path.exists("/proc/locks"):
      command = " ".join(holder.args[:2] + holder.args[2].split())
      command = command[:197] + "..." if len(command) > 200 else command  # 200 at most
      assert str(e.value) == f"{busy}; held by pid {holder.pid} ({command})"
    else:
      assert str(e.value) == busy
  finally:
    holder.kill()
    holder.wait()
  with exclusive(str(workdir)):
    pass


def test_the_workdir_is_held_for_the_whole_run_not_only_its_start_up(tmp_path, monkeypatch):
  # The lock guards the run's appends to metrics.jsonl and its checkpoint saves: let go after
  # the start-up checks, a second run could start in the folder while this one trains.
  from types import SimpleNamespace

  from cem_jax import train

  workdir = str(tmp_path / "w")
  # Stand-ins for the data, the model and the loop: only where the lock is held is under test.
  vocab = SimpleNamespace(tokenizer=SimpleNamespace(vocab_size=8))
  monkeypatch.setattr(train.workdir_lib, "build_data_once", lambda config, workdir: vocab)
  monkeypatch.setattr(train.steps_lib, "init_state", lambda *args: (None,) * 5)
  refused = []

  def second_run(when):
    with pytest.raises(ValueError, match="is in use"), exclusive(workdir):
      pass
    refused.append(when)

  class Loop:
    num_steps, last_eval = 2, {"eval/loss": 1.0}

    def __init__(self, run):
      self.run = run
      second_run("built")

    def step(self, step, preemption):
      second_run(f"step {step}")
      return False

    def close(self):
      second_run("close")
      self.run.ckpt.close()

    def abort(self):
      self.run.ckpt.close()

  monkeypatch.setattr(train, "_Loop", Loop)
  assert train.train_and_evaluate(tiny_config(), workdir) == {"eval/loss": 1.0}
  assert refused == ["built", "step 0", "step 1", "close"]
  with exclusive(workdir):  # let go when the run returns
    pass

  def diverge(self, step, preemption):
    raise FloatingPointError("train/loss is not finite")

  monkeypatch.setattr(Loop, "step", diverge)
  with pytest.raises(FloatingPointError) as e:
    train.train_and_evaluate(tiny_config(), workdir)
  # Let go when the run fails, too, while its error (whose traceback holds the run's frames)
  # is still being reported: a caller may start the next run in the folder.
  assert e.value is not None
  with exclusive(workdir):
    pass


def test_only_process_0_holds_the_workdir_for_its_run(tmp_path, monkeypatch):
  # The processes of one run share its folder: process 1 taking the lock too would find it
  # held by its own process 0 (on one host) and refuse its own run.
  from cem_jax import workdir as workdir_lib

  with exclusive(str(tmp_path)):
    monkeypatch.setattr(workdir_lib.jax, "process_index", lambda: 1)
    with exclusive(str(tmp_path)):
      entered = True
  assert entered


@pytest.mark.parametrize("code, busy", [
    (errno.EWOULDBLOCK, True),  # (= EAGAIN) another process holds it
    (errno.EACCES, True),  # what flock emulated with fcntl locks says for a held lock
    (errno.ENOLCK, False),  # a network mount without locks
    (errno.EOPNOTSUPP, False),
])
def test_a_held_workdir_is_refused_and_one_that_cannot_be_locked_trains_with_a_warning(
    tmp_path, monkeypatch, caplog, code, busy):
  # A filesystem without flock must not stop every run on it; a held lock must stop the second.
  import fcntl

  def flock(fd, operation):
    raise OSError(code, os.strerror(code))

  monkeypatch.setattr(fcntl, "flock", flock)
  entered = []
  if busy:
    with pytest.raises(ValueError, match=r"is in use: another run is training in it"):
      with exclusive(str(tmp_path)):
        entered.append(True)
  else:
    with exclusive(str(tmp_path)):
      entered.append(True)
    assert (f"--workdir={tmp_path} cannot be locked ({os.strerror(code)}): a second run "
            "started in it would not be refused") in caplog.text
  assert entered == ([] if busy else [True])


def test_a_run_folder_of_another_config_names_three_changes_and_counts_the_rest(tmp_path):
  # The message names the keys that differ, sorted; past three it counts the rest, so that a
  # folder of a very different run is still one readable line.
  from cem_jax.workdir import check_same_run

  (tmp_path / "checkpoints" / "10").mkdir(parents=True)
  (tmp_path / "config.json").write_text(tiny_config().to_json())
  fix = ("; it is not this run and resuming it would mix the two: use the command that started "
         "it, a new --workdir, or delete that run to train it again")
  three = {"model.d_model": 32, "train.batch_size": 4, "train.num_steps": 40}
  for changed, shown in (
      (three, "model.d_model: 64 -> 32; train.batch_size: 8 -> 4; train.num_steps: 30 -> 40"),
      ({**three, "seed": 3},  # one past three: counted, not dropped
       "model.d_model: 64 -> 32; seed: 0 -> 3; train.batch_size: 8 -> 4; and 1 more"),
      ({**three, "seed": 3, "train.warmup_steps": 7},
       "model.d_model: 64 -> 32; seed: 0 -> 3; train.batch_size: 8 -> 4; and 2 more")):
    with pytest.raises(ValueError) as e:
      check_same_run(str(tmp_path), tiny_config(**changed))
    assert str(e.value) == f"{tmp_path} holds a run started with another config ({shown}){fix}"
  check_same_run(str(tmp_path), tiny_config(**{"model.remat": "full"}))  # computed otherwise
  # A damaged config.json: one line naming it, not a traceback of the JSON parser.
  (tmp_path / "config.json").write_text('{"model": {"d_mod')
  with pytest.raises(ValueError) as e:
    check_same_run(str(tmp_path), tiny_config())
  assert str(e.value).startswith(f"{tmp_path / 'config.json'} is not valid JSON (")
  assert str(e.value).endswith("); delete that run to train it again")


def test_a_refused_resume_removes_only_the_data_it_prepared(tmp_path):
  workdir = tmp_path / "w"
  workdir.mkdir()
  assert prepared_folders(str(workdir)) is None
  (workdir / "data" / "old").mkdir(parents=True)
  (workdir / "data" / "old" / "manifest.json").write_text("{}")
  held = prepared_folders(str(workdir))
  (workdir / "data" / "new").mkdir()
  (workdir / "data" / "new" / "manifest.json").write_text("{}")
  remove_prepared_since(str(workdir), held)
  assert sorted(os.listdir(workdir / "data")) == ["old"] and held == {"old"}
  assert os.listdir(workdir / "data" / "old") == ["manifest.json"]
  remove_prepared_since(str(workdir), None)  # WORKDIR/data was not there before: all of it
  assert os.listdir(workdir) == []


def test_preemption_hands_sigterm_back_when_the_run_ends():
  # tables and tests run several trainings in one process: after each, SIGTERM must terminate
  # the process again, not set the flag of a run that has ended.
  import signal

  before = signal.getsignal(signal.SIGTERM)
  with Preemption() as preemption:
    assert signal.getsignal(signal.SIGTERM) == preemption._handle
  assert signal.getsignal(signal.SIGTERM) is before and not preemption.requested
  with Preemption() as preemption:
    assert signal.getsignal(signal.SIGTERM) == preemption._handle  # else the signal kills pytest
    with pytest.raises(cli.Terminated, match="during start-up"):
      signal.raise_signal(signal.SIGTERM)  # before the loop: start-up stops
    assert preemption.requested  # set first: a Terminated dropped still stops the loop
  with Preemption() as preemption:
    preemption.loop_starts()
    signal.raise_signal(signal.SIGTERM)  # in the loop, the notice: a flag, not the end
  assert preemption.requested and signal.getsignal(signal.SIGTERM) is before
  # Outside the main thread signal.signal raises: such a run installs nothing (and starts).
  seen = []

  def in_a_thread():
    try:
      with Preemption() as p:
        seen.append(p.requested)
    except ValueError as e:
      seen.append(e)

  thread = threading.Thread(target=in_a_thread)
  thread.start()
  thread.join()
  assert seen == [False] and signal.getsignal(signal.SIGTERM) is before


def test_held_leaves_alone_a_signal_whose_handler_was_set_outside_python(monkeypatch):
  # signal.getsignal says None for such a handler (JAX's preemption notifier): it could not be
  # put back after the block, so it is never taken.
  import signal

  before = signal.getsignal(signal.SIGTERM)
  real = signal.getsignal
  monkeypatch.setattr(signal, "getsignal", lambda s: None if s == signal.SIGTERM else real(s))
  with signals.held((signal.SIGTERM,)):
    assert real(signal.SIGTERM) is before
  assert real(signal.SIGTERM) is before


def test_held_signals_reach_their_handler_after_the_block_and_a_second_one_at_once():
  import signal

  got, before = [], {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

  def handler(signum, frame):  # not pytest's
    got.append(signal.Signals(signum).name)
    if len(got) > 5:
      raise KeyboardInterrupt

  for signum in before:
    signal.signal(signum, handler)
  try:
    with signals.held((signal.SIGINT, signal.SIGTERM)):
      signal.raise_signal(signal.SIGTERM)
      signal.raise_signal(signal.SIGINT)
      got.append("block ran on")
    assert got == ["block ran on", "SIGTERM", "SIGINT"]  # after the block, to their handler
    got.clear()
    with signals.held():  # SIGINT only
      signal.raise_signal(signal.SIGINT)
      signal.raise_signal(signal.SIGTERM)  # not held: its handler at once
      signal.raise_signal(signal.SIGINT)  # a second one: the way out of a block that hangs
      got.append("block ran on")
    assert got == ["SIGTERM", "SIGINT", "block ran on"]  # each once
    got.clear()
    got.extend(".....")  # the handler raises from now on
    with pytest.raises(KeyboardInterrupt):
      with signals.held():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        got.append("block ran on")
    assert got == [*".....", "SIGINT"]
    got.clear()
    with pytest.raises(RuntimeError, match="the block's own"):
      with signals.held():
        signal.raise_signal(signal.SIGINT)
        raise RuntimeError("the block's own")
    assert got == []  # the block's exception already stops the run
    signal.raise_signal(signal.SIGINT)
    assert got == ["SIGINT"]  # and the handler is back
    seen = []

    def in_a_thread():  # signal.signal would raise there: nothing is held
      with signals.held():
        seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [handler]
  finally:
    for signum, previous in before.items():
      signal.signal(signum, previous)


def test_process_slice_is_the_block_of_rows_this_process_holds():
  class Rows:  # a sharding's view of which rows this process's devices hold
    def __init__(self, *slices):
      self.slices = slices

    def addressable_devices_indices_map(self, shape):
      return {device: (s,) for device, s in enumerate(self.slices)}

  assert sharding.process_slice(Rows(slice(0, 8)), 8) == (0, 1)
  assert sharding.process_slice(Rows(slice(4, 6), slice(6, 8)), 8) == (1, 2)
  assert sharding.process_slice(Rows(slice(6, 8)), 8) == (3, 4)
  assert sharding.process_slice(Rows(slice(0, 2), slice(4, 6)), 8) == (0, 1)  # not one block
  # Rows 0, 1 and 3 span a block of 4 but are not all of it: no (index, count) describes them.
  assert sharding.process_slice(Rows(slice(0, 2), slice(3, 4)), 8) == (0, 1)
  assert sharding.process_slice(Rows(slice(2, 3), slice(3, 4)), 8) == (1, 4)
  # Rows 2..5: one run of 4 rows, but not one of the two blocks of 4 (rows 0..3 or 4..7):
  # (0, 2) would read rows 0..3, half of them another process's.
  assert sharding.process_slice(Rows(slice(2, 4), slice(4, 6)), 8) == (0, 1)
  # Spans listed by start: one that ends before an earlier one (rows 0..3 and 2) still
  # lies in its block, rows 0..3 of 8.
  assert sharding.process_slice(Rows(slice(2, 3), slice(0, 4)), 8) == (0, 2)


def test_recursion_report_tables_are_the_committed_reports_and_match_numpy():
  """The loss and energy tables computed from results/tiny/design's metrics.jsonl are the
  committed results/tiny/design_recursion.md's, line for line; two cells recomputed here from
  the JSON lines in float64 (a sign flipped in a paired difference, or step t+1's "after"
  taken for its "before", left the other tests passing)."""
  import importlib.util

  import numpy as np

  root = Path(__file__).resolve().parents[1]
  spec = importlib.util.spec_from_file_location("recursion_report",
                                                root / "experiments/recursion_report.py")
  rr = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(rr)
  workdir = str(root / "results/tiny")
  committed = (root / "results/tiny/design_recursion.md").read_text().split("\n## ")
  tables = [[line for line in part.splitlines() if line.startswith("|")]
            for part in committed[1:3]]
  assert rr.loss_table(workdir) == tables[0]
  assert rr.energy_table(workdir) == tables[1]

  def last_eval(row, seed):
    lines = (root / f"results/tiny/design/{row}/seed{seed}/metrics.jsonl").read_text()
    return [m for m in map(json.loads, lines.splitlines()) if "eval/loss" in m][-1]

  # t2_fixed: eval loss minus t1's, paired by seed: mean ± sample std.
  d = np.array([last_eval("t2_fixed", s)["eval/loss"] - last_eval("t1", s)["eval/loss"]
                for s in range(3)], np.float64)
  row = next(line for line in tables[0] if line.startswith("| t2_fixed |"))
  assert row.split("|")[5].strip() == f"{d.mean():+.3f} ± {d.std(ddof=1):.3f}"
  # t2_fixed: how far the MLP step moves the attention energy between steps 1 and 2: step 2's
  # before minus step 1's after, over layers and seeds.
  moved = []
  for s in range(3):
    m = last_eval("t2_fixed", s)
    layers = {int(k.split("/")[2][5:]) for k in m if k.startswith("eval/energy/layer")}
    moved += [m[f"eval/energy/layer{i}/step2/att_before"]
              - m[f"eval/energy/layer{i}/step1/att_after"] for i in sorted(layers)]
  row = next(line for line in tables[1] if line.startswith("| t2_fixed |"))
  assert len(moved) > 3 and row.split("|")[7].strip() == f"{np.mean(moved):+.2f}"


def test_recursion_report_reads_a_diverged_run_and_names_a_run_without_evals(tmp_path):
  import importlib.util

  spec = importlib.util.spec_from_file_location(
      "recursion_report", Path(__file__).resolve().parents[1] / "experiments/recursion_report.py")
  report = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(report)
  key = "eval/energy/layer0/step1/att_{}".format
  for row, loss, energy in (("t1", 2.0, (1.0, 0.5)), ("t2_fixed", None, (None, None))):
    run = tmp_path / "design" / row / "seed0"
    run.mkdir(parents=True)
    (run / "result.json").write_text("{}")
    # null: not finite, as metrics.jsonl writes it
    write_metrics(run, [{"step": 10, "eval/loss": loss, key("before"): energy[0],
                         key("after"): energy[1]}])
  table = report.loss_table(str(tmp_path))
  assert table[2:] == ["| t1 | 2.0000 | 0 | +nan |", "| t2_fixed | nan | +nan | 0 |"]
  assert "| t1 | -0.50 | – | – | – | 1/1 | – | – |" in report.energy_table(str(tmp_path))
  write_metrics(tmp_path / "design" / "t1" / "seed0", [{"step": 10, "train/loss": 3.0}])
  with pytest.raises(ValueError, match=r"design/t1/seed0/metrics\.jsonl has no eval line"):
    report.loss_table(str(tmp_path))


def _load_experiment(name: str):
  import importlib.util

  spec = importlib.util.spec_from_file_location(
      name, Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# Optimised HLO as XLA's GPU dumps write it: a synchronous all-gather, a combined asynchronous
# one returning (operands, results), an all-reduce's start (its result), a collective-permute's
# start, a reduce-scatter at the root of an async computation, and lines that quote an
# instruction without defining one (metadata, a "from instruction" note).
_HLO = """HloModule jit_step
%async_computation (p: f32[8,8]) -> f32[4,8] {
  ROOT %reduce-scatter.1 = f32[4,8]{1,0} reduce-scatter(f32[8,8]{1,0} %p), dimensions={0}
}
ENTRY %main {
  %all-gather.1 = f32[8,16]{1,0} all-gather(%a), channel_id=1, dimensions={0}
  %all-gather-start = ((f32[2]{0}, bf16[4,4]{1,0}), (f32[8]{0}, /*index=1*/bf16[16,4]{1,0})) \
all-gather-start(%b, %c), channel_id=2
  %all-gather-done = (f32[8]{0}, bf16[16,4]{1,0}) all-gather-done(%all-gather-start)
  %all-reduce-start = bf16[1024]{0} all-reduce-start(%d), replica_groups=mesh['x'=2] {'x'}
  %all-reduce-done = bf16[1024]{0} all-reduce-done(%all-reduce-start)
  ROOT %cp = (f32[3,3]{1,0}, f32[3,3]{1,0}) collective-permute-start(%e), channel_id=5
  %fusion = f32[8,16]{1,0} fusion(%x), metadata={op_name="%z = f32[99] all-gather(%y)"}
    from instruction: %all-to-all.7 = f32[999,999]{1,0} all-to-all(%q), dimensions={0}
}
"""


def test_collectives_counts_each_collective_once_at_its_results():
  collectives = _load_experiment("collectives").collectives
  assert collectives(_HLO) == {
      "all-gather": (2, 8 * 16 * 4 + 8 * 4 + 16 * 4 * 2),  # the start's results, not operands
      "all-reduce": (1, 1024 * 2),
      "collective-permute": (1, 3 * 3 * 4),
      "reduce-scatter": (1, 4 * 8 * 4),
  }


def test_collectives_reads_a_program_jax_compiled_on_four_devices():
  script = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
sys.path.insert(0, sys.argv[1])
from collectives import collectives
mesh = jax.make_mesh((4,), ("d",))
x = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("d")))
gather = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P()))
total = jax.jit(lambda x: jnp.sum(x, 0), out_shardings=NamedSharding(mesh, P()))
print(json.dumps([collectives(f.lower(x).compile().as_text()) for f in (gather, total)]))
"""
  gather, total = program_json(["-c", script, str(Path(__file__).resolve().parents[1] /
                                                  "experiments")], 4)
  assert gather == {"all-gather": [1, 8 * 16 * 4]}, gather
  assert total == {"all-reduce": [1, 16 * 4]}, total


def _collapse_batch() -> dict:
  """A batch of 3 windows of 8 tokens for experiments/collapse.py's layer_report: two documents
  in the first, padding after 6 tokens in the second, one real position (no pair) in the
  third."""
  import numpy as np

  tokens = np.random.default_rng(7).integers(1, 40, (3, 8))
  return {"inputs": tokens, "targets": np.roll(tokens, -1, 1),
          "segment_ids": np.array([[1] * 5 + [2] * 3, [1] * 6 + [0] * 2, [1] + [0] * 7]),
          "weights": np.array([[1.0] * 7 + [0.0], [1.0] * 5 + [0.0] * 3, [0.0] * 8])}


def test_collapse_measures_match_numpy_and_the_split_updates_add_up_to_the_block():
  """experiments/collapse.py: its two measures against float64 NumPy, and the attention and
  MLP updates it splits a layer into (each split it supports) against the block's own output,
  at random parameters; a split that is off trips its check."""
  import numpy as np

  collapse = _load_experiment("collapse")
  batch = _collapse_batch()
  # The measures at the shapes layer_report gives them (d_model 16 below): each op runs
  # eagerly, compiled once per shape.
  u = np.random.default_rng(7).normal(size=(3, 8, 16))
  share = np.sqrt(8 * np.sum(u.mean(axis=1) ** 2)) / np.linalg.norm(u)
  assert abs(collapse.constant_share(jax.numpy.asarray(u)) - share) < 1e-6
  assert abs(collapse.constant_share(jax.numpy.asarray(np.repeat(u[:, :1], 8, 1))) - 1) < 1e-6
  assert collapse.constant_share(jax.numpy.asarray(u - u.mean(axis=1, keepdims=True))) < 1e-6
  real = batch["segment_ids"] > 0
  pairs = [u[b, i] @ u[b, j] / np.linalg.norm(u[b, i]) / np.linalg.norm(u[b, j])
           for b in range(3) for i in range(8) for j in range(8)
           if i != j and real[b, i] and real[b, j]]
  got = collapse.position_collapse(jax.numpy.asarray(u), jax.numpy.asarray(real))
  assert abs(got - np.mean(pairs)) < 1e-6

  for overrides, parts in (({}, {"att", "mlp"}), ({"split": "joint"}, {"att", "mlp"}),
                           ({"mlp_condition": "layer", "embed_scale": 4.0}, {"att", "mlp"}),
                           ({"num_unique_blocks": 1, "num_layers": 3}, {"att", "mlp"}),
                           ({"num_steps": 2}, {"upd"})):
    cfg = tiny_config(**{f"model.{k}": v for k, v in overrides.items()}).model
    cfg.d_model, cfg.num_heads, cfg.mlp_dim, cfg.init_std = 16, 2, 32, 0.3
    model = DecoderLM(cfg, 40, rngs=nnx.Rngs(3))
    report = collapse.layer_report(model, batch)
    assert [set(layer) for layer in report["layers"]] == [parts] * cfg.num_layers, overrides
    assert report["loss"] > 0 and 0 < report["collapse"] < 1 and report["h_over_e"] > 0
    if not overrides:
      split_model = model  # checked again below: a model of other shapes recompiles every op
  real_split = collapse._sub_steps
  try:
    collapse._sub_steps = lambda block, x, aux: (lambda a, m: (a, 1.001 * m))(
        *real_split(block, x, aux))
    with pytest.raises(AssertionError, match="split updates miss the block's output"):
      collapse.layer_report(split_model, batch)
  finally:
    collapse._sub_steps = real_split


def test_collapse_report_is_the_models_own_forward_with_momentum():
  """experiments/collapse.py follows DecoderLM layer by layer: with a momentum block the
  velocity is carried across layers (restarted at 0 in each layer, the layers after the first
  were another network), so its loss is the model's own on the batch."""
  import numpy as np

  collapse = _load_experiment("collapse")
  batch = _collapse_batch()
  tokens = batch["inputs"]
  for optimizer in ("heavy_ball", "nesterov"):
    cfg = tiny_config(**{"model.inner_optimizer": optimizer, "model.num_layers": 3}).model
    cfg.d_model, cfg.num_heads, cfg.mlp_dim, cfg.init_std = 16, 2, 32, 0.3
    model = DecoderLM(cfg, 40, rngs=nnx.Rngs(3))
    logits = np.asarray(model(jax.numpy.asarray(tokens),
                              jax.numpy.asarray(batch["segment_ids"])), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    want = (nll * batch["weights"]).sum() / batch["weights"].sum()
    got = collapse.layer_report(model, batch)["loss"]
    assert abs(got - want) <= 1e-5 * want, (optimizer, got, want)


def test_collapse_reads_a_bfloat16_run_and_skips_a_damaged_checkpoint(tmp_path):
  """experiments/collapse.py on a bfloat16-compute run (its float32 split check computed in
  float32, not an AssertionError) whose older checkpoint is damaged: that step is named and
  skipped (restored, it gave wrong numbers or NaN without a word), the others reported."""
  from cem_jax import train

  workdir = tmp_path / "run"
  # One layer of width 32 on 32 tokens, its eval untraced: the report reads neither.
  train.train_and_evaluate(tiny_config(**{
      "model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64, "model.num_layers": 1,
      "data.seq_len": 32, "train.batch_size": 4, "model.dtype": "bfloat16",
      "train.num_steps": 4, "checkpoint.every_steps": 2, "train.eval_every_steps": 4,
      "eval.max_batches": 1, "eval.energy_trace": False}), str(workdir))
  files = sorted((workdir / "checkpoints" / "2").rglob("ocdbt.process_0/d/*"),
                 key=lambda p: p.stat().st_size)
  for path in files[-3:]:  # the largest: parameters and optimizer moments
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
  root = Path(__file__).resolve().parents[1]
  proc = subprocess.run([sys.executable, str(root / "experiments" / "collapse.py"),
                         f"--workdir={workdir}"], env=subprocess_env(),
                        capture_output=True, text=True, timeout=300, cwd=root)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert "computed here in float32" in lines[0], lines
  assert [line.split()[1] for line in lines if line.startswith("step")] == ["0", "2", "4"]
  assert "damaged, skipped" in next(line for line in lines if line.startswith("step      2"))
  assert "loss" in next(line for line in lines if line.startswith("step      4"))
