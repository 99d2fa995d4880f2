"""The MetricWorker Ray actor: a thin shell around the pure engine (``engine.Engine``).

The shell owns what the engine must not: the run folder and its owner lock, the actor's
lock and threads, the incarnation (``epoch``) senders name, the readers waiting for
results, the straggler timer, the journal and the other sinks (``SinkDispatcher``), Ray's
metrics, and the order of a rewind (the journal first). Every call that changes the run
passes ``_intake``: refused once the service is closed (``ServiceClosed``), answered
``epoch_changed`` when the caller last heard from another incarnation, merged under the
lock, its finished steps kept for readers and handed to the sinks, answered with one ack.

The actor is threaded, not asyncio: Ray runs a threaded actor's call for about half the
CPU of an async one, and the singleton's CPU per call bounds a run's steps per second.
``wait_final_res`` callers wait in a thread group of their own (``readers``), so waiting
readers can never hold up a merge; no sink I/O sits on the merge path.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
import warnings
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator
from typing import Any

import ray
import yaml

from metricsvc.config import ConfigSource, ServiceConfig, load_config
from metricsvc.core.keys import is_int
from metricsvc.core.redaction import Redactor
from metricsvc.core.wire import Batch
from metricsvc.errors import (
    BatchRejected,
    Refused,
    ServiceClosed,
    StepNotFinal,
    StepUnavailable,
)
from metricsvc.service.engine import Engine
from metricsvc.service.observe import LiveMetrics, Reporter
from metricsvc.service.output import StepResult
from metricsvc.sinks import SinkDispatcher, build_sinks
from metricsvc.sinks.jsonl import JsonlSink
from metricsvc.storage.files import write_atomic
from metricsvc.storage.history import Rewind, RunHistory
from metricsvc.storage.journal import Journal, iter_journal
from metricsvc.storage.run_folder import claim_run_dir, hold_run_dir

log = logging.getLogger(__name__)


def _context() -> tuple[str | None, str | None, str | None, bool]:
    """Where this body runs: its actor id, node id and job id, and whether Ray restarted
    it; all None (and False) where it is built outside an actor (a benchmark, a test)."""
    if not ray.is_initialized():  # ``get_runtime_context`` would start a Ray here
        return None, None, None, False
    context = ray.get_runtime_context()
    try:
        actor = context.get_actor_id()
        with warnings.catch_warnings():  # Ray's property reads its own deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = bool(context.was_current_actor_reconstructed)
    except Exception:  # not inside an actor (the body built in a driver)
        actor, restarted = None, False
    return actor, context.get_node_id(), context.get_job_id(), restarted


class Results:
    """The published steps a reader may ask for, the newest ``keep``, and every one in
    publish order for Ray's metrics (``since``). Readers wait on one condition of the
    actor's lock: what a reader checks is never half merged."""

    def __init__(self, keep: int, lock: threading.RLock) -> None:
        self.keep = keep
        self.by_step: OrderedDict[int, StepResult] = OrderedDict()
        self.changed = threading.Condition(lock)
        self.published = 0  # results put so far
        self._log: deque[StepResult] = deque(maxlen=10_000)

    def put(self, result: StepResult) -> None:
        """Keep ``result`` (forgetting the oldest past ``keep``)."""
        self.by_step[result.step] = result
        while len(self.by_step) > self.keep:
            self.by_step.popitem(last=False)
        self._log.append(result)
        self.published += 1

    def since(self, count: int) -> list[StepResult]:
        """The results put after the first ``count`` (at most the last 10,000)."""
        return list(self._log)[max(0, len(self._log) - (self.published - count)):]

    def forget_after(self, step: int) -> None:
        """Forget every kept result past ``step`` (a rewind supersedes them)."""
        for later in [s for s in self.by_step if s > step]:
            del self.by_step[later]


