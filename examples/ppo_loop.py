"""A PPO-like loop: training ranks with torch tensors record data, timing and throughput
metrics every step and validation every N steps; rollout workers stream episode stats
with no step barrier; the driver exports the stream into each step.

    python examples/ppo_loop.py [--steps 6] [--val-every 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import ray
import torch

import metricsvc
from metricsvc.client import MetricClient

SERVICE = "ppo_loop"
WORLD = 2


def fake_batch(rng: np.random.Generator, rows: int) -> dict:
    prompt, response = 6, 10
    r_len = torch.from_numpy(rng.integers(1, response + 1, rows))
    r_mask = torch.arange(response)[None] < r_len[:, None]
    scores = torch.zeros(rows, response)
    scores[torch.arange(rows), r_len - 1] = torch.from_numpy(rng.random(rows).astype(np.float32))
    return {"responses": torch.zeros(rows, response, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(rows, prompt, dtype=torch.bool), r_mask],
                                        1).long(),
            "response_mask": r_mask.long(), "token_level_scores": scores,
            "token_level_rewards": scores - 0.01,
            "advantages": torch.randn(rows, response), "returns": torch.randn(rows, response),
            "values": torch.randn(rows, response)}


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, rank: int) -> None:
        self.m = MetricClient(rank=rank, world_size=WORLD, name=SERVICE)
        self.rng = np.random.default_rng(rank)
        self.rank = rank

    def step(self, validate: bool) -> int:
        start = time.perf_counter()
        batch = fake_batch(self.rng, 4 + 3 * self.rank)
        with self.m.record_timing("update_actor"):
            loss = torch.rand(()) + self.rank  # stays a tensor: no .item()
        self.m.compute_local_data_metric(batch)
        self.m.submit_metric({"actor/loss/mean": loss})
        timing = {"gen": 0.01, "step": time.perf_counter() - start}
        self.m.compute_local_timing_metrics(batch, timing)
        self.m.compute_local_throughput_metrics(batch, timing, n_gpus=1)  # this rank's GPUs
        if validate:  # each prompt group on one rank
            prompts = [f"rank{self.rank}-q{i}" for i in range(3) for _ in range(4)]
            acc = (self.rng.random(len(prompts)) > 0.4).astype(float).tolist()
            self.m.process_local_validation_metrics(["gsm8k"] * len(prompts), prompts,
                                                    {"acc": acc, "reward": acc}, [1] * len(acc))
        self.m.wait_submit()
        return self.m.last_closed


@ray.remote(num_cpus=0)
class RolloutWorker:
    def __init__(self, seed: int) -> None:
        self.client = MetricClient(rank=0, world_size=1, name=SERVICE)
        self.rng = np.random.default_rng(seed)

    def episodes(self, n: int) -> int:
        with self.client.stream("rollout") as rollout:  # flushed at exit
            for _ in range(n):
                rollout.scalar(reward=float(self.rng.random()))
                rollout.stat(length=np.array([float(self.rng.integers(5, 50))]))
        return n


def main() -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--val-every", type=int, default=3)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)  # or joins a running cluster
    worker = metricsvc.start_metric_worker({"name": SERVICE, "sinks": {"console": None},
                                            "run": {"root": "runs", "experiment": "ppo_loop"}})
    trainers = [Trainer.remote(r) for r in range(WORLD)]
    rollouts = [RolloutWorker.remote(s) for s in range(3)]
    results = []
    for step in range(args.steps):
        ray.get([r.episodes.remote(5) for r in rollouts])
        ray.get(worker.export_stream.remote("rollout", step))  # before the trainers close it
        ray.get([t.step.remote(step % args.val_every == 0) for t in trainers])
        result = ray.get(worker.wait_final_res.remote(step, 60))
        results.append(result)
        print(f"step {step}: {len(result)} metrics, score {result['critic/score/mean']:.3f}, "
              f"rollout reward {result['rollout/reward']:.3f}, "
              f"throughput {result['perf/throughput']:.0f} tok/s/gpu"
              + (f", val acc {result['val-core/gsm8k/acc/mean@4']:.3f}"
                 if 'val-core/gsm8k/acc/mean@4' in result else ""))
    metricsvc.stop_metric_worker(worker)
    ray.shutdown()
    return results


if __name__ == "__main__":
    main()
