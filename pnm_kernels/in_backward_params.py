"""The parameters a step inside backward hooks, and which of them it still steps
(docs/design.md §9): one taken out of the optimizer's groups keeps its hook (autograd's cannot
be removed one by one) but neither steps there nor loses its gradient, which is left to whoever
steps it now; one moved into another group is hooked once. A parameter steps inside backward
in one optimizer only: another optimizer stepping it would find its gradient freed."""
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .params import is_param_list

# The hooks of every handle not removed, which any optimizer's step is checked against.
_LIVE: "weakref.WeakSet[WatchedParams]" = weakref.WeakSet()
_STEP_HOOK: list = []  # torch.optim's global step pre-hook, once registered


class WatchedParams:
    """The hooks of one handle: `on_ready` is called with each parameter whose gradient
    autograd has accumulated; DDP's parameters (`reduced_here`, ids) take none (they step in
    DDP's communication hook)."""

    def __init__(self, optimizer, on_ready, reduced_here: set) -> None:
        self._optimizer = optimizer
        self._on_ready = on_ready
        self._reduced_here = reduced_here
        self._hooks: list = []
        self._watched: dict = {}  # id(p) -> weakref(p): the parameters hooked (or DDP's)
        self._hooked: dict = {}  # id(p) -> weakref(p): those whose gradients it frees
        self._places: dict = {}  # id(p) -> (group, index) where still_stepped last found p
        _LIVE.add(self)
        if not _STEP_HOOK:
            _STEP_HOOK.append(register_optimizer_step_pre_hook(
                _refuse_stepping_what_steps_in_backward))

    def watch(self, params) -> None:
        """Hooks on these parameters (those requiring gradients); optimizer.add_param_group
        calls it for those it adds."""
        new = [p for p in params if not self.watches(p)]  # moved between groups: once
        self._watched.update((id(p), weakref.ref(p)) for p in new)
        hooked = [p for p in new if p.requires_grad and id(p) not in self._reduced_here]
        self._hooked.update((id(p), weakref.ref(p)) for p in hooked)
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_ready) for p in hooked]

    def watches(self, p) -> bool:
        ref = self._watched.get(id(p))
        return ref is not None and ref() is p

    def frees(self, p) -> bool:
        """Whether p's gradient is freed here once it has stepped inside backward."""
        ref = self._hooked.get(id(p))
        return ref is not None and ref() is p and bool(self.still_stepped([p]))

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._hooked = [], {}
        _LIVE.discard(self)

    def still_stepped(self, params) -> list:
        """Those of params that are still the optimizer's. Each is looked up where it was
        last seen (a bucket's cost, not the optimizer's size); the places are found again
        once one is not there."""
        groups = self._optimizer.param_groups
        kept, refound = [], False
        for p in params:
            if not self._still_at(p, groups) and not refound:
                # A group whose params were set by hand as no list steps nothing here: its
                # gradients stay for step(), whose planner refuses it naming the group.
                self._places = {id(q): (gi, pi) for gi, group in enumerate(groups)
                                if is_param_list(group["params"])
                                for pi, q in enumerate(group["params"])}
                refound = True
            if self._still_at(p, groups):
                kept.append(p)
        return kept

    def _still_at(self, p, groups) -> bool:
        gi, pi = self._places.get(id(p), (-1, -1))
        if not 0 <= gi < len(groups):
            return False
        params = groups[gi]["params"]
        return is_param_list(params) and pi < len(params) and params[pi] is p


def stepping_in_backward_elsewhere(optimizer, p):
    """The optimizer other than `optimizer` in whose backward steps p's gradient is freed, if
    any."""
    for watched in list(_LIVE):
        if watched._optimizer is not optimizer and watched.frees(p):
            return watched._optimizer
    return None


def refuse_stepped_elsewhere(optimizer, named_params) -> None:
    """Refuses, naming it, a parameter that steps inside backward in another optimizer.
    `named_params`: (where, parameter) pairs."""
    for where, p in named_params:
        other = stepping_in_backward_elsewhere(optimizer, p)
        if other is not None:
            raise RuntimeError(
                f"step_in_backward: {where} already steps inside backward in another optimizer "
                f"({type(other).__name__}), whose backward steps free its gradient: a parameter "
                "stepping inside backward belongs to one optimizer. Take it out of one of them, "
                "or remove() the other's handle first (an optimizer replaced without it keeps "
                "stepping inside backward through its hooks)")


def _refuse_stepping_what_steps_in_backward(optimizer, args, kwargs) -> None:
    """torch.optim's global step pre-hook: another optimizer about to step a parameter whose
    gradient a step inside backward frees would find none (the ordinary loop steps it in
    both), so it is refused before it steps."""
    if torch.compiler.is_compiling():  # not traced: a compiled step is not checked
        return
    if all(watched._optimizer is optimizer for watched in list(_LIVE)):
        return  # the usual case: no other optimizer's parameters step inside backward
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            other = stepping_in_backward_elsewhere(optimizer, p)
            if other is not None:
                raise RuntimeError(
                    f"step_in_backward: {type(optimizer).__name__}'s "
                    f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) steps inside "
                    f"backward in another optimizer ({type(other).__name__}), which frees its "
                    "gradient as soon as it has stepped: this step would find none. Nothing "
                    "was stepped; a parameter stepping inside backward belongs to one "
                    "optimizer: take it out of one of them, remove() the other's handle (an "
                    "optimizer replaced without it keeps stepping inside backward through its "
                    "hooks), or use the ordinary step")


__all__ = ["WatchedParams", "refuse_stepped_elsewhere"]
