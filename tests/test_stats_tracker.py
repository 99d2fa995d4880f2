"""AReaL's import style: module-level stats_tracker calls, bound once per process, record
on the process's client; export_all returns every rank's merged step on every rank."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
import torch

import metricsvc
from metricsvc.config import load_config


@ray.remote(num_cpus=0)
class AReaLWorker:
    """A training process written as AReaL writes it: module-level stats_tracker calls."""

    def before_init(self) -> str:
        from metricsvc.client import stats_tracker

        try:
            stats_tracker.scalar(lr=1.0)
        except Exception as err:  # noqa: BLE001  what a user sees
            return f"{type(err).__name__}: {err}"
        return "no error"

    def train(self, name: str, rank: int, world: int, loss, mask, diag) -> dict:
        from metricsvc.client import stats_tracker
        from metricsvc.client.stats_tracker import ReduceType

        stats_tracker.init(rank=rank, world_size=world, name=name)
        stats_tracker.scalar(lr=1e-5)
        with stats_tracker.scope("ppo_actor"):
            stats_tracker.denominator(n_valid_tokens=mask)
            stats_tracker.stat(loss=loss, denominator="n_valid_tokens")
            stats_tracker.stat_compact(mask, ReduceType.SUM, n_tokens=torch.ones_like(diag))
            stats_tracker.stat_compact(mask, ReduceType.AVG, diag=diag)
        with stats_tracker.record_timing("rollout"):
            pass
        with stats_tracker.record_timing("train_step", device=True):  # read at the close
            time.sleep(0.01 * (rank + 1))
        stats_tracker.get("rollout").scalar(reward=0.5 + rank)
        return stats_tracker.export_all(timeout_s=60)


def test_areal_module_level_calls_record_on_the_process_client_and_export_all_merges(
        ray_cluster, tmp_path):
    name = "areal-import-style"
    worker = metricsvc.start_metric_worker(load_config(
        "areal", name=name, run={"root": str(tmp_path)}, sinks={"console": None}))
    g = torch.Generator().manual_seed(0)
    parts = []
    for rows in (3, 7):  # unequal ranks
        loss = torch.randn(rows, 5, generator=g)
        mask = torch.rand(rows, 5, generator=g) < 0.7
        diag = torch.randn(rows, 5, generator=g).double() * 1e3 + 1e6
        parts.append((loss, mask, diag))
    actors = [AReaLWorker.remote() for _ in parts]
    said = ray.get(actors[0].before_init.remote())
    assert said.startswith("NotSetUp: ") and "stats_tracker.init(rank=" in said
    assert "\n" not in said
    got = ray.get([a.train.remote(name, r, len(parts), *p) for r, (a, p) in
                   enumerate(zip(actors, parts))])
    metricsvc.stop_metric_worker(worker)
    assert got[0] == got[1]  # every rank the same merged step, as AReaL's all-reduce
    stats = got[0]
    loss = torch.cat([p[0][p[1]] for p in parts]).double().numpy()
    diag = torch.cat([p[2][p[1]] for p in parts]).numpy()
    assert stats["ppo_actor/loss/avg"] == pytest.approx(loss.mean(), rel=1e-12)
    assert (stats["ppo_actor/loss/min"], stats["ppo_actor/loss/max"]) == (loss.min(),
                                                                         loss.max())
    assert stats["ppo_actor/n_valid_tokens"] == stats["ppo_actor/n_tokens"] == len(loss)
    assert stats["ppo_actor/diag"] == pytest.approx(np.mean(diag), rel=1e-15)
    assert stats["lr"] == 1e-5 and stats["rollout/reward"] == 1.0
    assert "timeperf/rollout" in stats
    assert 0.02 <= stats["timeperf/train_step"] < 1  # the slowest rank's, device-timed
    for a in actors:
        ray.kill(a)


def test_export_all_without_reset_is_refused_in_one_line():
    from metricsvc.client import stats_tracker

    with pytest.raises(ValueError) as err:
        stats_tracker.export_all(reset=False)
    assert "reset=False" in str(err.value) and "\n" not in str(err.value)
