"""Streams: records with no step barrier from clients that come and go, exported per step."""

import numpy as np
import pytest
import ray

from metricsvc.client import MetricClient
from metricsvc.core import records
from metricsvc.core.wire import Batch
from metricsvc.errors import BatchRejected
from metricsvc.service.engine import Engine as Aggregator


def quiet(client, name="rollout"):
    """A recorder that flushes only when told to."""
    return client.stream(name, flush_every=10**9, flush_interval_s=1e9)


def test_windows_hold_exactly_what_was_flushed_before_each_export(make_worker):
    handle, cfg = make_worker()
    driver = MetricClient(handle, rank=0, world_size=1)
    a, b = quiet(driver), quiet(driver)
    rng = np.random.default_rng(0)
    sent = {0: [], 1: [], 2: []}
    for v in rng.normal(size=5):
        a.stat(reward=np.array([v]))
        sent[0].append(v)
    a.flush()
    assert ray.get(handle.export_stream.remote("rollout", 0, True)) == {
        "rollout/reward/mean": pytest.approx(np.mean(sent[0])),
        "rollout/reward/min": min(sent[0]), "rollout/reward/max": max(sent[0])}
    late = rng.normal(size=3)
    for v in late:
        a.stat(reward=np.array([v]))  # recorded, but not flushed before the next export
    for v in rng.normal(size=4):
        b.stat(reward=np.array([v]))
        sent[1].append(v)
    b.close()  # a client that goes away
    ray.get(handle.export_stream.remote("rollout", 1, True))
    a.close()
    sent[2].extend(late)
    ray.get(handle.export_stream.remote("rollout", 2, True))
    for step in range(3):
        got = ray.get(handle.wait_final.remote(step, 10))
        assert got["metrics"]["rollout/reward/mean"] == pytest.approx(np.mean(sent[step]),
                                                                      rel=1e-12)
        assert got["meta"]["streams"] == ["rollout"]
    total = sum(len(v) for v in sent.values())
    assert total == 12  # nothing lost, nothing twice


def test_many_clients_coming_and_going_lose_and_double_nothing(make_worker):
    handle, cfg = make_worker()
    driver = MetricClient(handle, rank=0, world_size=1)
    rng = np.random.default_rng(1)
    counted = []
    for step in range(6):
        n = 0
        for _ in range(int(rng.integers(1, 4))):  # new short-lived clients every step
            rec = driver.stream("rollout", flush_every=3, flush_interval_s=1e9)
            for _ in range(int(rng.integers(1, 8))):
                rec.stat(reduce="sum", episodes=1.0)
                n += 1
            rec.close()
        counted.append(n)
        ray.get(handle.export_stream.remote("rollout", step, True))
    exported = [ray.get(handle.wait_final_res.remote(s, 10))["rollout/episodes"]
                for s in range(6)]
    assert exported == counted
    health = ray.get(handle.health.remote())
    assert health["stream_windows"] == {"rollout": 0} and health["stream_batches"] >= 6


def test_a_stream_folds_into_a_step_that_ranks_close_later(make_worker):
    handle, cfg = make_worker()
    ranks = [MetricClient(handle, rank=r, world_size=2) for r in range(2)]
    rec = quiet(ranks[0])
    rec.scalar(reward=0.5)
    rec.flush()
    ranks[0].submit_metric({"loss": 1.0})
    ranks[0].wait_submit()
    ray.get(handle.export_stream.remote("rollout", 0))  # step 0 is pending: it joins
    ranks[1].submit_metric({"loss": 3.0})
    ranks[1].wait_submit()
    out = ray.get(handle.wait_final.remote(0, 10))
    assert out["metrics"] == {"loss": 2.0, "rollout/reward": 0.5}
    assert out["meta"]["partial"] is False and "contributors" not in out["meta"]


def test_exporting_to_a_final_step_is_refused_and_the_window_kept(make_worker):
    handle, cfg = make_worker()
    (c,) = [MetricClient(handle, rank=0, world_size=1)]
    c.submit_metric({"loss": 1.0})
    c.wait_submit()
    rec = quiet(c)
    rec.scalar(reward=2.0)
    rec.flush()
    with pytest.raises(ValueError, match="step 0 is already final .* name a later step"):
        ray.get(handle.export_stream.remote("rollout", 0))
    ray.get(handle.export_stream.remote("rollout", 1))
    c.submit_metric({"loss": 1.0})
    c.wait_submit()
    assert ray.get(handle.wait_final_res.remote(1, 10)) == {"loss": 1.0, "rollout/reward": 2.0}


