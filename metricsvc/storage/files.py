"""Writing files whole or not at all: the atomic replace, the append-only line file the
service, the journal and the sinks use, the dead letters of the steps a sink could not
take, and each sink's durable record in the run folder (``SinkState``)."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from metricsvc.core.keys import safe_file_name


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: a reader sees the old file or the new
    one, never a torn one; a failed write leaves no temporary file behind."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _append_whole(fd: int, data: bytes, fsync: bool = False) -> int:
    """Append ``data`` whole to the file open at ``fd``, or raise with the file as it was;
    return the file's new length."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.ftruncate(fd, start)
        raise
    return start + len(data)


def append_line(path: Path, line: bytes) -> int:
    """Append ``line`` whole to ``path`` (opened for it alone, so writers of one file never
    hold a replaced copy); return the file's length."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        if end and os.pread(fd, 1, end - 1) != b"\n":
            line = b"\n" + line  # a crash cut the last line short: ours starts on its own
        return _append_whole(fd, line)
    finally:
        os.close(fd)


class LineFile:
    """An append-only file of whole lines, held open: a failed append is cut back to where
    it began."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        end = os.lseek(self._fd, 0, os.SEEK_END)
        if end and os.pread(self._fd, 1, end - 1) != b"\n":
            _append_whole(self._fd, b"\n")  # a crash cut the last line short

    def append(self, data: bytes, fsync: bool = False) -> None:
        """Append ``data`` whole, or raise with the file as it was."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is closed")
        _append_whole(self._fd, data, fsync)

    def size(self) -> int:
        """Return the file's length in bytes."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is closed")
        return os.lseek(self._fd, 0, os.SEEK_END)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class DeadLetter:
    """Append-only JSONL of steps a sink could not take; shared by every sink thread.

    A line is written whole or not at all (``LineFile``): a disk error leaves no torn line.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: LineFile | None = None

    def write(self, sink: str, step: int | None, payload: dict[str, Any], error: str) -> None:
        line = {"sink": sink, "step": step, **payload, "error": error, "time": time.time()}
        text = json.dumps(line, default=str) + "\n"
        with self._lock:
            if self._file is None:
                self._file = LineFile(self.path)
            self._file.append(text.encode("utf-8"))


_COMPACT_BYTES = 1 << 16  # about 1500 watermark lines


class SinkState:
    """The durable record of sink ``name`` in ``run_dir``; read and written by its thread."""

    def __init__(self, run_dir: Path, name: str) -> None:
        self.path = Path(run_dir) / "sinks" / f"{safe_file_name(name)}.json"

    def load(self) -> dict[str, Any]:
        """Return the record: every line's fields, later lines over earlier ones ({} when
        none was written or the file cannot be read; a torn or foreign line is skipped)."""
        try:
            lines = self.path.read_bytes().splitlines()
        except OSError:
            return {}
        data: dict[str, Any] = {}
        for line in lines:
            try:
                part = json.loads(line)
            except ValueError:
                continue
            if isinstance(part, dict):
                data.update(part)
        return data

    def update(self, **values: Any) -> None:
        """Merge ``values`` into the record: one appended line (on a line of its own after
        a torn one), or the folded record written whole once the file is long."""
        line = json.dumps(values).encode() + b"\n"
        try:
            size = append_line(self.path, line)
        except FileNotFoundError:  # the first update of this run folder
            self.path.parent.mkdir(parents=True, exist_ok=True)
            size = append_line(self.path, line)
        if size > _COMPACT_BYTES:
            write_atomic(self.path, json.dumps(self.load()) + "\n")
