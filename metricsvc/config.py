"""Configuration: pydantic v2 models, loaded from YAML, a dict, or built in code.

Unknown keys are errors that name the key. Secrets never live here: sinks that
need an API key read it from the environment themselves.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from metricsvc.core.formula import parse
from metricsvc.core.keys import DEFAULT_NAME, default_namespace, is_plain_part
from metricsvc.core.limits import (
    LIMITS,
    MAX_ALERT_RULES,
    MAX_PENDING_STEPS,
    MAX_STEPS_AHEAD,
    Limits,
)
from metricsvc.core.reduce import OutputRules, ReduceType, framework_conflict
from metricsvc.core.sketch import MIN_ALPHA, SketchSpec
from metricsvc.sinks.base import CustomSinkConfig, DeliveryConfig, Strict, sinks_model
from metricsvc.sinks.console import ConsoleSinkConfig
from metricsvc.sinks.jsonl import JsonlSinkConfig
from metricsvc.sinks.mlflow import MlflowSinkConfig
from metricsvc.sinks.swanlab import SwanlabSinkConfig
from metricsvc.sinks.tensorboard import TensorboardSinkConfig
from metricsvc.sinks.wandb import WandbSinkConfig
from metricsvc.storage.journal import journal_file

# The sinks section: a field per built-in sink, as its registration says (sinks/<name>.py).
SinksConfig = sinks_model()


class RunConfig(Strict):
    """Where a run's files go: ``<root>/<experiment>/<trial>/``."""

    root: str = "runs"
    experiment: str = "default"
    trial: str | None = Field(None, description="default: the start time and a random suffix")
    resume: bool = Field(
        False, description="continue the run already in the folder (else such a folder is an "
                           "error: a new run is never taken for a restart)"
    )

    from_step: int | None = Field(
        None, ge=-1,
        description="resuming from the checkpoint of this step: with resume, the run "
                    "continues and every step after it is recorded afresh (a rewind made "
                    "before any batch is taken; -1: before step 0)"
    )

    @model_validator(mode="after")
    def _from_step_resumes(self) -> RunConfig:
        if self.from_step is not None and not self.resume:
            raise ValueError(f"from_step: {self.from_step} continues a run from a "
                             f"checkpoint: set resume: true too")
        return self

    @field_validator("experiment", "trial")
    @classmethod
    def _one_path_part(cls, v: str | None) -> str | None:
        if v is not None and not is_plain_part(v):
            raise ValueError(f"must be one plain path part (letters, digits, ._-), got {v!r}")
        return v

    def run_dir(self, trial: str | None = None) -> Path:
        """Return the run folder, naming a new trial if unset (see ``new_trial``)."""
        name = trial or self.trial or new_trial()
        return Path(self.root).expanduser() / self.experiment / name


def new_trial() -> str:
    """Return a fresh trial name: the start time, then a random suffix (launches in the
    same second never share a folder)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(6).hex()}"  # 48 random bits


_LIMITS = LIMITS  # the defaults: one source, metricsvc.core.limits
_OUTPUT = OutputRules()  # the output defaults: one source, metricsvc.core.reduce


class LimitsConfig(Strict):
    """Bounds that keep the actor's memory finite; past them a batch is rejected."""

    max_pending_steps: int = Field(MAX_PENDING_STEPS, ge=1)
    max_steps_ahead: int = Field(
        MAX_STEPS_AHEAD, ge=0,
        description="a batch this many steps past the oldest open step is refused"
    )
    max_keys_per_batch: int = Field(_LIMITS.max_keys_per_batch, ge=1)
    max_key_length: int = Field(_LIMITS.max_key_length, ge=8)
    max_batch_bytes: int = Field(_LIMITS.max_batch_bytes, ge=1024)
    max_world_size: int = Field(_LIMITS.max_world_size, ge=1)
    keep_results: int = Field(1000, ge=1, description="finished steps kept for wait_final_res")
    max_declarations: int = Field(
        _LIMITS.max_declarations, ge=0,
        description="derived-metric declarations one batch may carry")
    max_derived_outputs: int = Field(
        _LIMITS.max_derived_outputs, ge=0,
        description="derived metrics one step may export (a templated declaration exports "
                    "one per binding); they count toward max_keys_per_batch with the "
                    "batch's keys")
    max_derived_reads: int = Field(
        _LIMITS.max_derived_reads, ge=0,
        description="merged records the formulas of one step may read (a group input reads "
                    "every key it matches)")

    def to_limits(self) -> Limits:
        """Return the validation limits this config sets."""
        return Limits(
            max_key_length=self.max_key_length,
            max_keys_per_batch=self.max_keys_per_batch,
            max_batch_bytes=self.max_batch_bytes,
            max_world_size=self.max_world_size,
            max_declarations=self.max_declarations,
            max_derived_outputs=self.max_derived_outputs,
            max_derived_reads=self.max_derived_reads,
        )


