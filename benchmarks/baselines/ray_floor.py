"""The floor under every pattern that makes one actor call per rank per step: Ray alone.

Each rank sends its metrics dict in one call and reads that call's answer at its next step
(``ray.get`` with timeout 0, as ``flush()`` does; a blocking get if it is not in yet); the
actor counts the calls of each step and answers nothing else; the driver waits for each
step as it waits for ours (``wait_final_res(step)``, issued before the ranks' step) and gets
the last rank's dict back, as many values as a real answer. Nothing is checked, merged,
journaled or reduced: what is left is Ray's per-call work on the rank, on the actor
(threaded, as ours: calls on one thread, readers' waits in a group of their own) and on the
driver. No design that keeps one call per rank per step can cost less than this.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray


@ray.remote(num_cpus=0, max_concurrency=1, concurrency_groups={"readers": 64})
class FloorWorker:
    """Counts each step's calls; ``wait_final_res`` returns once ``world`` have come."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.seen: dict[int, int] = {}
        self.last: dict[int, dict] = {}
        self.calls = 0

    def submit(self, metrics: dict, step: int) -> None:
        with self.cond:
            self.calls += 1
            self.seen[step] = self.seen.get(step, 0) + 1
            self.last[step] = metrics
            self.cond.notify_all()

    @ray.method(concurrency_group="readers")
    def wait_final_res(self, step: int, world: int, timeout_s: float = 120) -> dict:
        with self.cond:
            if not self.cond.wait_for(lambda: self.seen.get(step, 0) >= world, timeout_s):
                raise TimeoutError(f"step {step}: {self.seen.get(step, 0)} of {world} calls")
            self.seen.pop(step)
            return self.last.pop(step)

    def call_count(self) -> int:
        return self.calls

    def cpu_s(self) -> float:
        return time.process_time()


class FloorClient:
    """A rank: one call per step, its answer read at the next step."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.step = 0
        self.pending: Any = None

    def flush(self, metrics: dict[str, float]) -> None:
        if self.pending is not None:
            try:
                ray.get(self.pending, timeout=0)
            except ray.exceptions.GetTimeoutError:
                ray.get(self.pending)
        self.pending = self.worker.submit.remote(metrics, self.step)
        self.step += 1
