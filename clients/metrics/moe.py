"""MoE routing balance: expert counts summed over ranks before anything is normalised."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from metricsvc.protocol import Derived, Metric, ReduceType


@functools.cache
def moe_balance(prefix: str, layer: Any, experts: int) -> tuple[Derived, ...]:
    """Per expert ``…/load_percent`` (its share of the layer's tokens, summed over ranks)
    and per layer ``…/max_over_ideal`` (the busiest expert over the mean); an empty layer
    gives 0 for both."""
    group = f"{prefix}/layer_{layer}/expert_*/tokens"
    return (
        *(Derived(f"{prefix}/layer_{layer}/expert_{e}/load_percent",
                  "div0(100 * sum(expert), sum_all(layer))",
                  {"expert": f"{prefix}/layer_{layer}/expert_{e}/tokens", "layer": group},
                  unit="%") for e in range(experts)),
        Derived(f"{prefix}/layer_{layer}/max_over_ideal",
                "div0(max_all(layer), sum_all(layer) / size(layer))", {"layer": group}),
    )


METRICS = (  # what record_moe_balance records and declares (tested)
    Metric("moe_balance/layer_<l>/expert_<e>/tokens", ReduceType.SUM,
           "tokens routed to an expert, summed over ranks", "tokens"),
    Derived("moe_balance/layer_<l>/expert_<e>/load_percent",
            "div0(100 * sum(expert), sum_all(layer))",
            {"expert": "moe_balance/layer_<l>/expert_<e>/tokens",
             "layer": "moe_balance/layer_<l>/expert_*/tokens"},
            help="an expert's share of its layer's tokens", unit="%"),
    Derived("moe_balance/layer_<l>/max_over_ideal",
            "div0(max_all(layer), sum_all(layer) / size(layer))",
            {"layer": "moe_balance/layer_<l>/expert_*/tokens"},
            help="the busiest expert's tokens over the layer's mean (1: balanced)"),
)


def record_moe_balance(m: Any, counts: Mapping[Any, Any], prefix: str = "moe_balance") -> None:
    """Record per-layer expert token counts as ``<prefix>/layer_<l>/expert_<e>/tokens``
    (SUM over ranks); the service derives ``…/load_percent`` and ``…/max_over_ideal``
    (``moe_balance``) from the merged sums.

    ``counts`` maps a layer id to a 1-D tensor/array of routed tokens per expert.
    """
    for layer, per_expert in counts.items():
        m.declare(*moe_balance(prefix, layer, len(per_expert)))
        keys = [f"{prefix}/layer_{layer}/expert_{e}/tokens" for e in range(len(per_expert))]
        m.record_counts(keys, per_expert, ReduceType.SUM)
