"""PNM and AdaPNM behave like torch's own optimizers in everything a user relies on."""
import collections
import copy
import gc
import io
import math
import pickle
import random
import sys
import warnings

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from conftest import (DEVICE, FAST_PATHS, HAS_TRITON, OPTIMIZERS, assert_states_close,
                      clone_params, grads_for_step, make_params, train, user_event,
                      with_reference)
from pnm_kernels import PNM, AdaPNM, available_backends
from pnm_kernels import _backends
from pnm_kernels.reference import noise_norm

BOTH = pytest.mark.parametrize("name", ["PNM", "AdaPNM"])


def _planned_steps(opt, monkeypatch):
    """A list that grows by one at each step of `opt` that plans (see _repeat_step: a
    repeated step does not)."""
    plans = []
    plan = opt._plan
    monkeypatch.setattr(opt, "_plan", lambda *a, **k: plans.append(1) or plan(*a, **k))
    return plans


# --- the maths, against known optimizers -------------------------------------------------

@pytest.mark.parametrize("path", FAST_PATHS + ["reference"], indirect=True)
@pytest.mark.parametrize("decoupled", [True, False])
def test_adapnm_with_momentum_b0_is_adam(path, decoupled):
    """b0 = -b1/(1+b1), no AMSGrad: AdaPNM is Adam(W) with lr / noise_norm (DESIGN.md §1)."""
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


@pytest.mark.parametrize("path", FAST_PATHS + ["reference"], indirect=True)
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


# --- the torch.optim contract ------------------------------------------------------------

@BOTH
def test_closure_loss_and_zero_grad(name):
    p = torch.randn(4, requires_grad=True)
    opt = OPTIMIZERS[name]([p])
    loss = opt.step(lambda: (p**2).sum().backward() or (p**2).sum().detach())
    assert loss is not None and p.grad is not None
    opt.zero_grad()
    assert p.grad is None


@BOTH
def test_params_without_grad_get_no_state_and_keep_their_parity(name):
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    opt = OPTIMIZERS[name]([a, b])
    a.grad = torch.ones(3)
    opt.step()
    assert b not in opt.state and opt.state[a]["step"].item() == 1
    b.grad = torch.ones(3)
    opt.step()
    assert opt.state[a]["step"].item() == 2 and opt.state[b]["step"].item() == 1


@pytest.mark.parametrize("path", ["reference"] + FAST_PATHS, indirect=True)
@BOTH
def test_numpy_scalar_hyper_parameters_act_as_python_numbers(path, name):
    """lr, betas, eps and weight_decay given as numpy scalars (a numpy-computed schedule, a
    config) step exactly as the same Python numbers do, on every path."""
    np = pytest.importorskip("numpy")
    runs = []
    for num in (lambda x: float(np.float32(x)), np.float32):  # the same values
        params = make_params([(50,), (3, 3)])
        kw = dict(lr=num(0.01), weight_decay=num(0.1))
        kw["betas"] = (num(0.9), num(0.999), num(1.0)) if name == "AdaPNM" else (num(0.9), num(1.0))
        if name == "AdaPNM":
            kw["eps"] = num(1e-6)
        opt = OPTIMIZERS[name](params, backend=path, **kw)
        train(opt, params, 3)
        runs.append((opt, params))
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["reference"] + FAST_PATHS, indirect=True)
@BOTH
def test_betas_given_as_a_list_and_edited_in_place_are_validated_and_used(path, name):
    """betas may be a list (torch's optimizers take one); an edit in place between steps is
    seen like a new value: a valid one is used (the same as assigning it), an invalid one
    raises naming the group before anything changes. (A step repeating the last one once
    compared the list with itself, so the edit skipped validation.)"""
    runs = []
    for edit in ("in place", "assigned"):
        params = make_params([(6,), (2, 3)])
        betas = [0.9, 0.999, 1.0] if name == "AdaPNM" else [0.9, 1.0]
        opt = OPTIMIZERS[name](params, lr=0.01, betas=betas, backend=path)
        train(opt, params, 3)
        if edit == "in place":
            opt.param_groups[0]["betas"][0] = 0.5
        else:
            opt.param_groups[0]["betas"] = [0.5, *betas[1:]]
        train(opt, params, 2, start=3)
        runs.append(params)
        opt.param_groups[0]["betas"][0] = 1.5  # invalid: beta1 < 1
        for p in params:
            p.grad = torch.ones_like(p)
        before = [p.detach().clone() for p in params]
        steps = [opt.state[p]["step"].clone() for p in params]
        with pytest.raises(ValueError, match=r"param_groups\[0\]: invalid beta1 \(betas\[0\]\) 1.5"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert all(torch.equal(opt.state[p]["step"], s) for p, s in zip(params, steps))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_lr_scheduler_and_tensor_lr(path, name):
    params = make_params([(100,), (7,)])
    ref_params = clone_params(params)
    opt = OPTIMIZERS[name](params, lr=torch.tensor(0.01), backend=path)
    ref = OPTIMIZERS[name](ref_params, lr=torch.tensor(0.01), backend="reference")
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt, ref)]
    for t in range(10):
        train(opt, params, 1, start=t)
        train(ref, ref_params, 1, start=t)
        for s in scheds:
            s.step()
    assert_states_close(opt, params, ref, ref_params)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.01 * 0.5**3)


@pytest.mark.parametrize("path", ["reference"] + FAST_PATHS, indirect=True)
@BOTH
def test_an_lr_that_requires_grad_is_used_by_value_without_warnings(path, name):
    """A learned lr (a tensor that requires grad) steps as its value, with no warning about
    converting it to a number, and gets no gradient history from the step."""
    params = make_params([(20,), (3,)])
    ref_params = clone_params(params)
    lr = torch.tensor(0.01, requires_grad=True)
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # torch warns of this once a process otherwise
    try:
        with warnings.catch_warnings():
            # (Only torch's: triton 3.6's interpreter warns of its own numpy use.)
            warnings.filterwarnings("error", message=".*requires_grad")
            opt = OPTIMIZERS[name](params, lr=lr, backend=path)
            train(opt, params, 3)
    finally:
        torch.set_warn_always(warn_always)
    ref = OPTIMIZERS[name](ref_params, lr=0.01, backend="reference")
    train(ref, ref_params, 3)
    assert_states_close(opt, params, ref, ref_params)
    assert lr.grad is None and all(p.grad_fn is None for p in params)


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_steps_where_some_parameters_lack_a_gradient_match_the_reference(path, name,
                                                                         monkeypatch):
    """Mixture-of-experts layers and unused branches: each step another subset of parameters
    has no gradient (those do not step; some steps none of the second group's has one), and
    one parameter gets its first gradient only at step 6. The steps match the reference,
    state included; on the fused path they repeat without planning, but for the steps where
    a parameter without state gets a gradient (1 and 6, after the first)."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,), (4,), (5,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        o.param_groups[0]["params"] = ps[:3]
        o.add_param_group(dict(params=ps[3:], lr=3e-3))
    plans = _planned_steps(opt, monkeypatch)
    for t in range(20):
        for o, ps in ((opt, params), (ref, ref_params)):
            for i, (p, g) in enumerate(zip(ps, grads_for_step(ps, t))):
                p.grad = None if (i == 4 and t < 6) or (t + i) % 3 == 0 else g
            o.step()
    assert_states_close(opt, params, ref, ref_params)
    if path in ("fused", "emulated"):
        assert len(plans) == 3


@pytest.mark.parametrize("path", ["reference"] + FAST_PATHS, indirect=True)
@BOTH
def test_the_optimizer_keeps_no_gradient_alive(path, name):
    """After zero_grad() (set_to_none) no gradient of any step is kept alive by the optimizer:
    not the first step's (which built the cached lists), not a later one's, and not those a
    repeated step over several groups took before finding one group unable to step (at steps
    2 and 4 a gradient of the second group has gaps, which the repeated step does not take;
    the careful step copies it. From step 3 the first group's lists are the cached ones, so
    they outlive step 4). Holding a set would cost a model's worth of (GPU) memory."""
    params = make_params([(50,), (3, 3), (7,), (4,)])
    opt = OPTIMIZERS[name]([dict(params=params[:2]), dict(params=params[2:], lr=3e-3)],
                           backend=path)
    seen = []
    for t in range(5):
        for p, g in zip(params, grads_for_step(params, t)):
            p.grad = g
        if t in (2, 4):
            params[3].grad = torch.zeros(8, device=DEVICE)[::2].copy_(params[3].grad)
        # The memory, not the Python object: C++ may hold a tensor whose wrapper was freed.
        seen += [StorageWeakRef(p.grad.untyped_storage()) for p in params if p.grad is not None]
        opt.step()
        opt.zero_grad()
    assert [opt.state[p]["step"].item() for p in params] == [5, 5, 5, 5]
    gc.collect()
    assert [i for i, ref in enumerate(seen) if not ref.expired()] == []


