"""A throwaway redis-server (the Debian package's binary) on a free port, for tests, benchmarks and
the chaos script: started in the foreground as a child process, AOF on by default (as deployed),
stoppable and restartable on the same port and data directory."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalRedis:
    def __init__(self, data_dir: Path, *, port: int | None = None, appendonly: bool = True):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (./dev.sh setup installs the Debian package)")
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", str(self.data_dir), "--logfile", str(self.data_dir / "redis.log")]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                client.close()
                return self
            except (redis.ConnectionError, redis.BusyLoadingError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = (self.data_dir / "redis.log")
                    raise RuntimeError(f"redis-server on port {self.port} did not start: "
                                       f"{log.read_text()[-2000:] if log.exists() else ''}") from None
                time.sleep(0.05)

    def stop(self, *, kill: bool = False) -> None:
        """Stops the server (SIGKILL with ``kill``: nothing flushed beyond what AOF fsync wrote)."""
        if self.process is None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(kill=True)
