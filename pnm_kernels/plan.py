"""Planning a step: every group validated and its parameters with gradients split into
batches (one per device and dtype, each with its backend), checking everything and touching
nothing. Running a plan hands each batch to its backend."""
import itertools
import operator
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .aliasing import GRADIENT, LR, PARAMETER, SCALING, MemoryClaims
from .backends import REGISTRY, check_capturable, native_grad_check, resolve_backend
from .backends.base import Scaling, held_lists_ok, own_state
from .batching import BatchCache, writeback
from .hyper import (Hyper, check_float16_factors, check_sharding, check_state_dtype, signature,
                    steps_in_float32, validate_group, validate_lr)
from .params import check_param, check_param_list, check_unique, describe, shards_match
from .state import claim_state, is_plain

_MAX_GROUPINGS = 64


@dataclass
class Grouping:
    """A param group's parameters with gradients, split by device and dtype."""
    batches: list  # [(backend, parameter indices, plain tensors?, (device, dtype))]
    defer_check: bool = True  # False once the kernel refused a gradient's layout


@dataclass
class PlanItem:
    """One batch of a step: same device, dtype and backend."""
    group: dict
    backend: str
    params: list
    grads: list
    ids: tuple  # identifies the batch's parameters (the batch cache's key)
    layout_ok: Optional[bool]  # every gradient dense and laid out like its parameter?
    origin: Optional[tuple] = None  # (gi, grouping, the group's grads) when the kernel checks


def _pick(params, grads, indices):
    """The parameters and gradients at these indices (the lists themselves when all)."""
    if len(indices) == len(params):
        return params, grads
    return [params[i] for i in indices], [grads[i] for i in indices]


