"""Train-infer mismatch diagnostics (AReaL) from trainer and rollout log-probs."""

from __future__ import annotations

import math
from typing import Any

from metricsvc.client.metrics.catalogue import Catalogue
from metricsvc.core.declare import Metric
from metricsvc.core.reduce import ReduceType

THRESHOLDS = (1.5, 2.0, 3.0, 5.0, 10.0)
_AVG = ReduceType.AVG
# What record_logp_diagnostics records; d = log p_trainer - log p_rollout.
METRICS = Catalogue(
    Metric("logp_diff", ReduceType.AVG_MIN_MAX, "d over masked tokens with finite log-probs"),
    Metric("logp_abs_diff", ReduceType.AVG_MIN_MAX, "|d|"),
    Metric("logp_diff_squared", _AVG, "d^2"),
    Metric("trainer_nll", _AVG, "-log p_trainer"),
    Metric("rollout_nll", _AVG, "-log p_rollout"),
    Metric("kl_k1", _AVG, "-d"),
    Metric("kl_k2", _AVG, "d^2 / 2"),
    Metric("kl_k3", _AVG, "exp(d) - 1 - d"),
    Metric("ratio_outside_<t>", _AVG, "share of tokens with |d| > log t"),
    Metric("nonfinite_logp_fraction", _AVG, "share of masked tokens where a log-prob is NaN/inf"),
    # record_rollout_probs_diff (siiRL's compute_log_prob_diff_metrics): p = exp(log-prob)
    Metric("actor/rollout_probs_diff_max", ReduceType.MAX, "max |p_rollout - p_trainer|"),
    Metric("actor/rollout_probs_diff_mean", _AVG, "mean |p_rollout - p_trainer| per token"),
    Metric("actor/rollout_probs_diff", ReduceType.STD, "std of |p_rollout - p_trainer|"),
)


def record_logp_diagnostics(
    m: Any, trainer_logp: Any, rollout_logp: Any, mask: Any,
    thresholds: tuple[float, ...] = THRESHOLDS,
) -> None:
    """Record statistics of d = log p_trainer - log p_rollout over the masked tokens.

    Tokens where either log-prob is NaN/inf are left out of every statistic and
    counted in ``nonfinite_logp_fraction`` (their share of the masked tokens).
    Only compact records leave the rank; no per-token tensor is kept.
    """
    torch = __import__("torch")
    t = trainer_logp.double()
    r = rollout_logp.double()
    mask = mask.bool()
    finite = torch.isfinite(t) & torch.isfinite(r)
    valid = mask & finite
    d = t - r
    METRICS.stat(m, mask=valid, logp_diff=d, logp_abs_diff=d.abs())
    ratios = {f"ratio_outside_{th:g}": (d.abs() > math.log(th)).double() for th in thresholds}
    METRICS.stat(m, mask=valid, logp_diff_squared=d * d, trainer_nll=-t,
           rollout_nll=-r, kl_k1=-d, kl_k2=d * d / 2, kl_k3=torch.expm1(d) - d, **ratios)
    METRICS.stat(m, mask=mask, nonfinite_logp_fraction=(~finite).double())


def record_rollout_probs_diff(m: Any, data: Any) -> None:
    """Record siiRL's ``actor/rollout_probs_diff_{max,mean}`` and its std (``/std``) of
    |exp(rollout log-prob) - exp(old_log_probs)| over ``response_mask`` (every token without
    one). The rollout log-probs are ``rollout_log_prob`` or ``rollout_log_probs`` (siiRL has
    used both); a batch without them records nothing, as siiRL's."""
    keys = set(data.keys())
    rollout = next((k for k in ("rollout_log_prob", "rollout_log_probs") if k in keys), None)
    if rollout is None or "old_log_probs" not in keys:
        return
    diff = (data[rollout].double().exp() - data["old_log_probs"].double().exp()).abs()
    mask = data["response_mask"].bool() if "response_mask" in keys else None
    METRICS.stat(m, mask=mask, **{"actor/rollout_probs_diff_max": diff,
                                  "actor/rollout_probs_diff_mean": diff,
                                  "actor/rollout_probs_diff": diff})
