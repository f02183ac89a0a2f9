"""The maths, against known optimizers and by hand: with b0 = -b1/(1+b1) AdaPNM is Adam(W)
and PNM momentum SGD, on every path; PNM's first step worked out by hand."""
import math

import pytest
import torch

import cases
from cases import FAST_PATHS
from conftest import clone_params, grads_for_step, make_params, train
from pnm_kernels import PNM, AdaPNM
from pnm_kernels.reference import noise_norm


@pytest.mark.parametrize("decoupled", [True, False])
@cases.parametrize(FAST_PATHS + ["reference"], optimizers=["AdaPNM"], args=["path"])
def test_adapnm_with_momentum_b0_is_adam(path, decoupled):
    """b0 = -b1/(1+b1), no AMSGrad: AdaPNM is Adam(W) with lr / noise_norm (docs/design.md §1)."""
    b1, b2, wd, lr = 0.9, 0.999, 0.1, 1e-2
    b0 = -b1 / (1 + b1)
    nn = noise_norm(b0)
    params = make_params([(257,), (3, 5)])
    adam_params = clone_params(params)
    opt = AdaPNM(params, lr=lr, betas=(b1, b2, b0), weight_decay=wd, amsgrad=False,
                 decoupled=decoupled, backend=path)
    if decoupled:  # AdamW decays by lr_adam * wd_adam = lr * wd
        adam = torch.optim.AdamW(adam_params, lr=lr / nn, betas=(b1, b2), weight_decay=wd * nn)
    else:
        adam = torch.optim.Adam(adam_params, lr=lr / nn, betas=(b1, b2), weight_decay=wd)
    train(opt, params, 60)
    train(adam, adam_params, 60)
    for p, q in zip(params, adam_params):
        torch.testing.assert_close(p, q)


@cases.parametrize(FAST_PATHS + ["reference"], optimizers=["PNM"], args=["path"])
def test_pnm_with_momentum_b0_is_ema_momentum_sgd(path):
    """b0 = -b1/(1+b1): PNM steps along m_t = b1 m_{t-1} + (1-b1) g_t, scaled by lr/nn."""
    b1, lr = 0.9, 1e-2
    b0 = -b1 / (1 + b1)
    params = make_params([(257,), (3, 5)])
    sgd_params = [p.detach().clone() for p in params]
    buffers = [torch.zeros_like(p) for p in sgd_params]
    opt = PNM(params, lr=lr, betas=(b1, b0), backend=path)
    train(opt, params, 60)
    for t in range(60):
        for p, m, g in zip(sgd_params, buffers, grads_for_step(sgd_params, t)):
            m.mul_(b1).add_(g, alpha=1 - b1)
            p.add_(m, alpha=-lr / noise_norm(b0))
    for p, q in zip(params, sgd_params):
        torch.testing.assert_close(p.detach(), q)


def test_first_step_by_hand():
    """Step 1 of PNM with b0 = 1: m_pos = (1-b1^2) g, p -= lr * 2 m_pos / sqrt(5)."""
    p = torch.tensor([1.0, -2.0], requires_grad=True)
    opt = PNM([p], lr=0.1, betas=(0.5, 1.0), backend="reference")
    p.grad = torch.tensor([4.0, 8.0])
    opt.step()
    m = 0.75 * torch.tensor([4.0, 8.0])
    torch.testing.assert_close(p.detach(), torch.tensor([1.0, -2.0]) - 0.1 * 2 * m / math.sqrt(5))
    assert opt.state[p]["step"].item() == 1
    torch.testing.assert_close(opt.state[p]["neg_momentum"], torch.zeros(2))
