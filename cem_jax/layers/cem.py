"""CEM layers: tied attention, tied gated MLP, preconditioners and the recursive block.

Each sub-layer owns the parameters of one energy slot and hands them to the energy as a dict;
:class:`CEMBlock` turns energies into updates (``cem_jax.updates``) and runs CEM_MATH.md §4's
Algorithm 1::

    c ← norm_att(x)                       # attention context, fixed (or co-evolving)
    y ← x
    for t in 1..T:
        y ← y + P_att(-∇_g E_att(g | c)),      g = norm_att(y)
        y ← y + P_mlp(-∇_g E_mlp(g | g₀)),     g = norm_mlp(y), gate input g₀ held fixed
    return y

With T = 1, η = 1 and P = I it is a pre-norm block with tied attention and tied SwiGLU.
Each ``y ← y + u`` above is ``model.inner_optimizer='gd'`` on ``model.manifold='euclidean'``;
momentum (heavy ball, Nesterov, with a velocity carried across steps and layers) and the
sphere replace it by the rules of ``cem_jax.inner``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from cem_jax import energies, inner, updates
from cem_jax.axes import head_dim_of
from cem_jax.layers.common import (
    DTYPES,
    BlockOut,
    RMSNorm,
    const_param,
    param,
    softplus_inverse,
)
from cem_jax.layers.llama import LlamaAttention, SwiGLU


def _copies(cfg, per_step: bool) -> int:
  return cfg.num_steps if per_step else 1


def _at_step(copies: jax.Array, step: int) -> jax.Array:
  """The copy of a per-step parameter ``[copies, ...]`` (:func:`_copies`) that recursive step
  ``step`` (0-based) uses: its own, or the one shared copy. Test-time steps past the trained
  ``model.num_steps`` reuse the last copy, the one trained nearest to them."""
  return copies[min(step, copies.shape[0] - 1)]


def _eta_param(cfg, per_copy: tuple[int, ...], axes: tuple) -> nnx.Param:
  """The raw step size ``[copies, *per_copy]`` (``model.eta_per_step``), every entry
  ``softplus⁻¹(model.eta_init)``; ``axes``: the logical axes of ``per_copy``."""
  copies = _copies(cfg, cfg.eta_per_step)
  return const_param(jnp.full((copies, *per_copy), softplus_inverse(cfg.eta_init)),
                     (None, *axes))


def _eta_at(module, step: int, per_copy: tuple[int, ...]) -> jax.Array:
  """``module``'s positive step size at recursive step ``step``, float32 ``per_copy``:
  softplus of its raw ``eta`` (:func:`_eta_param`), or ones when ``model.learn_eta`` is off."""
  if module.learn_eta:
    return jax.nn.softplus(_at_step(module.eta[...], step))
  return jnp.ones(per_copy, jnp.float32)


def padding_energy(energy, params: dict, aux, d_model: int, dtype, context_dtype) -> jax.Array:
  """``energy`` of one padding token as the energy trace takes it off (``CEMBlock._energy``):
  ``y = context = 0``, seeing no key, under ``aux``'s static options. Multiplied by the count
  of padding tokens, which may be 0: a NaN or inf here makes every trace NaN, so
  :mod:`cem_jax.energy_checks` refuses a user energy whose value here is not finite."""
  alone = energies.EnergyAux(
      mask=jnp.zeros((1, 1, 1), bool), positions=jnp.zeros((1, 1), jnp.int32),
      rope_theta=aux.rope_theta, diagonal_form=aux.diagonal_form,
      strict_causal=aux.strict_causal, energy_block_size=aux.energy_block_size)
  zero = jnp.zeros((1, 1, d_model), dtype)
  return energy(zero, zero.astype(context_dtype), params, alone)


class CEMAttention(nnx.Module):
  """Parameters of the interaction energy (CEM_MATH.md §1): 2·d_model·num_heads·head_dim.

  ``w_q``, ``w_k``: ``[d_model, num_heads, head_dim]``; ``eta``: raw per-head step size
  ``[copies, num_heads]`` (softplus, starts at ``eta_init``); ``beta`` (only with
  ``learn_beta``): raw inverse temperature ``[num_heads]``; ``diag`` (with a diagonal):
  ``[num_heads, d_model]`` (per head) or ``[d_model]`` (shared), starts at 0.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, h, dh = cfg.d_model, cfg.num_heads, head_dim_of(cfg)
    pdt = DTYPES[cfg.param_dtype]
    self.num_heads, self.head_dim = h, dh
    self.w_q = param(rngs, (d, h, dh), cfg.init_std, ("embed", "heads", "head_dim"), pdt)
    self.w_k = param(rngs, (d, h, dh), cfg.init_std, ("embed", "heads", "head_dim"), pdt)
    self.learn_eta = cfg.learn_eta
    if cfg.learn_eta:
      self.eta = _eta_param(cfg, (h,), ("heads",))
    self.learn_beta = cfg.learn_beta
    if cfg.learn_beta:
      self.beta = const_param(jnp.full((h,), softplus_inverse(1.0 / math.sqrt(dh))), ("heads",))
    self.diagonal = cfg.diagonal
    if cfg.diagonal == "per_head":
      self.diag = const_param(jnp.zeros((h, d)), ("heads", "embed"), pdt)
    elif cfg.diagonal == "shared":
      self.diag = const_param(jnp.zeros((d,)), ("embed",), pdt)

  def energy_params(self, step: int, dtype) -> dict:
    """The ``params`` dict of the attention energy at recursive step ``step`` (0-based):
    ``w_q``, ``w_k`` ``[d_model, num_heads, head_dim]`` in ``dtype``; ``eta``, ``beta``
    ``[num_heads]`` float32, positive (softplus of the raw parameters; ones and
    ``1/sqrt(head_dim)`` when not learned); with a diagonal ``diag`` ``[num_heads, d_model]``
    in ``dtype`` ('shared' broadcast to every head)."""
    h = self.num_heads
    eta = _eta_at(self, step, (h,))
    if self.learn_beta:
      beta = jax.nn.softplus(self.beta[...])
    else:
      beta = jnp.full((h,), 1.0 / math.sqrt(self.head_dim), jnp.float32)
    out = {
        "w_q": self.w_q[...].astype(dtype),
        "w_k": self.w_k[...].astype(dtype),
        "eta": eta,
        "beta": beta,
    }
    if self.diagonal != "none":
      out["diag"] = jnp.broadcast_to(self.diag[...], (h, self.w_q.shape[0])).astype(dtype)
    return out


