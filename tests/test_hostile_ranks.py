"""A confused or hostile rank cannot corrupt, swallow or stall anyone else's data.

Whoever is wrong is the one refused, with a clear error; everyone else's data is
merged; the service keeps finishing steps.
"""

import dataclasses
import functools
import time
import tracemalloc
import warnings

import numpy as np
import pytest
import ray

from metricsvc.client import MetricClient
from metricsvc.core import records
from metricsvc.core.limits import Limits
from metricsvc.core.reduce import AUTO, ReduceType
from metricsvc.core.sketch import SketchSpec, sparse_counts
from metricsvc.core.wire import Batch, decode, encode
from metricsvc.errors import BatchRejected
from metricsvc.service.engine import Engine as Aggregator


def batch(step, rank, world_size=2, seq=None, final=True, kind=AUTO, **values):
    keys = tuple(values)
    data = [records.summarize_array(np.atleast_1d(np.asarray(v, dtype=float)))
            for v in values.values()]
    return Batch.build(step=step, rank=rank, world_size=world_size,
                       seq=seq if seq is not None else step + 1, final=final, keys=keys,
                       data=np.array(data).reshape(len(keys), records.NFIELDS),
                       kinds=[int(kind)] * len(keys), expected=[0] * len(keys))


def with_row(b, **fields):
    data = b.data.copy()
    for name, value in fields.items():
        data[0, records.FIELDS.index(name)] = value
    return dataclasses.replace(b, data=data)


# -- the run's world size ------------------------------------------------------------------
@pytest.mark.parametrize("wrong", [1, 2, 5])
def test_a_configured_world_size_refuses_a_confused_rank_whatever_the_arrival_order(wrong):
    agg = Aggregator(world_size=3)
    with pytest.raises(BatchRejected, match=f"rank 0 sent world_size {wrong}, but the run's "
                                            f"world size is 3 \\(config\\)"):
        agg.submit(batch(0, 0, world_size=wrong, x=100.0))
    agg.submit(batch(0, 0, world_size=3, x=1.0))
    agg.submit(batch(0, 1, world_size=3, x=2.0))
    (done,) = agg.submit(batch(0, 2, world_size=3, x=3.0)).finished
    assert done.metrics == {"x": 2.0} and done.meta["partial"] is False
    assert agg.counts["rejected"] == 1


def test_without_config_a_majority_of_ranks_fixes_the_world_size_and_the_odd_one_is_refused():
    agg = Aggregator()
    # The confused rank arrives first: it claims 2, which would need 2 ranks to agree.
    assert agg.submit(batch(0, 1, world_size=2, x=100.0)).finished == []
    agg.submit(batch(0, 0, world_size=4, x=1.0))
    agg.submit(batch(0, 2, world_size=4, x=2.0))
    assert agg.world_size is None and agg.pending.summary()[0]["closed"] == [0, 1, 2]
    out = agg.submit(batch(0, 3, world_size=4, x=3.0))  # 3 of 4 agree: a majority
    assert out.status == "merged" and out.finished == []
    assert agg.world_size == 4 and agg.world.source == "agreed by ranks [0, 2, 3]"
    assert agg.pending.summary()[0]["closed"] == [0, 2, 3]  # rank 1's claim is gone
    # The confused rank hears at its next call why its batch was dropped, and is refused.
    with pytest.raises(BatchRejected, match="world size is 4.*earlier: your batch for step 0 "
                                            "was dropped: rank 1 claimed world_size 2"):
        agg.submit(batch(1, 1, world_size=2, x=100.0))
    (done,) = agg.submit(batch(0, 1, world_size=4, seq=9, x=6.0)).finished  # fixed, resent
    assert done.metrics == {"x": 3.0} and done.meta["ranks"] == [0, 1, 2, 3]
    assert agg.counts["dropped"] == 1


