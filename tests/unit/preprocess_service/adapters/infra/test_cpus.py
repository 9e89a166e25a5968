"""The decode pool's size follows the cgroup CPU quota (v2 cpu.max, v1 cfs), not the node's cores."""

import os

from preprocess_service.adapters.infra.cpus import available_cpus, cgroup_cpu_quota


def _v2(tmp_path, path: str, limits: dict[str, str]):
    for rel, text in limits.items():
        d = tmp_path / "cg" / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(text)
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::{path}\n")
    return tmp_path / "cg", proc


def test_v2_quota_is_read_and_the_tightest_ancestor_wins(tmp_path):
    root, proc = _v2(tmp_path, "/kubepods/pod1/ctr", {
        "": "max 100000", "kubepods": "max 100000", "kubepods/pod1": "300000 100000",
        "kubepods/pod1/ctr": "max 100000"})
    assert cgroup_cpu_quota(root, proc) == 3.0
    assert available_cpus(root, proc) == min(3, len(os.sched_getaffinity(0)))


def test_fractional_quota_rounds_up_and_never_below_one(tmp_path):
    root, proc = _v2(tmp_path, "/", {"": "50000 100000"})
    assert cgroup_cpu_quota(root, proc) == 0.5
    assert available_cpus(root, proc) == 1


def test_no_limit_or_unreadable_means_the_cores(tmp_path):
    root, proc = _v2(tmp_path, "/", {"": "max 100000"})
    assert cgroup_cpu_quota(root, proc) is None
    assert available_cpus(root, proc) == len(os.sched_getaffinity(0))
    assert cgroup_cpu_quota(tmp_path / "absent", tmp_path / "absent-proc") is None
    garbage_root, garbage = _v2(tmp_path / "g", "/", {"": "lots 0"})
    assert cgroup_cpu_quota(garbage_root, garbage) is None


def test_v1_cfs_quota(tmp_path):
    d = tmp_path / "cg" / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("150000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    top = tmp_path / "cg" / "cpu,cpuacct"
    (top / "cpu.cfs_quota_us").write_text("-1\n")
    (top / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_quota(tmp_path / "cg", proc) == 1.5
    assert available_cpus(tmp_path / "cg", proc) == min(2, len(os.sched_getaffinity(0)))
