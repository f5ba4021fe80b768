"""The package's import structure: no cycle, imports point down the stages of
docs/ARCHITECTURE.md (config -> data -> energies -> layers -> model -> steps -> train -> tools),
and the config modules load without jax.

The graph is read from the source (``ast``), every ``import`` statement counted, including those
inside functions (a late import that closes a cycle is still a cycle: it only hides it from
start-up order). Importing ``a.b.c`` also runs the packages ``a.b`` and ``a``, so those are
edges too, except for the importer's own packages (a submodule naming its siblings through its
package is how packages work, not a cycle).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "cem_jax"


def _modules(root: str = os.path.join(REPO, PACKAGE)) -> dict[str, str]:
  """``{dotted module name: path}`` for every ``.py`` file of the package."""
  out = {}
  for folder, _, files in os.walk(root):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        parts = os.path.relpath(path, os.path.dirname(root))[:-3].split(os.sep)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
  """Dotted names of the in-package modules (or attributes of them) a module imports."""
  package = module if is_package else module.rpartition(".")[0]
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      out.add(base)
      out.update(f"{base}.{a.name}" for a in node.names)
  return {n for n in out if n == PACKAGE or n.startswith(PACKAGE + ".")}


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
  """``{module: modules it imports}`` over the package, by reading the source."""
  graph = {}
  for module, path in modules.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    own = {module.rsplit(".", k)[0] for k in range(module.count(".") + 1)}
    edges = set()
    for name in _imported_names(tree, module, path.endswith("__init__.py")):
      # `from pkg import name` names a module or an attribute: keep the longest module prefix.
      while name not in modules:
        name = name.rpartition(".")[0]
      parts = name.split(".")
      for k in range(1, len(parts) + 1):
        target = ".".join(parts[:k])
        if target not in own:
          edges.add(target)
    graph[module] = edges
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
  state = {}  # 1: on the current path, 2: done
  for start in sorted(graph):
    if start in state:
      continue
    path, stack = [start], [iter(sorted(graph[start]))]
    state[start] = 1
    while stack:
      nxt = next(stack[-1], None)
      if nxt is None:
        state[path.pop()] = 2
        stack.pop()
      elif state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      elif nxt not in state:
        state[nxt] = 1
        path.append(nxt)
        stack.append(iter(sorted(graph.get(nxt, ()))))
  return None


def test_the_cycle_finder_finds_cycles_and_passes_a_dag():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": {"c"}}) == ["c", "c"]


def test_the_graph_sees_late_and_relative_imports(tmp_path):
  pkg = tmp_path / PACKAGE
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("def f():\n  from cem_jax.sub import b\n")
  (pkg / "sub" / "__init__.py").write_text("from . import b\n")
  (pkg / "sub" / "b.py").write_text("from .. import a\n")
  graph = import_graph(_modules(str(pkg)))
  assert graph[f"{PACKAGE}.a"] == {f"{PACKAGE}.sub", f"{PACKAGE}.sub.b"}
  assert graph[f"{PACKAGE}.sub"] == {f"{PACKAGE}.sub.b"}
  assert graph[f"{PACKAGE}.sub.b"] == {f"{PACKAGE}.a"}
  assert find_cycle(graph) is not None


def test_the_package_has_no_import_cycle():
  graph = import_graph(_modules())
  assert len(graph) > 20 and f"{PACKAGE}.sharding" in graph[f"{PACKAGE}.steps"]
  cycle = find_cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


# docs/ARCHITECTURE.md's direction of imports as data: a module imports only modules of its own
# stage or an earlier one. A new module goes in the stage of what it owns.
STAGES = (
    # 0: leaf helpers, importable from anywhere
    ("axes", "errors", "files", "masks", "version", "signals", "cli", "distributed", "memory",
     "profiling", "integrity", "checkpoint", "metrics", "sharding", "cpus"),
    ("config", "attention", "inner", "loss", "model_stats", "scales"),  # 1
    ("data",),  # 2
    ("energies", "updates"),  # 3
    ("layers",),  # 4
    ("model", "optim", "energy_checks", "preflight"),  # 5
    ("steps", "workdir"),  # 6
    ("runs", "train"),  # 7
    ("main", "bench", "evaluate", "sample", "plot", "summary", "inspect", "tables",
     "prepare", "aot"),  # 8: the tools; nothing above imports them
)


def _stage(module: str) -> int:
  name = module[len(PACKAGE) + 1:]
  for i, names in enumerate(STAGES):
    if name.split(".")[0] in names:
      return i
  raise AssertionError(f"{module} is in no stage of STAGES (tests/test_imports.py): add it "
                       "where docs/ARCHITECTURE.md's diagram puts it")


def test_imports_point_down_the_stages():
  graph = import_graph(_modules())
  stage = {m: _stage(m) for m in graph if m != PACKAGE}  # every module has a stage
  upward = sorted(f"{a} ({stage[a]}) imports {b} ({stage[b]})"
                  for a, targets in graph.items() if a != PACKAGE
                  for b in targets if b != PACKAGE and stage[b] > stage[a])
  assert not upward, "; ".join(upward)


def test_config_and_axes_import_no_jax():
  # A fresh interpreter: this one has jax loaded already.
  code = ("import sys; import cem_jax.config, cem_jax.axes; "
          "bad = sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'flax'}); "
          "print(','.join(bad))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": REPO}, check=True)
  assert out.stdout.strip() == "", f"importing config/axes loaded: {out.stdout.strip()}"


def _main_error_before_jax(tmp_path, override: str, workdir=None) -> str:
  """The error line of ``cem_jax.main`` on tiny.py with ``override``, checked to have ended
  with status 1 before jax or flax was imported and before the workdir was made (``workdir``
  given: that one, which exists)."""
  code = ("import sys, runpy; sys.argv = ['main', '--config=experiments/tiny.py', "
          f"'--workdir={workdir or tmp_path / 'w'}', {override!r}]\n"
          "try:\n  runpy.run_module('cem_jax.main', run_name='__main__')\n"
          "except SystemExit as e:\n"
          "  print(e.code, sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax'}))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": REPO}, check=True, timeout=120)
  assert out.stdout.strip() == "1 []", out.stdout + out.stderr
  assert workdir is not None or not (tmp_path / "w").exists()
  return out.stderr.strip().splitlines()[-1]


def test_main_refuses_a_bad_config_value_before_jax_loads(tmp_path):
  # A value config.validate refuses (not a misspelt key: absl catches that) fails in a
  # fraction of a second, with no workdir made: jax is never imported.
  assert _main_error_before_jax(tmp_path, "--config.model.block=cme") == (
      "error: model.block='cme'; allowed: cem, llama")


def test_main_refuses_a_missing_data_file_before_jax_loads(tmp_path):
  # It was refused after jax loaded (seconds), the tokenizer only after the text was read.
  missing = tmp_path / "none"
  assert _main_error_before_jax(tmp_path, f"--config.data.tokenizer={missing}.model") == (
      f"error: data.tokenizer='{missing}.model': no such file; give a SentencePiece .model "
      "file, or data.tokenizer='' to train one")
  (tmp_path / "empty.model").write_bytes(b"")  # was "has 0 pieces", after the text was read
  assert _main_error_before_jax(tmp_path, f"--config.data.tokenizer={tmp_path}/empty.model") == (
      f"error: data.tokenizer='{tmp_path}/empty.model' is empty (0 bytes); give a "
      "SentencePiece .model file, or data.tokenizer='' to train one")
  assert _main_error_before_jax(tmp_path, f"--config.data.prepared_dir={missing}") == (
      f"error: data.prepared_dir={missing} does not exist; allowed: a folder python -m "
      "cem_jax.prepare --out=DIR wrote (or leave it empty)")
  (tmp_path / "empty").mkdir()
  assert _main_error_before_jax(tmp_path, f"--config.data.prepared_dir={tmp_path}/empty") == (
      f"error: data.prepared_dir={tmp_path}/empty: no manifest.json (not a prepared dataset, "
      "or its prepare did not finish); run python -m cem_jax.prepare --out=DIR again")
  (tmp_path / "notes.txt").write_text("not a model")  # was refused after the text was read
  assert _main_error_before_jax(tmp_path, f"--config.data.tokenizer={tmp_path}/notes.txt") == (
      f"error: data.tokenizer='{tmp_path}/notes.txt' is not a SentencePiece model (it does not "
      "parse as one); give a SentencePiece .model file, or data.tokenizer='' to train one")
  # A misspelt data.files glob was refused once jax had loaded (~10 s; 18 s on busy cores).
  assert _main_error_before_jax(tmp_path, f"--config.data.files={missing}/*.txt") == (
      f"error: data.files: glob '{missing}/*.txt' matches no file")


def test_main_refuses_a_folder_holding_no_run_before_jax_loads(tmp_path):
  # `main --workdir=.` in a checkout filled it with a run's files beside the sources.
  work = tmp_path / "src"
  (work / "notes").mkdir(parents=True)
  for name in ("README.md", "a.py", "b.py"):
    (work / name).write_text("x")
  before = sorted(p.name for p in work.iterdir())
  assert _main_error_before_jax(tmp_path, "--config.train.num_steps=1", work) == (
      f"error: --workdir={work} holds no run (found: README.md, a.py, b.py, and 1 more); "
      "allowed: an empty or new folder, or the --workdir of a run to resume (with its "
      "config.json, checkpoints/ or data/)")
  assert sorted(p.name for p in work.iterdir()) == before  # nothing written there


def test_main_refuses_a_bad_coordinator_before_jax_loads(tmp_path):
  # Refused by distributed.resolve only after jax's import (seconds) before.
  assert _main_error_before_jax(tmp_path, "--coordinator_address=host:70000") == (
      "error: --coordinator_address='host:70000' (or CEM_COORDINATOR_ADDRESS); allowed: "
      "HOST:PORT, PORT 1..65535 (e.g. 10.0.0.1:1234, [::1]:1234)")
  assert _main_error_before_jax(tmp_path, "--num_processes=2") == (
      "error: --num_processes=2 (or CEM_NUM_PROCESSES) without a coordinator; allowed: with "
      "--coordinator_address=HOST:PORT (or CEM_COORDINATOR_ADDRESS), or --distributed=on "
      "where JAX finds it (TPU pods, SLURM, Open MPI)")


def test_bench_imports_no_grain_and_training_no_tfds():
  # The offline GPU image has no grain, and ../shared/tools/gpu/prepare.sh does not carry
  # it: the bench (which never shuffles) must start without it. TFDS (~0.4 s to import) is
  # loaded only by a run that reads a catalog dataset, not at every program's start.
  code = ("import sys; import cem_jax.bench; "
          "print(','.join(sorted({m.split('.')[0] for m in sys.modules} & {'grain'}))); "
          "import cem_jax.train, cem_jax.main; "
          "print(','.join(sorted({m.split('.')[0] for m in sys.modules} & "
          "{'tensorflow_datasets', 'tensorflow'})))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": REPO}, check=True)
  bench, training = out.stdout.split("\n")[:2]
  assert bench == "", f"importing cem_jax.bench loaded: {bench}"
  assert training == "", f"importing the training programs loaded: {training}"


def test_importing_a_program_defines_no_flags():
  # absl flags are global: a program that defined its flags at import would clash with the
  # next one imported in the same process (cem_jax.main and cem_jax.prepare both take
  # --config) and would make its functions unusable from a test or a notebook.
  programs = sorted(name for name, path in _modules().items()
                    if "app.run(" in open(path).read() and name != f"{PACKAGE}.cli")
  # Libraries (absl's logging, orbax, grain) define their own at import: only ours count.
  code = ("import importlib, sys; from absl import flags; "
          "[importlib.import_module(m) for m in sys.argv[1:]]; "
          "print(','.join(sorted(f'{m}:{f.name}' for m, fs in "
          "flags.FLAGS.flags_by_module_dict().items() for f in fs if m.startswith('cem_jax'))))")
  out = subprocess.run([sys.executable, "-c", code, *programs], cwd=REPO, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": REPO}, check=True)
  assert len(programs) >= 9, programs
  assert out.stdout.strip() == "", f"importing {programs} defined flags: {out.stdout.strip()}"
