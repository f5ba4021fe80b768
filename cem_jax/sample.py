"""Generate text from a trained run: ``python -m cem_jax.sample --workdir=DIR --prompt="..."``.

Loads the run's config, tokenizer and newest checkpoint, then samples with a decoding cache
(Llama: rotated keys and values; CEM: the layer context, whose keys double as values, or
each recursive step's keys and values with ``model.cem_attention=False``) —
greedy (``--temperature=0``), or temperature with optional top-k / top-p (nucleus) filtering.
``--no_cache`` recomputes the whole prefix at every token (the reference the cache is tested
against: greedy tokens are identical).
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING

import numpy as np
from absl import app, flags, logging

from cem_jax import cli
from cem_jax import config as config_lib
from cem_jax.config import check_writable, shown

# jax, flax and the model are imported where they are used: the command line's flags are
# checked before (a bad flag is refused in a fraction of a second, not after jax's start-up).
if TYPE_CHECKING:
  import jax


def filter_logits(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
  """Scaled and filtered logits ``[batch, vocab]`` float32, shifted so that each row's largest
  is 0 (the same distribution; removed entries are -inf): top-k
  (Fan et al. 2018) and nucleus top-p (Holtzman et al. 2020, arXiv:1904.09751) sampling.

  ``top_k`` keeps exactly ``k`` tokens and ``top_p`` exactly the smallest prefix of the tokens
  sorted by logit whose probability mass reaches ``top_p``. Equal logits are ordered by token
  id (the lower id first), so ties never let an extra token through and the kept set is the
  same on every call. ``top_k`` <= 0 and ``top_p`` >= 1 disable those filters;
  ``temperature`` must be > 0.
  """
  import jax
  import jax.numpy as jnp

  # The ranking is taken from the logits themselves, the probabilities from the scaled ones
  # shifted to a maximum of 0: a tiny temperature then tends to greedy (no inf - inf), and a
  # huge one cannot collapse the ranking into ties.
  # Past float32's largest the cast to float32 is inf (the same limit: every kept token alike)
  # and NumPy warned "overflow encountered in cast" from inside jax on the user's terminal.
  temperature = min(temperature, float(np.finfo(np.float32).max))
  logits = logits.astype(jnp.float32)
  shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
  # 0 stays 0 where a temperature below float32's range is flushed to 0 (0/0 would be nan).
  scaled = jnp.where(shifted < 0, shifted / temperature, 0.0)
  rows = jnp.arange(logits.shape[0])[:, None]
  keep = jnp.ones(logits.shape, bool)
  if top_k > 0:
    # lax.top_k returns k indices, the lower index first among equal values: a threshold
    # (logits >= the k-th largest) would keep every token tied with the k-th.
    _, kept = jax.lax.top_k(logits, top_k)
    keep = jnp.zeros(logits.shape, bool).at[rows, kept].set(True)
  if top_p < 1.0:
    # Kept tokens by logit, the lower id first among ties; the removed ones last.
    order = jnp.argsort(-jnp.where(keep, logits, -jnp.inf), axis=-1, stable=True)
    probs = jax.nn.softmax(
        jnp.take_along_axis(jnp.where(keep, scaled, -jnp.inf), order, axis=-1), axis=-1)
    # a token stays when the mass before it is < top_p; the first always stays (also when
    # top_p is below float32's smallest number)
    keep_sorted = ((jnp.cumsum(probs, axis=-1) - probs) < top_p).at[:, 0].set(True)
    keep = keep & jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
  return jnp.where(keep, scaled, -jnp.inf)


def _choose(logits, rng, temperature, top_k, top_p):
  import jax
  import jax.numpy as jnp

  if temperature <= 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(rng, filter_logits(logits, temperature, top_k, top_p)).astype(
      jnp.int32)


def check_sampling(temperature: float, top_k: int, top_p: float,
                   vocab_size: int | None = None, flag: str = "") -> None:
  """Refuses sampling settings out of range, in one line naming the setting (``flag``
  prefixes each name: ``'--'`` for the command line): ``temperature`` 0 (greedy) or finite
  > 0; ``top_k`` 0 (off) or 1..``vocab_size`` (unbounded while ``vocab_size`` is None);
  ``0 < top_p <= 1``; with greedy, ``top_k`` and ``top_p`` left at 0 and 1 (they would have
  no effect).

  Raises:
    ValueError: the first setting out of range.
  """
  if not 0.0 <= temperature < float("inf"):  # also rejects nan
    raise ValueError(f"{flag}temperature={temperature}; allowed: 0 (greedy) or a finite "
                     "number > 0")
  # Not an int: jax.lax.top_k's own TypeError, deep in the first sampling step.
  if isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 0:
    raise ValueError(f"{flag}top_k={shown(top_k)}; allowed: 0 (off) or 1..vocab_size")
  if vocab_size is not None and top_k > vocab_size:
    raise ValueError(f"{flag}top_k={shown(top_k)}; allowed: 0 (off) or 1..{vocab_size} (the "
                     "vocabulary)")
  check_writable(f"{flag}top_k", top_k)  # no vocabulary yet: over 4300 digits is none's
  if not 0.0 < top_p <= 1.0:  # also rejects nan
    raise ValueError(f"{flag}top_p={top_p}; allowed: 0 < top_p <= 1")
  if temperature == 0.0 and (top_k or top_p < 1.0):
    raise ValueError(f"{flag}top_k={top_k} {flag}top_p={top_p} have no effect with "
                     f"{flag}temperature=0 (greedy); leave them at 0 and 1")


def generate(graphdef, params, prompt: np.ndarray, max_new_tokens: int, *, rng=None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             use_cache: bool = True, num_steps: int | None = None) -> np.ndarray:
  """Continues ``prompt`` (``[batch, prompt_len]`` int) by ``max_new_tokens`` tokens.

  Returns ``[batch, max_new_tokens]`` int32 new token ids. ``temperature`` 0 is greedy.
  ``num_steps`` overrides a CEM model's recursive steps. ``graphdef, params`` are
  ``nnx.split(model, nnx.Param)`` of a ``DecoderLM`` (the vocabulary size is read from
  ``params["embedding"]``, without building the model).

  Raises:
    ValueError: ``prompt`` not ``[batch, prompt_len >= 1]`` integer ids in
      ``[0, vocab_size)``, ``max_new_tokens`` < 1, or sampling settings out of range
      (:func:`check_sampling`).
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from cem_jax.model import check_num_steps

  prompt = np.asarray(prompt)
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must be [batch, prompt_len >= 1], got shape {prompt.shape}")
  if not np.issubdtype(prompt.dtype, np.integer):  # not truncated to ids
    raise ValueError(f"prompt has dtype {prompt.dtype}; allowed: integer token ids")
  if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r}; allowed: an int >= 1")
  check_num_steps(num_steps)  # here, not in the jitted step: its error is one line
  vocab = params["embedding"].shape[0]  # DecoderLM's [vocab_size, d_model] table
  check_sampling(temperature, top_k, top_p, vocab)
  # An id out of range reads a NaN embedding row (jnp.take fills) and decodes garbage.
  bad = prompt[(prompt < 0) | (prompt >= vocab)]
  if bad.size:
    raise ValueError(f"prompt holds token id {bad[0]}; allowed: 0..{vocab - 1} (the "
                     "vocabulary)")
  prompt = prompt.astype(np.int32)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  batch, plen = prompt.shape
  total = plen + max_new_tokens
  choose = functools.partial(_choose, temperature=temperature, top_k=top_k, top_p=top_p)
  out = []
  if use_cache:
    @jax.jit
    def step(params, cache, tokens, index, rng):
      logits, cache = nnx.merge(graphdef, params)(tokens, cache=cache, index=index,
                                                  num_steps=num_steps)
      return choose(logits[:, -1], rng), cache

    cache = nnx.merge(graphdef, params).init_cache(batch, total, num_steps)
    rng, sub = jax.random.split(rng)
    token, cache = step(params, cache, jnp.asarray(prompt), 0, sub)  # prefill
    out.append(token)
    for i in range(plen, total - 1):
      rng, sub = jax.random.split(rng)
      token, cache = step(params, cache, token[:, None], i, sub)
      out.append(token)
  else:
    @jax.jit
    def full(params, tokens, rng):
      logits = nnx.merge(graphdef, params)(tokens, num_steps=num_steps)
      return choose(logits[:, -1], rng)

    tokens = jnp.asarray(prompt)
    for _ in range(max_new_tokens):
      rng, sub = jax.random.split(rng)
      token = full(params, tokens, sub)
      out.append(token)
      tokens = jnp.concatenate([tokens, token[:, None]], axis=1)
  return np.asarray(jnp.stack(out, axis=1))


