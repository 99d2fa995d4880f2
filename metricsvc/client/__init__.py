"""The rank side: what every training rank imports (``MetricClient``, ``Tracker``,
``StreamRecorder``, the built-in metric families). It summarises on the rank's device,
merges micro-batches and sends one batch per step. It imports ``metricsvc.protocol`` and
nothing else of metricsvc (never the service, the sinks or pydantic)."""

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
