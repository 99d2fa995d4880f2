"""MoE routing balance: expert counts summed over ranks before anything is normalised."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metricsvc.reduce import ReduceType


def record_moe_balance(m: Any, counts: Mapping[Any, Any], prefix: str = "moe_balance") -> None:
    """Record per-layer expert token counts; the service derives, from the merged sums,
    ``<prefix>/layer_<l>/expert_<e>/{tokens,load_percent}`` and ``…/max_over_ideal``.

    ``counts`` maps a layer id to a 1-D tensor/array of routed tokens per expert.
    """
    for layer, per_expert in counts.items():
        keys = [f"__moe/{prefix}/layer_{layer}/expert_{e}" for e in range(len(per_expert))]
        m.record_counts(keys, per_expert, ReduceType.SUM)
