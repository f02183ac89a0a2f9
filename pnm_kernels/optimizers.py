"""PNM and AdaPNM as torch.optim.Optimizer subclasses: validate, group tensors by device and
dtype, and hand each batch to a backend (see _backends.py)."""
import itertools
import math
import numbers
import operator
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from . import _backends
from ._backends import ADAPNM_BUFFERS, PNM_BUFFERS, Batch
from ._backends import is_dense as _is_dense, same_dense_layout as _same_dense_layout

BACKENDS = ("auto", "fused", "triton", "foreach", "reference")


@dataclass
class _Grouping:
    """A param group's parameters with gradients, split by device and dtype."""
    batches: list  # [(backend, parameter indices, plain tensors?, (device, dtype))]
    defer_check: bool = True  # False once the kernel refused a gradient's layout


@dataclass
class _PlanItem:
    """One batch of a step: same device, dtype and backend."""
    group: dict
    backend: str
    params: list
    grads: list
    ids: tuple  # identifies the batch's parameters (the batch cache's key)
    layout_ok: Optional[bool]  # every gradient dense and laid out like its parameter?
    origin: Optional[tuple] = None  # (gi, grouping, the group's grads) when the kernel checks


_HELD_BACKENDS = ("fused", "triton")  # their lists are held in C++


@dataclass
class _HeldBatch:
    """One fused or Triton batch of a param group as the last step ran it, its lists held
    in C++ (see _repeat_step)."""
    lists: object  # the batch's pnm_kernels._C StepLists
    device: torch.device
    dtype: torch.dtype
    backend: str  # "fused" or "triton"
    memo: dict  # the batch's memo (a Triton batch's: its tables and ticket counter)


@dataclass
class _HeldGroup:
    """A param group as the last step ran it: one held batch per device and dtype."""
    group: dict
    params: list
    signature: tuple  # its hyper-parameters when last validated (see _signature)
    plan_keys: tuple  # (backend, buffers needed): a change of either needs a new plan
    batches: list  # [_HeldBatch]
    hp: dict  # _hyper(group) for that signature


def _is_real_number(x) -> bool:
    # float and int first: an isinstance check against the numbers.Real ABC costs ~0.2 µs,
    # and a scheduler's new lr has every group validated again at each step.
    return type(x) in (float, int) or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def _check_real(where, name, value, *, low, high=math.inf, high_open=False):
    if not _is_real_number(value) or not math.isfinite(value):
        raise ValueError(f"{where}: invalid {name} {value!r}; need a finite real number")
    if value < low or value > high or (high_open and value == high):
        upper = f"< {high}" if high_open else ("" if high == math.inf else f"<= {high}")
        raise ValueError(f"{where}: invalid {name} {value!r}; need {low} <= {name} {upper}".rstrip())


def _validate_lr(lr, where: str) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"{where}: a tensor lr must be a floating-point tensor with one "
                             f"element, got {lr.dtype} with shape {tuple(lr.shape)}")
        if lr.device.type == "cpu":  # a device lr is not read back: that would synchronise
            _check_real(where, "lr", float(lr.detach()), low=0.0)
    else:
        _check_real(where, "lr", lr, low=0.0)


def _validate_group(group: dict, adaptive: bool, where: str) -> None:
    """Checks every hyper-parameter of a group (DESIGN.md §1 "Valid hyper-parameters")."""
    _validate_lr(group["lr"], where)
    betas = group["betas"]
    names = ("beta1", "beta2", "beta0") if adaptive else ("beta1", "beta0")
    if not isinstance(betas, (tuple, list)) or len(betas) != len(names):
        raise ValueError(f"{where}: betas must be a tuple ({', '.join(names)}), got {betas!r}")
    for i, (name, value) in enumerate(zip(names, betas)):
        label = f"{name} (betas[{i}])"
        if name == "beta0":
            _check_real(where, label, value, low=-math.inf)
        else:
            _check_real(where, label, value, low=0.0, high=1.0, high_open=True)
    _check_real(where, "weight_decay", group["weight_decay"], low=0.0)
    flags = ("decoupled", "maximize") + (("amsgrad",) if adaptive else ())
    if adaptive:
        _check_real(where, "eps", group["eps"], low=0.0)
    for flag in flags:
        if not isinstance(group[flag], bool):
            raise ValueError(f"{where}: {flag} must be a bool, got {group[flag]!r}")
    if group["backend"] not in BACKENDS:
        raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {group['backend']!r}")


def _describe(param, gi, pi) -> str:
    return (f"param_groups[{gi}]['params'][{pi}] (shape {tuple(param.shape)}, {param.dtype}, "
            f"{param.device})")


def _check_param(param, gi, pi) -> None:
    grad = param.grad
    if grad.is_sparse or grad.layout != torch.strided:
        raise RuntimeError(f"{_describe(param, gi, pi)} has a sparse gradient; PNM and AdaPNM "
                           "do not support sparse gradients")
    if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
        raise RuntimeError(f"{_describe(param, gi, pi)} has a gradient of shape "
                           f"{tuple(grad.shape)}, {grad.dtype}, {grad.device}, which does not "
                           "match the parameter")
    if param.is_sparse or param.layout != torch.strided:
        raise RuntimeError(f"{_describe(param, gi, pi)} is sparse; not supported")


