"""Derived metrics, computed after the merge from merged records (never averaged per rank).

A client asks for a derived metric by recording *internal* keys: a path with
one segment that starts with ``__`` names the derivation, the segments before
it are kept as a prefix, the ones after name the output and its inputs.

- ``__ratio/<out>/num`` and ``/den`` (any kinds) -> ``<out>`` = num / den, each side
  finalised with its own kind first.
- ``__explained_var/<out>/target`` and ``/residual`` -> ``<out>`` =
  1 - Var(residual) / (Var(target) + 1e-5), unbiased variances from merged moments.
- ``__moe/<out>/layer_<l>/expert_<e>`` (SUM of routed tokens) ->
  ``<out>/layer_<l>/expert_<e>/tokens``, ``…/load_percent`` and
  ``<out>/layer_<l>/max_over_ideal`` (an empty layer gives 0).
- ``__cumulative/<out>/tokens`` (SUM) and ``/seconds`` (MAX) -> ``<out>/tokens``,
  ``seconds``, ``tokens_per_second``, ``total_tokens``, ``total_seconds``,
  ``cumulative_tokens_per_second``.

Cumulative totals live in the ``Deriver`` for the life of the service.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from metricsvc.records import COUNT, SUM, SUMSQ
from metricsvc.reduce import OutputRules, ReduceType, finalize_row

Merged = tuple[ReduceType, np.ndarray]  # a key's kind and merged record
DERIVATIONS = frozenset({"ratio", "explained_var", "moe", "cumulative"})  # handler names


def split_internal(key: str) -> tuple[str, str, str] | None:
    """Return ``(prefix, handler, rest)`` of an internal key, or None for a public one."""
    parts = key.split("/")
    for i, part in enumerate(parts):
        if part.startswith("__") and len(part) > 2:
            return "/".join(parts[:i]), part[2:], "/".join(parts[i + 1 :])
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _scalar(merged: Merged | None, rules: OutputRules) -> float | None:
    if merged is None:
        return None
    values = finalize_row(merged[1], merged[0], None, rules)
    return None if values is None else values[0]


def _unbiased_var(row: np.ndarray) -> float | None:
    n = row[COUNT]
    if n < 2:
        return None
    mean = row[SUM] / n
    return max(row[SUMSQ] - n * mean * mean, 0.0) / (n - 1)


def _by_output(items: dict, roles: tuple[str, ...]) -> dict[str, dict[str, Merged]]:
    """Group ``{(prefix, "<out>/<role>"): merged}`` into ``{prefix/<out>: {role: merged}}``."""
    grouped: dict[str, dict[str, Merged]] = defaultdict(dict)
    for (prefix, rest), merged in items.items():
        out, _, role = rest.rpartition("/")
        if out and role in roles:
            grouped[_join(prefix, out)][role] = merged
    return grouped


class Deriver:
    """Turn a finished step's internal records into derived metrics."""

    def __init__(self) -> None:
        self.cumulative: dict[str, dict[str, float]] = defaultdict(
            lambda: {"tokens": 0.0, "seconds": 0.0}
        )
        self._handlers: dict[str, Callable[[dict, OutputRules], dict[str, float]]] = {
            "ratio": self._ratio,
            "explained_var": self._explained_var,
            "moe": self._moe,
            "cumulative": self._cumulative,
        }

    def handles(self, key: str) -> bool:
        """Return True if ``key`` is an internal key of a known derivation."""
        parsed = split_internal(key)
        return parsed is not None and parsed[1] in self._handlers

    def derive(self, internal: Mapping[str, Merged], rules: OutputRules) -> dict[str, float]:
        """Return the derived metrics of one step from its internal records."""
        groups: dict[str, dict[tuple[str, str], Merged]] = defaultdict(dict)
        for key, merged in internal.items():
            parsed = split_internal(key)
            if parsed is not None:
                prefix, handler, rest = parsed
                groups[handler][(prefix, rest)] = merged
        out: dict[str, float] = {}
        for handler, items in groups.items():
            fn = self._handlers.get(handler)
            if fn is not None:  # unknown handlers stay internal: nothing is invented
                out.update(fn(items, rules))
        return out

    # -- handlers ------------------------------------------------------------------------
    def _ratio(self, items: dict, rules: OutputRules) -> dict[str, float]:
        out = {}
        for name, p in _by_output(items, ("num", "den")).items():
            num, den = _scalar(p.get("num"), rules), _scalar(p.get("den"), rules)
            if num is not None and den:
                out[name] = num / den
        return out

    def _explained_var(self, items: dict, rules: OutputRules) -> dict[str, float]:
        out = {}
        for name, p in _by_output(items, ("target", "residual")).items():
            if "target" not in p or "residual" not in p:
                continue
            var_target, var_res = _unbiased_var(p["target"][1]), _unbiased_var(p["residual"][1])
            if var_target is not None and var_res is not None:
                out[name] = 1.0 - var_res / (var_target + 1e-5)
        return out

    def _moe(self, items: dict, rules: OutputRules) -> dict[str, float]:
        layers: dict[str, dict[str, float]] = defaultdict(dict)
        for (prefix, rest), merged in items.items():
            layer, _, expert = rest.rpartition("/")
            if layer and expert:
                layers[_join(prefix, layer)][expert] = float(merged[1][SUM])
        out = {}
        for layer, counts in layers.items():
            total = sum(counts.values())
            for expert, tokens in counts.items():
                out[f"{layer}/{expert}/tokens"] = tokens
                out[f"{layer}/{expert}/load_percent"] = 100.0 * tokens / total if total else 0.0
            ideal = total / len(counts)
            out[f"{layer}/max_over_ideal"] = max(counts.values()) / ideal if total else 0.0
        return out

    def _cumulative(self, items: dict, rules: OutputRules) -> dict[str, float]:
        out = {}
        for name, p in _by_output(items, ("tokens", "seconds")).items():
            tokens = _scalar(p.get("tokens"), rules) or 0.0
            seconds = _scalar(p.get("seconds"), rules) or 0.0
            total = self.cumulative[name]
            total["tokens"] += tokens
            total["seconds"] += seconds
            out[f"{name}/tokens"] = tokens
            out[f"{name}/seconds"] = seconds
            if seconds > 0:
                out[f"{name}/tokens_per_second"] = tokens / seconds
            out[f"{name}/total_tokens"] = total["tokens"]
            out[f"{name}/total_seconds"] = total["seconds"]
            if total["seconds"] > 0:
                out[f"{name}/cumulative_tokens_per_second"] = total["tokens"] / total["seconds"]
        return out

    def state(self) -> dict[str, Any]:
        """Return the cumulative totals (journaled in each step's meta)."""
        return {k: dict(v) for k, v in self.cumulative.items()}

    def restore(self, state: Mapping[str, Mapping[str, float]]) -> None:
        """Continue cumulative totals from a journaled ``state()`` (after a restart)."""
        for name, totals in state.items():
            self.cumulative[name] = {"tokens": float(totals.get("tokens", 0.0)),
                                     "seconds": float(totals.get("seconds", 0.0))}

