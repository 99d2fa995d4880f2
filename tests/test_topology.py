"""Node-level pre-aggregation: combiners forward each step in one call, results unchanged."""

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import ray

import metricsvc
from metricsvc.core.keys import combiner_name
from metricsvc.errors import ServiceUnavailable
from metricsvc.storage.journal import read_journal
from tests.chaos.test_chaos import calls_for, rank_data
from tests.helpers import pooled_ranks, until_named, wait_for_new_incarnation

WORLD, STEPS = 8, 5


def run(cfg, via):
    ranks = pooled_ranks(cfg.name, WORLD)  # the session's rank processes, fresh clients
    ray.get([a.reset.remote(cfg.name, r, WORLD, via=via(r)) for r, a in enumerate(ranks)])
    ray.get([a.run.remote([], flush=False) for a in ranks])  # all registered
    for step in range(STEPS):
        ray.get([a.run.remote(calls_for(7, step, r) + [_with_ids(step, r)])
                 for r, a in enumerate(ranks)])


def _with_ids(step, rank):
    """The rank's values again, rounded (ties across ranks), with ids unique in the run."""
    data = np.round(rank_data(7, step, rank))
    return ("stat", (), {"ids": np.arange(len(data)) + 1000 * rank, "y": data})


def _extremes_by_numpy(step):
    """Where y's min and max are: numpy on the ranks' data concatenated in rank order."""
    data = [np.round(rank_data(7, step, r)) for r in range(WORLD)]
    where = [(r, i) for r in range(WORLD) for i in range(len(data[r]))]
    flat = np.concatenate(data)
    out = {}
    for name, at in (("y/min", flat.argmin()), ("y/max", flat.argmax())):
        r, i = where[int(at)]
        out[name] = {"rank": r, "id": 1000 * r + i, "row": i, "col": 0, "call": 0}
    return out


@pytest.mark.slow
def test_two_fake_nodes_of_four_ranks_equal_the_flat_topology_exactly(make_worker):
    flat, flat_cfg = make_worker()
    run(flat_cfg, lambda r: None)
    ray.get(flat.wait_final.remote(STEPS - 1, 30))
    flat_health = ray.get(flat.close.remote())

    per_node, cfg = make_worker(topology="per_node")
    for label in ("nodeA", "nodeB"):
        metricsvc.start_combiner(cfg, label)
    run(cfg, lambda r: "nodeA" if r < 4 else "nodeB")
    ray.get(per_node.wait_final.remote(STEPS - 1, 30))
    health = ray.get(per_node.close.remote())

    flat_lines = read_journal(f"{flat_health['run_dir']}/metrics.jsonl")
    lines = read_journal(f"{health['run_dir']}/metrics.jsonl")
    assert [r["step"] for r in lines] == list(range(STEPS))
    assert [r["metrics"] for r in lines] == [r["metrics"] for r in flat_lines]  # bit for bit
    # where each min and max came from: the same through the combiners, and numpy's
    assert [r["meta"]["extremes"] for r in lines] == [r["meta"]["extremes"] for r in flat_lines]
    for r in lines:
        assert {k: r["meta"]["extremes"][k] for k in ("y/min", "y/max")} == \
            _extremes_by_numpy(r["step"])
    assert all(r["meta"]["ranks"] == list(range(WORLD)) for r in lines)
    # the singleton served one call per node per step, not one per rank
    assert health["calls"].get("submit", 0) == 0
    assert health["calls"]["submit_many"] == 2 * STEPS
    for label in ("nodeA", "nodeB"):
        combiner = ray.get_actor(combiner_name(cfg.name, label), namespace=cfg.namespace)
        h = ray.get(combiner.health.remote())
        assert h["calls"]["submit"] == 4 * STEPS and h["calls"]["forward"] == STEPS
        assert h["local_ranks"] == ([0, 1, 2, 3] if label == "nodeA" else [4, 5, 6, 7])
        ray.kill(combiner)


