"""TensorBoard event files through tensorboardX (``pip install metricsvc[tensorboard]``).

Events are written synchronously (tensorboardX's ``RecordWriter``, not its background
``SummaryWriter`` queue), so ``commit`` knows they are on disk. A restarted service writes
a new event file into the same folder and leaves out every (step, tag) the folder's event
files already hold: each scalar appears once.

TensorBoard reads a folder's event files in name order, and a restart marker supersedes
only the events read before it; so a new file's name sorts after every file already there
(its second is past theirs), whatever node or clock wrote them.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from metricsvc.core.keys import safe_tag
from metricsvc.sinks.base import Builtin, Strict, descriptions, plain, tagged
from metricsvc.sinks.logfiles import tfrecords


class TensorboardSinkConfig(Strict):
    """tensorboardX event files under ``<run folder>/<subdir>``."""

    enabled: bool = True
    subdir: str = "tensorboard"
    flush_secs: float = Field(2.0, gt=0, description="background flush interval")
    flush_every_step: bool = True

    _subdir = field_validator("subdir")(classmethod(lambda cls, v: plain(v, "subdir")))


def event_file_name(logdir: Path) -> str:
    """A tensorboardX-style name (``events.out.tfevents.<second>.<host>.<pid>.<tag>``) that
    sorts after every event file in ``logdir``: its second is now, or one past the latest
    second there (an earlier incarnation on a node whose clock ran ahead, or one within the
    same second on a host whose name sorts later)."""
    seconds = [int(time.time())]
    for path in logdir.glob("events.out.tfevents.*"):
        stamp = path.name.split(".")[3]
        if stamp.isdigit():
            seconds.append(int(stamp) + 1)
    return (f"events.out.tfevents.{max(seconds):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{uuid.uuid4().hex[:8]}")


def import_tensorboardx() -> None:
    """Import tensorboardX without torch. Its package imports torch wherever torch is
    installed (for ``SummaryWriter``'s tensors, which this sink never writes): seconds of
    CPU and about 300 MB in the service's process at each start, which on a loaded node
    held a first step's write back by over 30 s. Where torch is loaded already, or
    tensorboardX is, nothing changes. Meanwhile ``import torch`` in another thread of this
    process fails (a sink that imports it while this one opens sees an ImportError, and its
    call is retried); imported later, torch works with tensorboardX as usual (its package
    only names ``torch.Tensor`` in annotations, and converts tensors with a later import)."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        return
    sys.modules["torch"] = None  # type: ignore[assignment]  ``import torch``: ImportError
    try:
        import tensorboardX  # noqa: F401  optional backend
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


def _histogram(tag: str, hist: Mapping[str, Any]) -> Any:
    """A merged histogram (``meta["histograms"]``) as TensorBoard's histogram summary: its
    bucket limits are the upper edges, the first bucket starts at the exact min."""
    from tensorboardX.summary import histogram_raw

    return histogram_raw(tag, hist["min"], hist["max"], hist["count"], hist["sum"],
                         hist["sum_squares"], list(hist["edges"][1:]), list(hist["counts"]))


def markdown(table: Mapping[str, Any]) -> str:
    """A step's table as the markdown TensorBoard's text panel draws."""
    lines = ["| " + " | ".join(map(str, table["columns"])) + " |",
             "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table["rows"]]
    if table.get("cut"):
        lines.append(f"({table['cut']} more rows not shown)")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    """A table cell in markdown: a number as ``%g``, text on one line with its bars escaped
    (a sample's payload may hold either)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    return " ".join(str(value).replace("|", "\\|").splitlines())


class TensorboardSink:
    """One scalar per key and step under ``<run folder>/<subdir>``, and a histogram per
    QUANTILES key (its merged buckets across ranks)."""

    name = "tensorboard"
    supports_nan = True
    table_series = False  # a step's tables as a text panel each, not a series per cell

    def __init__(self, config: TensorboardSinkConfig | None = None) -> None:
        self.config = config or TensorboardSinkConfig()
        self.logdir: Path | None = None
        self._writer: Any = None
        self._held: dict[int, set[str]] = {}  # after a restart: what the folder holds
        self._last_flush = 0.0
        self._dirty = False  # events written since the last flush

    def open(self, run_dir: Path) -> None:
        import_tensorboardx()
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.record_writer import RecordWriter  # optional backend

        self.logdir = Path(run_dir) / self.config.subdir
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = RecordWriter(str(self.logdir / event_file_name(self.logdir)))
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self._last_flush = time.monotonic()

    def _write(self, event: Any) -> None:
        self._writer.write(event.SerializeToString())
        self._dirty = True

    def resume(self, after: int | None) -> None:
        """Leave out of later writes every (step, tag) past ``after`` the folder holds in
        the current segment: a restart marker (``rewind``) supersedes, as TensorBoard's
        reader does, every earlier event at or past its step."""
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        assert self.logdir is not None
        for path in sorted(self.logdir.glob("events.out.tfevents.*")):
            for data in tfrecords(path):
                event = Event.FromString(data)
                what = event.WhichOneof("what")
                if what == "session_log" and event.session_log.status == SessionLog.START:
                    self._held = {s: tags for s, tags in self._held.items() if s < event.step}
                if what != "summary" or (after is not None and event.step <= after):
                    continue
                held = self._held.setdefault(int(event.step), set())
                held.update(value.tag for value in event.summary.value)

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar, text

        held = self._held.pop(step, ())
        now = time.time()
        about = descriptions(meta)  # shown as each scalar's description in TensorBoard
        for tag, value in tagged(metrics, meta).items():
            if tag not in held:
                summary = scalar(tag, value, summary_description=about.get(tag, ""))
                self._write(Event(wall_time=now, step=step, summary=summary))
        for name, hist in meta.get("histograms", {}).items():
            tag = safe_tag(name)
            if tag not in held:
                self._write(Event(wall_time=now, step=step, summary=_histogram(tag, hist)))
        for name, table in meta.get("tables", {}).items():
            tag = safe_tag(name)
            if tag not in held:
                self._write(Event(wall_time=now, step=step, summary=text(tag, markdown(table))))
        if self.config.flush_every_step or time.monotonic() - self._last_flush > \
                self.config.flush_secs:
            self.commit()

    def rewind(self, to_step: int) -> None:
        """Write TensorBoard's restart marker (what ``SummaryWriter(purge_step=)`` writes):
        readers drop every event past ``to_step`` written before it, so the rerun's values
        are the ones shown."""
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self._held = {s: tags for s, tags in self._held.items() if s <= to_step}
        self._write(Event(wall_time=time.time(), step=to_step + 1,
                          session_log=SessionLog(status=SessionLog.START)))
        self.commit()

    def commit(self) -> None:
        """Flush and fsync the event file: everything written so far is durable. (The
        dispatcher commits too when its queue drains: a clean file is not fsynced again.)"""
        if self._writer is not None and self._dirty:
            self._writer.flush()
            self._dirty = False
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if self._writer is not None:
            self.commit()
            self._writer.close()
            self._writer = None


BUILTIN = Builtin(
    'tensorboard', 2, TensorboardSinkConfig, None, 'metricsvc.sinks.tensorboard:TensorboardSink',
    library='tensorboardX', extra='tensorboard')