class TableConfig(Strict):
    """A table a step carries: a row for each binding of the ``rows`` pattern's
    ``<placeholders>`` among the step's exported names, a column for each placeholder and
    for each of ``values`` (the last segment under the row)."""

    rows: str = Field(description="the rows' key pattern, e.g. moe_balance/layer_<layer>/"
                                  "expert_<expert>")
    values: list[str] = Field(min_length=1, description="the value columns: last segments")
    max_rows: int = Field(10_000, ge=1, le=100_000,
                          description="rows kept (in order); past it the table says so")

    @field_validator("rows")
    @classmethod
    def _placeholders(cls, rows: str) -> str:
        if "<" not in rows:
            raise ValueError(f"tables: rows pattern {rows!r} has no <placeholder>")
        return rows


MOE_TABLE = {"moe_balance/expert_loads": TableConfig(
    rows="moe_balance/layer_<layer>/expert_<expert>", values=["tokens", "load_percent"])}


class OutputConfig(Strict):
    """How merged records become exported keys and numbers."""

    mean_suffix: str = Field(_OUTPUT.mean_suffix,
                             description="'mean' (siiRL/verl) or 'avg' (AReaL)")
    quantiles: tuple[float, ...] = Field(_OUTPUT.quantiles, description="QUANTILES outputs")
    nonfinite: Literal["exclude", "propagate"] = Field(
        _OUTPUT.nonfinite,
        description="exclude NaN/inf (counted in meta) or export NaN for that key"
    )
    sketch_alpha: float = Field(
        _OUTPUT.sketch.alpha, ge=MIN_ALPHA, lt=1,
        description="quantile relative accuracy (at least 0.001: a device holds 1418 / alpha "
                    "bucket counts a QUANTILES key)")
    histogram_bins: int = Field(
        _OUTPUT.histogram_bins, ge=0, le=512,
        description="bins of the merged histogram of each QUANTILES key, sent to the sinks "
                    "that draw histograms and kept in the journal (0: none)")
    tables: dict[str, TableConfig] = Field(
        default_factory=lambda: dict(MOE_TABLE),
        description="tables each step carries (meta.tables) from its exported names: wandb "
                    "logs one Table a step instead of their scalars, TensorBoard a text "
                    "panel, MLflow an artifact and SwanLab an ECharts table beside them, the "
                    "journal the rows (default: AReaL's "
                    "moe_balance/expert_loads)")

    @field_validator("quantiles")
    @classmethod
    def _unit_interval(cls, qs: tuple[float, ...]) -> tuple[float, ...]:
        bad = [q for q in qs if not 0 <= q <= 1]
        if bad:
            raise ValueError(f"quantiles must be in [0, 1], got {bad}")
        return qs

    def rules(self) -> OutputRules:
        """Return the finalisation rules this config sets."""
        return OutputRules(
            mean_suffix=self.mean_suffix,
            quantiles=tuple(self.quantiles),
            nonfinite=self.nonfinite,
            sketch=SketchSpec(alpha=self.sketch_alpha),
            histogram_bins=self.histogram_bins,
        )


class MetricsConfig(Strict):
    """The service's own health as Ray metrics (``ray.util.metrics``), which Ray exports in
    Prometheus format on each node's metrics port (with ``ray[default]``:
    ``pip install 'metricsvc[observe]'``); the series are ``metricsvc_*`` (Prometheus
    shows them as ``ray_metricsvc_*``), tagged with the service's name."""

    enabled: bool = Field(True, description="report the service's health as Ray metrics")
    interval_s: float = Field(
        5.0, gt=0, le=3600,
        description="seconds between two reports of the health: how fresh its series are "
                    "(Ray exports every 10 s by default, each series at the value last set)")
    export: list[str] = Field(
        default_factory=list,
        description="finished-step metrics (glob patterns of exported names, e.g. 'actor/*') "
                    "also reported, as the gauge metricsvc_step_metric{metric=...}: a "
                    "Grafana panel shows training live (default: none)")

    @field_validator("export")
    @classmethod
    def _patterns(cls, patterns: list[str]) -> list[str]:
        bad = [p for p in patterns if not isinstance(p, str) or not p.strip()]
        if bad:
            raise ValueError(f"metrics.export takes non-empty glob patterns, got {bad[0]!r}")
        return patterns


