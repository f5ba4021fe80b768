"""cem_jax.cpus: the CPUs this process may use, against cgroup mounts written by hand."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

from cem_jax import cpus


def _cgroups(tmp_path, monkeypatch, own: str, tree: dict[str, str]) -> None:
  """A cgroup mount (a new folder under ``tmp_path``) holding ``tree`` (path under the mount ->
  text) and a /proc/self/cgroup naming ``own``, in place of the machine's."""
  folder = Path(tempfile.mkdtemp(dir=tmp_path))
  root = folder / "cgroup"
  root.mkdir()
  for name, text in tree.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)
  (folder / "proc_self_cgroup").write_text(own)
  monkeypatch.setattr(cpus, "CGROUP_ROOT", os.fspath(root))
  monkeypatch.setattr(cpus, "PROC_SELF_CGROUP", os.fspath(folder / "proc_self_cgroup"))


def test_usable_cpus_are_the_affinity_mask_capped_by_the_tightest_cgroup_quota(tmp_path,
                                                                              monkeypatch):
  # A pod host's 100+ CPUs used to get 2 prepare workers; a container's quota is not in the mask.
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
  cgroups = functools.partial(_cgroups, tmp_path, monkeypatch)
  cgroups("0::/\n", {})
  assert cpus.usable() == 3
  # A CPU quota (a container's --cpus) caps it, rounded up; "max" or -1 is no quota.
  for text, want in (("200000 100000\n", 2), ("150000 100000", 2), ("50000 100000", 1),
                     ("800000 100000", 3), ("max 100000", 3)):
    cgroups("0::/\n", {"cpu.max": text})
    assert cpus.usable() == want, text
  # The process's own cgroup and those above it count (a limit set below the mount's root, as
  # without a cgroup namespace); the tightest wins.
  nested = "kubepods/pod1/c1"
  for tree, want in (({"cpu.max": "max 100000", "kubepods/cpu.max": "max 100000",
                        "kubepods/pod1/cpu.max": "200000 100000",
                        f"{nested}/cpu.max": "max 100000"}, 2),
                      ({"kubepods/cpu.max": "100000 100000",
                        f"{nested}/cpu.max": "250000 100000"}, 1),
                      ({f"{nested}/cpu.max": "250000 100000", "cpu.max": "max 100000"}, 3)):
    cgroups(f"0::/{nested}\n", tree)
    assert cpus.usable() == want, tree
  # A cgroup the mount does not show (a container that sees only its own): the mount's root.
  cgroups("0::/host/slice/c1\n", {"cpu.max": "150000 100000"})
  assert cpus.usable() == 2
  # cgroup v1: the cpu controller's hierarchy, its own path and those above.
  v1 = "5:memory:/other\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/x\n"
  for quota, want in (("150000", 2), ("-1", 3)):
    cgroups(v1, {"cpu/docker/abc/cpu.cfs_quota_us": quota + "\n",
                 "cpu/docker/abc/cpu.cfs_period_us": "100000\n",
                 "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
                 "cpu/other/cpu.cfs_quota_us": "100000\n",
                 "cpu/other/cpu.cfs_period_us": "100000\n"})
    assert cpus.usable() == want, quota


def test_cgroup_v1_reads_the_cpu_controllers_line_not_cpusets(tmp_path, monkeypatch):
  # "cpuset" contains "cpu": its line (listed after cpu's here) names another cgroup, whose
  # folder has no quota; the quota of the cpu controller's own cgroup is the one that counts.
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
  _cgroups(tmp_path, monkeypatch, "4:cpu,cpuacct:/docker/abc\n3:cpuset:/elsewhere\n",
           {"cpu/docker/abc/cpu.cfs_quota_us": "150000\n",
            "cpu/docker/abc/cpu.cfs_period_us": "100000\n",
            "cpu/elsewhere/cpu.cfs_quota_us": "-1\n",
            "cpu/elsewhere/cpu.cfs_period_us": "100000\n"})
  assert cpus.usable() == 2
