"""The MetricWorker's stream calls (AReaL's rollout paradigm): records with no step barrier
go to a stream's window, which the driver folds into a step at export. The merge itself is
the aggregator's (``metricsvc.streams``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from metricsvc.aggregator import Aggregator, StepResult
from metricsvc.records import Batch


class StreamCallMethods:
    """Mixed into the MetricWorker actor (its lock, aggregator and publishing are shared)."""

    _lock: threading.RLock
    aggregator: Aggregator
    calls: Any
    timer: Any
    _ack: Callable[..., dict[str, Any]]
    _publish: Callable[[list[StepResult]], None]

    def stream_submit(self, name: str, client: str, batch: Batch | bytes) -> dict[str, Any]:
        """Add a stream client's records to the current window of stream ``name``."""
        with self._lock:
            self.calls["stream_submit"] += 1
            batch = self.aggregator.decode(batch)
            status = self.aggregator.stream_submit(name, client, batch)
            return self._ack(status, seq=batch.seq)

    def export_stream(self, name: str, step: int, close: bool = False) -> dict[str, float]:
        """Publish the window of stream ``name`` with ``step``, start a new window, and
        return the window's metrics. ``close=True``: a step no rank submits is final with
        the window alone. Raises ``BatchRejected`` (window kept) if the step is final."""
        with self._lock:
            self.calls["export_stream"] += 1
            self.timer.start()
            metrics, finished = self.aggregator.export_stream(name, int(step), close)
            if finished:
                self._publish(finished)
            return metrics
