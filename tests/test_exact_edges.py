"""Exact at the edges of float64: the merged std/var/mean of values far from 0, quantiles of
any magnitude, and histogram bins counted as numpy counts them, compared with an exact
(rational) computation on the concatenated data."""

from __future__ import annotations

import math
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from metricsvc.client import MetricClient
from metricsvc.client.summaries import sketch, summarize
from metricsvc.client.tensors import accelerator_path_on_cpu
from metricsvc.core import records
from metricsvc.core.declare import Derived
from metricsvc.core.records import COUNT, M2_ROOT, MAX, MIN, SUM, SUM_LO
from metricsvc.core.sketch import SketchSpec, histogram, merge_sparse, quantiles, sparse_counts
from metricsvc.storage.journal import read_journal
from tests.helpers import merge_two

SPEC = SketchSpec()


def _sqrt(fr: Fraction) -> float:
    """The square root of a non-negative rational, to float64, with no overflow/underflow."""
    a, b = fr.numerator, fr.denominator
    if a == 0:
        return 0.0
    s = (130 + b.bit_length() - a.bit_length()) // 2
    r = math.isqrt((a << (2 * s)) // b) if s >= 0 else math.isqrt(a // (b << (-2 * s)))
    return math.ldexp(float(r), -s)


def exact(values) -> dict[str, float]:
    """sum, mean, population std and unbiased var of float64 values, exactly rounded."""
    x = [Fraction(float(v)) for v in values]
    n = len(x)
    total = sum(x)
    mean = total / n
    m2 = sum((v - mean) ** 2 for v in x)
    return {"sum": float(total), "mean": float(mean), "std": _sqrt(m2 / n),
            "sample_std": _sqrt(m2 / (n - 1)) if n > 1 else math.nan,
            "abs": float(sum(abs(v - mean) for v in x))}


def _close(got: float, want: float, rel: float = 1e-12, abs_: float = 0.0) -> bool:
    return abs(got - want) <= rel * abs(want) + abs_


# -- through the public client API, on a real local Ray cluster --------------------------
OFFSETS = (1e4, 1e8, 1.7e9, 1e12)


def test_merged_std_var_and_mean_of_values_far_from_zero_equal_the_exact_ones(make_worker):
    """1e8 + N(0, 1) gave std 1.414 (numpy 1.006) and 1.7e9 + N(0, 1) gave 0.0 before the
    record carried a stable second moment; now every offset is exact to 1e-12."""
    handle, cfg = make_worker(world_size=2)
    clients = [MetricClient(None, rank=r, world_size=2, name=cfg.name) for r in range(2)]
    rng = np.random.default_rng(11)
    whole = {}
    for step, offset in enumerate(OFFSETS):
        parts = []
        for rank, c in enumerate(clients):
            c.declare(Derived("gap/sd", "sample_std(x)", {"x": "x"}),
                      Derived("gap/var", "var(x)", {"x": "x"}))
            for micro in range(1 + 2 * rank):  # unequal calls and sizes per rank
                n = 40 * (rank + 1) + 7 * micro
                v = offset + rng.normal(size=(n, 3))
                mask = rng.random((n, 3)) < 0.7
                tensor = torch.from_numpy(v) if micro % 2 else v  # host arrays and tensors
                c.stat(mask=mask, reduce="std", x=tensor)
                c.stat(mask=mask, y=tensor)
                parts.append(v[mask])
            c.wait_submit(step=step)
        whole[step] = np.concatenate(parts)
    for step in range(len(OFFSETS)):
        got = ray.get(handle.wait_final_res.remote(step=step, timeout_s=30))
        ref = exact(whole[step])
        assert _close(got["x/std"], ref["std"]), (OFFSETS[step], got["x/std"], ref["std"])
        assert _close(got["gap/sd"], ref["sample_std"]), OFFSETS[step]
        assert _close(got["gap/var"], ref["std"] ** 2, rel=1e-11), OFFSETS[step]
        assert got["y/mean"] == pytest.approx(ref["mean"], rel=1e-15, abs=0), OFFSETS[step]
        assert got["y/min"] == whole[step].min() and got["y/max"] == whole[step].max()


def test_quantiles_of_any_magnitude_and_histogram_edges_as_numpy_counts(make_worker):
    """GPU bytes (1e10), nanoseconds, tiny KL values (1e-12) and negatives: every quantile
    within alpha of the exact one (before: clamped to the minimum outside [1e-9, 1e9]);
    [0.99, 1.0, 1.0, 1.01] is binned [1, 3] as numpy bins it (before: [3, 1])."""
    handle, cfg = make_worker(world_size=2, sinks={"jsonl": {}})
    clients = [MetricClient(None, rank=r, world_size=2, name=cfg.name) for r in range(2)]
    rng = np.random.default_rng(5)
    data = {"mem_bytes": 4e10 * rng.lognormal(0, 0.3, 300), "kl": 4e-12 * rng.lognormal(0, 1, 300),
            "adv": rng.normal(0, 1e-20, 300), "huge": -1e300 * rng.lognormal(0, 2, 300)}
    for rank, c in enumerate(clients):
        part = slice(0, 100) if rank == 0 else slice(100, 300)  # unequal ranks
        c.stat(reduce="quantiles", **{k: v[part] for k, v in data.items()})
        c.stat(reduce="quantiles", edge=np.array([0.99, 1.0] if rank else [1.0, 1.01]))
        c.wait_submit(step=0)
    got = ray.get(handle.wait_final_res.remote(step=0, timeout_s=30))
    for key, values in data.items():
        srt = np.sort(values)
        for q in (0.5, 0.9, 0.99):
            want = srt[math.floor(q * (len(srt) - 1))]
            assert abs(got[f"{key}/p{q * 100:g}"] - want) <= SPEC.alpha * abs(want), (key, q)
    health = ray.get(handle.close.remote())
    assert not health["sink_errors"], health["sink_errors"]
    (row,) = read_journal(Path(health["run_dir"]) / "metrics.jsonl")
    hist = row["meta"]["histograms"]["edge"]
    assert hist["counts"] == np.histogram([0.99, 1.0, 1.0, 1.01], hist["edges"])[0].tolist()
    assert hist["counts"] == [1, 3]


# -- property tests: the client's summaries and the service's merge ----------------------
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.bool)


@st.composite
def ranked_values(draw):
    """Values of one magnitude and offset, split unequally over 1-4 ranks, with masks."""
    dtype = draw(st.sampled_from(DTYPES))
    ranks = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 400)) for _ in range(ranks)]
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    if dtype == torch.bool:
        x = rng.random(n) < 0.3
    elif dtype == torch.int32:
        x = rng.integers(-(2**31), 2**31 - 1, n)
    else:
        wide = dtype == torch.float64
        exp = draw(st.integers(-300, 300) if wide else st.integers(-4, 3))
        spread = 10.0 ** exp
        ratio = 10.0 ** draw(st.integers(0, 12 if wide else 1))  # offset / spread
        x = spread * (ratio * draw(st.sampled_from((-1, 0, 1))) + rng.normal(size=n))
    t = torch.as_tensor(x).to(dtype)
    mask = torch.from_numpy(rng.random(n) < draw(st.sampled_from((0.3, 1.0))))
    mask[0] = True
    t[~torch.isfinite(t.double())] = 0  # past float16's range: the case is about finite data
    return t, mask, sizes


def _ranks(t, mask, sizes, accelerator):
    rows, sketches, start = [], [], 0
    for size in sizes:
        part, m = t[start:start + size], mask[start:start + size]
        start += size
        if accelerator:
            with accelerator_path_on_cpu():
                rows.append(np.asarray(summarize(part, m)))
                dense = sketch(part, m, SPEC).numpy()
            sketches.append((np.flatnonzero(dense) - SPEC.top, dense[dense > 0]))
        else:
            rows.append(np.asarray(summarize(part, m)))
            sketches.append(sketch(part, m, SPEC))
    return np.stack(rows), sketches


