"""Train-infer mismatch diagnostics (AReaL) from trainer and rollout log-probs."""

from __future__ import annotations

import math
from typing import Any

from metricsvc.client.metrics.catalogue import Catalogue
from metricsvc.core.declare import Metric
from metricsvc.core.reduce import ReduceType

THRESHOLDS = (1.5, 2.0, 3.0, 5.0, 10.0)
_AVG = ReduceType.AVG
# What record_logp_diagnostics records (AReaL's ppo_actor/train_infer/*, word for word);
# d = log p_trainer - log p_rollout over the generation mask.
METRICS = Catalogue(
    Metric("n_valid_tokens", ReduceType.SUM, "masked tokens", "tokens"),
    Metric("logp_diff", ReduceType.AVG_MIN_MAX, "d (a token whose log-prob is NaN/inf is "
           "counted in meta.nonfinite and left out, or NaN with output.nonfinite: propagate)"),
    Metric("logp_abs_diff", ReduceType.AVG_MIN_MAX, "|d|"),
    Metric("logp_diff_squared", _AVG, "d^2"),
    Metric("trainer_nll", _AVG, "-log p_trainer"),
    Metric("rollout_nll", _AVG, "-log p_rollout"),
    Metric("kl_k1", _AVG, "-d"),
    Metric("kl_k2", _AVG, "d^2 / 2"),
    Metric("kl_k3", _AVG, "exp(d) - 1 - d"),
    Metric("kl_k3_overflow_fraction", _AVG,
           "share of masked tokens with finite log-probs whose exp(d) - 1 - d passes float64"),
    Metric("ratio_outside_<t>", ReduceType.STRICT_AVG,
           "share of tokens with |d| > log t; NaN once a masked token's log-prob is NaN/inf"),
    Metric("nonfinite_logp_fraction", _AVG, "share of masked tokens where a log-prob is NaN/inf"),
    # record_advantage_signs (AReaL's ppo_actor/advantage_*_fraction): token occupancy
    Metric("advantage_positive_fraction", _AVG, "share of loss-masked tokens with advantage > 0"),
    Metric("advantage_negative_fraction", _AVG, "share of loss-masked tokens with advantage < 0"),
    Metric("advantage_zero_fraction", _AVG, "share of loss-masked tokens with advantage == 0"),
    # record_version_stats (AReaL's ppo_actor/update/version_stats/*): a token's age is the
    # last published checkpoint's version minus the version that generated it
    Metric("n_valid_generated_tokens", ReduceType.SUM,
           "masked generated tokens (version >= 0)", "tokens"),
    *(Metric(f"sample_staleness_{of}_{stat}", kind, f"{what} token age, in versions")
      for of in ("theta", "proximal") for stat, kind, what in (
          ("avg", _AVG, "token-weighted mean"), ("min", ReduceType.MIN, "smallest"),
          ("max", ReduceType.MAX, "largest"))),
    Metric("stale_token_fraction", _AVG, "share of generated tokens older than the checkpoint"),
    Metric("future_token_fraction", _AVG, "share of generated tokens newer than the checkpoint"),
    # record_rollout_probs_diff (siiRL's compute_log_prob_diff_metrics): p = exp(log-prob)
    Metric("actor/rollout_probs_diff_max", ReduceType.MAX, "max |p_rollout - p_trainer|"),
    Metric("actor/rollout_probs_diff_mean", _AVG, "mean |p_rollout - p_trainer| per token"),
    Metric("actor/rollout_probs_diff", ReduceType.STD, "std of |p_rollout - p_trainer|"),
)


