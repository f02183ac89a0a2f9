"""optimizer.step_in_backward(ddp=model) under DDP (docs/design.md §9): DDP's parameters step
in its communication hook, a bucket once reduced. One rank over gloo (or NCCL with a GPU):
bitwise the ordinary step, gradients left as DDP leaves them, micro-batches accumulated; three
gloo ranks bitwise ordinary DDP training. Two ranks: the ddp-in-backward mode of
test_distributed.py. What it refuses: test_ddp_in_backward_refusals.py."""
import contextlib
import copy
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import FAST_PATHS
from internals import record_bucket_steps
from pnm_kernels import PNM, AdaPNM, available_backends
# one_rank: the fixture, used by name
from test_distributed import OPTIMIZERS, STEPS, _data, _free_port, _model
from test_one_rank_distributed import ONE_RANK_DEVICE, one_rank  # noqa: F401
from test_in_backward_failed_passes import _FailsInBackward

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")


def _one_rank_ddp_training_in_backward(name, backend, in_backward, as_bucket_views=False,
                                       state_dtype=None, steps=6):
    """Steps of a DDP model with buckets of 256 bytes (after DDP's first iteration, which
    takes one bucket: the last layer's parameters, then the first's, as a bucket is closed once
    it reaches the cap), zero_grad(set_to_none=False) before every third, stepping inside
    backward or not. Returns the model, the optimizer, and the buckets stepped as
    (parameters, inside backward?)."""
    model = _model().to(ONE_RANK_DEVICE)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2**-12,
                                                    gradient_as_bucket_view=as_bucket_views)
    opt = OPTIMIZERS[name](ddp.parameters(), lr=1e-2, weight_decay=0.1, backend=backend,
                           state_dtype=state_dtype)
    buckets = record_bucket_steps(opt)
    if in_backward:
        opt.step_in_backward(ddp=ddp)
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        x, y = torch.randn(8, 128, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad(set_to_none=t % 3 != 2)
        torch.nn.functional.mse_loss(ddp(x.to(ONE_RANK_DEVICE)), y.to(ONE_RANK_DEVICE)).backward()
        opt.step()
    return model, opt, buckets


def _assert_same_training(model, opt, ordinary, ordinary_opt, grads=True):
    """Parameters, state and (DDP's, left as with the ordinary step) the gradients: the
    ordinary step's bits."""
    for p, q in zip(model.parameters(), ordinary.parameters()):
        assert torch.equal(p, q)
        if grads:
            assert (p.grad is None) == (q.grad is None)
            assert p.grad is None or torch.equal(p.grad, q.grad)
        for key, value in opt.state[p].items():
            assert torch.equal(value, ordinary_opt.state[q][key]), key


@pytest.mark.parametrize("state_dtype", [None, torch.int8], ids=["plain", "int8-state"])
@pytest.mark.parametrize("as_bucket_views", [False, True], ids=["grads", "bucket-views"])
@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_ddp_steps_in_backward_as_the_ordinary_step_bitwise(one_rank, path, name,
                                                            as_bucket_views, state_dtype):
    """step_in_backward(ddp=model): DDP's buckets step in its communication hook once
    reduced (the last one in step(), once its all-reduce is waited for); the gradients stay
    as DDP leaves them; parameters, state and gradients are the ordinary step's bits."""
    if path == "triton" and state_dtype is not None:
        pytest.skip("the Triton interpreter's int8 step is covered in test_step_in_backward.py")
    ordinary, ordinary_opt, _ = _one_rank_ddp_training_in_backward(
        name, path, False, as_bucket_views, state_dtype)
    model, opt, buckets = _one_rank_ddp_training_in_backward(
        name, path, True, as_bucket_views, state_dtype)
    # After the probe, two buckets of two parameters a step: one inside backward, the last
    # in step().
    assert buckets == [(2, True), (2, False)] * 5
    _assert_same_training(model, opt, ordinary, ordinary_opt)


def _one_rank_ddp_accumulation(name, how):
    """Four steps of two micro-batches each: the ordinary step ("ordinary"), or stepping
    in backward with the first micro-batch inside DDP's no_sync() ("no-sync": DDP reduces
    nothing and calls no hook) or inside handle.accumulating() ("accumulating": DDP reduces
    each micro-batch, the handle steps only the last). Each compared with the ordinary step
    over the same loop."""
    model = _model().to(ONE_RANK_DEVICE)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2**-12)
    opt = OPTIMIZERS[name](ddp.parameters(), lr=1e-2, weight_decay=0.1, backend="fused")
    handle = opt.step_in_backward(ddp=ddp) if how.endswith("in-backward") else None
    xs, ys = (t.to(ONE_RANK_DEVICE) for t in _data())
    for t in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            first = micro == 0
            if how.startswith("no-sync") and first:
                context = ddp.no_sync()
            elif how.startswith("accumulating") and first:
                context = handle.accumulating() if handle else contextlib.nullcontext()
            else:
                context = contextlib.nullcontext()
            with context:
                x, y = xs[t][micro * 4:(micro + 1) * 4], ys[t][micro * 4:(micro + 1) * 4]
                torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("how", ["no-sync", "accumulating"])
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_ddp_accumulates_micro_batches_in_backward_as_the_ordinary_step(one_rank, name, how):
    if "fused" not in available_backends(ONE_RANK_DEVICE):
        pytest.skip("pnm_kernels._C is not built")
    got = _one_rank_ddp_accumulation(name, f"{how}-in-backward")
    expected = _one_rank_ddp_accumulation(name, how)
    for p, q in zip(got, expected):
        assert torch.equal(p, q)


