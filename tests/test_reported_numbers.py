"""The reported figures counted again from their definitions, independently of the code that
reports them: parameters per part from the maths (CEM_MATH.md §6: a tied embedding once, shared
blocks once, step sizes, diagonals, preconditioners), and every committed paper table
(``results/*/TABLE.md``) recomputed in float64 NumPy from its committed runs' ``result.json``,
``config.json`` and ``metrics.jsonl``."""

import csv
import glob
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

from cem_jax import model_stats
from cem_jax.config import get_default_config
from cem_jax.model import abstract_model

ROOT = Path(__file__).resolve().parents[1]


def _hand_counts(m: dict, vocab: int) -> dict:
  """Parameters by part from the maths, per layer: Llama 4·d·H·d_h + 3df; CEM 2·d·H·d_h (+ H
  step sizes per copy, + H inverse temperatures, + H·d or d diagonal) + 2df (+ 1 step size per
  copy); two norm scales of d; a preconditioner d + d·r per copy; one momentum. G distinct
  blocks (model.num_unique_blocks); a final norm d; the embedding V·d, once when tied."""
  d, f, L, H = m["d_model"], m["mlp_dim"], m["num_layers"], m["num_heads"]
  dh = m["head_dim"] if m["head_dim"] > 0 else d // H
  T = m["num_steps"]
  G = L if m["num_unique_blocks"] <= 0 else m["num_unique_blocks"]
  eta_copies = (T if m["eta_per_step"] else 1) if m["learn_eta"] else 0
  other = 2 * d
  if m["block"] == "llama":
    att, mlp = 4 * d * H * dh, 3 * d * f
  else:
    if m["cem_attention"]:
      att = 2 * d * H * dh + eta_copies * H + (H if m["learn_beta"] else 0)
      att += {"none": 0, "per_head": H * d, "shared": d}[m["diagonal"]]
    else:
      att = 4 * d * H * dh
    mlp = 2 * d * f + eta_copies if m["cem_mlp"] else 3 * d * f
    one = (1 if m["precond_shared"] else T) * (d + d * m["precond_rank"])
    other += {"none": 0, "attention": one, "mlp": one, "both": 2 * one}[m["precond"]]
    other += m["inner_optimizer"] in ("heavy_ball", "nesterov")
  non_embedding = G * (att + mlp + other) + d
  embedding = vocab * d * (1 if m["tie_embeddings"] else 2)
  return {"params": non_embedding + embedding, "non_embedding_params": non_embedding,
          "attention_params": G * att, "mlp_params": G * mlp}


def _hand_flops(m: dict, vocab: int, n: int) -> int:
  """Forward FLOPs per token from the model_stats docstring, by hand (L layers, not G)."""
  d, f, L, H = m["d_model"], m["mlp_dim"], m["num_layers"], m["num_heads"]
  dh = m["head_dim"] if m["head_dim"] > 0 else d // H
  hd, T = H * dh, m["num_steps"]
  if m["block"] == "llama":
    return L * (8 * d * hd + 6 * d * f + 4 * n * hd) + 2 * d * vocab
  if m["cem_attention"]:
    width = dh if m["diagonal"] == "none" else dh + d + (m["diagonal_form"] == "distance")
    keys = 2 * d * hd * (T if m["context"] == "coevolve" else 1)
    step = 4 * d * hd + 4 * n * H * width
  else:
    keys, step = 0, 8 * d * hd + 4 * n * hd
  # U (Uᵀ v) on each preconditioned sub-step: two [d, r] products, 4dr
  step += {"none": 0, "attention": 1, "mlp": 1, "both": 2}[m["precond"]] * 4 * d * m[
      "precond_rank"]
  if m["cem_mlp"] and m["mlp_condition"] == "layer":  # G x of the layer's x: once a layer
    return L * (keys + 2 * d * f + T * (step + 4 * d * f)) + 2 * d * vocab
  return L * (keys + T * (step + 6 * d * f)) + 2 * d * vocab


CASES = [
    dict(block="llama"),
    dict(block="llama", tie_embeddings=False),
    dict(block="llama", num_unique_blocks=1),
    dict(block="cem"),
    dict(block="cem", tie_embeddings=False, num_steps=2, eta_per_step=True),
    dict(block="cem", num_steps=3, num_unique_blocks=2, learn_beta=True, learn_eta=False),
    dict(block="cem", diagonal="per_head", diagonal_form="distance", num_steps=2),
    dict(block="cem", diagonal="shared"),
    dict(block="cem", precond="both", precond_rank=3, precond_shared=False, num_steps=2),
    dict(block="cem", precond="mlp", precond_rank=0),
    dict(block="cem", precond="mlp", precond_rank=2, num_steps=2),
    dict(block="cem", precond="attention", precond_rank=5, num_steps=2),
    dict(block="cem", mlp_condition="layer", num_steps=3),
    dict(block="cem", mlp_condition="layer", cem_mlp=False, num_steps=2),
    dict(block="cem", inner_optimizer="heavy_ball", cem_attention=False),
    dict(block="cem", cem_mlp=False, head_dim=8, num_steps=2, context="coevolve"),
]


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in
                                                                     o.items()))
