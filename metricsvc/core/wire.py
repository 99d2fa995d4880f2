"""The wire form of a Batch: one flat bytes object (no pickle).

Ray serialises a dataclass holding several numpy arrays about a millisecond slower
per call than a plain bytes object of the same content (each array travels as its
own out-of-band buffer). One call per rank per step is the product's whole budget,
so batches travel encoded:

    header  <q step, i rank, i world_size, q seq, ? final, d sketch_alpha,
             I keys, I sketches, I buckets, I key bytes, I declaration bytes, I sources>
    keys    UTF-8, separated by NUL (a valid key never contains NUL)
    derived the derived-metric declarations, UTF-8 JSON (``metricsvc.core.declare``)
    columns data f64[K*6] · kinds i8[K] · expected i32[K] · sketch_rows i32[S]
            · sketch_offsets i64[S+1] · sketch_codes i32[N] · sketch_counts f64[N]
            · extreme_rows i32[E] · extremes f64[E*8] (where a min and max came from)
"""

from __future__ import annotations

import struct

import numpy as np

from metricsvc.core.batch import Batch
from metricsvc.core.errors import BatchRejected
from metricsvc.core.extremes import NSOURCE
from metricsvc.core.limits import Limits, remember
from metricsvc.core.records import NFIELDS

_HEADER = struct.Struct("<qiiq?dIIIIII")
_COLUMNS = (  # name, dtype, length as a function of (K, S, N, E)
    ("data", np.float64, lambda k, s, n, e: k * NFIELDS),
    ("kinds", np.int8, lambda k, s, n, e: k),
    ("expected", np.int32, lambda k, s, n, e: k),
    ("sketch_rows", np.int32, lambda k, s, n, e: s),
    ("sketch_offsets", np.int64, lambda k, s, n, e: s + 1),
    ("sketch_codes", np.int32, lambda k, s, n, e: n),
    ("sketch_counts", np.float64, lambda k, s, n, e: n),
    ("extreme_rows", np.int32, lambda k, s, n, e: e),
    ("extremes", np.float64, lambda k, s, n, e: e * NSOURCE),
)
# The same with each dtype's item size, worked out once (a batch is decoded per rank and step)
_LAYOUT = tuple((name, np.dtype(dtype), length, np.dtype(dtype).itemsize)
                for name, dtype, length in _COLUMNS)
_ALWAYS = ("data", "kinds", "expected")  # every batch has them (K may be 0)


def _column_bytes(k: int, s: int, n: int, e: int) -> int:
    return sum(length(k, s, n, e) * itemsize for _, _, length, itemsize in _LAYOUT)


# Every length is linear in (K, S, N, E): the columns' bytes are ``_FIXED + _PER_K * K +
# _PER_S * S + _PER_N * N + _PER_E * E``, worked out once here
_FIXED = _column_bytes(0, 0, 0, 0)
_PER_K, _PER_S, _PER_N, _PER_E = (_column_bytes(*unit) - _FIXED for unit in
                                  ((1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1)))
_F64, _I8, _I32, _I64 = (np.dtype(t) for t in (np.float64, np.int8, np.int32, np.int64))


def encode(batch: Batch) -> bytes:
    """Return ``batch`` as one bytes object."""
    keys = "\x00".join(batch.keys).encode("utf-8")
    k, s, n = len(batch.keys), len(batch.sketch_rows), len(batch.sketch_codes)
    head = _HEADER.pack(batch.step, batch.rank, batch.world_size, batch.seq, batch.final,
                        batch.sketch_alpha, k, s, n, len(keys), len(batch.derived),
                        len(batch.extreme_rows))
    parts = [head, keys, batch.derived]
    for name, dtype, _, _ in _LAYOUT:
        column = getattr(batch, name)
        if len(column):  # most batches carry no sketch and no located extremes
            parts.append(np.ascontiguousarray(column, dtype=dtype).tobytes())
    return b"".join(parts)


