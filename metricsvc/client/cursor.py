"""Which step a rank's records belong to, and how a step is closed.

Records belong to the client's open step. Closing a step takes its records as one final
batch and opens the next step; a caller may name the step it means (its trainer's global
step), and the client moves there only when nothing recorded is pending. A close it
refuses (a step already closed, another step while records are pending) drops its
records, as a refusal by the service does: the records of one close never reach another
step. After ``discard()`` or a refused close the records go to the step the caller names
next.
"""

from __future__ import annotations

import warnings
from typing import Any

from metricsvc.protocol import (
    Batch,
    LateBatch,
    ServiceNotice,
    StepAlreadyFinal,
    StepMismatch,
    is_int,
)


class StepCursor:
    """A rank's open step, the last step it closed, the batch closed and not yet acked,
    and the rules for moving between steps."""

    def __init__(self, rank: int, world_size: int, start_step: int, buffer: Any) -> None:
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.rank, self.world_size = rank, world_size
        self.buffer = buffer  # its label names the open step in errors
        self.step = int(start_step)
        self.last_closed: int | None = None
        self.known = True  # False after discard(): records go to the step named next
        self.seq = 0  # the number of this rank's last batch
        self.flushes = 0  # steps acked
        self.unacked: Batch | None = None  # closed, not yet acked (kept across a timeout)
        buffer.label = f"step {start_step}"

    def close(self, step: int | None, caller: str = "wait_submit") -> Batch:
        """Take the open step's records (after moving to ``step``, if named) as one final
        batch: the same one again after a timed-out ``wait_submit``."""
        with self.buffer.lock:
            if step is not None:
                self.name_step(step, caller)
            if self.unacked is None:
                self.seq += 1
                self.unacked = self.buffer.take_batch(
                    step=self.step, rank=self.rank, world_size=self.world_size,
                    seq=self.seq, final=True)
            return self.unacked

    def handed_over(self, batch: Batch) -> None:
        """``batch`` is the sender's now (or was refused): its step is closed."""
        self.unacked = None
        self.closed(batch.step)

    def name_step(self, step: int, caller: str = "wait_submit") -> None:
        """Move to ``step`` as ``name`` does, with what is pending for the open one."""
        self.name(step, caller, self.unacked is not None or len(self.buffer) > 0)

    def discard(self) -> tuple[int, Batch | None]:
        """Drop what was recorded for the open step; return how many keys were withdrawn
        and the batch a timed-out ``wait_submit`` sent already (it cannot be withdrawn)."""
        with self.buffer.lock:
            dropped = self.buffer.discard()
            sent, self.unacked = self.unacked, None
            self.known = False  # what comes next is for the step the caller names
        return dropped, sent

    def after_ack(self, ack: dict[str, Any], batch: Batch) -> None:
        """Say what the service's answer to ``batch`` means for this rank: a late step, a
        notice, or (a first flush for a step already final) a late join."""
        self.flushes += 1
        joined_late = self.joined_late(ack, batch.step, self.flushes)
        if ack["status"] == "late" and not joined_late:
            warnings.warn(LateBatch(
                f"rank {self.rank}: step {batch.step} was published without it (straggler "
                f"timeout); this batch is journaled as late and not merged"), stacklevel=3)
        if ack.get("notice"):
            warnings.warn(ServiceNotice(f"rank {self.rank}: {ack['notice']}"), stacklevel=3)
        if joined_late:
            self.catch_up(ack, batch.step)

    def open(self, step: int) -> None:
        self.step = step
        self.buffer.label = f"step {step}"

    def closed(self, step: int) -> None:
        """``step`` was closed: the next one opens."""
        self.last_closed = step
        self.known = True
        self.open(step + 1)

    def name(self, step: int, caller: str, pending: bool) -> None:
        """Move to the step the caller names, if nothing recorded is ``pending`` for the
        open one (and never backwards). Otherwise the close is refused, as the service
        refuses a batch: what was recorded for it is dropped (it cannot be told apart from
        the records of another step), nothing is sent, and the next step the caller names
        is taken (``StepMismatch``, or ``TypeError`` for a step that is no step)."""
        if not is_int(step) or step < 0:
            self.refuse(TypeError, f"{caller}(step={step!r}): step must be an int >= 0")
        if step == self.step:
            return
        if self.last_closed is not None and step <= self.last_closed:
            self.refuse(StepMismatch, f"{caller}(step={step}) refused: this client already "
                                      f"closed step {self.last_closed} (steps only go "
                                      f"forward)")
        if self.known and pending:
            origin = ("its start_step" if self.last_closed is None
                      else f"the step after {self.last_closed}")
            self.refuse(StepMismatch, f"{caller}(step={step}) refused: this client holds "
                                      f"records of step {self.step} ({origin}), which was "
                                      f"never closed, and a step's records never go to "
                                      f"another step")
        self.open(step)

    def refuse(self, error: type[Exception], what: str) -> None:
        """Refuse a close: drop what was recorded for it and raise ``error`` saying so."""
        keys = self.buffer.keys()
        self.buffer.discard()
        self.known = False  # the next step the caller names is taken
        shown = ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more"
                                                         if len(keys) > 8 else "")
        dropped = (f"its records were dropped ({len(keys)} keys: {shown})" if keys
                   else "nothing was recorded for it")
        raise error(f"rank {self.rank}: {what}; {dropped} and nothing was sent; the open "
                    f"step is {self.step}, and the next step named is taken")

    def joined_late(self, ack: dict[str, Any], step: int, flushes: int) -> bool:
        """A first flush (``flushes == 1``) for a step the service has already moved past
        (not just the step that timed out without this rank): the client started at the
        wrong step."""
        last_final = ack.get("last_final_step")
        return (ack["status"] == "late" and flushes == 1 and last_final is not None
                and step < last_final)

    def catch_up(self, ack: dict[str, Any], step: int) -> None:
        """A first flush for a step already final: the client joined late. Move to the
        open step, and say so, loudly."""
        open_step = (ack.get("last_final_step") or step) + 1
        self.open(max(self.step, open_step))
        raise StepAlreadyFinal(
            f"rank {self.rank}: step {step} is already final (the service has published "
            f"up to step {open_step - 1}); this batch was journaled as late, not merged. The "
            f"open step is {open_step}: this client now records for it (start clients with "
            f"start_step=..., or name steps with wait_submit(step=...))"
        )
