"""Formulas of derived metrics: a small expression language over merged records (pure).

A derived metric is declared with a formula over named inputs, each input a
recorded key (or, with ``*``, a group of keys). The service evaluates the formula
once per finished step over the merged records of its inputs; it knows no domain
formula itself. Grammar (Python expression syntax, nothing else):

- numbers, ``+ - * / **``, parentheses, unary ``-``;
- a statistic of one input: ``sum(x) count(x) mean(x) min(x) max(x)``,
  ``var(x) std(x)`` (population: divided by n, as numpy's default and the ``STD``
  reduce kind), ``sample_var(x) sample_std(x)`` (divided by n - 1, as ``torch.var``),
  ``value(x)`` (the input's own reduced value: the mean of an AVG key, the max of a
  MAX key, ...);
- over a group input (a key pattern with ``*``): ``sum_of_sums(g)``,
  ``max_of_sums(g)``, ``min_of_sums(g)`` (each key's sum, then added, or the largest,
  or the smallest of them) and ``size(g)`` (how many keys it matched);
- ``maximum(a, b, ...)``, ``minimum(a, b, ...)``, ``div0(a, b)`` (a / b, and 0 where
  b is 0);
- ``total(e)``: the running sum of ``e`` over every finished step of the run.

A formula is undefined for a step (the metric is omitted, never a made-up number)
when an input has no record or no values, or the result is not a finite number.
"""

from __future__ import annotations

import ast
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from metricsvc.core.records import COUNT, MAX, MIN, SUM, mean
from metricsvc.core.reduce import population_var

MAX_FORMULA_LENGTH = 1000
MAX_NODES = 200


class Undefined(Exception):
    """A formula has no value for this step (an input missing or empty, 0/0, ...)."""


class NotReal(Undefined):
    """A formula's value is a complex number (e.g. a negative number to a power 0.5)."""


def _power(a: float, b: float) -> float:
    out = a**b
    if isinstance(out, complex):
        raise NotReal
    return out


# Why a formula with every input present has no value: said in the step's meta.
_REASONS: tuple[tuple[type, str], ...] = (
    (NotReal, "not a real number"),
    (ZeroDivisionError, "division by zero"),
    (OverflowError, "overflow: past float64's range"),
    (ValueError, "outside the function's domain"),
    (TypeError, "not a number"),
)


def _n(row: np.ndarray) -> float:
    n = float(row[COUNT])
    if n <= 0:
        raise Undefined
    return n


def _sample_var(row: np.ndarray) -> float:
    n = _n(row)
    if n < 2:
        raise Undefined
    return population_var(row) * (n / (n - 1))


# statistic name -> f(row); ``value`` is resolved with the input's kind at evaluation.
STATISTICS: dict[str, Callable[[np.ndarray], float]] = {
    "sum": lambda row: float(row[SUM]),
    "count": lambda row: float(row[COUNT]),
    "mean": lambda row: _n(row) and mean(row),
    "min": lambda row: _n(row) and float(row[MIN]),
    "max": lambda row: _n(row) and float(row[MAX]),
    "var": lambda row: _n(row) and population_var(row),
    "std": lambda row: _n(row) and math.sqrt(population_var(row)),
    "sample_var": _sample_var,
    "sample_std": lambda row: math.sqrt(_sample_var(row)),
}
GROUP_STATISTICS = ("sum_of_sums", "max_of_sums", "min_of_sums", "size")
# Names of an earlier grammar, refused with what to write instead.
RENAMED = {"sum_all": "sum_of_sums", "max_all": "max_of_sums", "min_all": "min_of_sums"}
FUNCTIONS = ("maximum", "minimum", "div0", "total")
_OPERATORS: dict[type, Callable[[float, float], float]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: _power,
}


