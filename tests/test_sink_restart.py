"""What users look at survives a SIGKILLed MetricWorker: after Ray restarts it, every sink's
own files hold every finished step exactly once, in one run per backend, equal to the
journal (issue 18). Each backend is read back with its own reader (``tests/readback``)."""

import itertools
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from metricsvc.client import MetricClient
from metricsvc.core.keys import safe_tag
from metricsvc.storage.journal import read_journal
from tests import readback
from tests.helpers import sigkill

pytestmark = pytest.mark.slow

# A restarted service reopens every backend's run at once (wandb, SwanLab and MLflow each
# import and start in seconds of CPU): on a loaded machine that took over the default 30 s
# close timeout, and the close dead-lettered what these tests check was written.
SINKS = {"console": None, "jsonl": {}, "tensorboard": {},
         "wandb": {"mode": "offline", "flush_interval_s": 0.2},
         "swanlab": {"mode": "offline"}, "mlflow": {}, "trackio": {},
         "delivery": {"close_timeout_s": 150}}


def record(clients, step):
    rng = np.random.default_rng(step)
    for c in clients:
        n = 3 + 2 * c.rank
        c.stat(mask=rng.random(n) < 0.8, **{"actor/adv": rng.normal(size=n)})
        c.submit_metric({"actor/lr": 1e-5 * (step + 1), "score (top-1)": float(rng.random())})
        c.wait_submit(step=step)


def check_every_backend(run_dir, steps):
    journal = {r["step"]: r["metrics"] for r in read_journal(run_dir / "metrics.jsonl")}
    assert sorted(journal) == list(range(steps))

    def same(got, rename=lambda k: k, rel=1e-12, what=""):
        assert sorted(got) == list(range(steps)), (what, sorted(got))
        for step, metrics in journal.items():
            want = {rename(k): v for k, v in metrics.items()}
            assert got[step] == pytest.approx(want, rel=rel), (what, step)

    same(readback.tensorboard_scalars(run_dir / "tensorboard"), safe_tag, 1e-6, "tensorboard")
    same(readback.wandb_history(run_dir / "wandb"), what="wandb")
    same(readback.swanlab_scalars(run_dir / "swanlab"), safe_tag, what="swanlab")
    same(readback.mlflow_metrics((run_dir / "mlruns").as_uri()), lambda k: safe_tag(k, 250),
         what="mlflow")
    same(readback.trackio_scalars(run_dir / "trackio", run_dir.parent.name, run_dir.name),
         safe_tag, what="trackio")
    return journal


def test_every_sink_holds_every_step_once_after_kills_right_after_final_and_twice(make_worker):
    steps = 8
    handle, cfg = make_worker(sinks=SINKS, world_size=2)
    clients = [MetricClient(None, rank=r, world_size=2, name=cfg.name) for r in range(2)]
    for step in range(steps):
        record(clients, step)
        ray.get(handle.wait_final.remote(step, 60))
        if step == 2:
            sigkill(handle)  # right after step 2 is final: the sinks have barely begun
        if step == 5:
            # What the journal holds, as the ranks are told it (they forget batches up to it)
            held = ray.get(handle.health.remote(), timeout=60)["journal_through"]
            sigkill(handle)
            sigkill(handle)  # twice in a row: the second dies while it replays
    health = ray.get(handle.close.remote(), timeout=240)
    assert not health["sink_errors"], health["sink_errors"]["wandb"]["last_error"]
    # The last incarnation reloaded every step the journal held when the first of the two
    # kills came, and none past step 5. The journal is a thread beside the sinks and can be
    # a few steps behind the merge while a restarted actor opens its backends (steps 0-2 of
    # 0-5, once on a loaded machine): the ranks then sent the steps it lacked again, and
    # every backend below holds each step once all the same.
    assert held is not None and held + 1 <= health["restored_steps"] <= 6, (
        held, health["restored_steps"])
    check_every_backend(Path(health["run_dir"]), steps)


