"""Summaries on an accelerator: nothing may wait for the device, and a call's values of
one dtype and length are summarised stacked, with the launches of one: one fused kernel
(``torch.compile`` with dynamic shapes, so batch shapes and value counts never recompile),
or, where it cannot compile (and on the accelerator path on a CPU), vectorised whole-tensor
ops (no ``where``, no ``nonzero``)."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from metricsvc.client.tensors import INF, row_of, torch_module
from metricsvc.core.records import (
    COUNT,
    M2_ROOT,
    MAX,
    MIN,
    NFIELDS,
    NONFINITE,
    SUM,
    SUM_LO,
    centred_exactly,
    from_pivot,
)

log = logging.getLogger(__name__)


def compile_default() -> bool:
    """Return whether large device tensors use the compiled kernel (METRICSVC_COMPILE=0: no)."""
    return os.environ.get("METRICSVC_COMPILE", "1") not in ("0", "false", "False", "")


class _MaskPack:
    """Mask-derived tensors and scratch space shared by every value under one mask.

    ``like`` is one flat value ``[N]`` or several stacked ``[K, N]`` (the values of one call
    under one mask, summarised together: one kernel per step for all of them); the mask is
    ``[N]`` (one for all) or ``[K, N]`` (one per value). The scratch buffers matter on the
    CPU: fresh multi-MB temporaries per metric cost page faults that dwarf the arithmetic.
    """

    def __init__(self, mask: Any, like: Any) -> None:
        torch = torch_module()
        self.scratch = torch.empty_like(like)
        self.scratch64 = torch.empty(like.shape, dtype=torch.float64, device=like.device)
        if mask is None:
            self.weight = None
            self.to_pos = self.to_neg = None
            # a fill on the device, not a copy from the host
            self.count = torch.full(like.shape[:-1], float(like.shape[-1]),
                                    dtype=torch.float64, device=like.device)
        else:
            self.weight = mask.to(like.dtype)  # 1.0 valid, 0.0 masked out
            self.to_pos = torch.zeros_like(like).masked_fill_(~mask, INF)
            self.to_neg = -self.to_pos
            self.count = mask.sum(-1, dtype=torch.float64)

    def row(self, x: Any, locate: bool = False) -> Any:
        return _eager_row(x, self, locate)


def _eager_row(x: Any, p: _MaskPack, locate: bool = False) -> Any:
    """Summary row from vectorised whole-tensor ops only: no where, no masked_select, no sync.

    ``x`` is one flat value ``[N]`` (a row ``[NFIELDS]``) or ``K`` stacked ``[K, N]`` (rows
    ``[K, NFIELDS]``, the same launches as for one). Finite-ness comes from ``x - x`` (0, or
    NaN for NaN/inf); ``nan_to_num`` turns excluded positions into values that cannot win a
    sum, min or max. The deviations from the pivot (the mean, a device scalar per value)
    count at valid positions only. ``locate``: return ``(row, where)`` too, ``where`` the
    flat positions of the min, the max and the first non-finite value (``[3]``, or
    ``[K, 3]``; ``argmin`` / ``argmax`` in place of ``amin`` / ``amax``; still no sync).
    """
    torch = torch_module()
    s = p.scratch
    torch.sub(x, x, out=s)
    torch.nan_to_num_(s, nan=1.0)  # 1 where x is NaN/inf, else 0
    if p.weight is not None:
        s.mul_(p.weight)
    nonfinite = s.sum(-1, dtype=torch.float64)
    at_bad = s.argmax(-1) if locate else None  # the first 1
    count = p.count - nonfinite
    if p.weight is None:
        s.copy_(x)
    else:
        torch.mul(x, p.weight, out=s)
    torch.nan_to_num_(s, nan=0.0, posinf=0.0, neginf=0.0)
    z = p.scratch64.copy_(s)  # exact widening
    plain = z.sum(-1)
    pivot = plain / count.clamp(min=1.0)
    valid = torch.sub(x, x, out=s).eq_(0)  # 1 where finite (NaN != 0)
    if p.weight is not None:
        valid.mul_(p.weight)
    z.sub_(pivot.unsqueeze(-1)).mul_(valid)
    d1 = z.sum(-1)
    q = _norm(z, in_place=True)
    torch.add(x, p.to_pos, out=s) if p.to_pos is not None else s.copy_(x)
    torch.nan_to_num_(s, nan=INF, posinf=INF, neginf=INF)
    low, at_low = _extreme(s, torch.argmin if locate else None, torch.amin)
    torch.add(x, p.to_neg, out=s) if p.to_neg is not None else s.copy_(x)
    torch.nan_to_num_(s, nan=-INF, posinf=-INF, neginf=-INF)
    high, at_high = _extreme(s, torch.argmax if locate else None, torch.amax)
    total, low_part, root = from_pivot(count, pivot, d1, q, torch, plain,
                                       centred_exactly(low, high, pivot))
    row = row_of(x.device, sum=total, count=count, min=low, max=high, m2_root=root,
                  nonfinite=nonfinite, sum_lo=low_part)
    return (row, torch.stack([at_low, at_high, at_bad], -1)) if locate else row


def _extreme(s: Any, arg: Any, plain: Any) -> tuple[Any, Any]:
    """The extreme of ``s`` along its last dimension as float64 on the device, and (with
    ``arg``) its first flat position there: a gather, nothing read back."""
    torch = torch_module()
    if arg is None:
        return plain(s, -1).to(torch.float64), None
    at = arg(s, -1)
    return s.gather(-1, at.unsqueeze(-1)).squeeze(-1).to(torch.float64), at


def _norm(dev: Any, in_place: bool = False) -> Any:
    """``sqrt(sum(dev**2))`` along the last dimension of a float64 tensor, squared at a
    power-of-2 scale of its largest element (exact): no overflow past 1e154, no underflow
    below 1e-154, no sync. ``in_place`` scales ``dev`` itself (a scratch buffer)."""
    torch = torch_module()
    top = dev.abs().amax(-1)
    # 2**-exponent of the largest, in two halves: 2**1074 (a subnormal's) is past float64.
    half = torch.where(top > 0, -torch.frexp(top)[1], 0).to(torch.float64) / 2
    up, down = torch.exp2(torch.floor(half)), torch.exp2(torch.ceil(half))
    scale_up, scale_down = up.unsqueeze(-1), down.unsqueeze(-1)
    scaled = dev.mul_(scale_up).mul_(scale_down) if in_place else dev * scale_up * scale_down
    return torch.linalg.vector_norm(scaled, dim=-1) / up / down


def _use_compiled(x: Any, compile: bool | None) -> bool:
    """Whether ``x`` (one value or stacked ones) takes the fused kernel. On an accelerator
    it does by default, whatever its size: the eager path's ~150 small launches cost a
    device more than the kernel's guards and few launches, for a value of 64 elements as
    for 500,000 (``benchmarks/bench_device``: 1.6 against 0.34 ms on an H200). On the CPU
    the eager ops measured faster (``benchmarks/bench_summarize``)."""
    if _compile_failed:
        return False
    if compile is not None:
        return compile
    return compile_default() and x.device.type != "cpu"


def _kernel(x: Any, m: Any) -> Any:
    """Fused summaries of ``K`` values ``x`` ``[K, N]`` (float32 or float64) under the mask
    ``m`` (``[1, N]`` for all, or ``[K, N]``): their rows ``[K, NFIELDS]``, selections in
    ``x``'s dtype, sums in float64."""
    torch = torch_module()
    finite = torch.isfinite(x)
    use = m & finite
    low = torch.where(use, x, INF).amin(-1).to(torch.float64)
    high = torch.where(use, x, -INF).amax(-1).to(torch.float64)
    return _fused_rows(x, m, finite, use, low, high)


