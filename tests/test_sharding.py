"""Sharded training: mesh checks and rules, equal losses on every mesh, two processes = one.

Multi-device runs happen in subprocesses with ``XLA_FLAGS=--xla_force_host_platform_device_count``
set before jax loads; this pytest process stays single-device so other tests are unaffected.
"""

import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import program_json, subprocess_env, tiny_config

from cem_jax import axes, distributed, sharding
from cem_jax import config as config_lib

REPO = Path(__file__).resolve().parents[1]
# Llama runs pure data parallelism too, for the memory comparison with fsdp; CEM (its every
# parameter kind) the meshes that split parameters.
MESHES = {"llama": [(8, 1, 1), (2, 4, 1), (2, 2, 2)], "cem": [(2, 4, 1), (2, 2, 2)]}


def _env(devices: int) -> dict:
  return subprocess_env(devices, PYTHONPATH=str(REPO))


# ---------------------------------------------------------------------------------------------
# Start-up checks: one line each, naming the field, the value and what is allowed.


def _check(num_devices=8, **overrides):
  cfg = tiny_config("cem", **overrides)
  return axes.check_config(cfg, num_devices)


def test_mesh_that_does_not_use_the_devices_is_one_clear_line():
  with pytest.raises(ValueError) as e:
    _check(**{"mesh.data": 3, "mesh.fsdp": 2})
  assert str(e.value) == ("mesh.data*mesh.fsdp*mesh.tensor = 3*2*1 = 6, but there are 8 "
                          "devices; allowed: sizes whose product is 8 (one of them may be -1 = "
                          "the rest)")
  with pytest.raises(ValueError, match=r"^mesh sizes .* do not divide the 8 devices; allowed"):
    _check(**{"mesh.fsdp": 3})
  assert _check(**{"mesh.fsdp": 2, "mesh.tensor": 2}) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_batch_not_divisible_by_data_times_fsdp_is_one_clear_line():
  with pytest.raises(ValueError) as e:
    _check(**{"mesh.fsdp": 4, "train.batch_size": 4})  # data=2 x fsdp=4 = 8 rows per step
  assert str(e.value) == (
      "train.batch_size=4 is not divisible by the 8 data-parallel devices (8 devices, "
      "mesh.data x mesh.fsdp = 2 x 4); use a multiple of 8, e.g. 8")
  with pytest.raises(ValueError, match=r"^eval\.batch_size=12 is not divisible by the 8 "):
    _check(**{"eval.batch_size": 12})
  # Tensor parallelism does not split the batch: 8 devices as 2 x 1 x 4 need multiples of 2.
  _check(**{"mesh.tensor": 4, "model.num_heads": 4, "train.batch_size": 2,
            "eval.batch_size": 2})


@pytest.mark.parametrize("field,value,logical", [
    ("model.num_heads", 2, "heads"), ("model.mlp_dim", 102, "mlp")])
def test_tensor_size_must_divide_heads_and_mlp(field, value, logical):
  with pytest.raises(ValueError) as e:
    _check(**{"mesh.tensor": 4, field: value})
  assert str(e.value) == (f"{field}={value} is not divisible by mesh.tensor=4 (mesh.rules shards "
                          f"'{logical}' over tensor); allowed: a tensor size dividing {value}")


def test_a_dimension_split_over_two_mesh_axes_must_divide_by_their_product():
  # mlp over fsdp x tensor = 2 x 2 (8 devices, data 2): 102 divides by each axis alone but
  # not into the 4 shards jax would need.
  rules = tuple(("mlp", ("fsdp", "tensor")) if name == "mlp" else (name, target)
                for name, target in axes.DEFAULT_RULES)
  with pytest.raises(ValueError) as e:
    _check(**{"mesh.fsdp": 2, "mesh.tensor": 2, "mesh.rules": rules, "model.mlp_dim": 102})
  assert str(e.value) == ("model.mlp_dim=102 is not divisible by mesh.fsdp=2 x mesh.tensor=2 "
                          "(mesh.rules shards 'mlp' over fsdp x tensor); allowed: a fsdp x "
                          "tensor size dividing 102")
  assert _check(**{"mesh.fsdp": 2, "mesh.tensor": 2, "mesh.rules": rules,
                   "model.mlp_dim": 104})["data"] == 2


def test_mesh_sizes_refuse_a_bool_and_a_second_minus_one():
  # True is an int to Python: mesh.data=true in a config.json would read as 1 device.
  with pytest.raises(ValueError, match=r"^mesh\.data=True; allowed: -1 \(the devices left over\)"):
    axes.check_mesh_sizes({"data": True, "fsdp": 1, "tensor": 1})
  with pytest.raises(ValueError, match=r"^mesh\.data=-1 and mesh\.fsdp=-1: at most one mesh size"):
    axes.check_mesh_sizes({"data": -1, "fsdp": -1, "tensor": 1})
  axes.check_mesh_sizes({"data": -1, "fsdp": 2, "tensor": 1})


def test_two_microbatches_must_divide_each_devices_rows():
  # 4 rows over 4 data-parallel devices is one row each: it cannot make 2 microbatches.
  with pytest.raises(ValueError, match=r"^train\.batch_size=4 is not divisible by "
                                       r"train\.gradient_accumulation_steps=2 x the 4 "):
    _check(4, **{"train.batch_size": 4, "eval.batch_size": 4,
                 "train.gradient_accumulation_steps": 2})
  _check(2, **{"train.batch_size": 4, "eval.batch_size": 4,
               "train.gradient_accumulation_steps": 2})


def test_the_augmented_head_is_head_dim_plus_d_model_plus_one_in_the_distance_form():
  # q~ = [q, d*y] (bilinear) or [q, d*y, -1/2] (distance); none without a CEM diagonal.
  for form, extra in (("bilinear", 0), ("distance", 1)):
    m = tiny_config("cem", **{"model.diagonal": "per_head", "model.diagonal_form": form}).model
    assert axes.augmented_head_dim(m) == m.d_model // m.num_heads + m.d_model + extra
  assert axes.augmented_head_dim(tiny_config("cem", **{"model.diagonal": "none"}).model) is None
  assert axes.augmented_head_dim(tiny_config("llama").model) is None
  assert axes.augmented_head_dim(tiny_config("cem", **{
      "model.diagonal": "per_head", "model.cem_attention": False}).model) is None


def test_fsdp_size_must_divide_d_model():
  with pytest.raises(ValueError, match=r"^model\.d_model=60 is not divisible by mesh\.fsdp=8 "):
    _check(**{"mesh.fsdp": 8, "model.d_model": 60, "model.num_heads": 2})


def test_cli_reports_a_bad_mesh_in_one_line(tmp_path):
  cfg = tmp_path / "cfg.py"
  cfg.write_text("from cem_jax.config import get_default_config\n\n\n"
                 "def get_config():\n  return get_default_config()\n")
  proc = subprocess.run(
      [sys.executable, "-m", "cem_jax.main", f"--config={cfg}", f"--workdir={tmp_path / 'w'}",
       "--config.mesh.tensor=3"], cwd=REPO, env=_env(3), capture_output=True, text=True,
      timeout=120)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      "error: model.num_heads=4 is not divisible by mesh.tensor=3 (mesh.rules shards 'heads' "
      "over tensor); allowed: a tensor size dividing 4")
  assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------------------------------------
# mesh.rules in the config.


def test_rules_default_survive_config_json_and_reach_the_specs():
  cfg = config_lib.get_default_config()
  assert axes.rules_from_config(cfg.mesh) == axes.DEFAULT_RULES
  saved = json.loads(json.dumps(cfg.to_dict()))  # what config.json holds: lists, not tuples
  loaded = config_lib.get_default_config()
  loaded.update(saved)
  assert axes.rules_from_config(loaded.mesh) == axes.DEFAULT_RULES
  config_lib.validate(loaded)
  spec = sharding.logical_to_spec(("embed", "mlp"), axes.rules_from_config(loaded.mesh))
  assert spec == sharding.PartitionSpec("fsdp", "tensor")


