"""The step's life as a pure engine: batches and a clock in, finished steps and answers out.

No Ray, no threads, no I/O. A batch is received once at the boundary (``wire.receive``:
decoded, every rule checked, its declarations decoded), admitted (not too far ahead, room
for one more step, its declarations within their budget, its sketches mergeable), and kept
in its step. A step is final when ``world_size`` distinct ranks have sent a ``final`` batch
for it, or when its straggler timeout passes (counted from its first batch; then it is
*partial*). Finished steps leave strictly in step order.

Retries are idempotent on ``(step, rank, seq)``: a byte-identical resend is a *duplicate*,
other content under the same identity a *conflict*, refused. A batch for a step already
published is *late* if its rank never closed the step: counted, journaled by the shell,
never merged. The run's world size comes from the config, else a majority of the sizes
ranks claim, else the journal after a restart; whoever disagrees is refused. Stream windows
(no step barrier) are merged apart and folded into the step the driver names at export.
A restart reloads the journaled steps (``restore``); a rewind forgets every step after the
checkpoint (``rewind``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from metricsvc.core.declare import Derived
from metricsvc.core.limits import MAX_PENDING_STEPS, MAX_STEPS_AHEAD, Limits, Recent
from metricsvc.core.reduce import OutputRules, ReduceType
from metricsvc.core.wire import Batch, encode, key_cache, receive
from metricsvc.errors import BatchRejected
from metricsvc.service.alerts import Alerts
from metricsvc.service.derive import Deriver, RunDeclarations
from metricsvc.service.output import StepOutput, StepResult
from metricsvc.service.steps import PendingStep
from metricsvc.service.streams import STREAM_RANK, Streams

log = logging.getLogger(__name__)

Status = Literal["merged", "duplicate", "late"]  # what the engine did with a batch


@dataclass(frozen=True)
class Outcome:
    """What the engine did with a rank's batch: its status, what the rank must hear, and the
    steps it finished."""

    status: Status
    step: int
    rank: int
    seq: int
    finished: list[StepResult] = field(default_factory=list)
    notice: str | None = None  # something the sender must hear about an earlier batch
    keys: int = 0


class Engine:
    """Merge batches into steps and hand out finished steps in order. Each part of the job
    is a component it holds: the open steps (``pending``), the published ones
    (``published``), stream windows (``streams``), the world size and lagging ranks
    (``world``, ``lag``), what each rank must hear (``notices``), derivation and output."""

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
        formulas: Mapping[str, str] | None = None,
        max_staleness: int | None = None,
        tables: Mapping[str, Mapping[str, Any]] | None = None,
        alerts: Sequence[Mapping[str, Any]] = (),
        remember_steps: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        journaled_meta: Callable[[int], Mapping[str, Any] | None] | None = None,
    ) -> None:
        """``journaled_meta(step)``: how a published step's meta is read back when it is
        older than what is kept in memory (the journal's; None: only memory). ``formulas``:
        what a derived metric's name means here, over the inputs its declaration names
        (a preset's framework meaning: verl's ``timing_per_token_ms/<stage>``).
        ``max_staleness``: a step whose stream records are older than this many versions
        says so (``meta["staleness_over_bound"]``, and a warning). ``tables``: the tables a
        step carries, by name (``rows``, ``values``, ``max_rows``: ``output.Tables``).
        ``alerts``: the rules each final step is checked against (``alerts.Alerts``)."""
        self.straggler_timeout_s = straggler_timeout_s
        self.max_pending_steps, self.max_steps_ahead = max_pending_steps, max_steps_ahead
        self.limits = limits or Limits()
        self.output = output or OutputRules()
        self.world = WorldSize(world_size)
        self.notices = Notices()
        self.lag = LagWatch()
        self.deriver = Deriver(self.limits.max_derived_outputs, self.limits.max_derived_reads)
        self.declarations = RunDeclarations()  # one definition of a derived metric a run
        self.out = StepOutput(self.output, reduce_rules, renames, self.deriver,
                              self.declarations, max_staleness, tables)
        self.alerts = Alerts(alerts)
        self._clock = clock
        self._keys = key_cache()  # key tuples checked before (ranks send them every step)
        self._costs: Recent = Recent(256)  # declarations -> (outputs, reads) they cost
        self.formulas = dict(formulas or {})
        self._meant: Recent = Recent(64)  # declarations as sent -> as this run means them
        self.pending = PendingSteps()
        self.published = Published(remember_steps, journaled_meta)
        self.streams = Streams(self.limits.max_keys_per_batch)
        self.last_emitted: int | None = None
        self.newest_closed: int | None = None
        self.rank_last_seen: dict[int, int] = {}
        self.late_by_rank: Counter[int] = Counter()
        self.counts = Counter({"batches": 0, "duplicate": 0, "late": 0, "rejected": 0,
                               "partial": 0, "stream_batches": 0, "conflict": 0, "dropped": 0,
                               "collisions": 0, "alerts": 0})

    @property
    def world_size(self) -> int | None:
        """The run's world size (None until agreed)."""
        return self.world.size

    # -- a rank's batch ----------------------------------------------------------------
    def submit(self, item: Batch | bytes) -> Outcome:
        """Merge one rank's batch (or its wire bytes); return its outcome.

        Raises:
            BatchRejected: the batch is malformed, contradicts its step or the run (world
                size, a conflicting resend, too far ahead); nothing of it was merged and no
                state changed.
        """
        batch = self._receive(item)
        notice = self.notices.pop(batch.rank, None)
        try:
            if batch.world_size != self.world.size:
                self.world.check(batch)
            # What tells a resend (a duplicate) from other content under the same identity
            # (a conflict): the digest of the bytes received, never compared on the merge path
            wire = item if isinstance(item, (bytes, bytearray, memoryview)) else encode(batch)
            status, finished = self._merge(batch, hashlib.sha1(wire).digest())
        except BatchRejected as err:
            self.counts["rejected"] += 1
            if notice is not None:
                raise BatchRejected(f"{err}; earlier: {notice}") from None
            raise
        fresh = self.notices.pop(batch.rank, None)  # what this batch itself made the rank owe
        if fresh is not None:
            notice = fresh if notice is None else f"{notice}; {fresh}"
        return Outcome(status, batch.step, batch.rank, batch.seq, finished, notice,
                       len(batch.keys))

    def _receive(self, item: Batch | bytes) -> Batch:
        """The boundary: ``item`` decoded and checked, its sketches mergeable here."""
        try:
            batch = receive(item, self.limits, self._keys)
            if batch.sketch_rows.size and batch.sketch_alpha != self.output.sketch.alpha:
                key = batch.keys[int(batch.sketch_rows[0])]
                raise BatchRejected(
                    f"key {key!r}: quantile sketch alpha {batch.sketch_alpha} from rank "
                    f"{batch.rank} cannot merge with the service's alpha "
                    f"{self.output.sketch.alpha}")
        except BatchRejected:
            self.counts["rejected"] += 1
            raise
        if self.formulas and batch.declared:
            meant = self._meant.get(batch.derived)
            if meant is None:
                meant = self._meant[batch.derived] = tuple(map(self._as_meant, batch.declared))
            batch = replace(batch, declared=meant)
        return batch

    def _as_meant(self, decl: Derived) -> Derived:
        """``decl`` with the formula ``formulas`` gives its name (as it came where that
        formula reads an input it does not declare: logged)."""
        formula = self.formulas.get(decl.name)
        if formula is None or formula == decl.formula:
            return decl
        try:
            return Derived(decl.name, formula, decl.inputs, help=decl.help, unit=decl.unit)
        except ValueError as err:
            log.warning("formulas: %s; the declaration's own formula is used", err)
            return decl

    def _merge(self, batch: Batch, digest: bytes) -> tuple[Status, list[StepResult]]:
        step = batch.step
        pending = self.pending.get(step)
        if pending is None:
            if self.last_emitted is not None and step <= self.last_emitted:
                return self._after_published(batch, digest), []
            target = self._open(step, f"rank {batch.rank}")
        else:
            known = pending.digests.get((batch.rank, batch.seq))
            if known == digest:
                self.counts["duplicate"] += 1
                return "duplicate", []
            if known is not None:
                raise self._conflict(batch, RESENT_OTHERWISE)
            if batch.rank in pending.closed:
                raise self._conflict(batch, AFTER_CLOSE)
            target = pending
        declared = batch.declared
        ignored = None
        if declared:
            ignored = self.declarations.check(declared, step, batch.rank)
            self._check_cost(batch, pending.keys if pending is not None else ())
        target.take(batch, digest)  # a kind clash raises: nothing was kept
        if batch.final and (step + 1 in self.pending or batch.rank in self.lag.runs):
            self._check_lag(batch.rank, step)  # only then can a rank lag
        self.pending[step] = target
        if ignored is not None:  # its data merged, its declaration not: it hears why
            self.notices.tell(batch.rank, ignored)
        if declared:
            for rank in self.declarations.adopt(declared, step, batch.rank):
                self.notices.tell(rank, f"step {step}: rank {batch.rank} declares a derived "
                                        f"metric you declared otherwise; the lower rank's is "
                                        f"the run's, yours is ignored and your data merged")
        self.counts["batches"] += 1
        self.rank_last_seen[batch.rank] = max(step, self.rank_last_seen.get(batch.rank, step))
        if batch.final and (self.newest_closed is None or step > self.newest_closed):
            self.newest_closed = step
        if pending is None and self.last_emitted is None:
            self._drop_far_ahead()
        if self.world.size is None:  # kept apart until the world size is agreed
            target.keep_source(batch.world_size, batch.rank,
                               lambda p, b=batch, d=digest: p.take(b, d))
            source = self.world.claim(batch)
            if source is not None:
                self._fix_world_size(batch.world_size, source)
        return "merged", self._emit_ready()

    def _after_published(self, batch: Batch, digest: bytes) -> Status:
        status, what = self.published.judge(batch, digest)
        if status == "late":
            self.counts["late"] += 1
            self.late_by_rank[batch.rank] += 1
            return "late"
        if status == "duplicate":
            self.counts["duplicate"] += 1
            return "duplicate"
        raise self._conflict(batch, what, final=True)

    def _conflict(self, batch: Batch, what: str, final: bool = False) -> BatchRejected:
        self.counts["conflict"] += 1
        return BatchRejected(conflict_message(batch, what, final))

    def _check_lag(self, rank: int, step: int) -> None:
        following = self.pending.get(step + 1)
        said = self.lag.check(rank, step, None if following is None else following.closed,
                              self.world.size)
        if said is not None:
            self.notices.tell(rank, said)

    # -- admission -----------------------------------------------------------------------
    def _open(self, step: int, who: str) -> PendingStep:
        """Return a new step that ``who`` opens, once admitted: not too far past the oldest
        step still open, and room for one more."""
        # the oldest step still open (None before the first batch of a run)
        anchor = None if self.last_emitted is None else self.last_emitted + 1
        if self.pending:
            oldest = min(self.pending)
            anchor = oldest if anchor is None else min(anchor, oldest)
        if anchor is not None and step > anchor + self.max_steps_ahead:
            raise BatchRejected(
                f"step {step} from {who} is {step - anchor} steps ahead of the oldest open "
                f"step {anchor} (limit max_steps_ahead={self.max_steps_ahead}); "
                f"is its start_step right?")
        if len(self.pending) >= self.max_pending_steps:
            raise BatchRejected(
                f"step {step}: {len(self.pending)} steps are already pending "
                f"(limit max_pending_steps={self.max_pending_steps}); "
                f"oldest pending is {min(self.pending)}")
        return PendingStep(step, self.world.size, self._clock())

    def _drop_far_ahead(self) -> None:
        """Drop steps a runaway opened before the run's first step did (nothing published
        yet), too far past the oldest open step."""
        oldest = min(self.pending)
        for step in [s for s in self.pending if s > oldest + self.max_steps_ahead]:
            why = (f"it is {step - oldest} steps ahead of the oldest open step {oldest} "
                   f"(limit max_steps_ahead={self.max_steps_ahead}); is its start_step right?")
            for rank in self.pending.pop(step).ranks:
                self._drop(rank, f"your batch for step {step} was dropped: {why}")
        self.newest_closed = self.pending.newest_closed(self.last_emitted)

    def _check_cost(self, batch: Batch, step_keys: Sequence[str]) -> None:
        """Refuse declarations whose work or outputs would pass the limits, over the keys the
        step holds so far and the batch's (once per distinct set of declarations: ranks send
        the same every step). Finishing a step keeps to the same budget whatever keys come
        later (``Deriver.derive``)."""
        limits, declared = self.limits, batch.declared
        if len(declared) > limits.max_declarations:
            raise BatchRejected(
                f"step {batch.step}: rank {batch.rank} declares {len(declared)} derived "
                f"metrics; the limit is limits.max_declarations={limits.max_declarations}")
        cost = self._costs.get(batch.derived)
        if cost is None:
            cost = self._costs[batch.derived] = self.deriver.cost(
                declared, [*batch.keys, *step_keys])
        outputs, reads = cost
        what = None
        if outputs > limits.max_derived_outputs:
            what = (f"{outputs:,} derived metrics (limits.max_derived_outputs="
                    f"{limits.max_derived_outputs:,})")
        elif len(batch.keys) + outputs > limits.max_keys_per_batch:
            what = (f"{len(batch.keys):,} keys and {outputs:,} derived metrics "
                    f"(limits.max_keys_per_batch={limits.max_keys_per_batch:,} counts both)")
        elif reads > limits.max_derived_reads:
            what = (f"formulas reading {reads:,} merged records (limits.max_derived_reads="
                    f"{limits.max_derived_reads:,})")
        if what is not None:
            raise BatchRejected(f"step {batch.step}: rank {batch.rank}'s declarations would "
                                f"make {what}; nothing of the batch was merged")

    # -- the run's world size ----------------------------------------------------------
    def _fix_world_size(self, world_size: int, source: str) -> None:
        """Fix the run's world size; drop what ranks claiming another size sent so far."""
        self.world.fix(world_size, source)
        self.pending.regroup(world_size, lambda step, rank, claim: self._drop(
            rank, f"your batch for step {step} was dropped: rank {rank} claimed world_size "
                  f"{claim}, but the run's world size is {world_size} ({source})"))
        self.newest_closed = self.pending.newest_closed(self.last_emitted)

    def _drop(self, rank: int, why: str) -> None:
        """Drop an accepted batch of ``rank``; the rank hears why at its next call."""
        self.counts["dropped"] += 1
        self.notices.tell(rank, why)
        log.warning("rank %d: %s", rank, why)

    # -- time and output -----------------------------------------------------------------
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

    def _emit_ready(self) -> list[StepResult]:
        out: list[StepResult] = []
        while self.pending:
            step = min(self.pending)
            pending = self.pending[step]
            if not pending.ready():
                break
            result = self.out.finish(pending, pending.finish(self._clock()), self.lag.lagging)
            if self.alerts.rules:  # once, in step order: journaled with the step
                alerts, cut = self.alerts.check(step, result.metrics, result.meta)
                if alerts:
                    result.meta["alerts"] = alerts
                    self.counts["alerts"] += len(alerts)
                if cut:
                    result.meta["alerts_cut"] = cut
            if self.out.told.news:  # values the step left out, new to the run: its ranks hear
                said = self.out.told.take()
                for rank in sorted(pending.closed):
                    self.notices.tell(rank, said)
            self.counts["partial"] += result.meta["partial"]
            self.counts["collisions"] += "collisions" in result.meta
            out.append(result)  # before forgetting it: a raise loses nothing
            del self.pending[step]
            self.last_emitted = step
            self.published.add(step, frozenset(pending.closed), pending.digests)
        return out

    # -- streams -------------------------------------------------------------------------
    def submit_stream(self, name: str, client: str, item: Batch | bytes) -> tuple[Status, int]:
        """Add a stream client's records to the window of stream ``name`` (idempotent on
        the client's batch number); return the status and that number.

        Raises:
            BatchRejected: the batch breaks a rule, or the window would pass
                ``limits.max_keys_per_batch``; nothing of it was kept.
        """
        batch = self._receive(item)
        try:
            added = self.streams.add(name, client, batch)
        except BatchRejected:
            self.counts["rejected"] += 1
            raise
        self.counts["stream_batches" if added else "duplicate"] += 1
        return ("merged" if added else "duplicate"), batch.seq

    def export_stream(self, name: str, step: int,
                      close: bool = False) -> tuple[dict[str, float], list[StepResult]]:
        """Fold the window of stream ``name`` into ``step`` and start a new window; return
        the window's metrics and the steps that became final. ``close=True``: a step no rank
        submits becomes final with the window alone.

        Raises:
            BatchRejected: the step is already final, or the window cannot merge into it
                (the window is kept).
        """
        if self.last_emitted is not None and step <= self.last_emitted:
            raise BatchRejected(
                f"stream {name!r}: step {step} is already final (last final step "
                f"{self.last_emitted}); export before the ranks close it, or name a later step")
        target = self.pending.get(step)
        target = self._open(step, f"stream {name!r}") if target is None else target
        window = self.streams.window(name)
        declared = window.declared.values()
        self.declarations.check(declared, step, STREAM_RANK)
        fold = self.streams.folder(name)
        fold(target)
        self.declarations.adopt(declared, step, STREAM_RANK)
        self.streams.exported(name, step)
        self.pending[step] = target
        if self.world.size is None:
            target.keep_source(None, None, fold)
        if close:
            target.close_with_streams()
        return self.out.preview(window), self._emit_ready()

    # -- a run continued -------------------------------------------------------------------
    def restore(self, finished: Iterable[Mapping[str, Any]],
                settled: Iterable[dict[str, dict[str, int]]] = ()) -> None:
        """Continue after a restart from journaled steps ``{"step", "metrics", "meta"}``, in
        step order, one at a time: nothing is kept of a step past the recent ones' digests
        and ranks. ``settled``: the stream batches each journaled rewind settled."""
        for streams in settled:
            self.streams.ledger.journaled(streams)
        for record in finished:
            step = int(record["step"])
            meta = record.get("meta", {})
            self.last_emitted = step if self.last_emitted is None else max(step,
                                                                           self.last_emitted)
            self.newest_closed = step if self.newest_closed is None else max(
                step, self.newest_closed)
            self.published.add(step, frozenset(meta.get("ranks", ())),
                               digests_of(meta.get("digests")))
            if self.world.size is None and meta.get("world_size"):
                self.world.fix(int(meta["world_size"]), "from the journal")
            if isinstance(totals := meta.get("derived_totals"), dict):
                self.deriver.restore(totals)
            if isinstance(declarations := meta.get("declarations"), dict):
                self.declarations.restore(declarations, step)
            self.out.descriptions.restore(meta, step)
            if isinstance(metrics := record.get("metrics"), dict):
                self.out.tags.claim(tuple(metrics), step)
            if isinstance(collisions := meta.get("collisions"), dict):
                self.out.told.restore(collisions, step)
            if isinstance(stream_seqs := meta.get("stream_seqs"), dict):
                self.streams.ledger.journaled(stream_seqs)
            if self.alerts.rules and isinstance(metrics, dict):
                self.alerts.remember(step, metrics)  # evaluated once already: never again
        self.out.told.take()  # the ranks heard it from the incarnation that left it out

    def settled_by(self, to_step: int) -> dict[str, dict[str, int]]:
        """The stream batches a rewind to ``to_step`` settles (``StreamLedger.superseded``):
        journaled with it, so that every later incarnation knows them."""
        return self.streams.ledger.superseded(to_step, self.last_emitted)

    def rewind(self, to_step: int, totals: Mapping[str, Any] | None,
               before: Iterable[tuple[int, Mapping[str, float]]],
               settled: dict[str, dict[str, int]]) -> int:
        """Forget every step past ``to_step`` (published or pending): they will be recorded
        afresh, and what the superseded steps journaled once (declarations, descriptions) is
        journaled again with the rerun. ``totals``: the running sums as journaled with
        ``to_step``; ``before``: the final steps at or before it, ``(step, metrics)`` in
        order, as far back as the alerts' windows reach; ``settled``: ``settled_by``, as
        journaled. Returns how many published steps were superseded."""
        superseded = self.published.forget_after(to_step)
        self.streams.ledger.forget_after(to_step, settled)
        self.pending.forget_after(to_step)
        if self.last_emitted is not None and self.last_emitted > to_step:
            self.last_emitted = to_step if to_step >= 0 else None
        self.rank_last_seen = {r: min(s, to_step) for r, s in self.rank_last_seen.items()}
        self.lag.clear()
        self.deriver.totals.clear()
        self.deriver.restore(totals or {})
        self.declarations.forget_after(to_step)
        self.out.descriptions.forget_after(to_step)
        self.out.tags.forget_after(to_step)
        self.out.told.forget_after(to_step)
        self.alerts.rewound(before)
        self.newest_closed = self.pending.newest_closed(self.last_emitted)
        return superseded

    # -- what it says of itself --------------------------------------------------------
    def not_final(self, step: int | None, timeout_s: float | None) -> str:
        """Why ``step`` is not final after ``timeout_s`` (None: no step closed yet)."""
        if step is None:
            return f"no rank closed any step within {timeout_s} s"
        missing = self.pending.missing(step)
        if missing is None:
            return f"step {step} not final after {timeout_s} s: no rank has submitted it yet"
        if not missing:  # every rank closed it: an earlier step holds it back
            holder = min(self.pending)
            return (f"step {step} not final after {timeout_s} s: every rank closed it, but "
                    f"steps are published in order and step {holder} holds it: ranks "
                    f"{self.pending.missing(holder)} have not closed step {holder} "
                    f"(wait_submit)")
        return (f"step {step} not final after {timeout_s} s: ranks {missing} have not "
                f"closed it (wait_submit)")

    def health(self) -> dict[str, Any]:
        """The merge's part of ``health()``: steps, ranks and batch counts."""
        counts = self.counts
        return {
            "pending_steps": self.pending.summary(),
            "last_final_step": self.last_emitted,
            "newest_closed_step": self.newest_closed,
            "rank_last_seen": dict(sorted(self.rank_last_seen.items())),
            "batches": counts["batches"],
            "stream_batches": counts["stream_batches"],
            "stream_windows": {name: len(w.keys) for name, w in self.streams.windows.items()},
            "rejected_batches": counts["rejected"],
            "duplicate_batches": counts["duplicate"],
            "late_batches": counts["late"],
            "late_by_rank": dict(sorted(self.late_by_rank.items())),
            "lagging_ranks": self.lag.lagging,
            "conflicting_batches": counts["conflict"],
            "dropped_batches": counts["dropped"],
            "steps_with_collisions": counts["collisions"],
            "world_size": self.world.size,
            "world_size_source": self.world.source,
            "partial_steps": counts["partial"],
            "alerts": counts["alerts"],
        }

class PendingSteps(dict[int, PendingStep]):
    """Step -> its ``PendingStep``, for the steps not published yet."""

    def newest_closed(self, last_emitted: int | None) -> int | None:
        """Return the newest step a rank closed, pending or published."""
        closed = [s for s, p in self.items() if p.closed]
        if last_emitted is not None:
            closed.append(last_emitted)
        return max(closed, default=None)

    def summary(self) -> dict[int, dict[str, Any]]:
        """Per pending step: which ranks have closed it and how many keys it holds."""
        return {s: p.summary() for s, p in sorted(self.items())}

    def missing(self, step: int) -> list[int] | None:
        """Return the ranks that have not closed ``step``, or None if it is not pending."""
        p = self.get(step)
        return None if p is None else p.missing()

    def time_out(self, now: float, timeout_s: float, recount: bool = False) -> bool:
        """Mark the steps open for ``timeout_s`` or longer as timed out (``recount``: and
        only those, once the world size changed); return True if any is."""
        return any([p.time_out(now, timeout_s, recount) for p in self.values()])

    def forget_after(self, step: int) -> None:
        """A rewind: every step past ``step`` is recorded afresh."""
        for later in [s for s in self if s > step]:
            del self[later]

    def regroup(self, world_size: int, drop: Callable[[int, int, int | None], None]) -> None:
        """The run's world size is now ``world_size``: rebuild each step from the batches
        it kept apart, leaving out (``drop(step, rank, claim)``) those of ranks that
        claimed another size; a step left empty goes."""
        for step, p in list(self.items()):
            sources = p.agreed(world_size)
            if sources is None or all(w in (None, world_size) for w, _, _ in sources):
                continue
            fresh = PendingStep(step, world_size, p.opened_at, p.stream_only)
            for claim, rank, apply in sources:
                if claim in (None, world_size):
                    apply(fresh)
                else:
                    drop(step, rank, claim)
            if fresh.parts:
                self[step] = fresh
            else:
                del self[step]


# -- the run's ranks ---------------------------------------------------------------------
class WorldSize:
    """The run's world size and where it came from; the claims until it is agreed."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        self.source = "config" if size is not None else None
        self.claims: dict[int, int] = {}  # rank -> the world size it claims, until agreed

    def check(self, batch: Batch) -> None:
        """Refuse a batch whose world size contradicts the run's (or its rank's own claim)."""
        if self.size is not None:
            if batch.world_size != self.size:
                raise BatchRejected(
                    f"step {batch.step}: rank {batch.rank} sent world_size {batch.world_size}, "
                    f"but the run's world size is {self.size} ({self.source})")
            return
        claimed = self.claims.get(batch.rank, batch.world_size)
        if claimed != batch.world_size:
            raise BatchRejected(
                f"step {batch.step}: rank {batch.rank} sent world_size {batch.world_size}, but "
                f"claimed {claimed} before (the run's world size is not agreed yet)")

    def claim(self, batch: Batch) -> str | None:
        """Count a rank's claim; return where the size comes from once a majority of a
        claimed size agree (the caller then fixes it), else None."""
        self.claims[batch.rank] = batch.world_size
        agree = sorted(r for r, w in self.claims.items() if w == batch.world_size)
        if len(agree) >= batch.world_size // 2 + 1:
            return f"agreed by {_ranks(agree)}"
        return None

    def at_timeout(self) -> tuple[int, str] | None:
        """With no majority in time: the size most ranks claim (the larger on a tie)."""
        if self.size is not None or not self.claims:
            return None
        sizes = Counter(self.claims.values())
        size = max(sizes, key=lambda w: (sizes[w], w))
        voters = sorted(r for r, w in self.claims.items() if w == size)
        return size, f"claimed by {_ranks(voters)} at the straggler timeout"

    def fix(self, size: int, source: str) -> None:
        """Fix the run's world size; the claims are settled."""
        self.size, self.source = size, source
        self.claims.clear()
        log.warning("the run's world size is %d (%s)", size, source)


