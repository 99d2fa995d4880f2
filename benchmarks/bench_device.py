"""The client on an accelerator: exact merged summaries, one host copy per flush, and speed.

Run where torch sees a GPU, with Ray installed (``--device cpu --accelerator-path`` runs
the same script on a CPU, the ranks taking the accelerator's code path: a dry run):

    python -m benchmarks.bench_device [--ranks 4] [--steps 2] [--repeats 7] [--profile]

1. *exact*: ``--ranks`` Ray actors share the device; each step each records masked tensors
   of its own sizes (unequal rows per rank), in float32, bfloat16, float16 and float64,
   near 0, far from 0 (1e6 + noise), tiny (1e-300) and huge (1e300), with NaN and inf at
   valid positions, as micro-batches (the same key recorded twice, once without ids), with
   ``ids=`` (where each min and max came from), as quantiles, per-sequence values under
   their own masks (``stat_each``), and plain numbers; then ``flush()``. The driver
   compares each merged step with numpy in float64 on the concatenated valid values of
   every rank, and siiRL's data metrics of a batch on the device with the same methods on
   the CPU.
2. *host copies*: per rank and step, every synchronising CUDA call (torch's sync debug
   mode, with the lines of metricsvc that made it) while recording and in ``flush()``:
   none while recording once a step's kernels are compiled, one per flush.
3. *speed*: K masked metrics per flush (``bench_summarize``'s patterns) on the device:
   siiRL's per-metric ``.item()`` reductions; ours stacked and a value at a time, fused
   and eager; the one-sum floor. Then siiRL's batch (our siiRL-compatible methods against
   its functions) and a PPO step's recording (8 token-level tensors, 276 plain numbers,
   the flush's host copy and encoding) against siiRL's per-metric pattern.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

import metricsvc
from metricsvc.client import MetricClient
from metricsvc.client import device as device_module
from metricsvc.client.tensors import accelerator_path_on_cpu
from metricsvc.core.wire import encode
from tests.synccount import HostTransferCounter

RESULTS = Path("runs") / "bench"  # ignored by git: a run never dirties the checkout
SYNC_WARNING = "synchronizing CUDA operation"
QUANTILES = (0.5, 0.9, 0.99)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Located(HostTransferCounter):
    """The API counter, with the line of metricsvc (or of this script) that made each."""

    def __init__(self) -> None:
        super().__init__()
        self.located: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        before = len(self.calls)
        out = super().__torch_function__(func, types, args, kwargs)
        if len(self.calls) > before:
            self.located.append((self.calls[-1], _where(traceback.extract_stack()[:-2], 3)))
        return out


class Syncs:
    """Counts host transfers inside the block: torch's CUDA sync debug mode (each
    synchronising CUDA call, with the lines of metricsvc that made it) and the Python API
    counter."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.sites: list[str] = []
        self.api: list[str] = []

    def _seen(self, message: Any, *args: Any, **kwargs: Any) -> None:
        if SYNC_WARNING in str(message):
            self.sites.append(_where(traceback.extract_stack()[:-2], 3))

    def __enter__(self) -> Syncs:
        self._warn = warnings.catch_warnings()
        self._warn.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._seen
        # On CUDA the sync debug mode alone: a torch function mode would make torch.compile
        # trace again on every entry (it guards on the modes), never settling
        self._count = None if self.cuda else _Located().__enter__()
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        if self._count is not None:
            self._count.__exit__(*exc)
            self.api = [f"{name} at {where}" for name, where in self._count.located]
        self._warn.__exit__(*exc)


def _where(stack: list, depth: int = 1) -> str:
    """The innermost ``depth`` frames of metricsvc or of this script in ``stack``."""
    frames = [f for f in stack if "metricsvc" in f.filename or "bench_" in f.filename]
    inner = [f for f in stack if "metricsvc" not in f.filename][-1:] if stack else []
    return " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in
                      (inner + frames[::-1][:depth])) or "?"