def _kernel_located(x: Any, m: Any) -> tuple[Any, Any]:
    """``_kernel``'s rows, and the flat positions of each min, max and first non-finite
    value ``[K, 3]``, found in the pass that finds them (``argmin`` / ``argmax``, then a
    gather). A kernel of its own: an argmin over a long row parallelises less well than a
    min."""
    torch = torch_module()
    finite = torch.isfinite(x)
    use = m & finite
    lows, highs = torch.where(use, x, INF), torch.where(use, x, -INF)
    bad = (m & ~finite).to(torch.uint8)
    at = torch.stack([lows.argmin(-1), highs.argmax(-1), bad.argmax(-1)], -1)
    low = lows.gather(-1, at[:, :1]).squeeze(-1).to(torch.float64)
    high = highs.gather(-1, at[:, 1:2]).squeeze(-1).to(torch.float64)
    return _fused_rows(x, m, finite, use, low, high), at


def _fused_rows(x: Any, m: Any, finite: Any, use: Any, low: Any, high: Any) -> Any:
    """The rows of the fused kernels, from each value's valid positions and extremes."""
    torch = torch_module()
    z = torch.where(use, x, 0).to(torch.float64)  # exact: selection, then widening
    count = use.sum(-1, dtype=torch.float64)
    plain = z.sum(-1)
    pivot = plain / count.clamp(min=1.0)
    dev = torch.where(use, z - pivot.unsqueeze(-1), 0.0)
    total, low_part, root = from_pivot(count, pivot, dev.sum(-1), _norm(dev), torch, plain,
                                       centred_exactly(low, high, pivot))
    cols = [total] * NFIELDS
    cols[COUNT], cols[M2_ROOT], cols[SUM_LO] = count, root, low_part
    cols[MIN], cols[MAX] = low, high
    cols[NONFINITE] = (m & ~finite).sum(-1, dtype=torch.float64)
    return torch.stack(cols, -1)


@functools.lru_cache(maxsize=2)  # located or not
def _compiled(locate: bool) -> Any:
    """The compiled kernel (``torch.compile`` compiles at its first call)."""
    return torch_module().compile(_kernel_located if locate else _kernel, dynamic=True,
                                  fullgraph=True)


