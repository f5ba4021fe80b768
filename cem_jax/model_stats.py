"""Model size and cost without training: parameter names and counts, analytic FLOPs per token.

One place for the numbers the tools report (``bench``, ``tables``, ``summary``, the training
loop's ``params/total``), so they cannot drift apart. Nothing here builds a model: counts take
a built (or ``nnx.eval_shape``-built) module, FLOPs take the ``model`` config group.

FLOPs per token (forward; a training step is 3× forward: the backward costs 2×), counting a
multiply-add as 2 FLOPs, L layers, width d, MLP width f, sequence length n, vocabulary V,
heads H of width d_h (d² below stands for d·H·d_h, equal when H·d_h = d):

    Llama:  L·(8d² + 6df + 4n·H·d_h) + 2dV
    CEM:    L·(2d² + T·(4d² + 6df + 4n·H·d̃ + 4dr·P)) + 2dV
            d̃ = d_h, or with a diagonal d_h + d (+ 1 in the distance form)
            P = the preconditioned sub-steps (model.precond: 0, 1 or 2), r its rank
            (U (Uᵀ v): 4dr each; 0 for a diagonal-only P)
            with model.mlp_condition='layer' the gate G x is one product a layer (every
            step reads the same x): 2df once and 4df a step instead of 6df a step
            (fixed context: W_K c once; each step W_Q y, W_Qᵀ o and the MLP's W y, G x, Wᵀ h;
             a co-evolving context adds 2d² per extra step; with model.cem_attention=False
             each step's attention is Llama's, 8d² + 4n·H·d_h, and there is no key term)

The attention term counts the full n×n score and value products (as XLA computes them),
not the causal half. ``autodiff`` updates do the same model FLOPs as ``fused`` ones; their
extra work shows up as lower MFU.
"""

from __future__ import annotations

import jax
from flax import nnx

from cem_jax.axes import augmented_head_dim, head_dim_of

# Path keys of the model's parts (DecoderLM and its blocks): the embedding and untied head
# are the vocabulary-sized parameters, ``attn``/``mlp`` the blocks' two sub-layers.
EMBEDDING_KEYS = frozenset({"embedding", "lm_head"})
ATTENTION_KEY = "attn"
MLP_KEY = "mlp"


def path_names(path) -> list[str]:
  """The dict/attribute key names of a pytree ``path`` (``jax.tree_util`` keys), in order,
  without nnx's ``value`` leaf key and keys that have no name (sequence indices)."""
  names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
  return [n for n in names if n and n != "value"]


def param_name(path) -> str:
  """The variable's own name: the last key of its ``path`` (``''`` if it has none)."""
  names = path_names(path)
  return names[-1] if names else ""


def count_params(module: nnx.Module) -> int:
  """Number of scalar parameters (``nnx.Param``) in ``module``."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def parameter_counts(module: nnx.Module) -> dict[str, int]:
  """Parameters of a ``DecoderLM`` by part: ``{'params', 'non_embedding_params',
  'attention_params', 'mlp_params'}``, each a Python int (scalars, summed over layers).

  Non-embedding excludes ``embedding`` and ``lm_head``; attention and MLP are the blocks'
  ``attn`` and ``mlp`` sub-layers (norms, step sizes outside them count in neither).
  """
  counts = {"params": 0, "non_embedding_params": 0, "attention_params": 0, "mlp_params": 0}
  for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(module, nnx.Param)):
    names = set(path_names(path))
    counts["params"] += leaf.size
    if not names & EMBEDDING_KEYS:
      counts["non_embedding_params"] += leaf.size
    if ATTENTION_KEY in names:
      counts["attention_params"] += leaf.size
    if MLP_KEY in names:
      counts["mlp_params"] += leaf.size
  return counts


# Dense bf16 peak FLOP/s by device kind (vendor data sheets); MFU is left empty elsewhere.
# Each TPU under every name jax's runtimes report for it (jax's tpu_info: a v5p says "TPU v5").
PEAK_FLOPS = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


def peak_flops(devices=None) -> float | None:
  """Dense bf16 peak FLOP/s of ``devices`` together (a device or a list; default: this
  process's first device), from :data:`PEAK_FLOPS`; None when any kind is not listed (CPUs),
  so that no MFU is made up."""
  devices = [jax.local_devices()[0]] if devices is None else devices
  devices = devices if isinstance(devices, (list, tuple)) else [devices]
  peaks = [PEAK_FLOPS.get(d.device_kind) for d in devices]
  return None if not peaks or None in peaks else float(sum(peaks))


def flops_per_token(model_cfg, vocab_size: int, seq_len: int) -> float:
  """Analytic forward FLOPs per token of ``DecoderLM`` (formula in the module docstring).

  Args:
    model_cfg: the ``model`` config group.
    vocab_size: V, the LM head's width.
    seq_len: n, the attention length.
  Returns:
    FLOPs per token of one forward pass (an int-valued Python number).
  """
  d, f, n, L = model_cfg.d_model, model_cfg.mlp_dim, seq_len, model_cfg.num_layers
  h, dh = model_cfg.num_heads, head_dim_of(model_cfg)
  head = 2 * d * vocab_size
  if model_cfg.block == "llama":
    return L * (2 * d * h * dh * 4 + 6 * d * f + 4 * n * h * dh) + head
  t = model_cfg.num_steps
  if model_cfg.cem_attention:
    keys = 2 * d * h * dh * (t if model_cfg.context == "coevolve" else 1)
    attention_step = 4 * d * h * dh + 4 * n * h * (augmented_head_dim(model_cfg) or dh)
  else:  # the standard attention sub-layer (its own Q, K, V, O) at every step
    keys, attention_step = 0, 8 * d * h * dh + 4 * n * h * dh
  # P v = diag(.) ⊙ v + U (Uᵀ v) on each preconditioned sub-step (CEM_MATH.md §3).
  precond = {"none": 0, "attention": 1, "mlp": 1, "both": 2}[model_cfg.precond]
  precond *= 4 * d * model_cfg.precond_rank
  # The tied MLP's W y, G x, Wᵀ h a step; with the layer's gate input x, G x is the same
  # product at every step, made once (XLA merges the T equal products).
  gate_once = model_cfg.cem_mlp and model_cfg.mlp_condition == "layer"
  mlp_step, mlp_once = (4 * d * f, 2 * d * f) if gate_once else (6 * d * f, 0)
  return L * (keys + mlp_once + t * (attention_step + mlp_step + precond)) + head


def gflop_text(flops: float | None) -> str:
  """A FLOP count as tables print it: GFLOP (10⁹) to 4 decimals, ``n/a`` for None (a model
  whose count is not known: a user energy's operations are not modelled)."""
  return "n/a" if flops is None else f"{flops / 1e9:.4f}"
