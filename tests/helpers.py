"""Test helpers: a DAG-worker actor that drives a MetricClient inside Ray, the models and
builders tests share, and a service's merge without Ray (``LocalService``)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray

from metricsvc.client import MetricClient


@ray.remote(num_cpus=0)
class RankActor:
    """A stand-in for a training DAG worker: records what it is told and flushes."""

    def __init__(self, worker_name: str, rank: int, world_size: int, **kwargs: Any) -> None:
        self.client = MetricClient(None, rank=rank, world_size=world_size, name=worker_name,
                                   **kwargs)

    def run(self, calls: list[tuple[str, tuple, dict]], flush: bool = True) -> dict:
        """Apply ``(method, args, kwargs)`` calls to the client, then ``wait_submit``."""
        for method, args, kwargs in calls:
            getattr(self.client, method)(*args, **kwargs)
        ack = self.client.wait_submit() if flush else None
        return {"ack": ack, "step": self.client.step, "rpc": self.client.rpc_count,
                "host_copies": self.client.host_copies}

    def reset(self, worker_name: str, rank: int, world_size: int, **kwargs: Any) -> None:
        """Become a fresh rank of another service: a pooled actor (``pooled_ranks``) keeps
        its process, and the torch it imported, from one test to the next."""
        self.client = MetricClient(None, rank=rank, world_size=world_size, name=worker_name,
                                   **kwargs)

    def node_id(self) -> str:
        """Return the id of the Ray node this rank runs on."""
        return ray.get_runtime_context().get_node_id()

    def wait_final_res(self, step=None, timeout=None) -> dict:
        return self.client.wait_final_res(step, timeout)


def merge_two(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row ``i`` of two record matrices of one shape merged, by the product's one merge
    (``records.merge_grouped``)."""
    from metricsvc.core.records import merge_grouped

    n = len(a)
    return merge_grouped(np.concatenate([a, b]), np.tile(np.arange(n), 2), n)


def random_rank_data(seed: int, ranks: int, width: int = 7) -> list[dict[str, np.ndarray]]:
    """Return per-rank arrays with unequal batch sizes and random masks."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(ranks):
        rows = int(rng.integers(1, 9)) * (r + 1)
        out.append(
            {
                "values": rng.normal(loc=r, scale=1 + r, size=(rows, width)),
                "mask": rng.random((rows, width)) < 0.6,
                "scores": rng.uniform(-3, 3, size=rows),
            }
        )
    return out


def wait_for_new_incarnation(handle: Any, epoch: str, deadline_s: float = 60.0) -> dict:
    """Wait (at most ``deadline_s``) until Ray has restarted the actor; return its health."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            health = ray.get(handle.health.remote(), timeout=max(0.1, deadline - time.monotonic()))
            if health["epoch"] != epoch:
                return health
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.1)
    raise TimeoutError(f"the actor did not come back within {deadline_s} s")


def sigkill(handle):
    """SIGKILL the actor's process; return the next incarnation's health once it serves."""
    health = ray.get(handle.health.remote(), timeout=60)
    os.kill(health["pid"], signal.SIGKILL)
    return wait_for_new_incarnation(handle, health["epoch"])


def crash(handle) -> None:
    """End the actor for good, as a crashed job's service ends; return once its process is
    gone (the run folder's lock with it)."""
    pid = ray.get(handle.health.remote(), timeout=60)["pid"]
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the actor's process {pid} outlived ray.kill by 30 s")


def until_named(names: list[str], namespace: str, held: bool, failure: str,
                deadline_s: float = 30.0) -> None:
    """Wait until Ray holds (``held``) or has let go of every actor name in ``names``;
    fail with ``failure`` and the names left after ``deadline_s``."""
    def named(name: str) -> bool:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return False
        return True

    give_up = time.monotonic() + deadline_s
    left = [n for n in names if named(n) != held]
    while left:
        assert time.monotonic() < give_up, f"{failure}: {left}"
        time.sleep(0.05)
        left = [n for n in left if named(n) != held]


