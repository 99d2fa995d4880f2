"""MetricClient: buffer a rank's records for the open step, merge locally, one RPC per flush."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import ray

from metricsvc.client.buffer import RecordBuffer
from metricsvc.client.cursor import StepCursor
from metricsvc.client.rpc import ServiceHandle
from metricsvc.client.sender import Sender
from metricsvc.client.siirl import SiirlCalls
from metricsvc.client.stream import StreamRecorder
from metricsvc.client.tracker import Tracker
from metricsvc.protocol import (
    DEFAULT_NAME,
    RETRY_S,
    Batch,
    Refused,
    ServiceNotice,
    ServiceUnavailable,
    SketchSpec,
    check_rank,
    default_namespace,
    encode,
)

log = logging.getLogger(__name__)


class MetricClient(Tracker):
    """A rank's handle on the MetricWorker: record metrics for the open step, then flush.

    Recording never syncs a device: tensors are summarised on their device and
    merged there; ``wait_submit`` copies every row of the step to the host once
    and sends one batch in one message. The recording API is AReaL's
    ``stats_tracker`` (``stat``, ``denominator``, ``scalar``, ``scope``,
    ``record_timing``, ``get``) plus siiRL's ``submit_metric``.

    Batches stay in memory until the service's journal holds their step: if the
    actor restarts (and loses the steps it had not journaled), the client resends
    them, and the service merges each ``(step, rank, seq)`` once.

    Its parts: the step it records for and closes (``cursor``), the thread that delivers
    closed steps (``sender``), the service it calls (``service``) and siiRL's calls
    (``siirl``).
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
        retry_s: float = RETRY_S,
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
        self.service = ServiceHandle(worker, name or DEFAULT_NAME,
                                     namespace or default_namespace(), via, self.rank, retry_s)
        super().__init__(RecordBuffer(sketch_spec, compile))  # the client is its own tracker
        self.cursor = StepCursor(self.rank, self.world_size, start_step, self.buffer)
        self.siirl = SiirlCalls(self, self.world_size)
        self.retry_s = retry_s
        if max_unacked < 1:
            raise ValueError(f"max_unacked must be >= 1, got {max_unacked}")
        self.max_unacked = max_unacked
        self.sender = Sender(lambda payload, epoch, timeout_s: self.service.call(
            "submit", payload, epoch, timeout_s=timeout_s), f"rank {self.rank}", max_inflight,
            start=lambda payload, epoch: self.service.issue("submit", payload, epoch))
        if via is not None and worker is None:
            self.connect()  # register with the combiner before step 0

    @property
    def worker(self) -> Any:
        """Where batches go: the combiner ``via`` names, this node's combiner (topology
        per_node) or the MetricWorker itself, looked up by name on first use."""
        return self.service.target

    @property
    def rpc_count(self) -> int:
        """Actor calls this client made to the service."""
        return self.service.calls

    def connect(self) -> MetricClient:
        """Find the service now instead of at the first flush; under ``topology: per_node``
        this registers the rank with its node's combiner, so that the run's first step,
        too, reaches the MetricWorker in one call per node. Returns the client."""
        _ = self.worker
        return self

    def stream(self, name: str, **kwargs: Any) -> StreamRecorder:
        """Return a recorder for stream ``name``: no step barrier; see ``StreamRecorder``.
        It sends to the MetricWorker itself, never through a node's combiner."""
        buffer = self.buffer
        return StreamRecorder(self.service.metric_worker, name, sketch_spec=buffer.sketch_spec,
                              compile=buffer.compile, retry_s=self.retry_s, **kwargs)

    def log(self, metrics: Mapping[str, Any], step: int | None = None, *,
            commit: bool = True) -> None:
        """Record a plain dict for ``step`` and close it, as ``wandb.log(metrics, step=)``
        and verl's ``Tracking.log(data, step)`` do (reductions from the key names, as
        ``submit_metric``). ``step`` defaults to the open step; ``commit=False`` records
        without closing, so that several calls build one step. Closing is ``flush()``: it
        does not wait for the service."""
        if step is not None:
            self._moving_on(step)
            with self.buffer.lock:
                self.cursor.name_step(step, "log")  # before recording: the dict is ``step``'s
        self.submit_metric(metrics)
        if commit:
            self.flush()

    def flush(self, *, step: int | None = None) -> None:
        """Close this rank's step without waiting for the service: one host copy, one
        encoding and the call made (when nothing is in flight; else the batch is handed to
        the sender thread, which delivers it after the answer before it); the client moves
        to the next step at once.

        One batch is delivered at a time, in step order. Answers are read at the next
        ``flush`` / ``wait_submit`` / ``wait_acks``: a refusal (``BatchRejected``, with a note
        naming the step), a late or late-joining step (``LateBatch``, ``StepAlreadyFinal``)
        or a notice is raised or warned there, after this call's own step is handed over:
        an error about step N never costs step N+1 its records. At most ``max_unacked``
        flushes wait for their answer: one more waits for the oldest. Every batch is kept
        until the journal holds its step and is resent to a restarted actor, as with
        ``wait_submit``. ``step`` as for ``wait_submit``.
        """
        self._moving_on(step)
        if not self.sender.wait_until(self.max_unacked, self.retry_s + 60):
            raise ServiceUnavailable(f"rank {self.rank}: {self.in_flight} flushes "
                                     f"unanswered for {self.retry_s + 60} s")
        batch = self.cursor.close(step, "flush")
        self._hand_over(batch)
        # earlier answers: their errors reach the caller now
        self.sender.read_answers(self.cursor.after_ack, batch.step)

    def wait_acks(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Wait until every ``flush`` is answered; return the acks not read yet, oldest
        first. Raises what the first refused or late one raises (see ``flush``), or
        ``GetTimeoutError`` after ``timeout_s``."""
        if not self.sender.wait_until(1, timeout_s):
            raise ray.exceptions.GetTimeoutError(
                f"rank {self.rank}: {self.in_flight} flushes unanswered after {timeout_s} s")
        return self.sender.read_answers(self.cursor.after_ack, None)

    def wait_submit(self, timeout_s: float | None = None, *,
                    step: int | None = None) -> dict[str, Any]:
        """Close this rank's step: one host copy, one message, return after the ack
        (siiRL's blocking meaning; ``flush`` is the same without the wait).

        ``step`` names the step the caller means (e.g. the trainer's global step). The
        client moves to it if nothing recorded since its last flush is pending (a first
        flush, a step after ``discard()``, a rank that skipped steps). A close of a step at
        or below the last one closed (a retried or twice-logged step), or of another step
        while records of the open one are pending (an exception between recording and
        closing), is refused: ``StepMismatch`` names the call and the keys, the close's
        records are dropped (never merged into another step), nothing is sent, and the
        next step the caller names is taken.

        While the actor restarts the call waits (up to ``retry_s``). On a timeout
        the batch is kept and calling again resends it; the service merges it
        once. A refused batch (``metricsvc.core.errors.Refused``, raised) closes the step all the
        same: its records are dropped and the client moves to the next step.
        """
        self._moving_on(step)
        if not self.sender.wait_until(1, timeout_s):  # earlier flushes first: steps in order
            raise ray.exceptions.GetTimeoutError(
                f"rank {self.rank}: {self.in_flight} flushes unanswered after {timeout_s} s; "
                f"this step was not closed")
        batch = self.cursor.close(step, "wait_submit")
        blob = encode(batch)
        try:  # undelivered stays unacked: the next call sends it again
            ack = self.sender.send(batch, blob, timeout_s, keep_undelivered=False)
        except Refused:  # rejected by the service: retrying cannot help
            self.cursor.handed_over(batch)  # the step is closed all the same: the rank goes on
            raise
        self.cursor.handed_over(batch)
        self.sender.read_answers(self.cursor.after_ack, batch.step)  # earlier flushes' errors
        self.cursor.after_ack(ack, batch)
        return ack

    def _hand_over(self, batch: Batch) -> None:
        """Give a closed step's batch to the sender, which delivers it in the background."""
        self.sender.hand_over(batch, encode(batch))
        self.cursor.handed_over(batch)

    def _moving_on(self, step: int | None) -> None:
        """A ``wait_submit`` that timed out left its step's batch to be sent again; once the
        caller names another step, that step is closed all the same: its batch is handed
        to the sender (the records recorded since belong to the next step)."""
        held = self.cursor.unacked
        if held is not None and step is not None and step != held.step:
            self._hand_over(held)

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
        dropped, sent = self.cursor.discard()
        if sent is not None:
            self._hand_over(sent)
            self.cursor.known = False
            warnings.warn(ServiceNotice(
                f"rank {self.rank}: discard() cannot withdraw step {sent.step}'s batch "
                f"({len(sent.keys)} keys): wait_submit sent it before timing out, so it may "
                f"have been merged. It is delivered again (merged once); step {sent.step} "
                f"holds this rank's records"), stacklevel=2)
        return dropped

    @property
    def resent(self) -> int:
        """Batches sent again to a restarted actor."""
        return self.sender.outbox.resent

    @property
    def in_flight(self) -> int:
        """Flushes not answered yet (queued for the sender or being delivered)."""
        return self.sender.in_flight

    # -- siiRL's calls (``metricsvc.client.siirl``: the same names and arguments) ---------
    def submit_metric(self, metrics: Mapping[str, Any], world_size: int | None = None) -> None:
        """Record a plain dict, siiRL style: the reduction comes from each key's last segment.
        ``world_size``: the number of ranks expected to send these keys (siiRL passes 1 for
        keys only rank 0 computes); default: all ranks."""
        self.siirl.submit_metric(metrics, world_size)

    def compute_local_data_metric(self, batch: Mapping[str, Any],
                                  world_size: int | None = None) -> None:
        """Record the data metrics of a batch (``critic/*``, ``response/*``, ``prompt/*``)."""
        self.siirl.data(batch, world_size)

    def compute_local_timing_metrics(self, batch: Mapping[str, Any],
                                     timing_raw: Mapping[str, float],
                                     world_size: int | None = None) -> None:
        """Record ``timing_s/*`` and ``timing_per_token_ms/*``."""
        self.siirl.timing(batch, timing_raw, world_size)

    def compute_local_throughout_metrics(self, batch: Mapping[str, Any],
                                         timing_raw: Mapping[str, float], n_gpus: int,
                                         world_size: int | None = None) -> None:
        """Record ``perf/total_num_tokens``, ``perf/time_per_step``, ``perf/throughput``."""
        self.siirl.throughput(batch, timing_raw, n_gpus, world_size)

    compute_local_throughput_metrics = compute_local_throughout_metrics  # the right spelling

    def compute_log_prob_diff_metrics(self, data: Mapping[str, Any],
                                      world_size: int | None = None) -> None:
        """Record siiRL's ``actor/rollout_probs_diff_*`` (see ``SiirlCalls.log_prob_diff``)."""
        self.siirl.log_prob_diff(data, world_size)

    def process_local_validation_metrics(self, data_sources: Any, sample_inputs: Any,
                                         infos_dict: Mapping[str, Any], sample_turns: Any,
                                         world_size: int | None = None) -> None:
        """Record ``val-core/*``, ``val-aux/*`` and ``val/test_score/*``."""
        self.siirl.validation(data_sources, sample_inputs, infos_dict, sample_turns,
                              world_size)

    def stop(self) -> None:
        """siiRL's ``MetricClient.stop()``: wait until the service has taken every batch this
        rank handed over (the driver ends the service: ``metricsvc.stop_metric_worker``)."""
        self.wait_acks()

    def wait_final_res(self, step: int | None = None, timeout_s: float | None = None, *,
                       timeout: float | None = None) -> dict:
        """Return the merged metrics of ``step`` (default: the last step this rank closed).
        Raises ``StepNotFinal`` (a TimeoutError) after ``timeout_s`` seconds (``timeout=``,
        siiRL's spelling, is accepted too)."""
        return self.siirl.wait_final_res(step, timeout_s, timeout)
