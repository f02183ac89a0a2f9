"""optimizer.step_in_backward() (docs/design.md §9) where a parameter, its state, its gradient
or a tensor lr is given memory another bucket steps, or made a lazy negative view, between
passes or in a gradient hook: refused as the ordinary step refuses it, naming the culprit.
Each bucket steps alone, so a pass's first bucket checks the memory of every parameter that
may step, before any moved; the state of a layer the loss no longer reaches is not checked
(nor is it by the ordinary step)."""
import pytest
import torch

import cases
from cases import FAST_PATHS
from conftest import OPTIMIZERS
from pnm_kernels import PNM, AdaPNM
from test_step_in_backward import _train


@pytest.mark.parametrize("name, key", [("PNM", "pos_momentum"), ("AdaPNM", "exp_avg_sq")])
@pytest.mark.parametrize("taker", [0, 4], ids=["stepped-last-takes", "stepped-first-takes"])
def test_state_shared_between_parameters_of_different_buckets_is_refused_nothing_stepped(
        name, key, taker):
    """One parameter's state buffer put into another's entry after steps: the ordinary step
    refuses it naming both; so does the step inside backward, though each bucket steps
    alone, at the pass's first bucket (the state's change is seen), before any moved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8),
                                torch.nn.GELU(), torch.nn.Linear(8, 8))
    params = list(model.parameters())  # weights 0, 2, 4: backward reaches 4 first
    opt = {"PNM": PNM, "AdaPNM": AdaPNM}[name](params, lr=1e-2)
    opt.step_in_backward(bucket_mib=1e-6)  # a bucket a parameter
    batches = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(1))
    _train(model, opt, batches[:3])
    giver = 4 - taker
    opt.state[params[taker]][key] = opt.state[params[giver]][key]
    before = [p.detach().clone() for p in params]
    both = rf"params'\]\[[{taker}{giver}]\]"  # named in the order the check met them
    with pytest.raises(RuntimeError, match=rf"{both}.*state '{key}' is the very tensor of "
                                           rf".*{both}.*state '{key}'"):
        _train(model, opt, batches[3:4])
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    opt.state[params[taker]][key] = opt.state[params[giver]][key].clone()  # mended: steps on
    _train(model, opt, batches[4:])
    assert not all(torch.equal(p, b) for p, b in zip(params, before))


def _parameter_given_anothers_memory(opt, params):
    params[2].data = params[0].data[:]  # backward reaches 4 first, then 2, then 0


def _state_given_anothers_memory(opt, params):
    opt.state[params[0]]["exp_avg"].data = opt.state[params[4]]["exp_avg"].data


def _parameter_made_lazy(opt, params):
    params[0].data = torch._neg_view(params[0].data)  # its memory; backward reaches it last


def _state_made_lazy(opt, params):
    opt.state[params[0]]["exp_avg"].data = torch._neg_view(opt.state[params[0]]["exp_avg"].data)


@pytest.mark.parametrize("edit, match", [
    # Named in the order the check met them; the weights are the group's params 0, 1, 2.
    (_parameter_given_anothers_memory, r"params'\]\[[01]\].* shares memory with .*params'\]\[[01]\]"),
    (_state_given_anothers_memory, r"params'\]\[[02]\].*its state 'exp_avg' shares memory with "
                                   r".*params'\]\[[02]\].*'s state 'exp_avg'"),
    (_parameter_made_lazy, r"params'\]\[0\] \(shape .*\) is an unresolved negative view"),
    (_state_made_lazy, r"params'\]\[0\].*its state 'exp_avg' is an unresolved negative view")],
    ids=["parameter", "state", "lazy parameter", "lazy state"])
@cases.parametrize(FAST_PATHS + ["reference"], optimizers=["AdaPNM"])
def test_memory_given_through_data_between_passes_is_refused_before_any_bucket_steps(
        path, name, edit, match):
    """A parameter or a state buffer given another parameter's (state's) memory through
    .data after the probe, which no version counts, or made a lazy negative view of its own
    memory: the pass's first bucket, though its own tensors did not move, is checked against
    every other parameter's memory and bit (the held lists confirmed in C++, the others
    located), so the pass is refused before any bucket steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8),
                                torch.nn.GELU(), torch.nn.Linear(8, 8))
    params = [model[i].weight for i in (0, 2, 4)]
    for layer in (0, 2, 4):
        model[layer].bias.requires_grad_(False)
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path)
    opt.step_in_backward(bucket_mib=1e-6)  # a bucket a parameter
    batches = torch.randn(3, 3, 8, generator=torch.Generator().manual_seed(1))
    _train(model, opt, batches[:2])
    params = [params[0], None, params[1], None, params[2]]
    edit(opt, params)
    params = [p for p in params if p is not None]
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
              for p in params]
    with pytest.raises(RuntimeError, match=match):
        _train(model, opt, batches[2:])
    for p, (value, state) in zip(params, before):
        assert torch.equal(p, value)
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())


def _unused_layer_given_another_shape(in_backward):
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    params = [*used.parameters(), *unused.parameters()]
    opt = PNM(params, lr=1e-2)
    if in_backward:
        opt.step_in_backward(bucket_mib=1e-6)
    gen = torch.Generator().manual_seed(3)
    for t in range(5):
        if t == 2:  # the unused layer's weight given another shape; a counted state change
            unused.weight.data = torch.randn(4, 8, generator=gen)
            opt.state[used.bias]["pos_momentum"] = opt.state[used.bias]["pos_momentum"].clone()
        x = torch.randn(3, 8, generator=gen)
        y = unused(used(x)) if t < 2 else used(x)
        opt.zero_grad()
        y.pow(2).mean().backward()
        opt.step()
    return params


