"""The run folder is the truth: no swallowed runs, no crash loops, no duplicates, no lost
tail, no leaked secret. Real faults on real files and a real local Ray cluster."""

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

import metricsvc
from metricsvc.cli.main import main as cli_main
from metricsvc.client import MetricClient, ServiceUnavailable
from metricsvc.sinks.jsonl import JsonlSink
from metricsvc.storage.journal import read_journal
from metricsvc.storage.run_folder import probe_run_dir
from tests.helpers import until_named

ROOT = Path(__file__).resolve().parent.parent


def config(tmp_path, name, **extra):
    cfg = {"name": name, "run": {"root": str(tmp_path), "experiment": "e", "trial": "fixed"},
           "sinks": {"console": None}}
    for key, value in extra.items():
        cfg[key] = {**cfg[key], **value} if isinstance(cfg.get(key), dict) else value
    return cfg


def one_step(name, value, world_size=1):
    client = MetricClient(None, rank=0, world_size=world_size, name=name)
    client.submit_metric({"x": value})
    client.wait_submit()
    return client


def first_run(tmp_path, name, steps):
    """A run of ``steps`` steps (x = the step) on a fresh service, stopped."""
    handle = metricsvc.start_metric_worker(config(tmp_path, name))
    client = MetricClient(None, rank=0, world_size=1, name=name)
    for step in range(steps):
        client.submit_metric({"x": float(step)})
        client.wait_submit(step=step)
    metricsvc.stop_metric_worker(handle)


# -- a new run is never mistaken for a restart ---------------------------------------------
def test_a_new_run_on_a_used_folder_is_refused_naming_it_and_resume_continues_it(
        ray_cluster, tmp_path):
    first = metricsvc.start_metric_worker(config(tmp_path, "run-a"))
    one_step("run-a", 1.0)
    assert ray.get(first.wait_final_res.remote(0, 10)) == {"x": 1.0}
    metricsvc.stop_metric_worker(first)
    folder = tmp_path / "e" / "fixed"
    with pytest.raises(ValueError, match=f"run folder {folder} already holds a run") as err:
        metricsvc.start_metric_worker(config(tmp_path, "run-b"))
    assert "run.resume" in str(err.value)
    resumed = metricsvc.start_metric_worker(config(tmp_path, "run-c", run={"resume": True}))
    assert ray.get(resumed.wait_final_res.remote(0, 10)) == {"x": 1.0}
    client = MetricClient(None, rank=0, world_size=1, name="run-c", start_step=1)
    client.submit_metric({"x": 2.0})
    assert client.wait_submit()["status"] == "merged"
    assert ray.get(resumed.wait_final_res.remote(1, 10)) == {"x": 2.0}
    metricsvc.stop_metric_worker(resumed)
    assert [r["step"] for r in read_journal(folder / "metrics.jsonl")] == [0, 1]


def test_two_launches_in_the_same_second_get_their_own_trial_folders(ray_cluster, tmp_path):
    from metricsvc.config import new_trial

    assert len({new_trial() for _ in range(1000)}) == 1000  # all within a second or two
    handles = []
    for name in ("same-second-a", "same-second-b"):
        cfg = {"name": name, "run": {"root": str(tmp_path)}, "sinks": {"console": None}}
        handles.append(metricsvc.start_metric_worker(cfg))
    dirs = {ray.get(h.health.remote())["run_dir"] for h in handles}
    assert len(dirs) == 2
    for handle in handles:
        metricsvc.stop_metric_worker(handle)


