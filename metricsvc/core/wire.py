"""The wire batch: one rank's contribution to one step, its bytes and its rules.

A batch is columnar (no per-key Python objects cross the RPC): a tuple of keys, a float64
record matrix ``[K, NFIELDS]``, a reduce-kind code and an expected-contributors count per
key, optional quantile sketches (CSR) and where some keys' min and max came from, the
sender's derived-metric declarations, and ``step, rank, world_size, seq, final``.

It travels as one flat bytes object (no pickle): Ray serialises a dataclass holding
several numpy arrays about a millisecond slower per call than one bytes object of the
same content (each array travels as its own out-of-band buffer), and one call per rank
per step is the product's whole budget::

    header  <q step, i rank, i world_size, q seq, ? final, d sketch_alpha,
             I keys, I sketches, I buckets, I key bytes, I declaration bytes, I sources,
             I top samples>
    keys    UTF-8, separated by NUL (a valid key never contains NUL)
    derived the derived-metric declarations, UTF-8 JSON (``metricsvc.core.declare``)
    columns data f64[K*7] · kinds i8[K] · expected i32[K] · sketch_rows i32[S]
            · sketch_offsets i64[S+1] · sketch_codes i32[N] · sketch_counts f64[N]
            · extreme_rows i32[E] · extremes f64[E*13] · top_rows i32[T] · top f64[T*7]

``receive`` is the service's one boundary: the bytes decoded and every rule checked once,
each refusal a ``BatchRejected`` naming the key (or field), what was expected and what came.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from metricsvc.core.declare import Derived, decode_declarations
from metricsvc.core.keys import check_key, check_rank
from metricsvc.core.limits import (
    LIMITS,
    MAX_TEXT_BYTES,
    MAX_TEXT_FIELDS,
    MAX_TOP,
    SKETCH_ALPHA,
    Limits,
    Recent,
)
from metricsvc.core.records import (
    COUNT,
    LOCATED,
    M2_ROOT,
    MAX,
    MIN,
    NF_VALUE,
    NFIELDS,
    NONFINITE,
    NSOURCE,
    NTOP,
    SUM,
    SUM_LO,
    Top,
)
from metricsvc.core.reduce import KINDS, VALID_CODES
from metricsvc.core.sketch import MIN_ALPHA, SketchSpec
from metricsvc.errors import BatchRejected


def _empty(dtype: type, shape: tuple = (0,)) -> np.ndarray:
    """A column a batch does not carry: one array shared by every such batch (most carry no
    sketch and no located extremes), so read-only."""
    a = np.zeros(shape, dtype=dtype)
    a.setflags(write=False)
    return a


# The optional columns, empty: what a batch that carries none holds
EMPTY = {"sketch_rows": _empty(np.int32), "sketch_offsets": _empty(np.int64, (1,)),
         "sketch_codes": _empty(np.int32), "sketch_counts": _empty(np.float64),
         "extreme_rows": _empty(np.int32), "extremes": _empty(np.float64, (0, NSOURCE)),
         "top_rows": _empty(np.int32), "top": _empty(np.float64, (0, NTOP))}


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
    sketch_rows: np.ndarray = field(default_factory=lambda: EMPTY["sketch_rows"])
    sketch_offsets: np.ndarray = field(default_factory=lambda: EMPTY["sketch_offsets"])
    sketch_codes: np.ndarray = field(default_factory=lambda: EMPTY["sketch_codes"])
    sketch_counts: np.ndarray = field(default_factory=lambda: EMPTY["sketch_counts"])
    sketch_alpha: float = SKETCH_ALPHA
    derived: bytes = b""  # the sender's derived-metric declarations (``declare``), encoded
    # ``derived`` decoded and checked at the service's boundary (``receive``): the derived
    # metrics, and what declared names mean (``{name: (help, unit)}``)
    declared: tuple[Derived, ...] = ()
    about: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # Where some keys' min and max came from (``core.extremes``): key rows, [E, NSOURCE]
    extreme_rows: np.ndarray = field(default_factory=lambda: EMPTY["extreme_rows"])
    extremes: np.ndarray = field(default_factory=lambda: EMPTY["extremes"])
    # The largest and smallest samples of some keys (``stat(top=k)``): key rows, [T, NTOP]
    top_rows: np.ndarray = field(default_factory=lambda: EMPTY["top_rows"])
    top: np.ndarray = field(default_factory=lambda: EMPTY["top"])
    # Their payloads (``stat(text=)``), one per top sample or none at all: None, or
    # ``[text or {field: text}, UTF-8 bytes cut off]``
    top_text: tuple[Any, ...] = ()

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
        top: Mapping[int, np.ndarray] | None = None,
        top_text: Mapping[int, Sequence[Any]] | None = None,
    ) -> Batch:
        """Build a batch, coercing the columns to their wire dtypes.

        ``sketches`` maps a key's row to its sparse ``(codes, counts)`` buckets,
        ``extremes`` a key's row to where its min and max came from (``core.extremes``),
        ``top`` a key's row to its top samples (``[n, NTOP]``, fields ``records.Top``),
        ``top_text`` a key's row to their payloads (``Batch.top_text``).
        """
        k = len(keys)
        columns = dict(EMPTY)  # the optional columns it carries replace these
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
        if top:
            held = sorted(top)
            columns.update(
                top_rows=np.concatenate([np.full(len(top[r]), r, np.int32) for r in held]),
                top=np.concatenate([np.asarray(top[r], np.float64).reshape(-1, NTOP)
                                    for r in held]))
            if top_text:
                columns["top_text"] = tuple(t for r in held
                                            for t in top_text.get(r) or [None] * len(top[r]))
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
        """Return the wire size of the columns in bytes (a top sample's payload counted at
        its bound, ``MAX_TEXT_BYTES``)."""
        return int(self.data.nbytes + self.kinds.nbytes + self.expected.nbytes
                   + self.sketch_codes.nbytes + self.sketch_counts.nbytes + len(self.derived)
                   + self.extreme_rows.nbytes + self.extremes.nbytes + self.top_rows.nbytes
                   + self.top.nbytes + MAX_TEXT_BYTES * len(self.top_text))

    @property
    def nbytes(self) -> int:
        """Return the approximate wire size of the batch in bytes."""
        return self.nbytes_without_keys + sum(len(key) for key in self.keys)


_HEADER = struct.Struct("<qiiq?dIIIIIIII")
# Each column: its name, dtype, and length as counts of (K keys, S sketches, N buckets,
# E located keys, T top samples) and a constant: every length is linear in them.
_COLUMNS = (
    ("data", np.float64, (NFIELDS, 0, 0, 0, 0, 0)),
    ("kinds", np.int8, (1, 0, 0, 0, 0, 0)),
    ("expected", np.int32, (1, 0, 0, 0, 0, 0)),
    ("sketch_rows", np.int32, (0, 1, 0, 0, 0, 0)),
    ("sketch_offsets", np.int64, (0, 1, 0, 0, 0, 1)),
    ("sketch_codes", np.int32, (0, 0, 1, 0, 0, 0)),
    ("sketch_counts", np.float64, (0, 0, 1, 0, 0, 0)),
    ("extreme_rows", np.int32, (0, 0, 0, 1, 0, 0)),
    ("extremes", np.float64, (0, 0, 0, NSOURCE, 0, 0)),
    ("top_rows", np.int32, (0, 0, 0, 0, 1, 0)),
    ("top", np.float64, (0, 0, 0, 0, NTOP, 0)),
)
_LAYOUT = tuple((name, np.dtype(dtype), np.dtype(dtype).itemsize, per)
                for name, dtype, per in _COLUMNS)
# The columns' bytes: ``_FIXED + _PER_K * K + _PER_S * S + _PER_N * N + _PER_E * E
# + _PER_T * T``
_PER_K, _PER_S, _PER_N, _PER_E, _PER_T, _FIXED = (
    sum(itemsize * per[i] for _, _, itemsize, per in _LAYOUT) for i in range(6))


def encode(batch: Batch) -> bytes:
    """Return ``batch`` as one bytes object."""
    keys = "\x00".join(batch.keys).encode("utf-8")
    k, s, n = len(batch.keys), len(batch.sketch_rows), len(batch.sketch_codes)
    text = json.dumps(batch.top_text, ensure_ascii=False).encode("utf-8") \
        if batch.top_text else b""
    head = _HEADER.pack(batch.step, batch.rank, batch.world_size, batch.seq, batch.final,
                        batch.sketch_alpha, k, s, n, len(keys), len(batch.derived),
                        len(batch.extreme_rows), len(batch.top_rows), len(text))
    parts = [head, keys, batch.derived, text]
    for name, dtype, _, _ in _LAYOUT:
        column = getattr(batch, name)
        if len(column):  # most batches carry no sketch and no located extremes
            parts.append(np.ascontiguousarray(column, dtype=dtype).tobytes())
    return b"".join(parts)


def _check_header(blob: bytes, k: int, s: int, n: int, key_len: int, derived_len: int,
                  e: int, t: int, text_len: int, limits: Limits) -> None:
    """Refuse a batch by its header alone, before any per-key work or allocation."""
    if len(blob) > limits.max_batch_bytes:
        raise BatchRejected(f"batch is {len(blob)} bytes; the limit is {limits.max_batch_bytes}")
    if k > limits.max_keys_per_batch:
        raise BatchRejected(f"batch has {k} keys; the limit is {limits.max_keys_per_batch}")
    size = (_HEADER.size + key_len + derived_len + text_len + _FIXED + _PER_K * k
            + _PER_S * s + _PER_N * n + _PER_E * e + _PER_T * t)
    if size != len(blob):
        raise BatchRejected(
            f"malformed wire batch: its header describes {size} bytes, {len(blob)} came"
        )
    if k and key_len < 2 * k - 1 or key_len > k * 4 * limits.max_key_length + k:
        raise BatchRejected(f"malformed wire batch: {key_len} bytes cannot hold {k} keys")


# Key blocks decoded lately, and their tuples: ranks send the same keys every step, and one
# tuple object for them makes every later lookup by the keys (caches, layouts) cheaper
_KEY_TUPLES: Recent = Recent(256)
_KEY_BLOCK_CACHED = 1 << 16  # bytes: a larger key block is decoded every time


def decode(blob: bytes, limits: Limits | None = None) -> Batch:
    """Return the Batch a ``blob`` encodes; sizes are checked against ``limits`` first.

    Raises:
        BatchRejected: the bytes are not a well-formed encoded batch, or exceed a limit.
    """
    try:
        step, rank, world, seq, final, alpha, k, s, n, key_len, derived_len, e, t, text_len = \
            _HEADER.unpack_from(blob)
        _check_header(blob, k, s, n, key_len, derived_len, e, t, text_len, limits or Limits())
        pos = _HEADER.size
        # The keys (UTF-8, separated by NUL; ``k`` of them by the header, checked below):
        # ranks send the same ones every step, decoded once into one shared tuple
        raw = bytes(blob[pos : pos + key_len])
        keys = _KEY_TUPLES.get(raw) if k else ()
        if keys is None:
            keys = tuple(raw.decode("utf-8").split("\x00"))
            if len(raw) <= _KEY_BLOCK_CACHED:
                _KEY_TUPLES[raw] = keys
        pos += key_len
        derived = bytes(blob[pos : pos + derived_len])
        pos += derived_len
        text = json.loads(bytes(blob[pos : pos + text_len])) if text_len else []
        if not isinstance(text, list):
            raise ValueError("the top samples' payloads are not a list")
        pos += text_len
        columns = dict(EMPTY)  # a column the batch does not carry stays the shared empty
        for name, dtype, itemsize, (pk, ps, pn, pe, pt, fixed) in _LAYOUT:
            count = pk * k + ps * s + pn * n + pe * e + pt * t + fixed
            if count or name not in EMPTY:  # data, kinds and expected even for K = 0
                columns[name] = np.frombuffer(blob, dtype=dtype, count=count, offset=pos)
                pos += count * itemsize
    except BatchRejected:
        raise
    except (struct.error, ValueError, UnicodeDecodeError, RecursionError) as err:
        raise BatchRejected(f"malformed wire batch: {err}") from None
    if len(keys) != k or pos != len(blob):
        raise BatchRejected(f"malformed wire batch: {len(keys)} keys for {k}, "
                            f"{len(blob) - pos} stray bytes")
    columns["data"] = columns["data"].reshape(k, NFIELDS)
    if e:
        columns["extremes"] = columns["extremes"].reshape(e, NSOURCE)
    if t:
        columns["top"] = columns["top"].reshape(t, NTOP)
    return Batch(step=step, rank=rank, world_size=world, seq=seq, final=final, keys=keys,
                 sketch_alpha=alpha, derived=derived, top_text=tuple(text), **columns)



# Counts up to 2**53 are exact in float64; merged over any world size they stay finite,
# so turning them into ints when a step finishes cannot overflow.
MAX_COUNT = float(2**53)


def key_cache() -> Recent:
    """Key tuples already checked, each with its size in bytes and the layout (kind codes,
    expected contributors, world size) last accepted with it: ranks send the same keys and
    kinds each step, and checking 1000 names per batch would otherwise dominate the merge."""
    return Recent(64)


def receive(item: Batch | bytes, limits: Limits = LIMITS, cache: Recent | None = None) -> Batch:
    """The service's boundary: the Batch ``item`` is or encodes, every rule checked.

    Raises:
        BatchRejected: malformed, past a limit, or breaking a rule (named); nothing of it
            may be merged.
    """
    if isinstance(item, (bytes, bytearray, memoryview)):
        item = decode(item, limits)
    batch = check(item, limits, cache)
    if batch.derived:  # decoded once per distinct set (ranks send the same every step)
        try:
            declared, about = decode_declarations(batch.derived)
        except (TypeError, ValueError) as err:
            raise BatchRejected(f"step {batch.step} rank {batch.rank}: {err}") from None
        batch = replace(batch, declared=declared, about=about)
    return batch


def check(batch: object, limits: Limits = LIMITS, cache: Recent | None = None) -> Batch:
    """Return ``batch`` if it is a well-formed wire batch, else raise ``BatchRejected``
    (``cache``: a ``key_cache()``, kept across batches)."""
    if not isinstance(batch, Batch):
        raise BatchRejected(f"expected a metricsvc Batch, got {type(batch).__name__}")
    if not (batch.rank.__class__ is int and batch.world_size.__class__ is int
            and 0 <= batch.rank < batch.world_size):  # else check_rank says what is wrong
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
    if not isinstance(batch.top_text, tuple):
        raise BatchRejected(f"batch top sample payloads must be a tuple, got "
                            f"{type(batch.top_text).__name__}")
    known = cache.get(batch.keys) if cache is not None else None
    if known is None:
        _check_keys(batch.keys, limits)
        key_bytes = sum(len(key) for key in batch.keys)
        if cache is not None:
            known = cache[batch.keys] = [key_bytes, None]  # [bytes, layout accepted]
    else:
        key_bytes = known[0]
    _check_columns(batch, k)
    nbytes = key_bytes + batch.nbytes_without_keys
    if nbytes > limits.max_batch_bytes:
        raise BatchRejected(
            f"batch of rank {batch.rank} step {batch.step} is {nbytes} bytes; "
            f"the limit is {limits.max_batch_bytes}"
        )
    if known is None:
        _check_layout(batch)
    else:  # a key tuple's kinds and expected contributors recur every step: checked once
        layout = (batch.kinds.tobytes(), batch.expected.tobytes(), batch.world_size)
        if known[1] != layout:
            _check_layout(batch)
            known[1] = layout
    if not plainly_whole(batch.data):  # every row could merge and finalise without raising
        check_each_rule(batch)
    if batch.sketch_rows.size:
        _check_sketches(batch)
    if batch.extreme_rows.size:
        _check_sources(batch)
    if batch.top_rows.size or batch.top_text:
        _check_top(batch)
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
    """Every column its type and shape, the optional ones consistent with each other."""
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
    rows, offsets, codes = batch.sketch_rows, batch.sketch_offsets, batch.sketch_codes
    if not (isinstance(rows, np.ndarray) and rows.ndim == 1 and rows.dtype == np.int32
            and isinstance(offsets, np.ndarray) and offsets.shape == (len(rows) + 1,)
            and isinstance(codes, np.ndarray) and codes.dtype == np.int32
            and offsets[0] == 0 and offsets[-1] == len(codes)
            and (rows.size == 0 or bool(np.all(np.diff(offsets) >= 0)))  # one offset: sorted
            and isinstance(batch.sketch_counts, np.ndarray)
            and batch.sketch_counts.shape == codes.shape):
        raise BatchRejected("batch sketch columns are inconsistent (rows/offsets/codes/counts)")
    rows, src = batch.extreme_rows, batch.extremes
    if not (isinstance(rows, np.ndarray) and rows.ndim == 1 and rows.dtype == np.int32
            and isinstance(src, np.ndarray) and src.shape == (len(rows), NSOURCE)):
        raise BatchRejected("batch extreme columns are inconsistent (rows/sources)")
    rows, top = batch.top_rows, batch.top
    if not (isinstance(rows, np.ndarray) and rows.ndim == 1 and rows.dtype == np.int32
            and isinstance(top, np.ndarray) and top.shape == (len(rows), NTOP)
            and top.dtype == np.float64):
        raise BatchRejected("batch top columns are inconsistent (rows/samples)")


_VALID_CODE = np.zeros(256, dtype=bool)  # indexed by a kind code's byte
_VALID_CODE[[code & 0xFF for code in VALID_CODES]] = True
_WEIGHTED_CODE = np.zeros(256, dtype=bool)  # kinds whose counts may be fractional weights
_WEIGHTED_CODE[[int(k) for k, spec in KINDS.items() if spec.weighted]] = True
_EXTREMES_CODE = np.zeros(256, dtype=bool)  # kinds that export a min and a max
_EXTREMES_CODE[[int(k) & 0xFF for k, spec in KINDS.items() if spec.extremes]] = True
_SKETCH_CODE = np.zeros(256, dtype=bool)  # kinds that merge quantile sketches
_SKETCH_CODE[[int(k) for k, spec in KINDS.items() if spec.sketch]] = True


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


def check_each_rule(batch: Batch) -> None:
    """Refuse any row that could not be merged and finalised without raising, rule by rule
    (what a batch ``plainly_whole`` does not accept goes through).

    Sums may overflow (finite values past 1e308 add up to inf, or to NaN through
    inf - inf): that is float64 arithmetic, not corruption, and is flagged at the
    merge. Counts, extrema and squares cannot: a count is finite, >= 0 and at most
    2**53 (integral except for AVG, whose counts are ``weighted_mean`` weights), the
    non-finite count is such an integer too, a populated row has finite ``min <= max``,
    and an empty row is the identity record.
    """
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


def plainly_whole(data: np.ndarray) -> bool:
    """The common batch, checked in a few passes over the whole matrix: every count a whole
    number in [1, 2**53], every non-finite count one in [0, 2**53], finite ``min <= max``,
    ``m2_root`` at least 0 and no low part of a sum. False sends the batch through every
    rule of ``check_each_rule`` (a weighted count, an empty row, a low part, a NaN root, a
    fault), to pass or be refused naming its rule: this accepts nothing they refuse."""
    fields = data[:, _CHECKED]  # a view: every field but the sum, which may be anything
    # NaN fails every comparison (silently): such a batch goes through the full rules
    if not ((fields >= _LOW) & (fields <= _HIGH)).all():
        return False
    counts = data[:, _WHOLE_FIELDS]
    return bool((np.floor(counts) == counts).all() and (data[:, MIN] <= data[:, MAX]).all())


# What ``plainly_whole`` accepts, field by field from COUNT on (the sum is not checked)
_CHECKED = slice(COUNT, NFIELDS)
_BOUNDS = {COUNT: (1.0, MAX_COUNT), MIN: (-np.finfo(np.float64).max, np.finfo(np.float64).max),
           MAX: (-np.finfo(np.float64).max, np.finfo(np.float64).max), M2_ROOT: (0.0, np.inf),
           NONFINITE: (0.0, MAX_COUNT), SUM_LO: (0.0, 0.0)}
_LOW = np.array([_BOUNDS[f][0] for f in range(COUNT, NFIELDS)])
_HIGH = np.array([_BOUNDS[f][1] for f in range(COUNT, NFIELDS)])
_WHOLE_FIELDS = slice(COUNT, NONFINITE + 1, NONFINITE - COUNT)  # COUNT and NONFINITE


def _check_sources(batch: Batch) -> None:
    """Where a min, max and first non-finite value came from: distinct key rows; positions
    and call numbers whole numbers in [0, 2**53] (or NaN: unknown, all three together); ids
    finite or NaN; the non-finite value not finite."""
    rows, src = batch.extreme_rows, batch.extremes
    if rows.min() < 0 or rows.max() >= len(batch.keys) or len(np.unique(rows)) != len(rows):
        raise BatchRejected("batch extreme rows must name distinct keys of the batch")
    bad = np.isfinite(src[:, NF_VALUE])
    for _, first, _ in LOCATED.values():
        ident, where = src[:, first], src[:, first + 1: first + 4]
        bad |= ~(np.isnan(where).all(1) | _whole(where)) | np.isinf(ident)
    _refuse_first(bad, batch, rows,
                  lambda j: f"where its min, max and first non-finite value came from "
                            f"{src[j].tolist()} (call, row and column must be whole numbers "
                            f">= 0, or all NaN; an id finite or NaN; the value NaN or "
                            f"infinite)")


def _refuse_first(bad: np.ndarray, batch: Batch, rows: np.ndarray,
                  rule: Callable[[int], str]) -> None:
    """Refuse ``batch`` if any entry is ``bad``, naming the first one's key and the rule
    it breaks (``rule(j)``: what entry ``j`` holds and what it must be)."""
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise BatchRejected(f"key {batch.keys[int(rows[j])]!r}: {rule(j)}")


def _text_ok(entry: Any) -> bool:
    """Whether ``entry`` is a top sample's payload as a rank sends it (``Batch.top_text``)."""
    if entry is None:
        return True
    if not (isinstance(entry, list) and len(entry) == 2 and entry[1].__class__ is int
            and entry[1] >= 0):
        return False
    text = entry[0]
    fields = text.values() if isinstance(text, dict) else (text,)
    if not (len(fields) <= MAX_TEXT_FIELDS and all(f.__class__ is str for f in fields)
            and (not isinstance(text, dict)
                 or all(k.__class__ is str and len(k) <= 64 for k in text))):
        return False
    try:
        return sum(len(f.encode("utf-8")) for f in fields) <= MAX_TEXT_BYTES
    except UnicodeEncodeError:  # a lone surrogate: no text a sink could write
        return False


