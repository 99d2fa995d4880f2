"""The journal's writer: one JSON line per finished step (and per event) under the run
folder, each written whole or not at all (``LineFile``). The service owns it as its log:
how far it has written is how far clients may forget their batches. Read back with
``metricsvc.storage.journal``. A step with alerts is followed by an ``alert`` event line
each, and the samples they name go first to ``flagged_samples.jsonl``
(``metricsvc.storage.flagged``): a kill between the two writes them again, never loses
them."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from metricsvc.sinks.base import Builtin, Strict, plain
from metricsvc.storage.files import LineFile
from metricsvc.storage.flagged import FLAGGED_FILE, flagged_lines
from metricsvc.storage.journal import DEFAULT_JOURNAL, iter_journal, journal_file


class JsonlSinkConfig(Strict):
    """The journal: one JSON line per finished step under the run folder."""

    enabled: bool = True
    filename: str = DEFAULT_JOURNAL
    fsync: bool = Field(False, description="fsync after every line (slower, crash-proof)")

    _filename = field_validator("filename")(classmethod(lambda cls, v: plain(v, "filename")))


def _json_values(value: Any) -> Any:
    """``value`` with every non-finite float written as the string ``"inf"``, ``"-inf"`` or
    ``"nan"`` (JSON has none; the reader restores them as floats)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {k: _json_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_values(v) for v in value]
    return value


class JsonlSink:
    """Append ``{"step", "metrics", "meta", "time"}`` per step to the run's journal."""

    name = "jsonl"
    supports_nan = True  # written as the string "nan"

    def __init__(self, config: JsonlSinkConfig | None = None) -> None:
        self.config = config or JsonlSinkConfig()
        self.path: Path | None = None
        self._file: LineFile | None = None
        self._flagged: LineFile | None = None  # opened with the first sample an alert names
        self._through: int | None = None  # after a restart: its newest step

    def open(self, run_dir: Path) -> None:
        self.path = journal_file(run_dir, self.config.filename)
        self._file = LineFile(self.path)  # type: ignore[arg-type]
        self._flagged_path = Path(run_dir) / FLAGGED_FILE

    def resume(self, after: int | None) -> None:
        """Read back the newest step the journal's latest segment holds (``held_through``):
        the run's history decides from it what is written again."""
        assert self.path is not None
        self._through = max((r["step"] for r in iter_journal(self.path)), default=None)

    def held_through(self) -> int | None:
        """The newest step the journal's latest segment holds (read back from the file)."""
        return self._through

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        record = {"step": step, "metrics": metrics, "meta": meta, "time": time.time()}
        try:  # the common step: every number finite, written as it is (nothing copied)
            line = json.dumps(record, allow_nan=False)
        except (ValueError, TypeError):  # a non-finite number, or a mapping JSON cannot take
            line = json.dumps(_json_values(record), allow_nan=False)
        if self._file is None:
            raise RuntimeError("JsonlSink.write called before open or after close")
        alerts = meta.get("alerts")
        if alerts:
            line += "".join("\n" + json.dumps({"event": {"alert": _json_values(a)},
                                                "time": record["time"]}, allow_nan=False)
                            for a in alerts)
            flagged = flagged_lines(alerts)
            if flagged:
                if self._flagged is None:
                    self._flagged = LineFile(self._flagged_path)
                self._flagged.append("".join(json.dumps(_json_values(f)) + "\n"
                                             for f in flagged).encode("utf-8"), fsync=True)
        self._file.append((line + "\n").encode("utf-8"), fsync=self.config.fsync)

    def write_event(self, event: Mapping[str, Any]) -> None:
        """Journal something that is not a finished step (e.g. a late batch). A ``rewind``
        begins a segment of the run's history: it is synced before this returns."""
        if self._file is None:
            raise RuntimeError("JsonlSink.write_event called before open or after close")
        line = json.dumps({"event": dict(event), "time": time.time()}, allow_nan=False)
        self._file.append((line + "\n").encode("utf-8"),
                          fsync="rewind" in event or self.config.fsync)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._flagged is not None:
            self._flagged.close()
            self._flagged = None


BUILTIN = Builtin("jsonl", 1, JsonlSinkConfig, JsonlSinkConfig(), "metricsvc.sinks.jsonl:JsonlSink")
