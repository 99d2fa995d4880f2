"""Migrating means the same numbers: a key a framework defines means what that framework
means under every preset; siiRL's documented calls work on our actor; verl's names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ray
import torch

import metricsvc
from metricsvc.client import MetricClient
from metricsvc.config import load_config, presets
from metricsvc.core.reduce import AUTO, FRAMEWORK_KINDS, KindResolver, ReduceType
from tests.helpers import LocalService

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORK_KEYS = {  # plain-dict keys as siiRL and verl write them, and what they mean
    "perf/total_num_tokens": ReduceType.SUM,
    "perf/max_memory_allocated_gb": ReduceType.MAX,
    "perf/max_memory_reserved_gb": ReduceType.MAX,
    "perf/time_per_step_max": ReduceType.MAX,
    "training/rollout_probs_diff_max": ReduceType.MAX,
    "dapo_sampling/total_groups": ReduceType.SUM,
    "critic/score_max": ReduceType.MAX,
    "actor/pg_clip_min": ReduceType.MIN,
    "reward/sample_sum": ReduceType.SUM,
    "val-core/minerva_math/acc/mean": ReduceType.AVG,  # "min" inside a name is no min
}


@pytest.mark.parametrize("preset", presets())
def test_a_key_a_framework_defines_means_the_same_under_every_preset(preset):
    resolve = KindResolver(load_config(preset).parsed_rules()).resolve
    for key, kind in FRAMEWORK_KEYS.items():
        assert resolve(key, AUTO) is kind, (preset, key)


@pytest.mark.parametrize("rules", [{"perf/*": "mean"}, {"*": "sum"}, {"*_max": "mean"},
                                   {"perf/total_num_tokens": "avg"}])
def test_a_rule_that_would_change_a_framework_key_is_refused_in_one_line(rules):
    with pytest.raises(ValueError) as err:
        load_config({"reduce_rules": rules})
    message = str(err.value)
    assert "\n" not in message and "reduce_rules" in message
    assert "a rule cannot change what a framework's key means" in message
    assert any(repr(pattern) in message for pattern, _, _ in FRAMEWORK_KINDS)


def test_a_narrow_rule_loads_and_the_framework_meaning_still_wins_where_it_applies():
    resolve = KindResolver(load_config({"reduce_rules": {"critic/*": "sum"}})
                           .parsed_rules()).resolve
    assert resolve("critic/score", AUTO) is ReduceType.SUM
    assert resolve("critic/score_max", AUTO) is ReduceType.MAX


def test_the_built_in_recorders_keep_their_kinds_whatever_the_config_says():
    service = LocalService(reduce_rules={"timing_s/*": "mean", "critic/*": "sum",
                                         "train_perf/*": "min"})
    batches = [_batch(seed, rows) for seed, rows in ((0, 3), (1, 6))]
    clients = service.clients(2)
    for r, (c, b) in enumerate(zip(clients, batches)):
        c.compute_local_timing_metrics(b, {"gen": 1.0 + r, "step": 2.0 + r})
        c.compute_local_data_metric(b)
        service.close(c)
    got = service.final()["metrics"]
    scores = torch.cat([b["token_level_scores"].sum(-1, dtype=torch.float64) for b in batches])
    assert got["timing_s/gen"] == 2.0  # MAX, as declared, not the rule's mean
    assert got["critic/score/mean"] == pytest.approx(scores.mean().item(), rel=1e-12)


def _batch(seed: int, rows: int, prompt: int = 4, response: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    r_len = torch.randint(1, response + 1, (rows,), generator=g)
    r_mask = torch.arange(response)[None] < r_len[:, None]
    scores = torch.rand(rows, response, generator=g) * r_mask
    old = torch.log(torch.rand(rows, response, generator=g) * 0.9 + 0.05)
    return {
        "responses": torch.zeros(rows, response, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(rows, prompt, dtype=torch.long),
                                     r_mask.long()], 1),
        "response_mask": r_mask.long(),
        "token_level_scores": scores, "token_level_rewards": scores,
        "advantages": torch.randn(rows, response, generator=g),
        "returns": torch.randn(rows, response, generator=g),
        "values": torch.randn(rows, response, generator=g),
        "old_log_probs": old,
        "rollout_log_prob": old + 0.05 * torch.randn(rows, response, generator=g),
        # siiRL and verl count tokens per sample into global_token_num (here not the mask's
        # count, so that reading it is what the test sees)
        "global_token_num": (torch.arange(rows) * 10 + 100 + seed).tolist(),
    }


@ray.remote(num_cpus=0)
class SiirlDagWorker:
    """A siiRL DAG worker, its metric calls as siiRL's MetricClient docstring has them."""

    def __init__(self, metric_worker, rank: int, world_size: int) -> None:
        self.world_size = world_size
        self.client = MetricClient(metric_worker, rank=rank, world_size=world_size)

    def step(self, data: dict, timing_raw: dict) -> dict:
        ws, c = self.world_size, self.client
        c.compute_local_data_metric(data, ws)
        c.compute_local_timing_metrics(data, timing_raw, ws)
        c.compute_local_throughout_metrics(data, timing_raw, 1, ws)  # n_gpu: 1 per worker
        c.compute_log_prob_diff_metrics(data, ws)
        c.submit_metric({"perf/max_memory_allocated_gb": 10.0 + c.rank,
                         "perf/total_num_tokens_seen": 1.0}, ws)
        c.wait_submit()
        final = c.wait_final_res()
        c.stop()
        return final


