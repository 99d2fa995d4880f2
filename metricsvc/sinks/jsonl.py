"""The JSONL journal: one line per finished step, appended and flushed as it comes."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from metricsvc.config import JsonlSinkConfig


def _json_number(value: float) -> float | str:
    # JSON has no NaN/inf; keep such a value readable instead of writing invalid JSON.
    return value if math.isfinite(value) else str(value)


class JsonlSink:
    """Append ``{"step", "metrics", "meta", "time"}`` per step to ``<run_dir>/<filename>``."""

    name = "jsonl"
    supports_nan = True  # written as the string "nan"

    def __init__(self, config: JsonlSinkConfig | None = None) -> None:
        self.config = config or JsonlSinkConfig()
        self.path: Path | None = None
        self._fh: IO[str] | None = None

    def open(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / self.config.filename
        torn = self.path.exists() and self.path.stat().st_size and not _ends_with_newline(self.path)
        self._fh = self.path.open("a", encoding="utf-8")
        if torn:  # a crash cut the last line short: start ours on a line of its own
            self._fh.write("\n")

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        record = {
            "step": step,
            "metrics": {k: _json_number(v) for k, v in metrics.items()},
            "meta": dict(meta),
            "time": time.time(),
        }
        self._append(record)

    def write_event(self, event: Mapping[str, Any]) -> None:
        """Journal something that is not a finished step (e.g. a late batch)."""
        self._append({"event": dict(event), "time": time.time()})

    def _append(self, record: Mapping[str, Any]) -> None:
        if self._fh is None:
            raise RuntimeError("JsonlSink.write called before open or after close")
        self._fh.write(json.dumps(record, allow_nan=False, sort_keys=False) + "\n")
        self._fh.flush()
        if self.config.fsync:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def read_journal(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Return the finished-step records of a journal, in file order.

    Events are skipped, and so is a line a crash cut short.
    """
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                record = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "step" in record:
                out.append(record)
    return out
