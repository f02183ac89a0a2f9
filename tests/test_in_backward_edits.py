"""optimizer.step_in_backward() (docs/design.md §9) under what a training loop does between
backward passes: the handle removed mid-training, parameters edited between backward and
step, a refused probe retried, groups added, a parameter taken out of its group or moved into
another, a state_dict loaded, params set by hand as no list. Each gives the ordinary loop's
parameters and state bitwise, or is refused naming the group before anything moved (or, what
only shows after the probe, said). Hyper-parameters set by the loop:
test_in_backward_hypers.py; other optimizers and hooks over the same parameters:
test_in_backward_owners.py; failed passes: test_in_backward_failed_passes.py; memory shared
or made lazy: test_in_backward_memory.py."""
import copy
import warnings

import pytest
import torch

from pnm_kernels import PNM, AdaPNM, stepping_in_backward
from test_in_backward_failed_passes import _FailsInBackward
from test_step_in_backward import _assert_same, _batches, _model, _train


def _removed_mid_training(in_backward, backend, remove_at, unreached_from, to_none):
    """The handle removed at step 2, before zero_grad or between backward and step(); the
    second layer unreached from step `unreached_from` on; at step k, as the k-th letter of
    `to_none` says, optimizer.zero_grad(set_to_none=True) ("T") or False ("F"), or
    model.zero_grad() ("M", which the optimizer does not see)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt = PNM([*a.parameters(), *b.parameters()], lr=0.1, weight_decay=0.1, backend=backend)
    handle = opt.step_in_backward(bucket_mib=1e-6) if in_backward else None
    gen = torch.Generator().manual_seed(1)
    for k in range(5):
        if k == 2 and handle is not None and remove_at == "before-zero-grad":
            handle.remove()
        if to_none[k] == "M":
            a.zero_grad(), b.zero_grad()
        else:
            opt.zero_grad(set_to_none=to_none[k] == "T")
        x = torch.randn(8, 4, generator=gen)
        (b(a(x)) if k < unreached_from else a(x)).square().mean().backward()
        if k == 2 and handle is not None and remove_at == "before-step":
            handle.remove()
        opt.step()
    return [a, b], opt


@pytest.mark.parametrize("remove_at, unreached_from, to_none, steps_of_the_unreached", [
    ("before-zero-grad", 2, "FFFFF", 5),
    ("before-step", 2, "FFFFF", 5),
    ("before-step", 3, "FFFFF", 5),  # the layer stepped in the pass the handle was removed in
    ("before-zero-grad", 2, "TTFFF", 5),  # the pass before zeroed to None, then in place
    ("before-step", 3, "TTTTF", 3),  # zeroed to None after the removal: the layer stops
    ("before-zero-grad", 2, "TTTFF", 2),  # zeroed to None at the removal: it stops there
    ("before-step", 2, "MMMMM", 2),  # zeroed through the model: the handle does not see it
    ("before-zero-grad", 2, "MMMMM", 2),
])
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_removed_mid_training_the_ordinary_step_steps_what_it_would(
        backend, remove_at, unreached_from, to_none, steps_of_the_unreached):
    """The step in backward freed gradients the ordinary loop would still hold (the last
    step()'s until zero_grad(), zeros under zero_grad(set_to_none=False)): remove() gives
    them back as zeros, which either zero_grad() leaves as the ordinary loop's, so the
    ordinary step goes on stepping a layer the loss no longer reaches exactly when it would;
    removed between backward and step(), that step() still completes the pass's step as the
    handle would, and the parameters stepped in the pass get theirs after it."""
    runs = [_removed_mid_training(in_backward, backend, remove_at, unreached_from, to_none)
            for in_backward in (True, False)]
    (layers, opt), (ordinary, ordinary_opt) = runs
    params = [p for layer in layers for p in layer.parameters()]
    ordinary_params = [p for layer in ordinary for p in layer.parameters()]
    assert [int(opt.state[p]["step"]) for p in params] == [5, 5] + [steps_of_the_unreached] * 2
    for p, q in zip(params, ordinary_params):
        assert torch.equal(p, q) and (p.grad is None) == (q.grad is None)
        assert p.grad is None or torch.equal(p.grad, q.grad)
        assert all(torch.equal(v, ordinary_opt.state[q][k]) for k, v in opt.state[p].items())
    assert opt.step_in_backward_handle is None


def _clipped_weights(in_backward, clip_at, through_data=False):
    """WGAN-style weight clipping (`p.clamp_()`, or the original's `p.data.clamp_()`),
    between backward and step() or after step() (before the next backward)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = PNM(model.parameters(), lr=0.1)
    if in_backward:
        opt.step_in_backward()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=gen)).square().mean().backward()
        for when in ("before-step", "after-step"):
            if when == "after-step":
                opt.step()
            if when == clip_at:
                with torch.no_grad():
                    for p in model.parameters():
                        (p.data if through_data else p).clamp_(-0.2, 0.2)
    return model, opt