def test_siirls_documented_usage_sequence_runs_on_our_actor_and_means_siirls_numbers(
        ray_cluster, tmp_path):
    cfg = load_config("siirl", name="siirl-usage",
                      run={"root": str(tmp_path), "experiment": "siirl"})
    metric_worker = metricsvc.start_metric_worker(cfg)
    assert ray.get(metric_worker.start.remote()) is None  # siiRL's start(): it serves already
    world = 3
    batches = [_batch(seed, rows) for seed, rows in enumerate((2, 5, 3))]
    timings = [{"gen": 0.5 + r, "update_actor": 0.2, "step": 3.0 + r} for r in range(world)]
    workers = [SiirlDagWorker.remote(metric_worker, r, world) for r in range(world)]
    finals = ray.get([w.step.remote(b, t) for w, b, t in zip(workers, batches, timings)])
    got = finals[0]
    assert all(f == got for f in finals)
    tokens = sum(sum(b["global_token_num"]) for b in batches)
    assert got["perf/total_num_tokens"] == tokens  # a sum over ranks, as siiRL's
    # siiRL's trainer: tokens of every rank / (step time * every GPU): per GPU
    assert got["perf/throughput"] == pytest.approx(tokens / (5.0 * world), rel=1e-12)
    assert got["perf/delta_time/gen"] == 2.5 and "timing_s/gen" not in got
    assert got["perf/max_memory_allocated_gb"] == 12.0
    assert got["perf/total_num_tokens_seen"] == 1.0  # "total" inside a name is a mean
    mask = torch.cat([b["response_mask"].flatten() for b in batches]).bool()
    diff = torch.cat([(b["rollout_log_prob"].double().exp()
                       - b["old_log_probs"].double().exp()).abs().flatten() for b in batches])
    diff = diff[mask].numpy()
    assert got["actor/rollout_probs_diff_max"] == pytest.approx(diff.max(), rel=1e-12)
    assert got["actor/rollout_probs_diff_mean"] == pytest.approx(diff.mean(), rel=1e-12)
    assert got["actor/rollout_probs_diff/std"] == pytest.approx(diff.std(), rel=1e-9)
    assert ray.get(metric_worker.stop.remote()) is None  # siiRL's stop(): the service stays
    assert ray.get(metric_worker.health.remote())["last_final_step"] == 0
    metricsvc.stop_metric_worker(metric_worker)


def test_siiRL_calls_without_a_counterpart_say_what_to_call_in_one_line():
    with pytest.raises(TypeError) as err:
        MetricClient(object())  # siiRL's MetricClient(metric_worker)
    assert "rank= and world_size=" in str(err.value) and "\n" not in str(err.value)
    c = MetricClient(None, rank=0, world_size=1)
    std_stats = {"sum": 3.0, "sum_sq": 5.0, "count": 2}  # siiRL's StdStats, in dict form
    with pytest.raises(TypeError) as err:
        c.submit_metric({"actor/x/std": std_stats})
    message = str(err.value)
    assert "'actor/x/std' is a siiRL StdStats" in message and "stat(reduce='std'" in message
    assert "\n" not in message and c.pending_keys() == []