# -- 1 and 2: exact across ranks, host copies per flush ---------------------------------------
def rank_data(rank: int, step: int) -> dict[str, Any]:
    """One rank's values for one step, on the CPU (the driver makes them again for numpy)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    rows = 24 + 9 * rank  # unequal batches per rank
    cols = 512
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    noise = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    f32 = (3 * noise + 1).float()
    f32.view(-1)[7] = float("nan")  # non-finite values at valid positions are counted
    f32.view(-1)[11] = float("inf")
    big_rows = 48 + 16 * rank  # over the fused kernel's threshold (65,536 values)
    big = torch.randn(big_rows, 2048, generator=g) * 2 - 0.5
    big_mask = torch.rand(big_rows, 2048, generator=g) < 0.8
    return {
        "mask": mask, "lengths": lengths,
        "tok/f32": f32,
        "tok/f32_micro2": (3 * torch.randn(rows // 2, cols, generator=g) + 1).float(),
        "tok/bf16": (2 * noise).to(torch.bfloat16),
        "tok/f16_tiny": (1e-3 * noise).to(torch.float16),
        "tok/far": (1e6 + noise).float(),
        "tok/f64_huge": 1e300 * noise,
        "tok/f64_tiny": 1e-300 * noise,
        "big/f32": big, "big/mask": big_mask,
        "ids": torch.arange(rows, dtype=torch.int64) + 10_000 * rank,
        "rewards": torch.rand(rows, generator=g, dtype=torch.float64),
    }


MASKED = ("tok/f32", "tok/bf16", "tok/f16_tiny", "tok/far", "tok/f64_huge", "tok/f64_tiny")


class DeviceRank:
    """A training rank whose tensors live on the device."""

    def __init__(self, rank: int, world: int, device: str, name: str,
                 accelerator_path: bool = False) -> None:
        self.rank, self.device = rank, device
        # --device cpu --accelerator-path: the CPU takes the accelerator's code path (a dry
        # run of it; its host reads are counted as they would be syncs)
        self.path = accelerator_path_on_cpu if accelerator_path else contextlib.nullcontext
        self.client = MetricClient(None, rank=rank, world_size=world, name=name)

    def step(self, step: int) -> dict[str, Any]:
        d = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
             for k, v in rank_data(self.rank, step).items()}
        _sync(self.device)
        c = self.client
        with self.path(), Syncs(self.device) as recording:
            c.stat(mask=d["mask"], ids=d["ids"], **{k: d[k] for k in MASKED})
            c.stat(mask=d["mask"][: d["tok/f32_micro2"].shape[0]],  # a second micro-batch
                   **{"tok/f32": d["tok/f32_micro2"]})
            c.stat(mask=d["big/mask"], **{"big/f32": d["big/f32"]})
            c.stat(mask=d["big/mask"], reduce="std", **{"big/f32_std": d["big/f32"]})
            c.stat(mask=d["mask"], reduce="std", **{"tok/far_std": d["tok/far"]})
            c.stat(mask=d["mask"], reduce="quantiles", **{"tok/f32_q": d["tok/f32"]})
            lengths = d["lengths"].to(torch.float64)
            c.stat_each(**{"seq/length": (lengths, None),
                           "seq/correct_length": (lengths, d["rewards"] > 0.5)})
            c.submit_metric({"plain/tokens/total": float(d["mask"].shape[0]),
                             "plain/loss": 0.25 * (self.rank + 1)})
        with self.path(), Syncs(self.device) as flushing:
            c.flush(step=step)
        return {"recording": recording.sites, "recording_api": recording.api,
                "flush": flushing.sites, "flush_api": flushing.api}

    def siirl_step(self, step: int) -> dict[str, Any]:
        """siiRL's data, timing and throughput metrics of a batch on the device."""
        from benchmarks.bench_rank import RankBody

        body = RankBody(self.rank, 1, 0, 0, "siirl")
        batch = {k: v.to(self.device) for k, v in body.batches[0].items()}
        _sync(self.device)
        c = self.client
        with self.path(), Syncs(self.device) as recording:
            c.compute_local_data_metric(batch)
            c.compute_local_timing_metrics(batch, body.timing)
            c.compute_local_throughput_metrics(batch, body.timing, n_gpus=1)
        with self.path(), Syncs(self.device) as flushing:
            c.flush(step=step)
        return {"recording": recording.sites, "recording_api": recording.api,
                "flush": flushing.sites, "flush_api": flushing.api,
                "batch": {k: v.cpu() for k, v in body.batches[0].items()}}

    def close(self) -> int:
        self.client.wait_acks(60)
        return self.client.host_copies