@dataclass(frozen=True)
class Formula:
    """A parsed, checked formula: evaluate it with ``Formula.evaluate``."""

    text: str
    tree: ast.expr
    symbols: frozenset[str]  # the inputs it reads
    totals: tuple[ast.Call, ...]  # its total(...) calls, each with a running sum

    def evaluate(self, inputs: Mapping[str, Any], value_of: Callable[[str], float],
                 totals: list[float] | None = None,
                 why: list[str] | None = None) -> float | None:
        """Return the formula's value, or None where it is undefined for this step.

        ``inputs`` maps each symbol to a merged row (or, for a group, a list of rows);
        ``value_of(symbol)`` returns the input's own reduced value. ``totals`` holds the
        running sums of the ``total(...)`` calls: each adds its argument's value for
        this step where that is defined, whatever the rest of the formula gives. Where
        the inputs are there but the value is not a finite real, ``why`` gets the reason.
        """
        sums = totals if totals is not None else [0.0] * len(self.totals)
        index = {id(node): i for i, node in enumerate(self.totals)}
        for i, node in enumerate(self.totals):
            try:
                step_value = float(_eval(node.args[0], inputs, value_of, sums, index))
            except (Undefined, ArithmeticError, ValueError, TypeError):
                continue
            if math.isfinite(step_value):
                sums[i] += step_value
        try:
            value = float(_eval(self.tree, inputs, value_of, sums, index))
        except (Undefined, ArithmeticError, ValueError, TypeError) as err:
            reason = next((r for kind, r in _REASONS if isinstance(err, kind)), None)
            if why is not None and reason is not None:
                why.append(reason)
            return None
        if not math.isfinite(value):
            if why is not None:
                why.append(f"not finite ({value})")
            return None
        return value


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> Formula:
    """Return the checked formula of ``text``.

    Raises:
        ValueError: it is not a formula of this grammar (the rule it breaks is named).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a formula must be a non-empty string")
    if len(text) > MAX_FORMULA_LENGTH:
        raise ValueError(f"formula is {len(text)} characters; the limit is "
                         f"{MAX_FORMULA_LENGTH}")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise ValueError(f"formula {text!r} is not an expression: {err.msg}") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise ValueError(f"formula {text!r} has {len(nodes)} parts; the limit is {MAX_NODES}")
    symbols: set[str] = set()
    names_ok: set[int] = set()  # Name nodes that are a function or a statistic's input
    totals: list[ast.Call] = []
    for node in nodes:
        if isinstance(node, ast.Call):
            _check_call(text, node)
            names_ok.add(id(node.func))
            if node.func.id in INPUT_FUNCTIONS:  # type: ignore[attr-defined]
                symbols.add(node.args[0].id)  # type: ignore[attr-defined]
                names_ok.add(id(node.args[0]))
            elif node.func.id == "total":  # type: ignore[attr-defined]
                if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                       and n.func.id == "total" for n in ast.walk(node.args[0])):
                    raise ValueError(f"formula {text!r}: total() cannot hold another total()")
                totals.append(node)
    for node in nodes:
        if isinstance(node, ast.Name):
            if id(node) not in names_ok:
                raise ValueError(f"formula {text!r}: input {node.id!r} must be read through "
                                 f"a statistic, e.g. mean({node.id}) or value({node.id})")
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise ValueError(f"formula {text!r}: only numbers are allowed as constants")
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in _OPERATORS:
                raise ValueError(f"formula {text!r}: operator {type(node.op).__name__} is "
                                 f"not allowed (+ - * / **)")
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.USub, ast.UAdd)):
                raise ValueError(f"formula {text!r}: only unary - and + are allowed")
        elif not isinstance(node, (ast.Call, ast.operator, ast.unaryop, ast.Load)):
            raise ValueError(f"formula {text!r}: {type(node).__name__} is not allowed")
    return Formula(text, tree, frozenset(symbols), tuple(totals))


INPUT_FUNCTIONS = frozenset({*STATISTICS, "value", *GROUP_STATISTICS})


def _check_call(text: str, node: ast.Call) -> None:
    name = node.func.id if isinstance(node.func, ast.Name) else None
    if node.keywords or name is None:
        raise ValueError(f"formula {text!r}: only plain calls like sum(x) are allowed")
    if name in INPUT_FUNCTIONS:
        if len(node.args) != 1 or not isinstance(node.args[0], ast.Name):
            raise ValueError(f"formula {text!r}: {name}() takes one input name, e.g. {name}(x)")
    elif name == "total":
        if len(node.args) != 1:
            raise ValueError(f"formula {text!r}: total() takes one expression")
    elif name in ("maximum", "minimum"):
        if not node.args:
            raise ValueError(f"formula {text!r}: {name}() needs arguments")
    elif name == "div0":
        if len(node.args) != 2:
            raise ValueError(f"formula {text!r}: div0() takes two expressions")
    elif name in RENAMED:
        raise ValueError(f"formula {text!r}: {name}() is now {RENAMED[name]}() (the same "
                         f"statistic, named for what it computes)")
    else:
        known = ", ".join([*STATISTICS, "value", *GROUP_STATISTICS, *FUNCTIONS])
        raise ValueError(f"formula {text!r}: unknown function {name!r}; known: {known}")


def _eval(node: ast.expr, inputs: Mapping[str, Any], value_of: Callable[[str], float],
          totals: list[float], index: dict[int, int]) -> float:
    if isinstance(node, ast.Constant):
        return float(node.value)
    if isinstance(node, ast.UnaryOp):
        operand = _eval(node.operand, inputs, value_of, totals, index)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left = _eval(node.left, inputs, value_of, totals, index)
        right = _eval(node.right, inputs, value_of, totals, index)
        return _OPERATORS[type(node.op)](left, right)
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    name = node.func.id
    if name in INPUT_FUNCTIONS:
        symbol = node.args[0].id  # type: ignore[attr-defined]
        held = inputs.get(symbol)
        if held is None:
            raise Undefined
        if name == "value":
            return value_of(symbol)
        if name in STATISTICS:
            if isinstance(held, list):
                raise Undefined  # a statistic of one key, given a group
            return STATISTICS[name](held)
        if not isinstance(held, list):
            raise Undefined  # a group statistic, given one key: declare it with '*'
        if name == "size":
            return float(len(held))
        sums = [float(r[SUM]) for r in held]
        if not sums:
            raise Undefined
        return {"sum_of_sums": sum, "max_of_sums": max, "min_of_sums": min}[name](sums)
    if name == "total":
        return totals[index[id(node)]]
    args = [_eval(a, inputs, value_of, totals, index) for a in node.args]
    if name == "maximum":
        return max(args)
    if name == "minimum":
        return min(args)
    return 0.0 if args[1] == 0 else args[0] / args[1]  # div0
