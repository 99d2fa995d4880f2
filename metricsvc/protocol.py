"""The client/service protocol: everything a client needs from the service, and nothing else.

A client (``metricsvc.client``) imports only this module: the record and its algebra, the
batch and its wire encoding, the reduce kinds and the names they export, metric
declarations, the quantile sketch layout, the key rules, the restart protocol both
clients and combiners speak, how actors are named, and the errors (``metricsvc.errors``).
The rest of ``metricsvc`` (aggregation, the actor, sinks, config) may change freely
behind it. The service (the actor and every module it loads) never imports torch or
``metricsvc.client``; only the demo driver, which runs ranks, does (a test checks both).
"""

from __future__ import annotations

from metricsvc.declare import Derived, Metric, encode_derived
from metricsvc.errors import (
    BatchRejected,
    Late,
    LateBatch,
    MetricsvcError,
    NotFinal,
    Refused,
    ServiceClosed,
    ServiceNotice,
    ServiceUnavailable,
    StepAlreadyFinal,
    StepMismatch,
    StepNotFinal,
    StepUnavailable,
    Unavailable,
    is_refusal,
    own_error,
)
from metricsvc.keys import (
    DEFAULT_NAME,
    DEFAULT_NAMESPACE,
    check_key,
    check_rank,
    combiner_name,
    default_namespace,
    is_internal,
    safe_tag,
)
from metricsvc.records import (
    COUNT,
    FIELDS,
    IDENTITY,
    M2_ROOT,
    MAX,
    MIN,
    NFIELDS,
    NONFINITE,
    SCALARS,
    SUM,
    SUM_LO,
    Batch,
    centred_exactly,
    from_pivot,
    merge,
    merge_pair,
    rss,
    scalar_row,
    scalar_rows,
    summarize_array,
)
from metricsvc.reduce import AUTO, KINDS, OutputRules, ReduceType, kind_name, output_names
from metricsvc.resend import Outbox, deliver
from metricsvc.retry import ACTOR_ERRORS, backoff, ray_get
from metricsvc.sketch import SketchSpec, dense_to_sparse, merge_sparse, sparse_counts
from metricsvc.wire import encode

__all__ = [
    "ACTOR_ERRORS",
    "AUTO",
    "COUNT",
    "IDENTITY",
    "M2_ROOT",
    "MAX",
    "MIN",
    "NONFINITE",
    "SCALARS",
    "SUM",
    "SUM_LO",
    "centred_exactly",
    "from_pivot",
    "merge_pair",
    "rss",
    "DEFAULT_NAME",
    "DEFAULT_NAMESPACE",
    "default_namespace",
    "FIELDS",
    "KINDS",
    "NFIELDS",
    "Batch",
    "BatchRejected",
    "Late",
    "LateBatch",
    "MetricsvcError",
    "NotFinal",
    "Refused",
    "ServiceClosed",
    "ServiceNotice",
    "ServiceUnavailable",
    "StepAlreadyFinal",
    "StepMismatch",
    "StepNotFinal",
    "StepUnavailable",
    "Unavailable",
    "is_refusal",
    "own_error",
    "Derived",
    "Metric",
    "Outbox",
    "OutputRules",
    "ReduceType",
    "SketchSpec",
    "backoff",
    "ray_get",
    "check_key",
    "check_rank",
    "combiner_name",
    "deliver",
    "dense_to_sparse",
    "merge_sparse",
    "sparse_counts",
    "encode",
    "encode_derived",
    "is_internal",
    "kind_name",
    "merge",
    "output_names",
    "safe_tag",
    "scalar_row",
    "scalar_rows",
    "summarize_array",
]
