"""What every summary path shares: torch found without importing it, the record row's
layout as tensors, masks checked, a ``Difference`` and the per-step ``MaskCache``."""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

import numpy as np

from metricsvc.protocol import (
    FIELDS,
    IDENTITY,
)

log = logging.getLogger(__name__)


Row = Any  # np.ndarray on the host, torch.Tensor on a device

_INF = float("inf")


def _torch() -> Any:
    # Only a program that made a torch tensor can pass one; never import torch ourselves.
    return sys.modules.get("torch")


def is_tensor(value: object) -> bool:
    """Return True for a torch tensor (without importing torch)."""
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


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


_ARANGE_MAX = 1 << 20  # masks up to this size pick their positions from a kept arange


class MaskCache:
    """The masks a client used this step (flat, with their count of valid positions; their
    positions made on first ask), found once per mask, and the scratch buffers of the CPU
    summaries, kept across steps (fresh multi-MB buffers every step cost more in page
    faults than the arithmetic).

    A mask entry holds its mask (so its memory cannot be reused by another mask meanwhile)
    and the mask's version counter (so an in-place change is noticed). ``clear`` it when
    the step is closed; the buffers stay.
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: list[tuple[Any, int, Any]] = []
        self._buffers: dict[tuple[Any, str], Any] = {}
        self._arange = np.arange(0)  # positions to pick a mask's valid ones from

    def valid(self, mask: Any) -> tuple[np.ndarray, int]:
        """Return ``(flat, n)``: ``mask`` (a CPU bool tensor) as a flat numpy bool array and
        its count of True, found once per mask and step."""
        return self._entry(mask)[:2]

    def index(self, mask: Any) -> Any:
        """Return the flat indices (an int64 CPU tensor) where ``mask`` (a CPU bool tensor)
        is True (made on first ask: a gather picks by the bool mask itself)."""
        entry = self._entry(mask)
        if entry[2] is None:
            flat = entry[0]
            # picking from a kept ``arange`` is faster than ``flatnonzero`` counting them
            if flat.size <= _ARANGE_MAX:
                if self._arange.size < flat.size:
                    self._arange = np.arange(flat.size)
                entry[2] = _torch().from_numpy(self._arange[: flat.size][flat])
            else:
                entry[2] = _torch().from_numpy(np.flatnonzero(flat))
        return entry[2]

    def _entry(self, mask: Any) -> list:
        for held, version, entry in self._entries:
            if (held.data_ptr() == mask.data_ptr() and held.shape == mask.shape
                    and held.stride() == mask.stride() and mask._version == version):
                return entry
        flat = mask.numpy().reshape(-1)
        entry = [flat, int(np.count_nonzero(flat)), None]
        self._entries = [(mask, mask._version, entry), *self._entries][: self.size]
        return entry

    def buffer(self, dtype: Any, role: str, n: int) -> Any:
        """Return a 1-D CPU scratch tensor of ``n`` elements of ``dtype`` for ``role``."""
        buf = self._buffers.get((dtype, role))
        if buf is None or buf.numel() < n:
            buf = self._buffers[(dtype, role)] = _torch().empty(n, dtype=dtype)
        return buf[:n]

    def clear(self) -> None:
        self._entries = []


@functools.cache
def _numpy_dtypes(torch: Any) -> frozenset:
    """The torch dtypes ``Tensor.numpy()`` can view (numpy has no bfloat16)."""
    return frozenset({torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
                      torch.int16, torch.int32, torch.int64, torch.bool})


def _memory(x: Any) -> tuple:
    """What identifies a tensor's values within a call: every value arrives as a fresh
    detached view, so the memory it views, not its id."""
    return (x.data_ptr(), x.dtype, tuple(x.shape), x.stride())


def to_device(x: Any, device: Any) -> Any:
    """Host data (an array, a CPU tensor) on ``device``, without waiting for the device: a
    CUDA copy leaves from pinned memory, queued behind the device's work (one from pageable
    memory waits for that work to finish: a sync, which torch's sync debug mode reports).
    PyTorch keeps the pinned block until the copy is done."""
    torch = _torch()
    t = x if is_tensor(x) else torch.as_tensor(np.asarray(x))
    target = torch.device(device)
    if t.device == target:
        return t
    if t.device.type == "cpu" and target.type == "cuda":
        return t.pin_memory().to(target, non_blocking=True)
    return t.to(target)


def _identity_row(device: Any = "cpu") -> Any:
    return to_device(np.array(IDENTITY, dtype=np.float64), device)


def _row_of(device: Any, **fields: Any) -> Any:
    """Stack named fields (tensors, one shape, or floats) into record rows on ``device``,
    in ``FIELDS`` order along the last dimension: one row ``[NFIELDS]`` from 0-d fields,
    ``[K, NFIELDS]`` from ``[K]`` ones (host rows are built by ``host._host_row``)."""
    torch = _torch()
    cols = [fields[name] for name in FIELDS]
    return torch.stack([c.to(torch.float64) if is_tensor(c)
                        else torch.tensor(float(c), dtype=torch.float64, device=device)
                        for c in cols], -1)