def _is_plain(t) -> bool:
    """A plain tensor or Parameter, not a subclass such as DTensor."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _holdable(p) -> bool:
    """A parameter the kernels take as it is (plain, real, dense: contiguous, channels_last,
    transposed): its lists can be held between steps."""
    return _is_plain(p) and not p.is_complex() and (p.is_contiguous() or _is_dense(p))


def _shard_holdable(p) -> bool:
    """A DTensor (FSDP2) whose local shard is holdable: a cached batch may hold the shard,
    checked again at every step (see _batch); the repeated step, whose C++ lists read the
    gradients themselves, never holds it (a DTensor's gradient is not its shard's)."""
    shard = _local(p)
    return shard is not p and _holdable(shard)


_shard_of = operator.attrgetter("_local_tensor")  # a DTensor's (see _local)
_shape_of = operator.attrgetter("shape")


def _shards_match(params, grads, check) -> bool:
    """For DTensor parameters and gradients (FSDP2), without a Python loop over them: the
    same global shapes, and local shards that the C++ `check` finds alike (dtype, device,
    shape, dense layout). False where any of that is not so, or not all are DTensors: the
    per-parameter checks then say what is wrong."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return False
    is_a = itertools.repeat(dtensor.DTensor)
    return (all(map(isinstance, params, is_a)) and all(map(isinstance, grads, is_a))
            and all(map(operator.eq, map(_shape_of, params), map(_shape_of, grads)))
            and check(list(map(_shard_of, params)), list(map(_shard_of, grads)), True) < 0)


def _pick(params, grads, indices):
    """The parameters and gradients at these indices (the lists themselves when all)."""
    if len(indices) == len(params):
        return params, grads
    return [params[i] for i in indices], [grads[i] for i in indices]


def _state_fits(buffer: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether a state buffer still matches its parameter: dtype, device, shape and the
    layout zeros_like gives it (which the kernels that walk raw memory rely on)."""
    if buffer.dtype != p.dtype or buffer.device != p.device or buffer.shape != p.shape:
        return False
    if not _is_plain(p):
        return True
    if p.is_contiguous():
        return buffer.is_contiguous()
    if _is_dense(p):
        return _same_dense_layout(buffer, p)
    # A parameter with gaps is copied into its buffers' layout for the step: the one
    # zeros_like gives it.
    return buffer.stride() == torch.empty_like(p, device="meta").stride()


def _signature(group: dict) -> tuple:
    """A param group's hyper-parameters as they are now, lr first (a tensor by identity and
    version; a list, betas given as one, by its values: the list itself would equal itself
    after an edit in place, which then went unvalidated)."""
    return (_value_signature(group["lr"]),) + tuple(
        _value_signature(v) for k, v in group.items() if k != "params" and k != "lr")


def _value_signature(v):
    if isinstance(v, torch.Tensor):
        return id(v), v._version
    return tuple(v) if type(v) is list else v


def _held_step_extras(device, grad_scale, found_inf) -> tuple:
    """What a held batch's step takes after its hyper-parameters: whether it runs emulated,
    its device, and grad_scale / found_inf moved there (read once per device and step)."""
    return (_backends.emulating(device), device,
            None if grad_scale is None else grad_scale.to(device, non_blocking=True),
            None if found_inf is None else found_inf.to(device, non_blocking=True))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The shard a DTensor (FSDP2) holds on this rank; the kernels update shards in place.
    DTensor is looked up, not imported: importing torch.distributed.tensor costs ~0.3 s,
    and a program with DTensors has imported it."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        return t._local_tensor
    return t


def _kernel_views(p, grad, bufs):
    """A parameter, its gradient and state buffers as the kernels see them: a DTensor's
    local shard, complex as real views."""
    param, grad, bufs = _local(p), _local(grad), [_local(b) for b in bufs]
    if p.is_complex():
        param, grad = torch.view_as_real(param), torch.view_as_real(grad)
        bufs = [torch.view_as_real(b) for b in bufs]
    return param, grad, bufs


def _dense_copies(param, grad, buffer, flat):
    """Whether a flat backend (its kernels walk raw memory) needs the parameter and the
    gradient (as _kernel_views gives them) copied into the buffers' dense layout."""
    if not flat:
        return False, False
    return not _backends.dense_like(param, buffer), not _backends.dense_like(grad, buffer)


def _kernel_tensors(p, grad, bufs, flat, copies=None):
    """What the kernels take for one parameter (see _kernel_views and _dense_copies; under
    torch.compile `copies` was decided untraced). Returns (param, grad, buffers, the
    (param, dense copy) pair to write back after the step, or None)."""
    param, grad, bufs = _kernel_views(p, grad, bufs)
    copy_param, copy_grad = copies or _dense_copies(param, grad, bufs[0], flat)
    writeback = None
    if copy_param:
        dense = torch.empty_like(bufs[0]).copy_(param)
        writeback = (param, dense)
        param = dense
    if copy_grad:
        grad = torch.empty_like(bufs[0]).copy_(grad)
    return param, grad, bufs, writeback


def _kernel_batch(params, grads, buffers, steps, flat, copies=None):
    """The kernels' Batch for these parameters (`buffers`: a list per state buffer, `copies`:
    see _kernel_tensors), and the (param, dense copy) pairs to write back after the step."""
    batch = Batch(buffers=[[] for _ in buffers])
    writebacks = []
    for i, p in enumerate(params):
        param, grad, bufs, writeback = _kernel_tensors(
            p, grads[i], [b[i] for b in buffers], flat, copies[i] if copies else None)
        if writeback is not None:
            writebacks.append(writeback)
        batch.params.append(param)
        batch.grads.append(grad)
        for lst, buf in zip(batch.buffers, bufs):
            lst.append(buf)
        batch.steps.append(steps[i])
    return batch, writebacks


# How often anyone but the optimizers changed which tensors a state holds (see _ParamState).
_state_changes = 0


def _counted(change):
    def counted(self, *args, **kwargs):
        global _state_changes
        _state_changes += 1
        return change(self, *args, **kwargs)
    counted.__name__ = change.__name__
    return counted


