"""The CEM design space: descent, recursion, user energies, traces, validation, test-time steps."""

import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TRACED_T2, force_fields, tiny_config
from flax import nnx

from cem_jax import energies, preflight, steps, train, updates
from cem_jax.layers import CEMBlock
from cem_jax.layers.common import softplus_inverse
from cem_jax.metrics import energy_trace, read_metrics
from cem_jax.model import DecoderLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, H, F, B, T, V = 32, 4, 48, 2, 10, 50


def model_cfg(**overrides):
  cfg = tiny_config("cem").model
  cfg.d_model, cfg.num_heads, cfg.mlp_dim, cfg.init_std = D, H, F, 0.2
  for k, v in overrides.items():
    cfg[k] = v
  return cfg


def _aux(cfg, b=B, t=T):
  return DecoderLM(cfg, V, rngs=nnx.Rngs(0)).make_aux(None, b, t)


def _x(seed):
  return jax.random.normal(jax.random.PRNGKey(seed), (B, T, D))


@pytest.mark.parametrize("seed", range(4))
def test_preconditioned_small_step_decreases_each_energy(seed):
  ks = jax.random.split(jax.random.PRNGKey(100 + seed), 8)
  y, c = jax.random.normal(ks[0], (B, T, D)), jax.random.normal(ks[1], (B, T, D))
  p, u = 2.0 * jax.random.normal(ks[2], (D,)), jax.random.normal(ks[3], (D, 3))
  att = {"w_q": 0.3 * jax.random.normal(ks[4], (D, H, 8)),
         "w_k": 0.3 * jax.random.normal(ks[5], (D, H, 8)),
         "eta": jnp.ones((H,)), "beta": jnp.full((H,), 8**-0.5),
         "diag": 0.2 * jax.random.normal(ks[6], (H, D))}
  mlp = {"w": 0.3 * jax.random.normal(ks[6], (D, F)), "g": 0.3 * jax.random.normal(ks[7], (D, F)),
         "eta": jnp.array(1.0)}
  aux = _aux(model_cfg(rope=True, diagonal="per_head"))
  mlp_energy = energies.make_gated_energy("silu")[0]
  for energy, params in ((energies.interaction_energy, att), (mlp_energy, mlp)):
    grad = jax.grad(energy)(y, c, params, aux)
    step = updates.precondition(grad, p, u, 1e-3)
    before = float(energy(y, c, params, aux))
    after = float(energy(y - 1e-3 * step, c, params, aux))
    assert after < before


@pytest.mark.parametrize("precond_eps", [1e-3, 0.2])
def test_preconditioner_starts_at_the_identity(precond_eps):
  """P = diag(softplus(p) + ε) + U Uᵀ starts at I + U Uᵀ (U ~ normal(0, 1e-3)): a model with
  model.precond starts where the model without it does (CEM_MATH.md §3)."""
  from cem_jax.layers.cem import Preconditioner

  cfg = model_cfg(precond="both", precond_rank=2, precond_eps=precond_eps, num_steps=2,
                  precond_shared=False)
  pre = Preconditioner(cfg, rngs=nnx.Rngs(0))
  v = np.random.default_rng(0).standard_normal((B, T, D))
  for step in range(2):
    u = np.asarray(pre.u[...][step], np.float64)
    want = v + v @ u @ u.T  # diag(1) + U Uᵀ
    np.testing.assert_allclose(np.asarray(pre(jnp.asarray(v, jnp.float32), step)), want,
                               rtol=1e-5, atol=1e-5)


