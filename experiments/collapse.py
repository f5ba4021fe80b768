"""Why a run sits on the unigram plateau: per-layer update sizes and the collapse of positions.

    python -m cem_jax.main --config=experiments/paper/neighbours.py:cem_shared \
        --config.checkpoint.every_steps=25 --config.checkpoint.keep=100 --workdir=/tmp/shared
    python experiments/collapse.py --workdir=/tmp/shared

For the initialisation (step 0, rebuilt from the run's seed) and every checkpoint kept in
``WORKDIR/checkpoints``, on the first 16 windows of the held-out split, it prints one line:

- ``loss``: cross-entropy of the next token, nats per token, and, once, what predicting the
  unigram frequencies of the training targets (of the first 1,000 steps at most) scores on
  the same tokens (the plateau's level);
- ``collapse``: the mean cosine between the final residuals of two positions of a window (1:
  every position carries the same vector; the token's identity is gone);
- ``|h|/|e|``: the final residual's norm over the input embeddings' (``model.embed_scale``
  included);
- per layer, each update's norm over the layer input's (``att``, ``mlp``; one ``upd`` for the
  whole layer where the block is not split here) and, in brackets, its position-constant
  share: the norm of its mean over the window's positions over its own norm, over the whole
  batch (1: the same vector added at every position; 0: nothing in common).

The attention and MLP updates are split for CEM blocks with one step of plain gradient descent
on pre-normed points (``model.num_steps=1``, ``inner_optimizer='gd'``, ``manifold='euclidean'``,
``norm_mode='prenorm'``, no preconditioner), either split; their sum is checked against the
block's own output (an AssertionError if it is off by more than 1e-4 of it). Every other block
gets the layer's whole update (a momentum block's velocity carried across layers, as in the
model). A run trained with bfloat16 compute is evaluated in float32 (said on the first line);
a checkpoint that fails its digest is named and skipped.

What it showed (docs/REPRODUCING.md, neighbours): every CEM row first collapses onto one vector
(eval loss at the unigram level, 5.83 nats on War and Peace's 1,024 pieces), and with a block
reused across layers under the Lie–Trotter split the first layer's updates, sized for the
layers above (pre-norm: an update's size does not depend on its input's), bury the small
embedding, so the first MLP sees no token identity to undo it with.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

BATCH_ROWS = 16
UNIGRAM_STEPS = 1000  # the unigram frequencies are counted over at most this many batches


def constant_share(update):
  """``||mean over positions||·sqrt(positions) / ||update||`` over a ``[batch, seq_len, d]``
  array: the position-constant share of its norm, in [0, 1] (0 for an all-zero update)."""
  import jax.numpy as jnp

  total = jnp.linalg.norm(update)
  common = jnp.linalg.norm(jnp.mean(update, axis=1)) * update.shape[1] ** 0.5
  return float(jnp.where(total > 0, common / jnp.where(total > 0, total, 1.0), 0.0))


def position_collapse(h, real):
  """Mean cosine between two distinct real positions of the same window of ``h`` ``[batch,
  seq_len, d]``; ``real`` ``[batch, seq_len]`` bool. Windows with fewer than two real positions
  are left out."""
  import jax.numpy as jnp

  unit = h / jnp.maximum(jnp.linalg.norm(h, axis=-1, keepdims=True), 1e-30)
  cos = jnp.einsum("bsd,btd->bst", unit, unit)
  pair = real[:, :, None] & real[:, None, :] & ~jnp.eye(h.shape[1], dtype=bool)
  return float(jnp.sum(jnp.where(pair, cos, 0.0)) / jnp.maximum(jnp.sum(pair), 1))


def _splittable(cfg) -> bool:
  return (cfg.block == "cem" and cfg.cem_attention and cfg.cem_mlp and cfg.num_steps == 1
          and cfg.inner_optimizer == "gd" and cfg.manifold == "euclidean"
          and cfg.norm_mode == "prenorm" and cfg.precond == "none")


def _sub_steps(block, x, aux):
  """The attention and MLP updates of one CEM layer at ``x`` (see the module docstring)."""
  cfg = block.cfg
  context = block.norm_att(x)
  att = block.att_update(context, context, block.attn.energy_params(0, block.dtype), aux)
  y = x if cfg.split == "joint" else x + att
  gate_at = x if cfg.mlp_condition == "layer" else y
  mlp = block.mlp_update(block.norm_mlp(y), block.norm_mlp(gate_at),
                         block.mlp.energy_params(0, block.dtype), aux)
  return att, mlp


def layer_report(model, batch) -> dict:
  """The diagnostics of one model on one batch (``inputs``, ``targets``, ``segment_ids``,
  ``weights``, each ``[batch, seq_len]``): ``loss`` (nats per token), ``collapse``,
  ``h_over_e`` and ``layers``, one dict per layer of ``{part: (relative norm, constant
  share)}`` with parts ``att`` and ``mlp``, or ``upd``."""
  import jax.numpy as jnp

  from cem_jax.loss import output_logits, weighted_cross_entropy

  inputs, segments = jnp.asarray(batch["inputs"]), jnp.asarray(batch["segment_ids"])
  aux = model.make_aux(segments if model.cfg.document_mask else None, *inputs.shape)
  aux = aux.replace(real=segments > 0)
  e = model.embed(inputs)
  x, layers = e, []
  split = _splittable(model.cfg)
  # A momentum block (inner_optimizer heavy_ball/nesterov) carries its velocity across layers,
  # as DecoderLM does; restarting it at 0 in every layer would report another network.
  momentum = model.cfg.block == "cem" and model.cfg.inner_optimizer != "gd"
  velocity = jnp.zeros_like(x) if momentum else None
  for block in model.layer_blocks():
    out = block(x, aux, velocity=velocity)
    y, velocity = out.y, out.velocity
    norm = jnp.linalg.norm(x)
    if split:
      att, mlp = _sub_steps(block, x, aux)
      off = float(jnp.linalg.norm(y - x - att - mlp) / jnp.maximum(jnp.linalg.norm(y - x),
                                                                   1e-30))
      assert off <= 1e-4, f"the split updates miss the block's output by {off:.2e} of it"
      parts = {"att": att, "mlp": mlp}
    else:
      parts = {"upd": y - x}
    layers.append({k: (float(jnp.linalg.norm(v) / norm), constant_share(v))
                   for k, v in parts.items()})
    x = y
  logits = output_logits(model.final_norm(x), model.output_head())
  total, weight = weighted_cross_entropy(logits, jnp.asarray(batch["targets"]),
                                         jnp.asarray(batch["weights"]))
  return {"loss": float(total / weight), "collapse": position_collapse(x, segments > 0),
          "h_over_e": float(jnp.linalg.norm(x) / jnp.linalg.norm(e)), "layers": layers}


def unigram_loss(data, num_steps: int, batch) -> float:
  """Cross-entropy on ``batch``'s targets of the unigram frequencies of the training targets of
  steps ``0 .. num_steps - 1`` (add-one smoothed), nats per token."""
  import numpy as np

  vocab = data.tokenizer.vocab_size
  counts = np.ones(vocab)
  for step in range(num_steps):
    b = data.train.batch(step)
    np.add.at(counts, b["targets"][b["weights"] > 0], 1)
  logp = np.log(counts / counts.sum())
  w = batch["weights"]
  return float(-(logp[batch["targets"]] * w).sum() / w.sum())


def _line(step: int, r: dict) -> str:
  parts = " | ".join(" ".join(f"{k} {rel:7.2f} ({share:.2f})"
                              for k, (rel, share) in layer.items()) for layer in r["layers"])
  return (f"step {step:6d}  loss {r['loss']:.3f}  collapse {r['collapse']:.2f}  "
          f"|h|/|e| {r['h_over_e']:8.1f}  layers: {parts}")


def main(argv):
  from flax import nnx

  from cem_jax import cli, optim

  cli.no_extra_args(argv)  # a flag missing its -- was dropped without a word
  from cem_jax import steps as steps_lib
  from cem_jax.checkpoint import Checkpointer
  from cem_jax.runs import load_run

  cli.quiet_libraries(logging.logging.ERROR)
  workdir = flags.FLAGS.workdir
  with cli.user_errors():
    config, data, graphdef, params, newest = load_run(workdir)
    batch = next(iter(data.eval_batches(BATCH_ROWS)))
    if config.model.dtype != "float32":
      # The split check (1e-4) is float32's: bfloat16 rounding alone misses it by ~1e-2.
      print(f"{workdir}: trained with model.dtype={config.model.dtype!r}; computed here in "
            "float32 (its float32 parameters)")
      config.model.dtype = "float32"
      graphdef = nnx.split(steps_lib.build_model(config, data.tokenizer.vocab_size),
                           nnx.Param)[0]
    split = f", split {config.model.split}" if config.model.block == "cem" else ""
    steps = min(config.train.num_steps, UNIGRAM_STEPS)
    print(f"{workdir}: {config.model.block} block, {config.model.num_layers} layers over "
          f"{len(nnx.merge(graphdef, params).blocks)} unique blocks{split}; {BATCH_ROWS} "
          "held-out windows; predicting the unigram frequencies (of the training targets of "
          f"steps 0-{steps - 1}) scores {unigram_loss(data, steps, batch):.3f}")
    init = steps_lib.build_model(config, data.tokenizer.vocab_size)
    print(_line(0, layer_report(init, batch)))
    _, template = nnx.split(init, nnx.Param)
    tx, _ = optim.make_optimizer(config.train)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False, read_only=True)
    try:
      for step in ckpt.all_steps():
        damaged = [] if step == newest else ckpt.verify(step)
        if damaged:  # restored anyway, it gave wrong numbers or NaN without a word
          print(f"step {step:6d}  damaged, skipped: {damaged[0]}", flush=True)
          continue
        restored = params if step == newest else ckpt.restore(
            step, {"params": template, "opt_state": tx.init(template)})[0]["params"]
        print(_line(step, layer_report(nnx.merge(graphdef, restored), batch)), flush=True)
    finally:
      ckpt.close()


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A training run's --workdir (with its checkpoints).")
  from cem_jax import cli

  cli.require("workdir")
  app.run(main, flags_parser=cli.parse_flags)  # --help: status 0, bad flags: one line
