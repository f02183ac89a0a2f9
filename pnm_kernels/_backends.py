"""The step implementations behind ``backend=``, each taking one batch of same-device,
same-dtype tensors. Buffers are in kernel table order: PNM (pos_momentum, neg_momentum);
AdaPNM (exp_avg, neg_exp_avg, exp_avg_sq[, max_exp_avg_sq])."""
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import reference
from ._ops import extension_error

EMULATE_ENV = "PNM_KERNELS_EMULATE_CUDA"
PNM_BUFFERS: tuple[str, ...] = ("pos_momentum", "neg_momentum")
ADAPNM_BUFFERS: tuple[str, ...] = ("exp_avg", "neg_exp_avg", "exp_avg_sq", "max_exp_avg_sq")

# Parameter dtypes (complex ones go in as real views): the reference and foreach ops and the
# fused kernels take all four, the Triton kernels no float64.
REFERENCE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FUSED_DTYPES = REFERENCE_DTYPES
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Batch:
    params: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    buffers: list = field(default_factory=list)  # one list per buffer name
    steps: list = field(default_factory=list)
    # For a cached batch: what a backend derives once from the lists that stay the same from
    # step to step (parameters, buffers, counters), shared by the batches of every step.
    memo: Optional[dict] = None


def _skip_step(found_inf: Optional[torch.Tensor]) -> bool:
    # Host read: the reference and foreach backends are not capturable anyway.
    return found_inf is not None and bool(found_inf.item())


def run_reference(adaptive, batch, hp, grad_scale, found_inf):
    if _skip_step(found_inf):
        return
    lr = float(hp["lr"])
    names = ADAPNM_BUFFERS if adaptive else PNM_BUFFERS
    for i, (param, grad) in enumerate(zip(batch.params, batch.grads)):
        state = {name: buffers[i] for name, buffers in zip(names, batch.buffers)}
        state["step"] = batch.steps[i]
        common = dict(lr=lr, beta1=hp["beta1"], beta0=hp["beta0"],
                      weight_decay=hp["weight_decay"], decoupled=hp["decoupled"],
                      maximize=hp["maximize"], grad_scale=grad_scale)
        if adaptive:
            reference.adapnm_step(param, grad, state, beta2=hp["beta2"], eps=hp["eps"],
                                  amsgrad=hp["amsgrad"], **common)
        else:
            reference.pnm_step(param, grad, state, **common)


def run_foreach(adaptive, batch, hp, grad_scale, found_inf):
    """torch._foreach_* ops over the batch; parity and bias corrections are read on the host."""
    if torch.compiler.is_compiling() and found_inf is None:
        _run_traced(adaptive, batch, hp, grad_scale)
        return
    if _skip_step(found_inf):
        return
    lr, beta1, beta0, wd = float(hp["lr"]), hp["beta1"], hp["beta0"], hp["weight_decay"]
    params = batch.params
    torch._foreach_add_(batch.steps, 1.0)
    if params[0].device.type == "meta":  # no values to compute: only the counters advance
        return
    steps = [int(s) for s in torch.stack(batch.steps).tolist()]
    grads = batch.grads
    if grad_scale is not None:
        grads = torch._foreach_div(grads, grad_scale)
    if hp["maximize"]:
        grads = torch._foreach_neg(grads)
    decay = 1 - lr * wd
    if hp["decoupled"]:
        if decay != 1:  # times exactly 1 changes no bit: a pass over params saved
            torch._foreach_mul_(params, decay)
    else:
        grads = torch._foreach_add(grads, params, alpha=wd)
    pos, neg = batch.buffers[0], batch.buffers[1]
    m = [pos[i] if t % 2 == 1 else neg[i] for i, t in enumerate(steps)]
    m_other = [neg[i] if t % 2 == 1 else pos[i] for i, t in enumerate(steps)]
    torch._foreach_mul_(m, beta1**2)
    torch._foreach_add_(m, grads, alpha=1 - beta1**2)
    pn_momentum = torch._foreach_mul(m, 1 + beta0)
    torch._foreach_add_(pn_momentum, m_other, alpha=-beta0)
    torch._foreach_mul_(pn_momentum, 1 / reference.noise_norm(beta0))
    if not adaptive:
        torch._foreach_add_(params, pn_momentum, alpha=-lr)
        return
    beta2 = hp["beta2"]
    exp_avg_sq = batch.buffers[2]
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
    second_moment = exp_avg_sq
    if hp["amsgrad"]:
        torch._foreach_maximum_(batch.buffers[3], exp_avg_sq)
        second_moment = batch.buffers[3]
    denom = torch._foreach_sqrt(second_moment)
    torch._foreach_div_(denom, [math.sqrt(1 - beta2**t) for t in steps])
    torch._foreach_add_(denom, hp["eps"])
    torch._foreach_addcdiv_(params, pn_momentum, denom, [-lr / (1 - beta1**t) for t in steps])


