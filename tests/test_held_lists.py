"""The repeated fast step: the fused and Triton paths hold the tensor lists they built and
repeat the last step without planning while nothing it depends on changed. When it repeats
(schedules, several dtypes, odd layouts, frozen parameters, fused and Triton groups side by
side), when it plans again, when it lets go of what it held (gradients, state, parameters),
parameters given new data or storage: always what the reference, or steps planned afresh
every time, give. (Random sequences of user events: test_user_event_sequences.py.)"""
import collections
import copy
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import cases
from cases import FAST_PATHS, FUSED_PATHS, KERNEL_PATHS, OVER_OPTIMIZERS
from conftest import (DEVICE, HAS_TRITON, OPTIMIZERS, assert_states_close, clone_params,
                      grads_for_step, make_params,
                      second_parameter_restarted_after_three_steps, train, with_reference)
from internals import (count_planned_steps, extension_is_built, never_remember_steps,
                       record_repeated_steps, refuse_next_held_fused_step, triton_only_install)


@cases.parametrize(FAST_PATHS)
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
    plans = count_planned_steps(opt, monkeypatch)
    for t in range(20):
        for o, ps in ((opt, params), (ref, ref_params)):
            for i, (p, g) in enumerate(zip(ps, grads_for_step(ps, t))):
                p.grad = None if (i == 4 and t < 6) or (t + i) % 3 == 0 else g
            o.step()
    assert_states_close(opt, params, ref, ref_params)
    if path in ("fused", "emulated"):
        assert len(plans) == 3


@cases.parametrize(["reference"] + FAST_PATHS)
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


@cases.parametrize(FUSED_PATHS)
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
    refusals = refuse_next_held_fused_step(monkeypatch)
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


@pytest.mark.parametrize("how", ["load_state_dict", "new dtype", "del state"])
@cases.parametrize(["reference"] + FAST_PATHS)
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


@cases.parametrize(KERNEL_PATHS)
def test_a_scheduled_lr_keeps_the_repeated_step(path, name, monkeypatch):
    """The repeated fused or Triton step (no planning; see pnm_kernels/repeat.py) survives a new lr or beta1
    every step, as schedulers give: only a change of backend or of the buffers a group
    needs (AMSGrad switched) makes the next step plan again."""
    params = make_params([(50,), (3, 3), (7,), (4,)])
    opt = OPTIMIZERS[name]([dict(params=params[:2]), dict(params=params[2:], weight_decay=0.1)],
                           lr=1e-2, backend=path)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20)
    plans = count_planned_steps(opt, monkeypatch)
    for t in range(8):
        train(opt, params, 1, start=t)
        sched.step()
    assert len(plans) == 1  # the first step only
    if name == "AdaPNM":
        opt.param_groups[1]["amsgrad"] = False
        train(opt, params, 2, start=8)
        assert len(plans) == 2


MIXED = [torch.float32, torch.bfloat16, torch.float16]


def _mixed_dtype_params(seed=0):
    """Twelve parameters of three dtypes in turn: two of each in either half."""
    shapes = [(50,), (3, 3), (7,), (4,), (2, 5), (9,), (1,), (6,), (2, 2), (33,), (5,), (8,)]
    return [p.to(MIXED[i % 3]).detach().requires_grad_()
            for i, p in enumerate(make_params(shapes, seed=seed))]


@pytest.mark.parametrize("skip_every", [0, 2])
@cases.parametrize(KERNEL_PATHS)
def test_a_group_of_several_dtypes_repeats_its_steps(path, name, skip_every, monkeypatch):
    """A param group whose parameters have several dtypes (a bf16 model with fp32 norms) is
    one batch per dtype; its steps repeat too (no planning; see pnm_kernels/repeat.py), also when
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
            never_remember_steps(opt)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        plans = count_planned_steps(opt, monkeypatch)
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
    steps repeated the last one (see pnm_kernels/repeat.py)."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 4, 2, 5, generator=gen).to(memory_format=torch.channels_last),
               torch.randn(7, 6, generator=gen).t(), torch.randn(9, generator=gen)]
    params = [t.to(DEVICE).requires_grad_() for t in tensors]
    opt = OPTIMIZERS[name](params, lr=1e-2, weight_decay=0.1, backend=path)
    if not repeat:
        never_remember_steps(opt)
    repeated = record_repeated_steps(opt, monkeypatch)
    for t in range(10):
        for p, g in zip(params, grads_for_step(params, t)):
            p.grad = g.contiguous() if t == 5 else torch.empty_like(p).copy_(g)
        opt.step()
    return opt, params, repeated


@cases.parametrize(KERNEL_PATHS)
def test_dense_parameters_of_other_layouts_repeat_their_steps(path, name, monkeypatch):
    """channels_last and transposed parameters (dense, not contiguous) are held like
    contiguous ones: their steps repeat (no planning; see pnm_kernels/repeat.py); a step whose
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


@cases.parametrize(["triton"])
def test_dense_parameters_of_other_layouts_without_the_compiled_extension(path, name,
                                                                          monkeypatch):
    """The same on a Triton-only install, whose checks of gradients and held lists are in
    Python: a gradient given contiguous to a channels_last parameter (step 5) is copied into
    its layout, never walked as if laid out like it."""
    triton_only_install(monkeypatch)
    opt, params, _ = _dense_odd_layout_steps(name, path, True, monkeypatch)
    ref, ref_params, _ = _dense_odd_layout_steps(name, "reference", True, monkeypatch)
    assert_states_close(opt, params, ref, ref_params)


