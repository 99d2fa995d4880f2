"""Many keys, each under its own mask (``stat_each``): the short host vectors among them
(a value per sequence: lengths, scores, clip flags) summarised together, one numpy pass per
statistic over all of them stacked, whatever their masks; everything else as ``stat``
summarises it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from metricsvc.client.device import _on_host, device_rows, flat_value
from metricsvc.client.host import stacked_rows
from metricsvc.client.summarize import prepare, summarize_many
from metricsvc.client.tensors import MaskCache, Row, _numpy_dtypes, _torch, is_tensor

_LONGEST = 4096  # longer values take the single-value passes (gathered, chunked)


def summarize_each(values: Mapping[str, tuple[Any, Any]], *, compile: bool | None = None,
                   cache: MaskCache | None = None) -> dict[str, Row]:
    """Return ``{key: row}`` for ``{key: (value, mask or None)}``. A bad value or mask
    raises naming its key (``prepare``) before anything is summarised."""
    vectors: dict[int, dict[str, tuple[np.ndarray, Any]]] = {}  # length -> {key: (x, mask)}
    rest = {}
    for key, (v, m) in values.items():
        pair = _host_vector(v, m, compile)
        if pair is None:
            rest[key] = prepare(v, m, key=key)
        else:
            vectors.setdefault(pair[0].size, {})[key] = pair
    out: dict[str, Row] = {}
    on_device: dict[tuple, list[tuple[str, Any, Any]]] = {}  # dtype, device, length -> keys
    for key, (v, m) in rest.items():
        if is_tensor(v) and v.numel() and not _on_host(v, compile):
            kind, x = flat_value(v)
            on_device.setdefault(kind, []).append((key, x, m))
        else:
            out[key] = summarize_many({key: v}, m, compile=compile, cache=cache)[key]
    for group in on_device.values():
        _device_each(group, compile, out)
    for group in vectors.values():
        out.update(_vector_rows(group, compile, cache))
    return {key: out[key] for key in values}  # the caller's order


def _device_each(group: list[tuple[str, Any, Any]], compile: bool | None,
                 out: dict[str, Row]) -> None:
    """Rows of flat device values of one dtype and length, each under its own mask (None:
    every position), stacked: the kernels of one value for all of them (``device_rows``)."""
    masks = [m for _, _, m in group]
    if all(m is None for m in masks):
        mask = None
    else:
        torch = _torch()
        x = group[0][1]
        mask = torch.stack([torch.ones(x.shape, dtype=torch.bool, device=x.device)
                            if m is None else m.reshape(-1) for m in masks])
    device_rows([(key, x) for key, x, _ in group], mask, compile, False, out, {})


def _host_vector(v: Any, m: Any, compile: bool | None) -> tuple[np.ndarray, Any] | None:
    """``(v, m)`` as 1-D numpy views if ``v`` is a short host vector of numbers and ``m``
    None or a bool mask of its shape; else None (``prepare`` then checks them)."""
    # numpy first: the built-in families' per-sequence values are numpy views already
    if isinstance(v, np.ndarray):
        if not (v.ndim == 1 and v.dtype.kind in "biuf" and 0 < v.size <= _LONGEST):
            return None
        if m is None or (isinstance(m, np.ndarray) and m.dtype == np.bool_
                         and m.shape == v.shape):
            return v, m
    torch = _torch()
    if is_tensor(v):
        if (v.ndim != 1 or not _on_host(v, compile) or v.dtype not in _numpy_dtypes(torch)
                or v.requires_grad):
            return None
        v = v.numpy()
    elif not (isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "biuf"):
        return None
    if not 0 < v.size <= _LONGEST:
        return None
    if m is None:
        return v, None
    if is_tensor(m):
        if m.dtype != torch.bool or m.device.type != "cpu" or m.shape != v.shape:
            return None
        return v, m.numpy()
    if isinstance(m, np.ndarray) and m.dtype == np.bool_ and m.shape == v.shape:
        return v, m
    return None


def _vector_rows(group: Mapping[str, tuple[np.ndarray, Any]], compile: bool | None,
                 cache: MaskCache | None) -> dict[str, Row]:
    """Rows of same-length vectors, each under its mask: stacked in float64 (exact) and
    summarised together (``stacked_rows``); one whose valid values are not all finite, or
    reach 1e150, takes the single-value path (which counts and excludes them)."""
    stacked = np.stack([x for x, _ in group.values()]).astype(np.float64, copy=False)
    valid = np.ones(stacked.shape, bool)
    for i, (_, m) in enumerate(group.values()):
        if m is not None:
            valid[i] = m
    rows, ok, _ = stacked_rows(stacked, valid)
    out: dict[str, Row] = {}
    for i, (key, (x, m)) in enumerate(group.items()):
        out[key] = rows[i] if ok[i] else \
            summarize_many({key: x}, m, compile=compile, cache=cache)[key]
    return out