def _whole(where: np.ndarray) -> np.ndarray:
    """Per row: every position (call, row, column) a whole number in [0, 2**53]."""
    return ((where >= 0) & (where <= MAX_COUNT) & (np.floor(where) == where)).all(1)


def _check_top(batch: Batch) -> None:
    """The top samples: rows of keys whose kind exports a min and a max; a side 0 or 1; a
    finite value; call, row and column whole numbers in [0, 2**53]; an id finite or NaN;
    at most k (1 to ``MAX_TOP``) a key and side, each saying the same k; payloads, if any,
    one per sample (``_text_ok``)."""
    rows, top = batch.top_rows, batch.top
    if batch.top_text:
        if len(batch.top_text) != len(rows):
            raise BatchRejected(f"batch has {len(batch.top_text)} top sample payloads for "
                                f"{len(rows)} top samples (one each, or none)")
        _refuse_first(np.array([not _text_ok(t) for t in batch.top_text]), batch, rows,
                      lambda j: f"top sample payload {str(batch.top_text[j])[:80]!r}... (None, "
                                f"or [a string or a dict of at most {MAX_TEXT_FIELDS} strings "
                                f"by names of at most 64 characters, at most {MAX_TEXT_BYTES} "
                                f"UTF-8 bytes in all; the bytes cut off, a whole number >= 0])")
    if rows.min() < 0 or rows.max() >= len(batch.keys):
        raise BatchRejected("batch top rows must name keys of the batch")
    k = top[:, Top.K]
    ok = (_whole(top[:, [Top.CALL, Top.ROW, Top.COL]]) & np.isin(top[:, Top.SIDE], (0.0, 1.0))
          & np.isfinite(top[:, Top.VALUE]) & ~np.isinf(top[:, Top.ID]) & (k >= 1)
          & (k <= MAX_TOP) & (np.floor(k) == k))
    _refuse_first(~(ok & _EXTREMES_CODE[batch.kinds[rows].view(np.uint8)]), batch, rows,
                  lambda j: f"top sample {top[j].tolist()} (side 0 or 1, a finite value, "
                            f"call, row and column whole numbers >= 0, an id finite or NaN, k "
                            f"in [1, {MAX_TOP}], of a kind that exports a min and a max)")
    sides = rows.astype(np.int64) * 2 + top[:, Top.SIDE].astype(np.int64)
    order = np.argsort(sides, kind="stable")
    sides, k = sides[order], k[order]
    starts = np.flatnonzero(np.r_[True, sides[1:] != sides[:-1]])
    counts = np.diff(np.r_[starts, len(sides)])
    low, high = np.minimum.reduceat(k, starts), np.maximum.reduceat(k, starts)
    wrong = np.flatnonzero((counts > low) | (low != high))
    if wrong.size:
        at, count = starts[wrong[0]], counts[wrong[0]]
        raise BatchRejected(f"key {batch.keys[sides[at] // 2]!r}: {count} top samples on one "
                            f"side for k={k[at:at + count].tolist()} (at most k, one k a key)")


def _check_sketches(batch: Batch) -> None:
    """The quantile sketches of a batch that carries some: of distinct QUANTILES keys, with
    codes of the batch's accuracy and whole counts that sum to each key's count."""
    rows, offsets = batch.sketch_rows, batch.sketch_offsets
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