# -- the journal survives what disks and people do to it ----------------------------------
def test_unreadable_journal_lines_are_skipped_with_one_warning_each_and_counted(
        ray_cluster, tmp_path, caplog):
    folder = tmp_path / "e" / "fixed"
    folder.mkdir(parents=True)
    good = {"step": 0, "metrics": {"x": 1.0, "y": "inf"}, "meta": {"ranks": [0],
                                                                   "world_size": 1}}
    lines = [json.dumps(good), '{"step": 7}', '{"step": "one", "metrics": {}, "meta": {}}',
             '{"step": 1, "metrics": [], "meta": {}}', "[1, 2]", '{"event": {"type": "x"}}',
             json.dumps({**good, "step": 1}), '{"step": 2, "metr']
    (folder / "metrics.jsonl").write_text("\n".join(lines))
    with caplog.at_level(logging.WARNING, logger="metricsvc.storage.journal"):
        steps = read_journal(folder / "metrics.jsonl")
    assert [r["step"] for r in steps] == [0, 1]
    assert steps[0]["metrics"]["y"] == math.inf  # non-finite values come back as floats
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 5 and all(str(folder / "metrics.jsonl") in m for m in skipped)
    assert [m.split(":")[-2].rsplit(" ", 1)[-1] for m in skipped][:1] == ["line 2"] or \
        "line 2" in skipped[0]
    handle = metricsvc.start_metric_worker(config(tmp_path, "reload-odd", run={"resume": True}))
    health = ray.get(handle.health.remote())
    assert health["restored_steps"] == 2 and health["journal_skipped_lines"] == 5
    assert ray.get(handle.wait_final_res.remote(1, 10)) == {"x": 1.0, "y": math.inf}
    metricsvc.stop_metric_worker(handle)


def test_nonfinite_results_round_trip_with_their_type(tmp_path):
    sink = JsonlSink()
    sink.open(tmp_path)
    sink.write(0, {"a": math.inf, "b": -math.inf, "c": math.nan, "d": 1.5}, {})
    sink.close()
    (record,) = read_journal(tmp_path / "metrics.jsonl")
    values = record["metrics"]
    assert values["a"] == math.inf and values["b"] == -math.inf and math.isnan(values["c"])
    assert all(isinstance(v, float) for v in values.values())


