"""torch.compile: what the compiled step refuses, as eager refuses it, naming the culprit
before any group steps: a bad gradient, state no step can use, a CPU tensor lr or counter
filled with a bad value, memory shared (tensors changed through `.data` or made lazy negative
views after tracing: test_compile_data_edits.py); the checks inside the graph (in C++ and in Python alike, opchecked) and
what they leave alone (a group that does not step, interleaved parameters checked once)."""
import re

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from conftest import DEVICE, OPTIMIZERS, requires_extension
from internals import extension_is_built, state_buffer_names, triton_only_install
from pnm_kernels import aliasing, traced

pytestmark = requires_extension


def _assert_refused_untouched(step, opt, params, match, edit=None, error=RuntimeError):
    """After `edit`, the compiled step raises `match`, and no parameter or state changed."""
    values = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    if edit is not None:
        edit()
    try:
        with pytest.raises(error, match=match):
            step()
    finally:
        torch.set_grad_enabled(True)  # see test_a_compiled_step_refuses_a_bad_gradient_naming_it
    for p, v, state in zip(params, values, states):
        assert torch.equal(p, v)
        assert all(torch.equal(opt.state[p][k], value) for k, value in state.items())


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_a_compiled_step_refuses_a_bad_gradient_naming_it(name):
    """Under torch.compile as in eager: a gradient of another dtype than its parameter is
    refused, naming it, and nothing is written. (The compiled graph may run without
    re-tracing; then the kernel's own check names the gradient by its place in the batch.)"""
    torch._dynamo.reset()
    params = [torch.randn(5, device=DEVICE, requires_grad=True) for _ in range(2)]
    opt = OPTIMIZERS[name](params, lr=1e-2, backend="fused")
    step = torch.compile(opt.step, backend=CompileCounter())
    for p in params:
        p.grad = torch.ones_like(p)
    step()
    values = [p.detach().clone() for p in params]
    params[1].grad.data = torch.ones(5, dtype=torch.float64, device=DEVICE)
    try:
        with pytest.raises(Exception, match=r"param_groups\[0\]\['params'\]\[1\]|grads\[1\] has dtype"):
            step()
    finally:
        # An error raised inside a compiled graph skips the graph's own exit from the step's
        # no_grad region (a torch.compile limitation): grad mode would stay off for the tests
        # that follow.
        torch.set_grad_enabled(True)
    for p, v in zip(params, values):
        assert torch.equal(p, v)
    assert [opt.state[p]["step"].item() for p in params] == [1, 1]


def _counter_of_three_elements(state, first, second):
    state["step"] = torch.zeros(3, device=DEVICE)


def _one_tensor_under_two_keys(state, first, second):
    state[second] = state[first]


def _a_view_of_its_other_momentum(state, first, second):
    state[second] = state[first][:]


def _a_buffer_that_is_no_tensor(state, first, second):
    state[second] = "zeros"


@pytest.mark.parametrize("edit, match", [
    (_counter_of_three_elements, "'step' has 3 elements"),
    (_one_tensor_under_two_keys, "is the very tensor of its own state"),
    (_a_view_of_its_other_momentum, "shares memory with its own state"),
    (_a_buffer_that_is_no_tensor, "is a str, not a tensor")], ids=["counter", "shared", "view", "str"])
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_a_compiled_step_refuses_bad_state_naming_it_before_any_state_converts(name, edit,
                                                                              match):
    """As the eager step (tests/test_bad_state.py): state set by hand that no step can use is
    refused naming the parameter, and the first group, whose state_dtype was switched in the
    same edit, keeps its state unconverted (dynamo makes each group's state in turn)."""
    torch._dynamo.reset()
    params = [torch.randn(5, device=DEVICE, requires_grad=True) for _ in range(2)]
    opt = OPTIMIZERS[name]([dict(params=params[:1]), dict(params=params[1:], lr=1e-3)],
                           lr=1e-2, backend="fused")
    step = torch.compile(opt.step, backend=CompileCounter())
    for p in params:
        p.grad = torch.ones_like(p)
    step()
    values = [p.detach().clone() for p in params]
    first_state = dict(opt.state[params[0]])
    opt.param_groups[0]["state_dtype"] = torch.bfloat16
    edit(opt.state[params[1]], *state_buffer_names(opt)[:2])
    try:
        with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[0\].*" + match):
            step()
    finally:
        torch.set_grad_enabled(True)  # see test_a_compiled_step_refuses_a_bad_gradient_naming_it
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert all(opt.state[params[0]][key] is value for key, value in first_state.items())


