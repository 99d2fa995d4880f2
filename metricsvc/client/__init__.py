"""Worker-side API: summarise on the device, merge micro-batches, one RPC per step."""

from metricsvc.client.client import (
    LateBatch,
    MetricClient,
    ServiceNotice,
    StepAlreadyFinal,
    StepMismatch,
)
from metricsvc.client.rpc import ServiceUnavailable
from metricsvc.client.stream import StreamRecorder
from metricsvc.client.summarize import summarize
from metricsvc.client.tracker import Tracker
from metricsvc.protocol import Derived, Metric, ReduceType

__all__ = [
    "Derived",
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
