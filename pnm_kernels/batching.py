"""The tensor lists a step hands to a backend, and the cache that keeps them between steps.

The lists of parameters, buffers and counters are cached while the parameters with gradients
and the state stay the same (StateWatch); only the gradients are new each step."""
import contextlib
import operator
from typing import Optional

import torch

from ._ops import extension_error
from .aliasing import (GRADIENT, LR, PARAMETER, SCALING, MemoryClaims, SharedMemoryError,
                       held_params, written_memory)
from .backends import REGISTRY
from .backends.base import (Batch, HeldLists, held_lists_ok, held_memory, hold_layouts,
                            layouts_unchanged, own_state, tensor_layouts)
from .layout import LAZY_VIEW_ADVICE, dense_like, lazy_view
from .hyper import needs_seed, steps_in_float32
from .params import (describe, describe_in, element_offset, holdable, kernel_batch, local,
                     shard_holdable, shard_of)
from .quantization import scale_name
from .state import (REFUSED_LOAD, BufferShapeError, CodesWithoutScalesError, ParamState,
                    StateValueError, StateWatch, check_resolved, check_state, claim_state,
                    count_replacement, ensure_state, inference_tensors_writable, is_plain,
                    keys_read)

_MAX_ENTRIES = 64


class BatchCache:
    """The cached lists of each (group, backend, state_dtype, buffers, parameters) batch,
    valid while the state's version is the one they were built at."""

    def __init__(self) -> None:
        self.watch = StateWatch()
        self._entries: dict = {}
        self.drops = 0  # how many times every cached list was forgotten
        # The state's version and the parameters (id: memory) last checked together (their
        # memory and state, plan.run): a batch built of these alone, the state unchanged,
        # cannot share memory with the batches reused beside it.
        self._claimed: tuple = (None, {}, None)  # ..., and their tensors' tensor_layouts
        self._claimed_written = written_memory()  # where those noted lie (note_claimed)
        # Where every cached batch's tensors lie (grad_in_written), made again when read
        # after the entries changed.
        self._written = written_memory()
        self._written_stale = False

    def version(self, optimizer):
        return self.watch.version(optimizer)

    def drop(self) -> None:
        """Forgets every cached list, letting go of the tensors they hold."""
        self.watch.drop()
        self._entries.clear()
        self._written.clear()
        self._written_stale = False
        self.drops += 1

    def lookup(self, optimizer, group, backend, names, ids) -> Optional[Batch]:
        """The cached lists of a batch (gradients left out), if still valid."""
        hit = self._entries.get(_key(group, backend, names, ids))
        return hit[1] if hit is not None and hit[0] == self.version(optimizer) else None

    def reused(self, optimizer, item, names) -> Optional[Batch]:
        """The kernel-ready lists for a plan item from the cache, confirmed for this step's
        gradients, or None when they must be built (new_batch)."""
        group, backend, params = item.group, item.backend, item.params
        cached = self.lookup(optimizer, group, backend, names, item.ids)
        grads = item.grads
        if cached is not None and cached.held is not None and cached.held.shards:  # its params are all DTensors
            if all(map(operator.is_, map(shard_of, params), cached.params)):
                grads = list(map(shard_of if item.layout_ok else local, grads))
            else:  # FSDP2 gave a parameter a new shard (after model.to(...), say)
                cached = None
        if (cached is not None and (item.origin is None or own_state(cached))
                and not held_lists_ok(cached)):
            # A parameter, buffer or counter was given new data (t.data = ...) of another
            # dtype, shape or layout, or in other memory: rebuild, its state following it,
            # its memory checked. (On the deferred path the kernel's own checks find this,
            # held memory included, before touching anything.)
            self.drop()
            cached = None
        if cached is not None:
            layout_ok = item.layout_ok
            if layout_ok is None:
                layout_ok = all(map(dense_like, grads, cached.params))
            if layout_ok:
                return Batch(cached.params, grads, cached.buffers, cached.steps, cached.held,
                             cached.seeds, cached.offsets, cached.scales)
        return None

    def new_batch(self, optimizer, item, names) -> tuple[Batch, list]:
        """The kernel-ready lists for a plan item, built (its state made or converted where
        needed) and cached where they can be reused, and the (param, dense copy) pairs to
        write back after the step."""
        group, backend, params = item.group, item.backend, item.params
        batch, writebacks, counted = self.build(optimizer, group, params, names,
                                                REGISTRY[backend].flat)
        shards = not all(map(holdable, params))
        simple = counted and not writebacks and (not shards or all(map(shard_holdable, params)))
        if simple and REGISTRY[backend].holds_lists:
            version = self.version(optimizer)
            for key in [k for k, (v, _) in self._entries.items() if v != version]:
                del self._entries[key]  # stale: holds tensors the state may have replaced
            if len(self._entries) > _MAX_ENTRIES:
                self._entries.clear()
            batch.held = HeldLists(shards=shards)
            if extension_error() is not None:
                batch.held.memory = held_memory(batch)
            if steps_in_float32(group["state_dtype"], group["bf16_stochastic_round"],
                                params[0].dtype):  # its kernels take seeds and scales too
                batch.held.own_state = True
                batch.held.layouts = hold_layouts(batch)
            # Cached without this step's gradients: holding them would keep a whole set of
            # gradients alive after zero_grad() (a model's worth of GPU memory).
            held = Batch(batch.params, [], batch.buffers, batch.steps, batch.held, batch.seeds,
                         batch.offsets, batch.scales)
            self._entries[_key(group, backend, names, item.ids)] = (
                version, held)
            self._written_stale = True
        return batch, writebacks

    def build(self, optimizer, group, params, names, flat):
        """The batch, its write-backs, and whether every state it read counts its changes
        (only then may its lists be reused: see state.py)."""
        places = ParameterPlaces(optimizer)
        states = [self.state_for(optimizer, p, names, group, places) for p in params]
        batch, writebacks = kernel_batch(params, [p.grad for p in params],
                                         [[state[name] for state in states] for name in names],
                                         [state["step"] for state in states], flat)
        if needs_seed(group["state_dtype"], group["bf16_stochastic_round"], params[0].dtype):
            batch.seeds = [state["seed"] for state in states]
            batch.offsets = [element_offset(p) for p in params]
        if group["state_dtype"] == torch.int8:
            batch.scales = [[_local_or_none(state.get(scale_name(name))) for state in states]
                            for name in names]
        return batch, writebacks, all(type(state) is ParamState for state in states)

    def state_for(self, optimizer, p, names, group, places=None) -> dict:
        """p's state with these buffers: made where missing, converted where p (or a buffer,
        or its counter) was given new data since, or the group's state_dtype changed.
        Another shape is an error."""
        state_dtype = group["state_dtype"]
        seed = None
        if needs_seed(state_dtype, group["bf16_stochastic_round"], p.dtype):
            places = places or ParameterPlaces(optimizer)
            seed = lambda: places(p)  # noqa: E731  (where it has none)
        with _explained(optimizer, group, p):
            state, replaced = ensure_state(optimizer.state, p, names,
                                           None if p.is_complex() else state_dtype, seed)
        if replaced:  # an entry may be shared (opt2.state = opt1.state): every cache reads it
            count_replacement()
        return state

    def check_states(self, optimizer, group, params, names, claims: MemoryClaims) -> None:
        """Raises, naming the parameter, where building a batch of these parameters of the
        group would raise on one's state, or a tensor of its state is that of another key or
        parameter; adds the parameters, their gradients and state to `claims`, whose check
        (check_memory) then refuses memory shared between them. Before any state is converted
        (plan.run asks it of every batch to build, traced.init_group of every group)."""
        inference_ok = inference_tensors_writable()
        for p in params:
            with _explained(optimizer, group, p):
                check_state(optimizer.state, p, names, inference_ok)
                claims.add(p, p, PARAMETER)
                claims.add(p.grad, p, GRADIENT)
                claim_state(optimizer.state, p, claims, names)

    def check_resolved(self, optimizer, group, p, names) -> None:
        """Raises, naming p, where p or a tensor of its state the step reads is a lazy
        negative or conjugate view (a parameter of another bucket inside backward, checked
        with the first bucket built after memory changed)."""
        lazy = lazy_view(local(p))
        if lazy:
            raise RuntimeError(f"{_describe(optimizer, group, p)} is an unresolved {lazy} view "
                               f"(from .conj() or similar): {LAZY_VIEW_ADVICE}")
        with _explained(optimizer, group, p):
            check_resolved(optimizer.state, p, names)

    def grad_in_written(self, optimizer, plan, reused, names, lrs=()) -> bool:
        """Whether a gradient (or a group's tensor lr, `lrs`) of the step lies in memory a
        cached batch writes, or, beside the reused batches, memory a batch to build writes:
        put there since the lists were built and their memory checked (`p.grad = q.data`),
        which neither the held lists nor the record of what was checked together
        (claimed_together) see. A reused batch's gradients are read in C++ (HeldParams); a
        shard's is its DTensor's, given here."""
        if self._written_stale:
            self._written.clear()
            for _, batch in self._entries.values():
                self._written.add(_held_tensors(batch))
            self._written_stale = False
        grads: list = list(lrs)  # those given here (tensor lrs: only read, as gradients)
        held: list = []  # reused batches' HeldParams
        also: list = []  # what the batches to build write
        state = optimizer.state
        for item, item_names, batch in zip(plan, names, reused):
            if batch is not None:
                if batch.held.shards:
                    grads += batch.grads
                else:
                    if batch.held.params is None:
                        batch.held.params = held_params(batch.params)
                    held.append(batch.held.params)
                continue
            grads += map(local, item.grads)
            keys = keys_read(item_names)
            for p in item.params:
                also.append(local(p))
                also += [local(t) for key, t in (state.get(p) or {}).items()
                         if key in keys and isinstance(t, torch.Tensor)]
        written = self._written
        if written.grads_met(grads) or any(map(written.params_grads_met, held)):
            return True
        if not also:
            return False
        built = written_memory()
        built.add(also)
        return built.grads_met(grads) or any(map(built.params_grads_met, held))

    def claimed_together(self, optimizer, built, reused, names, lrs=()) -> bool:
        """Whether the parameters of the batches to build were checked together with those
        of the reused ones (note_claimed), in the memory they have now, the state unchanged
        since (the reused ones' memory is confirmed by their held lists)."""
        version, known, _ = self._claimed
        if version != self.version(optimizer):
            return False
        state, keys = optimizer.state, frozenset(keys_read(names))
        if not (all(id(p) in known for p in reused)
                and all(known.get(id(p)) == _memory_of(p, state, keys) for p in built)):
            return False
        # A gradient (or a group's tensor lr, `lrs`) put since into memory of those checked
        # with them (inside backward, another bucket's parameter or state: `b.grad = a.data`
        # in a hook), which the batches built here do not claim.
        grads = [local(p.grad) for p in built if p.grad is not None] + list(lrs)
        return not (grads and self._claimed_written.grads_met(grads))

    def note_claimed(self, optimizer, params, names) -> None:
        """These parameters' memory and state were checked together, replacing the last."""
        state, keys = optimizer.state, frozenset(keys_read(names))
        tensors = [local(t) for p in params
                   for t in (p, *(t for key, t in (state.get(p) or {}).items() if key in keys))
                   if isinstance(t, torch.Tensor)]
        self._claimed = (self.version(optimizer),
                         {id(p): _memory_of(p, state, keys) for p in params},
                         tensor_layouts(tensors))
        self._claimed_written = written_memory()
        self._claimed_written.add(tensors)

    def drop_if_moved(self, optimizer) -> None:
        """Before a backward pass's first bucket (the step inside backward): drops every cached
        list if a tensor they hold, or one of the parameters last checked together
        (note_claimed) or its state, was given other data or memory since (`t.data = ...`,
        which no version counts), so that the bucket is built and checked against the memory
        of every parameter that may step (plan.run) before anything in the pass steps. Both
        confirmed in C++ (held_lists_ok, layouts_unchanged), as an ordinary step confirms
        its held lists."""
        version = self.version(optimizer)
        noted, _, layouts = self._claimed
        if (any(v == version and not held_lists_ok(batch) for v, batch in self._entries.values())
                or (noted == version and not layouts_unchanged(layouts))):
            self.drop()  # (noted before the state changed: the next bucket is checked anyway)

    def check_memory(self, optimizer, claims: MemoryClaims) -> None:
        """Raises, naming both, where two tensors of `claims` share memory."""
        try:
            claims.check()
        except SharedMemoryError as e:
            raise RuntimeError(_shared_memory_message(optimizer, *e.args)) from None


