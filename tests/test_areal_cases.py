"""AReaL's own tests of its training diagnostics (areal/tests, inclusionAI/AReaL), with
each call of a case on a rank of its own: under the areal preset the merged values are
the values AReaL's tests state for one process (merged by the service's engine, without
Ray: what ranks record and how it merges is the subject)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from metricsvc.client import metrics
from tests.helpers import LocalService

T = torch.tensor


def run(calls, scope=None):
    """One step: rank i makes ``calls[i]`` (function, args, kwargs); the merged metrics, as
    the service merges them (its engine, without Ray: ``helpers.LocalService``)."""
    service = LocalService(output={"mean_suffix": "avg"})  # the areal preset's names
    clients = service.clients(len(calls))
    for client, (function, args, kwargs) in zip(clients, calls):
        with client.scope(scope) if scope else contextlib.nullcontext():
            getattr(metrics, function)(client, *args, **kwargs)
    service.close(*clients)
    return service.final()["metrics"]


def test_train_infer_masks_nonfinite_padding_and_weights_unequal_batches():
    got = run([
        ("record_logp_diagnostics", (T([-1.0, math.nan]), T([-3.0, math.inf]),
                                     T([True, False])), {}),
        ("record_logp_diagnostics", (torch.full((3,), -1.0), torch.full((3,), -1.0),
                                     torch.ones(3).bool()), {})], "ppo_actor/train_infer")
    p = "ppo_actor/train_infer/"
    assert got[p + "logp_diff/avg"] == 0.5 and got[p + "logp_diff_squared"] == 1
    assert got[p + "logp_abs_diff/max"] == 2
    assert got[p + "ratio_outside_2"] == 0.25 and got[p + "ratio_outside_10"] == 0
    assert got[p + "trainer_nll"] == 1 and got[p + "rollout_nll"] == 1.5
    assert got[p + "kl_k1"] == -0.5 and got[p + "kl_k2"] == 0.5
    assert got[p + "kl_k3"] == pytest.approx((math.exp(2.0) - 3) / 4)
    assert got[p + "nonfinite_logp_fraction"] == 0 and got[p + "n_valid_tokens"] == 4


@pytest.mark.parametrize("invalid", [math.nan, math.inf, -math.inf])
def test_an_invalid_valid_logprob_does_not_report_healthy_ratio_tails(invalid):
    got = run([  # the invalid log-prob on one rank, a healthy one on the other
        ("record_logp_diagnostics", (T([invalid]), T([-1.0]), T([True])), {}),
        ("record_logp_diagnostics", (T([-1.0]), T([-1.0]), T([True])), {})])
    assert got["nonfinite_logp_fraction"] == 0.5
    for threshold in ("1.5", "2", "3", "5", "10"):
        assert math.isnan(got[f"ratio_outside_{threshold}"])


def test_a_large_finite_gap_keeps_k3_finite_and_counts_no_overflow():
    got = run([("record_logp_diagnostics", (T([-1.0]), T([-101.0]), T([True])),
                             {})])
    assert got["nonfinite_logp_fraction"] == 0 and got["kl_k3_overflow_fraction"] == 0
    assert got["kl_k3"] == pytest.approx(math.expm1(100) - 100)


def test_ratio_tails_are_symmetric_and_fall_with_the_threshold():
    trainer = T([-5.0, -4.0, -6.0, -2.0, -8.0])
    rollout = torch.full_like(trainer, -5.0)
    got = run([("record_logp_diagnostics", (trainer[:2], rollout[:2],
                                                          torch.ones(2).bool()), {}),
                            ("record_logp_diagnostics", (trainer[2:], rollout[2:],
                                                          torch.ones(3).bool()), {})])
    tails = [got[f"ratio_outside_{t}"] for t in ("1.5", "2", "3", "5", "10")]
    assert tails == pytest.approx([0.8, 0.8, 0.4, 0.4, 0.4])


def test_kl_estimators_estimate_kl_from_rollout_to_trainer():
    q, p = T([0.75, 0.25], dtype=torch.float64), T([0.5, 0.5], dtype=torch.float64)
    tokens = T([0, 0, 0, 1])  # three of token 0 and one of token 1: exactly q
    got = run([("record_logp_diagnostics", (p[tokens[:3]].log(),
                                                          q[tokens[:3]].log(),
                                                          torch.ones(3).bool()), {}),
                            ("record_logp_diagnostics", (p[tokens[3:]].log(),
                                                          q[tokens[3:]].log(),
                                                          torch.ones(1).bool()), {})])
    expected = (q * (q.log() - p.log())).sum().item()
    assert got["kl_k1"] == pytest.approx(expected) and got["kl_k3"] == pytest.approx(expected)


def test_advantage_sign_fractions_ignore_padding():
    got = run([
        ("record_advantage_signs", (T([2.0, -1.0]), T([True, True])), {}),
        ("record_advantage_signs", (T([0.0, 9.0]), T([True, False])), {})], "ppo_actor")
    for sign in ("positive", "negative", "zero"):
        assert got[f"ppo_actor/advantage_{sign}_fraction"] == pytest.approx(1 / 3)


def test_staleness_of_unequal_batches_uses_token_weights_and_global_extrema():
    got = run([
        ("record_version_stats", (T([0, -1]), T([True, True]), 5), {"shift": False}),
        ("record_version_stats", (T([4, 4, 4, 0]), T([True, True, True, False]), 5),
         {"shift": False})], "update/version_stats")
    p = "update/version_stats/"
    assert (got[p + "sample_staleness_theta_avg"], got[p + "sample_staleness_theta_max"],
            got[p + "sample_staleness_theta_min"]) == (2, 5, 1)
    assert got[p + "sample_staleness_proximal_avg"] == 2
    assert got[p + "n_valid_generated_tokens"] == 4 and got[p + "stale_token_fraction"] == 1


def test_staleness_without_generated_tokens_has_no_fabricated_average():
    got = run([("record_version_stats", (T([-1, 0]), T([True, False]), 5),
                             {"shift": False})])
    assert got["n_valid_generated_tokens"] == 0
    assert "sample_staleness_theta_avg" not in got


@pytest.mark.parametrize("versions,mask,age,stale,future,count", [
    ([-1, -1, 4, 5], [0, 1, 1, 0], 0.5, 0.5, 0.0, 2),
    ([-1, -1, 5], [0, 1, 0], 0.0, 0.0, 0.0, 1),
    ([-1, 4, -1, -1, 5, 6], [1, 0, 0, 1, 1, 0], 0.0, 1 / 3, 1 / 3, 3),
])
def test_raw_versions_are_aligned_before_counting_checkpoint_age(
        versions, mask, age, stale, future, count):
    call = ("record_version_stats", (T([versions], dtype=torch.int32),
                                     T([mask], dtype=torch.bool), 5), {})
    got = run([call, call])  # AReaL's two microbatches, here two ranks
    assert got["sample_staleness_proximal_avg"] == pytest.approx(age)
    assert got["sample_staleness_theta_avg"] == pytest.approx(age)
    assert got["stale_token_fraction"] == pytest.approx(stale)
    assert got["future_token_fraction"] == pytest.approx(future)
    assert got["n_valid_generated_tokens"] == 2 * count
