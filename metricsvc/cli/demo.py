"""`metricsvc demo`: Ray (a running cluster, else a local one), the MetricWorker, training
ranks with fake PPO batches, finished steps. Needs no torch."""

from __future__ import annotations

import importlib.util
import sys
import time
from typing import Any

import numpy as np
import ray

import metricsvc
from metricsvc.client import MetricClient

HAS_TORCH = importlib.util.find_spec("torch") is not None  # looked up once, not per step

DEMO_CONFIG: dict[str, Any] = {
    "name": "metricsvc_demo",
    "run": {"root": "runs", "experiment": "demo"},
    "sinks": {"console": {"every": 5}, "jsonl": {}},
}


@ray.remote(num_cpus=0)
class DemoRank:
    """A training rank (siiRL's DAG worker) with a fake PPO batch: built-in data, timing
    and throughput metrics."""

    def __init__(self, rank: int, world_size: int, service: str) -> None:
        self.rank = rank
        self.metrics = MetricClient(rank=rank, world_size=world_size, name=service)
        self.rng = np.random.default_rng(rank)

    def train_step(self) -> int:
        start = time.perf_counter()
        batch = fake_batch(self.rng, rows=4 + 2 * self.rank, shift=0.1 * self.rank)
        timing = {"gen": 0.01 * (1 + self.rank), "update_actor": 0.02,
                  "step": time.perf_counter() - start + 0.05}
        if HAS_TORCH:
            import torch  # the built-in PPO recorders read torch tensors, as a real rank's

            tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
            self.metrics.compute_local_data_metric(tensors)
            self.metrics.compute_local_timing_metrics(tensors, timing)
            self.metrics.compute_local_throughput_metrics(tensors, timing, n_gpus=1)
        else:  # a base install: the same arrays, recorded as any metric is
            mask = batch["response_mask"].astype(bool)
            self.metrics.stat(mask=mask, **{"critic/advantages": batch["advantages"],
                                            "critic/returns": batch["returns"],
                                            "critic/values": batch["values"]})
            self.metrics.stat(**{"critic/score": batch["token_level_scores"].sum(-1),
                                 "response/length": mask.sum(-1)})
            self.metrics.stat(reduce_type="max", **{f"timing_s/{k}": v for k, v in timing.items()})
        self.metrics.scalar(**{"actor/lr": 1e-5})
        self.metrics.wait_submit()  # one host copy, one message
        return self.metrics.step


def fake_batch(rng: np.random.Generator, rows: int, shift: float) -> dict[str, np.ndarray]:
    """A PPO batch of ``rows`` samples: prompt and response masks, scores, values."""
    prompt, response = 8, 16
    p_len = rng.integers(1, prompt + 1, rows)
    r_len = rng.integers(1, response + 1, rows)
    p_mask = np.arange(prompt)[None] >= (prompt - p_len)[:, None]
    r_mask = np.arange(response)[None] < r_len[:, None]
    scores = np.zeros((rows, response), np.float32)
    scores[np.arange(rows), r_len - 1] = rng.random(rows)
    return {
        "responses": np.zeros((rows, response), np.int64),
        "attention_mask": np.concatenate([p_mask, r_mask], 1).astype(np.int64),
        "response_mask": r_mask.astype(np.int64),
        "token_level_scores": scores,
        "token_level_rewards": scores,
        "advantages": rng.normal(shift, 1, (rows, response)),
        "returns": rng.normal(1, 1, (rows, response)),
        "values": rng.normal(1, 1, (rows, response)),
    }


def progress(done: int, total: int, note: str) -> None:
    """Show progress on stderr: a bar redrawn in place on a terminal, else one line per
    step (a ``\\r`` would glue the lines of a log file together)."""
    if not sys.stderr.isatty():
        sys.stderr.write(f"{done}/{total} {note}\n")
        sys.stderr.flush()
        return
    bar = "#" * (20 * done // total)
    sys.stderr.write(f"\r[{bar:<20}] {done}/{total} {note}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def run_demo(config: Any = None, *, ranks: int = 4, steps: int = 20) -> dict[str, Any]:
    """Join the running Ray cluster (else start a local one), start the service and
    ``ranks`` training ranks; run ``steps`` steps."""
    cfg = metricsvc.load_config(config if config is not None else DEMO_CONFIG)
    if ranks < 1 or steps < 1:
        raise ValueError(f"--ranks and --steps must be >= 1, got {ranks} and {steps}")
    ray.init(include_dashboard=False,  # joins a running cluster if there is one
             logging_level="ERROR")
    try:
        worker = metricsvc.start_metric_worker(cfg)
        actors = [DemoRank.remote(r, ranks, cfg.name) for r in range(ranks)]
        for step in range(steps):
            ray.get([rank.train_step.remote() for rank in actors])
            result = ray.get(worker.wait_final_res.remote(step, 60))
            note = f"critic/score/mean={result.get('critic/score/mean', float('nan')):.3f}"
            progress(step + 1, steps, note)
        health = metricsvc.stop_metric_worker(worker)
    finally:
        ray.shutdown()
    journal = health["journal"]
    print(f"{steps} steps final; journal: {journal}")
    print(f"report: metricsvc report {health['run_dir']} --keys 'critic/*'")
    return health