def record_logp_diagnostics(
    m: Any, trainer_logp: Any, rollout_logp: Any, mask: Any,
    thresholds: tuple[float, ...] = THRESHOLDS,
) -> None:
    """Record AReaL's train-infer diagnostics of d = log p_trainer - log p_rollout over the
    masked (generated) tokens, as AReaL's ``log_train_inference_stats`` defines them.

    A masked token whose log-prob is NaN/inf is counted in ``nonfinite_logp_fraction``
    and makes every ``ratio_outside_<t>`` NaN (never a healthy-looking share); in the
    other statistics its value is counted in the step's ``meta.nonfinite`` and left out
    (exported as NaN under ``output.nonfinite: propagate``). ``kl_k3_overflow_fraction``:
    finite log-probs whose ``expm1(d) - d`` passes float64. Only compact records leave the
    rank; no per-token tensor is kept.

    Raises:
        ValueError: the three tensors' shapes differ.
    """
    torch = __import__("torch")
    if not trainer_logp.shape == rollout_logp.shape == mask.shape:
        raise ValueError(f"record_logp_diagnostics: trainer_logp {tuple(trainer_logp.shape)}, "
                         f"rollout_logp {tuple(rollout_logp.shape)} and mask "
                         f"{tuple(mask.shape)} must match")
    t = trainer_logp.detach().double()
    r = rollout_logp.detach().double()
    mask = mask.bool()
    finite = torch.isfinite(t) & torch.isfinite(r)
    d = t - r
    k3 = torch.expm1(d) - d
    nan = torch.full_like(d, math.nan)
    tails = {f"ratio_outside_{th:g}": torch.where(finite, (d.abs() > math.log(th)).double(), nan)
             for th in thresholds}
    METRICS.stat(m, mask=mask, n_valid_tokens=torch.ones_like(d), logp_diff=d,
                 logp_abs_diff=d.abs(), logp_diff_squared=d * d, trainer_nll=-t,
                 rollout_nll=-r, kl_k1=-d, kl_k2=d * d / 2, kl_k3=k3,
                 kl_k3_overflow_fraction=(~torch.isfinite(k3) & finite).double(),
                 nonfinite_logp_fraction=(~finite).double(), **tails)


def record_advantage_signs(m: Any, advantages: Any, loss_mask: Any) -> None:
    """Record AReaL's ``advantage_{positive,negative,zero}_fraction`` (under the caller's
    scope, ``ppo_actor`` in AReaL): the share of loss-masked tokens whose shaped advantage
    is above, below or at zero, over every rank's tokens. Token occupancy, not task success
    or gradient signs; pass the advantages and mask before any rejection filtering, as
    AReaL does. A NaN advantage is in none of the three."""
    METRICS.stat(m, mask=loss_mask.bool(),
                 advantage_positive_fraction=(advantages > 0).double(),
                 advantage_negative_fraction=(advantages < 0).double(),
                 advantage_zero_fraction=(advantages == 0).double())


def record_version_stats(m: Any, versions: Any, mask: Any, current_version: int,
                         shift: bool = True) -> None:
    """Record AReaL's version statistics (under the caller's scope, ``update/version_stats``
    within ``ppo_actor`` in AReaL) of the masked generated tokens (version >= 0; a prompt
    token's is -1): ``sample_staleness_{theta,proximal}_{avg,min,max}`` (the checkpoint
    ``current_version`` minus the token's version, both names AReaL's legacy pair of the
    same age), ``stale_token_fraction`` and ``future_token_fraction`` (older, newer than
    it) and ``n_valid_generated_tokens``; token-weighted means and global extrema over
    every rank, empty populations omitted. ``shift``: ``versions`` are the raw rollout
    versions, moved to their prediction positions (each position gets the next token's),
    as AReaL does for the loss mask's positions; ``shift=False`` for aligned ones."""
    torch = __import__("torch")
    v = versions.detach()
    if shift:
        v = torch.cat([v[..., 1:], torch.full_like(v[..., :1], -1)], dim=-1)
    generated = mask.bool() & (v >= 0)
    age = (current_version - v).double()
    METRICS.stat(m, mask=generated, n_valid_generated_tokens=torch.ones_like(age),
                 stale_token_fraction=(v < current_version).double(),
                 future_token_fraction=(v > current_version).double(),
                 **{f"sample_staleness_{of}_{stat}": age for of in ("theta", "proximal")
                    for stat in ("avg", "min", "max")})


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
