"""Reduce kinds, the key -> kind rule for plain dicts, and finalisation of merged records.

The reduction is declared per key when it is recorded (``ReduceType``) and
dispatched through a table here. Plain ``submit_metric`` dicts carry the
``AUTO`` code; the service resolves it from what the frameworks define for the key
(``FRAMEWORK_KINDS``), then config rules (glob -> kind), then the *exact* last path
segment of the key, then the mean. Never substrings.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from operator import getitem
from typing import Literal

import numpy as np

from metricsvc.core.limits import Recent
from metricsvc.core.records import (
    COUNT,
    M2_ROOT,
    MAX,
    MIN,
    NONFINITE,
    SUM,
    SUM_LO,
    mean,
    mean_parts,
)
from metricsvc.core.sketch import Sketch, SketchSpec, quantile_name, quantiles


class ReduceType(IntEnum):
    """How a key's records merge across micro-batches and ranks, and what it exports."""

    AVG_MIN_MAX = 1  # -> key/mean, key/min, key/max
    AVG = 2  # -> key: count-weighted mean
    MEAN = 2  # alias of AVG (siiRL / verl spelling)
    SUM = 3  # -> key: sum of all valid elements
    MIN = 4
    MAX = 5
    SCALAR = 6  # rank-identical value (e.g. a learning rate); mismatches are flagged
    STD = 7  # -> key/std: exact population std from merged moments
    QUANTILES = 8  # -> key/p50, key/p90, key/p99 (configurable) from merged sketches
    STRICT_AVG = 9  # -> key: the mean, NaN once a valid element was NaN/inf (AReaL's tails)

    @classmethod
    def parse(cls, value: ReduceType | str | int) -> ReduceType:
        """Return the kind named by an enum, its name (any case) or its code."""
        if isinstance(value, ReduceType):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                names = ", ".join(sorted(cls.__members__))
                raise ValueError(
                    f"unknown reduce kind {value!r}; expected one of {names}"
                ) from None
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return cls(int(value))
        raise TypeError(f"expected a ReduceType, its name or code, got {type(value).__name__}")


AUTO = 0  # wire code: "choose from the key name" (plain submit_metric values)
VALID_CODES = frozenset({AUTO, *(int(k) for k in ReduceType)})


def kind_name(code: int) -> str:
    """Return a reduce code's name for messages."""
    return "AUTO (from the key name)" if code == AUTO else ReduceType(code).name

# Exact last path segment -> kind. ``std``, ``median`` and ``pNN`` of plain
# per-rank numbers cannot be merged exactly; they are averaged and flagged
# approximate in the step meta (record tensors with stat(reduce=STD) instead).
_SEGMENT_KINDS: dict[str, ReduceType] = {
    "mean": ReduceType.AVG,
    "avg": ReduceType.AVG,
    "min": ReduceType.MIN,
    "max": ReduceType.MAX,
    "sum": ReduceType.SUM,
    "total": ReduceType.SUM,
    "count": ReduceType.SUM,
}
_APPROXIMATE_SEGMENT = re.compile(r"^(std|median|p\d{1,2}(\.\d+)?)$")


# Plain-dict keys whose meaning the frameworks define (siiRL, verl and AReaL agree on each),
# under every config: a rule that would give one of them another kind is refused when the
# config loads (``framework_conflict``). siiRL picks these by substring ("max" anywhere);
# here the suffix is exact, so "val-core/minerva_math/acc/mean" stays a mean.
FRAMEWORK_KINDS: tuple[tuple[str, ReduceType, str], ...] = (
    ("perf/total_num_tokens", ReduceType.SUM, "siiRL and verl count as the tokens of every rank"),
    ("perf/max_memory_allocated_gb", ReduceType.MAX, "is the busiest rank's peak"),
    ("perf/max_memory_reserved_gb", ReduceType.MAX, "is the busiest rank's peak"),
    ("perf/time_per_step_max", ReduceType.MAX, "siiRL reduces as the slowest rank's step"),
    ("dapo_sampling/total_groups", ReduceType.SUM, "siiRL counts over every rank"),
    ("*_max", ReduceType.MAX, "siiRL reduces as a max (its *_max keys)"),
    ("*_min", ReduceType.MIN, "siiRL reduces as a min (its *_min keys)"),
    ("*_sum", ReduceType.SUM, "siiRL reduces as a sum (its *_sum keys)"),
    ("*_total", ReduceType.SUM, "siiRL reduces as a sum (its *_total keys)"),
)