@pytest.mark.parametrize("path", ["fused", "emulated"], indirect=True)
@BOTH
def test_a_repeated_step_its_first_kernel_refuses_is_taken_carefully_and_keeps_nothing(
        path, name, monkeypatch):
    """When the first group's kernel refuses a repeated step over several groups (after every
    group took its gradients, before anything was written), the careful path steps instead,
    as the reference would, and no gradient taken for the refused step stays held."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,), (4,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        o.param_groups[0]["params"] = ps[:2]
        o.add_param_group(dict(params=ps[2:], lr=3e-3))
        train(o, ps, 3)
    run = _backends.run_fused_own_grads
    refusals = []

    def refuse_once(*args):
        if not refusals:
            refusals.append(1)
            raise RuntimeError("refused (test)")
        return run(*args)

    monkeypatch.setattr(_backends, "run_fused_own_grads", refuse_once)
    for o, ps in ((opt, params), (ref, ref_params)):
        for p, g in zip(ps, grads_for_step(ps, 3)):
            p.grad = g
    taken = [StorageWeakRef(p.grad.untyped_storage()) for p in params]
    opt.step()
    ref.step()
    assert refusals == [1]
    opt.zero_grad()
    gc.collect()
    assert [i for i, r in enumerate(taken) if not r.expired()] == []
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("path", ["reference"] + FAST_PATHS, indirect=True)
@pytest.mark.parametrize("how", ["load_state_dict", "new dtype", "del state"])
@BOTH
def test_state_the_optimizer_let_go_of_is_freed(path, name, how):
    """State replaced after some steps, by load_state_dict, by following parameters given a
    new dtype (the step counters stay), or by `del opt.state[p]`, is freed once the next step
    has run: no cached list keeps the old buffers (a second optimizer state's worth of
    memory) alive."""
    params = make_params([(50,), (3, 3), (7,), (4,)])
    opt = OPTIMIZERS[name]([dict(params=params[:2]), dict(params=params[2:], lr=3e-3)],
                           backend=path)
    train(opt, params, 3)
    old = [StorageWeakRef(t.untyped_storage()) for state in opt.state.values()
           for key, t in state.items() if not (how == "new dtype" and key == "step")]
    if how == "load_state_dict":
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    elif how == "new dtype":
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    else:
        for p in params:
            del opt.state[p]
    train(opt, params, 1, start=3)
    gc.collect()
    assert [i for i, ref in enumerate(old) if not ref.expired()] == []
    steps = 1 if how == "del state" else 4
    assert [opt.state[p]["step"].item() for p in params] == [steps] * 4


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@pytest.mark.parametrize("lr", ["float", "tensor"])
@BOTH
def test_hyper_parameters_changed_between_any_two_steps_match_the_reference(path, name, lr):
    """OneCycleLR changes lr and beta1 before every step, in two groups; weight_decay,
    maximize, decoupled and amsgrad are edited on the way. Every step uses the values of its
    moment, as the reference does, state buffers included."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,), (4,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        o.param_groups[0]["params"] = ps[:2]
        o.add_param_group(dict(params=ps[2:], weight_decay=0.1))
        if lr == "tensor":
            for group in o.param_groups:
                group["lr"] = torch.tensor(group["lr"])
        sched = torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20)
        for t in range(16):
            if t == 4:
                o.param_groups[1]["weight_decay"] = 0.3
            if t == 7:
                o.param_groups[0]["maximize"] = True
            if t == 9:
                o.param_groups[1]["decoupled"] = False
            if t == 11 and name == "AdaPNM":
                o.param_groups[0]["amsgrad"] = False
            train(o, ps, 1, start=t)
            sched.step()
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("path", ["fused", "emulated", "triton"], indirect=True)
@BOTH
def test_a_scheduled_lr_keeps_the_repeated_step(path, name, monkeypatch):
    """The repeated fused or Triton step (no planning; see _repeat_step) survives a new lr or beta1
    every step, as schedulers give: only a change of backend or of the buffers a group
    needs (AMSGrad switched) makes the next step plan again."""
    params = make_params([(50,), (3, 3), (7,), (4,)])
    opt = OPTIMIZERS[name]([dict(params=params[:2]), dict(params=params[2:], weight_decay=0.1)],
                           lr=1e-2, backend=path)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20)
    plans = _planned_steps(opt, monkeypatch)
    for t in range(8):
        train(opt, params, 1, start=t)
        sched.step()
    assert len(plans) == 1  # the first step only
    if name == "AdaPNM":
        opt.param_groups[1]["amsgrad"] = False
        train(opt, params, 2, start=8)
        assert len(plans) == 2


def _never_repeating(opt):
    """`opt` with every step planned: the step it remembers is forgotten at once."""
    opt._remember_step = lambda plan, batches: None
    return opt


MIXED = [torch.float32, torch.bfloat16, torch.float16]


def _mixed_dtype_params(seed=0):
    """Twelve parameters of three dtypes in turn: two of each in either half."""
    shapes = [(50,), (3, 3), (7,), (4,), (2, 5), (9,), (1,), (6,), (2, 2), (33,), (5,), (8,)]
    return [p.to(MIXED[i % 3]).detach().requires_grad_()
            for i, p in enumerate(make_params(shapes, seed=seed))]


@pytest.mark.parametrize("path", ["fused", "emulated", "triton"], indirect=True)
@pytest.mark.parametrize("skip_every", [0, 2])
@BOTH
def test_a_group_of_several_dtypes_repeats_its_steps(path, name, skip_every, monkeypatch):
    """A param group whose parameters have several dtypes (a bf16 model with fp32 norms) is
    one batch per dtype; its steps repeat too (no planning; see _repeat_step), also when
    some parameters lack a gradient (the fused step then holds every parameter with state;
    here every dtype keeps one with a gradient in each group), and give bit for bit what
    steps planned afresh every time give."""
    if path == "triton" and skip_every:
        pytest.skip("a Triton batch plans every step in which a parameter with state lacks "
                    "a gradient")
    runs = []
    for repeat in (True, False):
        params = _mixed_dtype_params()
        opt = OPTIMIZERS[name]([dict(params=params[:6]), dict(params=params[6:], lr=3e-3)],
                               lr=1e-2, weight_decay=0.1, backend=path)
        if not repeat:
            _never_repeating(opt)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        plans = _planned_steps(opt, monkeypatch)
        for t in range(10):
            train(opt, params, 1, start=t, skip_every=skip_every)
            sched.step()
            if t == 3:  # by now every parameter has state
                planned_by_step_3 = len(plans)
        runs.append((opt, params))
        if repeat:  # the steps after repeat (with skip_every, each lacking some gradients)
            assert len(plans) == planned_by_step_3 <= 3
    assert_states_close(*runs[0], *runs[1], rtol=0, atol=0)