def _run_traced(adaptive, batch, hp, grad_scale):
    """The foreach backend's maths as torch.compile traces it, without a graph break: each
    tensor's parity and bias corrections come from its step counter on the device (a
    torch.where between the buffers), not from the host. It serves what runs neither fused
    nor Triton under torch.compile: backend="foreach", float64 parameters without the
    extension, and Triton batches of an install without it. Both buffers are rewritten (one
    with its own values), which inductor fuses into the step's one pass. With found_inf (AMP)
    the eager path runs instead, reading it on the host."""
    lr, beta1, beta0 = hp["lr"], hp["beta1"], hp["beta0"]
    torch._foreach_add_(batch.steps, 1.0)
    for i, (param, grad, step) in enumerate(zip(batch.params, batch.grads, batch.steps)):
        grad = reference._decay_and_grad(param, grad, lr, hp["weight_decay"], hp["decoupled"],
                                         hp["maximize"], grad_scale)
        pos, neg = batch.buffers[0][i], batch.buffers[1][i]
        odd = torch.remainder(step, 2) == 1
        m_other = torch.where(odd, neg, pos)
        m = torch.where(odd, pos, neg).mul(beta1**2).add_(grad, alpha=1 - beta1**2)
        pos.copy_(torch.where(odd, m, pos))
        neg.copy_(torch.where(odd, neg, m))
        update = reference._pn_momentum(m, m_other, beta0)
        if not adaptive:
            param.sub_(update * lr)
            continue
        beta2, exp_avg_sq = hp["beta2"], batch.buffers[2][i]
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        second_moment = exp_avg_sq
        if hp["amsgrad"]:
            second_moment = batch.buffers[3][i]
            torch.maximum(second_moment, exp_avg_sq, out=second_moment)
        # In float64, as the reference's Python floats; applied in at least float32.
        t = step.to(torch.float64)
        scalar_dtype = torch.promote_types(param.dtype, torch.float32)
        bias_correction2_sqrt = (1 - beta2**t).sqrt().to(scalar_dtype)
        step_size = (lr / (1 - beta1**t)).to(scalar_dtype)
        denom = (second_moment.sqrt() / bias_correction2_sqrt).add_(hp["eps"])
        param.sub_(update / denom * step_size)


def split_lr(lr, device, keep_float64=False):
    """(float lr, lr tensor or None) as the kernels take them: a tensor lr stays a tensor,
    on the params' device or on the CPU (read there without a device synchronisation), in
    float32; with keep_float64 (the fused ops, which read a float64 lr in full), a float64
    one stays float64, so float64 parameters get all its digits."""
    if not isinstance(lr, torch.Tensor):
        return float(lr), None
    if lr.device != device and lr.device.type != "cpu":
        lr = lr.to(device)
    if keep_float64 and lr.dtype == torch.float64:
        return 0.0, lr
    return 0.0, lr.to(torch.float32)


