"""backend="foreach": torch._foreach_* ops over the batch. Eager, each parameter's parity and
bias corrections are read on the host; under torch.compile the same maths is traced without
host reads (see _traced_step)."""
import math
from dataclasses import replace
from typing import Optional, Union

import torch

from .. import reference
from ..hyper import Hyper, coefficients
from ..quantization import SIGNED, dequantize, quantize
from ..rounding import (HASH_SHIFT, PARAM_SHIFT, bits_from_hash, element_hash, element_index,
                        round_bf16_stochastic)
from .base import ADAPNM_BUFFERS, PNM_BUFFERS, Batch, HeldLists, Launch, Scaling
from .reference import skip_step


class ForeachBackend:
    name = "foreach"
    flat = False
    holds_lists = False
    reads_host = True

    def step(self, batch: Batch, hyper: Hyper, scaling: Scaling) -> None:
        if hyper.in_float32(batch.params[0].dtype):
            _step_in_float32(self, batch, hyper, scaling)
            return
        if torch.compiler.is_compiling() and scaling.found_inf is None:
            _traced_step(batch, hyper, scaling.grad_scale)
            return
        if skip_step(scaling.found_inf):
            return
        c = coefficients(hyper)
        lr, wd = float(hyper.lr), hyper.weight_decay
        params = batch.params
        torch._foreach_add_(batch.steps, 1.0)
        if params[0].device.type == "meta":  # no values to compute: only the counters advance
            return
        steps = [int(s) for s in torch.stack(batch.steps).tolist()]
        grads: Union[list[torch.Tensor], tuple[torch.Tensor, ...]] = batch.grads
        if scaling.grad_scale is not None:
            grads = torch._foreach_div(grads, scaling.grad_scale)
        if hyper.maximize:
            grads = torch._foreach_neg(grads)
        decay = 1 - lr * wd
        if hyper.decoupled:
            if decay != 1:  # times exactly 1 changes no bit: a pass over params saved
                torch._foreach_mul_(params, decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=wd)
        pos, neg = batch.buffers[0], batch.buffers[1]
        m = [pos[i] if t % 2 == 1 else neg[i] for i, t in enumerate(steps)]
        m_other = [neg[i] if t % 2 == 1 else pos[i] for i, t in enumerate(steps)]
        torch._foreach_mul_(m, c.b1_sq)
        torch._foreach_add_(m, grads, alpha=c.one_minus_b1_sq)
        pn_momentum = torch._foreach_mul(m, c.pos_coef)
        torch._foreach_add_(pn_momentum, m_other, alpha=c.neg_coef)
        torch._foreach_mul_(pn_momentum, c.inv_noise_norm)
        if not hyper.adaptive:
            torch._foreach_add_(params, pn_momentum, alpha=-lr)
            return
        exp_avg_sq = batch.buffers[2]
        torch._foreach_mul_(exp_avg_sq, c.b2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=c.one_minus_b2)
        second_moment = exp_avg_sq
        if hyper.amsgrad:
            torch._foreach_maximum_(batch.buffers[3], exp_avg_sq)
            second_moment = batch.buffers[3]
        denom = torch._foreach_sqrt(second_moment)
        torch._foreach_div_(denom, [math.sqrt(1 - hyper.beta2**t) for t in steps])
        torch._foreach_add_(denom, hyper.eps)
        torch._foreach_addcdiv_(params, pn_momentum, denom,
                                [-lr / (1 - hyper.beta1**t) for t in steps])

    def prepare_repeat(self, held: HeldLists, device: torch.device, dtype: torch.dtype,
                       hyper: Hyper, use_taken: bool) -> Optional[Launch]:
        return None  # holds no lists


