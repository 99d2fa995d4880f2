"""Summaries on the CPU: a mask's valid positions found once, each distinct tensor gathered
once, small values summarised together in numpy or plain Python, a large one widened to
float64 in cache-sized chunks centred on a pivot (the second moment never cancels); the
passes that exclude NaN/inf run only when the sum shows some. Reading a CPU value is not a
device sync."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from metricsvc.client.tensors import (
    Difference,
    identity_row,
    memory_of,
    numpy_dtypes,
    torch_module,
)
from metricsvc.core.records import (
    COUNT,
    EXACT_SUM_MAX,
    M2_ROOT,
    MAX,
    MIN,
    NFIELDS,
    NONFINITE,
    SCALARS,
    SUM,
    SUM_LO,
    centred_exactly,
    exact_sum,
    from_pivot,
    rss,
    summarize_array,
)

log = logging.getLogger(__name__)

_ARANGE_MAX = 1 << 20  # masks up to this size pick their positions from a kept arange
_SPAN = 64  # a mask's positions counted per span of this many (``MaskCache.positions``)


def _span_starts(flat: np.ndarray) -> np.ndarray:
    """How many of ``flat``'s positions are True before each span of ``_SPAN`` (64): the
    True bytes of each 8-byte word counted (``bitwise_count``, numpy 2), and the eight
    counts of a span added by one multiply of the word they make."""
    n = flat.size
    cut = n - n % _SPAN
    whole = flat[:cut]
    if hasattr(np, "bitwise_count"):
        per_word = np.bitwise_count(whole.view(np.uint64))  # 0-8 each, 8 a span
        counts = ((per_word.view(np.uint64) * np.uint64(0x0101010101010101))
                  >> np.uint64(56)).astype(np.int64)
    else:  # numpy 1: a sum of the bytes
        counts = whole.view(np.uint8).reshape(-1, _SPAN).sum(1, dtype=np.int64)
    if cut < n:
        counts = np.append(counts, np.count_nonzero(flat[cut:]))
    return np.concatenate([[0], np.cumsum(counts)[:-1]])


class MaskCache:
    """The masks a client used this step (flat, with their count of valid positions; their
    positions made on first ask), found once per mask, and the scratch buffers of the CPU
    summaries, kept across steps (fresh multi-MB buffers every step cost more in page
    faults than the arithmetic).

    A mask entry holds its mask (so its memory cannot be reused by another mask meanwhile)
    and the mask's version counter (so an in-place change is noticed). ``clear`` it when
    the step is closed; the buffers stay.
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: list[tuple[Any, int, Any]] = []
        self._buffers: dict[tuple[Any, str], Any] = {}
        self._arange = np.arange(0)  # positions to pick a mask's valid ones from

    def valid(self, mask: Any) -> tuple[np.ndarray, int]:
        """Return ``(flat, n)``: ``mask`` (a CPU bool tensor) as a flat numpy bool array and
        its count of True, found once per mask and step."""
        return self._entry(mask)[:2]

    def index(self, mask: Any) -> Any:
        """Return the flat indices (an int64 CPU tensor) where ``mask`` (a CPU bool tensor)
        is True (made on first ask: a gather picks by the bool mask itself)."""
        entry = self._entry(mask)
        if entry[2] is None:
            flat = entry[0]
            # picking from a kept ``arange`` is faster than ``flatnonzero`` counting them
            if flat.size <= _ARANGE_MAX:
                if self._arange.size < flat.size:
                    self._arange = np.arange(flat.size)
                entry[2] = torch_module().from_numpy(self._arange[: flat.size][flat])
            else:
                entry[2] = torch_module().from_numpy(np.flatnonzero(flat))
        return entry[2]

    def positions(self, mask: Any, at: np.ndarray) -> np.ndarray:
        """Return the flat positions of the ``at``-th valid positions of ``mask`` (a CPU
        bool tensor; ``at`` int64): each found in its span of 64 positions (a running
        count of the span's), from the mask's counts per span (made once per mask and step:
        a few of its positions are asked for, the min's, the max's, the top samples', never
        all of them)."""
        entry = self._entry(mask)
        if entry[2] is not None:  # every valid position is made already
            return entry[2].numpy()[at]
        flat = entry[0]
        if entry[3] is None:
            entry[3] = _span_starts(flat)
        starts = entry[3]
        span = np.searchsorted(starts, at, side="right") - 1
        nth = at - starts[span]  # which valid position of its span
        whole = flat.size // _SPAN
        out = np.empty(at.shape, np.int64)
        inside = span < whole
        if inside.any():
            counted = np.cumsum(flat[: whole * _SPAN].reshape(whole, _SPAN)[span[inside]], 1,
                                dtype=np.int16)
            out[inside] = span[inside] * _SPAN + (counted > nth[inside, None]).argmax(1)
        if not inside.all():  # in the part past the last whole span
            out[~inside] = whole * _SPAN + np.flatnonzero(flat[whole * _SPAN:])[nth[~inside]]
        return out

    def _entry(self, mask: Any) -> list:
        for held, version, entry in self._entries:
            if (held.data_ptr() == mask.data_ptr() and held.shape == mask.shape
                    and held.stride() == mask.stride() and mask._version == version):
                return entry
        flat = mask.numpy().reshape(-1)
        entry = [flat, int(np.count_nonzero(flat)), None, None]
        self._entries = [(mask, mask._version, entry), *self._entries][: self.size]
        return entry

    def buffer(self, dtype: Any, role: str, n: int) -> Any:
        """Return a 1-D CPU scratch tensor of ``n`` elements of ``dtype`` for ``role``."""
        buf = self._buffers.get((dtype, role))
        if buf is None or buf.numel() < n:
            buf = self._buffers[(dtype, role)] = torch_module().empty(n, dtype=dtype)
        return buf[:n]

    def __len__(self) -> int:
        """The masks held (prepared in this step)."""
        return len(self._entries)

    def clear(self) -> None:
        self._entries = []




