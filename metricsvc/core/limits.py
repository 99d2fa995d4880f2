"""The limits and defaults more than one part reads, each written once, and the one table
type of what ranks send again every step. A leaf module: it imports nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# -- the merge's admission -----------------------------------------------------------------
MAX_PENDING_STEPS = 64  # steps open at once; one more is refused
MAX_STEPS_AHEAD = 32  # a batch this many steps past the oldest open step is refused

# -- names ---------------------------------------------------------------------------------
MAX_KEY_LENGTH = 512  # the default of ``Limits.max_key_length``
MAX_TAG_LENGTH = 255  # the longest tag a sink is given (TensorBoard, wandb, mlflow, ...)

# -- quantiles -----------------------------------------------------------------------------
SKETCH_ALPHA = 0.01  # the quantile sketch's relative accuracy, on ranks and in the service

# -- the samples behind a number -------------------------------------------------------
MAX_TOP = 64  # stat(top=k): the largest k a call may ask for
MAX_TEXT_BYTES = 1024  # stat(text=): a top sample's payload, UTF-8 bytes (cut past it, marked)
MAX_TEXT_FIELDS = 16  # stat(text={field: [...]}): fields a payload may have

# -- alerts --------------------------------------------------------------------------------
MAX_ALERT_RULES = 64  # rules a run may declare (``alerts:``)
MAX_FLAGGED_PER_STEP = 256  # samples one step's alerts may name; past it the step says so

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


class Recent(dict):
    """A dict of at most ``capacity`` entries that forgets the oldest first: every table a
    part keeps of what ranks send again each step (key tuples, their checks, plans) is one
    of these. (A pure function's results are kept by ``functools.lru_cache`` with a
    ``maxsize``: its hits never enter Python.)"""

    __slots__ = ("capacity",)

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self and len(self) >= self.capacity:
            del self[next(iter(self))]
        super().__setitem__(key, value)
