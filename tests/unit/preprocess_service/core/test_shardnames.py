"""Shard names as views: a permuted order answers positions from its permutation, a concatenation
names across its parts, and every kind equals the list it stands for."""

import numpy as np
import pytest

from preprocess_service.core.mixture import shard_order
from preprocess_service.core.shardnames import Concat, ListNames, Permuted, ShardNames, as_names, positions


def test_views_equal_the_lists_they_stand_for():
    a, b = [f"/a/{i}.tar" for i in range(5)], [f"/b/{i}.tar" for i in range(3)]
    both = Concat([ListNames(a), ListNames([]), b])
    assert both == a + b and list(both) == a + b and len(both) == 8
    assert both[-1] == "/b/2.tar" and both[2:6] == (a + b)[2:6] and both[::3] == (a + b)[::3]
    with pytest.raises(IndexError):
        both[8]
    assert [both.position(u) for u in a + b] == list(range(8)) and both.position("/c/0.tar") is None
    assert "/b/1.tar" in both and "/c" not in both
    perm = np.random.default_rng(1).permutation(8)
    shuffled = Permuted(both, perm)
    assert list(shuffled) == [(a + b)[i] for i in perm]
    assert positions(shuffled, both).tolist() == perm.tolist()


def test_the_position_index_finds_first_places_and_tells_equal_hashes_apart():
    names = ListNames(["x", "y", "x"])
    assert names.position("x") == 0

    class Generated(ListNames):  # the generic index (12 bytes per name), not the list's dict
        position = ShardNames.position

    generated = Generated([f"s{i % 50}" for i in range(100)])
    assert [generated.position(f"s{i}") for i in range(50)] == list(range(50))
    assert generated.position("s50") is None


def test_a_seeded_order_is_a_permutation_of_positions_not_a_copy():
    names = as_names([f"/d/{i:05d}.tar" for i in range(1000)])
    order = shard_order(names, seed=3, epoch=2, shuffle=True)
    assert isinstance(order, Permuted) and order.perm.dtype == np.int32
    assert sorted(order) == list(names) and list(order) != list(names)
    assert positions(order, names).tolist() == [names.position(u) for u in order]
    assert list(shard_order(names, seed=3, epoch=2, shuffle=True)) == list(order)  # deterministic
    assert shard_order(names, seed=3, epoch=2, shuffle=False) is names
    assert positions(list(order), names).tolist() == order.perm.tolist()  # a plain list: looked up
