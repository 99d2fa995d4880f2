"""Summary records and their merge algebra (pure numpy: no Ray, no I/O, no torch).

A record is one float64 row of sufficient statistics per key:
``(sum, count, min, max, m2_root, nonfinite, sum_lo)``.

- ``sum + sum_lo`` is the sum of the values as a double-double (``sum`` rounded,
  ``sum_lo`` the rest, ``|sum_lo| <= ulp(sum) / 2``): means stay exact to the last bit
  even when the values sit far from 0 (1e12 + N(0, 1), timestamps, byte counts).
- ``m2_root`` is ``sqrt(M2)``, the root of the sum of squared deviations from the
  record's own mean. It is built, and merged, around a pivot near the mean (no
  ``sumsq/n - mean**2`` cancellation), its squares scaled where they would leave
  float64's range, so values near 1e300 never overflow and those near 1e-300 never
  underflow.
- ``nonfinite`` counts the NaN/inf values seen in valid positions and excluded.

Merging adds counts and non-finite counts, adds sums exactly (``two_sum``), takes the
min of mins and the max of maxes, and combines ``M2``s with each part's mean offset
from the common pivot (``merge_grouped``: any number of parts in one pass, the client's
micro-batches and the service's ranks alike). The identity record (count 0, min +inf,
max -inf) merges as a no-op, so an empty population is a documented value, never a
fabricated 0.

The algebra is written in plain arithmetic plus ``where/isfinite/sqrt/hypot`` of an
array namespace ``xp`` (numpy, or torch on a client's device, or ``SCALARS`` for plain
floats): one formula serves every place a record is built or merged.

Beside a record a client may carry its *sources*: where its min, its max and its first
non-finite value came from, one float64 row per key, ``(min_id, min_call, min_row, min_col,
max_id, max_call, max_row, max_col, nf_id, nf_call, nf_row, nf_col, nf_value)``. ``row``
and ``col`` are the value's position in the tensor it was recorded from (first dimension,
and the flat position within that row), ``call`` the number of earlier recordings of the
key in the batch, ``id`` the caller's sample id of that row (``stat(ids=...)``),
``nf_value`` the non-finite value itself (NaN, +inf or -inf); NaN where unknown. Sources
merge as min and max do, with one rule for ties that never depends on arrival order: the
earliest contribution wins, in the order rank, batch, call, row, column (``np.argmin`` /
``np.argmax`` on the ranks' data concatenated in rank order; the first non-finite value
of that data).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import numpy as np

SUM, COUNT, MIN, MAX, M2_ROOT, NONFINITE, SUM_LO = range(7)
FIELDS = ("sum", "count", "min", "max", "m2_root", "nonfinite", "sum_lo")
NFIELDS = len(FIELDS)
IDENTITY = (0.0, 0.0, math.inf, -math.inf, 0.0, 0.0, 0.0)  # in FIELDS order

_IDENTITY_ROW = np.array(IDENTITY, dtype=np.float64)
_SPLITTER = 134217729.0  # 2**27 + 1: Dekker's split of a float64 into two 26-bit halves


class _Scalars:
    """The array functions the algebra uses, for plain Python floats."""

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return a if cond else b

    isfinite = staticmethod(math.isfinite)
    sqrt = staticmethod(math.sqrt)
    hypot = staticmethod(math.hypot)


SCALARS = _Scalars()


def identity(n: int = 1) -> np.ndarray:
    """Return ``n`` identity records as an ``[n, NFIELDS]`` float64 matrix."""
    out = np.empty((n, NFIELDS))
    out[:] = _IDENTITY_ROW
    return out


# -- exact float arithmetic (error-free transformations) ------------------------------------
def two_sum(a: Any, b: Any) -> tuple[Any, Any]:
    """Return ``(s, e)`` with ``s = fl(a + b)`` and ``a + b = s + e`` exactly (Knuth)."""
    s = a + b
    t = s - a
    return s, (a - (s - t)) + (b - t)


def two_prod(a: Any, b: Any) -> tuple[Any, Any]:
    """Return ``(p, e)`` with ``p = fl(a * b)`` and ``a * b = p + e`` exactly (Dekker).

    Beyond about 1e300 the split overflows and ``e`` is not finite: callers drop it
    (a sum that large has no room for a low part anyway).
    """
    p = a * b
    t = _SPLITTER * a
    ah = t - (t - a)
    t = _SPLITTER * b
    bh = t - (t - b)
    al, bl = a - ah, b - bh
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _finite(x: Any, xp: Any) -> Any:
    return xp.where(xp.isfinite(x), x, 0.0)


def _normalised(hi: Any, lo: Any, xp: Any) -> tuple[Any, Any]:
    hi, lo = two_sum(hi, _finite(lo, xp))
    return hi, _finite(lo, xp)


def mean_parts(total: Any, total_lo: Any, n: Any, xp: Any = np) -> tuple[Any, Any]:
    """Return the mean of a double-double sum as ``(m, r)``: ``m + r`` exact to ~1e-32."""
    m = total / n
    p, e = two_prod(m, n)
    return m, ((total - p) - _finite(e, xp) + total_lo) / n


def mean(row: np.ndarray) -> float:
    """Return a populated record's mean, from its double-double sum."""
    m, r = mean_parts(float(row[SUM]), float(row[SUM_LO]), float(row[COUNT]), SCALARS)
    return m + r if math.isfinite(r) else m


