"""Masked tensors and arrays -> summary records, on the value's own device, without syncing.

``summarize`` is pure: it returns a float64 row ``(sum, count, min, max, sumsq,
nonfinite)`` — a numpy array for host data, a torch tensor on the value's
device for torch input. ``sketch`` returns the dense quantile-bucket counts the
same way. Nothing here copies device data to the host; the client stacks every
row and sketch of a flush and copies them once per device (``to_host``).

On the CPU the valid positions of a mask are found once (per step, when the
caller passes a ``MaskCache``: every value recorded under that mask shares them);
each value is then gathered (never larger than itself) and reduced in a few passes
of its own dtype, with float64 only for accumulating, in cache-sized chunks. On
an accelerator nothing may wait for the device, so small tensors take vectorised
whole-tensor ops (no ``where``, no ``nonzero``) and large ones one fused kernel
(``torch.compile`` with dynamic shapes, so batch shapes never recompile), with
the eager path as fallback.
"""

from __future__ import annotations

import functools
import logging
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from metricsvc.records import merge, scalar_row, summarize_array
from metricsvc.sketch import SketchSpec, dense_counts

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
        """Return the flat indices where ``mask`` (a CPU bool tensor) is True."""
        for held, version, index in self._entries:
            if (held.data_ptr() == mask.data_ptr() and held.shape == mask.shape
                    and held.stride() == mask.stride() and mask._version == version):
                return index
        index = mask.reshape(-1).nonzero().reshape(-1)
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
    (once per step with a ``cache``).

    Every value is checked before any is summarised, so a bad one raises
    (naming its key) before work is done.
    """
    prepared = {key: prepare(v, mask, key=key) for key, v in values.items()}
    packs: dict[Any, Any] = {}
    out: dict[str, Row] = {}
    for key, (v, m) in prepared.items():
        if not is_tensor(v):
            out[key] = _plain_number_row(key, v) if isinstance(v, numbers.Number) else (
                summarize_array(v, m)
            )
            continue
        torch = _torch()
        x = v.reshape(-1)
        if not x.is_floating_point():
            x = x.to(torch.float64)  # ints and bools: exact in float64, never in float32
        if x.numel() == 0:
            out[key] = torch.tensor([0.0, 0.0, _INF, -_INF, 0.0, 0.0], dtype=torch.float64,
                                    device=x.device)
            continue
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
                    if x.device.type == "cpu":
                        cache = cache or MaskCache()
                        index = None if m is None else cache.index(m)
                        pack = packs[where] = _SelectPack(index, x, cache)
                    else:
                        pack = packs[where] = _MaskPack(flat_mask, x)
                out[key] = pack.row(x)
    return out


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


_CHUNK = 1 << 16  # float64 accumulation in pieces of 512 KiB: no whole-tensor float64 copy


class _SelectPack:
    """CPU: the valid positions of one mask (``index``; None: all), and buffers shared by
    every value of one dtype and size under it."""

    def __init__(self, index: Any, like: Any, cache: MaskCache) -> None:
        torch = _torch()
        self.index = index
        n = like.numel() if index is None else index.numel()
        self.n = n
        self.count = torch.tensor(float(n), dtype=torch.float64)
        self.gathered = cache.buffer(like.dtype, "gathered", n)
        self.clean = cache.buffer(like.dtype, "clean", n)
        self.scratch = cache.buffer(like.dtype, "scratch", n)
        self.wide = cache.buffer(torch.float64, "wide", min(n, _CHUNK))

    def row(self, x: Any) -> Any:
        """The summary row of flat ``x`` over the valid positions: a gather, then seven
        passes in x's dtype over at most x's size, float64 only to accumulate."""
        torch = _torch()
        if self.n == 0:
            return torch.tensor([0.0, 0.0, _INF, -_INF, 0.0, 0.0], dtype=torch.float64)
        v = x if self.index is None else torch.index_select(x, 0, self.index,
                                                            out=self.gathered)
        clean = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0, out=self.clean)
        bad = torch.sub(v, clean, out=self.scratch)  # 0 where finite, NaN/inf where not
        bad = torch.nan_to_num_(bad, nan=1.0, posinf=1.0, neginf=1.0)  # 1 where not finite
        # A sum of 0/1 in the value's dtype is exact while n fits its significand.
        exact = self.n < (1 << (11 if bad.dtype == torch.float16 else
                                8 if bad.dtype == torch.bfloat16 else 24))
        nonfinite = (bad.sum() if exact else torch.count_nonzero(bad)).to(torch.float64)
        sums, squares = [], []
        for piece in clean.split(_CHUNK):
            wide = self.wide[: piece.numel()].copy_(piece)  # exact widening
            sums.append(wide.sum())
            squares.append(torch.dot(wide, wide))
        total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
        square = squares[0] if len(squares) == 1 else torch.stack(squares).sum()
        low = torch.nan_to_num(v, nan=_INF, posinf=_INF, neginf=_INF, out=self.scratch).amin()
        high = torch.nan_to_num(v, nan=-_INF, posinf=-_INF, neginf=-_INF,
                                out=self.scratch).amax()
        return torch.stack([total, self.count - nonfinite, low.to(torch.float64),
                            high.to(torch.float64), square, nonfinite])


def _eager_row(x: Any, p: _MaskPack) -> Any:
    """Summary row from vectorised whole-tensor ops only: no where, no masked_select, no sync.

    Finite-ness comes from ``x - x`` (0, or NaN for NaN/inf); ``nan_to_num``
    turns excluded positions into values that cannot win a sum, min or max.
    """
    torch = _torch()
    s = p.scratch
    torch.sub(x, x, out=s)
    torch.nan_to_num_(s, nan=1.0)  # 1 where x is NaN/inf, else 0
    if p.weight is not None:
        s.mul_(p.weight)
    nonfinite = s.sum(dtype=torch.float64)
    if p.weight is None:
        s.copy_(x)
    else:
        torch.mul(x, p.weight, out=s)
    torch.nan_to_num_(s, nan=0.0, posinf=0.0, neginf=0.0)
    z = p.scratch64.copy_(s)  # exact widening
    total, squares = z.sum(), torch.dot(z, z)
    torch.add(x, p.to_pos, out=s) if p.to_pos is not None else s.copy_(x)
    low = torch.nan_to_num_(s, nan=_INF, posinf=_INF, neginf=_INF).amin()
    torch.add(x, p.to_neg, out=s) if p.to_neg is not None else s.copy_(x)
    high = torch.nan_to_num_(s, nan=-_INF, posinf=-_INF, neginf=-_INF).amax()
    return torch.stack(
        [
            total,
            p.count - nonfinite,
            low.to(torch.float64),
            high.to(torch.float64),
            squares,
            nonfinite,
        ]
    )


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
    return torch.stack(
        [
            z.sum(),
            use.sum(dtype=torch.float64),
            torch.where(use, x, _INF).amin().to(torch.float64),
            torch.where(use, x, -_INF).amax().to(torch.float64),
            (z * z).sum(),
            bad.sum(dtype=torch.float64),
        ]
    )


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
    """Return one summary row per element of a 1-D tensor/array (views of one [K, 6] tensor)."""
    values, _ = prepare(values, None, key=key)
    if not is_tensor(values):
        return [scalar_row(float(v)) for v in np.asarray(values, dtype=np.float64).ravel()]
    torch = _torch()
    with torch.no_grad():
        v = values.reshape(-1).to(torch.float64)
        finite = torch.isfinite(v)
        z = torch.where(finite, v, 0.0)
        rows = torch.stack(
            [z, finite.double(), torch.where(finite, v, _INF), torch.where(finite, v, -_INF),
             z * z, (~finite).double()],
            dim=1,
        )
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
    out = a + b
    out[2] = torch.minimum(a[2], b[2])
    out[3] = torch.maximum(a[3], b[3])
    return out


def add_dense(a: Row, b: Row) -> Row:
    """Add two dense sketches, staying on the device if either is a tensor."""
    if is_tensor(a) and not is_tensor(b):
        return a + _torch().as_tensor(b, device=a.device)
    if is_tensor(b) and not is_tensor(a):
        return b + _torch().as_tensor(a, device=b.device)
    if is_tensor(a) and a.device != b.device:
        return a + b.to(a.device)
    return a + b


# -- quantile sketches ---------------------------------------------------------------------
def sketch(values: Any, mask: Any, spec: SketchSpec, *, key: str = "value") -> Row:
    """Return dense bucket counts of the valid, finite values (device tensor or numpy)."""
    values, mask = prepare(values, mask, key=key)
    if not is_tensor(values):
        v = np.atleast_1d(np.asarray(values, dtype=np.float64)).ravel()
        use = np.isfinite(v) if mask is None else mask.ravel() & np.isfinite(v)
        return dense_counts(v[use], spec)
    torch = _torch()
    with torch.no_grad():
        x = values.reshape(-1).to(torch.float64)
        use = torch.isfinite(x)
        if mask is not None:
            use = use & mask.reshape(-1)
        x = torch.where(use, x, 0.0)  # excluded positions land in the zero slot with weight 0
        mag = x.abs()
        idx = torch.ceil(torch.log(mag.clamp(min=spec.min_value)) / spec.log_gamma)
        idx = idx.clamp(spec.lowest, spec.highest).to(torch.int64) - spec.lowest
        zero = spec.per_sign
        slot = torch.where(
            mag < spec.min_value,
            torch.full_like(idx, zero),
            torch.where(x > 0, zero + 1 + idx, zero - 1 - idx),
        )
        dense = torch.zeros(spec.size, dtype=torch.float64, device=x.device)
        return dense.index_add_(0, slot, use.to(torch.float64))


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
    """Return rows as one ``[K, 6]`` float64 matrix and the number of device copies made."""
    host, copies = to_host(rows)
    data = np.stack(host) if host else np.zeros((0, 6))
    return data, copies