@contextlib.contextmanager
def _explained(optimizer, group, p):
    """The state errors of p, raised again naming p and saying what to do."""
    try:
        yield
    except CodesWithoutScalesError as e:
        raise RuntimeError(
            f"{_describe(optimizer, group, p)}: its state {e.args[0]!r} holds int8 codes "
            f"but no {scale_name(e.args[0])!r} (their block scales): load the whole "
            "state_dict the codes came from, or restart the parameter's state with "
            "`del optimizer.state[param]`") from None
    except BufferShapeError as e:
        name, buffer, needed = e.args
        raise RuntimeError(
            f"{_describe(optimizer, group, p)}: its state {name!r} has shape "
            f"{tuple(buffer.shape)}, not {tuple(needed)}: the parameter was given data of "
            "another shape after its state was made, or a state_dict of another model was "
            "loaded. "
            "Restart its state with `del optimizer.state[param]`, or load a matching "
            "state_dict") from None
    except StateValueError as e:
        key, problem = e.args
        if key == REFUSED_LOAD:
            raise RuntimeError(
                f"{_describe(optimizer, group, p)}: {problem} (its state {key!r} says so): "
                "restart its state with `del optimizer.state[param]`, or load a state_dict "
                "of this optimizer") from None
        raise RuntimeError(
            f"{_describe(optimizer, group, p)}: its state {key!r} {problem}: set by hand or "
            "loaded so? Restart its state with `del optimizer.state[param]`, or load a "
            "state_dict of this optimizer") from None