class AlertRule(Strict):
    """One alert rule: exactly one of ``above``, ``below``, ``spike`` (each on ``key``, an
    exported name), ``nonfinite`` (a pattern of recorded keys) or ``missing`` (a name)."""

    key: str | None = Field(None, description="the exported name above/below/spike watch")
    above: float | None = Field(None, description="alert when the value is above this")
    below: float | None = Field(None, description="alert when the value is below this")
    spike: float | None = Field(None, gt=1, description="alert when the value passes this "
                                                        "many times the median of the last "
                                                        "`over` final values")
    over: int = Field(20, ge=1, le=1000, description="the spike rule's window, in steps")
    nonfinite: str | None = Field(None, description="alert when a recorded key matching "
                                                    "this glob counted NaN/inf values")
    missing: str | None = Field(None, description="alert when a final step lacks this name")
    name: str | None = Field(None, description="how the alert is named (default: the rule)")

    @model_validator(mode="after")
    def _one_rule(self) -> AlertRule:
        kinds = [k for k in ("above", "below", "spike", "nonfinite", "missing")
                 if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"an alert rule is exactly one of above, below, spike, nonfinite, "
                             f"missing; got {kinds or 'none'}")
        keyed = kinds[0] in ("above", "below", "spike")
        if keyed and not self.key:
            raise ValueError(f"alert rule {kinds[0]}: needs key (the exported name it watches)")
        if not keyed and self.key is not None:
            raise ValueError(f"alert rule {kinds[0]}: takes no key (its value names it)")
        return self


class ServiceConfig(Strict):
    """Everything the MetricWorker actor needs; the driver passes it at start."""

    name: str = DEFAULT_NAME
    namespace: str = Field(
        default_factory=default_namespace, min_length=1,
        description="the Ray namespace of the service's actors: $METRICSVC_NAMESPACE, "
                    "else metricsvc; any shell finds the service there by name",
    )
    num_cpus: float = Field(0, ge=0)
    max_restarts: int = Field(3, ge=-1)
    world_size: int | None = Field(
        None, ge=1,
        description="the run's ranks; default: agreed by a majority of the size ranks claim",
    )
    straggler_timeout_s: float | None = Field(
        600.0, gt=0, description="finish a step as partial this long after its first batch"
    )
    topology: Literal["flat", "per_node"] = Field(
        "flat", description="per_node: one combiner per node forwards its ranks' batches"
    )
    combiner_timeout_s: float = Field(
        30.0, gt=0, description="a combiner forwards a step this long after its first batch"
    )
    reduce_rules: dict[str, str] = Field(
        default_factory=dict, description="glob -> reduce kind for plain submit_metric keys"
    )
    renames: dict[str, str] = Field(default_factory=dict, description="output key prefix renames")
    max_staleness: int | None = Field(
        None, ge=0,
        description="warn when a stream exported into step s holds records of a policy "
                    "version older than s minus this (AReaL's max_head_offpolicyness)")
    formulas: dict[str, str] = Field(
        default_factory=dict,
        description="derived metric name -> the formula it is computed with here, over the "
                    "inputs its declaration names: what a framework's name means under a "
                    "preset (verl: timing_per_token_ms/<stage> over the slowest rank's time)")
    alerts: list[AlertRule] = Field(
        default_factory=list, max_length=MAX_ALERT_RULES,
        description="rules evaluated once when a step is final; an alert is journaled with "
                    "its step and names the samples behind its value (failures.md)")
    output: OutputConfig = OutputConfig()
    limits: LimitsConfig = LimitsConfig()
    run: RunConfig = RunConfig()
    sinks: SinksConfig = SinksConfig()
    metrics: MetricsConfig = MetricsConfig()

    @field_validator("reduce_rules")
    @classmethod
    def _known_kinds(cls, rules: dict[str, str]) -> dict[str, str]:
        for pattern, kind in rules.items():
            parsed = ReduceType.parse(kind)  # raises ValueError naming the kind
            if not pattern:
                raise ValueError("reduce_rules: empty glob pattern")
            conflict = framework_conflict(pattern, parsed)
            if conflict:
                raise ValueError(f"reduce_rules: {conflict}")
        return rules

    @field_validator("formulas")
    @classmethod
    def _parsed(cls, formulas: dict[str, str]) -> dict[str, str]:
        for name, formula in formulas.items():
            try:
                parse(formula)
            except (TypeError, ValueError) as err:
                raise ValueError(f"formulas: {name!r}: {err}") from None
        return formulas

    @model_validator(mode="after")
    def _room_ahead(self) -> ServiceConfig:
        if self.limits.max_steps_ahead >= self.limits.max_pending_steps:
            raise ValueError(
                f"limits.max_steps_ahead ({self.limits.max_steps_ahead}) must be below "
                f"limits.max_pending_steps ({self.limits.max_pending_steps}): a runaway rank "
                f"must never fill the pending steps the others need"
            )
        if self.world_size is not None and self.world_size > self.limits.max_world_size:
            raise ValueError(f"world_size {self.world_size} exceeds limits.max_world_size "
                             f"{self.limits.max_world_size}")
        return self

    @property
    def max_concurrency(self) -> int:
        """Threads for the actor's calls other than readers' waits and the sinks' flush and
        close: one. Merges take the actor's lock in turn anyway, calls run in the order they
        came, and one thread costs Ray less per call than a pool."""
        return 1

    @property
    def max_readers(self) -> int:
        """Threads for ``wait_final_res`` / ``wait_final`` callers (the ``readers`` group):
        every rank of the configured ``world_size`` and 64 callers more may wait at once;
        128 where the config names no world size (a reader past them waits in Ray's queue).
        """
        # Ray starts every thread of a group with the actor, each with a process id of its
        # own. Sized by limits.max_world_size, a service held 1,120 threads, and the test
        # suite's service starts wrapped the node's ids within seconds; Ray's raylet, which
        # SIGKILLs a worker that exits slowly by its pid 5 s later, then killed a live
        # service whose thread had been given that id (test_multinode, once).
        return (self.world_size or 64) + 64

    def merge_options(self) -> dict[str, Any]:
        """Return the ``Aggregator``'s keyword arguments this config sets."""
        return {"straggler_timeout_s": self.straggler_timeout_s,
                "max_pending_steps": self.limits.max_pending_steps,
                "max_steps_ahead": self.limits.max_steps_ahead, "world_size": self.world_size,
                "limits": self.limits.to_limits(), "reduce_rules": self.parsed_rules(),
                "renames": self.renames, "output": self.output.rules(),
                "formulas": self.formulas, "max_staleness": self.max_staleness,
                "tables": {name: t.model_dump() for name, t in self.output.tables.items()},
                "alerts": [rule.model_dump() for rule in self.alerts]}

    def journal(self, run_dir: Path) -> Path | None:
        """Where the journal of the run in ``run_dir`` is (None: the journal is off)."""
        jsonl = self.sinks.jsonl  # type: ignore[attr-defined]
        return journal_file(run_dir, jsonl.filename if jsonl and jsonl.enabled else None)

    def parsed_rules(self) -> dict[str, ReduceType]:
        """Return the reduce rules with kinds parsed."""
        return {p: ReduceType.parse(k) for p, k in self.reduce_rules.items()}


