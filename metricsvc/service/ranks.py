"""What the service knows of the run's ranks: how many there are, and who lags.

The world size comes from the config, else is agreed by a majority of the sizes ranks
claim (no step can finish before), else is read from the journal after a restart. A rank
that closes each step only after every other rank closed the next one has probably had its
step count slip by one: it is told once, at the third step in a row.
"""

from __future__ import annotations

import logging
from collections import Counter

from metricsvc.core.batch import Batch
from metricsvc.core.errors import BatchRejected

log = logging.getLogger(__name__)


class WorldSize:
    """The run's world size and where it came from; the claims until it is agreed."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        self.source = "config" if size is not None else None
        self.claims: dict[int, int] = {}  # rank -> the world size it claims, until agreed

    def check(self, batch: Batch) -> None:
        """Refuse a batch whose world size contradicts the run's (or its rank's own claim)."""
        if self.size is not None:
            if batch.world_size != self.size:
                raise BatchRejected(
                    f"step {batch.step}: rank {batch.rank} sent world_size {batch.world_size}, "
                    f"but the run's world size is {self.size} ({self.source})"
                )
            return
        claimed = self.claims.get(batch.rank, batch.world_size)
        if claimed != batch.world_size:
            raise BatchRejected(
                f"step {batch.step}: rank {batch.rank} sent world_size {batch.world_size}, but "
                f"claimed {claimed} before (the run's world size is not agreed yet)"
            )

    def claim(self, batch: Batch) -> str | None:
        """Count a rank's claim; return where the size comes from once a majority of a
        claimed size agree (the caller then fixes it), else None."""
        self.claims[batch.rank] = batch.world_size
        agree = sorted(r for r, w in self.claims.items() if w == batch.world_size)
        if len(agree) >= batch.world_size // 2 + 1:
            return f"agreed by {_ranks(agree)}"
        return None

    def at_timeout(self) -> tuple[int, str] | None:
        """With no majority in time: the size most ranks claim (the larger on a tie)."""
        if self.size is not None or not self.claims:
            return None
        sizes = Counter(self.claims.values())
        size = max(sizes, key=lambda w: (sizes[w], w))
        voters = sorted(r for r, w in self.claims.items() if w == size)
        return size, f"claimed by {_ranks(voters)} at the straggler timeout"

    def fix(self, size: int, source: str) -> None:
        """Fix the run's world size; the claims are settled."""
        self.size, self.source = size, source
        self.claims.clear()
        log.warning("the run's world size is %d (%s)", size, source)


def _ranks(ranks: list[int]) -> str:
    """Name a list of ranks: all of a few, the count and ends of many."""
    if len(ranks) <= 8:
        return f"ranks {ranks}"
    return f"{len(ranks)} ranks ({ranks[0]} to {ranks[-1]})"


class LagWatch:
    """Ranks that close each step after every other rank closed the next one."""

    RUN = 3  # closes in a row behind every other rank that name a rank lagging

    def __init__(self) -> None:
        self._runs: Counter[int] = Counter()

    def check(self, rank: int, step: int, following: set[int] | None,
              world_size: int | None) -> str | None:
        """Count ``rank`` closing ``step`` when ``following`` (the ranks that closed the
        next step, None if it is not open) holds every other rank; return what to tell the
        rank at the third such step in a row, else None."""
        others = (world_size or 0) - 1
        if following is None or others < 1 or len(following - {rank}) < others:
            self._runs.pop(rank, None)
            return None
        self._runs[rank] += 1
        if self._runs[rank] != self.RUN:
            return None
        log.warning("rank %d closes each step after every other rank closed the next one",
                    rank)
        return (f"rank {rank} closes each step only after every other rank closed the next "
                f"one ({self.RUN} steps in a row, the last step {step}): its step count "
                f"has probably slipped by one (an exception between recording and "
                f"wait_submit, without discard()). Pass step= to wait_submit (the trainer's "
                f"global step) so a step never holds another's records")

    @property
    def lagging(self) -> list[int]:
        return sorted(r for r, n in self._runs.items() if n >= self.RUN)

    def clear(self) -> None:
        self._runs.clear()


class Notices:
    """What each rank must hear with its next ack: an accepted batch of it that was dropped,
    its declaration that lost, a name collision, its lag."""

    def __init__(self) -> None:
        self._by_rank: dict[int, str] = {}

    def tell(self, rank: int, why: str) -> None:
        """Give ``rank`` ``why`` with its next ack (after what it has not heard yet)."""
        earlier = self._by_rank.get(rank)
        self._by_rank[rank] = why if earlier is None else f"{earlier}; {why}"

    def take(self, rank: int) -> str | None:
        """Return (and forget) what ``rank`` has not heard yet."""
        return self._by_rank.pop(rank, None)
