"""Validation metrics with bootstrap best/worst/majority-of-k (siiRL / verl names).

A prompt group (all samples of one prompt) lives on one rank. Each prompt's
metrics are computed there; across ranks they merge as a mean over prompt
groups, weighted by the number of groups (not by rank). The bootstrap RNG is
seeded per prompt from a stable hash of the prompt and a global seed, so the
result does not depend on how prompts are split across ranks.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from metricsvc.client.metrics.catalogue import Catalogue
from metricsvc.core.declare import Metric
from metricsvc.core.reduce import ReduceType

N_BOOTSTRAP = 1000


def _rng(seed: int, *parts: str) -> np.random.Generator:
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return np.random.default_rng([seed, int.from_bytes(digest, "little")])


def _subset_sizes(n: int) -> list[int]:
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def _majority(values: np.ndarray, preds: Sequence[Any]) -> Any:
    """Value of the first sample whose prediction got the most votes."""
    votes = Counter(preds)
    winner = max(votes, key=votes.__getitem__)
    return values[next(i for i, p in enumerate(preds) if p == winner)]


def prompt_metrics(
    values: Sequence[float], preds: Sequence[Any] | None, rng: np.random.Generator
) -> dict[str, float]:
    """Return mean@N, std@N and bootstrap best/worst/maj@k of one prompt's N samples."""
    vals = np.asarray(values, dtype=np.float64)
    n = len(vals)
    out = {f"mean@{n}": float(vals.mean())}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(vals.std())
    for k in _subset_sizes(n):
        idx = rng.integers(0, n, size=(N_BOOTSTRAP, k))
        picks = vals[idx]
        best, worst = picks.max(axis=1), picks.min(axis=1)
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = float(best.mean()), float(best.std())
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = float(worst.mean()), float(worst.std())
        if preds is not None:
            maj = np.array([_majority(vals[row], [preds[i] for i in row]) for row in idx],
                           dtype=np.float64)
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = float(maj.mean()), float(maj.std())
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) \
        or isinstance(x, (bool, np.bool_))


def validation_metrics(
    data_sources: Sequence[str],
    sample_inputs: Sequence[str],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
) -> dict[str, list[float]]:
    """Return ``{exported key: [one value per prompt group]}`` for this rank's samples."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, (source, prompt) in enumerate(zip(data_sources, sample_inputs)):
        groups[(str(source), str(prompt))].append(i)
    per_key: dict[str, list[float]] = defaultdict(list)
    numeric = [v for v, vals in infos_dict.items() if len(vals) and _is_number(vals[0])]
    preds = infos_dict.get("pred")
    by_source: dict[str, list[tuple[str, str, dict[str, float]]]] = defaultdict(list)
    for (source, prompt), idx in groups.items():
        group_preds = None if preds is None else [preds[i] for i in idx]
        for var in numeric:
            values = [float(infos_dict[var][i]) for i in idx]
            metrics = prompt_metrics(values, group_preds, _rng(seed, source, prompt, var))
            by_source[source].append((var, prompt, metrics))
    for source, entries in by_source.items():
        variables = {var for var, _, _ in entries}
        core = "acc" if "acc" in variables else "reward"
        for var, _, metrics in entries:
            n_max = max(int(name.split("@")[1].split("/")[0]) for name in metrics)
            for name, value in metrics.items():
                is_core = (var == core and name.startswith(("mean", "maj", "best"))
                           and f"@{n_max}" in name)
                section = "val-core" if is_core else "val-aux"
                per_key[f"{section}/{source}/{var}/{name}"].append(value)
    return dict(per_key)


METRICS = Catalogue(  # what record_validation_metrics records (tested)
    *(Metric(f"{section}/<source>/<var>/<stat>{moment}", ReduceType.AVG,
             "per prompt group, averaged over groups (bootstrapped @k statistics)")
      for section in ("val-core", "val-aux") for moment in ("", "/<moment>")),
    Metric("val/test_score/<source>", ReduceType.AVG, "score of the source's samples"),
    Metric("val-aux/num_turns", ReduceType.AVG_MIN_MAX, "turns per sample"),
)


def record_validation_metrics(
    m: Any,
    data_sources: Sequence[str],
    sample_inputs: Sequence[str],
    infos_dict: Mapping[str, Sequence[Any]],
    sample_turns: Sequence[int] | None = None,
    seed: int = 42,
) -> None:
    """Record validation metrics: per-prompt results as means over prompt groups,
    ``val/test_score/<source>`` over samples, ``val-aux/num_turns/*`` when turns are given."""
    n = len(data_sources)
    if len(sample_inputs) != n or any(len(v) != n for v in infos_dict.values()):
        lengths = {k: len(v) for k, v in infos_dict.items()}
        raise ValueError(
            f"validation inputs disagree in length: {n} data sources, "
            f"{len(sample_inputs)} inputs, infos_dict lengths {lengths}"
        )
    for key, per_prompt in validation_metrics(data_sources, sample_inputs, infos_dict,
                                              seed).items():
        METRICS.stat(m, **{key: np.asarray(per_prompt)})
    score_var = next((v for v in ("reward", "score", "acc") if v in infos_dict), None)
    if score_var is not None:
        scores = np.asarray(infos_dict[score_var], dtype=np.float64)
        sources = np.asarray([str(s) for s in data_sources])
        for source in sorted(set(sources.tolist())):
            METRICS.stat(m, **{f"val/test_score/{source}": scores[sources == source]})
    if sample_turns is not None and len(sample_turns):
        METRICS.stat(m, **{"val-aux/num_turns": np.asarray(sample_turns, dtype=np.float64)})
