"""Errors a person can read (issue 37): every error the service raises reaches its caller
as metricsvc's own exception, one line naming the rule and the key or step, never Ray's
wrapper with the actor's remote traceback; a refused close is closed; and a declaration
conflict is decided the same whatever the arrival order."""

from __future__ import annotations

import warnings

import pytest
import ray

import metricsvc
import metricsvc.errors
from metricsvc.client import MetricClient
from metricsvc.core.declare import Derived
from metricsvc.errors import (
    BatchRejected,
    LateBatch,
    MetricsvcError,
    Refused,
    ServiceClosed,
    ServiceNotice,
    StepNotFinal,
    StepUnavailable,
)


def assert_readable(err: BaseException, *words: str) -> None:
    """One line, holding ``words``; no Ray wrapper, package path or terminal escape."""
    text = str(err)
    assert isinstance(err, MetricsvcError), type(err)
    assert "\n" not in text and "ray::" not in text and "\x1b" not in text, text
    assert "metricsvc/" not in text and ".py" not in text, text
    assert type(err) is getattr(metricsvc.errors, type(err).__name__), type(err)  # our own
    for word in words:
        assert word in text, (word, text)


def test_every_error_a_rank_and_a_driver_meet_is_one_line_of_our_own(make_worker):
    handle, cfg = make_worker(world_size=1, limits={"keep_results": 2})
    client = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    for step in range(4):
        client.submit_metric({"x": float(step)})
        client.wait_submit(step=step, timeout_s=30)

    rerun = MetricClient(None, rank=0, world_size=1, name=cfg.name, start_step=1)
    rerun.submit_metric({"x": 10.0})
    with pytest.raises(BatchRejected) as refused:  # a rerun without rewind: wait_submit
        rerun.wait_submit(step=1, timeout_s=30)
    assert_readable(refused.value, "step 1", "rewind(to_step=")
    assert "ray::" in str(refused.value.__cause__)  # the remote traceback stays at hand
    rerun.submit_metric({"x": 20.0})
    rerun.flush(step=2)  # the refused close was closed: this is step 2, not a mismatch
    with pytest.raises(BatchRejected) as later:  # flush's answer, raised later
        rerun.wait_acks(timeout_s=30)
    assert_readable(later.value, "step 2", "rewind(to_step=")

    with pytest.raises(StepNotFinal) as not_final:
        client.wait_final_res(step=9, timeout_s=0.1)
    assert_readable(not_final.value, "step 9")
    with pytest.raises(StepNotFinal) as not_final:
        metricsvc.final_result(handle, 9, 0.1)
    assert_readable(not_final.value, "step 9")
    with pytest.raises(StepUnavailable) as evicted:  # keep_results=2: step 0 is gone
        metricsvc.final_result(handle, 0, 5)
    assert_readable(evicted.value, "step 0", "keep_results")
    assert metricsvc.final_result(handle, 3, 5) == {"x": 3.0}
    assert metricsvc.final_result(handle, 3, 5, meta=True)["step"] == 3
    with pytest.raises(Refused) as bad:
        metricsvc.rewind(handle, "3")
    assert_readable(bad.value, "rewind(to_step=")
    assert metricsvc.service_health(handle)["rejected_batches"] == 2

    ray.get(handle.close.remote())
    client.submit_metric({"x": 4.0})
    with pytest.raises(ServiceClosed) as closed:
        client.wait_submit(step=4, timeout_s=30)
    assert_readable(closed.value, "closed", "submit")
    client.submit_metric({"x": 5.0})  # the refused close was closed: step 5, refused too
    with pytest.raises(ServiceClosed):
        client.wait_submit(step=5, timeout_s=30)


def test_a_late_batch_warns_in_one_line(make_worker):
    handle, cfg = make_worker(world_size=2, straggler_timeout_s=0.3)
    early, late = (MetricClient(None, rank=r, world_size=2, name=cfg.name) for r in range(2))
    early.submit_metric({"x": 1.0})
    early.wait_submit(step=0, timeout_s=30)
    assert metricsvc.final_result(handle, 0, 30, meta=True)["meta"]["partial"]
    late.submit_metric({"x": 2.0})
    with pytest.warns(LateBatch) as seen:
        late.wait_submit(step=0, timeout_s=30)
    assert_readable(seen[0].message, "step 0")


@pytest.mark.parametrize("first", [0, 1], ids=["rank_0_first", "rank_1_first"])
def test_a_declaration_conflict_publishes_the_same_value_at_once_in_both_orders(
        make_worker, first):
    handle, cfg = make_worker(world_size=2, straggler_timeout_s=60)
    clients = [MetricClient(None, rank=r, world_size=2, name=cfg.name) for r in range(2)]
    clients[0].declare(Derived("d", "sum(x) / 2", {"x": "x"}))
    clients[1].declare(Derived("d", "sum(x) * 100", {"x": "x"}))
    heard: list[str] = []
    for step in range(2):
        for rank in (first, 1 - first):
            clients[rank].submit_metric({"x": float(rank + 1)})
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                clients[rank].wait_submit(step=step, timeout_s=30)
            heard += [f"{rank}: {w.message}" for w in caught
                      if issubclass(w.category, ServiceNotice)]
        # at once: no straggler timeout (60 s) waited out; rank 0's formula, both ranks' data
        assert metricsvc.final_result(handle, step, 10) == {"x": 1.5, "d": 1.5}
    assert heard and all(h.startswith("1: ") for h in heard), heard
    assert any("yours is ignored and your data merged" in h for h in heard), heard
    assert metricsvc.service_health(handle)["rejected_batches"] == 0