_SAFE_SQUARES = (1e-280, 1e280)  # sums of squares that neither underflowed nor overflowed
_CHUNK = 1 << 16  # float64 accumulation in pieces of 512 KiB: no whole-tensor float64 copy
_SMALL = 4096  # below this, numpy's per-call cost (~1 us) beats torch's (~5 us)
_TINY = EXACT_SUM_MAX  # at most this, plain Python beats numpy's calls (and sums exactly)


def _min_max(v: Any, locate: bool) -> tuple[float, float, tuple[int, int] | None]:
    """The min and max of finite flat ``v`` (and with ``locate`` their first positions):
    torch's ``aminmax``, one pass for both (numpy's ``min`` and ``max`` are two, each as
    fast); located, numpy's SIMD ``argmin`` / ``argmax`` where it can view the dtype
    (several times faster than torch's on the CPU), else torch's."""
    torch = torch_module()
    if not locate:  # one pass for both (numpy's min and max are two)
        low, high = torch.aminmax(v)
        return low.item(), high.item(), None
    if v.dtype in numpy_dtypes(torch):
        x = v.numpy()
        at = (int(x.argmin()), int(x.argmax()))
        return float(x[at[0]]), float(x[at[1]]), at
    at = (int(torch.argmin(v)), int(torch.argmax(v)))
    return v[at[0]].item(), v[at[1]].item(), at


_GROUP = 256  # values per group whose min and max bound where the k smallest (largest) lie


def smallest_largest(x: np.ndarray, k: int, finite: bool = False) -> np.ndarray:
    """The ``k`` smallest and ``k`` largest finite values of flat ``x`` with their
    positions, ``[2, k, 3]`` (side 0 the smallest, ascending; 1 the largest, descending;
    ``(value, position, NaN)``, the last for the sample's id; NaN where fewer are finite);
    ties go to the lower position (``finite``: the caller knows every value is).

    Many values are searched by their groups (``GroupSearch``); the others by
    ``every_finite``."""
    search = GroupSearch(k)
    if search.add("", x, finite) is not None:
        return search.found()[""]
    return every_finite(x, k, finite)


