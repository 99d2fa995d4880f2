"""The journal, read back: where a run's journal is, its finished steps (one per step,
of the latest segment of the run's history), an index of where each step's record begins,
and the journal a restarted service reloads.

Its writer is the ``jsonl`` sink (``metricsvc.sinks.jsonl``), which every line goes through
whole or not at all. The reader keeps one record per step, restores non-finite values as
floats, and skips (with one warning naming file and line) anything it cannot use.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from metricsvc.core.keys import is_int
from metricsvc.storage.history import journal_rewinds, rewind_of

log = logging.getLogger(__name__)

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
DEFAULT_JOURNAL = "metrics.jsonl"  # the journal's file name unless configured


def journal_file(run_dir: str | os.PathLike[str], filename: str | None) -> Path | None:
    """The one place a journal's path is built: ``filename`` in ``run_dir`` (None: the
    journal is turned off)."""
    return None if filename is None else Path(run_dir) / filename


def run_journal(run_dir: Path) -> Path | None:
    """Return the journal of an existing run folder, as its saved ``config.yaml`` names it
    (the default name where the folder has none)."""
    import yaml

    filename: str | None = DEFAULT_JOURNAL
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        section = ((saved or {}).get("sinks") or {}).get("jsonl", {})
        if section is None or not section.get("enabled", True):
            filename = None
        else:
            filename = str(section.get("filename", DEFAULT_JOURNAL))
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        pass  # no saved config (or an unreadable one): the default name
    return journal_file(run_dir, filename)


def journals_under(folder: Path) -> list[Path]:
    """Return the journals of the runs under ``folder``: each run folder's (its
    ``config.yaml`` names the file), and files with the default name in folders without a
    saved config."""
    runs = {p.parent for p in folder.rglob("config.yaml")} | {folder}
    found = {run_journal(run) for run in runs}
    found |= {p for p in folder.rglob(DEFAULT_JOURNAL) if not (p.parent / "config.yaml").exists()}
    return sorted(p for p in found if p is not None and p.is_file())


class Journal:
    """A run's journal, read by its service: its file, what reading it skipped, and the
    meta of old steps."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.stats: dict[str, Any] = {"skipped": 0, "duplicates": 0}
        self.index = None if path is None else JournalIndex(path)

    def holds_steps(self) -> bool:
        """Return True if the file exists and holds anything."""
        return self.path is not None and self.path.exists() and self.path.stat().st_size > 0

    def steps(self) -> Iterator[dict[str, Any]]:
        """Yield the latest segment's step records (counting what is skipped in ``stats``)."""
        if self.path is None or not self.path.exists():
            return iter(())
        return iter_journal(self.path, self.stats)

    def meta(self, step: int) -> dict[str, Any] | None:
        """Return the journaled meta of ``step`` (None: not journaled, or no journal)."""
        return None if self.index is None else self.index.meta(step)

    def line_count(self) -> int:
        """How many lines the journal holds now (a cut last line counts)."""
        count, last = 0, b"\n"
        with open(self.path, "rb") as fh:  # type: ignore[arg-type]
            while chunk := fh.read(1 << 20):
                count += chunk.count(b"\n")
                last = chunk[-1:]
        return count + (last != b"\n")

    def totals_at(self, step: int) -> dict[str, Any] | None:
        """The running totals journaled with the last step at or before ``step`` in the
        latest segment (each step's meta holds them all: None, none yet)."""
        if step < 0 or not self.holds_steps():
            return None
        totals = None
        for record in iter_journal(self.path):  # type: ignore[arg-type]
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


def iter_journal(path: str | os.PathLike[str], stats: dict[str, Any] | None = None,
                 lines: int | None = None) -> Iterator[dict[str, Any]]:
    """Yield the finished-step records of a journal's latest segment, one per step, in
    file order, holding one record at a time (a restart reads a bounded part of a long
    journal). ``lines``: the journal as its first so many lines have it (what a restart
    found: what is journaled later reaches the sinks through their queues).

    A ``rewind`` event (``{"event": {"rewind": {"to_step": k}}}``) starts a segment: the
    records past ``k`` before it are archived (kept in the file, left out here; a first
    pass finds the rewinds). Other events and blank lines are passed over; a line that is
    not a usable step record (a torn line, missing fields, a non-numeric value) is skipped
    with one warning naming file and line; of several records of one step the first is
    kept and the rest counted. ``stats`` (if given) receives ``skipped``, ``duplicates``
    and ``archived`` once the journal has been read through.
    """
    rewinds = _rewinds(path, lines)  # line -> the lowest step any later rewind goes back to
    seen: set[int] = set()
    duplicates: list[int] = []
    skipped = archived = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if lines is not None and number > lines:
                break
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


def _rewinds(path: str | os.PathLike[str], lines: int | None = None) -> list[tuple[int, int]]:
    """``(line, to_step)`` of each rewind event, with ``to_step`` the lowest of it and every
    later one (what a record before that line is archived past)."""
    found = [(number, rewind.to_step) for number, rewind in journal_rewinds(path, lines)]
    for i in range(len(found) - 2, -1, -1):
        found[i] = (found[i][0], min(found[i][1], found[i + 1][1]))
    return found


def _later_rewind(rewinds: list[tuple[int, int]], number: int) -> int | None:
    """The lowest step a rewind after line ``number`` goes back to, or None."""
    at = bisect.bisect_right(rewinds, (number, float("inf")))
    return rewinds[at][1] if at < len(rewinds) else None
