"""Step state machine (pure Python and numpy, no Ray): batches in, finished steps out.

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
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from metricsvc.declare import decode_derived, is_internal
from metricsvc.derive import Deriver
from metricsvc.keys import safe_tag, tag_order
from metricsvc.records import COUNT, M2_ROOT, MAX, MIN, NONFINITE, SUM, Batch
from metricsvc.reduce import (
    AUTO,
    KINDS,
    KindResolver,
    OutputRules,
    ReduceType,
    Renamer,
    finalize,
    is_approximate_plain_key,
)
from metricsvc.run_declarations import RunDeclarations
from metricsvc.sketch import histogram
from metricsvc.step import Part, PendingStep, Window
from metricsvc.validation import BatchRejected, KeyCache, Limits, check_batch
from metricsvc.wire import as_batch, encode

log = logging.getLogger(__name__)

Status = Literal["merged", "duplicate", "late"]
_STREAM_RANK = 1 << 30  # streams declare after every rank: a rank's declaration goes first
DIGEST_STEPS = 64  # emitted steps whose batch digests are kept to tell resends from conflicts


@dataclass(frozen=True)
class StepResult:
    """A finished step: exported metrics and what is known about how they were made."""

    step: int
    metrics: dict[str, float]
    meta: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """What ``Aggregator.submit`` did with a batch, and the steps it finished."""

    status: Status
    finished: list[StepResult] = field(default_factory=list)
    notice: str | None = None  # something the sender must hear about an earlier batch
    batch: Batch | None = None  # the batch as decoded


class Aggregator:
    """Merge batches into steps and hand out finished steps in order."""

    def __init__(
        self,
        *,
        straggler_timeout_s: float | None = None,
        max_pending_steps: int = 64,
        max_steps_ahead: int = 32,
        world_size: int | None = None,
        limits: Limits | None = None,
        reduce_rules: Mapping[str, ReduceType | str] | None = None,
        renames: Mapping[str, str] | None = None,
        output: OutputRules | None = None,
        remember_steps: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.straggler_timeout_s = straggler_timeout_s
        self.max_pending_steps = max_pending_steps
        self.max_steps_ahead = max_steps_ahead
        # The run's world size: from config, else agreed by a majority of the size ranks
        # claim (no step can finish before), else from the journal after a restart.
        self.world_size = world_size
        self.world_source = "config" if world_size is not None else None
        self._claims: dict[int, int] = {}  # rank -> the world size it claims, until agreed
        self._notices: dict[int, str] = {}  # rank -> why an accepted batch of it was dropped
        self.limits = limits or Limits()
        self.output = output or OutputRules()
        self._resolver = KindResolver(reduce_rules)
        self._rename = Renamer(renames)
        self.deriver = Deriver(self.limits.max_derived_outputs, self.limits.max_derived_reads)
        self._costs: dict[bytes, tuple[int, int]] = {}  # declarations -> (outputs, reads)
        self.declarations = RunDeclarations()  # one definition of a derived metric a run
        self._tags = TagOwners()  # which key each sink tag shows, for the run
        self._key_cache = KeyCache()
        self._clock = clock
        self._pending: dict[int, PendingStep] = {}
        self._windows: dict[str, Window] = {}
        self._exports = 0
        # Ranks that closed each emitted step, and (for the newest) the digests of their
        # batches: a byte-identical resend is a duplicate, other content a conflict.
        self._emitted: OrderedDict[int, tuple[frozenset[int], dict | None]] = OrderedDict()
        self._remember_steps = remember_steps
        self.last_emitted: int | None = None
        self.newest_closed: int | None = None
        self.rank_last_seen: dict[int, int] = {}
        self.late_by_rank: Counter[int] = Counter()
        self._lagging: Counter[int] = Counter()  # rank -> closes in a row behind the others
        self.counts = {"batches": 0, "duplicate": 0, "late": 0, "rejected": 0, "partial": 0,
                       "stream_batches": 0, "conflict": 0, "dropped": 0, "collisions": 0}

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
            batch = self._checked(as_batch(item, self.limits))
        except BatchRejected:
            self.counts["rejected"] += 1
            raise
        notice = self._notices.pop(batch.rank, None)
        try:
            self._check_world_size(batch)
            # What tells a resend (a duplicate) from other content under the same identity
            # (a conflict): the wire bytes' digest, never compared on the merge path.
            wire = item if isinstance(item, (bytes, bytearray, memoryview)) else encode(batch)
            outcome = self._submit(batch, hashlib.sha1(wire).digest())
        except BatchRejected as err:
            self.counts["rejected"] += 1
            if notice is not None:
                raise BatchRejected(f"{err}; earlier: {notice}") from None
            raise
        fresh = self._notices.pop(batch.rank, None)  # what this batch itself made the rank owe
        if fresh is not None:
            notice = fresh if notice is None else f"{notice}; {fresh}"
        return Outcome(outcome.status, outcome.finished, notice, batch)

    def decode(self, item: Batch | bytes) -> Batch:
        """Return the Batch that ``item`` is or encodes; malformed bytes count as rejected."""
        try:
            return as_batch(item, self.limits)
        except BatchRejected:
            self.counts["rejected"] += 1
            raise

    def _checked(self, batch: Batch) -> Batch:
        batch = check_batch(batch, self.limits, self._key_cache)
        try:
            decode_derived(batch.derived)  # checked once here; cached for the step
        except (TypeError, ValueError) as err:
            raise BatchRejected(f"step {batch.step} rank {batch.rank}: {err}") from None
        if batch.sketch_rows.size and batch.sketch_alpha != self.output.sketch.alpha:
            key = batch.keys[int(batch.sketch_rows[0])]
            raise BatchRejected(
                f"key {key!r}: quantile sketch alpha {batch.sketch_alpha} from rank "
                f"{batch.rank} cannot merge with the service's alpha {self.output.sketch.alpha}"
            )
        return batch

    # -- the run's world size ------------------------------------------------------------
    def _check_world_size(self, batch: Batch) -> None:
        if self.world_size is not None:
            if batch.world_size != self.world_size:
                raise BatchRejected(
                    f"step {batch.step}: rank {batch.rank} sent world_size {batch.world_size}, "
                    f"but the run's world size is {self.world_size} ({self.world_source})"
                )
            return
        claimed = self._claims.get(batch.rank, batch.world_size)
        if claimed != batch.world_size:
            raise BatchRejected(
                f"step {batch.step}: rank {batch.rank} sent world_size {batch.world_size}, but "
                f"claimed {claimed} before (the run's world size is not agreed yet)"
            )

    def _claim(self, batch: Batch) -> None:
        """Count a rank's claim; fix the world size once a majority of a claimed size agree."""
        self._claims[batch.rank] = batch.world_size
        agree = sorted(r for r, w in self._claims.items() if w == batch.world_size)
        if len(agree) >= batch.world_size // 2 + 1:
            self._fix_world_size(batch.world_size, f"agreed by ranks {agree}")

    def _fix_world_size(self, world_size: int, source: str) -> None:
        """Fix the run's world size; drop what ranks claiming another size sent so far."""
        self.world_size, self.world_source = world_size, source
        log.warning("the run's world size is %d (%s)", world_size, source)
        for step, pending in list(self._pending.items()):
            sources, pending.sources = pending.sources, None
            if sources is None or all(w in (None, world_size) for w, _, _ in sources):
                pending.world_size = world_size if pending.ranks else pending.world_size
                continue
            fresh = PendingStep(step, world_size, pending.opened_at)
            fresh.stream_only = pending.stream_only
            for claim, rank, apply in sources:
                if claim in (None, world_size):
                    apply(fresh)
                else:
                    self._drop(rank, f"your batch for step {step} was dropped: rank {rank} "
                                     f"claimed world_size {claim}, but the run's world size "
                                     f"is {world_size} ({source})")
            if fresh.parts:
                self._pending[step] = fresh
            else:
                del self._pending[step]
        self._claims.clear()
        self._refresh_newest_closed()

    def _refresh_newest_closed(self) -> None:
        """Recompute the newest step a rank closed, after pending steps were dropped."""
        closed = [s for s, p in self._pending.items() if p.closed]
        if self.last_emitted is not None:
            closed.append(self.last_emitted)
        self.newest_closed = max(closed, default=None)

    def _drop(self, rank: int, why: str) -> None:
        """Drop an accepted batch of ``rank``; the rank hears why at its next call."""
        self.counts["dropped"] += 1
        self._notices[rank] = why
        log.warning("rank %d: %s", rank, why)

    def _conflict(self, batch: Batch, what: str) -> BatchRejected:
        self.counts["conflict"] += 1
        return BatchRejected(
            f"step {batch.step}: conflict: rank {batch.rank} seq {batch.seq} {what} "
            f"(two clients with rank {batch.rank}? only a byte-identical resend is a duplicate)"
        )

    # -- steps -----------------------------------------------------------------------------
    def _submit(self, batch: Batch, digest: bytes) -> Outcome:
        step = batch.step
        pending = self._pending.get(step)
        if pending is None:
            if self.last_emitted is not None and step <= self.last_emitted:
                return self._after_emitted(batch, digest)
            self._check_ahead(step, f"rank {batch.rank}")
            self._check_room(step)
        else:
            known = pending.digests.get((batch.rank, batch.seq))
            if known == digest:
                self.counts["duplicate"] += 1
                return Outcome("duplicate")
            if known is not None:
                raise self._conflict(batch, "was already received with other content")
            if batch.rank in pending.closed:
                raise self._conflict(batch, "comes after the rank already closed this step")
        declared = decode_derived(batch.derived)  # cached: checked in _checked
        self.declarations.check(declared, step, batch.rank)
        if declared:
            self._check_cost(batch, declared, pending)
        target = pending or PendingStep(step, self.world_size, self._clock())
        idx = target.check(batch)
        if batch.final:
            self._check_lag(batch.rank, step)
        fresh = np.flatnonzero(idx < 0)  # keys new to the step: the only ones new to the run
        self._pending[step] = target
        target.add_batch(batch, idx, digest)
        if fresh.size:
            said = self._tags.notice([batch.keys[i] for i in fresh])
            if said is not None:
                self._notices[batch.rank] = said
        for rank in self.declarations.adopt(declared, step, batch.rank):
            self._notices[rank] = (f"step {step}: rank {batch.rank} declares a derived metric "
                                   f"you declared otherwise; the lower rank's is the run's")
        self.counts["batches"] += 1
        self.rank_last_seen[batch.rank] = max(step, self.rank_last_seen.get(batch.rank, step))
        if batch.final and (self.newest_closed is None or step > self.newest_closed):
            self.newest_closed = step
        if pending is None:
            self._drop_far_ahead()
        if self.world_size is None:  # kept apart until the world size is agreed
            target.keep_source(batch.world_size, batch.rank,
                               lambda p, b=batch, d=digest: p.add_batch(b, p.check(b), d))
            self._claim(batch)
        return Outcome("merged", self._emit_ready())

    def _check_cost(self, batch: Batch, declared: tuple, pending: PendingStep | None) -> None:
        """Refuse declarations whose work or outputs would pass the limits, over the keys
        the step holds so far and the batch's (once per distinct set of declarations: ranks
        send the same every step). Finishing a step keeps to the same budget whatever
        keys come later (``Deriver.derive``)."""
        limits = self.limits
        if len(declared) > limits.max_declarations:
            raise BatchRejected(
                f"step {batch.step}: rank {batch.rank} declares {len(declared)} derived "
                f"metrics; the limit is limits.max_declarations={limits.max_declarations}")
        cost = self._costs.get(batch.derived)
        if cost is None:
            keys = [*batch.keys, *(pending.keys if pending is not None else ())]
            cost = self.deriver.cost(declared, keys)
            if len(self._costs) >= 256:
                self._costs.clear()
            self._costs[batch.derived] = cost
        outputs, reads = cost
        what = None
        if outputs > limits.max_derived_outputs:
            what = f"{outputs:,} derived metrics (limits.max_derived_outputs=" \
                   f"{limits.max_derived_outputs:,})"
        elif len(batch.keys) + outputs > limits.max_keys_per_batch:
            what = f"{len(batch.keys):,} keys and {outputs:,} derived metrics " \
                   f"(limits.max_keys_per_batch={limits.max_keys_per_batch:,} counts both)"
        elif reads > limits.max_derived_reads:
            what = f"formulas reading {reads:,} merged records (limits.max_derived_reads=" \
                   f"{limits.max_derived_reads:,})"
        if what is not None:
            raise BatchRejected(f"step {batch.step}: rank {batch.rank}'s declarations would "
                                f"make {what}; nothing of the batch was merged")

    LAG_RUN = 3  # closes in a row behind every other rank that name a rank lagging

    def _check_lag(self, rank: int, step: int) -> None:
        """Count a rank that closes ``step`` only after every other rank closed the next
        one: the mark of a rank whose counted steps (no ``step=``) slipped by one, when an
        exception came between recording and ``wait_submit``. Tell it once, at the third."""
        following = self._pending.get(step + 1)
        others = (self.world_size or 0) - 1
        if following is None or others < 1 or len(following.closed - {rank}) < others:
            self._lagging.pop(rank, None)
            return
        self._lagging[rank] += 1
        if self._lagging[rank] == self.LAG_RUN:
            log.warning("rank %d closes each step after every other rank closed the next one",
                        rank)
            self._notices[rank] = (
                f"rank {rank} closes each step only after every other rank closed the next "
                f"one ({self.LAG_RUN} steps in a row, the last step {step}): its step count "
                f"has probably slipped by one (an exception between recording and "
                f"wait_submit, without discard()). Pass step= to wait_submit (the trainer's "
                f"global step) so a step never holds another's records")

    @property
    def lagging_ranks(self) -> list[int]:
        """Ranks closing each step after every other rank closed the next one."""
        return sorted(r for r, n in self._lagging.items() if n >= self.LAG_RUN)

    # How a published step's meta is read back when it is older than what is kept in
    # memory (the worker reads its journal); None: only what is kept is known.
    journaled_meta: Callable[[int], Mapping[str, Any] | None] | None = None

    def _after_emitted(self, batch: Batch, digest: bytes) -> Outcome:
        closed, digests = self._emitted.get(batch.step, (None, None))
        if digests is None and self.journaled_meta is not None:
            meta = self.journaled_meta(batch.step)  # rare: an old step's batch
            if meta is not None:
                closed = frozenset(meta.get("ranks", ()))
                digests = _digests(meta.get("digests"))
        closed = closed or frozenset()
        if batch.rank not in closed:
            self.counts["late"] += 1
            self.late_by_rank[batch.rank] += 1
            return Outcome("late")
        known = None if digests is None else digests.get((batch.rank, batch.seq))
        if known is not None and known == digest[:len(known)]:  # the same bytes: a resend
            self.counts["duplicate"] += 1
            return Outcome("duplicate")
        # Not provably a resend (resends are recent: their digests are kept): never merged,
        # never taken for a duplicate, however old the step.
        self.counts["conflict"] += 1
        what = ("was already received with other content" if known is not None else
                "comes after the rank already closed this step")
        raise BatchRejected(
            f"step {batch.step}: conflict: rank {batch.rank} seq {batch.seq} {what}, and "
            f"the step is already final. Rerunning steps after resuming from a checkpoint? "
            f"Call rewind(to_step=<the checkpoint's step>) on the MetricWorker first. Two "
            f"clients with rank {batch.rank}? Only a byte-identical resend is a duplicate; "
            f"nothing was merged")

    def _anchor(self) -> int | None:
        """Return the oldest step still open (None before the first batch of a run)."""
        open_steps = list(self._pending)
        if self.last_emitted is not None:
            open_steps.append(self.last_emitted + 1)
        return min(open_steps, default=None)

    def _check_ahead(self, step: int, who: str) -> None:
        anchor = self._anchor()
        if anchor is not None and step > anchor + self.max_steps_ahead:
            raise BatchRejected(
                f"step {step} from {who} is {step - anchor} steps ahead of the oldest open "
                f"step {anchor} (limit max_steps_ahead={self.max_steps_ahead}); "
                f"is its start_step right?"
            )

    def _drop_far_ahead(self) -> None:
        """Drop steps a runaway opened before the run's first step did (nothing emitted yet)."""
        if self.last_emitted is not None:
            return
        oldest = min(self._pending)
        for step in [s for s in self._pending if s > oldest + self.max_steps_ahead]:
            far = self._pending.pop(step)
            for rank in far.ranks:
                self._drop(rank, f"your batch for step {step} was dropped: it is "
                                 f"{step - oldest} steps ahead of the oldest open step "
                                 f"{oldest} (limit max_steps_ahead={self.max_steps_ahead}); "
                                 f"is its start_step right?")
        self._refresh_newest_closed()

    def _check_room(self, step: int) -> None:
        if len(self._pending) >= self.max_pending_steps:
            raise BatchRejected(
                f"step {step}: {len(self._pending)} steps are already pending "
                f"(limit max_pending_steps={self.max_pending_steps}); "
                f"oldest pending is {min(self._pending)}"
            )

    # -- streams -----------------------------------------------------------------------
    def stream_submit(self, name: str, client: str, batch: Batch) -> Status:
        """Add a stream client's batch to the window of stream ``name`` (idempotent)."""
        try:
            batch = self._checked(batch)
            window = self._windows.setdefault(name, Window())
            if len(window.keys) + len(batch.keys) > self.limits.max_keys_per_batch:
                raise BatchRejected(
                    f"stream {name!r}: the window would exceed {self.limits.max_keys_per_batch} "
                    f"keys (limit max_keys_per_batch)"
                )
            if not window.add_batch(client, batch):
                self.counts["duplicate"] += 1
                return "duplicate"
        except BatchRejected:
            self.counts["rejected"] += 1
            raise
        self.counts["stream_batches"] += 1
        return "merged"

    def export_stream(self, name: str, step: int, close: bool = False) -> tuple[dict, list]:
        """Fold the window of ``name`` into ``step`` and start a new window.

        Returns the window's metrics and the steps that became final. With
        ``close=True`` a step no rank has submitted becomes final with the window
        alone (streams without training ranks). Raises ``BatchRejected`` (and keeps
        the window) if the step is already final or the window cannot merge into it.
        """
        window = self._windows.get(name) or Window()
        if self.last_emitted is not None and step <= self.last_emitted:
            raise BatchRejected(
                f"stream {name!r}: step {step} is already final (last final step "
                f"{self.last_emitted}); export before the ranks close it, or name a later step"
            )
        target = self._pending.get(step)
        if target is None:
            self._check_ahead(step, f"stream {name!r}")
            self._check_room(step)
            target = PendingStep(step, self.world_size, self._clock())
        self.declarations.check(window.declared.values(), step, _STREAM_RANK)
        self._exports += 1
        part, keys, codes, sketches = window.as_part((1, name, self._exports))

        def fold(into: PendingStep) -> None:
            located = Part(part.order, None, into.locate(keys, codes, f"stream {name!r}"),
                           part.rows)
            into.add(located, keys, codes, np.zeros(len(keys), dtype=np.int32), sketches, True)
            into.declare(window.declared.values())
            into.streams.append(name)

        fold(target)
        self.declarations.adopt(window.declared.values(), step, _STREAM_RANK)
        self._pending[step] = target
        if self.world_size is None:
            target.keep_source(None, None, fold)
        target.stream_only = target.stream_only or close
        self._windows[name] = Window()
        kinds = [self._resolver.resolve(k, int(c)) for k, c in zip(keys, codes)]
        preview = self._metrics(window.merged(), keys, kinds, _internal_rows(keys), {},
                                derive=False)
        return preview, self._emit_ready()

    # -- time --------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> list[StepResult]:
        """Finish, as partial, every step whose straggler timeout has passed."""
        if self.straggler_timeout_s is None or not self._pending:
            return []
        now = self._clock() if now is None else now
        for pending in self._pending.values():
            if now - pending.opened_at >= self.straggler_timeout_s:
                pending.timed_out = True
        if self.world_size is None and self._claims and any(
                p.timed_out for p in self._pending.values()):
            # No majority came in time: the size most ranks claim (the larger on a tie).
            sizes = Counter(self._claims.values())
            size = max(sizes, key=lambda w: (sizes[w], w))
            voters = sorted(r for r, w in self._claims.items() if w == size)
            self._fix_world_size(size, f"claimed by ranks {voters} at the straggler timeout")
            for pending in self._pending.values():
                pending.timed_out = now - pending.opened_at >= self.straggler_timeout_s
        return self._emit_ready()

    # -- restart -----------------------------------------------------------------------
    def restore(self, finished: Iterable[dict[str, Any]]) -> None:
        """Resume after a restart from journaled steps ``{"step", "metrics", "meta"}``, in
        step order (a journal's order), one at a time: nothing is kept of a step past the
        recent ones' digests and ranks."""
        for record in finished:
            step = int(record["step"])
            meta = record.get("meta", {})
            self.last_emitted = max(step, self.last_emitted if self.last_emitted is not None
                                    else step)
            digests = meta.get("digests")
            self._emitted[step] = (frozenset(meta.get("ranks", ())), _digests(digests))
            if self.newest_closed is None or step > self.newest_closed:
                self.newest_closed = step
            if self.world_size is None and meta.get("world_size"):
                self.world_size = int(meta["world_size"])
                self.world_source = "from the journal"
            totals = meta.get("derived_totals")
            if isinstance(totals, dict):
                self.deriver.restore(totals)
            declarations = meta.get("declarations")
            if isinstance(declarations, dict):
                self.declarations.restore(declarations, step)
            while len(self._emitted) > self._remember_steps:
                self._emitted.popitem(last=False)
            old = step - DIGEST_STEPS  # digests of the recent steps only
            if old in self._emitted:
                self._emitted[old] = (self._emitted[old][0], None)

    def rewind(self, to_step: int, totals: Mapping[str, Any] | None) -> int:
        """Forget every step past ``to_step`` (published or pending): they will be recorded
        afresh. ``totals``: the running sums as journaled with ``to_step``. Returns how
        many published steps were superseded."""
        superseded = [s for s in self._emitted if s > to_step]
        for step in superseded:
            del self._emitted[step]
        for step in [s for s in self._pending if s > to_step]:
            del self._pending[step]
        if self.last_emitted is not None and self.last_emitted > to_step:
            self.last_emitted = to_step if to_step >= 0 else None
        self.rank_last_seen = {r: min(s, to_step) for r, s in self.rank_last_seen.items()}
        self._lagging.clear()
        self.deriver.totals.clear()
        self.deriver.restore(totals or {})
        self._refresh_newest_closed()
        return len(superseded)

    # -- output ------------------------------------------------------------------------
    def _emit_ready(self) -> list[StepResult]:
        out: list[StepResult] = []
        while self._pending:
            step = min(self._pending)
            pending = self._pending[step]
            if not pending.ready:
                break
            out.append(self._finish(pending))  # before forgetting it: a raise loses nothing
            del self._pending[step]
            self.last_emitted = step
            self._emitted[step] = (frozenset(pending.closed), pending.digests)
            old = step - DIGEST_STEPS
            if old in self._emitted:
                self._emitted[old] = (self._emitted[old][0], None)
            while len(self._emitted) > self._remember_steps:
                self._emitted.popitem(last=False)
        return out

    def _metrics(self, merged: tuple, keys: list[str], kinds: list[ReduceType],
                 internal: list[int], declared: Mapping[str, Any], derive: bool = True,
                 collisions: dict[str, list[str]] | None = None) -> dict[str, float]:
        """Finalise the public keys; evaluate the ``declared`` derived metrics over every
        record (the ``internal`` ones are their inputs only).

        A name exported twice (two keys, a rename, a derived metric, or two names one sink
        tag) keeps its first source and is listed in ``collisions``.
        """
        data, _, sketches = merged
        public = np.setdiff1d(np.arange(len(keys)), internal)
        collisions = {} if collisions is None else collisions
        metrics = finalize(
            [keys[i] for i in public],
            [kinds[i] for i in public],
            data[public],
            sketches={j: sketches[i] for j, i in enumerate(public) if i in sketches},
            rules=self.output,
            rename=self._rename,
            collisions=collisions,
        )
        if derive:
            derived = self.deriver.derive(declared, keys, kinds, data, self.output)
            for key, value in derived.items():
                name = self._rename(key)
                if name in metrics:
                    collisions.setdefault(name, [name]).append(f"derived {key}")
                else:
                    metrics[name] = value
        by_tag: dict[str, list[str]] = {}
        for name in metrics:  # what sinks that sanitise names would merge
            by_tag.setdefault(safe_tag(name), []).append(name)
        for tag, names in by_tag.items():
            if len(names) > 1:  # the first is the one sinks show (``tag_order``)
                collisions[tag] = sorted(names, key=lambda n, t=tag: tag_order(n, t))
        return metrics

    def _finish(self, p: PendingStep) -> StepResult:
        kinds = [self._resolver.resolve(k, int(c)) for k, c in zip(p.keys, p.codes)]
        merged = p.merged()
        internal = _internal_rows(p.keys)
        collisions: dict[str, list[str]] = {}
        declared = self.declarations.of(p.declared)
        metrics = self._metrics(merged, p.keys, kinds, internal, declared,
                                collisions=collisions)
        partial = not p.complete
        if partial:
            self.counts["partial"] += 1
        meta: dict[str, Any] = {
            "partial": partial,
            "world_size": p.world_size or 0,
            "ranks": sorted(p.closed),
            "missing_ranks": p.missing(),
            "batches": p.batches,
            "keys": len(p.keys),
            "age_s": round(self._clock() - p.opened_at, 6),  # first batch -> final
        }
        if p.streams:
            meta["streams"] = list(p.streams)
        totals = self.deriver.state()
        if totals:
            meta["derived_totals"] = totals
        meta.update(_anomalies(p, kinds, merged))
        histograms = self._histograms(p.keys, kinds, merged)
        if histograms:
            meta["histograms"] = histograms
        if collisions:  # never overwritten: the first source kept, every source named
            meta["collisions"] = collisions
            self.counts["collisions"] += 1
        # What tells a resend from a rerun after a restart: the batches' digests, journaled.
        meta["digests"] = {f"{r}:{s}": d[:8].hex() for (r, s), d in sorted(p.digests.items())}
        if self.lagging_ranks:  # steps counted without step=, one behind the others
            meta["lagging_ranks"] = self.lagging_ranks
        if self.deriver.limited:  # the step's derivation budget ran out: the rest left out
            meta["derived_limit"] = dict(self.deriver.limited)
        if self.deriver.undefined:  # inputs present, but no finite real value: omitted
            meta["derived_undefined"] = dict(self.deriver.undefined)
        first = self.declarations.fix(declared)
        if first:  # journaled once: a restart keeps the run's definitions
            meta["declarations"] = first
        ignored = self.deriver.unread(declared, [p.keys[i] for i in internal])
        if ignored:
            meta["internal_ignored"] = ignored  # "__"-keys are never exported: say so
        return StepResult(p.step, metrics, meta)

    def _histograms(self, keys: list[str], kinds: list[ReduceType],
                    merged: tuple) -> dict[str, dict[str, Any]]:
        """Return the merged histogram of every public QUANTILES key of a step, by its
        (renamed) key: bin edges and counts, with the exact count, sum, sum of squares,
        min and max (what TensorBoard's histogram holds)."""
        data, _, sketches = merged
        bins = self.output.histogram_bins
        out: dict[str, dict[str, Any]] = {}
        if not bins:
            return out
        for i, sk in sketches.items():
            if not KINDS[kinds[i]].sketch or is_internal(keys[i]) or data[i, COUNT] <= 0:
                continue
            row = data[i]
            hist = histogram(*sk, self.output.sketch, float(row[MIN]), float(row[MAX]), bins)
            if hist is not None:
                out[self._rename(keys[i])] = {
                    "edges": hist[0].tolist(), "counts": hist[1].tolist(),
                    "count": float(row[COUNT]), "sum": float(row[SUM]),
                    "sum_squares": _sum_squares(row), "min": float(row[MIN]),
                    "max": float(row[MAX])}
        return out

    # -- introspection -----------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """The merge's part of the service's health: steps, ranks and batch counts."""
        counts = self.counts
        return {
            "pending_steps": self.pending_summary(),
            "last_final_step": self.last_emitted,
            "newest_closed_step": self.newest_closed,
            "rank_last_seen": dict(sorted(self.rank_last_seen.items())),
            "batches": counts["batches"],
            "stream_batches": counts["stream_batches"],
            "stream_windows": self.windows_summary(),
            "rejected_batches": counts["rejected"],
            "duplicate_batches": counts["duplicate"],
            "late_batches": counts["late"],
            "late_by_rank": dict(sorted(self.late_by_rank.items())),
            "lagging_ranks": self.lagging_ranks,
            "conflicting_batches": counts["conflict"],
            "dropped_batches": counts["dropped"],
            "steps_with_collisions": counts["collisions"],
            "world_size": self.world_size,
            "world_size_source": self.world_source,
            "partial_steps": counts["partial"],
        }

    def pending_summary(self) -> dict[int, dict[str, Any]]:
        """Return, per pending step, which ranks have closed it and how many keys it holds."""
        return {s: p.summary() for s, p in sorted(self._pending.items())}

    def missing_ranks(self, step: int) -> list[int] | None:
        """Return the ranks that have not closed a pending step, or None if it is not pending."""
        p = self._pending.get(step)
        return None if p is None else p.missing()

    def windows_summary(self) -> dict[str, int]:
        """Return the number of keys waiting in each stream window."""
        return {name: len(w.keys) for name, w in self._windows.items()}


