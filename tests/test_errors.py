"""Errors a caller can branch on: one module, a small hierarchy by meaning, the resend rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import ray

import metricsvc
from metricsvc import client, errors
from metricsvc.client import MetricClient

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("error", "meaning", "builtin"), [
    (errors.BatchRejected, errors.Refused, ValueError),
    (errors.StepMismatch, errors.Refused, ValueError),
    (errors.ServiceUnavailable, errors.Unavailable, RuntimeError),
    (errors.StepUnavailable, errors.Unavailable, LookupError),
    (errors.StepNotFinal, errors.NotFinal, TimeoutError),
    (errors.StepAlreadyFinal, errors.Late, ValueError),
    (errors.LateBatch, errors.Late, UserWarning),
])
def test_each_error_is_caught_by_its_meaning_and_by_the_builtin_callers_know(error, meaning,
                                                                             builtin):
    assert issubclass(error, meaning) and issubclass(error, errors.MetricsvcError)
    assert issubclass(error, builtin)
    # one object wherever a user imports it from
    assert getattr(metricsvc, error.__name__) is error
    assert getattr(client, error.__name__, error) is error


def test_no_error_class_is_defined_outside_the_errors_module():
    """Internal control flow (the formula evaluator's Undefined, the CLI's one-line error)
    stays where it is used; every error a user may catch lives in metricsvc/errors.py."""
    internal = {"CliError", "Undefined", "NotReal"}
    found = []
    for path in (ROOT / "metricsvc").rglob("*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in internal:
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if any(b.endswith(("Error", "Exception", "Warning")) or b in {
                        "BatchRejected", "Refused", "Late"} for b in bases):
                    found.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not found, found


def test_a_refusal_by_the_actor_reaches_the_rank_as_refused_and_is_never_resent(make_worker):
    """The resend rule reads the hierarchy: the actor's BatchRejected arrives through Ray as
    a Refused (so the batch leaves the outbox); anything else is kept for a resend."""
    handle, cfg = make_worker(world_size=2)
    c = MetricClient(None, rank=0, world_size=2, name=cfg.name)
    c.submit_metric({"x": 1.0})
    c.wait_submit()
    liar = MetricClient(None, rank=0, world_size=2, name=cfg.name)  # another "rank 0"
    liar.submit_metric({"x": 2.0})
    with pytest.raises(errors.Refused) as err:
        liar.wait_submit(step=0)
    assert isinstance(err.value, errors.BatchRejected)
    assert errors.is_refusal(err.value) and "conflict" in str(err.value)
    assert liar.in_flight == 0 and len(liar.sender.outbox) == 0  # dropped: resending cannot help
    assert not errors.is_refusal(ray.exceptions.GetTimeoutError("slow"))
    assert not errors.is_refusal(ValueError("Failed to look up actor"))  # Ray's own
