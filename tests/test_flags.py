"""Every tool's flags are refused by the config's rules (``config.check_flag``, ``check_count``)
and ``cli.check_given`` / ``check_folder``: one line naming the flag, the value (an int past
Python's 4300-digit limit by its digit count) and what is allowed, exit status 1, before any
run, data or checkpoint is read.

Each tool runs once, as ``python -m cem_jax.TOOL`` runs it (its ``__main__`` block defines its
flags and calls ``app.run``), with ``app.run`` made to run ``main`` once for each case's
arguments: one interpreter per tool, not per case.
"""


from conftest import tool_runs

from cem_jax import config as config_lib
from cem_jax import cpus

HUGE = "0x" + "f" * 4000  # absl reads it as an int of 4817 digits, past int -> str's limit
TOO_LONG = (f"={config_lib.shown(int(HUGE, 16))}; allowed: an int of at most 4300 digits "
            "(Python's int -> str limit: config.json and the messages write it in decimal)")

def _refusals(tool: str, cases: list[list[str]]) -> list[tuple[int, str, list[str]]]:
  """``(exit status, stderr, jax and flax if imported)`` of ``cem_jax.TOOL`` for each of
  ``cases`` (its arguments)."""
  return [(code, err, loaded) for code, _, err, loaded in tool_runs(tool, cases)]


def _check(tool: str, cases: list[tuple[list[str], str]]) -> None:
  # Each refusal before jax's import (seconds of CPU; the refusal a fraction of one).
  # Mutation: tables or bench importing jax at its top again gave ['jax'] (and 'flax') in
  # every case of its own.
  got = _refusals(tool, [args for args, _ in cases])
  assert got == [(1, f"error: {line}\n", []) for _, line in cases]


def test_evaluate_refuses_bad_flags_before_loading_the_run(tmp_path):
  # Mutations: evaluate's old --max_batches rule (< 1 and != -1) let HUGE through; without
  # check_folder, --workdir= read ./config.json (the working directory's).
  missing, file = tmp_path / "nothing", tmp_path / "file"
  file.write_text("")
  at = f"--workdir={missing}"
  _check("evaluate", [
      ([at, "--max_batches=0"], "--max_batches=0; allowed: -1 (the whole split) or an int >= 1"),
      ([at, "--max_batches=-2"],
       "--max_batches=-2; allowed: -1 (the whole split) or an int >= 1"),
      ([at, f"--max_batches={HUGE}"], f"--max_batches{TOO_LONG}"),
      ([at, "--batch_size=0"], "--batch_size=0; allowed: an int >= 1"),
      ([at, f"--batch_size={HUGE}"], f"--batch_size{TOO_LONG}"),
      (["--workdir="], "--workdir is empty; allowed: a trained run's folder"),
      ([at], f"--workdir={missing}: no such folder; allowed: a trained run's folder"),
      ([f"--workdir={file}"], f"--workdir={file}: is not a folder; allowed: a trained run's "
                              "folder"),
  ])


def test_sample_refuses_bad_flags_before_loading_the_run(tmp_path):
  missing = tmp_path / "nothing"
  at = [f"--workdir={missing}", "--prompt=The"]
  _check("sample", [
      ([*at, "--max_new_tokens=0"], "--max_new_tokens=0; allowed: an int >= 1"),
      ([*at, f"--max_new_tokens={HUGE}"], f"--max_new_tokens{TOO_LONG}"),
      ([*at, "--seed=-1"], "--seed=-1; allowed: an int >= 0 and < 2**63"),
      ([*at, f"--seed={2**63}"], f"--seed={2**63}; allowed: an int >= 0 and < 2**63"),
      ([*at, f"--top_k={HUGE}"], f"--top_k{TOO_LONG}"),
      ([*at, "--top_k=-1"], "--top_k=-1; allowed: 0 (off) or 1..vocab_size"),
      # float flags: absl takes nan, inf and any sign
      *[([*at, f"--temperature={t}"], f"--temperature={float(t)}; allowed: 0 (greedy) or a "
                                      "finite number > 0") for t in ("nan", "inf", "-1")],
      *[([*at, f"--top_p={p}"], f"--top_p={float(p)}; allowed: 0 < top_p <= 1")
        for p in ("0", "1.5", "nan", "-inf")],
      ([*at, "--temperature=0", "--top_p=0.5"], "--top_k=0 --top_p=0.5 have no effect with "
       "--temperature=0 (greedy); leave them at 0 and 1"),
      (["--workdir=", "--prompt=The"], "--workdir is empty; allowed: a trained run's folder"),
      (at, f"--workdir={missing}: no such folder; allowed: a trained run's folder"),
  ])


