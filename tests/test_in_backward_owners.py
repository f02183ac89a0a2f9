"""optimizer.step_in_backward() (docs/design.md §9) and who else steps its parameters:
another optimizer's step (torch's too) refused before it steps, a second step_in_backward()
or a group added over them refused, a handle not kept found by its parameters
(pnm_kernels.stepping_in_backward) and removed, a gradient given by hand between backward
and step() refused (not stepped twice, by step() or by remove()), a wrapper sharing the
param_groups list (Lookahead's pattern) stepping, an optimizer built over the group dicts
refused, and the with block left through a refusal removing the handle."""
import pytest
import torch

from pnm_kernels import PNM, AdaPNM, stepping_in_backward
from test_step_in_backward import _assert_same, _batches, _model, _train


@pytest.mark.parametrize("iteration", [0, 2], ids=["in-the-probe", "after-the-probe"])
@pytest.mark.parametrize("other", ["SGD", "PNM"])
def test_another_optimizer_stepping_a_parameter_that_steps_in_backward_is_refused(other,
                                                                                 iteration):
    """The ordinary loop steps a parameter in both optimizers; stepped inside backward, its
    gradient is freed, and the other optimizer would silently skip it. Its step is refused
    naming the parameter, before it steps anything (in the probe's iteration too: the loop
    cannot go on). Once the handle is removed, the other optimizer steps it again."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    kind, options = {"SGD": (torch.optim.SGD, {"momentum": 0.9}), "PNM": (PNM, {})}[other]
    second = kind([model[0].weight, model[4].bias], lr=1e-3, **options)
    handle = opt.step_in_backward(bucket_mib=1e-6)
    batches = _batches(iteration + 2)
    _train(model, opt, batches[:iteration])
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(batches[iteration]).pow(2).mean().backward()
    opt.step()
    stepped = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=rf"{other}'s param_groups\[0\]\['params'\]\[0\] "
                                           r"\(shape \(256, 16\), torch.float32, cpu\) "
                                           r"steps inside backward in another optimizer "
                                           r"\(AdaPNM\)"):
        second.step()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), stepped))
    assert not second.state and any(not torch.equal(p, b) for p, b in zip(stepped, before))
    handle.remove()
    opt.zero_grad(), second.zero_grad()
    model(batches[iteration + 1]).pow(2).mean().backward()
    opt.step(), second.step()
    assert len(second.state) == 2


def test_a_parameter_stepping_in_backward_elsewhere_is_refused_when_enabling_or_adding():
    """A second optimizer's step_in_backward(), or a group it adds, over a parameter already
    stepping inside backward in another: refused naming it, nothing hooked or added."""
    model = _model()
    first = PNM([*model[0].parameters(), *model[2].parameters()], lr=1e-2)
    first.step_in_backward()
    second = AdaPNM([*model[4].parameters(), model[2].bias], lr=1e-2)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[2\] already steps "
                                           r"inside backward in another optimizer \(PNM\)"):
        second.step_in_backward()
    assert second.step_in_backward_handle is None
    third = AdaPNM(model[4].parameters(), lr=1e-2)
    third.step_in_backward()
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[0\] already steps "
                                           r"inside backward in another optimizer \(PNM\)"):
        third.add_param_group({"params": [model[0].weight]})
    assert len(third.param_groups) == 1
    _train(model, first, _batches(3))  # third's step sees no parameter of first's


def test_a_handle_not_kept_is_found_by_its_parameters_and_removed():
    """An optimizer replaced without removing its handle keeps stepping inside backward
    through its hooks, and the new one's step is refused saying how to find the handle:
    pnm_kernels.stepping_in_backward(params), or the optimizer's step_in_backward_handle.
    Once removed, the new optimizer takes the ordinary loop over, as a fresh one would."""
    model, fresh_model = _model(), _model()
    old = PNM(model.parameters(), lr=1e-2)
    old.step_in_backward(bucket_mib=1e-6)  # the handle not kept
    handle = old.step_in_backward_handle
    _train(model, old, _batches(2))
    assert stepping_in_backward(model.parameters()) == [handle]
    assert stepping_in_backward(model[4].parameters()) == [handle]
    assert stepping_in_backward(torch.nn.Linear(2, 2).parameters()) == []
    assert any(h is handle for h in stepping_in_backward())
    new = AdaPNM(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match=r"pnm_kernels\.stepping_in_backward\(model\."
                                           r"parameters\(\)\) finds its handle"):
        _train(model, new, _batches(1))
    for found in stepping_in_backward(model.parameters()):
        found.remove()
    assert old.step_in_backward_handle is None and stepping_in_backward(model.parameters()) == []
    with torch.no_grad():
        for p, q in zip(fresh_model.parameters(), model.parameters()):
            p.copy_(q)
    fresh = AdaPNM(fresh_model.parameters(), lr=1e-2)
    new.zero_grad(), fresh.zero_grad()
    _train(model, new, _batches(3)), _train(fresh_model, fresh, _batches(3))
    _assert_same(model, new, fresh_model, fresh)


def test_a_gradient_given_by_hand_between_backward_and_step_is_refused_not_stepped_twice():
    """Past the probe, a gradient set by hand for a parameter that stepped inside backward
    (zeros for every parameter that has none, say): the ordinary step steps it once, with the
    new gradient; here it stepped with the pass's already. step() refuses it naming the
    parameter, stepping nothing."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    opt.step_in_backward(bucket_mib=1e-6)
    batches = _batches(3)
    _train(model, opt, batches[:2])
    opt.zero_grad()
    model(batches[2]).pow(2).mean().backward()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    after_backward = [p.detach().clone() for p in model.parameters()]
    steps = [int(opt.state[p]["step"]) for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape "
                                           r"\(256, 16\), torch.float32, cpu\) was given a "
                                           r"gradient between backward and step\(\).*"
                                           r"Nothing was stepped"):
        opt.step()
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), after_backward))
    assert steps == [int(opt.state[p]["step"]) for p in model.parameters()] == [3] * 6


