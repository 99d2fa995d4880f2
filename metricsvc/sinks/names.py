"""Metric-key rules shared by sinks: what is internal, and what a backend accepts as a name."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping

from metricsvc.declare import is_internal

_UNSAFE = re.compile(r"[^A-Za-z0-9_./\-]")


def public_metrics(metrics: Mapping[str, float], allow_nan: bool) -> dict[str, float]:
    """Return what a sink may see: no internal keys; non-finite values only if allowed."""
    return {
        k: v
        for k, v in metrics.items()
        if not is_internal(k) and (allow_nan or math.isfinite(v))
    }


@functools.lru_cache(maxsize=65536)  # names recur every step
def safe_tag(key: str, max_length: int = 255) -> str:
    """Return ``key`` as a tag every backend accepts: ``[A-Za-z0-9_./-]``, no empty parts."""
    tag = _UNSAFE.sub("_", key)
    tag = "/".join(part if part not in ("", ".", "..") else "_" for part in tag.split("/"))
    return tag[:max_length]


def tag_order(name: str, tag: str) -> tuple[bool, str]:
    """Order the names sharing one sink tag: the first is the one sinks show. The name
    written as its tag comes first, then the others alphabetically: the same name every
    step, whatever order the keys arrived in."""
    return (name != tag, name)


def tagged(metrics: Mapping[str, float], max_length: int = 255) -> dict[str, float]:
    """Return ``{safe_tag: value}``; of names sharing a tag the first in ``tag_order``
    keeps it (the service lists such names in the step's ``meta["collisions"]``), never
    a silent overwrite."""
    out: dict[str, float] = {}
    owner: dict[str, str] = {}
    for key, value in metrics.items():
        tag = safe_tag(key, max_length)
        held = owner.get(tag)
        if held is None or tag_order(key, tag) < tag_order(held, tag):
            owner[tag], out[tag] = key, value
    return out
