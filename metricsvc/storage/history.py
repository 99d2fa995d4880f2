"""The run's history: its segments, and how far the journal and each sink hold the current
one.

A run is a sequence of segments. The first begins at step 0; each ``rewind(to_step=k)``
(a live rewind, or a resume from a checkpoint) begins another, in which the steps after
``k`` are recorded afresh. The journal's ``rewind`` events are the boundaries: the
journal's own content, so a restart or a resume reads the same history back.

For each sink the run folder keeps the last step it durably holds and the segment that
was current then (``SinkState``: ``<run folder>/sinks/<name>.json``, which a sink may also
use to continue the same backend run: wandb's and MLflow's run ids). What the sink holds
of the *current* segment is that step lowered by every rewind since (``holds_through``).
The journal's writer, every other sink's ``Watermark`` and the reload all ask this one
model whether a step is already written; none keeps its own idea.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metricsvc.core.keys import is_int, safe_file_name
from metricsvc.storage.files import LineFile, write_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rewind:
    """One segment boundary: steps after ``to_step`` are recorded afresh. ``by``: the
    actor that made it at its start (a resume), so that Ray restarting that actor does
    not rewind again past the rerun's steps; ``held``: the journal's last step then (-1:
    none; None: not recorded), so that every incarnation of it reports what the resume
    found (``health()["resume"]``)."""

    to_step: int
    by: str | None = None
    held: int | None = None

    def event(self) -> dict[str, dict[str, object]]:
        """The journal event that records it."""
        body: dict[str, object] = {"to_step": self.to_step}
        if self.by is not None:
            body["by"] = self.by
        if self.held is not None:
            body["held"] = self.held
        return {"rewind": body}


class RunHistory:
    """The segments of a run, oldest first (segment ``i`` begins after ``rewinds[i-1]``)."""

    def __init__(self, rewinds: Iterable[Rewind] = ()) -> None:
        self.rewinds = list(rewinds)

    @classmethod
    def read(cls, journal: str | os.PathLike[str] | None) -> RunHistory:
        """The history a journal records (none, or no journal: one segment)."""
        if journal is None or not os.path.exists(journal):
            return cls()
        return cls(rewind for _, rewind in journal_rewinds(journal))

    @property
    def segment(self) -> int:
        """The current segment's number (0: the run was never rewound)."""
        return len(self.rewinds)

    def rewound(self, rewind: Rewind) -> None:
        """Begin a new segment."""
        self.rewinds.append(rewind)

    def made_by(self, actor: str | None) -> Rewind | None:
        """The rewind ``actor`` made of this run at its start, if it made one."""
        return next((r for r in self.rewinds if actor is not None and r.by == actor), None)

    def holds_through(self, through: int | None, segment: int) -> int | None:
        """The last step of the current segment a place holds that held ``through`` (None:
        nothing) when segment ``segment`` was current."""
        for rewind in self.rewinds[max(segment, 0):]:
            if through is not None and through > rewind.to_step:
                through = rewind.to_step if rewind.to_step >= 0 else None
        return through


def rewind_of(line: str) -> Rewind | None:
    """The rewind a journal line records, or None for any other line."""
    if '"rewind"' not in line:
        return None
    try:
        body = json.loads(line)["event"]["rewind"]
        to_step = body["to_step"]
    except (ValueError, KeyError, TypeError):
        return None
    if not is_int(to_step):
        return None
    by, held = body.get("by"), body.get("held")
    return Rewind(to_step, by if isinstance(by, str) else None, held if is_int(held) else None)


def journal_rewinds(path: str | os.PathLike[str]) -> Iterator[tuple[int, Rewind]]:
    """Yield ``(line number, rewind)`` of each rewind event in a journal, in file order."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            rewind = rewind_of(line)
            if rewind is not None:
                yield number, rewind


# -- each sink's place in it -----------------------------------------------------------
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
    """A sink's progress in the run's history: the last step written in the current segment
    (``last_step``), the newest step its backend has made durable (``durable_through``, kept
    with the segment current then in its ``SinkState``), where this incarnation started
    from (``floor``: what the sink holds of the current segment), and the steps the saved
    watermark claims but the content lacks (``missing``, reported until written)."""

    def __init__(self, state: SinkState, name: str, redact: Callable[[str], str],
                 history: RunHistory | None = None) -> None:
        self.state, self.name, self.redact = state, name, redact
        self.history = history or RunHistory()
        self.last_step: int | None = None
        self.durable_through: int | None = None
        self.missing: dict[str, Any] | None = None
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
        self.floor = self.durable_through = self.history.holds_through(through, segment)
        self.missed = self.history.rewinds[max(segment, 0):]
        return self.floor

    def caught_up(self) -> None:
        """The sink was given the rewinds it missed: save its watermark in the current
        segment, so that a later restart does not give them again."""
        if self.missed:
            self.missed = []
            self._save(self.durable_through)

    def believe_content(self, held: int | None) -> None:
        """The sink read back what it holds of the current segment (``held``: its last
        step): believe that, not the saved watermark, which past the content would make it
        skip steps for good."""
        if self.floor is not None and (held is None or held < self.floor):
            first = 0 if held is None else held + 1
            self.missing = {
                "steps": list(range(first, min(self.floor, first + 999) + 1)),
                "count": self.floor - first + 1,
                "reason": f"the watermark said the file held steps through {self.floor}, "
                          f"but it ends at {held} (a torn, cut or lost tail); a step ranks "
                          f"send again is written again"}
            log.error("sink %s: %s", self.name, self.missing["reason"])
        self.floor = self.durable_through = held

    def holds(self, step: int) -> bool:
        """Return True if the sink already holds ``step`` of the current segment."""
        last = self.floor if self.last_step is None else self.last_step
        return last is not None and step <= last

    def written(self, step: int) -> None:
        """Count ``step`` as written in the current segment: it is no longer missing."""
        self.last_step = step
        missing = self.missing
        if missing is not None and step in missing["steps"]:
            missing["steps"].remove(step)
            missing["count"] -= 1
            if not missing["count"]:
                self.missing = None

    def advance(self, through: int | None) -> None:
        """Save ``through`` as durable, if it is progress."""
        known = self.durable_through
        if through is None or through < 0 or (known is not None and through <= known):
            return  # nothing durable yet, or no progress
        self._save(through)
        self.durable_through = through

    def back_to(self, step: int) -> None:
        """A new segment begins after ``step`` (a rewind): the sink holds at most ``step``
        of it; saved too, so a restart replays the rerun."""
        self.segment += 1
        held = None if step < 0 else step
        if self.last_step is not None and self.last_step > step:
            self.last_step = held
        if self.durable_through is not None and self.durable_through > step:
            self.durable_through = held
        if self.floor is not None and self.floor > step:
            self.floor = held
        self._save(self.durable_through)

    def report(self) -> dict[str, Any]:
        """What ``health()`` shows of it."""
        return {"last_step": self.last_step, "durable_through": self.durable_through,
                "missing": self.missing}

    def _save(self, through: int | None) -> None:
        try:
            self.state.update(durable_through=through, segment=self.segment)
        except OSError as err:
            log.error("sink %s: its watermark could not be saved: %s", self.name,
                      self.redact(str(err)))


