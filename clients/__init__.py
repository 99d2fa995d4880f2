"""Worker-side API: summarise on the device, merge micro-batches, one RPC per step."""

from clients.client import (
    LateBatch,
    MetricClient,
    ServiceNotice,
    StepAlreadyFinal,
    StepMismatch,
)
from clients.rpc import ServiceUnavailable
from clients.stream import StreamRecorder
from clients.summarize import summarize
from clients.tracker import Tracker
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
