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


def test_clients_depend_on_the_service_only_through_its_protocol_module():
    """The client library imports one module of the service, ``metricsvc.protocol``
    (``clients/demo.py`` is a driver: it starts the service through ``metricsvc``)."""
    import ast

    seen = {}
    for path in sorted((ROOT / "clients").rglob("*.py")):
        if path.name == "demo.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name == "metricsvc" or name.startswith("metricsvc."):
                    seen.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    assert set(seen) == {"metricsvc.protocol"}, seen


def test_the_recording_layer_uses_no_private_method_of_the_buffer():
    """One public layer: MetricClient and StreamRecorder are Trackers; a Tracker records
    through the buffer's public methods (no `_record` forwarding chain)."""
    import re

    from clients import MetricClient, StreamRecorder, Tracker

    assert issubclass(MetricClient, Tracker) and issubclass(StreamRecorder, Tracker)
    source = (ROOT / "clients" / "tracker.py").read_text()
    assert not re.findall(r"self\.buffer\._\w+", source)
    assert MetricClient.stat is Tracker.stat  # no forwarding layer in between


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
    # The actor's lines carry its public name, not the implementation class's. (Ray forwards
    # an actor's stdout and stderr lines to the driver's asynchronously: a driver that ends
    # right after its last step may exit before some arrive, on either stream.)
    both = out.stdout + out.stderr
    assert "(MetricWorker pid=" in both and "MetricWorkerImpl" not in both
