"""AMP: GradScaler hands grad_scale/found_inf to the step (no host unscale), an inf skips the
whole step (no parameter, state or step counter changes) and lowers the scale."""
import copy

import torch

import cases
from cases import FAST_PATHS
from conftest import (DEVICE, OPTIMIZERS, assert_states_close, clone_params, grads_for_step,
                      make_params, train)

PATHS = FAST_PATHS + ["reference"]


def _steps_scaled_as_the_reference(name, path, shapes, steps, **options):
    """`steps` steps of gradients scaled by 1024 with grad_scale set, beside the reference's
    unscaled ones: the two agree. Returns the optimizer and its parameters."""
    params = make_params(shapes)
    plain = clone_params(params)
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path, **options)
    ref = OPTIMIZERS[name](plain, lr=1e-2, backend="reference", **options)
    for t in range(steps):
        train(ref, plain, 1, start=t)
        for p, g in zip(params, grads_for_step(params, t)):
            p.grad = g * 1024
        opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
        opt.step()
    assert_states_close(opt, params, ref, plain)
    return opt, params


@cases.parametrize(PATHS)
def test_grad_scale_is_unscaled_in_the_step(path, name):
    _steps_scaled_as_the_reference(name, path, [(40,), (3, 3)], 5)


@cases.parametrize(PATHS)
def test_found_inf_changes_nothing(path, name):
    params = make_params([(40,), (5,)])
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path)
    train(opt, params, 3)
    before = copy.deepcopy(opt.state_dict())
    values = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.grad_scale, opt.found_inf = torch.tensor(8.0), torch.tensor(1.0)
    opt.step()
    for p, v in zip(params, values):
        assert torch.equal(p, v)
    for k, st in before["state"].items():
        for key, value in st.items():
            assert torch.equal(opt.state_dict()["state"][k][key], value), key


@cases.parametrize([p for p in FAST_PATHS if p != "foreach"] + ["reference"])
def test_grad_scaler_end_to_end_with_an_injected_inf(path, name):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(DEVICE)
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, backend=path)
    assert opt._step_supports_amp_scaling
    scaler = torch.amp.GradScaler(DEVICE, init_scale=256.0)
    x = torch.randn(16, 8, device=DEVICE)
    for it in range(4):
        opt.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if it == 2:
            model.weight.grad[0, 0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            steps = [opt.state[p]["step"].clone() for p in model.parameters()]
        scaler.step(opt)
        if it == 2:
            for p, b, s in zip(model.parameters(), before, steps):
                assert torch.equal(p, b) and torch.equal(opt.state[p]["step"], s)
            scale_before = scaler.get_scale()
        scaler.update()
        if it == 2:
            assert scaler.get_scale() < scale_before
    assert opt.state[model.weight]["step"].item() == 3


@cases.parametrize(PATHS)
def test_unscale_then_clip_then_step_matches_training_without_scaling(path, name):
    """The usual clipping recipe: scaler.unscale_(opt), clip_grad_norm_, scaler.step(opt).
    The step then gets found_inf without grad_scale, and with a power-of-two scale the run is
    bitwise the run without any scaling."""
    runs = []
    for enabled in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(DEVICE)
        opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, backend=path)
        scaler = torch.amp.GradScaler(DEVICE, init_scale=256.0, enabled=enabled)
        x = torch.randn(16, 8, device=DEVICE)
        for _ in range(4):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
        runs.append((opt, list(model.parameters())))
    assert_states_close(*runs[0], *runs[1], rtol=0, atol=0)


@cases.parametrize(cases.INT8_PATHS)
def test_compressed_state_unscales_and_skips_as_the_reference(path, name):
    """bfloat16 and int8 state on every path that keeps them: a scaled gradient steps as the
    reference's unscaled one, and a found inf changes nothing (codes, scales, seeds,
    counters)."""
    for state_dtype in (torch.bfloat16, torch.int8):
        opt, params = _steps_scaled_as_the_reference(name, path, [(3, 200), (40,)], 4,
                                                     state_dtype=state_dtype)
        before = copy.deepcopy(opt.state_dict())
        values = [p.detach().clone() for p in params]
        opt.grad_scale, opt.found_inf = torch.tensor(8.0), torch.tensor(1.0)
        opt.step()
        assert all(torch.equal(p, v) for p, v in zip(params, values))
        for k, st in before["state"].items():
            for key, value in st.items():
                assert torch.equal(opt.state_dict()["state"][k][key], value), key
