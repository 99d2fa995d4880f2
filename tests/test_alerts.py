"""Alerts (``alerts:`` rules) and the samples behind them: evaluated once when a step is
final, in step order, from the merged values; journaled with the step (``meta.alerts`` and
an ``alert`` event line), on the console, in Trackio and Ray's metrics; the samples they
name in ``flagged_samples.jsonl``, which ``metricsvc.flagged_samples`` reads for a resumed
run to skip."""

from __future__ import annotations

import fnmatch
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

import metricsvc
from metricsvc.client import MetricClient
from metricsvc.config import load_config
from metricsvc.core.limits import MAX_ALERT_RULES, MAX_FLAGGED_PER_STEP
from metricsvc.service.alerts import Alerts
from metricsvc.storage.journal import read_journal
from tests.helpers import sigkill

RULES = [{"key": "kl/max", "above": 2.0}, {"key": "loss", "below": -1.0},
         {"key": "loss", "spike": 3.0, "over": 3}, {"nonfinite": "actor/*"},
         {"missing": "lr"}]


def _model(rule: dict, step: int, metrics: dict, meta: dict,
           segment: list[tuple[int, dict]]) -> tuple[str, float | None] | None:
    """Whether ``rule`` fires at ``step``, from the step and the steps before it in the
    run's current history (``segment``): the rule's definition, written out."""
    if "missing" in rule:
        return None if rule["missing"] in metrics else (rule["missing"], None)
    if "nonfinite" in rule:
        hit = {k: n for k, n in meta.get("nonfinite", {}).items()
               if fnmatch.fnmatchcase(k, rule["nonfinite"])}
        return (min(hit), float(sum(hit.values()))) if hit else None
    value = metrics.get(rule["key"])
    if value is None or not math.isfinite(value):
        return None
    if "above" in rule:
        return (rule["key"], value) if value > rule["above"] else None
    if "below" in rule:
        return (rule["key"], value) if value < rule["below"] else None
    before = [m[rule["key"]] for s, m in segment if s < step
              and math.isfinite(m.get(rule["key"], math.nan))][-rule["over"]:]
    if len(before) < rule["over"] or statistics.median(before) <= 0:
        return None
    return (rule["key"], value) if value > rule["spike"] * statistics.median(before) else None


def _step(rng: np.random.Generator) -> tuple[dict, dict]:
    metrics = {"loss": float(rng.choice([0.5, 1.0, 1.5, 6.0, -2.0, math.nan])),
               "kl/max": float(rng.normal(1.0, 1.0)), "kl/min": float(rng.normal(-1.0, 1.0))}
    if rng.random() < 0.8:
        metrics["lr"] = 1e-5
    meta = {"extremes": {"kl/max": {"rank": int(rng.integers(0, 4)),
                                    "id": int(rng.integers(0, 10**6)), "row": 0, "col": 1,
                                    "call": 0},
                         "kl/min": {"rank": 0}}}
    if rng.random() < 0.2:
        meta["nonfinite"] = {"actor/kl": int(rng.integers(1, 5)), "critic/v": 1}
        meta["nonfinite_first"] = {"actor/kl": {"rank": 1, "row": 0, "col": 2, "call": 1,
                                                "kind": "nan", "id": int(rng.integers(0, 99))},
                                   "critic/v": {"rank": 0}}
    return metrics, meta


@pytest.mark.parametrize("seed", range(40))
def test_alerts_fire_where_the_rules_say_once_across_restarts_and_rewinds(seed):
    """A run of steps with restarts (the service reloads the journal: every final step is
    remembered, none evaluated again) and rewinds (the steps past k are rerun) in any order:
    the alerts of each final step are what the rules say of it and the history before it
    in the run's current segment."""
    rng = np.random.default_rng(seed)
    alerts = Alerts(RULES)
    journal: list[tuple[int, dict, dict, list]] = []  # (step, metrics, meta, alerts) kept
    step = 0
    for _ in range(40):
        event = rng.random()
        if event < 0.1 and journal:  # a restart: a new engine reloads the journal
            alerts = Alerts(RULES)
            for s, metrics, _, _ in journal:
                alerts.remember(s, metrics)
            continue
        if event < 0.2 and journal:  # a rewind to k: the steps after k are rerun
            k = int(rng.integers(-1, step))
            journal = [j for j in journal if j[0] <= k]
            alerts.rewound([(s, m) for s, m, _, _ in journal])
            step = k + 1
            continue
        metrics, meta = _step(rng)
        found, cut = alerts.check(step, metrics, meta)
        segment = [(s, m) for s, m, _, _ in journal]
        want = [(rule, fired) for rule in RULES
                if (fired := _model(rule, step, metrics, meta, segment)) is not None]
        assert [(a["key"], a["value"]) for a in found] == [fired for _, fired in want]
        assert [a["step"] for a in found] == [step] * len(want) and cut == 0
        for a in found:
            if a["key"] == "kl/max":  # the samples behind it: where its max came from
                assert a["samples"] == [{"name": "kl/max", "value": metrics["kl/max"],
                                         **meta["extremes"]["kl/max"]}]
            if a["rule"] == "nonfinite actor/*":  # where its first non-finite value was
                assert a["samples"] == [{"name": "actor/kl",
                                         **meta["nonfinite_first"]["actor/kl"]}]
        journal.append((step, metrics, meta, found))
        step += 1


