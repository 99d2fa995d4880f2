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


def folded(path) -> tuple[dict[int, dict], list[int]]:
    """A sink's own file (a JSON line per step, and ``{"rewind": k}`` per rewind) as the
    run's current segment holds it, ``{step: metrics}``, and the steps it was given twice
    in one segment."""
    import json

    current: dict[int, dict] = {}
    twice: list[int] = []
    for line in path.read_text().splitlines() if path.exists() else ():
        record = json.loads(line)
        if "rewind" in record:
            current = {s: m for s, m in current.items() if s <= record["rewind"]}
        else:
            if record["step"] in current:
                twice.append(record["step"])
            current[record["step"]] = record["metrics"]
    return current, twice


def steps_past(path, after) -> set[int]:
    """The steps a sink's own file holds past ``after`` in the run's current segment."""
    return {step for step in folded(path)[0] if after is None or step > after}


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


class ReopeningSink:
    """A custom sink with a file of its own (one JSON line per step it is given, one per
    rewind it is given), exactly once across restarts (``resume`` reads its file back as
    the run's current segment holds it), whose reopening after a restart takes
    ``reopen_s``, or waits until the test creates the file ``gate``: what the service
    journals meanwhile is already there when it replays."""

    name = "reopening"

    def __init__(self, options: dict) -> None:
        self.gate = options.get("gate")
        self.reopen_s = float(options.get("reopen_s", 0))
        self.path = None
        self.held: set[int] = set()

    def open(self, run_dir) -> None:
        self.path = run_dir / "reopening.jsonl"

    def resume(self, after) -> None:
        import os
        import time

        time.sleep(self.reopen_s)
        give_up = time.monotonic() + 120
        while self.gate and not os.path.exists(self.gate) and time.monotonic() < give_up:
            time.sleep(0.05)
        self.held = steps_past(self.path, after)

    def write(self, step, metrics, meta) -> None:
        if step in self.held:
            self.held.discard(step)
            return
        self._line({"step": step, "metrics": dict(metrics)})

    def rewind(self, to_step) -> None:
        self.held = {s for s in self.held if s <= to_step}
        self._line({"rewind": to_step})

    def _line(self, record: dict) -> None:
        import json

        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass
