"""Quantile sketches: exact merges in any order, alpha-accurate quantiles, device == host."""

import numpy as np
import pytest
import torch

from metricsvc.client.summaries import sketch
from metricsvc.client.tensors import accelerator_path_on_cpu
from metricsvc.core.sketch import (
    SketchSpec,
    dense_counts,
    merge_sparse,
    quantile_name,
    quantiles,
    sparse_counts,
)

SPEC = SketchSpec()
QS = (0.5, 0.9, 0.99)


def distributions():
    rng = np.random.default_rng(42)
    return {
        "normal": rng.normal(3.0, 1.0, 40_000),
        "lognormal": rng.lognormal(0.0, 1.5, 40_000),
        "heavy_tailed": rng.standard_t(1.5, 40_000) * 10,
        "with_negatives": rng.normal(-2.0, 5.0, 40_000),
    }


@pytest.mark.parametrize("name", list(distributions()))
def test_quantiles_merged_over_8_ranks_equal_one_sketch_and_are_alpha_accurate(name):
    x = distributions()[name]
    rng = np.random.default_rng(1)
    cuts = np.sort(rng.choice(np.arange(1, x.size), size=7, replace=False))
    parts = np.split(x, cuts)  # 8 ranks with unequal shares
    sparse = [sparse_counts(p, SPEC) for p in parts]
    order = rng.permutation(8)
    merged = merge_sparse([sparse[i] for i in order])
    single = sparse_counts(x, SPEC)
    np.testing.assert_array_equal(merged[0], single[0])
    np.testing.assert_array_equal(merged[1], single[1])
    got = quantiles(*merged, QS, SPEC, x.min(), x.max())
    for q, value in zip(QS, got):
        for method in ("lower", "linear"):
            exact = np.quantile(x, q, method=method)
            assert abs(value - exact) <= SPEC.alpha * abs(exact) * 1.001, (name, q, method)


def test_zero_has_its_own_bucket_and_tiny_values_keep_their_magnitude():
    x = np.array([0.0, 0.0, 4e-12, -1e-12, 5.0])
    codes, counts = sparse_counts(x, SPEC)
    assert dict(zip(codes.tolist(), counts.tolist()))[0] == 2.0
    assert quantiles(codes, counts, (0.0, 0.25, 0.5, 0.75, 1.0), SPEC, x.min(), x.max()) == (
        pytest.approx([-1e-12, 0.0, 0.0, 4e-12, 5.0], rel=SPEC.alpha))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_device_sketch_equals_host_sketch(dtype):
    g = torch.Generator().manual_seed(0)
    v = (torch.randn(300, generator=g) * 100).to(dtype)
    v[::7] = 0.0
    mask = torch.rand(300, generator=g) > 0.3
    with accelerator_path_on_cpu():  # the dense device layout, filled by searchsorted
        dev = sketch(v, mask, SPEC).numpy()
    host = dense_counts(v.to(torch.float64).numpy()[mask.numpy()], SPEC)
    np.testing.assert_array_equal(dev, host)


def test_device_sketch_ignores_masked_out_and_nonfinite_values():
    v = torch.tensor([1.0, float("nan"), float("inf"), 2.0, 1e30])
    mask = torch.tensor([True, True, True, True, False])
    with accelerator_path_on_cpu():
        assert sketch(v, mask, SPEC).sum().item() == 2.0
    assert sketch(v, mask, SPEC)[1].sum() == 2.0  # the host path: sparse


def test_empty_sketch_has_no_quantiles_and_names_are_readable():
    codes, counts = merge_sparse([])
    assert quantiles(codes, counts, QS, SPEC) is None
    assert [quantile_name(q) for q in (0.5, 0.9, 0.99, 0.999)] == ["p50", "p90", "p99", "p99.9"]


def test_sketch_spec_checks_its_parameters():
    with pytest.raises(ValueError, match="alpha must be in"):
        SketchSpec(alpha=1.5)
    with pytest.raises(ValueError, match="alpha must be in"):
        SketchSpec(alpha=1e-4)  # its dense device layout would pass 100 MB a key
