"""Alerts: the config's rules (``alerts:``), evaluated once when a step is final, in step
order, from its merged values. Each alert names the samples behind its value: where the
step's extremes of its key came from (``meta["extremes"]``: rank, and with ``stat(ids=)``
the sample's id, row, column and call; its top samples where ``stat(top=k)`` kept them; for
a non-finite rule, each matching key's first non-finite value). The step carries them
(``meta["alerts"]``), so an alert is journaled with its step, once: a restart reloads the
step and never alerts again; a rewind forgets what the rerun replaces (the windows are
refilled from the history at or before its step), and the rerun is evaluated afresh.

A rule is one of (``key`` an exported name)::

    {key: actor/ppo_kl/max, above: 0.5}       the value is above (or ``below``) a bound
    {key: actor/grad_norm, spike: 10, over: 20}
                                              the value passes 10 x the median of the key's
                                              last 20 final values (once it has 20)
    {nonfinite: "actor/*"}                    a recorded key matching the pattern counted
                                              NaN/inf values (``meta["nonfinite"]``)
    {missing: actor/pg_loss}                  the final step does not export the name

Pure: no Ray, thread or I/O (the journal's writer keeps the flagged samples' file:
``storage.flagged``).
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metricsvc.core.limits import MAX_ALERT_RULES, MAX_FLAGGED_PER_STEP


@dataclass(frozen=True)
class Rule:
    """One alert rule (``config.AlertRule``, as a mapping): its kind, what it watches and
    its bound; ``name`` is how journal, console and Ray's metric name it."""

    kind: str  # above, below, spike, nonfinite, missing
    target: str  # an exported name, or a pattern of recorded keys (nonfinite)
    bound: float = math.nan
    over: int = 0
    name: str = ""

    @classmethod
    def of(cls, rule: Mapping[str, Any]) -> Rule:
        for kind in ("above", "below", "spike"):
            if rule.get(kind) is not None:
                bound, over = float(rule[kind]), int(rule.get("over") or 20)
                text = (f"{rule['key']} spike {bound:g}x over {over}" if kind == "spike"
                        else f"{rule['key']} {kind} {bound:g}")
                return cls(kind, rule["key"], bound, over, rule.get("name") or text)
        kind = "nonfinite" if rule.get("nonfinite") is not None else "missing"
        return cls(kind, rule[kind], name=rule.get("name") or f"{kind} {rule[kind]}")


class Alerts:
    """The run's rules and, for its spike rules, each watched key's recent final values."""

    def __init__(self, rules: Sequence[Mapping[str, Any]] = ()) -> None:
        if len(rules) > MAX_ALERT_RULES:
            raise ValueError(f"alerts: {len(rules)} rules, at most {MAX_ALERT_RULES} a run")
        self.rules = [Rule.of(r) for r in rules]
        self.windows: dict[str, deque[tuple[int, float]]] = {
            r.target: deque(maxlen=r.over) for r in self.rules if r.kind == "spike"}
        # the final steps a window can hold (0: none kept)
        self.reach = max((w.maxlen or 0 for w in self.windows.values()), default=0)

    def check(self, step: int, metrics: Mapping[str, float],
              meta: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int]:
        """The alerts of final step ``step`` (each ``{"step", "rule", "key", "value",
        "samples"}``) and how many samples past ``MAX_FLAGGED_PER_STEP`` they left out;
        then remember the step's values for the spike rules."""
        out, named = [], 0
        for rule in self.rules:
            fired = self._fired(rule, metrics, meta)
            if fired is None:
                continue
            key, value = fired
            samples = (_nonfinite_samples(rule.target, meta) if rule.kind == "nonfinite" else
                       _samples(key, metrics, meta.get("extremes") or {}, meta.get("top") or {}))
            room = max(0, MAX_FLAGGED_PER_STEP - named)
            named += len(samples)
            out.append({"step": step, "rule": rule.name, "key": key, "value": value,
                        "samples": samples[:room]})
        self.remember(step, metrics)
        return out, max(0, named - MAX_FLAGGED_PER_STEP)

    def _fired(self, rule: Rule, metrics: Mapping[str, float],
               meta: Mapping[str, Any]) -> tuple[str, float | None] | None:
        if rule.kind == "missing":
            return None if rule.target in metrics else (rule.target, None)
        if rule.kind == "nonfinite":
            counts = {k: n for k, n in (meta.get("nonfinite") or {}).items()
                      if fnmatch.fnmatchcase(k, rule.target)}
            return (min(counts), float(sum(counts.values()))) if counts else None
        value = metrics.get(rule.target)
        if value is None or not math.isfinite(value):
            return None
        if rule.kind == "above":
            return (rule.target, value) if value > rule.bound else None
        if rule.kind == "below":
            return (rule.target, value) if value < rule.bound else None
        window = self.windows[rule.target]
        if len(window) < rule.over:
            return None
        median = statistics.median(v for _, v in window)
        return (rule.target, value) if median > 0 and value > rule.bound * median else None

    def remember(self, step: int, metrics: Mapping[str, float]) -> None:
        """Keep ``step``'s finite values of the keys spike rules watch (also for a journaled
        step reloaded after a restart, which is never evaluated again)."""
        for key, window in self.windows.items():
            value = metrics.get(key)
            if value is not None and math.isfinite(value):
                window.append((step, float(value)))

    def rewound(self, steps: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        """A rewind: the windows hold what the final ``steps`` at or before the rewind's
        step say (the run's history as it stands; the steps past it will be rerun)."""
        for window in self.windows.values():
            window.clear()
        for step, metrics in steps:
            self.remember(step, metrics)


def _nonfinite_samples(pattern: str, meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Where the first non-finite value of each key matching ``pattern`` came from
    (``meta["nonfinite_first"]``: rank, and with ``stat(ids=)`` the sample and its kind)."""
    first = meta.get("nonfinite_first") or {}
    return [{"name": k, **first[k]} for k in sorted(first) if fnmatch.fnmatchcase(k, pattern)]


def _samples(key: str, metrics: Mapping[str, float],
             extremes: Mapping[str, Mapping[str, Any]],
             top: Mapping[str, list[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The samples behind ``key``'s value: where its own min or max came from (a name
    ``meta["extremes"]`` places), else where the min and max of its family came from (the
    extremes named under it, ``kl`` -> ``kl/min``, ``kl/max``; or beside it, ``kl/mean`` ->
    ``kl/min``, ``kl/max``); for a name recorded with ``stat(top=k)``, its k samples."""
    if key in extremes:
        names = [key]
    else:
        names = sorted(n for n in extremes if n.rpartition("/")[0] == key)
        parent = key.rpartition("/")[0]
        if not names and parent:
            names = sorted(n for n in extremes if n.rpartition("/")[0] == parent
                           and n.rpartition("/")[2] in ("min", "max"))
    return [found for n in names for found in
            ([{"name": n, **s} for s in top[n]] if n in top
             else [{"name": n, "value": metrics.get(n), **extremes[n]}])]
