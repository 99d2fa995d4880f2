"""The delivery of finished steps to one sink: its bounded queue, its sink thread, its
retries, dead letters and watermark (``SinkDispatcher`` holds one per sink).

Only the sink thread touches the sink. Each step of the run's current segment reaches the
sink once, in increasing order (``Watermark.holds``); a sink that raises is retried with
backoff and then dead-lettered; a rewind is recorded by the journal before anything else
is rewound (``Rewound``).
"""

from __future__ import annotations

import atexit
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from metricsvc.core.errors import ServiceUnavailable
from metricsvc.core.redaction import Redactor
from metricsvc.sinks.base import DeliveryConfig, Sink
from metricsvc.sinks.names import public_metrics
from metricsvc.storage.history import Rewind, RunHistory
from metricsvc.storage.sink_state import DeadLetter, SinkState, Watermark

log = logging.getLogger(__name__)

STOP = object()
_COMMIT_EVERY = 32  # writes between commits while a queue stays busy (one when it drains)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def thread_cpu_s(thread: threading.Thread) -> float | None:
    """The CPU seconds ``thread`` has spent (a sink thread: writing, committing, waking for
    each step), read from its CPU clock; None once it has ended, or where the platform has
    no per-thread clock."""
    ident = thread.ident
    if ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError):  # no pthread_getcpuclockid (macOS), or it just ended
        return None


class SinkCalls:
    """The calls of one sink, from its thread: the sink opened on first use (its delivery's
    close then registered at exit), a failing call retried with backoff that a close cuts
    short, every error redacted and counted in the delivery record (``stats``)."""

    def __init__(self, sink: Sink, run_dir: Path, delivery: DeliveryConfig, stats: dict,
                 redact: Callable[[str], str], close: Callable[[float], None]) -> None:
        self.sink, self.run_dir, self.delivery = sink, run_dir, delivery
        self.stats, self.redact, self._close = stats, redact, close
        self.opened = False
        self.closing = threading.Event()

    def attempt(self, call: Any, retry: bool = False) -> str | None:
        """Run ``call`` (opening the sink first if needed); return the last error or None."""
        tries = 1 + (self.delivery.retries if retry else 0)
        error = None
        for attempt in range(tries):
            try:
                if not self.opened:
                    self.sink.open(self.run_dir)
                    self.opened = True
                    # Registered after open, so it runs before any exit hook the backend
                    # registered while opening (atexit is LIFO): wandb's teardown, say.
                    atexit.register(self._close, 10.0)
                call()
                return None
            except Exception as err:  # a sink must never take the service down
                error = self.redact(f"{type(err).__name__}: {err}")
                self.stats["failures"] += 1
                self.stats["last_error"] = error
                log.warning("sink %s failed (attempt %d/%d): %s", self.sink.name,
                            attempt + 1, tries, error)
                if attempt + 1 < tries and not self.closing.is_set():
                    pause = min(self.delivery.max_backoff_s, self.delivery.backoff_s * 2**attempt)
                    self.closing.wait(pause)  # a close cuts the backoff short
                elif self.closing.is_set():
                    break
        return error


