"""What a training rank spends in metrics per step: ours vs siiRL's pattern, side by side.

Two workloads (``--workload``), each measured with every pattern in the same run.

``ppo300``. Ranks are Ray actors (CPU here). Each step a rank records K=300 metrics over a
realistic PPO batch: 8 token-level tensors of [256 x 2048] float32 under one response mask, each
reduced to mean/max/min (24 masked metrics), and 276 plain numbers (timing stages, losses,
learning rates, counters), then closes the step. Patterns, all in the same run:

  siirl_4call  siiRL's real pattern: every masked metric reduced on its own with ``.item()``
               (mean, max, min), the dicts sent as four actor calls
               (compute_local_data_metric, ..._timing_..., ..._throughout_..., submit_metric)
               then a blocking wait for all four (its ``wait_submit``)
  siirl_1call  the same reductions, one dict, one call, one blocking wait (its best case)
  ours_wait    ``stat(mask=...)`` + ``submit_metric`` + ``wait_submit()`` (blocking)
  ours         the same with ``flush()``: the Ray call made, its ack read next step
               (until 2026-12-05 a sender thread made the call)

``siirl``: siiRL's own batch per rank (``responses`` [64 x 1024], ``attention_mask``
[64 x 1536] with unequal valid tokens per rank, scores, rewards, advantages, returns,
values, 13 timing stages, 200 plain scalars; two such batches, taken in turn, so each step
reads a batch it did not read the step before, as in training) and siiRL's metric
functions rebuilt in ``benchmarks/baselines/siirl_metrics.py`` (what siiRL's
``compute_data_metric`` and its timing and throughput functions compute: one reduction and
``.item()`` per number):

  siirl_4call   its real client: compute_local_data_metric, ..._timing_..., ..._throughout_...,
                submit_metric as four calls, then wait_submit
  siirl_1call   the same functions, one dict, one call, one wait
  ours_compat   our siiRL-compatible methods (the same four names) + wait_submit
  ours_compat_flush  the same with flush()
  ours_stat     stat(mask=...) for the same tensors + submit_metric + wait_submit
  floor         one plain sum() over the same tensors (compute only, nothing sent)

Reported per pattern: median rank-side milliseconds per step spent recording (compute) and
closing (send + wait), and their sum, over ranks and measured steps; the patterns run in
turns, a round of ``--steps`` steps each (the order reversed every other round), and the
table gives the median of the rounds' medians; the whole step with ``flush()`` against
siiRL's one call is paired round by round (median and range).

    python -m benchmarks.bench_rank [--workload ppo300|siirl] [--ranks 4] [--steps 20]
        [--rounds 5]
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
from benchmarks.baselines import siirl_metrics
from benchmarks.baselines.siirl_style import SiirlStyleWorker
from metricsvc.client import MetricClient

RESULTS = Path("runs") / "bench"  # ignored by git: a run never dirties the checkout
TENSORS = ("advantages", "returns", "values", "old_log_prob", "log_prob", "entropy", "ratio",
           "kl")
PLAIN = 276
PATTERNS = {"ppo300": ("siirl_4call", "siirl_1call", "ours_wait", "ours"),
            "siirl": ("siirl_4call", "siirl_1call", "ours_compat", "ours_compat_flush",
                      "ours_stat", "floor")}
STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic",
          "update_actor", "testing", "save_checkpoint", "step", "reshard", "sync")


def siirl_masked(name: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """siiRL's per-metric reductions: a masked mean, max and min, each its own ``.item()``."""
    valid = torch.masked_select(x, mask)
    return {f"critic/{name}/mean": torch.mean(valid).item(),
            f"critic/{name}/max": torch.max(valid).item(),
            f"critic/{name}/min": torch.min(valid).item()}


