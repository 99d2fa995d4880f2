"""The hand-off of finished steps to the sinks: one thread and one bounded queue per sink.

Nothing here runs on the actor's merge path: ``publish`` only enqueues. Only a sink's own
thread touches the sink (``close`` included, so a sink is never closed while one of its
writes runs), and it sees each step of the run's current segment once, in increasing
order (``Watermark.holds``). A sink that raises is retried with exponential backoff; when
the retries are spent (or its queue is full, or the service is closing) the step goes to
the dead-letter JSONL in the run folder instead. Other sinks never wait for a failing one.

Restarts: each sink's watermark (the newest step its backend has made durable, as
``commit`` reports it) is kept in the run folder and advanced only after that commit. A
restarted service hands the journal to the dispatcher (``replay``): each sink first reopens
the same backend run, is told its watermark (``resume``, which lets a sink that can read
its backend leave out what it already holds), is given the rewinds it missed, and then
every journaled step past the watermark, before any new one. A rewind is recorded by the
journal before anything else is rewound.
"""

from __future__ import annotations

import atexit
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from metricsvc.core.declare import table_series
from metricsvc.core.keys import is_int, is_internal
from metricsvc.core.redaction import Redactor
from metricsvc.errors import ServiceUnavailable
from metricsvc.sinks.base import DeliveryConfig, Sink
from metricsvc.storage.files import DeadLetter, SinkState
from metricsvc.storage.history import Rewind, RunHistory

log = logging.getLogger(__name__)

_COMMIT_EVERY = 32  # writes between commits while a queue stays busy (one when it drains)


# -- what a sink thread is given ------------------------------------------------------------
class Write(NamedTuple):
    """A finished step to write."""

    step: int
    metrics: dict[str, float]
    meta: dict[str, Any]


class Event(NamedTuple):
    """A journal event (sinks without ``write_event`` pass it over)."""

    event: dict[str, Any]


class Flush(NamedTuple):
    """Set ``done`` once everything before is written and committed."""

    done: threading.Event


class NewSegment(NamedTuple):
    """A rewind: ``done`` hears how the sink that must record it did."""

    rewind: Rewind
    done: Rewound


STOP = object()  # the thread closes the sink and ends


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


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def public_metrics(metrics: Mapping[str, float], allow_nan: bool) -> dict[str, float]:
    """Return what a sink may see: no internal keys; non-finite values only if allowed."""
    out = {}
    for k, v in metrics.items():
        if ("__" not in k or not is_internal(k)) and (allow_nan or math.isfinite(v)):
            out[k] = v
    return out


def thread_cpu_s(thread: threading.Thread) -> float | None:
    """The CPU seconds ``thread`` has spent, from its CPU clock; None once it has ended, or
    where the platform has no per-thread clock."""
    ident = thread.ident
    if ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError):  # no pthread_getcpuclockid (macOS), or it just ended
        return None


