"""Derived metrics: declarations checked where they are made, formulas evaluated over merged
records by a service that knows no domain formula."""

import re

import numpy as np
import pytest

from metricsvc.core import records
from metricsvc.core.declare import Derived, decode_declarations, encode_derived
from metricsvc.core.formula import parse
from metricsvc.core.keys import is_internal
from metricsvc.core.reduce import OutputRules, ReduceType
from metricsvc.service.derive import Deriver
from tests.helpers import summed_batch

RULES = OutputRules()


def derive(deriver, declared, recs):
    keys = list(recs)
    kinds = [recs[k][0] for k in keys]
    data = np.stack([recs[k][1] for k in keys]) if keys else records.identity(0)
    return deriver.derive({d.name: d for d in declared}, keys, kinds, data, RULES)


def rec(values, kind=ReduceType.SUM):
    return kind, records.summarize_array(np.asarray(values, dtype=float))


def test_internal_keys_are_those_with_a_double_underscore_segment():
    assert is_internal("critic/__ev/residual") and is_internal("__perf/x")
    assert not is_internal("plain/key") and not is_internal("a/__/b")
    assert not is_internal("loss__count") and not is_internal("a/b__c")


def test_a_ratio_of_values_is_omitted_where_its_denominator_is_zero_or_missing():
    ratio = [Derived(n, "value(num) / value(den)", {"num": f"{n}/__num", "den": f"{n}/__den"})
             for n in ("a", "b", "c")]
    out = derive(Deriver(), ratio, {
        "a/__num": rec([2.0, 4.0]), "a/__den": rec([3.0], ReduceType.MAX),
        "b/__num": rec([1.0]),
        "c/__num": rec([1.0]), "c/__den": rec([0.0]),
    })
    assert out == {"a": 2.0}


def test_explained_variance_declared_by_the_client_uses_unbiased_merged_variances():
    from metricsvc.client.metrics.data import EXPLAINED_VARIANCE as ev

    returns, residual = np.array([1.0, 2.0, 4.0, 7.0]), np.array([0.5, -0.5, 0.2, 0.1])
    out = derive(Deriver(), [ev], {"critic/returns": rec(returns, ReduceType.AVG_MIN_MAX),
                                   "critic/__vf_explained_var/residual": rec(residual)})
    expected = 1 - residual.var(ddof=1) / (returns.var(ddof=1) + 1e-5)
    assert out == {"critic/vf_explained_var": pytest.approx(expected, rel=1e-12)}
    single = derive(Deriver(), [ev], {"critic/returns": rec([1.0]),
                                      "critic/__vf_explained_var/residual": rec([0.0])})
    assert single == {}  # a variance of one value is undefined: omitted, not invented


def test_running_totals_continue_across_steps_and_after_a_restart():
    from metricsvc.client.metrics.timing import train_perf

    declared = train_perf("tp")
    d = Deriver()
    for tokens in (100.0, 300.0):
        out = derive(d, declared, {"tp/tokens": rec([tokens]),
                                   "tp/seconds": rec([2.0], ReduceType.MAX)})
    assert out == {"tp/tokens_per_second": 150.0, "tp/total_tokens": 400.0,
                   "tp/total_seconds": 4.0, "tp/cumulative_tokens_per_second": 100.0}
    restarted = Deriver()
    restarted.restore(d.state())
    out = derive(restarted, declared, {"tp/tokens": rec([100.0]),
                                       "tp/seconds": rec([1.0], ReduceType.MAX)})
    assert out["tp/total_tokens"] == 500.0 and out["tp/total_seconds"] == 5.0


def test_a_total_keeps_counting_a_step_whose_whole_formula_is_undefined():
    rate = Derived("rate", "total(value(t)) / total(value(s))", {"t": "t", "s": "s"})
    d = Deriver()
    assert derive(d, [rate], {"t": rec([10.0]), "s": rec([0.0])}) == {}  # 10 / 0
    assert derive(d, [rate], {"t": rec([10.0]), "s": rec([4.0])}) == {"rate": 5.0}


