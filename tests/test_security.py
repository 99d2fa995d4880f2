"""Isolation and secrets: namespaces do not share a service; a planted API key shows up nowhere."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray

import metricsvc
from metricsvc.client import MetricClient

ROOT = Path(__file__).resolve().parent.parent


def test_two_namespaces_get_their_own_singleton_and_no_metric_crosses(ray_cluster, tmp_path):
    handles = {}
    for ns in ("team-a", "team-b"):
        handles[ns] = metricsvc.start_metric_worker(
            {"name": "shared-name", "run": {"root": str(tmp_path / ns), "trial": "t"},
             "sinks": {"console": None}}, namespace=ns)
    assert handles["team-a"]._actor_id != handles["team-b"]._actor_id
    for ns, value in (("team-a", 1.0), ("team-b", 2.0)):
        c = MetricClient(None, rank=0, world_size=1, name="shared-name", namespace=ns)
        c.submit_metric({"x": value})
        c.wait_submit()
    assert ray.get(handles["team-a"].wait_final_res.remote(0, 10)) == {"x": 1.0}
    assert ray.get(handles["team-b"].wait_final_res.remote(0, 10)) == {"x": 2.0}
    for handle in handles.values():
        ray.kill(handle)


@pytest.mark.slow
def test_a_second_job_on_the_cluster_cannot_join_a_live_jobs_service(make_worker, joined_env,
                                                                     tmp_path):
    """Two training jobs on one cluster with the default names would merge into one service:
    the second job's start is refused in one line, and the first job's service is untouched."""
    handle, cfg = make_worker()
    script = ("import ray, metricsvc\nray.init(logging_level='ERROR')\n"
              f"cfg = {cfg.model_dump(mode='json')!r}\n"
              "try:\n    metricsvc.start_metric_worker(cfg)\n"
              "except ValueError as err:\n    print('REFUSED', err)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=tmp_path, env=joined_env(METRICSVC_NAMESPACE=cfg.namespace),
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    refused = [line for line in out.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 1 and "for another job" in refused[0], out.stdout
    assert f"named {cfg.name!r} already runs in namespace {cfg.namespace!r}" in refused[0]
    assert ray.get(handle.health.remote(), timeout=30)["name"] == cfg.name


@pytest.mark.slow
def test_a_planted_api_key_appears_in_no_log_journal_health_or_config(tmp_path):
    """The documented way: the key is in the environment of the driver (or of `ray start`)."""
    secret = "sk-planted-5f3c9a0e7d41"
    script = textwrap.dedent(f"""
        import json, ray, metricsvc
        from metricsvc.client import MetricClient
        ray.init(num_cpus=1, include_dashboard=False)
        cfg = {{"name": "secret-holder", "run": {{"root": {str(tmp_path)!r}, "trial": "t"}},
               "sinks": {{"console": {{"every": 1}}, "wandb": {{"mode": "offline"}},
                         "swanlab": {{"mode": "offline"}}}}}}
        handle = metricsvc.start_metric_worker(cfg)
        c = MetricClient(None, rank=0, world_size=1, name="secret-holder")
        for step in range(3):
            c.submit_metric({{"loss": float(step)}})
            c.wait_submit()
        health = ray.get(handle.close.remote())
        print("HEALTH", json.dumps(health, default=str))
        print("SESSION", ray._private.worker._global_node.get_session_dir_path())
    """)
    env = {**os.environ, "WANDB_API_KEY": secret,
           "SWANLAB_API_KEY": secret}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert secret not in out.stdout + out.stderr  # the driver's console, health included
    session = next(line.split(" ", 1)[1] for line in out.stdout.splitlines()
                   if line.startswith("SESSION "))
    files = [p for p in Path(tmp_path).rglob("*") if p.is_file()]
    assert any(p.name == "metrics.jsonl" for p in files)
    assert any(p.name == "config.yaml" for p in files)
    logs = [p for p in Path(session, "logs").rglob("*") if p.is_file()]
    assert logs
    leaked = [str(p) for p in files + logs if secret.encode() in p.read_bytes()]
    assert leaked == []
