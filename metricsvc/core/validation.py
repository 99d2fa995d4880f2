"""Boundary checks shared by the client (before sending) and the actor (on receipt).

Every message names the key (or field) and says what was expected and what came.
"""

from __future__ import annotations

import numpy as np

from metricsvc.core.batch import Batch
from metricsvc.core.errors import BatchRejected
from metricsvc.core.extremes import MAX_ID, MIN_ID, NSOURCE
from metricsvc.core.keys import check_key, check_rank
from metricsvc.core.limits import LIMITS, Limits, remember
from metricsvc.core.records import COUNT, M2_ROOT, MAX, MIN, NFIELDS, NONFINITE, SUM, SUM_LO
from metricsvc.core.reduce import KINDS, VALID_CODES
from metricsvc.core.sketch import MIN_ALPHA, SketchSpec

# Counts up to 2**53 are exact in float64; merged over any world size they stay finite,
# so turning them into ints when a step finishes cannot overflow.
MAX_COUNT = float(2**53)


class KeyCache:
    """Key tuples already checked, each with its size in bytes and the layout (kind codes,
    expected contributors, world size) last accepted with it: ranks send the same keys and
    kinds each step, and checking 1000 names per batch would otherwise dominate the merge."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        # keys -> [their bytes, the layout last accepted with them (None: none yet)]
        self._known: dict[tuple[str, ...], list] = {}

    def get(self, keys: tuple[str, ...]) -> list | None:
        return self._known.get(keys)

    def add(self, keys: tuple[str, ...], nbytes: int) -> list:
        entry = [nbytes, None]
        remember(self._known, keys, entry, self.capacity)
        return entry


def check_batch(batch: object, limits: Limits = LIMITS, cache: KeyCache | None = None) -> Batch:
    """Return ``batch`` if it is a well-formed wire batch, else raise ``BatchRejected``."""
    if not isinstance(batch, Batch):
        raise BatchRejected(f"expected a metricsvc Batch, got {type(batch).__name__}")
    try:
        check_rank(batch.rank, batch.world_size)
    except (TypeError, ValueError) as err:
        raise BatchRejected(f"step {batch.step}: {err}") from None
    if batch.world_size > limits.max_world_size:
        raise BatchRejected(
            f"world_size {batch.world_size} exceeds the limit {limits.max_world_size}"
        )
    if not 0 <= batch.step <= MAX_COUNT:
        raise BatchRejected(f"step must be in [0, 2**53], got {batch.step}")
    if batch.seq < 0:
        raise BatchRejected(f"step {batch.step}: seq must be >= 0, got {batch.seq}")
    k = len(batch.keys)
    if k > limits.max_keys_per_batch:
        raise BatchRejected(
            f"batch of rank {batch.rank} step {batch.step} has {k} keys; "
            f"the limit is {limits.max_keys_per_batch}"
        )
    if not isinstance(batch.keys, tuple):
        raise BatchRejected(f"batch keys must be a tuple, got {type(batch.keys).__name__}")
    known = cache.get(batch.keys) if cache is not None else None
    if known is None:
        _check_keys(batch.keys, limits)
        key_bytes = sum(len(key) for key in batch.keys)
        if cache is not None:
            known = cache.add(batch.keys, key_bytes)
    else:
        key_bytes = known[0]
    nbytes = key_bytes + batch.nbytes_without_keys
    if nbytes > limits.max_batch_bytes:
        raise BatchRejected(
            f"batch of rank {batch.rank} step {batch.step} is {nbytes} bytes; "
            f"the limit is {limits.max_batch_bytes}"
        )
    _check_columns(batch, k)
    _check_values(batch, known)
    _check_sketches(batch)
    _check_sources(batch)
    return batch


def _check_keys(keys: tuple, limits: Limits) -> None:
    for key in keys:
        try:
            check_key(key, limits.max_key_length)
        except (TypeError, ValueError) as err:
            raise BatchRejected(str(err)) from None
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        dup = next(key for key in keys if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        raise BatchRejected(f"key {dup!r} appears twice in one batch")


def _check_columns(batch: Batch, k: int) -> None:
    shapes = {
        "data": (batch.data, (k, NFIELDS), np.float64),
        "kinds": (batch.kinds, (k,), np.int8),
        "expected": (batch.expected, (k,), np.int32),
    }
    for name, (arr, shape, dtype) in shapes.items():
        if not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype != dtype:
            got = (
                f"{arr.dtype}{arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
            )
            raise BatchRejected(
                f"batch column {name!r}: expected {np.dtype(dtype)}{shape}, got {got}"
            )


_VALID_CODE = np.zeros(256, dtype=bool)  # indexed by a kind code's byte
_VALID_CODE[[code & 0xFF for code in VALID_CODES]] = True
_WEIGHTED_CODE = np.zeros(256, dtype=bool)  # kinds whose counts may be fractional weights
_WEIGHTED_CODE[[int(k) for k, spec in KINDS.items() if spec.weighted]] = True
_SKETCH_CODE = np.zeros(256, dtype=bool)  # kinds that merge quantile sketches
_SKETCH_CODE[[int(k) for k, spec in KINDS.items() if spec.sketch]] = True


def _check_values(batch: Batch, known: list | None = None) -> None:
    """``known``: the key tuple's ``KeyCache`` entry, whose layout was checked before."""
    if known is None:
        _check_layout(batch)
    else:  # a key tuple's kinds and expected contributors recur every step: checked once
        layout = (batch.kinds.tobytes(), batch.expected.tobytes(), batch.world_size)
        if known[1] != layout:
            _check_layout(batch)
            known[1] = layout
    _check_records(batch)


