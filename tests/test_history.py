"""One history of a run (issue 35): restarts, resumes, rewinds, closes and streams, in one
run, leave every sink and reader equal to a run that never failed. One test per case a
user met; ``test_history_model`` drives random mixes of them against a plain model."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import ray

import metricsvc
from metricsvc.cli.main import load_steps
from metricsvc.client import MetricClient
from metricsvc.core.declare import Derived
from metricsvc.errors import ServiceNotice, ServiceUnavailable, StepNotFinal
from metricsvc.storage.journal import read_journal
from tests import readback
from tests.helpers import crash, sigkill

SINKS = {"console": None, "jsonl": {}, "tensorboard": {}}


def run_steps(name: str, values: dict[int, float]) -> None:
    """Close each step of ``values`` (in order) with one rank's ``{"x": value}``."""
    client = MetricClient(None, rank=0, world_size=1, name=name, start_step=min(values))
    for step in sorted(values):
        client.submit_metric({"x": values[step]})
        client.wait_submit(step=step, timeout_s=30)


def held(run: Path) -> dict[str, dict[int, float]]:
    """What each place a user looks at shows of 'x', step by step."""
    journal = {r["step"]: r["metrics"]["x"] for r in read_journal(run / "metrics.jsonl")}
    report = {r["step"]: r["metrics"]["x"] for r in load_steps(str(run))}
    board = {s: m["x"] for s, m in readback.tensorboard_scalars(run / "tensorboard").items()}
    return {"journal": journal, "report": report, "tensorboard": board}


def assert_everywhere(run: Path, want: dict[int, float]) -> None:
    for where, got in held(run).items():
        assert got == pytest.approx(want), where


def test_a_restart_then_a_rewind_writes_the_rerun_to_every_sink(make_worker):
    handle, cfg = make_worker(world_size=1, sinks=SINKS)
    run_steps(cfg.name, {s: float(s) for s in range(10)})
    ray.get(handle.flush.remote())
    sigkill(handle)
    ray.get(handle.rewind.remote(to_step=3))
    rerun = {s: 100.0 + s for s in range(4, 10)}
    run_steps(cfg.name, rerun)
    assert ray.get(handle.wait_final_res.remote(9, 30)) == {"x": 109.0}
    health = ray.get(handle.close.remote())
    assert not health["sink_errors"], health["sink_errors"]
    assert_everywhere(Path(health["run_dir"]), {**{s: float(s) for s in range(4)}, **rerun})


def test_a_crash_then_a_resume_from_a_checkpoint_keeps_the_rerun_for_later_readers(
        make_worker):
    handle, cfg = make_worker(world_size=1, sinks=SINKS)
    run_steps(cfg.name, {s: float(s) for s in range(8)})
    ray.get(handle.flush.remote())
    crash(handle)  # the job crashed, its service with it
    resumed_cfg = cfg.model_dump()
    resumed = metricsvc.start_metric_worker(resumed_cfg, resume_from_step=3)
    rerun = {s: 100.0 + s for s in range(4, 8)}
    run_steps(cfg.name, rerun)
    health = metricsvc.stop_metric_worker(resumed)
    assert not health["sink_errors"], health["sink_errors"]
    want = {**{s: float(s) for s in range(4)}, **rerun}
    run = Path(health["run_dir"])
    assert_everywhere(run, want)
    later = metricsvc.start_metric_worker({**resumed_cfg, "run": {**resumed_cfg["run"],
                                                                 "resume": True}})
    assert {s: ray.get(later.wait_final_res.remote(s, 10))["x"] for s in range(8)} == want
    metricsvc.stop_metric_worker(later)
    assert_everywhere(run, want)


