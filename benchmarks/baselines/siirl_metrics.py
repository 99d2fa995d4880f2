"""siiRL's metric functions rebuilt from what they do (``siirl/utils/metrics/metric_utils.py``
of sii-research/siiRL, which its ``MetricClient.compute_local_data_metric`` and the timing
and throughput calls run): every metric is its own torch reduction read back with
``.item()``; the dicts are plain floats.

Written from scratch for a side-by-side benchmark; only the shape of the work matches: the
same reductions, masks and reads (including the lengths of correct and of wrong responses,
the second sum of the token-level rewards and the process memory through psutil that
siiRL's ``compute_data_metric`` does, and the response info its timing metrics compute
again).
"""

from __future__ import annotations

import os
from typing import Any

import psutil
import torch


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    return {f"{prefix}/mean": torch.mean(x).detach().item(),
            f"{prefix}/max": torch.max(x).detach().item(),
            f"{prefix}/min": torch.min(x).detach().item()}


def _stats_or_zero(prefix: str, x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {f"{prefix}/max": 0, f"{prefix}/min": 0, f"{prefix}/mean": 0}
    return _stats(prefix, x)


def response_info(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """siiRL's ``_compute_response_info``: the response mask and both lengths."""
    max_response = batch["responses"].shape[-1]
    attention = batch["attention_mask"]
    prompt_mask = attention[:, :-max_response]
    response_mask = batch.get("response_mask", attention[:, -max_response:])
    return {"response_mask": response_mask, "prompt_length": prompt_mask.sum(-1).float(),
            "response_length": response_mask.sum(-1).float()}


def compute_data_metric(batch: dict[str, Any]) -> dict[str, float]:
    """critic/score, rewards, advantages, returns, values, vf_explained_var, response and
    prompt lengths with clip ratios, the lengths of correct and of wrong responses and the
    process memory: one reduction and one ``.item()`` per number."""
    sequence_score = batch["token_level_scores"].sum(-1)
    sequence_reward = batch["token_level_rewards"].sum(-1)
    max_response = batch["responses"].shape[-1]
    attention = batch["attention_mask"]
    prompt_mask = attention[:, :-max_response].bool()
    response_mask = batch.get("response_mask", attention[:, -max_response:]).bool()
    info = response_info(batch)
    prompt_length, response_length = info["prompt_length"], info["response_length"]
    valid_adv = torch.masked_select(batch["advantages"], response_mask)
    valid_returns = torch.masked_select(batch["returns"], response_mask)
    valid_values = torch.masked_select(batch["values"], response_mask)
    return_diff_var = torch.var(valid_returns - valid_values)
    return_var = torch.var(valid_returns)
    correct = batch["token_level_rewards"].sum(-1) > 0.5
    out: dict[str, float] = {}
    out.update(_stats("critic/score", sequence_score))
    out.update(_stats("critic/rewards", sequence_reward))
    out.update(_stats("critic/advantages", valid_adv))
    out.update(_stats("critic/returns", valid_returns))
    out.update(_stats("critic/values", valid_values))
    out["critic/vf_explained_var"] = (1.0 - return_diff_var / (return_var + 1e-5)).item()
    out.update(_stats("response/length", response_length))
    out["response/clip_ratio/mean"] = torch.mean(
        torch.eq(response_length, max_response).float()).item()
    out.update(_stats_or_zero("response/correct_length", response_length[correct]))
    out.update(_stats_or_zero("response/wrong_length", response_length[~correct]))
    out.update(_stats("prompt/length", prompt_length))
    out["prompt/clip_ratio/mean"] = torch.mean(
        torch.eq(prompt_length, prompt_mask.shape[-1]).float()).item()
    out["perf/process_cpu_mem_used_gb"] = psutil.Process(os.getpid()).memory_info().rss / 1024**3
    return out


def compute_timing_metrics(batch: dict[str, Any], timing_raw: dict[str, float]) -> dict:
    """timing_s/<stage> and timing_per_token_ms/<stage> (token counts read with .item())."""
    info = response_info(batch)
    prompt = torch.sum(info["prompt_length"]).item()
    response = torch.sum(info["response_length"]).item()
    overall = prompt + response
    tokens = {"gen": response, **{s: overall for s in
                                  ("ref", "values", "adv", "update_critic", "update_actor")}}
    out = {f"timing_s/{name}": value for name, value in timing_raw.items()}
    out.update({f"timing_per_token_ms/{name}": timing_raw[name] * 1000 / tokens[name]
                for name in tokens if name in timing_raw})
    return out


def compute_throughput_metrics(batch: dict[str, Any], timing_raw: dict[str, float],
                               n_gpus: int) -> dict[str, float]:
    total = batch["attention_mask"].sum().item()
    step = timing_raw["step"]
    return {"perf/total_num_tokens": total, "perf/time_per_step": step,
            "perf/throughput": total / (step * n_gpus)}
