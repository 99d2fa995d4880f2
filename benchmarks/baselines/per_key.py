"""The naive pattern: one actor call per metric key, values reduced in Python."""

from __future__ import annotations

import ray

from benchmarks.baselines.siirl_style import ListReducer


@ray.remote(num_cpus=0, max_concurrency=1024)
class PerKeyWorker(ListReducer):
    """One call per (rank, key), the same per-key lists as the siiRL pattern."""

    async def submit(self, key: str, value: float, world_size: int) -> None:
        self.calls += 1
        self.add(key, value, world_size)


class PerKeyClient:
    """A rank: one call per key, all in flight at once, then wait for them."""

    def __init__(self, worker, world_size: int) -> None:
        self.worker = worker
        self.world_size = world_size

    def flush(self, metrics: dict[str, float]) -> None:
        ray.get([self.worker.submit.remote(k, v, self.world_size) for k, v in metrics.items()])