def _half_plus(x: Any) -> Any:
    return x * 0.5 + abs(x) * 0.5  # max(x, 0) in arithmetic only, for any namespace


def centred_exactly(low: Any, high: Any, c: Any) -> Any:
    """Whether every value in ``[low, high]`` is within a factor 2 of ``c`` (same sign):
    then each ``x - c`` is exact (Sterbenz), and so is the sum around the pivot ``c``."""
    return (((low > 0) & (low * 2 >= c) & (high <= c * 2))
            | ((high < 0) & (high * 2 <= c) & (low >= c * 2)))


def from_pivot(n: Any, c: Any, d1: Any, q: Any, xp: Any = np, total: Any = None,
               exact: Any = True) -> tuple[Any, Any, Any]:
    """Return ``(sum, sum_lo, m2_root)`` of ``n`` values from sums around a pivot ``c``.

    ``d1 = sum(x - c)`` and ``q = sqrt(sum((x - c)**2))``. With ``c`` near the mean,
    ``M2 = q**2 - d1**2 / n`` loses nothing to cancellation; it is taken as
    ``(q - r)(q + r)`` with ``r = |d1| / sqrt(n)``, so nothing is squared on the way.
    The sum is ``n * c + d1``, carried exactly as a double-double where the deviations
    were exact (``exact``: ``centred_exactly``); elsewhere the values span more than the
    pivot, each ``x - c`` rounds, and the plain float64 ``total`` is the better sum. ``n``
    may be 0 (then ``c``, ``d1`` and ``q`` are 0, and so is everything returned).
    """
    if total is not None and xp is np and not np.any(exact):
        hi, lo = total, np.zeros(np.shape(total))  # the plain sums: no double-double to build
    else:
        p, e = two_prod(n, c)
        hi, lo = two_sum(p, d1)
        hi, lo = _normalised(hi, lo + _finite(e, xp), xp)
        if total is not None:
            hi, lo = xp.where(exact, hi, total), xp.where(exact, lo, 0.0)
    return hi, lo, m2_root(n, d1, q, xp)


def m2_root(n: Any, d1: Any, q: Any, xp: Any = np) -> Any:
    """Return ``sqrt(M2)`` of ``n`` values from ``d1 = sum(x - c)`` and
    ``q = sqrt(sum((x - c)**2))`` around any pivot ``c`` (``from_pivot``'s third field)."""
    r = abs(d1) / xp.sqrt(n + (n == 0))
    # (q - r)(q + r) stays in range: one rounding less. q == 0 (every value the pivot: a
    # constant row, a flag never set) has d1 == r == 0, and the product is exactly 0 too.
    near = ((q > 1e-150) | (q == 0)) & (q < 1e150)
    if xp is np and np.all(near):  # the usual case: only the first form is needed
        return np.sqrt(_half_plus((q - r) * (q + r)))
    return xp.where(near, xp.sqrt(_half_plus((q - r) * (q + r))),
                    xp.sqrt(_half_plus(q - r)) * xp.sqrt(q + r))


