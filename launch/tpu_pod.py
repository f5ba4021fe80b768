"""Train on a Cloud TPU VM pod slice: the same ``python -m cem_jax.main`` on every worker.

    python launch/tpu_pod.py --tpu=my-v4-32 --zone=us-central2-b -- \\
        --config=experiments/tiny.py --workdir=/mnt/shared/runs/tiny

Three steps, each one ``gcloud compute tpus tpu-vm`` command over ``--worker=all``:

1. ``scp`` this working tree (git's tracked and untracked, not ignored, files, packed into one
   tarball here) to every worker;
2. ``ssh``: unpack it into ``--remote_dir`` and remove there the files an earlier copy
   unpacked that this one lacks (deleted or renamed here: a stale module would still be
   imported; nothing else there is touched), create the venv ``--venv`` if missing, install
   ``jax[tpu]`` and the package (``pip install -e``), both under ``-c constraints.txt`` (the
   copied repository's: the versions its figures were measured with; ``--constraints=''`` lets
   pip take the newest, e.g. for another ``--jax_requirement``); skipped with
   ``--no_install`` (then only the code is refreshed);
3. ``ssh``: ``cd --remote_dir && VENV/bin/python -m cem_jax.main --distributed=on ARGS`` on all
   workers at once: ``jax.distributed.initialize()`` finds the other workers through the TPU
   metadata, every worker feeds its own slice of each batch, process 0 writes the metrics.

``ARGS`` (everything after ``--``) go to ``cem_jax.main`` unchanged. ``--workdir`` must be on
storage every worker sees at the same path (a Filestore/NFS mount or a gcsfuse-mounted bucket):
all workers write their shards of each Orbax checkpoint there and read the data caches: an
absolute path (a relative one is a one-line error). A relative ``--config=FILE`` is a file of
this repository (the workers run in its copy), and so is a relative path in a path-valued
``--config.FIELD`` (``data.files``, ``checkpoint.load_parameters_from``, ...:
``options.PATH_FIELDS``; only files git tracks or leaves unignored are copied); given from
another folder it is a one-line error. ``--remote_dir``, ``--venv`` and ``--log`` that
are not absolute (``~/x`` included) are relative to the remote home folder.

``--dry_run`` prints the exact commands instead of running them; every user value in them is
shell-quoted (``shlex.quote``), also inside the remote ``--command``. A failing step stops the
launcher with that step's exit status.
"""

from __future__ import annotations

import argparse
import io
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import options  # beside this script: python runs it with its folder first on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARBALL = "cem_jax_src.tar.gz"  # in the remote home folder
# In the tarball: the files it holds, one a line. Unpacked over the last copy, it tells the
# workers which files of that copy the new one no longer has.
SYNCED = ".tpu_pod_files"


def remote_path(path: str) -> str:
  """``path`` for a remote shell: absolute paths quoted as they are, others (and ``~/...``)
  under ``$HOME``: a quoted ``~`` would be a folder named ``~``."""
  if path.startswith("/"):
    return shlex.quote(path)
  if path == "~" or path.startswith("~/"):
    path = path[2:]
    if not path:
      return '"$HOME"'
  return '"$HOME"/' + shlex.quote(path)


def gcloud(verb: str, args: argparse.Namespace) -> tuple[list[str], list[str]]:
  """``(['gcloud', 'compute', 'tpus', 'tpu-vm', VERB], options)``: zone, all workers, project."""
  cmd = ["gcloud", "compute", "tpus", "tpu-vm", verb]
  return cmd, [f"--zone={args.zone}", "--worker=all",
               *([f"--project={args.project}"] if args.project else [])]


def scp_command(args: argparse.Namespace, tarball: str) -> list[str]:
  cmd, opts = gcloud("scp", args)
  return [*cmd, tarball, f"{args.tpu}:{TARBALL}", *opts]


def ssh_command(args: argparse.Namespace, remote: str) -> list[str]:
  cmd, opts = gcloud("ssh", args)
  return [*cmd, args.tpu, *opts, f"--command={remote}"]


