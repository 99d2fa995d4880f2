"""The naive pattern: one actor call per metric key, values reduced in Python."""

from __future__ import annotations

import asyncio

import ray

from benchmarks.baselines.siirl_style import reduce_by_substring


@ray.remote(num_cpus=0, max_concurrency=1024)
class PerKeyWorker:
    """One call per (rank, key); a round is final when no key is waiting."""

    def __init__(self) -> None:
        self.pending: dict[str, list[float]] = {}
        self.final: dict[str, float] = {}
        self.calls = 0
        self.expect = 1 << 30
        self._done = asyncio.Event()

    async def submit(self, key: str, value: float, world_size: int) -> None:
        self.calls += 1
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


class PerKeyClient:
    """A rank: one call per key, all in flight at once, then wait for them."""

    def __init__(self, worker, world_size: int) -> None:
        self.worker = worker
        self.world_size = world_size

    def flush(self, metrics: dict[str, float]) -> None:
        ray.get([self.worker.submit.remote(k, v, self.world_size) for k, v in metrics.items()])
