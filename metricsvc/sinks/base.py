"""Sinks: the protocol, the registry of sink factories (built-ins, entry points, dotted
paths), the config section each built-in's registration drives, and what a sink may show
(no internal keys, one value per tag). The base of every config model (``Strict``) lives
here too: the service's config (``metricsvc.config``) builds on the sinks' sections."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from metricsvc.core.keys import is_plain_part, safe_tag, tag_order
from metricsvc.core.limits import MAX_TAG_LENGTH

ENTRY_POINT_GROUP = "metricsvc.sinks"


class Strict(BaseModel):
    """The base of every config model: strict (an unknown key is an error naming it) and
    frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def plain(value: str, what: str) -> str:
    """Return ``value`` if it is one plain path part: nothing can escape the run folder."""
    if not is_plain_part(value):
        raise ValueError(f"{what} must be a plain file name (letters, digits, ._-), got {value!r}")
    return value


@dataclass(frozen=True)
class Builtin:
    """How a built-in sink registers (``BUILTIN`` in its own module, which drives the
    sink's config section ``sinks.<name>``): its config name and place in the order sinks
    are served, its model and default (None: off unless configured), its class as
    ``module:Class`` (imported when used), and the library it writes with and the extra
    that installs it (None: nothing to install). Adding a sink is adding its module."""

    name: str
    order: int
    config: type[Strict]
    default: Any
    factory: str
    library: str | None = None
    extra: str | None = None


@runtime_checkable
class Sink(Protocol):
    """Receives each finished step once, in increasing step order.

    Optional attributes:

    - ``supports_nan`` (default False: non-finite values are dropped before ``write``);
    - ``table_series`` (default True): False for a sink that draws ``meta["tables"]``
      itself (``{name: {"columns", "rows", "series"}}``, the configured ``output.tables``):
      the scalars a table holds are then left out of what it gets;
    - ``write_event(event)`` for journal events;
    - ``commit() -> int | None``: make what was written durable in the backend (its own
      flush); return the newest step now durable, or None for "everything written". The
      sink's watermark in the run folder advances only to what this says. Without it a
      returned ``write`` counts as durable;
    - ``resume(after: int | None)``: called once after ``open`` when a restarted service
      continues the run, before the journal's steps past the watermark ``after`` are
      written again. A sink that can read its backend leaves out of later writes what
      the backend already holds, which makes it exactly-once; one without ``resume`` gets
      at least once (a step may repeat if the service died between its write and its
      watermark).
    """

    name: str

    def open(self, run_dir: Path) -> None:
        """Prepare to write; ``run_dir`` exists and holds the run's files."""

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        """Record one finished step."""

    def close(self) -> None:
        """Flush and release resources; a second call is harmless."""


SinkFactory = Callable[[Any], Sink]


def load_object(target: str) -> Any:
    """Return the object named by ``"package.module:attr"``.

    Raises:
        ValueError: the target is malformed or cannot be imported.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"sink target {target!r} must look like 'package.module:Class'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot load sink target {target!r}: {err}") from None
    return obj


class SinkRegistry:
    """Sink factories by name; build a fresh one per service (no import-time globals)."""

    def __init__(self) -> None:
        self._factories: dict[str, SinkFactory] = {}

    def register(self, name: str, factory: SinkFactory) -> None:
        """Register ``factory(config) -> Sink`` under ``name``."""
        if name in self._factories:
            raise ValueError(f"sink {name!r} is already registered")
        self._factories[name] = factory

    def create(self, name: str, config: Any) -> Sink:
        """Return a new sink of kind ``name`` (or of a ``pkg.module:Class`` target)."""
        factory = self._factories.get(name)
        if factory is None:
            if ":" not in name:
                known = ", ".join(sorted(self._factories)) or "none"
                raise ValueError(f"unknown sink {name!r}; registered: {known}")
            factory = load_object(name)
        return factory(config)

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Register every sink that installed packages declare under ``group``."""
        for ep in entry_points(group=group):
            if ep.name not in self._factories:
                self._factories[ep.name] = _lazy(ep)

    def __contains__(self, name: object) -> bool:
        return name in self._factories


def _lazy(ep: Any) -> SinkFactory:
    # Importing a third-party sink only when it is configured keeps start-up cheap and safe.
    return lambda config: ep.load()(config)


def _builtin(module: str, cls: str) -> SinkFactory:
    return lambda config: getattr(importlib.import_module(module), cls)(config)


def missing_libraries(sinks_config: Any) -> list[str]:
    """Return one sentence per enabled sink whose library is not installed here."""
    out = []
    for name, _ in sinks_config.enabled():
        spec = builtins()[name]
        module, extra = spec.library, spec.extra
        if module is not None and importlib.util.find_spec(module) is None:
            out.append(f"sinks.{name} needs {module}, which is not installed: "
                       f"pip install 'metricsvc[{extra}]' (or turn it off: sinks.{name}: null)")
    return out


def check_libraries(sinks_config: Any) -> None:
    """Raise one line naming each configured sink whose library is missing, and its extra."""
    missing = missing_libraries(sinks_config)
    if missing:
        raise ValueError("; ".join(missing))


def default_registry(with_entry_points: bool = True) -> SinkRegistry:
    """Return a registry of the built-in sinks (and installed entry points)."""
    registry = SinkRegistry()
    for name, spec in builtins().items():
        module, _, cls = spec.factory.partition(":")
        registry.register(name, _builtin(module, cls))
    if with_entry_points:
        registry.load_entry_points()
    return registry


