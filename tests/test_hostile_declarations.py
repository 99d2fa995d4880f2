"""No rank can stall, freeze or flood the service through what it declares: key patterns
match in linear time, declarations' work and outputs are bounded, and honest ranks' steps
stay exact while ``health()`` answers."""

from __future__ import annotations

import time

import pytest

from metricsvc.core.declare import Derived, KeyIndex, key_pattern
from metricsvc.core.wire import Batch


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


def _plain(step, rank, **values):
    import numpy as np

    from metricsvc.core import records
    from metricsvc.core.reduce import ReduceType

    keys = list(values)
    data = np.stack([records.scalar_row(v) for v in values.values()])
    return Batch.build(step=step, rank=rank, world_size=2, seq=step, final=True,
                               keys=keys, data=data, kinds=[int(ReduceType.AVG)] * len(keys),
                               expected=[1] * len(keys))


def test_keys_sharing_a_sink_tag_show_the_same_one_whatever_the_arrival_order():
    """'acc rate' and 'acc_rate' from two ranks shared one TensorBoard tag, which showed 1.0
    at step 0 and 2.0 at step 1 for identical data (whichever arrived first). Now, of names
    a step brings together, the name written as its tag is shown, every step, and the ranks
    of the step are told once (before, only rank 1 was: rank 0, which sent the name left out,
    heard nothing)."""
    from metricsvc.service.engine import Engine as Aggregator
    from metricsvc.sinks.base import tagged

    agg = Aggregator(world_size=2)
    shown, notices = [], []
    for step, order in enumerate(((0, 1), (1, 0))):
        batches = {0: _plain(step, 0, **{"acc rate": 1.0}), 1: _plain(step, 1, acc_rate=2.0)}
        for rank in order:
            out = agg.submit(batches[rank])
            notices.append((rank, out.notice))
        (done,) = out.finished
        shown.append(tagged(done.metrics))
        assert done.meta["collisions"] == {"acc_rate": ["acc_rate", "acc rate"]}
    assert shown == [{"acc_rate": 2.0}, {"acc_rate": 2.0}]
    told = [(rank, n) for rank, n in notices if n]
    said = TAG_NOTICE.format(hidden="acc rate", tag="acc_rate", shown="acc_rate")
    assert told == [(1, said), (0, said)]  # rank 0 at its next call: it had sent step 0


TAG_NOTICE = ("name {hidden!r} shares the sink tag {tag!r} with {shown!r}: sinks show "
              "{shown!r} under it (the first name the run showed under it; of names one "
              "step brings, the name written as its tag, else the first alphabetically); "
              "rename one")


def _two_ranks(engine, step, zero, one):
    """Submit rank 0's ``zero`` then rank 1's ``one`` for ``step``; return the finished step
    and what each rank heard."""
    answers = [engine.submit(_plain(step, rank, **values))
               for rank, values in enumerate((zero, one))]
    (done,) = answers[-1].finished
    return done, [answer.notice for answer in answers]


