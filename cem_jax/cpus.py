"""The CPUs this process may use (``usable``): what a pool of workers should be sized to.

``os.cpu_count()`` counts the host's CPUs, which a process pinned to a few of them or a
container under a CPU quota (``docker --cpus``, a Kubernetes limit) cannot all use: the
one count of usable CPUs is here, for every part of the package that sizes work by them.
"""

from __future__ import annotations

import os
from pathlib import Path

# Where Linux states a CPU quota (a container's --cpus, a Kubernetes limit), which the
# affinity mask does not show: under the cgroup mount, in the process's own cgroup (named in
# /proc/self/cgroup) and each of its ancestors, cgroup v2's cpu.max ("QUOTA PERIOD" or
# "max PERIOD") or v1's cfs pair under the cpu controller.
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"


def usable() -> int:
  """The CPUs this process may use: its affinity mask where the OS has one (else
  ``os.cpu_count()``), capped by the tightest cgroup CPU quota of its cgroup and the cgroups
  above it, rounded up (a container limited to 4 of a host's 128 CPUs gets 4)."""
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:  # macOS and Windows have no affinity mask
    cpus = os.cpu_count() or 1
  quota = _cgroup_cpu_quota()
  return max(1, min(cpus, quota)) if quota is not None else cpus


def _own_cgroups() -> tuple[str, str]:
  """``(v2 path, v1 cpu path)`` of this process's cgroups as /proc/self/cgroup names them
  (``/`` where it names none: the mount's root, as inside a cgroup namespace)."""
  v2 = v1 = "/"
  try:
    lines = Path(PROC_SELF_CGROUP).read_text().splitlines()
  except OSError:
    return v2, v1
  for line in lines:
    parts = line.split(":", 2)
    if len(parts) != 3:
      continue
    if parts[0] == "0" and parts[1] == "":
      v2 = parts[2]
    elif "cpu" in parts[1].split(","):
      v1 = parts[2]
  return v2, v1


def _up_to_root(root: Path, cgroup: str) -> list[Path]:
  """``root/cgroup`` and each folder above it up to ``root``; those that do not exist (a
  mount showing only the container's own cgroup) are left out."""
  folder = root / cgroup.strip("/")
  chain = [folder, *folder.parents]
  return [f for f in chain[:chain.index(root) + 1] if f.is_dir()]


def _quota_cpus(quota: str, period: str) -> int | None:
  """A quota in whole CPUs (rounded up), or None for no limit ("max", -1) or unreadable text."""
  try:
    quota_us, period_us = int(quota), int(period)
  except ValueError:
    return None
  return -(-quota_us // period_us) if quota_us > 0 and period_us > 0 else None


def _cgroup_cpu_quota() -> int | None:
  """The tightest CPU quota on this process's cgroup and its ancestors, in whole CPUs (rounded
  up), or None: no limit, or none stated. A nested cgroup's quota counts too: without a cgroup
  namespace the container's limit sits below the mount's root."""
  root, (v2, v1) = Path(CGROUP_ROOT), _own_cgroups()
  quotas = []
  for folder in _up_to_root(root, v2):
    try:
      fields = (folder / "cpu.max").read_text().split()
    except OSError:
      continue
    quotas.append(_quota_cpus(*fields[:2]) if len(fields) >= 2 else None)
  if not quotas:  # no cpu.max anywhere: a cgroup v1 machine
    for folder in _up_to_root(root / "cpu", v1):
      try:
        quotas.append(_quota_cpus((folder / "cpu.cfs_quota_us").read_text().strip(),
                                  (folder / "cpu.cfs_period_us").read_text().strip()))
      except OSError:
        pass
  found = [q for q in quotas if q is not None]
  return min(found) if found else None
