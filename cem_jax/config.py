"""The full default configuration and its validation.

Every experiment file in ``experiments/`` starts from :func:`get_default_config` and
overrides what it needs, so every key below exists in every resolved config and can be set
from the command line (``--config.model.num_layers=2``). Groups: ``model``, ``data``,
``train``, ``eval``, ``mesh``, ``checkpoint``.

The maths behind the ``model`` options is in ``CEM_MATH.md`` (section numbers given per key).
"""

from __future__ import annotations

import ml_collections

BLOCKS = ("cem", "llama")
UPDATE_MODES = ("auto", "fused", "autodiff")
NORM_MODES = ("prenorm", "chain", "none")
DIAGONAL_MODES = ("none", "per_head", "shared")
DIAGONAL_FORMS = ("bilinear", "distance")
CONTEXT_MODES = ("fixed", "coevolve")
SPLIT_MODES = ("lie_trotter", "joint")
MLP_CONDITIONS = ("step", "layer")
PRECOND_TARGETS = ("none", "attention", "mlp", "both")
DTYPES = ("float32", "bfloat16")
INNER_OPTIMIZERS = ("gd", "heavy_ball", "nesterov")  # cem_jax/inner.py
MANIFOLDS = ("euclidean", "sphere")
# mesh.rules default: logical axis (named in the model code) -> mesh axis, None (replicated) or
# a tuple of mesh axes. FSDP shards the model dimension of every matrix, tensor parallelism the
# heads, the MLP width and the vocabulary; batches are split over data x fsdp.
DEFAULT_MESH_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


