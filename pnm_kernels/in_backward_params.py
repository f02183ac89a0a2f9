"""The parameters a step inside backward hooks, and which of them it still steps
(docs/design.md §9): one taken out of the optimizer's groups keeps its hook (autograd's cannot
be removed one by one) but neither steps there nor loses its gradient, which is left to whoever
steps it now; one moved into another group is hooked once."""
import weakref

from . import in_backward_owners
from .in_backward_passes import backward_pass
from .params import is_param_list


class WatchedParams:
    """The hooks of one handle: `on_ready` is called with each parameter whose gradient
    autograd has accumulated; DDP's parameters (`reduced_here`, ids) take none (they step in
    DDP's communication hook)."""

    def __init__(self, optimizer, on_ready, reduced_here: set) -> None:
        self.optimizer = optimizer
        self._on_ready = on_ready
        self._reduced_here = reduced_here
        self._hooks: list = []
        self._watched: dict = {}  # id(p) -> weakref(p): the parameters hooked (or DDP's)
        self._hooked: dict = {}  # id(p) -> weakref(p): those whose gradients it frees
        self._places: dict = {}  # id(p) -> (group, index) where still_stepped last found p
        self._searched_in = None  # the backward pass _places was last made in
        in_backward_owners.live(self)

    def watch(self, params) -> None:
        """Hooks on these parameters (those requiring gradients); optimizer.add_param_group
        calls it for those it adds."""
        new = [p for p in params if not self.watches(p)]  # moved between groups: once
        hooked = [p for p in new if p.requires_grad and id(p) not in self._reduced_here]
        hooks: list = []
        try:  # all or none: a hook refused midway leaves none of these
            for p in hooked:
                hooks.append(p.register_post_accumulate_grad_hook(self._on_ready))
        except BaseException:
            for hook in hooks:
                hook.remove()
            raise
        self._watched.update((id(p), weakref.ref(p)) for p in new)
        self._hooked.update((id(p), weakref.ref(p)) for p in hooked)
        self._hooks += hooks

    def watches(self, p) -> bool:
        ref = self._watched.get(id(p))
        return ref is not None and ref() is p

    def hooked_ids(self):
        return self._hooked.keys()

    def stepped_ids(self) -> set:
        """The ids of the optimizer's parameters now (in groups it steps: lists)."""
        return {id(p) for group in self.optimizer.param_groups
                if is_param_list(group["params"]) for p in group["params"]}

    def hooks(self, p) -> bool:
        """Whether p's gradient is freed here once it has stepped (if p is still stepped)."""
        ref = self._hooked.get(id(p))
        return ref is not None and ref() is p

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._hooked = [], {}
        in_backward_owners.removed(self)

    def still_stepped(self, params) -> list:
        """Those of params that are still the optimizer's. Each is looked up where it was
        last seen (a bucket's cost, not the optimizer's size); the places are found again
        once one is not there."""
        groups = self.optimizer.param_groups
        kept, refound = [], False
        for p in params:
            if not self._still_at(p, groups) and not refound and not self._known_absent(p):
                # A group whose params were set by hand as no list steps nothing here: its
                # gradients stay for step(), whose planner refuses it naming the group.
                self._places = {id(q): (gi, pi) for gi, group in enumerate(groups)
                                if is_param_list(group["params"])
                                for pi, q in enumerate(group["params"])}
                self._searched_in = backward_pass()
                refound = True
            if self._still_at(p, groups):
                kept.append(p)
        return kept

    def _known_absent(self, p) -> bool:
        """p was in no group when they were last searched, in this backward pass: each
        gradient of a parameter taken out would search them all again (its hook stays)."""
        now = backward_pass()
        return now not in (None, -1) and now == self._searched_in and id(p) not in self._places

    def _still_at(self, p, groups) -> bool:
        gi, pi = self._places.get(id(p), (-1, -1))
        if not 0 <= gi < len(groups):
            return False
        params = groups[gi]["params"]
        return is_param_list(params) and pi < len(params) and params[pi] is p


__all__ = ["WatchedParams"]
