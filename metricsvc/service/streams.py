"""Streams: records with no step barrier, merged apart in windows and folded into the
step the driver names at export (AReaL's rollout paradigm). ``Streams`` is the component
the aggregator holds: the windows, and how far the journal holds each stream client's
batches.

A window lives in memory until its export, so a stream client keeps each batch it sent
until the journal holds the step its window went into (``StreamLedger``), as a rank keeps
a step's batch until the journal holds that step (``metricsvc.core.resend``)."""

from __future__ import annotations

from collections.abc import Callable

from metricsvc.core.keys import is_int
from metricsvc.core.wire import Batch
from metricsvc.errors import BatchRejected
from metricsvc.service.steps import PendingStep, Window

STREAM_RANK = 1 << 30  # streams declare after every rank: a rank's declaration goes first


class StreamLedger:
    """How far the journal holds each stream client's batches (exported into a journaled
    step). Positions are the client's batch numbers (``seq``), which grow by one per batch
    and reach the service in order."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str], int] = {}  # (stream, client) -> newest seq
        self._exported: list[tuple[int, str, str, int]] = []  # (step, stream, client, seq)

    def exported(self, step: int, name: str, seqs: dict[str, int]) -> None:
        """Window ``name``, holding each client's batches up to ``seqs``, went into ``step``."""
        self._exported.extend((step, name, client, seq) for client, seq in seqs.items())

    def journaled(self, stream_seqs: dict[str, dict[str, int]]) -> None:
        """A journaled step held these windows, or a journaled rewind settled them (read
        back after a restart)."""
        for name, seqs in stream_seqs.items():
            if not isinstance(seqs, dict):
                continue
            for client, seq in seqs.items():
                if is_int(seq):
                    self._advance((str(name), str(client)), int(seq))

    def through(self, name: str, client: str, journal_through: int | None) -> int | None:
        """Return the newest batch of ``client`` to stream ``name`` that a step up to
        ``journal_through`` (the journal's newest) holds; None: none yet."""
        if journal_through is not None and self._exported:
            later = []
            for entry in self._exported:
                if entry[0] <= journal_through:
                    self._advance((entry[1], entry[2]), entry[3])
                else:
                    later.append(entry)
            self._exported = later
        return self.held.get((name, client))

    def superseded(self, step: int, final_through: int | None) -> dict[str, dict[str, int]]:
        """What a rewind to ``step`` settles: ``{stream: {client: seq}}``, each client's
        newest batch exported into a step past ``step``. Those windows are recorded afresh,
        so their batches are never merged again: a client resending them after a restart
        would put them in the rerun's window. A client is settled only where every batch
        of its before them went into a final step (through ``final_through``: the journal
        holds it once it records the rewind); a window folded into a step still open keeps
        the client's batches owed."""
        past: dict[tuple[str, str], int] = {}
        open_before: set[tuple[str, str]] = set()
        for at, name, client, seq in self._exported:
            if at > step:
                past[(name, client)] = max(seq, past.get((name, client), seq))
            elif final_through is None or at > final_through:
                open_before.add((name, client))
        settled: dict[str, dict[str, int]] = {}
        for (name, client), seq in past.items():
            if (name, client) not in open_before:
                settled.setdefault(name, {})[client] = seq
        return settled

    def forget_after(self, step: int, settled: dict[str, dict[str, int]]) -> None:
        """A rewind supersedes the steps past ``step``: their windows are recorded afresh,
        and the batches ``settled`` (``superseded``) are never resent."""
        self._exported = [e for e in self._exported if e[0] <= step]
        self.journaled(settled)

    def _advance(self, where: tuple[str, str], seq: int) -> None:
        self.held[where] = max(seq, self.held.get(where, seq))


class Streams:
    """The open window of each stream, and the ledger of what the journal holds."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys  # a window holds at most this many keys (max_keys_per_batch)
        self.windows: dict[str, Window] = {}
        self.ledger = StreamLedger()
        self._exports = 0

    def add(self, name: str, client: str, batch: Batch) -> bool:
        """Add a stream client's checked batch to the window of stream ``name``; False (and
        nothing kept) if the window holds it already.

        Raises:
            BatchRejected: the window would pass ``limits.max_keys_per_batch``.
        """
        window = self.windows.setdefault(name, Window())
        if len(window.keys) + len(batch.keys) > self.max_keys:
            raise BatchRejected(f"stream {name!r}: the window would exceed {self.max_keys} "
                                f"keys (limit max_keys_per_batch)")
        return window.add_batch(client, batch)

    def window(self, name: str) -> Window:
        """Return the open window of ``name`` (an empty one if it has none)."""
        return self.windows.get(name) or Window()

    def folder(self, name: str) -> Callable[[PendingStep], None]:
        """Return what folds the open window of ``name`` into a step (again, when the step
        is rebuilt once the world size is agreed). Raises ``BatchRejected`` from the fold
        if the window's keys cannot merge into the step."""
        window = self.window(name)
        self._exports += 1
        order = (1, name, self._exports)  # stream windows merge after every rank
        return lambda into: into.take_window(name, window, order)

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
