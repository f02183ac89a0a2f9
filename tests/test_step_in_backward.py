"""optimizer.step_in_backward() (docs/design.md §9): each gradient stepped, in buckets, as soon
as autograd has accumulated it, then freed. It gives the ordinary step's parameters and state
bitwise over many steps, on every fast path and with compressed state; a training loop written
for the ordinary optimizer runs unchanged (its step() and zero_grad() harmless, schedulers and
checkpoints as before); what cannot be applied to gradients that are gone (GradScaler,
clipping, accumulation without saying so) is refused before any parameter moved."""
import copy

import pytest
import torch

from cases import FAST_PATHS, OPTIMIZERS, parametrize
from pnm_kernels import PNM, AdaPNM

# Parameter dtype and optimizer arguments: as usual, and the smallest-memory recipe (bf16
# parameters rounded stochastically, int8 state).
RECIPES = {"plain": (torch.float32, {}),
           "bf16-int8": (torch.bfloat16, dict(state_dtype=torch.int8, bf16_stochastic_round=True))}


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 4)).to(dtype)


def _batches(steps, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(32, 16, generator=gen).to(dtype) for _ in range(steps)]


def _train(model, opt, batches, scheduler=None, clip=False):
    """The ordinary training loop, unchanged for either kind of step."""
    for x in batches:
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _assert_same(model_a, opt_a, model_b, opt_b):
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
        for key, value in opt_a.state[p].items():
            assert torch.equal(value, opt_b.state[q][key]), key


@pytest.mark.parametrize("mode", list(RECIPES))
@pytest.mark.parametrize("bucket_mib", [0.05, 100.0], ids=["small-buckets", "one-bucket"])
@parametrize(FAST_PATHS)
def test_the_step_in_backward_is_the_ordinary_step_bitwise(name, path, bucket_mib, mode):
    dtype, kwargs = RECIPES[mode]
    if path == "triton" and bucket_mib > 1:
        pytest.skip("the Triton interpreter takes seconds a step on a CPU: small buckets only")
    steps = 3 if path == "triton" else 8
    runs = []
    for in_backward in (False, True):
        model = _model(dtype)
        opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, weight_decay=0.1, backend=path,
                               **kwargs)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        handle = opt.step_in_backward(bucket_mib=bucket_mib) if in_backward else None
        _train(model, opt, _batches(steps, dtype), scheduler)
        runs.append((model, opt))
        if handle is not None:
            handle.remove()
    _assert_same(*runs[0], *runs[1])


def test_gradients_are_freed_during_backward_and_none_is_left_after_it():
    """Buckets of one parameter: the last layer's gradients are gone before backward reaches
    the first layer (seen from a hook on the first layer's output), and no parameter holds a
    gradient once backward is done."""
    model = _model()
    opt = PNM(model.parameters(), lr=1e-2)
    opt.step_in_backward(bucket_mib=1e-6)
    _train(model, opt, _batches(1))  # the first step: the ordinary probe
    opt.zero_grad()
    seen = []
    x = _batches(1)[0]
    hidden = model[0](x)
    hidden.register_hook(lambda g: seen.append([p.grad is None for p in model[4].parameters()]))
    loss = model[1:](hidden).pow(2).mean()
    loss.backward()
    assert seen == [[True, True]]
    assert all(p.grad is None for p in model.parameters())


def test_accumulation_inside_accumulating_blocks_sums_micro_batches_as_the_ordinary_step():
    runs = []
    for in_backward in (False, True):
        model = _model()
        opt = AdaPNM(model.parameters(), lr=1e-2)
        handle = opt.step_in_backward(bucket_mib=0.05) if in_backward else None
        batches = _batches(12)
        for step in range(4):
            opt.zero_grad()
            for i, x in enumerate(batches[3 * step:3 * step + 3]):
                loss = model(x).pow(2).mean()
                if handle is not None and i < 2:
                    with handle.accumulating():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
        runs.append((model, opt))
    for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        torch.testing.assert_close(p, q)  # sums of three: added in the same order


