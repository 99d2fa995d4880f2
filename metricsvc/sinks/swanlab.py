"""SwanLab (``pip install metricsvc[swanlab]``); offline unless configured otherwise.

``cloud`` mode logs in with SWANLAB_API_KEY from the environment; the key is
never printed or written anywhere by this module.

SwanLab keeps what it logs in a Python buffer until ``finish`` (its ``.swanlab`` file is
written in 8 KiB pieces), so a killed actor loses the tail of it. The run id is kept in the
run folder: a restarted service continues that id (``resume="allow"``; offline and local
modes open a new ``run-*-<id>`` folder under the same logdir, which ``swanlab sync`` uploads
into the one run) and writes only the (step, key) pairs that no ``.swanlab`` file of the
run holds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from metricsvc.core.keys import safe_tag
from metricsvc.sinks.base import Builtin, Strict, tagged
from metricsvc.sinks.logfiles import LevelDBLogTail
from metricsvc.storage.files import SinkState


class SwanlabSinkConfig(Strict):
    """SwanLab; offline by default (no network). The API key comes from SWANLAB_API_KEY."""

    enabled: bool = True
    mode: Literal["cloud", "local", "offline", "disabled"] = "offline"
    project: str = "metricsvc"
    experiment_name: str | None = Field(None, description="default: <experiment>/<trial>")
    logdir: str | None = Field(None, description="default: <run folder>/swanlab")

_MODES = {"cloud": "online", "local": "local", "offline": "offline", "disabled": "disabled"}


class SwanlabSink:
    """Log each finished step to a SwanLab run: its metrics, and per QUANTILES key its
    merged histogram as a bar chart."""

    name = "swanlab"
    supports_nan = False

    def __init__(self, config: SwanlabSinkConfig | None = None) -> None:
        self.config = config or SwanlabSinkConfig()
        self.run: Any = None
        self.logdir: Path | None = None
        self.run_id: str | None = None
        self._held: dict[int, set[str]] = {}
        self._earlier: set[Path] = set()  # .swanlab files of earlier incarnations
        self._tail: LevelDBLogTail | None = None  # this incarnation's, once it exists
        self._durable = -1

    def open(self, run_dir: Path) -> None:
        import swanlab  # optional backend: imported only when used

        cfg = self.config
        run_dir = Path(run_dir)
        self.logdir = Path(cfg.logdir) if cfg.logdir else run_dir / "swanlab"
        self.logdir.mkdir(parents=True, exist_ok=True)
        if cfg.mode == "cloud" and os.environ.get("SWANLAB_API_KEY"):
            swanlab.login(api_key=os.environ["SWANLAB_API_KEY"])
        state = SinkState(run_dir, self.name)
        kept = state.load().get("run_id")
        if kept is None:
            from swanlab.utils.experiment import generate_id

            state.update(run_id=generate_id())  # before init: a restart must find this run
        self.run_id = state.load()["run_id"]
        self._earlier = set(self.logdir.glob(f"run-*-{self.run_id}/run-{self.run_id}.swanlab"))
        self.run = swanlab.init(
            id=self.run_id,
            resume="allow",
            project=cfg.project,
            name=cfg.experiment_name or f"{run_dir.parent.name}/{run_dir.name}",
            log_dir=str(self.logdir),
            mode=_MODES[cfg.mode],
            reinit=True,
            settings=_quiet_settings(_MODES[cfg.mode], self.logdir),
        )

    def resume(self, after: int | None) -> None:
        """Leave out of later writes every (step, key) past ``after`` that a ``.swanlab``
        file of this run already holds (an earlier incarnation's, as far as it got)."""
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record

        assert self.logdir is not None
        for path in sorted(self.logdir.rglob(f"run-{self.run_id}.swanlab")):
            for data in LevelDBLogTail(path, b":SWL").read_new():
                record = Record.FromString(data)
                kind = record.WhichOneof("record_type")
                if kind in ("scalar", "media"):  # numbers, and histograms (charts)
                    item = getattr(record, kind)
                    step = int(item.step)
                    if after is None or step > after:
                        self._held.setdefault(step, set()).add(item.key)

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        held = self._held.pop(step, ())
        values: dict[str, Any] = {k: v for k, v in tagged(metrics, meta).items() if k not in held}
        for name, hist in meta.get("histograms", {}).items():
            tag = safe_tag(name)
            if tag not in held and tag not in values:
                chart = _histogram_chart(tag, hist)
                if chart is not None:
                    values[tag] = chart
        for name, table in meta.get("tables", {}).items():  # beside its scalars (the page's)
            tag = safe_tag(name)
            if tag not in held and tag not in values:
                import swanlab

                values[tag] = swanlab.echarts.Table().add(table["columns"], table["rows"])
        if values:
            self.run.log(values, step=step)

    def commit(self) -> int | None:
        """Return the newest step in this incarnation's ``.swanlab`` file (-1: none yet;
        None in cloud mode, whose files are SwanLab's own business).

        SwanLab holds what it logs in memory until a piece of the file is full, so a
        written step is durable only once the file holds it; the dispatcher's watermark
        follows this, and a SIGKILL never costs a step the journal would not replay.
        """
        if self.config.mode not in ("offline", "local"):
            return None
        if self._tail is None:
            assert self.logdir is not None
            mine = [p for p in self.logdir.glob(f"run-*-{self.run_id}/run-{self.run_id}.swanlab")
                    if p not in self._earlier]
            if not mine:
                return self._durable
            self._tail = LevelDBLogTail(max(mine, key=lambda p: p.stat().st_mtime), b":SWL")
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record

        for data in self._tail.read_new():
            record = Record.FromString(data)
            kind = record.WhichOneof("record_type")
            if kind in ("scalar", "media"):
                self._durable = max(self._durable, int(getattr(record, kind).step))
        return self._durable

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _histogram_chart(tag: str, hist: Mapping[str, Any]) -> Any:
    """A merged histogram as a SwanLab ECharts bar chart (SwanLab has no histogram type):
    one bar per bin, labelled by its range, each bar carrying its exact edges."""
    import swanlab

    try:
        from pyecharts.charts import Bar  # installed with swanlab (its ECharts type)
    except ImportError:
        return None

    edges, counts = list(hist["edges"]), list(hist["counts"])
    labels = [f"{a:.4g}..{b:.4g}" for a, b in zip(edges, edges[1:])]
    bars = [{"value": c, "lo": a, "hi": b} for c, a, b in zip(counts, edges, edges[1:])]
    return swanlab.ECharts(Bar().add_xaxis(labels).add_yaxis(tag, bars))


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


BUILTIN = Builtin(
    'swanlab', 4, SwanlabSinkConfig, None, 'metricsvc.sinks.swanlab:SwanlabSink',
    library='swanlab', extra='swanlab')
