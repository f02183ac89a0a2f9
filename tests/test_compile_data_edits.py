"""torch.compile: a tensor of the step changed through `.data` after tracing (another dtype,
layout, a complex tensor's dtype) or made a lazy negative view is refused, naming it, before
any group steps; compiled again, the step gives what the eager step gives after the same edit.
Dynamo guards an optimizer's tensors by identity only: the graph checks them itself."""
import pytest
import torch
import torch._dynamo

from conftest import OPTIMIZERS, assert_states_close, requires_extension
from internals import extension_is_built, triton_only_install
from test_compile_refusals import _assert_refused_untouched

pytestmark = requires_extension


def _to_bfloat16(opt, p):  # as module.to(torch.bfloat16) changes a parameter
    p.data = p.data.to(torch.bfloat16)


def _transposed_in_memory(opt, p):
    p.data = p.data.t().contiguous().t()


def _state_to_float64(opt, p):
    opt.state[p]["exp_avg"].data = opt.state[p]["exp_avg"].data.double()


_TRACED_AS = r"where the compiled step was traced with torch.float32 of shape \(4, 3\), strides \(3, 1\)"


@pytest.mark.parametrize("edit, match", [
    (_to_bfloat16, rf"param_groups\[1\]\['params'\]\[0\] is torch.bfloat16 of shape \(4, 3\), "
                   rf"strides \(3, 1\), on the CPU, {_TRACED_AS}, on the CPU: changed through .data"),
    (_transposed_in_memory, r"param_groups\[1\]\['params'\]\[0\] is torch.float32 of shape "
                            rf"\(4, 3\), strides \(1, 4\), on the CPU, {_TRACED_AS}"),
    (_state_to_float64, r"param_groups\[1\]\['params'\]\[0\]'s state 'exp_avg' is "
                        rf"torch.float64 of shape \(4, 3\), strides \(3, 1\), on the CPU, {_TRACED_AS}")],
    ids=["dtype", "strides", "state-dtype"])
@pytest.mark.parametrize("backend", ["fused", "foreach"])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_tensor_changed_through_data_after_tracing_is_refused_before_any_group_steps(
        compiler, backend, edit, match):
    """Dynamo does not guard a parameter's (or state tensor's) dtype or strides changed
    through .data, as module.to(torch.bfloat16) changes them: the graph compares
    every tensor with its layout as traced (traced._check_traced_tensors) and refuses,
    naming it, before any group steps (inductor's kernels would read the new memory as the
    old dtype; the fused op would refuse in the second group, the first stepped). Compiled
    again, the step gives what the eager step gives after the same edit. (Inductor's code
    checks its inputs' strides itself, before our check: its message is its own.)"""
    error = RuntimeError
    if compiler == "inductor" and edit is _transposed_in_memory:
        error, match = AssertionError, r"expected size 4==4, stride 1==3 at dim=0"
    runs = []
    for compiled in (True, False):
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(0)
        params = [torch.rand(4, 3, generator=gen).requires_grad_() for _ in range(2)]
        opt = OPTIMIZERS["AdaPNM"]([dict(params=params[:1]), dict(params=params[1:], lr=3e-3)],
                                   lr=1e-2, backend=backend)
        step = torch.compile(opt.step, backend=compiler) if compiled else opt.step
        for t in range(4):
            if t == 2:
                edit(opt, params[1])
                if compiled:
                    for p in params:
                        p.grad = torch.ones_like(p)
                    _assert_refused_untouched(step, opt, params, match, error=error)
                    torch.compiler.reset()
                    step = torch.compile(opt.step, backend=compiler)
            for p in params:
                p.grad = torch.full_like(p, 0.5 + t)
            step()
        runs.append((opt, params))
    (opt, params), (eager, eager_params) = runs
    assert [int(opt.state[p]["step"]) for p in params] == [4, 4]
    assert_states_close(opt, params, eager, eager_params)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_complex_parameter_changed_through_data_after_tracing_is_refused_naming_it(compiler):
    """The graph checks a complex tensor as its real view; the refusal still names it (under
    inductor, whose code checks the real view's dtype before our check, its own message)."""
    torch._dynamo.reset()
    params = [torch.randn(4, 3, dtype=torch.complex64).requires_grad_() for _ in range(2)]
    opt = OPTIMIZERS["PNM"]([dict(params=params[:1]), dict(params=params[1:])], lr=1e-2)
    step = torch.compile(opt.step, backend=compiler)
    for p in params:
        p.grad = torch.ones_like(p)
    step()
    params[1].data = params[1].data.to(torch.complex128)
    for p in params:
        p.grad = torch.ones_like(p)
    match = (r"param_groups\[1\]\['params'\]\[0\] is torch.complex128 of shape \(4, 3\), .* "
             r"traced with torch.float32 of shape \(4, 3, 2\), .*\(as the real view of a "
             r"complex tensor\)" if compiler == "aot_eager" else
             r"expected dtype torch.float32 but got torch.float64\nError in op: "
             r"torch.ops.aten.view_as_real")
    _assert_refused_untouched(step, opt, params, match)


