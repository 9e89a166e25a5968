"""Running a job's plugin hooks on one sample, in a worker process, under a time limit and a
memory budget (the worker's supervisor, host.py or the decode pool, is the backstop).

A hook that raises, runs past ``time_s`` or grows the worker past ``memory_bytes`` fails its
sample with a PluginFailed naming the plugin (in a decode worker, a media hook is held to
``memory_bytes`` while it runs: the worker's data limit, RLIMIT_DATA, is set that far above what it
maps, so an allocation past it fails inside the hook instead of growing the worker); a sample
hook's Skip leaves the sample out as "filtered". What a sample hook returns is checked: it may
change or add text and JSON members and drop media members, but never change or add media (they
were priced from their headers and are re-read from the shard when decoded), nor the sample's key
or shard.
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from disttrain_api.config import PluginConfig
from disttrain_api.plugins import MediaContext, Plugin, SampleContext, Skip, rng_seed
from preprocess_service.adapters.plugins.registry import instantiate

MAX_MEMBER_BYTES = 16 << 20
"""A text or JSON member a sample hook returns may be at most this big."""
MAX_MEMBERS = 256
"""Members a sample hook may return."""
TEXT_EXTENSIONS = ("txt", "json")


class PluginFailed(Exception):
    """A hook raised, hung, leaked or returned something it may not; the sample fails with this.
    Its message starts with PLUGIN_FAILED ("plugin 'name' ..."), which is how a decode error
    reported as text is known as a plugin's (is_plugin_failure)."""


PLUGIN_FAILED = "plugin "


def is_plugin_failure(reason: str) -> bool:
    """A decode error's reason came from a PluginFailed (other decode errors start with the
    exception's type, or with the pool's WORKER_DIED)."""
    return reason.startswith(PLUGIN_FAILED)


class PluginTimeout(BaseException):
    """Raised in a hook by the alarm (a BaseException, so a hook's ``except Exception`` cannot eat it)."""


@dataclass(frozen=True, slots=True)
class HookLimits:
    """What one hook call may take."""

    time_s: float = 10.0
    """Wall-clock seconds per hook call."""
    memory_bytes: int = 1 << 30
    """Growth of the worker's resident memory one hook call may cause."""


DEFAULT_LIMITS = HookLimits()


@dataclass(frozen=True, slots=True)
class HookSpec:
    """What a worker needs to run a job's hooks on one microbatch or sample: picklable and small."""

    plugins: tuple[PluginConfig, ...]
    seed: int
    epoch: int
    limits: HookLimits = field(default_factory=HookLimits)


@dataclass(slots=True)
class HookCost:
    """What one plugin's hook of one kind has spent so far: CPU seconds over how many calls (a
    sample hook is called once per sample, a media hook once per decoded item)."""

    cpu_s: float = 0.0
    calls: int = 0


HookCosts = dict[tuple[str, str], HookCost]
"""(plugin name, "sample" or "media") -> its HookCost."""


def add_costs(into: HookCosts, more: HookCosts) -> HookCosts:
    """``more`` added into ``into`` (returned)."""
    for key, cost in more.items():
        total = into.setdefault(key, HookCost())
        total.cpu_s += cost.cpu_s
        total.calls += cost.calls
    return into


def _cpu_clock() -> Callable[[], float]:
    """The process's CPU clock in a worker's main thread (a hook's helper threads count too), the
    thread's elsewhere (InlineDecoder's threads, the service's own)."""
    return time.process_time if threading.current_thread() is threading.main_thread() else time.thread_time


