"""Fan finished steps out to sinks, one sink thread and bounded queue per sink (``delivery``).

Nothing here runs on the actor's merge path: ``publish`` only enqueues. Each
sink sees each step once and in increasing order. A sink that raises is
retried with exponential backoff; when the retries are spent (or its queue is
full, or the service is closing) the step goes to the dead-letter JSONL in the
run folder instead. Other sinks never wait for a failing one.

Restarts: each sink's watermark (the newest step its backend has made durable, as
``commit`` reports it) is kept in the run folder (``SinkState``) and advanced only
after that commit. A restarted service hands the journal to the dispatcher
(``replay``): each sink first reopens the same backend run, is told its watermark
(``resume``, which lets a sink that can read its backend leave out what it already
holds), and is then given every journaled step past the watermark, before any new one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from metricsvc.core.errors import ServiceUnavailable
from metricsvc.core.redaction import Redactor
from metricsvc.sinks.base import DeliveryConfig, Sink
from metricsvc.sinks.delivery import Rewound, SinkDelivery, thread_cpu_s
from metricsvc.storage.history import Rewind, RunHistory
from metricsvc.storage.sink_state import DeadLetter


class SinkDispatcher:
    """Queue finished steps for every sink; each sink is served by its own thread."""

    def __init__(
        self, sinks: Sequence[Sink], run_dir: Path, delivery: DeliveryConfig | None = None,
        redactor: Redactor | None = None,
        replay: Callable[[], Iterator[dict[str, Any]]] | None = None,
        history: RunHistory | None = None,
    ) -> None:
        """``replay``: reads the journal's step records when this continues a run (after a
        restart; each sink reads it in its own pass); each sink then continues its backend
        run and gets what it lacks. ``history``: the run's, as its journal records it."""
        self.run_dir = run_dir
        delivery = self.delivery = delivery or DeliveryConfig()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.dead_letter = DeadLetter(run_dir / delivery.dead_letter)
        redactor = redactor or Redactor()
        self.history = history or RunHistory()
        self._deliveries = [SinkDelivery(s, run_dir, delivery, self.dead_letter, redactor,
                                     self.history, replay) for s in sinks]
        self._closed = False

    @property
    def sinks(self) -> list[Sink]:
        return [w.sink for w in self._deliveries]

    def publish(self, step: int, metrics: dict[str, float], meta: dict[str, Any]) -> None:
        """Queue one finished step for every sink; never blocks."""
        if not self._closed:
            for delivery in self._deliveries:
                delivery.put(("write", step, metrics, meta))

    def event(self, event: dict[str, Any]) -> None:
        """Queue a journal event (sinks without ``write_event`` ignore it)."""
        if not self._closed:
            for delivery in self._deliveries:
                delivery.put(("event", event))

    def rewind(self, rewind: Rewind, wait_for: Sink | None,
               timeout_s: float | None = 30.0) -> None:
        """Begin a new segment of the run's history: queued for every sink, in order with
        the steps around it; return once ``wait_for`` (the journal) has recorded it.

        Raises:
            ServiceUnavailable: ``wait_for`` could not record it (the error is named), or
                not within ``timeout_s``.
        """
        if self._closed:
            raise ServiceUnavailable("the service is closed: no rewind")
        done = Rewound(wait_for)
        first = [w for w in self._deliveries if w.sink is wait_for]
        for delivery in first:  # recorded first: a rewind the journal lacks never happened
            delivery.put(("rewind", rewind, done))
        done.wait(timeout_s)
        self.history.rewound(rewind)
        for delivery in self._deliveries:
            if delivery.sink is not wait_for:
                delivery.put(("rewind", rewind, done))

    def flush(self, timeout_s: float | None = 30.0) -> bool:
        """Wait until every sink has handled everything queued so far; True if all did."""
        if self._closed:
            return True
        events = []
        for delivery in self._deliveries:
            done = threading.Event()
            delivery.put(("flush", done))
            events.append(done)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return all(
            e.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            for e in events
        )

    def close(self, timeout_s: float | None = None) -> None:
        """Drain every queue and close every sink, all within one ``timeout_s`` (default:
        ``delivery.close_timeout_s``); what a sink has not taken by then is dead-lettered.
        A second call is harmless."""
        if self._closed:
            return
        self._closed = True
        timeout_s = self.delivery.close_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        for delivery in self._deliveries:
            delivery.begin_close()
        for delivery in self._deliveries:
            delivery.finish_close(deadline)

    def last_step(self, sink: Sink) -> int | None:
        """Return the last step of the current segment ``sink`` (one of this dispatcher's)
        has written (None if none yet, or not one of them)."""
        for delivery in self._deliveries:
            if delivery.sink is sink:
                return delivery.stats["last_step"]
        return None

    def health(self) -> dict[str, dict[str, Any]]:
        """Return each sink's delivery record: written, failures, dead-lettered, last error,
        and the CPU its thread has spent (``cpu_s``)."""
        return {
            w.name: {**w.stats, "queued": w.queue.qsize(), "failing": w.stats["failures"] > 0,
                     "cpu_s": thread_cpu_s(w.thread)}
            for w in self._deliveries
        }

    @property
    def errors(self) -> dict[str, dict[str, Any]]:
        """Return the records of the sinks that have failed at least once or that some step
        did not reach (dead-lettered: a full queue, a close that gave up; or lost)."""
        return {name: h for name, h in self.health().items()
                if h["failures"] or h["dead_lettered"] or h["lost"]}
