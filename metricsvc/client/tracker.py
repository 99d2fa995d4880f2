"""The AReaL ``stats_tracker``-style recording API, on top of a MetricClient's step buffer.

``denominator / stat / scalar / weighted_mean / scope / record_timing / get``
behave like AReaL's, with one difference that matters: nothing is reduced on
the worker; every call records sufficient statistics that the service merges
exactly across ranks. Scopes live in a ``ContextVar`` per tracker, so
concurrent coroutines (or threads) never see each other's scope.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import numpy as np

from metricsvc.client.blocks import record_kinds
from metricsvc.client.tensors import is_tensor
from metricsvc.protocol import KINDS, Derived, ReduceType, check_key

if TYPE_CHECKING:
    from metricsvc.client.buffer import RecordBuffer

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
        self._denominators: dict[str, Any] = {}
        self._full: dict[tuple, tuple[str, ...]] = {}  # (scopes, keys) -> checked full keys
        buffer.attach(self)

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
            full = tuple(self._key(k) for k in values)
            if len(self._full) >= 1024:
                self._full.clear()
            self._full[known] = full
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
        self.buffer.record(named, None, ReduceType.SUM)
        self._denominators.update(named)

    def _lookup(self, name: str, for_key: str) -> Any:
        scopes = self._scope.get()
        for depth in range(len(scopes), -1, -1):  # innermost scope first, then outwards
            candidate = self.prefix + "/".join((*scopes[:depth], name))
            if candidate in self._denominators:
                return self._denominators[candidate]
        known = sorted(self._denominators) or "none registered in this step"
        raise ValueError(f"unknown denominator {name!r} for key {for_key!r}; known: {known}")

    def stat(
        self,
        mask: Any = None,
        reduce: ReduceType | str = ReduceType.AVG_MIN_MAX,
        *,
        denominator: Any = None,
        reduce_type: ReduceType | str | None = None,
        ids: Any = None,
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
            raise TypeError(
                "stat() got no values to record: pass them as keywords, e.g. "
                "stat(mask=m, loss=t)" + ("; a tensor passed positionally is taken as the "
                                          "mask" if mask is not None else "")
            )
        kind = ReduceType.parse(reduce_type if reduce_type is not None else reduce)
        full = self._keys(values)
        if ids is not None and not KINDS[kind].extremes:
            raise ValueError(
                f"stat(ids=) for key {next(iter(full))!r}: ids name where a min or max came "
                f"from, and {kind.name} exports neither (use "
                f"{', '.join(k.name for k, spec in KINDS.items() if spec.extremes)})")
        if isinstance(denominator, str):
            mask = self._lookup(denominator, next(iter(full), "<none>"))
        elif denominator is not None:
            mask = denominator
        self.buffer.record(full, mask, kind, ids)

    def _stat_as(self, kind: ReduceType, mask: Any, values: dict[str, Any]) -> None:
        """``stat(mask=mask, reduce=kind, **values)`` for a caller whose arguments are
        right by construction (a built-in family: a declared kind, values, a mask or None)."""
        self.buffer.record(self._keys(values), mask, kind)

    def _stat_kinds_as(self, kinds: tuple[ReduceType, ...], values: dict[str, Any]) -> None:
        """``stat`` of ``values`` with each key's kind in ``kinds``, in order, for a caller
        whose arguments are right by construction (a built-in family's call of several
        kinds, no mask): plain numbers are one record of the buffer."""
        record_kinds(self.buffer, self._keys(values), kinds)

    def _stat_each_as(self, kinds: tuple[ReduceType, ...],
                      values: dict[str, tuple[Any, Any]]) -> None:
        """``stat_each`` for a caller whose arguments are right by construction (a built-in
        family: ``(value, mask)`` pairs, each key's declared kind in ``kinds``, in order)."""
        full = self._keys(values)
        self.buffer.record_each(full, dict(zip(full, kinds)))

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
        full = self._keys(values)
        self.buffer.record_each(full, dict(zip(full, (kinds.get(k, kind) for k in values))))

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
        full = [self._key(k) for k in keys]
        self.buffer.record_elements(full, counts, kind)

    def weighted_mean(self, key: str, value: float, weight: float) -> None:
        """Record ``value`` counted ``weight`` times into the mean of ``key``."""
        self.buffer.record_weighted(self._key(key), value, weight)

    @contextlib.contextmanager
    def record_timing(self, name: str) -> Iterator[None]:
        """Time the block into ``timing_s/<name>`` (MAX across ranks by default)."""
        key = check_key(f"{self.prefix}{self.timing_prefix}{name}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.buffer.record({key: time.perf_counter() - start}, None, self.timing_reduce)

    def get(self, name: str) -> Tracker:
        """Return the named tracker ``name``: keys prefixed ``name/``, scopes of its own."""
        prefix = check_key(self.prefix + name)
        with self.buffer.lock:
            tracker = self.buffer.trackers.get(prefix)
            if tracker is None:
                tracker = self.buffer.trackers[prefix] = Tracker(self.buffer, prefix=f"{prefix}/")
            return tracker

    def pending_keys(self) -> list[str]:
        """Return the keys recorded since the last flush."""
        return self.buffer.keys()

    @property
    def host_copies(self) -> int:
        """Device-to-host copies made by flushes so far."""
        return self.buffer.host_copies

    def end_step(self) -> None:
        """Forget what lives for one step (the registered denominators)."""
        self._denominators.clear()
