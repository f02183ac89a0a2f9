"""Whether the backward pass before this one ended (docs/design.md §9): a pass that raises
midway (an out-of-memory error the loop catches) never runs the callbacks queued for its end,
and autograd lets go of them with the pass. The optimizer's zero_grad() after it says so; the
model's does not reach the optimizer, so a new pass asks here."""
import weakref

import torch

from .in_backward_ddp import backward_pass


class PassEnds:
    """The backward pass the last gradient came in, and its end: queued, ran, or let go."""

    def __init__(self) -> None:
        self._current: int | None = None  # autograd's graph task id
        # A weak reference to the callback queued for its end, until it ran.
        self._end: weakref.ref | None = None

    def new_pass_after_failure(self) -> bool:
        """At a gradient (inside backward): whether it is the first of a pass that came after
        one that raised midway and was not forgotten since. A nested pass (a reentrant
        checkpoint's) comes while the pass it is in still runs, its end still queued."""
        this_pass = backward_pass()
        if this_pass == self._current and self._end is not None:
            return False
        failed = self._end is not None and self._end() is None
        end = self._ended  # a new bound method, which autograd alone holds
        torch.autograd.Variable._execution_engine.queue_callback(end)
        self._current, self._end = this_pass, weakref.ref(end)
        return failed

    def _ended(self) -> None:
        self._end = None

    def forget(self) -> None:
        """A failed pass was seen (zero_grad() after it): none to tell the next pass of."""
        self._end = None


__all__ = ["PassEnds"]
