"""Random mixes of what happens to a run, against a plain model of it (issue 35).

Each run is flat or per node (the rank's batches through its node's combiner). Operations:
close a step (``wait_submit``, or ``flush`` read back later) or several, a client dropped with its
flushes unanswered (a new one carries on), ``discard``, ``rewind``,
SIGKILL of the actor (Ray restarts it), a crash and a new driver resuming the folder
(``resume_from_step``, or ``run.resume`` alone), a crash between the journal's record
of a rewind and the other sinks' turn, ``close`` then a resume,
``stop_metric_worker`` then a new run of the same name (a folder of its own), a close its
caller gave up on, then a flush and a stop, while a sink still reopens after a SIGKILL, and
a stream window recorded, flushed (across a SIGKILL, too) and exported. After each check
the journal's latest segment, ``metricsvc report``, TensorBoard (its own reader), a custom
sink slow to reopen after each restart (each step of a segment once) and ``wait_final``
equal the model: every published step once, with the values recorded for it, where its
min and max came from, its top samples (``stat(top=)`` with their text), where its NaN
came from, its alerts, and the flagged samples of every alert of the run, superseded steps'
included; and the rank hears of the key a sink tag leaves out (warned, or logged where its
client was dropped unread) once, again only after a rewind before the step that told it or
a restart whose journal lacked that step; and no dropped client's batch is logged as
refused, undelivered or left out of its step.
``METRICSVC_MODEL_EXAMPLES`` draws more runs (default 3, about a minute).
"""

from __future__ import annotations

import itertools
import os
import re
import tempfile
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import metricsvc
from metricsvc.client import MetricClient
from metricsvc.errors import ServiceClosed, ServiceNotice
from tests.helpers import Logged, crash, sigkill

_services = itertools.count()
VALUES = st.one_of(st.floats(-1e6, 1e6, allow_nan=False, width=32),
                   st.sampled_from([1e-30, -3.5e25, 7.0]))
# Two keys that share TensorBoard's tag "acc_rate": a step records one of them, or none
PAIR = ("acc rate", "acc_rate")
TAGS = st.sampled_from([None, *PAIR])
ALERT_ABOVE = 1e5  # m/max past it: an alert naming m/max's top samples