_compile_failed = False


def _run_compiled(x: Any, m: Any, locate: bool) -> Any:
    """The fused kernel's answer for ``x`` ``[K, N]`` under ``m`` (``[1, N]`` or ``[K, N]``):
    the rows, with ``locate`` and where each min and max lies; or None where it cannot be
    compiled: the caller then takes the eager path, which is always right, as every later
    call does.

    One form for every call, so that a run compiles few graphs per kernel (dynamic sizes;
    ``K`` and the mask's rows 1 or more; float32 or float64: six), never more than dynamo
    keeps per function (8): a value in float16 or bfloat16 arrives widened to float32
    (exact), and one without a mask with a mask of ones."""
    global _compile_failed
    try:
        return _compiled(locate)(x, m)
    except Exception as err:  # no compiler, unsupported backend: eager is always right
        _compile_failed = True
        log.warning("torch.compile of the summary kernel failed, using eager: %s", err)
        return None


def flat_value(v: Any) -> tuple[tuple, Any]:
    """A device value flat (ints and bools in float64: exact there, never in float32), and
    what it is summarised with: the values of one dtype, device and length (``device_rows``)."""
    x = v.reshape(-1)
    if not x.is_floating_point():
        x = x.to(torch_module().float64)
    return (x.dtype, x.device, x.numel()), x


STACK_MAX = 1 << 24  # values stacked per kernel, at most: a [K, N] float64 scratch of 128 MB


def device_rows(values: list[tuple[str, Any]], mask: Any, compile: bool | None, locate: bool,
                out: dict[str, Any], at: dict[str, Any]) -> None:
    """Summarise flat device values of one dtype and length under one flat ``mask`` (or
    None), or each under its own (``mask`` stacked ``[K, N]``), into ``out`` (and, with
    ``locate``, where each min and max lies into ``at``): stacked ``[K, N]``, so a call's
    values take the kernels of one (a kernel launch costs a device more than its work on a
    batch's tensors), at most ``STACK_MAX`` values at a time."""
    torch = torch_module()
    n = values[0][1].numel()
    per_mask = mask is not None and mask.dim() == 2
    fused = _use_compiled(values[0][1], compile)
    step = max(1, STACK_MAX // n)
    with torch.no_grad():
        for first in range(0, len(values), step):
            chunk = values[first:first + step]
            m = mask[first:first + step] if per_mask else mask
            x = chunk[0][1].unsqueeze(0) if len(chunk) == 1 else torch.stack([v for _, v in chunk])
            if n == 1:  # one number each (a loss, a token count): a row is the number
                found = number_rows(x, m, locate)
            else:
                found = _fused(x, m, locate) if fused else None
            if found is None:
                found = _MaskPack(m, x).row(x, locate)
            rows, where = found if locate else (found, None)
            out.update(zip((key for key, _ in chunk), rows.unbind(0)))
            if locate:  # each value's positions, and its value at the first non-finite one
                bad = x.gather(-1, where[:, 2:]).squeeze(-1)
                at.update(zip((key for key, _ in chunk), zip(where.unbind(0), bad.unbind(0))))


def number_rows(x: Any, m: Any, locate: bool) -> Any:
    """The rows of ``K`` values of one number each (``x`` ``[K, 1]``, ``m`` None, ``[1]`` or
    ``[K, 1]``), in a few whole-tensor ops: what the summary of one number is (its sum, a
    count of 1, its min and max, no spread), or the empty record where it is masked out or
    not finite (counted as such). With ``locate``, its position: the only one there is."""
    torch = torch_module()
    v = x.reshape(-1).to(torch.float64)
    finite = torch.isfinite(v)
    valid = finite if m is None else finite & m.reshape(-1)
    bad = ~finite if m is None else ~finite & m.reshape(-1)
    zero = torch.zeros_like(v)
    cols = [zero] * NFIELDS
    cols[SUM] = torch.where(valid, v, 0.0)
    cols[COUNT] = valid.to(torch.float64)
    cols[MIN], cols[MAX] = torch.where(valid, v, INF), torch.where(valid, v, -INF)
    cols[NONFINITE] = bad.to(torch.float64)
    rows = torch.stack(cols, -1)
    return (rows, torch.zeros((len(v), 3), dtype=torch.int64, device=v.device)) if locate \
        else rows


def _fused(x: Any, m: Any, locate: bool) -> Any:
    """``_run_compiled`` on ``x`` ``[K, N]`` in its one form (see there), both inputs tensors
    of their own: dynamo guards a view on the tensor it views, so a view would compile
    graphs of its own (one copy of a value costs a device less than a compile)."""
    torch = torch_module()
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    elif x._is_view():
        x = x.clone()
    if m is None:
        m = torch.ones((1, x.shape[-1]), dtype=torch.bool, device=x.device)
    else:
        m = m.reshape(-1, x.shape[-1])
        m = m.clone() if m._is_view() else m
    return _run_compiled(x, m, locate)