def _ranks(ranks: list[int]) -> str:
    """Name a list of ranks: all of a few, the count and ends of many."""
    if len(ranks) <= 8:
        return f"ranks {ranks}"
    return f"{len(ranks)} ranks ({ranks[0]} to {ranks[-1]})"


class LagWatch:
    """Ranks that close each step after every other rank closed the next one: its step
    count has probably slipped by one. Told once, at the third step in a row."""

    RUN = 3

    def __init__(self) -> None:
        self.runs: Counter[int] = Counter()  # rank -> closes in a row behind the others
        self.lagging: list[int] = []  # the ranks RUN or more in a row behind

    def check(self, rank: int, step: int, following: set[int] | None,
              world_size: int | None) -> str | None:
        """Count ``rank`` closing ``step`` when ``following`` (the ranks that closed the
        next step, None if it is not open) holds every other rank; return what to tell the
        rank at the third such step in a row, else None."""
        others = (world_size or 0) - 1
        if following is None or others < 1 or len(following - {rank}) < others:
            if self.runs.pop(rank, 0) >= self.RUN:
                self.lagging = sorted(r for r, n in self.runs.items() if n >= self.RUN)
            return None
        self.runs[rank] += 1
        if self.runs[rank] != self.RUN:
            return None
        self.lagging = sorted(r for r, n in self.runs.items() if n >= self.RUN)
        log.warning("rank %d closes each step after every other rank closed the next one",
                    rank)
        return (f"rank {rank} closes each step only after every other rank closed the next "
                f"one ({self.RUN} steps in a row, the last step {step}): its step count "
                f"has probably slipped by one (an exception between recording and "
                f"wait_submit, without discard()). Pass step= to wait_submit (the trainer's "
                f"global step) so a step never holds another's records")

    def clear(self) -> None:
        self.runs.clear()
        self.lagging = []