_POOL: list[Any] = []  # this session's RankActors that tests borrow (never killed)


def pooled_ranks(worker_name: str, count: int, **kwargs: Any) -> list[Any]:
    """Return ``count`` RankActors, ranks 0 to ``count - 1``, each a fresh client of
    ``worker_name`` (of a world of ``count`` ranks unless ``world_size=`` says more),
    reusing the session's: starting a rank's process (and importing torch there) costs more
    than most tests. A rank a test kills or places on a node is one of its own."""
    world_size = kwargs.pop("world_size", count)
    while len(_POOL) < count:
        _POOL.append(RankActor.remote(worker_name, len(_POOL), world_size, **kwargs))
    ranks = _POOL[:count]
    ray.get([a.reset.remote(worker_name, r, world_size, **kwargs) for r, a in enumerate(ranks)],
            timeout=120)
    return ranks


# Driver scripts run beside each other, at most this many at once: each is a Python process
# with Ray (and often torch) to import and a driver to connect, and on two cores eleven at
# once cost ~15% more CPU than three at a time, for no shorter wall time (test_docs, measured
# in pairs: 61.8-67.3 against 52.7-55.9 busy CPU-s).
AT_ONCE = 3


def run_scripts(commands: Mapping[str, tuple[list[str], dict[str, Any]]],
                timeout_s: float) -> dict[str, tuple[int, str, str]]:
    """Run ``{name: (argv, Popen keyword arguments)}``, ``AT_ONCE`` at a time, in order;
    return ``{name: (returncode, stdout, stderr)}``. One that runs past ``timeout_s`` is
    killed, and its stderr says so."""
    waiting, running, done = list(commands.items()), [], {}
    while waiting or running:
        while waiting and len(running) < AT_ONCE:
            name, (argv, kwargs) = waiting.pop(0)
            running.append((name, subprocess.Popen(argv, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True,
                                                   **kwargs)))
        name, proc = running.pop(0)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\n(timed out after {timeout_s} s)"
        done[name] = (proc.returncode, out, err)
    return done


