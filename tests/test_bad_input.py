"""Bad input gets a clear error (naming the group, parameter or argument at fault, or saying
what is missing and why), and nothing is touched: no parameter, state buffer or step
counter changes, in any group."""
import copy
import re
import sys

import pytest
import torch

import cases
from cases import FAST_PATHS, OVER_OPTIMIZERS
from conftest import DEVICE, HAS_TRITON, OPTIMIZERS, make_params, train
from internals import (extension_unavailable, python_gradient_checks,
                       simulate_cuda_graph_capture, simulate_triton_graph_capture,
                       unchecked_scaling)
from pnm_kernels import PNM


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
    # past float32's range (the step's factors are float32): refused, not NaN or an overflow
    # error midway through a step; a Python int past a float's range is named too
    ("PNM", dict(lr=10**400), "invalid lr an integer of 401 digits"),
    ("PNM", dict(betas=(0.9, -1e39)), "beta0"),
    ("PNM", dict(weight_decay=10**400), "weight_decay"),
    ("PNM", dict(lr=1e30, weight_decay=1e10), r"lr \* weight_decay is 1e\+40"),
    ("AdaPNM", dict(eps=1e39), "eps"),
    ("AdaPNM", dict(lr=1e31, betas=(1 - 1e-8, 0.999, 1.0)), r"lr / \(1 - beta1\)"),
    ("PNM", dict(lr=torch.tensor(0.1, device="meta")), "tensor lr is on the meta device"),
]


@pytest.mark.parametrize("name,kwargs,culprit", BAD_HYPER,
                         ids=[f"{n}-{c}-{i}" for i, (n, _, c) in enumerate(BAD_HYPER)])
def test_invalid_hyper_parameters_raise_naming_the_argument(name, kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        OPTIMIZERS[name]([torch.zeros(2, requires_grad=True)], **kwargs)


@OVER_OPTIMIZERS
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


@OVER_OPTIMIZERS
def test_negative_b0_is_legal(name):
    betas = (0.9, 0.999, -0.4) if name == "AdaPNM" else (0.9, -0.4)
    OPTIMIZERS[name]([torch.zeros(2, requires_grad=True)], betas=betas)


@OVER_OPTIMIZERS
def test_invalid_value_set_after_construction_raises_at_step_before_any_change(name):
    params = make_params([(4,)])
    opt = OPTIMIZERS[name](params)
    opt.param_groups[0]["lr"] = float("nan")
    params[0].grad = torch.ones_like(params[0])
    before = params[0].detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[0\].*lr"):
        opt.step()
    assert torch.equal(params[0], before) and not opt.state


def _set_lr(group, how, value):
    if how == "assigned":
        group["lr"] = value
    elif how == "tensor_filled":
        group["lr"].fill_(value)  # as torch's schedulers set a tensor lr
    else:
        group["lr"].data.fill_(value)  # bumps no version: the value itself must be read


@pytest.mark.parametrize("how", ["assigned", "tensor_filled", "tensor_data_filled"])
@pytest.mark.parametrize("bad_lr", [float("nan"), -0.1, float("inf"), 1e39],
                         ids=["nan", "negative", "inf", "past-float32"])
@cases.parametrize(["reference"] + FAST_PATHS)
def test_an_invalid_lr_set_between_steps_raises_before_any_change(path, name, bad_lr, how):
    """As a scheduler sets it, after steps that repeat the last one (whose check of a new
    float lr is the lr's alone): the step raises naming the group, changes nothing, and
    steps again once the lr is valid."""
    params = make_params([(5,), (3, 2)])
    # (a float64 tensor lr holds a value past float32's range)
    dtype = torch.float64 if abs(bad_lr) > 1e38 else torch.float32
    lr = 0.01 if how == "assigned" else torch.tensor(0.01, dtype=dtype)
    opt = OPTIMIZERS[name]([dict(params=params[:1]), dict(params=params[1:], lr=lr)], lr=0.01,
                           backend=path)
    train(opt, params, 3)
    _set_lr(opt.param_groups[1], how, bad_lr)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"param_groups\[1\]: invalid lr"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert [opt.state[p]["step"].item() for p in params] == [3, 3]
    _set_lr(opt.param_groups[1], how, 0.005)
    opt.step()
    assert [opt.state[p]["step"].item() for p in params] == [4, 4]


@cases.parametrize(["reference"] + FAST_PATHS)
def test_an_lr_whose_decay_factor_leaves_float32_is_refused_between_steps(path, name):
    """A new float lr alone is checked on a repeated step, with its products: lr *
    weight_decay past float32's range is refused naming the group, nothing stepped (the
    kernels would write NaN, torch's float32 ops raise midway)."""
    params = make_params([(5,), (3, 2)])
    opt = OPTIMIZERS[name]([dict(params=params[:1]), dict(params=params[1:], weight_decay=10.0)],
                           lr=0.01, backend=path)
    train(opt, params, 3)
    opt.param_groups[1]["lr"] = 1e38
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"param_groups\[1\]: lr \* weight_decay is 1e\+39"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert [opt.state[p]["step"].item() for p in params] == [3, 3]


@pytest.mark.parametrize("backend", ["reference", "foreach"])
@pytest.mark.parametrize("kwargs,culprit", [
    (dict(lr=1e5), "lr"), (dict(betas=(0.9, 1e5)), r"1 \+ \|beta0\|"),
    (dict(weight_decay=1e5, decoupled=False), "weight_decay")], ids=["lr", "beta0", "l2"])
def test_a_factor_past_float16s_range_is_refused_where_float16_parameters_step_in_float16(
        backend, kwargs, culprit):
    """The reference and foreach step float16 parameters in float16 torch ops, which raise
    on such a scalar midway through a step (a float32 group stepped, the float16 one's
    counter advanced): refused before, naming it; the kernels compute in float32."""
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4).half())]
    opt = PNM(params, backend=backend, **{"lr": 1e-3, **kwargs})
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: {culprit} is .* past float16's"):
        opt.step()
    assert all(torch.equal(p, torch.ones_like(p)) for p in params) and not opt.state
    opt.param_groups[0]["backend"] = "fused"
    opt.step()  # float32 arithmetic
    assert all(bool(torch.isfinite(p).all()) for p in params)


