"""The journal: the service's durability log, written and read back.

Every line is written whole or not at all (``LineFile``): a write that fails part-way is
cut back to where it started, so a retried write never leaves a torn or doubled line.
The worker owns one ``Journal`` per run: where the file is (``journal_file``, the one
place that path is built), the writer the dispatcher serves (a ``JsonlSink``), how far it
is durable, and its reading for a restart. The reader keeps one record per step, restores
non-finite values as floats, and skips (with one warning naming file and line) anything it
cannot use.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from metricsvc.config_base import Strict, plain
from metricsvc.core.limits import is_int
from metricsvc.core.step_result import StepResult
from metricsvc.storage.files import LineFile
from metricsvc.storage.history import journal_rewinds, rewind_of

log = logging.getLogger(__name__)

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _json_number(value: float) -> float | str:
    # JSON has no NaN/inf: such a value is written as "inf", "-inf" or "nan" and read back
    # as the float it was.
    return value if math.isfinite(value) else str(value)


def _json_values(value: Any) -> Any:
    """``value`` with every non-finite float written as ``_json_number`` writes it (a meta
    entry holding an overflowed figure must not cost the step its line)."""
    if isinstance(value, float):
        return _json_number(value)
    if isinstance(value, Mapping):
        return {k: _json_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_values(v) for v in value]
    return value



def _line(record: Mapping[str, Any]) -> str:
    """One journal line: ``record`` as JSON (a non-finite number raises ValueError)."""
    return json.dumps(record, allow_nan=False, sort_keys=False) + "\n"


class JsonlSinkConfig(Strict):
    """The journal: one JSON line per finished step under the run folder."""

    enabled: bool = True
    filename: str = "metrics.jsonl"
    fsync: bool = Field(False, description="fsync after every line (slower, crash-proof)")

    _filename = field_validator("filename")(classmethod(lambda cls, v: plain(v, "filename")))

class JsonlSink:
    """Append ``{"step", "metrics", "meta", "time"}`` per step to ``<run_dir>/<filename>``."""

    name = "jsonl"
    supports_nan = True  # written as the string "nan"

    def __init__(self, config: JsonlSinkConfig | None = None) -> None:
        self.config = config or JsonlSinkConfig()
        self.path: Path | None = None
        self._file: LineFile | None = None
        self._through: int | None = None  # after a restart: its newest step

    def open(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / self.config.filename
        self._file = LineFile(self.path)

    def resume(self, after: int | None) -> None:
        """Read back the newest step the journal's latest segment holds (``held_through``):
        the run's history (``metricsvc.storage.history``) decides from it what is written again."""
        assert self.path is not None
        self._through = max((r["step"] for r in iter_journal(self.path)), default=None)

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        now = time.time()
        try:  # the common step: every number finite, written as it is (nothing copied)
            line = _line({"step": step, "metrics": metrics, "meta": meta, "time": now})
        except (ValueError, TypeError):  # a non-finite number, or a mapping JSON cannot take
            line = _line({"step": step,
                          "metrics": {k: _json_number(v) for k, v in metrics.items()},
                          "meta": _json_values(meta), "time": now})
        self._write(line)

    def held_through(self) -> int | None:
        """The newest step the journal's latest segment holds (read back from the file)."""
        return self._through

    def write_event(self, event: Mapping[str, Any]) -> None:
        """Journal something that is not a finished step (e.g. a late batch). A ``rewind``
        begins a segment of the run's history: it is synced before this returns."""
        self._append({"event": dict(event), "time": time.time()}, sync="rewind" in event)

    def _append(self, record: Mapping[str, Any], sync: bool = False) -> None:
        self._write(_line(record), sync)

    def _write(self, line: str, sync: bool = False) -> None:
        if self._file is None:
            raise RuntimeError("JsonlSink.write called before open or after close")
        self._file.append(line.encode("utf-8"), fsync=sync or self.config.fsync)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


DEFAULT_JOURNAL = JsonlSinkConfig().filename  # "metrics.jsonl"


def journal_file(run_dir: str | os.PathLike[str], sinks: Any = None) -> Path | None:
    """Return the journal of the run in ``run_dir`` under ``sinks`` (None: the default
    config), or None where the journal is turned off."""
    return _journal_at(run_dir, JsonlSinkConfig() if sinks is None else sinks.jsonl)


