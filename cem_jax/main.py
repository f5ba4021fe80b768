"""Train a model: ``python -m cem_jax.main --config=experiments/tiny.py --workdir=DIR``.

Any config key can be overridden: ``--config.model.num_layers=2 --config.data.files=a.txt``;
a misspelt key or a value of the wrong type fails while the flags are parsed, a value the
config's rules refuse (``config.validate``) right after, and a missing ``data.tokenizer`` file
or ``data.prepared_dir`` folder or a ``data.files`` glob matching no file next, all before jax
is imported.
Rerunning the same command resumes from the newest intact checkpoint in ``DIR``. Exit status: 0
when done or stopped by SIGTERM after saving (preemption), 1 with a one-line ``error: ...`` for
bad input or a diverged run; SIGTERM during start-up (nothing to save; from the first line of
this file, the flags and the config file included) is one line ``terminated (SIGTERM): ...``
and death by SIGTERM (143), as Ctrl-C is one line and 130.

Several processes (TPU pod workers, ``srun`` tasks, ``launch/local.py``) run this same command;
``jax.distributed.initialize`` is called when the environment or the flags say so (see
:mod:`cem_jax.distributed`): ``--distributed=on`` on TPU pods, automatic under SLURM/Open MPI,
or explicit ``--coordinator_address=HOST:PORT --num_processes=N --process_id=I``.
"""

from __future__ import annotations

from cem_jax import signals

# First, run as a program: until train sets its own handler (seconds: absl's import, the flags
# and the config file, jax's import, the processes' meeting, jax's backend start) a SIGTERM was
# the default action, the process gone without a word (status 143).
_HELD = signals.Held(take=__name__ == "__main__")
# What a Ctrl-C in start-up leaves and what to do then, after "interrupted (Ctrl-C): ".
_INTERRUPTED = ("stopped at once (no save of its own); the same command resumes from the "
                "newest checkpoint in --workdir (checkpoint.every_steps)")

try:
  from absl import app, flags, logging

  from cem_jax import cli, distributed
  from cem_jax import config as config_lib
except KeyboardInterrupt:
  # Ctrl-C while absl and ml_collections load (0.3 s) was a 22-39 line traceback: the same
  # one line as later in start-up (cli.interrupted, not importable yet), no workdir made.
  if __name__ == "__main__":
    signals.die_interrupted(_INTERRUPTED)
  raise


def main(argv):
  cli.no_extra_args(argv)
  fl = flags.FLAGS
  logging.set_verbosity(logging.INFO)
  cli.quiet_libraries()
  stop = cli.Terminated(cli.TERMINATED_IN_START_UP)
  # Ctrl-C and a held SIGTERM end as one line by the cli.interrupted around app.run.
  with cli.user_errors(FloatingPointError):  # a diverged run is reported like bad input
    _HELD.stop_if_sent(stop)  # while the flags and the config file were read
    cli.check_given("workdir", fl.workdir, "a folder (created if missing)")
    cli.check_workdir(fl.workdir)
    # '' was read as not given: the coordinator of the environment, or none.
    cli.check_given("coordinator_address", fl.coordinator_address,
                    "HOST:PORT (leave the flag out for $CEM_COORDINATOR_ADDRESS or JAX's)")
    if fl.num_processes is not None:
      config_lib.check_count("--num_processes", fl.num_processes)
    if fl.process_id is not None:
      config_lib.check_count("--process_id", fl.process_id, minimum=0)
    # jax-free: a coordinator that is not HOST:PORT or a process id out of range fails in a
    # second, not after jax's import (initialize resolves them again, unchanged).
    distributed.resolve(fl.distributed, fl.coordinator_address, fl.num_processes,
                        fl.process_id)
    config = cli.load_config()
    # jax-free: a value the config's own rules refuse fails in a second, before jax loads
    # (train checks it again with what needs the model code: preflight.check), and so does
    # a given data file that is not there.
    config_lib.validate(config)
    from cem_jax import data

    data.check_given_files(config.data)
    import jax

    from cem_jax import energies, train

    # Before anything touches a device: the runtime must know all processes first. The
    # meeting waits in Python (distributed._wait_in_python), where a SIGTERM stops it at once.
    with _HELD.raising(stop):
      met = distributed.initialize(fl.distributed, fl.coordinator_address, fl.num_processes,
                                   fl.process_id, fl.workdir)
    energies.absolute_paths(config.model)
    jax.process_count()  # jax's backend starts here, held, not in train before its handler
    # Once met, JAX's preemption notifier holds SIGTERM below Python's handler: left to it.
    _HELD.release(stop, restore=not met)
    default = cli.default_config_arg()
    if default is not None:  # a variant the command does not name: said, not trained silently
      # Here, with training's own lines: an error line before it stays the only line.
      spec = flags.FLAGS[cli.CONFIG_FLAG].config_filename
      logging.info("--config=%s: get_config's default arg %r (choose one with --config=%s:ARG)",
                   spec, default, spec)
    train.train_and_evaluate(config, fl.workdir)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so other tools can import the functions.
  cli.define_config_flag()
  flags.DEFINE_string("workdir", None, "Folder for metrics, config and checkpoints.")
  flags.DEFINE_enum(
      "distributed", "auto", ["auto", "on", "off"],
      "jax.distributed.initialize: 'auto' when a coordinator is given or SLURM/Open MPI started "
      "several processes; 'on' always (TPU pods: JAX finds the workers); 'off' never.")
  flags.DEFINE_string(
      "coordinator_address", None, "HOST:PORT of process 0 (default: "
      "$CEM_COORDINATOR_ADDRESS or detected by JAX).")
  flags.DEFINE_integer(
      "num_processes", None, "Number of processes (default: $CEM_NUM_PROCESSES or detected).")
  flags.DEFINE_integer(
      "process_id", None, "This process's index (default: $CEM_PROCESS_ID or detected).")
  cli.require("config", "workdir")
  # Around app.run, not in main: the flags are parsed (the config file runs) before main.
  with cli.interrupted(_INTERRUPTED):
    app.run(main, flags_parser=cli.parse_flags)
