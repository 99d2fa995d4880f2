"""Client-side summaries: masked, float64, non-finite excluded, no host transfer while recording."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metricsvc.client.buffer import RecordBuffer
from metricsvc.client.summaries import summarize, to_host
from metricsvc.client.tensors import accelerator_path_on_cpu
from metricsvc.core.records import (
    COUNT,
    M2_ROOT,
    MAX,
    MIN,
    NFIELDS,
    NONFINITE,
    SUM,
    SUM_LO,
    summarize_array,
)
from metricsvc.core.reduce import AUTO, ReduceType
from tests.helpers import located_of, merged, rows_of
from tests.synccount import HostTransferCounter


def _exact_root(x):
    """sqrt(M2) of the values ``x``, their spread taken in exact arithmetic."""
    exact = [Fraction(float(v)) for v in x]
    mean = sum(exact) / len(exact)
    return math.sqrt(float(sum((v - mean) ** 2 for v in exact)))


def _host(row):
    return row.numpy(force=True) if isinstance(row, torch.Tensor) else row


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_tensor_summary_matches_numpy_in_float64_for_every_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(13, 17, generator=g).to(dtype)
    mask = torch.rand(13, 17, generator=g) < 0.5
    row = _host(summarize(v, mask))
    ref = v.to(torch.float64).numpy()[mask.numpy()]
    assert row[COUNT] == ref.size and row[MIN] == ref.min() and row[MAX] == ref.max()
    np.testing.assert_allclose(row[SUM], ref.sum(), rtol=1e-12)
    np.testing.assert_allclose(row[M2_ROOT], np.sqrt(((ref - ref.mean()) ** 2).sum()), rtol=1e-12)


def test_tensor_summary_stays_on_device_and_never_syncs():
    v = torch.randn(64, 32)
    mask = torch.rand(64, 32) > 0.2
    with accelerator_path_on_cpu(), HostTransferCounter() as counter:
        row = summarize(v, mask, key="k")
        again = summarize(v[:3], mask[:3], key="k")
    assert isinstance(row, torch.Tensor) and row.dtype == torch.float64
    assert isinstance(again, torch.Tensor)
    assert counter.calls == []


def test_nonfinite_in_valid_positions_is_counted_and_masked_garbage_ignored():
    v = torch.tensor([1.0, float("nan"), float("inf"), 4.0, float("nan"), -float("inf")])
    mask = torch.tensor([True, True, True, True, False, False])
    row = _host(summarize(v, mask))
    assert row[SUM] == 5.0 and row[COUNT] == 2 and row[NONFINITE] == 2
    assert row[MIN] == 1.0 and row[MAX] == 4.0


def test_fully_masked_and_empty_tensors_give_the_identity():
    for v, m in [(torch.ones(3), torch.zeros(3, dtype=torch.bool)), (torch.ones(0), None)]:
        row = _host(summarize(v, m))
        assert row[COUNT] == 0 and row[MIN] == np.inf and row[MAX] == -np.inf and row[SUM] == 0


def test_numpy_and_plain_numbers_stay_on_the_host():
    assert isinstance(summarize(np.arange(4.0)), np.ndarray)
    row = summarize(np.int64(2**53 + 1))
    assert row[SUM] == float(np.int64(2**53 + 1)) and row[COUNT] == 1
    assert summarize([1, 2, 3])[SUM] == 6.0


def test_integer_and_bool_tensors_are_accepted():
    assert _host(summarize(torch.tensor([1, 2, 3])))[SUM] == 6.0
    assert _host(summarize(torch.tensor([True, False, True])))[SUM] == 2.0


@pytest.mark.parametrize(
    ("values", "mask", "error", "message"),
    [
        (torch.ones(4, 9), torch.ones(4, 8, dtype=torch.bool), ValueError,
         r"expected mask of shape \(4, 9\) for key 'critic/advantages', got \(4, 8\)"),
        (torch.ones(3), torch.ones(3), TypeError, "mask for key 'critic/advantages' must be bool"),
        (np.ones(3), np.ones(3, dtype=int), TypeError, "mask for key 'critic/advantages' must be"),
        (np.ones((2, 2)), np.ones(4, dtype=bool), ValueError, r"expected mask of shape \(2, 2\)"),
        ("abc", None, TypeError, "value for key 'critic/advantages' must be a number"),
        (np.array(["a"]), None, TypeError, "must be numeric, got dtype <U1"),
        (torch.ones(2, dtype=torch.complex64), None, TypeError, "must be a real tensor"),
        (1 + 2j, None, TypeError, "must be a real number"),
        ({"a": 1}, None, TypeError, "must be a number, tensor or array"),
    ],
)
def test_bad_input_raises_naming_the_key(values, mask, error, message):
    with pytest.raises(error, match=message):
        summarize(values, mask, key="critic/advantages")


def test_to_host_makes_one_transfer_for_all_device_rows():
    with accelerator_path_on_cpu():  # the rows a device makes
        rows = [summarize(torch.randn(5) + i) for i in range(40)] + [summarize(np.arange(3.0))]
        with HostTransferCounter() as counter:
            host, copies = to_host(rows)
    assert counter.count == 1 and copies == 1
    data = np.stack(host)
    assert data.shape == (41, NFIELDS) and data[-1, SUM] == 3.0
    np.testing.assert_array_equal(data[0], rows[0].numpy())
    # The host path's rows (numpy) are read where they are: no copy at all
    rows = [summarize(torch.randn(5) + i) for i in range(3)]
    host, copies = to_host(rows)
    assert copies == 0 and all(np.shares_memory(h, r) for h, r in zip(host, rows))


def test_a_key_recorded_on_the_host_and_on_a_device_merges_exactly():
    buf = RecordBuffer()
    with accelerator_path_on_cpu():  # the first recording's row lives on "the device"
        buf.record({"k": torch.tensor([2.0, 6.0])}, None, ReduceType.AVG_MIN_MAX)
    buf.record({"k": np.array([12.0])}, None, ReduceType.AVG_MIN_MAX)
    row = merged(buf)["k"]
    assert row[SUM] == 20.0 and row[COUNT] == 3 and row[MIN] == 2.0 and row[MAX] == 12.0


def test_compiled_kernel_equals_eager_and_never_recompiles_for_new_shapes(monkeypatch):
    """The fused kernels trace whole (``fullgraph``) with dynamic sizes: every form a run
    meets (one value or stacked, one mask or one per value, float32 or float64, located or
    not) compiles once, and new batch shapes and value counts compile nothing more; their
    rows are the host path's. Traced with ``aot_eager`` (dynamo and AOT autograd, the
    compiler's front half: what decides graphs and recompiles) and not lowered to C++ here
    (40 s of a CPU for a kernel that only a GPU runs by default; ``benchmarks/bench_device``
    runs the real one there)."""
    import importlib

    from torch._dynamo.utils import counters

    from tests.helpers import each_of

    s = importlib.import_module("metricsvc.client.device")  # the accelerator path's module
    kernels = {located: torch.compile(s._kernel_located if located else s._kernel,
                                      dynamic=True, fullgraph=True, backend="aot_eager")
               for located in (False, True)}
    monkeypatch.setattr(s, "_compiled", kernels.__getitem__)
    g = torch.Generator().manual_seed(1)

    def check(compiled, host, v, mask):
        np.testing.assert_allclose(np.delete(compiled.numpy(), [SUM, SUM_LO]),
                                   np.delete(np.asarray(host), [SUM, SUM_LO]), rtol=1e-12)
        # Sums of +-values round differently by order: both within 1e-15 of sum(|x|).
        exact = math.fsum(v.double().numpy()[mask.numpy()])
        for row in (compiled, host):
            assert abs(row[SUM] + row[SUM_LO] - exact) <= 1e-15 * float(v.abs().sum())

    def every_form(rows, count):
        values = {f"v{i}": torch.randn(rows, 96, generator=g, dtype=torch.float64 if i % 2
                                       else torch.float32) for i in range(count)}
        values["half"] = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
        mask = torch.rand(rows, 96, generator=g) > 0.4
        ids = torch.arange(rows)
        for located in (False, True):
            got = (located_of(values, mask, ids, compile=True)[0] if located
                   else rows_of(values, mask, compile=True))
            for key, v in values.items():
                check(got[key], summarize(v, mask, compile=False), v, mask)
        each = {key: (v[0], mask[0] if i in (1, 2, 3) else None) for i, (key, v) in
                enumerate(values.items())}  # a row each, under masks of their own
        got = each_of(each, compile=True)
        for key, (v, m) in each.items():
            m = torch.ones_like(v, dtype=torch.bool) if m is None else m
            check(got[key], summarize(v, m, compile=False), v, m)

    every_form(64, 5)  # float32 and float64 values stacked, under one mask and their own
    every_form(65, 2)  # a float64 value alone
    before = counters["stats"]["unique_graphs"]
    assert 1 <= before <= 10  # at most 6 forms of the kernel and 4 located: under dynamo's 8
    for rows, count in ((97, 3), (130, 4), (33, 6)):
        every_form(rows, count)
    assert counters["stats"]["unique_graphs"] == before
    assert not s._compile_failed


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 40),
    dtype_i=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
    with_mask=st.booleans(),
    inject=st.sampled_from(["none", "nan", "inf", "-inf", "max", "all_bad"]),
)
def test_summary_equals_numpy_reference_on_random_masked_data(n, dtype_i, seed, with_mask, inject):
    rng = np.random.default_rng(seed)
    dtype = _DTYPES[dtype_i]
    v = torch.from_numpy(rng.normal(0, 100, n)).to(dtype)
    if n:
        special = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"),
                   "max": float(torch.finfo(dtype).max), "all_bad": float("nan")}.get(inject)
        if special is not None:
            pos = np.arange(n) if inject == "all_bad" else rng.choice(n, size=max(1, n // 4))
            v[torch.from_numpy(np.asarray(pos))] = special
    mask = torch.from_numpy(rng.random(n) < 0.6) if with_mask else None
    row = _host(summarize(v, mask, compile=False))
    x = v.to(torch.float64).numpy()
    valid = np.ones(n, dtype=bool) if mask is None else mask.numpy()
    finite = np.isfinite(x)
    ref = summarize_array(x, valid)
    assert row[COUNT] == ref[COUNT] == np.count_nonzero(valid & finite)
    assert row[NONFINITE] == ref[NONFINITE]
    assert row[MIN] == ref[MIN] and row[MAX] == ref[MAX]
    np.testing.assert_allclose(row[SUM], ref[SUM], rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(row[M2_ROOT], ref[M2_ROOT], rtol=1e-12, atol=1e-9)


def test_values_sharing_a_mask_share_its_preparation():
    mask = torch.rand(50) > 0.5
    a, b = torch.randn(50), torch.randn(50, dtype=torch.float64)
    rows = rows_of({"a": a, "b": b}, mask)
    for key, v in (("a", a), ("b", b)):
        ref = v.to(torch.float64)[mask]
        assert rows[key][SUM].item() == pytest.approx(ref.sum().item(), rel=1e-12)
        assert rows[key][MIN].item() == ref.min().item()


def test_a_mask_is_prepared_once_per_step_and_an_in_place_change_is_noticed():
    from metricsvc.client import MetricClient

    c = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed
    mask = torch.rand(4, 64) > 0.3
    mask[0, :] = True  # flipped below: the count must change by 64
    x, y = torch.randn(4, 64), torch.randn(4, 64)
    c.stat(mask=mask, x=x)
    c.stat(mask=mask, y=y)  # another call, the same mask: its positions are reused
    assert len(c.buffer.masks) == 1
    mask[0, :] = ~mask[0, :]  # changed in place: never the stale positions
    c.stat(mask=mask, z=x)
    assert len(c.buffer.masks) == 2
    rows = merged(c.buffer)
    assert rows["z"][SUM].item() == pytest.approx(x[mask].double().sum().item(), rel=1e-12)
    assert rows["z"][COUNT].item() == mask.sum().item()
    assert rows["x"][COUNT].item() == rows["z"][COUNT].item() + 64


def test_a_masked_call_counts_a_masks_positions_only_where_it_locates_a_sample(monkeypatch):
    """The mask's positions per span of 64 place a located min or max, or a top sample,
    back in its value; a plain masked call (siiRL's data metrics: every step, every mask)
    needs none, and made them anyway: a pass over each mask per step for nothing."""
    import metricsvc.client.host as host
    from metricsvc.client.host import MaskCache
    from metricsvc.core.records import MIN_COL, MIN_ROW

    counted = []
    span_starts = host._span_starts
    monkeypatch.setattr(host, "_span_starts", lambda flat: counted.append(flat.size)
                        or span_starts(flat))
    mask = torch.rand(64, 300, generator=torch.Generator().manual_seed(3)) > 0.3
    values = {"a": torch.randn(64, 300), "b": torch.randn(64, 300, dtype=torch.float64)}
    cache = MaskCache()
    plain = rows_of(values, mask, cache=cache)
    assert counted == []
    located, sources = located_of(values, mask, ids=torch.arange(64), cache=cache)
    assert counted == [mask.numel()]  # once for the mask, then kept
    for key, v in values.items():
        ref = v.double()[mask]
        assert plain[key][SUM].item() == pytest.approx(ref.sum().item(), rel=1e-12)
        assert np.array_equal(np.asarray(plain[key]), np.asarray(located[key]))
        flat = int(np.flatnonzero(mask.numpy().ravel())[int(ref.argmin())])
        assert sources[key][MIN_ROW] == flat // 300 and sources[key][MIN_COL] == flat % 300


def test_threads_recording_masked_tensors_into_one_client_stay_exact():
    import threading

    from metricsvc.client import MetricClient

    c = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed
    g = torch.Generator().manual_seed(3)
    data = {f"t{i}": (torch.randn(64, 256, generator=g),
                      torch.rand(64, 256, generator=g) > 0.4) for i in range(8)}

    def record(keys):
        for _ in range(20):
            for k in keys:
                x, m = data[k]
                c.stat(mask=m, **{k: x})

    threads = [threading.Thread(target=record, args=(list(data)[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    rows = merged(c.buffer)
    for k, (x, m) in data.items():
        row = rows[k]
        ref = x[m].double()
        assert row[COUNT].item() == 20 * ref.numel()
        assert row[SUM].item() == pytest.approx(20 * ref.sum().item(), rel=1e-9)
        assert row[MIN].item() == ref.min().item() and row[MAX].item() == ref.max().item()


@pytest.mark.parametrize("n", [7, 5000, 70_000])  # numpy's small path, torch's, several chunks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_a_difference_is_summarised_exactly_over_the_valid_positions(n, dtype):
    from metricsvc.client.tensors import Difference

    g = torch.Generator().manual_seed(n)
    a = (torch.randn(n, generator=g) * 3 + 1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    mask = torch.rand(n, generator=g) < 0.7
    a[~mask] = float("nan")  # garbage where masked out never matters
    a[int(mask.nonzero()[0])] = float("inf")  # a valid inf is counted, not summed
    rows = rows_of({"res": Difference(a, b), "a": a}, mask)
    ref = summarize_array(a.double().numpy() - b.double().numpy(), mask.numpy())
    row = _host(rows["res"])
    assert row[COUNT] == ref[COUNT] and row[NONFINITE] == ref[NONFINITE] == 1
    assert row[MIN] == ref[MIN] and row[MAX] == ref[MAX]
    np.testing.assert_allclose(row[SUM], ref[SUM], rtol=1e-12)
    np.testing.assert_allclose(row[M2_ROOT], ref[M2_ROOT], rtol=1e-12)
    np.testing.assert_allclose(_host(rows["a"])[SUM],
                               summarize_array(a.double().numpy(), mask.numpy())[SUM], rtol=1e-12)


@pytest.mark.parametrize("n", [64, 1000])  # plain Python floats; numpy, stacked
def test_small_values_of_one_call_are_summarised_together_each_exactly(n):
    g = torch.Generator().manual_seed(5)
    values = {
        "plain": torch.randn(n, generator=g),
        "nan": torch.randn(n, generator=g).index_fill_(0, torch.tensor([3, 9]), float("nan")),
        "huge": torch.full((n,), 1e200, dtype=torch.float64),  # its squares would overflow
        "ints": torch.arange(n),
        "flags": torch.arange(n) % 3 == 0,
        "half": torch.randn(n, generator=g).half(),
        "brain": torch.randn(n, generator=g).bfloat16(),
    }
    rows = rows_of(values)
    for key, v in values.items():
        ref = summarize_array(v.double().numpy())
        row = _host(rows[key])
        assert row[COUNT] == ref[COUNT] and row[NONFINITE] == ref[NONFINITE], key
        assert row[MIN] == ref[MIN] and row[MAX] == ref[MAX], key
        np.testing.assert_allclose(row[SUM], ref[SUM], rtol=1e-12, err_msg=key)
        with np.errstate(over="ignore"):
            np.testing.assert_allclose(row[M2_ROOT], ref[M2_ROOT], rtol=1e-12, err_msg=key)
    assert _host(rows["huge"])[M2_ROOT] == 0.0 and _host(rows["huge"])[NONFINITE] == 0


def test_each_tensor_of_a_call_is_gathered_once_whatever_it_is_recorded_as():
    from torch.overrides import TorchFunctionMode

    from metricsvc.client.tensors import Difference

    class Count(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls, self.whole = [], 0  # whole: numpy views of a whole [64, 1024] tensor

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            self.calls.append(name)
            self.whole += name == "numpy" and args[0].numel() == 64 * 1024
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(1)
    ret, val = torch.randn(64, 1024, generator=g), torch.randn(64, 1024, generator=g)
    mask = torch.rand(64, 1024, generator=g) < 0.5
    with Count() as count:
        rows = rows_of({"returns": ret, "values": val, "target": ret,
                               "residual": Difference(ret, val)}, mask)
    # picked by the bool mask in numpy: a view of the mask, of returns and of values, once
    # each (each tensor's gather read once: 4, 6 with the residual, before it was shared)
    assert count.whole == 3 and "index_select" not in count.calls, count.calls
    # all finite: no passes to find non-finite values, no torch nonzero
    assert "nonzero" not in count.calls and "nan_to_num" not in count.calls
    np.testing.assert_array_equal(_host(rows["target"]), _host(rows["returns"]))
    ref = (ret.double() - val.double())[mask]
    assert _host(rows["residual"])[SUM] == pytest.approx(ref.sum().item(), rel=1e-12)


def _counted_merges(monkeypatch):
    """Count the client's merges: records merged by key (the step's close)."""
    from metricsvc.client import buffer

    merges = []
    real = buffer.merge_grouped
    monkeypatch.setattr(buffer, "merge_grouped",
                        lambda rows, idx, n: merges.append(len(rows)) or real(rows, idx, n))
    return merges


def _exact(row, x):
    """A merged record equals the values' own: count, extremes, the sum within 1e-15 of
    sum(|x|) (the float64 sums of +-values round by order) and the spread to 1e-12."""
    assert row[COUNT] == x.size and row[MIN] == x.min() and row[MAX] == x.max()
    assert abs(row[SUM] + row[SUM_LO] - math.fsum(x)) <= 1e-15 * math.fsum(np.abs(x))
    assert row[M2_ROOT] == pytest.approx(_exact_root(x), rel=1e-12, abs=1e-300)


def test_plain_dicts_recorded_again_in_a_step_merge_once_at_the_close_exactly(monkeypatch):
    """Each micro-batch's dict of plain numbers is kept as it came: recording merges
    nothing, the close merges every key's records in one pass, and each merged record is
    exact against the concatenated values."""
    merges = _counted_merges(monkeypatch)
    rng = np.random.default_rng(11)
    k = 200
    keys = [f"train/group{i % 7}/value_{i}" for i in range(k)]
    scale = 10.0 ** rng.uniform(-150, 150, k)  # far from 0, tiny, huge
    offset = np.where(rng.random(k) < 0.3, 1e12, 0.0)  # means far from 0 next to the spread

    def draw(names):
        out = {}
        for name in names:
            i = keys.index(name)
            x = offset[i] + scale[i] * rng.standard_normal()
            kind = i % 4  # the types a training loop hands over
            out[name] = (float(x), np.float64(x), np.float32(x) if abs(x) < 1e30 else x,
                         int(x) if abs(x) < 1e15 else x)[kind]
        return out

    extra = [f"train/extra_{i}" for i in range(30)]
    keys += extra
    scale, offset = np.concatenate([scale, np.ones(30)]), np.concatenate([offset, np.zeros(30)])
    calls = [draw(keys[:k]) for _ in range(4)]  # the same dict, micro-batch after micro-batch
    calls.append(draw(keys[: k // 2] + extra))  # part of it, with keys new in this step
    calls.append(draw(keys[:k]))
    buf = RecordBuffer()
    for values in calls:
        buf.record(values, None, AUTO)
    assert merges == []  # recording merges nothing
    batch = buf.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    assert merges == [sum(len(c) for c in calls)]  # one merge of every record, at the close
    got = dict(zip(batch.keys, batch.data))
    assert list(got) == keys[:k] + extra  # in the order first recorded
    for key in keys:
        _exact(got[key], np.array([float(c[key]) for c in calls if key in c]))
    assert all(code == AUTO for code in batch.kinds)


def test_host_and_device_micro_batches_merge_once_at_the_close_exactly(monkeypatch):
    """Masked tensors recorded micro-batch after micro-batch, magnitudes far apart, a key
    left out of one: nothing merges while recording (on the accelerator path nothing is
    read back either), the close merges once, exact against the concatenated values, and
    the accelerator path's records are the host path's."""
    merges = _counted_merges(monkeypatch)
    g = torch.Generator().manual_seed(5)
    keys = ["actor/kl", "actor/ratio", "actor/entropy", "actor/pg_loss"]
    dtypes = (torch.float32, torch.bfloat16, torch.float64, torch.float16)
    scale, offset = (1e30, 1e-20, 1.0, 1e2), (0.0, 0.0, 1e12, 0.0)  # huge, tiny, far from 0
    calls = []
    for micro in range(5):  # unequal micro-batches, magnitudes far apart, a key left out
        rows = 3 + 2 * micro
        mask = torch.rand(rows, 40, generator=g) < 0.6
        values = {k: (torch.randn(rows, 40, generator=g, dtype=torch.float64) * scale[i]
                      + offset[i]).to(dtypes[i]) for i, k in enumerate(keys)
                  if not (micro == 3 and i == 1)}
        calls.append((values, mask))
    buf = RecordBuffer()
    for values, mask in calls:
        buf.record(values, mask, ReduceType.AVG_MIN_MAX)
    assert merges == []
    got = merged(buf)
    assert len(merges) == 1
    for key in keys:
        parts = [(v[key].double().numpy(), m.numpy()) for v, m in calls if key in v]
        _exact(got[key], np.concatenate([v[m] for v, m in parts]))
    with accelerator_path_on_cpu(), HostTransferCounter() as counter:
        for values, mask in calls:
            buf.record(values, mask, ReduceType.AVG_MIN_MAX)
        assert counter.calls == [] and len(merges) == 1
        device = buf.take_batch(step=1, rank=0, world_size=1, seq=1, final=True)
    assert buf.host_copies == 1  # the close's one copy of the device rows
    for key, row in zip(device.keys, device.data):
        assert row[COUNT] == got[key][COUNT] and row[MIN] == got[key][MIN]
        assert row[MAX] == got[key][MAX]
        assert row[SUM] + row[SUM_LO] == pytest.approx(got[key][SUM] + got[key][SUM_LO],
                                                       rel=1e-15, abs=1e-300)


class _DataOps(torch.overrides.TorchFunctionMode):
    """Counts torch calls that launch work (what a device pays per kernel), not views."""

    VIEWS = {"__get__", "reshape", "unsqueeze", "squeeze", "numel", "dim", "is_floating_point",
             "unbind", "__getitem__", "detach", "size", "__len__", "device", "dtype"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in self.VIEWS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _accelerator_values(g, k, shape=(24, 40)):
    values = {f"v{i}": torch.randn(*shape, generator=g) * 10.0 ** (i - 2) for i in range(k)}
    values["v0"].view(-1)[3] = float("nan")
    values["v1"].view(-1)[5] = float("inf")
    return values


@pytest.mark.parametrize("locate", [False, True])
def test_values_of_one_call_on_an_accelerator_take_the_kernels_of_one_and_the_same_rows(
        locate):
    """On a device a call's values of one dtype and shape are summarised stacked: the
    launches of one value for all of them (a launch costs a device more than its work
    on a batch's tensors), and each row (and where its min and max lie) what the value
    summarised alone gives."""
    from tests.helpers import located_of

    g = torch.Generator().manual_seed(5)
    mask = torch.rand(24, 40, generator=g) < 0.7
    ids = torch.arange(24) + 100

    def run(values):
        with accelerator_path_on_cpu(), torch.no_grad(), _DataOps() as ops:
            if locate:
                rows, sources = located_of(values, mask, ids)
            else:
                rows, sources = rows_of(values, mask), {}
        return rows, sources, ops.calls

    values = _accelerator_values(g, 8)
    rows, sources, calls = run(values)
    for key, value in values.items():
        alone, alone_sources, one = run({key: value})
        np.testing.assert_allclose(rows[key].numpy(), alone[key].numpy(), rtol=1e-15,
                                   atol=0, err_msg=key)
        if locate:
            np.testing.assert_array_equal(sources[key].numpy(), alone_sources[key].numpy())
    # + the stack of the values (and, located, of where their min and max lie)
    assert len(calls) <= len(one) + 1 + locate, (len(calls), len(one))
    valid = [v.double().numpy()[mask.numpy()] for v in values.values()]
    for key, v in zip(values, valid):
        v = v[np.isfinite(v)]
        assert rows[key][COUNT] == v.size and rows[key][MIN] == v.min()
        np.testing.assert_allclose(rows[key][SUM] + rows[key][SUM_LO], math.fsum(v),
                                   rtol=1e-15)


def test_a_calls_device_values_group_by_dtype_and_length_and_large_ones_in_bounded_stacks(
        monkeypatch):
    """Values of other dtypes or lengths are summarised apart; a stack holds at most
    STACK_MAX values (the float64 scratch of a kernel stays bounded): the rows are each
    value's alone either way."""
    import importlib

    device = importlib.import_module("metricsvc.client.device")
    g = torch.Generator().manual_seed(6)
    values = {**_accelerator_values(g, 5),
              "half": torch.randn(24, 40, generator=g).to(torch.bfloat16),
              "ints": torch.randint(-5, 5, (24, 40), generator=g),
              "flags": torch.rand(24, 40, generator=g) < 0.5}
    mask = torch.rand(24, 40, generator=g) < 0.6
    with accelerator_path_on_cpu():
        whole = rows_of(values, mask)
        monkeypatch.setattr(device, "STACK_MAX", 2 * 24 * 40)  # two values per stack
        bounded = rows_of(values, mask)
        alone = {key: rows_of({key: v}, mask)[key] for key, v in values.items()}
    for key in values:
        for rows in (whole, bounded):
            np.testing.assert_allclose(rows[key].numpy(), alone[key].numpy(), rtol=1e-15,
                                       atol=0, err_msg=key)


def test_keys_recorded_again_on_an_accelerator_merge_with_the_kernels_of_one_merge():
    """A call's keys recorded again in the step (micro-batches) merge on the device in one
    stacked merge, whatever their number: the records those of the whole data."""
    g = torch.Generator().manual_seed(8)
    micro = [(_accelerator_values(g, 8), torch.rand(24, 40, generator=g) < 0.7)
             for _ in range(2)]

    def again(keys):
        buf = RecordBuffer()
        with accelerator_path_on_cpu(), torch.no_grad():
            values, mask = micro[0]
            buf.record({k: values[k] for k in keys}, mask, ReduceType.AVG_MIN_MAX)
            values, mask = micro[1]
            with _DataOps() as ops:
                buf.record({k: values[k] for k in keys}, mask, ReduceType.AVG_MIN_MAX)
        return buf, ops.calls

    buf, calls = again(list(micro[0][0]))
    _, one = again(["v0"])
    assert len(calls) <= len(one) + 3, (len(calls), len(one))  # + the stacks of the rows
    batch = buf.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    for key, row in zip(batch.keys, batch.data):
        v = np.concatenate([vals[key].double().numpy()[m.numpy()] for vals, m in micro])
        v = v[np.isfinite(v)]
        assert row[COUNT] == v.size and row[MIN] == v.min() and row[MAX] == v.max(), key
        np.testing.assert_allclose(row[SUM] + row[SUM_LO], math.fsum(v), rtol=1e-15)


def test_single_numbers_on_an_accelerator_are_their_own_rows_in_a_few_launches():
    """Values of one number each (a loss, a token count as a 0-d device tensor) are rows in
    a handful of whole-tensor ops, whatever their count: the same rows as the host's, with
    a masked-out or non-finite number the empty record (counted when not finite)."""
    import importlib

    device = importlib.import_module("metricsvc.client.device")
    values = {"loss": torch.tensor(0.25), "tokens": torch.tensor([512.0]),
              "nan": torch.tensor(float("nan")), "inf": torch.tensor([float("inf")]),
              "neg": torch.tensor(-3.5, dtype=torch.float64), "int": torch.tensor(7)}
    host = rows_of(values)
    with accelerator_path_on_cpu(), torch.no_grad(), _DataOps() as ops:
        on_device = rows_of(values)
    for key, row in on_device.items():
        np.testing.assert_array_equal(row.numpy(), np.asarray(host[key]), err_msg=key)
    assert len(ops.calls) <= 30, ops.calls  # few launches, not ~150 per group
    masked = torch.tensor([False])
    with accelerator_path_on_cpu():
        row = rows_of({"x": torch.tensor([2.0])}, masked)["x"]
        eager = device._MaskPack(masked, torch.tensor([[2.0]])).row(torch.tensor([[2.0]]))[0]
    np.testing.assert_array_equal(row.numpy(), eager.numpy())
    assert row[COUNT] == 0 and row[MIN] == math.inf