class RunHistoryMachine(RuleBasedStateMachine):
    """One run of one rank (and one stream), driven at random; ``model`` is what every
    reader must show: step -> metrics."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="metricsvc-model-")
        self.name = f"model-{os.getpid()}-{next(_services)}"
        self.gate = Path(self.tmp.name) / "gate"  # the custom sink reopens once it exists
        self.gate.touch()
        self.cfg = {"name": self.name, "world_size": 1, "max_restarts": 1000,
                    "sinks": {"console": None, "jsonl": {}, "tensorboard": {},
                              "custom": [{"target": "tests.sink_fixtures:ReopeningSink",
                                          "options": {"reopen_s": 0.5,
                                                      "gate": str(self.gate)}}]},
                    "alerts": [{"key": "m/max", "above": ALERT_ABOVE, "name": "m high"}],
                    "run": {"root": self.tmp.name, "experiment": "m", "trial": "t"}}
        self.model: dict[int, dict[str, float]] = {}
        # step -> the key of the two sharing TensorBoard's tag "acc_rate" it recorded: the
        # tag shows the first step's key for the run, the other never
        self.tagged: dict[int, str] = {}
        # What the rank hears of the key the tag leaves out (a ``ServiceNotice``): once,
        # with the answer to the first step that leaves it out, and again only after a
        # rewind to before that step or a restart whose journal lacks it. ``told``: key ->
        # the step that told it, as the service holds it; ``unread``: told in answers to
        # flushes not read yet; ``least``/``most``: how often the rank must / may have heard
        self.told: dict[str, int] = {}
        self.unread: list[str] = []
        self.least: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.heard: list[warnings.WarningMessage] = []
        self.hearing = None
        self.logged = Logged()  # what a dropped client's unread answers said: notices only
        # step -> what its meta names: extremes, top, nonfinite_first, alerts
        self.extremes: dict[int, dict[str, dict]] = {}
        self.samples: dict[int, dict[str, Any]] = {}
        self.flagged: set[int] = set()  # every id an alert of this run's folder named
        self.next = 0  # the rank's open step
        self.flushed = False  # flushes whose answers are not read yet
        self.runs = itertools.count(1)
        self.handle = None
        # The stream's recorder lives as long as the driver (a rollout worker): across a
        # rewind and a SIGKILL of the service; a new driver (a resume, a new run) makes its own
        self.recorder = None

    def _client(self) -> MetricClient:
        return MetricClient(None, rank=0, world_size=1, name=self.name, start_step=self.next)

    def _settle(self) -> None:
        """Read every flush's answer: the run's state is what the model says."""
        if self.flushed:
            self.client.wait_acks(timeout_s=60)
            self.flushed = False
        self.least.update(self.unread)
        self.most.update(self.unread)
        self.unread = []

    def _drop_client(self) -> None:
        """A new client carries on; the old one's answers nobody reads (it may have read
        some before: a flush reads the answers that are in)."""
        self.client = self._client()
        self.flushed = False
        self.most.update(self.unread)
        self.unread = []

    def _killed(self) -> None:
        """After a SIGKILL: a key told at a step the journal did not hold yet is told again
        when the rank's resend of that step is final (the restart rebuilt what the ranks
        heard from the journal); whether its answer is read before the check, the check says."""
        from metricsvc.storage.journal import read_journal

        path = Path(self.tmp.name) / "m" / self.cfg["run"]["trial"] / "metrics.jsonl"
        held = {r["step"] for r in read_journal(path)} if path.exists() else set()
        self.most.update(k for k, s in self.told.items() if s not in held)

    def _resume(self, from_step: int | None) -> None:
        run = {**self.cfg["run"], "resume": True}
        if from_step is None:
            self.handle = metricsvc.start_metric_worker({**self.cfg, "run": run})
        else:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always", ServiceNotice)
                self.handle = metricsvc.start_metric_worker({**self.cfg, "run": run},
                                                            resume_from_step=from_step)
            # A checkpoint past the journal's last step (the model's) is said: the steps
            # between are in no journal, and the service names them
            held = max(self.model, default=None)
            first = 0 if held is None else held + 1
            gap = {"first": first, "last": from_step} if from_step >= first else None
            report = ray.get(self.handle.health.remote(), timeout=60)["resume"]
            assert (report["from_step"], report["journal_through"]) == (from_step, held)
            assert (report["unjournaled"] and {k: report["unjournaled"][k]
                                               for k in ("first", "last")}) == gap, report
            notices = [w for w in seen if issubclass(w.category, ServiceNotice)]
            assert len(notices) == (gap is not None), [str(w.message) for w in notices]
            self._rewound(from_step)
        self.client = self._client()
        self.recorder = None

    def _back_to(self) -> st.SearchStrategy[int]:
        """A step to rewind to: any, or just before a step that told the rank of a key
        the tag leaves out (the rerun tells it again: rare among any)."""
        anywhere = st.integers(-1, self.next - 1)
        told = sorted({s - 1 for s in self.told.values()})
        return st.one_of(anywhere, st.sampled_from(told)) if told else anywhere

    def _rewound(self, to_step: int) -> None:
        self.model = {s: m for s, m in self.model.items() if s <= to_step}
        self.tagged = {s: k for s, k in self.tagged.items() if s <= to_step}
        self.told = {k: s for k, s in self.told.items() if s <= to_step}
        self.extremes = {s: e for s, e in self.extremes.items() if s <= to_step}
        self.samples = {s: e for s, e in self.samples.items() if s <= to_step}
        self.next = to_step + 1

    @initialize(topology=st.sampled_from(["flat", "per_node"]))
    def start(self, topology: str) -> None:
        self.cfg["topology"] = topology
        self.hearing = warnings.catch_warnings(record=True)
        self.heard = self.hearing.__enter__()
        self.logged.__enter__()
        warnings.simplefilter("always", ServiceNotice)
        self.handle = metricsvc.start_metric_worker(self.cfg)
        self.client = self._client()

    @rule(value=VALUES, blocking=st.booleans(), tag=TAGS)
    def close_step(self, value: float, blocking: bool, tag: str | None = None) -> None:
        self.client.submit_metric({"x": value, **({tag: value} if tag else {})})
        pair, first = [value, -value], 100 * self.next  # a tie at 0: row 0 is both
        # and a NaN in row 2; the two samples of each side with their text
        self.client.stat(ids=np.array([first, first + 1, first + 2]), top=2,
                         text=[f"row {r} of {self.next}" for r in range(3)],
                         m=np.array([*pair, np.nan]))
        low, high = int(np.argmin(pair)), int(np.argmax(pair))
        self.extremes[self.next] = {
            "m/min": {"rank": 0, "id": first + low, "row": low, "col": 0, "call": 0},
            "m/max": {"rank": 0, "id": first + high, "row": high, "col": 0, "call": 0}}
        top = {name: [{"value": pair[r], "rank": 0, "row": r, "col": 0, "call": 0,
                       "id": first + r, "text": f"row {r} of {self.next}"}
                      for r in sorted(range(2), key=lambda r: (sign * pair[r], r))]
               for name, sign in (("m/min", 1), ("m/max", -1))}
        alerts = [{"step": self.next, "rule": "m high", "key": "m/max", "value": max(pair),
                   "samples": [{"name": "m/max", **s} for s in top["m/max"]]}
                  ] if max(pair) > ALERT_ABOVE else []
        self.flagged.update(s["id"] for a in alerts for s in a["samples"])
        self.samples[self.next] = {
            "top": top, "alerts": alerts or None,
            "nonfinite_first": {"m": {"rank": 0, "row": 2, "col": 0, "call": 0, "kind": "nan",
                                      "id": first + 2}}}
        if blocking:
            self.client.wait_submit(step=self.next, timeout_s=60)
        else:
            self.client.flush(step=self.next)
            self.flushed = True
        self.model[self.next] = {"x": value, "m/mean": 0.0, "m/min": min(pair),
                                 "m/max": max(pair), **({tag: value} if tag else {})}
        if tag:
            self.tagged[self.next] = tag
            if tag != self.tagged[min(self.tagged)] and tag not in self.told:
                self.told[tag] = self.next
                self.unread.append(tag)
                if blocking:  # its answer is read now
                    self._settle()
        self.next += 1

    @rule(steps=st.lists(st.tuples(VALUES, st.booleans(), TAGS), min_size=2, max_size=5))
    def close_steps(self, steps: list[tuple[float, bool, str | None]]) -> None:
        """Steps in a row, as training closes them (a key of the two sharing a tag on some
        of them: what a sink shows under the tag, and what the rank hears, over steps)."""
        for value, blocking, tag in steps:
            self.close_step(value, blocking, tag)

    @rule(values=st.lists(st.tuples(VALUES, TAGS), min_size=1, max_size=3))
    def close_and_drop_the_client(self, values: list[tuple[float, str | None]]) -> None:
        """The rank closes steps with ``flush`` (no wait) and lets its client go at once,
        carrying on with a new one: what the old one handed over is delivered all the
        same."""
        for value, tag in values:
            self.close_step(value, blocking=False, tag=tag)
        self._drop_client()

    @rule(value=VALUES)
    def discard(self, value: float) -> None:
        self.client.submit_metric({"x": value})
        self.client.discard()

    @precondition(lambda self: self.next > 0)
    @rule(data=st.data())
    def rewind(self, data: st.DataObject) -> None:
        self._settle()
        to_step = data.draw(self._back_to(), label="to_step")
        ray.get(self.handle.rewind.remote(to_step=to_step), timeout=60)
        self._rewound(to_step)
        self.client = self._client()

    @rule()
    def sigkill(self) -> None:
        self._settle()
        sigkill(self.handle)
        self._killed()

    @rule(data=st.data())
    def crash_and_resume(self, data: st.DataObject) -> None:
        self._settle()
        ray.get(self.handle.flush.remote(), timeout=60)  # what the crash may lose: nothing
        crash(self.handle)
        last = self.next - 1  # a checkpoint past it: steps the journal never held
        from_step = data.draw(st.one_of(st.none(), self._back_to(),
                                        st.integers(last + 1, last + 2)), label="from")
        if from_step is None:  # the run continues after the journal's last step
            self.next = max(self.model, default=-1) + 1
        self._resume(from_step)  # the new driver's client starts at self.next

    @precondition(lambda self: self.next > 0)
    @rule(data=st.data())
    def crash_after_only_the_journal_took_a_rewind(self, data: st.DataObject) -> None:
        """The service ends between the journal's record of a rewind and the other sinks'
        turn (a rewind the journal lacks never happened: it records it first): the folder
        is left so, by the journal's own writer, and a new driver continues the run."""
        from metricsvc.sinks.jsonl import JsonlSink
        from metricsvc.storage.history import Rewind

        self._settle()
        ray.get(self.handle.flush.remote(), timeout=60)
        crash(self.handle)
        to_step = data.draw(self._back_to(), label="to_step")
        journal = JsonlSink()
        journal.open(Path(self.tmp.name) / "m" / self.cfg["run"]["trial"])
        journal.write_event(Rewind(to_step).event())
        journal.close()
        self._rewound(to_step)
        self._resume(None)

    @rule(value=VALUES)
    def close_then_resume(self, value: float) -> None:
        self._settle()
        ray.get(self.handle.close.remote(), timeout=120)
        self.client.submit_metric({"x": value})
        with pytest.raises(ServiceClosed):
            self.client.wait_submit(step=self.next, timeout_s=60)
        crash(self.handle)
        self._resume(None)

    @rule()
    def stop_and_start_anew(self) -> None:
        """The run ends; the next one of the same name has a folder, and combiners, of its
        own: nothing of the last one reaches it."""
        self._settle()
        metricsvc.stop_metric_worker(self.handle)
        self._start_anew()

    @rule(values=st.lists(VALUES, min_size=2, max_size=3))
    def stop_while_a_given_up_close_runs(self, values: list[float]) -> None:
        """After a SIGKILL of a run with a step journaled, the custom sink reopens only
        once the test lets it (``gate``), and the steps closed meanwhile wait for it. The
        driver's close outlasts its caller's wait; the driver flushes and stops. Neither the
        flush nor the stop's close answers while the sink still reopens; once the service
        has ended, the run's folder holds every step, none dead-lettered."""
        first, *later = values  # (the drawn list stays as drawn: a failure reports it)
        self.close_step(first, blocking=True)
        self._settle()
        ray.get(self.handle.flush.remote(), timeout=60)  # journaled: the restart continues it
        self.gate.unlink()
        sigkill(self.handle)
        self._killed()
        for value in later:
            self.close_step(value, blocking=True)
        closing = self.handle.close.remote()
        ray.wait([closing], timeout=0.05)  # the caller's own wait ran out
        flushed, stopping = self.handle.flush.remote(90), self.handle.close.remote()
        early = ray.wait([flushed, stopping], num_returns=1, timeout=0.5)[0]
        self.gate.touch()
        assert not early, "a flush or a second close answered while a sink still reopened"
        assert ray.get(flushed, timeout=120)
        self._folder_equals_the_model()
        health = metricsvc.stop_metric_worker(self.handle)
        assert not [(name, h["dead_lettered"], h["lost"]) for name, h in health["sinks"].items()
                    if h["dead_lettered"] or h["lost"]]
        self._folder_equals_the_model()
        self._start_anew()

    def _start_anew(self) -> None:
        self.cfg["run"] = {**self.cfg["run"], "trial": f"t{next(self.runs)}"}
        self.model, self.extremes, self.samples, self.next = {}, {}, {}, 0
        self.tagged, self.told = {}, {}
        self.flagged = set()
        self.handle = metricsvc.start_metric_worker(self.cfg)
        self.client = self._client()
        self.recorder = None

    @rule(values=st.lists(VALUES, min_size=1, max_size=4), kill=st.booleans())
    def stream_window(self, values: list[float], kill: bool) -> None:
        self._settle()
        if self.recorder is None:
            self.recorder = self.client.stream("s")
        self.recorder.stat(r=values)
        self.recorder.flush()
        if kill:
            sigkill(self.handle)
            self._killed()
        self.recorder.flush()  # resends what a restart lost, never what a rewind superseded
        window = ray.get(self.handle.export_stream.remote("s", self.next, True), timeout=60)
        mean = sum(values) / len(values)
        want = {"s/r/mean": mean, "s/r/min": min(values), "s/r/max": max(values)}
        assert window == pytest.approx(want, rel=1e-9)
        self.model[self.next] = want
        self.extremes[self.next] = {"s/r/min": {"stream": "s"}, "s/r/max": {"stream": "s"}}
        self.samples[self.next] = {"top": None, "alerts": None, "nonfinite_first": None}
        self.next += 1
        self.client = self._client()  # the rank skips the stream's step

    @invariant()
    def readers_equal_the_model(self) -> None:
        self._settle()
        # Every step final (a dropped client's are delivered by its sender thread), then
        # every sink has written what was published (a first write opens its backend)
        finals = {s: ray.get(self.handle.wait_final.remote(s, 30), timeout=60)
                  for s in self.model}
        assert ray.get(self.handle.flush.remote(90), timeout=120), "a sink took over 90 s"
        _same({s: f["metrics"] for s, f in finals.items()}, self.model, 1e-9, "wait_final")
        # Where each min and max came from, the top samples, the NaN and the alerts,
        # through every restart, resend and rewind
        assert {s: f["meta"].get("extremes") for s, f in finals.items()} == self.extremes
        assert {s: _samples_of(f["meta"]) for s, f in finals.items()} == self.samples
        self._folder_equals_the_model()
        # What the rank heard of the key the tag leaves out, each time it was told: warned,
        # or logged where its client was dropped before reading the answer
        dropped = [s for s in self.logged.said if "dropped before reading it" in s]
        notices = [s for s in dropped if " came with a notice: " in s]
        heard = Counter(m.group(1) for said in [
            *(str(w.message) for w in self.heard if issubclass(w.category, ServiceNotice)),
            *notices] for m in re.finditer(r"name '([^']*)' shares the sink tag", said))
        assert set(heard) <= set(PAIR), heard
        for key in PAIR:
            assert self.least[key] <= heard[key] <= self.most[key], (
                key, heard[key], self.least[key], self.most[key], self.told)
        # No dropped client's batch was refused, left undelivered or left out of its step
        assert not [s for s in dropped if s not in notices], dropped

    def _folder_equals_the_model(self) -> None:
        """The run folder's readers (the journal, ``metricsvc report``, TensorBoard, a sink
        slow to reopen) hold what the model says, its samples and flagged ids too."""
        run = Path(self.tmp.name) / "m" / self.cfg["run"]["trial"]
        if not (run / "metrics.jsonl").exists():
            assert not self.model
            return
        journal, report, board, sources = _views(run)
        _same(journal, self.model, 1e-9, "journal")
        assert {s: e for s, (e, _) in sources.items()} == self.extremes
        assert {s: m for s, (_, m) in sources.items()} == self.samples
        assert set(metricsvc.flagged_samples(run)) == self.flagged
        _same(report, self.model, 1e-9, "report")
        shown = self.tagged[min(self.tagged)] if self.tagged else None
        _same(board, {s: {("acc_rate" if k == shown else k): v for k, v in m.items()
                          if k not in PAIR or k == shown}
                      for s, m in self.model.items()}, 1e-6, "tensorboard")
        # A sink slow to reopen after a restart: each step of each segment once, whatever
        # the run journals while it reopens (a rewind, its rerun)
        from tests.sink_fixtures import folded

        held, twice = folded(run / "reopening.jsonl")
        assert not twice, ("a step given twice in one segment", twice)
        _same(held, self.model, 1e-9, "a sink slow to reopen")

    def teardown(self) -> None:
        from metricsvc.service.combiner import stop_combiners

        if self.hearing is not None:
            self.hearing.__exit__(None, None, None)
        self.logged.__exit__()
        try:
            if self.handle is not None:
                ray.kill(self.handle, no_restart=True)
            stop_combiners(self.name)
        finally:
            self.tmp.cleanup()


