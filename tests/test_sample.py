"""Generation: cached decoding equals recomputing the prefix; sampling filters are right."""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

from cem_jax import preflight, sample
from cem_jax.model import DecoderLM

V = 97

# CEM with T = 2 alone: its logits at every position in test_cached_logits_match_the_full_forward.
CASES = [
    dict(block="llama"),
    dict(block="cem"),
    dict(block="cem", num_steps=2, context="coevolve", diagonal="per_head", precond="both",
         precond_rank=2),
]


def _model(case):
  cfg = tiny_config(**{f"model.{k}": v for k, v in case.items()}).model
  cfg.init_std = 0.1  # sharper logits than the default init: greedy choices are not near-ties
  model = DecoderLM(cfg, V, rngs=nnx.Rngs(1))
  return nnx.split(model, nnx.Param)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_greedy_cached_equals_uncached(case):
  graphdef, params = _model(case)
  prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (2, 5), 0, V))
  # 6 new tokens: the prefill and 5 single-token steps (the uncached path compiles once per
  # length; the logits at every position are checked in test_cached_logits_match_...).
  cached = sample.generate(graphdef, params, prompt, 6, use_cache=True)
  uncached = sample.generate(graphdef, params, prompt, 6, use_cache=False)
  np.testing.assert_array_equal(cached, uncached)
  assert cached.shape == (2, 6)


def _assert_cached_logits_match_the_full_forward(model, num_steps: int | None = None) -> None:
  """Prefill 4 tokens, then one token at a time: every position's logits equal the full
  forward's (1e-5), at ``num_steps`` recursive steps (default: the trained T)."""
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 10), 0, V)
  full = model(tokens, num_steps=num_steps)
  cache = model.init_cache(2, 10, num_steps)
  prefill, cache = model(tokens[:, :4], cache=cache, index=0, num_steps=num_steps)
  np.testing.assert_allclose(prefill, full[:, :4], atol=1e-5)
  for i in range(4, 10):
    logits, cache = model(tokens[:, i:i + 1], cache=cache, index=i, num_steps=num_steps)
    np.testing.assert_allclose(logits[:, 0], full[:, i], atol=1e-5)


def test_cached_logits_match_the_full_forward():
  graphdef, params = _model(dict(block="cem", num_steps=2))
  _assert_cached_logits_match_the_full_forward(nnx.merge(graphdef, params))


def test_cached_logits_match_the_full_forward_with_every_parameter_moved():
  # At initialisation a block's two norm scales are both ones, so a cached path that normalises
  # with the wrong one matches the full forward there. Every parameter moved (seeded, by up to
  # ~50%): fails with the Llama block's cached MLP input taken through norm_att.
  graphdef, params = _model(dict(block="llama"))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(4), len(leaves))
  leaves = [p * (1.0 + 0.5 * jax.random.normal(k, p.shape, p.dtype))
            for p, k in zip(leaves, keys, strict=True)]
  _assert_cached_logits_match_the_full_forward(
      nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)))


def test_top_k_and_top_p_filters():
  logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
  k2 = sample.filter_logits(logits, 1.0, 2, 1.0)
  assert np.isfinite(np.asarray(k2)).tolist() == [[True, True, False, False]]
  p = sample.filter_logits(logits, 1.0, 0, 0.7)  # 0.5 + 0.25 reaches 0.7
  assert np.isfinite(np.asarray(p)).tolist() == [[True, True, False, False]]
  p_small = sample.filter_logits(logits, 1.0, 0, 0.1)  # the top token always stays
  assert np.isfinite(np.asarray(p_small)).tolist() == [[True, False, False, False]]
  # Scaled and shifted to a maximum of 0 (the same distribution as logits / 2).
  np.testing.assert_allclose(sample.filter_logits(logits, 2.0, 0, 1.0),
                             (logits - jnp.log(0.5)) / 2.0, rtol=1e-6)


