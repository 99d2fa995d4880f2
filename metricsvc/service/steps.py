"""What the engine holds for a step not final yet, and for a stream window (pure numpy).

Contributions are kept as they arrive ("parts") and merged only when the step finishes,
in a fixed order (ranks by number, then stream windows), so the float sums, and hence the
published values, are identical whatever order the batches arrived in, across retries and
actor restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any

import numpy as np

from metricsvc.core import records
from metricsvc.core.declare import Derived
from metricsvc.core.keys import version_of
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


@dataclass(frozen=True)
class Merged:
    """A collection's records merged in merge order: ``data`` (a record per key), each
    key's kind code, expected contributors and whether a stream sent it, how many ranks
    contributed each, the merged sketches by key row, the parts in merge order with their
    rows and key indices concatenated (where a min or max came from is read there:
    ``StepOutput.extremes``), and a finished step's ``meta`` (``finish``)."""

    data: np.ndarray
    codes: np.ndarray
    expected: np.ndarray
    from_stream: np.ndarray
    contributors: np.ndarray
    sketches: dict[int, Sketch]
    parts: list[Part]
    rows: np.ndarray
    idx: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)
    # stat(top=k): each rank's samples, (rank, key rows in the step, [n, NTOP], payloads)
    tops: list[tuple[int, np.ndarray, np.ndarray, tuple]] = field(default_factory=list)


class Collection:
    """Keys with their reduce codes, and the parts that will merge into them."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.keys: list[str] = []
        self._codes = np.zeros(16, dtype=np.int8)
        self._expected = np.zeros(16, dtype=np.int32)
        self._from_stream = np.zeros(16, dtype=bool)
        self.parts: list[Part] = []
        # key tuple -> its rows and the kinds they hold (at most one per batch of the step)
        self._layouts: dict[tuple[str, ...], tuple[np.ndarray, bytes]] = {}
        self.declared: dict[str, Derived] = {}  # derived metrics declared for these records
        self.about: dict[str, tuple[str, str]] = {}  # what declared names mean (help, unit)
        self._ordered: tuple | None = None  # (parts held, parts in order, rows, key indices)

    def locate(self, keys: Sequence[str], kinds: np.ndarray, who: str) -> np.ndarray:
        """Return each key's row (-1 if new); raise if a key arrives with another kind."""
        if not self.index:  # the step's first contribution: every key is new
            return np.full(len(keys), -1, dtype=np.int64)
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
                f"but {who} sent it as {kind_name(int(kinds[j]))}")
        return idx

    def add(self, part: Part, keys: Sequence[str], kinds: np.ndarray, expected: np.ndarray,
            sketches: Sequence[tuple[int, np.ndarray, np.ndarray]] = (),
            from_stream: bool = False) -> None:
        """Add a located part (``part.idx`` from ``locate``, completed here for new keys)."""
        idx = part.idx
        new = idx < 0
        n_new = int(new.sum())
        if n_new:
            start = len(self.keys)
            if start + n_new > len(self._codes):
                self._grow(start + n_new)
            ids = np.arange(start, start + n_new)
            idx[new] = ids
            fresh = keys if n_new == len(keys) else [k for k, n in zip(keys, new) if n]
            self.keys.extend(fresh)
            self.index.update(zip(fresh, ids.tolist()))
            self._codes[ids] = kinds[new]
        if expected.any():
            self._expected[idx] = np.maximum(self._expected[idx], expected)
        if from_stream:
            self._from_stream[idx] = True
        if isinstance(keys, tuple) and keys not in self._layouts:
            self._layouts[keys] = (idx.copy(), self._codes[idx].tobytes())
        if sketches:
            sketches = [(int(idx[row]), codes, counts) for row, codes, counts in sketches]
        self.parts.append(Part(part.order, part.rank, idx, part.rows, list(sketches),
                               part.sources))

    def declare(self, declarations: Iterable[Derived],
                about: Mapping[str, tuple[str, str]] | None = None) -> None:
        """Note the derived metrics declared for these records (the run's declarations,
        ``RunDeclarations``, say what each name means) and what declared names mean."""
        for decl in declarations:
            self.declared.setdefault(decl.name, decl)
        if about:
            self.about.update(about)

    def _grow(self, n: int) -> None:
        grow = max(n, 2 * len(self._codes)) - len(self._codes)
        self._codes = np.concatenate([self._codes, np.zeros(grow, dtype=np.int8)])
        self._expected = np.concatenate([self._expected, np.zeros(grow, dtype=np.int32)])
        self._from_stream = np.concatenate([self._from_stream, np.zeros(grow, dtype=bool)])

    def merged(self) -> Merged:
        """The parts merged in merge order (ranks by number, then stream windows)."""
        n = len(self.keys)
        held = self._ordered
        if held is None or held[0] != len(self.parts):  # worked out once for the parts held
            parts = sorted(self.parts, key=attrgetter("order"))
            if parts:
                rows = np.concatenate(list(map(attrgetter("rows"), parts)))
                idx = np.concatenate(list(map(attrgetter("idx"), parts)))
            else:
                rows, idx = records.identity(0), np.zeros(0, np.int64)
            held = self._ordered = (len(self.parts), parts, rows, idx)
        _, parts, rows, idx = held
        data = records.merge_grouped(rows, idx, n) if parts else records.identity(n)
        sketch_parts: dict[int, list[Sketch]] = {}
        rank_rows: dict[int, list[np.ndarray]] = {}
        for part in parts:
            for row, codes, counts in part.sketches:
                sketch_parts.setdefault(row, []).append((codes, counts))
            if part.rank is not None:
                rank_rows.setdefault(part.rank, []).append(part.idx)
        # One part's rows are distinct keys; several parts of a rank may share keys.
        held = []
        for of in rank_rows.values():
            held.append(of[0] if len(of) == 1 else np.unique(np.concatenate(of)))
        contributors = (np.bincount(np.concatenate(held), minlength=n).astype(np.int32)
                        if held else np.zeros(n, dtype=np.int32))
        sketches = {}
        for row, of_row in sketch_parts.items():
            sketches[row] = merge_sparse(of_row)
        return Merged(data, self._codes[:n], self._expected[:n], self._from_stream[:n],
                      contributors, sketches, parts, rows, idx)