@settings(max_examples=120, deadline=None)
@given(case=ranked_values(), accelerator=st.booleans(), order=st.randoms())
def test_merged_sums_means_std_and_quantiles_equal_the_concatenated_data(case, accelerator,
                                                                         order):
    t, mask, sizes = case
    rows, sketches = _ranks(t, mask, sizes, accelerator)
    perm = list(range(len(rows)))
    order.shuffle(perm)
    pairwise = records.identity(1)
    for i in perm:  # one micro-batch at a time, in any order ...
        pairwise = merge_two(pairwise, rows[i][None])
    grouped = records.merge_grouped(rows[perm], np.zeros(len(rows), dtype=np.int64), 1)
    x = t.to(torch.float64).numpy()[mask.numpy()]
    # a sum past float64's range is the flagged overflow case (test_aggregator's), not this
    assume(abs(sum(Fraction(float(v)) for v in x)) <= sys.float_info.max)
    ref = exact(x)
    scale = max(abs(float(x.max())), abs(float(x.min())))
    for row in (pairwise[0], grouped[0]):  # ... and the service's, over every rank at once
        assert row[COUNT] == x.size and row[MIN] == x.min() and row[MAX] == x.max()
        total = row[SUM] + row[SUM_LO]
        assert _close(total, ref["sum"], abs_=1e-15 * ref["abs"]), (total, ref["sum"])
        assert _close(records.mean(row), ref["mean"], abs_=1e-15 * ref["abs"] / x.size)
        std = row[M2_ROOT] / math.sqrt(row[COUNT])
        assert _close(std, ref["std"], abs_=1e-15 * scale), (std, ref["std"])
    codes, counts = merge_sparse(sketches)
    srt = np.sort(x)
    got = quantiles(codes, counts, (0.0, 0.25, 0.5, 0.99, 1.0), SPEC, x.min(), x.max())
    for q, value in zip((0.0, 0.25, 0.5, 0.99, 1.0), got):
        want = srt[math.floor(q * (x.size - 1))]
        assert abs(value - want) <= SPEC.alpha * abs(want) * 1.0001, (q, value, want)


@settings(max_examples=60, deadline=None)
@given(first=st.integers(1, SPEC.top - 40), width=st.integers(1, 30), bins=st.integers(1, 64),
       negative=st.booleans())
def test_values_on_every_exported_edge_are_binned_as_numpy_bins_them(first, width, bins,
                                                                    negative):
    b = SPEC.bounds
    x = np.concatenate([b[first:first + width], b[first:first + width]])  # every boundary
    x = np.concatenate([x, -x]) if negative else x
    codes, counts = sparse_counts(x, SPEC)
    edges, got = histogram(codes, counts, SPEC, float(x.min()), float(x.max()), bins)
    edge_values = np.concatenate([x, edges[(edges > x.min()) & (edges < x.max())]])
    codes, counts = sparse_counts(edge_values, SPEC)  # and values on the exported edges
    edges2, got2 = histogram(codes, counts, SPEC, float(x.min()), float(x.max()), bins)
    for e, c, data in ((edges, got, x), (edges2, got2, edge_values)):
        assert np.all(np.diff(e) >= 0)
        np.testing.assert_array_equal(c, np.histogram(data, e)[0])


@pytest.mark.parametrize(("dtype", "offset", "spread"), [
    (torch.float32, 0.0, 1.0),  # near 0: the one-pass row
    (torch.float32, 3.0, 1.0),
    (torch.float32, 1e4, 1.0),  # far from 0: the centred second pass
    (torch.float64, 1e12, 1.0),
    (torch.float64, -1.7e9, 1e-3),
    (torch.float64, 0.0, 1e-200),  # squares that would underflow
    (torch.float64, 0.0, 1e-310),  # subnormal values (scaling by 2**1074 overflowed)
    (torch.float64, 1e200, 1e190),  # and overflow
])
def test_large_host_rows_merged_over_ranks_are_exact_whichever_pass_they_take(dtype, offset,
                                                                               spread):
    """Large CPU values (over 4096 valid) take the chunked pass; checked in long double."""
    g = torch.Generator().manual_seed(3)
    parts = [(torch.randn(n, generator=g, dtype=torch.float64) * spread + offset).to(dtype)
             for n in (70_000, 150_000, 9_000)]
    masks = [torch.rand(p.shape, generator=g) < 0.8 for p in parts]
    rows = np.stack([np.asarray(summarize(p, m)) for p, m in zip(parts, masks)])
    row = records.merge_grouped(rows, np.zeros(3, dtype=np.int64), 1)[0]
    x = np.concatenate([p.double().numpy()[m.numpy()] for p, m in zip(parts, masks)])
    wide = x.astype(np.longdouble)
    scale = np.longdouble(max(abs(x).max(), 1e-300))
    mean = (wide / scale).sum() / x.size * scale
    std = np.sqrt((((wide - mean) / scale) ** 2).sum() / x.size) * scale
    assert row[COUNT] == x.size
    assert abs(records.mean(row) - mean) <= 1e-12 * abs(mean) + 1e-14 * std
    ulp = 5e-324 * 4  # subnormals carry a few bits: rounding is to their grid
    assert abs(row[M2_ROOT] / math.sqrt(x.size) - std) <= 1e-12 * std + ulp


