"""Lazy negative views (what `z.conj().imag` of a complex tensor gives: -t read through the
negative bit) given after steps to a parameter, a gradient, a state buffer or the lr: each
is refused naming it before anything is touched, with the compiled extension and without
(the kernels read memory, not values: docs/edits.md, "Lazy negative and conjugate
views")."""
import pytest
import torch

import cases
from cases import FAST_PATHS
from conftest import OPTIMIZERS, assert_same_entry, make_params, train
from internals import state_buffer_names, triton_only_install


def _negative_view(t):
    """`t`'s values as a lazy negative view of new memory (-t read through the negative bit):
    what `z.conj().imag` of a complex tensor gives a user, contiguous here."""
    return torch._neg_view(-t.detach())


def _negative_in_state(key):
    def edit(opt, params):
        entry = opt.state[params[1]]
        entry[key(opt)] = _negative_view(entry[key(opt)])
    return edit


def _first_buffer_name(opt):
    return state_buffer_names(opt)[0]


# Edits after steps that leave a tensor of the step a lazy negative view, each with the state
# dtype it needs and what the refusal names. The fused kernels, Triton and the foreach ops
# read and write the memory itself; the refusal comes where the view is first met.
LAZY_VIEW_EDITS = {
    "parameter": (None, lambda opt, params: setattr(params[1], "data",
                                                    _negative_view(params[1])),
                  r"params'\]\[1\] \(shape .*\) is an unresolved negative view"),
    "parameter, its own memory": (
        None, lambda opt, params: setattr(params[1], "data", torch._neg_view(params[1].data)),
        r"params'\]\[1\] \(shape .*\) is an unresolved negative view"),
    "gradient": (None, lambda opt, params: setattr(params[1], "grad",
                                                   _negative_view(params[1].grad)),
                 r"params'\]\[1\] \(shape .*\)'s gradient is an unresolved negative view"),
    "buffer": (None, _negative_in_state(_first_buffer_name),
               r"params'\]\[1\] .*: its state '(exp_avg|pos_momentum)' is an unresolved "
               "negative view"),
    "buffer, through .data": (
        None, lambda opt, params: setattr(opt.state[params[1]][_first_buffer_name(opt)], "data",
                                          torch._neg_view(
                                              opt.state[params[1]][_first_buffer_name(opt)].data)),
        r"params'\]\[1\] .*: its state '(exp_avg|pos_momentum)' is an unresolved negative view"),
    "counter": (None, _negative_in_state(lambda opt: "step"),
                r"params'\]\[1\] .*: its state 'step' is an unresolved negative view"),
    "lr": (None, lambda opt, params: opt.param_groups[0].update(
        lr=_negative_view(opt.param_groups[0]["lr"])),
           r"param_groups\[0\]: the tensor lr is an unresolved negative view"),
    "bfloat16 buffer": (torch.bfloat16, _negative_in_state(_first_buffer_name),
                        r"params'\]\[1\] .*: its state '(exp_avg|pos_momentum)' is an "
                        "unresolved negative view"),
    "seed": (torch.bfloat16, _negative_in_state(lambda opt: "seed"),
             r"params'\]\[1\] .*: its state 'seed' is an unresolved negative view"),
    "int8 scales": (torch.int8, _negative_in_state(lambda opt: f"{_first_buffer_name(opt)}_scale"),
                    r"params'\]\[1\] .*: its state '(exp_avg|pos_momentum)_scale' is an "
                    "unresolved negative view"),
}


def _assert_lazy_view_refused(path, name, edit):
    state_dtype, apply, match = LAZY_VIEW_EDITS[edit]
    params = make_params([(2, 256), (2, 256)])
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=state_dtype,
                           lr=torch.tensor(1e-2))
    train(opt, params, 3)  # the lists held
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    apply(opt, params)
    values = [p.detach().clone() for p in params]
    before = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises((RuntimeError, ValueError), match=match):
        opt.step()
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    for p, entry in zip(params, before):
        assert_same_entry(entry, opt.state[p])


@pytest.mark.parametrize("edit", list(LAZY_VIEW_EDITS))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_lazy_negative_view_given_after_steps_is_refused_naming_it_before_any_change(
        path, name, edit):
    """A parameter, gradient, state tensor or tensor lr that reads as its memory negated
    (torch's lazy negative bit, as `z.conj().imag` sets it) cannot be stepped by kernels that
    read and write memory: refused as on the first step, naming it, before anything changes,
    also where the lists held between steps saw the same memory (`.data =` a negative view
    of it)."""
    _assert_lazy_view_refused(path, name, edit)


@pytest.mark.parametrize("edit", list(LAZY_VIEW_EDITS))
@cases.parametrize(["triton"])
def test_a_lazy_negative_view_given_after_steps_is_refused_without_the_compiled_extension(
        path, name, edit, monkeypatch):
    """As above on a Triton-only install, whose held lists are confirmed in Python."""
    triton_only_install(monkeypatch)
    _assert_lazy_view_refused(path, name, edit)