def _digests(journaled: Any) -> dict[tuple[int, int], bytes] | None:
    """The batch digests a journaled step's meta holds, by ``(rank, seq)``."""
    if not isinstance(journaled, dict):
        return None
    out = {}
    for key, value in journaled.items():
        try:
            rank, seq = (int(x) for x in str(key).split(":"))
            out[(rank, seq)] = bytes.fromhex(value)
        except (TypeError, ValueError):
            continue
    return out


class TagOwners:
    """The keys of the run by sink tag, to tell a rank whose new key shares a tag with
    another key (``"acc rate"`` and ``"acc_rate"``) which of them sinks will show."""

    LIMIT = 100_000  # keys remembered; past it, new keys are not checked

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._owner: dict[str, str] = {}

    def notice(self, keys: Sequence[str]) -> str | None:
        """Register ``keys``; return what their sender must hear, or None."""
        said = []
        for key in keys:
            if key in self._seen or len(self._seen) >= self.LIMIT:
                continue
            self._seen.add(key)
            tag = safe_tag(key)
            held = self._owner.setdefault(tag, key)
            if held != key:
                shown = min(held, key, key=lambda n: tag_order(n, tag))
                self._owner[tag] = shown
                said.append(f"key {key!r} shares the sink tag {tag!r} with key {held!r}: "
                            f"sinks show {shown!r} under it (the name written as its tag, "
                            f"else the first alphabetically); rename one")
        return "; ".join(said[:8]) or None


