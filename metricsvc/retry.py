"""Calling actors: which errors mean an actor is down or restarting, how long between
tries, and what a caller is raised when an actor's method raised.

Shared by the clients (blocking calls), the combiners (async calls) and the driver's
calls, so all back off the same way, give up after the same kind of budget, and raise
metricsvc's own exceptions, never Ray's wrapper of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import ray

from metricsvc.errors import own_error

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
