"""Metric declarations: what a metric is called, how it reduces, and what it means.

A ``Metric`` names a recorded key, its reduce kind, its help text and unit; it owns
the names the key exports (``/mean``, ``/min``, ...). A ``Derived`` metric is a
formula (``metricsvc.core.formula``) over the merged records of other keys, evaluated by
the service after every merge; it owns its one exported name. Declarations live
next to the code that records their inputs; the service knows no domain formula.

Inputs of a derived metric may be public keys (exported as well) or internal ones
(a path segment starting with ``__``: recorded only to be read by a formula, never
exported). An input holding ``*`` is a group: every key of the step it matches, ``*``
within one path segment (``moe/layer_0/expert_*/tokens``), read with ``sum_of_sums``,
``max_of_sums``, ``min_of_sums`` or ``size``.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from metricsvc.core.formula import Formula, parse
from metricsvc.core.keys import check_key, is_internal, safe_tag
from metricsvc.core.reduce import KINDS, OutputRules, ReduceType, output_names

MAX_DECLARATIONS = 20_000


MEAN_SUFFIXES = ("mean", "avg")  # the service's is configured: a client claims both


@dataclass(frozen=True)
class Metric:
    """A recorded metric: its key, reduce kind, help text and unit.

    The declaration owns the names the key exports: ``claims`` lists them (as written and
    as a sink tag), and a client refuses a second source of any of them. A ``<name>`` in
    the key stands for one path segment (``timing_s/<stage>``): a family of keys.
    """

    name: str
    kind: ReduceType = ReduceType.AVG_MIN_MAX
    help: str = ""
    unit: str = ""

    def __post_init__(self) -> None:
        check_key(self.name)
        key_pattern(self.name)
        object.__setattr__(self, "kind", ReduceType.parse(self.kind))

    def claims(self) -> tuple[str, ...]:
        """Return every name this metric may export, as written and as a sink tag (both
        mean suffixes; quantile names depend on the service's list: it checks those)."""
        return _claims(self.name, self.kind)

    def matches(self, key: str) -> bool:
        """Return True if ``key`` is this metric's key (or one of its family's)."""
        return key == self.name or ("<" in self.name and _in_group(key, self.name))


@functools.lru_cache(maxsize=65536)  # keys recur every step
def _claims(name: str, kind: ReduceType) -> tuple[str, ...]:

    if KINDS[kind].suffixes_vary:
        names: tuple[str, ...] = ()
    else:
        names = tuple(dict.fromkeys(n for suffix in MEAN_SUFFIXES
                                    for n in output_names(name, kind,
                                                          OutputRules(mean_suffix=suffix))))
    return tuple(dict.fromkeys(names + tuple(safe_tag(n) for n in names)))


@dataclass(frozen=True)
class Derived:
    """A metric computed after the merge: ``formula`` over the merged records of ``inputs``.

    ``inputs`` maps each name the formula reads to a recorded key, or a key pattern with
    ``*`` (a group: every key it matches). A name with ``<name>`` segments declares a
    family: each binding of its placeholders found in the step's keys (through the input
    that holds them all) is one metric, e.g. ``timing_per_token_ms/<stage>``.

    Raises:
        ValueError: a bad name, formula or input (the metric and the rule are named).
    """

    name: str
    formula: str
    inputs: Mapping[str, str] = field(default_factory=dict)
    # What it means: shown by the sinks that can (not part of the definition a run fixes)
    help: str = field(default="", compare=False)
    unit: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        try:
            check_key(self.name)
            if is_internal(self.name):
                raise ValueError("a derived metric is exported: its name cannot have a "
                                 "segment starting with '__'")
            parsed = parse(self.formula)
            inputs = dict(self.inputs)
            missing = sorted(parsed.symbols - set(inputs))
            if missing:
                raise ValueError(f"formula {self.formula!r} reads {missing}, which "
                                 f"inputs= does not map to keys")
            key_pattern(self.name)
            for symbol, key in inputs.items():
                if not isinstance(symbol, str) or not symbol.isidentifier():
                    raise ValueError(f"input name {symbol!r} is not an identifier")
                check_key(key)
                key_pattern(key)
            wanted = set(placeholders(self.name))
            if wanted and self.anchor(inputs) is None:
                raise ValueError(f"the placeholders {sorted(wanted)} of the name must all "
                                 f"appear in one input without '*' (the keys that bind them)")
            unbound = {p for k in inputs.values() for p in placeholders(k)} - wanted
            if unbound:
                raise ValueError(f"inputs use placeholders {sorted(unbound)} the name does "
                                 f"not have")
        except (TypeError, ValueError) as err:
            raise type(err)(f"derived metric {self.name!r}: {err}") from None
        object.__setattr__(self, "inputs", dict(sorted(inputs.items())))

    @property
    def parsed(self) -> Formula:
        return parse(self.formula)

    @property
    def templated(self) -> bool:
        """True for a family of metrics: ``<name>`` segments bound from recorded keys."""
        return "<" in self.name and bool(placeholders(self.name))

    def anchor(self, inputs: Mapping[str, str] | None = None) -> str | None:
        """Return the input key (no ``*``) holding every placeholder of the name: the keys
        of a step it matches bind the placeholders, one metric per binding."""
        wanted = set(placeholders(self.name))
        for key in sorted((inputs if inputs is not None else self.inputs).values()):
            if "*" not in key and wanted <= set(placeholders(key)):
                return key
        return None

    def under(self, prefix: str) -> Derived:
        """Return this declaration with its name and input keys under ``prefix``."""
        if not prefix:
            return self
        return Derived(prefix + self.name, self.formula,
                       {s: prefix + k for s, k in self.inputs.items()}, self.help, self.unit)

    def claims(self) -> tuple[str, ...]:
        """Return the name this metric exports, as written and as a sink tag (a family's
        names are known only once bound: the service checks those)."""
        if self.templated:
            return ()
        return tuple(dict.fromkeys((self.name, safe_tag(self.name))))

    def matches(self, key: str) -> bool:
        """Return True if ``key`` is this metric's name (or one of its family's)."""
        return key == self.name or (self.templated and _in_group(key, self.name))

    def reads(self, key: str) -> bool:
        """Return True if ``key`` is one of this metric's inputs (or in one of its groups)."""
        return any(key == k or (("*" in k or "<" in k) and _in_group(key, k))
                   for k in self.inputs.values())

    def wire(self) -> list[Any]:
        """Return the part of the declaration the service needs, as JSON-ready lists."""
        return [self.name, self.formula, sorted(self.inputs.items())]


_PLACEHOLDER = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)>")