def test_a_step_names_at_most_so_many_samples_and_says_how_many_more():
    """The samples one step's alerts name are bounded (``MAX_FLAGGED_PER_STEP``), shared
    by its rules in their order; the step says how many were left out."""
    alerts = Alerts([{"key": "a", "above": 0.0}, {"key": "b", "above": 0.0}])
    extremes = {**{f"a/x{i}/max": {"rank": 0, "id": i} for i in range(MAX_FLAGGED_PER_STEP - 3)},
                **{f"b/y{i}/max": {"rank": 1, "id": -i} for i in range(10)}}
    extremes = {name.rpartition("/")[0]: where for name, where in extremes.items()}
    found, cut = alerts.check(0, {"a": 1.0, "b": 1.0}, {"extremes": extremes})
    assert [len(a["samples"]) for a in found] == [MAX_FLAGGED_PER_STEP - 3, 3] and cut == 7
    assert [s["name"] for s in found[1]["samples"]] == ["b/y0", "b/y1", "b/y2"]


@pytest.mark.parametrize("rules, said", [
    ([{"key": "a", "above": 1, "below": 0}], "exactly one of above, below, spike"),
    ([{"above": 1}], "needs key"),
    ([{"key": "a", "missing": "b"}], "takes no key"),
    ([{"key": "a", "spike": 0.5}], "spike"),
    ([{"key": "a", "abov": 1}], "abov"),
    ([{"missing": "x"}] * (MAX_ALERT_RULES + 1), str(MAX_ALERT_RULES)),
])
def test_a_bad_rule_is_refused_in_one_line_naming_it(rules, said):
    with pytest.raises(ValueError, match=said) as err:
        load_config({"alerts": rules})
    assert "alerts" in str(err.value)


