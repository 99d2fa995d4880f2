"""The recording API, and the two clients it records for.

``Tracker`` is AReaL's ``stats_tracker`` (``denominator / stat / scalar / weighted_mean /
scope / record_timing / get``), with one difference that matters: nothing is reduced on
the rank; every call records sufficient statistics that the service merges exactly across
ranks. Scopes live in a ``ContextVar`` per tracker, so concurrent coroutines (or threads)
never see each other's scope.

``MetricClient`` is a rank's tracker: it closes each step (``flush`` / ``wait_submit``: one
host copy, one message) and answers siiRL's calls by their names. ``StreamRecorder`` is a
stream's (AReaL's rollout paradigm): no step barrier; its windows are exported by the
driver into the step it names.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import numpy as np
import ray

from metricsvc.client import metrics as families
from metricsvc.client.buffer import RecordBuffer, StepCursor
from metricsvc.client.summaries import Rows, checked_text, element_rows
from metricsvc.client.tensors import is_tensor
from metricsvc.core.declare import Derived
from metricsvc.core.keys import (
    DEFAULT_NAME,
    VERSION_SEGMENT,
    check_key,
    check_rank,
    default_namespace,
    is_int,
)
from metricsvc.core.limits import MAX_TOP, RETRY_S, Recent
from metricsvc.core.records import scalar_row
from metricsvc.core.reduce import AUTO, KINDS, ReduceType
from metricsvc.core.sketch import SketchSpec
from metricsvc.core.wire import encode
from metricsvc.errors import ServiceNotice, ServiceUnavailable
from metricsvc.transport import Sender, ServiceHandle

_ids = itertools.count()

class Tracker:
    """The recording API (AReaL's ``stats_tracker``): records into a ``RecordBuffer``'s open
    step under an optional name prefix and scopes. ``MetricClient`` and ``StreamRecorder``
    are trackers; ``get(name)`` returns a named one over the same buffer."""

    def __init__(
        self,
        buffer: RecordBuffer,
        prefix: str = "",
        *,
        timing_prefix: str = "timing_s/",
        timing_reduce: ReduceType = ReduceType.MAX,
    ) -> None:
        self.buffer = buffer
        self.prefix = prefix
        self.timing_prefix = timing_prefix
        self.timing_reduce = timing_reduce
        self._scope: ContextVar[tuple[str, ...]] = ContextVar(f"metricsvc_scope_{next(_ids)}",
                                                              default=())
        self._full: Recent = Recent(1024)  # (scopes, keys) -> their checked full keys

    # -- keys and scopes ---------------------------------------------------------------
    def full_key(self, key: str) -> str:
        """Return ``key`` under this tracker's prefix and the current scopes."""
        return self.prefix + "/".join((*self._scope.get(), key))

    def _key(self, key: str) -> str:
        """Return the checked full key (name rules, reserved ``__`` segments)."""
        return self.buffer.checked(self.full_key(key))

    def _keys(self, values: dict[str, Any]) -> dict[str, Any]:
        """Return ``values`` by checked full key; a call's keys recur every step, so their
        full keys are worked out once per scope (a key is checked once: its rules cannot
        change, and an internal key's reader, once declared, stays declared)."""
        known = (self._scope.get(), tuple(values))
        full = self._full.get(known)
        if full is None:
            full = self._full[known] = tuple(self._key(k) for k in values)
        return dict(zip(full, values.values()))

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Nest keys under ``name/`` (a context manager, and a decorator)."""
        if not isinstance(name, str) or not name.strip("/"):
            raise ValueError(f"scope name must be a non-empty string, got {name!r}")
        token = self._scope.set((*self._scope.get(), name.strip("/")))
        try:
            yield
        finally:
            self._scope.reset(token)

    # -- recording ---------------------------------------------------------------------
    def denominator(self, **masks: Any) -> None:
        """Register bool masks by name for ``stat(denominator=name)``; exports their counts.

        Raises:
            TypeError: a mask that is not bool (the denominator is named).
        """
        if not masks:
            raise TypeError("denominator() got no masks: pass them as keywords, "
                            "e.g. denominator(n_tokens=mask)")
        named = {}
        for name, mask in masks.items():
            dtype = mask.dtype if (is_tensor(mask) or isinstance(mask, np.ndarray)) else None
            is_bool = dtype is not None and str(dtype) in ("bool", "torch.bool")
            if not is_bool:
                got = dtype if dtype is not None else type(mask).__name__
                raise TypeError(f"denominator {name!r} must be a bool tensor or array, got {got}")
            named[self._key(name)] = mask
        self.buffer.denominate(named)

    def _lookup(self, name: str, for_key: str) -> Any:
        scopes = self._scope.get()
        for depth in range(len(scopes), -1, -1):  # innermost scope first, then outwards
            candidate = self.prefix + "/".join((*scopes[:depth], name))
            if candidate in self.buffer.denominators:
                return self.buffer.denominators[candidate]
        known = sorted(self.buffer.denominators) or "none registered in this step"
        raise ValueError(f"unknown denominator {name!r} for key {for_key!r}; known: {known}")

    def stat(
        self,
        mask: Any = None,
        reduce: ReduceType | str = ReduceType.AVG_MIN_MAX,
        *,
        denominator: Any = None,
        reduce_type: ReduceType | str | None = None,
        ids: Any = None,
        top: int | None = None,
        text: Any = None,
        **values: Any,
    ) -> None:
        """Record masked summaries of tensors/arrays (AVG_MIN_MAX: mean, min and max).

        The mask is ``mask=`` (a bool tensor/array) or ``denominator=`` (a name
        given to ``denominator`` in this step, or a bool tensor); a string passed
        as ``mask`` is taken as a denominator name, as AReaL's positional call does.

        ``ids``: one sample id per row of the values (a batch's uid as an integer, or each
        row's index in the global batch), a tensor on the values' device or an array. The
        finished step's ``meta["extremes"]`` then names, for each exported min and max,
        the rank, the id and the position (``row``, ``col``) it came from, and ``call``:
        the key's recordings before it in that rank's step. Without ``ids`` it names the
        rank. Ids are carried as float64: integers up to 2**53 are exact.

        ``top=k`` (1 to 64): the finished step's ``meta["top"]`` also lists, for each
        exported min and max, the ``k`` smallest and largest samples of every rank (value,
        rank, and with ``ids`` the id; row, column, call), found where the values live and
        merged exactly: the k of the union, ties to the lower rank, call, row, column.

        ``text`` (with ``top``): each row's payload, one string per row (e.g. the decoded
        response) or a dict of such lists by field (``{"prompt": [...], "response":
        [...]}``); the samples ``top`` keeps carry theirs (``"text"``), cut to 1024 UTF-8
        bytes a sample (``"text_cut"``: the bytes left out). Only the rank's own k a side
        travel. ``mask``, ``denominator``, ``ids``, ``top`` and ``text`` are argument
        names, never keys.
        """
        if isinstance(mask, str):
            mask, denominator = None, mask
        elif isinstance(mask, ReduceType):
            raise TypeError(
                "stat()'s first argument is a mask or a denominator name; "
                "pass the kind as reduce=..."
            )
        if mask is not None and denominator is not None:
            raise ValueError("give either mask= or denominator=, not both")
        if not values:
            own = {"reduce": None if reduce is ReduceType.AVG_MIN_MAX else reduce,
                   "denominator": denominator, "reduce_type": reduce_type, "ids": ids,
                   "top": top, "text": text}  # a key of such a name is taken as the argument
            taken = [repr(name) for name, given in own.items() if given is not None]
            raise TypeError(
                "stat() got no values to record: pass them as keywords, e.g. "
                "stat(mask=m, loss=t)" + ("; a tensor passed positionally is taken as the "
                                          "mask" if mask is not None else "")
                + (f"; stat()'s arguments are never keys: {', '.join(taken)} went to the "
                   f"argument of that name (name the metric otherwise)" if taken else "")
            )
        kind = reduce_type if reduce_type is not None else reduce
        if kind.__class__ is not ReduceType:
            kind = ReduceType.parse(kind)
        full = self._keys(values)
        if top is not None and (top.__class__ is not int or not 1 <= top <= MAX_TOP):
            raise ValueError(f"stat(top=) for key {next(iter(full))!r}: top is how many of the "
                             f"largest and smallest samples to keep, an int from 1 to "
                             f"{MAX_TOP}; got {top!r}")
        if (ids is not None or top is not None) and not KINDS[kind].extremes:
            raise ValueError(
                f"stat({'ids' if ids is not None else 'top'}=) for key {next(iter(full))!r}: "
                f"ids and top name the samples behind a min or max, and {kind.name} exports "
                f"neither (use "
                f"{', '.join(k.name for k, spec in KINDS.items() if spec.extremes)})")
        if text is not None:
            if top is None:
                raise ValueError(f"stat(text=) for key {next(iter(full))!r}: text is the "
                                 f"payload of the samples top=k keeps; pass top= too")
            text = checked_text(text, full)
        if isinstance(denominator, str):
            mask = self._lookup(denominator, next(iter(full), "<none>"))
        elif denominator is not None:
            mask = denominator
        self.buffer.record(full, mask, kind, ids, top=top, text=text)

    def stat_compact(self, mask: Any = None, reduce: ReduceType | str = ReduceType.AVG_MIN_MAX,
                     **values: Any) -> None:
        """AReaL's ``stat_compact(mask, reduce_type, **values)``: four scalars a batch there
        instead of the tensors; every ``stat`` here keeps only a compact record, so it is
        ``stat`` (``denominator=``, ``reduce_type=`` and ``ids=`` included)."""
        self.stat(mask, reduce, **values)

    def record_as(self, kinds: ReduceType | Mapping[str, ReduceType], values: dict[str, Any],
                  mask: Any = None, masks: Mapping[str, Any] | None = None) -> None:
        """Record ``values`` whose arguments are right by construction (a built-in family):
        each key with its declared kind (``kinds``: one for all, or one per key), under
        ``mask`` or each under its own (``masks``). Plain numbers of several kinds are one
        record of the buffer."""
        full = self._keys(values)
        if kinds.__class__ is dict or isinstance(kinds, Mapping):
            kinds = dict(zip(full, map(kinds.__getitem__, values)))
        if masks is not None:
            masks = dict(zip(full, map(masks.__getitem__, values)))
        self.buffer.record(full, mask, kinds, masks=masks)

    def stat_each(self, reduce: ReduceType | str = ReduceType.AVG_MIN_MAX, *,
                  kinds: dict[str, ReduceType | str] | None = None,
                  **values: tuple[Any, Any]) -> None:
        """Record each key's value under its own mask, ``stat_each(length=(lengths, None),
        correct_length=(lengths, rewards > 0.5))``: what one ``stat`` call per mask records,
        with the short host vectors (a value per sequence) summarised in one pass.
        ``kinds``: the kind of some keys, where it is not ``reduce``.

        Raises:
            TypeError: a value that is not a ``(value, mask)`` pair, or what ``stat`` raises.
        """
        if not values:
            raise TypeError("stat_each() got no values: pass (value, mask) pairs as keywords, "
                            "e.g. stat_each(length=(lengths, mask))")
        for key, pair in values.items():
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"stat_each: the value for key {key!r} must be a (value, mask) "
                                f"pair (mask None for every position), got "
                                f"{type(pair).__name__}")
        kind = ReduceType.parse(reduce)
        kinds = {key: ReduceType.parse(k) for key, k in (kinds or {}).items()}
        self.record_as({k: kinds.get(k, kind) for k in values},
                       {k: v for k, (v, _) in values.items()},
                       masks={k: m for k, (_, m) in values.items()})

    def declare(self, *declarations: Derived) -> None:
        """Declare derived metrics (names and inputs under this tracker's prefix and scopes);
        see ``RecordBuffer.declare``."""
        prefix = self.full_key("")
        self.buffer.declare(*(d.under(prefix) if isinstance(d, Derived) else d
                              for d in declarations))  # the buffer names what is not one

    def scalar(self, **values: Any) -> None:
        """Record rank-identical numbers (e.g. a learning rate); mismatches are flagged.

        Raises:
            ValueError: a tensor or array with more than one element (the key is named).
        """
        if not values:
            raise TypeError("scalar() got no values: pass them as keywords, e.g. scalar(lr=1e-5)")
        for key, value in values.items():
            size = value.numel() if is_tensor(value) else np.size(value)
            if size != 1:
                raise ValueError(
                    f"scalar {key!r} must be a single number, got {size} elements; "
                    f"use stat() for tensors"
                )
        full = {self._key(k): v for k, v in values.items()}
        self.buffer.record(full, None, ReduceType.SCALAR)

    def record_counts(self, keys: list[str], counts: Any, kind: ReduceType) -> None:
        """Record element ``i`` of a 1-D tensor/array as one value of ``keys[i]``."""
        full = tuple(self._key(k) for k in keys)
        rows = element_rows(counts, key=full[0] if full else "value")
        if len(rows) != len(full):
            raise ValueError(f"{len(full)} keys for {len(rows)} values (first key {keys[0]!r})")
        self.buffer.keep(Rows(full, rows), int(kind))

    def weighted_mean(self, key: str, value: float, weight: float) -> None:
        """Record ``value`` counted ``weight`` times into the mean of ``key``."""
        full = self._key(key)
        if not weight >= 0:
            raise ValueError(f"weight for key {full!r} must be >= 0, got {weight}")
        self.buffer.keep(Rows((full,), scalar_row(float(value), float(weight))[None]),
                         int(ReduceType.AVG))

    def record_timing(self, name: str, *,
                      device: bool = False) -> contextlib.AbstractContextManager[None]:
        """Time the block into ``timing_s/<name>`` (MAX across ranks by default).
        ``device=True``: the time the block's work took on the CUDA device (events on the
        current stream, read at the flush with one wait per device, never per block); on
        the CPU the wall time, as AReaL's."""
        key = check_key(f"{self.prefix}{self.timing_prefix}{name}")
        return self.buffer.timed(key, self.timing_reduce, device)

    def get(self, name: str) -> Tracker:
        """Return the named tracker ``name``: keys prefixed ``name/``, scopes of its own."""
        prefix = check_key(self.prefix + name)
        with self.buffer.lock:
            tracker = self.buffer.trackers.get(prefix)
            if tracker is None:
                tracker = Tracker(self.buffer, prefix=f"{prefix}/")
                self.buffer.trackers[prefix] = tracker
            return tracker

    def pending_keys(self) -> list[str]:
        """Return the keys recorded since the last flush."""
        return self.buffer.keys()

    @property
    def host_copies(self) -> int:
        """Device-to-host copies made by flushes so far."""
        return self.buffer.host_copies


