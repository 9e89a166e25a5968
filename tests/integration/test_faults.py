"""Cluster faults (bench/faults.py): the history verdict catches what it must, and the short
version of the bench (one run of each fault, in network namespaces) loses, repeats and conflicts
nothing; a Sentinel failover that lost writes and full disks are said; torchrun restarts a killed
rank's group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain_tools import netlab

REPO = Path(__file__).resolve().parents[2]
_PATH = list(sys.path)
sys.path.insert(0, str(REPO / "bench"))
import faults  # noqa: E402

sys.path[:] = _PATH  # the bench puts the repository, bench/ and tests/ first on the path: not for the tests after


def _history(path: Path, rows: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _mb(t, step, index, keys, replica="a", pace=0.1):
    return {"t": t, "rank": 0, "epoch": 0, "step": step, "mb": index, "keys": keys, "skipped": [], "pace": pace,
            "replica": replica}


def test_the_verdict_counts_lost_repeated_conflicting_and_acknowledged_replays(tmp_path):
    keys = {"k1", "k2", "k3", "k4", "k5"}
    _history(tmp_path / "rank0.jsonl", [
        {"event": "start", "t": 0.0, "from_step": 0},
        _mb(1.0, 0, 0, ["k1"]), _mb(1.1, 0, 1, ["k2"]), {"t": 1.2, "ack": 1},
        _mb(1.3, 1, 0, ["k3"]), '{"t": 1.4, "ra',  # a rank killed while writing
        {"event": "start", "t": 2.0, "from_step": 1},
        _mb(9.0, 1, 0, ["k4"], replica="b"),  # replayed after the restart, with other keys: a conflict
        _mb(9.1, 0, 1, ["k2"], replica="b"),  # a step it had acknowledged
        _mb(9.2, 1, 1, ["k1"], replica="b"),  # k1 a second time
        {"event": "done", "t": 9.3}])
    result = faults.verdict(tmp_path, 1, keys, 1, fault_at=5.0, healed_at=8.0)
    assert result["keys_lost"] == 2  # k4 (its slot kept the first delivery, k3) and k5
    assert result["keys_repeated"] == 1  # k1
    assert result["conflicting_microbatches"] == 1 and result["acknowledged_steps_replayed"] == 1
    assert result["ranks_finished"] == 1 and result["ranks_moved_during_fault"] == 0
    assert result["stall_s"] == pytest.approx(9.0 - 2.0 - 0.1)  # the restarted rank's wait for data


@pytest.mark.timeout(900)
def test_a_slot_delivered_twice_to_one_client_life_is_a_repeat_not_a_replay(tmp_path):
    _history(tmp_path / "rank0.jsonl", [
        {"event": "start", "t": 0.0, "from_step": 0},
        _mb(1.0, 0, 0, ["k1"]), _mb(1.1, 0, 0, ["k1"]),  # the same client got (0, 0) twice
        _mb(1.2, 0, 1, ["k2"]), {"event": "done", "t": 2.0}])
    result = faults.verdict(tmp_path, 1, {"k1", "k2"}, 1, fault_at=5.0, healed_at=6.0)
    assert result["keys_repeated"] == 1 and result["microbatches_replayed_after_restart"] == 0
    assert result["keys_lost"] == 0


def test_a_rank_restarted_after_the_fault_is_back_at_its_first_microbatch(tmp_path):
    _history(tmp_path / "rank0.jsonl", [
        {"event": "start", "t": 0.0, "from_step": 0},
        _mb(1.0, 0, 0, ["k1"]), _mb(1.1, 0, 1, ["k2"]), {"t": 1.2, "ack": 1},
        {"event": "start", "t": 7.0, "from_step": 1, "restart": 1},  # killed at 5.0, restarted by torchrun
        _mb(8.5, 1, 0, ["k3"]), _mb(8.6, 1, 1, ["k4"]), {"event": "done", "t": 9.0}])
    result = faults.verdict(tmp_path, 1, {"k1", "k2", "k3", "k4"}, 1, fault_at=5.0, healed_at=5.0)
    assert result["ranks_back_s"] == pytest.approx(3.5) and result["keys_lost"] == 0
    assert result["rank_restarts"] == 1
    assert result["stall_s"] == pytest.approx(8.5 - 7.0 - 0.1)  # the wait of its new life, not its restart


@pytest.mark.timeout(900)
def test_short_fault_runs_lose_and_repeat_nothing_and_a_cut_replica_s_ranks_move(tmp_path):
    reason = netlab.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    out = tmp_path / "faults.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "faults.py"), "--quick", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    print(done.stdout[-4000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == set(faults.FAULTS)
    for name, runs in results.items():
        for run in runs:
            assert run["keys_lost"] == run["keys_repeated"] == run["conflicting_microbatches"] == 0, (name, run)
            assert run["acknowledged_steps_replayed"] == 0 and run["ranks_finished"] == 2, (name, run)
            assert run["keys_delivered"] == run["keys_expected"], (name, run)
            assert run["rank_restarts"] == 0 or name == "rank-kill", (name, run)  # torchrun hides no crash
    # how soon ranks move (ranks_moved_during_fault, stall_s) is measured, not asserted: on a loaded
    # machine a hand-over (stream timeout, planning lease, replay) can outlast a 10 s cut
    # a failover to a replica behind its primary lost committed steps: said, and planned again the same
    assert results["redis-failover"][0]["said"] >= 1, results["redis-failover"]
    # torchrun restarted the killed rank's group, which resumed from its checkpoints
    assert results["rank-kill"][0]["ranks_back_s"] is not None, results["rank-kill"]
    # full disks: said, no partial file left; a node restarted on a full state_dir resumed from the
    # state saved before, and saved again once there was room
    cache, state = results["cache-disk-full"][0], results["state-disk-full"][0]
    assert cache["said"] >= 1 and cache["partial_files_left"] == 0, cache
    assert state["said"] >= 1 and state["resumed_from_saved_state"] >= 1 and state["partial_files_left"] == 0, state
    assert state["state_saved_again"] and state["state_saved_at"] == state["last_acked"] > 0, state
