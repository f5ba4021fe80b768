"""Config validation refuses out-of-range numbers and options that would be silently ignored."""

import math
import re
import sys

import pytest
from conftest import force_fields, tiny_config

from cem_jax import config as config_lib

OUT_OF_RANGE = [
    ("train.grad_clip", 0.0), ("train.grad_clip", -1.0), ("train.grad_clip", math.nan),
    ("train.grad_clip", math.inf), ("train.learning_rate", -1e-3), ("train.learning_rate", 0.0),
    ("train.b1", 1.5), ("train.b1", 1.0), ("train.b2", -0.1), ("train.b2", 1.0),
    ("train.weight_decay", -0.1),
    ("train.min_learning_rate_ratio", 1.5), ("train.min_learning_rate_ratio", -0.1),
    ("model.norm_eps", 0.0), ("model.norm_eps", -1e-6), ("model.rope_theta", 0.0),
    ("model.init_std", 0.0), ("model.embed_scale", 0.0), ("model.embed_scale", -1.0),
    ("model.embed_scale", math.inf), ("model.precond_eps", 0.0), ("model.precond_eps", -1e-3),
    ("model.precond_eps", 1.0), ("model.precond_eps", 2.0), ("model.eta_init", 0.0),
    ("model.eta_init", -0.5), ("model.eta_init", math.nan), ("model.eta_init", 1e-50),
    ("model.eta_init", 1e4),
    # the sigmoid's limit: a momentum of exactly 0 has no finite raw value to start from
    ("model.momentum_init", 0.0),
]


@pytest.mark.parametrize("field, value", OUT_OF_RANGE, ids=lambda v: str(v))
def test_numbers_out_of_range_are_one_line_errors(field, value):
  cfg = tiny_config("cem", **({"model.precond": "both"} if "precond" in field else {}),
                    **{field: value})
  with pytest.raises(ValueError, match=rf"^{field}={value!r}; allowed: a finite number, ") as e:
    config_lib.validate(cfg)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("field, value", [
    ("train.b1", 0.0), ("train.b2", 0.0), ("train.weight_decay", 0.0),
    ("train.min_learning_rate_ratio", 0.0), ("train.min_learning_rate_ratio", 1.0),
    ("model.precond_eps", 0.5), ("train.grad_clip", 1e9), ("train.learning_rate", 1),
    ("model.eta_init", 1e-6), ("model.eta_init", 1e3), ("data.validation_fraction", 0.5),
    ("model.num_unique_blocks", 2),  # tiny_config: 2 layers
    ("train.max_consecutive_nonfinite", 2**31 - 2),  # trains (main, 2 steps)
    ("train.warmup_steps", 2**31 - 1),  # optim.make_schedule takes it
    ("data.vocab_size", 2**31 - 1),
    ("model.num_steps", 2**8 - 1), ("eval.num_steps", 2**8 - 1)])
def test_numbers_at_the_edges_of_their_ranges_are_accepted(field, value):
  config_lib.validate(tiny_config("cem", **({"model.precond": "both"} if "precond" in field
                                            else {}), **{field: value}))


# The float fields with no upper bound. 1e300 is a finite Python float but inf in the float32
# the model and optimizer compute in: norm_eps=1e300 trained a constant model (loss ln V at
# every step), rope_theta=1e300 rotated one frequency pair, embed_scale=1e300 gave NaN losses.
UNBOUNDED_FLOATS = ["model.rope_theta", "model.norm_eps", "model.init_std", "model.embed_scale",
                    "train.learning_rate", "train.weight_decay", "train.grad_clip"]


@pytest.mark.parametrize("field", UNBOUNDED_FLOATS)
def test_floats_beyond_float32_are_refused(field):
  with pytest.raises(ValueError) as e:
    config_lib.validate(tiny_config("cem", **{field: 1e300}))
  assert str(e.value) == (f"{field}=1e+300 is infinite in float32, the precision it is used "
                          f"in; allowed: a finite number, 0 {'<=' if 'decay' in field else '<'} "
                          "value, at most 3.402823e+38")
  with pytest.raises(ValueError, match=r"is infinite in float32"):
    config_lib.validate(tiny_config("cem", **{field: 3.403e38}))
  config_lib.validate(tiny_config("cem", **{field: 3.4e38}))  # float32's largest is 3.4028e38