def _dense_odd_layout_steps(name, path, repeat, monkeypatch):
    """Ten steps over channels_last and transposed parameters (with a contiguous one), the
    gradients laid out like them, as autograd lays them out, but for step 5, where each
    gradient is given contiguous by hand. Returns the optimizer, its parameters and which
    steps repeated the last one (see _repeat_step)."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 4, 2, 5, generator=gen).to(memory_format=torch.channels_last),
               torch.randn(7, 6, generator=gen).t(), torch.randn(9, generator=gen)]
    params = [t.to(DEVICE).requires_grad_() for t in tensors]
    opt = OPTIMIZERS[name](params, lr=1e-2, weight_decay=0.1, backend=path)
    if not repeat:
        _never_repeating(opt)
    repeated, repeat_step = [], opt._repeat_step
    monkeypatch.setattr(opt, "_repeat_step",
                        lambda *a: repeated.append(repeat_step(*a)) or repeated[-1])
    for t in range(10):
        for p, g in zip(params, grads_for_step(params, t)):
            p.grad = g.contiguous() if t == 5 else torch.empty_like(p).copy_(g)
        opt.step()
    return opt, params, repeated


@pytest.mark.parametrize("path", ["fused", "emulated", "triton"], indirect=True)
@BOTH
def test_dense_parameters_of_other_layouts_repeat_their_steps(path, name, monkeypatch):
    """channels_last and transposed parameters (dense, not contiguous) are held like
    contiguous ones: their steps repeat (no planning; see _repeat_step); a step whose
    gradients are laid out unlike them is planned (and copied into their layout), and the
    steps give bit for bit what steps planned afresh every time give, and the reference's."""
    opt, params, repeated = _dense_odd_layout_steps(name, path, True, monkeypatch)
    again, again_params, _ = _dense_odd_layout_steps(name, path, False, monkeypatch)
    ref, ref_params, _ = _dense_odd_layout_steps(name, "reference", True, monkeypatch)
    assert repeated == [False] + [True] * 4 + [False] + [True] * 4
    assert_states_close(opt, params, again, again_params, rtol=0, atol=0)
    assert_states_close(opt, params, ref, ref_params)
    for p in params:
        for key, buffer in opt.state[p].items():
            if key != "step":
                assert buffer.stride() == p.stride(), key


@pytest.mark.parametrize("path", ["triton"], indirect=True)
@BOTH
def test_dense_parameters_of_other_layouts_without_the_compiled_extension(path, name,
                                                                          monkeypatch):
    """The same on a Triton-only install, whose checks of gradients and held lists are in
    Python: a gradient given contiguous to a channels_last parameter (step 5) is copied into
    its layout, never walked as if laid out like it."""
    monkeypatch.setattr(_backends, "extension_error", lambda: "not built, for the test")
    monkeypatch.setattr(_backends, "first_mismatched_grad", None)
    opt, params, _ = _dense_odd_layout_steps(name, path, True, monkeypatch)
    ref, ref_params, _ = _dense_odd_layout_steps(name, "reference", True, monkeypatch)
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("path", ["fused", "emulated", "triton"], indirect=True)
@BOTH
def test_parameters_that_never_step_keep_the_repeated_step(path, name, monkeypatch):
    """A model passed whole, its frozen part included: parameters that never get a gradient
    have no state, and the steps of the others repeat (Triton's too: its tables name only
    the parameters with state). One that then gets a gradient is given state by a planned
    step, after which the steps repeat again; all as the reference steps."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,), (4,)])
    plans = _planned_steps(opt, monkeypatch)
    for o, ps in ((opt, params), (ref, ref_params)):
        for t in range(8):
            for i, (p, g) in enumerate(zip(ps, grads_for_step(ps, t))):
                p.grad = g if i != 1 or t >= 5 else None  # ps[1] frozen until step 5
            o.step()
    assert opt.state[params[1]]["step"].item() == 3
    assert len(plans) == 2  # steps 0 and 5
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_step_hooks_run_around_every_step_and_their_edits_are_stepped(path, name):
    """torch's step hooks (the optimizer's own and the global ones) run around every step,
    repeated ones included, and what a pre-hook changes (gradients clipped in place or
    replaced, a new lr) is what the step uses: the reference, given the same hooks, agrees."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,)])
    calls = []

    def pre_hook(optimizer, args, kwargs):
        calls.append("pre")
        group_params = optimizer.param_groups[0]["params"]
        torch.nn.utils.clip_grad_norm_(group_params[:2], 1.0)  # in place
        group_params[2].grad = group_params[2].grad * 0.5  # a new tensor
        optimizer.param_groups[0]["lr"] *= 0.9

    for o in (opt, ref):
        o.register_step_pre_hook(pre_hook)
        o.register_step_post_hook(lambda optimizer, args, kwargs: calls.append("post"))
    handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: calls.append("global"))
    try:
        train(opt, params, 6)
        train(ref, ref_params, 6)
    finally:
        handle.remove()
    assert calls == ["global", "pre", "post"] * 12
    assert_states_close(opt, params, ref, ref_params)


@BOTH
def test_a_repeated_step_over_fused_and_triton_groups(name, monkeypatch):
    """A Triton group repeats too, beside a fused one, while every one of its parameters has
    a gradient. A step where one lacks a gradient (steps 3 and 4), or has one with gaps
    (step 6), is planned: the Triton tables name every tensor they update, and its kernels
    check nothing. The Triton group is checked before the fused group steps: otherwise the
    fused group would step twice. Every step matches the reference."""
    if _backends.extension_error() is not None or not HAS_TRITON:
        pytest.skip("needs pnm_kernels._C and triton")
    monkeypatch.delenv("PNM_KERNELS_EMULATE_CUDA", raising=False)
    params = make_params([(50,), (3, 3), (7,), (4,)])
    ref_params = clone_params(params)
    opt = OPTIMIZERS[name]([dict(params=params[:2], backend="fused"),
                            dict(params=params[2:], backend="triton", lr=3e-3)], lr=1e-2)
    ref = OPTIMIZERS[name]([dict(params=ref_params[:2]), dict(params=ref_params[2:], lr=3e-3)],
                           lr=1e-2, backend="reference")
    plans = _planned_steps(opt, monkeypatch)
    for t in range(9):
        for o, ps in ((opt, params), (ref, ref_params)):
            for i, (p, g) in enumerate(zip(ps, grads_for_step(ps, t))):
                if i == 3 and t in (3, 4):
                    g = None
                elif i == 2 and t == 6:
                    g = torch.empty(14, device=p.device, dtype=p.dtype)[::2].copy_(g)
                p.grad = g
            o.step()
        assert_states_close(opt, params, ref, ref_params)
    assert len(plans) == 1 + 2 + 2  # the first step; 3 and 4; 5 (its gradient is back); 6


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_mixed_dtypes_complex_and_odd_layouts_in_one_group(path, name):
    """fp32/fp16/bf16, complex, transposed, channels_last, a strided slice, 0-dim, empty."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(8, 12, generator=gen)
    tensors = [
        torch.randn(10, generator=gen),
        torch.randn(9, generator=gen).half(),
        torch.randn(6, 2, generator=gen).bfloat16(),
        torch.randn(5, generator=gen, dtype=torch.complex64),
        torch.randn(6, 4, generator=gen).t(),                                   # transposed
        torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last),
        base.to(DEVICE)[:, ::3],                                 # not dense (sliced on the device)
        torch.randn((), generator=gen),
        torch.randn(0, generator=gen),
    ]
    if path == "triton":
        tensors[3] = torch.randn(5, generator=gen)  # complex is tested for fused/foreach
    params = [t.to(DEVICE).requires_grad_() for t in tensors]
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    for group in (params, ref_params):
        for p in group:
            assert p.is_leaf
    opt = OPTIMIZERS[name](params, lr=1e-2, weight_decay=0.1, backend=path)
    ref = OPTIMIZERS[name](ref_params, lr=1e-2, weight_decay=0.1, backend="reference")
    for t in range(6):
        for ps in (params, ref_params):
            gen_t = torch.Generator().manual_seed(t)
            for p in ps:
                g = torch.randn(p.shape, generator=gen_t, dtype=p.dtype if p.is_complex() else torch.float32)
                # a gradient laid out differently from its parameter
                p.grad = g.to(p.dtype).to(DEVICE).contiguous()
        opt.step()
        ref.step()
    # This test is about layouts and mixing; precision has its own test (test_backends.py).
    # fp32/complex members must match at default tolerances; fp16/bf16 members differ from
    # the reference by its per-op roundings (a few ulps after six steps).
    low = {1, 2}
    full = [i for i in range(len(params)) if i not in low]
    assert_states_close(opt, [params[i] for i in full], ref, [ref_params[i] for i in full])
    assert_states_close(opt, [params[i] for i in low], ref, [ref_params[i] for i in low],
                        atol=4e-2, rtol=2e-2)
    assert params[6].stride() == (12, 3)  # the strided slice was updated in place


@pytest.mark.parametrize("path", FAST_PATHS + ["reference"], indirect=True)
@BOTH
def test_l2_mode_never_writes_into_grad(path, name):
    p = make_params([(33,)])[0]
    opt = OPTIMIZERS[name]([p], weight_decay=0.5, decoupled=False, backend=path)
    p.grad = torch.ones_like(p)
    opt.step()
    torch.testing.assert_close(p.grad, torch.ones_like(p))


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_state_dict_round_trip_mid_run_is_bitwise(path, name):
    params = make_params([(50,), (3, 3)])
    straight = clone_params(params)
    opt_straight = OPTIMIZERS[name](straight, lr=1e-2, backend=path)
    train(opt_straight, straight, 9)

    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path)
    train(opt, params, 5)
    saved = copy.deepcopy(opt.state_dict())
    resumed = clone_params(params)
    opt2 = OPTIMIZERS[name](resumed, lr=1e-2, backend=path)
    opt2.load_state_dict(saved)
    train(opt2, resumed, 4, start=5)
    for p, q in zip(resumed, straight):
        assert torch.equal(p, q)
    assert_states_close(opt2, resumed, opt_straight, straight, atol=0, rtol=0)


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_named_parameters_are_taken_their_names_saved_and_resumed_from(path, name):
    """optimizer(model.named_parameters()), as torch's optimizers take it: the names are in
    the state_dict's groups, a fresh optimizer over the named parameters resumes from it,
    and the steps are those of unnamed parameters (bitwise)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2)).to(DEVICE)
    unnamed = clone_params(list(model.parameters()))
    opt_unnamed = OPTIMIZERS[name](unnamed, lr=1e-2, backend=path)
    opt = OPTIMIZERS[name](model.named_parameters(), lr=1e-2, backend=path)
    train(opt, list(model.parameters()), 3)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    resumed = OPTIMIZERS[name](model.named_parameters(), lr=1e-2, backend=path)
    resumed.load_state_dict(saved)
    train(resumed, list(model.parameters()), 3, start=3)
    train(opt_unnamed, unnamed, 6)
    assert_states_close(resumed, list(model.parameters()), opt_unnamed, unnamed, atol=0, rtol=0)


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_loading_an_earlier_state_into_the_same_optimizer_rewinds_it(path, name):
    """The kernels' cached tensor lists follow load_state_dict: the loaded buffers and
    counters are the ones stepped, not those held from before."""
    params = make_params([(50,), (3, 3)])
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path)
    train(opt, params, 3)
    saved_params = [p.detach().clone() for p in params]
    saved = copy.deepcopy(opt.state_dict())
    train(opt, params, 4, start=3)
    after_seven = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, saved_params):
            p.copy_(v)
    opt.load_state_dict(saved)
    train(opt, params, 4, start=3)
    for p, v in zip(params, after_seven):
        assert torch.equal(p, v)


