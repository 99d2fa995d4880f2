"""Finished steps for readers: the last ``keep_results`` of them, and waiting on them.

``wait_final_res`` callers wait on one condition, each in a thread of the actor's
``readers`` group (so no number of waiting readers can hold up a rank's merge); each
published step wakes them. The condition's lock is the actor's: what a reader checks is
never half merged.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path

from metricsvc.core.errors import StepNotFinal, StepUnavailable
from metricsvc.service.aggregator import Aggregator, StepResult


class Results:
    """The published steps a reader may ask for, newest ``keep`` of them."""

    def __init__(self, aggregator: Aggregator, keep: int, run_dir: Path,
                 lock: threading.RLock) -> None:
        self.aggregator = aggregator
        self.keep = keep
        self.run_dir = run_dir
        self._by_step: OrderedDict[int, StepResult] = OrderedDict()
        self._changed = threading.Condition(lock)  # the actor's lock: held by every merge

    def put(self, result: StepResult) -> None:
        """Keep ``result`` (forgetting the oldest past ``keep``)."""
        self._by_step[result.step] = result
        while len(self._by_step) > self.keep:
            self._by_step.popitem(last=False)

    def forget_after(self, step: int) -> None:
        """Forget every kept result past ``step`` (a rewind supersedes them)."""
        for later in [s for s in self._by_step if s > step]:
            del self._by_step[later]

    def steps(self) -> list[int]:
        """Return the steps kept, oldest first."""
        return list(self._by_step)

    def get(self, step: int) -> StepResult | None:
        """Return the result of ``step`` if kept; never waits."""
        return self._by_step.get(step)

    def notify(self) -> None:
        """Wake every waiting reader: something was published."""
        with self._changed:
            self._changed.notify_all()

    def wait(self, step: int | None, timeout_s: float | None) -> StepResult:
        """Return the result of ``step`` once it is final (``None``: the newest step any rank
        closed, waiting for one if none has).

        Raises:
            StepNotFinal: not final within ``timeout_s`` (the message names who holds it).
            StepUnavailable: final, but never submitted or no longer kept.
        """
        agg = self.aggregator
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def until(ready) -> bool:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self._changed.wait_for(ready, left)

        with self._changed:
            if step is None and not until(lambda: agg.newest_closed is not None):
                raise StepNotFinal(self._not_final_message(None, timeout_s))
            target = int(agg.newest_closed if step is None else step)  # type: ignore[arg-type]
            if not until(lambda: agg.last_emitted is not None and agg.last_emitted >= target):
                raise StepNotFinal(self._not_final_message(target, timeout_s))
            result = self._by_step.get(target)
        if result is None:
            raise StepUnavailable(
                f"step {target} has no result: no rank submitted it, or it was evicted "
                f"(keep_results={self.keep}); "
                f"the journal under {self.run_dir} holds every finished step"
            )
        return result

    def _not_final_message(self, step: int | None, timeout_s: float | None) -> str:
        if step is None:
            return f"no rank closed any step within {timeout_s} s"
        missing = self.aggregator.pending.missing(step)
        if missing is None:
            return f"step {step} not final after {timeout_s} s: no rank has submitted it yet"
        if not missing:  # every rank closed it: an earlier step holds it back
            holder = min(self.aggregator.pending)
            return (f"step {step} not final after {timeout_s} s: every rank closed it, but "
                    f"steps are published in order and step {holder} holds it: ranks "
                    f"{self.aggregator.pending.missing(holder)} have not closed step {holder} "
                    f"(wait_submit)")
        return (
            f"step {step} not final after {timeout_s} s: "
            f"ranks {missing} have not closed it (wait_submit)"
        )
