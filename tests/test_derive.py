"""Derived metrics from merged records: parsing of internal keys and each derivation."""

import numpy as np
import pytest

from metricsvc import records
from metricsvc.derive import Deriver, split_internal
from metricsvc.reduce import OutputRules, ReduceType

RULES = OutputRules()


def rec(values, kind=ReduceType.SUM):
    return kind, records.summarize_array(np.asarray(values, dtype=float))


def test_internal_keys_split_into_prefix_handler_and_rest():
    assert split_internal("critic/__explained_var/ev/target") == ("critic", "explained_var",
                                                                  "ev/target")
    assert split_internal("__ratio/perf/throughput/num") == ("", "ratio", "perf/throughput/num")
    assert split_internal("plain/key") is None and split_internal("a/__/b") is None


def test_ratio_needs_both_sides_and_a_nonzero_denominator():
    d = Deriver()
    out = d.derive({
        "__ratio/a/num": rec([2.0, 4.0]), "__ratio/a/den": rec([3.0], ReduceType.MAX),
        "__ratio/b/num": rec([1.0]),
        "__ratio/c/num": rec([1.0]), "__ratio/c/den": rec([0.0]),
    }, RULES)
    assert out == {"a": 2.0}


def test_explained_variance_uses_unbiased_merged_variances():
    target, residual = np.array([1.0, 2.0, 4.0, 7.0]), np.array([0.5, -0.5, 0.2, 0.1])
    out = Deriver().derive({"x/__explained_var/ev/target": rec(target, ReduceType.AVG),
                            "x/__explained_var/ev/residual": rec(residual, ReduceType.AVG)},
                           RULES)
    expected = 1 - residual.var(ddof=1) / (target.var(ddof=1) + 1e-5)
    assert out == {"x/ev": pytest.approx(expected, rel=1e-12)}
    single = Deriver().derive({"__explained_var/ev/target": rec([1.0]),
                               "__explained_var/ev/residual": rec([0.0])}, RULES)
    assert single == {}  # a variance of one value is undefined: omitted, not invented


def test_cumulative_totals_survive_across_steps_and_unknown_handlers_stay_hidden():
    d = Deriver()
    for tokens in (100.0, 300.0):
        out = d.derive({"__cumulative/tp/tokens": rec([tokens]),
                        "__cumulative/tp/seconds": rec([2.0], ReduceType.MAX),
                        "__mystery/x": rec([1.0])}, RULES)
    assert out == {"tp/tokens": 300.0, "tp/seconds": 2.0, "tp/tokens_per_second": 150.0,
                   "tp/total_tokens": 400.0, "tp/total_seconds": 4.0,
                   "tp/cumulative_tokens_per_second": 100.0}
    assert d.state() == {"tp": {"tokens": 400.0, "seconds": 4.0}}
