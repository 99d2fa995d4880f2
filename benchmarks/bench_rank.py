"""What a training rank spends in metrics per step: ours vs siiRL's pattern, side by side.

Ranks are Ray actors (CPU here). Each step a rank records K=300 metrics over a realistic
PPO batch: 8 token-level tensors of [256 x 2048] float32 under one response mask, each
reduced to mean/max/min (24 masked metrics), and 276 plain numbers (timing stages, losses,
learning rates, counters), then closes the step. Patterns, all in the same run:

  siirl_4call  siiRL's real pattern: every masked metric reduced on its own with ``.item()``
               (mean, max, min), the dicts sent as four actor calls
               (compute_local_data_metric, ..._timing_..., ..._throughout_..., submit_metric)
               then a blocking wait for all four (its ``wait_submit``)
  siirl_1call  the same reductions, one dict, one call, one blocking wait (its best case)
  ours_wait    ``stat(mask=...)`` + ``submit_metric`` + ``wait_submit()`` (blocking)
  ours         the same with ``flush()``: the Ray call is issued, the ack read next step

Reported per pattern: median rank-side milliseconds per step spent recording (compute) and
closing (send + wait), and their sum, over ranks and measured steps.

    python -m benchmarks.bench_rank [--ranks 4] [--steps 30] [--rows 256] [--cols 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import ray
import torch

import metricsvc
from benchmarks.baselines.siirl_style import SiirlStyleWorker
from clients import MetricClient

RESULTS = Path("runs") / "bench"  # ignored by git: a run never dirties the checkout
TENSORS = ("advantages", "returns", "values", "old_log_prob", "log_prob", "entropy", "ratio",
           "kl")
PLAIN = 276
PATTERNS = ("siirl_4call", "siirl_1call", "ours_wait", "ours")


def siirl_masked(name: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """siiRL's per-metric reductions: a masked mean, max and min, each its own ``.item()``."""
    valid = torch.masked_select(x, mask)
    return {f"critic/{name}/mean": torch.mean(valid).item(),
            f"critic/{name}/max": torch.max(valid).item(),
            f"critic/{name}/min": torch.min(valid).item()}


@ray.remote(num_cpus=0)
class Rank:
    """A training rank that closes each step in one of the patterns."""

    def __init__(self, rank: int, world: int, rows: int, cols: int) -> None:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(rank)
        self.rank, self.world = rank, world
        self.tensors = {n: torch.randn(rows, cols, generator=g) for n in TENSORS}
        lengths = torch.randint(cols // 8, cols, (rows,), generator=g)  # unequal per rank
        self.mask = torch.arange(cols)[None, :] < lengths[:, None]
        self.plain = [f"group{i % 9}/value_{i}" for i in range(PLAIN)]
        self.step_no = 0

    def setup(self, pattern: str, target, name: str | None) -> None:
        self.pattern, self.target = pattern, target
        self.client = (MetricClient(None, rank=self.rank, world_size=self.world, name=name)
                       if pattern.startswith("ours") else None)

    def _plain(self) -> dict[str, float]:
        return {k: float(self.step_no * 0.001 + i) for i, k in enumerate(self.plain)}

    def step(self) -> dict[str, float]:
        self.step_no += 1
        plain = self._plain()  # what the training loop hands over: not timed
        t0 = time.perf_counter()
        if self.pattern.startswith("ours"):
            self.client.stat(mask=self.mask, **{f"critic/{n}": x for n, x in self.tensors.items()})
            self.client.submit_metric(plain)
            t1 = time.perf_counter()
            if self.pattern == "ours":
                self.client.flush()
            else:
                self.client.wait_submit()
        else:
            data: dict[str, float] = {}
            for n, x in self.tensors.items():
                data.update(siirl_masked(n, x, self.mask))
            keys = list(plain)
            timing = {k: plain[k] for k in keys[:40]}
            throughput = {k: plain[k] for k in keys[40:46]}
            custom = {k: plain[k] for k in keys[46:]}
            t1 = time.perf_counter()
            if self.pattern == "siirl_4call":
                calls = [data, timing, throughput, custom]
            else:
                calls = [{**data, **timing, **throughput, **custom}]
            ray.get([self.target.submit_metric.remote(d, self.world) for d in calls])
        t2 = time.perf_counter()
        return {"compute_ms": 1e3 * (t1 - t0), "close_ms": 1e3 * (t2 - t1),
                "last_flush": time.time()}

    def drain(self) -> None:
        if self.client is not None:
            self.client.wait_acks(60)


def run(pattern: str, ranks, steps: int, warmup: int, index: int) -> dict:
    world = len(ranks)
    name = f"bench-rank-{index}"
    if pattern.startswith("ours"):
        target = metricsvc.start_metric_worker(
            {"name": name, "world_size": world, "sinks": {"console": None, "jsonl": None},
             "run": {"root": "/tmp/metricsvc-bench", "trial": f"rank-{index}-{os.getpid()}"}})
    else:
        target = SiirlStyleWorker.remote()
    ray.get([r.setup.remote(pattern, target, name) for r in ranks])
    samples = []
    keys = 3 * len(TENSORS) + PLAIN
    for step in range(warmup + steps):
        final = (target.wait_final_res.remote(step, 120) if pattern.startswith("ours")
                 else target.wait_final_res.remote(keys))
        got = ray.get([r.step.remote() for r in ranks])
        assert len(ray.get(final)) >= keys
        if step >= warmup:
            samples.extend(got)
    ray.get([r.drain.remote() for r in ranks])
    ray.kill(target)
    med = {k: statistics.median(s[k] for s in samples) for k in ("compute_ms", "close_ms")}
    total = statistics.median(s["compute_ms"] + s["close_ms"] for s in samples)
    return {"pattern": pattern, "ranks": world, "steps": steps, **med, "total_ms": total}


def main() -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=2048)
    args = parser.parse_args()
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
    ranks = [Rank.remote(r, args.ranks, args.rows, args.cols) for r in range(args.ranks)]
    rows = [run(p, ranks, args.steps, args.warmup, i) for i, p in enumerate(PATTERNS)]
    base = {r["pattern"]: r for r in rows}
    print(f"bench_rank: {args.ranks} rank actors, {args.cols}-token x {args.rows}-row batch, "
          f"K={3 * len(TENSORS) + PLAIN} metrics ({3 * len(TENSORS)} masked over "
          f"{len(TENSORS)} tensors, {PLAIN} plain), median of {args.steps} steps x ranks, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    print("| pattern | compute ms | send + wait ms | rank-side total ms | "
          "siiRL 4-call / this | siiRL 1-call / this |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['pattern']} | {r['compute_ms']:.2f} | {r['close_ms']:.2f} | "
              f"{r['total_ms']:.2f} | {base['siirl_4call']['total_ms'] / r['total_ms']:.2f}× | "
              f"{base['siirl_1call']['total_ms'] / r['total_ms']:.2f}× |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rank.json").write_text(json.dumps(rows, indent=2) + "\n")
    ray.shutdown()
    return rows


if __name__ == "__main__":
    main()
