"""The rank side: what every training rank imports (``MetricClient``, ``Tracker``,
``StreamRecorder``, the built-in metric families). It summarises on the rank's device,
merges micro-batches and sends one batch per step. It imports ``metricsvc.core``,
``metricsvc.transport`` and ``metricsvc.errors``, and nothing else of metricsvc (never the
service, the sinks, the config or pydantic)."""

from metricsvc.client.client import MetricClient, StreamRecorder, Tracker
from metricsvc.client.summaries import summarize
from metricsvc.core.declare import Derived, Metric
from metricsvc.core.reduce import ReduceType
from metricsvc.errors import (
    BatchRejected,
    LateBatch,
    MetricsvcError,
    Refused,
    ServiceNotice,
    ServiceUnavailable,
    StepAlreadyFinal,
    StepMismatch,
)

__all__ = [
    "BatchRejected",
    "Derived",
    "LateBatch",
    "Metric",
    "MetricClient",
    "MetricsvcError",
    "ReduceType",
    "Refused",
    "ServiceNotice",
    "ServiceUnavailable",
    "StepAlreadyFinal",
    "StepMismatch",
    "StreamRecorder",
    "Tracker",
    "summarize",
]
