"""The repeated step: the last step again, from the lists held in C++, without planning.

After a step in which every param group ran as fused or Triton batches held in C++ (one per
device and dtype), what the next step needs to repeat it is remembered. The C++ lists read
the gradients themselves, so an eager step over thousands of tensors costs no Python loop.
It applies while nothing it depends on changed: the same groups and parameters, the same
state (StateWatch), backends and buffers; other hyper-parameters may change (a scheduler's
lr) and are validated as a planned step would."""
import operator
from dataclasses import dataclass
from typing import Optional

import torch

from .aliasing import written_memory
from .backends import REGISTRY
from .backends.base import Batch, HeldLists, Scaling, step_lists
from .batching import BatchCache
from .params import holdable, is_param_list
from .plan import Planner, read_while_writing
from .state import ParamState, buffer_fits, counted_entry


@dataclass
class HeldBatch:
    """One fused or Triton batch of a param group as the last step ran it."""
    held: HeldLists  # its lists (held.step_lists: the C++ StepLists)
    device: torch.device
    dtype: torch.dtype
    backend: str


@dataclass
class HeldGroup:
    """A param group as the last step ran it: one held batch per device and dtype."""
    group: dict
    params: list
    plan_keys: tuple  # see _plan_keys: a change of any needs a new plan
    batches: list  # [HeldBatch]


def _plan_keys(group: dict, buffer_names: tuple) -> tuple:
    """What decides a group's batches besides its parameters: the backend asked for, the
    buffers needed (AMSGrad), the dtype they are kept in and whether bfloat16 parameters
    round stochastically (another kernel)."""
    return group["backend"], group["state_dtype"], group["bf16_stochastic_round"], buffer_names


class RepeatedStep:
    def __init__(self) -> None:
        # (state version, [HeldGroup], [(HeldGroup, HeldBatch)], their WrittenMemory)
        self._last: Optional[tuple] = None

    def forget(self) -> None:
        self._last = None

    def remember(self, optimizer, plan, batches, planner: Planner, cache: BatchCache,
                 names: tuple) -> None:
        """Where some of a group's parameters had no gradient, the lists held are those of all
        its parameters with state (see _lists_with_state); for Triton, whose tables name every
        tensor they update, only where those all stepped (the others, never stepped, have no
        state: a model passed whole, its frozen part included)."""
        self._last = None
        items = list(zip(plan, batches))
        entries, k = [], 0
        for group in optimizer.param_groups:
            mine = []
            while k < len(items) and items[k][0].group is group:
                mine.append(items[k])
                k += 1
            if not mine:
                return
            group_names = planner.buffer_names(names, group)
            every_param_stepped = sum(len(item.params) for item, _ in mine) == len(group["params"])
            kinds = {(item.params[0].device, item.params[0].dtype) for item, _ in mine}
            held_batches: list[HeldBatch] = []
            for item, batch in mine:
                if (not REGISTRY[item.backend].holds_lists or batch.held is None
                        or batch.held.shards or batch.held.own_state):
                    return
                lists, outside = batch.held.step_lists, ()
                if not every_param_stepped:
                    if item.backend == "triton" and any(
                            p.grad is None and optimizer.state.get(p) for p in group["params"]):
                        return  # Triton cannot skip them (_lists_with_state would refuse)
                    lists, outside = _lists_with_state(optimizer, group, group_names, item,
                                                       lists, kinds)
                if lists is None:
                    return
                # The parameters without state are checked once, by the group's first batch.
                lists.hold_outside(list(outside) if not held_batches else [])
                held = batch.held if lists is batch.held.step_lists else HeldLists(
                    step_lists=lists)
                held_batches.append(HeldBatch(held, item.params[0].device,
                                              item.params[0].dtype, item.backend))
            entries.append(HeldGroup(group, list(group["params"]),
                                     _plan_keys(group, group_names), held_batches))
        if k == len(items):
            flat = [(held, batch) for held in entries for batch in held.batches]
            # Every batch's lists decline a gradient in memory any of them writes.
            written = written_memory()
            for _, batch in flat:
                written.add_lists(batch.held.step_lists)
            for _, batch in flat:
                batch.held.step_lists.watch_written(written)
            self._last = (cache.version(optimizer), entries, flat, written)

    def run(self, optimizer, scaling: Scaling, planner: Planner, cache: BatchCache,
            names: tuple) -> bool:
        """The last step again, if it applies. False, having done nothing, when it does not
        (a gradient for a parameter without state, or one laid out unlike its parameter,
        included, or a batch's kernel refusing its arguments)."""
        if self._last is None:
            return False
        version, entries, flat, written = self._last
        groups = optimizer.param_groups
        if len(groups) != len(entries) or cache.version(optimizer) != version:
            return False
        hypers = []
        for gi, (group, held) in enumerate(zip(groups, entries)):
            current = group["params"]
            if (group is not held.group or not is_param_list(current)
                    or len(current) != len(held.params)
                    or not all(map(operator.is_, current, held.params))):
                return False
            hyper = planner.hyper(group, gi)  # validated again where it changed
            if _plan_keys(group, planner.buffer_names(names, group)) != held.plan_keys:
                return False
            hypers.append(hyper)
        lrs = read_while_writing(groups, scaling)
        if lrs and written.grads_met(lrs):
            return False  # a tensor lr (GradScaler's tensors) in memory the step writes: the
            # planned step names it
        hyper_of = {id(held): hyper for held, hyper in zip(entries, hypers)}
        several = len(flat) > 1
        if several and not all(b.held.step_lists.take_own_grads() for _, b in flat):
            _drop_taken_grads(flat)
            return False
        # Every batch is prepared (Triton: its gradients and tables taken) before any steps:
        # a Triton kernel checks nothing, so one that cannot step stops the whole step.
        launches = []
        for held, batch in flat:
            try:
                launch = REGISTRY[batch.backend].prepare_repeat(
                    batch.held, batch.device, batch.dtype, hyper_of[id(held)], several)
            except RuntimeError:  # tables to build inside a capture: the careful step
                launch = None  # says what to do
            if launch is None:
                _drop_taken_grads(flat)
                return False
            launches.append(launch)
        on_device = {}  # moved once per step, not per batch: host time is most of it here
        for i, ((_, batch), launch) in enumerate(zip(flat, launches)):
            if batch.device not in on_device:
                on_device[batch.device] = scaling.to(batch.device)
            try:
                done = launch(on_device[batch.device])
            except RuntimeError:
                _drop_taken_grads(flat)
                if i == 0:  # refused before touching anything: the careful path says why
                    return False
                raise  # a later batch refused after earlier ones stepped
            if not done:  # only without `several`, so in the first and only batch
                return False
        return True


