"""Data metrics of a PPO batch, with siiRL / verl names."""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from typing import Any

from clients.metrics.batch import get, response_info
from metricsvc.reduce import ReduceType


def record_data_metrics(m: Any, batch: Mapping[str, Any]) -> None:
    """Record ``critic/*``, ``response/*``, ``prompt/*`` and ``num_turns/*`` of a batch.

    Sequence-level values (score, rewards, lengths) count once per sequence;
    token-level ones (advantages, returns, values) once per valid response
    token. ``critic/vf_explained_var`` is derived by the service from the
    merged moments of returns and returns - values over every valid token.
    """
    torch = __import__("torch")  # the batch is made of torch tensors: it is loaded already
    info = response_info(batch)
    resp = info.response_mask
    # Sums accumulate in float64 without a float64 copy of the token tensors.
    scores = batch["token_level_scores"].sum(-1, dtype=torch.float64)
    rewards = batch["token_level_rewards"].sum(-1, dtype=torch.float64)
    m.stat(**{"critic/score": scores, "critic/rewards": rewards})
    values = get(batch, "values")
    token_level = {"critic/advantages": batch["advantages"], "critic/returns": batch["returns"]}
    if values is not None:
        token_level["critic/values"] = values
    m.stat(mask=resp, **token_level)  # one mask preparation, one call
    if values is not None:
        returns = batch["returns"]
        m.stat(mask=resp, reduce=ReduceType.AVG, **{
            "critic/__explained_var/vf_explained_var/target": returns,  # widened exactly
            # The residual itself in float64: a float32 difference would round.
            "critic/__explained_var/vf_explained_var/residual":
                returns.to(torch.float64) - values,
        })
    length = info.response_length
    m.stat(**{"response/length": length, "prompt/length": info.prompt_length})
    m.stat(reduce=ReduceType.AVG, **{
        "response/clip_ratio/mean": (length == info.max_response_length).double(),
        "prompt/clip_ratio/mean": (info.prompt_length == info.max_prompt_length).double(),
    })
    # A rank without correct (or wrong) responses contributes nothing: no 0 placeholder.
    correct = rewards > 0.5
    m.stat(mask=correct, **{"response/correct_length": length})
    m.stat(mask=~correct, **{"response/wrong_length": length})
    turns = get(batch, "__num_turns__", get(batch, "num_turns"))
    if turns is not None:
        m.stat(**{"num_turns": turns})


def _rss_gb() -> float:
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 1024**3
    except (OSError, ValueError, IndexError):  # not Linux: the peak is what we can get
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def record_process_memory(m: Any) -> None:
    """Record this process's resident memory: MAX across ranks, and the mean under ``/mean``."""
    gb = _rss_gb()
    m.stat(reduce=ReduceType.MAX, **{"perf/process_cpu_mem_used_gb": gb})
    m.stat(reduce=ReduceType.AVG, **{"perf/process_cpu_mem_used_gb/mean": gb})
