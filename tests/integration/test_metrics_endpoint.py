"""The /metrics HTTP endpoint (metrics.serve): loopback by default, bearer tokens, bounded connections."""

from __future__ import annotations

import base64
import http.client
import socket
import time

import pytest

from disttrain_api.errors import ConfigError
from preprocess_service.adapters.infra import metrics


@pytest.fixture
def serve():
    started = []

    def start(*args, **kwargs):
        server, thread, port = metrics.serve(*args, **kwargs)
        started.append(server)
        return server, thread, port

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def get(port: int, path: str = "/metrics", headers: dict[str, str] | None = None, host: str = "127.0.0.1"):
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        conn.close()


def _non_loopback_ipv4() -> str | None:
    candidates = []
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1; a UDP connect sends nothing, it only picks a route
            candidates.append(probe.getsockname()[0])
    except OSError:
        pass
    return next((ip for ip in candidates if not ip.startswith("127.") and ip != "0.0.0.0"), None)


def test_default_binds_loopback_only(serve):
    server, thread, port = serve(0)
    assert port > 0 and server.server_address == ("127.0.0.1", port)
    assert thread.daemon and thread.is_alive()
    assert get(port)[0] == 200
    other = _non_loopback_ipv4()
    if other is None:
        pytest.skip("this machine has only a loopback address")
    with pytest.raises(OSError):
        socket.create_connection((other, port), timeout=2).close()


def test_no_tokens_serves_metrics(serve):
    metrics.MICROBATCHES_SENT.inc(0)
    _, _, port = serve(0)
    for path in ("/metrics", "/", "/metrics?name[]=x"):
        status, headers, body = get(port, path)
        assert status == 200, path
        assert headers["Content-Type"].startswith("text/plain")
        assert "disttrain_microbatches_sent_total" in body


def test_bearer_tokens(serve):
    _, _, port = serve(0, tokens=("a-secret-token", "b"))
    refused = [
        None,
        "Bearer wrong",
        "Bearer a-secret-toke",  # a prefix of the right one
        "Bearer a-secret-token-and-more",
        "Bearer ",
        "Bearer",
        "a-secret-token",
        "Basic " + base64.b64encode(b"user:a-secret-token").decode(),
        "Basic a-secret-token",
        "Bearer\u00e9",
    ]
    for header in refused:
        status, headers, body = get(port, headers={"Authorization": header} if header is not None else {})
        assert status == 401, header
        assert headers["WWW-Authenticate"] == "Bearer"
        assert "disttrain_" not in body and "python_" not in body and len(body) < 200
    for header in ("Bearer a-secret-token", "Bearer b", "bearer b", "Bearer  b "):
        status, _, body = get(port, headers={"Authorization": header})
        assert status == 200, header
        assert "disttrain_microbatches_sent_total" in body
    # the token is checked before the path: an unauthenticated client learns nothing of the paths
    assert get(port, "/nope")[0] == 401
    assert get(port, "/nope", {"Authorization": "Bearer b"})[0] == 404


def test_two_authorization_headers_are_refused(serve):
    _, _, port = serve(0, tokens=("a",))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.putrequest("GET", "/metrics")
    conn.putheader("Authorization", "Bearer a")
    conn.putheader("Authorization", "Bearer x")
    conn.endheaders()
    assert conn.getresponse().status == 401
    conn.close()


def test_unknown_path_and_method(serve):
    _, _, port = serve(0)
    status, _, body = get(port, "/admin")
    assert status == 404 and "disttrain_" not in body
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("POST", "/metrics", body=b"x")
    assert conn.getresponse().status == 501
    conn.close()


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes ``sock`` (fails after ``seconds``)."""
    began = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(1024):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept an idle connection open for {seconds} s")
    return time.monotonic() - began


def test_silent_connection_is_closed_and_others_are_served(serve):
    _, _, port = serve(0, timeout_s=0.5)
    idle = socket.create_connection(("127.0.0.1", port))
    try:
        assert get(port)[0] == 200  # served while the idle one holds its thread
        assert _closed_within(idle, 5) < 3
    finally:
        idle.close()
    assert get(port)[0] == 200


def test_trickling_connection_is_cut_at_the_deadline(serve):
    _, _, port = serve(0, timeout_s=0.6)
    slow = socket.create_connection(("127.0.0.1", port))
    began = time.monotonic()
    try:
        for byte in b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"a" * 100:  # one byte every 0.1 s: each recv is quick
            slow.sendall(bytes([byte]))
            time.sleep(0.1)
            if time.monotonic() - began > 3:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        _closed_within(slow, 5)
    except OSError:
        pass
    finally:
        slow.close()
    assert time.monotonic() - began < 4


def test_connections_beyond_the_cap_are_closed(serve):
    _, _, port = serve(0, timeout_s=1.0, max_connections=2)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        time.sleep(0.1)  # both accepted and holding a slot
        extra = socket.create_connection(("127.0.0.1", port))
        try:
            assert _closed_within(extra, 0.8) < 0.5
        finally:
            extra.close()
        for sock in idle:
            _closed_within(sock, 5)
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.05)
    assert get(port)[0] == 200  # slots are free again


def test_bad_bind_raises_config_error(serve):
    _, _, port = serve(0)
    with pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
        metrics.serve(port)
    with pytest.raises(ConfigError, match="no-such-host.invalid:0"):
        metrics.serve(0, "no-such-host.invalid")
    with pytest.raises(ConfigError, match="70000"):
        metrics.serve(70000)
    with pytest.raises(ConfigError):
        metrics.serve(0, tokens=("a", ""))
    with pytest.raises(TypeError):
        metrics.serve(0, tokens="abc")