def _shared_memory_message(optimizer, first, second, same_tensor) -> str:
    """What SharedMemoryError's owners (parameter, key) say, a state's key named first: it
    is what to mend; an owner named twice: a tensor whose own elements share memory."""
    if SCALING in (first[1], second[1]):
        (name, _), (p, key) = (first, second) if first[1] == SCALING else (second, first)
        what = {PARAMETER: "", GRADIENT: "'s gradient"}.get(key, f"'s state {key!r}")
        return (f"optimizer.{name} (GradScaler's) shares memory with "
                f"{_describe_anywhere(optimizer, p)}{what}, which the step writes while it "
                f"reads {name} (each backend in another order): give it memory of its own "
                "(`.clone()`). Nothing was stepped")
    if LR in (first[1], second[1]):
        (group, _), (p, key) = (first, second) if first[1] == LR else (second, first)
        gi = next(i for i, g in enumerate(optimizer.param_groups) if g is group)
        what = {PARAMETER: "", GRADIENT: "'s gradient"}.get(key, f"'s state {key!r}")
        return (f"param_groups[{gi}]['lr'] (a tensor) shares memory with "
                f"{_describe_anywhere(optimizer, p)}{what}, which the step writes while it "
                "reads the lr (each backend in another order): give the lr memory of its "
                "own (`.clone()`)")
    if first[0] is second[0] and first[1] == second[1]:
        p, key = first
        what = ("" if key == PARAMETER else f": its state {key!r}")
        return (f"{_describe_anywhere(optimizer, p)}{what} has elements that share memory (an "
                "expanded or overlapping view): a step writes each element in place, so give "
                "it memory of its own (`.clone()`; a parameter: `p.data = p.data.clone()`)")
    if first[1] in (PARAMETER, GRADIENT) and second[1] not in (PARAMETER, GRADIENT):
        first, second = second, first
    (p, key), (other, other_key) = first, second
    subject = _describe_anywhere(optimizer, p) + {
        PARAMETER: "", GRADIENT: ": its gradient"}.get(key, f": its state {key!r}")
    whose = "its" if other is p else f"{_describe_anywhere(optimizer, other)}'s"
    if other_key == PARAMETER:
        what = "the parameter itself" if other is p else _describe_anywhere(optimizer, other)
    elif other_key == GRADIENT:
        what = f"{whose} gradient"
    else:
        what = f"{'its own' if other is p else whose} state {other_key!r}"
    if key in (PARAMETER, GRADIENT):
        advice = ("a step writes each parameter in place: give every parameter and gradient "
                  "memory of its own")
    else:
        advice = ("each parameter needs state of its own, in memory of its own, a tensor a "
                  "key (give it a copy: `.clone()`, or `del optimizer.state[param]` to "
                  "restart it)")
    verb = "is the very tensor of" if same_tensor else "shares memory with"
    return f"{subject} {verb} {what}: {advice}"


