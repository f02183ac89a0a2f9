"""backend="fused": the compiled extension's ops (csrc/): the fused CPU kernel, the CUDA
kernels, or their CPU emulation (PNM_KERNELS_EMULATE_CUDA=1), each one pass over memory."""
from typing import Optional

import torch

from .._ops import extension_error
from ..hyper import Hyper
from .base import (Batch, HeldLists, Launch, Scaling, emulating, int8_parts, split_int8,
                   split_lr, step_lists)

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def unavailable_reason(device: torch.device, dtype: torch.dtype, own_state_dtype: bool = False,
                       int8: bool = False) -> Optional[str]:
    error = extension_error()
    if error is not None:
        return f"the compiled extension pnm_kernels._C could not be loaded ({error})"
    if dtype not in DTYPES:
        return f"the fused kernels take float32, float64, float16 and bfloat16, not {dtype}"
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        op = "pnm_int8_step_" if int8 else "pnm_state_step_" if own_state_dtype else "pnm_step_"
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"pnm_kernels::{op}", "CUDA"):
            return None
        return ("pnm_kernels._C was built without CUDA kernels (no nvcc at build time, or "
                "PNM_KERNELS_NO_CUDA=1); rebuild it where nvcc is available")
    return f"there are no fused kernels for {device.type} tensors"


def _held_step_args(hyper: Hyper, device: torch.device, scaling: Scaling) -> tuple:
    """The arguments of a StepLists step after its gradients, as the C++ methods take them."""
    lr, lr_tensor = split_lr(hyper.lr, device, keep_float64=True)
    h = hyper
    if h.adaptive:
        return (emulating(device), lr, h.beta1, h.beta2, h.beta0, h.eps, h.weight_decay,
                h.amsgrad, h.decoupled, h.maximize, lr_tensor, scaling.grad_scale,
                scaling.found_inf)
    return (emulating(device), lr, h.beta1, h.beta0, h.weight_decay, h.decoupled, h.maximize,
            lr_tensor, scaling.grad_scale, scaling.found_inf)


class FusedBackend:
    name = "fused"
    flat = True
    holds_lists = True
    reads_host = False

    def step(self, batch: Batch, hyper: Hyper, scaling: Scaling) -> None:
        device = batch.params[0].device
        own_state = batch.scales or hyper.in_float32(batch.params[0].dtype)
        if own_state and batch.held is not None and not torch.compiler.is_compiling():
            # As below for a float32 batch: a cached batch of state in a dtype of its own
            # (confirmed by BatchCache) steps from the C++ copies of its lists.
            args = (*_held_step_args(hyper, device, scaling), hyper.bf16_stochastic_round)
            for indices, lists in _state_lists(batch, hyper):
                grads = batch.grads if indices is None else [batch.grads[i] for i in indices]
                (lists.adapnm_step if hyper.adaptive else lists.pnm_step)(grads, *args)
            return
        if batch.scales:
            _int8_step(batch, hyper, scaling)
            return
        if own_state:
            _state_step(batch, hyper, scaling)
            return
        if batch.held is not None and not torch.compiler.is_compiling():
            # Eager steps of a cached batch: parameters, buffers and counters were handed to
            # C++ once, and only the gradients cross over from Python. With thousands of small
            # tensors, converting the lists was most of a step's host time.
            lists = step_lists(batch)
            args = _held_step_args(hyper, device, scaling)
            (lists.adapnm_step if hyper.adaptive else lists.pnm_step)(batch.grads, *args)
            return
        lr, lr_tensor = split_lr(hyper.lr, device, keep_float64=True)
        ops = torch.ops.pnm_kernels
        emulate = emulating(device)
        common = dict(lr=lr, beta1=hyper.beta1, beta0=hyper.beta0,
                      weight_decay=hyper.weight_decay, decoupled=hyper.decoupled,
                      maximize=hyper.maximize, lr_tensor=lr_tensor,
                      grad_scale=scaling.grad_scale, found_inf=scaling.found_inf)
        if hyper.adaptive:
            op = ops.emulated_cuda_adapnm_step_ if emulate else ops.adapnm_step_
            max_exp_avg_sq = batch.buffers[3] if hyper.amsgrad else []
            # [] after the counters: no ticket counter (blocks_done), so the counters step in a
            # launch of their own
            op(batch.params, batch.grads, batch.buffers[0], batch.buffers[1], batch.buffers[2],
               max_exp_avg_sq, batch.steps, [], beta2=hyper.beta2, eps=hyper.eps,
               amsgrad=hyper.amsgrad, **common)
        else:
            op = ops.emulated_cuda_pnm_step_ if emulate else ops.pnm_step_
            op(batch.params, batch.grads, batch.buffers[0], batch.buffers[1], batch.steps, [],
               **common)

    def prepare_repeat(self, held: HeldLists, device: torch.device, dtype: torch.dtype,
                       hyper: Hyper, use_taken: bool) -> Optional[Launch]:
        # The C++ step reads the gradients and checks every list itself (before writing
        # anything), so there is nothing to prepare: the launch declines when it cannot step.
        lists = held.step_lists
        step = lists.adapnm_step_own_grads if hyper.adaptive else lists.pnm_step_own_grads

        def launch(scaling: Scaling) -> bool:
            return step(use_taken, *_held_step_args(hyper, device, scaling))
        return launch