def test_rules_override_from_the_command_line(tmp_path):
  script = textwrap.dedent("""
      from absl import app
      from ml_collections import config_flags
      from cem_jax import axes, config, sharding
      C = config_flags.DEFINE_config_file("config", None, "", lock_config=True)
      def main(argv):
        config.validate(C.value)
        rules = axes.rules_from_config(C.value.mesh)
        print(rules, tuple(sharding.logical_to_spec(("embed", "mlp"), rules)))
      app.run(main)
  """)
  (tmp_path / "show.py").write_text(script)
  rules = "(('batch', ('data', 'fsdp')), ('embed', None), ('mlp', ('fsdp', 'tensor')))"
  proc = subprocess.run([sys.executable, str(tmp_path / "show.py"),
                         f"--config={REPO / 'experiments/tiny.py'}",
                         f"--config.mesh.rules={rules}"], cwd=REPO, env=_env(1),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == f"{rules} (None, ('fsdp', 'tensor'))"


def test_bad_rules_are_one_clear_line():
  cfg = tiny_config("cem", **{"mesh.rules": (("embed", "fdsp"),)})
  with pytest.raises(ValueError, match=r"^mesh\.rules maps 'embed' to 'fdsp'; allowed mesh axes: "
                                       r"data, fsdp, tensor \(or None: replicated\)$"):
    config_lib.validate(cfg)
  cfg = tiny_config("cem", **{"mesh.rules": (("hidden", "fsdp"),)})
  with pytest.raises(ValueError, match=r"^mesh\.rules names logical axis 'hidden'; allowed: "):
    config_lib.validate(cfg)
  # What --config.mesh.rules=5 or =(None,) hands over (no TypeError traceback).
  with pytest.raises(ValueError, match=r"^mesh\.rules=5; allowed: a tuple of \(logical_axis, "):
    axes.rules_from_config({"rules": 5})
  with pytest.raises(ValueError, match=r"^mesh\.rules entry None; allowed: a pair "):
    axes.rules_from_config({"rules": (None,)})
  # A NamedSharding takes a mesh axis once (main failed at the first sharding with jax's
  # DuplicateSpecError); a second rule for an axis would win silently.
  with pytest.raises(ValueError, match=r"^mesh\.rules maps 'embed' to \('fsdp', 'fsdp'\), a "
                                       r"mesh axis twice; allowed: each mesh axis at most once"):
    config_lib.validate(tiny_config("cem", **{"mesh.rules": (("embed", ("fsdp", "fsdp")),)}))
  with pytest.raises(ValueError, match=r"^mesh\.rules gives logical axis 'embed' twice; "):
    config_lib.validate(tiny_config("cem", **{"mesh.rules": (("embed", "fsdp"),
                                                             ("embed", None))}))


def test_a_dimension_the_mesh_axes_do_not_divide_is_replicated_with_a_warning(caplog):
  # jax.jit refuses uneven shardings: a loaded tokenizer's vocabulary of 50 over tensor=4.
  import logging
  from types import SimpleNamespace

  from flax import nnx

  from cem_jax import steps

  _, abstract = nnx.split(nnx.eval_shape(lambda: steps.build_model(tiny_config("llama"), 50)),
                          nnx.Param)
  mesh = SimpleNamespace(shape={"data": 1, "fsdp": 2, "tensor": 4})  # only its sizes are read
  with caplog.at_level(logging.WARNING):
    specs = sharding.param_specs(abstract, mesh=mesh)
  assert specs["embedding"] == sharding.PartitionSpec(None, "fsdp")  # vocab, embed (64)
  assert "dimension of size 50 is not divisible by mesh axes ('tensor',); replicated" in (
      caplog.text)


def test_the_default_rules_split_what_the_design_says():
  # axes.py: fsdp shards the model dimension; tensor the heads, the MLP width and the
  # vocabulary; a head's own width is never split; batches go over data x fsdp.
  from jax.sharding import PartitionSpec as P

  rules = axes.rules_from_config(config_lib.get_default_config().mesh)
  assert {a: sharding.logical_to_spec((a,), rules) for a in axes.LOGICAL_AXES} == {
      "batch": P(("data", "fsdp")), "embed": P("fsdp"), "heads": P("tensor"),
      "head_dim": P(None), "mlp": P("tensor"), "vocab": P("tensor")}
  # so a head width that tensor does not divide is fine: only the heads are split
  assert _check(4, **{"mesh.tensor": 4, "model.head_dim": 6})["tensor"] == 4


def test_the_batch_is_split_over_the_mesh_axes_its_rule_names():
  # With batch over data alone, fsdp's devices hold the same rows: the batch need only divide
  # mesh.data (2 of 8 devices here), and the batch sharding says so.
  rules = (("batch", "data"), ("embed", "fsdp"))
  cfg = tiny_config("cem", **{"mesh.fsdp": 4, "mesh.rules": rules, "train.batch_size": 2,
                              "eval.batch_size": 2})
  assert axes.check_config(cfg, 8) == {"data": 2, "fsdp": 4, "tensor": 1}
  cfg.eval.batch_size = 3
  with pytest.raises(ValueError) as e:
    axes.check_config(cfg, 8)
  assert str(e.value) == ("eval.batch_size=3 is not divisible by the 2 data-parallel devices "
                          "(8 devices, mesh.data = 2); use a multiple of 2, e.g. 4")
  mesh = sharding.make_mesh(tiny_config("cem").mesh)  # this process's one device
  assert sharding.batch_sharding(mesh, rules).spec == sharding.PartitionSpec("data", None)
  assert sharding.batch_sharding(mesh).spec == sharding.PartitionSpec(("data", "fsdp"), None)


def test_parameters_and_adam_moments_are_laid_out_by_the_configured_rules():
  # On this process's one device (a 1 x 1 x 1 mesh) every spec is kept as the rules give it,
  # so the layout a pod would get is visible here: the parameters by mesh.rules (not the
  # defaults), Adam's moments exactly like their parameters, counts and flags replicated.
  import jax
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from cem_jax import optim, steps

  rules = (("batch", "data"), ("embed", None), ("mlp", ("fsdp", "tensor")), ("vocab", "tensor"))
  cfg = tiny_config("llama", **{"model.num_layers": 1, "model.d_model": 16, "model.num_heads": 2,
                                "model.mlp_dim": 32, "mesh.rules": rules})
  mesh = sharding.make_mesh(cfg.mesh)
  # DESIGN.md: jax's Explicit default breaks sharded matmuls of ordinary code
  assert tuple(mesh.axis_types) == (jax.sharding.AxisType.Auto,) * 3
  _, abstract = nnx.split(nnx.eval_shape(lambda: steps.build_model(cfg, 64)), nnx.Param)
  params = sharding.param_shardings(abstract, mesh, axes.rules_from_config(cfg.mesh))
  # w_up is (embed, mlp), the embedding (vocab, embed)
  assert params["blocks"][0]["mlp"]["w_up"].spec == P(None, ("fsdp", "tensor"))
  assert params["embedding"].spec == P("tensor", None)
  tx, _ = optim.make_optimizer(cfg.train)
  opt = sharding.opt_state_shardings(tx, jax.eval_shape(tx.init, abstract), params, mesh)
  is_sharding = lambda x: isinstance(x, NamedSharding)  # noqa: E731
  param_specs = [x.spec for x in jax.tree.leaves(params, is_leaf=is_sharding)]
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
  (adam,) = [x for x in jax.tree.leaves(opt, is_leaf=is_adam) if is_adam(x)]
  for moment in (adam.mu, adam.nu):
    assert [x.spec for x in jax.tree.leaves(moment, is_leaf=is_sharding)] == param_specs
  moments = {id(x) for m in (adam.mu, adam.nu) for x in jax.tree.leaves(m, is_leaf=is_sharding)}
  others = [x for x in jax.tree.leaves(opt, is_leaf=is_sharding) if id(x) not in moments]
  assert others and all(x.spec == P() for x in others)


def test_a_rule_that_is_not_a_pair_is_one_clear_line():
  # Else Python's own unpacking error ("too many values to unpack") with a traceback.
  for entry in (("embed",), ("embed", "fsdp", "tensor"), ["embed"]):
    with pytest.raises(ValueError) as e:
      axes.rules_from_config({"rules": (entry,)})
    assert str(e.value) == (f"mesh.rules entry {entry!r}; allowed: a pair (logical_axis, "
                            "mesh_axis or None or a tuple of mesh axes)")


def test_rows_are_split_only_over_mesh_axes_whose_product_divides_them():
  # The activations' and splash's row split (model.py, attention.py): an uneven split is an
  # error in jax, so a batch the axes do not divide (decoding 4 rows on 8 devices) stays whole.
  from cem_jax import axes

  shape = {"data": 2, "fsdp": 4, "tensor": 2}
  assert axes.dividing_axes(("data", "fsdp"), 16, shape) == ("data", "fsdp")
  assert axes.dividing_axes(("data", "fsdp"), 4, shape) is None
  assert axes.dividing_axes(("data", "fsdp"), 1, shape) is None
  assert axes.dividing_axes(("data", "fsdp"), 6, {"data": 2}) == ("data",)  # fsdp not there
  assert axes.dividing_axes((), 8, shape) is None


def test_a_mesh_over_given_devices_lays_them_out_in_order_under_the_mesh_axis_names():
  # The subset/target path of make_mesh (not jax.make_mesh): devices 0..7 in the order given
  # fill [data, fsdp, tensor] = [2, 4, 1] row by row. Losses cannot see a wrong layout (any
  # sharding computes the same numbers), so it is checked here, on stand-in devices.
  class Device:
    def __init__(self, i):
      self.id, self.platform, self.device_kind = i, "cpu", "cpu"

  devices = [Device(i) for i in range(8)]
  mesh = sharding.make_mesh(tiny_config("cem", **{"mesh.fsdp": 4}).mesh, devices)
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
  assert [[d.id for d in row] for row in mesh.devices[:, :, 0]] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_mesh_axis_two_logical_axes_map_to_is_used_by_the_first_only():
  # NamedSharding rejects a spec naming a mesh axis twice: the later dimension is replicated,
  # and of a tuple rule only the axes not yet used remain (written out by hand).
  from jax.sharding import PartitionSpec as P

  rules = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "fsdp"), ("vocab", "tensor"))
  assert sharding.logical_to_spec(("embed", "mlp"), rules) == P("fsdp", None)
  assert sharding.logical_to_spec(("mlp", "vocab", "embed"), rules) == P("fsdp", "tensor", None)
  assert sharding.logical_to_spec(("embed", "batch"), rules) == P("fsdp", "data")
  assert sharding.logical_to_spec(("batch", "embed"), rules) == P(("data", "fsdp"), None)
  assert sharding.logical_to_spec((None, "embed"), rules) == P(None, "fsdp")