def test_stream_batches_are_idempotent_per_client_and_seq():
    agg = Aggregator()
    row = records.scalar_row(3.0)[None]
    b = Batch.build(step=0, rank=0, world_size=1, seq=1, final=False, keys=("r",), data=row,
                    kinds=[2], expected=[0])
    assert agg.submit_stream("s", "client-a", b)[0] == "merged"
    assert agg.submit_stream("s", "client-a", b)[0] == "duplicate"
    assert agg.submit_stream("s", "client-b", b)[0] == "merged"
    metrics, finished = agg.export_stream("s", 0, close=True)
    assert metrics == {"r": 3.0} and [r.step for r in finished] == [0]
    assert finished[0].meta["partial"] is False and finished[0].meta["world_size"] == 0
    with pytest.raises(BatchRejected, match="already final"):
        agg.export_stream("s", 0)


def test_a_restart_before_the_export_loses_and_doubles_no_stream_batch(make_worker):
    """A stream's batches go through the restart protocol the ranks' use: each is kept until
    the journal holds the step its window was exported into, and resent to a restarted
    actor that lacks it (its window lived in memory)."""
    from tests.helpers import wait_for_new_incarnation

    handle, cfg = make_worker(sinks={"console": None, "jsonl": {}})
    driver = MetricClient(handle, rank=0, world_size=1)
    rec = quiet(driver)
    values = [3.0, 5.0, 11.0]
    rec.stat(reward=np.array(values[:1]))
    rec.flush()
    ray.get(handle.export_stream.remote("rollout", 0, True))
    assert ray.get(handle.wait_final_res.remote(0, 10))["rollout/reward/mean"] == 3.0
    assert ray.get(handle.flush.remote())  # step 0 is journaled
    for v in values[1:]:
        rec.stat(reward=np.array([v]))
        rec.flush()  # step 0's export is durable: what it held is forgotten here
    assert len(rec.sender.outbox) == 2  # the two batches of the window not exported yet
    epoch = ray.get(handle.health.remote())["epoch"]
    ray.kill(handle, no_restart=False)  # the window dies with the actor
    wait_for_new_incarnation(handle, epoch)
    rec.stat(reward=np.array([17.0]))
    rec.flush()  # told epoch_changed: resends the two, then this one
    ray.get(handle.export_stream.remote("rollout", 1, True))
    got = ray.get(handle.wait_final_res.remote(1, 10))
    assert got["rollout/reward/mean"] == pytest.approx(np.mean([5.0, 11.0, 17.0]), rel=1e-15)
    assert got["rollout/reward/min"] == 5.0 and got["rollout/reward/max"] == 17.0
    health = ray.get(handle.health.remote())
    assert health["calls"]["epoch_changed"] == 1 and rec.sender.outbox.resent == 2


def test_a_new_stream_clients_batches_are_owed_until_exported_whatever_step_is_journaled(
        make_worker):
    """A client whose batches no journaled step holds yet owes them all: its batch numbers
    are not steps, so the journal's newest step (here 1, past the batch number 1) says
    nothing of them, and a restart before the export loses none."""
    from tests.helpers import wait_for_new_incarnation

    handle, cfg = make_worker(sinks={"console": None, "jsonl": {}})
    driver = MetricClient(handle, rank=0, world_size=1)
    for step in (0, 1):  # two windows of other clients, journaled
        with quiet(driver) as rec:
            rec.stat(reward=np.array([1.0]))
        ray.get(handle.export_stream.remote("rollout", step, True))
    assert ray.get(handle.flush.remote())
    rec = quiet(driver)  # a new client: its first batch is number 1
    rec.stat(reward=np.array([7.0]))
    ack = rec.flush()
    assert ack["journal_through"] is None and len(rec.sender.outbox) == 1
    epoch = ray.get(handle.health.remote())["epoch"]
    ray.kill(handle, no_restart=False)  # the window dies with the actor
    wait_for_new_incarnation(handle, epoch)
    rec.close()  # resends what the restart lost
    assert ray.get(handle.export_stream.remote("rollout", 2, True)) == {
        "rollout/reward/mean": 7.0, "rollout/reward/min": 7.0, "rollout/reward/max": 7.0}


def test_a_stream_recorder_reaches_the_service_under_per_node_topology(make_worker):
    """Streams have no step barrier, so they go to the MetricWorker itself, not through the
    node's combiner (which gathers ranks' steps)."""
    from metricsvc.core.keys import combiner_name

    handle, cfg = make_worker(topology="per_node")
    node = ray.get_runtime_context().get_node_id()
    combiner = ray.get_actor(combiner_name(cfg.name, node), namespace=cfg.namespace)
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    rec = quiet(client)
    rec.stat(reduce="sum", episodes=2.0)
    rec.close()
    ray.get(handle.export_stream.remote("rollout", 0, True))
    assert ray.get(handle.wait_final_res.remote(0, 10)) == {"rollout/episodes": 2.0}
    ray.kill(combiner)