def test_the_low_rank_factor_starts_small_but_not_zero_so_its_gradient_does_not_vanish():
  """U starts ~ normal(0, 1e-3), not at 0 (CEM_MATH.md §3): the gradient of ⟨w, U Uᵀ v⟩ in U
  is w (Uᵀv)ᵀ + v (Uᵀw)ᵀ, zero at U = 0, which would freeze U for the whole run. Checked
  against that float64 formula at the initial U."""
  from cem_jax.layers.cem import Preconditioner

  cfg = model_cfg(precond="both", precond_rank=3)
  pre = Preconditioner(cfg, rngs=nnx.Rngs(3))
  u0 = np.asarray(pre.u[...][0], np.float64)
  assert 0.5e-3 <= u0.std() <= 2e-3, u0.std()
  rng = np.random.default_rng(5)
  v, w = rng.standard_normal((7, D)), rng.standard_normal((7, D))

  def loss(u):  # ⟨w, P v⟩ through the library's P; only its U Uᵀ term depends on U
    pv = updates.precondition(jnp.asarray(v, jnp.float32), pre.p[...][0], u, pre.eps)
    return jnp.sum(jnp.asarray(w, jnp.float32) * pv)

  got = np.asarray(jax.grad(loss)(pre.u[...][0]), np.float64)
  want = w.T @ (v @ u0) + v.T @ (w @ u0)
  assert np.abs(want).max() > 1e-4
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("precond", ["none", "both"])
def test_prenorm_energy_is_monotone_over_four_steps(precond):
  """Joint step on E_att + E_mlp, small η: the total energy falls at every one of 4 steps."""
  cfg = model_cfg(num_steps=4, split="joint", precond=precond,
                  precond_rank=2 if precond != "none" else 0, mlp_condition="layer")
  block = CEMBlock(cfg, rngs=nnx.Rngs(3))
  block.attn.eta[...] = jnp.full_like(block.attn.eta[...], softplus_inverse(0.05))
  block.mlp.eta[...] = jnp.full_like(block.mlp.eta[...], softplus_inverse(0.05))
  trace = block(_x(4), _aux(cfg), trace=True).trace
  totals = [float(trace[0]["att_before"] + trace[0]["mlp_before"])]
  totals += [float(r["att_after"] + r["mlp_after"]) for r in trace]
  assert all(b < a for a, b in zip(totals, totals[1:], strict=False)), totals


def test_lie_trotter_substeps_each_descend():
  cfg = model_cfg(num_steps=4)
  block = CEMBlock(cfg, rngs=nnx.Rngs(5))
  block.attn.eta[...] = jnp.full_like(block.attn.eta[...], softplus_inverse(0.05))
  block.mlp.eta[...] = jnp.full_like(block.mlp.eta[...], softplus_inverse(0.05))
  trace = block(_x(5), _aux(cfg), trace=True).trace
  for rec in trace:
    assert float(rec["att_after"]) < float(rec["att_before"])
    assert float(rec["mlp_after"]) < float(rec["mlp_before"])


def test_two_steps_equal_two_explicit_energy_steps():
  """T = 2, shared parameters, fixed context: Algorithm 1 written out with the pure energies."""
  cfg = model_cfg(num_steps=2, rope=True)
  block = CEMBlock(cfg, rngs=nnx.Rngs(6))
  aux = _aux(cfg)
  x = _x(6)
  att_p, mlp_p = block.attn.energy_params(0, jnp.float32), block.mlp.energy_params(0, jnp.float32)
  mlp_update = updates.autodiff_update(energies.make_gated_energy("silu")[0])
  att_update = updates.autodiff_update(energies.interaction_energy)
  context = block.norm_att(x)
  y = x
  for _ in range(2):
    y = y + att_update(block.norm_att(y), context, att_p, aux)
    g = block.norm_mlp(y)
    y = y + mlp_update(g, g, mlp_p, aux)
  np.testing.assert_allclose(block(x, aux)[0], y, rtol=1e-5, atol=1e-5)
  one = CEMBlock(model_cfg(num_steps=1, rope=True), rngs=nnx.Rngs(6))
  assert float(jnp.max(jnp.abs(one(x, aux)[0] - block(x, aux, num_steps=1)[0]))) == 0.0


