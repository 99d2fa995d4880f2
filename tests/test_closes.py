"""Closing a step: a close the client refuses drops that close's records, whichever call
refused it, and a step holds exactly what was recorded for it (issue 68)."""

import numpy as np
import pytest
import ray

import metricsvc
from metricsvc.client import MetricClient, StepMismatch
from tests.helpers import KEYS, STEPS, Rank


def closer(name):
    """The close a training loop makes with ``name`` (``wait_submit``, ``flush``, ``log``)."""
    if name == "log":
        return lambda c, step: c.log({}, step=step)
    return lambda c, step: getattr(c, name)(step=step)


@pytest.mark.parametrize("call", ["wait_submit", "flush", "log"])
def test_a_second_close_of_a_closed_step_never_feeds_the_next_step(make_worker, call):
    handle, cfg = make_worker(world_size=1)
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    close = closer(call)
    c.submit_metric({"loss": 1.0})
    close(c, 0)
    c.submit_metric({"loss": 100.0})  # the loop retries step 0, or logs it twice
    with pytest.raises(StepMismatch) as err:
        close(c, 0)
    said = str(err.value)
    assert f"{call}(step=0)" in said and "already closed step 0" in said
    assert "dropped" in said and "'loss'" in said  # what was dropped: its keys
    assert c.pending_keys() == []
    c.submit_metric({"loss": 2.0})
    close(c, 1)
    c.wait_acks(timeout_s=30)
    assert metricsvc.final_result(handle, 0, 30) == {"loss": 1.0}
    assert metricsvc.final_result(handle, 1, 30) == {"loss": 2.0}


def test_a_refused_close_of_a_step_ahead_drops_its_records_and_the_loop_goes_on(make_worker):
    """An exception between recording and closing left step 0's records pending; the
    close of step 1 is refused, drops them (they cannot be told from step 1's), and the
    next step the loop names is taken."""
    handle, cfg = make_worker(world_size=1)
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.stat(x=np.array([100.0]))  # step 0: the training step raises before closing
    c.stat(x=np.array([1.0]))  # step 1 records
    with pytest.raises(StepMismatch, match=r"wait_submit\(step=1\).*dropped.*'x'"):
        c.wait_submit(step=1)
    assert c.pending_keys() == [] and c.discard() == 0 and c.rpc_count == 0
    c.stat(x=np.array([2.0]))
    c.wait_submit(step=2)
    assert metricsvc.final_result(handle, 2, 30)["x/mean"] == 2.0
    assert ray.get(handle.get_result.remote(0)) is None
    assert ray.get(handle.get_result.remote(1)) is None



def test_a_timed_out_close_is_closed_once_the_loop_names_the_next_step(make_worker):
    """Naming step 1 after step 0's wait_submit timed out was refused as step 0 'never
    closed', and refused again at every later step: the rank could not go on."""
    from tests.test_flush import Paused

    handle, cfg = make_worker(world_size=1)
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    c.stat(x=np.array([1.0, 3.0]))
    with Paused(handle), pytest.raises(ray.exceptions.GetTimeoutError):
        c.wait_submit(step=0, timeout_s=0.5)
    c.stat(x=np.array([5.0]))  # the next step's records
    c.wait_submit(step=1, timeout_s=60)
    c.wait_acks(timeout_s=60)
    assert metricsvc.final_result(handle, 0, 30)["x/mean"] == 2.0
    assert metricsvc.final_result(handle, 1, 30)["x/mean"] == 5.0

def test_every_published_step_holds_exactly_what_was_recorded_for_it(make_worker):
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, rule

    handle, _ = make_worker(world_size=1)
    next_start = [0]  # each example's rank starts past the steps the ones before used

    class Calls(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.start = next_start[0]
            self.model = Rank(self.start)
            self.client = MetricClient(handle, rank=0, world_size=1, start_step=self.start)

        def target(self, offset):
            """The step a close names (the steps before this rank's start are another
            example's, published already)."""
            return None if offset is None else max(self.start, self.model.open + offset)

        @rule(key=st.sampled_from(KEYS), value=st.integers(1, 9))
        def record(self, key, value):
            if key == "c/sum":
                self.client.submit_metric({key: float(value)})
            else:
                self.client.stat(reduce="sum", **{key: np.array([float(value)])})
            self.model.record(key, value)

        @rule(call=st.sampled_from(["wait_submit", "flush"]), offset=st.sampled_from(STEPS))
        def close(self, call, offset):
            step = self.target(offset)
            if step is not None and self.model.name(step):
                with pytest.raises(StepMismatch, match=rf"{call}\(step={step}\) refused"):
                    getattr(self.client, call)(step=step)
                return
            getattr(self.client, call)(step=step)
            self.model.close()

        @rule(offset=st.sampled_from(STEPS), value=st.integers(1, 9), commit=st.booleans())
        def log(self, offset, value, commit):
            """``log(metrics, step=, commit=)``: the step named before the dict is recorded."""
            step = self.target(offset)
            if step is not None and self.model.name(step):
                with pytest.raises(StepMismatch, match=rf"log\(step={step}\) refused"):
                    self.client.log({"c/sum": float(value)}, step=step, commit=commit)
                return
            self.client.log({"c/sum": float(value)}, step=step, commit=commit)
            self.model.record("c/sum", value)
            if commit:
                self.model.close()

        @rule()
        def discard(self):
            """After a failed training step (an exception between recording and closing)."""
            assert self.client.discard() == len(self.model.pending)
            self.model.drop()

        def teardown(self):
            self.client.wait_acks(timeout_s=60)
            model = self.model
            last = max(model.open, model.last_closed or 0)
            for step in range(self.start, last + 1):
                got = ray.get(handle.get_result.remote(step), timeout=60)
                want = model.published.get(step)
                if want is None:
                    assert got is None, f"step {step} was never closed, yet published"
                else:
                    assert got is not None, f"step {step} was closed, yet not published"
                    assert got["metrics"] == {k: float(v) for k, v in want.items()}, step
            next_start[0] = last + 1

    Calls.TestCase.settings = settings(max_examples=25, stateful_step_count=25,
                                       deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
    Calls.TestCase().runTest()
