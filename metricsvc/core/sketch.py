"""A mergeable quantile sketch in the DDSketch style over every finite float64 (pure numpy).

Bucket boundaries are one table per accuracy ``alpha``: ``bounds[j] = gamma ** (j + low)``
with ``gamma = (1 + alpha) / (1 - alpha)``, from below the smallest normal float
(``bounds[0] = 0``) up to ``inf``. A positive value ``v`` has the bucket code ``b`` with
``bounds[b-1] <= v < bounds[b]``, a negative value ``-v`` the code ``-b`` with
``bounds[b-1] < v <= bounds[b]``, and 0 the code 0. Every bucket is therefore closed on
its lower edge and open on its upper one, as numpy's (and wandb's) histogram bins are: a
value that sits exactly on an exported edge is counted in the bin that starts there.
Every value in a bucket is within relative error ``alpha`` of its representative
``bounds[b-1] * (1 + alpha)``, over the whole float64 range (only subnormals share one
bucket).

On a device, buckets are filled into a fixed dense layout (``SketchSpec.size`` counts,
slot ``code + SketchSpec.top``) with a scatter-add and no sync; on the wire they travel
as sparse ``(code, count)`` pairs. Merging adds counts: exact and independent of order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from metricsvc.core.limits import SKETCH_ALPHA

# A sparse sketch: bucket codes and their counts.
Sketch = tuple[np.ndarray, np.ndarray]

MIN_ALPHA = 0.001  # finer buckets make the dense device layout past 10 MB per key
_SMALLEST_NORMAL = 2.2250738585072014e-308


@dataclass(frozen=True)
class SketchSpec:
    """Sketch accuracy: every quantile within relative error ``alpha`` of a data value."""

    alpha: float = SKETCH_ALPHA

    def __post_init__(self) -> None:
        if not MIN_ALPHA <= self.alpha < 1:
            raise ValueError(f"sketch alpha must be in [{MIN_ALPHA}, 1), got {self.alpha}")

    @property
    def gamma(self) -> float:
        return (1 + self.alpha) / (1 - self.alpha)

    @property
    def log_gamma(self) -> float:
        return math.log(self.gamma)

    @property
    def bounds(self) -> np.ndarray:
        """The bucket boundaries (read-only float64, ``bounds[0] = 0``, ``bounds[-1] = inf``)."""
        return _bounds(self.alpha)

    @property
    def low(self) -> int:
        """The exponent of ``bounds[1]``, minus one."""
        return math.floor(math.log(_SMALLEST_NORMAL) / self.log_gamma) - 1

    @property
    def top(self) -> int:
        """The largest bucket code (that of the largest floats)."""
        return len(self.bounds) - 1

    @property
    def size(self) -> int:
        """Length of the dense layout: negative buckets, zero, positive buckets."""
        return 2 * self.top + 1


@functools.lru_cache(maxsize=8)
def _bounds(alpha: float) -> np.ndarray:
    spec = SketchSpec(alpha)
    lg = spec.log_gamma
    last = math.ceil(math.log(np.finfo(np.float64).max) / lg) + 2  # gamma**last overflows
    with np.errstate(over="ignore"):
        table = np.power(spec.gamma, np.arange(spec.low, last + 1, dtype=np.float64))
    table = np.maximum.accumulate(np.concatenate([[0.0], table[1:]]))
    table = table[: int(np.argmax(np.isinf(table))) + 1]  # ends at its first inf
    table.setflags(write=False)
    return table


def sketch_codes(values: np.ndarray, spec: SketchSpec) -> np.ndarray:
    """Return the bucket code (int64) of each finite value."""
    v = np.asarray(values, dtype=np.float64).ravel()
    mag = np.abs(v)
    bounds = spec.bounds
    with np.errstate(divide="ignore"):
        est = np.floor(np.log(np.where(mag > 0, mag, 1.0)) / spec.log_gamma) - spec.low
    b = np.clip(est, 1, len(bounds) - 1).astype(np.int64)
    neg = v < 0
    for _ in range(64):  # the estimate is off by at most one bucket: this runs once or twice
        lower, upper = bounds[b - 1], bounds[b]
        down = np.where(neg, mag <= lower, mag < lower) & (b > 1)
        up = np.where(neg, mag > upper, mag >= upper)
        if not (down.any() or up.any()):
            break
        b += up.astype(np.int64) - down.astype(np.int64)
    return np.where(mag == 0, 0, np.where(neg, -b, b))


def dense_counts(values: np.ndarray, spec: SketchSpec) -> np.ndarray:
    """Return the dense bucket counts of finite ``values`` (float64, length ``spec.size``)."""
    slots = sketch_codes(values, spec) + spec.top
    return np.bincount(slots, minlength=spec.size).astype(np.float64)


def sparse_counts(values: np.ndarray, spec: SketchSpec) -> tuple[np.ndarray, np.ndarray]:
    """Return the non-empty buckets of finite ``values`` as ``(codes int32, counts float64)``."""
    return dense_to_sparse(dense_counts(values, spec), spec)


def dense_to_sparse(dense: np.ndarray, spec: SketchSpec) -> tuple[np.ndarray, np.ndarray]:
    """Return the non-empty buckets of a dense layout as ``(codes int32, counts float64)``."""
    slots = np.flatnonzero(dense)
    return (slots - spec.top).astype(np.int32), dense[slots].astype(np.float64)


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


def _representative(codes: np.ndarray, spec: SketchSpec) -> np.ndarray:
    b = np.abs(codes)
    bounds = spec.bounds
    with np.errstate(over="ignore"):
        mag = np.where(b > 1, bounds[np.maximum(b - 1, 0)] * (1 + spec.alpha), bounds[1] / 2)
    return np.where(codes == 0, 0.0, np.sign(codes) * mag)


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
    order = np.argsort(codes, kind="stable")  # codes sort as their values do
    vals = _representative(codes[order], spec)
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


def lower_edges(codes: np.ndarray, spec: SketchSpec) -> np.ndarray:
    """Return each bucket's lower (closed) edge: ``bounds[b-1]``, ``-bounds[b]``, or 0."""
    b = np.abs(codes)
    bounds = spec.bounds
    return np.where(codes > 0, bounds[np.maximum(b - 1, 0)], np.where(codes < 0, -bounds[b], 0.0))


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

    Each bin is a run of adjacent occupied buckets; every interior edge is a bucket's
    lower edge (so a bin holds exactly the values of its buckets, and ``np.histogram`` of
    the data on these edges gives these counts), the outer edges are the exact merged
    ``lo`` and ``hi``. Empty buckets between runs are folded into the bin below, which
    holds no value there.
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
    lower = lower_edges(codes[firsts], spec)
    edges = np.concatenate([[lo], lower[1:], [hi]]).astype(np.float64)
    edges = np.maximum.accumulate(edges)
    if edges[-1] <= edges[0]:  # one value: a bin of no width cannot be drawn
        edges[-1] = np.nextafter(edges[0], np.inf)
    return edges, bin_counts