def _check_layout(batch: Batch) -> None:
    """Every kind code known, every expected contributor count in [0, world_size]."""
    bad_kind = ~_VALID_CODE[batch.kinds.view(np.uint8)]
    if bad_kind.any():
        i = int(np.flatnonzero(bad_kind)[0])
        raise BatchRejected(f"key {batch.keys[i]!r}: unknown reduce code {int(batch.kinds[i])}")
    bad_expected = (batch.expected < 0) | (batch.expected > batch.world_size)
    if bad_expected.any():
        i = int(np.flatnonzero(bad_expected)[0])
        raise BatchRejected(
            f"key {batch.keys[i]!r}: expected contributors must be in [0, {batch.world_size}], "
            f"got {int(batch.expected[i])}"
        )


def _check_records(batch: Batch) -> None:
    """Refuse any row that could not be merged and finalised without raising.

    Sums may overflow (finite values past 1e308 add up to inf, or to NaN through
    inf - inf): that is float64 arithmetic, not corruption, and is flagged at the
    merge. Counts, extrema and squares cannot: a count is finite, >= 0 and at most
    2**53 (integral except for AVG, whose counts are ``weighted_mean`` weights), the
    non-finite count is such an integer too, a populated row has finite ``min <= max``,
    and an empty row is the identity record.
    """
    if not _plainly_whole(batch.data):
        _check_each_rule(batch)


def _check_each_rule(batch: Batch) -> None:
    """``_check_records``' rules, each in turn (what a batch ``_plainly_whole`` does not
    accept goes through)."""
    cols = np.ascontiguousarray(batch.data.T)
    total, count, low, high = cols[SUM], cols[COUNT], cols[MIN], cols[MAX]
    root, nonfinite, low_part = cols[M2_ROOT], cols[NONFINITE], cols[SUM_LO]
    with np.errstate(invalid="ignore"):
        rules = (
            ("count must be finite, in [0, 2**53]", (count >= 0) & (count <= MAX_COUNT)),
            ("count must be a whole number",
             (np.floor(count) == count) | _WEIGHTED_CODE[batch.kinds.view(np.uint8)]),
            ("nonfinite must be a whole number in [0, 2**53]",
             (nonfinite >= 0) & (nonfinite <= MAX_COUNT) & (np.floor(nonfinite) == nonfinite)),
            ("m2_root must be >= 0", ~(root < 0)),  # NaN only where the sum overflowed
            ("sum_lo must be the low part of sum: |sum_lo| <= ulp(sum), 0 if sum is not "
             "finite", np.True_ if not low_part.any() else  # most rows carry no low part
             np.abs(low_part) <= np.spacing(np.abs(np.where(np.isfinite(total), total, 0.0)))),
            ("a populated record needs finite min <= max; an empty record (count 0) must be "
             "the identity (sum 0, min +inf, max -inf)",
             np.where(count > 0, np.isfinite(low) & np.isfinite(high) & (low <= high),
                      (total == 0) & (root == 0) & (low == np.inf) & (high == -np.inf))),
        )
    for rule, good in rules:
        if not good.all():
            i = int(np.flatnonzero(~good)[0])
            raise BatchRejected(
                f"key {batch.keys[i]!r}: corrupt record {batch.data[i].tolist()} ({rule})"
            )


def _plainly_whole(data: np.ndarray) -> bool:
    """The common batch, checked in a few passes over the whole matrix: every count a whole
    number in [1, 2**53], every non-finite count one in [0, 2**53], finite ``min <= max``,
    ``m2_root`` at least 0 and no low part of a sum. False sends the batch through every
    rule of ``_check_records`` (a weighted count, an empty row, a low part, a NaN root, a
    fault), to pass or be refused naming its rule: this accepts nothing they refuse."""
    fields = data[:, _CHECKED]  # a view: every field but the sum, which may be anything
    # NaN fails every comparison (silently): such a batch goes through the full rules
    if not ((fields >= _LOW) & (fields <= _HIGH)).all():
        return False
    counts = data[:, _WHOLE_FIELDS]
    return bool((np.floor(counts) == counts).all() and (data[:, MIN] <= data[:, MAX]).all())


