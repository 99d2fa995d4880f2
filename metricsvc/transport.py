"""Calling the service's actors, on every side: the one transport is Ray actor calls.

Ranks' clients, per-node combiners and drivers call the MetricWorker the same way: while
it restarts they back off and try again, at once they hear that it is gone for good, and
what it raised reaches them as metricsvc's own one-line exception (``ray_get``), never
Ray's wrapper with the remote traceback.

A MetricWorker that Ray restarts loses the steps its journal did not hold yet. So a sender
keeps every batch it sent until an ack says the journal holds its step (``journal_through``)
and names in each call the incarnation it last heard from (``epoch``). A new incarnation
merges nothing from a sender that names another one: it answers ``epoch_changed``, and the
sender first resends what it still owes, oldest first, then the batch it was sending, so
no new step can finish ahead of an older one it needs. ``Outbox.exchange`` is that exchange
without I/O; the client drives it with blocking calls, the combiner with awaited ones.

A rank's closed steps, to the service: where they go (``ServiceHandle``: the
MetricWorker, or its node's combiner, found by name) and how (``Sender``: one delivery at
a time, in step order, through the restart protocol above).

A closed step is handed to the sender, which makes the call on the caller's thread when
nothing is in flight (a process that ends right after its call returns must not lose it:
Ray connects to an actor on a handle's first call, after the call returns) and leaves the
answer to the caller's next call, which reads it if it is in by then (no thread wakes).
An answer not in by then, and steps handed over meanwhile, go to the sender thread, which
waits for each answer in turn. An answer the caller leaves unread (``UNREAD_S``: a client
dropped, a rank silent until its next step) is read once it is in (until then it stays the
caller's) by the process's one looker (``look``: one ``ray.wait`` for every sender's), so
that a restarted actor's ``epoch_changed`` never leaves a step undelivered; what a dropped
client's answers would raise is logged (``Sender._say``).
One delivery runs at a time, so steps reach the service in order (Ray does not promise to
run an actor's calls in the order sent). Every batch is kept until an ack says the journal
holds its step and is resent to a restarted actor that lacks it; a refused one is dropped
at once (resending cannot help).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any

import ray

from metricsvc.core.keys import combiner_name
from metricsvc.core.wire import Batch
from metricsvc.errors import MetricsvcError, ServiceUnavailable, is_refusal

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


def ray_down(label: str, method: str) -> ServiceUnavailable:
    """What a call is refused with once this process has shut Ray down
    (``ray.shutdown()``): made anyway, Ray would start a new local cluster for it, or,
    from a sender thread, end the process. Every call checks ``ray.is_initialized()``."""
    return ServiceUnavailable(f"{label} ({method}): Ray is not running in this process "
                              f"(ray.shutdown() was called); nothing was sent")


def ray_get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get(ref)``, raising what the actor raised as metricsvc's own exception.

    Raises:
        ServiceUnavailable: this process shut Ray down while waiting (Ray raises
            ``SystemExit(0)`` in the waiting thread: handed to a caller, it ended the
            program).
    """
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as err:
        own = own_error(err)
        if own is err:
            raise
        raise own from err
    except (SystemExit, ray.exceptions.RaySystemError):
        if ray.is_initialized():
            raise
        raise ServiceUnavailable("the answer never came: Ray was shut down in this process "
                                 "(ray.shutdown() was called) while waiting") from None


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
        if not ray.is_initialized():  # at every try: a retry may outlast the process's Ray
            raise ray_down(label, method)
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
    every payload sent whose step the journal may not hold yet (at most ``limit``).

    Each owed payload remembers the segment of the run's history it was merged in (the
    ack's ``rewinds``: every rewind's ``to_step``, oldest first; None until its ack). A
    payload a later rewind superseded (one to before its step) is owed no longer: resent,
    it would be merged as the rerun's step. ``steps=False``: the payloads are numbered by
    batch (a stream's), not by step, and rewinds do not apply."""

    def __init__(self, limit: int = 256, label: str = "sender", steps: bool = True) -> None:
        self.epoch: str | None = None
        self.limit = limit
        self.label = label
        self.steps = steps
        self.resent = 0
        self.superseded = 0  # owed payloads a rewind superseded, dropped
        self._owed: list[list[Any]] = []  # [step, payload, segment merged in or None]

    def __len__(self) -> int:
        return len(self._owed)

    def sent(self, step: int, payload: Any) -> None:
        """Owe ``payload`` (of ``step``) until an ack says the journal holds that step."""
        self._owed.append([step, payload, None])
        if len(self._owed) > self.limit:
            dropped = self._owed.pop(0)[0]
            log.warning("%s: more than %d steps not yet journaled; step %d can no longer be "
                        "resent after a restart", self.label, self.limit, dropped)

    def drop(self, payload: Any) -> None:
        """Stop owing ``payload`` (refused: resending it cannot help)."""
        self._owed = [owed for owed in self._owed if owed[1] is not payload]

    def heard(self, ack: Ack, payload: Any = None) -> None:
        """Take the incarnation, the run's history and the journal's progress from an ack
        (of ``payload``, if given: merged in the history's current segment)."""
        self.epoch = ack.get("epoch", self.epoch)
        journaled = ack.get("journal_through")
        rewinds = ack.get("rewinds") if self.steps else None
        merged = ack.get("status") != "epoch_changed"
        kept = []
        for owed in self._owed:
            step, owed_payload, segment = owed
            if journaled is not None and step <= journaled:
                continue  # the journal holds its step
            if rewinds is not None:
                if owed_payload is payload and merged:
                    owed[2] = len(rewinds)
                elif segment is not None and segment < len(rewinds) \
                        and min(rewinds[segment:]) < step:
                    self.superseded += 1  # a rewind since superseded its step
                    continue
            kept.append(owed)
        self._owed = kept

    def newest(self) -> Any:
        """Return the newest payload still owed (None: nothing is)."""
        return self._owed[-1][1] if self._owed else None

    def owed(self) -> list[Any]:
        """Return, oldest first, what is owed (after an ack of a new incarnation: what it
        may lack)."""
        return [owed[1] for owed in self._owed]

    def exchange(self, payload: Any) -> Generator[Any, Ack, Ack]:
        """Send ``payload`` (already ``sent``): yield each payload to send, with ``epoch``,
        and receive its ack; return the ack of ``payload``."""
        ack = mine = yield payload
        while ack.get("status") == "epoch_changed":  # another incarnation: what it lacks first
            self.heard(ack)
            mine = None
            for old in self.owed():
                ack = yield old
                if ack.get("status") == "epoch_changed":
                    break  # restarted again meanwhile: start over with the newest incarnation
                self.heard(ack, old)
                if old is payload:
                    mine = ack
                else:
                    self.resent += 1
            else:
                if mine is None:  # not owed (an unsent payload): it goes after the older ones
                    ack = mine = yield payload
        self.heard(ack, payload)
        return mine


def is_stale(heard: str | None, epoch: str) -> bool:
    """Return True if a sender that last heard from incarnation ``heard`` talks to
    incarnation ``epoch`` (None: a sender's first call): it is told ``epoch_changed``."""
    return heard is not None and heard != epoch


Answer = tuple[Batch, "Ack | None", "BaseException | None"]


class ServiceHandle:
    """Where one rank's batches go (found by name on first use) and how each call is
    made: retried while the actor restarts, counted in ``calls``."""

    def __init__(self, worker: Any, name: str, namespace: str, via: str | None, rank: int,
                 retry_s: float, direct: bool = False) -> None:
        """``direct``: always the MetricWorker itself, never a combiner (a stream's)."""
        self._target = worker
        self._given = worker  # the MetricWorker's handle when the caller gave it
        self.name, self.namespace, self.via, self.rank = name, namespace, via, rank
        self.direct = direct
        self.retry_s = retry_s
        self.calls = 0  # actor calls made

    @property
    def target(self) -> Any:
        """The combiner ``via`` names, this node's combiner (topology per_node; the rank
        registers with it) or the MetricWorker itself."""
        if self._target is None and self.direct:
            self._target = self.metric_worker()
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

    def to_metric_worker(self) -> ServiceHandle:
        """A handle of its own on the MetricWorker itself (never a combiner): a stream's."""
        return ServiceHandle(self._given, self.name, self.namespace, None, self.rank,
                             self.retry_s, direct=True)

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """One call of the target, waited for, retried while the actor restarts."""
        self.calls += 1
        return call(lambda: self.target, method, *args, retry_s=self.retry_s,
                    timeout_s=timeout_s, label=f"MetricWorker {self.name!r}")

    def issue(self, method: str, *args: Any) -> ray.ObjectRef:
        """One call of the target, made now; returns its answer's reference."""
        if not ray.is_initialized():
            raise ray_down(f"MetricWorker {self.name!r}", method)
        self.calls += 1
        target = self._target if self._target is not None else self.target
        return getattr(target, method).remote(*args)


class Sender:
    """The delivery of one client's batches; see the module's docstring."""

    def __init__(self, service: ServiceHandle, method: str, label: str, *args: Any,
                 owner: object, max_inflight: int = 256, by_seq: bool = False) -> None:
        """Batches go to ``service.method(*args, blob, epoch)``, for ``owner`` (the client
        whose callers read the answers). ``by_seq``: acks' ``journal_through`` counts batch
        numbers (a stream client's), else steps."""
        self.service, self.method, self.args = service, method, args
        self.label = label
        # Sent but not yet in the service's journal (resent after a restart), and the
        # incarnation last heard from: the restart protocol, shared with the combiner.
        self.outbox = Outbox(max_inflight, label=label, steps=not by_seq)
        # One lock, two conditions: callers wait on ``_cv`` for answers, the sender thread
        # on ``_work`` for its queue. An answer read at the caller's next call (the common
        # case) then wakes no thread.
        lock = self._lock = threading.RLock()
        self._cv = threading.Condition(lock)
        self._work = threading.Condition(lock)
        self._send_lock = threading.Lock()  # one delivery at a time: batches stay in order
        self._queue: deque[tuple[Batch, bytes, ray.ObjectRef | None]] = deque()
        self.answers: deque[Answer] = deque()  # answers in, not read yet
        self._pending: tuple[Batch, bytes, ray.ObjectRef] | None = None  # nobody waits on it
        self._pending_at = 0.0  # when its call was made
        self.in_flight = 0  # handed over, not answered yet
        self._waiting = 0  # callers in ``wait_until``: the thread waits out a call made then
        self._thread: threading.Thread | None = None
        self.wakes = 0  # times the sender thread woke from waiting for work (counted)
        self.orphan = False  # its owner is gone: answers are logged, nobody reads them
        weakref.finalize(owner, self._orphaned)

    def hand_over(self, batch: Batch, blob: bytes) -> None:
        """Deliver ``batch`` without waiting: the call made here if nothing is in flight
        (its answer read at a later call), else queued for the sender thread."""
        self._settle()
        with self._lock:
            self.in_flight += 1
            issued = None
            if self.in_flight == 1 and self._send_lock.acquire(blocking=False):
                try:
                    self.outbox.sent(batch.step if self.outbox.steps else batch.seq, blob)
                    issued = self.service.issue(self.method, *self.args, blob,
                                                self.outbox.epoch)
                except Exception:  # noqa: BLE001  the thread delivers it, retrying
                    self.outbox.drop(blob)
                finally:
                    self._send_lock.release()
            if issued is None or self._waiting:  # the thread delivers or waits it out
                self._to_thread((batch, blob, issued))
                return
            # read by the caller's next call, else by the looker (``UNREAD_S``)
            self._pending, self._pending_at = (batch, blob, issued), time.monotonic()
            _queued.add(self)  # kept until its answer is read
        if _looker is None:
            look_later()

    def _exchange(self, blob: bytes, issued: ray.ObjectRef | None = None) -> Ack:
        """The one delivery: ``blob`` (owed in the outbox) through the restart protocol, the
        first call's wait ``issued`` if a hand-over made it; returns its ack. Under the
        send lock."""
        exchange = self.outbox.exchange(blob)
        payload = next(exchange)
        while True:
            ack = None
            if issued is not None:  # the first call was made at the hand-over
                try:
                    ack = ray_get(issued)
                except ACTOR_ERRORS:  # the actor is down: call again, waiting it out
                    pass
                issued = None
            if ack is None:
                ack = self.service.call(self.method, *self.args, payload, self.outbox.epoch)
            try:
                payload = exchange.send(ack)
            except StopIteration as done:
                return done.value

    def _deliver(self, batch: Batch, blob: bytes, issued: ray.ObjectRef | None) -> Answer:
        """Deliver a handed-over batch; its answer (a refused one leaves the outbox; an
        undelivered one stays owed, for a restarted actor that lacks it)."""
        with self._send_lock:
            try:
                if issued is None:
                    self.outbox.sent(batch.step if self.outbox.steps else batch.seq, blob)
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

    def _to_thread(self, item: tuple[Batch, bytes, ray.ObjectRef | None],
                   first: bool = False) -> None:
        """Queue ``item`` for the sender thread, started if idle; under the lock."""
        _queued.add(self)  # kept until its queue is delivered and its answer read
        if first:
            self._queue.appendleft(item)
        else:
            self._queue.append(item)
        if self._thread is None:
            self._thread = threading.Thread(
                target=serve, args=(weakref.ref(self), self._work, self._queue),
                daemon=True, name=f"metricsvc-{self.label}-sender")
            self._thread.start()
        self._work.notify()

    def unread(self, now: float) -> ray.ObjectRef | None:
        """The answer the caller has left unread ``UNREAD_S`` or longer, if any (the
        looker's)."""
        with self._lock:
            pending = self._pending
            if pending is None or now - self._pending_at < UNREAD_S:
                return None
            return pending[2]

    def look(self, issued: ray.ObjectRef, ready: bool) -> None:
        """The looker's verdict on the answer ``issued`` the caller left unread: one in
        (``ready``) is read here (``_settle``); one not in yet stays the caller's, looked at
        again ``UNREAD_S`` later."""
        with self._lock:
            if self._pending is None or self._pending[2] is not issued:
                return  # the caller read it meanwhile
            if not ready:
                self._pending_at = time.monotonic()
                return
        self._settle()

    def _settle(self) -> None:
        """Read the answer of the call a hand-over made, here, if it is in and of this
        incarnation; else leave it to the sender thread, which waits it out."""
        with self._lock:
            if self._pending is None:
                return
            batch, blob, issued = self._pending
            try:  # one look: the answer if it is in
                got = ray.get(issued, timeout=0)
            except BaseException:  # noqa: BLE001  not in, refused, the actor down: the thread's
                got = None
            self._pending = None
            if not self._queue:
                _queued.discard(self)
            if got is None or got.get("status") == "epoch_changed":
                self._to_thread((batch, blob, issued), first=True)
                return
        with self._send_lock:  # what ``deliver`` does with an ack of this incarnation
            self.outbox.heard(got, blob)
        self._answered((batch, got, None))

    def _answered(self, answer: Answer) -> None:
        with self._lock:
            self.in_flight -= 1
            if not self.orphan:
                self.answers.append(answer)
                self._cv.notify_all()
                return
        self._say(answer)

    def _orphaned(self) -> None:
        """The owner is gone: what it left unread, and each answer from now on, is logged;
        no caller is left to raise it to."""
        with self._lock:
            self.orphan = True
            unread = list(self.answers)
            self.answers.clear()
        for answer in unread:
            self._say(answer)

    def _say(self, answer: Answer) -> None:
        """Log what an answer nobody reads would have raised or warned: a refusal, a batch
        not delivered, a batch its step was published without, a notice."""
        batch, ack, error = answer
        said = []
        if error is not None:
            fate = "refused" if is_refusal(error) else "not delivered"
            said.append(f"was {fate} ({type(error).__name__}: {str(error).splitlines()[0]})")
        elif ack is not None:
            if ack.get("status") == "late":
                said.append("was not merged: its step was published without it")
            if ack.get("notice"):
                said.append(f"came with a notice: {ack['notice']}")
        for what in said:
            log.warning("%s: the batch of step %d %s, and its client was dropped before "
                        "reading it", self.label, batch.step, what)

    def idle(self) -> None:
        """The sender thread ends (idle): the next hand-over starts a new one."""
        with self._lock:
            self._thread = None

    def deliver_first(self, woke: bool) -> None:
        """Deliver the oldest queued batch: the sender thread's work (``woke``: it waited
        for it)."""
        with self._lock:
            self.wakes += woke
            item = self._queue[0]
        answer = self._deliver(*item)
        with self._lock:
            self._queue.popleft()
            if not self._queue:
                _queued.discard(self)
        self._answered(answer)

    def read_answers(self, on_ack: Callable[[Ack, Batch], None],
                     handed_over: int | None = None) -> list[Ack]:
        """Take the answers in, oldest first, giving each ack to ``on_ack``; raise the first
        error among them (the rest wait for the next call), with notes naming its step and
        ``handed_over``, the step the caller closed before (not lost)."""
        acks = []
        while True:
            with self._lock:
                if not self.answers:
                    return acks
                batch, ack, error = self.answers.popleft()
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
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            with self._lock:
                while self.in_flight >= in_flight_below:
                    left = None if deadline is None else deadline - time.monotonic()
                    if (left is not None and left <= 0) or not self._cv.wait(left):
                        return self.in_flight < in_flight_below
                return True
        finally:
            with self._lock:
                self._waiting -= 1


IDLE_S = 30.0  # a sender thread ends after this long without work
UNREAD_S = 1.0  # an answer the caller leaves unread this long, the looker reads
# The senders whose threads have batches queued, or an answer to read: kept alive
_queued: set[Sender] = set()


def serve(sender: weakref.ref[Sender], work: threading.Condition, queue: deque) -> None:
    """A sender thread: deliver ``sender``'s queued batches one at a time, oldest first.

    A sender is kept (``_queued``) while batches are queued or an answer waits to be read
    (a client dropped meanwhile still has them delivered). The thread holds the sender
    only while it delivers, and idle holds no Ray reference. A thread other than the one
    in ``ray.shutdown()`` that frees a Ray reference meanwhile ends the process (Ray: "The
    core worker has already been shutdown ... The process will exit"): an idle thread that
    ends (``IDLE_S``) frees none, and a client is freed by whoever drops it, or by its
    thread after the last batch it had, never later."""
    while True:
        with work:
            woke = False
            while not queue:
                if not work.wait(timeout=IDLE_S) and not queue:
                    owner = sender()
                    if owner is not None:
                        owner.idle()
                    return
                woke = True
        live = sender()  # alive: kept in _queued while it has work
        if live is None:
            return
        live.deliver_first(woke)
        del live


_looker: threading.Thread | None = None  # the process's, once a hand-over needs it
_looker_lock = threading.Lock()


def _forget_looker() -> None:
    """A forked child has none of its parent's threads (nor a lock one of them held)."""
    global _looker, _looker_lock
    _looker, _looker_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_looker)


