"""Run a paper table's rows over seeds and aggregate them: ``python -m cem_jax.tables``.

    python -m cem_jax.tables --table=attention --scale=tiny --seeds=2 --workdir=results/tiny

``--table`` is a file name in ``experiments/paper/`` (``attention``, ``mlp``, ``design``,
``end_to_end``, ``neighbours``) or a path to a file with the same shape (``ROWS`` and
``get_config(arg)`` taking ``"ROW,SCALE"``). Each run trains in ``WORKDIR/TABLE/ROW/seed{S}``: a
finished run is skipped (its ``result.json`` exists), an interrupted one resumes from its
checkpoint, and a run whose resolved config equals a finished run of another table under the
same ``WORKDIR`` (e.g. the Llama baseline shared by the attention, mlp and end_to_end tables)
reuses that run's result and metrics instead of training again (``reused_from`` in its
``result.json``; an unfinished run in the row's folder is then moved aside to
``seedN.partial``, so that ``evaluate`` there does not load its partial step). A run is
reused only when trained on the same text (``data_source`` in its ``result.json``: the files'
sha256, not their paths; :func:`source_record`), with the same user energies
(``energy_digests``: an energy whose function, or a constant or helper it reads, was edited
since is another run; :func:`cem_jax.energies.source_digest`), from the same parameters
(``parameters_from``: with ``checkpoint.load_parameters_from``, the source's step folder, step
and digest sha256; a run's folder names its newest step, which moves on as that run trains),
and under the current
:data:`cem_jax.version.NUMERICS_VERSION` (``numerics_version`` in its ``result.json``; none =
1; unfinished: its first metrics line's): an older one in the row's own folder, finished or
not (``main`` refuses to resume it) and whatever its config, is moved aside to
``seed{S}.numerics_v{N}`` (or ``...v{N}.2``, ... when taken) and trained again, with a log
line saying so. Then
``WORKDIR/TABLE.{md,csv,png}`` are written: parameters (total, non-embedding, attention,
MLP), analytic FLOPs per token, eval loss (mean ± std over seeds), perplexity, bits per byte and
training tokens/s; the plot has one eval-loss curve per row (mean over seeds). A table of a
partial set says so (with ``--rows`` it shows every row finished in ``WORKDIR``): a row with
fewer finished seeds than ``--seeds`` reads "(k of N seeds)", and the rows with none are named
under the table. A run whose final eval is not finite stops the command (FloatingPointError,
one line) and records nothing.
"""

from __future__ import annotations

import csv
import functools
import glob
import importlib.util
import io
import json
import math
import os
import re
import shlex
import shutil
import statistics
import time

import ml_collections
from absl import app, flags, logging
from tqdm import tqdm

# Without jax (and flax, and the modules that import them: those are imported in the functions
# that build, train or compare runs): `python -m cem_jax.tables` refuses a bad flag in a
# fraction of a second, not after jax's seconds of import.
from cem_jax import cli, errors
from cem_jax import config as config_lib
from cem_jax.config import get_default_config
from cem_jax.data import pipeline, prepared, sources
from cem_jax.files import atomic_write_json, atomic_write_text, read_json, saved_figure
from cem_jax.metrics import has_final_eval, metrics_path, read_metrics
from cem_jax.version import NUMERICS_VERSION

PAPER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "experiments", "paper")
COLUMNS = ["row", "params", "non_embedding_params", "attention_params", "mlp_params",
           "flops_per_token", "eval_loss_mean", "eval_loss_std", "delta_loss_mean",
           "delta_loss_std", "perplexity", "bits_per_byte_mean", "bits_per_byte_std",
           "tokens_per_sec", "seeds"]