class MetricWorkerImpl:
    """Actor body; use ``MetricWorker`` (the Ray actor class) or ``start_metric_worker``."""

    def __init__(self, config: ConfigSource = None) -> None:
        cfg = self.config = load_config(config)
        self.run_dir = cfg.run.run_dir().resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(cfg.journal(self.run_dir))
        self._owner_fd: int | None = hold_run_dir(self.run_dir, cfg.name)
        self.actor, self.node_id, self.job, restarted = _context()
        continuing = restarted or cfg.run.resume  # only these reload the folder
        if not continuing:
            claim_run_dir(self.run_dir, self.journal.path, cfg.name,
                          check=cfg.run.trial is not None)
        dumped = cfg.model_dump()
        self.redactor = Redactor(dumped)
        write_atomic(self.run_dir / "config.yaml", yaml.safe_dump(self.redactor.value(dumped)))
        self.engine = Engine(**cfg.merge_options(), journaled_meta=self.journal.meta)
        # Held by every call that reads or changes the merge state, and by the readers'
        # condition: Ray runs this actor's calls on several threads.
        self.lock = threading.RLock()
        self.results = Results(cfg.limits.keep_results, self.lock)
        # The run's segments as the journal records them: every sink's watermark obeys it.
        # Continuing a run, each sink continues its backend run and is given the journaled
        # steps past its watermark: what users look at survives the restart too.
        self.history = RunHistory.read(self.journal.path if continuing else None)
        self.restored_steps = self._restore() if continuing else 0
        # The last step the journal held when this incarnation reloaded it (None: new run)
        self.reloaded_through = self.engine.last_emitted if self.restored_steps else None
        self.writer = None if self.journal.path is None else JsonlSink(cfg.sinks.jsonl)
        # The replay is the journal as this incarnation found it: what it journals later
        # (a rewind, its rerun) reaches each sink through its queue, once.
        replay = (functools.partial(iter_journal, self.journal.path,
                                    lines=self.journal.line_count())
                  if continuing and self.journal.holds_steps() else None)
        self.sinks = SinkDispatcher(
            build_sinks(cfg.sinks, check=True, built={"jsonl": self.writer} if self.writer
                        else {}),
            self.run_dir, cfg.sinks.delivery, self.redactor, replay=replay, history=self.history)
        self.journal_mark = self.sinks.mark_of(self.writer) if self.writer else None
        self.epoch = uuid.uuid4().hex  # a new one per incarnation: senders resend on a change
        self.calls: Counter[str] = Counter()
        self.merge_cpu_s = 0.0  # CPU inside the ranks' calls (submit, submit_many)
        self.closed = False
        self.combiners: dict[str, dict[str, Any]] = {}  # label -> its last reported health
        self._timer: threading.Thread | None = None
        self._stopped = threading.Event()
        self.timer_errors = 0
        self.live = LiveMetrics(cfg.name, enabled=cfg.metrics.enabled, export=cfg.metrics.export)
        self.reporter = Reporter(self.live, self.health, self.results, cfg.metrics.interval_s)
        self.started = time.time()
        self.resume = self._resume(cfg.run.from_step)
        self.reporter.start()

    def _restore(self) -> int:
        """After a restart: the engine continues from the journal's steps (streamed: what
        stays is bounded, whatever its length) and readers get the last ones; return how
        many were read."""
        recent: deque[dict[str, Any]] = deque(maxlen=self.results.keep)
        count = 0

        def kept(records: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
            nonlocal count
            for record in records:
                recent.append(record)
                count += 1
                yield record

        self.engine.restore(kept(self.journal.steps()),
                            (rewind.streams for rewind in self.history.rewinds if rewind.streams))
        for record in recent:
            self.results.put(StepResult(int(record["step"]), record["metrics"], record["meta"]))
        if count:
            log.warning("restarted: %d finished steps reloaded from %s (last step %s)",
                        count, self.journal.path, self.engine.last_emitted)
        return count

    def _resume(self, from_step: int | None) -> dict[str, Any] | None:
        """Resuming from a checkpoint: rewound before any batch is taken, once (a Ray
        restart of this actor finds its own rewind in the journal and leaves the rerun
        alone). Returns what the journal held then (``health()["resume"]``), recorded with
        the rewind, so every incarnation reports it."""
        if from_step is None:
            return None
        made = self.history.made_by(self.actor)
        if made is None:
            held = self.reloaded_through
            with self.lock:
                self._rewind(from_step, by=self.actor, held=-1 if held is None else held)
            return resume_report(from_step, held)
        if made.held is None:
            return None
        return resume_report(made.to_step, None if made.held < 0 else made.held)

    # -- the intake: ranks, combiners and streams --------------------------------------
    def _intake(self, what: str, epoch: str | None) -> bool:
        """Under the lock: refuse a call that would change the run once ``close`` has begun;
        True (and counted) if the caller last heard from another incarnation."""
        if self.closed:
            self.calls["refused_closed"] += 1
            raise ServiceClosed(
                f"MetricWorker {self.config.name!r} is closed ({what} refused): nothing of it "
                f"was merged; start a service (start_metric_worker, run.resume: true to "
                f"continue this run) before sending more")
        if epoch is not None and epoch != self.epoch:
            self.calls["epoch_changed"] += 1
            return True
        self.calls[what] += 1
        return False

    def _ack(self, status: str, **extra: Any) -> dict[str, Any]:
        """What every sender hears: the status, this incarnation, the run's rewinds (each
        one's ``to_step``, oldest first: a sender drops what they superseded), how far the
        journal holds (a stream client's ``extra`` says how far its own batches are, None:
        none yet), the last final step."""
        return {"status": status, "epoch": self.epoch,
                "rewinds": [r.to_step for r in self.history.rewinds] if self.history.rewinds
                else [],
                "journal_through": self.journal_through(),
                "last_final_step": self.engine.last_emitted, **extra}

    def _take(self, item: Batch | bytes) -> tuple[dict[str, Any], list[StepResult]]:
        """Merge one rank's batch; return what that rank hears (``status``, ``step``,
        ``seq``, ``notice``) and the steps it finished. A late batch is journaled.

        Raises:
            BatchRejected: the batch was refused; nothing was merged.
        """
        try:
            outcome = self.engine.submit(item)
        except BatchRejected as err:
            log.warning("rejected batch: %s", err)
            raise
        if outcome.status == "late":
            log.warning("late batch: step %d from rank %d arrived after the step was published",
                        outcome.step, outcome.rank)
            self.sinks.event({"type": "late_batch", "step": outcome.step, "rank": outcome.rank,
                              "seq": outcome.seq, "keys": outcome.keys})
        answer = {"status": outcome.status, "step": outcome.step, "seq": outcome.seq}
        if outcome.notice is not None:
            answer["notice"] = outcome.notice
        return answer, outcome.finished

    def submit(self, batch: Batch | bytes, epoch: str | None = None) -> dict[str, Any]:
        """Merge one rank's batch (or its wire bytes); return the ack.

        ``epoch``: the incarnation the client last heard from. If this is another one (the
        actor restarted), nothing is merged and the ack says ``epoch_changed``: the client
        first resends what the journal may have lost, then this batch (``metricsvc.transport``).

        Raises:
            BatchRejected: (a ValueError) the batch was refused; nothing was merged.
        """
        with self.lock:
            start = time.thread_time()  # a rank's call: its CPU counted in merge_cpu_s
            try:
                if self._intake("submit", epoch):
                    return self._ack("epoch_changed")
                if self._timer is None:
                    self._start_timer()
                newest = self.engine.newest_closed
                answer, finished = self._take(batch)
                ack = self._ack(**answer)
                if finished or self.engine.newest_closed != newest:
                    self._publish(finished)  # wait_final_res(step=None) watches newest_closed
                return ack
            finally:
                self.merge_cpu_s += time.thread_time() - start

    def submit_many(self, batches: list[Batch | bytes], epoch: str | None = None,
                    combiner: dict[str, Any] | None = None) -> dict[str, Any]:
        """Merge batches forwarded by a combiner, each exactly as if sent directly.

        Returns the ack with one answer per batch in ``answers``: what ``submit`` would
        have answered that rank, or the exception it would have raised (a refusal does not
        stop the others); the combiner relays each to its rank. ``combiner``: the
        combiner's own health, shown in ``health()["combiners"]``.
        """
        with self.lock:
            start = time.thread_time()
            try:
                if combiner is not None:
                    self.combiners[str(combiner.get("label"))] = combiner
                if self._intake("submit_many", epoch):
                    return self._ack("epoch_changed")
                if self._timer is None:
                    self._start_timer()
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
                self._publish(finished)
                return self._ack("batch", answers=answers)
            finally:
                self.merge_cpu_s += time.thread_time() - start

    def stream_submit(self, name: str, client: str, batch: Batch | bytes,
                      epoch: str | None = None) -> dict[str, Any]:
        """Add a stream client's records to the current window of stream ``name``.

        The restart protocol of ``submit``, with the client's batch numbers for steps: the
        ack's ``journal_through`` is the newest batch of ``client`` that a journaled step
        holds."""
        with self.lock:
            stale = self._intake("stream_submit", epoch)
            status, seq = ("epoch_changed", None) if stale else \
                self.engine.submit_stream(name, client, batch)
            journaled = self.engine.streams.ledger.through(name, client, self.journal_through())
            return self._ack(status, journal_through=journaled,
                             **({} if seq is None else {"seq": seq}))

    def export_stream(self, name: str, step: int, close: bool = False) -> dict[str, float]:
        """Publish the window of stream ``name`` with ``step``, start a new window, and
        return the window's metrics. ``close=True``: a step no rank submits is final with
        the window alone. Raises ``BatchRejected`` (window kept) if the step is final."""
        with self.lock:
            self._intake("export_stream", None)
            if self._timer is None:
                self._start_timer()
            metrics, finished = self.engine.export_stream(name, int(step), close)
            self._publish(finished)
            return metrics

    def _publish(self, finished: list[StepResult]) -> None:
        """Keep finished steps for readers and hand them to the sinks (the lock is held);
        wake the readers."""
        for result in finished:
            self.results.put(result)
            self.sinks.publish(result.step, result.metrics, result.meta)
        self.results.changed.notify_all()

    def journal_through(self) -> int | None:
        """Return the last step the journal holds (clients may forget batches up to it)."""
        if self.journal_mark is None:  # no journal: nothing more durable than memory
            return self.engine.last_emitted
        written = self.journal_mark.last_step
        # After a restart the journal already holds the reloaded steps.
        return self.reloaded_through if written is None else written

    # -- the straggler timer -------------------------------------------------------------
    def _start_timer(self) -> None:
        """Start the timer once, at the first call that may open a step (no straggler
        timeout: never)."""
        timeout = self.config.straggler_timeout_s
        if self._timer is None and timeout is not None:
            self._timer = threading.Thread(target=self._expire, args=(min(1.0, timeout / 4),),
                                           daemon=True, name="metricsvc-straggler-timer")
            self._timer.start()

    def _expire(self, period: float) -> None:
        """Finish, as partial, the steps whose straggler timeout passed."""
        while not self._stopped.wait(period):
            try:
                with self.lock:  # a merge never sees a step half expired
                    if self._stopped.is_set():  # closed meanwhile: nothing is published
                        return
                    finished = self.engine.expire()
                    for r in finished:
                        if r.meta["partial"]:
                            log.warning("step %d finished partial: missing ranks %s",
                                        r.step, r.meta["missing_ranks"])
                    if finished:
                        self._publish(finished)
            except Exception:  # the straggler timer must outlive any one bad step
                self.timer_errors += 1
                log.exception("straggler timer: finishing timed-out steps failed")

    # -- readers -------------------------------------------------------------------------
    @ray.method(concurrency_group="readers")
    def wait_final_res(self, step: int | None = None,
                       timeout_s: float | None = None) -> dict[str, float]:
        """Return the merged metrics of ``step`` once it is final.

        ``step=None`` means the newest step any rank has closed (waiting for one if none
        has). Raises ``StepNotFinal`` (a TimeoutError) after ``timeout_s``.
        """
        return self._wait(step, timeout_s).metrics

    @ray.method(concurrency_group="readers")
    def wait_final(self, step: int | None = None, timeout_s: float | None = None) -> dict:
        """Like ``wait_final_res`` but return ``{"step", "metrics", "meta"}``."""
        result = self._wait(step, timeout_s)
        return {"step": result.step, "metrics": result.metrics, "meta": result.meta}

    def _wait(self, step: int | None, timeout_s: float | None) -> StepResult:
        """The result of ``step`` once it is final (``None``: the newest step any rank
        closed, waiting for one if none has).

        Raises:
            StepNotFinal: not final within ``timeout_s`` (the message names who holds it).
            StepUnavailable: final, but never submitted or no longer kept.
        """
        engine = self.engine
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def until(ready: Any) -> bool:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self.results.changed.wait_for(ready, left)

        with self.results.changed:
            if step is None and not until(lambda: engine.newest_closed is not None):
                raise StepNotFinal(engine.not_final(None, timeout_s))
            target = int(engine.newest_closed if step is None else step)  # type: ignore[arg-type]
            if not until(lambda: engine.last_emitted is not None
                         and engine.last_emitted >= target):
                raise StepNotFinal(engine.not_final(target, timeout_s))
            result = self.results.by_step.get(target)
        if result is None:
            raise StepUnavailable(
                f"step {target} has no result: no rank submitted it, or it was evicted "
                f"(keep_results={self.results.keep}); the journal under {self.run_dir} holds "
                f"every finished step")
        return result

    def get_result(self, step: int) -> dict | None:
        """Return ``{"step", "metrics", "meta"}`` of a finished step, or None; never waits."""
        result = self.results.by_step.get(step)
        return None if result is None else {"step": step, "metrics": result.metrics,
                                            "meta": result.meta}

    def job_id(self) -> str | None:
        """Return the id of the Ray job that started this service (it dies with that job)."""
        return self.job

    def health(self) -> dict[str, Any]:
        """Return the actor's state: pending steps, counters, sink errors, run folder."""
        with self.lock:
            sinks = self.sinks.health()
            journal = self.journal.health()
            return {
                "name": self.config.name,
                "epoch": self.epoch,
                "pid": os.getpid(),
                "node_id": self.node_id,  # its run folder is on this node
                "restored_steps": self.restored_steps,
                "resume": self.resume,
                "journal_skipped_lines": journal["skipped_lines"],
                "journal_duplicate_steps": journal["duplicate_steps"],
                "journal": journal["path"],
                **self.engine.health(),
                "journal_through": self.journal_through(),
                "timer_errors": self.timer_errors,
                "failing_sinks": sorted(name for name, h in sinks.items() if h["failing"]),
                "calls": dict(self.calls),
                "sinks": sinks,
                "sink_errors": self.sinks.errors,
                "run_dir": str(self.run_dir),
                "uptime_s": time.time() - self.started,
                "cpu_s": time.process_time(),  # this process's CPU time, all its threads
                "merge_cpu_s": self.merge_cpu_s,  # of it, inside submit / submit_many
                "closed": self.closed,
                "combiners": dict(self.combiners),
                "metrics_export": self.live.status(),
            }

    # -- lifecycle -------------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every finished step so far has been handed to the sinks (during a
        close: until the close has written or dead-lettered each); True if it has."""
        return self.sinks.flush(timeout_s)

    @ray.method(concurrency_group="control")
    def close(self) -> dict[str, Any]:
        """Flush and close every sink, then let go of the run folder; returns ``health()``.
        A later call (another caller's, or one made while the first still runs) returns
        once the first has closed the sinks, within the first's ``close_timeout_s``."""
        with self.lock:  # none runs once this is set, none starts after it
            first = not self.closed
            self.closed = True
            self._stopped.set()
        if not first:
            # A stop's kill follows its close: answered before the sinks are closed, it
            # would end a sink mid-write, its step neither written nor dead-lettered.
            self.sinks.wait_closed()
            return self.health()
        self.sinks.close()
        self.reporter.stop()  # the final state, reported once more
        if self._owner_fd is not None:
            os.close(self._owner_fd)  # the folder may have a new owner now
            self._owner_fd = None
        return self.health()

    def start(self) -> None:
        """siiRL's ``MetricWorker.start()``: the service serves from its creation, so this
        only answers (``ray.get(metric_worker.start.remote())`` works as in siiRL)."""

    def stop(self) -> None:
        """siiRL's ``MetricWorker.stop()``: nothing to stop between steps here. The service
        keeps serving; end it with ``metricsvc.stop_metric_worker`` (or ``close()``)."""

    def rewind(self, to_step: int) -> dict[str, Any]:
        """Resume from the checkpoint of ``to_step``: every step after it is recorded afresh.

        A new segment of the run's history begins (``metricsvc.storage.history``),
        journaled and synced before this returns. Published steps past it are superseded,
        not deleted: their records stay in the journal, archived, and every reader shows
        the latest segment; TensorBoard is given its restart marker; every sink's
        watermark goes back, so it is given the rerun, and a restart replays it. Running
        totals continue from the last step at or before ``to_step``. Returns
        ``{"to_step", "superseded"}``.
        """
        if not is_int(to_step) or to_step < -1:
            raise Refused(f"rewind(to_step=...) takes a step >= -1 (-1: before step 0), "
                          f"got {to_step!r}")
        with self.lock:
            self._intake("rewind", None)
            return self._rewind(to_step)

    def _rewind(self, to_step: int, by: str | None = None,
                held: int | None = None) -> dict[str, Any]:
        """One operation over every part, in this order: the journal records it (synced; a
        rewind it lacks never happened), the engine forgets what it supersedes and continues
        the running totals from the last step at or before it, readers forget the superseded
        results, and every sink is given it in order with the steps around it."""
        settled = self.engine.settled_by(to_step)
        self.sinks.rewind(Rewind(to_step, by, held, settled), self.writer)  # the journal first
        superseded = self.engine.rewind(to_step, self._totals_at(to_step),
                                        self._steps_through(to_step), settled)
        self.results.forget_after(to_step)
        if self.reloaded_through is not None:
            self.reloaded_through = min(self.reloaded_through, to_step)
        log.warning("rewound to step %d: %d published steps superseded", to_step, superseded)
        self.results.changed.notify_all()
        return {"to_step": to_step, "superseded": superseded}

    def _totals_at(self, step: int) -> dict[str, Any] | None:
        """The running totals as of the last published step at or before ``step``: what the
        readers keep of it, else the journal's record."""
        kept = [s for s in self.results.by_step if s <= step]
        if kept:
            return self.results.by_step[max(kept)].meta.get("derived_totals")
        return self.journal.totals_at(step)

    def _steps_through(self, step: int) -> deque[tuple[int, dict[str, float]]]:
        """The last final steps at or before ``step``, ``(step, metrics)`` in order, as many
        as the alerts' windows hold: the journal's latest segment, else what readers keep."""
        reach = self.engine.alerts.reach
        if not reach:
            return deque()
        if self.journal.holds_steps():
            found = ((r["step"], r["metrics"]) for r in self.journal.steps())
        else:
            found = ((s, r.metrics) for s, r in sorted(self.results.by_step.items()))
        return deque(((s, m) for s, m in found if s <= step), maxlen=reach)

    def config_dump(self) -> dict[str, Any]:
        """Return the config this service runs (secrets hidden), for ``start_metric_worker``
        to compare with the one it is asked to start."""
        return self.redactor.value(self.config.model_dump(mode="json"))

    def __ray_shutdown__(self) -> None:
        # Called by Ray when the actor ends gracefully. Best effort: by then Ray has ended
        # the actor's child processes (wandb's writer among them) unless
        # RAY_kill_child_processes_on_worker_exit=0; close() before that is the sure way.
        self.sinks.close(timeout_s=10)


def resume_report(from_step: int, journal_through: int | None) -> dict[str, Any]:
    """What resuming a run from the checkpoint of ``from_step`` finds: the journal's last
    step (``journal_through``, None: it holds none) and, in ``unjournaled``, the steps after
    it up to ``from_step`` (``first``, ``last``, ``reason``; None where the journal reaches
    the checkpoint). The journal writes a step a moment after the step's ack, so a job that
    crashed right after its ranks' last acks can end before it held them: what the run
    finished of those steps is in no journal and no sink, and the rerun starts after them.
    Logged here; ``start_metric_worker`` warns the driver that resumes."""
    first = 0 if journal_through is None else journal_through + 1
    unjournaled = None
    if from_step >= first:
        span = f"step {first}" if from_step == first else f"steps {first}-{from_step}"
        held = ("holds no step of the run" if journal_through is None else
                f"holds the run only through step {journal_through}")
        unjournaled = {"first": first, "last": from_step, "reason": (
            f"resumed from step {from_step}, but the journal {held}: whatever the run "
            f"finished of {span} is in no journal and no sink (the run ended before its "
            f"journal wrote it; it writes each step a moment after the step's ack, and the "
            f"service's flush() waits for it); the rerun starts at step {from_step + 1}")}
        log.warning("%s", unjournaled["reason"])
    return {"from_step": from_step, "journal_through": journal_through,
            "unjournaled": unjournaled}


_DEFAULTS = ServiceConfig()


@functools.lru_cache(maxsize=16)
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
