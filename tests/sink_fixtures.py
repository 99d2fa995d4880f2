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


def steps_past(path, after) -> set[int]:
    """The steps a sink's own file (one JSON line per step) holds past ``after``."""
    import json

    if not path.exists():
        return set()
    steps = (json.loads(line)["step"] for line in path.read_text().splitlines())
    return {step for step in steps if after is None or step > after}


class StallingSink:
    """A custom sink with a file of its own (one JSON line per step) that stalls once, in
    the write of ``stall_step``, until the test kills the actor. ``resume`` reads its file,
    so it is exactly-once across restarts like the built-in sinks; with ``reopen_s`` it
    first takes that long, as a backend slow to reopen its run does (wandb or MLflow on a
    loaded node)."""

    name = "stalling"

    def __init__(self, options: dict) -> None:
        self.stall_step = int(options["stall_step"])
        self.reopen_s = float(options.get("reopen_s", 0))
        self.path = None
        self.held: set[int] = set()

    def open(self, run_dir) -> None:
        self.path = run_dir / "stalling.jsonl"
        self.marker = run_dir / "stalling.started"

    def resume(self, after) -> None:
        import time

        time.sleep(self.reopen_s)
        self.held = steps_past(self.path, after)

    def write(self, step, metrics, meta) -> None:
        import json
        import time

        if step in self.held:
            return
        if step == self.stall_step and not self.marker.exists():
            self.marker.write_text(str(step))  # the test kills the actor now
            time.sleep(120)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, "metrics": dict(metrics)}) + "\n")

    def close(self) -> None:
        pass


class GatedSink:
    """A custom sink with a file of its own (one JSON line per step it is given), exactly
    once across restarts (``resume`` reads its file), whose reopening after a restart waits
    until the test creates the file ``gate``: everything the service journals meanwhile is
    already there when it replays."""

    name = "gated"

    def __init__(self, options: dict) -> None:
        self.gate = options["gate"]
        self.path = None
        self.held: set[int] = set()

    def open(self, run_dir) -> None:
        self.path = run_dir / "gated.jsonl"

    def resume(self, after) -> None:
        import os
        import time

        give_up = time.monotonic() + 120
        while not os.path.exists(self.gate) and time.monotonic() < give_up:
            time.sleep(0.05)
        self.held = steps_past(self.path, after)

    def write(self, step, metrics, meta) -> None:
        import json

        if step in self.held:
            self.held.discard(step)
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, "metrics": dict(metrics)}) + "\n")

    def rewind(self, to_step) -> None:
        self.held = {s for s in self.held if s <= to_step}

    def close(self) -> None:
        pass
