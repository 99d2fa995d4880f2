"""MoE routing balance: expert counts summed over ranks before anything is normalised."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from metricsvc.client.metrics.catalogue import Catalogue
from metricsvc.core.declare import Derived, Metric
from metricsvc.core.reduce import ReduceType


@functools.lru_cache(maxsize=256)  # by prefix: a run has a few
def moe_balance(prefix: str) -> tuple[Derived, ...]:
    """Per expert ``…/load_percent`` (its share of the layer's tokens, summed over ranks)
    and per layer ``…/max_over_ideal`` (the busiest expert over the mean); an empty layer
    gives 0 for both. Two declarations for every layer and expert: the service binds
    ``<l>`` and ``<e>`` from the recorded keys."""
    tokens = f"{prefix}/layer_<l>/expert_<e>/tokens"
    layer = f"{prefix}/layer_<l>/expert_*/tokens"
    return (
        Derived(f"{prefix}/layer_<l>/expert_<e>/load_percent",
                "div0(100 * sum(expert), sum_of_sums(layer))", {"expert": tokens, "layer": layer},
                help="an expert's share of its layer's tokens", unit="%"),
        # One expert key per layer binds <l> (expert 0, which every layer has).
        Derived(f"{prefix}/layer_<l>/max_over_ideal",
                "div0(max_of_sums(layer), sum_of_sums(layer) / size(layer))",
                {"first": f"{prefix}/layer_<l>/expert_0/tokens", "layer": layer},
                help="the busiest expert's tokens over the layer's mean (1: balanced)"),
    )


METRICS = Catalogue(  # what record_moe_balance records and declares (tested)
    Metric("moe_balance/layer_<l>/expert_<e>/tokens", ReduceType.SUM,
           "tokens routed to an expert, summed over ranks", "tokens"),
    *moe_balance("moe_balance"),
)


def record_moe_balance(m: Any, counts: Mapping[Any, Any], prefix: str = "moe_balance") -> None:
    """Record per-layer expert token counts as ``<prefix>/layer_<l>/expert_<e>/tokens``
    (SUM over ranks); the service derives ``…/load_percent`` and ``…/max_over_ideal``
    (``moe_balance``) from the merged sums.

    ``counts`` maps a layer id to a 1-D tensor/array of routed tokens per expert.
    """
    m.declare(*moe_balance(prefix))
    for layer, per_expert in counts.items():
        keys = [f"{prefix}/layer_{layer}/expert_{e}/tokens" for e in range(len(per_expert))]
        m.record_counts(keys, per_expert, METRICS.kind(keys[0]))
