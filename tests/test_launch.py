"""launch/: dry runs print the exact commands (hostile values quoted); the local launcher runs N
processes, forwards their environment and stops them all when one fails; the sweep skips
finished runs. No JAX here: every command is a plain Python script."""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write_metrics

REPO = Path(__file__).resolve().parents[1]
HOSTILE = "--config.data.files=a b;rm -rf x"
MAIN_ARGS = ["--config=experiments/tiny.py", "--workdir=/mnt/runs/t w", HOSTILE]


def _launch(script: str, *args: str, timeout: float = 300,
            env: dict | None = None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, f"launch/{script}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout, env=env)


# ``python launch/sweep.py ARGS`` once per case in one interpreter, each case's exit status,
# stdout and stderr as that program gives them (sys.exit's message printed, status 1). For
# dry runs over run folders that hold checkpoints: comparing a folder's config imports jax
# (2 s of CPU a program). Signals as a terminal leaves them, whatever pytest's are.
_SWEEP_CASES = """
import contextlib, io, json, runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
script, cases, out = sys.argv[1], json.load(sys.stdin), []
sys.path.insert(0, script.rpartition("/")[0])  # as python puts a script's folder first
for args in cases:
  sys.argv = [script, *args]
  stdout, stderr = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
    try:
      runpy.run_path(script, run_name="__main__")
      code = 0
    except SystemExit as e:
      code = e.code
      if code is None:
        code = 0
      elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
  out.append([code, stdout.getvalue(), stderr.getvalue()])
print(json.dumps(out))
"""


def _sweeps(*cases: list[str]) -> list[subprocess.CompletedProcess]:
  """``_launch("sweep.py", *args)`` for each of ``cases`` (its arguments), in one interpreter:
  the runs they start, if any, must not depend on the cases before them."""
  proc = subprocess.run([sys.executable, "-c", _SWEEP_CASES, "launch/sweep.py"], cwd=REPO,
                        input=json.dumps(cases), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
  return [subprocess.CompletedProcess(["launch/sweep.py", *args], code, out, err)
          for args, (code, out, err) in zip(cases, json.loads(proc.stdout), strict=True)]


def _script(name: str):
  """``launch/NAME.py`` imported as a module, to call its functions in this process (with
  launch/ on ``sys.path``, as python puts it there for the script: its ``options`` beside it)."""
  if str(REPO / "launch") not in sys.path:
    sys.path.append(str(REPO / "launch"))
  spec = importlib.util.spec_from_file_location(f"launch_{name}", REPO / "launch" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# ---------------------------------------------------------------------------------------------
# local.py


def test_local_dry_run_prints_each_process_environment_and_command(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # the test session's own flags would be kept
  proc = _launch("local.py", "--num_processes=2", "--devices_per_process=4", "--port=4321",
                 "--dry_run", "--", "python", "-m", "cem_jax.main", *MAIN_ARGS)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines == [
      f"CEM_COORDINATOR_ADDRESS=127.0.0.1:4321 CEM_NUM_PROCESSES=2 CEM_PROCESS_ID={i} "
      "XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python -m "
      "cem_jax.main --config=experiments/tiny.py '--workdir=/mnt/runs/t w' "
      "'--config.data.files=a b;rm -rf x'" for i in (0, 1)]
  assert shlex.split(lines[1])[-len(MAIN_ARGS):] == MAIN_ARGS  # the shell gets the exact args


def test_local_gpu_processes_each_get_their_own_gpus():
  proc = _launch("local.py", "--platform=gpu", "--num_processes=3", "--devices_per_process=2",
                 "--port=4321", "--dry_run", "--", "python", "train.py")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines() == [
      f"CEM_COORDINATOR_ADDRESS=127.0.0.1:4321 CEM_NUM_PROCESSES=3 CEM_PROCESS_ID={i} "
      f"JAX_LOCAL_DEVICE_IDS={ids} python train.py"
      for i, ids in enumerate(["0,1", "2,3", "4,5"])]


def test_local_keeps_the_callers_other_xla_flags(monkeypatch):
  # Only the device count is replaced; a dump folder or debug flag the caller set stays.
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8")
  env = _script("local").process_env(1, 2, 4, 1234)
  assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=4"


def test_local_runs_every_process_with_its_environment(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # the test session's own flags would be kept
  code = ("import os; print(os.environ['CEM_PROCESS_ID'], os.environ['CEM_NUM_PROCESSES'], "
          "os.environ['CEM_COORDINATOR_ADDRESS'], os.environ['XLA_FLAGS'])")
  proc = _launch("local.py", "--num_processes=3", "--devices_per_process=2", "--",
                 sys.executable, "-c", code)
  assert proc.returncode == 0, proc.stderr
  lines = sorted(proc.stdout.splitlines())
  assert len(lines) == 3
  addresses = set()
  for i, line in enumerate(lines):
    prefix, pid, n, address, flags = line.split(" ")
    assert (prefix, pid, n) == (f"[{i}]", str(i), "3")
    assert flags == "--xla_force_host_platform_device_count=2"
    addresses.add(address)
  (address,) = addresses  # one coordinator for all
  assert address.startswith("127.0.0.1:") and int(address.split(":")[1]) > 0


def test_local_stops_all_processes_when_one_fails(tmp_path):
  # Process 1 fails; 0 sleeps; 2 ignores SIGTERM and must get SIGKILL after the grace period.
  code = f"""
import os, signal, sys, time
i = int(os.environ["CEM_PROCESS_ID"])
if i == 2:  # before its pid is written, so the SIGTERM always finds it ignoring
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
pid = os.path.join({str(tmp_path)!r}, f"pid{{i}}")
open(pid + ".tmp", "w").write(str(os.getpid()))
os.replace(pid + ".tmp", pid)  # present means written whole
if i == 1:  # fails once the others have written their pids, however slowly they start
  while not all(os.path.exists(os.path.join({str(tmp_path)!r}, f"pid{{j}}")) for j in (0, 2)):
    time.sleep(0.05)
  sys.exit(3)
time.sleep(120)
open(pid + ".slept", "w").close()  # not stopped: the launcher waited for it to end
"""
  proc = _launch("local.py", "--num_processes=3", "--kill_grace_s=1", "--",
                 sys.executable, "-c", code)
  assert proc.returncode == 3
  assert "process 1 exited with status 3; stopping the others" in proc.stderr
  assert not list(tmp_path.glob("*.slept"))  # read from the processes, not a clock
  for i in (0, 2):
    pid = int((tmp_path / f"pid{i}").read_text())
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


def test_local_stops_the_others_with_sigterm_first_so_they_can_save(tmp_path):
  # cem_jax.main saves a checkpoint on SIGTERM: the others must get it before any SIGKILL.
  code = f"""
import os, signal, sys, time
d = {str(tmp_path)!r}
if os.environ["CEM_PROCESS_ID"] == "0":
  def stop(signum, frame):
    open(os.path.join(d, "got"), "w").write(str(signum))
    sys.exit(0)
  signal.signal(signal.SIGTERM, stop)
  open(os.path.join(d, "ready.tmp"), "w").close()
  os.replace(os.path.join(d, "ready.tmp"), os.path.join(d, "ready"))
  time.sleep(120)
while not os.path.exists(os.path.join(d, "ready")):
  time.sleep(0.05)
sys.exit(3)
"""
  proc = _launch("local.py", "--num_processes=2", "--kill_grace_s=30", "--",
                 sys.executable, "-c", code)
  assert proc.returncode == 3, proc.stderr
  assert (tmp_path / "got").read_text() == "15"


def test_local_reports_a_killed_process_as_128_plus_signal():
  code = ("import os, signal, time\n"
          "if os.environ['CEM_PROCESS_ID'] == '0': os.kill(os.getpid(), signal.SIGKILL)\n"
          "time.sleep(120)\n")
  proc = _launch("local.py", "--num_processes=2", "--kill_grace_s=1", "--",
                 sys.executable, "-c", code)
  assert proc.returncode == 128 + 9


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_process_whose_launcher_is_already_gone_gets_the_signal_and_runs_nothing(tmp_path):
  # The parent-death signal only fires for a death after it is set: a launcher gone before
  # then (the child's parent is another process by the time it asks) must stop it the same way.
  import signal

  marker = tmp_path / "ran"
  cmd = _script("local").dying_with_parent(["touch", str(marker)], signal.SIGTERM)
  assert cmd[-2:] == ["touch", str(marker)]
  assert subprocess.run(cmd).returncode == 0 and marker.exists()  # its parent is this process
  marker.unlink()
  cmd[cmd.index(str(os.getpid()))] = str(os.getpid() + 1)  # a parent it does not have
  assert subprocess.run(cmd).returncode == -signal.SIGTERM and not marker.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_command_that_cannot_run_is_one_line_from_the_started_process(tmp_path):
  missing = str(tmp_path / "no_such_program")
  got = subprocess.run(_script("local").dying_with_parent([missing]), capture_output=True,
                       text=True)
  assert got.returncode == 1
  assert got.stderr == f"launch: cannot run {missing!r}: No such file or directory\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_started_command_gets_the_signal_dispositions_popen_gives_it():
  # Python's start ignores SIGPIPE and SIGXFSZ and exec keeps an ignored signal: through the
  # wrapper, a shell pipeline's writer got EPIPE ("Broken pipe") instead of SIGPIPE.
  probe = ["grep", "^SigIgn", "/proc/self/status"]
  direct = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
  wrapped = subprocess.run(_script("local").dying_with_parent(probe), capture_output=True,
                           text=True, check=True).stdout
  assert wrapped == direct


def _gone(pid: int) -> bool:
  """No process ``pid``, or only its zombie (an orphan waits for whoever adopted it)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"
  except FileNotFoundError:
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_local_killed_with_sigkill_takes_its_processes_with_it(tmp_path):
  # Nothing of the launcher runs after SIGKILL: the kernel must stop its processes, else they
  # wait for their peers until JAX's initialization timeout.
  import signal

  code = (f"import os, time; p = os.path.join({str(tmp_path)!r}, os.environ['CEM_PROCESS_ID']); "
          "open(p + '.tmp', 'w').write(str(os.getpid())); os.replace(p + '.tmp', p); "
          "time.sleep(120)")
  launcher = subprocess.Popen([sys.executable, "launch/local.py", "--num_processes=2", "--",
                               sys.executable, "-c", code], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 120  # two Python starts on a loaded machine
  while len(list(tmp_path.glob("[0-9]"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.1)
  pids = [int(f.read_text()) for f in tmp_path.glob("[0-9]")]
  assert len(pids) == 2
  launcher.send_signal(signal.SIGKILL)
  launcher.wait(timeout=30)
  deadline = time.monotonic() + 30
  while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  left = [p for p in pids if not _gone(p)]
  for p in left:
    os.kill(p, signal.SIGKILL)
  assert not left


def test_local_needs_a_command_and_helps_without_one():
  proc = _launch("local.py", "--num_processes=2")
  assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
      "local.py: error: give the command after --"), proc.stderr
  proc = _launch("local.py", "--help")
  assert proc.returncode == 0 and "--devices_per_process" in proc.stdout, proc.stderr


@pytest.mark.parametrize("arg,allowed", [
    ("--num_processes=0", "an int >= 1"), ("--devices_per_process=0", "an int >= 1"),
    ("--port=65536", "0 (a free port) or 1..65535")])
def test_local_refuses_a_count_or_port_out_of_range(arg, allowed):
  proc = _launch("local.py", arg, "--dry_run", "--", "python", "x.py")
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == f"local.py: error: {arg}; allowed: {allowed}"


@pytest.mark.parametrize("script,args,message", [
    # argparse checked the required flags first: "the following arguments are required:
    # --workdir", naming the flag given right, not the one misspelt.
    ("sweep", ["--config=c.py", "--workdr=/tmp/w"],
     "unknown option '--workdr'; did you mean --workdir? allowed: --help, --config, --workdir, "
     "--launcher, --num_processes, --devices_per_process, --tpu, --zone, --project, --dry_run"),
    # An abbreviation was taken for the option it begins: no longer.
    ("sweep", ["--config=c.py", "--work=/tmp/w"], "unknown option '--work'; did you mean "
     "--workdir? allowed: "),
    ("local", ["--num_procs=2", "--", "python", "x.py"], "unknown option '--num_procs'; did you "
     "mean --num_processes? allowed: --help, --num_processes, "),
    ("slurm", ["--node=2", "--", "--config=c.py", "--workdir=w"],
     "unknown option '--node'; did you mean --nodes? allowed: --help, --nodes, "),
    ("tpu_pod", ["--tpu=t", "--zone=z", "--dryrun", "--", "--config=c.py"],
     "unknown option '--dryrun'; did you mean --dry_run? allowed: --help, --tpu, "),
])
def test_launch_scripts_name_an_unknown_option_and_the_allowed_ones(capsys, script, args,
                                                                    message):
  with pytest.raises(SystemExit) as e:
    _script(script).parse_args(args)
  assert e.value.code == 2
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert last.partition(": error: ")[2].startswith(message), last
  # A negative number stays a value (argparse's own rule), and '-h' is known.
  with pytest.raises(SystemExit) as e:
    _script("local").parse_args(["--port", "-1", "--", "python", "x.py"])
  assert "--port=-1; allowed: 0 (a free port)" in capsys.readouterr().err


def test_local_waits_for_every_process_and_reports_a_late_failure():
  # Process 0 succeeds at once; 1 fails a second later: the launcher must still see it.
  code = ("import os, sys, time\n"
          "if os.environ['CEM_PROCESS_ID'] == '1': time.sleep(1); sys.exit(3)\n")
  proc = _launch("local.py", "--num_processes=2", "--", sys.executable, "-c", code)
  assert proc.returncode == 3, proc.stderr


def test_local_passes_the_callers_environment_on(monkeypatch):
  monkeypatch.setenv("CEM_TEST_MARKER", "kept")
  proc = _launch("local.py", "--num_processes=1", "--", sys.executable, "-c",
                 "import os; print(os.environ.get('CEM_TEST_MARKER'))", env=dict(os.environ))
  assert proc.returncode == 0 and proc.stdout.split() == ["[0]", "kept"], proc.stderr


def test_local_stopped_by_sigterm_stops_its_processes_and_exits_128_plus_15(tmp_path):
  import signal

  code = (f"import os, time; p = os.path.join({str(tmp_path)!r}, os.environ['CEM_PROCESS_ID']); "
          "open(p + '.tmp', 'w').write(str(os.getpid())); os.replace(p + '.tmp', p); "
          "time.sleep(120)")
  launcher = subprocess.Popen([sys.executable, "launch/local.py", "--num_processes=2",
                               "--kill_grace_s=1", "--", sys.executable, "-c", code], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.monotonic() + 120  # two Python starts on a loaded machine
  # Each pid file is written whole under a temporary name and renamed, so present means complete.
  while len(list(tmp_path.glob("[0-9]"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.1)
  launcher.send_signal(signal.SIGTERM)
  assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
  assert b"got signal 15; stopping all processes" in launcher.stderr.read()
  for f in tmp_path.glob("[0-9]"):
    with pytest.raises(ProcessLookupError):
      os.kill(int(f.read_text()), 0)


def test_local_dry_run_without_a_port_names_one_free_port_for_all_processes():
  proc = _launch("local.py", "--num_processes=2", "--dry_run", "--", "python", "x.py")
  assert proc.returncode == 0, proc.stderr
  ports = {dict(w.split("=", 1) for w in shlex.split(line) if "=" in w)[
      "CEM_COORDINATOR_ADDRESS"].split(":")[1] for line in proc.stdout.splitlines()}
  (port,) = ports  # port 0 would be no address a process could reach
  assert 0 < int(port) < 65536


def test_local_dry_run_line_gives_the_shell_the_callers_xla_flags_as_one_word(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
  proc = _launch("local.py", "--num_processes=1", "--port=4321", "--dry_run", "--",
                 "python", "x.py", env=dict(os.environ))
  assert ("XLA_FLAGS=--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=1"
          in shlex.split(proc.stdout)), proc.stdout


# ---------------------------------------------------------------------------------------------
# tpu_pod.py


# What every worker runs to unpack the code (--remote_dir=cem_jax): the files the last copy
# unpacked and this one lacks removed (test_tpu_pod_resync_removes_what_was_deleted_here).
UNPACK = ('set -e; mkdir -p "$HOME"/cem_jax; cd "$HOME"/cem_jax; if [ -f .tpu_pod_files ]; '
          'then mv .tpu_pod_files .tpu_pod_files.old; fi; tar -xzf "$HOME"/cem_jax_src.tar.gz; '
          'if [ -f .tpu_pod_files.old ]; then LC_ALL=C sort .tpu_pod_files > .tpu_pod_files.new; '
          'LC_ALL=C sort .tpu_pod_files.old | LC_ALL=C comm -23 - .tpu_pod_files.new | while '
          'IFS= read -r f; do rm -f -- "$f"; done; rm -f .tpu_pod_files.old .tpu_pod_files.new; '
          'fi')


def test_tpu_pod_dry_run_prints_the_exact_gcloud_commands():
  proc = _launch("tpu_pod.py", "--tpu=my-v4-32", "--zone=us-central2-b", "--project=p1",
                 "--dry_run", "--", *MAIN_ARGS)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("# pack ") and lines[0].endswith("/cem_jax_src.tar.gz")
  scp, setup, run = (shlex.split(line) for line in lines[1:])
  opts = ["--zone=us-central2-b", "--worker=all", "--project=p1"]
  assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
  assert scp[6:] == ["my-v4-32:cem_jax_src.tar.gz", *opts]
  assert setup[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v4-32"]
  assert setup[6:9] == opts and setup[9].startswith("--command=")
  assert setup[9] == (
      f"--command={UNPACK}; test -x \"$HOME\"/cem_jax_venv/bin/python || python3 -m venv "
      '"$HOME"/cem_jax_venv; "$HOME"/cem_jax_venv/bin/pip install -q -U pip; '
      '"$HOME"/cem_jax_venv/bin/pip install -q \'jax[tpu]\' -c "$HOME"/cem_jax/constraints.txt; '
      '"$HOME"/cem_jax_venv/bin/pip install -q -e "$HOME"/cem_jax -c '
      '"$HOME"/cem_jax/constraints.txt')
  assert run[:9] == setup[:9]
  remote = run[9][len("--command="):]
  # What each worker's shell executes: the same command everywhere, hostile value intact.
  assert shlex.split(remote) == [
      "cd", "$HOME/cem_jax", "&&", "$HOME/cem_jax_venv/bin/python", "-m", "cem_jax.main",
      "--distributed=on", *MAIN_ARGS]
  assert "'--config.data.files=a b;rm -rf x'" in remote


def test_tpu_pod_quotes_hostile_names_and_detaches_with_a_log():
  proc = _launch("tpu_pod.py", "--tpu=tpu;reboot", "--zone=z one", "--no_sync",
                 "--remote_dir=/opt/my code", "--log=logs/run 1.log", "--dry_run", "--",
                 *MAIN_ARGS)
  assert proc.returncode == 0, proc.stderr
  (line,) = proc.stdout.splitlines()  # --no_sync: only the run
  argv = shlex.split(line)
  assert argv[5:8] == ["tpu;reboot", "--zone=z one", "--worker=all"]
  remote = shlex.split(argv[8][len("--command="):])
  assert remote[:3] == ["nohup", "sh", "-c"]
  assert remote[4:] == [">", "$HOME/logs/run 1.log", "2>&1", "<", "/dev/null", "&"]
  assert shlex.split(remote[3]) == [
      "cd", "/opt/my code", "&&", "$HOME/cem_jax_venv/bin/python", "-m", "cem_jax.main",
      "--distributed=on", *MAIN_ARGS]


def test_tpu_pod_needs_config_and_workdir():
  proc = _launch("tpu_pod.py", "--tpu=t", "--zone=z", "--dry_run", "--", "--config=a.py")
  assert proc.returncode == 2 and "give --workdir=DIR after --" in proc.stderr
  proc = _launch("tpu_pod.py", "--tpu=t", "--zone=z", "--dry_run", "--", "--workdir=/w")
  assert proc.returncode == 2 and "at least --config=FILE" in proc.stderr, proc.stderr


def test_tpu_pod_copies_the_tarball_it_has_just_packed(monkeypatch):
  # Not a stale one from an earlier launch; --no_sync packs and copies nothing.
  tpu_pod, packed, ran = _script("tpu_pod"), [], []
  monkeypatch.setattr(tpu_pod, "pack", lambda tarball: packed.append(tarball) or 3)
  monkeypatch.setattr(tpu_pod.shutil, "which", lambda name: f"/usr/bin/{name}")
  monkeypatch.setattr(tpu_pod.subprocess, "run",
                      lambda cmd: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
  assert tpu_pod.main(["--tpu=t", "--zone=z", "--", *MAIN_ARGS]) == 0
  assert len(packed) == 1 and ran[0][4] == "scp" and ran[0][5] == packed[0]
  packed.clear()
  ran.clear()
  assert tpu_pod.main(["--tpu=t", "--zone=z", "--no_sync", "--", *MAIN_ARGS]) == 0
  assert packed == [] and "scp" not in [cmd[4] for cmd in ran]


@pytest.mark.parametrize("constraints, pin", [
    ("", ""), ("/opt/pins.txt", " -c /opt/pins.txt")])
def test_tpu_pod_installs_under_the_constraints_given(constraints, pin):
  proc = _launch("tpu_pod.py", "--tpu=t", "--zone=z", f"--constraints={constraints}",
                 "--dry_run", "--", *MAIN_ARGS)
  assert proc.returncode == 0, proc.stderr
  remote = shlex.split(proc.stdout.splitlines()[2])[-1]
  assert remote.endswith(f"pip install -q 'jax[tpu]'{pin}; "
                         f'"$HOME"/cem_jax_venv/bin/pip install -q -e "$HOME"/cem_jax{pin}')


def test_tpu_pod_refuses_a_constraints_file_it_would_not_copy():
  proc = _launch("tpu_pod.py", "--tpu=t", "--zone=z", "--constraints=pins.txt", "--dry_run",
                 "--", *MAIN_ARGS)
  assert proc.returncode == 2 and proc.stdout == ""
  assert "--constraints='pins.txt': no such file in" in proc.stderr


def test_tpu_pod_no_install_only_unpacks_the_code():
  proc = _launch("tpu_pod.py", "--tpu=t", "--zone=z", "--no_install", "--dry_run", "--",
                 *MAIN_ARGS)
  assert proc.returncode == 0, proc.stderr
  setup = shlex.split(proc.stdout.splitlines()[2])
  assert setup[-1] == f"--command={UNPACK}"


@pytest.mark.parametrize("args,message", [
    (["--no_install", "--jax_requirement=jax[tpu]==0.4.30"],
     "--jax_requirement='jax[tpu]==0.4.30' has no effect with --no_install (nothing is "
     "installed); leave it out"),
    (["--no_install", "--constraints="], "--constraints='' has no effect with --no_install"),
    (["--no_sync", "--python=python3.12"],
     "--python='python3.12' has no effect with --no_sync (nothing is copied or set up)"),
    (["--no_sync", "--no_install"], "--no_install has no effect with --no_sync (nothing is "
                                    "copied or set up); leave it out")])
def test_tpu_pod_refuses_an_install_option_it_would_skip(capsys, args, message):
  # setup_script's install options are read only when the code is copied and installed.
  with pytest.raises(SystemExit) as e:
    _script("tpu_pod").parse_args(["--tpu=t", "--zone=z", "--dry_run", *args, "--", *MAIN_ARGS])
  assert e.value.code == 2
  assert f" error: {message}" in capsys.readouterr().err.strip().splitlines()[-1]
  # Where they are read, they are taken; the defaults are taken with either flag.
  tpu_pod = _script("tpu_pod")
  for ok in (["--jax_requirement=jax[tpu]==0.4.30", "--python=python3.12"],
             ["--no_install", "--constraints=constraints.txt"], ["--no_sync", "--venv=v"]):
    tpu_pod.parse_args(["--tpu=t", "--zone=z", "--dry_run", *ok, "--", *MAIN_ARGS])


def test_tpu_pod_stops_at_the_first_failed_command(monkeypatch, capsys):
  # A failed copy must not start training on the workers' old code, and the launcher (which
  # sweep.py's exit status relies on) exits with the failure's status.
  tpu_pod = _script("tpu_pod")
  ran = []
  monkeypatch.setattr(tpu_pod, "pack", lambda tarball: 3)
  monkeypatch.setattr(tpu_pod.shutil, "which", lambda name: f"/usr/bin/{name}")
  monkeypatch.setattr(tpu_pod.subprocess, "run",
                      lambda cmd: ran.append(cmd) or subprocess.CompletedProcess(cmd, 5))
  assert tpu_pod.main(["--tpu=t", "--zone=z", "--", *MAIN_ARGS]) == 5
  assert [cmd[4] for cmd in ran] == ["scp"]
  assert "launch/tpu_pod.py: scp failed with exit status 5" in capsys.readouterr().err


def test_tpu_pod_packs_the_working_tree(tmp_path):
  import tarfile

  n = _script("tpu_pod").pack(str(tmp_path / "src.tar.gz"))
  names = tarfile.open(tmp_path / "src.tar.gz").getnames()
  assert n == len(names) - 1 and "cem_jax/train.py" in names and "setup.cfg" in names
  assert not any("__pycache__" in x or x.startswith(".git/") for x in names)


def test_tpu_pod_packs_untracked_files_but_not_ignored_or_deleted_ones(tmp_path):
  import tarfile

  repo = tmp_path / "repo"
  repo.mkdir()
  for name, text in [("tracked.py", "a"), ("gone.py", "b"), ("new.py", "c"), ("out.log", "d"),
                     (".gitignore", "*.log\n")]:
    (repo / name).write_text(text)
  subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
  subprocess.run(["git", "add", "tracked.py", "gone.py", ".gitignore"], cwd=repo, check=True)
  (repo / "gone.py").unlink()  # tracked, deleted in the working tree: nothing to copy
  n = _script("tpu_pod").pack(str(tmp_path / "src.tar.gz"), repo=str(repo))
  tar = tarfile.open(tmp_path / "src.tar.gz")
  names = sorted(tar.getnames())
  assert (n, names) == (3, [".gitignore", ".tpu_pod_files", "new.py", "tracked.py"])
  assert tar.extractfile(".tpu_pod_files").read() == b".gitignore\nnew.py\ntracked.py\n"


def test_tpu_pod_resync_removes_what_was_deleted_here(tmp_path):
  # The copy is unpacked over the last one: a module deleted (or renamed) here stayed on the
  # workers, and was still imported there. The unpack command the workers run (--no_install),
  # run here by sh with HOME standing for a worker's home folder.
  tpu_pod = _script("tpu_pod")
  repo, home = tmp_path / "repo", tmp_path / "home"
  (repo / "pkg").mkdir(parents=True)
  home.mkdir()
  for name in ("keep.py", "pkg/gone.py", "pkg/stays.py", "-dash.py", "with space.py", " lead.py",
               "back\\slash.py"):
    (repo / name).write_text(name)
  subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
  args = tpu_pod.parse_args(["--tpu=t", "--zone=z", "--no_install", "--dry_run",
                             f"--remote_dir={home}/code", "--", "--config=/c.py",
                             "--workdir=/w"])[0]

  def sync():
    tpu_pod.pack(str(home / tpu_pod.TARBALL), repo=str(repo))
    subprocess.run(["sh", "-c", tpu_pod.setup_script(args)], env={**os.environ, "HOME": str(home)},
                   check=True)
    return sorted(str(p.relative_to(home / "code")) for p in (home / "code").rglob("*")
                  if p.is_file() and p.name != ".tpu_pod_files")

  (home / "code").mkdir()
  (home / "code" / "worker_own.txt").write_text("not from a copy")  # no copy unpacked it
  assert sync() == [" lead.py", "-dash.py", "back\\slash.py", "keep.py", "pkg/gone.py",
                    "pkg/stays.py", "with space.py", "worker_own.txt"]
  # Names read back as written: a leading blank or a backslash kept (read's IFS= and -r).
  for name in ("pkg/gone.py", "-dash.py", "with space.py", " lead.py", "back\\slash.py"):
    (repo / name).unlink()
  assert sync() == ["keep.py", "pkg/stays.py", "worker_own.txt"]
  assert sorted(p.name for p in (home / "code").iterdir()) == [".tpu_pod_files", "keep.py", "pkg",
                                                               "worker_own.txt"]


def test_tpu_pod_refuses_a_file_name_with_a_line_break(tmp_path):
  # The workers read their list of copied files one name a line: 'a\nb.py' would be read as
  # 'a' and 'b.py', and removing it there (once deleted here) would remove those two.
  (tmp_path / "a\nb.py").write_text("")
  subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
  with pytest.raises(SystemExit, match=r"^launch/tpu_pod\.py: 'a\\nb\.py': a file name with a "
                     r"line break; .* rename it, or name it in \.gitignore$"):
    _script("tpu_pod").pack(str(tmp_path / "src.tar.gz"), repo=str(tmp_path))


@pytest.mark.parametrize("workdir", ["runs/t", "~/runs/t", "./t", ""])
def test_tpu_pod_refuses_a_workdir_the_workers_would_not_share(workdir):
  # Relative: a folder under --remote_dir on each worker's own disk (and '~' is not expanded
  # in a quoted word): every worker would write its shards of each checkpoint where no other
  # worker sees them.
  proc = _launch("tpu_pod.py", "--tpu=t", "--zone=z", "--dry_run", "--",
                 "--config=experiments/tiny.py", f"--workdir={workdir}")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert f"error: '--workdir={workdir}': allowed: an absolute path every worker sees" in last
  assert "gcloud" not in proc.stdout


def test_tpu_pod_takes_a_relative_config_as_a_file_of_the_repository_it_copies(tmp_path):
  # The workers run in the copy of this repository: a path relative to the caller's folder
  # that is not a file of the repository names nothing there.
  (tmp_path / "mine.py").write_text("")
  proc = subprocess.run([sys.executable, str(REPO / "launch" / "tpu_pod.py"), "--tpu=t",
                         "--zone=z", "--dry_run", "--", "--config=mine.py:x", "--workdir=/w"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert f"error: '--config=mine.py:x': no file 'mine.py' in {REPO}" in proc.stderr
  proc = subprocess.run([sys.executable, str(REPO / "launch" / "tpu_pod.py"), "--tpu=t",
                         "--zone=z", "--dry_run", "--", "--config=experiments/tiny.py:llama",
                         f"--config.data.files={tmp_path}/a.txt", "--workdir=/w"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path,remote", [("~/code", '"$HOME"/code'), ("~", '"$HOME"'),
                                         ("code dir", '"$HOME"/\'code dir\''),
                                         ("/opt/x y", "'/opt/x y'")])
def test_tpu_pod_remote_paths_under_home_include_a_tilde(path, remote):
  # A quoted '~/code' would be a folder named '~' in the home folder.
  assert _script("tpu_pod").remote_path(path) == remote


def test_tpu_pod_outside_a_git_tree_or_without_git_is_one_line(tmp_path):
  # The files to copy are git's list: without it, one line, not a traceback.
  (tmp_path / "launch").mkdir()
  for name in ("tpu_pod.py", "exits.py", "options.py"):
    (tmp_path / "launch" / name).write_text((REPO / "launch" / name).read_text())
  (tmp_path / "c.py").write_text("")
  (tmp_path / "constraints.txt").write_text("")
  cmd = [sys.executable, "launch/tpu_pod.py", "--tpu=t", "--zone=z", "--dry_run", "--",
         "--config=c.py", "--workdir=/w"]
  env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path.parent))
  proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.startswith(f"launch/tpu_pod.py: {tmp_path} is not a git working tree (")
  assert proc.stderr.count("\n") == 1 and "pass --no_sync" in proc.stderr
  proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                        env=dict(env, PATH=str(tmp_path)))
  assert proc.returncode == 1 and proc.stderr.startswith(
      "launch/tpu_pod.py: git not found on PATH"), proc.stderr


def test_tpu_pod_packs_into_a_folder_of_its_own_and_removes_it(monkeypatch):
  # A fixed /tmp/cem_jax_src.tar.gz is another launch's tarball, or another user's file.
  tpu_pod, packed = _script("tpu_pod"), []
  monkeypatch.setattr(tpu_pod, "pack", lambda tarball: packed.append(tarball) or 3)
  monkeypatch.setattr(tpu_pod.shutil, "which", lambda name: f"/usr/bin/{name}")
  monkeypatch.setattr(tpu_pod.subprocess, "run",
                      lambda cmd: subprocess.CompletedProcess(cmd, 0))
  for _ in range(2):
    assert tpu_pod.main(["--tpu=t", "--zone=z", "--", *MAIN_ARGS]) == 0
  assert packed[0] != packed[1] and all(p.endswith("/cem_jax_src.tar.gz") for p in packed)
  assert not any(os.path.exists(os.path.dirname(p)) for p in packed)


# ---------------------------------------------------------------------------------------------
# slurm.py


def test_slurm_dry_run_prints_the_sbatch_script():
  proc = _launch("slurm.py", "--nodes=2", "--gpus_per_node=4", "--partition=gpu",
                 "--time=1-00:00:00", "--python=/opt/venv/bin/python", "--repo=/shared/cem jax",
                 "--dry_run", "--", *MAIN_ARGS)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[:10] == [
      "# cem_jax.sbatch",
      "#!/bin/bash",
      "#SBATCH --job-name=cem_jax",
      "#SBATCH --nodes=2",
      "#SBATCH --ntasks-per-node=4",
      "#SBATCH --gpus-per-node=4",
      "#SBATCH --time=1-00:00:00",
      "#SBATCH --output=cem_jax-%j.out",
      "#SBATCH --partition=gpu",
      "# Generated by launch/slurm.py: 2 node(s) x 4 process(es), 4 GPU(s) per node.",
  ]
  assert lines[10:13] == ["set -euo pipefail", "cd '/shared/cem jax'", (
      "srun --kill-on-bad-exit=1 /opt/venv/bin/python -m cem_jax.main --distributed=on "
      "--config=experiments/tiny.py '--workdir=/mnt/runs/t w' "
      "'--config.data.files=a b;rm -rf x'")]
  assert shlex.split(lines[12])[-len(MAIN_ARGS):] == MAIN_ARGS
  assert lines[13] == "# then: sbatch cem_jax.sbatch"
  assert not any("JAX_LOCAL_DEVICE_IDS" in x for x in lines)


def test_slurm_one_process_per_node_drives_all_its_gpus(tmp_path):
  script = tmp_path / "job.sbatch"
  proc = _launch("slurm.py", "--per=node", "--nodes=4", "--gpus_per_node=8", "--no_submit",
                 f"--script={script}", "--", "--config=experiments/tiny.py", "--workdir=/w")
  assert proc.returncode == 0, proc.stderr
  text = script.read_text()
  assert "#SBATCH --ntasks-per-node=1\n" in text and "#SBATCH --gpus-per-node=8\n" in text
  assert "export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7" in text
  assert text.rstrip().endswith(
      "-m cem_jax.main --distributed=on --config=experiments/tiny.py --workdir=/w")


def test_slurm_submits_unless_told_not_to_and_exits_with_sbatchs_status(tmp_path, monkeypatch):
  slurm = _script("slurm")
  calls = []
  monkeypatch.chdir(REPO)  # the job runs in the repository: its relative config is there
  monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")
  monkeypatch.setattr(slurm.subprocess, "run",
                      lambda cmd: calls.append(cmd) or subprocess.CompletedProcess(cmd, 1))
  script = tmp_path / "job.sbatch"
  args = [f"--script={script}", "--", "--config=experiments/tiny.py", "--workdir=/w"]
  assert slurm.main(["--no_submit", *args]) == 0 and calls == [] and script.is_file()
  assert slurm.main(args) == 1 and calls == [["sbatch", str(script)]]  # sbatch failed


@pytest.mark.parametrize("script,args,tool", [
    ("slurm.py", ["--script={tmp}/job.sbatch"], "sbatch"),
    ("tpu_pod.py", ["--tpu=t", "--zone=z"], "gcloud"),
    ("local.py", [], "no-such-tool"),
])
def test_a_launcher_whose_tool_is_missing_says_so_in_one_line_and_writes_nothing(
    script, args, tool, tmp_path):
  # Off a SLURM login node or without the Cloud CLI: one line naming the tool, no traceback,
  # no half-done work (no script written, no tarball packed, no process started).
  main = (["no-such-tool", "x"] if script == "local.py" else
          ["--config=experiments/tiny.py", "--workdir=/w"])
  proc = _launch(script, *(a.format(tmp=tmp_path) for a in args), "--", *main,
                 env=dict(os.environ, PATH=str(tmp_path)))
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f"{script}: error: ") and tool in last, last
  assert "not found on PATH" in last or "not an executable on PATH" in last, last
  if script == "local.py":  # a path is not looked up on PATH
    proc = _launch("local.py", "--", str(tmp_path / "run.sh"))
    assert proc.stderr.strip().splitlines()[-1].endswith("is not an executable file"), proc.stderr
  assert list(tmp_path.iterdir()) == []


def test_slurm_rejects_values_sbatch_cannot_quote():
  proc = _launch("slurm.py", "--partition=gpu\n#SBATCH --x", "--dry_run", "--", "--config=c",
                 "--workdir=w")
  assert proc.returncode == 2
  assert "--partition='gpu\\n#SBATCH --x'; allowed: letters, digits" in proc.stderr


@pytest.mark.parametrize("arg", ["--output=a b.out", "--job_name=x;y", "--job_name=x\n",
                                 "--account=a b", "--time=1 day", "--partition=$(x)",
                                 "--nodes=0", "--gpus_per_node=0", "--cpus_per_task=-1"])
def test_slurm_refuses_each_value_sbatch_cannot_take(arg):
  proc = _launch("slurm.py", arg, "--dry_run", "--", "--config=experiments/tiny.py", "--workdir=/w")
  name, value = arg.split("=", 1)
  assert proc.returncode == 2 and f"error: {name}=" in proc.stderr, proc.stderr
  assert "#SBATCH" not in proc.stdout


@pytest.mark.parametrize("main_args", [["--config=c.py"], ["--workdir=/w"], []])
def test_slurm_needs_both_config_and_workdir(main_args):
  proc = _launch("slurm.py", "--dry_run", "--", *main_args)
  assert proc.returncode == 2 and "at least --config=FILE and --workdir=DIR" in proc.stderr


def test_slurm_refuses_relative_paths_that_the_job_would_read_in_another_folder(tmp_path):
  # The script cds into --repo: from another folder a relative --config or --workdir names
  # another path there (a config not found after the queue, or a workdir in the repository).
  (tmp_path / "experiments").mkdir()
  (tmp_path / "experiments" / "tiny.py").write_text("")
  slurm = [sys.executable, str(REPO / "launch" / "slurm.py"), "--dry_run", "--"]
  for arg in ("--config=experiments/tiny.py", "--workdir=runs/x"):
    main = ["--config=experiments/tiny.py", "--workdir=runs/x"]
    main = [a if a == arg else a.replace("=", f"={REPO}/" if "config" in a else "=/", 1)
            for a in main]
    proc = subprocess.run([*slurm, *main], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "#SBATCH" not in proc.stdout, proc.stdout
    assert (f"error: '{arg}' is relative, and the job runs in --repo={REPO}, not in this "
            f"folder ({tmp_path})") in proc.stderr, proc.stderr
  proc = subprocess.run([*slurm, f"--config={REPO}/experiments/tiny.py", "--workdir=/w"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  # From the repository: relative paths are its own; a config that is not there is refused.
  proc = _launch("slurm.py", "--dry_run", "--", "--config=experiments/nope.py:x", "--workdir=w")
  assert proc.returncode == 2 and ("error: '--config=experiments/nope.py:x': no file "
                                   f"'experiments/nope.py' in --repo={REPO}") in proc.stderr
  assert _launch("slurm.py", "--dry_run", "--", "--config=experiments/tiny.py:llama",
                 "--workdir=w").returncode == 0


def test_the_path_fields_the_launchers_check_are_the_configs_path_fields():
  import re

  from cem_jax import config as config_lib

  values = config_lib.flat(config_lib.get_default_config())
  named = {k for k, v in values.items() if isinstance(v, str) and re.search(
      r"(dir|files|tokenizer|_from|_energy)$", k)}
  assert set(_script("options").PATH_FIELDS) == named


def test_a_scripts_help_shows_its_docstrings_first_paragraph_as_written():
  # The four launch scripts' --help: the docstring's first paragraph with its own line breaks
  # and indents (argparse would refill it), nothing of the paragraphs after it.
  doc = "Runs it.\n\n  python x.py -- A\n  B\n\nNot shown."
  parser = _script("options").script_parser(doc.split("\n\n", 1)[1], usage="x")
  assert "usage: x\n\n  python x.py -- A\n  B\n" in parser.format_help()
  assert "Not shown" not in parser.format_help()


# Relative paths in path fields, each with the path the refusal names, then values that are
# not relative paths (absolute, '~', '', an energy by registry or module name).
_RELATIVE = [(["--config.data.files=/a/x.txt,data/*.txt"], "data/*.txt"),
             (["--config.checkpoint.load_parameters_from", "runs/base"], "runs/base"),
             (["--config.data.tokenizer=tok.model"], "tok.model"),
             (["--config.model.mlp_energy=mine.py:energy"], "mine.py")]
_NOT_RELATIVE = ["--config.data.files=~/corpus/*.txt,/data/b.txt", "--config.data.tokenizer=",
                 "--config.model.mlp_energy=silu", "--config.model.attention_energy=pkg.m:f",
                 "--config.data.prepared_dir=~", "--config.train.num_steps=4"]


@pytest.mark.parametrize("script,before", [("slurm", ["--dry_run"]),
                                           ("tpu_pod", ["--tpu=t", "--zone=z", "--dry_run"])])
def test_launchers_refuse_a_relative_path_field_from_outside_the_repository(
    script, before, tmp_path, monkeypatch, capsys):
  # Their processes run in the repository (slurm: cd --repo; tpu_pod: its copy, --remote_dir):
  # from another folder a relative path would name another file there.
  main = [f"--config={REPO}/experiments/tiny.py", "--workdir=/w"]
  launcher = _script(script)
  monkeypatch.chdir(tmp_path)
  for args, path in _RELATIVE:
    with pytest.raises(SystemExit) as e:
      launcher.parse_args([*before, "--", *main, *args])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    given = " ".join(args)
    assert last.partition(": error: ")[2].startswith(
        f"{given!r}: {path!r} is relative, and "), last
    assert f"not in this folder ({tmp_path}); allowed: an absolute path or ~" in last, last
  launcher.parse_args([*before, "--", *main, *_NOT_RELATIVE])
  monkeypatch.chdir(REPO)  # from the repository: a relative path is its own, as the job's
  launcher.parse_args([*before, "--", *main, *(a for args, _ in _RELATIVE for a in args)])
  # The script itself: nothing printed or launched.
  proc = subprocess.run([sys.executable, str(REPO / "launch" / f"{script}.py"), *before, "--",
                         *main, *_RELATIVE[1][0]], cwd=tmp_path, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2 and proc.stdout == "" and "runs/base" in proc.stderr


def test_relative_paths_edge_values():
  # A field given last without a value or followed by the next flag has no path (neither an
  # IndexError nor the flag read as one); an energy is a file only as 'file.py:function', and
  # its function follows the last ':' (a folder may hold one).
  relative_paths = _script("options").relative_paths
  field = "--config.checkpoint.load_parameters_from"
  assert relative_paths(["--workdir=w", field]) == []
  assert relative_paths([field, "--workdir=w"]) == []
  assert relative_paths(["--config.model.mlp_energy=mine.py"]) == []
  assert relative_paths(["--config.model.mlp_energy=a:b/mine.py:f"]) == [
      ("--config.model.mlp_energy=a:b/mine.py:f", "a:b/mine.py")]


def test_slurm_cpus_per_task_only_when_given():
  main = ["--dry_run", "--", "--config=experiments/tiny.py", "--workdir=/w"]
  lines = _launch("slurm.py", "--cpus_per_task=6", *main).stdout.splitlines()
  assert "#SBATCH --cpus-per-task=6" in lines
  assert "cpus-per-task" not in _launch("slurm.py", *main).stdout


def test_slurm_charges_the_account_given_and_asks_four_hours_by_default():
  main = ["--dry_run", "--", "--config=experiments/tiny.py", "--workdir=/w"]
  lines = _launch("slurm.py", "--account=proj-7", *main).stdout.splitlines()
  assert "#SBATCH --account=proj-7" in lines and "#SBATCH --time=04:00:00" in lines
  assert "account" not in _launch("slurm.py", *main).stdout  # the cluster's default account


def test_slurm_refuses_no_submit_with_a_dry_run():
  # The dry run writes and submits nothing: --no_submit would change nothing.
  proc = _launch("slurm.py", "--no_submit", "--dry_run", "--", "--config=experiments/tiny.py",
                 "--workdir=/w")
  assert proc.returncode == 2 and proc.stdout == "", proc.stdout
  assert proc.stderr.strip().splitlines()[-1] == (
      "slurm.py: error: --no_submit has no effect with --dry_run (it writes and submits "
      "nothing); leave one out")


# ---------------------------------------------------------------------------------------------
# sweep.py

SWEEP_CONFIG = """
from cem_jax.config import get_default_config


def get_config(arg="a"):
  c = get_default_config()
  c.train.num_steps = 40 if arg == "a" else 10
  return c


def get_sweep(arg="a"):
  return [{"train.learning_rate": 1e-3}, {"train.learning_rate": 3e-3, "model.block": "llama"},
          {"name": "custom", "data.files": "a b;c"}]
"""


def _finish(run_dir: Path, steps: int, eval_line: bool = True, checkpoint: bool = True):
  run_dir.mkdir(parents=True)
  lines = [{"step": steps, "train/loss": 1.0}] + ([{"step": steps, "eval/loss": 1.0}]
                                                  if eval_line else [])
  write_metrics(run_dir, lines)
  if checkpoint:
    (run_dir / "checkpoints" / str(steps)).mkdir(parents=True)


def _sweep_with_first_run_finished(tmp_path, steps: int, work: str = "sw") -> tuple[Path, Path]:
  """``sweep_cfg.py`` (SWEEP_CONFIG) and the workdir ``tmp_path/work`` whose first run
  (``train.learning_rate=0.001``) has finished ``steps`` steps; returns ``(config, workdir)``."""
  cfg = tmp_path / "sweep_cfg.py"
  cfg.write_text(SWEEP_CONFIG)
  _finish(tmp_path / work / "train.learning_rate=0.001", steps)
  return cfg, tmp_path / work


def test_sweep_dry_run_skips_finished_runs(tmp_path):
  cfg, work = _sweep_with_first_run_finished(tmp_path, 40)
  _finish(work / "custom", 40, checkpoint=False)  # interrupted before its final save
  proc, longer = _sweeps(
      [f"--config={cfg}", f"--workdir={work}", "--dry_run", "--", "--config.eval.batch_size=8"],
      [f"--config={cfg}", f"--workdir={work}", "--dry_run", "--", "--config.train.num_steps=80"])
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0] == "skip train.learning_rate=0.001 (finished: step 40)"
  assert shlex.split(lines[1]) == [
      sys.executable, "-m", "cem_jax.main", f"--config={cfg}",
      f"--workdir={work}/train.learning_rate=0.003,model.block=llama",
      "--config.train.learning_rate=0.003", "--config.model.block=llama",
      "--config.eval.batch_size=8"]
  assert shlex.split(lines[2])[3:] == [
      f"--config={cfg}", f"--workdir={work}/custom", "--config.data.files=a b;c",
      "--config.eval.batch_size=8"]
  assert len(lines) == 3
  # Longer training (an override after --) makes the finished run unfinished again.
  assert longer.returncode == 0 and not longer.stdout.startswith("skip"), longer.stderr


def test_sweep_ends_with_its_runs_best_first(tmp_path):
  # A newcomer's sweep finished without a word on which run won: each run's best_eval.json,
  # best loss first, the runs without one last.
  cfg = tmp_path / "sweep_cfg.py"
  cfg.write_text(SWEEP_CONFIG)
  work = tmp_path / "sw"
  names = ["train.learning_rate=0.001", "train.learning_rate=0.003,model.block=llama", "custom"]
  for name, loss in zip(names, (3.25, 3.125, None), strict=True):
    _finish(work / name, 40)
    if loss is not None:
      (work / name / "best_eval.json").write_text(json.dumps(
          {"eval/best_loss": loss, "eval/best_bits_per_byte": loss / 2, "eval/best_step": 30}))
  # All finished: skipped (no run started, so the dry run can share the interpreter).
  proc, dry = _sweeps([f"--config={cfg}", f"--workdir={work}"],
                      [f"--config={cfg}", f"--workdir={work}", "--dry_run"])
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines()[3:] == [
      "| run | best eval loss | bits/byte | at step |", "|---|---:|---:|---:|",
      f"| {names[1]} | 3.1250 | 1.5625 | 30 |", f"| {names[0]} | 3.2500 | 1.6250 | 30 |",
      "| custom | n/a | n/a | n/a |"]
  assert len(dry.stdout.splitlines()) == 3  # a dry run lists what it would do, nothing more


@pytest.mark.parametrize("damaged", [
    '{"eval/best_loss": "3.0", "eval/best_bits_per_byte": 1.5, "eval/best_step": 30}',
    '{"eval/best_loss": null, "eval/best_bits_per_byte": 1.5, "eval/best_step": 30}',
    '{"eval/best_loss": NaN, "eval/best_bits_per_byte": 1.5, "eval/best_step": 30}',
    '{"eval/best_loss": 3.0, "eval/best_bits_per_byte": "x", "eval/best_step": 30}',
    '{"eval/best_loss": 3.0, "eval/best_bits_per_byte": 1.5, "eval/best_step": "30"}',
    '{"eval/best_loss": 3.0, "eval/best_bits_per_byte": 1.5, "eval/best_step": true}',
    '[3.0]', '{"eval/best_loss": 3.0'])
def test_sweep_summary_shows_a_damaged_best_eval_as_na(tmp_path, damaged):
  # A best_eval.json edited or half written: its run n/a and last, not a TypeError traceback
  # at the end of the sweep (its list of failed runs and exit status lost), nor a NaN first.
  sweep = _script("sweep")
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "best_eval.json").write_text(damaged)
  (tmp_path / "good").mkdir()
  (tmp_path / "good" / "best_eval.json").write_text(json.dumps(
      {"eval/best_loss": 3.5, "eval/best_bits_per_byte": 1.75, "eval/best_step": 20}))
  for names in (["bad", "good"], ["good", "bad"]):
    assert sweep.summary(str(tmp_path), names).splitlines()[2:] == [
        "| good | 3.5000 | 1.7500 | 20 |", "| bad | n/a | n/a | n/a |"]


def test_sweep_run_names_are_one_safe_folder_name():
  # A value with a slash or a space named a nested folder, or one a shell splits.
  sweep = _script("sweep")
  assert sweep.run_name({"data.files": "/d/a b*.txt", "train.learning_rate": 0.001}) == (
      "data.files=_d_a_b_.txt,train.learning_rate=0.001")
  assert sweep.run_name({}) == "default"


def _finished_b_run(tmp_path, **model) -> tuple[Path, Path, Path]:
  """``sweep_cfg.py`` (SWEEP_CONFIG) and, in ``sw/``, its first run finished as
  ``sweep_cfg.py:b`` trains it (10 steps, learning rate 1e-3, ``model`` keys set), with the
  ``config.json`` main writes; returns ``(config file, workdir, run folder)``."""
  from cem_jax.config import get_default_config

  cfg, work = _sweep_with_first_run_finished(tmp_path, 10)
  run = work / "train.learning_rate=0.001"
  trained = get_default_config()
  trained.train.num_steps, trained.train.learning_rate = 10, 1e-3
  for key, value in model.items():
    trained.model[key] = value
  (run / "config.json").write_text(trained.to_json())
  return cfg, work, run


def test_sweep_refuses_a_run_folder_started_with_another_config(tmp_path):
  # A finished run of another config (another file arg, an override after --) was skipped as
  # this sweep's run, and an unfinished one resumed as a mix of the two: main only logs the
  # changes (and refuses another model only on a resume, never on a skip).
  cfg, work, run = _finished_b_run(tmp_path)
  args = lambda spec, *extra: [f"--config={spec}", f"--workdir={work}", "--dry_run", "--",
                               *extra]
  refused = (
      (cfg, [], "train.num_steps: 10 -> 40"),  # the file's other arg
      (f"{cfg}:b", ["--config.model.d_model=64", "--config.train.weight_decay=1e-2"],
       "model.d_model: 128 -> 64; train.weight_decay: 0.1 -> 0.01"))
  proc, *refusals = _sweeps(args(f"{cfg}:b", "--config.model.remat=full"),
                            *(args(spec, *extra) for spec, extra, _ in refused))
  # computed differently: the same run
  assert proc.returncode == 0 and proc.stdout.splitlines()[0] == (
      "skip train.learning_rate=0.001 (finished: step 10)"), proc.stderr
  fix = ("it is not this run and resuming it would mix the two: use the command that started "
         "it, a new --workdir, or delete that run to train it again")
  for proc, (_, _, change) in zip(refusals, refused, strict=True):
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: {run} holds a run started with another config "
                                   f"({change}); {fix}")
  (run / "checkpoints" / "10").rmdir()  # no checkpoint: main starts the run over, no mix
  assert _launch("sweep.py", *args(cfg)).returncode == 0


def test_sweep_takes_a_relative_energy_file_for_the_absolute_one_main_saved(tmp_path):
  # main saves an energy file's path made absolute; the same relative path on the sweep's
  # command line is the same run (skipped as finished), not refused as another config.
  energy = tmp_path / "my_energy.py"
  cfg, work, _ = _finished_b_run(tmp_path, attention_energy=f"{energy}:energy")
  # CEM runs only: the energy flag after -- would make SWEEP_CONFIG's llama run one that the
  # sweep refuses before any run (check_configs).
  cfg.write_text(SWEEP_CONFIG + '\n\ndef get_sweep(arg="a"):\n'
                 '  return [{"train.learning_rate": 1e-3}]\n')
  relative = os.path.relpath(energy, REPO)  # the sweep, as main, runs in the repository
  proc = _launch("sweep.py", f"--config={cfg}:b", f"--workdir={work}", "--dry_run", "--",
                 f"--config.model.attention_energy={relative}:energy")
  assert proc.returncode == 0 and proc.stdout.splitlines()[0] == (
      "skip train.learning_rate=0.001 (finished: step 10)"), proc.stderr


def test_sweep_refuses_a_run_that_main_would_refuse_before_any_run_starts(tmp_path):
  # A NaN learning rate in the last run failed only once the runs before it had trained (a
  # day of a real sweep): now one line naming the run and the field, and nothing started.
  cfg = tmp_path / "sweep_cfg.py"
  cfg.write_text(SWEEP_CONFIG + '\n\ndef get_sweep(arg="a"):\n'
                 '  return [{"train.learning_rate": 1e-3}, {"train.learning_rate": 0.0}]\n')
  work = tmp_path / "sw"
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={work}", "--dry_run")
  assert proc.returncode == 1 and proc.stdout == "", (proc.stdout, proc.stderr)
  assert proc.stderr == ("error: run train.learning_rate=0.0: train.learning_rate=0.0; allowed: "
                         "a finite number, 0 < value; no run was started\n")
  assert not work.exists()


def test_sweep_passes_an_empty_arg_on_as_main_does(tmp_path):
  # FILE: ran get_config() here and printed runs main then refused (get_config('')) one by one.
  proc = _launch("sweep.py", "--config=experiments/lr_sweep.py:", f"--workdir={tmp_path}",
                 "--dry_run")
  assert (proc.returncode, proc.stdout) == (1, "")
  assert proc.stderr == ("error: get_config() raised ValueError: experiments/lr_sweep.py:; "
                         "allowed args: full, short\n")


def test_sweep_leaves_a_flag_it_cannot_parse_to_main_not_a_traceback_of_its_own(tmp_path):
  # An unknown key after -- (a typo) is main's to report, in one line, when the run starts;
  # the sweep's check of the folder must not end in a traceback on it.
  cfg, work = _sweep_with_first_run_finished(tmp_path, 10)
  proc = _launch("sweep.py", f"--config={cfg}:b", f"--workdir={work}", "--dry_run", "--",
                 "--config.model.no_such_key=1")
  assert proc.returncode == 0 and proc.stdout.splitlines()[0] == (
      "skip train.learning_rate=0.001 (finished: step 10)"), proc.stderr


def test_sweep_on_a_pod_and_through_the_local_launcher(tmp_path):
  cfg = tmp_path / "sweep_cfg.py"
  cfg.write_text(SWEEP_CONFIG)
  proc = _launch("sweep.py", f"--config={cfg}:b", f"--workdir={tmp_path / 'w'}", "--dry_run",
                 "--launcher=tpu_pod", "--tpu=t1", "--zone=z1")
  assert proc.returncode == 0, proc.stderr
  runs = [shlex.split(x) for x in proc.stdout.splitlines()]
  assert [r[1:5] for r in runs] == [[str(REPO / "launch/tpu_pod.py"), "--tpu=t1", "--zone=z1",
                                     x] for x in ("--", "--no_sync", "--no_sync")]
  assert runs[0][5] == f"--config={cfg}:b"
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={tmp_path / 'w'}", "--dry_run",
                 "--num_processes=2", "--devices_per_process=4")
  first = shlex.split(proc.stdout.splitlines()[0])
  assert first[1:6] == [str(REPO / "launch/local.py"), "--num_processes=2",
                        "--devices_per_process=4", "--", sys.executable]


def test_sweep_errors_are_one_line(tmp_path):
  cfg = tmp_path / "nosweep.py"
  cfg.write_text("def get_config():\n  return None\n")
  proc = _launch("sweep.py", f"--config={cfg}", "--workdir=/tmp/x", "--dry_run")
  assert proc.returncode == 1
  assert proc.stderr.strip() == ("error: the config file has no get_sweep(); define one returning "
                                 "a list of override dicts, e.g. [{'train.learning_rate': 1e-3}, "
                                 "...]")
  cfg.write_text(SWEEP_CONFIG.replace('"name": "custom"', '"name": "train.learning_rate=0.001"'))
  proc = _launch("sweep.py", f"--config={cfg}", "--workdir=/tmp/x", "--dry_run")
  assert proc.stderr.strip() == ("error: get_sweep() has two runs named "
                                 "'train.learning_rate=0.001'; give one a 'name'")
  # The file's own code or its get_config raising (a missing import, a bad ARG): one line
  # naming the file or the function, not the sweep's traceback.
  cfg.write_text("import no_such_module_here\n")
  proc = _launch("sweep.py", f"--config={cfg}", "--workdir=/tmp/x", "--dry_run")
  assert proc.returncode == 1 and proc.stderr.strip() == (
      f"error: --config='{cfg}': {cfg}: ModuleNotFoundError: No module named "
      "'no_such_module_here'")
  proc = _launch("sweep.py", "--config=experiments/lr_sweep.py:bogus", "--workdir=/tmp/x",
                 "--dry_run")
  assert proc.returncode == 1 and proc.stderr.strip() == (
      "error: get_config() raised ValueError: experiments/lr_sweep.py:bogus; allowed args: "
      "full, short")


@pytest.mark.parametrize("args,message", [
    (["--launcher=tpu_pod", "--tpu=t"], "--launcher=tpu_pod needs --tpu=NAME and --zone=ZONE"),
    (["--launcher=tpu_pod", "--zone=z"], "--launcher=tpu_pod needs --tpu=NAME and --zone=ZONE"),
    (["--num_processes=0"], "--num_processes=0; allowed: an int >= 1")])
def test_sweep_refuses_a_pod_without_its_name_and_zone_or_no_processes(tmp_path, args, message):
  proc = _launch("sweep.py", "--config=experiments/tiny.py", f"--workdir={tmp_path}",
                 "--dry_run", *args)
  assert proc.returncode == 2 and proc.stderr.strip().endswith(message), proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--tpu=t"], "--tpu='t' applies to --launcher=tpu_pod only; leave it out with "
                  "--launcher=local"),
    (["--num_processes=2", "--zone=z"], "--zone='z' applies to --launcher=tpu_pod only"),
    (["--project=p"], "--project='p' applies to --launcher=tpu_pod only"),
    (["--launcher=tpu_pod", "--tpu=t", "--zone=z", "--num_processes=2"],
     "--num_processes=2 applies to --launcher=local only (a pod runs one process per worker, "
     "on its own devices); leave it out"),
    (["--launcher=tpu_pod", "--tpu=t", "--zone=z", "--devices_per_process=4"],
     "--devices_per_process=4 applies to --launcher=local only"),
    (["--devices_per_process=4"], "--devices_per_process=4 has no effect with "
                                  "--num_processes=1 (one plain process on this machine's "
                                  "devices); allowed: 1, or --num_processes >= 2"),
    (["--num_processes=2", "--devices_per_process=0"],
     "--devices_per_process=0; allowed: an int >= 1")])
def test_sweep_refuses_an_option_its_launcher_would_ignore(capsys, args, message):
  # run_command reads --tpu/--zone/--project for a pod only, the process and device counts
  # locally only, and the device count only through launch/local.py (several processes).
  with pytest.raises(SystemExit) as e:
    _script("sweep").parse_args(["--config=experiments/tiny.py", "--workdir=/w", *args])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert f" error: {message}" in err, err
  # What each launcher does read is still accepted.
  for ok in (["--num_processes=2", "--devices_per_process=4"],
             ["--launcher=tpu_pod", "--tpu=t", "--zone=z", "--project=p"]):
    _script("sweep").parse_args(["--config=experiments/tiny.py", "--workdir=/w", *ok])


def _sweep_file(tmp_path: Path, sweep: str) -> Path:
  cfg = tmp_path / "c.py"
  cfg.write_text("import numpy as np\nfrom cem_jax.config import get_default_config\n\n\n"
                 "def get_config():\n  return get_default_config()\n\n\n"
                 f"def get_sweep():\n  return {sweep}\n")
  return cfg


def test_sweep_entry_that_is_not_a_dict_is_a_one_line_error(tmp_path):
  cfg = _sweep_file(tmp_path, "[[('train.learning_rate', 1e-3)]]")
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={tmp_path}/w", "--dry_run")
  assert proc.returncode == 1 and proc.stderr.strip() == (
      "error: get_sweep() entry 0 is [('train.learning_rate', 0.001)]; allowed: a dict of "
      "'group.key': value overrides")


@pytest.mark.parametrize("sweep,error", [
    ("[{'name': 'x'}, {'name': 'x/'}]", "get_sweep() entry 1 has name 'x/'; allowed: a folder "
                                        "name inside --workdir (no '/', not '.' or '..')"),
    ("[{'name': '../escape'}]", "get_sweep() entry 0 has name '../escape'; allowed: "),
    ("[{'name': '.'}]", "get_sweep() entry 0 has name '.'; allowed: "),
    ("None", "get_sweep() returned None; allowed: a non-empty list of dicts"),
    ("[]", "get_sweep() returned []; allowed: a non-empty list of dicts"),
    ("1 / 0", "get_sweep() raised ZeroDivisionError: division by zero"),
    ("[{'train.num_steps': 10.5}]",
     "get_sweep() entry 0: train.num_steps=10.5; allowed: an integer"),
    ("[{'train.learning_rate': 1}, {'train.learning_rate': 1.0}]",
     "get_sweep() has two runs named 'train.learning_rate=1.0'; give one a 'name'"),
])
def test_a_sweep_that_would_share_a_folder_or_cannot_run_is_a_one_line_error(tmp_path, sweep,
                                                                            error):
  cfg = _sweep_file(tmp_path, sweep)
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={tmp_path}/w", "--dry_run")
  assert proc.returncode == 1 and proc.stderr.startswith(f"error: {error}"), proc.stderr
  assert proc.stdout == "" and not (tmp_path / "w").exists()


@pytest.mark.parametrize("extra", ["--workdir=/tmp/y", "--config=other.py",
                                   "--config.train.num_steps=ten"])
def test_what_follows_the_sweeps_double_dash_may_not_merge_its_runs(tmp_path, extra):
  cfg = _sweep_file(tmp_path, "[{'train.learning_rate': 1e-3}]")
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={tmp_path}/w", "--dry_run", "--",
                 extra)
  assert proc.returncode in (1, 2) and proc.stdout == "", proc.stdout
  last = proc.stderr.strip().splitlines()[-1]
  assert last.endswith("give it before --") or last == (
      "error: train.num_steps='ten'; allowed: an int >= 1"), last


def test_sweep_numpy_values_and_an_entry_without_overrides_get_folders_and_flags(tmp_path):
  # np.logspace gives np.float64: its repr ('np.float64(0.001)') is no value a flag parses.
  cfg = _sweep_file(tmp_path, "[{}] + [{'train.learning_rate': lr, 'train.num_steps': n} "
                              "for lr, n in zip(np.logspace(-3, -2, 2), np.array([10, 20]))]")
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={tmp_path}/w", "--dry_run")
  assert proc.returncode == 0, proc.stderr
  runs = [shlex.split(line)[4:] for line in proc.stdout.splitlines()]
  assert runs == [
      [f"--workdir={tmp_path}/w/default"],  # the config as it is, in a folder of its own
      [f"--workdir={tmp_path}/w/train.learning_rate=0.001,train.num_steps=10",
       "--config.train.learning_rate=0.001", "--config.train.num_steps=10"],
      [f"--workdir={tmp_path}/w/train.learning_rate=0.01,train.num_steps=20",
       "--config.train.learning_rate=0.01", "--config.train.num_steps=20"]]


def test_sweep_names_a_run_by_its_values_as_the_config_field_types_read_them(tmp_path):
  # 1 and 1.0 (or '1e-3' and 0.001) for a float field are one run: they were two folders,
  # the second training the first's run again under another name.
  cfg = _sweep_file(tmp_path, "[{'train.learning_rate': 1, 'train.num_steps': np.int64(20), "
                              "'checkpoint.async_save': 'false', 'model.block': 'llama'}, "
                              "{'train.learning_rate': '1e-3', 'train.warmup_steps': '5'}]")
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={tmp_path}/w", "--dry_run")
  assert proc.returncode == 0, proc.stderr
  runs = [shlex.split(line)[4:] for line in proc.stdout.splitlines()]
  assert runs == [
      [f"--workdir={tmp_path}/w/train.learning_rate=1.0,train.num_steps=20,"
       "checkpoint.async_save=False,model.block=llama", "--config.train.learning_rate=1.0",
       "--config.train.num_steps=20", "--config.checkpoint.async_save=False",
       "--config.model.block=llama"],
      [f"--workdir={tmp_path}/w/train.learning_rate=0.001,train.warmup_steps=5",
       "--config.train.learning_rate=0.001", "--config.train.warmup_steps=5"]]


@pytest.mark.parametrize("key, given, read", [
    ("checkpoint.async_save", "true", True), ("checkpoint.async_save", "True", True),
    ("checkpoint.async_save", 1, True), ("checkpoint.async_save", "F", False),
    ("train.learning_rate", "-1e-3", -0.001), ("train.learning_rate", -0.001, -0.001),
    ("train.learning_rate", "1E+2", 100.0), ("train.learning_rate", 2, 2.0),
    ("train.num_steps", "0x10", 16),  # as absl reads the flag main is given
    ("model.block", "1e0", "1e0"), ("data.files", 10, 10),  # not a number field: as given
])
def test_sweep_reads_each_spelling_of_a_value_as_its_field_does(key, given, read):
  from cem_jax import config as config_lib

  fields = config_lib.flat(config_lib.get_default_config())
  got = _script("sweep").normalised({key: given}, fields, "get_sweep() entry 0")[key]
  assert (got, type(got)) == (read, type(read))


@pytest.mark.parametrize("get_config, error", [
    ("def get_config():\n  pass\n", "error: get_config() returned a NoneType; allowed: an "
     "ml_collections.ConfigDict (e.g. cem_jax.config.get_default_config() with your changes)"),
    # Was a traceback (AttributeError) since the sweep reads the config's field types.
    ("", "error: the config file has no get_config(); define one returning the config the "
     "sweep's runs override (e.g. cem_jax.config.get_default_config() with your changes)"),
])
def test_sweep_without_a_config_from_get_config_is_a_one_line_error(tmp_path, get_config,
                                                                    error):
  cfg = tmp_path / "c.py"
  cfg.write_text(f"{get_config}\n\ndef get_sweep():\n  return [{{'seed': 1}}]\n")
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={tmp_path}/w", "--dry_run")
  assert proc.returncode == 1 and proc.stderr.splitlines() == [error]
  assert proc.stdout == "" and not (tmp_path / "w").exists()


SWEEP_STEPS_CONFIG = """
from cem_jax.config import get_default_config


def get_config():
  c = get_default_config()
  c.train.num_steps = 40
  return c


def get_sweep():
  return [{"name": "short", "train.num_steps": 20}, {"name": "no_eval"},
          {"data.files": "../data/x.txt"}]
"""


def test_sweep_judges_a_run_by_its_own_num_steps_and_its_final_eval(tmp_path):
  cfg = tmp_path / "sweep_cfg.py"
  cfg.write_text(SWEEP_STEPS_CONFIG)
  work = tmp_path / "sw"
  _finish(work / "short", 20)  # its own override: 20 steps, not the config's 40
  _finish(work / "no_eval", 40, eval_line=False)  # killed between its last step and final eval
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={work}", "--dry_run")
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0] == "skip short (finished: step 20)"
  assert shlex.split(lines[1])[4] == f"--workdir={work}/no_eval"
  # A value's '/' neither nests the run's folder nor ('..') puts it outside --workdir.
  assert shlex.split(lines[2])[4] == f"--workdir={work}/data.files=.._data_x.txt"


def test_sweep_reads_metrics_with_the_one_parser(tmp_path):
  """A torn last line (a kill mid-write) is skipped; damage before it is one line naming the
  run and the file, not a run silently judged unfinished and trained again over it."""
  cfg = tmp_path / "sweep_cfg.py"
  cfg.write_text(SWEEP_STEPS_CONFIG)
  work = tmp_path / "sw"
  _finish(work / "short", 20)
  with open(work / "short" / "metrics.jsonl", "a") as f:
    f.write('{"step": 21, "train/lo')  # torn
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={work}", "--dry_run")
  assert proc.returncode == 0 and proc.stdout.startswith("skip short"), proc.stderr
  metrics = work / "short" / "metrics.jsonl"
  metrics.write_text("not json\n" + metrics.read_text())
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={work}", "--dry_run")
  assert proc.returncode == 1 and proc.stdout == ""
  assert proc.stderr.startswith(f"error: run '{work}/short': {metrics}:1 is not valid JSON")
  assert len(proc.stderr.strip().splitlines()) == 1


def test_sweep_refuses_extra_flags_for_a_key_it_sets(tmp_path):
  # After the run's own --config.KEY flag, EXTRA's would win: every run the same value under
  # a folder name that says another.
  cfg = tmp_path / "sweep_cfg.py"
  cfg.write_text(SWEEP_CONFIG)
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={tmp_path / 'w'}", "--dry_run",
                 "--", "--config.train.learning_rate=0.1")
  assert proc.returncode == 1 and proc.stdout == "", proc.stdout
  assert proc.stderr == ("error: --config.train.learning_rate=0.1 after -- overrides "
                         "train.learning_rate, which get_sweep() sets per run (2 of 3 runs, "
                         "e.g. 'train.learning_rate=0.001'); allowed: after --, only keys the "
                         "sweep does not set\n")
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={tmp_path / 'w'}", "--dry_run",
                 "--", "--config.train.seed=3")
  assert proc.returncode == 0 and "--config.train.seed=3" in proc.stdout, proc.stderr


def test_sweep_refuses_an_extra_config_flag_whose_value_is_the_next_word(tmp_path):
  # '--config.train.num_steps 80': the sweep judged "finished" by the file's num_steps (40)
  # and skipped a run main would have trained to 80.
  cfg, work = _sweep_with_first_run_finished(tmp_path, 40, "w")
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={work}", "--dry_run", "--",
                 "--config.train.num_steps", "80")
  assert proc.returncode == 2 and proc.stdout == "", proc.stdout
  assert proc.stderr.strip().splitlines()[-1] == (
      "sweep.py: error: --config.train.num_steps after -- without =VALUE; allowed: "
      "--config.train.num_steps=VALUE, one word")
  proc = _launch("sweep.py", f"--config={cfg}", f"--workdir={work}", "--dry_run", "--",
                 "--config.train.num_steps=80")
  assert proc.returncode == 0 and "skip" not in proc.stdout, proc.stdout


def test_sweep_on_a_pod_needs_an_absolute_workdir(tmp_path):
  cfg = tmp_path / "sweep_cfg.py"
  cfg.write_text(SWEEP_CONFIG)
  proc = _launch("sweep.py", f"--config={cfg}", "--workdir=runs/w", "--dry_run",
                 "--launcher=tpu_pod", "--tpu=t1", "--zone=z1")
  assert proc.returncode == 2 and proc.stdout == "", proc.stdout
  assert "error: --workdir='runs/w' with --launcher=tpu_pod; allowed: an absolute" in proc.stderr


def test_sweep_copies_the_code_with_its_first_launched_run_and_fails_if_any_run_fails(
    tmp_path, monkeypatch, capsys):
  sweep = _script("sweep")
  cfg, work = _sweep_with_first_run_finished(tmp_path, 40)  # the sweep's first run: skipped
  ran, codes = [], iter([-9, 0])  # the first launched run is killed by SIGKILL
  monkeypatch.setattr(sweep, "run_one", lambda cmd, env: ran.append((cmd, env)) or
                      (next(codes), None))
  monkeypatch.setenv("PYTHONPATH", "/elsewhere")
  status = sweep.main([f"--config={cfg}", f"--workdir={work}", "--launcher=tpu_pod", "--tpu=t",
                       "--zone=z", "--project=p"])
  assert status == 1
  err = capsys.readouterr().err
  assert "1 of 3 runs failed: train.learning_rate=0.003,model.block=llama" in err
  # Popen's -9 in words: the signal that ended the run, not an "exit status -9".
  assert ("launch/sweep.py: run train.learning_rate=0.003,model.block=llama failed with "
          "signal 9\n") in err
  # The first run that starts copies the code (no --no_sync), whichever run of the sweep it is;
  # so does the run after a failed one (the failure may have been the copy: the next run would
  # train the workers' old code).
  assert [cmd[2:6] for cmd, _ in ran] == [["--tpu=t", "--zone=z", "--project=p", "--"]] * 2
  # cem_jax imports in the runs even when it is not pip-installed.
  assert {env["PYTHONPATH"] for _, env in ran} == {f"{REPO}{os.pathsep}/elsewhere"}
  # Once a run succeeded, the code on the workers is this one: not copied again, until a run
  # fails.
  ran.clear()
  codes = iter([0, 5, 0])
  assert sweep.main([f"--config={cfg}", f"--workdir={tmp_path / 'sw2'}", "--launcher=tpu_pod",
                     "--tpu=t", "--zone=z"]) == 1
  assert ["--no_sync" in cmd for cmd, _ in ran] == [False, True, False]


# A stand-in run: records the signal that stops it (main saves on SIGTERM and exits 0).
_SIGNALLED_RUN = """
import os, signal, sys, time
run = sys.argv[1].split("=", 1)[1]
os.makedirs(run, exist_ok=True)
got = []
def stop(signum, frame):
  got.append(signum)
  with open(os.path.join(run, "stopped"), "a") as f:
    f.write(f"{signum}\\n")
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
with open(os.path.join(run, "started.tmp"), "w") as f:  # its group: whom a Ctrl-C reaches
  f.write(str(os.getpgid(0)))
os.replace(os.path.join(run, "started.tmp"), os.path.join(run, "started"))
deadline = time.time() + 60
while not got and time.time() < deadline:
  time.sleep(0.05)
time.sleep(0.5)  # a second delivery, if one was sent, is written down before "exited" says done
open(os.path.join(run, "exited"), "w").close()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_signal_to_the_sweep_reaches_its_run_once_and_stops_the_sweep(tmp_path, sig):
  # Before, a sweep stopped with kill (or killed with -9) left its run training without it, and
  # a rerun trained a second copy beside it; Ctrl-C must reach the run once, not twice.
  import signal

  cfg = tmp_path / "sweep_cfg.py"
  cfg.write_text(SWEEP_CONFIG)
  work = tmp_path / "sw"
  run = [sys.executable, "-c", _SIGNALLED_RUN]
  wrapper = (  # launch/sweep.py with the stand-in as each run's command
      "import importlib.util, sys\n"
      f"sys.path.append({str(REPO / 'launch')!r})\n"
      f"spec = importlib.util.spec_from_file_location('sweep', {str(REPO / 'launch')!r} + "
      "'/sweep.py')\n"
      "sweep = importlib.util.module_from_spec(spec); spec.loader.exec_module(sweep)\n"
      f"sweep.run_command = lambda args, mains, first: {run!r} + [mains[1]]\n"
      f"sys.exit(sweep.main(['--config={cfg}', '--workdir={work}']))\n")
  # Its own process group, as a shell gives a command: Ctrl-C signals the whole group.
  proc = subprocess.Popen([sys.executable, "-c", wrapper], stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  first = work / "train.learning_rate=0.001"
  try:
    for _ in range(300):
      if (first / "started").exists():
        break
      time.sleep(0.1)
    assert (first / "started").exists(), proc.stderr.read() if proc.poll() is not None else ""
    # Not in the sweep's group: the terminal's Ctrl-C reaches the run only through the sweep.
    # Checked here, as two SIGINTs sent close together may arrive as one.
    assert int((first / "started").read_text()) != proc.pid
    if sig == "SIGINT":  # Ctrl-C: the terminal signals the foreground group
      os.killpg(proc.pid, signal.SIGINT)
    else:
      proc.send_signal(getattr(signal, sig))
    code = proc.wait(timeout=30)
  finally:
    proc.kill()
  # After a SIGKILL the run gets SIGTERM from the kernel a moment later; "stopped" is only read
  # once the run says it is done writing (reading on its mere existence raced the write in CI).
  for _ in range(150):
    if (first / "exited").exists():
      break
    time.sleep(0.1)
  expected = signal.SIGTERM if sig == "SIGKILL" else getattr(signal, sig)
  stopped = (first / "stopped").read_text().splitlines()
  if sig == "SIGKILL":
    # The kernel sends the parent-death signal each time the run passes from one exiting
    # thread of the killed sweep to the next: once or more (cem_jax.main's SIGTERM is a flag).
    assert stopped and set(stopped) == {str(int(expected))}, stopped
  else:
    assert stopped == [str(int(expected))]  # once
  assert sorted(p.name for p in work.iterdir()) == [first.name]  # no later run started
  if sig == "SIGKILL":
    assert code == -signal.SIGKILL
  else:
    assert code == 128 + getattr(signal, sig)
    assert proc.stderr.read().splitlines()[-1] == (
        f"launch/sweep.py: got signal {int(expected)}; run {first.name} stopped with exit "
        "status 0, the sweep with it: run the same command to resume")


def test_a_signal_as_the_run_starts_reaches_it(monkeypatch):
  # A signal between the run's start and the sweep's handler ended the sweep itself (SIGTERM's
  # default action; SIGINT raised KeyboardInterrupt) instead of reaching the run.
  import signal

  sweep = _script("sweep")
  real = subprocess.Popen

  def started_then_signalled(*args, **kwargs):
    proc = real(*args, **kwargs)
    signal.raise_signal(signal.SIGTERM)
    return proc

  monkeypatch.setattr(sweep.subprocess, "Popen", started_then_signalled)
  outside = []  # where a SIGTERM the sweep does not take goes, instead of ending pytest
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: outside.append(signum))
  try:
    got = sweep.run_one([sys.executable, "-c", "import time; time.sleep(10)"], dict(os.environ))
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert got == (-signal.SIGTERM, signal.SIGTERM) and outside == []


@pytest.mark.parametrize("script,args", [
    ("local.py", ["--num_processes=2", "--port=4321", "--dry_run", "--", "python", "x.py"]),
    ("slurm.py", ["--dry_run", "--", f"--config={REPO}/experiments/tiny.py", "--workdir=/w"]),
    ("tpu_pod.py", ["--tpu=t", "--zone=z", "--dry_run", "--", "--config=experiments/tiny.py",
                    "--workdir=/w"]),
    ("sweep.py", ["--config=experiments/lr_sweep.py:short", "--workdir={tmp}", "--dry_run"]),
], ids=["local", "slurm", "tpu_pod", "sweep"])
def test_a_dry_run_whose_reader_has_gone_ends_with_status_1_and_no_traceback(script, args,
                                                                             tmp_path):
  # `--dry_run | head -1`: the pipe is closed before the script writes. Each printed a
  # BrokenPipeError traceback (and Python a second one at exit).
  # Buffered, as a user's shell runs it: unbuffered, every print met the closed pipe at once
  # and the flush at the end of exits.run was never the first write to fail.
  buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
  read, write = os.pipe()
  os.close(read)
  try:
    proc = subprocess.run([sys.executable, f"launch/{script}",
                           *[a.format(tmp=tmp_path) for a in args]], cwd=REPO, stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=120, env=buffered)
  finally:
    os.close(write)
  assert (proc.returncode, proc.stderr) == (1, ""), proc.stderr[-2000:]
