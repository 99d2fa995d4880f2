"""Step state machine (pure Python and numpy, no Ray): batches in, finished steps out.

A step is final when ``world_size`` distinct ranks have sent a ``final`` batch
for it, or when its straggler timeout passes (then it is *partial*). Finished
steps leave strictly in step order. Retries are idempotent on
``(step, rank, seq)``; a batch for a step already emitted is *late*: counted,
reported, never merged into a published value.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from metricsvc import records
from metricsvc.derive import Deriver, split_internal
from metricsvc.records import COUNT, MAX, MIN, NONFINITE, Batch
from metricsvc.reduce import (
    AUTO,
    KindResolver,
    OutputRules,
    ReduceType,
    Renamer,
    finalize,
    is_approximate_plain_key,
)
from metricsvc.sketch import merge_sparse
from metricsvc.validation import BatchRejected, Limits, check_batch

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


def _kind_name(code: int) -> str:
    return "AUTO" if code == AUTO else ReduceType(code).name


class _PendingStep:
    """Merged records of one step that is not final yet."""

    def __init__(self, step: int, world_size: int, now: float) -> None:
        self.step = step
        self.world_size = world_size
        self.opened_at = now
        self.index: dict[str, int] = {}
        self.keys: list[str] = []
        self.data = records.identity(16)
        self.codes = np.zeros(16, dtype=np.int8)
        self.expected = np.zeros(16, dtype=np.int32)
        self.contributors = np.zeros(16, dtype=np.int32)
        self.closed: set[int] = set()
        self.seqs: set[tuple[int, int]] = set()
        self.rank_rows: dict[int, np.ndarray] = {}
        self.sketches: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.batches = 0
        self.timed_out = False

    def check(self, batch: Batch) -> np.ndarray:
        """Return the row of each batch key (-1 if new); raise if the batch cannot merge."""
        if batch.world_size != self.world_size:
            raise BatchRejected(
                f"step {self.step}: rank {batch.rank} sent world_size {batch.world_size}, "
                f"but the step was opened with world_size {self.world_size}"
            )
        if batch.rank in self.closed:
            raise BatchRejected(
                f"step {self.step}: rank {batch.rank} already closed this step "
                f"(new seq {batch.seq})"
            )
        get = self.index.get
        idx = np.fromiter((get(k, -1) for k in batch.keys), dtype=np.int64, count=len(batch.keys))
        old = idx >= 0
        clash = self.codes[idx[old]] != batch.kinds[old]
        if clash.any():
            j = int(np.flatnonzero(old)[np.flatnonzero(clash)[0]])
            raise BatchRejected(
                f"key {batch.keys[j]!r}: recorded as {_kind_name(int(self.codes[idx[j]]))} "
                f"in step {self.step}, but rank {batch.rank} sent it as "
                f"{_kind_name(int(batch.kinds[j]))}"
            )
        return idx

    def merge(self, batch: Batch, idx: np.ndarray) -> None:
        """Merge a checked batch; ``idx`` comes from ``check`` and is completed in place."""
        new = idx < 0
        n_new = int(new.sum())
        if n_new:
            start = len(self.keys)
            self._reserve(start + n_new)
            ids = np.arange(start, start + n_new)
            idx[new] = ids
            new_keys = [k for k, is_new in zip(batch.keys, new) if is_new]
            self.keys.extend(new_keys)
            self.index.update(zip(new_keys, ids.tolist()))
            self.codes[ids] = batch.kinds[new]
        self.expected[idx] = np.maximum(self.expected[idx], batch.expected)
        records.merge_into(self.data, batch.data, idx)
        for j, row in enumerate(batch.sketch_rows.tolist()):
            self.sketches.setdefault(int(idx[row]), []).append(batch.sketch(j))
        seen = self.rank_rows.get(batch.rank)
        fresh = idx if seen is None else idx[~np.isin(idx, seen)]
        self.contributors[fresh] += 1
        self.rank_rows[batch.rank] = idx if seen is None else np.union1d(seen, idx)
        self.seqs.add((batch.rank, batch.seq))
        self.batches += 1
        if batch.final:
            self.closed.add(batch.rank)

    def _reserve(self, n: int) -> None:
        cap = len(self.codes)
        if n <= cap:
            return
        new_cap = max(n, 2 * cap)
        grow = new_cap - cap
        self.data = np.vstack([self.data, records.identity(grow)])
        self.codes = np.concatenate([self.codes, np.zeros(grow, dtype=np.int8)])
        self.expected = np.concatenate([self.expected, np.zeros(grow, dtype=np.int32)])
        self.contributors = np.concatenate([self.contributors, np.zeros(grow, dtype=np.int32)])

    @property
    def complete(self) -> bool:
        return len(self.closed) >= self.world_size

    @property
    def ready(self) -> bool:
        return self.complete or self.timed_out


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
        self._clock = clock
        self._pending: dict[int, _PendingStep] = {}
        # (rank, seq) pairs of emitted steps, so a retried batch reads as duplicate, not late.
        self._emitted_seqs: OrderedDict[int, set[tuple[int, int]]] = OrderedDict()
        self._remember_steps = remember_steps
        self.last_emitted: int | None = None
        self.newest_closed: int | None = None
        self.counts = {"batches": 0, "duplicate": 0, "late": 0, "rejected": 0, "partial": 0}

    # -- input -------------------------------------------------------------------------
    def submit(self, batch: Batch) -> Outcome:
        """Merge one batch; return its status and any steps that became final.

        Raises:
            BatchRejected: the batch is malformed or contradicts its step; nothing
                of it was merged and no state changed.
        """
        try:
            return self._submit(check_batch(batch, self.limits))
        except BatchRejected:
            self.counts["rejected"] += 1
            raise

    def _submit(self, batch: Batch) -> Outcome:
        step = batch.step
        pending = self._pending.get(step)
        if pending is None:
            emitted = self._emitted_seqs.get(step)
            if emitted is not None and (batch.rank, batch.seq) in emitted:
                self.counts["duplicate"] += 1
                return Outcome("duplicate")
            if self.last_emitted is not None and step <= self.last_emitted:
                self.counts["late"] += 1
                return Outcome("late")
            if len(self._pending) >= self.max_pending_steps:
                raise BatchRejected(
                    f"step {step}: {len(self._pending)} steps are already pending "
                    f"(limit max_pending_steps={self.max_pending_steps}); "
                    f"oldest pending is {min(self._pending)}"
                )
        elif (batch.rank, batch.seq) in pending.seqs:
            self.counts["duplicate"] += 1
            return Outcome("duplicate")
        if batch.sketch_rows.size and batch.sketch_alpha != self.output.sketch.alpha:
            key = batch.keys[int(batch.sketch_rows[0])]
            raise BatchRejected(
                f"key {key!r}: quantile sketch alpha {batch.sketch_alpha} from rank "
                f"{batch.rank} cannot merge with the service's alpha {self.output.sketch.alpha}"
            )
        target = pending or _PendingStep(step, batch.world_size, self._clock())
        idx = target.check(batch)
        self._pending[step] = target
        target.merge(batch, idx)
        self.counts["batches"] += 1
        if batch.final and (self.newest_closed is None or step > self.newest_closed):
            self.newest_closed = step
        return Outcome("merged", self._emit_ready())

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

    def next_deadline(self) -> float | None:
        """Return the clock time at which the oldest pending step times out, if any."""
        if self.straggler_timeout_s is None or not self._pending:
            return None
        return min(p.opened_at for p in self._pending.values()) + self.straggler_timeout_s

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
            self._emitted_seqs[step] = pending.seqs
            while len(self._emitted_seqs) > self._remember_steps:
                self._emitted_seqs.popitem(last=False)
        return out

    def _finish(self, p: _PendingStep) -> StepResult:
        n = len(p.keys)
        data, codes = p.data[:n], p.codes[:n]
        kinds = [self._resolver.resolve(k, int(c)) for k, c in zip(p.keys, codes)]
        sketches = {i: merge_sparse(parts) for i, parts in p.sketches.items()}
        internal = [i for i, key in enumerate(p.keys) if split_internal(key) is not None]
        public = np.setdiff1d(np.arange(n), internal)
        metrics = finalize(
            [p.keys[i] for i in public],
            [kinds[i] for i in public],
            data[public],
            sketches={j: sketches[i] for j, i in enumerate(public) if i in sketches},
            rules=self.output,
            rename=self._rename,
        )
        derived = self.deriver.derive({p.keys[i]: (kinds[i], data[i]) for i in internal},
                                      self.output)
        metrics.update({self._rename(k): v for k, v in derived.items()})
        partial = not p.complete
        if partial:
            self.counts["partial"] += 1
        meta: dict[str, Any] = {
            "partial": partial,
            "world_size": p.world_size,
            "ranks": sorted(p.closed),
            "missing_ranks": sorted(set(range(p.world_size)) - p.closed),
            "batches": p.batches,
            "keys": n,
        }
        meta.update(_anomalies(p, kinds, data))
        return StepResult(p.step, metrics, meta)

    # -- introspection -----------------------------------------------------------------
    def pending_summary(self) -> dict[int, dict[str, Any]]:
        """Return, per pending step, which ranks have closed it and how many keys it holds."""
        return {
            s: {"closed": sorted(p.closed), "world_size": p.world_size, "keys": len(p.keys)}
            for s, p in sorted(self._pending.items())
        }

    def missing_ranks(self, step: int) -> list[int] | None:
        """Return the ranks that have not closed a pending step, or None if it is not pending."""
        p = self._pending.get(step)
        return None if p is None else sorted(set(range(p.world_size)) - p.closed)


def _anomalies(p: _PendingStep, kinds: list[ReduceType], data: np.ndarray) -> dict[str, Any]:
    """Return the meta entries that flag values a user should not trust blindly."""
    n = len(p.keys)
    out: dict[str, Any] = {}
    nonfinite = np.flatnonzero(data[:, NONFINITE] > 0)
    if nonfinite.size:
        out["nonfinite"] = {p.keys[i]: int(data[i, NONFINITE]) for i in nonfinite}
    want = np.where(p.expected[:n] > 0, p.expected[:n], p.world_size)
    off = np.flatnonzero(p.contributors[:n] != want)
    if off.size:
        out["contributors"] = {p.keys[i]: [int(p.contributors[i]), int(want[i])] for i in off}
    scalar_clash = [
        p.keys[i]
        for i, kind in enumerate(kinds)
        if kind is ReduceType.SCALAR and data[i, COUNT] > 0 and data[i, MIN] != data[i, MAX]
    ]
    if scalar_clash:
        out["scalar_mismatch"] = scalar_clash
    approx = [
        k for k, c in zip(p.keys, p.codes[:n]) if c == AUTO and is_approximate_plain_key(k)
    ]
    if approx:
        out["approximate"] = approx
    return out

