"""The wire batch: one rank's contribution to one step, columnar (pure numpy)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from metricsvc.core.extremes import NSOURCE
from metricsvc.core.limits import SKETCH_ALPHA
from metricsvc.core.records import NFIELDS


def _empty(dtype: type, shape: tuple = (0,)) -> Callable[[], np.ndarray]:
    """A column's default: shared by every batch that carries none (most carry no sketch and
    no located extremes), so read-only."""
    a = np.zeros(shape, dtype=dtype)
    a.flags.writeable = False
    return lambda: a


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
    sketch_rows: np.ndarray = field(default_factory=_empty(np.int32))
    sketch_offsets: np.ndarray = field(default_factory=_empty(np.int64, (1,)))
    sketch_codes: np.ndarray = field(default_factory=_empty(np.int32))
    sketch_counts: np.ndarray = field(default_factory=_empty(np.float64))
    sketch_alpha: float = SKETCH_ALPHA
    derived: bytes = b""  # the sender's derived-metric declarations (``declare``), encoded
    # Where some keys' min and max came from (``core.extremes``): key rows, [E, NSOURCE]
    extreme_rows: np.ndarray = field(default_factory=_empty(np.int32))
    extremes: np.ndarray = field(default_factory=_empty(np.float64, (0, NSOURCE)))

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
        sketch_alpha: float = SKETCH_ALPHA,
        derived: bytes = b"",
        extremes: Mapping[int, np.ndarray] | None = None,
    ) -> Batch:
        """Build a batch, coercing the columns to their wire dtypes.

        ``sketches`` maps a key's row to its sparse ``(codes, counts)`` buckets,
        ``extremes`` a key's row to where its min and max came from (``core.extremes``).
        """
        k = len(keys)
        columns: dict[str, np.ndarray] = {}  # the rest: the empty defaults
        if sketches:
            rows = sorted(sketches)
            parts = [sketches[r] for r in rows]
            columns.update(
                sketch_rows=np.asarray(rows, dtype=np.int32),
                sketch_offsets=np.concatenate(
                    [[0], np.cumsum([len(p[0]) for p in parts])]).astype(np.int64),
                sketch_codes=np.concatenate([p[0] for p in parts]).astype(np.int32),
                sketch_counts=np.concatenate([p[1] for p in parts]).astype(np.float64))
        if extremes:
            held = sorted(extremes)
            columns.update(
                extreme_rows=np.asarray(held, dtype=np.int32),
                extremes=np.asarray([extremes[r] for r in held],
                                    dtype=np.float64).reshape(len(held), NSOURCE))
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
            sketch_alpha=float(sketch_alpha),
            derived=bytes(derived),
            **columns,
        )

    def sketch(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Return the ``j``-th sketch of the batch as ``(codes, counts)``."""
        lo, hi = int(self.sketch_offsets[j]), int(self.sketch_offsets[j + 1])
        return self.sketch_codes[lo:hi], self.sketch_counts[lo:hi]

    @property
    def nbytes_without_keys(self) -> int:
        """Return the wire size of the numeric columns in bytes."""
        return int(self.data.nbytes + self.kinds.nbytes + self.expected.nbytes
                   + self.sketch_codes.nbytes + self.sketch_counts.nbytes + len(self.derived)
                   + self.extreme_rows.nbytes + self.extremes.nbytes)

    @property
    def nbytes(self) -> int:
        """Return the approximate wire size of the batch in bytes."""
        return self.nbytes_without_keys + sum(len(key) for key in self.keys)
