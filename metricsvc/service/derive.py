"""Derived metrics after the merge: the run's declarations, and the declared formulas
evaluated over merged records (no domain formula lives here; each is declared next to the
code that records its inputs).

Ranks send their declarations with every batch. The first declaration of a name holds for
the run, across steps and restarts: a later, different one is ignored and the rank that
sent it told (a notice naming both formulas) while its data is merged, so a published value
never depends on which rank happened to arrive first. Within the first step that declares
a name (before anything with it is published) the lowest rank's declaration is the run's,
whatever the arrival order; a rank whose declaration lost is told at its next call.

Each finished step, every declaration ranks sent for it is evaluated over the step's
merged records (``metricsvc.core.formula``); a formula that is undefined for the step is
omitted. The running sums of ``total(...)`` live here for the life of the service and
travel in each step's meta, so a restarted service continues them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from metricsvc.core.declare import Derived, KeyIndex, fill, is_internal, key_pattern
from metricsvc.core.formula import Undefined
from metricsvc.core.limits import LIMITS
from metricsvc.core.reduce import OutputRules, ReduceType, finalize_row


def instances(decl: Derived, index: KeyIndex) -> Iterator[tuple[str, dict[str, str]]]:
    """Yield ``(name, inputs)`` of each metric a declaration makes in a step: itself, or
    for a templated one each binding of its placeholders found in the step's keys."""
    if not decl.templated:
        yield decl.name, dict(decl.inputs)
        return
    anchor = decl.anchor()
    assert anchor is not None  # checked when it was declared
    pattern = key_pattern(anchor)
    for key in index.matching(anchor):
        binding = pattern.match(key)
        assert binding is not None  # matching() returned it
        yield fill(decl.name, binding), {s: fill(k, binding) for s, k in decl.inputs.items()}


def resolved(declared: Iterable[Derived], index: KeyIndex
             ) -> Iterator[tuple[str, Derived, dict[str, Any], int]]:
    """Each instance of each declaration over ``index``, in order: ``(name, declaration,
    its inputs' rows, how many rows it reads)`` (what the budget counts)."""
    for decl in declared:
        for name, inputs in instances(decl, index):
            found = {s: index.resolve(k) for s, k in inputs.items()}
            yield name, decl, found, sum(len(f) if isinstance(f, list) else 1
                                         for f in found.values())


class Deriver:
    """Evaluate a step's declared derived metrics; keep the runs' running totals."""

    def __init__(self, max_outputs: int = LIMITS.max_derived_outputs,
                 max_reads: int = LIMITS.max_derived_reads) -> None:
        self.totals: dict[str, list[float]] = {}  # derived name -> its total(...) sums
        self.undefined: dict[str, str] = {}  # the last step's omitted metrics -> why
        self.max_outputs, self.max_reads = max_outputs, max_reads
        self.limited: dict[str, Any] = {}  # the last step's budget, if it ran out
        self._held_plan: tuple = ((), (), [], {})  # declarations, keys, plan, limited

    def derive(self, declared: Mapping[str, Derived], keys: Sequence[str],
               kinds: Sequence[ReduceType], data: np.ndarray,
               rules: OutputRules) -> dict[str, float]:
        """Return ``{name: value}`` of every declared metric defined for this step (a
        templated declaration gives one per binding of its placeholders).

        At most ``max_outputs`` metrics are evaluated, reading at most ``max_reads``
        merged records; past either, the rest is left out and ``limited`` says so.
        """
        self.undefined, self.limited = {}, {}
        if not declared:
            return {}
        plan, limited = self._plan(declared, keys)
        out: dict[str, float] = {}
        for name, decl, found in plan:
            self._evaluate(name, decl, found, kinds, data, rules, out)
        self.limited = dict(limited)
        return out

    def _plan(self, declared: Mapping[str, Derived], keys: Sequence[str]
              ) -> tuple[list[tuple[str, Derived, dict[str, Any]]], dict[str, Any]]:
        """What ``derive`` evaluates over ``keys``: ``(name, declaration, its inputs'
        rows)`` within the budget, and what ``limited`` says (empty: within it); kept
        while steps bring the same keys and declarations (they recur every step)."""
        decls, keys = tuple(declared.values()), tuple(keys)
        held = self._held_plan
        if (len(held[0]) == len(decls) and all(a is b for a, b in zip(held[0], decls))
                and held[1] == keys):
            return held[2], held[3]
        plan: list[tuple[str, Derived, dict[str, Any]]] = []
        limited: dict[str, Any] = {}
        reads = 0
        for name, decl, found, cost in resolved(decls, KeyIndex(keys)):
            if len(plan) >= self.max_outputs or reads + cost > self.max_reads:
                limited = {
                    "limit": ("limits.max_derived_outputs" if len(plan) >= self.max_outputs
                              else "limits.max_derived_reads"),
                    "evaluated": len(plan), "first_left_out": name}
                break
            reads += cost
            plan.append((name, decl, found))
        self._held_plan = (decls, keys, plan, limited)
        return plan, limited

    def cost(self, declared: Iterable[Derived], keys: Iterable[str]) -> tuple[int, int]:
        """Return ``(outputs, reads)`` the declarations would cost over ``keys`` (counting
        stops once past the limits: a hostile declaration is not worked through)."""
        outputs = reads = 0
        for *_, cost in resolved(declared, KeyIndex(keys)):
            outputs, reads = outputs + 1, reads + cost
            if outputs > self.max_outputs or reads > self.max_reads:
                return outputs, reads
        return outputs, reads

    def _evaluate(self, name: str, decl: Derived, found: Mapping[str, Any],
                  kinds: Sequence[ReduceType], data: np.ndarray, rules: OutputRules,
                  out: dict[str, float]) -> None:
        inputs: dict[str, Any] = {}
        rows: dict[str, int] = {}
        for symbol, at in found.items():
            if isinstance(at, list):
                inputs[symbol] = [data[i] for i in at]
            elif at is not None:
                inputs[symbol], rows[symbol] = data[at], at

        def value_of(symbol: str) -> float:
            if symbol not in rows:
                raise Undefined  # value() of a group
            values = finalize_row(data[rows[symbol]], kinds[rows[symbol]], None, rules)
            if values is None:
                raise Undefined
            return values[0]

        parsed = decl.parsed
        totals = self.totals.setdefault(name, [0.0] * len(parsed.totals))
        if len(totals) != len(parsed.totals):  # redeclared with another formula
            totals[:] = [0.0] * len(parsed.totals)
        why: list[str] = []
        value = parsed.evaluate(inputs, value_of, totals, why)
        if value is not None and name not in out:
            out[name] = value
        elif why and len(self.undefined) < 100:
            self.undefined[name] = why[0]

    def unread(self, declared: Mapping[str, Derived], keys: Sequence[str]) -> list[str]:
        """Return the internal keys of a step that no declaration reads (never exported)."""
        exact = {k for d in declared.values() for k in d.inputs.values()
                 if "*" not in k and "<" not in k}
        groups = [d for d in declared.values()
                  if any("*" in k or "<" in k for k in d.inputs.values())]
        return [k for k in keys if is_internal(k) and k not in exact
                and not any(d.reads(k) for d in groups)]

    def state(self) -> dict[str, list[float]]:
        """Return the running totals (journaled in each step's meta)."""
        return {name: list(sums) for name, sums in self.totals.items() if sums}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue running totals from a journaled ``state()`` (after a restart)."""
        for name, sums in state.items():
            if isinstance(sums, list) and all(isinstance(x, (int, float)) for x in sums):
                self.totals[name] = [float(x) for x in sums]


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
