"""Which step a rank's records belong to.

Records belong to the client's open step. Closing a step opens the next one; a caller may
name the step it means (its trainer's global step), and the client moves there only when
nothing recorded is pending: records of a step that was never closed are never merged into
another. After ``discard()`` the records go to the step the caller names next.
"""

from __future__ import annotations

from typing import Any

from metricsvc.protocol import StepAlreadyFinal, StepMismatch


class StepCursor:
    """A rank's open step, the last step it closed, and the rules for moving between."""

    def __init__(self, rank: int, start_step: int, buffer: Any) -> None:
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.rank = rank
        self.buffer = buffer  # its label names the open step in errors
        self.step = int(start_step)
        self.last_closed: int | None = None
        self.known = True  # False after discard(): records go to the step named next
        buffer.label = f"step {start_step}"

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
        open one (and never backwards); else raise ``StepMismatch``: nothing is sent."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"step must be an int >= 0, got {step!r}")
        if step == self.step:
            return
        backwards = self.last_closed is not None and step <= self.last_closed
        if backwards or (self.known and pending):
            origin = ("its start_step" if self.last_closed is None
                      else f"the step after {self.last_closed}")
            what = (f"already closed step {self.last_closed}: steps only go forward" if backwards
                    else f"holds records of step {self.step} ({origin}), which was never closed "
                         f"(an exception between recording and wait_submit? call discard() "
                         f"after a failed step; or start the client with start_step={step})")
            raise StepMismatch(f"rank {self.rank}: {caller}(step={step}), but this client "
                               f"{what}; nothing was sent")
        self.open(step)

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
