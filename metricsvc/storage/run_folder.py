"""A run's folder: one run per folder, one live service per run.

A new run marks its folder (``run.json``, created exclusively: of two launches racing for
one folder, one wins); a folder that holds a run (a marker, or a journal with steps) is
refused to a new run unless it resumes. The live service holds ``owner.lock`` (``flock``:
the kernel releases it when the process ends, SIGKILL included), so two live services
never write one folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

RUN_MARKER = "run.json"  # written by a run's first incarnation: the folder is taken


def run_dir_in_use(run_dir: Path, journal: Path | None) -> str | None:
    """Return what shows that ``run_dir`` already holds a run, or None for a fresh folder."""
    marker = run_dir / RUN_MARKER
    if marker.exists():
        try:
            started = json.loads(marker.read_text()).get("started", "?")
        except (OSError, ValueError, AttributeError):
            started = "?"
        return f"a run started {started}"
    if journal is not None and journal.exists() and journal.stat().st_size:
        return f"a journal ({journal.name})"
    return None


def check_run_dir(run_dir: Path, journal: Path | None) -> None:
    """Refuse to start a new run in ``run_dir`` if it holds another one (``journal``: where
    that run's journal would be).

    Raises:
        ValueError: naming the folder, and the two ways out.
    """
    found = run_dir_in_use(run_dir, journal)
    if found is not None:
        raise ValueError(
            f"run folder {run_dir} already holds a run ({found}); a new run needs its own "
            f"folder: choose another run.trial (or leave it unset for a fresh one), or set "
            f"run.resume: true to continue that run"
        )


def claim_run_dir(run_dir: Path, journal: Path | None, service: str, check: bool) -> None:
    """Mark ``run_dir`` as the new run's of ``service`` (refused as ``check_run_dir``
    refuses, where ``check``); of two launches racing for one folder, the exclusive create
    lets one win."""
    if check:
        check_run_dir(run_dir, journal)
    marker = json.dumps({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "service": service})
    try:
        fd = os.open(run_dir / RUN_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if check:
            check_run_dir(run_dir, journal)  # the other launch won meanwhile: raises
        raise
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(marker)


OWNER_LOCK = "owner.lock"  # held (flock) by the live service of a run folder


def hold_run_dir(run_dir: Path, service: str) -> int:
    """Take the run folder's owner lock for this process; return its descriptor (keep it
    open: the kernel releases the lock when the process ends, SIGKILL included).

    Raises:
        ValueError: another live service holds the folder (it is named).
    """
    path = run_dir / OWNER_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise ValueError(
            f"run folder {run_dir} is held by a live service ({holder}); one folder has one "
            f"live owner: stop that service first (metricsvc.stop_metric_worker), or give "
            f"this one another run.trial") from None
    owner = json.dumps({"service": service, "pid": os.getpid(), "host": socket.gethostname(),
                        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    os.ftruncate(fd, 0)
    os.pwrite(fd, owner.encode(), 0)
    return fd


def probe_run_dir(run_dir: Path) -> None:
    """Raise (naming the holder) if a live service on this machine holds ``run_dir``: a
    driver hears it at once (the service checks again where it runs, with the lock)."""
    path = run_dir / OWNER_LOCK
    if not path.exists():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
        raise ValueError(
            f"run folder {run_dir} is held by a live service ({holder}); one folder has one "
            f"live owner: stop that service first (metricsvc.stop_metric_worker), or give "
            f"this one another run.trial") from None
    finally:
        os.close(fd)
