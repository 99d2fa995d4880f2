"""End to end on local Ray: ours vs siiRL's one-call and four-call patterns vs one call per key.

W rank actors (num_cpus=0) each record K plain float metrics per step and close the
step; the driver waits for each step's final result. Reported per pattern: steps/s,
actor calls per step, the latency from the last rank's flush to the final result
(p50/p95), and the actor's CPU time per batch (process time inside the actor), with
ratios against ours measured in the same run. The service runs as a run does: every
check on, its journal (the JSONL sink) written and its watermark kept each step, the
console sink off (siiRL's actor prints nothing). ``ours`` closes a step with ``flush()``
(the ack is read at the next step), ``ours_wait`` with the blocking ``wait_submit()``.
Each pattern first runs ``WARMUP`` steps that no figure counts (a sink opening, a key
set's first merge). ``--gap-ms`` leaves that long between steps, as a training step's
compute does (default 0: back to back, where a rank's next flush mostly comes before the
answer to its last one; a few ms apart the answer is in by then, as in training); the
steps per second count the metrics' time only. The ranks' CPU is their processes' (every
thread) and, in brackets in the last table, their own threads' (the training loop's).
``siirl1`` is siiRL's one-call pattern on its actor path (a queue, a processing loop,
per-key lists of Metric objects: ``baselines/siirl_actor.py``);
``siirl`` its four-call pattern with the per-key lists reduced inline
(``baselines/siirl_style.py``). ``floor`` is Ray alone, one call per rank per step with
nothing computed (``baselines/ray_floor.py``): no pattern with one call per rank per step
can cost less.

    python -m benchmarks.bench_rpc [--worlds 4 16] [--keys 30 300] [--steps 40] [--rounds 3]
                                   [--gap-ms 0]

It ends with the end-to-end table (ours against siiRL's one-call and four-call patterns,
as ratios measured round by round), ours over siiRL's one-call pattern paired by round
(the median of the rounds and their range: the ranks' CPU per step, the service's CPU per
batch, steps per second), and where the CPU of one step goes.
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
from benchmarks.baselines.per_key import PerKeyClient, PerKeyWorker
from benchmarks.baselines.ray_floor import FloorClient, FloorWorker
from benchmarks.baselines.siirl_actor import SiirlActor, SiirlOneCallClient
from benchmarks.baselines.siirl_style import SiirlStyleClient, SiirlStyleWorker
from metricsvc.client import MetricClient

RESULTS = Path("runs") / "bench"  # ignored by git: a run never dirties the checkout
WARMUP = 5  # steps each pattern runs before its figures are taken


def metric_names(k: int) -> list[str]:
    kinds = ["mean", "max", "min", "mean", "total"]
    return [f"group{i % 7}/metric_{i}/{kinds[i % len(kinds)]}" for i in range(k)]


@ray.remote(num_cpus=0)
class BenchRank:
    """A rank that can speak each pattern."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.client = None

    def setup(self, pattern: str, worker, world: int, keys: int) -> None:
        self.names = metric_names(keys)
        self.rng = np.random.default_rng(self.rank)
        if pattern in ("ours", "ours_wait"):
            self.client = MetricClient(worker, rank=self.rank, world_size=world)
        elif pattern == "harness":
            self.client = None
        elif pattern == "siirl":
            self.client = SiirlStyleClient(worker, world)
        elif pattern == "siirl1":
            self.client = SiirlOneCallClient(worker, world)
        elif pattern == "floor":
            self.client = FloorClient(worker)
        else:
            self.client = PerKeyClient(worker, world)
        self.pattern = pattern

    def cpu_s(self) -> tuple[float, float]:
        """This rank process's CPU time, every thread (Ray's own and a sender thread
        included), and its own thread's: the one that runs ``step``, the training loop's."""
        return time.process_time(), time.thread_time()

    def step(self) -> float:
        values = dict(zip(self.names, self.rng.normal(size=len(self.names)).tolist()))
        start = time.time()
        if self.pattern == "ours":
            self.client.submit_metric(values)
            self.client.flush()
        elif self.pattern == "ours_wait":
            self.client.submit_metric(values)
            self.client.wait_submit()
        elif self.pattern == "harness":
            pass  # the driver's per-step round trip to every rank, and nothing else
        else:
            self.client.flush(values)
        return start


