"""TensorBoard event files through tensorboardX (``pip install metricsvc[tensorboard]``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metricsvc.config import TensorboardSinkConfig
from metricsvc.sinks.names import tagged


class TensorboardSink:
    """One scalar per key and step under ``<run folder>/<subdir>``."""

    name = "tensorboard"
    supports_nan = True

    def __init__(self, config: TensorboardSinkConfig | None = None) -> None:
        self.config = config or TensorboardSinkConfig()
        self.logdir: Path | None = None
        self._writer: Any = None

    def open(self, run_dir: Path) -> None:
        from tensorboardX import SummaryWriter  # optional backend: imported only when used

        self.logdir = Path(run_dir) / self.config.subdir
        self._writer = SummaryWriter(logdir=str(self.logdir), flush_secs=self.config.flush_secs)

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        for tag, value in tagged(metrics).items():
            self._writer.add_scalar(tag, value, global_step=step)
        if self.config.flush_every_step:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
