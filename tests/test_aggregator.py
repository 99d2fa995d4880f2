"""The step state machine without Ray: completion, order, dedup, late batches, rejection."""

import numpy as np
import pytest

from metricsvc.core import records
from metricsvc.core.limits import Limits
from metricsvc.core.reduce import AUTO, OutputRules, ReduceType, finalize, finalize_row
from metricsvc.core.wire import Batch
from metricsvc.errors import BatchRejected
from metricsvc.service.engine import Engine as Aggregator


def batch(step, rank, world_size=2, seq=None, final=True, kind=AUTO, expected=0, **values):
    keys = tuple(values)
    data = [records.summarize_array(np.atleast_1d(np.asarray(v, dtype=float))) for v in
            values.values()]
    return Batch.build(step=step, rank=rank, world_size=world_size,
                       seq=seq if seq is not None else step * 100 + 1, final=final, keys=keys,
                       data=np.array(data).reshape(len(keys), records.NFIELDS),
                       kinds=[int(kind)] * len(keys), expected=[expected] * len(keys))


def test_step_is_final_only_when_world_size_ranks_closed_it():
    agg = Aggregator()
    assert agg.submit(batch(0, 0, x=1.0)).finished == []
    done = agg.submit(batch(0, 1, x=3.0)).finished
    assert [r.step for r in done] == [0]
    assert done[0].metrics == {"x": 2.0}
    assert done[0].meta["partial"] is False and done[0].meta["ranks"] == [0, 1]


def test_steps_finish_in_order_when_ranks_close_a_later_step_first():
    agg = Aggregator()
    agg.submit(batch(0, 0, x=1.0))
    agg.submit(batch(1, 0, x=10.0))
    # rank 1 is ahead and closes step 1 first: step 1 is complete but must wait for step 0
    assert agg.submit(batch(1, 1, x=30.0)).finished == []
    done = agg.submit(batch(0, 1, x=3.0)).finished
    assert [(r.step, r.metrics["x"]) for r in done] == [(0, 2.0), (1, 20.0)]


def test_retried_batch_is_merged_once_before_and_after_the_step_finished():
    agg = Aggregator(world_size=2)
    b = batch(0, 0, seq=7, x=5.0)
    assert agg.submit(b).status == "merged"
    assert agg.submit(b).status == "duplicate"
    done = agg.submit(batch(0, 1, x=1.0)).finished
    assert done[0].metrics["x"] == 3.0
    assert agg.submit(b).status == "duplicate"
    assert agg.counts["duplicate"] == 2 and agg.counts["late"] == 0


def test_batch_for_an_emitted_step_never_changes_the_result():
    agg = Aggregator(straggler_timeout_s=1.0, clock=lambda: 0.0)
    agg.submit(batch(0, 0, world_size=3, x=1.0))
    agg.submit(batch(0, 1, world_size=3, x=1.0))
    (result,) = agg.expire(now=5.0)
    # rank 1 closed step 0 already: a byte-identical resend is a duplicate, new content a
    # conflict; rank 2 is late
    assert agg.submit(batch(0, 1, world_size=3, x=1.0)).status == "duplicate"
    with pytest.raises(BatchRejected, match="conflict: rank 1 seq 999"):
        agg.submit(batch(0, 1, world_size=3, seq=999, x=100.0))
    assert agg.submit(batch(0, 2, world_size=3, x=100.0)).status == "late"
    assert agg.late_by_rank == {2: 1} and agg.counts["conflict"] == 1
    assert result.metrics == {"x": 1.0} and agg.counts == {**agg.counts, "late": 1,
                                                           "duplicate": 1}


def test_nonfinal_batches_merge_with_the_final_one():
    agg = Aggregator()
    agg.submit(batch(0, 0, seq=1, final=False, x=[1.0, 2.0]))
    agg.submit(batch(0, 0, seq=2, final=True, x=[3.0]))
    done = agg.submit(batch(0, 1, x=[6.0])).finished[0]
    assert done.metrics["x"] == 3.0
    assert "contributors" not in done.meta  # rank 0 counts once for x, not twice