def test_a_kill_while_a_sink_is_writing_loses_and_doubles_nothing(make_worker):
    steps, stall = 6, 3
    handle, cfg = make_worker(sinks={
        **SINKS, "custom": [{"target": "tests.sink_fixtures:StallingSink",
                             "options": {"stall_step": stall}}]}, world_size=2)
    clients = [MetricClient(None, rank=r, world_size=2, name=cfg.name) for r in range(2)]
    run_dir = None
    for step in range(steps):
        record(clients, step)
        if step == stall:
            run_dir = Path(ray.get(handle.health.remote())["run_dir"])
            deadline = time.monotonic() + 60
            # The sink is mid-write, and the journal (a delivery of its own, beside the
            # sinks) holds the step: the next incarnation replays it from the journal.
            # (Killed before the journal has it, the ranks resend it instead.)
            journal = run_dir / "metrics.jsonl"
            while not ((run_dir / "stalling.started").exists() and journal.exists()
                       and stall in {r["step"] for r in read_journal(journal)}):
                assert time.monotonic() < deadline, "the stalling sink never started step 3"
                time.sleep(0.02)
            sigkill(handle)
    ray.get(handle.wait_final.remote(steps - 1, 60))
    health = ray.get(handle.close.remote(), timeout=240)
    assert not health["sink_errors"], health["sink_errors"]
    journal = check_every_backend(run_dir, steps)
    lines = [json.loads(x) for x in (run_dir / "stalling.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(steps))
    for x in lines:
        assert x["metrics"] == pytest.approx(journal[x["step"]], rel=1e-12)
    # The step it died writing came from the journal's replay (not from the ranks) in the
    # incarnation after the kill. Under load the restarted actor itself can crash in Ray
    # ("Failed to initialize threads", thread_pool.cc) after that replay: the incarnation
    # after it finds the step written and has nothing left to replay.
    from ray._private.state import actors  # what Ray's own runtime context asks

    if actors(actor_id=handle._actor_id.hex())["NumRestarts"] == 1:
        assert health["sinks"]["stalling"]["replayed"] >= 1


def test_a_close_that_gives_up_on_a_sink_still_reopening_dead_letters_what_it_lacks(
        make_worker):
    """A restarted service's close gave up on a sink still reopening its run (30 s on a
    loaded machine for wandb, MLflow and TensorBoard): the steps the ranks sent after the
    restart were dead-lettered, the journaled steps the sink lacked were in neither its
    backend nor the dead letters, and health counted no loss."""
    handle, cfg = make_worker(world_size=1, sinks={
        "console": None, "jsonl": {}, "delivery": {"close_timeout_s": 2},
        "custom": [{"target": "tests.sink_fixtures:StallingSink",
                    "options": {"stall_step": 1, "reopen_s": 60}}]})
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    run_dir = Path(ray.get(handle.health.remote())["run_dir"])
    journal = run_dir / "metrics.jsonl"
    for step in range(4):
        client.submit_metric({"x": float(step)})
        client.wait_submit(step=step)
    deadline = time.monotonic() + 60
    while not ((run_dir / "stalling.started").exists()
               and {r["step"] for r in read_journal(journal)} >= {0, 1, 2, 3}):
        assert time.monotonic() < deadline, "the stalling sink never started step 1"
        time.sleep(0.02)
    sigkill(handle)  # steps 1-3: journaled, not in the sink; its next incarnation reopens
    client.submit_metric({"x": 4.0})
    client.wait_submit(step=4)
    health = ray.get(handle.close.remote(), timeout=120)
    held = [json.loads(x)["step"] for x in (run_dir / "stalling.jsonl").read_text().splitlines()]
    dead = [r["step"] for r in map(json.loads, (run_dir / "dead_letter.jsonl").read_text()
                                   .splitlines()) if r["sink"] == "stalling"]
    assert held == [0]
    # Every step the sink lacks, each once, none lost; step 0 too where the kill came
    # before its watermark was saved (the sink was already writing step 1): a dead letter
    # may hold a step the sink has, never the other way round
    assert set(dead) - {0} == {1, 2, 3, 4} and len(dead) == len(set(dead))
    stats = health["sink_errors"]["stalling"]
    assert stats["dead_lettered"] == len(dead) and stats["lost"] == 0
    assert "jsonl" not in health["sink_errors"]  # the journal, a sink of its own, holds all
    assert [r["step"] for r in read_journal(journal)] == [0, 1, 2, 3, 4]


def test_a_close_that_gives_up_dead_letters_a_rerun_after_a_queued_rewind_too(tmp_path):
    """Each step once, but a rewind queued behind a stuck write starts a new segment: its
    rerun's steps 1 and 2 are not the steps 1 and 2 before it, and are dead-lettered too."""
    from metricsvc.config import DeliveryConfig
    from metricsvc.sinks.dispatch import SinkDispatcher
    from metricsvc.storage.history import Rewind
    from tests.sink_fixtures import SlowSink

    sink = SlowSink({"seconds": 3, "trace": str(tmp_path / "trace")})
    d = SinkDispatcher([sink], tmp_path, DeliveryConfig(close_timeout_s=0.3))
    for step in range(3):
        d.publish(step, {"x": float(step)}, {"ranks": [0]})
    d.rewind(Rewind(0), wait_for=None)
    for step in (1, 2):
        d.publish(step, {"x": 10.0 + step}, {"ranks": [0]})
    d.close()  # the write of step 0 takes 3 s: the close gives up on it and the rest
    dead = [(r["step"], r["metrics"]["x"]) for r in
            map(json.loads, (tmp_path / "dead_letter.jsonl").read_text().splitlines())]
    assert dead == [(0, 0.0), (1, 1.0), (2, 2.0), (1, 11.0), (2, 12.0)]


class GateSink:
    """A custom sink whose reopening and writes wait at a gate (a backend slow to reopen
    or to write); an incarnation that crashed (``dead``) lands nothing more."""

    name = "gate"

    def __init__(self, gate, path: Path) -> None:
        self.gate, self.path, self.dead = gate, path, False

    def open(self, run_dir) -> None:
        self.gate.wait()

    def write(self, step, metrics, meta) -> None:
        self.gate.wait()
        if not self.dead:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps([step, metrics["x"]]) + "\n")

    def close(self) -> None:
        pass


class SinkHistoryMachine(RuleBasedStateMachine):
    """A run's sinks across publishes, rewinds, a sink that stalls, crashes (the service
    continues the run from its journal) and closes that give up on the stalled sink, in
    any mix, against a model (step -> value): once a close returns, every value the model
    holds is in the sink's file or in its dead letters. The real dispatcher and journal,
    wired as the service wires them on a restart; one process, no Ray."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="metricsvc-sinks-")
        self.run = Path(self.tmp.name)
        self.gate = threading.Event()
        self.gate.set()
        self.model: dict[int, float] = {}
        self.next = 0
        self.values = itertools.count()
        self.incarnations: list = []
        self._start(continuing=False)

    def _start(self, continuing: bool) -> None:
        from metricsvc.config import DeliveryConfig
        from metricsvc.sinks.dispatch import SinkDispatcher
        from metricsvc.sinks.jsonl import JsonlSink
        from metricsvc.storage.history import RunHistory
        from metricsvc.storage.journal import iter_journal

        path = self.run / "metrics.jsonl"
        self.journal, self.sink = JsonlSink(), GateSink(self.gate, self.run / "gate.jsonl")
        self.d = SinkDispatcher(
            [self.journal, self.sink], self.run, DeliveryConfig(close_timeout_s=0.3),
            replay=(lambda: iter_journal(path)) if continuing and path.exists() else None,
            history=RunHistory.read(path if continuing else None))
        self.incarnations.append(self.d)

    def _nothing_lost(self) -> None:
        held = {tuple(json.loads(x)) for x in _lines(self.run / "gate.jsonl")}
        dead = {(r["step"], r["metrics"]["x"]) for r in map(json.loads,
                _lines(self.run / "dead_letter.jsonl")) if r["sink"] == "gate"}
        assert set(self.model.items()) <= held | dead, (self.model, held, dead)

    @rule()
    def publish(self) -> None:
        value = float(next(self.values))
        self.d.publish(self.next, {"x": value}, {"ranks": [0]})
        self.model[self.next] = value
        self.next += 1

    @precondition(lambda self: self.next > 0)
    @rule(data=st.data())
    def rewind(self, data) -> None:
        self.rewind_to(data.draw(st.integers(-1, self.next - 1), label="to_step"))

    def rewind_to(self, to_step: int) -> None:
        from metricsvc.storage.history import Rewind

        self.d.rewind(Rewind(to_step), wait_for=self.journal, timeout_s=30)
        self.model = {s: v for s, v in self.model.items() if s <= to_step}
        self.next = to_step + 1

    @rule()
    def stall(self) -> None:
        self.gate.clear()

    @rule()
    def unstall(self) -> None:
        self.gate.set()

    @rule()
    def crash(self) -> None:
        """The process ends with nothing closed, once the journal holds every step."""
        from metricsvc.storage.journal import read_journal

        journal = self.run / "metrics.jsonl"
        give_up = time.monotonic() + 30
        while self.model and (not journal.exists() or self.model != {
                r["step"]: r["metrics"]["x"] for r in read_journal(journal)}):
            assert time.monotonic() < give_up, "the journal did not take every step"
            time.sleep(0.01)
        # A process that ends runs nothing more: its sink threads neither land a write nor
        # save a watermark (here they would live on: a write stalled at the gate, returning
        # after the next incarnation started, saved its step as durable, and that
        # incarnation, reading the watermark after it, skipped the step: 31 runs of 200)
        for delivery in self.d._deliveries:
            with delivery._lock:
                delivery._abandoned = True
        self.sink.dead = True
        self._start(continuing=True)  # reopens the sink: at the gate if it stalls

    @rule()
    def close_then_continue(self) -> None:
        self.d.close()  # gives up on the sink if it stalls
        self._nothing_lost()
        self._start(continuing=True)

    @rule()
    def flush_while_a_close_runs_then_continue(self) -> None:
        """Another caller's close runs; a flush (and a second close) made meanwhile says
        True only once every step is written or dead-lettered."""
        closing = threading.Thread(target=self.d.close)
        closing.start()
        give_up = time.monotonic() + 30
        while not self.d._closed:
            assert time.monotonic() < give_up, "the close did not begin"
            time.sleep(0.001)
        assert self.d.flush(30)
        self._nothing_lost()
        self.d.wait_closed()  # the actor's second close waits on the same mark
        closing.join(30)
        self._start(continuing=True)

    @invariant()
    def a_flowing_sink_holds_the_model(self) -> None:
        if self.gate.is_set():
            assert self.d.flush(30)
            self._nothing_lost()

    def teardown(self) -> None:
        self.gate.set()
        for d in self.incarnations:
            d.close(5)
        self.tmp.cleanup()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_every_mix_of_stall_crash_rewind_and_a_close_that_gives_up_loses_no_step():
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(SinkHistoryMachine, settings=settings(
        max_examples=25, stateful_step_count=12, deadline=None, database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck)))


# Mixes the model found (random draws find each only now and then), run every time:
# the first lost step 0 on the delivery.py before 62876f5 (a close gave up on a sink still
# reopening after a crash, before its replay had a backlog); the second lost step 1 in 31
# runs of 200 when a crashed incarnation's stalled write saved its watermark after the next
# incarnation had started (a test that let a crashed process's thread live on).
KNOWN_MIXES = [
    ["stall", "publish", "crash", "publish", "close_then_continue"],
    ["stall", "publish", "unstall", ("rewind_to", 0), "crash", "stall", "publish", "crash",
     "publish", "unstall"],
]


@pytest.mark.parametrize("mix", KNOWN_MIXES, ids=["close-while-reopening", "stalled-crash"])
def test_the_mixes_the_sink_model_found_lose_no_step(mix):
    machine = SinkHistoryMachine()
    try:
        for step in mix:
            name, *args = (step,) if isinstance(step, str) else step
            getattr(machine, name)(*args)
            machine.a_flowing_sink_holds_the_model()
    finally:
        machine.teardown()


@pytest.mark.parametrize("left", ["a torn run", "a run whose id was not kept",
                                  "a torn experiment"])
def test_mlflow_continues_its_store_after_a_kill_while_it_created_the_run(tmp_path, left,
                                                                          monkeypatch):
    """A kill inside MLflow's file store creating the experiment or the run leaves its
    ``meta.yaml`` empty (MLflow opens it for writing, then writes), and MLflow's own readers
    fail on it: no run of the experiment can be listed. A kill between the run's creation and
    the sink keeping its id leaves a run that the next incarnation does not continue. Either
    way the next incarnation leaves the store readable, with one run holding every step."""
    import mlflow

    from metricsvc.sinks.mlflow import MlflowSink

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the sink sets
    run_dir = tmp_path / "exp" / "trial"
    run_dir.mkdir(parents=True)
    store = run_dir / "mlruns"
    client = mlflow.MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.create_experiment("exp")
    torn = store / experiment  # what MLflow cannot read: moved aside
    if left == "a torn experiment":
        (torn / "meta.yaml").write_text("")
    else:
        run = client.create_run(experiment, run_name="trial")
        torn = torn / run.info.run_id if left == "a torn run" else None
        if torn is not None:
            (torn / "meta.yaml").write_text("")
    sink = MlflowSink()
    sink.open(run_dir)
    sink.resume(None)
    for step in range(3):
        sink.write(step, {"loss": 1.0 / (step + 1)}, {})
    sink.close()
    assert readback.mlflow_metrics(store.as_uri()) == {
        step: {"loss": 1.0 / (step + 1)} for step in range(3)}
    aside = run_dir / "mlruns-torn"
    if torn is None:
        assert not aside.exists()  # the run left unkept is the one continued
        assert readback._mlflow_run(store.as_uri())[1].info.run_id == run.info.run_id
    else:
        assert not torn.exists() and (aside / torn.relative_to(store) / "meta.yaml").exists()
