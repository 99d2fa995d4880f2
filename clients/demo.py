"""`metricsvc demo` / `make run`: local Ray, the MetricWorker, DAG workers, finished steps."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

import metricsvc
from clients import MetricClient

DEMO_CONFIG: dict[str, Any] = {
    "name": "metricsvc_demo",
    "run": {"root": "runs", "experiment": "demo"},
    "sinks": {"console": {"every": 5}, "jsonl": {}},
}


@ray.remote(num_cpus=0)
class DemoWorker:
    """A DAG worker with a fake PPO batch: built-in data, timing and throughput metrics."""

    def __init__(self, rank: int, world_size: int, service: str) -> None:
        self.rank = rank
        self.metrics = MetricClient(rank=rank, world_size=world_size, name=service)
        self.rng = np.random.default_rng(rank)

    def train_step(self) -> int:
        import torch

        start = time.perf_counter()
        rows, prompt, response = 4 + 2 * self.rank, 8, 16  # ranks hold unequal batches
        p_len = torch.from_numpy(self.rng.integers(1, prompt + 1, rows))
        r_len = torch.from_numpy(self.rng.integers(1, response + 1, rows))
        p_mask = torch.arange(prompt)[None] >= (prompt - p_len)[:, None]
        r_mask = torch.arange(response)[None] < r_len[:, None]
        scores = torch.zeros(rows, response)
        scores[torch.arange(rows), r_len - 1] = torch.from_numpy(
            self.rng.random(rows).astype(np.float32))
        batch = {
            "responses": torch.zeros(rows, response, dtype=torch.long),
            "attention_mask": torch.cat([p_mask, r_mask], 1).long(),
            "response_mask": r_mask.long(),
            "token_level_scores": scores,
            "token_level_rewards": scores,
            "advantages": torch.from_numpy(self.rng.normal(0.1 * self.rank, 1, (rows, response))),
            "returns": torch.from_numpy(self.rng.normal(1, 1, (rows, response))),
            "values": torch.from_numpy(self.rng.normal(1, 1, (rows, response))),
        }
        self.metrics.compute_local_data_metric(batch)
        self.metrics.scalar(**{"actor/lr": 1e-5})
        timing = {"gen": 0.01 * (1 + self.rank), "update_actor": 0.02,
                  "step": time.perf_counter() - start + 0.05}
        self.metrics.compute_local_timing_metrics(batch, timing)
        self.metrics.compute_local_throughput_metrics(batch, timing, n_gpus=8)
        self.metrics.wait_submit()  # one host copy, one message
        return self.metrics.step


def progress(done: int, total: int, note: str) -> None:
    """Draw a one-line progress bar on stderr (the demo's and ``make run``'s)."""
    bar = "#" * (20 * done // total)
    sys.stderr.write(f"\r[{bar:<20}] {done}/{total} {note}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def run_demo(config: Any = None, *, workers: int = 4, steps: int = 20) -> dict[str, Any]:
    """Start local Ray, the service and ``workers`` DAG workers; run ``steps`` steps."""
    cfg = metricsvc.load_config(config if config is not None else DEMO_CONFIG)
    if workers < 1 or steps < 1:
        raise ValueError(f"--workers and --steps must be >= 1, got {workers} and {steps}")
    ray.init(include_dashboard=False,  # joins a running cluster if there is one
             logging_level="ERROR")
    try:
        worker = metricsvc.start_metric_worker(cfg)
        ranks = [DemoWorker.remote(r, workers, cfg.name) for r in range(workers)]
        for step in range(steps):
            ray.get([rank.train_step.remote() for rank in ranks])
            result = ray.get(worker.wait_final_res.remote(step, 60))
            note = f"critic/score/mean={result.get('critic/score/mean', float('nan')):.3f}"
            progress(step + 1, steps, note)
        health = metricsvc.stop_metric_worker(worker)
    finally:
        ray.shutdown()
    journal = Path(health["run_dir"]) / "metrics.jsonl"
    print(f"{steps} steps final; journal: {journal}")
    print(f"report: metricsvc report {health['run_dir']} --keys 'critic/*'")
    return health
