"""Real sinks in offline/local modes, files read back and compared with the journal."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import ray

from metricsvc.client import Derived, MetricClient
from metricsvc.client.metrics import record_moe_balance
from metricsvc.config import load_config
from metricsvc.core.keys import safe_tag
from metricsvc.sinks import SinkDispatcher, build_sinks, default_registry
from metricsvc.storage.journal import read_journal
from tests import readback
from tests.sink_fixtures import RecordingSink

ROOT = Path(__file__).resolve().parent.parent
PER_LR = Derived("tokens/per_lr", "value(t) / value(lr)", {"t": "tokens/total", "lr": "actor/lr"},
                 help="tokens per unit of learning rate", unit="tokens")
WEIRD = "eval/acc (top-1)/mean"  # needs sanitising for TensorBoard, SwanLab and MLflow


def run_steps(cfg, steps=4, world=2, declare=()):
    clients = [MetricClient(None, rank=r, world_size=world, name=cfg.name) for r in range(world)]
    rng = np.random.default_rng(0)
    for _ in range(steps):
        for c in clients:
            c.declare(*declare)
            c.stat(mask=rng.random(6) < 0.8, **{"critic/advantages": rng.normal(size=6)})
            c.submit_metric({"actor/lr": 1e-5, "tokens/total": int(rng.integers(10, 20)),
                             WEIRD: float(rng.random()), "rollout/reward__count": 3.0})
            c.wait_submit()


def journal_values(run_dir):
    return {r["step"]: r["metrics"] for r in read_journal(run_dir / "metrics.jsonl")}


def assert_same(got, journal, rename=lambda k: k, rel=1e-12):
    public = {step: {rename(k): v for k, v in m.items()} for step, m in journal.items()}
    assert sorted(got) == sorted(public)
    for step, metrics in public.items():
        assert set(got[step]) == set(metrics), step
        for key, value in metrics.items():
            assert got[step][key] == pytest.approx(value, rel=rel), (step, key)


@pytest.mark.slow
def test_every_sink_of_all_yaml_gets_the_same_numbers_as_the_journal(make_worker, tmp_path):
    cfg_all = load_config("all")
    handle, cfg = make_worker(sinks={**cfg_all.sinks.model_dump(), "console": None})
    run_steps(cfg, declare=[PER_LR])
    assert ray.get(handle.flush.remote(120), timeout=150)  # every backend opened and wrote
    # The service merges float64 records and never needs torch, even where it is installed
    # (tensorboardX's package imports it if it can: seconds of CPU and about 300 MB in the
    # singleton, at each start; a run on a loaded machine waited 30 s on it)
    pid = ray.get(handle.health.remote())["pid"]
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    assert not {line.split()[-1] for line in maps if "libtorch" in line}
    health = ray.get(handle.close.remote())
    run_dir = Path(health["run_dir"])
    journal = journal_values(run_dir)
    assert len(journal) == 4 and WEIRD in journal[0]
    assert "rollout/reward__count" in journal[0]  # a user's key: it reaches every sink
    assert not health["sink_errors"], health["sink_errors"]
    assert {name: h["written"] for name, h in health["sinks"].items()} == {
        n: 4 for n in ("jsonl", "tensorboard", "wandb", "swanlab", "mlflow", "trackio")}

    assert_same(readback.tensorboard_scalars(run_dir / "tensorboard"), journal, safe_tag,
                rel=1e-6)  # TensorBoard stores float32
    assert_same(readback.wandb_history(run_dir), journal)
    assert_same(readback.swanlab_scalars(run_dir / "swanlab"), journal, safe_tag)
    assert_same(readback.mlflow_metrics((run_dir / "mlruns").as_uri()), journal,
                lambda k: safe_tag(k, 250))
    assert_same(readback.trackio_scalars(run_dir / "trackio", run_dir.parent.name,
                                         run_dir.name), journal, safe_tag)

    # What a declared metric means reaches every sink that can show it, once
    meaning = "tokens per unit of learning rate [tokens]"
    first = read_journal(run_dir / "metrics.jsonl")
    assert first[0]["meta"]["descriptions"] == {
        "tokens/per_lr": {"help": "tokens per unit of learning rate", "unit": "tokens"}}
    assert all("descriptions" not in r["meta"] for r in first[1:])
    assert readback.tensorboard_descriptions(run_dir / "tensorboard") == {
        "tokens/per_lr": meaning}
    assert readback.wandb_config(run_dir)["description/tokens/per_lr"] == meaning
    assert readback.mlflow_tags((run_dir / "mlruns").as_uri())[
        "description/tokens/per_lr"] == meaning


def test_failing_sink_dead_letters_every_step_while_others_get_all(make_worker):
    handle, cfg = make_worker(sinks={
        "console": None, "tensorboard": {},
        "custom": [{"target": "tests.sink_fixtures:ExplodingSink", "name": "flaky"}],
        "delivery": {"retries": 2, "backoff_s": 0.01},
    })
    run_steps(cfg, steps=5)
    ray.get(handle.flush.remote())
    mid = ray.get(handle.health.remote())
    assert mid["sink_errors"]["flaky"]["failing"] and mid["pending_steps"] == {}
    health = ray.get(handle.close.remote())
    run_dir = Path(health["run_dir"])
    journal = journal_values(run_dir)
    assert sorted(journal) == [0, 1, 2, 3, 4]
    assert sorted(readback.tensorboard_scalars(run_dir / "tensorboard")) == [0, 1, 2, 3, 4]
    dead = [json.loads(x) for x in (run_dir / "dead_letter.jsonl").read_text().splitlines()]
    assert [(d["sink"], d["step"]) for d in dead] == [("flaky", s) for s in range(5)]
    assert dead[0]["metrics"] == journal[0] and "ConnectionError" in dead[0]["error"]
    flaky = health["sinks"]["flaky"]
    assert flaky["dead_lettered"] == 5 and flaky["failures"] == 5 * 3 and flaky["written"] == 0


def test_nonfinite_values_reach_only_sinks_that_support_them(tmp_path):
    recording = RecordingSink()
    dispatcher = SinkDispatcher({**build_sinks(load_config({"sinks": {"console": None}}).sinks),
                                 "recording": recording}, tmp_path)
    dispatcher.publish(0, {"a": 1.0, "b": math.nan, "__hidden": 2.0, "c__count": 4.0}, {})
    dispatcher.close()
    assert recording.steps[0][1] == {"a": 1.0, "c__count": 4.0}
    journaled = read_journal(tmp_path / "metrics.jsonl")[0]["metrics"]
    assert journaled["a"] == 1.0 and math.isnan(journaled["b"])
    assert set(journaled) == {"a", "b", "c__count"}


def test_steps_reach_a_sink_once_and_in_increasing_order(tmp_path):
    recording = RecordingSink()
    dispatcher = SinkDispatcher([recording], tmp_path)
    for step in (0, 1, 1, 0, 2):
        dispatcher.publish(step, {"x": float(step)}, {})
    dispatcher.close()
    assert [s for s, _, _ in recording.steps] == [0, 1, 2]


def test_third_party_sinks_load_by_entry_point_and_dotted_path(tmp_path, monkeypatch):
    dist = tmp_path / "fake_sink-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-sink\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[metricsvc.sinks]\nrecorder = tests.sink_fixtures:RecordingSink\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = default_registry()
    assert "recorder" in registry
    assert isinstance(registry.create("recorder", {}), RecordingSink)
    assert isinstance(registry.create("tests.sink_fixtures:RecordingSink", {}), RecordingSink)
    with pytest.raises(ValueError, match="cannot load sink target 'tests.nope:X'"):
        registry.create("tests.nope:X", {})
    cfg = load_config({"sinks": {"console": None, "jsonl": None,
                                 "custom": [{"target": "recorder", "name": "mine"}]}})
    sinks = build_sinks(cfg.sinks, registry)
    assert list(sinks) == ["mine"] and isinstance(sinks["mine"], RecordingSink)
    two = load_config({"sinks": {"console": None, "jsonl": None, "custom": [
        {"target": "recorder", "name": "mine"}, {"target": "recorder", "name": "mine"}]}})
    with pytest.raises(ValueError, match="two sinks are named 'mine'"):
        build_sinks(two.sinks, registry)


def test_secrets_from_the_environment_never_reach_our_files_or_output(tmp_path, capfd,
                                                                     monkeypatch):
    secret = "sk-test-0123456789abcdef"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("SWANLAB_API_KEY", secret)
    cfg = load_config({"sinks": {"wandb": {}, "swanlab": {}, "console": {}},
                       "run": {"root": str(tmp_path)}})
    run_dir = cfg.run.run_dir()
    dispatcher = SinkDispatcher(build_sinks(cfg.sinks), run_dir)
    (run_dir / "config.yaml").write_text(json.dumps(cfg.model_dump()))
    dispatcher.publish(0, {"x": 1.0}, {})
    dispatcher.close()
    out = capfd.readouterr()
    assert secret not in out.out + out.err
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaked == []
    with pytest.raises(ValueError, match="sinks.wandb.api_key: Extra inputs are not permitted"):
        load_config({"sinks": {"wandb": {"api_key": secret}}})


def test_service_imports_and_runs_without_optional_backends(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        for name in ("wandb", "swanlab", "tensorboardX", "mlflow", "torch"):
            sys.modules[name] = None  # as if not installed
        from metricsvc.config import load_config
        from metricsvc.sinks import SinkDispatcher, build_sinks
        cfg = load_config({{"sinks": {{"console": None, "tensorboard": {{}}}},
                           "run": {{"root": {str(tmp_path)!r}}}}})
        d = SinkDispatcher(build_sinks(cfg.sinks), cfg.run.run_dir())
        d.publish(0, {{"x": 1.0}}, {{}})
        d.close()
        print(d.health()["jsonl"]["written"], d.health()["tensorboard"]["dead_lettered"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1"]  # the journal works; tensorboard dead-letters


def wandb_record_kinds(root):
    from wandb.proto import wandb_internal_pb2 as pb

    kinds = []
    for path in root.rglob("run-*.wandb"):
        for data in readback.leveldb_log_records(path, b":W&B"):
            record = pb.Record()
            record.ParseFromString(data)
            kinds.append(record.WhichOneof("record_type"))
    return kinds


@pytest.mark.slow
def test_a_driver_that_exits_without_close_still_finishes_the_wandb_run(tmp_path):
    """The exit hook closes the service, and the close waits for wandb's run to end. The
    close is given 150 s: in a loaded ``make test`` wandb's start and finish took more than
    the default 30 s, and the close gave up on the run (by design: it dead-letters)."""
    script = textwrap.dedent(f"""
        import os
        import ray, metricsvc
        from metricsvc.client import Derived, MetricClient
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        cfg = {{"name": "exit-wandb", "run": {{"root": {str(tmp_path)!r}, "trial": "t"}},
               "sinks": {{"console": None, "wandb": {{}},
                         "delivery": {{"close_timeout_s": 150}}}}}}
        metricsvc.start_metric_worker(cfg)
        c = MetricClient(None, rank=0, world_size=1, name="exit-wandb")
        for step in range(3):
            c.submit_metric({{"x": float(step)}})
            c.wait_submit()
        # no close(), no ray.shutdown(): the script just ends
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    run_dir = tmp_path / "default" / "t"
    assert wandb_record_kinds(run_dir)[-1] == "exit"  # run.finish() ran
    assert readback.wandb_history(run_dir) == {s: {"x": float(s)} for s in range(3)}