def test_without_a_majority_a_timed_out_step_takes_the_size_most_ranks_claim():
    agg = Aggregator(straggler_timeout_s=1.0, clock=lambda: 0.0)
    agg.submit(batch(0, 0, world_size=1, x=100.0))  # a lone rank: a majority of "1"
    assert agg.world_size == 1  # a one-rank run cannot be told from it: set world_size
    agg = Aggregator(straggler_timeout_s=1.0, clock=lambda: 0.0)
    agg.submit(batch(0, 1, world_size=8, x=1.0))
    agg.submit(batch(0, 2, world_size=8, x=3.0))
    agg.submit(batch(0, 3, world_size=4, x=100.0))
    assert agg.expire(now=0.5) == []
    (done,) = agg.expire(now=2.0)
    assert agg.world.source == "claimed by ranks [1, 2] at the straggler timeout"
    assert done.metrics == {"x": 2.0} and done.meta["missing_ranks"] == [0, 3, 4, 5, 6, 7]


def test_a_lone_rank_claiming_world_size_one_cannot_finish_a_configured_run():
    agg = Aggregator(world_size=2)
    with pytest.raises(BatchRejected, match="world_size 1"):
        agg.submit(batch(0, 0, world_size=1, x=100.0))
    assert agg.last_emitted is None and agg.pending.summary() == {}


# -- conflicts: two clients with one rank --------------------------------------------------
def test_same_step_rank_seq_with_other_content_is_a_conflict_before_and_after_the_step():
    agg = Aggregator(world_size=2)
    agg.submit(batch(0, 0, seq=1, x=1.0))
    with pytest.raises(BatchRejected, match="conflict: rank 0 seq 1 was already received"):
        agg.submit(batch(0, 0, seq=1, x=50.0))
    assert agg.submit(batch(0, 0, seq=1, x=1.0)).status == "duplicate"  # byte-identical
    (done,) = agg.submit(batch(0, 1, seq=1, x=3.0)).finished
    assert done.metrics == {"x": 2.0}
    with pytest.raises(BatchRejected, match="conflict: rank 1 seq 1 was already received"):
        agg.submit(batch(0, 1, seq=1, x=70.0))
    with pytest.raises(BatchRejected, match="conflict: rank 1 seq 2 comes after"):
        agg.submit(batch(0, 1, seq=2, x=70.0))
    assert agg.submit(batch(0, 1, seq=1, x=3.0)).status == "duplicate"
    assert agg.counts["conflict"] == 3 and agg.counts["duplicate"] == 2


# -- runaway ranks -------------------------------------------------------------------------
def test_a_runaway_rank_is_refused_and_the_others_finish_every_step():
    agg = Aggregator(world_size=2, max_steps_ahead=4, max_pending_steps=8)
    agg.submit(batch(0, 0, x=1.0))
    with pytest.raises(BatchRejected, match="step 1000 from rank 1 is 1000 steps ahead of the "
                                            "oldest open step 0 \\(limit max_steps_ahead=4\\)"):
        agg.submit(batch(1000, 1, x=9.0))
    for step in range(1, 5):  # rank 0 races ahead within the bound
        agg.submit(batch(step, 0, x=1.0))
    with pytest.raises(BatchRejected, match="limit max_steps_ahead=4"):
        agg.submit(batch(5, 0, x=1.0))
    done = []
    for step in range(5):
        done += agg.submit(batch(step, 1, x=3.0)).finished
    assert [r.step for r in done] == list(range(5))
    assert all(r.metrics == {"x": 2.0} and not r.meta["partial"] for r in done)


def test_a_runaway_that_arrives_first_is_dropped_when_the_real_first_step_opens():
    clock = [0.0]
    agg = Aggregator(world_size=2, max_steps_ahead=4, straggler_timeout_s=10.0,
                     clock=lambda: clock[0])
    agg.submit(batch(1000, 1, x=9.0))  # nothing else known yet: taken for now
    agg.submit(batch(0, 0, x=1.0))  # the run's real first step: 1000 is a runaway
    assert list(agg.pending.summary()) == [0] and agg.newest_closed == 0
    with pytest.raises(BatchRejected, match="earlier: your batch for step 1000 was dropped"):
        agg.submit(batch(1001, 1, x=9.0))
    clock[0] = 5.0
    (done,) = agg.submit(batch(0, 1, x=3.0)).finished
    assert done.metrics == {"x": 2.0}
    clock[0] = 100.0
    assert agg.expire() == []  # nothing far ahead is left to time out and swallow steps
    (done,) = agg.submit(batch(1, 0, x=1.0)).finished or agg.submit(batch(1, 1, x=1.0)).finished
    assert done.step == 1 and done.meta["partial"] is False