class CEMMLP(nnx.Module):
  """Parameters of the gated element-wise energy (CEM_MATH.md §2): 2·d_model·mlp_dim.

  ``w`` (tied to the readout ``Wᵀ``) and ``g`` (the gate): ``[d_model, mlp_dim]``; ``eta``:
  raw scalar step size per copy ``[copies]`` (softplus, starts at ``eta_init``).
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.mlp_dim
    pdt = DTYPES[cfg.param_dtype]
    self.w = param(rngs, (d, f), cfg.init_std, ("embed", "mlp"), pdt)
    self.g = param(rngs, (d, f), cfg.init_std, ("embed", "mlp"), pdt)
    self.learn_eta = cfg.learn_eta
    if cfg.learn_eta:
      self.eta = _eta_param(cfg, (), ())

  def energy_params(self, step: int, dtype) -> dict:
    """The ``params`` dict of the MLP energy at recursive step ``step`` (0-based): ``w``,
    ``g`` ``[d_model, mlp_dim]`` in ``dtype``; ``eta`` ``[]`` float32, positive (softplus of
    the raw parameter; 1 when not learned)."""
    eta = _eta_at(self, step, ())
    return {"w": self.w[...].astype(dtype), "g": self.g[...].astype(dtype), "eta": eta}


class Preconditioner(nnx.Module):
  """``P = diag(softplus(p) + eps) + U Uᵀ`` (CEM_MATH.md §3), identity-like at init.

  ``p``: ``[copies, d_model]`` with ``softplus(p) + eps = 1``; ``u``: ``[copies, d_model,
  rank]`` ~ normal(0, 1e-3) (exactly 0 would freeze ``U``: its gradient vanishes at 0).
  ``copies`` is 1 (shared across recursive steps) or T (one per step).
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, r = cfg.d_model, cfg.precond_rank
    copies = _copies(cfg, not cfg.precond_shared)
    self.eps = cfg.precond_eps
    self.p = const_param(jnp.full((copies, d), softplus_inverse(1.0 - cfg.precond_eps)),
                         (None, "embed"))
    self.rank = r
    if r > 0:
      self.u = param(rngs, (copies, d, r), 1e-3, (None, "embed", None))

  def __call__(self, v: jax.Array, step: int) -> jax.Array:
    """``P_step v`` for ``v`` ``[..., d_model]``; same shape and dtype."""
    u = _at_step(self.u[...], step) if self.rank > 0 else None
    return updates.precondition(v, _at_step(self.p[...], step), u, self.eps)


