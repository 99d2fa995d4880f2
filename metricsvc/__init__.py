"""metricsvc: exact, non-blocking metrics aggregation for distributed training on Ray.

Two halves, one package:

- ``metricsvc.client``: what every training rank imports (``MetricClient``, ``Tracker``,
  ``StreamRecorder``, the built-in recorders). It loads neither the service nor pydantic.
- the service (``start_metric_worker``, ``MetricWorker``, ``load_config``, sinks): what a
  Ray driver imports to start it.

Names are imported on first use (PEP 562), so ``import metricsvc.client`` on a rank stays
light and ``from metricsvc import start_metric_worker`` on a driver works as before;
``metricsvc.errors`` is there after ``import metricsvc``, and ``python -m metricsvc`` is
the command line.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "Batch": "metricsvc.core.wire",
    "BatchRejected": "metricsvc.errors",
    "Combiner": "metricsvc.service.combiner",
    "Derived": "metricsvc.core.declare",
    "Late": "metricsvc.errors",
    "LateBatch": "metricsvc.errors",
    "Metric": "metricsvc.core.declare",
    "MetricClient": "metricsvc.client",
    "MetricWorker": "metricsvc.service.worker",
    "MetricsvcError": "metricsvc.errors",
    "NotFinal": "metricsvc.errors",
    "ReduceType": "metricsvc.core.reduce",
    "Refused": "metricsvc.errors",
    "ServiceClosed": "metricsvc.errors",
    "ServiceConfig": "metricsvc.config",
    "ServiceNotice": "metricsvc.errors",
    "ServiceUnavailable": "metricsvc.errors",
    "StepAlreadyFinal": "metricsvc.errors",
    "StepMismatch": "metricsvc.errors",
    "StepNotFinal": "metricsvc.errors",
    "StepResult": "metricsvc.service.output",
    "StepUnavailable": "metricsvc.errors",
    "StreamRecorder": "metricsvc.client",
    "Tracker": "metricsvc.client",
    "Unavailable": "metricsvc.errors",
    "final_result": "metricsvc.service.start",
    "flagged_samples": "metricsvc.storage.flagged",
    "get_metric_worker": "metricsvc.service.start",
    "load_config": "metricsvc.config",
    "presets": "metricsvc.config",
    "rewind": "metricsvc.service.start",
    "service_health": "metricsvc.service.start",
    "start_combiner": "metricsvc.service.combiner",
    "start_metric_worker": "metricsvc.service.start",
    "stop_metric_worker": "metricsvc.service.start",
}
# Submodules a user reaches as attributes after ``import metricsvc``
_MODULES = ("errors", "client", "config")

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"metricsvc.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'metricsvc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_MODULES))
