"""A mergeable quantile sketch in the DDSketch style (pure numpy: no torch, no I/O).

A value ``v`` falls in the log bucket ``i = ceil(log|v| / log(gamma))`` with
``gamma = (1 + alpha) / (1 - alpha)``; every value in bucket ``i`` is within
relative error ``alpha`` of the bucket's representative ``2 gamma^i / (gamma + 1)``.
Negative values use mirrored buckets, ``|v| < min_value`` counts as zero.

Buckets live in a fixed dense layout (``SketchSpec.size`` counts) so that a
device can fill them with a scatter-add and no sync; on the wire they travel as
sparse ``(code, count)`` pairs, with ``code = sign * (i + BIAS)`` (0 = zero).
Merging adds counts: exact and independent of order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BIAS = 1 << 20  # keeps every signed bucket code away from 0 (zero's code)


@dataclass(frozen=True)
class SketchSpec:
    """Sketch accuracy and the magnitude range kept at full accuracy."""

    alpha: float = 0.01
    min_value: float = 1e-9
    max_value: float = 1e9

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"sketch alpha must be in (0, 1), got {self.alpha}")
        if not 0 < self.min_value < self.max_value:
            raise ValueError(
                f"sketch range needs 0 < min_value < max_value, "
                f"got {self.min_value}, {self.max_value}"
            )

    @property
    def gamma(self) -> float:
        return (1 + self.alpha) / (1 - self.alpha)

    @property
    def log_gamma(self) -> float:
        return math.log(self.gamma)

    @property
    def lowest(self) -> int:
        """Bucket index of ``min_value``."""
        return math.ceil(math.log(self.min_value) / self.log_gamma)

    @property
    def highest(self) -> int:
        """Bucket index of ``max_value`` (larger magnitudes are clamped into it)."""
        return math.ceil(math.log(self.max_value) / self.log_gamma)

    @property
    def per_sign(self) -> int:
        return self.highest - self.lowest + 1

    @property
    def size(self) -> int:
        """Length of the dense layout: negative buckets, zero, positive buckets."""
        return 2 * self.per_sign + 1


def dense_slots(values: np.ndarray, spec: SketchSpec) -> np.ndarray:
    """Return the dense-layout slot of each value (numpy twin of the client's torch code)."""
    v = np.asarray(values, dtype=np.float64)
    mag = np.abs(v)
    with np.errstate(divide="ignore"):
        idx = np.ceil(np.log(np.maximum(mag, spec.min_value)) / spec.log_gamma)
    idx = np.clip(idx, spec.lowest, spec.highest).astype(np.int64) - spec.lowest
    zero = spec.per_sign
    return np.where(mag < spec.min_value, zero, np.where(v > 0, zero + 1 + idx, zero - 1 - idx))


def dense_counts(values: np.ndarray, spec: SketchSpec) -> np.ndarray:
    """Return the dense bucket counts of finite ``values`` (float64, length ``spec.size``)."""
    slots = dense_slots(values, spec)
    return np.bincount(slots, minlength=spec.size).astype(np.float64)


def dense_to_sparse(dense: np.ndarray, spec: SketchSpec) -> tuple[np.ndarray, np.ndarray]:
    """Return the non-empty buckets of a dense layout as ``(codes int32, counts float64)``."""
    slots = np.flatnonzero(dense)
    zero = spec.per_sign
    offset = slots - zero  # <0 negative buckets, 0 zero, >0 positive buckets
    idx = np.abs(offset) - 1 + spec.lowest
    codes = np.where(offset == 0, 0, np.sign(offset) * (idx + BIAS))
    return codes.astype(np.int32), dense[slots].astype(np.float64)


def merge_sparse(
    parts: Sequence[tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray]:
    """Return the sum of sparse sketches as sorted unique codes and their counts."""
    if not parts:
        return np.zeros(0, dtype=np.int32), np.zeros(0)
    codes = np.concatenate([p[0] for p in parts])
    counts = np.concatenate([p[1] for p in parts])
    uniq, inverse = np.unique(codes, return_inverse=True)
    return uniq.astype(np.int32), np.bincount(inverse, weights=counts, minlength=uniq.size)


def _representative(codes: np.ndarray, gamma: float) -> np.ndarray:
    sign = np.sign(codes)
    idx = np.abs(codes) - BIAS
    return np.where(codes == 0, 0.0, sign * 2.0 * gamma ** idx.astype(np.float64) / (gamma + 1))


def quantiles(
    codes: np.ndarray,
    counts: np.ndarray,
    qs: Sequence[float],
    spec: SketchSpec,
    lo: float = -math.inf,
    hi: float = math.inf,
) -> list[float] | None:
    """Return the ``qs`` quantiles of a merged sketch, clamped to the exact ``[lo, hi]``.

    The quantile ``q`` is the value of rank ``floor(q * (n - 1))`` (0-based) in
    sorted order, within relative error ``alpha``. None for an empty sketch.
    """
    total = float(counts.sum())
    if total <= 0:
        return None
    # Codes sort as their values do: -(i + BIAS) is smaller for larger magnitudes.
    order = np.argsort(codes, kind="stable")
    vals = _representative(codes[order], spec.gamma)
    cum = np.cumsum(counts[order])
    out = []
    for q in qs:
        rank = math.floor(q * (total - 1))
        pos = int(np.searchsorted(cum, rank, side="right"))
        out.append(float(min(max(vals[min(pos, vals.size - 1)], lo), hi)))
    return out


def quantile_name(q: float) -> str:
    """Return the output suffix of a quantile: 0.5 -> 'p50', 0.999 -> 'p99.9'."""
    return f"p{q * 100:g}"


def _lower_bounds(codes: np.ndarray, spec: SketchSpec) -> np.ndarray:
    """Return each bucket's lower bound: positive ``(g^(i-1), g^i]``, negative
    ``[-g^i, -g^(i-1))``, zero ``(-min_value, min_value)``."""
    idx = (np.abs(codes) - BIAS).astype(np.float64)
    gamma = spec.gamma
    return np.where(codes > 0, gamma ** (idx - 1),
                    np.where(codes < 0, -(gamma ** idx), -spec.min_value))


def histogram(
    codes: np.ndarray,
    counts: np.ndarray,
    spec: SketchSpec,
    lo: float,
    hi: float,
    max_bins: int = 64,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Return a merged sketch as a histogram ``(edges, counts)`` of at most ``max_bins``
    bins, or None if it is empty.

    Each bin is a run of adjacent occupied buckets; every interior edge is a bucket
    boundary (so a bin holds exactly the values of its buckets), the outer edges are the
    exact merged ``lo`` and ``hi``. Empty buckets between runs are folded into the bin
    below, which holds no value there.
    """
    keep = counts > 0
    codes, counts = codes[keep], counts[keep]
    if codes.size == 0 or max_bins < 1:
        return None
    order = np.argsort(codes, kind="stable")  # codes sort as their values do
    codes, counts = codes[order], counts[order]
    groups = np.array_split(np.arange(codes.size), min(max_bins, codes.size))
    firsts = np.array([g[0] for g in groups])
    bin_counts = np.add.reduceat(counts, firsts)
    lower = _lower_bounds(codes[firsts], spec)
    edges = np.concatenate([[lo], lower[1:], [hi]]).astype(np.float64)
    edges = np.maximum.accumulate(edges)  # float rounding at a boundary never reverses them
    if edges[-1] <= edges[0]:  # one value: a bin of no width cannot be drawn
        edges[-1] = np.nextafter(edges[0], np.inf)
    return edges, bin_counts
