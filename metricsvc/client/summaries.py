"""Masked tensors, arrays and numbers -> summary records, on the value's own device,
without syncing: one entry (``summarize_call``), the host and device paths behind it.

A call's values are checked first (a bad one raises naming its key, before any work), then
summarised where they live: plain numbers in one vectorised pass; numpy arrays with numpy;
CPU tensors on the host path (``host``: a mask's valid positions found once per step, each
distinct tensor gathered once, small values stacked, large ones in cache-sized float64
chunks); tensors on an accelerator on the device path (``device``: stacked by dtype and
length, one fused kernel or whole-tensor ops, nothing read back). Each row is a float64
record (``records.FIELDS``); with ``ids`` it also carries where its min and max came from
(``records`` sources), found in the same pass. The rows of a step go to the host in one
copy per device at the flush (``to_host``).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from metricsvc.client.device import device_rows, flat_value, number_rows
from metricsvc.client.host import (
    GroupSearch,
    HostPass,
    MaskCache,
    every_finite,
    smallest_largest,
    stacked_rows,
    through,
)
from metricsvc.client.tensors import (
    Difference,
    check_mask,
    identity_row,
    is_tensor,
    numpy_dtypes,
    on_host,
    real_dtypes,
    to_device,
    torch_module,
)
from metricsvc.core.limits import MAX_TEXT_BYTES, MAX_TEXT_FIELDS
from metricsvc.core.records import (
    COUNT,
    MAX_ID,
    MIN_ID,
    NF_ID,
    NF_VALUE,
    NFIELDS,
    NONFINITE,
    scalar_row,
    scalar_rows,
    summarize_array,
    unknown_sources,
)
from metricsvc.core.sketch import SketchSpec, merge_sparse, sparse_counts

_PLAIN = frozenset({float, int, bool})  # numbers that need no checks
_NUMBERS = frozenset({float, int, bool, np.float64, np.float32, np.float16, np.int64, np.int32,
                      np.int16, np.int8, np.uint8, np.bool_})
_VECTOR = 4096  # a host vector at most this long, under its own mask, is stacked with others


@dataclass(slots=True)
class Rows:
    """Records of some keys of one call, where they live: ``rows [k, NFIELDS]`` (numpy on
    the host, a tensor on its device) and, where located, ``sources [k, NSOURCE]``."""

    keys: tuple[str, ...]
    rows: Any
    sources: Any = None


def plain_rows(values: Sequence[Any]) -> np.ndarray | None:
    """The records of plain numbers (count 1 each), in one vectorised pass; None for
    anything else (or an int past float64, which the per-key path names)."""
    if not _NUMBERS.issuperset(map(type, values)):
        return None
    try:
        return scalar_rows(np.array(values, dtype=np.float64))
    except OverflowError:
        return None


def summarize_call(values: Mapping[str, Any], mask: Any = None, *,
                   masks: Mapping[str, Any] | None = None, ids: Any = None,
                   compile: bool | None = None, cache: MaskCache | None = None,
                   top: int | None = None, tops: dict[str, Any] | None = None) -> list[Rows]:
    """Return the records of a call's ``{key: value}``, grouped by where they live: every
    value under ``mask``, or each under its own (``masks``: ``{key: mask or None}``). A value
    may be a ``Difference`` of two tensors. With ``ids`` (one per row of every value), where
    each min and max lies too. With ``top``, each value's ``top`` smallest and largest valid
    finite values into ``tops``: ``{key: (found [2, top, 3], row length)}`` (side 0 the
    smallest; ``(value, flat position, id)``; NaN where fewer are valid; ties to the lower
    position), found in the same pass: from the values gathered for the record on the
    host (``smallest_largest``), by a stable sort on a device (nothing read back).

    Raises:
        TypeError: a non-numeric value, a mask that is not bool, bad ``ids``.
        ValueError: a mask or ``ids`` of another shape than the value's (the key is named).
    """
    keys = tuple(values)
    tops = {} if tops is None else tops
    if mask is None and masks is None and ids is None and top is None:
        block = plain_rows(list(values.values()))
        if block is not None:  # plain numbers only (timings, counters): the common call
            return [Rows(keys, block)]
    prepared = {}  # every value checked before any is summarised
    for key, value in values.items():
        prepared[key] = _prepare(value, mask if masks is None else masks.get(key), key)
    if ids is not None:
        ids = _checked_ids(ids, prepared)
    locate = ids is not None
    every = locate or top is not None  # each value on its own (no short vectors stacked)
    host_top: dict[str, np.ndarray] = {}  # with top: key -> [2, top, 3], host values'
    search = GroupSearch(top) if top is not None else None  # the arrays' of many values
    placed: dict[str, np.ndarray | None] = {}  # an array's valid positions (None: all)
    on_device: dict[Any, Any] = {}  # with top and ids: the ids on each device
    host: dict[str, Any] = {}  # key -> numpy row
    at: dict[str, Any] = {}  # key -> its min and max flat positions (located)
    passes: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(mask) -> (mask, CPU values)
    vectors: dict[int, dict[str, tuple[np.ndarray, Any]]] = {}  # length -> short vectors
    device: dict[tuple, list[tuple[str, Any, Any]]] = {}  # (kind, id(mask)) -> values
    for key, (v, m) in prepared.items():
        if v.__class__ is np.ndarray:
            if masks is not None and not every and v.ndim == 1 and 0 < v.size <= _VECTOR:
                vectors.setdefault(v.size, {})[key] = (v, m)  # a value per sequence
                continue
            host[key] = summarize_array(v, m)
            if locate and host[key][COUNT] > 0:
                at[key] = _array_extremes(v, m)
            if top is not None:  # many values: searched with the call's others (below)
                host_top[key], placed[key] = _array_top(key, v, m, top, search)
        elif v.__class__ is not Difference and not is_tensor(v):  # a plain number
            host[key] = _number_row(key, v)
            if top is not None:
                host_top[key] = smallest_largest(np.asarray(v, dtype=np.float64).reshape(-1), top)
        elif on_host(v.a if isinstance(v, Difference) else v, compile):
            pair = None if (every or masks is None) else _host_vector(v, m)
            if pair is not None:
                vectors.setdefault(pair[0].size, {})[key] = pair
            else:  # grouped by the mask the caller gave: one pass gathers it once
                given = mask if masks is None else masks.get(key)
                passes.setdefault(id(given), (m, {}))[1][key] = v
        else:
            v = v.tensor() if isinstance(v, Difference) else v
            if v.numel() == 0:
                host[key] = identity_row().numpy()
                continue
            kind, x = flat_value(v)
            device.setdefault((kind, 0 if masks else id(mask)), []).append((key, x, m))
            if top is not None:  # the ids on the value's device, once a call
                if ids is not None and v.device not in on_device:
                    on_device[v.device] = to_device(ids, v.device)
                tops[key] = (_device_top(v, m, on_device.get(v.device), top, _inner(v)),
                             _inner(v))
    if search is not None:
        host_top.update(search.found())
    for key, where in placed.items():  # among the valid values -> flat in the value
        if where is not None:
            through(host_top[key], where)
    for group in vectors.values():
        host.update(_vector_rows(group))
    for m, group in passes.values():
        hosted = HostPass(m, MaskCache() if cache is None else cache, locate, top)
        for key, row in hosted.rows(group).items():
            host[key] = row.numpy()
        at.update(hosted.at)
        host_top.update(hosted.tops)
    if host_top:  # the host values' samples (all keys at once): their ids, their rows' length
        inner = [_inner(prepared[key][0]) for key in host_top]
        samples = np.stack(list(host_top.values()))  # [keys, 2, top, 3]
        flat = samples[..., 1]
        known = ~np.isnan(flat)
        if ids is not None and known.any():  # (no valid value: maybe no row to look up)
            host_ids = ids.detach().cpu().numpy() if is_tensor(ids) else np.asarray(ids)
            row = np.where(known, flat, 0).astype(np.int64) // np.array(inner)[:, None, None]
            samples[..., 2] = np.where(known, host_ids[row], np.nan)
        tops.update(zip(host_top, zip(samples, inner)))
    out = []
    if host:
        order, found = [], []  # the caller's order
        for key in keys:
            row = host.get(key)
            if row is not None:
                order.append(key)
                found.append(row)
        rows = np.empty((len(order), NFIELDS))
        for i, row in enumerate(found):
            rows[i] = row
        sources = None
        if locate:
            sources = unknown_sources(len(order))
            for i, k in enumerate(order):  # a non-finite value is rare: then looked for
                bad = _first_nonfinite(*prepared[k]) if rows[i, NONFINITE] > 0 else None
                if k in at or bad is not None:
                    sources[i] = _host_sources(at.get(k), _inner(prepared[k][0]), ids, bad)
        out.append(Rows(tuple(order), rows, sources))
    for group in device.values():
        out.append(_device_group(group, values, ids, compile, masks is not None))
    return out


def summarize(values: Any, mask: Any = None, *, key: str = "value",
              compile: bool | None = None) -> Any:
    """Return the summary row of ``values`` over the positions where ``mask`` is True (a
    numpy row for host data, a tensor on the value's device for a device tensor).

    NaN/+-inf in valid positions are counted in ``nonfinite`` and excluded from the other
    fields; masked-out positions never matter, whatever they hold.
    """
    found = summarize_call({key: values}, mask, compile=compile)[0]
    return found.rows[0]


def _prepare(values: Any, mask: Any, key: str) -> tuple[Any, Any]:
    """``(values, mask)`` checked and on one side: tensors on one device, or numpy; a
    ``Difference`` of two tensors on one device."""
    if values.__class__ is np.ndarray and values.dtype.kind in "biuf" and (
            mask is None or (mask.__class__ is np.ndarray and mask.dtype == np.bool_
                             and mask.shape == values.shape)):
        return values, mask  # a numpy array of numbers (under a bool mask of its shape)
    if isinstance(values, Difference):
        a, m = _prepare(values.a, mask, key)
        b, _ = _prepare(values.b, mask, key)
        if b.device != a.device:
            raise ValueError(f"value for key {key!r}: Difference of tensors on "
                             f"{a.device} and {b.device}")
        return Difference(a, b), m
    if is_tensor(values):
        torch = torch_module()
        if values.dtype not in real_dtypes(torch):
            raise TypeError(f"value for key {key!r} must be a real tensor, got dtype "
                            f"{values.dtype}")
        if mask is not None:
            mask = to_device(mask, values.device)  # from the host: no sync
            check_mask(key, mask.shape, mask.dtype == torch.bool, values.shape, mask.dtype)
            mask = mask.detach()
        return values.detach(), mask
    if mask is None and isinstance(values, numbers.Number):
        if not isinstance(values, numbers.Real):
            raise TypeError(f"value for key {key!r} must be a real number, got {values!r}")
        return values, None
    if isinstance(values, (str, bytes, dict)):
        raise TypeError(f"value for key {key!r} must be a number, tensor or array, "
                        f"got {type(values).__name__}")
    try:
        arr = np.asarray(values)
    except Exception as err:  # ragged lists and the like
        raise TypeError(f"value for key {key!r} is not an array of numbers: {err}") from None
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"value for key {key!r} must be numeric, got dtype {arr.dtype}")
    if mask is not None:
        mask = mask.numpy(force=True) if is_tensor(mask) else np.asarray(mask)
        check_mask(key, mask.shape, mask.dtype == np.bool_, arr.shape, mask.dtype)
    return arr, mask


def _number_row(key: str, value: Any) -> np.ndarray:
    try:
        return scalar_row(float(value))
    except OverflowError:
        raise ValueError(f"value for key {key!r} does not fit in a float64: {value}") from None


def _array_extremes(v: np.ndarray, mask: Any) -> tuple[int, int]:
    """The flat positions of the min and max of a numpy array's valid, finite values."""
    x = np.asarray(v, dtype=np.float64).ravel()
    use = np.isfinite(x) if mask is None else np.isfinite(x) & np.asarray(mask).ravel()
    return int(np.where(use, x, np.inf).argmin()), int(np.where(use, x, -np.inf).argmax())


def _host_vector(v: Any, m: Any) -> tuple[np.ndarray, Any] | None:
    """``(v, m)`` as 1-D numpy views if ``v`` is a short CPU vector of numbers under its
    own mask (None, or bool of its shape); else None (the host pass takes it)."""
    torch = torch_module()
    if (isinstance(v, Difference) or v.ndim != 1 or v.dtype not in numpy_dtypes(torch)
            or v.requires_grad or not 0 < v.numel() <= _VECTOR):
        return None
    if m is not None and not (m.dtype == torch.bool and m.device.type == "cpu"):
        return None
    return v.numpy(), None if m is None else m.numpy()


def _vector_rows(group: Mapping[str, tuple[np.ndarray, Any]]) -> dict[str, np.ndarray]:
    """Rows of same-length vectors, each under its mask: stacked in float64 (exact) and
    summarised together (``stacked_rows``); one whose valid values are not all finite, or
    reach 1e150, takes the host pass (which counts and excludes them)."""
    stacked = np.stack([x for x, _ in group.values()]).astype(np.float64, copy=False)
    valid = np.ones(stacked.shape, bool)
    for i, (_, m) in enumerate(group.values()):
        if m is not None:
            valid[i] = m
    rows, ok, _ = stacked_rows(stacked, valid)
    out = {}
    for i, (key, (x, m)) in enumerate(group.items()):
        # one not summarised together is counted and excluded, or summed scaled, on its own
        out[key] = rows[i] if ok[i] else summarize_array(x, m)
    return out


def _device_group(group: list[tuple[str, Any, Any]], values: Mapping[str, Any], ids: Any,
                  compile: bool | None, each: bool) -> Rows:
    """Rows of flat device values of one dtype, device and length under one mask (or each
    under its own: ``each``), stacked: the kernels of one value for all of them."""
    torch = torch_module()
    masks = [m for _, _, m in group]
    if not each:
        mask = None if masks[0] is None else masks[0].reshape(-1)
    elif all(m is None for m in masks):
        mask = None
    else:
        x = group[0][1]
        mask = torch.stack([torch.ones(x.shape, dtype=torch.bool, device=x.device)
                            if m is None else m.reshape(-1) for m in masks])
    out: dict[str, Any] = {}
    at: dict[str, Any] = {}
    device_rows([(key, x) for key, x, _ in group], mask, compile, ids is not None, out, at)
    keys = tuple(key for key, _, _ in group)
    rows = torch.stack([out[k] for k in keys])
    sources = None
    if ids is not None:
        inner = {_inner(values[k]) for k in keys}
        where = torch.stack([at[k][0] for k in keys])
        bad = torch.stack([at[k][1] for k in keys])
        sources = torch.cat([_device_sources(where[i:i + 1], bad[i:i + 1], _inner(values[k]),
                                             ids)
                             for i, k in enumerate(keys)]) if len(inner) > 1 else \
            _device_sources(where, bad, inner.pop(), ids)
    return Rows(keys, rows, sources)


# -- where each min and max lies (``stat(ids=)``) ------------------------------------------
def _checked_ids(ids: Any, prepared: Mapping[str, tuple[Any, Any]]) -> Any:
    """``ids`` as a 1-D tensor or numpy array of numbers, one per row of every value."""
    first = next(iter(prepared), "?")
    torch = torch_module()
    if is_tensor(ids):
        ok = ids.dtype in real_dtypes(torch) and ids.dtype != torch.bool
    else:
        try:
            ids = np.asarray(ids)
        except Exception:  # ragged lists and the like
            ok = False
        else:
            ok = ids.dtype.kind in "iuf"
    if not ok:
        got = getattr(ids, "dtype", type(ids).__name__)
        raise TypeError(f"ids for key {first!r} must be numbers (a sample's index or uid as "
                        f"an integer), one per row; got {got}")
    if ids.ndim != 1:
        raise ValueError(f"ids for key {first!r} must be 1-D (one per row), got shape "
                         f"{tuple(ids.shape)}")
    for key, (v, _) in prepared.items():
        v = v.a if isinstance(v, Difference) else v
        shape = tuple(getattr(v, "shape", ()))
        if not shape or shape[0] != len(ids):
            raise ValueError(f"ids for key {key!r}: {len(ids)} ids, one per row, but the value "
                             f"has shape {shape}")
    return ids


def _inner(value: Any) -> int:
    """The length of one row of ``value``: flat positions within a row."""
    return math.prod(getattr(value.a if isinstance(value, Difference) else value, "shape",
                             ())[1:])


def _host_sources(where: tuple[int, int] | None, inner: int, ids: Any,
                  bad: tuple[int, float] | None) -> np.ndarray:
    """A located host value's sources: its min and max flat positions (``where``; None:
    it has no valid finite value), its first non-finite one's and that value (``bad``)."""
    src = unknown_sources(1)[0]
    found = [] if where is None else [(MIN_ID, where[0]), (MAX_ID, where[1])]
    if bad is not None:
        found.append((NF_ID, bad[0]))
        src[NF_VALUE] = bad[1]
    for first, flat in found:
        row, col = divmod(int(flat), inner)
        src[first + 1: first + 4] = (0.0, row, col)
        if ids is not None:
            src[first] = float(ids[row])
    return src


def _first_nonfinite(v: Any, m: Any) -> tuple[int, float]:
    """The flat position and value of a host value's first non-finite value at a valid
    position (it has one: its record counts it)."""
    v = v.tensor() if isinstance(v, Difference) else v
    if is_tensor(v):
        v = v.detach().to(torch_module().float64).numpy()
        m = None if m is None else m.numpy()
    x = np.asarray(v, dtype=np.float64).reshape(-1)
    bad = ~np.isfinite(x) if m is None else ~np.isfinite(x) & np.asarray(m).reshape(-1)
    at = int(bad.argmax())
    return at, float(x[at])


def _device_sources(where: Any, bad: Any, inner: int, ids: Any) -> Any:
    """The sources rows ``[K, NSOURCE]`` on the device of ``where`` (each value's flat min,
    max and first non-finite positions, ``[K, 3]``; ``bad`` the value at the last, ``[K]``):
    a gather of the ids, nothing read back."""
    torch = torch_module()
    rows, cols = torch.div(where, inner, rounding_mode="floor"), where % inner
    ident = to_device(ids, where.device)[rows].to(torch.float64)  # host -> device: no sync
    zero = torch.zeros(where.shape, dtype=torch.float64, device=where.device)
    fields = torch.stack([ident, zero, rows.to(torch.float64), cols.to(torch.float64)], -1)
    return torch.cat([fields.flatten(-2), bad.to(torch.float64).unsqueeze(-1)], -1)


# -- elements, sketches and the one host copy ---------------------------------------------
def element_rows(values: Any, *, key: str = "value") -> Any:
    """One record per element of a 1-D tensor/array (``[K, NFIELDS]``, on its device)."""
    values, _ = _prepare(values, None, key)
    if not is_tensor(values):
        return scalar_rows(np.asarray(values, dtype=np.float64).ravel())
    with torch_module().no_grad():
        return number_rows(values.reshape(-1, 1), None, False)


def sketch(values: Any, mask: Any, spec: SketchSpec, *, key: str = "value") -> Any:
    """Return the bucket counts of the valid, finite values: sparse ``(codes, counts)`` for
    host data, a dense tensor of ``spec.size`` counts on the value's device otherwise."""
    values, mask = _prepare(values, mask, key)
    torch = torch_module()
    if not is_tensor(values) or on_host(values):
        if is_tensor(values):
            values = values.detach().to("cpu", torch.float64).numpy()
            mask = None if mask is None else mask.numpy()
        v = np.atleast_1d(np.asarray(values, dtype=np.float64)).ravel()
        use = np.isfinite(v) if mask is None else np.asarray(mask).ravel() & np.isfinite(v)
        return sparse_counts(v[use], spec)
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


@functools.lru_cache(maxsize=16)  # a run has an accuracy or two, a device or few
def _device_bounds(spec: SketchSpec, device: Any) -> Any:
    """The bucket boundaries on ``device``, copied there once per accuracy."""
    return to_device(np.array(spec.bounds), device)


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
        slots = to_device(np.asarray(codes, dtype=np.int64) + (a.numel() - 1) // 2, a.device)
        return a.index_add(0, slots, to_device(counts, a.device))
    return a + (b if b.device == a.device else b.to(a.device))


def to_host(parts: Sequence[Any]) -> tuple[list[np.ndarray], int]:
    """Return every part as a float64 numpy array, and the number of device copies made.

    Tensor parts are flattened and concatenated per device, then copied with one transfer
    per device, whatever their number; a CPU part is viewed as it is, unless the CPU
    stands in for an accelerator (``accelerator_path_on_cpu``).
    """
    torch = torch_module()
    tensor = () if torch is None else torch.Tensor  # isinstance(x, ()) is False
    out: list[Any] = [None] * len(parts)
    by_device: dict[Any, list[int]] = {}
    for i, part in enumerate(parts):
        if not isinstance(part, tensor):
            out[i] = np.asarray(part, dtype=np.float64)
        elif on_host(part) and part.dtype == torch.float64:
            out[i] = part.numpy()  # a view: reading the CPU is no copy and no sync
        else:
            by_device.setdefault(part.device, []).append(i)
    for idx in by_device.values():
        host = torch.cat([parts[i].reshape(-1).to(torch.float64) for i in idx]).numpy(force=True)
        start = 0
        for i in idx:
            n = parts[i].numel()
            out[i] = host[start: start + n].reshape(tuple(parts[i].shape))
            start += n
    return out, len(by_device)


# -- the largest and smallest samples (``stat(top=k)``) --------------------------------------
def checked_text(text: Any, values: Mapping[str, Any]) -> list[str] | dict[str, list[str]]:
    """``stat(text=)``: one string per row of every value (a list), or a dict of such lists
    by field name (at most ``MAX_TEXT_FIELDS``), copied (the caller may reuse its lists; the
    strings are not copied). Only the samples ``top=k`` keeps take their text along.

    Raises:
        TypeError: not a list of strings or a dict of them (the key is named).
        ValueError: another number of strings than the values have rows.
    """
    first = next(iter(values))
    fields = text if isinstance(text, Mapping) else {"": text}
    if isinstance(text, Mapping) and (len(fields) > MAX_TEXT_FIELDS or not all(
            isinstance(f, str) and 0 < len(f) <= 64 for f in fields)):
        raise TypeError(f"text for key {first!r}: a dict of at most {MAX_TEXT_FIELDS} fields "
                        f"named by strings of at most 64 characters, got {list(fields)[:20]}")
    out = {}
    for name, strings in fields.items():
        what = f"text[{name!r}]" if name else "text"
        if not isinstance(strings, (list, tuple)):
            raise TypeError(f"{what} for key {first!r}: one string per row (a list, or a dict "
                            f"of lists by field name), got {type(strings).__name__}")
        bad = next((i for i, x in enumerate(strings) if x.__class__ is not str), None)
        if bad is not None:
            raise TypeError(f"{what} for key {first!r}: {what}[{bad}] is a "
                            f"{type(strings[bad]).__name__}, not a string")
        for key, value in values.items():
            v = value.a if isinstance(value, Difference) else value
            rows = len(v) if isinstance(v, (list, tuple)) else tuple(getattr(v, "shape", ()))[:1]
            if rows not in (len(strings), (len(strings),)):
                raise ValueError(f"{what} for key {key!r}: {len(strings)} strings, one per row, "
                                 f"but the value has shape {tuple(np.shape(v))}")
        out[name] = list(strings)
    return out[""] if "" in out else out


def sample_text(text: list[str] | dict[str, list[str]], row: int) -> list[Any]:
    """Row ``row``'s payload of a call's ``text``, cut to ``MAX_TEXT_BYTES`` UTF-8 bytes
    (the fields in order, each what the bound leaves it): ``[payload, bytes left out]``."""
    room = MAX_TEXT_BYTES
    fields = text.items() if isinstance(text, dict) else (("", text),)
    out, dropped = {}, 0
    for name, strings in fields:
        raw = strings[row].encode("utf-8", "replace")  # a lone surrogate: "?"
        out[name] = raw[:room].decode("utf-8", "ignore")  # a character cut through: out
        used = len(out[name].encode("utf-8"))
        dropped += len(raw) - used
        room -= used
    return [out[""] if "" in out else out, dropped]

def _array_top(key: str, v: np.ndarray, m: Any, k: int, search: GroupSearch
               ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``smallest_largest`` of a numpy value's valid values (None: many values, added to
    ``search``), and the valid positions its positions are among (None: every position)."""
    x = v.reshape(-1)
    where = None if m is None else np.flatnonzero(np.asarray(m).reshape(-1))
    if where is not None:
        x = x[where]
    return (None if search.add(key, x) is not None else every_finite(x, k)), where


def _device_top(v: Any, m: Any, ids: Any, k: int, inner: int) -> Any:
    """The ``[2, k, 3]`` top samples (``summarize_call``) of a device tensor, found on its
    device by a stable sort (ties to the lower position), nothing read back."""
    torch = torch_module()
    x = v.reshape(-1).to(torch.float64)
    valid = torch.isfinite(x) if m is None else torch.isfinite(x) & m.reshape(-1)
    n = min(k, x.numel())
    found = torch.full((2, k, 3), float("nan"), dtype=torch.float64, device=x.device)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=x.device)
    for side, order in ((0, x), (1, -x)):
        at = torch.sort(torch.where(valid, order, inf), stable=True).indices[:n]
        found[side, :n, 0] = torch.where(valid[at], x[at], torch.nan)
        found[side, :n, 1] = at.to(torch.float64)
        if ids is not None:  # on the value's device
            found[side, :n, 2] = ids[at // inner].to(torch.float64)
    return found
