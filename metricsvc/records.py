"""Summary records and their merge algebra (pure numpy: no Ray, no I/O, no torch).

A record is one float64 row of sufficient statistics per key:
``(sum, count, min, max, sumsq, nonfinite)``. Merging adds sums, counts,
squares and non-finite counts, and takes the min of mins and the max of maxes.
The identity record (count 0, min +inf, max -inf) merges as a no-op, so an
empty population is a documented value, never a fabricated 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

SUM, COUNT, MIN, MAX, SUMSQ, NONFINITE = range(6)
FIELDS = ("sum", "count", "min", "max", "sumsq", "nonfinite")
NFIELDS = len(FIELDS)

_IDENTITY_ROW = np.array([0.0, 0.0, np.inf, -np.inf, 0.0, 0.0], dtype=np.float64)


def identity(n: int = 1) -> np.ndarray:
    """Return ``n`` identity records as an ``[n, NFIELDS]`` float64 matrix."""
    return np.tile(_IDENTITY_ROW, (n, 1))


def merge(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Return the merge of two record matrices of equal shape; neither is changed."""
    out = a + b  # sum, count, sumsq and nonfinite add; min/max fixed below
    out[..., MIN] = np.minimum(a[..., MIN], b[..., MIN])
    out[..., MAX] = np.maximum(a[..., MAX], b[..., MAX])
    return out


def merge_into(acc: np.ndarray, rows: np.ndarray, idx: np.ndarray) -> None:
    """Merge ``rows`` into ``acc[idx]`` in place; ``idx`` must hold unique row numbers."""
    cur = acc[idx]
    acc[idx] = merge(cur, rows)


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
        # Finite values may still sum past float64's range: that is flagged, not an error.
        with np.errstate(over="ignore", invalid="ignore"):
            row[SUM] = x.sum()
            row[SUMSQ] = np.dot(x, x)
        row[COUNT] = x.size
        row[MIN] = x.min()
        row[MAX] = x.max()
    return row


def scalar_row(value: float, weight: float = 1.0) -> np.ndarray:
    """Return the record of one plain number counted ``weight`` times."""
    value, weight = float(value), float(weight)  # Python floats: an overflow is inf, silently
    if not math.isfinite(value):
        row = _IDENTITY_ROW.copy()
        row[NONFINITE] = 1.0
        return row
    if weight == 0:  # counted zero times: nothing recorded, not a min or max either
        return _IDENTITY_ROW.copy()
    return np.array([value * weight, weight, value, value, value * value * weight, 0.0])


def scalar_rows(values: np.ndarray) -> np.ndarray:
    """Return one record per plain number (count 1 each; NaN/inf counted as nonfinite)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    rows = np.empty((v.size, NFIELDS), dtype=np.float64)
    if v.size and np.isfinite(v).all() and np.abs(v).max() < 1e150:  # the common case
        rows[:, SUM] = v
        rows[:, COUNT] = 1.0
        rows[:, MIN] = v
        rows[:, MAX] = v
        np.multiply(v, v, out=rows[:, SUMSQ])  # cannot overflow: checked above
        rows[:, NONFINITE] = 0.0
        return rows
    finite = np.isfinite(v)
    z = np.where(finite, v, 0.0)
    rows[:, SUM] = z
    rows[:, COUNT] = finite
    rows[:, MIN] = np.where(finite, v, np.inf)
    rows[:, MAX] = np.where(finite, v, -np.inf)
    with np.errstate(over="ignore"):
        rows[:, SUMSQ] = z * z
    rows[:, NONFINITE] = ~finite
    return rows


@dataclass(frozen=True)
class Batch:
    """One rank's contribution to one step, columnar: no per-key objects cross the wire.

    ``kinds`` holds a reduce-kind code per key (``reduce.AUTO`` lets the service
    choose from the key name); ``expected`` the number of ranks expected to send
    each key (0 means the step's world size). Quantile sketches travel as CSR:
    key row ``sketch_rows[j]`` owns ``sketch_codes/counts[offsets[j]:offsets[j+1]]``.
    """

    step: int
    rank: int
    world_size: int
    seq: int
    final: bool
    keys: tuple[str, ...]
    data: np.ndarray  # [K, NFIELDS] float64
    kinds: np.ndarray  # [K] int8
    expected: np.ndarray  # [K] int32
    sketch_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    sketch_offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    sketch_codes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    sketch_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    sketch_alpha: float = 0.01
    derived: bytes = b""  # the sender's derived-metric declarations (``declare``), encoded

    @classmethod
    def build(
        cls,
        *,
        step: int,
        rank: int,
        world_size: int,
        seq: int,
        final: bool,
        keys: Sequence[str],
        data: np.ndarray,
        kinds: Sequence[int],
        expected: Sequence[int],
        sketches: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None,
        sketch_alpha: float = 0.01,
        derived: bytes = b"",
    ) -> Batch:
        """Build a batch, coercing the columns to their wire dtypes.

        ``sketches`` maps a key's row to its sparse ``(codes, counts)`` buckets.
        """
        k = len(keys)
        rows = sorted(sketches or {})
        parts = [sketches[r] for r in rows] if sketches else []
        sizes = [len(p[0]) for p in parts]
        return cls(
            step=int(step),
            rank=int(rank),
            world_size=int(world_size),
            seq=int(seq),
            final=bool(final),
            keys=tuple(keys),
            data=np.ascontiguousarray(data, dtype=np.float64).reshape(k, NFIELDS),
            kinds=np.asarray(kinds, dtype=np.int8).reshape(k),
            expected=np.asarray(expected, dtype=np.int32).reshape(k),
            sketch_rows=np.asarray(rows, dtype=np.int32),
            sketch_offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            sketch_codes=np.concatenate([np.zeros(0), *[p[0] for p in parts]]).astype(np.int32),
            sketch_counts=np.concatenate([np.zeros(0), *[p[1] for p in parts]]).astype(
                np.float64
            ),
            sketch_alpha=float(sketch_alpha),
            derived=bytes(derived),
        )

    def sketch(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Return the ``j``-th sketch of the batch as ``(codes, counts)``."""
        lo, hi = int(self.sketch_offsets[j]), int(self.sketch_offsets[j + 1])
        return self.sketch_codes[lo:hi], self.sketch_counts[lo:hi]

    @property
    def nbytes_without_keys(self) -> int:
        """Return the wire size of the numeric columns in bytes."""
        return int(self.data.nbytes + self.kinds.nbytes + self.expected.nbytes
                   + self.sketch_codes.nbytes + self.sketch_counts.nbytes + len(self.derived))

    @property
    def nbytes(self) -> int:
        """Return the approximate wire size of the batch in bytes."""
        return self.nbytes_without_keys + sum(len(key) for key in self.keys)
