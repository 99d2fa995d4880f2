"""Where the test suite's CPU goes: each test's wall time and the whole machine's busy CPU
while it runs (``/proc/stat``: the test's own process, the Ray processes it starts, the
drivers and actors it spawns), summed per file.

Run serially, so that one test at a time is what the machine does (the idle cluster's
own CPU included, as in ``make test``)::

    .venv/bin/python -m benchmarks.bench_suite            # the whole suite, ~10 min here
    .venv/bin/python -m benchmarks.bench_suite tests/test_cli.py

A test's figures include the fixtures it sets up (the first test of a file its module
fixtures, the first of the run the session's cluster). It prints the files by CPU, then
the tests that cost most, and writes every test's figures to ``runs/bench/suite.json``.
``make test`` runs the same tests three at a time on two cores: its wall time is about the
total CPU here over the cores it keeps busy.
Loaded by pytest as a plugin (``-p benchmarks.bench_suite``); nothing else uses it.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

OUT = Path("runs/bench/suite.json")
_rows: list[tuple[str, float, float]] = []
_started: dict[str, tuple[float, float]] = {}


def busy_cpu_s() -> float:
    """The machine's busy CPU seconds since boot (all cores; idle and iowait left out)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / 100  # USER_HZ is 100 on Linux


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = (busy_cpu_s(), time.perf_counter())


def pytest_runtest_logfinish(nodeid, location):
    cpu, wall = _started.pop(nodeid)
    _rows.append((nodeid, busy_cpu_s() - cpu, time.perf_counter() - wall))


def table(rows: list[tuple[str, float, float]], top: int = 15) -> str:
    """The per-file and per-test tables of ``rows`` (nodeid, busy CPU s, wall s)."""
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, cpu, wall in rows:
        entry = files[nodeid.split("::")[0]]
        entry[0] += cpu
        entry[1] += wall
        entry[2] += 1
    cpu_total = sum(r[1] for r in rows)
    wall_total = sum(r[2] for r in rows)
    lines = [f"{len(rows)} tests, one at a time: {cpu_total:.0f} busy CPU-s over "
             f"{wall_total:.0f} s wall ({cpu_total / max(wall_total, 1e-9):.2f} cores busy)",
             "", "| file | tests | busy CPU s | share | wall s |", "|---|---:|---:|---:|---:|"]
    for name, (cpu, wall, n) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {name} | {n} | {cpu:.1f} | {cpu / cpu_total:.0%} | {wall:.1f} |")
    lines += ["", f"| the {top} tests that cost most | busy CPU s | wall s |", "|---|---:|---:|"]
    for nodeid, cpu, wall in sorted(rows, key=lambda r: -r[1])[:top]:
        lines.append(f"| {nodeid} | {cpu:.1f} | {wall:.1f} |")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps([{"test": n, "busy_cpu_s": c, "wall_s": w} for n, c, w in _rows],
                              indent=1))
    terminalreporter.write_line("")
    terminalreporter.write_line(table(_rows))
    terminalreporter.write_line(f"(every test: {OUT})")


def main(argv: list[str]) -> int:
    import pytest

    # one worker (the figures are per test only when tests do not overlap)
    return pytest.main(["-q", "-n", "0", "-p", "benchmarks.bench_suite", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
