"""Masked tensors and arrays -> summary records, on the value's own device, without syncing.

``summarize`` is pure: it returns a float64 record row (``records.FIELDS``: the
double-double sum, count, min, max, the root of M2 and the non-finite count) — a numpy
array for host data, a torch tensor on the value's device for torch input. ``sketch``
returns the quantile-bucket counts (sparse on the host, dense on a device). Nothing here
copies device data to the host; the client stacks every row and sketch of a flush and
copies them once per device (``to_host``).

On the CPU the valid positions of a mask are found once (per step, when the
caller passes a ``MaskCache``: every value recorded under that mask shares them);
each distinct tensor of a call is gathered once (never larger than itself). Small
values are summarised together, stacked, one numpy pass per statistic; a large one
is widened to float64 in cache-sized chunks, each chunk centred on a pivot (the first
chunk's mean) and its deviations summed and squared while it is in cache (so the second
moment never cancels), then min/max; the passes that exclude NaN/inf run only when its
sum shows some.
Reading a CPU value is not a device sync. A ``Difference(a, b)`` is summarised
over the valid positions only, in float64. On an accelerator nothing may wait for
the device, so small tensors take vectorised whole-tensor ops (no ``where``, no
``nonzero``) and large ones one fused kernel (``torch.compile`` with dynamic
shapes, so batch shapes never recompile), with the eager path as fallback.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from metricsvc.protocol import (
    COUNT,
    FIELDS,
    IDENTITY,
    M2_ROOT,
    MAX,
    MIN,
    NFIELDS,
    NONFINITE,
    SCALARS,
    SUM,
    SUM_LO,
    SketchSpec,
    centred_exactly,
    from_pivot,
    merge,
    merge_pair,
    merge_sparse,
    rss,
    scalar_row,
    scalar_rows,
    sparse_counts,
    summarize_array,
)

log = logging.getLogger(__name__)

Row = Any  # np.ndarray on the host, torch.Tensor on a device

COMPILE_MIN_NUMEL = 1 << 16  # below this, kernel launch and guard checks cost more than they save
_INF = float("inf")


def _torch() -> Any:
    # Only a program that made a torch tensor can pass one; never import torch ourselves.
    return sys.modules.get("torch")


def is_tensor(value: object) -> bool:
    """Return True for a torch tensor (without importing torch)."""
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


_accelerator_path_on_cpu = 0


@contextlib.contextmanager
def accelerator_path_on_cpu() -> Iterator[None]:
    """Summarise CPU tensors with the accelerator path (sync-free, whole-tensor ops) inside
    the block: how a machine without an accelerator tests that path and counts its host
    reads (there must be none). Outside it, CPU tensors take the host path, which reads
    values freely: on the CPU that is not a device sync."""
    global _accelerator_path_on_cpu
    _accelerator_path_on_cpu += 1
    try:
        yield
    finally:
        _accelerator_path_on_cpu -= 1


def _on_host(x: Any, compile: bool | None) -> bool:
    # compile=True asks for the fused kernel, wherever the tensor is.
    return x.device.type == "cpu" and not _accelerator_path_on_cpu and compile is not True


def compile_default() -> bool:
    """Return whether large device tensors use the compiled kernel (METRICSVC_COMPILE=0: no)."""
    return os.environ.get("METRICSVC_COMPILE", "1") not in ("0", "false", "False", "")


# -- validation ----------------------------------------------------------------------------
def _check_mask(key: str, mask_shape: Any, is_bool: bool, shape: Any, dtype: Any) -> None:
    if not is_bool:
        raise TypeError(f"mask for key {key!r} must be bool, got dtype {dtype}")
    if tuple(mask_shape) != tuple(shape):
        raise ValueError(
            f"expected mask of shape {tuple(shape)} for key {key!r}, got {tuple(mask_shape)}"
        )


@functools.cache
def _real_dtypes(torch: Any) -> frozenset:
    return frozenset(
        {
            torch.float16, torch.bfloat16, torch.float32, torch.float64,
            torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
        }
    )


def prepare(values: Any, mask: Any = None, *, key: str = "value") -> tuple[Any, Any]:
    """Return ``(values, mask)`` checked and on one side: tensors on one device, or numpy.

    Raises:
        TypeError: non-numeric values, or a mask that is not bool.
        ValueError: the mask's shape differs from the values'.
    """
    if is_tensor(values):
        torch = _torch()
        if values.dtype not in _real_dtypes(torch):
            raise TypeError(
                f"value for key {key!r} must be a real tensor, got dtype {values.dtype}"
            )
        if mask is not None:
            if not is_tensor(mask):
                mask = torch.as_tensor(np.asarray(mask), device=values.device)  # host -> device
            _check_mask(key, mask.shape, mask.dtype == torch.bool, values.shape, mask.dtype)
            if mask.device != values.device:
                mask = mask.to(values.device)
            mask = mask.detach()
        return values.detach(), mask
    if mask is None and isinstance(values, numbers.Number):
        if not isinstance(values, numbers.Real):
            raise TypeError(f"value for key {key!r} must be a real number, got {values!r}")
        return values, None
    if isinstance(values, (str, bytes, dict)):
        raise TypeError(
            f"value for key {key!r} must be a number, tensor or array, "
            f"got {type(values).__name__}"
        )
    try:
        arr = np.asarray(values)
    except Exception as err:  # ragged lists and the like
        raise TypeError(f"value for key {key!r} is not an array of numbers: {err}") from None
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"value for key {key!r} must be numeric, got dtype {arr.dtype}")
    if mask is not None:
        mask = mask.numpy(force=True) if is_tensor(mask) else np.asarray(mask)
        _check_mask(key, mask.shape, mask.dtype == np.bool_, arr.shape, mask.dtype)
    return arr, mask


# -- summaries -----------------------------------------------------------------------------
def summarize(
    values: Any, mask: Any = None, *, key: str = "value", compile: bool | None = None
) -> Row:
    """Return the summary row of ``values`` over the positions where ``mask`` is True.

    NaN/+-inf in valid positions are counted in ``nonfinite`` and excluded from
    the other fields; masked-out positions never matter, whatever they hold.
    """
    return summarize_many({key: values}, mask, compile=compile)[key]


class Difference:
    """``a - b`` for a summary, computed where it is summarised: on the CPU over the valid
    positions only, in float64 (exact for float32 and smaller inputs), sharing the gathers
    of ``a`` and ``b`` with the other values of the call; on an accelerator as a float64
    tensor. Pass it as a value: ``stat(mask=m, **{"residual": Difference(returns, values)})``.
    """

    __slots__ = ("a", "b")

    def __init__(self, a: Any, b: Any) -> None:
        if not (is_tensor(a) and is_tensor(b)):
            raise TypeError("Difference takes two tensors")
        if a.shape != b.shape:
            raise ValueError(f"Difference of tensors of shapes {tuple(a.shape)} and "
                             f"{tuple(b.shape)}")
        self.a, self.b = a, b

    def tensor(self) -> Any:
        """The difference as one float64 tensor (the accelerator path)."""
        torch = _torch()
        return self.a.detach().to(torch.float64) - self.b.detach()


class MaskCache:
    """The valid positions of the masks a client used this step, found once per mask, and
    the scratch buffers of the CPU summaries, kept across steps (fresh multi-MB buffers
    every step cost more in page faults than the arithmetic).

    A mask entry holds its mask (so its memory cannot be reused by another mask meanwhile)
    and the mask's version counter (so an in-place change is noticed). ``clear`` it when
    the step is closed; the buffers stay.
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: list[tuple[Any, int, Any]] = []
        self._buffers: dict[tuple[Any, str], Any] = {}

    def index(self, mask: Any) -> Any:
        """Return the flat indices (an int64 CPU tensor) where ``mask`` (a CPU bool tensor)
        is True."""
        for held, version, index in self._entries:
            if (held.data_ptr() == mask.data_ptr() and held.shape == mask.shape
                    and held.stride() == mask.stride() and mask._version == version):
                return index
        # numpy finds the positions several times faster than torch's nonzero on the CPU.
        index = _torch().from_numpy(np.flatnonzero(mask.numpy()))
        self._entries = [(mask, mask._version, index), *self._entries][: self.size]
        return index

    def buffer(self, dtype: Any, role: str, n: int) -> Any:
        """Return a 1-D CPU scratch tensor of ``n`` elements of ``dtype`` for ``role``."""
        buf = self._buffers.get((dtype, role))
        if buf is None or buf.numel() < n:
            buf = self._buffers[(dtype, role)] = _torch().empty(n, dtype=dtype)
        return buf[:n]

    def clear(self) -> None:
        self._entries = []