@cases.parametrize(FAST_PATHS)
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
    opt.param_groups[0]["weight_decay"] = 0.0
    # Equal to the flag it replaces (1 == True), yet no bool: refused as at construction.
    opt.param_groups[0]["maximize"] = 0
    with pytest.raises(ValueError, match=r"param_groups\[0\]: maximize must be a bool, got 0"):
        opt.step()


def _bad_grad_cases():
    return [
        ("sparse", torch.zeros(3, 2).to_sparse(), "sparse"),
        ("shape", torch.zeros(2, 3), "does not match"),
        ("dtype", torch.zeros(3, 2, dtype=torch.float64), "does not match"),
    ]


@pytest.mark.parametrize("native_check", [True, False], ids=["cpp-check", "python-check"])
@pytest.mark.parametrize("case,grad,message", _bad_grad_cases(), ids=lambda x: x if isinstance(x, str) else "")
@OVER_OPTIMIZERS
def test_bad_gradient_raises_and_leaves_every_group_untouched(name, case, grad, message,
                                                              native_check, monkeypatch):
    if not native_check:  # as without the compiled extension
        python_gradient_checks(monkeypatch)
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


@pytest.mark.parametrize("native_check", [True, False], ids=["cpp-check", "python-check"])
@OVER_OPTIMIZERS
def test_bad_gradient_after_cached_steps_is_still_caught(name, native_check, monkeypatch):
    """Once the grouping is cached, gradients are still checked every step."""
    if not native_check:
        python_gradient_checks(monkeypatch)
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