def placeholders(text: str) -> list[str]:
    """Return the ``<name>`` placeholders of a key template, in order."""
    return _PLACEHOLDER.findall(text)


class KeyPattern:
    """A key pattern: ``*`` (any text, possibly none) and ``<name>`` (one or more
    characters, the same value wherever the name repeats) within one path segment.

    Matched segment by segment with ``str`` operations, in time linear in the key for a
    segment with one wildcard (a ``*`` run is matched greedily, leftmost first): no
    regular expression, so no pattern can make a match backtrack. A segment holds at most
    one ``<name>``, and then no ``*`` (its binding would be ambiguous).

    Raises:
        ValueError: a segment breaks that rule.
    """

    def __init__(self, pattern: str) -> None:
        self.text = pattern
        cut = min((i for i in (pattern.find("*"), pattern.find("<")) if i >= 0),
                  default=len(pattern))
        self.prefix = pattern[:cut]  # the literal text every matching key starts with
        self._segments: list[tuple] = []
        for seg in pattern.split("/"):
            names = placeholders(seg)
            if len(names) > 1 or (names and "*" in seg):
                raise ValueError(f"key pattern {pattern!r}: segment {seg!r} may hold one "
                                 f"<name>, or '*'s, not both and not two names")
            if names:
                head, tail = seg.split(f"<{names[0]}>", 1)
                self._segments.append(("bind", head, names[0], tail))
            elif "*" in seg:
                self._segments.append(("glob", tuple(seg.split("*"))))
            else:
                self._segments.append(("literal", seg))

    def match(self, key: str) -> dict[str, str] | None:
        """Return the placeholders' values if ``key`` matches (``{}`` without any), else
        None."""
        parts = key.split("/")
        if len(parts) != len(self._segments):
            return None
        binding: dict[str, str] = {}
        for part, seg in zip(parts, self._segments):
            if seg[0] == "literal":
                if part != seg[1]:
                    return None
            elif seg[0] == "glob":
                if not _glob(part, seg[1]):
                    return None
            else:
                _, head, name, tail = seg
                if (len(part) <= len(head) + len(tail) or not part.startswith(head)
                        or not part.endswith(tail)):
                    return None
                value = part[len(head):len(part) - len(tail)]
                if binding.setdefault(name, value) != value:
                    return None
        return binding


def _glob(text: str, pieces: tuple[str, ...]) -> bool:
    """Whether ``text`` is ``pieces`` joined by runs of any text (a ``*`` glob): the
    first piece a prefix, the last a suffix, the rest found leftmost in order."""
    first, *middle, last = pieces
    end = len(text) - len(last)
    if end < len(first) or not text.startswith(first) or not text.endswith(last):
        return False
    pos = len(first)
    for piece in middle:
        found = text.find(piece, pos, end)
        if found < 0:
            return False
        pos = found + len(piece)
    return True


@functools.lru_cache(maxsize=4096)
def key_pattern(pattern: str) -> KeyPattern:
    """Return the (cached) ``KeyPattern`` of ``pattern``."""
    return KeyPattern(pattern)


