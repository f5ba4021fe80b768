"""cem_jax.aot: the steps compiled for a target's devices are main's, and their memory check.

The TPU and GPU targets need libtpu or jax's CUDA plugin, which CI does not install: their
compilation was checked by hand (docs/PERFORMANCE.md; with libtpu installed, the splash test
below runs instead of skipping). Here the same path runs with this machine's CPU as the
target, against the start-up compilation of ``cem_jax.train``.
"""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env, tiny_config
from flax import nnx

from cem_jax import aot, memory, optim, sharding, steps, train
from cem_jax.model import DecoderLM


def _cpu_target(memory_bytes: int = 2**40) -> aot.Target:
  return aot.Target(devices=jax.devices()[:1], platform="cpu", memory_bytes=memory_bytes,
                    kind=jax.devices()[0].device_kind)


def test_the_compiled_steps_need_what_mains_start_up_compilation_needs():
  # The abstract state (shapes on shardings, nothing allocated) must compile to main's
  # programs: same memory per device for the training step and the eval step.
  config = tiny_config("cem")
  report = aot.compile_for(config, _cpu_target(), vocab_size=300)
  tx, schedule = optim.make_optimizer(config.train)
  graphdef, params, opt_state, shardings, _ = steps.init_state(config, 300, tx)
  train_step, eval_step = train.make_steps(config, graphdef, tx, shardings, schedule)
  guard = jax.device_put(np.zeros((), np.int32), shardings.replicated)
  compiled = train.compile_steps(config, train_step, eval_step, params, opt_state, guard,
                                 shardings.batch, 1)
  want = [memory.footprint_bytes(c) for c in compiled]
  assert report["train_bytes"] == want[0] > 0
  assert report["eval_bytes"] == want[1] + memory.resident_bytes(opt_state)
  assert (report["devices"], report["mesh"], report["attention"]) == (
      1, {"data": 1, "fsdp": 1, "tensor": 1}, "xla")


def test_a_step_larger_than_the_targets_memory_is_one_line_naming_what_to_change():
  config = tiny_config("llama")
  with pytest.raises(ValueError) as e:
    aot.compile_for(config, _cpu_target(memory_bytes=2**20), vocab_size=300)
  line = str(e.value)
  assert "\n" not in line
  assert line.startswith("the training step needs ") and "the device allows 1.0 MiB" in line
  assert "train.gradient_accumulation_steps" in line


def _step_recording_its_tables():
  """A one-device mesh, and a jitted step that makes an array while traced, as splash makes
  its mask tables, recording the array's placement and the abstract mesh in context."""
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,))
  placed = []

  @jax.jit
  def step(x):
    with jax.ensure_compile_time_eval():
      table = jnp.asarray(np.arange(3, dtype=np.int32))
    placed.append((table.sharding, jax.sharding.get_abstract_mesh()))
    return x + table.sum()

  return mesh, step, placed


def test_a_sharded_step_is_lowered_with_no_array_on_the_meshs_devices():
  # aot compiles for TPU devices jax only describes. Splash makes its mask tables (arrays)
  # while the step is traced; under the concrete mesh they would go to the mesh's devices,
  # which fails for described ones, so a step is lowered under the abstract mesh alone.
  mesh, step, placed = _step_recording_its_tables()
  steps._UnderMesh(step, mesh).lower(np.zeros(2, np.int32))
  assert len(placed) == 1 and not isinstance(placed[0][0], jax.sharding.NamedSharding), placed
  assert placed[0][1] == mesh.abstract_mesh
  assert steps._UnderMesh(step, mesh)(np.zeros(2, np.int32)).tolist() == [3, 3]


def test_a_sharded_step_runs_under_its_own_mesh_whatever_mesh_the_caller_set():
  # A caller's jax.set_mesh (its concrete mesh would again take the arrays made while tracing
  # to the mesh's devices) or a mesh in context of another size (use_abstract_mesh refuses
  # to change the size) does not reach the step: it is lowered and called as without one.
  mesh, step, placed = _step_recording_its_tables()
  wrapped = steps._UnderMesh(step, mesh)
  with jax.set_mesh(mesh):
    wrapped.lower(np.zeros(2, np.int32))
    assert jax.sharding.get_mesh() == mesh  # the caller's again after the call
  other = jax.sharding.AbstractMesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.sharding.use_abstract_mesh(other):
    assert wrapped(np.zeros(2, np.int32)).tolist() == [3, 3]
    assert jax.sharding.get_abstract_mesh() == other
  assert wrapped(np.zeros(2, np.int32)).tolist() == [3, 3]  # and with no mesh set
  assert len(placed) == 1  # the calls reused the lowered trace
  assert not isinstance(placed[0][0], jax.sharding.NamedSharding), placed
  assert placed[0][1] == mesh.abstract_mesh