def run(pattern: str, ranks, world: int, keys: int, steps: int, index: int,
        gap_s: float = 0.0) -> dict:
    if pattern == "harness":
        worker = None
    elif pattern in ("ours", "ours_wait"):
        worker = metricsvc.start_metric_worker(
            {"name": f"bench-{index}", "sinks": {"console": None, "jsonl": {}},
             "run": {"root": "/tmp/metricsvc-bench", "trial": f"{index}-{os.getpid()}"}})
    elif pattern == "siirl":
        worker = SiirlStyleWorker.remote()
    elif pattern == "siirl1":
        worker = SiirlActor.remote()
        ray.get(worker.start.remote())
    elif pattern == "floor":
        worker = FloorWorker.remote()
    else:
        worker = PerKeyWorker.remote()
    active = ranks[:world]
    ray.get([r.setup.remote(pattern, worker, world, keys) for r in active])
    latencies = []

    def one(step: int) -> float:
        """One step of the pattern; return the latency from the last rank's flush to the
        final result."""
        if pattern == "harness":
            flushed = ray.get([r.step.remote() for r in active])
            return time.time() - max(flushed)
        if pattern == "siirl1":  # siiRL reads the result after every rank's wait_submit
            flushed = ray.get([r.step.remote() for r in active])
            result = ray.get(worker.wait_final_res.remote())
            assert len(result) == keys
            return time.time() - max(flushed)
        final = (worker.wait_final_res.remote(step, 120) if pattern.startswith("ours")
                 else worker.wait_final_res.remote(step, world) if pattern == "floor"
                 else worker.wait_final_res.remote(keys))
        flushed = ray.get([r.step.remote() for r in active])
        result = ray.get(final)
        assert len(result) == keys
        return time.time() - max(flushed)

    # Steady state: the first steps (a sink opening, the first merge of a key set) are
    # each pattern's start-up, taken before anything is counted.
    for step in range(WARMUP):
        one(step)
    merge0 = batches0 = calls0 = sink0 = 0.0
    if worker is None:
        cpu0 = 0.0
    elif pattern.startswith("ours"):
        health = ray.get(worker.health.remote())
        cpu0, merge0, batches0 = health["cpu_s"], health["merge_cpu_s"], health["batches"]
        sink0 = _sink_cpu_s(health)
        calls0 = health["calls"].get("submit", 0)
    else:
        cpu0 = ray.get(worker.cpu_s.remote())
        calls0 = ray.get(worker.call_count.remote())
    ranks0 = ray.get([r.cpu_s.remote() for r in active])
    driver0 = time.process_time()
    t0 = time.perf_counter()
    slept = 0.0
    for step in range(WARMUP, WARMUP + steps):
        latencies.append(one(step))
        if gap_s:
            time.sleep(gap_s)
            slept += gap_s
    elapsed = time.perf_counter() - t0 - slept  # steps per second of the metrics alone
    driver_ms = 1e3 * (time.process_time() - driver0) / steps
    ranks1 = ray.get([r.cpu_s.remote() for r in active])
    ranks_ms = 1e3 * sum(b[0] - a[0] for a, b in zip(ranks0, ranks1)) / steps
    thread_ms = 1e3 * sum(b[1] - a[1] for a, b in zip(ranks0, ranks1)) / steps
    cpu_ms_per_batch = merge_ms = sink_ms = 0.0
    if pattern == "harness":
        calls = 0
    elif pattern.startswith("ours"):
        health = ray.get(worker.health.remote())
        calls = health["calls"]["submit"] - calls0
        cpu_ms_per_batch = 1e3 * (health["cpu_s"] - cpu0) / max(1, health["batches"] - batches0)
        merge_ms = 1e3 * (health["merge_cpu_s"] - merge0) / steps
        sink_ms = 1e3 * (_sink_cpu_s(health) - sink0) / steps
        ray.get(worker.close.remote())
    else:
        calls = ray.get(worker.call_count.remote()) - calls0
        cpu_ms_per_batch = 1e3 * (ray.get(worker.cpu_s.remote()) - cpu0) / (steps * world)
    if worker is not None:
        ray.kill(worker)
    lat = sorted(latencies)
    return {"pattern": pattern, "world": world, "keys": keys, "steps": steps,
            "steps_per_s": steps / elapsed, "calls_per_step": calls / steps,
            "actor_cpu_ms_per_batch": cpu_ms_per_batch,
            "actor_cpu_ms_per_step": cpu_ms_per_batch * world,
            "merge_cpu_ms_per_step": merge_ms, "sink_cpu_ms_per_step": sink_ms,
            "ranks_cpu_ms_per_step": ranks_ms,
            "ranks_thread_cpu_ms_per_step": thread_ms, "gap_ms": 1e3 * gap_s,
            "driver_cpu_ms_per_step": driver_ms,
            "latency_p50_ms": 1e3 * statistics.median(lat),
            "latency_p95_ms": 1e3 * lat[min(len(lat) - 1, int(0.95 * len(lat)))]}


