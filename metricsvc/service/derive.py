"""Derived metrics after the merge: the declared formulas over merged records (no domain
formula lives here; each is declared next to the code that records its inputs).

Each finished step, every ``Derived`` declaration that ranks sent for it is evaluated
over the step's merged records (``metricsvc.core.formula``); a formula that is undefined
for the step is omitted. The running sums of ``total(...)`` live here for the life of
the service and travel in each step's meta, so a restarted service continues them.
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
