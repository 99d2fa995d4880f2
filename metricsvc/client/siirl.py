"""siiRL's ``MetricClient`` methods, on a metricsvc client: the same names and calls.

siiRL passes ``world_size`` to every call; here each client is one rank's and knows its
world size, so the argument is checked (``1 <= world_size <= the client's``: siiRL passes 1
for keys only rank 0 computes) and otherwise ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metricsvc.client import metrics
from metricsvc.protocol import is_int


class SiirlCalls:
    """siiRL's calls for one rank's client: each recording call checks the ``world_size``
    siiRL passes and records through the client's tracker API (``metricsvc.client.metrics``);
    ``wait_final_res`` takes siiRL's spellings and asks the client's service.
    ``MetricClient`` holds one and answers siiRL's method names with it."""

    def __init__(self, tracker: Any, world_size: int) -> None:
        self.tracker = tracker
        self.world_size = world_size

    def submit_metric(self, metrics: Mapping[str, Any], world_size: int | None) -> None:
        if not isinstance(metrics, Mapping):
            raise TypeError(f"submit_metric expects a mapping, got {type(metrics).__name__}")
        expected = self._expected(world_size, metrics)
        try:
            self.tracker.buffer.record_plain(metrics, expected)
        except TypeError:  # a value that is no number: say what a siiRL StdStats becomes
            key = next((k for k, v in metrics.items() if _is_std_stats(v)), None)
            if key is None:
                raise
            raise TypeError(
                f"submit_metric: {key!r} is a siiRL StdStats (sum, sum_sq, count): record "
                f"the values themselves, stat(reduce='std', **{{{key.removesuffix('/std')!r}: "
                f"values}}), an exact std over every rank's values") from None

    def log_prob_diff(self, data: Mapping[str, Any], world_size: int | None) -> None:
        """siiRL's rollout-vs-trainer probability gap: |exp(rollout_log_prob) -
        exp(old_log_probs)| over the response mask, as ``actor/rollout_probs_diff_max``,
        ``actor/rollout_probs_diff_mean`` and ``actor/rollout_probs_diff/std`` (siiRL's
        StdStats), each exact over every rank's tokens. Records nothing when the batch lacks
        either log-prob, as siiRL."""
        self._expected(world_size, {"actor/rollout_probs_diff_max": None})
        metrics.record_rollout_probs_diff(self.tracker, data)

    def data(self, batch: Mapping[str, Any], world_size: int | None) -> None:
        self._expected(world_size, {"critic/score": None})
        metrics.record_data_metrics(self.tracker, batch)
        metrics.record_process_memory(self.tracker)

    def timing(self, batch: Mapping[str, Any], timing_raw: Mapping[str, float],
               world_size: int | None) -> None:
        self._expected(world_size, {"timing_s": None})
        metrics.record_timing_metrics(self.tracker, batch, timing_raw)

    def throughput(self, batch: Mapping[str, Any], timing_raw: Mapping[str, float],
                   n_gpus: int, world_size: int | None) -> None:
        self._expected(world_size, {"perf/throughput": None})
        metrics.record_throughput_metrics(self.tracker, batch, timing_raw, n_gpus)

    def validation(self, data_sources: Any, sample_inputs: Any, infos_dict: Mapping[str, Any],
                   sample_turns: Any, world_size: int | None) -> None:
        self._expected(world_size, {"val-core": None})
        metrics.record_validation_metrics(self.tracker, data_sources, sample_inputs,
                                          infos_dict, sample_turns)

    def wait_final_res(self, step: int | None, timeout_s: float | None,
                       timeout: float | None) -> dict:
        if timeout is not None:
            if timeout_s is not None:
                raise TypeError("give timeout_s or timeout, not both")
            timeout_s = timeout
        step = self.tracker.last_closed if step is None else step
        # The actor enforces ``timeout_s``; the margin here only guards a lost actor.
        return self.tracker.service.call("wait_final_res", step, timeout_s,
                                         timeout_s=None if timeout_s is None else timeout_s + 30)

    def _expected(self, world_size: int | None, keys: Mapping[str, Any]) -> int:
        if world_size is None:
            return 0
        if not is_int(world_size):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
        if not 1 <= world_size <= self.world_size:
            first = next(iter(keys), "<none>")
            raise ValueError(
                f"world_size for keys like {first!r} must be in [1, {self.world_size}] "
                f"(this client's world size), got {world_size}"
            )
        return 0 if world_size == self.world_size else world_size


def _is_std_stats(value: Any) -> bool:
    """True for siiRL's ``StdStats`` (or its dict form): a sum, a sum of squares, a count."""
    fields = ("sum", "sum_sq", "count")
    if isinstance(value, Mapping):
        return all(f in value for f in fields)
    return all(hasattr(value, f) for f in fields) and not hasattr(value, "shape")
