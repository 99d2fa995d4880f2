"""A rank's open step: its records, which step it is, and how it is closed.

Each recording call's records are kept as they come (a ``Part``: a call's keys and their
rows, on the host or on their device) and merged when the step is closed: one copy to the
host per device, then one exact merge (``records.merge_grouped``, the service's own) for
keys recorded more than once (micro-batches). Where a key's min and max came from
(``stat(ids=)``) merges the same way: the first recording holding the merged value wins.

One exported name, one source: a key whose exported name another key (or a declared
derived metric) of the step exports is refused where it is recorded. A step is closed as
one final batch; a caller may name the step it means, and a close the client refuses (a
step already closed, another step while records are pending) drops its records, as a
refusal by the service does: the records of one close never reach another step.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import repeat
from operator import add, is_not
from typing import Any

import numpy as np

from metricsvc.client.host import MaskCache
from metricsvc.client.summaries import (
    Rows,
    add_sketches,
    sample_text,
    sketch,
    summarize_call,
    to_host,
)
from metricsvc.client.tensors import is_tensor, to_device, torch_module
from metricsvc.core.declare import Derived, Metric, encode_derived
from metricsvc.core.keys import check_key, is_int, is_internal, safe_tag
from metricsvc.core.limits import Recent
from metricsvc.core.records import (
    CALLS,
    LOCATED,
    NFIELDS,
    NTOP,
    Top,
    best_of,
    merge_grouped,
    unknown_sources,
    winners,
)
from metricsvc.core.reduce import AUTO, KINDS, ReduceType, kind_name
from metricsvc.core.sketch import SketchSpec, dense_to_sparse
from metricsvc.core.wire import Batch
from metricsvc.errors import LateBatch, ServiceNotice, StepAlreadyFinal, StepMismatch

MAX_PARTS = 512  # recordings held before they are merged (a bound on a step's memory)
_SKETCHED = frozenset(int(kind) for kind, spec in KINDS.items() if spec.sketch)


@dataclass(slots=True)
class Part:
    """One recording call's records: ``rows [k, NFIELDS]`` of ``keys`` (numpy on the host, a
    tensor on its device), and where located, ``sources [k, NSOURCE]``."""

    keys: tuple[str, ...]
    rows: Any
    sources: Any = None


class RecordBuffer:
    """The records of one client's open step; ``take_batch`` makes them one wire batch."""

    def __init__(self, sketch_spec: SketchSpec | None = None, compile: bool | None = None,
                 label: str = "this step", on_record: Callable[[], None] | None = None):
        """``label``: how errors name the open window; ``on_record``: called after each
        recording (a stream's auto-flush)."""
        self.sketch_spec = sketch_spec or SketchSpec()
        self.compile = compile
        self.lock = threading.RLock()
        self.parts: list[Part] = []
        self.kinds: dict[str, int] = {}  # key -> its kind code in this step, in first order
        # key -> its recordings so far in this step, for a key recorded more than once (one
        # recording, the common case, is its entry in ``kinds``: ``recordings``)
        self.seen: dict[str, int] = {}
        self.expected: dict[str, int] = {}  # key -> the ranks expected to send it, if not all
        self._on_device = False  # a part or sketch of this step lives on a device
        self.sketches: dict[str, Any] = {}  # QUANTILES key -> its buckets
        self.masks = MaskCache()  # one mask preparation per mask per step
        self.good_keys: set[str] = set()  # names already checked (they recur every step)
        self.declarations = Declarations()
        self.names = ExportedNames()
        self.trackers: dict[str, Any] = {}  # named trackers, by prefix (Tracker.get)
        self.denominators: dict[str, Any] = {}  # this step's masks by full name
        self._masked = False  # a mask was prepared in this step (the cache holds it)
        self.host_copies = 0
        # blocks timed with ``device=True``: (key, kind, start, end, device or None), read at
        # the close (``_read_timings``), one wait per device
        self.timings: list[tuple[str, int, Any, Any, Any]] = []
        self.device_waits = 0
        # stat(top=k): key -> each call's (call, row length, samples [2, k, 3], k, text)
        self.tops: dict[str, list[tuple[int, int, Any, int, Any]]] = {}
        self._tops_copied: list[np.ndarray] = []  # their samples, on the host (``_merged``)
        self.label = label
        self.on_record = on_record

    def __len__(self) -> int:
        return len(self.kinds) + len(self.timings)

    def denominate(self, masks: Mapping[str, Any]) -> None:
        """Register this step's denominators (bool masks by full name) and record their
        counts (SUM)."""
        self.record(masks, None, ReduceType.SUM)
        self.denominators.update(masks)

    def opened(self, label: str) -> None:
        """A new window opened (``label``: how errors name it, e.g. ``"step 5"``)."""
        self.label = label

    def keys(self) -> list[str]:
        """Return the keys recorded since the last flush."""
        return list(dict.fromkeys([*self.kinds, *(t[0] for t in self.timings)]))

    def checked(self, key: str) -> str:
        """Return ``key`` if it is a usable name here (key rules; an internal key must be
        read by a declared metric); each key is checked once (keys recur every step)."""
        if key not in self.good_keys:
            check_key(key)
            if is_internal(key) and not self.declarations.reads(key):
                raise ValueError(
                    f"key {key!r}: a path segment starting with '__' marks an input of a "
                    f"derived metric, and no metric declared in this client reads it; declare "
                    f"the metric first (declare(Derived(...))) or rename the key")
            if len(self.good_keys) < 100_000:
                self.good_keys.add(key)
        return key

    # -- recording -----------------------------------------------------------------------
    def record(self, values: Mapping[str, Any], mask: Any,
               kinds: ReduceType | int | Mapping[str, ReduceType | int], ids: Any = None,
               expected: int = 0, masks: Mapping[str, Any] | None = None,
               top: int | None = None, text: Any = None) -> None:
        """Summarise ``{full key: value}`` (under ``mask``, or each under its own: ``masks``;
        with ``ids``, where each min and max lies; with ``top``, the k smallest and largest
        samples, and ``text`` their payloads, ``checked_text``) and keep the records as
        ``kinds`` (one for every key, or one per key; ``AUTO``: a plain dict's, chosen by
        the service)."""
        if kinds.__class__ is dict or isinstance(kinds, Mapping):
            each: Mapping[str, int] | None = kinds  # IntEnum codes are the ints
            code = None
            sketched = not _SKETCHED.isdisjoint(kinds.values())
        else:
            each, code = None, int(kinds)
            sketched = code in _SKETCHED
        with self.lock:  # the mask cache's scratch buffers serve one summary at a time
            if mask is not None or masks is not None:
                self._masked = True
            samples: dict[str, Any] = {}  # with top: key -> (samples, row length)
            found = summarize_call(values, mask, masks=masks, ids=ids, compile=self.compile,
                                   cache=self.masks, top=top, tops=samples)
            sketches = self._sketches(values, mask, masks, each, code) if sketched else None
            # each top key's call number: its recordings before this one
            calls = self.recordings(samples) if samples else []
            for rows in found:
                self.keep(rows, code if each is None else tuple(map(each.__getitem__, rows.keys)),
                          expected, sketches)
            # the samples kept with the records (a call ``keep`` refused keeps neither)
            for call, (key, (held, inner)) in zip(calls, samples.items()):
                self.tops.setdefault(key, []).append((call, inner, held, top, text))
        if self.on_record is not None:
            self.on_record()

    def _sketches(self, values: Mapping[str, Any], mask: Any, masks: Mapping[str, Any] | None,
                  each: Mapping[str, int] | None, code: int | None) -> dict[str, Any]:
        """The quantile buckets of the values whose kind keeps them (QUANTILES)."""
        out = {}
        for key, value in values.items():
            kind = each[key] if each is not None else code
            if kind != AUTO and KINDS[ReduceType(kind)].sketch:
                out[key] = sketch(value, mask if masks is None else masks.get(key),
                                  self.sketch_spec, key=key)
        return out

    def keep(self, found: Rows, codes: int | tuple[int, ...], expected: int = 0,
             sketches: Mapping[str, Any] | None = None) -> None:
        """Keep records as one part: ``codes`` one kind for all keys, or one each."""
        keys = found.keys
        with self.lock:
            kinds = self.kinds
            each = codes if codes.__class__ is tuple else None
            if kinds.keys().isdisjoint(keys):  # new in this step: the common case
                self.names.claim(keys, codes, kinds, self.declarations, self.label)
                kinds.update(zip(keys, each) if each else dict.fromkeys(keys, codes))
                sources = found.sources
            else:
                sources = self._again(found, codes, each)
            self.parts.append(Part(keys, found.rows, sources))
            if found.rows.__class__ is not np.ndarray:
                self._on_device = True
            if expected:
                for key in keys:
                    self.expected[key] = max(expected, self.expected.get(key, 0))
            for key in keys if sketches else ():
                buckets, held = sketches.get(key), self.sketches.get(key)  # type: ignore[union-attr]
                if buckets is not None:
                    self.sketches[key] = buckets if held is None else add_sketches(held, buckets)
                    self._on_device = self._on_device or is_tensor(buckets)
            if len(self.parts) > MAX_PARTS:
                self._compact()

    def _again(self, found: Rows, codes: int | tuple[int, ...],
               each: tuple[int, ...] | None) -> Any:
        """Keys of which some were recorded before in this step: every kind checked before
        the buffer is touched (a bad call records nothing); their sources' call numbers.
        Micro-batches repeat a call's keys every time: the keys are walked by ``map`` and
        sets, not key by key in Python."""
        kinds, keys, seen = self.kinds, found.keys, self.seen
        held = list(map(kinds.get, keys))
        wanted = repeat(codes) if each is None else each
        if not ({*held} <= {None, codes} if each is None else
                all(h is None or h == c for h, c in zip(held, each))):
            key, was, code = next((k, h, c) for k, h, c in zip(keys, held, wanted)
                                  if h is not None and h != c)
            raise ValueError(f"key {key!r} was recorded as {kind_name(was)} in {self.label}; "
                             f"recording it as {kind_name(code)} would mix reductions")
        if None in held:
            new = [(k, c) for k, h, c in zip(keys, held, wanted) if h is None]
            self.names.claim(tuple(k for k, _ in new), codes if each is None else tuple(
                c for _, c in new), kinds, self.declarations, self.label)
            kinds.update(new)
        calls = list(map(seen.get, keys, map(is_not, held, repeat(None))))
        seen.update(zip(keys, map(add, calls, repeat(1))))
        sources = found.sources
        if sources is not None and any(calls):  # the call of each key's recording
            calls_of = np.asarray(calls, dtype=np.float64)[:, None]
            if is_tensor(sources):
                calls_of = to_device(calls_of, sources.device)
            sources = sources.clone() if is_tensor(sources) else sources.copy()
            sources[:, CALLS] = calls_of
        return sources

    def recordings(self, keys: Iterable[str]) -> list[int]:
        """How many times each key was recorded in this step (its next recording's call
        number)."""
        seen, kinds = self.seen, self.kinds
        return [seen.get(key, 1 if key in kinds else 0) for key in keys]

    @contextlib.contextmanager
    def timed(self, key: str, code: int, device: bool = False) -> Iterator[None]:
        """Time the block into ``key`` (kind ``code``), in seconds. ``device``: on a CUDA
        device (torch imported, a device present), two events on the current stream, read
        at the close with one wait per device and never before (AReaL's device timing);
        elsewhere the wall time, also kept until the close. Otherwise the wall time, now."""
        torch = torch_module() if device else None
        cuda = torch is not None and torch.cuda.is_available()
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                with self.lock:
                    self.timings.append((key, int(code), start, end,
                                         torch.cuda.current_device()))
            elif device:
                with self.lock:
                    self.timings.append((key, int(code), start, time.perf_counter(), None))
            else:
                self.record({key: time.perf_counter() - start}, None, code)

    def _read_timings(self) -> None:
        """The step's device-timed blocks, recorded in seconds: one wait per device that
        timed any (everything queued there before the flush is done), then each block's
        elapsed time; wall-timed ones as they are."""
        timings, self.timings = self.timings, []
        torch = torch_module()
        for device in dict.fromkeys(t[4] for t in timings if t[4] is not None):
            torch.cuda.synchronize(device)
            self.device_waits += 1
        for key, code, start, end, device in timings:
            seconds = end - start if device is None else start.elapsed_time(end) / 1000.0
            self.record({key: seconds}, None, code)

    # -- closing -------------------------------------------------------------------------
    def take_batch(self, *, step: int, rank: int, world_size: int, seq: int,
                   final: bool, then: str | None = None) -> Batch:
        """Return everything recorded as one wire batch (one host copy per device) and
        start afresh (``then``: the new window's label, if it is another)."""
        with self.lock:
            if then is not None:
                self.label = then
            if self.timings:
                self._read_timings()
            keys, data, codes, expected, extremes, sketches = self._merged()
            top, text = self._top(keys) if self.tops else (None, None)
            derived = self.declarations.take_wire()
            self._reset()
            return Batch.build(step=step, rank=rank, world_size=world_size, seq=seq,
                               final=final, keys=keys, data=data, kinds=codes,
                               expected=expected, sketches=sketches,
                               sketch_alpha=self.sketch_spec.alpha, derived=derived,
                               extremes=extremes, top=top, top_text=text)

    def _top(self, keys: list[str]) -> tuple[dict[int, np.ndarray], dict[int, list]]:
        """Each ``stat(top=k)`` key's k smallest and k largest samples over the step's calls
        (ties to the earlier call, then row, then column), by key row: ``[n, NTOP]``; their
        samples were copied with the step's records (``_merged``). And, by key row, the
        kept samples' payloads where their call gave ``text`` (``sample_text``; else None)."""
        names = list(self.tops)
        # every call: its key's number, the key's k (the largest its calls asked for), its
        # call number, row length and payloads
        calls = []
        for n, key in enumerate(names):
            held = self.tops[key]
            most = held[0][3] if len(held) == 1 else max(c[3] for c in held)
            calls.extend((n, most, c[0], c[1], c[4]) for c in held)
        k = max(c[1] for c in calls)
        samples = np.full((len(calls), 2, k, 3), np.nan)  # each call's, padded to k
        for i, s in enumerate(self._tops_copied):
            s = np.asarray(s, dtype=np.float64)
            samples[i, :, : s.shape[1]] = s
        held = ~np.isnan(samples[..., 0])
        of, side, _ = held.nonzero()  # each sample's call and side, in that order
        samples = samples[held]
        meta = np.array([c[:4] for c in calls], np.float64)[of]  # key, k, call, row length
        found = np.empty((len(samples), NTOP))
        found[:, Top.SIDE], found[:, Top.VALUE], found[:, Top.ID] = side, samples[:, 0], \
            samples[:, 2]
        found[:, Top.ROW], found[:, Top.COL] = np.divmod(samples[:, 1], meta[:, 3])
        found[:, Top.CALL], found[:, Top.K] = meta[:, 2], meta[:, 1]
        name = meta[:, 0].astype(np.int64)
        if len(calls) > len(names):  # a key of several calls: each call's k best merged
            keep = best_of(found, name)  # by key and side, the k best: ties to the earlier call
            found, of, name = found[keep], of[keep], name[keep]
        out, texts = {}, {}
        bounds = np.searchsorted(name, np.arange(len(names) + 1)).tolist()
        row_of = {key: keys.index(key) for key in names}
        with_text = {c[0] for c in calls if c[4] is not None}
        for n, key in enumerate(names):
            a, b = bounds[n], bounds[n + 1]
            if a == b:
                continue
            out[row_of[key]] = found[a:b]
            if n in with_text:  # these samples' payloads
                texts[row_of[key]] = [
                    None if calls[c][4] is None else sample_text(calls[c][4], int(row))
                    for c, row in zip(of[a:b].tolist(), found[a:b, Top.ROW].tolist())]
        return out, texts

    def _merged(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, dict, dict]:
        """Every part merged: the keys in the order first recorded, their records, kind
        codes, expected ranks, the sources of the keys some recording located, and the
        QUANTILES keys' buckets (sparse), all copied to the host in one copy per device."""
        parts, keys = self.parts, list(self.kinds)
        n = len(keys)
        codes = np.fromiter(self.kinds.values(), dtype=np.int8, count=n)
        expected = np.zeros(n, np.int32)
        if self.expected:
            for i, key in enumerate(keys):
                expected[i] = self.expected.get(key, 0)
        if not parts:
            return keys, np.zeros((0, NFIELDS)), codes, expected, {}, {}
        held, located, order = [], [], []
        for part in parts:
            held.append(part.rows)
            order.extend(part.keys)
            if part.sources is not None:
                located.append(part)
        for part in located:
            held.append(part.sources)
        dense = []
        for key, buckets in self.sketches.items():
            if is_tensor(buckets):
                dense.append(key)
                held.append(buckets)
        tops = []  # stat(top=k)'s samples, where the values were (the same copy)
        for calls in self.tops.values() if self.tops else ():
            tops.extend(samples for _, _, samples, _, _ in calls)
        held.extend(tops)
        if self._on_device:  # one copy per device, of everything the step holds there
            held, copies = to_host(held)
            self.host_copies += copies
        if tops:
            self._tops_copied = held[len(held) - len(tops):]
            del held[len(held) - len(tops):]
        rows = held[0] if len(parts) == 1 else np.concatenate(held[:len(parts)])
        idx = None
        data = rows
        if len(order) != n:  # keys recorded more than once: merged, exactly, once
            at = {k: i for i, k in enumerate(keys)}
            idx = np.fromiter((at[k] for k in order), dtype=np.int64, count=len(order))
            data = merge_grouped(rows, idx, n)
        sources = self._sources(parts, located, held, rows, idx, data) if located else {}
        sketches = self._sparse(keys, dense, held[len(parts) + len(located):]) \
            if self.sketches else {}
        return keys, data, codes, expected, sources, sketches

    def _sources(self, parts: list[Part], located: list[Part], held: list, rows: np.ndarray,
                 idx: np.ndarray | None, data: np.ndarray) -> dict[int, np.ndarray]:
        """Where the merged min, max and first non-finite value of each located key came
        from: the first recording holding the merged value (the first counting a non-finite
        one) wins (unknown where that one was not located)."""
        if not located:
            return {}
        copies = iter(held[len(parts):len(parts) + len(located)])
        src = np.concatenate([next(copies) if p.sources is not None
                              else unknown_sources(len(p.keys)) for p in parts])
        if idx is None:
            idx = np.arange(len(data))
        carried = np.concatenate([np.full(len(p.keys), p.sources is not None) for p in parts])
        won = winners(rows, idx, data)
        out = {}
        for i in np.unique(idx[carried]).tolist():
            found = unknown_sources(1)[0]
            for (_, first, end), side in zip(LOCATED.values(), won):
                if side[i] >= 0:
                    found[first:end] = src[side[i], first:end]
            out[i] = found
        return out

    def _sparse(self, keys: list[str], dense: list[str], copied: list) -> dict[int, tuple]:
        """Each QUANTILES key's buckets, sparse, by key row (``copied``: the dense ones')."""
        if not self.sketches:
            return {}
        at = {k: i for i, k in enumerate(keys)}
        out = {at[k]: s for k, s in self.sketches.items() if not is_tensor(s)}
        out.update({at[k]: dense_to_sparse(np.asarray(a), self.sketch_spec)
                    for k, a in zip(dense, copied)})
        return out

    def _compact(self) -> None:
        """Merge every part held into one, on the host (a copy per device: counted)."""
        keys, data, _, _, extremes, sketches = self._merged()
        self.sketches = {keys[i]: found for i, found in sketches.items()}
        self._on_device = False
        sources = None
        if extremes:
            sources = unknown_sources(len(keys))
            for i, found in extremes.items():
                sources[i] = found
        self.parts = [Part(tuple(keys), data, sources)]

    def discard(self) -> int:
        """Drop everything recorded since the last flush; return how many keys were dropped."""
        with self.lock:
            dropped = len(self.kinds)
            self._reset()
            return dropped

    def _reset(self) -> None:
        if self._masked:  # a mask is prepared once per step; the scratch buffers stay
            self.masks.clear()
            self._masked = False
        self.parts, self.kinds, self.seen, self.sketches = [], {}, {}, {}
        self.timings = []
        if self.tops:
            self.tops, self._tops_copied = {}, []
        self._on_device = False
        if self.expected:
            self.expected = {}
        if self.denominators:
            self.denominators = {}
        self.names.forget()

    # -- declarations --------------------------------------------------------------------
    def declare(self, *declarations: Derived) -> None:
        """Declare derived metrics for every step: sent with each batch, evaluated by the
        service over the merged records of their inputs (declaring one again: harmless).

        Raises:
            TypeError: not a ``Derived``.
            ValueError: a name declared before with another formula or inputs, or one a
                key recorded in this step exports (the names are named).
        """
        if not self.declarations.holds(declarations):  # else: as each step declares again
            with self.lock:
                self.declarations.declare(declarations, self.names.owner, self.label)

    def describe(self, *metrics: Metric | Derived, under: Any = None) -> None:
        """Say what ``metrics`` mean: the help and unit of each go to the service with the
        next batch, once. ``under(name)``: the key a tracker records ``name`` as."""
        with self.lock:
            self.declarations.describe(metrics, under)


