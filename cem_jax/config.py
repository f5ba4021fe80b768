"""The full default configuration and its validation.

Every experiment file in ``experiments/`` starts from :func:`get_default_config` and
overrides what it needs, so every key below exists in every resolved config and can be set
from the command line (``--config.model.num_layers=2``). Groups: ``model``, ``data``,
``train``, ``eval``, ``mesh``, ``checkpoint``.

The maths behind the ``model`` options is in ``CEM_MATH.md`` (section numbers given per key).

Besides the defaults and :func:`validate` (with the per-field rules the tools reuse:
:func:`check_int`, :func:`check_flag`, :func:`check_range`, ...), a saved run's config read
back and compared (jax-free, as the whole module): :func:`flat`, :func:`from_saved`,
:func:`changes` (what a resume logs), :func:`run_changes` (another run: ``tables``,
``launch/sweep.py``) and :func:`model_changes` (another model: a resume refused), with the keys
they leave out (:data:`RESUME_MAY_CHANGE`, :data:`COMPUTE_ONLY`, :data:`OBSERVE_ONLY`).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import types
from collections.abc import Collection

import ml_collections

from cem_jax import axes

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
REMAT_POLICIES = ("none", "full", "dots")  # cem_jax/model.py
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash")  # cem_jax/attention.py
BUILTINS = ("pydoc", "pydoc+docstrings")  # cem_jax/data/builtin.py
TOKENIZER_MODEL_TYPES = ("bpe", "unigram")  # cem_jax/data/tokenizer.py
# mesh.rules default (logical axis -> mesh axes): see axes.py.
DEFAULT_MESH_RULES = axes.DEFAULT_RULES


def get_default_config() -> ml_collections.ConfigDict:
  """Returns the default config: the tiny CEM model of ``experiments/tiny.py``.

  d_model 128, 4 layers, 4 heads, mlp_dim 512, seq_len 128, a 1024-piece BPE trained on the
  built-in corpus (CPython's pydoc topics + stdlib docstrings; held out: the last 10% of the
  pydoc topics), 1000 steps of batch 16: 5–13 minutes on 2 CPU cores (README).
  """
  c = ml_collections.ConfigDict()

  c.seed = 0  # the parameters' initialisation (data order: data.shuffle_seed)

  # ---- model -------------------------------------------------------------------------------
  m = c.model = ml_collections.ConfigDict()
  m.block = "cem"  # 'cem' | 'llama'
  m.d_model = 128
  m.num_heads = 4
  m.head_dim = -1  # -1: d_model // num_heads
  m.mlp_dim = 512
  m.num_layers = 4
  m.tie_embeddings = True  # the output layer is the embedding table's transpose
  m.rope = True  # rotary position embedding of queries and keys
  m.rope_theta = 10_000.0
  m.norm_eps = 1e-6  # RMSNorm's epsilon
  # True: in a packed window a token sees only its own document (an explicit [b, n, n] mask).
  # False: plain causal attention over the whole window (nanoGPT/nanodo), which lets fused
  # kernels use is_causal (cuDNN flash attention on GPU, no n x n mask in memory). The loss
  # never crosses a document boundary either way (data/packing.py weights).
  m.document_mask = True
  m.dtype = "float32"  # compute dtype: 'float32' | 'bfloat16'
  # Parameters and optimizer state: 'float32' only. bfloat16 is refused: the optimizer would
  # update bfloat16 weights with no float32 master copy, and small updates would round away.
  m.param_dtype = "float32"
  m.init_std = 0.02  # std of the normal initialisation of every weight matrix and embedding
  # Multiplies the looked-up input embedding (not the tied output layer). Gemma uses
  # sqrt(d_model); with a block reused across layers it keeps the first layer's pre-norm updates
  # from burying the token's identity (docs/REPRODUCING.md, neighbours).
  m.embed_scale = 1.0
  # CEM options (CEM_MATH.md sections 1-5).
  m.cem_attention = True  # False: the standard untied attention inside a CEM block (controls)
  m.cem_mlp = True  # False: the standard SwiGLU inside a CEM block (controls)
  m.update_mode = "auto"  # 'auto' (fused where a closed form exists) | 'fused' | 'autodiff'
  m.attention_energy = "softmax"  # registry name, 'package.module:function' or 'file.py:function'
  m.mlp_energy = "silu"  # registry name, 'package.module:function' or 'file.py:function'
  m.strict_causal = False  # N(i) = {j < i} instead of {j <= i} (section 1)
  m.learn_beta = False  # learnable inverse temperature (then eta is fixed, section 1)
  m.learn_eta = True  # per-head (attention) / scalar (MLP) step sizes, softplus
  # The learned step sizes' starting value (every head, step and sub-layer). 1 / num_steps
  # makes T steps move a token as far as one step does at initialisation (section 4).
  m.eta_init = 1.0
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
  # Attention kernel of the Llama block, the fused CEM update (cem_jax/attention.py):
  # 'auto' (CPU: xla; GPU bf16: cudnn; TPU: splash; the per-head diagonal: xla) | 'xla' |
  # 'cudnn' | 'splash'. The model logs one line with its choice and why; an explicit choice
  # that cannot run is an error at start-up.
  m.attention_impl = "auto"
  # Query and key block of the interaction energy's online log-sum-exp (0 = dense scores):
  # jax.grad of the energy (update_mode='autodiff'), and training through it, then need
  # memory linear in seq_len.
  m.energy_block_size = 0

  # ---- data --------------------------------------------------------------------------------
  d = c.data = ml_collections.ConfigDict()
  d.files = ""  # glob(s) of local text files, comma separated; '' = another source
  d.tfds_name = ""  # TFDS catalog dataset, e.g. 'wikipedia/20230601.en'; needs internet
  d.tfds_data_dir = ""  # '' = TFDS default (~/tensorflow_datasets)
  d.tfds_text_key = "text"  # the feature holding the text
  d.tfds_train_split = "train"  # TFDS split specs, e.g. 'train[:99%]'
  d.tfds_eval_split = "validation"
  d.builtin = "pydoc+docstrings"  # built-in offline corpus: 'pydoc' | 'pydoc+docstrings'
  # Fraction of the characters held out (builtin and files sources). Files: every k-th chunk,
  # k = round(1 / fraction), of chunks of <= 16,384 characters cut after a paragraph break
  # (data/text.py interleave_split), so the held-out text samples the whole corpus, not its
  # tail (e-texts end in licence text). Builtin: the tail of the pydoc topics (the text the
  # README's byte 4-gram reference is scored on).
  d.validation_fraction = 0.1
  d.seq_len = 128  # tokens per training window (inputs; the targets are the next tokens)
  d.vocab_size = 1024
  d.tokenizer = ""  # path to a sentencepiece .model; '' = train one on the train split
  d.tokenizer_model_type = "bpe"  # 'bpe' | 'unigram'
  d.shuffle_seed = 0  # the order of the training windows (a pure function of it and the step)
  # Folder made by `python -m cem_jax.prepare --out=DIR` (token shards + manifest): train from
  # it, reading no raw text. '' = prepare into WORKDIR/data/<fingerprint> first (process 0;
  # reused while the text and the keys above are unchanged). data.files/tfds_name may then
  # be left '': the folder is the source; set, they must match it, as vocab_size must.
  d.prepared_dir = ""

  # ---- train -------------------------------------------------------------------------------
  t = c.train = ml_collections.ConfigDict()
  t.num_steps = 1000
  t.batch_size = 16  # global batch, sequences
  # The global batch runs as this many microbatches of batch_size / k rows, one after another
  # inside the step, their gradients summed: one update of the same batch and loss (the
  # token-weighted mean over the whole batch) in 1/k of the activation memory.
  t.gradient_accumulation_steps = 1
  # The output layer and cross-entropy run over blocks of this many positions (training and
  # evaluation), each block's logits made again in the backward pass: [batch, block,
  # vocab_size] logits live at once, not [batch, seq_len, vocab_size]. 0 = all at once.
  # Must divide data.seq_len.
  t.loss_block_size = 0
  t.learning_rate = 3e-3  # the peak of the schedule (AdamW)
  # Cosine decays to this fraction of the peak. Unread when warmup_steps >= num_steps (the run
  # ends before the decay) and still accepted there: a config file is tried with a short run.
  t.min_learning_rate_ratio = 0.1
  t.warmup_steps = 50  # linear up to learning_rate, then cosine (optim.make_schedule)
  t.weight_decay = 0.1  # decoupled (AdamW), on the parameters optim.decay_mask names
  t.b1 = 0.9  # AdamW's first-moment decay
  t.b2 = 0.95  # AdamW's second-moment decay
  t.grad_clip = 1.0  # the gradient's global norm is clipped to this
  t.eval_every_steps = 100  # and at the last step
  t.log_every_steps = 10  # train/* lines in metrics.jsonl and the log
  # A step whose loss or gradient is not finite is skipped (parameters and optimizer state
  # kept); this many in a row end the run with a FloatingPointError.
  t.max_consecutive_nonfinite = 10
  # A jax profiler trace of this many training steps (process 0) into WORKDIR/tensorboard, from
  # step profile_first_step on (1-based; past the first steps' one-time costs). 0 = none
  # (profile_first_step, then unread, may keep a config file's value: one flag turns it off).
  # Changes nothing computed: tables and resumes ignore both (OBSERVE_ONLY).
  t.profile_steps = 0
  t.profile_first_step = 5

  # ---- eval --------------------------------------------------------------------------------
  e = c.eval = ml_collections.ConfigDict()
  e.batch_size = 32  # global batch, sequences
  e.max_batches = -1  # -1: the whole validation split
  e.num_steps = -1  # recursive steps T at eval; -1 = model.num_steps (test-time steps)
  # Log eval/energy/layer{l}/step{t}/... CEM models with an energy step only: a Llama model, or
  # a CEM block with cem_attention=cem_mlp=False, has no energy to trace and logs none either
  # way (not refused: the default is True, and refusing it would refuse every such config).
  e.energy_trace = True

  # ---- mesh --------------------------------------------------------------------------------
  h = c.mesh = ml_collections.ConfigDict()
  # data x fsdp x tensor = the devices of all processes (one size may be -1: the rest).
  h.data = -1  # -1: take the devices left over
  h.fsdp = 1  # parameters and optimizer state sharded over it (ZeRO-3 style), batch too
  h.tensor = 1  # heads, MLP width and vocabulary split over it (must divide them)
  h.rules = DEFAULT_MESH_RULES  # ((logical_axis, mesh_axis | None | (mesh_axes...)), ...)

  # ---- checkpoint --------------------------------------------------------------------------
  k = c.checkpoint = ml_collections.ConfigDict()
  k.every_steps = 250  # and at the last step
  k.keep = 3  # the newest checkpoints kept (older ones deleted after each save)
  k.async_save = True  # write in the background while training goes on
  # Fine-tuning / continued pre-training: start from another run's parameters. Its --workdir
  # (its newest intact checkpoint) or one step folder of it (WORKDIR/checkpoints/<step>).
  # Read at a fresh start only (--workdir holds no checkpoint): the parameters are restored
  # onto this run's mesh, and the optimizer state, the step (0), the schedule and the data
  # order start afresh. A run resuming its own checkpoint ignores it (logged): a preempted
  # fine-tune goes on from its own step, not from the source. Refused (one line, before
  # anything compiles): no intact checkpoint there; another data.vocab_size or tokenizer;
  # any parameter of another shape or path. Model fields that change no shape (num_steps,
  # energies, attention_impl...) are logged. Each checkpoint records the source (its step
  # folder, step and digest: meta parameters_from). '' = initialise from `seed`.
  k.load_parameters_from = ""

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
    "model.remat": REMAT_POLICIES,
    "model.attention_impl": ATTENTION_IMPLEMENTATIONS,
    "data.builtin": BUILTINS,
    "data.tokenizer_model_type": TOKENIZER_MODEL_TYPES,
}

# The type every bool and str field must hold, named as the refusal states it. ConfigDict
# lets a config file store None in any field, and an int in a bool one: `c.model.rope = None`
# would train without RoPE, `c.data.tokenizer = None` train a tokenizer, both silently.
# (Choice fields are checked against their choices first; ints and floats by the rules below.)
_TYPE_NAMES = {bool: "True or False", str: "a string"}

# field -> (minimum allowed, inclusive)
_MINIMUMS = {
    "seed": 0,  # numpy's generators (data order) take no negative seed
    "data.shuffle_seed": 0,
    "model.d_model": 1,
    "model.num_heads": 1,
    "model.mlp_dim": 1,
    "model.num_layers": 1,
    "model.num_steps": 1,
    "model.precond_rank": 0,
    "model.energy_block_size": 0,
    "data.seq_len": 2,
    "data.vocab_size": 8,
    "train.num_steps": 1,
    "train.batch_size": 1,
    "train.gradient_accumulation_steps": 1,
    "train.loss_block_size": 0,
    "train.warmup_steps": 0,
    "train.eval_every_steps": 1,
    "train.log_every_steps": 1,
    "train.max_consecutive_nonfinite": 1,
    "train.profile_steps": 0,
    "train.profile_first_step": 1,
    "eval.batch_size": 1,
    "checkpoint.every_steps": 1,
    "checkpoint.keep": 1,
}


# field -> (exclusive upper bound, as the message writes it): ints that reach jax as fixed-width
# integers, where a larger one was an OverflowError traceback after the data was built, and
# model.num_steps. Each is a _MINIMUMS field too: check_int reads both.
_BELOW = {
    # The recursive steps are a Python loop (layers/cem.py), unrolled into the traced program:
    # 10**9 passed validation, then traced for ever. One tiny CEM layer's eval step on a CPU
    # (d_model 64, 2 x 64 tokens) traces in ~30 ms a step and compiles in 1.7 s at T = 16,
    # 45 s at 256, 254 s at 512 (XLA's time grows faster than T; training adds the backward
    # pass). 2**8 is 32x the most any config, doc or experiment uses (T = 8) and still starts
    # within a minute or so a layer; the same rule bounds the test-time steps
    # (eval.num_steps, evaluate --num_steps, DecoderLM's num_steps).
    "model.num_steps": (2**8, "2**8 (every step is unrolled into the compiled program)"),
    # jax keys take a signed 64-bit seed
    "seed": (2**63, "2**63"),
    "data.shuffle_seed": (2**63, "2**63"),
    # optax.apply_if_finite counts in int32 and is given the value + 1 (optim.make_optimizer)
    "train.max_consecutive_nonfinite": (2**31 - 1, "2**31 - 1"),
    # optax counts applied updates in int32; its schedule compares that count with the warmup
    # (2**31 and up was an OverflowError in the first step) and the decay's length
    "train.warmup_steps": (2**31, "2**31"),
    "train.num_steps": (2**31, "2**31"),
    # token ids are int32 (the data's windows, the embedding's lookup), and SentencePiece
    # takes its vocab_size as an int32: 2**31 was its "cannot parse as int" in the tokenizer's
    # training, and inspect --vocab_size printed a table for any size
    "data.vocab_size": (2**31, "2**31"),
}


# field -> (what -1 means, the largest allowed value or None): an int >= 1, or -1 for a value
# derived from others. model.num_unique_blocks's maximum is model.num_layers.
_MINUS_ONE_OR_POSITIVE = {
    "model.head_dim": ("= model.d_model // model.num_heads", None),
    "model.num_unique_blocks": ("= model.num_layers", "model.num_layers"),
    "eval.max_batches": ("the whole split", None),
    "eval.num_steps": ("= model.num_steps", None),
}

# field of _MINUS_ONE_OR_POSITIVE -> the _MINIMUMS field whose rule (allowed_int) its values
# other than -1 follow: the steps T run at eval are model.num_steps's quantity.
_POSITIVE_AS = {"eval.num_steps": "model.num_steps"}


# field -> (low, low inclusive, high, high inclusive): a finite real number in that interval
# (None: unbounded). One rule per numeric float key of the defaults.
_RANGES = {
    "model.rope_theta": (0.0, False, None, False),
    "model.norm_eps": (0.0, False, None, False),
    "model.init_std": (0.0, False, None, False),
    "model.embed_scale": (0.0, False, None, False),
    # float32 softplus keeps eta (and its gradient) alive in this range; below ~1e-38 it
    # underflows to a dead 0, and a step 1000x the gradient is no descent step.
    "model.eta_init": (1e-6, True, 1e3, True),
    # P = diag(softplus(p) + eps) + U U^T starts at I: softplus(p) = 1 - eps needs eps < 1,
    # and eps > 0 keeps P positive definite (CEM_MATH.md section 3).
    "model.precond_eps": (0.0, False, 1.0, False),
    # the learned momentum mu = sigmoid(raw) starts here: 0 and 1 are the sigmoid's limits.
    "model.momentum_init": (0.0, False, 1.0, False),
    "train.learning_rate": (0.0, False, None, False),
    "train.min_learning_rate_ratio": (0.0, True, 1.0, True),
    "train.weight_decay": (0.0, True, None, False),
    "train.b1": (0.0, True, 1.0, False),
    "train.b2": (0.0, True, 1.0, False),
    # 0 would scale every update to nothing, a negative norm turns descent into ascent.
    "train.grad_clip": (0.0, False, None, False),
    # The files source holds out every k-th chunk, k = round(1 / fraction): k = 1 (above 0.5)
    # would hold out everything. data/text.py's splitters check it with this rule too.
    "data.validation_fraction": (0.0, False, 0.5, True),
}


# The largest finite float32 (numpy.finfo(numpy.float32).max): the _RANGES values are used in
# float32 (the schedule, the norms, the init), where a larger one is inf. norm_eps=1e300 trained
# a constant model at loss ln(vocab_size), rope_theta=1e300 rotated one frequency pair of each
# head (inf ** -x = 0), both silently.
FLOAT32_MAX = 3.4028234663852886e38


def _interval(low, low_in, high, high_in) -> str:
  left = "" if low is None else f"{low:g} {'<=' if low_in else '<'} "
  right = "" if high is None else f" {'<=' if high_in else '<'} {high:g}"
  return f"{left}value{right}" if left or right else "any finite number"


def _unwritable(value) -> bool:
  """Whether ``value`` is an int longer than Python's int -> str limit
  (``sys.get_int_max_str_digits()``, 4300 digits by default; 0: none), which ``repr``,
  ``str`` and ``json.dumps`` refuse with ValueError."""
  if isinstance(value, bool) or not isinstance(value, int):
    return False
  try:
    repr(value)
  except ValueError:
    return True
  return False


def shown(value) -> str:
  """``repr(value)``, as a refusal names a field's value; an int longer than Python's int -> str
  limit (:func:`_unwritable`, where ``repr`` raises ValueError and the refusal could not be
  worded) as ``an int of N digits``."""
  if not _unwritable(value):
    return repr(value)
  n = abs(value)
  # 10**digits <= n < 10**(digits + 1) for one of these two, without a string of n
  digits = int(n.bit_length() * math.log10(2))
  digits += n >= 10**digits
  return f"{'a negative' if value < 0 else 'an'} int of {digits} digits"


def allowed_int(field: str) -> str:
  """What :func:`check_int` allows for ``field``, as its refusal words it: ``an int >= 1``,
  ``an int >= 0 and < 2**63`` (:data:`_MINIMUMS`, :data:`_BELOW`). For a check of a value
  given under another name (a flag, a function's argument) that follows the field's rule."""
  bound_text = _BELOW.get(field, (None, None))[1]
  return f"an int >= {_MINIMUMS[field]}" + (f" and < {bound_text}" if bound_text else "")


def is_allowed_int(field: str, value) -> bool:
  """Whether ``value`` is what :func:`check_int` allows for ``field``: a Python ``int`` (not a
  bool, a float or a numpy integer, which ``config.json`` could not hold) >= its minimum in
  :data:`_MINIMUMS` and, where it has one, below its bound in :data:`_BELOW`."""
  return _is_int_from(value, _MINIMUMS[field], _BELOW.get(field, (None, ""))[0])


def _is_int_from(value, minimum: int, bound: int | None = None) -> bool:
  """Whether ``value`` is a Python ``int`` (not a bool) >= ``minimum`` and < ``bound``."""
  return (not isinstance(value, bool) and isinstance(value, int) and value >= minimum
          and (bound is None or value < bound))


def check_int(field: str, value, name: str | None = None) -> None:
  """Checks one integer field as :func:`is_allowed_int` does. ``name``: what the refusal calls
  the value (a flag that stands for the field, e.g. ``--batch_size``; default ``field``).

  Raises:
    ValueError: one line naming the field (or ``name``), the value (:func:`shown`: an int of
      over 4300 digits by its digit count) and what is allowed (:func:`allowed_int`), e.g.
      ``seed=-1; allowed: an int >= 0 and < 2**63``.
  """
  if not is_allowed_int(field, value):
    raise ValueError(f"{name or field}={shown(value)}; allowed: {allowed_int(field)}")


def check_writable(name: str, value) -> None:
  """Refuses an int longer than Python's int -> str limit (:func:`_unwritable`), which the
  rules without an upper bound let through: a message or ``config.json`` writing it later
  failed with int -> str's ValueError, naming nothing. ``name``: the field or flag.

  Raises:
    ValueError: ``NAME=an int of N digits; allowed: an int of at most 4300 digits (...)``.
  """
  if _unwritable(value):
    raise ValueError(f"{name}={shown(value)}; allowed: an int of at most "
                     f"{sys.get_int_max_str_digits()} digits (Python's int -> str limit: "
                     "config.json and the messages write it in decimal)")


def check_flag(name: str, field: str, value) -> None:
  """Checks a command-line flag that stands for the config field ``field`` (evaluate's
  ``--max_batches`` for ``eval.max_batches``, tables' ``--steps`` for ``train.num_steps``) by
  that field's rule (:func:`check_int`, :func:`check_minus_one_or_positive` without its
  maximum, :func:`check_range`) and, an int, by :func:`check_writable`, as
  :func:`validate` checks the field; the refusal names ``name``.

  Raises:
    ValueError: one line naming ``name``, the value and what is allowed.
  """
  if field in _MINUS_ONE_OR_POSITIVE:
    check_minus_one_or_positive(field, value, name=name)
  elif field in _RANGES:
    check_range(field, value, name)
  else:
    check_int(field, value, name)
  check_writable(name, value)


def check_count(name: str, value, minimum: int = 1) -> None:
  """Checks a command-line flag that counts something no config field holds (sample's
  ``--max_new_tokens``, tables' ``--seeds``, prepare's ``--workers``): a Python ``int`` >=
  ``minimum`` that Python can write in decimal (:func:`check_writable`).

  Raises:
    ValueError: one line, e.g. ``--seeds=0; allowed: an int >= 1``.
  """
  if not _is_int_from(value, minimum):
    raise ValueError(f"{name}={shown(value)}; allowed: an int >= {minimum}")
  check_writable(name, value)


def vocab_size(config: ml_collections.ConfigDict, flag: int | None) -> int:
  """The vocabulary size a tool that builds no tokenizer sizes the model with: ``--vocab_size``
  (``flag``) when given, else ``config.data.vocab_size``.

  Raises:
    ValueError: ``flag`` not as ``data.vocab_size`` allows (:func:`check_flag`), one line naming
      ``--vocab_size``.
  """
  if flag is None:
    return config.data.vocab_size
  check_flag("--vocab_size", "data.vocab_size", flag)
  return flag


def check_minus_one_or_positive(field: str, value, high: int | None = None,
                                name: str | None = None) -> None:
  """Checks one field of :data:`_MINUS_ONE_OR_POSITIVE`: a Python ``int`` that is -1 (the
  value derived from others) or >= 1, and at most ``high`` (the value of the field the table
  names as its maximum) where it has one, or as :func:`check_int` allows the field
  :data:`_POSITIVE_AS` names for it. ``name``: as :func:`check_int`'s.

  Raises:
    ValueError: one line naming the field (or ``name``), the value and what is allowed, e.g.
      ``eval.max_batches=0; allowed: -1 (the whole split) or an int >= 1``.
  """
  meaning, most = _MINUS_ONE_OR_POSITIVE[field]
  is_int = not isinstance(value, bool) and isinstance(value, int)
  rule = _POSITIVE_AS.get(field)
  if rule is not None:
    ok, ints = is_allowed_int(rule, value), allowed_int(rule)
  else:
    ok = is_int and 1 <= value and (high is None or value <= high)
    ints = "an int >= 1" if high is None else f"an int in 1..{shown(high)} ({most})"
  if not is_int or not (value == -1 or ok):
    raise ValueError(f"{name or field}={shown(value)}; allowed: -1 ({meaning}) or {ints}")


def check_range(field: str, value, name: str | None = None) -> None:
  """Checks one numeric field against :data:`_RANGES`. ``name``: as :func:`check_int`'s.

  Raises:
    ValueError: one line naming the field (or ``name``), the value and the allowed interval;
      also for nan, inf, non-numbers and numbers beyond float32's range (:data:`FLOAT32_MAX`).
  """
  low, low_in, high, high_in = _RANGES[field]
  allowed = f"allowed: a finite number, {_interval(low, low_in, high, high_in)}"
  # An int is finite (math.isfinite of one beyond float64's range raised OverflowError), and
  # Python compares it with the bounds exactly.
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (
      isinstance(value, float) and not math.isfinite(value)):
    raise ValueError(f"{name or field}={shown(value)}; {allowed}")
  below = low is not None and (value < low or (value == low and not low_in))
  above = high is not None and (value > high or (value == high and not high_in))
  if below or above:
    raise ValueError(f"{name or field}={shown(value)}; {allowed}")
  if abs(value) > FLOAT32_MAX:
    raise ValueError(f"{name or field}={shown(value)} is infinite in float32, the precision it is "
                     f"used in; {allowed}, at most {FLOAT32_MAX:.7g}")


# Options that build or change nothing in some configurations: (condition on the config,
# why, dotted keys that must then keep their default). A non-default value there would be
# silently ignored, so validation refuses it.
_CEM_ONLY = ("cem_attention", "cem_mlp", "update_mode", "attention_energy", "mlp_energy",
             "learn_beta", "learn_eta", "eta_init", "diagonal", "diagonal_form", "precond",
             "precond_rank", "precond_eps", "precond_shared", "num_steps", "context", "split",
             "eta_per_step", "mlp_condition", "norm_mode", "energy_block_size", "inner_optimizer",
             "momentum_init", "manifold")
_TFDS_KEYS = ("tfds_data_dir", "tfds_text_key", "tfds_train_split", "tfds_eval_split")
_model = lambda keys: tuple(f"model.{k}" for k in keys)
_data = lambda keys: tuple(f"data.{k}" for k in keys)
_UNUSED = (
    (lambda c: c.model.block == "llama",
     "with model.block='llama' (it applies to CEM blocks only)",
     (*_model(_CEM_ONLY), "eval.num_steps")),
    (lambda c: c.model.block == "cem" and not c.model.cem_attention,
     "with model.cem_attention=False (the standard attention has no energy)",
     _model(("attention_energy", "learn_beta", "diagonal", "context", "energy_block_size"))),
    (lambda c: c.model.block == "cem" and not c.model.cem_mlp,
     "with model.cem_mlp=False (the standard SwiGLU has no energy)",
     _model(("mlp_energy", "mlp_condition"))),
    (lambda c: c.model.block == "cem" and not (c.model.cem_attention or c.model.cem_mlp),
     "with model.cem_attention=False and model.cem_mlp=False (no energy step)",
     _model(("update_mode", "learn_eta", "eta_init", "eta_per_step"))),
    (lambda c: c.model.block == "cem" and not (c.model.cem_attention or c.model.cem_mlp)
     and c.model.norm_mode == "chain",
     "with model.cem_attention=False and model.cem_mlp=False ('chain' differentiates an "
     "energy step through its norm; the standard sub-layers take the normalised input)",
     ("model.norm_mode",)),
    (lambda c: c.model.block == "cem" and not c.model.learn_eta,
     "with model.learn_eta=False (the step size is then fixed at 1)",
     _model(("eta_init", "eta_per_step"))),
    (lambda c: c.model.diagonal == "none", "with model.diagonal='none'",
     ("model.diagonal_form",)),
    (lambda c: c.model.inner_optimizer == "gd", "with model.inner_optimizer='gd' (no velocity)",
     ("model.momentum_init",)),
    (lambda c: c.model.precond == "none", "with model.precond='none'",
     _model(("precond_eps", "precond_shared"))),
    # T=1 has one step: one set of per-step parameters either way (later test-time steps
    # reuse the last trained step's).
    (lambda c: c.model.num_steps == 1, "with model.num_steps=1 (one step: nothing per step)",
     _model(("eta_per_step", "precond_shared"))),
    (lambda c: not c.model.rope, "with model.rope=False", ("model.rope_theta",)),
    (lambda c: bool(c.data.tokenizer),
     "with data.tokenizer set (the given model is used as it is, not trained)",
     ("data.tokenizer_model_type",)),
    (lambda c: bool(c.data.files or c.data.tfds_name),
     "with data.files or data.tfds_name set (the built-in corpus is not read)",
     ("data.builtin",)),
    (lambda c: not c.data.tfds_name, "without data.tfds_name", _data(_TFDS_KEYS)),
    (lambda c: bool(c.data.tfds_name),
     "with data.tfds_name (the catalog's own splits are used)", ("data.validation_fraction",)),
)


def _check_unused(config: ml_collections.ConfigDict) -> None:
  m, defaults = config.model, get_default_config()
  for applies, why, keys in _UNUSED:
    if not applies(config):
      continue
    for key in keys:
      value, default = config[key], defaults[key]
      if value == default:
        continue
      if m.block == "llama" and key.startswith("model."):  # the message llama users know
        raise ValueError(f"{key}={value!r} applies to CEM blocks only; "
                         f"model.block='llama' needs {key}={default!r}")
      raise ValueError(f"{key}={value!r} has no effect {why}; leave it at {default!r}")
  targets = {"attention": m.cem_attention, "mlp": m.cem_mlp}
  wanted = ("attention", "mlp") if m.precond == "both" else (m.precond,)
  for target in wanted:
    if m.block == "cem" and target in targets and not targets[target]:
      raise ValueError(f"model.precond={m.precond!r} preconditions an energy step that "
                       f"model.cem_{target}=False replaces; choose another model.precond")


def flat(config: ml_collections.ConfigDict | dict) -> dict:
  """A config (a ``ConfigDict``, or the nested dict ``config.json`` or a checkpoint holds) as
  one dict with dotted keys (``{"model": {"d_model": 64}}`` -> ``{"model.d_model": 64}``).

  Values are as JSON stores them (tuples such as ``mesh.rules`` become lists), so that a
  config read back from disk compares equal to the live one it was written from.
  """
  tree = json.loads(config.to_json() if isinstance(config, ml_collections.ConfigDict)
                    else json.dumps(config))
  out = {}

  def walk(node: dict, prefix: str) -> None:
    for k, v in node.items():
      if isinstance(v, dict):
        walk(v, f"{prefix}{k}.")
      else:
        out[f"{prefix}{k}"] = v

  walk(tree, "")
  return out


# Keys a resumed run may change: how the model is computed (another machine's kernel,
# precision or memory policy; the blockwise log-sum-exp is tested equal to the dense one) and
# values read only when parameters are initialised (the restore replaces what they made).
# Every other model.* key defines the model. Not update_mode: a user's closed form is checked
# at start-up by its values only, so fused and autodiff may train differently.
RESUME_MAY_CHANGE = ("model.attention_impl", "model.dtype", "model.remat",
                     "model.energy_block_size", "model.init_std", "model.eta_init",
                     "model.momentum_init")
# Keys that change how a run is computed, not its numbers (equal up to float rounding:
# tests/test_attention.py, test_accumulation.py, test_loss.py): a table reuses a finished run
# whatever they are, e.g. one trained without gradient accumulation for a row run with it.
COMPUTE_ONLY = ("model.attention_impl", "model.remat", "model.energy_block_size",
                "train.gradient_accumulation_steps", "train.loss_block_size")
# Keys that change what is recorded about a run, nothing it computes: a table reuses a finished
# run whatever they are, and a resume does not mention them.
OBSERVE_ONLY = ("train.profile_steps", "train.profile_first_step")


# The fields that name an energy: a registry name, 'package.module:function' or
# 'path/to/file.py:function'.
ENERGY_KEYS = ("model.attention_energy", "model.mlp_energy")


def energy_file_name(name: str) -> str:
  """A ``model.*_energy`` value with a ``'path/to/file.py:function'`` path cut to its file
  name (``'file.py:function'``): the same file in another checkout, or on another host, is
  the same energy by name (its content is compared by ``energies.source_digest``); registry
  names and ``'package.module:function'`` are returned unchanged."""
  module, sep, function = str(name).rpartition(":")
  if sep and module.endswith(".py"):
    return f"{os.path.basename(module)}:{function}"
  return name


def _model_identity(values: dict) -> dict:
  """A flat config's ``model.*`` values as the model they make: ``-1`` sizes resolved, and an
  energy file named by its file name (the same file from another checkout is the same energy;
  its content is compared from the checkpoint's digests, ``energies.source_digest``)."""
  out = {k: v for k, v in values.items() if k.startswith("model.")}
  model = types.SimpleNamespace(**{k[len("model."):]: v for k, v in out.items()})
  out["model.head_dim"] = axes.head_dim_of(model)
  if out["model.num_unique_blocks"] == -1:
    out["model.num_unique_blocks"] = out["model.num_layers"]
  for key in ENERGY_KEYS:
    out[key] = energy_file_name(out[key])
  return out


def from_saved(saved: dict, where: str) -> ml_collections.ConfigDict:
  """The config a run was trained with, from its saved form (a checkpoint's or
  ``config.json``'s nested dict, named ``where`` in errors): the defaults updated with it, so
  the keys it predates keep their defaults (the old behaviour).

  Raises:
    ValueError: ``saved`` is not a JSON object, has fields this version of cem_jax does not
      know, or a value of another type than its field's (one line naming ``where``).
  """
  check_saved(saved, where)
  config = get_default_config()
  unknown = sorted(set(flat(saved)) - set(flat(config)))
  if unknown:
    raise ValueError(f"{where}: config fields {', '.join(unknown)} are unknown to this "
                     "version of cem_jax; use the version that trained it")
  try:
    config.update(saved)
  except (TypeError, ValueError, AttributeError) as e:  # ml_collections: a value of another type
    raise ValueError(f"{where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}; "
                     "allowed: the config the run saved, each value of its field's type") from None
  return config


def check_saved(saved, where: str) -> None:
  """Refuses a saved config (a run's ``config.json``, named ``where``) that is not a JSON
  object: read as one, a list or a number was an AttributeError traceback.

  Raises:
    ValueError: one line naming ``where`` and what it holds.
  """
  if not isinstance(saved, dict):
    raise ValueError(f"{where} holds a JSON {type(saved).__name__}, not a config; allowed: "
                     "the JSON object of config groups a run saves")


def with_defaults(saved: ml_collections.ConfigDict | dict) -> dict:
  """A saved config (a checkpoint's or ``config.json``'s) as a flat dict (:func:`flat`), the
  keys it predates at their defaults: a new key's default keeps the old behaviour."""
  return {**flat(get_default_config()), **flat(saved)}


class _Removed:
  """A key only a saved config has (removed since), as :func:`changes` writes it: ``(none)``
  unquoted, where a string value is quoted; equal to no value (the string '(none)' included)."""

  def __repr__(self) -> str:
    return "(none)"


def changes(saved: ml_collections.ConfigDict | dict, now: ml_collections.ConfigDict | dict,
            ignored: Collection[str] = (), by_file_name: Collection[str] = ()
            ) -> dict[str, str]:
  """The keys in which a run's saved config (a checkpoint's or ``config.json``'s) and ``now``
  differ, each with its ``"key: old -> new"`` text, in key order; ``ignored`` keys left out.

  A key ``saved`` predates compares at its default (new options default to the old
  behaviour); a key only ``saved`` has (removed since) differs, as ``(none)`` now. Keys in
  ``by_file_name`` (comma-separated paths) compare by their files' names.
  """

  def values(config) -> dict:
    out = {k: v for k, v in config.items() if k not in ignored}
    for k in by_file_name:
      if out.get(k):
        out[k] = ",".join(os.path.basename(p) for p in out[k].split(","))
    return out

  old, new = values(with_defaults(saved)), values(flat(now))
  missing = _Removed()
  return {k: f"{k}: {old.get(k, missing)!r} -> {new.get(k, missing)!r}"
          for k in sorted(set(old) | set(new)) if old.get(k, missing) != new.get(k, missing)}


def run_changes(saved: ml_collections.ConfigDict | dict,
                now: ml_collections.ConfigDict | dict) -> list[str]:
  """The keys in which two configs train different runs, as ``"key: old -> new"`` strings,
  sorted (empty: the same run); ``saved`` is a run's ``config.json`` (a nested dict), ``now``
  the config it would be trained or resumed with (compared as :func:`changes` does).

  Left out: :data:`COMPUTE_ONLY` and :data:`OBSERVE_ONLY`; ``data.files`` compares by file
  name (the same corpus seen from another checkout or machine).
  """
  return list(changes(saved, now, COMPUTE_ONLY + OBSERVE_ONLY, ("data.files",)).values())


def model_changes(saved: ml_collections.ConfigDict | dict,
                  now: ml_collections.ConfigDict | dict) -> list[str]:
  """The ``model.*`` keys that define the model and differ between two configs, as
  ``"key: old -> new"`` strings, sorted; keys in :data:`RESUME_MAY_CHANGE` are left out, and
  values are compared as the model they make (:func:`_model_identity`).

  ``saved`` is a checkpoint's resolved config (``meta["config"]``), ``now`` the config of the
  run resuming from it (a ``ConfigDict`` or the nested dict ``config.json`` holds). A key the
  checkpoint predates is compared at its default (a new key's default keeps the old model); a
  key only the checkpoint has (removed since) is not compared.
  """
  raw_old, raw_new = with_defaults(saved), flat(now)
  old, new = _model_identity(raw_old), _model_identity(raw_new)
  # A size -1 in both is no change of its own: the key it follows is listed (num_layers 4 -> 2
  # alone, not also num_unique_blocks 4 -> 2, a key the user never set).
  derived = lambda k: raw_old.get(k) == raw_new.get(k) == -1
  keys = sorted(k for k in new if k not in RESUME_MAY_CHANGE and not derived(k))
  return [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in keys if old.get(k) != new[k]]


def check_loss_block_size(block_size, seq_len: int) -> None:
  """The rule of ``train.loss_block_size`` (:func:`cem_jax.loss.blockwise_cross_entropy`): an
  int >= 0 that, unless 0, divides ``seq_len`` (``data.seq_len``, or the length of the array
  a direct caller passes).

  Raises:
    ValueError: one line naming the value and what is allowed.
  """
  if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or (
      block_size < 0):
    raise ValueError(f"train.loss_block_size={shown(block_size)}; allowed: an int >= 0 "
                     "(0 = all positions at once)")
  if block_size and seq_len % block_size:
    raise ValueError(f"train.loss_block_size={block_size} does not divide "
                     f"data.seq_len={seq_len}; allowed: 0 (all positions at once) or a "
                     "divisor of data.seq_len")


def absolute_energy_name(name: str) -> str:
  """``name`` (an energy of ``model.attention_energy`` or ``model.mlp_energy``) with a relative
  ``'path/to/file.py:function'`` path made absolute; registry names and
  ``'package.module:function'`` are returned unchanged.

  A run's saved config then names the same file from any working directory (``evaluate``,
  ``sample`` and ``tables`` reload the energy from it).
  """
  module_name, sep, fn_name = name.rpartition(":")
  if sep and module_name.endswith(".py") and not os.path.isabs(module_name):
    return f"{os.path.abspath(module_name)}:{fn_name}"
  return name


def absolute_energy_paths(model_config: ml_collections.ConfigDict) -> None:
  """Rewrites ``model.attention_energy`` and ``model.mlp_energy`` with
  :func:`absolute_energy_name` (in place), before a run saves its config: every program that
  reloads the run then finds the same files."""
  for field in ("attention_energy", "mlp_energy"):
    model_config[field] = absolute_energy_name(model_config[field])


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks a resolved config's own rules (choices, ranges, combinations), without jax.

  Programs call :func:`cem_jax.preflight.check`, which runs this and then the checks that need
  the model code (the attention kernel, the energies).

  Raises:
    ValueError: one line naming the field, its value and what is allowed.
  """
  for field, allowed in _CHOICES.items():
    value = config[field]
    if value not in allowed:
      raise ValueError(f"{field}={shown(value)}; allowed: {', '.join(allowed)}")
  for field, default in flat(get_default_config()).items():
    kind = type(default)
    if kind in _TYPE_NAMES and not isinstance(config[field], kind):
      raise ValueError(f"{field}={shown(config[field])}; allowed: {_TYPE_NAMES[kind]}")
  for field in _MINIMUMS:
    check_int(field, config[field])
  for field in _RANGES:
    check_range(field, config[field])
  for field, (_, most) in _MINUS_ONE_OR_POSITIVE.items():
    check_minus_one_or_positive(field, config[field], None if most is None else config[most])
  # After each field's own rule: an int that Python cannot write in decimal passed the rules
  # with no upper bound (model.d_model=0x followed by 5000 f's from the command line), then
  # failed in a message or config.json with int -> str's ValueError, naming no field.
  for field, default in flat(get_default_config()).items():
    if type(default) is int:
      check_writable(field, config[field])
  m = config.model
  if m.param_dtype != "float32":
    raise ValueError(
        f"model.param_dtype={m.param_dtype!r}: the optimizer would update bfloat16 weights "
        "directly (no float32 master copy), so small updates round away; allowed: 'float32' "
        "(set model.dtype='bfloat16' for bfloat16 compute)")
  head_dim = axes.head_dim_of(m)
  if m.head_dim <= 0 and m.d_model % m.num_heads:
    raise ValueError(
        f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; "
        "change one or set model.head_dim"
    )
  if m.rope and head_dim % 2:
    derived = ("" if m.head_dim > 0 else
               f" (model.d_model={m.d_model} // model.num_heads={m.num_heads})")
    raise ValueError(f"model.head_dim={head_dim}{derived} must be even with model.rope=True")
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
  if g > 0 and m.num_layers % g:
    divisors = ", ".join(str(d) for d in range(1, m.num_layers + 1) if m.num_layers % d == 0)
    raise ValueError(f"model.num_unique_blocks={g} does not divide model.num_layers="
                     f"{m.num_layers} (each block is reused num_layers / G times); allowed: -1 "
                     f"(a block per layer) or a divisor of {m.num_layers}: {divisors}")
  _check_unused(config)
  axes.check_mesh_sizes(config.mesh)
  axes.rules_from_config(config.mesh)
  t = config.train
  if t.batch_size % t.gradient_accumulation_steps:
    raise ValueError(f"train.batch_size={t.batch_size} is not divisible by "
                     f"train.gradient_accumulation_steps={t.gradient_accumulation_steps}; "
                     "each microbatch has batch_size / gradient_accumulation_steps rows")
  check_loss_block_size(t.loss_block_size, config.data.seq_len)
  if t.profile_steps and t.profile_first_step + t.profile_steps - 1 > t.num_steps:
    raise ValueError(f"train.profile_first_step={t.profile_first_step} with "
                     f"train.profile_steps={t.profile_steps} traces past "
                     f"train.num_steps={t.num_steps}; allowed: a window of steps inside "
                     f"1..{t.num_steps}")
