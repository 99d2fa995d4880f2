"""The records one client holds before a flush: merged locally, built into one wire batch."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from metricsvc.client.blocks import (
    _Block,
    _Entry,
    _plain_block,
    by_code,
    code_of,
    columns,
    own_entries,
)
from metricsvc.client.declarations import ClientDeclarations
from metricsvc.client.device import _on_host
from metricsvc.client.extremes import merge_row_sources, summarize_located
from metricsvc.client.names import ExportedNames
from metricsvc.client.summarize import (
    add_sketches,
    element_rows,
    merge_rows_on_device,
    sketch,
    summarize,
    summarize_many,
    to_host,
)
from metricsvc.client.tensors import MaskCache, Row, is_tensor
from metricsvc.client.vectors import summarize_each
from metricsvc.protocol import (
    AUTO,
    KINDS,
    NFIELDS,
    Batch,
    Derived,
    Metric,
    ReduceType,
    SketchSpec,
    check_key,
    dense_to_sparse,
    is_internal,
    kind_name,
    merge,
    scalar_row,
)


def _merge_on_host(pairs: list[tuple[_Entry, np.ndarray, np.ndarray]]) -> None:
    """Merge each ``(entry, its row, a row recorded again)`` on the host, in one merge."""
    if pairs:
        merged = merge(np.array([a for _, a, _ in pairs]), np.array([b for _, _, b in pairs]))
        for (entry, _, _), row in zip(pairs, merged):
            entry.row = row


def _merge_on_device(pairs: list[tuple[_Entry, Row, Row]]) -> None:
    """Merge each ``(entry, its row, a row recorded again)``, either on a device, where the
    device row is: one stacked merge per device (``merge_rows_on_device``)."""
    if pairs:
        for (entry, _, _), row in zip(pairs, merge_rows_on_device([(a, b) for _, a, b in pairs])):
            entry.row = row


def _host_view(row: Row) -> np.ndarray | None:
    """A host row as numpy (a CPU tensor's row is a view of it, no copy); None for a row on
    a device (or on the accelerator path), which merges where it is."""
    if not is_tensor(row):
        return row
    return row.numpy() if _on_host(row, None) else None


def _entry_columns(held: list[tuple[str, _Entry]], entries: list[_Entry],
                   spec: Any) -> tuple[list, list, dict, dict, int]:
    """The keys, rows (one host copy per device), sparse sketches and extremes' sources of
    the entries ``held`` (``entries``: their records), and the copies made; nothing for a
    step of plain numbers only (its blocks hold every key)."""
    if not held:
        return [], [], {}, {}, 0
    dense = [i for i, e in enumerate(entries) if e.sketch is not None and is_tensor(e.sketch)]
    located = [i for i, e in enumerate(entries) if e.sources is not None]
    parts, copies = to_host([e.row for e in entries] + [entries[i].sketch for i in dense]
                            + [entries[i].sources for i in located])
    k = len(entries)
    sketches = {i: e.sketch for i, e in enumerate(entries)
                if e.sketch is not None and not is_tensor(e.sketch)}
    sketches.update({i: dense_to_sparse(parts[k + j], spec) for j, i in enumerate(dense)})
    start = k + len(dense)
    extremes = {i: parts[start + j] for j, i in enumerate(located)}
    return [key for key, _ in held], [np.reshape(parts[:k], (k, NFIELDS))], sketches, \
        extremes, copies


class RecordBuffer:
    """Keys recorded since the last flush, each one merged record (and sketch) on its device."""

    def __init__(self, sketch_spec: SketchSpec | None = None, compile: bool | None = None):
        self.sketch_spec = sketch_spec or SketchSpec()
        self.compile = compile
        self.lock = threading.RLock()
        self._entries: dict[str, _Entry | _Block] = {}  # key -> its record (or its block)
        self._blocks: list[_Block] = []
        self._masks = MaskCache()  # one mask preparation per mask per step
        self._good_keys: set[str] = set()  # names already checked (they recur every step)
        self.declarations = ClientDeclarations()  # derived metrics and what names mean
        self.names = ExportedNames(self)  # which key of the step exports each name
        self.trackers: dict[str, Any] = {}  # named trackers, by prefix (Tracker.get)
        self._attached: list[Any] = []  # what records here and has step-scoped state
        self.host_copies = 0
        self.label = "this step"  # how errors name the open window
        self.on_record: Any = None  # called after each successful recording (auto-flush)

    # -- trackers ------------------------------------------------------------------------
    def attach(self, tracker: Any) -> None:
        """Let ``tracker`` record here; its ``end_step()`` is called as each step ends."""
        with self.lock:
            self._attached.append(tracker)

    # -- recording -----------------------------------------------------------------------
    def record_plain(self, metrics: Mapping[str, Any], expected: int) -> None:
        """Record a plain dict whose reductions the service takes from the key names."""
        keys = tuple(metrics)
        if not self._good_keys.issuperset(keys):  # else every name was checked before
            keys = tuple(self.checked(k) for k in keys)
        block = _plain_block(list(metrics.values()))  # the common case: a dict of floats
        if block is not None:
            return self._record_block(keys, block, AUTO, expected)
        rows = [summarize(v, key=k, compile=self.compile) for k, v in metrics.items()]
        self._record_all(dict(zip(keys, rows)), AUTO, expected)

    def checked(self, key: str) -> str:
        """Return ``key`` if it is a usable name here (key rules; an internal key must be
        read by a declared metric); each key is checked once (keys recur every step)."""
        if key not in self._good_keys:
            self.check_internal(check_key(key))
            if len(self._good_keys) < 100_000:
                self._good_keys.add(key)
        return key

    def check_internal(self, key: str) -> str:
        """Refuse an internal key (a ``__`` path segment) that no declared metric reads."""
        if is_internal(key) and not self.declarations.reads(key):
            raise ValueError(
                f"key {key!r}: a path segment starting with '__' marks an input of a derived "
                f"metric, and no metric declared in this client reads it; declare the metric "
                f"first (declare(Derived(...))) or rename the key"
            )
        return key

    # -- declarations --------------------------------------------------------------------
    def declare(self, *declarations: Derived) -> None:
        """Declare derived metrics for every step: sent with each batch, evaluated by the
        service over the merged records of their inputs (declaring one again: harmless).

        Raises:
            TypeError: not a ``Derived``.
            ValueError: a name declared before with another formula or inputs, or one a
                key recorded in this step exports (the names are named).
        """
        if not self.declarations.holds(declarations):  # else: as each step declares again
            with self.lock:
                self.declarations.declare(declarations, self.names.owner, self.label)

    def describe(self, *metrics: Metric | Derived, under: Any = None) -> None:
        """Say what ``metrics`` mean: the help and unit of each go to the service with the
        next batch, once (the service journals them and gives them to the sinks).
        ``under(name)``: the key a tracker records ``name`` as (its prefix and scopes)."""
        with self.lock:
            self.declarations.describe(metrics, under)

    @property
    def declared(self) -> dict[str, Derived]:
        """Return the derived metrics declared in this client, by name."""
        return dict(self.declarations.held)

    def record(self, values: Mapping[str, Any], mask: Any, kind: ReduceType,
               ids: Any = None) -> None:
        """Summarise ``{full key: value}`` under one mask and merge into the buffer; with
        ``ids`` (one per row), where each min and max lies too (``client.extremes``)."""
        block = None if mask is not None or ids is not None or KINDS[kind].sketch \
            else _plain_block(list(values.values()))  # plain numbers: timings, counters
        if block is not None:
            return self._record_block(tuple(values), block, int(kind), 0)
        with self.lock:  # the mask cache's scratch buffers serve one summary at a time
            rows, sources = (summarize_many(values, mask, compile=self.compile,
                                            cache=self._masks), None) if ids is None else \
                summarize_located(values, mask, ids, compile=self.compile, cache=self._masks)
        sketches = None
        if KINDS[kind].sketch:
            sketches = {k: sketch(v, mask, self.sketch_spec, key=k) for k, v in values.items()}
        self._record_all(rows, int(kind), 0, sketches, sources)

    def record_each(self, values: Mapping[str, tuple[Any, Any]],
                    kinds: Mapping[str, ReduceType]) -> None:
        """Summarise ``{full key: (value, mask)}``, each key under its own mask and with its
        kind (short host vectors in one pass: ``client.vectors``); merge into the buffer."""
        with self.lock:  # the mask cache's scratch buffers serve one summary at a time
            rows = summarize_each(values, compile=self.compile, cache=self._masks)
        groups: dict[int, dict[str, Row]] = {}
        for key, row in rows.items():
            groups.setdefault(int(kinds[key]), {})[key] = row
        for code, group in groups.items():
            self._record_all(group, code, 0)

    def record_elements(self, keys: list[str], values: Any, kind: ReduceType) -> None:
        """Record element ``i`` of ``values`` as one value (count 1) of ``keys[i]``."""
        rows = element_rows(values, key=keys[0] if keys else "value")
        if len(rows) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(rows)} values (first key {keys[0]!r})")
        self._record_all(dict(zip(keys, rows)), int(kind), 0)

    def record_weighted(self, key: str, value: float, weight: float) -> None:
        if not weight >= 0:
            raise ValueError(f"weight for key {key!r} must be >= 0, got {weight}")
        self._record_all({key: scalar_row(float(value), float(weight))}, int(ReduceType.AVG), 0)

    def _record_all(
        self,
        rows: dict[str, Row],
        code: int,
        expected: int,
        sketches: dict[str, Row] | None = None,
        sources: dict[str, Row] | None = None,
    ) -> None:
        with self.lock:
            entries = self._entries
            if sketches is None and sources is None and entries.keys().isdisjoint(rows):
                # Keys new in this step (the common case): nothing to merge with.
                self.names.claim(rows, code, self._entries, fresh=True)
                entries.update(zip(rows, [_Entry(code, expected, row) for row in rows.values()]))
            else:
                self._merge_rows(rows, code, expected, sketches, sources or {})
        if self.on_record is not None:
            self.on_record()

    def _record_block(self, keys: tuple[str, ...], rows: np.ndarray,
                      code: int | tuple[int, ...], expected: int) -> None:
        with self.lock:
            entries = self._entries
            if entries.keys().isdisjoint(keys):  # new in this step: kept as one block
                self.names.claim(keys, code, entries, fresh=True)
                block = _Block(code, expected, keys, rows)
                entries.update(dict.fromkeys(keys, block))
                self._blocks.append(block)
            else:  # recorded before in this step: the same dict again is one merge
                held = entries[keys[0]]
                if not (held.__class__ is _Block and held.merged(keys, rows, code, expected)):
                    for c, group in (by_code(keys, code, rows) if code.__class__ is tuple
                                     else {code: dict(zip(keys, rows))}).items():  # kind by kind
                        self._merge_rows(group, c, expected, None, {})
        if self.on_record is not None:
            self.on_record()

    def _merge_rows(self, rows: dict[str, Row], code: int, expected: int,
                    sketches: dict[str, Row] | None, sources: dict[str, Row]) -> None:
        entries = self._entries
        # Check every key before touching the buffer: a bad call records nothing.
        for key in rows:
            held = code_of(entries.get(key), key)
            if held is not None and held != code:
                raise ValueError(f"key {key!r} was recorded as {kind_name(held)} in {self.label}; "
                                 f"recording it as {kind_name(code)} would mix reductions")
        self.names.claim(rows, code, self._entries)
        on_host: list[tuple[_Entry, Row, Row]] = []  # the host rows: merged as one
        on_device: list[tuple[_Entry, Row, Row]] = []  # the rest: one merge per device
        for key, row in rows.items():
            sk = None if sketches is None else sketches[key]
            src = sources.get(key)
            entry = entries.get(key)
            if entry.__class__ is _Block:
                entry = entries[key] = entry.take(key)
            if entry is None:
                entries[key] = _Entry(code, expected, row, sk, src)
                continue
            if src is not None or entry.sources is not None:  # from the rows before merging
                entry.sources = merge_row_sources(entry.row, row, entry.sources, src,
                                                  entry.calls)
            a, b = _host_view(entry.row), _host_view(row)
            if a is None or b is None:
                on_device.append((entry, entry.row, row))  # on the device: no host copy
            else:
                on_host.append((entry, a, b))
            entry.calls += 1
            entry.expected = max(entry.expected, expected)
            if sk is not None:
                entry.sketch = sk if entry.sketch is None else add_sketches(entry.sketch, sk)
        _merge_on_host(on_host)
        _merge_on_device(on_device)

    def keys(self) -> list[str]:
        """Return the keys recorded since the last flush."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    # -- flushing ------------------------------------------------------------------------
    def take_batch(self, *, step: int, rank: int, world_size: int, seq: int,
                   final: bool) -> Batch:
        """Return everything recorded as one wire batch (one host copy) and start afresh."""
        with self.lock:
            held = own_entries(self._entries, self._blocks)
            entries = [e for _, e in held]
            keys, data, sketches, extremes, copies = _entry_columns(
                held, entries, self.sketch_spec)
            self.host_copies += copies
            kinds, expected = columns(entries, self._blocks, keys, data)
            batch = Batch.build(
                step=step, rank=rank, world_size=world_size, seq=seq, final=final,
                keys=keys, kinds=kinds, expected=expected,
                data=data[0] if len(data) == 1 else np.concatenate(
                    data or [np.zeros((0, NFIELDS))]),  # one block's rows: no copy here
                sketches=sketches, sketch_alpha=self.sketch_spec.alpha,
                derived=self.declarations.take_wire(), extremes=extremes,
            )
            self._reset()
            return batch

    def discard(self) -> int:
        """Drop everything recorded since the last flush; return how many keys were dropped."""
        with self.lock:
            dropped = len(self._entries)
            self._reset()
            return dropped

    def _reset(self) -> None:
        self._masks.clear()  # a mask is prepared once per step; the scratch buffers stay
        self._entries = {}
        self._blocks = []
        self.names.owner = {}
        for tracker in self._attached:
            tracker.end_step()
