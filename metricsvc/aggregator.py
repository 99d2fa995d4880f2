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

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from metricsvc.derive import Deriver, split_internal
from metricsvc.records import COUNT, MAX, MIN, NONFINITE, SUM, SUMSQ, Batch
from metricsvc.reduce import (
    AUTO,
    KindResolver,
    OutputRules,
    ReduceType,
    Renamer,
    finalize,
    is_approximate_plain_key,
)
from metricsvc.step import PendingStep, Window
from metricsvc.validation import BatchRejected, KeyCache, Limits, check_batch
from metricsvc.wire import as_batch

Status = Literal["merged", "duplicate", "late"]


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


class Aggregator:
    """Merge batches into steps and hand out finished steps in order."""

    def __init__(
        self,
        *,
        straggler_timeout_s: float | None = None,
        max_pending_steps: int = 64,
        limits: Limits | None = None,
        reduce_rules: Mapping[str, ReduceType | str] | None = None,
        renames: Mapping[str, str] | None = None,
        output: OutputRules | None = None,
        remember_steps: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.straggler_timeout_s = straggler_timeout_s
        self.max_pending_steps = max_pending_steps
        self.limits = limits or Limits()
        self.output = output or OutputRules()
        self._resolver = KindResolver(reduce_rules)
        self._rename = Renamer(renames)
        self.deriver = Deriver()
        self._key_cache = KeyCache()
        self._clock = clock
        self._pending: dict[int, PendingStep] = {}
        self._windows: dict[str, Window] = {}
        self._exports = 0
        # Ranks that closed each emitted step: a resent batch of theirs is a duplicate.
        self._emitted: OrderedDict[int, frozenset[int]] = OrderedDict()
        self._remember_steps = remember_steps
        self.last_emitted: int | None = None
        self.newest_closed: int | None = None
        self.rank_last_seen: dict[int, int] = {}
        self.counts = {"batches": 0, "duplicate": 0, "late": 0, "rejected": 0, "partial": 0,
                       "stream_batches": 0}

    # -- input -------------------------------------------------------------------------
    def submit(self, batch: Batch) -> Outcome:
        """Merge one batch; return its status and any steps that became final.

        Raises:
            BatchRejected: the batch is malformed or contradicts its step; nothing
                of it was merged and no state changed.
        """
        try:
            return self._submit(self._checked(batch))
        except BatchRejected:
            self.counts["rejected"] += 1
            raise

    def decode(self, item: Batch | bytes) -> Batch:
        """Return the Batch that ``item`` is or encodes; malformed bytes count as rejected."""
        try:
            return as_batch(item)
        except BatchRejected:
            self.counts["rejected"] += 1
            raise

    def _checked(self, batch: Batch) -> Batch:
        batch = check_batch(batch, self.limits, self._key_cache)
        if batch.sketch_rows.size and batch.sketch_alpha != self.output.sketch.alpha:
            key = batch.keys[int(batch.sketch_rows[0])]
            raise BatchRejected(
                f"key {key!r}: quantile sketch alpha {batch.sketch_alpha} from rank "
                f"{batch.rank} cannot merge with the service's alpha {self.output.sketch.alpha}"
            )
        return batch

    def _submit(self, batch: Batch) -> Outcome:
        step = batch.step
        pending = self._pending.get(step)
        if pending is None:
            if self.last_emitted is not None and step <= self.last_emitted:
                closed = self._emitted.get(step, frozenset())
                status: Status = "duplicate" if batch.rank in closed else "late"
                self.counts[status] += 1
                return Outcome(status)
            self._check_room(step)
        elif (batch.rank, batch.seq) in pending.seqs:
            self.counts["duplicate"] += 1
            return Outcome("duplicate")
        target = pending or PendingStep(step, batch.world_size, self._clock())
        idx = target.check(batch)
        self._pending[step] = target
        target.add_batch(batch, idx)
        self.counts["batches"] += 1
        self.rank_last_seen[batch.rank] = max(step, self.rank_last_seen.get(batch.rank, step))
        if batch.final and (self.newest_closed is None or step > self.newest_closed):
            self.newest_closed = step
        return Outcome("merged", self._emit_ready())

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
            self._check_room(step)
            target = PendingStep(step, None, self._clock())
        self._exports += 1
        part, keys, codes, sketches = window.as_part((1, name, self._exports))
        part.idx = target.locate(keys, codes, f"stream {name!r}")
        self._pending[step] = target
        target.add(part, keys, codes, np.zeros(len(keys), dtype=np.int32), sketches, True)
        target.streams.append(name)
        target.stream_only = target.stream_only or close
        self._windows[name] = Window()
        kinds = [self._resolver.resolve(k, int(c)) for k, c in zip(keys, codes)]
        preview = self._metrics(window.merged(), keys, kinds, _internal_rows(keys), derive=False)
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
        return self._emit_ready()

    # -- restart -----------------------------------------------------------------------
    def restore(self, finished: list[dict[str, Any]]) -> None:
        """Resume after a restart from journaled steps ``{"step", "metrics", "meta"}``."""
        for record in sorted(finished, key=lambda r: r["step"]):
            step = int(record["step"])
            self.last_emitted = step
            self._emitted[step] = frozenset(record.get("meta", {}).get("ranks", ()))
            if self.newest_closed is None or step > self.newest_closed:
                self.newest_closed = step
            cumulative = record.get("meta", {}).get("cumulative")
            if cumulative:
                self.deriver.restore(cumulative)
        while len(self._emitted) > self._remember_steps:
            self._emitted.popitem(last=False)

    # -- output ------------------------------------------------------------------------
    def _emit_ready(self) -> list[StepResult]:
        out: list[StepResult] = []
        while self._pending:
            step = min(self._pending)
            pending = self._pending[step]
            if not pending.ready:
                break
            del self._pending[step]
            out.append(self._finish(pending))
            self.last_emitted = step
            self._emitted[step] = frozenset(pending.closed)
            while len(self._emitted) > self._remember_steps:
                self._emitted.popitem(last=False)
        return out

    def _metrics(self, merged: tuple, keys: list[str], kinds: list[ReduceType],
                 internal: list[int], derive: bool = True) -> dict[str, float]:
        """Finalise the public keys; derive metrics from the ``internal`` ones (their rows)."""
        data, _, sketches = merged
        public = np.setdiff1d(np.arange(len(keys)), internal)
        metrics = finalize(
            [keys[i] for i in public],
            [kinds[i] for i in public],
            data[public],
            sketches={j: sketches[i] for j, i in enumerate(public) if i in sketches},
            rules=self.output,
            rename=self._rename,
        )
        if derive:
            derived = self.deriver.derive({keys[i]: (kinds[i], data[i]) for i in internal},
                                          self.output)
            metrics.update({self._rename(k): v for k, v in derived.items()})
        return metrics

    def _finish(self, p: PendingStep) -> StepResult:
        kinds = [self._resolver.resolve(k, int(c)) for k, c in zip(p.keys, p.codes)]
        merged = p.merged()
        internal = _internal_rows(p.keys)
        metrics = self._metrics(merged, p.keys, kinds, internal)
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
        if self.deriver.cumulative:
            meta["cumulative"] = self.deriver.state()
        meta.update(_anomalies(p, kinds, merged))
        ignored = [p.keys[i] for i in internal if not self.deriver.handles(p.keys[i])]
        if ignored:
            meta["internal_ignored"] = ignored  # "__"-keys are never exported: say so
        return StepResult(p.step, metrics, meta)

    # -- introspection -----------------------------------------------------------------
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


def _internal_rows(keys: list[str]) -> list[int]:
    """Return the rows of internal keys (a ``__`` path segment): derivation inputs only."""
    return [i for i, key in enumerate(keys)
            if (key.startswith("__") or "/__" in key) and split_internal(key) is not None]


def _anomalies(p: PendingStep, kinds: list[ReduceType], merged: tuple) -> dict[str, Any]:
    """Return the meta entries that flag values a user should not trust blindly."""
    data, contributors, _ = merged
    out: dict[str, Any] = {}
    nonfinite = np.flatnonzero(data[:, NONFINITE] > 0)
    if nonfinite.size:
        out["nonfinite"] = {p.keys[i]: int(data[i, NONFINITE]) for i in nonfinite}
    overflow = np.flatnonzero((data[:, COUNT] > 0) & ~np.isfinite(data[:, [SUM, SUMSQ]]).all(1))
    if overflow.size:  # finite values whose sum (or sum of squares) left float64's range
        out["overflow"] = [p.keys[i] for i in overflow]
    want = np.where(p.expected > 0, p.expected, p.world_size or 0)
    off = np.flatnonzero((contributors != want) & ~p.from_stream)
    if off.size:
        out["contributors"] = {p.keys[i]: [int(contributors[i]), int(want[i])] for i in off}
    scalar_clash = [
        p.keys[i]
        for i, kind in enumerate(kinds)
        if kind is ReduceType.SCALAR and data[i, COUNT] > 0 and data[i, MIN] != data[i, MAX]
    ]
    if scalar_clash:
        out["scalar_mismatch"] = scalar_clash
    approx = [k for k, c in zip(p.keys, p.codes) if c == AUTO and is_approximate_plain_key(k)]
    if approx:
        out["approximate"] = approx
    return out
