"""Every example runs from a fresh checkout and does what its docstring says, on a Ray
cluster that is already running (the session's; ``make run`` without one is tested in
test_packaging, the demo in test_install, and in test_cli on the session's cluster)."""

import os
import sys
from pathlib import Path

import pytest

from tests.helpers import run_scripts

pytestmark = pytest.mark.slow  # subprocesses

ROOT = Path(__file__).resolve().parent.parent
# Run as from the repository root (examples/ importable), but in a temporary folder: the
# examples' runs/ go there, never into the checkout.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


RUNS = {  # name: (script, arguments); each runs in its own folder, beside the others
    "ppo": ("ppo_loop.py", "--steps", "3", "--val-every", "2"),
    "siirl": ("siirl_migration.py",),
    "areal": ("areal_migration.py",),
    "csv": ("custom_sink.py",),
    "quickstart": ("ray_driver.py", "--config", "{tmp}/q.yaml", "--workers", "2",
                   "--steps", "2"),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, joined_env):
    """Run every example (a few at a time: ``helpers.run_scripts``), each joining the
    session's cluster (as ``ray.init()`` does where a cluster runs), each in a namespace of
    its own."""
    commands = {}
    for name, (script, *args) in RUNS.items():
        tmp = tmp_path_factory.mktemp(name)
        (tmp / "q.yaml").write_text(f"name: q\nrun:\n  root: {tmp}\nsinks:\n  console: null\n")
        commands[name] = ([sys.executable, str(ROOT / "examples" / script),
                           *(a.format(tmp=tmp) for a in args)],
                          {"cwd": tmp, "env": joined_env(PYTHONPATH=ENV["PYTHONPATH"])})
    return run_scripts(commands, timeout_s=300)


def run(outputs, name):
    code, out, err = outputs[name]
    assert code == 0, err[-3000:]
    return out


def test_ppo_loop_records_data_timing_validation_and_a_rollout_stream(outputs):
    out = run(outputs, "ppo")
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all("rollout reward" in line for line in lines)
    assert "val acc" in lines[0] and "val acc" not in lines[1] and "val acc" in lines[2]


def test_siirl_migration_runs_with_siirl_names(outputs):
    out = run(outputs, "siirl")
    assert "perf/delta_time/gen" in out and "training/grad_norm/mean" in out


def test_areal_migration_runs_with_areal_names(outputs):
    out = run(outputs, "areal")
    for key in ("ppo_actor/loss/avg", "ppo_actor/n_valid_tokens", "timeperf/rollout", "lr",
                "rollout/reward"):
        assert key in out, key


def test_custom_sink_writes_its_csv(outputs):
    out = run(outputs, "csv")
    rows = [line for line in out.splitlines() if line.count(",") == 2]
    assert rows[:2] == ["0,loss,1.0", "0,tokens/total,100.0"] and len(rows) == 6


def test_quickstart_driver_runs(outputs):
    out = run(outputs, "quickstart")
    assert "step   1 final" in out
