"""``stat_each``: each key under its own mask, the short host vectors in one pass; the same
records as one ``stat`` call per key, and numpy's figures on the valid values."""

import contextlib
import math

import numpy as np
import pytest
import torch

from metricsvc.client import MetricClient
from metricsvc.client.summaries import summarize
from metricsvc.client.tensors import accelerator_path_on_cpu
from metricsvc.core.records import COUNT, M2_ROOT, MAX, MIN, NONFINITE, SUM, SUM_LO
from metricsvc.core.reduce import ReduceType
from tests.helpers import each_of


def _vectors(rng):
    n = 64
    out = {}
    for i, scale in enumerate((1e-200, 1e-9, 1.0, 1e12, 1e160)):  # far from 0, tiny, huge
        v = rng.normal(size=n) * scale + (scale * 3 if i % 2 else 0.0)
        mask = rng.random(n) < 0.6
        out[f"f64/{i}"] = (torch.tensor(v), torch.tensor(mask))
    out["f32"] = (torch.randn(n, dtype=torch.float32), None)
    out["int"] = (torch.randint(0, 1024, (n,)), torch.rand(n) < 0.5)
    out["bool"] = (torch.rand(n) < 0.3, None)
    out["numpy"] = (rng.integers(0, 9, size=n).astype(np.int32), rng.random(n) < 0.5)
    nan = rng.normal(size=n)
    nan[[3, 7]] = np.nan
    nan[9] = np.inf
    out["nonfinite"] = (torch.tensor(nan), torch.tensor(rng.random(n) < 0.9))
    out["none valid"] = (torch.ones(n), torch.zeros(n, dtype=torch.bool))
    out["constant"] = (torch.full((n,), 2.5), None)
    out["other length"] = (torch.arange(7.0), None)
    out["token level"] = (torch.randn(4, 300), torch.rand(4, 300) < 0.5)  # not a vector
    out["plain"] = (3.0, None)
    return out


@pytest.mark.parametrize("accelerator", [False, True])
def test_every_row_equals_numpy_on_the_valid_values_and_the_single_key_path(accelerator):
    """On the host the short vectors take one numpy pass; on a device (here the accelerator
    path on the CPU) a length's values take one stacked pass, each under its own mask."""
    rng = np.random.default_rng(5)
    path = accelerator_path_on_cpu if accelerator else contextlib.nullcontext
    for _ in range(5):
        values = _vectors(rng)
        with path():
            rows = each_of(values)
            alones = {key: summarize(v, m, key=key) for key, (v, m) in values.items()}
        for key, (v, m) in values.items():
            row = np.asarray(rows[key], dtype=np.float64)
            alone = np.asarray(alones[key], dtype=np.float64)
            x = np.asarray(v, dtype=np.float64).ravel()
            use = np.ones(x.shape, bool) if m is None else np.asarray(m).ravel()
            finite = x[use & np.isfinite(x)]
            assert row[COUNT] == alone[COUNT] == finite.size, key
            assert row[NONFINITE] == alone[NONFINITE] == np.count_nonzero(use & ~np.isfinite(x))
            if not finite.size:
                assert row[MIN] == math.inf and row[MAX] == -math.inf
                continue
            assert row[MIN] == finite.min() and row[MAX] == finite.max(), key
            total = math.fsum(finite)
            assert row[SUM] + row[SUM_LO] == pytest.approx(total, rel=1e-12, abs=1e-300), key
            dev = finite - math.fsum(finite) / finite.size
            scale = float(np.abs(dev).max()) or 1.0  # squared at scale: no over- or underflow
            root = scale * math.sqrt(math.fsum((dev / scale) ** 2))
            assert row[M2_ROOT] == pytest.approx(root, rel=1e-9, abs=1e-300), key


def test_stat_each_records_what_one_stat_per_mask_records_in_one_batch():
    x = torch.arange(10.0)
    a, b = MetricClient(None, rank=0, world_size=1), MetricClient(None, rank=0, world_size=1)
    a.stat_each(length=(x, None), long=(x, x > 5), kinds={"long": "max"})
    b.stat(length=x)
    b.stat(mask=x > 5, reduce="max", long=x)
    one = a.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    two = b.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    assert one.keys == two.keys and one.kinds.tolist() == two.kinds.tolist()
    np.testing.assert_allclose(one.data, two.data, rtol=1e-15)


def test_a_bad_value_or_mask_is_named_and_nothing_is_recorded():
    c = MetricClient(None, rank=0, world_size=1)
    with pytest.raises(TypeError, match=r"stat_each: the value for key 'x' must be a \(value"):
        c.stat_each(x=torch.ones(3))
    with pytest.raises(ValueError, match=r"mask of shape \(3,\) for key 'bad'"):
        c.stat_each(good=(torch.ones(3), None), bad=(torch.ones(3), torch.ones(4, dtype=bool)))
    with pytest.raises(TypeError, match=r"mask for key 'int mask' must be bool"):
        c.stat_each(**{"int mask": (torch.ones(3), torch.ones(3, dtype=torch.int64))})
    assert c.pending_keys() == []


def test_plain_numbers_recorded_again_merge_with_the_block_they_came_in():
    c = MetricClient(None, rank=0, world_size=1)
    c.submit_metric({"a": 1.0, "b": 2.0, "c": 5})
    c.submit_metric({"a": 3.0})  # merges with the first call's record of "a"
    with pytest.raises(ValueError, match=r"key 'b' was recorded as AUTO .* as MAX would mix"):
        c.stat(reduce="max", b=torch.tensor([7.0, 1.0]))  # a kind that clashes: refused
    c.submit_metric({"d": 4.0})
    assert c.pending_keys() == ["a", "b", "c", "d"]
    batch = c.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    rows = dict(zip(batch.keys, batch.data))
    assert sorted(batch.keys) == ["a", "b", "c", "d"]
    assert rows["a"][COUNT] == 2 and rows["a"][SUM] == 4.0 and rows["a"][MAX] == 3.0
    assert rows["b"][COUNT] == 1 and rows["b"][SUM] == 2.0 and rows["c"][SUM] == 5.0
    assert rows["d"][MIN] == 4.0


def test_keys_recorded_again_with_a_kind_each_merge_and_a_clash_records_nothing():
    """Micro-batches of a built-in family (one kind per key) repeat their keys every call:
    a new key among them joins, a key of another kind refuses the whole call by name."""
    c = MetricClient(None, rank=0, world_size=1)
    c.record_as({"a": ReduceType.SUM, "b": ReduceType.MAX}, {"a": 1.0, "b": 2.0})
    c.record_as({"a": ReduceType.SUM, "b": ReduceType.MAX, "n": ReduceType.MIN},
                {"a": 3.0, "b": 5.0, "n": 4.0})
    with pytest.raises(ValueError, match=r"key 'b' was recorded as MAX .* as MIN would mix"):
        c.record_as({"z": ReduceType.SUM, "a": ReduceType.SUM, "b": ReduceType.MIN},
                    {"z": 9.0, "a": 100.0, "b": -1.0})
    assert c.pending_keys() == ["a", "b", "n"]
    batch = c.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    rows = dict(zip(batch.keys, batch.data))
    assert rows["a"][COUNT] == 2 and rows["a"][SUM] == 4.0
    assert rows["b"][MAX] == 5.0 and rows["n"][MIN] == 4.0
    assert dict(zip(batch.keys, batch.kinds.tolist())) == {
        "a": int(ReduceType.SUM), "b": int(ReduceType.MAX), "n": int(ReduceType.MIN)}
