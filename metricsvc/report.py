"""What the aggregator says of itself: the run's ranks and world size, pending steps, its
counts (its part of the service's health)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from metricsvc.step import PendingStep

if TYPE_CHECKING:
    pass



class ReportMethods:
    """The aggregator's reports (mixed into ``Aggregator``: its state is shared)."""

    _pending: dict[int, PendingStep]

    @property
    def lagging_ranks(self) -> list[int]:
        """Ranks closing each step after every other rank closed the next one."""
        return self.lag.lagging

    @property
    def world_size(self) -> int | None:
        """The run's world size (None until agreed)."""
        return self.world.size

    @property
    def world_source(self) -> str | None:
        """Where the run's world size came from."""
        return self.world.source

    @property
    def journaled_meta(self) -> Callable[[int], Mapping[str, Any] | None] | None:
        """How a published step's meta is read back when it is older than what is kept in
        memory (the worker reads its journal)."""
        return self.published.journaled_meta

    @journaled_meta.setter
    def journaled_meta(self, read: Callable[[int], Mapping[str, Any] | None] | None) -> None:
        self.published.journaled_meta = read

    def health(self) -> dict[str, Any]:
        """The merge's part of the service's health: steps, ranks and batch counts."""
        counts = self.counts
        return {
            "pending_steps": self.pending_summary(),
            "last_final_step": self.last_emitted,
            "newest_closed_step": self.newest_closed,
            "rank_last_seen": dict(sorted(self.rank_last_seen.items())),
            "batches": counts["batches"],
            "stream_batches": counts["stream_batches"],
            "stream_windows": self.windows_summary(),
            "rejected_batches": counts["rejected"],
            "duplicate_batches": counts["duplicate"],
            "late_batches": counts["late"],
            "late_by_rank": dict(sorted(self.late_by_rank.items())),
            "lagging_ranks": self.lagging_ranks,
            "conflicting_batches": counts["conflict"],
            "dropped_batches": counts["dropped"],
            "steps_with_collisions": counts["collisions"],
            "world_size": self.world_size,
            "world_size_source": self.world_source,
            "partial_steps": counts["partial"],
        }

    def pending_summary(self) -> dict[int, dict[str, Any]]:
        """Return, per pending step, which ranks have closed it and how many keys it holds."""
        return {s: p.summary() for s, p in sorted(self._pending.items())}

    def missing_ranks(self, step: int) -> list[int] | None:
        """Return the ranks that have not closed a pending step, or None if it is not pending."""
        p = self._pending.get(step)
        return None if p is None else p.missing()
