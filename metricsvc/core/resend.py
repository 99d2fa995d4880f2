"""The restart protocol, written once for every sender (a rank's client, a node's combiner).

A MetricWorker that Ray restarts loses the steps its journal did not hold yet. So a
sender keeps every batch it sent until an ack says the journal holds its step
(``durable_through``), and names in each call the incarnation it last heard from
(``epoch``). A new incarnation merges nothing from a sender that names another one: it
answers ``epoch_changed``, and the sender first resends what it still owes, oldest first,
then the batch it was sending, so no new step can finish ahead of an older one it needs.

``deliver`` is that exchange without any I/O: a generator that yields what to send and is
sent the answers. The client drives it with blocking Ray calls, the combiner with awaited
ones; both keep their batches in an ``Outbox``.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

log = logging.getLogger(__name__)

Ack = dict[str, Any]


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
        """Stop owing ``payload`` (the service refused it: resending cannot help)."""
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


def is_stale(heard: str | None, epoch: str) -> bool:
    """Return True if a sender that last heard from incarnation ``heard`` talks to
    incarnation ``epoch``: it is told ``epoch_changed`` and nothing is taken, so that it
    resends what the new incarnation lacks first (None: a sender's first call)."""
    return heard is not None and heard != epoch


def deliver(outbox: Outbox, payload: Any) -> Generator[Any, Ack, Ack]:
    """Send ``payload`` (already ``outbox.sent``); yield each payload to send, with
    ``outbox.epoch``, and receive its ack; return the ack of ``payload``."""
    ack = mine = yield payload
    while ack.get("status") == "epoch_changed":  # another incarnation: what it may lack first
        outbox.epoch = ack["epoch"]
        mine = None
        for old in outbox.owed(ack.get("durable_through")):
            ack = yield old
            if ack.get("status") == "epoch_changed":
                break  # restarted again meanwhile: start over with the newest incarnation
            if old is payload:
                mine = ack
            else:
                outbox.resent += 1
        else:
            if mine is None:  # not owed (an unsent payload): it goes after the older ones
                ack = mine = yield payload
    outbox.heard(ack)
    return mine
