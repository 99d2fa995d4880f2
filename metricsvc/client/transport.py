"""A rank's closed steps, to the service: where they go (``ServiceHandle``: the
MetricWorker, or its node's combiner, found by name) and how (``Sender``: one delivery at
a time, in step order, through the restart protocol of ``metricsvc.calls``).

A closed step is handed to the sender, which makes the call on the caller's thread when
nothing is in flight (a process that ends right after its call returns must not lose it:
Ray connects to an actor on a handle's first call, after the call returns) and leaves the
answer to the caller's next call, which reads it if it is in by then (no thread wakes).
An answer not in by then, and steps handed over meanwhile, go to the sender thread, which
waits for each answer in turn. One delivery runs at a time, so steps reach the service in
order (Ray does not promise to run an actor's calls in the order sent). Every batch is kept
until an ack says the journal holds its step and is resent to a restarted actor that lacks
it; a refused one is dropped at once (resending cannot help).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import ray

from metricsvc.calls import ACTOR_ERRORS, Ack, Outbox, call, ray_get
from metricsvc.core.keys import combiner_name
from metricsvc.core.wire import Batch
from metricsvc.errors import ServiceUnavailable, is_refusal

# ``start(payload, epoch) -> Issued``: a batch's call, made now
Start = Callable[[bytes, "str | None"], "Issued"]
Answer = tuple[Batch, "Ack | None", "BaseException | None"]


class Issued:
    """A call made: ``poll()`` returns its answer if it is in (never waits), calling it
    waits for the answer; both raise what the call raised."""

    __slots__ = ("ref",)

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def poll(self) -> Any:
        """The answer if it is in, else None (an ack is a dict): one look."""
        try:
            return ray_get(self.ref, timeout=0)
        except ray.exceptions.GetTimeoutError:
            return None

    def __call__(self) -> Any:
        return ray_get(self.ref)


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
        """The combiner ``via`` names, this node's combiner (topology per_node; the rank
        registers with it) or the MetricWorker itself."""
        if self._target is None:
            label = self.via if self.via is not None else \
                ray.get_runtime_context().get_node_id()
            try:
                combiner = ray.get_actor(combiner_name(self.name, label),
                                         namespace=self.namespace)
            except ValueError:
                if self.via is not None:
                    raise ValueError(f"no combiner {self.via!r} for service {self.name!r}; "
                                     f"start it with metricsvc.start_combiner") from None
                self._target = self.metric_worker()
            else:
                ray.get(combiner.register.remote(self.rank))
                self._target = combiner
        return self._target

    def metric_worker(self) -> Any:
        """The MetricWorker itself (never a combiner): given, else found by name."""
        if self._given is None:
            try:
                self._given = ray.get_actor(self.name, namespace=self.namespace)
            except ValueError:  # not a bad batch (nothing to drop): no service to send to
                raise ServiceUnavailable(
                    f"no MetricWorker named {self.name!r} in namespace {self.namespace!r}: "
                    f"start it with metricsvc.start_metric_worker (or it was stopped)"
                ) from None
        return self._given

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """One call of the target, waited for, retried while the actor restarts."""
        self.calls += 1
        return call(lambda: self.target, method, *args, retry_s=self.retry_s,
                    timeout_s=timeout_s, label=f"MetricWorker {self.name!r}")

    def issue(self, method: str, *args: Any) -> Issued:
        """One call of the target, made now; returns the wait for its answer."""
        self.calls += 1
        return Issued(getattr(self.target, method).remote(*args))


class Sender:
    """The delivery of one client's batches; see the module's docstring."""

    def __init__(self, start: Start, again: Callable[[bytes, str | None], Ack], label: str,
                 max_inflight: int = 256,
                 position: Callable[[Batch], int] = lambda batch: batch.step) -> None:
        """``start`` makes a batch's call now; ``again`` makes it and waits, retrying while
        the actor restarts (a resend). ``position``: where a batch stands in the order acks'
        ``durable_through`` counts (a rank's step, a stream client's batch number)."""
        self._start, self._again = start, again
        self.label = label
        self._position = position
        # Sent but not yet in the service's journal (resent after a restart), and the
        # incarnation last heard from: the restart protocol, shared with the combiner.
        self.outbox = Outbox(max_inflight, label=label)
        # One lock, two conditions: callers wait on ``_cv`` for answers, the sender thread
        # on ``_work`` for its queue. An answer read at the caller's next call (the common
        # case) then wakes no thread.
        lock = self._lock = threading.RLock()
        self._cv = threading.Condition(lock)
        self._work = threading.Condition(lock)
        self._send_lock = threading.Lock()  # one delivery at a time: batches stay in order
        self._queue: deque[tuple[Batch, bytes, Issued | None]] = deque()
        self._answers: deque[Answer] = deque()
        self._pending: tuple[Batch, bytes, Issued] | None = None  # a call nobody waits on
        self.in_flight = 0  # handed over, not answered yet
        self._waiting = 0  # callers in ``wait_until``: the thread waits out a call made then
        self._thread: threading.Thread | None = None
        self.wakes = 0  # times the sender thread woke from waiting for work (counted)

    def hand_over(self, batch: Batch, blob: bytes) -> None:
        """Deliver ``batch`` without waiting: the call made here if nothing is in flight
        (its answer read at a later call), else queued for the sender thread."""
        self._settle()
        with self._lock:
            self.in_flight += 1
            issued = None
            if self.in_flight == 1 and self._send_lock.acquire(blocking=False):
                try:
                    self.outbox.sent(self._position(batch), blob)
                    issued = self._start(blob, self.outbox.epoch)
                except Exception:  # noqa: BLE001  the thread delivers it, retrying
                    self.outbox.drop(blob)
                finally:
                    self._send_lock.release()
            if issued is None or self._waiting:  # the thread delivers or waits it out
                self._to_thread((batch, blob, issued))
            else:
                self._pending = (batch, blob, issued)

    def _exchange(self, blob: bytes, issued: Issued | None = None) -> Ack:
        """The one delivery: ``blob`` (owed in the outbox) through the restart protocol, the
        first call's wait ``issued`` if a hand-over made it; returns its ack. Under the
        send lock."""
        exchange = self.outbox.exchange(blob)
        payload = next(exchange)
        while True:
            ack = None
            if issued is not None:  # the first call was made at the hand-over
                try:
                    ack = issued()
                except ACTOR_ERRORS:  # the actor is down: call again, waiting it out
                    pass
                issued = None
            if ack is None:
                ack = self._again(payload, self.outbox.epoch)
            try:
                payload = exchange.send(ack)
            except StopIteration as done:
                return done.value

    def _deliver(self, batch: Batch, blob: bytes, issued: Issued | None) -> Answer:
        """Deliver a handed-over batch; its answer (a refused one leaves the outbox; an
        undelivered one stays owed, for a restarted actor that lacks it)."""
        with self._send_lock:
            try:
                if issued is None:
                    self.outbox.sent(self._position(batch), blob)
                return batch, self._exchange(blob, issued), None
            except BaseException as err:  # noqa: BLE001  handed to the caller
                if is_refusal(err):
                    self.outbox.drop(blob)
                return batch, None, err

    def resend_owed(self) -> Ack | None:
        """Deliver again the newest batch the journal may lack (None: nothing is owed). The
        incarnation that has it answers ``duplicate``; one that lost it (a restart) answers
        ``epoch_changed`` and is sent everything owed, oldest first."""
        with self._send_lock:
            newest = self.outbox.newest()
            return None if newest is None else self._exchange(newest)

    def _to_thread(self, item: tuple[Batch, bytes, Issued | None], first: bool = False) -> None:
        """Queue ``item`` for the sender thread (started if idle); under the lock."""
        if first:
            self._queue.appendleft(item)
        else:
            self._queue.append(item)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"metricsvc-{self.label}-sender")
            self._thread.start()
        self._work.notify()

    def _settle(self) -> None:
        """Read the answer of the call a hand-over made, here, if it is in and of this
        incarnation; else leave it to the sender thread, which waits it out."""
        with self._lock:
            if self._pending is None:
                return
            batch, blob, issued = self._pending
            self._pending = None
            try:
                got = issued.poll()
            except BaseException:  # noqa: BLE001  a refusal or a down actor: the thread's
                got = None
            if got is None or got.get("status") == "epoch_changed":
                self._to_thread((batch, blob, issued), first=True)
                return
        with self._send_lock:  # what ``deliver`` does with an ack of this incarnation
            self.outbox.heard(got)
        self._answered((batch, got, None))

    def _answered(self, answer: Answer) -> None:
        with self._lock:
            self.in_flight -= 1
            self._answers.append(answer)
            self._cv.notify_all()

    def _loop(self) -> None:
        """The sender thread: deliver queued batches one at a time, oldest first."""
        while True:
            with self._lock:
                while not self._queue:
                    if not self._work.wait(timeout=30.0) and not self._queue:
                        self._thread = None  # idle: the next hand-over starts a new one
                        return
                    self.wakes += 1
                item = self._queue[0]
            answer = self._deliver(*item)
            with self._lock:
                self._queue.popleft()
            self._answered(answer)

    def read_answers(self, on_ack: Callable[[Ack, Batch], None],
                     handed_over: int | None = None) -> list[Ack]:
        """Take the answers in, oldest first, giving each ack to ``on_ack``; raise the first
        error among them (the rest wait for the next call), with notes naming its step and
        ``handed_over``, the step the caller closed before (not lost)."""
        acks = []
        while True:
            with self._lock:
                if not self._answers:
                    return acks
                batch, ack, error = self._answers.popleft()
            if error is not None:
                what = ("refused" if is_refusal(error) else
                        "not delivered (kept for a restarted actor that lacks it)")
                error.add_note(f"{self.label}: the batch of step {batch.step} was {what}")
                if handed_over is not None and handed_over != batch.step:
                    error.add_note(f"{self.label}: step {handed_over} was handed over "
                                   f"before this was raised: its records are not lost")
                raise error
            on_ack(ack, batch)  # type: ignore[arg-type]
            acks.append(ack)  # type: ignore[arg-type]

    def wait_until(self, in_flight_below: int, timeout_s: float | None) -> bool:
        """Wait until fewer than ``in_flight_below`` hand-overs are unanswered; False on a
        timeout."""
        with self._lock:
            if self.in_flight < in_flight_below:
                return True
            self._waiting += 1  # from here the thread waits out the calls made
        try:
            self._settle()
            with self._lock:
                return self._cv.wait_for(lambda: self.in_flight < in_flight_below,
                                         timeout=timeout_s)
        finally:
            with self._lock:
                self._waiting -= 1