def _sketches_of(batch: Batch) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """A batch's sketches as ``(row in batch, codes, counts)``."""
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
        # Per stream exported into this step: its records per policy version (version=)
        self.stream_versions: dict[str, dict[int, int]] = {}
        self.tops: list[tuple[int, np.ndarray, np.ndarray, tuple]] = []  # stat(top=k)'s
        self.timed_out = False
        self.stream_only = stream_only  # final with its stream windows alone (no rank)
        # Until the run's world size is agreed: how to rebuild this step without the
        # contributions of ranks that claimed another size (claim, rank, apply).
        self.sources: list[tuple[int | None, int | None, Callable[[PendingStep], None]]] | None \
            = None

    def take(self, batch: Batch, digest: bytes) -> None:
        """Keep a rank's batch as a part (a final batch closes the step for its rank).

        Raises:
            BatchRejected: a key arrives with another kind than the step holds; nothing of
                the batch was kept.
        """
        idx = self.locate(batch.keys, batch.kinds, f"rank {batch.rank} in step {self.step}")
        sources = None
        if batch.extreme_rows.size:
            sources = records.unknown_sources(len(idx))
            sources[batch.extreme_rows] = batch.extremes
        part = Part((0, batch.rank, batch.seq), batch.rank, idx, batch.data, [], sources)
        self.add(part, batch.keys, batch.kinds, batch.expected,
                 _sketches_of(batch) if batch.sketch_rows.size else ())
        if batch.top_rows.size:  # kept with the part (``add`` gave every key its row)
            self.tops.append((batch.rank, idx[batch.top_rows], batch.top, batch.top_text))
        if batch.declared or batch.about:
            self.declare(batch.declared, batch.about)
        self.digests[(batch.rank, batch.seq)] = digest
        self.batches += 1
        if batch.final:
            self.closed.add(batch.rank)

    def take_window(self, name: str, window: Window, order: tuple) -> None:
        """Fold the window of stream ``name`` in, merged as one part (``order``: where it
        merges). Raises ``BatchRejected`` if its keys cannot merge into the step."""
        part, keys, codes, sketches = window.as_part(order)
        versions = [(i, v) for i, k in enumerate(keys)
                    if (v := version_of(k, name)) is not None]
        if versions:  # the records' versions: counted for the step, never exported
            counts = self.stream_versions.setdefault(name, {})
            for i, v in versions:
                counts[v] = counts.get(v, 0) + int(part.rows[i, records.SUM])
            keep = np.ones(len(keys), dtype=bool)
            keep[[i for i, _ in versions]] = False
            row_of = np.cumsum(keep) - 1  # a kept key's row among the kept ones
            keys = [k for k, kept in zip(keys, keep) if kept]
            codes, part = codes[keep], Part(order, None, part.idx[keep], part.rows[keep])
            sketches = [(int(row_of[row]), c, n) for row, c, n in sketches if keep[row]]
        located = Part(order, None, self.locate(keys, codes, f"stream {name!r}"), part.rows)
        self.add(located, keys, codes, np.zeros(len(keys), dtype=np.int32), sketches, True)
        self.declare(window.declared.values(), window.about)
        self.streams.append(name)
        seqs = self.stream_seqs.setdefault(name, {})
        for client, seq in window.last_seq.items():
            seqs[client] = max(seq, seqs.get(client, seq))

    def keep_source(self, claim: int | None, rank: int | None,
                    apply: Callable[[PendingStep], None]) -> None:
        """Remember a contribution made before the world size was agreed."""
        if self.sources is None:
            self.sources = []
        self.sources.append((claim, rank, apply))

    def agreed(self, world_size: int) -> list[tuple[int | None, int | None, Callable]] | None:
        """The run's world size is agreed: return the contributions kept apart until then
        (None: none), and wait for that size."""
        sources, self.sources = self.sources, None
        if self.digests:
            self.world_size = world_size
        return sources

    def time_out(self, now: float, timeout_s: float, recount: bool = False) -> bool:
        """Mark the step timed out if open for ``timeout_s`` or longer (``recount``: only
        then, once the world size changed); return whether it is."""
        late = now - self.opened_at >= timeout_s
        self.timed_out = late if recount else (self.timed_out or late)
        return self.timed_out

    def close_with_streams(self) -> None:
        """No rank submits this step: it is final with its stream windows alone."""
        self.stream_only = True

    def ready(self) -> bool:
        """Whether the step is final: every rank closed it (a step of streams only: closed
        with them), or its straggler timeout passed. A step with ranks in it waits for the
        run's world size even past its timeout."""
        if not self.digests:
            return self.stream_only or self.timed_out
        if self.world_size is None:
            return False
        return len(self.closed) >= self.world_size or self.timed_out

    @property
    def ranks(self) -> list[int]:
        """Every rank that sent a part of this step."""
        return sorted({rank for rank, _ in self.digests})

    def size(self) -> int:
        """The world size this step waits for (before agreement: the largest claim)."""
        if self.world_size is not None:
            return self.world_size
        return max((claim or 0 for claim, _, _ in self.sources or ()), default=0)

    def missing(self) -> list[int]:
        """The ranks that have not closed the step."""
        return sorted(set(range(self.size())) - self.closed)

    def finish(self, now: float) -> Merged:
        """The step merged, with its ``meta``: partial
        or not, its ranks, the missing ones, its batches and keys, its age (first batch to
        final), its streams, and its batches' digests (what tells a resend from a rerun
        after a restart)."""
        size = self.world_size
        complete = (self.stream_only if not self.digests
                    else size is not None and len(self.closed) >= size)
        digests = {}
        for (rank, seq), digest in sorted(self.digests.items()):
            digests[f"{rank}:{seq}"] = digest[:8].hex()
        meta: dict[str, Any] = {
            "partial": not complete, "world_size": size or 0,
            "ranks": sorted(self.closed),
            "missing_ranks": self.missing() if size is None or len(self.closed) < size else [],
            "batches": self.batches, "keys": len(self.keys),
            "age_s": round(now - self.opened_at, 6)}
        if self.stream_versions:
            meta["stream_versions"] = {name: {str(v): n for v, n in sorted(counts.items())}
                                       for name, counts in self.stream_versions.items()}
        if self.streams:
            meta["streams"] = list(self.streams)
            meta["stream_seqs"] = {name: dict(seqs) for name, seqs in self.stream_seqs.items()}
        meta["digests"] = digests
        merged = self.merged()
        merged.meta.update(meta)
        return replace(merged, tops=self.tops) if self.tops else merged

    def summary(self) -> dict[str, Any]:
        return {"closed": sorted(self.closed), "world_size": self.size(), "keys": len(self.keys)}


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
        self.add(part, batch.keys, batch.kinds, batch.expected, _sketches_of(batch), True)
        self.declare(batch.declared, batch.about)
        self.seqs.add((client, batch.seq))
        self.last_seq[client] = max(batch.seq, self.last_seq.get(client, batch.seq))
        return True

    def as_part(self, order: tuple) -> tuple[Part, list[str], np.ndarray, list]:
        """Return the merged window as one part for a step (and the keys, codes, sketches)."""
        merged = self.merged()
        idx = np.full(len(self.keys), -1, dtype=np.int64)
        return Part(order, None, idx, merged.data), list(self.keys), merged.codes.copy(), [
            (row, codes, counts) for row, (codes, counts) in merged.sketches.items()]