def framework_kind(key: str) -> ReduceType | None:
    """Return the kind a framework defines for plain-dict ``key``, or None."""
    for pattern, kind, _ in FRAMEWORK_KINDS:
        if fnmatch.fnmatchcase(key, pattern):
            return kind
    return None


def framework_conflict(pattern: str, kind: ReduceType) -> str | None:
    """Return why a config rule ``pattern -> kind`` would change a framework key's meaning
    (a key of ``FRAMEWORK_KINDS`` it matches, with another kind), or None."""
    for framework, fkind, why in FRAMEWORK_KINDS:
        witness = framework.replace("*", "x")  # a key the framework entry covers
        if fkind is not kind and fnmatch.fnmatchcase(witness, pattern):
            return (f"{pattern!r} -> {kind.name.lower()} would cover {framework!r}, which "
                    f"{why}: {fkind.name.lower()}; a rule cannot change what a framework's "
                    f"key means (narrow the pattern)")
    return None


def kind_for_key(key: str, rules: Sequence[tuple[str, ReduceType]] = ()) -> ReduceType:
    """Return the reduce kind of a plain-dict key: the frameworks' meaning of the key
    (``FRAMEWORK_KINDS``), config rules, the exact last segment, else the mean."""
    kind = framework_kind(key)
    if kind is not None:
        return kind
    for pattern, kind in rules:
        if fnmatch.fnmatchcase(key, pattern):
            return kind
    return _SEGMENT_KINDS.get(key.rsplit("/", 1)[-1], ReduceType.AVG)


@functools.lru_cache(maxsize=65536)  # keys recur every step
def is_approximate_plain_key(key: str) -> bool:
    """Return True when a plain per-rank value of this key cannot be merged exactly."""
    return _APPROXIMATE_SEGMENT.match(key.rsplit("/", 1)[-1]) is not None


class KindResolver:
    """Resolve wire codes to kinds, caching the rule lookups of ``AUTO`` keys."""

    def __init__(self, rules: Mapping[str, ReduceType | str] | None = None) -> None:
        self._rules = [(p, ReduceType.parse(k)) for p, k in (rules or {}).items()]
        self._cache: Recent = Recent(100_000)

    def resolve(self, key: str, code: int) -> ReduceType:
        """Return the kind for ``key`` sent with wire ``code``."""
        if code != AUTO:
            return ReduceType(code)
        kind = self._cache.get(key)
        if kind is None:
            kind = self._cache[key] = kind_for_key(key, self._rules)
        return kind


class Renamer:
    """Apply prefix renames (e.g. ``timing_s/`` -> ``perf/delta_time/``) to output keys."""

    def __init__(self, renames: Mapping[str, str] | None = None) -> None:
        # Longest prefix first so that nested prefixes rename predictably.
        self._pairs = sorted((renames or {}).items(), key=lambda kv: -len(kv[0]))
        self._names: Recent = Recent(100_000)  # (key, kind, rules) -> renamed output names

    def exported(self, key: str, kind: ReduceType, rules: OutputRules) -> tuple[str, ...]:
        """The names a key recorded with ``kind`` is exported as, renamed."""
        got = self._names.get((key, kind, rules))
        if got is None:
            got = self._names[(key, kind, rules)] = tuple(
                self(n) for n in output_names(key, kind, rules))
        return got

    def __call__(self, key: str) -> str:
        for old, new in self._pairs:
            if key.startswith(old):
                return new + key[len(old) :]
        return key


@dataclass(frozen=True)
class OutputRules:
    """How merged records become exported numbers."""

    mean_suffix: str = "mean"
    quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)
    nonfinite: Literal["exclude", "propagate"] = "exclude"
    sketch: SketchSpec = SketchSpec()
    histogram_bins: int = 64  # of each QUANTILES key's merged histogram (0: none)


def population_std(row: np.ndarray) -> float:
    """Return the population std (divided by n) of a record with values."""
    return float(row[M2_ROOT]) / math.sqrt(float(row[COUNT]))


def population_var(row: np.ndarray) -> float:
    """Return the population variance (divided by n) of a record with values."""
    return float(row[M2_ROOT]) ** 2 / float(row[COUNT])


# ``finalise(row, mean, sketch, rules)``: a merged record's exported values (its mean given)
Finalise = Callable[[np.ndarray, float, "Sketch | None", OutputRules],
                    "tuple[float, ...] | None"]


def _quantiles(row: np.ndarray, m: float, sketch: Sketch | None,
               rules: OutputRules) -> tuple | None:
    if sketch is None:
        return None
    qs = quantiles(*sketch, rules.quantiles, rules.sketch, float(row[MIN]), float(row[MAX]))
    return None if qs is None else tuple(qs)


