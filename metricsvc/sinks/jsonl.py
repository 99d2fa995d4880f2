"""The journal as the sink registry names it (``jsonl``): its one definition is
``metricsvc.journal``, which the worker owns as the service's log."""

from metricsvc.journal import JsonlSink

__all__ = ["JsonlSink"]
