"""Memory shared between what a step reads and what it writes: state or a gradient given the
memory of a parameter, of another's state or of a gradient the step writes, a tensor lr in
such memory, tensors whose own elements overlap, batches sharing memory through new data
(lazy negative views: test_lazy_views.py). Each is refused at the step naming both tensors, before anything is
touched; memory shared that no step writes (storage shared without overlap, interleaved
parameters, gradients sharing memory, a gradient in a parameter's that does not step) steps
as separate tensors do, as the reference steps it (docs/edits.md)."""
import re

import pytest
import torch

import cases
from cases import FAST_PATHS
from conftest import (DEVICE, OPTIMIZERS, assert_same_bits, assert_same_entry,
                      assert_states_close, grads_for_step, make_params, train,
                      with_reference)
from internals import state_buffer_names, triton_only_install
from test_bad_state import _assert_step_refused_untouched


SHARED_MEMORY = {
    "a view of its other momentum": (
        lambda opt, ps, a, b: (1, b, opt.state[ps[1]][a][:]),
        r"params'\]\[1\].* state '{b}' shares memory with its own state '{a}'"),
    "a slice of another parameter's buffer": (
        lambda opt, ps, a, b: (1, a, opt.state[ps[0]][a][2:8].view(3, 2)),
        r"params'\]\[1\].* state '{a}' shares memory with param_groups\[0\]\['params'\]\[0\] "
        r"\(.*\)'s state '{a}'"),
    "its parameter's data": (
        lambda opt, ps, a, b: (1, a, ps[1].data),
        r"params'\]\[1\].* state '{a}' shares memory with the parameter itself"),
    "another parameter's data": (
        lambda opt, ps, a, b: (1, a, ps[0].data[:6].view(3, 2)),
        r"params'\]\[1\].* state '{a}' shares memory with param_groups\[0\]\['params'\]\[0\] "
        r"\(shape \(8,\), torch.float32, \S+\):"),
    "a view of its other momentum, bf16 parameter": (
        lambda opt, ps, a, b: (2, b, opt.state[ps[2]][a][:]),
        r"params'\]\[2\].* state '{b}' shares memory with its own state '{a}'"),
}


@pytest.mark.parametrize("batches", ["one", "two"])
@pytest.mark.parametrize("how", ["put", "data"])
@pytest.mark.parametrize("edit", list(SHARED_MEMORY))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_state_sharing_memory_with_what_the_step_writes_is_refused_before_any_change(
        path, name, edit, how, batches):
    """Each backend steps aliased memory another way (the reference a tensor after another,
    the kernels all at once): a state tensor that is a view of another's memory, or of a
    parameter's, is refused naming both, before any batch has stepped. Put under the key,
    or given as the key's tensor's new data (`.data = view`: no change the state counts, but
    the held lists see the memory moved; one batch, whose kernel makes the other checks,
    and two, whose lists are confirmed before either steps)."""
    if batches == "one" and "bf16" in edit:
        pytest.skip("the bfloat16 parameter is the second batch")
    params = make_params([(8,), (3, 2)])
    if batches == "two":
        params += make_params([(4,)], dtype=torch.bfloat16)
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=torch.float32)
    train(opt, params, 3)
    a, b = ("exp_avg", "neg_exp_avg") if name == "AdaPNM" else ("pos_momentum", "neg_momentum")
    share, match = SHARED_MEMORY[edit]
    i, key, view = share(opt, params, a, b)
    if how == "put":
        opt.state[params[i]][key] = view
    else:
        opt.state[params[i]][key].data = view
    _assert_step_refused_untouched(opt, params, match.format(a=a, b=b))


