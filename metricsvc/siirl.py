"""siiRL's ``MetricWorker`` calls, on ours: the same names, so siiRL's driver code runs.
(The rank side's are ``metricsvc.client.siirl``.)"""

from __future__ import annotations


class SiirlActorMethods:
    """Mixed into the MetricWorker actor."""

    def start(self) -> None:
        """siiRL's ``MetricWorker.start()``: the service serves from its creation, so this
        only answers (``ray.get(metric_worker.start.remote())`` works as in siiRL)."""

    def stop(self) -> None:
        """siiRL's ``MetricWorker.stop()``: nothing to stop between steps here (siiRL's loop
        restarts on the next ``wait_final_res``). The service keeps serving; end it with
        ``metricsvc.stop_metric_worker`` (or ``close()``)."""
