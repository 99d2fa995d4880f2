"""The wire form of a batch: a lossless round trip, and malformed bytes refused clearly."""

import numpy as np
import pytest

from metricsvc.core.records import NFIELDS, NSOURCE
from metricsvc.core.sketch import SketchSpec, sparse_counts
from metricsvc.core.wire import Batch, decode, encode
from metricsvc.errors import BatchRejected


def test_round_trip_keeps_every_field_bit_for_bit():
    spec = SketchSpec()
    sketch = sparse_counts(np.array([0.5, 2.0, -3.0]), spec)
    b = Batch.build(step=7, rank=3, world_size=8, seq=42, final=True,
                    keys=("ключ/mean", "a/b", "🙂"), data=np.random.default_rng(0).normal(
                        size=(3, NFIELDS)), kinds=[0, 1, 8], expected=[0, 2, 0],
                    sketches={2: sketch}, sketch_alpha=0.01)
    out = decode(encode(b))
    assert (out.step, out.rank, out.world_size, out.seq, out.final, out.keys,
            out.sketch_alpha) == (7, 3, 8, 42, True, b.keys, 0.01)
    for name in ("data", "kinds", "expected", "sketch_rows", "sketch_offsets", "sketch_codes",
                 "sketch_counts"):
        got, want = getattr(out, name), getattr(b, name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name


def test_an_empty_batch_round_trips():
    b = Batch.build(step=0, rank=0, world_size=1, seq=1, final=True, keys=(), data=[],
                    kinds=[], expected=[])
    assert decode(encode(b)).keys == ()


@pytest.mark.parametrize("blob", [b"", b"\x00" * 10, encode(Batch.build(
    step=0, rank=0, world_size=1, seq=1, final=True, keys=("x",), data=[[1, 1, 1, 1, 0, 0, 0]],
    kinds=[0], expected=[0]))[:-3]])
def test_malformed_bytes_are_refused_not_crashed_on(blob):
    with pytest.raises(BatchRejected, match="malformed wire batch"):
        decode(blob)


def _batch(sketch: bool, located: bool, derived: bytes = b"") -> Batch:
    spec = SketchSpec()
    return Batch.build(
        step=5, rank=1, world_size=4, seq=2, final=True, keys=("a/mean", "b", "c/max", "d"),
        data=np.random.default_rng(1).normal(size=(4, NFIELDS)), kinds=[0, 8, 2, 0],
        expected=[0, 0, 3, 1], derived=derived, sketch_alpha=0.01,
        sketches={1: sparse_counts(np.array([0.5, 2.0]), spec)} if sketch else None,
        extremes={0: np.r_[np.arange(8.0), 0, 0, 1, 2, np.inf],
                  2: np.full(NSOURCE, np.nan)} if located else None)


@pytest.mark.parametrize("sketch, located", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_every_layout_decodes_to_the_batch_it_encodes(sketch, located):
    """A batch of records only (the common one) and one with sketches or located extremes
    give every column back, a column the batch does not carry is the one shared empty
    array (``wire.EMPTY``); any byte short or over is refused."""
    b = _batch(sketch, located, derived=b'{"x": 1}')
    blob = encode(b)
    out = decode(blob)
    assert (out.step, out.rank, out.world_size, out.seq, out.final, out.keys, out.derived,
            out.sketch_alpha) == (5, 1, 4, 2, True, b.keys, b'{"x": 1}', 0.01)
    for name in ("data", "kinds", "expected", "sketch_rows", "sketch_offsets", "sketch_codes",
                 "sketch_counts", "extreme_rows", "extremes"):
        got, want = getattr(out, name), getattr(b, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert np.array_equal(got, want, equal_nan=True), name
    from metricsvc.core.wire import EMPTY

    empty = Batch(step=0, rank=0, world_size=1, seq=0, final=True, keys=(),
                  data=np.zeros((0, NFIELDS)), kinds=np.zeros(0, np.int8),
                  expected=np.zeros(0, np.int32))
    assert empty.sketch_codes is EMPTY["sketch_codes"]
    if not sketch:
        assert out.sketch_codes is empty.sketch_codes and out.sketch_rows is empty.sketch_rows
    if not located:
        assert out.extremes is empty.extremes and out.extreme_rows is empty.extreme_rows
    assert encode(out) == blob
    for cut in (1, 7, 8, 61):
        with pytest.raises(BatchRejected, match="malformed wire batch"):
            decode(blob[:-cut])
        with pytest.raises(BatchRejected, match="malformed wire batch"):
            decode(blob + b"\x00" * cut)


def test_a_key_block_seen_before_decodes_to_the_same_tuple_and_never_to_another():
    """Ranks send the same keys every step: their decoded tuple is reused (one object, so
    lookups by it are cheap); a block is never mistaken for another, nor an invalid one
    taken because a valid one of its length was cached."""
    def one(keys, step=0):
        return encode(Batch.build(step=step, rank=0, world_size=1, seq=1, final=True,
                                  keys=keys, data=np.zeros((len(keys), NFIELDS)),
                                  kinds=[0] * len(keys), expected=[0] * len(keys)))

    first, again = decode(one(("a/mean", "b"))), decode(one(("a/mean", "b"), step=1))
    assert first.keys == ("a/mean", "b") and again.keys is first.keys
    assert decode(one(("a/mean", "c"))).keys == ("a/mean", "c")
    assert decode(one(())).keys == ()
    blob = bytearray(one(("a/mean", "b")))
    blob[blob.index(b"a/mean")] = 0xFF  # the same length, no longer UTF-8
    with pytest.raises(BatchRejected, match="malformed wire batch"):
        decode(bytes(blob))