@pytest.mark.parametrize("when", ["first step", "after steps"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_gradient_in_its_parameters_memory_is_refused_before_any_change(path, name, when):
    """The reference and foreach steps would read it after writing the parameter, the
    kernels before: refused, naming it, where the step's lists are built and, past that,
    where a held or repeated step checks its gradients (`p.grad = p.detach()`)."""
    params = make_params([(8,), (3, 2)])
    opt = OPTIMIZERS[name](params, backend=path)
    if when == "after steps":
        train(opt, params, 3)
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.ones_like(params[0])
    params[1].grad = params[1].data
    with pytest.raises(RuntimeError, match=r"params'\]\[1\].*: its gradient shares memory "
                                           "with the parameter itself"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    steps = 0 if when == "first step" else 3
    assert not opt.state or all(int(opt.state[p]["step"]) == steps for p in opt.state)


# A gradient put, between steps, into memory the step writes that is not its own parameter's
# (that one: the test above).
def _first_buffer(opt, p):
    return next(t for k, t in opt.state[p].items() if k not in ("step", "seed"))


def _where(gi, pi):
    return f"param_groups[{gi}]['params'][{pi}]"


# (the parameter given the gradient, the gradient, the places the refusal names)
GRADIENT_PLACES = {
    "another parameter of its group":
        (0, lambda opt, params: params[1].data, (_where(0, 0), _where(0, 1))),
    "another parameter's state buffer":
        (0, lambda opt, params: _first_buffer(opt, params[1]), (_where(0, 0), _where(0, 1))),
    "its own state buffer":
        (1, lambda opt, params: _first_buffer(opt, params[1]), (_where(0, 1),)),
    "a parameter of another group":
        (2, lambda opt, params: params[0].data, (_where(1, 0), _where(0, 0))),
    "a parameter of a group stepped later":
        (0, lambda opt, params: params[2].data, (_where(0, 0), _where(1, 0))),
    "a parameter of a group never held":
        (0, lambda opt, params: params[3].data, (_where(0, 0), _where(2, 0))),
    "a held parameter, from a group never held":
        (3, lambda opt, params: params[2].data, (_where(2, 0), _where(1, 0))),
}


def _moved_in_place(t):
    """t's storage given other memory in place, its bytes kept, as `t.share_memory_()` or a
    storage resized to nothing and back (FSDP1's way of freeing) give it: no tensor of it
    changes (the same storage, offset and layout), only where its elements lie."""
    storage = t.untyped_storage()
    before, blockers = storage.data_ptr(), []

    def as_bytes():
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)

    saved = as_bytes().clone()
    for _ in range(16):  # until the allocator places it elsewhere
        storage.resize_(0)
        blockers.append(torch.empty(saved.numel(), dtype=torch.uint8, device=t.device))
        storage.resize_(saved.numel())
        if storage.data_ptr() != before:
            break
    assert storage.data_ptr() != before
    as_bytes().copy_(saved)
    return t


# Memory moved in place since the lists were held (`q.share_memory_()`, a storage resized),
# and then also reached through a storage of its own (`torch.from_dlpack(q)`).
MOVES = {"": None, "its-memory-moved-in-place": "in place",
         "its-memory-moved-then-seen-through-another-storage": "another storage"}


@pytest.mark.parametrize("moved", list(MOVES.values()), ids=list(MOVES))
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16], ids=["own-dtype-state",
                                                                      "bf16-state"])
@pytest.mark.parametrize("place", list(GRADIENT_PLACES))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_gradient_put_into_memory_the_step_writes_is_refused_before_any_change(
        path, name, place, state_dtype, moved):
    """`p.grad = q.data` (or a buffer of q's state, or of p's own) after steps whose lists
    are held, and repeated (state in the parameters' dtype, every group held) or planned each
    step (bfloat16 state, or beside a group whose lists are built every step: foreach's), in one
    group, across groups, and across a group never held and a held one, also once that
    memory was moved in place (`q.share_memory_()`, a storage resized), and where another
    storage over that memory is the gradient:
    each backend would read it before or after writing it, so every one refuses it, naming
    both, as the reference does."""
    _gradient_put_into_written_memory(path, name, place, state_dtype, moved)


