"""Pure-PyTorch reference of PNM and AdaPNM (docs/design.md §1): per parameter, obviously
correct.

This is the ground truth every faster backend is compared with. It follows the authors' code
operation by operation, with docs/design.md's three deliberate differences: L2 weight decay
never writes into ``p.grad``, ``maximize`` exists, and complex parameters are passed in as real
views.

State in a dtype of its own (``state_dtype``) and bfloat16 parameters rounded stochastically
(``bf16_stochastic_round``), docs/design.md §7: the step runs in float32 on float32 copies of
the parameter, gradient and buffers, exactly as with float32 state; then each buffer is
written back in its dtype and the parameter in its own, every bfloat16 the step writes with
stochastic rounding (bits from pnm_kernels/rounding.py), other dtypes to nearest.
"""
import math

import torch

from . import quantization
from .rounding import (HASH_SHIFT, PARAM_SHIFT, element_index, random_bits,
                       round_bf16_stochastic, store_stochastic)


def noise_norm(beta0: float) -> float:
    """The factor PNM's enlarged gradient noise is divided by: sqrt((1+b0)^2 + b0^2)."""
    return math.sqrt((1 + beta0) ** 2 + beta0**2)


def _advance_step(state: dict) -> int:
    state["step"] += 1
    return int(state["step"].item())


def _decay_and_grad(param, grad, lr, weight_decay, decoupled, maximize, grad_scale):
    if grad_scale is not None:
        grad = grad / grad_scale
    if maximize:
        grad = -grad
    if decoupled:
        param.mul_(1 - lr * weight_decay)
    else:
        grad = grad.add(param, alpha=weight_decay)  # a new tensor: p.grad stays as it was
    return grad


def _this_and_other(state: dict, t: int, positive: str, negative: str):
    """Odd steps update the positive buffer, even steps the negative one."""
    if t % 2 == 1:
        return state[positive], state[negative]
    return state[negative], state[positive]


def _pn_momentum(m, m_other, beta0):
    return m.mul(1 + beta0).add_(m_other, alpha=-beta0).mul_(1 / noise_norm(beta0))


def _in_float32(step, param, grad, state, names, offset, bf16_stochastic_round, **hyper):
    """One step with the state in its own dtype (bfloat16, or float32 beside 16-bit
    parameters): computed in float32, then written back (see the module's docstring)."""
    work = {key: (_load(state, key) if key in names else value) for key, value in state.items()}
    param32 = param.float()  # param itself where it is float32
    step(param32, grad.float(), work, **hyper)
    t = int(state["step"].item())  # advanced through work, which holds the same counter
    unchanged = names[1] if t % 2 == 1 else names[0]  # the momentum this step only read
    for name in names:
        if quantization.scale_name(name) in state:  # int8 codes (quantization.py)
            if name == unchanged:  # keeps its codes (bfloat16 rounds to itself anyway)
                continue
            codes = state[name]
            bits = random_bits(int(state["seed"].item()), t, HASH_SHIFT[name],
                               element_index(codes, offset))
            new_codes, scales = quantization.quantize(work[name], bits, quantization.SIGNED[name])
            codes.copy_(new_codes)
            state[quantization.scale_name(name)].copy_(scales)
        elif state[name].dtype == torch.bfloat16:
            store_stochastic(state[name], work[name], seed=int(state["seed"].item()), step=t,
                             shift=HASH_SHIFT[name], offset=offset)
        elif work[name] is not state[name]:
            state[name].copy_(work[name])
    if bf16_stochastic_round and param.dtype == torch.bfloat16:
        # The parameter's bits are indexed as its first buffer's elements: in its own layout
        # beside bfloat16 or float32 state, row-major beside int8 codes (their blocks' order).
        bits = random_bits(int(state["seed"].item()), t, PARAM_SHIFT,
                           element_index(state[names[0]], offset))
        param.copy_(round_bf16_stochastic(param32, bits))
    elif param32 is not param:
        param.copy_(param32)


def _load(state, name):
    """A buffer's values in float32 (int8 codes decoded with their scales)."""
    scales = state.get(quantization.scale_name(name))
    if scales is None:
        return state[name].float()
    return quantization.dequantize(state[name], scales, quantization.SIGNED[name])


