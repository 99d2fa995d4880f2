"""The MetricWorker Ray actor: the run's components, behind Ray calls.

It owns the run folder (``run_folder``), the merge (``Aggregator``), the journal
(``Journal``, the service's log), the readers' results (``Results``) and the sinks
(``SinkDispatcher``). The actor is threaded, not asyncio: Ray runs a threaded actor's call
for about half the CPU of an async one, and the singleton's CPU per call is what bounds a
run's steps per second. A rank's ``submit`` merges under the actor's lock and returns at
once; ``wait_final_res`` callers wait in a thread group of their own (``readers``), so
waiting readers can never hold up a merge; finished steps reach the sinks through
background threads, so no sink I/O sits on the merge path. Starting it from a driver is
``metricsvc.service``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import ray
import yaml

from metricsvc.aggregator import Aggregator, StepResult
from metricsvc.config import (
    ConfigSource,
    ServiceConfig,
    load_config,
)
from metricsvc.errors import BatchRejected, Refused, ServiceClosed
from metricsvc.files import write_atomic
from metricsvc.history import RunHistory
from metricsvc.journal import Journal
from metricsvc.records import Batch
from metricsvc.redaction import Redactor
from metricsvc.resend import is_stale
from metricsvc.results import ReaderMethods, Results
from metricsvc.rewinds import Rewinds
from metricsvc.run_folder import (
    claim_run_dir,
    hold_run_dir,
)
from metricsvc.siirl import SiirlActorMethods
from metricsvc.sinks import SinkDispatcher, build_sinks
from metricsvc.stream_calls import StreamCallMethods
from metricsvc.timer import StragglerTimer

log = logging.getLogger(__name__)


def _actor_id() -> str | None:
    try:
        return ray.get_runtime_context().get_actor_id()
    except Exception:  # not inside an actor (the impl built directly)
        return None


def _restarted_by_ray() -> bool:
    try:
        with warnings.catch_warnings():  # Ray's property reads its own deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not inside an actor (the impl built directly)
        return False


class MetricWorkerImpl(ReaderMethods, StreamCallMethods, SiirlActorMethods):
    """Actor body; use ``MetricWorker`` (the Ray actor class) or ``start_metric_worker``."""

    def __init__(self, config: ConfigSource = None) -> None:
        self.config: ServiceConfig = load_config(config)
        cfg = self.config
        self.aggregator = Aggregator(**cfg.merge_options())
        self.run_dir = cfg.run.run_dir().resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.run_dir, cfg.sinks)  # the service's log, its own
        self._owner_fd: int | None = hold_run_dir(self.run_dir, cfg.name)
        # Only a restart of this run (by Ray, or an explicit resume) reloads the folder.
        continuing = _restarted_by_ray() or cfg.run.resume
        self.actor = _actor_id()
        if not continuing:
            claim_run_dir(self.run_dir, cfg)
        dumped = cfg.model_dump()
        self.redactor = Redactor(dumped)
        write_atomic(self.run_dir / "config.yaml", yaml.safe_dump(self.redactor.value(dumped)))
        # Held by every call that reads or changes the merge state, and by the readers'
        # condition: Ray runs this actor's calls on several threads.
        self._lock = threading.RLock()
        self.results = Results(self.aggregator, cfg.limits.keep_results, self.run_dir,
                               self._lock)
        self.epoch = uuid.uuid4().hex  # a new one per incarnation: clients resend on a change
        self.job = ray.get_runtime_context().get_job_id()  # the job whose run this is
        self.aggregator.journaled_meta = self.journal.meta  # an old step's batches: checked
        # After a restart: finished steps, running totals and recent digests, streamed from
        # the journal (what stays is bounded, whatever its length)
        self.restored_steps, journal = (
            self.journal.restore(self.aggregator, self.results) if continuing else (0, None))
        # Continuing a run, each sink continues its backend run and is given the journaled
        # steps past its watermark: what users look at survives the restart too.
        writer = {} if self.journal.writer is None else {"jsonl": self.journal.writer}
        # The run's segments as the journal records them: every sink's watermark obeys it
        self.history = RunHistory.read(self.journal.path if continuing else None)
        self.sinks = SinkDispatcher(build_sinks(cfg.sinks, check=True, built=writer),
                                    self.run_dir, cfg.sinks.delivery, self.redactor,
                                    replay=journal, history=self.history)
        self.rewinds = Rewinds(self.aggregator, self.journal, self.results, self.sinks,
                               self.aggregator.last_emitted if self.restored_steps else None)
        self.timer = StragglerTimer(cfg.straggler_timeout_s, self._lock,
                                    self.aggregator.expire, self._publish)
        self._started = time.time()
        self.calls: Counter[str] = Counter()
        self.merge_cpu_s = 0.0  # CPU inside the ranks' calls: the service's own work
        self._closed = False
        self.combiners: dict[str, dict[str, Any]] = {}  # label -> its last reported health
        # Resuming from a checkpoint: rewound before any batch is taken, once (a Ray restart
        # of this actor finds its own rewind in the journal and leaves the rerun alone)
        if cfg.run.from_step is not None and not self.history.made_by(self.actor):
            with self._lock:
                self.rewinds.rewind(cfg.run.from_step, by=self.actor)

    def _durable_through(self) -> int | None:
        """Return the last step the journal holds (clients may forget batches up to it)."""
        if self.journal.writer is None:  # no journal: nothing more durable than memory
            return self.aggregator.last_emitted
        written = self.sinks.last_step(self.journal.writer)
        # After a restart the journal already holds the reloaded steps.
        return self.rewinds.reloaded_through if written is None else written

    def _stale(self, epoch: str | None) -> bool:
        """Return True (and count it) if a caller last heard from another incarnation."""
        if not is_stale(epoch, self.epoch):
            return False
        self.calls["epoch_changed"] += 1
        return True

    def _check_open(self, what: str) -> None:
        """Refuse a call that would change the run once ``close`` has begun: its sender
        hears it (never acked and lost)."""
        if self._closed:
            self.calls["refused_closed"] += 1
            raise ServiceClosed(
                f"MetricWorker {self.config.name!r} is closed ({what} refused): nothing of it "
                f"was merged; start a service (start_metric_worker, run.resume: true to "
                f"continue this run) before sending more")

    def _ack(self, status: str, **extra: Any) -> dict[str, Any]:
        return {"status": status, "epoch": self.epoch, "durable_through": self._durable_through(),
                "last_final_step": self.aggregator.last_emitted, **extra}

    # -- ranks -------------------------------------------------------------------------
    def submit(self, batch: Batch | bytes, epoch: str | None = None) -> dict[str, Any]:
        """Merge one rank's batch (or its wire bytes); return the ack.

        ``epoch``: the incarnation the client last heard from. If this is another one
        (the actor restarted), nothing is merged and the ack says ``epoch_changed``: the
        client first resends what the journal may have lost, then this batch, so a new
        step cannot finish ahead of an older one it still owes (``metricsvc.resend``).

        Raises:
            BatchRejected: (a ValueError) the batch was refused; nothing was merged.
        """
        with _merging(self):
            return self._submit(batch, epoch)

    def _submit(self, batch: Batch | bytes, epoch: str | None) -> dict[str, Any]:
        self._check_open("submit")
        if self._stale(epoch):
            return self._ack("epoch_changed")
        self.calls["submit"] += 1
        self.timer.start()
        newest = self.aggregator.newest_closed
        answer, finished = self._take(batch)
        if finished:
            self._publish(finished)
        elif self.aggregator.newest_closed != newest:
            self.results.notify()  # wait_final_res(step=None) watches newest_closed
        return self._ack(**answer)

    def _take(self, batch: Batch | bytes) -> tuple[dict[str, Any], list[StepResult]]:
        """Merge one rank's batch; return what that rank hears (``status``, ``step``,
        ``seq``, ``notice``) and the steps it finished. The one path for a batch, sent
        directly or through a combiner: the same refusal, notice and journal lines.

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

    def submit_many(self, batches: list[Batch | bytes], epoch: str | None = None,
                    combiner: dict[str, Any] | None = None) -> dict[str, Any]:
        """Merge batches forwarded by a combiner, each exactly as if sent directly.

        Returns the ack with one answer per batch in ``answers``: what ``submit`` would
        have answered that rank, or the exception it would have raised (a refusal does not
        stop the others); the combiner relays each to its rank. ``epoch`` as for
        ``submit``: another incarnation's answers ``epoch_changed`` and merges nothing.
        ``combiner``: the combiner's own health, shown in ``health()["combiners"]``.
        """
        with _merging(self):
            if combiner is not None:
                self.combiners[str(combiner.get("label"))] = combiner
            return self._submit_many(batches, epoch)

    def _submit_many(self, batches: list[Batch | bytes], epoch: str | None) -> dict[str, Any]:
        self._check_open("submit_many")
        if self._stale(epoch):
            return self._ack("epoch_changed")
        self.calls["submit_many"] += 1
        self.timer.start()
        answers: list[dict[str, Any] | BatchRejected] = []
        finished: list[StepResult] = []
        for batch in batches:
            try:
                answer, done = self._take(batch)
            except BatchRejected as err:
                answers.append(err)
                continue
            answers.append(answer)
            finished.extend(done)
        if finished:
            self._publish(finished)
        else:
            self.results.notify()
        return self._ack("batch", answers=answers)

    def job_id(self) -> str:
        """Return the id of the Ray job that started this service (it dies with that job)."""
        return self.job

    def health(self) -> dict[str, Any]:
        """Return the actor's state: pending steps, counters, sink errors, run folder."""
        with self._lock:
            return _health(self)

    # -- lifecycle ---------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every finished step so far has been handed to the sinks."""
        return self.sinks.flush(timeout_s)

    @ray.method(concurrency_group="control")
    def close(self) -> dict[str, Any]:
        """Flush and close every sink, then let go of the run folder; a second call is
        harmless. Returns ``health()``."""
        with self._lock:  # no merge runs once this is set, and none starts after it
            first = not self._closed
            self._closed = True
            self.timer.stop()
        if first:
            self.sinks.close()
            if self._owner_fd is not None:
                os.close(self._owner_fd)  # the folder may have a new owner now
                self._owner_fd = None
        return self.health()

    def rewind(self, to_step: int) -> dict[str, Any]:
        """Resume from the checkpoint of ``to_step``: every step after it is recorded afresh.

        A new segment of the run's history begins (``metricsvc.history``), journaled and
        synced before this returns. Published steps past it are superseded, not deleted:
        their records stay in the journal, archived, and every reader shows the latest
        segment; TensorBoard is given its restart marker (it shows the rerun); every sink's
        watermark goes back, so it is given the rerun, and a restart replays it. Running
        totals continue from the last step at or before ``to_step``. Returns
        ``{"to_step", "superseded"}``.
        """
        if isinstance(to_step, bool) or not isinstance(to_step, int) or to_step < -1:
            raise Refused(f"rewind(to_step=...) takes a step >= -1 (-1: before step 0), "
                          f"got {to_step!r}")
        with self._lock:
            self._check_open("rewind")
            return self.rewinds.rewind(to_step)

    def config_dump(self) -> dict[str, Any]:
        """Return the config this service runs (secrets hidden), for ``start_metric_worker``
        to compare with the one it is asked to start."""
        return self.redactor.value(self.config.model_dump(mode="json"))

    def __ray_shutdown__(self) -> None:
        # Called by Ray when the actor ends gracefully. Best effort: by then Ray has ended
        # the actor's child processes (wandb's writer among them) unless
        # RAY_kill_child_processes_on_worker_exit=0; close() before that is the sure way.
        self.sinks.close(timeout_s=10)

    # -- internals ---------------------------------------------------------------------
    def _publish(self, finished: list[StepResult]) -> None:
        """Keep finished steps for readers and hand them to the sinks (the lock is held)."""
        for result in finished:
            self.results.put(result)
            self.sinks.publish(result.step, result.metrics, result.meta)
        self.results.notify()