def test_parameters_edited_between_backward_and_step_are_refused_by_the_probe_nothing_stepped():
    """The ordinary step steps from the edited parameters; inside backward the step came
    first: the probe sees a parameter's version changed since its gradient was made and
    refuses, before anything stepped. Edited after step() (before the next backward), the
    step in backward gives the ordinary loop's bits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = PNM(model.parameters(), lr=0.1)
    opt.step_in_backward()
    model(torch.randn(8, 4)).square().mean().backward()
    with torch.no_grad():
        model[0].weight.clamp_(-0.2, 0.2)
    clipped = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"\(of shape \(8, 4\)\) was changed in place "
                                           "between backward and step"):
        opt.step()
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), clipped))
    assert not opt.state
    for through_data in (False, True):  # every step, from the first
        with pytest.raises(RuntimeError, match=r"changed in place between backward and step"):
            _clipped_weights(True, "before-step", through_data)
    (model, opt), (ordinary, _) = (_clipped_weights(True, "after-step"),
                                   _clipped_weights(False, "after-step"))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ordinary.parameters()))
    assert all(int(opt.state[p]["step"]) == 3 for p in model.parameters())


def test_parameters_sharing_a_version_counter_are_not_taken_for_edited():
    """Parameters made of views of one buffer share its version counter: another optimizer
    stepping the sibling parameters between backward and step() edits none of these, and
    the probe does not refuse them (it compares their bits)."""
    runs = []
    for in_backward in (True, False):
        flat = torch.rand(4 * 4 + 4 + 4 + 1, generator=torch.Generator().manual_seed(0))
        w1, b1, w2, b2 = (torch.nn.Parameter(flat[:16].view(4, 4)),
                          torch.nn.Parameter(flat[16:20]),
                          torch.nn.Parameter(flat[20:24].view(1, 4)),
                          torch.nn.Parameter(flat[24:]))
        sgd = torch.optim.SGD([w1, w2], lr=0.1)
        opt = PNM([b1, b2], lr=0.1)
        if in_backward:
            opt.step_in_backward()
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            sgd.zero_grad()
            opt.zero_grad()
            x = torch.randn(8, 4, generator=gen)
            torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, w1, b1)), w2,
                                       b2).square().mean().backward()
            sgd.step()  # writes w1, w2: the buffer's counter, which b1 and b2 share
            opt.step()
        runs.append(flat)
    assert torch.equal(*runs)


def test_after_remove_between_backward_and_step_the_optimizer_is_free_at_once():
    """remove() between a backward pass that stepped and step() completes what it can of
    that step and lets go of the optimizer: a group added then is not hooked, and a new
    handle may be made at once."""
    torch.manual_seed(0)
    model, extra = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    opt = PNM(model.parameters(), lr=0.1)
    handle = opt.step_in_backward()
    for _ in range(2):  # the probe, then a step inside backward
        opt.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        if _ == 1:
            handle.remove()
        opt.step() if _ == 0 else None
    assert opt.step_in_backward_handle is None
    opt.add_param_group(dict(params=extra.parameters()))
    opt.step_in_backward().remove()  # not refused as "already steps inside backward"
    opt.step()
    (model(torch.randn(8, 4)) + extra(torch.randn(8, 4))).square().mean().backward()
    assert all(p.grad is not None for p in extra.parameters())  # no hook freed them
    opt.step()
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [3, 3]
    assert [int(opt.state[p]["step"]) for p in extra.parameters()] == [1, 1]


def test_a_refused_probe_is_retried_afresh_and_added_groups_step_in_backward():
    model = _model()
    opt = PNM(model.parameters(), lr=1e-2)
    opt.step_in_backward()
    with pytest.raises(RuntimeError, match="gradient clipping"):
        _train(model, opt, _batches(1), clip=True)
    _train(model, opt, _batches(2))  # the loop fixed: the probe passes, then in backward
    extra = torch.nn.Linear(16, 3)
    opt.add_param_group({"params": list(extra.parameters())})
    opt.zero_grad()
    (model(_batches(1)[0]).sum() + extra(_batches(1)[0]).sum()).backward()
    assert all(p.grad is None for p in [*model.parameters(), *extra.parameters()])
    assert int(opt.state[extra.weight]["step"]) == 1


def _regrouped_training(in_backward, edit_at, edit, moved, loop="sgd-after"):
    """Six steps of AdaPNM in buckets of one parameter; before step `edit_at` the last bias
    or the first weight (every parameter after it then one place earlier) is taken out of
    the group ("to-sgd": given to torch's SGD) or moved into a group of its own
    ("new-group", add_param_group with another lr). SGD's part of the loop (`loop`): it
    steps after ours ("sgd-after") or before ("sgd-first"), clips its gradient first
    ("sgd-clips"), or also steps after a backward pass of its own that reaches nothing of
    ours ("sgd-own-pass"). Returns the model and whether that bias held a gradient after
    each backward pass from then on."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2, weight_decay=0.1, backend="fused")
    if in_backward:
        opt.step_in_backward(bucket_mib=1e-6)
    bias = model[4].bias if moved == "last-bias" else model[0].weight
    other, kept = None, []
    for t, x in enumerate(_batches(6)):
        if t == edit_at:
            opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"]
                                             if p is not bias]
            if edit == "to-sgd":
                other = torch.optim.SGD([bias], lr=0.5)
            else:
                opt.add_param_group(dict(params=[bias], lr=1e-3))
        model(x).pow(2).mean().backward()
        if t >= edit_at:
            kept.append(bias.grad is not None)
        if other is not None and loop == "sgd-clips":
            torch.nn.utils.clip_grad_norm_([bias], 1e-3)
        if other is not None and loop == "sgd-first":
            other.step()
        opt.step()
        if other is not None and loop != "sgd-first":
            other.step()
        if other is not None and loop == "sgd-own-pass":
            other.zero_grad()
            (bias * x.sum()).sum().backward()
            other.step()
        if other is not None:
            other.zero_grad()
        # After the step: zeroed before backward, the ordinary loop would add the bias's last
        # gradient from our group to its first in SGD's (our zero_grad no longer reaches it),
        # where in backward that gradient was freed once stepped.
        opt.zero_grad()
    return model, kept