def test_per_node_start_places_one_combiner_on_each_node(make_worker):
    handle, cfg = make_worker(topology="per_node")
    node = ray.get_runtime_context().get_node_id()
    combiner = ray.get_actor(combiner_name(cfg.name, node), namespace=cfg.namespace)
    from metricsvc.client import MetricClient

    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.submit_metric({"x": 2.0})
    c.wait_submit()
    assert c.worker._actor_id == combiner._actor_id  # found by node id, without being told
    assert ray.get(handle.wait_final_res.remote(0, 30)) == {"x": 2.0}
    # Its log lines carry the public name, as the MetricWorker's do: Ray names each actor
    # in its worker's log file, and prefixes the lines it forwards with that name
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    named = {line for path in logs.glob("worker-*.out")
             for line in path.read_text(errors="replace").splitlines()
             if line.startswith(":actor_name:Combiner")}
    assert named == {":actor_name:Combiner"}
    ray.kill(combiner)


def test_a_lone_combiner_resends_an_owed_step_before_the_new_one_after_a_restart(make_worker):
    from pathlib import Path

    from metricsvc.client import MetricClient

    handle, cfg = make_worker(topology="per_node", sinks={"console": None, "jsonl": {}})
    combiner = metricsvc.start_combiner(cfg, "solo")
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name, via="solo")
    # A step the combiner still owes: its ack came before the journal wrote it (the
    # journal's thread may win that race on a loaded machine: then the next step)
    owed = None
    for s in range(12):
        c.submit_metric({"x": float(s)})
        c.wait_submit()
        if s >= 2 and ray.get(combiner.health.remote())["inflight"] >= 1:
            owed = s
            break
    assert owed is not None, "precondition: a step owed (each was journaled before its ack)"
    ray.get(handle.wait_final.remote(owed, 30))
    health = ray.get(handle.health.remote())
    assert ray.get(handle.flush.remote())
    journal = Path(health["run_dir"]) / "metrics.jsonl"
    journal.write_text("".join(journal.read_text().splitlines(keepends=True)[:owed]))
    ray.kill(handle, no_restart=False)  # as if it died before journaling the owed step
    wait_for_new_incarnation(handle, health["epoch"])
    c.submit_metric({"x": float(owed + 1)})
    c.wait_submit()
    assert [ray.get(handle.wait_final_res.remote(s, 30))["x"]
            for s in (owed, owed + 1)] == [float(owed), float(owed + 1)]
    after = ray.get(handle.health.remote())
    assert after["calls"]["epoch_changed"] == 1 and after["late_batches"] == 0
    assert ray.get(combiner.health.remote())["calls"]["resent"] >= 1
    ray.kill(combiner)


def test_batches_reaching_a_combiner_while_it_forwards_their_step_are_not_held_back(
        make_worker):
    """Ranks register with their combiner on first use; the first one's batch is forwarded
    at once. Batches of that step arriving while that forward is still in flight used to
    start a second gathering for the step, which then waited for the first rank again,
    until combiner_timeout_s (30 s)."""
    from metricsvc.client import MetricClient

    handle, cfg = make_worker(topology="per_node", world_size=4)
    clients = [MetricClient(None, rank=r, world_size=4, name=cfg.name) for r in range(4)]
    for step in range(2):
        for c in clients:
            c.submit_metric({"x": float(c.rank + step)})
            c.flush()  # back to back: the next batch arrives while the last is forwarded
        got = ray.get(handle.wait_final_res.remote(step, 10))  # far below the 30 s
        assert got == {"x": 1.5 + step}
    for c in clients:
        c.wait_acks(30)
    node = ray.get_runtime_context().get_node_id()
    ray.kill(ray.get_actor(combiner_name(cfg.name, node), namespace=cfg.namespace))


