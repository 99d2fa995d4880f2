"""Scale past one actor: W simulated ranks x K keys on a multi-node Ray cluster, flat vs
per-node pre-aggregation.

The cluster is Ray's own ``ray.cluster_utils.Cluster`` on this machine (the one the tests
use): a head and ``--nodes`` more raylet nodes. One host actor per node stands in for that
node's W/nodes ranks (their MetricClients, multiplexed). Reported: the singleton's actor
calls per step, its CPU milliseconds per step and per batch, and the time from the last
rank's flush to the final result, flat (every rank calls the MetricWorker) vs per_node
(every rank calls its node's combiner, found by its real node id, which forwards one call
per step). Writes runs/bench/scale.json and scale.png.

    python -m benchmarks.bench_scale [--worlds 64 256 1024] [--keys 300] [--nodes 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import ray

import metricsvc
from metricsvc.client import MetricClient
from metricsvc.core.keys import combiner_name

RESULTS = Path("runs") / "bench"  # ignored by git: a run never dirties the checkout


@ray.remote(num_cpus=0)
class Host:
    """A stand-in for a node: its ranks' MetricClients in one process."""

    def __init__(self, service: str, ranks: list[int], world: int, keys: int) -> None:
        self.clients = [MetricClient(None, rank=r, world_size=world, name=service).connect()
                        for r in ranks]
        self.names = [f"group{i % 13}/metric_{i}/mean" for i in range(keys)]
        self.rng = np.random.default_rng(ranks[0])

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def step(self) -> float:
        for c in self.clients:
            c.submit_metric(dict(zip(self.names, self.rng.normal(size=len(self.names)).tolist())))
        for c in self.clients:
            c.flush()  # one Ray call issued; the ack is read at the next step
        return time.time()

    def drain(self) -> int:
        return sum(len(c.wait_acks(120)) for c in self.clients)


def start_cluster(nodes: int):
    """A head and ``nodes`` raylets on this machine, each with resource ``bench_node_<i>``."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": os.cpu_count() or 2, "include_dashboard": False})
    for i in range(nodes):
        cluster.add_node(num_cpus=1, resources={f"bench_node_{i}": 1000})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def run(topology: str, world: int, keys: int, nodes: int, steps: int, index: int,
        warmup: int = 2) -> dict:
    """One configuration on the running cluster."""
    name = f"scale-{index}"
    cfg = metricsvc.load_config({"name": name, "topology": topology, "world_size": world,
                                 "sinks": {"console": None, "jsonl": {}},  # journal on, as a run
                                 "limits": {"max_world_size": 4096},
                                 "run": {"root": "/tmp/metricsvc-bench",
                                         "trial": f"{name}-{os.getpid()}"}})
    worker = metricsvc.start_metric_worker(cfg)  # per_node: a combiner on every node
    per_host = world // nodes
    group = [Host.options(resources={f"bench_node_{h}": 1}).remote(
        name, list(range(h * per_host, (h + 1) * per_host)), world, keys) for h in range(nodes)]
    assert len(set(ray.get([h.node_id.remote() for h in group]))) == nodes  # one per node
    latencies, cpu = [], []
    calls_at = {}
    for step in range(warmup + steps):
        health = ray.get(worker.health.remote())
        before = health["cpu_s"]
        calls_at[step] = sum(health["calls"].get(k, 0) for k in ("submit", "submit_many"))
        final = worker.wait_final_res.remote(step, 300)
        last_flush = max(ray.get([h.step.remote() for h in group]))
        result = ray.get(final)
        latencies.append(time.time() - last_flush)
        cpu.append(ray.get(worker.health.remote())["cpu_s"] - before)
        assert len(result) == keys
    ray.get([h.drain.remote() for h in group])
    health = ray.get(worker.health.remote())
    singleton = sum(health["calls"].get(k, 0) for k in ("submit", "submit_many"))
    combiners = [ray.get_actor(combiner_name(name, n["NodeID"]), namespace=cfg.namespace)
                 for n in ray.nodes() if n["Alive"]] if topology == "per_node" else []
    for actor in [worker, *combiners, *group]:
        ray.kill(actor)
    cpu_ms = 1e3 * statistics.median(cpu[warmup:])
    return {"topology": topology, "world": world, "keys": keys, "nodes": nodes,
            "warmup_steps": warmup, "latency_ms": [1e3 * x for x in latencies],
            "latency_p50_ms": 1e3 * statistics.median(latencies[warmup:]),
            "cold_step_ms": 1e3 * latencies[0],
            # Steady state: the first step of per_node forwards piecemeal while ranks
            # register with their combiner (it cannot know how many a node has before).
            "singleton_calls_per_step": (singleton - calls_at[warmup]) / steps,
            "singleton_calls_first_step": calls_at.get(1, singleton) - calls_at[0],
            "singleton_cpu_ms_per_step": cpu_ms,
            "singleton_cpu_ms_per_batch": cpu_ms / world}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for topology, marker, label in (("flat", "o", "flat"), ("per_node", "s", "per_node")):
        pts = [(r["world"], r["latency_p50_ms"]) for r in rows if r["topology"] == topology]
        ax.plot(*zip(*pts), marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks (W)")
    ax.set_ylabel("last flush → final result, ms (median)")
    ax.set_title(f"{rows[0]['keys']} keys per rank, {rows[0]['nodes']} Ray nodes, "
                 f"{os.cpu_count()} cores")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--keys", type=int, default=300)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first, not measured")
    args = parser.parse_args()
    cluster = start_cluster(args.nodes)
    rows, index = [], 0
    for world in args.worlds:
        for topology in ("flat", "per_node"):
            rows.append(run(topology, world, args.keys, args.nodes, args.steps, index,
                            args.warmup))
            index += 1
    print(f"bench_scale: W simulated ranks on a {args.nodes + 1}-node Ray cluster (Ray's "
          f"Cluster on one machine; one host actor per worker node), K={args.keys} keys, "
          f"median of {args.steps} steps after {args.warmup} warm-up steps, "
          f"{os.cpu_count()} cores")
    print("| W | topology | singleton actor calls / step (first step) | "
          "singleton CPU ms / step | singleton CPU ms / rank batch | "
          "last flush → final, median ms | first step ms |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['world']} | {row['topology']} | {row['singleton_calls_per_step']:.1f} "
              f"({row['singleton_calls_first_step']}) | "
              f"{row['singleton_cpu_ms_per_step']:.1f} | "
              f"{row['singleton_cpu_ms_per_batch']:.3f} | {row['latency_p50_ms']:.0f} | "
              f"{row['cold_step_ms']:.0f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scale.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, RESULTS / "scale.png")
    ray.shutdown()
    cluster.shutdown()
    return rows


if __name__ == "__main__":
    main()