_LAZY_VIEW_EDITS = {  # each leaves params[1]'s tensor a lazy negative view of its values
    "parameter": lambda opt, p: setattr(p, "data", torch._neg_view(-p.data)),
    "state": lambda opt, p: setattr(opt.state[p]["exp_avg"], "data",
                                    torch._neg_view(-opt.state[p]["exp_avg"].data)),
    "gradient": lambda opt, p: setattr(p, "grad", torch._neg_view(-p.grad)),
    "counter": lambda opt, p: setattr(opt.state[p]["step"], "data",
                                      torch._neg_view(-opt.state[p]["step"].data)),
}


_LAZY_VIEW_NAMED = {
    "parameter": r"param_groups\[1\]\['params'\]\[0\] is an unresolved negative view",
    "state": r"param_groups\[1\]\['params'\]\[0\]'s state 'exp_avg' is an unresolved negative view",
    "gradient": r"param_groups\[1\]\['params'\]\[0\]'s gradient is an unresolved negative view",
    "counter": r"param_groups\[1\]\['params'\]\[0\]'s state 'step' is an unresolved negative view",
}


@pytest.mark.parametrize("what", list(_LAZY_VIEW_EDITS))
@pytest.mark.parametrize("backend, install", [("fused", "extension"), ("foreach", "extension"),
                                              ("foreach", "python")])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_lazy_negative_view_after_tracing_is_refused_before_any_group_steps(
        compiler, backend, install, what, monkeypatch):
    """A parameter or state tensor given a lazy negative view of its values through .data
    after tracing (which dynamo does not see), or a gradient that is one: the kernels would
    read and write the memory itself (the fused op refused in the second group, the first
    stepped). The graph's check refuses it naming it, as the eager step does, before any
    group steps (the C++ check, or the Python one on an install without the extension);
    under aot_eager, functionalising the check refuses it first (torch's own
    NotImplementedError)."""
    if install == "python":
        triton_only_install(monkeypatch)
    elif not extension_is_built():
        pytest.skip("pnm_kernels._C is not built")
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = [torch.rand(4, 3, generator=gen).requires_grad_() for _ in range(2)]
    opt = OPTIMIZERS["AdaPNM"]([dict(params=params[:1]), dict(params=params[1:], lr=3e-3)],
                               lr=1e-2, backend=backend)
    step = torch.compile(opt.step, backend=compiler)
    for t in range(2):
        for p in params:
            p.grad = torch.full_like(p, 0.5 + t)
        step()
    error, match = RuntimeError, _LAZY_VIEW_NAMED[what]
    if compiler == "aot_eager":
        error, match = NotImplementedError, r"auto_functionalized.*DispatchKey.Negative"
    _assert_refused_untouched(step, opt, params, match, error=error,
                              edit=lambda: _LAZY_VIEW_EDITS[what](opt, params[1]))
