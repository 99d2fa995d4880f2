"""What every summary path shares: torch found without importing it, the record row's
layout as tensors, masks checked, ``Difference``, and which values take the host path."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from metricsvc.core.records import FIELDS, IDENTITY

Row = Any  # np.ndarray on the host, torch.Tensor on a device
INF = float("inf")


def torch_module() -> Any:
    """torch, if the program imported it (only a program that made a tensor can pass one;
    metricsvc never imports torch itself), else None."""
    return sys.modules.get("torch")


def is_tensor(value: object) -> bool:
    """Return True for a torch tensor (without importing torch)."""
    torch = torch_module()
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


def on_host(x: Any, compile: bool | None = None) -> bool:
    """Whether tensor ``x`` takes the host path: on the CPU, unless the CPU stands in for an
    accelerator or ``compile=True`` asks for the fused kernel wherever the tensor is."""
    return x.device.type == "cpu" and not _accelerator_path_on_cpu and compile is not True


def check_mask(key: str, mask_shape: Any, is_bool: bool, shape: Any, dtype: Any) -> None:
    """Refuse a mask that is not bool or not of the value's shape, naming the key."""
    if not is_bool:
        raise TypeError(f"mask for key {key!r} must be bool, got dtype {dtype}")
    if tuple(mask_shape) != tuple(shape):
        raise ValueError(
            f"expected mask of shape {tuple(shape)} for key {key!r}, got {tuple(mask_shape)}")


@functools.lru_cache(maxsize=1)  # of the one torch a process imports
def real_dtypes(torch: Any) -> frozenset:
    """The torch dtypes a value may have."""
    return frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                      torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                      torch.bool})


@functools.lru_cache(maxsize=1)
def numpy_dtypes(torch: Any) -> frozenset:
    """The torch dtypes ``Tensor.numpy()`` can view (numpy has no bfloat16)."""
    return frozenset({torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8,
                      torch.int16, torch.int32, torch.int64, torch.bool})


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
        return self.a.detach().to(torch_module().float64) - self.b.detach()


def memory_of(x: Any) -> tuple:
    """What identifies a tensor's values within a call: every value arrives as a fresh
    detached view, so the memory it views, not its id."""
    return (x.data_ptr(), x.dtype, tuple(x.shape), x.stride())


def to_device(x: Any, device: Any) -> Any:
    """Host data (an array, a CPU tensor) on ``device``, without waiting for the device: a
    CUDA copy leaves from pinned memory, queued behind the device's work (one from pageable
    memory waits for that work to finish: a sync, which torch's sync debug mode reports)."""
    torch = torch_module()
    t = x if is_tensor(x) else torch.as_tensor(np.asarray(x))
    target = torch.device(device)
    if t.device == target:
        return t
    if t.device.type == "cpu" and target.type == "cuda":
        return t.pin_memory().to(target, non_blocking=True)
    return t.to(target)


def identity_row(device: Any = "cpu") -> Any:
    """The identity record (count 0) as a float64 tensor on ``device``."""
    return to_device(np.array(IDENTITY, dtype=np.float64), device)


def row_of(device: Any, **fields: Any) -> Any:
    """Stack named fields (tensors of one shape, or floats) into record rows on ``device``,
    in ``FIELDS`` order along the last dimension."""
    torch = torch_module()
    return torch.stack([fields[name].to(torch.float64) if is_tensor(fields[name])
                        else torch.tensor(float(fields[name]), dtype=torch.float64,
                                          device=device) for name in FIELDS], -1)
