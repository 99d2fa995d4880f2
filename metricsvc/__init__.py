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
    "Aggregator": "metricsvc.aggregator",
    "StepResult": "metricsvc.output",
    "Combiner": "metricsvc.combiner",
    "start_combiner": "metricsvc.combiner",
    "ServiceConfig": "metricsvc.config",
    "load_config": "metricsvc.config",
    "presets": "metricsvc.config",
    "Batch": "metricsvc.records",
    "ReduceType": "metricsvc.reduce",
    "Derived": "metricsvc.declare",
    "Metric": "metricsvc.declare",
    "BatchRejected": "metricsvc.errors",
    "MetricsvcError": "metricsvc.errors",
    "Refused": "metricsvc.errors",
    "Unavailable": "metricsvc.errors",
    "NotFinal": "metricsvc.errors",
    "Late": "metricsvc.errors",
    "LateBatch": "metricsvc.errors",
    "ServiceNotice": "metricsvc.errors",
    "StepAlreadyFinal": "metricsvc.errors",
    "StepMismatch": "metricsvc.errors",
    "MetricWorker": "metricsvc.worker",
    "StepNotFinal": "metricsvc.errors",
    "StepUnavailable": "metricsvc.errors",
    "get_metric_worker": "metricsvc.service",
    "start_metric_worker": "metricsvc.service",
    "stop_metric_worker": "metricsvc.service",
    "MetricClient": "metricsvc.client",
    "StreamRecorder": "metricsvc.client",
    "Tracker": "metricsvc.client",
    "ServiceUnavailable": "metricsvc.errors",
    "ServiceClosed": "metricsvc.errors",
    "final_result": "metricsvc.service",
    "rewind": "metricsvc.service",
    "service_health": "metricsvc.service",
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