def test_stop_metric_worker_closes_sinks_then_ends_the_actor(ray_cluster, tmp_path):
    import metricsvc

    # wandb's finish takes seconds of CPU: on a loaded machine past the default 30 s close
    # timeout (the run then lacked its exit record), as in test_sink_restart
    cfg = load_config({"name": "stop-wandb", "run": {"root": str(tmp_path), "trial": "t"},
                       "sinks": {"console": None, "wandb": {},
                                 "delivery": {"close_timeout_s": 150}}})
    handle = metricsvc.start_metric_worker(cfg)
    run_steps(cfg, steps=2, world=1)
    health = metricsvc.stop_metric_worker(handle, timeout_s=200)
    assert health["closed"] and health["sinks"]["wandb"]["written"] == 2
    assert "exit" in wandb_record_kinds(tmp_path / "default" / "t")
    with pytest.raises(ValueError):
        metricsvc.get_metric_worker("stop-wandb")


def test_the_wandb_sink_closes_only_once_wandb_has_written_the_run_and_ended(tmp_path):
    """``run.finish()`` returns before wandb-core has closed the run's files; an actor that
    ``stop_metric_worker`` ended right after its close lost their tail (the run in
    ``make test`` held no history and no exit record, though the sink had written both
    steps). The sink's close waits for wandb's process to end, so nothing is left to lose."""
    import psutil

    from metricsvc.sinks.wandb import WandbSink, WandbSinkConfig

    before = psutil.Process().children()
    sink = WandbSink(WandbSinkConfig(flush_interval_s=3600))  # wandb's own flush never fires
    sink.open(tmp_path)
    for step in range(2):
        sink.write(step, {"x": float(step)}, {})
    sink.close()
    assert [c.cmdline() for c in psutil.Process().children() if c not in before] == []  # wandb's
    kinds = wandb_record_kinds(tmp_path)
    assert kinds.count("history") == 2 and kinds[-1] == "exit"
    assert readback.wandb_history(tmp_path) == {0: {"x": 0.0}, 1: {"x": 1.0}}