def test_a_sink_tag_shows_one_name_for_the_whole_run_whichever_steps_hold_each(tmp_path):
    """Two names sharing a sink tag on different steps (a validation key on some steps
    only, say) filled one TensorBoard series with both: each step showed whichever of them
    it held. The first name a run shows under a tag keeps it, across steps, a restart and
    a rewind that does not reach back past it; the other is never shown under it."""
    from metricsvc.service.engine import Engine
    from metricsvc.sinks.base import tagged
    from metricsvc.sinks.tensorboard import TensorboardSink
    from tests import readback

    told = []

    def run(engine, steps, first=0):
        out = []
        for step, (zero, one) in enumerate(steps, first):
            done, notices = _two_ranks(engine, step, zero, one)
            told.extend((step, rank, n) for rank, n in enumerate(notices) if n)
            out.append(done)
        return out

    steps = [({"acc rate": 1.0}, {"loss": 0.5}),  # "acc rate" takes the tag "acc_rate"
             ({"acc rate": 1.0}, {"acc_rate": 2.0}),  # both: the first keeps it
             ({"loss": 0.5}, {"acc_rate": 2.0}),  # the other alone: not under the tag
             ({"acc rate": 3.0}, {"loss": 0.5})]
    engine = Engine(world_size=2)
    done = run(engine, steps)
    sink = TensorboardSink()
    sink.open(tmp_path)
    for result in done:
        sink.write(result.step, result.metrics, result.meta)
    sink.close()
    board = readback.tensorboard_scalars(tmp_path / "tensorboard")
    assert {s: m.get("acc_rate") for s, m in board.items()} == {0: 1.0, 1: 1.0, 2: None,
                                                                3: 3.0}
    assert [tagged(r.metrics, r.meta).get("acc_rate") for r in done] == [1.0, 1.0, None, 3.0]
    assert [r.meta.get("collisions") for r in done] == [
        None, {"acc_rate": ["acc rate", "acc_rate"]}, {"acc_rate": ["acc rate", "acc_rate"]},
        None]
    assert [r.meta.get("sink_tags") for r in done] == [
        None, {"acc_rate": "acc rate"}, {"acc_rate": "acc rate"}, None]
    # every rank of step 1 hears it once (rank 0 with its next batch)
    said = TAG_NOTICE.format(hidden="acc_rate", tag="acc_rate", shown="acc rate")
    assert told == [(1, 1, said), (2, 0, said)]
    # A restart continues from the journaled steps: the tag stays with "acc rate", and what
    # the ranks heard before is not said again
    told.clear()
    restarted = Engine(world_size=2)
    restarted.restore({"step": r.step, "metrics": r.metrics, "meta": r.meta} for r in done)
    (later,) = run(restarted, [({"loss": 0.5}, {"acc_rate": 4.0})], first=4)
    assert "acc_rate" not in tagged(later.metrics, later.meta) and told == []
    # A rewind before the step that gave the tag away: the rerun gives it afresh, and the
    # ranks hear which name it shows now
    restarted.rewind(-1, None, [], {})
    (rerun,) = run(restarted, [({"loss": 0.5}, {"acc_rate": 5.0})])
    assert tagged(rerun.metrics, rerun.meta)["acc_rate"] == 5.0
    (after,) = run(restarted, [({"acc rate": 6.0}, {"loss": 0.5})], first=1)
    assert "acc_rate" not in tagged(after.metrics, after.meta)
    said = TAG_NOTICE.format(hidden="acc rate", tag="acc_rate", shown="acc_rate")
    assert told == [(1, 1, said)]  # rank 1 in the same answer; rank 0 at its next call


def test_after_a_restart_a_name_a_journaled_step_took_the_tag_from_is_told():
    """The service restarted from its journal, where "acc rate" holds the tag "acc_rate";
    a rank then sends "acc_rate", which sinks leave out. It heard nothing: what it was told
    came from keys seen by this incarnation only."""
    from metricsvc.service.engine import Engine

    first = Engine(world_size=2)
    done, _ = _two_ranks(first, 0, {"acc rate": 1.0}, {"loss": 0.5})
    restarted = Engine(world_size=2)
    restarted.restore([{"step": done.step, "metrics": done.metrics, "meta": done.meta}])
    later, notices = _two_ranks(restarted, 1, {"loss": 0.5}, {"acc_rate": 2.0})
    assert later.meta["sink_tags"] == {"acc_rate": "acc rate"}
    said = TAG_NOTICE.format(hidden="acc_rate", tag="acc_rate", shown="acc rate")
    assert notices == [None, said]
    _, notices = _two_ranks(restarted, 2, {"loss": 0.5}, {"acc_rate": 3.0})
    assert notices == [said, None]  # rank 0 with its next batch; once each


def test_the_ranks_hear_of_a_value_left_out_where_two_sources_export_one_name():
    """A rename makes key "a" export "b", which rank 1's key "b" exports too: the step shows
    one of them ("a"'s: of sources one step brings, the first alphabetically) and listed
    both in ``meta.collisions``, but no rank heard that a value was left out."""
    from metricsvc.service.engine import Engine

    def run(engine, steps):
        notices, done = [], []
        for step in steps:
            result, heard = _two_ranks(engine, step, {"a": 1.0}, {"b": 2.0})
            notices += [(step, rank, n) for rank, n in enumerate(heard)]
            done.append(result)
            assert result.metrics == {"b": 1.0}
            assert result.meta["collisions"] == {"b": ["a", "b"]}
        return [(step, rank) for step, rank, n in notices if n], {n for *_, n in notices if n}, done

    said = ("key 'b' exports the name 'b', as key 'a' does: the step shows key 'a''s value "
            "under it, and leaves this one out (of sources one step brings, the first key "
            "alphabetically; a derived metric yields to a key); rename one")
    engine = Engine(world_size=2, renames={"a": "b"})
    told, heard, done = run(engine, range(2))
    assert told == [(0, 1), (1, 0)] and heard == {said}  # each rank once, rank 0 at step 1
    # a restart: what the journal left out was heard; a rewind's rerun says it again
    restarted = Engine(world_size=2, renames={"a": "b"})
    restarted.restore({"step": r.step, "metrics": r.metrics, "meta": r.meta} for r in done)
    assert run(restarted, [2])[:2] == ([], set())
    restarted.rewind(-1, None, [], {})
    assert run(restarted, [0])[:2] == ([(0, 1)], {said})