@pytest.mark.parametrize("value, shown, negative", [
    (10**400, "1" + "0" * 400, "-1" + "0" * 400),
    (10**5000, "an int of 5001 digits", "a negative int of 5001 digits")],
    ids=["401_digits", "5001_digits"])
def test_an_int_beyond_float64_in_a_float_field_is_refused_in_one_line(value, shown, negative):
  # ConfigDict casts an int set on a float field, but a field set past its type check
  # (force_fields) is not: math.isfinite(10**400) raised OverflowError, a traceback.
  cfg = tiny_config("cem")
  force_fields(cfg, {"train.learning_rate": value})
  with pytest.raises(ValueError) as e:
    config_lib.validate(cfg)
  assert str(e.value) == (f"train.learning_rate={shown} is infinite in float32, the precision "
                          "it is used in; allowed: a finite number, 0 < value, at most "
                          "3.402823e+38")
  force_fields(cfg, {"train.learning_rate": 0.1, "train.b1": -value})
  with pytest.raises(ValueError) as e:
    config_lib.validate(cfg)
  assert str(e.value) == f"train.b1={negative}; allowed: a finite number, 0 <= value < 1"


def test_the_messages_state_the_interval():
  with pytest.raises(ValueError, match=r"train.b1=1.5; allowed: a finite number, 0 <= value < 1$"):
    config_lib.validate(tiny_config("cem", **{"train.b1": 1.5}))
  nan = r"train.grad_clip=nan; allowed: a finite number, 0 < value$"
  with pytest.raises(ValueError, match=nan):
    config_lib.validate(tiny_config("cem", **{"train.grad_clip": math.nan}))


def test_bfloat16_parameters_are_refused_not_silently_frozen():
  with pytest.raises(ValueError, match=r"^model.param_dtype='bfloat16': .*no float32 master"):
    config_lib.validate(tiny_config("cem", **{"model.param_dtype": "bfloat16"}))
  config_lib.validate(tiny_config("cem", **{"model.dtype": "bfloat16"}))  # bf16 compute is fine


