"""The aggregator alone (no Ray): W batches of K keys per step, merged and finalised.

    python benchmarks/bench_merge.py [--world 256] [--keys 1000] [--steps 5]

Reports key-records merged per second (W * K per step over the time from the first
batch in to the finished step out), against the target of 1,000,000/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from metricsvc.core.records import COUNT, M2_ROOT, MAX, MIN, NFIELDS, NONFINITE, SUM_LO
from metricsvc.core.wire import Batch
from metricsvc.service.engine import Engine

RESULTS = Path("runs") / "bench"  # ignored by git: a run never dirties the checkout


def make_batches(world: int, keys: int, step: int, rng: np.random.Generator) -> list[Batch]:
    names = tuple(f"group{i % 17}/metric_{i}/mean" for i in range(keys))
    out = []
    for rank in range(world):
        data = rng.normal(size=(keys, NFIELDS))
        data[:, COUNT] = rng.integers(1, 100, size=keys)
        data[:, MIN] = -abs(data[:, MIN])  # min <= max
        data[:, MAX] = abs(data[:, MAX])
        data[:, M2_ROOT] = abs(data[:, M2_ROOT])  # the service refuses impossible records
        data[:, NONFINITE] = 0
        data[:, SUM_LO] = 0
        out.append(Batch.build(step=step, rank=rank, world_size=world, seq=step + 1,
                               final=True, keys=names, data=data,
                               kinds=np.zeros(keys, dtype=np.int8),
                               expected=np.zeros(keys, dtype=np.int32)))
    return out


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=256)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    agg = Engine()
    per_step = []
    submit_s, finish_s = [], []
    for step in range(args.steps):
        batches = make_batches(args.world, args.keys, step, rng)
        t0 = time.perf_counter()
        for b in batches[:-1]:
            agg.submit(b)
        t1 = time.perf_counter()
        (result,) = agg.submit(batches[-1]).finished
        t2 = time.perf_counter()
        assert len(result.metrics) == args.keys and not result.meta["partial"]
        per_step.append(t2 - t0)
        submit_s.append(t1 - t0)
        finish_s.append(t2 - t1)
    records = args.world * args.keys
    best = statistics.median(per_step)
    rate = records / best
    print(f"bench_merge: W={args.world} batches x K={args.keys} keys per step, "
          f"{args.steps} steps, no Ray")
    print("| W | K | key-records per step | ms per step (median) | of which: receive / "
          "merge+finish | key-records / s | target |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.world} | {args.keys} | {records:,} | {best * 1e3:.1f} | "
          f"{statistics.median(submit_s) * 1e3:.1f} / {statistics.median(finish_s) * 1e3:.1f} "
          f"| {rate:,.0f} | 1,000,000 ({rate / 1e6:.1f}x) |")
    figures = {"config": vars(args), "ms_per_step": best * 1e3, "records_per_s": rate,
               "receive_ms": statistics.median(submit_s) * 1e3,
               "finish_ms": statistics.median(finish_s) * 1e3}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "merge.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