def test_a_ddp_probe_pass_skipped_by_zero_grad_steps_nothing_and_the_next_pass_probes(one_rank):
    """The probe's pass, then zero_grad() (its batch skipped: a loss gone NaN), then step():
    nothing steps, as in the ordinary loop, and the next pass is the probe."""
    model = _model().to(ONE_RANK_DEVICE)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = PNM(ddp.parameters(), lr=1e-2)
    opt.step_in_backward(ddp=ddp)
    xs, ys = (t.to(ONE_RANK_DEVICE) for t in _data())
    before = [p.detach().clone() for p in model.parameters()]
    torch.nn.functional.mse_loss(ddp(xs[0]), ys[0]).backward()
    opt.zero_grad()
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not opt.state
    torch.nn.functional.mse_loss(ddp(xs[1]), ys[1]).backward()
    opt.step()
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [1] * len(before)


@pytest.mark.parametrize("recovery", ["batch-skipped", "checkpoint-loaded"])
def test_a_ddp_backward_pass_failing_after_buckets_stepped_is_told_from_one_that_ended(
        one_rank, recovery):
    """A pass that raises after DDP's later buckets stepped (a bucket a layer): zero_grad()
    says they stay stepped (§9's failed pass, not refused as a step skipped), and a checkpoint
    loads, but step() after it with no zero_grad() between is refused, nothing stepped. DDP
    itself then refuses the next forward, as under the ordinary step: a failed pass's batch
    cannot be skipped under DDP."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 31), torch.nn.Tanh(),
                                torch.nn.Linear(31, 128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 4)).to(ONE_RANK_DEVICE)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2**-12)
    opt = PNM(ddp.parameters(), lr=1e-2)
    opt.step_in_backward(ddp=ddp)
    xs = torch.randn(4, 8, 128, generator=torch.Generator().manual_seed(1)).to(ONE_RANK_DEVICE)
    for x in xs[:3]:  # DDP's first iteration (one bucket), the probe, buckets of a layer
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    early = _FailsInBackward.apply(model[0](xs[3])).sum()  # its backward runs last
    with pytest.raises(RuntimeError, match="simulated failure"):
        (early + ddp(xs[3]).square().mean()).backward()
    steps = [int(opt.state[p]["step"]) for p in model.parameters()]
    assert steps[:2] == [3, 3] and steps[-2:] == [4, 4]  # the last layer's bucket stepped
    if recovery == "checkpoint-loaded":
        opt.load_state_dict(saved)
        params = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"step\(\) after a backward pass that failed "
                                               r"midway and a load_state_dict"):
            opt.step()
        assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
        assert [int(opt.state[p]["step"]) for p in model.parameters()] == [3] * 6
    with pytest.warns(UserWarning, match="failed midway: the buckets it stepped"):
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="Expected to have finished reduction"):
        ddp(xs[0]).square().mean().backward()


def test_an_lr_set_between_backward_and_step_after_the_probe_says_ddps_last_bucket_takes_it(
        one_rank):
    """DDP's last bucket steps in step(), after the lr set between backward and step; the
    buckets before it stepped inside backward with the lr before: the warning says both."""
    model = _model().to(ONE_RANK_DEVICE)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2**-12)
    opt = AdaPNM(ddp.parameters(), lr=1e-2)
    buckets = record_bucket_steps(opt)
    opt.step_in_backward(ddp=ddp)
    xs, ys = (t.to(ONE_RANK_DEVICE) for t in _data())
    for t in range(3):
        opt.zero_grad()
        pass_begins = len(buckets)
        torch.nn.functional.mse_loss(ddp(xs[t]), ys[t]).backward()
        if t < 2:
            opt.step()
    stepped_inside = len(buckets)
    opt.param_groups[0]["lr"] = 0.5
    with pytest.warns(UserWarning, match=r"param_groups\[0\]\['lr'\] was changed between "
                                         r"backward and step\(\).*used the value before, "
                                         r"what step\(\) steps now \(gradients no bucket "
                                         r"took: DDP's last bucket.*\) the new one"):
        opt.step()
    assert stepped_inside > pass_begins
    assert all(inside for _, inside in buckets[pass_begins:stepped_inside])
    assert [inside for _, inside in buckets[stepped_inside:]] == [False]


def test_two_optimizers_of_one_ddp_model_each_step_their_parameters_in_backward(one_rank):
    """DDP takes one communication hook: both optimizers' handles share it, each stepping
    its own parameters in each bucket; removing one's handle leaves its parameters to its
    ordinary step. Bitwise the ordinary steps throughout."""
    runs = []
    for in_backward in (False, True):
        model = _model().to(ONE_RANK_DEVICE)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2**-12)
        opts = [PNM(model[0].parameters(), lr=1e-2), AdaPNM(model[2].parameters(), lr=1e-3)]
        handles = [opt.step_in_backward(ddp=ddp) for opt in opts] if in_backward else []
        xs, ys = (t.to(ONE_RANK_DEVICE) for t in _data())
        for t in list(range(STEPS)) * 2:
            if in_backward and t == 2:
                handles[1].remove()
            for opt in opts:
                opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(xs[t]), ys[t]).backward()
            for opt in opts:
                opt.step()
        runs.append(model)
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("loop", ["sgd-first", "sgd-clips"])
def test_a_ddp_parameter_taken_out_of_the_optimizer_is_left_to_its_new_one(one_rank, loop):
    """The last layer handed to torch's SGD after step_in_backward(ddp=): its buckets are
    not this optimizer's, so SGD stepping it before ours or clipping its gradients between
    backward and step is SGD's loop, not an edit the probe refuses. Bitwise the ordinary
    loop."""
    runs = []
    for in_backward in (False, True):
        model = _model().to(ONE_RANK_DEVICE)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2**-12)
        opt = AdaPNM(model.parameters(), lr=1e-3)
        if in_backward:
            opt.step_in_backward(ddp=ddp)
        head = list(model[2].parameters())
        opt.param_groups[0]["params"] = list(model[0].parameters())
        sgd = torch.optim.SGD(head, lr=1e-2)
        xs, ys = (t.to(ONE_RANK_DEVICE) for t in _data())
        for t in range(STEPS):
            opt.zero_grad()
            sgd.zero_grad()
            torch.nn.functional.mse_loss(ddp(xs[t]), ys[t]).backward()
            if loop == "sgd-clips":
                torch.nn.utils.clip_grad_norm_(head, 1e-3)
            else:
                sgd.step()
            opt.step()
            if loop == "sgd-clips":
                sgd.step()
        runs.append(model)
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        assert torch.equal(p, q)


def _one_rank_ddp_attached(events, static_graph):
    """Twelve steps of a DDP model; `events`: step index -> "on" (step_in_backward(ddp=...))
    or "off" (the handle removed: DDP keeps the hook, which then only reduces; before the
    step's zero_grad, or with "off-before-step" between its backward and step()). Returns the
    parameters and the steps that stepped no bucket inside backward (ordinary steps)."""
    model = _model().to(ONE_RANK_DEVICE)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2**-12,
                                                    static_graph=static_graph)
    opt = AdaPNM(ddp.parameters(), lr=1e-3, weight_decay=0.1)
    buckets = record_bucket_steps(opt)
    xs, ys = (t.to(ONE_RANK_DEVICE) for t in _data())
    handle, ordinary = None, []
    for i, t in enumerate(list(range(STEPS)) * 3):
        if events.get(i) == "on":
            handle = opt.step_in_backward(ddp=ddp)
        elif events.get(i) == "off":
            handle.remove()
        opt.zero_grad()
        before = len(buckets)
        torch.nn.functional.mse_loss(ddp(xs[t]), ys[t]).backward()
        if len(buckets) == before:
            ordinary.append(i)
        if events.get(i) == "off-before-step":
            handle.remove()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()], ordinary


@pytest.mark.parametrize("static_graph", ["dynamic", "static-graph"])
@pytest.mark.parametrize("events, ordinary_steps", [
    # With static_graph DDP keeps one bucket a step for two iterations, not one: step 1's
    # only bucket is its last, stepped in step().
    ({0: "on"}, {"dynamic": [0], "static-graph": [0, 1]}),
    ({3: "on"}, [0, 1, 2, 3]),  # attached mid-training: the probe is step 3
    ({2: "on", 5: "off", 8: "on"}, [0, 1, 2, 5, 6, 7, 8]),  # removed, then attached again
    # Removed between backward and step(): that step() completes the pass's (no bucket
    # stepped twice).
    ({2: "on", 5: "off-before-step", 8: "on"}, [0, 1, 2, 6, 7, 8]),
], ids=["from-the-start", "mid-training", "removed-and-again", "removed-before-step"])
def test_ddp_step_in_backward_attached_and_removed_between_steps(one_rank, events,
                                                                  ordinary_steps,
                                                                  static_graph):
    """DDP(static_graph=True) reduces its first iteration's buckets in its end-of-backward
    callback: the buckets still step after DDP has written the gradients."""
    if "fused" not in available_backends(ONE_RANK_DEVICE):
        pytest.skip("pnm_kernels._C is not built")
    expected, _ = _one_rank_ddp_attached({}, static_graph=False)
    got, ordinary = _one_rank_ddp_attached(events, static_graph == "static-graph")
    if isinstance(ordinary_steps, dict):
        ordinary_steps = ordinary_steps[static_graph]
    assert ordinary == ordinary_steps  # the others stepped a bucket inside backward
    for p, q in zip(got, expected):
        assert torch.equal(p, q)


def _three_rank_training(rank, name, state_dtype, how, in_backward):
    """One rank's DDP training of three. how: "grads" (DDP's own gradients, set to None
    between steps), "kept-zero-views" (gradients as bucket views zeroed in place: DDP then
    divides them in the bucket instead of multiplying as it copies), "accumulating" (two
    micro-batches a step, the first inside handle.accumulating()), "join" (uneven inputs
    under DDP's Join: rank r trains 6 + r steps, the joined ranks shadowing the rest)."""
    from torch.distributed.algorithms.join import Join

    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=2**-12, gradient_as_bucket_view=how != "grads")
    opt = OPTIMIZERS[name](ddp.parameters(), lr=1e-2, weight_decay=0.1, backend="fused",
                           state_dtype=state_dtype)
    handle = opt.step_in_backward(ddp=ddp) if in_backward else None
    xs, ys = _data()
    steps = list(range(STEPS)) * 2 + list(range(rank)) * (how == "join")
    with Join([ddp]) if how == "join" else contextlib.nullcontext():
        for t in steps:  # each rank its own slice of the batch
            opt.zero_grad(set_to_none=how != "kept-zero-views")
            x, y = xs[t][rank * 2:rank * 2 + 3], ys[t][rank * 2:rank * 2 + 3]
            if how == "accumulating":
                with handle.accumulating() if handle else contextlib.nullcontext():
                    torch.nn.functional.mse_loss(ddp(x[:1]), y[:1]).backward()
                x, y = x[1:], y[1:]
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    return model, opt


