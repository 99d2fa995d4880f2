"""The wire form of a batch: a lossless round trip, and malformed bytes refused clearly."""

import numpy as np
import pytest

from metricsvc.core.batch import Batch
from metricsvc.core.records import NFIELDS
from metricsvc.core.sketch import SketchSpec, sparse_counts
from metricsvc.core.validation import BatchRejected
from metricsvc.core.wire import decode, encode


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