def test_global_batch_gives_jax_this_process_rows_and_the_global_row_count(monkeypatch):
  # One process of four holds 2 of 8 rows: jax must be told the global shape [8, ...], not the
  # local one (with one process the two agree, so only a spy tells them apart).
  seen = []
  monkeypatch.setattr(sharding.jax, "make_array_from_process_local_data",
                      lambda sh, v, shape: seen.append((sh, v.shape, shape)) or shape)
  local = {"inputs": np.zeros((2, 5), np.int32), "weights": np.zeros((2, 5), np.float32)}
  out = sharding.global_batch(local, "S", 8)
  assert out == {"inputs": (8, 5), "weights": (8, 5)}
  assert seen == [("S", (2, 5), (8, 5)), ("S", (2, 5), (8, 5))]


# ---------------------------------------------------------------------------------------------
# jax.distributed start-up decisions (no processes started).


def test_distributed_resolve():
  assert distributed.resolve("auto", environ={}) is None
  assert distributed.resolve("off", environ={}) is None
  env = {"CEM_COORDINATOR_ADDRESS": "127.0.0.1:5", "CEM_NUM_PROCESSES": "2",
         "CEM_PROCESS_ID": "1"}
  assert distributed.resolve("auto", environ=env) == {
      "coordinator_address": "127.0.0.1:5", "num_processes": 2, "process_id": 1}
  assert distributed.resolve("auto", "h:9", 4, 3, environ=env)["coordinator_address"] == "h:9"
  slurm = {"SLURM_NTASKS": "16", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "7"}
  assert distributed.resolve("auto", environ=slurm) == {}  # JAX detects the rest
  assert distributed.resolve("auto", environ={**slurm, "SLURM_NTASKS": "1"}) is None
  assert distributed.resolve("on", environ={}) == {}  # TPU pods: JAX asks the metadata server
  assert distributed.resolve("on", num_processes=4, process_id=2, environ={}) == {
      "num_processes": 4, "process_id": 2}  # given without a coordinator: JAX finds it
  with pytest.raises(ValueError, match=r"needs --num_processes and --process_id"):
    distributed.resolve("auto", "h:1", environ={})
  with pytest.raises(ValueError, match=r"^--process_id=2 with --num_processes=2; allowed"):
    distributed.resolve("auto", "h:1", 2, 2, environ={})
  # jax took these to tracebacks (IndexError, JaxRuntimeError), a 300 s wait, or a lone run.
  for address in ("nonsense", "h:abc", ":1234", "h:", "h:0", "h:70000", "h:+1"):
    with pytest.raises(ValueError, match=rf"^--coordinator_address={re.escape(repr(address))} "
                                         r"\(or CEM_COORDINATOR_ADDRESS\); allowed: HOST:PORT"):
      distributed.resolve("auto", address, 2, 0, environ={})
  with pytest.raises(ValueError, match=r"^--coordinator_address='x' \(or CEM_COORDINATOR_"):
    distributed.resolve("auto", environ={**env, "CEM_COORDINATOR_ADDRESS": "x"})
  assert distributed.resolve("auto", "[::1]:65535", 2, 0, environ={})["coordinator_address"] == (
      "[::1]:65535")
  with pytest.raises(ValueError, match=r"^environment variable CEM_PROCESS_ID='x'"):
    distributed.resolve("auto", environ={**env, "CEM_PROCESS_ID": "x"})
  # Several processes given without a coordinator: each would train alone as process 0.
  for given, environ in (((None, 4, 1), {}), ((None, None, None),
                                            {"CEM_NUM_PROCESSES": "2", "CEM_PROCESS_ID": "0"})):
    with pytest.raises(ValueError, match=r"^--num_processes=\d \(or CEM_NUM_PROCESSES\) without "
                                         r"a coordinator; allowed: with --coordinator_address"):
      distributed.resolve("auto", *given, environ=environ)
  assert distributed.resolve("auto", None, 1, 0, environ={}) is None  # one process: as it is


def test_distributed_refuses_what_it_would_ignore():
  # 'off' starts no jax.distributed: a process given a coordinator, a count or an id (a flag,
  # or the variable launch/local.py sets) trained alone as process 0, all in one --workdir.
  for given, environ, named in (
      (("h:1", 2, 0), {}, "--coordinator_address='h:1'"),
      ((None, 2, None), {}, "--num_processes=2"),
      ((None, None, 1), {}, "--process_id=1"),
      ((None, None, None), {"CEM_PROCESS_ID": "1"}, "environment variable CEM_PROCESS_ID='1'"),
      ((None, None, None), {"CEM_COORDINATOR_ADDRESS": "h:1"},
       "environment variable CEM_COORDINATOR_ADDRESS='h:1'")):
    with pytest.raises(ValueError) as e:
      distributed.resolve("off", *given, environ=environ)
    assert str(e.value) == (f"{named} has no effect with --distributed=off (one process, "
                            "jax.distributed not started); leave it out, or use "
                            "--distributed=auto or on")
  # 'auto' with no coordinator and no cluster is one process: an id other than 0 was ignored.
  for given, environ in (((None, None, 3), {}), ((None, 1, 1), {}),
                         ((None, None, None), {"CEM_PROCESS_ID": "2"})):
    with pytest.raises(ValueError, match=r"^--process_id=\d \(or CEM_PROCESS_ID\) without a "
                                         r"coordinator; allowed: 0 \(one process\), or with "):
      distributed.resolve("auto", *given, environ=environ)
  assert distributed.resolve("auto", None, None, 0, environ={}) is None
  # Where JAX finds the others, the id is handed on.
  slurm = {"SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]"}
  assert distributed.resolve("auto", None, None, 3, environ=slurm) == {"process_id": 3}
  assert distributed.resolve("on", None, None, 3, environ={}) == {"process_id": 3}


def test_a_batch_script_outside_srun_is_one_process():
  # sbatch/salloc set SLURM_NTASKS for the whole allocation; only an srun step starts that
  # many processes (SLURM_STEP_NODELIST). A plain `python -m cem_jax.main` in the batch script
  # is one process: initialising jax.distributed would wait for peers that never come.
  batch_script = {"SLURM_NTASKS": "16", "SLURM_JOB_ID": "7", "SLURM_NODELIST": "gpu[01-02]"}
  assert distributed.cluster_processes(batch_script) == 1
  assert distributed.resolve("auto", environ=batch_script) is None
  assert distributed.cluster_processes({**batch_script, "SLURM_STEP_NODELIST": "gpu01"}) == 16
  # A count that is not an int is no count: the next launcher's is read, else one process.
  odd = {"SLURM_NTASKS": "16(x2)", "SLURM_STEP_NODELIST": "gpu01"}
  assert distributed.cluster_processes(odd) == 1
  assert distributed.cluster_processes({**odd, "OMPI_COMM_WORLD_SIZE": "4"}) == 4


# ---------------------------------------------------------------------------------------------
# Eight forced CPU devices: every mesh gives the 1-device losses.


MESH_SCRIPT = """
import json, sys
import jax, numpy as np
from flax import nnx
sys.path.insert(0, {tests!r})
from conftest import float_collectives, subprocess_env, tiny_config
from cem_jax import axes, data as data_lib, memory, optim, sharding, steps

assert jax.device_count() == 8, jax.devices()
block = {block!r}


def whole_batch_collectives(compiled, rows, seq_len=32):
  # The collectives of a compiled program with a float result of `rows` rows of `seq_len`
  # positions: a batch's activations brought whole onto a device, which the rows' split over
  # data x fsdp exists to avoid.
  return float_collectives(compiled.as_text(), rows, seq_len)


overrides = {{"data.files": {text!r}, "data.seq_len": 32, "data.vocab_size": 512,
             "model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64,
             "model.num_layers": 1, "train.batch_size": 8, "eval.batch_size": 8,
             "eval.max_batches": 2, "train.warmup_steps": 1, "train.learning_rate": 1e-2}}
if block == "cem":  # T = 2, a diagonal and a low-rank preconditioner: every CEM parameter kind
  overrides.update({{"model.num_steps": 2, "model.diagonal": "per_head",
                    "model.precond": "both", "model.precond_rank": 2}})
else:  # an untied LM head too
  overrides.update({{"model.tie_embeddings": False}})
cfg = tiny_config(block, **overrides)
data = data_lib.build_data(cfg, {workdir!r})
vocab = data.tokenizer.vocab_size
tx, _ = optim.make_optimizer(cfg.train)
_, eager = nnx.split(steps.build_model(cfg, vocab), nnx.Param)
out = {{}}
for shape in [(1, 1, 1)] + {meshes!r}:
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = shape
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(shape))])
  graphdef, params, opt_state, sh, _ = steps.init_state(cfg, vocab, tx, mesh)
  rec = {{"init_max_diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                              for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(eager)))}}
  # Each parameter's sharding, the number of distinct shards, and its moment's sharding.
  # Sharded init: what one device computes and keeps (no device ever holds a full copy). The
  # initialiser init_state ran, lowered again: its program is read back from the compilation
  # cache, not compiled a second time as a program of its own.
  init = steps._params_initialiser(cfg, vocab, None, mesh, sh.params).lower(
      steps.seed_key_data(cfg.seed)).compile().memory_analysis()
  rec["init_bytes"] = {{"full": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)),
                       "output": init.output_size_in_bytes, "temp": init.temp_size_in_bytes}}
  rules = axes.rules_from_config(cfg.mesh)
  mu = opt_state.inner_state[1][0].mu
  rec["params"] = {{}}
  for (path, var), (_, m) in zip(nnx.to_flat_state(params), nnx.to_flat_state(mu)):
    a = var.get_value()
    rec["params"]["/".join(map(str, path))] = {{
        "shape": list(a.shape), "logical": list(var.get_metadata()["logical_axes"]),
        "spec": str(a.sharding.spec), "want": str(sharding.logical_to_spec(
            var.get_metadata()["logical_axes"], rules)),
        "shards": len({{str(s.index) for s in a.addressable_shards}}),
        "shard_shape": list(a.addressable_shards[0].data.shape),
        "moment_spec": str(m.get_value().sharding.spec)}}
  step = steps.make_train_step(graphdef, tx, 5, sh)
  guard = jax.make_array_from_process_local_data(sh.replicated, np.zeros((), np.int32))
  losses = []
  for s in range(5):
    batch = sh.global_batch(data.train.batch(s), cfg.train.batch_size)
    params, opt_state, m = step(params, opt_state, batch, guard, np.int32(s + 1))
    losses.append(float(m["loss"]))
  rec["losses"] = losses
  rec["batch_spec"] = str(tuple(batch["inputs"].sharding.spec))
  # The compiled step's memory per device (the calls' own compilation: no second compile).
  compiled = step.lower(params, opt_state, batch, guard, np.int32(1)).compile()
  rec["footprint"] = memory.footprint_bytes(compiled)
  rec["whole_batch"] = whole_batch_collectives(compiled, 8)
  if shape == (2, 2, 2) and block == "cem":  # gradient accumulation: each device's rows in two,
    # and the logits made 8 positions at a time (train.loss_block_size)
    graphdef, p2, o2, sh, _ = steps.init_state(cfg, vocab, tx, mesh)
    step2 = steps.make_train_step(graphdef, tx, 5, sh, gradient_accumulation_steps=2,
                                  loss_block_size=8)
    rec["losses_accumulated"] = []
    for s in range(5):
      batch = sh.global_batch(data.train.batch(s), cfg.train.batch_size)
      p2, o2, m = step2(p2, o2, batch, guard, np.int32(s + 1))
      rec["losses_accumulated"].append(float(m["loss"]))
    compiled = step2.lower(p2, o2, batch, guard, np.int32(1)).compile()
    for rows in (4, 8):  # a micro-batch's rows, the batch's
      rec["whole_batch"] += whole_batch_collectives(compiled, rows)
  eval_batch = sh.global_batch(next(data.eval_batches(8, *sh.process_slice(8), 1)), 8)
  eval_step = steps.make_eval_step(graphdef, None, False, sh)
  rec["eval"] = steps.eval_loop(eval_step, params, data, cfg, sh)
  rec["whole_batch"] += whole_batch_collectives(eval_step.lower(params, eval_batch).compile(), 8)
  out["x".join(map(str, shape))] = rec
print("RESULT " + json.dumps(out))
"""