def _three_rank_worker(rank, name, state_dtype, how, workdir, port):
    """On each of three gloo ranks, the same DDP training stepping in backward and not;
    saves whether the two gave the same bits."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=3)
    try:
        (ordinary, ordinary_opt), (model, opt) = (
            _three_rank_training(rank, name, state_dtype, how, in_backward)
            for in_backward in (False, True))
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ordinary.parameters()))
        same &= all(torch.equal(value, ordinary_opt.state[q][key])
                    for p, q in zip(model.parameters(), ordinary.parameters())
                    for key, value in opt.state[p].items())
        torch.save(same, f"{workdir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)  # as test_distributed._worker: skip a teardown that sometimes aborts


@pytest.mark.parametrize("name,state_dtype,how", [
    ("PNM", None, "grads"), ("AdaPNM", None, "grads"), ("AdaPNM", torch.int8, "grads"),
    ("PNM", None, "kept-zero-views"), ("AdaPNM", None, "accumulating"), ("PNM", None, "join")])
def test_three_ddp_ranks_step_in_backward_as_the_ordinary_step_bitwise(name, state_dtype, how):
    """Three ranks: DDP's average (each gradient times 1/3 as DDP copies it into its bucket,
    or divided by 3 where it already is the bucket's view) is not a division by a power of
    two, so its bits show that the communication hook reduces as DDP's built-in all-reduce
    does; each rank's parameters and state are the ordinary step's."""
    if "fused" not in available_backends("cpu"):
        pytest.skip("pnm_kernels._C is not built")
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_three_rank_worker, args=(name, state_dtype, how, workdir, _free_port()),
                 nprocs=3, join=True)
        assert all(torch.load(f"{workdir}/rank{rank}.pt") for rank in range(3))


class _Checkpointed(torch.nn.Module):
    """Three layers, the middle one under reentrant activation checkpointing: its backward
    runs as a nested backward pass (its own graph task) inside the outer one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle = torch.nn.Linear(128, 64), torch.nn.Linear(64, 64)
        self.last = torch.nn.Linear(64, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = torch.tanh(self.first(x))
        x = checkpoint(lambda h: torch.tanh(self.middle(h)), x, use_reentrant=True)
        return self.last(x)


@pytest.mark.parametrize("ddp", [False, True], ids=["one-process", "ddp-static-graph"])
def test_reentrant_checkpointing_steps_in_backward_as_the_ordinary_step(one_rank, ddp):
    """The nested pass flushes what is ready when it ends, the outer pass the rest (none
    taken for a failed pass); with DDP (static_graph, as DDP asks of reentrant
    checkpointing) each bucket steps once. Bitwise the ordinary step; without DDP no
    gradient is left after backward."""
    if "fused" not in available_backends(ONE_RANK_DEVICE):
        pytest.skip("pnm_kernels._C is not built")
    runs = []
    for in_backward in (False, True):
        model = _Checkpointed().to(ONE_RANK_DEVICE)
        wrapped = (torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=2**-12,
                                                             static_graph=True)
                   if ddp else model)
        opt = AdaPNM(model.parameters(), lr=1e-3, weight_decay=0.1)
        if in_backward:
            opt.step_in_backward(ddp=wrapped if ddp else None)
        xs, ys = (t.to(ONE_RANK_DEVICE) for t in _data())
        for t in list(range(STEPS)) * 2:
            opt.zero_grad()
            x = torch.cat([xs[t], xs[t]], 1)[:, :128].requires_grad_()
            torch.nn.functional.mse_loss(wrapped(x), ys[t]).backward()
            if in_backward and not ddp and t > 0:
                assert all(p.grad is None for p in model.parameters())
            opt.step()
        runs.append((model, opt))
    _assert_same_training(*runs[1], *runs[0], grads=ddp)


