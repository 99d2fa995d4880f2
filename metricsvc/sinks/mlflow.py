"""MLflow (``pip install metricsvc[mlflow]``): by default a file store in the run folder."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metricsvc.config import MlflowSinkConfig
from metricsvc.sinks.names import tagged


class MlflowSink:
    """Log each finished step as one ``log_batch`` of metrics at ``step``."""

    name = "mlflow"
    supports_nan = False

    def __init__(self, config: MlflowSinkConfig | None = None) -> None:
        self.config = config or MlflowSinkConfig()
        self.client: Any = None
        self.run_id: str | None = None
        self.tracking_uri: str | None = None

    def open(self, run_dir: Path) -> None:
        import mlflow  # optional backend: imported only when used

        cfg = self.config
        run_dir = Path(run_dir)
        self.tracking_uri = cfg.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        if self.tracking_uri.startswith("file:"):
            # MLflow 3 keeps the file store only on request; a local store is what we want here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        experiment = cfg.experiment_name or run_dir.parent.name
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        run = self.client.create_run(exp_id, run_name=cfg.run_name or run_dir.name)
        self.run_id = run.info.run_id

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(tag, float(v), now, step) for tag, v in tagged(metrics, 250).items()]
        for i in range(0, len(batch), 1000):  # MLflow caps a batch at 1000 metrics
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None
