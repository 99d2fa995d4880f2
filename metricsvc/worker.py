"""The MetricWorker Ray actor: a thin async shell around the Aggregator.

The actor is asynchronous: a rank's ``submit`` merges and returns at once, and
any number of ``wait_final_res`` callers wait on a condition without holding a
thread. Finished steps go to the sinks through a background dispatcher, so no
sink I/O sits on the merge path.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import time
import uuid
import warnings
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import ray
import yaml

from metricsvc.aggregator import Aggregator, StepResult
from metricsvc.config import (
    DEFAULT_NAME,
    ConfigSource,
    ServiceConfig,
    load_config,
    new_trial,
)
from metricsvc.errors import StepNotFinal, StepUnavailable
from metricsvc.files import write_atomic
from metricsvc.journal import Journal, iter_journal
from metricsvc.keys import default_namespace
from metricsvc.records import Batch
from metricsvc.redaction import Redactor
from metricsvc.resend import is_stale
from metricsvc.run_folder import (
    check_run_dir,
    claim_run_dir,
    hold_run_dir,
    probe_run_dir,
)
from metricsvc.sinks import SinkDispatcher, build_sinks
from metricsvc.sinks.base import check_libraries
from metricsvc.validation import BatchRejected

log = logging.getLogger(__name__)


def config_differences(asked: Mapping[str, Any], running: Mapping[str, Any],
                       prefix: str = "") -> list[str]:
    """Return the dotted names of the fields where two config dumps differ."""
    out = []
    for key in sorted(set(asked) | set(running)):
        a, b = asked.get(key), running.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def _restarted_by_ray() -> bool:
    try:
        with warnings.catch_warnings():  # Ray's property reads its own deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not inside an actor (the impl built directly)
        return False


class MetricWorkerImpl:
    """Actor body; use ``MetricWorker`` (the Ray actor class) or ``start_metric_worker``."""

    def __init__(self, config: ConfigSource = None) -> None:
        self.config: ServiceConfig = load_config(config)
        cfg = self.config
        self.aggregator = Aggregator(
            straggler_timeout_s=cfg.straggler_timeout_s,
            max_pending_steps=cfg.limits.max_pending_steps,
            max_steps_ahead=cfg.limits.max_steps_ahead,
            world_size=cfg.world_size,
            limits=cfg.limits.to_limits(),
            reduce_rules=cfg.parsed_rules(),
            renames=cfg.renames,
            output=cfg.output.rules(),
        )
        self.run_dir = cfg.run.run_dir().resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.run_dir, cfg.sinks)  # the service's log, its own
        self._owner_fd: int | None = hold_run_dir(self.run_dir, cfg.name)
        # Only a restart of this run (by Ray, or an explicit resume) reloads the folder.
        continuing = _restarted_by_ray() or cfg.run.resume
        if not continuing:
            claim_run_dir(self.run_dir, cfg)
        self.redactor = Redactor(cfg.model_dump())
        write_atomic(self.run_dir / "config.yaml",
                      yaml.safe_dump(self.redactor.value(cfg.model_dump())))
        self._results: OrderedDict[int, StepResult] = OrderedDict()
        self.epoch = uuid.uuid4().hex  # a new one per incarnation: clients resend on a change
        self.job = ray.get_runtime_context().get_job_id()  # the job whose run this is
        self.aggregator.journaled_meta = self.journal.meta  # an old step's batches: checked
        self.restored_steps = 0
        journal = self._restore() if continuing else None
        self._reloaded_through = self.aggregator.last_emitted if self.restored_steps else None
        # Continuing a run, each sink continues its backend run and is given the journaled
        # steps past its watermark: what users look at survives the restart too.
        writer = {} if self.journal.writer is None else {"jsonl": self.journal.writer}
        self.sinks = SinkDispatcher(build_sinks(cfg.sinks, check=True, built=writer),
                                    self.run_dir, cfg.sinks.delivery, self.redactor,
                                    replay=journal)
        self._changed = asyncio.Condition()
        self._ticker: asyncio.Task[None] | None = None
        self._started = time.time()
        self.calls: Counter[str] = Counter()
        self.timer_errors = 0
        self._closed = False

    def _restore(self) -> Callable[[], Iterator[dict[str, Any]]] | None:
        """After a restart, continue from the journal: finished steps, cumulative totals.
        The journal is streamed: what stays is the last ``keep_results`` steps, the running
        totals and the recent steps' digests, whatever its length. Returns how the sinks
        read it again for their replay (None: no journal)."""
        path = self.journal.path
        if path is None or not path.exists():
            return None
        recent: deque[dict[str, Any]] = deque(maxlen=self.config.limits.keep_results)

        def kept(records: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
            for record in records:
                recent.append(record)
                self.restored_steps += 1
                yield record

        self.aggregator.restore(kept(self.journal.stream()))
        for record in recent:
            step = int(record["step"])
            self._results[step] = StepResult(step, record["metrics"], record["meta"])
        if self.restored_steps:
            log.warning("restarted: %d finished steps reloaded from %s (last step %s)",
                        self.restored_steps, path, self.aggregator.last_emitted)
        return lambda: iter_journal(path)

    def _durable_through(self) -> int | None:
        """Return the last step the journal holds (clients may forget batches up to it)."""
        if self.journal.writer is None:  # no journal: nothing more durable than memory
            return self.aggregator.last_emitted
        written = self.sinks.last_step(self.journal.writer)
        # After a restart the journal already holds the reloaded steps.
        return self._reloaded_through if written is None else written

    def _stale(self, epoch: str | None) -> bool:
        """Return True (and count it) if a caller last heard from another incarnation."""
        if not is_stale(epoch, self.epoch):
            return False
        self.calls["epoch_changed"] += 1
        return True

    def _ack(self, status: str, **extra: Any) -> dict[str, Any]:
        return {"status": status, "epoch": self.epoch, "durable_through": self._durable_through(),
                "last_final_step": self.aggregator.last_emitted, **extra}

    # -- ranks -------------------------------------------------------------------------
    async def submit(self, batch: Batch | bytes, epoch: str | None = None) -> dict[str, Any]:
        """Merge one rank's batch (or its wire bytes); return the ack.

        ``epoch``: the incarnation the client last heard from. If this is another one
        (the actor restarted), nothing is merged and the ack says ``epoch_changed``: the
        client first resends what the journal may have lost, then this batch, so a new
        step cannot finish ahead of an older one it still owes (``metricsvc.resend``).

        Raises:
            BatchRejected: (a ValueError) the batch was refused; nothing was merged.
        """
        if self._stale(epoch):
            return self._ack("epoch_changed")
        self.calls["submit"] += 1
        self._ensure_ticker()
        newest = self.aggregator.newest_closed
        try:
            outcome = self.aggregator.submit(batch)
            batch = outcome.batch
        except BatchRejected as err:
            log.warning("rejected batch: %s", err)
            raise
        if outcome.status == "late":
            log.warning("late batch: step %d from rank %d arrived after the step was published",
                        batch.step, batch.rank)
            self.sinks.event(
                {
                    "type": "late_batch",
                    "step": batch.step,
                    "rank": batch.rank,
                    "seq": batch.seq,
                    "keys": len(batch.keys),
                }
            )
        if outcome.finished:
            await self._publish(outcome.finished)
        elif self.aggregator.newest_closed != newest:
            await self._notify()  # wait_final_res(step=None) watches newest_closed
        ack = self._ack(outcome.status, step=batch.step, seq=batch.seq)
        if outcome.notice is not None:
            ack["notice"] = outcome.notice
        return ack

    async def submit_many(self, batches: list[Batch | bytes],
                          epoch: str | None = None) -> dict[str, Any]:
        """Merge batches forwarded by a combiner, each exactly as if sent directly.

        Returns the ack with one status per batch (``rejected: <why>`` for a refused one:
        a refusal does not stop the others). ``epoch`` as for ``submit``: another
        incarnation's answers ``epoch_changed`` and merges nothing.
        """
        if self._stale(epoch):
            return self._ack("epoch_changed")
        self.calls["submit_many"] += 1
        self._ensure_ticker()
        statuses, finished = [], []
        for batch in batches:
            try:
                outcome = self.aggregator.submit(batch)
            except BatchRejected as err:
                statuses.append(f"rejected: {err}")
                continue
            statuses.append(outcome.status if outcome.notice is None
                            else f"{outcome.status}; earlier: {outcome.notice}")
            finished.extend(outcome.finished)
        if finished:
            await self._publish(finished)
        else:
            await self._notify()
        return self._ack("batch", statuses=statuses)

    # -- streams -----------------------------------------------------------------------
    async def stream_submit(self, name: str, client: str, batch: Batch | bytes) -> dict[str, Any]:
        """Add a stream client's records to the current window of stream ``name``."""
        self.calls["stream_submit"] += 1
        batch = self.aggregator.decode(batch)
        status = self.aggregator.stream_submit(name, client, batch)
        return self._ack(status, seq=batch.seq)

    async def export_stream(self, name: str, step: int, close: bool = False) -> dict[str, float]:
        """Publish the window of stream ``name`` with ``step``, start a new window, and
        return the window's metrics. ``close=True``: a step no rank submits is final with
        the window alone. Raises ``BatchRejected`` (window kept) if the step is final."""
        self.calls["export_stream"] += 1
        self._ensure_ticker()
        metrics, finished = self.aggregator.export_stream(name, int(step), close)
        if finished:
            await self._publish(finished)
        return metrics

    # -- readers -----------------------------------------------------------------------
    async def wait_final_res(
        self, step: int | None = None, timeout_s: float | None = None
    ) -> dict[str, float]:
        """Return the merged metrics of ``step`` once it is final.

        ``step=None`` means the newest step any rank has closed (waiting for one
        if none has). Raises ``StepNotFinal`` (a TimeoutError) after ``timeout_s``.
        """
        return (await self._wait(step, timeout_s)).metrics

    async def wait_final(self, step: int | None = None, timeout_s: float | None = None) -> dict:
        """Like ``wait_final_res`` but return ``{"step", "metrics", "meta"}``."""
        result = await self._wait(step, timeout_s)
        return {"step": result.step, "metrics": result.metrics, "meta": result.meta}

    async def _wait(self, step: int | None, timeout_s: float | None) -> StepResult:
        agg = self.aggregator
        try:
            async with self._changed:
                if step is None:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: agg.newest_closed is not None), timeout_s
                    )
                    step = agg.newest_closed
                target = int(step)  # type: ignore[arg-type]
                await asyncio.wait_for(
                    self._changed.wait_for(
                        lambda: agg.last_emitted is not None and agg.last_emitted >= target
                    ),
                    timeout_s,
                )
        except asyncio.TimeoutError:
            raise StepNotFinal(self._not_final_message(step, timeout_s)) from None
        result = self._results.get(target)
        if result is None:
            raise StepUnavailable(
                f"step {target} has no result: no rank submitted it, or it was evicted "
                f"(keep_results={self.config.limits.keep_results}); "
                f"the journal under {self.run_dir} holds every finished step"
            )
        return result

    def _not_final_message(self, step: int | None, timeout_s: float | None) -> str:
        if step is None:
            return f"no rank closed any step within {timeout_s} s"
        missing = self.aggregator.missing_ranks(step)
        if missing is None:
            return f"step {step} not final after {timeout_s} s: no rank has submitted it yet"
        if not missing:  # every rank closed it: an earlier step holds it back
            holder = min(self.aggregator.pending_summary())
            return (f"step {step} not final after {timeout_s} s: every rank closed it, but "
                    f"steps are published in order and step {holder} holds it: ranks "
                    f"{self.aggregator.missing_ranks(holder)} have not closed step {holder} "
                    f"(wait_submit)")
        return (
            f"step {step} not final after {timeout_s} s: "
            f"ranks {missing} have not closed it (wait_submit)"
        )

    def get_result(self, step: int) -> dict | None:
        """Return ``{"step", "metrics", "meta"}`` of a finished step, or None; never waits."""
        result = self._results.get(step)
        if result is None:
            return None
        return {"step": step, "metrics": result.metrics, "meta": result.meta}

    async def start(self) -> None:
        """siiRL's ``MetricWorker.start()``: the service serves from its creation, so this
        only answers (``ray.get(metric_worker.start.remote())`` works as in siiRL)."""

    async def stop(self) -> None:
        """siiRL's ``MetricWorker.stop()``: nothing to stop between steps here (siiRL's loop
        restarts on the next ``wait_final_res``). The service keeps serving; end it with
        ``metricsvc.stop_metric_worker`` (or ``close()``)."""

    def job_id(self) -> str:
        """Return the id of the Ray job that started this service (it dies with that job)."""
        return self.job

    def health(self) -> dict[str, Any]:
        """Return the actor's state: pending steps, counters, sink errors, run folder."""
        agg = self.aggregator
        sinks = self.sinks.health()
        return {
            "name": self.config.name,
            "epoch": self.epoch,
            "pid": os.getpid(),
            "restored_steps": self.restored_steps,
            "journal_skipped_lines": self.journal.stats["skipped"],
            "journal_duplicate_steps": self.journal.stats["duplicates"],
            "journal": self.journal.health()["path"],
            "pending_steps": agg.pending_summary(),
            "last_final_step": agg.last_emitted,
            "newest_closed_step": agg.newest_closed,
            "durable_through": self._durable_through(),
            "rank_last_seen": dict(sorted(agg.rank_last_seen.items())),
            "batches": agg.counts["batches"],
            "stream_batches": agg.counts["stream_batches"],
            "stream_windows": agg.windows_summary(),
            "rejected_batches": agg.counts["rejected"],
            "duplicate_batches": agg.counts["duplicate"],
            "late_batches": agg.counts["late"],
            "late_by_rank": dict(sorted(agg.late_by_rank.items())),
            "lagging_ranks": agg.lagging_ranks,
            "conflicting_batches": agg.counts["conflict"],
            "dropped_batches": agg.counts["dropped"],
            "steps_with_collisions": agg.counts["collisions"],
            "world_size": agg.world_size,
            "world_size_source": agg.world_source,
            "timer_errors": self.timer_errors,
            "partial_steps": agg.counts["partial"],
            "failing_sinks": sorted(name for name, h in sinks.items() if h["failing"]),
            "calls": dict(self.calls),
            "sinks": sinks,
            "sink_errors": self.sinks.errors,
            "run_dir": str(self.run_dir),
            "uptime_s": time.time() - self._started,
            "cpu_s": time.process_time(),  # this process's CPU time, all its threads
            "closed": self._closed,
        }

    # -- lifecycle ---------------------------------------------------------------------
    async def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every finished step so far has been handed to the sinks."""
        return await asyncio.get_running_loop().run_in_executor(None, self.sinks.flush, timeout_s)

    async def close(self) -> dict[str, Any]:
        """Flush and close every sink, then let go of the run folder; a second call is
        harmless. Returns ``health()``."""
        if not self._closed:
            self._closed = True
            if self._ticker is not None:
                self._ticker.cancel()
            await asyncio.get_running_loop().run_in_executor(None, self.sinks.close)
            if self._owner_fd is not None:
                os.close(self._owner_fd)  # the folder may have a new owner now
                self._owner_fd = None
        return self.health()

    async def rewind(self, to_step: int) -> dict[str, Any]:
        """Resume from the checkpoint of ``to_step``: every step after it is recorded afresh.

        Published steps past it are superseded, not deleted: the journal starts a new
        segment (its earlier records past ``to_step`` stay in the file, archived, and every
        reader shows the latest segment), TensorBoard is given its restart marker (it
        shows the rerun), and each sink's watermark goes back so a restart replays the
        rerun. Returns ``{"to_step", "superseded"}``.
        """
        if isinstance(to_step, bool) or not isinstance(to_step, int) or to_step < -1:
            raise ValueError(f"rewind(to_step=...) takes a step >= -1 (-1: before step 0), "
                             f"got {to_step!r}")
        totals = None
        kept = self._results.get(to_step)
        if kept is not None:
            totals = kept.meta.get("derived_totals")
        elif to_step >= 0 and self.journal.holds_steps():
            record = next((r for r in iter_journal(self.journal.path)
                           if r["step"] == to_step), None)
            totals = None if record is None else record["meta"].get("derived_totals")
        superseded = self.aggregator.rewind(to_step, totals)
        for step in [s for s in self._results if s > to_step]:
            del self._results[step]
        if self._reloaded_through is not None:
            self._reloaded_through = min(self._reloaded_through, to_step)
        self.sinks.rewind(to_step)
        log.warning("rewound to step %d: %d published steps superseded", to_step, superseded)
        await self._notify()
        return {"to_step": to_step, "superseded": superseded}

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
    async def _publish(self, finished: list[StepResult]) -> None:
        keep = self.config.limits.keep_results
        for result in finished:
            self._results[result.step] = result
            while len(self._results) > keep:
                self._results.popitem(last=False)
            self.sinks.publish(result.step, result.metrics, result.meta)
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _ensure_ticker(self) -> None:
        if self._ticker is None and self.config.straggler_timeout_s is not None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        period = min(1.0, self.config.straggler_timeout_s / 4)  # type: ignore[operator]
        while True:
            await asyncio.sleep(period)
            try:
                finished = self.aggregator.expire()
                if finished:
                    for r in finished:
                        if r.meta["partial"]:
                            log.warning("step %d finished partial: missing ranks %s",
                                        r.step, r.meta["missing_ranks"])
                    await self._publish(finished)
            except Exception:  # the straggler timer must outlive any one bad step
                self.timer_errors += 1
                log.exception("straggler timer: finishing timed-out steps failed")


_DEFAULTS = ServiceConfig()

MetricWorker = ray.remote(
    num_cpus=0,
    max_restarts=_DEFAULTS.max_restarts,
    max_concurrency=_DEFAULTS.max_concurrency,
)(type("MetricWorker", (MetricWorkerImpl,), {"__doc__": MetricWorkerImpl.__doc__}))
# (Named MetricWorker so that Ray's log lines read "(MetricWorker pid=...)".)
"""The Ray actor class. ``start_metric_worker`` creates the named singleton from a config."""


def start_metric_worker(
    config: ConfigSource = None,
    *,
    name: str | None = None,
    namespace: str | None = None,
    world_size: int | None = None,
    runtime_env: dict[str, Any] | None = None,
) -> Any:
    """Create (or return the existing) named MetricWorker singleton and wait until it serves.

    ``config`` is a YAML path, a dict, a ServiceConfig or None; ``name``, ``namespace``
    and ``world_size`` (the run's number of ranks: set it, and no confused rank can
    claim another) override the config's; ``runtime_env`` is passed to Ray. Never put
    API keys in ``runtime_env``: Ray writes runtime environments to its logs. Export
    them where the driver (or ``ray start``) runs instead. Calling it twice returns
    the same actor.
    """
    cfg = load_config(config, name=name, namespace=namespace, world_size=world_size)
    check_libraries(cfg.sinks)  # here, in one line, not as retries in the actor
    if not Path(cfg.run.root).is_absolute():  # the driver's folder, not the cluster's cwd
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(
            update={"root": str(Path(cfg.run.root).resolve())})})
    try:
        running = ray.get_actor(cfg.name, namespace=cfg.namespace)
    except ValueError:  # none runs yet: a new run, whose folder must be its own
        check_run_dir(cfg)
        if cfg.run.trial is not None:
            probe_run_dir(cfg.run.run_dir().resolve())
    else:
        return _same_service(running, cfg)
    if cfg.run.trial is None:
        # Fixed here, not in the actor: a restarted actor must find the same run folder.
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"trial": new_trial()})})
    handle = MetricWorker.options(  # type: ignore[attr-defined]
        name=cfg.name,
        namespace=cfg.namespace,
        get_if_exists=True,
        max_restarts=cfg.max_restarts,
        max_concurrency=cfg.max_concurrency,
        num_cpus=cfg.num_cpus,
        runtime_env=runtime_env,
    ).remote(cfg.model_dump())
    ray.get(handle.health.remote())  # surfaces a failing __init__ here, not later
    if cfg.topology == "per_node":
        from metricsvc.combiner import start_combiner

        for node in ray.nodes():
            if node.get("Alive"):
                start_combiner(cfg, node["NodeID"], node_id=node["NodeID"])
    # Registered after ray.init's own exit hook, so it runs first, while Ray still answers:
    # a driver that ends without close() must not lose what the sinks buffer.
    atexit.register(_close_at_exit, handle)
    return handle


def _same_service(handle: Any, cfg: ServiceConfig) -> Any:
    """Return the running service if it runs ``cfg`` (an unset trial matches any), else
    raise naming the fields that differ."""
    running = ray.get(handle.config_dump.remote())
    job = ray.get(handle.job_id.remote())
    if job != ray.get_runtime_context().get_job_id():
        raise ValueError(
            f"a MetricWorker named {cfg.name!r} already runs in namespace {cfg.namespace!r} "
            f"for another job ({job}): two runs would merge into one service; give this run "
            f"its own name (start_metric_worker(name=) and MetricClient(name=)) or namespace")
    asked = cfg.model_dump(mode="json")
    asked = Redactor(asked).value(asked)
    if cfg.run.trial is None:
        asked["run"]["trial"] = running["run"]["trial"]
    differ = config_differences(asked, running)
    if differ:
        raise ValueError(
            f"a MetricWorker named {cfg.name!r} already runs in namespace {cfg.namespace!r} "
            f"with another config: {', '.join(differ[:12])} differ; stop it first "
            f"(metricsvc.stop_metric_worker) or start this one under another name")
    return handle


def stop_metric_worker(handle: Any = None, *, name: str | None = None,
                       namespace: str | None = None,
                       timeout_s: float = 120.0) -> dict[str, Any]:
    """Close every sink (wandb finishes its run), then end the actor; return its last health.

    The sinks get ``sinks.delivery.close_timeout_s``; a step a sink has not taken by then
    is dead-lettered, and the returned health says so per sink (``dead_lettered``,
    ``in_flight_at_close``, ``lost``). ``timeout_s`` only guards an actor that does not
    answer: keep it above ``close_timeout_s``. Call this (or ``worker.close.remote()``) before
    ``ray.shutdown()``: Ray ends an actor's child processes first, and wandb's writer is
    one of them.
    """
    handle = handle or get_metric_worker(name, namespace)
    health = ray.get(handle.close.remote(), timeout=timeout_s)
    ray.kill(handle, no_restart=True)
    return health


def _close_at_exit(handle: Any) -> None:
    if not ray.is_initialized():
        return
    try:
        ray.get(handle.close.remote(), timeout=60)
    except Exception as err:  # already closed, killed or never started: nothing to save
        log.debug("closing the MetricWorker at exit: %s", err)


def get_metric_worker(name: str | None = None, namespace: str | None = None) -> Any:
    """Return the handle of a running MetricWorker by name (default: the config default)."""
    return ray.get_actor(name or DEFAULT_NAME, namespace=namespace or default_namespace())