@pytest.mark.parametrize("values", [
    [0.0, 0, 0, 0, 0, 1, 1e308, -1e308],  # a sum left to right loses the 1 (the fuzz found it)
    [1e308, 1, -1e308, 0, 0, 0, 0, 0],  # numpy's pairwise sum loses it
    [3.0, 1e300, 2.0, -1e300, -5.0, 1e-300, 7.0],
])
def test_a_few_values_whose_huge_terms_cancel_keep_the_exact_sum(values):
    """Sums of a few values (a small CPU tensor, a small array) are exact: huge terms that
    cancel never take the small ones with them. (On an accelerator the sum is the device's
    float64 reduction, as torch's own.)"""
    exact = Fraction(0)
    for v in values:
        exact += Fraction(v)
    want = float(exact / len(values))
    rows = {"torch": summarize(torch.tensor(values, dtype=torch.float64)),
            "numpy": records.summarize_array(np.array(values)),
            "2-d": summarize(torch.tensor(values, dtype=torch.float64)[None])}
    for where, row in rows.items():
        row = np.asarray(row, dtype=np.float64)
        assert records.mean(row) == pytest.approx(want, rel=1e-15), where
        assert row[SUM] + row[SUM_LO] == float(exact), where


def test_a_masks_positions_are_the_same_whether_picked_from_a_kept_arange_or_counted():
    """A mask's valid positions come from a kept ``arange`` up to ``_ARANGE_MAX`` values and
    from ``flatnonzero`` past it: the same positions, so the same rows, either way; a mask
    changed in place is read again, and a larger mask grows the kept arange."""
    from metricsvc.client import host as tensors
    from tests.helpers import rows_of

    g = torch.Generator().manual_seed(7)
    cache = tensors.MaskCache()
    for n in (1000, tensors._ARANGE_MAX + 1, 5000, tensors._ARANGE_MAX):
        x = torch.randn(n, generator=g, dtype=torch.float64) * 1e3 + 7
        mask = torch.rand(n, generator=g) < 0.3
        for _ in range(2):  # the second time: the mask changed in place
            picked = cache.index(mask)
            assert torch.equal(picked, torch.nonzero(mask).reshape(-1)), n
            row = rows_of({"x": x}, mask, cache=cache)["x"]
            kept = x.numpy()[mask.numpy()]
            assert row[COUNT] == kept.size and row[MIN] == kept.min() and row[MAX] == kept.max()
            assert math.isclose(row[SUM] + row[SUM_LO], math.fsum(kept), rel_tol=1e-15)
            mask[: n // 2] = ~mask[: n // 2]
    assert cache._arange.size == tensors._ARANGE_MAX  # grown to the largest mask under it


@pytest.mark.parametrize("numpy_1", [False, True])
def test_a_few_valid_positions_found_by_span_equal_the_masks_every_position(numpy_1,
                                                                            monkeypatch):
    """``MaskCache.positions`` (the mask counted per span of 64, a span's positions made
    when asked for) gives what the index of every valid position gives: masks of sizes
    around the span, dense, sparse, with empty spans, changed in place; and with numpy 1's
    count (no ``bitwise_count``)."""
    from metricsvc.client import host

    if numpy_1:
        monkeypatch.delattr(np, "bitwise_count")
    rng = np.random.default_rng(11)
    cache = host.MaskCache()
    for n in (1, 63, 64, 65, 1000, 3 * 1024 + 5, 100_003):
        for density in (0.001, 0.5, 0.999):
            mask = torch.tensor(rng.random(n) < density)
            if n > 3 * 1024:
                mask[1024:2 * 1024] = False  # a span with none
            for _ in range(2):  # the second time: changed in place, read again
                every = np.flatnonzero(mask.numpy())
                if every.size:
                    at = rng.integers(0, every.size, size=min(50, every.size))
                    np.testing.assert_array_equal(cache.positions(mask, at), every[at])
                mask[: n // 2] = ~mask[: n // 2]
            cache.clear()
    shifted = torch.tensor(rng.random(100_003) < 0.5)[3:]  # a view 3 bytes into its storage
    at = rng.integers(0, int(shifted.sum()), size=50)
    np.testing.assert_array_equal(cache.positions(shifted, at),
                                  np.flatnonzero(shifted.numpy())[at])
