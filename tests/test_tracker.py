"""The AReaL-style tracker API on MetricClient: end to end through a real MetricWorker where
the actor is the subject (the calls' meaning as a user sees it, a refusal reaching the rank,
one host copy per flush), merged by the service's engine without Ray (``LocalService``)
where what ranks record and how it merges is."""

import asyncio
import math
import time

import numpy as np
import pytest
import ray
import torch

from metricsvc import ReduceType as ServiceReduceType
from metricsvc.client import MetricClient, ReduceType
from metricsvc.client.tensors import accelerator_path_on_cpu
from tests.helpers import LocalService
from tests.synccount import HostTransferCounter


def final(handle, step=0):
    return ray.get(handle.wait_final.remote(step, 20))


def clients_for(cfg, world_size):
    return [MetricClient(None, rank=r, world_size=world_size, name=cfg.name)
            for r in range(world_size)]


def test_reduce_type_is_one_enum_for_clients_and_service():
    assert ReduceType is ServiceReduceType


def test_areal_calls_move_over_with_renames_only(make_worker):
    handle, cfg = make_worker(output={"mean_suffix": "avg"})
    (c,) = clients_for(cfg, 1)
    valid = torch.tensor([[True, True, False], [True, False, False]])
    loss = torch.tensor([[1.0, 2.0, 99.0], [3.0, -5.0, 7.0]])
    c.scalar(lr=1e-5)
    with c.scope("ppo_actor"):
        with c.scope("update"):
            c.denominator(valid=valid)
            c.stat(loss=loss, denominator="valid")
            c.stat("valid", ReduceType.SUM, loss_sum=loss)  # AReaL's positional form
            c.stat(denominator="valid", reduce_type=ReduceType.MAX, peak=loss)
    c.wait_submit()
    assert final(handle)["metrics"] == {
        "lr": 1e-5,
        "ppo_actor/update/valid": 3.0,  # a denominator exports its count
        "ppo_actor/update/loss/avg": 2.0,
        "ppo_actor/update/loss/min": 1.0,
        "ppo_actor/update/loss/max": 3.0,
        "ppo_actor/update/loss_sum": 6.0,
        "ppo_actor/update/peak": 3.0,
    }


def test_denominator_is_found_from_inner_scopes_and_forgotten_after_the_step():
    service = LocalService()
    (c,) = service.clients(1)
    c.denominator(valid=np.array([True, False]))
    with c.scope("inner"):
        c.stat(x=np.array([4.0, 100.0]), denominator="valid")
    service.close(c)
    assert service.final()["metrics"]["inner/x/mean"] == 4.0
    with pytest.raises(ValueError, match="unknown denominator 'valid' for key 'x'"):
        c.stat(x=np.array([1.0, 2.0]), denominator="valid")


def test_scope_works_as_a_decorator_and_named_trackers_prefix_keys():
    service = LocalService()
    (c,) = service.clients(1)

    @c.scope("eval")
    def evaluate():
        c.scalar(acc=0.5)

    evaluate()
    rollout = c.get("rollout")
    assert c.get("rollout") is rollout
    rollout.scalar(reward=0.8)
    with rollout.scope("env"):
        rollout.stat(steps=np.array([3.0, 5.0]))
    rollout.get("inner").scalar(x=1.0)
    service.close(c)
    assert service.final()["metrics"] == {
        "eval/acc": 0.5, "rollout/reward": 0.8, "rollout/env/steps/mean": 4.0,
        "rollout/env/steps/min": 3.0, "rollout/env/steps/max": 5.0, "rollout/inner/x": 1.0,
    }


def test_concurrent_coroutines_never_mislabel_each_others_keys():
    service = LocalService()
    (c,) = service.clients(1)
    rollout = c.get("rollout")

    async def episode(name, value):
        with rollout.scope(name):
            await asyncio.sleep(0)  # the other coroutine enters its scope meanwhile
            await asyncio.sleep(0.01 if name == "a" else 0)
            rollout.scalar(reward=value)

    async def both():
        await asyncio.gather(episode("a", 1.0), episode("b", 2.0))

    asyncio.run(both())
    service.close(c)
    assert service.final()["metrics"] == {"rollout/a/reward": 1.0, "rollout/b/reward": 2.0}


def test_record_timing_takes_the_slowest_rank():
    service = LocalService()
    fast, slow = service.clients(2)
    with slow.record_timing("gen"):
        time.sleep(0.05)
    with fast.record_timing("gen"):
        pass
    service.close(fast, slow)
    assert service.final()["metrics"]["timing_s/gen"] >= 0.05


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda c: c.stat(x=torch.ones(3), denominator="nope"), ValueError,
         "unknown denominator 'nope' for key 'x'"),
        (lambda c: c.denominator(valid=torch.ones(3)), TypeError,
         "denominator 'valid' must be a bool tensor or array, got torch.float32"),
        (lambda c: c.denominator(valid=[True, False]), TypeError,
         "denominator 'valid' must be a bool tensor or array, got list"),
        (lambda c: (c.denominator(v=torch.ones(3, dtype=torch.bool)),
                    c.stat(x=torch.ones(4), denominator="v")), ValueError,
         r"expected mask of shape \(4,\) for key 'x', got \(3,\)"),
        (lambda c: (c.stat(x=torch.ones(2)), c.stat(reduce=ReduceType.SUM, x=torch.ones(2))),
         ValueError, "key 'x' was recorded as AVG_MIN_MAX in step 0; recording it as SUM"),
        (lambda c: c.stat(ReduceType.SUM, x=torch.ones(2)), TypeError,
         "first argument is a mask or a denominator name; pass the kind as reduce="),
        (lambda c: c.scalar(lr=torch.ones(2)), ValueError,
         "scalar 'lr' must be a single number, got 2 elements"),
        (lambda c: c.stat(mask=torch.ones(2, dtype=torch.bool), denominator="v",
                          x=torch.ones(2)), ValueError, "either mask= or denominator="),
    ],
)
def test_tracker_errors_name_the_key(ray_cluster, call, error, message):
    c = MetricClient(None, rank=0, world_size=1, name="never-contacted")
    with pytest.raises(error, match=message):
        call(c)
    assert c.rpc_count == 0


