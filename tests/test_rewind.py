"""Resuming from a checkpoint: rewind(to_step=k), and steps after k are recorded afresh;
the superseded values are archived, never deleted, and every reader and sink shows the
rerun (where the backend can)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

import metricsvc
from metricsvc.client import MetricClient
from metricsvc.core.keys import combiner_name
from metricsvc.storage.journal import read_journal
from tests import readback


def _steps(name, values, start):
    client = MetricClient(None, rank=0, world_size=1, name=name, start_step=start)
    for step, value in enumerate(values, start):
        client.submit_metric({"x": value})
        client.wait_submit(step=step, timeout_s=30)


def _tensorboard_seen(logdir: Path) -> dict[int, float]:
    """What TensorBoard shows for 'x': its reader, with its purge of orphaned data."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), purge_orphaned_data=True)
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("x")}


def _mlflow_points(run: Path) -> list[tuple[int, float]]:
    import os

    import mlflow

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = next(p for p in run.rglob("mlruns") if p.is_dir())
    client = mlflow.MlflowClient(tracking_uri=str(uri))
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    (found,) = client.search_runs([experiment.experiment_id])
    return [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "x")]


def test_rewind_records_steps_afresh_and_every_reader_shows_the_rerun(ray_cluster, tmp_path):
    cfg = {"name": "rewind-a", "world_size": 1, "sinks": {"console": None, "jsonl": {},
                                                          "tensorboard": {}, "wandb": {},
                                                          "swanlab": {}, "mlflow": {},
                                                          "trackio": {}},
           "run": {"root": str(tmp_path), "experiment": "e", "trial": "t"}}
    handle = metricsvc.start_metric_worker(cfg)
    _steps("rewind-a", [float(s) for s in range(8)], 0)
    with pytest.raises(ValueError, match="rewind"):  # without rewind, a rerun is refused
        _steps("rewind-a", [40.0], 4)
    assert ray.get(handle.rewind.remote(to_step=3)) == {"to_step": 3, "superseded": 4}
    _steps("rewind-a", [40.0, 50.0, 60.0, 70.0, 80.0], 4)  # the rerun, and one step more
    assert ray.get(handle.wait_final_res.remote(5, 10)) == {"x": 50.0}
    health = ray.get(handle.close.remote())
    assert not health["sink_errors"], health["sink_errors"]
    run = Path(health["run_dir"])
    want = {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0, 5: 50.0, 6: 60.0, 7: 70.0, 8: 80.0}

    stats: dict = {}
    journal = read_journal(run / "metrics.jsonl", stats)
    assert {r["step"]: r["metrics"]["x"] for r in journal} == want
    assert stats["archived"] == 4  # the superseded steps stay in the file
    assert sum('"x": 5.0' in line for line in (run / "metrics.jsonl").read_text().splitlines())
    assert _tensorboard_seen(run / "tensorboard") == want
    # wandb (offline) takes no step below one it already has: it keeps the first values
    # of steps 4-7 and shows the rerun from step 8 (the README says so).
    wandb = {s: row["x"] for s, row in readback.wandb_history(run).items()}
    assert wandb == {**want, 4: 4.0, 5: 5.0, 6: 6.0, 7: 7.0}
    # SwanLab (offline) likewise; MLflow keeps both points of steps 4-7, the rerun's last.
    assert {s: row["x"] for s, row in readback.swanlab_scalars(run / "swanlab").items()} == {
        **want, 4: 4.0, 5: 5.0, 6: 6.0, 7: 7.0}
    assert _mlflow_points(run) == [(s, float(s)) for s in range(8)] + [
        (s, want[s]) for s in range(4, 9)]
    # Trackio likewise keeps both points of steps 4-7, in the order logged
    assert [(s, row["x"]) for s, row in readback.trackio_points(run / "trackio", "e", "t")] \
        == [(s, float(s)) for s in range(8)] + [(s, want[s]) for s in range(4, 9)]

    ray.kill(handle, no_restart=True)
    resumed = metricsvc.start_metric_worker({**cfg, "name": "rewind-b",
                                             "run": {**cfg["run"], "resume": True}})
    assert ray.get(resumed.wait_final_res.remote(6, 10)) == {"x": 60.0}  # reloaded: the rerun
    metricsvc.stop_metric_worker(resumed)