def setup_script(args: argparse.Namespace) -> str:
  """The remote shell line that unpacks the code and (unless ``--no_install``) installs it."""
  src, venv = remote_path(args.remote_dir), remote_path(args.venv)
  old, new, c = f"{SYNCED}.old", f"{SYNCED}.new", "LC_ALL=C"
  # The files the last copy unpacked and this one lacks (deleted or renamed here) are removed:
  # a stale module would still be imported. Only those: not the venv, build files or the
  # workers' own files, which a cleared --remote_dir would lose.
  steps = ["set -e", f"mkdir -p {src}", f"cd {src}",
           f"if [ -f {SYNCED} ]; then mv {SYNCED} {old}; fi",
           f'tar -xzf "$HOME"/{TARBALL}',
           f"if [ -f {old} ]; then {c} sort {SYNCED} > {new}; {c} sort {old} | {c} comm -23 - "
           f'{new} | while IFS= read -r f; do rm -f -- "$f"; done; rm -f {old} {new}; fi']
  if args.install:
    pip = f"{venv}/bin/pip"
    # Pinned as here: without -c the workers would train on whatever jax and flax are newest.
    pin = ""
    if args.constraints:
      pin = " -c " + (shlex.quote(args.constraints) if args.constraints.startswith("/")
                      else f"{src}/{shlex.quote(args.constraints)}")
    steps += [f"test -x {venv}/bin/python || {shlex.quote(args.python)} -m venv {venv}",
              f"{pip} install -q -U pip",
              f"{pip} install -q {shlex.quote(args.jax_requirement)}{pin}",
              f"{pip} install -q -e {src}{pin}"]
  return "; ".join(steps)


def train_script(args: argparse.Namespace, main_args: list[str]) -> str:
  """The remote shell line that runs the training on one worker (the same on all)."""
  python = f"{remote_path(args.venv)}/bin/python"
  run = " ".join([python, "-m", "cem_jax.main", "--distributed=on",
                  *(shlex.quote(a) for a in main_args)])
  line = f"cd {remote_path(args.remote_dir)} && {run}"
  if args.log:
    # Detached: keeps training when the ssh session ends; output in --log on every worker.
    line = f"nohup sh -c {shlex.quote(line)} > {remote_path(args.log)} 2>&1 < /dev/null &"
  return line


def commands(args: argparse.Namespace, main_args: list[str], tarball: str) -> list[list[str]]:
  """The gcloud commands, in order: copy the code, install, train."""
  out = []
  if args.sync:
    out.append(scp_command(args, tarball))
    out.append(ssh_command(args, setup_script(args)))
  out.append(ssh_command(args, train_script(args, main_args)))
  return out


def source_files(repo: str = REPO) -> list[str]:
  """Files git tracks plus untracked ones it does not ignore (paths relative to ``repo``)."""
  try:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=repo, check=True, capture_output=True).stdout
  except FileNotFoundError:
    raise SystemExit("launch/tpu_pod.py: git not found on PATH: it lists the files to copy "
                     "(tracked and untracked, not ignored); install git, or copy the code "
                     "yourself and pass --no_sync") from None
  except subprocess.CalledProcessError as e:
    said = (e.stderr.decode(errors="replace").strip().splitlines() or ["git ls-files failed"])
    raise SystemExit(f"launch/tpu_pod.py: {repo} is not a git working tree ({said[0]}); "
                     "the files to copy are git's tracked and untracked, not ignored, ones: "
                     "run it from a clone, or copy the code yourself and pass --no_sync") from None
  paths = out.decode().split("\0")
  return sorted({p for p in paths if p and os.path.isfile(os.path.join(repo, p))})


