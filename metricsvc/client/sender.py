"""Delivering a rank's closed steps to the service: one at a time, in step order, through
the restart protocol (``metricsvc.core.resend``).

A blocking ``send`` runs on the caller's thread (``wait_submit``). ``hand_over``
(``flush``) makes the call on the caller's thread when nothing is in flight and returns,
leaving the answer to the caller's next call, which reads it if it is in by then
(``ray.get`` with timeout 0: the common case, and no thread wakes). An answer not in by
then, and batches handed over meanwhile, go to the sender thread, which waits for the
answer, delivers them and leaves their answers for the caller to read later. (Until
2026-12-05 the thread made every call but a client's first: Ray's submission wakes its
own IO thread, which on a node with no idle core preempts the caller, 0.5-2 ms of the
rank's wall a step with 4-16 ranks on 2 cores; but waking the thread for each call cost
the rank's process 76-160 us of CPU a step, and the run 6-12 % of its steps per second.)

Either way one delivery runs at a time, so steps reach the service in order (Ray does
not promise to run an actor's calls in the order sent: a large batch travels through the
object store, so batches sent without waiting could overtake each other). Every batch is
kept until an ack says the journal holds its step, and resent to a restarted actor that
lacks it; a refused one is dropped at once (resending cannot help).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from metricsvc.protocol import ACTOR_ERRORS, Batch, Outbox, Refused, deliver, is_refusal

# ``call(payload, epoch, timeout_s) -> ack``: one actor call carrying a batch's bytes
Call = Callable[[bytes, "str | None", "float | None"], dict[str, Any]]
# ``start(payload, epoch) -> wait``: the same call issued now; ``wait()`` returns its ack,
# ``wait.poll()`` the ack if it is in, else None (``client.rpc.Issued``)
Start = Callable[[bytes, "str | None"], Any]
Answer = tuple[Batch, "dict[str, Any] | None", "BaseException | None"]


class Sender:
    """The delivery of one client's batches; see the module's docstring."""

    def __init__(self, call: Call, label: str, max_inflight: int = 256,
                 position: Callable[[Batch], int] = lambda batch: batch.step,
                 start: Start | None = None) -> None:
        self._call = call
        self._start = start
        self.label = label
        # Where a batch stands in the order acks' ``durable_through`` counts: a rank's step,
        # a stream client's batch number
        self._position = position
        # Sent but not yet in the service's journal (resent after a restart), and the
        # incarnation last heard from: the restart protocol, shared with the combiner.
        self.outbox = Outbox(max_inflight, label=label)
        # One lock, two conditions: callers wait on ``_cv`` for answers (``in_flight``
        # falling), the sender thread on ``_work`` for its queue. An answer read at the
        # caller's next call (the common case) then wakes no thread.
        lock = self._lock = threading.RLock()  # held directly where nothing waits (C-level)
        self._cv = threading.Condition(lock)
        self._work = threading.Condition(lock)
        self._send_lock = threading.Lock()  # one delivery at a time: batches stay in order
        # (batch, blob, the wait of a call made | None: a delivery to make)
        self._queue: deque[tuple[Batch, bytes, Any]] = deque()
        self._answers: deque[Answer] = deque()
        self.in_flight = 0  # handed over, not answered yet
        self._thread: threading.Thread | None = None
        self.wakes = 0  # times the sender thread woke from waiting for work (counted)
        # The call a hand-over made, whose answer nobody waits for yet: (batch, blob,
        # wait); read by the caller's next call (``_settle``)
        self._pending: tuple[Batch, bytes, Any] | None = None
        self._waiting = 0  # callers in ``wait_until``: the thread waits out a call made then

    # -- blocking ------------------------------------------------------------------------
    def send(self, batch: Batch, blob: bytes, timeout_s: float | None, *,
             keep_undelivered: bool, issued: Any = None) -> dict[str, Any]:
        """Deliver one batch now and return its ack. A refused batch leaves the outbox; an
        undelivered one too unless ``keep_undelivered``. ``issued``: the wait of the call
        ``hand_over`` already made for it (under the send lock, the batch in the outbox)."""
        with self._send_lock:
            if issued is None:
                self.outbox.sent(self._position(batch), blob)
            try:
                return self._deliver(blob, timeout_s, issued)
            except Refused:
                self.outbox.drop(blob)
                raise
            except BaseException:
                if not keep_undelivered:
                    self.outbox.drop(blob)
                raise

    def resend_owed(self, timeout_s: float | None) -> dict[str, Any] | None:
        """Deliver again the newest batch the journal may lack, if any, and return its ack.
        The incarnation that has it answers ``duplicate``; one that lost it (a restart)
        answers ``epoch_changed`` and is sent everything owed, oldest first. None: nothing
        is owed."""
        with self._send_lock:
            newest = self.outbox.newest()
            return None if newest is None else self._deliver(newest, timeout_s)

    def _deliver(self, blob: bytes, timeout_s: float | None, issued: Any = None) -> dict[str, Any]:
        exchange = deliver(self.outbox, blob)
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
                ack = self._call(payload, self.outbox.epoch, timeout_s)
            try:
                payload = exchange.send(ack)
            except StopIteration as done:
                return done.value

    # -- in the background ---------------------------------------------------------------
    def hand_over(self, batch: Batch, blob: bytes) -> None:
        """Deliver ``batch`` without waiting: the call made here if nothing is in flight
        (its answer read at a later call), else queued for the sender thread, which
        delivers it after the batches before it.

        The call is the caller's: on a handle's first call Ray finds the actor and connects
        to it, after the call returns, and a process ended meanwhile loses the call (a rank
        actor ended right after the method that flushed its first step returned lost that
        step 15 times of 15 when a thread made the call, 5 of 30 when the caller did)."""
        self._settle()
        with self._lock:
            issue = self._start is not None and not self.in_flight
            self.in_flight += 1
            if not issue:  # an answer still out: delivered after it, by the thread
                self._to_thread((batch, blob, None))
                return
            issued = self._call_now(batch, blob, block=False)
            if issued is None:  # the thread delivers it, retrying, and reports what fails
                self._to_thread((batch, blob, None))
            elif self._waiting:  # a caller waits for answers: the thread waits this one out
                self._to_thread((batch, blob, issued))
            else:
                self._pending = (batch, blob, issued)

    def _call_now(self, batch: Batch, blob: bytes, block: bool = True) -> Any:
        """Make the batch's call now and return its wait; None if it could not be made (or,
        unless ``block``, if another delivery holds the send lock)."""
        if not self._send_lock.acquire(blocking=block):
            return None
        try:
            self.outbox.sent(self._position(batch), blob)
            return self._start(blob, self.outbox.epoch)  # type: ignore[misc]
        except Exception:  # noqa: BLE001  delivered by the thread's retrying call
            self.outbox.drop(blob)
            return None
        finally:
            self._send_lock.release()

    def _to_thread(self, item: tuple[Batch, bytes, Any], first: bool = False) -> None:
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
        """Read the answer of the call ``hand_over`` made, here, if it is in and complete
        (an ack, or a refusal); else leave it to the sender thread, which waits it out (an
        answer still out, an actor restarting, a new incarnation to resend to)."""
        with self._lock:
            if self._pending is None:
                return
            batch, blob, issued = self._pending
            self._pending = None
            got = None
            try:
                got = issued.poll()
            except ACTOR_ERRORS:
                here = False
            except BaseException:  # noqa: BLE001  a refusal: ``send`` raises it again
                here = True
            else:
                here = got is not None and got.get("status") != "epoch_changed"
            if not here:
                self._to_thread((batch, blob, issued), first=True)
                return
        ack, error = None, None
        if got is not None:  # an ack of this incarnation (the common case): what ``deliver``
            with self._send_lock:  # does with it, without its exchange
                self.outbox.heard(got)
            ack = got
        else:
            try:  # a refusal: ``send`` raises it again (the batch leaves the outbox)
                ack = self.send(batch, blob, None, keep_undelivered=True, issued=issued)
            except BaseException as err:  # noqa: BLE001  handed to the caller
                error = err
        with self._lock:
            self.in_flight -= 1
            self._answers.append((batch, ack, error))
            self._cv.notify_all()

    def _loop(self) -> None:
        """The sender thread: deliver queued batches one at a time, oldest first (a batch
        whose call was made: its answer waited for)."""
        while True:
            with self._lock:
                while not self._queue:
                    if not self._work.wait(timeout=30.0) and not self._queue:
                        self._thread = None  # idle: the next hand-over starts a new one
                        return
                    self.wakes += 1
                batch, blob, issued = self._queue[0]
            ack, error = None, None
            try:  # undelivered stays owed: a restarted actor that lacks it gets it
                ack = self.send(batch, blob, None, keep_undelivered=True, issued=issued)
            except BaseException as err:  # noqa: BLE001  handed to the caller
                error = err
            with self._lock:
                self._queue.popleft()
                self.in_flight -= 1
                self._answers.append((batch, ack, error))
                self._cv.notify_all()

    def read_answers(self, on_ack: Callable[[dict[str, Any], Batch], None],
                     handed_over: int | None = None) -> list[dict[str, Any]]:
        """Take the thread's answers, oldest first, giving each ack to ``on_ack``; raise the
        first error among them (the rest wait for the next call), with notes naming its
        step and ``handed_over``, the step the caller closed before (not lost). The answer
        of the call ``hand_over`` made last is read by the next ``hand_over`` or
        ``wait_until``: just made, it is not in yet."""
        acks = []
        while True:
            with self._lock:
                if not self._answers:
                    return acks
                batch, ack, error = self._answers.popleft()
            if error is not None:
                what = ("refused" if is_refusal(error) else
                        "not delivered (kept for a restarted actor that lacks it)")
                error.add_note(f"{self.label}: the batch of step {batch.step}, sent by "
                               f"flush(), was {what}")
                if handed_over is not None:
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
