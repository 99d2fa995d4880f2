"""The service's health, live where Ray users already look: Ray's own metrics.

``LiveMetrics`` reports what ``health()`` says (pending steps, the last final step,
batches merged, refused, late, duplicate and conflicting batches, partial steps, lagging
ranks, each sink's steps written, dead letters and backlog, the merge's CPU) as
``ray.util.metrics`` gauges and counters, tagged with the service's name, and each
finished step's wait (its first batch to final) as a histogram. Ray exports them in
Prometheus format on each node's metrics port (Prometheus names them ``ray_metricsvc_*``)
and in its dashboard: no port or transport of ours. Ray serves that export with its
metrics agent, which comes with ``ray[default]`` (``metricsvc[observe]``); without it
nothing is reported and ``health()["metrics_export"]`` says why.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from metricsvc.core.limits import Recent

log = logging.getLogger(__name__)

# Series from health(): name -> (health key, what it means). Gauges are set to the value;
# counters are raised by what it grew since the last report (a restart starts them anew).
GAUGES = {
    "metricsvc_pending_steps": ("pending_steps", "steps open (not final yet)"),
    "metricsvc_last_final_step": ("last_final_step", "the newest published step"),
    "metricsvc_newest_closed_step": ("newest_closed_step", "the newest step a rank closed"),
    "metricsvc_lagging_ranks": ("lagging_ranks", "ranks closing each step after every other "
                                                 "rank closed the next one"),
    "metricsvc_world_size": ("world_size", "the run's ranks (0 until agreed)"),
}
COUNTERS = {
    "metricsvc_batches": ("batches", "rank batches merged"),
    "metricsvc_rejected_batches": ("rejected_batches", "batches refused (nothing merged)"),
    "metricsvc_late_batches": ("late_batches", "batches for a published step (journaled, "
                                               "not merged)"),
    "metricsvc_duplicate_batches": ("duplicate_batches", "resends merged once"),
    "metricsvc_conflicting_batches": ("conflicting_batches", "batches whose identity clashed"),
    "metricsvc_dropped_batches": ("dropped_batches", "accepted batches dropped later (another "
                                                     "world size, a runaway step)"),
    "metricsvc_partial_steps": ("partial_steps", "steps published without every rank"),
    "metricsvc_stream_batches": ("stream_batches", "stream batches merged"),
    "metricsvc_merge_cpu_seconds": ("merge_cpu_s", "CPU seconds inside the ranks' calls"),
}
SINK_COUNTERS = {
    "metricsvc_sink_steps_written": ("written", "steps a sink wrote"),
    "metricsvc_sink_dead_lettered": ("dead_lettered", "steps a sink gave up on (dead letters)"),
    "metricsvc_sink_failures": ("failures", "failed writes (retried)"),
    "metricsvc_sink_cpu_seconds": ("cpu_s", "CPU seconds the sink's thread spent"),
}
SINK_GAUGES = {
    "metricsvc_sink_backlog": ("queued", "steps waiting for a sink"),
    "metricsvc_sink_failing": ("failing", "1 once a write of the sink failed "
                                          "(health: failing_sinks)"),
}
WAIT = "metricsvc_flush_to_final_seconds"  # a step's first batch -> final (its meta.age_s)
WAIT_BOUNDS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]
STEP = "metricsvc_step_metric"  # the finished-step metrics metrics.export names
ALERTS = "metricsvc_alerts"  # the alerts of the steps finished, by rule (tag ``rule``)


def export_off(enabled: bool) -> str | None:
    """Why nothing is exported here (None: Ray's metrics agent exports what is reported)."""
    if not enabled:
        return "off (metrics.enabled is false)"
    # What ray[default] adds for its metrics agent (found, not imported: a service's start
    # stays light)
    missing = [name for name in ("aiohttp", "prometheus_client")
               if importlib.util.find_spec(name) is None]
    if missing:
        return (f"off: Ray's metrics agent needs ray[default] ({', '.join(missing)} missing: "
                f"pip install 'metricsvc[observe]')")
    if not ray.is_initialized():  # the service's body built directly: no agent to report to
        return "off: this process is not connected to Ray"
    return None


class SeriesTable:
    """The gauges and counters of one table pair (``{name: (key, meaning)}``), made with
    ``tag_keys`` and reported from a dict of values: a gauge is set to its value (a
    collection: its size), a counter raised by what its total grew since the last report
    with the same tags (a restart starts the totals anew)."""

    def __init__(self, gauges: Mapping[str, tuple[str, str]],
                 counters: Mapping[str, tuple[str, str]], tag_keys: tuple[str, ...]) -> None:
        from ray.util.metrics import Counter, Gauge

        self.gauges, self.counters = gauges, counters
        self.series: dict[str, Any] = {
            **{name: Gauge(name, description=what, tag_keys=tag_keys)
               for name, (_, what) in gauges.items()},
            **{name: Counter(name, description=what, tag_keys=tag_keys)
               for name, (_, what) in counters.items()}}
        self._last: dict[tuple[str, tuple], float] = {}  # counter, tags -> last total

    def report(self, values: Mapping[str, Any], tags: dict[str, str]) -> None:
        for name, (key, _) in self.gauges.items():
            value = values.get(key) or 0
            if isinstance(value, (dict, list)):
                value = len(value)
            self.series[name].set(float(value), tags=tags)
        where = tuple(tags.values())
        for name, (key, _) in self.counters.items():
            total = float(values.get(key) or 0)
            last = self._last.get((name, where), 0.0)
            if total > last:
                self.series[name].inc(total - last, tags=tags)
            self._last[(name, where)] = total


class LiveMetrics:
    """One actor's series in Ray's metrics: created once, reported from its health."""

    def __init__(self, service: str, *, enabled: bool = True,
                 export: list[str] | tuple[str, ...] = ()) -> None:
        self.service = service
        self.off = export_off(enabled)
        self.patterns = tuple(export)
        self.reports = 0
        self.errors = 0
        self._chosen: Recent = Recent(64)  # step keys -> the exported ones
        self._series: dict[str, Any] = {}
        self._step: tuple[int, dict[str, float]] | None = None  # the newest, as exported
        if self.off is None:
            try:
                self._create()
            except Exception as err:  # never a reason for the service not to run
                self.off = f"off: {type(err).__name__}: {err}"

    def _create(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = ("service",)
        self._health = SeriesTable(GAUGES, COUNTERS, tags)
        self._sinks = SeriesTable(SINK_GAUGES, SINK_COUNTERS, ("service", "sink"))
        self._series.update({**self._health.series, **self._sinks.series})
        self._series[ALERTS] = Counter(
            ALERTS, description="alerts raised when a step was final, by rule",
            tag_keys=("service", "rule"))
        self._series[WAIT] = Histogram(
            WAIT, description="seconds from a step's first batch to its being final",
            boundaries=WAIT_BOUNDS, tag_keys=tags)
        if self.patterns:
            self._series[STEP] = Gauge(
                STEP, description="a finished step's metric (metrics.export)",
                tag_keys=("service", "metric"))
            self._series["metricsvc_step"] = Gauge(
                "metricsvc_step", description="the step metricsvc_step_metric shows",
                tag_keys=tags)

    @property
    def on(self) -> bool:
        return self.off is None

    def status(self) -> dict[str, Any]:
        """What ``health()`` says of the export."""
        return {"export": "on" if self.on else self.off, "series": len(self._series),
                "reports": self.reports, "errors": self.errors,
                "step_metrics": list(self.patterns)}

    def report(self, health: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
               finished: Sequence[Any] = ()) -> None:
        """Set every series from ``health`` (a ``health()`` dict, or what reads it) and the
        steps ``finished`` since the last report (each a ``StepResult``: its wait, and the
        metrics ``metrics.export`` names). A report never takes the service down: what
        fails is counted (``errors``) and logged."""
        if not self.on:
            return
        try:
            self._report(health() if callable(health) else health, finished)
        except Exception:
            self.errors += 1
            log.exception("reporting the service's health to Ray's metrics failed")

    def _report(self, health: Mapping[str, Any], finished: Sequence[Any]) -> None:
        tags = {"service": self.service}
        self._health.report(health, tags)
        for sink, state in (health.get("sinks") or {}).items():
            self._sinks.report(state, {"service": self.service, "sink": sink})
        for result in finished:
            age = result.meta.get("age_s")
            if isinstance(age, (int, float)):
                self._series[WAIT].observe(max(age, 0.0), tags=tags)
            for alert in result.meta.get("alerts", ()):
                self._series[ALERTS].inc(1, tags={**tags, "rule": alert["rule"]})
        if self.patterns and finished:
            self._step = (finished[-1].step, self._chosen_of(finished[-1].metrics))
        self._show_step(tags)
        self.reports += 1

    def _chosen_of(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """The metrics of a step that ``metrics.export`` names."""
        keys = tuple(metrics)
        names = self._chosen.get(keys)
        if names is None:
            names = self._chosen[keys] = [k for k in keys if any(
                fnmatch.fnmatchcase(k, p) for p in self.patterns)]
        return {k: float(metrics[k]) for k in names if isinstance(metrics[k], (int, float))}

    def _show_step(self, tags: dict[str, str]) -> None:
        """Set the step gauges to the newest finished step's (again at every report: a
        value set once, early, must not wait for the next step to be seen)."""
        if self._step is None:
            return
        step, chosen = self._step
        for key, value in chosen.items():
            self._series[STEP].set(value, tags={**tags, "metric": key})
        self._series["metricsvc_step"].set(float(step), tags=tags)


class Reporter:
    """A daemon thread that reports ``health()`` every ``interval_s`` while the service
    runs (reading the health takes the actor's lock for a moment; nothing on the merge
    path waits for it)."""

    def __init__(self, live: LiveMetrics, health: Callable[[], Mapping[str, Any]],
                 results: Any, interval_s: float) -> None:
        """``results``: the worker's (``since(count)``: the steps published after the first
        ``count``; ``published``: how many; ``changed``: its condition, on the actor's lock)."""
        self.live, self.health, self.results, self.interval_s = live, health, results, interval_s
        self._seen = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.live.on and self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="metricsvc-metrics-reporter")
            self._thread.start()

    def stop(self) -> None:
        """Report once more (the final state), then stop."""
        if self._thread is not None and not self._stopped.is_set():
            self._stopped.set()
            self.report()

    def report(self) -> None:
        with self.results.changed:  # the actor's lock: no step is put meanwhile
            finished, self._seen = self.results.since(self._seen), self.results.published
        self.live.report(self.health, finished)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.report()


COMBINER_GAUGES = {
    "metricsvc_combiner_ranks": ("ranks", "the node's ranks registered with the combiner"),
    "metricsvc_combiner_waiting": ("waiting", "ranks' submits waiting for their answer"),
    "metricsvc_combiner_in_flight": ("in_flight", "forwarded batches not journaled yet"),
}
COMBINER_COUNTERS = {
    "metricsvc_combiner_forwarded_batches": ("batches_forwarded", "batches forwarded"),
    "metricsvc_combiner_rejected_upstream": ("rejected_upstream", "forwarded batches the "
                                                                  "MetricWorker refused"),
}


class CombinerMetrics:
    """A per-node combiner's series (tagged with the service, the combiner and its node),
    reported after each forward from its own health report."""

    def __init__(self, service: str, label: str, node: str, enabled: bool = True) -> None:
        self.off = export_off(enabled)
        self.tags = {"service": service, "combiner": label, "node": node}
        self._table: SeriesTable | None = None
        if self.off is None:
            try:
                self._table = SeriesTable(COMBINER_GAUGES, COMBINER_COUNTERS, tuple(self.tags))
            except Exception as err:  # never a reason for the combiner not to run
                self.off = f"off: {type(err).__name__}: {err}"

    def report(self, health: Mapping[str, Any]) -> None:
        if self._table is not None:
            self._table.report(health, self.tags)