def test_a_sink_reopening_after_a_restart_gets_a_rewinds_rerun_once(make_worker, tmp_path):
    """A restarted service whose sink is still reopening its backend while the run rewinds
    and reruns: the sink's replay is the journal as the restart found it, and the rewind and
    the rerun reach it once, in order (the replay read the rerun from the journal, then the
    queued rewind lowered the watermark and the rerun was written again)."""
    import json

    from tests.helpers import sigkill

    gate = tmp_path / "gate"
    handle, cfg = make_worker(world_size=1, sinks={"jsonl": {}, "custom": [
        {"target": "tests.sink_fixtures:ReopeningSink", "options": {"gate": str(gate)}}]})
    _steps(cfg.name, [float(s) for s in range(4)], 0)
    ray.get(handle.flush.remote(30), timeout=60)
    sigkill(handle)  # the next incarnation's gated sink waits to reopen
    _steps(cfg.name, [4.0, 5.0, 6.0], 4)
    assert ray.get(handle.rewind.remote(to_step=4)) == {"to_step": 4, "superseded": 2}
    _steps(cfg.name, [50.0, 60.0], 5)
    ray.get(handle.wait_final.remote(6, 30))
    gate.write_text("open")
    health = ray.get(handle.close.remote(), timeout=120)
    assert not health["sink_errors"], health["sink_errors"]
    lines = [record for line in
             (Path(health["run_dir"]) / "reopening.jsonl").read_text().splitlines()
             if "step" in (record := json.loads(line))]  # its rewind lines aside
    seen = [(r["step"], r["metrics"]["x"]) for r in lines]
    # each step of each segment once, in order: 0-4, the superseded 5 and 6 if the sink
    # took them before the rewind reached it, then the rerun
    assert seen in ([(s, float(s)) for s in range(5)] + [(5, 50.0), (6, 60.0)],
                    [(s, float(s)) for s in range(7)] + [(5, 50.0), (6, 60.0)]), seen


def test_a_combiner_never_resends_a_batch_a_rewind_superseded(make_worker):
    """Per node: step 0 recorded and journaled, a SIGKILL, a rewind to before it, another
    SIGKILL; the rerun's step 0 is merged, with its own value (found by the run-history
    model: the combiner, still owing the superseded step 0, resent it to the new
    incarnation first, which took it for the rerun's and refused the rerun's)."""
    from tests.helpers import sigkill

    handle, cfg = make_worker(world_size=1, topology="per_node", max_restarts=10)
    first = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    first.submit_metric({"x": 1.0})
    first.flush(step=0)
    first.wait_acks(timeout_s=30)
    assert ray.get(handle.flush.remote(30), timeout=60)  # the journal holds step 0
    sigkill(handle)
    ray.get(handle.rewind.remote(to_step=-1), timeout=60)
    sigkill(handle)
    rerun = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    rerun.submit_metric({"x": 2.0})
    rerun.wait_submit(step=0, timeout_s=60)
    assert ray.get(handle.wait_final.remote(0, 30), timeout=60)["metrics"]["x"] == 2.0
    node = ray.get_runtime_context().get_node_id()
    combiner = ray.get_actor(combiner_name(cfg.name, node), namespace=cfg.namespace)
    calls = ray.get(combiner.health.remote(), timeout=60)["calls"]
    assert (calls["superseded"], calls["resent"]) == (1, 0)  # dropped, never resent


def test_an_outbox_owes_no_batch_a_rewind_superseded():
    """The restart protocol without I/O: what a sender resends to a new incarnation after a
    rewind is what the rerun may lack, never a batch merged in a segment a rewind
    superseded; a batch in flight when the run was rewound (never acked) is resent."""
    from metricsvc.transport import Outbox

    def ack(epoch, rewinds, status="batch", durable=None):
        return {"status": status, "epoch": epoch, "rewinds": rewinds,
                "journal_through": durable}

    box = Outbox()
    for step, payload in enumerate("ab"):  # steps 0 and 1, merged in segment 0
        box.sent(step, payload)
        box.heard(ack("A", []), payload)
    box.sent(2, "c")  # in flight when the run is rewound to step 0, then restarted
    exchange = box.exchange("c")
    assert next(exchange) == "c"
    assert exchange.send(ack("B", [0], "epoch_changed")) == "a"  # step 0 is kept
    assert exchange.send(ack("B", [0])) == "c"  # "b" (step 1) was superseded
    with pytest.raises(StopIteration) as done:
        exchange.send(ack("B", [0]))
    assert done.value.value["epoch"] == "B"
    assert (box.owed(), box.superseded, box.resent) == (["a", "c"], 1, 1)
    box.heard(ack("B", [0, -1]))  # rewound to before step 0: nothing of it is owed
    assert (box.owed(), box.superseded) == ([], 3)

    box.sent(0, "d")  # merged in the newest segment: owed until the journal holds it
    box.heard(ack("B", [0, -1]), "d")
    box.heard(ack("C", [0, -1], "epoch_changed"))
    assert box.owed() == ["d"]
    box.heard(ack("C", [0, -1], durable=0))
    assert box.owed() == []

    stream = Outbox(steps=False)  # numbered by batch: rewinds (of steps) do not apply
    stream.sent(5, "s")
    stream.heard(ack("A", []), "s")
    stream.heard(ack("A", [0]))
    assert stream.owed() == ["s"]
