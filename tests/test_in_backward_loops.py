"""optimizer.step_in_backward() (docs/design.md §9) under training loops whose order of
zero_grad(), backward and step() differs from the usual one. Each loop is a script of events
run by the ordinary optimizer and by one stepping inside backward: the two give the same
parameters and state bitwise, or the step inside backward is refused at the event where the
ordinary loop would do what it cannot (step gradients it freed again, add a pass's gradients
to freed ones), before that event changes anything; or, where nothing showed it coming, at
the first event that shows it (said, after the fact)."""
import contextlib
import re

import pytest
import torch

from cases import FAST_PATHS, parametrize
from conftest import OPTIMIZERS, assert_same_bits
from test_in_backward_failed_passes import _FailsInBackward

# Events: Z optimizer.zero_grad(), m model.zero_grad(), 0 model.zero_grad(set_to_none=False),
# z every gradient zeroed in place by hand, d zeroed through .data (which counts no version),
# B a backward pass, F a backward pass
# that fails after the last layer's gradients were made (caught: the batch skipped),
# S optimizer.step(), E step_in_backward() called (at the start where the script has none).
_STEP_TWICE = r"step\(\) again with no backward pass since the last one and no zero_grad\(\)"
_ADDED = r"this backward pass added its gradients to those of the step before"
_AFTER_STEP = r"a backward pass came after step\(\) before zero_grad\(\)"
_UNCOUNTED = r"zeroed where no version counts \(`p.grad.data.zero_\(\)`"
_SKIPPED = r"zero_grad\(\) after a backward pass that no step\(\) followed \(a step skipped\)"
_HELD = r"added its gradients to those held when step_in_backward\(\) was called"

# (script, where the step inside backward is refused (None: nowhere), what it says, whether
# the refusal comes before the event changed anything)
LOOPS = {
    "zero-backward-step": ("ZBS" * 4, None, None, True),
    "backward-step-zero": ("BSZ" * 4, None, None, True),
    "zeroed-through-the-model": ("mBS" * 4, None, None, True),
    "zeroed-in-place-through-the-model": ("BS0" * 4, None, None, True),
    "zeroed-in-place-by-hand": ("BSz" * 4, None, None, True),
    "failed-pass-in-the-probe-skipped": ("ZFZ" + "ZBS" * 3, None, None, True),
    "two-steps-in-the-probe": ("ZBSS" + "ZBS" * 2, None, None, True),
    "two-steps-a-pass": ("ZBSS" * 3, 7, _STEP_TWICE, True),
    "pass-after-step-in-the-probe": ("ZBSBZ" * 3, 3, _ADDED, True),
    "pass-after-step-later": ("ZBS" * 2 + "ZBSBZ", 9, _AFTER_STEP, True),
    "never-zeroed": ("BS" * 4, 2, _ADDED, True),
    "zeroed-through-data": ("BSd" * 4, 3, _UNCOUNTED, True),
    "step-skipped": ("ZBS" * 2 + "ZBZS", 8, _SKIPPED, False),
    "enabled-between-backward-and-step": ("ZBES" + "ZBS" * 3, None, None, True),
    "enabled-between-step-and-zeroing": ("ZBSE" + "ZBS" * 3, None, None, True),
    "enabled-after-step-zeroed-through-the-model": ("BSE" + "mBS" * 3, None, None, True),
    "enabled-after-step-zeroed-in-place": ("BS0E" + "BS0" * 3, None, None, True),
    # the probe would see one pass of the loop's two a step
    "enabled-between-two-passes-of-a-step": ("ZBEBS" + "ZBBS" * 2, 4, _HELD, True),
    "enabled-after-step-never-zeroed": ("BSE" + "BS" * 3, 4, _HELD, True),
    "enabled-after-step-zeroed-through-data": ("BSEd" + "BSd" * 3, 5, _UNCOUNTED, True),
}