def test_parameter_counts_and_flops_are_the_hand_counts(overrides):
  # Mutations: model_stats counting a tied embedding twice (or an untied head not at all),
  # non-embedding keeping lm_head, attention/MLP keys swapped; flops_per_token with G for L.
  m = get_default_config().model
  m.d_model, m.num_heads, m.mlp_dim, m.num_layers = 32, 4, 48, 3
  for key, value in overrides.items():
    m[key] = value
  vocab, n = 97, 24
  counts = model_stats.parameter_counts(abstract_model(m, vocab))
  want = _hand_counts(m.to_dict(), vocab)
  assert counts == want
  assert model_stats.count_params(abstract_model(m, vocab)) == want["params"]
  assert model_stats.flops_per_token(m, vocab, n) == _hand_flops(m.to_dict(), vocab, n)



@pytest.mark.parametrize("table", ["attention", "end_to_end"])
def test_a_tables_aggregated_row_reports_the_hand_counts_of_its_own_config(table):
  # Mutations: aggregate counting FLOPs at seq_len + 1 or another row's config, a part's
  # parameters swapped; the committed-table test above reads TABLE.md, not aggregate.
  from cem_jax import tables

  module = tables.load_table(table)
  results = [{"row": row, "seed": 0, "eval/loss": 3.0, "eval/bits_per_byte": 1.0,
              "tokens_per_sec": 1.0} for row in module.ROWS]
  rows = tables.aggregate(module, "tiny", results)
  assert [r["row"] for r in rows] == list(module.ROWS)
  for r in rows:
    config = tables.row_config(module, r["row"], "tiny", 0).to_dict()
    vocab, n = config["data"]["vocab_size"], config["data"]["seq_len"]
    counts = _hand_counts(config["model"], vocab)
    assert {k: r[k] for k in counts} == counts, r["row"]
    assert r["flops_per_token"] == _hand_flops(config["model"], vocab, n), r["row"]

def _cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split("|")]


def _committed_tables():
  out = []
  for md in sorted(glob.glob(str(ROOT / "results" / "*" / "*.md"))):
    lines = Path(md).read_text().splitlines()
    if lines and lines[0].startswith("Table "):
      out.append(md)
  return out


def _config(folder: str, result: dict) -> dict:
  """The run's config.json: its own, or that of the run it reused (``reused_from``)."""
  source = os.path.normpath(os.path.join(folder, result.get("reused_from", ".")))
  return json.loads(Path(source, "config.json").read_text())


@pytest.mark.parametrize("md", _committed_tables(), ids=lambda p: os.path.relpath(p, ROOT))
def test_a_committed_table_is_the_statistics_of_its_committed_runs(md):
  """Each row of a committed table (its .md and .csv) from its runs alone: parameter counts
  and GFLOP/token by hand from the first run's config.json, eval loss and bits per byte as
  mean ± sample std (ddof 1) over the seeds found, Δ paired by seed against the first row,
  perplexity exp(mean loss), tokens/s the mean of each run's result; each result.json the
  run's own seed and its last eval line, its rate the median of its logged rates without the
  first. A table left stale by a code change (counts, formula) or a retrained run fails."""
  lines = Path(md).read_text().splitlines()
  header = lines[0]
  table = re.search(r"--table=(\w+)", header)[1]
  seeds = int(re.search(r"--seeds=(\d+)", header)[1])
  workdir = os.path.dirname(md)
  rows = [_cells(x) for x in lines[3:] if x.startswith("| ")]
  with open(md[:-3] + ".csv", newline="") as f:
    csv_rows = {r["row"]: r for r in csv.DictReader(f)}
  assert sorted(csv_rows) == sorted(r[0] for r in rows), md
  assert rows
  base = None
  for cells in rows:
    row = cells[0]
    results = {}
    for seed in range(seeds):
      folder = os.path.join(workdir, table, row, f"seed{seed}")
      if os.path.exists(os.path.join(folder, "result.json")):
        results[seed] = json.loads(Path(folder, "result.json").read_text())
        config = _config(folder, results[seed])
        assert results[seed]["seed"] == config["seed"] == config["data"]["shuffle_seed"] == seed
        evals = [json.loads(x) for x in Path(folder, "metrics.jsonl").read_text().splitlines()
                 if '"eval/loss"' in x]
        assert evals[-1]["eval/loss"] == results[seed]["eval/loss"], (folder)
        assert evals[-1]["eval/bits_per_byte"] == results[seed]["eval/bits_per_byte"], folder
        if "reused_from" not in results[seed]:
          rates = [json.loads(x)["train/tokens_per_sec"] for x in
                   Path(folder, "metrics.jsonl").read_text().splitlines()
                   if '"train/tokens_per_sec"' in x]
          assert results[seed]["tokens_per_sec"] == pytest.approx(
              float(np.median(rates[1:] or rates)), rel=1e-12), folder
    assert results, f"{md}: row {row} has no finished run"
    loss = np.array([r["eval/loss"] for r in results.values()], np.float64)
    bpb = np.array([r["eval/bits_per_byte"] for r in results.values()], np.float64)
    base = base or {s: r["eval/loss"] for s, r in results.items()}
    delta = np.array([r["eval/loss"] - base[s] for s, r in results.items() if s in base])

    def spread(x, fmt, k=len(results)):  # noqa: B008 - the row's seed count, as the table
      return f"{x.mean():{fmt}}" + (f" ± {x.std(ddof=1):.4f}" if k > 1 else "")

    config = _config(os.path.join(workdir, table, row, f"seed{min(results)}"),
                     results[min(results)])
    vocab, n = config["data"]["vocab_size"], config["data"]["seq_len"]
    counts = _hand_counts(config["model"], vocab)
    user_energy = any(k.endswith("_energy") and v.endswith(".py") for k, v in
                      config["model"].items() if isinstance(v, str))
    want = ([f"{counts[k] / 1e6:.3f}M" for k in ("params", "non_embedding_params",
                                                  "attention_params", "mlp_params")]
            + ["n/a" if user_energy else f"{_hand_flops(config['model'], vocab, n) / 1e9:.4f}",
               spread(loss, ".4f"), spread(delta, "+.4f"), f"{math.exp(loss.mean()):.2f}",
               spread(bpb, ".4f"),
               f"{np.mean([r['tokens_per_sec'] for r in results.values()]):.0f}"])
    assert cells[1:11] == want, f"{md}, row {row}"
    csv_row = csv_rows[row]
    assert [int(csv_row[k]) for k in ("params", "non_embedding_params", "attention_params",
                                       "mlp_params", "seeds")] == [
        counts[k] for k in ("params", "non_embedding_params", "attention_params",
                            "mlp_params")] + [len(results)], f"{md[:-3]}.csv, row {row}"
    if not user_energy:
      assert int(csv_row["flops_per_token"]) == _hand_flops(config["model"], vocab, n), row
    np.testing.assert_allclose(
        [float(csv_row[k]) for k in ("eval_loss_mean", "eval_loss_std", "perplexity",
                                     "bits_per_byte_mean", "bits_per_byte_std")],
        [loss.mean(), loss.std(ddof=1) if len(loss) > 1 else 0.0, math.exp(loss.mean()),
         bpb.mean(), bpb.std(ddof=1) if len(bpb) > 1 else 0.0], rtol=1e-9, err_msg=row)