def _trackio_alerts(folder: Path, project: str, run: str) -> list[dict]:
    script = ("import json, os, sys\nos.environ['TRACKIO_DIR'] = sys.argv[1]\n"
              "from trackio.sqlite_storage import SQLiteStorage\n"
              "print(json.dumps(SQLiteStorage.get_alerts(sys.argv[2], run_name=sys.argv[3]),"
              " default=str))")
    out = subprocess.run([sys.executable, "-c", script, str(folder), project, run],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_alerts_name_the_samples_behind_them_everywhere_once_across_a_kill_and_a_rewind(
        make_worker):
    """Two ranks record token values with sample ids; the planted spikes and a NaN fire the
    rules at the steps a one-process reading of the journal says; the journal, the flagged
    samples, Trackio and health() hold each alert once after a SIGKILL, and a rewind's rerun
    is evaluated afresh."""
    rules = [{"key": "kl/max", "above": 5.0, "name": "kl too high"},
             {"nonfinite": "actor/*"}, {"missing": "lr"}]
    handle, cfg = make_worker(world_size=2, alerts=rules,
                              sinks={"jsonl": {}, "trackio": {}, "console": {"every": 100}})
    ranks = [MetricClient(None, rank=r, world_size=2, name=cfg.name) for r in range(2)]
    planted = {(3, 1): (4711, 9.0), (5, 0): (17, 7.5)}  # (step, rank) -> (id, value)

    def record(step: int, plant: bool = True) -> None:
        for r, c in enumerate(ranks):
            rows = 3 + r
            ids = torch.arange(100 * r, 100 * r + rows)
            kl = torch.full((rows, 4), 0.5 + step / 10)
            if plant and (step, r) in planted:
                sample, value = planted[(step, r)]
                ids[1] = sample
                kl[1, 2] = value
            actor = torch.ones(rows)
            if step == 4 and r == 1:
                actor[0] = float("nan")
            c.stat(ids=ids, kl=kl)
            c.stat(ids=ids, **{"actor/entropy": actor})
            if step != 2:
                c.scalar(lr=1e-5)
            c.wait_submit(step=step, timeout_s=30)

    for step in range(4):
        record(step)
    sigkill(handle)
    for step in range(4, 7):
        record(step)
    assert ray.get(handle.wait_final.remote(6, 30))
    # a rewind to step 4: 5 and 6 again, step 5 without its planted spike
    assert ray.get(handle.rewind.remote(to_step=4))["superseded"] == 2
    ranks[:] = [MetricClient(None, rank=r, world_size=2, name=cfg.name, start_step=5)
                for r in range(2)]  # the resumed job's ranks
    for step in (5, 6):
        record(step, plant=False)
    ray.get(handle.wait_final.remote(6, 30))
    health = ray.get(handle.close.remote(), timeout=120)
    assert not health["sink_errors"], health["sink_errors"]
    run = Path(health["run_dir"])

    journal = read_journal(run / "metrics.jsonl")
    fired = {r["step"]: [(a["rule"], a["key"], a["value"]) for a in r["meta"].get("alerts", ())]
             for r in journal}
    assert fired == {0: [], 1: [], 2: [("missing lr", "lr", None)],
                     3: [("kl too high", "kl/max", 9.0)],
                     4: [("nonfinite actor/*", "actor/entropy", 1.0)], 5: [], 6: []}
    by_step = {r["step"]: r for r in journal}
    (kl,) = by_step[3]["meta"]["alerts"]
    assert kl["samples"] == [{"name": "kl/max", "value": 9.0, "rank": 1, "id": 4711, "row": 1,
                              "col": 2, "call": 0}]
    (nan,) = by_step[4]["meta"]["alerts"]  # the NaN's sample, named by the alert
    assert nan["samples"] == [{"name": "actor/entropy", "rank": 1, "row": 0, "col": 0,
                               "call": 0, "kind": "nan", "id": 100}]
    # each alert an event line too, once: the kill did not repeat any; the superseded
    # step 5's alert stays in the file, archived with its step
    events = [json.loads(line)["event"]["alert"]
              for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"alert"' in line and line.startswith('{"event"')]
    assert [(e["step"], e["rule"]) for e in events] == [
        (2, "missing lr"), (3, "kl too high"), (4, "nonfinite actor/*"), (5, "kl too high")]
    # the samples with ids, each once, in the order flagged: what a resumed run skips
    assert metricsvc.flagged_samples(run) == [4711, 100, 17]
    assert metricsvc.flagged_samples(run / "no-such-run") == []
    # Trackio: each alert once; the superseded step 5's, if its sink wrote the step before
    # the rewind came (a sink's queue past the rewind is dropped)
    held = sorted((a["step"], a["title"]) for a in
                  _trackio_alerts(run / "trackio", run.parent.name, run.name))
    assert held in ([(2, "missing lr"), (3, "kl too high"), (4, "nonfinite actor/*")],
                    [(2, "missing lr"), (3, "kl too high"), (4, "nonfinite actor/*"),
                     (5, "kl too high")])
    # a resumed run (a new service on the folder): the journaled steps are never checked
    # again; its own steps are
    resumed = metricsvc.start_metric_worker({**cfg.model_dump(), "name": f"{cfg.name}-b",
                                             "run": {**cfg.run.model_dump(), "resume": True}})
    ranks[:] = [MetricClient(None, rank=r, world_size=2, name=f"{cfg.name}-b", start_step=7)
                for r in range(2)]
    planted.clear()
    planted[(7, 0)] = (99, 8.0)
    record(7)
    ray.get(resumed.close.remote(), timeout=120)
    alerted = [json.loads(line)["event"]["alert"]["step"]
               for line in (run / "metrics.jsonl").read_text().splitlines()
               if line.startswith('{"event": {"alert"')]
    assert alerted == [2, 3, 4, 5, 7]
    assert metricsvc.flagged_samples(run) == [4711, 100, 17, 99]


def test_the_alerts_are_counted_in_rays_metrics_by_rule(make_worker):
    from tests.test_observe import scrape, values

    handle, cfg = make_worker(world_size=1, alerts=[{"missing": "lr", "name": "no lr"}],
                              sinks={"jsonl": {}}, metrics={"interval_s": 0.2})
    c = MetricClient(None, rank=0, world_size=1, name=cfg.name)
    for step in range(3):
        c.scalar(loss=1.0)
        c.wait_submit(step=step, timeout_s=30)
    assert ray.get(handle.health.remote())["alerts"] == 3
    give_up = time.monotonic() + 60
    while sum(values(scrape(), "ray_metricsvc_alerts_total", rule="no lr")) < 3:
        assert time.monotonic() < give_up, "metricsvc_alerts never reached 3"
        time.sleep(0.5)


def test_the_console_prints_each_alert_with_its_samples_whatever_steps_it_shows():
    import io

    from metricsvc.sinks.console import ConsoleSink, ConsoleSinkConfig

    out = io.StringIO()
    sink = ConsoleSink(ConsoleSinkConfig(every=10), stream=out)
    alert = {"step": 3, "rule": "kl too high", "key": "kl/max", "value": 9.0,
             "samples": [{"name": "kl/max", "value": 9.0, "rank": 1, "id": 4711}]}
    sink.write(3, {"kl/max": 9.0}, {"alerts": [alert, {**alert, "rule": "missing lr",
                                                       "key": "lr", "value": None,
                                                       "samples": []}]})
    assert out.getvalue() == ("ALERT step 3: kl too high: kl/max = 9  <- kl/max: rank 1, id 4711\n"
                              "ALERT step 3: missing lr: missing\n")
