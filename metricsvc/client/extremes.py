"""Where each min and max lies (``stat(ids=)``): found in the summary's own pass, on the
values' device, and kept through a step's micro-batches (``protocol.merge_sources``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from metricsvc.client.summarize import _summaries
from metricsvc.client.tensors import (
    Difference,
    MaskCache,
    Row,
    _real_dtypes,
    _torch,
    is_tensor,
    to_device,
)
from metricsvc.protocol import MAX_CALL, MAX_ID, MIN_CALL, MIN_ID, NSOURCE, merge_sources


def summarize_located(
    values: Mapping[str, Any], mask: Any, ids: Any, *, compile: bool | None = None,
    cache: MaskCache | None = None,
) -> tuple[dict[str, Row], dict[str, Row]]:
    """Return ``({key: row}, {key: sources})`` as ``summarize_many``, with where each key's
    min and max lie (``core.extremes``: row, column and, with ``ids``, the id of that row)
    found in the same pass (``argmin`` / ``argmax`` in place of ``min`` / ``max``), on the
    values' device: nothing is read back from an accelerator.

    Raises:
        TypeError: ``ids`` not a 1-D tensor or array of numbers.
        ValueError: ``ids`` of another length than a value's first dimension.
    """
    ids = _checked_ids(ids, values)
    rows, at = _summaries(values, mask, compile, cache, True)
    sources: dict[str, Row] = {}
    on_device: dict[tuple, list[str]] = {}  # (device, row length) -> keys: found together
    for key, where in at.items():
        v = values[key].a if isinstance(values[key], Difference) else values[key]
        shape = tuple(v.shape)
        inner = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        if is_tensor(where):
            on_device.setdefault((where.device, inner), []).append(key)
        else:
            sources[key] = _host_sources(where, inner, ids)
    for (_, inner), keys in on_device.items():
        where = at[keys[0]] if len(keys) == 1 else _torch().stack([at[k] for k in keys])
        found = _device_sources(where, inner, ids)
        sources.update(zip(keys, [found] if len(keys) == 1 else found.unbind(0)))
    return rows, sources


def _checked_ids(ids: Any, values: Mapping[str, Any]) -> Any:
    """``ids`` as a 1-D tensor or numpy array of numbers, one per row of every value."""
    if ids is None:
        return None
    if is_tensor(ids):
        ok = ids.dtype in _real_dtypes(_torch()) and ids.dtype != _torch().bool
    else:
        try:
            ids = np.asarray(ids)
        except Exception:  # ragged lists and the like
            ok = False
        else:
            ok = ids.dtype.kind in "iuf"
    if not ok:
        got = getattr(ids, "dtype", type(ids).__name__)
        raise TypeError(f"ids for key {next(iter(values), '?')!r} must be numbers (a sample's "
                        f"index or uid as an integer), one per row; got {got}")
    if ids.ndim != 1:
        raise ValueError(f"ids for key {next(iter(values), '?')!r} must be 1-D (one per row), "
                         f"got shape {tuple(ids.shape)}")
    for key, v in values.items():
        v = v.a if isinstance(v, Difference) else v
        shape = tuple(getattr(v, "shape", ()))
        if not shape or shape[0] != len(ids):
            raise ValueError(f"ids for key {key!r}: {len(ids)} ids, one per row, but the value "
                             f"has shape {shape}")
    return ids


def _host_sources(where: tuple[int, int], inner: int, ids: Any) -> np.ndarray:
    src = _unknown_sources()
    for first, flat in ((MIN_ID, where[0]), (MAX_ID, where[1])):
        row, col = divmod(int(flat), inner)
        src[first + 1: first + 4] = (0.0, row, col)
        if ids is not None:
            src[first] = float(ids[row])
    return src


def _device_sources(where: Any, inner: int, ids: Any) -> Any:
    """The sources row on the device of ``where`` (the flat min and max positions, ``[2]``),
    or the rows ``[K, NSOURCE]`` of ``K`` values' (``[K, 2]``)."""
    torch = _torch()
    rows, cols = torch.div(where, inner, rounding_mode="floor"), where % inner
    if ids is None:
        ident = torch.full(where.shape, float("nan"), dtype=torch.float64, device=where.device)
    else:
        ids = to_device(ids, where.device)  # host -> device, no sync
        ident = ids[rows].to(torch.float64)
    zero = torch.zeros(where.shape, dtype=torch.float64, device=where.device)
    cols8 = torch.stack([ident, zero, rows.to(torch.float64), cols.to(torch.float64)], -1)
    return cols8.flatten(-2)  # (min's 4 fields, max's 4 fields) per value


def merge_row_sources(a_row: Row, b_row: Row, a_src: Row | None, b_src: Row | None,
                      call: int) -> Row:
    """Return where the merge of ``a_row`` (recorded first) and ``b_row`` (the key's
    ``call``-th recording) has its min and max (``core.extremes``); None for unknown. A side
    won by a recording that was not located stays unknown, every field of it (its call
    with it: the service takes a position whole or not at all).
    On the device of either, as ``merge_rows``."""
    if b_src is not None:  # located: each side carries the call (an unlocated one's do not)
        b_src = b_src.clone() if is_tensor(b_src) else b_src.copy()
        b_src[[MIN_CALL, MAX_CALL]] = float(call)
    tensors = [x for x in (a_row, b_row, a_src, b_src) if is_tensor(x)]
    if not tensors:
        a_src, b_src = (_unknown_sources() if s is None else s for s in (a_src, b_src))
        return merge_sources(a_row, b_row, a_src, b_src)
    torch = _torch()
    device = tensors[0].device

    def on(x: Any) -> Any:
        if x is None:  # a fill on the device, not a copy from the host
            return torch.full((NSOURCE,), float("nan"), dtype=torch.float64, device=device)
        return to_device(x, device)

    return merge_sources(on(a_row), on(b_row), on(a_src), on(b_src), torch)


def _unknown_sources() -> np.ndarray:
    return np.full(NSOURCE, np.nan)
