"""The defaults and rules that more than one part reads, each written once.

The config (``metricsvc.config``), the merge, the ranks' clients, the combiners and the
sinks read these; none writes its own copy. A leaf module: it imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

# -- the merge's admission -----------------------------------------------------------------
MAX_PENDING_STEPS = 64  # steps open at once; one more is refused
MAX_STEPS_AHEAD = 32  # a batch this many steps past the oldest open step is refused

# -- names ---------------------------------------------------------------------------------
MAX_KEY_LENGTH = 512  # the default of ``Limits.max_key_length``
MAX_TAG_LENGTH = 255  # the longest tag a sink is given (TensorBoard, wandb, mlflow, ...)

# -- quantiles -----------------------------------------------------------------------------
SKETCH_ALPHA = 0.01  # the quantile sketch's relative accuracy, on ranks and in the service

# -- calling actors ------------------------------------------------------------------------
RETRY_S = 120.0  # how long a sender waits for a restarting actor before it gives up


@dataclass(frozen=True)
class Limits:
    """Size limits applied to every key and batch (``limits.*`` in the config)."""

    max_key_length: int = MAX_KEY_LENGTH
    max_keys_per_batch: int = 100_000
    max_batch_bytes: int = 64 * 2**20
    max_world_size: int = 1024
    max_declarations: int = 1000  # derived-metric declarations in one batch
    max_derived_outputs: int = 10_000  # derived metrics one step exports
    max_derived_reads: int = 1_000_000  # merged records the formulas of one step read


LIMITS = Limits()  # the defaults


def remember(cache: dict, key: object, value: object, capacity: int) -> None:
    """``cache[key] = value``, first forgetting the oldest entry once ``capacity`` are held:
    the rule of the caches of what ranks send again every step (their keys)."""
    if key not in cache and len(cache) >= capacity:
        cache.pop(next(iter(cache)))
    cache[key] = value


def is_int(value: object) -> bool:
    """The rule for a count, a step or a rank: an ``int``, never a ``bool`` (which Python
    counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)
