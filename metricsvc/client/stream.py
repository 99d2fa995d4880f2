"""Streams: records with no step barrier, from any number of clients that come and go.

AReaL's rollout paradigm: each rollout process records whenever an episode ends;
the driver calls ``worker.export_stream.remote(name, step)``, which publishes
everything flushed to stream ``name`` since the last export with that step
(merged count-weighted, like any step) and starts a new window. Records still
in a recorder's buffer at the export go to the next window: nothing is lost or
counted twice.

A recorder delivers through the same ``Sender`` as a rank's client: one batch at a time,
each kept until the journal holds the step its window was exported into, and resent to a
restarted actor (whose windows died with it). Streams go to the MetricWorker itself, never
through a node's combiner, which gathers ranks' steps.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from metricsvc.client.buffer import RecordBuffer
from metricsvc.client.rpc import call
from metricsvc.client.sender import Sender
from metricsvc.client.tracker import Tracker
from metricsvc.protocol import RETRY_S, Batch, Refused, SketchSpec, check_key, encode


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
        retry_s: float = RETRY_S,
        flush_every: int = 256,
        flush_interval_s: float = 1.0,
        max_inflight: int = 1024,
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
        self._closed = False
        self.rpc_count = 0
        # Batches are numbered (seq) in the order sent: the position acks count in
        self.sender = Sender(self._call, f"stream {name!r}", max_inflight,
                             position=lambda batch: batch.seq)

    def _call(self, payload: bytes, epoch: str | None, timeout_s: float | None) -> dict:
        self.rpc_count += 1
        return call(self._worker, "stream_submit", self.name, self.client_id, payload, epoch,
                    retry_s=self.retry_s, timeout_s=timeout_s)

    def _maybe_flush(self) -> None:
        self._check_open()
        due = time.monotonic() - self._last_flush >= self.flush_interval_s
        if len(self.buffer) >= self.flush_every or due:
            self.flush()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"stream {self.name!r}: this recorder is closed (close() or "
                               f"the end of its with-block); records after it are not sent: "
                               f"take a new one with client.stream({self.name!r})")

    def flush(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Send what was recorded since the last flush (one host copy, one actor call)
        and return the ack. With nothing recorded, the newest batch the journal does not
        hold yet is sent again (a restarted actor then gets every batch it lost, which
        land in its next export); None if nothing was recorded and nothing is owed.

        On a timeout, or while the actor is unreachable past ``retry_s``, the batch is
        kept and the next flush sends it again (the service merges it once); a refused
        batch is dropped (resending cannot help) and the error raised.
        """
        self._check_open()
        with self.buffer.lock:
            if self._unacked is None and len(self.buffer):
                self._seq += 1
                self._unacked = self.buffer.take_batch(step=0, rank=0, world_size=1,
                                                       seq=self._seq, final=False)
            batch = self._unacked
        if batch is None:
            return self.sender.resend_owed(timeout_s)
        try:
            ack = self.sender.send(batch, encode(batch), timeout_s, keep_undelivered=False)
        except Refused:
            self._unacked = None  # rejected: resending the same batch cannot help
            raise
        self._unacked = None
        self._last_flush = time.monotonic()
        return ack

    def close(self) -> None:
        """Flush what is left and end the recorder: recording afterwards raises. The
        batches the journal does not hold yet can no longer be resent after an actor
        restart once this object is gone."""
        if not self._closed:
            self.flush()
            self._closed = True

    def __enter__(self) -> StreamRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
