"""Where each min and max came from (pure numpy: no Ray, no I/O, no torch).

A record's min and max are values; beside a record a client may carry its *sources*: one
float64 row per key, ``(min_id, min_call, min_row, min_col, max_id, max_call, max_row,
max_col)``. ``row`` and ``col`` are the value's position in the tensor it was recorded
from (first dimension, and the flat position within that row), ``call`` the number of
earlier calls that recorded the key in the batch, ``id`` the caller's sample id of that
row (``stat(ids=...)``); NaN where unknown.

Sources merge as min and max do, with one rule for ties that never depends on arrival
order: the earliest contribution wins, in the order rank, batch, call, row, column (what
``np.argmin`` / ``np.argmax`` return on the ranks' data concatenated in rank order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from metricsvc.core.records import COUNT, MAX, MIN

MIN_ID, MIN_CALL, MIN_ROW, MIN_COL, MAX_ID, MAX_CALL, MAX_ROW, MAX_COL = range(8)
NSOURCE = 8
SIDES = (("min", MIN, MIN_ID), ("max", MAX, MAX_ID))  # name, record field, first source field
SIDE = {name: i for i, (name, _, _) in enumerate(SIDES)}  # the order ``winners`` answers in


def unknown(n: int) -> np.ndarray:
    """Return ``n`` source rows that know nothing (every field NaN)."""
    return np.full((n, NSOURCE), np.nan)


def merge_sources(a_row: Any, b_row: Any, a_src: Any, b_src: Any, xp: Any = np) -> Any:
    """Return the sources of the merge of record ``a_row`` (earlier) with ``b_row`` (later):
    each side keeps ``a``'s source unless ``b``'s value is strictly better. Works for numpy
    and for torch (``xp=torch``) alike; nothing is read back."""
    low = b_row[..., MIN] < a_row[..., MIN]
    high = b_row[..., MAX] > a_row[..., MAX]
    lows = xp.where(low[..., None], b_src[..., :MAX_ID], a_src[..., :MAX_ID])
    highs = xp.where(high[..., None], b_src[..., MAX_ID:], a_src[..., MAX_ID:])
    return xp.concatenate([lows, highs], -1)


_NONE = np.iinfo(np.int64).max  # no candidate (yet): above every position


def winners(rows: np.ndarray, idx: np.ndarray, merged: np.ndarray) -> list[np.ndarray]:
    """Return, for the min and for the max, the position in ``rows`` of each key's winning
    contribution (-1 for a key without values). ``rows`` are the contributions in merge
    order (``idx[i]``: the key of ``rows[i]``), ``merged`` the merged records: the winner
    is the first contribution holding the merged value."""
    n = len(merged)
    out = []
    has = rows[:, COUNT] > 0
    for _, field, _ in SIDES:
        won = np.full(n, _NONE, dtype=np.int64)
        cand = np.flatnonzero(has & (rows[:, field] == merged[idx, field]))
        np.minimum.at(won, idx[cand], cand)  # each key's first candidate
        won[won == _NONE] = -1
        out.append(won)
    return out


def describe(sources: Sequence[float], side: str) -> dict[str, Any]:
    """Return the fields of one side (``"min"`` or ``"max"``) of a key's sources as shown in
    ``meta["extremes"]`` (the known ones only)."""
    first = SIDES[SIDE[side]][2]
    ident, call, row, col = (float(x) for x in sources[first:first + MAX_ID - MIN_ID])
    out: dict[str, Any] = {}
    if not math.isnan(row):
        out.update(row=int(row), col=int(col), call=int(call))
    if not math.isnan(ident):
        out["id"] = int(ident) if ident.is_integer() else ident
    return out
