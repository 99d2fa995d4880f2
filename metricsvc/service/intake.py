"""The service's intake: every call that changes the run's numbers passes here.

A rank's batch, a combiner's forwarded batches and a stream client's records each take
the actor's lock, are refused once the service is closed (``ServiceClosed``: the sender
hears it, nothing is acked and lost), are answered ``epoch_changed`` when the caller last
heard from another incarnation (``metricsvc.core.resend``), and publish the steps they
finished: kept for readers, handed to the sinks. The one path for a batch, sent directly
or through a combiner: the same refusal, notice and journal lines (``take``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from metricsvc.core.batch import Batch
from metricsvc.core.errors import BatchRejected, ServiceClosed
from metricsvc.core.resend import is_stale
from metricsvc.core.step_result import StepResult
from metricsvc.service.aggregator import Aggregator
from metricsvc.service.results import Results
from metricsvc.service.timer import StragglerTimer
from metricsvc.sinks import SinkDispatcher

log = logging.getLogger(__name__)


class Intake:
    """The merge path of one MetricWorker: its lock, its counters and its closed flag."""

    def __init__(self, name: str, aggregator: Aggregator, results: Results,
                 sinks: SinkDispatcher, lock: threading.RLock,
                 durable_through: Callable[[], int | None], epoch: str,
                 straggler_timeout_s: float | None,
                 observe: Callable[[int, dict, dict], None] | None = None) -> None:
        self.name = name
        self.aggregator, self.results, self.sinks = aggregator, results, sinks
        self.lock = lock  # the actor's: held by every call that reads or changes the merge
        self.durable_through = durable_through
        self.epoch = epoch  # a new one per incarnation: clients resend on a change
        self.timer = StragglerTimer(straggler_timeout_s, lock, aggregator.expire,
                                    self.publish)
        self.calls: Counter[str] = Counter()
        self.merge_cpu_s = 0.0  # CPU inside the ranks' calls: the service's own work
        self.closed = False
        self.combiners: dict[str, dict[str, Any]] = {}  # label -> its last reported health
        self.observe = observe  # each published step, for Ray's metrics (LiveMetrics.step)

    # -- the calls -------------------------------------------------------------------------
    def submit(self, batch: Batch | bytes, epoch: str | None) -> dict[str, Any]:
        """A rank's batch: merged, answered with the ack (``MetricWorker.submit``)."""
        with self._merging():
            self.check_open("submit")
            if self._stale(epoch):
                return self.ack("epoch_changed")
            self.calls["submit"] += 1
            self.timer.start()
            newest = self.aggregator.newest_closed
            answer, finished = self.take(batch)
            if finished:
                self.publish(finished)
            elif self.aggregator.newest_closed != newest:
                self.results.notify()  # wait_final_res(step=None) watches newest_closed
            return self.ack(**answer)

    def submit_many(self, batches: list[Batch | bytes], epoch: str | None,
                    combiner: dict[str, Any] | None) -> dict[str, Any]:
        """A combiner's batches, each answered as ``submit`` would have answered its rank
        (``MetricWorker.submit_many``)."""
        with self._merging():
            if combiner is not None:
                self.combiners[str(combiner.get("label"))] = combiner
            self.check_open("submit_many")
            if self._stale(epoch):
                return self.ack("epoch_changed")
            self.calls["submit_many"] += 1
            self.timer.start()
            answers: list[dict[str, Any] | BatchRejected] = []
            finished: list[StepResult] = []
            for batch in batches:
                try:
                    answer, done = self.take(batch)
                except BatchRejected as err:
                    answers.append(err)
                    continue
                answers.append(answer)
                finished.extend(done)
            if finished:
                self.publish(finished)
            else:
                self.results.notify()
            return self.ack("batch", answers=answers)

    def take(self, batch: Batch | bytes) -> tuple[dict[str, Any], list[StepResult]]:
        """Merge one rank's batch; return what that rank hears (``status``, ``step``,
        ``seq``, ``notice``) and the steps it finished.

        Raises:
            BatchRejected: the batch was refused; nothing was merged.
        """
        try:
            outcome = self.aggregator.submit(batch)
        except BatchRejected as err:
            log.warning("rejected batch: %s", err)
            raise
        batch = outcome.batch
        if outcome.status == "late":
            log.warning("late batch: step %d from rank %d arrived after the step was published",
                        batch.step, batch.rank)
            self.sinks.event({"type": "late_batch", "step": batch.step, "rank": batch.rank,
                              "seq": batch.seq, "keys": len(batch.keys)})
        answer = {"status": outcome.status, "step": batch.step, "seq": batch.seq}
        if outcome.notice is not None:
            answer["notice"] = outcome.notice
        return answer, outcome.finished

    def stream_submit(self, name: str, client: str, batch: Batch | bytes,
                      epoch: str | None) -> dict[str, Any]:
        """A stream client's records, into the window of stream ``name``; the ack's
        ``durable_through`` is the client's newest batch a journaled step holds."""
        with self.lock:
            self.check_open("stream_submit")
            if self._stale(epoch):
                return self._stream_ack("epoch_changed", name, client)
            self.calls["stream_submit"] += 1
            batch = self.aggregator.streams.decode(batch)
            status = self.aggregator.streams.submit(name, client, batch)
            return self._stream_ack(status, name, client, seq=batch.seq)

    def _stream_ack(self, status: str, name: str, client: str, **extra: Any) -> dict[str, Any]:
        ack = self.ack(status, **extra)
        ack["durable_through"] = self.aggregator.streams.ledger.through(
            name, client, ack["durable_through"])
        return ack

    def export_stream(self, name: str, step: int, close: bool) -> dict[str, float]:
        """Publish the window of stream ``name`` with ``step``; return its metrics."""
        with self.lock:
            self.check_open("export_stream")
            self.calls["export_stream"] += 1
            self.timer.start()
            metrics, finished = self.aggregator.export_stream(name, int(step), close)
            if finished:
                self.publish(finished)
            return metrics

    # -- what every call shares ------------------------------------------------------------
    def ack(self, status: str, **extra: Any) -> dict[str, Any]:
        return {"status": status, "epoch": self.epoch, "durable_through": self.durable_through(),
                "last_final_step": self.aggregator.last_emitted, **extra}

    def check_open(self, what: str) -> None:
        """Refuse a call that would change the run once ``close`` has begun."""
        if self.closed:
            self.calls["refused_closed"] += 1
            raise ServiceClosed(
                f"MetricWorker {self.name!r} is closed ({what} refused): nothing of it "
                f"was merged; start a service (start_metric_worker, run.resume: true to "
                f"continue this run) before sending more")

    def close(self) -> bool:
        """Refuse every later call (none runs once this is set, none starts after it) and
        stop the timer. Returns True the first time."""
        with self.lock:
            first = not self.closed
            self.closed = True
            self.timer.stop()
        return first

    def publish(self, finished: list[StepResult]) -> None:
        """Keep finished steps for readers and hand them to the sinks (the lock is held)."""
        for result in finished:
            self.results.put(result)
            self.sinks.publish(result.step, result.metrics, result.meta)
            if self.observe is not None:
                self.observe(result.step, result.metrics, result.meta)
        self.results.notify()

    def _stale(self, epoch: str | None) -> bool:
        """Return True (and count it) if a caller last heard from another incarnation."""
        if not is_stale(epoch, self.epoch):
            return False
        self.calls["epoch_changed"] += 1
        return True

    def _merging(self) -> _Merging:
        """Hold the lock for a rank's call, counting its CPU in ``merge_cpu_s``."""
        return _Merging(self)


class _Merging:
    """``Intake._merging``: a plain context manager (a rank's every call enters one)."""

    __slots__ = ("intake", "start")

    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    def __enter__(self) -> None:
        self.intake.lock.acquire()
        self.start = time.thread_time()

    def __exit__(self, *exc: object) -> None:
        try:
            self.intake.merge_cpu_s += time.thread_time() - self.start
        finally:
            self.intake.lock.release()
