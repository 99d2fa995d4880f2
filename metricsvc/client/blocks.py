"""A call's plain numbers as one block of records, and the kinds of a block's keys (a call
of several kinds keeps each key's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from metricsvc.protocol import KINDS, ReduceType, scalar_rows

_PLAIN_NUMBERS = frozenset({float, int, bool, np.float64, np.float32, np.float16, np.int64,
                            np.int32, np.int16, np.int8, np.uint8, np.bool_})


def _plain_block(values: list[Any]) -> np.ndarray | None:
    """The records of plain numbers, in one vectorised pass; None for anything else (or an
    int past float64, which the per-key path names)."""
    if not _PLAIN_NUMBERS.issuperset(map(type, values)):
        return None
    try:
        return scalar_rows(np.array(values, dtype=np.float64))
    except OverflowError:
        return None

def by_code(keys: tuple[str, ...], codes: tuple, values: Any) -> dict[Any, dict[str, Any]]:
    """``{code: {key: value}}`` of keys each with its code."""
    groups: dict[Any, dict[str, Any]] = {}
    for key, code, value in zip(keys, codes, values):
        groups.setdefault(code, {})[key] = value
    return groups


def code_of(entry: Any, key: str) -> int | None:
    """The kind ``key`` is recorded as (None: not recorded in this step)."""
    if entry is None or not hasattr(entry, "code_of"):  # none, or an entry of its own
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