_STATM: tuple[int, int] | None = None
"""(pid, descriptor of /proc/self/statm) kept open: read twice per hook call (a fork opens its own)."""
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    global _STATM
    try:
        if _STATM is None or _STATM[0] != os.getpid():
            _STATM = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        return int(os.pread(_STATM[1], 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _data_bytes() -> int:
    """The process's private writable mappings (VmData: what RLIMIT_DATA counts), or 0."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmData:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


class _DataLimit:
    """RLIMIT_DATA set ``nbytes`` above what the process maps now, for the duration of a hook call;
    the previous limit comes back after. Only for a process whose one working thread runs the hook
    (a decode worker): the limit is the whole process's."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.previous: tuple[int, int] | None = None

    def __enter__(self) -> _DataLimit:
        mapped = _data_bytes()
        if mapped:
            soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
            limit = mapped + self.nbytes
            if hard == resource.RLIM_INFINITY or limit <= hard:
                if soft == resource.RLIM_INFINITY or limit < soft:
                    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
                    self.previous = (soft, hard)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            resource.setrlimit(resource.RLIMIT_DATA, self.previous)


def _alarm(signum, frame):
    raise PluginTimeout()


def call_bounded(name: str, what: str, fn: Callable, limits: HookLimits, *, hold_memory: bool = False,
                 costs: HookCosts | None = None, hook: str = ""):
    """``fn()`` under the time limit and the memory budget; anything it raises but Skip becomes
    PluginFailed naming ``name``. The time limit is an alarm, so it holds in a process's main
    thread (the workers'); elsewhere (InlineDecoder's threads, for tests) only the supervisor's.
    ``hold_memory`` (a decode worker): the budget holds while ``fn`` runs (_DataLimit), not only
    when it returns. The CPU the call took, whatever its end, is added to ``costs[(name, hook)]``."""
    before = _rss_bytes()
    clock = _cpu_clock()
    cpu_before = clock()
    alarm = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, _alarm) if alarm else None
    if alarm:
        signal.setitimer(signal.ITIMER_REAL, limits.time_s)
    started = time.monotonic()
    held = hold_memory and alarm
    try:
        if held:
            with _DataLimit(limits.memory_bytes):
                result = fn()
        else:
            result = fn()
    except PluginTimeout:
        raise PluginFailed(f"plugin {name!r} {what} ran past its {limits.time_s:g} s limit") from None
    except Skip:
        raise
    except MemoryError:
        if held:
            raise PluginFailed(f"plugin {name!r} {what} tried to grow the worker past its memory budget of "
                               f"{limits.memory_bytes >> 20} MiB; stopped") from None
        raise PluginFailed(f"plugin {name!r} {what} ran out of memory") from None
    except Exception as exc:
        raise PluginFailed(f"plugin {name!r} {what} failed: {type(exc).__name__}: {str(exc)[:300]}") from None
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        if costs is not None:
            cost = costs.setdefault((name, hook), HookCost())
            cost.cpu_s += clock() - cpu_before
            cost.calls += 1
    grown = _rss_bytes() - before
    if grown > limits.memory_bytes:
        raise PluginFailed(f"plugin {name!r} {what} grew the worker by {grown >> 20} MiB, over its budget of "
                           f"{limits.memory_bytes >> 20} MiB (took {time.monotonic() - started:.2f} s)")
    return result


def _loaded(spec: HookSpec, has: Callable[[type[Plugin]], bool]) -> list[tuple[str, Plugin]]:
    return [(c.name, p) for c in spec.plugins if has(type(p := instantiate(c)))]


def is_media(member: str) -> bool:
    return member.rsplit(".", 1)[-1] not in TEXT_EXTENSIONS


def sample_changes(spec: HookSpec, sample: dict, costs: HookCosts | None = None) -> tuple[dict, list[str]]:
    """What the job's sample hooks do to ``sample``: (members changed or added, members removed),
    so a worker sends back only those. Raises Skip or PluginFailed as run_sample_hooks."""
    after = run_sample_hooks(spec, sample, costs)
    return ({k: v for k, v in after.items() if sample.get(k) is not v and not k.startswith("__")},
            [k for k in sample if k not in after])


def wanted_members(spec: HookSpec) -> frozenset[str] | None:
    """The member extensions the job's sample hooks read (Plugin.sample_members), or None for all."""
    wanted: set[str] = set()
    for _, plugin in _loaded(spec, lambda cls: cls.has_sample_hook()):
        if plugin.sample_members is None:
            return None
        wanted.update(plugin.sample_members)
    return frozenset(wanted)


def run_sample_hooks(spec: HookSpec, sample: dict, costs: HookCosts | None = None) -> dict:
    """``sample`` (``__key__``, ``__url__``, member -> bytes) after the job's sample hooks, in
    order. Raises Skip (a hook left it out) or PluginFailed. Each hook's CPU goes to ``costs``."""
    key, url = sample["__key__"], sample.get("__url__", "")
    meta = {k: v for k, v in sample.items() if not isinstance(k, str) or k.startswith("__")}
    members = {k: v for k, v in sample.items() if k not in meta}
    for name, plugin in _loaded(spec, lambda cls: cls.has_sample_hook()):
        ctx = SampleContext(key=key, url=url, seed=spec.seed, epoch=spec.epoch,
                            rng=np.random.default_rng(rng_seed(spec.seed, key, spec.epoch, name)))
        given = dict(members)
        out = call_bounded(name, "sample hook", partial(plugin.sample, given, ctx), spec.limits, costs=costs,
                           hook="sample")
        if out is not None:
            members = _checked(name, members, out)
    return {**members, **meta}


def _checked(name: str, before: dict, after) -> dict:
    """A sample hook's output, refused (PluginFailed) where it does what it may not."""
    if not isinstance(after, dict) or len(after) > MAX_MEMBERS:
        raise PluginFailed(f"plugin {name!r} sample hook returned {type(after).__name__}, not a dict of at most "
                           f"{MAX_MEMBERS} members")
    out = {}
    for member, value in after.items():
        if not isinstance(member, str) or member.startswith("__") or not isinstance(value, (bytes, bytearray)):
            raise PluginFailed(f"plugin {name!r} sample hook returned member {member!r:.60} -> "
                               f"{type(value).__name__}; members are names (not __key__ or __url__) -> bytes")
        if is_media(member):
            if member not in before or bytes(value) != before[member]:
                raise PluginFailed(f"plugin {name!r} sample hook changed or added media member {member!r:.60}; "
                                   "media may only be dropped there (use a media hook to change pixels)")
        elif len(value) > MAX_MEMBER_BYTES:
            raise PluginFailed(f"plugin {name!r} sample hook returned {len(value)} bytes for {member!r}, more "
                               f"than {MAX_MEMBER_BYTES}")
        out[member] = value if type(value) is bytes else bytes(value)
    return out


class MediaHooks:
    """A job's media hooks for one decode task (built in the worker from a HookSpec)."""

    def __init__(self, spec: HookSpec, *, hold_memory: bool = False):
        self.spec = spec
        self.plugins = _loaded(spec, lambda cls: cls.has_media_hook())
        self.hold_memory = hold_memory
        """In a decode worker: each hook is held to its memory budget while it runs (call_bounded)."""
        self.costs: HookCosts = {}
        """What each hook has spent since the last take_costs()."""
        self._lock = threading.Lock()  # InlineDecoder runs a task's documents on several threads

    def take_costs(self) -> HookCosts:
        """The hooks' costs since the last call (and from now on, zero again)."""
        with self._lock:
            costs, self.costs = self.costs, {}
        return costs

    def apply(self, kind: str, array: np.ndarray, key: str, member: str) -> np.ndarray:
        """``array`` after every hook for ``kind``: the same shape and dtype (PluginFailed otherwise)."""
        costs: HookCosts = {}
        try:
            return self._apply(kind, array, key, member, costs)
        finally:
            with self._lock:
                add_costs(self.costs, costs)

    def _apply(self, kind: str, array: np.ndarray, key: str, member: str, costs: HookCosts) -> np.ndarray:
        spec = self.spec
        for name, plugin in self.plugins:
            if kind not in plugin.media_kinds:
                continue
            ctx = MediaContext(key=key, member=member, seed=spec.seed, epoch=spec.epoch,
                               rng=np.random.default_rng(rng_seed(spec.seed, key, spec.epoch, name, member)))
            out = call_bounded(name, f"media hook on {member!r}", partial(plugin.media, kind, array, ctx),
                               spec.limits, hold_memory=self.hold_memory, costs=costs, hook="media")
            if out is not None and out is not array:
                if not isinstance(out, np.ndarray) or out.shape != array.shape or out.dtype != array.dtype:
                    raise PluginFailed(f"plugin {name!r} media hook returned "
                                       f"{getattr(out, 'shape', type(out).__name__)} {getattr(out, 'dtype', '')} "
                                       f"for a {array.shape} {array.dtype} {kind}")
                array[...] = out
        return array
