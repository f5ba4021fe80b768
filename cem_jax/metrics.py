"""``metrics.jsonl``: one JSON object per line, each with ``step`` (DESIGN.md contract)."""

from __future__ import annotations

import json
import os


class MetricsWriter:
  """Appends metric lines to ``WORKDIR/metrics.jsonl`` (only where ``enabled``: process 0).

  Args:
    workdir: the run's folder.
    enabled: False on processes other than 0, which then write nothing.
    truncate_after_step: on resume, lines with a larger ``step`` (written by a run that died
      after its last checkpoint) are dropped so the file never shows a step twice.
  """

  def __init__(self, workdir: str, enabled: bool = True, truncate_after_step: int | None = None):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.enabled = enabled
    self._file = None
    if not enabled:
      return
    if truncate_after_step is not None and os.path.exists(self.path):
      kept = []
      with open(self.path) as f:
        for line in f:
          try:
            if json.loads(line)["step"] <= truncate_after_step:
              kept.append(line if line.endswith("\n") else line + "\n")
          except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by a kill
      tmp = self.path + ".tmp"
      with open(tmp, "w") as f:
        f.writelines(kept)
      os.replace(tmp, self.path)
    self._file = open(self.path, "a")

  def write(self, step: int, metrics: dict) -> None:
    """Writes ``{"step": step, **metrics}`` as one line and flushes it."""
    if self._file is None:
      return
    self._file.write(json.dumps({"step": int(step), **metrics}) + "\n")
    self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


def read_metrics(workdir: str) -> list[dict]:
  """All lines of ``WORKDIR/metrics.jsonl`` as dicts."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]