# -- late batches --------------------------------------------------------------------------
def test_late_batches_are_counted_per_rank():
    agg = Aggregator(world_size=2, straggler_timeout_s=1.0, clock=lambda: 0.0)
    agg.submit(batch(0, 0, x=1.0))
    agg.expire(now=5.0)
    assert agg.submit(batch(0, 1, x=1.0)).status == "late"
    assert agg.late_by_rank == {1: 1}


# -- every field is validated before anything merges ---------------------------------------
@pytest.mark.parametrize(
    ("fields", "rule"),
    [
        ({"nonfinite": np.inf}, "nonfinite must be a whole number"),
        ({"nonfinite": 0.5}, "nonfinite must be a whole number"),
        ({"nonfinite": 2.0**60}, "nonfinite must be a whole number"),
        ({"count": np.inf}, "count must be finite"),
        ({"count": 2.0**60}, "count must be finite"),
        ({"count": 1.5}, "count must be a whole number"),
        ({"min": 5.0, "max": 1.0}, "finite min <= max"),
        ({"max": np.inf}, "finite min <= max"),
        ({"m2_root": -1.0}, "m2_root must be >= 0"),
        ({"sum_lo": 1.0}, "sum_lo must be the low part of sum"),
        ({"sum_lo": np.nan}, "sum_lo must be the low part of sum"),
        ({"count": 0.0}, "an empty record"),
    ],
)
def test_records_that_could_not_be_merged_or_finalised_are_refused(fields, rule):
    agg = Aggregator(world_size=1)
    with pytest.raises(BatchRejected, match=f"key 'x': corrupt record .*{rule}"):
        agg.submit(with_row(batch(0, 0, world_size=1, kind=ReduceType.SUM, x=[1.0, 2.0]),
                            **fields))
    assert agg.pending.summary() == {} and agg.counts["rejected"] == 1


def test_weighted_means_keep_fractional_counts():
    agg = Aggregator(world_size=1)
    b = Batch.build(step=0, rank=0, world_size=1, seq=1, final=True, keys=("w",),
                    data=records.scalar_row(4.0, 0.25)[None], kinds=[int(ReduceType.AVG)],
                    expected=[0])
    (done,) = agg.submit(b).finished
    assert done.metrics == {"w": 4.0}


def quantile_batch(values, rank=0, world_size=1, seq=1, counts_scale=1.0):
    spec = SketchSpec()
    codes, counts = sparse_counts(np.asarray(values), spec)
    row = records.summarize_array(np.asarray(values))
    return Batch.build(step=0, rank=rank, world_size=world_size, seq=seq, final=True,
                       keys=("q",), data=row[None], kinds=[int(ReduceType.QUANTILES)],
                       expected=[0], sketches={0: (codes, counts * counts_scale)})


@pytest.mark.parametrize(("scale", "rule"), [(1e300, "whole numbers in"), (2.0, "holds 6 values"),
                                            (0.5, "whole numbers in")])
def test_sketches_whose_buckets_disagree_with_their_record_are_refused(scale, rule):
    agg = Aggregator(world_size=1)
    with pytest.raises(BatchRejected, match=rule):
        agg.submit(quantile_batch([1.0, 2.0, 3.0], counts_scale=scale))
    (done,) = agg.submit(quantile_batch([1.0, 2.0, 3.0])).finished
    assert done.metrics["q/p50"] == pytest.approx(2.0, rel=0.02)


