"""Per-node combiners answer every rank as the flat topology does (issue 36): the same
refusals, late batches and notices, word for word, and the same journal lines, on the
session's real multi-node cluster."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import ray

import metricsvc
from metricsvc.client import MetricClient
from metricsvc.core.declare import Derived
from metricsvc.core.keys import combiner_name


def _heard(label: str, call, out: list) -> None:
    """Run ``call``; keep what it raised and warned, as (client, type, message)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
        except Exception as err:  # what the rank meets
            out.append((label, type(err).__name__, str(err)))
    out += [(label, w.category.__name__, str(w.message)) for w in caught
            if w.category.__module__ == "metricsvc.errors"]


def scenario(name: str, handle, via: str | None) -> list:
    """The flat topology's refusal and notice cases, in one run of two ranks."""
    out: list = []

    def client(rank, world=2, start=0):
        return MetricClient(None, rank=rank, world_size=world, name=name, start_step=start,
                            via=via)

    r0, r1 = client(0), client(1)
    r0.declare(Derived("d", "sum(x) / 2", {"x": "x"}))
    r1.declare(Derived("d", "sum(x) * 100", {"x": "x"}))  # the loser: told, data merged
    r0.submit_metric({"x": 1.0, "x y": 1.0})
    r0.flush(step=0)
    # Answered before rank 1 sends: who is told of the collision and of the derived
    # metric follows from the order the batches came in (flushed together, a loaded
    # machine's sender threads sent rank 1's first now and then, in either topology)
    _heard("r0", lambda: r0.wait_acks(30), out)
    r1.submit_metric({"x": 2.0, "x_y": 2.0})  # a tag collision: both ranks told
    r1.flush(step=0)
    _heard("r1", lambda: r1.wait_acks(30), out)

    r0.submit_metric({"x": 3.0})  # step 1: rank 1 straggles, then comes late
    r0.flush(step=1)
    _heard("r0", lambda: r0.wait_acks(30), out)
    assert metricsvc.final_result(handle, 1, 30, meta=True)["meta"]["partial"]
    r1.submit_metric({"x": 4.0})
    _heard("r1", lambda: r1.wait_submit(step=1, timeout_s=30), out)

    rerun = client(0)  # a rerun of step 0 without rewind
    rerun.submit_metric({"x": 5.0})
    _heard("rerun", lambda: rerun.wait_submit(step=0, timeout_s=30), out)
    other = client(0, world=3, start=2)  # another world size
    other.submit_metric({"x": 6.0})
    other.flush(step=2)
    _heard("other", lambda: other.wait_acks(30), out)

    twin = client(1, start=2)  # a second client with rank 1, once step 2 is final: what
    # it hears may not hang on whether its batch overtook rank 0's
    for c, x in ((r0, 7.0), (r1, 8.0)):
        c.submit_metric({"x": x})
        c.flush(step=2)
    for label, c in (("r0", r0), ("r1", r1)):
        _heard(label, lambda c=c: c.wait_acks(30), out)
    twin.submit_metric({"x": 9.0})
    twin.flush(step=2)
    _heard("twin", lambda: twin.wait_acks(30), out)
    runaway = client(0, start=1000)
    runaway.submit_metric({"x": 10.0})
    _heard("runaway", lambda: runaway.wait_submit(step=1000, timeout_s=30), out)
    assert metricsvc.final_result(handle, 2, 30) == {"x": 7.5, "d": 7.5}
    return out


def _events(run_dir: str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line)["event"].items()} for line in lines
            if '"event"' in line]


def test_a_combiner_relays_every_refusal_late_batch_and_notice_word_for_word(make_worker):
    # The straggler timeout only has to end step 1 (rank 1 late): long enough that no
    # other step of a loaded machine times out
    common = dict(world_size=2, straggler_timeout_s=2.0, combiner_timeout_s=0.3,
                  sinks={"console": None, "jsonl": {}})
    flat, flat_cfg = make_worker(**common)
    want = scenario(flat_cfg.name, flat, None)
    flat_health = ray.get(flat.close.remote())

    per_node, cfg = make_worker(topology="per_node", **common)
    combiner = metricsvc.start_combiner(cfg, "group")
    try:
        got = scenario(cfg.name, per_node, "group")
        health = ray.get(per_node.close.remote())
        mine = ray.get(combiner.health.remote())
    finally:
        ray.kill(combiner)
        node = ray.get_runtime_context().get_node_id()
        ray.kill(ray.get_actor(combiner_name(cfg.name, node), namespace=cfg.namespace))
    kinds = {kind for _, kind, _ in want}
    assert {"BatchRejected", "LateBatch", "ServiceNotice"} <= kinds, want
    assert len(want) == 8, "\n".join(map(str, want))
    # the tag collision: both ranks of the step hear it, rank 0 (its "x y" left out) too
    assert [label for label, kind, said in want if "shares the sink tag" in said] == \
        ["r1", "r0"]
    assert got == want
    assert _events(health["run_dir"]) == _events(flat_health["run_dir"])
    assert any(e.get("type") == "late_batch" for e in _events(health["run_dir"]))
    for key in ("rejected_batches", "late_batches"):
        assert health[key] == flat_health[key], key
    assert health["calls"].get("submit", 0) == 0
    report = health["combiners"]["group"]
    # as of its last forward (sent with it): the one it was sending is not counted yet
    assert report["ranks"] == [0, 1] and 0 < report["batches_forwarded"] < mine[
        "batches_forwarded"]
    assert "BatchRejected" in mine["last_error"] and mine["calls"]["rejected_upstream"] == 4


@pytest.mark.parametrize("topology", ["flat", "per_node"])
def test_a_refusal_through_either_topology_is_one_line_of_our_own(make_worker, topology):
    from metricsvc.errors import BatchRejected

    handle, cfg = make_worker(world_size=1, topology=topology)
    via = None
    if topology == "per_node":
        metricsvc.start_combiner(cfg, "solo")
        via = "solo"
    first = MetricClient(None, rank=0, world_size=1, name=cfg.name, via=via)
    first.submit_metric({"x": 1.0})
    first.wait_submit(step=0, timeout_s=30)
    again = MetricClient(None, rank=0, world_size=1, name=cfg.name, via=via)
    again.submit_metric({"x": 2.0})
    with pytest.raises(BatchRejected) as err:
        again.wait_submit(step=0, timeout_s=30)
    assert "\n" not in str(err.value) and "ray::" not in str(err.value)
    assert "rewind(to_step=" in str(err.value)
    if via is not None:
        ray.kill(ray.get_actor(combiner_name(cfg.name, via), namespace=cfg.namespace))