class MetricClient(Tracker):
    """A rank's handle on the MetricWorker: record metrics for the open step, then close it.

    Recording never syncs a device: tensors are summarised on their device; closing a step
    (``flush``, ``wait_submit``) copies its records to the host once and sends one batch in
    one message. The recording API is AReaL's ``stats_tracker`` (``stat``, ``denominator``,
    ``scalar``, ``scope``, ``record_timing``, ``get``) plus siiRL's calls by their names
    (``submit_metric``, ``compute_local_*``, ``wait_submit``, ``wait_final_res``).

    Batches stay in memory until the service's journal holds their step: if the actor
    restarts (and loses the steps it had not journaled), the client resends them, and the
    service merges each ``(step, rank, seq)`` once.
    """

    def __init__(
        self,
        worker: Any = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        start_step: int = 0,
        name: str | None = None,
        namespace: str | None = None,
        sketch_spec: SketchSpec | None = None,
        compile: bool | None = None,
        retry_s: float = RETRY_S,
        max_inflight: int = 256,
        max_unacked: int = 4,
        via: str | None = None,
    ) -> None:
        if rank is None or world_size is None:  # siiRL's MetricClient(metric_worker)
            raise TypeError(
                "MetricClient needs rank= and world_size=: siiRL's client passes world_size "
                "to each call, this one is one rank's (MetricClient(metric_worker, "
                "rank=rank, world_size=world_size))")
        self.rank, self.world_size = check_rank(rank, world_size)
        if max_unacked < 1:
            raise ValueError(f"max_unacked must be >= 1, got {max_unacked}")
        self.max_unacked = max_unacked
        self.retry_s = retry_s
        self.service = ServiceHandle(worker, name or DEFAULT_NAME,
                                     namespace or default_namespace(), via, self.rank, retry_s)
        super().__init__(RecordBuffer(sketch_spec, compile))  # the client is its own tracker
        self.cursor = StepCursor(self.rank, self.world_size, start_step, self.buffer)
        self.sender = Sender(self.service, "submit", f"rank {self.rank}", owner=self,
                             max_inflight=max_inflight)
        self._timed_out: int | None = None  # a wait_submit's step whose answer is not in
        if via is not None and worker is None:
            self.connect()  # register with the combiner before step 0

    @property
    def worker(self) -> Any:
        """Where batches go: the combiner ``via`` names, this node's combiner (topology
        per_node) or the MetricWorker itself, looked up by name on first use."""
        return self.service.target

    @property
    def rpc_count(self) -> int:
        """Actor calls this client made to the service."""
        return self.service.calls

    def connect(self) -> MetricClient:
        """Find the service now instead of at the first flush; under ``topology: per_node``
        this registers the rank with its node's combiner, so that the run's first step,
        too, reaches the MetricWorker in one call per node. Returns the client."""
        _ = self.worker
        return self

    def stream(self, name: str, **kwargs: Any) -> StreamRecorder:
        """Return a recorder for stream ``name``: no step barrier; see ``StreamRecorder``.
        It sends to the MetricWorker itself, never through a node's combiner."""
        return StreamRecorder(self.service.to_metric_worker(), name,
                              sketch_spec=self.buffer.sketch_spec, compile=self.buffer.compile,
                              **kwargs)

    # -- closing steps -------------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], step: int | None = None, *,
            commit: bool = True) -> None:
        """Record a plain dict for ``step`` and close it, as ``wandb.log(metrics, step=)``
        and verl's ``Tracking.log(data, step)`` do (reductions from the key names, as
        ``submit_metric``). ``step`` defaults to the open step; ``commit=False`` records
        without closing, so that several calls build one step. Closing is ``flush()``: it
        does not wait for the service."""
        if step is not None:
            with self.buffer.lock:
                self.cursor.name(step, "log")  # before recording: the dict is ``step``'s
        self.submit_metric(metrics)
        if commit:
            self.flush()

    def flush(self, *, step: int | None = None) -> None:
        """Close this rank's step without waiting for the service: one host copy, one
        encoding and the call made; the client moves to the next step at once.

        One batch is delivered at a time, in step order. Answers are read at the next
        ``flush`` / ``wait_submit`` / ``wait_acks``: a refusal (``BatchRejected``, with a note
        naming the step), a late or late-joining step (``LateBatch``, ``StepAlreadyFinal``)
        or a notice is raised or warned there, after this call's own step is handed over:
        an error about step N never costs step N+1 its records. At most ``max_unacked``
        flushes wait for their answer: one more waits for the oldest. ``step`` as for
        ``wait_submit``.
        """
        self._close(step, "flush")

    def _close(self, step: int | None, caller: str) -> None:
        """Close the step, hand its batch to the sender, and read the answers that are in:
        their errors reach the caller now, after this step is handed over."""
        sender = self.sender
        if (sender.in_flight >= self.max_unacked
                and not sender.wait_until(self.max_unacked, self.retry_s + 60)):
            raise ServiceUnavailable(f"rank {self.rank}: {self.in_flight} flushes "
                                     f"unanswered for {self.retry_s + 60} s")
        batch = self.cursor.close(step, caller)
        sender.hand_over(batch, encode(batch))
        if sender.answers:
            self._read_answers(batch.step)

    def wait_submit(self, timeout_s: float | None = None, *,
                    step: int | None = None) -> dict[str, Any]:
        """Close this rank's step and wait for the service's answer; return its ack (siiRL's
        blocking meaning: ``flush`` is the same without the wait).

        ``step`` names the step the caller means (e.g. the trainer's global step). The
        client moves to it if nothing recorded since its last close is pending (a first
        close, a step after ``discard()``, a rank that skipped steps). A close of a step at
        or below the last one closed (a retried or twice-logged step), or of another step
        while records of the open one are pending (an exception between recording and
        closing), is refused: ``StepMismatch`` names the call and the keys, the close's
        records are dropped (never merged into another step), nothing is sent, and the
        next step the caller names is taken.

        While the actor restarts the call waits (up to ``retry_s``). After ``timeout_s``
        it raises ``GetTimeoutError``: the step is closed all the same, its batch delivered
        in the background (a resend merges once) and its answer read at the next call. A
        refused batch (``metricsvc.errors.Refused``, raised) closes the step all the same:
        its records are dropped and the client moves to the next step.
        """
        self._close(step, "wait_submit")
        if not self.sender.wait_until(1, timeout_s):
            self._timed_out = self.cursor.last_closed
            raise ray.exceptions.GetTimeoutError(
                f"rank {self.rank}: step {self.cursor.last_closed} was closed, but the service "
                f"did not answer within {timeout_s} s; its batch is delivered in the "
                f"background and its answer read at the next call")
        acks = self.sender.read_answers(self.cursor.answered)
        self._timed_out = None  # every close is answered
        return acks[-1]

    def wait_acks(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Wait until every close is answered; return the acks not read yet, oldest first.
        Raises what the first refused or late one raises (see ``flush``), or
        ``GetTimeoutError`` after ``timeout_s``. Call it before the process ends: an answer
        nobody reads cannot raise (a dropped client's is logged)."""
        if not self.sender.wait_until(1, timeout_s):
            raise ray.exceptions.GetTimeoutError(
                f"rank {self.rank}: {self.in_flight} flushes unanswered after {timeout_s} s")
        return self._read_answers(None)

    def _read_answers(self, handed_over: int | None) -> list[dict[str, Any]]:
        acks = self.sender.read_answers(self.cursor.answered, handed_over)
        if self._timed_out is not None and not self.in_flight:
            self._timed_out = None
        return acks

    @property
    def step(self) -> int:
        """The open step: what is recorded now belongs to it."""
        return self.cursor.step

    @property
    def last_closed(self) -> int | None:
        """The last step this rank closed (None before the first)."""
        return self.cursor.last_closed

    def discard(self) -> int:
        """Drop what was recorded for the open step; return how many keys were dropped. The
        step stays open: after a failed training step, the service publishes it without
        this rank (partial) unless the rank records and closes it again. A closed step
        cannot be withdrawn: after a ``wait_submit`` that timed out, its batch is delivered
        all the same (a ``ServiceNotice`` says so)."""
        if self._timed_out is not None:
            warnings.warn(ServiceNotice(
                f"rank {self.rank}: discard() cannot withdraw step {self._timed_out}'s batch: "
                f"wait_submit closed that step before it timed out, so it may have been "
                f"merged; it is delivered (merged once), and step {self._timed_out} holds this "
                f"rank's records"), stacklevel=2)
            self._timed_out = None
        return self.cursor.discard()

    @property
    def resent(self) -> int:
        """Batches sent again to a restarted actor."""
        return self.sender.outbox.resent

    @property
    def in_flight(self) -> int:
        """Closes not answered yet."""
        return self.sender.in_flight

    # -- siiRL's calls: the same names and arguments -------------------------------------
    # siiRL passes ``world_size`` to every call; here each client is one rank's and knows
    # its world size, so the argument is checked (``1 <= world_size <= the client's``:
    # siiRL passes 1 for keys only rank 0 computes) and otherwise means the ranks expected
    # to send those keys.
    def submit_metric(self, metrics: Mapping[str, Any], world_size: int | None = None) -> None:
        """Record a plain dict, siiRL style: the reduction comes from each key's last segment.
        ``world_size``: the number of ranks expected to send these keys (siiRL passes 1 for
        keys only rank 0 computes); default: all ranks."""
        if not isinstance(metrics, Mapping):
            raise TypeError(f"submit_metric expects a mapping, got {type(metrics).__name__}")
        expected = 0 if world_size is None else self._expected(world_size, metrics)
        if not self.buffer.good_keys.issuperset(metrics):  # else every name was checked
            for key in metrics:
                self.buffer.checked(key)
        try:
            self.buffer.record(metrics, None, AUTO, expected=expected)
        except TypeError:  # a value that is no number: say what a siiRL StdStats becomes
            key = next((k for k, v in metrics.items() if _is_std_stats(v)), None)
            if key is None:
                raise
            raise TypeError(
                f"submit_metric: {key!r} is a siiRL StdStats (sum, sum_sq, count): record "
                f"the values themselves, stat(reduce='std', **{{{key.removesuffix('/std')!r}: "
                f"values}}), an exact std over every rank's values") from None

    def compute_local_data_metric(self, batch: Mapping[str, Any],
                                  world_size: int | None = None) -> None:
        """Record the data metrics of a batch (``critic/*``, ``response/*``, ``prompt/*``)."""
        self._expected(world_size, {"critic/score": None})
        families.record_data_metrics(self, batch)
        families.record_process_memory(self)

    def compute_local_timing_metrics(self, batch: Mapping[str, Any],
                                     timing_raw: Mapping[str, float],
                                     world_size: int | None = None) -> None:
        """Record ``timing_s/*`` and ``timing_per_token_ms/*``."""
        self._expected(world_size, {"timing_s": None})
        families.record_timing_metrics(self, batch, timing_raw)

    def compute_local_throughout_metrics(self, batch: Mapping[str, Any],
                                         timing_raw: Mapping[str, float], n_gpus: int,
                                         world_size: int | None = None) -> None:
        """Record ``perf/total_num_tokens``, ``perf/time_per_step``, ``perf/throughput``."""
        self._expected(world_size, {"perf/throughput": None})
        families.record_throughput_metrics(self, batch, timing_raw, n_gpus)

    compute_local_throughput_metrics = compute_local_throughout_metrics  # the right spelling

    def compute_log_prob_diff_metrics(self, data: Mapping[str, Any],
                                      world_size: int | None = None) -> None:
        """Record siiRL's ``actor/rollout_probs_diff_*``: |exp(rollout_log_prob) -
        exp(old_log_probs)| over the response mask (max, mean and std, exact over every
        rank's tokens); nothing where the batch lacks either log-prob, as siiRL."""
        self._expected(world_size, {"actor/rollout_probs_diff_max": None})
        families.record_rollout_probs_diff(self, data)

    def process_local_validation_metrics(self, data_sources: Any, sample_inputs: Any,
                                         infos_dict: Mapping[str, Any], sample_turns: Any,
                                         world_size: int | None = None) -> None:
        """Record ``val-core/*``, ``val-aux/*`` and ``val/test_score/*``."""
        self._expected(world_size, {"val-core": None})
        families.record_validation_metrics(self, data_sources, sample_inputs, infos_dict,
                                           sample_turns)

    def stop(self) -> None:
        """siiRL's ``MetricClient.stop()``: wait until the service has taken every batch this
        rank handed over (the driver ends the service: ``metricsvc.stop_metric_worker``)."""
        self.wait_acks()

    def wait_final_res(self, step: int | None = None, timeout_s: float | None = None, *,
                       timeout: float | None = None) -> dict:
        """Return the merged metrics of ``step`` (default: the last step this rank closed).
        Raises ``StepNotFinal`` (a TimeoutError) after ``timeout_s`` seconds (``timeout=``,
        siiRL's spelling, is accepted too)."""
        if timeout is not None:
            if timeout_s is not None:
                raise TypeError("give timeout_s or timeout, not both")
            timeout_s = timeout
        step = self.last_closed if step is None else step
        # The actor enforces ``timeout_s``; the margin here only guards a lost actor.
        return self.service.call("wait_final_res", step, timeout_s,
                                 timeout_s=None if timeout_s is None else timeout_s + 30)

    def _expected(self, world_size: int | None, keys: Mapping[str, Any]) -> int:
        """The ranks expected to send ``keys`` (0: every rank), from siiRL's ``world_size``."""
        if world_size is None:
            return 0
        if not is_int(world_size):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
        if not 1 <= world_size <= self.world_size:
            first = next(iter(keys), "<none>")
            raise ValueError(
                f"world_size for keys like {first!r} must be in [1, {self.world_size}] "
                f"(this client's world size), got {world_size}")
        return 0 if world_size == self.world_size else world_size


class StreamRecorder(Tracker):
    """Records for stream ``name`` (keys prefixed ``name/``, like AReaL's ``get(name)``): no
    step barrier. The driver's ``worker.export_stream.remote(name, step)`` publishes what
    every recorder of the stream flushed since the last export with that step (merged
    count-weighted, like any step) and starts a new window; records still in a recorder's
    buffer at the export go to the next window: nothing is lost or counted twice.

    Flushes (one actor call) once ``flush_every`` keys are waiting or ``flush_interval_s``
    seconds have passed at a recording, on ``flush()`` and on ``close()``. Each batch is kept
    until the journal holds the step its window was exported into, and resent to a
    restarted actor (whose windows died with it). Streams go to the MetricWorker itself,
    never through a node's combiner, which gathers ranks' steps.
    """

    def __init__(
        self,
        service: ServiceHandle,
        name: str,
        *,
        sketch_spec: SketchSpec | None = None,
        compile: bool | None = None,
        flush_every: int = 256,
        flush_interval_s: float = 1.0,
        max_inflight: int = 1024,
    ) -> None:
        """``service``: the MetricWorker itself (``MetricClient.stream`` gives it)."""
        self.name = check_key(name)
        self.client_id = uuid.uuid4().hex
        self.service = service
        super().__init__(RecordBuffer(sketch_spec, compile,
                                      label=f"stream {name!r} before its flush",
                                      on_record=self._maybe_flush), prefix=f"{name}/")
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self._seq = 0
        self._last_flush = time.monotonic()
        self._closed = False
        # Batches are numbered (seq) in the order sent: the position acks count in
        self.sender = Sender(service, "stream_submit", f"stream {name!r}", self.name,
                             self.client_id, owner=self, max_inflight=max_inflight,
                             by_seq=True)

    @property
    def rpc_count(self) -> int:
        """Actor calls this recorder made."""
        return self.service.calls

    def scalar(self, version: int | None = None, **values: Any) -> None:
        """``Tracker.scalar``; ``version``: the policy version that produced these values
        (AReaL's rollout paradigm): the step a window is exported into gets the
        staleness of its records (``<stream>/staleness/*``: that step minus each record's
        version) and, in the journal, the records per version. A negative version (a
        prompt's) is not counted."""
        checked = self._version(version)
        super().scalar(**values)
        self._count_version(checked)

    def stat(self, mask: Any = None, reduce: ReduceType | str = ReduceType.AVG_MIN_MAX, *,
             version: int | None = None, **kwargs: Any) -> None:
        """``Tracker.stat``; ``version`` as in ``scalar`` (one record per call). A stream's
        window names the stream, not samples: ``top=`` and ``text=`` are refused."""
        checked = self._version(version)
        if kwargs.get("top") is not None or kwargs.get("text") is not None:
            raise ValueError(f"stream {self.name!r}: a stream's records merge into a window "
                             f"that keeps no samples (its min and max name the stream); "
                             f"record top=/text= with the rank's client, client.stat(...)")
        super().stat(mask, reduce, **kwargs)
        self._count_version(checked)

    def _version(self, version: Any) -> int | None:
        if version is None:
            return None
        if not is_int(version):
            raise TypeError(f"stream {self.name!r}: version= is the policy version that "
                            f"produced the records, an int, got {type(version).__name__} "
                            f"({version!r}); 'version' is a reserved argument name here")
        return version

    def _count_version(self, version: int | None) -> None:
        """One record of ``version`` (after the call's values were kept: a bad call counts
        nothing)."""
        if version is not None and version >= 0:
            key = f"{self.prefix}{VERSION_SEGMENT}/{version}"
            self.buffer.keep(Rows((key,), scalar_row(1.0)[None]), int(ReduceType.SUM))

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

        While the actor is unreachable past ``retry_s`` the batch is kept and resent by
        the next flush (the service merges it once); a refused batch is dropped (resending
        cannot help) and the error raised. ``timeout_s``: how long to wait for the answer
        (``GetTimeoutError`` after it; the batch is still delivered).
        """
        self._check_open()
        with self.buffer.lock:
            if not len(self.buffer):
                return self.sender.resend_owed()
            self._seq += 1
            batch = self.buffer.take_batch(step=0, rank=0, world_size=1, seq=self._seq,
                                           final=False)
        self.sender.hand_over(batch, encode(batch))
        self._last_flush = time.monotonic()
        if not self.sender.wait_until(1, timeout_s):
            raise ray.exceptions.GetTimeoutError(
                f"stream {self.name!r}: no answer within {timeout_s} s; the batch is kept "
                f"and delivered")
        acks = self.sender.read_answers(lambda ack, batch: None)
        return acks[-1] if acks else None

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


def _is_std_stats(value: Any) -> bool:
    """True for siiRL's ``StdStats`` (or its dict form): a sum, a sum of squares, a count."""
    fields = ("sum", "sum_sq", "count")
    if isinstance(value, Mapping):
        return all(f in value for f in fields)
    return all(hasattr(value, f) for f in fields) and not hasattr(value, "shape")