# 1e38: within float32, its factor lr / (1 - beta1) not
@pytest.mark.parametrize("bad", [float("nan"), -1.0, 1e38], ids=["nan", "negative", "factor"])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor", "inductor-dynamic"])
@pytest.mark.parametrize("backend", ["fused", "foreach"])
def test_a_cpu_tensor_lr_filled_with_a_bad_value_is_refused_by_the_compiled_step(backend,
                                                                                 compiler, bad):
    """Dynamo does not guard a tensor lr's value (a new value must not recompile), so the
    step checks a CPU lr inside the graph, as eager checks it: refused naming the group,
    before any group stepped (here the first, whose lr is fine). With dynamic=True the
    check's bound is symbolic (traced from the group's floats)."""
    torch._dynamo.reset()
    params = [torch.randn(5, requires_grad=True) for _ in range(2)]
    lrs = [torch.tensor(1e-2), torch.tensor(1e-3, dtype=torch.float64)]
    opt = OPTIMIZERS["AdaPNM"]([dict(params=[p], lr=lr) for p, lr in zip(params, lrs)],
                               backend=backend)
    step = torch.compile(opt.step, backend=compiler.removesuffix("-dynamic"),
                         dynamic=compiler.endswith("-dynamic"))
    for p in params:
        p.grad = torch.ones_like(p)
    step()
    lrs[1].fill_(bad)
    _assert_refused_untouched(step, opt, params, r"param_groups\[1\]: invalid lr")
    lrs[1].fill_(1e-3)
    step()  # the same graph, stepping again
    assert [int(opt.state[p]["step"]) for p in params] == [2, 2]


def test_the_in_graph_lr_refusal_names_only_the_factors_the_group_computes():
    """PNM with coupled weight decay scales nothing but the lr: the refusal names no factor
    its group does not compute."""
    torch._dynamo.reset()
    params = [torch.randn(5, requires_grad=True)]
    lr = torch.tensor(1e-2)
    opt = OPTIMIZERS["PNM"](params, lr=lr, weight_decay=1e-2, decoupled=False, backend="fused")
    step = torch.compile(opt.step, backend="aot_eager")
    params[0].grad = torch.ones_like(params[0])
    step()
    lr.fill_(float("nan"))
    _assert_refused_untouched(step, opt, params, r"param_groups\[0\]: invalid lr .* factors "
                                                 r"\(lr\) pass")


# A float lr made bad, and what the refusal says: lr / (1 - beta1), AdaPNM's first step's
# factor, past float32's range while the lr is within it.
BAD_FLOAT_LR = {"negative": (-0.1, "invalid lr"), "infinite": (float("inf"), "invalid lr"),
                "too-large": (1e39, "invalid lr"),
                "its-factor-too-large": (1e38, r"lr / \(1 - beta1\) is 1e\+39")}


@pytest.mark.parametrize("bad", BAD_FLOAT_LR)
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("backend", ["fused", "foreach"])
def test_a_float_lr_made_dynamic_then_bad_is_refused_by_the_compiled_step(backend, compiler,
                                                                           bad):
    """A float lr that changed between steps (a scheduler's) is a graph input dynamo does not
    guard, and the trace's validation has passed: a linear decay run past its end (negative)
    was stepped. Guarded on what the validation checks, it traces again, which refuses it
    naming the group, before any group stepped."""
    torch._dynamo.reset()
    params = [torch.randn(5, requires_grad=True) for _ in range(2)]
    opt = OPTIMIZERS["AdaPNM"]([dict(params=[p]) for p in params], lr=1e-2, backend=backend)
    step = torch.compile(opt.step, backend=compiler)
    for lr in (1e-2, 2e-2, 3e-2):  # dynamo makes the float an input once it changed
        for group in opt.param_groups:
            group["lr"] = lr
        for p in params:
            p.grad = torch.ones_like(p)
        step()
    opt.param_groups[1]["lr"], message = BAD_FLOAT_LR[bad]
    _assert_refused_untouched(step, opt, params, rf"param_groups\[1\]: {message}",
                              error=Exception)
    opt.param_groups[1]["lr"] = 1e-3
    step()
    assert [int(opt.state[p]["step"]) for p in params] == [4, 4]


