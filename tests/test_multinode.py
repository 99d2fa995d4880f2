"""The per-node topology on a real multi-node Ray cluster (Ray's own ``Cluster``: the
session's head plus raylet nodes ``node_a`` and ``node_b``, and a third added and removed
here). Combiners are found by each rank's real node id (issue 15)."""

import numpy as np
import pytest
import ray

from metricsvc.core.keys import combiner_name
from metricsvc.storage.journal import read_journal
from tests.chaos.test_chaos import calls_for, expected_for
from tests.helpers import RankActor

pytestmark = pytest.mark.slow

STEPS = 4
PLACEMENT = {0: "node_a", 1: "node_a", 2: "node_a", 3: "node_b", 4: "node_b"}  # 5 ranks


def start_ranks(cfg, placement, ranks=None):
    """Rank actors placed on ``placement``'s nodes, clients of ``cfg``'s service (``ranks``:
    these placed ones again, fresh clients of it: their processes and torch kept)."""
    world = len(placement)
    if ranks is None:
        ranks = {r: RankActor.options(resources={node: 1}).remote(cfg.name, r, world)
                 for r, node in placement.items()}
    else:
        ray.get([a.reset.remote(cfg.name, r, world) for r, a in ranks.items()])
    # connect(): every rank registered with its combiner before the first step
    ray.get([a.run.remote([("connect", (), {})], flush=False) for a in ranks.values()])
    return ranks


def node_of(actor):
    return ray.get(actor.node_id.remote())


def run_steps(ranks, steps, seed=11):
    for step in steps:
        ray.get([a.run.remote(calls_for(seed, step, r)) for r, a in ranks.items()])


def journal(handle, last):
    ray.get(handle.wait_final.remote(last, 60))
    health = ray.get(handle.close.remote())
    return read_journal(f"{health['run_dir']}/metrics.jsonl"), health


def test_per_node_combiners_on_real_nodes_equal_flat_bit_for_bit_one_call_per_node(make_worker):
    flat, flat_cfg = make_worker(world_size=5)
    ranks = start_ranks(flat_cfg, PLACEMENT)
    run_steps(ranks, range(STEPS))
    flat_lines, _ = journal(flat, STEPS - 1)

    handle, cfg = make_worker(world_size=5, topology="per_node")
    ranks = start_ranks(cfg, PLACEMENT, ranks)  # the same processes, on the same nodes
    run_steps(ranks, range(STEPS))
    lines, health = journal(handle, STEPS - 1)
    assert [r["step"] for r in lines] == list(range(STEPS))
    assert [r["metrics"] for r in lines] == [r["metrics"] for r in flat_lines]  # bit for bit
    assert all(r["meta"]["ranks"] == list(range(5)) and not r["meta"]["partial"] for r in lines)
    # The singleton served one call per node with ranks per step, none per rank.
    assert health["calls"].get("submit", 0) == 0
    assert health["calls"]["submit_many"] == 2 * STEPS
    for node in ("node_a", "node_b"):
        members = sorted(r for r, n in PLACEMENT.items() if n == node)
        node_id = node_of(ranks[members[0]])
        assert {node_of(ranks[r]) for r in members} == {node_id}
        combiner = ray.get_actor(combiner_name(cfg.name, node_id), namespace=cfg.namespace)
        h = ray.get(combiner.health.remote())
        assert h["local_ranks"] == members  # found by the ranks' real node id
        assert h["calls"]["submit"] == len(members) * STEPS and h["calls"]["forward"] == STEPS
    for a in ranks.values():
        ray.kill(a)


@pytest.mark.removes_nodes
def test_a_removed_node_makes_its_ranks_steps_partial_and_the_others_never_notice(
        make_worker, ray_cluster):
    node_c = ray_cluster.add_node(num_cpus=1, resources={"node_c": 1000})
    ray_cluster.wait_for_nodes()
    placement = {**PLACEMENT, 5: "node_c", 6: "node_c"}
    # A timeout well past the spread of one step's 7 calls, issued at once (their first steps
    # close within it, loaded or not); the partial steps wait it out.
    handle, cfg = make_worker(world_size=7, topology="per_node", straggler_timeout_s=2.5)
    ranks = start_ranks(cfg, placement)
    run_steps(ranks, range(2))
    ray.get(handle.wait_final.remote(1, 30))
    ray_cluster.remove_node(node_c)  # its raylet, its ranks and its combiner are gone
    survivors = {r: a for r, a in ranks.items() if placement[r] != "node_c"}
    for step in range(2, 4):
        results = ray.get([a.run.remote(calls_for(11, step, r)) for r, a in survivors.items()])
        assert all(x["ack"]["status"] in ("accepted", "merged") for x in results), results
    lines, health = journal(handle, 3)
    assert [r["step"] for r in lines] == list(range(4))
    for r in lines:
        step, meta = r["step"], r["meta"]
        present = range(7) if step < 2 else sorted(survivors)
        assert meta["partial"] is (step >= 2) and meta["ranks"] == list(present)
        assert meta["missing_ranks"] == ([] if step < 2 else [5, 6])
        expected = expected_for(11, step, present)
        assert r["metrics"] == pytest.approx(expected, rel=1e-12), step
    assert health["partial_steps"] == 2
    for a in survivors.values():
        ray.kill(a)
    assert np.isfinite(health["uptime_s"])


def test_the_singleton_runs_on_the_node_of_the_driver_that_starts_it(make_worker):
    """Its run folder is then on the driver's disk, where the driver resolved it, and a node
    that an autoscaler (or another test) removes never takes the service with it. Ray
    spreads a zero-CPU actor over the nodes by itself: five services would all land on the
    driver's node by chance about once in a hundred runs."""
    here = ray.get_runtime_context().get_node_id()
    handles = [make_worker()[0] for _ in range(5)]
    nodes = [h["node_id"] for h in ray.get([handle.health.remote() for handle in handles])]
    assert nodes == [here] * 5


@pytest.mark.removes_nodes
def test_a_node_removed_while_the_service_starts_gets_no_combiner_and_stops_no_start(
        make_worker, ray_cluster):
    """``per_node`` starts a combiner on each node ``ray.nodes()`` lists; a node an
    autoscaler (or another test worker of the shared cluster) removes before its combiner
    is placed has no ranks to serve: the start goes on without it (it raised Ray's
    ActorUnschedulableError, and make test failed so). A node named by hand that is gone
    is refused naming it."""
    from metricsvc.service.combiner import start_combiner, start_node_combiners

    gone = ray_cluster.add_node(num_cpus=1, resources={"node_gone": 1})
    ray_cluster.wait_for_nodes()
    gone_id = gone.node_id
    ray_cluster.remove_node(gone)  # still in the listing a starting service just read
    here = ray.get_runtime_context().get_node_id()
    handle, cfg = make_worker(world_size=1)
    started = start_node_combiners(cfg, [here, gone_id])
    assert sorted(started) == [here]
    assert ray.get(started[here].health.remote())["node"] == here
    with pytest.raises(ValueError, match=f"node {gone_id}.*is not alive"):
        start_combiner(cfg, gone_id, node_id=gone_id)
    ray.get(handle.close.remote())
