"""Sinks: where finished steps go. One module per backend (its ``BUILTIN`` registration
drives its config section); ``base`` holds the protocol, the registry and what a sink may
show, ``dispatch`` the sink threads that hand each sink its steps. It may import
``metricsvc.core``, ``metricsvc.storage`` and ``metricsvc.errors``; never the service, the
client or ``metricsvc.config``."""

from metricsvc.sinks.base import Sink, SinkRegistry, build_sinks, default_registry
from metricsvc.sinks.dispatch import SinkDispatcher

__all__ = ["Sink", "SinkDispatcher", "SinkRegistry", "build_sinks", "default_registry"]