def test_the_wandb_sink_leaves_wandb_running_for_a_run_of_the_callers_own(tmp_path):
    """Sinks run in the MetricWorker; one a caller runs beside a wandb run of its own
    (``SinkDispatcher`` is public) leaves that run's wandb process alone at its close."""
    import wandb

    from metricsvc.sinks.wandb import WandbSink

    own = wandb.init(mode="offline", dir=str(tmp_path / "own"), project="own",
                     reinit="create_new", settings=wandb.Settings(console="off", silent=True))
    sink = WandbSink()
    sink.open(tmp_path / "sink")
    sink.write(0, {"x": 1.0}, {})
    sink.close()
    own.log({"y": 2.0}, step=0)  # refused by wandb once its process has ended
    own.finish()
    wandb.teardown()
    assert readback.wandb_history(tmp_path / "own") == {0: {"y": 2.0}}
    assert readback.wandb_history(tmp_path / "sink") == {0: {"x": 1.0}}


@pytest.mark.slow
def test_moe_loads_reach_wandb_as_one_table_a_step_and_the_scalars_where_the_page_says(
        make_worker):
    """AReaL's page: wandb gets one moe_balance/expert_loads Table per step (layer, expert,
    tokens, load_percent; its history keeps every step's), max_over_ideal stays a scalar;
    SwanLab (and MLflow) keep the per-expert scalars; TensorBoard shows the layer summaries
    and a text panel, no per-expert series; the journal holds the rows. Counts of two
    ranks are summed before anything is normalised."""
    cfg_all = load_config("all")
    handle, cfg = make_worker(sinks={**cfg_all.sinks.model_dump(), "console": None})
    per_rank = [{0: np.array([10, 0, 5, 5]), 1: np.array([3, 3, 3, 3])},
                {0: np.array([0, 30, 0, 10]), 1: np.array([1, 0, 0, 0])}]
    steps = 2
    for step in range(steps):
        for rank, counts in enumerate(per_rank):
            c = MetricClient(None, rank=rank, world_size=2, name=cfg.name, start_step=step)
            record_moe_balance(c, {layer: v * (step + 1) for layer, v in counts.items()})
            c.wait_submit(timeout_s=30)
    assert ray.get(handle.flush.remote(120), timeout=150)
    health = ray.get(handle.close.remote())
    assert not health["sink_errors"], health["sink_errors"]
    run_dir = Path(health["run_dir"])
    journal = read_journal(run_dir / "metrics.jsonl")
    expert = "moe_balance/layer_0/expert_1/tokens"
    for record in journal:
        step = record["step"]
        total = {layer: (per_rank[0][layer] + per_rank[1][layer]) * (step + 1)
                 for layer in (0, 1)}
        rows = [[layer, e, float(n), 100.0 * n / total[layer].sum()]
                for layer in (0, 1) for e, n in enumerate(total[layer])]
        table = record["meta"]["tables"]["moe_balance/expert_loads"]
        assert table["columns"] == ["layer", "expert", "tokens", "load_percent"]
        np.testing.assert_allclose(np.array(table["rows"], float), rows, rtol=1e-12)
        assert record["metrics"][expert] == total[0][1]  # the journal keeps every series
        columns, got = readback.wandb_tables(run_dir)[step]["moe_balance/expert_loads"]
        assert columns == table["columns"]
        np.testing.assert_allclose(np.array(got, float), rows, rtol=1e-12)
        wandb = readback.wandb_history(run_dir)[step]
        assert "moe_balance/layer_0/max_over_ideal" in wandb and expert not in wandb
        board = readback.tensorboard_scalars(run_dir / "tensorboard")[step]
        assert "moe_balance/layer_0/max_over_ideal" in board and expert not in board
        assert readback.swanlab_scalars(run_dir / "swanlab")[step][expert] == total[0][1]
        assert readback.swanlab_tables(run_dir / "swanlab")[step][
            safe_tag("moe_balance/expert_loads")] == {"columns": table["columns"],
                                                      "rows": table["rows"]}
        assert readback.mlflow_metrics((run_dir / "mlruns").as_uri())[step][expert] == \
            total[0][1]
        held = readback.mlflow_tables((run_dir / "mlruns").as_uri())[step]
        assert held["moe_balance/expert_loads"] == {"columns": table["columns"],
                                                    "data": table["rows"]}
    texts = readback.tensorboard_texts(run_dir / "tensorboard")
    assert sorted(texts) == list(range(steps))
    assert "| layer | expert | tokens | load_percent |" in texts[0]["moe_balance/expert_loads"]
    assert len(readback.wandb_tables(run_dir)) == steps  # one table a step, every step kept


def test_a_sink_that_draws_tables_gets_every_value_a_table_holds_or_its_scalar(tmp_path):
    """A sink with ``table_series = False`` gets a table instead of the scalars it holds;
    a table cut at ``max_rows`` leaves its scalars in (the rows past the cut are nowhere
    else)."""
    from metricsvc.service.output import Tables

    class Drawing(RecordingSink):
        table_series = False

    metrics = {f"moe/layer_0/expert_{e}/tokens": float(e) for e in range(4)}
    metrics["moe/layer_0/max_over_ideal"] = 1.5
    sink = Drawing()
    dispatcher = SinkDispatcher([sink], tmp_path)
    for step, max_rows in enumerate((10, 3)):
        tables = Tables({"loads": {"rows": "moe/layer_<layer>/expert_<expert>",
                                   "values": ["tokens"], "max_rows": max_rows}}).of(metrics)
        dispatcher.publish(step, metrics, {"tables": tables})
    dispatcher.close()
    (_, whole, _), (_, cut, meta) = sink.steps
    assert whole == {"moe/layer_0/max_over_ideal": 1.5}  # the table holds the rest
    assert cut == metrics and meta["tables"]["loads"]["cut"] == 1
