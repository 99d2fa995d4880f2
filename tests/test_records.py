"""The record algebra: identity, associativity, commutativity, exactness on random splits."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricsvc.core import records
from metricsvc.core.records import COUNT, M2_ROOT, MAX, MIN, NONFINITE, SUM
from metricsvc.core.wire import Batch
from tests.helpers import merge_two


def _whole(x):
    return records.summarize_array(x)


def test_identity_merge_is_a_no_op_and_does_not_change_arguments():
    row = records.summarize_array(np.array([1.0, -2.0, 5.0]))[None]
    ident = records.identity(1)
    before = row.copy()
    assert np.array_equal(merge_two(row, ident), row)
    assert np.array_equal(merge_two(ident, row), row)
    assert np.array_equal(row, before) and np.array_equal(ident, records.identity(1))


def test_summary_excludes_nonfinite_and_masked_positions():
    v = np.array([1.0, np.nan, np.inf, 4.0, 1e300 * 10, 7.0])
    mask = np.array([True, True, True, True, False, False])
    row = records.summarize_array(v, mask)
    assert row[SUM] == 5.0 and row[COUNT] == 2 and row[MIN] == 1.0 and row[MAX] == 4.0
    assert row[M2_ROOT] == pytest.approx(np.sqrt(4.5), rel=1e-15) and row[NONFINITE] == 2


def test_empty_population_is_the_identity_not_zero():
    row = records.summarize_array(np.array([3.0]), np.array([False]))
    assert np.array_equal(row, records.identity(1)[0])


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=80),
    cuts=st.lists(st.integers(0, 80), max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_merge_of_random_splits_in_random_order_equals_whole(data, cuts, seed):
    x = np.array(data)
    parts = np.split(x, sorted({c % (len(x) + 1) for c in cuts}))
    rows = [records.summarize_array(p)[None] for p in parts]
    order = np.random.default_rng(seed).permutation(len(rows))
    acc = records.identity(1)
    for i in order:
        acc = merge_two(acc, rows[i])
    whole = _whole(x)
    assert acc[0, COUNT] == whole[COUNT] and acc[0, MIN] == whole[MIN]
    assert acc[0, MAX] == whole[MAX]
    np.testing.assert_allclose(acc[0, SUM], whole[SUM], rtol=1e-9, atol=1e-6)
    np.testing.assert_allclose(acc[0, M2_ROOT], whole[M2_ROOT], rtol=1e-9, atol=1e-300)


def test_scalar_row_weight_counts_the_value_weight_times():
    row = records.scalar_row(3.0, weight=4.0)
    assert row[SUM] == 12.0 and row[COUNT] == 4.0 and row[MIN] == row[MAX] == 3.0
    assert records.scalar_row(float("nan"))[NONFINITE] == 1


def test_batch_build_coerces_wire_dtypes():
    b = Batch.build(step=1, rank=0, world_size=2, seq=1, final=True, keys=["a"],
                    data=[[1, 1, 1, 1, 0, 0, 0]], kinds=[2], expected=[0])
    assert b.data.dtype == np.float64 and b.kinds.dtype == np.int8 and b.expected.dtype == np.int32
    assert b.nbytes > 0


def test_a_keys_merged_record_does_not_depend_on_the_keys_merged_beside_it():
    """``merge_grouped`` takes the double-double offsets only when some key is far from 0
    (mean > 10 std); a key's record must be the same bits whichever way its step's other
    keys send it, across magnitudes, empty and non-finite contributions."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n, parts, idx = int(rng.integers(2, 8)), [], []
        for key in range(n):
            off = rng.choice([0.0, 0.0, 1e6, -3e12])  # some keys far from 0, most not
            scale = 10.0 ** rng.integers(-200, 200)
            for _ in range(int(rng.integers(1, 5))):
                x = off + scale * rng.normal(size=int(rng.integers(0, 6)))
                if x.size and rng.random() < 0.1:
                    x[0] = np.inf
                parts.append(records.summarize_array(x))
                idx.append(key)
        rows, idx = np.array(parts), np.array(idx)
        together = records.merge_grouped(rows, idx, n)
        for key in range(n):
            alone = records.merge_grouped(rows[idx == key], np.zeros((idx == key).sum(), int), 1)
            assert together[key].tobytes() == alone[0].tobytes(), (key, together[key], alone)