UNUSED = [
    ({"model.cem_attention": False, "model.precond": "attention"},
     r"model.precond='attention' preconditions an energy step that model.cem_attention=False"),
    ({"model.cem_attention": False, "model.precond": "both"},
     r"model.precond='both' preconditions an energy step that model.cem_attention=False"),
    ({"model.cem_mlp": False, "model.precond": "mlp"},
     r"model.precond='mlp' preconditions an energy step that model.cem_mlp=False"),
    ({"model.cem_attention": False, "model.num_steps": 2, "model.context": "coevolve"},
     r"model.context='coevolve' has no effect with model.cem_attention=False"),
    ({"model.cem_attention": False, "model.attention_energy": "sigmoid"},
     r"model.attention_energy='sigmoid' has no effect with model.cem_attention=False"),
    ({"model.cem_attention": False, "model.diagonal": "per_head"},
     r"model.diagonal='per_head' has no effect with model.cem_attention=False"),
    ({"model.cem_attention": False, "model.learn_beta": True, "model.learn_eta": False},
     r"model.learn_beta=True has no effect with model.cem_attention=False"),
    ({"model.cem_mlp": False, "model.mlp_condition": "layer"},
     r"model.mlp_condition='layer' has no effect with model.cem_mlp=False"),
    ({"model.cem_mlp": False, "model.mlp_energy": "gelu"},
     r"model.mlp_energy='gelu' has no effect with model.cem_mlp=False"),
    ({"model.cem_attention": False, "model.cem_mlp": False, "model.update_mode": "autodiff"},
     r"model.update_mode='autodiff' has no effect with model.cem_attention=False and"),
    ({"model.diagonal_form": "distance"},
     r"model.diagonal_form='distance' has no effect with model.diagonal='none'"),
    ({"model.precond_eps": 0.01}, r"model.precond_eps=0.01 has no effect with model.precond="),
    ({"model.num_steps": 2, "model.precond_shared": False},
     r"model.precond_shared=False has no effect with model.precond='none'"),
    ({"model.precond": "both", "model.precond_shared": False},
     r"model.precond_shared=False has no effect with model.num_steps=1"),
    ({"model.eta_per_step": True}, r"model.eta_per_step=True has no effect with model.num_steps"),
    # per-step copies of a step size that is not a parameter (fixed at 1), or of none at all
    ({"model.learn_eta": False, "model.learn_beta": True, "model.num_steps": 2,
      "model.eta_per_step": True},
     r"^model.eta_per_step=True has no effect with model.learn_eta=False \(the step size is "),
    ({"model.cem_attention": False, "model.cem_mlp": False, "model.num_steps": 2,
      "model.eta_per_step": True},
     r"^model.eta_per_step=True has no effect with model.cem_attention=False and model.cem_mlp"),
    ({"model.block": "llama", "model.context": "coevolve"},
     r"model.context='coevolve' applies to CEM blocks only; model.block='llama' needs"),
    ({"model.block": "llama", "model.cem_mlp": False}, r"model.cem_mlp=False applies to CEM"),
    ({"model.block": "llama", "model.cem_attention": False},
     r"^model.cem_attention=False applies to CEM blocks only; model.block='llama' needs "),
    ({"model.precond_rank": 2},
     r"^model.precond_rank=2 has no effect with model.precond='none'; set model.precond to "),
    ({"model.precond_rank": 1},  # the smallest rank that adds anything
     r"^model.precond_rank=1 has no effect with model.precond='none'; set model.precond to "),
    # β and η scale the same energy: learning both only adds a direction of no effect
    ({"model.learn_beta": True},
     r"^model.learn_beta=True and model.learn_eta=True are redundant \(CEM_MATH.md §1\); set "
     r"model.learn_eta=False to learn the temperature$"),
    ({"model.cem_mlp": False, "model.precond": "both"},
     r"^model.precond='both' preconditions an energy step that model.cem_mlp=False replaces"),
    ({"model.block": "llama", "model.norm_mode": "chain"}, r"model.norm_mode='chain' applies"),
    ({"model.block": "llama", "model.eta_init": 0.5}, r"model.eta_init=0.5 applies to CEM"),
    ({"model.learn_eta": False, "model.learn_beta": True, "model.eta_init": 0.5},
     r"model.eta_init=0.5 has no effect with model.learn_eta=False"),
    ({"model.cem_attention": False, "model.cem_mlp": False, "model.eta_init": 0.5},
     r"model.eta_init=0.5 has no effect with model.cem_attention=False and"),
    ({"model.cem_attention": False, "model.cem_mlp": False, "model.norm_mode": "chain"},
     r"^model.norm_mode='chain' has no effect with model.cem_attention=False and model.cem_mlp"
     r"=False \('chain' differentiates an energy step through its norm; .*'prenorm'$"),
    ({"model.block": "llama", "eval.num_steps": 3},
     r"^eval.num_steps=3 has no effect with model.block='llama' \(it applies to CEM blocks "),
    ({"model.rope": False, "model.rope_theta": 500.0},
     r"^model.rope_theta=500.0 has no effect with model.rope=False; leave it at 10000.0$"),
    ({"data.tokenizer": "/x/spm.model", "data.tokenizer_model_type": "unigram"},
     r"^data.tokenizer_model_type='unigram' has no effect with data.tokenizer set"),
    ({"data.files": "a.txt", "data.builtin": "pydoc"},
     r"^data.builtin='pydoc' has no effect with data.files or data.tfds_name set"),
    ({"data.tfds_name": "lm1b", "data.builtin": "pydoc"},
     r"^data.builtin='pydoc' has no effect with data.files or data.tfds_name set"),
    ({"data.tfds_text_key": "body"},
     r"^data.tfds_text_key='body' has no effect without data.tfds_name; leave it at 'text'$"),
    ({"data.tfds_data_dir": "/data/tfds"}, r"^data.tfds_data_dir='/data/tfds' has no effect"),
    ({"data.tfds_name": "lm1b", "data.validation_fraction": 0.2},
     r"^data.validation_fraction=0.2 has no effect with data.tfds_name"),
]


