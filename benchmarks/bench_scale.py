"""Scale past one actor: W simulated ranks x K keys, flat vs per-node pre-aggregation.

Ranks are multiplexed inside a few host processes (each host stands in for a
node with W/hosts ranks). Reported: the time from the last rank's flush to the
final result of the step, flat (every rank sends to the MetricWorker) vs per-node
(every host's ranks send to its combiner, which forwards one call per step) vs
flat_ray (flat with the fast path off: one Ray call per rank), and how it grows
with W. Writes runs/bench/scale.json and scale.png.

    python benchmarks/bench_scale.py [--worlds 64 256 1024] [--keys 300] [--hosts 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import ray

import metricsvc
from clients import MetricClient

RESULTS = Path("runs") / "bench"  # ignored by git: a run never dirties the checkout


@ray.remote(num_cpus=0)
class Host:
    """A stand-in for a node: many ranks' MetricClients in one process."""

    def __init__(self, service: str, ranks: list[int], world: int, keys: int,
                 via: str | None) -> None:
        self.clients = [MetricClient(None, rank=r, world_size=world, name=service, via=via)
                        for r in ranks]
        self.names = [f"group{i % 13}/metric_{i}/mean" for i in range(keys)]
        self.rng = np.random.default_rng(ranks[0])
        self.pool = ThreadPoolExecutor(max_workers=16)

    def step(self) -> float:
        for c in self.clients:
            c.submit_metric(dict(zip(self.names, self.rng.normal(size=len(self.names)).tolist())))
        last_flush = time.time()
        list(self.pool.map(lambda c: c.wait_submit(), self.clients))
        return last_flush


def run(topology: str, world: int, keys: int, hosts: int, steps: int, index: int,
        warmup: int = 2) -> dict:
    """One configuration; ``flat_ray`` is flat with the fast path off (Ray calls only)."""
    name = f"scale-{index}"
    cfg = metricsvc.load_config({"name": name, "topology": "flat",
                                 "fast_path": {"enabled": topology != "flat_ray"},
                                 "sinks": {"console": None, "jsonl": None},
                                 "limits": {"max_world_size": 4096},
                                 "run": {"root": "/tmp/metricsvc-bench", "trial": name}})
    worker = metricsvc.start_metric_worker(cfg)
    per_host = world // hosts
    labels = [f"host{h}" if topology == "per_node" else None for h in range(hosts)]
    combiners = [metricsvc.start_combiner(cfg, label) for label in labels if label]
    group = [Host.remote(name, list(range(h * per_host, (h + 1) * per_host)), world, keys,
                         labels[h]) for h in range(hosts)]
    latencies = []
    for step in range(warmup + steps):  # warm-up: first contact, fast-path connections
        final = worker.wait_final_res.remote(step, 300)
        last_flush = max(ray.get([h.step.remote() for h in group]))
        result = ray.get(final)
        latencies.append(time.time() - last_flush)
        assert len(result) == keys
    health = ray.get(worker.health.remote())
    calls, frames = health["calls"], (health["fast_path"] or {"frames": 0})["frames"]
    singleton = calls.get("submit", 0) + calls.get("submit_many", 0)
    total = warmup + steps
    for actor in [worker, *combiners, *group]:
        ray.kill(actor)
    return {"topology": topology, "world": world, "keys": keys, "hosts": hosts,
            "warmup_steps": warmup, "latency_ms": [1e3 * x for x in latencies],
            "latency_p50_ms": 1e3 * statistics.median(latencies[warmup:]),
            "cold_step_ms": 1e3 * latencies[0],
            "singleton_calls_per_step": (singleton - frames) / total,
            "singleton_frames_per_step": frames / total}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for topology, marker, label in (("flat", "o", "flat"), ("per_node", "s", "per_node"),
                                    ("flat_ray", "^", "flat, fast path off (Ray calls)")):
        pts = [(r["world"], r["latency_p50_ms"]) for r in rows if r["topology"] == topology]
        ax.plot(*zip(*pts), marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks (W)")
    ax.set_ylabel("last flush → final result, ms (median)")
    ax.set_title(f"{rows[0]['keys']} keys per rank, {rows[0]['hosts']} hosts, "
                 f"{os.cpu_count()} cores")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--keys", type=int, default=300)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first, not measured")
    args = parser.parse_args()
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
    rows, index = [], 0
    for world in args.worlds:
        for topology in ("flat", "per_node", "flat_ray"):
            rows.append(run(topology, world, args.keys, args.hosts, args.steps, index,
                            args.warmup))
            index += 1
    print(f"bench_scale: W simulated ranks in {args.hosts} host processes, K={args.keys} keys, "
          f"median of {args.steps} steps after {args.warmup} warm-up steps, {os.cpu_count()} cores")
    print("| W | topology | singleton actor calls / step | singleton TCP frames / step | "
          "last flush → final, median ms | latency vs flat | first step ms |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for row in rows:
        flat = next(r for r in rows if r["world"] == row["world"] and r["topology"] == "flat")
        print(f"| {row['world']} | {row['topology']} | {row['singleton_calls_per_step']:.0f} | "
              f"{row['singleton_frames_per_step']:.0f} | {row['latency_p50_ms']:.0f} | "
              f"{row['latency_p50_ms'] / flat['latency_p50_ms']:.2f}× | "
              f"{row['cold_step_ms']:.0f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scale.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, RESULTS / "scale.png")
    ray.shutdown()
    return rows


if __name__ == "__main__":
    main()
