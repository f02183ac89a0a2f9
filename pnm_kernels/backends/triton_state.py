"""backend="triton" for state in a dtype of its own (docs/design.md §7) and int8 state (§8):
the host side of triton_state_kernels.py. Tables as triton.py's, cached under the tensors'
addresses, sizes, seeds' addresses and offsets; such batches are cached in Python (the fused
backend also holds them in C++). The kernels check nothing: the optimizer made every buffer, seed and
scale tensor to fit its parameter (state.py), a cached batch's tensors are confirmed to be
laid out as then before each step (BatchCache, HeldLayouts), and the lists' lengths here."""
import torch

from ..hyper import Hyper, coefficients
from ..quantization import blocks_per_row, row_length_of
from .base import Batch, Scaling, show_writes, split_int8, split_lr
from .triton_tables import as_device, cached, chunk_map

INT8_BLOCKS = {"interpreter": 8, "gpu": 16}  # quantisation blocks a program (tests cross them)


def _common_tables(device, lists, batch: Batch, counts, chunk, extra=()):
    """Device tables: list pointers (list after list), counts, counters' and seeds' addresses
    (0 where there is no seed), offsets, the chunk map; cached. `extra`: more int64 tables,
    as lists of values, cached with them."""
    ptrs = [t.data_ptr() for lst in lists for t in lst]
    steps = [s.data_ptr() for s in batch.steps]
    seeds = [s.data_ptr() for s in batch.seeds] or [0] * len(counts)
    offsets = list(batch.offsets) or [0] * len(counts)
    key = ("state", device, chunk, tuple(ptrs), tuple(steps), tuple(seeds), tuple(offsets),
           tuple(counts), tuple(tuple(e) for e in extra))

    def build():
        chunk_tensor, chunk_start = chunk_map(counts, chunk)
        tables = [as_device(x, torch.int64, device)
                  for x in (ptrs, counts, steps, seeds, offsets, *extra)]
        return (*tables, as_device(chunk_tensor, torch.int32, device),
                as_device(chunk_start, torch.int64, device), len(chunk_tensor))
    return cached(key, device, build)


def _scalar_args(hyper: Hyper, device, scaling: Scaling, dummy):
    c = coefficients(hyper)
    lr, lr_tensor = split_lr(hyper.lr, device)
    if lr_tensor is not None and lr_tensor.device != device:  # a CPU lr: read it, no sync
        lr, lr_tensor = float(lr_tensor), None
    grad_scale, found_inf = scaling.grad_scale, scaling.found_inf
    args = (float(lr), dummy if lr_tensor is None else lr_tensor,
            dummy if grad_scale is None else grad_scale,
            dummy if found_inf is None else found_inf,
            c.b1_sq, c.one_minus_b1_sq, c.b2, c.one_minus_b2, c.log_b1, c.log_b2, c.pos_coef,
            c.neg_coef, c.inv_noise_norm, hyper.eps, hyper.weight_decay, c.grad_sign)
    flags = dict(ADAPTIVE=hyper.adaptive, AMSGRAD=hyper.adaptive and hyper.amsgrad,
                 DECOUPLED=hyper.decoupled, HAS_LR_TENSOR=lr_tensor is not None,
                 HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
                 INTERPRETED=device.type == "cpu")
    return args, flags


def _check_lists(batch: Batch, lists, needed: int, with_seeds: bool) -> None:
    n = len(batch.params)
    if (len(lists) != 2 + needed or any(len(lst) != n for lst in lists + [batch.steps])
            or (with_seeds and (len(batch.seeds) != n or len(batch.offsets) != n))):
        raise RuntimeError(
            f"pnm_kernels (backend='triton'): a batch of {n} params needs as many gradients, "
            f"step counters, seeds and {needed} lists of state buffers; got "
            f"{len(batch.grads)}, {len(batch.steps)}, {len(batch.seeds)} and "
            f"{[len(b) for b in batch.buffers]}")