def _edit_state(how, o, ps):
    """One way of changing the second parameter's state by hand between steps. Returns a
    plain dict put in by hand, which the user may go on editing."""
    state = o.state[ps[1]]
    buffer = next(key for key in state if key != "step")
    if how == "a buffer replaced":  # a moment reset
        state[buffer] = torch.ones_like(state[buffer])
    elif how == "the counter replaced":
        state["step"] = torch.tensor(1.0)
    elif how == "the counter as an int":
        state["step"] = 1
    elif how == "update()":
        state.update({key: value * 0.5 for key, value in state.items() if key != "step"})
    elif how == "a buffer deleted":  # made again, zero
        del state[buffer]
    elif how == "a plain dict":
        kept = o.state[ps[1]] = {key: value.clone() for key, value in state.items()}
        return kept
    elif how == "a new optimizer.state":
        o.state = collections.defaultdict(dict, {p: dict(s) for p, s in o.state.items()})
        return o.state[ps[1]]
    return None


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@pytest.mark.parametrize("how", ["a buffer replaced", "the counter replaced",
                                 "the counter as an int", "update()", "a buffer deleted",
                                 "a plain dict", "a new optimizer.state"])
@BOTH
def test_state_changed_by_hand_is_what_the_next_step_reads(path, name, how):
    """The fast paths reuse the tensor lists they built (cached and repeated steps), yet a
    step reads the state as it is now, as torch's optimizers do: after an entry is replaced
    by hand (a Python int counter made a tensor, as load_state_dict makes it), and after a
    plain dict is put in by hand and then edited through the user's own reference to it."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        kept = _edit_state(how, o, ps)
        train(o, ps, 2, start=3)
        if kept is not None:
            kept["step"] = torch.tensor(10.0)
            train(o, ps, 2, start=5)
            # Still the user's dict (not a copy the optimizer made), edits and steps seen.
            assert o.state[ps[1]] is kept and kept["step"].item() == 12
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_a_held_plain_dict_of_a_parameter_that_skips_steps_is_read_when_it_steps(path, name):
    """Steps in which one parameter of a group has no gradient repeat with lists of every
    parameter with state (see _lists_with_state). A parameter whose state is a plain dict the
    user still holds is kept out of them: while it skips steps the user replaces a buffer
    through their dict, and its next step reads the new one."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        kept = o.state[ps[2]] = dict(o.state[ps[2]])
        for t in range(3, 7):  # ps[2] skips these steps
            for p, g in zip(ps, grads_for_step(ps, t)):
                p.grad = None if p is ps[2] else g
            o.step()
            if t == 4:
                buffer = next(key for key in kept if key != "step")
                kept[buffer] = torch.full_like(kept[buffer], 0.5)
        train(o, ps, 2, start=7)
        assert o.state[ps[2]] is kept and kept["step"].item() == 5
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("path", ["fused", "emulated", "triton"], indirect=True)
@pytest.mark.parametrize("how", ["a plain dict", "a new optimizer.state", "load_state_dict"])
@BOTH
def test_state_put_in_by_hand_and_let_go_of_keeps_the_repeated_step(path, name, how,
                                                                     monkeypatch):
    """State put in by hand as plain dicts that only the optimizer then holds (a parameter
    restarted with `opt.state[p] = {}`, a new `opt.state`, ZeroRedundancyOptimizer loading
    a checkpoint entry by entry) costs one planned step; the steps after it repeat. One the
    user still holds is read afresh at every step (see the test above)."""
    params = make_params([(50,), (3, 3), (7,)])
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path)
    train(opt, params, 2)
    if how == "a plain dict":
        opt.state[params[1]] = {}
    elif how == "a new optimizer.state":
        opt.state = collections.defaultdict(dict)
    else:
        opt.load_state_dict(opt.state_dict())
    plans = _planned_steps(opt, monkeypatch)
    train(opt, params, 4, start=2)
    assert len(plans) == 1


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_swapping_parameters_works_once_the_held_lists_are_let_go_of(path, name):
    """The README's way for model.to() with swap_module_params_on_conversion: after
    opt.load_state_dict(opt.state_dict()) nothing holds the parameters but the model and the
    param groups, torch.utils.swap_tensors takes them, and the state follows the new dtype."""
    model = torch.nn.Linear(4, 3).to(DEVICE)
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, backend=path)
    x = torch.randn(2, 4, device=DEVICE)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.bfloat16)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    model(x.bfloat16()).sum().backward()
    opt.step()
    state = opt.state[model.weight]
    assert state["step"].item() == 3
    assert all(t.dtype == torch.bfloat16 for key, t in state.items() if key != "step")


@pytest.mark.parametrize("path", ["fused", "emulated"], indirect=True)
@BOTH
def test_reading_the_state_between_steps_keeps_the_repeated_step(path, name, monkeypatch):
    """Logging code that reads opt.state[p] of every parameter, one without a gradient (and
    so without state) included, costs no planned step; that parameter still gets its state
    when it gets a gradient."""
    params = make_params([(50,), (3, 3), (7,)])
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path)
    frozen = params[2]
    plans = _planned_steps(opt, monkeypatch)
    for t in range(4):
        train(opt, params[:2], 1, start=t)
        assert [len(opt.state[p]) for p in params] == [len(opt.state[params[0]])] * 2 + [0]
    assert len(plans) == 1
    train(opt, params, 1, start=4)
    assert opt.state[frozen]["step"].item() == 1 and len(plans) == 2


