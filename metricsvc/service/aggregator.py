"""Step state machine (Python and numpy: no Ray, no pydantic): batches in, finished steps
out.

A step is final when ``world_size`` distinct ranks have sent a ``final`` batch
for it, or when its straggler timeout passes (counted from its first batch;
then it is *partial*). Finished steps leave strictly in step order. Retries
are idempotent on ``(step, rank, seq)``; a batch for a step already emitted is
a *duplicate* if its rank closed that step, else *late*: counted, reported,
never merged into a published value. Stream windows (no step barrier) are
merged apart and folded into the step the driver names at export.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from metricsvc.core.batch import Batch
from metricsvc.core.declare import decode_derived
from metricsvc.core.errors import BatchRejected
from metricsvc.core.limits import MAX_PENDING_STEPS, MAX_STEPS_AHEAD, Limits
from metricsvc.core.reduce import OutputRules, ReduceType
from metricsvc.core.step_result import StepResult
from metricsvc.core.wire import as_batch, encode
from metricsvc.service.admission import Admission
from metricsvc.service.derive import Deriver
from metricsvc.service.output import StepOutput, TagOwners
from metricsvc.service.pending import PendingSteps
from metricsvc.service.published import (
    AFTER_CLOSE,
    RESENT_OTHERWISE,
    Published,
    Status,
    conflict_message,
)
from metricsvc.service.ranks import LagWatch, Notices, WorldSize
from metricsvc.service.run_declarations import RunDeclarations
from metricsvc.service.step import PendingStep
from metricsvc.service.streams import Streams

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Outcome:
    """What ``Aggregator.submit`` did with a batch, and the steps it finished."""

    status: Status
    finished: list[StepResult] = field(default_factory=list)
    notice: str | None = None  # something the sender must hear about an earlier batch
    batch: Batch | None = None  # the batch as decoded


class Aggregator:
    """Merge batches into steps and hand out finished steps in order. Each part of the
    job is a component it holds: the open steps (``pending``), the published ones
    (``published``), stream windows (``streams``), the world size and lagging ranks
    (``world``, ``lag``), admission, derivation and output; its health is
    ``metricsvc.service.health``."""

    def __init__(
        self,
        *,
        straggler_timeout_s: float | None = None,
        max_pending_steps: int = MAX_PENDING_STEPS,
        max_steps_ahead: int = MAX_STEPS_AHEAD,
        world_size: int | None = None,
        limits: Limits | None = None,
        reduce_rules: Mapping[str, ReduceType | str] | None = None,
        renames: Mapping[str, str] | None = None,
        output: OutputRules | None = None,
        remember_steps: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.straggler_timeout_s = straggler_timeout_s
        # The run's world size: from config, else agreed by a majority of the size ranks
        # claim (no step can finish before), else from the journal after a restart.
        self.world = WorldSize(world_size)
        self.notices = Notices()  # what each rank hears with its next ack
        self.limits = limits or Limits()
        self.output = output or OutputRules()
        self.deriver = Deriver(self.limits.max_derived_outputs, self.limits.max_derived_reads)
        self.declarations = RunDeclarations()  # one definition of a derived metric a run
        self.admission = Admission(self.limits, max_pending_steps, max_steps_ahead,
                                   self.deriver, self.output.sketch.alpha)
        self.out = StepOutput(self.output, reduce_rules, renames, self.deriver,
                              self.declarations, clock)
        self._tags = TagOwners()  # which key each sink tag shows, for the run
        self._clock = clock
        self.pending = PendingSteps()
        # Ranks that closed each emitted step, and (for the newest) the digests of their
        # batches: a byte-identical resend is a duplicate, other content a conflict.
        self.published = Published(remember_steps)
        self.last_emitted: int | None = None
        self.newest_closed: int | None = None
        self.rank_last_seen: dict[int, int] = {}
        self.late_by_rank: Counter[int] = Counter()
        self.lag = LagWatch()
        self.counts = {"batches": 0, "duplicate": 0, "late": 0, "rejected": 0, "partial": 0,
                       "stream_batches": 0, "conflict": 0, "dropped": 0, "collisions": 0}
        self.streams = Streams(self.admission, self.counts)  # stream windows, merged apart

    # -- input -------------------------------------------------------------------------
    def submit(self, item: Batch | bytes) -> Outcome:
        """Merge one batch (or its wire bytes); return its status and any steps that became
        final.

        Raises:
            BatchRejected: the batch is malformed, contradicts its step or the run (world
                size, a conflicting resend, too far ahead); nothing of it was merged and no
                state changed.
        """
        try:
            batch = self.admission.check(as_batch(item, self.limits))
        except BatchRejected:
            self.counts["rejected"] += 1
            raise
        notice = self.notices.take(batch.rank)
        try:
            self.world.check(batch)
            # What tells a resend (a duplicate) from other content under the same identity
            # (a conflict): the wire bytes' digest, never compared on the merge path.
            wire = item if isinstance(item, (bytes, bytearray, memoryview)) else encode(batch)
            outcome = self._submit(batch, hashlib.sha1(wire).digest())
        except BatchRejected as err:
            self.counts["rejected"] += 1
            if notice is not None:
                raise BatchRejected(f"{err}; earlier: {notice}") from None
            raise
        fresh = self.notices.take(batch.rank)  # what this batch itself made the rank owe
        if fresh is not None:
            notice = fresh if notice is None else f"{notice}; {fresh}"
        return Outcome(outcome.status, outcome.finished, notice, batch)

    # -- the run's world size ------------------------------------------------------------
    def _fix_world_size(self, world_size: int, source: str) -> None:
        """Fix the run's world size; drop what ranks claiming another size sent so far."""
        self.world.fix(world_size, source)
        self.pending.regroup(world_size, lambda step, rank, claim: self._drop(
            rank, f"your batch for step {step} was dropped: rank {rank} claimed world_size "
                  f"{claim}, but the run's world size is {world_size} ({source})"))
        self._refresh_newest_closed()

    def _refresh_newest_closed(self) -> None:
        """Recompute the newest step a rank closed, after pending steps were dropped."""
        self.newest_closed = self.pending.newest_closed(self.last_emitted)

    def _drop(self, rank: int, why: str) -> None:
        """Drop an accepted batch of ``rank``; the rank hears why at its next call."""
        self.counts["dropped"] += 1
        self.notices.tell(rank, why)
        log.warning("rank %d: %s", rank, why)

    def _conflict(self, batch: Batch, what: str, final: bool = False) -> BatchRejected:
        self.counts["conflict"] += 1
        return BatchRejected(conflict_message(batch, what, final))

    # -- steps -----------------------------------------------------------------------------
    def _submit(self, batch: Batch, digest: bytes) -> Outcome:
        step = batch.step
        pending = self.pending.get(step)
        if pending is None:
            if self.last_emitted is not None and step <= self.last_emitted:
                return self._after_emitted(batch, digest)
            target = self._open(step, f"rank {batch.rank}")
        else:
            known = pending.digests.get((batch.rank, batch.seq))
            if known == digest:
                self.counts["duplicate"] += 1
                return Outcome("duplicate")
            if known is not None:
                raise self._conflict(batch, RESENT_OTHERWISE)
            if batch.rank in pending.closed:
                raise self._conflict(batch, AFTER_CLOSE)
            target = pending
        declared = decode_derived(batch.derived)  # cached: checked by admission
        ignored = self.declarations.check(declared, step, batch.rank)
        if declared:
            self.admission.check_cost(batch, declared,
                                      pending.keys if pending is not None else ())
        idx = target.check(batch)
        if batch.final:
            self._check_lag(batch.rank, step)
        fresh = np.flatnonzero(idx < 0)  # keys new to the step: the only ones new to the run
        self.pending[step] = target
        target.add_batch(batch, idx, digest)
        if fresh.size:
            said = self._tags.notice([batch.keys[i] for i in fresh])
            if said is not None:
                self.notices.tell(batch.rank, said)
        if ignored is not None:  # its data merged, its declaration not: it hears why
            self.notices.tell(batch.rank, ignored)
        for rank in self.declarations.adopt(declared, step, batch.rank):
            self.notices.tell(rank, f"step {step}: rank {batch.rank} declares a derived metric you "
                             f"declared otherwise; the lower rank's is the run's, yours is "
                             f"ignored and your data merged")
        self.counts["batches"] += 1
        self.rank_last_seen[batch.rank] = max(step, self.rank_last_seen.get(batch.rank, step))
        if batch.final and (self.newest_closed is None or step > self.newest_closed):
            self.newest_closed = step
        if pending is None:
            self._drop_far_ahead()
        if self.world_size is None:  # kept apart until the world size is agreed
            target.keep_source(batch.world_size, batch.rank,
                               lambda p, b=batch, d=digest: p.add_batch(b, p.check(b), d))
            source = self.world.claim(batch)
            if source is not None:
                self._fix_world_size(batch.world_size, source)
        return Outcome("merged", self._emit_ready())

    def _check_lag(self, rank: int, step: int) -> None:
        following = self.pending.get(step + 1)
        said = self.lag.check(rank, step, None if following is None else following.closed,
                              self.world_size)
        if said is not None:
            self.notices.tell(rank, said)

    def _after_emitted(self, batch: Batch, digest: bytes) -> Outcome:
        status, what = self.published.judge(batch, digest)
        if status == "late":
            self.counts["late"] += 1
            self.late_by_rank[batch.rank] += 1
            return Outcome("late")
        if status == "duplicate":
            self.counts["duplicate"] += 1
            return Outcome("duplicate")
        raise self._conflict(batch, what, final=True)

    def _open(self, step: int, who: str) -> PendingStep:
        """Return a new step that ``who`` opens, once admitted (not too far ahead, room)."""
        self.admission.check_ahead(step, who, self.pending.anchor(self.last_emitted))
        self.admission.check_room(step, self.pending)
        return PendingStep(step, self.world_size, self._clock())

    def _drop_far_ahead(self) -> None:
        """Drop steps a runaway opened before the run's first step did (nothing emitted yet)."""
        if self.last_emitted is not None:
            return
        for step, why in self.admission.far_ahead(list(self.pending)):
            for rank in self.pending.pop(step).ranks:
                self._drop(rank, f"your batch for step {step} was dropped: {why}")
        self._refresh_newest_closed()

    # -- time --------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> list[StepResult]:
        """Finish, as partial, every step whose straggler timeout has passed."""
        if self.straggler_timeout_s is None or not self.pending:
            return []
        now = self._clock() if now is None else now
        late = self.pending.time_out(now, self.straggler_timeout_s)
        choice = self.world.at_timeout()
        if choice is not None and late:
            self._fix_world_size(*choice)  # no majority came in time
            self.pending.time_out(now, self.straggler_timeout_s, recount=True)
        return self._emit_ready()

    # -- output ------------------------------------------------------------------------
    def _emit_ready(self) -> list[StepResult]:
        out: list[StepResult] = []
        while self.pending:
            step = min(self.pending)
            pending = self.pending[step]
            if not pending.ready:
                break
            result = self.out.finish(pending, self.lag.lagging)
            self.counts["partial"] += result.meta["partial"]
            self.counts["collisions"] += "collisions" in result.meta
            out.append(result)  # before forgetting it: a raise loses nothing
            del self.pending[step]
            self.last_emitted = step
            self.published.add(step, frozenset(pending.closed), pending.digests)
        return out

    # -- streams -------------------------------------------------------------------------
    def export_stream(self, name: str, step: int,
                      close: bool = False) -> tuple[dict, list[StepResult]]:
        """Fold the window of stream ``name`` into ``step`` and start a new window.

        Returns the window's metrics and the steps that became final. With ``close=True``
        a step no rank has submitted becomes final with the window alone (streams without
        training ranks). Raises ``BatchRejected`` (and keeps the window) if the step is
        already final or the window cannot merge into it.
        """
        if self.last_emitted is not None and step <= self.last_emitted:
            raise BatchRejected(
                f"stream {name!r}: step {step} is already final (last final step "
                f"{self.last_emitted}); export before the ranks close it, or name a later step"
            )
        target = self.pending.get(step)
        target = self._open(step, f"stream {name!r}") if target is None else target
        window, fold = self.streams.fold_into(name, step, target, self.declarations)
        self.pending[step] = target
        if self.world_size is None:
            target.keep_source(None, None, fold)
        target.stream_only = target.stream_only or close
        return self.out.preview(window), self._emit_ready()

    @property
    def world_size(self) -> int | None:
        """The run's world size (None until agreed)."""
        return self.world.size
