"""The backward passes a step inside backward saw, and their ends (docs/design.md §9). A
callback queued on a pass runs at its end, where the bucket still pending steps. A pass that
raises midway (an out-of-memory error the loop catches) never runs it, and autograd lets go
of it with the pass: a callback held here only weakly and gone unrun is a pass that failed.
One record serves the gradients the handle's hooks see and the buckets DDP reduces."""
import weakref

import torch


def backward_pass():
    """Which backward pass is running (autograd's graph task id: -1 outside any, as in a
    joined rank's shadow all-reduce), None where torch has no such query."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else current()


class _End:
    """The callback queued for one pass's end: autograd alone holds it."""

    def __init__(self, passes: "PassEnds", this_pass) -> None:
        self._passes, self._pass = passes, this_pass

    def __call__(self) -> None:
        self._passes.ended(self._pass)


class PassEnds:
    """The backward passes that came since the last step() or zero_grad() and have not ended
    (each with the weak reference to its queued end); `at_end` runs at each one's end."""

    def __init__(self, at_end) -> None:
        self._at_end = at_end
        self._ends: dict = {}  # graph task id -> weakref to its _End, until it ran

    def came(self) -> bool:
        """At a gradient or a DDP bucket (inside backward): the pass's end is queued, once (a
        reentrant checkpoint's nested pass is a pass of its own, ending before its outer
        one). Returns whether, new, this pass came after one that failed and was not
        forgotten since; that one is forgotten now."""
        this_pass = backward_pass()
        end = self._ends.get(this_pass)
        if end is not None and end() is not None:
            return False
        failed = self.failed()
        if failed:
            self._ends = {}
        queued = _End(self, this_pass)
        torch.autograd.Variable._execution_engine.queue_callback(queued)
        self._ends[this_pass] = weakref.ref(queued)
        return failed

    def ended(self, this_pass) -> None:
        self._ends.pop(this_pass, None)
        self._at_end()

    def failed(self) -> bool:
        """A pass raised midway: autograd let go of its end unrun."""
        return any(end() is None for end in self._ends.values())

    def unended(self) -> bool:
        """A pass that came has not ended: if no step() or zero_grad() came since, it failed
        (or is still running)."""
        return bool(self._ends)

    def forget(self) -> None:
        """step() or zero_grad() came: the failed passes before it are dealt with."""
        self._ends = {}


__all__ = ["PassEnds", "backward_pass"]