def test_plot_summary_and_aot_refuse_bad_flags(tmp_path):
  missing = tmp_path / "nothing"
  _check("plot", [
      # A required flag left out: its help, not absl's 'must have a value other than None'.
      ([], "--workdir is required: A run's folder (holds metrics.jsonl)"),
      (["--workdir="], "--workdir is empty; allowed: a run's folder"),
      ([f"--workdir={missing}"], f"--workdir={missing}: no such folder; allowed: a run's folder"),
  ])
  tiny = "--config=experiments/tiny.py"
  _check("summary", [
      # data.vocab_size's rule; token ids are int32: any larger size printed a table
      ([tiny, "--vocab_size=7"], "--vocab_size=7; allowed: an int >= 8 and < 2**31"),
      ([tiny, f"--vocab_size={2**31}"], f"--vocab_size={2**31}; allowed: an int >= 8 and < 2**31"),
      ([tiny, f"--vocab_size={HUGE}"],
       f"--vocab_size={config_lib.shown(int(HUGE, 16))}; allowed: an int >= 8 and < 2**31"),
      ([tiny, "--num_devices=0"], "--num_devices=0; allowed: an int >= 1"),
      ([tiny, f"--num_devices={HUGE}"], f"--num_devices{TOO_LONG}"),
      (["--workdir="], "--workdir is empty; allowed: a trained run's folder"),
      ([f"--workdir={missing}"],
       f"--workdir={missing}: no such folder; allowed: a trained run's folder"),
  ])
  _check("aot", [
      ([tiny], "--target is required: The devices to compile for: a TPU slice (e.g. "
               "v5e:16x16) or h100/h200[:N] (module docstring)"),
      (["--target=h100"], "--config is required: Experiment config file[:arg]"),
      ([tiny, "--target=h100", "--vocab_size=0"],
       "--vocab_size=0; allowed: an int >= 8 and < 2**31"),
      ([tiny, "--target=h100", f"--vocab_size={HUGE}"],
       f"--vocab_size={config_lib.shown(int(HUGE, 16))}; allowed: an int >= 8 and < 2**31"),
  ])


def test_tables_prepare_and_bench_refuse_bad_flags(tmp_path):
  out = f"--workdir={tmp_path / 'tables'}"
  _check("tables", [
      (["--table=mlp", out, "--seeds=0"], "--seeds=0; allowed: an int >= 1"),
      (["--table=mlp", out, f"--seeds={HUGE}"], f"--seeds{TOO_LONG}"),
      # run S has seed S: was checked seed by seed, for ever, with no word
      (["--table=mlp", out, f"--seeds={10**21}"],
       f"--seeds={10**21}; allowed: an int >= 1 and <= 2**63 (run S has seed S, and a seed is "
       "< 2**63)"),
      (["--table=mlp", out, f"--steps={2**31}"],
       f"--steps={2**31}; allowed: an int >= 1 and < 2**31"),
      (["--table=mlp", out, f"--steps={HUGE}"],
       f"--steps={config_lib.shown(int(HUGE, 16))}; allowed: an int >= 1 and < 2**31"),
      (["--table=mlp", "--workdir="], "--workdir is empty; allowed: a folder (created if missing)"),
      (["--table=", out], "--table is empty; allowed: a table name in experiments/paper/ or a "
                          "path to one"),
      (["--table=mlp", out, "--seed=2"], "Unknown command line flag 'seed'. Did you mean: seeds ?"),
      (["--table=mlp", out, "--scale=huge"],
       "flag --scale=huge: value should be one of <tiny|gpu|small|paper>"),
      (["--table=mlp", out, "--rows=zzz"], "--rows='zzz': not rows of the table: zzz; allowed: "
                                           "swiglu, cem_tied, swiglu_matched, cem_widened, each "
                                           "at most once"),
      (["--table=mlp", out, "--set=train.lr=3"],
       "--set='train.lr=3': no config key 'train.lr'; did you mean train.learning_rate?"),
      (["--table=mlp", out, "--set=seed=3"],
       "--set=seed=... is set for every run by --seeds (run S has seed S); leave it out"),
      (["--table=mlp", out, "--set=model.mlp_dim=64"],
       "--set=model.mlp_dim=... overrides what the rows set themselves (row 'swiglu_matched': "
       "model.mlp_dim=341); leave that key to the rows"),
      # The config's own rules and the data, checked for every row before preflight's jax.
      (["--table=mlp", out, "--set=model.norm_eps=0.0"],
       "row 'swiglu': model.norm_eps=0.0; allowed: a finite number, 0 < value"),
      (["--table=mlp", out, f"--set=data.prepared_dir={tmp_path / 'none'}"],
       f"row 'swiglu': data.prepared_dir={tmp_path / 'none'} does not exist; allowed: a folder "
       "python -m cem_jax.prepare --out=DIR wrote (or leave it empty)"),
  ])
  assert not (tmp_path / "tables").exists()
  tiny, prepared = "--config=experiments/tiny.py", f"--out={tmp_path / 'prepared'}"
  usable = cpus.usable()  # the child's too: it inherits this process's affinity and cgroup
  _check("prepare", [
      ([tiny, prepared, "--workers=0"], "--workers=0; allowed: an int >= 1"),
      ([tiny, prepared, f"--workers={HUGE}"], f"--workers{TOO_LONG}"),  # was a hang
      # each worker a process: 10**12 started processes until memory ran out
      ([tiny, prepared, f"--workers={10**12}"], f"--workers={10**12}; allowed: 1..{usable} "
       "(the CPUs this process may use: encoding is CPU-bound, more processes only take memory)"),
      ([tiny, "--out="], "--out is empty; allowed: a folder (created)"),  # was the cwd
  ])
  assert not (tmp_path / "prepared").exists()
  _check("bench", [
      (["--loss_block_size=-1"], "--loss_block_size=-1; allowed: an int >= 0"),
      ([f"--loss_block_size={HUGE}"], f"--loss_block_size{TOO_LONG}"),
      (["--out="], "--out is empty; allowed: a JSON file's path (leave the flag out for none)"),
      (["--profile_dir="],
       "--profile_dir is empty; allowed: a folder (leave the flag out for no trace)"),
  ])