def test_state_of_a_parameter_no_longer_reached_is_not_checked_by_the_buckets():
    """As the ordinary step, which checks the state of the parameters it steps: a layer the
    loss stopped reaching, its weight given data its state no longer fits, trains on; the
    buckets check the memory of every parameter that may step in another bucket, not their
    state."""
    for p, q in zip(_unused_layer_given_another_shape(False),
                    _unused_layer_given_another_shape(True)):
        assert torch.equal(p, q)


def _two_parameters(name, path):
    """Two parameters of 8 elements, an input, and their optimizer."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(8, generator=gen)) for _ in range(2))
    x = torch.randn(8, generator=gen)
    return a, b, x, OPTIMIZERS[name]([a, b], lr=1e-2, backend=path)


@pytest.mark.parametrize("into", ["parameter", "state"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_gradient_put_into_another_buckets_memory_is_refused_naming_both(path, name, into):
    """One parameter a bucket; from the third pass on, a hook puts b's gradient into a's
    memory (`b.grad = a.data`, or a buffer of a's state), where a's bucket steps after b's:
    every backend refuses it, naming both, before b's bucket steps (the ordinary step
    refuses it too), after the buckets had been checked together on the passes before."""
    a, b, x, opt = _two_parameters(name, path)
    aliasing = []

    def put_into_a(p):
        if aliasing:
            p.grad = aliasing[0]()

    b.register_post_accumulate_grad_hook(put_into_a)
    opt.step_in_backward(bucket_mib=1e-6)
    for t in range(3):
        if t == 2:
            aliasing.append(lambda: a.data if into == "parameter" else next(
                v for k, v in opt.state[a].items() if k not in ("step", "seed")))
        values = [p.detach().clone() for p in (a, b)]
        opt.zero_grad()
        loss = (b * (a * x)).sin().sum()
        if t < 2:
            loss.backward()
            opt.step()
            continue
        with pytest.raises(RuntimeError, match=r"params'\]\[0\].* (shares memory with|is "
                                               r"the very tensor of) .*params'\]\[1\].*gradient"):
            loss.backward()
        assert all(torch.equal(p, v) for p, v in zip((a, b), values))


@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_tensor_lr_put_into_another_buckets_memory_is_refused_before_any_change(path, name):
    """b's group's lr set, between passes, to an element of a (whose bucket steps in the
    same pass): refused on every backend, naming the lr and a, before either stepped."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(8, generator=gen)) for _ in range(2))
    x = torch.randn(8, generator=gen)
    opt = OPTIMIZERS[name]([dict(params=[a]), dict(params=[b])], lr=1e-2, backend=path)
    opt.step_in_backward(bucket_mib=1e-6)
    for _ in range(2):
        opt.zero_grad()
        (b * (a * x)).sin().sum().backward()
        opt.step()
    lr = a.data[0]
    lr.fill_(1e-2)  # a valid lr, so that only where it lies is refused
    opt.param_groups[1]["lr"] = lr
    values = [p.detach().clone() for p in (a, b)]
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['lr'\] \(a tensor\) shares "
                                           r"memory with param_groups\[0\]\['params'\]\[0\]"):
        (b * (a * x)).sin().sum().backward()
    assert all(torch.equal(p, v) for p, v in zip((a, b), values))


@pytest.mark.parametrize("made_lazy", ["b", "a"], ids=["first-bucket", "later-bucket"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_gradient_made_a_lazy_negative_view_in_a_hook_is_refused_when_its_bucket_comes(
        path, name, made_lazy):
    """One parameter a bucket (b's steps first, then a's); from the third pass on, a hook
    makes one's gradient a lazy negative view (`torch._neg_view`), which the kernels would
    read as its memory, not its values: refused when its bucket comes, naming its gradient,
    before its parameter or state moved (and, in the pass's first bucket, before anything
    moved), after the buckets had stepped it on the passes before."""
    a, b, x, opt = _two_parameters(name, path)
    lazy = []

    def make_lazy(p):
        if lazy:
            p.grad = torch._neg_view(-p.grad.detach())

    culprit = {"a": a, "b": b}[made_lazy]
    culprit.register_post_accumulate_grad_hook(make_lazy)
    opt.step_in_backward(bucket_mib=1e-6)
    for t in range(3):
        if t == 2:
            lazy.append(True)
        values = [p.detach().clone() for p in (a, b)]
        states = [{k: v.clone() for k, v in opt.state[p].items()} for p in (a, b)]
        opt.zero_grad()
        loss = (b * (a * x)).sin().sum()
        if t < 2:
            loss.backward()
            opt.step()
            continue
        index = 0 if made_lazy == "a" else 1
        with pytest.raises(RuntimeError, match=rf"params'\]\[{index}\] \(shape .*\)'s gradient "
                                               "is an unresolved negative view"):
            loss.backward()
        untouched = [0, 1] if made_lazy == "b" else [0]  # a, and b where its bucket came first
        for i in untouched:
            p = (a, b)[i]
            assert torch.equal(p, values[i])
            assert all(torch.equal(opt.state[p][k], v) for k, v in states[i].items())
