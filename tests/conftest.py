"""Shared fixtures: one real local Ray cluster per session, fresh named actors per test."""

from __future__ import annotations

import fcntl
import gc
import itertools
import json
import os
import shutil
import tempfile
import time

import pytest
import ray
from hypothesis import settings

import metricsvc

# CI replays the same examples each run (a landing must not hinge on a lucky draw);
# local runs draw new ones, so fuzzing keeps finding what CI would not.
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile("ci" if os.environ.get("CI") else "default")

_names = itertools.count()

# A driver a test starts in a child process gets a Ray of its own, as on a machine with no
# cluster running: ``ray.init()`` joins a running cluster it finds unless RAY_ADDRESS says
# "local". Tests whose subject is not starting Ray (examples, README blocks) pass the
# session cluster's address instead (``joined_env``): the same scripts, on a cluster that
# is already up. Set before any test module copies the environment.
os.environ["RAY_ADDRESS"] = "local"


# The session's cluster: a head and these raylet nodes, each with a custom resource of its
# name so a test can place ranks per node (``RankActor.options(resources={"node_a": 1})``).
NODES = ("node_a", "node_b")


METRICS_PORTS: list[int] = []  # each node's Prometheus export, once the cluster runs


def ephemeral_ports() -> range:
    """The ports the kernel hands out for outgoing connections (Linux's
    ``ip_local_port_range``; IANA's range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except OSError:
        low, high = 49152, 65535
    return range(low, high + 1)


def _free_ports(n: int) -> list[int]:
    """``n`` ports free now, below the kernel's ephemeral range and above Ray's worker
    ports (10002-19999): a port chosen now is bound seconds later, by each node's metrics
    agent, and one from the ephemeral range could meanwhile be handed to one of the
    connections Ray opens as it starts (a node's agent then failed to bind, the node died
    with it, and every test of the run errored)."""
    import random
    import socket

    low = ephemeral_ports().start
    candidates = random.sample(range(20000, low), k=min(200, low - 20000)) \
        if low - 20000 >= 10 * n else []
    ports = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    sockets = [socket.socket() for _ in range(n)]  # no room below the range: the kernel's
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _token_auth() -> None:
    """Ray's default: token authentication, turned on (and a token made where the machine
    has none) by Ray's own functions, as ``ray.init()`` does for a cluster it starts;
    ``Cluster`` does not by itself. Child drivers inherit RAY_AUTH_MODE from here."""
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )

    enable_token_auth_by_default()
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)


def _start_cluster(ports: list[int] | None = None):
    """Start a real multi-node Ray cluster on this machine (Ray's own ``Cluster``: a head
    and two more raylets) and return it."""
    from ray.cluster_utils import Cluster

    _token_auth()
    # Each node's metrics agent serves Ray's Prometheus export on a port the tests know
    # (METRICS_PORTS), reporting every 2 s (Ray's default: 10 s; every second cost the
    # cluster 5-7 % of a core more than every 10 s, with a dozen actors alive).
    ports = ports or _free_ports(1 + len(NODES))
    METRICS_PORTS[:] = ports
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 4, "include_dashboard": False,
                                      "metrics_export_port": ports[0],
                                      "_system_config": {"metrics_report_interval_ms": 2000}})
    for name, port in zip(NODES, ports[1:]):
        cluster.add_node(num_cpus=2, resources={name: 1000}, metrics_export_port=port)
    cluster.wait_for_nodes()
    return cluster


# ``make test`` runs the tests in three pytest-xdist workers, a file at a time each, on ONE
# cluster: the controlling process starts it, once the workers are started (they inherit
# this variable, collect meanwhile, and wait for the cluster's address in its file), and
# stops it at the end. A cluster per worker on two cores would multiply the CPU that Ray
# itself spends; one shared cluster lets a test that waits leave the cores to the other
# workers' tests.
_SHARED = "METRICSVC_TEST_CLUSTER"
_controller_cluster: list = []
_controller_locks: list[str] = []  # the folder of the lock files between the workers
CLUSTER_START_S = 120  # a worker's wait for the controller's cluster


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "removes_nodes: adds a node to the shared cluster and removes it; runs "
                   "while no test of another worker does (``pytest_runtest_protocol``)")
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        _token_auth()  # before the workers start: they inherit RAY_AUTH_MODE
        locks = tempfile.mkdtemp(prefix="metricsvc-test-locks-")
        os.environ[_SHARED] = json.dumps({"ports": _free_ports(1 + len(NODES)),
                                          "locks": locks})
        _controller_locks.append(locks)


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionstart(session):
    """The controller starts the shared cluster after pytest-xdist has started the workers
    (its own ``pytest_sessionstart``), while they collect; its address, or why it did not
    start, goes to ``cluster.json`` in the locks' folder, written whole."""
    yield
    if not _controller_locks:
        return
    locks = _controller_locks[0]
    try:
        cluster = _start_cluster(json.loads(os.environ[_SHARED])["ports"])
        _controller_cluster.append(cluster)
        found = {"address": cluster.address}
    except Exception as err:  # noqa: BLE001  the workers' tests fail with it
        found = {"error": f"{type(err).__name__}: {err}"}
    with open(os.path.join(locks, "cluster.json.part"), "w") as f:
        json.dump(found, f)
    os.replace(os.path.join(locks, "cluster.json.part"), os.path.join(locks, "cluster.json"))