def test_main_and_the_data_benchmark_refuse_bad_flags(tmp_path):
  # A config the config's rules refuse (model.block): main checks its flags before it reads
  # the config, so each case below still gets its flag's line, and were a flag's check lost
  # the run would stop at config.validate within a second instead of training (an empty
  # --coordinator_address, --num_processes=0 and --process_id=-1 each trained alone, and the
  # test failed only at the subprocess's 300 s timeout).
  refused = tmp_path / "refused.py"
  refused.write_text("from cem_jax.config import get_default_config\n"
                     "def get_config():\n"
                     "  c = get_default_config()\n"
                     "  c.model.block = 'cme'\n"
                     "  return c\n")
  run = [f"--config={refused}", f"--workdir={tmp_path / 'run'}"]
  _check("main", [
      ([run[0], "--workdir="], "--workdir is empty; allowed: a folder (created if missing)"),
      ([*run, "--coordinator_address="],  # was read as not given, the run trained alone
       "--coordinator_address is empty; allowed: HOST:PORT (leave the flag out for "
       "$CEM_COORDINATOR_ADDRESS or JAX's)"),
      ([*run, "--num_processes=0"], "--num_processes=0; allowed: an int >= 1"),
      ([*run, f"--num_processes={HUGE}"], f"--num_processes{TOO_LONG}"),
      ([*run, "--process_id=-1"], "--process_id=-1; allowed: an int >= 0"),
  ])
  assert not (tmp_path / "run").exists()
  corpus = ["--mode=corpus", f"--out={tmp_path / 'corpus.txt'}"]
  _check("data.benchmark", [
      ([*corpus, "--megabytes=0"], "--megabytes=0; allowed: an int >= 1"),
      ([*corpus, f"--megabytes={HUGE}"], f"--megabytes{TOO_LONG}"),
      ([*corpus, "--seed=-1"], "--seed=-1; allowed: an int >= 0 and < 2**63"),
      ([*corpus, "--seq_len=1"], "--seq_len=1; allowed: an int >= 2"),
      ([*corpus, "--batch_size=0"], "--batch_size=0; allowed: an int >= 1"),
      ([*corpus, "--steps=0"], "--steps=0; allowed: an int >= 1"),
      (["--mode=corpus", "--out="],
       "--out is empty; allowed: a path (leave the flag out where not needed)"),
      ([*corpus, f"--shared={tmp_path / 'none'}"],
       f"--shared={tmp_path / 'none'}: no such folder; allowed: the folder of the source texts"),
  ])
  assert not (tmp_path / "corpus.txt").exists()


def test_a_flag_absl_refuses_is_not_called_a_required_one_left_out():
  # absl stops at an unknown flag or a value it refuses before it checks the required flags,
  # all of which are None then, given or not: '--mode=bogus' was '--mode is required', and a
  # misspelt '--workdr=...' was '--workdir is required' instead of absl's 'Did you mean'.
  got = _refusals("data.benchmark", [["--mode=bogus"], []])
  assert got[0][0] == 1 and "--mode=bogus" in got[0][1] and "required" not in got[0][1], got
  assert got[1] == (1, "error: --mode is required: <corpus|prepare|pipeline|first_step>: What "
                       "to measure\n", [])
  # ... and a --flagfile that cannot be opened (the required flag may well be in it).
  (code, err, _), (code2, err2, _) = _refusals("plot", [["--workdr=somewhere"],
                                                  ["--flagfile=/nonexistent/flags.txt"]])
  assert code == 1 and "'workdr'" in err and "required" not in err, err
  assert code2 == 1 and "/nonexistent/flags.txt" in err2 and "required" not in err2, err2