def pack(tarball: str, repo: str = REPO) -> int:
  """Writes the working tree's source files into ``tarball``, with their list as
  :data:`SYNCED`; returns how many.

  Raises:
    SystemExit: a file name with a line break (one line naming it).
  """
  files = source_files(repo)
  for path in files:
    if "\n" in path:  # it would be read there as two names: two other files removed
      raise SystemExit(f"launch/tpu_pod.py: {path!r}: a file name with a line break; the "
                       f"workers' list of the files copied ({SYNCED}) holds one name a line: "
                       "rename it, or name it in .gitignore")
  listing = "".join(f"{path}\n" for path in files).encode()
  with tarfile.open(tarball, "w:gz") as tar:
    for path in files:
      tar.add(os.path.join(repo, path), arcname=path)
    info = tarfile.TarInfo(SYNCED)
    info.size, info.mode, info.mtime = len(listing), 0o644, int(time.time())
    tar.addfile(info, io.BytesIO(listing))
  return len(files)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  own, after = options.split_at_dashes(argv)
  parser = options.script_parser(__doc__)
  parser.add_argument("--tpu", required=True, help="TPU VM name")
  parser.add_argument("--zone", required=True)
  parser.add_argument("--project", default="", help="default: gcloud's configured project")
  parser.add_argument("--remote_dir", default="cem_jax", help="code folder on every worker")
  parser.add_argument("--venv", default="cem_jax_venv", help="virtualenv on every worker")
  parser.add_argument("--python", default="python3", help="remote python that creates the venv")
  parser.add_argument("--jax_requirement", default="jax[tpu]",
                      help="pip requirement for JAX on the workers")
  parser.add_argument("--constraints", default="constraints.txt",
                      help="pip constraints file for both installs, relative to the copied "
                           "repository or absolute on the workers; '' for none")
  parser.add_argument("--no_sync", dest="sync", action="store_false",
                      help="run only: the code and venv are already on the workers")
  parser.add_argument("--no_install", dest="install", action="store_false",
                      help="copy the code but do not pip install (the venv is set up)")
  parser.add_argument("--log", default="",
                      help="run detached (nohup), output to this remote file on every worker")
  parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
  args = parser.parse_args(own)
  main_args = after or []
  if not any(a.startswith("--config=") for a in main_args):
    parser.error("give cem_jax.main's arguments after --, at least --config=FILE and "
                 "--workdir=DIR")
  if not any(a.startswith("--workdir=") for a in main_args):
    parser.error("give --workdir=DIR after -- (a folder every worker sees at the same path)")
  for a in main_args:
    if a.startswith("--workdir=") and not a[len("--workdir="):].startswith("/"):
      # Relative: inside --remote_dir, on each worker's own disk; '~' is not expanded there.
      parser.error(f"{a!r}: allowed: an absolute path every worker sees (a shared mount, e.g. "
                   "--workdir=/mnt/shared/runs/x); a relative one would be a folder on each "
                   "worker's own disk, where no worker sees the others' checkpoint shards")
    if a.startswith("--config=") and not a[len("--config="):].startswith("/"):
      file = a[len("--config="):].partition(":")[0]
      if not os.path.isfile(os.path.join(REPO, file)):
        # The workers run in --remote_dir, the copy of this repository: paths are relative to it.
        parser.error(f"{a!r}: no file {file!r} in {REPO}; allowed: a path relative to this "
                     "repository (the workers run in its copy, --remote_dir) or an absolute "
                     "one every worker sees")
  if os.path.realpath(os.getcwd()) != os.path.realpath(REPO):
    for a, path in options.relative_paths(main_args):
      # The workers run in --remote_dir: a path relative to this folder names another there.
      parser.error(f"{a!r}: {path!r} is relative, and the workers run in --remote_dir (a "
                   f"copy of {REPO}), not in this folder ({os.getcwd()}); allowed: an absolute "
                   f"path or ~, or run this from {REPO}")
  # The install options are read only by the set-up that --no_sync skips and --no_install
  # cuts to the unpacking (setup_script, commands): another value there would be ignored.
  skipped = "--no_sync (nothing is copied or set up)" if not args.sync else (
      "--no_install (nothing is installed)" if not args.install else None)
  if skipped:
    for name in ("python", "jax_requirement", "constraints"):
      if getattr(args, name) != parser.get_default(name):
        parser.error(f"--{name}={getattr(args, name)!r} has no effect with {skipped}; leave it "
                     "out")
    if not args.sync and not args.install:
      parser.error("--no_install has no effect with --no_sync (nothing is copied or set up); "
                   "leave it out")
  if (args.sync and args.install and args.constraints and not args.constraints.startswith("/")
      and not os.path.isfile(os.path.join(REPO, args.constraints))):
    parser.error(f"--constraints={args.constraints!r}: no such file in {REPO}; allowed: a path "
                 "relative to this repository (it is copied to the workers), an absolute one "
                 "on the workers, or '' for none")
  if not args.dry_run and shutil.which("gcloud") is None:
    parser.error("gcloud not found on PATH: install the Google Cloud CLI, or pass --dry_run to "
                 "print the commands")
  return args, main_args


def main(argv: list[str]) -> int:
  args, main_args = parse_args(argv)
  # A folder of its own, removed at the end: a fixed /tmp path would be another launch's
  # tarball (or another user's file, not writable).
  folder = tempfile.mkdtemp(prefix="cem_jax_launch_")
  try:
    return _launch(args, main_args, os.path.join(folder, TARBALL))
  finally:
    shutil.rmtree(folder, ignore_errors=True)


def _launch(args: argparse.Namespace, main_args: list[str], tarball: str) -> int:
  cmds = commands(args, main_args, tarball)
  if args.dry_run:
    if args.sync:
      print(f"# pack {len(source_files())} files of {REPO} into {tarball}")
    for cmd in cmds:
      print(shlex.join(cmd))
    return 0
  if args.sync:
    print(f"packed {pack(tarball)} files into {tarball}", flush=True)
  for cmd in cmds:
    print("+ " + shlex.join(cmd), flush=True)
    code = subprocess.run(cmd).returncode
    if code:
      print(f"launch/tpu_pod.py: {cmd[4]} failed with exit status {code}", file=sys.stderr)
      return code
  return 0

if __name__ == "__main__":
  import exits  # beside this script, which python runs with its folder first on sys.path
  exits.run(main)
