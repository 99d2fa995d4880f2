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

# A driver a test starts in a child process (examples, README blocks) must get a Ray of its
# own, as on a user's machine, not join the session's cluster: ``ray.init()`` joins a
# running cluster it finds unless RAY_ADDRESS says "local". Set before any test module
# copies the environment; the session's own driver names its cluster's address.
os.environ["RAY_ADDRESS"] = "local"


# The session's cluster: a head and these raylet nodes, each with a custom resource of its
# name so a test can place ranks per node (``RankActor.options(resources={"node_a": 1})``).
NODES = ("node_a", "node_b")


@pytest.fixture(scope="session")
def ray_cluster():
    """Start a real multi-node Ray cluster on this machine (Ray's own ``Cluster``: a head
    and two more raylets) for the whole session; yield it (tests may add and remove nodes)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 4, "include_dashboard": False})
    for name in NODES:
        cluster.add_node(num_cpus=2, resources={name: 1000})
    cluster.wait_for_nodes()
    ray.init(
        address=cluster.address,
        namespace="metricsvc-tests",
        log_to_driver=False,
        configure_logging=False,
    )
    yield cluster
    ray.shutdown()
    cluster.shutdown()


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
