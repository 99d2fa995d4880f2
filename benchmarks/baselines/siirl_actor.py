"""siiRL's MetricWorker actor path, rebuilt from its public source for a fair side-by-side
(sii-research/siiRL, ``siirl/execution/metric_worker/metric_worker.py`` and ``utils.py``).

Per call, as siiRL's actor does: ``submit_metric`` puts ``(metrics, world_size)`` on an
``asyncio.Queue``; a background loop takes each item and, key by key, wraps the value in a
``Metric`` dataclass, appends it to that key's list, and once the list holds
``world_size`` entries reduces it in Python with the function the key's name selects by
substring (``min`` / ``max`` / ``sum``-or-``total`` / else the mean of
``statistics.mean``), renaming ``timing_s/`` to ``perf/delta_time/``. ``wait_final_res``
stops the loop, drains the queue, reduces whatever is left, restarts the loop and returns
the results. Its one-call pattern: each rank sends all its metrics in one
``submit_metric`` and waits for it (``wait_submit``), then the results are read.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any

import ray

from benchmarks.baselines.siirl_style import siirl_kind


@dataclass
class Metric:
    name: str
    value: Any
    world_size: int


def _values(metrics: list[Metric]) -> list[float]:
    return [v for m in metrics for v in (m.value if isinstance(m.value, list) else [m.value])]


_PYTHON = {"min": min, "max": max, "sum": sum, "mean": statistics.mean}  # siiRL's, in Python


def metric_func(name: str):
    reduce = _PYTHON[siirl_kind(name)]
    return lambda ms: reduce(_values(ms))


@ray.remote(num_cpus=0)
class SiirlActor:
    """siiRL's MetricWorker: a queue, a processing loop, per-key lists of Metric objects."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue | None = None
        self.running = False
        self.task: asyncio.Task | None = None
        self.final: dict[str, float] = {}
        self.working: dict[str, list[Metric]] = {}
        self.calls = 0

    async def start(self) -> None:
        if self.queue is None:
            self.queue = asyncio.Queue()
        if self.running:
            return
        self.running = True
        self.task = asyncio.create_task(self._loop())

    async def submit_metric(self, metric: dict, world_size: int) -> None:
        self.calls += 1
        await self.queue.put((metric, world_size))  # type: ignore[union-attr]

    async def stop(self) -> None:
        self.running = False
        if self.task:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass

    async def _compute(self, name: str, metrics: list[Metric]) -> None:
        result = metric_func(name)(metrics)
        self.working.pop(name)
        if name.startswith("timing_s/"):
            name = name.replace("timing_s/", "perf/delta_time/")
        self.final[name] = result

    async def _parse(self, item: tuple) -> None:
        metric_dict, world_size = item
        for key, value in metric_dict.items():
            metric = Metric(name=key, value=value, world_size=world_size)
            if key in self.working:
                self.working[key].append(metric)
                if len(self.working[key]) == world_size:
                    await self._compute(key, self.working[key])
            else:
                self.working[key] = [metric]

    async def _loop(self) -> None:
        while self.running:
            item = await self.queue.get()  # type: ignore[union-attr]
            await self._parse(item)

    async def wait_final_res(self) -> dict[str, float]:
        await self.stop()
        while self.queue.qsize():  # type: ignore[union-attr]
            await self._parse(await self.queue.get())  # type: ignore[union-attr]
        for key, value in list(self.working.items()):
            await self._compute(key, value)
        await self.start()
        final, self.final, self.working = self.final, {}, {}
        return final

    def call_count(self) -> int:
        return self.calls

    def cpu_s(self) -> float:
        return time.process_time()


class SiirlOneCallClient:
    """A rank in siiRL's one-call pattern: every metric in one ``submit_metric``, then
    ``wait_submit`` (the put is acknowledged)."""

    def __init__(self, worker, world_size: int) -> None:
        self.worker = worker
        self.world_size = world_size

    def flush(self, metrics: dict[str, float]) -> None:
        ray.get(self.worker.submit_metric.remote(metrics, self.world_size))
