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
The journal's writer, every other sink's ``Watermark`` (``sinks.dispatch``) and the
reload all ask this one model whether a step is already written; none keeps its own idea.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from metricsvc.core.keys import is_int

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
    # {stream: {client: seq}}: the stream batches it settled (exported into the steps it
    # superseded: never merged again, so never resent; ``StreamLedger.superseded``)
    streams: dict[str, dict[str, int]] | None = None

    def event(self) -> dict[str, dict[str, object]]:
        """The journal event that records it."""
        body: dict[str, object] = {"to_step": self.to_step}
        if self.by is not None:
            body["by"] = self.by
        if self.held is not None:
            body["held"] = self.held
        if self.streams:
            body["streams"] = self.streams
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
    by, held, streams = body.get("by"), body.get("held"), body.get("streams")
    return Rewind(to_step, by if isinstance(by, str) else None, held if is_int(held) else None,
                  streams if isinstance(streams, dict) else None)


def journal_rewinds(path: str | os.PathLike[str],
                    lines: int | None = None) -> Iterator[tuple[int, Rewind]]:
    """Yield ``(line number, rewind)`` of each rewind event in a journal (its first
    ``lines`` lines, if given), in file order."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if lines is not None and number > lines:
                break
            rewind = rewind_of(line)
            if rewind is not None:
                yield number, rewind


# -- each sink's place in it -----------------------------------------------------------