def _sigmoid_update_by_hand(y, c, p, aux):
  """Σ_k η_k W_Qkᵀ R_iᵀ Σ_j σ(β s_ij - log|N(i)|) R_j W_Kk c_j, written without autodiff."""
  q = energies.apply_rope(jnp.einsum("btd,dhk->bthk", y, p["w_q"]), aux.positions, 1e4)
  k = energies.apply_rope(jnp.einsum("bsd,dhk->bshk", c, p["w_k"]), aux.positions, 1e4)
  s = jnp.einsum("bthk,bshk->bhts", q, k) * p["beta"][None, :, None, None]
  bias = -jnp.log(jnp.maximum(aux.mask.sum(-1), 1))[:, None, :, None]
  a = jnp.where(aux.mask[:, None], jax.nn.sigmoid(s + bias), 0.0)
  o = energies.apply_rope(jnp.einsum("bhts,bshk->bthk", a, k), aux.positions, 1e4, inverse=True)
  return jnp.einsum("bthk,h,dhk->btd", o, p["eta"], p["w_q"])


def test_user_energy_update_equals_independent_gradient():
  path = os.path.join(REPO, "experiments", "sigmoid_energy.py") + ":energy"
  cfg = model_cfg(attention_energy=path, rope=True)
  block = CEMBlock(cfg, rngs=nnx.Rngs(7))
  assert block.att_spec.fused_update is None  # derived by jax.grad
  aux = _aux(cfg)
  y, c = _x(7), _x(8)
  params = block.attn.energy_params(0, jnp.float32)
  got = block.att_update(y, c, params, aux)
  want = _sigmoid_update_by_hand(y, c, params, aux)
  assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) <= 1e-5


_QUARTIC = """import jax.numpy as jnp


def energy(y, context, params, aux):
  z = jnp.einsum("btd,df->btf", y, params["w"], preferred_element_type=jnp.float32)
  gx = jnp.einsum("btd,df->btf", context, params["g"], preferred_element_type=jnp.float32)
  return -params["eta"] * jnp.sum(gx * (z**2 / 2 - z**4 / 12))
"""


def test_user_mlp_energy_update_is_its_gradient_by_hand(tmp_path):
  # The MLP slot's promise: a user's element-wise energy, no closed form, gets -∇_y E from
  # jax.grad. Φ(z) = z²/2 - z⁴/12 gives -∇_y E = η Wᵀ((z - z³/3) ⊙ Gx), in float64 NumPy.
  (tmp_path / "quartic_mlp.py").write_text(_QUARTIC)
  cfg = model_cfg(mlp_energy=f"{tmp_path}/quartic_mlp.py:energy")
  block = CEMBlock(cfg, rngs=nnx.Rngs(3))
  assert block.mlp_spec.fused_update is None
  block.mlp.eta[...] = jnp.full_like(block.mlp.eta[...], softplus_inverse(0.37))
  params = block.mlp.energy_params(0, jnp.float32)
  y, c = 0.5 * _x(11), _x(12)
  got = np.asarray(block.mlp_update(y, c, params, _aux(cfg)), np.float64)
  w, g = (np.asarray(params[k], np.float64) for k in ("w", "g"))
  z = np.asarray(y, np.float64) @ w
  want = 0.37 * ((z - z**3 / 3) * (np.asarray(c, np.float64) @ g)) @ w.T
  assert np.max(np.abs(got - want)) / np.max(np.abs(want)) <= 1e-5


def test_user_energy_trains_on_real_text(shared_data, tmp_path):
  path = os.path.join(REPO, "experiments", "sigmoid_energy.py") + ":energy"
  # One layer: the energy's own parameters train through jax.grad as in any number of layers.
  # The eval's energy trace is left out: only its loss is read here.
  cfg = tiny_config("cem", **{"model.attention_energy": path, "model.num_layers": 1,
                              "eval.energy_trace": False,
                              "data.files": str(shared_data / "tinyshakespeare.txt")})
  train.train_and_evaluate(cfg, str(tmp_path))
  losses = [m["eval/loss"] for m in read_metrics(str(tmp_path)) if "eval/loss" in m]
  # below the uniform predictor (ln 512 nats) and still falling after step 10 (measured:
  # 5.49 at step 10, 5.24 at step 30; two layers: 5.46, 5.24)
  assert losses[-1] < losses[0] - 0.15 and losses[-1] < math.log(512) - 0.8, losses