class Planner:
    """Plans steps for one optimizer; keeps each group's grouping while the same parameters
    have gradients, and each group's Hyper while its hyper-parameters stay the same."""

    def __init__(self, adaptive: bool, keys: tuple) -> None:
        self.adaptive = adaptive
        self.keys = keys  # the group keys that decide a step (hyper.PNM_KEYS / ADAPNM_KEYS)
        self._groupings: dict = {}
        self._hypers: dict = {}  # id(group) -> (signature, Hyper)
        # The combinations of cached groupings (their ids) found to step no parameter twice.
        self._unique: set = set()

    def buffer_names(self, names: tuple, group: dict) -> tuple:
        if self.adaptive and not group["amsgrad"]:
            return names[:3]
        return names

    def hyper(self, group: dict, gi: int) -> Hyper:
        """The group's Hyper, validated and built again only when a hyper-parameter changed
        (a scheduler, a user's edit)."""
        now = signature(group, self.keys)
        known = self._hypers.get(id(group))
        if known is not None and known[0] == now:
            return known[1]
        if known is not None and type(group["lr"]) is float and now[1:] == known[0][1:]:
            # Only a float lr changed (a scheduler's, every step): only it is checked.
            validate_lr(group["lr"], f"param_groups[{gi}]", group, self.adaptive)
            hyper = known[1].with_lr(group["lr"])
        else:
            validate_group(group, self.adaptive, f"param_groups[{gi}]")
            hyper = Hyper.from_group(group, self.adaptive)
        self._hypers[id(group)] = (now, hyper)
        return hyper

    def plan(self, optimizer, cache: BatchCache, names: tuple, defer=True,
             only: Optional[set] = None) -> list[PlanItem]:
        """Checks everything and decides the backend of every batch, touching nothing.
        `only`: the ids of the parameters to step (the others as if without gradients).

        The gradients are still checked every step (in C++ where the extension is built).
        One check is deferred: when the whole step is one cached batch for the fused
        kernels, their own argument checks, which run before anything is touched, stand in
        for it, and the step looks closer if they refuse (see refusal_explained)."""
        found: list[Any] = []  # (gi, group, key, grouping, from the cache?, grads, indices)
        regrouped = False
        for gi, group in enumerate(optimizer.param_groups):
            self.hyper(group, gi)
            params = group["params"]
            check_param_list(group, gi)
            grads = [p.grad for p in params]
            if only is not None:  # these parameters alone (by id): the others have no say
                grads = [g if id(p) in only else None for p, g in zip(params, grads)]
            if all(map(operator.is_not, grads, itertools.repeat(None))):  # the common case
                indices: Sequence[int] = range(len(params))
                ids = tuple(map(id, params))
                places = None  # every parameter's: ids say where each is
            else:
                indices = [i for i, g in enumerate(grads) if g is not None]
                ids = tuple(id(params[i]) for i in indices)
                # A grouping holds places in the group: the same parameters stepped, one
                # without a gradient taken out before them, are at other places.
                places = tuple(indices)
            if not indices:
                continue
            # bf16_stochastic_round decides what group_batches checks (a DTensor's sharding).
            key = (id(group), group["backend"], ids, group["state_dtype"],
                   bool(group["bf16_stochastic_round"]), places)
            grouping = self._groupings.get(key)
            regrouped |= grouping is None
            found.append((gi, group, key, grouping, grouping is not None, grads, indices))
        # Cached groupings each step a parameter once, but two of them may now step the same
        # one (a parameter moved into a second group's list by hand): checked for every new
        # combination.
        combination = None if regrouped else tuple(id(f[3]) for f in found)
        if combination not in self._unique:
            check_unique(optimizer.param_groups)
            if combination is not None:  # the next step's, after a new grouping
                if len(self._unique) > _MAX_GROUPINGS:
                    self._unique.clear()
                self._unique.add(combination)
        batch_count = sum(len(f[3].batches) if f[3] else 1 for f in found)
        plan = []
        for gi, group, key, grouping, cached, grads, indices in found:
            params = group["params"]
            layouts = None
            if cached:
                backend, idx, plain, _ = grouping.batches[0]
                deferred = (defer and batch_count == 1 and grouping.defer_check and plain
                            and backend == "fused")
                hit = deferred and cache.lookup(optimizer, group, backend,
                                                self.buffer_names(names, group), key[2])
                # State in a dtype of its own is confirmed before each step (its step can be
                # two kernel calls): never deferred.
                if hit and not own_state(hit):
                    batch_params, batch_grads = _pick(params, grads, idx)
                    plan.append(PlanItem(group, backend, batch_params, batch_grads, key[2],
                                         layout_ok=True, origin=(gi, grouping, grads)))
                    continue
                layouts = check_grads(grouping.batches, params, grads, gi)
                if layouts is None:  # a parameter moved to another device or dtype
                    cached = False
                    cache.drop()
            if not cached:
                grouping = Grouping(group_batches(group, gi, indices))
                if len(self._groupings) > _MAX_GROUPINGS:
                    self._groupings.clear()
                    self._unique.clear()  # ids of groupings let go
                self._groupings[key] = grouping
            for b, (backend, idx, _, (_, dtype)) in enumerate(grouping.batches):
                if dtype == torch.float16 and backend in ("reference", "foreach"):
                    hyper = self._hypers[id(group)][1]
                    if not hyper.in_float32(dtype):
                        check_float16_factors(hyper, f"param_groups[{gi}]")
                batch_params, batch_grads = _pick(params, grads, idx)
                ids = key[2] if len(grouping.batches) == 1 else tuple(map(id, batch_params))
                plan.append(PlanItem(group, backend, batch_params, batch_grads, ids,
                                     layout_ok=layouts[b] if layouts else None))
        return plan


