"""The rules every side checks names, ranks and steps by: ranks, the service, sinks and
the CLI. It imports only ``metricsvc.core.limits``, so both the client and the service
import it without pulling in the other."""

from __future__ import annotations

import functools
import os
import re

import numpy as np

from metricsvc.core.limits import MAX_KEY_LENGTH, MAX_TAG_LENGTH

DEFAULT_NAME = "metricsvc_worker"  # the MetricWorker's Ray actor name unless configured
# The Ray namespace the service's actors live in unless configured: named, so another
# shell (``metricsvc health``) or another job finds the service without knowing the
# starting driver's anonymous namespace.
DEFAULT_NAMESPACE = "metricsvc"
NAMESPACE_ENV = "METRICSVC_NAMESPACE"  # overrides DEFAULT_NAMESPACE, e.g. per job

_UNSAFE = re.compile(r"[^A-Za-z0-9_./\-]")


def check_key(key: object, max_length: int = MAX_KEY_LENGTH) -> str:
    """Return ``key`` if it is a usable metric name, else raise naming it."""
    if not isinstance(key, str):
        raise TypeError(f"metric keys must be str, got {type(key).__name__} ({key!r})")
    if not key:
        raise ValueError("metric key must be a non-empty string")
    if len(key) > max_length:
        raise ValueError(
            f"metric key {key[:60]!r}... is {len(key)} characters; the limit is {max_length}"
        )
    if not key.isprintable():
        raise ValueError(f"metric key {key!r} contains non-printable characters")
    return key


def is_int(value: object) -> bool:
    """The rule for a count, a step or a rank: an ``int``, never a ``bool`` (which Python
    counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_rank(rank: object, world_size: object) -> tuple[int, int]:
    """Return ``(rank, world_size)`` as ints if ``0 <= rank < world_size``, else raise."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    rank, world_size = int(rank), int(world_size)  # type: ignore[arg-type]
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size


# A stream record's policy version (``StreamRecorder.scalar(..., version=v)``): one count
# under ``<stream>/__version/<v>`` per recording call, read by the service when the window
# is exported into a step (its staleness), never exported as a metric.
VERSION_SEGMENT = "__version"


def version_of(key: str, stream: str) -> int | None:
    """The version a stream's version-count key counts (None: not one)."""
    head, _, tail = key.rpartition("/")
    if head != f"{stream}/{VERSION_SEGMENT}" or not tail.isdigit():
        return None
    return int(tail)


def is_internal(key: str) -> bool:
    """Return True for a key with a path segment ``__<name>``: an input of derived
    metrics only, never exported."""
    if "__" not in key:
        return False
    return any(part.startswith("__") and len(part) > 2 for part in key.split("/"))


@functools.lru_cache(maxsize=65536)  # names recur every step
def safe_tag(key: str, max_length: int = MAX_TAG_LENGTH) -> str:
    """Return ``key`` as a tag every backend accepts: ``[A-Za-z0-9_./-]``, no empty parts."""
    tag = _UNSAFE.sub("_", key)
    tag = "/".join(part if part not in ("", ".", "..") else "_" for part in tag.split("/"))
    return tag[:max_length]


def safe_file_name(name: str) -> str:
    """Return ``name`` as one plain file-name part: a sink tag with ``/`` replaced too."""
    return safe_tag(name).replace("/", "_") or "_"


def is_plain_part(value: str) -> bool:
    """Return True if ``value`` is one plain path part, unchanged by ``safe_file_name``,
    starting with a letter or digit: nothing built from it can leave its folder."""
    return value[:1].isalnum() and value.isascii() and safe_file_name(value) == value


def tag_order(name: str, tag: str) -> tuple[bool, str]:
    """Order the names one step brings under one sink tag: the name written as its tag
    comes first, then the others alphabetically, whatever order the keys arrived in. The
    first takes the tag for the run, if no earlier step gave it (``output.SinkTags``)."""
    return (name != tag, name)


def default_namespace() -> str:
    """Return the namespace a service runs in unless configured: ``$METRICSVC_NAMESPACE``,
    else ``"metricsvc"``. Two jobs on one cluster each set their own (or a ``name``)."""
    return os.environ.get(NAMESPACE_ENV) or DEFAULT_NAMESPACE


def combiner_name(service: str, label: str) -> str:
    """Return the Ray actor name of the combiner ``label`` of service ``service``."""
    return f"{service}--combiner--{label}"