def _check_header(blob: bytes, k: int, s: int, n: int, key_len: int, derived_len: int,
                  e: int, limits: Limits) -> None:
    """Refuse a batch by its header alone, before any per-key work or allocation."""
    if len(blob) > limits.max_batch_bytes:
        raise BatchRejected(f"batch is {len(blob)} bytes; the limit is {limits.max_batch_bytes}")
    if k > limits.max_keys_per_batch:
        raise BatchRejected(f"batch has {k} keys; the limit is {limits.max_keys_per_batch}")
    size = (_HEADER.size + key_len + derived_len + _FIXED + _PER_K * k + _PER_S * s
            + _PER_N * n + _PER_E * e)
    if size != len(blob):
        raise BatchRejected(
            f"malformed wire batch: its header describes {size} bytes, {len(blob)} came"
        )
    if k and key_len < 2 * k - 1 or key_len > k * 4 * limits.max_key_length + k:
        raise BatchRejected(f"malformed wire batch: {key_len} bytes cannot hold {k} keys")


# Key blocks decoded lately, and their tuples: ranks send the same keys every step, and one
# tuple object for them makes every later lookup by the keys (caches, layouts) cheaper
_KEY_TUPLES: dict[bytes, tuple[str, ...]] = {}
_KEY_TUPLES_HELD = 256
_KEY_BLOCK_CACHED = 1 << 16  # bytes: a larger key block is decoded every time


def _keys(raw: bytes, k: int) -> tuple[str, ...]:
    """The keys a batch's key block holds (UTF-8, separated by NUL; ``k`` of them by the
    header, which the caller checks against what they are)."""
    if not k:
        return ()
    keys = _KEY_TUPLES.get(raw)
    if keys is None:
        keys = tuple(raw.decode("utf-8").split("\x00"))
        if len(raw) <= _KEY_BLOCK_CACHED:
            remember(_KEY_TUPLES, raw, keys, _KEY_TUPLES_HELD)
    return keys


def decode(blob: bytes, limits: Limits | None = None) -> Batch:
    """Return the Batch a ``blob`` encodes; sizes are checked against ``limits`` first.

    Raises:
        BatchRejected: the bytes are not a well-formed encoded batch, or exceed a limit.
    """
    try:
        step, rank, world, seq, final, alpha, k, s, n, key_len, derived_len, e = \
            _HEADER.unpack_from(blob)
        _check_header(blob, k, s, n, key_len, derived_len, e, limits or Limits())
        pos = _HEADER.size
        keys = _keys(bytes(blob[pos : pos + key_len]), k)
        pos += key_len
        derived = bytes(blob[pos : pos + derived_len])
        pos += derived_len
        # A column a batch does not carry keeps Batch's shared empty default
        if not (s or n or e):  # the common batch: records only (no sketch, no sources)
            kinds_at = pos + _F64.itemsize * NFIELDS * k  # the columns in _COLUMNS' order
            expected_at = kinds_at + _I8.itemsize * k
            columns = {
                "data": np.frombuffer(blob, _F64, k * NFIELDS, pos),
                "kinds": np.frombuffer(blob, _I8, k, kinds_at),
                "expected": np.frombuffer(blob, _I32, k, expected_at),
                "sketch_offsets": np.frombuffer(blob, _I64, 1, expected_at + _I32.itemsize * k)}
            pos += _FIXED + _PER_K * k
        else:
            columns = {}
            for name, dtype, length, itemsize in _LAYOUT:
                count = length(k, s, n, e)
                if count or name in _ALWAYS:
                    columns[name] = np.frombuffer(blob, dtype=dtype, count=count, offset=pos)
                    pos += count * itemsize
    except BatchRejected:
        raise
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        raise BatchRejected(f"malformed wire batch: {err}") from None
    if len(keys) != k or pos != len(blob):
        raise BatchRejected(f"malformed wire batch: {len(keys)} keys for {k}, "
                            f"{len(blob) - pos} stray bytes")
    columns["data"] = columns["data"].reshape(k, NFIELDS)
    if e:
        columns["extremes"] = columns["extremes"].reshape(e, NSOURCE)
    return Batch(step=step, rank=rank, world_size=world, seq=seq, final=final, keys=keys,
                 sketch_alpha=alpha, derived=derived, **columns)


def as_batch(item: Batch | bytes, limits: Limits | None = None) -> Batch:
    """Accept a Batch or its encoded bytes (what clients send)."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return decode(item, limits)
    return item