@pytest.mark.parametrize("overrides, message", UNUSED, ids=lambda v: str(v)[:60])
def test_options_that_would_be_ignored_are_refused(overrides, message):
  with pytest.raises(ValueError, match=message):
    config_lib.validate(tiny_config("cem", **overrides))


@pytest.mark.parametrize("overrides", [
    {"model.cem_attention": False, "model.precond": "mlp"},
    {"model.cem_mlp": False, "model.precond": "attention", "model.num_steps": 2,
     "model.context": "coevolve", "model.precond_shared": False, "model.eta_per_step": True},
    {"model.cem_attention": False, "model.cem_mlp": False, "model.num_steps": 2},
    {"model.cem_attention": False, "model.cem_mlp": False, "model.norm_mode": "none"},
    {"model.cem_mlp": False, "model.norm_mode": "chain"},  # the attention's energy step
    {"model.diagonal": "shared", "model.diagonal_form": "distance"},
    {"model.context": "coevolve"},  # T=1 in training, eval.num_steps may add test-time steps
    {"model.split": "joint"},  # joint differs from lie_trotter at T=1 too
    {"model.eta_init": 0.5},  # T=1 too: a smaller first step
    {"model.cem_attention": False, "model.eta_init": 0.25},  # the MLP's step size
    {"data.tfds_name": "lm1b", "data.tfds_text_key": "body", "data.tfds_data_dir": "/d"},
    {"model.rope_theta": 500.0},
    {"model.block": "llama", "eval.max_batches": 3},
])
def test_options_that_do_something_are_accepted(overrides):
  config_lib.validate(tiny_config("cem", **overrides))


def test_flat_config_equals_the_json_it_is_saved_as():
  """A config read back from config.json or a checkpoint (tuples as lists) flattens to the same
  dotted keys and values as the live ConfigDict: resume's diff and evaluate's unknown-field
  check rely on it."""
  import json

  c = config_lib.get_default_config()
  c.model.d_model = 48
  live = config_lib.flat(c)
  assert live["model.d_model"] == 48 and isinstance(live["mesh.rules"], list)
  assert config_lib.flat(json.loads(c.to_json())) == live
  assert not any(isinstance(v, dict) for v in live.values())