@pytest.mark.parametrize("temperature,top_k,top_p,want", [
    (1e-40, 0, 1.0, {1}),  # tends to greedy: 1/T overflows float32
    (1.0, 0, 1e-40, {1}),  # below float32's smallest number: the top token still stays
    (1e300, 2, 1.0, {1, 2}),  # near-uniform, but top-k ranks by the logits: not ids 0 and 1
])
def test_extreme_settings_keep_the_tokens_their_limits_define(temperature, top_k, top_p, want):
  logits = jnp.asarray([[1.0, 3.0, 2.0, 0.0]])
  out = np.asarray(sample.filter_logits(logits, temperature, top_k, top_p))
  assert set(np.flatnonzero(np.isfinite(out[0])).tolist()) == want
  keys = jax.random.split(jax.random.PRNGKey(0), 64)
  tokens = {int(sample._choose(logits, k, temperature, top_k, top_p)[0]) for k in keys}
  assert tokens <= want and (len(want) == 1 or tokens == want)


def test_a_temperature_past_float32s_range_samples_uniformly_without_a_warning():
  # 1e300 became inf in float32 with NumPy's "overflow encountered in cast" printed by
  # sample's command from inside jax; the limit (all kept tokens alike) is float32's largest.
  logits = jnp.asarray([[1.0, 3.0, 2.0, 0.0]])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = np.asarray(sample.filter_logits(logits, 1e300, 0, 1.0))
  np.testing.assert_allclose(out, np.zeros((1, 4)), atol=1e-30)


def test_temperature_sampling_is_seeded_and_validates_length():
  graphdef, params = _model(dict(block="cem"))
  prompt = np.zeros((1, 3), np.int32)
  n = 5  # new tokens (not 8): the uncached path compiles once per length
  a = sample.generate(graphdef, params, prompt, n, rng=jax.random.PRNGKey(5), temperature=1.0,
                      top_k=3)
  b = sample.generate(graphdef, params, prompt, n, rng=jax.random.PRNGKey(5), temperature=1.0,
                      top_k=3)
  np.testing.assert_array_equal(a, b)
  # The final norm's scale at 0: every logit is 0 and top-k a uniform draw over tokens 0..2.
  # Each token has its own key: drawn with one key at every step, they would all be one token.
  flat = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if "final_norm" in jax.tree_util.keystr(path) else x,
      params)
  uniform = sample.generate(graphdef, flat, prompt, n, rng=jax.random.PRNGKey(5),
                            temperature=1.0, top_k=3)
  assert len(set(uniform[0, 1:].tolist())) > 1, uniform
  # Without the cache the same keys in the same order: on flat logits, the same draws.
  np.testing.assert_array_equal(
      sample.generate(graphdef, flat, prompt, n, rng=jax.random.PRNGKey(5), temperature=1.0,
                      top_k=3, use_cache=False), uniform)
  # The key given is the one drawn with (--seed): another key, other draws (a generate that
  # ignored it drew the same tokens for every --seed).
  for seed in (6, 7):
    other = sample.generate(graphdef, flat, prompt, n, rng=jax.random.PRNGKey(seed),
                            temperature=1.0, top_k=3)
    assert other[0].tolist() != uniform[0].tolist(), (seed, other, uniform)
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    sample.generate(graphdef, params, prompt, 0)


def _stand_in_run(monkeypatch, tokenizer):
  """cem_jax.sample's flags in a FlagValues of their own (defaults: greedy, 5 new tokens) and
  a stand-in run of seq_len 8; its ``generate`` records its keyword arguments."""
  from types import SimpleNamespace

  from absl import flags

  from cem_jax import runs

  fv = flags.FlagValues()
  # The workdir a folder that exists (sample refuses one that does not before loading).
  here = os.path.dirname(__file__)
  for name, default in (("workdir", here), ("prompt", "abc"), ("verbosity", "0"),
                        ("attention_impl", "xla")):
    flags.DEFINE_string(name, default, "", flag_values=fv)
  for name, default in (("max_new_tokens", 5), ("top_k", 0), ("seed", 0)):
    flags.DEFINE_integer(name, default, "", flag_values=fv)
  for name, default in (("temperature", 0.0), ("top_p", 1.0)):
    flags.DEFINE_float(name, default, "", flag_values=fv)
  flags.DEFINE_bool("no_cache", False, "", flag_values=fv)
  fv(["sample", "--verbosity=0"])  # given: main leaves the logging level alone
  monkeypatch.setattr(flags, "FLAGS", fv)
  config = tiny_config(**{"data.seq_len": 8})
  def load_run(workdir, attention_impl):
    assert (workdir, attention_impl) == (here, "xla")  # the flags, passed on
    return config, SimpleNamespace(tokenizer=tokenizer), None, None, 7

  monkeypatch.setattr(runs, "load_run", load_run)
  calls = []

  def generate(graphdef, params, prompt, n, **kw):
    calls.append(kw)
    return np.zeros((1, n), np.int32)

  monkeypatch.setattr(sample, "generate", generate)
  return fv, calls