def summarize_many(
    values: Mapping[str, Any], mask: Any = None, *, compile: bool | None = None,
    cache: MaskCache | None = None,
) -> dict[str, Row]:
    """Return ``{key: row}`` for values sharing one mask; the mask is prepared once
    (once per step with a ``cache``). A value may be a ``Difference`` of two tensors.

    Every value is checked before any is summarised, so a bad one raises
    (naming its key) before work is done.
    """
    plain: dict[str, Any] = {}
    rest = values
    if mask is None:  # plain floats and ints (timings, counters) need no checks
        plain = {key: v for key, v in values.items() if type(v) in _PLAIN}
        if plain:
            rest = {key: v for key, v in values.items() if key not in plain}
    prepared = {key: _prepare_value(v, mask, key) for key, v in rest.items()}
    out: dict[str, Row] = {}
    host: dict[str, Any] = {}  # CPU tensors and differences: summarised together
    packs: dict[Any, Any] = {}
    for key, (v, m) in prepared.items():
        if isinstance(v, Difference):
            if _on_host(v.a, compile):
                host[key] = v
                continue
            v = v.tensor()
        if not is_tensor(v):
            if isinstance(v, numbers.Number):
                plain[key] = v
            else:
                out[key] = summarize_array(v, m)
            continue
        if _on_host(v, compile):
            host[key] = v
            continue
        torch = _torch()
        x = v.reshape(-1)
        if x.numel() == 0:
            out[key] = _identity_row(x.device)
            continue
        if not x.is_floating_point():
            x = x.to(torch.float64)  # ints and bools: exact in float64, never in float32
        flat_mask = None if m is None else m.reshape(-1)
        with torch.no_grad():
            if _use_compiled(x, compile):
                out[key] = _run_compiled(x, flat_mask)
            else:
                # Values of one call may differ in shape (without a mask) and in dtype:
                # a pack is shared only by values it fits.
                where = (x.dtype, x.device, x.numel())
                pack = packs.get(where)
                if pack is None:
                    pack = packs[where] = _MaskPack(flat_mask, x)
                out[key] = pack.row(x)
    if plain:
        out.update(_plain_rows(plain))
    if host:
        host_mask = prepared[next(iter(host))][1]
        out.update(_HostPass(host_mask, cache or MaskCache()).rows(host))
    return {key: out[key] for key in values}  # the caller's order