def _sum_squares(row: np.ndarray) -> float:
    """The sum of squares TensorBoard's histogram shows (a display figure, not an input)."""
    n = row[COUNT]
    with np.errstate(over="ignore"):  # past float64's range it is inf, as the value is
        return float(row[M2_ROOT] ** 2 + row[SUM] ** 2 / n) if n else 0.0


def _internal_rows(keys: list[str]) -> list[int]:
    """Return the rows of internal keys (a ``__`` path segment): derivation inputs only."""
    return [i for i, key in enumerate(keys) if is_internal(key)]


def _anomalies(p: PendingStep, kinds: list[ReduceType], merged: tuple) -> dict[str, Any]:
    """Return the meta entries that flag values a user should not trust blindly."""
    data, contributors, _ = merged
    out: dict[str, Any] = {}
    nonfinite = np.flatnonzero(data[:, NONFINITE] > 0)
    if nonfinite.size:
        out["nonfinite"] = {p.keys[i]: int(data[i, NONFINITE]) for i in nonfinite}
    overflow = np.flatnonzero((data[:, COUNT] > 0) & ~np.isfinite(data[:, [SUM, M2_ROOT]]).all(1))
    if overflow.size:  # finite values whose sum (or spread) left float64's range
        out["overflow"] = [p.keys[i] for i in overflow]
    want = np.where(p.expected > 0, p.expected, p.world_size or 0)
    off = np.flatnonzero((contributors != want) & ~p.from_stream)
    if off.size:
        out["contributors"] = {p.keys[i]: [int(contributors[i]), int(want[i])] for i in off}
    for i, kind in enumerate(kinds):  # what a kind's own check marks (KINDS[kind].flag)
        flag = KINDS[kind].flag
        if flag is not None and data[i, COUNT] > 0 and flag[1](data[i]):
            out.setdefault(flag[0], []).append(p.keys[i])
    approx = [k for k, c in zip(p.keys, p.codes) if c == AUTO and is_approximate_plain_key(k)]
    if approx:
        out["approximate"] = approx
    return out
