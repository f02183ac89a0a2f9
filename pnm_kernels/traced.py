"""The step as torch.compile traces it.

Each group's tensors come from the optimizer's _init_group, which dynamo runs untraced, as it
runs torch's optimizers' own; it then knows each tensor by its place in param_groups or state
and guards on them as for torch's optimizers. (Traced, the eager planning would reach them
through the state dict's keys: a gradient would be guarded by identity, and every step with
new gradients would recompile.)

Also here: the checks inside the graph of what dynamo does not guard (the CPU step counters'
values; every tensor's memory, dtype, device and layout as traced), as custom ops: in C++
where the extension is built, in Python otherwise."""
import weakref

import torch

from ._ops import DTYPE_CODES, extension_error
from .aliasing import LR, SCALING, MemoryClaims, extents_meet
from .backends import REGISTRY, traceable
from .backends.base import Scaling, is_whole_count
from .batching import ParameterPlaces, writeback
from .hyper import Hyper, assert_lr_in_graph, lr_bound, needs_seed, validate_group
from .layout import LAZY_VIEW_ADVICE, lazy_view
from .params import (check_param_list, check_unique, dense_copies, element_offset, kernel_batch,
                     kernel_views, local)
from .plan import group_batches
from .quantization import scale_name


def step(optimizer, scaling: Scaling) -> None:
    for gi, group in enumerate(optimizer.param_groups):  # before any group steps
        assert_lr_in_graph(group["lr"], f"param_groups[{gi}]", group, optimizer._adaptive)
    # Every group's lists, and their counters checked, before any group steps.
    groups = []
    counters: tuple[list, list, list] = ([], [], [])  # the CPU ones, their groups and places
    for gi, group in enumerate(optimizer.param_groups):
        lists: list[list[torch.Tensor]] = [[] for _ in range(8)]
        # int8 state: a list per buffer (as backends.base.Batch.scales). Flat lists: dynamo finds
        # the sources of the tensors the untraced _init_group puts into them.
        scales: list[list] = [[] for _ in range(4)]
        batches = optimizer._init_group(group, gi, *lists, *scales)
        places = [pi for *_, indices in batches for pi in indices]
        for step, pi in zip(lists[6], places):
            if step.device.type == "cpu":
                counters[0].append(step)
                counters[1].append(gi)
                counters[2].append(pi)
        groups.append((group, lists, scales, batches))
        if isinstance(group["lr"], float):
            # A float lr that changed once is a graph input dynamo does not guard, and
            # _init_group's validation ran at tracing: a guard on what it checked makes a
            # negative or too large one trace again, which refuses it (a NaN traces anyway).
            # A bound of constants (no symbolic product): the lr and its factors' range.
            torch._check(group["lr"] >= 0)
            torch._check(group["lr"] <= lr_bound(group, optimizer._adaptive))  # `<=`: sympy
            # takes `< inf` as true
    if counters[0]:  # none on a device: no op in the graph
        _check_step_counts(*counters)
    steps, written, read = _memory_of(optimizer, groups)
    if steps:  # a group steps
        read += [t for _, t in scaling.named()]  # GradScaler's: read as a tensor lr is
        # A gradient's sizes may be symbolic (dynamo makes them dynamic once they changed);
        # the parameters and state are static inputs.
        _check_traced_tensors(steps, written, read,
                              _layouts(steps + written) + _layouts(read, with_shape=False))
    for group, lists, scales, batches in groups:
        params, grads, buffer0, buffer1, buffer2, buffer3, steps, seeds = lists
        hyper = Hyper.from_group(group, optimizer._adaptive)  # validated by _init_group
        buffers = [buffer0, buffer1, buffer2, buffer3][:hyper.num_buffers]
        start = 0
        for backend, count, copies, offsets, _ in batches:
            end = start + count
            device = params[start].device
            batch_hyper = hyper
            if REGISTRY[backend].flat and not isinstance(hyper.lr, torch.Tensor):
                # A float lr is a graph input, as for torch's optimizers, but an op's float
                # argument would be specialised on, recompiling for every new lr: it enters
                # the kernels as a tensor on their device, in float64, the eager step's
                # digits (the kernels read it in double). (A product: torch.full's fill
                # value would be specialised on too.)
                lr = torch.ones((), dtype=torch.float64, device=device) * hyper.lr
                batch_hyper = hyper.with_lr(lr)
            batch, writebacks = kernel_batch(
                params[start:end], grads[start:end], [b[start:end] for b in buffers],
                steps[start:end], REGISTRY[backend].flat, copies, traced=True)
            if seeds:
                batch.seeds, batch.offsets = seeds[start:end], list(offsets)
            if scales[0]:
                batch.scales = [slot[start:end] for slot in scales[:hyper.num_buffers]]
            REGISTRY[backend].step(batch, batch_hyper, Scaling(
                *(None if t is None else t.to(device)
                  for t in (scaling.grad_scale, scaling.found_inf))))
            writeback(writebacks)
            start = end