def test_a_derived_metric_left_out_for_a_renamed_key_names_that_key():
    """A rename makes key "x" export "y", the name a declared derived metric has too: the
    step shows "x"'s value (a derived metric yields to a key), but ``meta.collisions`` and
    the notice named the exported name as the key kept ("as key 'y' does"), a key no rank
    sent."""
    from metricsvc.core.declare import encode_derived
    from metricsvc.service.engine import Engine
    from tests.helpers import summed_batch

    declared = encode_derived([Derived("y", "sum(n)", {"n": "y/__n"})])
    engine = Engine(world_size=2, renames={"x": "y"})
    for rank in (0, 1):
        answer = engine.submit(summed_batch(rank, declared, **{"x": [1.0 + rank],
                                                               "y/__n": [2.0, 5.0]}))
    (done,) = answer.finished
    assert done.metrics == {"y": 3.0}
    assert done.meta["collisions"] == {"y": ["x", "derived y"]}
    assert answer.notice.startswith("derived metric 'y' exports the name 'y', as key 'x' "
                                    "does: the step shows key 'x''s value under it")


def test_two_derived_metrics_renamed_onto_one_name_show_the_first_and_name_it():
    """Renames may map two declared derived metrics onto one name: the step shows the first
    and names it as the one kept. Finding the kept source among the keys' exports alone
    (none exports the name) ended the step's finish in StopIteration: the step was never
    published."""
    from metricsvc.core.declare import encode_derived
    from metricsvc.service.engine import Engine
    from tests.helpers import summed_batch

    declared = encode_derived([Derived("p", "sum(n)", {"n": "p/__n"}),
                               Derived("q", "2 * sum(n)", {"n": "p/__n"})])
    engine = Engine(world_size=2, renames={"p": "z", "q": "z"})
    for rank in (0, 1):
        answer = engine.submit(summed_batch(rank, declared, **{"p/__n": [2.0]}))
    (done,) = answer.finished
    assert done.metrics == {"z": 4.0}
    assert done.meta["collisions"] == {"z": ["derived p", "derived q"]}
    assert answer.notice.startswith("derived metric 'q' exports the name 'z', as derived "
                                    "metric 'p' does: the step shows derived metric 'p''s "
                                    "value under it")


def test_what_a_rank_hears_of_long_names_names_both_ends_in_a_line():
    """Names past a sink tag's length share its tag when they differ only past it. The
    notice quoted each name whole, four times: 1,300 characters for two keys of 300."""
    from metricsvc.core.limits import MAX_TAG_LENGTH
    from metricsvc.service.engine import Engine

    engine = Engine(world_size=2)
    long = "a" * (MAX_TAG_LENGTH + 45)
    for rank, key in enumerate((f"{long}/x", f"{long}/y")):
        notice = engine.submit(_plain(0, rank, **{key: 1.0})).notice
    assert "/x" in notice and "/y" in notice and len(notice) < 600, notice
    assert f"({len(long) + 2} characters)" in notice


def _blob(step, rank, keys, derived=b"", world_size=2):
    import numpy as np

    from metricsvc.core import records
    from metricsvc.core.reduce import ReduceType
    from metricsvc.core.wire import encode

    data = np.stack([records.scalar_row(1.0) for _ in keys]) if keys else records.identity(0)
    return encode(Batch.build(
        step=step, rank=rank, world_size=world_size, seq=step, final=True, keys=keys,
        data=data, kinds=[int(ReduceType.SUM)] * len(keys), expected=[1] * len(keys),
        derived=derived))


def _health_within(handle, seconds):
    import ray

    start = time.perf_counter()
    ray.get(handle.health.remote(), timeout=seconds)
    return time.perf_counter() - start