def _key(group, backend, names, ids) -> tuple:
    """What a batch's lists depend on besides the state: the group, its backend, the dtype
    of its state, whether bfloat16 parameters round stochastically (seeds or none), the
    buffers and the parameters."""
    return (id(group), backend, group["state_dtype"], group["bf16_stochastic_round"], names,
            ids)


class ParameterPlaces:
    """Each parameter's place among all the optimizer's parameters, in param_groups order:
    the seed of its random bits when its state is made (the same on every rank of a sharded
    model). The map is made once, where a state first needs a seed: a search per parameter
    made a first step over n parameters take n^2/2 comparisons."""

    def __init__(self, optimizer) -> None:
        self._optimizer = optimizer
        self._places: Optional[dict] = None

    def __call__(self, p) -> int:
        if self._places is None:
            params = (q for group in self._optimizer.param_groups for q in group["params"])
            self._places = {id(q): i for i, q in enumerate(params)}
        return self._places[id(p)]


def _describe(optimizer, group, p) -> str:
    gi = next(i for i, g in enumerate(optimizer.param_groups) if g is group)
    pi = next(i for i, q in enumerate(group["params"]) if q is p)
    return describe(p, gi, pi)


def _describe_anywhere(optimizer, p) -> str:
    return describe_in(optimizer.param_groups, p)


def _memory_of(p, state, keys) -> tuple:
    """Where p and its state tensors of these keys (those a step reads) are, and how laid
    out (a batch never held is built each step, and any of them may have been given other
    memory, `.data =`, which no version counts)."""
    entry = state.get(p) or {}
    return _span_of(p), tuple(_span_of(t) for key, t in entry.items() if key in keys)


def _span_of(t):
    if not is_plain(t):  # (the common case first: a step locates thousands a step)
        if not isinstance(t, torch.Tensor):
            return None
        t = local(t)
    try:
        return t.data_ptr(), t.shape, t.stride()
    except RuntimeError:  # no storage (a sparse tensor in a user's key): nothing to locate
        return None



def _held_tensors(batch: Batch) -> list:
    """Every tensor a cached batch writes: parameters, buffers, counters, seeds, scales."""
    tensors = [*batch.params, *(b for bs in batch.buffers for b in bs), *batch.steps,
               *(batch.seeds or ()), *(s for ss in batch.scales or () for s in ss)]
    return [t for t in tensors if t is not None]


def _local_or_none(t):
    return None if t is None else local(t)


def writeback(writebacks) -> None:
    for param, dense in writebacks:
        param.copy_(dense)


__all__ = ["BatchCache", "writeback"]
