"""The siirl preset means what siiRL means: its sum / max / min keys reduce so, exactly."""


import numpy as np
import pytest
import ray

import metricsvc
from metricsvc.client import MetricClient

# Every siiRL key name (its metric helpers, MetricsCollector, DAPO sampling, the docs)
# whose meaning is a sum, a max or a min; and means that must stay means.
SIIRL_KEYS = {
    "perf/total_num_tokens": np.sum,
    "perf/max_memory_allocated_gb": np.max,
    "perf/max_memory_reserved_gb": np.max,
    "training/rollout_probs_diff_max": np.max,
    "training/rollout_probs_diff_mean": np.mean,
    "dapo_sampling/total_groups": np.sum,
    "dapo_sampling/kept_groups": np.mean,
    "critic/score_max": np.max,
    "critic/score_min": np.min,
    "critic/advantages_max": np.max,
    "critic/advantages_min": np.min,
    "response/length_max": np.max,
    "response/length_min": np.min,
    "response/correct_length_max": np.max,
    "prompt/length_min": np.min,
    "actor/pg_clip_min": np.min,
    "analysis/unique_transitions/total": np.sum,
    "critic/score/max": np.max,
    "critic/score/min": np.min,
    "critic/score/mean": np.mean,
    "val-core/minerva_math/acc/mean": np.mean,  # siiRL's substring rule would take a min
    "timing_s/gen": np.max,  # exported as perf/delta_time/gen
}


def test_the_siirl_preset_reduces_each_siirl_key_as_siirl_means_it(ray_cluster, tmp_path):
    cfg = metricsvc.load_config("siirl", name="siirl-preset")
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"root": str(tmp_path)}),
                                 "sinks": cfg.sinks.model_copy(update={"console": None})})
    world = 3
    handle = metricsvc.start_metric_worker(cfg, world_size=world)
    rng = np.random.default_rng(7)
    per_rank = {key: rng.uniform(1, 100, size=world).round(3) for key in SIIRL_KEYS}
    for rank in range(world):
        c = MetricClient(None, rank=rank, world_size=world, name="siirl-preset")
        c.submit_metric({key: float(values[rank]) for key, values in per_rank.items()},
                        world_size=world)
        c.wait_submit()
    got = ray.get(handle.wait_final_res.remote(0, 30))
    for key, reduce in SIIRL_KEYS.items():
        name = key.replace("timing_s/", "perf/delta_time/")
        assert got[name] == pytest.approx(float(reduce(per_rank[key])), rel=1e-12), key
    metricsvc.stop_metric_worker(handle)