def test_empty_populations_omit_all_but_sums_and_denominators():
    service = LocalService()
    (c,) = service.clients(1)
    none = torch.zeros(4, dtype=torch.bool)
    x = torch.arange(4.0)
    c.denominator(nothing=none)
    for kind in ("AVG", "MIN", "MAX", "AVG_MIN_MAX", "STD", "QUANTILES", "SUM"):
        c.stat(reduce=kind, denominator="nothing", **{kind.lower(): x})
    service.close(c)
    assert service.final()["metrics"] == {"nothing": 0.0, "sum": 0.0}


def test_scalar_mismatch_across_ranks_is_reported():
    service = LocalService()
    for c, lr in zip(service.clients(2), (1e-5, 2e-5)):
        c.scalar(lr=lr, same=3.0)
        service.close(c)
    out = service.final()
    assert out["meta"]["scalar_mismatch"] == ["lr"]


def test_nonfinite_can_be_propagated_instead_of_excluded():
    service = LocalService(output={"nonfinite": "propagate"})
    (c,) = service.clients(1)
    c.stat(bad=torch.tensor([1.0, float("nan")]), good=torch.tensor([1.0, 3.0]))
    service.close(c)
    metrics = service.final()["metrics"]
    assert all(math.isnan(metrics[f"bad/{s}"]) for s in ("mean", "min", "max"))
    assert metrics["good/mean"] == 2.0


def test_weighted_mean_counts_each_value_by_its_weight():
    service = LocalService()
    a, b = service.clients(2)
    a.weighted_mean("reward", 1.0, 3)
    b.weighted_mean("reward", 5.0, 1)
    service.close(a, b)
    assert service.final()["metrics"] == {"reward": 2.0}
    with pytest.raises(ValueError, match="weight for key 'reward' must be >= 0"):
        a.weighted_mean("reward", 1.0, -1)


def test_std_is_exact_against_numpy_on_the_concatenated_data():
    service = LocalService()
    rng = np.random.default_rng(3)
    parts = [rng.normal(5.0, 2.0, size=n).astype(np.float32) for n in (3, 50, 1000, 7)]
    masks = [rng.random(p.shape) < 0.7 for p in parts]
    for c, p, m in zip(service.clients(4), parts, masks):
        c.stat(mask=torch.from_numpy(m), reduce=ReduceType.STD, x=torch.from_numpy(p))
        service.close(c)
    whole = np.concatenate([p[m] for p, m in zip(parts, masks)]).astype(np.float64)
    assert service.final()["metrics"]["x/std"] == pytest.approx(whole.std(), rel=1e-12)


def test_quantiles_through_the_service_with_a_configured_list():
    service = LocalService(output={"quantiles": [0.1, 0.5, 0.999]})
    rng = np.random.default_rng(5)
    data = [rng.lognormal(0, 1, size=n) for n in (100, 2000, 37)]
    for c, d in zip(service.clients(3), data):
        c.stat(reduce=ReduceType.QUANTILES, lat=torch.from_numpy(d))
        service.close(c)
    out = service.final()["metrics"]
    whole = np.concatenate(data)
    assert set(out) == {"lat/p10", "lat/p50", "lat/p99.9"}
    for q, name in ((0.1, "p10"), (0.5, "p50"), (0.999, "p99.9")):
        exact = np.quantile(whole, q, method="lower")
        assert abs(out[f"lat/{name}"] - exact) <= 0.01 * abs(exact) * (1 + 1e-9)


def test_quantile_sketch_alpha_mismatch_is_rejected_naming_the_key(make_worker):
    from metricsvc.core.sketch import SketchSpec

    handle, cfg = make_worker()
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name, sketch_spec=SketchSpec(0.05))
    c.stat(reduce="quantiles", lat=np.arange(10.0))
    with pytest.raises(ValueError, match="key 'lat': quantile sketch alpha 0.05 .* alpha 0.01"):
        c.wait_submit()


def test_one_host_copy_per_flush_with_quantiles_and_denominators(make_worker):
    handle, cfg = make_worker()
    (c,) = clients_for(cfg, 1)
    with accelerator_path_on_cpu(), HostTransferCounter() as counter:
        mask = torch.rand(8, 16) > 0.5
        c.denominator(valid=mask)
        for i in range(20):
            c.stat(denominator="valid", **{f"m{i}": torch.randn(8, 16)})
            c.stat(reduce="quantiles", denominator="valid", **{f"q{i}": torch.randn(8, 16)})
        with c.record_timing("step"):
            c.scalar(lr=torch.tensor(1e-4))
        recorded = counter.count
        c.wait_submit()
    assert recorded == 0 and counter.count == 1, counter.calls
    assert len(final(handle)["metrics"]) == 1 + 20 * 3 + 20 * 3 + 2