def test_hostile_declarations_are_refused_or_cheap_and_honest_steps_stay_exact(make_worker):
    """Against a live actor, step by step, a hostile rank 1 sends what froze or flooded the
    service (a backtracking pattern, 20,000 group declarations over 3,000 keys, 300
    families over 1,000 keys); honest rank 0 records the same values each step. Every
    attack is refused naming its limit or costs nothing, health() answers within 1 s,
    and every honest step is published exact."""
    import numpy as np
    import ray

    from metricsvc.client import MetricClient
    from metricsvc.core.declare import encode_derived

    handle, cfg = make_worker(world_size=2, limits={"max_keys_per_batch": 5000})
    honest = MetricClient(None, rank=0, world_size=2, name=cfg.name)
    wide = [f"k/{i}" for i in range(3000)]
    attacks = [
        (["k/" + "a" * 60],
         encode_derived([Derived("bt", "size(g)", {"g": "k/" + "a*" * 30 + "b"})]), None),
        (wide, encode_derived([Derived(f"s{i}", "sum_of_sums(g)", {"g": "k/*"})
                               for i in range(20_000)]), "limits.max_declarations=1000"),
        (wide[:1000], encode_derived([Derived(f"f{i}/<x>", "sum(v)", {"v": "k/<x>"})
                                      for i in range(300)]), "limits.max_derived_outputs"),
        (wide, encode_derived([Derived(f"s{i}", "sum_of_sums(g)", {"g": "k/*"})
                               for i in range(900)]), "limits.max_derived_reads"),
    ]
    values = np.arange(12.0)
    for step, (keys, derived, limit) in enumerate(attacks):
        honest.stat(x=values)
        honest.wait_submit(step=step, timeout_s=30)
        if limit is None:
            ray.get(handle.submit.remote(_blob(step, 1, keys, derived)), timeout=30)
        else:
            with pytest.raises(ValueError, match=limit):
                ray.get(handle.submit.remote(_blob(step, 1, keys, derived)), timeout=30)
            ray.get(handle.submit.remote(_blob(step, 1, [])), timeout=30)  # it closes honestly
        assert _health_within(handle, 1.0) < 1.0
        got = ray.get(handle.wait_final_res.remote(step=step, timeout_s=30))
        assert (got["x/mean"], got["x/min"], got["x/max"]) == (5.5, 0.0, 11.0), step
    assert got.get("bt") is None
    assert ray.get(handle.wait_final.remote(step=0, timeout_s=5))["metrics"]["bt"] == 0.0


@pytest.mark.parametrize(("about", "rule"), [
    ({"x": ["help", 3]}, "must be [help, unit], two strings"),
    ({"x": ["h" * 1001, ""]}, "of at most 1000 characters"),
    ({"x": ["help"]}, "must be [help, unit]"),
    ({"m/<a>_<b>": ["help", ""]}, "one <name>"),
])
def test_a_malformed_description_is_refused_naming_the_key_and_the_rule(about, rule):
    """What a name means travels with a batch; a malformed one refuses the batch at the
    aggregator, naming the key and the rule, and merges nothing."""
    import json

    from metricsvc.core.records import scalar_row
    from metricsvc.core.wire import Batch
    from metricsvc.errors import BatchRejected
    from metricsvc.service.engine import Engine as Aggregator

    blob = json.dumps({"derived": [], "about": about}).encode()
    batch = Batch.build(step=0, rank=0, world_size=1, seq=0, final=True, keys=("x",),
                        data=[scalar_row(1.0)], kinds=[0], expected=[0], derived=blob)
    agg = Aggregator(world_size=1)
    with pytest.raises(BatchRejected, match="step 0 rank 0") as err:
        agg.submit(batch)
    assert rule in str(err.value) and next(iter(about)) in str(err.value)
    assert agg.last_emitted is None and agg.counts["rejected"] == 1


def test_a_metric_declared_again_each_step_costs_no_check_and_a_changed_one_is_refused(
        monkeypatch):
    from metricsvc.client import MetricClient
    from metricsvc.client.buffer import Declarations as ClientDeclarations

    c = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed
    ratio = Derived("train/ratio", "value(a) / value(b)", {"a": "train/a", "b": "train/b"})
    c.declare(ratio)
    checks = []
    real = ClientDeclarations.declare
    monkeypatch.setattr(ClientDeclarations, "declare",
                        lambda self, *a: checks.append(a) or real(self, *a))
    for _ in range(3):  # every step declares the same object again: nothing to check
        c.declare(ratio)
        c.buffer.discard()
    assert checks == []
    same = Derived("train/ratio", "value(a) / value(b)", {"a": "train/a", "b": "train/b"})
    c.declare(same)  # an equal declaration, another object: checked, and harmless
    assert len(checks) == 1
    other = Derived("train/ratio", "value(b) / value(a)", {"a": "train/a", "b": "train/b"})
    with pytest.raises(ValueError, match=r"'train/ratio' is declared with formula"):
        c.declare(ratio, other)
    with pytest.raises(TypeError, match=r"declare\(\) takes Derived metrics, got str"):
        c.declare(ratio, "train/ratio")