@BOTH
def test_a_state_dict_loads_with_weights_only(name):
    """torch.load's default (weights_only=True) accepts the state_dict: plain containers,
    however the optimizer keeps its state."""
    params = make_params([(5,), (2, 3)])
    opt = OPTIMIZERS[name](params)
    train(opt, params, 2)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    twin = OPTIMIZERS[name](clone_params(params))
    twin.load_state_dict(loaded)
    assert all(type(entry) is dict for entry in loaded["state"].values())
    step = twin.state[twin.param_groups[0]["params"][1]]["step"]
    assert torch.equal(step.cpu(), torch.tensor(2.0))  # (a fast path keeps it on the GPU)


@BOTH
def test_pytree_walks_the_state_as_torchs_dict_state(name):
    """torch.utils._pytree goes through optimizer.state and each entry as through torch's
    plain dicts (torch.compile marks state tensors static that way), and maps back to the
    same kinds of containers."""
    from torch.utils import _pytree as pytree

    params = make_params([(5,), (2, 3)])
    opt = OPTIMIZERS[name](params)
    train(opt, params, 2)
    leaves, spec = pytree.tree_flatten(opt.state)
    assert len(leaves) == sum(len(entry) for entry in opt.state.values()) > len(params)
    assert all(isinstance(leaf, torch.Tensor) for leaf in leaves)
    doubled = pytree.tree_map(lambda t: t * 2, opt.state)
    assert type(doubled) is type(opt.state) and list(doubled) == list(opt.state)
    for p in params:
        assert type(doubled[p]) is type(opt.state[p])
        for key, value in opt.state[p].items():
            assert torch.equal(doubled[p][key], value * 2)
    paths = [path for path, _ in pytree.tree_flatten_with_path(opt.state)[0]]
    assert [(path[0].key, path[1].key) for path in paths] == [
        (p, key) for p in opt.state for key in opt.state[p]]


def _second_parameter_restarted_after_three_steps(name, path, restart):
    """Three steps, restart(opt, params) on both runs, three more: the second parameter has
    fresh state (3 steps), the others carry on (6), and the fast path matches the reference."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        restart(o, ps)
        train(o, ps, 3, start=3)
    assert opt.state[params[1]]["step"].item() == 3 and opt.state[params[0]]["step"].item() == 6
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_deleting_a_parameters_state_restarts_it(path, name):
    """`del opt.state[p]` (as after re-initialising a layer) gives p fresh state at its next
    step, as with torch's optimizers; the other parameters carry on."""
    def restart(o, ps):
        del o.state[ps[1]]

    _second_parameter_restarted_after_three_steps(name, path, restart)


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_parameter_storage_swapped_under_cached_lists(path, name):
    """`p.data = ...` (as wrappers that re-point parameters do) moves a parameter's memory;
    the kernels follow it rather than writing where it used to be."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3)])
    old_storage = None
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        old = ps[0].data
        ps[0].data = old.clone()
        if o is opt:
            old_storage = old.clone(), old
        train(o, ps, 3, start=3)
    assert torch.equal(old_storage[0], old_storage[1])  # nothing written to the old memory
    assert_states_close(opt, params, ref, ref_params)


NEW_DATA = {  # what model.to(...) does to a parameter after its state exists
    "channels_last": lambda p: p.data.contiguous(memory_format=torch.channels_last),
    "bfloat16": lambda p: p.data.to(torch.bfloat16),
}


def _give_new_data_mid_run(name, path, change, groups, reload=False):
    """Three steps, then the first parameter's data replaced (and with `reload` the state
    converted by a load_state_dict round trip), then three more steps, the gradients laid out
    like their parameters: on `path` and on the reference. Returns both runs."""
    opt, params, ref, ref_params = with_reference(name, path, [(4, 3, 2, 2), (5,), (6,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        if groups == 2:
            o.param_groups[0]["params"] = ps[:2]
            o.add_param_group(dict(params=ps[2:], weight_decay=0.1))
        train(o, ps, 3, like_params=True)
        ps[0].data = NEW_DATA[change](ps[0])
        if reload:
            o.load_state_dict(o.state_dict())
        train(o, ps, 3, start=3, like_params=True)
    return opt, params, ref, ref_params


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@pytest.mark.parametrize("change", sorted(NEW_DATA))
@pytest.mark.parametrize("groups", [1, 2])
@BOTH
def test_state_follows_a_parameter_given_new_dtype_or_layout(path, name, change, groups):
    """`p.data = ...` in another dtype or memory format after steps (model.to(bfloat16),
    model.to(memory_format=torch.channels_last)): the state buffers are converted to the
    parameter's dtype and layout, as load_state_dict converts state, and the steps go on as
    the reference's, with one param group or with the change in one of two. (In bfloat16
    the backends round differently, so there the yardstick is the same backend with the
    state converted by a load_state_dict round trip.)"""
    opt, params, ref, ref_params = _give_new_data_mid_run(name, path, change, groups)
    p = params[0]
    for key, buffer in opt.state[p].items():
        if key != "step":
            assert buffer.dtype == p.dtype and buffer.stride() == p.stride(), key
    assert opt.state[p]["step"].item() == 6
    if change == "bfloat16":
        ref, ref_params = _give_new_data_mid_run(name, path, change, groups, reload=True)[:2]
        assert_states_close(opt, params, ref, ref_params, rtol=0, atol=0)
    else:
        assert_states_close(opt, params, ref, ref_params)


@BOTH
def test_auto_picks_again_when_every_parameter_moves_to_another_dtype(name):
    """model.double() mid-run: "auto" plans the parameters' steps again (the fused kernels'
    float64 build where there is one), their state following them to float64."""
    opt, params, ref, ref_params = with_reference(name, "auto", [(5,), (3, 2)])
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        for p in ps:
            p.data = p.data.double()
        train(o, ps, 3, start=3)
    assert all(buffer.dtype == torch.float64 for p in params
               for key, buffer in opt.state[p].items() if key != "step")
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("path", ["triton"], indirect=True)
@BOTH
def test_state_follows_new_data_without_the_compiled_extension(path, name, monkeypatch):
    """The same on a Triton-only install, whose check of the held lists is in Python: the
    Triton kernels walk raw memory, so a buffer left in the old layout would be misread."""
    monkeypatch.setattr(_backends, "extension_error", lambda: "not built, for the test")
    monkeypatch.setattr(_backends, "first_mismatched_grad", None)
    opt, params, ref, ref_params = _give_new_data_mid_run(name, path, "channels_last", 1)
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("path", FAST_PATHS + ["reference"], indirect=True)
@BOTH
def test_a_parameter_given_data_of_another_shape_raises_before_any_change(path, name):
    """State cannot follow a new shape: the step raises, naming the parameter, before any
    batch (here the float32 one ahead of it) has stepped."""
    params = make_params([(5,), (3, 2)]) + make_params([(4,)], dtype=torch.bfloat16)
    opt = OPTIMIZERS[name](params, backend=path)
    train(opt, params, 3)
    params[2].data = torch.zeros(9, dtype=torch.bfloat16, device=DEVICE)
    values = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"params'\]\[2\].*another shape"):
        opt.step()
    for p, v, s in zip(params, values, steps):
        assert torch.equal(p, v) and torch.equal(opt.state[p]["step"], s)


@BOTH
def test_meta_parameters_step_like_torchs_optimizers(name):
    """On the meta device (shapes without data) a step makes the state and counts."""
    p = torch.nn.Parameter(torch.empty(3, 2, device="meta"))
    p.grad = torch.empty(3, 2, device="meta")
    opt = OPTIMIZERS[name]([p])
    opt.step()
    opt.step()
    assert opt.state[p]["step"].device.type == "meta"
    assert all(b.shape == p.shape for k, b in opt.state[p].items() if k != "step")


@pytest.mark.parametrize("path", ["triton"], indirect=True)
@BOTH
def test_triton_backend_needs_no_compiled_extension(path, name, monkeypatch):
    """A Triton-only install (pnm_kernels._C absent) runs the Triton kernels as they are,
    its tables built from Python, and bumps the version counters from Python."""
    monkeypatch.setattr(_backends, "extension_error", lambda: "not built, for the test")
    monkeypatch.setattr(_backends, "first_mismatched_grad", None)
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (4097,)])
    train(opt, params, 6)
    train(ref, ref_params, 6)
    assert_states_close(opt, params, ref, ref_params)
    assert [p._version for p in params] == [6] * len(params)


@pytest.mark.parametrize("path", ["triton"], indirect=True)
def test_triton_tables_needed_inside_a_graph_capture_raise_clearly(path, monkeypatch):
    """Tables for new addresses would need a host-to-device copy, which a CUDA graph capture
    forbids: the step says so (and what to do) instead of failing inside CUDA."""
    from pnm_kernels import triton_kernels

    params = make_params([(5,), (3, 2)])
    opt = PNM(params, backend=path)
    train(opt, params, 2)
    monkeypatch.setattr(triton_kernels, "capturing", lambda device: True)
    for p in params:  # gradients kept, as zero_grad(set_to_none=False) keeps them
        p.grad.fill_(0.5)
    opt.step()  # same addresses as in the last step: its tables are used as they are
    params[0].grad = torch.ones(5, device=DEVICE)  # a new address
    with pytest.raises(RuntimeError, match="set_to_none=False"):
        opt.step()


@BOTH
def test_loads_a_checkpoint_in_the_authors_format(name):
    """The authors' optimizers store step as a Python int and know no maximize/backend."""
    params = make_params([(20,), (4,)])
    straight = clone_params(params)
    opt_straight = OPTIMIZERS[name](straight, lr=1e-2)
    train(opt_straight, straight, 7)

    opt = OPTIMIZERS[name](params, lr=1e-2)
    train(opt, params, 4)
    saved = copy.deepcopy(opt.state_dict())
    for state in saved["state"].values():
        state["step"] = int(state["step"].item())
    for group in saved["param_groups"]:
        del group["maximize"], group["backend"]
    resumed = clone_params(params)
    opt2 = OPTIMIZERS[name](resumed, lr=1e-2)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["maximize"] is False
    assert opt2.state[resumed[0]]["step"].dtype == torch.float32
    train(opt2, resumed, 3, start=4)
    for p, q in zip(resumed, straight):
        assert torch.equal(p, q)