@cases.parametrize(KERNEL_PATHS)
def test_parameters_that_never_step_keep_the_repeated_step(path, name, monkeypatch):
    """A model passed whole, its frozen part included: parameters that never get a gradient
    have no state, and the steps of the others repeat (Triton's too: its tables name only
    the parameters with state). One that then gets a gradient is given state by a planned
    step, after which the steps repeat again; all as the reference steps."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,), (4,)])
    plans = count_planned_steps(opt, monkeypatch)
    for o, ps in ((opt, params), (ref, ref_params)):
        for t in range(8):
            for i, (p, g) in enumerate(zip(ps, grads_for_step(ps, t))):
                p.grad = g if i != 1 or t >= 5 else None  # ps[1] frozen until step 5
            o.step()
    assert opt.state[params[1]]["step"].item() == 3
    assert len(plans) == 2  # steps 0 and 5
    assert_states_close(opt, params, ref, ref_params)


@OVER_OPTIMIZERS
def test_a_repeated_step_over_fused_and_triton_groups(name, monkeypatch):
    """A Triton group repeats too, beside a fused one, while every one of its parameters has
    a gradient. A step where one lacks a gradient (steps 3 and 4), or has one with gaps
    (step 6), is planned: the Triton tables name every tensor they update, and its kernels
    check nothing. The Triton group is checked before the fused group steps: otherwise the
    fused group would step twice. Every step matches the reference."""
    if not extension_is_built() or not HAS_TRITON:
        pytest.skip("needs pnm_kernels._C and triton")
    monkeypatch.delenv("PNM_KERNELS_EMULATE_CUDA", raising=False)
    params = make_params([(50,), (3, 3), (7,), (4,)])
    ref_params = clone_params(params)
    opt = OPTIMIZERS[name]([dict(params=params[:2], backend="fused"),
                            dict(params=params[2:], backend="triton", lr=3e-3)], lr=1e-2)
    ref = OPTIMIZERS[name]([dict(params=ref_params[:2]), dict(params=ref_params[2:], lr=3e-3)],
                           lr=1e-2, backend="reference")
    plans = count_planned_steps(opt, monkeypatch)
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


@pytest.mark.parametrize("how", ["a plain dict", "a new optimizer.state", "load_state_dict"])
@cases.parametrize(KERNEL_PATHS)
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
    plans = count_planned_steps(opt, monkeypatch)
    train(opt, params, 4, start=2)
    assert len(plans) == 1


@cases.parametrize(FAST_PATHS)
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


@cases.parametrize(FUSED_PATHS)
def test_reading_the_state_between_steps_keeps_the_repeated_step(path, name, monkeypatch):
    """Logging code that reads opt.state[p] of every parameter, one without a gradient (and
    so without state) included, costs no planned step; that parameter still gets its state
    when it gets a gradient."""
    params = make_params([(50,), (3, 3), (7,)])
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path)
    frozen = params[2]
    plans = count_planned_steps(opt, monkeypatch)
    for t in range(4):
        train(opt, params[:2], 1, start=t)
        assert [len(opt.state[p]) for p in params] == [len(opt.state[params[0]])] * 2 + [0]
    assert len(plans) == 1
    train(opt, params, 1, start=4)
    assert opt.state[frozen]["step"].item() == 1 and len(plans) == 2


@cases.parametrize(FAST_PATHS)
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


@cases.parametrize(FAST_PATHS)
def test_a_parameter_replaced_in_its_group_between_steps_is_followed(path, name):
    """Steps after the first repeat the last one without planning while nothing they depend
    on changed; a parameter swapped into the group's own list in place is such a change."""
    def replace(o, ps):
        ps[1] = o.param_groups[0]["params"][1] = ps[1].detach().clone().mul_(2).requires_grad_()

    second_parameter_restarted_after_three_steps(name, path, replace)


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


@pytest.mark.parametrize("change", sorted(NEW_DATA))
@pytest.mark.parametrize("groups", [1, 2])
@cases.parametrize(FAST_PATHS)
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


@cases.parametrize(["triton"])
def test_state_follows_new_data_without_the_compiled_extension(path, name, monkeypatch):
    """The same on a Triton-only install, whose check of the held lists is in Python: the
    Triton kernels walk raw memory, so a buffer left in the old layout would be misread."""
    triton_only_install(monkeypatch)
    opt, params, ref, ref_params = _give_new_data_mid_run(name, path, "channels_last", 1)
    assert_states_close(opt, params, ref, ref_params)


@cases.parametrize(["triton"])
def test_triton_backend_needs_no_compiled_extension(path, name, monkeypatch):
    """A Triton-only install (pnm_kernels._C absent) runs the Triton kernels as they are,
    its tables built from Python, and bumps the version counters from Python."""
    triton_only_install(monkeypatch)
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (4097,)])
    train(opt, params, 6)
    train(ref, ref_params, 6)
    assert_states_close(opt, params, ref, ref_params)
    assert [p._version for p in params] == [6] * len(params)


@cases.parametrize(FAST_PATHS)
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
