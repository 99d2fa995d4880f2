"""Count device->host transfers and syncs made through torch's Python API (tests, benchmarks)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_SYNCING = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__",
            "__array__", "__len__"}


class HostTransferCounter(TorchFunctionMode):
    """Counts every tensor method call that moves data to the host or syncs on a value."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _SYNCING and name != "__len__":
            self.calls.append(name)
        elif name == "to" and any(
            (isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu")
            for a in list(args[1:]) + [kwargs.get("device")] if a is not None
        ):
            self.calls.append("to(cpu)")
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return len(self.calls)