def test_loading_another_optimizers_state_dict_raises_before_changing_anything():
    """AdamW's groups have two betas: the load is refused, naming the group and the
    argument, and the optimizer goes on as it was."""
    params = make_params([(4,)])
    adamw = torch.optim.AdamW(params)
    opt = AdaPNM(params, lr=0.05)
    train(opt, params, 2)
    adamw.step()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"state_dict\['param_groups'\]\[0\]: betas must be"):
        opt.load_state_dict(adamw.state_dict())
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["betas"] == (0.9, 0.999, 1.0)
    for key, value in opt.state[params[0]].items():
        assert torch.equal(value, before["state"][0][key]), key
    train(opt, params, 1, start=2)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@BOTH
def test_a_copy_is_independent(name, how):
    params = make_params([(5,)])
    opt = OPTIMIZERS[name](params)
    train(opt, params, 3)
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    twin_param = twin.param_groups[0]["params"][0]
    torch.testing.assert_close(twin.state[twin_param]["exp_avg" if name == "AdaPNM" else "pos_momentum"],
                               opt.state[params[0]]["exp_avg" if name == "AdaPNM" else "pos_momentum"])
    twin_param.grad = torch.ones_like(twin_param)
    twin.step()
    assert opt.state[params[0]]["step"].item() == 3


def test_amsgrad_switched_on_mid_run_creates_its_buffer():
    params = make_params([(5,)])
    opt = AdaPNM(params, amsgrad=False)
    train(opt, params, 2)
    assert "max_exp_avg_sq" not in opt.state[params[0]]
    opt.param_groups[0]["amsgrad"] = True
    train(opt, params, 1, start=2)
    assert "max_exp_avg_sq" in opt.state[params[0]]


def test_auto_backend_picks_fused_on_cpu_when_built():
    expected = "fused" if "fused" in available_backends("cpu") else "foreach"
    assert _backends.resolve_backend("auto", torch.device("cpu"), torch.float32) == expected
    assert _backends.resolve_backend("auto", torch.device("cpu"), torch.float64) == expected


# --- bad input: a clear error, and nothing touched --------------------------------------

BAD_HYPER = [
    ("PNM", dict(lr=-1.0), "lr"),
    ("PNM", dict(lr=float("nan")), "lr"),
    ("PNM", dict(lr=float("inf")), "lr"),
    ("PNM", dict(lr=torch.tensor([0.1, 0.2])), "lr"),
    ("PNM", dict(betas=(0.9, 1.0, 1.0)), "betas"),
    ("PNM", dict(betas=(1.0, 1.0)), "beta1"),
    ("PNM", dict(betas=(-0.1, 1.0)), "beta1"),
    ("PNM", dict(betas=(0.9, float("nan"))), "beta0"),
    ("PNM", dict(betas=(0.9, float("inf"))), "beta0"),
    ("PNM", dict(weight_decay=-1e-3), "weight_decay"),
    ("PNM", dict(weight_decay=float("nan")), "weight_decay"),
    ("PNM", dict(decoupled="yes"), "decoupled"),
    ("PNM", dict(backend="cuda-magic"), "backend"),
    ("AdaPNM", dict(betas=(0.9, 1.0)), "betas"),
    ("AdaPNM", dict(betas=(0.9, 1.0, 1.0)), "beta2"),
    ("AdaPNM", dict(betas=(0.9, float("nan"), 1.0)), "beta2"),
    ("AdaPNM", dict(eps=-1e-8), "eps"),
    ("AdaPNM", dict(eps=float("inf")), "eps"),
    ("AdaPNM", dict(amsgrad=1), "amsgrad"),
]


@pytest.mark.parametrize("name,kwargs,culprit", BAD_HYPER,
                         ids=[f"{n}-{c}-{i}" for i, (n, _, c) in enumerate(BAD_HYPER)])
def test_invalid_hyper_parameters_raise_naming_the_argument(name, kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        OPTIMIZERS[name]([torch.zeros(2, requires_grad=True)], **kwargs)


@BOTH
def test_a_parameter_listed_twice_raises_naming_both_places(name):
    """torch's optimizers warn that a duplicate will become an error; the backends would each
    step it differently (twice in turn, or twice at once), so here it is one already."""
    a, b = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\] is the same "
                                         r"tensor as param_groups\[0\]\['params'\]\[0\]"):
        OPTIMIZERS[name](iter([a, b, a]))
    opt = OPTIMIZERS[name]([b])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\]"):
        opt.add_param_group({"params": [("a", a), ("a_again", a)]})
    assert len(opt.param_groups) == 1


@BOTH
def test_negative_b0_is_legal(name):
    betas = (0.9, 0.999, -0.4) if name == "AdaPNM" else (0.9, -0.4)
    OPTIMIZERS[name]([torch.zeros(2, requires_grad=True)], betas=betas)


@BOTH
def test_invalid_value_set_after_construction_raises_at_step_before_any_change(name):
    params = make_params([(4,)])
    opt = OPTIMIZERS[name](params)
    opt.param_groups[0]["lr"] = float("nan")
    params[0].grad = torch.ones_like(params[0])
    before = params[0].detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[0\].*lr"):
        opt.step()
    assert torch.equal(params[0], before) and not opt.state


@pytest.mark.parametrize("path", ["reference"] + FAST_PATHS, indirect=True)
@pytest.mark.parametrize("bad_lr", [float("nan"), -0.1, float("inf")], ids=["nan", "negative", "inf"])
@BOTH
def test_an_invalid_lr_set_between_steps_raises_before_any_change(path, name, bad_lr):
    """As a scheduler sets it, after steps that repeat the last one (whose check of a new
    float lr is the lr's alone): the step raises naming the group, changes nothing, and
    steps again once the lr is valid."""
    params = make_params([(5,), (3, 2)])
    opt = OPTIMIZERS[name]([dict(params=params[:1]), dict(params=params[1:])], lr=0.01,
                           backend=path)
    train(opt, params, 3)
    opt.param_groups[1]["lr"] = bad_lr
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"param_groups\[1\]: invalid lr"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert [opt.state[p]["step"].item() for p in params] == [3, 3]
    opt.param_groups[1]["lr"] = 0.005
    opt.step()
    assert [opt.state[p]["step"].item() for p in params] == [4, 4]