def test_sizes_are_checked_from_the_header_before_any_per_key_allocation():
    keys = tuple(f"{i:x}" for i in range(300_000))
    big = Batch.build(step=0, rank=0, world_size=1, seq=1, final=True, keys=keys,
                      data=records.identity(len(keys)), kinds=[0] * len(keys),
                      expected=[0] * len(keys))
    blob = encode(big)
    tracemalloc.start()
    try:
        with pytest.raises(BatchRejected, match="batch has 300000 keys; the limit is 1000"):
            decode(blob, Limits(max_keys_per_batch=1000, max_batch_bytes=len(blob)))
        with pytest.raises(BatchRejected, match="bytes; the limit is 4096"):
            decode(blob, Limits(max_batch_bytes=4096))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak  # the 300,000 keys were never split out
    lying = blob[:33] + (10).to_bytes(4, "little") + blob[37:]  # header: 10 keys
    with pytest.raises(BatchRejected, match="header describes"):
        decode(lying, Limits(max_batch_bytes=len(blob), max_keys_per_batch=len(keys)))


# -- on a live actor -----------------------------------------------------------------------
@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, name, rank, world_size, start_step=0):
        self.client = MetricClient(None, rank=rank, world_size=world_size, name=name,
                                   start_step=start_step)

    def step(self, value):
        self.client.stat(x=np.array([value]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ack = self.client.wait_submit()
            except ValueError as err:
                return {"error": str(err)}
        return {"status": ack["status"], "warnings": [str(w.message) for w in caught]}


def test_on_the_actor_confused_runaway_and_late_ranks_are_told_and_the_others_go_on(make_worker):
    handle, cfg = make_worker(world_size=2, straggler_timeout_s=1.0)
    good = [Rank.remote(cfg.name, r, 2) for r in range(2)]
    confused = Rank.remote(cfg.name, 0, 1)  # world_size 1
    runaway = Rank.remote(cfg.name, 0, 2, start_step=1000)
    out = ray.get(confused.step.remote(100.0))
    assert "the run's world size is 2 (config)" in out["error"]
    assert [o["status"] for o in ray.get([g.step.remote(1.0) for g in good])] == ["merged"] * 2
    out = ray.get(runaway.step.remote(100.0))
    assert "is 999 steps ahead of the oldest open step 1" in out["error"]
    for _ in range(2):
        assert [o["status"] for o in ray.get([g.step.remote(1.0) for g in good])] == \
            ["merged"] * 2
    ray.get(good[0].step.remote(1.0))  # rank 1 stalls on step 3: the step ends partial
    result = ray.get(handle.wait_final.remote(3, 30))
    assert result["meta"]["missing_ranks"] == [1]
    late = ray.get(good[1].step.remote(5.0))
    assert late["status"] == "late" and "published without it" in late["warnings"][0]
    health = ray.get(handle.health.remote())
    assert health["late_by_rank"] == {1: 1} and health["world_size"] == 2
    assert health["rejected_batches"] == 2 and health["pending_steps"] == {}
    assert [ray.get(handle.wait_final_res.remote(s, 5)) for s in range(3)] == [{
        "x/mean": 1.0, "x/min": 1.0, "x/max": 1.0}] * 3


def test_a_second_client_with_the_same_rank_is_refused_as_a_conflict(make_worker):
    handle, cfg = make_worker(world_size=2)
    first, twin, other = (Rank.remote(cfg.name, 0, 2), Rank.remote(cfg.name, 0, 2),
                          Rank.remote(cfg.name, 1, 2))
    assert ray.get(first.step.remote(1.0))["status"] == "merged"
    out = ray.get(twin.step.remote(7.0))
    assert "conflict: rank 0 seq 1 was already received with other content" in out["error"]
    ray.get(other.step.remote(3.0))
    assert ray.get(handle.wait_final_res.remote(0, 10)) == {"x/mean": 2.0, "x/min": 1.0,
                                                             "x/max": 3.0}
    assert ray.get(handle.health.remote())["conflicting_batches"] == 1


def test_a_hostile_batch_is_refused_and_the_straggler_timer_keeps_firing(make_worker):
    handle, cfg = make_worker(world_size=2, straggler_timeout_s=0.5)
    hostile = with_row(batch(0, 1, kind=ReduceType.SUM, x=[1.0]), nonfinite=np.inf)
    with pytest.raises(BatchRejected, match="nonfinite must be a whole number"):
        ray.get(handle.submit.remote(encode(hostile)))
    rank0 = Rank.remote(cfg.name, 0, 2)
    for step in range(2):  # rank 1 never closes: each step ends partial by the timer
        ray.get(rank0.step.remote(1.0))
        result = ray.get(handle.wait_final.remote(step, 20))
        assert result["meta"]["partial"] and result["meta"]["missing_ranks"] == [1]
    health = ray.get(handle.health.remote())
    assert health["timer_errors"] == 0 and health["rejected_batches"] == 1


# -- wire-level fuzz -----------------------------------------------------------------------
HEADER_FIELDS = [  # offset, struct format of each header field of metricsvc.core.wire
    (0, "<q"), (8, "<i"), (12, "<i"), (16, "<q"), (24, "<B"), (25, "<d"), (33, "<I"),
    (37, "<I"), (41, "<I"), (45, "<I"),
]
NASTY = [np.nan, np.inf, -np.inf, 0.0, -0.0, -1.0, 0.5, 1e308, -1e308, 2.0**53, 2.0**60, 5e-324]


@functools.lru_cache(maxsize=64)  # bytes: the fuzz test mutates the same one 2000 times
def base_blob(step, rank, seq):
    """A valid batch with a mean, a sum and a quantile key (and its sketch)."""
    spec = SketchSpec()
    q = np.array([0.5, 1.5, 2.5, 40.0])
    codes, counts = sparse_counts(q, spec)
    data = np.stack([records.summarize_array(np.array([1.0, 2.0])),
                     records.summarize_array(np.array([3.0])), records.summarize_array(q)])
    return encode(Batch.build(
        step=step, rank=rank, world_size=2, seq=seq, final=True, keys=("m", "s/total", "q"),
        data=data, kinds=[int(ReduceType.AVG), AUTO, int(ReduceType.QUANTILES)],
        expected=[0, 0, 0], sketches={2: (codes, counts)}))


HOSTILE_FORMULAS = [
    "sum(x)", "(mean(x) - 1) ** 0.5", "1 / (sum(x) - sum(x))", "sum(x) ** sum(x) ** 99",
    "__import__('os')", "x", "(" * 300 + "1" + ")" * 300, "size(x) * " * 400 + "1",
    "max_all(x)", "sum_of_sums(x)", "total(total(sum(x)))", "mean(x) if 1 else 2", "",
]
HOSTILE_PATTERNS = [
    "m", "k/" + "a*" * 40 + "b", "k/<a><b>", "*/*/*", "<", "q*", "s/<t>", "a/" * 300,
    "\x00", "m/<a>*",
]


def hostile_declarations(count, formula, pattern):
    """Declarations as a hostile rank might send them: many, odd formulas, odd patterns."""
    import json

    item = [f"d/{formula % 7}", HOSTILE_FORMULAS[formula % len(HOSTILE_FORMULAS)],
            [["x", HOSTILE_PATTERNS[pattern % len(HOSTILE_PATTERNS)]]]]
    return json.dumps([item] * count).encode()


def mutations():
    from hypothesis import strategies as st

    header = st.tuples(st.just("header"), st.sampled_from(range(len(HEADER_FIELDS))),
                       st.integers(-2**63, 2**64 - 1), st.sampled_from(NASTY))
    cell = st.tuples(st.just("cell"), st.integers(0, 2), st.integers(0, 5),
                     st.sampled_from(NASTY))
    column = st.tuples(st.just("column"), st.sampled_from(["kinds", "expected", "sketch_counts",
                                                           "sketch_codes", "sketch_offsets",
                                                           "sketch_rows"]),
                       st.integers(0, 3), st.integers(-2**31, 2**31 - 1))
    raw = st.tuples(st.sampled_from(["truncate", "extend", "flip"]), st.integers(0, 400),
                    st.integers(0, 255), st.just(0.0))
    derived = st.tuples(st.just("derived"), st.integers(0, 2500), st.integers(0, 10**6),
                        st.integers(0, 10**6))
    return st.lists(st.one_of(header, cell, column, raw, derived), min_size=1, max_size=3)


def mutate(blob, ops):
    for op in ops:
        blob = mutate_once(blob, *op)
    return blob


def mutate_once(blob, op, where, value, number):
    import struct

    if op == "header":
        offset, fmt = HEADER_FIELDS[where]
        if len(blob) < offset + struct.calcsize(fmt):
            return blob
        b = bytearray(blob)
        if fmt == "<d":
            struct.pack_into(fmt, b, offset, number)
        else:
            bits = 8 * struct.calcsize(fmt)
            low = -(2 ** (bits - 1)) if fmt[1].islower() else 0
            struct.pack_into(fmt, b, offset, low + value % 2**bits)
        return bytes(b)
    if op == "truncate":
        return blob[: where % (len(blob) + 1)]
    if op == "extend":
        return blob + bytes([value]) * (where % 17 + 1)
    if op == "flip":
        b = bytearray(blob)
        if b:
            b[where % len(b)] ^= value or 1
        return bytes(b)
    try:
        b = decode(blob, Limits(max_batch_bytes=1 << 30))
    except BatchRejected:
        return blob  # an earlier mutation broke the framing: no field to address
    if op == "derived":
        return encode(dataclasses.replace(b, derived=hostile_declarations(where, value,
                                                                          int(number))))
    if op == "cell":
        if where >= len(b.keys):
            return blob
        data = b.data.copy()
        data[where, value] = number
        return encode(dataclasses.replace(b, data=data))
    arr = getattr(b, where).copy()
    if not arr.size:
        return blob
    arr[value % arr.size] = np.asarray(value * 7919 % 2**31).astype(arr.dtype)
    return encode(dataclasses.replace(b, **{where: arr}))


@pytest.fixture(scope="module")
def fuzzed_service(ray_cluster, tmp_path_factory):
    import metricsvc

    cfg = {"name": "wire-fuzz", "world_size": 2, "straggler_timeout_s": 0.5,
           "sinks": {"console": None, "jsonl": {}},
           "run": {"root": str(tmp_path_factory.mktemp("wire-fuzz")), "trial": "t"}}
    handle = metricsvc.start_metric_worker(cfg)
    for rank in range(2):  # an honest step 0 first: the run has an anchor
        ray.get(handle.submit.remote(base_blob(0, rank, 1)))
    assert ray.get(handle.wait_final_res.remote(0, 10))["m"] == 1.5
    yield handle
    ray.kill(handle)


def fuzz_examples():
    import os

    return int(os.environ.get("METRICSVC_FUZZ_EXAMPLES", "2000"))


@pytest.mark.slow
def test_mutated_wire_batches_among_honest_ranks_are_merged_or_refused_clearly(fuzzed_service):
    from hypothesis import HealthCheck, given, settings

    handle = fuzzed_service
    seen = {"merged": 0, "refused": 0}
    mutants: list[tuple[list, bytes]] = []

    @settings(max_examples=fuzz_examples(), deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(ops=mutations())
    def one(ops):
        mutants.append((ops, mutate(base_blob(1, 1, 2), ops)))

    one()

    def submitted(blob):
        """One call (a refusal raised through Ray, as a rank sees it): its ack or refusal."""
        try:
            return ray.get(handle.submit.remote(blob), timeout=30)
        except BatchRejected as err:
            return err

    # The first hundred one call each, the rest a hundred a call (submit_many, what a
    # combiner forwards: each merged or refused as submit would, in order; the same
    # verdicts at a fraction of the calls)
    for start in range(0, len(mutants), 100):
        chunk = mutants[start:start + 100]
        answers = [submitted(blob) for _, blob in chunk] if start == 0 else ray.get(
            handle.submit_many.remote([blob for _, blob in chunk]), timeout=60)["answers"]
        assert len(answers) == len(chunk)
        for (ops, _), answer in zip(chunk, answers):
            if isinstance(answer, BatchRejected):
                assert str(answer).strip() and \
                    "Traceback" not in str(answer).split("\n")[-1], ops
                seen["refused"] += 1
            else:
                assert answer["status"] in ("merged", "duplicate", "late", "held"), (ops, answer)
                seen["merged"] += 1
    assert seen["refused"] > 0 and seen["merged"] > 0, seen
    start = time.perf_counter()
    ray.get(handle.health.remote(), timeout=1.0)  # hostile declarations included
    assert time.perf_counter() - start < 1.0
    # Afterwards: whatever the mutants opened times out, and honest steps are exact.
    deadline = time.monotonic() + 60
    while ray.get(handle.health.remote())["pending_steps"]:
        assert time.monotonic() < deadline, "mutant steps never timed out"
        time.sleep(0.2)
    health = ray.get(handle.health.remote())
    assert health["timer_errors"] == 0
    step = health["last_final_step"] + 1
    for rank in range(2):
        ray.get(handle.submit.remote(base_blob(step, rank, 10_000 + step)))
    result = ray.get(handle.wait_final.remote(step, 10))
    assert result["metrics"]["m"] == 1.5 and result["metrics"]["s/total"] == 6.0
    assert result["meta"]["partial"] is False
    ray.get(handle.submit.remote(base_blob(step + 1, 0, 20_000 + step)))  # rank 1 never comes
    late = ray.get(handle.wait_final.remote(step + 1, 20))
    assert late["meta"]["partial"] and late["meta"]["missing_ranks"] == [1]


def test_the_quick_check_of_plain_records_accepts_nothing_the_rules_refuse():
    """A batch of plain records is accepted in a few passes over the whole matrix
    (``_plainly_whole``); what it does not accept goes through every rule. Records mutated
    a field at a time (NaN, infinities, -0.0, halves, 2**53 and past it, negatives, the
    float64 extremes, subnormals): the service's verdict is the rules' verdict, anything the
    quick check accepts passes every rule, and a refusal names the key."""
    from metricsvc.core.wire import check as check_batch
    from metricsvc.core.wire import check_each_rule, plainly_whole

    rng = np.random.default_rng(11)
    values = [np.nan, np.inf, -np.inf, -0.0, 0.0, 0.5, 1.0, 2.0**53, 2.0**53 + 2, -1.0,
              1e308, -1e308, 5e-324, 3.0, 1e-300]
    keys = tuple(f"k{i}" for i in range(12))
    base = records.scalar_rows(rng.normal(size=12) * 1e3)
    base[3] = records.summarize_array(rng.normal(size=50))  # a record of many values
    quick_accepted = refused = 0
    for _ in range(4000):
        data = base.copy()
        for _ in range(int(rng.integers(0, 3))):
            data[rng.integers(0, 12), rng.integers(0, records.NFIELDS)] = \
                values[rng.integers(0, len(values))]
        batch = Batch.build(step=0, rank=0, world_size=1, seq=1, final=True, keys=keys,
                            data=data, kinds=[int(AUTO)] * 12, expected=[0] * 12)
        try:
            check_each_rule(batch)
            valid = True
        except BatchRejected as err:
            valid = False
            assert any(repr(k) in str(err) for k in keys), err
        quick = plainly_whole(batch.data)
        assert valid or not quick, batch.data
        try:
            check_batch(batch)
            verdict = True
        except BatchRejected:
            verdict = False
        assert verdict == valid, batch.data
        quick_accepted += quick
        refused += not valid
    assert quick_accepted > 500 and refused > 500  # both sides of both checks are seen