class RankBody:
    """A training rank that closes each step in one of the patterns (``Rank``: its actor)."""

    def __init__(self, rank: int, world: int, rows: int, cols: int, workload: str) -> None:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(rank)
        self.rank, self.world, self.workload = rank, world, workload
        self.step_no = 0
        if workload == "siirl":
            self._siirl_batch(g)
            return
        self.tensors = {n: torch.randn(rows, cols, generator=g) for n in TENSORS}
        lengths = torch.randint(cols // 8, cols, (rows,), generator=g)  # unequal per rank
        self.mask = torch.arange(cols)[None, :] < lengths[:, None]
        self.plain = [f"group{i % 9}/value_{i}" for i in range(PLAIN)]

    def _siirl_batch(self, g: torch.Generator, b: int = 64, prompt: int = 512,
                     response: int = 1024) -> None:
        plen = torch.randint(prompt // 4, prompt + 1, (b,), generator=g)
        rlen = torch.randint(response // 8, response + 1 - 100 * self.rank, (b,), generator=g)
        pmask = torch.arange(prompt)[None, :] >= (prompt - plen)[:, None]  # left-padded
        rmask = torch.arange(response)[None, :] < rlen[:, None]
        scores = torch.zeros(b, response)
        scores[torch.arange(b), rlen - 1] = torch.rand(b, generator=g)
        batch = {
            "responses": torch.randint(0, 32000, (b, response), generator=g),
            "attention_mask": torch.cat([pmask, rmask], dim=1).long(),
            "token_level_scores": scores, "token_level_rewards": scores.clone(),
            "advantages": torch.randn(b, response, generator=g),
            "returns": torch.randn(b, response, generator=g),
            "values": torch.randn(b, response, generator=g),
        }
        # A step's batch is new to it (training hands each step a new one: nothing the
        # step before read of it is cached): two batches, taken in turn.
        self.batches = (batch, {k: v.clone() for k, v in batch.items()})
        self.response_mask = rmask
        self.timing = {s: 0.5 + 0.01 * i for i, s in enumerate(STAGES)}
        self.plain = [f"custom/group{i % 7}/value_{i}" for i in range(200)]

    def setup(self, pattern: str, target, name: str | None) -> None:
        self.pattern, self.target = pattern, target
        self.client = (MetricClient(None, rank=self.rank, world_size=self.world, name=name)
                       if pattern.startswith("ours") else None)
        self.step_no = 0

    def _plain(self) -> dict[str, float]:
        return {k: float(self.step_no * 0.001 + i) for i, k in enumerate(self.plain)}

    def step(self) -> dict[str, float]:
        self.step_no += 1
        if self.workload == "siirl":
            return self._siirl_step()
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

    def _siirl_step(self) -> dict[str, float]:
        plain = self._plain()
        batch, timing, c = self.batches[self.step_no % 2], self.timing, self.client
        t0 = time.perf_counter()
        p = self.pattern
        if p in ("siirl_4call", "siirl_1call"):
            dicts = [siirl_metrics.compute_data_metric(batch),
                     siirl_metrics.compute_timing_metrics(batch, timing),
                     siirl_metrics.compute_throughput_metrics(batch, timing, 1), plain]
            if p == "siirl_1call":
                dicts = [{k: v for d in dicts for k, v in d.items()}]
            t1 = time.perf_counter()
            ray.get([self.target.submit_metric.remote(d, self.world) for d in dicts])
        elif p == "floor":
            for x in batch.values():
                x.sum()
            t1 = time.perf_counter()
        else:
            if p == "ours_stat":
                c.stat(**{"critic/score": batch["token_level_scores"].sum(-1),
                          "critic/rewards": batch["token_level_rewards"].sum(-1)})
                c.stat(mask=self.response_mask, **{f"critic/{k}": batch[k] for k in
                                                   ("advantages", "returns", "values")})
                c.submit_metric({**{f"timing_s/{k}": v for k, v in timing.items()}, **plain})
            else:
                c.compute_local_data_metric(batch)
                c.compute_local_timing_metrics(batch, timing)
                c.compute_local_throughout_metrics(batch, timing, 1)
                c.submit_metric(plain)
            t1 = time.perf_counter()
            c.flush() if p == "ours_compat_flush" else c.wait_submit()
        t2 = time.perf_counter()
        return {"compute_ms": 1e3 * (t1 - t0), "close_ms": 1e3 * (t2 - t1),
                "last_flush": time.time()}

    def drain(self) -> None:
        if self.client is not None:
            self.client.wait_acks(60)


Rank = ray.remote(num_cpus=0)(RankBody)


def run(pattern: str, ranks, steps: int, warmup: int, index: int, workload: str) -> dict:
    world = len(ranks)
    name = f"bench-rank-{index}"
    if pattern == "floor":
        target = None
    elif pattern.startswith("ours"):
        target = metricsvc.start_metric_worker(
            {"name": name, "world_size": world, "sinks": {"console": None, "jsonl": None},
             "run": {"root": "/tmp/metricsvc-bench", "trial": f"rank-{index}-{os.getpid()}"}})
    else:
        target = SiirlStyleWorker.remote()
    ray.get([r.setup.remote(pattern, target, name) for r in ranks])
    samples = []
    keys = 3 * len(TENSORS) + PLAIN if workload == "ppo300" else 200
    for step in range(warmup + steps):
        final = (None if target is None else target.wait_final_res.remote(step, 120)
                 if pattern.startswith("ours") else target.wait_final_res.remote(keys))
        got = ray.get([r.step.remote() for r in ranks])
        assert final is None or len(ray.get(final)) >= keys
        if step >= warmup:
            samples.extend(got)
    ray.get([r.drain.remote() for r in ranks])
    if target is not None:
        ray.kill(target)
    med = {k: statistics.median(s[k] for s in samples) for k in ("compute_ms", "close_ms")}
    total = statistics.median(s["compute_ms"] + s["close_ms"] for s in samples)
    return {"workload": workload, "pattern": pattern, "ranks": world, "steps": steps, **med,
            "total_ms": total}


def over_rounds(got: dict[str, list[dict]]) -> list[dict]:
    """One row per pattern: the medians over its rounds (each round's row under
    ``rounds``, to pair patterns round by round)."""
    out = []
    for rounds in got.values():
        row = dict(rounds[0])
        for k in ("compute_ms", "close_ms", "total_ms"):
            row[k] = statistics.median(r[k] for r in rounds)
        row["steps"] = sum(r["steps"] for r in rounds)
        out.append({**row, "rounds": rounds})
    return out


def compat_compute(rounds: int = 15, steps: int = 20) -> dict:
    """Ours over siiRL's compute on siiRL's batch, in this process (no Ray, no send):
    ``compute_local_data_metric`` + ``..._timing_..`` + ``..._throughput_..`` +
    ``submit_metric`` of 200 scalars against siiRL's three functions and its one dict.
    Each step runs both on the step's batch (the two batches taken in turn), in turns
    (which goes first alternates), timed in this thread's CPU time (what the rank spends;
    a core taken by another process does not count); a round is ``steps`` such steps, its
    ratio ours' CPU time over siiRL's."""
    torch.set_num_threads(1)
    rank = RankBody(0, 1, 1, 1, "siirl")
    rank.setup("ours_compat", None, "bench-compat")
    timing, client = rank.timing, rank.client
    plain = rank._plain()

    def ours(batch) -> None:
        client.compute_local_data_metric(batch)
        client.compute_local_timing_metrics(batch, timing)
        client.compute_local_throughput_metrics(batch, timing, 1)
        client.submit_metric(plain)
        client.buffer.discard()

    def theirs(batch) -> None:
        dicts = [siirl_metrics.compute_data_metric(batch),
                 siirl_metrics.compute_timing_metrics(batch, timing),
                 siirl_metrics.compute_throughput_metrics(batch, timing, 1), plain]
        {k: v for d in dicts for k, v in d.items()}

    c = paired(ours, theirs, rank.batches, rounds, steps)
    return {"ours_ms": c.pop("a_ms"), "siirl_ms": c.pop("b_ms"), **c}


def paired(a, b, batches, rounds: int, steps: int) -> dict:
    """``a``'s CPU time over ``b``'s, both run each step on that step's batch (in turns:
    which goes first alternates), after four warm-up steps: the medians per step in ms,
    and the median and range of the rounds' ratios."""
    clock = time.thread_time
    for i in range(4):
        a(batches[i % 2])
        b(batches[i % 2])
    ratios, ms = [], {a: [], b: []}
    for r in range(rounds):
        took = {a: 0.0, b: 0.0}
        for i in range(steps):
            batch = batches[i % 2]
            for f in ((a, b) if (r * steps + i) % 2 else (b, a)):
                start = clock()
                f(batch)
                spent = clock() - start
                took[f] += spent
                ms[f].append(spent * 1e3)
        ratios.append(took[a] / took[b])
    return {"a_ms": statistics.median(ms[a]), "b_ms": statistics.median(ms[b]),
            "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "rounds": rounds}


def interleaved(a, b, rounds: int, calls: int) -> dict:
    """``a``'s compute over ``b``'s, in interleaved rounds (the order alternates), each the
    mean of ``calls`` calls after two warm-up calls of each: the medians in ms, and the
    ratio's median and range. Timed as this process's CPU time (one thread computes):
    what the rank spends, not what other processes on a shared machine take from it."""
    for f in (a, b, a, b):
        f()
    ratios, ms = [], {a: [], b: []}
    for r in range(rounds):
        took = {}
        for f in ((a, b) if r % 2 else (b, a)):
            start = time.process_time()
            for _ in range(calls):
                f()
            took[f] = (time.process_time() - start) / calls * 1e3
            ms[f].append(took[f])
        ratios.append(took[a] / took[b])
    return {"a_ms": statistics.median(ms[a]), "b_ms": statistics.median(ms[b]),
            "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "rounds": rounds}


def extremes_cost(rows: int, cols: int, rounds: int = 15, calls: int = 5) -> dict:
    """A PPO step with ``stat(ids=)`` over one without, in this process: 8 token-level
    tensors [rows x cols] under the response mask, 6 per-sequence values, 276 plain numbers,
    then the flush's host copy and encoding (``take_batch`` + ``encode``), in interleaved
    rounds (the order alternates), each the mean of ``calls`` steps."""
    from metricsvc.core.wire import encode

    torch.set_num_threads(1)
    body = RankBody(0, 1, rows, cols, "ppo300")
    client = MetricClient(None, rank=0, world_size=1, name="bench-extremes")
    tokens = {f"critic/{n}": x for n, x in body.tensors.items()}
    per_seq = {f"response/{n}": x.sum(1) for n, x in list(body.tensors.items())[:6]}
    ids = torch.arange(rows) + 10_000
    plain = body._plain()

    def step(given: torch.Tensor | None, top: int | None = None) -> None:
        client.stat(mask=body.mask, ids=given, top=top, **tokens)
        client.stat(ids=given, top=top, **per_seq)
        client.submit_metric(plain)
        encode(client.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True))

    def with_ids() -> None:
        step(ids)

    def without() -> None:
        step(None)

    def with_top() -> None:
        step(ids, 8)

    c = interleaved(with_ids, without, rounds, calls)
    t = interleaved(with_top, with_ids, rounds, calls)
    return {"with_ids_ms": c.pop("a_ms"), "without_ms": c.pop("b_ms"), **c,
            "with_top_ms": t["a_ms"], "top_ratio": t["ratio"], "top_low": t["low"],
            "top_high": t["high"]}


def print_extremes_cost(c: dict, rows: int, cols: int) -> None:
    print(f"bench_rank extremes: one process, a PPO step (8 token-level [{rows} x {cols}] "
          f"masked, 6 per-sequence, 276 plain; record + take_batch + encode), "
          f"{c['rounds']} interleaved rounds")
    print("| step | ms | with ids / without (median) | range |")
    print("|---|---:|---:|---:|")
    print(f"| without ids | {c['without_ms']:.2f} | | |")
    print(f"| stat(ids=) | {c['with_ids_ms']:.2f} | {c['ratio']:.2f}× | "
          f"{c['low']:.2f}–{c['high']:.2f}× |")
    print(f"| stat(ids=, top=8) | {c['with_top_ms']:.2f} | {c['top_ratio']:.2f}× of stat(ids=) "
          f"| {c['top_low']:.2f}–{c['top_high']:.2f}× |")


def main() -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted([*PATTERNS, "extremes"]), nargs="+",
                        default=["ppo300", "siirl", "extremes"])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per round")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds; each runs every pattern once, in turns (the order "
                             "reversed every other round)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=2048)
    args = parser.parse_args()
    rows, index = [], 0
    if "extremes" in args.workload:  # in this process, before Ray's processes start
        c = extremes_cost(args.rows, args.cols)
        rows.append({"workload": "extremes", "pattern": "stat_ids", **c})
        print_extremes_cost(c, args.rows, args.cols)
        args.workload = [w for w in args.workload if w != "extremes"]
    if args.workload:  # the others run rank actors
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
    for workload in args.workload:
        ranks = [Rank.remote(r, args.ranks, args.rows, args.cols, workload)
                 for r in range(args.ranks)]
        got: dict[str, list[dict]] = {p: [] for p in PATTERNS[workload]}
        for r in range(args.rounds):  # the load on a shared machine changes: in turns
            order = PATTERNS[workload] if r % 2 == 0 else PATTERNS[workload][::-1]
            for pattern in order:
                got[pattern].append(run(pattern, ranks, args.steps, args.warmup, index,
                                        workload))
                index += 1
        rows.extend(over_rounds(got))
        for r in ranks:
            ray.kill(r)
    for workload in args.workload:
        table = [r for r in rows if r["workload"] == workload]
        base = {r["pattern"]: r for r in table}
        if workload == "ppo300":
            print(f"bench_rank ppo300: {args.ranks} rank actors, [{args.rows} x {args.cols}] "
                  f"batch, K={3 * len(TENSORS) + PLAIN} metrics ({3 * len(TENSORS)} masked over "
                  f"{len(TENSORS)} tensors, {PLAIN} plain)", end="")
        else:
            print(f"bench_rank siirl: {args.ranks} rank actors, siiRL's batch (responses "
                  f"[64 x 1024], attention_mask [64 x 1536], 13 timing stages, 200 scalars)",
                  end="")
        print(f", {args.rounds} rounds of {args.steps} steps x ranks in turns, "
              f"{os.cpu_count()} cores, "
              f"torch {torch.__version__}")
        print("| pattern | compute ms | send + wait ms | rank-side total ms | "
              "siiRL 4-call / this | siiRL 1-call / this |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in table:
            print(f"| {r['pattern']} | {r['compute_ms']:.2f} | {r['close_ms']:.2f} | "
                  f"{r['total_ms']:.2f} | "
                  f"{base['siirl_4call']['total_ms'] / r['total_ms']:.2f}× | "
                  f"{base['siirl_1call']['total_ms'] / r['total_ms']:.2f}× |")
        if workload == "siirl":
            whole = [one["total_ms"] / flush["total_ms"] for one, flush in
                     zip(base["siirl_1call"]["rounds"], base["ours_compat_flush"]["rounds"])]
            base["ours_compat_flush"]["whole_step_ratio"] = statistics.median(whole)
            print(f"\nwhole step with flush: siiRL 1-call / ours_compat_flush = "
                  f"{statistics.median(whole):.2f}× (median of {len(whole)} rounds; "
                  f"{min(whole):.2f}–{max(whole):.2f}×)")
            c = compat_compute()
            rows.append({"workload": "siirl", "pattern": "compat_compute", **c})
            print(f"\ncompat compute in one process, CPU time per step ({c['rounds']} rounds of "
                  f"paired steps): ours "
                  f"{c['ours_ms']:.2f} ms, siiRL {c['siirl_ms']:.2f} ms")
            print("| compute | ours / siiRL (median) | range |")
            print("|---|---:|---:|")
            print(f"| data + timing + throughput + 200 scalars | {c['ratio']:.2f}× | "
                  f"{c['low']:.2f}–{c['high']:.2f}× |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rank.json").write_text(json.dumps(rows, indent=2) + "\n")
    ray.shutdown()
    return rows


if __name__ == "__main__":
    main()
