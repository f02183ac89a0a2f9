"""backend="triton": the host side of the Triton step (triton_kernels.py holds the kernels).

Device tables hold every tensor's data pointer, its numel and its step counter's address;
they are cached under the tensors' addresses and sizes (a held batch: in its HeldLists), so a
training loop whose tensors stay put uploads nothing after its first step. The kernels check
nothing: every list is confirmed to fit its parameter before its pointers enter a table
(held_lists_ok, StepLists.own_grad_pointers)."""
import os
from typing import Optional

import torch

from ..hyper import Hyper, coefficients
from . import triton_state
from .base import (Batch, HeldLists, Launch, Scaling, dispatch_mode_active, new_blocks_done,
                   show_writes, split_lr, step_lists)
from .triton_tables import as_device, cached, chunk_map, refuse_in_capture

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    if dtype not in DTYPES:
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


def _tables(lists, steps, device, chunk):
    """Device tables for these tensors, rebuilt only when an address or size changed."""
    numels = [t.numel() for t in lists[0]]
    ptrs = [t.data_ptr() for lst in lists for t in lst]
    step_ptrs = [s.data_ptr() for s in steps]
    key = ("step", device, chunk, tuple(ptrs), tuple(step_ptrs), tuple(numels))
    return cached(key, device, lambda: _build_tables(ptrs, step_ptrs, numels, device, chunk))


def _held_tables(now, n, device, chunk, held: HeldLists):
    """The tables of a batch held in C++ (a StepLists), from `now`, the addresses it read at
    once (see StepLists.pointers: reading them one by one from Python costs more host time
    than a whole step over thousands of small tensors)."""
    entries = held.triton_tables
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
    refuse_in_capture(device)
    chunk_tensor, chunk_start = chunk_map(numels, chunk)
    aligned = all(ptr % 16 == 0 for ptr in ptrs)  # every tensor starts on 16 bytes
    return (as_device(ptrs, torch.int64, device), as_device(numels, torch.int64, device),
            as_device(step_ptrs, torch.int64, device), as_device(chunk_tensor, torch.int32, device),
            as_device(chunk_start, torch.int64, device), len(chunk_tensor), aligned)


def _blocks_done(held: Optional[HeldLists], device):
    """The batch's ticket counter (new_blocks_done) for steps that increment their counters
    in the step launch; None where a step keeps the second launch: a batch that is not held,
    under torch.compile, or first stepped inside a CUDA-graph capture."""
    if held is None or torch.compiler.is_compiling():
        return None
    if held.triton_blocks_done is None:
        held.triton_blocks_done = new_blocks_done(device)
    return held.triton_blocks_done