def _bad_grad_cases():
    return [
        ("sparse", torch.zeros(3, 2).to_sparse(), "sparse"),
        ("shape", torch.zeros(2, 3), "does not match"),
        ("dtype", torch.zeros(3, 2, dtype=torch.float64), "does not match"),
    ]


@pytest.mark.parametrize("native_check", [True, False], ids=["cpp-check", "python-check"])
@pytest.mark.parametrize("case,grad,message", _bad_grad_cases(), ids=lambda x: x if isinstance(x, str) else "")
@BOTH
def test_bad_gradient_raises_and_leaves_every_group_untouched(name, case, grad, message,
                                                              native_check, monkeypatch):
    if not native_check:  # as without the compiled extension
        monkeypatch.setattr(_backends, "first_mismatched_grad", None)
    good = make_params([(5,), (6,)])
    bad = torch.zeros(3, 2, requires_grad=True)
    opt = OPTIMIZERS[name]([{"params": good}, {"params": [bad], "lr": 0.1}])
    train(opt, good, 2)
    snapshot = copy.deepcopy(opt.state_dict())
    values = [p.detach().clone() for p in good]
    for p in good:
        p.grad = torch.ones_like(p)
    if grad.is_sparse:
        bad.grad = grad
    else:  # torch's grad setter refuses such gradients; .data does not check
        bad.grad = torch.zeros(3, 2)
        bad.grad.data = grad
    with pytest.raises(RuntimeError, match=rf"param_groups\[1\]\['params'\]\[0\].*{message}"):
        opt.step()
    for p, v in zip(good, values):
        assert torch.equal(p, v)
    assert bad not in opt.state
    after = opt.state_dict()
    for k, state in snapshot["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][k][key], value)


@pytest.mark.parametrize("backend", ["foreach", "reference"])
@BOTH
def test_a_host_reading_backend_refuses_a_cuda_graph_capture_untouched(name, backend,
                                                                       monkeypatch):
    """backend="foreach" and "reference" read each step count on the host, which a CUDA
    graph capture cannot record: the step raises, naming what can be captured, before any
    group is touched (as torch's optimizers refuse a capture without capturable=True), also
    where another group's fused step would have run first. The capture is simulated here, on
    CPU tensors (tests/test_cuda.py captures for real)."""
    fused, host = make_params([(5,), (6,)]), make_params([(4,)], seed=1)
    opt = OPTIMIZERS[name]([{"params": fused, "backend": "fused"},
                            {"params": host, "backend": backend}])
    train(opt, fused + host, 2)
    snapshot = copy.deepcopy(opt.state_dict())
    values = [p.detach().clone() for p in fused + host]
    for p in fused + host:
        p.grad = torch.ones_like(p)
    monkeypatch.setattr(_backends, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match=rf"backend='{backend}' reads each parameter's step "
                                           r"count on the host.*backend='fused' or 'triton'"):
        opt.step()
    assert all(torch.equal(p, v) for p, v in zip(fused + host, values))
    after = opt.state_dict()
    for k, state in snapshot["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][k][key], value)
    monkeypatch.undo()
    opt.step()  # outside a capture it steps
    assert not torch.equal(host[0], values[-1])


@pytest.mark.parametrize("backend", ["fused", "triton"])
def test_unsupported_dtype_for_a_kernel_backend_names_the_parameter(backend):
    """float64 has fused kernels but no Triton ones; float8 has neither (nor any backend)."""
    dtypes = [torch.float64, torch.float8_e4m3fn] if backend == "triton" else [torch.float8_e4m3fn]
    for dtype in dtypes:
        p = torch.zeros(3, dtype=dtype, requires_grad=True)
        opt = PNM([p], backend=backend)
        p.grad = torch.ones(3).to(dtype)
        with pytest.raises(RuntimeError, match=rf"params'\]\[0\].*{dtype}.*unavailable"):
            opt.step()
        assert not opt.state
    p = torch.zeros(3, dtype=torch.float8_e4m3fn, requires_grad=True)
    opt = PNM([p])
    p.grad = torch.ones(3).to(p.dtype)
    with pytest.raises(ValueError, match=r"params'\]\[0\].*unsupported parameter dtype"):
        opt.step()


def test_unavailable_backend_says_why(monkeypatch):
    monkeypatch.setattr(_backends, "extension_error", lambda: "built without it, for the test")
    p = torch.zeros(3, requires_grad=True)
    opt = PNM([p], backend="fused")
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="built without it, for the test"):
        opt.step()
    assert torch.equal(p, torch.zeros(3))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_on_cpu_without_the_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = torch.zeros(3, requires_grad=True)
    opt = PNM([p], backend="triton")
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        opt.step()


def test_triton_without_triton_installed_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    p = torch.zeros(3, requires_grad=True)
    opt = PNM([p], backend="triton")
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        opt.step()
    assert torch.equal(p, torch.zeros(3)) and not opt.state


def test_fused_on_a_device_without_kernels_says_why():
    p = torch.zeros(3, device="meta", requires_grad=True)
    opt = PNM([p], backend="fused")
    p.grad = torch.zeros(3, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        opt.step()


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_clipping_set_to_none_false_and_freezing_mid_training(path, name):
    """clip_grad_norm_ before the step, zero_grad(set_to_none=False), and a parameter frozen
    half-way (no gradient: no step, state kept) behave as with the reference."""
    runs = []
    for backend in (path, "reference"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(DEVICE)
        opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, backend=backend)
        x, y = torch.randn(16, 6, device=DEVICE), torch.randn(16, 2, device=DEVICE)
        for t in range(8):
            if t == 4:
                model[0].weight.requires_grad_(False)
                model[0].weight.grad = None
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
            opt.step()
        runs.append((model, opt))
    (m, o), (rm, ro) = runs
    assert o.state[m[0].weight]["step"].item() == 4 and o.state[m[2].weight]["step"].item() == 8
    assert_states_close(o, list(m.parameters()), ro, list(rm.parameters()))


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_one_optimizer_per_parameter_stepped_inside_backward(path, name):
    """The optimizer-in-backward pattern (torch's "fuse the optimizer step into the backward
    pass"): one optimizer per parameter, stepped and zeroed by a post-accumulate-grad hook
    while autograd is still running, so no parameter's gradient outlives its step. The
    parameters and every state buffer end as with the reference."""
    runs = []
    for backend in (path, "reference"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(DEVICE)
        opts = {p: OPTIMIZERS[name]([p], lr=1e-2, weight_decay=0.1, backend=backend)
                for p in model.parameters()}

        def step_now(p):
            opts[p].step()
            opts[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_now)
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 2, generator=gen)
            torch.nn.functional.mse_loss(model(x.to(DEVICE)), y.to(DEVICE)).backward()
        assert all(p.grad is None for p in model.parameters())
        runs.append((list(model.parameters()), opts))
    (params, opts), (ref_params, ref_opts) = runs
    for p, q in zip(params, ref_params):
        assert opts[p].state[p]["step"].item() == 6
        assert_states_close(opts[p], [p], ref_opts[q], [q])


@pytest.mark.parametrize("native_check", [True, False], ids=["cpp-check", "python-check"])
@BOTH
def test_bad_gradient_after_cached_steps_is_still_caught(name, native_check, monkeypatch):
    """Once the grouping is cached, gradients are still checked every step."""
    if not native_check:
        monkeypatch.setattr(_backends, "first_mismatched_grad", None)
    params = make_params([(5,), (3, 2), (7,)])
    opt = OPTIMIZERS[name](params)
    train(opt, params, 3)
    values = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    params[1].grad.data = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[1\].*does not match"):
        opt.step()
    for p, v, s in zip(params, values, steps):
        assert torch.equal(p, v) and torch.equal(opt.state[p]["step"], s)


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_gradients_laid_out_unlike_their_parameters_after_cached_steps(path, name):
    """A transposed gradient for a contiguous parameter, arriving after the tensor lists were
    cached, is copied densely for the kernels; later contiguous gradients use the cache."""
    opt, params, ref, ref_params = with_reference(name, path, [(4, 6), (5,), (3, 2)])
    for t in range(8):
        for ps in (params, ref_params):
            gen = torch.Generator().manual_seed(t)
            grads = [torch.randn(p.shape, generator=gen) for p in ps]
            if 3 <= t < 6:  # same values, other layout
                grads[0] = grads[0].t().contiguous().t()
            for p, g in zip(ps, grads):
                p.grad = g.to(DEVICE)
        assert (params[0].grad.is_contiguous()) == (not 3 <= t < 6)
        opt.step()
        ref.step()
    assert_states_close(opt, params, ref, ref_params)


@BOTH
def test_a_kernel_refusal_no_gradient_explains_is_raised_untouched(name):
    """The fused kernel checks every argument before it touches anything; when none of the
    gradients is at fault, its own error reaches the user and nothing has changed."""
    params = make_params([(5,), (3, 2)])
    opt = OPTIMIZERS[name](params, backend="fused")
    train(opt, params, 3)
    values = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].clone() for p in params]
    opt.grad_scale = torch.tensor(1.0, dtype=torch.float64, device=DEVICE)  # must be float32
    with pytest.raises(RuntimeError, match="grad_scale must be a float32 tensor"):
        opt.step()
    for p, v, s in zip(params, values, steps):
        assert torch.equal(p, v) and torch.equal(opt.state[p]["step"], s)


