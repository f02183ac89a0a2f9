"""PNM and AdaPNM keep torch.optim's contract, on every path: closures and zero_grad, parameters
without gradients, hyper-parameters as numpy scalars, lists, tensors and schedules, step hooks,
named parameters, copies, extra group keys, version counters, clipping and freezing, and
the optimizer stepped inside backward."""
import contextlib
import copy
import pickle
import warnings

import pytest
import torch

import cases
from cases import FAST_PATHS, OVER_OPTIMIZERS
from conftest import (DEVICE, OPTIMIZERS, assert_same_bits, assert_states_close, clone_params,
                      made_under_inference_mode, make_params, train, with_reference)


@OVER_OPTIMIZERS
def test_closure_loss_and_zero_grad(name):
    p = torch.randn(4, requires_grad=True)
    opt = OPTIMIZERS[name]([p])
    loss = opt.step(lambda: (p**2).sum().backward() or (p**2).sum().detach())
    assert loss is not None and p.grad is not None
    opt.zero_grad()
    assert p.grad is None


@OVER_OPTIMIZERS
def test_params_without_grad_get_no_state_and_keep_their_parity(name):
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    opt = OPTIMIZERS[name]([a, b])
    a.grad = torch.ones(3)
    opt.step()
    assert b not in opt.state and opt.state[a]["step"].item() == 1
    b.grad = torch.ones(3)
    opt.step()
    assert opt.state[a]["step"].item() == 2 and opt.state[b]["step"].item() == 1


@cases.parametrize(["reference"] + FAST_PATHS)
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


@pytest.mark.parametrize("state_dtype", [None, torch.int8], ids=["own-state", "int8-state"])
@pytest.mark.parametrize("where", ["first-step", "load-converting", "checkpoint-read"])
@cases.parametrize(["reference"] + FAST_PATHS)
def test_state_made_under_inference_mode_is_stepped_by_the_steps_after_it(path, name, where,
                                                                          state_dtype):
    """torch.inference_mode() around the first step (an evaluation helper's), around a load
    that converts a checkpoint (counters saved as ints, the authors' format), or around the
    read of a checkpoint loaded after it: tensors made there are inference tensors, which no
    step outside the mode may write (torch's optimizers raise then, the first counter
    already advanced; the kernels wrote them). The state is ordinary tensors: training goes
    on bitwise as if no mode had been on."""
    expected = make_params([(3, 200), (2, 128)])
    params = clone_params(expected)
    ordinary = OPTIMIZERS[name](expected, backend=path, state_dtype=state_dtype)
    train(ordinary, expected, 4)
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=state_dtype)
    if where == "first-step":
        calls = []
        hook = opt.register_step_pre_hook(lambda *args: calls.append(1))
        with torch.inference_mode():
            train(opt, params, 1)
        hook.remove()
        assert calls == [1]  # the step's hooks run once
    else:
        train(opt, params, 1)
        saved = copy.deepcopy(opt.state_dict())
        if where == "load-converting":
            for entry in saved["state"].values():
                entry["step"] = int(entry["step"])
            with torch.inference_mode():
                opt.load_state_dict(saved)
        else:
            saved["state"] = {i: {k: made_under_inference_mode(v) for k, v in entry.items()}
                              for i, entry in saved["state"].items()}
            opt.load_state_dict(saved)
    assert not any(torch.is_tensor(v) and v.is_inference()
                   for entry in opt.state.values() for v in entry.values())
    train(opt, params, 3, start=1)
    assert_same_bits(ordinary, expected, opt, params)


def _layer_added_then_a_pass_inside_inference_mode(in_backward, name, backend):
    """A layer's group added after the probe; the next backward pass run inside
    torch.inference_mode() (its graph made outside), which makes the layer's state."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt = OPTIMIZERS[name](a.parameters(), lr=1e-2, backend=backend)
    if in_backward:
        opt.step_in_backward(bucket_mib=1e-6)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    a(x).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.add_param_group({"params": list(b.parameters())})
    for t in range(3):
        loss = b(a(x * t)).square().sum()
        with torch.inference_mode() if t == 0 else contextlib.nullcontext():
            loss.backward()
        opt.step()
        opt.zero_grad()
    return opt, [*a.parameters(), *b.parameters()]


@cases.parametrize(FAST_PATHS)
def test_a_backward_pass_inside_inference_mode_steps_in_backward_with_ordinary_state(path,
                                                                                      name):
    """The step inside backward runs in the pass's mode: state it makes there is made of
    ordinary tensors too, which the steps after it write as the ordinary loop's."""
    opt, params = _layer_added_then_a_pass_inside_inference_mode(True, name, path)
    assert not any(torch.is_tensor(v) and v.is_inference()
                   for entry in opt.state.values() for v in entry.values())
    assert_same_bits(*_layer_added_then_a_pass_inside_inference_mode(False, name, path),
                     opt, params)


@cases.parametrize(["reference"] + FAST_PATHS)
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


@cases.parametrize(FAST_PATHS)
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


@cases.parametrize(["reference"] + FAST_PATHS)
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


@pytest.mark.parametrize("lr", ["float", "tensor"])
@cases.parametrize(FAST_PATHS)
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


@cases.parametrize(FAST_PATHS)
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


@cases.parametrize(FAST_PATHS + ["reference"])
def test_l2_mode_never_writes_into_grad(path, name):
    p = make_params([(33,)])[0]
    opt = OPTIMIZERS[name]([p], weight_decay=0.5, decoupled=False, backend=path)
    p.grad = torch.ones_like(p)
    opt.step()
    torch.testing.assert_close(p.grad, torch.ones_like(p))


@cases.parametrize(FAST_PATHS)
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


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@OVER_OPTIMIZERS
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


@pytest.mark.parametrize("how", ["load_state_dict", "deepcopy", "pickle"])
@OVER_OPTIMIZERS
def test_a_reloaded_or_copied_optimizer_saves_the_same_group_keys(name, how):
    """torch's __setstate__ adds 'differentiable' to the defaults; it is torch's flag (these
    optimizers have no differentiable step), so it must not appear in the groups."""
    params = make_params([(4,)])
    opt = OPTIMIZERS[name](params)
    train(opt, params, 1)
    keys = set(opt.state_dict()["param_groups"][0])
    if how == "load_state_dict":
        opt.load_state_dict(opt.state_dict())
    else:
        opt = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    opt.add_param_group(dict(params=make_params([(3,)])))  # takes the defaults' keys
    assert [set(group) for group in opt.state_dict()["param_groups"]] == [keys, keys]


@OVER_OPTIMIZERS
def test_extra_group_keys_including_tensors_are_carried_along(name):
    params = make_params([(4,)])
    opt = OPTIMIZERS[name]([{"params": params, "tag": "decoder", "scale": torch.tensor(2.0)}])
    train(opt, params, 2)
    opt.param_groups[0]["scale"].mul_(2)  # a user's own tensor, changed in place
    train(opt, params, 1, start=2)
    assert opt.param_groups[0]["tag"] == "decoder" and opt.state[params[0]]["step"].item() == 3


@cases.parametrize(["reference"] + FAST_PATHS)
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


@cases.parametrize(FAST_PATHS)
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


@cases.parametrize(FAST_PATHS)
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