@pytest.mark.parametrize("how", ["new-tensor", "data"])
@pytest.mark.parametrize("attribute", ["grad_scale", "found_inf"])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_grad_scalers_tensor_moved_into_written_memory_is_refused_by_the_compiled_step(
        compiler, attribute, how):
    """GradScaler's tensors are read as a tensor lr is: one put into a parameter's memory
    after tracing (a new tensor, which traces again, or through `.data`, which dynamo does
    not see) is refused naming both, before anything is written."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = [torch.rand(4, 3, generator=gen).requires_grad_() for _ in range(2)]
    opt = OPTIMIZERS["AdaPNM"](params, lr=1e-2, backend="fused")
    opt.grad_scale, opt.found_inf = torch.ones(()), torch.zeros(())
    step = torch.compile(opt.step, backend=compiler)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        step()
    inside = params[1].detach()[0, 0]

    def edit():
        if how == "data":
            getattr(opt, attribute).data = inside
        else:
            setattr(opt, attribute, inside)
    _assert_refused_untouched(step, opt, params,
                              rf"optimizer.{attribute} \(GradScaler's\) shares memory with "
                              rf"{_SECOND}", edit=edit, error=Exception)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, 2.5], ids=["nan", "negative", "fractional"])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("backend", ["fused", "foreach"])
def test_a_cpu_counter_filled_with_no_count_of_steps_is_refused_by_the_compiled_step(
        backend, compiler, bad):
    """Dynamo does not guard a counter's value (but for NaN, which traces again and is
    refused as in eager): the step checks the CPU counters inside the graph, as eager checks
    them, refused naming the parameter before any group stepped (here the first, whose
    counter is fine; inductor would advance its counter before an assert that wrote none);
    the same graph steps once the counter holds a count again."""
    torch._dynamo.reset()
    params = [torch.randn(5, requires_grad=True) for _ in range(2)]
    opt = OPTIMIZERS["AdaPNM"]([dict(params=[p]) for p in params], lr=1e-2, backend=backend)
    step = torch.compile(opt.step, backend=compiler)
    for p in params:
        p.grad = torch.ones_like(p)
    for _ in range(2):  # the first traced with no state: the second's graph is the one kept
        step()
    values = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    opt.state[params[1]]["step"].fill_(bad)
    try:
        with pytest.raises(RuntimeError,
                           match=r"param_groups\[1\]\['params'\]\[0\].* 'step' is "
                                 r"(nan|-1\.0|2\.5), not a whole number of steps >= 0"):
            step()
    finally:
        torch.set_grad_enabled(True)  # see test_a_compiled_step_refuses_a_bad_gradient_naming_it
    for p, v, state in zip(params, values, states):
        assert torch.equal(p, v)
        assert all(torch.allclose(opt.state[p][k], value, rtol=0, atol=0, equal_nan=True)
                   for k, value in state.items() if k != "step" or p is params[0])
    opt.state[params[1]]["step"].fill_(2)
    step()  # the same graph, stepping again
    assert [int(opt.state[p]["step"]) for p in params] == [3, 3]


_FIRST, _SECOND = (rf"param_groups\[0\]\['params'\]\[{i}\]" for i in (0, 1))


def _grad_is_its_own_state(opt, p, q):
    p.grad = opt.state[p]["exp_avg"]


def _grad_views_another_parameter(opt, p, q):
    p.grad = q.detach()[:]


def _grad_views_another_state(opt, p, q):
    p.grad = opt.state[q]["neg_exp_avg"][:]


def _state_views_another_state(opt, p, q):
    opt.state[p]["exp_avg_sq"] = opt.state[q]["exp_avg_sq"][:]


def _lr_views_a_parameter(opt, p, q):
    opt.param_groups[0]["lr"] = q.detach()[0, 0]


@pytest.mark.parametrize("edit, match", [
    (_grad_is_its_own_state, rf"{_FIRST}.*: its state 'exp_avg' is the very tensor of its gradient"),
    (_grad_views_another_parameter, rf"{_SECOND}.* shares memory with {_FIRST}.*'s gradient"),
    (_grad_views_another_state, rf"{_SECOND}.*: its state 'neg_exp_avg' shares memory with {_FIRST}"),
    (_state_views_another_state, rf"{_SECOND}.*: its state 'exp_avg_sq' shares memory with {_FIRST}"
                                 r".*'s state 'exp_avg_sq'"),
    (_lr_views_a_parameter, rf"param_groups\[0\]\['lr'\] \(a tensor\) shares memory with {_SECOND}")],
    ids=["grad-own-state", "grad-other-param", "grad-other-state", "state-other-state", "lr"])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_memory_shared_after_tracing_is_refused_by_the_compiled_step_as_in_eager(compiler, edit,
                                                                                 match):
    """Dynamo guards the layout of gradients, lrs and state tensors, not their memory: the
    graph checks, at every step, that nothing it writes shares memory with anything else it
    reads or writes (traced._check_traced_tensors), and refuses as the eager step refuses,
    naming both, before anything is written; the same graph steps again once mended."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = [torch.rand(4, 3, generator=gen).requires_grad_() for _ in range(2)]  # lrs >= 0
    opt = OPTIMIZERS["AdaPNM"](params, lr=torch.tensor(1e-2), backend="fused")
    step = torch.compile(opt.step, backend=compiler)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        step()
    _assert_refused_untouched(step, opt, params, match, edit=lambda: edit(opt, *params))