@BOTH
def test_extra_group_keys_including_tensors_are_carried_along(name):
    params = make_params([(4,)])
    opt = OPTIMIZERS[name]([{"params": params, "tag": "decoder", "scale": torch.tensor(2.0)}])
    train(opt, params, 2)
    opt.param_groups[0]["scale"].mul_(2)  # a user's own tensor, changed in place
    train(opt, params, 1, start=2)
    assert opt.param_groups[0]["tag"] == "decoder" and opt.state[params[0]]["step"].item() == 3


@pytest.mark.parametrize("path", ["reference"] + FAST_PATHS, indirect=True)
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_a_backward_through_a_graph_that_saved_a_stepped_parameter_raises(path, name):
    """As with torch's optimizers, a step bumps the version counter of every tensor it
    writes, so autograd refuses to reuse a graph that saved a parameter the step changed
    instead of silently using the new values: the first (planned) step and the repeated
    ones after it."""
    w = torch.randn(3, 3, device=DEVICE, requires_grad=True)
    x = torch.randn(2, 3, device=DEVICE, requires_grad=True)
    opt = OPTIMIZERS[name]([w], lr=0.1, backend=path)
    for t in range(3):
        loss = (x @ w).pow(2).sum()  # saves w for x's gradient
        loss.backward(retain_graph=True)
        opt.step()
        assert opt.state[w]["step"]._version > t
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_a_parameter_replaced_in_its_group_between_steps_is_followed(path, name):
    """Steps after the first repeat the last one without planning while nothing they depend
    on changed; a parameter swapped into the group's own list in place is such a change."""
    def replace(o, ps):
        ps[1] = o.param_groups[0]["params"][1] = ps[1].detach().clone().mul_(2).requires_grad_()

    _second_parameter_restarted_after_three_steps(name, path, replace)


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_a_hyper_parameter_edited_between_steps_is_validated_again(path, name):
    """A repeated step checks that no hyper-parameter changed since the last one; an edited
    group is validated again, with the same errors as at construction."""
    params = make_params([(5,), (3, 2)])
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path)
    train(opt, params, 3)
    opt.param_groups[0]["backend"] = "fastest"
    with pytest.raises(ValueError, match=r"param_groups\[0\]: backend must be one of"):
        opt.step()
    opt.param_groups[0]["backend"] = path
    opt.param_groups[0]["weight_decay"] = -0.5
    with pytest.raises(ValueError, match=r"param_groups\[0\].*weight_decay"):
        opt.step()


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@BOTH
def test_repeated_steps_over_several_groups_match_the_reference(path, name):
    """Two param groups (say, with and without weight decay) stepping together, then one
    parameter without a gradient for a step, then a bad gradient in the second group: the
    repeated steps agree with the reference, and the bad one is refused, naming it, with
    nothing written in either group."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,), (4,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        o.param_groups[0]["params"] = ps[:2]
        o.add_param_group(dict(params=ps[2:], weight_decay=0.0, lr=3e-3))
        train(o, ps, 4)
        ps[3].grad = None
        train(o, ps[:3], 1, start=4)
        train(o, ps, 3, start=5)
    assert_states_close(opt, params, ref, ref_params)
    values = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    params[3].grad.data = torch.ones(4, dtype=torch.float64)  # the setter would refuse it
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[1\]"):
        opt.step()
    for p, v, s in zip(params, values, steps):
        assert torch.equal(p, v) and torch.equal(opt.state[p]["step"], s)


def _steps_with_random_events(name, backends, seed, steps=80, missing=0.25,
                              dtypes=(torch.float32,), repeat=True):
    """Steps over three groups (on `backends`, one each, or one for all) in which, at
    random, a fraction `missing` of the gradients are missing and, now and then, a
    user_event happens (hyper-parameters changed, state deleted, replaced or reloaded: see
    conftest) or a parameter is given new data. The parameters take `dtypes` in turn;
    without `repeat` every step is planned."""
    events = random.Random(seed)
    torch.manual_seed(seed)
    shapes = [(events.randint(1, 40),) for _ in range(7)] + [(3, 5), (2, 2, 3)]
    params = [torch.randn(s, device=DEVICE).to(dtypes[i % len(dtypes)]).requires_grad_()
              for i, s in enumerate(shapes)]
    backends = [backends] * 3 if isinstance(backends, str) else backends
    opt = OPTIMIZERS[name]([dict(params=params[:4], backend=backends[0]),
                            dict(params=params[4:7], weight_decay=0.1, backend=backends[1]),
                            dict(params=params[7:], lr=3e-3, backend=backends[2])], lr=1e-2)
    if not repeat:
        _never_repeating(opt)
    for t in range(steps):
        for p, g in zip(params, grads_for_step(params, t, seed)):
            p.grad = None if events.random() < missing else g
        event, k = user_event(opt, params, events, name)
        if 0.24 <= event < 0.27:
            params[k].data = params[k].data.clone()
        opt.step()
    return opt, params


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@pytest.mark.parametrize("seed", [0, 1])
@BOTH
def test_any_sequence_of_user_events_gives_the_references_steps(path, name, seed):
    """Whatever a user does between steps, in whatever order, the fast paths (with their
    cached and repeated steps) give what the reference gives, state included."""
    opt, params = _steps_with_random_events(name, path, seed)
    ref, ref_params = _steps_with_random_events(name, "reference", seed)
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("path", ["fused", "emulated", "triton"], indirect=True)
@pytest.mark.parametrize("seed", [0, 1])
@BOTH
def test_user_events_over_groups_of_several_dtypes_repeat_as_planned_steps_step(path, name,
                                                                                seed):
    """The same over parameters of three dtypes, each group one batch per dtype: the steps,
    repeated where they can be, give bit for bit what steps planned afresh every time give."""
    opt, params = _steps_with_random_events(name, path, seed, dtypes=MIXED, missing=0.1)
    planned, planned_params = _steps_with_random_events(name, path, seed, dtypes=MIXED,
                                                        missing=0.1, repeat=False)
    assert_states_close(opt, params, planned, planned_params, rtol=0, atol=0)


@pytest.mark.parametrize("backends", [("triton",) * 3, ("fused", "triton", "triton"),
                                      ("triton", "fused", "fused")], ids="-".join)
@pytest.mark.parametrize("seed", [0, 1])
@BOTH
def test_user_events_over_groups_on_several_backends_between_repeated_steps(backends, name,
                                                                            seed):
    """The same with one gradient in fifty missing, so that most steps have every gradient
    and repeat (fused and Triton groups side by side) between the events."""
    if _backends.extension_error() is not None or not HAS_TRITON:
        pytest.skip("needs pnm_kernels._C and triton")
    opt, params = _steps_with_random_events(name, backends, seed, missing=0.02)
    ref, ref_params = _steps_with_random_events(name, "reference", seed, missing=0.02)
    assert_states_close(opt, params, ref, ref_params)
