"""Continuing a run: from the journal after a restart, or from a checkpoint's step after a
rewind. The aggregator's part."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from metricsvc.step import PendingStep


class RestartMethods:
    """The aggregator's restart calls (mixed into ``Aggregator``: its state is shared)."""

    _pending: dict[int, PendingStep]

    def restore(self, finished: Iterable[dict[str, Any]]) -> None:
        """Resume after a restart from journaled steps ``{"step", "metrics", "meta"}``, in
        step order (a journal's order), one at a time: nothing is kept of a step past the
        recent ones' digests and ranks."""
        for record in finished:
            step = int(record["step"])
            meta = record.get("meta", {})
            self.last_emitted = max(step, self.last_emitted if self.last_emitted is not None
                                    else step)
            self.published.add_journaled(step, meta)
            if self.newest_closed is None or step > self.newest_closed:
                self.newest_closed = step
            if self.world_size is None and meta.get("world_size"):
                self.world.size, self.world.source = int(meta["world_size"]), "from the journal"
            totals = meta.get("derived_totals")
            if isinstance(totals, dict):
                self.deriver.restore(totals)
            declarations = meta.get("declarations")
            if isinstance(declarations, dict):
                self.declarations.restore(declarations, step)
            self.out.descriptions.restore(meta, step)
            stream_seqs = meta.get("stream_seqs")
            if isinstance(stream_seqs, dict):
                self.stream_ledger.journaled(stream_seqs)

    def rewind(self, to_step: int, totals: Mapping[str, Any] | None) -> int:
        """Forget every step past ``to_step`` (published or pending): they will be recorded
        afresh. ``totals``: the running sums as journaled with ``to_step``. Returns how
        many published steps were superseded."""
        superseded = self.published.forget_after(to_step)
        self.stream_ledger.forget_after(to_step)
        for step in [s for s in self._pending if s > to_step]:
            del self._pending[step]
        if self.last_emitted is not None and self.last_emitted > to_step:
            self.last_emitted = to_step if to_step >= 0 else None
        self.rank_last_seen = {r: min(s, to_step) for r, s in self.rank_last_seen.items()}
        self.lag.clear()
        self.deriver.totals.clear()
        self.deriver.restore(totals or {})
        # What the superseded steps journaled once is journaled again with the rerun: the
        # latest segment carries the run's definitions and descriptions
        self.declarations.forget_after(to_step)
        self.out.descriptions.forget_after(to_step)
        self._refresh_newest_closed()
        return superseded
