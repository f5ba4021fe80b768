"""The training loop: state, jitted step, periodic eval, metrics and checkpoints.

One clear path (nanodo-style): build data → build model → split it into ``graphdef`` and
``params`` → ``jax.jit`` a pure train step over ``(params, opt_state, batch)`` → evaluate,
log and checkpoint at step boundaries. The data order is a pure function of the step, so the
checkpointed step *is* the data position and a resumed run sees exactly the same batches.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from cem_jax import config as config_lib
from cem_jax import data as data_lib
from cem_jax.checkpoint import Checkpointer
from cem_jax.layers import DECAYED_PARAM_NAMES
from cem_jax.metrics import MetricsWriter
from cem_jax.model import DecoderLM, count_params

# ---------------------------------------------------------------------------------------------
# Optimizer


def _param_name(path) -> str:
  """The variable's own name: the last dict/attribute key of its path (not ``value``)."""
  names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
  names = [n for n in names if n and n != "value"]
  return names[-1] if names else ""


def decay_mask(params):
  """True for parameters weight decay applies to: chosen by *name*, never by rank."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: _param_name(path) in DECAYED_PARAM_NAMES, params
  )


def make_schedule(cfg: ml_collections.ConfigDict):
  """Linear warmup to ``train.learning_rate``, then cosine decay to ``min_learning_rate_ratio``."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=cfg.learning_rate,
      warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.num_steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.min_learning_rate_ratio,
  )


def make_optimizer(cfg: ml_collections.ConfigDict):
  """AdamW with global-norm clipping; updates with a non-finite gradient are skipped.

  Returns ``(tx, schedule)``. ``optax.apply_if_finite`` keeps the parameters unchanged on a
  NaN/Inf gradient and counts it; the loop stops after ``train.max_consecutive_nonfinite``.
  """
  schedule = make_schedule(cfg)
  inner = optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                  mask=decay_mask),
  )
  # apply_if_finite would let updates through after this many in a row; the loop stops first.
  return optax.apply_if_finite(inner, cfg.max_consecutive_nonfinite + 1), schedule


# ---------------------------------------------------------------------------------------------
# Loss