def test_key_sent_by_some_ranks_merges_over_those_and_is_reported():
    agg = Aggregator()
    agg.submit(batch(0, 0, world_size=3, x=[2.0, 4.0], y=1.0))
    agg.submit(batch(0, 1, world_size=3, x=[6.0]))
    done = agg.submit(batch(0, 2, world_size=3)).finished[0]
    assert done.metrics == {"x": 4.0, "y": 1.0}
    assert done.meta["contributors"] == {"x": [2, 3], "y": [1, 3]}


def test_expected_contributors_below_world_size_are_not_flagged():
    agg = Aggregator()
    agg.submit(batch(0, 0, expected=1, **{"timing_s/gen": 2.5}))
    done = agg.submit(batch(0, 1)).finished[0]
    assert done.metrics == {"timing_s/gen": 2.5} and "contributors" not in done.meta


def test_empty_population_everywhere_is_absent_not_zero():
    agg = Aggregator()
    empty = np.array([], dtype=float)
    agg.submit(batch(0, 0, kind=ReduceType.AVG_MIN_MAX, length=empty))
    done = agg.submit(batch(0, 1, kind=ReduceType.AVG_MIN_MAX, length=empty)).finished[0]
    assert done.metrics == {}


def test_nonfinite_values_are_counted_and_excluded_whatever_the_arrival_order():
    results = []
    for order in ([0, 1], [1, 0]):
        agg = Aggregator()
        parts = {0: [1.0, np.nan], 1: [np.inf, 3.0]}
        for r in order:
            out = agg.submit(batch(0, r, x=parts[r])).finished
        results.append(out[0])
    assert results[0].metrics == results[1].metrics == {"x": 2.0}
    assert results[0].meta["nonfinite"] == {"x": 2}


def test_rejected_batch_changes_nothing_and_the_step_still_completes():
    agg = Aggregator(world_size=2)
    agg.submit(batch(0, 0, kind=ReduceType.AVG, x=1.0))
    clash = "key 'x': recorded as AVG, but rank 1 in step 0 sent it as SUM"
    with pytest.raises(BatchRejected, match=clash):
        agg.submit(batch(0, 1, seq=5, kind=ReduceType.SUM, x=9.0, y=2.0))
    with pytest.raises(BatchRejected, match="world_size 3, but the run's world size is 2"):
        agg.submit(batch(0, 1, world_size=3, seq=6, x=9.0))
    done = agg.submit(batch(0, 1, kind=ReduceType.AVG, x=3.0)).finished[0]
    assert done.metrics == {"x": 2.0} and agg.counts["rejected"] == 2


def test_rank_cannot_add_to_a_step_it_closed():
    agg = Aggregator(world_size=2)
    agg.submit(batch(0, 0, seq=1, x=1.0))
    with pytest.raises(BatchRejected, match="rank 0 seq 2 comes after the rank already closed"):
        agg.submit(batch(0, 0, seq=2, x=1.0))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (dict(rank=2), r"rank must be in \[0, 2\)"),
        (dict(keys=("a", "a")), "key 'a' appears twice"),
        (dict(keys=("",)), "non-empty"),
        (dict(kinds=np.array([42], dtype=np.int8)), "unknown reduce code 42"),
        (dict(expected=np.array([5], dtype=np.int32)), r"expected contributors must be in"),
        (dict(data=np.zeros((1, 3))), "batch column 'data'"),
        (dict(step=-1), r"step must be in \[0, 2\*\*53\]"),
    ],
)
def test_malformed_batches_are_rejected_with_a_clear_message(mutate, message):
    import dataclasses

    base = batch(0, 0, x=1.0)
    if "keys" in mutate and len(mutate["keys"]) == 2:
        base = batch(0, 0, x=1.0, y=2.0)
    bad = dataclasses.replace(base, **mutate)
    agg = Aggregator()
    with pytest.raises(BatchRejected, match=message):
        agg.submit(bad)
    assert agg.counts["rejected"] == 1 and agg.pending.summary() == {}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (dict(kinds=np.array([42, int(AUTO)], dtype=np.int8)), "key 'x': unknown reduce code 42"),
        (dict(expected=np.array([0, 5], dtype=np.int32)),
         r"key 'y': expected contributors must be in \[0, 2\], got 5"),
        (dict(kinds=np.array([int(AUTO), int(ReduceType.MAX)], dtype=np.int8)),
         r"key 'y': recorded as AUTO \(from the key name\), but rank 1 in step 1 sent it as MAX"),
    ],
)
def test_keys_sent_before_are_checked_again_when_their_kinds_or_expected_change(mutate, message):
    # Ranks send the same keys every step, so a key tuple's kinds and rows are remembered;
    # a batch of the same keys with other kinds or expected counts is checked in full.
    import dataclasses

    agg = Aggregator(world_size=2)
    for rank in (0, 1):
        agg.submit(batch(0, rank, x=1.0, y=2.0))
    agg.submit(batch(1, 0, x=1.0, y=2.0))
    with pytest.raises(BatchRejected, match=message):
        agg.submit(dataclasses.replace(batch(1, 1, x=3.0, y=4.0), **mutate))
    (done,) = agg.submit(batch(1, 1, x=3.0, y=4.0)).finished
    assert done.metrics == {"x": 2.0, "y": 3.0} and agg.counts["rejected"] == 1


