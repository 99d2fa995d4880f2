"""siiRL's metric functions rebuilt from their documented behaviour (verl's lineage): every
metric is its own torch reduction read back with ``.item()``; the dicts are plain floats.

Written from scratch for a side-by-side benchmark; only the shape of the work matches.
"""

from __future__ import annotations

from typing import Any

import torch


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    return {f"{prefix}/mean": torch.mean(x).detach().item(),
            f"{prefix}/max": torch.max(x).detach().item(),
            f"{prefix}/min": torch.min(x).detach().item()}


def compute_data_metric(batch: dict[str, Any]) -> dict[str, float]:
    """critic/score, rewards, advantages, returns, values, vf_explained_var, response and
    prompt lengths with clip ratios: one reduction and one ``.item()`` per number."""
    max_response = batch["responses"].shape[-1]
    attention = batch["attention_mask"]
    response_mask = attention[:, -max_response:].bool()
    prompt_mask = attention[:, :-max_response].bool()
    response_length = response_mask.sum(-1).float()
    prompt_length = prompt_mask.sum(-1).float()
    valid_adv = torch.masked_select(batch["advantages"], response_mask)
    valid_returns = torch.masked_select(batch["returns"], response_mask)
    valid_values = torch.masked_select(batch["values"], response_mask)
    out: dict[str, float] = {}
    out.update(_stats("critic/score", batch["token_level_scores"].sum(-1)))
    out.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)))
    out.update(_stats("critic/advantages", valid_adv))
    out.update(_stats("critic/returns", valid_returns))
    out.update(_stats("critic/values", valid_values))
    return_diff_var = torch.var(valid_returns - valid_values)
    return_var = torch.var(valid_returns)
    out["critic/vf_explained_var"] = (1.0 - return_diff_var / (return_var + 1e-5)).item()
    out.update(_stats("response_length", response_length))
    out["response_length/clip_ratio"] = torch.mean(
        torch.eq(response_length, max_response).float()).item()
    out.update(_stats("prompt_length", prompt_length))
    out["prompt_length/clip_ratio"] = torch.mean(
        torch.eq(prompt_length, prompt_mask.shape[-1]).float()).item()
    return out


def compute_timing_metrics(batch: dict[str, Any], timing_raw: dict[str, float]) -> dict:
    """timing_s/<stage> and timing_per_token_ms/<stage> (token counts read with .item())."""
    max_response = batch["responses"].shape[-1]
    attention = batch["attention_mask"]
    response = attention[:, -max_response:].sum().item()
    overall = attention.sum().item()
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
