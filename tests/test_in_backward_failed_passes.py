"""optimizer.step_in_backward() (docs/design.md §9) after a backward pass that fails midway
(an out-of-memory error the loop catches): its batch skipped by optimizer.zero_grad(), by the
model's (found at the next pass), or followed by step() or a checkpoint's load; under
zero_grad(set_to_none=False) too, and after a reentrant checkpoint's nested pass ended. The
ordinary loop's bits where nothing stepped before the failure; said where buckets had
stepped; refused where the ordinary step would step with gradients that are gone."""
import copy

import pytest
import torch

from conftest import assert_same_bits
from pnm_kernels import PNM, AdaPNM
from test_step_in_backward import _batches, _model


class _FailsInBackward(torch.autograd.Function):
    """Identity forward; its backward raises (an out-of-memory error, say)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("simulated failure in backward")


def _loop_with_edge_cases(in_backward, set_to_none_at=None):
    """zero_grad(set_to_none=False) (but set_to_none=True at step `set_to_none_at`); a layer
    the loss reaches only in some steps; one backward pass that fails after a layer's
    gradients were accumulated (the batch skipped)."""
    torch.manual_seed(0)
    a, b, c, sometimes = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.Linear(4, 2),
                          torch.nn.Linear(4, 2))
    opt = PNM([*a.parameters(), *b.parameters(), *sometimes.parameters()], lr=0.1,
              weight_decay=0.1)
    if in_backward:
        opt.step_in_backward(bucket_mib=100 / 2**20)  # a's gradients alone stay pending
    gen = torch.Generator().manual_seed(2)
    for k in range(6):
        opt.zero_grad(set_to_none=k == set_to_none_at)
        x = torch.randn(8, 4, generator=gen)
        if k == 3:
            loss = _FailsInBackward.apply(c(x)).sum() + a(x).sum()
        else:
            loss = b(a(x)).square().mean() + (sometimes(x).square().mean() if k < 2 else 0)
        try:
            loss.backward()
        except RuntimeError:
            continue
        opt.step()
    return [a, b, sometimes], opt


@pytest.mark.parametrize("set_to_none_at, steps_of_the_unreached_layer", [(None, 5), (2, 2)])
def test_zero_filled_gradients_and_a_failed_backward_pass_step_as_the_ordinary_loop(
        set_to_none_at, steps_of_the_unreached_layer):
    """zero_grad(set_to_none=False) keeps a zero gradient for a layer the loss stops reaching,
    which the ordinary step still steps (decay, momentum, its counter): so does the step in
    backward, at step(); until one zero_grad(set_to_none=True) drops it, after which neither
    steps the layer. A backward pass that fails leaves nothing pending for the next."""
    (layers_a, opt_a), (layers_b, opt_b) = (_loop_with_edge_cases(False, set_to_none_at),
                                            _loop_with_edge_cases(True, set_to_none_at))
    params_a = [p for layer in layers_a for p in layer.parameters()]
    params_b = [p for layer in layers_b for p in layer.parameters()]
    assert int(opt_b.state[layers_b[2].weight]["step"]) == steps_of_the_unreached_layer
    assert_same_bits(opt_a, params_a, opt_b, params_b)


def test_a_failed_pass_after_buckets_stepped_then_the_batch_skipped_trains_on():
    """A backward pass that raises after some buckets stepped (an OOM the loop catches,
    zero_grad(), the next batch): what stepped stays stepped (§9; that zero_grad() says so),
    and the next passes step inside backward as before, not refused as a second gradient
    before a step()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = PNM(model.parameters(), lr=0.1)
    opt.step_in_backward(bucket_mib=1e-6)  # a parameter a bucket
    gen = torch.Generator().manual_seed(1)
    failed = 0
    for k in range(4):
        if k == 3:
            with pytest.warns(UserWarning, match="failed midway: the buckets it stepped"):
                opt.zero_grad()
        else:
            opt.zero_grad()
        hidden = model[0](torch.randn(8, 4, generator=gen))
        if k == 2:  # fails after the last layer's buckets stepped
            hidden = _FailsInBackward.apply(hidden)
        try:
            model[1](hidden).square().mean().backward()
        except RuntimeError:
            failed += 1
            continue
        opt.step()
    assert failed == 1
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [3, 3, 4, 4]
    assert all(p.grad is None for p in model.parameters())


