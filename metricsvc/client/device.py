"""Summaries on an accelerator: nothing may wait for the device, so small tensors take
vectorised whole-tensor ops (no ``where``, no ``nonzero``) and large ones one fused kernel
(``torch.compile`` with dynamic shapes, so batch shapes never recompile), with the eager
path as fallback."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from metricsvc.client.tensors import _INF, _row_of, _torch
from metricsvc.protocol import (
    COUNT,
    M2_ROOT,
    MAX,
    MIN,
    NFIELDS,
    NONFINITE,
    SUM_LO,
    centred_exactly,
    from_pivot,
)

log = logging.getLogger(__name__)


COMPILE_MIN_NUMEL = 1 << 16  # below this, kernel launch and guard checks cost more than they save
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


    def row(self, x: Any, locate: bool = False) -> Any:
        return _eager_row(x, self, locate)


def _eager_row(x: Any, p: _MaskPack, locate: bool = False) -> Any:
    """Summary row from vectorised whole-tensor ops only: no where, no masked_select, no sync.

    Finite-ness comes from ``x - x`` (0, or NaN for NaN/inf); ``nan_to_num``
    turns excluded positions into values that cannot win a sum, min or max. The
    deviations from the pivot (the mean, a device scalar) count at valid positions only.
    ``locate``: return ``(row, where)`` too, ``where`` the flat positions of the min and
    the max (``argmin`` / ``argmax`` in place of ``amin`` / ``amax``; still no sync).
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
    torch.nan_to_num_(s, nan=_INF, posinf=_INF, neginf=_INF)
    low, at_low = _extreme(s, torch.argmin if locate else None, torch.amin)
    torch.add(x, p.to_neg, out=s) if p.to_neg is not None else s.copy_(x)
    torch.nan_to_num_(s, nan=-_INF, posinf=-_INF, neginf=-_INF)
    high, at_high = _extreme(s, torch.argmax if locate else None, torch.amax)
    total, low_part, root = from_pivot(count, pivot, d1, q, torch, plain,
                                       centred_exactly(low, high, pivot))
    row = _row_of(x.device, sum=total, count=count, min=low, max=high, m2_root=root,
                  nonfinite=nonfinite, sum_lo=low_part)
    return (row, torch.cat([at_low, at_high])) if locate else row


def _extreme(s: Any, arg: Any, plain: Any) -> tuple[Any, Any]:
    """``s``'s extreme as a float64 device scalar, and (with ``arg``) its first flat
    position as a 1-element tensor: a gather, nothing read back."""
    torch = _torch()
    if arg is None:
        return plain(s).to(torch.float64), None
    at = arg(s).reshape(1)
    return s.index_select(0, at).reshape(()).to(torch.float64), at


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


def _kernel(x: Any, m: Any, locate: bool = False) -> Any:
    """Fused summary of a flat tensor: selections in its dtype, sums in float64
    (``locate``: with the flat positions of its min and max, as ``_eager_row``)."""
    torch = _torch()
    finite = torch.isfinite(x)
    use = finite if m is None else m & finite
    bad = ~finite if m is None else m & ~finite
    z = torch.where(use, x, 0).to(torch.float64)  # exact: selection, then widening
    count = use.sum(dtype=torch.float64)
    plain = z.sum()
    pivot = plain / count.clamp(min=1.0)
    dev = torch.where(use, z - pivot, 0.0)
    lows, highs = torch.where(use, x, _INF), torch.where(use, x, -_INF)
    if locate:
        at = torch.stack([lows.argmin(), highs.argmax()])
        low, high = (t.to(torch.float64) for t in lows.gather(0, at).unbind(0))
    else:
        low, high = lows.amin().to(torch.float64), highs.amax().to(torch.float64)
    total, low_part, root = from_pivot(count, pivot, dev.sum(), _norm(dev), torch, plain,
                                       centred_exactly(low, high, pivot))
    cols = [total] * NFIELDS
    cols[COUNT], cols[M2_ROOT], cols[SUM_LO] = count, root, low_part
    cols[MIN], cols[MAX] = low, high
    cols[NONFINITE] = bad.sum(dtype=torch.float64)
    return (torch.stack(cols), at) if locate else torch.stack(cols)


_compiled: Any = None
_compile_failed = False


def _run_compiled(x: Any, m: Any, locate: bool = False) -> Any:
    global _compiled, _compile_failed
    try:
        if _compiled is None:
            _compiled = _torch().compile(_kernel, dynamic=True, fullgraph=True)
        return _compiled(x, m, locate)
    except Exception as err:  # no compiler, unsupported backend: eager is always right
        _compile_failed = True
        log.warning("torch.compile of the summary kernel failed, using eager: %s", err)
        return _kernel(x, m, locate)
