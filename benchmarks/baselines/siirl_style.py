"""The siiRL MetricWorker pattern, written from scratch for a fair side-by-side.

A rank sends each metrics dict as its own actor call (data, timing, throughput,
custom: four per step). The actor appends every value to a per-key Python list;
when a key has ``world_size`` values it reduces them in Python, choosing the
reduction by substring of the key name (as siiRL does). A round is final when
no key is waiting.
"""

from __future__ import annotations

import asyncio

import numpy as np
import ray


def siirl_kind(name: str) -> str:
    """The reduction siiRL picks for a key: by substring of its name."""
    if "min" in name:
        return "min"
    if "max" in name:
        return "max"
    if "sum" in name or "total" in name:
        return "sum"
    return "mean"


_NUMPY = {"min": np.min, "max": np.max, "sum": np.sum, "mean": np.mean}


def reduce_by_substring(name: str, values: list[float]) -> float:
    return float(_NUMPY[siirl_kind(name)](values))


class ListReducer:
    """Per-key Python lists, each reduced in Python once ``world_size`` values arrived."""

    def __init__(self) -> None:
        self.pending: dict[str, list[float]] = {}
        self.final: dict[str, float] = {}
        self.calls = 0
        self.expect = 1 << 30
        self._done = asyncio.Event()

    def add(self, key: str, value: float, world_size: int) -> None:
        values = self.pending.setdefault(key, [])
        values.append(value)
        if len(values) == world_size:
            self.final[key] = reduce_by_substring(key, self.pending.pop(key))
        if len(self.final) >= self.expect:
            self._done.set()

    async def wait_final_res(self, expect: int) -> dict[str, float]:
        """Wait until ``expect`` keys are reduced (the driver knows how many it asked for)."""
        self.expect = expect
        if len(self.final) >= expect:
            self._done.set()
        await self._done.wait()
        result, self.final = self.final, {}
        self._done.clear()
        return result

    def call_count(self) -> int:
        return self.calls

    def cpu_s(self) -> float:
        """This process's CPU time (as the MetricWorker's ``health()["cpu_s"]``)."""
        import time

        return time.process_time()


@ray.remote(num_cpus=0, max_concurrency=1024)
class SiirlStyleWorker(ListReducer):
    """siiRL's MetricWorker: one call per metrics dict."""

    async def submit_metric(self, metrics: dict[str, float], world_size: int) -> None:
        self.calls += 1
        for key, value in metrics.items():
            self.add(key, value, world_size)


class SiirlStyleClient:
    """A rank: four submit_metric calls per step, then wait for them (siiRL's wait_submit)."""

    def __init__(self, worker, world_size: int) -> None:
        self.worker = worker
        self.world_size = world_size

    def flush(self, metrics: dict[str, float]) -> None:
        keys = list(metrics)
        cut = [0, int(len(keys) * 0.6), int(len(keys) * 0.75), int(len(keys) * 0.85), len(keys)]
        groups = [{k: metrics[k] for k in keys[a:b]} for a, b in zip(cut, cut[1:])]
        ray.get([self.worker.submit_metric.remote(g, self.world_size) for g in groups if g])