def load_table(table: str):
  """Imports a table config module by name (``experiments/paper/NAME.py``) or by path.

  Raises:
    ValueError: no such table file, its code raises (one line naming the file), or it lacks
      ``ROWS``/``get_config``.
  """
  path = table if table.endswith(".py") else os.path.join(PAPER_DIR, f"{table}.py")
  if not os.path.isfile(path):
    known = ", ".join(sorted(f[:-3] for f in os.listdir(PAPER_DIR) if f.endswith(".py")))
    if os.path.exists(table):  # a file of another kind, or a folder: "no file X.py" misled
      raise ValueError(f"--table={table!r} is not a .py file; allowed: a table's name "
                       f"({known}) or the path of a .py file defining ROWS and get_config(arg)")
    raise ValueError(f"--table={table!r}: no file {path}; known tables: {known}")
  spec = importlib.util.spec_from_file_location(f"cem_table_{os.path.basename(path)[:-3]}",
                                                path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ValueError(f"--table={table!r}: {path}:{e.lineno}: {e.msg}") from None
  except Exception as e:  # the user's file: any exception is its message to the user
    raise ValueError(f"--table={table!r}: {path}: {errors.one_line(e)}") from None
  if not hasattr(module, "ROWS") or not hasattr(module, "get_config"):
    raise ValueError(f"--table={table!r}: {path} must define ROWS and get_config(arg)")
  _check_rows(table, path, module.ROWS)
  return module


def _check_rows(table: str, path: str, rows) -> None:
  """Refuses a table's ``ROWS`` that is not a non-empty dict or list of distinct names that
  can be a folder and an item of ``--rows`` and of ``get_config("ROW,SCALE")``: a row listed
  twice trained into one folder and showed twice in the table, each time with every seed
  counted twice (its std over the duplicates).

  Raises:
    ValueError: one line naming ``--table``, the file and the rows.
  """
  allowed = ("allowed: a dict or list of row names, each once, none empty or holding ',' "
             "or '/'")
  if isinstance(rows, str) or not isinstance(rows, dict | list | tuple) or not rows:
    raise ValueError(f"--table={table!r}: {path}: ROWS={rows!r}; {allowed}")
  names = list(rows)
  bad = [r for r in names if not isinstance(r, str) or not r or "," in r or os.sep in r
         or r in (".", "..")]
  twice = sorted({r for r in names if names.count(r) > 1 and r not in bad}, key=str)
  if bad or twice:
    what = ([f"{', '.join(map(repr, twice))} listed twice"] if twice else []) + (
        [f"{', '.join(map(repr, bad))} not a row name"] if bad else [])
    raise ValueError(f"--table={table!r}: {path}: ROWS has {'; '.join(what)}; {allowed}")


def parse_overrides(pairs: list[str]) -> dict:
  """``["KEY=VALUE", ...]`` (the ``--set`` flag) → ``{KEY: value}``, each value converted to
  the type of that key in the default config (bools: true/false/1/0).

  Raises:
    ValueError: one line naming the ``--set`` value: no ``=``, an unknown key (with the
      closest keys), or a value that does not parse as the key's type.
  """
  default = config_lib.flat(get_default_config())
  out = {}
  for pair in pairs:
    key, sep, text = pair.partition("=")
    if not sep:
      raise ValueError(f"--set={pair!r}; allowed: KEY=VALUE, e.g. --set=data.prepared_dir=DIR")
    if key not in default:
      close = cli.closest_keys(key, default)
      raise ValueError(f"--set={pair!r}: no config key {key!r}"
                       + (f"; did you mean {', '.join(close)}?" if close else ""))
    current = default[key]
    if not isinstance(current, (bool, int, float, str)):
      raise ValueError(f"--set={pair!r}: {key} is a {type(current).__name__}; --set takes "
                       "numbers, booleans and strings only (edit the table file instead)")
    out[key] = cli.parse_value(f"--set={key}", text, current)
  return out


def row_config(module, row: str, scale: str, seed: int, steps: int | None = None,
               overrides: dict | None = None):
  """The resolved config of one run: the row at ``scale`` with ``seed`` (init and data order)
  and ``overrides`` (``{"data.prepared_dir": DIR}``, from :func:`parse_overrides`) applied
  after the row's own edits.

  Raises:
    ValueError: the table's ``get_config`` raises (another exception: one line naming the
      file).
  """
  try:
    c = module.get_config(f"{row},{scale}")
  except ValueError:  # the table's own one-line message (scales.parse_arg's)
    raise
  except Exception as e:  # the user's file: any other exception is its message to the user
    raise ValueError(f"{module.__file__}: get_config({row + ',' + scale!r}) raised "
                     f"{errors.one_line(e)}") from None
  for key, value in (overrides or {}).items():
    group, _, name = key.rpartition(".")
    (c[group] if group else c)[name] = value
  config_lib.absolute_energy_paths(c.model)  # a --set energy file is reloaded by evaluate/sample
  c.seed = seed
  c.data.shuffle_seed = seed
  if steps is not None:
    c.train.num_steps = steps
    c.train.warmup_steps = min(c.train.warmup_steps, max(steps // 10, 1))
    c.train.eval_every_steps = min(c.train.eval_every_steps, steps)
    c.checkpoint.every_steps = min(c.checkpoint.every_steps, steps)
  return c


def parameter_counts(config) -> dict:
  """Total, non-embedding, attention and MLP parameters of ``config``'s model (no allocation)."""
  from cem_jax import model_stats
  from cem_jax.model import abstract_model

  return model_stats.parameter_counts(
      abstract_model(config.model, config.data.vocab_size))


def run_dir(workdir: str, table: str, row: str, seed: int) -> str:
  """The workdir of one run: ``WORKDIR/TABLE/ROW/seed{seed}``."""
  return os.path.join(workdir, table, row, f"seed{seed}")


def config_digest(config) -> str:
  """:func:`cem_jax.workdir.config_digest` of the resolved config as 64 hex digits (the
  ``config_digest`` of a ``result.json``): equal digests mean the same training run."""
  from cem_jax import workdir as workdir_lib

  return workdir_lib.config_digest(config).hex()


def _write_json(path: str, obj) -> None:
  atomic_write_json(path, obj)  # written last: a result.json's presence means the run finished


RESULT_KEYS = ("row", "seed", "eval/loss", "eval/bits_per_byte", "tokens_per_sec",
               "config_digest")


@functools.lru_cache(maxsize=16)
def _source_record(data_json: str) -> dict:
  data = ml_collections.ConfigDict(json.loads(data_json))
  if data.prepared_dir:  # trained on these tokens, whatever data.files names (check_fits)
    manifest = prepared.PreparedData.open_manifest(data.prepared_dir, verify=False)
    return {"kind": "prepared", **pipeline.data_identity(manifest)}
  identity = sources.source_identity(data)
  if identity["kind"] == "files":  # by content, not by where the files lie
    identity["files"] = [{**f, "path": os.path.basename(f["path"])} for f in identity["files"]]
  identity.pop("data_dir", None)  # a TFDS catalog's local folder
  return identity


def source_record(config) -> dict:
  """What identifies the text a run of ``config`` trains on, wherever it lies: for a
  ``data.prepared_dir`` its tokenizer's and token streams' sha256 (as the manifest records
  them: :func:`cem_jax.data.pipeline.data_identity`); else for ``data.files`` each file's name,
  size and sha256; for a TFDS or built-in corpus its name, splits and (built-in) Python
  version (:func:`cem_jax.data.sources.source_identity`, the files hashed once per command).
  Recorded as ``data_source`` in a run's ``result.json``.

  Raises:
    ValueError: a ``data.files`` glob that matches no file; a ``data.prepared_dir`` without a
      manifest (:class:`cem_jax.data.prepared.BadPreparedData`: a damaged one).
  """
  return _source_record(json.dumps(config.data.to_dict(), sort_keys=True))


def _other_source(result: dict, config) -> str | None:
  """Why ``result`` was trained on other text than ``config`` selects, or None. A result
  without a record (written before ``data_source`` existed) is judged by its config alone,
  which names ``data.files`` by file name."""
  saved = result.get("data_source")
  now = None if saved is None else source_record(config)
  if saved is None or saved == now:
    return None
  if saved.get("kind") == now["kind"] == "files":
    return (f"data.files with sha256 {[f['sha256'][:12] for f in saved['files']]}, now "
            f"{[f['sha256'][:12] for f in now['files']]}")
  if saved.get("kind") == now["kind"] == "prepared":
    return ("data.prepared_dir with " + ", ".join(
        f"{k} {str(saved.get(k))[:12]} -> {v[:12]}" for k, v in now.items()
        if k != "kind" and saved.get(k) != v))
  return f"{saved.get('kind')} {saved.get('name', '')}, now {now['kind']} {now.get('name', '')}"


def _edited_energies(path: str, result: dict, config) -> list[str]:
  """The user energies of ``config`` edited since the run of ``result`` (read from ``path``)
  was trained (:func:`cem_jax.runs.edited_energies`); a result written before
  ``energy_digests`` existed is judged by its config alone.

  Raises:
    ValueError: ``path`` records a digest version this code does not know.
  """
  from cem_jax import runs

  return runs.edited_energies(runs.result_record(result), config, path)


def _same_config(run: str, config) -> bool:
  """True when ``run/config.json`` is ``config`` as a training run
  (:func:`cem_jax.workdir.config_changes`: up to keys added to the defaults since that run, the
  folder of ``data.files``, so that runs trained in another checkout, e.g. the committed
  ``results/tiny``, count, and :data:`cem_jax.config.COMPUTE_ONLY` and
  :data:`cem_jax.config.OBSERVE_ONLY`)."""
  from cem_jax import workdir as workdir_lib

  return workdir_lib.config_changes(run, config) == []


def _finite_number(value) -> bool:
  """A finite int or float (not a bool): what a table computes with. Python's json reads NaN
  and Infinity, which ``statistics.stdev`` cannot take and strict JSON does not have."""
  return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _read_result(path: str, digest: str | None = None, config=None) -> dict:
  """A finished run's ``result.json``, checked: valid JSON with :data:`RESULT_KEYS` (numbers
  where the table computes with them), and
  trained with ``config`` (digest ``digest``, else the run's ``config.json``) when given.

  Raises:
    ValueError: one line naming the file and what to do.
  """
  result = read_json(path, "delete it to train that run again")
  missing = [k for k in RESULT_KEYS if k not in result] if isinstance(result, dict) else ["all"]
  if missing:
    raise ValueError(f"{path} lacks {', '.join(missing)}; delete it to train that run again")
  wrong = [f"{k}={result[k]!r}" for k in ("eval/loss", "eval/bits_per_byte", "tokens_per_sec")
           if not _finite_number(result[k])]
  wrong += [f"seed={result['seed']!r}"] if type(result["seed"]) is not int else []
  wrong += [f"row={result['row']!r}"] if not isinstance(result["row"], str) else []
  if wrong:  # else a TypeError deep in the table's statistics
    raise ValueError(f"{path} has {', '.join(wrong)}; allowed: a string row, an integer seed "
                     "and finite numbers; delete it to train that run again")
  digests = result.get("energy_digests", {})
  if not (isinstance(digests, dict) and all(isinstance(v, str) for v in digests.values())):
    raise ValueError(f"{path} has energy_digests={digests!r}; allowed: an object of strings; "
                     "delete it to train that run again")
  otherwise = _trained_otherwise(path, result, digest, config)
  if otherwise:
    raise ValueError(otherwise)
  return result


def _trained_otherwise(path: str, result: dict, digest: str | None, config) -> str | None:
  """Why the run of ``result`` (read from ``path``) is not one of ``config`` (digest
  ``digest``), as one line naming the file and what to do; None when it is (or when neither
  is given)."""
  from cem_jax import workdir as workdir_lib

  trained = os.path.normpath(os.path.join(os.path.dirname(path),
                                          result.get("reused_from", ".")))
  if digest is not None and result["config_digest"] != digest:
    # None: no config to compare, or the run has no config.json to compare it with.
    changes = workdir_lib.config_changes(trained, config) if config is not None else None
    if changes != []:
      what = (errors.first_three(changes, "; ") if changes else
              "e.g. another --steps or --scale, or an edited table file")
      return (f"{path} was trained with another config ({what}); use a new --workdir, or "
              "delete that run to train it again")
  other = _other_source(result, config) if config is not None else None
  if other:
    return (f"{path} was trained on other text ({other}); use a new --workdir, or delete that "
            "run to train it again")
  changed = _edited_energies(path, result, config) if config is not None else None
  if changed:
    return (f"{path} was trained with another version of its energy ({', '.join(changed)}); "
            "use a new --workdir, or delete that run to train it again")
  return None


def _free_name(path: str) -> str:
  """``path``, or ``path.2``, ``path.3``, ... : the first that does not exist (a run moved
  aside before, e.g. finished with older code and met again, keeps its folder)."""
  candidate, n = path, 1
  while os.path.exists(candidate):
    n += 1
    candidate = f"{path}.{n}"
  return candidate


def _trained_version(out: str) -> int | None:
  """The numerics version run folder ``out`` was trained under: its ``result.json``'s, else
  (unfinished) its first metrics line's; None when it has neither (never started)."""
  from cem_jax import runs

  result_path = os.path.join(out, "result.json")
  if os.path.exists(result_path):
    return runs.numerics_version_of(_read_result(result_path))
  if os.path.exists(metrics_path(out)):
    lines = read_metrics(out)
    return runs.numerics_version_of(lines[0]) if lines else None
  return None


def _starts_from(config) -> dict | None:
  """Where a fresh run of ``config`` takes its parameters from, as its checkpoints record it
  (:attr:`cem_jax.runs.CheckpointMeta.parameters_from`): None from its seed.

  Raises:
    ValueError: as :func:`cem_jax.runs.open_parameters_source` (the run would refuse the same).
  """
  if not config.checkpoint.load_parameters_from:
    return None
  from cem_jax import runs

  source = runs.open_parameters_source(config)
  source.close()
  return source.record


def _finished_run(workdir: str, digest: str, config) -> str | None:
  """The directory of a finished run under ``workdir`` trained with ``config`` under the
  current numerics version, if any: one started from the parameters a fresh run would start
  from (a ``checkpoint.load_parameters_from`` path is the same config whichever step it holds).

  Raises:
    ValueError: a ``result.json`` damaged (:func:`_read_result`), or a source that a fresh run
      would refuse (:func:`_starts_from`).
  """
  from cem_jax import runs

  starts_from = functools.cache(lambda: _starts_from(config))  # opened once, if ever
  for path in sorted(glob.glob(os.path.join(workdir, "*", "*", "seed*", "result.json"))):
    result = _read_result(path)
    if "reused_from" not in result and runs.numerics_version_of(result) == NUMERICS_VERSION and (
        result["config_digest"] == digest or _same_config(os.path.dirname(path), config)
    ) and not _other_source(result, config) and not _edited_energies(path, result, config) and (
        result.get("parameters_from") == starts_from()):
      return os.path.dirname(path)
  return None


def check_runs(module, scale: str, seeds: int, steps: int | None = None,
               rows: list[str] | None = None, overrides: dict | None = None) -> None:
  """Validates every run's config before any trains, so that a bad ``--set`` or row fails
  in one line at start-up, not after the rows before it have trained.

  Raises:
    ValueError: a run's config is invalid, or its text cannot be found
      (:func:`source_record`; prefixed with the row); an override sets a key the
      runner sets itself (``seed`` and ``data.shuffle_seed`` from the seed, ``train.num_steps``
      with ``steps``: the override would be ignored); or an override sets a key
      in which the rows run differ (``rows``, default all: ``--set=train.learning_rate``
      would turn ``t2_lr_half`` into ``t2_fixed``), naming the override and a row.
  """
  runner = {"seed": "--seeds (run S has seed S)", "data.shuffle_seed": "--seeds (run S has "
            "seed S)", **({"train.num_steps": f"--steps={steps}"} if steps is not None else {})}
  for key in sorted(overrides or {}):
    if key in runner:  # row_config sets it after the overrides: the --set would be ignored
      raise ValueError(f"--set={key}=... is set for every run by {runner[key]}; leave it out")
  own = {row: config_lib.flat(row_config(module, row, scale, 0, steps))
         for row in rows or module.ROWS}
  for key in sorted(overrides or {}):
    values = {row: json.dumps(flat.get(key)) for row, flat in own.items()}
    if len(set(values.values())) > 1:  # the rows differ in this key: it is what they compare
      row = min(values, key=lambda r: list(values.values()).count(values[r]))
      raise ValueError(f"--set={key}=... overrides what the rows set themselves (row {row!r}: "
                       f"{key}={own[row].get(key)!r}); leave that key to the rows")
  # A run's seed sets only seed and data.shuffle_seed, whose rules are ranges: the first and
  # the last seed stand for all (each in turn: --seeds=10**21 checked for ever, silently).
  # The config's own rules and the data first, without jax (a --set value they refuse is
  # refused in a fraction of a second); then what needs the model code (preflight).
  configs = []
  for row in rows or module.ROWS:
    for seed in sorted({0, seeds - 1}):
      try:
        cfg = row_config(module, row, scale, seed, steps, overrides)
        config_lib.validate(cfg)
        source_record(cfg)  # e.g. a data.prepared_dir without a manifest (cached: read once)
      except ValueError as e:
        raise ValueError(f"row {row!r}: {e}") from None
      configs.append((row, cfg))
  from cem_jax import preflight

  for row, cfg in configs:
    try:
      preflight.check(cfg)
    except ValueError as e:
      raise ValueError(f"row {row!r}: {e}") from None


def run_table(module, table: str, scale: str, seeds: int, workdir: str,
              steps: int | None = None, rows: list[str] | None = None,
              overrides: dict | None = None) -> list[dict] | None:
  """Trains every (row, seed) not finished yet (``rows``: only those, default all); returns
  the per-run results, or None when a run was preempted (SIGTERM) before its last step:
  nothing is written for it, and the same command resumes it.

  Raises:
    ValueError: as :func:`check_runs`, before any run trains; a finished run's
      ``result.json`` damaged or trained with another config (one line naming the file and
      the fix); and as :func:`cem_jax.train.train_and_evaluate` for a run that trains.
    FloatingPointError: as :func:`cem_jax.train.train_and_evaluate`, or a run whose final
      eval is not finite (nothing recorded for it).
  """
  check_runs(module, scale, seeds, steps, rows, overrides)
  from cem_jax import workdir as workdir_lib  # after the checks of the flags: it imports jax

  os.makedirs(workdir, exist_ok=True)  # after the checks: a refused command leaves no folder
  more = [row for row in (rows or module.ROWS)
          if os.path.exists(os.path.join(run_dir(workdir, table, row, seeds), "result.json"))]
  if more:  # e.g. --seeds=2 over a table made with 3: the table would drop finished seeds
    logging.warning("table %s: rows %s have a finished seed %d in %s; the table shows seeds "
                    "0..%d (--seeds=%d): give --seeds=%d or more to include it", table,
                    ", ".join(more), seeds, workdir, seeds - 1, seeds, seeds + 1)
  # Made as they train: a list of every (row, seed) first took --seeds' count in memory.
  runs = ((row, seed) for row in (rows or module.ROWS) for seed in range(seeds))
  results = []
  for row, seed in tqdm(runs, desc=f"table {table}", unit="run",
                        total=len(rows or module.ROWS) * seeds):
    out = run_dir(workdir, table, row, seed)
    result_path = os.path.join(out, "result.json")
    cfg = row_config(module, row, scale, seed, steps, overrides)
    digest = config_digest(cfg)
    version = _trained_version(out)
    # An older version's run, finished or not (its resume would be refused), is retrained
    # whatever its config; the config is checked only for a run that would be reused (a
    # stale run may point into runs retrained since).
    if version == NUMERICS_VERSION and os.path.exists(result_path):
      results.append(_read_result(result_path, digest, cfg))
      continue
    if version not in (None, NUMERICS_VERSION):
      stale = _free_name(f"{out}.numerics_v{version}")
      logging.info("table %s: row %s seed %d was trained under numerics version %d, now %d "
                   "(cem_jax/version.py): moved to %s, training again", table, row, seed,
                   version, NUMERICS_VERSION, stale)
      os.replace(out, stale)
    workdir_lib.check_same_run(out, cfg)  # an unfinished run: resumed only as this config
    label = f"table {table}: row {row} seed {seed}"
    source = _finished_run(workdir, digest, cfg)
    if source is not None:
      result = _reused_result(label, out, source, digest, cfg, row)
    else:
      result = _trained_result(label, out, cfg, row, seed, digest)
      if result is None:
        return None
    _write_json(result_path, result)
    results.append(result)
  return results


def _reused_result(label: str, out: str, source: str, digest: str, config, row: str) -> dict:
  """The result of the run of ``config`` (digest ``digest``) in ``out`` taken from the finished
  run in ``source``: its ``metrics.jsonl`` copied into ``out`` (an unfinished run there moved
  aside first), its ``result.json`` with ``row`` and ``reused_from``. ``label`` ("table T: row
  R seed S") starts the log lines.

  Raises:
    ValueError: ``source``'s ``result.json`` damaged or trained otherwise (:func:`_read_result`).
    OSError: a file cannot be moved or copied.
  """
  logging.info("%s reuses %s (same config)", label, source)
  if os.path.isdir(os.path.join(out, "checkpoints")):
    # A killed run of this config: evaluate or sample in the row's folder would load its
    # partial step as the reused result's model. Kept aside, not deleted.
    partial = _free_name(f"{out}.partial")
    logging.info("%s: its unfinished run moved to %s", label, partial)
    os.replace(out, partial)
  os.makedirs(out, exist_ok=True)
  shutil.copyfile(metrics_path(source), metrics_path(out))
  return {**_read_result(os.path.join(source, "result.json"), digest, config), "row": row,
          "reused_from": os.path.relpath(source, out)}


def _trained_result(label: str, out: str, config, row: str, seed: int, digest: str
                    ) -> dict | None:
  """Trains (or resumes) the run of ``config`` in ``out`` and returns its result (what
  ``result.json`` records: the final eval, the digests of its config, text and energies, where
  its parameters started from (``parameters_from``: its newest checkpoint's record, None from
  its seed), the median logged rate); None when it was preempted before its last step.
  ``label`` ("table T: row R seed S") starts the log lines.

  Raises:
    ValueError, FloatingPointError: as :func:`cem_jax.train.train_and_evaluate`.
    FloatingPointError: its final eval loss or bits per byte is not finite (one line naming
      the run; no ``result.json`` is written).
  """
  from cem_jax import energies, runs, train

  logging.info("%s -> %s", label, out)
  trained_with = energies.energy_digests(config)
  final = train.train_and_evaluate(config, out)
  if not has_final_eval(out, config.train.num_steps):
    # Preempted (SIGTERM): the run saved a checkpoint and returned early. Writing its
    # result.json would make a partial run count as finished; stop the table instead.
    logging.warning("%s stopped before step %d (preempted); rerun the same command to resume "
                    "it", label, config.train.num_steps)
    return None
  bad = [f"{k}={final.get(k)!r}" for k in ("eval/loss", "eval/bits_per_byte")
         if not _finite_number(final.get(k))]
  if bad:  # finite parameters, a non-finite eval (e.g. bf16 logits overflowing): diverged
    # Not recorded: result.json would hold NaN (not JSON) and the row's mean and std with it.
    raise FloatingPointError(
        f"{label}: its final eval at step {config.train.num_steps} is not finite ("
        f"{', '.join(bad)}); no result.json written; lower train.learning_rate (or change the "
        f"row), then delete {out} to train it again")
  rates = [m["train/tokens_per_sec"] for m in read_metrics(out) if "train/tokens_per_sec" in m]
  return {"row": row, "seed": seed, **final, "config_digest": digest,
          "numerics_version": NUMERICS_VERSION, "data_source": source_record(config),
          "energy_digests": trained_with, "energy_digest_version": energies.DIGEST_VERSION,
          "parameters_from": runs.newest_meta(out)[1].parameters_from,
          "tokens_per_sec": statistics.median(rates[1:] or rates)}


def finished_results(module, table: str, scale: str, seeds: int, workdir: str,
                     steps: int | None = None, overrides: dict | None = None) -> list[dict]:
  """The results of every (row, seed) of the table already finished in ``workdir`` with the
  config this command would give it, under the current numerics version, in table order;
  runs trained otherwise (or not at all) are left out. ``--rows`` trains a subset but the
  table shows every row that has such runs.

  Raises:
    ValueError: a ``result.json`` is damaged (as :func:`_read_result`: one line naming it).
  """
  from cem_jax import runs

  out = []
  for row in module.ROWS:
    for seed in range(seeds):
      path = os.path.join(run_dir(workdir, table, row, seed), "result.json")
      if not os.path.exists(path):
        continue
      cfg = row_config(module, row, scale, seed, steps, overrides)
      result = _read_result(path)  # damage is an error here too, not a row silently left out
      if _trained_otherwise(path, result, config_digest(cfg), cfg):
        continue
      if runs.numerics_version_of(result) == NUMERICS_VERSION:
        out.append(result)
  return out


def aggregate(module, scale: str, results: list[dict], steps: int | None = None,
              rows: list[str] | None = None, overrides: dict | None = None) -> list[dict]:
  """One summary dict per row that has results (keys ``COLUMNS``), in table order (``rows``:
  only those); the first of them is the baseline of ``delta_loss_*``.

  ``delta_loss_*``: eval loss minus the first row's, paired by seed (same initialisation seed
  and data order), mean and std over the seeds both rows have. Seeds move all rows together
  (a lucky data order helps every model), so the paired difference is the fair comparison.
  Every ``*_std`` is the sample standard deviation over seeds (n - 1; 0 for one seed);
  ``paired_seeds`` counts the seeds a row shares with the baseline (``delta_loss_mean`` is NaN
  without one; the Markdown table says so and shows Δ's spread only over two or more).
  Losses are nats/token; ``perplexity`` is ``exp`` of the mean loss over seeds (capped as
  ``eval/perplexity``, :func:`cem_jax.loss.perplexity`: a diverged row's 800 nats would overflow);
  ``tokens_per_sec`` the mean over seeds of each run's median logged rate (the first log
  left out as warm-up: the step is compiled before the clock starts, but the first steps
  still start the data reads and allocate buffers); ``flops_per_token``
  analytic forward FLOPs (:func:`cem_jax.model.known_flops_per_token`: None for a row with a
  user energy, whose own operations are not modelled).
  """
  from cem_jax.loss import perplexity
  from cem_jax.model import known_flops_per_token

  names = [r for r in (rows or module.ROWS) if any(x["row"] == r for x in results)]
  if not names:  # no row has a result yet: no baseline either
    return []
  rows = []
  base = {r["seed"]: r["eval/loss"] for r in results if r["row"] == names[0]}
  for row in names:
    runs = [r for r in results if r["row"] == row]
    if not runs:
      continue
    deltas = [r["eval/loss"] - base[r["seed"]] for r in runs if r["seed"] in base]
    cfg = row_config(module, row, scale, 0, steps, overrides)
    losses = [r["eval/loss"] for r in runs]
    bpb = [r["eval/bits_per_byte"] for r in runs]
    mean_loss = statistics.fmean(losses)
    rows.append({
        "row": row,
        **parameter_counts(cfg),
        "flops_per_token": known_flops_per_token(cfg.model, cfg.data.vocab_size,
                                                 cfg.data.seq_len),
        "eval_loss_mean": mean_loss,
        "eval_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        "delta_loss_mean": statistics.fmean(deltas) if deltas else math.nan,
        "delta_loss_std": statistics.stdev(deltas) if len(deltas) > 1 else 0.0,
        "perplexity": perplexity(mean_loss),
        "bits_per_byte_mean": statistics.fmean(bpb),
        "bits_per_byte_std": statistics.stdev(bpb) if len(bpb) > 1 else 0.0,
        "tokens_per_sec": statistics.fmean(r["tokens_per_sec"] for r in runs),
        "seeds": len(runs),
        "paired_seeds": len(deltas),  # rendered beside Δ, not a CSV column
    })
  return rows


def write_outputs(workdir: str, table: str, rows: list[dict], curves: dict, header: str,
                  seeds: int | None = None, missing: list[str] | tuple = ()) -> list:
  """Writes ``TABLE.md``, ``TABLE.csv`` and ``TABLE.png`` in ``workdir``; returns the paths.

  ``seeds``: the seeds the table was asked for (``--seeds``): a row with fewer finished runs
  says "(k of N seeds)" in its eval loss cell; ``missing``: the table's rows without a finished
  run, named under the table. Either way a table of a partial set says so (with ``--rows`` it
  shows whatever else is finished in ``workdir``).

  A ``TABLE.md`` that differs from the new one only in the date of its header (``written
  YYYY-MM-DD``) is left as it is: rebuilding a committed table from its committed runs changes
  no tracked file, and the date stays the day its figures were first written."""
  from cem_jax import model_stats

  base = os.path.join(workdir, table)
  csv_text = io.StringIO(newline="")
  writer = csv.DictWriter(csv_text, fieldnames=COLUMNS, extrasaction="ignore")
  writer.writeheader()
  writer.writerows(rows)
  atomic_write_text(base + ".csv", csv_text.getvalue())
  lines = [header, "",
           "| row | params | non-emb. | attention | MLP | GFLOP/token | eval loss | "
           f"Δ loss vs {rows[0]['row'] if rows else '-'} (paired) | perplexity | bits/byte | "
           "tokens/s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  def spread(mean: float, std: float, seeds: int, fmt: str) -> str:
    return f"{mean:{fmt}} ± {std:.4f}" if seeds > 1 else f"{mean:{fmt}}"

  def delta(r: dict) -> str:
    paired = r.get("paired_seeds", r["seeds"])
    if paired == 0:
      return "n/a (no seed in common)"
    text = spread(r["delta_loss_mean"], r["delta_loss_std"], paired, "+.4f")
    return text if paired == r["seeds"] else f"{text} ({paired} of {r['seeds']} seeds)"

  def loss(r: dict) -> str:
    text = spread(r["eval_loss_mean"], r["eval_loss_std"], r["seeds"], ".4f")
    if seeds is None or r["seeds"] >= seeds:
      return text
    return f"{text} ({r['seeds']} of {seeds} seeds)"

  for r in rows:
    lines.append(
        f"| {r['row']} | {r['params'] / 1e6:.3f}M | {r['non_embedding_params'] / 1e6:.3f}M | "
        f"{r['attention_params'] / 1e6:.3f}M | {r['mlp_params'] / 1e6:.3f}M | "
        f"{model_stats.gflop_text(r['flops_per_token'])} | "
        f"{loss(r)} | "
        f"{delta(r)} | "
        f"{r['perplexity']:.2f} | "
        f"{spread(r['bits_per_byte_mean'], r['bits_per_byte_std'], r['seeds'], '.4f')} | "
        f"{r['tokens_per_sec']:.0f} |")
  if missing:
    lines += ["", f"Not in the table (no run finished with this command's config in {workdir}): "
              f"{', '.join(missing)}."]
  if any(r["flops_per_token"] is None for r in rows):
    lines += ["", "GFLOP/token n/a: a row with a user energy, whose own operations the "
              "analytic count (cem_jax.model_stats) does not model."]
  text = "\n".join(lines) + "\n"
  undated = lambda t: re.sub(r"\bwritten \d{4}-\d{2}-\d{2}\b", "written", t, count=1)
  try:
    with open(base + ".md", encoding="utf-8") as f:
      same = undated(f.read()) == undated(text)
  except (OSError, UnicodeDecodeError):
    same = False
  if not same:
    atomic_write_text(base + ".md", text)
  with saved_figure(base + ".png", figsize=(7, 4.5)) as (_, ax):
    for row, points in curves.items():
      ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=row, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("eval loss (nats/token), mean over seeds")
    ax.set_title(table)
    ax.grid(alpha=0.3)
    ax.legend()
  return [base + ext for ext in (".md", ".csv", ".png")]


def eval_curves(workdir: str, table: str, module, seeds: int,
                rows: list[str] | None = None, runs: set | None = None) -> dict:
  """``{row: [(step, mean eval loss over seeds), ...]}`` from the runs' metrics; ``runs``: only
  those ``(row, seed)`` pairs, the finished runs the table's figures are of (None: every seed
  below ``seeds`` with a ``metrics.jsonl``, unfinished or trained otherwise as it may be).

  Raises:
    ValueError: a damaged line in a ``metrics.jsonl`` (:func:`cem_jax.metrics.read_metrics`);
      a run of ``runs`` whose ``metrics.jsonl`` is missing or holds no finite eval loss.
  """
  curves = {}
  for row in rows or module.ROWS:
    by_step: dict[int, list[float]] = {}
    for seed in range(seeds):
      if runs is not None and (row, seed) not in runs:
        continue
      path = run_dir(workdir, table, row, seed)
      metrics = read_metrics(path) if os.path.exists(metrics_path(path)) else []
      # None: non-finite (written as null)
      losses = [(m["step"], m["eval/loss"]) for m in metrics if m.get("eval/loss") is not None]
      for step, loss in losses:
        by_step.setdefault(step, []).append(loss)
      if runs is not None and not losses:  # else its row's curve would lack it, unsaid
        raise ValueError(f"{metrics_path(path)} has no eval loss, but the "
                         "table shows that run (its result.json); restore it, or delete the "
                         "run to train it again")
    curves[row] = [(s, statistics.fmean(v)) for s, v in sorted(by_step.items())]
  return curves


def command_line(table: str, scale: str, seeds: int, workdir: str, steps: int | None,
                 rows: list[str] | None, sets: list[str]) -> str:
  """The shell command that writes this table again from the same runs (quoted for a shell)."""
  args = ["python", "-m", "cem_jax.tables", f"--table={table}", f"--scale={scale}",
          f"--seeds={seeds}", f"--workdir={workdir}"]
  args += [f"--steps={steps}"] if steps else []
  args += [f"--rows={','.join(rows)}"] if rows else []
  return shlex.join(args + [f"--set={pair}" for pair in sets])


def _rows_flag(module, value: str | None) -> list[str] | None:
  """``--rows=a,b`` → ``["a", "b"]`` in the given order; None (all rows) when unset.

  Raises:
    ValueError: a name that is not a row of the table, naming the allowed rows.
  """
  if value is None:
    return None
  rows = [r.strip() for r in value.split(",") if r.strip()]
  allowed = f"allowed: {', '.join(module.ROWS)}, each at most once"
  unknown = [r for r in rows if r not in module.ROWS]
  if unknown or not rows:
    raise ValueError(f"--rows={value!r}: not rows of the table: {', '.join(unknown) or 'none'};"
                     f" {allowed}")
  twice = sorted({r for r in rows if rows.count(r) > 1})
  if twice:
    raise ValueError(f"--rows={value!r}: {', '.join(twice)} given twice; {allowed}")
  return rows


def check_seeds(seeds) -> None:
  """Refuses a ``--seeds`` count that is not an int >= 1 (:func:`cem_jax.config.check_count`)
  or whose last run's seed (run S has seed S) the config's seed rule refuses.

  Raises:
    ValueError: one line, e.g. ``--seeds=0; allowed: an int >= 1``.
  """
  config_lib.check_count("--seeds", seeds)
  if not config_lib.is_allowed_int("seed", seeds - 1):
    raise ValueError(f"--seeds={seeds}; allowed: an int >= 1 and <= 2**63 (run S has seed S, "
                     "and a seed is < 2**63)")


def main(argv):
  cli.no_extra_args(argv)
  cli.quiet_libraries()
  fl = flags.FLAGS
  with cli.interrupted("the run in training stopped at once (no save of its own); the same "
                       "command skips the finished runs and resumes it from its newest "
                       "checkpoint"), \
       cli.user_errors(FloatingPointError):  # a diverged run is reported like bad input
    check_seeds(fl.seeds)
    if fl.steps is not None:  # it replaces every row's train.num_steps
      config_lib.check_flag("--steps", "train.num_steps", fl.steps)
    cli.check_given("workdir", fl.workdir, "a folder (created if missing)")
    cli.check_given("table", fl.table, "a table name in experiments/paper/ or a path to one")
    module = load_table(fl.table)
    name = os.path.basename(fl.table)[:-3] if fl.table.endswith(".py") else fl.table
    rows = _rows_flag(module, fl.rows)
    overrides = parse_overrides(fl.set)
    if os.path.exists(fl.workdir) and not os.path.isdir(fl.workdir):
      raise ValueError(f"--workdir={fl.workdir} is a file; give a folder (created if missing)")
    results = run_table(module, name, fl.scale, fl.seeds, fl.workdir, fl.steps, rows,
                        overrides)
    if results is None:  # preempted: the table is written when every run has finished
      return
    if rows:  # the table shows every row finished here, not only those trained now
      results = finished_results(module, name, fl.scale, fl.seeds, fl.workdir, fl.steps,
                                 overrides)
    table_rows = aggregate(module, fl.scale, results, fl.steps, None, overrides)
    import jax  # imported by the runs trained above (or by aggregate's model)

    device = jax.devices()[0].device_kind
    when = time.strftime("%Y-%m-%d", time.gmtime())
    command = command_line(fl.table, fl.scale, fl.seeds, fl.workdir, fl.steps, rows, fl.set)
    header = (f"Table {name}, scale {fl.scale}, {fl.seeds} seed(s), written {when} ({device}); "
              f"command: {command}")
    # Inside: a damaged metrics line of a finished run is a one-line ValueError too. The
    # curves are of the runs in the table only (not an unfinished seed, or one trained with
    # another config, in a row's folder).
    curves = eval_curves(fl.workdir, name, module, fl.seeds, [r["row"] for r in table_rows],
                         {(r["row"], r["seed"]) for r in results})
    shown = {r["row"] for r in table_rows}
    paths = write_outputs(fl.workdir, name, table_rows, curves, header, fl.seeds,
                          [r for r in module.ROWS if r not in shown])
  print(open(paths[0]).read())
  print("\n".join(paths))


if __name__ == "__main__":
  from cem_jax import scales

  flags.DEFINE_string("table", None, "Table name in experiments/paper/ or a path to one.")
  flags.DEFINE_enum("scale", "tiny", list(scales.SCALES), "Model scale (cem_jax/scales.py).")
  flags.DEFINE_integer("seeds", 3, "Seeds per row (init and data order).")
  flags.DEFINE_string("workdir", None, "Where runs and the table files go.")
  flags.DEFINE_integer("steps", None, "Override train.num_steps of every row (quick looks).")
  flags.DEFINE_string("rows", None, "Comma-separated rows to train, in this order (default: "
                      "every row); the table shows every row finished in --workdir.")
  flags.DEFINE_multi_string("set", [], "KEY=VALUE applied to every row's config, e.g. "
                            "--set=data.prepared_dir=/data/corpus (repeatable).")
  cli.require("table", "workdir")
  app.run(main, flags_parser=cli.parse_flags)
