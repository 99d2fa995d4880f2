"""Layout promises: the service never imports torch; the demo runs end to end."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_service_package_never_imports_torch_or_clients():
    code = "import sys, metricsvc; print('torch' in sys.modules, 'clients' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_example_driver_runs_and_writes_the_journal(tmp_path):
    config = tmp_path / "demo.yaml"
    config.write_text(f"name: demo_worker\nrun:\n  root: {tmp_path}\n  experiment: demo\n"
                      "sinks:\n  console:\n    every: 1\n")
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ray_driver.py"), "--config", str(config),
         "--workers", "3", "--steps", "3"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if " final: " in line]
    assert [line.split()[1] for line in lines] == ["0", "1", "2"]
    journal = next((tmp_path / "demo").glob("*/metrics.jsonl"))
    assert len(journal.read_text().splitlines()) == 3
    assert f"journal: {journal}" in out.stdout
    # The actor's lines carry its public name, not the implementation class's.
    assert "(MetricWorker pid=" in out.stdout and "MetricWorkerImpl" not in out.stdout + out.stderr
