"""A built-in family's declarations, which drive its recording.

Each family lists a ``Metric(name, kind, help, unit)`` per key it records (``<name>`` for a
path segment) and its ``Derived`` metrics. Recording through the catalogue takes each key's
reduce kind from its declaration, so a kind is declared once, next to its help text, as
torchmetrics' ``add_state(dist_reduce_fx=...)`` does; a key the family does not declare is
refused, naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from metricsvc.protocol import Derived, Metric, ReduceType


class Catalogue:
    """The declarations of one family of built-in metrics."""

    def __init__(self, *entries: Metric | Derived) -> None:
        self.entries = entries
        self._entries: dict[str, Metric] = {}

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
        one ``stat`` call per kind, under ``mask``."""
        groups: dict[ReduceType, dict[str, Any]] = {}
        entries = [self.entry(key) for key in values]
        m.buffer.describe(*entries, under=m.full_key)  # what each means: sent once, shown by sinks
        for (key, value), entry in zip(values.items(), entries):
            groups.setdefault(entry.kind, {})[key] = value
        for kind, group in groups.items():
            m.stat(mask=mask, reduce=kind, **group)
