"""Estimated training FLOPs (AReaL's ``train_perf/estimated_flops``): a registry of
per-model estimators, each a function of one sequence's length, registered in every
training process (AReaL's ``register_flops_estimator``).

A multiply-add counts as two FLOPs; the estimate is three times the forward work (forward
plus a backward of twice the forward). A packed batch is the sum of the estimate of each of
its sequences, never the estimate of their summed length: attention grows with the square
of a sequence's length.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from metricsvc.core.limits import Recent

Estimator = Callable[[int], float]  # one sequence's length -> its training FLOPs
Factory = Callable[[Any], Estimator]  # a model config -> its estimator

_factories: dict[str, Factory] = {}
# (type, id(config)) -> (config, estimator): the config kept alive while its entry is; a
# run that builds its config anew each step keeps the newest few
_built: Recent = Recent(64)
_lock = threading.Lock()


def dense_transformer(config: Any) -> Estimator:
    """The reference estimator of a dense decoder from its config: ``6 * active parameters
    * L`` for the linear layers and ``6 * layers * heads * head_dim * L * (L + 1)`` for
    causal attention (AReaL's page). The config gives ``num_hidden_layers``,
    ``num_attention_heads``, ``head_dim`` (else ``hidden_size / num_attention_heads``)
    and ``active_parameters`` (else ``num_parameters``)."""
    layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    params = getattr(config, "active_parameters", None) or config.num_parameters

    def training_flops(length: int) -> float:
        return float(6 * params * length + 6 * layers * heads * head_dim * length * (length + 1))

    return training_flops


def register_flops_estimator(model_type: str, factory: Factory) -> None:
    """Register ``factory(config) -> estimator`` for ``model_type`` in this process (each
    training process registers its own); a second registration replaces the first."""
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"register_flops_estimator: model_type must be a non-empty string, "
                         f"got {model_type!r}")
    if not callable(factory):
        raise TypeError(f"register_flops_estimator({model_type!r}): factory must be callable, "
                        f"got {type(factory).__name__}")
    with _lock:
        _factories[model_type] = factory
        for key in [k for k in _built if k[0] == model_type]:
            del _built[key]


def flops_estimator(model_type: str, config: Any) -> Estimator:
    """The estimator of ``model_type`` for ``config``, its factory called once per model type
    and config.

    Raises:
        ValueError: no estimator is registered for ``model_type`` (the registered ones named).
    """
    with _lock:
        held = _built.get((model_type, id(config)))
        if held is not None and held[0] is config:
            return held[1]
        factory = _factories.get(model_type)
        if factory is None:
            known = ", ".join(sorted(_factories)) or "none"
            raise ValueError(f"no FLOPs estimator for model type {model_type!r} in this "
                             f"process (registered: {known}); call "
                             f"register_flops_estimator({model_type!r}, factory) in every "
                             f"training process first")
        estimator = factory(config)
        _built[(model_type, id(config))] = (config, estimator)
        return estimator


def estimate_flops(model_type: str, config: Any, seqlens: Iterable[int] | Any) -> float:
    """The training FLOPs of a batch: the sum over its sequences of the estimate of each
    (``seqlens``: each sequence's length, host numbers; a tensor is read once)."""
    estimate = flops_estimator(model_type, config)
    lengths = seqlens.tolist() if hasattr(seqlens, "tolist") else seqlens
    return float(sum(estimate(int(n)) for n in lengths))


register_flops_estimator("dense_transformer", dense_transformer)
