"""How a built-in sink registers: one ``BUILTIN`` in its own module, which drives the
sink's config section (``sinks.<name>``), its factory and the library it needs. Adding a
sink is adding its module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from metricsvc.config_base import Strict


@dataclass(frozen=True)
class Builtin:
    """A built-in sink: its config name, model and default (None: off unless configured),
    its class as ``module:Class`` (imported when used), and the library it writes with and
    the extra that installs it (None: nothing to install)."""

    name: str
    order: int  # where it stands in the config, health and the order sinks are served
    config: type[Strict]
    default: Any
    factory: str
    library: str | None = None
    extra: str | None = None
