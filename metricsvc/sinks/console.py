"""A compact aligned table of each finished step, grouped by key prefix."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from itertools import groupby
from pathlib import Path
from typing import Any, TextIO

from pydantic import Field

from metricsvc.sinks.base import Builtin, Strict


class ConsoleSinkConfig(Strict):
    """Aligned table of each finished step, printed by the actor."""

    enabled: bool = True
    every: int = Field(1, ge=1, description="print every N-th finished step")
    max_rows: int = Field(200, ge=1, description="rows shown per step before eliding")
    total_steps: int | None = Field(
        None, ge=1, description="the run's last step + 1: the header shows an ETA"
    )


def format_step(
    step: int, metrics: Mapping[str, float], meta: Mapping[str, Any], max_rows: int = 200,
    pace: str = "",
) -> str:
    """Return the table printed for one step (``pace``: steps per minute, ETA)."""
    ranks = f"{len(meta.get('ranks', []))}/{meta.get('world_size', '?')} ranks"
    head = f"step {step} | {ranks} | {len(metrics)} metrics"
    if meta.get("partial"):
        head += f" | PARTIAL, missing ranks {meta.get('missing_ranks')}"
    head += pace
    keys = sorted(metrics)
    extremes = meta.get("extremes", {})
    width = max((len(k) for k in keys[:max_rows]), default=10)
    rule = "-" * max(len(head), width + 16)
    lines = [head]
    for prefix, group in groupby(keys[:max_rows], key=lambda k: k.split("/", 1)[0]):
        lines.append(f"{prefix} " + rule[len(prefix) + 1 :])
        lines.extend(f"{k:<{width}}  {metrics[k]:>14.6g}{source(extremes.get(k))}"
                     for k in group)
    if len(keys) > max_rows:
        lines.append(f"... {len(keys) - max_rows} more")
    lines.extend(f"top {name}: {top_line(samples)}"  # stat(top=k): one line a name
                 for name, samples in meta.get("top", {}).items())
    lines.extend(f"first non-finite {key}: {nonfinite_text(where)}"
                 for key, where in meta.get("nonfinite_first", {}).items())
    return "\n".join(lines) + "\n"


def top_line(samples: list[Mapping[str, Any]]) -> str:
    """``9 (rank 1, id 11); 7 (rank 0)``: a name's top samples (``meta.top``), best first."""
    return "; ".join(f"{s['value']:.6g} ({place(s)})" for s in samples)


def nonfinite_text(where: Mapping[str, Any]) -> str:
    """``nan at rank 2, id 214 (row 0, col 1, call 1)``: where a key's first non-finite
    value came from (``meta.nonfinite_first``; without ``ids=``, the rank alone)."""
    return f"{where['kind'] + ' ' if 'kind' in where else ''}at {where_text(where)}"


def where_text(where: Mapping[str, Any]) -> str:
    """``rank 2, id 1017 (row 3, col 0, call 1)``: a sample's place, as far as known."""
    text = place(where)
    if "row" in where:
        text += f" (row {where['row']}, col {where['col']}, call {where['call']})"
    return text


def source(where: Mapping[str, Any] | None) -> str:
    """``  <- rank 2, id 1017`` beside a min or max: where it came from (``meta.extremes``)."""
    return f"  <- {place(where)}" if where else ""


def place(where: Mapping[str, Any]) -> str:
    """``rank 2, id 1017``: the rank (or stream) whose record a value came from, and the
    sample where it is known."""
    parts = [f"rank {where['rank']}" if "rank" in where else f"stream {where.get('stream')}"]
    if "id" in where:
        parts.append(f"id {where['id']}")
    return ", ".join(parts)


def alert_line(alert: Mapping[str, Any]) -> str:
    """``ALERT step 12: kl/max above 0.5: kl/max = 0.73  <- rank 1, id 4711`` (each sample
    the alert names, after the arrow)."""
    value = alert.get("value")
    shown = "missing" if value is None else f"{alert['key']} = {value:.6g}"
    samples = "; ".join(f"{s['name']}: {place(s)}" for s in alert.get("samples", ()))
    return (f"ALERT step {alert['step']}: {alert['rule']}: {shown}"
            f"{'  <- ' + samples if samples else ''}\n")


class ConsoleSink:
    """Print every N-th finished step as an aligned table."""

    name = "console"
    supports_nan = True
    table_series = False  # the layer summaries, not a line per table cell

    def __init__(
        self, config: ConsoleSinkConfig | None = None, stream: TextIO | None = None
    ) -> None:
        self.config = config or ConsoleSinkConfig()
        self._stream = stream
        self._first: tuple[float, int] | None = None  # (time, step) of the first step seen

    def open(self, run_dir: Path) -> None:
        del run_dir  # the console writes no files

    def pace(self, step: int, now: float | None = None) -> str:
        """Return `` | N steps/min | ETA ...`` from the steps seen so far ("" at first)."""
        now = time.monotonic() if now is None else now
        if self._first is None:
            self._first = (now, step)
            return ""
        start, first = self._first
        if step <= first or now <= start:
            return ""
        per_min = (step - first) * 60.0 / (now - start)
        text = f" | {per_min:.3g} steps/min"
        total = self.config.total_steps
        if total is not None and step + 1 < total:
            left = (total - step - 1) * 60.0 / per_min
            text += f" | ETA {int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}"
        return text

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        stream = self._stream or sys.stdout
        for alert in meta.get("alerts", ()):  # every step's, shown or not
            stream.write(alert_line(alert))
        if step % self.config.every and not meta.get("partial"):
            stream.flush()
            return  # the pace is measured from the first step shown
        pace = self.pace(step)
        if meta.get("partial"):
            stream.write(f"WARNING step {step} is partial: ranks {meta.get('missing_ranks')} "
                         f"did not close it within the straggler timeout\n")
        stream.write(format_step(step, metrics, meta, self.config.max_rows, pace))
        stream.flush()

    def close(self) -> None:
        """Nothing to release."""


BUILTIN = Builtin(
    'console', 0, ConsoleSinkConfig, ConsoleSinkConfig(), 'metricsvc.sinks.console:ConsoleSink')