def test_interleaved_parameters_are_checked_element_by_element_once_not_at_every_step(
        monkeypatch):
    """Column blocks of one matrix: their extents meet, their elements do not. The graph's
    screen sends such a layout to the element-wise check once, and remembers it passed."""
    torch._dynamo.reset()
    calls = []
    refuse = traced._refuse_shared_memory
    monkeypatch.setattr(traced, "_refuse_shared_memory",
                        lambda counter: calls.append(counter) or refuse(counter))
    base = torch.rand(6, 8)
    params = [torch.nn.Parameter(base[:, i::4]) for i in range(4)]  # interleaved columns
    opt = OPTIMIZERS["PNM"](params, lr=1e-2, backend="fused")
    # Inductor: aot_eager hands the op fresh copies of the counters each step (a layout
    # never seen before, checked in Python every time: slower, not wrong).
    step = torch.compile(opt.step, backend="inductor")
    for _ in range(4):
        for p in params:
            p.grad = torch.ones_like(p)
        step()
    assert len(calls) == 1
    assert all(int(opt.state[p]["step"]) == 4 for p in params)


def test_the_screen_of_the_compiled_step_misses_no_memory_the_exact_check_finds_shared(
        monkeypatch):
    """aliasing.extents_meet, in C++ and in Python alike, says "meet" for every pair of
    views (slices, strided slices, columns, rows, transposes, touching and disjoint) whose
    elements share memory, written with written and read with written, and "apart" for
    disjoint extents; read with read is never a hit."""
    from pnm_kernels.aliasing import (GRADIENT, PARAMETER, MemoryClaims, SharedMemoryError,
                                      extents_meet)
    base = torch.zeros(8, 8)
    views = [base[0], base[1], base[:2], base[1:3], base[:, 0], base[:, 1], base[::2],
             base[1::2], base.t(), base[0, :4], base[0, 4:], base[7], torch.zeros(8)]
    for a in views:
        for b in views:
            claims = MemoryClaims()
            claims.add(a, "a", PARAMETER)
            claims.add(b, "b", GRADIENT)
            try:
                claims.check()
                shared = False
            except SharedMemoryError:
                shared = True
            screens = [extents_meet([a], [b]), extents_meet([a, b], []),
                       extents_meet([], [a, b])]
            with monkeypatch.context() as m:
                m.setattr(aliasing, "extension_error", lambda: "not built, for the test")
                assert [extents_meet([a], [b]), extents_meet([a, b], []),
                        extents_meet([], [a, b])] == screens
            if shared:
                assert screens[:2] == [True, True], (a.stride(), b.stride())
            assert not screens[2]
            if a is not b and a.data_ptr() + a.numel() * 4 <= b.data_ptr() and a.is_contiguous():
                assert screens[:2] == [False, False]  # disjoint (or touching) extents


_NOW_AND_TRACED = (r"{} is torch.{} of shape \({}\), strides \({}\), on the CPU, where the "
                   r"compiled step was traced with torch.float32 of shape \(4, 3\), strides \(3, 1\)")


