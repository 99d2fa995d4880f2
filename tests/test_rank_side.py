"""Never a silently wrong number on the rank side: mixed shapes, step identity, one exported
name per source. Each case ends in the right value or a clear error naming the key/step."""

import json
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from metricsvc.client import MetricClient, StepAlreadyFinal, StepMismatch
from metricsvc.core.records import summarize_array
from metricsvc.storage.journal import read_journal
from tests.helpers import LocalService, rows_of


def client(cfg, rank=0, world_size=1, **kwargs):
    return MetricClient(None, rank=rank, world_size=world_size, name=cfg.name, **kwargs)


# -- 1. values of different shapes in one call ---------------------------------------------
def test_every_value_of_one_call_is_summarised_on_its_own_shape_dtype_and_kind():
    values = {"a": torch.ones(4), "b": torch.full((1,), 10.0), "c": torch.tensor(3.0),
              "d": np.arange(3.0), "e": 2.5, "f": torch.arange(6).reshape(2, 3),
              "g": torch.ones(5, dtype=torch.float16), "h": torch.tensor([True, False, True]),
              "i": torch.tensor([0.5, -1.25, 3.0], dtype=torch.float64)}
    rows = rows_of(values)
    for key, value in values.items():
        data = value.double().numpy() if isinstance(value, torch.Tensor) else value
        expected = summarize_array(np.asarray(data, dtype=np.float64))
        assert np.asarray(rows[key]).tolist() == expected.tolist(), key


def test_a_value_that_does_not_fit_its_mask_is_refused_naming_key_and_shapes():
    with pytest.raises(ValueError, match=r"expected mask of shape \(1,\) for key 'b', got \(4,\)"):
        rows_of({"a": torch.ones(4), "b": torch.ones(1)},
                       torch.ones(4, dtype=torch.bool))


def test_areal_denominators_of_two_shapes_in_one_call_count_exactly():
    service = LocalService()
    (c,) = service.clients(1)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    c.denominator(n_seqs=torch.ones(2, dtype=torch.bool), n_tokens=mask)
    c.stat(denominator="n_tokens", loss=torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]]))
    service.close(c)
    assert service.final()["metrics"] == {
        "n_seqs": 2.0, "n_tokens": 3.0, "loss/mean": 2.0, "loss/min": 1.0, "loss/max": 3.0}


# -- 2. step identity ----------------------------------------------------------------------
def test_a_failed_step_is_never_merged_into_the_step_the_caller_names(make_worker):
    handle, cfg = make_worker(world_size=2, straggler_timeout_s=0.5)
    lost, other = client(cfg, 0, 2), client(cfg, 1, 2)
    for step in range(2):
        other.submit_metric({"x": 1.0})
        other.wait_submit(step=step)
    lost.submit_metric({"x": 100.0})  # step 0: the training step raises before wait_submit
    lost.submit_metric({"y": 1.0})  # step 1 records, the old records still pending
    with pytest.raises(StepMismatch, match="wait_submit\\(step=1\\) refused: this client "
                                           "holds records of step 0 \\(its start_step\\), "
                                           "which was never closed.*dropped \\(2 keys"):
        lost.wait_submit(step=1)
    assert lost.rpc_count == 0  # nothing was sent
    assert lost.discard() == 0  # the refused close dropped them
    lost.submit_metric({"x": 3.0})
    lost.wait_submit(step=1)  # nothing pending: the client moves to the named step
    assert ray.get(handle.wait_final.remote(0, 20))["meta"]["missing_ranks"] == [0]
    assert ray.get(handle.wait_final_res.remote(0, 20)) == {"x": 1.0}
    assert ray.get(handle.wait_final_res.remote(1, 20)) == {"x": 2.0}
    with pytest.raises(StepMismatch, match=r"already closed step 1 \(steps only go forward\)"):
        lost.wait_submit(step=1)


def test_the_readme_pattern_discards_a_failed_step_and_keeps_the_next_exact():
    service = LocalService(world_size=1)
    (c,) = service.clients(1)
    for step in range(3):
        try:
            c.stat(x=np.array([float(step), 10.0 * step]))
            if step == 1:
                raise RuntimeError("one bad batch")
            service.close(c, step=step)  # wait_submit(step=step)
        except RuntimeError:
            c.discard()
    assert sorted(service.results) == [0, 2]
    assert service.final(2)["metrics"] == {"x/mean": 11.0, "x/min": 2.0, "x/max": 20.0}


def test_a_rank_that_joins_late_is_told_which_step_is_open(make_worker):
    handle, cfg = make_worker(world_size=2, straggler_timeout_s=0.3)
    early = client(cfg, 0, 2)
    for step in range(3):
        early.submit_metric({"x": 1.0})
        early.wait_submit()
        ray.get(handle.wait_final.remote(step, 20))  # published without rank 1
    late = client(cfg, 1, 2)  # start_step=0 while the job is at step 3
    late.submit_metric({"x": 5.0})
    with pytest.raises(StepAlreadyFinal, match="step 0 is already final .* open step is 3"):
        late.wait_submit()
    assert late.step == 3
    late.submit_metric({"x": 5.0})
    early.submit_metric({"x": 1.0})
    late.wait_submit()
    early.wait_submit()
    assert ray.get(handle.wait_final_res.remote(3, 20)) == {"x": 3.0}
    assert ray.get(handle.health.remote())["late_by_rank"] == {1: 1}


