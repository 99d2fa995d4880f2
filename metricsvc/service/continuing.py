"""Continuing a run, the merge's part: after a restart, from the journaled steps; after a
rewind, from the checkpoint of a step. Each part the aggregator holds restores or forgets
its own (the run's history itself is ``metricsvc.storage.history``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from metricsvc.service.aggregator import Aggregator


def restore(agg: Aggregator, finished: Iterable[dict[str, Any]]) -> None:
    """Resume ``agg`` after a restart from journaled steps ``{"step", "metrics", "meta"}``,
    in step order (a journal's order), one at a time: nothing is kept of a step past the
    recent ones' digests and ranks."""
    for record in finished:
        step = int(record["step"])
        meta = record.get("meta", {})
        agg.last_emitted = step if agg.last_emitted is None else max(step, agg.last_emitted)
        agg.newest_closed = step if agg.newest_closed is None else max(step, agg.newest_closed)
        agg.published.add_journaled(step, meta)
        if agg.world.size is None and meta.get("world_size"):
            agg.world.size, agg.world.source = int(meta["world_size"]), "from the journal"
        if isinstance(totals := meta.get("derived_totals"), dict):
            agg.deriver.restore(totals)
        if isinstance(declarations := meta.get("declarations"), dict):
            agg.declarations.restore(declarations, step)
        agg.out.descriptions.restore(meta, step)
        if isinstance(stream_seqs := meta.get("stream_seqs"), dict):
            agg.streams.ledger.journaled(stream_seqs)


def rewind(agg: Aggregator, to_step: int, totals: Mapping[str, Any] | None) -> int:
    """Forget in ``agg`` every step past ``to_step`` (published or pending): they will be
    recorded afresh, and what the superseded steps journaled once (declarations,
    descriptions) is journaled again with the rerun. ``totals``: the running sums as
    journaled with ``to_step``. Returns how many published steps were superseded."""
    superseded = agg.published.forget_after(to_step)
    agg.streams.ledger.forget_after(to_step)
    agg.pending.forget_after(to_step)
    if agg.last_emitted is not None and agg.last_emitted > to_step:
        agg.last_emitted = to_step if to_step >= 0 else None
    agg.rank_last_seen = {r: min(s, to_step) for r, s in agg.rank_last_seen.items()}
    agg.lag.clear()
    agg.deriver.totals.clear()
    agg.deriver.restore(totals or {})
    agg.declarations.forget_after(to_step)
    agg.out.descriptions.forget_after(to_step)
    agg.newest_closed = agg.pending.newest_closed(agg.last_emitted)
    return superseded
