"""What restarting a long run costs the service: peak memory and time of a restart that
reloads a journal of N steps, against a fresh start, each in a process of its own.

    python -m benchmarks.bench_restart [--steps 1000 10000 100000] [--keys 20] [--ranks 4]

The journal is written as the service writes it (K metrics, the meta of W ranks with their
batch digests); the service is built without Ray (``MetricWorkerImpl``) on that run folder
with ``run.resume: true``. A restart streams the journal: it keeps ``keep_results`` steps,
the running totals and the recent steps' digests, whatever N.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path("runs") / "bench"  # ignored by git: a run never dirties the checkout

_CHILD = r"""
import json, resource, sys, time
from metricsvc.service.worker import MetricWorkerImpl
cfg = json.loads(sys.argv[1])
start = time.perf_counter()
impl = MetricWorkerImpl(cfg)
ready = time.perf_counter() - start
impl.sinks.close()
print(json.dumps({"seconds": ready, "peak_rss_mb": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss / 1024, "restored": impl.restored_steps}))
"""


def write_journal(path: Path, steps: int, keys: int, ranks: int) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for step in range(steps):
            record = {
                "step": step,
                "metrics": {f"group{k % 7}/metric_{k}/mean": step * 0.001 + k for k in range(keys)},
                "meta": {"partial": False, "world_size": ranks, "ranks": list(range(ranks)),
                         "missing_ranks": [], "batches": ranks, "keys": keys, "age_s": 0.01,
                         "digests": {f"{r}:{step + 1}": f"{(step * 31 + r):016x}"
                                     for r in range(ranks)}},
                "time": 1.7e9 + step,
            }
            fh.write(json.dumps(record) + "\n")


def measure(root: Path, trial: str, resume: bool) -> dict:
    cfg = {"name": "bench-restart", "sinks": {"console": None, "jsonl": {}},
           "run": {"root": str(root), "experiment": "e", "trial": trial, "resume": resume}}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fresh = measure(root, "fresh", resume=False)
        for n in args.steps:
            folder = root / "e" / f"n{n}"
            folder.mkdir(parents=True)
            t0 = time.perf_counter()
            write_journal(folder / "metrics.jsonl", n, args.keys, args.ranks)
            size_mb = (folder / "metrics.jsonl").stat().st_size / 2**20
            restart = measure(root, f"n{n}", resume=True)
            assert restart["restored"] == n, restart
            rows.append({"steps": n, "journal_mb": size_mb, "fresh": fresh, "restart": restart,
                         "write_s": time.perf_counter() - t0})
    print(f"bench_restart: K={args.keys} metrics, W={args.ranks} ranks a step; one process "
          f"each; the fresh start is an empty run folder")
    print("| journal steps | journal MB | fresh start: peak RSS MB | restart: peak RSS MB | "
          "restart - fresh MB | restart s | fresh s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        f, s = r["fresh"], r["restart"]
        print(f"| {r['steps']:,} | {r['journal_mb']:.1f} | {f['peak_rss_mb']:.0f} | "
              f"{s['peak_rss_mb']:.0f} | {s['peak_rss_mb'] - f['peak_rss_mb']:+.0f} | "
              f"{s['seconds']:.2f} | {f['seconds']:.2f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "restart.json").write_text(json.dumps({"config": vars(args), "rows": rows},
                                                     indent=2) + "\n")
    return {"rows": rows}


if __name__ == "__main__":
    main()