def test_a_resume_past_the_journals_last_step_names_the_steps_no_journal_holds(make_worker):
    """The journal writes a step a moment after its ack: a job that crashes right after its
    ranks' last acks can end before the journal holds them (seen in make test on a loaded
    machine: a service killed right after six acks had journaled none). Resumed from a
    checkpoint past the journal's last step, the steps between are in no journal and no
    sink, and the rerun starts after them: the driver that resumes is told which, and
    health() keeps them; a resume the journal covers says nothing."""
    handle, cfg = make_worker(world_size=1, sinks=SINKS)
    run_steps(cfg.name, {s: float(s) for s in range(3)})
    ray.get(handle.flush.remote())  # the journal holds steps 0-2: as if 3-5 never reached it
    crash(handle)
    with pytest.warns(ServiceNotice, match=r"steps 3-5 is in no journal and no sink") as seen:
        resumed = metricsvc.start_metric_worker(cfg.model_dump(), resume_from_step=5)
    assert len(seen) == 1, [str(w.message) for w in seen]
    report = ray.get(resumed.health.remote())["resume"]
    assert report["from_step"] == 5 and report["journal_through"] == 2
    assert {k: report["unjournaled"][k] for k in ("first", "last")} == {"first": 3, "last": 5}
    assert str(seen[0].message).endswith(report["unjournaled"]["reason"])
    # Ray restarting the resumed service (a crash at its start, under load) keeps the report:
    # the rewind the journal holds records what the resume found
    assert sigkill(resumed)["resume"] == report
    run_steps(cfg.name, {6: 60.0})
    health = metricsvc.stop_metric_worker(resumed)
    assert_everywhere(Path(health["run_dir"]), {0: 0.0, 1: 1.0, 2: 2.0, 6: 60.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ServiceNotice)  # covered by the journal: no notice
        again = metricsvc.start_metric_worker(cfg.model_dump(), resume_from_step=1)
    assert ray.get(again.health.remote())["resume"] == {
        "from_step": 1, "journal_through": 6, "unjournaled": None}
    metricsvc.stop_metric_worker(again)


def test_a_restart_finds_a_rewind_only_the_journal_recorded_and_writes_the_rerun(
        make_worker):
    """The journal records a rewind before any other sink is told (a rewind it lacks never
    happened); a service that dies between the two leaves TensorBoard without the rewind's
    restart marker, its watermark in the old segment. Seen in a serial run of the suite on a
    loaded machine: Ray restarted a service resumed from step 3 (its thread pool timed out
    at start) before its TensorBoard thread took the rewind, and the restarted one skipped
    the rerun's steps as "held": TensorBoard showed steps 4-7 of the first run, and nothing
    said so. Here the folder is left exactly so (the rewind written by the journal's own
    writer), then continued."""
    from metricsvc.sinks.jsonl import JsonlSink
    from metricsvc.storage.history import Rewind

    handle, cfg = make_worker(world_size=1, sinks=SINKS)
    run_steps(cfg.name, {s: float(s) for s in range(8)})
    ray.get(handle.flush.remote())  # every sink holds steps 0-7
    run = Path(ray.get(handle.health.remote())["run_dir"])
    crash(handle)
    journal = JsonlSink()
    journal.open(run)
    journal.write_event(Rewind(3).event())
    journal.close()
    dumped = cfg.model_dump()
    resumed = metricsvc.start_metric_worker({**dumped, "run": {**dumped["run"],
                                                               "resume": True}})
    rerun = {s: 100.0 + s for s in range(4, 8)}
    run_steps(cfg.name, rerun)
    health = metricsvc.stop_metric_worker(resumed)
    assert not health["sink_errors"], health["sink_errors"]
    assert_everywhere(run, {**{s: float(s) for s in range(4)}, **rerun})


def test_resume_from_step_in_the_config_is_the_same_operation(make_worker):
    handle, cfg = make_worker(world_size=1, sinks=SINKS)
    run_steps(cfg.name, {s: float(s) for s in range(6)})
    # the journal holds steps 0-5 (it writes a moment after the acks: a crash right after
    # them, on a loaded machine, left it none, and the resume is then warned of a gap)
    ray.get(handle.flush.remote())
    crash(handle)
    dumped = cfg.model_dump()
    resumed = metricsvc.start_metric_worker(
        {**dumped, "run": {**dumped["run"], "resume": True, "from_step": 2}})
    run_steps(cfg.name, {3: 30.0})
    health = metricsvc.stop_metric_worker(resumed)
    assert_everywhere(Path(health["run_dir"]), {0: 0.0, 1: 1.0, 2: 2.0, 3: 30.0})


def test_a_kill_mid_rerun_leaves_tensorboard_the_rerun(make_worker):
    handle, cfg = make_worker(world_size=1, sinks=SINKS)
    run_steps(cfg.name, {s: float(s) for s in range(8)})
    ray.get(handle.rewind.remote(to_step=3))
    run_steps(cfg.name, {4: 40.0, 5: 50.0})
    ray.get(handle.flush.remote())
    sigkill(handle)
    run_steps(cfg.name, {6: 60.0, 7: 70.0, 8: 80.0})
    health = ray.get(handle.close.remote())
    assert_everywhere(Path(health["run_dir"]),
                      {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0, 5: 50.0, 6: 60.0, 7: 70.0,
                       8: 80.0})


_TOTAL = Derived("seen", "total(sum(x))", {"x": "x"})


@pytest.mark.parametrize("to_step, skipped", [(5, None), (2, 2)],
                         ids=["past_the_last_step", "a_step_without_the_key"])
def test_running_totals_resume_from_the_last_record_at_or_before_the_rewind(
        make_worker, to_step, skipped):
    handle, cfg = make_worker(world_size=1, sinks={"console": None, "jsonl": {}})
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    client.declare(_TOTAL)
    for step in range(4):  # totals 1, 3, 6, 10 (step 2 has no x: 3 through it)
        if step != skipped:
            client.submit_metric({"x": step + 1.0})
        else:
            client.submit_metric({"y": 0.0})
        client.wait_submit(step=step, timeout_s=30)
    sums = {0: 1.0, 1: 3.0, 2: 6.0 if skipped is None else 3.0, 3: 10.0 if skipped is None
            else 7.0}
    ray.get(handle.rewind.remote(to_step=to_step))
    base = sums[min(to_step, 3)]
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name, start_step=to_step + 1)
    client.declare(_TOTAL)
    for i, step in enumerate(range(to_step + 1, to_step + 3)):
        client.submit_metric({"x": 5.0})
        client.wait_submit(step=step, timeout_s=30)
        got = ray.get(handle.wait_final_res.remote(step, 30))["seen"]
        assert got == base + 5.0 * (i + 1)


