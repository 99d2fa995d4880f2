"""Data metrics of a PPO batch, with siiRL / verl names."""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from typing import Any

from metricsvc.client.metrics.batch import get, response_info
from metricsvc.client.metrics.catalogue import Catalogue
from metricsvc.client.tensors import Difference, on_host
from metricsvc.core.declare import Derived, Metric
from metricsvc.core.reduce import ReduceType

EXPLAINED_VARIANCE = Derived(
    "critic/vf_explained_var",
    "1 - sample_var(residual) / (sample_var(returns) + 1e-5)",
    {"residual": "critic/__vf_explained_var/residual", "returns": "critic/returns"},
    help="verl's explained variance of the value function over every valid response token "
         "of every rank: unbiased variances of the merged returns - values and returns",
)


AMM, AVG = ReduceType.AVG_MIN_MAX, ReduceType.AVG
METRICS = Catalogue(  # what record_data_metrics and record_process_memory record (tested)
    Metric("critic/score", AMM, "sum of a sequence's token-level scores, per sequence"),
    Metric("critic/rewards", AMM, "sum of a sequence's token-level rewards, per sequence"),
    Metric("critic/advantages", AMM, "advantages of every valid response token"),
    Metric("critic/returns", AMM, "returns of every valid response token"),
    Metric("critic/values", AMM, "value estimates of every valid response token"),
    Metric("critic/__vf_explained_var/residual", AMM,
           "returns - values per valid token, in float64 (an input of vf_explained_var)"),
    EXPLAINED_VARIANCE,
    Metric("response/length", AMM, "valid response tokens per sequence", "tokens"),
    Metric("prompt/length", AMM, "valid prompt tokens per sequence", "tokens"),
    Metric("num_turns", AMM, "turns per sequence (when the batch has them)"),
    Metric("response/clip_ratio/mean", AVG, "share of responses at the maximum length"),
    Metric("response/aborted_ratio", AVG, "share of responses with no valid token (verl)"),
    Metric("response/length_non_aborted", AMM, "valid tokens per response, of responses with "
           "at least one (verl)", "tokens"),
    Metric("response/clip_ratio_non_aborted/mean", AVG,
           "share of responses with at least one token that are at the maximum length (verl)"),
    Metric("tool_call_counts", AMM, "tool calls per sequence (when the batch has them)"),
    Metric("prompt/clip_ratio/mean", AVG, "share of prompts at the maximum length"),
    Metric("response/correct_length", AMM, "length of responses with reward > 0.5", "tokens"),
    Metric("response/wrong_length", AMM, "length of responses with reward <= 0.5", "tokens"),
    Metric("perf/process_cpu_mem_used_gb", ReduceType.MAX,
           "resident memory of the largest rank process", "GB"),
    Metric("perf/process_cpu_mem_used_gb/mean", AVG, "mean resident memory of a rank", "GB"),
)


def record_data_metrics(m: Any, batch: Mapping[str, Any]) -> None:
    """Record ``critic/*``, ``response/*``, ``prompt/*`` and ``num_turns/*`` of a batch.

    Sequence-level values (score, rewards, lengths) count once per sequence;
    token-level ones (advantages, returns, values) once per valid response
    token. ``critic/vf_explained_var`` is declared (``EXPLAINED_VARIANCE``) and
    derived by the service from the merged moments of returns and returns - values.

    Two calls: the token-level values under the response mask together (each tensor read
    once: the explained-variance inputs reuse the returns and values gathered for their
    own keys), and every per-sequence value (score, rewards, lengths, clip ratios, verl's
    non-aborted lengths and clip ratio, the lengths of correct and of wrong responses),
    each under its own mask, in one ``stat_each`` pass.
    """
    torch = __import__("torch")  # the batch is made of torch tensors: it is loaded already
    info = response_info(batch)
    # Sums accumulate in float64 without a float64 copy of the token tensors.
    rewards = batch["token_level_rewards"].sum(-1, dtype=torch.float64)
    scores = batch["token_level_scores"].sum(-1, dtype=torch.float64)
    length, prompt_length = info.response_length, info.prompt_length
    # A value per sequence is a few dozen numbers: on the host, numpy's comparisons cost a
    # fraction of torch's per-call overhead (views, no copy); on a device they stay there.
    if all(on_host(t, None) for t in (rewards, scores, length, prompt_length)):
        rewards, scores, length, prompt_length = (
            t.numpy() for t in (rewards, scores, length, prompt_length))
    per_sequence = {"critic/score": scores, "critic/rewards": rewards,
                    "response/length": length, "prompt/length": prompt_length}
    turns = get(batch, "__num_turns__", get(batch, "num_turns"))
    if turns is not None:
        per_sequence["num_turns"] = turns
    tools = get(batch, "tool_call_counts")
    if tools is not None:
        per_sequence["tool_call_counts"] = tools
    returns, values = batch["returns"], get(batch, "values")
    token_level = {"critic/advantages": batch["advantages"], "critic/returns": returns}
    if values is not None:
        m.declare(EXPLAINED_VARIANCE)
        token_level["critic/values"] = values
        # Over the valid tokens only, in float64: a float32 difference would round.
        token_level["critic/__vf_explained_var/residual"] = Difference(returns, values)
    METRICS.stat(m, mask=info.response_mask, **token_level)
    clipped = length == info.max_response_length  # flags: recorded as 0 and 1
    aborted = length == 0
    kept = ~aborted
    correct = rewards > 0.5
    # Every per-sequence value, each under its own mask, in one pass. A rank without
    # correct (or wrong) responses contributes nothing to their lengths: no 0 placeholder.
    METRICS.stat_each(m, **{key: (v, None) for key, v in per_sequence.items()}, **{
        "response/clip_ratio/mean": (clipped, None),
        "prompt/clip_ratio/mean": (prompt_length == info.max_prompt_length, None),
        "response/aborted_ratio": (aborted, None),
        "response/length_non_aborted": (length, kept),
        "response/clip_ratio_non_aborted/mean": (clipped, kept),
        "response/correct_length": (length, correct),
        "response/wrong_length": (length, ~correct),
    })


_statm: list[int] = []  # (pid, fd) of this process's open /proc/self/statm


def _rss_gb() -> float:
    """This process's resident memory: /proc/self/statm, kept open and read again from its
    start each step (an open per step cost more than the reading)."""
    try:
        if not _statm or _statm[0] != os.getpid():  # first use, or a forked child
            if _statm:
                os.close(_statm[1])
            _statm[:] = [os.getpid(), os.open("/proc/self/statm", os.O_RDONLY)]
        pages = int(os.pread(_statm[1], 128, 0).split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 1024**3
    except (OSError, ValueError, IndexError):  # not Linux: the peak is what we can get
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def record_process_memory(m: Any) -> None:
    """Record this process's resident memory: MAX across ranks, and the mean under ``/mean``."""
    gb = _rss_gb()
    METRICS.stat(m, **{"perf/process_cpu_mem_used_gb": gb,
                       "perf/process_cpu_mem_used_gb/mean": gb})
