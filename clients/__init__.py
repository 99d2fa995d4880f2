"""Worker-side API: summarise on the device, merge micro-batches, one RPC per step."""

from clients.client import MetricClient
from clients.summarize import summarize
from metricsvc.reduce import ReduceType

__all__ = ["MetricClient", "ReduceType", "summarize"]