def _run(script, in_backward, backend, until=None):
    """The script's events up to `until` (excluded); with in_backward, the event at `until`
    raises (returned)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = OPTIMIZERS["AdaPNM"](model.parameters(), lr=1e-2, weight_decay=0.1, backend=backend)
    if in_backward and "E" not in script:
        opt.step_in_backward(bucket_mib=1e-6)  # a bucket a parameter
    gen = torch.Generator().manual_seed(1)
    raised = None
    for i, event in enumerate(script if until is None or in_backward else script[:until]):
        try:
            if event == "E":
                if in_backward:
                    opt.step_in_backward(bucket_mib=1e-6)
            elif event == "Z":
                opt.zero_grad()
            elif event == "m":
                model.zero_grad()
            elif event == "0":
                model.zero_grad(set_to_none=False)
            elif event in "zd":
                for p in model.parameters():
                    if p.grad is not None:  # (stepping inside backward frees them)
                        (p.grad if event == "z" else p.grad.data).zero_()
            elif event == "S":
                opt.step()
            else:
                x = torch.randn(4, 8, generator=gen)
                hidden = model[0](x)
                if event == "F":
                    hidden = _FailsInBackward.apply(hidden)
                try:
                    model[1:](hidden).square().mean().backward()
                except RuntimeError as e:
                    if event != "F" or "simulated failure" not in str(e):
                        raise
        except RuntimeError as e:
            assert in_backward and i == until, (i, e)
            raised = e
            break
    return model, opt, raised


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_a_loop_steps_as_the_ordinary_one_or_is_refused_where_it_cannot(loop, backend):
    script, refused_at, match, before_any_change = LOOPS[loop]
    model, opt, raised = _run(script, True, backend, until=refused_at)
    if refused_at is None:
        assert raised is None
    else:
        assert raised is not None and re.search(match, str(raised)), raised
    if before_any_change:  # the ordinary loop's parameters and state before that event
        ordinary, ordinary_opt, _ = _run(script, False, backend, until=refused_at)
        assert_same_bits(ordinary_opt, list(ordinary.parameters()), opt, list(model.parameters()))


def _clamp(p):
    p.grad.clamp_(-0.05, 0.05)


class _Branching(torch.nn.Module):
    """A head the loss reaches from the second batch on (its first gradient comes after the
    probe's step), gradients clamped in place by a post-accumulate hook of the user's."""

    def __init__(self, clamped):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        for p in self.parameters() if clamped else ():
            p.register_post_accumulate_grad_hook(_clamp)

    def forward(self, x, t, branch):
        hidden = torch.tanh(self.a(x))
        return self.b(hidden) if t >= 1 or not branch else hidden[:, :2]


# How the first pass after the probe comes: a gradient of the user's hook written again,
# replaced out of place (create_graph), or first made for a layer the probe did not see.
PASS_AFTER_THE_PROBE = {"hook-writes-gradients": dict(clamped=True),
                        "create-graph": dict(create_graph=True),
                        "branch-first-reached": dict(branch=True)}


def _branching_loop(in_backward, zero_in_place, clamped=False, create_graph=False,
                    branch=False):
    torch.manual_seed(0)
    model = _Branching(clamped)
    opt = OPTIMIZERS["AdaPNM"](model.parameters(), lr=1e-2, backend="fused")
    if in_backward:
        opt.step_in_backward(bucket_mib=1e-6)
    for t in range(4):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(t))
        model(x, t, branch).square().mean().backward(create_graph=create_graph)
        opt.step()
        if zero_in_place:
            model.zero_grad(set_to_none=False)
    return model, opt


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("how", PASS_AFTER_THE_PROBE)
def test_the_first_pass_after_the_probe_tells_zeroed_in_place_from_never_zeroed(how):
    """Never zeroed: refused at the pass's first gradient, before it steps anything, whatever
    wrote or replaced that gradient; zeroed in place through the model: the ordinary loop."""
    kwargs = PASS_AFTER_THE_PROBE[how]
    with pytest.raises(RuntimeError, match=_ADDED):
        _branching_loop(True, False, **kwargs)
    model, opt = _branching_loop(True, True, **kwargs)
    ordinary, ordinary_opt = _branching_loop(False, True, **kwargs)
    assert_same_bits(ordinary_opt, list(ordinary.parameters()), opt, list(model.parameters()))


def _gan_loop(in_backward, freeze_during_generator_pass):
    """A GAN's alternating loop: the discriminator's step on its loss, then the generator's
    on a loss whose backward pass reaches the discriminator too (its gradients dropped at its
    next zero_grad()), unless the discriminator is frozen during it."""
    torch.manual_seed(0)
    gen_net, disc = torch.nn.Linear(2, 4), torch.nn.Sequential(torch.nn.Linear(4, 1))
    opt_g = OPTIMIZERS["PNM"](gen_net.parameters(), lr=1e-2)
    opt_d = OPTIMIZERS["AdaPNM"](disc.parameters(), lr=1e-2)
    if in_backward:
        opt_g.step_in_backward(bucket_mib=1e-6), opt_d.step_in_backward(bucket_mib=1e-6)
    noise = torch.Generator().manual_seed(1)
    for _ in range(4):
        z, real = torch.randn(8, 2, generator=noise), torch.randn(8, 4, generator=noise)
        opt_d.zero_grad()
        (disc(gen_net(z).detach()).mean() - disc(real).mean()).backward()
        opt_d.step()
        opt_g.zero_grad()
        disc.requires_grad_(not freeze_during_generator_pass)
        (-disc(gen_net(z)).mean()).backward()
        disc.requires_grad_(True)
        opt_g.step()
    return [*gen_net.parameters(), *disc.parameters()], (opt_g, opt_d)


def test_a_gan_loop_steps_in_backward_with_the_discriminator_frozen_for_the_generator_pass():
    """The generator's pass reaches the discriminator, whose gradients the ordinary loop drops
    at its next zero_grad(); inside backward they would step it: refused at that pass,
    before it steps, the message saying to freeze the discriminator during it. Frozen, the
    loop gives the ordinary loop's bits."""
    with pytest.raises(RuntimeError, match=r"a GAN's generator pass reaching its "
                                           r"discriminator: freeze them during it"):
        _gan_loop(True, freeze_during_generator_pass=False)
    params, (opt_g, opt_d) = _gan_loop(True, freeze_during_generator_pass=True)
    ordinary, (ordinary_g, ordinary_d) = _gan_loop(False, freeze_during_generator_pass=True)
    assert_same_bits(ordinary_g, ordinary[:2], opt_g, params[:2])
    assert_same_bits(ordinary_d, ordinary[2:], opt_d, params[2:])


def _passes_over_one_graph(in_backward, name, backend, split, allow_mutation,
                           state_dtype=None):
    """Four steps of a two-layer model; with `split`, two backward passes over one retained
    graph, the head's first (`inputs=`), then the trunk's, which reads the head's weights
    the first pass stepped inside backward. The whole loop, ordinary step included, inside
    torch.autograd.graph.allow_mutation_on_saved_tensors() with `allow_mutation`."""
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(6, 128), torch.nn.Linear(128, 3)  # rows of an int8 block
    # Memory with gaps: no held lists, its fused step a direct call of the op.
    gappy = torch.nn.Parameter(torch.randn(4, 256)[:, ::2])
    params = [*trunk.parameters(), *head.parameters(), gappy]
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=backend, state_dtype=state_dtype)
    if in_backward:
        opt.step_in_backward(bucket_mib=1e-6)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(5, 6, generator=gen)
        with (torch.autograd.graph.allow_mutation_on_saved_tensors() if allow_mutation
              else contextlib.nullcontext()):
            loss = head(torch.tanh(trunk(x))).square().mean() + gappy.square().mean()
            if split:
                loss.backward(inputs=list(head.parameters()), retain_graph=True)
                loss.backward(inputs=[*trunk.parameters(), gappy])
            else:
                loss.backward()
            opt.step()
        opt.zero_grad()
    return opt, params


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.int8],
                         ids=["own-state", "bf16-state", "int8-state"])