def _state_names(state, adaptive):
    names = ["exp_avg", "neg_exp_avg", "exp_avg_sq", "max_exp_avg_sq"] if adaptive else [
        "pos_momentum", "neg_momentum"]
    return [name for name in names if name in state]


def compressed_state(state_dtype, param_dtype: torch.dtype) -> bool:
    """Whether a parameter's state is kept in a dtype of its own: int8 or bfloat16 (always
    with stochastic rounding, even beside bfloat16 parameters) or float32 beside 16-bit
    ones."""
    return state_dtype is not None and (state_dtype in (torch.bfloat16, torch.int8)
                                        or state_dtype != param_dtype)


def steps_in_float32(state_dtype, bf16_stochastic_round: bool, param_dtype: torch.dtype) -> bool:
    """Whether a parameter steps in float32 with its own rounding: its state in a dtype of its
    own, or a bfloat16 parameter rounded stochastically."""
    return compressed_state(state_dtype, param_dtype) or (
        bf16_stochastic_round and param_dtype == torch.bfloat16)


def needs_seed(state_dtype, bf16_stochastic_round: bool, param_dtype: torch.dtype) -> bool:
    """Whether a parameter's step draws random bits (writes some bfloat16 stochastically)."""
    return steps_in_float32(state_dtype, bf16_stochastic_round, param_dtype) and (
        (state_dtype or param_dtype) in (torch.bfloat16, torch.int8)
        or (bf16_stochastic_round and param_dtype == torch.bfloat16))


@torch.no_grad()
def pnm_step(param, grad, state, *, lr, beta1, beta0, weight_decay, decoupled, maximize,
             grad_scale=None, state_dtype=None, bf16_stochastic_round=False, offset=0):
    """One PNM step (paper's Algorithm 2). ``state``: step, pos_momentum, neg_momentum (and
    seed, where a bfloat16 is written stochastically). ``offset``: the elements of the whole
    parameter before this shard (their index picks the random bits)."""
    if steps_in_float32(state_dtype, bf16_stochastic_round, param.dtype):
        _in_float32(pnm_step, param, grad, state, _state_names(state, False), offset,
                    bf16_stochastic_round, lr=lr,
                    beta1=beta1, beta0=beta0, weight_decay=weight_decay, decoupled=decoupled,
                    maximize=maximize, grad_scale=grad_scale)
        return
    t = _advance_step(state)
    grad = _decay_and_grad(param, grad, lr, weight_decay, decoupled, maximize, grad_scale)
    m, m_other = _this_and_other(state, t, "pos_momentum", "neg_momentum")
    m.mul_(beta1**2).add_(grad, alpha=1 - beta1**2)
    param.add_(_pn_momentum(m, m_other, beta0), alpha=-lr)


@torch.no_grad()
def adapnm_step(param, grad, state, *, lr, beta1, beta2, beta0, eps, weight_decay, amsgrad,
                decoupled, maximize, grad_scale=None, state_dtype=None,
                bf16_stochastic_round=False, offset=0):
    """One AdaPNM step (paper's Algorithm 3).

    ``state``: step, exp_avg, neg_exp_avg, exp_avg_sq and, with amsgrad, max_exp_avg_sq (and
    seed, where a bfloat16 is written stochastically). ``offset``: as for pnm_step.
    """
    if steps_in_float32(state_dtype, bf16_stochastic_round, param.dtype):
        names = _state_names(state, True)
        if not amsgrad and "max_exp_avg_sq" in names:
            names.remove("max_exp_avg_sq")
        _in_float32(adapnm_step, param, grad, state, names, offset, bf16_stochastic_round,
                    lr=lr, beta1=beta1,
                    beta2=beta2, beta0=beta0, eps=eps, weight_decay=weight_decay,
                    amsgrad=amsgrad, decoupled=decoupled, maximize=maximize,
                    grad_scale=grad_scale)
        return
    t = _advance_step(state)
    grad = _decay_and_grad(param, grad, lr, weight_decay, decoupled, maximize, grad_scale)
    m, m_other = _this_and_other(state, t, "exp_avg", "neg_exp_avg")
    m.mul_(beta1**2).add_(grad, alpha=1 - beta1**2)
    exp_avg_sq = state["exp_avg_sq"]
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    if amsgrad:
        max_exp_avg_sq = state["max_exp_avg_sq"]
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (max_exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(_pn_momentum(m, m_other, beta0), denom, value=-lr / bias_correction1)