class SinkDelivery:
    """One sink, its queue, its thread (the sink thread), its delivery record.

    Only the thread touches the sink, ``close`` included, so a sink is never closed
    while one of its writes runs. A close that gives up (the sink still busy at the
    deadline) dead-letters every step the sink has not taken, the one in flight too.
    """

    def __init__(self, sink: Sink, run_dir: Path, delivery: DeliveryConfig, dead: DeadLetter,
                 redactor: Redactor, history: RunHistory,
                 replay: Callable[[], Iterator[dict[str, Any]]] | None = None):
        self.sink = sink
        self.replay = replay  # None: a new run; else reads the journal of the run to continue
        self.state = SinkState(run_dir, sink.name)
        self.redact = redactor.text  # errors may quote a URI with its password
        self.name, self.run_dir, self.delivery, self.dead = sink.name, run_dir, delivery, dead
        self.allow_nan = bool(getattr(sink, "supports_nan", False))
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=delivery.queue_size)
        self.closed = self._abandoned = False
        self._lock = threading.Lock()  # the hand-over between the thread and a closer
        self._current: tuple | None = None
        self._backlog: Iterator[tuple] = iter(())  # the replay's steps not yet given
        self._uncommitted = 0
        self.stats = {"written": 0, "failures": 0, "dead_lettered": 0, "lost": 0,
                      "in_flight_at_close": 0, "last_step": None, "last_error": None,
                      "durable_through": None, "replayed": 0, "missing": None}
        self.mark = Watermark(self.state, self.stats, self.name, self.redact, history)
        self.calls = SinkCalls(sink, run_dir, delivery, self.stats, self.redact, self.close)
        self.thread = threading.Thread(target=self._serve, name=f"metricsvc-sink-{self.name}",
                                       daemon=True)
        self.thread.start()

    # -- producer side -----------------------------------------------------------------
    def put(self, item: tuple) -> None:
        if item[0] == "rewind":  # never dropped: the thread makes room
            self.queue.put(item)
            return
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            if item[0] == "write":
                self._dead_letter(item, f"queue full ({self.delivery.queue_size} steps waiting)")

    # -- consumer side -----------------------------------------------------------------
    def _serve(self) -> None:
        if self.replay is not None:
            self._continue_run(self.replay())
            self.replay = None
        while True:
            if self.queue.empty() and self._uncommitted:
                self._commit()
            item = self.queue.get()
            if item is STOP:
                break
            with self._lock:
                if self._abandoned:
                    break
                self._current = item
            kind = item[0]
            if kind == "flush":
                self._commit()  # a flush returns once what was written is durable
                item[1].set()
            elif kind == "write":
                self._deliver_step(item)
            elif kind == "event" and hasattr(self.sink, "write_event"):
                self.calls.attempt(functools.partial(self.sink.write_event, item[1]))
            elif kind == "rewind":
                self._rewind(*item[1:])
            with self._lock:
                self._current = None
                if self._abandoned:
                    break
        if self.calls.opened:
            if not self._abandoned:
                self._commit()
            error = self.calls.attempt(self.sink.close)
            if error is not None:
                log.error("sink %s failed to close: %s", self.name, error)
            elif not self._abandoned:
                self.mark.advance(self.stats["last_step"])  # closing flushes what was written

    def _continue_run(self, journal: Iterator[dict[str, Any]]) -> None:
        """Reopen the backend run, give it the rewinds it missed, then replay the journal
        past the watermark."""
        floor = self.mark.load()
        with self._lock:  # from here a closer that gives up dead-letters what it lacks
            self._backlog = self._past_floor(journal)
        resume = getattr(self.sink, "resume", None)  # without it, the attempt opens the sink
        error = self.calls.attempt(lambda: resume and resume(floor), retry=True)
        if error is not None:
            log.error("sink %s could not continue the run: %s", self.name, error)
        # Rewinds the journal recorded that this sink never took (the service ended between
        # the journal's turn and the sink's): given first, oldest first, or the rerun's
        # steps would pass for steps it holds (TensorBoard's events past the rewound step)
        rewind = getattr(self.sink, "rewind", None)
        missed = self.mark.missed if rewind is not None else []
        errors = [self.calls.attempt(functools.partial(rewind, r.to_step), retry=True)
                  for r in missed]
        if not any(errors):
            self.mark.caught_up()
        held_through = getattr(self.sink, "held_through", None)
        if held_through is not None and self.calls.opened:  # it can read back its content
            self.mark.believe_content(held_through())
        first = None
        while True:
            with self._lock:  # a closer that gives up dead-letters the rest of the backlog
                item = None if self._abandoned else next(self._backlog, None)
                if item is None:
                    break
                self._current = item
            first = item[1] if first is None else first
            self._deliver_step(item)
            self.stats["replayed"] += 1
            with self._lock:
                self._current = None
        if self.stats["replayed"]:
            log.warning("sink %s: %d journaled steps replayed after a restart, from step %s",
                        self.name, self.stats["replayed"], first)
        self._commit()

    def _past_floor(self, journal: Iterator[dict[str, Any]]) -> Iterator[tuple]:
        """The journaled steps past the sink's floor, one at a time, the floor read at the
        first: after the sink's resume has settled it (what its content holds), or, for a
        closer that gives up while the sink still reopens, the saved watermark."""
        floor = self.mark.floor
        for r in journal:
            if floor is None or r["step"] > floor:
                yield "write", r["step"], r["metrics"], r["meta"]

    def _commit(self) -> None:
        """Ask the sink to make its writes durable; advance the watermark to what it says."""
        self._uncommitted = 0
        last = self.stats["last_step"]
        if not self.calls.opened or last is None:
            return
        commit = getattr(self.sink, "commit", None)
        said: list[int | None] = [None]
        if commit is not None:
            if self.calls.attempt(lambda: said.__setitem__(0, commit())) is not None:
                return  # the sink could not say: the watermark stays
        durable = said[0]
        self.mark.advance(last if durable is None else min(durable, last))

    def _rewind(self, rewind: Rewind, done: Rewound) -> None:
        """A new segment of the run's history begins: the journal records it, the backend
        is told (where it can show a rerun), and the watermark goes back, so a restart
        replays the rerun. ``done`` hears the outcome."""
        error = None
        if hasattr(self.sink, "write_event"):  # the journal: the history's own record
            error = self.calls.attempt(
                functools.partial(self.sink.write_event, rewind.event()), retry=True)
            if error is not None:  # not recorded: nothing is rewound (the caller hears it)
                done.heard(self.sink, error)
                return
        if self.calls.opened and hasattr(self.sink, "rewind"):
            error = self.calls.attempt(functools.partial(self.sink.rewind, rewind.to_step))
        if error is not None:
            log.error("sink %s could not rewind to step %d: %s", self.name, rewind.to_step,
                      error)
        self.mark.back_to(rewind.to_step)
        done.heard(self.sink, error)

    def _deliver_step(self, item: tuple) -> None:
        _, step, metrics, meta = item
        if self.mark.holds(step):
            return  # each step of a segment once, in increasing order
        visible = public_metrics(metrics, self.allow_nan)
        error = self.calls.attempt(lambda: self.sink.write(step, visible, meta), retry=True)
        with self._lock:
            if self._abandoned:  # a closer gave up meanwhile and dead-lettered this step
                return
            if error is None:
                self.stats["written"] += 1
                self.stats["last_step"] = step
                self._uncommitted += 1
                self.mark.written(step)
        if error is not None:
            self._dead_letter(item, error, visible)
        elif self._uncommitted >= _COMMIT_EVERY:
            self._commit()

    def _dead_letter(self, item: tuple, error: str, visible: dict | None = None) -> None:
        """Keep the step exactly as the sink would have received it, for a later replay."""
        _, step, metrics, meta = item
        if visible is None:
            visible = public_metrics(metrics, self.allow_nan)
        self.stats["last_error"] = error  # why a step did not reach the sink: health shows it
        try:
            self.dead.write(self.name, step, {"metrics": visible, "meta": meta}, error)
            self.stats["dead_lettered"] += 1
        except OSError as err:
            self.stats["lost"] += 1
            log.error("sink %s lost step %s: its dead-letter write failed too: %s",
                      self.name, step, self.redact(str(err)))

    def close(self, timeout_s: float | None) -> None:
        """Close within ``timeout_s``: see ``begin_close`` and ``finish_close``."""
        self.begin_close()
        self.finish_close(None if timeout_s is None else time.monotonic() + timeout_s)

    def begin_close(self) -> None:
        """Stop taking steps: the thread finishes what is queued, then closes the sink."""
        if self.closed:
            return
        self.closed = True
        self.calls.closing.set()  # cuts retry backoffs short: a failing sink dead-letters now
        try:
            self.queue.put_nowait(STOP)
        except queue.Full:
            pass  # finish_close makes room

    def finish_close(self, deadline: float | None) -> None:
        """Wait until ``deadline``; then dead-letter whatever the sink has not taken."""
        self.thread.join(_left(deadline))
        if not self.thread.is_alive():
            return
        with self._lock:
            self._abandoned = True
            current = self._current
            waiting = list(self._backlog)  # journaled steps its replay never reached
            self._backlog = iter(())
        while True:
            try:
                waiting.append(self.queue.get_nowait())
            except queue.Empty:
                break
        why = f"the sink was still busy when close gave up ({self.delivery.close_timeout_s} s)"
        # Each step once: the journal the replay reads also holds the steps finished since
        # the restart, which the queue holds too (the sink would have skipped them there)
        last, count = None, 0
        if current is not None and current[0] == "write":
            self.stats["in_flight_at_close"] += 1
            self._dead_letter(current, f"{why}, writing this step: it may also have reached "
                                       f"the sink")
            last, count = current[1], 1
        for item in waiting:
            if item is not STOP and item[0] == "write":
                if last is None or item[1] > last:
                    self._dead_letter(item, f"not written: {why}")
                    last, count = item[1], count + 1
            elif item is not STOP and item[0] == "rewind":  # a rerun's steps follow
                item[2].heard(self.sink, f"not rewound: {why}")
                last = None if last is None else min(last, item[1].to_step)
            elif item is not STOP and item[0] == "flush":
                item[1].set()
        self.queue.put_nowait(STOP)  # the thread closes the sink once its write returns
        log.error("sink %s: close gave up after %s s; %d steps dead-lettered", self.name,
                  self.delivery.close_timeout_s, count)


class Rewound:
    """The outcome of a rewind at the sink that must record it (the journal)."""

    def __init__(self, sink: Sink | None) -> None:
        self.sink = sink
        self.error: str | None = None
        self._done = threading.Event()
        if sink is None:
            self._done.set()

    def heard(self, sink: Sink, error: str | None) -> None:
        if sink is self.sink:
            self.error = error
            self._done.set()

    def wait(self, timeout_s: float | None) -> None:
        if not self._done.wait(timeout_s):
            raise ServiceUnavailable(f"the rewind was not journaled within {timeout_s} s "
                                     f"(sink {self.sink.name} busy)")  # type: ignore[union-attr]
        if self.error is not None:
            raise ServiceUnavailable(f"the rewind could not be journaled: {self.error}")


