"""Fan finished steps out to sinks on one background thread, off the merge path.

One thread keeps every sink's writes in step order. A sink that raises is
isolated: the error is counted and reported in ``health``, the other sinks and
the aggregation go on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from metricsvc.sinks.base import Sink

log = logging.getLogger(__name__)

_STOP = object()


class SinkDispatcher:
    """Queue of sink work served by a single daemon thread."""

    def __init__(self, sinks: Sequence[Sink], run_dir: Path, max_queue: int = 10_000) -> None:
        self.sinks = list(sinks)
        self.run_dir = run_dir
        self.errors: dict[str, dict[str, Any]] = {}
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._closed = False
        run_dir.mkdir(parents=True, exist_ok=True)
        for sink in list(self.sinks):
            if not self._guard(sink, "open", sink.open, run_dir):
                self.sinks.remove(sink)
        self._thread = threading.Thread(target=self._serve, name="metricsvc-sinks", daemon=True)
        self._thread.start()

    def publish(self, step: int, metrics: dict[str, float], meta: dict[str, Any]) -> None:
        """Queue one finished step for every sink."""
        if not self._closed:
            self._queue.put(("write", step, metrics, meta))

    def event(self, event: dict[str, Any]) -> None:
        """Queue a journal event (sinks without ``write_event`` ignore it)."""
        if not self._closed:
            self._queue.put(("event", event))

    def flush(self, timeout_s: float | None = 30.0) -> bool:
        """Wait until everything queued so far was handed to the sinks; True if done."""
        if self._closed:
            return True
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout_s)

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Drain the queue, close every sink; a second call is harmless."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        for sink in self.sinks:
            self._guard(sink, "close", sink.close)

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if item[0] == "flush":
                item[1].set()
                continue
            for sink in self.sinks:
                if item[0] == "write":
                    self._guard(sink, "write", sink.write, *item[1:])
                elif hasattr(sink, "write_event"):
                    self._guard(sink, "write_event", sink.write_event, item[1])

    def _guard(self, sink: Sink, what: str, fn: Any, *args: Any) -> bool:
        try:
            fn(*args)
            return True
        except Exception as err:  # a sink must never take the service down
            entry = self.errors.setdefault(sink.name, {"count": 0, "last_error": ""})
            entry["count"] += 1
            entry["last_error"] = f"{what}: {type(err).__name__}: {err}"
            log.warning("sink %s failed in %s: %s", sink.name, what, err)
            return False