def _samples_of(meta: dict) -> dict[str, Any]:
    return {name: meta.get(name) for name in ("top", "alerts", "nonfinite_first")}


def _same(got: dict, want: dict, rel: float, where: str) -> None:
    assert sorted(got) == sorted(want), (where, sorted(got), sorted(want))
    for step, metrics in want.items():
        assert got[step] == pytest.approx(metrics, rel=rel), (where, step)


def _views(run: Path):
    from metricsvc.cli.main import CliError, load_steps
    from metricsvc.storage.journal import read_journal
    from tests import readback

    records = read_journal(run / "metrics.jsonl")
    journal = {r["step"]: r["metrics"] for r in records}
    sources = {r["step"]: (r["meta"].get("extremes"), _samples_of(r["meta"])) for r in records}
    try:
        report = {r["step"]: r["metrics"] for r in load_steps(str(run))}
    except CliError:  # "the journal holds no finished step": a run rewound to its start
        report = {}
    board = readback.tensorboard_scalars(run / "tensorboard") if (run / "tensorboard").exists() \
        else {}
    return journal, report, board, sources


def test_every_mix_of_restart_rewind_resume_close_and_streams_keeps_every_reader_whole(
        ray_cluster):
    from hypothesis.stateful import run_state_machine_as_test

    examples = int(os.environ.get("METRICSVC_MODEL_EXAMPLES", "3"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cli's "N steps" line, Ray's restarts
        # No shrinking: each step costs real Ray time; hypothesis prints the failing run
        run_state_machine_as_test(RunHistoryMachine, settings=settings(
            max_examples=examples, stateful_step_count=8, deadline=None,
            phases=[Phase.explicit, Phase.generate], database=None, report_multiple_bugs=False,
            suppress_health_check=list(HealthCheck)))


def test_a_stop_during_a_close_given_up_on_after_a_restart_loses_nothing(ray_cluster):
    """The stop of a run whose close outlasted its caller's wait, while a sink still
    reopens after a SIGKILL, in one fixed mix CI always runs (per node; a flush read later,
    a key the tag leaves out, an alert with its samples before it; a step after it, in the
    next run): the random draws above meet it only now and then."""
    run = RunHistoryMachine()
    try:
        run.start("per_node")
        run.close_steps([(1.0, True, None), (2e5, False, "acc rate")])
        run.readers_equal_the_model()
        run.stop_while_a_given_up_close_runs([3.0, -4.0, 5.0])
        run.close_step(6.0, blocking=True)
        run.readers_equal_the_model()
    finally:
        run.teardown()
