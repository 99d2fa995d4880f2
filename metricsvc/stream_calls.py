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
    _stale: Callable[[str | None], bool]
    _check_open: Callable[[str], None]
    _publish: Callable[[list[StepResult]], None]

    def stream_submit(self, name: str, client: str, batch: Batch | bytes,
                      epoch: str | None = None) -> dict[str, Any]:
        """Add a stream client's records to the current window of stream ``name``.

        The restart protocol of ``submit``, with the client's batch numbers for steps: the
        ack's ``durable_through`` is the newest batch of ``client`` that a journaled step
        holds, and a caller that names another incarnation (``epoch``) is answered
        ``epoch_changed`` with nothing merged, so that it first resends what the window
        lost with the old incarnation.
        """
        with self._lock:
            self._check_open("stream_submit")
            if self._stale(epoch):
                return self._stream_ack("epoch_changed", name, client)
            self.calls["stream_submit"] += 1
            batch = self.aggregator.decode(batch)
            status = self.aggregator.stream_submit(name, client, batch)
            return self._stream_ack(status, name, client, seq=batch.seq)

    def _stream_ack(self, status: str, name: str, client: str, **extra: Any) -> dict[str, Any]:
        ack = self._ack(status, **extra)
        ack["durable_through"] = self.aggregator.stream_ledger.through(
            name, client, ack["durable_through"])
        return ack

    def export_stream(self, name: str, step: int, close: bool = False) -> dict[str, float]:
        """Publish the window of stream ``name`` with ``step``, start a new window, and
        return the window's metrics. ``close=True``: a step no rank submits is final with
        the window alone. Raises ``BatchRejected`` (window kept) if the step is final."""
        with self._lock:
            self._check_open("export_stream")
            self.calls["export_stream"] += 1
            self.timer.start()
            metrics, finished = self.aggregator.export_stream(name, int(step), close)
            if finished:
                self._publish(finished)
            return metrics