_PLAIN = frozenset({float, int, bool})


def _plain_rows(plain: Mapping[str, Any]) -> dict[str, Any]:
    """Rows of plain numbers: a few one by one, more in one vectorised pass."""
    try:
        floats = [float(v) for v in plain.values()]
    except OverflowError:  # an int past float64: name it
        return {key: _plain_number_row(key, v) for key, v in plain.items()}
    if len(floats) <= 8:
        return {key: scalar_row(x) for key, x in zip(plain, floats)}
    return dict(zip(plain, scalar_rows(np.array(floats, dtype=np.float64))))


def _prepare_value(v: Any, mask: Any, key: str) -> tuple[Any, Any]:
    if isinstance(v, Difference):
        a, m = prepare(v.a, mask, key=key)
        b, _ = prepare(v.b, mask, key=key)
        if b.device != a.device:
            raise ValueError(f"value for key {key!r}: Difference of tensors on "
                             f"{a.device} and {b.device}")
        return Difference(a, b), m
    return prepare(v, mask, key=key)


def _plain_number_row(key: str, value: Any) -> Any:
    try:
        return scalar_row(float(value))
    except OverflowError:
        raise ValueError(f"value for key {key!r} does not fit in a float64: {value}") from None


class _MaskPack:
    """Mask-derived tensors and scratch space shared by every value under one mask.

    The scratch buffers matter on the CPU: fresh multi-MB temporaries per metric
    cost page faults that dwarf the arithmetic.
    """

    def __init__(self, mask: Any, like: Any) -> None:
        torch = _torch()
        self.scratch = torch.empty_like(like)
        self.scratch64 = torch.empty(like.shape, dtype=torch.float64, device=like.device)
        if mask is None:
            self.weight = None
            self.to_pos = self.to_neg = None
            self.count = torch.tensor(float(like.numel()), dtype=torch.float64, device=like.device)
        else:
            self.weight = mask.to(like.dtype)  # 1.0 valid, 0.0 masked out
            self.to_pos = torch.zeros_like(like).masked_fill_(~mask, _INF)
            self.to_neg = -self.to_pos
            self.count = mask.sum(dtype=torch.float64)


    def row(self, x: Any) -> Any:
        return _eager_row(x, self)