def _refused_in_the_probe(loop, match):
    model = _model()
    opt = PNM(model.parameters(), lr=1e-2)
    opt.step_in_backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=match):
        loop(model, opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not opt.state


def test_accumulation_without_saying_so_is_refused_before_anything_moves():
    def loop(model, opt):
        for x in _batches(2):
            model(x).pow(2).mean().backward()
        opt.step()
    _refused_in_the_probe(loop, r"2 backward passes .* handle.accumulating\(\)")


def test_gradient_clipping_is_refused_before_anything_moves():
    _refused_in_the_probe(lambda model, opt: _train(model, opt, _batches(1), clip=True),
                          r"changed between backward and step \(gradient clipping")


def test_gradients_edited_without_a_new_version_are_refused_before_anything_moves():
    """Edits through .data bump no version counter (nor do in-place foreach ops on a DTensor
    gradient, as FSDP2's clipping runs them: test_distributed.py); the probe compares the
    gradients' bits too."""
    def loop(model, opt):
        model(_batches(1)[0]).pow(2).mean().backward()
        model[0].weight.grad.data.mul_(0.5)
        opt.step()
    _refused_in_the_probe(loop, r"changed between backward and step")


def test_a_step_before_any_backward_pass_leaves_the_probe_to_the_first_real_one():
    """A step with no backward pass before it (gradients set by hand, as DCP's optimizer state
    initialisation does) is not taken as the training loop's probe: clipping in the loop
    after it is still refused."""
    model = _model()
    opt = PNM(model.parameters(), lr=1e-2)
    opt.step_in_backward()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    with pytest.raises(RuntimeError, match="gradient clipping"):
        _train(model, opt, _batches(1), clip=True)


def test_grad_scaler_is_refused_before_anything_moves():
    def loop(model, opt):
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(model(_batches(1)[0]).pow(2).mean()).backward()
        scaler.step(opt)
    _refused_in_the_probe(loop, r"GradScaler")


def test_a_refused_grad_scaler_leaves_no_scale_behind_for_the_ordinary_step():
    """GradScaler deletes optimizer.grad_scale and found_inf only after a step that returned:
    the refusal drops them, so that the ordinary step after handle.remove() does not unscale
    by a stale scale (nor is every later step refused as GradScaler's)."""
    model, ordinary = _model(), _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    ordinary_opt = AdaPNM(ordinary.parameters(), lr=1e-2)
    handle = opt.step_in_backward()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(_batches(1)[0]).pow(2).mean()).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    handle.remove()
    for m, o in ((model, opt), (ordinary, ordinary_opt)):
        o.zero_grad()
        _train(m, o, _batches(3)[1:])
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == [2.0] * 6
    _assert_same(model, opt, ordinary, ordinary_opt)


def _closure_steps(model, opt, batches, scheduler=None, clip=False):
    """A framework's loop (Lightning's): step(closure), the closure zeroing, running forward
    and backward (and clipping, as Lightning does after it) and returning the loss."""
    losses = []
    for x in batches:
        def closure():
            opt.zero_grad()
            loss = model(x).float().pow(2).mean()
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            return loss
        losses.append(opt.step(closure))
        if scheduler is not None:
            scheduler.step()
    return losses


@parametrize(FAST_PATHS)
def test_step_with_a_closure_steps_inside_its_backward_bitwise_the_ordinary_step(name, path):
    """step(closure) runs the closure, whose backward steps the buckets (the gradients freed
    before the closure returns), then finishes: bitwise the ordinary closure step, the loss
    returned."""
    steps = 3 if path == "triton" else 6
    runs, freed = [], []
    for in_backward in (False, True):
        model = _model()
        opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, weight_decay=0.1, backend=path)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        handle = opt.step_in_backward(bucket_mib=0.05) if in_backward else None
        losses = _closure_steps(model, opt, _batches(steps), scheduler)
        if handle is not None:
            freed.append(all(p.grad is None for p in model.parameters()))
            handle.remove()
        runs.append((model, opt, losses))
    assert freed == [True]
    assert [x.item() for x in runs[0][2]] == [x.item() for x in runs[1][2]]
    _assert_same(*runs[0][:2], *runs[1][:2])