class _CountsChanges:
    """Every way of putting in, replacing or taking out an entry, counted."""
    __slots__ = ()
    __setitem__ = _counted(dict.__setitem__)
    __delitem__ = _counted(dict.__delitem__)
    __ior__ = _counted(dict.__ior__)
    clear = _counted(dict.clear)
    pop = _counted(dict.pop)
    popitem = _counted(dict.popitem)
    setdefault = _counted(dict.setdefault)
    update = _counted(dict.update)


class _ParamState(_CountsChanges, dict):
    """One parameter's state. Steps reuse the tensor lists they built from it (the batch
    cache, the repeated step), so a change made from outside (a moment reset by hand, a new
    step counter) is counted, and the next step reads the state again, as torch's
    optimizers, which read it every step, would. The optimizers' own writes are not counted
    (_put): the lists built before stay valid."""
    __slots__ = ()


class _OptimizerState(_CountsChanges, defaultdict):
    """optimizer.state: a defaultdict of _ParamState, entries replaced or deleted counted."""
    __slots__ = ()

    def __missing__(self, param):  # optimizer.state[p] before p has state, as in torch
        # Not counted: an empty entry is no state (a step treats p as without state, and
        # what is put into the entry is counted), so reading it costs no planned step.
        entry = _ParamState()
        _put(self, param, entry)
        return entry


def _put(state: dict, key, value) -> None:
    """The optimizer's own write into its state: not counted as a change."""
    dict.__setitem__(state, key, value)


def _register_as_dicts() -> None:
    """Pytree walks over optimizer.state go through our dict subclasses as through dicts.
    torch.compile marks torch's optimizers' state tensors static that way (mode=
    "reduce-overhead" then keeps the step's CUDA graph and updates them in place); as
    leaves, one parameter's state became graph inputs copied in, and the graph was skipped
    for "mutated inputs" (H200 run 7)."""
    from torch.utils import _pytree as pytree

    def flatten(d):
        return list(d.values()), list(d.keys())

    def flatten_with_keys(d):
        return [(pytree.MappingKey(k), v) for k, v in d.items()], list(d.keys())

    pytree.register_pytree_node(
        _ParamState, flatten, lambda values, keys: _ParamState(zip(keys, values)),
        flatten_with_keys_fn=flatten_with_keys)
    pytree.register_pytree_node(
        _OptimizerState, flatten, lambda values, keys: _OptimizerState(None, zip(keys, values)),
        flatten_with_keys_fn=flatten_with_keys)


_register_as_dicts()


def _references(holder: dict, key) -> int:
    return sys.getrefcount(dict.get(holder, key))


# What _references counts for an object only its holder holds (calibrated, not assumed:
# the count of a call's own references differs between Python versions).
_HELD_ONLY_THERE = _references({0: {}}, 0)


def _counted_entry(state: dict, p):
    """p's entry in an optimizer state, made a _ParamState if it is a plain dict no one else
    holds (load_state_dict's, or optimizer.state[p] = {} by hand), so that its parameter's
    lists may be reused. A plain dict the user still holds stays as it is: their edits
    through it are then seen, its group being read afresh at every step."""
    if type(state.get(p)) is dict and _references(state, p) == _HELD_ONLY_THERE:
        _put(state, p, _ParamState(state[p]))
    return state.get(p)


def _tracked_state(state) -> _OptimizerState:
    """optimizer.state made counted (load_state_dict's, or one set by hand: optimizer.state
    = defaultdict(dict) to restart); its entries are made counted as they are read (see
    _counted_entry). Built by dict's own update, which counts nothing."""
    return _OptimizerState(None, state)


def _plain_state_entries(optimizer, state_dict):
    """state_dict post-hook: plain dicts, which torch.load(weights_only=True) accepts."""
    state_dict["state"] = {key: dict(entry) if isinstance(entry, _ParamState) else entry
                           for key, entry in state_dict["state"].items()}


def _as_step(step, p) -> torch.Tensor:
    """A step counter as the backends take it: a float32 tensor on its parameter's device
    (a Python int in the authors' checkpoints; one set by hand may be anything numeric)."""
    if torch.is_tensor(step):
        return step.to(device=p.device, dtype=torch.float32)  # itself where it is one already
    return torch.as_tensor(float(step), dtype=torch.float32).to(p.device)


def _normalise_loaded_state(optimizer) -> None:
    """After load_state_dict: every step counter as the backends take it (see _as_step)."""
    optimizer._drop_cached_batches()
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "step" in state:
                _put(state, "step", _as_step(state["step"], p))