class Watermark:
    """A sink's progress in the run's history: the last step written in the current segment
    (``last_step``), the newest step its backend has made durable (``durable_through``, kept
    with the segment current then in its ``SinkState``), where this incarnation started
    from (``floor``: what the sink holds of the current segment), and the steps the saved
    watermark claims but the content lacks (``missing``, reported until written)."""

    def __init__(self, state: SinkState, name: str, redact: Callable[[str], str],
                 history: RunHistory | None = None) -> None:
        self.state, self.name, self.redact = state, name, redact
        self.history = history or RunHistory()
        self.last_step: int | None = None
        self.durable_through: int | None = None
        self.missing: dict[str, Any] | None = None
        self.segment = self.history.segment  # advanced by each rewind this sink is given
        self.floor: int | None = None
        # The rewinds the journal recorded after the saved watermark's segment: the sink
        # may never have been given them (the service ended between the two), so its
        # backend may still show the steps they superseded (``load``)
        self.missed: list[Rewind] = []

    def load(self) -> int | None:
        """Start from the saved watermark (a restart), lowered by every rewind since it was
        saved; return it."""
        saved = self.state.load()
        through, segment = saved.get("durable_through"), saved.get("segment", 0)
        if not is_int(through):
            through = None
        if not isinstance(segment, int):
            segment = 0
        self.floor = self.durable_through = self.history.holds_through(through, segment)
        self.missed = self.history.rewinds[max(segment, 0):]
        return self.floor

    def caught_up(self) -> None:
        """The sink was given the rewinds it missed: save its watermark in the current
        segment, so that a later restart does not give them again."""
        if self.missed:
            self.missed = []
            self._save(self.durable_through)

    def believe_content(self, held: int | None) -> None:
        """The sink read back what it holds of the current segment (``held``: its last
        step): believe that, not the saved watermark, which past the content would make it
        skip steps for good."""
        if self.floor is not None and (held is None or held < self.floor):
            first = 0 if held is None else held + 1
            self.missing = {
                "steps": list(range(first, min(self.floor, first + 999) + 1)),
                "count": self.floor - first + 1,
                "reason": f"the watermark said the file held steps through {self.floor}, "
                          f"but it ends at {held} (a torn, cut or lost tail); a step ranks "
                          f"send again is written again"}
            log.error("sink %s: %s", self.name, self.missing["reason"])
        self.floor = self.durable_through = held

    def holds(self, step: int) -> bool:
        """Return True if the sink already holds ``step`` of the current segment."""
        last = self.floor if self.last_step is None else self.last_step
        return last is not None and step <= last

    def written(self, step: int) -> None:
        """Count ``step`` as written in the current segment: it is no longer missing."""
        self.last_step = step
        missing = self.missing
        if missing is not None and step in missing["steps"]:
            missing["steps"].remove(step)
            missing["count"] -= 1
            if not missing["count"]:
                self.missing = None

    def advance(self, through: int | None) -> None:
        """Save ``through`` as durable, if it is progress."""
        known = self.durable_through
        if through is None or through < 0 or (known is not None and through <= known):
            return  # nothing durable yet, or no progress
        self._save(through)
        self.durable_through = through

    def back_to(self, step: int) -> None:
        """A new segment begins after ``step`` (a rewind): the sink holds at most ``step``
        of it; saved too, so a restart replays the rerun."""
        self.segment += 1
        held = None if step < 0 else step
        if self.last_step is not None and self.last_step > step:
            self.last_step = held
        if self.durable_through is not None and self.durable_through > step:
            self.durable_through = held
        if self.floor is not None and self.floor > step:
            self.floor = held
        self._save(self.durable_through)

    def report(self) -> dict[str, Any]:
        """What ``health()`` shows of it."""
        return {"last_step": self.last_step, "durable_through": self.durable_through,
                "missing": self.missing}

    def _save(self, through: int | None) -> None:
        try:
            self.state.update(durable_through=through, segment=self.segment)
        except OSError as err:
            log.error("sink %s: its watermark could not be saved: %s", self.name,
                      self.redact(str(err)))