def capturing(device) -> bool:
    """Whether a CUDA graph is being captured on the device's current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# Backends that read each parameter's step count (and a tensor lr) on the host in an eager
# step: not capturable in a CUDA graph.
HOST_READ_BACKENDS = ("foreach", "reference")


def check_capturable(backend, device):
    """Refuses, before anything is touched, an eager step that a CUDA-graph capture would
    break halfway (as torch's optimizers refuse one without capturable=True)."""
    if backend in HOST_READ_BACKENDS and capturing(device):
        raise RuntimeError(
            f"pnm_kernels: backend='{backend}' reads each parameter's step count on the host, "
            "which a CUDA graph capture cannot record; capture the step with backend='fused' "
            "or 'triton' (what 'auto' picks on CUDA where the extension is built), or "
            "compile it (torch.compile traces the foreach step without host reads)")


def new_blocks_done(device):
    """A batch's ticket counter for steps that increment their step counters in their own
    launch: one int32, zero between steps. None inside a CUDA-graph capture, where its zeroing
    would only be recorded; a batch without one keeps a second launch for its counters."""
    if capturing(device):
        return None
    return torch.zeros(1, dtype=torch.int32, device=device)


def step_lists(batch):
    """The C++ copy (pnm_kernels._C's StepLists) of a cached batch's parameters, buffers and
    counters, made on first use; None without a memo or the extension.

    It also holds the batch's blocks_done counter, with which each CUDA launch increments
    the step counters itself instead of a second launch doing it (csrc/multi_tensor_apply.h;
    see new_blocks_done)."""
    if batch.memo is None or extension_error() is not None:
        return None
    lists = batch.memo.get("step_lists")
    if lists is None:
        blocks_done = new_blocks_done(batch.params[0].device)
        buffers = list(batch.buffers) + [[]] * (4 - len(batch.buffers))
        lists = batch.memo["step_lists"] = torch.classes.pnm_kernels.StepLists(
            batch.params, *buffers, batch.steps, blocks_done)
    return lists


def emulating(device) -> bool:
    """Whether the CUDA kernels' code runs emulated on this device's (CPU) tensors."""
    return device.type == "cpu" and os.environ.get(EMULATE_ENV) == "1"


def _held_step_args(adaptive, hp, emulate, device, grad_scale, found_inf):
    """The arguments of a StepLists step after its gradients, as the C++ methods take them."""
    lr, lr_tensor = split_lr(hp["lr"], device, keep_float64=True)
    if adaptive:
        return (emulate, lr, hp["beta1"], hp["beta2"], hp["beta0"], hp["eps"],
                hp["weight_decay"], hp["amsgrad"], hp["decoupled"], hp["maximize"], lr_tensor,
                grad_scale, found_inf)
    return (emulate, lr, hp["beta1"], hp["beta0"], hp["weight_decay"], hp["decoupled"],
            hp["maximize"], lr_tensor, grad_scale, found_inf)


def run_fused_own_grads(adaptive, lists, hp, use_taken, emulate, device, grad_scale,
                        found_inf) -> bool:
    """A fused step of a held batch (a StepLists) with its parameters' own gradients, read in
    C++ (or, with use_taken, those its take_own_grads() took); False, having done nothing,
    when one is missing or laid out unlike its parameter. `emulate`: emulating(device), read
    once per step by the caller."""
    args = _held_step_args(adaptive, hp, emulate, device, grad_scale, found_inf)
    step = lists.adapnm_step_own_grads if adaptive else lists.pnm_step_own_grads
    return step(use_taken, *args)


def prepare_triton_own_grads(adaptive, lists, memo, device, dtype, hp, use_taken):
    """triton_kernels.prepare_own_grad_step: a Triton step of a held batch with its
    parameters' own gradients, ready to launch, or None."""
    from . import triton_kernels

    return triton_kernels.prepare_own_grad_step(adaptive, lists, memo, device, dtype, hp,
                                                use_taken)


def run_fused(adaptive, batch, hp, grad_scale, found_inf):
    device = batch.params[0].device
    if batch.memo is not None and not torch.compiler.is_compiling():
        # Eager steps of a cached batch: parameters, buffers and counters were handed to C++
        # once, and only the gradients cross over from Python. With thousands of small
        # tensors, converting the lists was most of a step's host time.
        lists = step_lists(batch)
        args = _held_step_args(adaptive, hp, emulating(device), device, grad_scale, found_inf)
        (lists.adapnm_step if adaptive else lists.pnm_step)(batch.grads, *args)
        return
    emulate = emulating(device)
    lr, lr_tensor = split_lr(hp["lr"], device, keep_float64=True)
    ops = torch.ops.pnm_kernels
    common = dict(lr=lr, beta1=hp["beta1"], beta0=hp["beta0"], weight_decay=hp["weight_decay"],
                  decoupled=hp["decoupled"], maximize=hp["maximize"], lr_tensor=lr_tensor,
                  grad_scale=grad_scale, found_inf=found_inf)
    if adaptive:
        op = ops.emulated_cuda_adapnm_step_ if emulate else ops.adapnm_step_
        max_exp_avg_sq = batch.buffers[3] if hp["amsgrad"] else []
        op(batch.params, batch.grads, batch.buffers[0], batch.buffers[1], batch.buffers[2],
           max_exp_avg_sq, batch.steps, beta2=hp["beta2"], eps=hp["eps"],
           amsgrad=hp["amsgrad"], **common)
    else:
        op = ops.emulated_cuda_pnm_step_ if emulate else ops.pnm_step_
        op(batch.params, batch.grads, batch.buffers[0], batch.buffers[1], batch.steps, **common)


def traceable(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that runs a batch under torch.compile. Dynamo cannot trace the Triton
    step (its kernels read pointer tables): the same maths over the same state runs traced
    in the fused kernels, or in foreach ops without the extension (a Triton-only install).
    Decided where dynamo does not trace (the optimizer's _init_group): traced, asking
    whether the extension has CUDA kernels broke the graph."""
    if backend == "triton":
        return "fused" if fused_unavailable_reason(device, dtype) is None else "foreach"
    return backend


def run_triton(adaptive, batch, hp, grad_scale, found_inf):
    from . import triton_kernels  # (never under torch.compile: see traceable)

    triton_kernels.step(adaptive, batch, hp, grad_scale, found_inf)


def _native_first_mismatched_grad():
    """C++ check of a batch: index of the first gradient that is not a dense tensor of its
    parameter's shape, dtype and device (or whose parameter left the batch's device/dtype),
    else -1. None without the extension."""
    if extension_error() is not None:
        return None
    return torch.ops.pnm_kernels._first_mismatched_grad


first_mismatched_grad = _native_first_mismatched_grad()

RUNNERS = {"reference": run_reference, "foreach": run_foreach, "fused": run_fused,
           "triton": run_triton}
# Backends whose kernels need every tensor dense and laid out like its parameter.
FLAT_BACKENDS = ("fused", "triton")


def fused_unavailable_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    error = extension_error()
    if error is not None:
        return f"the compiled extension pnm_kernels._C could not be loaded ({error})"
    if dtype not in FUSED_DTYPES:
        return f"the fused kernels take float32, float64, float16 and bfloat16, not {dtype}"
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if torch._C._dispatch_has_kernel_for_dispatch_key("pnm_kernels::pnm_step_", "CUDA"):
            return None
        return ("pnm_kernels._C was built without CUDA kernels (no nvcc at build time, or "
                "PNM_KERNELS_NO_CUDA=1); rebuild it where nvcc is available")
    return f"there are no fused kernels for {device.type} tensors"


def triton_unavailable_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    if dtype not in TRITON_DTYPES:
        return f"the Triton kernels take float32, float16 and bfloat16, not {dtype}"
    try:
        import triton  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (f"Triton kernels run on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1), "
            f"not on {device.type} tensors")


# "auto": the fused kernels wherever they run (float32, float64, float16 and bfloat16 on CPU
# and CUDA), else on CUDA the Triton step (an install without the extension's CUDA kernels;
# not float64), else foreach ops (other devices, an install without the extension). On an
# H200, side by side in one process
# (benchmarks/results/gpu-h200-2026-11-26-run12), the fused step with its 4,096-element fp32
# chunks took the Triton step's time within 0.5 % on every fp32 set from 2^26 elements, PNM and
# AdaPNM, and less below (16-bit: less or the same everywhere). With 16,384-element chunks the
# Triton PNM step had taken 2-4 % less from 2^26 elements, and "auto" took it there (runs 7-11).
# The fused step also spends less host time a step (run 11, from 2^26 elements: 0.05-0.13 ms
# against 0.09-0.17), repeats where a parameter with state lacks a gradient, and runs inside
# any CUDA-graph capture.
def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that runs a batch: the one asked for, or for "auto" the fastest available
    as measured (see above). Raises RuntimeError/ValueError saying why a requested backend
    cannot run."""
    if requested in ("reference", "foreach"):
        if dtype not in REFERENCE_DTYPES:
            raise ValueError(f"unsupported parameter dtype {dtype}")
        return requested
    if requested == "fused":
        reason = fused_unavailable_reason(device, dtype)
    elif requested == "triton":
        reason = triton_unavailable_reason(device, dtype)
    else:  # auto: see above
        if fused_unavailable_reason(device, dtype) is None:
            return "fused"
        if device.type == "cuda" and triton_unavailable_reason(device, dtype) is None:
            return "triton"
        return resolve_backend("foreach", device, dtype)
    if reason is not None:
        raise RuntimeError(f"backend={requested!r} is unavailable for {dtype} tensors on "
                           f"{device}: {reason}")
    return requested


def held_lists_ok(batch) -> bool:
    """Whether a cached batch's parameters still fit their state (dtype, device, shape,
    layout): a parameter given new data (p.data = ...) changes under the held lists. The
    buffers were made to fit when the batch was built; the first stands for all."""
    lists = step_lists(batch)
    if lists is not None:
        return lists.held_lists_ok()
    # Without the extension (a Triton-only install), the same check in Python.
    return all(b.dtype == p.dtype and b.device == p.device and b.shape == p.shape
               and dense_like(b, p) for p, b in zip(batch.params, batch.buffers[0]))


def is_dense(t: torch.Tensor) -> bool:
    """Its elements fill one block of memory without gaps or overlap, in some dim order."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def same_dense_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` is dense and laid out like `b` (equal strides where a dimension has 2 or more)."""
    if not is_dense(a):
        return False
    return all(n <= 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


def dense_like(t: torch.Tensor, p: torch.Tensor) -> bool:
    """What the flat kernels, which walk raw memory, need of a tensor beside its parameter
    (csrc/pnm_ops.cpp's dense_like): dense and laid out like it."""
    return (t.is_contiguous() and p.is_contiguous()) or same_dense_layout(t, p)
