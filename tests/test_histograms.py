"""Merged distributions where people look at them: every QUANTILES key's buckets, merged over
ranks, read back from the journal, TensorBoard, wandb and SwanLab files and compared with a
histogram of the concatenated data."""

from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from metricsvc.client import MetricClient
from metricsvc.core.sketch import SketchSpec, histogram, sparse_counts
from metricsvc.storage.journal import read_journal
from tests import readback


def _check(name, got, data):
    """``got`` = (edges, counts) read back; each bin holds exactly the values of the data
    between its edges (the edges are sketch-bucket boundaries: the histogram is exact at
    them, which is within the sketch's 1% relative accuracy of any value)."""
    edges, counts = np.asarray(got[0], dtype=float), np.asarray(got[1], dtype=float)
    assert np.all(np.diff(edges) > 0), name
    assert edges[0] == data.min() and edges[-1] == pytest.approx(data.max(), rel=1e-15), name
    assert counts.sum() == data.size, name
    np.testing.assert_array_equal(counts, np.histogram(data, edges)[0], err_msg=name)


@pytest.mark.slow
def test_merged_histograms_read_back_from_every_backend_equal_the_whole_data(make_worker):
    handle, cfg = make_worker(sinks={"jsonl": {}, "tensorboard": {}, "wandb": {},
                                     "swanlab": {}})
    world, steps = 2, 2
    clients = [MetricClient(None, rank=r, world_size=world, name=cfg.name) for r in range(world)]
    rng = np.random.default_rng(7)
    whole = {}
    for step in range(steps):
        parts = {"rollout/latency_s": [], "reward": []}
        for rank, c in enumerate(clients):
            for micro in range(1 + rank):  # unequal calls and sizes per rank
                n = 300 * (rank + 1) + 17 * micro
                lat = torch.from_numpy(rng.lognormal(-1, 0.8, n)).float()
                mask = torch.from_numpy(rng.random(n) < 0.8)
                c.stat(mask=mask, reduce="quantiles", **{"rollout/latency_s": lat})
                parts["rollout/latency_s"].append(lat.double().numpy()[mask.numpy()])
                reward = rng.normal(0.2 * step, 1.0, 50 + 40 * rank)  # float64, both signs
                c.stat(reduce="quantiles", reward=reward)
                parts["reward"].append(reward)
            c.wait_submit()
        whole[step] = {k: np.concatenate(v) for k, v in parts.items()}
    health = ray.get(handle.close.remote())
    assert not health["sink_errors"], health["sink_errors"]
    run = Path(health["run_dir"])

    journal = {r["step"]: r["meta"]["histograms"] for r in read_journal(run / "metrics.jsonl")}
    backends = {
        "journal": {s: {k: (h["edges"], h["counts"]) for k, h in hs.items()}
                    for s, hs in journal.items()},
        "tensorboard": readback.tensorboard_histograms(run / "tensorboard"),
        "wandb": readback.wandb_histograms(run),
        "swanlab": readback.swanlab_histograms(run / "swanlab"),
    }
    for backend, steps_read in backends.items():
        assert sorted(steps_read) == list(range(steps)), backend
        for step, keys in steps_read.items():
            assert set(keys) == {"rollout/latency_s", "reward"}, (backend, step)
            for key, got in keys.items():
                _check(f"{backend} step {step} {key}", got, whole[step][key])
    meta = journal[0]["reward"]  # the exact moments travel with the buckets
    assert meta["count"] == whole[0]["reward"].size
    assert meta["sum"] == pytest.approx(whole[0]["reward"].sum(), rel=1e-12)


def test_a_histogram_has_at_most_its_bins_and_folds_whole_buckets():
    spec = SketchSpec()
    data = np.concatenate([np.random.default_rng(1).normal(0, 3, 4000), np.zeros(5)])
    codes, counts = sparse_counts(data, spec)
    for bins in (1, 7, 64, 100_000):
        edges, got = histogram(codes, counts, spec, data.min(), data.max(), bins)
        assert len(got) == min(bins, len(codes))
        np.testing.assert_array_equal(got, np.histogram(data, edges)[0])
    single = histogram(*sparse_counts(np.array([2.5]), spec), spec,
                       2.5, 2.5)
    assert single[0][0] == 2.5 < single[0][1] and list(single[1]) == [1.0]
    assert histogram(np.zeros(0, np.int32), np.zeros(0), spec, 0.0, 0.0) is None