def every_finite(x: np.ndarray, k: int, finite: bool = False) -> np.ndarray:
    """``smallest_largest`` of a value ``GroupSearch.add`` did not take: where a NaN or inf
    is among them, the finite values searched as any value is (by their groups where
    many); a few, or many tied, every one: of many, what passes each side's k-th."""
    if not (finite or x.dtype.kind != "f" or np.isfinite(x).all()):
        at = np.flatnonzero(np.isfinite(x))
        return through(smallest_largest(x[at], k, True), at)
    at = np.arange(x.size)
    if x.size > 4 * k:  # what passes each side's k-th, then as many tied as wanted
        keep = [_passing(x, k, 0), _passing(x, k, 1)]
        return _best(x[np.concatenate(keep)], at[np.concatenate(keep)],
                     np.repeat([0, 1], [keep[0].size, keep[1].size]), k)
    return _best(np.tile(x, 2), np.tile(at, 2), np.repeat([0, 1], x.size), k)


def through(found: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``found`` (``[..., 3]``, ``smallest_largest``), its positions among ``x[index]``
    made positions in ``x`` (in place; NaN, no sample, stays)."""
    at = found[..., 1]
    held = ~np.isnan(at)
    at[held] = index[at[held].astype(np.int64)]
    return found


class GroupSearch:
    """The ``k`` smallest and largest values of many flat values, searched together.

    ``add`` deals a value's many values into ``m`` groups of 256 (``x[j::m]``: its rows as
    ``[256, m]``, so each group's min and max is one SIMD pass over it for all groups): if
    the k-th largest group max is ``t``, k groups hold a value of at least ``t``, so each
    of the k largest values is at least ``t`` and lies in a group whose max is (or past
    the last whole row). Those few groups (and that tail) are kept, and the smallest
    likewise; ``found`` then finds, for every value added, what passes its bounds and
    orders it, all in one pass (a few numpy calls for all, not a few for each)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.keys: list[str] = []
        self.blocks: list[np.ndarray] = []  # [groups, 256]: each value's groups of both sides
        self.groups: list[np.ndarray] = []  # their numbers (a group's j: it is x[j::m])
        self.counts: list[int] = []  # per value: its groups of side 0, then of side 1
        self.bounds: list[float] = []  # per value: side 0's bound, then side 1's
        self.steps: list[int] = []  # per value: m
        self.tails: list[np.ndarray] = []  # per value: the values past its last whole row

    def add(self, key: str, x: np.ndarray, finite: bool = False) -> tuple[float, float] | None:
        """Keep flat ``x``'s candidates under ``key``; return its min and max, or None
        where it is not one to search by groups (fewer than 4k groups, a NaN or inf, many
        groups tied at a bound): kept nothing then. ``finite``: every value is."""
        k = self.k
        m = x.size // _GROUP
        if m < 4 * k:
            return None
        rows, tail = x[: m * _GROUP].reshape(_GROUP, m), x[m * _GROUP:]
        low, high = rows.min(0), rows.max(0)
        if not (finite or x.dtype.kind != "f" or math.isfinite(
                float(high.max()) - float(low.min())
                + (float(tail.sum(dtype=np.float64)) if tail.size else 0.0))):
            return None
        bounds = np.partition(low, k - 1)[k - 1], np.partition(high, m - k)[m - k]
        sides = (low <= bounds[0]).nonzero()[0], (high >= bounds[1]).nonzero()[0]
        if sides[0].size + sides[1].size > 8 * k:  # many tied groups
            return None
        groups = np.concatenate(sides)
        self.keys.append(key)
        self.blocks.append(rows[:, groups].T)  # a group a row (numpy's pick is laid so)
        self.groups.append(groups)
        self.counts += [sides[0].size, sides[1].size]
        self.bounds += bounds
        self.steps.append(m)
        self.tails.append(tail.copy())  # (a view would hold all of x)
        return float(low.min()), float(high.max())

    def found(self) -> dict[str, np.ndarray]:
        """Every added value's ``[2, k, 3]`` (``smallest_largest``), by key."""
        k, n = self.k, len(self.keys)
        if not n:
            return {}
        counts = np.array(self.counts)
        block = np.concatenate(self.blocks)  # [groups, 256], C-ordered
        if block.dtype.kind != "f":
            block = block.astype(np.float64)  # ints and bools (exact to 2**53)
        tails = np.full((2 * n, _GROUP), np.nan, block.dtype)  # each tail, as a group a side
        for i, t in enumerate(self.tails):
            tails[2 * i: 2 * i + 2, : t.size] = t
        block = np.concatenate([block, tails])
        # each group's value, side and bound, and its column's position: r * step + base
        steps, bounds, sides = np.array(self.steps), np.array(self.bounds), np.tile([0, 1], n)
        sizes = counts.reshape(n, 2).sum(1)
        owner = np.concatenate([np.repeat(np.arange(n), sizes), np.repeat(np.arange(n), 2)])
        side = np.concatenate([np.repeat(sides, counts), sides])
        bound = np.concatenate([np.repeat(bounds, counts), bounds])
        step = np.concatenate([np.repeat(steps, sizes), np.ones(2 * n, np.int64)])
        base = np.concatenate([*self.groups, np.repeat(steps * _GROUP, 2)])
        # the largest as the smallest of the values negated; one dtype (two compare slowly)
        sign = (1 - 2 * side).astype(block.dtype)
        hit = block * sign[:, None] <= (bound * sign).astype(block.dtype)[:, None]
        c, r = np.divmod(np.flatnonzero(hit), _GROUP)  # NaN (a tail's end) passes nothing
        v = block[c, r].astype(np.float64)
        side, owner, at = side[c], owner[c], r * step[c] + base[c]
        order = np.lexsort((at, np.where(side == 0, v, -v), side, owner))
        group = (2 * owner + side)[order]
        rank = np.arange(order.size) - np.searchsorted(group, group)  # within its value's side
        keep = rank < k
        order, group, rank = order[keep], group[keep], rank[keep]
        out = np.empty((n, 2, k, 3))
        out.fill(np.nan)
        out[group // 2, group % 2, rank, 0], out[group // 2, group % 2, rank, 1] = \
            v[order], at[order]
        return dict(zip(self.keys, out))


def _passing(values: np.ndarray, k: int, side: int) -> np.ndarray:
    """The positions in ``values`` of its ``k`` smallest (side 0) or largest (1), ties to
    the lower position."""
    at = k - 1 if side == 0 else values.size - k
    kth = np.partition(values, at)[at]
    past = np.flatnonzero(values < kth if side == 0 else values > kth)
    return np.concatenate([past, np.flatnonzero(values == kth)[: k - past.size]])


def _best(values: np.ndarray, at: np.ndarray, side: np.ndarray, k: int) -> np.ndarray:
    """The ``[2, k, 3]`` top samples from candidates at positions ``at`` for ``side``
    (0: the smallest, 1: the largest): each side's ``k`` best, ties to the lower
    position."""
    v = values.astype(np.float64)
    order = np.lexsort((at, np.where(side == 0, v, -v), side))
    split = int(np.searchsorted(side[order], 1))
    out = np.empty((2, k, 3))
    out.fill(np.nan)
    for s, part in ((0, order[:min(split, k)]), (1, order[split:split + k])):
        out[s, : part.size, 0], out[s, : part.size, 1] = v[part], at[part]
    return out


def stacked_smallest_largest(x: np.ndarray, k: int) -> np.ndarray:
    """``smallest_largest`` of each row of ``x`` (``[K, n]``, a few values each), ``[K,
    2, k, 3]``, for all rows and both sides at once (the largest as the smallest of the
    values negated): each row's k-th by a partition, what passes it ordered by row, value
    and position, the first k of each row kept."""
    v = x.astype(np.float64)
    count, n = v.shape
    out = np.empty((count, 2, k, 3))
    out.fill(np.nan)
    if not n:
        return out
    signed = np.concatenate([v, -v])  # row i: side i // count of row i % count
    bad = ~np.isfinite(signed)
    if bad.any():
        signed[bad] = np.nan  # last in a partition; passes no k-th
    kth = np.partition(signed, min(k, n) - 1, axis=1)[:, min(k, n) - 1:min(k, n)]
    hit = signed <= kth
    short = np.isnan(kth)  # rows of fewer than k finite values: every finite one passes
    if short.any():
        hit |= short & ~np.isnan(signed)
    r, c = hit.nonzero()
    order = np.lexsort((c, signed[r, c], r))
    r, c = r[order], c[order]
    place = np.arange(r.size) - np.searchsorted(r, r)  # the rank within its row
    keep = place < k
    (side, row), c, place = np.divmod(r[keep], count), c[keep], place[keep]
    out[row, side, place, 0], out[row, side, place, 1] = v[row, c], c
    return out


def _numpy(g: Any) -> np.ndarray:
    """A flat CPU tensor as numpy (a dtype numpy has not: widened to float64)."""
    torch = torch_module()
    return (g if g.dtype in numpy_dtypes(torch) else g.to(torch.float64)).numpy()


def _host_row(total: float, n: float, low: float, high: float, root: float,
              total_lo: float) -> Any:
    """The record row of finite values (no non-finite count) as a CPU tensor."""
    row = np.empty(NFIELDS)
    row[SUM], row[COUNT], row[MIN], row[MAX] = total, n, low, high
    row[M2_ROOT], row[NONFINITE], row[SUM_LO] = root, 0.0, total_lo
    return torch_module().from_numpy(row)


def stacked_rows(stacked: np.ndarray, valid: np.ndarray | None = None, locate: bool = False
                 ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]] | None]:
    """Records of ``k`` same-length float64 vectors, one numpy pass per statistic over all
    of them, each under its row of ``valid`` (None: every position counts; masked-out
    positions weigh nothing): ``(rows [k, NFIELDS], ok [k], at)``. A row is not ``ok``
    where a valid value is not finite or reaches 1e150 (the single-value path counts and
    excludes those, or sums them scaled). Deviations whose squares would vanish are summed
    scaled. ``at``, with ``locate``: each row's first min and max positions."""
    k, n = stacked.shape
    if valid is None:
        z = lows = highs = stacked
        count = np.full(k, float(n))
    else:
        z = np.where(valid, stacked, 0.0)
        lows, highs = np.where(valid, stacked, np.inf), np.where(valid, stacked, -np.inf)
        count = np.count_nonzero(valid, axis=1).astype(np.float64)
    at = None
    if locate:
        lo, hi = lows.argmin(1), highs.argmax(1)
        line = np.arange(k)
        low, high = lows[line, lo], highs[line, hi]
        at = list(zip(lo.tolist(), hi.tolist()))
    else:
        low, high = lows.min(1, initial=np.inf), highs.max(1, initial=-np.inf)
    # The extremes tell which rows are ok: NaN fails both tests, and an empty row passes
    ok = (low > -1e150) & (high < 1e150)
    if not ok.all():  # the rows left to the caller weigh nothing here: no overflow, no warning
        z = np.where(ok[:, None], z, 0.0)
    plain = z.sum(1)
    pivot = plain / np.maximum(count, 1.0)
    dev = z - pivot[:, None]
    if valid is not None:
        dev = np.where(valid, dev, 0.0)
    squares = np.einsum("ij,ij->i", dev, dev)
    q = np.sqrt(squares)
    if squares.min() < 1e-280:  # would square to nothing: scaled, unless every deviation
        tiny = np.flatnonzero(squares < 1e-280)  # is 0 (a constant row: a clip flag)
        for i in tiny[np.abs(dev[tiny]).max(1) > 0]:
            q[i] = rss(dev[i])
    rows = np.zeros((k, NFIELDS))
    rows[:, COUNT], rows[:, MIN], rows[:, MAX] = count, low, high
    rows[:, SUM], rows[:, SUM_LO], rows[:, M2_ROOT] = from_pivot(
        count, pivot, dev.sum(1), q, np, plain, centred_exactly(low, high, pivot))
    return rows, ok, at