def merge_grouped(rows: np.ndarray, idx: np.ndarray, n: int) -> np.ndarray:
    """Return ``n`` records, record ``k`` the merge of every ``rows[i]`` with ``idx[i] == k``.

    One vectorised pass for any number of contributions: each key's values are
    re-centred on a common pivot (the plain mean of its sums), every contribution adds
    its mean's offset from the pivot, and ``from_pivot`` rebuilds the record. The offsets
    are taken in plain float64 first; for a key whose mean is large next to its spread
    (``mean**2 > 100 var``), where that would lose digits, they are taken again from the
    double-double sums.
    """
    out = identity(n)
    if not len(rows):
        return out
    rows = np.asarray(rows, dtype=np.float64)
    out[:, NONFINITE] = np.bincount(idx, rows[:, NONFINITE], n)
    np.minimum.at(out[:, MIN], idx, rows[:, MIN])
    np.maximum.at(out[:, MAX], idx, rows[:, MAX])
    has = rows[:, COUNT] > 0
    if not has.all():
        rows, idx = rows[has], idx[has]
    count = rows[:, COUNT]
    total = np.bincount(idx, count, n)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        sums = np.bincount(idx, rows[:, SUM], n)
        pivot = sums / np.where(total > 0, total, 1.0)
        offset = (rows[:, SUM] / count - pivot[idx]) + rows[:, SUM_LO] / count
        d1, q = _spread(rows, idx, offset, n)
        root = m2_root(total, d1, q)
        far = np.abs(pivot) * np.sqrt(total) > 10.0 * root  # |mean| > 10 std: cancellation
        some_far = bool(far.any())
        if some_far:  # offsets from double-double means where plain ones lose digits
            sel = far[idx]
            m, r = mean_parts(rows[sel, SUM], rows[sel, SUM_LO], count[sel])
            offset[sel] = (m - pivot[idx[sel]]) + r
            d1, q = _spread(rows, idx, offset, n)
            out[:, SUM], out[:, SUM_LO], out[:, M2_ROOT] = from_pivot(total, pivot, d1, q)
        else:  # no key far from 0: each sum is the plain one below, the root is this one
            out[:, M2_ROOT] = root
        if not far.all():  # near 0 the sums of the contributions' sums are the better sum
            plain = _normalised(sums, np.bincount(idx, rows[:, SUM_LO], n), np)
            near = ~far if some_far else slice(None)  # every key, the common case
            out[near, SUM], out[near, SUM_LO] = plain[0][near], plain[1][near]
    out[:, COUNT] = total
    return out