def test_group_inputs_read_every_key_they_match_within_one_segment():
    from metricsvc.client.metrics.moe import moe_balance

    declared = moe_balance("moe")
    recs = {f"moe/layer_0/expert_{e}/tokens": rec([float(t)]) for e, t in enumerate((1, 2, 5))}
    recs["moe/layer_0/expert_9/other/tokens"] = rec([100.0])  # another segment: not matched
    out = derive(Deriver(), declared, recs)
    assert out == {"moe/layer_0/expert_0/load_percent": 12.5,
                   "moe/layer_0/expert_1/load_percent": 25.0,
                   "moe/layer_0/expert_2/load_percent": 62.5,
                   "moe/layer_0/max_over_ideal": 5 / (8 / 3)}
    empty = derive(Deriver(), declared, {k: rec([0.0]) for k in list(recs)[:3]})
    assert empty["moe/layer_0/max_over_ideal"] == 0.0  # an empty layer: 0, as documented
    two = derive(Deriver(), declared, {f"moe/layer_{layer}/expert_{e}/tokens": rec([1.0 + e])
                                       for layer in (0, 7) for e in range(2)})
    assert two == {f"moe/layer_{layer}/{name}": value for layer in (0, 7) for name, value in
                   (("expert_0/load_percent", 100 / 3), ("expert_1/load_percent", 200 / 3),
                    ("max_over_ideal", 2 / 1.5))}  # two declarations, every layer and expert


