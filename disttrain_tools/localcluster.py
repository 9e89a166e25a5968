"""Local stand-ins for a deployment, for tests, benchmarks and the chaos script: a throwaway
redis-server (the Debian package's binary) on a free port, run in the foreground as a child
process with AOF on (as deployed) and restartable on the same port and data directory; and
service replicas as separate processes that can be SIGKILLed and restarted."""

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
    def __init__(self, data_dir: Path, *, port: int | None = None, appendonly: bool = True,
                 extra_args: tuple[str, ...] = ()):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (./dev.sh setup installs the Debian package)")
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.extra_args = extra_args
        """More redis-server arguments (``--replicaof 127.0.0.1 PORT`` makes it a replica)."""
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", str(self.data_dir), "--logfile", str(self.data_dir / "redis.log")]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        args += list(self.extra_args)
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


class LocalSentinel:
    """One Redis Sentinel (redis-server in sentinel mode) watching the primary on ``master_port``
    as ``name``, quick to act (down after ``down_after_ms``, 1 s by default; quorum 1): a failover
    promotes its replica. The service reaches it as ``redis+sentinel://127.0.0.1:PORT/NAME/0``."""

    def __init__(self, work_dir: Path, master_port: int, *, name: str = "disttrain", port: int | None = None,
                 master_host: str = "127.0.0.1", host: str = "127.0.0.1", prefix: tuple[str, ...] = (),
                 down_after_ms: int = 1000):
        self.down_after_ms = down_after_ms
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.port, self.host, self.name, self.prefix = port or free_port(), host, name, prefix
        self.master = (master_host, master_port)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://{self.host}:{self.port}/{self.name}/0"

    def start(self, timeout_s: float = 10.0) -> LocalSentinel:
        config = self.work_dir / "sentinel.conf"  # Sentinel rewrites it with what it learns
        config.write_text(f"port {self.port}\nbind {self.host}\nprotected-mode no\ndir {self.work_dir}\n"
                          f"logfile {self.work_dir / 'sentinel.log'}\n"
                          f"sentinel monitor {self.name} {self.master[0]} {self.master[1]} 1\n"
                          f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}\n"
                          f"sentinel failover-timeout {self.name} 3000\n")
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (./dev.sh setup installs the Debian package)")
        self.process = subprocess.Popen([*self.prefix, binary, str(config), "--sentinel"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.2) as client:
                    if client.sentinel_get_master_addr_by_name(self.name):
                        return self
            except redis.RedisError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis sentinel on port {self.port} did not start")
            time.sleep(0.05)

    def primary(self) -> tuple[str, int] | None:
        """Where the Sentinel says the primary is now."""
        with redis.Redis(host=self.host, port=self.port, socket_connect_timeout=1) as client:
            found = client.sentinel_get_master_addr_by_name(self.name)
        if not found:
            return None
        host = found[0].decode() if isinstance(found[0], bytes) else found[0]
        return host, int(found[1])

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


class Replica:
    """One service replica as its own process (``python -m preprocess_service serve --redis``), so
    it can be SIGKILLed like a crashed node and restarted on the same port. With ``redis_url``
    None it is a single node (its state in ``--state-dir``, if ``extra_args`` gives one)."""

    def __init__(self, redis_url: str | None, *, port: int | None = None, decode_workers: int = 1,
                 log_path: Path | None = None, extra_args: tuple[str, ...] = (), host: str = "127.0.0.1",
                 prefix: tuple[str, ...] = ()):
        self.redis_url = redis_url
        self.host = host
        self.prefix = prefix
        """Prepended to the command (``ip netns exec NS`` runs it in a network namespace)."""
        self.port = port or free_port()
        self.decode_workers = decode_workers
        self.log_path = log_path
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, *, wait: bool = True, timeout_s: float = 120.0) -> Replica:
        import sys

        args = [*self.prefix, sys.executable, "-m", "preprocess_service", "serve", "--host", self.host,
                "--port", str(self.port),
                *(("--redis", self.redis_url) if self.redis_url else ()), "--decode-workers", str(self.decode_workers),
                "--replica-id", f"replica-{self.host}:{self.port}", "--metrics-port", "0", *self.extra_args]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        finally:  # the child has its own copy
            if self.log_path:
                log.close()
        self.starts += 1
        if wait:
            self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"replica on port {self.port} exited with {self.process.returncode}")
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica on port {self.port} not serving after {timeout_s:g} s")
                time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL, as a crashed node: no cleanup, its leases expire in Redis."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=30)
            self.process = None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None