def get_default_config() -> ml_collections.ConfigDict:
  """Returns the default config: the tiny CEM model of ``experiments/tiny.py``.

  d_model 128, 4 layers, 4 heads, mlp_dim 512, seq_len 128, a 1024-piece BPE trained on the
  built-in corpus (CPython's pydoc topics + stdlib docstrings; held out: the last 10% of the
  pydoc topics), 1000 steps of batch 16: about 8 minutes on 2 CPU cores.
  """
  c = ml_collections.ConfigDict()

  c.seed = 0

  # ---- model -------------------------------------------------------------------------------
  m = c.model = ml_collections.ConfigDict()
  m.block = "cem"  # 'cem' | 'llama'
  m.d_model = 128
  m.num_heads = 4
  m.head_dim = -1  # -1: d_model // num_heads
  m.mlp_dim = 512
  m.num_layers = 4
  m.tie_embeddings = True
  m.rope = True
  m.rope_theta = 10_000.0
  m.norm_eps = 1e-6
  # True: in a packed window a token sees only its own document (an explicit [b, n, n] mask).
  # False: plain causal attention over the whole window (nanoGPT/nanodo), which lets fused
  # kernels use is_causal (cuDNN flash attention on GPU, no n x n mask in memory). The loss
  # never crosses a document boundary either way (data/packing.py weights).
  m.document_mask = True
  m.dtype = "float32"  # compute dtype
  m.param_dtype = "float32"
  m.init_std = 0.02
  # CEM options (CEM_MATH.md sections 1-5).
  m.cem_attention = True  # False: the standard untied attention inside a CEM block (controls)
  m.cem_mlp = True  # False: the standard SwiGLU inside a CEM block (controls)
  m.update_mode = "auto"  # 'auto' (fused where a closed form exists) | 'fused' | 'autodiff'
  m.attention_energy = "softmax"  # registry name or 'module:function'
  m.mlp_energy = "silu"  # registry name or 'module:function'
  m.strict_causal = False  # N(i) = {j < i} instead of {j <= i} (section 1)
  m.learn_beta = False  # learnable inverse temperature (then eta is fixed, section 1)
  m.learn_eta = True  # per-head (attention) / scalar (MLP) step sizes, softplus, init 1
  m.diagonal = "none"  # 'none' | 'per_head' | 'shared' (section 1)
  m.diagonal_form = "bilinear"  # 'bilinear' | 'distance'
  m.precond = "none"  # 'none' | 'attention' | 'mlp' | 'both' (section 3)
  m.precond_rank = 0  # rank r of U in P = diag(softplus(p) + eps) + U U^T
  m.precond_eps = 1e-3
  m.precond_shared = True  # one P for all recursive steps (False: one per step)
  m.num_steps = 1  # T, recursive updates inside a layer (section 4)
  m.context = "fixed"  # 'fixed' | 'coevolve'
  m.split = "lie_trotter"  # 'lie_trotter' | 'joint'
  m.eta_per_step = False  # a separate step size per recursive step
  m.mlp_condition = "step"  # gate input: 'step' (state entering the MLP step) | 'layer'
  m.norm_mode = "prenorm"  # 'prenorm' | 'chain' | 'none' (section 5)
  # Neighbours of CEM (cem_jax/inner.py): the rule that applies each sub-step's update.
  m.inner_optimizer = "gd"  # 'gd' | 'heavy_ball' | 'nesterov' (velocity carried across layers)
  m.momentum_init = 0.5  # initial learned momentum per block, in (0, 1); momentum rules only
  m.manifold = "euclidean"  # 'euclidean' | 'sphere' (tokens on the sphere of radius sqrt(d))
  # Shared depth: G unique blocks, layer l runs block l % G (G must divide num_layers);
  # -1 = num_layers (no sharing).
  m.num_unique_blocks = -1
  m.remat = "none"  # 'none' | 'full' | 'dots' : jax.checkpoint policy per block

  # ---- data --------------------------------------------------------------------------------
  d = c.data = ml_collections.ConfigDict()
  d.files = ""  # glob(s) of local text files, comma separated; '' = another source
  d.tfds_name = ""  # TFDS catalog dataset, e.g. 'wikipedia/20230601.en'; needs internet
  d.tfds_data_dir = ""  # '' = TFDS default (~/tensorflow_datasets)
  d.tfds_text_key = "text"
  d.tfds_train_split = "train"
  d.tfds_eval_split = "validation"
  d.builtin = "pydoc+docstrings"  # built-in offline corpus: 'pydoc' | 'pydoc+docstrings'
  d.validation_fraction = 0.1  # tail of the text held out (builtin and files sources)
  d.seq_len = 128
  d.vocab_size = 1024
  d.tokenizer = ""  # path to a sentencepiece .model; '' = train one on the train split
  d.tokenizer_model_type = "bpe"  # 'bpe' | 'unigram'
  d.shuffle_seed = 0

  # ---- train -------------------------------------------------------------------------------
  t = c.train = ml_collections.ConfigDict()
  t.num_steps = 1000
  t.batch_size = 16  # global batch, sequences
  t.learning_rate = 3e-3
  t.min_learning_rate_ratio = 0.1  # cosine decays to this fraction of the peak
  t.warmup_steps = 50
  t.weight_decay = 0.1
  t.b1 = 0.9
  t.b2 = 0.95
  t.grad_clip = 1.0
  t.eval_every_steps = 100
  t.log_every_steps = 10
  t.max_consecutive_nonfinite = 10

  # ---- eval --------------------------------------------------------------------------------
  e = c.eval = ml_collections.ConfigDict()
  e.batch_size = 32
  e.max_batches = -1  # -1: the whole validation split
  e.num_steps = -1  # recursive steps T at eval; -1 = model.num_steps (test-time steps)
  e.energy_trace = True  # log eval/energy/layer{l}/step{t}/... for CEM models

  # ---- mesh --------------------------------------------------------------------------------
  h = c.mesh = ml_collections.ConfigDict()
  # data x fsdp x tensor = the devices of all processes (one size may be -1: the rest).
  h.data = -1  # -1: take the devices left over
  h.fsdp = 1  # parameters and optimizer state sharded over it (ZeRO-3 style), batch too
  h.tensor = 1  # heads, MLP width and vocabulary split over it (must divide them)
  h.rules = DEFAULT_MESH_RULES  # ((logical_axis, mesh_axis | None | (mesh_axes...)), ...)

  # ---- checkpoint --------------------------------------------------------------------------
  k = c.checkpoint = ml_collections.ConfigDict()
  k.every_steps = 250
  k.keep = 3
  k.async_save = True

  return c


_CHOICES = {
    "model.block": BLOCKS,
    "model.update_mode": UPDATE_MODES,
    "model.norm_mode": NORM_MODES,
    "model.diagonal": DIAGONAL_MODES,
    "model.diagonal_form": DIAGONAL_FORMS,
    "model.context": CONTEXT_MODES,
    "model.split": SPLIT_MODES,
    "model.mlp_condition": MLP_CONDITIONS,
    "model.precond": PRECOND_TARGETS,
    "model.inner_optimizer": INNER_OPTIMIZERS,
    "model.manifold": MANIFOLDS,
    "model.dtype": DTYPES,
    "model.param_dtype": DTYPES,
    "model.remat": ("none", "full", "dots"),
    "data.builtin": ("pydoc", "pydoc+docstrings"),
    "data.tokenizer_model_type": ("bpe", "unigram"),
}