def _drop_taken_grads(flat) -> None:
    """The gradients take_own_grads() took and no step used: not kept until the next."""
    for _, batch in flat:
        batch.held.step_lists.drop_taken_grads()


def _lists_with_state(optimizer, group, names, item, lists, kinds):
    """For a group of which only some parameters stepped (the plan item's, one of the
    group's batches, whose (device, dtype) pairs are `kinds`): C++ lists of every parameter
    with state on the item's device and of its dtype, so that steps where others lack a
    gradient (mixture-of-experts layers, unused branches) repeat too, those without one
    skipped in C++; and the group's parameters without state, which must get none. (None, ())
    where a parameter with state belongs to no batch of the step (another device or dtype)
    or cannot join the item's lists (another layout, state not made like the batch's).
    `lists`: the batch's own, used when they are all of them."""
    device, dtype = item.params[0].device, item.params[0].dtype
    held, states, outside = [], [], []
    for p in group["params"]:
        state = counted_entry(optimizer.state, p)
        if not state:
            outside.append(p)
            continue
        if (p.device, p.dtype) != (device, dtype) and (p.device, p.dtype) in kinds:
            continue  # another batch of the step holds it
        if not (type(state) is ParamState and holdable(p) and p.device == device
                and p.dtype == dtype and getattr(state.get("step"), "device", None) == device
                and all(name in state and buffer_fits(state[name], p) for name in names)):
            return None, ()
        held.append(p)
        states.append(state)
    if len(held) == len(item.params):  # every parameter with state stepped
        return lists, tuple(outside)
    batch = Batch(held, [], [[state[name] for state in states] for name in names],
                  [state["step"] for state in states], held=HeldLists())
    return step_lists(batch), tuple(outside)