@pytest.mark.parametrize("field, value, message", [
    ("model.head_dim", 0, r"^model.head_dim=0; allowed: -1 "),
    ("model.head_dim", -7, r"^model.head_dim=-7; allowed: -1 "),
    ("seed", -1, r"^seed=-1; allowed: an int >= 0 and < 2\*\*63$"),
    ("data.shuffle_seed", -3, r"^data.shuffle_seed=-3; allowed: an int >= 0 and < 2\*\*63$"),
    ("seed", 2**63, r"^seed=9223372036854775808; allowed: an int >= 0 and < 2\*\*63$"),
    # the data order's seed reaches a jax key too (data/pipeline.py), with the same limit
    ("data.shuffle_seed", 2**63,
     r"^data.shuffle_seed=9223372036854775808; allowed: an int >= 0 and < 2\*\*63$"),
    # apply_if_finite's int32 count, given the value + 1: was an OverflowError in the first step
    ("train.max_consecutive_nonfinite", 2**31 - 1,
     r"^train.max_consecutive_nonfinite=2147483647; allowed: an int >= 1 and < 2\*\*31 - 1$"),
    ("train.warmup_steps", 2**31,
     r"^train.warmup_steps=2147483648; allowed: an int >= 0 and < 2\*\*31$"),
    ("train.num_steps", 2**31,
     r"^train.num_steps=2147483648; allowed: an int >= 1 and < 2\*\*31$"),
    ("data.validation_fraction", 0.0,
     r"^data.validation_fraction=0.0; allowed: a finite number, 0 < value <= 0.5$"),
    ("data.seq_len", 1, r"^data.seq_len=1; allowed: an int >= 2$"),
    ("data.vocab_size", 7, r"^data.vocab_size=7; allowed: an int >= 8 and < 2\*\*31$"),
    # token ids are int32, and SentencePiece's vocab_size: "cannot parse as int" in training
    ("data.vocab_size", 2**31,
     r"^data.vocab_size=2147483648; allowed: an int >= 8 and < 2\*\*31$"),
    ("checkpoint.every_steps", 0, r"^checkpoint.every_steps=0; allowed: an int >= 1$"),
    ("train.eval_every_steps", 0, r"^train.eval_every_steps=0; allowed: an int >= 1$"),
    ("eval.max_batches", -2,  # else the run trains, then fails at its first eval
     r"^eval.max_batches=-2; allowed: -1 \(the whole split\) or an int >= 1$"),
    ("eval.max_batches", 0, r"^eval.max_batches=0; allowed: -1 "),
    ("data.validation_fraction", 0.51,
     r"^data.validation_fraction=0.51; allowed: a finite number, 0 < value <= 0.5$"),
    ("train.num_steps", True, r"^train.num_steps=True; allowed: an int >= 1 and < 2\*\*31$"),
    ("model.precond_rank", 65, r"^model.precond_rank=65 exceeds model.d_model=64; allowed: 0..64$"),
    ("model.d_model", 66, r"^model.d_model=66 is not divisible by model.num_heads=4; change one "),
    ("model.head_dim", 7, r"^model.head_dim=7 must be even with model.rope=True$"),
    # more blocks than layers: the range, not "does not divide" (tiny_config: 2 layers)
    ("model.num_unique_blocks", 4, r"^model.num_unique_blocks=4; allowed: -1 \(= "
     r"model.num_layers\) or an int in 1..2 \(model.num_layers\)$"),
    ("model.num_unique_blocks", 0, r"^model.num_unique_blocks=0; allowed: -1 "),
    ("model.num_unique_blocks", 3, r"^model.num_unique_blocks=3; allowed: -1 .* 1..2 "),
    ("eval.num_steps", 0, r"^eval.num_steps=0; allowed: -1 \(= model.num_steps\) or an int >= 1 "
     r"and < 2\*\*8 \(every step is unrolled into the compiled program\)$"),
    # the recursive steps are unrolled: 10**9 passed, then was traced for ever
    ("model.num_steps", 10**9, r"^model.num_steps=1000000000; allowed: an int >= 1 and < 2\*\*8 "
     r"\(every step is unrolled into the compiled program\)$"),
    ("model.num_steps", 2**8, r"^model.num_steps=256; allowed: an int >= 1 and < 2\*\*8 "),
    ("eval.num_steps", 2**8, r"^eval.num_steps=256; allowed: -1 \(= model.num_steps\) or an int "
     r">= 1 and < 2\*\*8 "),
    ("eval.num_steps", -2, r"^eval.num_steps=-2; allowed: -1 "),
    ("model.head_dim", True, r"^model.head_dim=True; allowed: -1 \(= model.d_model // "
     r"model.num_heads\) or an int >= 1$"),
])
def test_values_that_were_silently_defaulted_or_failed_late_are_refused(field, value, message):
  """head_dim 0 or -7 used to mean "the default" (only -1 is documented); a negative seed
  passed validation and failed inside numpy after the data was built."""
  extra = {"model.precond": "both"} if field == "model.precond_rank" else {}
  with pytest.raises(ValueError, match=message) as e:
    config_lib.validate(tiny_config("cem", **extra, **{field: value}))
  assert "\n" not in str(e.value)


def test_a_bool_is_not_a_number():
  # ConfigDict turns True into 1.0 for a float field; a config file's dict or a config.json
  # read back need not, and True would train at learning rate 1.
  cfg = tiny_config("cem")
  force_fields(cfg, {"train.learning_rate": True})
  with pytest.raises(ValueError, match=r"^train.learning_rate=True; allowed: a finite number"):
    config_lib.validate(cfg)


_DEFAULTS = config_lib.flat(config_lib.get_default_config())
# Every bool and every free-text str field (choice fields list their choices instead).
_TYPED = [(k, v) for k, v in _DEFAULTS.items() if isinstance(v, (bool, str))
          and k not in config_lib._CHOICES]


