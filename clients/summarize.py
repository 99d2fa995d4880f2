"""Masked tensors and arrays -> summary records, on the value's own device, without syncing.

``summarize`` is pure: it returns a float64 row ``(sum, count, min, max, sumsq,
nonfinite)`` — a numpy array for host data, a torch tensor on the value's
device for torch input. Nothing here copies device data to the host; the
client stacks every row of a flush and copies them once (``rows_to_host``).
"""

from __future__ import annotations

import functools
import numbers
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from metricsvc.records import NFIELDS, merge, scalar_row, summarize_array

Row = Any  # np.ndarray on the host, torch.Tensor on a device


def _torch() -> Any:
    # Only a program that made a torch tensor can pass one; never import torch ourselves.
    return sys.modules.get("torch")


def is_tensor(value: object) -> bool:
    """Return True for a torch tensor (without importing torch)."""
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def summarize(values: Any, mask: Any = None, *, key: str = "value") -> Row:
    """Return the summary row of ``values`` over the positions where ``mask`` is True.

    Args:
        values: torch tensor (any float/int dtype, any device), numpy array,
            sequence or plain number.
        mask: optional bool tensor/array of exactly the shape of ``values``.
        key: the metric name, used in error messages.

    Raises:
        TypeError: non-numeric values, or a mask that is not bool.
        ValueError: the mask's shape differs from the values'.
    """
    if is_tensor(values):
        return _summarize_tensor(values, mask, key)
    if mask is None and isinstance(values, numbers.Number):
        if isinstance(values, complex) or not isinstance(values, numbers.Real):
            raise TypeError(f"value for key {key!r} must be a real number, got {values!r}")
        return scalar_row(float(values))
    if isinstance(values, (str, bytes)) or isinstance(values, dict):
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
    host_mask = None
    if mask is not None:
        host_mask = mask.numpy(force=True) if is_tensor(mask) else np.asarray(mask)
        _check_mask(key, host_mask.shape, host_mask.dtype == np.bool_, arr.shape, host_mask.dtype)
    return summarize_array(arr, host_mask)


def _check_mask(key: str, mask_shape: Any, is_bool: bool, shape: Any, dtype: Any) -> None:
    if not is_bool:
        raise TypeError(f"mask for key {key!r} must be bool, got dtype {dtype}")
    if tuple(mask_shape) != tuple(shape):
        raise ValueError(
            f"expected mask of shape {tuple(shape)} for key {key!r}, got {tuple(mask_shape)}"
        )


def _summarize_tensor(values: Any, mask: Any, key: str) -> Row:
    torch = _torch()
    if values.is_complex() or values.dtype not in _real_dtypes(torch):
        raise TypeError(f"value for key {key!r} must be a real tensor, got dtype {values.dtype}")
    if mask is not None:
        if not is_tensor(mask):
            mask = torch.as_tensor(np.asarray(mask), device=values.device)  # host -> device only
        _check_mask(key, mask.shape, mask.dtype == torch.bool, values.shape, mask.dtype)
        if mask.device != values.device:
            mask = mask.to(values.device)
    with torch.no_grad():
        return _tensor_row(torch, values.detach(), None if mask is None else mask.detach())


@functools.cache
def _real_dtypes(torch: Any) -> frozenset:
    return frozenset(
        {
            torch.float16, torch.bfloat16, torch.float32, torch.float64,
            torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
        }
    )


def _tensor_row(torch: Any, values: Any, mask: Any) -> Any:
    """Return the summary row as a float64 tensor on ``values.device``; never syncs."""
    x = values.reshape(-1).to(torch.float64)
    finite = torch.isfinite(x)
    if mask is None:
        use, bad = finite, ~finite
    else:
        m = mask.reshape(-1)
        use, bad = m & finite, m & ~finite
    if x.numel() == 0:
        return torch.tensor([0.0, 0.0, np.inf, -np.inf, 0.0, 0.0], dtype=torch.float64,
                            device=x.device)
    z = torch.where(use, x, 0.0)
    return torch.stack(
        [
            z.sum(),
            use.sum(dtype=torch.float64),
            torch.where(use, x, np.inf).amin(),
            torch.where(use, x, -np.inf).amax(),
            (z * z).sum(),
            bad.sum(dtype=torch.float64),
        ]
    )


def merge_rows(a: Row, b: Row) -> Row:
    """Merge two rows, staying on the device if either is a tensor (no host copy)."""
    a_t, b_t = is_tensor(a), is_tensor(b)
    if not (a_t or b_t):
        return merge(a, b)
    torch = _torch()
    device = a.device if a_t else b.device
    a = a if a_t else torch.as_tensor(a, device=device)
    if not b_t:
        b = torch.as_tensor(b, device=device)
    elif b.device != device:
        b = b.to(device)  # device -> device, no host round trip
    out = a + b
    out[2] = torch.minimum(a[2], b[2])
    out[3] = torch.maximum(a[3], b[3])
    return out


def rows_to_host(rows: Sequence[Row]) -> tuple[np.ndarray, int]:
    """Return rows as one ``[K, NFIELDS]`` float64 matrix and the number of device copies made.

    Device rows are stacked per device and copied with one transfer each.
    """
    out = np.empty((len(rows), NFIELDS), dtype=np.float64)
    by_device: dict[Any, list[int]] = {}
    for i, row in enumerate(rows):
        if is_tensor(row):
            by_device.setdefault(row.device, []).append(i)
        else:
            out[i] = row
    if by_device:
        torch = _torch()
        for idx in by_device.values():
            out[idx] = torch.stack([rows[i] for i in idx]).numpy(force=True)
    return out, len(by_device)
