"""Streams: records with no step barrier, from any number of clients that come and go.

AReaL's rollout paradigm: each rollout worker records whenever an episode ends;
the driver calls ``worker.export_stream.remote(name, step)``, which publishes
everything flushed to stream ``name`` since the last export with that step
(merged count-weighted, like any step) and starts a new window. Records still
in a recorder's buffer at the export go to the next window: nothing is lost or
counted twice.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from metricsvc.client.buffer import RecordBuffer
from metricsvc.client.rpc import call
from metricsvc.client.tracker import Tracker
from metricsvc.protocol import Batch, Refused, SketchSpec, check_key, encode


class StreamRecorder(Tracker):
    """Records for stream ``name`` (keys prefixed ``name/``, like AReaL's ``get(name)``).

    Flushes (one actor call) once ``flush_every`` keys are waiting or
    ``flush_interval_s`` seconds have passed at a recording, on ``flush()`` and
    on ``close()``.
    """

    def __init__(
        self,
        worker: Callable[[], Any],
        name: str,
        *,
        sketch_spec: SketchSpec | None = None,
        compile: bool | None = None,
        retry_s: float = 120.0,
        flush_every: int = 256,
        flush_interval_s: float = 1.0,
    ) -> None:
        self.name = check_key(name)
        self.client_id = uuid.uuid4().hex
        self._worker = worker
        super().__init__(RecordBuffer(sketch_spec, compile), prefix=f"{name}/")
        self.buffer.label = f"stream {name!r} before its flush"
        self.buffer.on_record = self._maybe_flush
        self.retry_s = retry_s
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self._seq = 0
        self._unacked: Batch | None = None
        self._last_flush = time.monotonic()
        self.rpc_count = 0

    def _maybe_flush(self) -> None:
        due = time.monotonic() - self._last_flush >= self.flush_interval_s
        if len(self.buffer) >= self.flush_every or due:
            self.flush()

    def flush(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Send what was recorded since the last flush (one host copy, one actor call)."""
        with self.buffer.lock:
            if self._unacked is None:
                if not len(self.buffer):
                    return None
                self._seq += 1
                self._unacked = self.buffer.take_batch(step=0, rank=0, world_size=1,
                                                       seq=self._seq, final=False)
            batch = self._unacked
        self.rpc_count += 1
        try:
            ack = call(self._worker, "stream_submit", self.name, self.client_id, encode(batch),
                       retry_s=self.retry_s, timeout_s=timeout_s)
        except Refused:
            self._unacked = None  # rejected: resending the same batch cannot help
            raise
        self._unacked = None
        self._last_flush = time.monotonic()
        return ack

    def close(self) -> None:
        """Flush what is left; the recorder can still be used afterwards."""
        self.flush()

    def __enter__(self) -> StreamRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