_SAFE_SQUARES = (1e-280, 1e280)  # sums of squares that neither underflowed nor overflowed
_CHUNK = 1 << 16  # float64 accumulation in pieces of 512 KiB: no whole-tensor float64 copy
_SMALL = 4096  # below this, numpy's per-call cost (~1 us) beats torch's (~5 us)
_TINY = 256  # at most this, plain Python beats numpy's calls


@functools.cache
def _numpy_dtypes(torch: Any) -> frozenset:
    """The torch dtypes ``Tensor.numpy()`` can view (numpy has no bfloat16)."""
    return frozenset({torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
                      torch.int16, torch.int32, torch.int64, torch.bool})


def _memory(x: Any) -> tuple:
    """What identifies a tensor's values within a call: every value arrives as a fresh
    detached view, so the memory it views, not its id."""
    return (x.data_ptr(), x.dtype, tuple(x.shape), x.stride())


def _identity_row(device: Any = "cpu") -> Any:
    return _torch().tensor(IDENTITY, dtype=_torch().float64, device=device)


def _row_of(device: Any = None, **fields: Any) -> Any:
    """Stack named fields (tensors or floats) into one record row, in ``FIELDS`` order."""
    torch = _torch()
    cols = [fields[name] for name in FIELDS]
    if device is None:
        return torch.from_numpy(np.array([float(c) for c in cols], dtype=np.float64))
    return torch.stack([c.to(torch.float64) if is_tensor(c)
                        else torch.tensor(float(c), dtype=torch.float64, device=device)
                        for c in cols])


