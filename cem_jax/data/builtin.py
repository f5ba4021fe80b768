"""Built-in offline corpora: English text that ships with every CPython.

``'pydoc'``: the 79-odd documentation topics of ``pydoc_data.topics`` (~0.47 MB), one
document per topic, in sorted-key order (the order ``/work/shared/tools/ngram_bpb.py`` uses).
``'pydoc+docstrings'``: those topics, then the docstrings of the pure-Python standard library,
one document per source file in sorted module order. The docstrings are read with ``ast`` from
the source files, never by importing the modules, so nothing is executed and the text depends
only on the installed Python (identical across runs).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import sysconfig
import warnings
from pathlib import Path
from pydoc_data import topics

from cem_jax.config import BUILTINS

# Packages of tests, demos and GUI tools: docstrings that are mostly code or boilerplate.
_SKIP_PACKAGES = frozenset(
    {"test", "tests", "idlelib", "idle_test", "turtledemo", "lib2to3", "ensurepip", "this"}
)


def pydoc_topics() -> list[str]:
  """Returns the ``pydoc_data.topics`` texts, one per topic, in sorted-key order."""
  return [topics.topics[key] for key in sorted(topics.topics)]


def _module_files() -> list[tuple[str, Path]]:
  """(dotted name, source path) of every pure-Python stdlib module, sorted by name."""
  files: dict[str, Path] = {}
  # Only files under the stdlib directory: a same-named module on sys.path (say a local
  # string.py) must not change the corpus.
  stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
  for top in sorted(sys.stdlib_module_names):
    if top.startswith("_") or top in _SKIP_PACKAGES:
      continue
    try:
      spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
      continue
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
      continue  # built-in or extension module: no Python source to read
    origin = Path(spec.origin).resolve()
    if not origin.is_relative_to(stdlib):
      continue
    if origin.name != "__init__.py":
      files[top] = origin
      continue
    for path in origin.parent.rglob("*.py"):
      rel = path.relative_to(origin.parent).with_suffix("").parts
      if any(p in _SKIP_PACKAGES or (p.startswith("_") and p != "__init__") for p in rel):
        continue
      name = ".".join((top,) + rel[:-1] if rel[-1] == "__init__" else (top,) + rel)
      files[name] = path
  return sorted(files.items())


def _docstrings(source: str) -> list[str]:
  """Docstrings of a module, its classes and functions (nested ones too), in source order."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # invalid escape sequences in old sources
    tree = ast.parse(source)
  out = []

  def visit(node: ast.AST) -> None:
    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
      doc = ast.get_docstring(node, clean=True)
      if doc and doc.strip():
        out.append(doc.strip())
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        visit(child)

  visit(tree)
  return out


def stdlib_docstrings() -> list[str]:
  """Returns one document per pure-Python stdlib source file: its docstrings joined by blank
  lines, files in sorted dotted-name order; unreadable or unparsable files are skipped."""
  docs = []
  for _, path in _module_files():
    try:
      parts = _docstrings(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
      continue
    if parts:
      docs.append("\n\n".join(parts))
  return docs


def builtin_documents(name: str) -> list[str]:
  """Returns the documents of built-in corpus ``name`` (see the module docstring).

  Raises:
    ValueError: unknown ``name`` (the message names ``data.builtin`` and the allowed values).
  """
  if name == "pydoc":
    return pydoc_topics()
  if name == "pydoc+docstrings":
    return pydoc_topics() + stdlib_docstrings()
  raise ValueError(f"data.builtin={name!r} is not one of {BUILTINS}")