@pytest.mark.parametrize("lazy", ["parameter", "gradient"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_an_unresolved_conjugate_view_raises_naming_the_parameter_untouched(path, name, lazy):
    """`p.data = p.data.conj()` (or a gradient that is one) after steps: the step reads and
    writes memory, which a lazy conjugate's is not; refused before any group has stepped."""
    if path == "triton":
        pytest.skip("Triton steps no complex parameters")
    params = make_params([(4,)]) + [torch.randn(3, dtype=torch.complex64, device=DEVICE)
                                     .requires_grad_()]
    opt = OPTIMIZERS[name]([dict(params=params[:1]), dict(params=params[1:])], backend=path)
    train(opt, params, 2)
    if lazy == "parameter":
        params[1].data = params[1].data.conj()
    values = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    if lazy == "gradient":
        params[1].grad = params[1].grad.conj()
    with pytest.raises(RuntimeError, match=r"groups\[1\]\['params'\]\[0\].* unresolved conjugate"):
        opt.step()
    for p, v in zip(params, values):
        assert torch.equal(p, v)


@OVER_OPTIMIZERS
def test_a_kernel_refusal_no_gradient_explains_is_raised_untouched(name, monkeypatch):
    """The fused kernel checks every argument before it touches anything; when none of the
    gradients is at fault, its own error reaches the user and nothing has changed. (A
    float64 grad_scale, let through the optimizer's own check of it.)"""
    unchecked_scaling(monkeypatch)
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


BAD_SCALING = {
    "float64 grad_scale": ("grad_scale", torch.tensor(2.0, dtype=torch.float64)),
    "bfloat16 grad_scale": ("grad_scale", torch.tensor(2.0, dtype=torch.bfloat16)),
    "int64 found_inf": ("found_inf", torch.tensor(0)),
    "two-element found_inf": ("found_inf", torch.zeros(2)),
    "float found_inf": ("found_inf", 0.0),
}


@pytest.mark.parametrize("bad", sorted(BAD_SCALING))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_grad_scale_or_found_inf_not_as_grad_scaler_sets_them_is_refused_untouched(path, name,
                                                                                  bad):
    """optimizer.grad_scale/found_inf set by hand: anything but a float32 tensor of one
    element is refused, naming it, before any backend touches anything (the backends used
    to differ: some stepped, some raised after stepping)."""
    params = make_params([(4, 256), (5,)])
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=torch.int8)
    train(opt, params, 2)
    values = [p.detach().clone() for p in params]
    attribute, value = BAD_SCALING[bad]
    setattr(opt, attribute, value.to(DEVICE) if isinstance(value, torch.Tensor) else value)
    with pytest.raises(ValueError, match=f"optimizer.{attribute} must be a float32 tensor of "
                                         "one element"):
        opt.step()
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert all(int(opt.state[p]["step"]) == 2 for p in params)


@pytest.mark.parametrize("where", ["parameter", "state"])
@pytest.mark.parametrize("attribute", ["grad_scale", "found_inf"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_grad_scale_or_found_inf_in_memory_the_step_writes_is_refused_untouched(path, name,
                                                                                attribute,
                                                                                where):
    """GradScaler's tensors are read while the step writes, as a tensor lr is: one set by
    hand into a parameter's or a state buffer's memory is refused naming both, before
    anything moves (stepped, the backends each read it before or after writing it: a
    partial step on some), also after steps whose lists are held."""
    params = make_params([(4, 256), (5,)])
    opt = OPTIMIZERS[name](params, backend=path)
    train(opt, params, 2)
    key = "exp_avg" if name == "AdaPNM" else "pos_momentum"
    target = params[0] if where == "parameter" else opt.state[params[0]][key]
    target.data[1, 7:8].fill_(0.0 if attribute == "found_inf" else 1.0)
    setattr(opt, attribute, target.data[1, 7:8])
    values = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    whose = "" if where == "parameter" else f"'s state '{key}'"
    with pytest.raises(RuntimeError, match=rf"optimizer.{attribute} \(GradScaler's\) shares "
                                           rf"memory with param_groups\[0\]\['params'\]\[0\] "
                                           rf"\(.*\){re.escape(whose)}, which the step writes"):
        opt.step()
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert all(torch.equal(opt.state[p][k], v) for p, state in zip(params, states)
               for k, v in state.items())


@cases.parametrize(FAST_PATHS + ["reference"])
def test_grad_scale_and_found_inf_of_shape_one_step_as_scalars(path, name):
    """One element of shape (1,) is taken as GradScaler's 0-dim tensors are, on every path."""
    runs = []
    for shape in ((), (1,)):
        params = make_params([(4, 256), (5,)])
        opt = OPTIMIZERS[name](params, backend=path)
        opt.grad_scale = torch.full(shape, 4.0, device=DEVICE)
        opt.found_inf = torch.zeros(shape, device=DEVICE)
        train(opt, params, 2)
        runs.append(params)
    assert all(torch.equal(p, q) for p, q in zip(*runs))


@pytest.mark.parametrize("backend", ["foreach", "reference"])
@OVER_OPTIMIZERS
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
    simulate_cuda_graph_capture(monkeypatch)
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


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16], ids=["plain", "bf16-state"])
@cases.parametrize(["triton"], optimizers=["PNM"], args=["path"])
def test_triton_tables_needed_inside_a_graph_capture_raise_clearly(path, state_dtype,
                                                                   monkeypatch):
    """Tables for new addresses would need a host-to-device copy, which a CUDA graph capture
    forbids: the step says so (and what to do) instead of failing inside CUDA."""
    params = make_params([(5,), (3, 2)])
    opt = PNM(params, backend=path, state_dtype=state_dtype)
    train(opt, params, 2)
    simulate_triton_graph_capture(monkeypatch)
    for p in params:  # gradients kept, as zero_grad(set_to_none=False) keeps them
        p.grad.fill_(0.5)
    opt.step()  # same addresses as in the last step: its tables are used as they are
    params[0].grad = torch.ones(5, device=DEVICE)  # a new address
    with pytest.raises(RuntimeError, match="set_to_none=False"):
        opt.step()


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
    if backend == "triton":  # a complex128 parameter steps as its float64 real view
        p = torch.zeros(3, dtype=torch.complex128, requires_grad=True)
        opt = PNM([p], backend=backend)
        p.grad = torch.ones_like(p)
        with pytest.raises(RuntimeError, match=r"params'\]\[0\].*complex128 steps as its "
                                               r"real view, torch.float64"):
            opt.step()
        assert not opt.state
    p = torch.zeros(3, dtype=torch.float8_e4m3fn, requires_grad=True)
    opt = PNM([p])
    p.grad = torch.ones(3).to(p.dtype)
    with pytest.raises(ValueError, match=r"params'\]\[0\].*unsupported parameter dtype"):
        opt.step()


def test_unavailable_backend_says_why(monkeypatch):
    extension_unavailable(monkeypatch, "built without it, for the test")
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
