"""Sinks: where finished steps go. One module per backend (its registration drives its
config section); ``base`` holds the protocol, ``delivery`` and ``dispatch`` the sink threads
that hand each sink its steps. It may import ``metricsvc.core``, ``metricsvc.storage`` and
the config base; never the service, the client or ``metricsvc.config``."""

from metricsvc.sinks.base import Sink, SinkRegistry, build_sinks, default_registry
from metricsvc.sinks.dispatch import SinkDispatcher

__all__ = ["Sink", "SinkDispatcher", "SinkRegistry", "build_sinks", "default_registry"]
