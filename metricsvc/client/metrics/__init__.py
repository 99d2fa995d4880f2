"""Built-in metrics (siiRL / verl / AReaL names), recorded as mergeable records.

Every function records into a ``MetricClient`` or a ``Tracker`` and never
syncs a device. Values that the peers compute per rank and then average
(means of means, per-rank variances, ratios) are derived by the service after
the merge, so they equal the value computed on the whole global batch.
"""

from metricsvc.client.metrics import data, diagnostics, moe, timing, validation
from metricsvc.client.metrics.data import record_data_metrics, record_process_memory
from metricsvc.client.metrics.diagnostics import (
    record_advantage_signs,
    record_logp_diagnostics,
    record_rollout_probs_diff,
    record_version_stats,
)
from metricsvc.client.metrics.flops import (
    dense_transformer,
    estimate_flops,
    flops_estimator,
    register_flops_estimator,
)
from metricsvc.client.metrics.moe import record_moe_balance
from metricsvc.client.metrics.timing import (
    TOKENS_OF_STAGE,
    record_throughput_metrics,
    record_timing_metrics,
    record_train_perf,
    timed_train_perf,
)
from metricsvc.client.metrics.validation import record_validation_metrics, validation_metrics

# Every built-in family's declarations (name, kind, help, unit; formulas of derived ones),
# next to the code that records them. ``<name>`` stands for one path segment.
FAMILIES = {
    "data": data.METRICS,
    "timing": timing.METRICS,
    "validation": validation.METRICS,
    "diagnostics": diagnostics.METRICS,
    "moe": moe.METRICS,
}

__all__ = [
    "FAMILIES",
    "TOKENS_OF_STAGE",
    "dense_transformer",
    "estimate_flops",
    "flops_estimator",
    "register_flops_estimator",
    "record_advantage_signs",
    "record_data_metrics",
    "record_logp_diagnostics",
    "record_rollout_probs_diff",
    "record_moe_balance",
    "record_process_memory",
    "record_throughput_metrics",
    "record_timing_metrics",
    "record_train_perf",
    "timed_train_perf",
    "record_version_stats",
    "record_validation_metrics",
    "validation_metrics",
]
