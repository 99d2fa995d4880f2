"""SwanLab (``pip install metricsvc[swanlab]``); offline unless configured otherwise.

``cloud`` mode logs in with SWANLAB_API_KEY from the environment; the key is
never printed or written anywhere by this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metricsvc.config import SwanlabSinkConfig
from metricsvc.sinks.names import tagged

_MODES = {"cloud": "online", "local": "local", "offline": "offline", "disabled": "disabled"}


class SwanlabSink:
    """Log each finished step to a SwanLab run."""

    name = "swanlab"
    supports_nan = False

    def __init__(self, config: SwanlabSinkConfig | None = None) -> None:
        self.config = config or SwanlabSinkConfig()
        self.run: Any = None
        self.logdir: Path | None = None

    def open(self, run_dir: Path) -> None:
        import swanlab  # optional backend: imported only when used

        cfg = self.config
        run_dir = Path(run_dir)
        self.logdir = Path(cfg.logdir) if cfg.logdir else run_dir / "swanlab"
        self.logdir.mkdir(parents=True, exist_ok=True)
        if cfg.mode == "cloud" and os.environ.get("SWANLAB_API_KEY"):
            swanlab.login(api_key=os.environ["SWANLAB_API_KEY"])
        self.run = swanlab.init(
            project=cfg.project,
            name=cfg.experiment_name or f"{run_dir.parent.name}/{run_dir.name}",
            log_dir=str(self.logdir),
            mode=_MODES[cfg.mode],
            reinit=True,
            settings=_quiet_settings(_MODES[cfg.mode], self.logdir),
        )

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        self.run.log(tagged(metrics), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _quiet_settings(mode: str, logdir: Path) -> Any:
    """Keep SwanLab off the actor's stdout and off hardware probing (the console sink prints)."""
    try:
        from swanlab.sdk.internal.settings import Settings

        return Settings(
            mode=mode,
            log_dir=logdir,
            interactive=False,  # never prompt for a login inside an actor
            terminal={"proxy_type": "none"},
            probe={"monitor": False, "hardware": False, "requirements": False, "git": False},
        )
    except Exception:  # older or newer swanlab: its defaults are fine, only noisier
        return None