@pytest.mark.parametrize("edit_at", [0, 3], ids=["before-the-first-step", "mid-training"])
@pytest.mark.parametrize("edit", ["to-sgd", "new-group"])
@pytest.mark.parametrize("moved", ["last-bias", "first-weight"])
def test_a_parameter_taken_out_of_its_group_is_stepped_where_it_went(edit, edit_at, moved):
    """Its hook stays (autograd's cannot be removed one by one): taken out of the optimizer
    it keeps its gradient for whoever steps it now; moved into a new group it is hooked once
    (a second hook would count two backward passes at the probe). Bitwise the ordinary
    loop either way."""
    if "fused" not in __import__("pnm_kernels").available_backends("cpu"):
        pytest.skip("pnm_kernels._C is not built")
    ordinary, _ = _regrouped_training(False, edit_at, edit, moved)
    model, kept = _regrouped_training(True, edit_at, edit, moved)
    assert all(kept) if edit == "to-sgd" else not any(kept[1:])
    for p, q in zip(model.parameters(), ordinary.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("edit_at", [0, 3], ids=["before-the-first-step", "mid-training"])
@pytest.mark.parametrize("loop", ["sgd-first", "sgd-clips", "sgd-own-pass"])
def test_what_the_new_owner_does_with_a_parameter_taken_out_is_not_this_optimizers_concern(
        loop, edit_at):
    """A parameter handed to another optimizer is no longer judged by the handle: that
    optimizer stepping it before ours, clipping its gradient between backward and step, or
    running a backward pass that reaches only it are the other's loop, which the probe and
    the checks of later passes would otherwise refuse as edits or extra passes of ours."""
    if "fused" not in __import__("pnm_kernels").available_backends("cpu"):
        pytest.skip("pnm_kernels._C is not built")
    ordinary, _ = _regrouped_training(False, edit_at, "to-sgd", "last-bias", loop)
    model, kept = _regrouped_training(True, edit_at, "to-sgd", "last-bias", loop)
    assert all(kept)
    for p, q in zip(model.parameters(), ordinary.parameters()):
        assert torch.equal(p, q)


def test_load_state_dict_keeps_the_step_in_backward():
    """torch's load_state_dict goes through __setstate__, which makes the step paths anew: the
    handle stays (its refusals too), and the loaded state steps inside backward."""
    runs = []
    for in_backward in (False, True):
        model = _model()
        opt = AdaPNM(model.parameters(), lr=1e-2, weight_decay=0.1)
        handle = opt.step_in_backward(bucket_mib=0.05) if in_backward else None
        batches = _batches(6)
        _train(model, opt, batches[:3])
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        if handle is not None:
            assert opt.step_in_backward_handle is handle
            with pytest.raises(RuntimeError, match="already steps inside backward"):
                opt.step_in_backward()
        _train(model, opt, batches[3:])
        if handle is not None:
            assert all(p.grad is None for p in model.parameters())
            with pytest.raises(RuntimeError, match="no backward pass since the last one"):
                opt.step(lambda: 0.0)  # a second step for the pass that stepped inside
        runs.append((model, opt))
    _assert_same(*runs[0], *runs[1])


def test_load_state_dict_between_backward_and_step_is_refused_past_the_probe_nothing_loaded():
    """The ordinary step would step the loaded state with the pass's gradients, which stepped
    inside backward already: refused, the state as it was; in the probe's iteration (an
    ordinary step) it loads, and a load after a failed pass (recovering) is not refused (the
    zero_grad() skipping that batch says that buckets it had stepped stay stepped)."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    opt.step_in_backward(bucket_mib=0.05)
    batches = _batches(4)
    model(batches[0]).pow(2).mean().backward()
    saved = copy.deepcopy(opt.state_dict())  # no state yet
    opt.load_state_dict(copy.deepcopy(saved))  # the probe's iteration
    opt.step()
    opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    model(batches[1]).pow(2).mean().backward()
    state = copy.deepcopy(opt.state_dict()["state"])
    assert any(not torch.equal(saved["state"][0][k], v) for k, v in state[0].items())
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) between a backward pass and "
                                           r"its step\(\).*Nothing was loaded"):
        opt.load_state_dict(saved)
    for i, entry in opt.state_dict()["state"].items():
        assert all(torch.equal(state[i][k], v) for k, v in entry.items())
    opt.step()
    opt.zero_grad()
    x = batches[2]  # the later layers' buckets step, then the failure: the first layer's not
    with pytest.raises(RuntimeError, match="simulated failure"):
        (_FailsInBackward.apply(model[0](x)).sum() + model(x).pow(2).mean()).backward()
    assert float(opt.state[model[4].weight]["step"]) == 3
    assert float(opt.state[model[0].weight]["step"]) == 2
    opt.load_state_dict(saved)  # recovering from a checkpoint
    with pytest.warns(UserWarning, match="failed midway: the buckets it stepped before "
                                         "failing stay stepped"):
        opt.zero_grad()
    assert float(opt.state[model[4].weight]["step"]) == 1


def test_params_set_by_hand_as_a_set_are_refused_naming_the_group_nothing_stepped():
    """Inside backward no bucket of such a group steps (its gradients stay); step() then
    refuses the group, naming it, as the ordinary step does."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    opt.step_in_backward(bucket_mib=1e-6)
    _train(model, opt, _batches(2))  # the probe, then a step inside backward
    opt.param_groups[0]["params"] = set(opt.param_groups[0]["params"])
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(_batches(3)[2]).pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\] is a set; it must be a "
                                        "list of parameters"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _shared_layer_checkpointed(checkpoint_from):
    """A layer applied twice (weights shared, ALBERT-style), each application under a
    reentrant checkpoint from step `checkpoint_from` on: each nested backward pass makes a
    gradient of the shared layer."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    shared, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    opt = PNM([*shared.parameters(), *head.parameters()], lr=1e-2)
    opt.step_in_backward()
    gen = torch.Generator().manual_seed(1)
    for t in range(3):
        x = torch.randn(4, 8, generator=gen, requires_grad=True)
        layer = lambda h: torch.tanh(shared(h))  # noqa: E731
        if t >= checkpoint_from:
            h = checkpoint(layer, checkpoint(layer, x, use_reentrant=True), use_reentrant=True)
        else:
            h = layer(layer(x))
        opt.zero_grad()
        head(h).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("checkpoint_from", [0, 1], ids=["in-the-probe", "after-the-probe"])
def test_a_parameter_reached_by_two_reentrant_checkpoints_is_refused_not_stepped_twice(
        checkpoint_from):
    """Its hook runs in each nested backward pass: stepping at each would step it twice with
    a part of its gradient each time. The probe refuses it before anything moved; after the
    probe, its second gradient is refused at once, saying what to do (no silent second
    step)."""
    with pytest.raises(RuntimeError, match=r"reentrant checkpoint segments .* "
                                           r"use_reentrant=False"):
        _shared_layer_checkpointed(checkpoint_from)


def _take_out(opt, p):
    opt.param_groups[0]["params"] = [q for q in opt.param_groups[0]["params"] if q is not p]


def _move_to_a_new_group(opt, p):
    _take_out(opt, p)
    opt.add_param_group({"params": [p], "lr": 0.5})


@pytest.mark.parametrize("edit", [_take_out, _move_to_a_new_group],
                         ids=["taken-out", "moved-into-another-group"])
def test_a_parameter_regrouped_between_backward_and_step_is_refused_by_the_probe_or_said(edit):
    """The ordinary step steps the groups as they are at step() (a parameter taken out not at
    all, one moved with its new group's lr); inside backward it stepped in its group at
    backward. In the probe's iteration: refused naming the group, nothing stepped; past the
    probe (it stepped already): said by a warning. Added to a group, nothing is said."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    opt.step_in_backward(bucket_mib=1e-6)
    batches = _batches(3)
    model(batches[0]).pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    edit(opt, model[4].bias)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\] \(a parameter taken "
                                           r"out of it, or moved into another group\) was "
                                           r"changed between backward and step\(\).*nothing "
                                           r"was stepped"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not opt.state
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    opt.step_in_backward(bucket_mib=1e-6)
    _train(model, opt, batches[:1])  # the probe
    opt.zero_grad()
    model(batches[1]).pow(2).mean().backward()
    edit(opt, model[4].bias)
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\['params'\] \(a parameter taken"):
        opt.step()
    with warnings.catch_warnings():  # a parameter added to a group is no change of this kind
        warnings.simplefilter("error")
        opt.zero_grad()
        model(batches[2]).pow(2).mean().backward()
        opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(3)))
        opt.step()