def main(argv):
  cli.no_extra_args(argv)
  fl = flags.FLAGS
  if not fl["verbosity"].present:
    # The text is the output: Orbax logs every restore (INFO) and its read-only mode
    # (WARNING); our own warnings, e.g. a damaged newest checkpoint, still show.
    logging.set_verbosity(logging.WARNING)
    cli.quiet_libraries(logging.logging.ERROR)  # a Python logging level
  with cli.user_errors():
    config_lib.check_count("--max_new_tokens", fl.max_new_tokens)
    check_sampling(fl.temperature, fl.top_k, fl.top_p, flag="--")
    # jax.random.PRNGKey takes a signed 64-bit seed (2**64 was an OverflowError traceback
    # after the run was loaded): the run's own seed's rule.
    config_lib.check_flag("--seed", "seed", fl.seed)
    if fl.temperature == 0.0 and fl["seed"].present:
      raise ValueError(f"--seed={fl.seed} has no effect with --temperature=0 (greedy): "
                       "the most likely token is taken; leave --seed out")
    if not fl.prompt:
      raise ValueError("--prompt is empty; give at least one character")
    try:
      fl.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes the shell passed that are not UTF-8
      raise ValueError(f"--prompt={fl.prompt!r} is not UTF-8 text (at character {e.start}); "
                       "give it in UTF-8") from None
    cli.check_folder("workdir", fl.workdir, "a trained run's folder")
    import jax

    from cem_jax import runs
    config, data, graphdef, params, step = runs.load_run(fl.workdir,
                                                         attention_impl=fl.attention_impl)
    check_sampling(fl.temperature, fl.top_k, fl.top_p, data.tokenizer.vocab_size, "--")
    ids = data.tokenizer.encode(fl.prompt)
    if not ids:
      raise ValueError(f"--prompt={fl.prompt!r} encodes to no tokens; give some text")
    if len(ids) >= config.data.seq_len:
      raise ValueError(
          f"--prompt is {len(ids)} tokens; allowed: at most {config.data.seq_len - 1}, so that "
          f"one new token fits in data.seq_len={config.data.seq_len}, the longest context the "
          "model was trained on")
    if len(ids) + fl.max_new_tokens > config.data.seq_len:
      room = config.data.seq_len - len(ids)
      raise ValueError(
          f"--prompt ({len(ids)} token{'s' * (len(ids) != 1)}) + --max_new_tokens="
          f"{config_lib.shown(fl.max_new_tokens)} exceeds data.seq_len={config.data.seq_len}, "
          "the longest context the model was trained on; "
          f"allowed: at most {room} new token{'s' * (room != 1)} for this prompt")
    print(f"sampling from {fl.workdir}, checkpoint step {step}", file=sys.stderr)
    new = generate(graphdef, params, np.asarray([ids]), fl.max_new_tokens,
                   rng=jax.random.PRNGKey(fl.seed), temperature=fl.temperature,
                   top_k=fl.top_k, top_p=fl.top_p, use_cache=not fl.no_cache)
  print(fl.prompt + data.tokenizer.decode(new[0].tolist()))


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A trained run's folder.")
  flags.DEFINE_string("prompt", None, "Text to continue (at least one character).")
  flags.DEFINE_integer("max_new_tokens", 100, "Tokens to generate.")
  flags.DEFINE_float("temperature", 0.8, "Sampling temperature, finite and >= 0; 0 = greedy "
                     "(the most likely token; --top_k, --top_p and --seed then left out).")
  flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens, 1..vocab_size (0: all).")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass, 0 < top_p <= 1 (1: off).")
  flags.DEFINE_integer("seed", 0, "Sampling seed (refused with --temperature=0: greedy).")
  flags.DEFINE_bool("no_cache", False, "Recompute the prefix at every token.")
  cli.define_attention_impl_flag(config_lib.ATTENTION_IMPLEMENTATIONS)
  cli.require("workdir", "prompt")
  app.run(main, flags_parser=cli.parse_flags)