def test_limits_reject_big_batches_and_too_many_keys():
    agg = Aggregator(limits=Limits(max_batch_bytes=2048, max_keys_per_batch=100))
    many = {f"k{i}": 1.0 for i in range(101)}
    with pytest.raises(BatchRejected, match="has 101 keys; the limit is 100"):
        agg.submit(batch(0, 0, **many))
    big = {f"k{i}": 1.0 for i in range(60)}
    with pytest.raises(BatchRejected, match="bytes; the limit is 2048"):
        agg.submit(batch(0, 0, **big))
    assert agg.counts["rejected"] == 2 and agg.pending.summary() == {}


def test_limits_reject_long_keys_and_too_many_pending_steps():
    agg = Aggregator(limits=Limits(max_key_length=8), max_pending_steps=2, world_size=2)
    with pytest.raises(BatchRejected, match="the limit is 8"):
        agg.submit(batch(0, 0, **{"a_very_long_key": 1.0}))
    agg.submit(batch(0, 0, x=1.0))
    agg.submit(batch(1, 0, x=1.0))
    with pytest.raises(BatchRejected, match="max_pending_steps=2"):
        agg.submit(batch(2, 0, x=1.0))


def test_straggler_timeout_finishes_a_partial_step_and_later_steps_proceed():
    now = [0.0]
    agg = Aggregator(straggler_timeout_s=5.0, clock=lambda: now[0])
    agg.submit(batch(0, 0, world_size=3, x=1.0))
    agg.submit(batch(0, 1, world_size=3, x=3.0))
    now[0] = 4.9
    assert agg.expire() == []
    now[0] = 5.0
    (done,) = agg.expire()
    assert done.meta["partial"] is True and done.meta["missing_ranks"] == [2]
    assert done.metrics == {"x": 2.0}
    assert agg.submit(batch(0, 2, world_size=3, seq=50, x=100.0)).status == "late"
    for r in range(3):
        out = agg.submit(batch(1, r, world_size=3, x=float(r))).finished
    assert [r.step for r in out] == [1] and out[0].meta["partial"] is False


def test_scalar_mismatch_and_approximate_plain_keys_are_flagged():
    agg = Aggregator()
    agg.submit(batch(0, 0, seq=1, final=False, **{"lat/p95": 3.0}))
    agg.submit(batch(0, 0, seq=2, kind=ReduceType.SCALAR, lr=1e-5))
    done = agg.submit(batch(0, 1, kind=ReduceType.SCALAR, lr=2e-5)).finished[0]
    assert done.meta["scalar_mismatch"] == ["lr"]
    assert done.meta["approximate"] == ["lat/p95"]


