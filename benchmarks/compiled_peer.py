"""PNM and AdaPNM as a user could write them instead of using fused kernels: docs/design.md §1 in
torch._foreach ops over the whole group, compiled by torch.compile into one graph per step.

A peer for bench_step.py, checked against the reference in tests/test_bench_step.py. It is
deliberately small: every parameter of the optimizer steps together (one host-side parity
picks which momentum buffer is updated; the compiled graph takes the two lists in either
order), no weight decay, no maximize, no AMP arguments, one param group.
"""
import torch

from pnm_kernels.reference import noise_norm


def _pn_update(m, m_other, grads, beta1, beta0):
    """Updates m in place; returns the positive-negative momentum over its noise norm."""
    torch._foreach_mul_(m, beta1**2)
    torch._foreach_add_(m, grads, alpha=1 - beta1**2)
    norm = noise_norm(beta0)
    update = torch._foreach_mul(m, (1 + beta0) / norm)
    torch._foreach_add_(update, m_other, alpha=-beta0 / norm)
    return update


def _pnm_step(params, grads, m, m_other, lr, beta1, beta0):
    torch._foreach_add_(params, _pn_update(m, m_other, grads, beta1, beta0), alpha=-lr)


def _adapnm_step(params, grads, m, m_other, v, v_max, step, lr, beta1, beta2, beta0, eps):
    """``step``: a 0-dim tensor, advanced here, so the bias corrections never recompile."""
    step.add_(1)
    update = _pn_update(m, m_other, grads, beta1, beta0)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    torch._foreach_maximum_(v_max, v)
    denom = torch._foreach_sqrt(v_max)
    torch._foreach_div_(denom, torch.sqrt(1 - beta2**step))
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(update, denom)
    torch._foreach_mul_(update, -lr / (1 - beta1**step))
    torch._foreach_add_(params, update)


class _CompiledPeer(torch.optim.Optimizer):
    buffers: tuple = ()

    def __init__(self, params, defaults, compile_backend="inductor"):
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError(f"{type(self).__name__} takes one param group")
        self._steps_taken = 0  # on the host: the parity needs no device read
        self._update = torch.compile(self._maths, backend=compile_backend)

    @torch.no_grad()
    def step(self):
        params = self.param_groups[0]["params"]
        for p in params:
            if p.grad is None:
                raise ValueError(f"{type(self).__name__} steps every parameter: one has no grad")
            if not self.state[p]:
                self.state[p].update({name: torch.zeros_like(p) for name in self.buffers})
        self._steps_taken += 1
        lists = [[self.state[p][name] for p in params] for name in self.buffers]
        if self._steps_taken % 2 == 0:  # even steps update the negative buffer
            lists[0], lists[1] = lists[1], lists[0]
        self._call(params, [p.grad for p in params], lists)


class CompiledPNM(_CompiledPeer):
    buffers = ("pos_momentum", "neg_momentum")
    _maths = staticmethod(_pnm_step)

    def __init__(self, params, lr=1e-3, betas=(0.9, 1.0), **kw):
        super().__init__(params, dict(lr=lr, betas=betas), **kw)

    def _call(self, params, grads, lists):
        g = self.param_groups[0]
        self._update(params, grads, *lists, g["lr"], *g["betas"])


class CompiledAdaPNM(_CompiledPeer):
    buffers = ("exp_avg", "neg_exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _maths = staticmethod(_adapnm_step)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 1.0), eps=1e-8, **kw):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps), **kw)
        first = self.param_groups[0]["params"][0]
        self.step_count = torch.zeros((), device=first.device)  # device-side, as capturable

    def _call(self, params, grads, lists):
        g = self.param_groups[0]
        beta1, beta2, beta0 = g["betas"]
        self._update(params, grads, *lists, self.step_count, g["lr"], beta1, beta2, beta0,
                     g["eps"])