def test_the_verl_preset_exports_verls_compute_data_metrics_keys(ray_cluster, tmp_path):
    verl = {line.strip() for line in
            (ROOT / "tests" / "data" / "verl_compute_data_metrics_keys.txt").read_text()
            .splitlines() if line.strip() and not line.startswith("#")}
    cfg = load_config("verl", name="verl-keys", run={"root": str(tmp_path)},
                      sinks={"console": None})
    handle = metricsvc.start_metric_worker(cfg)
    c = MetricClient(None, rank=0, world_size=1, name="verl-keys")
    b = _batch(0, 5)
    b["__num_turns__"] = torch.tensor([1, 2, 1, 3, 2])
    b["tool_call_counts"] = torch.tensor([0, 1, 0, 2, 1])
    b["response_mask"][1] = 0  # one aborted response: verl counts it apart
    b["attention_mask"][1, -6:] = 0
    c.compute_local_data_metric(b)
    c.wait_submit()
    got = ray.get(handle.wait_final_res.remote(0, 30))
    assert verl <= set(got), sorted(verl - set(got))
    assert not [k for k in got if k.startswith(("response/length/", "prompt/length/"))]
    lengths = b["response_mask"].sum(-1).double().numpy()
    assert got["response/aborted_ratio"] == pytest.approx(0.2)
    kept = lengths[lengths > 0]
    assert got["response_length_non_aborted/mean"] == pytest.approx(kept.mean(), rel=1e-12)
    assert got["response_length_non_aborted/clip_ratio"] == pytest.approx(
        np.mean(kept == 6), rel=1e-12)
    assert got["response_length/clip_ratio"] == pytest.approx(np.mean(lengths == 6), rel=1e-12)
    metricsvc.stop_metric_worker(handle)


@pytest.mark.parametrize("preset", ["verl", "siirl"])
def test_verls_own_timing_and_throughput_cases_split_over_two_ranks_mean_each_presets_value(
        ray_cluster, tmp_path, preset):
    """verl's tests of compute_timing_metrics / compute_throughout_metrics
    (tests/trainer/ppo/test_metric_utils.py): 2 samples of 3 prompt and 3 response tokens,
    gen 0.5 s, ref 0.3 s, values 0.2 s; 600 tokens in 2 s on 2 GPUs. Split over two ranks
    that run each stage in parallel (a sample each, the same stage times), the verl preset
    gives verl's values (the slowest rank's time over every rank's tokens); the siirl
    preset keeps siiRL's per-rank form (the ranks' summed time over their summed tokens)."""
    name = f"verl-cases-{preset}"
    handle = metricsvc.start_metric_worker(load_config(
        preset, name=name, run={"root": str(tmp_path)}, sinks={"console": None}))
    timing_raw = {"gen": 0.5, "ref": 0.3, "values": 0.2, "step": 2.0}
    for rank, tokens in ((0, [100]), (1, [200, 300])):
        c = MetricClient(None, rank=rank, world_size=2, name=name)
        batch = {"responses": torch.zeros((1, 3)), "attention_mask": torch.ones((1, 6)),
                 "global_token_num": tokens}
        c.compute_local_timing_metrics(batch, timing_raw)
        c.compute_local_throughout_metrics(batch, timing_raw, 1)
        c.wait_submit()
    got = ray.get(handle.wait_final_res.remote(0, 30))
    metricsvc.stop_metric_worker(handle)
    ranks = 1 if preset == "verl" else 2  # whose seconds: the slowest rank's, or every rank's
    assert got["timing_per_token_ms/gen"] == pytest.approx(ranks * 0.5 * 1000 / 6, rel=1e-12)
    assert got["timing_per_token_ms/ref"] == pytest.approx(ranks * 0.3 * 1000 / 12, rel=1e-12)
    assert got["timing_per_token_ms/values"] == pytest.approx(ranks * 0.2 * 1000 / 12,
                                                              rel=1e-12)
    assert got["perf/total_num_tokens"] == 600 and got["perf/time_per_step"] == 2.0
    assert got["perf/throughput"] == pytest.approx(600 / (2.0 * 2), rel=1e-12)
    timing = "timing_s/gen" if preset == "verl" else "perf/delta_time/gen"
    assert got[timing] == 0.5
