"""What the service says of itself (``MetricWorker.health()``): each component it holds
reports its own part, read here from their public state."""

from __future__ import annotations

import os
import time
from typing import Any

from metricsvc.service.aggregator import Aggregator


def merge_health(agg: Aggregator) -> dict[str, Any]:
    """The merge's part: steps, ranks and batch counts."""
    counts = agg.counts
    return {
        "pending_steps": agg.pending.summary(),
        "last_final_step": agg.last_emitted,
        "newest_closed_step": agg.newest_closed,
        "rank_last_seen": dict(sorted(agg.rank_last_seen.items())),
        "batches": counts["batches"],
        "stream_batches": counts["stream_batches"],
        "stream_windows": agg.streams.summary(),
        "rejected_batches": counts["rejected"],
        "duplicate_batches": counts["duplicate"],
        "late_batches": counts["late"],
        "late_by_rank": dict(sorted(agg.late_by_rank.items())),
        "lagging_ranks": agg.lag.lagging,
        "conflicting_batches": counts["conflict"],
        "dropped_batches": counts["dropped"],
        "steps_with_collisions": counts["collisions"],
        "world_size": agg.world.size,
        "world_size_source": agg.world.source,
        "partial_steps": counts["partial"],
    }


def worker_health(w: Any) -> dict[str, Any]:
    """The health of ``w``, a MetricWorker (the lock is held)."""
    sinks = w.sinks.health()
    journal = w.journal.health()
    intake = w.intake
    return {
        "name": w.config.name,
        "epoch": intake.epoch,
        "pid": os.getpid(),
        "node_id": w.node_id,  # its run folder is on this node
        "restored_steps": w.restored_steps,
        "resume": w.resume,
        "journal_skipped_lines": journal["skipped_lines"],
        "journal_duplicate_steps": journal["duplicate_steps"],
        "journal": journal["path"],
        **merge_health(w.aggregator),
        "durable_through": w.durable_through(),
        "timer_errors": intake.timer.errors,
        "failing_sinks": sorted(name for name, h in sinks.items() if h["failing"]),
        "calls": dict(intake.calls),
        "sinks": sinks,
        "sink_errors": w.sinks.errors,
        "run_dir": str(w.run_dir),
        "uptime_s": time.time() - w.started,
        "cpu_s": time.process_time(),  # this process's CPU time, all its threads
        "merge_cpu_s": intake.merge_cpu_s,  # of it, inside submit / submit_many
        "closed": intake.closed,
        "combiners": dict(intake.combiners),
        "metrics_export": w.live.status(),
    }
