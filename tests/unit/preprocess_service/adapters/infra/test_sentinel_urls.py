"""redis+sentinel:// URLs (adapters/infra/store.py): what the replicas ask the Sentinels for, and
the URLs refused with a message rather than half understood."""

from __future__ import annotations

import pytest

from preprocess_service.adapters.infra.store import describe, sentinel_target


def test_sentinels_master_db_and_credentials_are_read_and_the_password_kept_out_of_messages():
    assert sentinel_target("redis+sentinel://bob:p%40ss@s1:26380,s2,[::1]:26381/mymaster/2") == (
        [("s1", 26380), ("s2", 26379), ("::1", 26381)], "mymaster", 2, "bob", "p@ss")
    assert sentinel_target("redis+sentinel://s1/m") == ([("s1", 26379)], "m", 0, None, None)
    assert describe("redis+sentinel://bob:secret@s1:26380,s2/m/0") == "redis+sentinel://s1:26380,s2/m/0"


@pytest.mark.parametrize("url", ["redis+sentinel://s1/", "redis+sentinel://s1:/m", "redis+sentinel://s1:99999/m",
                                 "redis+sentinel://s1/m?ssl=1", "redis+sentinel://s1/m/x", "redis+sentinel:///m",
                                 "redis+sentinel://s1,/m"])
def test_a_url_that_does_not_name_sentinels_and_a_master_is_refused(url):
    with pytest.raises(ValueError, match="a Sentinel URL is"):
        sentinel_target(url)


def test_the_redis_py_internals_the_primary_watch_uses_are_there():
    """_cut_connections and PrimaryConnection lean on redis-py internals: an upgrade that renames
    them fails here, not in a failover."""
    import socket

    import redis
    from redis.sentinel import SentinelConnectionPool, SentinelManagedConnection

    from preprocess_service.adapters.infra.store import _cut_connections

    pool = redis.ConnectionPool()
    connection = pool.make_connection()
    pool._in_use_connections.add(connection)  # as get_connection does, without a server to connect to
    assert hasattr(connection, "_sock") and hasattr(SentinelManagedConnection, "_connect_retry")
    assert hasattr(SentinelConnectionPool, "get_master_address")
    left, right = socket.socketpair()
    try:
        connection._sock, connection.host, connection.port = left, "old", 6379
        assert _cut_connections(pool, ("new", 6379)) == 1
        assert left.recv(1) == b""  # shut down: a read waiting on it returns at once
        assert _cut_connections(pool, ("old", 6379)) == 0  # the primary's own connections stay
    finally:
        connection._sock = None
        left.close()
        right.close()
