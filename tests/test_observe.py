"""The service's health, live in Ray's own metrics (issue 40): read back from Ray's
Prometheus export over HTTP, as Prometheus scrapes it (the session cluster's nodes export
on known ports, ``conftest.METRICS_PORTS``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import ray

from metricsvc.client import MetricClient
from metricsvc.core.records import summarize_array
from metricsvc.core.wire import Batch, encode
from metricsvc.errors import BatchRejected
from metricsvc.service.observe import COUNTERS, GAUGES, SINK_COUNTERS, SINK_GAUGES, LiveMetrics
from tests.conftest import METRICS_PORTS, ephemeral_ports

_LINE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")


def scrape() -> list[tuple[str, dict[str, str], float]]:
    """Every sample of every node's export: (name, labels, value)."""
    samples = []
    for port in METRICS_PORTS:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                          timeout=5).read().decode()
        except OSError:
            continue  # a node whose agent is not up: the others
        for line in text.splitlines():
            found = _LINE.match(line)
            if found and found.group(1).startswith("ray_metricsvc_"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', found.group(2)))
                samples.append((found.group(1), labels, float(found.group(3))))
    return samples


def values(samples, name: str, **labels: str) -> list[float]:
    return [v for n, tags, v in samples
            if n == name and all(tags.get(k) == x for k, x in labels.items())]


def test_the_services_health_is_live_in_rays_prometheus_export(make_worker):
    handle, cfg = make_worker(world_size=2, straggler_timeout_s=1.0,
                              sinks={"jsonl": {}},
                              metrics={"interval_s": 0.2, "export": ["loss/*"]})
    ranks = [MetricClient(None, rank=r, world_size=2, name=cfg.name) for r in range(2)]
    for r, c in enumerate(ranks):  # step 0: both ranks
        c.scalar(**{"loss/value": 1.0 + r})
        c.wait_submit(step=0, timeout_s=30)
    ranks[0].scalar(**{"loss/value": 5.0})  # step 1: rank 1 never closes it: partial
    ranks[0].wait_submit(step=1, timeout_s=30)
    bad = Batch.build(step=1, rank=1, world_size=3, seq=1, keys=["x"],  # another world size
                      data=summarize_array(np.array([1.0]))[None], kinds=[0], expected=[0],
                      final=True)
    with pytest.raises(BatchRejected):
        ray.get(handle.submit.remote(encode(bad)))
    final = ray.get(handle.wait_final.remote(1, 30))
    assert final["meta"]["partial"]
    health = ray.get(handle.health.remote())
    assert health["metrics_export"]["export"] == "on"

    service = {"service": cfg.name}
    want = {
        "ray_metricsvc_last_final_step": 1.0,
        "ray_metricsvc_pending_steps": 0.0,
        "ray_metricsvc_world_size": 2.0,
        "ray_metricsvc_batches_total": 3.0,
        "ray_metricsvc_rejected_batches_total": 1.0,
        "ray_metricsvc_partial_steps_total": 1.0,
        "ray_metricsvc_flush_to_final_seconds_count": 2.0,
        "ray_metricsvc_step": 1.0,
    }
    deadline = time.monotonic() + 60
    while True:
        samples = scrape()
        got = {name: values(samples, name, **service) for name in want}
        sink = values(samples, "ray_metricsvc_sink_steps_written_total", sink="jsonl",
                      **service)
        step_metric = values(samples, "ray_metricsvc_step_metric", metric="loss/value",
                             **service)
        if all(got[n] == [v] for n, v in want.items()) and sink == [2.0] \
                and step_metric == [5.0]:
            break
        assert time.monotonic() < deadline, (got, sink, step_metric)
        time.sleep(0.3)
    # every gauge is exported for this service; a counter once it counted something (as
    # Prometheus has it: a series that never grew is absent, `or vector(0)` in a panel)
    names = {n for n, tags, _ in samples if tags.get("service") == cfg.name}
    assert {f"ray_{name}" for name in [*GAUGES, *SINK_GAUGES]} <= names
    counted = {f"ray_{n}_total" for n in [*COUNTERS, *SINK_COUNTERS]} & names
    assert counted == {"ray_metricsvc_batches_total", "ray_metricsvc_rejected_batches_total",
                       "ray_metricsvc_partial_steps_total", "ray_metricsvc_merge_cpu_seconds_total",
                       "ray_metricsvc_sink_steps_written_total",
                       "ray_metricsvc_sink_cpu_seconds_total"}, counted
    merge_cpu = values(samples, "ray_metricsvc_merge_cpu_seconds_total", **service)
    assert len(merge_cpu) == 1 and 0 < merge_cpu[0] < 60
    sink_cpu = values(samples, "ray_metricsvc_sink_cpu_seconds_total", sink="jsonl", **service)
    assert len(sink_cpu) == 1 and 0 < sink_cpu[0] < 60  # the journal's thread


def test_a_gauge_keeps_its_value_between_two_reports_past_rays_gauge_ttl(make_worker):
    """Ray drops a gauge whose emitter stopped exporting it for two of its export intervals
    (the session cluster's: 2 s, so 4 s); a live actor's last value is exported every
    interval, set again or not. So the health may be reported less often than Ray exports
    (``metrics.interval_s``, 5 s by default against Ray's 10 s): here the one report of a
    closed service's final state (the actor lives on), then none, and the gauge is there at
    every scrape, well past those 4 s."""
    handle, cfg = make_worker(world_size=1, metrics={"interval_s": 3600.0})
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    client.scalar(x=1.0)
    client.wait_submit(step=0, timeout_s=30)
    assert ray.get(handle.close.remote())["metrics_export"]["reports"] == 1
    service = {"service": cfg.name}
    deadline = time.monotonic() + 60
    while not values(scrape(), "ray_metricsvc_last_final_step", **service):
        assert time.monotonic() < deadline
        time.sleep(0.3)
    seen, first = [], time.monotonic()
    while not seen or seen[-1][0] - first < 6.0:  # scrapes over 6 s, however slow each is
        got = values(scrape(), "ray_metricsvc_last_final_step", **service)
        seen.append((time.monotonic(), got))
        time.sleep(0.5)
    assert ray.get(handle.health.remote())["metrics_export"]["reports"] == 1  # none since
    assert len(seen) >= 4 and all(v == [0.0] for _, v in seen), seen


def test_the_nodes_export_on_ports_no_outgoing_connection_can_take(ray_cluster):
    """Each node's metrics agent binds its export port seconds after the port was found
    free; one from the kernel's ephemeral range could be handed meanwhile to a connection
    Ray opens as it starts: the agent failed to bind it, its node died with it, and a
    make test run errored in every test (the shared cluster did not start)."""
    ephemeral = ephemeral_ports()
    assert len(METRICS_PORTS) == 3  # the head and node_a, node_b
    assert not [port for port in METRICS_PORTS if port in ephemeral], METRICS_PORTS


def test_the_export_turned_off_says_so_and_reports_nothing(make_worker):
    handle, cfg = make_worker(world_size=1, metrics={"enabled": False})
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    client.scalar(x=1.0)
    client.wait_submit(step=0, timeout_s=30)
    status = ray.get(handle.health.remote())["metrics_export"]
    assert status["export"] == "off (metrics.enabled is false)" and status["series"] == 0
    assert not [s for s in scrape() if s[1].get("service") == cfg.name]


def test_without_rays_metrics_agent_the_service_says_what_to_install(monkeypatch):
    """Where ray[default] is missing (a base install), nothing is reported and health()
    names the extra to install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "aiohttp" else real(name, *a))
    live = LiveMetrics("svc")
    assert not live.on and "pip install 'metricsvc[observe]'" in live.status()["export"]
    from metricsvc.service.output import StepResult

    live.report({"pending_steps": {}, "sinks": {"jsonl": {"written": 3}}},  # a no-op
                [StepResult(0, {"x": 1.0}, {"age_s": 0.1})])
    assert live.status()["reports"] == 0


def test_the_service_built_without_ray_reports_its_health_and_starts_no_ray(tmp_path):
    """The service's body built directly in a process not connected to Ray (as
    ``bench_restart`` builds it, and tests do) reads its health, reports it and closes
    without starting Ray. Its health read Ray's runtime context, which starts a local Ray
    instance where none is connected: a test's body whose reporter thread outlived the
    test started two Ray clusters from a make test worker after its session had ended."""
    script = (
        "import json, sys, ray\n"
        "from metricsvc.service.worker import MetricWorkerImpl\n"
        "impl = MetricWorkerImpl({'name': 'bare', 'sinks': {'console': None},\n"
        "                         'run': {'root': sys.argv[1], 'experiment': 'e', 'trial': 't'}})\n"
        "impl.reporter.report()  # what its reporter thread does every interval\n"
        "health = impl.close()\n"
        "print(json.dumps({'ray': ray.is_initialized(), 'node_id': health['node_id'],\n"
        "                  'export': health['metrics_export']['export']}))\n")
    env = {**os.environ, "RAY_ADDRESS": "local"}  # where a start would start a cluster
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got == {"ray": False, "node_id": None,
                   "export": "off: this process is not connected to Ray"}, done.stderr[-2000:]
    assert "Started a local Ray instance" not in done.stderr


def test_a_combiner_reports_its_forwards_in_rays_export(make_worker):
    import metricsvc

    handle, cfg = make_worker(world_size=2, topology="per_node")
    combiner = metricsvc.start_combiner(cfg, "obs")
    ranks = [MetricClient(None, rank=r, world_size=2, name=cfg.name, via="obs")
             for r in range(2)]
    for step in range(3):
        for c in ranks:
            c.scalar(x=float(step))
            c.flush()
    for c in ranks:
        c.wait_acks(30)
    ray.get(handle.wait_final.remote(2, 30))
    assert ray.get(combiner.health.remote())["metrics_export"] == "on"
    tags = {"service": cfg.name, "combiner": "obs"}
    deadline = time.monotonic() + 60
    while True:
        samples = scrape()
        forwarded = values(samples, "ray_metricsvc_combiner_forwarded_batches_total", **tags)
        registered = values(samples, "ray_metricsvc_combiner_ranks", **tags)
        if forwarded == [6.0] and registered == [2.0]:
            break
        assert time.monotonic() < deadline, (forwarded, registered)
        time.sleep(0.3)
    ray.kill(combiner)