EAGER_SCRIPT = """
import sys
import jax, numpy as np
sys.path.insert(0, {tests!r})
from conftest import tiny_config
from cem_jax import sharding, steps

tokens = np.random.RandomState(0).randint(0, 512, (4, 8)).astype(np.int32)
for block in ("cem", "llama"):
  cfg = tiny_config(block, **{{"model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64,
                              "model.num_layers": 1}})
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 2, 2, 1
  mesh = sharding.make_mesh(cfg.mesh, jax.devices())
  model = steps.build_model(cfg, 512)  # off the mesh: its parameters on one device
  want = np.asarray(model(tokens))
  with jax.set_mesh(mesh):
    got = np.asarray(model(tokens))
    cached = np.asarray(model(tokens, cache=model.init_cache(4, 8), index=0)[0])
  print(block, float(np.max(np.abs(got - want))), float(np.max(np.abs(cached - want))))
"""


def test_a_model_built_off_the_mesh_runs_op_by_op_under_set_mesh():
  # jax refuses a sharding constraint under jax.set_mesh on an array that is not on the mesh:
  # the token lookup's gathered table must leave a one-device table (eager calls) alone.
  proc = subprocess.run([sys.executable, "-c", EAGER_SCRIPT.format(tests=str(REPO / "tests"))],
                        cwd=REPO, env=_env(4), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [line.split() for line in proc.stdout.splitlines()]
  assert [r[0] for r in rows] == ["cem", "llama"], proc.stdout
  for block, full, cached in rows:
    assert float(full) <= 1e-5 and float(cached) <= 1e-5, (block, full, cached)


SEEDS_SCRIPT = """
import json, sys
import jax, numpy as np
from flax import nnx
sys.path.insert(0, sys.argv[1])
from conftest import count_compiles, tiny_config
from cem_jax import optim, sharding, steps

made = count_compiles()
cfg = tiny_config("cem", **{"model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64,
                            "model.num_layers": 1, "model.diagonal": "per_head",
                            "model.precond": "both", "model.precond_rank": 2,
                            "model.tie_embeddings": False})
tx, _ = optim.make_optimizer(cfg.train)
out = {}
for shape in ((1, 1, 1), (1, 2, 2)):
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = shape
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(shape))])
  rec = out["x".join(map(str, shape))] = {"runs": []}
  # Two seeds, then a value read only at initialisation: a model of its own.
  for seed, init_std in ((0, 0.02), (12345, 0.02), (0, 0.05)):
    cfg.seed, cfg.model.init_std = seed, init_std
    before = made["jit(init_params)"]
    _, params, _, sh, _ = steps.init_state(cfg, 512, tx, mesh)
    compiles = made["jit(init_params)"] - before
    # The initialiser as it was: its own jit, the seed compiled in as a constant.
    want = jax.jit(lambda: nnx.state(steps.build_model(cfg, 512), nnx.Param),
                   out_shardings=sh.params)()
    eager = nnx.state(steps.build_model(cfg, 512), nnx.Param)  # op by op, on one device
    leaves = list(zip(jax.tree.leaves(params), jax.tree.leaves(want), jax.tree.leaves(eager),
                      strict=True))
    rec["runs"].append({
        "compiles": compiles,
        "bits_differ": sum(not (a.dtype == w.dtype and np.array_equal(np.asarray(a),
                                                                       np.asarray(w)))
                           for a, w, _ in leaves),
        "specs_differ": sum(a.sharding != w.sharding for a, w, _ in leaves),
        "eager_max_diff": max(float(np.max(np.abs(np.asarray(a) - np.asarray(e))))
                              for a, _, e in leaves),
        "embedding": np.asarray(params["embedding"].get_value())[0, :4].tolist()})
print(json.dumps(out))
"""


def test_another_seed_runs_the_compiled_initialiser_and_gives_the_seeds_own_values():
  # init_state's key is the jitted initialiser's argument: a second seed of one model on one
  # mesh (tables' --seeds run in one process) compiles nothing (the seed as a constant of the
  # program compiled once per seed); a value read only at initialisation (model.init_std) is
  # another initialiser. Counted: the executables jax makes of it (compiled or read back from
  # the persistent cache), not time. The values are bit for bit those of the initialiser as
  # it was (its own jit, the seed a constant) and its shardings, and within float rounding
  # of the model built op by op outside jit.
  # Mutations: a new jit per call (or config.seed in the initialisers' key) made 2 compiles
  # for 2 seeds; the key ignored for config.seed gave seed 12345 seed 0's values; the key
  # without the model config gave init_std 0.05 the 0.02 initialiser's values.
  runs = program_json(["-c", SEEDS_SCRIPT, str(REPO / "tests")], 4, timeout=300)
  assert sorted(runs) == ["1x1x1", "1x2x2"]
  for mesh, rec in runs.items():
    first, second, wider = rec["runs"]
    assert [r["compiles"] for r in rec["runs"]] == [1, 0, 1], (mesh, rec)
    for r in rec["runs"]:
      assert r["bits_differ"] == 0 and r["specs_differ"] == 0, (mesh, r)
      assert r["eager_max_diff"] <= 1e-7, (mesh, r)
    # Each seed and init_std its own values (the references above follow config.seed).
    assert first["embedding"] != second["embedding"], (mesh, rec)
    assert np.allclose(np.asarray(wider["embedding"]), 2.5 * np.asarray(first["embedding"]),
                       rtol=1e-5), (mesh, rec)
  assert runs["1x1x1"]["runs"][0]["embedding"] == runs["1x2x2"]["runs"][0]["embedding"]


@pytest.mark.parametrize("block", ["cem", "llama"])
def test_every_mesh_gives_the_one_device_losses(block, shared_data, tmp_path):
  script = MESH_SCRIPT.format(tests=str(REPO / "tests"), block=block, meshes=MESHES[block],
                              text=str(shared_data / "tinyshakespeare.txt"),
                              workdir=str(tmp_path / "w"))
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(8),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  runs = json.loads(line[len("RESULT "):])
  ref = runs.pop("1x1x1")
  assert len(ref["losses"]) == 5 and ref["losses"][-1] < ref["losses"][0]
  assert len(runs["2x2x2"].get("losses_accumulated", [])) == (5 if block == "cem" else 0)
  # fsdp splits the rows as data does (the model pins its activations to the batch axes), and
  # its sharded parameters and moments make the step smaller than data parallelism's. It used
  # to follow the parameters' sharding into the activations, every device running every token
  # (here 1.05x data parallelism's memory; 2.2x with d_model 128, batch 32 x 128).
  if block == "llama":
    assert runs["2x4x1"]["footprint"] <= 0.95 * runs["8x1x1"]["footprint"], (
        runs["2x4x1"]["footprint"], runs["8x1x1"]["footprint"])
  assert sorted(runs) == sorted("x".join(map(str, m)) for m in MESHES[block])
  for name, rec in runs.items():
    for key in ("losses", "losses_accumulated"):
      if key in rec:
        diff = max(abs(a - b) for a, b in zip(rec[key], ref["losses"], strict=True))
        assert diff <= 1e-5, (name, key, rec[key], ref["losses"])
    for key in ("eval/loss", "eval/bits_per_byte"):
      assert abs(rec["eval"][key] - ref["eval"][key]) <= 1e-5, (name, key)
    assert rec["eval"]["eval/tokens"] == ref["eval"]["eval/tokens"]
    assert rec["init_max_diff"] <= 1e-6, name  # sharded init = the eager model's values
    assert rec["batch_spec"] == "(('data', 'fsdp'), None)"
    # No device holds the whole batch's activations: the embedding lookup used to give every
    # device all rows for its share of d_model, and XLA could reach the rows' split from there
    # only through the whole batch (its "involuntary full rematerialization" on data x fsdp).
    assert rec["whole_batch"] == [], (name, rec["whole_batch"])
    shape = dict(zip(("data", "fsdp", "tensor"), map(int, name.split("x")), strict=True))
    for path, p in rec["params"].items():
      # Every parameter is sharded as its logical axes and the rules say (tied embedding
      # included), split into as many distinct shards as its mesh axes have devices, and its
      # Adam moment is sharded the same way.
      assert p["spec"] == p["want"], (name, path, p)
      assert p["moment_spec"] == p["spec"], (name, path, p)
      parts = 1
      for entry in sharding.logical_to_spec(p["logical"]):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        for n in names:
          parts *= shape[n]
      assert p["shards"] == parts, (name, path, p)
      assert math.prod(p["shard_shape"]) * parts == math.prod(p["shape"]), (name, path, p)
  # On 2 x 2 x 2 every device initialises about a quarter of the parameters (fsdp x tensor;
  # vectors over fsdp only), and its scratch space is smaller than one full copy.
  size = runs["2x2x2"]["init_bytes"]
  assert size["output"] < size["full"] / 2 and size["temp"] < size["full"], size
  assert ref["init_bytes"]["output"] >= ref["init_bytes"]["full"]  # one device: all of it
  # Every matrix is split over fsdp (and, but for norms and step sizes, over tensor too).
  both = runs["2x2x2"]["params"]
  matrices = [p for p in both.values() if len(p["shape"]) >= 2 and "embed" in p["logical"]]
  assert matrices and all(p["shards"] >= 2 for p in matrices)
  assert "embedding" in both and both["embedding"]["shards"] == 4  # vocab/tensor x embed/fsdp


SHARED_AXIS_SCRIPT = """
import json, sys
import jax, numpy as np, optax
sys.path.insert(0, sys.argv[1])
from conftest import tiny_config
from cem_jax import sharding, steps

rng = np.random.RandomState(0)
tokens = rng.randint(1, 128, (4, 17)).astype(np.int32)
local = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
         "segment_ids": np.ones((4, 16), np.int32), "weights": np.ones((4, 16), np.float32)}
rules = (("batch", ("data", "tensor")), ("embed", "fsdp"), ("heads", "tensor"),
         ("mlp", "tensor"), ("vocab", "tensor"))
tx = optax.apply_if_finite(optax.sgd(1.0), 5)
out = {}
for diagonal in sys.argv[2:]:  # one process for every diagonal: jax starts once
  cfg = tiny_config("cem", **{"data.seq_len": 16, "model.d_model": 32, "model.num_heads": 4,
                              "model.mlp_dim": 64, "model.num_layers": 1, "train.batch_size": 4,
                              "model.diagonal": diagonal, "mesh.rules": rules})
  for shape in ((1, 1, 1), (2, 2, 2)):  # 4 rows: one a device on 2 x 2 x 2
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = shape
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(shape))])
    graphdef, params, opt_state, sh, _ = steps.init_state(cfg, 128, tx, mesh)
    # Away from the initial values: the diagonal starts at zero, where it changes nothing.
    noise = np.random.RandomState(1)
    params = jax.tree.map(lambda x: jax.device_put(
        np.asarray(x) + 0.1 * noise.standard_normal(x.shape).astype(np.float32), x.sharding),
        params)
    before = [np.asarray(x) for x in jax.tree.leaves(params)]
    step = steps.make_train_step(graphdef, tx, None, sh)
    guard = jax.make_array_from_process_local_data(sh.replicated, np.zeros((), np.int32))
    params, _, m = step(params, opt_state, sh.global_batch(local, 4), guard, np.int32(1))
    grads = [b - np.asarray(a) for a, b in zip(jax.tree.leaves(params), before, strict=True)]
    out[diagonal + " " + "x".join(map(str, shape))] = {
        "loss": float(m["loss"]), "grads": [g.ravel().tolist() for g in grads]}
print(json.dumps(out))
"""


def test_a_diagonal_with_batch_and_heads_on_one_mesh_axis_gives_the_one_device_step():
  # mesh.rules may split the rows over tensor, which also splits the heads. With a CEM
  # diagonal (its widened heads, the fused update) and one row per device XLA computed half
  # the rows' updates wrong (the loss off by 0.1%, gradients by 300%); found by an
  # adversarial review comparing gradients on every mesh. The step (SGD at rate 1: the update
  # is minus the gradient) now equals one device's, for either diagonal.
  diagonals = ["per_head", "shared"]
  runs = program_json(["-c", SHARED_AXIS_SCRIPT, str(REPO / "tests"), *diagonals], 8,
                      timeout=300)
  assert sorted(runs) == sorted(f"{d} {m}" for d in diagonals for m in ("1x1x1", "2x2x2"))
  for diagonal in diagonals:
    one, mesh = runs[f"{diagonal} 1x1x1"], runs[f"{diagonal} 2x2x2"]
    assert abs(mesh["loss"] - one["loss"]) <= 1e-5 * one["loss"], (
        diagonal, mesh["loss"], one["loss"])
    for got, want in zip(mesh["grads"], one["grads"], strict=True):
      scale = max(abs(x) for x in want) + 1e-12
      assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 2e-5 * scale + 1e-6, (
          diagonal)


VOCAB_RULES_SCRIPT = """
import json, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
from conftest import float_collectives, tiny_config
from cem_jax import axes, optim, sharding, steps

rng = np.random.RandomState(0)
tokens = rng.randint(1, 512, (8, 33)).astype(np.int32)
local = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
         "segment_ids": np.ones((8, 32), np.int32), "weights": np.ones((8, 32), np.float32),
         "target_bytes": np.ones((8, 32), np.float32)}
# (block, mesh, tied output layer, rules other than the defaults). The vocabulary code is the
# model's, not the block's: CEM's case stands for vocab -> fsdp with a tied layer for both.
cases = [("llama", (2, 2, 2), True, {"vocab": "data"}),
         ("cem", (1, 4, 2), True, {"vocab": "fsdp"}),
         ("llama", (1, 4, 2), True, {"vocab": ("fsdp", "tensor")}),
         ("llama", (1, 2, 4), False, {"vocab": "fsdp", "embed": None}),
         ("llama", (2, 2, 2), True, {})]


def run(block, tied, changed, mesh_shape, programs):
  rules = tuple((name, changed.get(name, target)) for name, target in axes.DEFAULT_RULES)
  cfg = tiny_config(block, **{"data.seq_len": 32, "model.d_model": 32, "model.num_heads": 2,
                              "model.mlp_dim": 64, "model.num_layers": 1, "train.batch_size": 8,
                              "train.warmup_steps": 1, "train.learning_rate": 1e-2,
                              "model.tie_embeddings": tied, "mesh.rules": rules})
  tx, _ = optim.make_optimizer(cfg.train)
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh_shape
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(mesh_shape))])
  graphdef, params, opt_state, sh, _ = steps.init_state(cfg, 512, tx, mesh)
  step, evaluate = steps.make_train_step(graphdef, tx, 5, sh), steps.make_eval_step(
      graphdef, None, False, sh)
  guard = jax.make_array_from_process_local_data(sh.replicated, np.zeros((), np.int32))
  batch = sh.global_batch(local, 8)
  losses = []
  for s in range(3):
    params, opt_state, m = step(params, opt_state, batch, guard, np.int32(s + 1))
    losses.append(float(m["loss"]))
  rec = {"losses": losses, "eval": float(evaluate(params, batch)["loss_sum"])}
  if programs:
    texts = [program.compile().as_text() for program in (
        step.lower(params, opt_state, batch, guard, np.int32(1)), evaluate.lower(params, batch))]
    # A float [8, 32, ...] result: the whole batch's rows on a device; a float [512, 32] or
    # [32, 512]: the whole vocabulary's embedding or output layer on a device.
    rec["whole_batch"] = [c for t in texts for c in float_collectives(t, 8, 32)]
    rec["whole_vocabulary"] = [c for t in texts for dims in ((512, 32), (32, 512))
                               for c in float_collectives(t, *dims)]
  return rec


# The reference: one device under the default rules, once per model (on one device the rules
# change no number, and a rule that did would show as a difference from it).
one = {}
out = {}
for block, shape, tied, changed in cases:
  if (block, tied) not in one:
    one[block, tied] = run(block, tied, {}, (1, 1, 1), programs=False)
  out[f"{block} {'tied' if tied else 'untied'} {changed} {'x'.join(map(str, shape))}"] = {
      "one": one[block, tied], "mesh": run(block, tied, changed, shape, programs=True)}
print(json.dumps(out))
"""


def test_a_vocabulary_rule_on_a_batch_axis_keeps_the_rows_on_their_devices():
  # mesh.rules may put the vocabulary on an axis that also splits the rows (vocab -> fsdp or
  # data). The tied output layer then had its vocabulary split where the rows are: XLA
  # all-gathered the whole batch's hidden states for the logits (f32[8,32,32] on both such
  # meshes here, with a vocabulary of 512; of 256 XLA's choice happened to be fine); the
  # losses were still right. The output layer now gathers its vocabulary over the
  # rows' axes before use, as FSDP gathers every weight. With vocab on ('fsdp', 'tensor') on
  # 1 x 4 x 2 the token lookup into the table so split summed the whole batch's embeddings over
  # all 8 devices (all-reduce f32[8,32,32], in the training and the eval step); the lookup's
  # table is now split likewise only over the vocabulary's axes that do not split the rows.
  runs = program_json(["-c", VOCAB_RULES_SCRIPT, str(REPO / "tests")], 8, timeout=600)
  assert len(runs) == 5, runs
  for name, rec in runs.items():
    one, mesh = rec["one"], rec["mesh"]
    assert mesh["whole_batch"] == [], (name, mesh["whole_batch"])
    if name.endswith("{} 2x2x2"):  # the default rules: the vocabulary stays split over tensor
      assert mesh["whole_vocabulary"] == [], (name, mesh["whole_vocabulary"])
    diff = max(abs(a - b) for a, b in zip(mesh["losses"], one["losses"], strict=True))
    # The eval loss is summed over the batch's 256 tokens (~1.6e3 nats).
    assert diff <= 1e-5 and abs(mesh["eval"] - one["eval"]) <= 1e-6 * one["eval"], (name, rec)
    assert one["losses"][-1] < one["losses"][0], (name, one["losses"])


# ---------------------------------------------------------------------------------------------
# Two processes x 4 devices through launch/local.py = one process with 8 devices.


CONFIG = """
from cem_jax.config import get_default_config


def get_config():
  c = get_default_config()
  c.model.d_model, c.model.num_heads, c.model.mlp_dim, c.model.num_layers = 32, 2, 64, 1
  c.data.files = {text!r}
  c.data.seq_len, c.data.vocab_size = 32, 512
  c.train.batch_size, c.train.num_steps, c.train.warmup_steps = 8, 6, 1
  c.train.learning_rate = 1e-2
  c.train.eval_every_steps, c.train.log_every_steps = 3, 1
  c.eval.batch_size, c.eval.max_batches = 8, 3
  c.checkpoint.every_steps = 3
  c.mesh.fsdp, c.mesh.tensor = 2, 2
  return c
"""


def _metrics(workdir: Path) -> list[dict]:
  return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_match_one_process(shared_data, tmp_path):
  cfg = tmp_path / "cfg.py"
  cfg.write_text(CONFIG.format(text=str(shared_data / "tinyshakespeare.txt")))
  main = [sys.executable, "-m", "cem_jax.main", f"--config={cfg}"]
  # Process 0 traces steps 2..3 and all wait for it. Only this run traces: jax's profiler
  # once crashed (SIGSEGV in stop_trace) in the one-process reference run, which needs none.
  multi = subprocess.run(
      [sys.executable, "launch/local.py", "--num_processes=2", "--devices_per_process=4", "--",
       *main, f"--workdir={tmp_path / 'mp'}", "--config.train.profile_steps=2",
       "--config.train.profile_first_step=2"], cwd=REPO, env=_env(1), capture_output=True,
      text=True, timeout=600)
  assert multi.returncode == 0, multi.stdout[-4000:] + multi.stderr[-2000:]
  single = subprocess.run([*main, f"--workdir={tmp_path / 'sp'}"], cwd=REPO, env=_env(8),
                          capture_output=True, text=True, timeout=600)
  assert single.returncode == 0, single.stderr[-3000:]
  # Each process read its own half of every batch (one process: all of it).
  for i in (0, 1):
    assert any(line.startswith(f"[{i}] ") and
               f"of 2 processes; process {i} reads rows block {i} of 2" in line
               for line in multi.stdout.splitlines()), multi.stdout[-3000:]
  assert "of 1 processes; process 0 reads rows block 0 of 1" in single.stderr
  written = [line for line in multi.stdout.splitlines() if "profile: trace of steps 2..3" in line]
  assert len(written) == 1 and written[0].startswith("[0] "), multi.stdout[-3000:]
  mp, sp = _metrics(tmp_path / "mp"), _metrics(tmp_path / "sp")
  assert [m["step"] for m in mp] == [m["step"] for m in sp]
  for a, b in zip(mp, sp, strict=True):
    for key in ("train/loss", "eval/loss", "eval/bits_per_byte"):
      if key in b:
        assert abs(a[key] - b[key]) <= 1e-5, (a["step"], key, a[key], b[key])
  assert sum("train/loss" in m for m in mp) == 6 and sum("eval/loss" in m for m in mp) == 2
  # Both processes wrote checkpoints together; only process 0 wrote metrics and config.json.
  assert sorted(p.name for p in (tmp_path / "mp" / "checkpoints").iterdir()
                if p.name.isdigit()) == ["3", "6"]
  assert json.loads((tmp_path / "mp" / "config.json").read_text())["mesh"]["tensor"] == 2
  # The two processes' checkpoint restores in one process on another mesh (fsdp over all 8).
  resumed = subprocess.run([*main, f"--workdir={tmp_path / 'mp'}", "--config.train.num_steps=8",
                            "--config.mesh.fsdp=8", "--config.mesh.tensor=1"], cwd=REPO,
                           env=_env(8), capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed from {tmp_path / 'mp' / 'checkpoints' / '6'} at step 6" in resumed.stderr
  after = [m for m in _metrics(tmp_path / "mp") if "train/loss" in m and m["step"] > 6]
  assert [m["step"] for m in after] == [7, 8] and all(m["train/loss"] < 7 for m in after)


# ---------------------------------------------------------------------------------------------
# Splash attention (a Pallas call XLA cannot partition) runs per device in shard_map.


SPLASH_SCRIPT = """
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from cem_jax import attention, data as data_lib, optim, sharding, steps
from cem_jax import model as model_lib
from tests.conftest import tiny_config
from tests.test_attention import _qkv, _structure, np_attention, rel

assert jax.device_count() == 4, jax.devices()
out = {{"kernel": {{}}, "losses": {{}}, "manual": {{}}, "eval": {{}}, "specs": {{}}}}
# Kernel: rows over the batch rule's axes, heads over the heads rule's (an axis that does not
# divide its dimension, or that the rows already use, is left out); eager and jitted, several
# meshes in one process (the cached kernel must not belong to one trace or mesh); values and
# gradients against float64.
CASES = [((2, 1, 2), None, "documents"), ((1, 2, 2), (("data",), ("fsdp",)), "causal"),
         ((1, 1, 4), None, "strict_documents"),  # 4 does not divide 2 heads
         ((1, 2, 2), (("data", "fsdp"), ("fsdp",)), "documents")]  # fsdp taken by the rows
for i, (shape, partition, kind) in enumerate(CASES):
  q, k, v, cot = _qkv(11)
  kw, mask = _structure(kind)

  def loss(q, k, v):
    o = attention.dot_product_attention(q, k, v, scale=0.3, implementation="splash",
                                        interpret=True, partition=partition, **kw)
    return jnp.sum(o * cot), o

  mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  args = [jax.device_put(x, NamedSharding(mesh, P(None))) for x in (q, k, v)]
  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  want = np_attention(q, k, v, mask, 0.3, cot)
  # The kernel is cached across traces: built first eagerly or first under jit, it must hold
  # no tracer of the trace that built it (nor of a shard_map inside it).
  attention._splash_kernel.cache_clear()
  order = (("eager", grad), ("jit", jax.jit(grad)))[::1 if i % 2 else -1]
  if i >= 2:  # built first eagerly (case 1) and first under jit (case 0) is checked: jit only
    order = (("jit", jax.jit(grad)),)
  with jax.set_mesh(mesh):
    results = {{how: fn(*args) for how, fn in order}}
    jaxpr = str(jax.make_jaxpr(loss)(*args))
  spec = jaxpr[jaxpr.index("out_specs="):].split(",)")[0] if "out_specs=" in jaxpr else ""
  for how, ((_, o), grads) in results.items():
    out["kernel"]["x".join(map(str, shape)) + f"/{{partition}}/{{how}}"] = {{
        "errors": [rel(a, b) for a, b in zip((o, *grads), want, strict=True)],
        "shard_map": "shard_map[" in jaxpr, "spec": spec}}
# Training and eval: splash on a mesh = XLA attention on one device, Llama and fused CEM (with
# the energy trace in eval), under the default rules and under rules of our own (rows over
# data, heads over fsdp), which reach the kernel only through the model and its layers.
RULES = [["batch", "data"], ["heads", "fsdp"], ["embed", None], ["mlp", "tensor"],
         ["vocab", "tensor"], ["head_dim", None]]
RUNS = {{"llama": [("xla_1", (1, 1, 1), "xla", None),
                  ("splash_1x2x2_rules", (1, 2, 2), "splash", RULES)],
        "cem": [("xla_1", (1, 1, 1), "xla", None),
                ("splash_1x2x2_rules", (1, 2, 2), "splash", RULES)]}}
for block, runs in RUNS.items():
  cfg = tiny_config(block, **{{"data.files": {text!r}, "data.seq_len": 128,
                              "model.d_model": 32, "model.num_heads": 2, "model.mlp_dim": 64,
                              "model.num_layers": 1, "train.batch_size": 4, "eval.batch_size": 4,
                              "eval.max_batches": 2, "train.warmup_steps": 1,
                              "train.learning_rate": 1e-2}})
  data = data_lib.build_data(cfg, {workdir!r} + block)
  vocab = data.tokenizer.vocab_size
  tx, _ = optim.make_optimizer(cfg.train)
  for name, shape, impl, rules in runs:
    model_lib.resolve_attention = lambda cfg, blocks, platform=None, impl=impl: (impl, "test")
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = shape
    if rules is not None:
      cfg.mesh.rules = rules
    m = sharding.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(shape))])
    graphdef, params, opt_state, sh, _ = steps.init_state(cfg, vocab, tx, m)
    step = steps.make_train_step(graphdef, tx, 5, sh)
    eval_step = steps.make_eval_step(graphdef, None, block == "cem", sh)
    guard = jax.make_array_from_process_local_data(sh.replicated, np.zeros((), np.int32))
    key = block + "/" + name
    losses = []
    for s in range(3):
      batch = sh.global_batch(data.train.batch(s), cfg.train.batch_size)
      if s == 0:  # the steps themselves put splash in shard_map (no mesh set here)
        hlos = [step.lower(params, opt_state, batch, guard, np.int32(1)).as_text(),
                eval_step.lower(params, sh.global_batch(
                    next(iter(data.eval_batches(4, 0, 1))), 4)).as_text()]
        out["manual"][key] = [("manual_computation" in h or "SPMDFullToShardShape" in h)
                              for h in hlos]
        model = nnx.merge(graphdef, params)
        with jax.set_mesh(m):
          jaxpr = str(jax.make_jaxpr(lambda t, g: model(t, g))(batch["inputs"],
                                                              batch["segment_ids"]))
        spec = r"out_specs=\\((P\\((?:[^()]|\\([^()]*\\))*\\))"  # P(...) with nested tuples
        out["specs"][key] = sorted(set(re.findall(spec, jaxpr)))
      params, opt_state, met = step(params, opt_state, batch, guard, np.int32(s + 1))
      losses.append(float(met["loss"]))
    out["losses"][key] = losses
    out["eval"][key] = steps.eval_loop(eval_step, params, data, cfg, sh)
print("RESULT " + json.dumps(out))
"""


def test_splash_runs_per_device_in_shard_map_on_a_mesh(shared_data, tmp_path):
  script = SPLASH_SCRIPT.format(text=str(shared_data / "tinyshakespeare.txt"),
                                workdir=str(tmp_path / "w"))
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(4),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  res = json.loads(line[len("RESULT "):])
  assert len(res["kernel"]) == 6  # 2 cases eager and jitted, 2 jitted
  for case, rec in res["kernel"].items():
    assert rec["shard_map"], case  # split per device
    assert max(rec["errors"]) <= 1e-5, (case, rec["errors"])  # output, dq, dk, dv
  specs = {case.rsplit("/", 1)[0]: rec["spec"] for case, rec in res["kernel"].items()}
  assert sorted(case.rsplit("/", 1)[1] for case in res["kernel"]) == ["eager"] * 2 + ["jit"] * 4
  assert specs == {
      "2x1x2/None": "out_specs=(P(('data', 'fsdp'), None, 'tensor', None)",
      "1x2x2/(('data',), ('fsdp',))": "out_specs=(P('data', None, 'fsdp', None)",
      "1x1x4/None": "out_specs=(P(('data', 'fsdp'), None, None, None)",
      "1x2x2/(('data', 'fsdp'), ('fsdp',))": "out_specs=(P(('data', 'fsdp'), None, None, None)"}
  # Training under rules of our own (the default rules' layout: the kernel cases above with
  # partition None, and test_attention.py's aux under the default rules).
  for block, names in (("llama", ["splash_1x2x2_rules"]), ("cem", ["splash_1x2x2_rules"])):
    ref = res["losses"][f"{block}/xla_1"]
    assert ref[-1] < ref[0] and res["manual"][f"{block}/xla_1"] == [False, False]
    for name in names:
      key = f"{block}/{name}"
      got = res["losses"][key]
      assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) <= 1e-5, (key, got, ref)
      assert res["manual"][key] == [True, True], key  # train and eval steps
      # the layers pass the rules
      assert res["specs"][key] == ["P('data', None, 'fsdp', None)"], (key, res["specs"][key])
      for metric, value in res["eval"][f"{block}/xla_1"].items():
        tol = 1e-5 * max(1.0, abs(value))
        assert abs(res["eval"][key][metric] - value) <= tol, (key, metric)


@pytest.mark.parametrize("overrides", [
    {"model.block": "llama"},
    {"model.diagonal": "per_head", "model.precond": "both", "model.precond_rank": 3,
     "model.context": "coevolve", "model.num_steps": 2},
    {"model.diagonal": "shared", "model.inner_optimizer": "nesterov", "model.num_steps": 2},
    {"model.cem_attention": False, "model.cem_mlp": False},
], ids=["llama", "cem-per_head-precond-coevolve", "cem-shared-nesterov", "cem-standard"])
def test_every_parameter_names_the_axes_of_its_own_dimensions(overrides):
  # A tag on the wrong dimension still trains (it only splits the weight otherwise over
  # devices), so no loss comparison sees it: the sizes tell, all distinct here.
  from flax import nnx

  from cem_jax import steps

  sizes = {"embed": 48, "heads": 4, "head_dim": 8, "mlp": 80, "vocab": 101}
  block = overrides.get("model.block", "cem")
  cfg = tiny_config(block, **{k: v for k, v in overrides.items() if k != "model.block"},
                    **{"model.d_model": 48, "model.num_heads": 4, "model.head_dim": 8,
                       "model.mlp_dim": 80})
  config_lib.validate(cfg)
  state = nnx.state(nnx.eval_shape(lambda: steps.build_model(cfg, sizes["vocab"])), nnx.Param)
  named = 0
  for path, variable in nnx.to_flat_state(state):
    axes = variable.get_metadata().get("logical_axes")
    shape = variable.get_value().shape
    assert axes is not None and len(axes) == len(shape), (path, axes, shape)
    for axis, size in zip(axes, shape, strict=True):
      if axis is not None:
        named += 1
        assert size == sizes[axis], (path, axes, shape)
  assert named > 10


def test_open_mpi_and_flags_over_the_environment_one_value_at_a_time():
  # mpirun sets OMPI_COMM_WORLD_SIZE (also inside a one-task srun step); JAX detects the rest.
  ompi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}
  assert distributed.cluster_processes(ompi) == 4
  assert distributed.resolve("auto", environ=ompi) == {}
  assert distributed.cluster_processes(
      {**ompi, "SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "gpu01"}) == 4
  assert distributed.resolve("auto", environ={"OMPI_COMM_WORLD_SIZE": "1"}) is None
  # A flag wins over its CEM_* variable; the others still come from the environment.
  env = {"CEM_COORDINATOR_ADDRESS": "127.0.0.1:5", "CEM_NUM_PROCESSES": "2",
         "CEM_PROCESS_ID": "1"}
  assert distributed.resolve("auto", "h:9", 4, 3, environ=env) == {
      "coordinator_address": "h:9", "num_processes": 4, "process_id": 3}
  assert distributed.resolve("auto", process_id=0, environ=env) == {
      "coordinator_address": "127.0.0.1:5", "num_processes": 2, "process_id": 0}
  assert distributed.resolve("auto", num_processes=4, environ=env)["num_processes"] == 4
  with pytest.raises(ValueError, match=r"^--distributed='yes'; allowed: auto, on, off$"):
    distributed.resolve("yes", environ={})


def test_initialize_calls_jax_when_resolve_says_so_and_the_barrier_needs_two_processes(
    monkeypatch, tmp_path):
  import jax
  from jax.experimental import multihost_utils

  for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", distributed.ENV_ADDRESS,
              distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
    monkeypatch.delenv(key, raising=False)
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # process 1 of h:1's lock file
  assert distributed.initialize("auto") is False and calls == []
  # 'on' with nothing given: JAX detects everything (a TPU pod), called with no arguments.
  assert distributed.initialize("on") is True and calls == [{}]
  assert distributed.initialize("auto", "h:1", 2, 1) is True
  assert calls[-1] == {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}
  barriers = []
  monkeypatch.setattr(multihost_utils, "sync_global_devices", barriers.append)
  for count, name in ((1, "one"), (2, "two")):
    monkeypatch.setattr(jax, "process_count", lambda count=count: count)
    distributed.sync_processes(name)
  assert barriers == ["two"]


# Holds process 0 of coordinator argv[1] (distributed.hold_process_id) for workdir argv[2], says
# so, and keeps it until stdin closes or it is killed; signal dispositions set, as CI's nohup
# leaves SIGHUP ignored.
_HOLD_ID = """
import signal, sys
for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
  signal.signal(signum, signal.SIG_DFL)
from cem_jax import distributed
distributed.hold_process_id(sys.argv[1], 0, sys.argv[2])
print("held", flush=True)
sys.stdin.read()
"""


def test_a_second_process_with_the_same_id_is_one_line_and_a_killed_one_blocks_nothing(
    tmp_path):
  # Two processes with one id and coordinator (a command run twice): the second joined the
  # coordination service as a newer incarnation of the first, which JAX's runtime aborted in
  # C++ (status 134, a stack dump). The second is now refused before it meets anyone, in one
  # line naming the first; once that one is killed (-9), the id is free at once.
  env = {**_env(1), "TMPDIR": str(tmp_path)}  # the lock files' folder: this test's own
  address = "127.0.0.1:1"  # never reached: nothing here meets a coordinator

  def start_holder():
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_ID, address, "/runs/a"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder

  def hold_again(process_id=0, coordinator=address):
    code = ("import sys\nfrom cem_jax import distributed\ntry:\n"
            f"  distributed.hold_process_id({coordinator!r}, {process_id}, '/runs/b')\n"
            "except ValueError as e:\n  print(e)\n  sys.exit(1)")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)

  holder = start_holder()
  try:
    refused = hold_again()
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert refused.stdout == (
        f"--process_id=0 of --coordinator_address='127.0.0.1:1' is already running on this "
        f"host (pid {holder.pid} on {socket.gethostname()}, --workdir='/runs/a'); two "
        "processes with one id abort inside JAX's runtime: wait for that one to end or stop "
        "it, or give this run another coordinator port\n")
    assert hold_again(process_id=1).returncode == 0  # another id, or another run's
    assert hold_again(coordinator="127.0.0.1:2").returncode == 0
    # The program: refused at start-up, before jax meets anyone and before the workdir exists.
    main = subprocess.run(
        [sys.executable, "-m", "cem_jax.main", f"--config={REPO}/experiments/tiny.py",
         f"--workdir={tmp_path}/w", f"--coordinator_address={address}", "--num_processes=2",
         "--process_id=0"], env=env, capture_output=True, text=True, timeout=300)
    assert main.returncode == 1, main.stderr[-3000:]
    assert main.stderr.strip().splitlines()[-1] == "error: " + refused.stdout.strip()
    assert not (tmp_path / "w").exists()
  finally:
    holder.kill()
    holder.wait()
  locks = tmp_path / f"cem_jax-{os.getuid()}"
  assert len(list(locks.iterdir())) == 1  # the killed one's file, left behind
  assert hold_again().returncode == 0  # kill -9 let it go: a resume is never blocked
  start_holder().communicate("")  # nor is a holder that ended as usual
  assert list(locks.iterdir()) == []  # each removed at its holder's exit


# ---------------------------------------------------------------------------------------------
# Processes of one run: the same config, one shared workdir.


def test_a_process_on_another_workdir_or_config_is_one_line_not_a_hang(shared_data, tmp_path):
  # Process 1's --workdir is another folder (as a path on its host's own disk would be): it
  # hung in the first checkpoint until Orbax's 600 s timeout, and process 0 at its end. Now
  # both stop at start-up with one line, and leave no folder they created behind.
  cfg = tmp_path / "cfg.py"
  cfg.write_text(CONFIG.format(text=str(shared_data / "tinyshakespeare.txt")))
  # cem_jax.main as `python -m` runs it, but process 1 waits 0.5 s (not 5) for the file
  # process 0 writes in its own folder, which never shows in process 1's.
  program = ("import functools, runpy\n"
             "from cem_jax import workdir\n"
             "workdir.process_mismatch = functools.partial(workdir.process_mismatch, wait_s=0.5)\n"
             "runpy.run_module('cem_jax.main', run_name='__main__', alter_sys=True)\n")
  main = (f"exec {shlex.quote(sys.executable)} -c {shlex.quote(program)} "
          f"--config={shlex.quote(str(cfg))} --workdir={shlex.quote(str(tmp_path))}/w"
          "$CEM_PROCESS_ID")
  proc = subprocess.run(
      [sys.executable, "launch/local.py", "--num_processes=2", "--devices_per_process=4",
       "--kill_grace_s=60", "--", "sh", "-c", main], cwd=REPO, env=_env(1),
      capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stdout[-3000:]
  errors = [line for line in proc.stdout.splitlines() if "error:" in line]
  for i in (0, 1):
    assert f"[{i}] error: --workdir='{tmp_path}/w{i}': process 1 does not see the files " \
        "process 0 writes there; allowed: a folder on storage every process shares" in "\n".join(
            errors), proc.stdout[-3000:]
  assert "Traceback" not in proc.stdout
  assert not (tmp_path / "w0").exists() and not (tmp_path / "w1").exists()


def test_each_process_compares_its_config_and_process_0s_file(tmp_path):
  from cem_jax import workdir

  cfg = tiny_config()
  digest = workdir.processes_digest(cfg)
  (tmp_path / ".processes_see_this_abc").write_text("abc")
  assert workdir.process_mismatch(str(tmp_path), cfg, digest, "abc") == 0
  assert workdir.process_mismatch(str(tmp_path), cfg, digest, "abd", wait_s=0) == 2
  (tmp_path / ".processes_see_this_abd").write_text("abc")  # another run's leftover
  assert workdir.process_mismatch(str(tmp_path), cfg, digest, "abd", wait_s=0) == 2
  other = tiny_config()
  other.train.learning_rate *= 2
  assert workdir.process_mismatch(str(tmp_path), other, digest, "abc") == 1
  assert workdir.processes_digest(cfg) == workdir.processes_digest(tiny_config())
  # A network mount may show process 0's file late: it is waited for, up to wait_s.
  late = tmp_path / ".processes_see_this_late"
  writer = threading.Timer(0.5, late.write_text, args=("late",))
  writer.start()
  try:
    assert workdir.process_mismatch(str(tmp_path), cfg, digest, "late", wait_s=30) == 0
  finally:
    writer.join()


def test_a_killed_starts_file_is_removed_by_the_next_start_and_one_under_way_is_not(
    tmp_path, monkeypatch):
  # Process 0's file lives from before the broadcast to its end; a start killed there
  # (kill -9) left it in the workdir for good, one more each time. Another start's file, held
  # by its process 0 while that start runs, is not a leftover (collectives stubbed).
  import fcntl

  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from cem_jax import workdir

  killed = tmp_path / ".processes_see_this_0123456789abcdef"
  killed.write_text("0123456789abcdef")
  (tmp_path / ".processes_see_this_fedcba9876543210").write_text("")  # not written yet
  under_way = tmp_path / ".processes_see_this_aaaaaaaaaaaaaaaa"
  under_way.write_text("aaaaaaaaaaaaaaaa")
  # The run's own files, unlocked and not empty like a killed start's, are not one.
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
  seen = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 0)

  def broadcast(x):  # process 0's own file is there, and another start keeps it too
    workdir.remove_killed_starts_files(str(tmp_path))
    seen.append(sorted(p.name for p in tmp_path.iterdir()))
    return x

  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
  monkeypatch.setattr(multihost_utils, "process_allgather", lambda code: np.array([code, 0]))
  with open(under_way) as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    workdir.check_processes_agree(tiny_config(), str(tmp_path))
  names = sorted(p.name for p in tmp_path.iterdir())
  assert names == [".processes_see_this_aaaaaaaaaaaaaaaa", ".processes_see_this_fedcba9876543210",
                   "metrics.jsonl"]
  assert len(seen[0]) == 4 and set(names) < set(seen[0])
  # With no start under way, a later start (one process) removes what is left.
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  workdir.check_processes_agree(tiny_config(), str(tmp_path))
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      ".processes_see_this_fedcba9876543210", "metrics.jsonl"]


