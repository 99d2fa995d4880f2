"""Third-party-style sinks for tests, loaded by dotted path inside the actor."""

from __future__ import annotations


class ExplodingSink:
    """A sink whose backend is down: every write raises."""

    name = "exploding"

    def __init__(self, options: dict) -> None:
        self.message = options.get("message", "backend down")

    def open(self, run_dir) -> None:
        pass

    def write(self, step, metrics, meta) -> None:
        raise ConnectionError(self.message)

    def close(self) -> None:
        pass


class RecordingSink:
    """Keeps what it was given, in memory (for in-process tests)."""

    name = "recording"
    supports_nan = False

    def __init__(self, options: dict | None = None) -> None:
        self.steps: list[tuple[int, dict, dict]] = []

    def open(self, run_dir) -> None:
        pass

    def write(self, step, metrics, meta) -> None:
        self.steps.append((step, dict(metrics), dict(meta)))

    def close(self) -> None:
        pass


class SlowSink:
    """A backend that takes ``seconds`` per write; appends what happens to ``trace``."""

    name = "slow"

    def __init__(self, options: dict) -> None:
        self.seconds = float(options.get("seconds", 1.0))
        self.trace = options["trace"]

    def _note(self, event: str) -> None:
        with open(self.trace, "a", encoding="utf-8") as fh:
            fh.write(event + "\n")

    def open(self, run_dir) -> None:
        pass

    def write(self, step, metrics, meta) -> None:
        import time

        self._note("write-start")
        time.sleep(self.seconds)
        self._note("write-end")

    def close(self) -> None:
        self._note("close")
