"""What the engine holds for the steps not final yet and for stream windows (pure numpy).

Contributions are kept as they arrive ("parts") and merged only when the step finishes,
in a fixed order (ranks by number, then stream windows), so the float sums, and hence the
published values, are identical whatever order the batches arrived in, across retries and
actor restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from metricsvc.core import records
from metricsvc.core.declare import Derived
from metricsvc.core.limits import Recent
from metricsvc.core.reduce import kind_name
from metricsvc.core.sketch import Sketch, merge_sparse
from metricsvc.core.wire import Batch
from metricsvc.errors import BatchRejected


@dataclass
class Part:
    """One contribution: rows of a batch (or of a stream window) and where they go."""

    order: tuple
    rank: int | None
    idx: np.ndarray
    rows: np.ndarray
    sketches: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)
    sources: np.ndarray | None = None  # where each row's min and max came from, or None


class Collection:
    """Keys with their reduce codes, and the parts that will merge into them."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.keys: list[str] = []
        self._codes = np.zeros(16, dtype=np.int8)
        self._expected = np.zeros(16, dtype=np.int32)
        self._from_stream = np.zeros(16, dtype=bool)
        self.parts: list[Part] = []
        # key tuple -> its rows and the kinds they hold (``kinds.tobytes()``)
        self._layouts: Recent = Recent(64)
        self.declared: dict[str, Derived] = {}  # derived metrics declared for these records
        self.about: dict[str, tuple[str, str]] = {}  # what declared names mean (help, unit)
        self._ordered: tuple | None = None  # (parts held, parts in order, rows, key indices)

    @property
    def codes(self) -> np.ndarray:
        return self._codes[: len(self.keys)]

    @property
    def expected(self) -> np.ndarray:
        return self._expected[: len(self.keys)]

    @property
    def from_stream(self) -> np.ndarray:
        return self._from_stream[: len(self.keys)]

    def locate(self, keys: Sequence[str], kinds: np.ndarray, who: str) -> np.ndarray:
        """Return each key's row (-1 if new); raise if a key arrives with another kind."""
        known = self._layouts.get(keys) if isinstance(keys, tuple) else None
        if known is not None:  # the same key tuple as an earlier batch: no per-key lookups
            if kinds.tobytes() == known[1]:  # and the same kinds: none can clash
                return known[0].copy()
            idx = known[0].copy()
        else:
            get = self.index.get
            idx = np.fromiter((get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        old = idx >= 0
        clash = self._codes[idx[old]] != kinds[old]
        if clash.any():
            j = int(np.flatnonzero(old)[np.flatnonzero(clash)[0]])
            raise BatchRejected(
                f"key {keys[j]!r}: recorded as {kind_name(int(self._codes[idx[j]]))}, "
                f"but {who} sent it as {kind_name(int(kinds[j]))}"
            )
        return idx

    def add(
        self,
        part: Part,
        keys: Sequence[str],
        kinds: np.ndarray,
        expected: np.ndarray,
        sketches: Sequence[tuple[int, np.ndarray, np.ndarray]] = (),
        from_stream: bool = False,
    ) -> None:
        """Add a located part (``part.idx`` from ``locate``, completed here for new keys)."""
        idx = part.idx
        new = idx < 0
        n_new = int(new.sum())
        if n_new:
            start = len(self.keys)
            self._reserve(start + n_new)
            ids = np.arange(start, start + n_new)
            idx[new] = ids
            new_keys = [k for k, is_new in zip(keys, new) if is_new]
            self.keys.extend(new_keys)
            self.index.update(zip(new_keys, ids.tolist()))
            self._codes[ids] = kinds[new]
        self._expected[idx] = np.maximum(self._expected[idx], expected)
        if from_stream:
            self._from_stream[idx] = True
        if isinstance(keys, tuple) and keys not in self._layouts:
            self._layouts[keys] = (idx.copy(), self._codes[idx].tobytes())
        self.parts.append(Part(part.order, part.rank, idx, part.rows,
                               [(int(idx[row]), codes, counts) for row, codes, counts in sketches],
                               part.sources))

    def declare(self, declarations: Iterable[Derived],
                about: dict[str, tuple[str, str]] | None = None) -> None:
        """Note the derived metrics declared for these records (the run's declarations,
        ``RunDeclarations``, say what each name means) and what declared names mean."""
        for decl in declarations:
            self.declared.setdefault(decl.name, decl)
        if about:
            self.about.update(about)

    def _reserve(self, n: int) -> None:
        cap = len(self._codes)
        if n <= cap:
            return
        grow = max(n, 2 * cap) - cap
        self._codes = np.concatenate([self._codes, np.zeros(grow, dtype=np.int8)])
        self._expected = np.concatenate([self._expected, np.zeros(grow, dtype=np.int32)])
        self._from_stream = np.concatenate([self._from_stream, np.zeros(grow, dtype=bool)])

    def merged(self) -> tuple[np.ndarray, np.ndarray, dict[int, Sketch]]:
        """Return merged rows, ranks contributing to each row, and merged sketches."""
        n = len(self.keys)
        sketch_parts: dict[int, list[Sketch]] = {}
        rank_rows: dict[int, list[np.ndarray]] = {}
        parts, rows, idx = self._in_order()
        data = records.merge_grouped(rows, idx, n) if parts else records.identity(n)
        for part in parts:
            for row, codes, counts in part.sketches:
                sketch_parts.setdefault(row, []).append((codes, counts))
            if part.rank is not None:
                rank_rows.setdefault(part.rank, []).append(part.idx)
        # One part's rows are distinct keys; several parts of a rank may share keys.
        held = [rows_of[0] if len(rows_of) == 1 else np.unique(np.concatenate(rows_of))
                for rows_of in rank_rows.values()]
        contributors = (np.bincount(np.concatenate(held), minlength=n).astype(np.int32)
                        if held else np.zeros(n, dtype=np.int32))
        return data, contributors, {r: merge_sparse(p) for r, p in sketch_parts.items()}

    def _in_order(self) -> tuple[list[Part], np.ndarray, np.ndarray]:
        """The parts in merge order (ranks by number, then stream windows) and their rows
        and key indices concatenated; worked out once for the parts held."""
        held = self._ordered
        if held is None or held[0] != len(self.parts):
            parts = sorted(self.parts, key=lambda p: p.order)
            rows = np.concatenate([p.rows for p in parts]) if parts else records.identity(0)
            idx = np.concatenate([p.idx for p in parts]) if parts else np.zeros(0, np.int64)
            held = self._ordered = (len(self.parts), parts, rows, idx)
        return held[1], held[2], held[3]

    def extremes(self, data: np.ndarray) -> list[tuple[np.ndarray, list[Part], Any]]:
        """Return, for the min and for the max of the merged records ``data``, the part each
        key's value came from and that part's source rows (``core.extremes``; None where no
        part carries any): ``(winner per key, -1 for none; the parts in merge order;
        sources)``. The first part in merge order holding the value wins (ranks by number,
        then batches)."""
        parts, rows, idx = self._in_order()
        if not parts:
            return []
        owner = np.repeat(np.arange(len(parts)), [len(p.idx) for p in parts])
        carried = any(p.sources is not None for p in parts)
        known = np.concatenate([p.sources if p.sources is not None
                                else records.unknown_sources(len(p.idx)) for p in parts]) \
            if carried else None
        out = []
        for won in records.winners(rows, idx, data):
            hit = won >= 0
            part_of = np.full(len(won), -1, dtype=np.int64)
            part_of[hit] = owner[won[hit]]
            src = None
            if known is not None:
                src = records.unknown_sources(len(won))
                src[hit] = known[won[hit]]
            out.append((part_of, parts, src))
        return out


def batch_sketches(batch: Batch) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Return a batch's sketches as ``(row in batch, codes, counts)``."""
    return [(int(row), *batch.sketch(j)) for j, row in enumerate(batch.sketch_rows.tolist())]


class PendingStep(Collection):
    """A step that is not final yet: its parts, and which ranks have closed it."""

    def __init__(self, step: int, world_size: int | None, now: float,
                 stream_only: bool = False) -> None:
        super().__init__()
        self.step = step
        self.world_size = world_size  # None until a rank's batch arrives (stream-only so far)
        self.opened_at = now
        self.closed: set[int] = set()
        self.digests: dict[tuple[int, int], bytes] = {}  # (rank, seq) -> content digest
        self.batches = 0
        self.streams: list[str] = []
        # Per stream exported into this step: each client's newest batch (seq) it holds
        self.stream_seqs: dict[str, dict[str, int]] = {}
        self.timed_out = False
        self.stream_only = stream_only  # final with its stream windows alone (no rank)
        # Until the run's world size is agreed: how to rebuild this step without the
        # contributions of ranks that claimed another size (claim, rank, apply).
        self.sources: list[tuple[int | None, int | None, Callable[[PendingStep], None]]] | None \
            = None

    def keep_source(self, claim: int | None, rank: int | None,
                    apply: Callable[[PendingStep], None]) -> None:
        """Remember a contribution made before the world size was agreed."""
        if self.sources is None:
            self.sources = []
        self.sources.append((claim, rank, apply))

    def time_out(self, now: float, timeout_s: float, recount: bool = False) -> bool:
        """Mark the step timed out if open for ``timeout_s`` or longer (``recount``: only
        then, once the world size changed); return whether it is."""
        late = now - self.opened_at >= timeout_s
        self.timed_out = late if recount else (self.timed_out or late)
        return self.timed_out

    def close_with_streams(self) -> None:
        """No rank submits this step: it is final with its stream windows alone."""
        self.stream_only = True

    def agreed(self, world_size: int) -> list[tuple[int | None, int | None, Callable]] | None:
        """The run's world size is agreed: return the contributions kept apart until then
        (None: none), and wait for that size."""
        sources, self.sources = self.sources, None
        if self.ranks:
            self.world_size = world_size
        return sources

    def check(self, batch: Batch) -> np.ndarray:
        """Return the row of each batch key (-1 if new); raise if a key changes its kind."""
        return self.locate(batch.keys, batch.kinds, f"rank {batch.rank} in step {self.step}")

    def add_batch(self, batch: Batch, idx: np.ndarray, digest: bytes) -> None:
        """Keep a checked batch as a part; a final batch closes the step for its rank."""
        sources = None
        if batch.extreme_rows.size:
            sources = records.unknown_sources(len(idx))
            sources[batch.extreme_rows] = batch.extremes
        part = Part((0, batch.rank, batch.seq), batch.rank, idx, batch.data, [], sources)
        self.add(part, batch.keys, batch.kinds, batch.expected, batch_sketches(batch))
        self.declare(batch.declared, batch.about)
        self.digests[(batch.rank, batch.seq)] = digest
        self.batches += 1
        if batch.final:
            self.closed.add(batch.rank)

    def take_window(self, name: str, window: Window, order: tuple) -> None:
        """Fold the window of stream ``name`` in, merged as one part (``order``: where it
        merges). Raises ``BatchRejected`` if its keys cannot merge into the step."""
        part, keys, codes, sketches = window.as_part(order)
        located = Part(order, None, self.locate(keys, codes, f"stream {name!r}"), part.rows)
        self.add(located, keys, codes, np.zeros(len(keys), dtype=np.int32), sketches, True)
        self.declare(window.declared.values(), window.about)
        self.streams.append(name)
        seqs = self.stream_seqs.setdefault(name, {})
        for client, seq in window.last_seq.items():
            seqs[client] = max(seq, seqs.get(client, seq))

    @property
    def ranks(self) -> list[int]:
        """Return every rank that sent a part of this step."""
        return sorted({rank for rank, _ in self.digests})

    @property
    def complete(self) -> bool:
        if not self.digests:  # no rank has sent anything: streams only
            return self.stream_only
        return self.world_size is not None and len(self.closed) >= self.world_size

    @property
    def ready(self) -> bool:
        # A step with ranks in it waits for the run's world size even past its timeout.
        return self.complete or (self.timed_out and (self.world_size is not None
                                                     or not self.digests))

    @property
    def size(self) -> int:
        """Return the world size this step waits for (before agreement: the largest claim)."""
        if self.world_size is not None:
            return self.world_size
        return max((claim or 0 for claim, _, _ in self.sources or ()), default=0)

    def missing(self) -> list[int]:
        return sorted(set(range(self.size)) - self.closed)

    def summary(self) -> dict[str, Any]:
        return {"closed": sorted(self.closed), "world_size": self.size, "keys": len(self.keys)}


class Window(Collection):
    """A stream's records since its last export, from any number of clients."""

    def __init__(self) -> None:
        super().__init__()
        self.seqs: set[tuple[str, int]] = set()
        self.last_seq: dict[str, int] = {}  # each client's newest batch in the window

    def add_batch(self, client: str, batch: Batch) -> bool:
        """Keep a stream batch; False (and nothing kept) if it was seen before."""
        if (client, batch.seq) in self.seqs:
            return False
        idx = self.locate(batch.keys, batch.kinds, f"stream client {client}")
        part = Part((client, batch.seq), None, idx, batch.data)
        self.add(part, batch.keys, batch.kinds, batch.expected, batch_sketches(batch), True)
        self.declare(batch.declared, batch.about)
        self.seqs.add((client, batch.seq))
        self.last_seq[client] = max(batch.seq, self.last_seq.get(client, batch.seq))
        return True

    def as_part(self, order: tuple) -> tuple[Part, list[str], np.ndarray, list]:
        """Return the merged window as one part for a step (and the keys, codes, sketches)."""
        data, _, sketches = self.merged()
        idx = np.full(len(self.keys), -1, dtype=np.int64)
        part = Part(order, None, idx, data)
        return part, list(self.keys), self.codes.copy(), [
            (row, codes, counts) for row, (codes, counts) in sketches.items()
        ]


class PendingSteps(dict[int, PendingStep]):
    """Step -> its ``PendingStep``, for the steps not published yet."""

    def anchor(self, last_emitted: int | None) -> int | None:
        """Return the oldest step still open (None before the first batch of a run)."""
        open_steps = list(self)
        if last_emitted is not None:
            open_steps.append(last_emitted + 1)
        return min(open_steps, default=None)

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