class TritonBackend:
    name = "triton"
    flat = True
    holds_lists = True
    reads_host = False

    def step(self, batch: Batch, hyper: Hyper, scaling: Scaling) -> None:
        """One step over a batch of same-device, same-dtype dense tensors."""
        from .triton_kernels import launch_config

        params = batch.params
        if not params:
            return
        if batch.scales:  # int8 state
            triton_state.int8_step(batch, hyper, scaling)
            return
        if hyper.in_float32(params[0].dtype):  # state in a dtype of its own
            triton_state.state_step(batch, hyper, scaling)
            return
        device, dtype = params[0].device, params[0].dtype
        needed = hyper.num_buffers
        lists = [params, batch.grads] + batch.buffers[:needed]
        # The kernels check nothing and read every list through one pointer table: a missing
        # list or entry would have them read past it (the fused op checks this itself).
        if (len(lists) != 2 + needed
                or any(len(lst) != len(params) for lst in lists + [batch.steps])):
            raise RuntimeError(
                f"pnm_kernels (backend='triton'): a batch of {len(params)} params needs as "
                f"many gradients, step counters and {needed} lists of state buffers; got "
                f"{len(batch.grads)}, {len(batch.steps)} and {[len(b) for b in batch.buffers]}")
        config = launch_config(device, dtype, hyper.adaptive)
        chunk = config.block * config.iters
        held = None if torch.compiler.is_compiling() else step_lists(batch)
        if held is not None and batch.held is not None:
            tables = _held_tables(held.pointers(lists[1], needed), len(params), device, chunk,
                                  batch.held)
        else:
            tables = _tables(lists, batch.steps, device, chunk)
        show_writes([*params, *sum(lists[2:], []), *batch.steps])
        _launch(tables, config, device, dtype, hyper, scaling, batch.held)
        # The kernels wrote through raw pointers: tell autograd, as torch's in-place ops do
        # (C++ for a held batch: from Python it costs ~35 ns a tensor).
        if held is not None:
            held.bump_versions(needed)
        elif not torch.compiler.is_compiling():
            torch.autograd.graph.increment_version(
                [*params, *sum(lists[2:], []), *batch.steps])

    def prepare_repeat(self, held: HeldLists, device: torch.device, dtype: torch.dtype,
                       hyper: Hyper, use_taken: bool) -> Optional[Launch]:
        """Tables are built here (which raises inside a CUDA-graph capture), so that a step
        over several batches prepares them all before any launches."""
        from .triton_kernels import launch_config

        if dispatch_mode_active():
            return None  # the planned step shows a dispatch mode what it writes (show_writes)
        lists = held.step_lists
        needed = hyper.num_buffers
        now = lists.own_grad_pointers(use_taken, needed)
        if now.numel() == 0:
            return None
        config = launch_config(device, dtype, hyper.adaptive)
        tables = _held_tables(now, now.numel() // (4 + needed), device,
                              config.block * config.iters, held)

        def launch(scaling: Scaling) -> bool:
            _launch(tables, config, device, dtype, hyper, scaling, held)
            lists.bump_versions(needed)
            return True
        return launch


def _launch(tables, config, device, dtype, hyper: Hyper, scaling: Scaling,
            held: Optional[HeldLists]):
    """The step's launches over these tables: one, or two where there is no ticket counter
    (see _blocks_done)."""
    from .triton_kernels import TL_DTYPES, _increment_steps_kernel, _step_kernel

    ptr_table, numels, step_table, chunk_tensor, chunk_start, n_chunks, aligned = tables
    n = numels.numel()
    c = coefficients(hyper)
    grad_scale, found_inf = scaling.grad_scale, scaling.found_inf
    lr, lr_tensor = split_lr(hyper.lr, device)
    if lr_tensor is not None and lr_tensor.device != device:  # a CPU lr: read it, no sync
        lr, lr_tensor = float(lr_tensor), None
    dummy = step_table  # stands in for absent optional pointers (never read)
    # An all-empty batch gets no ticket counter: only the counters' launch runs.
    blocks_done = _blocks_done(held, device) if n_chunks else None
    if n_chunks:
        _step_kernel[(n_chunks,)](
            ptr_table, numels, step_table, chunk_tensor, chunk_start, n,
            float(lr), lr_tensor if lr_tensor is not None else dummy,
            grad_scale if grad_scale is not None else dummy,
            found_inf if found_inf is not None else dummy,
            blocks_done if blocks_done is not None else dummy,
            c.b1_sq, c.one_minus_b1_sq, c.b2, c.one_minus_b2, c.log_b1, c.log_b2,
            c.pos_coef, c.neg_coef, c.inv_noise_norm, hyper.eps, hyper.weight_decay,
            c.grad_sign,
            DTYPE=TL_DTYPES[dtype], ADAPTIVE=hyper.adaptive,
            AMSGRAD=hyper.adaptive and hyper.amsgrad, DECOUPLED=hyper.decoupled,
            HAS_LR_TENSOR=lr_tensor is not None, HAS_GRAD_SCALE=grad_scale is not None,
            HAS_FOUND_INF=found_inf is not None, BLOCK=config.block, ITERS=config.iters,
            ALIGNED=aligned, COUNT_STEPS=blocks_done is not None,
            INTERPRETED=device.type == "cpu", num_warps=config.num_warps)
    if blocks_done is None:
        block = 256
        # (n + block - 1) // block, not triton.cdiv: a JIT function, ~4 us a call from Python
        _increment_steps_kernel[((n + block - 1) // block,)](
            step_table, n, found_inf if found_inf is not None else dummy,
            HAS_FOUND_INF=found_inf is not None, BLOCK=block)
