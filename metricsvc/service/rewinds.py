"""Rewinding a live run: resuming from the checkpoint of a step (the service's part).

A rewind is one operation over every part of the service, in this order: the journal
records it (synced; a rewind it lacks never happened), then the merge forgets what it
supersedes and continues the running totals from the last step at or before it, the
readers forget the superseded results, and every sink is given it in order with the steps
around it (``SinkDispatcher.rewind``; the run's history, ``metricsvc.storage.history``).
"""

from __future__ import annotations

import logging
from typing import Any

from metricsvc.service import continuing
from metricsvc.service.aggregator import Aggregator
from metricsvc.service.results import Results
from metricsvc.sinks import SinkDispatcher
from metricsvc.storage.history import Rewind
from metricsvc.storage.journal import Journal

log = logging.getLogger(__name__)


class Rewinds:
    """The service's rewinds, over the parts it holds (call under the actor's lock)."""

    def __init__(self, aggregator: Aggregator, journal: Journal, results: Results,
                 sinks: SinkDispatcher, reloaded_through: int | None) -> None:
        self.aggregator, self.journal, self.results, self.sinks = (aggregator, journal,
                                                                   results, sinks)
        # The last step the journal held when this incarnation reloaded it (None: a new run)
        self.reloaded_through = reloaded_through

    def rewind(self, to_step: int, by: str | None = None,
               held: int | None = None) -> dict[str, Any]:
        """Rewind to ``to_step``; return ``{"to_step", "superseded"}``. ``by`` and
        ``held``: a resume's (``Rewind``)."""
        self.sinks.rewind(Rewind(to_step, by, held), self.journal.writer)  # the journal first
        superseded = continuing.rewind(self.aggregator, to_step, self.totals_at(to_step))
        self.results.forget_after(to_step)
        if self.reloaded_through is not None:
            self.reloaded_through = min(self.reloaded_through, to_step)
        log.warning("rewound to step %d: %d published steps superseded", to_step, superseded)
        self.results.notify()
        return {"to_step": to_step, "superseded": superseded}

    def totals_at(self, step: int) -> dict[str, Any] | None:
        """The running totals as of the last published step at or before ``step``: what
        the readers keep of it, else the journal's record."""
        kept = [s for s in self.results.steps() if s <= step]
        if kept:
            return self.results.get(max(kept)).meta.get("derived_totals")  # type: ignore
        return self.journal.totals_at(step)


def resume_report(from_step: int, journal_through: int | None) -> dict[str, Any]:
    """What resuming a run from the checkpoint of ``from_step`` finds: the journal's last
    step (``journal_through``, None: it holds none) and, in ``unjournaled``, the steps after
    it up to ``from_step`` (``first``, ``last``, ``reason``; None where the journal reaches
    the checkpoint). The journal writes a step a moment after the step's ack, so a job that
    crashed right after its ranks' last acks can end before it held them: what the run
    finished of those steps is in no journal and no sink, and the rerun starts after them.
    (A run that logs every few steps may have had none of them.) Logged here;
    ``start_metric_worker`` warns the driver that resumes."""
    first = 0 if journal_through is None else journal_through + 1
    unjournaled = None
    if from_step >= first:
        span = f"step {first}" if from_step == first else f"steps {first}-{from_step}"
        held = ("holds no step of the run" if journal_through is None else
                f"holds the run only through step {journal_through}")
        unjournaled = {"first": first, "last": from_step, "reason": (
            f"resumed from step {from_step}, but the journal {held}: whatever the run "
            f"finished of {span} is in no journal and no sink (the run ended before its "
            f"journal wrote it; it writes each step a moment after the step's ack, and the "
            f"service's flush() waits for it); the rerun starts at step {from_step + 1}")}
        log.warning("%s", unjournaled["reason"])
    return {"from_step": from_step, "journal_through": journal_through,
            "unjournaled": unjournaled}
