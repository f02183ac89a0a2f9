"""Pure-PyTorch reference of PNM and AdaPNM (docs/design.md §1): per parameter, obviously
correct.

This is the ground truth every faster backend is compared with. It follows the authors' code
operation by operation, with docs/design.md's two deliberate differences: L2 weight decay never
writes into ``p.grad`` and ``maximize`` exists. Complex parameters are passed in as real views.
"""
import math

import torch


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


@torch.no_grad()
def pnm_step(param, grad, state, *, lr, beta1, beta0, weight_decay, decoupled, maximize,
             grad_scale=None):
    """One PNM step (paper's Algorithm 2). ``state``: step, pos_momentum, neg_momentum."""
    t = _advance_step(state)
    grad = _decay_and_grad(param, grad, lr, weight_decay, decoupled, maximize, grad_scale)
    m, m_other = _this_and_other(state, t, "pos_momentum", "neg_momentum")
    m.mul_(beta1**2).add_(grad, alpha=1 - beta1**2)
    param.add_(_pn_momentum(m, m_other, beta0), alpha=-lr)


@torch.no_grad()
def adapnm_step(param, grad, state, *, lr, beta1, beta2, beta0, eps, weight_decay, amsgrad,
                decoupled, maximize, grad_scale=None):
    """One AdaPNM step (paper's Algorithm 3).

    ``state``: step, exp_avg, neg_exp_avg, exp_avg_sq and, with amsgrad, max_exp_avg_sq.
    """
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
