"""Which key of a client's open step exports each name: one exported name, one source."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from metricsvc.protocol import AUTO, Metric, ReduceType, kind_name, safe_tag


@functools.lru_cache(maxsize=65536)  # keys recur every step
def _exported(key: str, code: int) -> tuple[str, ...]:
    """Return every name ``key`` may export under ``code``: its declaration's claims."""
    if code == AUTO:  # a plain number exports its key (its kind is the service's to pick)
        return tuple(dict.fromkeys((key, safe_tag(key))))
    return Metric(key, ReduceType(code)).claims()


class ExportedNames:
    """The names the keys of ``buffer``'s open step export (``owner``: name or sink tag ->
    the key exporting it), and what each recurring call's keys claimed, reused."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.owner: dict[str, str] = {}
        # What a call's keys claimed (by keys, code and declarations held), reused
        self._claims: dict[tuple, dict[str, str]] = {}

    def claim(self, rows: Mapping[str, Any], code: int | tuple[int, ...],
              recorded: Mapping[str, Any], fresh: bool = False) -> None:
        """Own the names new keys export; refuse one that another key of the step exports
        (``recorded``: the keys recorded in the step so far; ``fresh``: the caller found
        none of ``rows`` among them). A call with the keys of an earlier one (every step's
        same dict) reuses what that one claimed, once no name of it is taken in this step."""
        names = self.owner
        known = (tuple(rows), code, len(self.buffer.declarations.held))
        claimed = self._claims.get(known)
        if claimed is not None and names.keys().isdisjoint(claimed) \
                and (fresh or recorded.keys().isdisjoint(rows)):
            names.update(claimed)
            return
        new = [key for key in rows if key not in recorded]
        claimed = {}
        declared = self.buffer.declarations.names
        each = dict(zip(rows, code)) if code.__class__ is tuple else None  # a kind per key
        for key in new:
            kind = code if each is None else each[key]
            for name in _exported(key, kind):  # type: ignore[arg-type]
                if name in declared:
                    raise ValueError(
                        f"key {key!r} ({kind_name(kind)}) would export {name!r}, which the "
                        f"derived metric {declared[name]!r} declared in this client exports: "
                        f"one exported name, one source (rename one of them)"
                    )
                owner = names.get(name, claimed.get(name, key))
                if owner != key:
                    raise ValueError(
                        f"key {key!r} ({kind_name(kind)}) would export {name!r}, which key "
                        f"{owner!r} already exports in {self.buffer.label}: one exported name, one "
                        f"source (rename one of them)"
                    )
                claimed[name] = key
        names.update(claimed)
        if len(new) == len(rows):  # every key new here: the same call next step claims this
            if len(self._claims) >= 64:
                self._claims.pop(next(iter(self._claims)))
            self._claims[known] = claimed
