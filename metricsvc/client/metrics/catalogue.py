"""A built-in family's declarations, which drive its recording.

Each family lists a ``Metric(name, kind, help, unit)`` per key it records (``<name>`` for a
path segment) and its ``Derived`` metrics. Recording through the catalogue takes each key's
reduce kind from its declaration, so a kind is declared once, next to its help text, as
torchmetrics' ``add_state(dist_reduce_fx=...)`` does; a key the family does not declare is
refused, naming it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from metricsvc.core.declare import Derived, Metric
from metricsvc.core.reduce import ReduceType


class Catalogue:
    """The declarations of one family of built-in metrics."""

    def __init__(self, *entries: Metric | Derived) -> None:
        self.entries = entries
        self._entries: dict[str, Metric] = {}
        # Per recording buffer: (prefix and scopes, keys) -> the keys of each kind
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __iter__(self) -> Iterator[Metric | Derived]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def kind(self, key: str) -> ReduceType:
        """Return the declared kind of ``key`` (a name or one of a family's)."""
        return self.entry(key).kind

    def entry(self, key: str) -> Metric:
        """Return the declaration of ``key`` (a name or one of a family's)."""
        entry = self._entries.get(key)
        if entry is None:
            found = [e for e in self.entries if isinstance(e, Metric) and e.matches(key)]
            if len(found) != 1:
                raise KeyError(f"{key!r} is declared {len(found)} times in this family; "
                               f"a built-in key needs exactly one declaration")
            entry = self._entries[key] = found[0]
        return entry

    def stat(self, m: Any, mask: Any = None, **values: Any) -> None:
        """Record ``values`` on ``m`` (a client or tracker), each with its declared kind:
        under ``mask``, one ``stat`` call per kind; plain numbers without a mask, one record
        whatever their kinds. A call's keys recur every step: which
        kind each has is worked out, and what each means described, once per client."""
        plan, kinds = self._plan(m, values)
        if len(plan) == 1:
            m.record_as(plan[0][0], values, mask)
        elif mask is None:  # plain numbers of several kinds: one record for all
            m.record_as(dict(zip(values, kinds)), values)
        else:
            for kind, keys in plan:
                m.record_as(kind, {key: values[key] for key in keys}, mask)

    def stat_each(self, m: Any, **values: tuple[Any, Any]) -> None:
        """Record ``{key: (value, mask)}`` on ``m``, each key under its own mask and with its
        declared kind (``Tracker.stat_each``: per-sequence values in one pass)."""
        m.record_as(dict(zip(values, self._plan(m, values)[1])),
                    {key: v for key, (v, _) in values.items()},
                    masks={key: mask for key, (_, mask) in values.items()})

    def _plan(self, m: Any, values: dict[str, Any]) -> tuple[list, tuple[ReduceType, ...]]:
        """``values``' keys grouped by declared kind, and each key's kind in order; worked
        out (and what each key means described) once per client and call."""
        plans = self._plans.get(m.buffer)
        if plans is None:
            plans = self._plans[m.buffer] = {}
        known = (m.full_key(""), tuple(values))
        plan = plans.get(known)
        if plan is None:
            groups: dict[ReduceType, list[str]] = {}
            entries = [self.entry(key) for key in values]
            m.buffer.describe(*entries, under=m.full_key)  # sent once, shown by sinks
            for key, entry in zip(values, entries):
                groups.setdefault(entry.kind, []).append(key)
            plan = plans[known] = ([(kind, tuple(keys)) for kind, keys in groups.items()],
                                   tuple(entry.kind for entry in entries))
        return plan
