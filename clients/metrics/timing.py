"""Timing, throughput and AReaL's train_perf; rates are derived by the service after the merge."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clients.metrics.batch import plain_if_host, response_info
from metricsvc.reduce import ReduceType

# Which token count a stage's time is divided by (siiRL / verl).
TOKENS_OF_STAGE = {
    "gen": "response",
    "ref": "overall",
    "values": "overall",
    "adv": "overall",
    "update_critic": "overall",
    "update_actor": "overall",
}


def record_timing_metrics(
    m: Any, batch: Mapping[str, Any], timing_raw: Mapping[str, float],
    reduce: ReduceType = ReduceType.MAX,
) -> None:
    """Record ``timing_s/<stage>`` (MAX across ranks: the slowest rank sets the step time)
    and ``timing_per_token_ms/<stage>`` = 1000 * sum of times / sum of tokens over ranks."""
    info = response_info(batch)
    response = info.response_length.sum()
    tokens = {"response": plain_if_host(response),
              "overall": plain_if_host(response + info.prompt_length.sum())}
    # Plain numbers stay plain (one vectorised call for every stage); the two token counts
    # are plain on the host and stay on their device elsewhere (no sync), shared by the
    # stages that divide by them.
    m.stat(reduce=reduce, **{f"timing_s/{stage}": float(s) for stage, s in timing_raw.items()})
    per_token = [(stage, TOKENS_OF_STAGE[stage]) for stage in timing_raw
                 if stage in TOKENS_OF_STAGE]
    if per_token:
        ratios = {}
        for stage, which in per_token:
            ratios[f"__ratio/timing_per_token_ms/{stage}/num"] = 1000.0 * float(timing_raw[stage])
            ratios[f"__ratio/timing_per_token_ms/{stage}/den"] = tokens[which]
        m.stat(reduce=ReduceType.SUM, **ratios)


def record_throughput_metrics(
    m: Any, batch: Mapping[str, Any], timing_raw: Mapping[str, float], n_gpus: int
) -> None:
    """Record ``perf/total_num_tokens`` (SUM), ``perf/time_per_step`` (MAX) and
    ``perf/throughput`` = total tokens / (time per step * n_gpus), derived after the merge."""
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
    tokens = plain_if_host(batch["attention_mask"].sum())
    seconds = float(timing_raw["step"])
    m.stat(reduce=ReduceType.SUM, **{"perf/total_num_tokens": tokens,
                                     "__ratio/perf/throughput/num": tokens})
    m.stat(reduce=ReduceType.MAX, **{"perf/time_per_step": seconds,
                                     "__ratio/perf/throughput/den": seconds * n_gpus})


def record_train_perf(m: Any, tokens: Any, seconds: float, name: str = "train_perf") -> None:
    """Record AReaL's ``train_perf/*``: tokens summed over ranks, seconds the max over ranks,
    rates and cumulative totals (kept by the service across steps) derived after the merge."""
    m.stat(reduce=ReduceType.SUM, **{f"__cumulative/{name}/tokens": tokens})
    m.stat(reduce=ReduceType.MAX, **{f"__cumulative/{name}/seconds": float(seconds)})