ConfigSource = ServiceConfig | Mapping[str, Any] | str | os.PathLike[str] | None


def _presets_folder() -> Path:
    """The presets: the repository's top-level ``configs/`` (one copy of each), which a
    wheel carries as ``metricsvc/configs`` (pyproject's ``package-dir``). Found from any
    directory, installed or from the checkout."""
    package = Path(__file__).resolve().parent
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


PRESETS = _presets_folder()


def presets() -> list[str]:
    """Return the names of the packaged presets (``load_config("siirl")`` loads one)."""
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def resolve_config_path(source: str | os.PathLike[str]) -> Path:
    """Return the YAML file ``source`` names: a path to a file, or a preset's name
    (``"default"``, ``"siirl"``, ...). Raise one line saying which it is not."""
    path = Path(source)
    if path.is_file():
        return path
    if path.is_dir():
        raise FileNotFoundError(f"{path} is a folder; give a config file (.yaml) or a preset "
                                f"name ({', '.join(presets())})")
    preset = PRESETS / f"{path.name}.yaml"
    if str(source) == path.name and preset.is_file():
        return preset
    raise FileNotFoundError(f"config file not found: {path} (not a preset either; presets: "
                            f"{', '.join(presets())})")


def load_config(source: ConfigSource = None, **overrides: Any) -> ServiceConfig:
    """Return a ServiceConfig from a YAML path, a preset's name (``presets()``), a dict, a
    ServiceConfig or None (defaults).

    ``overrides`` replace top-level fields (e.g. ``name=...``).

    Raises:
        FileNotFoundError: the YAML path does not exist and is no preset's name.
        ValueError: the config is invalid; the message names each bad key.
    """
    origin = "config"
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, ServiceConfig):
        data = source.model_dump()
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        path = resolve_config_path(source)
        origin = str(path)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:  # one line: where, and what the parser expected
            mark = getattr(err, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"{where}: YAML syntax error: {problem}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        data = loaded
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ServiceConfig.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in err.errors()
        )
        raise ValueError(f"{origin}: invalid config: {problems}") from None


__all__ = [  # the sinks' models live with their sinks; here for one import of every model
    "ConfigSource", "ConsoleSinkConfig", "CustomSinkConfig", "DeliveryConfig",
    "JsonlSinkConfig", "LimitsConfig", "MetricsConfig", "MlflowSinkConfig", "OutputConfig",
    "RunConfig", "ServiceConfig", "SinksConfig", "SwanlabSinkConfig", "TensorboardSinkConfig",
    "WandbSinkConfig", "load_config", "new_trial", "presets", "resolve_config_path",
]
