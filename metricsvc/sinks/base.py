"""The sink protocol and a registry of sink factories by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel


@runtime_checkable
class Sink(Protocol):
    """Receives each finished step once, in increasing step order."""

    name: str

    def open(self, run_dir: Path) -> None:
        """Prepare to write; ``run_dir`` exists and holds the run's files."""

    def write(self, step: int, metrics: Mapping[str, float], meta: Mapping[str, Any]) -> None:
        """Record one finished step."""

    def close(self) -> None:
        """Flush and release resources; a second call is harmless."""


SinkFactory = Callable[[Any], Sink]


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
        """Return a new sink of kind ``name`` built from ``config``."""
        try:
            factory = self._factories[name]
        except KeyError:
            known = ", ".join(sorted(self._factories)) or "none"
            raise ValueError(f"unknown sink {name!r}; registered: {known}") from None
        return factory(config)

    def __contains__(self, name: object) -> bool:
        return name in self._factories


def default_registry() -> SinkRegistry:
    """Return a registry holding the built-in sinks."""
    from metricsvc.sinks.console import ConsoleSink
    from metricsvc.sinks.jsonl import JsonlSink

    registry = SinkRegistry()
    registry.register("console", ConsoleSink)
    registry.register("jsonl", JsonlSink)
    return registry


def build_sinks(sinks_config: BaseModel, registry: SinkRegistry | None = None) -> list[Sink]:
    """Return one sink per enabled entry of a sinks config, in field order."""
    registry = registry or default_registry()
    out: list[Sink] = []
    for name in type(sinks_config).model_fields:
        cfg = getattr(sinks_config, name)
        if cfg is not None and getattr(cfg, "enabled", True):
            out.append(registry.create(name, cfg))
    return out