@pytest.mark.parametrize("field, default", _TYPED, ids=lambda v: str(v))
def test_bool_and_str_fields_refuse_another_type(field, default):
  # ConfigDict lets a config file store None anywhere and 2 in a bool field: None read as
  # False or '' (model.rope=None trained without RoPE, data.tokenizer=None trained one).
  allowed = "True or False" if isinstance(default, bool) else "a string"
  for bad in (None, 2) if isinstance(default, bool) else (None, 3):
    cfg = tiny_config("cem")
    force_fields(cfg, {field: bad})
    with pytest.raises(ValueError) as e:
      config_lib.validate(cfg)
    assert str(e.value) == f"{field}={bad!r}; allowed: {allowed}"


@pytest.mark.parametrize("field, value, shown, allowed", [
    ("model.num_steps", 10**5000, "an int of 5001 digits", "an int >= 1 and < 2**8 "),
    ("data.shuffle_seed", -(10**5000 - 1), "a negative int of 5000 digits", "an int >= 0 "),
    ("data.shuffle_seed", 10**4300 - 1, "9" * 4300, "an int >= 0 "),  # the longest repr allows
    ("data.shuffle_seed", 10**4300, "an int of 4301 digits", "an int >= 0 and < 2**63"),
    ("eval.num_steps", 2**20000, "an int of 6021 digits", "-1 (= model.num_steps) or "),
    ("model.block", 10**5000, "an int of 5001 digits", "cem, llama"),
    ("model.rope", 10**5000, "an int of 5001 digits", "True or False"),
], ids=["num_steps", "negative", "4300_digits", "4301_digits", "eval_num_steps", "choice",
        "bool"])
def test_an_int_too_long_to_print_is_refused_by_its_digit_count(field, value, shown, allowed):
  # Python refuses int -> str beyond 4300 digits (sys.get_int_max_str_digits): the refusal's
  # f-string raised that ValueError in place of the field's. Digits counted by str() here.
  cfg = tiny_config("cem")
  force_fields(cfg, {field: value})
  with pytest.raises(ValueError) as e:
    config_lib.validate(cfg)
  assert str(e.value).startswith(f"{field}={shown}; allowed: {allowed}"), str(e.value)[:200]
  if "digits" in shown:
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
      digits = len(str(abs(value)))
    finally:
      sys.set_int_max_str_digits(old)
    assert shown == f"{'a negative' if value < 0 else 'an'} int of {digits} digits"


INT_FIELDS = [k for k, v in config_lib.flat(config_lib.get_default_config()).items()
              if type(v) is int]


@pytest.mark.parametrize("field", INT_FIELDS)
def test_every_int_field_too_long_to_write_is_refused_naming_it(field):
  # absl parses --config.model.d_model=0xfff... (hex has no digit limit) to an int of 5001
  # decimal digits; a field with no upper bound passed its rule, then a message or
  # config.json failed with int -> str's ValueError naming no field ('Exceeds the limit').
  from cem_jax import cli

  value = cli.parse_value(f"--config.{field}", f"{10**5000:#x}", 1)
  assert value == 10**5000
  for bad, shown in ((value, "an int of 5001 digits"), (-value, "a negative int of 5001 digits")):
    cfg = tiny_config("cem", **{"model.precond": "both"})  # precond_rank's rule applies
    force_fields(cfg, {field: bad})
    with pytest.raises(ValueError) as e:
      config_lib.validate(cfg)
    assert str(e.value).startswith(f"{field}={shown}; allowed: "), str(e.value)[:200]
    if bad > 0 and field not in config_lib._BELOW and field not in ("model.num_unique_blocks",
                                                                      "eval.num_steps"):
      assert str(e.value).endswith("; allowed: an int of at most 4300 digits (Python's int -> "
                                   "str limit: config.json and the messages write it in "
                                   "decimal)")


def test_a_limit_too_long_to_write_is_named_by_its_digit_count():
  # model.num_unique_blocks's maximum is model.num_layers: a refusal of the first wrote the
  # second, itself past int -> str's limit.
  cfg = tiny_config("cem")
  force_fields(cfg, {"model.num_layers": 10**5000, "model.num_unique_blocks": 0})
  with pytest.raises(ValueError) as e:
    config_lib.validate(cfg)
  assert str(e.value) == ("model.num_unique_blocks=0; allowed: -1 (= model.num_layers) or an "
                          "int in 1..an int of 5001 digits (model.num_layers)")


