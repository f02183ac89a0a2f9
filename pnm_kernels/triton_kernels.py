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
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from ._backends import capturing, new_blocks_done, split_lr, step_lists
from .reference import noise_norm


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
def _update(p_ptr, g_ptr, pos_ptr, neg_ptr, odd, m_ptr, v_ptr, v_max_ptr, offs, mask,
            grad_factor, decay, b1_sq, one_minus_b1_sq, b2, one_minus_b2, pos_coef, neg_coef,
            inv_noise_norm, eps, weight_decay, neg_step_size, bc2_sqrt, DTYPE: tl.constexpr,
            ADAPTIVE: tl.constexpr, AMSGRAD: tl.constexpr, DECOUPLED: tl.constexpr,
            INTERPRETED: tl.constexpr):
    """One block of elements (DESIGN.md §1); mask is None for a whole aligned block. Both
    momentum buffers are loaded by their fixed addresses and chosen by parity afterwards, so
    no load waits for the step counter; only the store goes to m_ptr (the one updated)."""
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * grad_factor
    pos_m = tl.load(pos_ptr + offs, mask=mask).to(tl.float32)
    neg_m = tl.load(neg_ptr + offs, mask=mask).to(tl.float32)
    m = tl.where(odd, pos_m, neg_m)
    m_other = tl.where(odd, neg_m, pos_m)
    if DECOUPLED:
        p = p * decay
    else:
        g = g + weight_decay * p
    m = b1_sq * m + one_minus_b1_sq * g
    pn_momentum = (pos_coef * m + neg_coef * m_other) * inv_noise_norm
    if ADAPTIVE:
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        v = b2 * v + one_minus_b2 * (g * g)
        second_moment = v
        if AMSGRAD:
            v_max = tl.load(v_max_ptr + offs, mask=mask).to(tl.float32)
            v_max = tl.where((v_max != v_max) | (v_max > v), v_max, v)  # NaN-propagating
            _store(v_max_ptr + offs, v_max, mask, DTYPE, INTERPRETED)
            second_moment = v_max
        _store(v_ptr + offs, v, mask, DTYPE, INTERPRETED)
        denom = tl.sqrt(second_moment) / bc2_sqrt + eps
        p = p + neg_step_size * (pn_momentum / denom)
    else:
        p = p + neg_step_size * pn_momentum
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
    step = tl.load(tl.load(step_table + t).to(tl.pointer_type(tl.float32))) + 1.0
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
    bc2_sqrt = 1.0
    neg_step_size = -lr
    if ADAPTIVE:
        v_ptr = tl.load(ptr_table + 4 * n_tensors + t).to(tl.pointer_type(DTYPE))
        # Bias corrections in float64: 1 - b2^t loses digits in float32 when b2 is near 1.
        step64 = step.to(tl.float64)
        bc1 = 1.0 - tl.exp(step64 * log_b1)
        bc2_sqrt = tl.sqrt(1.0 - tl.exp(step64 * log_b2)).to(tl.float32)
        neg_step_size = (-lr / bc1).to(tl.float32)  # float64: bc1 is float64
        if AMSGRAD:
            v_max_ptr = tl.load(ptr_table + 5 * n_tensors + t).to(tl.pointer_type(DTYPE))
    decay = 1.0 - lr * weight_decay

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
    addr = tl.load(step_table + offs, mask=mask, other=0).to(tl.pointer_type(tl.float32))
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


# Per GPU generation; the interpreter gets small chunks so tests cross chunk boundaries.
_CONFIGS = {
    "interpreter": LaunchConfig(block=64, iters=2, num_warps=4),
    # Hopper, fp32: benchmarks/tune_triton.py on an H200 (2026-11-26, 2^28 elements, two runs):
    # 8192 elements x 2 iterations with 16 warps was within 1 % of the best configuration tried
    # (PNM, AdaPNM); bench_step.py then measured 94-102 % of copy bandwidth from 2^26 elements
    # (results/gpu-h200-2026-11-26-run5). It runs at the 128-register cap of 16 warps and
    # spills (ptxas for sm_90a: 68 bytes a thread in PNM, ~630-710 in AdaPNM-AMSGrad), and was
    # still the fastest measured.
    9: LaunchConfig(block=8192, iters=2, num_warps=16),
    8: LaunchConfig(block=1024, iters=16, num_warps=4),  # Ampere / Ada
}
# Per (generation, storage bytes, adaptive), ahead of the table above.
# 2-byte storage (bf16, fp16) on Hopper, 32 warps. On an H200, bench_step.py run side by side
# with the fp32 configuration above (results/gpu-h200-2026-11-26-run6, each twice or more,
# bf16 at 2^26 / 2^28 / 2^30 elements): PNM 16384 x 2 reached 95 / 100 / 101 % of copy
# bandwidth against 85-90 / 92 / 93 %, AdaPNM 8192 x 2 reached 91 / 94 / 94 % against 83 / 86 /
# 87 %. fp16 was not measured; its loads and stores are those of bf16. Run 2 had chosen 16
# warps for every dtype, against an older kernel.
# fp32 AdaPNM on Hopper: 4096 x 4 with 16 warps, tune_triton.py's pick in run 7 (98 % of copy
# bandwidth at 2^26 and 2^28 against 94-95 % for 8192 x 2); bench_step.py in run 9 then gave
# 1.200 / 0.648 / 2.562 ms on gpt2-124m / flat64M / flat256M against 1.264 / 0.675-0.678 /
# 2.671-2.676 for 8192 x 2 in three runs (those sets vary by < 1 % from run to run). For PNM
# run 7 picked 8192 x 2 with 32 warps, which run 9 measured within 0.7 % of the 16 warps above.
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


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_TABLE_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_TABLE_CACHE_SIZE = 16


