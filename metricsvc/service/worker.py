"""The MetricWorker Ray actor: the run's components, behind Ray calls.

It owns the run folder (``storage.run_folder``), the merge (``Aggregator``), the journal
(``Journal``, the service's log), the intake every changing call passes (``Intake``), the
readers' results (``Results``), the rewinds and the sinks (``SinkDispatcher``). The
actor is threaded, not asyncio: Ray runs a threaded actor's call for about half the CPU
of an async one, and the singleton's CPU per call is what bounds a
run's steps per second. A rank's ``submit`` merges under the actor's lock and returns at
once; ``wait_final_res`` callers wait in a thread group of their own (``readers``), so
waiting readers can never hold up a merge; finished steps reach the sinks through
background threads, so no sink I/O sits on the merge path. Starting it from a driver is
``metricsvc.service.start``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
import warnings
from typing import Any

import ray
import yaml

from metricsvc.config import ConfigSource, ServiceConfig, load_config
from metricsvc.core.batch import Batch
from metricsvc.core.errors import Refused
from metricsvc.core.limits import is_int
from metricsvc.core.redaction import Redactor
from metricsvc.service import continuing as continuing_run
from metricsvc.service.aggregator import Aggregator
from metricsvc.service.health import worker_health
from metricsvc.service.intake import Intake
from metricsvc.service.observe import LiveMetrics, Reporter
from metricsvc.service.results import Results
from metricsvc.service.rewinds import Rewinds, resume_report
from metricsvc.sinks import SinkDispatcher, build_sinks
from metricsvc.storage.files import write_atomic
from metricsvc.storage.history import RunHistory
from metricsvc.storage.journal import Journal
from metricsvc.storage.run_folder import claim_run_dir, hold_run_dir

log = logging.getLogger(__name__)


def _ray_context() -> Any:
    """Ray's runtime context where this process is connected to Ray (an actor always is),
    else None: the body built directly (``bench_restart``, a test) starts no Ray, which
    ``ray.get_runtime_context()`` does where none is connected."""
    return ray.get_runtime_context() if ray.is_initialized() else None


def _actor_id(ray_context: Any) -> str | None:
    if ray_context is None:
        return None
    try:
        return ray_context.get_actor_id()
    except Exception:  # not inside an actor (the impl built in a driver)
        return None


def _restarted_by_ray(ray_context: Any) -> bool:
    if ray_context is None:
        return False
    try:
        with warnings.catch_warnings():  # Ray's property reads its own deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(ray_context.was_current_actor_reconstructed)
    except Exception:  # not inside an actor (the impl built in a driver)
        return False


class MetricWorkerImpl:
    """Actor body; use ``MetricWorker`` (the Ray actor class) or ``start_metric_worker``.
    Its calls are the public face of the components it holds (``intake``, ``results``,
    ``rewinds``, ``sinks``, ``journal``)."""

    def __init__(self, config: ConfigSource = None) -> None:
        self.config: ServiceConfig = load_config(config)
        cfg = self.config
        self.aggregator = Aggregator(**cfg.merge_options())
        self.run_dir = cfg.run.run_dir().resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.run_dir, cfg.sinks)  # the service's log, its own
        self._owner_fd: int | None = hold_run_dir(self.run_dir, cfg.name)
        # Only a restart of this run (by Ray, or an explicit resume) reloads the folder.
        context = _ray_context()
        continuing = _restarted_by_ray(context) or cfg.run.resume
        self.actor = _actor_id(context)
        # where it runs: its run folder is on this node's disk (None: built without Ray)
        self.node_id = None if context is None else context.get_node_id()
        if not continuing:
            claim_run_dir(self.run_dir, self.journal.path, cfg.name,
                          check=cfg.run.trial is not None)
        dumped = cfg.model_dump()
        self.redactor = Redactor(dumped)
        write_atomic(self.run_dir / "config.yaml", yaml.safe_dump(self.redactor.value(dumped)))
        # Held by every call that reads or changes the merge state, and by the readers'
        # condition: Ray runs this actor's calls on several threads.
        lock = threading.RLock()
        self.results = Results(self.aggregator, cfg.limits.keep_results, self.run_dir, lock)
        self.job = None if context is None else context.get_job_id()  # whose run this is
        self.aggregator.published.journaled_meta = self.journal.meta  # old steps: checked
        # After a restart: finished steps, running totals and recent digests, streamed from
        # the journal (what stays is bounded, whatever its length)
        self.restored_steps, journal = (
            self.journal.restore(functools.partial(continuing_run.restore, self.aggregator),
                                 self.results) if continuing else (0, None))
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
        # The health, live in Ray's metrics (Prometheus, the dashboard): metricsvc_*
        self.live = LiveMetrics(cfg.name, enabled=cfg.metrics.enabled, export=cfg.metrics.export)
        self.intake = Intake(cfg.name, self.aggregator, self.results, self.sinks, lock,
                             self.durable_through, uuid.uuid4().hex, cfg.straggler_timeout_s,
                             observe=self.live.step if self.live.on else None)
        self.reporter = Reporter(self.live, self.health, cfg.metrics.interval_s)
        self.started = time.time()
        # Resuming from a checkpoint: rewound before any batch is taken, once (a Ray restart
        # of this actor finds its own rewind in the journal and leaves the rerun alone).
        # health()["resume"]: what the journal held then, recorded with the rewind, so every
        # incarnation reports it (None where the rewind does not record it)
        self.resume: dict[str, Any] | None = None
        if cfg.run.from_step is not None:
            made = self.history.made_by(self.actor)
            if made is None:
                held = self.rewinds.reloaded_through
                self.resume = resume_report(cfg.run.from_step, held)
                with lock:
                    self.rewinds.rewind(cfg.run.from_step, by=self.actor,
                                        held=-1 if held is None else held)
            elif made.held is not None:
                self.resume = resume_report(made.to_step, None if made.held < 0 else made.held)
        self.reporter.start()

    def durable_through(self) -> int | None:
        """Return the last step the journal holds (clients may forget batches up to it)."""
        if self.journal.writer is None:  # no journal: nothing more durable than memory
            return self.aggregator.last_emitted
        written = self.sinks.last_step(self.journal.writer)
        # After a restart the journal already holds the reloaded steps.
        return self.rewinds.reloaded_through if written is None else written

    # -- ranks, combiners and streams (the intake) -------------------------------------
    def submit(self, batch: Batch | bytes, epoch: str | None = None) -> dict[str, Any]:
        """Merge one rank's batch (or its wire bytes); return the ack.

        ``epoch``: the incarnation the client last heard from. If this is another one
        (the actor restarted), nothing is merged and the ack says ``epoch_changed``: the
        client first resends what the journal may have lost, then this batch, so a new
        step cannot finish ahead of an older one it still owes (``metricsvc.core.resend``).

        Raises:
            BatchRejected: (a ValueError) the batch was refused; nothing was merged.
        """
        return self.intake.submit(batch, epoch)

    def submit_many(self, batches: list[Batch | bytes], epoch: str | None = None,
                    combiner: dict[str, Any] | None = None) -> dict[str, Any]:
        """Merge batches forwarded by a combiner, each exactly as if sent directly.

        Returns the ack with one answer per batch in ``answers``: what ``submit`` would
        have answered that rank, or the exception it would have raised (a refusal does not
        stop the others); the combiner relays each to its rank. ``epoch`` as for
        ``submit``. ``combiner``: the combiner's own health, shown in
        ``health()["combiners"]``.
        """
        return self.intake.submit_many(batches, epoch, combiner)

    def stream_submit(self, name: str, client: str, batch: Batch | bytes,
                      epoch: str | None = None) -> dict[str, Any]:
        """Add a stream client's records to the current window of stream ``name``.

        The restart protocol of ``submit``, with the client's batch numbers for steps: the
        ack's ``durable_through`` is the newest batch of ``client`` that a journaled step
        holds, and a caller that names another incarnation (``epoch``) is answered
        ``epoch_changed`` with nothing merged, so that it first resends what the window
        lost with the old incarnation.
        """
        return self.intake.stream_submit(name, client, batch, epoch)

    def export_stream(self, name: str, step: int, close: bool = False) -> dict[str, float]:
        """Publish the window of stream ``name`` with ``step``, start a new window, and
        return the window's metrics. ``close=True``: a step no rank submits is final with
        the window alone. Raises ``BatchRejected`` (window kept) if the step is final."""
        return self.intake.export_stream(name, step, close)

    # -- readers (the results) -----------------------------------------------------------
    @ray.method(concurrency_group="readers")
    def wait_final_res(
        self, step: int | None = None, timeout_s: float | None = None
    ) -> dict[str, float]:
        """Return the merged metrics of ``step`` once it is final.

        ``step=None`` means the newest step any rank has closed (waiting for one
        if none has). Raises ``StepNotFinal`` (a TimeoutError) after ``timeout_s``.
        """
        return self.results.wait(step, timeout_s).metrics

    @ray.method(concurrency_group="readers")
    def wait_final(self, step: int | None = None, timeout_s: float | None = None) -> dict:
        """Like ``wait_final_res`` but return ``{"step", "metrics", "meta"}``."""
        result = self.results.wait(step, timeout_s)
        return {"step": result.step, "metrics": result.metrics, "meta": result.meta}

    def get_result(self, step: int) -> dict | None:
        """Return ``{"step", "metrics", "meta"}`` of a finished step, or None; never waits."""
        result = self.results.get(step)
        return None if result is None else {"step": step, "metrics": result.metrics,
                                            "meta": result.meta}

    def job_id(self) -> str:
        """Return the id of the Ray job that started this service (it dies with that job)."""
        return self.job

    def health(self) -> dict[str, Any]:
        """Return the actor's state: pending steps, counters, sink errors, run folder."""
        with self.intake.lock:
            return worker_health(self)

    # -- lifecycle ---------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every finished step so far has been handed to the sinks."""
        return self.sinks.flush(timeout_s)

    @ray.method(concurrency_group="control")
    def close(self) -> dict[str, Any]:
        """Flush and close every sink, then let go of the run folder; a second call is
        harmless. Returns ``health()``."""
        if self.intake.close():
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
        """siiRL's ``MetricWorker.stop()``: nothing to stop between steps here (siiRL's loop
        restarts on the next ``wait_final_res``). The service keeps serving; end it with
        ``metricsvc.stop_metric_worker`` (or ``close()``)."""

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
        with self.intake.lock:
            self.intake.check_open("rewind")
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
