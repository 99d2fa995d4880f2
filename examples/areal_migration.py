"""Moving AReaL's stats_tracker / StatsLogger code to metricsvc: renames only.

Before (AReaL):

    from areal.utils import stats_tracker
    stats_tracker.scalar(lr=current_lr)
    with stats_tracker.scope("ppo_actor"):
        stats_tracker.denominator(n_valid_tokens=loss_mask.bool())
        stats_tracker.stat(loss=loss_per_token, importance_weight=ratio,
                           denominator="n_valid_tokens")
    with stats_tracker.record_timing("rollout"):
        batch = rollout()
    stats_tracker.get("rollout").scalar(reward=episode_reward)
    stats = stats_tracker.export_all(reduce_group=dp_group)
    stats_logger.commit(epoch, step, global_step, stats)

After (below): the same calls on a MetricClient (the areal preset: key/avg suffixes,
record_timing under timeperf/); export + commit become wait_submit on every rank, and
the MetricWorker's sinks (wandb, swanlab, tensorboard, JSONL) take StatsLogger's place.

    python examples/areal_migration.py
"""

from __future__ import annotations

import time

import ray
import torch

import metricsvc
from metricsvc.client import MetricClient

WORLD = 2


@ray.remote(num_cpus=0)
class TrainEngine:
    def __init__(self, rank: int) -> None:
        self.stats_tracker = MetricClient(rank=rank, world_size=WORLD,
                                          name="areal_migration")
        self.rank = rank

    def train_step(self, current_lr: float) -> int:
        st = self.stats_tracker
        st.scalar(lr=current_lr)
        loss_mask = torch.rand(4 + self.rank, 8) > 0.3
        with st.scope("ppo_actor"):
            st.denominator(n_valid_tokens=loss_mask.bool())
            rows = 4 + self.rank
            st.stat(loss=torch.rand(rows, 8), importance_weight=torch.rand(rows, 8),
                    denominator="n_valid_tokens")
        with st.record_timing("rollout"):
            time.sleep(0.01 * (1 + self.rank))
        st.get("rollout").scalar(reward=0.5 + 0.1 * self.rank)
        st.wait_submit()  # replaces export_all + commit: one call, exact across ranks
        return st.last_closed


def main() -> dict:
    ray.init(include_dashboard=False, log_to_driver=False)  # or joins a running cluster
    worker = metricsvc.start_metric_worker("areal", name="areal_migration")
    engines = [TrainEngine.remote(r) for r in range(WORLD)]
    step = ray.get([e.train_step.remote(1e-5) for e in engines])[0]
    stats = ray.get(worker.wait_final_res.remote(step, 30))
    for key in sorted(stats):
        print(f"{key:36s} {stats[key]:.6g}")
    metricsvc.stop_metric_worker(worker)
    ray.shutdown()
    return stats


if __name__ == "__main__":
    main()
