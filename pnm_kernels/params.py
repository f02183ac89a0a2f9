"""A parameter as the kernels take it: checks that name it, its local shard (DTensor), real
views of complex tensors, and dense copies for the flat kernels; and the Batch they make."""
import itertools
import operator
import sys

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .backends.base import Batch
from .layout import LAZY_VIEW_ADVICE, dense_like, is_dense, lazy_view
from .state import is_dtensor, is_plain


def describe(param, gi, pi) -> str:
    shape = "nested" if param.is_nested else f"shape {tuple(param.shape)}"
    return f"param_groups[{gi}]['params'][{pi}] ({shape}, {param.dtype}, {param.device})"


def describe_in(param_groups, param) -> str:
    """describe() of a parameter where it stands in these groups (in none: its shape)."""
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            if p is param:
                return describe(param, gi, pi)
    return f"a parameter of shape {tuple(param.shape)}"


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def check_param(param, gi, pi) -> None:
    """Raises, naming the parameter, if it or its gradient cannot step."""
    grad = param.grad
    for what, t in (("", param), ("'s gradient", grad)):
        # (the subclass test first only where it can hold: it costs a microsecond a tensor)
        kind = ("a nested tensor" if t.is_nested else
                f"a {type(t).__name__}, a tensor subclass wrapping other tensors"
                if type(t) not in _PLAIN and is_traceable_wrapper_subclass(t)
                and not is_dtensor(t) else None)
        if kind:
            raise RuntimeError(f"{describe(param, gi, pi)}{what} is {kind}: not supported (the "
                               "steps take plain tensors' memory, or a DTensor's shard)")
    if grad.is_sparse or grad.layout != torch.strided:
        raise RuntimeError(f"{describe(param, gi, pi)} has a sparse gradient; PNM and AdaPNM "
                           "do not support sparse gradients")
    if grad.shape != param.shape or grad.dtype != param.dtype or grad.device != param.device:
        raise RuntimeError(f"{describe(param, gi, pi)} has a gradient of shape "
                           f"{tuple(grad.shape)}, {grad.dtype}, {grad.device}, which does not "
                           "match the parameter")
    if param.is_sparse or param.layout != torch.strided:
        raise RuntimeError(f"{describe(param, gi, pi)} is sparse; not supported")
    for what, t in (("", param), ("'s gradient", grad)):
        lazy = lazy_view(local(t))  # a DTensor's shard is what the kernels take
        if lazy:
            raise RuntimeError(f"{describe(param, gi, pi)}{what} is an unresolved {lazy} view "
                               f"(from .conj() or similar): {LAZY_VIEW_ADVICE}")


def is_param_list(params) -> bool:
    """Whether a group's params are as torch's add_param_group leaves them, a list (or a
    tuple set by hand): a set or dict keys set by hand has no order to step by, a tensor
    would step rows."""
    return isinstance(params, (list, tuple))


def check_param_list(group: dict, gi: int) -> None:
    """Raises, naming the group, where its params are no list (is_param_list)."""
    params = group["params"]
    if not is_param_list(params):
        raise TypeError(f"param_groups[{gi}]['params'] is a {type(params).__name__}; it must "
                        "be a list of parameters")


def check_unique(param_groups) -> None:
    """Each parameter steps once: a parameter put into a group's list a second time by hand
    (add_param_group refuses it) is refused at the step, before anything is touched."""
    first: dict[int, tuple[int, int]] = {}
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            where = first.setdefault(id(p), (gi, pi))
            if where != (gi, pi):
                raise ValueError(
                    f"{describe(p, gi, pi)} is the same tensor as "
                    f"param_groups[{where[0]}]['params'][{where[1]}]; a parameter may appear "
                    "only once among the param groups")


def holdable(p) -> bool:
    """A parameter the kernels take as it is (plain, real, dense: contiguous, channels_last,
    transposed): its lists can be held between steps."""
    return is_plain(p) and not p.is_complex() and (p.is_contiguous() or is_dense(p))