def test_sample_takes_a_prompt_and_new_tokens_up_to_seq_len_and_no_more(monkeypatch, capsys):
  # cem_jax.sample's main on a stand-in run (seq_len 8, a 3-token prompt): 5 new tokens fill the
  # trained context exactly and are allowed; 6 are refused, naming the 5 that are.
  from types import SimpleNamespace

  from cem_jax import runs

  tokenizer = SimpleNamespace(vocab_size=V, encode=lambda text: [1, 2, 3],
                              decode=lambda ids: "+" * len(ids))
  fv, _ = _stand_in_run(monkeypatch, tokenizer)
  sample.main([])
  assert capsys.readouterr().out == "abc+++++\n"
  fv.max_new_tokens = 6
  with pytest.raises(SystemExit) as e:
    sample.main([])
  assert e.value.code == 1
  assert capsys.readouterr().err.endswith("allowed: at most 5 new tokens for this prompt\n")
  # One token is said as one: a 1-token prompt, and a 7-token one that leaves room for one.
  for prompt, new_tokens, said in (
      ([1], 8, "(1 token) + --max_new_tokens=8 exceeds data.seq_len=8, the longest context the "
               "model was trained on; allowed: at most 7 new tokens for this prompt"),
      (list(range(1, 8)), 2, "(7 tokens) + --max_new_tokens=2 exceeds data.seq_len=8, the "
                             "longest context the model was trained on; allowed: at most 1 new "
                             "token for this prompt")):
    fv.max_new_tokens = new_tokens
    monkeypatch.setattr(tokenizer, "encode", lambda text, ids=prompt: ids)
    with pytest.raises(SystemExit):
      sample.main([])
    assert capsys.readouterr().err == f"error: --prompt {said}\n"
  # A prompt that fills the context leaves no room: said of the prompt, not as "-1 new tokens".
  fv.max_new_tokens = 1
  monkeypatch.setattr(tokenizer, "encode", lambda text: list(range(1, 9)))
  with pytest.raises(SystemExit):
    sample.main([])
  assert capsys.readouterr().err == (
      "error: --prompt is 8 tokens; allowed: at most 7, so that one new token fits in "
      "data.seq_len=8, the longest context the model was trained on\n")
  # Bytes that are not UTF-8 reach Python as surrogates: refused before the run is loaded.
  fv.prompt = "\udcff\udcfe abc"
  monkeypatch.setattr(runs, "load_run", lambda workdir: pytest.fail("loaded"))
  with pytest.raises(SystemExit):
    sample.main([])
  assert capsys.readouterr().err == (
      "error: --prompt='\\udcff\\udcfe abc' is not UTF-8 text (at character 0); give it in "
      "UTF-8\n")


