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