def test_a_lazy_parameter_is_refused_naming_it_nothing_hooked():
    """A lazy module's uninitialized parameter takes no gradient hook: step_in_backward()
    (or a group added to an optimizer stepping inside backward) refuses it naming it, and
    leaves nothing hooked or registered; after a dry run a new optimizer steps inside
    backward as usual. A hook refused midway (by torch) leaves none of the others either."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LazyLinear(1))
    opt = AdaPNM(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\] is an "
                                         r"uninitialized parameter"):
        opt.step_in_backward()
    assert opt.step_in_backward_handle is None and not stepping_in_backward(model.parameters())
    assert not model[0].weight._post_accumulate_grad_hooks
    model(torch.randn(2, 3))  # the dry run
    opt = AdaPNM(model.parameters(), lr=1e-2)
    handle = opt.step_in_backward()
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] is an "
                                         r"uninitialized parameter"):
        opt.add_param_group({"params": torch.nn.LazyLinear(1).weight})
    assert len(opt.param_groups) == 1
    handle.remove()
    refused_at = model[0].bias

    def register(p, hook, original=torch.Tensor.register_post_accumulate_grad_hook):
        if p is refused_at:
            raise RuntimeError("refused by torch")
        return original(p, hook)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "register_post_accumulate_grad_hook", register)
        with pytest.raises(RuntimeError, match="refused by torch"):
            opt.step_in_backward()
    assert opt.step_in_backward_handle is None and not stepping_in_backward(model.parameters())
    assert not model[0].weight._post_accumulate_grad_hooks
