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
    next_pause,
    ray_get,
)

log = logging.getLogger(__name__)


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
            delay = next_pause(handle, method, err, pauses, retry_s, label)
            if deadline is not None and time.monotonic() + delay >= deadline:
                raise ray.exceptions.GetTimeoutError(
                    f"{label} ({method}): no answer within {timeout_s} s") from err
            log.warning("%s unreachable (%s), retrying in %.2f s", label, method, delay)
            time.sleep(delay)


class Issued:
    """A call made: ``poll()`` returns its answer if it is in (never waits), calling it
    waits for the answer and returns it; both raise what the call raised."""

    __slots__ = ("ref",)

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def poll(self) -> Any:
        """The answer if it is in, else None (an ack is a dict): one look (``ray.get``
        with timeout 0, no ``ray.wait`` first)."""
        try:
            return ray_get(self.ref, timeout=0)
        except ray.exceptions.GetTimeoutError:
            return None

    def __call__(self) -> Any:
        return ray_get(self.ref)


def issue(handle: Any, method: str, *args: Any) -> Issued:
    """Make the call ``handle.method(*args)`` now; return the wait for its answer."""
    return Issued(getattr(handle, method).remote(*args))


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


class ServiceHandle:
    """Where one rank's batches go (found by name on first use) and how each call is
    made: retried while the actor restarts, counted in ``calls``."""

    def __init__(self, worker: Any, name: str, namespace: str, via: str | None, rank: int,
                 retry_s: float) -> None:
        self._target = worker
        self._given = worker  # the MetricWorker's handle when the caller gave it
        self.name, self.namespace, self.via, self.rank = name, namespace, via, rank
        self.retry_s = retry_s
        self.calls = 0  # actor calls made

    @property
    def target(self) -> Any:
        """The combiner ``via`` names, this node's combiner (topology per_node) or the
        MetricWorker itself."""
        if self._target is None:
            self._target = find_service(self.name, self.namespace, self.via, self.rank)
        return self._target

    def metric_worker(self) -> Any:
        """The MetricWorker itself (never a combiner): given, else found by name."""
        self._given = self._given or find_metric_worker(self.name, self.namespace)
        return self._given

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """One call of the target, waited for (``call``)."""
        self.calls += 1
        return call(lambda: self.target, method, *args, retry_s=self.retry_s,
                    timeout_s=timeout_s, label=f"MetricWorker {self.name!r}")

    def issue(self, method: str, *args: Any) -> Issued:
        """One call of the target, made now; returns the wait for its answer."""
        self.calls += 1
        return issue(self.target, method, *args)
