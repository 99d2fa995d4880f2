"""No rank can stall, freeze or flood the service through what it declares: key patterns
match in linear time, declarations' work and outputs are bounded, and honest ranks' steps
stay exact while ``health()`` answers."""

from __future__ import annotations

import time

import pytest

from metricsvc.declare import Derived, KeyIndex, key_pattern


@pytest.mark.parametrize(("pattern", "key", "binding"), [
    ("a/*/c", "a/bb/c", {}),
    ("a/*/c", "a//c", {}),
    ("a/*/c", "a/b/x/c", None),  # '*' stays within one segment
    ("a/x*y*z", "a/xqyqqz", {}),
    ("a/x*y*z", "a/xqqz", None),
    ("moe/layer_<l>/expert_<e>/tokens", "moe/layer_3/expert_12/tokens", {"l": "3", "e": "12"}),
    ("m/<l>/x/<l>", "m/4/x/4", {"l": "4"}),
    ("m/<l>/x/<l>", "m/4/x/5", None),
    ("m/pre_<t>", "m/pre_", None),  # a <name> holds one character at least
])
def test_key_patterns_match_segment_by_segment_like_the_globs_they_are(pattern, key, binding):
    assert key_pattern(pattern).match(key) == binding


def test_a_backtracking_pattern_matches_in_linear_time():
    """``a*a*...a*b`` against 60 a's froze the actor (a regex backtracking: 47 s offline
    for a 40-character key)."""
    pattern = "k/" + "a*" * 30 + "b"
    keys = ["k/" + "a" * n for n in (40, 60, 200)]
    start = time.perf_counter()
    assert [key_pattern(pattern).match(k) for k in keys] == [None, None, None]
    index = KeyIndex(keys * 1 + [f"k/{i}" for i in range(3000)])
    assert index.matching(pattern) == []
    assert time.perf_counter() - start < 0.5


def test_a_segment_with_two_names_or_a_name_and_a_star_is_refused_naming_it():
    with pytest.raises(ValueError, match="derived metric 'x/<a>': key pattern 'k/<a><b>'"):
        Derived("x/<a>", "sum(v)", {"v": "k/<a><b>"})
    with pytest.raises(ValueError, match=r"segment 'e_<a>\*' may hold one <name>"):
        Derived("x/<a>", "sum(v)", {"v": "k/e_<a>*"})