def test_a_combiner_whose_metric_worker_is_gone_for_good_says_so_at_once(make_worker):
    """One retry rule for every sender (issue 38): a combiner stops retrying at once when
    the MetricWorker is dead for good, as a rank's client does, instead of retrying for
    the whole budget (120 s); the rank hears ServiceUnavailable naming why."""
    import time

    from metricsvc.client import MetricClient
    from metricsvc.errors import ServiceUnavailable

    handle, cfg = make_worker(topology="per_node")
    combiner = metricsvc.start_combiner(cfg, "orphan")
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name, via="orphan")
    c.submit_metric({"x": 1.0})
    c.wait_submit(timeout_s=30)
    ray.kill(handle, no_restart=True)
    c.submit_metric({"x": 2.0})
    start = time.monotonic()
    with pytest.raises(ServiceUnavailable, match="dead for good"):
        c.wait_submit(timeout_s=60)
    assert time.monotonic() - start < 30
    ray.kill(combiner)


def test_stopping_a_per_node_service_ends_the_combiners_it_started(make_worker):
    """A combiner lives as long as a handle to it: the driver that started them held them
    after the service was stopped, each a process forwarding to no run; a new service of
    the same name found the old ones by name (``get_if_exists``), started for the old
    run's config, and the first of them died under it (a script run on the old code)."""
    from metricsvc.client import MetricClient

    handle, cfg = make_worker(topology="per_node", world_size=1)
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    names = [combiner_name(cfg.name, node) for node in nodes]
    old = {ray.get_actor(name, namespace=cfg.namespace)._actor_id for name in names}
    metricsvc.stop_metric_worker(handle)
    until_named(names, cfg.namespace, False, "combiners still alive after stop_metric_worker")
    # The next run of the same name gets combiners of its own, with its own config
    dumped = cfg.model_dump()
    again = metricsvc.start_metric_worker({**dumped, "run": {**dumped["run"], "trial": "next"}})
    new = {ray.get_actor(name, namespace=cfg.namespace)._actor_id for name in names}
    assert not new & old
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.submit_metric({"x": 3.0})
    c.wait_submit(timeout_s=30)
    assert ray.get(again.wait_final_res.remote(0, 30)) == {"x": 3.0}
    # A stop that hears nothing (the service's process stopped) still ends the service
    # and its combiners: it raised Ray's GetTimeoutError and left them all running, the
    # service holding its name and run folder. A stop of the ended service says so.
    os.kill(ray.get(again.health.remote(), timeout=60)["pid"], signal.SIGSTOP)
    with pytest.raises(ServiceUnavailable, match=f"{cfg.name}.*silent for 2 s.*not closed"):
        metricsvc.stop_metric_worker(again, timeout_s=2)
    until_named([*names, cfg.name], cfg.namespace, False,
                "a stop that gave up on a silent service left these running")
    with pytest.raises(ServiceUnavailable, match=f"{cfg.name}.*had already ended"):
        metricsvc.stop_metric_worker(again, timeout_s=2)


def test_a_service_started_right_after_a_stop_of_the_same_name_starts(make_worker):
    """``stop_metric_worker`` then ``start_metric_worker`` of the same name, at once: Ray
    may still resolve the name to the ended actor for a moment, and the start raised
    Ray's ActorDiedError so (the history model's ``stop_and_start_anew``, per node, in a
    loaded make test). The ended service is waited out and a new one starts, each time."""
    from metricsvc.client import MetricClient

    handle, cfg = make_worker(world_size=1)
    dumped = cfg.model_dump()
    for run in range(3):
        metricsvc.stop_metric_worker(handle)  # no wait between: the start comes at once
        handle = metricsvc.start_metric_worker(
            {**dumped, "run": {**dumped["run"], "trial": f"again-{run}"}})
        c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
        c.submit_metric({"x": float(run)})
        c.wait_submit(timeout_s=30)
        assert ray.get(handle.wait_final_res.remote(0, 30)) == {"x": float(run)}
    metricsvc.stop_metric_worker(handle)

