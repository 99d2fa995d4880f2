"""Train-infer mismatch diagnostics (AReaL) from trainer and rollout log-probs."""

from __future__ import annotations

import math
from typing import Any

from metricsvc.protocol import ReduceType

THRESHOLDS = (1.5, 2.0, 3.0, 5.0, 10.0)


def record_logp_diagnostics(
    m: Any, trainer_logp: Any, rollout_logp: Any, mask: Any,
    thresholds: tuple[float, ...] = THRESHOLDS,
) -> None:
    """Record statistics of d = log p_trainer - log p_rollout over the masked tokens.

    Tokens where either log-prob is NaN/inf are left out of every statistic and
    counted in ``nonfinite_logp_fraction`` (their share of the masked tokens).
    Only compact records leave the worker; no per-token tensor is kept.
    """
    torch = __import__("torch")
    t = trainer_logp.double()
    r = rollout_logp.double()
    mask = mask.bool()
    finite = torch.isfinite(t) & torch.isfinite(r)
    valid = mask & finite
    d = t - r
    m.stat(mask=valid, logp_diff=d, logp_abs_diff=d.abs())
    ratios = {f"ratio_outside_{th:g}": (d.abs() > math.log(th)).double() for th in thresholds}
    m.stat(mask=valid, reduce=ReduceType.AVG, logp_diff_squared=d * d, trainer_nll=-t,
           rollout_nll=-r, kl_k1=-d, kl_k2=d * d / 2, kl_k3=torch.expm1(d) - d, **ratios)
    m.stat(mask=mask, reduce=ReduceType.AVG, nonfinite_logp_fraction=(~finite).double())
