"""The README quickstart, runnable: a Ray driver, the MetricWorker, training ranks submitting.

    python examples/ray_driver.py [--config default] [--ranks 4] [--steps 10]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import ray

import metricsvc
from metricsvc.cli.demo import progress
from metricsvc.client import MetricClient

try:
    import torch
except ImportError:  # the demo also runs on numpy alone
    torch = None



@ray.remote(num_cpus=0)
class TrainingRank:
    """A stand-in for a training worker: makes a fake PPO batch and records its metrics."""

    def __init__(self, rank: int, world_size: int, worker_name: str) -> None:
        self.rank = rank
        self.metrics = MetricClient(rank=rank, world_size=world_size, name=worker_name)
        self.rng = np.random.default_rng(rank)

    def _tensor(self, array: np.ndarray):
        return torch.from_numpy(array) if torch is not None else array

    def train_step(self) -> int:
        t0 = time.perf_counter()
        batch_size, max_len = 4 + 2 * self.rank, 16  # ranks hold unequal batches
        lengths = self.rng.integers(1, max_len + 1, size=batch_size)
        mask = np.arange(max_len)[None, :] < lengths[:, None]
        advantages = self.rng.normal(0.1 * self.rank, 1.0, size=(batch_size, max_len))
        self.metrics.stat(
            mask=self._tensor(mask), **{"critic/advantages": self._tensor(advantages)}
        )
        self.metrics.stat(**{"response/length": self._tensor(lengths.astype(np.float32))})
        self.metrics.submit_metric(
            {"actor/lr": 1e-5, "tokens/total": int(mask.sum())},
            world_size=self.metrics.world_size,
        )
        if self.rank == 0:  # like siiRL: some keys come from rank 0 only
            self.metrics.submit_metric({"timing_s/step": time.perf_counter() - t0}, world_size=1)
        self.metrics.wait_submit()  # one host copy, one message
        return self.metrics.step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="default",
                        help="a preset name (default, siirl, areal, all, ...) or a YAML file")
    parser.add_argument("--ranks", "--workers", dest="ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    ray.init(include_dashboard=False)  # joins a running cluster if there is one
    worker = metricsvc.start_metric_worker(args.config)
    cfg = metricsvc.load_config(args.config)
    ranks = [TrainingRank.remote(r, args.ranks, cfg.name) for r in range(args.ranks)]

    for step in range(args.steps):
        ray.get([rank.train_step.remote() for rank in ranks])
        result = ray.get(worker.wait_final_res.remote(step=step, timeout_s=60))
        shown = ", ".join(
            f"{k}={result[k]:.4g}"
            for k in ("critic/advantages/mean", "response/length/mean", "tokens/total")
            if k in result
        )
        clear = "\r\x1b[K" if sys.stderr.isatty() else ""  # over the progress bar's line
        print(f"{clear}step {step:3d} final: {len(result)} metrics | {shown}", flush=True)
        progress(step + 1, args.steps, f"step {step} final")

    health = ray.get(worker.close.remote())
    print(f"journal: {health['journal']}")
    print(f"batches merged: {health['batches']}, submits: {health['calls'].get('submit', 0)}, "
          f"rejected: {health['rejected_batches']}")
    for name, sink in health["sinks"].items():
        print(f"sink {name}: {sink['written']} steps written, "
              f"{sink['dead_lettered']} dead-lettered")
    ray.shutdown()


if __name__ == "__main__":
    main()
