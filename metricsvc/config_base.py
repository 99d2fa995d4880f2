"""The base of every config model: strict (an unknown key is an error naming it), frozen,
and the one check that a name stays a plain path part."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from metricsvc.core.keys import is_plain_part


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def plain(value: str, what: str) -> str:
    """Return ``value`` if it is one plain path part: nothing can escape the run folder."""
    if not is_plain_part(value):
        raise ValueError(f"{what} must be a plain file name (letters, digits, ._-), got {value!r}")
    return value