def _xla_flops_per_token(m, vocab: int, n: int) -> float:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from cem_jax.model import DecoderLM

  graphdef, params = nnx.split(DecoderLM(m, vocab, rngs=nnx.Rngs(0)), nnx.Param)
  forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
  cost = forward.lower(params, jnp.zeros((2, n), jnp.int32)).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"] / (2 * n)


@pytest.mark.parametrize("update_mode", ["fused", "autodiff"])
def test_a_layer_gate_is_one_product_a_layer_as_xla_counts_it(update_mode):
  """model.mlp_condition='layer': every step's gate is G x of the same x, which XLA makes
  once. Counted 6df a step it was 11% over XLA's count at T = 2 (d 64, f 256) and 32% over
  on each extra step; now the total and the two extra steps' FLOPs are within 5%."""
  def both(num_steps):
    m = get_default_config().model
    m.d_model, m.num_heads, m.mlp_dim, m.num_layers = 64, 4, 256, 2
    m.mlp_condition, m.num_steps, m.update_mode = "layer", num_steps, update_mode
    return model_stats.flops_per_token(m, 64, 32), _xla_flops_per_token(m, 64, 32)

  (analytic1, xla1), (analytic3, xla3) = both(1), both(3)
  assert abs(analytic3 / xla3 - 1.0) <= 0.05, (analytic3, xla3)
  assert abs((analytic3 - analytic1) / (xla3 - xla1) - 1.0) <= 0.05, (analytic3 - analytic1,
                                                                      xla3 - xla1)


def test_the_preconditioners_low_rank_flops_are_what_xla_adds():
  """The FLOPs per token that a rank-r preconditioner on both sub-steps adds (T = 2): within 5%
  of what it adds to XLA's cost analysis of the forward pass. (It was not counted: 1.3% of
  the design table's t1_precond_dlr, 4dr of a width-d step per sub-step.)"""
  def both(rank):
    m = get_default_config().model
    m.d_model, m.num_heads, m.mlp_dim, m.num_layers, m.num_steps = 64, 4, 32, 2, 2
    m.precond, m.precond_rank, m.update_mode = "both", rank, "fused"
    return model_stats.flops_per_token(m, 64, 32), _xla_flops_per_token(m, 64, 32)

  (analytic0, xla0), (analytic, xla) = both(0), both(48)
  assert analytic - analytic0 == 2 * 2 * 2 * 4 * 64 * 48  # L · T · 2 sub-steps · 4dr
  assert abs((analytic - analytic0) / (xla - xla0) - 1.0) <= 0.05, (analytic - analytic0,
                                                                     xla - xla0)