# -- 3. one exported name, one source ------------------------------------------------------
def test_a_plain_key_that_another_key_of_the_step_exports_is_refused():
    service = LocalService()
    (c,) = service.clients(1)
    c.stat(loss=torch.tensor([1.0, 3.0]))
    with pytest.raises(ValueError, match="key 'loss/mean' .* would export 'loss/mean', which key "
                                         "'loss' already exports in step 0"):
        c.submit_metric({"loss/mean": 100.0})
    with pytest.raises(ValueError, match="'eval/pass_1', which key 'eval/pass@1'"):
        c.submit_metric({"eval/pass@1": 0.5, "eval/pass_1": 0.7})  # one TensorBoard tag
    service.close(c)
    assert service.final()["metrics"] == {"loss/mean": 2.0, "loss/min": 1.0, "loss/max": 3.0}


def test_a_collision_only_the_service_sees_is_reported_never_overwritten():
    service = LocalService(world_size=2)
    a, b = service.clients(2)
    a.stat(loss=torch.tensor([1.0, 3.0]))
    b.submit_metric({"loss/mean": 100.0})
    service.close(a, b)
    result = service.final()
    assert result["meta"]["collisions"] == {"loss/mean": ["loss", "loss/mean"]}
    assert result["metrics"]["loss/mean"] == 2.0  # the first source kept, not overwritten
    assert service.engine.health()["steps_with_collisions"] == 1


@pytest.mark.parametrize(("call", "message"), [
    (lambda c: c.stat(torch.ones(3)), "stat\\(\\) got no values .* taken as the mask"),
    (lambda c: c.stat(), "stat\\(\\) got no values"),
    (lambda c: c.stat(**{"text": torch.ones(2)}), "got no values.*never keys: 'text' went to"),
    (lambda c: c.stat(**{"top": torch.ones(2)}), "got no values.*never keys: 'top' went to"),
    (lambda c: c.stat(**{"reduce": torch.ones(2)}), "never keys: 'reduce' went to"),
    (lambda c: c.stat(ids=[1, 2], reduce_type="sum"), "never keys: 'reduce_type', 'ids' went to"),
    (lambda c: c.scalar(), "scalar\\(\\) got no values"),
    (lambda c: c.denominator(), "denominator\\(\\) got no masks"),
    (lambda c: c.stat(**{"a/__foo/b": torch.ones(2)}), "key 'a/__foo/b': a path segment"),
    (lambda c: c.submit_metric({"__x": 1.0}), "key '__x': a path segment"),
])
def test_a_call_that_would_record_nothing_or_a_reserved_name_raises(ray_cluster, call, message):
    c = MetricClient(object(), rank=0, world_size=1)  # never flushed: no service needed
    with pytest.raises((TypeError, ValueError), match=message):
        call(c)
    assert c.pending_keys() == [] and c.rpc_count == 0


def test_a_user_key_ending_in_double_underscore_count_reaches_every_output(make_worker):
    handle, cfg = make_worker(sinks={"console": None, "jsonl": {}, "tensorboard": {}})
    c = client(cfg)
    c.submit_metric({"rollout/reward__count": 3.0})
    c.wait_submit()
    assert ray.get(handle.wait_final_res.remote(0, 10)) == {"rollout/reward__count": 3.0}
    health = ray.get(handle.close.remote())
    run = Path(health["run_dir"])
    assert read_journal(run / "metrics.jsonl")[0]["metrics"] == {"rollout/reward__count": 3.0}
    assert health["sinks"]["tensorboard"]["written"] == 1
    assert json.loads((run / "run.json").read_text())["service"] == cfg.name


def test_a_derived_metric_owns_its_name_and_its_sink_tag(ray_cluster):
    from metricsvc.client import Derived

    c = MetricClient(object(), rank=0, world_size=1)  # never flushed: no service needed
    c.declare(Derived("eval/acc rate", "mean(x)", {"x": "eval/__acc"}))
    c.declare(Derived("eval/acc rate", "mean(x)", {"x": "eval/__acc"}))  # again: harmless
    with pytest.raises(ValueError, match="'eval/acc rate' is declared with formula"):
        c.declare(Derived("eval/acc rate", "max(x)", {"x": "eval/__acc"}))
    with pytest.raises(ValueError, match="would export 'eval/acc_rate', which the derived "
                                         "metric 'eval/acc rate'"):
        c.submit_metric({"eval/acc_rate": 1.0})  # the same sink tag: one would be lost
    with pytest.raises(ValueError, match="derived metric 'eval/acc_rate' would export "
                                         "'eval/acc_rate', which derived metric 'eval/acc rate'"):
        c.declare(Derived("eval/acc_rate", "mean(x)", {"x": "eval/__acc"}))
    c.stat(**{"eval/__acc": torch.ones(3)})  # the input: read by the declared metric
    with pytest.raises(ValueError, match="key 'eval/__other': a path segment"):
        c.stat(**{"eval/__other": torch.ones(3)})
    assert c.pending_keys() == ["eval/__acc"] and c.rpc_count == 0