@pytest.mark.parametrize("given", ["both", "both-and-one-again"])
def test_one_optimizer_over_two_ddp_models_steps_each_in_its_buckets(one_rank, given):
    """ddp=[model_a, model_b]: each model's buckets step its parameters (a model given twice
    is hooked once). Bitwise the ordinary step of both models."""
    if "fused" not in available_backends(ONE_RANK_DEVICE):
        pytest.skip("pnm_kernels._C is not built")
    runs = []
    for in_backward in (False, True):
        models = [_model().to(ONE_RANK_DEVICE), _model().to(ONE_RANK_DEVICE)]
        ddps = [torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=2**-12)
                for m in models]
        opt = AdaPNM([p for m in models for p in m.parameters()], lr=1e-3, weight_decay=0.1)
        if in_backward:
            opt.step_in_backward(ddp=ddps if given == "both" else ddps + ddps[:1])
        xs, ys = (t.to(ONE_RANK_DEVICE) for t in _data())
        for t in list(range(STEPS)) * 2:
            opt.zero_grad()
            out = ddps[0](xs[t]) + 0.5 * ddps[1](xs[t].flip(0))
            torch.nn.functional.mse_loss(out, ys[t]).backward()
            opt.step()
        runs.append((models, opt))
    (models, opt), (ordinary, ordinary_opt) = runs[1], runs[0]
    for model, expected in zip(models, ordinary):
        _assert_same_training(model, opt, expected, ordinary_opt)


