"""metricsvc: exact, non-blocking metrics aggregation for distributed training on Ray."""

from metricsvc.aggregator import Aggregator, StepResult
from metricsvc.combiner import Combiner, start_combiner
from metricsvc.config import ServiceConfig, load_config
from metricsvc.records import Batch
from metricsvc.reduce import ReduceType
from metricsvc.validation import BatchRejected
from metricsvc.worker import (
    MetricWorker,
    StepNotFinal,
    StepUnavailable,
    get_metric_worker,
    start_metric_worker,
    stop_metric_worker,
)

__all__ = [
    "Aggregator",
    "Batch",
    "BatchRejected",
    "Combiner",
    "MetricWorker",
    "ReduceType",
    "ServiceConfig",
    "StepNotFinal",
    "StepResult",
    "StepUnavailable",
    "get_metric_worker",
    "load_config",
    "start_combiner",
    "start_metric_worker",
    "stop_metric_worker",
]
__version__ = "0.1.0"
