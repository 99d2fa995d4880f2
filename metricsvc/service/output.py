"""How a finished step becomes what readers and sinks see.

Kinds resolved (declared, else the frameworks' meaning of the key, the config's rules, the
key's last segment), records finalised and renamed, derived metrics evaluated over the
merged records, histograms of the sketched keys, where each min and max came from, what
the exported names mean (their declarations' help and unit, given to the sinks with the
first step that exports each), and the meta that flags what a user should not trust
blindly (non-finite values, overflow, missing contributors, approximations, collisions).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np

from metricsvc.core.declare import key_pattern, placeholders
from metricsvc.core.keys import is_internal, safe_tag, tag_order
from metricsvc.core.records import (
    COUNT,
    LOCATED,
    M2_ROOT,
    MAX,
    MIN,
    NONFINITE,
    NTOP,
    SIDE,
    SUM,
    Top,
    best_of,
    describe_source,
    winners,
)
from metricsvc.core.reduce import (
    AUTO,
    KINDS,
    Exports,
    KindResolver,
    OutputRules,
    ReduceType,
    Renamer,
    finalize,
    is_approximate_plain_key,
)
from metricsvc.core.sketch import histogram, quantile_name
from metricsvc.service.derive import Deriver, RunDeclarations
from metricsvc.service.steps import Merged, PendingStep

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class StepResult:
    """A finished step, as readers, sinks and the journal see it: exported metrics and
    what is known about how they were made."""

    step: int
    metrics: dict[str, float]
    meta: dict[str, Any]


@dataclass(frozen=True)
class KeyPlan:
    """What a step's key set means, worked out once while steps bring the same keys with
    the same codes (they recur every step): each key's kind, the rows of internal keys,
    the exported names whose min or max ``meta["extremes"]`` places (public keys, by key:
    ``(row, ((side, name), ...))``), the rows a kind's own check flags (``Kind.flag``), the
    plain keys whose per-rank values cannot merge exactly, and what the public keys export
    (``Exports``)."""

    kinds: list[ReduceType]
    internal: list[int]
    extremes: list[tuple[int, tuple[tuple[str, str], ...]]]
    flags: list[tuple[int, str, Callable[[np.ndarray], bool]]]
    approximate: list[str]
    exports: Exports


class StepOutput:
    """Finalise steps for the run: its output rules, renames, kinds and derivations."""

    def __init__(self, output: OutputRules, reduce_rules: Mapping[str, Any] | None,
                 renames: Mapping[str, str] | None, deriver: Deriver,
                 declarations: RunDeclarations, max_staleness: int | None = None,
                 tables: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.output = output
        self.max_staleness = max_staleness
        self.tables = Tables(tables)
        self.resolver = KindResolver(reduce_rules)
        self.rename = Renamer(renames)
        self.told = Told()
        self.tags = SinkTags(self.told)
        self._held_plan: tuple = ([], b"", None)  # keys, codes, their KeyPlan
        self.deriver = deriver
        self.declarations = declarations
        self.descriptions = Descriptions()

    def kinds(self, keys: Sequence[str], codes: Sequence[int]) -> list[ReduceType]:
        """Return the kind of each key sent with its wire code."""
        return [self.resolver.resolve(k, int(c)) for k, c in zip(keys, codes)]

    def plan(self, keys: list[str], codes: np.ndarray) -> KeyPlan:
        """The ``KeyPlan`` of a step's keys and their wire codes, kept while steps bring the
        same ones."""
        held = self._held_plan
        if held[2] is None or held[0] != keys or held[1] != codes.tobytes():
            held = self._held_plan = (list(keys), codes.tobytes(), self._make_plan(keys, codes))
        return held[2]

    def _make_plan(self, keys: list[str], codes: np.ndarray) -> KeyPlan:
        kinds = self.kinds(keys, codes)
        internal = internal_rows(keys)
        left_out = set(internal)
        extremes = []  # by key: a name two keys export is the first key's (``finalize``)
        for i in sorted((i for i, kind in enumerate(kinds)
                         if KINDS[kind].extremes and i not in left_out), key=keys.__getitem__):
            names = self.rename.exported(keys[i], kinds[i], self.output)
            sides = KINDS[kinds[i]].extremes
            extremes.append((i, tuple(zip(sides, names[-len(sides):]))))
        flags = [(i, flag[0], flag[1]) for i, kind in enumerate(kinds)
                 if (flag := KINDS[kind].flag) is not None]
        approximate = [k for k, c in zip(keys, codes.tolist())
                       if c == AUTO and is_approximate_plain_key(k)]
        return KeyPlan(kinds, internal, extremes, flags, approximate,
                       Exports.of(keys, kinds, self.output, self.rename, internal))

    def preview(self, window: Any) -> dict[str, float]:
        """Return what a stream window holds, as metrics (no derivation): what
        ``export_stream`` answers its caller."""
        keys = list(window.keys)
        merged = window.merged()
        kinds = self.kinds(keys, merged.codes)
        return finalize(keys, kinds, merged.data, sketches=merged.sketches, rules=self.output,
                        exports=Exports.of(keys, kinds, self.output, self.rename,
                                           internal_rows(keys)))

    def metrics(self, merged: Merged, keys: list[str], plan: KeyPlan,
                declared: Mapping[str, Any], collisions: dict[str, list[str]]) -> dict[str, float]:
        """Finalise the public keys; evaluate the ``declared`` derived metrics over every
        record (the internal ones are their inputs only).

        A name exported twice (two keys, a rename, a derived metric) keeps its first source
        and is listed in ``collisions``.
        """
        metrics = finalize(keys, plan.kinds, merged.data, sketches=merged.sketches,
                           rules=self.output, collisions=collisions, exports=plan.exports)
        if declared:  # (what the deriver says of a step is read only then)
            derived = self.deriver.derive(declared, keys, plan.kinds, merged.data, self.output)
            shown: dict[str, str] = {}  # name -> the derived metric shown under it
            for key, value in derived.items():
                name = self.rename(key)
                if name not in metrics:
                    metrics[name] = value
                    shown[name] = f"derived {key}"
                    continue
                exports = plan.exports  # else a key's value (the one key that exports it)
                kept = collisions.get(name) or [shown.get(name) or next(
                    keys[row] for exported, row in zip(exports.names, exports.rows)
                    if exported == name and merged.data[row, COUNT] > 0)]
                collisions[name] = [*kept, f"derived {key}"]
        return metrics

    def finish(self, p: PendingStep, merged: Merged, lagging: list[int]) -> StepResult:
        """The finished step ``p`` (``merged``: what ``p.finish`` made of it) as readers and
        sinks see it (``lagging``: the ranks closing each step behind the others)."""
        plan = self.plan(p.keys, merged.codes)
        collisions: dict[str, list[str]] = {}
        declared = self.declarations.of(p.declared) if p.declared else {}
        metrics = self.metrics(merged, p.keys, plan, declared, collisions)
        for name, (kept, *others) in collisions.items() if collisions else ():
            for other in others:  # a value left out: its rank hears it, once
                if (name, other) not in self.told:
                    self.told.say((name, other), p.step, left_out(name, kept, other))
        meta = merged.meta
        if p.stream_versions:  # the records' staleness: the step minus their versions
            for name, counts in p.stream_versions.items():
                metrics.update(staleness(name, p.step, counts, self.output))
                oldest = min(counts)
                if self.max_staleness is not None and p.step - oldest > self.max_staleness:
                    said = {"oldest_version": oldest, "staleness": p.step - oldest,
                            "bound": self.max_staleness}
                    meta.setdefault("staleness_over_bound", {})[name] = said
                    log.warning("step %d: stream %r holds records of version %d, %d versions "
                                "old (max_staleness %d)", p.step, name, oldest,
                                p.step - oldest, self.max_staleness)
        names = tuple(metrics)  # the names of the step before: the same answer
        hidden = self.tags.hidden if names == self.tags.names else self.tags.claim(names, p.step)
        if hidden:  # names that sinks which sanitise names leave out: another shows their tag
            collisions.update((tag, list(listed)) for tag, listed in hidden.items())
            meta["sink_tags"] = {tag: listed[0] for tag, listed in hidden.items()}
        starts = self.tables.starts
        for name in metrics if starts else ():
            if name.startswith(starts):  # a name a table may hold: the step's tables
                tables = self.tables.of(metrics)
                if tables:  # rows of exported values, for the sinks that show tables
                    meta["tables"] = tables
                break
        if self.deriver.totals:  # the running sums: a restart continues them
            meta["derived_totals"] = self.deriver.state()
        meta.update(_anomalies(p.keys, plan, merged, p.world_size))
        if merged.tops:  # stat(top=k): the k smallest and largest samples of every rank
            top = top_samples(plan, merged.tops, metrics)
            if top:
                meta["top"] = top
                meta.setdefault("tables", {}).update(
                    {f"top/{name}": top_table(name, rows) for name, rows in top.items()})
        # the rank (and sample) each exported min and max came from, each first NaN's
        if plan.extremes or "nonfinite" in meta:
            sources, first = self.extremes(p.keys, plan, merged, metrics)
            if sources:
                meta["extremes"] = sources
            if first:
                meta["nonfinite_first"] = first
        if merged.sketches and self.output.histogram_bins:
            histograms = self.histograms(p.keys, plan.kinds, merged)
            if histograms:
                meta["histograms"] = histograms
        if collisions:  # never overwritten: the first source kept, every source named
            meta["collisions"] = collisions
        if lagging:  # steps counted without step=, one behind the others
            meta["lagging_ranks"] = lagging
        if declared:
            if self.deriver.limited:  # the step's derivation budget ran out: the rest out
                meta["derived_limit"] = dict(self.deriver.limited)
            if self.deriver.undefined:  # inputs present, but no finite real value: omitted
                meta["derived_undefined"] = dict(self.deriver.undefined)
            first = self.declarations.fix(declared, p.step)
            if first:  # journaled once: a restart keeps the run's definitions
                meta["declarations"] = first
        if p.about or self.descriptions.unjournaled:
            about = self.descriptions.learn(p.about, p.step)
            if about:  # journaled once, too
                meta["about"] = about
        if self.descriptions.about:
            shown = self.descriptions.of(metrics, p.step)
            if shown:  # what the sinks show, with the first step that exports each name
                meta["descriptions"] = shown
        if plan.internal:
            ignored = self.deriver.unread(declared, [p.keys[i] for i in plan.internal])
            if ignored:
                meta["internal_ignored"] = ignored  # "__"-keys are never exported: say so
        return StepResult(p.step, metrics, meta)

    def extremes(self, keys: list[str], plan: KeyPlan, merged: Merged,
                 metrics: Mapping[str, float]) -> tuple[dict[str, dict[str, Any]], dict]:
        """Return where each exported min and max came from, by exported name, and where
        each key's first non-finite value came from, by key: the rank (or the stream)
        whose record holds it, and, where that rank's client was given ``ids=``, the
        sample's id, its position (``row``, ``col``), the ``call`` (and a non-finite
        value's ``kind``). The first part in merge order holding the value wins (ranks by
        number, then batches: ``records.winners``)."""
        parts = merged.parts
        ends = np.cumsum(np.fromiter(map(len, map(attrgetter("idx"), parts)), np.int64,
                                     len(parts)))  # each part's rows end there in ``rows``
        found = {}  # side -> each key's winning row, and the part it is in
        for side, won in zip(LOCATED, winners(merged.rows, merged.idx, merged.data)):
            found[side] = (won.tolist(), np.searchsorted(ends, won, side="right").tolist())
        out: dict[str, dict[str, Any]] = {}
        first: dict[str, dict[str, Any]] = {}
        todo = []  # (key row, side, name, where it goes)
        for i, sides in plan.extremes:
            for side, name in sides:
                if name in metrics:
                    todo.append((i, side, name, out))
        for i in np.flatnonzero(merged.data[:, NONFINITE] > 0).tolist():
            todo.append((i, "nonfinite", keys[i], first))
        for i, side, name, into in todo:
            row, part = found[side][0][i], found[side][1][i]
            if row < 0 or name in into:
                continue
            of = parts[part]
            where: dict[str, Any] = ({"rank": of.rank} if of.rank is not None
                                     else {"stream": of.order[1]})
            if of.sources is not None:  # its client gave ids: the sample, where known
                where.update(describe_source(of.sources[row - int(ends[part]) + len(of.idx)],
                                             side))
            into[name] = where
        return out, first

    def histograms(self, keys: list[str], kinds: list[ReduceType],
                    merged: Merged) -> dict[str, dict[str, Any]]:
        """Return the merged histogram of every public QUANTILES key of a step, by its
        (renamed) key: bin edges and counts, with the exact count, sum, sum of squares,
        min and max (what TensorBoard's histogram holds)."""
        data, bins = merged.data, self.output.histogram_bins
        out: dict[str, dict[str, Any]] = {}
        for i, sk in merged.sketches.items():
            if not KINDS[kinds[i]].sketch or is_internal(keys[i]) or data[i, COUNT] <= 0:
                continue
            row = data[i]
            hist = histogram(*sk, self.output.sketch, float(row[MIN]), float(row[MAX]), bins)
            if hist is not None:
                out[self.rename(keys[i])] = {
                    "edges": hist[0].tolist(), "counts": hist[1].tolist(),
                    "count": float(row[COUNT]), "sum": float(row[SUM]),
                    "sum_squares": _sum_squares(row), "min": float(row[MIN]),
                    "max": float(row[MAX])}
        return out


class SinkTags:
    """The name each sink tag shows for the run. Sinks that sanitise names (TensorBoard,
    MLflow, SwanLab, Trackio) give ``acc rate`` and ``acc_rate`` one tag: it shows the
    first name a step exported under it (of names one step brings together, the first in
    ``tag_order``) from then on, whichever of them a later step holds, so that its series
    is one metric's, and the ranks hear of each name it leaves out (``told``). A rewind
    before the step that gave a tag gives it afresh."""

    LIMIT = 100_000  # tags remembered; a step's new tags past it are decided by the step

    def __init__(self, told: Told) -> None:
        self._shown: dict[str, tuple[str, int]] = {}  # tag -> (its name, the step giving it)
        self.told = told
        # The last names claimed and the answer: the same for a step of the same names
        self.names: tuple[str, ...] | None = None
        self.hidden: dict[str, list[str]] = {}

    def claim(self, names: tuple[str, ...], step: int) -> dict[str, list[str]]:
        """Learn the tags of ``step``'s exported ``names``; return ``{tag: [the name it
        shows, the names of this step it leaves out]}`` where this step has such names."""
        if names == self.names:
            return self.hidden  # their tags are all given: the same answer
        by_tag: dict[str, list[str]] = {}
        for name in names:
            by_tag.setdefault(safe_tag(name), []).append(name)
        hidden = {}
        for tag, same in by_tag.items():
            held = self._shown.get(tag)
            shown = min(same, key=lambda n, t=tag: tag_order(n, t)) if held is None \
                else held[0]
            if held is None and len(self._shown) < self.LIMIT:
                self._shown[tag] = (shown, step)
            if len(same) > 1 or shown != same[0]:
                left_out = sorted((n for n in same if n != shown),
                                  key=lambda n, t=tag: tag_order(n, t))
                hidden[tag] = [shown, *left_out]
                for name in left_out:
                    if (tag, name) not in self.told:
                        self.told.say((tag, name), step, (
                            f"name {quoted(name)} shares the sink tag {quoted(tag)} with "
                            f"{quoted(shown)}: sinks show {quoted(shown)} under it (the first "
                            f"name the run showed under it; of names one step brings, the "
                            f"name written as its tag, else the first alphabetically); "
                            f"rename one"))
        self.names, self.hidden = names, hidden
        return hidden

    def forget_after(self, step: int) -> None:
        """A rewind to ``step``: the tags later steps gave are given afresh."""
        self._shown = {tag: held for tag, held in self._shown.items() if held[1] <= step}
        self.names = None


class Told:
    """What the ranks have heard of values a step leaves out (``collisions``: a second
    source of one exported name, a name a sink tag does not show), by ``(name or tag, the
    source left out)``: each once, from the first step that leaves it out. ``news``: what
    they have not heard yet (the engine tells every rank of that step). A restart does not
    say again what its journal left out (``restore``); a rewind's rerun says it afresh."""

    LIMIT = 100_000  # what is remembered; past it, nothing new is said

    def __init__(self) -> None:
        self._at: dict[tuple[str, str], int] = {}  # what was said -> the step that said it
        self.news: list[str] = []

    def __contains__(self, about: tuple[str, str]) -> bool:
        return about in self._at

    def say(self, about: tuple[str, str], step: int, message: str) -> None:
        """Have the ranks hear ``message`` about ``about``, unless they have."""
        if about not in self._at and len(self._at) < self.LIMIT:
            self._at[about] = step
            self.news.append(message)

    def take(self) -> str | None:
        """What the ranks have not heard yet, in one line (None: nothing); heard now."""
        news, self.news = self.news, []
        if not news:
            return None
        return "; ".join(news[:8]) + (f"; and {len(news) - 8} more" if len(news) > 8 else "")

    def restore(self, collisions: Mapping[str, list[str]], step: int) -> None:
        """A journaled step's ``collisions``: heard by the ranks already."""
        for name, listed in collisions.items():
            for other in listed[1:] if isinstance(listed, list) else ():
                self._at.setdefault((name, str(other)), step)

    def forget_after(self, step: int) -> None:
        """A rewind to ``step``: what later steps said is said afresh by their rerun."""
        self._at = {about: at for about, at in self._at.items() if at <= step}


def left_out(name: str, kept: str, other: str) -> str:
    """What a rank hears when ``other``'s value of the exported ``name`` is left out for
    ``kept``'s (each a key, or ``"derived <name>"``: ``StepOutput.metrics``)."""
    def source(s: str) -> str:
        return f"derived metric {quoted(s[8:])}" if s.startswith("derived ") \
            else f"key {quoted(s)}"

    return (f"{source(other)} exports the name {quoted(name)}, as {source(kept)} does: the step "
            f"shows {source(kept)}'s value under it, and leaves this one out (of sources one "
            f"step brings, the first key alphabetically; a derived metric yields to a key); "
            f"rename one")


def quoted(name: str) -> str:
    """``name`` as a message quotes it: whole up to 80 characters, else both ends (names
    past a sink tag's length differ at their ends) and its length."""
    if len(name) <= 80:
        return repr(name)
    return f"{name[:40]!r}...{name[-24:]!r} ({len(name)} characters)"


def _sum_squares(row: np.ndarray) -> float:
    """The sum of squares TensorBoard's histogram shows (a display figure, not an input)."""
    n = row[COUNT]
    with np.errstate(over="ignore"):  # past float64's range it is inf, as the value is
        return float(row[M2_ROOT] ** 2 + row[SUM] ** 2 / n) if n else 0.0


class Tables:
    """The tables a step carries (``meta["tables"]``), each built from the step's exported
    names: a row per binding of its ``rows`` pattern's placeholders, its columns those
    placeholders (whole numbers as ints) and its ``values``; rows in order, at most
    ``max_rows`` (``cut`` says how many more there were). ``series`` tells a sink which
    exported names the table carries (``core.declare.table_series``)."""

    def __init__(self, specs: Mapping[str, Mapping[str, Any]] | None) -> None:
        self.specs = {name: (key_pattern(f"{spec['rows']}/<value>"), placeholders(spec["rows"]),
                             list(spec["values"]), int(spec.get("max_rows", 10_000)))
                      for name, spec in (specs or {}).items()}
        # what every name a table holds starts with (the rows pattern up to its first
        # placeholder): a step with none of them has no table, found without a call
        self.starts = tuple(spec["rows"].partition("<")[0] for spec in (specs or {}).values())
        self._held: tuple[tuple[str, ...], dict[str, Any]] = ((), {})

    def of(self, metrics: Mapping[str, float]) -> dict[str, dict[str, Any]]:
        """The tables of a step's exported ``metrics`` (none: an empty dict)."""
        names = tuple(metrics)
        if self._held[0] != names:  # where each cell comes from, once per set of names
            self._held = (names, self._layout(names))
        out = {}
        for table, (columns, cells, cut, series) in self._held[1].items():
            rows = [[*row, *(None if n is None else metrics[n] for n in names_of)]
                    for row, names_of in cells]
            out[table] = {"columns": columns, "rows": rows, "series": series}
            if cut:
                out[table]["cut"] = cut
        return out

    def _layout(self, names: tuple[str, ...]) -> dict[str, Any]:
        layout = {}
        for table, (pattern, holes, values, max_rows) in self.specs.items():
            rows: dict[tuple, list[str | None]] = {}
            for name in names:
                binding = pattern.match(name)
                if binding is None or binding["value"] not in values:
                    continue
                row = tuple(int(binding[h]) if binding[h].isdigit() else binding[h]
                            for h in holes)
                rows.setdefault(row, [None] * len(values))[values.index(binding["value"])] = name
            if rows:
                ordered = sorted(rows.items(), key=lambda kv: [(isinstance(v, str), v)
                                                             for v in kv[0]])
                layout[table] = ([*holes, *values], ordered[:max_rows],
                                 max(0, len(ordered) - max_rows),
                                 {"pattern": pattern.text, "values": values})
        return layout


TOP_COLUMNS = ["value", "rank", "id", "row", "col", "call"]


def top_samples(plan: KeyPlan, tops: Sequence[tuple[int, np.ndarray, np.ndarray, tuple]],
                metrics: Mapping[str, float]) -> dict[str, list[dict[str, Any]]]:
    """``meta["top"]``: for each exported min and max of a key some rank recorded with
    ``stat(top=k)``, the k samples of the union of the ranks' (the smallest for a min, the
    largest for a max; ties to the lower rank, call, row, column), best first, each with
    its payload where its rank sent one (``text``, and ``text_cut`` where it was cut)."""
    texts: list[Any] = []  # every rank's payloads, in turn (a sample's column NTOP + 1)
    parts = []  # each rank's samples, with the rank and where their payloads are
    for rank, _, samples, text in tops:
        at = np.arange(len(texts), len(texts) + len(samples)) if text else \
            np.full(len(samples), -1)
        texts.extend(text)
        parts.append(np.column_stack([samples, np.full(len(samples), rank, np.float64), at]))
    every = np.concatenate(parts)
    key = np.concatenate([rows for _, rows, _, _ in tops])
    keep = best_of(every, key, every[:, NTOP])  # by key and side, the k of the union
    every, group = every[keep], 2 * key[keep] + every[keep, Top.SIDE].astype(np.int64)
    out: dict[str, list[dict[str, Any]]] = {}
    for i, sides in plan.extremes:
        for side, name in sides:
            if name not in metrics or name in out:
                continue
            first, end = np.searchsorted(group, (2 * i + SIDE[side], 2 * i + SIDE[side] + 1))
            if first < end:
                out[name] = [_top_sample(s, texts) for s in every[first:end]]
    return out


def _top_sample(s: np.ndarray, texts: list[Any]) -> dict[str, Any]:
    found: dict[str, Any] = {"value": float(s[Top.VALUE]), "rank": int(s[NTOP]),
                             "row": int(s[Top.ROW]), "col": int(s[Top.COL]),
                             "call": int(s[Top.CALL])}
    ident = float(s[Top.ID])
    if not math.isnan(ident):
        found["id"] = int(ident) if ident.is_integer() else ident
    text = texts[int(s[NTOP + 1])] if s[NTOP + 1] >= 0 else None
    if text is not None:
        found["text"] = text[0]
        if text[1]:
            found["text_cut"] = text[1]
    return found


def top_table(name: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``meta["tables"]`` entry of a name's top samples, with a ``text`` column where
    some sample has a payload (a dict's fields as JSON) (the sinks that draw tables show
    it; it holds no scalar: ``series`` matches no name)."""
    columns = TOP_COLUMNS + ["text"] * any("text" in s for s in samples)
    return {"columns": columns,
            "rows": [[s.get(c) if c != "text" or not isinstance(s.get(c), dict)
                      else json.dumps(s[c], ensure_ascii=False) for c in columns]
                     for s in samples],
            "series": {"pattern": f"top/{name}/<value>", "values": []}}


def staleness(name: str, step: int, counts: Mapping[int, int],
              rules: OutputRules) -> dict[str, float]:
    """``<name>/staleness/*`` of the records of stream ``name`` exported into ``step``:
    ``step`` minus each record's version, exactly from the counts per version: the mean,
    min, max and the configured quantiles (numpy's linear interpolation over every
    record, never a sketch)."""
    versions = np.array(sorted(counts), dtype=np.int64)
    weights = np.array([counts[v] for v in versions], dtype=np.float64)
    ages = (step - versions)[::-1].astype(np.float64)  # ascending
    weights = weights[::-1]
    n = weights.sum()
    out = {f"{name}/staleness/{rules.mean_suffix}": float(ages @ weights / n),
           f"{name}/staleness/min": float(ages[0]), f"{name}/staleness/max": float(ages[-1])}
    ends = np.cumsum(weights)  # records up to and including each age
    for q in rules.quantiles:
        h = (n - 1) * q  # the position among the records, in order
        low = ages[np.searchsorted(ends, np.floor(h) + 1)]
        high = ages[np.searchsorted(ends, np.ceil(h) + 1)]
        out[f"{name}/staleness/{quantile_name(q)}"] = float(low + (h - np.floor(h)) * (high - low))
    return out


def internal_rows(keys: list[str]) -> list[int]:
    """Return the rows of internal keys (a ``__`` path segment): derivation inputs only."""
    return [i for i, key in enumerate(keys) if is_internal(key)]


def _anomalies(keys: list[str], plan: KeyPlan, merged: Merged,
               world_size: int | None) -> dict[str, Any]:
    """Return the meta entries that flag values a user should not trust blindly."""
    data, contributors = merged.data, merged.contributors
    expected, from_stream = merged.expected, merged.from_stream
    out: dict[str, Any] = {}
    nonfinite = np.flatnonzero(data[:, NONFINITE] > 0)
    if nonfinite.size:
        out["nonfinite"] = {keys[i]: int(data[i, NONFINITE]) for i in nonfinite}
    overflow = np.flatnonzero((data[:, COUNT] > 0) & ~np.isfinite(data[:, [SUM, M2_ROOT]]).all(1))
    if overflow.size:  # finite values whose sum (or spread) left float64's range
        out["overflow"] = [keys[i] for i in overflow]
    want = np.where(expected > 0, expected, world_size or 0)
    off = np.flatnonzero((contributors != want) & ~from_stream)
    if off.size:
        out["contributors"] = {keys[i]: [int(contributors[i]), int(want[i])] for i in off}
    for i, name, marks in plan.flags:  # what a kind's own check marks (KINDS[kind].flag)
        if data[i, COUNT] > 0 and marks(data[i]):
            out.setdefault(name, []).append(keys[i])
    if plan.approximate:
        out["approximate"] = list(plan.approximate)
    return out


class Descriptions:
    """The run's descriptions, by declared name or key pattern (``timing_s/<stage>``)."""

    def __init__(self) -> None:
        self.about: dict[str, tuple[str, str]] = {}
        self._patterns: list[str] = []  # the names with ``<...>`` segments
        # Exported names given to the sinks (never again) and descriptions journaled, each
        # with the step whose meta holds it: a rewind before that step gives it again
        self._shown: dict[str, int] = {}
        self._journaled: dict[str, int] = {}
        self.unjournaled: set[str] = set()
        self._unknown: set[str] = set()  # exported names no description covered (yet)

    def learn(self, about: Mapping[str, Any], step: int) -> dict[str, list[str]]:
        """Keep what ``about`` says; return the entries to journal with ``step``: the new
        ones, and those a rewind took out of the latest segment."""
        new = {name: [str(text[0]), str(text[1])] for name, text in about.items()
               if tuple(text) != self.about.get(name)}
        if new:
            for name, (help_, unit) in new.items():
                self.about[name] = (help_, unit)
            self._patterns = [n for n in self.about if "<" in n]
            self._unknown.clear()  # names without a description may have one now
        for name in self.unjournaled:
            new.setdefault(name, list(self.about[name]))
        self.unjournaled.clear()
        self._journaled.update(dict.fromkeys(new, step))
        return new

    def restore(self, meta: Mapping[str, Any], step: int) -> None:
        """Continue from journaled ``step``'s ``meta`` (after a restart)."""
        about = meta.get("about")
        if isinstance(about, dict):
            self.learn({k: v for k, v in about.items()
                        if isinstance(v, list) and len(v) == 2}, step)
        shown = meta.get("descriptions")
        if isinstance(shown, dict):
            self._shown.update(dict.fromkeys(shown, step))

    def forget_after(self, step: int) -> None:
        """A rewind to ``step``: what later steps journaled or showed is given again."""
        self.unjournaled.update(n for n, at in self._journaled.items() if at > step)
        self._journaled = {n: at for n, at in self._journaled.items() if at <= step}
        self._shown = {n: at for n, at in self._shown.items() if at <= step}

    def of(self, names: Iterable[str], step: int) -> dict[str, dict[str, str]]:
        """Return ``{name: {"help", "unit"}}`` for each of ``names`` not given to the sinks
        before that a description covers: the name itself, or the key it exports
        (``key/mean``)."""
        out = {}
        for name in names:
            if name in self._shown or name in self._unknown:
                continue
            text = self._find(name)
            if text is None and "/" in name:
                text = self._find(name.rsplit("/", 1)[0])  # key/mean, key/p90, ...
            if text is None:
                self._unknown.add(name)
            else:
                self._shown[name] = step
                out[name] = {"help": text[0], "unit": text[1]}
        return out

    def _find(self, key: str) -> tuple[str, str] | None:
        text = self.about.get(key)
        if text is None:
            for pattern in self._patterns:
                if key_pattern(pattern).match(key) is not None:
                    return self.about[pattern]
        return text
