"""Sinks: where finished steps go. One module per sink; ``base`` holds the protocol."""

from metricsvc.sinks.base import Sink, SinkRegistry, build_sinks, default_registry
from metricsvc.sinks.dispatch import SinkDispatcher

__all__ = ["Sink", "SinkDispatcher", "SinkRegistry", "build_sinks", "default_registry"]
