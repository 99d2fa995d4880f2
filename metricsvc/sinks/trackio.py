"""Trackio (``pip install metricsvc[trackio]``), local-first: a project's SQLite database in
``<run folder>/trackio`` by default, which ``trackio show`` (with ``TRACKIO_DIR`` set to
that folder) draws and Trackio's ``SQLiteStorage`` reads.

Each step is one ``SQLiteStorage.bulk_log`` of its metrics at its step, the call Trackio's
own run makes from its background thread, made here on the sink's thread: it returns once
the database holds the step (a write is durable), and a failure raises (to be retried)
where Trackio's thread would only warn. A restarted service continues the same run and
leaves out every step the database already holds past the watermark (``resume``). A
step's alerts (``meta["alerts"]``) become Trackio alerts (level ``warn``) at that step,
written before its metrics, each once (Trackio keeps one alert per id).

Trackio takes its folder from ``TRACKIO_DIR`` when it is first imported: a service opens
it before, and a process can hold one Trackio folder (a second is refused, naming both).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field

from metricsvc.sinks.base import Builtin, Strict, tagged
from metricsvc.sinks.console import alert_line

# Trackio's own columns beside the metrics: a metric of such a name is renamed ``__name``,
# as ``trackio.log`` renames it (``trackio.utils.RESERVED_KEYS``)
_RESERVED = frozenset({"project", "run", "timestamp", "step", "time", "metrics"})


class TrackioSinkConfig(Strict):
    """Trackio (``pip install metricsvc[trackio]``), local: a SQLite database per project."""

    enabled: bool = True
    project: str | None = Field(None, description="default: the run's experiment")
    run_name: str | None = Field(None, description="default: the run's trial")
    dir: str | None = Field(None, description="Trackio's folder (TRACKIO_DIR); default: "
                                              "<run folder>/trackio")


class TrackioSink:
    """Log each finished step into a Trackio project's database, at its step."""

    name = "trackio"
    supports_nan = False

    def __init__(self, config: TrackioSinkConfig | None = None) -> None:
        self.config = config or TrackioSinkConfig()
        self.storage: Any = None
        self.project = self.run = ""
        self._held: set[int] = set()
        self._config: dict[str, Any] | None = None

    def open(self, run_dir: Path) -> None:
        run_dir = Path(run_dir)
        folder = Path(self.config.dir or run_dir / "trackio").resolve()
        folder.mkdir(parents=True, exist_ok=True)
        self.storage = storage_in(folder)
        self.project = self.config.project or run_dir.parent.name
        self.run = self.config.run_name or run_dir.name
        self._config = {"metricsvc_run_dir": str(run_dir)}  # kept with the run's first step

    def resume(self, after: int | None) -> None:
        """Leave out of later writes every step past ``after`` the run already holds."""
        self._held = {int(log["step"]) for log in self.storage.get_logs(self.project, self.run)
                      if after is None or log["step"] > after}

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        if step in self._held:
            self._held.discard(step)
            return
        alerts = meta.get("alerts") or []
        if alerts:
            self.storage.bulk_alert(
                project=self.project, run=self.run, titles=[a["rule"] for a in alerts],
                texts=[alert_line(a).strip() for a in alerts], levels=["warn"] * len(alerts),
                steps=[step] * len(alerts),
                alert_ids=[f"{step}/{a['rule']}/{a['value']!r}" for a in alerts])
        values = {(f"__{tag}" if tag in _RESERVED else tag): float(v)
                  for tag, v in tagged(metrics, meta).items()}
        self.storage.bulk_log(project=self.project, run=self.run, metrics_list=[values],
                              steps=[step], config=self._config)
        self._config = None

    def close(self) -> None:
        self.storage = None


def storage_in(folder: Path) -> Any:
    """Trackio's ``SQLiteStorage`` writing under ``folder`` (``TRACKIO_DIR``, read once,
    when Trackio is first imported in this process).

    Raises:
        RuntimeError: Trackio was imported here before with another folder.
    """
    import sys

    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(folder)
    import trackio.utils  # optional backend: imported only when used
    from trackio.sqlite_storage import SQLiteStorage

    if Path(trackio.utils.TRACKIO_DIR).resolve() != folder:
        raise RuntimeError(f"trackio: this process already writes to {trackio.utils.TRACKIO_DIR} "
                           f"(Trackio reads TRACKIO_DIR once); cannot also write to {folder}")
    return SQLiteStorage


BUILTIN = Builtin(
    'trackio', 6, TrackioSinkConfig, None, 'metricsvc.sinks.trackio:TrackioSink',
    library='trackio', extra='trackio')