def test_sample_refuses_flags_out_of_range_and_passes_the_rest_on(monkeypatch, capsys):
  # One line and exit status 1 for each flag out of its range; in range, the values reach
  # generate: top_k up to the vocabulary (V), the seed as the key, --no_cache as use_cache.
  from types import SimpleNamespace

  tokenizer = SimpleNamespace(vocab_size=V, encode=lambda text: [1, 2, 3],
                              decode=lambda ids: "+" * len(ids))
  fv, calls = _stand_in_run(monkeypatch, tokenizer)

  def run(**values):
    base = dict(temperature=0.5, top_k=V, top_p=1.0, seed=7, no_cache=True, max_new_tokens=5)
    for name, value in {**base, **values}.items():
      setattr(fv, name, value)
    try:
      sample.main([])
    except SystemExit as e:
      assert e.code == 1
      return capsys.readouterr().err
    return capsys.readouterr().out

  assert run() == "abc+++++\n"
  (kw,) = calls
  assert {k: kw[k] for k in ("temperature", "top_k", "top_p", "use_cache")} == {
      "temperature": 0.5, "top_k": V, "top_p": 1.0, "use_cache": False}
  # A top_p other than the default reaches generate too (one passed as 1.0 was not caught).
  assert run(top_p=0.25, top_k=3) == "abc+++++\n"
  assert {k: calls[-1][k] for k in ("top_k", "top_p")} == {"top_k": 3, "top_p": 0.25}
  np.testing.assert_array_equal(kw["rng"], jax.random.PRNGKey(7))
  assert run(top_k=V + 1) == (f"error: --top_k={V + 1}; allowed: 0 (off) or 1..{V} (the "
                              "vocabulary)\n")
  for top_p in (1.5, 0.0):
    assert run(top_p=top_p) == f"error: --top_p={top_p}; allowed: 0 < top_p <= 1\n"
  assert run(temperature=0.0, top_k=0, top_p=0.9) == (
      "error: --top_k=0 --top_p=0.9 have no effect with --temperature=0 (greedy); leave them at "
      "0 and 1\n")
  assert run(max_new_tokens=0) == "error: --max_new_tokens=0; allowed: an int >= 1\n"
  monkeypatch.setattr(tokenizer, "encode", lambda text: [])
  assert run() == "error: --prompt='abc' encodes to no tokens; give some text\n"
  assert len(calls) == 2  # nothing refused reached generate


def test_greedy_takes_the_lower_id_of_tied_logits_whatever_the_key():
  logits = jnp.asarray([[1.0, 4.0, 4.0, 0.0]])
  keys = jax.random.split(jax.random.PRNGKey(0), 32)
  assert {int(sample._choose(logits, k, 0.0, 0, 1.0)[0]) for k in keys} == {1}


def test_generate_refuses_a_prompt_of_no_tokens():
  with pytest.raises(ValueError, match=r"^prompt must be \[batch, prompt_len >= 1\], got shape "
                                       r"\(1, 0\)$"):
    sample.generate(None, None, np.zeros((1, 0), np.int32), 4)


def _kept_reference(logits, top_k, top_p):
  """The kept token ids by the definition: sort by (logit descending, id ascending), keep the
  first k, then the shortest prefix whose softmax mass reaches top_p (float64 NumPy)."""
  logits = np.asarray(logits, np.float64)
  order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
  if top_k > 0:
    order = order[:top_k]
  probs = np.exp(logits[order] - logits[order].max())
  probs /= probs.sum()
  kept, mass = [], 0.0
  for i, p in zip(order, probs, strict=True):
    if top_p < 1.0 and mass >= top_p:
      break
    kept.append(i)
    mass += p
  return sorted(kept)


@pytest.mark.parametrize("logits, top_k, top_p", [
    ([1.0, 2.0, 2.0, 2.0, 3.0], 3, 1.0),  # a tie at the k-th place: exactly 3 stay
    ([5.0, 5.0, 0.0, -1.0], 1, 1.0),
    ([0.0, 0.0, 0.0, 0.0], 0, 0.5),  # uniform: exactly two tokens reach 0.5
    ([0.0, 0.0, 0.0, 0.0], 0, 0.51),
    ([2.0, 1.0, 1.0, 1.0, -3.0], 3, 0.6),
    ([2.0, 1.0, 1.0, 1.0, -3.0], 0, 0.6),
    ([0.0, 0.0, 0.0, 0.0], 2, 0.5),  # top-p of the top-k tokens' own distribution: 0.5 each
])
def test_filters_keep_exactly_the_defined_tokens_under_ties(logits, top_k, top_p):
  out = sample.filter_logits(jnp.asarray([logits], jnp.float32), 1.0, top_k, top_p)
  kept = np.flatnonzero(np.isfinite(np.asarray(out[0]))).tolist()
  assert kept == _kept_reference(logits, top_k, top_p)
  if top_k and top_p >= 1.0:
    assert len(kept) == top_k



