"""Calling the MetricWorker: bounded waiting while the actor is down, never forever."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from metricsvc.retry import ACTOR_ERRORS, backoff

log = logging.getLogger(__name__)

class ServiceUnavailable(RuntimeError):
    """The MetricWorker stayed unreachable for longer than the client's ``retry_s``."""


def call(worker: Callable[[], Any], method: str, *args: Any, retry_s: float,
         timeout_s: float | None = None, label: str = "MetricWorker") -> Any:
    """Call ``worker().method(*args)`` and wait for it, retrying with backoff while the
    actor is unreachable, for at most ``retry_s`` seconds.

    Raises:
        ServiceUnavailable: the actor stayed unreachable for ``retry_s`` seconds.
        GetTimeoutError: the call itself ran past ``timeout_s``.
        Whatever the actor method raised (a rejection is a ``ValueError``).
    """
    pauses = backoff(retry_s)
    while True:
        try:
            return ray.get(getattr(worker(), method).remote(*args), timeout=timeout_s)
        except ACTOR_ERRORS as err:
            delay = next(pauses, None)
            if delay is None:
                raise ServiceUnavailable(
                    f"{label} unreachable for {retry_s} s ({method}): {err}") from err
            log.warning("%s unreachable (%s), retrying in %.2f s", label, method, delay)
            time.sleep(delay)