def test_a_batch_sent_to_a_closed_service_is_refused_to_its_sender(make_worker):
    handle, cfg = make_worker(world_size=1, sinks={"console": None, "jsonl": {}})
    run_steps(cfg.name, {0: 1.0})
    ray.get(handle.close.remote())
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name, start_step=1)
    client.submit_metric({"x": 2.0})
    with pytest.raises(ServiceUnavailable, match="closed"):
        client.wait_submit(step=1, timeout_s=30)
    client.submit_metric({"x": 3.0})
    client.flush(step=2)
    with pytest.raises(ServiceUnavailable, match="closed"):
        client.wait_acks(timeout_s=30)
    with pytest.raises(StepNotFinal):  # never published, never served
        ray.get(handle.wait_final_res.remote(1, 0.2))


def test_a_stream_batch_owed_at_a_restart_is_resent_by_flush_and_lands_in_the_export(
        make_worker):
    handle, cfg = make_worker(world_size=1, sinks={"console": None, "jsonl": {}})
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    recorder = client.stream("rollout")
    recorder.stat(**{"reward": [1.0, 2.0, 3.0]})
    recorder.flush()  # sent; the export that would journal it never came
    sigkill(handle)
    assert recorder.flush() is not None  # nothing new, but what the restart lost is owed
    recorder.close()
    window = ray.get(handle.export_stream.remote("rollout", 0, True))
    assert window == pytest.approx({"rollout/reward/mean": 2.0, "rollout/reward/min": 1.0,
                                    "rollout/reward/max": 3.0})