# -- a call's records, read through the client's one summary entry ---------------------------
def located_of(values: Mapping[str, Any], mask: Any = None, ids: Any = None,
               **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({key: record row}, {key: where its min and max came from})`` of one call's values
    (``summarize_call``), each row where it lives; sources only with ``ids``."""
    from metricsvc.client.summaries import summarize_call

    rows, sources = {}, {}
    for found in summarize_call(values, mask, ids=ids, **kwargs):
        for i, key in enumerate(found.keys):
            rows[key] = found.rows[i]
            if found.sources is not None:
                sources[key] = found.sources[i]
    return {key: rows[key] for key in values}, sources


def rows_of(values: Mapping[str, Any], mask: Any = None, **kwargs: Any) -> dict[str, Any]:
    """``{key: record row}`` of one call's values (``summarize_call``)."""
    return located_of(values, mask, **kwargs)[0]


def each_of(values: Mapping[str, tuple[Any, Any]], **kwargs: Any) -> dict[str, Any]:
    """``{key: record row}`` of ``{key: (value, its mask)}`` (what ``stat_each`` records)."""
    return rows_of({k: v for k, (v, _) in values.items()},
                   masks={k: m for k, (_, m) in values.items()}, **kwargs)


def merged(buffer: Any) -> dict[str, Any]:
    """``{key: merged record}`` of what a client's buffer holds (closing it as step 0)."""
    batch = buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    return dict(zip(batch.keys, batch.data))


def summed_batch(rank: int, derived: bytes, step: int = 0, **values: Any) -> Any:
    """Rank ``rank``'s final batch of ``step`` (of two ranks) without a client: each of
    ``values`` (numbers) one SUM record, with the declarations ``derived`` (wire form)."""
    from metricsvc.core import records
    from metricsvc.core.reduce import ReduceType
    from metricsvc.core.wire import Batch

    keys = list(values)
    data = np.stack([records.summarize_array(np.asarray(v, dtype=float))
                     for v in values.values()])
    return Batch.build(step=step, rank=rank, world_size=2, seq=step, final=True, keys=keys,
                       data=data, kinds=[int(ReduceType.SUM)] * len(keys),
                       expected=[0] * len(keys), derived=derived)


class Logged(logging.Handler):
    """The transport's warnings while in the ``with`` block: ``said``, and ``heard`` set
    at each."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.said, self.heard = [], threading.Event()
        self.logger = logging.getLogger("metricsvc.transport")

    def emit(self, record):
        self.said.append(record.getMessage())
        self.heard.set()

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


# -- a rank's calls against a plain model of which records belong to which step ----------
KEYS = ("a", "b", "c/sum")  # two stat(reduce="sum") keys and a plain one (a sum by its name)
STEPS = (None, -2, -1, 0, 1, 2)  # a close names no step, or one relative to the open step


class Rank:
    """The model: the open step, the last closed, whether the open step is the caller's
    (False after a discard or a refused close: the next step named is taken), the sums
    recorded since the last close and how many recordings of each key (the next one's call
    number), and what each closed step holds."""

    def __init__(self, start: int) -> None:
        self.open, self.last_closed, self.known = start, None, True
        self.pending: dict[str, int] = {}
        self.recorded: dict[str, int] = {}
        self.published: dict[int, dict[str, int]] = {}

    def name(self, step: int) -> bool:
        """Move to ``step``; True if the close is refused (its records then dropped)."""
        if step == self.open:
            return False
        if (self.last_closed is not None and step <= self.last_closed) or (
                self.known and self.pending):
            self.drop()
            return True
        self.open = step
        return False

    def drop(self) -> None:
        """A discard or a refused close: the records since the last close are gone, and the
        next step named is taken."""
        self.pending, self.recorded, self.known = {}, {}, False

    def record(self, key: str, value: int) -> None:
        self.pending[key] = self.pending.get(key, 0) + value
        self.recorded[key] = self.recorded.get(key, 0) + 1

    def close(self) -> None:
        self.published[self.open] = dict(self.pending)
        self.last_closed, self.open, self.known = self.open, self.open + 1, True
        self.pending, self.recorded = {}, {}


# -- a service's merge without Ray ---------------------------------------------------------
class LocalService:
    """What a MetricWorker of this config merges, without Ray: the engine the actor builds
    from it (``Config.merge_options``), fed each rank's closed step as the wire's bytes, as
    the actor's intake is. For tests of what ranks record and how it merges; what needs
    the actor (delivery, acks, refusals reaching the rank, sinks) is tested through it."""

    def __init__(self, **config: Any) -> None:
        import metricsvc
        from metricsvc.service.engine import Engine

        self.engine = Engine(**metricsvc.load_config({"name": "local", **config})
                             .merge_options())
        self.results: dict[int, dict[str, Any]] = {}
        self._clients: list[MetricClient] = []

    def clients(self, world_size: int) -> list[MetricClient]:
        """This service's ranks, one client each, the same from step to step; they never
        contact a service (their closes go to ``close``)."""
        if len(self._clients) != world_size:
            self._clients = [MetricClient(None, rank=r, world_size=world_size,
                                          name="never-contacted") for r in range(world_size)]
        return self._clients

    def close(self, *clients: MetricClient, step: int | None = None) -> None:
        """Close each client's open step (as ``wait_submit(step=)`` does) and merge it."""
        from metricsvc.core.wire import encode

        for client in clients:
            batch = client.cursor.close(step, "wait_submit")
            for result in self.engine.submit(encode(batch)).finished:
                self.results[result.step] = {"step": result.step, "metrics": result.metrics,
                                             "meta": result.meta}

    def final(self, step: int = 0) -> dict[str, Any]:
        """The finished step, as the actor's ``wait_final`` returns it."""
        return self.results[step]
