"""Worker-side summaries side by side: per-metric .item() calls vs ours vs the bandwidth floor.

K metrics of [rows x cols] float32 values with one shared bool mask, as a PPO
step records them. Rows:
  (a) naive  — per metric: masked mean .item(), masked_select().max().item(), .min().item()
  (b) ours   — per metric: one summary on the value's device; one host copy for all K
               (on the CPU: the mask's positions found once, each value gathered once)
  (c) floor  — one plain x.sum() over the same bytes

Then a step recorded as micro-batches (one process, no Ray): each micro-batch records 200
plain numbers and 4 masked [8 x 512] float32 tensors, M = 1 and 8 micro-batches per step.
  verl   — ``append_to_dict`` per micro-batch (a masked mean ``.item()`` per tensor), then
           ``np.mean`` of each key's list at the step's end (a mean of means)
  ours   — ``submit_metric`` + ``stat(mask=)`` per micro-batch: every key merged exactly
           into the step's records (count-weighted, with min and max)

    python benchmarks/bench_summarize.py [--k 32] [--rows 256] [--cols 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from metricsvc.client import MetricClient
from metricsvc.client.summaries import summarize_call, to_host
from metricsvc.client.tensors import accelerator_path_on_cpu
from tests.synccount import HostTransferCounter

RESULTS = Path("runs") / "bench"  # ignored by git: a run never dirties the checkout


def naive(values: list[torch.Tensor], mask: torch.Tensor) -> list[float]:
    out = []
    for x in values:
        maskf = mask.float()
        out.append(((x * maskf).sum() / maskf.sum()).item())
        out.append(x.masked_select(mask).max().item())
        out.append(x.masked_select(mask).min().item())
    return out


def ours(values: list[torch.Tensor], mask: torch.Tensor, compile: bool | None) -> object:
    # What MetricClient.stat(mask=mask, **metrics) then wait_submit do before the RPC.
    found = summarize_call({f"m{i}": x for i, x in enumerate(values)}, mask, compile=compile)
    return to_host([rows.rows for rows in found])[0]


def floor(flat: torch.Tensor) -> float:
    return flat.sum()


def timed(fn, repeats: int) -> tuple[float, int]:
    fn()  # warm-up (and compilation)
    # Device syncs are counted on the path an accelerator takes: on the CPU our summaries
    # read values (no device there to wait for), which the counter would also count.
    with accelerator_path_on_cpu(), HostTransferCounter() as counter:
        fn()
    syncs = counter.count
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3, syncs


def micro_batches(repeats: int, steps: int = 20) -> dict:
    """ms per step of a step recorded as M micro-batches, verl's pattern and ours, for M
    = 1 and 8 (the patterns alternate, each the median of ``repeats`` runs of ``steps``)."""
    g = torch.Generator().manual_seed(1)
    plain = [f"actor/group{i % 9}/value_{i}" for i in range(200)]
    names = ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/ratio")
    micro = [({k: float(torch.rand(1, generator=g)) for k in plain},
              {k: torch.randn(8, 512, generator=g) for k in names},
              torch.rand(8, 512, generator=g) < 0.7) for _ in range(8)]
    client = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed

    def verl(m: int) -> None:
        lists: dict[str, list[float]] = {}
        for numbers, tensors, mask in micro[:m]:
            out = dict(numbers)
            for k, x in tensors.items():
                out[k] = ((x * mask).sum() / mask.sum()).item()
            for k, v in out.items():  # verl's append_to_dict
                lists.setdefault(k, []).append(v)
        {k: float(np.mean(v)) for k, v in lists.items()}  # its reduce_metrics

    def ours(m: int) -> None:
        for numbers, tensors, mask in micro[:m]:
            client.submit_metric(numbers)
            client.stat(mask=mask, **tensors)
        client.buffer.discard()

    ms: dict[tuple[str, int], list[float]] = {}
    for r in range(repeats):
        for m in (1, 8):
            for name, fn in (("verl", verl), ("ours", ours))[:: 1 if r % 2 else -1]:
                fn(m)  # warm
                t0 = time.perf_counter()
                for _ in range(steps):
                    fn(m)
                ms.setdefault((name, m), []).append((time.perf_counter() - t0) / steps * 1e3)
    return {f"{name}_m{m}": statistics.median(v) for (name, m), v in ms.items()}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    values = [torch.randn(args.rows, args.cols, generator=g).to(args.device) for _ in range(args.k)]
    mask = (torch.rand(args.rows, args.cols, generator=g) < 0.7).to(args.device)
    flat = torch.cat([v.reshape(-1) for v in values])

    runs = {
        "(a) naive per-metric .item()": lambda: naive(values, mask),
        "(b) ours (default path)": lambda: ours(values, mask, compile=None),
        "(b') ours, forced torch.compile kernel": lambda: ours(values, mask, compile=True),
        "(c) floor: one x.sum()": lambda: floor(flat),
    }
    measured = {name: timed(fn, args.repeats) for name, fn in runs.items()}
    a_ms = measured["(a) naive per-metric .item()"][0]
    b_ms = measured["(b) ours (default path)"][0]
    c_ms = measured["(c) floor: one x.sum()"][0]

    title = (f"bench_summarize: K={args.k} metrics of [{args.rows} x {args.cols}] float32, "
             f"one shared mask, device={args.device}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads")
    print(title)
    print("| pattern | ms per flush | device syncs per flush | vs (a) naive | vs (c) floor |")
    print("|---|---:|---:|---:|---:|")
    for name, (ms, syncs) in measured.items():
        print(f"| {name} | {ms:.2f} | {syncs} | {a_ms / ms:.2f}x faster | {ms / c_ms:.1f}x |")
    print(f"\na/b = {a_ms / b_ms:.2f}  (target >= 4)    b/c = {b_ms / c_ms:.1f}")
    micro = micro_batches(args.repeats)
    print("\nmicro-batches: 200 plain numbers + 4 masked [8 x 512] tensors each, one process")
    print("| micro-batches per step | verl ms per step | ours ms per step | ours / verl |")
    print("|---:|---:|---:|---:|")
    for m in (1, 8):
        v, o = micro[f"verl_m{m}"], micro[f"ours_m{m}"]
        print(f"| {m} | {v:.2f} | {o:.2f} | {o / v:.2f}× |")

    figures = {
        "config": vars(args),
        "torch": torch.__version__,
        "ms": {name: ms for name, (ms, _) in measured.items()},
        "host_syncs_per_flush": {name: s for name, (_, s) in measured.items()},
        "a_over_b": a_ms / b_ms,
        "b_over_c": b_ms / c_ms,
        "micro_batches_ms": micro,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summarize.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
