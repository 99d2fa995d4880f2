"""A rank's step cursor and the engine, without Ray: every close a training loop can make
(naming no step, the open one, one behind or ahead), discards after a failed step, and a
plain model of which records belong to which step (``helpers.Rank``). The cursor's
batches go through the wire's bytes into the engine, as they reach the service; the Ray
twin of this model is ``test_closes.test_every_published_step_holds_exactly_what_was_
recorded_for_it``."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from metricsvc.client import StepMismatch
from metricsvc.client.buffer import RecordBuffer, StepCursor
from metricsvc.core.reduce import AUTO, ReduceType
from metricsvc.core.wire import encode
from metricsvc.service.engine import Engine
from tests.helpers import KEYS, STEPS, Rank

CALLERS = ("wait_submit", "flush", "log")


class Cursor(RuleBasedStateMachine):
    """One rank (world size 1) whose closes the engine turns into published steps."""

    @initialize(start=st.integers(0, 3))
    def start(self, start):
        self.buffer = RecordBuffer()
        self.cursor = StepCursor(0, 1, start, self.buffer)
        self.engine = Engine()
        self.model = Rank(start)
        self.published: dict[int, dict[str, float]] = {}
        self.sent: list[int] = []  # the steps of the batches sent, in order

    @rule(key=st.sampled_from(KEYS), value=st.integers(1, 9))
    def record(self, key, value):
        if key == "c/sum":  # a plain number: the service picks its kind by its name
            self.buffer.record({key: float(value)}, None, AUTO)
        else:
            self.buffer.record({key: np.array([float(value)])}, None, ReduceType.SUM)
        self.model.record(key, value)

    @rule(caller=st.sampled_from(CALLERS), offset=st.sampled_from(STEPS))
    def close(self, caller, offset):
        step = None if offset is None else self.model.open + offset
        if step is not None and step < 0:
            with pytest.raises(TypeError, match=rf"{caller}\(step={step}\): step must be"):
                self.cursor.close(step, caller)
            self.model.drop()  # as a refusal does
            return
        if step is not None and self.model.name(step):
            with pytest.raises(StepMismatch, match=rf"{caller}\(step={step}\) refused.*"
                                                   rf"(dropped|nothing was recorded)"):
                self.cursor.close(step, caller)
            return
        batch = self.cursor.close(step, caller)
        self.sent.append(batch.step)
        for result in self.engine.submit(encode(batch)).finished:
            self.published[result.step] = result.metrics
        self.model.close()

    @rule()
    def discard(self):
        assert self.cursor.discard() == len(self.model.pending)
        self.model.drop()

    @invariant()
    def every_published_step_holds_what_was_recorded_for_it(self):
        assert self.sent == sorted(set(self.sent))  # steps only go forward, each sent once
        assert self.cursor.step == self.model.open
        assert sorted(self.buffer.keys()) == sorted(self.model.pending)
        # each key's next call number (where its min and max came from): across re-recordings,
        # discards, refusals and closes
        assert self.buffer.recordings(KEYS) == [self.model.recorded.get(k, 0) for k in KEYS]
        assert self.published == {
            step: {key: float(v) for key, v in held.items()}
            for step, held in self.model.published.items()}


TestCursor = Cursor.TestCase
TestCursor.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow])