def build_sinks(sinks_config: Any, registry: SinkRegistry | None = None, *,
                check: bool = False, built: Mapping[str, Sink] | None = None) -> dict[str, Sink]:
    """Return one sink per enabled entry of a ``SinksConfig``, by the name it is served
    under (its health, dead letters and run-folder state): built-ins, then custom ones.
    ``check``: first refuse, in one line, a sink whose library is not installed.
    ``built``: sinks made by their owner, used as they are (the worker's journal writer).

    Raises:
        ValueError: two sinks of one name (give a custom sink a ``name``).
    """
    if check:
        check_libraries(sinks_config)
    registry = registry or default_registry()
    built = built or {}
    out = {name: built[name] if name in built else registry.create(name, cfg)
           for name, cfg in sinks_config.enabled()}
    for custom in sinks_config.custom:
        sink = registry.create(custom.target, dict(custom.options))
        name = custom.name or sink.name
        if name in out:
            raise ValueError(f"two sinks are named {name!r}: give the custom sink "
                             f"{custom.target!r} a name of its own (sinks.custom[].name)")
        out[name] = sink
    return out


# -- the config section every built-in sink's registration makes -------------------------
@functools.lru_cache(maxsize=1)  # the package's own modules
def builtins() -> dict[str, Builtin]:
    """Every built-in sink, by name, in its order: each module of ``metricsvc.sinks`` that
    is a sink declares ``BUILTIN`` (adding a sink is adding its module)."""
    found = []
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):  # a sink: BUILTIN in it
        spec = getattr(importlib.import_module(f"metricsvc.sinks.{info.name}"), "BUILTIN", None)
        if spec is not None:
            found.append(spec)
    return {spec.name: spec for spec in sorted(found, key=lambda s: s.order)}


class CustomSinkConfig(Strict):
    """A third-party sink: ``pkg.module:Class`` or a ``metricsvc.sinks`` entry-point name."""

    target: str
    name: str | None = Field(None, description="the name used in health and dead letters")
    options: dict[str, Any] = Field(default_factory=dict, description="passed to the factory")


class DeliveryConfig(Strict):
    """How failing sinks are retried before their steps go to the dead-letter file."""

    retries: int = Field(3, ge=0)
    backoff_s: float = Field(0.2, ge=0)
    max_backoff_s: float = Field(5.0, ge=0)
    queue_size: int = Field(10_000, ge=1, description="steps waiting per sink")
    dead_letter: str = "dead_letter.jsonl"
    close_timeout_s: float = Field(
        30.0, gt=0, description="at close, steps a sink has not taken by then are dead-lettered"
    )

    _dead_letter = field_validator("dead_letter")(
        classmethod(lambda cls, v: plain(v, "dead_letter"))
    )


class _Sinks(Strict):
    """Which sinks receive finished steps; ``null`` (or ``enabled: false``) turns one off."""

    def enabled(self) -> list[tuple[str, Any]]:
        """Return ``(name, config)`` of every enabled built-in sink, in their order."""
        out = []
        for name in builtins():
            cfg = getattr(self, name)
            if cfg is not None and cfg.enabled:
                out.append((name, cfg))
        return out


def sinks_model() -> type[Strict]:
    """The ``sinks:`` config section: a field per built-in sink (its registration's model
    and default), then ``custom`` and ``delivery``."""
    fields: dict[str, Any] = {name: (spec.config | None, spec.default)
                              for name, spec in builtins().items()}
    fields["custom"] = (tuple[CustomSinkConfig, ...], ())
    fields["delivery"] = (DeliveryConfig, DeliveryConfig())
    return create_model("SinksConfig", __base__=_Sinks, __module__="metricsvc.config",
                        **fields)


# -- what a sink may show ------------------------------------------------------------
def tagged(metrics: Mapping[str, float], meta: Mapping[str, Any] | None = None,
           max_length: int = MAX_TAG_LENGTH) -> dict[str, float]:
    """Return ``{safe_tag: value}`` of a step's ``metrics``. A name whose tag the run shows
    another name under (``meta["sink_tags"]``, from the service) is left out; of names
    sharing a tag otherwise the first in ``tag_order`` keeps it, never a silent overwrite
    (the service lists such names in the step's ``meta["collisions"]``)."""
    out: dict[str, float] = {}
    owner: dict[str, str] = {}
    shown = (meta or {}).get("sink_tags") or {}
    for key, value in metrics.items():
        tag = safe_tag(key, max_length)
        if shown.get(tag, key) != key:
            continue
        held = owner.get(tag)
        if held is None or tag_order(key, tag) < tag_order(held, tag):
            owner[tag], out[tag] = key, value
    return out


def descriptions(meta: Mapping[str, Any], max_length: int = MAX_TAG_LENGTH) -> dict[str, str]:
    """Return ``{safe_tag: "help [unit]"}`` for the names this step is the first to export
    with a description (``meta["descriptions"]``, from the declarations' help and unit)."""
    out = {}
    for name, text in (meta.get("descriptions") or {}).items():
        words = " ".join(part for part in (text.get("help", ""), text.get("unit") and
                                           f"[{text['unit']}]") if part)
        out.setdefault(safe_tag(name, max_length), words)
    return out
