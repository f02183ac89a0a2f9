"""Triton kernels for PNM and AdaPNM: a whole step over many tensors in one launch.

Device tables hold every tensor's data pointer (read back with ``tl.pointer_type``), its
numel and its step counter's address; a chunk map sends each program to one chunk of one
tensor. The tables are cached under the tensors' addresses and sizes, so a training loop whose
tensors stay put (static gradients, as under CUDA graphs) uploads nothing after its first step.
Hyper-parameters are runtime arguments: a new lr never recompiles. Parity and bias corrections
come from each tensor's own step counter, read in the kernel, so nothing synchronises with
the host. Whole chunks of 16-byte-aligned tensors take an unmasked path with alignment hints:
pointers read from a table carry no alignment, and without the hints Triton emits 4-byte
loads (tests/test_triton_compiles.py checks the PTX for 128-bit loads). Under
TRITON_INTERPRET=1 the same kernels run on CPU tensors (that is how CI tests them).
"""
from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]


@triton.jit
def _store(ptr, x, mask, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    if INTERPRETED and DTYPE == tl.bfloat16:
        # The interpreter (triton 3.8) truncates fp32 -> bf16; GPUs round to nearest even.
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        tl.store(ptr, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, x.to(DTYPE), mask=mask)


@triton.jit
def _element_math(p, g, m, m_other, v, v_max, decay, b1_sq, one_minus_b1_sq, b2, one_minus_b2,
                  pos_coef, neg_coef, inv_noise_norm, eps, weight_decay, neg_step_size,
                  bc2_sqrt, ADAPTIVE: tl.constexpr, AMSGRAD: tl.constexpr,
                  DECOUPLED: tl.constexpr):
    """The update of float32 values (docs/design.md §1): the new p, m, v and v_max (v and
    v_max as given unless ADAPTIVE / AMSGRAD). Also triton_state_kernels.py's."""
    if DECOUPLED:
        p = p * decay
    else:
        g = g + weight_decay * p
    m = b1_sq * m + one_minus_b1_sq * g
    pn_momentum = (pos_coef * m + neg_coef * m_other) * inv_noise_norm
    if ADAPTIVE:
        v = b2 * v + (one_minus_b2 * g) * g  # addcmul's order: g * g overflows sooner
        second_moment = v
        if AMSGRAD:
            v_max = tl.where((v_max != v_max) | (v_max > v), v_max, v)  # NaN-propagating
            second_moment = v_max
        denom = tl.sqrt(second_moment) / bc2_sqrt + eps
        p = p + neg_step_size * (pn_momentum / denom)
    else:
        p = p + neg_step_size * pn_momentum
    return p, m, v, v_max


@triton.jit
def _tensor_constants(step, lr, log_b1, log_b2, weight_decay, ADAPTIVE: tl.constexpr):
    """A tensor's constants at this step: the decay, -lr (over AdaPNM's first bias
    correction) and the square root of the second bias correction."""
    bc2_sqrt = 1.0
    neg_step_size = -lr
    if ADAPTIVE:
        # Bias corrections in float64: 1 - b2^t loses digits in float32 when b2 is near 1.
        step64 = step.to(tl.float64)
        bc1 = 1.0 - tl.exp(step64 * log_b1)
        bc2_sqrt = tl.sqrt(1.0 - tl.exp(step64 * log_b2)).to(tl.float32)
        neg_step_size = (-lr / bc1).to(tl.float32)  # float64: bc1 is float64
    decay = 1.0 - lr * weight_decay
    return decay, neg_step_size, bc2_sqrt


@triton.jit
def _update(p_ptr, g_ptr, pos_ptr, neg_ptr, odd, m_ptr, v_ptr, v_max_ptr, offs, mask,
            grad_factor, decay, b1_sq, one_minus_b1_sq, b2, one_minus_b2, pos_coef, neg_coef,
            inv_noise_norm, eps, weight_decay, neg_step_size, bc2_sqrt, DTYPE: tl.constexpr,
            ADAPTIVE: tl.constexpr, AMSGRAD: tl.constexpr, DECOUPLED: tl.constexpr,
            INTERPRETED: tl.constexpr):
    """One block of elements; mask is None for a whole aligned block. Both momentum buffers
    are loaded by their fixed addresses and chosen by parity afterwards, so no load waits for
    the step counter; only the store goes to m_ptr (the one updated)."""
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * grad_factor
    pos_m = tl.load(pos_ptr + offs, mask=mask).to(tl.float32)
    neg_m = tl.load(neg_ptr + offs, mask=mask).to(tl.float32)
    m = tl.where(odd, pos_m, neg_m)
    m_other = tl.where(odd, neg_m, pos_m)
    v = p  # placeholders unless ADAPTIVE / AMSGRAD
    v_max = p
    if ADAPTIVE:
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        if AMSGRAD:
            v_max = tl.load(v_max_ptr + offs, mask=mask).to(tl.float32)
    p, m, v, v_max = _element_math(p, g, m, m_other, v, v_max, decay, b1_sq, one_minus_b1_sq,
                                   b2, one_minus_b2, pos_coef, neg_coef, inv_noise_norm, eps,
                                   weight_decay, neg_step_size, bc2_sqrt, ADAPTIVE, AMSGRAD,
                                   DECOUPLED)
    if ADAPTIVE:
        if AMSGRAD:
            _store(v_max_ptr + offs, v_max, mask, DTYPE, INTERPRETED)
        _store(v_ptr + offs, v, mask, DTYPE, INTERPRETED)
    _store(m_ptr + offs, m, mask, DTYPE, INTERPRETED)
    _store(p_ptr + offs, p, mask, DTYPE, INTERPRETED)


@triton.jit
def _step_kernel(ptr_table, numels, step_table, chunk_tensor, chunk_start, n_tensors,
                 lr, lr_ptr, grad_scale_ptr, found_inf_ptr, blocks_done_ptr,
                 b1_sq, one_minus_b1_sq, b2, one_minus_b2, log_b1, log_b2,
                 pos_coef, neg_coef, inv_noise_norm, eps, weight_decay, grad_sign,
                 DTYPE: tl.constexpr, ADAPTIVE: tl.constexpr, AMSGRAD: tl.constexpr,
                 DECOUPLED: tl.constexpr, HAS_LR_TENSOR: tl.constexpr,
                 HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
                 BLOCK: tl.constexpr, ITERS: tl.constexpr, ALIGNED: tl.constexpr,
                 COUNT_STEPS: tl.constexpr, INTERPRETED: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    start = tl.multiple_of(tl.load(chunk_start + pid), BLOCK)  # chunks start at block multiples
    numel = tl.load(numels + t)
    # Counters are incremented after every program read them (COUNT_STEPS: by the program
    # that finishes last; else by a second launch): this is step + 1.
    step = tl.load(tl.load(step_table + t).to(tl.pointer_type(tl.float64))) + 1.0
    odd = (step.to(tl.int64) % 2) == 1
    if HAS_LR_TENSOR:
        lr = tl.load(lr_ptr)
    grad_factor = grad_sign
    if HAS_GRAD_SCALE:
        grad_factor = grad_sign / tl.load(grad_scale_ptr)
    if HAS_FOUND_INF:  # an inf/NaN gradient somewhere: this step writes nothing
        numel = tl.where(tl.load(found_inf_ptr) == 0.0, numel, 0)

    pos = tl.load(ptr_table + 2 * n_tensors + t)
    neg = tl.load(ptr_table + 3 * n_tensors + t)
    p_ptr = tl.load(ptr_table + t).to(tl.pointer_type(DTYPE))
    g_ptr = tl.load(ptr_table + n_tensors + t).to(tl.pointer_type(DTYPE))
    pos_ptr, neg_ptr = pos.to(tl.pointer_type(DTYPE)), neg.to(tl.pointer_type(DTYPE))
    m_ptr = tl.where(odd, pos, neg).to(tl.pointer_type(DTYPE))  # the buffer this step updates
    v_ptr = p_ptr  # placeholders, never read unless ADAPTIVE / AMSGRAD
    v_max_ptr = p_ptr
    if ADAPTIVE:
        v_ptr = tl.load(ptr_table + 4 * n_tensors + t).to(tl.pointer_type(DTYPE))
        if AMSGRAD:
            v_max_ptr = tl.load(ptr_table + 5 * n_tensors + t).to(tl.pointer_type(DTYPE))
    decay, neg_step_size, bc2_sqrt = _tensor_constants(step, lr, log_b1, log_b2, weight_decay,
                                                       ADAPTIVE)

    if ALIGNED and start + BLOCK * ITERS <= numel:
        # A whole chunk of 16-byte-aligned tensors: unmasked, so loads are 128-bit wide.
        p_ptr, g_ptr = tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16)
        pos_ptr, neg_ptr = tl.multiple_of(pos_ptr, 16), tl.multiple_of(neg_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr, v_max_ptr = tl.multiple_of(v_ptr, 16), tl.multiple_of(v_max_ptr, 16)
        for i in tl.static_range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            _update(p_ptr, g_ptr, pos_ptr, neg_ptr, odd, m_ptr, v_ptr, v_max_ptr, offs, None,
                    grad_factor, decay, b1_sq, one_minus_b1_sq, b2, one_minus_b2, pos_coef,
                    neg_coef, inv_noise_norm, eps, weight_decay, neg_step_size, bc2_sqrt,
                    DTYPE, ADAPTIVE, AMSGRAD, DECOUPLED, INTERPRETED)
    else:  # the tail of a tensor, a misaligned tensor, or a skipped (found_inf) step
        for i in tl.static_range(ITERS):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            _update(p_ptr, g_ptr, pos_ptr, neg_ptr, odd, m_ptr, v_ptr, v_max_ptr, offs,
                    offs < numel, grad_factor, decay, b1_sq, one_minus_b1_sq, b2, one_minus_b2,
                    pos_coef, neg_coef, inv_noise_norm, eps, weight_decay, neg_step_size, bc2_sqrt,
                    DTYPE, ADAPTIVE, AMSGRAD, DECOUPLED, INTERPRETED)

    if COUNT_STEPS:
        # No second launch for the counters (host time, which decides small steps): each
        # program takes a ticket on blocks_done (zero between steps) once all its warps are
        # done, so once they have read their counter, and the program with the last ticket
        # increments every counter and re-zeroes blocks_done. A skipped step takes no ticket.
        tl.debug_barrier()
        go = True
        if HAS_FOUND_INF:
            go = tl.load(found_inf_ptr) == 0.0
        if go:
            ticket = tl.atomic_add(blocks_done_ptr, 1, sem="acq_rel")
            if ticket == tl.num_programs(0) - 1:
                for first in range(0, n_tensors, 256):
                    _increment_counters(step_table, first + tl.arange(0, 256), n_tensors)
                tl.store(blocks_done_ptr, 0)


@triton.jit
def _increment_counters(step_table, offs, n_tensors):
    mask = offs < n_tensors
    addr = tl.load(step_table + offs, mask=mask, other=0).to(tl.pointer_type(tl.float64))
    tl.store(addr, tl.load(addr, mask=mask) + 1.0, mask=mask)


@triton.jit
def _increment_steps_kernel(step_table, n_tensors, found_inf_ptr,
                            HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr):
    if HAS_FOUND_INF:
        n_tensors = tl.where(tl.load(found_inf_ptr) == 0.0, n_tensors, 0)
    _increment_counters(step_table, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), n_tensors)


@dataclass(frozen=True)
class LaunchConfig:
    block: int       # elements per program per iteration
    iters: int       # iterations per program: a chunk is block * iters elements
    num_warps: int


# Per GPU generation; the interpreter gets small chunks so tests cross chunk boundaries. The
# Hopper entries were chosen by benchmarks/experiments/tune_triton.py and confirmed with
# bench_step.py side by side on an H200 (docs/performance.md, "Triton launch configurations"):
# fp32 PNM's 8192 x 2 with 16 warps was within 1 % of the best tried, and stays the fastest
# measured although it runs at the 128-register cap and spills. fp64 takes it too (untuned).
_CONFIGS = {
    "interpreter": LaunchConfig(block=64, iters=2, num_warps=4),
    9: LaunchConfig(block=8192, iters=2, num_warps=16),
    8: LaunchConfig(block=1024, iters=16, num_warps=4),  # Ampere / Ada
}
# Per (generation, storage bytes, adaptive), ahead of the table above: 2-byte storage (bf16,
# fp16) gains 5-10 points of copy bandwidth with 32 warps; fp32 AdaPNM gains ~4 % with
# 4096 x 4 (docs/performance.md).
_PER_OPTIMIZER_CONFIGS = {
    (9, 2, False): LaunchConfig(block=16384, iters=2, num_warps=32),
    (9, 2, True): LaunchConfig(block=8192, iters=2, num_warps=32),
    (9, 4, True): LaunchConfig(block=4096, iters=4, num_warps=16),
}
_DEFAULT_CONFIG = LaunchConfig(block=1024, iters=16, num_warps=4)
_override = None


def set_launch_config(config=None) -> None:
    """Test/benchmark hook: a LaunchConfig for every launch, or a dict {(dtype, adaptive):
    LaunchConfig} for the launches it names (the others keep the table's); None resets."""
    global _override
    _override = config


def launch_config(device: torch.device, dtype: torch.dtype, adaptive: bool) -> LaunchConfig:
    if isinstance(_override, LaunchConfig):
        return _override
    if _override is not None and (dtype, adaptive) in _override:
        return _override[(dtype, adaptive)]
    if device.type != "cuda":
        return _CONFIGS["interpreter"]
    generation = torch.cuda.get_device_capability(device)[0]
    config = _PER_OPTIMIZER_CONFIGS.get((generation, dtype.itemsize, adaptive))
    return config or _CONFIGS.get(generation, _DEFAULT_CONFIG)




TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
