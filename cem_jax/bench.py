"""Training-step benchmark of Llama and CEM variants in one run: ``python -m cem_jax.bench``.

For each variant × shape it measures compile time, step time (the mean of the preset's
``steps`` run back to back after its ``warmup``, as training dispatches them; the median of
steps waited for one by one as ``step_ms_synced``), tokens/s, analytic model FLOPs per
token, MFU (when the device's peak is known) and peak device memory, prints a table and
writes JSON.

    python -m cem_jax.bench --preset=tiny                  # CPU, ~1 min for all 8 variants
    python -m cem_jax.bench --preset=cpu --variants=llama,cem_fused  # CPU, the tiny LM's size
    python -m cem_jax.bench --preset=gpu125m --out=bench.json   # one GPU, ~125M, bf16
    python -m cem_jax.bench --preset=gpu125m --attention_impl=xla  # the XLA attention path
    python -m cem_jax.bench --preset=gpu125m --loss_block_size=256  # logits 256 positions at once
    python -m cem_jax.bench --preset=tiny --profile_dir=/tmp/prof  # + a trace of each row

Analytic FLOPs per token: :func:`cem_jax.model_stats.flops_per_token` (formula there).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
from absl import app, flags

# Without jax (and flax, and the modules that import them: those are imported in the functions
# that run the model): `python -m cem_jax.bench` refuses a bad flag in a fraction of a second,
# not after jax's seconds of import.
from cem_jax import cli, errors
from cem_jax import config as config_lib
from cem_jax.config import get_default_config
from cem_jax.data import make_batch
from cem_jax.files import atomic_write_json, check_can_write

VARIANTS = {
    "llama": dict(block="llama"),
    "cem_fused": dict(block="cem", update_mode="fused"),
    "cem_autodiff": dict(block="cem", update_mode="autodiff"),
    "cem_fused_T2": dict(block="cem", update_mode="fused", num_steps=2),
    "cem_fused_diag": dict(block="cem", update_mode="fused", diagonal="per_head"),
    # jax.grad of the energy with the online log-sum-exp over 512-key blocks.
    "cem_autodiff_blocks": dict(block="cem", update_mode="autodiff", energy_block_size=512),
    # Packed documents (model.document_mask=True, 4 documents per window): the kernel gets
    # segment ids (splash) or a dense mask (XLA; cuDNN as a bias), never is_causal alone.
    "llama_docs": dict(block="llama", document_mask=True),
    "cem_fused_docs": dict(block="cem", update_mode="fused", document_mask=True),
}

PRESETS = {
    # Each batch holds tokens_per_batch tokens (batch = tokens_per_batch // seq_len), so the
    # seq_len sweep shows the attention's n² cost at a constant number of tokens.
    # document_mask: the model.document_mask of every variant that does not set its own
    # (True: packed documents, an explicit mask or segment ids; False: plain causal attention
    # over the window, which cuDNN and splash take as structure, no n x n array). Override
    # with --document_mask. The kernel is model.attention_impl ('auto'; --attention_impl).
    "tiny": dict(d_model=64, num_layers=2, num_heads=4, mlp_dim=256, vocab_size=512,
                 tokens_per_batch=512, seq_lens=[64, 128], widths=[64, 128],
                 dtype="float32", steps=10, warmup=2, document_mask=True),
    "cpu": dict(d_model=128, num_layers=4, num_heads=4, mlp_dim=512, vocab_size=1024,
                tokens_per_batch=2048, seq_lens=[128, 256, 512, 1024], widths=[128, 256],
                dtype="float32", steps=10, warmup=2, document_mask=True),
    "gpu125m": dict(d_model=768, num_layers=12, num_heads=12, mlp_dim=2048, vocab_size=32768,
                    tokens_per_batch=16384, seq_lens=[1024, 4096], widths=[768],
                    dtype="bfloat16", steps=10, warmup=3, document_mask=False),
    # The same model at 4x the tokens per batch (65,536), where kernel launch and optimizer
    # overheads weigh less.
    "gpu125m_64k": dict(d_model=768, num_layers=12, num_heads=12, mlp_dim=2048,
                        vocab_size=32768, tokens_per_batch=65536, seq_lens=[1024, 4096],
                        widths=[768], dtype="bfloat16", steps=10, warmup=3,
                        document_mask=False),
}
DOCUMENTS_PER_WINDOW = 4  # the benchmark batch's packed documents (equal lengths)


def model_config(preset: dict, variant: dict, seq_len: int, width: int,
                 attention_impl: str | None = None, loss_block_size: int = 0):
  """The config of one bench row: the defaults with ``preset``'s model (a :data:`PRESETS`
  entry) scaled to ``d_model=width`` (heads and ``mlp_dim`` in proportion), then
  ``variant``'s ``model.*`` values (a :data:`VARIANTS` entry: they win over the preset's,
  its ``document_mask`` among them), ``model.attention_impl`` when given,
  ``data.seq_len=seq_len``, ``train.loss_block_size`` and as many rows as fill the preset's
  ``tokens_per_batch`` (at least 1). Also what ``experiments/step_program.py`` compiles."""
  c = get_default_config()
  m = c.model
  m.d_model = width
  m.num_heads = max(1, preset["num_heads"] * width // preset["d_model"])
  m.mlp_dim = preset["mlp_dim"] * width // preset["d_model"]
  m.num_layers = preset["num_layers"]
  m.dtype = preset["dtype"]
  m.document_mask = preset.get("document_mask", True)
  for k, v in variant.items():
    m[k] = v
  if attention_impl is not None:
    m.attention_impl = attention_impl
  c.data.seq_len = seq_len
  c.train.batch_size = max(1, preset["tokens_per_batch"] // seq_len)
  c.train.loss_block_size = loss_block_size
  return c


class RowsFailed(RuntimeError):
  """Rows of a :func:`run` sweep failed; the others were measured (and written)."""


PROFILE_STEPS = 2  # steps traced after the timed ones (--profile_dir)
# Environment variables recorded in the JSON when set: they change the compiled program or
# what memory it may use, so two files are comparable only where these agree.
ENVIRONMENT = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
               "XLA_PYTHON_CLIENT_ALLOCATOR", "LIBTPU_INIT_ARGS")


def train_step_inputs(config, vocab_size: int, abstract: bool = False,
                      platform: str | None = None):
  """The training step that :func:`bench_one` times, and its inputs.

  Args:
    config: a full config (``model``, ``train``, ``data.seq_len``).
    vocab_size: the model's vocabulary.
    abstract: build the model and optimizer state as shapes only (``nnx.eval_shape``,
      ``jax.eval_shape``): enough to lower and compile the step, with no memory for them.
    platform: the platform the model's attention kernel is chosen for (``DecoderLM``): this
      machine's if None.
  Returns:
    ``(model, step, params, opt_state, batch)``: the ``DecoderLM`` (seed 0), the jitted
    ``step(params, opt_state, batch)`` of :func:`cem_jax.steps.make_train_step`, and a batch
    of ``train.batch_size`` windows of ``data.seq_len`` random int32 tokens (seed 0), each
    packing :data:`DOCUMENTS_PER_WINDOW` equal documents.
  """
  import jax
  from flax import nnx

  from cem_jax import optim
  from cem_jax import steps as steps_lib
  from cem_jax.model import DecoderLM

  build = lambda: DecoderLM(config.model, vocab_size, rngs=nnx.Rngs(0),
                            platform=platform)
  model = nnx.eval_shape(build) if abstract else build()
  graphdef, params = nnx.split(model, nnx.Param)
  tx, _ = optim.make_optimizer(config.train)
  opt_state = jax.eval_shape(tx.init, params) if abstract else tx.init(params)
  step = steps_lib.make_train_step(graphdef, tx,
                                   loss_block_size=config.train.loss_block_size)
  b, n = config.train.batch_size, config.data.seq_len
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab_size, (b, n + 1), dtype=np.int32)
  segment_ids = 1 + np.arange(n + 1, dtype=np.int32) * DOCUMENTS_PER_WINDOW // (n + 1)
  batch = make_batch(tokens, np.broadcast_to(segment_ids, (b, n + 1)))
  return model, step, params, opt_state, batch


def bench_one(config, vocab_size: int, steps: int, warmup: int,
              profile_dir: str | None = None) -> dict:
  """Compiles and times one training step of ``config``; returns the figures as a dict.

  With ``profile_dir``, :data:`PROFILE_STEPS` more steps run after the timed ones under the
  jax profiler (:func:`cem_jax.profiling.start_trace`; each step marked ``train``): the timing
  never includes tracing. Key ``profile``: that folder (the files are in its
  ``plugins/profile/<time>/``); ``profile_error``: why there is no trace, if there is none
  (the figures are kept); ``kernels``: the traced steps' device time by kind of kernel
  (:func:`cem_jax.profiling.kernel_summary`), or ``kernels_error``: why not (a CPU has no
  device process in its trace).

  Raises:
    ValueError: the step does not fit the device's memory (on a CPU, the host's memory and
      swap), as :func:`cem_jax.memory.compile_within_memory` finds it after compiling, before
      any step runs: :func:`run` records it as the row's error.

  Keys: ``attention`` and ``attention_reason`` (the kernel its step runs at this seq_len:
  ``DecoderLM.kernel_at``), ``params``,
  ``compile_s`` (seconds), ``step_ms`` (milliseconds: the mean of ``steps`` steps run back to
  back, waited for once, as the training loop dispatches them; after ``warmup`` steps and
  ``steps`` steps each waited for), ``step_ms_synced`` (the median of those ``steps`` waited
  for one by one: the host's dispatch of each step included; ``step_ms`` before 2026-12-04),
  ``tokens_per_s``, ``flops_per_token`` (analytic forward FLOPs), ``tflops_per_s`` (3× forward
  per token, in 10¹² FLOP/s), ``mfu`` (a fraction of the device's ``model_stats.PEAK_FLOPS``; None
  when unknown; the three None for a model with a user energy, whose operations are not
  modelled: :func:`cem_jax.model.known_flops_per_token`), ``peak_memory_mb`` (MiB, 2²⁰ bytes, of
  XLA's memory analysis; None when not reported) and ``loss`` (nats/token of the last step;
  None if not finite: strict JSON has no NaN).
  """
  import jax

  from cem_jax import memory, profiling
  from cem_jax.model import known_flops_per_token
  from cem_jax.model_stats import count_params, peak_flops

  model, step, params, opt_state, batch = train_step_inputs(config, vocab_size)
  b, n = config.train.batch_size, config.data.seq_len
  t0 = time.perf_counter()
  # Refused here, a row's error, where the step cannot fit: on a CPU the first step of
  # --preset=gpu125m (43 GiB) had the kernel kill the whole sweep (exit status 137, no line).
  compiled = memory.compile_within_memory(
      step, (params, opt_state, batch), config, what=f"the training step at seq_len {n}, "
      f"batch {b}, d_model {config.model.d_model}",
      advice="run a smaller --preset on this machine, or give --loss_block_size (now "
             f"{config.train.loss_block_size}) to make the logits in blocks")
  compile_s = time.perf_counter() - t0
  synced = []
  for i in range(warmup + steps):
    t0 = time.perf_counter()
    params, opt_state, metrics = compiled(params, opt_state, batch)
    jax.block_until_ready(metrics["loss"])
    if i >= warmup:
      synced.append(time.perf_counter() - t0)
  # The figure: steps dispatched back to back, waited for once, as the training loop runs them
  # (it waits only to log). Waiting for each step adds the host's dispatch of the next to the
  # device's time: ~2 ms a step on an H200 at 125M (a gap between steps in the profile).
  t0 = time.perf_counter()
  for _ in range(steps):
    params, opt_state, metrics = compiled(params, opt_state, batch)
  jax.block_until_ready((params, metrics["loss"]))
  step_s = (time.perf_counter() - t0) / steps
  profile_error = profiling.start_trace(profile_dir) if profile_dir else None
  if profile_dir and not profile_error:
    try:
      for i in range(PROFILE_STEPS):
        with profiling.step_marker(i + 1):
          params, opt_state, metrics = compiled(params, opt_state, batch)
      jax.block_until_ready(metrics["loss"])  # the traced steps' device work is in the trace
    finally:
      profile_error = profiling.stop_trace()
  kernels = kernels_error = None
  if profile_dir and not profile_error:
    try:
      kernels = profiling.kernel_summary(profile_dir, PROFILE_STEPS)
    except Exception as e:  # noqa: BLE001 - an aid: e.g. a CPU has no device process; the row
      kernels_error = str(e) if isinstance(e, ValueError) else errors.one_line(e)  # keeps on
  fpt = known_flops_per_token(config.model, vocab_size, n)  # None: no TFLOP/s or MFU either
  achieved = 3 * fpt * b * n / step_s if fpt is not None else None
  peak = peak_flops()
  kernel, reason = model.kernel_at(n)
  return {
      "attention": kernel,
      "attention_reason": reason,
      "params": count_params(model),
      "compile_s": compile_s,
      "step_ms": 1e3 * step_s,
      "step_ms_synced": 1e3 * statistics.median(synced),
      "tokens_per_s": b * n / step_s,
      "flops_per_token": fpt,
      "tflops_per_s": achieved / 1e12 if achieved is not None else None,
      "mfu": achieved / peak if peak and achieved is not None else None,
      "peak_memory_mb": (lambda m: m / 2**20 if m else None)(memory.footprint_bytes(compiled)),
      "loss": (lambda x: x if np.isfinite(x) else None)(float(metrics["loss"])),  # JSON
      **({"profile": profile_dir} if profile_dir else {}),
      **({"profile_error": profile_error} if profile_error else {}),
      **({"kernels": kernels} if kernels else {}),
      **({"kernels_error": kernels_error} if kernels_error else {}),
  }


def run(preset: str, variants: list[str], out: str | None = None,
        document_mask: bool | None = None, attention_impl: str | None = None,
        loss_block_size: int = 0, profile_dir: str | None = None) -> list[dict]:
  """Benchmarks ``variants`` over the preset's seq_len and width sweeps; prints and returns rows.

  ``document_mask`` overrides the preset's ``model.document_mask`` (variants that set it
  keep theirs); ``attention_impl`` sets ``model.attention_impl`` of every variant (default:
  the config's 'auto'). ``loss_block_size`` sets ``train.loss_block_size`` (the logits
  made that many positions at a time; 0: all at once). Each row records the kernel the model
  actually used. ``profile_dir``: each row also traces :data:`PROFILE_STEPS` steps after its
  timed ones into ``profile_dir/<variant>_<seq_len>_<d_model>`` (:func:`bench_one`).

  Rows run variant by variant in the order of ``variants``, each over every shape; each row
  records ``wall_s``, its whole cost in seconds (compile, steps, trace). The printed table is
  ordered by shape. ``out`` (JSON: ``device``, ``platform``, ``jax``, ``environment`` (the
  variables of :data:`ENVIRONMENT` that are set), ``preset``, ``rows`` in the order they ran,
  ``complete``, ``failed``) is rewritten atomically after every row,
  ``complete`` false until the last: a sweep stopped by a time limit (a lent GPU's) keeps the
  rows it measured, every shape of the variants it reached. A row whose
  config or kernel fails (an ``Exception``: out of memory, a kernel that refuses the shape)
  is recorded with its ``error`` (type and first line) instead of figures, printed, and the
  sweep goes on to the next row; ``failed`` counts them.

  Raises:
    KeyError: an unknown ``preset`` or variant name (``main`` checks them first).
    ValueError: no variants; ``document_mask`` given with only variants that set their own;
      a row's config or kernel that cannot run here
      (``preflight.check``, the model's kernel choice), before any row is measured.
    RowsFailed: after the whole sweep, when a row failed (one line naming the rows; the
      figures of the others are in ``out`` and printed).
  """
  if not variants:
    raise ValueError(f"no variants to run; allowed: one or more of {', '.join(VARIANTS)}")
  if document_mask is not None and all("document_mask" in VARIANTS[v] for v in variants):
    # The variants' own value wins (model_config): the flag would change no row.
    raise ValueError(f"--document_mask={str(document_mask).lower()} has no effect on "
                     f"--variants={','.join(variants)}: each sets its own model.document_mask; "
                     "leave it out, or add a variant that does not set it (e.g. llama)")
  import jax

  from cem_jax import preflight
  from cem_jax.model import abstract_model

  p = dict(PRESETS[preset])
  if document_mask is not None:
    p["document_mask"] = document_mask
  shapes = [(n, p["d_model"]) for n in p["seq_lens"]]
  shapes += [(p["seq_lens"][0], w) for w in p["widths"] if w != p["d_model"]]
  rows = []
  device = jax.local_devices()[0]
  # What else decides the figures: XLA's flags (a kernel or scheduler switched on or off) and
  # the share of device memory jax may take.
  environment = {k: os.environ[k] for k in ENVIRONMENT if k in os.environ}
  print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, "
        f"preset {preset}, {p['tokens_per_batch']} tokens per batch, {p['dtype']}, "
        f"document_mask={p['document_mask']}, attention_impl={attention_impl or 'auto'}, "
        f"loss_block_size={loss_block_size}"
        + "".join(f", {k}={v!r}" for k, v in environment.items()),
        flush=True)
  # Variant by variant, in the order given: a sweep cut off by a time limit has every shape
  # of the variants it reached (the comparisons across seq_len need them), not a seq_len of all.
  todo = [(n, width, name) for name in variants for n, width in shapes]
  configs = [model_config(p, VARIANTS[name], n, width, attention_impl, loss_block_size)
             for n, width, name in todo]
  for cfg in configs:  # what no row could run fails now, in one line, before any is measured
    # The model first: its kernel choice knows this machine (cuDNN on a CPU: "needs a GPU").
    abstract_model(cfg.model, p["vocab_size"])
    preflight.check(cfg)
  for i, ((n, width, name), cfg) in enumerate(zip(todo, configs, strict=True)):
    row = {"variant": name, "seq_len": n, "d_model": width,
           "document_mask": cfg.model.document_mask, "loss_block_size": loss_block_size}
    t0 = time.perf_counter()
    try:
      trace_dir = (os.path.join(profile_dir, f"{name}_{n}_{width}") if profile_dir
                   else None)
      row.update(bench_one(cfg, p["vocab_size"], p["steps"], p["warmup"], trace_dir))
    except Exception as e:  # noqa: BLE001 - recorded in the row; the sweep measures the rest
      row["error"] = errors.one_line(e)[:300]
    row["wall_s"] = time.perf_counter() - t0  # the row's whole cost: plan a time-limited call
    rows.append(row)
    print(json.dumps(row), flush=True)
    failed = [r for r in rows if "error" in r]
    if out:
      atomic_write_json(out, {"device": device.device_kind, "platform": device.platform,
                              "jax": jax.__version__, "environment": environment,
                              "preset": preset, "rows": rows,
                              "complete": i == len(todo) - 1, "failed": len(failed)})
  order = {shape: i for i, shape in enumerate(shapes)}  # read by shape: the ratios' columns
  print(format_table(sorted(rows, key=lambda r: order[(r["seq_len"], r["d_model"])])))
  if failed:
    raise RowsFailed(f"{len(failed)} of {len(rows)} rows failed: " + "; ".join(
        f"{r['variant']} at seq_len {r['seq_len']}, d_model {r['d_model']}: {r['error']}"
        for r in failed))
  return rows


def format_table(rows: list[dict]) -> str:
  """A markdown table of the rows, with step-time ratios against Llama and fused CEM."""
  from cem_jax.model_stats import gflop_text

  base = {(r["seq_len"], r["d_model"], r["variant"]): r["step_ms"] for r in rows
          if "error" not in r}
  lines = ["| variant | attention | seq_len | d_model | params | compile s | step ms | "
           "tokens/s | GFLOP/token | MFU | peak MB | × llama | × cem_fused |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    if "error" in r:
      error = r["error"][:80].replace("|", "/")  # a | would end the table cell
      lines.append(f"| {r['variant']} | failed: {error} | {r['seq_len']} | "
                   f"{r['d_model']} |" + " |" * 9)
      continue
    key = (r["seq_len"], r["d_model"])
    ratio = lambda other, r=r, key=key: (f"{r['step_ms'] / base[(*key, other)]:.2f}"
                                         if (*key, other) in base else "")
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    mem = f"{r['peak_memory_mb']:.0f}" if r["peak_memory_mb"] is not None else "n/a"
    lines.append(
        f"| {r['variant']} | {r['attention']} | {r['seq_len']} | {r['d_model']} | "
        f"{r['params'] / 1e6:.2f}M | "
        f"{r['compile_s']:.1f} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
        f"{gflop_text(r['flops_per_token'])} | {mfu} | {mem} | {ratio('llama')} | "
        f"{ratio('cem_fused')} |")
  return "\n".join(lines)


def main(argv):
  cli.no_extra_args(argv)
  fl = flags.FLAGS
  with cli.user_errors():
    unknown = [v for v in fl.variants if v not in VARIANTS]
    if unknown or not fl.variants:
      raise ValueError(f"--variants={','.join(unknown)}; allowed: one or more of "
                       f"{', '.join(VARIANTS)}")
    twice = sorted({v for v in fl.variants if fl.variants.count(v) > 1})
    if twice:
      raise ValueError(f"--variants={','.join(fl.variants)}: {', '.join(twice)} given twice; "
                       "allowed: each variant once")
    # Found out now, not after the first row (or the whole sweep).
    config_lib.check_flag("--loss_block_size", "train.loss_block_size", fl.loss_block_size)
    cli.check_given("out", fl.out, "a JSON file's path (leave the flag out for none)")
    cli.check_given("profile_dir", fl.profile_dir, "a folder (leave the flag out for no trace)")
    out_dir = os.path.dirname(os.path.abspath(fl.out)) if fl.out else None
    if out_dir and not os.path.isdir(out_dir):
      raise ValueError(f"--out={fl.out}: folder {out_dir} does not exist")
    if fl.out and os.path.isdir(fl.out):
      raise ValueError(f"--out={fl.out} is a folder; give the JSON file's path")
    if fl.out:  # else found after the first row's compile and steps (minutes on a GPU)
      try:
        check_can_write(fl.out)
      except OSError as e:
        raise ValueError(f"--out={fl.out}: cannot write a file in {out_dir} ({e.strerror}); "
                         "give a path in a writable folder") from None
    if fl.profile_dir and os.path.exists(fl.profile_dir) and not os.path.isdir(fl.profile_dir):
      raise ValueError(f"--profile_dir={fl.profile_dir} is a file; give a folder (created if "
                       "missing)")
    document_mask = None if fl.document_mask is None else fl.document_mask.lower() == "true"
    try:
      run(fl.preset, fl.variants, fl.out, document_mask, fl.attention_impl,
          fl.loss_block_size, fl.profile_dir)
    except RowsFailed as e:  # said in one line, after the other rows' figures
      print(f"error: {e}", file=sys.stderr)
      sys.exit(1)


if __name__ == "__main__":
  flags.DEFINE_enum("preset", "tiny", list(PRESETS), "Model size and sweeps.")
  flags.DEFINE_list("variants", list(VARIANTS), "Which variants to run.")
  flags.DEFINE_string("out", None, "Write the rows as JSON here.")
  flags.DEFINE_enum("document_mask", None, ["true", "false"],
                    "Override the preset's model.document_mask (see PRESETS).")
  flags.DEFINE_enum("attention_impl", None, ["auto", "xla", "cudnn", "splash"],
                    "model.attention_impl of every variant (default: the config's 'auto').")
  flags.DEFINE_integer("loss_block_size", 0, "train.loss_block_size of every row: the logits "
                       "made this many positions at a time (0: all at once).")
  flags.DEFINE_string("profile_dir", None, "Also trace 2 steps of every row, after its timed "
                      "ones, into DIR/<variant>_<seq_len>_<d_model> (jax profiler; Perfetto).")
  app.run(main, flags_parser=cli.parse_flags)