def _param_sr(hyper: Hyper, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and hyper.bf16_stochastic_round


def _finish(batch: Batch, lists, tables, scaling: Scaling, extra_written=()):
    """The counters' launch, and the version bumps of what the kernel wrote."""
    from .triton_kernels import _increment_steps_kernel

    step_table = tables[2]
    n = len(batch.params)
    found_inf = scaling.found_inf
    block = 256
    _increment_steps_kernel[((n + block - 1) // block,)](
        step_table, n, step_table if found_inf is None else found_inf,
        HAS_FOUND_INF=found_inf is not None, BLOCK=block)
    if not torch.compiler.is_compiling():
        torch.autograd.graph.increment_version(
            [*batch.params, *sum(lists[2:], []), *batch.steps, *extra_written])


def state_step(batch: Batch, hyper: Hyper, scaling: Scaling) -> None:
    """bfloat16 state, float32 state of 16-bit parameters, or bfloat16 parameters rounded
    stochastically (triton_state_kernels._state_step_kernel)."""
    from .triton_kernels import TL_DTYPES, launch_config
    from .triton_state_kernels import _state_step_kernel

    params = batch.params
    device, dtype = params[0].device, params[0].dtype
    needed = hyper.num_buffers
    lists = [params, batch.grads] + batch.buffers[:needed]
    state_dtype = batch.buffers[0][0].dtype
    param_sr = _param_sr(hyper, dtype)
    _check_lists(batch, lists, needed, with_seeds=param_sr or state_dtype == torch.bfloat16)
    config = launch_config(device, dtype, hyper.adaptive)
    tables = _common_tables(device, lists, batch, [p.numel() for p in params],
                            config.block * config.iters)
    ptr_table, numels, step_table, seed_table, offsets, chunk_tensor, chunk_start, n_chunks = \
        tables
    args, flags = _scalar_args(hyper, device, scaling, step_table)
    show_writes([*params, *sum(lists[2:], []), *batch.steps])
    if n_chunks:
        _state_step_kernel[(n_chunks,)](
            ptr_table, numels, step_table, seed_table, offsets, chunk_tensor, chunk_start,
            len(params), *args, DTYPE=TL_DTYPES[dtype], STATE_DTYPE=TL_DTYPES[state_dtype],
            PARAM_SR=param_sr, BLOCK=config.block, ITERS=config.iters,
            num_warps=config.num_warps, enable_fp_fusion=False, **flags)
    _finish(batch, lists, tables, scaling)


def int8_step(batch: Batch, hyper: Hyper, scaling: Scaling) -> None:
    """int8 state (triton_state_kernels._int8_step_kernel): the parameters with codes; those
    whose rows are too short for a block keep bfloat16 state (state_step)."""
    from .triton_kernels import TL_DTYPES
    from .triton_state_kernels import _int8_step_kernel

    part, rest = split_int8(batch)
    if rest is not None:
        state_step(rest, hyper, scaling)
    if part is None:
        return
    params = part.params
    device, dtype = params[0].device, params[0].dtype
    needed = hyper.num_buffers
    lists = [params, part.grads] + part.buffers[:needed]
    _check_lists(part, lists, needed, with_seeds=True)
    scales = part.scales[:needed]
    if any(len(s) != len(params) for s in scales):
        raise RuntimeError(f"pnm_kernels (backend='triton'): {len(params)} params with int8 "
                           f"state need as many scales in each of {needed} lists")
    row_lengths = [row_length_of(p) for p in params]
    counts = [p.shape[0] * blocks_per_row(length) for p, length in zip(params, row_lengths)]
    blocks = INT8_BLOCKS["interpreter" if device.type == "cpu" else "gpu"]
    scale_ptrs = [s.data_ptr() for lst in scales for s in lst]
    tables = _common_tables(device, lists, part, counts, blocks, extra=(scale_ptrs, row_lengths))
    (ptr_table, numels, step_table, seed_table, offsets, scale_table, row_table, chunk_tensor,
     chunk_start, n_chunks) = tables
    args, flags = _scalar_args(hyper, device, scaling, step_table)
    show_writes([*params, *sum(lists[2:], []), *part.steps, *(s for lst in scales for s in lst)])
    if n_chunks:
        _int8_step_kernel[(n_chunks,)](
            ptr_table, scale_table, numels, row_table, step_table, seed_table, offsets,
            chunk_tensor, chunk_start, len(params), *args, DTYPE=TL_DTYPES[dtype],
            PARAM_SR=_param_sr(hyper, dtype), BLOCKS=blocks, num_warps=4,
            enable_fp_fusion=False, **flags)
    _finish(part, lists, tables, scaling, extra_written=[s for lst in scales for s in lst])
