import pytest

from helpers import make_document
from preprocess_service.core.packing import pack_documents


def _pack(lengths, seq_len=100, window=4):
    docs = [make_document(f"{i:09d}", text_tokens=n - 2) for i, n in enumerate(lengths)]
    return docs, list(pack_documents(docs, seq_len=seq_len, window=window))


@pytest.mark.parametrize("window", [1, 2, 8])
def test_every_document_packed_exactly_once_and_fits(window):
    lengths = [7, 93, 40, 40, 20, 61, 100, 3, 55, 45, 12, 88, 2, 50]
    docs, seqs = _pack(lengths, window=window)
    packed = [doc.key for seq in seqs for doc in seq.documents]
    assert sorted(packed) == sorted(d.key for d in docs)
    assert all(seq.num_tokens <= 100 for seq in seqs)


def test_sequential_packing_keeps_order_and_closes_on_overflow():
    docs, seqs = _pack([60, 30, 20, 50], window=1)
    assert [[d.key for d in s.documents] for s in seqs] == [[docs[0].key, docs[1].key], [docs[2].key, docs[3].key]]


def test_best_fit_fills_the_tightest_open_sequence():
    # 70 and 50 open two sequences; 30 fits only with 70 exactly, 50 goes with 50.
    docs, seqs = _pack([70, 50, 30, 50], window=4)
    groups = sorted(sorted(d.key for d in s.documents) for s in seqs)
    assert groups == sorted([sorted([docs[0].key, docs[2].key]), sorted([docs[1].key, docs[3].key])])
    assert all(s.free_tokens == 0 for s in seqs)


def test_best_fit_packs_denser_than_sequential():
    lengths = [60, 50, 40, 30, 45, 55, 65, 35, 25, 75, 20, 80] * 4
    _, sequential = _pack(lengths, window=1)
    _, best_fit = _pack(lengths, window=8)
    assert len(best_fit) < len(sequential)


def test_document_longer_than_sequence_is_refused():
    with pytest.raises(ValueError, match="more than seq_len 100"):
        _pack([101])