def group_batches(group, gi, indices):
    """[(backend, parameter indices, plain tensors?, (device, dtype))] per (device, dtype);
    raises on the first bad parameter or gradient, naming it."""
    batches = {}
    for pi in indices:
        p = group["params"][pi]
        check_param(p, gi, pi)  # raises, naming the parameter
        if not is_plain(p):  # each DTensor's placements (a batch's first speaks for no other)
            try:
                check_sharding(group["state_dtype"], group["bf16_stochastic_round"], p)
            except ValueError as e:
                raise ValueError(f"{describe(p, gi, pi)}: {e}") from None
        key = (p.device, p.dtype)
        if key not in batches:
            real = p.real.dtype if p.is_complex() else p.dtype
            try:
                check_state_dtype(group["state_dtype"], p)
                backend = resolve_backend(group["backend"], p.device, real,
                                          steps_in_float32(group["state_dtype"],
                                                           group["bf16_stochastic_round"],
                                                           p.dtype),
                                          int8=group["state_dtype"] == torch.int8)
            except (RuntimeError, ValueError) as e:
                # The backends name the dtype they step: a complex one's real view.
                view = f" ({p.dtype} steps as its real view, {real})" if p.is_complex() else ""
                raise type(e)(f"{describe(p, gi, pi)}: {e}{view}") from None
            batches[key] = (backend, [], [True])
        batches[key][1].append(pi)
        if not is_plain(p) or type(p.grad) is not torch.Tensor:
            batches[key][2][0] = False  # subclasses: DTensors are checked by shards_match
    return [(backend, idx, plain[0], (device, dtype))
            for (device, dtype), (backend, idx, plain) in batches.items()]


_native_check = native_grad_check()


def check_grads(batches, params, grads, gi):
    """Checks the gradients of a cached grouping, raising on one that does not match its
    parameter. Returns None when a parameter itself moved to another device or dtype
    (regroup), else per batch whether every gradient is dense and laid out like its
    parameter: True, False, or None where unknown."""
    check = _native_check
    layouts = []
    for _, idx, plain, (device, dtype) in batches:
        first = params[idx[0]]
        if first.device != device or first.dtype != dtype:  # model.to(...): all moved
            return None
        # Complex batches (never held) are checked in Python: a conjugate view is not a
        # layout the native check sees.
        native = check is not None and not dtype.is_complex
        if native and plain:
            bad = check([params[i] for i in idx], [grads[i] for i in idx], True)
            if bad < 0:
                layouts.append(True)
                continue
            rest, layout = idx[bad:], False  # the Python checks below say why
        elif native and shards_match([params[i] for i in idx],
                                                [grads[i] for i in idx], check):
            layouts.append(True)
            continue
        else:
            rest, layout = idx, None
        for pi in rest:
            p = params[pi]
            check_param(p, gi, pi)  # raises when the gradient is at fault
            if (p.device, p.dtype) != (first.device, first.dtype):
                return None
        layouts.append(layout)
    return layouts


def read_while_writing(groups, scaling: Scaling) -> list:
    """What a step reads while it writes, besides the gradients: the groups' tensor lrs and
    GradScaler's tensors (none may lie in memory the step writes)."""
    return ([group["lr"] for group in groups if isinstance(group["lr"], torch.Tensor)]
            + [t for _, t in scaling.named()])


