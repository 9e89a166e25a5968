"""How many CPUs this process may use: the cores it may run on, capped by its cgroup's CPU quota.

A container limited to ``cpu: 4`` on a 64-core node sees 64 cores in ``sched_getaffinity`` (the
quota is a share of time, not a set of cores), so one decode worker per visible core would start
64 processes that the kernel throttles to 4 cores' worth of time, and each holds its own memory.
The quota is read from cgroup v2 (``cpu.max``: "QUOTA PERIOD" or "max PERIOD") or v1
(``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, -1 for none), at this process's cgroup and every
ancestor up to the mount (a parent's limit binds its children too); the tightest one wins,
rounded up (a 2.5-CPU quota runs 3 workers, each busy most of the time).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The CPUs this process may use: min(affinity, ceil(cgroup quota)), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(root, proc_cgroup)
    return max(1, min(cores, math.ceil(quota)) if quota is not None else cores)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota (in CPUs) over this process's cgroup and its ancestors; None if unlimited
    or unreadable (not Linux, no cgroup filesystem)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: one unified tree
            limits.extend(_walk(root, path, _v2_quota))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own tree
            for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
                if mount.is_dir():
                    limits.extend(_walk(mount, path, _v1_quota))
                    break
    return min(limits) if limits else None


def _walk(mount: Path, path: str, read) -> list[float]:
    """Quotas at ``mount/path`` and each parent up to ``mount`` (inside a container's cgroup
    namespace the path is "/", and the mount is the container's own cgroup)."""
    out = []
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    for depth in range(len(parts), -1, -1):
        quota = read(mount.joinpath(*parts[:depth]))
        if quota is not None:
            out.append(quota)
    return out


def _v2_quota(directory: Path) -> float | None:
    try:
        fields = (directory / "cpu.max").read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = (directory / "cpu.cfs_quota_us").read_text().strip()
        period = (directory / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
