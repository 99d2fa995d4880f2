"""metricsvc: exact, non-blocking metrics aggregation for distributed training on Ray.

Two halves, one package:

- ``metricsvc.client``: what every training rank imports (``MetricClient``, ``Tracker``,
  ``StreamRecorder``, the built-in recorders). It loads neither the service nor pydantic.
- the service (``start_metric_worker``, ``MetricWorker``, ``load_config``, sinks): what a
  Ray driver imports to start it.

Names are imported on first use (PEP 562), so ``import metricsvc.client`` on a rank stays
light and ``from metricsvc import start_metric_worker`` on a driver works as before.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "Aggregator": "metricsvc.service.aggregator",
    "StepResult": "metricsvc.core.step_result",
    "Combiner": "metricsvc.service.combiner",
    "start_combiner": "metricsvc.service.combiner",
    "ServiceConfig": "metricsvc.config",
    "load_config": "metricsvc.config",
    "presets": "metricsvc.config",
    "Batch": "metricsvc.core.records",
    "ReduceType": "metricsvc.core.reduce",
    "Derived": "metricsvc.core.declare",
    "Metric": "metricsvc.core.declare",
    "BatchRejected": "metricsvc.core.errors",
    "MetricsvcError": "metricsvc.core.errors",
    "Refused": "metricsvc.core.errors",
    "Unavailable": "metricsvc.core.errors",
    "NotFinal": "metricsvc.core.errors",
    "Late": "metricsvc.core.errors",
    "LateBatch": "metricsvc.core.errors",
    "ServiceNotice": "metricsvc.core.errors",
    "StepAlreadyFinal": "metricsvc.core.errors",
    "StepMismatch": "metricsvc.core.errors",
    "MetricWorker": "metricsvc.service.worker",
    "StepNotFinal": "metricsvc.core.errors",
    "StepUnavailable": "metricsvc.core.errors",
    "get_metric_worker": "metricsvc.service.start",
    "start_metric_worker": "metricsvc.service.start",
    "stop_metric_worker": "metricsvc.service.start",
    "MetricClient": "metricsvc.client",
    "StreamRecorder": "metricsvc.client",
    "Tracker": "metricsvc.client",
    "ServiceUnavailable": "metricsvc.core.errors",
    "ServiceClosed": "metricsvc.core.errors",
    "final_result": "metricsvc.service.start",
    "rewind": "metricsvc.service.start",
    "service_health": "metricsvc.service.start",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'metricsvc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
