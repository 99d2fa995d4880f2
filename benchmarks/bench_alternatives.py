"""What the usual alternatives report for one step of four unequal ranks, against the
same formula on the concatenated data in one process.

    python -m benchmarks.bench_alternatives

The alternatives, as their code computes:

- *rank 0 only*: ``wandb.log(metrics)`` on rank 0, with rank 0's own metrics;
- *verl* ``reduce_metrics``: each rank's (or micro-batch's) value, then ``np.mean`` of them;
- *siiRL* ``MetricWorker``: each rank's value, then a reduction picked by substring
  (``"min"`` in the name: min; ``"max"``: max; ``"sum"``/``"total"``: sum; else mean);
- *metricsvc*: each rank records its tensor (or number); the service merges exactly.

The workload is a PPO step's shape: ranks hold 64 to 3,000 tokens (sequence packing and
dynamic batch sizes make them unequal), and longer batches have lower entropy.
Prints the relative error of each against the one-process value.
"""

from __future__ import annotations

import numpy as np

from benchmarks.baselines.siirl_style import reduce_by_substring
from metricsvc.client import MetricClient
from metricsvc.service.engine import Engine

TOKENS = (3000, 64, 700, 150)  # tokens per rank


def workload(seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    ranks = []
    for n in TOKENS:
        entropy = rng.gamma(2.0, 0.4 + 200.0 / n, size=n)  # long batches: lower entropy
        acc = (rng.random(n // 16 + 1) < 0.2 + 60.0 / n).astype(float)  # per prompt
        ranks.append({"entropy": entropy, "acc": acc, "tokens": float(n)})
    return ranks


def exact(ranks: list[dict]) -> dict[str, float]:
    entropy = np.concatenate([r["entropy"] for r in ranks])
    acc = np.concatenate([r["acc"] for r in ranks])
    return {"actor/entropy/mean": entropy.mean(), "actor/entropy/std": entropy.std(),
            "val-core/minerva_math/acc/mean": acc.mean(),
            "perf/total_num_tokens": sum(r["tokens"] for r in ranks)}


def per_rank(r: dict) -> dict[str, float]:
    return {"actor/entropy/mean": r["entropy"].mean(), "actor/entropy/std": r["entropy"].std(),
            "val-core/minerva_math/acc/mean": r["acc"].mean(),
            "perf/total_num_tokens": r["tokens"]}


def ours(ranks: list[dict]) -> dict[str, float]:
    agg = Engine(world_size=len(ranks))
    finished = []
    for rank, r in enumerate(ranks):
        c = MetricClient(None, rank=rank, world_size=len(ranks))  # never sends: no actor
        c.stat(reduce="avg", **{"actor/entropy/mean": r["entropy"],
                                "val-core/minerva_math/acc/mean": r["acc"]})
        c.stat(reduce="std", **{"actor/entropy": r["entropy"]})
        c.submit_metric({"perf/total_num_tokens": r["tokens"]})
        batch = c.buffer.take_batch(step=0, rank=rank, world_size=len(ranks), seq=1,
                                    final=True)
        finished += agg.submit(batch).finished
    return finished[0].metrics


def main() -> dict[str, dict[str, float]]:
    ranks = workload()
    truth = exact(ranks)
    locals_ = [per_rank(r) for r in ranks]
    reported = {
        "rank 0 only (wandb.log)": locals_[0],
        "verl reduce_metrics": {k: float(np.mean([m[k] for m in locals_])) for k in truth},
        "siiRL MetricWorker": {k: reduce_by_substring(k, [m[k] for m in locals_])
                               for k in truth},
        "metricsvc": ours(ranks),
    }
    heads = list(reported)
    print(f"tokens per rank: {', '.join(map(str, TOKENS))}; relative error against the "
          f"one-process value\n")
    print("| metric | one process | " + " | ".join(heads) + " |")
    print("|---|---:|" + "---:|" * len(heads))
    errors: dict[str, dict[str, float]] = {h: {} for h in heads}
    for key, value in truth.items():
        cells = []
        for head in heads:
            err = abs(reported[head][key] - value) / abs(value)
            errors[head][key] = err
            cells.append(f"{err:.0%}" if err >= 0.005 else ("exact" if err < 1e-12
                                                           else f"{err:.1e}"))
        print(f"| `{key}` | {value:.4g} | " + " | ".join(cells) + " |")
    return errors


if __name__ == "__main__":
    main()
