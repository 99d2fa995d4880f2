"""A client's declarations: its derived metrics (sent with every batch) and what its
declared names mean (help and unit, sent once, with the next batch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from metricsvc.protocol import Derived, Metric, encode_derived, is_internal


class ClientDeclarations:
    """The derived metrics declared in one client, the names they export, and the
    descriptions not sent yet. The caller (``RecordBuffer``) holds the lock."""

    def __init__(self) -> None:
        self.held: dict[str, Derived] = {}  # derived metrics, for every step
        self.names: dict[str, str] = {}  # a name (or sink tag) one of them exports
        self._wire = b""
        self._described: set[str] = set()  # names whose meaning was given (describe)
        self._about: dict[str, list[str]] = {}  # what they mean, not sent yet: next batch

    def holds(self, declarations: Iterable[Derived]) -> bool:
        """Whether every one of ``declarations`` is held already, the same object (what a
        family declares each step): then declaring them again has nothing to check."""
        held = self.held
        return all(held.get(getattr(d, "name", None)) is d for d in declarations)

    def declare(self, declarations: Iterable[Derived], key_names: Mapping[str, str],
                label: str) -> None:
        """Hold ``declarations``; refuse one that changes a held name or exports a name a
        key (``key_names``: exported name -> key, in ``label``) or another one exports."""
        new: dict[str, Derived] = {}
        for decl in declarations:
            if not isinstance(decl, Derived):
                raise TypeError(f"declare() takes Derived metrics, got {type(decl).__name__}")
            held = self.held.get(decl.name, new.get(decl.name))
            if held is decl:  # declared again each step: the same object
                continue
            if held is not None and held != decl:
                raise ValueError(
                    f"derived metric {decl.name!r} is declared with formula "
                    f"{held.formula!r} over {held.inputs}; it cannot be declared again "
                    f"as {decl.formula!r} over {decl.inputs}: one exported name, one source"
                )
            if held is not None:
                continue
            for name in decl.claims():
                owner = key_names.get(name)
                other = self.names.get(name)
                if owner is not None or (other is not None and other != decl.name):
                    raise ValueError(
                        f"derived metric {decl.name!r} would export {name!r}, which "
                        f"{f'key {owner!r}' if owner else f'derived metric {other!r}'} "
                        f"already exports in {label}: one exported name, one source "
                        f"(rename one of them)")
            new[decl.name] = decl
        if new:
            for decl in new.values():
                self.names.update(dict.fromkeys(decl.claims(), decl.name))
            self.held.update(new)
            self._wire = encode_derived(self.held.values())
            self.describe(new.values())

    def describe(self, metrics: Iterable[Metric | Derived],
                 under: Callable[[str], str] | None = None) -> None:
        """Note what ``metrics`` mean (once per name; ``under(name)``: the key recorded)."""
        for metric in metrics:
            name = metric.name if under is None else under(metric.name)
            if name not in self._described:
                self._described.add(name)
                said = metric.help or metric.unit
                if said and not is_internal(name):  # an internal key is never shown
                    self._about[name] = [metric.help, metric.unit]

    def reads(self, key: str) -> bool:
        """Return True if a held derived metric reads ``key``."""
        return any(d.reads(key) for d in self.held.values())

    def take_wire(self) -> bytes:
        """Return the declarations for the next batch: the derived metrics, with what names
        mean that was not sent yet (then forgotten here: sent once)."""
        if not self._about:
            return self._wire
        blob, self._about = encode_derived(self.held.values(), self._about), {}
        return blob