# field -> (minimum allowed, inclusive)
_MINIMUMS = {
    "model.d_model": 1,
    "model.num_heads": 1,
    "model.mlp_dim": 1,
    "model.num_layers": 1,
    "model.num_steps": 1,
    "model.precond_rank": 0,
    "data.seq_len": 2,
    "data.vocab_size": 8,
    "train.num_steps": 1,
    "train.batch_size": 1,
    "train.warmup_steps": 0,
    "train.eval_every_steps": 1,
    "train.log_every_steps": 1,
    "train.max_consecutive_nonfinite": 1,
    "eval.batch_size": 1,
    "checkpoint.every_steps": 1,
    "checkpoint.keep": 1,
}


def _get(config, dotted: str):
  node = config
  for part in dotted.split("."):
    node = node[part]
  return node


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks a resolved config before anything is built or compiled.

  Raises:
    ValueError: one line naming the field, its value and what is allowed.
  """
  for field, allowed in _CHOICES.items():
    value = _get(config, field)
    if value not in allowed:
      raise ValueError(f"{field}={value!r}; allowed: {', '.join(allowed)}")
  for field, minimum in _MINIMUMS.items():
    value = _get(config, field)
    if isinstance(value, bool) or not isinstance(value, int):
      raise ValueError(f"{field}={value!r} must be an int (a static Python int)")
    if value < minimum:
      raise ValueError(f"{field}={value} must be >= {minimum}")
  m = config.model
  head_dim = m.head_dim if m.head_dim > 0 else m.d_model // m.num_heads
  if m.head_dim <= 0 and m.d_model % m.num_heads:
    raise ValueError(
        f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; "
        "change one or set model.head_dim"
    )
  if m.rope and head_dim % 2:
    raise ValueError(f"model.head_dim={head_dim} must be even with model.rope=True")
  if m.precond_rank > m.d_model:
    raise ValueError(
        f"model.precond_rank={m.precond_rank} exceeds model.d_model={m.d_model}; "
        f"allowed: 0..{m.d_model}"
    )
  if m.learn_beta and m.learn_eta:
    raise ValueError(
        "model.learn_beta=True and model.learn_eta=True are redundant (CEM_MATH.md §1); "
        "set model.learn_eta=False to learn the temperature"
    )
  if m.precond == "none" and m.precond_rank > 0:
    raise ValueError(
        f"model.precond_rank={m.precond_rank} has no effect with model.precond='none'; "
        "set model.precond to attention, mlp or both"
    )
  g = m.num_unique_blocks
  if isinstance(g, bool) or not isinstance(g, int) or not (g == -1 or 1 <= g <= m.num_layers):
    raise ValueError(f"model.num_unique_blocks={g!r}; allowed: -1 (= model.num_layers) or an "
                     f"int in 1..{m.num_layers} (model.num_layers)")
  if g > 0 and m.num_layers % g:
    raise ValueError(f"model.num_unique_blocks={g} does not divide model.num_layers="
                     f"{m.num_layers}; each block is reused num_layers / G times")
  mi = m.momentum_init
  if isinstance(mi, bool) or not isinstance(mi, (int, float)) or not 0.0 < mi < 1.0:
    raise ValueError(f"model.momentum_init={mi!r}; allowed: a float with 0 < momentum < 1")
  if m.inner_optimizer == "gd" and mi != 0.5:
    raise ValueError(f"model.momentum_init={mi} has no effect with model.inner_optimizer='gd'; "
                     "set model.inner_optimizer to heavy_ball or nesterov")
  if m.block == "llama":
    cem_only = {"num_steps": 1, "diagonal": "none", "precond": "none", "inner_optimizer": "gd",
                "manifold": "euclidean"}
    for key, neutral in cem_only.items():
      if m[key] != neutral:
        raise ValueError(
            f"model.{key}={m[key]!r} applies to CEM blocks only; model.block='llama' "
            f"needs model.{key}={neutral!r}"
        )
  if m.block == "cem" and not m.cem_attention and m.diagonal != "none":
    raise ValueError(
        f"model.diagonal={m.diagonal!r} needs the energy attention; set model.cem_attention="
        "True or model.diagonal='none'"
    )
  rest = []
  for axis in ("data", "fsdp", "tensor"):
    size = config.mesh[axis]
    if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
      raise ValueError(f"mesh.{axis}={size!r}; allowed: -1 (the devices left over) or an "
                       "int >= 1")
    rest += [f"mesh.{axis}=-1"] if size == -1 else []
  if len(rest) > 1:
    raise ValueError(f"{' and '.join(rest)}: at most one mesh size may be -1 (the devices "
                     "left over); give the others as ints (mesh.data defaults to -1)")
  # Imported here: sharding imports jax, which this module must not do at import time.
  from cem_jax import sharding

  sharding.rules_from_config(config.mesh)
  mb = config.eval.max_batches
  if isinstance(mb, bool) or not isinstance(mb, int) or (mb < 1 and mb != -1):
    raise ValueError(f"eval.max_batches={mb!r}; allowed: -1 (the whole split) or an int >= 1")
  ev = config.eval.num_steps
  if isinstance(ev, bool) or not isinstance(ev, int) or (ev < 1 and ev != -1):
    raise ValueError(f"eval.num_steps={ev!r}; allowed: -1 (= model.num_steps) or an int >= 1")
  vf = config.data.validation_fraction
  if not 0.0 < vf <= 0.5:
    raise ValueError(f"data.validation_fraction={vf}; allowed: 0 < fraction <= 0.5")
  if m.block == "cem":
    validate_energies(config)


def validate_energies(config: ml_collections.ConfigDict) -> None:
  """Looks up both energies and checks, by abstract evaluation (no compilation), that each
  returns a scalar float and that the chosen update mode exists for it.

  Raises:
    ValueError: unknown energy, no closed form for ``update_mode='fused'``, or an energy that
      returns a non-scalar or non-float value.
  """
  # Imported here: config is the leftmost module and must not pull in jax at import time.
  import jax
  import jax.numpy as jnp

  from cem_jax import energies, updates

  m = config.model
  d, h = m.d_model, m.num_heads
  dh = m.head_dim if m.head_dim > 0 else d // h
  b, t = 1, 4
  y = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
  aux = energies.EnergyAux(
      mask=jnp.tril(jnp.ones((b, t, t), bool)),
      positions=jnp.zeros((b, t), jnp.int32),
      rope_theta=m.rope_theta if m.rope else None,
      diagonal_form=m.diagonal_form,
  )
  att_params = {
      "w_q": jax.ShapeDtypeStruct((d, h, dh), jnp.float32),
      "w_k": jax.ShapeDtypeStruct((d, h, dh), jnp.float32),
      "eta": jax.ShapeDtypeStruct((h,), jnp.float32),
      "beta": jax.ShapeDtypeStruct((h,), jnp.float32),
  }
  if m.diagonal != "none":
    att_params["diag"] = jax.ShapeDtypeStruct((h, d), jnp.float32)
  mlp_params = {
      "w": jax.ShapeDtypeStruct((d, m.mlp_dim), jnp.float32),
      "g": jax.ShapeDtypeStruct((d, m.mlp_dim), jnp.float32),
      "eta": jax.ShapeDtypeStruct((), jnp.float32),
  }
  slots = []
  if m.cem_attention:
    slots.append(("model.attention_energy", "attention", att_params))
  if m.cem_mlp:
    slots.append(("model.mlp_energy", "mlp", mlp_params))
  for field, kind, params in slots:
    spec = energies.get(m[field.split(".")[1]], kind, field)
    updates.resolve_update(spec, m.update_mode)
    try:
      out = jax.eval_shape(lambda y_, p_, s=spec: s.energy(y_, y_, p_, aux), y, params)
    except Exception as e:  # the user's function failed on valid shapes: say whose it is
      raise ValueError(f"{field}={spec.name!r} failed on [batch, seq_len, d_model] inputs: "
                       f"{type(e).__name__}: {e}") from e
    if not hasattr(out, "shape") or out.shape != ():
      shape = getattr(out, "shape", type(out).__name__)
      raise ValueError(f"{field}={spec.name!r} returns shape {shape}; an energy must return "
                       "a scalar (sum over batch and positions)")
    if not jnp.issubdtype(out.dtype, jnp.floating):
      raise ValueError(f"{field}={spec.name!r} returns dtype {out.dtype}; an energy must "
                       "return a float scalar")