@pytest.mark.parametrize("block", ["llama", "cem"])
def test_splash_is_compiled_for_a_tpu_slice_described_not_present(monkeypatch, block):
  # Needs libtpu (jax[tpu]), which CI lacks: run by hand in a venv with it
  # (docs/PERFORMANCE.md, "Memory per device").
  try:
    target = aot.target_devices("v5e:2x2")
  except ValueError as e:
    pytest.skip(str(e))
  compiled = []
  compile_steps = train.compile_steps
  monkeypatch.setattr(train, "compile_steps",
                      lambda *a, **k: compiled.extend(compile_steps(*a, **k)) or compiled)
  config = tiny_config(block, **{"data.seq_len": 128, "mesh.data": 1, "mesh.fsdp": 2,
                                 "mesh.tensor": 2})
  report = aot.compile_for(config, target, vocab_size=300)
  assert report["attention"] == "splash" and report["devices"] == 4
  # Per layer, splash's forward kernel, and its dq and dkv kernels in the backward pass.
  kernels = compiled[0].as_text().count('custom_call_target="tpu_custom_call"')
  assert kernels == 3 * config.model.num_layers, kernels


@pytest.mark.parametrize("target, error", [
    ("h200:0", "--target=h200:0: the GPU count '0'; allowed: an int >= 1"),
    ("h100:two", "--target=h100:two: the GPU count 'two'; allowed: an int >= 1"),
    # The GPU's own spelling is the GPU (it was looked up as a TPU: "needs jax[tpu]").
    ("H100:0", "--target=H100:0: the GPU count '0'; allowed: an int >= 1"),
    ("a100", "--target=a100; allowed: a TPU slice as libtpu names it (e.g. v5e:16x16), or "
             "h100, h200[:N]"),
    # Not a TPU's name either: refused here, not after installing libtpu to look it up.
    ("b200:8", "--target=b200:8; allowed: a TPU slice as libtpu names it (e.g. v5e:16x16), or "
               "h100, h200[:N]"),
])
def test_a_bad_target_is_one_line(target, error):
  with pytest.raises(ValueError) as e:
    aot.target_devices(target)
  assert str(e.value) == error


def test_a_target_without_its_plugin_names_the_wheel_to_install():
  # CI has neither libtpu nor the CUDA plugin.
  for target, wheel in (("v5e:2x2", "jax[tpu]"), ("h200:8", "jax[cuda12]")):
    with pytest.raises(ValueError) as e:
      aot.target_devices(target)
    assert str(e.value).startswith(f"--target={target} needs {wheel}=={jax.__version__} "
                                   "installed"), str(e.value)


def test_a_model_built_for_a_tpu_elsewhere_runs_splash_as_the_kernel_not_interpreted():
  config = tiny_config("llama", **{"data.seq_len": 128})
  interpret = {}
  for platform in (None, "tpu", "gpu"):
    model = DecoderLM(config.model, 64, rngs=nnx.Rngs(0), platform=platform)
    interpret[platform] = model.make_aux(None, 1, 128).attention_interpret
  assert interpret == {None: None, "tpu": False, "gpu": True}


def test_on_a_mesh_that_splits_the_state_the_steps_need_what_mains_need():
  # One device cannot tell a sharded abstract state from a replicated one: 8 forced CPU
  # devices, fsdp and tensor parallel, accumulation and loss blocks (a subprocess: this pytest
  # process stays single-device).
  code = textwrap.dedent("""
      import sys; sys.path.insert(0, sys.argv[1])
      import jax, numpy as np
      from conftest import tiny_config
      from cem_jax import aot, memory, optim, steps, train
      config = tiny_config("cem", **{"mesh.data": -1, "mesh.fsdp": 2, "mesh.tensor": 2,
                                     "train.batch_size": 16, "train.loss_block_size": 16,
                                     "train.gradient_accumulation_steps": 2,
                                     "model.num_layers": 1})  # every kind of parameter
      target = aot.Target(jax.devices(), "cpu", 2**40, jax.devices()[0].device_kind)
      r = aot.compile_for(config, target, vocab_size=300)
      tx, schedule = optim.make_optimizer(config.train)
      graphdef, params, opt_state, shardings, _ = steps.init_state(config, 300, tx)
      ts, es = train.make_steps(config, graphdef, tx, shardings, schedule)
      guard = jax.device_put(np.zeros((), np.int32), shardings.replicated)
      c = train.compile_steps(config, ts, es, params, opt_state, guard, shardings.batch,
                              train.data_parallel_devices(config))
      want = [memory.footprint_bytes(c[0]),
              memory.footprint_bytes(c[1]) + memory.resident_bytes(opt_state)]
      assert [r["train_bytes"], r["eval_bytes"]] == want, (r, want)
      assert r["mesh"] == dict(shardings.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
      print("ok")
  """)
  done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)],
                        env=subprocess_env(8, PYTHONPATH=str(Path(__file__).parents[1])),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


class _Described:
  """A device as a target describes it: this machine's id and platform, not this machine's."""

  def __init__(self, kind: str = "cpu", platform: str = "cpu"):
    self.id, self.platform, self.device_kind = 0, platform, kind


