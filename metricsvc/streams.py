"""Streams: records with no step barrier, merged apart in windows and folded into the
step the driver names at export (AReaL's rollout paradigm). The aggregator's part.

A window lives in memory until its export, so a stream client keeps each batch it sent
until the journal holds the step its window went into (``StreamLedger``), as a rank keeps
a step's batch until the journal holds that step (``metricsvc.resend``)."""

from __future__ import annotations

import numpy as np

from metricsvc.errors import BatchRejected
from metricsvc.output import internal_rows
from metricsvc.published import Status
from metricsvc.records import Batch
from metricsvc.step import Part, PendingStep, Window
from metricsvc.wire import as_batch

_STREAM_RANK = 1 << 30  # streams declare after every rank: a rank's declaration goes first


class StreamLedger:
    """How far each stream client's batches are durable: exported into a step the journal
    holds. Positions are the client's batch numbers (``seq``), which grow by one per batch
    and reach the service in order."""

    def __init__(self) -> None:
        self.durable: dict[tuple[str, str], int] = {}  # (stream, client) -> newest seq
        self._exported: list[tuple[int, str, str, int]] = []  # (step, stream, client, seq)

    def exported(self, step: int, name: str, seqs: dict[str, int]) -> None:
        """Window ``name``, holding each client's batches up to ``seqs``, went into ``step``."""
        self._exported.extend((step, name, client, seq) for client, seq in seqs.items())

    def journaled(self, stream_seqs: dict[str, dict[str, int]]) -> None:
        """A journaled step held these windows (read back after a restart)."""
        for name, seqs in stream_seqs.items():
            for client, seq in seqs.items():
                self._advance((str(name), str(client)), int(seq))

    def through(self, name: str, client: str, durable_step: int | None) -> int | None:
        """Return the newest batch of ``client`` to stream ``name`` that a step up to
        ``durable_step`` (the journal's newest) holds; None: none yet."""
        if durable_step is not None and self._exported:
            later = []
            for entry in self._exported:
                if entry[0] <= durable_step:
                    self._advance((entry[1], entry[2]), entry[3])
                else:
                    later.append(entry)
            self._exported = later
        return self.durable.get((name, client))

    def forget_after(self, step: int) -> None:
        """A rewind supersedes the steps past ``step``: their windows are recorded afresh."""
        self._exported = [e for e in self._exported if e[0] <= step]

    def _advance(self, where: tuple[str, str], seq: int) -> None:
        self.durable[where] = max(seq, self.durable.get(where, seq))


class StreamMethods:
    """The aggregator's stream calls (mixed into ``Aggregator``: its state is shared)."""

    _windows: dict[str, Window]
    _pending: dict[int, PendingStep]
    stream_ledger: StreamLedger

    def decode(self, item: Batch | bytes) -> Batch:
        """Return the Batch that ``item`` is or encodes; malformed bytes count as rejected."""
        try:
            return as_batch(item, self.limits)
        except BatchRejected:
            self.counts["rejected"] += 1
            raise

    def stream_submit(self, name: str, client: str, batch: Batch) -> Status:
        """Add a stream client's batch to the window of stream ``name`` (idempotent)."""
        try:
            batch = self._checked(batch)
            window = self._windows.setdefault(name, Window())
            if len(window.keys) + len(batch.keys) > self.limits.max_keys_per_batch:
                raise BatchRejected(
                    f"stream {name!r}: the window would exceed {self.limits.max_keys_per_batch} "
                    f"keys (limit max_keys_per_batch)"
                )
            if not window.add_batch(client, batch):
                self.counts["duplicate"] += 1
                return "duplicate"
        except BatchRejected:
            self.counts["rejected"] += 1
            raise
        self.counts["stream_batches"] += 1
        return "merged"

    def export_stream(self, name: str, step: int, close: bool = False) -> tuple[dict, list]:
        """Fold the window of ``name`` into ``step`` and start a new window.

        Returns the window's metrics and the steps that became final. With
        ``close=True`` a step no rank has submitted becomes final with the window
        alone (streams without training ranks). Raises ``BatchRejected`` (and keeps
        the window) if the step is already final or the window cannot merge into it.
        """
        window = self._windows.get(name) or Window()
        if self.last_emitted is not None and step <= self.last_emitted:
            raise BatchRejected(
                f"stream {name!r}: step {step} is already final (last final step "
                f"{self.last_emitted}); export before the ranks close it, or name a later step"
            )
        target = self._pending.get(step)
        if target is None:
            self._check_ahead(step, f"stream {name!r}")
            self.admission.check_room(step, self._pending)
            target = PendingStep(step, self.world_size, self._clock())
        self.declarations.check(window.declared.values(), step, _STREAM_RANK)
        self._exports += 1
        part, keys, codes, sketches = window.as_part((1, name, self._exports))

        def fold(into: PendingStep) -> None:
            located = Part(part.order, None, into.locate(keys, codes, f"stream {name!r}"),
                           part.rows)
            into.add(located, keys, codes, np.zeros(len(keys), dtype=np.int32), sketches, True)
            into.declare(window.declared.values(), window.about)
            into.streams.append(name)
            seqs = into.stream_seqs.setdefault(name, {})
            for client, seq in window.last_seq.items():
                seqs[client] = max(seq, seqs.get(client, seq))

        fold(target)
        self.declarations.adopt(window.declared.values(), step, _STREAM_RANK)
        self.stream_ledger.exported(step, name, window.last_seq)
        self._pending[step] = target
        if self.world_size is None:
            target.keep_source(None, None, fold)
        target.stream_only = target.stream_only or close
        self._windows[name] = Window()
        kinds = self.out.kinds(keys, codes)
        preview = self.out.metrics(window.merged(), keys, kinds, internal_rows(keys), {},
                                derive=False)
        return preview, self._emit_ready()

    def windows_summary(self) -> dict[str, int]:
        """Return the number of keys waiting in each stream window."""
        return {name: len(w.keys) for name, w in self._windows.items()}