def _step_in_float32(backend, batch: Batch, hyper: Hyper, scaling: Scaling) -> None:
    """A step with the state in a dtype of its own (reference.py's semantics): the foreach
    step over float32 copies, then every buffer written back (bfloat16 ones with stochastic
    rounding: the buffer the step did not change rounds to itself) and the parameters in
    their dtype. Eager or traced alike: the random bits come from the counters as tensors."""
    if not torch.compiler.is_compiling() and skip_step(scaling.found_inf):
        return
    names = ADAPNM_BUFFERS if hyper.adaptive else PNM_BUFFERS  # the buffers' table order
    scales = batch.scales or [[None] * len(batch.params) for _ in batch.buffers]
    work = Batch(params=[p.float() for p in batch.params], grads=[g.float() for g in batch.grads],
                 buffers=[[b.float() if s is None else dequantize(b, s, SIGNED[name])
                           for b, s in zip(buffers, slot_scales)]
                          for name, buffers, slot_scales in zip(names, batch.buffers, scales)],
                 steps=batch.steps)
    backend.step(work, replace(hyper, state_dtype=None, bf16_stochastic_round=False), scaling)
    if batch.params[0].device.type == "meta":
        return
    for i, param in enumerate(batch.params):
        hashes = torch.empty(0, dtype=torch.int64)  # no bfloat16 write, no seed: not read
        if batch.seeds:  # where a bfloat16 is written stochastically (hyper.needs_seed)
            hashes = element_hash(batch.seeds[i], batch.steps[i].to(torch.int64),
                                  element_index(batch.buffers[0][i], batch.offsets[i]))
        if hyper.bf16_stochastic_round and param.dtype == torch.bfloat16:
            param.copy_(round_bf16_stochastic(work.params[i], bits_from_hash(hashes, PARAM_SHIFT)))
        elif work.params[i] is not param:
            param.copy_(work.params[i])
        for slot, (buffers, values) in enumerate(zip(batch.buffers, work.buffers)):
            buffer, value = buffers[i], values[i]
            if scales[slot][i] is not None:  # int8 codes (quantization.py)
                bits = bits_from_hash(hashes, HASH_SHIFT[names[slot]])
                codes, block_scales = quantize(value, bits, SIGNED[names[slot]])
                if slot < 2:  # the momentum this step only read keeps its codes
                    odd = torch.remainder(batch.steps[i], 2) == 1  # on the device: traceable
                    written = odd if slot == 0 else ~odd
                    codes = torch.where(written, codes, buffer)
                    block_scales = torch.where(written, block_scales, scales[slot][i])
                buffer.copy_(codes)
                scales[slot][i].copy_(block_scales)
            elif buffer.dtype == torch.bfloat16:
                shift = HASH_SHIFT[names[slot]]
                buffer.copy_(round_bf16_stochastic(value, bits_from_hash(hashes, shift)))
            elif value is not buffer:
                buffer.copy_(value)


def _traced_step(batch: Batch, hyper: Hyper, grad_scale):
    """The foreach maths as torch.compile traces it, without a graph break: each tensor's
    parity and bias corrections come from its step counter on the device (a torch.where
    between the buffers), not from the host. It serves what runs neither fused nor Triton
    under torch.compile: backend="foreach", float64 parameters without the extension, and
    Triton batches of an install without it. Both buffers are rewritten (one with its own
    values), which inductor fuses into the step's one pass. With found_inf (AMP) the eager
    path runs instead, reading it on the host."""
    c = coefficients(hyper)
    lr = hyper.lr
    torch._foreach_add_(batch.steps, 1.0)
    for i, (param, grad, step) in enumerate(zip(batch.params, batch.grads, batch.steps)):
        grad = reference._decay_and_grad(param, grad, lr, hyper.weight_decay, hyper.decoupled,
                                         hyper.maximize, grad_scale)
        pos, neg = batch.buffers[0][i], batch.buffers[1][i]
        odd = torch.remainder(step, 2) == 1
        m_other = torch.where(odd, neg, pos)
        m = torch.where(odd, pos, neg).mul(c.b1_sq).add_(grad, alpha=c.one_minus_b1_sq)
        pos.copy_(torch.where(odd, m, pos))
        neg.copy_(torch.where(odd, neg, m))
        update = m.mul(c.pos_coef).add_(m_other, alpha=c.neg_coef).mul_(c.inv_noise_norm)
        if not hyper.adaptive:
            param.sub_(update * lr)
            continue
        exp_avg_sq = batch.buffers[2][i]
        exp_avg_sq.mul_(c.b2).addcmul_(grad, grad, value=c.one_minus_b2)
        second_moment = exp_avg_sq
        if hyper.amsgrad:
            second_moment = batch.buffers[3][i]
            # Not out=: dynamo takes no out= tensor that is not contiguous (a transposed one).
            second_moment.copy_(torch.maximum(second_moment, exp_avg_sq))
        # In float64, as the reference's Python floats; applied in at least float32.
        t = step.to(torch.float64)
        scalar_dtype = torch.promote_types(param.dtype, torch.float32)
        bias_correction2_sqrt = (1 - hyper.beta2**t).sqrt().to(scalar_dtype)
        step_size = (lr / (1 - hyper.beta1**t)).to(scalar_dtype)
        denom = (second_moment.sqrt() / bias_correction2_sqrt).add_(hyper.eps)
        param.sub_(update / denom * step_size)
