"""Metric-key rules shared by sinks: what is internal, and what a backend accepts as a name."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

_UNSAFE = re.compile(r"[^A-Za-z0-9_./\-]")


def is_internal(key: str) -> bool:
    """Return True for bookkeeping keys that never reach a sink (``__x``, ``x__count``)."""
    return key.startswith("__") or key.endswith("__count")


def public_metrics(metrics: Mapping[str, float], allow_nan: bool) -> dict[str, float]:
    """Return what a sink may see: no internal keys; non-finite values only if allowed."""
    return {
        k: v
        for k, v in metrics.items()
        if not is_internal(k) and (allow_nan or math.isfinite(v))
    }


def safe_tag(key: str, max_length: int = 255) -> str:
    """Return ``key`` as a tag every backend accepts: ``[A-Za-z0-9_./-]``, no empty parts."""
    tag = _UNSAFE.sub("_", key)
    tag = "/".join(part if part not in ("", ".", "..") else "_" for part in tag.split("/"))
    return tag[:max_length]
