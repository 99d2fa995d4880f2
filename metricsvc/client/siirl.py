"""siiRL's ``MetricClient`` methods, on a metricsvc client: the same names and calls.

siiRL passes ``world_size`` to every call; here each client is one rank's and knows its
world size, so the argument is checked (``1 <= world_size <= the client's``: siiRL passes 1
for keys only rank 0 computes) and otherwise ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metricsvc.client import metrics


class SiirlMethods:
    """Mixed into ``MetricClient``: siiRL's calls, recording through the client's own
    ``buffer`` and closing through its ``wait_acks``."""

    world_size: int  # the client's (MetricClient sets these, wait_acks and _call)
    buffer: Any
    last_closed: int | None

    def submit_metric(self, metrics: Mapping[str, Any], world_size: int | None = None) -> None:
        """Record a plain dict, siiRL style: the reduction comes from each key's last segment.

        ``world_size`` is the number of ranks expected to send these keys
        (siiRL passes 1 for keys only rank 0 computes); default: all ranks.
        """
        if not isinstance(metrics, Mapping):
            raise TypeError(f"submit_metric expects a mapping, got {type(metrics).__name__}")
        expected = self._expected(world_size, metrics)
        try:
            self.buffer.record_plain(metrics, expected)
        except TypeError:  # a value that is no number: say what a siiRL StdStats becomes
            key = next((k for k, v in metrics.items() if _is_std_stats(v)), None)
            if key is None:
                raise
            raise TypeError(
                f"submit_metric: {key!r} is a siiRL StdStats (sum, sum_sq, count): record "
                f"the values themselves, stat(reduce='std', **{{{key.removesuffix('/std')!r}: "
                f"values}}), an exact std over every rank's values") from None

    def stop(self) -> None:
        """siiRL's ``MetricClient.stop()``: wait until the service has taken every batch this
        rank handed over. The service keeps serving the other ranks; the driver ends it with
        ``metricsvc.stop_metric_worker``."""
        self.wait_acks()

    def compute_log_prob_diff_metrics(self, data: Mapping[str, Any],
                                      world_size: int | None = None) -> None:
        """siiRL's rollout-vs-trainer probability gap: |exp(rollout_log_prob) -
        exp(old_log_probs)| over the response mask, as ``actor/rollout_probs_diff_max``,
        ``actor/rollout_probs_diff_mean`` and ``actor/rollout_probs_diff/std`` (siiRL's
        StdStats), each exact over every rank's tokens. Records nothing when the batch lacks
        either log-prob, as siiRL."""
        self._expected(world_size, {"actor/rollout_probs_diff_max": None})
        metrics.record_rollout_probs_diff(self, data)

    def compute_local_data_metric(self, batch: Mapping[str, Any],
                                  world_size: int | None = None) -> None:
        """Record the data metrics of a batch (``critic/*``, ``response/*``, ``prompt/*``)."""
        self._expected(world_size, {"critic/score": None})
        metrics.record_data_metrics(self, batch)
        metrics.record_process_memory(self)

    def compute_local_timing_metrics(self, batch: Mapping[str, Any],
                                     timing_raw: Mapping[str, float],
                                     world_size: int | None = None) -> None:
        """Record ``timing_s/*`` and ``timing_per_token_ms/*``."""
        self._expected(world_size, {"timing_s": None})
        metrics.record_timing_metrics(self, batch, timing_raw)

    def compute_local_throughout_metrics(self, batch: Mapping[str, Any],
                                         timing_raw: Mapping[str, float], n_gpus: int,
                                         world_size: int | None = None) -> None:
        """Record ``perf/total_num_tokens``, ``perf/time_per_step``, ``perf/throughput``."""
        self._expected(world_size, {"perf/throughput": None})
        metrics.record_throughput_metrics(self, batch, timing_raw, n_gpus)

    compute_local_throughput_metrics = compute_local_throughout_metrics  # the right spelling

    def process_local_validation_metrics(self, data_sources: Any, sample_inputs: Any,
                                         infos_dict: Mapping[str, Any], sample_turns: Any,
                                         world_size: int | None = None) -> None:
        """Record ``val-core/*``, ``val-aux/*`` and ``val/test_score/*``."""
        self._expected(world_size, {"val-core": None})
        metrics.record_validation_metrics(self, data_sources, sample_inputs,
                                          infos_dict, sample_turns)

    def _expected(self, world_size: int | None, keys: Mapping[str, Any]) -> int:
        if world_size is None:
            return 0
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
        if not 1 <= world_size <= self.world_size:
            first = next(iter(keys), "<none>")
            raise ValueError(
                f"world_size for keys like {first!r} must be in [1, {self.world_size}] "
                f"(this client's world size), got {world_size}"
            )
        return 0 if world_size == self.world_size else world_size

    def wait_final_res(self, step: int | None = None, timeout_s: float | None = None, *,
                       timeout: float | None = None) -> dict:
        """Return the merged metrics of ``step`` (default: the last step this rank closed).

        Raises ``StepNotFinal`` (a TimeoutError) after ``timeout_s`` seconds (``timeout=``,
        siiRL's spelling, is accepted too).
        """
        if timeout is not None:
            if timeout_s is not None:
                raise TypeError("give timeout_s or timeout, not both")
            timeout_s = timeout
        if step is None:
            step = self.last_closed
        # The actor enforces ``timeout_s``; the margin here only guards a lost actor.
        return self._call("wait_final_res", step, timeout_s,
                          timeout_s=None if timeout_s is None else timeout_s + 30)



def _is_std_stats(value: Any) -> bool:
    """True for siiRL's ``StdStats`` (or its dict form): a sum, a sum of squares, a count."""
    fields = ("sum", "sum_sq", "count")
    if isinstance(value, Mapping):
        return all(f in value for f in fields)
    return all(hasattr(value, f) for f in fields) and not hasattr(value, "shape")
