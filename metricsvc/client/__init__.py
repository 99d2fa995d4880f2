"""Worker-side API: summarise on the device, merge micro-batches, one RPC per step."""

from metricsvc.client.client import MetricClient
from metricsvc.client.stream import StreamRecorder
from metricsvc.client.summarize import summarize
from metricsvc.client.tracker import Tracker
from metricsvc.protocol import (
    BatchRejected,
    Derived,
    LateBatch,
    Metric,
    MetricsvcError,
    ReduceType,
    Refused,
    ServiceNotice,
    ServiceUnavailable,
    StepAlreadyFinal,
    StepMismatch,
)

__all__ = [
    "BatchRejected",
    "Derived",
    "MetricsvcError",
    "Refused",
    "LateBatch",
    "Metric",
    "MetricClient",
    "ReduceType",
    "ServiceNotice",
    "ServiceUnavailable",
    "StepAlreadyFinal",
    "StepMismatch",
    "StreamRecorder",
    "Tracker",
    "summarize",
]