@dataclass(frozen=True)
class Kind:
    """Everything one reduce kind means, in one entry of ``KINDS``.

    Records of every kind merge the same way (sums, counts, squares and non-finite
    counts add; min of mins, max of maxes); ``sketch`` kinds also merge quantile
    buckets. ``suffixes`` are the exported names (``""``: the key itself), ``finalise``
    turns a merged record with at least one value into them; an empty population
    exports ``empty`` (None: nothing). ``weighted``: counts may be fractional weights.
    ``flag``: a meta entry naming the keys whose merged record it marks. ``strict``: a
    record that saw a NaN/inf exports NaN, whatever ``OutputRules.nonfinite``. ``extremes``: which
    of the record's min and max the last exported names are (in that order): where each
    came from is named in the step's ``meta["extremes"]``, and ``stat(ids=)`` accepts the kind.
    """

    suffixes: Callable[[OutputRules], tuple[str, ...]]
    finalise: Finalise
    sketch: bool = False
    empty: tuple[float, ...] | None = None
    weighted: bool = False
    flag: tuple[str, Callable[[np.ndarray], bool]] | None = None
    suffixes_vary: bool = False  # set by service config (the client cannot check them)
    strict: bool = False
    extremes: tuple[str, ...] = ()  # "min", "max": what the last exported names are


KINDS: dict[ReduceType, Kind] = {
    ReduceType.AVG_MIN_MAX: Kind(lambda r: (r.mean_suffix, "min", "max"),
                                 lambda row, m, _, r: (m, float(row[MIN]), float(row[MAX])),
                                 extremes=("min", "max")),
    ReduceType.AVG: Kind(lambda r: ("",), lambda row, m, _, r: (m,), weighted=True),
    ReduceType.SUM: Kind(lambda r: ("",), lambda row, m, _, r: (float(row[SUM]),),
                         empty=(0.0,)),
    ReduceType.MIN: Kind(lambda r: ("",), lambda row, m, _, r: (float(row[MIN]),),
                         extremes=("min",)),
    ReduceType.MAX: Kind(lambda r: ("",), lambda row, m, _, r: (float(row[MAX]),),
                         extremes=("max",)),
    ReduceType.SCALAR: Kind(lambda r: ("",), lambda row, m, _, r: (m,),
                            flag=("scalar_mismatch", lambda row: row[MIN] != row[MAX])),
    ReduceType.STD: Kind(lambda r: ("std",), lambda row, m, _, r: (population_std(row),)),
    ReduceType.QUANTILES: Kind(lambda r: tuple(quantile_name(q) for q in r.quantiles),
                               _quantiles, sketch=True, suffixes_vary=True),
    ReduceType.STRICT_AVG: Kind(lambda r: ("",), lambda row, m, _, r: (m,), weighted=True,
                                strict=True),
}
_missing = set(ReduceType) - set(KINDS)
if _missing:  # an enum member without its entry would fail at the first step instead
    raise RuntimeError(f"reduce kinds without a KINDS entry: {sorted(k.name for k in _missing)}")


@functools.lru_cache(maxsize=65536)  # keys recur every step
def output_names(key: str, kind: ReduceType, rules: OutputRules = OutputRules()) -> tuple[str, ...]:
    """Return the exported names of a key recorded with ``kind``."""
    return tuple(f"{key}/{s}" if s else key for s in KINDS[kind].suffixes(rules))


def finalize_row(
    row: Sequence[float],
    kind: ReduceType,
    sketch: Sketch | None = None,
    rules: OutputRules = OutputRules(),
    m: float | None = None,
) -> tuple[float, ...] | None:
    """Return the exported values of one merged record (a row, or its fields as a list),
    or None for an empty population. ``m``: its mean, if worked out already (``means``).

    SUM of an empty population is 0 (the empty sum); every other kind omits it.
    With ``rules.nonfinite == "propagate"``, or of a ``strict`` kind, a key that saw NaN/inf
    exports NaN.
    """
    spec = KINDS[kind]
    if row[NONFINITE] > 0 and (spec.strict or rules.nonfinite == "propagate"):
        return (math.nan,) * len(spec.suffixes(rules))
    if row[COUNT] <= 0:
        return spec.empty
    return spec.finalise(row, mean(row) if m is None else m, sketch, rules)