def test_processes_with_the_code_at_other_paths_agree_and_with_other_energy_code_not(tmp_path):
  # main makes a relative energy file's path absolute: on hosts that keep their checkout at
  # other paths (or with experiments/design.py:sigmoid, which names the file by its own path)
  # the same config differed in that path alone, and every process but 0 was refused.
  from cem_jax import workdir

  source = (REPO / "experiments" / "sigmoid_energy.py").read_text()
  edited = source.replace("q = jnp.einsum", "q = 2 * jnp.einsum")
  assert edited != source
  for host, text in (("a", source), ("b", source), ("c", edited)):
    (tmp_path / host).mkdir()
    (tmp_path / host / "sigmoid_energy.py").write_text(text)

  def on(host):
    return tiny_config(**{"model.attention_energy":
                          f"{tmp_path / host / 'sigmoid_energy.py'}:energy"})

  digest = workdir.processes_digest(on("a"))
  (tmp_path / ".processes_see_this_abc").write_text("abc")
  assert workdir.process_mismatch(str(tmp_path), on("b"), digest, "abc") == 0
  # The same file name, its energy edited on one host: another model, refused.
  assert workdir.process_mismatch(str(tmp_path), on("c"), digest, "abc") == 1


@pytest.mark.parametrize("index", [0, 1])
def test_process_0_that_cannot_write_its_file_stops_every_process(tmp_path, monkeypatch, index):
  # A full disk: prepare_workdir's empty probe file fits, the 16 bytes process 0 writes do not.
  # Process 0 raised an OSError alone, before the broadcast; every other process waited in it.
  # Now process 0 joins it, and all stop with one line (collectives stubbed: two processes).
  import errno

  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from cem_jax import workdir

  joined = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: index)
  def broadcast(x):
    joined.append("broadcast")
    return x if index == 0 else np.frombuffer(workdir.processes_digest(cfg) + b" " * 16, np.uint8)
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda code: np.array([3, 3]) if index else np.array([code, 3]))
  def full(path, mode="r", *args, **kwargs):
    if "w" in mode:
      raise OSError(errno.ENOSPC, "No space left on device")
    return open(path, mode, *args, **kwargs)
  monkeypatch.setattr(workdir, "open", full, raising=False)
  cfg = tiny_config()
  with pytest.raises(ValueError, match=rf"^--workdir='{tmp_path}': process 0 could not write a "
                                       r"file there.*; allowed: a writable folder with free space"):
    workdir.check_processes_agree(cfg, str(tmp_path))
  assert joined == ["broadcast"]
  assert list(tmp_path.iterdir()) == []
