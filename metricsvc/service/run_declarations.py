"""The run's derived-metric declarations: one definition per name for the whole run.

Ranks send their declarations with every batch. The first declaration of a name holds
for the run, across steps and restarts: a later, different one is ignored and the rank
that sent it told (a notice naming both formulas) while its data is merged, so a
published value never depends on which rank happened to arrive first. Within the first
step that declares a name (before anything with it is published) the lowest rank's
declaration is the run's, whatever the arrival order; a rank whose declaration lost is
told at its next call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from metricsvc.core.declare import Derived


def _describe(decl: Derived) -> str:
    return f"{decl.formula!r} over {dict(decl.inputs)}"


class RunDeclarations:
    """The declarations of the run, each fixed once a step using it is published."""

    def __init__(self) -> None:
        self.held: dict[str, Derived] = {}
        self._origin: dict[str, tuple[int, int]] = {}  # name -> (step, rank) it came from
        self._fixed: set[str] = set()  # published with: never replaced
        self._unjournaled: dict[str, Derived] = {}
        self._journaled: dict[str, int] = {}  # name -> the step whose meta holds it

    def check(self, declarations: Iterable[Derived], step: int, rank: int) -> str | None:
        """Return what ``rank`` must hear if one of its declarations differs from the run's
        of its name (None: nothing). Such a declaration is ignored and the batch's data
        merged: the same outcome whatever the arrival order.

        A different declaration from an earlier (step, rank) than the held one, before
        the name was published, is not ignored: it becomes the run's (``adopt``).
        """
        ignored = []
        for decl in declarations:
            held = self.held.get(decl.name)
            if held is None or held == decl:
                continue
            if decl.name not in self._fixed and (step, rank) < self._origin[decl.name]:
                continue
            o_step, o_rank = self._origin[decl.name]
            ignored.append(
                f"derived metric {decl.name!r}: rank {rank} declares {_describe(decl)}, but "
                f"the run declares it {_describe(held)} (rank {o_rank}, step {o_step}); "
                f"yours is ignored and your data merged: a run's definition of a metric does "
                f"not change mid-run, give the new one a new name")
        return "; ".join(ignored) or None

    def adopt(self, declarations: Iterable[Derived], step: int, rank: int) -> list[int]:
        """Keep what ``check`` let through; return the ranks whose declaration it replaced."""
        displaced = []
        for decl in declarations:
            held = self.held.get(decl.name)
            if held is not None and (held == decl or decl.name in self._fixed
                                     or (step, rank) >= self._origin[decl.name]):
                continue
            if held is not None:
                displaced.append(self._origin[decl.name][1])
            self.held[decl.name] = decl
            self._origin[decl.name] = (step, rank)
            self._unjournaled[decl.name] = decl
        return displaced

    def of(self, names: Iterable[str]) -> dict[str, Derived]:
        """Return the run's declarations of ``names``."""
        return {name: self.held[name] for name in names if name in self.held}

    def fix(self, names: Iterable[str], step: int) -> dict[str, list[Any]]:
        """Fix ``names`` (``step``, using them, is being published); return the
        declarations not journaled yet, in their wire form, for that step's meta."""
        out: dict[str, list[Any]] = {}
        for name in names:
            self._fixed.add(name)
            decl = self._unjournaled.pop(name, None)
            if decl is not None:
                out[name] = decl.wire()[1:]
                self._journaled[name] = step
        return out

    def forget_after(self, step: int) -> None:
        """A rewind to ``step`` archives the steps after it: what they journaled is
        journaled again with the next step that uses it (the definitions still hold)."""
        for name in [n for n, at in self._journaled.items() if at > step]:
            del self._journaled[name]
            self._unjournaled[name] = self.held[name]

    def restore(self, journaled: Mapping[str, Any], step: int) -> None:
        """Take back declarations a journaled step's meta holds (after a restart)."""
        for name, wire in journaled.items():
            try:
                formula, inputs = wire
                decl = Derived(name, formula, {s: k for s, k in inputs})
            except (TypeError, ValueError):
                continue  # a journal line edited by hand: the next declaration will do
            self.held[name], self._origin[name] = decl, (step, -1)
            self._fixed.add(name)
            self._journaled[name] = step