def oracle(ranks: int, step: int) -> dict[str, float]:
    """The merged step, computed by numpy in float64 on every rank's values concatenated."""
    data = [rank_data(r, step) for r in range(ranks)]
    out: dict[str, float] = {}

    def valid(key: str, r: int, mask_key: str = "mask") -> np.ndarray:
        x = data[r][key].to(torch.float64).numpy()
        m = data[r][mask_key].numpy()[: x.shape[0]]
        v = x[m]
        return v[np.isfinite(v)]

    for key in MASKED + ("tok/f32",):
        parts = [valid(key, r) for r in range(ranks)]
        if key == "tok/f32":
            parts += [valid("tok/f32_micro2", r) for r in range(ranks)]
        v = np.concatenate(parts)
        out[f"{key}/mean"], out[f"{key}/min"], out[f"{key}/max"] = v.mean(), v.min(), v.max()
    big = np.concatenate([valid("big/f32", r, "big/mask") for r in range(ranks)])
    out["big/f32/mean"], out["big/f32/min"], out["big/f32/max"] = big.mean(), big.min(), big.max()
    out["big/f32_std/std"] = big.std()
    far = np.concatenate([valid("tok/far", r) for r in range(ranks)])
    out["tok/far_std/std"] = far.std()
    q = np.concatenate([valid("tok/f32", r) for r in range(ranks)])
    for p in QUANTILES:
        out[f"tok/f32_q/p{round(p * 100)}"] = float(np.quantile(q, p))
    lengths = np.concatenate([d["lengths"].numpy().astype(np.float64) for d in data])
    correct = np.concatenate([d["lengths"].numpy()[d["rewards"].numpy() > 0.5] for d in data])
    out["seq/length/mean"], out["seq/length/min"], out["seq/length/max"] = (
        lengths.mean(), lengths.min(), lengths.max())
    out["seq/correct_length/mean"] = correct.astype(np.float64).mean()
    out["plain/tokens/total"] = float(sum(d["mask"].shape[0] for d in data))
    out["plain/loss"] = float(np.mean([0.25 * (r + 1) for r in range(ranks)]))
    return out