def _memory_of(optimizer, groups) -> tuple[list, list, list]:
    """What _check_traced_tensors takes: the step counters, the other tensors the step writes
    or reads as state (parameters, buffers, seeds, int8 scales), and what it only reads
    (gradients, the tensor lrs of groups that step); a shard's local tensor."""
    steps, written, read = [], [], []
    for group, lists, scales, _ in groups:
        params, grads, *buffers, counters, seeds = lists
        steps += counters
        for tensors in (params, *buffers, seeds, *scales):
            written += [_real(local(t)) for t in tensors if t is not None]
        read += [_real(local(g)) for g in grads]
        if params and isinstance(group["lr"], torch.Tensor):
            read.append(group["lr"])
    return steps, written, read


def _real(tensor):
    """A complex tensor as its real view: inductor fails on a custom op taking complex ones."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _check_step_counts(steps: list, groups: list, places: list) -> None:
    """state.check_state's check of the CPU step counters' values, run inside the traced
    step: dynamo does not guard a counter's value, so one filled in place after tracing
    (`state["step"].fill_(-1)`) would step on (AdaPNM dividing by a bias correction of 0).
    An op declared as writing the counters, so that the compiler orders every read and
    write of them (every group's step) after it: an assert that wrote nothing could run
    after the first group's counters had advanced. Counter i is param_groups[groups[i]]
    ['params'][places[i]]'s; those on a device are not given (that would synchronise, as in
    eager). In C++ (csrc/traced_checks.h) where the extension is built: a number a counter."""
    if extension_error() is None:
        torch.ops.pnm_kernels.check_step_counts(steps, groups, places)
    else:
        _check_step_counts_in_python(steps, groups, places)


def _layouts(tensors: list, with_shape: bool = True) -> list[int]:
    """Each tensor's layout as traced, as _check_traced_tensors compares it (the format:
    csrc/traced_checks.h): constants of the graph. Without shapes: dtypes and devices."""
    out: list[int] = []
    for t in tensors:
        out += _layout_entry(t, with_shape)
    return out


def _layout_entry(t, with_shape: bool) -> list:
    """`t`'s entry in a list of layouts: a head (dtype, device, dims, contiguous), its sizes,
    and its strides where it is not contiguous; without its shape, the head alone."""
    dims = t.dim() if with_shape else -1
    contiguous = with_shape and t.is_contiguous()
    device = -1 if t.device.type == "cpu" else t.device.index
    head = (DTYPE_CODES.get(t.dtype, _NOT_COMPARED) + ((device + 1) << 8) + ((dims + 1) << 16)
            + (contiguous << 24))
    if not with_shape:
        return [head]
    return [head, *t.shape] if contiguous else [head, *t.shape, *t.stride()]


_NOT_COMPARED = 255  # a dtype's code


def _check_traced_tensors(steps: list, written: list, read: list, layouts: list) -> None:
    """Two checks of the eager step run inside the traced step, for what dynamo does not
    guard:
    - that each tensor is laid out as when the step was traced (`layouts`): a parameter's
      dtype, device, sizes or strides changed through .data (module.to(dtype) changes them
      so) would be stepped by code traced for the old ones (inductor's kernels read the new
      memory as the old dtype). Refused by _refuse_changed_tensor.
    - that no two tensors it writes share memory, nor a gradient or tensor lr one of them
      (docs/edits.md): `p.grad = q.data` or a state tensor made a view of another's after
      tracing would step aliased memory. A screen of the extents; on a hit,
      _refuse_shared_memory.
    In C++ where the extension is built (a few numbers a tensor at every step). Declared as
    writing the counters for its place in the graph (see _check_step_counts)."""
    if extension_error() is None:
        torch.ops.pnm_kernels.check_traced_tensors(steps, written, read, layouts)
    else:
        _check_traced_tensors_in_python(steps, written, read, layouts)


def _refuse_step_count(group: int, place: int, value: float) -> None:
    """Raises naming param_groups[group]['params'][place], whose counter holds `value`."""
    raise RuntimeError(f"param_groups[{group}]['params'][{place}]: its state 'step' is "
                       f"{value!r}, not a whole number of steps >= 0: filled in place? "
                       "Restart its state with `del optimizer.state[param]`")


# The optimizers whose step was traced: a refusal finds its own by where a tensor of the
# step lies (_traced_optimizer), as no constant of the graph names it.
_TRACED: weakref.WeakSet = weakref.WeakSet()


def _traced_optimizer(where: int):
    """The traced optimizer one of whose tensors (a shard's local tensor) lies at `where`;
    the only one alive where none is found (`where` 0: no tensor had memory)."""
    optimizers = list(_TRACED)
    for optimizer in optimizers:
        if where and any(local(t).numel() and local(t).data_ptr() == where
                         for t, _ in _tensors_named(optimizer)):
            return optimizer
    if len(optimizers) == 1:
        return optimizers[0]
    raise RuntimeError("pnm_kernels: the compiled step's optimizer is not found")


def _refuse_changed_tensor(optimizer_at: int, where: int, numel: int, dtype: int, device: int,
                           sizes, strides) -> None:
    """Raises naming the tensor of the step at `where` (of `numel` elements), traced with the
    dtype of code `dtype` on `device` (see _layouts), of `sizes` and `strides` (or None)."""
    dtypes = {code: d for d, code in DTYPE_CODES.items()}
    traced = _layout_text(dtypes.get(dtype, "another dtype"), device, sizes, strides)
    name, now, lazy = "a tensor of the step", None, None
    for tensor, owner in _tensors_named(_traced_optimizer(optimizer_at)):
        t = local(tensor)
        if where and _real(t).numel() == numel and t.data_ptr() == where:  # checked as _real's
            name, lazy = owner, lazy_view(t)
            now = _layout_text(t.dtype, -1 if t.device.type == "cpu" else t.device.index,
                               tuple(t.shape), t.stride())
            if t.is_complex():
                traced += " (as the real view of a complex tensor)"
            break
    if lazy:
        raise RuntimeError(
            f"pnm_kernels: {name} is an unresolved {lazy} view (given through .data after the "
            f"step was traced?) of {now}: {LAZY_VIEW_ADVICE}. Nothing was stepped")
    raise RuntimeError(
        f"pnm_kernels: {name} is {'not laid out' if now is None else now}, where the compiled "
        f"step was traced with {traced}: changed through .data (module.to() changes a "
        "parameter so), which torch.compile does not see. Nothing was stepped; compile the "
        "step again (torch.compiler.reset()) to step it so")


def _layout_text(dtype, device: int, sizes, strides) -> str:
    where = "the CPU" if device < 0 else f"cuda:{device}"
    shape = "" if sizes is None else f" of shape {tuple(sizes)}, strides {tuple(strides)},"
    return f"{dtype}{shape} on {where}"


def _tensors_named(optimizer):
    """Every tensor a step of `optimizer` may take, with its name."""
    for gi, group in enumerate(optimizer.param_groups):
        if isinstance(group["lr"], torch.Tensor):
            yield group["lr"], f"param_groups[{gi}]['lr']"
        for pi, p in enumerate(group["params"]):
            name = f"param_groups[{gi}]['params'][{pi}]"
            yield p, name
            if p.grad is not None:
                yield p.grad, f"{name}'s gradient"
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    yield value, f"{name}'s state {key!r}"


def _refuse_shared_memory(where: int) -> None:
    """The eager step's check of every group, which raises naming both tensors that share
    memory (or passes: strided views whose elements interleave, extents meeting)."""
    _check_every_group(_traced_optimizer(where))


def _first_memory(tensors) -> int:
    """csrc/traced_checks.cpp's optimizer_of."""
    return next((t.data_ptr() for t in tensors if t.numel()), 0)


@torch.library.custom_op("pnm_kernels::check_step_counts_in_python", mutates_args=("steps",))
def _check_step_counts_in_python(steps: list[torch.Tensor], groups: list[int],
                                 places: list[int]) -> None:
    """csrc/traced_checks.h's check_step_counts, for an install without the extension."""
    _check_counts(steps, groups, places)


def _check_counts(steps, groups, places) -> None:
    for step, group, place in zip(steps, groups, places):
        if lazy_view(step):
            continue  # _check_traced_tensors_in_python, next, refuses it naming it
        if not is_whole_count(float(step)):
            _refuse_step_count(group, place, float(step))


@torch.library.custom_op("pnm_kernels::check_traced_tensors_in_python", mutates_args=("steps",))
def _check_traced_tensors_in_python(steps: list[torch.Tensor], written: list[torch.Tensor],
                                    read: list[torch.Tensor], layouts: list[int]) -> None:
    """csrc/traced_checks.h's check_traced_tensors, for an install without the extension."""
    _check_layouts_and_memory(steps, written, read, layouts)


def _check_layouts_and_memory(steps, written, read, layouts) -> None:
    at = 0
    for t in steps + written + read:
        head = layouts[at]
        dtype, device, dims = head & 255, ((head >> 8) & 255) - 1, ((head >> 16) & 255) - 1
        contiguous = bool(head >> 24 & 1)
        entry = layouts[at:at + 1 + max(dims, 0) * (1 if contiguous else 2)]
        now = _layout_entry(t, dims >= 0)
        if dtype == _NOT_COMPARED:
            now[0] = (now[0] & ~255) + _NOT_COMPARED
        if now != entry or lazy_view(t):
            where = t.data_ptr() if t.numel() else 0
            sizes = entry[1:1 + dims] if dims >= 0 else None
            strides = entry[1 + dims:] if dims >= 0 and not contiguous else None
            if sizes is not None and strides is None:
                strides = list(torch.empty(sizes, device="meta").stride())
            _refuse_changed_tensor(_first_memory(written), where, t.numel(), dtype, device,
                                   sizes, strides)
        at += len(entry)
    if extents_meet(steps + written, read):
        _refuse_shared_memory(_first_memory(written))


# A lazy negative or conjugate view among the inputs: the dispatcher's fallback would hand the
# check a resolved copy (in other memory, not lazy); the check itself sees and refuses it (as
# csrc/ops.cpp registers the C++ check).
_LAZY_VIEW_KERNELS = torch.library.Library("pnm_kernels", "IMPL")
for _key in ("Negative", "Conjugate"):
    _LAZY_VIEW_KERNELS.impl("check_step_counts_in_python", _check_counts, _key)
    _LAZY_VIEW_KERNELS.impl("check_traced_tensors_in_python", _check_layouts_and_memory, _key)


@_check_step_counts_in_python.register_fake
def _(steps, groups, places) -> None:
    return None


@_check_traced_tensors_in_python.register_fake
def _(steps, written, read, layouts) -> None:
    return None


def _check_every_group(optimizer) -> None:
    """What a step refuses in any group (params that are no list or appear twice, a bad
    hyper-parameter, state no step can use or shared between parameters or keys), checked
    before the first group's state is made or converted: dynamo runs init_group a group at a
    time, and a refusal in a later group would leave the earlier ones' state converted."""
    groups = optimizer.param_groups
    for gi, group in enumerate(groups):
        check_param_list(group, gi)
    check_unique(groups)
    claims = MemoryClaims()
    for gi, group in enumerate(groups):
        validate_group(group, optimizer._adaptive, f"param_groups[{gi}]")
        stepping = [p for p in group["params"] if p.grad is not None]
        optimizer._batches.check_states(optimizer, group, stepping,
                                        _buffer_names(optimizer, group), claims)
        if stepping:  # a group that does not step reads no lr
            claims.add(group["lr"], group, LR)
    for name, tensor in Scaling.of(optimizer).named():
        claims.add(tensor, name, SCALING)
    optimizer._batches.check_memory(optimizer, claims)


def _buffer_names(optimizer, group) -> tuple:
    """The state buffers a step of `group` keeps (AMSGrad's maximum only where it is on)."""
    return optimizer._buffer_names[:Hyper.from_group(group, optimizer._adaptive).num_buffers]


def _make_every_state(optimizer) -> None:
    """Makes or converts the state of every group's parameters that step, before the first
    group's lists are made: dynamo maps the tensors of every group's state, by their keys'
    places, after each group's init_group, and a later group's conversion that drops keys
    (int8 state's scales, its state_dtype switched) would leave those places stale (an
    IndexError while dynamo builds its guards, the state converted)."""
    places = ParameterPlaces(optimizer)
    for group in optimizer.param_groups:
        names = _buffer_names(optimizer, group)
        for p in group["params"]:
            if p.grad is not None:
                optimizer._batches.state_for(optimizer, p, names, group, places)


def init_group(optimizer, group, gi, params, grads, buffer0, buffer1, buffer2, buffer3, steps,
               seeds, scales):
    """Run untraced (see the optimizer's _init_group): validates the group, checks its
    gradients, makes missing state, and fills the lists with the parameters that have a
    gradient, their gradients, state buffers, step counters, (bfloat16 or int8 state) seeds
    and (int8 state) each buffer's block scales or None, batch after batch. Returns each
    batch's (backend, number of parameters, each one's dense_copies, each one's
    element_offset, each one's place in the group), decided here from the layouts: constants,
    as dynamo takes them. (Dynamo guards the parameters, not the gradients; the kernel
    refuses a gradient laid out otherwise.) `gi`: the group's index; dynamo hands a group of
    constants alone (no parameter) over as a copy, so `group` is read from the optimizer."""
    group = optimizer.param_groups[gi]
    validate_group(group, optimizer._adaptive, f"param_groups[{gi}]")
    if gi == 0:
        _check_every_group(optimizer)
        _TRACED.add(optimizer)
        _make_every_state(optimizer)
    indices = [i for i, p in enumerate(group["params"]) if p.grad is not None]
    names = _buffer_names(optimizer, group)
    out = []
    places = ParameterPlaces(optimizer)
    int8 = group["state_dtype"] == torch.int8
    for backend, idx, _, (device, dtype) in group_batches(group, gi, indices):
        backend = traceable(backend, device, dtype.to_real())
        copies, offsets = [], []
        for pi in idx:
            p = group["params"][pi]
            state = optimizer._batches.state_for(optimizer, p, names, group, places)
            params.append(p)
            grads.append(p.grad)
            bufs = [state[name] for name in names]
            for lst, buf in zip((buffer0, buffer1, buffer2, buffer3), bufs):
                lst.append(buf)
            steps.append(state["step"])
            for slot, name in zip(scales if int8 else (), names):
                slot.append(None if scale_name(name) not in state else local(state[scale_name(name)]))
            if needs_seed(group["state_dtype"], group["bf16_stochastic_round"], p.dtype):
                seeds.append(state["seed"])
                offsets.append(element_offset(p))
            param, grad, bufs = kernel_views(p, p.grad, bufs)
            copies.append(dense_copies(param, grad, bufs[0], REGISTRY[backend].flat))
        out.append((backend, len(idx), tuple(copies), tuple(offsets), tuple(idx)))
    return tuple(out)
