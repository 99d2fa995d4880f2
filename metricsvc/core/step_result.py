"""A finished step, as readers, sinks and the journal see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepResult:
    """A finished step: exported metrics and what is known about how they were made."""

    step: int
    metrics: dict[str, float]
    meta: dict[str, Any]
