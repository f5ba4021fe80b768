"""Data benchmarks (print figures; nothing here is a test).

    # a text corpus of ~N MB: the lines of the shared corpora, shuffled with a fixed seed
    python -m cem_jax.data.benchmark --mode=corpus --megabytes=100 --out=/tmp/c100/corpus.txt
    # prepare throughput (MB/s of text)
    python -m cem_jax.data.benchmark --mode=prepare --files=/tmp/c100/corpus.txt --out=/tmp/p100
    # input pipeline alone: tokens/s of batches of 64 x 1024 read from a prepared folder
    python -m cem_jax.data.benchmark --mode=pipeline --prepared_dir=/tmp/p100
    # a 5-step run of the tiny config from a prepared folder: time to first step, peak RSS
    python -m cem_jax.data.benchmark --mode=first_step --prepared_dir=/tmp/p100

The corpus is built from ``--shared=../shared/data`` (every ``*.txt``): all lines, shuffled by
``numpy.random.default_rng([seed, repetition])``, written again with a new shuffle until the
size is reached; the same arguments give the same bytes.

Measured on 2 CPU cores at load average ~2-3 (README, "Large corpora", has the table):
prepare 5.3 MB/s (100 MB) and 4.7 MB/s (1 GB; 8.2 MB/s on an idle machine, peak
RSS 0.50 GB, on 2026-12-03); pipeline 13.8M (100 MB) and 5.1M (1 GB)
tokens/s; 5-step run: first step at 8.7 s / 8.3 s, peak RSS 1.16 / 1.23 GB (10^9 bytes).
"""

from __future__ import annotations

import collections
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

from cem_jax import cli, cpus
from cem_jax import config as config_lib
from cem_jax.files import atomic_writer

REPO = Path(__file__).resolve().parents[2]



def make_corpus(shared: Path, out: Path, megabytes: int, seed: int = 0) -> int:
  """Writes ~``megabytes`` MB of shuffled lines of ``shared/*.txt`` to ``out``; returns bytes.

  Raises:
    ValueError: no ``*.txt`` in ``shared`` (naming the folder), or ``megabytes`` more than the
      disk of ``out`` has free.
    OSError: ``out`` cannot be written (it is then unchanged, and no temporary file is left).
  """
  import numpy as np

  # Streamed until the disk is full, --megabytes=10**9 failed only after it had filled it,
  # for every other user of that disk too.
  folder = next(p for p in (out.parent.absolute(), *out.parent.absolute().parents) if p.exists())
  free = shutil.disk_usage(folder).free
  if megabytes * 10**6 > free:
    raise ValueError(f"--megabytes={megabytes} is more than the {free // 10**6} MB free on the "
                     f"disk of {os.fspath(out)}; lower it or write --out elsewhere")
  files = sorted(shared.glob("*.txt"))
  if not files:
    raise ValueError(f"--shared={os.fspath(shared)} holds no *.txt file")
  lines = [line for f in files for line in f.read_bytes().splitlines(keepends=True)
           if line.strip()]
  target = megabytes * 10**6
  out.parent.mkdir(parents=True, exist_ok=True)
  written, rep = 0, 0
  # Streamed: a corpus of a gigabyte need not fit in memory.
  with atomic_writer(out) as f:
    while written < target:
      for i in np.random.default_rng([seed, rep]).permutation(len(lines)):
        f.write(lines[i])
        written += len(lines[i])
        if written >= target:
          break
      rep += 1
  return written


def _peak_rss_gb(who: int) -> float:
  """The peak resident memory of this process or (``RUSAGE_CHILDREN``) of its largest finished
  child, in GB (10^9 bytes; Linux counts ``ru_maxrss`` in KiB)."""
  return resource.getrusage(who).ru_maxrss * 1024 / 1e9


def _pipeline(prepared_dir: str, batch: int, seq_len: int, steps: int) -> None:
  """Prints the tokens/s of ``steps`` training batches of ``batch`` x ``seq_len`` read from
  ``prepared_dir``.

  Raises:
    ValueError: one batch's host arrays exceed this machine's memory and swap
      (:func:`cem_jax.memory.check_host_batch`: it was a MemoryError traceback, or the
      kernel's kill), checked before the data is opened; the data's own errors.
  """
  import numpy as np

  from cem_jax import memory
  from cem_jax.config import get_default_config
  from cem_jax.data import build_data, make_batch
  from cem_jax.data.prepared import PreparedData

  probe = make_batch(np.zeros((1, 2), np.int32), np.ones((1, 2), np.int32))
  memory.check_host_batch("--batch_size", batch, batch,
                          seq_len * sum(v.dtype.itemsize for v in probe.values()), seq_len,
                          f"lower --batch_size={batch} or --seq_len={seq_len}")
  config = get_default_config()
  config.data.prepared_dir = prepared_dir
  config.data.seq_len, config.train.batch_size = seq_len, batch
  manifest = PreparedData.open_manifest(prepared_dir, verify=False)
  config.data.vocab_size = manifest["tokenizer"]["vocab_size"]
  for key in ("validation_fraction", "tokenizer_model_type"):
    config.data[key] = manifest["config"][key]
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as workdir:
    data = build_data(config, workdir)
  opened = time.perf_counter() - start
  data.train.batch(0)
  start = time.perf_counter()
  for step in range(1, steps + 1):
    data.train.batch(step * 7919)  # spread over the corpus (and epochs)
  seconds = time.perf_counter() - start
  print(f"pipeline: opened {prepared_dir} (sha256 of every shard checked) in {opened:.2f} s; "
        f"{steps} batches of {batch} x {seq_len} in {seconds:.2f} s = "
        f"{steps * batch * seq_len / seconds / 1e6:.2f}M tokens/s")