class SinkDelivery:
    """One sink, its queue, its thread, its retries and its record (``counts``, and the
    sink's ``Watermark`` in the run's history). A close that gives up (the sink still busy
    at the deadline) dead-letters every step the sink has not taken, the one in flight too."""

    def __init__(self, name: str, sink: Sink, run_dir: Path, delivery: DeliveryConfig,
                 dead: DeadLetter, redactor: Redactor, history: RunHistory,
                 replay: Callable[[], Iterator[dict[str, Any]]] | None = None):
        self.sink, self.name, self.run_dir = sink, name, run_dir
        self.delivery, self.dead, self.redact = delivery, dead, redactor.text
        self.replay = replay  # None: a new run; else reads the journal of the run to continue
        self.allow_nan = bool(getattr(sink, "supports_nan", False))
        # False: the sink shows a step's tables instead of the scalars they carry
        self.table_series = bool(getattr(sink, "table_series", True))
        self._tabled: tuple[tuple, frozenset[str]] = ((), frozenset())
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=delivery.queue_size)
        self.mark = Watermark(SinkState(run_dir, name), name, self.redact, history)
        self.counts: dict[str, Any] = {"written": 0, "failures": 0, "dead_lettered": 0,
                                       "lost": 0, "in_flight_at_close": 0, "replayed": 0,
                                       "last_error": None}
        self.opened = self.closed = self._abandoned = False
        self.closing = threading.Event()  # set by a close: retries stop waiting
        self._lock = threading.Lock()  # the hand-over between the thread and a closer
        self._current: Any = None
        self._backlog: Iterator[Write] = iter(())  # the replay's steps not yet given
        self._uncommitted = 0
        self.thread = threading.Thread(target=self._serve, name=f"metricsvc-sink-{self.name}",
                                       daemon=True)
        self.thread.start()

    def health(self) -> dict[str, Any]:
        return {**self.counts, **self.mark.report(), "queued": self.queue.qsize(),
                "failing": self.counts["failures"] > 0, "cpu_s": thread_cpu_s(self.thread)}

    # -- producer side -----------------------------------------------------------------
    def put(self, item: Any) -> None:
        if isinstance(item, NewSegment):  # never dropped: the thread makes room
            self.queue.put(item)
            return
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            if isinstance(item, Write):
                self._dead_letter(item, f"queue full ({self.delivery.queue_size} steps waiting)")

    # -- the sink thread ---------------------------------------------------------------
    def attempt(self, call: Callable[..., Any], *args: Any, retry: bool = False) -> str | None:
        """Run ``call(*args)`` (opening the sink first if needed); return the last error or
        None."""
        tries = 1 + (self.delivery.retries if retry else 0)
        error = None
        for attempt in range(tries):
            try:
                if not self.opened:
                    self.sink.open(self.run_dir)
                    self.opened = True
                    # Registered after open, so it runs before any exit hook the backend
                    # registered while opening (atexit is LIFO): wandb's teardown, say.
                    atexit.register(self.close, 10.0)
                call(*args)
                return None
            except Exception as err:  # a sink must never take the service down
                error = self.redact(f"{type(err).__name__}: {err}")
                self.counts["failures"] += 1
                self.counts["last_error"] = error
                log.warning("sink %s failed (attempt %d/%d): %s", self.name, attempt + 1,
                            tries, error)
                if attempt + 1 < tries and not self.closing.is_set():
                    pause = min(self.delivery.max_backoff_s, self.delivery.backoff_s * 2**attempt)
                    self.closing.wait(pause)  # a close cuts the backoff short
                elif self.closing.is_set():
                    break
        return error

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
            if isinstance(item, Write):
                self._write(item)
            elif isinstance(item, Flush):
                self._commit()  # a flush returns once what was written is durable
                item.done.set()
            elif isinstance(item, Event):
                if hasattr(self.sink, "write_event"):
                    self.attempt(self.sink.write_event, item.event)  # type: ignore[attr-defined]
            else:
                self._new_segment(item)
            with self._lock:
                self._current = None
                if self._abandoned:
                    break
        if self.opened:
            if not self._abandoned:
                self._commit()
            error = self.attempt(self.sink.close)
            if error is not None:
                log.error("sink %s failed to close: %s", self.name, error)
            elif not self._abandoned:
                self.mark.advance(self.mark.last_step)  # closing flushes what was written

    def _continue_run(self, journal: Iterator[dict[str, Any]]) -> None:
        """Reopen the backend run, give it the rewinds it missed, then replay the journal
        past the watermark."""
        floor = self.mark.load()
        with self._lock:  # from here a closer that gives up dead-letters what it lacks
            self._backlog = self._past_floor(journal)
        resume = getattr(self.sink, "resume", None)  # without it, the attempt opens the sink
        error = self.attempt(lambda: resume and resume(floor), retry=True)
        if error is not None:
            log.error("sink %s could not continue the run: %s", self.name, error)
        # Rewinds the journal recorded that this sink never took (the service ended between
        # the journal's turn and the sink's): given first, oldest first, or the rerun's
        # steps would pass for steps it holds (TensorBoard's events past the rewound step)
        rewind = getattr(self.sink, "rewind", None)
        missed = self.mark.missed if rewind is not None else []
        if not any([self.attempt(rewind, r.to_step, retry=True) for r in missed]):
            self.mark.caught_up()
        held_through = getattr(self.sink, "held_through", None)
        if held_through is not None and self.opened:  # it can read back its content
            self.mark.believe_content(held_through())
        first = None
        while True:
            with self._lock:  # a closer that gives up dead-letters the rest of the backlog
                item = None if self._abandoned else next(self._backlog, None)
                if item is None:
                    break
                self._current = item
            first = item.step if first is None else first
            self._write(item)
            self.counts["replayed"] += 1
            with self._lock:
                self._current = None
        if self.counts["replayed"]:
            log.warning("sink %s: %d journaled steps replayed after a restart, from step %s",
                        self.name, self.counts["replayed"], first)
        self._commit()

    def _past_floor(self, journal: Iterator[dict[str, Any]]) -> Iterator[Write]:
        """The journaled steps past the sink's floor, the floor read at the first: after the
        sink's resume has settled it, or (a closer that gives up while the sink still
        reopens) the saved watermark."""
        floor = self.mark.floor
        for r in journal:
            if floor is None or r["step"] > floor:
                yield Write(r["step"], r["metrics"], r["meta"])

    def _commit(self) -> None:
        """Ask the sink to make its writes durable; advance the watermark to what it says."""
        self._uncommitted = 0
        last = self.mark.last_step
        if not self.opened or last is None:
            return
        commit = getattr(self.sink, "commit", None)
        said: list[int | None] = [None]
        if commit is not None and self.attempt(lambda: said.__setitem__(0, commit())):
            return  # the sink could not say: the watermark stays
        self.mark.advance(last if said[0] is None else min(said[0], last))

    def _new_segment(self, item: NewSegment) -> None:
        """A new segment of the run's history begins: the journal records it, the backend
        is told (where it can show a rerun), and the watermark goes back, so a restart
        replays the rerun. ``item.done`` hears the outcome."""
        rewind, error = item.rewind, None
        if hasattr(self.sink, "write_event"):  # the journal: the history's own record
            error = self.attempt(self.sink.write_event, rewind.event(),  # type: ignore[attr-defined]
                                 retry=True)
            if error is not None:  # not recorded: nothing is rewound (the caller hears it)
                item.done.heard(self.sink, error)
                return
        if self.opened and hasattr(self.sink, "rewind"):
            error = self.attempt(self.sink.rewind, rewind.to_step)  # type: ignore[attr-defined]
        if error is not None:
            log.error("sink %s could not rewind to step %d: %s", self.name, rewind.to_step,
                      error)
        self.mark.back_to(rewind.to_step)
        item.done.heard(self.sink, error)

    def _write(self, item: Write) -> None:
        if self.mark.holds(item.step):
            return  # each step of a segment once, in increasing order
        visible = public_metrics(item.metrics, self.allow_nan)
        tables = item.meta.get("tables")
        if tables and not self.table_series:
            visible = self._untabled(visible, tables)
        error = self.attempt(self.sink.write, item.step, visible, item.meta, retry=True)
        with self._lock:
            if self._abandoned:  # a closer gave up meanwhile and dead-lettered this step
                return
            if error is None:
                self.counts["written"] += 1
                self._uncommitted += 1
                self.mark.written(item.step)
        if error is not None:
            self._dead_letter(item, error, visible)
        elif self._uncommitted >= _COMMIT_EVERY:
            self._commit()

    def _untabled(self, visible: dict[str, float],
                  tables: Mapping[str, Any]) -> dict[str, float]:
        """``visible`` without the names a step's tables carry (worked out once while the
        steps export the same names and tables); a table cut at its ``max_rows`` leaves its
        scalars in (the rows past the cut are nowhere else)."""
        whole = [name for name, t in tables.items() if not t.get("cut")]
        held = (tuple(visible), tuple(whole))  # a table's series is fixed by its name
        if self._tabled[0] != held:
            carried = [table_series(tables[name]["series"]) for name in whole]
            self._tabled = (held, frozenset(n for n in visible if any(c(n) for c in carried)))
        drop = self._tabled[1]
        return {k: v for k, v in visible.items() if k not in drop}

    def _dead_letter(self, item: Write, error: str, visible: dict | None = None) -> None:
        """Keep the step exactly as the sink would have received it, for a later replay."""
        if visible is None:
            visible = public_metrics(item.metrics, self.allow_nan)
        self.counts["last_error"] = error  # why a step did not reach the sink: health shows it
        try:
            self.dead.write(self.name, item.step, {"metrics": visible, "meta": item.meta}, error)
            self.counts["dead_lettered"] += 1
        except OSError as err:
            self.counts["lost"] += 1
            log.error("sink %s lost step %s: its dead-letter write failed too: %s",
                      self.name, item.step, self.redact(str(err)))

    # -- closing -----------------------------------------------------------------------
    def close(self, timeout_s: float | None) -> None:
        """Close within ``timeout_s``: see ``begin_close`` and ``finish_close``."""
        self.begin_close()
        self.finish_close(None if timeout_s is None else time.monotonic() + timeout_s)

    def begin_close(self) -> None:
        """Stop taking steps: the thread finishes what is queued, then closes the sink."""
        if self.closed:
            return
        self.closed = True
        self.closing.set()  # cuts retry backoffs short: a failing sink dead-letters now
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
        if isinstance(current, Write):
            self.counts["in_flight_at_close"] += 1
            self._dead_letter(current, f"{why}, writing this step: it may also have reached "
                                       f"the sink")
            last, count = current.step, 1
        for item in waiting:
            if isinstance(item, Write):
                if last is None or item.step > last:
                    self._dead_letter(item, f"not written: {why}")
                    last, count = item.step, count + 1
            elif isinstance(item, NewSegment):  # a rerun's steps follow
                item.done.heard(self.sink, f"not rewound: {why}")
                last = None if last is None else min(last, item.rewind.to_step)
            elif isinstance(item, Flush):
                item.done.set()
        self.queue.put_nowait(STOP)  # the thread closes the sink once its write returns
        log.error("sink %s: close gave up after %s s; %d steps dead-lettered", self.name,
                  self.delivery.close_timeout_s, count)


