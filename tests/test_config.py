"""Config loading: YAML presets, dicts, overrides, and errors that name the bad key."""


import numpy as np
import pytest

import metricsvc.config
from metricsvc import ServiceConfig, load_config
from metricsvc.core.reduce import ReduceType

CONFIGS = sorted(metricsvc.config.PRESETS.glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    assert isinstance(load_config(path), ServiceConfig)


def test_siirl_preset_renames_timing_and_takes_the_slowest_rank():
    cfg = load_config("siirl")
    assert cfg.renames == {"timing_s/": "perf/delta_time/"}
    assert cfg.parsed_rules()["timing_s/*"] is ReduceType.MAX  # siiRL keys: test_siirl_preset


def test_unknown_key_is_an_error_naming_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("sinks:\n  jsonl:\n    filenme: x.jsonl\n")
    with pytest.raises(ValueError, match=r"bad.yaml: invalid config: sinks.jsonl.filenme: Extra"):
        load_config(path)


def test_bad_values_are_errors_naming_the_field():
    with pytest.raises(ValueError, match="reduce_rules"):
        load_config({"reduce_rules": {"a/*": "median"}})
    with pytest.raises(ValueError, match="run.experiment"):
        load_config({"run": {"experiment": "../escape"}})
    with pytest.raises(ValueError, match="sinks.jsonl.filename"):
        load_config({"sinks": {"jsonl": {"filename": "../../etc/x"}}})
    with pytest.raises(ValueError, match="sinks.console.every"):
        load_config({"sinks": {"console": {"every": 0}}})


def test_missing_file_and_non_mapping_yaml_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")


def test_overrides_and_round_trip():
    cfg = load_config(None, name="other", namespace="ns")
    assert (cfg.name, cfg.namespace) == ("other", "ns")
    assert load_config(cfg.model_dump()) == cfg and load_config(cfg) == cfg
    assert cfg.max_readers == 128  # no world size: 64 ranks and 64 callers more
    assert load_config(None, world_size=1000).max_readers == 1064


def test_run_dir_is_root_experiment_trial(tmp_path):
    cfg = load_config({"run": {"root": str(tmp_path), "experiment": "e", "trial": "t1"}})
    assert cfg.run.run_dir() == tmp_path / "e" / "t1"


def test_the_limits_config_and_the_validation_limits_share_their_defaults():
    from dataclasses import fields

    from metricsvc.config import LimitsConfig
    from metricsvc.core.limits import Limits

    assert LimitsConfig().to_limits() == Limits()
    assert {f.name for f in fields(Limits)} <= set(LimitsConfig.model_fields)


def test_each_default_more_than_one_part_reads_comes_from_one_place():
    """Issue 38: the merge's admission limits, the sketch's alpha, the retry budget, the
    tag length and the output rules are written once (``metricsvc.core.limits``,
    ``OutputRules``); the config, the merge, the clients and the sinks read them."""
    import inspect

    from metricsvc.client import MetricClient
    from metricsvc.config import ServiceConfig
    from metricsvc.core import limits
    from metricsvc.core.keys import safe_tag
    from metricsvc.core.reduce import OutputRules
    from metricsvc.core.sketch import SketchSpec
    from metricsvc.core.wire import Batch
    from metricsvc.service.derive import Deriver
    from metricsvc.service.engine import Engine as Aggregator
    from metricsvc.sinks.base import descriptions, tagged

    def default(f, name):
        return inspect.signature(f).parameters[name].default

    cfg = ServiceConfig()
    assert cfg.limits.max_pending_steps == default(Aggregator, "max_pending_steps") \
        == limits.MAX_PENDING_STEPS
    assert cfg.limits.max_steps_ahead == default(Aggregator, "max_steps_ahead") \
        == limits.MAX_STEPS_AHEAD
    assert cfg.limits.to_limits() == limits.LIMITS
    assert (default(Deriver, "max_outputs"), default(Deriver, "max_reads")) == (
        limits.LIMITS.max_derived_outputs, limits.LIMITS.max_derived_reads)
    assert cfg.output.rules() == OutputRules()
    assert cfg.output.sketch_alpha == SketchSpec().alpha == Batch.sketch_alpha \
        == limits.SKETCH_ALPHA
    assert default(MetricClient, "retry_s") == limits.RETRY_S  # a stream's handle is its
    assert default(safe_tag, "max_length") == default(tagged, "max_length") \
        == default(descriptions, "max_length") == limits.MAX_TAG_LENGTH


def test_a_presets_formula_for_a_derived_name_is_checked_at_load_and_replaces_the_declared_one():
    from metricsvc.core.declare import Derived, encode_derived
    from metricsvc.core.records import scalar_row
    from metricsvc.core.wire import Batch
    from metricsvc.service.engine import Engine

    with pytest.raises(ValueError) as err:
        load_config(None, formulas={"rate": "max(ms"})
    assert "formulas: 'rate'" in str(err.value)
    declared = [Derived("rate", "value(ms) / value(n)", {"ms": "__ms", "n": "__n"}),
                Derived("other", "value(ms)", {"ms": "__ms"})]
    engine = Engine(world_size=2, formulas={"rate": "max(ms) / value(n)",
                                            "other": "value(missing)"})  # reads no input
    finished = []
    for rank, ms in ((0, 3.0), (1, 5.0)):
        finished += engine.submit(Batch.build(
            step=0, rank=rank, world_size=2, seq=1, final=True, keys=["__ms", "__n"],
            data=np.stack([scalar_row(ms), scalar_row(2.0)]),
            kinds=[ReduceType.SUM, ReduceType.SUM], expected=[0, 0],
            derived=encode_derived(declared))).finished
    (done,) = finished
    assert done.metrics["rate"] == 5.0 / 4.0  # the slowest rank's over every rank's count
    assert done.metrics["other"] == 8.0  # a formula that cannot apply: the declared one
    assert done.meta["declarations"]["rate"][0] == "max(ms) / value(n)"  # journaled so