def test_a_profile_window_must_lie_inside_the_run():
  cfg = tiny_config("cem", **{"train.num_steps": 30, "train.profile_steps": 3,
                              "train.profile_first_step": 29})
  with pytest.raises(ValueError) as e:
    config_lib.validate(cfg)
  assert str(e.value) == ("train.profile_first_step=29 with train.profile_steps=3 traces past "
                          "train.num_steps=30; allowed: a window of steps inside 1..30")
  cfg.train.profile_first_step = 28  # steps 28..30: the last three
  config_lib.validate(cfg)
  for field, value in (("train.profile_steps", -1), ("train.profile_first_step", 0)):
    with pytest.raises(ValueError, match=rf"^{field}={value}; allowed: an int >= "):
      config_lib.validate(tiny_config("cem", **{field: value}))
  # No trace, the first step unread but accepted: --config.train.profile_steps=0 alone turns off
  # a config file's profile (refusing it was tried, and made that two flags).
  cfg.train.profile_steps = 0
  cfg.train.profile_first_step = 1000
  config_lib.validate(cfg)
  # Likewise a short try of a config file with its own decay ratio (the warm-up outlasts it).
  config_lib.validate(tiny_config("cem", **{"train.num_steps": 6, "train.warmup_steps": 50,
                                            "train.min_learning_rate_ratio": 0.0}))


@pytest.mark.parametrize("overrides", [
    {"model.head_dim": 8},
    {"model.d_model": 66, "model.head_dim": 16},  # heads need not divide d_model then
    {"model.rope": False, "model.head_dim": 7},  # only RoPE needs an even head_dim
    {"model.precond": "both", "model.precond_rank": 64},  # rank up to d_model
    {"data.vocab_size": 8},
])
def test_documented_edges_are_accepted(overrides):
  config_lib.validate(tiny_config("cem", **overrides))


def test_the_defaults_are_the_documented_tiny_model():
  # get_default_config's docstring and experiments/tiny.py's.
  c = config_lib.get_default_config()
  m, t = c.model, c.train
  assert (m.block, m.d_model, m.num_layers, m.num_heads, m.mlp_dim) == ("cem", 128, 4, 4, 512)
  assert (c.data.seq_len, c.data.vocab_size, c.data.tokenizer_model_type,
          c.data.validation_fraction) == (128, 1024, "bpe", 0.1)
  assert (t.num_steps, t.batch_size, t.learning_rate, t.warmup_steps,
          t.min_learning_rate_ratio) == (1000, 16, 3e-3, 50, 0.1)


def test_model_tables_match_the_config_choices():
  # A block or remat choice added to config without a class or policy in the model would pass
  # validation and fail only when the model is built.
  from cem_jax import model

  assert set(model.BLOCK_TYPES) == set(config_lib.BLOCKS)
  assert set(model.CHECKPOINT_POLICIES) | {"none"} == set(config_lib.REMAT_POLICIES)


# The least value of every integer field, as the comments of get_default_config state it: one
# below is refused by name (a warmup of -1 steps or an eval batch of 0 rows would otherwise
# reach optax or the data pipeline and fail there, after the data is built).
INT_MINIMUMS = [
    ("seed", 0), ("data.shuffle_seed", 0), ("model.d_model", 1), ("model.num_heads", 1),
    ("model.mlp_dim", 1), ("model.num_layers", 1), ("model.num_steps", 1),
    ("model.precond_rank", 0), ("model.energy_block_size", 0), ("data.seq_len", 2),
    ("data.vocab_size", 8), ("train.num_steps", 1), ("train.batch_size", 1),
    ("train.gradient_accumulation_steps", 1), ("train.warmup_steps", 0),
    ("train.eval_every_steps", 1), ("train.log_every_steps", 1),
    ("train.max_consecutive_nonfinite", 1), ("train.profile_steps", 0),
    ("train.profile_first_step", 1), ("eval.batch_size", 1), ("checkpoint.every_steps", 1),
    ("checkpoint.keep", 1),
]