def _failed_pass_skipped_through_the_model(in_backward, fail_at, bucket_mib):
    """A loop zeroing through the model (`model.zero_grad()`, which the optimizer does not
    see); at step `fail_at` a backward pass raises after the last two layers' gradients were
    made, and the loop skips its batch with model.zero_grad()."""
    torch.manual_seed(0)
    a, b, c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    model = torch.nn.Sequential(a, b, c)  # b's and c's gradients: 100 bytes
    opt = AdaPNM(model.parameters(), lr=1e-2)
    if in_backward:
        opt.step_in_backward(bucket_mib=bucket_mib)
    gen = torch.Generator().manual_seed(1)
    for t in range(4):
        model.zero_grad()
        x = torch.randn(3, 4, generator=gen)
        if t == fail_at:
            with pytest.raises(RuntimeError, match="simulated failure"):
                c(b(_FailsInBackward.apply(a(x)))).square().mean().backward()
            model.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("fail_at, bucket_mib", [(0, 1e-6), (2, 100.0), (2, 110 / 2**20)],
                         ids=["in-the-probe", "nothing-stepped", "a-bucket-pending"])
def test_a_failed_pass_skipped_through_the_model_trains_on_as_the_ordinary_loop(fail_at,
                                                                                bucket_mib):
    """The next pass finds that the one before never ended (the callback queued for its end
    was let go of unrun) and forgets what it left, as optimizer.zero_grad() would: the probe
    starts again, a pending bucket steps anew with this pass's gradients. Where the failed pass
    stepped nothing, the ordinary loop's bits, with no warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, opt = _failed_pass_skipped_through_the_model(True, fail_at, bucket_mib)
    ordinary, ordinary_opt = _failed_pass_skipped_through_the_model(False, fail_at, bucket_mib)
    assert_same_bits(ordinary_opt, list(ordinary.parameters()), opt, list(model.parameters()))


def test_a_failed_pass_that_stepped_skipped_through_the_model_is_said_at_the_next_pass():
    """Buckets the failed pass stepped stay stepped (the ordinary loop steps none): no
    optimizer.zero_grad() comes to say so, so the next pass's first gradient does, and that
    pass steps inside backward as any other (not refused as a second gradient)."""
    with pytest.warns(UserWarning, match=r"a backward pass after one that failed midway, "
                                         r"with no optimizer.zero_grad\(\) between"):
        model, opt = _failed_pass_skipped_through_the_model(True, 2, 1e-6)
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [4, 4, 5, 5, 5, 5]


@pytest.mark.parametrize("outer_gradient", [True, False],
                         ids=["outer-pass-hooked-first", "every-layer-above-checkpointed"])
@pytest.mark.parametrize("skipped_through", ["optimizer", "model"])
def test_a_pass_failing_after_a_reentrant_checkpoints_nested_pass_ended_is_told_failed(
        skipped_through, outer_gradient):
    """A reentrant checkpoint runs a nested backward pass, which ends (and steps what it
    made) inside a node of its outer pass. The outer pass failing after it is still a failed
    pass, whether or not a gradient of its own came before (every layer above the failure
    checkpointed, an OOM recomputing the segment below): the zero_grad() skipping its batch
    warns (it does not refuse as after a pass awaiting its step()), or, skipped through the
    model, the next pass says so and steps on (it does not refuse the stepped parameters'
    new gradients as second ones)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    a, b, c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    model = torch.nn.Sequential(a, b, c)
    opt = PNM(model.parameters(), lr=0.1)
    opt.step_in_backward(bucket_mib=1e-6)  # a parameter a bucket
    gen = torch.Generator().manual_seed(1)
    for t in range(4):
        opt.zero_grad()
        x = torch.randn(3, 4, generator=gen)
        if t != 2:
            model(x).square().mean().backward()
            opt.step()
            continue
        # c's gradients (the outer pass) or none, b's (the nested pass), then the failure
        hidden = _FailsInBackward.apply(a(x))
        top = c if outer_gradient else (lambda h: checkpoint(c, h, use_reentrant=True))
        with pytest.raises(RuntimeError, match="simulated failure"):
            top(checkpoint(b, hidden, use_reentrant=True)).square().mean().backward()
        if skipped_through == "optimizer":
            with pytest.warns(UserWarning, match="failed midway: the buckets it stepped"):
                opt.zero_grad()
        else:
            model.zero_grad()
            with pytest.warns(UserWarning, match="a backward pass after one that failed"):
                model(x).square().mean().backward()
            opt.step()
    steps = [int(opt.state[p]["step"]) for p in model.parameters()]
    assert steps == ([3, 3, 4, 4, 4, 4] if skipped_through == "optimizer" else [4, 4, 5, 5, 5, 5])


