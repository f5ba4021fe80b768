"""Run one command as N processes of a multi-process JAX job on this machine.

    python launch/local.py --num_processes=2 --devices_per_process=4 -- \\
        python -m cem_jax.main --config=experiments/tiny.py --workdir=/tmp/mp

Every process gets the same command and, in its environment, ``CEM_COORDINATOR_ADDRESS``
(``127.0.0.1:PORT``, a free port), ``CEM_NUM_PROCESSES`` and ``CEM_PROCESS_ID``, which
``cem_jax.main`` passes to ``jax.distributed.initialize``. With ``--platform=cpu`` (default)
each process sees ``--devices_per_process`` forced host devices (``XLA_FLAGS``); with
``--platform=gpu`` it sees its own ``--devices_per_process`` GPUs (``JAX_LOCAL_DEVICE_IDS``).

Output lines are prefixed with ``[i]``. If a process fails, the others are stopped (SIGTERM,
then SIGKILL after ``--kill_grace_s``) and the launcher exits with the failed process's status;
0 when all succeed. ``--dry_run`` prints each process's environment and command instead.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import options  # beside this script: python runs it with its folder first on sys.path

ENV_ADDRESS = "CEM_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "CEM_NUM_PROCESSES"
ENV_PROCESS_ID = "CEM_PROCESS_ID"
FORCE_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(i: int, num_processes: int, devices_per_process: int, port: int,
                platform: str = "cpu") -> dict[str, str]:
  """The variables process ``i`` gets on top of the launcher's environment."""
  env = {ENV_ADDRESS: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(num_processes),
         ENV_PROCESS_ID: str(i)}
  if platform == "cpu":
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(FORCE_FLAG)]
    env["XLA_FLAGS"] = " ".join([*kept, f"{FORCE_FLAG}={devices_per_process}"])
    env["JAX_PLATFORMS"] = "cpu"
  else:
    first = i * devices_per_process
    env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(first + k) for k in range(devices_per_process))
  return env


def dry_run_lines(command: list[str], num_processes: int, devices_per_process: int, port: int,
                  platform: str) -> list[str]:
  """One shell line per process: its variables and the command, every value shell-quoted."""
  lines = []
  for i in range(num_processes):
    env = process_env(i, num_processes, devices_per_process, port, platform)
    assigns = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(" ".join([*assigns, shlex.join(command)]))
  return lines


# The child's first program: it asks the kernel for the signal (argv[1]) on its parent's death,
# makes up for a parent (argv[2]) already gone, and becomes the command (exec: the same pid).
# Python's start ignores SIGPIPE and SIGXFSZ, and exec keeps an ignored signal: they are set
# back to default first, as Popen's restore_signals did for the command before.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "sig, parent, command = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]\n"
    "ctypes.CDLL(None).prctl(1, sig)  # 1 = PR_SET_PDEATHSIG\n"
    "if os.getppid() != parent:\n"
    "  os.kill(os.getpid(), sig)\n"
    "signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
    "try:\n"
    "  os.execvp(command[0], command)\n"
    "except OSError as e:\n"
    "  sys.exit(f'launch: cannot run {command[0]!r}: {e.strerror}')\n")


def dying_with_parent(command: list[str], sig: int = signal.SIGKILL) -> list[str]:
  """``command`` as started so that on Linux it gets ``sig`` if the launcher itself dies
  (``PR_SET_PDEATHSIG``, kept across exec; elsewhere ``command`` unchanged). SIGKILL by default,
  so no process is left waiting for its peers until JAX's initialization timeout;
  ``launch/sweep.py`` asks for SIGTERM (its run saves and stops).

  Not Popen's ``preexec_fn``: that runs Python in a fork of the launcher, which may be
  multithreaded (the sweep imports jax), and a fork of threads may deadlock in the child.
  A multithreaded launcher's death may deliver ``sig`` more than once (the kernel sends it
  each time the child passes from one exiting thread to the next): the command must take it
  as a flag, as ``cem_jax.main`` does with SIGTERM.
  """
  if not sys.platform.startswith("linux"):
    return list(command)
  return [sys.executable, "-c", _DIE_WITH_PARENT, str(int(sig)), str(os.getpid()), *command]