@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "two-passes-one-graph"])
@parametrize(FAST_PATHS)
def test_under_allow_mutation_on_saved_tensors_parameters_saved_for_backward_step_inside_it(
        name, path, split, state_dtype):
    """torch's context for writing tensors autograd saved clones them before an op writes
    them, the fused kernels' ops too (their written arguments are positional: torch takes
    one after `*` for an out=; Triton's, written past torch's dispatcher, are shown to it):
    the step inside backward gives the ordinary loop's bits, also where a later pass over the
    same graph reads the weights an earlier one stepped."""
    ordinary = _passes_over_one_graph(False, name, path, split, True, state_dtype)
    in_backward = _passes_over_one_graph(True, name, path, split, True, state_dtype)
    assert_same_bits(*ordinary, *in_backward)


def test_without_it_a_pass_over_weights_stepped_by_an_earlier_pass_raises_torchs_error():
    """What docs/design.md §9 says is not refused: the head stepped in the first pass (it is
    stepped, not undone), and torch refuses the second pass, which saved its old weights."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _passes_over_one_graph(True, "AdaPNM", "foreach", True, allow_mutation=False)


def test_step_in_backward_takes_meta_parameters_holding_gradients():
    """Gradients held when it is called are read (whether all zero) only where they hold
    data: a model built on the meta device, as before materialising it, is taken."""
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    opt = OPTIMIZERS["AdaPNM"](model.parameters())
    handle = opt.step_in_backward()
    handle.remove()