def fill(template: str, binding: Mapping[str, str]) -> str:
    """Return ``template`` with each ``<name>`` replaced by its value in ``binding``."""
    return _PLACEHOLDER.sub(lambda m: binding[m.group(1)], template)


def _in_group(key: str, pattern: str) -> bool:
    return key_pattern(pattern).match(key) is not None


MAX_ABOUT_CHARS = 1000  # a help text or unit


def encode_derived(declarations: Iterable[Derived],
                   about: Mapping[str, list[str]] | None = None) -> bytes:
    """Return declarations in their wire form (UTF-8 JSON; empty for none): the list of
    derived metrics, or with ``about`` (what declared names mean: ``{name: [help, unit]}``,
    sent once) the object ``{"derived": [...], "about": {...}}``."""
    items: Any = [d.wire() for d in declarations]
    if about:
        items = {"derived": items, "about": dict(about)}
    return json.dumps(items, separators=(",", ":")).encode("utf-8") if items else b""


@functools.lru_cache(maxsize=256)  # ranks send the same declarations every step
def decode_declarations(blob: bytes) -> tuple[tuple[Derived, ...], dict[str, tuple[str, str]]]:
    """Return the declarations a batch carries, each checked as the client checked it, and
    what declared names mean (``{name or key pattern: (help, unit)}``).

    Raises:
        ValueError: malformed, or a declaration breaks a rule (it is named).
    """
    if not blob:
        return (), {}
    try:
        items = json.loads(bytes(blob).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"malformed derived-metric declarations: {err}") from None
    about = {}
    if isinstance(items, dict):
        if set(items) != {"derived", "about"} or not isinstance(items["about"], dict):
            raise ValueError("malformed declarations: expected {\"derived\": [...], "
                             "\"about\": {name: [help, unit]}}")
        about = _about(items["about"])
        items = items["derived"]
    if not isinstance(items, list) or len(items) > MAX_DECLARATIONS:
        raise ValueError(f"malformed derived-metric declarations: expected a list of at most "
                         f"{MAX_DECLARATIONS}")
    out = []
    for item in items:
        if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[2], list)
                or not all(isinstance(p, list) and len(p) == 2 for p in item[2])):
            raise ValueError(f"malformed derived-metric declaration {str(item)[:200]}")
        name, formula, inputs = item
        if not isinstance(name, str) or not isinstance(formula, str):
            raise ValueError(f"malformed derived-metric declaration {str(item)[:200]}")
        out.append(Derived(name, formula, {s: k for s, k in inputs}))
    return tuple(out), about


def _about(items: dict[Any, Any]) -> dict[str, tuple[str, str]]:
    if len(items) > MAX_DECLARATIONS:
        raise ValueError(f"malformed declarations: more than {MAX_DECLARATIONS} descriptions")
    out = {}
    for name, text in items.items():
        check_key(name)
        key_pattern(name)
        if (not isinstance(text, list) or len(text) != 2
                or not all(isinstance(t, str) and len(t) <= MAX_ABOUT_CHARS for t in text)):
            raise ValueError(f"the description of {name!r} must be [help, unit], two strings "
                             f"of at most {MAX_ABOUT_CHARS} characters")
        out[name] = (text[0], text[1])
    return out


class KeyIndex:
    """The keys of one step, sorted, to resolve group inputs by their literal prefix."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.rows: dict[str, int] = {key: i for i, key in enumerate(keys)}
        self._groups: dict[str, list[int]] = {}  # patterns recur across declarations

    @functools.cached_property
    def sorted(self) -> list[str]:
        """The keys in order: sorted only when a pattern is first resolved."""
        return sorted(self.rows)

    def resolve(self, key: str) -> int | list[int] | None:
        """Return the row of ``key``, the rows of a group pattern (in key order), or None."""
        if "*" not in key:
            return self.rows.get(key)
        rows = self._groups.get(key)
        if rows is None:
            rows = self._groups[key] = [self.rows[k] for k in self.matching(key)]
        return rows

    def matching(self, pattern: str) -> list[str]:
        """Return the keys ``pattern`` matches (``*`` and ``<name>`` within a segment)."""
        group = key_pattern(pattern)
        start = bisect.bisect_left(self.sorted, group.prefix)
        out = []
        for k in self.sorted[start:]:
            if not k.startswith(group.prefix):
                break
            if group.match(k) is not None:
                out.append(k)
        return out


def table_series(series: Mapping[str, Any]) -> Callable[[str], bool]:
    """Whether an exported name is one a step's table carries (its ``series``: the rows'
    ``pattern`` with a last ``<value>`` segment, and the ``values`` that segment takes)."""
    pattern, values = key_pattern(series["pattern"]), frozenset(series["values"])

    def carried(name: str) -> bool:
        binding = pattern.match(name)
        return binding is not None and binding.get("value") in values

    return carried
