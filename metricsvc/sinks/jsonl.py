"""The journal as the sink registry names it (``jsonl``): its registration. Its config,
writer and reader are ``metricsvc.storage.journal``, which the worker owns as the
service's log."""

from __future__ import annotations

from metricsvc.sinks.spec import Builtin
from metricsvc.storage.journal import JsonlSinkConfig

__all__ = ["BUILTIN", "JsonlSinkConfig"]

BUILTIN = Builtin('jsonl', 1, JsonlSinkConfig, JsonlSinkConfig(),
                  'metricsvc.storage.journal:JsonlSink')
