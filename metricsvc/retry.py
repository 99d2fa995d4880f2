"""Waiting out an actor that is down or restarting: which errors, and how long between tries.

Shared by the clients (blocking calls) and the combiners (async calls), so both back
off the same way and give up after the same kind of budget.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import ray

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
