"""Streams: records with no step barrier, merged apart in windows and folded into the
step the driver names at export (AReaL's rollout paradigm). ``Streams`` is the component
the aggregator holds: the windows, and how far each stream client is durable.

A window lives in memory until its export, so a stream client keeps each batch it sent
until the journal holds the step its window went into (``StreamLedger``), as a rank keeps
a step's batch until the journal holds that step (``metricsvc.core.resend``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from metricsvc.core.batch import Batch
from metricsvc.core.errors import BatchRejected
from metricsvc.core.wire import as_batch
from metricsvc.service.admission import Admission
from metricsvc.service.published import Status
from metricsvc.service.run_declarations import RunDeclarations
from metricsvc.service.step import Part, PendingStep, Window

STREAM_RANK = 1 << 30  # streams declare after every rank: a rank's declaration goes first


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


class Streams:
    """The open window of each stream, and the ledger of what the journal holds."""

    def __init__(self, admission: Admission, counts: dict[str, int]) -> None:
        self.admission = admission  # the run's: a stream batch keeps the ranks' rules
        self.counts = counts  # the aggregator's counts, which health() reports
        self.windows: dict[str, Window] = {}
        self.ledger = StreamLedger()
        self._exports = 0

    def decode(self, item: Batch | bytes) -> Batch:
        """Return the Batch that ``item`` is or encodes; malformed bytes count as rejected."""
        try:
            return as_batch(item, self.admission.limits)
        except BatchRejected:
            self.counts["rejected"] += 1
            raise

    def submit(self, name: str, client: str, batch: Batch) -> Status:
        """Add a stream client's batch to the window of stream ``name`` (idempotent).

        Raises:
            BatchRejected: the batch breaks a rule, or the window would pass
                ``limits.max_keys_per_batch``; nothing of it was kept.
        """
        try:
            batch = self.admission.check(batch)
            window = self.windows.setdefault(name, Window())
            limit = self.admission.limits.max_keys_per_batch
            if len(window.keys) + len(batch.keys) > limit:
                raise BatchRejected(f"stream {name!r}: the window would exceed {limit} keys "
                                    f"(limit max_keys_per_batch)")
            if not window.add_batch(client, batch):
                self.counts["duplicate"] += 1
                return "duplicate"
        except BatchRejected:
            self.counts["rejected"] += 1
            raise
        self.counts["stream_batches"] += 1
        return "merged"

    def fold_into(self, name: str, step: int, target: PendingStep,
                  declarations: RunDeclarations) -> tuple[Window, Callable[[PendingStep], None]]:
        """Fold the open window of ``name`` into ``step`` (``target``), under the run's
        ``declarations``; a new window begins. Returns the exported window and its fold
        (to apply again when the step is rebuilt). Raises ``BatchRejected`` with the
        window kept if it cannot merge into the step."""
        declared = self.window(name).declared.values()
        declarations.check(declared, step, STREAM_RANK)
        fold = self.folder(name)
        fold(target)
        declarations.adopt(declared, step, STREAM_RANK)
        return self.exported(name, step), fold

    def window(self, name: str) -> Window:
        """Return the open window of ``name`` (an empty one if it has none)."""
        return self.windows.get(name) or Window()

    def folder(self, name: str) -> Callable[[PendingStep], None]:
        """Return what folds the open window of ``name`` into a step (again, when the step
        is rebuilt once the world size is agreed). Raises ``BatchRejected`` from the fold
        if the window's keys cannot merge into the step."""
        window = self.window(name)
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

        return fold

    def exported(self, name: str, step: int) -> Window:
        """The window of ``name`` went into ``step``: a new window begins. Returns the
        exported one."""
        window = self.window(name)
        self.ledger.exported(step, name, window.last_seq)
        self.windows[name] = Window()
        return window

    def summary(self) -> dict[str, int]:
        """Return the number of keys waiting in each stream window."""
        return {name: len(w.keys) for name, w in self.windows.items()}