def test_a_mesh_of_described_devices_is_theirs_even_with_this_machines_ids():
  # An h100:8 target described on an 8-GPU node has its ids and platform: jax.make_mesh there
  # would lay the mesh over the node's own GPUs and compile for them.
  config = tiny_config("cem")
  described = [_Described()]
  assert sharding.make_mesh(config.mesh, described).devices.flat[0] is described[0]
  assert sharding.make_mesh(config.mesh, jax.devices()).devices.flat[0] is jax.devices()[0]


def test_a_gpu_targets_limit_is_the_share_jax_preallocates_of_its_memory(monkeypatch):
  monkeypatch.setattr(aot, "_topology", lambda *a, **k: [_Described("NVIDIA H200", "gpu")])
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  assert aot.target_devices("h200").memory_bytes == int(0.75 * 150110011392)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  assert aot.target_devices("h100:2").memory_bytes == int(0.5 * 84978434048)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1")  # all of it: (0, 1] includes 1
  assert aot.target_devices("h200").memory_bytes == 150110011392


def test_v4_and_v5p_are_described_one_device_per_chip_as_jax_runs_them(monkeypatch):
  asked = {}

  def topology(target, platform, **kwargs):
    asked[target] = kwargs.get("chip_config_name")
    return [_Described("TPU v4", "tpu")]

  monkeypatch.setattr(aot, "_topology", topology)
  for target in ("v4:2x2x2", "v5p:2x2x2", "v5e:2x2"):
    aot.target_devices(target)
  assert asked == {"v4:2x2x2": "megacore", "v5p:2x2x2": "megacore", "v5e:2x2": None}


def test_auto_at_a_length_splash_cannot_take_is_compiled_with_xla_for_a_tpu():
  # training_aux runs XLA's attention under 'auto' at seq_len 64 (splash needs a multiple of
  # 128): nothing to refuse, and the report names the kernel that runs.
  config = tiny_config("llama")
  target = aot.Target(devices=jax.devices()[:1], platform="tpu", memory_bytes=2**34,
                      kind="TPU v5 lite")
  assert aot.compile_for(config, target, vocab_size=300)["attention"] == "xla"


@pytest.mark.parametrize("fraction", ["abc", "0", "1.5"])
def test_a_bad_gpu_memory_fraction_is_one_line_naming_the_variable(monkeypatch, fraction):
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
  with pytest.raises(ValueError) as e:
    aot.target_devices("h200")
  assert str(e.value) == (f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction!r}; allowed: a number in "
                          "(0, 1], the share of a GPU's memory jax takes (default 0.75)")


def test_a_gpu_target_is_described_with_its_count_of_gpus_in_one_node(monkeypatch):
  # h200:8 is 8 GPUs of one node (1x1x8), the XLA description of that GPU; h100 alone is one.
  asked = {}

  def topology(target, platform, **kwargs):
    asked[target] = (platform, kwargs["topology"], 'device_description_str: "NVIDIA H200"'
                     in kwargs["target_config"])
    return [_Described("NVIDIA H200", "gpu")]

  monkeypatch.setattr(aot, "_topology", topology)
  for target in ("h200:8", "h100"):
    aot.target_devices(target)
  assert asked == {"h200:8": ("cuda", "1x1x8", True), "h100": ("cuda", "1x1x1", False)}
  # XLA's description of each GPU holds its own memory, the figure the check compares with.
  for name in ("h100", "h200"):
    memory = re.search(r"device_memory_size: (\d+)", aot.GPU_TARGET_CONFIGS[name]).group(1)
    assert int(memory) == aot.GPU_MEMORY_BYTES[name], name


@pytest.mark.parametrize("kind, gib", [("TPU v4", 32), ("TPU v5 lite", 16), ("TPU v5", 95),
                                       ("TPU v5p", 95), ("TPU v6 lite", 32)])
def test_a_tpu_targets_limit_is_its_chips_hbm_and_an_unlisted_chip_is_one_line(
    monkeypatch, kind, gib):
  # Google Cloud's figures per chip: v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB of HBM.
  monkeypatch.setattr(aot, "_topology", lambda *a, **k: [_Described(kind, "tpu")])
  assert aot.target_devices("v9:2x2").memory_bytes == gib * 2**30
  monkeypatch.setattr(aot, "_topology", lambda *a, **k: [_Described("TPU v9", "tpu")])
  with pytest.raises(ValueError) as e:
    aot.target_devices("v9:2x2")
  assert str(e.value) == ("--target=v9:2x2: no memory size known for 'TPU v9'; known: TPU v4, "
                          "TPU v5 lite, TPU v5, TPU v5p, TPU v6 lite "
                          "(cem_jax.aot.TPU_MEMORY_BYTES)")


def test_a_vocabulary_of_no_tokens_is_refused_before_anything_compiles():
  with pytest.raises(ValueError) as e:
    aot.compile_for(tiny_config("llama"), _cpu_target(), vocab_size=0)
  assert str(e.value) == "--vocab_size=0; allowed: an int >= 8 and < 2**31"
