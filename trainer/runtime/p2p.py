"""Point-to-point transfer of tensor lists between ranks (gloo on CPU, NCCL on GPU).

Every message is a list of tensors whose shapes the receiver does not know: a header (count,
then per tensor its dtype code, rank and shape, padded to a fixed length) precedes the data.
Sends are asynchronous (``isend``); the handles are kept until ``Outbox.wait()`` at the end of a
step, so a stage never blocks on a send and the 1F1B order of receives alone decides progress.
Each kind of message has its own tag, so their orders between two ranks are independent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TAGS = {"media": 1, "embed": 2, "embed_grad": 3, "act": 4, "act_grad": 5, "gen": 6, "gen_grad": 7, "tp": 8}
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8, torch.float64]
_HEADER = 512


class Outbox:
    """Pending asynchronous sends, and the tensors they read from. ``device``: where the headers
    are made (NCCL sends only GPU tensors; gloo CPU ones)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self._pending = []
        self.device = torch.device(device)

    def send(self, tensors: list[torch.Tensor], dst: int, kind: str) -> None:
        tag = TAGS[kind]
        header = [len(tensors)]
        for t in tensors:
            header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        if len(header) > _HEADER:
            raise ValueError(f"message of {len(tensors)} tensors does not fit a {_HEADER}-number header")
        head = torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.int64, device=self.device)
        self._pending.append((dist.isend(head, dst, tag=tag), head))
        for t in tensors:
            t = t.detach().to(self.device).contiguous()
            if t.numel():
                self._pending.append((dist.isend(t, dst, tag=tag), t))

    def wait(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def recv(src: int, kind: str, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    tag = TAGS[kind]
    head = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(head, src, tag=tag)
    values, out, i = head.tolist(), [], 1
    for _ in range(values[0]):
        dtype, ndim = _DTYPES[values[i]], values[i + 1]
        shape = values[i + 2:i + 2 + ndim]
        i += 2 + ndim
        t = torch.empty(shape, dtype=dtype, device=device)
        if t.numel():
            dist.recv(t, src, tag=tag)
        out.append(t)
    return out
