"""Point-to-point transfer of messages between ranks, matched the way NCCL matches them.

A message is a list of tensors plus a few host integers (``meta``: sequence boundaries, seeds,
counts), whose shapes the receiver does not know. A header (the tensors' dtypes and shapes, then
the integers) travels on a CPU (gloo) group, the tensors on the data group (NCCL on GPUs), so the
receiver learns shapes and metadata without reading a device tensor back: no host sync per message.

NCCL ignores tags: two messages between the same pair of ranks on one communicator match in the
order they were posted. So every message kind (``KINDS``) has its own channel, a pair of process
groups spanning the world (one communicator per kind), and within a kind sender and receiver post
in the same order (1F1B forwards and backwards both run in microbatch order). Tags are never used,
on gloo either: with them gloo would match out of order and hide an ordering bug that NCCL turns
into a wrong tensor or a hang. ``Channels.shared()`` puts every kind on one channel (the old
layout), which tests use to show that this ordering matters.

Sends are asynchronous (``isend``); the Outbox keeps a send's tensors only until it has completed
(checked at every later send) and waits for the rest at the end of a step, so a stage never blocks
on a send and the 1F1B order of receives alone decides progress. A send and a receive of different
kinds never share a communicator, so neither can queue behind the other on one NCCL stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

KINDS = ("media", "embed", "embed_grad", "act", "act_grad", "gen", "gen_grad", "tp")
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8, torch.float64,
           torch.bool]
MAX_HEADER = 1 << 20
"""Numbers in one header at most (a peer's corrupt length must not allocate unbounded memory)."""


@dataclass
class Channel:
    data: object = None
    """Process group the tensors travel on (None: the default group)."""
    header: object = None
    """CPU (gloo) process group the headers travel on (None: the default group, gloo on CPU)."""


@dataclass
class Channels:
    """One Channel per message kind."""

    by_kind: dict[str, Channel] = field(default_factory=dict)

    def __getitem__(self, kind: str) -> Channel:
        return self.by_kind[kind]

    @classmethod
    def create(cls, device: torch.device) -> Channels:
        """A channel per kind: new groups over the whole world (every rank must call this, in the
        same order). On a GPU the data groups are the default backend's (NCCL) and the headers get
        gloo groups; on the CPU one gloo group per kind carries both."""
        world = list(range(dist.get_world_size()))
        by_kind = {}
        for kind in KINDS:
            data = dist.new_group(world)
            header = dist.new_group(world, backend="gloo") if device.type != "cpu" else data
            by_kind[kind] = Channel(data, header)
        return cls(by_kind)

    @classmethod
    def default(cls) -> Channels:
        """Every kind on the default group, no group created (a worker built outside a CPU run)."""
        return cls({kind: Channel() for kind in KINDS})

    @classmethod
    def shared(cls, device: torch.device) -> Channels:
        """Every kind on one channel (the default group, plus one gloo group for headers on a GPU):
        messages of different kinds between two ranks then match in posting order."""
        header = dist.new_group(list(range(dist.get_world_size())), backend="gloo") if device.type != "cpu" else None
        channel = Channel(None, header)
        return cls({kind: channel for kind in KINDS})


def connect(channels: Channels, pairs: list[tuple[str, int, int]], device: torch.device | str) -> None:
    """Opens every (kind, sender, receiver) connection a run uses with one tiny message each, every
    rank walking the same sorted list with blocking sends and receives (deadlock-free: the first
    pending pair always has both ends waiting on it). NCCL connects a pair lazily, and a first send
    blocks the host until the receiver posts its receive; inside a step that turns any rank that
    is busy elsewhere (in a collective, say) into a wait for it. Every rank must call this with the
    same pairs."""
    rank = dist.get_rank()
    token = torch.zeros(1, device=device)
    for kind, src, dst in sorted(set(pairs)):
        if rank == src:
            dist.send(token, dst, group=channels[kind].data)
        elif rank == dst:
            dist.recv(token, src, group=channels[kind].data)


def _header(tensors: list[torch.Tensor], meta: list[int]) -> np.ndarray:
    values = [len(tensors)]
    for t in tensors:
        values += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    values += [len(meta), *meta]
    return np.asarray(values, dtype=np.int64)


class Outbox:
    """Pending asynchronous sends, and the tensors they read from (until they complete)."""

    def __init__(self, channels: Channels, device: torch.device | str = "cpu"):
        self._pending: list[tuple[object, object]] = []
        self.sent: set[tuple[str, int]] = set()
        """(kind, receiver) of every message sent (the connections p2p.connect must have opened)."""
        self.channels = channels
        self.device = torch.device(device)

    def send(self, tensors: list[torch.Tensor], dst: int, kind: str, meta: list[int] = ()) -> None:
        """Posts ``tensors`` (moved to this outbox's device) and ``meta`` to ``dst`` on ``kind``'s channel."""
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        channel = self.channels[kind]
        self.sent.add((kind, dst))
        head = torch.from_numpy(_header(tensors, [int(v) for v in meta]))
        length = torch.tensor([head.numel()], dtype=torch.int64)
        self._pending.append((dist.isend(length, dst, group=channel.header), length))
        self._pending.append((dist.isend(head, dst, group=channel.header), head))
        for t in tensors:
            t = t.detach().to(self.device, non_blocking=True).contiguous()
            if t.numel():
                self._pending.append((dist.isend(t, dst, group=channel.data), t))

    def wait(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    @property
    def num_pending(self) -> int:
        return len(self._pending)


def recv(channels: Channels, src: int, kind: str, device: torch.device | str = "cpu"
         ) -> tuple[list[torch.Tensor], list[int]]:
    """The next message from ``src`` on ``kind``'s channel: (tensors on ``device``, meta)."""
    channel = channels[kind]
    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, src, group=channel.header)
    n = int(length.numpy()[0])
    if not 1 <= n <= MAX_HEADER:
        raise RuntimeError(f"{kind} message from rank {src}: a header of {n} numbers")
    head = torch.empty(n, dtype=torch.int64)
    dist.recv(head, src, group=channel.header)
    values = head.numpy().tolist()
    out, i = [], 1
    for _ in range(values[0]):
        dtype, ndim = _DTYPES[values[i]], values[i + 1]
        shape = values[i + 2:i + 2 + ndim]
        i += 2 + ndim
        t = torch.empty(shape, dtype=dtype, device=device)
        if t.numel():
            dist.recv(t, src, group=channel.data)
        out.append(t)
    meta = values[i + 1:i + 1 + values[i]]
    return out, meta
