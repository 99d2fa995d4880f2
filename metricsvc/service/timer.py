"""The straggler timer: finishes, as partial, the steps whose straggler timeout passed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from metricsvc.service.output import StepResult

log = logging.getLogger(__name__)


class StragglerTimer:
    """Finishes, as partial, the steps whose straggler timeout has passed: a daemon thread,
    started by the first call that may open a step."""

    def __init__(self, timeout_s: float | None, lock: threading.RLock,
                 expire: Callable[[], list[StepResult]],
                 publish: Callable[[list[StepResult]], None]) -> None:
        self.period = None if timeout_s is None else min(1.0, timeout_s / 4)
        self.lock, self.expire, self.publish = lock, expire, publish
        self.errors = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the timer once (no straggler timeout: never)."""
        if self._thread is None and self.period is not None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="metricsvc-straggler-timer")
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.period):
            try:
                with self.lock:  # the actor's: a merge never sees a step half expired
                    if self._stopped.is_set():  # closed meanwhile: nothing is published
                        return
                    finished = self.expire()
                    for r in finished:
                        if r.meta["partial"]:
                            log.warning("step %d finished partial: missing ranks %s",
                                        r.step, r.meta["missing_ranks"])
                    if finished:
                        self.publish(finished)
            except Exception:  # the straggler timer must outlive any one bad step
                self.errors += 1
                log.exception("straggler timer: finishing timed-out steps failed")