def local(t: torch.Tensor) -> torch.Tensor:
    """The shard a DTensor (FSDP2) holds on this rank; the kernels update shards in place."""
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def shard_holdable(p) -> bool:
    """A DTensor (FSDP2) whose local shard is holdable: a cached batch may hold the shard,
    checked again at every step; the repeated step, whose C++ lists read the gradients
    themselves, never holds it (a DTensor's gradient is not its shard's)."""
    shard = local(p)
    return shard is not p and holdable(shard)


shard_of = operator.attrgetter("_local_tensor")  # a DTensor's (see local)


def element_offset(p) -> int:
    """The elements of the whole parameter before its local shard, in row-major order: 0 for
    a plain tensor. With it, the index of a shard's element (which picks its random bits)
    is that element's in the whole parameter, for FSDP2's dim-0 shards (uneven ones too)."""
    shard = local(p)
    if shard is p or shard.numel() == 0:
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, start = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    offset, stride = 0, 1
    for size, first in reversed(list(zip(p.shape, start))):
        offset += first * stride
        stride *= size
    return offset
_shape_of = operator.attrgetter("shape")


def shards_match(params, grads, check) -> bool:
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
            and check(list(map(shard_of, params)), list(map(shard_of, grads)), True) < 0)


def kernel_views(p, grad, bufs):
    """A parameter, its gradient and state buffers as the kernels see them: a DTensor's
    local shard, complex as real views."""
    param, grad, bufs = local(p), local(grad), [local(b) for b in bufs]
    if p.is_complex():
        param, grad = torch.view_as_real(param), torch.view_as_real(grad)
        bufs = [torch.view_as_real(b) for b in bufs]
    return param, grad, bufs


def dense_copies(param, grad, buffer, flat):
    """Whether a flat backend (its kernels walk raw memory) needs the parameter and the
    gradient (as kernel_views gives them) copied into the buffers' dense layout."""
    if not flat:
        return False, False
    return not dense_like(param, buffer), not dense_like(grad, buffer)


def _kernel_tensors(p, grad, bufs, flat, copies=None, traced=False):
    """What the kernels take for one parameter (under torch.compile `copies` was decided
    untraced). Returns (param, grad, buffers, the (tensor, copy) pairs to write back after
    the step)."""
    param, grad, bufs = kernel_views(p, grad, bufs)
    copy_param, copy_grad = copies or dense_copies(param, grad, bufs[0], flat)
    writebacks = []
    # In the buffers' layout, in the tensor's own dtype (the buffers may hold another: bfloat16
    # or int8 state).
    if copy_param:
        dense = torch.empty_like(bufs[0], dtype=param.dtype).copy_(param)
        writebacks.append((param, dense))
        param = dense
    if copy_grad:
        grad = torch.empty_like(bufs[0], dtype=grad.dtype).copy_(grad)
    if traced and p.is_complex():
        # torch's functionalization of an op that writes a dtype-changing view (the real view
        # of a complex tensor) rebuilds the view as_strided over the complex base, which
        # fails: the op writes real copies, copied back through the views.
        if not copy_param:
            writebacks.append((param, param.clone()))
            param = writebacks[-1][1]
        writebacks += [(buf, buf.clone()) for buf in bufs]
        bufs = [copy for _, copy in writebacks[-len(bufs):]]
    return param, grad, bufs, writebacks


def kernel_batch(params, grads, buffers, steps, flat, copies=None, traced=False):
    """The kernels' Batch for these parameters (`buffers`: a list per state buffer, `copies`:
    see _kernel_tensors; `traced`: under torch.compile), and the (tensor, copy) pairs to
    write back after the step."""
    batch = Batch(buffers=[[] for _ in buffers])
    writebacks = []
    for i, p in enumerate(params):
        param, grad, bufs, written = _kernel_tensors(
            p, grads[i], [b[i] for b in buffers], flat, copies[i] if copies else None, traced)
        writebacks += written
        batch.params.append(param)
        batch.grads.append(grad)
        for lst, buf in zip(batch.buffers, bufs):
            lst.append(buf)
        batch.steps.append(steps[i])
    return batch, writebacks
