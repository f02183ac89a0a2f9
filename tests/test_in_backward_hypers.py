"""optimizer.step_in_backward() (docs/design.md §9) and hyper-parameters set by a training
loop: an lr set between backward and step() (refused by the probe, nothing stepped; past the
probe said, applied from the next pass, and at once to what step() itself steps: the sums of
micro-batches the last pass missed), and hyper-parameters set before backward (neither
refused nor said)."""
import contextlib
import re
import warnings

import pytest
import torch

from pnm_kernels import PNM, AdaPNM
from test_step_in_backward import _assert_same, _batches, _model, _train


def _lr_set_between_backward_and_step(in_backward, set_at, lr_kind="float"):
    """Five steps of PNM, small buckets; before the step `set_at` a new lr is set (a warmup
    scheduler stepped before optimizer.step(), an old BERT recipe): between backward and
    step() in backward (what is checked), before the next backward pass in the ordinary
    loop (what stepping in backward can do)."""
    model = _model()
    lr = 1e-2 if lr_kind == "float" else torch.tensor(1e-2)
    opt = PNM(model.parameters(), lr=lr, weight_decay=0.1)
    if in_backward:
        opt.step_in_backward(bucket_mib=1e-6)

    def set_lr():
        if lr_kind == "float":
            opt.param_groups[0]["lr"] = 3e-2
        elif lr_kind == "tensor-filled":
            opt.param_groups[0]["lr"].fill_(3e-2)
        else:  # bumps no version: seen by the value
            opt.param_groups[0]["lr"].data.fill_(3e-2)

    for t, x in enumerate(_batches(5)):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if t == set_at and in_backward:
            set_lr()
        opt.step()
        if t == set_at and not in_backward:
            set_lr()
    return model, opt


@pytest.mark.parametrize("lr_kind", ["float", "tensor-filled", "tensor-data-filled"])
def test_an_lr_set_between_backward_and_step_is_refused_by_the_probe_nothing_stepped(lr_kind):
    """The ordinary step would step with it; the buckets inside backward could not: the
    probe finds it before any parameter moved, naming the group's key."""
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['lr'\] was changed between "
                                           r"backward and step\(\).*nothing was stepped"):
        _lr_set_between_backward_and_step(True, set_at=0, lr_kind=lr_kind)
    model = _model()
    opt = PNM(model.parameters(), lr=1e-2)
    opt.step_in_backward()
    model(_batches(1)[0]).pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["betas"] = (0.8, 1.0)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['betas'\]"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not opt.state



@pytest.mark.parametrize("lr_kind", ["float", "tensor-filled", "tensor-data-filled"])
def test_an_lr_set_between_backward_and_step_after_the_probe_is_said_and_applies_next(lr_kind):
    """Past the probe the buckets have stepped with the lr before: a warning names it, and
    training goes on as the ordinary loop where the lr was set after that step, bitwise."""
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\['lr'\] was changed between "
                                         r"backward and step\(\).*applies from the next"):
        in_backward = _lr_set_between_backward_and_step(True, set_at=2, lr_kind=lr_kind)
    _assert_same(*_lr_set_between_backward_and_step(False, set_at=2, lr_kind=lr_kind),
                 *in_backward)


def _lr_set_after_micro_batches_the_last_pass_misses(in_backward, lr_set_before_step):
    """Past the probe, micro-batches inside accumulating() reach both layers, the last pass
    only the first; the lr is set before step() or after it."""

    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    opt = PNM([*a.parameters(), *b.parameters()], lr=1e-2)
    handle = opt.step_in_backward(bucket_mib=1e-6) if in_backward else None
    gen = torch.Generator().manual_seed(1)
    caught = []
    for t in range(3):
        opt.zero_grad()
        x = torch.randn(3, 4, generator=gen)
        if t == 2:
            with handle.accumulating() if handle else contextlib.nullcontext():
                b(a(x)).square().mean().backward()
            a(x).square().mean().backward()
            if lr_set_before_step:
                opt.param_groups[0]["lr"] = 5e-2
        else:
            b(a(x)).square().mean().backward()
        with warnings.catch_warnings(record=True) as caught_now:
            warnings.simplefilter("always")
            opt.step()
        caught += [str(w.message) for w in caught_now]
        if t == 2 and not lr_set_before_step:
            opt.param_groups[0]["lr"] = 5e-2
    return [*a.parameters()], [*b.parameters()], caught


def test_an_lr_set_before_step_applies_now_to_sums_no_bucket_took_and_the_warning_says_so():
    """The last pass missed the second layer: its micro-batches' sum steps in step(), with
    the lr set before it (as the ordinary step would), while the first layer stepped inside
    backward with the lr before; the warning says both."""
    first, second, caught = _lr_set_after_micro_batches_the_last_pass_misses(True, True)
    assert len(caught) == 1 and re.search(
        r"used the value before, what step\(\) steps now \(gradients no bucket took.*\) "
        r"the new one", caught[0])
    first_set_after, _, _ = _lr_set_after_micro_batches_the_last_pass_misses(False, False)
    _, second_set_before, _ = _lr_set_after_micro_batches_the_last_pass_misses(False, True)
    assert all(torch.equal(p, q) for p, q in zip(first, first_set_after))
    assert all(torch.equal(p, q) for p, q in zip(second, second_set_before))


def test_hyper_parameters_set_before_backward_are_neither_refused_nor_said():
    """Schedulers stepped after optimizer.step() (every step, here) set the lr before the
    next backward pass, as stepping in backward needs."""

    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    opt.step_in_backward(bucket_mib=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (t + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, opt, _batches(4), scheduler)

