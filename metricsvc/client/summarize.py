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

import logging
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from metricsvc.client.device import (
    _on_host,
    accelerator_path_on_cpu,
    compile_default,
    device_rows,
    flat_value,
    number_rows,
)
from metricsvc.client.host import _HostPass
from metricsvc.client.tensors import (
    Difference,
    MaskCache,
    Row,
    _check_mask,
    _identity_row,
    _real_dtypes,
    _torch,
    is_tensor,
    to_device,
)
from metricsvc.protocol import (
    COUNT,
    SketchSpec,
    merge,
    merge_pair,
    merge_sparse,
    scalar_row,
    scalar_rows,
    sparse_counts,
    summarize_array,
)

log = logging.getLogger(__name__)


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
            mask = to_device(mask, values.device)  # from the host: no sync
            _check_mask(key, mask.shape, mask.dtype == torch.bool, values.shape, mask.dtype)
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


def summarize_many(
    values: Mapping[str, Any], mask: Any = None, *, compile: bool | None = None,
    cache: MaskCache | None = None,
) -> dict[str, Row]:
    """Return ``{key: row}`` for values sharing one mask; the mask is prepared once
    (once per step with a ``cache``). A value may be a ``Difference`` of two tensors.

    Every value is checked before any is summarised, so a bad one raises
    (naming its key) before work is done.
    """
    return _summaries(values, mask, compile, cache, False)[0]


def _summaries(values: Mapping[str, Any], mask: Any, compile: bool | None,
               cache: MaskCache | None, locate: bool) -> tuple[dict[str, Row], dict[str, Any]]:
    if mask is None and _PLAIN.issuperset(map(type, values.values())):
        return _plain_rows(values), {}  # plain floats and ints only (timings, counters)
    plain: dict[str, Any] = {}
    rest = values
    if mask is None:  # plain floats and ints (timings, counters) need no checks
        plain = {key: v for key, v in values.items() if type(v) in _PLAIN}
        if plain:
            rest = {key: v for key, v in values.items() if key not in plain}
    prepared = {key: _prepare_value(v, mask, key) for key, v in rest.items()}
    out: dict[str, Row] = {}
    at: dict[str, Any] = {}  # with ``locate``: key -> flat positions of its min and max
    host: dict[str, Any] = {}  # CPU tensors and differences: summarised together
    device: dict[tuple, list[tuple[str, Any]]] = {}  # same kind of flat values: together
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
                if locate and out[key][COUNT] > 0:
                    at[key] = _array_extremes(v, m)
            continue
        if _on_host(v, compile):
            host[key] = v
            continue
        if v.numel() == 0:
            out[key] = _identity_row(v.device)
            continue
        kind, x = flat_value(v)
        device.setdefault(kind, []).append((key, x))
    for values_of_a_kind in device.values():  # the mask as prepared for their device
        m = prepared[values_of_a_kind[0][0]][1]
        device_rows(values_of_a_kind, None if m is None else m.reshape(-1), compile, locate,
                    out, at)
    if plain:
        out.update(_plain_rows(plain))
    if host:
        host_mask = prepared[next(iter(host))][1]
        hosted = _HostPass(host_mask, cache or MaskCache(), locate)
        out.update(hosted.rows(host))
        at.update(hosted.at)
    return {key: out[key] for key in values}, at  # the caller's order


def _array_extremes(v: np.ndarray, mask: Any) -> tuple[int, int]:
    """The flat positions of the min and max of a numpy array's valid, finite values."""
    x = np.asarray(v, dtype=np.float64).ravel()
    use = np.isfinite(x) if mask is None else np.isfinite(x) & np.asarray(mask).ravel()
    return int(np.where(use, x, np.inf).argmin()), int(np.where(use, x, -np.inf).argmax())


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


def element_rows(values: Any, *, key: str = "value") -> list[Row]:
    """Return one summary row per element of a 1-D tensor/array (views of one [K, F] tensor)."""
    values, _ = prepare(values, None, key=key)
    if not is_tensor(values):
        return [scalar_row(float(v)) for v in np.asarray(values, dtype=np.float64).ravel()]
    with _torch().no_grad():
        return list(number_rows(values.reshape(-1, 1), None, False).unbind(0))


def merge_rows(a: Row, b: Row) -> Row:
    """Merge two rows, staying on the device if either is a tensor (no host copy)."""
    a_t, b_t = is_tensor(a), is_tensor(b)
    if not (a_t or b_t):
        return merge(a, b)
    torch = _torch()
    device = a.device if a_t else b.device
    a, b = to_device(a, device), to_device(b, device)  # no sync, no host round trip
    return merge_pair(a, b, torch)


def merge_rows_on_device(pairs: Sequence[tuple[Row, Row]]) -> list[Row]:
    """Merge each ``(a, b)`` (either on a device: a key recorded again) where the device
    row is, in one stacked merge per device: the kernels of one merge for all of them."""
    torch = _torch()
    out: list[Row] = [None] * len(pairs)
    by_device: dict[Any, list[int]] = {}
    for i, (a, b) in enumerate(pairs):
        by_device.setdefault((a if is_tensor(a) else b).device, []).append(i)
    for device, idx in by_device.items():
        if len(idx) == 1:
            out[idx[0]] = merge_rows(*pairs[idx[0]])
            continue
        a, b = (torch.stack([to_device(pairs[i][side], device) for i in idx])
                for side in (0, 1))
        for i, row in zip(idx, merge_pair(a, b, torch).unbind(0)):
            out[i] = row
    return out


def add_sketches(a: Any, b: Any) -> Any:
    """Add two sketches: sparse ``(codes, counts)`` pairs (host data) merge on the host, dense
    device tensors add on the device, and a sparse one meeting a dense one is scattered
    into it on that device (a host -> device copy; nothing waits for the device)."""
    if not is_tensor(a) and not is_tensor(b):
        return merge_sparse([a, b])
    if not is_tensor(a):
        a, b = b, a
    if not is_tensor(b):
        codes, counts = b
        slots = to_device(np.asarray(codes, dtype=np.int64) + _top(a), a.device)
        return a.index_add(0, slots, to_device(counts, a.device))
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
        held = _BOUNDS[(spec.alpha, device)] = to_device(np.array(spec.bounds), device)
    return held


# -- the one host copy ---------------------------------------------------------------------
def to_host(parts: Sequence[Any]) -> tuple[list[np.ndarray], int]:
    """Return every part as a float64 numpy array, and the number of device copies made.

    Tensor parts are flattened and concatenated per device, then copied with
    one transfer per device, whatever their number; a CPU part (the host path's rows) is
    viewed as it is, unless the CPU stands in for an accelerator (``accelerator_path_on_cpu``).
    """
    torch = _torch()
    tensor = () if torch is None else torch.Tensor  # isinstance(x, ()) is False
    out: list[Any] = [None] * len(parts)
    by_device: dict[Any, list[int]] = {}
    for i, part in enumerate(parts):
        if not isinstance(part, tensor):
            out[i] = np.asarray(part, dtype=np.float64)
        elif _on_host(part, None) and part.dtype == torch.float64:
            out[i] = part.numpy()  # a view: reading the CPU is no copy and no sync
        else:
            by_device.setdefault(part.device, []).append(i)
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


__all__ = [
    "Difference",
    "MaskCache",
    "Row",
    "accelerator_path_on_cpu",
    "compile_default",
    "is_tensor",
]