def means(data: np.ndarray) -> list[float]:
    """Each merged record's mean from its double-double sum, every row in one numpy pass:
    the same float operations as ``mean`` of each row (bit for bit); an empty row's is not
    a number, never read."""
    with np.errstate(all="ignore"):
        m, r = mean_parts(data[:, SUM], data[:, SUM_LO], data[:, COUNT], np)
        return np.where(np.isfinite(r), m + r, m).tolist()


# Where each exported value of the kinds that need no per-row work comes from, in the
# order of their suffixes: a column of the merged records, or "mean" (``means``).
VALUE_COLUMNS: dict[ReduceType, tuple[str | int, ...]] = {
    ReduceType.AVG_MIN_MAX: ("mean", MIN, MAX), ReduceType.AVG: ("mean",),
    ReduceType.SUM: (SUM,), ReduceType.MIN: (MIN,), ReduceType.MAX: (MAX,),
    ReduceType.SCALAR: ("mean",),
}


@dataclass(frozen=True)
class Exports:
    """What a set of keys exports, worked out once per key set and kinds (they recur every
    step): each exported name, in key order, with the row its value comes from and where in
    that row's values (``finalize_row``) it stands; ``columns``, where every kind reads its
    values from columns (``VALUE_COLUMNS``) and no name is exported twice, the column of
    each name, so a step's values are read a column at a time."""

    names: tuple[str, ...]
    rows: tuple[int, ...]
    positions: tuple[int, ...]
    kinds: tuple[ReduceType, ...]  # of every row
    columns: tuple[str | int, ...] | None

    @classmethod
    def of(cls, keys: Sequence[str], kinds: Sequence[ReduceType], rules: OutputRules,
           rename: Renamer | None = None, skip: Sequence[int] = ()) -> Exports:
        """The exports of ``keys`` recorded with ``kinds``, renamed, without rows ``skip``."""
        rename = rename or Renamer()
        left_out = set(skip)
        names, rows, positions, columns = [], [], [], []
        for i, (key, kind) in enumerate(zip(keys, kinds)):
            if i in left_out:
                continue
            exported = rename.exported(key, kind, rules)
            names.extend(exported)
            rows.extend([i] * len(exported))
            positions.extend(range(len(exported)))
            columns.extend(VALUE_COLUMNS.get(kind) or [None] * len(exported))
        plain = None not in columns and len(set(names)) == len(names)
        return cls(tuple(names), tuple(rows), tuple(positions), tuple(kinds),
                   tuple(columns) if plain else None)


def finalize(
    keys: Sequence[str],
    kinds: Sequence[ReduceType],
    data: np.ndarray,
    *,
    sketches: Mapping[int, Sketch] | None = None,
    rules: OutputRules = OutputRules(),
    rename: Renamer | None = None,
    collisions: dict[str, list[str]] | None = None,
    exports: Exports | None = None,
) -> dict[str, float]:
    """Return ``{output name: value}`` for merged records; empty populations are omitted.

    Two keys exporting one name never overwrite each other: the key first in
    alphabetical order keeps it, whatever order the keys arrived in, and ``collisions``
    (if given) receives ``{name: [keys exporting it, the one kept first]}``. ``exports``:
    ``Exports.of`` these keys (a caller that finalises the same keys every step keeps it).
    """
    exports = exports or Exports.of(keys, kinds, rules, rename)
    populated = data[:, COUNT] > 0
    plain = exports.columns is not None and bool(populated.all()) and not (
        rules.nonfinite == "propagate" and data[:, NONFINITE].any())
    if plain:  # every value read a column at a time: no per-key work
        cols = {"mean": means(data), MIN: data[:, MIN].tolist(), MAX: data[:, MAX].tolist(),
                SUM: data[:, SUM].tolist()}
        # each name's column, at its row (``map`` in C: no per-key Python frame)
        return dict(zip(exports.names, map(getitem, map(cols.__getitem__, exports.columns),
                                           exports.rows)))
    sketches = sketches or {}
    every = means(data)
    values: dict[int, tuple[float, ...] | None] = {}
    out: dict[str, float] = {}
    source: dict[str, str] = {}
    for name, row, position in zip(exports.names, exports.rows, exports.positions):
        if row not in values:
            values[row] = finalize_row(data[row].tolist(), exports.kinds[row],
                                       sketches.get(row), rules, every[row])
        found = values[row]
        if found is None:
            continue
        key, held = keys[row], source.get(name)
        if held is not None:
            if collisions is not None:
                collisions[name] = sorted({*collisions.get(name, [held]), key})
            if key < held:
                out[name], source[name] = found[position], key
            continue
        out[name], source[name] = found[position], key
    return out