def _pump(stream, prefix: str) -> None:
  for line in iter(stream.readline, b""):
    sys.stdout.buffer.write(prefix.encode() + line)
    sys.stdout.buffer.flush()
  stream.close()


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
  """SIGTERM to each running process's group, then SIGKILL to those still running."""
  running = [p for p in procs if p.poll() is None]
  for p in running:
    try:
      os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
      pass
  deadline = time.monotonic() + grace_s
  for p in running:
    try:
      p.wait(timeout=max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:
      pass
  for p in running:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()


def _exit_status(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode  # killed by signal N -> 128 + N


def run(command: list[str], num_processes: int, devices_per_process: int, port: int = 0,
        platform: str = "cpu", kill_grace_s: float = 5.0) -> int:
  """Starts the processes, streams their output, returns the launcher's exit status."""
  port = port or free_port()
  procs, pumps = [], []
  stopping = {"signal": None}

  def on_signal(signum, frame):
    del frame
    stopping["signal"] = signum

  previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    for i in range(num_processes):
      env = dict(os.environ, **process_env(i, num_processes, devices_per_process, port, platform))
      # Own session: stopping a process also stops whatever it started, and nothing else.
      procs.append(subprocess.Popen(dying_with_parent(command), env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True))
    for i, p in enumerate(procs):
      t = threading.Thread(target=_pump, args=(p.stdout, f"[{i}] "), daemon=True)
      t.start()
      pumps.append(t)
    status = 0
    while True:
      if stopping["signal"] is not None:
        print(f"launch/local.py: got signal {stopping['signal']}; stopping all processes",
              file=sys.stderr)
        _stop(procs, kill_grace_s)
        status = 128 + stopping["signal"]
        break
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        i, code = failed[0]
        print(f"launch/local.py: process {i} exited with status {_exit_status(code)}; stopping "
              "the others", file=sys.stderr)
        _stop(procs, kill_grace_s)
        status = _exit_status(code)
        break
      if all(c == 0 for c in codes):
        break
      time.sleep(0.1)
    for t in pumps:
      t.join(timeout=5)
    return status
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def parse_args(argv: list[str]) -> argparse.Namespace:
  own, command = options.split_at_dashes(argv)
  parser = options.script_parser(__doc__, usage="%(prog)s [options] -- COMMAND [ARG ...]")
  parser.add_argument("--num_processes", type=int, default=2)
  parser.add_argument("--devices_per_process", type=int, default=1,
                      help="CPU: forced host devices per process; GPU: GPUs per process")
  parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
  parser.add_argument("--kill_grace_s", type=float, default=5.0,
                      help="seconds between SIGTERM and SIGKILL when stopping processes")
  parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
  args = parser.parse_args(own)  # --help prints the usage here, with or without --
  if command is None:
    parser.error("give the command after --, e.g. launch/local.py --num_processes=2 -- python "
                 "-m cem_jax.main --config=experiments/tiny.py --workdir=/tmp/mp")
  args.command = command
  if not args.command:
    parser.error("the command after -- is empty")
  if args.num_processes < 1:
    parser.error(f"--num_processes={args.num_processes}; allowed: an int >= 1")
  if args.devices_per_process < 1:
    parser.error(f"--devices_per_process={args.devices_per_process}; allowed: an int >= 1")
  if not 0 <= args.port < 65536:
    parser.error(f"--port={args.port}; allowed: 0 (a free port) or 1..65535")
  if not args.dry_run and shutil.which(args.command[0]) is None:
    where = "file" if os.sep in args.command[0] else "on PATH"
    parser.error(f"the command after --, {args.command[0]!r}, is not an executable {where}")
  return args


def main(argv: list[str]) -> int:
  args = parse_args(argv)
  if args.dry_run:
    port = args.port or free_port()
    for line in dry_run_lines(args.command, args.num_processes, args.devices_per_process, port,
                              args.platform):
      print(line)
    return 0
  return run(args.command, args.num_processes, args.devices_per_process, args.port,
             args.platform, args.kill_grace_s)


if __name__ == "__main__":
  import exits  # beside this script, which python runs with its folder first on sys.path
  exits.run(main)