@pytest.mark.parametrize("top_k", [0, 30])
def test_top_p_keeps_the_lowest_ids_of_a_tie_cut_in_a_large_vocabulary(top_k):
  # 40 tokens tied at the top of 4096, at random ids, the nucleus cut inside the tie: the kept
  # set is the tied tokens of the lowest ids (the float64 reference's), on every backend. The
  # small rows above cannot tell a stable sort from an unstable one (XLA's CPU sort of a few
  # entries keeps ties in order anyway); 4096 entries it reorders: with stable=False this
  # kept 21 other tied tokens in each row.
  rng = np.random.default_rng(3)
  logits = np.zeros((4, 4096), np.float32)
  for row in logits:
    row[rng.choice(4096, 40, replace=False)] = 10.0
  top_p = 20.5 * np.exp(10.0) / (40 * np.exp(10.0) + 4056)  # 20.5 tied tokens' mass
  out = np.asarray(sample.filter_logits(jnp.asarray(logits), 1.0, top_k, float(top_p)))
  for row, got in zip(logits, out, strict=True):
    kept = np.flatnonzero(np.isfinite(got)).tolist()
    assert kept == _kept_reference(row.tolist(), top_k, top_p)
    assert len(kept) == (21 if top_k == 0 else 16)

def test_top_p_just_below_1_never_lets_a_token_top_k_removed_back_in():
  # The largest float32 below 1: the kept tokens' softmax, summed in float32, can fall short of
  # it by rounding, so the mass before a removed token is < top_p and the nucleus alone would
  # keep it. Top-k must still keep exactly k (the float64 reference's tokens) in every row.
  top_p = float(np.nextafter(np.float32(1.0), np.float32(0.0)))
  logits = np.random.default_rng(11).standard_normal((256, 8)).astype(np.float32)
  k = 3
  top = -np.sort(-logits, axis=-1)[:, :k]
  mass = np.asarray(jnp.sum(jax.nn.softmax(jnp.asarray(top), axis=-1), axis=-1))
  assert (mass < np.float32(top_p)).any()  # the rounding the test is about occurs
  out = np.asarray(sample.filter_logits(jnp.asarray(logits), 1.0, k, top_p))
  for row, got in zip(logits, out, strict=True):
    assert np.flatnonzero(np.isfinite(got)).tolist() == _kept_reference(row.tolist(), k, top_p)


def test_top_k_1_with_a_tie_always_samples_the_same_token():
  logits = jnp.asarray([[5.0, 5.0, 0.0, -1.0]])
  keys = jax.random.split(jax.random.PRNGKey(0), 64)
  tokens = {int(sample._choose(logits, k, 1.0, 1, 1.0)[0]) for k in keys}
  assert tokens == {0}


STRICT_CASES = [
    dict(block="cem", strict_causal=True),
    dict(block="cem", strict_causal=True, num_steps=2, context="coevolve", precond="both",
         precond_rank=2),
]


def _strict_model(case):
  """A strict-causal (N(i) = {j < i}) CEM model with random η and preconditioners too."""
  graphdef, params = _model(case)
  model = nnx.merge(graphdef, params)
  ks = iter(jax.random.split(jax.random.PRNGKey(7), 16))
  for blk in model.blocks:
    blk.attn.eta[...] = 0.5 * jax.random.normal(next(ks), blk.attn.eta.shape)
    blk.mlp.eta[...] = 0.5 * jax.random.normal(next(ks), blk.mlp.eta.shape)
    for pc in (blk.precond_att, blk.precond_mlp):
      if pc is not None:
        pc.p[...] = 0.5 * jax.random.normal(next(ks), pc.p.shape)
        pc.u[...] = 0.3 * jax.random.normal(next(ks), pc.u.shape)
  return model


@pytest.mark.parametrize("case", STRICT_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_strict_causal_cached_decoding_equals_the_full_forward(case):
  """model.strict_causal=True: the cached path (prefill, then one token at a time) gives the
  full forward's logits at every position, and greedy cached = uncached token for token."""
  model = _strict_model(case)
  _assert_cached_logits_match_the_full_forward(model)
  graphdef, params = nnx.split(model, nnx.Param)
  prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (2, 5), 0, V))
  # 3 new tokens, the prefill and 2 single-token steps: the logits at every position are
  # checked above, and the uncached path compiles once per length.
  cached = sample.generate(graphdef, params, prompt, 3, use_cache=True)
  uncached = sample.generate(graphdef, params, prompt, 3, use_cache=False)
  np.testing.assert_array_equal(cached, uncached)