def _health(w: MetricWorkerImpl) -> dict[str, Any]:
    """The MetricWorker's health: each part it holds reports its own."""
    sinks = w.sinks.health()
    journal = w.journal.health()
    return {
        "name": w.config.name,
        "epoch": w.epoch,
        "pid": os.getpid(),
        "restored_steps": w.restored_steps,
        "journal_skipped_lines": journal["skipped_lines"],
        "journal_duplicate_steps": journal["duplicate_steps"],
        "journal": journal["path"],
        **w.aggregator.health(),  # each component reports its own
        "durable_through": w._durable_through(),
        "timer_errors": w.timer.errors,
        "failing_sinks": sorted(name for name, h in sinks.items() if h["failing"]),
        "calls": dict(w.calls),
        "sinks": sinks,
        "sink_errors": w.sinks.errors,
        "run_dir": str(w.run_dir),
        "uptime_s": time.time() - w._started,
        "cpu_s": time.process_time(),  # this process's CPU time, all its threads
        "merge_cpu_s": w.merge_cpu_s,  # of it, inside submit / submit_many
        "closed": w._closed,
        "combiners": dict(w.combiners),
    }



@contextlib.contextmanager
def _merging(worker: MetricWorkerImpl) -> Iterator[None]:
    """Hold the actor's lock for a rank's call, counting its CPU in ``merge_cpu_s``."""
    start = time.thread_time()
    try:
        with worker._lock:
            yield
    finally:
        worker.merge_cpu_s += time.thread_time() - start


_DEFAULTS = ServiceConfig()


@functools.cache
def actor_class(max_readers: int = _DEFAULTS.max_readers) -> Any:
    """Return the Ray actor class whose ``readers`` group has ``max_readers`` threads (Ray
    fixes concurrency groups with the class, not in ``.options``)."""
    return ray.remote(
        num_cpus=0,
        max_restarts=_DEFAULTS.max_restarts,
        max_concurrency=_DEFAULTS.max_concurrency,
        concurrency_groups={"readers": max_readers, "control": 4},
    )(type("MetricWorker", (MetricWorkerImpl,), {"__doc__": MetricWorkerImpl.__doc__}))
    # (Named MetricWorker so that Ray's log lines read "(MetricWorker pid=...)".)


MetricWorker = actor_class()
"""The Ray actor class. ``start_metric_worker`` creates the named singleton from a config."""
