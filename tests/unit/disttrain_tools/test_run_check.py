"""`run`'s exactly-once check (RunResult.exactly_once) on crafted results: what passes, what fails."""

from __future__ import annotations

import pytest

from disttrain_tools.rank_client import RankResult
from disttrain_tools.runner import RunResult, exactly_once_line

SHARD_KEYS = {f"k{i}" for i in range(6)}


def _result(delivered: list[list[str]], skipped: list[tuple[str, str]], *, num_epochs: int = 1,
            error: str = "") -> RunResult:
    ranks = [RankResult(rank=r, microbatches=[{"step": 0, "microbatch": 0, "keys": keys}], error=error)
             for r, keys in enumerate(delivered)]
    return RunResult(job_id="j", ranks=ranks, step_balance=[], shard_keys=set(SHARD_KEYS), seconds=1.0,
                     skipped=[{"key": key, "shard": "s.tar", "reason": "why", "kind": kind} for key, kind in skipped],
                     num_epochs=num_epochs)


DUPLICATES_AND_LOSSES = [
    ("k0", "duplicate_member"),  # its first copy was kept and delivered
    ("k1", "duplicate_key"),  # likewise
    ("k2", "unreadable_image"),  # lost, not delivered
    ("cut", "truncated_shard"),  # a sample the reader never finished: a key, reported, not delivered
    ("", "truncated_shard"),  # a shard cut before its first sample: not a key
    ("", "shard_error"),
]


def test_a_kept_first_copy_and_shard_records_pass_and_every_category_is_counted():
    result = _result([["k0", "k3", "k5"], ["k1", "k4"]], DUPLICATES_AND_LOSSES)
    check = result.exactly_once()
    assert check["ok"], check
    assert (check["delivered_once"], check["skipped"], check["kept_first_copy"]) == (3, 2, ["k0", "k1"])
    assert check["num_keys"] == 7 and not (check["missing"] or check["duplicated"])
    assert exactly_once_line(check) == ("  exactly-once: OK (3 delivered once, 2 skipped with reasons, "
                                        "2 delivered + reported duplicate, 0 missing, 0 duplicated, of 7 keys)")


@pytest.mark.parametrize("delivered, skipped, failure", [
    ([["k0", "k1", "k3"], ["k0", "k4", "k5"]], [("k0", "duplicate_member"), ("k2", "bad_utf8")], "duplicated"),
    ([["k0", "k1", "k3"], ["k4"]], [("k2", "bad_utf8")], "missing"),  # k5 lost without a word
    ([["k0", "k1", "k3"], ["k4"]], [("k2", "bad_utf8"), ("k5", "duplicate_key")], "missing"),  # first copy gone
    ([["k0", "k1", "k2", "k3"], ["k4", "k5"]], [("k2", "decode_failed")], "delivered_and_skipped"),
    ([["k0", "k1", "k2", "k3"], ["k4", "k5", "zz"]], [], "unexpected"),
])
def test_a_key_delivered_twice_lost_or_both_delivered_and_lost_fails(delivered, skipped, failure):
    check = _result(delivered, skipped).exactly_once()
    assert not check["ok"] and check[failure], check
    assert exactly_once_line(check).startswith("  exactly-once: FAILED (")


def test_nothing_delivered_or_a_failed_rank_is_not_a_success():
    everything_skipped = [(k, "unreadable_image") for k in SHARD_KEYS]
    check = _result([[], []], everything_skipped).exactly_once()
    assert not check["ok"] and check["nothing_delivered"] and check["skipped"] == 6
    assert exactly_once_line(check).endswith("; nothing was delivered")
    assert not _result([sorted(SHARD_KEYS)], [], error="RuntimeError: gone").exactly_once()["ok"]


def test_each_pass_delivers_every_key_once():
    keys = sorted(SHARD_KEYS - {"k2"})
    twice = _result([keys, keys], [("k2", "bad_utf8"), ("k0", "duplicate_key")], num_epochs=2).exactly_once()
    assert twice["ok"] and twice["delivered_once"] == 4 and twice["kept_first_copy"] == ["k0"], twice
    assert "delivered once in each of 2 passes" in exactly_once_line(twice)
    assert not _result([keys, keys], [("k2", "bad_utf8")]).exactly_once()["ok"]  # one pass: duplicated
    assert not _result([keys, keys[1:]], [("k2", "bad_utf8")], num_epochs=2).exactly_once()["ok"]  # k0 once
