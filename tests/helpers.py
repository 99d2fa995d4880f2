"""Test helpers: a DAG-worker actor that drives a MetricClient inside Ray."""

from __future__ import annotations

from typing import Any

import numpy as np
import ray

from clients import MetricClient


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

    def wait_final_res(self, step=None, timeout=None) -> dict:
        return self.client.wait_final_res(step, timeout)


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
