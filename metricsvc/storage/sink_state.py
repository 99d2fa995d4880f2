"""What a sink keeps in the run folder: its state, so that a restarted service continues
it, and the dead letters of the steps it could not take.

One small file of JSON lines per sink, ``<run folder>/sinks/<name>.json``: the dispatcher
keeps the sink's watermark there (``durable_through``: the newest step the backend has
made durable), and a sink may keep what it needs to continue the same backend run (wandb's
run id, MLflow's run id). Each update is one appended line of the fields it sets (the
watermark moves every step: a file replaced per step cost more than the step's merge);
reading folds the lines in order, leaving out a line a crash tore. Past ``_COMPACT_BYTES``
the file is replaced atomically by the one line of its folded record.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from metricsvc.core.keys import safe_file_name
from metricsvc.core.limits import is_int
from metricsvc.storage.files import LineFile, write_atomic
from metricsvc.storage.history import Rewind, RunHistory

log = logging.getLogger(__name__)

_COMPACT_BYTES = 1 << 16  # about 1500 watermark lines


class SinkState:
    """The durable record of sink ``name`` in ``run_dir``; read and written by its thread."""

    def __init__(self, run_dir: Path, name: str) -> None:
        self.path = Path(run_dir) / "sinks" / f"{safe_file_name(name)}.json"

    def load(self) -> dict[str, Any]:
        """Return the record: every line's fields, later lines over earlier ones ({} when
        none was written or the file cannot be read; a torn or foreign line is skipped)."""
        try:
            lines = self.path.read_bytes().splitlines()
        except OSError:
            return {}
        data: dict[str, Any] = {}
        for line in lines:
            try:
                part = json.loads(line)
            except ValueError:
                continue
            if isinstance(part, dict):
                data.update(part)
        return data

    def update(self, **values: Any) -> None:
        """Merge ``values`` into the record: one appended line (on a line of its own after
        a torn one), or the folded record written whole once the file is long."""
        line = json.dumps(values).encode() + b"\n"
        try:
            file = LineFile(self.path)
        except FileNotFoundError:  # the first update of this run folder
            self.path.parent.mkdir(parents=True, exist_ok=True)
            file = LineFile(self.path)
        try:
            if file.size() + len(line) <= _COMPACT_BYTES:
                file.append(line)
                return
        finally:
            file.close()
        write_atomic(self.path, json.dumps({**self.load(), **values}) + "\n")


class Watermark:
    """A sink's durable progress in the run's history (``metricsvc.storage.history``): the newest
    step its backend has made durable and the segment that was current then (kept in its
    ``SinkState``), where this incarnation started from (``floor``: what the sink holds of
    the current segment), and the steps the saved watermark claims but the content lacks
    (reported until they are written). Its figures live in the sink's delivery record
    (``stats``)."""

    def __init__(self, state: SinkState, stats: dict, name: str,
                 redact: Callable[[str], str], history: RunHistory | None = None) -> None:
        self.state, self.stats, self.name, self.redact = state, stats, name, redact
        self.history = history or RunHistory()
        self.segment = self.history.segment  # advanced by each rewind this sink is given
        self.floor: int | None = None
        # The rewinds the journal recorded after the saved watermark's segment: the sink
        # may never have been given them (the service ended between the two), so its
        # backend may still show the steps they superseded (``load``)
        self.missed: list[Rewind] = []

    def load(self) -> int | None:
        """Start from the saved watermark (a restart), lowered by every rewind since it was
        saved; return it."""
        saved = self.state.load()
        through, segment = saved.get("durable_through"), saved.get("segment", 0)
        if not is_int(through):
            through = None
        if not isinstance(segment, int):
            segment = 0
        self.floor = self.stats["durable_through"] = self.history.holds_through(through,
                                                                                segment)
        self.missed = self.history.rewinds[max(segment, 0):]
        return self.floor

    def caught_up(self) -> None:
        """The sink was given the rewinds it missed: save its watermark in the current
        segment, so that a later restart does not give them again."""
        if self.missed:
            self.missed = []
            self._save(self.stats["durable_through"])

    def believe_content(self, held: int | None) -> None:
        """The sink read back what it holds of the current segment (``held``: its last
        step): believe that, not the saved watermark, which past the content would make it
        skip steps for good."""
        if self.floor is not None and (held is None or held < self.floor):
            first = 0 if held is None else held + 1
            self.stats["missing"] = {
                "steps": list(range(first, min(self.floor, first + 999) + 1)),
                "count": self.floor - first + 1,
                "reason": f"the watermark said the file held steps through {self.floor}, "
                          f"but it ends at {held} (a torn, cut or lost tail); a step ranks "
                          f"send again is written again"}
            log.error("sink %s: %s", self.name, self.stats["missing"]["reason"])
        self.floor = self.stats["durable_through"] = held

    def holds(self, step: int) -> bool:
        """Return True if the sink already holds ``step`` of the current segment."""
        last = self.stats["last_step"]
        last = self.floor if last is None else last
        return last is not None and step <= last

    def written(self, step: int) -> None:
        """Count ``step`` as written: it is no longer missing."""
        missing = self.stats["missing"]
        if missing is not None and step in missing["steps"]:
            missing["steps"].remove(step)
            missing["count"] -= 1
            if not missing["count"]:
                self.stats["missing"] = None

    def advance(self, through: int | None) -> None:
        """Save ``through`` as durable, if it is progress."""
        known = self.stats["durable_through"]
        if through is None or through < 0 or (known is not None and through <= known):
            return  # nothing durable yet, or no progress
        self._save(through)
        self.stats["durable_through"] = through

    def back_to(self, step: int) -> None:
        """A new segment begins after ``step`` (a rewind): the sink holds at most ``step``
        of it; saved too, so a restart replays the rerun."""
        self.segment += 1
        held = None if step < 0 else step
        for field in ("last_step", "durable_through"):
            if self.stats[field] is not None and self.stats[field] > step:
                self.stats[field] = held
        if self.floor is not None and self.floor > step:
            self.floor = held
        self._save(self.stats["durable_through"])

    def _save(self, through: int | None) -> None:
        try:
            self.state.update(durable_through=through, segment=self.segment)
        except OSError as err:
            log.error("sink %s: its watermark could not be saved: %s", self.name,
                      self.redact(str(err)))


class DeadLetter:
    """Append-only JSONL of steps a sink could not take; shared by every sink thread.

    A line is written whole or not at all (``LineFile``): a disk error leaves no torn line.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: LineFile | None = None

    def write(self, sink: str, step: int | None, payload: dict[str, Any], error: str) -> None:
        line = {"sink": sink, "step": step, **payload, "error": error, "time": time.time()}
        text = json.dumps(line, default=str) + "\n"
        with self._lock:
            if self._file is None:
                self._file = LineFile(self.path)
            self._file.append(text.encode("utf-8"))
