"""The CPU and memory of a process tree, for bench/peers.py: every process that ever ran below the
harness, sampled from /proc, and the usage of the children it reaped (it is their subreaper)."""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")


def descendants() -> list[int]:
    """Every live process below this one."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    me, out = os.getpid(), []
    for pid in parent:
        p = pid
        while p in parent and p not in (0, 1):
            p = parent[p]
            if p == me:
                out.append(pid)
                break
    return out


def _proc_cpu(pid: int) -> tuple[tuple[int, int], float, float, int]:
    """((pid, start time), utime + stime in seconds, stime in seconds, minor page faults) of one
    live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return (pid, -1), 0.0, 0.0, 0
    return (pid, int(fields[19])), (int(fields[11]) + int(fields[12])) / HZ, int(fields[12]) / HZ, int(fields[7])


class TreeSampler:
    """CPU and memory of this process's descendants, sampled: the CPU last seen of every process that
    ever ran below us (so processes whose parent discards their usage, e.g. with SIGCHLD ignored
    as Ray's daemons do, still count; a process is missed after its last sample, <= one period)."""

    def __init__(self):
        self.seen: dict[tuple[int, int], float] = {}
        self.names: dict[tuple[int, int], str] = {}
        self.pss: dict[tuple[int, int], float] = {}
        self.system: dict[tuple[int, int], float] = {}
        """System CPU seconds of each process (of its CPU in ``seen``), as last sampled."""
        self.faults: dict[tuple[int, int], int] = {}
        """Minor page faults of each process, as last sampled."""
        self.peak_pss_mib = 0.0
        self.lock = threading.Lock()

    def sample(self, memory: bool = True) -> float:
        """Updates the figures; returns the CPU seconds seen so far."""
        with self.lock:
            pids = descendants()
            total = 0.0
            for pid in pids:
                key, cpu, system, faults = _proc_cpu(pid)
                self.seen[key] = max(cpu, self.seen.get(key, 0.0))
                self.system[key] = max(system, self.system.get(key, 0.0))
                self.faults[key] = max(faults, self.faults.get(key, 0))
                if key not in self.names:
                    self.names[key] = _role(pid)
                if memory:
                    pss = _pss_mib(pid)
                    self.pss[key] = max(pss, self.pss.get(key, 0.0))
                    total += pss
            if memory:
                self.peak_pss_mib = max(self.peak_pss_mib, total)
            return sum(self.seen.values())


def _role(pid: int) -> str:
    """What a process is, from its command line (for the per-process breakdown)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    for marker, role in (("forkserver", "fork server / decode worker"), ("resource_tracker", "resource tracker"),
                         ("spawn_main", "spawned child"), ("peers_systems.py", "main")):
        if marker in cmd:
            return role
    return cmd[:60]


def _pss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reap_orphans(tree: TreeSampler, timeout_s: float = 20.0) -> None:
    """Waits for the processes the run left behind (reparented here), killing them after timeout_s."""
    deadline = time.time() + timeout_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            tree.sample()
            if time.time() > deadline:
                for p in descendants():
                    os.kill(p, 9)
            time.sleep(0.1)