def _journal_at(run_dir: str | os.PathLike[str], jsonl: JsonlSinkConfig | None) -> Path | None:
    """The one place a journal's path is built (None: the journal is turned off)."""
    if jsonl is None or not jsonl.enabled:
        return None
    return Path(run_dir) / jsonl.filename


def run_journal(run_dir: Path) -> Path | None:
    """Return the journal of an existing run folder, as its saved ``config.yaml`` names it
    (the default name where the folder has none)."""
    import yaml

    jsonl: JsonlSinkConfig | None = JsonlSinkConfig()
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        section = ((saved or {}).get("sinks") or {}).get("jsonl", {})
        jsonl = None if section is None else JsonlSinkConfig.model_validate(section)
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        pass  # no saved config (or an unreadable one): the default name
    return _journal_at(run_dir, jsonl)


class Journal:
    """A run's journal, owned by the worker: its file, its writer and its reading."""

    def __init__(self, run_dir: Path, sinks: Any) -> None:
        self.path = journal_file(run_dir, sinks)
        # The writer the dispatcher serves with the other sinks (retries, dead letters);
        # the worker asks it, not a sink looked up by name, how far the log is durable.
        self.writer = None if self.path is None else JsonlSink(sinks.jsonl)
        self.stats: dict[str, Any] = {"skipped": 0, "duplicates": 0}
        self.index = None if self.path is None else JournalIndex(self.path)

    def holds_steps(self) -> bool:
        """Return True if the file exists and holds anything."""
        return self.path is not None and self.path.exists() and self.path.stat().st_size > 0

    def stream(self) -> Iterator[dict[str, Any]]:
        """Yield the latest segment's step records (counting what is skipped in ``stats``)."""
        return iter_journal(self.path, self.stats) if self.path is not None else iter(())

    def meta(self, step: int) -> dict[str, Any] | None:
        """Return the journaled meta of ``step`` (None: not journaled, or no journal)."""
        return None if self.index is None else self.index.meta(step)

    def restore(self, restore: Callable[[Iterator[dict[str, Any]]], None],
                results: Any) -> tuple[int, Callable[[], Iterator[dict[str, Any]]] | None]:
        """After a restart, hand ``restore`` (the merge's) the journal's latest segment
        (finished steps, running totals, the recent steps' digests), one record at a time,
        and give ``results`` the last steps it keeps. Return how many steps were read and
        how the sinks read the journal again for their replay (None: no journal)."""
        if self.path is None or not self.path.exists():
            return 0, None
        recent: deque[dict[str, Any]] = deque(maxlen=results.keep)
        count = 0

        def kept(records: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
            nonlocal count
            for record in records:
                recent.append(record)
                count += 1
                yield record

        restore(kept(self.stream()))
        for record in recent:
            results.put(StepResult(int(record["step"]), record["metrics"], record["meta"]))
        if count:
            log.warning("restarted: %d finished steps reloaded from %s (last step %s)",
                        count, self.path, recent[-1]["step"] if recent else None)
        path = self.path
        return count, lambda: iter_journal(path)

    def totals_at(self, step: int) -> dict[str, Any] | None:
        """The running totals journaled with the last step at or before ``step`` in the
        latest segment (each step's meta holds them all: None, none yet)."""
        if step < 0 or not self.holds_steps():
            return None
        totals = None
        for record in iter_journal(self.path):
            if record["step"] <= step:
                totals = record["meta"].get("derived_totals")
        return totals

    def health(self) -> dict[str, Any]:
        """The journal's own record: where it is and what reading it skipped."""
        return {"path": None if self.path is None else str(self.path),
                "skipped_lines": self.stats["skipped"],
                "duplicate_steps": self.stats["duplicates"]}


def _step_record(line: str) -> tuple[dict[str, Any] | None, str | None]:
    """Return ``(record, None)`` for a finished step, ``(None, why)`` for an unusable line,
    and ``(None, None)`` for a line that is fine but not a step (an event, a blank)."""
    if not line.strip():
        return None, None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        return None, f"not JSON ({err.msg})"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object"
    if "event" in record and "step" not in record:
        return None, None
    step, metrics, meta = record.get("step"), record.get("metrics"), record.get("meta")
    if not is_int(step) or step < 0:
        return None, f"'step' must be an int >= 0, got {step!r}"
    if not isinstance(metrics, dict) or not isinstance(meta, dict):
        return None, "a step record needs 'metrics' and 'meta' objects"
    values = {}
    for key, value in metrics.items():
        if isinstance(value, str):
            value = _NONFINITE.get(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None, f"metric {key!r} is not a number: {metrics[key]!r}"
        values[key] = float(value)
    return {**record, "metrics": values}, None


def read_journal(path: str | os.PathLike[str],
                 stats: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Return the finished-step records of a journal's latest segment, one per step, in
    file order (``iter_journal``, as a list)."""
    return list(iter_journal(path, stats))


def iter_journal(path: str | os.PathLike[str],
                 stats: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Yield the finished-step records of a journal's latest segment, one per step, in
    file order, holding one record at a time (a restart reads a bounded part of a long
    journal).

    A ``rewind`` event (``{"event": {"rewind": {"to_step": k}}}``) starts a segment: the
    records past ``k`` before it are archived (kept in the file, left out here; a first
    pass finds the rewinds). Other events and blank lines are passed over; a line that is
    not a usable step record (a torn line, missing fields, a non-numeric value) is skipped
    with one warning naming file and line; of several records of one step the first is
    kept and the rest counted. ``stats`` (if given) receives ``skipped``, ``duplicates``
    and ``archived`` once the journal has been read through.
    """
    rewinds = _rewinds(path)  # line number -> the lowest step any later rewind goes back to
    seen: set[int] = set()
    duplicates: list[int] = []
    skipped = archived = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            record, why = _step_record(line)
            if why is not None:
                skipped += 1
                log.warning("%s line %d: skipped: %s", path, number, why)
                continue
            if record is None:  # an event (a rewind was read in the first pass) or a blank
                continue
            limit = _later_rewind(rewinds, number)
            if limit is not None and record["step"] > limit:
                archived += 1
            elif record["step"] in seen:
                duplicates.append(record["step"])
            else:
                seen.add(record["step"])
                yield record
    if duplicates:
        log.warning("%s: %d duplicate step records (steps %s) skipped; the first of each kept",
                    path, len(duplicates), sorted(set(duplicates)))
    if stats is not None:
        stats.update(skipped=skipped, duplicates=len(duplicates), archived=archived)


class JournalIndex:
    """Where each step's record in a journal's latest segment begins: found by one scan
    the first time an old step is asked for, then extended as the journal grows (a batch
    for a step older than the service keeps in memory is rare, and must not cost a read
    of the whole journal each time)."""

    _STEP = re.compile(rb'^\{"step": (\d+),')

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._at: dict[int, int] = {}
        self._scanned = 0

    def meta(self, step: int) -> dict[str, Any] | None:
        """Return the journaled meta of ``step``, or None if the journal does not hold it."""
        self._scan()
        at = self._at.get(step)
        if at is None:
            return None
        with open(self.path, "rb") as fh:
            fh.seek(at)
            record, _ = _step_record(fh.readline().decode("utf-8", "replace"))
        return None if record is None else record["meta"]

    def _scan(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as fh:
            fh.seek(self._scanned)
            while True:
                start = fh.tell()
                line = fh.readline()
                if not line.endswith(b"\n"):
                    break  # the end, or a line still being written
                self._scanned = fh.tell()
                found = self._STEP.match(line)
                if found is not None:
                    self._at.setdefault(int(found.group(1)), start)
                elif b'"rewind"' in line:
                    rewind = rewind_of(line.decode("utf-8", "replace"))
                    if rewind is not None:
                        self._at = {s: a for s, a in self._at.items() if s <= rewind.to_step}


def _rewinds(path: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """``(line, to_step)`` of each rewind event, with ``to_step`` the lowest of it and every
    later one (what a record before that line is archived past)."""
    found = [(number, rewind.to_step) for number, rewind in journal_rewinds(path)]
    for i in range(len(found) - 2, -1, -1):
        found[i] = (found[i][0], min(found[i][1], found[i + 1][1]))
    return found


def _later_rewind(rewinds: list[tuple[int, int]], number: int) -> int | None:
    """The lowest step a rewind after line ``number`` goes back to, or None."""
    at = bisect.bisect_right(rewinds, (number, float("inf")))
    return rewinds[at][1] if at < len(rewinds) else None