@pytest.mark.parametrize("field, minimum", INT_MINIMUMS, ids=lambda v: str(v))
def test_every_integer_field_refuses_one_below_its_minimum(field, minimum):
  extra = {"model.precond": "both"} if field == "model.precond_rank" else {}
  with pytest.raises(ValueError) as e:
    config_lib.validate(tiny_config("cem", **extra, **{field: minimum - 1}))
  # The upper bound, where a field has one, is in the cases of the test above.
  assert re.fullmatch(rf"{re.escape(field)}={minimum - 1}; allowed: an int >= {minimum}"
                      r"( and < 2\*\*\d+( - 1)?( \(.+\))?)?", str(e.value)), str(e.value)


def test_every_upper_bound_is_checked_with_its_minimum():
  # check_int reads _BELOW for the _MINIMUMS fields validate passes it: a bound of a field
  # without a minimum would never be checked.
  assert set(config_lib._BELOW) <= set(config_lib._MINIMUMS)


@pytest.mark.parametrize("field, allowed", [
    ("model.block", "cem, llama"), ("model.update_mode", "auto, fused, autodiff"),
    ("model.norm_mode", "prenorm, chain, none"), ("model.diagonal", "none, per_head, shared"),
    ("model.diagonal_form", "bilinear, distance"), ("model.context", "fixed, coevolve"),
    ("model.split", "lie_trotter, joint"), ("model.mlp_condition", "step, layer"),
    ("model.precond", "none, attention, mlp, both"),
    ("model.inner_optimizer", "gd, heavy_ball, nesterov"),
    ("model.manifold", "euclidean, sphere"), ("model.dtype", "float32, bfloat16"),
    ("model.param_dtype", "float32, bfloat16"), ("model.remat", "none, full, dots"),
    ("model.attention_impl", "auto, xla, cudnn, splash"),
    ("data.builtin", "pydoc, pydoc+docstrings"), ("data.tokenizer_model_type", "bpe, unigram"),
])
def test_every_choice_field_refuses_an_unknown_name_and_lists_the_choices(field, allowed):
  # config.validate itself (no jax): an unknown remat policy would otherwise pass it and fail
  # only when the model is built, after the data.
  with pytest.raises(ValueError) as e:
    config_lib.validate(tiny_config("cem", **{field: "bogus"}))
  assert str(e.value) == f"{field}='bogus'; allowed: {allowed}"


@pytest.mark.parametrize("head_dim", [1, 2, 6])
def test_an_explicit_head_dim_is_used_however_small(head_dim):
  # Only -1 means d_model // num_heads; a head width of 1 (no RoPE) is a width, not a default.
  from cem_jax import axes

  cfg = tiny_config("cem", **{"model.rope": False, "model.head_dim": head_dim})
  config_lib.validate(cfg)
  assert axes.head_dim_of(cfg.model) == head_dim
  assert axes.head_dim_of(tiny_config("cem").model) == 64 // 4


def test_a_tool_sizes_its_model_with_the_configs_vocabulary_unless_told_another():
  cfg = tiny_config(**{"data.vocab_size": 300})
  assert config_lib.vocab_size(cfg, None) == 300
  assert config_lib.vocab_size(cfg, 512) == 512
  with pytest.raises(ValueError, match=r"^--vocab_size=7; allowed: an int >= 8 and < 2\*\*31$"):
    config_lib.vocab_size(cfg, 7)


def test_run_changes_compares_each_data_file_by_its_file_name():
  # The same files from another checkout or machine are the same run; another first file is
  # another run, even with the same last file.
  saved = tiny_config(**{"data.files": "/old/x.txt,/old/y.txt"}).to_dict()
  assert config_lib.run_changes(saved, tiny_config(**{"data.files": "/new/x.txt,/new/y.txt"})
                                ) == []
  assert config_lib.run_changes(saved, tiny_config(**{"data.files": "/old/z.txt,/old/y.txt"})
                                ) == ["data.files: 'x.txt,y.txt' -> 'z.txt,y.txt'"]