def test_readme_swap_an_energy_example_runs_as_written(shared_data, tmp_path):
  readme = open(os.path.join(REPO, "README.md")).read()
  section = readme[readme.index("## Swap an energy"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  assert len(code.strip().splitlines()) <= 15
  (tmp_path / "my_energy.py").write_text(code)
  # Saved in the repository root as the README says, the file is under `ruff check .`.
  lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--config",
                         os.path.join(REPO, "pyproject.toml"), str(tmp_path / "my_energy.py")],
                        capture_output=True, text=True)
  assert lint.returncode == 0, lint.stdout[-2000:]
  command = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
  args = command.split()[3:]  # after 'python -m cem_jax.main'
  assert args[0] == "--config=experiments/tiny.py" and "my_energy.py:energy" in args[-1]
  args[0] = f"--config={REPO}/experiments/tiny.py"
  # A one-layer model of the tests' size (measured: eval loss 6.20 -> 5.43 over the 30 steps)
  args = [a for a in args if not a.startswith("--workdir")] + [
      f"--workdir={tmp_path / 'w'}", "--config.model.d_model=64", "--config.model.num_layers=1",
      "--config.model.mlp_dim=128", "--config.data.seq_len=64", "--config.data.vocab_size=512",
      "--config.train.num_steps=30", "--config.train.batch_size=8",
      "--config.train.eval_every_steps=10", "--config.eval.max_batches=4",
      f"--config.data.files={shared_data / 'tinyshakespeare.txt'}"]
  proc = subprocess.run([sys.executable, "-m", "cem_jax.main", *args], cwd=tmp_path,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  losses = [m["eval/loss"] for m in read_metrics(str(tmp_path / "w")) if "eval/loss" in m]
  assert losses[-1] < losses[0] - 0.2, losses
  # Saved absolute: evaluate/sample started from another folder reload the same file.
  with open(tmp_path / "w" / "config.json") as f:
    saved = json.load(f)["model"]
  assert f"{tmp_path}/my_energy.py:energy" in (saved["attention_energy"], saved["mlp_energy"])


def test_eval_logs_energy_traces_and_test_time_steps(shared_data, tmp_path):
  from cem_jax import evaluate, plot

  cfg = tiny_config("cem", **TRACED_T2,
                    **{"data.files": str(shared_data / "wikitext2_valid.txt")})
  train.train_and_evaluate(cfg, str(tmp_path))
  last = [m for m in read_metrics(str(tmp_path)) if "eval/loss" in m][-1]
  trace = energy_trace(last)
  assert sorted(trace) == [0, 1] and len(trace[0]["att"]) == 3  # before, after t=1, t=2
  assert "eval/energy/layer1/step2/mlp_after" in last
  paths = plot.plot_run(str(tmp_path))
  assert [os.path.basename(p) for p in paths] == ["loss.png", "energy.png"]
  rows = evaluate.test_time_steps(str(tmp_path), [1, 2, 3], max_batches=2)  # as eval at step 4
  assert [(r["T_eval"], r["T_trained"], r["step"]) for r in rows] == [(1, 2, 4), (2, 2, 4),
                                                                      (3, 2, 4)]
  assert all(np.isfinite(r["eval/perplexity"]) for r in rows)
  assert rows[0]["eval/loss"] != rows[2]["eval/loss"]
  # At the trained T the report's row is the last eval of training: the final energy is the
  # energy after the last step, summed over the layers and sub-layers.
  assert rows[1]["eval/loss"] == pytest.approx(last["eval/loss"], rel=1e-6)
  want = sum(last[f"eval/energy/layer{layer}/step2/{part}_after"] for layer in (0, 1)
             for part in ("att", "mlp"))
  assert rows[1]["final_energy"] == pytest.approx(want, rel=1e-5)
  written = evaluate.write_report(str(tmp_path), rows, trained_steps=2)
  assert all(os.path.getsize(p) > 0 for p in written)


@pytest.mark.parametrize("cem_attention,cem_mlp", [(False, True), (False, False)])
def test_test_time_steps_of_a_block_with_standard_sublayers(tmp_path, monkeypatch, cem_attention,
                                                             cem_mlp):
  """Controls with the standard attention (or MLP) have no energy there: the final energy is
  the CEM sub-layers' (None without any), not a KeyError."""
  from cem_jax import evaluate

  cfg = tiny_config("cem", **{"model.cem_attention": cem_attention, "model.cem_mlp": cem_mlp,
                              "model.num_layers": 1, "train.num_steps": 2,
                              "train.eval_every_steps": 2, "eval.max_batches": 1})
  train.train_and_evaluate(cfg, str(tmp_path))
  # --max_batches, not the run's eval.max_batches, sets the batches each row reads.
  read, real_eval_loop = [], steps.eval_loop

  def eval_loop(eval_step, params, data, cfg, *args):
    read.append(cfg.eval.max_batches)
    return real_eval_loop(eval_step, params, data, cfg, *args)

  monkeypatch.setattr(steps, "eval_loop", eval_loop)
  rows = evaluate.test_time_steps(str(tmp_path), [1, 2], max_batches=2)
  assert read == [2, 2]
  last = [m for m in read_metrics(str(tmp_path)) if "eval/loss" in m][-1]
  if cem_mlp:
    assert sorted(energy_trace(last)[0]) == ["mlp"]
    assert all(np.isfinite(r["final_energy"]) for r in rows)
  else:
    assert energy_trace(last) == {} and [r["final_energy"] for r in rows] == [None, None]
  md = evaluate.write_report(str(tmp_path), rows, trained_steps=1)[0]
  assert ("| n/a |" in open(md).read()) is not cem_mlp


INVALID = [
    ({"model.precond": "both", "model.precond_rank": 65}, r"model.precond_rank=65 exceeds"),
    ({"model.num_steps": 0}, r"model.num_steps=0; allowed: an int >= 1 and < 2\*\*8 \(every "),
    ({"model.num_steps": 1.5}, r"model.num_steps=1.5; allowed: an int >= 1 and < 2\*\*8 "),
    ({"model.attention_energy": "hopfield"}, r"model.attention_energy='hopfield' is not a "),
    ({"model.mlp_energy": "softmax"}, r"model.mlp_energy='softmax' is an attention energy"),
    ({"model.learn_beta": True}, r"model.learn_beta=True and model.learn_eta=True"),
    ({"model.block": "llama", "model.num_steps": 2}, r"model.num_steps=2 applies to CEM"),
    ({"model.diagonal": "full"}, r"model.diagonal='full'; allowed: none, per_head, shared"),
    ({"model.d_model": 66, "model.num_heads": 4}, r"model.d_model=66 is not divisible"),
    ({"eval.num_steps": 0}, r"eval.num_steps=0; allowed"),
]


@pytest.mark.parametrize("overrides,message", INVALID, ids=lambda v: str(v)[:40])
def test_invalid_configs_fail_at_start_up(overrides, message):
  cfg = tiny_config("cem")
  force_fields(cfg, overrides)
  with pytest.raises(ValueError, match=message):
    preflight.check(cfg)


USER_ENERGIES = '''
import jax.numpy as jnp
def vector(y, context, params, aux):
  return jnp.sum(y, axis=-1)
def integer(y, context, params, aux):
  return jnp.sum(y).astype(jnp.int32)
def broken(y, context, params, aux):
  return params["no_such_param"].sum()
def half(y, context, params, aux):
  return (jnp.sum(params["eta"]) * jnp.sum(y * y)).astype(jnp.bfloat16)
'''


@pytest.mark.parametrize("name,message", [
    ("vector", r"returns shape \(1, 4\) for y of shape \[1, 4, 64\] \(\[batch, seq_len, "
               r"d_model\]\); an energy must return a scalar"),
    ("integer", r"returns dtype int32 for y of shape \[1, 4, 64\] .*; an energy must return a "
                r"float scalar$"),
    # bfloat16 passed, then the slope check refused its rounded value as a wrong gradient.
    ("half", r"returns dtype bfloat16 for y .*; an energy must return a float32 \(or float64\) "
             r"scalar: accumulate in float32"),
    ("broken", r"failed on \[batch, seq_len, d_model\] inputs: KeyError"),
])
def test_bad_user_energies_fail_before_compilation(tmp_path, name, message):
  path = tmp_path / "bad_energy.py"
  path.write_text(USER_ENERGIES)
  cfg = tiny_config("cem", **{"model.attention_energy": f"{path}:{name}"})
  with pytest.raises(ValueError, match=message):
    preflight.check(cfg)


def test_fused_requested_for_an_energy_without_closed_form(tmp_path):
  path = os.path.join(REPO, "experiments", "sigmoid_energy.py") + ":energy"
  cfg = tiny_config("cem", **{"model.attention_energy": path, "model.update_mode": "fused"})
  with pytest.raises(ValueError, match="has no closed-form update; use 'autodiff' or 'auto'"):
    preflight.check(cfg)


@pytest.mark.parametrize("per_step", [False, True])
def test_eta_init_sets_every_learned_step_size(per_step):
  """model.eta_init is the starting η of every head, recursive step and sub-layer (issue 17:
  1/T makes T steps move a token as far as one at initialisation)."""
  cfg = model_cfg(num_steps=3, eta_init=1 / 3, eta_per_step=per_step)
  block = CEMBlock(cfg, rngs=nnx.Rngs(0))
  assert block.attn.eta[...].shape == ((3, H) if per_step else (1, H))
  for step in range(3):
    np.testing.assert_allclose(block.attn.energy_params(step, jnp.float32)["eta"],
                               np.full(H, 1 / 3), rtol=1e-6)
    np.testing.assert_allclose(block.mlp.energy_params(step, jnp.float32)["eta"], 1 / 3,
                               rtol=1e-6)
  default = CEMBlock(model_cfg(num_steps=3), rngs=nnx.Rngs(0))
  np.testing.assert_allclose(default.attn.energy_params(0, jnp.float32)["eta"], np.ones(H),
                             rtol=1e-6)


@pytest.mark.parametrize("head_dim", [-1, 16])
def test_learned_beta_starts_at_one_over_sqrt_head_dim(head_dim):
  """model.learn_beta=True: β_k starts at the fixed value 1/√d_h of every head (CEM_MATH.md
  §1), d_h = model.head_dim or d_model // num_heads; so at initialisation the block equals the
  fixed-β block with the same weights."""
  dh = head_dim if head_dim > 0 else D // H
  learned = CEMBlock(model_cfg(learn_beta=True, learn_eta=False, head_dim=head_dim),
                     rngs=nnx.Rngs(0))
  raw = np.asarray(learned.attn.beta[...], np.float64)
  assert raw.shape == (H,)
  np.testing.assert_allclose(np.logaddexp(0.0, raw), np.full(H, 1 / math.sqrt(dh)), rtol=1e-6)
  np.testing.assert_allclose(learned.attn.energy_params(0, jnp.float32)["beta"],
                             np.full(H, 1 / math.sqrt(dh)), rtol=1e-6)
  fixed_cfg = model_cfg(learn_eta=False, head_dim=head_dim)
  fixed = CEMBlock(fixed_cfg, rngs=nnx.Rngs(0))
  aux, x = _aux(fixed_cfg), _x(6)
  np.testing.assert_allclose(learned(x, aux)[0], fixed(x, aux)[0], rtol=1e-5, atol=1e-6)


def test_readme_and_design_space_list_every_field_of_energy_aux():
  # A user energy reads aux; a field the docs leave out is one a user cannot know about.
  import dataclasses

  fields = {f.name for f in dataclasses.fields(energies.EnergyAux)}
  readme = open(os.path.join(REPO, "README.md")).read()
  table = readme[readme.index("**`aux`**"):]
  table = table[:table.index("\n\n", table.index("| field |"))]
  design = open(os.path.join(REPO, "docs", "DESIGN_SPACE.md")).read()
  design = design[design.index("**`aux`**"):design.index("**Closed form.**")]
  for doc, text in [("README.md", table), ("docs/DESIGN_SPACE.md", design)]:
    missing = sorted(f for f in fields if f"`{f}`" not in text)
    assert not missing, f"{doc} does not list EnergyAux fields {missing}"