def run(optimizer, plan, planner: Planner, cache: BatchCache, names, scaling: Scaling,
        bucket: bool = False):
    """Runs every item of the plan; returns the batches it ran. Every batch is built (and
    checked) before any runs: a step that raises has not touched a parameter. A bucket
    (some of the parameters, stepped inside backward) steps beside all the others, which
    step in other buckets."""
    for item in plan:
        check_capturable(item.backend, item.params[0].device)
    item_names = [planner.buffer_names(names, item.group) for item in plan]
    drops = cache.drops
    reused = [cache.reused(optimizer, item, n) for item, n in zip(plan, item_names)]
    groups = {id(item.group): item.group for item in plan}.values()
    lrs = read_while_writing(groups, scaling)
    if cache.drops != drops:
        # A batch given new data or memory dropped the cache: every batch is built again, so
        # that its memory is checked against all the others' (one reused before the drop
        # would not be).
        reused = [None] * len(plan)
    elif any(batch is not None for batch in reused) and cache.grad_in_written(
            optimizer, plan, reused, item_names, lrs):
        # A gradient (or a tensor lr) put into memory the step writes since it was checked:
        # every batch is built again, all checked together below, which names it.
        cache.drop()
        reused = [None] * len(plan)
    claims = MemoryClaims()  # the tensors met: memory shared between them is refused
    for group in groups:
        claims.add(group["lr"], group, LR)  # a tensor lr is read while the step writes
    for name, tensor in scaling.named():
        claims.add(tensor, name, SCALING)
    for item, n, batch in zip(plan, item_names, reused):
        if batch is None:  # what building it would refuse, before any state is converted
            cache.check_states(optimizer, item.group, item.params, n, claims)
    built_params = [p for item, batch in zip(plan, reused) if batch is None for p in item.params]
    reused_params = [p for item, batch in zip(plan, reused) if batch is not None
                     for p in item.params]
    # Built alone (the whole step, never-held batches' every step), all is checked together
    # above: the record is for building beside what is reused, or beside other buckets.
    together = (not built_params or (not reused_params and not bucket)
                or cache.claimed_together(optimizer, built_params, reused_params, names, lrs))
    if not together:
        # A parameter new to the step (a group added, a parameter given other memory, one
        # not checked with the reused ones) or a changed state: the reused batches, and a
        # bucket's other parameters, are checked beside the built ones, as when all were.
        for item, n, batch in zip(plan, item_names, reused):
            if batch is not None:
                cache.check_states(optimizer, item.group, item.params, n, claims)
        others = _claim_others(optimizer, plan, planner, cache, names, claims) if bucket else []
    cache.check_memory(optimizer, claims)
    built = [(batch, []) if batch is not None else cache.new_batch(optimizer, item, n)
             for item, n, batch in zip(plan, item_names, reused)]
    if not together:  # noted with the state the builds made
        cache.note_claimed(optimizer, [p for item in plan for p in item.params] + others, names)
    on_device = {}
    for item, (batch, writebacks) in zip(plan, built):
        device = batch.params[0].device
        if device not in on_device:
            on_device[device] = scaling.to(device)
        gi = next(i for i, g in enumerate(optimizer.param_groups) if g is item.group)
        REGISTRY[item.backend].step(batch, planner.hyper(item.group, gi), on_device[device])
        writeback(writebacks)
    return [batch for batch, _ in built]


def _claim_others(optimizer, plan, planner: Planner, cache: BatchCache, names, claims) -> list:
    """Adds to `claims` the memory of the parameters outside the plan that may step (those
    requiring gradients: in other buckets), their gradients' and their state's, and refuses
    one of them, or a tensor of its state, that is a lazy view; the rest of their state is
    checked when their own bucket is built. Returns them."""
    planned = {id(p) for item in plan for p in item.params}
    claimed = []
    for group in optimizer.param_groups:
        group_names = planner.buffer_names(names, group)
        for p in group["params"]:
            if id(p) not in planned and p.requires_grad:
                cache.check_resolved(optimizer, group, p, group_names)
                claims.add(p, p, PARAMETER)
                claims.add(p.grad, p, GRADIENT)
                claim_state(optimizer.state, p, claims, group_names)
                claimed.append(p)
    return claimed


def refusal_explained(optimizer, item, planner: Planner, cache: BatchCache, names) -> bool:
    """The fused kernel refused a batch whose gradient check was left to it. It checks all
    its arguments before touching anything, so the step can be redone carefully when the
    cause is known: a gradient that does not match its parameter raises here, naming it; a
    parameter that moved, a tensor given new data, or a gradient laid out unlike its
    parameter (copied on the careful path) returns True."""
    gi, grouping, grads = item.origin
    layouts = check_grads(grouping.batches, item.group["params"], grads, gi)
    if layouts is None:  # the careful path regroups
        return True
    cached = cache.lookup(optimizer, item.group, item.backend,
                          planner.buffer_names(names, item.group), item.ids)
    if cached is not None and not held_lists_ok(cached):
        return True  # the careful path rebuilds (BatchCache.batch)
    if layouts[0] is False:
        grouping.defer_check = False  # check in C++ first from now on
        return True
    return False