# model.cem_attention=False (the mlp table's cem_tied / cem_widened controls): the standard
# attention inside a CEM block caches each recursive step's keys and values.
STANDARD_ATTENTION_CASES = [
    dict(block="cem", cem_attention=False, num_steps=2),
    dict(block="cem", cem_attention=False, num_steps=3, strict_causal=True, precond="mlp",
         precond_rank=2),
    dict(block="cem", cem_attention=False, num_steps=2, inner_optimizer="nesterov",
         manifold="sphere"),
]


@pytest.mark.parametrize("case", STANDARD_ATTENTION_CASES,
                         ids=lambda c: "-".join(map(str, c.values())))
def test_cem_block_with_the_standard_attention_decodes_with_the_cache(case):

  preflight.check(tiny_config(**{f"model.{k}": v for k, v in case.items()}))  # trainable
  graphdef, params = _model(case)
  _assert_cached_logits_match_the_full_forward(nnx.merge(graphdef, params))
  if case is not STANDARD_ATTENTION_CASES[0]:
    return  # the logits check is the specification; the rest once (its compiles cost)
  # Test-time steps beyond the trained T: the cache holds one key/value copy per step run.
  model = nnx.merge(graphdef, params)
  _assert_cached_logits_match_the_full_forward(model, num_steps=4)
  # sample.generate with the cache is greedy under the full forward (teacher-forced on its
  # own output: uncached generation would compile once per length).
  prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (2, 5), 0, V))
  out = np.asarray(sample.generate(graphdef, params, prompt, 8, num_steps=4))
  seq = np.concatenate([prompt, out], axis=1)  # [2, 13]
  full = np.asarray(model(jnp.asarray(seq[:, :-1]), num_steps=4))
  np.testing.assert_array_equal(full[:, 4:].argmax(-1), seq[:, 5:])


def test_an_energy_trace_with_a_decoding_cache_is_refused():
  # Cached decoding keeps no trace: asking for one was silently ignored.
  graphdef, params = _model(dict(block="cem"))
  model = nnx.merge(graphdef, params)
  with pytest.raises(ValueError, match=r"^DecoderLM: trace=True with a decoding cache"):
    model(jnp.zeros((1, 3), jnp.int32), trace=True, cache=model.init_cache(1, 8))


def test_top_p_measures_the_mass_of_the_tempered_distribution():
  """The nucleus is taken from the distribution that is sampled, softmax(logits / T), not from
  softmax(logits): at T = 2, [2, 1, 0] has probabilities [0.506, 0.307, 0.186], so top_p = 0.6
  keeps two tokens (at T = 1 the first alone holds 0.665)."""
  logits = jnp.asarray([[2.0, 1.0, 0.0]])
  out = np.asarray(sample.filter_logits(logits, 2.0, 0, 0.6))
  assert np.isfinite(out).tolist() == [[True, True, False]]
  assert np.isfinite(np.asarray(sample.filter_logits(logits, 1.0, 0, 0.6))).tolist() == [
      [True, False, False]]


