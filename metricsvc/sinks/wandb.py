"""Weights & Biases (``pip install metricsvc[wandb]``); offline unless configured otherwise.

wandb buffers in a child process (``wandb-core``) and writes its transaction log
(``run-<id>.wandb``) every ``flush_interval_s``; a SIGKILL of the actor loses what it had
not written yet. So the watermark this sink reports (``commit``) is read from that log, not
assumed, and a restarted service continues the *same* run (the id is kept in the run
folder): it reads what the run's transaction logs already hold and writes only the rest.
In offline mode each incarnation gets its own ``offline-run-*-<id>`` folder, all with the
one run id; ``wandb sync`` uploads them into one run.

``close`` (called by ``worker.close()`` and at actor shutdown) always calls ``finish`` and
waits for ``wandb-core`` to end.
The API key is read by wandb from WANDB_API_KEY; this module never reads, prints or
stores it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from metricsvc.sinks.base import Builtin, Strict, descriptions
from metricsvc.sinks.console import alert_line
from metricsvc.sinks.logfiles import LevelDBLogTail
from metricsvc.storage.files import SinkState


class WandbSinkConfig(Strict):
    """Weights & Biases; offline by default (no network). The API key comes from WANDB_API_KEY."""

    enabled: bool = True
    mode: Literal["online", "offline", "disabled"] = "offline"
    project: str = "metricsvc"
    entity: str | None = None
    name: str | None = Field(None, description="default: <experiment>/<trial>")
    group: str | None = None
    tags: tuple[str, ...] = ()
    notes: str | None = None
    dir: str | None = Field(None, description="default: the run folder")
    id: str | None = Field(None, description="default: a new id, kept in the run folder so "
                                           "a restarted service continues the same run")
    resume: Literal["allow", "must", "never", "auto"] | None = None
    flush_interval_s: float = Field(
        1.0, gt=0, description="how often wandb writes its transaction log (run-<id>.wandb); "
                               "a killed actor loses at most this much there, and the restart "
                               "replays it from the journal"
    )

_IDENT = b":W&B"


def _history_steps(records: list[bytes]) -> list[int]:
    """Return the ``_step`` of every history record among transaction-log records."""
    from wandb.proto import wandb_internal_pb2 as pb

    steps = []
    for data in records:
        record = pb.Record.FromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            if item.key == "_step" or list(item.nested_key) == ["_step"]:
                steps.append(int(json.loads(item.value_json)))
    return steps


class WandbSink:
    """Log each finished step as one wandb history row at ``step``: its metrics, and a
    ``wandb.Histogram`` per QUANTILES key (its merged buckets across ranks)."""

    name = "wandb"
    supports_nan = True
    table_series = False  # a step's tables as one wandb.Table each, not thousands of series

    def __init__(self, config: WandbSinkConfig | None = None) -> None:
        self.config = config or WandbSinkConfig()
        self.run: Any = None
        self.run_id: str | None = None
        self._root: Path | None = None
        self._last_step = -1
        self._held: set[int] = set()
        self._tail: LevelDBLogTail | None = None
        self._durable: int | None = None

    def open(self, run_dir: Path) -> None:
        import wandb  # optional backend: imported only when used

        cfg = self.config
        run_dir = Path(run_dir)
        state = SinkState(run_dir, self.name)
        kept = state.load().get("run_id")
        self.run_id = cfg.id or kept or uuid.uuid4().hex[:12]
        if kept is None:
            state.update(run_id=self.run_id)  # before init: a restart must find this run
        self._root = Path(cfg.dir or run_dir)
        self.run = wandb.init(
            mode=cfg.mode,
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or f"{run_dir.parent.name}/{run_dir.name}",
            group=cfg.group,
            tags=list(cfg.tags) or None,
            notes=cfg.notes,
            dir=str(self._root),
            id=self.run_id,
            resume=cfg.resume or ("allow" if kept else None),
            reinit="create_new",
            # The actor's stdout belongs to the console sink; stats sampling is not ours to do.
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                    x_transaction_log_flush_interval=cfg.flush_interval_s),
        )
        sync_file = getattr(self.run.settings, "sync_file", None)
        self._tail = LevelDBLogTail(Path(sync_file), _IDENT) if sync_file else None

    def _logs(self) -> list[Path]:
        assert self._root is not None
        return sorted(self._root.rglob(f"run-{self.run_id}.wandb"))

    def resume(self, after: int | None) -> None:
        """Leave out of later writes every step past ``after`` that a transaction log of
        this run already holds (an earlier incarnation's, flushed before it died)."""
        current = self._tail.path if self._tail is not None else None
        for path in self._logs():
            if path != current:
                self._held.update(s for s in _history_steps(LevelDBLogTail(path, _IDENT)
                                                             .read_new())
                                  if after is None or s > after)

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        if step <= self._last_step:
            return  # wandb rejects non-increasing steps; the dispatcher never sends them
        self._last_step = step
        if step in self._held:
            self._held.discard(step)
            return
        row: dict[str, Any] = dict(metrics)
        about = descriptions(meta)
        if about:  # wandb's metrics have no description field: the run's config holds them
            self.run.config.update({f"description/{tag}": text for tag, text in about.items()},
                                   allow_val_change=True)
        histograms, tables = meta.get("histograms"), meta.get("tables")
        if histograms or tables:
            import wandb

            for name, hist in (histograms or {}).items():  # merged buckets of every rank
                row.setdefault(name, wandb.Histogram(
                    np_histogram=(list(hist["counts"]), list(hist["edges"]))))
            for name, table in (tables or {}).items():  # one per step: the history keeps each
                row.setdefault(name, wandb.Table(columns=table["columns"], data=table["rows"]))
        self.run.log(row, step=step, commit=True)
        if self.config.mode == "online":  # wandb's alerts need its server (email, Slack)
            for alert in meta.get("alerts", ()):
                self.run.alert(title=f"metricsvc: {alert['rule']}",
                               text=alert_line(alert).strip(), level="WARN",
                               wait_duration=0)

    def commit(self) -> int | None:
        """Return the newest step wandb has written to its transaction log (its own flush,
        every ``flush_interval_s``); held steps count as durable."""
        if self._tail is None:
            return None  # no transaction log to read: trust the writes
        steps = _history_steps(self._tail.read_new())
        if steps:
            self._durable = max(steps)
        if self._durable is None:
            return -1
        return self._durable

    def close(self) -> None:
        """Finish the run, then wait for wandb's process to end unless another run of this
        process still uses it: ``finish`` returns before wandb-core has closed the run's
        files, and an actor ended right after its close (``stop_metric_worker``) lost
        their tail."""
        if self.run is not None:
            import wandb
            from wandb.sdk import wandb_setup

            self.run.finish()
            self.run = None
            # (``singleton``, not ``wandb.setup``: that one starts wandb's process if none
            # runs, as in mode "disabled", only for it to be torn down)
            if wandb_setup.singleton().most_recent_active_run is not None:
                return  # a run of the caller's own (sinks outside the MetricWorker)
            try:
                wandb.teardown()
            except SystemExit as ended:  # wandb's way to say its process failed
                raise RuntimeError(f"wandb's process ended with code {ended.code}") from None


BUILTIN = Builtin(
    'wandb', 3, WandbSinkConfig, None, 'metricsvc.sinks.wandb:WandbSink',
    library='wandb', extra='wandb')