class HostPass:
    """CPU summaries of the values of one call under one mask.

    The mask is read once per step (``MaskCache``: flat, with its count of valid
    positions); each distinct tensor is gathered once per call (a tensor passed under two
    keys, or inside a ``Difference``, is read once) by numpy's pick by that bool mask, a
    fresh array no larger than itself, summarised before the next is gathered (kept only
    for a ``Difference``). Picking by the mask reads a byte per position where a gather by
    index reads 8 (torch's ``index_select``: only for dtypes numpy has not, into a scratch
    buffer kept across steps). Small values (a
    value per sequence, say) are then summarised together, one numpy pass per statistic
    over all of them stacked; a large one takes four passes of its own: the float64 sum
    and sum of squares (widened in cache-sized chunks, never a whole float64 copy), and
    min/max together. Non-finite values are rare: their presence shows in the float64
    sum (NaN and inf propagate through it), and only then does a row take the slower
    passes that count and exclude them. Reading the CPU is not a device sync.
    """

    def __init__(self, mask: Any, cache: MaskCache, locate: bool = False,
                 top: int | None = None) -> None:
        self.cache = cache
        self.mask = mask
        # the mask's valid positions: flat bool and their count (found once per step)
        self.valid, self.n = (None, 0) if mask is None else cache.valid(mask)
        self._kept: dict[tuple, tuple[Any, Any]] = {}  # memory -> (tensor, its valid values)
        # With ``locate``: each key's min and max positions, flat in its value
        self.locate = locate
        self.at: dict[str, tuple[int, int]] = {}
        # With ``top``: each key's k smallest and largest values and their flat positions,
        # found from the values gathered for its row (``smallest_largest``)
        self.top = top
        self.tops: dict[str, np.ndarray] = {}
        self.search: GroupSearch | None = None  # a call's large values' (``rows``, ``_top``)

    def rows(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Return ``{key: row}`` for CPU tensors and differences of CPU tensors (with
        ``locate``, ``at`` then holds where each key's min and max lie)."""
        # What a Difference reads stays gathered for the call; every other large value
        # is gathered into one shared buffer and summarised before the next is gathered.
        keep = {memory_of(t) for v in values.values() if isinstance(v, Difference)
                for t in (v.a, v.b)}
        out: dict[str, Any] = {}
        small: dict[int, dict[str, Any]] = {}  # length -> {key: numpy array}
        done: dict[tuple, Any] = {}  # memory -> row: the same tensor under two keys
        same: dict[str, str] = {}  # key -> the key whose row it repeats
        found: dict[str, tuple[int, int] | None] = {}  # key -> min, max in the gathered values
        few: dict[int, dict[str, np.ndarray]] = {}  # with ``top``: length -> {key: values}
        self.search = GroupSearch(self.top) if self.top else None
        for key, v in values.items():
            if isinstance(v, Difference):
                g = self._difference(v)  # a shared buffer: summarised before the next one
            else:
                where = memory_of(v)
                if where in done:
                    same[key] = done[where]
                    continue
                done[where] = key
                g = self._gather(v, where, where in keep)
            n = g.numel()
            if self.top and n <= _TINY:  # a few values: their top found stacked
                few.setdefault(n, {})[key] = _numpy(g).copy()
            if n == 0:
                out[key] = identity_row()
            elif n <= _TINY:
                out[key], found[key] = self._tiny_row(g)
            elif n < _SMALL and g.dtype in numpy_dtypes(torch_module()):
                small.setdefault(n, {})[key] = g.numpy().copy() if isinstance(v, Difference) \
                    else g.numpy()
                if self.top:
                    self._top(key, g)
            else:
                out[key], found[key] = self._row(g, top=key if self.top else None)
        if self.search is not None:  # the large values' top samples, all searched at once
            for key, top in self.search.found().items():
                self.tops[key] = top  # the first of each side: the min's and max's place
                found[key] = (int(top[0, 0, 1]), int(top[1, 0, 1]))
        for group in few.values():
            tops = stacked_smallest_largest(np.stack(list(group.values())), self.top)
            self.tops.update(zip(group, tops))
        for group in small.values():
            for key, (row, at) in self._small_rows(group).items():
                out[key], found[key] = row, at
        for key, first in same.items():
            out[key] = out[first].clone()
            found[key] = found.get(first)
            if self.top:
                self.tops[key] = self.tops[first]
        if self.locate:
            self.at = {key: at for key, at in found.items() if at is not None}
        if (self.at or self.tops) and self.valid is not None and self.n != self.valid.size:
            self._place()  # positions among the valid values -> in the value
        return out

    def _place(self) -> None:
        """The positions found among the gathered values (``at``, ``tops``) made the
        values' own flat positions: the mask's, all in one lookup."""
        keys = list(self.tops)
        tops = np.stack([self.tops[key] for key in keys]) if keys else np.empty((0, 2, 1, 3))
        at = tops[..., 1]
        held = ~np.isnan(at)
        first = np.array(list(self.at.values()), np.int64).reshape(-1)
        placed = self.cache.positions(self.mask, np.concatenate([first, at[held].astype(
            np.int64)]))
        self.at = {key: (int(placed[2 * i]), int(placed[2 * i + 1]))
                   for i, key in enumerate(self.at)}
        at[held] = placed[first.size:]
        self.tops = dict(zip(keys, tops))

    def _top(self, key: str, g: Any, finite: bool = False
             ) -> tuple[float, float, tuple[int, int] | None] | None:
        """Find ``key``'s top samples among its gathered values ``g`` (``finite``: every
        one is): many values join the call's ``search`` (their samples found with the
        others' at the end of ``rows``), a few are found now, into ``tops``. Return the min
        and max, and their positions in ``g`` where known now, what the record's are when
        every value is finite (None: no finite value)."""
        x = _numpy(g)
        if not finite:
            found = smallest_largest(x, self.top)
        else:
            extremes = self.search.add(key, x, True)
            if extremes is not None:
                return extremes[0], extremes[1], None
            found = every_finite(x, self.top, True)  # too few groups, or many tied
        first = None
        if not np.isnan(found[0, 0, 0]):
            first = (found[0, 0, 0], found[1, 0, 0],
                     (int(found[0, 0, 1]), int(found[1, 0, 1])))
        self.tops[key] = found  # positions among the gathered values, until ``_place``
        return first

    def _gather(self, x: Any, where: tuple, keep: bool) -> Any:
        """The valid values of ``x``, flat: a view when all are valid; else picked by the
        bool mask, fresh (a dtype numpy has not: by index, into a scratch buffer when many,
        the shared one or a kept one)."""
        held = self._kept.get(where)
        if held is not None:
            return held[1]
        torch = torch_module()
        flat = x.reshape(-1)
        if self.valid is not None and self.n != flat.numel():
            if flat.dtype in numpy_dtypes(torch):  # numpy picks by the bool mask itself
                flat = torch.from_numpy(flat.numpy()[self.valid])
            else:
                index = self.cache.index(self.mask)
                flat = (torch.index_select(flat, 0, index) if self.n < _SMALL else
                        torch.index_select(flat, 0, index, out=self.cache.buffer(
                            flat.dtype, f"kept{len(self._kept)}" if keep else "gathered",
                            self.n)))
        if keep:
            self._kept[where] = (x, flat)  # x is held: its memory cannot be reused meanwhile
        return flat

    def _difference(self, d: Difference) -> Any:
        """``a - b`` over the valid positions only, in float64: exact for float32 and
        smaller inputs, and no larger than the two inputs together."""
        ga = self._gather(d.a, memory_of(d.a), True)
        gb = self._gather(d.b, memory_of(d.b), True)
        res = self.cache.buffer(torch_module().float64, "difference", ga.numel())
        return res.copy_(ga).sub_(gb)

    def _tiny_row(self, v: Any) -> tuple[Any, tuple[int, int] | None]:
        """The row of a few values in plain Python floats (float64; ints exact): a numpy or
        torch call costs more than the arithmetic here. With its min and max positions
        (first of each) when locating."""
        values = [float(x) for x in v.tolist()]
        n = len(values)
        plain = exact_sum(values)
        c = plain / n
        dev = [x - c for x in values]
        q = math.hypot(*dev)  # no overflow or underflow of the squares
        if math.isfinite(c) and math.isfinite(q):
            low, high = min(values), max(values)
            total, low_part, root = from_pivot(float(n), c, sum(dev), q, SCALARS, plain,
                                               centred_exactly(low, high, c))
            at = (values.index(low), values.index(high)) if self.locate else None
            return _host_row(total, n, low, high, root, low_part), at
        return self._row_nonfinite(v)

    def _small_rows(self, group: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Rows of same-length numpy values, stacked: one pass per statistic for all
        (``stacked_rows``); one with a value not finite or past 1e150 on its own."""
        torch = torch_module()
        arrays = list(group.values())
        stacked = (np.stack(arrays) if len(arrays) > 1 else arrays[0][None]).astype(
            np.float64, copy=False)  # exact widening of small values
        rows, ok, at = stacked_rows(stacked, None, self.locate)
        return {key: (torch.from_numpy(rows[i]), at[i] if at else None) if ok[i]
                else self._row_nonfinite(torch.from_numpy(stacked[i]))
                for i, key in enumerate(group)}

    def _row(self, v: Any, clean: bool = False, top: str | None = None
             ) -> tuple[Any, tuple[int, int] | None]:
        """The summary row of flat ``v`` (every position valid, not empty; ``clean``: every
        value finite, so a non-finite sum is an overflow to report, not values to drop).

        A pass in cache-sized float64 chunks sums the values and their squares. Where the
        values sit near 0 next to their spread (``sum(x**2) <= 100 M2``, as most training
        tensors do), ``M2 = sum(x**2) - sum(x)**2 / n`` loses under 100 eps: that is the
        row. Otherwise (a large offset: timestamps, byte counts) a second pass centres each
        chunk on the mean and sums the deviations and their squares: the mean becomes a
        double-double and M2 loses nothing to cancellation. When locating, the min and
        max come from ``argmin`` / ``argmax`` (their first positions, returned too). With
        ``top`` (the key), ``_top`` finds its top samples once the sums have read ``v`` (in
        cache then: the first pass over fresh values pays for reading them); the first of
        each side are the min and max.
        """
        torch = torch_module()
        n = v.numel()
        if not v.is_floating_point():
            v = v.to(torch.float64)  # ints and bools: exact in float64
        total, squares = self._sums(v, 0.0)
        finite = math.isfinite(total) and math.isfinite(squares)  # so is every value
        known = None if top is None else self._top(top, v, finite)
        if not finite:
            if not clean:
                return self._row_nonfinite(v)
            at = None
            if self.locate:
                x = v.numpy()
                at = (int(np.argmin(x)), int(np.argmax(x)))
            return torch.from_numpy(summarize_array(v.numpy())), at  # finite, past 1e308
        if known is None:
            low, high, at = _min_max(v, self.locate)
        else:  # the min and max ``top`` found (every value finite: the first of each side)
            low, high, at = known[0], known[1], known[2] if self.locate else None
        m2 = squares - total * total / n
        if _SAFE_SQUARES[0] < squares < _SAFE_SQUARES[1] and 100.0 * m2 >= squares:
            total_lo, root = 0.0, math.sqrt(m2)
        else:
            pivot = total / n
            d1, squares = self._sums(v, pivot)
            if _SAFE_SQUARES[0] < squares < _SAFE_SQUARES[1]:
                q = math.sqrt(squares)
            else:  # the squares under- or overflowed: scaled
                q = rss(v.to(torch.float64).numpy() - pivot)
            total, total_lo, root = from_pivot(float(n), pivot, d1, q, SCALARS, total,
                                               centred_exactly(low, high, pivot))
        return _host_row(total, n, low, high, root, total_lo), at

    def _sums(self, v: Any, pivot: float) -> tuple[float, float]:
        """``(sum(v - pivot), sum((v - pivot)**2))`` in float64, widened and centred a
        cache-sized chunk at a time (never a whole float64 copy)."""
        torch = torch_module()
        if v.dtype == torch.float64 and not pivot:  # already wide: no copy to make
            return v.sum().item(), torch.dot(v, v).item()
        n = v.numel()
        wide = self.cache.buffer(torch.float64, "wide", min(n, _CHUNK))
        total = squares = 0.0
        for start in range(0, n, _CHUNK):
            piece = v if n <= _CHUNK else v[start:start + _CHUNK]  # one chunk: no slicing
            t = wide if piece.numel() == wide.numel() else wide[: piece.numel()]
            t.copy_(piece)  # exact widening
            if pivot:
                np.subtract(t.numpy(), pivot, out=t.numpy())  # in cache: cheap
            total += t.sum().item()
            squares += torch.dot(t, t).item()
        return total, squares

    def _row_nonfinite(self, v: Any) -> tuple[Any, tuple[int, int] | None]:
        """The row of ``v`` when something in it is not finite (or its sum overflows)."""
        torch = torch_module()
        if not v.is_floating_point():
            v = v.to(torch.float64)
        finite = torch.isfinite(v)
        good = v[finite]  # the rare path: a copy of the finite values is fine
        row, at = self._row(good, clean=True) if good.numel() else (identity_row(), None)
        row[NONFINITE] = float(v.numel() - good.numel())
        if at is not None:  # positions among the finite values -> in v
            kept = torch.nonzero(finite).reshape(-1)
            at = (int(kept[at[0]]), int(kept[at[1]]))
        return row, at