def test_a_gradient_given_by_hand_then_the_handle_removed_is_refused_by_the_removal():
    """remove() between backward and step() leaves that step() to the ordinary step, which
    would step again a parameter that stepped inside backward and was given a gradient by hand
    since: the removal is refused naming it, the handle kept; without that gradient it goes."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    handle = opt.step_in_backward(bucket_mib=1e-6)
    batches = _batches(3)
    _train(model, opt, batches[:2])
    opt.zero_grad()
    model(batches[2]).pow(2).mean().backward()
    model[4].bias.grad = torch.zeros_like(model[4].bias)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[5\] .* was given a "
                                           r"gradient .*The handle was not removed"):
        handle.remove()
    assert opt.step_in_backward_handle is handle
    model[4].bias.grad = None
    handle.remove()
    opt.step()
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [3] * 6


class _SharingGroups(torch.optim.Optimizer):
    """An optimizer wrapping another and sharing its param groups, whose step() steps the
    inner one (Lookahead's pattern)."""

    def __init__(self, inner):
        super().__init__(inner.param_groups, inner.defaults)
        self.inner, self.param_groups = inner, inner.param_groups

    def step(self, closure=None):
        return self.inner.step(closure)


def test_a_wrapper_sharing_the_param_groups_of_an_optimizer_stepping_in_backward_steps():
    """Its step() runs torch's global step pre-hooks, and its parameters step inside backward
    in the optimizer it wraps: the same parameters, stepped once, not refused; the ordinary
    loop's bits."""
    runs = []
    for in_backward in (True, False):
        model = _model()
        inner = AdaPNM(model.parameters(), lr=1e-2)
        if in_backward:
            inner.step_in_backward(bucket_mib=1e-6)
        _train(model, _SharingGroups(inner), _batches(3))
        runs.append((model, inner))
    _assert_same(*runs[0], *runs[1])


class _DictCopyingWrapper:
    """A wrapper made a subclass of the optimizer's class, holding a copy of its __dict__,
    whose step() calls the optimizer's (Lightning's LightningOptimizer)."""

    def __init__(self, optimizer):
        self.__class__ = type(f"Wrapped{type(optimizer).__name__}",
                              (type(self), type(optimizer)), {})
        self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k != "step"}
        self.optimizer = optimizer

    def step(self, closure=None):
        return self.optimizer.step(closure)


