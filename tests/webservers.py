"""Real web servers for the remote-shard tests and bench/remote.py: nginx (Debian's package,
started in the foreground as a child process on a free port, its access log recording the bytes
sent per request) and a small http.server that supports Range and can drop connections."""

from __future__ import annotations

import http.server
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

NGINX_LOG_FORMAT = '$request_method $uri $status $bytes_sent $body_bytes_sent "$http_range"'


def nginx_binary() -> str | None:
    """nginx on PATH or in /usr/sbin (Debian's, where a non-root PATH may not look)."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LogLine:
    method: str
    path: str
    status: int
    bytes_sent: int
    """Headers and body."""
    body_bytes_sent: int
    range: str


class Nginx:
    """nginx serving ``root`` on ``host`` (127.0.0.1; ``url``); ``/slow/...`` serves the same files
    at ``slow_rate`` bytes/s. ``prefix`` is prepended to its command (``ip netns exec NS``: in a
    network namespace, whose address ``host`` is). Use as a context manager; ``log()`` parses the
    access log."""

    def __init__(self, root: Path, work: Path, *, slow_rate: str = "200k", host: str = "127.0.0.1",
                 port: int | None = None, prefix: tuple[str, ...] = ()):
        binary = nginx_binary()
        if binary is None:
            raise FileNotFoundError("nginx is not installed (apt-get install nginx-light; ./dev.sh test does)")
        self.root, self.work, self.host = Path(root), Path(work), host
        self.port = port or free_port()
        self.work.mkdir(parents=True, exist_ok=True)
        user = "user root;" if os.geteuid() == 0 else ""  # workers would run as nobody, who cannot read tmp dirs
        temp = "\n".join(f"    {kind}_temp_path {self.work}/{kind};" for kind in
                         ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (self.work / "nginx.conf").write_text(f"""
{user}
daemon off;
worker_processes 1;
pid {self.work}/nginx.pid;
error_log {self.work}/error.log warn;
events {{ worker_connections 256; }}
http {{
    log_format fetch '{NGINX_LOG_FORMAT}';
    access_log {self.work}/access.log fetch;
{temp}
    default_type application/octet-stream;
    sendfile on;
    server {{
        listen {self.host}:{self.port};
        root {self.root};
        location /slow/ {{ alias {self.root}/; limit_rate {slow_rate}; sendfile off; output_buffers 1 8k; }}
    }}
}}
""")
        self.process = subprocess.Popen([*prefix, binary, "-c", str(self.work / "nginx.conf"), "-p", str(self.work),
                                         "-e", str(self.work / "error.log")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.process.returncode}: "
                                   f"{self.process.stderr.read().decode(errors='replace')}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError(f"nginx did not listen on port {self.port} within {timeout_s} s")

    def log(self) -> list[LogLine]:
        path = self.work / "access.log"
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            method, uri, status, sent, body, rng = re.match(r'(\S+) (\S+) (\d+) (\d+) (\d+) "(.*)"$', line).groups()
            out.append(LogLine(method, uri, int(status), int(sent), int(body), "" if rng == "-" else rng))
        return out

    def log_since(self, start: int, at_least: int, timeout_s: float = 10.0, settle_s: float = 0.3) -> list[LogLine]:
        """The access log's lines after the first ``start``, once it holds ``at_least`` of them (nginx
        writes a request's line as it finishes the request, which can be just after the client got
        its last byte) and nothing more came for ``settle_s``: a line a test expects is waited for,
        one it does not expect is still seen. Bounded by ``timeout_s`` (then what is there)."""
        deadline = time.monotonic() + timeout_s
        while len(self.log()) < start + at_least and time.monotonic() < deadline:
            time.sleep(0.02)
        seen = len(self.log())
        while time.monotonic() < deadline:
            time.sleep(settle_s)
            if len(self.log()) == seen:
                break
            seen = len(self.log())
        return self.log()[start:]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()

    def __enter__(self) -> Nginx:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Plan:
    """How ``RangeServer`` misbehaves."""

    drop_after: dict[str, int] = field(default_factory=dict)
    """Path -> bytes of body after which the first response for it is cut (connection closed)."""
    ignore_ranges: bool = False
    """Answer every request 200 with the whole file (a server without Range support)."""
    fail_first: dict[str, int] = field(default_factory=dict)
    """Path -> how many first requests get 503."""
    pace: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Path -> (pieces, seconds): the body is sent in that many pieces with that pause between
    two (a slow server whose delays the test controls, not the machine's speed)."""


class RangeServer:
    """http.server serving the files of ``root`` with Range support (206, Content-Range, ETag),
    misbehaving as ``plan`` says; ``requests`` lists (path, range header, status, body bytes sent)."""

    def __init__(self, root: Path, plan: Plan | None = None):
        self.root, self.plan = Path(root), plan or Plan()
        self.requests: list[tuple[str, str, int, int]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # the stdlib's name
                server._serve(self)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def _serve(self, handler) -> None:
        path = handler.path
        file = self.root / path.lstrip("/")
        rng = handler.headers.get("Range", "")
        with self._lock:
            failures = self.plan.fail_first.get(path, 0)
            if failures:
                self.plan.fail_first[path] = failures - 1
            drop = None if failures else self.plan.drop_after.pop(path, None)
        if failures:
            return self._answer(handler, path, rng, 503, b"", {})
        if not file.is_file():
            return self._answer(handler, path, rng, 404, b"", {})
        data = file.read_bytes()
        start = 0
        match = re.match(r"bytes=(\d+)-$", rng)
        if match and not self.plan.ignore_ranges:
            start = int(match.group(1))
        headers = {"ETag": f'"{len(data)}-{int(file.stat().st_mtime)}"', "Accept-Ranges": "bytes"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self._answer(handler, path, rng, 206 if start else 200, data[start:], headers, drop, self.plan.pace.get(path))

    def _answer(self, handler, path, rng, status, body, headers, drop=None, pace=None) -> None:
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            handler.send_header(name, value)
        if drop is not None:
            handler.send_header("Connection", "close")
        handler.end_headers()
        sent = body if drop is None else body[:drop]
        pieces, pause = pace or (1, 0.0)
        step = -(-len(sent) // pieces) or 1
        written = 0
        try:
            for offset in range(0, len(sent), step):
                if offset:
                    time.sleep(pause)
                handler.wfile.write(sent[offset:offset + step])
                handler.wfile.flush()
                written = min(len(sent), offset + step)
        except OSError:  # the client went away
            pass
        sent = sent[:written]
        if drop is not None:
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self.requests.append((path, rng, status, len(sent)))

    def served(self, count: int, timeout_s: float = 10.0) -> list[tuple[str, str, int, int]]:
        """``requests`` once ``count`` are recorded: a request is recorded after its last byte is
        written, which the client may have read (and returned) before the server's thread records it."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if len(self.requests) >= count or time.monotonic() > deadline:
                    return list(self.requests)
            time.sleep(0.01)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
