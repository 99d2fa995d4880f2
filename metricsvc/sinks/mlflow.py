"""MLflow (``pip install metricsvc[mlflow]``): by default a file store in the run folder.

``log_batch`` returns once the store holds the metrics, so a write is durable. The run id
is kept in the run folder: a restarted service logs into the same run (set back to
RUNNING) and leaves out every (step, metric) the run already holds.

MLflow's file store writes a new experiment's or run's ``meta.yaml`` in place, so a service
killed while creating them leaves it empty, and MLflow's readers then fail on the whole
experiment; killed between the run's creation and keeping its id, it leaves a run nobody
continues. In the store of its own run folder (the default), the next incarnation moves
such folders aside (to ``<run folder>/mlruns-torn/``) and continues the run it finds.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field

from metricsvc.core.keys import safe_tag
from metricsvc.sinks.base import Builtin, Strict, descriptions, tagged
from metricsvc.storage.files import SinkState

log = logging.getLogger(__name__)


class MlflowSinkConfig(Strict):
    """MLflow (``pip install metricsvc[mlflow]``); a local file store by default."""

    enabled: bool = True
    tracking_uri: str | None = Field(None, description="default: <run folder>/mlruns")
    experiment_name: str | None = Field(None, description="default: the run's experiment")
    run_name: str | None = Field(None, description="default: the run's trial")


class MlflowSink:
    """Log each finished step as one ``log_batch`` of metrics at ``step``."""

    name = "mlflow"
    supports_nan = False

    def __init__(self, config: MlflowSinkConfig | None = None) -> None:
        self.config = config or MlflowSinkConfig()
        self.client: Any = None
        self.run_id: str | None = None
        self.tracking_uri: str | None = None
        self._held: dict[int, set[str]] = {}

    def open(self, run_dir: Path) -> None:
        import mlflow  # optional backend: imported only when used

        cfg = self.config
        run_dir = Path(run_dir)
        self.tracking_uri = cfg.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        if self.tracking_uri.startswith("file:"):
            # MLflow 3 keeps the file store only on request; a local store is what we want here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        own = cfg.tracking_uri is None  # the store in the run folder: this service's alone
        if own:
            set_aside_torn(run_dir / "mlruns", run_dir / "mlruns-torn")
        self.client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        state = SinkState(run_dir, self.name)
        kept = state.load().get("run_id")
        if kept is not None:  # a restart: continue the run this service started
            self.client.update_run(kept, status="RUNNING")
            self.run_id = kept
            return
        self.run_id = self._first_run(cfg.experiment_name or run_dir.parent.name,
                                      cfg.run_name or run_dir.name, own)
        state.update(run_id=self.run_id)

    def _first_run(self, experiment: str, name: str, own: bool) -> str:
        """The run a service logs into from its start: a new one, or in the store of its own
        run folder the one an incarnation created, killed before it kept the id."""
        found = self.client.get_experiment_by_name(experiment)
        if found is not None and own:
            runs = self.client.search_runs([found.experiment_id], max_results=1,
                                           order_by=["attributes.start_time DESC"])
            if runs:
                return runs[0].info.run_id
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        return self.client.create_run(exp_id, run_name=name).info.run_id

    def resume(self, after: int | None) -> None:
        """Leave out of later writes every (step, metric) past ``after`` the run holds."""
        for key in self.client.get_run(self.run_id).data.metrics:
            for m in self.client.get_metric_history(self.run_id, key):
                if after is None or m.step > after:
                    self._held.setdefault(int(m.step), set()).add(m.key)

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        held = self._held.pop(step, ())
        batch = [Metric(tag, float(v), now, step) for tag, v in tagged(metrics, meta, 250).items()
                 if tag not in held]
        about = descriptions(meta, 230)  # a run tag per metric: "description/<metric>"
        if about:
            self.client.log_batch(self.run_id, tags=[RunTag(f"description/{tag}", text[:5000])
                                                     for tag, text in about.items()])
        for i in range(0, len(batch), 1000):  # MLflow caps a batch at 1000 metrics
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])
        for name, table in meta.get("tables", {}).items():  # an artifact a step, in the
            self.client.log_dict(  # form of MLflow's table files (a restart rewrites it alike)
                self.run_id, {"columns": table["columns"], "data": table["rows"]},
                f"tables/{safe_tag(name)}/step_{step:08d}.json")

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None


def set_aside_torn(store: Path, aside: Path) -> None:
    """Move out of the file store ``store``, into ``aside``, every experiment or run folder
    whose ``meta.yaml`` a kill left empty or cut short."""
    moved = []
    if store.is_dir():
        for experiment in sorted(store.iterdir()):
            if not experiment.is_dir() or experiment.name.startswith("."):  # .trash
                continue
            if _torn(experiment / "meta.yaml"):
                moved.append(experiment)
                continue
            moved += [run for run in sorted(experiment.iterdir())
                      if run.is_dir() and _torn(run / "meta.yaml")]
    for path in moved:
        target = aside / path.relative_to(store)
        if target.exists():
            target = target.with_name(f"{target.name}.{time.time_ns()}")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        log.warning("mlflow: %s had an empty or cut meta.yaml (a kill while MLflow created "
                    "it), which MLflow cannot read; moved to %s", path, target)


def _torn(meta: Path) -> bool:
    """True if ``meta`` exists but is not a whole MLflow record (a folder without one is
    not MLflow's, or one MLflow passes over)."""
    import yaml

    try:
        text = meta.read_text(encoding="utf-8")
    except OSError:
        return False
    try:
        record = yaml.safe_load(text)
    except yaml.YAMLError:
        return True
    return not (isinstance(record, dict) and {"experiment_id", "lifecycle_stage"} <= set(record))


BUILTIN = Builtin(
    'mlflow', 5, MlflowSinkConfig, None, 'metricsvc.sinks.mlflow:MlflowSink',
    library='mlflow', extra='mlflow')
