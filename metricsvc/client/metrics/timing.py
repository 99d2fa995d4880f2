"""Timing, throughput and AReaL's train_perf; rates are derived by the service after the merge."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from metricsvc.client.metrics.batch import (
    get,
    held_response_info,
    plain_if_host,
    response_info,
)
from metricsvc.client.metrics.catalogue import Catalogue
from metricsvc.client.tensors import on_host
from metricsvc.core.declare import Derived, Metric
from metricsvc.core.keys import is_int
from metricsvc.core.reduce import ReduceType

THROUGHPUT = Derived(
    "perf/throughput", "value(tokens) / (value(seconds) * value(gpus))",
    {"tokens": "perf/total_num_tokens", "seconds": "perf/time_per_step",
     "gpus": "__perf/throughput/gpus"},
    help="tokens per second per GPU: the tokens of every rank over the slowest rank's step "
         "time and the GPUs of every rank (siiRL's and verl's meaning)",
    unit="tokens/s/GPU",
)


PER_TOKEN_MS = Derived(
    "timing_per_token_ms/<stage>", "value(ms) / value(tokens)",
    {"ms": "__timing_per_token_ms/<stage>/ms", "tokens": "__timing_per_token_ms/<stage>/tokens"},
    help="milliseconds of a stage per token, over every rank", unit="ms")


@functools.lru_cache(maxsize=256)  # by name: a run has a few
def train_perf(name: str) -> tuple[Derived, ...]:
    """AReaL's ``<name>/*`` rates and running totals over ``<name>/tokens`` (SUM) and
    ``<name>/seconds`` (MAX)."""
    inputs = {"tokens": f"{name}/tokens", "seconds": f"{name}/seconds"}
    return (
        Derived(f"{name}/tokens_per_second", "value(tokens) / value(seconds)", inputs,
                help="this step's tokens over its slowest rank's seconds", unit="tokens/s"),
        Derived(f"{name}/total_tokens", "total(value(tokens))", inputs,
                help="tokens of every step so far", unit="tokens"),
        Derived(f"{name}/total_seconds", "total(value(seconds))", inputs,
                help="seconds of every step so far", unit="s"),
        Derived(f"{name}/cumulative_tokens_per_second",
                "total(value(tokens)) / total(value(seconds))", inputs,
                help="tokens over seconds of every step so far", unit="tokens/s"),
    )


@functools.lru_cache(maxsize=256)
def train_perf_flops(name: str) -> tuple[Derived, ...]:
    """AReaL's ``<name>/estimated_flops*`` rates over ``<name>/estimated_flops`` (SUM) and
    ``<name>/seconds`` (MAX): cluster rates, not per GPU."""
    inputs = {"flops": f"{name}/estimated_flops", "seconds": f"{name}/seconds"}
    return (
        Derived(f"{name}/estimated_flops_per_second", "value(flops) / value(seconds)", inputs,
                help="this step's estimated FLOPs over its slowest rank's seconds",
                unit="FLOP/s"),
        Derived(f"{name}/cumulative_estimated_flops_per_second",
                "total(value(flops)) / total(value(seconds))", inputs,
                help="estimated FLOPs over seconds of every step so far", unit="FLOP/s"),
    )


METRICS = Catalogue(  # what the timing, throughput and train_perf recorders record (tested)
    Metric("timing_s/<stage>", ReduceType.MAX, "seconds of a stage on the slowest rank", "s"),
    Metric("__timing_per_token_ms/<stage>/ms", ReduceType.SUM,
           "1000 x a stage's seconds, summed over ranks (an input of timing_per_token_ms)"),
    Metric("__timing_per_token_ms/<stage>/tokens", ReduceType.SUM,
           "tokens a stage's time is divided by, summed over ranks"),
    PER_TOKEN_MS,
    Metric("perf/total_num_tokens", ReduceType.SUM,
           "tokens of every rank (global_token_num, else the attention mask)", "tokens"),
    Metric("perf/time_per_step", ReduceType.MAX, "seconds of the slowest rank's step", "s"),
    Metric("__perf/throughput/gpus", ReduceType.SUM,
           "GPUs of every rank (each rank's n_gpus; an input of perf/throughput)"),
    THROUGHPUT,
    Metric("train_perf/tokens", ReduceType.SUM, "tokens of every rank this step", "tokens"),
    Metric("train_perf/seconds", ReduceType.MAX, "seconds of the slowest rank", "s"),
    *train_perf("train_perf"),
    Metric("train_perf/estimated_flops", ReduceType.SUM,
           "estimated training FLOPs of every rank's sequences (forward and backward)", "FLOP"),
    *train_perf_flops("train_perf"),
)

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
    reduce: ReduceType | None = None,
) -> None:
    """Record ``timing_s/<stage>`` (as declared, MAX across ranks: the slowest rank sets the
    step time; ``reduce`` overrides it) and ``timing_per_token_ms/<stage>`` = 1000 * sum
    of times / sum of tokens over ranks."""
    tokens = _tokens(response_info(batch))
    # Plain numbers stay plain (one vectorised call for every stage); the two token counts
    # are plain on the host and stay on their device elsewhere (no sync), shared by the
    # stages that divide by them.
    times = {f"timing_s/{stage}": float(s) for stage, s in timing_raw.items()}
    if reduce is not None:
        m.stat(reduce=reduce, **times)
        times = {}
    per_token = [(stage, TOKENS_OF_STAGE[stage]) for stage in timing_raw
                 if stage in TOKENS_OF_STAGE]
    if per_token:
        m.declare(PER_TOKEN_MS)
        for stage, which in per_token:
            times[f"__timing_per_token_ms/{stage}/ms"] = 1000.0 * float(timing_raw[stage])
            times[f"__timing_per_token_ms/{stage}/tokens"] = tokens[which]
    if times:  # the stage times and the per-token inputs: one record of the buffer
        METRICS.stat(m, **times)


def record_throughput_metrics(
    m: Any, batch: Mapping[str, Any], timing_raw: Mapping[str, float], n_gpus: int = 1
) -> None:
    """Record ``perf/total_num_tokens`` (SUM over ranks), ``perf/time_per_step`` (MAX) and
    ``perf/throughput``, tokens per second per GPU, derived after the merge as
    total tokens / (slowest step time * GPUs of every rank), as siiRL's trainer does.

    ``n_gpus`` is the GPUs this rank's step used (siiRL passes 1 per DAG worker); verl's
    driver-side call passes the job's GPU count once, which is the sum of these. Tokens
    are the batch's ``global_token_num`` (a list, a tensor or a NonTensorData of per-sample
    counts, as siiRL and verl fill it), else its attention mask's.
    """
    if not is_int(n_gpus) or n_gpus < 1:
        raise ValueError(f"n_gpus must be an int >= 1 (the GPUs this rank used), got {n_gpus!r}")
    tokens = _token_count(batch)
    seconds = float(timing_raw["step"])
    m.declare(THROUGHPUT)
    METRICS.stat(m, **{"perf/total_num_tokens": tokens, "__perf/throughput/gpus": float(n_gpus),
                       "perf/time_per_step": seconds})


def _tokens(info: Any) -> dict[str, Any]:
    """The response's and the whole batch's tokens: plain on the host (numpy's sums of a
    few dozen lengths), on their device elsewhere (no sync)."""
    lengths = info.response_length, info.prompt_length
    if all(on_host(t, None) for t in lengths):
        response, prompt = (float(t.numpy().sum()) for t in lengths)
        return {"response": response, "overall": response + prompt}
    response = info.response_length.sum()
    return {"response": response, "overall": response + info.prompt_length.sum()}


def _token_count(batch: Mapping[str, Any]) -> Any:
    """This rank's tokens: ``global_token_num`` where the batch has it, else the mask's."""
    counts = get(batch, "global_token_num")
    if counts is None:
        if get(batch, "attention_mask") is None:
            raise KeyError("batch has neither 'global_token_num' nor 'attention_mask'; "
                           "throughput metrics need one")
        info = held_response_info(batch)
        if info is not None and info.of_attention:  # the mask's two parts, summed already
            return _tokens(info)["overall"]
        return plain_if_host(batch["attention_mask"].sum())
    counts = getattr(counts, "data", counts)  # a tensordict NonTensorData holds a list
    if hasattr(counts, "sum") and not isinstance(counts, (list, tuple)):
        return plain_if_host(counts.sum())
    if isinstance(counts, (int, float)):
        return float(counts)
    return float(sum(counts))


def record_train_perf(m: Any, tokens: Any, seconds: float | None, name: str = "train_perf",
                      *, flops: float | None = None) -> None:
    """Record AReaL's ``train_perf/*``: tokens summed over ranks, seconds the max over ranks,
    rates and cumulative totals (kept by the service across steps) derived after the merge.
    ``flops``: this rank's estimated training FLOPs (``estimate_flops``), summed over ranks
    into ``estimated_flops`` and its rates; without it they are omitted, as AReaL omits them
    for a model it cannot estimate. ``seconds`` None: recorded by the caller
    (``timed_train_perf``)."""
    m.declare(*train_perf(name))
    entries = [METRICS.entry("train_perf/tokens"), METRICS.entry("train_perf/seconds")]
    if flops is not None:
        m.declare(*train_perf_flops(name))
        entries.append(METRICS.entry("train_perf/estimated_flops"))
    # the kinds and meanings declared for train_perf/*, whatever the name
    m.buffer.describe(*entries,
                      under=lambda key: m.full_key(name + key.removeprefix("train_perf")))
    m.stat(reduce=METRICS.kind("train_perf/tokens"), **{f"{name}/tokens": tokens})
    if seconds is not None:
        m.stat(reduce=METRICS.kind("train_perf/seconds"), **{f"{name}/seconds": float(seconds)})
    if flops is not None:
        m.stat(reduce=METRICS.kind("train_perf/estimated_flops"),
               **{f"{name}/estimated_flops": float(flops)})


@contextlib.contextmanager
def timed_train_perf(m: Any, tokens: Any, name: str = "train_perf", *,
                     flops: float | None = None, device: bool = True) -> Iterator[None]:
    """``record_train_perf`` with the block's own time as its seconds, as AReaL times
    ``train_perf``: on the CUDA device (events on the current stream, read at the flush
    with one wait per device, never per batch), the wall time on the CPU (or with
    ``device=False``)."""
    record_train_perf(m, tokens, None, name, flops=flops)
    key = m.full_key(f"{name}/seconds")
    with m.buffer.timed(key, int(METRICS.kind("train_perf/seconds")), device):
        yield