def test_renames_and_suffix_apply_to_outputs():
    agg = Aggregator(renames={"timing_s/": "perf/delta_time/"},
                     output=OutputRules(mean_suffix="avg"))
    agg.submit(batch(0, 0, kind=ReduceType.AVG_MIN_MAX, **{"timing_s/gen": [1.0, 3.0]}))
    done = agg.submit(batch(0, 1)).finished[0]
    assert done.metrics == {"perf/delta_time/gen/avg": 2.0, "perf/delta_time/gen/min": 1.0,
                            "perf/delta_time/gen/max": 3.0}


def test_finite_values_whose_sum_overflows_are_kept_and_flagged():
    agg = Aggregator()
    done = agg.submit(batch(0, 0, world_size=1, x=[1e308, 1e308, 1e307])).finished[0]
    assert done.meta["overflow"] == ["x"] and not np.isfinite(done.metrics["x"])
    assert agg.counts["rejected"] == 0


def test_a_rerun_of_an_old_final_step_is_refused_never_a_silent_duplicate():
    """A rank restarted from an old checkpoint reran step 2 while the run was at step 68:
    acked as a duplicate (older than the 64-step digest window), its values dropped
    silently. A batch that is not provably a resend is refused, however old the step."""
    agg = Aggregator(world_size=1)
    sent = {}
    for step in range(70):
        sent[step] = batch(step, 0, world_size=1, seq=step + 1, x=float(step))
        agg.submit(sent[step])
    assert agg.submit(sent[68]).status == "duplicate"  # a recent resend: the same bytes
    with pytest.raises(BatchRejected, match=r"step 2: conflict: rank 0 seq 1 comes after the "
                                            r"rank already closed this step.*rewind\(to_step="):
        agg.submit(batch(2, 0, world_size=1, seq=1, x=99.0))
    with pytest.raises(BatchRejected, match=r"step 2: conflict.*rewind"):
        agg.submit(sent[2])  # without a journal to read it back, not provably a resend


def test_a_step_with_other_keys_kinds_or_tag_clashes_is_finished_as_a_new_service_would():
    """The service keeps what it works out from a step's keys (their kinds, renamed names,
    sink-tag clashes) while they recur: a step bringing other keys, the same keys under
    other kinds, or a clash that comes and goes, publishes what a fresh aggregator does."""
    steps = [
        (AUTO, {"a": 1.0, "b/c": 2.0}),
        (AUTO, {"a": 1.5, "b/c": 2.5}),  # the same keys again
        (AUTO, {"a": 1.0, "acc rate": 1.0, "acc_rate": 2.0}),  # a clash appears
        (int(ReduceType.AVG_MIN_MAX), {"a": 1.0, "acc rate": 1.0, "acc_rate": 2.0}),
        (int(ReduceType.MAX), {"a": 3.0, "acc rate": 1.0, "acc_rate": 2.0}),
        (AUTO, {"a": 1.0, "b/c": 2.0}),  # the clash gone
        (AUTO, {"a": 1.0, "lat/p95": [3.0, 4.0], "x/max": [1.0, 9.0], "x/min": [2.0, 0.5]}),
        (AUTO, {"a": 2.0, "lat/p95": [3.5, 4.0], "x/max": [7.0, 9.0], "x/min": [2.0, 0.5]}),
        (int(ReduceType.SCALAR), {"a": [1.0, 2.0], "lat/p95": 3.0}),  # a mismatch: flagged
        (int(ReduceType.AVG_MIN_MAX), {"a": [1.0, 2.0], "__x": 3.0}),  # an internal key
    ]
    kept = Aggregator(world_size=1)
    plans = []  # what the kept aggregator worked out anew: once per new key set
    make = kept.out._make_plan
    kept.out._make_plan = lambda keys, codes: plans.append(list(keys)) or make(keys, codes)
    fields, seen = ("collisions", "extremes", "scalar_mismatch", "approximate"), set()
    for step, (kind, values) in enumerate(steps):
        (got,) = kept.submit(batch(step, 0, world_size=1, kind=kind, **values)).finished
        (want,) = Aggregator(world_size=1).submit(
            batch(0, 0, world_size=1, kind=kind, **values)).finished
        assert got.metrics == want.metrics, step
        for field in fields:
            assert got.meta.get(field) == want.meta.get(field), (step, field)
        seen.update(field for field in fields if got.meta.get(field))
    assert seen == set(fields)
    assert len(plans) == len(steps) - 2  # steps 1 and 7 bring the keys of the step before
    assert [steps[i][0] for i in (6, 7)] == [AUTO, AUTO]