def _spread(rows: np.ndarray, idx: np.ndarray, offset: np.ndarray,
            n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per key, ``d1 = sum(x - pivot)`` and ``q = sqrt(sum((x - pivot)**2))`` over the
    values of every contribution, from each one's M2 and mean offset ``offset``."""
    count = rows[:, COUNT]
    d1 = np.bincount(idx, offset * count, n)
    shift = np.abs(offset) * np.sqrt(count)  # the contribution's mean offset, as a norm
    root = rows[:, M2_ROOT]
    squares = np.bincount(idx, root * root + shift * shift, n)
    # Squares past 1e154 overflow, below 1e-154 vanish: those keys are summed scaled.
    held = np.bincount(idx, (root > 0) | (shift > 0), n) > 0
    odd = ~((squares > 1e-280) & (squares < 1e280)) & held
    if odd.any():
        scale = np.zeros(n)
        np.maximum.at(scale, idx, np.maximum(root, shift))
        scale = np.where(scale > 0, scale, 1.0)
        s = scale[idx]
        scaled = scale * np.sqrt(np.bincount(idx, (root / s) ** 2 + (shift / s) ** 2, n))
        return d1, np.where(odd, scaled, np.sqrt(squares))
    return d1, np.sqrt(squares)


def rss(values: np.ndarray) -> float:
    """Return ``sqrt(sum(values**2))`` without overflow or underflow of the squares."""
    if not values.size:
        return 0.0
    top = float(np.max(np.abs(values)))
    if not 1e-140 < top < 1e140:  # the squares would leave float64's range: scale first
        if top == 0 or not math.isfinite(top):
            return top
        exp = math.frexp(top)[1]
        scaled = np.ldexp(values, -exp)  # by a power of 2: exact (subnormals too)
        with np.errstate(over="ignore"):  # a norm past float64's range is inf
            return float(np.ldexp(math.sqrt(float(np.dot(scaled, scaled))), exp))
    return math.sqrt(float(np.dot(values, values)))


def summarize_array(values: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Summarise a numpy array (optionally masked) into one record row.

    NaN and +-inf in valid positions are counted in ``nonfinite`` and excluded
    from every other field; masked-out positions never matter.
    """
    v = np.asarray(values, dtype=np.float64).ravel()
    valid = np.ones(v.shape, dtype=bool) if mask is None else np.asarray(mask).ravel()
    finite = np.isfinite(v)
    use = valid & finite
    row = _IDENTITY_ROW.copy()
    row[NONFINITE] = np.count_nonzero(valid & ~finite)
    x = v[use]
    if x.size:
        row[COUNT] = x.size
        row[MIN] = x.min()
        row[MAX] = x.max()
        row[[SUM, SUM_LO, M2_ROOT]] = pivoted_row_fields(x)
    return row


EXACT_SUM_MAX = 256  # a few values (a small tensor or array): their sum is exact


def exact_sum(values: Any) -> float:
    """The sum of finite floats rounded once (``math.fsum``): huge terms that cancel keep
    the small ones. Where the partial sums leave float64's range, or a value is not finite
    (inf and -inf), the plain sum: inf or NaN, which the caller takes as a sum past
    float64's range or as values to count and exclude."""
    try:
        return math.fsum(values)
    except (OverflowError, ValueError):
        return float(sum(values))


def pivoted_row_fields(x: np.ndarray) -> tuple[float, float, float]:
    """Return ``(sum, sum_lo, m2_root)`` of finite float64 values (not empty)."""
    # Finite values may still sum past float64's range: that is flagged, not an error.
    with np.errstate(over="ignore", invalid="ignore"):
        total = exact_sum(x) if x.size <= EXACT_SUM_MAX else float(x.sum())
        c = total / x.size
        if not math.isfinite(c):  # the sum overflowed; the mean need not
            c = float((x / x.size).sum())
        dev = x - c
        exact = bool(centred_exactly(float(x.min()), float(x.max()), c))
        return from_pivot(float(x.size), c, float(dev.sum()), rss(dev), SCALARS, total, exact)


def scalar_row(value: float, weight: float = 1.0) -> np.ndarray:
    """Return the record of one plain number counted ``weight`` times."""
    value, weight = float(value), float(weight)  # Python floats: an overflow is inf, silently
    if not math.isfinite(value):
        row = _IDENTITY_ROW.copy()
        row[NONFINITE] = 1.0
        return row
    if weight == 0:  # counted zero times: nothing recorded, not a min or max either
        return _IDENTITY_ROW.copy()
    total, total_lo, _ = from_pivot(weight, value, 0.0, 0.0, SCALARS)
    return np.array([total, weight, value, value, 0.0, 0.0, total_lo])


def scalar_rows(values: np.ndarray) -> np.ndarray:
    """Return one record per plain number (count 1 each; NaN/inf counted as nonfinite)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    rows = np.zeros((v.size, NFIELDS), dtype=np.float64)
    if math.isfinite(v.sum()):  # every value finite (a NaN or inf would show in the sum)
        rows[:, SUM] = rows[:, MIN] = rows[:, MAX] = v
        rows[:, COUNT] = 1.0
        return rows
    finite = np.isfinite(v)
    z = np.where(finite, v, 0.0)
    rows[:, SUM] = z
    rows[:, COUNT] = finite
    rows[:, MIN] = np.where(finite, v, np.inf)
    rows[:, MAX] = np.where(finite, v, -np.inf)
    rows[:, NONFINITE] = ~finite
    return rows


# -- where each min and max came from ----------------------------------------------------
(MIN_ID, MIN_CALL, MIN_ROW, MIN_COL, MAX_ID, MAX_CALL, MAX_ROW, MAX_COL,
 NF_ID, NF_CALL, NF_ROW, NF_COL, NF_VALUE) = range(13)
NSOURCE = 13
# Each thing located, in the order ``winners`` answers: its record field (what a winning
# contribution holds) and its source fields, ``[first, end)``
LOCATED = {"min": (MIN, MIN_ID, MAX_ID), "max": (MAX, MAX_ID, NF_ID),
           "nonfinite": (NONFINITE, NF_ID, NSOURCE)}
SIDE = {"min": 0, "max": 1}  # a top sample's side (``Top.SIDE``) of a min and of a max
CALLS = [MIN_CALL, MAX_CALL, NF_CALL]  # each one's call number
KINDS_NONFINITE = ("nan", "+inf", "-inf")


class Top(IntEnum):
    """The fields of a top sample (``stat(top=k)``): which side (``SIDE``: 0 the smallest,
    1 the largest), its value, the sample's id (NaN: none given), the call, row and column
    it was recorded at, and the k its rank asked for."""

    SIDE = 0
    VALUE = 1
    ID = 2
    CALL = 3
    ROW = 4
    COL = 5
    K = 6


NTOP = len(Top)


def best_of(samples: np.ndarray, key: np.ndarray, rank: np.ndarray | None = None
            ) -> np.ndarray:
    """The positions in ``samples`` (``[n, NTOP]``, of key ``key[i]``) of each key's k
    smallest (side 0) and k largest (side 1), in order: by key, side, best first, ties to
    the lower ``rank`` (if given), then call, row and column (what a sort of the data
    concatenated in that order gives); k is the largest any of the side's samples says."""
    side = samples[:, Top.SIDE]
    order = np.lexsort((samples[:, Top.COL], samples[:, Top.ROW], samples[:, Top.CALL],
                        *(() if rank is None else (rank,)),
                        np.where(side == 0, 1.0, -1.0) * samples[:, Top.VALUE], side, key))
    if not len(order):
        return order
    group = (2 * key + side.astype(np.int64))[order]
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    sizes = np.diff(np.r_[starts, len(group)])
    k = np.maximum.reduceat(samples[order, Top.K], starts)
    return order[np.arange(len(order)) - np.repeat(starts, sizes) < np.repeat(k, sizes)]


def unknown_sources(n: int) -> np.ndarray:
    """Return ``n`` source rows that know nothing (every field NaN)."""
    return np.full((n, NSOURCE), np.nan)


_NONE = np.iinfo(np.int64).max  # no candidate (yet): above every position


def winners(rows: np.ndarray, idx: np.ndarray, merged: np.ndarray) -> list[np.ndarray]:
    """Return, for the min, the max and the first non-finite value (``LOCATED``), the
    position in ``rows`` of each key's winning contribution (-1 for a key without one).
    ``rows`` are the contributions in merge order (``idx[i]``: the key of ``rows[i]``),
    ``merged`` the merged records: the winner is the first contribution holding the merged
    value (the first that counts a non-finite value)."""
    n = len(merged)
    out = []
    has = rows[:, COUNT] > 0
    for field, _, _ in LOCATED.values():
        held = (rows[:, NONFINITE] > 0 if field == NONFINITE
                else has & (rows[:, field] == merged[idx, field]))
        won = np.full(n, _NONE, dtype=np.int64)
        cand = np.flatnonzero(held)
        np.minimum.at(won, idx[cand], cand)  # each key's first candidate
        won[won == _NONE] = -1
        out.append(won)
    return out


def describe_source(sources: Sequence[float], side: str) -> dict[str, Any]:
    """Return the fields of one side (``"min"``, ``"max"`` or ``"nonfinite"``) of a key's
    sources as shown in ``meta["extremes"]`` and ``meta["nonfinite_first"]`` (the known
    ones only; the non-finite value's ``kind``: ``nan``, ``+inf`` or ``-inf``)."""
    first = LOCATED[side][1]
    ident, call, row, col = (float(x) for x in sources[first:first + 4])
    out: dict[str, Any] = {}
    if not math.isnan(row):
        out.update(row=int(row), col=int(col), call=int(call))
        if side == "nonfinite":
            out["kind"] = nonfinite_kind(float(sources[NF_VALUE]))
    if not math.isnan(ident):
        out["id"] = int(ident) if ident.is_integer() else ident
    return out


def nonfinite_kind(value: float) -> str:
    """``nan``, ``+inf`` or ``-inf``: the kind of a non-finite value."""
    return KINDS_NONFINITE[0 if math.isnan(value) else 1 if value > 0 else 2]
