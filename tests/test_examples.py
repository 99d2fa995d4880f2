"""Every example runs from a fresh checkout and does what its docstring says."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ)


def run(script, *args):
    out = subprocess.run([sys.executable, f"examples/{script}", *args], capture_output=True,
                         text=True, cwd=ROOT, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_ppo_loop_records_data_timing_validation_and_a_rollout_stream():
    out = run("ppo_loop.py", "--steps", "3", "--val-every", "2")
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all("rollout reward" in line for line in lines)
    assert "val acc" in lines[0] and "val acc" not in lines[1] and "val acc" in lines[2]


def test_siirl_migration_runs_with_siirl_names():
    out = run("siirl_migration.py")
    assert "perf/delta_time/gen" in out and "training/grad_norm/mean" in out


def test_areal_migration_runs_with_areal_names():
    out = run("areal_migration.py")
    for key in ("ppo_actor/loss/avg", "ppo_actor/n_valid_tokens", "timeperf/rollout", "lr",
                "rollout/reward"):
        assert key in out, key


def test_custom_sink_writes_its_csv():
    out = run("custom_sink.py")
    rows = [line for line in out.splitlines() if line.count(",") == 2]
    assert rows[:2] == ["0,loss,1.0", "0,tokens/total,100.0"] and len(rows) == 6


@pytest.mark.parametrize("script", ["ray_driver.py"])
def test_quickstart_driver_runs(script, tmp_path):
    config = tmp_path / "q.yaml"
    config.write_text(f"name: q\nrun:\n  root: {tmp_path}\nsinks:\n  console: null\n")
    out = run(script, "--config", str(config), "--workers", "2", "--steps", "2")
    assert "step   1 final" in out