def test_one_deriver_over_steps_whose_keys_and_declarations_change_derives_each_afresh():
    """The service's deriver keeps what it works out from a step's keys while they recur:
    a step with more, fewer or other keys, or other declarations, derives as a new deriver
    would (layers appearing and going, a declaration dropped)."""
    from metricsvc.client.metrics.moe import moe_balance

    declared = moe_balance("moe")
    ratio = Derived("r", "sum(a) / sum(b)", {"a": "x/a", "b": "x/b"})
    other = Derived("q", "sum(b) / sum(a)", {"a": "x/a", "b": "x/b"})
    layers = [(0,), (0, 7), (0, 7), (7,), (7,), ()]
    kept = Deriver()
    for step, held in enumerate(layers):
        recs = {f"moe/layer_{layer}/expert_{e}/tokens": rec([1.0 + e + step])
                for layer in held for e in range(2)}
        recs.update({"x/a": rec([3.0 + step]), "x/b": rec([2.0])})
        # the same declarations two steps running, then others (more, then as many)
        decls = [declared, [*declared, ratio], [*declared, other]][step // 2]
        assert derive(kept, decls, recs) == derive(Deriver(), decls, recs), step


def test_a_templated_declaration_binds_its_placeholders_from_the_recorded_keys():
    from metricsvc.client.metrics.timing import PER_TOKEN_MS

    recs = {f"__timing_per_token_ms/{stage}/{part}": rec([v])
            for stage, ms, tokens in (("gen", 500.0, 100.0), ("ref", 90.0, 30.0))
            for part, v in (("ms", ms), ("tokens", tokens))}
    recs["__timing_per_token_ms/odd/ms"] = rec([1.0])  # no tokens: undefined, omitted
    assert derive(Deriver(), [PER_TOKEN_MS], recs) == {"timing_per_token_ms/gen": 5.0,
                                                       "timing_per_token_ms/ref": 3.0}
    with pytest.raises(ValueError, match="placeholders \\['s'\\] of the name must all appear"):
        Derived("a/<s>", "mean(x)", {"x": "a/*/x"})
    with pytest.raises(ValueError, match="inputs use placeholders \\['t'\\]"):
        Derived("a/<s>", "mean(x) + mean(y)", {"x": "a/<s>/x", "y": "b/<t>"})


@pytest.mark.parametrize("formula, message", [
    ("x", "must be read through a statistic"),
    ("__import__('os')", "unknown function"),
    ("mean(x).real", "Attribute is not allowed"),
    ("mean(x) if 1 else 2", "IfExp is not allowed"),
    ("mean(x, y)", "takes one input name"),
    ("'text'", "only numbers"),
    ("mean(x) +", "not an expression"),
    ("total(total(mean(x)))", "cannot hold another total"),
    ("mean(y)", "reads \\['y'\\], which inputs= does not map"),
])
def test_a_bad_declaration_is_refused_naming_the_metric_and_the_rule(formula, message):
    with pytest.raises(ValueError, match=f"derived metric 'out': .*{message}"):
        Derived("out", formula, {"x": "k"})


def test_declarations_travel_as_data_and_are_checked_again_on_receipt():
    ev = Derived("a/ev", "1 - sample_var(r) / (sample_var(t) + 1e-5)",
                 {"r": "a/__ev/r", "t": "a/t"})
    assert decode_declarations(encode_derived([ev]))[0] == (ev,)
    with pytest.raises(ValueError, match="derived metric 'x': .*unknown function 'open'"):
        decode_declarations(b'[["x", "open(a)", [["a", "k"]]]]')
    with pytest.raises(ValueError, match="malformed"):
        decode_declarations(b'{"x": 1}')


def test_formulas_are_parsed_once_and_their_inputs_listed():
    f = parse("div0(100 * sum(e), sum_of_sums(layer)) + std(e)")
    assert f.symbols == {"e", "layer"} and parse("div0(100 * sum(e), sum_of_sums(layer)) + "
                                                 "std(e)") is f


def test_the_service_evaluates_what_ranks_declare_and_refuses_a_bad_declaration():
    from metricsvc.errors import BatchRejected
    from metricsvc.service.engine import Engine as Aggregator

    agg = Aggregator(world_size=2)
    share = Derived("a/share", "sum(a) / (sum(a) + sum(b))", {"a": "a/__n", "b": "a/__m"})
    with pytest.raises(BatchRejected, match="derived metric 'x': .*unknown function 'open'"):
        agg.submit(summed_batch(0, b'[["x", "open(a)", [["a", "k"]]]]', **{"a/__n": [1.0]}))
    agg.submit(summed_batch(0, encode_derived([share]),
                            **{"a/__n": [1.0, 2.0], "a/__m": [1.0], "a/__stray": [5.0]}))
    (done,) = agg.submit(summed_batch(1, encode_derived([share]),
                                      **{"a/__n": [3.0], "a/__m": [3.0]})).finished
    assert done.metrics == {"a/share": 0.6}  # over both ranks' records
    assert done.meta["declarations"] == {"a/share": [share.formula, sorted(share.inputs.items())]}
    assert done.meta["internal_ignored"] == ["a/__stray"]  # read by nothing: said, not shown


SHARE = Derived("a/share", "sum(a) / (sum(a) + sum(b))", {"a": "a/__n", "b": "a/__m"})
OTHER = Derived("a/share", "sum(b) / sum(a)", {"a": "a/__n", "b": "a/__m"})


def _step(agg, step, rank, decl, n, m):
    return agg.submit(summed_batch(rank, encode_derived([decl]), step,
                                   **{"a/__n": [n], "a/__m": [m]}))


@pytest.mark.parametrize("first", [0, 1])
def test_a_declaration_means_the_same_whoever_arrives_first_and_the_loser_is_told(first):
    """Two ranks declaring 'a/share' differently gave 2.0 or 3.0 for the same data by
    arrival order. Then the lower rank's declaration became the run's, but the other
    rank's whole batch was refused when it came second and merged when it came first: the
    step was published from one rank's data or from two, at once or at the straggler
    timeout. Now, in both orders, both ranks' data is merged at once under rank 0's
    formula, and rank 1 is told (a notice naming both formulas), in later steps and after
    a restart too."""
    from metricsvc.service.engine import Engine as Aggregator

    agg = Aggregator(world_size=2)
    told = (r"derived metric 'a/share': rank 1 declares 'sum\(b\) / sum\(a\)'.* but the "
            r"run declares it 'sum\(a\) / \(sum\(a\) \+ sum\(b\)\)' over .* \(rank 0, "
            r"step 0\); yours is ignored and your data merged")
    if first == 0:
        _step(agg, 0, 0, SHARE, 2.0, 2.0)
        loser = _step(agg, 0, 1, OTHER, 4.0, 0.0)
        (done,) = loser.finished
        assert re.search(told, loser.notice)
    else:  # rank 1 first: rank 0's declaration, arriving later, is still the run's
        assert _step(agg, 0, 1, OTHER, 4.0, 0.0).notice is None
        (done,) = _step(agg, 0, 0, SHARE, 2.0, 2.0).finished
        later = _step(agg, 1, 1, OTHER, 1.0, 1.0)  # it hears why its own was replaced
        assert "rank 0 declares a derived metric you declared otherwise" in later.notice
        assert re.search(told, later.notice)
    assert done.metrics == {"a/share": 0.75}  # rank 0's formula over both ranks' data
    restarted = Aggregator(world_size=2)
    restarted.restore([{"step": 0, "metrics": done.metrics, "meta": done.meta}])
    notice = _step(restarted, 1, 1, OTHER, 1.0, 1.0).notice
    assert re.search(r"'a/share': rank 1 declares .* yours is ignored and your data merged",
                     notice)


def test_a_formula_with_no_real_value_is_omitted_with_its_reason_and_steps_go_on():
    """``(mean(x) - 1) ** 0.5`` at mean 0 is complex: it raised TypeError while finishing
    the step, the honest rank closing it got the error and no later step was published.
    Now it is omitted, meta says why, and every step is published exact."""
    from tests.helpers import LocalService

    service = LocalService(world_size=2)
    clients = service.clients(2)
    clients[0].declare(Derived("gap/sqrt", "(mean(x) - 1) ** 0.5", {"x": "x"}),
                       Derived("gap/inv", "1 / (mean(x) - mean(x))", {"x": "x"}))
    for step, values in enumerate(([0.0, 0.0], [2.0, 4.0], [-3.0, 1.0])):
        for rank, c in enumerate(clients):
            c.stat(x=np.array([values[rank]]))
            service.close(c, step=step)
    got = [service.final(s) for s in range(3)]
    assert [r["metrics"]["x/mean"] for r in got] == [0.0, 3.0, -1.0]
    assert got[1]["metrics"]["gap/sqrt"] == pytest.approx(2.0 ** 0.5)
    for r in (got[0], got[2]):
        assert "gap/sqrt" not in r["metrics"]
        assert r["meta"]["derived_undefined"]["gap/sqrt"] == "not a real number"
    assert got[1]["meta"]["derived_undefined"] == {"gap/inv": "division by zero"}
    assert service.engine.health()["rejected_batches"] == 0


def test_a_step_derives_within_its_budget_whatever_keys_come_later():
    """The receipt check counts the keys known then; finishing keeps to the same budget."""
    deriver = Deriver(max_outputs=2, max_reads=100)
    recs = {f"k/{i}": rec([float(i)]) for i in range(3)}
    decls = [Derived(f"d{i}", "sum(v)", {"v": f"k/{i}"}) for i in range(3)]
    assert derive(deriver, decls, recs) == {"d0": 0.0, "d1": 1.0}
    assert deriver.limited == {"limit": "limits.max_derived_outputs", "evaluated": 2,
                               "first_left_out": "d2"}
    deriver = Deriver(max_outputs=10, max_reads=4)
    group = [Derived(f"g{i}", "sum_of_sums(g)", {"g": "k/*"}) for i in range(3)]
    assert derive(deriver, group, recs) == {"g0": 3.0}  # each reads 3 records
    assert deriver.limited["limit"] == "limits.max_derived_reads"
    assert deriver.cost(group, list(recs)) == (2, 6)  # counting stops past the limit