def test_a_compiled_ddp_model_steps_in_backward_as_the_compiled_ordinary_one(one_rank):
    """torch.compile of a DDP model: dynamo's DDPOptimizer splits the graph at DDP's bucket
    bounds (1 MiB at least: DDP's first bucket), so the buckets of a 2.6 MB model are reduced,
    and stepped, while the backward pass goes on. Bitwise the same compiled model's
    ordinary step."""
    if "fused" not in available_backends(ONE_RANK_DEVICE):
        pytest.skip("pnm_kernels._C is not built")
    runs = []
    for in_backward in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.Tanh(),
                                    torch.nn.Linear(1024, 512), torch.nn.Tanh(),
                                    torch.nn.Linear(512, 4)).to(ONE_RANK_DEVICE)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
        compiled = torch.compile(ddp)
        opt = PNM(model.parameters(), lr=1e-2, weight_decay=0.1)
        buckets = record_bucket_steps(opt)
        if in_backward:
            opt.step_in_backward(ddp=ddp)
        xs, ys = (t.to(ONE_RANK_DEVICE) for t in _data())
        for t in list(range(STEPS)) * 2:
            opt.zero_grad()
            torch.nn.functional.mse_loss(compiled(xs[t]), ys[t]).backward()
            opt.step()
        runs.append((model, opt))
    # Every pass after the probe's steps a bucket inside backward (the last one in step()).
    assert sum(inside for _, inside in buckets) == 2 * STEPS - 1
    _assert_same_training(*runs[1], *runs[0])