def test_step_in_backward_called_on_a_wrapper_copying_the_optimizers_dict_is_the_optimizers():
    """Its hooks would report to the wrapper while the optimizer steps (the handle stayed in
    its probe: nothing stepped inside backward, no gradient freed, nothing said): the handle
    is the wrapped optimizer's; the ordinary loop's bits, gradients freed past the probe."""
    runs = []
    for in_backward in (True, False):
        model = _model()
        opt = AdaPNM(model.parameters(), lr=1e-2)
        wrapper = _DictCopyingWrapper(opt)
        if in_backward:
            handle = wrapper.step_in_backward(bucket_mib=1e-6)
            assert opt.step_in_backward_handle is handle
            assert wrapper.step_in_backward_handle is handle
        _train(model, wrapper, _batches(3))
        if in_backward:
            wrapper.zero_grad()
            model(_batches(1)[0]).pow(2).mean().backward()
            assert all(p.grad is None for p in model.parameters())
            wrapper.step()
        else:
            _train(model, wrapper, _batches(1))
        runs.append((model, opt))
    _assert_same(*runs[0], *runs[1])


@pytest.mark.parametrize("enabled_on", ["wrapper", "optimizer"])
def test_zero_grad_through_a_wrapper_copying_the_optimizers_dict_reaches_the_handle(enabled_on):
    """Enabled after wrapping, the wrapper's copy of __dict__ holds no handle: its zero_grad()
    (set_to_none=False, the last layer no longer reached: the ordinary step steps it with
    zeros) tells the optimizer's handle all the same; the ordinary loop's bits."""
    runs = []
    for in_backward in (True, False):
        model = _model()
        opt = PNM(model.parameters(), lr=1e-2)
        wrapper = _DictCopyingWrapper(opt)
        if in_backward:
            (wrapper if enabled_on == "wrapper" else opt).step_in_backward(bucket_mib=1e-6)
        for i, x in enumerate(_batches(5)):
            wrapper.zero_grad(set_to_none=False)
            (model if i < 2 else model[:3])(x).pow(2).mean().backward()
            wrapper.step()
        runs.append((model, opt))
    _assert_same(*runs[0], *runs[1])


def test_an_optimizer_built_over_the_param_groups_of_one_stepping_in_backward_is_refused():
    """Built over the same group dicts (`SGD(opt.param_groups)`), it is another optimizer
    (its own param_groups list), whose step would find the gradients freed: refused."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    opt.step_in_backward(bucket_mib=1e-6)
    _train(model, opt, _batches(2))
    replacement = torch.optim.SGD(opt.param_groups, lr=1e-3)
    opt.zero_grad()
    model(_batches(3)[2]).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match=r"SGD's param_groups\[0\]\['params'\]\[0\] .* steps "
                                           r"inside backward in another optimizer \(AdaPNM\)"):
        replacement.step()


def test_leaving_the_with_block_through_a_refused_step_removes_the_handle():
    """The block's end is the ordinary step's, even where it is left through an error (a
    step() refused for a gradient given by hand)."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    batches = _batches(3)
    with pytest.raises(RuntimeError, match=r"was given a gradient between backward and step"):
        with opt.step_in_backward(bucket_mib=1e-6):
            _train(model, opt, batches[:2])
            opt.zero_grad()
            model(batches[2]).pow(2).mean().backward()
            model[4].bias.grad = torch.zeros_like(model[4].bias)
            opt.step()
    assert opt.step_in_backward_handle is None
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
