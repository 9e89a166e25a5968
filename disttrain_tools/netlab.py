"""A network of namespaces on this machine, for fault benches: a router namespace, one namespace
per node joined to the router by a veth pair, and this process's own namespace joined too (so the
bench reaches every node). Faults are the router's: ``cut`` adds policy rules that blackhole what
one node sends another (packets vanish silently, as in a real partition: no reset, no ICMP),
``heal`` removes them; ``throttle`` limits a node's link with a token bucket.

Needs root (CAP_NET_ADMIN) and ``ip`` (iproute2); ``unavailable()`` says why not, for a skip.
Everything it makes is named with its tag and removed by ``close()`` (or ``with``), and
the next lab removes what a killed run left behind (``sweep_stale``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import uuid

SUBNET = "10.213"
"""Node i has {SUBNET}.{i}.2, its router side {SUBNET}.{i}.1; this process is node 0."""
LOCK = "/tmp/disttrain-netlab.lock"
"""One lab at a time on a machine (they share SUBNET): a second one waits for the first to close."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"dtprobe{uuid.uuid4().hex[:6]}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"ip netns add failed: {done.stderr.strip()}"
    try:
        link = _ip("-n", probe, "link", "add", "dtpa", "type", "veth", "peer", "name", "dtpb", check=False)
        if link.returncode != 0:
            return f"veth pairs cannot be made: {link.stderr.strip()}"
        rule = _ip("-n", probe, "rule", "add", "from", "10.0.0.1", "to", "10.0.0.2", "blackhole", check=False)
        if rule.returncode != 0:
            return f"policy routing rules cannot be made: {rule.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def sweep_stale() -> None:
    """Removes what labs of runs that were killed left: their processes, namespaces and links
    (call it holding LOCK: then no lab is in use)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if re.fullmatch(r"dt[0-9a-f]{5}-\d+|dt[0-9a-f]{5}-r", name):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        match = re.search(r"\d+: (dt[0-9a-f]{5}0h)[@:]", line)
        if match:
            _ip("link", "del", match.group(1), check=False)


class NetLab:
    def __init__(self, tag: str | None = None):
        self.tag = tag or f"dt{uuid.uuid4().hex[:5]}"  # sweep_stale knows this shape
        if len(self.tag) > 9:
            raise ValueError(f"tag {self.tag!r} is longer than 9 characters (interface names hold 15)")
        self.router = f"{self.tag}-r"
        self.nodes: dict[str, int] = {}
        self._rules: set[tuple[str, str]] = set()
        self._open = False

    def __enter__(self) -> NetLab:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> NetLab:
        fd = os.open(LOCK, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        self._lock = os.fdopen(fd, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        sweep_stale()  # under the lock, any lab left is one a killed run left behind
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.router)
        _ip("-n", self.router, "link", "set", "lo", "up")
        subprocess.run(["ip", "netns", "exec", self.router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
                       check=True, capture_output=True, timeout=30)
        # this process's namespace as node 0: it reaches every node through the router
        host, peer = f"{self.tag}0h", f"{self.tag}0r"
        _ip("link", "add", host, "type", "veth", "peer", "name", peer, "netns", self.router)
        _ip("addr", "add", f"{SUBNET}.0.2/24", "dev", host)
        _ip("link", "set", host, "up")
        _ip("-n", self.router, "addr", "add", f"{SUBNET}.0.1/24", "dev", peer)
        _ip("-n", self.router, "link", "set", peer, "up")
        _ip("route", "replace", f"{SUBNET}.0.0/16", "via", f"{SUBNET}.0.1", "dev", host)
        self.nodes["bench"] = 0

    def add(self, name: str) -> str:
        """A node in its own namespace; returns its address."""
        index = len(self.nodes)
        if index > 250:
            raise ValueError("at most 250 nodes")
        ns, router_end, node_end = self.namespace(name, index), f"{self.tag}{index}r", f"{self.tag}{index}n"
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.router, "link", "add", router_end, "type", "veth", "peer", "name", node_end, "netns", ns)
        _ip("-n", self.router, "addr", "add", f"{SUBNET}.{index}.1/24", "dev", router_end)
        _ip("-n", self.router, "link", "set", router_end, "up")
        _ip("-n", ns, "addr", "add", f"{SUBNET}.{index}.2/24", "dev", node_end)
        _ip("-n", ns, "link", "set", node_end, "up")
        _ip("-n", ns, "route", "add", "default", "via", f"{SUBNET}.{index}.1")
        self.nodes[name] = index
        return self.address(name)

    def namespace(self, name: str, index: int | None = None) -> str:
        return f"{self.tag}-{self.nodes[name] if index is None else index}"

    def address(self, name: str) -> str:
        return f"{SUBNET}.{self.nodes[name]}.2"

    def exec_prefix(self, name: str) -> list[str]:
        """Prepend to a command to run it in ``name``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(name)]

    # --- faults -------------------------------------------------------------------------------
    def cut(self, a: str, b: str, *, both: bool = True) -> None:
        """What ``a`` sends ``b`` (and, with ``both``, the reverse) is dropped silently."""
        for src, dst in ((a, b), (b, a)) if both else ((a, b),):
            if (src, dst) not in self._rules:
                _ip("-n", self.router, "rule", "add", "from", self.address(src), "to", self.address(dst),
                    "blackhole", "priority", "100")
                self._rules.add((src, dst))

    def isolate(self, a: str) -> None:
        """``a`` can reach nobody and nobody it (this process included)."""
        for other in self.nodes:
            if other != a:
                self.cut(a, other)

    def heal(self, a: str | None = None, b: str | None = None) -> None:
        """Removes the cuts between ``a`` and ``b`` (every cut of ``a`` without ``b``; all without either)."""
        for src, dst in sorted(self._rules):
            if a is None or (b is None and a in (src, dst)) or {src, dst} == {a, b}:
                _ip("-n", self.router, "rule", "del", "from", self.address(src), "to", self.address(dst),
                    "blackhole", "priority", "100", check=False)
                self._rules.discard((src, dst))

    def throttle(self, name: str, rate: str = "8mbit", *, latency_ms: int = 200) -> None:
        """Limits what reaches ``name`` and what it sends to ``rate`` (a token bucket; a packet that
        would wait longer than ``latency_ms`` in the queue is dropped)."""
        index = self.nodes[name]
        for ns, dev in ((self.router, f"{self.tag}{index}r"), (self.namespace(name), f"{self.tag}{index}n")):
            _ip("-n", ns, "link", "set", dev, "up")
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                            "burst", "32kbit", "latency", f"{latency_ms}ms"], check=True, capture_output=True,
                           timeout=30)

    def unthrottle(self, name: str) -> None:
        index = self.nodes[name]
        for ns, dev in ((self.router, f"{self.tag}{index}r"), (self.namespace(name), f"{self.tag}{index}n")):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)

    def close(self) -> None:
        if not self._open:
            return
        for name, index in list(self.nodes.items()):
            if index:
                _ip("netns", "del", self.namespace(name), check=False)
        _ip("link", "del", f"{self.tag}0h", check=False)
        _ip("netns", "del", self.router, check=False)
        self.nodes.clear()
        self._rules.clear()
        self._open = False
        self._lock.close()  # and with it the flock