@functools.lru_cache(maxsize=65536)  # keys recur every step
def exported_names(key: str, code: int) -> tuple[str, ...]:
    """Every name ``key`` may export under ``code``: its declaration's claims."""
    if code == AUTO:  # a plain number exports its key (its kind is the service's to pick)
        return tuple(dict.fromkeys((key, safe_tag(key))))
    return Metric(key, ReduceType(code)).claims()


class ExportedNames:
    """The names the keys of the open step export (``owner``: name or sink tag -> the key
    exporting it), and what each recurring call's keys claimed, reused."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}
        self._claims: Recent = Recent(64)  # (keys, codes, declarations held) -> claimed

    def forget(self) -> None:
        """A new step: no key exports anything yet."""
        self.owner = {}

    def claim(self, keys: tuple[str, ...], codes: int | tuple[int, ...],
              recorded: Mapping[str, Any], declarations: Declarations, label: str) -> None:
        """Own the names new ``keys`` export (``recorded``: the keys of the step so far);
        refuse one that another key of the step or a declared metric exports. A call with
        the keys of an earlier one (every step's same dict) reuses what it claimed."""
        names = self.owner
        known = (keys, codes, len(declarations.held))
        claimed = self._claims.get(known)
        if claimed is not None and names.keys().isdisjoint(claimed):
            names.update(claimed)
            return
        claimed = {}
        each = dict(zip(keys, codes)) if codes.__class__ is tuple else None
        for key in keys:
            kind = codes if each is None else each[key]
            for name in exported_names(key, kind):  # type: ignore[arg-type]
                if name in declarations.names:
                    raise ValueError(
                        f"key {key!r} ({kind_name(kind)}) would export {name!r}, which the "
                        f"derived metric {declarations.names[name]!r} declared in this client "
                        f"exports: one exported name, one source (rename one of them)")
                owner = names.get(name, claimed.get(name, key))
                if owner != key:
                    raise ValueError(
                        f"key {key!r} ({kind_name(kind)}) would export {name!r}, which key "
                        f"{owner!r} already exports in {label}: one exported name, one source "
                        f"(rename one of them)")
                claimed[name] = key
        names.update(claimed)
        if recorded.keys().isdisjoint(keys):  # every key new: the same call next step
            self._claims[known] = claimed


class Declarations:
    """The derived metrics declared in one client, the names they export, and what declared
    names mean, not sent yet (the caller holds the buffer's lock)."""

    def __init__(self) -> None:
        self.held: dict[str, Derived] = {}  # derived metrics, for every step
        self.names: dict[str, str] = {}  # a name (or sink tag) one of them exports
        self._wire = b""
        self._described: set[str] = set()  # names whose meaning was given (describe)
        self._about: dict[str, list[str]] = {}  # what they mean, not sent yet: next batch

    def holds(self, declarations: Iterable[Derived]) -> bool:
        """Whether every one of ``declarations`` is held already, the same object (what a
        family declares each step): then declaring them again has nothing to check."""
        return all(self.held.get(getattr(d, "name", None)) is d for d in declarations)

    def declare(self, declarations: Iterable[Derived], key_names: Mapping[str, str],
                label: str) -> None:
        """Hold ``declarations``; refuse one that changes a held name or exports a name a
        key (``key_names``: exported name -> key, in ``label``) or another one exports."""
        new: dict[str, Derived] = {}
        for decl in declarations:
            if not isinstance(decl, Derived):
                raise TypeError(f"declare() takes Derived metrics, got {type(decl).__name__}")
            held = self.held.get(decl.name, new.get(decl.name))
            if held is decl:  # declared again each step: the same object
                continue
            if held is not None and held != decl:
                raise ValueError(
                    f"derived metric {decl.name!r} is declared with formula "
                    f"{held.formula!r} over {held.inputs}; it cannot be declared again "
                    f"as {decl.formula!r} over {decl.inputs}: one exported name, one source")
            if held is not None:
                continue
            for name in decl.claims():
                owner = key_names.get(name)
                other = self.names.get(name)
                if owner is not None or (other is not None and other != decl.name):
                    raise ValueError(
                        f"derived metric {decl.name!r} would export {name!r}, which "
                        f"{f'key {owner!r}' if owner else f'derived metric {other!r}'} "
                        f"already exports in {label}: one exported name, one source "
                        f"(rename one of them)")
            new[decl.name] = decl
        if new:
            for decl in new.values():
                self.names.update(dict.fromkeys(decl.claims(), decl.name))
            self.held.update(new)
            self._wire = encode_derived(self.held.values())
            self.describe(new.values())

    def describe(self, metrics: Iterable[Metric | Derived],
                 under: Callable[[str], str] | None = None) -> None:
        """Note what ``metrics`` mean (once per name; ``under(name)``: the key recorded)."""
        for metric in metrics:
            name = metric.name if under is None else under(metric.name)
            if name not in self._described:
                self._described.add(name)
                if (metric.help or metric.unit) and not is_internal(name):  # never shown
                    self._about[name] = [metric.help, metric.unit]

    def reads(self, key: str) -> bool:
        """Return True if a held derived metric reads ``key``."""
        return any(d.reads(key) for d in self.held.values())

    def take_wire(self) -> bytes:
        """The declarations for the next batch: the derived metrics, with what names mean
        that was not sent yet (then forgotten here: sent once)."""
        if not self._about:
            return self._wire
        blob, self._about = encode_derived(self.held.values(), self._about), {}
        return blob


class StepCursor:
    """A rank's open step, the last step it closed, and the rules for moving between steps
    (over the rank's ``RecordBuffer``)."""

    def __init__(self, rank: int, world_size: int, start_step: int,
                 buffer: RecordBuffer) -> None:
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.rank, self.world_size, self.buffer = rank, world_size, buffer
        self.step = int(start_step)
        self.last_closed: int | None = None
        self.known = True  # False after a discard or a refused close: the next named is taken
        self.seq = 0  # the number of this rank's last batch
        self.flushes = 0  # steps answered
        buffer.opened(f"step {start_step}")

    def close(self, step: int | None, caller: str) -> Batch:
        """Close the open step (after moving to ``step``, if named): its records as one
        final batch; the next step opens."""
        with self.buffer.lock:
            if step is not None and (step.__class__ is not int or step != self.step):
                self.name(step, caller)
            step = self.step
            self.seq += 1
            self.last_closed, self.known = step, True
            self.step = step + 1
            return self.buffer.take_batch(step=step, rank=self.rank,
                                          world_size=self.world_size, seq=self.seq, final=True,
                                          then=f"step {step + 1}")

    def name(self, step: int, caller: str) -> None:
        """Move to the step the caller names, if nothing recorded is pending for the open
        one (and never backwards). Otherwise the close is refused, as the service refuses a
        batch: what was recorded for it is dropped (it cannot be told apart from the records
        of another step), nothing is sent, and the next step the caller names is taken
        (``StepMismatch``, or ``TypeError`` for a step that is no step)."""
        if (step.__class__ is not int and not is_int(step)) or step < 0:
            self.refuse(TypeError, f"{caller}(step={step!r}): step must be an int >= 0")
        if step == self.step:
            return
        if self.last_closed is not None and step <= self.last_closed:
            self.refuse(StepMismatch, f"{caller}(step={step}) refused: this client already "
                                      f"closed step {self.last_closed} (steps only go "
                                      f"forward)")
        if self.known and len(self.buffer):
            origin = ("its start_step" if self.last_closed is None
                      else f"the step after {self.last_closed}")
            self.refuse(StepMismatch, f"{caller}(step={step}) refused: this client holds "
                                      f"records of step {self.step} ({origin}), which was "
                                      f"never closed, and a step's records never go to "
                                      f"another step")
        self.open(step)

    def refuse(self, error: type[Exception], what: str) -> None:
        """Refuse a close: drop what was recorded for it and raise ``error`` saying so."""
        keys = self.buffer.keys()
        self.discard()
        shown = ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more"
                                                         if len(keys) > 8 else "")
        dropped = (f"its records were dropped ({len(keys)} keys: {shown})" if keys
                   else "nothing was recorded for it")
        raise error(f"rank {self.rank}: {what}; {dropped} and nothing was sent; the open "
                    f"step is {self.step}, and the next step named is taken")

    def discard(self) -> int:
        """Drop what was recorded for the open step; return how many keys were dropped. The
        next step the caller names is taken."""
        self.known = False
        return self.buffer.discard()

    def open(self, step: int) -> None:
        self.step = step
        self.buffer.opened(f"step {step}")

    def answered(self, ack: dict[str, Any], batch: Batch) -> None:
        """Say what the service's answer to ``batch`` means for this rank: a late step, a
        notice, or (a first flush for a step already final) a late join."""
        self.flushes += 1
        last_final = ack.get("last_final_step")
        joined_late = (ack["status"] == "late" and self.flushes == 1 and last_final is not None
                       and batch.step < last_final)
        if ack["status"] == "late" and not joined_late:
            warnings.warn(LateBatch(
                f"rank {self.rank}: step {batch.step} was published without it (straggler "
                f"timeout); this batch is journaled as late and not merged"), stacklevel=3)
        if ack.get("notice"):
            warnings.warn(ServiceNotice(f"rank {self.rank}: {ack['notice']}"), stacklevel=3)
        if joined_late:  # the client started at the wrong step: to the open step, loudly
            open_step = (last_final or batch.step) + 1
            self.open(max(self.step, open_step))
            raise StepAlreadyFinal(
                f"rank {self.rank}: step {batch.step} is already final (the service has "
                f"published up to step {open_step - 1}); this batch was journaled as late, "
                f"not merged. The open step is {open_step}: this client now records for it "
                f"(start clients with start_step=..., or name steps with "
                f"wait_submit(step=...))")

