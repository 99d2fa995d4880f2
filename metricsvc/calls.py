"""Calling the service's actors, on every side: the one transport is Ray actor calls.

Ranks' clients, per-node combiners and drivers call the MetricWorker the same way: while
it restarts they back off and try again, at once they hear that it is gone for good, and
what it raised reaches them as metricsvc's own one-line exception (``ray_get``), never
Ray's wrapper with the remote traceback.

A MetricWorker that Ray restarts loses the steps its journal did not hold yet. So a sender
keeps every batch it sent until an ack says the journal holds its step (``durable_through``)
and names in each call the incarnation it last heard from (``epoch``). A new incarnation
merges nothing from a sender that names another one: it answers ``epoch_changed``, and the
sender first resends what it still owes, oldest first, then the batch it was sending, so
no new step can finish ahead of an older one it needs. ``Outbox.exchange`` is that exchange
without I/O; the client drives it with blocking calls, the combiner with awaited ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import ray

from metricsvc.errors import MetricsvcError, ServiceUnavailable

log = logging.getLogger(__name__)

Ack = dict[str, Any]  # what the MetricWorker answers a batch (``MetricWorker.submit``)

# An actor that is down: Ray raises ``ActorUnavailableError`` while it may come back (it
# restarts) and ``ActorDiedError`` once it is dead for good (stopped, killed without a
# restart, out of restarts); a plain ``RayActorError`` is taken to be worth waiting for.
ACTOR_ERRORS: tuple[type[BaseException], ...] = (ray.exceptions.RayActorError,)


def backoff(budget_s: float, first_s: float = 0.05, cap_s: float = 2.0) -> Iterator[float]:
    """Yield pauses that double from ``first_s`` up to ``cap_s``, while they fit in the budget."""
    deadline = time.monotonic() + budget_s
    delay = first_s
    while time.monotonic() + delay <= deadline:
        yield delay
        delay = min(2 * delay, cap_s)


def own_error(error: BaseException) -> BaseException:
    """Return the metricsvc error that ``error`` carries when it is Ray's wrapper of one
    raised in an actor (``RayTaskError(BatchRejected)``, whose text is the remote
    traceback): the actor's own exception, its one-line message intact, with the wrapper
    (and so the remote traceback) as its ``__cause__``. Any other error as it is."""
    cause = getattr(error, "cause", None)
    if cause is error or not isinstance(cause, MetricsvcError):
        return error
    cause.__cause__ = error
    cause.__suppress_context__ = True
    return cause


def ray_get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get(ref)``, raising what the actor raised as metricsvc's own exception."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as err:
        own = own_error(err)
        if own is err:
            raise
        raise own from err


def next_pause(err: BaseException, method: str, pauses: Iterator[float], budget_s: float,
               label: str) -> float:
    """The pause before trying ``method`` again after ``err`` said the actor is down: the
    one retry rule of every caller.

    Raises:
        ServiceUnavailable: at once if the actor is dead for good; else once the pauses
            (a ``backoff`` over ``budget_s``) are spent.
    """
    if isinstance(err, ray.exceptions.ActorDiedError):
        why = [line.strip() for line in str(err).splitlines() if line.strip()][-1:]
        raise ServiceUnavailable(f"{label} ({method}): it is dead for good "
                                 f"({why[0] if why else 'no restarts left'})") from err
    delay = next(pauses, None)
    if delay is None:
        raise ServiceUnavailable(f"{label} unreachable for {budget_s} s ({method}): {err}") from err
    return delay


def call(target: Callable[[], Any], method: str, *args: Any, retry_s: float,
         timeout_s: float | None = None, label: str = "MetricWorker") -> Any:
    """Call ``target().method(*args)`` and wait for it, trying again while the actor
    restarts. ``timeout_s`` bounds the whole call, retries included; ``retry_s`` the
    waiting for a restart.

    Raises:
        ServiceUnavailable: the actor is dead for good, or unreachable for ``retry_s``.
        GetTimeoutError: the call ran past ``timeout_s``.
        Whatever the actor method raised, as its own exception.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pauses = backoff(retry_s if timeout_s is None else min(retry_s, timeout_s))
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return ray_get(getattr(target(), method).remote(*args), timeout=left)
        except ACTOR_ERRORS as err:
            delay = next_pause(err, method, pauses, retry_s, label)
            if deadline is not None and time.monotonic() + delay >= deadline:
                raise ray.exceptions.GetTimeoutError(
                    f"{label} ({method}): no answer within {timeout_s} s") from err
            log.warning("%s unreachable (%s), retrying in %.2f s", label, method, delay)
            time.sleep(delay)


# -- the restart protocol -------------------------------------------------------------------
class Outbox:
    """What a sender owes a restartable MetricWorker: the incarnation it last heard from and
    every payload sent whose step the journal may not hold yet (at most ``limit``)."""

    def __init__(self, limit: int = 256, label: str = "sender") -> None:
        self.epoch: str | None = None
        self.limit = limit
        self.label = label
        self.resent = 0
        self._owed: list[tuple[int, Any]] = []

    def __len__(self) -> int:
        return len(self._owed)

    def sent(self, step: int, payload: Any) -> None:
        """Owe ``payload`` (of ``step``) until an ack says the journal holds that step."""
        self._owed.append((step, payload))
        if len(self._owed) > self.limit:
            dropped, _ = self._owed.pop(0)
            log.warning("%s: more than %d steps not yet journaled; step %d can no longer be "
                        "resent after a restart", self.label, self.limit, dropped)

    def drop(self, payload: Any) -> None:
        """Stop owing ``payload`` (refused: resending it cannot help)."""
        self._owed = [(s, p) for s, p in self._owed if p is not payload]

    def heard(self, ack: Ack) -> None:
        """Take the incarnation and the journal's progress from an ack."""
        self.epoch = ack.get("epoch", self.epoch)
        durable = ack.get("durable_through")
        if durable is not None:
            self._owed = [(s, p) for s, p in self._owed if s > durable]

    def newest(self) -> Any:
        """Return the newest payload still owed (None: nothing is)."""
        return self._owed[-1][1] if self._owed else None

    def owed(self, durable_through: int | None) -> list[Any]:
        """Return, oldest first, what a new incarnation whose journal holds steps up to
        ``durable_through`` may lack."""
        return [p for s, p in self._owed if durable_through is None or s > durable_through]

    def exchange(self, payload: Any) -> Generator[Any, Ack, Ack]:
        """Send ``payload`` (already ``sent``): yield each payload to send, with ``epoch``,
        and receive its ack; return the ack of ``payload``."""
        ack = mine = yield payload
        while ack.get("status") == "epoch_changed":  # another incarnation: what it lacks first
            self.epoch = ack["epoch"]
            mine = None
            for old in self.owed(ack.get("durable_through")):
                ack = yield old
                if ack.get("status") == "epoch_changed":
                    break  # restarted again meanwhile: start over with the newest incarnation
                if old is payload:
                    mine = ack
                else:
                    self.resent += 1
            else:
                if mine is None:  # not owed (an unsent payload): it goes after the older ones
                    ack = mine = yield payload
        self.heard(ack)
        return mine


def is_stale(heard: str | None, epoch: str) -> bool:
    """Return True if a sender that last heard from incarnation ``heard`` talks to
    incarnation ``epoch`` (None: a sender's first call): it is told ``epoch_changed``."""
    return heard is not None and heard != epoch
