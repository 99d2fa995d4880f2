"""Shared fixtures: one real local Ray cluster per session, fresh named actors per test."""

from __future__ import annotations

import itertools
import os

import pytest
import ray
from hypothesis import settings

import metricsvc

# CI replays the same examples each run (a landing must not hinge on a lucky draw);
# local runs draw new ones, so fuzzing keeps finding what CI would not.
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile("ci" if os.environ.get("CI") else "default")

_names = itertools.count()


@pytest.fixture(scope="session")
def ray_cluster():
    """Start a real local Ray for the whole session."""
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        namespace="metricsvc-tests",
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


@pytest.fixture
def make_worker(ray_cluster, tmp_path):
    """Return ``make(**config) -> (handle, config)`` creating a uniquely named MetricWorker."""
    handles = []

    def make(**overrides):
        n = next(_names)
        cfg = {
            "name": f"mw-{os.getpid()}-{n}",
            "run": {"root": str(tmp_path / "runs"), "experiment": "t", "trial": str(n)},
            "sinks": {"console": {"enabled": False}},
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key] = {**cfg[key], **value}
            else:
                cfg[key] = value
        handle = metricsvc.start_metric_worker(cfg)
        handles.append(handle)
        return handle, metricsvc.load_config(cfg)

    yield make
    for handle in handles:
        ray.kill(handle)