def _sink_cpu_s(health: dict) -> float:
    """The CPU the service's sink threads have spent (the journal's, here)."""
    return sum(s["cpu_s"] or 0.0 for s in health["sinks"].values())


def _range(values: list[float], fmt: str = ".2f") -> str:
    lo, hi = min(values), max(values)
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}}–{hi:{fmt}}"


def summary(rows: list[dict]) -> list[str]:
    """The end-to-end table: per (W, K), each round's ratios of ours against siiRL's one-call
    (``siirl1``) and four-call (``siirl``) patterns and of Ray's floor (``floor``) against
    siiRL's one-call pattern, all measured back to back in that round."""
    lines = ["| W, K | siiRL 1-call steps/s | ours `flush` steps/s | ours / siiRL 1-call | "
             "ours / siiRL 4-call | floor / siiRL 1-call | ours / floor | "
             "flush→final p50 ms, ours / siiRL 1-call | "
             "actor CPU ms / batch, ours / siiRL 1-call / floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for world, keys in dict.fromkeys((r["world"], r["keys"]) for r in rows):
        got = {}
        for pattern in ("ours", "siirl1", "siirl", "floor"):
            got[pattern] = sorted((r for r in rows if r["pattern"] == pattern
                                   and (r["world"], r["keys"]) == (world, keys)),
                                  key=lambda r: r["round"])
        ours, one, four, floor = got["ours"], got["siirl1"], got["siirl"], got["floor"]

        def ratios(a: list[dict], b: list[dict]) -> str:
            return _range([x["steps_per_s"] / y["steps_per_s"] for x, y in zip(a, b)]) \
                if a and b else "—"

        def cpu(of: list[dict]) -> str:
            return _range([r["actor_cpu_ms_per_batch"] for r in of], ".3f") if of else "—"

        lines.append(
            f"| {world}, {keys} | {_range([r['steps_per_s'] for r in one], '.1f')} | "
            f"{_range([r['steps_per_s'] for r in ours], '.1f')} | {ratios(ours, one)} | "
            f"{ratios(ours, four)} | {ratios(floor, one)} | {ratios(ours, floor)} | "
            f"{_range([r['latency_p50_ms'] for r in ours], '.1f')} / "
            f"{_range([r['latency_p50_ms'] for r in one], '.1f')} | "
            f"{cpu(ours)} / {cpu(one)} / {cpu(floor)} |")
    return lines


def paired(rows: list[dict]) -> list[str]:
    """Ours over siiRL's one-call pattern, round by round (each round runs both back to
    back): the median of the rounds' ratios and their range, for what the rank, the
    service and the run feel: the ranks' CPU per step (less the harness's, the driver's
    trigger that every pattern pays), the service's CPU per batch and steps per second."""
    lines = ["| W, K | ranks' CPU / step | actor CPU / batch | steps / s |",
             "|---|---:|---:|---:|"]
    for world, keys in dict.fromkeys((r["world"], r["keys"]) for r in rows):
        by_round: dict[int, dict[str, dict]] = {}
        for r in rows:
            if (r["world"], r["keys"]) == (world, keys):
                by_round.setdefault(r["round"], {})[r["pattern"]] = r
        pairs = [got for got in by_round.values() if {"ours", "siirl1", "harness"} <= set(got)]
        if not pairs:
            continue
        cells = []
        for name in ("ranks_cpu_ms_per_step", "actor_cpu_ms_per_batch", "steps_per_s"):
            values = []
            for got in pairs:
                less = got["harness"][name] if name == "ranks_cpu_ms_per_step" else 0.0
                values.append((got["ours"][name] - less) / (got["siirl1"][name] - less))
            cells.append(f"{statistics.median(values):.2f} ({_range(values)})")
        lines.append(f"| {world}, {keys} | " + " | ".join(cells) + " |")
    return lines


def breakdown(rows: list[dict]) -> list[str]:
    """Where the CPU of one step goes (medians over the rounds): the ranks' processes less
    the harness's (the driver triggering each rank's step costs the same for every
    pattern), the service actor's process (for ours: its merge, validation, finishing and
    journal hand-off inside the calls, and the journal's thread; the rest is Ray's
    per-call work, the readers' calls included), and the driver's process."""
    lines = ["| W, K | pattern | ranks' metrics CPU ms / step (of it their own threads) | "
             "actor CPU ms / step (ours: inside the calls; the journal's thread) | "
             "driver CPU ms / step | steps/s |",
             "|---|---|---:|---:|---:|---:|"]
    med = statistics.median
    for world, keys in dict.fromkeys((r["world"], r["keys"]) for r in rows):
        mine = [r for r in rows if (r["world"], r["keys"]) == (world, keys)]
        harness = med(r["ranks_cpu_ms_per_step"] for r in mine if r["pattern"] == "harness")
        harness_thread = med(r["ranks_thread_cpu_ms_per_step"] for r in mine
                             if r["pattern"] == "harness")
        for pattern in ("ours", "siirl1", "floor"):
            got = [r for r in mine if r["pattern"] == pattern]
            if not got:
                continue
            inside = (f" ({med(r['merge_cpu_ms_per_step'] for r in got):.2f}; "
                      f"{med(r['sink_cpu_ms_per_step'] for r in got):.2f})"
                      if pattern == "ours" else "")
            lines.append(
                f"| {world}, {keys} | {pattern} | "
                f"{med(r['ranks_cpu_ms_per_step'] for r in got) - harness:.2f} "
                f"({med(r['ranks_thread_cpu_ms_per_step'] for r in got) - harness_thread:.2f}) | "
                f"{med(r['actor_cpu_ms_per_step'] for r in got):.2f}{inside} | "
                f"{med(r['driver_cpu_ms_per_step'] for r in got):.2f} | "
                f"{med(r['steps_per_s'] for r in got):.1f} |")
    return lines


def main() -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--keys", type=int, nargs="+", default=[30, 300])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every pattern back to back (ratios are per round)")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="time between steps (a training step's compute); not counted in "
                             "steps per second")
    parser.add_argument("--per-key-steps", type=int, default=3,
                        help="steps for the one-call-per-key baseline (it is slow)")
    args = parser.parse_args()
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
    ranks = [BenchRank.remote(r) for r in range(max(args.worlds))]
    run("harness", ranks, max(args.worlds), 1, 3, -1)  # warm-up: every rank process started
    rows, index = [], 0
    patterns = ["ours", "ours_wait", "siirl1", "siirl", "floor"]
    for round_ in range(args.rounds):
        for world in args.worlds:
            for keys in args.keys:
                # harness: the driver's trigger alone; ours_wait: ours with the blocking close;
                # the order alternates by round so neither side always goes first
                order = patterns if round_ % 2 == 0 else patterns[::-1]
                extra = ["harness"] + (["per_key"] if round_ == 0 else [])
                for pattern in extra + order:
                    steps = args.steps if pattern != "per_key" else args.per_key_steps
                    row = run(pattern, ranks, world, keys, steps, index, args.gap_ms / 1e3)
                    rows.append({**row, "round": round_})
                    index += 1
    print(f"bench_rpc: local Ray on {os.cpu_count()} cores; W rank actors each flush K plain "
          f"float metrics per step, {args.gap_ms:g} ms between steps; {args.rounds} rounds, "
          f"every pattern back to back")
    print("| W | K | round | pattern | steps/s | actor calls / step | actor CPU ms / batch | "
          "flush→final p50 ms | p95 ms | ours: steps/s × |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ours = next(r for r in rows if r["pattern"] == "ours" and r["world"] == row["world"]
                    and r["keys"] == row["keys"] and r["round"] == row["round"])
        print(f"| {row['world']} | {row['keys']} | {row['round']} | {row['pattern']} | "
              f"{row['steps_per_s']:.1f} | {row['calls_per_step']:.1f} | "
              f"{row['actor_cpu_ms_per_batch']:.3f} | "
              f"{row['latency_p50_ms']:.1f} | {row['latency_p95_ms']:.1f} | "
              f"{ours['steps_per_s'] / row['steps_per_s']:.2f} |")
    print()
    print("End to end, ours against siiRL's patterns (ranges over the rounds):")
    print("\n".join(summary(rows)))
    print()
    print("Ours over siiRL's one-call pattern, paired by round (median, range):")
    print("\n".join(paired(rows)))
    print()
    print("Where the CPU of one step goes (medians over the rounds; 2 cores share it all):")
    print("\n".join(breakdown(rows)))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rpc.json").write_text(json.dumps(rows, indent=2) + "\n")
    ray.shutdown()
    return rows


if __name__ == "__main__":
    main()
