"""The steps already published, and what a batch for one of them is.

For each published step the service remembers which ranks closed it and, for the recent
``DIGEST_STEPS``, the digests of their batches (older ones are read back from the
journal's meta). A batch for a published step is *late* if its rank never closed the step,
a *duplicate* if it is byte-identical to what the rank sent (a resend), and otherwise a
*conflict* (a rerun after resuming from a checkpoint, or a second client with the rank's
number): counted, reported, never merged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Literal

from metricsvc.core.batch import Batch

DIGEST_STEPS = 64  # published steps whose batch digests are kept to tell resends apart

Digests = dict[tuple[int, int], bytes]
Status = Literal["merged", "duplicate", "late"]  # what the service did with a batch


class Published:
    """Which ranks closed each published step, and the recent steps' batch digests."""

    def __init__(self, remember: int) -> None:
        self.remember = remember
        self._steps: OrderedDict[int, tuple[frozenset[int], Digests | None]] = OrderedDict()
        # How a published step's meta is read back when it is older than what is kept in
        # memory (the worker reads its journal); None: only what is kept is known.
        self.journaled_meta: Callable[[int], Mapping[str, Any] | None] | None = None

    def add(self, step: int, closed: frozenset[int], digests: Digests | None) -> None:
        """Remember a published step (forgetting digests past the recent ones)."""
        self._steps[step] = (closed, digests)
        old = step - DIGEST_STEPS
        if old in self._steps:
            self._steps[old] = (self._steps[old][0], None)
        while len(self._steps) > self.remember:
            self._steps.popitem(last=False)

    def add_journaled(self, step: int, meta: Mapping[str, Any]) -> None:
        """Remember a step as its journaled meta has it (after a restart)."""
        self.add(step, frozenset(meta.get("ranks", ())), digests_of(meta.get("digests")))

    def judge(self, batch: Batch,
              digest: bytes) -> tuple[Literal["late", "duplicate", "conflict"], str]:
        """Say what ``batch`` (for a published step) is, and for a conflict what clashed."""
        closed, digests = self._steps.get(batch.step, (None, None))
        if digests is None and self.journaled_meta is not None:
            meta = self.journaled_meta(batch.step)  # rare: an old step's batch
            if meta is not None:
                closed = frozenset(meta.get("ranks", ()))
                digests = digests_of(meta.get("digests"))
        if batch.rank not in (closed or frozenset()):
            return "late", ""
        known = None if digests is None else digests.get((batch.rank, batch.seq))
        if known is not None and known == digest[:len(known)]:  # the same bytes: a resend
            return "duplicate", ""
        # Not provably a resend (resends are recent: their digests are kept): never merged,
        # never taken for a duplicate, however old the step.
        return "conflict", RESENT_OTHERWISE if known is not None else AFTER_CLOSE

    def forget_after(self, step: int) -> int:
        """Forget every published step past ``step`` (a rewind); return how many."""
        superseded = [s for s in self._steps if s > step]
        for later in superseded:
            del self._steps[later]
        return len(superseded)


def digests_of(journaled: Any) -> Digests | None:
    """The batch digests a journaled step's meta holds, by ``(rank, seq)``."""
    if not isinstance(journaled, dict):
        return None
    out = {}
    for key, value in journaled.items():
        try:
            rank, seq = (int(x) for x in str(key).split(":"))
            out[(rank, seq)] = bytes.fromhex(value)
        except (TypeError, ValueError):
            continue
    return out


RESENT_OTHERWISE = "was already received with other content"  # the same identity, new bytes
AFTER_CLOSE = "comes after the rank already closed this step"


def conflict_message(batch: Batch, what: str, final: bool) -> str:
    """The refusal of a batch whose identity ``(step, rank, seq)`` clashes (``what``) with
    what the service holds; ``final``: its step is already published."""
    if not final:
        return (f"step {batch.step}: conflict: rank {batch.rank} seq {batch.seq} {what} (two "
                f"clients with rank {batch.rank}? only a byte-identical resend is a duplicate)")
    return (f"step {batch.step}: conflict: rank {batch.rank} seq {batch.seq} {what}, and the "
            f"step is already final. Rerunning steps after resuming from a checkpoint? Call "
            f"rewind(to_step=<the checkpoint's step>) on the MetricWorker first. Two clients "
            f"with rank {batch.rank}? Only a byte-identical resend is a duplicate; nothing "
            f"was merged")
