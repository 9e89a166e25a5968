"""A TCP relay that can make its link slow and lossy, for fault benches where the kernel has no
netem (tc's delay and loss qdisc): ``python -m disttrain_tools.impair --listen HOST:PORT --to
HOST:PORT [--delay-ms 200] [--loss 0.05]``. It relays every connection unchanged until it gets
SIGUSR1, then impairs both directions until SIGUSR2:

- **delay**: every chunk is forwarded ``delay_ms`` after it arrived (order kept);
- **loss**: a chunk (what one read returns, up to 64 KiB: not a packet) is "lost" with
  probability ``loss`` and forwarded only after a retransmission timeout (200 ms doubling, up to
  3 tries), holding back the chunks behind it: what TCP makes of a lost segment, as the
  application on either end sees it, at a coarser grain than packet loss.

It prints ``ready`` once listening."""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import time

CHUNK = 64 << 10
RTO_S = 0.2


class Impairment:
    def __init__(self, delay_ms: float, loss: float, seed: int):
        self.on = False
        self.delay_s = delay_ms / 1000
        self.loss = loss
        self.rng = random.Random(seed)

    def hold_s(self) -> float:
        """How long a chunk arriving now waits before it is forwarded."""
        if not self.on:
            return 0.0
        hold, rto = self.delay_s, RTO_S
        for _ in range(3):
            if self.rng.random() >= self.loss:
                break
            hold += rto
            rto *= 2
        return hold


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, impairment: Impairment) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def forward() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.ensure_future(forward())
    last_due = 0.0
    try:
        while data := await reader.read(CHUNK):
            last_due = max(last_due, time.monotonic() + impairment.hold_s())  # in order, as TCP delivers
            await queue.put((last_due, data))
    except (ConnectionError, OSError):
        pass
    await queue.put((0.0, None))
    try:
        await sender
    except (ConnectionError, OSError):
        pass


async def _serve(listen: tuple[str, int], target: tuple[str, int], impairment: Impairment) -> None:
    async def handle(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.wait_for(asyncio.open_connection(*target), 10)
        except (TimeoutError, OSError):
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, server_writer, impairment),
                             _pipe(server_reader, client_writer, impairment))

    server = await asyncio.start_server(handle, *listen)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(impairment, "on", True))
    loop.add_signal_handler(signal.SIGUSR2, lambda: setattr(impairment, "on", False))
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", type=_address, required=True)
    parser.add_argument("--to", type=_address, required=True)
    parser.add_argument("--delay-ms", type=float, default=200.0)
    parser.add_argument("--loss", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args.listen, args.to, Impairment(args.delay_ms, args.loss, args.seed)))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
