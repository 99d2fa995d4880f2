"""The client/service protocol: everything a client needs from the service, and nothing else.

A client (``metricsvc.client``) imports only this module: the record and its algebra, the
batch and its wire encoding, the reduce kinds and the names they export, metric
declarations, the quantile sketch layout, the key rules, the restart protocol both
clients and combiners speak, how actors are named, and the errors (``metricsvc.core.errors``).
The rest of ``metricsvc`` (aggregation, the actor, sinks, config) may change freely
behind it. The service (the actor and every module it loads) never imports torch or
``metricsvc.client``; only the demo driver, which runs ranks, does (a test checks both).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import ray

from metricsvc.core.batch import Batch
from metricsvc.core.declare import Derived, Metric, encode_derived
from metricsvc.core.errors import (
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
from metricsvc.core.extremes import MAX_CALL, MAX_ID, MIN_CALL, MIN_ID, NSOURCE, merge_sources
from metricsvc.core.keys import (
    DEFAULT_NAME,
    DEFAULT_NAMESPACE,
    check_key,
    check_rank,
    combiner_name,
    default_namespace,
    is_internal,
    safe_tag,
)
from metricsvc.core.limits import RETRY_S, is_int
from metricsvc.core.records import (
    COUNT,
    EXACT_SUM_MAX,
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
    centred_exactly,
    exact_sum,
    from_pivot,
    merge,
    merge_pair,
    rss,
    scalar_row,
    scalar_rows,
    summarize_array,
)
from metricsvc.core.reduce import AUTO, KINDS, OutputRules, ReduceType, kind_name, output_names
from metricsvc.core.resend import Outbox, deliver
from metricsvc.core.sketch import SketchSpec, dense_to_sparse, merge_sparse, sparse_counts
from metricsvc.core.wire import encode

__all__ = [
    "MAX_CALL",
    "MAX_ID",
    "MIN_CALL",
    "MIN_ID",
    "NSOURCE",
    "merge_sources",
    "ACTOR_ERRORS",
    "RETRY_S",
    "is_int",
    "gone_for_good",
    "next_pause",
    "AUTO",
    "COUNT",
    "EXACT_SUM_MAX",
    "IDENTITY",
    "M2_ROOT",
    "MAX",
    "MIN",
    "NONFINITE",
    "SCALARS",
    "SUM",
    "SUM_LO",
    "centred_exactly",
    "exact_sum",
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


# -- calling actors: which errors mean an actor is down or restarting, how long between
# tries, and what a caller is raised when an actor's method raised (the clients, the
# combiners and the driver's calls all back off the same way) ----------------------------

# Raised while an actor is dead or restarting; worth waiting for, unlike a rejection.
ACTOR_ERRORS: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(ray.exceptions, name, None)
                for name in ("RayActorError", "ActorUnavailableError"))
    if e is not None
)


def backoff(budget_s: float, first_s: float = 0.05, cap_s: float = 2.0) -> Iterator[float]:
    """Yield pauses that double from ``first_s`` up to ``cap_s``, while they fit in the budget."""
    deadline = time.monotonic() + budget_s
    delay = first_s
    while time.monotonic() + delay <= deadline:
        yield delay
        delay = min(2 * delay, cap_s)


def ray_get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get(ref)``, raising what the actor raised as metricsvc's own exception (one
    line, the remote traceback kept as its ``__cause__``), never Ray's wrapper of it."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as err:
        own = own_error(err)
        if own is err:
            raise
        raise own from err


def gone_for_good(handle: Any) -> str | None:
    """Return why the actor behind ``handle`` cannot come back, or None if it may."""
    try:
        from ray._private.state import actors  # what Ray's own runtime context asks

        info = actors(actor_id=handle._actor_id.hex())
    except Exception:  # no answer from the control store: assume it may come back
        return None
    if not info or info.get("State") != "DEAD":
        return None
    cause = info.get("DeathCause") or {}
    detail = next((v.get("errorMessage") for v in cause.values() if isinstance(v, dict)
                   and v.get("errorMessage")), None) if isinstance(cause, dict) else None
    return f"it is dead for good ({(detail or 'no restarts left').splitlines()[0]})"


def next_pause(handle: Any, method: str, err: BaseException, pauses: Iterator[float],
               budget_s: float, label: str) -> float:
    """The pause before trying ``method`` again, after ``err`` said the actor behind
    ``handle`` is down or restarting (``pauses``: a ``backoff`` over ``budget_s``). The
    one retry rule of every caller: ranks' clients, combiners and drivers.

    Raises:
        ServiceUnavailable: at once if the actor is dead for good (stopped, killed without
            restart, out of restarts); else once the budget is spent.
    """
    why = gone_for_good(handle)
    if why is not None:
        raise ServiceUnavailable(f"{label} ({method}): {why}") from err
    delay = next(pauses, None)
    if delay is None:
        raise ServiceUnavailable(f"{label} unreachable for {budget_s} s ({method}): {err}") from err
    return delay