def _shared_address(locks: str) -> str:
    """The shared cluster's address, once the controller has started it."""
    path = os.path.join(locks, "cluster.json")
    give_up = time.monotonic() + CLUSTER_START_S
    while not os.path.exists(path):
        if time.monotonic() > give_up:
            raise TimeoutError(f"the shared Ray cluster did not start within "
                               f"{CLUSTER_START_S} s")
        time.sleep(0.1)
    with open(path) as f:
        found = json.load(f)
    if "error" in found:
        raise RuntimeError(f"the shared Ray cluster did not start: {found['error']}")
    return found["address"]


# The files that take longest (seconds in `make test`, 2026-12-05), longest first, run
# first, so that the workers end close together: with pytest-xdist's own order (most
# tests first: ``--no-loadscope-reorder`` in the Makefile turns it off) the history model,
# one test of 30 s, ran last, and one worker stood idle for the last 12 s. Only the order
# changes; files not named keep theirs, after these (test_builtin_metrics and test_tracker
# left the list once their merge tests ran without Ray). test_multinode (21 s) is not named:
# its ``removes_nodes`` tests wait for the other workers' tests to end, which among the
# small files after these is short (11 s lost waiting for a 15 s test among the heavy).
HEAVIEST_FIRST = ("test_examples.py", "test_docs.py", "test_history.py", "test_topology.py",
                  "test_worker.py", "test_run_folder.py", "test_history_model.py",
                  "test_sink_backends.py", "test_hostile_ranks.py", "test_cli.py",
                  "test_packaging.py", "test_chaos.py", "test_install.py",
                  "test_observe.py", "test_security.py", "test_sink_restart.py",
                  "test_topology_answers.py", "test_summarize.py", "test_rewind.py",
                  "test_tls.py", "test_flush.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: else as before


def pytest_unconfigure(config):
    while _controller_cluster:
        _controller_cluster.pop().shutdown()
    while _controller_locks:
        shutil.rmtree(_controller_locks.pop(), ignore_errors=True)


# A node a test adds and removes takes down whatever Ray placed on it meanwhile: Ray
# spreads zero-CPU actors (an example's trainers, a per-node service's combiners) over
# every node, and another worker's test lost its actors so ("the actor's node was
# terminated"). Such a test (``removes_nodes``) holds the shared cluster alone: a
# readers-writer lock between the workers, per test, its module fixtures' setup and
# teardown included. The turnstile keeps the tests that share from starving it.
# Taken in the test's setup and let go at the end of its teardown: a wait past the
# deadline (or pytest-timeout's) fails that test by name, where raised from
# ``pytest_runtest_protocol`` it was an internal error of the worker.
_ALONE: list[bool] = [False]  # whether this worker's running test holds the cluster alone
_HELD: list = []  # the lock files this worker's running test holds open
LOCK_DEADLINE_S = 280  # within the test's own limit (pytest-timeout: 300 s)


def _lock(file, mode: int, test: str) -> None:
    """``flock`` with a deadline: a test waiting on another worker's fails with its name."""
    give_up = time.monotonic() + LOCK_DEADLINE_S
    while True:
        try:
            fcntl.flock(file, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > give_up:
                raise TimeoutError(f"{test}: the shared cluster stayed held by another "
                                   f"worker's test for {LOCK_DEADLINE_S} s") from None
            time.sleep(0.05)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    shared = os.environ.get(_SHARED)
    locks = json.loads(shared).get("locks") if shared else None
    if locks:  # else one process: nothing runs beside it
        alone = item.get_closest_marker("removes_nodes") is not None
        turn = open(os.path.join(locks, "turnstile"), "a")
        nodes = open(os.path.join(locks, "nodes"), "a")
        _HELD[:] = [turn, nodes]  # closing a file lets go of its lock
        _lock(turn, fcntl.LOCK_EX, item.nodeid)
        _lock(nodes, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, item.nodeid)
        fcntl.flock(turn, fcntl.LOCK_UN)
        _ALONE[0] = alone
    yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        yield
    finally:
        while _HELD:
            _HELD.pop().close()
        _ALONE[0] = False


def _joined_cluster(address: str):
    """The shared cluster as a worker sees it: its address, and nodes this worker adds and
    removes itself (Ray's ``Cluster`` with the running head in place of one of its own)."""
    from types import SimpleNamespace

    from ray.cluster_utils import Cluster

    class Joined(Cluster):
        def add_node(self, **kwargs):
            if not _ALONE[0]:
                raise RuntimeError("a test that adds a node to the shared cluster must be "
                                   "marked removes_nodes: the node's removal would take "
                                   "other workers' actors placed there with it")
            return super().add_node(**kwargs)

        def wait_for_nodes(self, timeout: float = 30) -> None:
            for node in self.worker_nodes:  # the nodes this worker added (the rest run)
                self._wait_for_node(node, timeout)

    cluster = Joined()
    cluster.head_node = SimpleNamespace(gcs_address=address, redis_address=None)
    return cluster


@pytest.fixture(scope="session")
def ray_cluster(worker_id):
    """The session's real multi-node Ray cluster (a head and two more raylets); yield it
    (tests may add and remove nodes of their own). Each xdist worker has a namespace of its
    own on the shared cluster, so tests' fixed actor names never meet."""
    shared = os.environ.get(_SHARED)
    if shared:
        info = json.loads(shared)
        METRICS_PORTS[:] = info["ports"]
        cluster = _joined_cluster(_shared_address(info["locks"]))
    else:
        cluster = _start_cluster()
    ray.init(
        address=cluster.address,
        namespace=f"metricsvc-tests-{worker_id}",
        log_to_driver=False,
        configure_logging=False,
    )
    yield cluster
    # Dead clients (their Ray references in reference cycles) are freed here, by this
    # thread: one freed by another thread while ray.shutdown() runs ends the process
    # (Ray's "The core worker has already been shutdown"; the worker then "crashed").
    gc.collect()
    ray.shutdown()
    if shared:
        for node in list(cluster.worker_nodes):
            cluster.remove_node(node)
    else:
        cluster.shutdown()


_joined = itertools.count()


@pytest.fixture(scope="session")
def joined_env(ray_cluster):
    """Return ``env(**more)``: this process's environment for a child driver that joins the
    session's running cluster, in a namespace of its own (its services keep their default
    names, as a user's script does, without meeting another test's). The namespace goes
    where a job submitted with ``ray job submit --runtime-env-json`` has it: in the job's
    runtime environment, so that its workers on the cluster see it too."""
    import json

    def env(**more):
        namespace = f"joined-{os.getpid()}-{next(_joined)}"
        job = {"runtime_env": {"env_vars": {"METRICSVC_NAMESPACE": namespace}}}
        return {**os.environ, "RAY_ADDRESS": ray_cluster.address,
                "METRICSVC_NAMESPACE": namespace,
                "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job), **more}

    return env


@pytest.fixture
def make_worker(ray_cluster, tmp_path):
    """Return ``make(**config) -> (handle, config)`` creating a uniquely named MetricWorker."""
    handles, names = [], []

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
        names.append(cfg["name"])
        return handle, metricsvc.load_config(cfg)

    yield make
    from metricsvc.service.combiner import stop_combiners

    for handle in handles:
        ray.kill(handle)
    for name in names:  # per-node combiners: a process each, for the whole session
        stop_combiners(name)