def _state_lists(batch: Batch, hyper: Hyper) -> list:
    """The C++ copies (StateLists) of a cached batch of state in a dtype of its own, made on
    first use, as [(indices into the batch or None for all of it, lists)] in the order they
    step: an int8 batch's short rows (bfloat16 state) first, then its codes, as _int8_step."""
    assert batch.held is not None
    key = (hyper.adaptive, hyper.amsgrad)  # which buffers and scales the kernels take
    made = batch.held.state_lists.get(key)
    if made is None:
        if batch.scales:
            coded, rest = int8_parts(batch)
            parts = [(rest, False), (coded, True)]
        else:
            parts = [(list(range(len(batch.params))), False)]
        made = []
        for indices, int8 in parts:
            if not indices:
                continue
            take = lambda items: [items[i] for i in indices]  # noqa: E731
            buffers = [take(b) for b in batch.buffers[:hyper.num_buffers]]
            buffers += [[]] * (4 - len(buffers))  # PNM's two; AdaPNM's three without AMSGrad
            scales = ([s for slot in batch.scales[:hyper.num_buffers] for s in take(slot)]
                      if int8 else [])
            lists = torch.classes.pnm_kernels.StateLists(  # no seeds: nothing rounds randomly
                take(batch.params), *buffers, take(batch.steps),
                take(batch.seeds) if batch.seeds else [],
                take(batch.offsets) if batch.offsets else [], scales, int8)
            made.append((None if len(indices) == len(batch.params) else indices, lists))
        batch.held.state_lists[key] = made
    return made


def _int8_step(batch: Batch, hyper: Hyper, scaling: Scaling) -> None:
    """int8 state (csrc/cpu_int8_kernel.cpp, csrc/int8_block.h on CUDA or emulated): the
    parameters with codes in one call, those whose rows are too short for a block (bfloat16
    state) in the state kernel's."""
    part, rest = split_int8(batch)
    if rest is not None:
        _state_step(rest, hyper, scaling)
    if part is None:
        return
    lr, lr_tensor = split_lr(hyper.lr, part.params[0].device, keep_float64=True)
    common = dict(lr=lr, beta1=hyper.beta1, beta0=hyper.beta0, weight_decay=hyper.weight_decay,
                  decoupled=hyper.decoupled, maximize=hyper.maximize, lr_tensor=lr_tensor,
                  grad_scale=scaling.grad_scale, found_inf=scaling.found_inf,
                  bf16_stochastic_round=hyper.bf16_stochastic_round)
    scales = [s for slot in part.scales[:hyper.num_buffers] for s in slot]  # buffer after buffer
    ops = torch.ops.pnm_kernels
    emulate = emulating(part.params[0].device)
    if hyper.adaptive:
        max_exp_avg_sq = part.buffers[3] if hyper.amsgrad else []
        op = ops.emulated_cuda_adapnm_int8_step_ if emulate else ops.adapnm_int8_step_
        op(part.params, part.grads, part.buffers[0], part.buffers[1], part.buffers[2],
           max_exp_avg_sq, part.steps, part.seeds, part.offsets, scales, beta2=hyper.beta2,
           eps=hyper.eps, amsgrad=hyper.amsgrad, **common)
    else:
        op = ops.emulated_cuda_pnm_int8_step_ if emulate else ops.pnm_int8_step_
        op(part.params, part.grads, part.buffers[0], part.buffers[1], part.steps, part.seeds,
           part.offsets, scales, **common)


def _state_step(batch: Batch, hyper: Hyper, scaling: Scaling) -> None:
    """The kernels for state in a dtype of its own (csrc/cpu_state_kernel.cpp on the CPU,
    csrc/state_block.h on CUDA or emulated). Their lists are cached (BatchCache) and held in
    C++ (StateLists), confirmed before each step, not repeated (docs/design.md §5)."""
    device = batch.params[0].device
    lr, lr_tensor = split_lr(hyper.lr, device, keep_float64=True)
    ops = torch.ops.pnm_kernels
    emulate = emulating(device)
    common = dict(lr=lr, beta1=hyper.beta1, beta0=hyper.beta0, weight_decay=hyper.weight_decay,
                  decoupled=hyper.decoupled, maximize=hyper.maximize, lr_tensor=lr_tensor,
                  grad_scale=scaling.grad_scale, found_inf=scaling.found_inf,
                  bf16_stochastic_round=hyper.bf16_stochastic_round)
    if hyper.adaptive:
        max_exp_avg_sq = batch.buffers[3] if hyper.amsgrad else []
        op = ops.emulated_cuda_adapnm_state_step_ if emulate else ops.adapnm_state_step_
        op(batch.params, batch.grads, batch.buffers[0], batch.buffers[1], batch.buffers[2],
           max_exp_avg_sq, batch.steps, batch.seeds, batch.offsets, beta2=hyper.beta2,
           eps=hyper.eps, amsgrad=hyper.amsgrad, **common)
    else:
        op = ops.emulated_cuda_pnm_state_step_ if emulate else ops.pnm_state_step_
        op(batch.params, batch.grads, batch.buffers[0], batch.buffers[1], batch.steps,
           batch.seeds, batch.offsets, **common)
