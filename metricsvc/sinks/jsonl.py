"""The journal as the sink registry names it (``jsonl``): its config and registration.
The writer and the reader are ``metricsvc.journal``, which the worker owns as the service's
log."""

from __future__ import annotations

from pydantic import Field, field_validator

from metricsvc.model import Strict, plain
from metricsvc.sinks.spec import Builtin


class JsonlSinkConfig(Strict):
    """The journal: one JSON line per finished step under the run folder."""

    enabled: bool = True
    filename: str = "metrics.jsonl"
    fsync: bool = Field(False, description="fsync after every line (slower, crash-proof)")

    _filename = field_validator("filename")(classmethod(lambda cls, v: plain(v, "filename")))

BUILTIN = Builtin('jsonl', 1, JsonlSinkConfig, JsonlSinkConfig(), 'metricsvc.journal:JsonlSink')