def _first_step(prepared_dir: str) -> None:
  from cem_jax.data.prepared import PreparedData

  # The run itself verifies every file; this only needs the manifest's settings.
  manifest = PreparedData.open_manifest(prepared_dir, verify=False)
  with tempfile.TemporaryDirectory() as workdir:
    cmd = [sys.executable, "-m", "cem_jax.main", f"--config={REPO / 'experiments' / 'tiny.py'}",
           f"--workdir={workdir}", f"--config.data.prepared_dir={prepared_dir}",
           f"--config.data.vocab_size={manifest['tokenizer']['vocab_size']}",
           f"--config.data.validation_fraction={manifest['config']['validation_fraction']}",
           "--config.train.num_steps=5", "--config.train.log_every_steps=1",
           "--config.train.eval_every_steps=1000", "--config.eval.max_batches=1"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    first = ready = own = None
    tail = collections.deque(maxlen=20)  # the run's last words, shown if it fails
    for line in proc.stderr:
      tail.append(line)
      if ready is None and (m := re.search(r"data: .* ready in ([\d.]+) s", line)):
        ready, own = time.perf_counter() - start, float(m.group(1))
      if first is None and re.search(r"step 1/5", line):
        first = time.perf_counter() - start
    proc.wait()
  rss_gb = _peak_rss_gb(resource.RUSAGE_CHILDREN)
  if proc.returncode:
    sys.stderr.writelines(tail)
    raise RuntimeError(f"the 5-step run failed (exit {proc.returncode}): {' '.join(cmd)}")
  print(f"first_step: {prepared_dir}: data ready {ready:.1f} s (build_data itself {own:.2f} s) "
        f"and first step logged "
        f"{first:.1f} s after start, whole run "
        f"{time.perf_counter() - start:.1f} s, peak RSS {rss_gb:.2f} GB")


def main(argv):
  del argv
  with cli.user_errors():
    _main()


def _main() -> None:
  fl = flags.FLAGS
  # The config's rules of the fields these flags stand for (the seed: numpy's generator).
  config_lib.check_count("--megabytes", fl.megabytes)
  config_lib.check_flag("--seed", "data.shuffle_seed", fl.seed)
  config_lib.check_flag("--batch_size", "train.batch_size", fl.batch_size)
  config_lib.check_flag("--seq_len", "data.seq_len", fl.seq_len)
  config_lib.check_count("--steps", fl.steps)
  for name in ("out", "files", "prepared_dir"):
    cli.check_given(name, getattr(fl, name), "a path (leave the flag out where not needed)")
  if fl.mode in ("pipeline", "first_step") and not fl.prepared_dir:
    raise ValueError(f"--mode={fl.mode} needs --prepared_dir=FOLDER (made by --mode=prepare)")
  if fl.mode == "corpus":
    if not fl.out:
      raise ValueError("--mode=corpus needs --out=FILE")
    cli.check_folder("shared", fl.shared, "the folder of the source texts")
    start = time.perf_counter()
    n = make_corpus(Path(fl.shared), Path(fl.out), fl.megabytes, fl.seed)
    print(f"corpus: wrote {n / 1e6:.1f} MB to {fl.out} in {time.perf_counter() - start:.1f} s")
  elif fl.mode == "prepare":
    from cem_jax.config import get_default_config
    from cem_jax.data import prepared, shard_writer

    if not (fl.files and fl.out):
      raise ValueError("--mode=prepare needs --files and --out")
    config = get_default_config()
    config.data.files = fl.files
    start = time.perf_counter()
    out = shard_writer.prepare(config.data, fl.out)
    seconds = time.perf_counter() - start
    manifest = prepared.PreparedData.open_manifest(out, verify=False)
    mb = sum(s["bytes"] for s in manifest["splits"].values()) / 1e6
    print(f"prepare: {mb:.1f} MB of text in {seconds:.1f} s = {mb / seconds:.2f} MB/s "
          f"(tokenizer training, reading, hashing and encoding; {cpus.usable()} usable CPUs); "
          f"peak RSS {_peak_rss_gb(resource.RUSAGE_SELF):.2f} GB, of an encoding worker "
          f"{_peak_rss_gb(resource.RUSAGE_CHILDREN):.2f} GB")
  elif fl.mode == "pipeline":
    _pipeline(fl.prepared_dir, fl.batch_size, fl.seq_len, fl.steps)
  else:
    _first_step(fl.prepared_dir)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so tests can import the functions.
  flags.DEFINE_enum("mode", None, ["corpus", "prepare", "pipeline", "first_step"],
                    "What to measure.")
  flags.DEFINE_string("out", None, "corpus: the text file to write; prepare: the folder.")
  flags.DEFINE_integer("megabytes", 100, "corpus: size in MB (10^6 bytes).")
  flags.DEFINE_string("shared", "../shared/data", "corpus: folder of the source texts.")
  flags.DEFINE_integer("seed", 0, "corpus: shuffle seed.")
  flags.DEFINE_string("files", None, "prepare: data.files of the corpus.")
  flags.DEFINE_string("prepared_dir", None, "pipeline/first_step: prepared folder.")
  flags.DEFINE_integer("batch_size", 64, "pipeline: rows per batch.")
  flags.DEFINE_integer("seq_len", 1024, "pipeline: tokens per row.")
  flags.DEFINE_integer("steps", 200, "pipeline: batches to read.")
  cli.require("mode")
  app.run(main, flags_parser=cli.parse_flags)