def where_extremes(ranks: int, step: int) -> dict[str, dict[str, int]]:
    """The rank and id each MASKED key's min and max came from (the first by rank, call,
    position; a recording without ids names the rank alone)."""
    data = [rank_data(r, step) for r in range(ranks)]
    found = {}
    for key in MASKED:
        for end, pick in (("min", np.argmin), ("max", np.argmax)):
            best = None
            for r, d in enumerate(data):
                calls = [(d[key], d["ids"])]
                if key == "tok/f32":  # its second micro-batch, recorded without ids
                    calls.append((d["tok/f32_micro2"], None))
                for values, ids in calls:
                    x = values.to(torch.float64).numpy().copy()
                    hidden = ~d["mask"].numpy()[: x.shape[0]] | ~np.isfinite(x)
                    x[hidden] = np.inf if end == "min" else -np.inf
                    at = int(pick(x))
                    value = x.reshape(-1)[at]
                    if best is None or (value < best[0] if end == "min" else value > best[0]):
                        where = {"rank": r}
                        if ids is not None:
                            where["id"] = int(ids[at // x.shape[1]])
                        best = (value, where)
            found[f"{key}/{end}"] = best[1]
    return found


def relative(got: float, want: float) -> float:
    if got == want:
        return 0.0
    return abs(got - want) / max(abs(want), 1e-300)


def exactness(args: argparse.Namespace) -> dict[str, Any]:
    name = f"device-{os.getpid()}"
    worker = metricsvc.start_metric_worker(
        {"name": name, "sinks": {"console": None, "jsonl": None},
         "run": {"root": "/tmp/metricsvc-device", "trial": str(os.getpid())}},
        world_size=args.ranks)
    share = 1 / args.ranks if args.device.startswith("cuda") else 0
    actor = ray.remote(num_cpus=0, num_gpus=share)(DeviceRank)
    ranks = [actor.remote(r, args.ranks, args.device, name, args.accelerator_path)
             for r in range(args.ranks)]
    report: dict[str, Any] = {"steps": [], "worst": {}}
    for step in range(args.steps):
        t0 = time.perf_counter()
        counted = ray.get([r.step.remote(step) for r in ranks])
        final = ray.get(worker.wait_final.remote(step, 120))
        got, want = final["metrics"], oracle(args.ranks, step)
        errors = {}
        for key, value in want.items():
            bound = 0.011 if "_q/p" in key else 1e-12
            err = relative(got.get(key, math.nan), value)
            report["worst"][key] = max(report["worst"].get(key, 0.0), err)
            if not err <= bound:
                errors[key] = {"got": got.get(key), "numpy": value, "relative": err}
        extremes = final["meta"].get("extremes", {})
        wrong_source = {k: {"got": extremes.get(k), "numpy": v}
                        for k, v in where_extremes(args.ranks, step).items()
                        if {f: x for f, x in (extremes.get(k) or {}).items()
                            if f in ("rank", "id")} != v}
        report["steps"].append({
            "step": step, "seconds": time.perf_counter() - t0, "errors": errors,
            "wrong_extreme_sources": wrong_source,
            "syncs_recording": [c["recording"] for c in counted],
            "api_recording": [c["recording_api"] for c in counted],
            "syncs_flush": [c["flush"] for c in counted],
            "api_flush": [c["flush_api"] for c in counted]})
    # siiRL's data metrics of a batch on the device, against the same methods on the CPU
    step = args.steps + 1  # the second such step: the first compiles the fused kernels
    ray.get([r.siirl_step.remote(step - 1) for r in ranks])
    counted = ray.get([r.siirl_step.remote(step) for r in ranks])
    on_device = ray.get(worker.wait_final_res.remote(step, 120))
    host = metricsvc.start_metric_worker(
        {"name": name + "-cpu", "sinks": {"console": None, "jsonl": None},
         "run": {"root": "/tmp/metricsvc-device", "trial": f"{os.getpid()}-cpu"}},
        world_size=args.ranks)
    clients = [MetricClient(None, rank=r, world_size=args.ranks, name=name + "-cpu",
                            start_step=step)
               for r in range(args.ranks)]
    for c, got in zip(clients, counted):
        c.compute_local_data_metric(got["batch"])
        c.wait_submit(step=step)
    on_host = ray.get(host.wait_final_res.remote(step, 120))
    differ = {k: (on_device.get(k), v) for k, v in on_host.items()
              if not k.startswith(("perf/", "timing")) and relative(on_device.get(k, math.nan),
                                                                    v) > 1e-12}
    report["siirl"] = {"keys": len(on_device), "differ_from_cpu": differ,
                       "syncs_recording": [c["recording"] for c in counted],
                       "api_recording": [c["recording_api"] for c in counted],
                       "syncs_flush": [c["flush"] for c in counted]}
    report["host_copies"] = ray.get([r.close.remote() for r in ranks])
    for handle in (worker, host):
        metricsvc.stop_metric_worker(handle)
    return report


# -- 3: speed --------------------------------------------------------------------------------
def graphs() -> int:
    """Graphs torch.compile made in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def timed(fn: Any, device: str, repeats: int) -> float:
    fn()
    fn()  # a form's second call (dynamic sizes) may compile once more
    compiled = graphs()
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    if graphs() != compiled:
        print(f"  ({graphs() - compiled} graphs compiled during the timed calls of "
              f"{getattr(fn, '__name__', fn)})")
    return statistics.median(samples) * 1e3


def alone(ours: Any, values: Any, mask: Any, compile: bool) -> Any:
    """``ours`` with every value summarised on its own (no stacking)."""
    held = device_module.STACK_MAX
    device_module.STACK_MAX = 1
    try:
        return ours(values, mask, compile)
    finally:
        device_module.STACK_MAX = held


def speed(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.bench_rank import TENSORS, siirl_masked
    from benchmarks.bench_summarize import floor, naive, ours

    dev, out = args.device, {}
    g = torch.Generator().manual_seed(0)
    for k, rows, cols in ((1, 256, 2048), (8, 256, 2048), (32, 256, 2048), (8, 1024, 8192)):
        values = [torch.randn(rows, cols, generator=g).to(dev) for _ in range(k)]
        mask = (torch.rand(rows, cols, generator=g) < 0.7).to(dev)
        flat = torch.cat([v.reshape(-1) for v in values])
        t0 = time.perf_counter()
        ours(values, mask, compile=True)  # the first call compiles the fused kernel
        _sync(dev)
        first = time.perf_counter() - t0
        row = {"first_call_s": first}
        patterns = {"naive .item() per metric": lambda v=values, m=mask: naive(v, m),
                    "ours, fused kernel, stacked": lambda v=values, m=mask: ours(v, m, True),
                    "ours, eager, stacked": lambda v=values, m=mask: ours(v, m, False),
                    "ours, fused kernel, a value at a time":
                        lambda v=values, m=mask: alone(ours, v, m, True),
                    "ours, eager, a value at a time":
                        lambda v=values, m=mask: alone(ours, v, m, False),
                    "floor: one sum": lambda f=flat: floor(f)}
        for label, fn in patterns.items():
            row[label] = timed(fn, dev, args.repeats)
        row["kernel compiled"] = not device_module._compile_failed
        out[f"K={k} [{rows} x {cols}]"] = row
    # A PPO step's recording: 8 token-level tensors under the response mask, 276 numbers
    tensors = {n: torch.randn(256, 2048, generator=g).to(dev) for n in TENSORS}
    lengths = torch.randint(256, 2048, (256,), generator=g)
    mask = (torch.arange(2048)[None, :] < lengths[:, None]).to(dev)
    plain = {f"group{i % 9}/value_{i}": float(i) for i in range(276)}
    client = MetricClient(None, rank=0, world_size=1)

    def step_ours() -> None:
        client.stat(mask=mask, **{f"critic/{n}": x for n, x in tensors.items()})
        client.submit_metric(plain)
        encode(client.cursor.close(None, "flush"))

    def step_siirl() -> None:
        metrics = dict(plain)
        for n, x in tensors.items():
            metrics.update(siirl_masked(n, x, mask))

    out.update(compat_speed(args))
    out["PPO step, 8 tensors [256 x 2048] + 276 numbers"] = {
        "siiRL per-metric .item()": timed(step_siirl, dev, args.repeats),
        "ours: stat + submit_metric + host copy + encode": timed(step_ours, dev, args.repeats)}
    with Syncs(dev) as counted:
        step_ours()
    out["PPO step host transfers (ours)"] = {"cuda syncs": len(counted.sites),
                                              "sites": _sites([counted.sites]),
                                              "API host reads": len(counted.api)}
    return out


def _sites(per_rank: list[list[str]]) -> list[dict[str, int]]:
    """Each rank's synchronising calls, counted by the line that made them."""
    out = []
    for sites in per_rank:
        counts: dict[str, int] = {}
        for site in sites:
            counts[site] = counts.get(site, 0) + 1
        out.append(counts)
    return out


def compat_speed(args: argparse.Namespace) -> dict[str, Any]:
    """siiRL's batch on the device: our siiRL-compatible methods against siiRL's functions
    (one reduction and ``.item()`` per number), the compute of one step each."""
    from benchmarks.baselines import siirl_metrics
    from benchmarks.bench_rank import RankBody

    body = RankBody(0, 1, 0, 0, "siirl")
    batches = [{k: v.to(args.device) for k, v in b.items()} for b in body.batches]
    timing, plain = body.timing, body._plain()
    client = MetricClient(None, rank=0, world_size=1)
    turn = [0]

    def ours() -> None:
        batch = batches[turn[0] % 2]
        turn[0] += 1
        client.compute_local_data_metric(batch)
        client.compute_local_timing_metrics(batch, timing)
        client.compute_local_throughput_metrics(batch, timing, 1)
        client.submit_metric(plain)
        encode(client.cursor.close(None, "flush"))  # the flush's one host copy, encoded

    def theirs() -> None:
        batch = batches[turn[0] % 2]
        turn[0] += 1
        dicts = [siirl_metrics.compute_data_metric(batch),
                 siirl_metrics.compute_timing_metrics(batch, timing),
                 siirl_metrics.compute_throughput_metrics(batch, timing, 1), plain]
        {k: v for d in dicts for k, v in d.items()}

    row = {"siiRL's functions (.item() per number)": timed(theirs, args.device, args.repeats),
           "ours: compat methods + host copy + encode": timed(ours, args.device, args.repeats)}
    with Syncs(args.device) as counted:
        ours()
    row["ours: CUDA syncs"] = _sites([counted.sites])
    row["graphs compiled in this process"] = graphs()
    if args.profile:  # where a step's time goes: our functions and torch's, 20 steps
        import cProfile
        import io
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(20):
            ours()
        _sync(args.device)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
        row["profile of ours (20 steps)"] = "\n".join(
            line[:150] for line in text.getvalue().splitlines() if line.strip()[:1].isdigit())
    row["ours: API host reads"] = counted.api
    return {"siiRL's batch [64 x 1024], compute of a step": row}


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--parts", nargs="+", default=["exact", "speed"])
    parser.add_argument("--profile", action="store_true",
                        help="profile our siiRL-compatible step (cProfile, tottime)")
    parser.add_argument("--accelerator-path", action="store_true",
                        help="with --device cpu: the ranks take the accelerator's code path")
    parser.add_argument("--out", default=str(RESULTS / "device.json"))
    args = parser.parse_args()
    print(f"bench_device: torch {torch.__version__} on {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""),
          flush=True)
    figures: dict[str, Any] = {"device": args.device, "torch": torch.__version__}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if "exact" in args.parts:
        ray.init(include_dashboard=False, log_to_driver=True, object_store_memory=2 * 10**9)
        try:
            figures["exact"] = exactness(args)
        finally:
            ray.shutdown()
        path.write_text(json.dumps(figures, indent=2, default=str) + "\n")
        report = figures["exact"]
        for s in report["steps"]:
            print(f"step {s['step']}: {len(s['errors'])} keys off numpy {s['errors']}; "
                  f"extreme sources wrong: {s['wrong_extreme_sources']}")
            print(f"  CUDA syncs while recording, per rank: {_sites(s['syncs_recording'])}")
            print(f"  API host reads while recording, per rank: "
                  f"{[len(c) for c in s['api_recording']]}; rank 0's: {s['api_recording'][0]}")
            print(f"  CUDA syncs in flush: {_sites(s['syncs_flush'])}; API host reads: "
                  f"{[len(c) for c in s['api_flush']]}")
        print("worst relative error per key:",
              {k: f"{v:.1e}" for k, v in sorted(report["worst"].items())})
        print(f"siiRL data metrics on the device: {report['siirl']['keys']} keys, differing "
              f"from the CPU: {report['siirl']['differ_from_cpu']}")
        print(f"  CUDA syncs while recording: {_sites(report['siirl']['syncs_recording'])}")
        print(f"  API host reads while recording, per rank: "
              f"{[len(c) for c in report['siirl']['api_recording']]}; rank 0's: "
              f"{report['siirl']['api_recording'][0]}")
        print(f"  CUDA syncs in flush: {_sites(report['siirl']['syncs_flush'])}")
        print(f"host copies per rank over {args.steps + 2} flushes: {report['host_copies']}",
              flush=True)
    if "speed" in args.parts:
        figures["speed"] = speed(args)
        path.write_text(json.dumps(figures, indent=2, default=str) + "\n")
        print("| workload | pattern | ms |")
        print("|---|---|---:|")
        for workload, row in figures["speed"].items():
            for pattern, ms in row.items():
                if pattern.startswith("profile"):
                    print(f"{pattern}:\n{ms}")
                    continue
                shown = f"{ms:.3f}" if isinstance(ms, float) else ms
                print(f"| {workload} | {pattern} | {shown} |")
    return figures


if __name__ == "__main__":
    main()