@pytest.mark.parametrize("place", list(GRADIENT_PLACES))
@cases.parametrize(["triton"])
def test_a_gradient_put_into_memory_the_step_writes_without_the_compiled_extension(
        path, name, place, monkeypatch):
    """The same on a Triton-only install, whose held batches' memory is kept in Python."""
    triton_only_install(monkeypatch)
    _gradient_put_into_written_memory(path, name, place, torch.bfloat16)
    if "state buffer" not in place:  # (a bfloat16 buffer is no float32 gradient)
        for moved in ("in place", "another storage"):
            _gradient_put_into_written_memory(path, name, place, torch.bfloat16, moved)


def _gradient_put_into_written_memory(path, name, place, state_dtype, moved=None):
    if state_dtype is not None and "state buffer" in place:
        pytest.skip("a bfloat16 buffer cannot be a float32 parameter's gradient")
    params = make_params([(8,), (8,), (8,), (8,)])
    third = "foreach" if "never held" in place else path  # else all held: the step repeats
    opt = OPTIMIZERS[name]([dict(params=params[:2]), dict(params=params[2:3]),
                            dict(params=params[3:], backend=third)],
                           backend=path, state_dtype=state_dtype)
    train(opt, params, 3)
    i, target, named = GRADIENT_PLACES[place]
    if moved:
        _moved_in_place(target(opt, params))
    values = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    grad = target(opt, params)
    params[i].grad = torch.from_dlpack(grad) if moved == "another storage" else grad
    with pytest.raises(RuntimeError, match="gradient") as refused:
        opt.step()
    assert all(where in str(refused.value) for where in named), refused.value
    for p, v, s in zip(params, values, steps):
        assert torch.equal(p, v) and torch.equal(opt.state[p]["step"], s)


# A tensor lr put, between steps, into memory the step writes: (the place, the parameter
# the refusal names with the group's lr).
LR_PLACES = {
    "a parameter of its group": (lambda opt, params: params[0].data[:1], _where(0, 0)),
    "a parameter of another group": (lambda opt, params: params[2].data[3:4], _where(1, 0)),
    "another parameter's state buffer":
        (lambda opt, params: _first_buffer(opt, params[1])[:1], _where(0, 1)),
}


def _lr_put_into_written_memory(path, name, place, how, moved=None):
    params = make_params([(8,), (8,), (8,)])
    lr = torch.tensor(1e-2, device=DEVICE)
    opt = OPTIMIZERS[name]([dict(params=params[:2], lr=lr), dict(params=params[2:])],
                           backend=path)
    train(opt, params, 3)
    target, named = LR_PLACES[place]
    view = (_moved_in_place(target(opt, params)) if moved else target(opt, params)).view(())
    if moved == "another storage":
        view = torch.from_dlpack(view)
    view.fill_(1e-2)  # a valid lr, so that only where it lies is refused
    if how == "a new tensor":
        opt.param_groups[0]["lr"] = view
    else:
        lr.data = view
    values = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['lr'\] \(a tensor\) shares "
                                           "memory with " + re.escape(named)):
        opt.step()
    for p, v, state in zip(params, values, states):
        assert torch.equal(p, v)
        assert all(torch.equal(opt.state[p][k], t) for k, t in state.items())


@pytest.mark.parametrize("how", ["a new tensor", "lr.data =", "into memory moved in place",
                                 "into memory moved in place, through another storage"])
@pytest.mark.parametrize("place", list(LR_PLACES))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_tensor_lr_put_into_memory_the_step_writes_is_refused_before_any_change(
        path, name, place, how):
    """The step reads the lr while it writes that memory, each backend in another order (the
    CUDA kernels and Triton read it after some blocks were written): refused, naming the
    group's lr and what it shares, before anything is touched, also where the lists are
    held and the step repeats, and where that memory was moved in place since."""
    moved = {"into memory moved in place": "in place",
             "into memory moved in place, through another storage": "another storage"}.get(how)
    _lr_put_into_written_memory(path, name, place, "a new tensor" if moved else how, moved)