class Notices(dict[int, str]):
    """What each rank must hear with its next answer (``pop(rank, None)`` takes it): an
    accepted batch of it that was dropped, its declaration that lost, a name collision,
    its lag."""

    def tell(self, rank: int, why: str) -> None:
        """Give ``rank`` ``why`` with its next answer (after what it has not heard yet)."""
        earlier = self.get(rank)
        self[rank] = why if earlier is None else f"{earlier}; {why}"


# -- the steps already published -------------------------------------------------------------
DIGEST_STEPS = 64  # published steps whose batch digests are kept to tell resends apart
Digests = dict[tuple[int, int], bytes]
RESENT_OTHERWISE = "was already received with other content"  # the same identity, new bytes
AFTER_CLOSE = "comes after the rank already closed this step"


class Published:
    """Which ranks closed each published step and, for the recent ``DIGEST_STEPS``, the
    digests of their batches (older ones are read back from the journal's meta). A batch
    for a published step is *late* if its rank never closed the step, a *duplicate* if it
    is byte-identical to what the rank sent, and otherwise a *conflict*."""

    def __init__(self, remember: int,
                 journaled_meta: Callable[[int], Mapping[str, Any] | None] | None) -> None:
        self.remember = remember
        self.journaled_meta = journaled_meta
        self._steps: OrderedDict[int, tuple[frozenset[int], Digests | None]] = OrderedDict()

    def add(self, step: int, closed: frozenset[int], digests: Digests | None) -> None:
        """Remember a published step (forgetting digests past the recent ones)."""
        self._steps[step] = (closed, digests)
        old = step - DIGEST_STEPS
        if old in self._steps:
            self._steps[old] = (self._steps[old][0], None)
        while len(self._steps) > self.remember:
            self._steps.popitem(last=False)

    def judge(self, batch: Batch,
              digest: bytes) -> tuple[Literal["late", "duplicate", "conflict"], str]:
        """Say what ``batch`` (for a published step) is, and for a conflict what clashed."""
        closed, digests = self._steps.get(batch.step, (None, None))
        if digests is None and self.journaled_meta is not None:
            meta = self.journaled_meta(batch.step)  # rare: an old step's batch
            if meta is not None:
                closed = frozenset(meta.get("ranks", ()))
                digests = digests_of(meta.get("digests"))
        if batch.rank not in (closed or frozenset()):
            return "late", ""
        known = None if digests is None else digests.get((batch.rank, batch.seq))
        if known is not None and known == digest[:len(known)]:  # the same bytes: a resend
            return "duplicate", ""
        # Not provably a resend (resends are recent: their digests are kept): never merged,
        # never taken for a duplicate, however old the step.
        return "conflict", RESENT_OTHERWISE if known is not None else AFTER_CLOSE

    def forget_after(self, step: int) -> int:
        """Forget every published step past ``step`` (a rewind); return how many."""
        superseded = [s for s in self._steps if s > step]
        for later in superseded:
            del self._steps[later]
        return len(superseded)


def digests_of(journaled: Any) -> Digests | None:
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


def conflict_message(batch: Batch, what: str, final: bool) -> str:
    """The refusal of a batch whose identity ``(step, rank, seq)`` clashes (``what``) with
    what the engine holds; ``final``: its step is already published."""
    if not final:
        return (f"step {batch.step}: conflict: rank {batch.rank} seq {batch.seq} {what} (two "
                f"clients with rank {batch.rank}? only a byte-identical resend is a duplicate)")
    return (f"step {batch.step}: conflict: rank {batch.rank} seq {batch.seq} {what}, and the "
            f"step is already final. Rerunning steps after resuming from a checkpoint? Call "
            f"rewind(to_step=<the checkpoint's step>) on the MetricWorker first. Two clients "
            f"with rank {batch.rank}? Only a byte-identical resend is a duplicate; nothing "
            f"was merged")

