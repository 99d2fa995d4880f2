"""What sinks may show: no internal keys, one value per tag (rules: ``metricsvc.core.keys``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from metricsvc.core.keys import is_internal, safe_tag, tag_order
from metricsvc.core.limits import MAX_TAG_LENGTH


def public_metrics(metrics: Mapping[str, float], allow_nan: bool) -> dict[str, float]:
    """Return what a sink may see: no internal keys; non-finite values only if allowed."""
    return {
        k: v
        for k, v in metrics.items()
        if not is_internal(k) and (allow_nan or math.isfinite(v))
    }


def tagged(metrics: Mapping[str, float], max_length: int = MAX_TAG_LENGTH) -> dict[str, float]:
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


def descriptions(meta: Mapping[str, Any], max_length: int = MAX_TAG_LENGTH) -> dict[str, str]:
    """Return ``{safe_tag: "help [unit]"}`` for the names this step is the first to export
    with a description (``meta["descriptions"]``, from the declarations' help and unit)."""
    out = {}
    for name, text in (meta.get("descriptions") or {}).items():
        words = " ".join(part for part in (text.get("help", ""), text.get("unit") and
                                           f"[{text['unit']}]") if part)
        out.setdefault(safe_tag(name, max_length), words)
    return out
