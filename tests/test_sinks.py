"""Sinks: the protocol, the registry, the journal and console read back, failure isolation."""

import io
import json
import math

import pytest

from metricsvc.config import DeliveryConfig, SinksConfig
from metricsvc.sinks import Sink, SinkDispatcher, SinkRegistry, build_sinks, default_registry
from metricsvc.sinks.console import ConsoleSink, ConsoleSinkConfig
from metricsvc.sinks.jsonl import JsonlSink, JsonlSinkConfig
from metricsvc.storage.journal import read_journal


def test_builtin_sinks_satisfy_the_protocol_and_build_from_config():
    sinks = build_sinks(SinksConfig(console=ConsoleSinkConfig(enabled=False)))
    assert list(sinks) == ["jsonl"] and sinks["jsonl"].name == "jsonl"
    assert all(isinstance(s, Sink) for s in (ConsoleSink(), JsonlSink()))


def test_registry_is_a_fresh_object_and_rejects_unknown_or_duplicate_names():
    reg = SinkRegistry()
    reg.register("mine", lambda cfg: ConsoleSink())
    with pytest.raises(ValueError, match="already registered"):
        reg.register("mine", lambda cfg: ConsoleSink())
    with pytest.raises(ValueError, match="unknown sink 'nope'; registered: mine"):
        reg.create("nope", None)
    assert "console" in default_registry() and "console" not in reg


def test_journal_lines_read_back_with_nonfinite_values_kept_readable(tmp_path):
    sink = JsonlSink(JsonlSinkConfig(fsync=True))
    sink.open(tmp_path)
    sink.write(0, {"a": 1.5, "b": math.inf}, {"partial": False})
    sink.write_event({"type": "late_batch", "step": 0})
    sink.write(1, {"a": 2.0}, {"partial": True, "missing_ranks": [3]})
    sink.close()
    sink.close()  # harmless
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines)
    steps = read_journal(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    assert steps[0]["metrics"] == {"a": 1.5, "b": float("inf")}  # back as the float it was
    assert steps[1]["meta"]["missing_ranks"] == [3]


def test_a_journal_line_holds_each_meta_figure_whatever_it_is(tmp_path):
    # A step of finite numbers is written as it is; a non-finite figure anywhere (a metric,
    # a meta total past float64's range) or a mapping JSON cannot take (a read-only view)
    # is written too, every number read back as the float it was.
    from types import MappingProxyType

    sink = JsonlSink()
    sink.open(tmp_path)
    plain = {"partial": False, "ranks": (0, 1), "extremes": {"x/max": {"rank": 1, "row": 3}}}
    sink.write(0, {"x/max": 2.5}, plain)
    sink.write(1, {"x/max": -math.inf}, {"derived_totals": {"t": [math.nan, 1e308 * 10]}})
    sink.write(2, {"x/max": 1.0}, {"about": MappingProxyType({"x": ("help", "s")})})
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first["metrics"] == {"x/max": 2.5} and first["meta"] == {**plain, "ranks": [0, 1]}
    steps = read_journal(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert steps[1]["metrics"] == {"x/max": -math.inf}
    assert steps[1]["meta"]["derived_totals"] == {"t": ["nan", "inf"]}  # meta: as written
    assert steps[2]["meta"]["about"] == {"x": ["help", "s"]}


def test_console_prints_every_nth_step_and_always_partial_ones():
    out = io.StringIO()
    sink = ConsoleSink(ConsoleSinkConfig(every=2), stream=out)
    for step in range(4):
        sink.write(step, {"loss/mean": float(step)}, {"ranks": [0], "world_size": 1})
    sink.write(5, {"loss/mean": 5.0}, {"ranks": [0], "world_size": 2, "partial": True,
                                       "missing_ranks": [1]})
    text = out.getvalue()
    assert "step 0 |" in text and "step 2 |" in text and "step 1 |" not in text
    assert "step 5 | 1/2 ranks | 1 metrics | PARTIAL, missing ranks [1]" in text
    row = next(line for line in text.splitlines() if line.startswith("loss/mean"))
    assert float(row.split()[-1]) == 0.0


class _Exploding:
    name = "exploding"

    def open(self, run_dir):
        pass

    def write(self, step, metrics, meta):
        raise RuntimeError("backend down")

    def close(self):
        pass


def test_a_failing_sink_is_retried_then_dead_lettered_and_others_go_on(tmp_path):
    journal = JsonlSink()
    delivery = DeliveryConfig(retries=2, backoff_s=0.001)
    dispatcher = SinkDispatcher([_Exploding(), journal], tmp_path, delivery)
    for step in range(3):
        dispatcher.publish(step, {"x": float(step)}, {"partial": False})
    assert dispatcher.flush(10)
    dispatcher.close()
    dispatcher.close()
    assert [r["step"] for r in read_journal(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    health = dispatcher.health()
    assert health["exploding"]["failures"] == 3 * 3 and health["exploding"]["dead_lettered"] == 3
    assert health["exploding"]["last_error"] == "RuntimeError: backend down"
    assert health["jsonl"]["written"] == 3 and not health["jsonl"]["failing"]
    dead = [json.loads(line) for line in (tmp_path / "dead_letter.jsonl").read_text().splitlines()]
    assert [(d["sink"], d["step"], d["metrics"]) for d in dead] == [
        ("exploding", s, {"x": float(s)}) for s in range(3)]


def test_keys_become_safe_tags_that_cannot_climb_out_of_a_folder():
    from metricsvc.core.keys import is_internal, safe_tag

    assert safe_tag("eval/acc (top-1)/mean") == "eval/acc__top-1_/mean"
    assert safe_tag("../../etc/passwd") == "_/_/etc/passwd"
    assert safe_tag("a//b/./c") == "a/_/b/_/c"
    assert len(safe_tag("x" * 400)) == 255
    # One rule with the service: a "__<name>" path segment is a derivation input; a key that
    # merely ends in "__count" is a user's key and reaches every sink.
    assert is_internal("__step") and is_internal("a/__ratio/x/num")
    assert not is_internal("reward__count") and not is_internal("a__b")


def test_the_console_shows_steps_per_minute_and_an_eta():
    import io

    from metricsvc.sinks.console import ConsoleSink, ConsoleSinkConfig

    sink = ConsoleSink(ConsoleSinkConfig(total_steps=100), io.StringIO())
    assert sink.pace(0, now=0.0) == ""  # nothing to measure yet
    assert sink.pace(10, now=60.0) == " | 10 steps/min | ETA 0:08:54"
    assert sink.pace(99, now=600.0) == " | 9.9 steps/min"  # the last step: no ETA


def test_each_built_in_sinks_registration_makes_its_config_section():
    """A built-in sink is its module: its BUILTIN names its config model (defined there),
    default, class and library; the config's sinks section, the registry and the
    missing-library check are made from these (adding a sink touches one module)."""
    from metricsvc.sinks.base import builtins

    specs = builtins()
    assert list(specs) == ["console", "jsonl", "tensorboard", "wandb", "swanlab", "mlflow",
                           "trackio"]
    assert list(SinksConfig.model_fields) == [*specs, "custom", "delivery"]
    for name, spec in specs.items():
        # (the journal's config lives with the journal, in storage: the worker owns it)
        home = f"metricsvc.sinks.{name}"
        assert spec.config.__module__ == home, name
        assert SinksConfig.model_fields[name].default == spec.default
        assert name in default_registry(with_entry_points=False)
    assert [s.extra for s in specs.values() if s.library] == [
        "tensorboard", "wandb", "swanlab", "mlflow", "trackio"]