@pytest.mark.parametrize("place", list(LR_PLACES))
@cases.parametrize(["triton"])
def test_a_tensor_lr_put_into_memory_the_step_writes_without_the_compiled_extension(
        path, name, place, monkeypatch):
    """The same on a Triton-only install, whose held batches' memory is kept in Python."""
    triton_only_install(monkeypatch)
    _lr_put_into_written_memory(path, name, place, "a new tensor")


@cases.parametrize(FAST_PATHS)
def test_a_gradient_in_memory_of_a_parameter_that_does_not_step_steps_as_the_reference(
        path, name):
    """Not refused: a parameter without a gradient writes nothing, so another's gradient may
    be its memory (`p.grad = frozen.data`). The repeated step, whose lists hold the parameter
    without a gradient too, and the planned one agree with the reference."""
    opt, params, ref, ref_params = with_reference(name, path, [(8,), (8,), (5,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        for t in range(3):
            ps[0].grad, ps[1].grad, ps[2].grad = ps[1].detach(), None, torch.full((5,), 0.5)
            o.step()
    assert_states_close(opt, params, ref, ref_params)


# Two parameters that are columns of one tensor: every other one, or a block each (a fused
# q/k weight split).
COLUMNS = {"interleaved": (slice(None, None, 2), slice(1, None, 2)),
           "blocks": (slice(None, 6), slice(6, None))}


def _interleaved_training(path, name, shared_storage, columns):
    """Two parameters that are columns of one tensor, and state moved after the first step
    into slices of one flat tensor (or each its own copy)."""
    base = torch.randn(8, 12, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    views = [base[:, cols] for cols in COLUMNS[columns]]
    params = [torch.nn.Parameter(v if shared_storage else v.clone()) for v in views]
    opt = OPTIMIZERS[name](params, backend=path, lr=1e-2, weight_decay=0.1)
    train(opt, params, 1)
    if shared_storage:
        keys = [(p, k) for p in params for k, v in opt.state[p].items() if v.dim() > 0]
        flat = torch.cat([opt.state[p][k].flatten() for p, k in keys])
        for i, (p, k) in enumerate(keys):
            opt.state[p][k] = flat[i * 48:(i + 1) * 48].view(8, 6)
    train(opt, params, 4, start=1)
    return opt, params


@cases.parametrize(FAST_PATHS + ["reference"])
@pytest.mark.parametrize("columns", list(COLUMNS))
def test_storage_shared_without_shared_memory_steps_as_separate_tensors_do(path, name,
                                                                          columns):
    """Not refused: parameters that are columns of one tensor, state in slices of one flat
    tensor. Bitwise what separate tensors give."""
    assert_same_bits(*_interleaved_training(path, name, True, columns),
                     *_interleaved_training(path, name, False, columns))


@cases.parametrize(FAST_PATHS + ["reference"])
def test_interleaved_parameters_past_the_runs_compared_step_as_separate_tensors_do(path, name):
    """Two parameters that are every other element of one tensor, each of more runs (here
    single elements) than aliasing compares, 2^22: their spans meet but they are taken as
    apart, not refused (a false refusal would stop a training run, and such layouts are made
    on purpose). Bitwise what separate tensors give."""
    if path == "triton" and DEVICE == "cpu":
        pytest.skip("8M elements a step: too slow under the Triton interpreter")
    n = (1 << 22) + 1

    def run(shared):
        base = torch.randn(n, 2, generator=torch.Generator().manual_seed(0)).to(DEVICE)
        params = [torch.nn.Parameter(v if shared else v.clone()) for v in (base[:, 0],
                                                                            base[:, 1])]
        opt = OPTIMIZERS[name](params, backend=path, lr=1e-2, weight_decay=0.1)
        train(opt, params, 2)
        return opt, params

    assert_same_bits(*run(shared=True), *run(shared=False))


@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_tensor_lr_in_a_gradients_memory_steps_as_the_reference(path, name):
    """Not refused: a tensor lr is only read, as a gradient is, so it may be an element of
    a gradient (here of another group's parameter), given anew before each step: the steps
    agree with the reference."""
    opt, params, ref, ref_params = with_reference(name, path, [(8,), (8,), (5,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        o.param_groups[0]["params"] = ps[:2]
        o.add_param_group(dict(params=ps[2:]))
        train(o, ps, 2)
        for t in range(4):
            for p, g in zip(ps, grads_for_step(ps, t)):
                p.grad = g.abs() * 1e-2  # its elements are valid lrs
            o.param_groups[0]["lr"] = ps[2].grad[t]
            o.step()
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("first", ["with the other", "alone"])
@pytest.mark.parametrize("second", ["held", "never held"])
@pytest.mark.parametrize("edit", ["buffer", "parameter"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_memory_shared_across_batches_by_new_data_is_refused_before_any_change(path, name,
                                                                              edit, second,
                                                                              first):
    """The second group's buffer, or parameter, given the first group's memory (`.data =`,
    which no version counts): the first group's batch, confirmed before the edit was seen,
    is built or checked again with the second's. Also where the second group's lists are
    built every step (foreach's: never held), and where it first steps alone after the edit
    (checked alone: nothing shared within that step) and the two step together after."""
    params = make_params([(8,), (8,)])
    backend = path if second == "held" else "foreach"
    opt = OPTIMIZERS[name]([dict(params=params[:1]), dict(params=params[1:], backend=backend)],
                           backend=path)
    train(opt, params, 3)
    key = "exp_avg" if name == "AdaPNM" else "pos_momentum"
    if edit == "buffer":
        opt.state[params[1]][key].data = opt.state[params[0]][key]
        match = rf"params'\]\[0\].* state '{key}' shares memory with param_groups\[\d\]"
    else:
        params[1].data = params[0].data
        match = r"param_groups\[\d\]\['params'\]\[0\].* shares memory with param_groups"
    if first == "alone":
        params[0].grad, params[1].grad = None, torch.ones_like(params[1])
        opt.step()
    _assert_step_refused_untouched(opt, params, match)


def _add_by(how, opt, new):
    if how == "add_param_group":
        opt.add_param_group(dict(params=[new]))
    elif how == "appended to a group's list":
        opt.param_groups[1]["params"].append(new)
    else:  # "group appended by hand"
        opt.param_groups.append({**opt.param_groups[1], "params": [new]})


@pytest.mark.parametrize("overlaps", ["parameter", "buffer"])
@pytest.mark.parametrize("how", ["add_param_group", "appended to a group's list",
                                 "group appended by hand"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_parameter_new_to_the_step_sharing_a_stepped_batchs_memory_is_refused(path, name,
                                                                               how, overlaps):
    """A parameter added after steps whose memory is a row of a parameter (or a state
    buffer) of a batch held since: the held batch is checked again with the new one, as
    when both were built together."""
    params = make_params([(3, 8), (2, 8)])
    opt = OPTIMIZERS[name]([dict(params=params[:1]), dict(params=params[1:])], backend=path)
    train(opt, params, 2)
    key = "exp_avg" if name == "AdaPNM" else "pos_momentum"
    new = torch.nn.Parameter(torch.zeros(1, 8, device=DEVICE))
    new.data = (params[0] if overlaps == "parameter" else opt.state[params[0]][key]).data[:1]
    _add_by(how, opt, new)
    if overlaps == "parameter":  # the two named in the order the check met them
        match = (r"shape \((1|3), 8\)[^:]* shares memory with param_groups\[\d\]\['params'\]"
                 r"\[\d\] \(shape \((3|1), 8\)")
    else:
        match = (rf"param_groups\[0\]\['params'\]\[0\][^:]*: its state '{key}' shares memory "
                 r"with param_groups\[\d\]\['params'\]\[\d\] \(shape \(1, 8\)")
    _assert_step_refused_untouched(opt, params + [new], match)


# Parameters whose own elements share memory: made so, or given such data after some steps.
SELF_OVERLAPPING = {
    "expanded": lambda: torch.zeros(1, device=DEVICE).expand(6),
    "rows over one another": lambda: torch.zeros(120, device=DEVICE).as_strided((2, 5), (0, 20)),
    "overlapping windows": lambda: torch.zeros(40, device=DEVICE).as_strided((4, 8), (4, 1)),
}


@pytest.mark.parametrize("when", ["first step", "after steps"])
@pytest.mark.parametrize("data", list(SELF_OVERLAPPING))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_parameter_whose_elements_share_memory_is_refused_before_any_change(path, name,
                                                                             data, when):
    """A step writes each element in place: elements at one address would be written
    twice, each backend in another order (torch's in-place ops refuse only some layouts,
    after the others had stepped). Refused naming it, before any parameter (here the one
    ahead of it) or state changes."""
    overlapping = SELF_OVERLAPPING[data]()
    params = make_params([(5,), tuple(overlapping.shape)])
    opt = OPTIMIZERS[name](params, backend=path)
    if when == "after steps":
        train(opt, params, 3)
    params[1].data = overlapping
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in opt.state}
    _assert_step_refused_untouched(
        opt, params, r"params'\]\[1\].* has elements that share memory \(an expanded")
    for p, entry in before.items():
        assert_same_entry(entry, opt.state[p])


@pytest.mark.parametrize("how", ["put", "data"])
@pytest.mark.parametrize("data", list(SELF_OVERLAPPING))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_state_buffer_whose_elements_share_memory_is_refused_before_any_change(path, name,
                                                                                 data, how):
    """As a parameter's: a state buffer whose own elements share memory (an expanded view,
    windows over one another), put under its key or given as its tensor's data after steps
    (the lists held), would have elements written twice. Refused naming the parameter and
    the key, before any parameter (here the one ahead of it) or state changes."""
    overlapping = SELF_OVERLAPPING[data]()
    params = make_params([(5,), tuple(overlapping.shape)])
    opt = OPTIMIZERS[name](params, backend=path)
    train(opt, params, 3)
    key = state_buffer_names(opt)[0]
    if how == "put":
        opt.state[params[1]][key] = overlapping
    else:
        opt.state[params[1]][key].data = overlapping
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in opt.state}
    _assert_step_refused_untouched(
        opt, params, rf"params'\]\[1\].*: its state '{key}' has elements that share memory "
                     r"\(an expanded")
    for p, entry in before.items():
        assert_same_entry(entry, opt.state[p])


GRADIENTS_SHARING_MEMORY = {
    "one tensor": lambda grads: [grads[0], grads[0]],
    "views of one scalar": lambda grads: [grads[0][:1].expand(6), grads[0][:1].expand(6)],
}


@pytest.mark.parametrize("when", ["first step", "after steps"])
@pytest.mark.parametrize("share", list(GRADIENTS_SHARING_MEMORY))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_gradients_sharing_memory_step_as_separate_copies_do(path, name, share, when):
    """Gradients are only read: two parameters given one gradient tensor, or views of one
    element, step bitwise as with a copy each, on the first step and on repeated ones."""
    def run(copies):
        params = make_params([(6,), (6,)])
        opt = OPTIMIZERS[name](params, backend=path)
        if when == "after steps":
            train(opt, params, 3)
        for t in range(2):
            shared = GRADIENTS_SHARING_MEMORY[share](
                [torch.full((6,), 0.5 + t, device=DEVICE)])
            for p, g in zip(params, shared):
                p.grad = g.clone() if copies else g
            opt.step()
        return opt, params

    assert_same_bits(*run(copies=False), *run(copies=True))