class _HostPass:
    """CPU summaries of the values of one call under one mask.

    The mask's valid positions are found once per step (``MaskCache``); each distinct
    tensor is gathered once per call (a tensor passed under two keys, or inside a
    ``Difference``, is read once) into a scratch buffer no larger than itself, shared
    by the values of the call one at a time (kept only for a ``Difference``). Small values (a
    value per sequence, say) are then summarised together, one numpy pass per statistic
    over all of them stacked; a large one takes four passes of its own: the float64 sum
    and sum of squares (widened in cache-sized chunks, never a whole float64 copy), and
    min/max together. Non-finite values are rare: their presence shows in the float64
    sum (NaN and inf propagate through it), and only then does a row take the slower
    passes that count and exclude them. Reading the CPU is not a device sync.
    """

    def __init__(self, mask: Any, cache: MaskCache) -> None:
        self.cache = cache
        self.index = None if mask is None else cache.index(mask)
        self._kept: dict[tuple, tuple[Any, Any]] = {}  # memory -> (tensor, its valid values)

    def rows(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Return ``{key: row}`` for CPU tensors and differences of CPU tensors."""
        # What a Difference reads stays gathered for the call; every other large value
        # is gathered into one shared buffer and summarised before the next is gathered.
        keep = {_memory(t) for v in values.values() if isinstance(v, Difference)
                for t in (v.a, v.b)}
        out: dict[str, Any] = {}
        small: dict[int, dict[str, Any]] = {}  # length -> {key: numpy array}
        done: dict[tuple, Any] = {}  # memory -> row: the same tensor under two keys
        same: dict[str, str] = {}  # key -> the key whose row it repeats
        for key, v in values.items():
            if isinstance(v, Difference):
                g = self._difference(v)  # a shared buffer: summarised before the next one
                if 0 < g.numel() <= _TINY:
                    out[key] = self._tiny_row(g)
                elif 0 < g.numel() < _SMALL:
                    small.setdefault(g.numel(), {})[key] = g.numpy().copy()
                else:
                    out[key] = self._row(g) if g.numel() else _identity_row()
                continue
            where = _memory(v)
            if where in done:
                same[key] = done[where]
                continue
            done[where] = key
            g = self._gather(v, where, where in keep)
            n = g.numel()
            if n == 0:
                out[key] = _identity_row()
            elif n <= _TINY:
                out[key] = self._tiny_row(g)
            elif n < _SMALL and g.dtype in _numpy_dtypes(_torch()):
                small.setdefault(n, {})[key] = g.numpy()
            else:
                out[key] = self._row(g)
        for group in small.values():
            out.update(self._small_rows(group))
        for key, first in same.items():
            out[key] = out[first].clone()
        return out

    def _gather(self, x: Any, where: tuple, keep: bool) -> Any:
        """The valid values of ``x``, flat: a view when all are valid; fresh when few
        (under ``_SMALL``); else in the shared scratch buffer, or a kept one."""
        held = self._kept.get(where)
        if held is not None:
            return held[1]
        torch = _torch()
        flat = x.reshape(-1)
        if self.index is not None and self.index.numel() != flat.numel():
            n = self.index.numel()
            if n < _SMALL:
                flat = (torch.from_numpy(flat.numpy()[self.index.numpy()])
                        if flat.dtype in _numpy_dtypes(torch)
                        else torch.index_select(flat, 0, self.index))
            else:
                slot = f"kept{len(self._kept)}" if keep else "gathered"
                flat = torch.index_select(flat, 0, self.index,
                                          out=self.cache.buffer(flat.dtype, slot, n))
        if keep:
            self._kept[where] = (x, flat)  # x is held: its memory cannot be reused meanwhile
        return flat

    def _difference(self, d: Difference) -> Any:
        """``a - b`` over the valid positions only, in float64: exact for float32 and
        smaller inputs, and no larger than the two inputs together."""
        ga = self._gather(d.a, _memory(d.a), True)
        gb = self._gather(d.b, _memory(d.b), True)
        res = self.cache.buffer(_torch().float64, "difference", ga.numel())
        return res.copy_(ga).sub_(gb)

    def _tiny_row(self, v: Any) -> Any:
        """The row of a few values in plain Python floats (float64; ints exact): a numpy or
        torch call costs more than the arithmetic here."""
        values = [float(x) for x in v.tolist()]
        n = len(values)
        plain = sum(values)
        c = plain / n
        dev = [x - c for x in values]
        q = math.hypot(*dev)  # no overflow or underflow of the squares
        if math.isfinite(c) and math.isfinite(q):
            low, high = min(values), max(values)
            total, low_part, root = from_pivot(float(n), c, sum(dev), q, SCALARS, plain,
                                               centred_exactly(low, high, c))
            return _row_of(sum=total, count=n, min=low, max=high, m2_root=root,
                           nonfinite=0.0, sum_lo=low_part)
        return self._row_nonfinite(v)

    def _small_rows(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """Rows of same-length numpy values, stacked: one pass per statistic for all."""
        torch = _torch()
        arrays = list(group.values())
        stacked = (np.stack(arrays) if len(arrays) > 1 else arrays[0][None]).astype(
            np.float64, copy=False)  # exact widening of small values
        rows = np.zeros((len(arrays), NFIELDS))
        # Checked first, so the sums below can neither overflow nor meet inf - inf (numpy
        # would warn, and its errstate costs more than these passes).
        if np.isfinite(stacked).all():
            np.minimum.reduce(stacked, axis=1, out=rows[:, MIN])
            np.maximum.reduce(stacked, axis=1, out=rows[:, MAX])
            if max(-rows[:, MIN].min(), rows[:, MAX].max()) < 1e150:
                n = float(stacked.shape[1])
                plain = stacked.sum(axis=1)
                pivot = plain / n
                dev = stacked - pivot[:, None]
                squares = np.einsum("ij,ij->i", dev, dev)
                q = np.sqrt(squares)
                for i in np.flatnonzero(squares < 1e-280):  # would square to nothing: scaled
                    q[i] = rss(dev[i])
                rows[:, COUNT] = n
                rows[:, SUM], rows[:, SUM_LO], rows[:, M2_ROOT] = from_pivot(
                    n, pivot, dev.sum(axis=1), q, np, plain,
                    centred_exactly(rows[:, MIN], rows[:, MAX], pivot))
                return dict(zip(group, torch.from_numpy(rows).unbind(0)))
        return {key: self._row_nonfinite(torch.from_numpy(stacked[i]))
                for i, key in enumerate(group)}

    def _row(self, v: Any, clean: bool = False) -> Any:
        """The summary row of flat ``v`` (every position valid, not empty; ``clean``: every
        value finite, so a non-finite sum is an overflow to report, not values to drop).

        A pass in cache-sized float64 chunks sums the values and their squares. Where the
        values sit near 0 next to their spread (``sum(x**2) <= 100 M2``, as most training
        tensors do), ``M2 = sum(x**2) - sum(x)**2 / n`` loses under 100 eps: that is the
        row. Otherwise (a large offset: timestamps, byte counts) a second pass centres each
        chunk on the mean and sums the deviations and their squares: the mean becomes a
        double-double and M2 loses nothing to cancellation.
        """
        torch = _torch()
        n = v.numel()
        if not v.is_floating_point():
            v = v.to(torch.float64)  # ints and bools: exact in float64
        total, squares = self._sums(v, 0.0)
        if not (math.isfinite(total) and math.isfinite(squares)):
            if not clean:
                return self._row_nonfinite(v)
            return torch.from_numpy(summarize_array(v.numpy()))  # finite, but past 1e308
        low, high = (t.item() for t in torch.aminmax(v))
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
        return _row_of(sum=total, count=n, min=low, max=high, m2_root=root,
                       nonfinite=0.0, sum_lo=total_lo)

    def _sums(self, v: Any, pivot: float) -> tuple[float, float]:
        """``(sum(v - pivot), sum((v - pivot)**2))`` in float64, widened and centred a
        cache-sized chunk at a time (never a whole float64 copy)."""
        torch = _torch()
        n = v.numel()
        wide = self.cache.buffer(torch.float64, "wide", min(n, _CHUNK))
        total = squares = 0.0
        for start in range(0, n, _CHUNK):
            piece = v[start:start + _CHUNK]
            t = wide[: piece.numel()].copy_(piece)  # exact widening
            if pivot:
                np.subtract(t.numpy(), pivot, out=t.numpy())  # in cache: cheap
            total += t.sum().item()
            squares += torch.dot(t, t).item()
        return total, squares

    def _row_nonfinite(self, v: Any) -> Any:
        """The row of ``v`` when something in it is not finite (or its sum overflows)."""
        torch = _torch()
        if not v.is_floating_point():
            v = v.to(torch.float64)
        good = v[torch.isfinite(v)]  # the rare path: a copy of the finite values is fine
        row = self._row(good, clean=True) if good.numel() else _identity_row()
        row[NONFINITE] = float(v.numel() - good.numel())
        return row

def _eager_row(x: Any, p: _MaskPack) -> Any:
    """Summary row from vectorised whole-tensor ops only: no where, no masked_select, no sync.

    Finite-ness comes from ``x - x`` (0, or NaN for NaN/inf); ``nan_to_num``
    turns excluded positions into values that cannot win a sum, min or max. The
    deviations from the pivot (the mean, a device scalar) count at valid positions only.
    """
    torch = _torch()
    s = p.scratch
    torch.sub(x, x, out=s)
    torch.nan_to_num_(s, nan=1.0)  # 1 where x is NaN/inf, else 0
    if p.weight is not None:
        s.mul_(p.weight)
    nonfinite = s.sum(dtype=torch.float64)
    count = p.count - nonfinite
    if p.weight is None:
        s.copy_(x)
    else:
        torch.mul(x, p.weight, out=s)
    torch.nan_to_num_(s, nan=0.0, posinf=0.0, neginf=0.0)
    z = p.scratch64.copy_(s)  # exact widening
    plain = z.sum()
    pivot = plain / count.clamp(min=1.0)
    valid = torch.sub(x, x, out=s).eq_(0)  # 1 where finite (NaN != 0)
    if p.weight is not None:
        valid.mul_(p.weight)
    z.sub_(pivot).mul_(valid)
    d1 = z.sum()
    q = _norm(z, in_place=True)
    torch.add(x, p.to_pos, out=s) if p.to_pos is not None else s.copy_(x)
    low = torch.nan_to_num_(s, nan=_INF, posinf=_INF, neginf=_INF).amin().to(torch.float64)
    torch.add(x, p.to_neg, out=s) if p.to_neg is not None else s.copy_(x)
    high = torch.nan_to_num_(s, nan=-_INF, posinf=-_INF, neginf=-_INF).amax().to(torch.float64)
    total, low_part, root = from_pivot(count, pivot, d1, q, torch, plain,
                                       centred_exactly(low, high, pivot))
    return _row_of(x.device, sum=total, count=count, min=low, max=high, m2_root=root,
                   nonfinite=nonfinite, sum_lo=low_part)


def _norm(dev: Any, in_place: bool = False) -> Any:
    """``sqrt(sum(dev**2))`` of a float64 tensor, squared at a power-of-2 scale of its
    largest element (exact): no overflow past 1e154, no underflow below 1e-154, no sync.
    ``in_place`` scales ``dev`` itself (a scratch buffer) instead of a copy."""
    torch = _torch()
    top = dev.abs().amax()
    # 2**-exponent of the largest, in two halves: 2**1074 (a subnormal's) is past float64.
    half = torch.where(top > 0, -torch.frexp(top)[1], 0).to(torch.float64) / 2
    up, down = torch.exp2(torch.floor(half)), torch.exp2(torch.ceil(half))
    scaled = dev.mul_(up).mul_(down) if in_place else dev * up * down
    return torch.linalg.vector_norm(scaled) / up / down


def _use_compiled(x: Any, compile: bool | None) -> bool:
    if x.numel() < COMPILE_MIN_NUMEL or _compile_failed:
        return False
    if compile is not None:
        return compile
    # One fused kernel pays on accelerators (one launch instead of ~15); on the CPU the
    # vectorised eager ops above measured faster (benchmarks/bench_summarize.py).
    return compile_default() and x.device.type != "cpu"


def _kernel(x: Any, m: Any) -> Any:
    """Fused summary of a flat tensor: selections in its dtype, sums in float64."""
    torch = _torch()
    finite = torch.isfinite(x)
    use = finite if m is None else m & finite
    bad = ~finite if m is None else m & ~finite
    z = torch.where(use, x, 0).to(torch.float64)  # exact: selection, then widening
    count = use.sum(dtype=torch.float64)
    plain = z.sum()
    pivot = plain / count.clamp(min=1.0)
    dev = torch.where(use, z - pivot, 0.0)
    low = torch.where(use, x, _INF).amin().to(torch.float64)
    high = torch.where(use, x, -_INF).amax().to(torch.float64)
    total, low_part, root = from_pivot(count, pivot, dev.sum(), _norm(dev), torch, plain,
                                       centred_exactly(low, high, pivot))
    cols = [total] * NFIELDS
    cols[COUNT], cols[M2_ROOT], cols[SUM_LO] = count, root, low_part
    cols[MIN], cols[MAX] = low, high
    cols[NONFINITE] = bad.sum(dtype=torch.float64)
    return torch.stack(cols)


_compile_failed = False


_compiled: Any = None
_compile_failed = False


def _run_compiled(x: Any, m: Any) -> Any:
    global _compiled, _compile_failed
    try:
        if _compiled is None:
            _compiled = _torch().compile(_kernel, dynamic=True, fullgraph=True)
        return _compiled(x, m)
    except Exception as err:  # no compiler, unsupported backend: eager is always right
        _compile_failed = True
        log.warning("torch.compile of the summary kernel failed, using eager: %s", err)
        return _kernel(x, m)


def element_rows(values: Any, *, key: str = "value") -> list[Row]:
    """Return one summary row per element of a 1-D tensor/array (views of one [K, F] tensor)."""
    values, _ = prepare(values, None, key=key)
    if not is_tensor(values):
        return [scalar_row(float(v)) for v in np.asarray(values, dtype=np.float64).ravel()]
    torch = _torch()
    with torch.no_grad():
        v = values.reshape(-1).to(torch.float64)
        finite = torch.isfinite(v)
        zero = torch.zeros_like(v)
        cols = [zero] * NFIELDS
        cols[SUM] = torch.where(finite, v, 0.0)
        cols[COUNT] = finite.double()
        cols[MIN] = torch.where(finite, v, _INF)
        cols[MAX] = torch.where(finite, v, -_INF)
        cols[NONFINITE] = (~finite).double()
        rows = torch.stack(cols, dim=1)
    return list(rows.unbind(0))


def merge_rows(a: Row, b: Row) -> Row:
    """Merge two rows, staying on the device if either is a tensor (no host copy)."""
    a_t, b_t = is_tensor(a), is_tensor(b)
    if not (a_t or b_t):
        return merge(a, b)
    torch = _torch()
    device = a.device if a_t else b.device
    if not a_t:
        a = torch.as_tensor(a, device=device)
    if not b_t:
        b = torch.as_tensor(b, device=device)
    elif b.device != device:
        b = b.to(device)  # device -> device, no host round trip
    return merge_pair(a, b, torch)


def add_sketches(a: Any, b: Any) -> Any:
    """Add two sketches: sparse ``(codes, counts)`` pairs (host data) merge on the host, dense
    device tensors add on the device, and a sparse one meeting a dense one is scattered
    into it on that device (a host -> device copy; nothing waits for the device)."""
    if not is_tensor(a) and not is_tensor(b):
        return merge_sparse([a, b])
    if not is_tensor(a):
        a, b = b, a
    torch = _torch()
    if not is_tensor(b):
        codes, counts = b
        slots = torch.as_tensor(np.asarray(codes, dtype=np.int64) + _top(a), device=a.device)
        return a.index_add(0, slots, torch.as_tensor(counts, device=a.device))
    return a + (b if b.device == a.device else b.to(a.device))


def _top(dense: Any) -> int:
    return (dense.numel() - 1) // 2


# -- quantile sketches ---------------------------------------------------------------------
def sketch(values: Any, mask: Any, spec: SketchSpec, *, key: str = "value") -> Any:
    """Return the bucket counts of the valid, finite values: sparse ``(codes, counts)`` for
    host data, a dense tensor of ``spec.size`` counts on the value's device otherwise."""
    values, mask = prepare(values, mask, key=key)
    if not is_tensor(values) or _on_host(values, None):
        if is_tensor(values):
            values = values.detach().to("cpu", _torch().float64).numpy()
            mask = None if mask is None else mask.numpy()
        v = np.atleast_1d(np.asarray(values, dtype=np.float64)).ravel()
        use = np.isfinite(v) if mask is None else np.asarray(mask).ravel() & np.isfinite(v)
        return sparse_counts(v[use], spec)
    torch = _torch()
    with torch.no_grad():
        x = values.reshape(-1).to(torch.float64)
        use = torch.isfinite(x)
        if mask is not None:
            use = use & mask.reshape(-1)
        x = torch.where(use, x, 0.0)  # excluded positions land in the zero slot with weight 0
        mag = x.abs()
        bounds = _device_bounds(spec, x.device)
        # bounds[b-1] <= v < bounds[b] for a positive v, bounds[b-1] < v <= bounds[b] for -v
        up = torch.searchsorted(bounds, mag, right=True)
        down = torch.searchsorted(bounds, mag, right=False)
        code = torch.where(x > 0, up, torch.where(x < 0, -down, torch.zeros_like(up)))
        dense = torch.zeros(spec.size, dtype=torch.float64, device=x.device)
        return dense.index_add_(0, code + spec.top, use.to(torch.float64))


_BOUNDS: dict[tuple[float, Any], Any] = {}


def _device_bounds(spec: SketchSpec, device: Any) -> Any:
    """The bucket boundaries on ``device``, copied there once per accuracy."""
    held = _BOUNDS.get((spec.alpha, device))
    if held is None:
        held = _BOUNDS[(spec.alpha, device)] = _torch().as_tensor(
            np.array(spec.bounds), device=device)
    return held


# -- the one host copy ---------------------------------------------------------------------
def to_host(parts: Sequence[Any]) -> tuple[list[np.ndarray], int]:
    """Return every part as a float64 numpy array, and the number of device copies made.

    Tensor parts are flattened and concatenated per device, then copied with
    one transfer per device, whatever their number.
    """
    torch = _torch()
    tensor = () if torch is None else torch.Tensor  # isinstance(x, ()) is False
    out: list[Any] = [None] * len(parts)
    by_device: dict[Any, list[int]] = {}
    for i, part in enumerate(parts):
        if isinstance(part, tensor):
            by_device.setdefault(part.device, []).append(i)
        else:
            out[i] = np.asarray(part, dtype=np.float64)
    if by_device:
        for idx in by_device.values():
            flat = torch.cat([parts[i].reshape(-1).to(torch.float64) for i in idx])
            host = flat.numpy(force=True)
            start = 0
            for i in idx:
                n = parts[i].numel()
                out[i] = host[start : start + n].reshape(tuple(parts[i].shape))
                start += n
    return out, len(by_device)


def rows_to_host(rows: Sequence[Row]) -> tuple[np.ndarray, int]:
    """Return rows as one ``[K, NFIELDS]`` float64 matrix and the number of device copies."""
    host, copies = to_host(rows)
    data = np.stack(host) if host else np.zeros((0, NFIELDS))
    return data, copies
