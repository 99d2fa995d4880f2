"""Writing files whole or not at all: the atomic replace, the append-only line file the
service, the journal and the sinks use, and the dead letters of the steps a sink could not
take."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


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


class LineFile:
    """An append-only file of whole lines: a failed append is cut back to where it began."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        end = os.lseek(self._fd, 0, os.SEEK_END)
        if end and os.pread(self._fd, 1, end - 1) != b"\n":
            self.append(b"\n")  # a crash cut the last line short: ours start on their own

    def append(self, data: bytes, fsync: bool = False) -> None:
        """Append ``data`` whole, or raise with the file as it was."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is closed")
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            if fsync:
                os.fsync(self._fd)
        except BaseException:
            os.ftruncate(self._fd, start)
            raise

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
