"""A trace of a window of training steps with the jax profiler (``train.profile_steps``).

Where the step time goes (kernels, collectives, host gaps, the input pipeline) is read off a
trace, not off ``train/tokens_per_sec``. Process 0 traces ``train.profile_steps`` steps from
``train.profile_first_step`` on with :func:`jax.profiler.start_trace` into
``WORKDIR/tensorboard`` (TensorBoard's profile-plugin layout: ``plugins/profile/<time>/``
holds ``<host>.xplane.pb`` and ``perfetto_trace.json.gz``, which https://ui.perfetto.dev
opens without TensorBoard). The loop marks every step with
``jax.profiler.StepTraceAnnotation("train", step_num=step)``, so the viewers show step
boundaries; the trace's start and its writing are left out of ``train/tokens_per_sec``.
"""

from __future__ import annotations

import jax
from absl import logging


class StepProfiler:
  """Starts and stops one trace around training steps ``first .. first + num_steps - 1``
  (1-based, as the log counts them), or does nothing.

  Args:
    log_dir: where :func:`jax.profiler.start_trace` writes (``metrics.tensorboard_dir``).
    first: ``train.profile_first_step``.
    num_steps: ``train.profile_steps``; 0 = no trace.
    start_step: the steps already done (a resumed run traces the rest of its window, or
      nothing if the window ran before the resume; logged).
    enabled: False on processes other than 0, which then trace nothing.
  """

  def __init__(self, log_dir: str, first: int, num_steps: int, start_step: int,
               enabled: bool = True):
    self.log_dir = log_dir
    self.last = first + num_steps - 1
    self.first = max(first, start_step + 1)
    self.active = False
    self.enabled = enabled and num_steps > 0 and self.first <= self.last
    if enabled and num_steps > 0:
      if self.enabled:
        logging.info("profile: steps %d..%d will be traced into %s", self.first, self.last,
                     log_dir)
      else:
        logging.info("profile: steps %d..%d (train.profile_first_step, train.profile_steps) "
                     "ran before this start at step %d: no trace", first, self.last,
                     start_step)

  def starts_at(self, step: int) -> bool:
    """Whether the trace starts before step ``step`` (1-based) runs."""
    return self.enabled and not self.active and step == self.first

  def stops_at(self, step: int) -> bool:
    """Whether the trace stops after step ``step`` (1-based) has run."""
    return self.active and step == self.last

  def start(self) -> None:
    """Starts the trace. Another trace already running in this process (one a user started
    around the training) is logged as an error and training goes on without ours."""
    try:
      jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
    except RuntimeError as e:
      self.enabled = False
      logging.error("profile: could not start the trace of steps %d..%d (%s); training goes "
                    "on without it", self.first, self.last, e)
      return
    self.active = True

  def stop(self, through: int) -> None:
    """Writes the trace, if one is running, of the steps up to ``through`` (the last step run:
    ``last``, or less when the run stops inside the window). The caller waits for the traced
    steps first, so that their device work is in it."""
    if not self.active:
      return
    self.active = False
    jax.profiler.stop_trace()
    logging.info("profile: trace of steps %d..%d written under %s (TensorBoard's profile "
                 "plugin, or perfetto_trace.json.gz at https://ui.perfetto.dev)", self.first,
                 through, self.log_dir)
