"""Usable cores from affinity, cgroup cpuset and CPU quota (v1 and v2), on fixture trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from packrat.cores import usable_cores
from packrat.errors import ConfigError

AFF = tuple(range(64))  # a 64-core node


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _v2(root: Path, cgroup: str, files: dict[str, str]) -> Path:
    return _tree(root, {
        "proc/self/cgroup": f"0::{cgroup}\n",
        "proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
        **{f"sys/fs/cgroup/{k}": v for k, v in files.items()},
    })


def _v1(root: Path, cpu_path: str, cpuset_path: str, files: dict[str, str]) -> Path:
    # As on the development machine: hybrid, v1 controllers plus an unused unified mount.
    return _tree(root, {
        "proc/self/cgroup": f"4:memory:/x\n3:cpuset:{cpuset_path}\n2:cpuacct:{cpu_path}\n1:cpu:{cpu_path}\n0::/\n",
        "proc/self/mountinfo": (
            "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
            "33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct\n"
            "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
            "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
        ),
        **{f"sys/fs/cgroup/{k}": v for k, v in files.items()},
    })


def test_v2_pod_limited_to_4_cpus_on_a_64_core_node(tmp_path: Path) -> None:
    # Kubernetes with a cgroup namespace: the pod's cgroup is the root of the mount.
    root = _v2(tmp_path, "/", {"cpu.max": "400000 100000\n", "cpuset.cpus.effective": "0-63\n"})
    u = usable_cores(root=root, affinity=AFF)
    assert u.cores == (0, 1, 2, 3) and u.quota_cores == 4.0 and u.cgroup == "v2"
    assert "quota 4 cores -> 4" in u.reason


def test_v2_the_smallest_quota_on_the_path_counts_and_cpuset_intersects(tmp_path: Path) -> None:
    root = _v2(tmp_path, "/kubepods/pod1/ctr", {
        "kubepods/cpu.max": "max 100000\n",
        "kubepods/pod1/cpu.max": "250000 100000\n",  # 2.5 cores: 2 usable
        "kubepods/pod1/ctr/cpu.max": "max 100000\n",
        "kubepods/pod1/ctr/cpuset.cpus.effective": "8-11\n",
    })
    u = usable_cores(root=root, affinity=AFF)
    assert u.cpuset == (8, 9, 10, 11) and u.quota_cores == 2.5
    assert u.cores == (8, 9)


def test_v2_without_limits_keeps_the_affinity(tmp_path: Path) -> None:
    root = _v2(tmp_path, "/", {"cpu.max": "max 100000\n"})
    u = usable_cores(root=root, affinity=(0, 1))
    assert u.cores == (0, 1) and u.quota_cores is None and u.cpuset is None


def test_v1_quota_and_cpuset(tmp_path: Path) -> None:
    root = _v1(tmp_path, "/docker/abc", "/docker/abc", {
        "cpu/docker/abc/cpu.cfs_quota_us": "300000\n",
        "cpu/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpuset/docker/abc/cpuset.effective_cpus": "2-5,7\n",
    })
    u = usable_cores(root=root, affinity=AFF)
    assert u.cgroup == "v1" and u.cpuset == (2, 3, 4, 5, 7) and u.quota_cores == 3.0
    assert u.cores == (2, 3, 4)


def test_v1_no_quota_and_a_quota_below_one_core(tmp_path: Path) -> None:
    root = _v1(tmp_path / "a", "/", "/", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
                                          "cpuset/cpuset.cpus": "0-1\n"})
    assert usable_cores(root=root, affinity=(0, 1)).cores == (0, 1)
    root = _v1(tmp_path / "b", "/", "/", {"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert usable_cores(root=root, affinity=(0, 1)).cores == (0,)  # half a core: still one to plan on


def test_override_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _v2(tmp_path, "/", {"cpu.max": "100000 100000\n"})
    assert usable_cores("4-5", root=root, affinity=AFF).cores == (4, 5)
    monkeypatch.setenv("PACKRAT_CORES", "1,3")
    u = usable_cores(root=root, affinity=AFF)
    assert u.cores == (1, 3) and "$PACKRAT_CORES" in u.reason
    with pytest.raises(ConfigError):
        usable_cores("zero-two", root=root, affinity=AFF)


def test_this_machine() -> None:
    u = usable_cores()
    assert set(u.cores) <= set(os.sched_getaffinity(0)) and u.cores and u.reason