class CEMBlock(nnx.Module):
  """A CEM layer: T recursive energy-descent steps (CEM_MATH.md §4).

  Call: see :meth:`__call__`. The block owns ``momentum`` (with ``model.inner_optimizer``
  heavy_ball or nesterov), the raw ``[]`` parameter of ``μ = sigmoid(momentum)``. On
  ``model.manifold='sphere'`` the input is first retracted onto the sphere of radius
  ``√d_model`` (the embeddings enter it here; later layers' inputs are already on it).
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = DTYPES[cfg.dtype]
    pdt = DTYPES[cfg.param_dtype]
    self.norm_att = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    self.norm_mlp = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    # A sub-layer is an energy step (CEM) or, for controlled comparisons, the standard
    # untied Llama sub-layer applied as a residual update (model.cem_attention/cem_mlp).
    self.attn = CEMAttention(cfg, rngs=rngs) if cfg.cem_attention else LlamaAttention(
        cfg, rngs=rngs)
    self.mlp = CEMMLP(cfg, rngs=rngs) if cfg.cem_mlp else SwiGLU(cfg, rngs=rngs)
    self.att_spec = self.mlp_spec = self.att_update = self.mlp_update = None
    if cfg.cem_attention:
      self.att_spec = energies.get(cfg.attention_energy, "attention", "model.attention_energy")
      self.att_update = updates.resolve_update(self.att_spec, cfg.update_mode)
    if cfg.cem_mlp:
      self.mlp_spec = energies.get(cfg.mlp_energy, "mlp", "model.mlp_energy")
      self.mlp_update = updates.resolve_update(self.mlp_spec, cfg.update_mode)
    self.precond_att = nnx.data(
        Preconditioner(cfg, rngs=rngs) if cfg.precond in ("attention", "both") else None)
    self.precond_mlp = nnx.data(
        Preconditioner(cfg, rngs=rngs) if cfg.precond in ("mlp", "both") else None)
    if inner.has_velocity(cfg.inner_optimizer):
      mu0 = cfg.momentum_init
      self.momentum = const_param(jnp.asarray(math.log(mu0 / (1.0 - mu0))), ())

  def _view(self, norm, y, views: dict | None = None):
    """``norm(y)`` (``y`` itself with ``model.norm_mode='none'``). With ``views`` (one dict per
    call of the block) each norm is applied once to each array: where two uses see the same
    point (the attention's context and query at its first step, the MLP's gate and input with
    ``mlp_condition='step'``; a Nesterov look-ahead is another point), the backward pass adds
    their cotangents and differentiates the norm once instead of twice. ``norm_mode='chain'``
    pulls each update back through its own ``jax.vjp`` of the norm, outside this sharing."""
    if self.cfg.norm_mode == "none":
      return y
    if views is None:
      return norm(y)
    key = (id(norm), id(y))
    if key not in views:
      views[key] = (y, norm(y))  # y held so that its id names this array for the whole call
    return views[key][1]

  def _step(self, update_fn, norm, precond, y, context, params, aux, step, views=None):
    """``P(-∇E)`` w.r.t. the normalised variable (prenorm), through the norm (chain) or y."""
    if self.cfg.norm_mode == "chain":
      g, pullback = jax.vjp(norm, y)
      u = pullback(update_fn(g, context, params, aux))[0]
    else:
      u = update_fn(self._view(norm, y, views), context, params, aux)
    return u if precond is None else precond(u, step)

  def _energy(self, spec, norm, y, context, params, aux, views=None):
    """The energy summed over the real tokens (``aux.real``): without that, padding would
    enter per-token means and make them depend on the batching. Padding positions are
    evaluated at ``y = context = 0`` with no visible key (and seen by none), then what one
    such token contributes is taken off per padding token: 0 for every built-in energy, a
    constant for a user energy that is not 0 there (per-token terms, as the start-up checks
    require)."""
    view = self._view(norm, y, views)
    if aux.real is None:
      return spec.energy(view, context, params, aux)
    real = aux.real
    view = jnp.where(real[..., None], view, 0)
    context = jnp.where(real[..., None], context, 0)
    if aux.segment_ids is None:
      # model.document_mask=False: the causal mask lets padding see (and be seen by) tokens,
      # and a query at 0 facing n keys still has a log-sum-exp of log n. Packed windows pad
      # only at their tail, which causality hides from real queries; the key term is for
      # padding before real tokens (a caller's own segment_ids).
      aux = aux.replace(mask=aux.mask & real[:, :, None] & real[:, None, :],
                        is_plain_causal=False, is_causal=False)
    energy = spec.energy(view, context, params, aux)
    if spec.builtin:  # 0 (tests/test_neighbours.py); the call doubled the traced program
      return energy
    padding = padding_energy(spec.energy, params, aux, view.shape[-1], view.dtype,
                             context.dtype)
    return energy - jnp.sum(~real) * padding

  def _att_delta(self, y, context, aux, t, rec, key, at=None, kv=None, views=None):
    """The attention sub-step's residual update at ``at`` (default ``y``; Nesterov: the
    look-ahead point); records E_att at ``y`` when ``rec``. ``kv`` (decoding with the
    standard attention): ``{"cache", "index"}``, whose cache is replaced by the updated one."""
    at = y if at is None else at
    if self.att_spec is None:
      view = self._view(self.norm_att, at, views)
      return self.attn(view, aux) if kv is None else self._cached_attention(view, aux, kv, t)
    params = self.attn.energy_params(t, self.dtype)
    if rec is not None:
      rec[f"att_{key}"] = self._energy(self.att_spec, self.norm_att, y, context, params, aux,
                                       views)
    return self._step(self.att_update, self.norm_att, self.precond_att, at, context, params,
                      aux, t, views)

  def _mlp_delta(self, y, gate, aux, t, rec, key, at=None, views=None):
    """The MLP sub-step's residual update at ``at`` (default ``y``), gate input held fixed."""
    at = y if at is None else at
    if self.mlp_spec is None:
      return self.mlp(self._view(self.norm_mlp, at, views))
    params = self.mlp.energy_params(t, self.dtype)
    if rec is not None:
      rec[f"mlp_{key}"] = self._energy(self.mlp_spec, self.norm_mlp, y, gate, params, aux,
                                       views)
    return self._step(self.mlp_update, self.norm_mlp, self.precond_mlp, at, gate, params, aux,
                      t, views)

  def _energy_after(self, y, att_context, gate, aux, t, rec, views):
    if self.att_spec is not None and "att_after" not in rec:
      params = self.attn.energy_params(t, self.dtype)
      rec["att_after"] = self._energy(self.att_spec, self.norm_att, y, att_context, params, aux,
                                      views)
    if self.mlp_spec is not None and gate is not None:
      params = self.mlp.energy_params(t, self.dtype)
      rec["mlp_after"] = self._energy(self.mlp_spec, self.norm_mlp, y, gate, params, aux,
                                      views)

  def _cached_context(self, new, cache, slot, index):
    """Writes the new positions' context into cache slot ``slot``; returns the full context."""
    buf = jax.lax.dynamic_update_slice(cache["context"][slot],
                                       new.astype(cache["context"].dtype), (0, index, 0))
    return buf.astype(self.dtype), {"context": cache["context"].at[slot].set(buf)}

  def _cached_attention(self, view, aux, kv, t):
    """The standard attention of the new positions at step ``t`` against cache slot ``t``."""
    cache, index = kv["cache"], kv["index"]
    out, slot = self.attn(view, aux, {name: cache[name][t] for name in ("k", "v")}, index)
    kv["cache"] = {name: cache[name].at[t].set(slot[name]) for name in ("k", "v")}
    return out

  def init_cache(self, batch: int, max_len: int, num_steps: int | None = None) -> dict:
    """Empty decoding cache for up to ``max_len`` positions.

    CEM attention: ``context`` ``[copies, batch, max_len, d_model]``, the attention context
    ``c_j`` of every position, one copy with a fixed context (keys = values follow from it:
    the energy reads them off ``c_j``) and one per recursive step with a co-evolving context.
    Any energy, user-defined ones included, decodes from it.

    ``model.cem_attention=False`` (the standard attention): rotated keys ``k`` and values
    ``v``, each ``[steps, batch, max_len, num_heads, head_dim]`` (the
    :class:`~cem_jax.layers.LlamaAttention` cache, once per recursive step: ``num_steps``,
    default ``model.num_steps``) since each step attends from a new ``y``.

    Every leaf is in ``model.dtype``.
    """
    steps = self.cfg.num_steps if num_steps is None else num_steps
    if self.att_spec is None:
      return {name: jnp.zeros((steps,) + one.shape, one.dtype)
              for name, one in self.attn.init_cache(batch, max_len, self.dtype).items()}
    copies = steps if self.cfg.context == "coevolve" else 1
    return {"context": jnp.zeros((copies, batch, max_len, self.cfg.d_model), self.dtype)}

  def _gate(self, point, layer_gate, views):
    """The MLP's gate input: the layer's (``mlp_condition='layer'``) or ``norm_mlp(point)``."""
    if self.cfg.mlp_condition == "layer":
      return layer_gate
    return self._view(self.norm_mlp, point, views)

  def __call__(self, x, aux, num_steps: int | None = None, trace: bool = False,
               cache: dict | None = None, index: jax.Array | int = 0,
               velocity: jax.Array | None = None) -> BlockOut:
    """T recursive energy-descent steps from ``x``.

    Args:
      x: ``[batch, seq_len, d_model]``, cast to ``model.dtype``.
      aux: the :class:`cem_jax.energies.EnergyAux` of this layout (training or decoding).
      num_steps: overrides T at evaluation (test-time steps; per-step parameters are reused
        from the last trained step beyond T).
      trace: record, per step, the energies before/after each sub-step (``att_before``,
        ``att_after``, ``mlp_before``, ``mlp_after``), each a scalar summed over the real
        tokens of the batch (``aux.real``; divide by their number for a per-token mean).
      cache: decoding (:meth:`init_cache`, same ``num_steps``): ``x`` holds new tokens at
        positions ``index, index+1, ...``; their context (with ``model.cem_attention=False``:
        each step's keys and values) is written into the cache. CEM attention: ``{'context':
        [copies, batch, max_len, d_model]}``; the standard attention: ``{'k', 'v': [steps,
        batch, max_len, num_heads, head_dim]}``; in ``model.dtype``.
      index: where the new tokens go in the cache (int or int32 scalar).
      velocity: momentum only (``model.inner_optimizer`` heavy_ball or nesterov): like ``x``,
        None = zeros (the first layer); ignored otherwise.
    Returns:
      :class:`~cem_jax.layers.BlockOut`: ``y`` like ``x`` in ``model.dtype``; ``trace`` (empty
      without ``trace``); ``cache`` updated (None without one); ``velocity`` after the last
      sub-step (None without momentum), which :class:`cem_jax.model.DecoderLM` carries to the
      next layer.
    """
    cfg = self.cfg
    steps = cfg.num_steps if num_steps is None else num_steps
    x = x.astype(self.dtype)
    opt, manifold = cfg.inner_optimizer, cfg.manifold
    # 'gd' on the euclidean manifold keeps its own ops in their own order. The general branches
    # compute the same sums (Lie–Trotter bit for bit), but under the joint split XLA then
    # fuses the sum otherwise: gradients move by ~3e-7, which would bump NUMERICS_VERSION
    # and retrain the committed joint-split runs for nothing.
    plain = opt == "gd" and manifold == "euclidean"
    if manifold == "sphere":
      x = inner.retract(x)
    mu = v = None
    if inner.has_velocity(opt):
      mu = inner.momentum(self.momentum[...])
      v = jnp.zeros_like(x) if velocity is None else velocity.astype(self.dtype)
    y = x
    views = {}  # each norm of each array once in this call (_view)
    att_context = self._view(self.norm_att, x, views)
    kv = None
    if cache is not None and self.att_spec is None:  # the standard attention: keys and values
      kv = {"cache": cache, "index": index}
    elif cache is not None:  # decoding: x holds the new tokens, the cache every earlier one
      att_context, cache = self._cached_context(att_context, cache, 0, index)
    layer_gate = self._view(self.norm_mlp, x, views) if cfg.mlp_condition == "layer" else None
    records = []
    for t in range(steps):
      if cfg.context == "coevolve" and t > 0:
        att_context = self._view(self.norm_att, y, views)
        if cache is not None and kv is None:
          att_context, cache = self._cached_context(att_context, cache, t, index)
      rec = {} if trace else None
      if plain and cfg.split == "joint":
        gate = self._gate(y, layer_gate, views)
        delta = self._att_delta(y, att_context, aux, t, rec, "before", kv=kv, views=views)
        y = y + delta + self._mlp_delta(y, gate, aux, t, rec, "before", views=views)
      elif plain:
        y = y + self._att_delta(y, att_context, aux, t, rec, "before", kv=kv, views=views)
        if trace:
          self._energy_after(y, att_context, None, aux, t, rec, views)
        gate = self._gate(y, layer_gate, views)
        y = y + self._mlp_delta(y, gate, aux, t, rec, "before", views=views)
      elif cfg.split == "joint":  # one inner step on E_att + E_mlp, both at the same point
        z = inner.lookahead(y, v, mu, opt, manifold)
        gate = self._gate(z, layer_gate, views)
        delta = self._att_delta(y, att_context, aux, t, rec, "before", at=z, kv=kv, views=views)
        delta = (delta, self._mlp_delta(y, gate, aux, t, rec, "before", at=z, views=views))
        y, v = inner.apply(y, v, delta, mu, opt, manifold)
      else:  # Lie–Trotter: each sub-step is one inner step, sharing the velocity
        z = inner.lookahead(y, v, mu, opt, manifold)
        delta = self._att_delta(y, att_context, aux, t, rec, "before", at=z, kv=kv, views=views)
        y, v = inner.apply(y, v, delta, mu, opt, manifold)
        if trace:
          self._energy_after(y, att_context, None, aux, t, rec, views)
        z = inner.lookahead(y, v, mu, opt, manifold)
        gate = self._gate(z, layer_gate, views)
        delta = self._mlp_delta(y, gate, aux, t, rec, "before", at=z, views=views)
        y, v = inner.apply(y, v, delta, mu, opt, manifold)
      if trace:
        self._energy_after(y, att_context, gate, aux, t, rec, views)
        records.append(rec)
    if kv is not None:
      cache = kv["cache"]
    return BlockOut(y, records, cache, v)
