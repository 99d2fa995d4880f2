"""The `metricsvc` command, run as a user would: a subprocess, files read back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ)


def cli(*args, timeout=240, env=None):
    return subprocess.run([sys.executable, "-m", "metricsvc.cli.main", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=env or ENV,
                          timeout=timeout)


@pytest.fixture(scope="module")
def journal(tmp_path_factory):
    """A small journal with a partial step, written as the service writes it."""
    from metricsvc.sinks.jsonl import JsonlSink

    run = tmp_path_factory.mktemp("run")
    sink = JsonlSink()
    sink.open(run)
    for step in range(6):
        partial = step == 4
        sink.write(step, {"critic/score/mean": 0.1 * step, "critic/score/min": 0.0,
                          "critic/score/max": 0.2 * step, "actor/lr": 1e-5},
                   {"partial": partial, "missing_ranks": [3] if partial else []})
    sink.close()
    return run


def test_report_prints_a_table_and_marks_partial_steps(journal):
    out = cli("report", journal, "--keys", "critic/*", "--last", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["step", "3", "4*", "5"]
    row = next(line for line in lines if line.startswith("critic/score/mean"))
    assert [float(x) for x in row.split()[1:]] == pytest.approx([0.3, 0.4, 0.5])
    assert "actor/lr" not in out.stdout
    assert "* step 4 is partial: missing ranks [3]" in out.stdout
    assert lines[-1] == "# the last 3 of 6 steps (--last N shows more)"
    assert cli("report", journal, "--last", "9").stdout.splitlines()[-1] == "# all 6 steps"


def test_report_extremes_says_so_when_the_journal_names_no_source(journal):
    out = cli("report", journal, "--keys", "critic/score/max", "--extremes")
    assert out.returncode == 0, out.stderr
    assert "where each min and max came from" in out.stdout
    assert "(none: the journal names no min or max source for these keys and steps)" \
        in out.stdout


def test_report_alerts_lists_every_alert_of_the_run_with_its_samples(journal, tmp_path):
    from metricsvc.sinks.jsonl import JsonlSink

    assert "the run's alerts (0;" in cli("report", journal, "--alerts").stdout
    run = tmp_path / "run"
    run.mkdir()
    sink = JsonlSink()
    sink.open(run)
    for step in range(8):
        alerts = [{"step": step, "rule": "kl too high", "key": "kl/max", "value": 9.0,
                   "samples": [{"name": "kl/max", "value": 9.0, "rank": 1, "id": 4711}]}] \
            if step == 1 else []
        sink.write(step, {"kl/max": 9.0 if step == 1 else 0.1}, {"alerts": alerts})
    sink.close()
    out = cli("report", run, "--alerts", "--last", "2")  # every alert, not only those shown
    assert out.returncode == 0, out.stderr
    assert "ALERT step 1: kl too high: kl/max = 9  <- kl/max: rank 1, id 4711" in out.stdout
    assert "the run's alerts (1;" in out.stdout


def test_plot_writes_a_png_with_bands_and_partial_marks(journal, tmp_path):
    png = tmp_path / "out.png"
    out = cli("plot", journal / "metrics.jsonl", "--keys", "critic/*", "actor/lr", "-o", png)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # critic/score as one banded series, and actor/lr
    assert "2 plots in a 1x2 grid, 6 steps" in out.stdout


def test_validate_config_prints_the_resolved_config_with_secrets_redacted(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sinks:\n  custom:\n    - target: tests.sink_fixtures:RecordingSink\n"
                   "      options: {api_key: sk-live-123, path: x}\n")
    out = cli("validate-config", cfg)
    assert out.returncode == 0, out.stderr
    assert "sk-live-123" not in out.stdout and "api_key: '***'" in out.stdout
    assert "straggler_timeout_s: 600.0" in out.stdout and "path: x" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("report", "/no/such/run"), "no such run folder or journal: /no/such/run"),
        (("plot", "/no/such/run", "--keys", "x", "-o", "/tmp/x.png"), "no such run folder"),
        (("validate-config", "/no/such.yaml"), "config file not found: /no/such.yaml"),
        (("health", "--address", "127.0.0.1:1"), "cannot connect to Ray"),
    ],
)
def test_errors_are_one_clear_line_and_a_nonzero_exit(args, message):
    out = cli(*args, timeout=120)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_bad_keys_and_bad_yaml_are_clear(journal, tmp_path):
    out = cli("report", journal, "--keys", "nope/*")
    assert out.returncode == 2 and "no key matches nope/*" in out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("sinks:\n  jsonl:\n    filenme: x\n")
    out = cli("validate-config", bad)
    assert out.returncode == 2
    assert "sinks.jsonl.filenme: Extra inputs are not permitted" in out.stderr


@pytest.mark.slow
def test_demo_runs_end_to_end_with_progress_and_report(tmp_path, joined_env):
    """On a running cluster (the session's); the demo without one, from a base install,
    is test_install's."""
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(f"name: cli_demo\nrun:\n  root: {tmp_path}\n  experiment: demo\n"
                   "sinks:\n  console: null\n")
    out = cli("demo", "--config", cfg, "--workers", "2", "--steps", "3", env=joined_env())
    assert out.returncode == 0, out.stderr[-2000:]
    # not a terminal: one line per step, no carriage return gluing log lines together
    assert "\r" not in out.stderr and "[#" not in out.stderr
    assert [line.split()[0] for line in out.stderr.splitlines() if "critic/score/mean=" in line] \
        == ["1/3", "2/3", "3/3"]
    journal = next((tmp_path / "demo").glob("*/metrics.jsonl"))
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert "critic/vf_explained_var" in lines[0]["metrics"]
    assert f"journal: {journal}" in out.stdout


def test_validate_config_errors_are_one_line_with_exit_2(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("sinks:\n  jsonl: {enabled: true\n  x: [\n")
    out = cli("validate-config", broken)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert f"{broken}:3:4: YAML syntax error" in out.stderr
    missing = tmp_path / "missing.yaml"
    missing.write_text("sinks:\n  custom:\n    - target: nosuch.mod:Sink\n")
    out = cli("validate-config", missing)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "cannot load sink target 'nosuch.mod:Sink'" in out.stderr


def test_report_reads_the_newest_journal_by_time_and_says_which(tmp_path):
    import os

    from metricsvc.sinks.jsonl import JsonlSink

    for trial, value, age in (("b-older", 1.0, 100), ("a-newer", 2.0, 0)):
        (tmp_path / trial).mkdir()
        sink = JsonlSink()
        sink.open(tmp_path / trial)
        sink.write(0, {"x": value}, {})
        sink.close()
        os.utime(tmp_path / trial / "metrics.jsonl", (1e9 - age, 1e9 - age))
    out = cli("report", tmp_path)
    assert out.returncode == 0
    assert str(tmp_path / "a-newer" / "metrics.jsonl") in out.stderr
    assert out.stdout.splitlines()[1].split() == ["x", "2"]


def test_plot_lays_many_keys_out_in_a_readable_grid(tmp_path):
    from metricsvc.sinks.jsonl import JsonlSink

    sink = JsonlSink()
    sink.open(tmp_path)
    for step in range(5):
        sink.write(step, {f"group{i % 4}/metric_{i}": float(step * i) for i in range(46)}, {})
    sink.close()
    png = tmp_path / "many.png"
    out = cli("plot", tmp_path, "--keys", "*", "-o", png)
    assert out.returncode == 0, out.stderr
    assert "46 plots in a 12x4 grid" in out.stdout
    import struct

    width, height = struct.unpack(">II", png.read_bytes()[16:24])
    assert width < 2000 and height < 4000, (width, height)  # not a 770 x 13156 column


def test_plot_shows_steps_as_integers_on_every_x_axis():
    """Three steps were labelled 0.0, 0.5, 1.0, 1.5 ...: a step is a whole number."""
    from metricsvc.cli.main import plot_steps

    steps = [{"step": s, "metrics": {"x": float(s), "y": 1.0}, "meta": {}} for s in range(3)]
    fig, _, _, _ = plot_steps(steps, ["x", "y"])
    fig.canvas.draw()
    for ax in fig.axes:
        if ax.get_visible():
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_plot_labels_the_steps_of_every_panel_not_only_the_bottom_row():
    from metricsvc.cli.main import plot_steps

    steps = [{"step": s, "metrics": {f"k{i}": float(s) for i in range(6)}, "meta": {}}
             for s in range(3)]
    fig, _, rows, _ = plot_steps(steps, [f"k{i}" for i in range(6)])
    fig.canvas.draw()
    assert rows == 2
    for ax in (a for a in fig.axes if a.get_visible()):
        shown = [t.get_text() for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        assert shown, ax.get_title()


# -- the first hour: papercuts --------------------------------------------------------------
def test_version_prints_the_installed_version():
    import metricsvc

    out = cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"metricsvc {metricsvc.__version__}"


@pytest.mark.parametrize("last", ["0", "-1", "x"])
def test_report_last_takes_a_positive_count_in_one_line(journal, last):
    out = cli("report", journal, "--last", last)
    assert out.returncode == 2 and "--last" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_report_into_a_pipe_that_closes_early_ends_quietly(tmp_path):
    """`metricsvc report RUN | head`: more output than a pipe holds, a reader that leaves."""
    from metricsvc.sinks.jsonl import JsonlSink

    sink = JsonlSink()
    sink.open(tmp_path)
    for step in range(3):
        sink.write(step, {f"group/key_{i:05d}/mean": float(i) for i in range(3000)}, {})
    sink.close()
    out = subprocess.run(
        ["bash", "-o", "pipefail", "-c",
         f"{sys.executable} -m metricsvc.cli.main report {tmp_path} | head -n 2"],
        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2
    assert "Broken pipe" not in out.stderr and "Exception" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"# {tmp_path / 'metrics.jsonl'}: 3 steps"]


def test_a_binary_file_is_refused_in_one_line(tmp_path):
    journal = tmp_path / "metrics.jsonl"
    journal.write_bytes(bytes(range(256)) * 200 + b"\n" * 30 + bytes(range(256)))
    out = cli("report", journal)
    assert out.returncode == 2, out.stdout
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "not a metrics journal" in out.stderr and str(journal) in out.stderr


def test_validate_config_names_a_folder_a_folder_and_takes_preset_names(tmp_path):
    out = cli("validate-config", tmp_path)
    assert out.returncode == 2 and "is a folder" in out.stderr and "not found" not in out.stderr
    out = cli("validate-config", "siirl")
    assert out.returncode == 0, out.stderr
    assert "perf/delta_time/" in out.stdout


def test_every_option_of_every_command_has_help_text():
    from metricsvc.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    undocumented = [f"{name} {'/'.join(a.option_strings) or a.dest}"
                    for name, sub in commands.items() for a in sub._actions
                    if a.dest != "help" and not a.help]
    assert set(commands) >= {"demo", "report", "plot", "health", "validate-config"}
    assert not undocumented, undocumented


def test_health_reaches_the_service_from_another_shell_under_default_auth(make_worker,
                                                                           ray_cluster):
    """What a user runs in a second terminal: no RAY_ADDRESS, no RAY_AUTH_MODE in the
    environment, only the address `ray status` shows; the service is found by its name in
    the documented namespace, without the starting driver's anonymous one."""
    import ray

    handle, cfg = make_worker()
    assert cfg.namespace == "metricsvc"  # the documented default
    ray.get(handle.health.remote())
    shell = {k: v for k, v in os.environ.items()
             if not k.startswith(("RAY_", "METRICSVC_"))}
    out = subprocess.run([sys.executable, "-m", "metricsvc.cli.main", "health", "--name", cfg.name,
                          "--address", ray_cluster.address],
                         capture_output=True, text=True, cwd=ROOT, env=shell, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"MetricWorker {cfg.name!r} pid" in out.stdout and "last final step None" in out.stdout
    assert "Authentication" not in out.stderr and "{" not in out.stdout
    out = subprocess.run([sys.executable, "-m", "metricsvc.cli.main", "health", "--name", cfg.name,
                          "--address", ray_cluster.address, "--json"],
                         capture_output=True, text=True, cwd=ROOT, env=shell, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["name"] == cfg.name, out.stderr
    out = subprocess.run([sys.executable, "-m", "metricsvc.cli.main", "health", "--name", cfg.name,
                          "--namespace", "elsewhere", "--address", ray_cluster.address],
                         capture_output=True, text=True, cwd=ROOT, env=shell, timeout=120)
    assert out.returncode == 2
    assert "it runs in namespace metricsvc: pass --namespace" in out.stderr


def test_report_finds_a_journal_under_its_configured_file_name(tmp_path):
    """A run whose config names its journal otherwise (``sinks.jsonl.filename``) is found
    by its run folder's saved config, not by the default name."""
    import yaml

    from metricsvc.sinks.jsonl import JsonlSink, JsonlSinkConfig

    run = tmp_path / "exp" / "trial"
    run.mkdir(parents=True)
    saved = {"sinks": {"jsonl": {"filename": "steps.log"}}}
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    sink = JsonlSink(JsonlSinkConfig(filename="steps.log"))
    sink.open(run)
    sink.write(0, {"loss": 0.5}, {})
    sink.close()
    out = cli("report", tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"# {run / 'steps.log'}: 1 steps" in out.stderr and "loss" in out.stdout