def test_a_closure_that_clips_is_refused_at_the_probe_nothing_stepped():
    """Clipping after backward inside the closure (Lightning's gradient_clip_val) changes the
    gradients the buckets would have stepped with: refused by the probe's step."""
    model = _model()
    opt = PNM(model.parameters(), lr=1e-2)
    opt.step_in_backward()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="changed"):
        _closure_steps(model, opt, _batches(1), clip=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not opt.state


def test_a_closure_under_grad_scaler_is_refused_before_it_runs():
    model = _model()
    opt = PNM(model.parameters(), lr=1e-2)
    opt.step_in_backward()
    opt.grad_scale = torch.ones(())  # what GradScaler.step() sets before calling step()
    ran = []
    with pytest.raises(RuntimeError, match="GradScaler"):
        opt.step(lambda: ran.append(1))
    assert ran == [] and not hasattr(opt, "grad_scale")


def test_a_closure_without_backward_after_a_step_is_refused_nothing_stepped_twice():
    """A closure that only evaluates (no backward) after a step: the ordinary step would
    step the last gradients again, which stepped inside backward and were freed."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    opt.step_in_backward()
    _closure_steps(model, opt, _batches(3))
    after = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="no backward pass since the last one"):
        opt.step(lambda: model(_batches(1)[0]).pow(2).mean())
    for key, value in model.state_dict().items():
        assert torch.equal(value, after[key]), key


def test_a_checkpoint_saved_in_backward_mode_resumes_in_the_ordinary_one():
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2, state_dtype=torch.int8)
    handle = opt.step_in_backward(bucket_mib=0.05)
    _train(model, opt, _batches(4))
    saved, weights = copy.deepcopy((opt.state_dict(), model.state_dict()))
    _train(model, opt, _batches(7)[4:])
    handle.remove()
    resumed = _model()
    resumed.load_state_dict(weights)
    opt2 = AdaPNM(resumed.parameters(), lr=1e-2, state_dtype=torch.int8)
    opt2.load_state_dict(saved)
    _train(resumed, opt2, _batches(7)[4:])
    _assert_same(model, opt, resumed, opt2)


def test_remove_restores_the_ordinary_step_and_its_gradients():
    model = _model()
    opt = PNM(model.parameters(), lr=1e-2)
    with opt.step_in_backward():
        _train(model, opt, _batches(2))
    model(_batches(1)[0]).pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("bad", [0, -1.0, "25"])
def test_a_bad_bucket_size_is_refused(bad):
    with pytest.raises(ValueError, match="bucket_mib"):
        PNM(_model().parameters()).step_in_backward(bucket_mib=bad)


def test_twice_and_plain_tensors_under_several_ranks_are_refused(monkeypatch):
    opt = PNM(_model().parameters())
    opt.step_in_backward()
    with pytest.raises(RuntimeError, match=r"already steps inside backward \(remove\(\) its "
                                           r"handle first: optimizer.step_in_backward_handle"):
        opt.step_in_backward()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\] .*DDP"):
        PNM(_model().parameters()).step_in_backward()
    # A group added later under several ranks: refused before it joins the optimizer.
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 1)
    opt = PNM(_model().parameters())
    opt.step_in_backward()
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[0\] .*DDP"):
        opt.add_param_group({"params": torch.nn.Linear(2, 2).weight})
    assert len(opt.param_groups) == 1


def test_a_compiled_model_steps_in_backward_as_with_the_ordinary_step():
    """torch.compile of the model: its backward still ends in autograd's accumulation into
    each parameter, where the hooks step; the same compiled model trained with the ordinary
    step gives the same bits."""
    torch._dynamo.reset()
    runs = []
    for in_backward in (False, True):
        model, opt = _adapnm(in_backward)
        _train(torch.compile(model), opt, _batches(4))
        runs.append((model, opt))
    _assert_same(*runs[0], *runs[1])


def _adapnm(in_backward):
    """A model and its AdaPNM, stepping in backward (small buckets) or not."""
    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2)
    if in_backward:
        opt.step_in_backward(bucket_mib=0.05)
    return model, opt


def test_a_compiled_training_step_steps_in_backward_as_the_compiled_ordinary_one():
    """torch.compile of the whole training step (forward, backward, step, zero_grad): the
    hooks step the buckets eagerly inside backward, and the compiled step() finds nothing
    left. The compiled ordinary step runs the traced step (foreach ops under inductor), so
    the two agree to rounding, each parameter stepped once a step."""
    torch._dynamo.reset()
    runs = []
    for in_backward in (False, True):
        model, opt = _adapnm(in_backward)

        @torch.compile
        def train_step(x):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

        for x in _batches(4):
            train_step(x)
        runs.append((model, opt))
    (ordinary, ordinary_opt), (model, opt) = runs
    for p, q in zip(model.parameters(), ordinary.parameters()):
        torch.testing.assert_close(p, q)
        assert p.grad is None
        assert int(opt.state[p]["step"]) == int(ordinary_opt.state[q]["step"]) == 4


@pytest.mark.parametrize("fullgraph", [False, True], ids=["", "fullgraph"])
def test_compiled_autograd_is_refused_by_name_before_any_step(fullgraph):
    """Compiled autograd traces the backward pass into a graph, where the hooks' steps and
    the pass's end cannot run eagerly (torch failed inside its engine, naming neither):
    refused by name at the first gradient, nothing stepped."""
    torch._dynamo.reset()
    model, opt = _adapnm(True)
    before = [p.detach().clone() for p in model.parameters()]
    compiler = torch.compile(backend="aot_eager", fullgraph=fullgraph)
    with pytest.raises(Exception, match="step_in_backward does not run under compiled "
                                        "autograd"):
        with torch._dynamo.compiled_autograd._enable(compiler):
            model(next(iter(_batches(1)))).pow(2).mean().backward()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not any(int(opt.state[p]["step"]) for p in model.parameters() if p in opt.state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_checkpoint_of_int8_state_resumes_bitwise_in_backward():
    """torch.distributed.checkpoint in one process (get_state_dict, save, load into a fresh
    model and optimizer that also step in backward, set_state_dict), int8 state."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _model()
    opt = AdaPNM(model.parameters(), lr=1e-2, state_dtype=torch.int8)
    opt.step_in_backward(bucket_mib=0.05)
    _train(model, opt, _batches(3))
    fresh = _model()
    fresh_opt = AdaPNM(fresh.parameters(), lr=1e-2, state_dtype=torch.int8)
    fresh_opt.step_in_backward(bucket_mib=0.05)
    with tempfile.TemporaryDirectory() as directory:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=directory)
        set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"])
    _train(model, opt, _batches(6)[3:])
    _train(fresh, fresh_opt, _batches(6)[3:])
    _assert_same(model, opt, fresh, fresh_opt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_cuda_graph_captures_a_training_step_that_steps_in_backward(name):
    """Where the ordinary fused step is capturable, so is the step in backward: a captured
    forward and backward (whose hooks step the buckets) replays as the same steps taken
    eagerly. The warm-up steps (outside the capture) include the probe step."""
    models = [_model().cuda() for _ in range(2)]  # the same weights: _model seeds
    x = torch.randn(32, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    opts = [OPTIMIZERS[name](m.parameters(), lr=torch.tensor(1e-2, device="cuda"),
                             backend="fused") for m in models]
    handles = [opt.step_in_backward(bucket_mib=0.05) for opt in opts]

    def train_step(model, opt):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for model, opt in zip(models, opts):
                train_step(model, opt)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step(models[0], opts[0])
    for _ in range(5):
        graph.replay()
        train_step(models[1], opts[1])
    torch.cuda.synchronize()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q)
    for handle in handles:
        handle.remove()