class SinkDispatcher:
    """Queue finished steps for every sink; each sink is served by its own thread."""

    def __init__(
        self, sinks: Mapping[str, Sink] | Sequence[Sink], run_dir: Path,
        delivery: DeliveryConfig | None = None,
        redactor: Redactor | None = None,
        replay: Callable[[], Iterator[dict[str, Any]]] | None = None,
        history: RunHistory | None = None,
    ) -> None:
        """``sinks``: by the name each is served under (a sequence: by their ``name``).
        ``replay``: reads the journal's step records when this continues a run (each sink
        reads it in its own pass); each sink then continues its backend run and gets what it
        lacks. ``history``: the run's, as its journal records it."""
        delivery = self.delivery = delivery or DeliveryConfig()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.dead_letter = DeadLetter(run_dir / delivery.dead_letter)
        self.history = history or RunHistory()
        named = sinks if isinstance(sinks, Mapping) else {s.name: s for s in sinks}
        self._deliveries = [SinkDelivery(name, s, run_dir, delivery, self.dead_letter,
                                         redactor or Redactor(), self.history, replay)
                            for name, s in named.items()]
        self._closed = False
        self._shut = threading.Event()  # set once close() has closed every sink

    @property
    def sinks(self) -> list[Sink]:
        return [d.sink for d in self._deliveries]

    def publish(self, step: int, metrics: dict[str, float], meta: dict[str, Any]) -> None:
        """Queue one finished step for every sink; never blocks."""
        if not self._closed:
            item = Write(step, metrics, meta)
            for delivery in self._deliveries:
                delivery.put(item)

    def event(self, event: dict[str, Any]) -> None:
        """Queue a journal event (sinks without ``write_event`` pass it over)."""
        if not self._closed:
            for delivery in self._deliveries:
                delivery.put(Event(event))

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
        item = NewSegment(rewind, Rewound(wait_for))
        first = [d for d in self._deliveries if d.sink is wait_for]
        for delivery in first:  # recorded first: a rewind the journal lacks never happened
            delivery.put(item)
        item.done.wait(timeout_s)
        self.history.rewound(rewind)
        for delivery in self._deliveries:
            if delivery.sink is not wait_for:
                delivery.put(item)

    def flush(self, timeout_s: float | None = 30.0) -> bool:
        """Wait until every sink has handled everything queued so far; True if all did
        (once a close has begun: once it has written or dead-lettered every step)."""
        if self._closed:
            return self._shut.wait(timeout_s)
        items = []
        for delivery in self._deliveries:
            items.append(Flush(threading.Event()))
            delivery.put(items[-1])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for item in items:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not item.done.wait(left):
                return False
        return True

    def close(self, timeout_s: float | None = None) -> None:
        """Drain every queue and close every sink, all within one ``timeout_s`` (default:
        ``delivery.close_timeout_s``); what a sink has not taken by then is dead-lettered.
        A second call is harmless."""
        if self._closed:
            return
        self._closed = True
        timeout_s = self.delivery.close_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            for delivery in self._deliveries:
                delivery.begin_close()
            for delivery in self._deliveries:
                delivery.finish_close(deadline)
        finally:
            self._shut.set()

    def wait_closed(self) -> None:
        """Return once ``close()`` has closed every sink (its timeout bounds the wait)."""
        self._shut.wait()

    def mark_of(self, sink: Sink) -> Watermark | None:
        """The watermark of ``sink`` (one of this dispatcher's; None if not one of them):
        its ``last_step`` is the last step of the current segment it has written."""
        return next((d.mark for d in self._deliveries if d.sink is sink), None)

    def health(self) -> dict[str, dict[str, Any]]:
        """Return each sink's delivery record: written, failures, dead-lettered, last error,
        its watermark, and the CPU its thread has spent (``cpu_s``)."""
        return {d.name: d.health() for d in self._deliveries}

    @property
    def errors(self) -> dict[str, dict[str, Any]]:
        """Return the records of the sinks that have failed at least once or that some step
        did not reach (dead-lettered: a full queue, a close that gave up; or lost)."""
        return {name: h for name, h in self.health().items()
                if h["failures"] or h["dead_lettered"] or h["lost"]}
