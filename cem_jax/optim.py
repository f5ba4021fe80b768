"""The optimizer: which parameters decay, the learning-rate schedule, AdamW with clipping and a
skip of non-finite updates (optax).

Imported by :mod:`cem_jax.steps` (the train step logs the schedule's rate), the loop and the
tools that build a train step (bench, evaluate).
"""

from __future__ import annotations

import functools
import json

import jax
import ml_collections
import optax

from cem_jax.layers import DECAYED_PARAM_NAMES
from cem_jax.model_stats import param_name


def decay_mask(params):
  """True for parameters weight decay applies to: chosen by *name*, never by rank."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: param_name(path) in DECAYED_PARAM_NAMES, params
  )


def make_schedule(cfg: ml_collections.ConfigDict):
  """The learning rate of each update: ``schedule(count)`` for the update made after ``count``
  applied updates (optax's count, 0 for the first).

  Update ``k = count + 1`` uses ``peak * k / warmup_steps`` while ``k <= warmup_steps`` (so the
  first update already moves the weights, and update ``warmup_steps`` uses the peak
  ``train.learning_rate``), then a cosine decay reaching ``peak * min_learning_rate_ratio`` at
  update ``train.num_steps``. ``warmup_steps = 0``: the cosine from the first update.
  """
  base = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=cfg.learning_rate,
      warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.num_steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.min_learning_rate_ratio,
  )
  # optax's schedule gives init_value (0) at count 0: shift by one so update k gets base(k).
  return lambda count: base(count + 1)


def applied_updates(opt_state) -> jax.Array:
  """Updates applied so far (int32 ``[]``): the count of the learning-rate schedule's state,
  which a skipped non-finite update (``optax.apply_if_finite``) does not advance.

  Raises:
    ValueError: ``opt_state`` holds no schedule state, or more than one (not built by
      :func:`make_optimizer`).
  """
  is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
  states = [x for x in jax.tree.leaves(opt_state, is_leaf=is_sched) if is_sched(x)]
  if len(states) != 1:
    raise ValueError(f"expected one learning-rate schedule in the optimizer state, found "
                     f"{len(states)}; build the optimizer with make_optimizer")
  return states[0].count


def make_optimizer(cfg: ml_collections.ConfigDict):
  """AdamW with global-norm clipping; updates with a non-finite gradient are skipped.

  ``optax.clip_by_global_norm`` then ``optax.adamw`` (Loshchilov & Hutter 2019, decoupled
  weight decay, masked by :func:`decay_mask`) inside ``optax.apply_if_finite``; ``cfg`` is the
  ``train`` config group. Returns ``(tx, schedule)``. ``optax.apply_if_finite`` keeps the
  parameters unchanged on a NaN/Inf gradient and counts it; the loop stops after
  ``train.max_consecutive_nonfinite``.

  Equal ``train`` groups (every field, its type included) give the same ``(tx, schedule)``
  objects: the jitted steps are cached by the optimizer's identity
  (:func:`cem_jax.steps.make_train_step`), so the runs of one config in one process (tables'
  seeds) reuse their compiled programs, while any other field value (the schedule's rates and
  step counts are constants of the compiled step) is another optimizer.
  """
  # The optimizer is built from the key itself (the group as JSON, which tells 1 from 1.0),
  # so no field it reads can be missing from the key.
  return _optimizer(json.dumps(json.loads(cfg.to_json()), sort_keys=True))


@functools.lru_cache(maxsize=8)
def _optimizer(train_json: str):
  """:func:`make_optimizer` of the ``train`` group written as ``train_json``."""
  cfg = ml_collections.ConfigDict(json.loads(train_json))
  schedule = make_schedule(cfg)
  inner = optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                  mask=decay_mask),
  )
  # apply_if_finite would let updates through after this many in a row; the loop stops first.
  return optax.apply_if_finite(inner, cfg.max_consecutive_nonfinite + 1), schedule