class _PositiveNegativeMomentum(Optimizer):
    _adaptive = False
    _buffer_names: tuple[str, ...] = PNM_BUFFERS
    # GradScaler then hands over grad_scale/found_inf instead of unscaling on the host.
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults):
        _validate_group(dict(defaults, params=[]), self._adaptive, "defaults")
        super().__init__(params, defaults)
        self.state = _OptimizerState()
        self.register_state_dict_post_hook(_plain_state_entries, prepend=True)

    def load_state_dict(self, state_dict: dict) -> None:
        # Checked before anything is replaced: a state_dict of another optimizer (AdamW's
        # two betas) is refused here, not at the next step with the groups already loaded.
        for gi, group in enumerate(state_dict.get("param_groups", [])):
            _validate_group({**self.defaults, **group}, self._adaptive,
                            f"state_dict['param_groups'][{gi}]")
        super().load_state_dict(state_dict)  # its state made counted by __setstate__
        _normalise_loaded_state(self)

    def add_param_group(self, param_group: dict) -> None:
        where = f"param_groups[{len(self.param_groups)}]"
        merged = {**self.defaults, **param_group}
        _validate_group(merged, self._adaptive, where)
        params = param_group.get("params")
        if not isinstance(params, (torch.Tensor, set, type(None))):
            param_group["params"] = params = list(params)  # a generator can be read once
            first: dict[int, int] = {}
            for i, item in enumerate(params):
                tensor = item[1] if isinstance(item, tuple) else item  # (name, tensor) too
                if id(tensor) in first:
                    # torch's optimizers warn that this will be an error; here the backends
                    # would each do something else with it.
                    raise ValueError(
                        f"{where}['params'][{i}] is the same tensor as "
                        f"{where}['params'][{first[id(tensor)]}]; a parameter may appear "
                        "only once")
                first[id(tensor)] = i
        super().add_param_group(param_group)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.state = _tracked_state(self.state)
        for group in self.param_groups:  # groups saved before a key existed get its default
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def _hyper(self, group) -> dict:
        """A validated group's hyper-parameters as every backend takes them: Python floats
        (a numpy scalar reached the Triton kernels as a type they refuse, and the reference
        computed in its precision); a tensor lr stays a tensor."""
        betas, lr = group["betas"], group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.detach() if lr.requires_grad else lr  # its value only: float() then quiet
        else:
            lr = float(lr)
        hp = dict(lr=lr, beta1=float(betas[0]), beta0=float(betas[-1]),
                  weight_decay=float(group["weight_decay"]), decoupled=group["decoupled"],
                  maximize=group["maximize"])
        if self._adaptive:
            hp.update(beta2=float(betas[1]), eps=float(group["eps"]), amsgrad=group["amsgrad"])
        return hp

    def _buffers_needed(self, group):
        if self._adaptive and not group["amsgrad"]:
            return self._buffer_names[:3]
        return self._buffer_names

    def _plan(self, defer=True):
        """Checks everything and decides the backend of every batch, touching nothing.

        The grouping of a param group's parameters into (device, dtype) batches is cached
        while the same parameters have gradients; the gradients are still checked every step
        (in C++ where the extension is built). One check is deferred: when the whole step is
        one cached batch for the fused kernels, their own argument checks, which run before
        anything is touched, stand in for it, and step() looks closer if they refuse.
        Eager only: torch.compile traces _traced_step."""
        cache = self.__dict__.setdefault("_plan_cache", {})
        validated = self.__dict__.setdefault("_validated", {})
        found = []  # (gi, group, key, grouping, from the cache?, grads, indices)
        for gi, group in enumerate(self.param_groups):
            # Re-validate only when a hyper-parameter changed (a scheduler, a user's edit).
            signature = _signature(group)
            if validated.get(id(group)) != signature:
                _validate_group(group, self._adaptive, f"param_groups[{gi}]")
                validated[id(group)] = signature
            params = group["params"]
            grads = [p.grad for p in params]
            if all(map(operator.is_not, grads, itertools.repeat(None))):  # the common case
                indices = range(len(params))
                ids = tuple(map(id, params))
            else:
                indices = [i for i, g in enumerate(grads) if g is not None]
                ids = tuple(id(params[i]) for i in indices)
            if not indices:
                continue
            key = (id(group), group["backend"], ids)
            grouping = cache.get(key)
            found.append((gi, group, key, grouping, grouping is not None, grads, indices))
        batch_count = sum(len(f[3].batches) if f[3] else 1 for f in found)
        plan = []
        for gi, group, key, grouping, cached, grads, indices in found:
            params = group["params"]
            layouts = None
            if cached:
                backend, idx, plain, _ = grouping.batches[0]
                deferred = (defer and batch_count == 1 and grouping.defer_check and plain
                            and backend == "fused")
                if deferred and self._cached_batch(group, backend, key[2]) is not None:
                    plan.append(_PlanItem(group, backend, *_pick(params, grads, idx), key[2],
                                          layout_ok=True, origin=(gi, grouping, grads)))
                    continue
                layouts = self._check_grads(grouping.batches, params, grads, gi)
                if layouts is None:  # a parameter moved to another device or dtype
                    cached = False
                    self._drop_cached_batches()
            if not cached:
                grouping = _Grouping(self._group_batches(group, gi, indices))
                if len(cache) > 64:
                    cache.clear()
                cache[key] = grouping
            for b, (backend, idx, _, _) in enumerate(grouping.batches):
                batch_params, batch_grads = _pick(params, grads, idx)
                ids = key[2] if len(grouping.batches) == 1 else tuple(map(id, batch_params))
                plan.append(_PlanItem(group, backend, batch_params, batch_grads, ids,
                                      layout_ok=layouts[b] if layouts else None))
        return plan

    def _group_batches(self, group, gi, indices):
        """[(backend, parameter indices, plain tensors?, (device, dtype))] per (device, dtype);
        raises on the first bad parameter or gradient, naming it."""
        batches = {}
        for pi in indices:
            p = group["params"][pi]
            _check_param(p, gi, pi)  # raises, naming the parameter
            key = (p.device, p.dtype)
            if key not in batches:
                real = p.real.dtype if p.is_complex() else p.dtype
                try:
                    backend = _backends.resolve_backend(group["backend"], p.device, real)
                except (RuntimeError, ValueError) as e:
                    raise type(e)(f"{_describe(p, gi, pi)}: {e}") from None
                batches[key] = (backend, [], [True])
            batches[key][1].append(pi)
            if not _is_plain(p) or type(p.grad) is not torch.Tensor:
                batches[key][2][0] = False  # subclasses: DTensors are checked by _shards_match
        return [(backend, idx, plain[0], (device, dtype))
                for (device, dtype), (backend, idx, plain) in batches.items()]

    def _lacking_grads_with_state(self, group):
        """Whether a parameter of the group that has state has no gradient."""
        return any(p.grad is None and self.state.get(p) for p in group["params"])

    @staticmethod
    def _check_grads(batches, params, grads, gi):
        """Checks the gradients of a cached grouping, raising on one that does not match its
        parameter. Returns None when a parameter itself moved to another device or dtype
        (regroup), else per batch whether every gradient is dense and laid out like its
        parameter: True, False, or None where unknown."""
        check = _backends.first_mismatched_grad
        layouts = []
        for _, idx, plain, (device, dtype) in batches:
            first = params[idx[0]]
            if first.device != device or first.dtype != dtype:  # model.to(...): all moved
                return None
            if check is not None and plain:
                bad = check([params[i] for i in idx], [grads[i] for i in idx], True)
                if bad < 0:
                    layouts.append(True)
                    continue
                rest, layout = idx[bad:], False  # the Python checks below say why
            elif check is not None and _shards_match([params[i] for i in idx],
                                                     [grads[i] for i in idx], check):
                layouts.append(True)
                continue
            else:
                rest, layout = idx, None
            for pi in rest:
                p = params[pi]
                _check_param(p, gi, pi)  # raises when the gradient is at fault
                if (p.device, p.dtype) != (first.device, first.dtype):
                    return None
            layouts.append(layout)
        return layouts

    def _batch_key(self, group, backend, ids):
        return (id(group), backend, self._buffers_needed(group), ids)

    def _cached_batch(self, group, backend, ids):
        """The cached tensor lists of a batch (gradients left out), if still valid."""
        hit = self.__dict__.get("_batch_cache", {}).get(self._batch_key(group, backend, ids))
        return hit[1] if hit is not None and hit[0] == self._state_version() else None

    def _batch(self, item):
        """The kernel-ready tensor lists for a batch, and the (param, dense copy) pairs to
        write back after the step. The lists of parameters, buffers and counters are cached
        while the parameters with gradients and the state stay the same; only the gradients
        are new each step."""
        group, backend, params = item.group, item.backend, item.params
        cached = self._cached_batch(group, backend, item.ids)
        grads = item.grads
        if cached is not None and cached.memo.get("shards"):  # its params are all DTensors
            if all(map(operator.is_, map(_shard_of, params), cached.params)):
                grads = list(map(_shard_of if item.layout_ok else _local, grads))
            else:  # FSDP2 gave a parameter a new shard (after model.to(...), say)
                cached = None
        if (cached is not None and item.origin is None
                and not _backends.held_lists_ok(cached)):
            # A parameter was given new data (p.data = ...) of another dtype, shape or
            # layout: rebuild, its state following it. (On the deferred path the kernel's
            # own checks find this before touching anything; see _refusal_explained.)
            self._drop_cached_batches()
            cached = None
        if cached is not None:
            layout_ok = item.layout_ok
            if layout_ok is None:
                layout_ok = all(map(_backends.dense_like, grads, cached.params))
            if layout_ok:
                return Batch(cached.params, grads, cached.buffers, cached.steps,
                             cached.memo), []
        names = self._buffers_needed(group)
        batch, writebacks, counted = self._build_batch(group, backend, params, names)
        shards = not all(map(_holdable, params))
        simple = counted and not writebacks and (not shards or all(map(_shard_holdable, params)))
        if simple and backend in _backends.FLAT_BACKENDS:
            cache = self.__dict__.setdefault("_batch_cache", {})
            version = self._state_version()
            for key in [k for k, (v, _) in cache.items() if v != version]:
                del cache[key]  # stale: holds tensors the state may have replaced
            if len(cache) > 64:
                cache.clear()
            batch.memo = {"shards": True} if shards else {}
            # Cached without this step's gradients: holding them would keep a whole set of
            # gradients alive after zero_grad() (a model's worth of GPU memory).
            held = Batch(batch.params, [], batch.buffers, batch.steps, batch.memo)
            cache[self._batch_key(group, backend, item.ids)] = (version, held)
        return batch, writebacks

    def _state_version(self):
        """Changes whenever a state entry may have been put in, replaced or taken out by
        anyone but the optimizer (whose new entries leave the lists built before valid)."""
        if type(self.state) is not _OptimizerState:  # optimizer.state = ... by hand
            if _references(self.__dict__, "state") != _HELD_ONLY_THERE:
                # The user still holds it, and may change it unseen: no list is reused.
                return object()
            self.state = _tracked_state(self.state)
            self._drop_cached_batches()
        return self.__dict__.get("_state_epoch", 0), _state_changes

    def _drop_cached_batches(self):
        """Forgets every cached list, letting go of the tensors they hold (a whole replaced
        state after load_state_dict)."""
        self._state_epoch = self.__dict__.get("_state_epoch", 0) + 1
        self.__dict__.pop("_batch_cache", None)
        self.__dict__.pop("_repeat", None)

    def _build_batch(self, group, backend, params, names):
        """The batch, its write-backs, and whether every state it read counts its changes
        (only then may its lists be reused: see _ParamState)."""
        states = [self._state_for(p, names, group) for p in params]
        batch, writebacks = _kernel_batch(params, [p.grad for p in params],
                                          [[state[name] for state in states] for name in names],
                                          [state["step"] for state in states],
                                          backend in _backends.FLAT_BACKENDS)
        return batch, writebacks, all(type(state) is _ParamState for state in states)

    def _state_for(self, p, names, group):
        """p's state with these buffers: made where missing, and converted where p was given
        new data since (see _follow)."""
        state = _counted_entry(self.state, p)
        if state is None:
            state = _ParamState()
            _put(self.state, p, state)
        if "step" not in state:
            _put(state, "step", torch.zeros((), dtype=torch.float32, device=p.device))
        else:
            _put(state, "step", _as_step(state["step"], p))
        for name in names:
            if name not in state:  # e.g. amsgrad switched on mid-run
                _put(state, name, torch.zeros_like(p, memory_format=torch.preserve_format))
            elif not _state_fits(state[name], p):
                _put(state, name, self._follow(p, name, state[name], group))
        return state

    def _follow(self, p, name, buffer, group):
        """A state buffer converted to its parameter's dtype, device and layout, as
        load_state_dict converts state to its parameter: for a parameter given new data
        (p.data = ..., model.to(...)) after its state was made. Another shape is an error."""
        if buffer.shape != p.shape:
            gi = next(i for i, g in enumerate(self.param_groups) if g is group)
            pi = next(i for i, q in enumerate(group["params"]) if q is p)
            raise RuntimeError(
                f"{_describe(p, gi, pi)}: its state {name!r} has shape {tuple(buffer.shape)}; "
                "the parameter was given data of another shape after its state was made. "
                "Restart its state with `del optimizer.state[param]`, or load a matching "
                "state_dict")
        self._drop_cached_batches()
        return torch.empty_like(p).copy_(buffer)

    @torch.no_grad()
    def step(self, closure=None):  # typed by Optimizer.step's overloads, as torch's own
        """Performs one optimization step. ``closure`` re-evaluates the model and returns the
        loss. Under torch.amp.GradScaler, grad_scale/found_inf are applied in the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if torch.compiler.is_compiling():
            self._traced_step(grad_scale, found_inf)
            return loss
        if self._repeat_step(grad_scale, found_inf):
            return loss
        self.__dict__.pop("_repeat", None)  # remembered again only after a step like it
        plan = self._plan()  # raises before any parameter or state is touched
        if plan and plan[0].origin is not None:  # its gradients are checked by the kernel
            try:
                self._remember_step(plan, self._run(plan, grad_scale, found_inf))
                return loss
            except RuntimeError as e:
                refusal = e
            # Outside the handler: an error naming the culprit is not chained to the refusal.
            if not self._refusal_explained(plan[0]):
                raise refusal
            plan = self._plan(defer=False)
        self._remember_step(plan, self._run(plan, grad_scale, found_inf))
        return loss

    def _traced_step(self, grad_scale, found_inf):
        """The step as torch.compile traces it. Each group's tensors come from _init_group,
        which dynamo runs untraced, as it runs torch's optimizers' own; it then knows each
        tensor by its place in param_groups or state and guards on them as for torch's
        optimizers. (Traced, _plan reached them through the state dict's keys: a gradient
        was guarded by identity, and every step with new gradients recompiled.)"""
        for group in self.param_groups:
            params, grads, buffer0, buffer1, buffer2, buffer3, steps = [], [], [], [], [], [], []
            batches = self._init_group(group, params, grads, buffer0, buffer1, buffer2,
                                       buffer3, steps)
            buffers = [buffer0, buffer1, buffer2, buffer3][:len(self._buffers_needed(group))]
            hp = self._hyper(group)
            start = 0
            for backend, count, copies in batches:
                end = start + count
                device = params[start].device
                flat = backend in _backends.FLAT_BACKENDS
                batch_hp = hp
                if flat and not isinstance(hp["lr"], torch.Tensor):
                    # A float lr is a graph input, as for torch's optimizers, but an op's float
                    # argument would be specialised on, recompiling for every new lr: it
                    # enters the kernels as a tensor on their device (float64 for float64
                    # parameters, which the fused op reads in full).
                    # (A product: torch.full's fill value would be specialised on too.)
                    lr_dtype = (torch.float64
                                if params[start].dtype in (torch.float64, torch.complex128)
                                else torch.float32)
                    # ({**hp}: torch 2.6's dynamo cannot trace dict(hp, lr=...).)
                    batch_hp = {**hp, "lr": torch.ones((), dtype=lr_dtype, device=device)
                                * hp["lr"]}
                batch, writebacks = _kernel_batch(
                    params[start:end], grads[start:end], [b[start:end] for b in buffers],
                    steps[start:end], flat, copies)
                _backends.RUNNERS[backend](
                    self._adaptive, batch, batch_hp,
                    *(None if t is None else t.to(device) for t in (grad_scale, found_inf)))
                for param, dense in writebacks:
                    param.copy_(dense)
                start = end

    # Never compiled as a frame of its own: when a graph break leaves _traced_step running
    # eagerly, dynamo compiled this alone and specialised its state lookups on the first
    # parameter, unguarded (every group got the first one's state). torch's own way of
    # disabling dynamo, imported when first called.
    @torch._disable_dynamo
    def _init_group(self, group, params, grads, buffer0, buffer1, buffer2, buffer3, steps):
        """For torch.compile (see _traced_step), which runs this untraced: validates the
        group, checks its gradients, makes missing state, and fills the lists with the
        parameters that have a gradient, their gradients, state buffers and step counters,
        batch after batch. Returns each batch's (backend, number of parameters, each one's
        _dense_copies): decided here, from the layouts when traced. (Dynamo guards the
        parameters, not the gradients; the kernel refuses a gradient laid out otherwise.)"""
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        _validate_group(group, self._adaptive, f"param_groups[{gi}]")
        indices = [i for i, p in enumerate(group["params"]) if p.grad is not None]
        names = self._buffers_needed(group)
        out = []
        for backend, idx, _, (device, dtype) in self._group_batches(group, gi, indices):
            backend = _backends.traceable(backend, device, dtype.to_real())
            copies = []
            for pi in idx:
                p = group["params"][pi]
                state = self._state_for(p, names, group)
                params.append(p)
                grads.append(p.grad)
                bufs = [state[name] for name in names]
                for lst, buf in zip((buffer0, buffer1, buffer2, buffer3), bufs):
                    lst.append(buf)
                steps.append(state["step"])
                param, grad, bufs = _kernel_views(p, p.grad, bufs)
                copies.append(_dense_copies(param, grad, bufs[0],
                                            backend in _backends.FLAT_BACKENDS))
            out.append((backend, len(idx), tuple(copies)))
        return tuple(out)

    def _remember_step(self, plan, batches):
        """After a step (these plan items, run as these batches) in which every param group
        was run as fused or Triton batches held in C++ (one per device and dtype): what the
        next step needs to repeat it without planning (see _repeat_step). Where some of a
        group's parameters had no gradient, the lists held are those of all its parameters
        with state (see _lists_with_state); for Triton, whose tables name every tensor they
        update, only where those all stepped (the others, never stepped, have no state: a
        model passed whole, its frozen part included)."""
        items = list(zip(plan, batches))
        entries, k = [], 0
        for group in self.param_groups:
            mine = []
            while k < len(items) and items[k][0].group is group:
                mine.append(items[k])
                k += 1
            if not mine:
                return
            every_param_stepped = sum(len(item.params) for item, _ in mine) == len(group["params"])
            kinds = {(item.params[0].device, item.params[0].dtype) for item, _ in mine}
            held = []
            for item, batch in mine:
                if (item.backend not in _HELD_BACKENDS or batch.memo is None
                        or batch.memo.get("shards")):
                    return
                lists, outside = batch.memo.get("step_lists"), ()
                if not every_param_stepped:
                    if item.backend == "triton" and self._lacking_grads_with_state(group):
                        return  # Triton cannot skip them (_lists_with_state would refuse)
                    lists, outside = self._lists_with_state(group, item, lists, kinds)
                if lists is None:
                    return
                # The parameters without state are checked once, by the group's first batch.
                lists.hold_outside(list(outside) if not held else [])
                held.append(_HeldBatch(lists, item.params[0].device, item.params[0].dtype,
                                       item.backend, batch.memo))
            entries.append(_HeldGroup(group, list(group["params"]), self._validated[id(group)],
                                      (group["backend"], self._buffers_needed(group)), held,
                                      self._hyper(group)))
        if k == len(items):
            flat = [(held, batch) for held in entries for batch in held.batches]
            self._repeat = (self._state_version(), entries, flat)

    def _lists_with_state(self, group, item, lists, kinds):
        """For a group of which only some parameters stepped (the plan item's, one of the
        group's batches, whose (device, dtype) pairs are `kinds`): C++ lists of every
        parameter with state on the item's device and of its dtype, so that steps where
        others lack a gradient (mixture-of-experts layers, unused branches) repeat too,
        those without one skipped in C++; and the group's parameters without state, which
        must get none. (None, ()) where a parameter with state belongs to no batch of the
        step (another device or dtype) or cannot join the item's lists (another layout,
        state not made like the batch's). `lists`: the batch's own, used when they are all
        of them (always so for Triton: _remember_step holds no Triton batch otherwise)."""
        names = self._buffers_needed(group)
        device, dtype = item.params[0].device, item.params[0].dtype
        held, states, outside = [], [], []
        for p in group["params"]:
            state = _counted_entry(self.state, p)
            if not state:
                outside.append(p)
                continue
            if (p.device, p.dtype) != (device, dtype) and (p.device, p.dtype) in kinds:
                continue  # another batch of the step holds it
            if not (type(state) is _ParamState and _holdable(p) and p.device == device
                    and p.dtype == dtype and getattr(state.get("step"), "device", None) == device
                    and all(name in state and _state_fits(state[name], p) for name in names)):
                return None, ()
            held.append(p)
            states.append(state)
        if len(held) == len(item.params):  # every parameter with state stepped
            return lists, tuple(outside)
        batch = Batch(held, [], [[state[name] for state in states] for name in names],
                      [state["step"] for state in states], memo={})
        return _backends.step_lists(batch), tuple(outside)

    def _repeat_step(self, grad_scale, found_inf):
        """The last step again, if it was remembered and nothing it depends on changed: the
        same groups and parameters, state, backends and buffers. Other hyper-parameters may
        change (a scheduler's lr): they are validated here, as _plan would. The C++ lists read
        the gradients themselves, so an eager step over thousands of tensors costs no Python
        loop; a parameter without one does not step (a Triton batch, whose tables name every
        tensor, then declines). False, having done nothing, when it does
        not apply (a gradient for a parameter without state, or one laid out unlike its
        parameter, included, or a batch's kernel refusing its arguments)."""
        repeat = self.__dict__.get("_repeat")
        if repeat is None:
            return False
        version, entries, flat = repeat
        groups = self.param_groups
        if len(groups) != len(entries) or self._state_version() != version:
            return False
        for gi, (group, held) in enumerate(zip(groups, entries)):
            current = group["params"]
            if (group is not held.group or len(current) != len(held.params)
                    or not all(map(operator.is_, current, held.params))):
                return False
            signature = _signature(group)
            if signature != held.signature:
                lr = group["lr"]
                if type(lr) is float and signature[1:] == held.signature[1:]:
                    # Only a float lr changed (a scheduler's, every step): only it is checked.
                    _validate_lr(lr, f"param_groups[{gi}]")
                    held.hp = dict(held.hp, lr=lr)
                else:
                    _validate_group(group, self._adaptive, f"param_groups[{gi}]")
                    if (group["backend"], self._buffers_needed(group)) != held.plan_keys:
                        return False
                    held.hp = self._hyper(group)
                held.signature = self._validated[id(group)] = signature
        if len(flat) == 1 and flat[0][1].backend == "fused":  # the common case, in short
            held, batch = flat[0]
            try:
                return _backends.run_fused_own_grads(
                    self._adaptive, batch.lists, held.hp, False,
                    *_held_step_extras(batch.device, grad_scale, found_inf))
            except RuntimeError:  # refused before touching anything: the careful path says why
                return False
        batches = [(held.hp, batch) for held, batch in flat]
        several = len(batches) > 1
        if several and not all(batch.lists.take_own_grads() for _, batch in batches):
            self._drop_taken_grads(batches)
            return False
        # Triton batches first take their gradients and tables, for every group before any
        # steps: their kernels check nothing, so one that cannot step stops the whole step.
        launches = {}
        for i, (hp, batch) in enumerate(batches):
            if batch.backend == "triton":
                try:
                    launches[i] = _backends.prepare_triton_own_grads(
                        self._adaptive, batch.lists, batch.memo, batch.device, batch.dtype,
                        hp, several)
                except RuntimeError:  # tables to build inside a capture: the careful step
                    launches[i] = None  # says what to do
                if launches[i] is None:
                    self._drop_taken_grads(batches)
                    return False
        per_device = {}  # read once per step, not per batch: host time is most of it here
        for i, (hp, batch) in enumerate(batches):
            extra = per_device.get(batch.device)
            if extra is None:
                extra = per_device[batch.device] = _held_step_extras(batch.device, grad_scale,
                                                                     found_inf)
            try:
                if batch.backend == "triton":
                    launches[i](*extra[2:])
                    continue
                done = _backends.run_fused_own_grads(
                    self._adaptive, batch.lists, hp, several, *extra)
            except RuntimeError:
                self._drop_taken_grads(batches)
                if i == 0:  # refused before touching anything: the careful path says why
                    return False
                raise  # a later batch refused after earlier ones stepped, as in _run
            if not done:  # only without `several`, so in the first and only batch
                return False
        return True

    @staticmethod
    def _drop_taken_grads(batches):
        """The gradients take_own_grads() took and no step used: not kept until the next."""
        for _, batch in batches:
            batch.lists.drop_taken_grads()

    def _run(self, plan, grad_scale, found_inf):
        """Runs every item of the plan; returns the batches it ran."""
        per_device = {}
        for item in plan:
            _backends.check_capturable(item.backend, item.params[0].device)
        # Every batch is built (and checked) before any runs: a step that raises has not
        # touched a parameter.
        built = [self._batch(item) for item in plan]
        batches = [batch for batch, _ in built]
        for item, (batch, writebacks) in zip(plan, built):
            device = batch.params[0].device
            if device not in per_device:
                per_device[device] = tuple(
                    None if t is None else t.to(device, non_blocking=True)
                    for t in (grad_scale, found_inf))
            _backends.RUNNERS[item.backend](self._adaptive, batch, self._hyper(item.group),
                                            *per_device[device])
            for param, dense in writebacks:
                param.copy_(dense)
        return batches

    def _refusal_explained(self, item):
        """The fused kernel refused a batch whose gradient check was left to it. It checks
        all its arguments before touching anything, so the step can be redone carefully when
        the cause is known: a gradient that does not match its parameter raises here, naming
        it; a parameter that moved, or a gradient laid out unlike its parameter (copied on
        the careful path), returns True."""
        gi, grouping, grads = item.origin
        layouts = self._check_grads(grouping.batches, item.group["params"], grads, gi)
        if layouts is None:  # the careful path regroups
            return True
        cached = self._cached_batch(item.group, item.backend, item.ids)
        if cached is not None and not _backends.held_lists_ok(cached):
            return True  # a parameter was given new data: the careful path rebuilds (_batch)
        if layouts[0] is False:
            grouping.defer_check = False  # check in C++ first from now on
            return True
        return False


class PNM(_PositiveNegativeMomentum):
    r"""Positive-Negative Momentum (Xie et al., ICML 2021, Algorithm 2).

    Two momentum buffers, fed by alternate steps' gradients; the step goes along
    ``(1+b0)*m_now - b0*m_other``, divided by ``sqrt((1+b0)^2 + b0^2)``.

    Args:
        params: parameters or param groups.
        lr: learning rate (float or 0-dim tensor). The momentum is an average, not torch
            SGD's sum: ``lr/(1-beta1)`` keeps the step of ``SGD(lr, momentum=beta1)``,
            before the noise normalisation.
        betas: ``(beta1, beta0)``: momentum coefficient and positive-negative coefficient.
            ``beta0 = -beta1/(1+beta1)`` is ordinary EMA momentum up to the normalisation.
        weight_decay: weight-decay coefficient.
        decoupled: decoupled (AdamW-style) weight decay; False applies L2 to the gradient.
        maximize: maximize the objective instead of minimizing it.
        backend: "auto", "fused", "triton", "foreach" or "reference".
    """

    _adaptive = False
    _buffer_names = PNM_BUFFERS

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 1.0), weight_decay: float = 0.0,
                 decoupled: bool = True, maximize: bool = False, backend: str = "auto") -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, decoupled=decoupled,
                        maximize=maximize, backend=backend)
        super().__init__(params, defaults)


class AdaPNM(_PositiveNegativeMomentum):
    r"""Adaptive Positive-Negative Momentum (Xie et al., ICML 2021, Algorithm 3), with AMSGrad
    by default.

    Args:
        params: parameters or param groups.
        lr: learning rate (float or 0-dim tensor).
        betas: ``(beta1, beta2, beta0)``. ``beta0 = -beta1/(1+beta1)`` with ``amsgrad=False``
            is Adam, up to the noise normalisation.
        eps: added to the denominator after bias correction.
        weight_decay: weight-decay coefficient.
        amsgrad: keep the running maximum of the second moment.
        decoupled: decoupled (AdamW-style) weight decay; False applies L2 to the gradient.
        maximize: maximize the objective instead of minimizing it.
        backend: "auto", "fused", "triton", "foreach" or "reference".
    """

    _adaptive = True
    _buffer_names = ADAPNM_BUFFERS

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float, float] = (0.9, 0.999, 1.0), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = True, decoupled: bool = True,
                 maximize: bool = False, backend: str = "auto") -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        decoupled=decoupled, maximize=maximize, backend=backend)
        super().__init__(params, defaults)