def weighted_cross_entropy(logits, targets, weights):
  """Sum of ``-log p(target)`` over weighted positions, and the sum of weights.

  Args:
    logits: ``[batch, seq_len, vocab_size]`` float32.
    targets: ``[batch, seq_len]`` int.
    weights: ``[batch, seq_len]`` float32 (0 for targets across a document boundary or padding).
  Returns:
    ``(loss_sum, weight_sum)``, float32 scalars, loss in nats.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * weights), jnp.sum(weights)


# ---------------------------------------------------------------------------------------------
# Steps


def make_train_step(graphdef, tx):
  """Returns the jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)``."""

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    logits = model(batch["inputs"], batch["segment_ids"])
    loss_sum, weight_sum = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    return loss_sum / jnp.maximum(weight_sum, 1.0)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "nonfinite_total": opt_state.total_notfinite,
        "nonfinite_consecutive": opt_state.notfinite_count,
    }
    return params, opt_state, metrics

  return step


def make_eval_step(graphdef, token_bytes: np.ndarray, num_steps: int | None,
                   energy_trace: bool = False):
  """Returns the jitted ``eval_step(params, batch) -> dict`` of sums over the batch.

  Keys: ``loss_sum`` (nats), ``weight_sum`` (predicted tokens), ``byte_sum`` (their UTF-8
  bytes) and, with ``energy_trace``, ``energy`` (per layer, per step: the mean per-token
  energies before/after each sub-step, see :class:`cem_jax.layers.CEMBlock`).
  ``num_steps`` overrides the recursive steps T of every CEM layer (test-time steps).
  """
  token_bytes = jnp.asarray(token_bytes, jnp.float32)

  @jax.jit
  def eval_step(params, batch):
    model = nnx.merge(graphdef, params)
    outputs = model(batch["inputs"], batch["segment_ids"], num_steps=num_steps,
                    trace=energy_trace)
    logits, traces = outputs if energy_trace else (outputs, None)
    loss_sum, weight_sum = weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    byte_sum = jnp.sum(token_bytes[batch["targets"]] * batch["weights"])
    out = {"loss_sum": loss_sum, "weight_sum": weight_sum, "byte_sum": byte_sum}
    if energy_trace:
      out["energy"] = traces
    return out

  return eval_step


def energy_metrics(traces) -> dict:
  """Flattens a model's energy trace into ``eval/energy/layer{l}/step{t}/{att,mlp}_{before,after}``.

  ``traces``: list over layers of lists over steps of dicts of scalars (mean energy per token).
  """
  out = {}
  for layer, steps in enumerate(traces):
    for t, rec in enumerate(steps):
      for key, value in rec.items():
        out[f"eval/energy/layer{layer}/step{t + 1}/{key}"] = float(value)
  return out


def evaluate(eval_step, params, data, cfg) -> dict:
  """Runs ``eval_step`` over the validation split; returns ``eval/...`` metrics.

  ``eval/loss`` is nats per predicted token, ``eval/perplexity`` its exponential and
  ``eval/bits_per_byte`` the total bits over the UTF-8 bytes of the predicted tokens. Energy
  traces (when ``eval_step`` makes them) are averaged over the evaluated batches.
  """
  totals = {"loss_sum": 0.0, "weight_sum": 0.0, "byte_sum": 0.0}
  energy_sum, batches = None, 0
  for i, batch in enumerate(data.eval_batches(cfg.eval.batch_size)):
    if 0 <= cfg.eval.max_batches <= i:
      break
    out = jax.device_get(eval_step(params, batch))
    for k in totals:
      totals[k] += float(out[k])
    if "energy" in out:
      energy_sum = out["energy"] if energy_sum is None else jax.tree.map(
          lambda a, b: a + b, energy_sum, out["energy"])
    batches += 1
  loss = totals["loss_sum"] / max(totals["weight_sum"], 1.0)
  metrics = {
      "eval/loss": loss,
      "eval/perplexity": math.exp(min(loss, 80.0)),
      "eval/bits_per_byte": totals["loss_sum"] / math.log(2) / max(totals["byte_sum"], 1.0),
      "eval/tokens": int(totals["weight_sum"]),
  }
  if energy_sum is not None:
    metrics.update(energy_metrics(jax.tree.map(lambda a: a / batches, energy_sum)))
  return metrics


# ---------------------------------------------------------------------------------------------
# The loop


def _write_json_atomic(path: str, obj) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def build_model(config, vocab_size: int) -> DecoderLM:
  """The model of ``config.model`` with ``vocab_size`` tokens, initialised from ``config.seed``."""
  return DecoderLM(config.model, vocab_size, rngs=nnx.Rngs(params=config.seed))


def _format_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains ``config`` in ``workdir`` (resuming from its newest checkpoint); returns final metrics.

  Writes ``workdir/config.json`` (resolved config), ``workdir/metrics.jsonl`` (one JSON object
  per line: train lines every ``train.log_every_steps``, eval lines every
  ``train.eval_every_steps`` and at the end) and ``workdir/checkpoints/``.

  Raises:
    ValueError: invalid config or data (one line naming the field, value and what is allowed).
    FloatingPointError: ``train.max_consecutive_nonfinite`` non-finite steps in a row.
  """
  config_lib.validate(config)
  os.makedirs(workdir, exist_ok=True)
  data = data_lib.build_data(config, workdir)
  vocab_size = data.tokenizer.vocab_size
  model = build_model(config, vocab_size)
  graphdef, params = nnx.split(model, nnx.Param)
  tx, schedule = make_optimizer(config.train)
  opt_state = tx.init(params)

  is_main = jax.process_index() == 0
  resolved = config.to_dict()
  if is_main:
    _write_json_atomic(os.path.join(workdir, "config.json"), resolved)

  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                      async_save=config.checkpoint.async_save)
  start_step = 0
  latest = ckpt.latest_step()
  if latest is not None:
    state, meta = ckpt.restore(latest, {"params": params, "opt_state": opt_state})
    params, opt_state = state["params"], state["opt_state"]
    start_step = int(meta["step"])
    logging.info("resumed from %s at step %d", ckpt.directory, start_step)

  writer = MetricsWriter(workdir, enabled=is_main, truncate_after_step=start_step)
  if start_step == 0:
    stats = {f"data/{k}": v for k, v in data.stats().items()}
    writer.write(0, {"params/total": count_params(model), **stats})
  train_step = make_train_step(graphdef, tx)
  eval_num_steps = None if config.eval.num_steps < 0 else config.eval.num_steps
  trace = config.eval.energy_trace and config.model.block == "cem"
  eval_step = make_eval_step(graphdef, data.tokenizer.token_bytes, eval_num_steps, trace)
  cfg_t = config.train
  num_steps = cfg_t.num_steps
  tokens_per_step = cfg_t.batch_size * config.data.seq_len

  def meta(step):
    return {"step": step, "data_position": step, "seed": config.seed, "config": resolved}

  last_eval = {}
  t_start = t_log = time.perf_counter()
  step_at_log = start_step
  for step in range(start_step, num_steps):
    batch = data.train.batch(step, jax.process_index(), jax.process_count())
    params, opt_state, m = train_step(params, opt_state, batch)
    done = step + 1
    if done % cfg_t.log_every_steps == 0 or done == num_steps:
      m = jax.device_get(m)
      if int(m["nonfinite_consecutive"]) >= cfg_t.max_consecutive_nonfinite:
        raise FloatingPointError(
            f"{int(m['nonfinite_consecutive'])} consecutive non-finite loss/gradient steps up "
            f"to step {done} (train.max_consecutive_nonfinite="
            f"{cfg_t.max_consecutive_nonfinite}); lower train.learning_rate"
        )
      now = time.perf_counter()
      rate = (done - step_at_log) * tokens_per_step / max(now - t_log, 1e-9)
      writer.write(done, {
          "train/loss": float(m["loss"]),
          "train/grad_norm": float(m["grad_norm"]),
          "train/learning_rate": float(schedule(step)),
          "train/tokens_per_sec": rate,
          "train/nonfinite_steps": int(m["nonfinite_total"]),
      })
      eta = (now - t_start) / max(done - start_step, 1) * (num_steps - done)
      logging.info("step %d/%d  loss %.4f  %.0f tok/s  ETA %s", done, num_steps,
                   float(m["loss"]), rate, _format_eta(eta))
      t_log, step_at_log = now, done
    if done % cfg_t.eval_every_steps == 0 or done == num_steps:
      last_eval = evaluate(eval_step, params, data, config)
      writer.write(done, last_eval)
      logging.info("eval at step %d: loss %.4f  ppl %.2f  bits/byte %.4f", done,
                   last_eval["eval/loss"], last_eval["eval/perplexity"],
                   last_eval["eval/bits_per_byte"])
    if done % config.checkpoint.every_steps == 0 or done == num_steps:
      ckpt.save(done, {"params": params, "opt_state": opt_state}, meta(done),
                force=done == num_steps)
  ckpt.wait()
  ckpt.close()
  writer.close()
  return last_eval
