"""A parameter steps inside backward in one optimizer only (docs/design.md §9): its gradient is
freed once it has stepped there, so another optimizer stepping it (the ordinary loop steps it
in both) would find none and silently skip it. Such a step is refused before it steps, through
torch.optim's global step pre-hook (eager steps: a compiled one is not traced into it), and so
is a second step_in_backward() or a group added over such a parameter. An optimizer wrapping
another and sharing its `param_groups` list (Lookahead's pattern, whose step() steps the inner
one) is the same optimizer here; one built over the same group dicts is not."""
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .params import describe

# The WatchedParams of every handle not removed.
_LIVE: weakref.WeakSet = weakref.WeakSet()
_STEP_HOOK: list = []  # the global step pre-hook, once registered


def live(watched) -> None:
    """A handle's hooks are on: every optimizer's step is checked against them from now on."""
    _LIVE.add(watched)
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_refuse_stepping_elsewhere))


def removed(watched) -> None:
    _LIVE.discard(watched)


def stepping_in_backward(params=None) -> list:
    """The handles, not removed, of the optimizers stepping any of `params` inside backward
    (every one with `params` None): how a handle whose optimizer was replaced, or never kept,
    is found and removed."""
    params = None if params is None else list(params)
    handles: list = []
    for watched in list(_LIVE):
        handle = getattr(watched.optimizer, "_in_backward", None)
        if handle is None or any(h is handle for h in handles):
            continue
        # By identity, not id(): a parameter gone may have left its id to another.
        if params is None or any(watched.hooks(p) for p in params):
            handles.append(handle)
    return handles


def _stepped_elsewhere(optimizer, params):
    """The first of `params` ((label, parameter) pairs) whose gradient the step inside
    backward of another optimizer frees, with that optimizer; None if none."""
    for watched in list(_LIVE):
        if _same(watched.optimizer, optimizer):
            continue
        candidates = [(label, p) for label, p in params if watched.hooks(p)]
        if candidates:  # still in its groups? one walk for all
            kept = watched.stepped_ids()
            for label, p in candidates:
                if id(p) in kept:
                    return label, p, watched.optimizer
    return None


def _same(a, b) -> bool:
    """One optimizer, or one wrapping the other with its very param_groups list."""
    return a is b or a.param_groups is b.param_groups


def refuse_stepped_elsewhere(optimizer, named_params) -> None:
    """Refuses, naming it, a parameter that steps inside backward in another optimizer.
    `named_params`: (where, parameter) pairs."""
    found = _stepped_elsewhere(optimizer, list(named_params))
    if found is not None:
        where, _, other = found
        raise RuntimeError(
            f"step_in_backward: {where} already steps inside backward in another optimizer "
            f"({type(other).__name__}), whose backward steps free its gradient: a parameter "
            f"stepping inside backward belongs to one optimizer. {_REMEDY}")


def _refuse_stepping_elsewhere(optimizer, args, kwargs) -> None:
    """torch.optim's global step pre-hook."""
    if torch.compiler.is_compiling():  # not traced: a compiled step is not checked
        return
    others = [watched for watched in list(_LIVE) if not _same(watched.optimizer, optimizer)]
    if not others:
        return  # the usual case: no other optimizer's parameters step inside backward
    hooked: set = set().union(*(watched.hooked_ids() for watched in others))
    suspects = [((gi, pi), p) for gi, group in enumerate(optimizer.param_groups)
                if not hooked.isdisjoint(map(id, group["params"]))  # at C speed, mostly
                for pi, p in enumerate(group["params"]) if id(p) in hooked]
    found = _stepped_elsewhere(optimizer, suspects) if suspects else None
    if found is not None:
        (gi, pi), p, other = found
        raise RuntimeError(
            f"step_in_backward: {type(optimizer).__name__}'s {describe(p, gi, pi)} steps inside "
            "backward in another optimizer "
            f"({type(other).__name__}), which frees its gradient as soon as it has stepped: "
            f"this step would find none. Nothing was stepped. {_REMEDY}")


_REMEDY = ("Take it out of one of them, or remove() the other's handle (an optimizer replaced "
           "without it keeps stepping inside backward through its hooks: "
           "pnm_kernels.stepping_in_backward(model.parameters()) finds its handle)")

__all__ = ["live", "refuse_stepped_elsewhere", "removed", "stepping_in_backward"]