def look_later() -> None:
    """Have the process's looker read the answers callers leave unread (started once)."""
    global _looker
    with _looker_lock:
        if _looker is None:
            _looker = threading.Thread(target=look, daemon=True, name="metricsvc-looker")
            _looker.start()


def look() -> None:
    """The looker: once each ``UNREAD_S``, the answers callers have left unread that long,
    looked at together (one ``ray.wait``, for 256 ranks' clients in a process as for one);
    each one in is read by its sender (``Sender.look``: an ``epoch_changed`` one goes to
    its thread's queue), each one not in yet stays its caller's. Callers that read their
    answers in time (the common case) cost it one wake a second, and no Ray call. It runs
    as long as the process, and asleep holds no sender and no Ray reference (``serve``)."""
    while True:
        time.sleep(UNREAD_S)
        now = time.monotonic()
        due = [(sender, sender.unread(now)) for sender in list(_queued)]
        due = [(sender, issued) for sender, issued in due if issued is not None]
        if due:
            refs = [issued for _, issued in due]
            try:
                refs = ray.wait(refs, num_returns=len(refs), timeout=0)[0]
            except BaseException:  # noqa: BLE001  Ray shut down: each sender's look says so
                pass
            ready = {ref.hex() for ref in refs}
            for sender, issued in due:
                try:
                    sender.look(issued, issued.hex() in ready)
                except Exception:  # the others' answers are still looked at
                    log.exception("%s: reading an answer left unread failed", sender.label)
            del due, refs, sender, issued
