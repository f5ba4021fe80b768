"""Multi-process start-up: ``jax.distributed.initialize`` when launched as several processes.

JAX's own multi-controller runtime does all the work; this module only decides *whether* to
call it and with which values, so that one command works everywhere:

* explicit values: ``--coordinator_address``, ``--num_processes``, ``--process_id`` flags of
  ``cem_jax.main``, or the environment variables ``CEM_COORDINATOR_ADDRESS``,
  ``CEM_NUM_PROCESSES``, ``CEM_PROCESS_ID`` (set by ``launch/local.py``);
* SLURM (``srun``, ``SLURM_NTASKS`` > 1) and Open MPI (``OMPI_COMM_WORLD_SIZE`` > 1): JAX
  detects coordinator, process count and id from the environment;
* TPU pod slices: ``--distributed=on`` (``launch/tpu_pod.py`` passes it); JAX reads the
  worker list from the TPU VM metadata.

It must run before anything touches a JAX device (``jax.devices()``, the first array).
:func:`sync_processes` is the one barrier of the processes once they run.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import os
import re
import signal
import socket
import tempfile

from cem_jax import cli, signals

MODES = ("auto", "on", "off")
ENV_ADDRESS = "CEM_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "CEM_NUM_PROCESSES"
ENV_PROCESS_ID = "CEM_PROCESS_ID"


def _env_int(env, name: str) -> int | None:
  value = env.get(name, "")
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name}={value!r}; allowed: an int") from None


def cluster_processes(environ=None) -> int:
  """Processes a SLURM step or Open MPI job launched (1 outside such a job)."""
  env = os.environ if environ is None else environ
  for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if key == "SLURM_NTASKS" and "SLURM_STEP_NODELIST" not in env:
      continue  # inside `salloc`/`sbatch` but not an `srun` step: one process
    try:
      n = int(env.get(key, "1"))
    except ValueError:
      continue
    if n > 1:
      return n
  return 1


def resolve(mode: str = "auto", coordinator_address: str | None = None,
            num_processes: int | None = None, process_id: int | None = None,
            environ=None) -> dict | None:
  """The keyword arguments for ``jax.distributed.initialize``, or None for one process.

  Flag values win over the ``CEM_*`` environment variables. ``mode``: ``'auto'`` initialises
  when a coordinator is given or a SLURM/Open MPI job has several processes; ``'on'`` always
  (values not given are detected by JAX: TPU pods, SLURM, Open MPI); ``'off'`` never.

  Raises:
    ValueError: an unknown mode, a non-int environment value, a coordinator address that is not
      ``HOST:PORT`` (:func:`_check_address`), a coordinator given without
      ``num_processes`` and ``process_id`` (or those out of range), or under ``'auto'`` more
      than one process (or a process id other than 0) given without a coordinator or a
      cluster that starts them, or under ``'off'`` any of the three given (a flag or its
      ``CEM_*`` variable, which ``'off'`` would ignore) — one line naming the field.
  """
  env = os.environ if environ is None else environ
  if mode not in MODES:
    raise ValueError(f"--distributed={mode!r}; allowed: {', '.join(MODES)}")
  if mode == "off":
    # 'off' reads none of them: a process given an id or a coordinator would train alone as
    # process 0 (launch/local.py's processes each, all writing one --workdir).
    for name, value, env_name in (("coordinator_address", coordinator_address, ENV_ADDRESS),
                                  ("num_processes", num_processes, ENV_NUM_PROCESSES),
                                  ("process_id", process_id, ENV_PROCESS_ID)):
      if value is not None or env.get(env_name):
        named = (f"--{name}={value!r}" if value is not None
                 else f"environment variable {env_name}={env[env_name]!r}")
        raise ValueError(f"{named} has no effect with --distributed=off (one process, "
                         "jax.distributed not started); leave it out, or use "
                         "--distributed=auto or on")
    return None
  address = coordinator_address or env.get(ENV_ADDRESS) or None
  n = num_processes if num_processes is not None else _env_int(env, ENV_NUM_PROCESSES)
  pid = process_id if process_id is not None else _env_int(env, ENV_PROCESS_ID)
  if address is not None:
    _check_address(address)
    if n is None or pid is None:
      raise ValueError(f"--coordinator_address={address!r} needs --num_processes and "
                       f"--process_id (or {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})")
    if n < 1 or not 0 <= pid < n:
      raise ValueError(f"--process_id={pid} with --num_processes={n}; allowed: "
                       f"0 <= process_id < num_processes")
    return {"coordinator_address": address, "num_processes": n, "process_id": pid}
  if mode == "auto" and n is not None and n > 1 and cluster_processes(env) == 1:
    # Left to 'auto' it would train as one process each, every one of them process 0.
    raise ValueError(f"--num_processes={n} (or {ENV_NUM_PROCESSES}) without a coordinator; "
                     f"allowed: with --coordinator_address=HOST:PORT (or {ENV_ADDRESS}), or "
                     "--distributed=on where JAX finds it (TPU pods, SLURM, Open MPI)")
  if mode == "auto" and pid and cluster_processes(env) == 1:
    # Left to 'auto' it would train alone as process 0, not as the process it was told it is.
    raise ValueError(f"--process_id={pid} (or {ENV_PROCESS_ID}) without a coordinator; allowed: "
                     f"0 (one process), or with --coordinator_address=HOST:PORT (or "
                     f"{ENV_ADDRESS}) and --num_processes, or --distributed=on where JAX finds "
                     "the others (TPU pods, SLURM, Open MPI)")
  if mode == "on" or cluster_processes(env) > 1:
    kwargs = {}
    if n is not None:
      kwargs["num_processes"] = n
    if pid is not None:
      kwargs["process_id"] = pid
    return kwargs
  return None


def _check_address(address: str) -> None:
  """Refuses a coordinator address that is not ``HOST:PORT`` (a host and a port 1..65535):
  jax took ``nonsense`` to an IndexError traceback, ``host:abc`` to a JaxRuntimeError one,
  ``:1234`` to a wait for the 300 s timeout, and ``host:`` or ``host:70000`` trained alone.

  Raises:
    ValueError: one line naming ``--coordinator_address`` and what is allowed.
  """
  host, _, port = address.rpartition(":")
  if not (host and port.isdigit() and 1 <= int(port) <= 65535):
    raise ValueError(f"--coordinator_address={address!r} (or {ENV_ADDRESS}); allowed: "
                     "HOST:PORT, PORT 1..65535 (e.g. 10.0.0.1:1234, [::1]:1234)")


# The process ids this process holds (hold_process_id): key -> the open locked file's fd, kept
# open until the process ends, when the OS drops the lock (also on kill -9).
_HELD_IDS: dict[str, int] = {}


def _lock_path(coordinator_address: str, process_id: int) -> str:
  folder = os.path.join(tempfile.gettempdir(), f"cem_jax-{os.getuid()}")
  key = re.sub(r"[^A-Za-z0-9.-]", "_", coordinator_address)
  return os.path.join(folder, f"coordinator-{key}-process-{process_id}.lock")


def hold_process_id(coordinator_address: str, process_id: int, workdir: str | None) -> None:
  """Holds process ``process_id`` of the run whose coordinator is ``coordinator_address`` for
  this process, on this host, until it ends: an exclusive ``flock`` on a file in
  ``$TMPDIR/cem_jax-UID/`` that says who holds it (pid, host, workdir), removed at the exit;
  the OS drops the lock when the process ends, also by ``kill -9`` (whose file the next start
  takes over), so a crashed run never blocks the next. Held already by this
  process: nothing to do. Where ``flock`` is missing (not POSIX, or the folder cannot be made):
  nothing is held.

  A second process started with the same id (a command run twice, a process restarted while
  the first still runs) joined the coordination service as a newer incarnation of the first,
  which JAX's runtime then aborted from C++ ("Terminating process because the JAX distributed
  service detected fatal errors", a stack dump, status 134).

  Raises:
    ValueError: another process on this host holds the id (one line naming the id, the
      coordinator, that process and its workdir).
  """
  if os.name != "posix":
    return
  path = _lock_path(coordinator_address, process_id)
  if path in _HELD_IDS:
    return
  import fcntl  # POSIX only

  while True:  # again when the file locked was removed meanwhile (by its holder's exit)
    try:
      os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
      return
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "another process"
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        return  # no flock here: nothing held, nothing refused
      raise ValueError(
          f"--process_id={process_id} of --coordinator_address={coordinator_address!r} is "
          f"already running on this host ({holder}); two processes with one id abort inside "
          "JAX's runtime: wait for that one to end or stop it, or give this run another "
          "coordinator port") from None
    try:
      if os.path.samestat(os.fstat(fd), os.stat(path)):
        break
    except FileNotFoundError:
      pass
    os.close(fd)
  os.ftruncate(fd, 0)
  os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, --workdir={workdir!r}".encode())
  if not _HELD_IDS:
    atexit.register(_let_go_of_ids)
  _HELD_IDS[path] = fd


def _let_go_of_ids() -> None:
  """Removes the lock files of :func:`hold_process_id` at the exit, each while still held (a
  start that opened one meanwhile finds it gone and makes another), so that none is left
  behind but by a process killed (-9), whose file the next start takes over."""
  for path, fd in list(_HELD_IDS.items()):
    with contextlib.suppress(OSError):
      os.remove(path)
    os.close(fd)
    del _HELD_IDS[path]


def initialize(mode: str = "auto", coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               workdir: str | None = None) -> bool:
  """Calls ``jax.distributed.initialize`` if :func:`resolve` says so; True if it did. With a
  coordinator and a process id given, that id is first held for this process on this host
  (:func:`hold_process_id`; ``workdir`` is what a second start is told this one runs in).

  A peer that never connects makes JAX abort after its ``initialization_timeout`` (300 s);
  ``launch/local.py`` kills the others as soon as one process fails. Until then this process
  waits for the others in Python, where Ctrl-C and a SIGTERM handler stop it
  (:func:`_wait_in_python`).

  Raises:
    ValueError: as :func:`resolve` and :func:`hold_process_id`.
    KeyboardInterrupt, cem_jax.cli.Terminated: a signal stopped the wait; the process then
      ends by that signal before jax's ``atexit`` clean-up.
  """
  kwargs = resolve(mode, coordinator_address, num_processes, process_id)
  if kwargs is None:
    return False
  if "coordinator_address" in kwargs:
    hold_process_id(kwargs["coordinator_address"], kwargs["process_id"], workdir)
  import jax

  _wait_in_python(functools.partial(jax.distributed.initialize, **kwargs))
  return True


def _wait_in_python(meet) -> None:
  """Runs ``meet`` (``jax.distributed.initialize``) in a thread of its own while the calling
  thread waits for it in Python, where signal handlers run (:class:`cem_jax.signals.Calls`,
  which wakes also for a signal the kernel gave another thread): the meeting waits in C++,
  where Ctrl-C did nothing and a SIGTERM handler ran only when it ended (the others came, or
  the 300 s timeout's abort).

  Stopped by Ctrl-C or a :class:`cem_jax.cli.Terminated` (SIGTERM), the process ends by that
  signal before jax's ``atexit`` clean-up (``atexit`` runs the last registered first): it shut
  down the runtime the meeting still used, 5 s and a dozen lines of coordination-service errors
  (process 0 of 2, the other never started).

  Raises:
    what ``meet`` raises, or the exception that stopped the wait.
  """
  calls = signals.Calls("jax.distributed.initialize")
  try:
    calls.run(meet)
  except (KeyboardInterrupt, cli.Terminated) as e:
    atexit.register(signals.end_by,
                    signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM)
    raise
  finally:
    calls.stop()


def sync_processes(name: str) -> None:
  """Waits until every process has reached the barrier ``name`` (nothing with one process).
  Every process must call it, with the same name, at the same point."""
  import jax  # here, as in initialize: deciding how to start needs no jax

  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