def _tables(lists, steps, device, chunk):
    """Device tables for these tensors, rebuilt only when an address or size changed."""
    numels = [t.numel() for t in lists[0]]
    ptrs = [t.data_ptr() for lst in lists for t in lst]
    step_ptrs = [s.data_ptr() for s in steps]
    key = (device, chunk, tuple(ptrs), tuple(step_ptrs), tuple(numels))
    try:  # one call each: an optimizer stepping in another thread may evict the key
        _TABLE_CACHE.move_to_end(key)
        return _TABLE_CACHE[key]
    except KeyError:
        pass
    tables = _TABLE_CACHE[key] = _build_tables(ptrs, step_ptrs, numels, device, chunk)
    if len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
        _TABLE_CACHE.popitem(last=False)
    return tables


def _held_tables(now, n, device, chunk, memo):
    """The tables of a batch held in C++ (a StepLists), from `now`, the addresses it read at
    once (see StepLists.pointers: reading them one by one from Python costs more host time
    than a whole step over thousands of small tensors). Kept in the batch's `memo`."""
    entries = memo.setdefault("triton_tables", [])
    for config, ptrs, tables in entries:
        if config == (device, chunk) and torch.equal(ptrs, now):
            return tables
    flat = now.tolist()  # pointers of every list, of the counters, then sizes
    tables = _build_tables(flat[:-2 * n], flat[-2 * n:-n], flat[-n:], device, chunk)
    if len(entries) >= 4:  # gradients at a few alternating addresses are common
        entries.pop(0)
    entries.append(((device, chunk), now, tables))
    return tables


def _build_tables(ptrs, step_ptrs, numels, device, chunk):
    if capturing(device):
        raise RuntimeError(
            "pnm_kernels (backend='triton'): the step's tensors are at addresses not seen "
            "before the CUDA graph capture, and their tables cannot be copied to the GPU "
            "inside a capture. Keep gradients between steps (zero_grad(set_to_none=False)) "
            "so the warm-up steps build the tables, or use backend='fused', whose tables "
            "travel as kernel arguments.")
    chunk_tensor, chunk_start = [], []
    for i, n in enumerate(numels):
        for s in range(0, n, chunk):
            chunk_tensor.append(i)
            chunk_start.append(s)
    as_device = lambda xs, dt: torch.tensor(xs, dtype=dt).to(device)  # noqa: E731
    aligned = all(ptr % 16 == 0 for ptr in ptrs)  # every tensor starts on 16 bytes
    return (as_device(ptrs, torch.int64), as_device(numels, torch.int64),
            as_device(step_ptrs, torch.int64), as_device(chunk_tensor, torch.int32),
            as_device(chunk_start, torch.int64), len(chunk_tensor), aligned)


def _blocks_done(memo, device):
    """The batch's ticket counter (new_blocks_done) for steps that increment their counters
    in the step launch; None where a step keeps the second launch: a batch without a memo,
    under torch.compile, or first stepped inside a CUDA-graph capture."""
    if memo is None or torch.compiler.is_compiling():
        return None
    if memo.get("triton_blocks_done") is None:
        memo["triton_blocks_done"] = new_blocks_done(device)
    return memo["triton_blocks_done"]


def _buffers_needed(adaptive, hp):
    return (4 if hp["amsgrad"] else 3) if adaptive else 2


