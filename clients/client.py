"""MetricClient: buffer a rank's records for the open step, merge locally, one RPC per flush."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray

from clients import metrics
from clients.summarize import (
    Row,
    add_dense,
    element_rows,
    merge_rows,
    sketch,
    summarize,
    summarize_many,
    to_host,
)
from clients.tracker import Tracker
from metricsvc.config import DEFAULT_NAME
from metricsvc.records import Batch, scalar_row
from metricsvc.reduce import AUTO, ReduceType
from metricsvc.sketch import SketchSpec, dense_to_sparse
from metricsvc.validation import check_key, check_rank


def _kind_name(code: int) -> str:
    return "AUTO (from the key name)" if code == AUTO else ReduceType(code).name


@dataclass
class _Entry:
    code: int
    expected: int
    row: Row
    sketch: Row | None = None


class MetricClient:
    """A rank's handle on the MetricWorker: record metrics for the open step, then flush.

    Recording never syncs a device: tensors are summarised on their device and
    merged there; ``wait_submit`` copies every row of the step to the host once
    and sends one batch in one actor call. The recording API is AReaL's
    ``stats_tracker`` (``stat``, ``denominator``, ``scalar``, ``scope``,
    ``record_timing``, ``get``) plus siiRL's ``submit_metric``.
    """

    def __init__(
        self,
        worker: Any = None,
        *,
        rank: int,
        world_size: int,
        start_step: int = 0,
        name: str | None = None,
        namespace: str | None = None,
        sketch_spec: SketchSpec | None = None,
        compile: bool | None = None,
    ) -> None:
        self.rank, self.world_size = check_rank(rank, world_size)
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self._worker = worker
        self._name = name or DEFAULT_NAME
        self._namespace = namespace
        self.sketch_spec = sketch_spec or SketchSpec()
        self.compile = compile
        self.step = int(start_step)
        self.last_closed: int | None = None
        self._buffer: dict[str, _Entry] = {}
        self._lock = threading.RLock()
        self._seq = 0
        self._unacked: Batch | None = None
        self._trackers: dict[str, Tracker] = {}
        self.tracker = Tracker(self)
        self.rpc_count = 0
        self.host_copies = 0

    @property
    def worker(self) -> Any:
        """The MetricWorker handle, looked up by name on first use if none was given."""
        if self._worker is None:
            self._worker = ray.get_actor(self._name, namespace=self._namespace)
        return self._worker

    # -- the tracker API (default tracker) ---------------------------------------------
    def stat(self, mask: Any = None, reduce: ReduceType | str = ReduceType.AVG_MIN_MAX,
             **kwargs: Any) -> None:
        """Record masked summaries; see ``Tracker.stat``.

        Raises:
            TypeError: a non-numeric value or a non-bool mask (the key is named).
            ValueError: a mask whose shape differs from the value's, an unknown denominator.
        """
        self.tracker.stat(mask, reduce, **kwargs)

    def denominator(self, **masks: Any) -> None:
        """Register bool masks by name; see ``Tracker.denominator``."""
        self.tracker.denominator(**masks)

    def scalar(self, **values: Any) -> None:
        """Record rank-identical numbers; see ``Tracker.scalar``."""
        self.tracker.scalar(**values)

    def weighted_mean(self, key: str, value: float, weight: float) -> None:
        """Record ``value`` counted ``weight`` times into the mean of ``key``."""
        self.tracker.weighted_mean(key, value, weight)

    def record_counts(self, keys: list[str], counts: Any, kind: ReduceType) -> None:
        """Record element ``i`` of a 1-D tensor/array as one value of ``keys[i]``."""
        self.tracker.record_counts(keys, counts, kind)

    def scope(self, name: str) -> Any:
        """Nest keys under ``name/``; a context manager and a decorator."""
        return self.tracker.scope(name)

    def record_timing(self, name: str) -> Any:
        """Time a block into ``timing_s/<name>`` (MAX across ranks)."""
        return self.tracker.record_timing(name)

    def get(self, name: str) -> Tracker:
        """Return the named tracker ``name``: keys prefixed ``name/``, scopes of its own."""
        check_key(name)
        with self._lock:
            tracker = self._trackers.get(name)
            if tracker is None:
                tracker = self._trackers[name] = Tracker(self, prefix=f"{name}/")
            return tracker

    # -- siiRL ---------------------------------------------------------------------------
    def submit_metric(self, metrics: Mapping[str, Any], world_size: int | None = None) -> None:
        """Record a plain dict, siiRL style: the reduction comes from each key's last segment.

        ``world_size`` is the number of ranks expected to send these keys
        (siiRL passes 1 for keys only rank 0 computes); default: all ranks.
        """
        if not isinstance(metrics, Mapping):
            raise TypeError(f"submit_metric expects a mapping, got {type(metrics).__name__}")
        expected = self._expected(world_size, metrics)
        rows = {check_key(k): summarize(v, key=k, compile=self.compile) for k, v in metrics.items()}
        self._record_all(rows, AUTO, expected)

    # siiRL's MetricClient methods; ``world_size`` is checked, the client's own is used.
    def compute_local_data_metric(self, batch: Mapping[str, Any],
                                  world_size: int | None = None) -> None:
        """Record the data metrics of a batch (``critic/*``, ``response/*``, ``prompt/*``)."""
        self._expected(world_size, {"critic/score": None})
        metrics.record_data_metrics(self.tracker, batch)
        metrics.record_process_memory(self.tracker)

    def compute_local_timing_metrics(self, batch: Mapping[str, Any],
                                     timing_raw: Mapping[str, float],
                                     world_size: int | None = None) -> None:
        """Record ``timing_s/*`` and ``timing_per_token_ms/*``."""
        self._expected(world_size, {"timing_s": None})
        metrics.record_timing_metrics(self.tracker, batch, timing_raw)

    def compute_local_throughout_metrics(self, batch: Mapping[str, Any],
                                         timing_raw: Mapping[str, float], n_gpus: int,
                                         world_size: int | None = None) -> None:
        """Record ``perf/total_num_tokens``, ``perf/time_per_step``, ``perf/throughput``."""
        self._expected(world_size, {"perf/throughput": None})
        metrics.record_throughput_metrics(self.tracker, batch, timing_raw, n_gpus)

    compute_local_throughput_metrics = compute_local_throughout_metrics  # the right spelling

    def process_local_validation_metrics(self, data_sources: Any, sample_inputs: Any,
                                         infos_dict: Mapping[str, Any], sample_turns: Any,
                                         world_size: int | None = None) -> None:
        """Record ``val-core/*``, ``val-aux/*`` and ``val/test_score/*``."""
        self._expected(world_size, {"val-core": None})
        metrics.record_validation_metrics(self.tracker, data_sources, sample_inputs,
                                          infos_dict, sample_turns)

    def _expected(self, world_size: int | None, keys: Mapping[str, Any]) -> int:
        if world_size is None:
            return 0
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
        if not 1 <= world_size <= self.world_size:
            first = next(iter(keys), "<none>")
            raise ValueError(
                f"world_size for keys like {first!r} must be in [1, {self.world_size}] "
                f"(this client's world size), got {world_size}"
            )
        return 0 if world_size == self.world_size else world_size

    # -- the buffer ----------------------------------------------------------------------
    def _record(self, values: Mapping[str, Any], mask: Any, kind: ReduceType) -> None:
        """Summarise ``{full key: value}`` under one mask and merge into the open step."""
        rows = summarize_many(values, mask, compile=self.compile)
        sketches = None
        if kind is ReduceType.QUANTILES:
            sketches = {k: sketch(v, mask, self.sketch_spec, key=k) for k, v in values.items()}
        self._record_all(rows, int(kind), 0, sketches)

    def _record_elements(self, keys: list[str], values: Any, kind: ReduceType) -> None:
        """Record element ``i`` of ``values`` as one value (count 1) of ``keys[i]``."""
        rows = element_rows(values, key=keys[0] if keys else "value")
        if len(rows) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(rows)} values (first key {keys[0]!r})")
        self._record_all(dict(zip(keys, rows)), int(kind), 0)

    def _record_weighted(self, key: str, value: float, weight: float) -> None:
        if not weight >= 0:
            raise ValueError(f"weight for key {key!r} must be >= 0, got {weight}")
        self._record_all({key: scalar_row(float(value), float(weight))}, int(ReduceType.AVG), 0)

    def _record_all(
        self,
        rows: dict[str, Row],
        code: int,
        expected: int,
        sketches: dict[str, Row] | None = None,
    ) -> None:
        with self._lock:
            # Check every key before touching the buffer: a bad call records nothing.
            for key in rows:
                entry = self._buffer.get(key)
                if entry is not None and entry.code != code:
                    raise ValueError(
                        f"key {key!r} was recorded as {_kind_name(entry.code)} in step "
                        f"{self.step}; recording it as {_kind_name(code)} would mix reductions"
                    )
            for key, row in rows.items():
                sk = None if sketches is None else sketches[key]
                entry = self._buffer.get(key)
                if entry is None:
                    self._buffer[key] = _Entry(code, expected, row, sk)
                    continue
                entry.row = merge_rows(entry.row, row)
                entry.expected = max(entry.expected, expected)
                if sk is not None:
                    entry.sketch = sk if entry.sketch is None else add_dense(entry.sketch, sk)

    def pending_keys(self) -> list[str]:
        """Return the keys recorded in the open step so far."""
        return list(self._buffer)

    # -- flushing ------------------------------------------------------------------------
    def wait_submit(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Close this rank's step: one host copy, one actor call, return after the ack.

        On a timeout or an actor error the batch is kept; calling again resends
        the same batch, which the service merges once. If the service rejects the
        batch, it is dropped, the step stays open and the error is raised.
        """
        with self._lock:
            if self._unacked is None:
                self._unacked = self._build_batch()
                self._buffer = {}
                for tracker in (self.tracker, *self._trackers.values()):
                    tracker._reset()
            batch = self._unacked
        self.rpc_count += 1
        try:
            ack = ray.get(self.worker.submit.remote(batch), timeout=timeout_s)
        except ValueError:
            self._unacked = None  # rejected by the service: retrying cannot help
            raise
        self._unacked = None
        self.last_closed = batch.step
        self.step = batch.step + 1
        return ack

    def _build_batch(self) -> Batch:
        keys = tuple(self._buffer)
        entries = list(self._buffer.values())
        with_sketch = [i for i, e in enumerate(entries) if e.sketch is not None]
        parts, copies = to_host([e.row for e in entries] + [entries[i].sketch for i in with_sketch])
        self.host_copies += copies
        k = len(entries)
        sketches = {
            i: dense_to_sparse(parts[k + j], self.sketch_spec) for j, i in enumerate(with_sketch)
        }
        self._seq += 1
        return Batch.build(
            step=self.step,
            rank=self.rank,
            world_size=self.world_size,
            seq=self._seq,
            final=True,
            keys=keys,
            data=parts[:k] if k else [],
            kinds=[e.code for e in entries],
            expected=[e.expected for e in entries],
            sketches=sketches,
            sketch_alpha=self.sketch_spec.alpha,
        )

    # -- reading -------------------------------------------------------------------------
    def wait_final_res(self, step: int | None = None, timeout: float | None = None) -> dict:
        """Return the merged metrics of ``step`` (default: the last step this rank closed)."""
        if step is None:
            step = self.last_closed
        self.rpc_count += 1
        ref = self.worker.wait_final_res.remote(step, timeout)
        # The actor enforces ``timeout``; the margin here only guards a lost actor.
        return ray.get(ref, timeout=None if timeout is None else timeout + 30)