# What ``_plainly_whole`` accepts, field by field from COUNT on (the sum is not checked)
_CHECKED = slice(COUNT, NFIELDS)
_BOUNDS = {COUNT: (1.0, MAX_COUNT), MIN: (-np.finfo(np.float64).max, np.finfo(np.float64).max),
           MAX: (-np.finfo(np.float64).max, np.finfo(np.float64).max), M2_ROOT: (0.0, np.inf),
           NONFINITE: (0.0, MAX_COUNT), SUM_LO: (0.0, 0.0)}
_LOW = np.array([_BOUNDS[f][0] for f in range(COUNT, NFIELDS)])
_HIGH = np.array([_BOUNDS[f][1] for f in range(COUNT, NFIELDS)])
_WHOLE_FIELDS = slice(COUNT, NONFINITE + 1, NONFINITE - COUNT)  # COUNT and NONFINITE


def _check_sources(batch: Batch) -> None:
    """Where a min and max came from: distinct key rows; positions and call numbers whole
    numbers in [0, 2**53] (or NaN: unknown, all three together); ids finite or NaN."""
    rows, src = batch.extreme_rows, batch.extremes
    if not (isinstance(rows, np.ndarray) and rows.ndim == 1 and rows.dtype == np.int32
            and isinstance(src, np.ndarray) and src.shape == (len(rows), NSOURCE)):
        raise BatchRejected("batch extreme columns are inconsistent (rows/sources)")
    if rows.size == 0:
        return
    if rows.min() < 0 or rows.max() >= len(batch.keys) or len(np.unique(rows)) != len(rows):
        raise BatchRejected("batch extreme rows must name distinct keys of the batch")
    for first in (MIN_ID, MAX_ID):
        ident, where = src[:, first], src[:, first + 1: first + 4]
        unknown = np.isnan(where)
        whole = (where >= 0) & (where <= MAX_COUNT) & (np.floor(where) == where)
        bad = ~(unknown.all(1) | whole.all(1)) | np.isinf(ident)
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            raise BatchRejected(
                f"key {batch.keys[int(rows[j])]!r}: where its min and max came from "
                f"{src[j].tolist()} (call, row and column must be whole numbers >= 0, "
                f"or all NaN; an id finite or NaN)")


def _check_sketches(batch: Batch) -> None:
    rows, offsets = batch.sketch_rows, batch.sketch_offsets
    n = len(batch.sketch_codes)
    ok = (
        isinstance(rows, np.ndarray) and rows.ndim == 1 and rows.dtype == np.int32
        and isinstance(offsets, np.ndarray) and offsets.shape == (len(rows) + 1,)
        and offsets[0] == 0 and offsets[-1] == n
        and (rows.size == 0 or bool(np.all(np.diff(offsets) >= 0)))  # one offset: sorted
        and batch.sketch_counts.shape == (n,) and batch.sketch_codes.dtype == np.int32
    )
    if not ok:
        raise BatchRejected("batch sketch columns are inconsistent (rows/offsets/codes/counts)")
    if rows.size == 0:
        return
    if rows.min() < 0 or rows.max() >= len(batch.keys) or len(np.unique(rows)) != len(rows):
        raise BatchRejected("batch sketch rows must name distinct keys of the batch")
    not_q = ~_SKETCH_CODE[batch.kinds[rows].view(np.uint8)]
    if not_q.any():
        key = batch.keys[int(rows[np.flatnonzero(not_q)[0]])]
        raise BatchRejected(f"key {key!r}: a quantile sketch was sent for a non-QUANTILES key")
    top = SketchSpec(batch.sketch_alpha).top if MIN_ALPHA <= batch.sketch_alpha < 1 else 0
    if batch.sketch_codes.size and np.abs(batch.sketch_codes.astype(np.int64)).max() > top:
        raise BatchRejected(f"batch sketch codes must lie in [-{top}, {top}] (alpha "
                            f"{batch.sketch_alpha})")
    counts = batch.sketch_counts
    if not np.all((counts >= 0) & (counts <= MAX_COUNT) & (np.floor(counts) == counts)):
        raise BatchRejected("batch sketch counts must be whole numbers in [0, 2**53]")
    totals = np.zeros(len(rows))
    filled = np.diff(offsets) > 0  # reduceat needs the empty ranges left out
    if filled.any():
        totals[filled] = np.add.reduceat(counts, offsets[:-1][filled])
    off = totals != batch.data[rows, COUNT]
    if off.any():
        j = int(np.flatnonzero(off)[0])
        raise BatchRejected(
            f"key {batch.keys[int(rows[j])]!r}: its quantile sketch holds {totals[j]:g} values "
            f"but its record counts {batch.data[int(rows[j]), COUNT]:g}"
        )