def test_readers_keep_one_record_per_step_and_say_so(tmp_path, caplog, capsys):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "metrics": {"x": float(s)}, "meta": {}} for s in (0, 1, 1, 2, 2, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="metricsvc.storage.journal"):
        steps = read_journal(path)
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert any("3 duplicate" in r.getMessage() for r in caplog.records)
    assert cli_main(["report", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[0].split() == ["step", "0", "1", "2"]
    assert "3 duplicate" in out.err


@pytest.mark.slow
def test_a_transient_write_failure_never_duplicates_a_line_or_tears_the_dead_letter(tmp_path):
    """A real file-size limit (RLIMIT_FSIZE) in a child process, hit and then lifted."""
    script = textwrap.dedent(f"""
        import json, resource, signal, time
        from pathlib import Path
        from metricsvc.config import DeliveryConfig
        from metricsvc.sinks.dispatch import SinkDispatcher
        from metricsvc.sinks.jsonl import JsonlSink
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail (EFBIG)
        run = Path({str(tmp_path)!r})
        d = SinkDispatcher([JsonlSink()], run, DeliveryConfig(retries=2, backoff_s=0.05))
        big = {{f"k{{i}}": float(i) for i in range(200)}}
        def publish(step):
            d.publish(step, dict(big, step=float(step)), {{"ranks": [0]}})
        for step in range(3):
            publish(step)
        assert d.flush(10)
        size = (run / "metrics.jsonl").stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 3000, resource.RLIM_INFINITY))
        publish(3)  # fails every try: dead-lettered (whose file hits the limit too)
        publish(4)
        assert d.flush(10)
        health = d.health()["jsonl"]
        print("FAILED", health["failures"], health["dead_lettered"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        for step in range(5, 8):
            publish(step)
        d.close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    failed = next(line for line in out.stdout.splitlines() if line.startswith("FAILED"))
    assert int(failed.split()[1]) > 0  # the fault really happened
    journal = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in journal]
    assert len(steps) == len(set(steps)) and steps == sorted(steps)
    dead = tmp_path / "dead_letter.jsonl"
    dead_steps = []
    if dead.exists():
        text = dead.read_text()
        assert text == "" or text.endswith("\n")
        dead_steps = [json.loads(line)["step"] for line in text.splitlines()]
    # every step is in exactly one place, or (if even the dead letter could not take it)
    # was reported as lost by the health the sink kept
    assert not set(steps) & set(dead_steps)
    assert set(range(8)) - set(steps) - set(dead_steps) <= {3, 4}
    assert {0, 1, 2, 5, 6, 7} <= set(steps)


# -- shutdown loses nothing without a trace ------------------------------------------------
def test_stop_with_a_slow_sink_writes_or_dead_letters_every_step_and_never_closes_mid_write(
        ray_cluster, tmp_path):
    trace = tmp_path / "slow-trace.txt"
    cfg = config(tmp_path, "slow-stop", sinks={
        "console": None, "jsonl": {},
        "custom": [{"target": "tests.sink_fixtures:SlowSink",
                    "options": {"seconds": 0.6, "trace": str(trace)}}],
        "delivery": {"close_timeout_s": 1.5}})
    handle = metricsvc.start_metric_worker(cfg)
    client = MetricClient(None, rank=0, world_size=1, name="slow-stop")
    for step in range(6):
        client.submit_metric({"x": float(step)})
        client.wait_submit()
    ray.get(handle.wait_final_res.remote(5, 10))
    health = metricsvc.stop_metric_worker(handle)
    slow = health["sinks"]["slow"]
    assert slow["written"] + slow["dead_lettered"] == 6 and slow["dead_lettered"] > 0
    assert health["sinks"]["jsonl"]["written"] == 6
    # Steps that never reached a sink make it one of the sink errors, with the reason: a
    # user reading sink_errors after close is not told all went well
    assert set(health["sink_errors"]) == {"slow"}
    assert "close gave up" in health["sink_errors"]["slow"]["last_error"]
    folder = Path(health["run_dir"])
    dead = [json.loads(line) for line in (folder / "dead_letter.jsonl").read_text().splitlines()]
    assert sorted(d["step"] for d in dead if d["sink"] == "slow") == \
        list(range(slow["written"], 6))
    # The sink is closed by its own thread once its last write returns (or not at all if
    # the actor is ended first): never while a write runs.
    events = trace.read_text().split()
    if "close" in events:
        assert events[-1] == "close" and events[-2] == "write-end"
    writes = [e for e in events if e != "close"]
    assert all(writes[i:i + 2] in (["write-start", "write-end"], ["write-start"])
               for i in range(0, len(writes), 2))


def one_slow_step(tmp_path, name, seconds, **delivery):
    """A service whose slow sink takes ``seconds`` a write, with step 0 final (and being
    written); return its handle and the sink's trace file."""
    trace = tmp_path / "trace.txt"
    handle = metricsvc.start_metric_worker(config(tmp_path, name, sinks={
        "console": None, "jsonl": {}, "delivery": delivery,
        "custom": [{"target": "tests.sink_fixtures:SlowSink",
                    "options": {"seconds": seconds, "trace": str(trace)}}]}))
    one_step(name, 1.0)
    ray.get(handle.wait_final_res.remote(0, 10))
    return handle, trace


def begin_close(handle):
    """Close the service as a caller whose own wait runs out first: return, the close
    still running (the slow sink still writing step 0)."""
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(handle.close.remote(), timeout=0.5)


def test_a_stop_while_an_earlier_close_still_runs_waits_for_it_and_loses_no_step(
        ray_cluster, tmp_path):
    """A caller whose own wait for ``close`` ran out (or another caller's close, still
    running) and then a stop: the stop's close returns once the first close has closed the
    sinks. A second close answered at once, and the kill right after it ended a sink in the
    middle of a write: its step was neither written nor dead-lettered."""
    handle, trace = one_slow_step(tmp_path, "close-twice", 2)
    begin_close(handle)
    health = metricsvc.stop_metric_worker(handle)
    assert trace.read_text().split() == ["write-start", "write-end", "close"]
    assert health["sinks"]["slow"]["written"] == 1
    assert health["sinks"]["slow"]["dead_lettered"] == 0 and not health["sink_errors"]


def test_a_flush_while_a_close_runs_says_true_only_once_the_sinks_have_the_steps(
        ray_cluster, tmp_path):
    """The actor's ``flush()`` says every finished step has reached the sinks: during a
    close it said so at once, while a slow sink was still writing the last step."""
    handle, trace = one_slow_step(tmp_path, "flush-closing", 2)
    begin_close(handle)
    assert ray.get(handle.flush.remote(0.2), timeout=30) is False  # not within 0.2 s
    assert ray.get(handle.flush.remote(20), timeout=30) is True
    assert trace.read_text().split()[:2] == ["write-start", "write-end"]
    metricsvc.stop_metric_worker(handle)


def test_a_stop_waits_past_its_timeout_for_a_close_the_service_still_answers_through(
        ray_cluster, tmp_path):
    """``timeout_s`` guards a service that does not answer; a close still running in one
    that answers is waited for (``close_timeout_s`` bounds it). The stop gave up after
    ``timeout_s`` in all: the steps a slow sink had not written were then lost with the
    driver (its default, 120 s, undercut any close timeout over about 90 s)."""
    handle, trace = one_slow_step(tmp_path, "stop-waits", 3, close_timeout_s=60)
    health = metricsvc.stop_metric_worker(handle, timeout_s=1)
    assert trace.read_text().split() == ["write-start", "write-end", "close"]
    assert health["sinks"]["slow"]["written"] == 1 and not health["sink_errors"]


def test_a_stop_gives_up_on_a_service_that_stops_answering(ray_cluster, tmp_path):
    """Waiting for a close never hangs: a service that answers nothing (its process
    stopped) is given up once it has been silent for ``timeout_s`` (it took twice that: a
    wait for the close, then a health call's) and ended all the same, in one line of our
    own. It raised Ray's GetTimeoutError and left the service holding its name and run
    folder; the stop now returns once the folder is free."""
    cfg = config(tmp_path, "stop-silent")
    handle = metricsvc.start_metric_worker(cfg)
    one_step("stop-silent", 1.0)
    pid = ray.get(handle.health.remote(), timeout=60)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            stopping = pool.submit(metricsvc.stop_metric_worker, handle, timeout_s=4)
            # given up and ended: Ray lets the name go at once (the process a moment later)
            until_named(["stop-silent"], metricsvc.load_config(cfg).namespace, False,
                        "the silent service kept its name")
            assert 4 <= time.monotonic() - start < 7  # it took 8: wide of a loaded lag
            with pytest.raises(ServiceUnavailable) as raised:
                stopping.result(timeout=60)
        assert str(raised.value) == (
            "MetricWorker 'stop-silent' was silent for 4 s while closing and was ended: "
            "its sinks were not closed")
        probe_run_dir(tmp_path / "e" / "fixed")  # no live service holds the folder
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        ray.kill(handle, no_restart=True)


@pytest.mark.slow
def test_a_driver_that_ends_without_close_gives_its_sinks_the_configured_close_timeout(
        tmp_path, joined_env):
    """A driver that ends without ``close()`` is closed by the exit hook
    ``start_metric_worker`` registers, and Ray ends the service right after it. The hook
    waited 60 s whatever ``sinks.delivery.close_timeout_s`` said: with a longer one, a sink
    still writing at 60 s was ended with the actor, and its step was neither written nor
    dead-lettered. The hook waits for the whole close while the service answers."""
    trace = tmp_path / "trace.txt"
    script = textwrap.dedent(f"""
        import ray, metricsvc
        from metricsvc.client import MetricClient
        ray.init(log_to_driver=False)
        metricsvc.start_metric_worker({{
            "name": "exit-slow", "run": {{"root": {str(tmp_path)!r}, "trial": "t"}},
            "sinks": {{"console": None, "delivery": {{"close_timeout_s": 100}},
                      "custom": [{{"target": "tests.sink_fixtures:SlowSink",
                                  "options": {{"seconds": 65, "trace": {str(trace)!r}}}}}]}}}})
        c = MetricClient(None, rank=0, world_size=1, name="exit-slow")
        c.submit_metric({{"x": 1.0}})
        c.wait_submit(timeout_s=60)
        # no close(), no stop: the script just ends, the sink still writing its step
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, env=joined_env(PYTHONPATH=str(ROOT)), timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert trace.read_text().split() == ["write-start", "write-end", "close"]


def test_a_client_of_an_actor_stopped_for_good_fails_at_once(ray_cluster, tmp_path, caplog):
    cfg = config(tmp_path, "gone-for-good")
    handle = metricsvc.start_metric_worker(cfg)
    client = one_step("gone-for-good", 1.0)
    metricsvc.stop_metric_worker(handle)
    # Gone for good once Ray has let its name go: ``ray.kill`` returns before that, and a
    # batch sent in between meets the closed actor ("is closed (submit refused)")
    until_named(["gone-for-good"], metricsvc.load_config(cfg).namespace, False,
                "the stopped service kept its name")
    client.submit_metric({"x": 2.0})
    start = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(ServiceUnavailable,
                                                         match="gone-for-good.*dead"):
        client.wait_submit(timeout_s=5)
    assert time.monotonic() - start < 5  # bounded by timeout_s, retries included
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) <= 1


# -- secrets -------------------------------------------------------------------------------
@pytest.mark.slow
def test_one_redaction_rule_hides_every_planted_secret_and_no_number(tmp_path, joined_env):
    secret = "S3CRETpw-71c2"
    script = textwrap.dedent(f"""
        import json, subprocess, sys, ray, metricsvc
        from metricsvc.client import MetricClient
        ray.init()  # the session's cluster: its logs, every test's, are searched
        cfg = {{"name": "secret-places", "run": {{"root": {str(tmp_path)!r}, "trial": "t"}},
               "sinks": {{"console": {{"every": 1}},
                         "mlflow": {{"tracking_uri": "http://user:{secret}@127.0.0.1:9/x"}},
                         "custom": [{{"target": "tests.sink_fixtures:ExplodingSink",
                                     "options": {{"api_key": "{secret}",
                                                 "message": "auth failed for "
                                                 "https://bot:{secret}@host/api"}}}}],
                         "delivery": {{"retries": 0}}}}}}
        handle = metricsvc.start_metric_worker(cfg)
        c = MetricClient(None, rank=0, world_size=1, name="secret-places")
        c.submit_metric({{"loss": 1.0}})
        c.wait_submit()
        ray.get(handle.flush.remote(30))
        health = ray.get(handle.close.remote())
        print("HEALTH", json.dumps(health, default=str))
        print("SESSION", ray._private.worker._global_node.get_session_dir_path())
    """)
    mlflow = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",  # nobody listens on port 9
              "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    env = joined_env()  # the actor's environment is the job's runtime environment's
    job = json.loads(env["RAY_JOB_CONFIG_JSON_ENV_VAR"])
    job["runtime_env"]["env_vars"].update(mlflow)
    env.update(mlflow, RAY_JOB_CONFIG_JSON_ENV_VAR=json.dumps(job))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    health = json.loads(next(line.split(" ", 1)[1] for line in out.stdout.splitlines()
                             if line.startswith("HEALTH ")))
    assert health["sink_errors"]  # the exploding sink really failed, with its message
    session = next(line.split(" ", 1)[1] for line in out.stdout.splitlines()
                   if line.startswith("SESSION "))
    cfg_file = next(Path(tmp_path).rglob("config.yaml"))
    validate = subprocess.run([sys.executable, "-m", "metricsvc.cli.main", "validate-config",
                               str(cfg_file)], capture_output=True, text=True, cwd=ROOT,
                              timeout=60)
    files = [p for p in Path(tmp_path).rglob("*") if p.is_file()]
    assert any(p.name == "dead_letter.jsonl" for p in files)
    logs = [p for p in Path(session, "logs").rglob("*") if p.is_file()]
    leaked = [str(p) for p in files + logs if secret.encode() in p.read_bytes()]
    assert leaked == []
    assert secret not in out.stdout + out.stderr + validate.stdout + validate.stderr
    assert "max_keys_per_batch: 100000" in validate.stdout  # numbers are never hidden
    assert "user:***@127.0.0.1" in validate.stdout


# -- one run folder, one live owner --------------------------------------------------------
def test_a_second_live_service_on_a_run_folder_is_refused_naming_the_holder(ray_cluster,
                                                                           tmp_path):
    """A second service with run.resume: true, started while the first still ran, wrote
    into the same journal: steps [0, 1, 2, 3, 3, 4, 4, 5, 5]. The live owner holds the
    folder (an OS lock); a SIGKILLed owner's lock goes with its process."""
    first = metricsvc.start_metric_worker(config(tmp_path, "own-a"))
    one_step("own-a", 1.0)
    folder = tmp_path / "e" / "fixed"
    with pytest.raises(ValueError, match=rf"run folder {folder} is held by a live service "
                                         r"\(\{\"service\": \"own-a\", \"pid\": \d+"):
        metricsvc.start_metric_worker(config(tmp_path, "own-b", run={"resume": True}))
    ray.kill(first, no_restart=True)  # SIGKILL: the kernel lets go of the lock
    deadline = time.monotonic() + 30
    while True:  # the process goes down a moment after the kill is acknowledged
        try:
            second = metricsvc.start_metric_worker(config(tmp_path, "own-b",
                                                          run={"resume": True}))
            break
        except ValueError:
            assert time.monotonic() < deadline, "the killed owner's lock was never released"
    assert ray.get(second.wait_final_res.remote(0, 10)) == {"x": 1.0}
    client = MetricClient(None, rank=0, world_size=1, name="own-b", start_step=1)
    client.submit_metric({"x": 2.0})
    client.wait_submit()
    metricsvc.stop_metric_worker(second)
    assert [r["step"] for r in read_journal(folder / "metrics.jsonl")] == [0, 1]


def test_starting_a_running_service_with_another_config_names_the_fields(ray_cluster,
                                                                         tmp_path):
    """start_metric_worker with another trial and world size returned the running
    service without a word; it returns it only for the same config."""
    handle = metricsvc.start_metric_worker(config(tmp_path, "cfg-a", world_size=2))
    assert metricsvc.start_metric_worker(config(tmp_path, "cfg-a", world_size=2)) == handle
    with pytest.raises(ValueError, match=r"a MetricWorker named 'cfg-a' already runs .* "
                                         r"with another config: run.trial, world_size differ"):
        metricsvc.start_metric_worker(config(tmp_path, "cfg-a", world_size=4,
                                             run={"trial": "other"}))
    metricsvc.stop_metric_worker(handle)


def test_rerunning_final_steps_after_a_resume_is_refused_naming_rewind(ray_cluster, tmp_path):
    """Resume a run and rerun steps 4-7 from a checkpoint with new values: every close was
    acked 'duplicate' and the old values stayed, silently. Now each is refused at the
    rank, naming the step and the call to make."""
    first_run(tmp_path, "rerun-a", 8)
    resumed = metricsvc.start_metric_worker(config(tmp_path, "rerun-b", run={"resume": True}))
    rerun = MetricClient(None, rank=0, world_size=1, name="rerun-b", start_step=4)
    rerun.submit_metric({"x": 100.0})
    with pytest.raises(ValueError, match=r"step 4: conflict: rank 0 .*already final.*"
                                         r"rewind\(to_step="):
        rerun.wait_submit(step=4)
    assert ray.get(resumed.wait_final_res.remote(4, 10)) == {"x": 4.0}
    metricsvc.stop_metric_worker(resumed)


# -- the journal's content decides what it holds -------------------------------------------
def test_a_watermark_past_the_journal_never_stops_it_and_a_torn_step_is_written_again(
        ray_cluster, tmp_path):
    """With sinks/jsonl.json set past the journal's end, the journal stopped growing
    (written stayed 0, no error); with its torn last line a step the ranks still owed,
    it ended [0, 1, 2, 4]. The journal's own content decides; what the watermark claims
    and the file lacks is reported in health() until it is written."""
    first_run(tmp_path, "hole-a", 4)
    folder = tmp_path / "e" / "fixed"
    journal = folder / "metrics.jsonl"
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join(lines[:3]) + lines[3][:25])  # step 3's line torn
    (folder / "sinks" / "jsonl.json").write_text(json.dumps({"durable_through": 50}))

    resumed = metricsvc.start_metric_worker(config(tmp_path, "hole-b", run={"resume": True}))
    missing = ray.get(resumed.health.remote())["sinks"]["jsonl"]["missing"]
    assert missing["steps"][:2] == [3, 4] and missing["count"] == 48
    assert "ends at 2" in missing["reason"]
    again = MetricClient(None, rank=0, world_size=1, name="hole-b", start_step=3)
    for step in (3, 4):  # the step the ranks still owed, sent again, and the next
        again.submit_metric({"x": 10.0 * step})
        again.wait_submit(step=step)
    health = metricsvc.stop_metric_worker(resumed)
    assert health["sinks"]["jsonl"]["written"] == 2
    assert health["sinks"]["jsonl"]["missing"]["count"] == 46  # 5..50: claimed, never held
    assert [(r["step"], r["metrics"]["x"]) for r in read_journal(journal)] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_a_restart_streams_the_journal_and_keeps_a_bounded_part(tmp_path):
    """Resuming a 28 MB journal raised peak RSS by 379 MB: the whole journal was held. A
    restart keeps keep_results steps, running totals and recent digests (counted with
    tracemalloc, not timed; benchmarks/bench_restart.py measures peak RSS)."""
    import tracemalloc

    from benchmarks.bench_restart import write_journal
    from metricsvc.service.worker import MetricWorkerImpl

    folder = tmp_path / "e" / "fixed"
    folder.mkdir(parents=True)
    write_journal(folder / "metrics.jsonl", 5000, 20, 4)  # 4.7 MB
    cfg = config(tmp_path, "stream", run={"resume": True}, limits={"keep_results": 5},
                 sinks={"jsonl": {}})
    tracemalloc.start()
    impl = MetricWorkerImpl(cfg)
    impl.sinks.flush()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    impl.close()  # its sinks and its reporter thread, which would outlive the test
    assert impl.restored_steps == 5000 and list(impl.results.by_step) == [4995, 4996, 4997,
                                                                    4998, 4999]
    assert peak < 12 * 2**20, f"a restart held {peak / 2**20:.0f} MB"  # 6.9 MB measured


def test_a_resend_of_an_old_step_is_told_by_its_content_read_back_from_the_journal(
        ray_cluster, tmp_path):
    """Past the 64 steps whose digests the service keeps in memory, the journal's digests
    (meta.digests) still tell a byte-identical resend (a duplicate) from a rerun (refused):
    by content, not by a window."""
    from metricsvc.core.records import scalar_row
    from metricsvc.core.wire import Batch, encode

    handle = metricsvc.start_metric_worker(config(tmp_path, "old-resend"))
    blobs = [encode(Batch.build(step=s, rank=0, world_size=1, seq=s + 1, final=True,
                                keys=("x",), data=scalar_row(float(s))[None], kinds=[1],
                                expected=[0]))
             for s in range(70)]
    for blob in blobs:
        ray.get(handle.submit.remote(blob))
    assert ray.get(handle.submit.remote(blobs[2]))["status"] == "duplicate"
    other = encode(Batch.build(step=2, rank=0, world_size=1, seq=3, final=True, keys=("x",),
                               data=scalar_row(99.0)[None], kinds=[1], expected=[0]))
    with pytest.raises(ValueError, match=r"step 2: conflict: rank 0 seq 3 was already received "
                                         r"with other content.*rewind"):
        ray.get(handle.submit.remote(other))
    assert ray.get(handle.wait_final_res.remote(2, 10))["x/mean"] == 2.0
    metricsvc.stop_metric_worker(handle)


def test_a_journal_cut_back_to_the_checkpoint_takes_the_rerun_without_a_hole(ray_cluster,
                                                                             tmp_path):
    """Cut the journal back to the checkpoint (step 3), resume and rerun: the journal ended
    with steps {0-3, 8, 9}, 4-7 never written, and nothing said so."""
    first_run(tmp_path, "cut-a", 8)
    journal = tmp_path / "e" / "fixed" / "metrics.jsonl"
    journal.write_bytes(b"".join(journal.read_bytes().splitlines(keepends=True)[:4]))
    resumed = metricsvc.start_metric_worker(config(tmp_path, "cut-b", run={"resume": True}))
    rerun = MetricClient(None, rank=0, world_size=1, name="cut-b", start_step=4)
    for step in range(4, 10):
        rerun.submit_metric({"x": 10.0 * step})
        rerun.wait_submit(step=step)
    health = metricsvc.stop_metric_worker(resumed)
    assert [r["step"] for r in read_journal(journal)] == list(range(10))
    assert [r["metrics"]["x"] for r in read_journal(journal)][4:] == [40.0, 50.0, 60.0, 70.0,
                                                                      80.0, 90.0]
    assert health["sinks"]["jsonl"]["missing"] is None  # 4-7 claimed, then written


def test_a_sinks_state_is_appended_per_step_and_reads_back_whole_after_a_torn_write(tmp_path):
    """A sink's watermark advances every step: appended as one line (a replace per step
    cost the service ~0.3 ms of CPU per sink here), folded on reading, a torn last line
    left out; a sink's own fields (wandb's run id) and the watermark's, written by two
    readers of the one file, both stay; a long file is compacted into one line."""
    from metricsvc.storage.files import SinkState

    ours, sinks = SinkState(tmp_path, "wandb"), SinkState(tmp_path, "wandb")
    ours.update(durable_through=0, segment=0)
    sinks.update(run_id="abc123")
    inode = ours.path.stat().st_ino
    for step in range(1, 200):
        ours.update(durable_through=step, segment=0)
    assert ours.path.stat().st_ino == inode  # appended in place, never replaced per step
    assert sinks.load() == {"durable_through": 199, "segment": 0, "run_id": "abc123"}
    with open(ours.path, "ab") as fh:
        fh.write(b'{"durable_through": 20')  # a crash tore the last append
    assert ours.load()["durable_through"] == 199
    ours.update(durable_through=200, segment=1)  # starts on a line of its own
    assert ours.load() == {"durable_through": 200, "segment": 1, "run_id": "abc123"}
    for step in range(201, 3000):
        ours.update(durable_through=step, segment=1)
    assert ours.path.stat().st_size < 70_000  # compacted: it never grows without bound
    assert sinks.load() == {"durable_through": 2999, "segment": 1, "run_id": "abc123"}
    ours.path.write_text(json.dumps({"durable_through": 7, "run_id": "old"}))  # old format
    ours.update(durable_through=8)
    assert ours.load() == {"durable_through": 8, "run_id": "old"}