class _NestedPassCaught(torch.autograd.Function):
    """Identity; its backward runs a nested backward pass through `layer` that fails after
    the layer's gradients were made, and catches the error (falling back to the incoming
    gradient)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            x = grad.detach().requires_grad_()
            out = ctx.layer(_FailsInBackward.apply(x)).sum()  # the layer's gradients first
        try:
            out.backward()
        except RuntimeError:
            pass
        return grad, None


def test_a_pass_that_caught_a_nested_pass_failing_inside_it_is_a_pass_that_ended():
    """A nested pass that fails inside a pass that catches it and ends: the pass ended, so
    load_state_dict() before its step() is refused (nothing loaded), not taken for the
    recovery from a failed pass."""
    torch.manual_seed(0)
    inner, outer = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt = PNM([*inner.parameters(), *outer.parameters()], lr=0.1)
    opt.step_in_backward(bucket_mib=1e-6)
    gen = torch.Generator().manual_seed(1)
    for t in range(3):
        opt.zero_grad()
        x = torch.randn(3, 4, generator=gen)
        outer(_NestedPassCaught.apply(x.requires_grad_(), inner)).sum().backward()
        if t == 2:
            saved = copy.deepcopy(opt.state_dict())
            with pytest.raises(RuntimeError, match=r"load_state_dict\(\) between a backward "
                                                   r"pass and its step\(\)"):
                opt.load_state_dict(saved)
        opt.step()
    assert [int(opt.state[p]["step"]) for p in outer.parameters()] == [3, 3]


def test_step_after_a_failed_pass_and_a_load_with_no_zero_grad_between_is_refused():
    """The ordinary step would step the loaded state with all the failed pass's gradients, the
    buckets it stepped before failing used theirs (and freed them) already: refused, nothing
    stepped; zero_grad() (the batch skipped) lets training go on."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    opt.step_in_backward(bucket_mib=0.05)
    batches = _batches(4)
    for x in batches[:2]:  # the probe, then a pass stepping inside backward
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    x = batches[2]  # the later layers' buckets step, then the failure: the first layer's not
    with pytest.raises(RuntimeError, match="simulated failure"):
        (_FailsInBackward.apply(model[0](x)).sum() + model(x).pow(2).mean()).backward()
    opt.load_state_dict(saved)
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(RuntimeError, match=r"step\(\) after a backward pass that failed midway "
                                           r"and a load_state_dict\(\), with no zero_grad"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    for i, entry in opt.state_dict()["state"].items():
        assert all(torch.equal(state[i][k], v) for k, v in entry.items())
    with pytest.warns(UserWarning, match="failed midway"):
        opt.zero_grad()
    model(batches[3]).pow(2).mean().backward()
    opt.step()
    assert float(opt.state[model[0].weight]["step"]) == 3