def step(adaptive, batch, hp, grad_scale, found_inf):
    """One PNM/AdaPNM step over a batch of same-device, same-dtype dense tensors."""
    params = batch.params
    if not params:
        return
    device, dtype = params[0].device, params[0].dtype
    needed = _buffers_needed(adaptive, hp)
    lists = [params, batch.grads] + batch.buffers[:needed]
    # The kernels check nothing and read every list through one pointer table: a missing
    # list or entry would have them read past it (the fused op checks this itself).
    if len(lists) != 2 + needed or any(len(lst) != len(params) for lst in lists + [batch.steps]):
        raise RuntimeError(
            f"pnm_kernels (backend='triton'): a batch of {len(params)} params needs as many "
            f"gradients, step counters and {needed} lists of state buffers; got "
            f"{len(batch.grads)}, {len(batch.steps)} and {[len(b) for b in batch.buffers]}")
    config = launch_config(device, dtype, adaptive)
    chunk = config.block * config.iters
    held = None if torch.compiler.is_compiling() else step_lists(batch)
    if held is not None:
        tables = _held_tables(held.pointers(lists[1], needed), len(params), device, chunk,
                              batch.memo)
    else:
        tables = _tables(lists, batch.steps, device, chunk)
    _launch(adaptive, tables, config, device, dtype, hp, grad_scale, found_inf, batch.memo)
    # The kernels wrote through raw pointers: tell autograd, as torch's in-place ops do (C++
    # for a held batch: from Python it costs ~35 ns a tensor).
    if held is not None:
        held.bump_versions(needed)
    elif not torch.compiler.is_compiling():
        torch.autograd.graph.increment_version([*params, *sum(lists[2:], []), *batch.steps])


def prepare_own_grad_step(adaptive, lists, memo, device, dtype, hp, use_taken):
    """A repeated step of a batch held in C++ (a StepLists, `memo` its batch's) with its
    parameters' own gradients, read in C++ (or with use_taken, those its take_own_grads()
    took): returns launch(grad_scale, found_inf), or None, having done nothing, when it cannot
    take them (see StepLists.own_grad_pointers). Any tables needed are built here (which
    raises inside a CUDA-graph capture), so that a step over several batches can prepare
    them all before any launches."""
    needed = _buffers_needed(adaptive, hp)
    now = lists.own_grad_pointers(use_taken, needed)
    if now.numel() == 0:
        return None
    config = launch_config(device, dtype, adaptive)
    tables = _held_tables(now, now.numel() // (4 + needed), device, config.block * config.iters,
                          memo)

    def launch(grad_scale, found_inf):
        _launch(adaptive, tables, config, device, dtype, hp, grad_scale, found_inf, memo)
        lists.bump_versions(needed)
    return launch


def _launch(adaptive, tables, config, device, dtype, hp, grad_scale, found_inf, memo):
    """The step's launches over these tables: one, or two where there is no ticket counter
    (see _blocks_done; `memo` is the batch's)."""
    ptr_table, numels, step_table, chunk_tensor, chunk_start, n_chunks, aligned = tables
    n = numels.numel()
    amsgrad = adaptive and hp["amsgrad"]
    lr, lr_tensor = split_lr(hp["lr"], device)
    if lr_tensor is not None and lr_tensor.device != device:  # a CPU lr: read it, no sync
        lr, lr_tensor = float(lr_tensor), None
    beta1, beta0 = hp["beta1"], hp["beta0"]
    beta2 = hp.get("beta2", 0.0)
    log = lambda b: math.log(b) if b > 0 else -math.inf  # noqa: E731
    dummy = step_table  # stands in for absent optional pointers (never read)
    # An all-empty batch gets no ticket counter: only the counters' launch runs.
    blocks_done = _blocks_done(memo, device) if n_chunks else None
    if n_chunks:
        _step_kernel[(n_chunks,)](
            ptr_table, numels, step_table, chunk_tensor, chunk_start, n,
            float(lr), lr_tensor if lr_tensor is not None else dummy,
            grad_scale if grad_scale is not None else dummy,
            found_inf if found_inf is not None else dummy,
            blocks_done if blocks_done is not None else dummy,
            beta1**2, 1 - beta1**2, beta2, 1 - beta2, log(beta1), log(beta2),
            1 + beta0, -beta0, 1 / noise_norm(beta0), hp.get("eps", 0.0), hp["weight_decay"],
            -1.0 if hp["maximize"] else 1.0,
            DTYPE=_TL_DTYPES[dtype], ADAPTIVE=adaptive, AMSGRAD=amsgrad,
            DECOUPLED=hp["decoupled"], HAS_LR_TENSOR=lr_tensor is not None,
            HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
            BLOCK=config.block, ITERS=config.iters, ALIGNED=aligned,
            COUNT_STEPS=blocks_done is not None, INTERPRETED=device.type == "cpu",
            num_warps=config.num_warps)
    if blocks_done is None:
        block = 256
        # (n + block - 1) // block, not triton.cdiv: a JIT function, ~4 us a call from Python
        _increment_steps_kernel[((n + block - 1) // block,)](
            step_table, n, found_inf if found_inf is not None else dummy,
            HAS_FOUND_INF=found_inf is not None, BLOCK=block)
