"""What a batch must keep to be merged at all: how far ahead of the oldest open step it is,
how many steps are pending, and what its derived declarations would cost. Each refusal
names the limit (``limits.*``) and leaves the service as it was."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from metricsvc.core.batch import Batch
from metricsvc.core.declare import decode_derived
from metricsvc.core.errors import BatchRejected
from metricsvc.core.validation import KeyCache, Limits, check_batch
from metricsvc.service.derive import Deriver


class Admission:
    """The run's admission limits, checked before anything of a batch is merged."""

    def __init__(self, limits: Limits, max_pending_steps: int, max_steps_ahead: int,
                 deriver: Deriver, sketch_alpha: float) -> None:
        self.limits = limits
        self.max_pending_steps = max_pending_steps
        self.max_steps_ahead = max_steps_ahead
        self.deriver = deriver
        self.sketch_alpha = sketch_alpha  # the service's: a rank's sketch must match it
        self._costs: dict[bytes, tuple[int, int]] = {}  # declarations -> (outputs, reads)
        self._key_cache = KeyCache()

    def check(self, batch: Batch) -> Batch:
        """Return ``batch`` checked against the limits, its declarations decoded (and
        cached for the step) and its sketch's alpha the service's.

        Raises:
            BatchRejected: naming the key or the limit; nothing of it was merged.
        """
        batch = check_batch(batch, self.limits, self._key_cache)
        try:
            decode_derived(batch.derived)
        except (TypeError, ValueError) as err:
            raise BatchRejected(f"step {batch.step} rank {batch.rank}: {err}") from None
        if batch.sketch_rows.size and batch.sketch_alpha != self.sketch_alpha:
            key = batch.keys[int(batch.sketch_rows[0])]
            raise BatchRejected(
                f"key {key!r}: quantile sketch alpha {batch.sketch_alpha} from rank "
                f"{batch.rank} cannot merge with the service's alpha {self.sketch_alpha}"
            )
        return batch

    def check_ahead(self, step: int, who: str, anchor: int | None) -> None:
        """Refuse ``step`` if it is too far past ``anchor``, the oldest step still open."""
        if anchor is not None and step > anchor + self.max_steps_ahead:
            raise BatchRejected(
                f"step {step} from {who} is {step - anchor} steps ahead of the oldest open "
                f"step {anchor} (limit max_steps_ahead={self.max_steps_ahead}); "
                f"is its start_step right?"
            )

    def check_room(self, step: int, pending: Mapping[int, object]) -> None:
        """Refuse a new step when ``pending`` holds as many as the limit."""
        if len(pending) >= self.max_pending_steps:
            raise BatchRejected(
                f"step {step}: {len(pending)} steps are already pending "
                f"(limit max_pending_steps={self.max_pending_steps}); "
                f"oldest pending is {min(pending)}"
            )

    def far_ahead(self, steps: Sequence[int]) -> list[tuple[int, str]]:
        """Of the steps pending before the run's first step finished, return those a
        runaway opened too far past the oldest, each with what its ranks must hear."""
        oldest = min(steps)
        return [(step, f"it is {step - oldest} steps ahead of the oldest open step {oldest} "
                       f"(limit max_steps_ahead={self.max_steps_ahead}); "
                       f"is its start_step right?")
                for step in steps if step > oldest + self.max_steps_ahead]

    def check_cost(self, batch: Batch, declared: tuple, step_keys: Sequence[str]) -> None:
        """Refuse declarations whose work or outputs would pass the limits, over the keys
        the step holds so far (``step_keys``) and the batch's (once per distinct set of
        declarations: ranks send the same every step). Finishing a step keeps to the same
        budget whatever keys come later (``Deriver.derive``)."""
        limits = self.limits
        if len(declared) > limits.max_declarations:
            raise BatchRejected(
                f"step {batch.step}: rank {batch.rank} declares {len(declared)} derived "
                f"metrics; the limit is limits.max_declarations={limits.max_declarations}")
        cost = self._costs.get(batch.derived)
        if cost is None:
            cost = self.deriver.cost(declared, [*batch.keys, *step_keys])
            if len(self._costs) >= 256:
                self._costs.clear()
            self._costs[batch.derived] = cost
        outputs, reads = cost
        what = None
        if outputs > limits.max_derived_outputs:
            what = (f"{outputs:,} derived metrics (limits.max_derived_outputs="
                    f"{limits.max_derived_outputs:,})")
        elif len(batch.keys) + outputs > limits.max_keys_per_batch:
            what = (f"{len(batch.keys):,} keys and {outputs:,} derived metrics "
                    f"(limits.max_keys_per_batch={limits.max_keys_per_batch:,} counts both)")
        elif reads > limits.max_derived_reads:
            what = (f"formulas reading {reads:,} merged records (limits.max_derived_reads="
                    f"{limits.max_derived_reads:,})")
        if what is not None:
            raise BatchRejected(f"step {batch.step}: rank {batch.rank}'s declarations would "
                                f"make {what}; nothing of the batch was merged")