@pytest.mark.parametrize("edit", ["counter", "gradient", "dtype", "strides", "shape"])
@pytest.mark.parametrize("install", ["extension", "python"])
def test_the_compiled_steps_checks_in_cpp_and_in_python_refuse_alike(install, edit, monkeypatch):
    """The checks of the counters, layouts and memory inside the traced step are C++ ops
    where the extension is built and Python ops on a Triton-only install (whose traced step
    runs foreach ops); the two read one encoding of the layouts (csrc/traced_checks.h). A
    counter filled in place, a gradient put into a state buffer, and a parameter given
    bfloat16 data, other strides or another shape through .data are refused by either with
    the same message, before anything is written."""
    if install == "python":
        triton_only_install(monkeypatch)
    elif not extension_is_built():
        pytest.skip("pnm_kernels._C is not built")
    torch._dynamo.reset()
    params = [torch.rand(4, 3).requires_grad_() for _ in range(2)]
    opt = OPTIMIZERS["AdaPNM"](params, lr=torch.tensor(1e-2), backend="foreach")
    graphs = []

    def recorded(gm, inputs):  # aot_eager, the graphs' code kept
        graphs.append(gm.code)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)
    step = torch.compile(opt.step, backend=recorded)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        step()
    suffix = "_in_python" if install == "python" else ""
    assert re.search(rf"check_traced_tensors{suffix}\b", graphs[-1])
    assert re.search(rf"check_step_counts{suffix}\b", graphs[-1])
    values = [p.detach().clone() for p in params]
    if edit == "counter":
        opt.state[params[1]]["step"].fill_(-1)
        match = rf"{_SECOND}: its state 'step' is -1.0, not a whole number"
    elif edit == "gradient":
        params[0].grad = opt.state[params[0]]["exp_avg"]
        match = rf"{_FIRST}.*: its state 'exp_avg' is the very tensor of its gradient"
    else:
        params[1].data = {"dtype": lambda d: d.bfloat16(), "shape": lambda d: d.reshape(3, 4),
                          "strides": lambda d: d.t().contiguous().t()}[edit](params[1].data)
        params[1].grad = torch.ones_like(params[1])
        values[1] = params[1].detach().clone()
        match = _NOW_AND_TRACED.format(
            _SECOND, *{"dtype": ("bfloat16", "4, 3", "3, 1"), "shape": ("float32", "3, 4", "4, 1"),
                       "strides": ("float32", "4, 3", "1, 4")}[edit])
    try:
        with pytest.raises(RuntimeError, match=match):
            step()
    finally:
        torch.set_grad_enabled(True)  # see test_a_compiled_step_refuses_a_bad_gradient_naming_it
    assert all(torch.equal(p, v) for p, v in zip(params, values))


def test_a_group_that_does_not_step_reads_no_lr_so_its_lr_may_lie_anywhere():
    """As in eager: a group without gradients does not step, so its tensor lr in a stepping
    parameter's memory is no memory the step both reads and writes."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        a, b, c = (torch.ones(4, requires_grad=True) for _ in range(3))
        opt = OPTIMIZERS["AdaPNM"]([dict(params=[a, b]), dict(params=[c])], lr=1e-2,
                                   backend="fused")
        opt.param_groups[1]["lr"] = a.data[0]  # c has no gradient: its group does not step
        # Dynamo alone: aot_autograd refuses inputs aliased so (a torch limit, not ours).
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for _ in range(2):
            a.grad, b.grad = torch.full_like(a, 0.5), torch.ones_like(b)
            step()
        runs.append([p.detach().clone() for p in (a, b, c)])
    assert all(torch.equal(x, y) for x, y in zip(*runs))
    assert not torch.equal(runs[1][0], torch.ones(4))


@pytest.mark.parametrize("op", ["check_step_counts", "check_traced_tensors",
                                "check_step_counts_in_python", "check_traced_tensors_in_python"])
def test_the_checks_inside_the_compiled_step_pass_opcheck(op):
    """Their schemas (declared as writing the counters: see traced._check_step_counts) and
    fake kernels are what torch.compile needs; in C++ and, for an install without the
    extension, in Python."""
    counters = [torch.tensor(3.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)]
    params = [torch.randn(4, requires_grad=True) for _ in range(2)]
    grads = [torch.randn(4) for _ in params]
    args = ((counters, [0, 1], [0, 0]) if "counts" in op  # as traced and apart: nothing
            else (counters, params, grads, traced._layouts(counters + params + grads)))
    torch.library.opcheck(getattr(torch.ops.pnm_kernels, op).default, args)
