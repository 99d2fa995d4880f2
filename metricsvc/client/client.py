"""MetricClient: buffer a rank's records for the open step, merge locally, one RPC per flush."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import ray

from metricsvc.client.buffer import RecordBuffer
from metricsvc.client.cursor import StepCursor
from metricsvc.client.rpc import call, find_metric_worker, find_service, issue
from metricsvc.client.sender import Sender
from metricsvc.client.siirl import SiirlMethods
from metricsvc.client.stream import StreamRecorder
from metricsvc.client.tracker import Tracker
from metricsvc.protocol import (
    DEFAULT_NAME,
    Batch,
    LateBatch,
    Refused,
    ServiceNotice,
    ServiceUnavailable,
    SketchSpec,
    check_rank,
    default_namespace,
    encode,
)

log = logging.getLogger(__name__)


class MetricClient(SiirlMethods, Tracker):
    """A rank's handle on the MetricWorker: record metrics for the open step, then flush.

    Recording never syncs a device: tensors are summarised on their device and
    merged there; ``wait_submit`` copies every row of the step to the host once
    and sends one batch in one message. The recording API is AReaL's
    ``stats_tracker`` (``stat``, ``denominator``, ``scalar``, ``scope``,
    ``record_timing``, ``get``) plus siiRL's ``submit_metric``.

    Batches stay in memory until the service's journal holds their step: if the
    actor restarts (and loses the steps it had not journaled), the client resends
    them, and the service merges each ``(step, rank, seq)`` once.
    """

    def __init__(
        self,
        worker: Any = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        start_step: int = 0,
        name: str | None = None,
        namespace: str | None = None,
        sketch_spec: SketchSpec | None = None,
        compile: bool | None = None,
        retry_s: float = 120.0,
        max_inflight: int = 256,
        max_unacked: int = 4,
        via: str | None = None,
    ) -> None:
        if rank is None or world_size is None:  # siiRL's MetricClient(metric_worker)
            raise TypeError(
                "MetricClient needs rank= and world_size=: siiRL's client passes world_size "
                "to each call, this one is one rank's (MetricClient(metric_worker, "
                "rank=rank, world_size=world_size))")
        self.rank, self.world_size = check_rank(rank, world_size)
        self._worker = worker
        self._given = worker  # the MetricWorker's handle when the caller gave it
        self._via = via
        self._name = name or DEFAULT_NAME
        self._namespace = namespace or default_namespace()
        super().__init__(RecordBuffer(sketch_spec, compile))  # the client is its own tracker
        self.cursor = StepCursor(self.rank, start_step, self.buffer)
        self.retry_s = retry_s
        if max_unacked < 1:
            raise ValueError(f"max_unacked must be >= 1, got {max_unacked}")
        self.max_unacked = max_unacked
        self._seq = 0
        self._flushes = 0
        self._unacked: Batch | None = None  # closed, not yet acked (kept across a timeout)
        self.sender = Sender(lambda payload, epoch, timeout_s: self._call(
            "submit", payload, epoch, timeout_s=timeout_s), f"rank {self.rank}", max_inflight,
            start=self._start_submit)
        self.rpc_count = 0  # actor calls to the service
        if via is not None and worker is None:
            self.connect()  # register with the combiner before step 0

    @property
    def worker(self) -> Any:
        """Where batches go: the combiner ``via`` names, this node's combiner (topology
        per_node) or the MetricWorker itself, looked up by name on first use."""
        if self._worker is None:
            self._worker = find_service(self._name, self._namespace, self._via, self.rank)
        return self._worker

    def connect(self) -> MetricClient:
        """Find the service now instead of at the first flush; under ``topology: per_node``
        this registers the rank with its node's combiner, so that the run's first step,
        too, reaches the MetricWorker in one call per node. Returns the client."""
        _ = self.worker
        return self

    def stream(self, name: str, **kwargs: Any) -> StreamRecorder:
        """Return a recorder for stream ``name``: no step barrier; see ``StreamRecorder``.
        It sends to the MetricWorker itself, never through a node's combiner."""
        def metric_worker() -> Any:  # the handle given, else found by name on first use
            self._given = self._given or find_metric_worker(self._name, self._namespace)
            return self._given
        return StreamRecorder(metric_worker, name, sketch_spec=self.buffer.sketch_spec,
                              compile=self.buffer.compile, retry_s=self.retry_s, **kwargs)

    def log(self, metrics: Mapping[str, Any], step: int | None = None, *,
            commit: bool = True) -> None:
        """Record a plain dict for ``step`` and close it, as ``wandb.log(metrics, step=)``
        and verl's ``Tracking.log(data, step)`` do (reductions from the key names, as
        ``submit_metric``). ``step`` defaults to the open step; ``commit=False`` records
        without closing, so that several calls build one step. Closing is ``flush()``: it
        does not wait for the service."""
        if step is not None:
            with self.buffer.lock:
                self._name_step(step, "log")  # before recording: the dict is ``step``'s
        self.submit_metric(metrics)
        if commit:
            self.flush()

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """One actor call, retried with backoff while the actor is down (up to ``retry_s``)."""
        self.rpc_count += 1
        return call(lambda: self.worker, method, *args, retry_s=self.retry_s,
                    timeout_s=timeout_s, label=f"MetricWorker {self._name!r}")

    def _start_submit(self, payload: bytes, epoch: str | None) -> Any:  # flush's first try
        self.rpc_count += 1
        return issue(self.worker, "submit", payload, epoch)

    def _close_step(self, step: int | None) -> Batch:
        """Take the open step's records as one final batch (the same one again after a
        timed-out ``wait_submit``)."""
        with self.buffer.lock:
            if step is not None:
                self._name_step(step)
            if self._unacked is None:
                self._seq += 1
                self._unacked = self.buffer.take_batch(
                    step=self.step, rank=self.rank, world_size=self.world_size,
                    seq=self._seq, final=True)
            return self._unacked

    def flush(self, *, step: int | None = None) -> None:
        """Close this rank's step without waiting for the service: one host copy, one
        encoding and (nothing in flight) the call here; the sender thread waits for the ack
        and the client moves to the next step at once.

        One batch is delivered at a time, in step order. Answers are read at the next
        ``flush`` / ``wait_submit`` / ``wait_acks``: a refusal (``BatchRejected``, with a note
        naming the step), a late or late-joining step (``LateBatch``, ``StepAlreadyFinal``)
        or a notice is raised or warned there, after this call's own step is handed over:
        an error about step N never costs step N+1 its records. At most ``max_unacked``
        flushes wait for their answer: one more waits for the oldest. Every batch is kept
        until the journal holds its step and is resent to a restarted actor, as with
        ``wait_submit``. ``step`` as for ``wait_submit``.
        """
        if not self.sender.wait_until(self.max_unacked, self.retry_s + 60):
            raise ServiceUnavailable(f"rank {self.rank}: {self.in_flight} flushes "
                                     f"unanswered for {self.retry_s + 60} s")
        batch = self._close_step(step)
        self.sender.hand_over(batch, encode(batch))
        self._closed(batch)
        self._read_answers(handed_over=batch.step)  # earlier answers: errors reach the caller

    def _read_answers(self, handed_over: int | None = None) -> list[dict[str, Any]]:
        """Take the sender's answers, oldest first; raise the first error among them (the
        rest wait for the next call). ``handed_over``: the step the calling ``flush`` /
        ``wait_submit`` closed before, which the error's note names."""
        return self.sender.read_answers(self._after_ack, handed_over)

    def wait_acks(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Wait until every ``flush`` is answered; return the acks not read yet, oldest
        first. Raises what the first refused or late one raises (see ``flush``), or
        ``GetTimeoutError`` after ``timeout_s``."""
        if not self.sender.wait_until(1, timeout_s):
            raise ray.exceptions.GetTimeoutError(
                f"rank {self.rank}: {self.in_flight} flushes unanswered after {timeout_s} s")
        return self._read_answers()

    def wait_submit(self, timeout_s: float | None = None, *,
                    step: int | None = None) -> dict[str, Any]:
        """Close this rank's step: one host copy, one message, return after the ack
        (siiRL's blocking meaning; ``flush`` is the same without the wait).

        ``step`` names the step the caller means (e.g. the trainer's global step). The
        client moves to it if nothing recorded since its last flush is pending (a first
        flush, a step after ``discard()``, a rank that skipped steps). Records left from a
        step that was never closed are never merged into a later one: that raises
        ``StepMismatch`` (``discard()`` them after a failed step); so does a step at or
        below the last one closed.

        While the actor restarts the call waits (up to ``retry_s``). On a timeout
        the batch is kept and calling again resends it; the service merges it
        once. A refused batch (``metricsvc.errors.Refused``, raised) closes the step all the
        same: its records are dropped and the client moves to the next step.
        """
        if not self.sender.wait_until(1, timeout_s):  # earlier flushes first: steps in order
            raise ray.exceptions.GetTimeoutError(
                f"rank {self.rank}: {self.in_flight} flushes unanswered after {timeout_s} s; "
                f"this step was not closed")
        batch = self._close_step(step)
        blob = encode(batch)
        try:  # undelivered stays in _unacked: the next call sends it again
            ack = self.sender.send(batch, blob, timeout_s, keep_undelivered=False)
        except Refused:  # rejected by the service: retrying cannot help
            self._closed(batch)  # the step is closed all the same: the rank goes on
            raise
        self._closed(batch)
        self._read_answers(handed_over=batch.step)  # earlier flushes' errors, after this
        self._after_ack(ack, batch)
        return ack

    def _closed(self, batch: Batch) -> None:
        self._unacked = None
        self.cursor.closed(batch.step)

    def _name_step(self, step: int, caller: str = "wait_submit") -> None:
        pending = self._unacked is not None or len(self.buffer) > 0
        self.cursor.name(step, caller, pending)

    @property
    def step(self) -> int:
        """The open step: what is recorded now belongs to it."""
        return self.cursor.step

    @property
    def last_closed(self) -> int | None:
        """The last step this rank closed (None before the first)."""
        return self.cursor.last_closed

    def discard(self) -> int:
        """Drop what was recorded (and not yet sent) for the open step; return how many keys
        were withdrawn. The step stays open: after a failed training step, the service
        publishes it without this rank (partial) unless the rank records and closes it
        again. A batch already sent cannot be withdrawn: after a ``wait_submit`` that timed
        out, the service may have merged it. It is then delivered again (a resend merges
        once), so its step holds this rank's records either way; a ``ServiceNotice`` says so.
        """
        with self.buffer.lock:
            dropped = self.buffer.discard()
            sent, self._unacked = self._unacked, None
            self.cursor.known = False  # what comes next is for the step the caller names
        if sent is not None:
            self.sender.hand_over(sent, encode(sent))
            self._closed(sent)
            self.cursor.known = False
            warnings.warn(ServiceNotice(
                f"rank {self.rank}: discard() cannot withdraw step {sent.step}'s batch "
                f"({len(sent.keys)} keys): wait_submit sent it before timing out, so it may "
                f"have been merged. It is delivered again (merged once); step {sent.step} "
                f"holds this rank's records"), stacklevel=2)
        return dropped

    def _after_ack(self, ack: dict[str, Any], batch: Batch) -> None:
        self._flushes += 1
        joined_late = self.cursor.joined_late(ack, batch.step, self._flushes)
        if ack["status"] == "late" and not joined_late:
            warnings.warn(LateBatch(
                f"rank {self.rank}: step {batch.step} was published without it (straggler "
                f"timeout); this batch is journaled as late and not merged"), stacklevel=3)
        if ack.get("notice"):
            warnings.warn(ServiceNotice(f"rank {self.rank}: {ack['notice']}"), stacklevel=3)
        if joined_late:
            self.cursor.catch_up(ack, batch.step)

    @property
    def resent(self) -> int:
        """Batches sent again to a restarted actor."""
        return self.sender.outbox.resent

    @property
    def in_flight(self) -> int:
        """Flushes not answered yet (queued for the sender or being delivered)."""
        return self.sender.in_flight