@pytest.mark.parametrize("nonfinite", ["exclude", "propagate"])
def test_values_read_a_column_at_a_time_equal_each_records_own_finalisation(nonfinite):
    """The one finalizer reads the plain kinds' values a column at a time where it can: the
    same numbers, in the same order, as each record finalised on its own
    (``finalize_row``), across magnitudes, renames, internal keys, non-finite values and
    empty records (which take the per-row path)."""
    rng = np.random.default_rng(11)
    agg = Aggregator(renames={"t/": "perf/t/"}, output=OutputRules(nonfinite=nonfinite))
    out = agg.out
    plain = [ReduceType.AVG_MIN_MAX, ReduceType.AVG, ReduceType.SUM, ReduceType.MIN,
             ReduceType.MAX, ReduceType.SCALAR]
    keys = [f"t/k{i}" for i in range(12)] + ["x/max", "lat/p95", "a/__in"]
    codes = np.array([int(plain[i % len(plain)]) for i in range(12)] + [AUTO, AUTO, AUTO],
                     dtype=np.int8)
    plan = out.plan(keys, codes)
    exports = plan.exports
    assert exports.columns is not None and plan.internal == [14]
    taken = {"columns": 0, "rows": 0}
    for trial in range(60):
        rows = []
        for i in range(len(keys)):
            scale = 10.0 ** rng.uniform(-300, 300) if trial % 3 == 0 else 10.0 ** rng.uniform(-6, 6)
            values = rng.normal(loc=rng.choice([0.0, 1e6]), size=rng.integers(1, 9)) * scale
            if trial % 5 == 1 and i == 3:
                values[0] = np.nan  # a non-finite value: counted, excluded or propagated
            rows.append(records.summarize_array(values))
        if trial % 7 == 2:
            rows[5] = records.identity(1)[0]  # an empty record
        data = np.array(rows)
        got = finalize(keys, plan.kinds, data, rules=out.output, exports=exports)
        want = {}
        for name, row, at in zip(exports.names, exports.rows, exports.positions):
            values = finalize_row(data[row].tolist(), plan.kinds[row], None, out.output)
            if values is not None:
                want[name] = values[at]
        assert [(k, repr(v)) for k, v in got.items()] == [(k, repr(v)) for k, v in want.items()]
        assert "a/__in" not in got and "perf/t/k0/mean" in got
        plainly = (data[:, records.COUNT] > 0).all() and not (
            nonfinite == "propagate" and data[:, records.NONFINITE].any())
        taken["columns" if plainly else "rows"] += 1
    assert taken["columns"] > 30 and taken["rows"] > 5  # both paths were compared


def test_a_table_holds_a_row_per_binding_in_number_order_and_says_what_it_cut():
    from metricsvc.core.declare import table_series
    from metricsvc.service.output import Tables

    tables = Tables({"loads": {"rows": "moe/layer_<layer>/expert_<expert>",
                               "values": ["tokens", "share"], "max_rows": 3}})
    metrics = {"moe/layer_0/expert_10/tokens": 5.0, "moe/layer_0/expert_2/tokens": 7.0,
               "moe/layer_0/expert_2/share": 0.5, "moe/layer_1/expert_0/tokens": 1.0,
               "moe/layer_0/expert_3/tokens": 2.0, "moe/layer_0/max_over_ideal": 1.2,
               "moe/layer_0/expert_2/other": 9.0}
    table = tables.of(metrics)["loads"]
    assert table["columns"] == ["layer", "expert", "tokens", "share"]
    assert table["rows"] == [[0, 2, 7.0, 0.5], [0, 3, 2.0, None], [0, 10, 5.0, None]]
    assert table["cut"] == 1  # layer 1's row, past max_rows
    carried = table_series(table["series"])
    assert {n for n in metrics if carried(n)} == {
        n for n in metrics if n.endswith(("/tokens", "/share"))}
    assert tables.of({"loss": 1.0}) == {}