def test_a_rewind_before_a_description_keeps_it_in_the_latest_segment(make_worker):
    handle, cfg = make_worker(world_size=1, sinks={"console": None, "jsonl": {}})
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    client.declare(Derived("twice", "2 * mean(x)", {"x": "x"}, help="x doubled", unit="u"))
    for step in range(3):
        client.submit_metric({"x": float(step)})
        client.wait_submit(step=step, timeout_s=30)
    ray.get(handle.rewind.remote(to_step=-1))
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    client.declare(Derived("twice", "2 * mean(x)", {"x": "x"}, help="x doubled", unit="u"))
    for step in range(2):
        client.submit_metric({"x": 10.0 + step})
        client.wait_submit(step=step, timeout_s=30)
    health = ray.get(handle.close.remote())
    journal = read_journal(Path(health["run_dir"]) / "metrics.jsonl")
    assert [r["metrics"]["twice"] for r in journal] == [20.0, 22.0]
    assert journal[0]["meta"]["descriptions"]["twice"] == {"help": "x doubled", "unit": "u"}


@pytest.mark.parametrize("earlier", ["same second, another node", "a clock ahead"])
def test_a_rerun_after_a_restart_wins_in_tensorboard_whatever_the_earlier_file_is_named(
        tmp_path, earlier):
    """TensorBoard reads a folder's event files in name order, and tensorboardX names a file
    by its second and host: an incarnation restarted within the same second on a node whose
    name sorts first, or after a node whose clock ran ahead, was read before the events it
    supersedes, and the first run's values came back over the rerun (seen in CI)."""
    from metricsvc.sinks.tensorboard import TensorboardSink

    first = TensorboardSink()
    first.open(tmp_path)
    for step in range(8):
        first.write(step, {"x": float(step)}, {})
    first.close()
    (old,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    stamp, host = old.name.split(".")[3:5]
    if earlier == "a clock ahead":
        stamp = f"{int(stamp) + 3600:010d}"
    else:
        host = "zzzz-another-node"
    old.rename(old.with_name(f"events.out.tfevents.{stamp}.{host}.1.cafe"))
    second = TensorboardSink()
    second.open(tmp_path)
    second.resume(3)
    second.rewind(3)
    for step in range(4, 8):
        second.write(step, {"x": 100.0 + step}, {})
    second.close()
    board = readback.tensorboard_scalars(tmp_path / "tensorboard")
    assert {s: m["x"] for s, m in board.items()} == {
        **{s: float(s) for s in range(4)}, **{s: 100.0 + s for s in range(4, 8)}}


@pytest.mark.parametrize("restart", [False, True], ids=["live", "restarted"])
def test_a_stream_batch_a_rewind_superseded_never_lands_in_the_rerun(make_worker, restart):
    """A long-lived stream recorder (a rollout worker) whose batch went into a step a rewind
    superseded: the rerun's window holds the new batches only, whether or not the service
    restarted after the rewind (a restart had the recorder resend the superseded batch,
    which the journal no longer held, into the rerun's window)."""
    handle, cfg = make_worker(world_size=1, sinks={"console": None, "jsonl": {}})
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    recorder = client.stream("rollout")
    recorder.stat(reward=[1.0])
    recorder.flush()
    ray.get(handle.export_stream.remote("rollout", 0, True))
    ray.get(handle.flush.remote())  # the journal holds step 0 and the batch in its window
    ray.get(handle.rewind.remote(to_step=-1))
    if restart:
        sigkill(handle)
    recorder.stat(reward=[5.0])
    recorder.close()
    window = ray.get(handle.export_stream.remote("rollout", 0, True))
    assert window == {"rollout/reward/mean": 5.0, "rollout/reward/min": 5.0,
                      "rollout/reward/max": 5.0}
    health = metricsvc.stop_metric_worker(handle)
    journal = read_journal(Path(health["run_dir"]) / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["rollout/reward/mean"]) for r in journal] == [(0, 5.0)]
