"""Reduce kinds: the plain-dict rule table (never substrings) and finalisation."""

import math

import numpy as np
import pytest

from metricsvc.core import records
from metricsvc.core.reduce import (
    KindResolver,
    OutputRules,
    ReduceType,
    Renamer,
    finalize,
    is_approximate_plain_key,
    kind_for_key,
)
from tests.helpers import merge_two

RULE_TABLE = [
    # the siiRL pitfall: "min" is a substring of "minerva", this key is still a mean
    ("val-core/minerva_math/acc/mean", ReduceType.AVG),
    ("critic/score/min", ReduceType.MIN),
    ("critic/score/max", ReduceType.MAX),
    ("critic/maximum_thing", ReduceType.AVG),
    ("perf/total_num_tokens", ReduceType.SUM),  # a framework's key: siiRL and verl sum it
    ("perf/total_num_tokens_seen", ReduceType.AVG),  # "total" inside a name is no sum
    ("tokens/total", ReduceType.SUM),
    ("reward/sum", ReduceType.SUM),
    ("samples/count", ReduceType.SUM),
    ("loss/avg", ReduceType.AVG),
    ("actor/lr", ReduceType.AVG),
    ("summary", ReduceType.AVG),
    ("x/min/y", ReduceType.AVG),
]


@pytest.mark.parametrize(("key", "kind"), RULE_TABLE)
def test_plain_key_kind_comes_from_exact_last_segment(key, kind):
    assert kind_for_key(key) is kind


def test_config_rules_win_over_the_last_segment():
    rules = [("timing_s/*", ReduceType.MAX)]
    assert kind_for_key("timing_s/gen", rules) is ReduceType.MAX
    assert kind_for_key("timing_s/gen/mean", rules) is ReduceType.MAX
    assert kind_for_key("other/mean", rules) is ReduceType.AVG


def test_resolver_passes_explicit_kinds_and_resolves_auto():
    r = KindResolver({"a/*": "sum"})
    assert r.resolve("a/x", 0) is ReduceType.SUM
    assert r.resolve("a/x", int(ReduceType.MAX)) is ReduceType.MAX
    assert r.resolve("b/min", 0) is ReduceType.MIN


def test_reduce_type_parse_accepts_names_aliases_and_rejects_unknown():
    assert ReduceType.parse("mean") is ReduceType.AVG is ReduceType.MEAN
    assert ReduceType.parse("AVG_MIN_MAX") is ReduceType.AVG_MIN_MAX
    with pytest.raises(ValueError, match="unknown reduce kind 'median'"):
        ReduceType.parse("median")


def test_approximate_plain_keys_are_recognised():
    assert is_approximate_plain_key("lat/p95") and is_approximate_plain_key("x/std")
    assert is_approximate_plain_key("x/median") and not is_approximate_plain_key("x/mean")


def _rows(*arrays):
    return np.stack([records.summarize_array(np.asarray(a, dtype=float)) for a in arrays])


def test_finalize_exports_names_per_kind_and_omits_empty_populations():
    data = _rows([1, 2, 3], [4, 6], [], [1, 3], [], [2, 2])
    kinds = [ReduceType.AVG_MIN_MAX, ReduceType.STD, ReduceType.AVG, ReduceType.SUM,
             ReduceType.SUM, ReduceType.SCALAR]
    out = finalize(["a", "b", "c", "d", "e", "f"], kinds, data,
                   rules=OutputRules(mean_suffix="avg"))
    assert out == {"a/avg": 2.0, "a/min": 1.0, "a/max": 3.0, "b/std": 1.0, "d": 4.0,
                   "e": 0.0, "f": 2.0}


def test_every_rows_mean_at_once_is_each_rows_mean_bit_for_bit():
    """``finalize`` takes every record's mean in one numpy pass: the same float operations
    as ``records.mean`` of each row, across magnitudes (far from 0, tiny, huge), with the
    double-double low part, fractional weights and empty rows among them."""
    from metricsvc.core.reduce import means

    rng = np.random.default_rng(5)
    rows = []
    for _ in range(400):
        n = int(rng.integers(1, 50))
        scale = 10.0 ** rng.uniform(-300, 290)  # with the offsets: finite
        x = scale * (rng.normal(size=n) + rng.choice([0.0, 1e8, -1e12]))
        rows.append(records.summarize_array(x))
    data = np.stack(rows + [records.identity(1)[0]])
    both = merge_two(data[:200], data[200:400])  # low parts from exact merges
    data = np.concatenate([data, both])
    data[::7, records.COUNT] *= 0.37  # weights (AVG of fractional counts)
    got = means(data)
    for row, m in zip(data, got):
        if row[records.COUNT] > 0:
            assert m == records.mean(row) or (math.isnan(m) and math.isnan(records.mean(row)))
    out = finalize([f"k{i}" for i in range(len(data))], [ReduceType.AVG] * len(data), data)
    assert [out.get(f"k{i}") for i in range(len(data))] == [
        records.mean(row) if row[records.COUNT] > 0 else None for row in data]


def test_std_is_population_std_of_all_values():
    x = np.array([0.5, 1.5, 2.0, 9.0, -3.0])
    out = finalize(["s"], [ReduceType.STD], _rows(x))
    assert math.isclose(out["s/std"], float(np.std(x)), rel_tol=1e-12)


def test_renamer_rewrites_prefixes_longest_first():
    r = Renamer({"timing_s/": "perf/delta_time/", "timing_s/gen": "gen_time"})
    assert r("timing_s/ref") == "perf/delta_time/ref"
    assert r("timing_s/gen") == "gen_time"
    assert r("other") == "other"


def test_a_kinds_table_entry_is_the_one_place_a_kind_is_defined(monkeypatch):
    """Names, values, batch checks and the client's name claims all read KINDS: changing
    an entry changes every one of them (here STD exporting ``/sd`` as a variance)."""
    import numpy as np

    from metricsvc.client import buffer
    from metricsvc.core import reduce
    from metricsvc.core.records import summarize_array

    def clear():
        reduce.output_names.cache_clear()
        buffer.exported_names.cache_clear()

    clear()
    monkeypatch.setitem(reduce.KINDS, reduce.ReduceType.STD, reduce.Kind(
        lambda r: ("sd",), lambda row, m, _, r: (reduce.population_var(row),)))
    try:
        row = summarize_array(np.array([1.0, 3.0]))
        assert reduce.output_names("k", reduce.ReduceType.STD) == ("k/sd",)
        assert reduce.finalize(["k"], [reduce.ReduceType.STD], row[None]) == {
            "k/sd": pytest.approx(1.0, rel=1e-15)}
        assert "k/sd" in buffer.exported_names("k", int(reduce.ReduceType.STD))
    finally:
        monkeypatch.undo()
        clear()
    assert reduce.output_names("k", reduce.ReduceType.STD) == ("k/std",)


def test_every_reduce_kind_has_its_table_entry():
    from metricsvc.core.reduce import KINDS, ReduceType

    assert set(KINDS) == set(ReduceType)
