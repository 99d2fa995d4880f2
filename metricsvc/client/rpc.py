"""Calling the MetricWorker: bounded waiting while the actor restarts, never for a dead one."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from metricsvc.protocol import (
    ACTOR_ERRORS,
    ServiceUnavailable,
    backoff,
    combiner_name,
    ray_get,
)

log = logging.getLogger(__name__)


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


def call(worker: Callable[[], Any], method: str, *args: Any, retry_s: float,
         timeout_s: float | None = None, label: str = "MetricWorker") -> Any:
    """Call ``worker().method(*args)`` and wait for it, retrying with backoff while the
    actor restarts. ``timeout_s`` bounds the whole call, retries included; ``retry_s``
    bounds the waiting for a restart.

    Raises:
        ServiceUnavailable: at once if the actor is dead for good (stopped, killed without
            restart, out of restarts); else after ``retry_s`` of trying.
        GetTimeoutError: the call ran past ``timeout_s``.
        Whatever the actor method raised (a rejection is a ``ValueError``).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pauses = backoff(retry_s if timeout_s is None else min(retry_s, timeout_s))
    while True:
        handle = worker()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return ray_get(getattr(handle, method).remote(*args), timeout=left)
        except ACTOR_ERRORS as err:
            why = gone_for_good(handle)
            if why is not None:
                raise ServiceUnavailable(f"{label} ({method}): {why}") from err
            delay = next(pauses, None)
            if delay is None:
                raise ServiceUnavailable(
                    f"{label} unreachable for {retry_s} s ({method}): {err}") from err
            if deadline is not None and time.monotonic() + delay >= deadline:
                raise ray.exceptions.GetTimeoutError(
                    f"{label} ({method}): no answer within {timeout_s} s") from err
            log.warning("%s unreachable (%s), retrying in %.2f s", label, method, delay)
            time.sleep(delay)


def issue(handle: Any, method: str, *args: Any) -> Callable[[], Any]:
    """Make the call ``handle.method(*args)`` now; return the wait for its answer."""
    ref = getattr(handle, method).remote(*args)
    return lambda: ray_get(ref)


def find_service(name: str, namespace: str, via: str | None, rank: int) -> Any:
    """Return where a rank's batches go: the combiner ``via`` names, else this node's
    combiner (topology per_node; the rank registers with it), else the MetricWorker."""
    label = via if via is not None else ray.get_runtime_context().get_node_id()
    try:
        combiner = ray.get_actor(combiner_name(name, label), namespace=namespace)
    except ValueError:
        if via is not None:
            raise ValueError(f"no combiner {via!r} for service {name!r}; "
                             f"start it with metricsvc.start_combiner") from None
        return find_metric_worker(name, namespace)
    ray.get(combiner.register.remote(rank))
    return combiner


def find_metric_worker(name: str, namespace: str) -> Any:
    """Return the MetricWorker named ``name``, or raise ``ServiceUnavailable`` naming it."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:  # not a bad batch (nothing to drop): no service to send to
        raise ServiceUnavailable(
            f"no MetricWorker named {name!r} in namespace {namespace!r}: "
            f"start it with metricsvc.start_metric_worker (or it was stopped)"
        ) from None
