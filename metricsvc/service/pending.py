"""The steps not final yet: which are open, which rank closed what, and the step a
batch may open next. A component the aggregator holds (pure numpy, no Ray)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from metricsvc.service.step import PendingStep


class PendingSteps(dict[int, PendingStep]):
    """Step -> its ``PendingStep``, for the steps not published yet."""

    def anchor(self, last_emitted: int | None) -> int | None:
        """Return the oldest step still open (None before the first batch of a run)."""
        open_steps = list(self)
        if last_emitted is not None:
            open_steps.append(last_emitted + 1)
        return min(open_steps, default=None)

    def newest_closed(self, last_emitted: int | None) -> int | None:
        """Return the newest step a rank closed, pending or published."""
        closed = [s for s, p in self.items() if p.closed]
        if last_emitted is not None:
            closed.append(last_emitted)
        return max(closed, default=None)

    def summary(self) -> dict[int, dict[str, Any]]:
        """Per pending step: which ranks have closed it and how many keys it holds."""
        return {s: p.summary() for s, p in sorted(self.items())}

    def missing(self, step: int) -> list[int] | None:
        """Return the ranks that have not closed ``step``, or None if it is not pending."""
        p = self.get(step)
        return None if p is None else p.missing()

    def time_out(self, now: float, timeout_s: float, recount: bool = False) -> bool:
        """Mark the steps open for ``timeout_s`` or longer as timed out (``recount``: and
        only those, once the world size changed); return True if any is."""
        for p in self.values():
            late = now - p.opened_at >= timeout_s
            p.timed_out = late if recount else (p.timed_out or late)
        return any(p.timed_out for p in self.values())

    def forget_after(self, step: int) -> None:
        """A rewind: every step past ``step`` is recorded afresh."""
        for later in [s for s in self if s > step]:
            del self[later]

    def regroup(self, world_size: int, drop: Callable[[int, int, int | None], None]) -> None:
        """The run's world size is now ``world_size``: rebuild each step from the batches
        it kept apart, leaving out (``drop(step, rank, claim)``) those of ranks that
        claimed another size; a step left empty goes."""
        for step, p in list(self.items()):
            sources, p.sources = p.sources, None
            if sources is None or all(w in (None, world_size) for w, _, _ in sources):
                p.world_size = world_size if p.ranks else p.world_size
                continue
            fresh = PendingStep(step, world_size, p.opened_at)
            fresh.stream_only = p.stream_only
            for claim, rank, apply in sources:
                if claim in (None, world_size):
                    apply(fresh)
                else:
                    drop(step, rank, claim)
            if fresh.parts:
                self[step] = fresh
            else:
                del self[step]
