"""Prepare a corpus once: ``python -m cem_jax.prepare --config=CFG --out=DIR``.

Trains (or loads, with ``--config.data.tokenizer``) the tokenizer on the training split and
writes each split's token stream as sharded ArrayRecord files in ``DIR``, with the tokenizer
and a manifest (:mod:`cem_jax.data.shard_writer`; the format: :mod:`cem_jax.data.prepared`).
The source is the config's:
``--config.data.files=GLOB``, ``--config.data.tfds_name=NAME`` or the built-in corpus.
Encoding runs in worker processes (``--workers``, at most the CPUs this process may use;
default: every one of them,
at most one per shard of 16M characters, so several only from 16.8M characters of text on)
with a progress bar when stderr is a terminal. Killed,
it leaves no manifest; run again, it writes only the missing shards; complete, it is a no-op.
Failed before its first shard (bad input), it removes what it wrote, so the re-run with fixed
input starts afresh. Then train with
``python -m cem_jax.main --config=CFG --workdir=W --config.data.prepared_dir=DIR``.

The config is validated first, as ``cem_jax.main`` does (``cem_jax.config.validate``): a
config that main would reject prepares nothing. Exit status 0 when done, 1 with a one-line
``error: ...`` for bad input (an invalid config field, a flag, a source file).
"""

from __future__ import annotations

import shlex

from absl import app, flags, logging

from cem_jax import cli, cpus
from cem_jax import config as config_lib


def check_workers(workers) -> None:
  """Refuses a ``--workers`` count that is not an int >= 1 (:func:`cem_jax.config.check_count`)
  or is above :func:`cem_jax.cpus.usable`: encoding is CPU-bound, so more processes than CPUs
  add only memory (each a Python interpreter with one shard's text and tokens, ~100 MB), and
  ``--workers=10**6`` started processes until the machine ran out of memory.

  Raises:
    ValueError: one line, e.g. ``--workers=64; allowed: 1..16 (the CPUs this process may
      use)``.
  """
  config_lib.check_count("--workers", workers)
  usable = cpus.usable()
  if workers > usable:
    raise ValueError(f"--workers={workers}; allowed: 1..{usable} (the CPUs this process may "
                     "use: encoding is CPU-bound, more processes only take memory)")


def run(config, out: str, workers: int | None = None) -> None:
  """Validates ``config`` as main does, prepares its data into ``out``, prints each split.

  Raises:
    ValueError: a config main would reject, ``data.prepared_dir`` set, or ``workers`` not
      as :func:`check_workers` allows (one line naming the field or flag and the value); the
      source's own errors
      (:func:`cem_jax.data.shard_writer.prepare`).
  """
  # The checks main runs before training: data prepared from a config main rejects (or
  # from an option it would silently ignore) is a wasted, misleading preparation. The
  # config's own rules first, as main checks them: before jax loads (seconds), for
  # preflight's checks of the model code.
  config_lib.validate(config)
  if config.data.prepared_dir:
    raise ValueError(f"data.prepared_dir={config.data.prepared_dir!r}: prepare writes to "
                     "--out; leave data.prepared_dir unset here")
  from cem_jax import data

  data.check_given_files(config.data)  # a misspelt data.files glob: before jax, as in main
  from cem_jax import preflight
  from cem_jax.data import prepared, shard_writer

  preflight.check(config)
  if workers is not None:
    check_workers(workers)
  out = shard_writer.prepare(config.data, out, workers=workers)
  manifest = prepared.PreparedData.open_manifest(out, verify=False)
  for split, info in manifest["splits"].items():
    print(f"{split}: {info['documents']} documents, {info['bytes']} bytes of text, "
          f"{info['tokens']} tokens in {len(info['shards'])} shards")
  # Quoted: a folder with a space or a quote in its name pastes into the shell as one word.
  print(f"prepared {out}; train with {shlex.quote(f'--config.data.prepared_dir={out}')}")


def main(argv):
  cli.no_extra_args(argv)
  logging.set_verbosity(logging.INFO)
  cli.quiet_libraries()
  with cli.interrupted("stopped at once; the same command finishes what is missing, keeping "
                       "the shards already written"), cli.user_errors():
    fl = flags.FLAGS
    cli.check_given("out", fl.out, "a folder (created)")
    if fl.workers is not None:  # before the config file runs
      check_workers(fl.workers)
    run(cli.load_config(), fl.out, fl.workers)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so other tools can import the functions.
  cli.define_config_flag()
  flags.DEFINE_string("out", None, "Folder of the prepared dataset (created).")
  flags.DEFINE_integer("workers", None, "Encoding processes, at most the usable CPUs "
                       "(default: those for large corpora, else 1).")
  cli.require("config", "out")
  app.run(main, flags_parser=cli.parse_flags)
