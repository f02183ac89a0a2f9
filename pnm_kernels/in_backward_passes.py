"""The backward passes a step inside backward saw, and their ends (docs/design.md §9). A
callback queued on a pass runs at its end, where the bucket still pending steps. A pass that
raises midway (an out-of-memory error the loop catches) never runs it, and autograd lets go
of it with the pass: a callback held here only weakly and gone unrun is a pass that failed.
A reentrant checkpoint's nested pass ends inside a node of its outer pass, which may fail
after it: the outer pass's end is awaited too, queued from that node's end (a hook on it,
run in the outer pass). One record serves the gradients the handle's hooks see and the
buckets DDP reduces."""
import sys
import weakref

import torch


def backward_pass():
    """Which backward pass is running (autograd's graph task id: -1 outside any, as in a
    joined rank's shadow all-reduce), None where torch has no such query. Under compiled
    autograd none is: refused by name."""
    _refuse_compiled_autograd()
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else current()


def _running_node():
    """The autograd node being run on this thread (that of an outer pass while a nested pass
    it runs ends), None outside any or where torch has no such query."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return None if current is None else current()


class _End:
    """The callback queued for one pass's end: autograd alone holds it."""

    def __init__(self, passes: "PassEnds", this_pass) -> None:
        self._passes, self._pass = passes, this_pass

    def __call__(self) -> None:
        self._passes.ended(self._pass, _running_node())


class _OuterResumed:
    """The hook on the node of an outer pass that a nested pass ended in: run once that node
    is done, in the outer pass. The node alone holds it, so it is gone unrun once autograd
    lets go of a graph that failed in that node."""

    def __init__(self, passes: "PassEnds", key) -> None:
        self._passes, self._key = passes, key

    def __call__(self, *_) -> None:
        self._passes.outer_resumed(self._key)


class PassEnds:
    """The backward passes that came since the last step() or zero_grad() and have not ended,
    each with a weak reference to its queued end (or, an outer pass a nested one ended in, to
    the hook on that node); `at_end` runs at each one's end."""

    def __init__(self, at_end) -> None:
        # Weakly: a retained graph keeps a node's hook, which must not keep the handle.
        self._at_end = weakref.WeakMethod(at_end)
        self._ends: dict = {}  # graph task id (or ("outer of", id)) -> weakref, until run

    def came(self) -> bool:
        """At a gradient or a DDP bucket (inside backward): the pass's end is queued, once (a
        reentrant checkpoint's nested pass is a pass of its own, ending before its outer
        one). Returns whether, new, this pass came after one that failed and was not
        forgotten since; that one is forgotten now."""
        this_pass = backward_pass()  # refuses compiled autograd
        end = self._ends.get(this_pass)
        if end is not None and end() is not None:
            return False
        failed = self.failed()
        if failed:
            self._ends = {}
        self._queue_end(this_pass)
        return failed

    def _queue_end(self, this_pass) -> None:
        queued = _End(self, this_pass)
        torch.autograd.Variable._execution_engine.queue_callback(queued)
        self._ends[this_pass] = weakref.ref(queued)

    def ended(self, this_pass, enclosing_node=None) -> None:
        """`this_pass` ran its end; `enclosing_node`: the node of an outer pass it ran in."""
        self._ends.pop(this_pass, None)
        if enclosing_node is None:  # a pass of its own: the nested passes it ran have ended
            # (one that failed, its error caught inside the pass, left its end unrun)
            self._ends = {key: end for key, end in self._ends.items() if end() is not None}
        else:
            key = ("outer of", this_pass)
            hook = _OuterResumed(self, key)
            enclosing_node.register_hook(hook)
            self._ends[key] = weakref.ref(hook)
        at_end = self._at_end()
        if at_end is not None:
            at_end()

    def outer_resumed(self, key) -> None:
        """The node a nested pass ended in is done (in the outer pass): that pass's end is
        queued, unless it is already."""
        self._ends.pop(key, None)
        outer = backward_pass()
        end = self._ends.get(outer)
        if end is None or end() is None:
            self._queue_end(outer)

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


def _refuse_compiled_autograd() -> None:
    """Compiled autograd (torch._dynamo.compiled_autograd) traces the backward pass into a
    graph: a pass's end cannot be queued outside it (torch asserts inside its engine), and
    the hooks' steps would be traced into the graph. Refused by name, before any step."""
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")
    if compiled is not None and (compiled.compiled_autograd_enabled
                                 or compiled.in_compiled_autograd_region):
        raise RuntimeError(
            "pnm_kernels: step_in_backward does not run under compiled autograd "
            "(torch._dynamo.compiled_autograd): its steps run from hooks the backward pass "
            "calls eagerly. Compile the model and its forward, not the backward pass, or "
            "remove the handle (handle.remove()) and step after backward")


__all__ = ["PassEnds", "backward_pass"]
