"""Weights & Biases (``pip install metricsvc[wandb]``); offline unless configured otherwise.

wandb inside a Ray actor loses buffered data unless the run is finished
explicitly, so ``close`` (called by ``worker.close()`` and at actor shutdown)
always calls ``finish``. The API key is read by wandb from WANDB_API_KEY; this
module never reads, prints or stores it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metricsvc.config import WandbSinkConfig


class WandbSink:
    """Log each finished step as one wandb history row at ``step``."""

    name = "wandb"
    supports_nan = True

    def __init__(self, config: WandbSinkConfig | None = None) -> None:
        self.config = config or WandbSinkConfig()
        self.run: Any = None
        self._last_step = -1

    def open(self, run_dir: Path) -> None:
        import wandb  # optional backend: imported only when used

        cfg = self.config
        run_dir = Path(run_dir)
        self.run = wandb.init(
            mode=cfg.mode,
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or f"{run_dir.parent.name}/{run_dir.name}",
            group=cfg.group,
            tags=list(cfg.tags) or None,
            notes=cfg.notes,
            dir=cfg.dir or str(run_dir),
            id=cfg.id,
            resume=cfg.resume,
            reinit="create_new",
            # The actor's stdout belongs to the console sink; stats sampling is not ours to do.
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        if step <= self._last_step:
            return  # wandb rejects non-increasing steps; the dispatcher never sends them
        self.run.log(dict(metrics), step=step)
        self._last_step = step

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
