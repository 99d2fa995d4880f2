"""Moving siiRL metric code to metricsvc: the same calls, plus rank/world_size and exactness.

Before (siiRL):

    from siirl.execution.metric_worker.metric_worker import MetricClient, MetricWorker
    metric_worker = MetricWorker.remote()
    metric_client = MetricClient(metric_worker)
    metric_client.compute_local_data_metric(batch, world_size)
    metric_client.compute_local_timing_metrics(batch, timing_raw, world_size)
    metric_client.compute_local_throughout_metrics(batch, timing_raw, n_gpus, world_size)
    metric_client.submit_metric({"training/grad_norm/mean": grad_norm.item()}, world_size)
    metric_client.wait_submit()
    final_metrics = metric_client.wait_final_res()

After (below): the MetricWorker is started once by the driver (the siirl preset keeps
siiRL's names: timing_s/ -> perf/delta_time/); each DAG worker's client knows its rank.
No .item(): a 0-d tensor stays on its device until the one copy per step.

    python examples/siirl_migration.py
"""

from __future__ import annotations

import ray
import torch

import metricsvc
from metricsvc.client import MetricClient

WORLD = 2


@ray.remote(num_cpus=0)
class DAGWorker:
    def __init__(self, rank: int) -> None:
        self.metric_client = MetricClient(rank=rank, world_size=WORLD,
                                          name="siirl_migration")  # + rank, world size
        self.rank = rank

    def step(self) -> dict:
        rows, prompt, response = 3 + self.rank, 4, 6
        mask = torch.ones(rows, prompt + response, dtype=torch.long)
        batch = {"responses": torch.zeros(rows, response, dtype=torch.long),
                 "attention_mask": mask, "token_level_scores": torch.rand(rows, response),
                 "token_level_rewards": torch.rand(rows, response),
                 "advantages": torch.randn(rows, response), "returns": torch.randn(rows, response)}
        timing_raw = {"gen": 0.2 + self.rank, "step": 1.0 + self.rank}
        grad_norm = torch.tensor(0.5 + self.rank)
        c = self.metric_client
        c.compute_local_data_metric(batch, WORLD)
        c.compute_local_timing_metrics(batch, timing_raw, WORLD)
        c.compute_local_throughout_metrics(batch, timing_raw, 1, WORLD)  # 1 GPU per worker
        c.submit_metric({"training/grad_norm/mean": grad_norm}, WORLD)  # no .item()
        c.wait_submit()
        return c.wait_final_res()


def main() -> dict:
    ray.init(include_dashboard=False, log_to_driver=False)  # or joins a running cluster
    worker = metricsvc.start_metric_worker("siirl",
                                           name="siirl_migration")
    workers = [DAGWorker.remote(r) for r in range(WORLD)]
    final = ray.get([w.step.remote() for w in workers])[0]
    for key in ("critic/advantages/mean", "perf/delta_time/gen", "perf/throughput",
                "training/grad_norm/mean"):
        print(f"{key:28s} {final[key]:.6g}")
    metricsvc.stop_metric_worker(worker)
    ray.shutdown()
    return final


if __name__ == "__main__":
    main()
