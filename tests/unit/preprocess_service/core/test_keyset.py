"""The planner's set of key hashes (duplicate detection): exact membership at 8 bytes per key."""

import numpy as np

from preprocess_service.core.planner import KeySet, _key_hash


def test_membership_survives_merges_and_a_round_trip_through_the_state():
    keys = [f"{i:09d}" for i in range(30_000)]
    seen = KeySet()
    for key in keys[:20_000]:
        digest = _key_hash(key)
        assert digest not in seen
        seen.add(digest)
    assert len(seen) == 20_000
    assert all(_key_hash(k) in seen for k in keys[:20_000:7])
    assert not any(_key_hash(k) in seen for k in keys[20_000::7])
    array = seen.to_array()
    assert array.dtype == np.uint64 and len(array) == 20_000 and bool(np.all(array[1:] > array[:-1]))
    restored = KeySet(np.frombuffer(array.tobytes(), dtype=np.uint64))
    assert all(_key_hash(k) in restored for k in keys[:20_000:5])
    assert _key_hash(keys[25_000]) not in restored
    assert array.nbytes == 8 * 20_000, "8 bytes per key"