@ray.remote(num_cpus=0)
class RolloutWorker:
    """An asynchronous rollout worker, AReaL's paradigm: each episode's reward recorded with
    the policy version that generated it."""

    def __init__(self, name):
        self.client = MetricClient(None, rank=0, world_size=1, name=name)
        self.rec = self.client.stream("rollout", flush_every=10**9, flush_interval_s=1e9)

    def episodes(self, rewards, versions):
        for r, v in zip(rewards, versions):
            self.rec.scalar(reward=float(r), version=int(v))
        self.rec.flush()


def test_stream_records_carry_their_policy_version_and_each_step_gets_their_staleness(
        make_worker):
    """Records of several versions (older and newer than the step, negative ones not
    counted) from concurrent workers, exported into two steps: every record counted once,
    the staleness (step minus version) equal to numpy's on every record of the window,
    the counts per version journaled, a record older than max_staleness said."""
    handle, cfg = make_worker(max_staleness=3)
    rng = np.random.default_rng(7)
    workers = [RolloutWorker.remote(cfg.name) for _ in range(3)]
    windows = []
    for step in (10, 11):
        sent = [(rng.normal(size=n), rng.integers(step - 6, step + 2, size=n))
                for n in (5, 9, 2)]
        sent[0][1][0] = -1  # a prompt's version: not counted
        ray.get([w.episodes.remote(*s) for w, s in zip(workers, sent)])
        ray.get(handle.export_stream.remote("rollout", step, True))
        windows.append((step, np.concatenate([v for _, v in sent])))
    for step, versions in windows:
        got = ray.get(handle.wait_final.remote(step, 30))
        metrics, meta = got["metrics"], got["meta"]
        counted = versions[versions >= 0]
        ages = (step - counted).astype(float)
        assert metrics["rollout/staleness/mean"] == pytest.approx(ages.mean(), rel=1e-12)
        assert (metrics["rollout/staleness/min"], metrics["rollout/staleness/max"]) == (
            ages.min(), ages.max())
        for q in (0.5, 0.9, 0.99):
            assert metrics[f"rollout/staleness/p{q * 100:g}"] == pytest.approx(
                np.quantile(ages, q), rel=1e-12, abs=1e-12)
        values, counts = np.unique(counted, return_counts=True)
        assert meta["stream_versions"]["rollout"] == {
            str(v): int(c) for v, c in zip(values, counts)}
        assert not any("__version" in k for k in metrics)  # counted, never exported
        over = meta.get("staleness_over_bound", {}).get("rollout")
        assert (over is not None) == (ages.max() > 3)
        if over:
            assert over == {"oldest_version": int(counted.min()),
                            "staleness": int(ages.max()), "bound": 3}
    for w in workers:
        ray.kill(w)


def test_a_stream_version_that_is_no_int_is_refused_naming_it_and_nothing_is_kept():
    rec = MetricClient(None, rank=0, world_size=1).stream("rollout")
    with pytest.raises(TypeError) as err:
        rec.scalar(reward=1.0, version="v3")
    assert "version=" in str(err.value) and "\n" not in str(err.value)
    assert rec.pending_keys() == []


def test_a_rewind_settles_the_stream_batches_it_superseded_and_only_those():
    """A rewind's ledger, without Ray: each client's batches exported into the steps it
    superseded are settled (never resent: they would land in the rerun's window), unless
    the client has a batch before them in a step still open, which must stay owed."""
    from metricsvc.service.streams import StreamLedger

    ledger = StreamLedger()
    ledger.exported(0, "s", {"a": 2, "b": 1})
    ledger.exported(1, "s", {"a": 4})
    ledger.exported(2, "s", {"b": 3})  # step 2 is not final yet
    ledger.exported(3, "s", {"a": 6, "b": 5})
    settled = ledger.superseded(2, final_through=1)
    assert settled == {"s": {"a": 6}}
    ledger.forget_after(2, settled)
    assert ledger.through("s", "a", None) == 6 and ledger.through("s", "b", None) is None
    assert ledger.through("s", "b", 1) == 1  # step 0 journaled; step 2's batch still owed
    assert ledger.through("s", "b", 2) == 3 and ledger.through("s", "a", 2) == 6
    assert ledger.superseded(5, final_through=5) == {}  # nothing past step 5
