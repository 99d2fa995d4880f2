"""The records of a client's open step: an entry per key, or a block for a call's plain
numbers (one matrix; a call of several kinds keeps each key's kind)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from metricsvc.client.tensors import Row
from metricsvc.protocol import KINDS, ReduceType, merge, scalar_rows

_PLAIN_NUMBERS = frozenset({float, int, bool, np.float64, np.float32, np.float16, np.int64,
                            np.int32, np.int16, np.int8, np.uint8, np.bool_})


@dataclass(slots=True)
class _Entry:
    code: int
    expected: int
    row: Row
    sketch: Row | None = None
    sources: Row | None = None  # where its min and max came from (``stat(ids=)``), or None
    calls: int = 1  # recordings merged into ``row`` in this step


@dataclass(slots=True)
class _Block:
    """The plain numbers of one call (a dict of floats): a record per key, as one matrix."""

    code: int | tuple[int, ...]  # the keys' kind; a tuple, each key's (a call of several)
    expected: int
    keys: tuple[str, ...]
    rows: np.ndarray  # [len(keys), NFIELDS]
    alive: np.ndarray | None = None  # which rows are still the block's (None: all)
    calls: int = 1  # recordings of these keys merged into ``rows`` in this step

    def take(self, key: str) -> _Entry:
        """Hand ``key``'s record over to an entry of its own (the key is recorded again)."""
        i = self.keys.index(key)
        if self.alive is None:
            self.alive = np.ones(len(self.keys), dtype=bool)
        self.alive[i] = False
        return _Entry(self.code_of(i), self.expected, self.rows[i].copy(), calls=self.calls)

    def code_of(self, i: int) -> int:
        """The kind of key ``i``."""
        return self.code[i] if self.code.__class__ is tuple else self.code  # type: ignore[index]

    def merged(self, keys: tuple[str, ...], rows: np.ndarray, code: int | tuple[int, ...],
               expected: int) -> bool:
        """Merge ``rows`` in, one merge, if they are this block's keys again (a micro-batch's
        same dict) with its kind; return whether they were."""
        if keys != self.keys or self.alive is not None or code != self.code:
            return False
        self.rows = merge(self.rows, rows)
        self.calls += 1
        self.expected = max(self.expected, expected)
        return True


def _plain_block(values: list[Any]) -> np.ndarray | None:
    """The records of plain numbers, in one vectorised pass; None for anything else (or an
    int past float64, which the per-key path names)."""
    if not _PLAIN_NUMBERS.issuperset(map(type, values)):
        return None
    try:
        return scalar_rows(np.array(values, dtype=np.float64))
    except OverflowError:
        return None


def own_entries(entries: Mapping[str, Any], blocks: list[_Block]) -> list[tuple[str, _Entry]]:
    """The keys with an entry of their own (not a block's row), in the order recorded:
    none without a look at each key when the blocks hold every key."""
    in_blocks = sum(len(b.keys) if b.alive is None else int(b.alive.sum()) for b in blocks)
    if in_blocks == len(entries):
        return []
    return [(k, e) for k, e in entries.items() if e.__class__ is _Entry]


def columns(entries: list[_Entry], blocks: list[_Block], keys: list,
            data: list) -> tuple[np.ndarray, np.ndarray]:
    """Append the blocks' keys and rows to ``keys`` and ``data`` (after the entries': each
    call's plain numbers in the order recorded, without the keys an entry of their own
    took over); return every key's kind and expected ranks, as the wire's arrays."""
    kinds, expected = [], []
    if entries or not blocks:
        kinds.append(np.array([e.code for e in entries], dtype=np.int8))
        expected.append(np.array([e.expected for e in entries], dtype=np.int32))
    for b in blocks:
        codes = (np.array(b.code, dtype=np.int8) if b.code.__class__ is tuple
                 else np.full(len(b.keys), b.code, dtype=np.int8))
        if b.alive is None:
            keys.extend(b.keys)
            data.append(b.rows)
        else:
            keys.extend(name for name, a in zip(b.keys, b.alive) if a)
            data.append(b.rows[b.alive])
            codes = codes[b.alive]
        kinds.append(codes)
        expected.append(np.full(len(codes), b.expected, dtype=np.int32))
    if len(kinds) == 1:
        return kinds[0], expected[0]
    return np.concatenate(kinds), np.concatenate(expected)


def by_code(keys: tuple[str, ...], codes: tuple, values: Any) -> dict[Any, dict[str, Any]]:
    """``{code: {key: value}}`` of keys each with its code."""
    groups: dict[Any, dict[str, Any]] = {}
    for key, code, value in zip(keys, codes, values):
        groups.setdefault(code, {})[key] = value
    return groups


def code_of(entry: Any, key: str) -> int | None:
    """The kind ``key`` is recorded as (None: not recorded in this step)."""
    if entry is None or entry.__class__ is _Entry:
        return None if entry is None else entry.code
    return entry.code_of(entry.keys.index(key))


def record_kinds(buffer: Any, values: Mapping[str, Any],
                 kinds: tuple[ReduceType, ...]) -> None:
    """``record`` of ``{full key: value}``, each key with its kind in ``kinds`` (a built-in
    family's call of several kinds): plain numbers in one block, else a record per kind."""
    block = None if any(KINDS[k].sketch for k in kinds) else _plain_block(list(values.values()))
    if block is not None:
        return buffer._record_block(tuple(values), block, tuple(map(int, kinds)), 0)
    for kind, group in by_code(tuple(values), kinds, values.values()).items():
        buffer.record(group, None, kind)