# Settings out of range were taken silently by generate (the CLI checked its flags, callers of
# the function got greedy for temperature=-1, a NaN-embedding prompt for an id >= vocab_size,
# ids truncated from floats, the identity for num_steps=0): each is one line now.
@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-1.0), r"temperature=-1.0; allowed: 0 \(greedy\) or a finite number > 0"),
    (dict(temperature=float("nan")), r"temperature=nan; allowed: 0 \(greedy\)"),
    (dict(temperature=1.0, top_k=-3), r"top_k=-3; allowed: 0 \(off\) or 1..vocab_size"),
    (dict(temperature=1.0, top_k=2.5), r"top_k=2.5; allowed: 0 \(off\) or 1..vocab_size"),
    (dict(temperature=1.0, top_k=V + 1), rf"top_k={V + 1}; allowed: 0 \(off\) or 1..{V} \(the "
                                         r"vocabulary\)"),
    (dict(temperature=1.0, top_p=0.0), r"top_p=0.0; allowed: 0 < top_p <= 1"),
    (dict(temperature=1.0, top_p=float("nan")), r"top_p=nan; allowed: 0 < top_p <= 1"),
    (dict(top_k=2), r"top_k=2 top_p=1.0 have no effect with temperature=0 \(greedy\)"),
    (dict(prompt=[[1, V, 3]]), rf"prompt holds token id {V}; allowed: 0..{V - 1} \(the "
                               r"vocabulary\)"),
    (dict(prompt=[[1, -1, 3]]), rf"prompt holds token id -1; allowed: 0..{V - 1}"),
    (dict(prompt=[[1.7, 2.0]]), r"prompt has dtype float64; allowed: integer token ids"),
    (dict(max_new_tokens=2.5), r"max_new_tokens=2.5; allowed: an int >= 1"),
    (dict(num_steps=0), r"DecoderLM: num_steps=0; allowed: an int >= 1 and < 2\*\*8 \(every "
                        r"step is unrolled into the compiled program\) \(None: model.num_steps\)"),
], ids=lambda v: str(v)[:30])
@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_refuses_settings_out_of_range_in_one_line(kwargs, message, use_cache):
  graphdef, params = _model(dict(block="cem"))
  kwargs = {"prompt": [[1, 2, 3]], "max_new_tokens": 2, **kwargs}
  prompt, n = np.asarray(kwargs.pop("prompt")), kwargs.pop("max_new_tokens")
  with pytest.raises(ValueError, match=rf"^{message}[^\n]*$"):
    sample.generate(graphdef, params, prompt, n, use_cache=use_cache, **kwargs)


def test_decoding_refuses_a_cache_that_does_not_fit_the_call():
  """A decoding call the cache does not fit gave wrong logits without an error: a write past
  max_len is clamped onto the last slots (dynamic_update_slice), and a co-evolving context or
  the standard attention at more steps than the cache's copies reads the last copy and writes
  none. Each is refused in one line now."""
  graphdef, params = _model(dict(block="cem", num_steps=2, context="coevolve"))
  model = nnx.merge(graphdef, params)
  one = jnp.asarray([[1]])

  def refused(message, tokens, cache, index, num_steps=None):
    with pytest.raises(ValueError, match=rf"^DecoderLM: {message}[^\n]*$"):
      model(tokens, cache=cache, index=index, num_steps=num_steps)

  cache = model.init_cache(1, 4)
  refused(r"6 new tokens exceed the cache's max_len=4", jnp.ones((1, 6), jnp.int32), cache, 0)
  refused(r"index=4 for 1 new tokens in a cache of max_len=4; allowed: 0..3", one, cache, 4)
  refused(r"index=3 for 2 new tokens in a cache of max_len=4; allowed: 0..2",
          jnp.ones((1, 2), jnp.int32), cache, 3)
  refused(r"index=-1 for 1 new tokens", one, cache, -1)
  refused(r"the cache does not fit this call \(batch=2, num_steps=2\): layer 0 holds context "
          r"\[2, 1, 4, 64\] float32, the call needs context \[2, 2, 4, 64\] float32",
          jnp.ones((2, 1), jnp.int32), cache, 0)
  # test-time steps: a cache made for T = 2 at T = 3, and for T = 3 at T = 2
  refused(r"the cache does not fit this call \(batch=1, num_steps=3\): layer 0 holds context "
          r"\[2, 1, 4, 64\]", one, cache, 0, num_steps=3)
  refused(r"the cache does not fit this call \(batch=1, num_steps=2\)", one,
          model.init_cache(1, 4, num_steps=3), 0)
  refused(r"num_steps=0; allowed: an int >= 1", one, cache, 0, num_steps=0)
  # another model's cache: one layer fewer
  other = nnx.merge(*_model(dict(block="cem", num_steps=2, context="coevolve", num_layers=1)))
  refused(r"the cache holds 1 layers, this model runs 2; make it with this model's init_cache$",
          one, other.init_cache(1, 4), 0)
  with pytest.raises(ValueError, match=r"^DecoderLM: segment_ids with a decoding cache; "):
    model(one, jnp.asarray([[0]]), cache=cache, index=0)  # padding that was ignored
  with pytest.raises(ValueError, match=r"^DecoderLM.init_cache: batch=1, max_len=0; allowed"):
    model.init_cache(1, 0)
  with pytest.raises(ValueError, match=r"^DecoderLM: num_steps=0; allowed"):
    model.init_cache(1, 4, num_steps=0)