def test_a_resend_of_an_old_step_is_told_apart_by_the_journals_meta():
    """Published steps keep their batches' digests for the recent 64 steps and their ranks
    for ``remember_steps``; an older step's are read back from the journal's meta (here its
    JSON round trip): a byte-identical resend is a duplicate, other bytes under the same
    identity a conflict, and a rank the step was published without is late, however old."""
    import json

    from metricsvc.core.wire import encode
    from metricsvc.service.engine import DIGEST_STEPS

    journal: dict[int, dict] = {}
    read = []

    def meta_of(step):
        read.append(step)
        return journal.get(step)

    agg = Aggregator(remember_steps=80, journaled_meta=meta_of)
    sent = {}
    for step in range(100):
        for rank in (0, 1):
            sent[step, rank] = encode(batch(step, rank, x=float(step + rank)))
            for result in agg.submit(sent[step, rank]).finished:
                journal[result.step] = json.loads(json.dumps(result.meta))
    assert sorted(journal) == list(range(100))
    newest_digests = 100 - DIGEST_STEPS

    def resend(step, rank, data=None):
        return agg.submit(sent[step, rank] if data is None else encode(data)).status

    for step in (99, newest_digests, newest_digests - 1, 20, 19, 0):  # memory, then journal
        read.clear()
        assert resend(step, 0) == "duplicate", step
        assert bool(read) == (step < newest_digests), step
        with pytest.raises(BatchRejected, match=f"step {step}: conflict: rank 1 seq "
                                                f"{step * 100 + 1} was already received"):
            resend(step, 1, batch(step, 1, x=-1.0))
    journal[5]["ranks"] = [0]  # step 5 published without rank 1 (a straggler timeout)
    assert resend(5, 1) == "late"
    assert agg.counts["duplicate"] == 6 and agg.counts["late"] == 1

    forgetful = Aggregator(remember_steps=80)  # no journal: an old step is not provable
    for step in range(100):
        forgetful.submit(sent[step, 0])
        forgetful.submit(sent[step, 1])
    assert forgetful.submit(sent[90, 0]).status == "duplicate"
    with pytest.raises(BatchRejected, match="step 30: conflict.*comes after the rank"):
        forgetful.submit(sent[30, 0])  # its ranks kept, its digests not: never merged twice
    assert forgetful.submit(sent[5, 0]).status == "late"  # forgotten whole: journaled as late


def test_a_steps_samples_are_located_only_where_a_min_max_or_nonfinite_value_is_shown(
        monkeypatch):
    """Locating where each value came from reads every rank's rows (1024 ranks: 6 ms a
    step): a step that shows no min, no max and no non-finite value never pays it."""
    from metricsvc.service import output

    located = []
    monkeypatch.setattr(output, "winners", lambda *a: located.append(1) or records.winners(*a))
    agg = Aggregator(world_size=2)
    for rank in (0, 1):  # means only
        done = agg.submit(batch(0, rank, kind=ReduceType.MEAN, x=[1.0, 2.0 + rank])).finished
    assert located == [] and done[0].metrics == {"x": 1.75}
    for rank in (0, 1):  # a mean with a NaN: where it came from is said
        done = agg.submit(batch(1, rank, kind=ReduceType.MEAN,
                                x=[1.0, np.nan if rank else 2.0])).finished
    assert located == [1] and done[0].meta["nonfinite_first"] == {"x": {"rank": 1}}
    for rank in (0, 1):  # a max: its rank is named
        done = agg.submit(batch(2, rank, kind=ReduceType.MAX, x=[1.0, 5.0 - rank])).finished
    assert located == [1, 1] and done[0].meta["extremes"] == {"x": {"rank": 0}}
