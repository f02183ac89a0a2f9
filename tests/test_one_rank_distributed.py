"""DDP and FSDP2 (DTensor parameters) in a process group of this process alone: DDP's
gradients as views of its buckets, FSDP2 steps holding their local shards and following new
ones, shards made lazy or given another rank's state refused before any change, random bits
on a DTensor sharded along another dim refused, gradients laid out unlike their shards, and
random sequences of user events, each against the reference. Two ranks:
test_distributed.py."""
import random

import pytest
import torch
import torch.distributed as dist

from conftest import FAST_PATHS, user_event
from internals import count_batch_builds
from pnm_kernels import PNM, AdaPNM
from test_distributed import STEPS, _data, _model, _shard, _train

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")

OPTIMIZERS = {"PNM": PNM, "AdaPNM": AdaPNM}
# On every device there is (FAST_PATHS is the device's too).
ONE_RANK_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# FSDP2 on the CPU records events on torch.cpu.Stream, which torch 2.6 cannot (it fails inside
# torch: "'Stream' object has no attribute 'record_event'").
CPU_FSDP2 = hasattr(torch.cpu.Stream, "record_event")
needs_one_rank_fsdp2 = pytest.mark.skipif(ONE_RANK_DEVICE == "cpu" and not CPU_FSDP2,
                                          reason="this torch has no FSDP2 on the CPU")


@pytest.fixture
def one_rank():
    """A process group of this process alone (a HashStore: no port); NCCL too with a GPU."""
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _one_rank_model():
    model = _model().to(ONE_RANK_DEVICE)
    _shard(model, device_type=ONE_RANK_DEVICE, ranks=1)
    return model, [t.to(ONE_RANK_DEVICE) for t in _data()]


def _one_rank_ddp_training(name, backend, as_bucket_views):
    """Six steps of a DDP model, zero_grad(set_to_none=True) before every third."""
    model = _model().to(ONE_RANK_DEVICE)
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=as_bucket_views)
    opt = OPTIMIZERS[name](ddp.parameters(), lr=1e-2, weight_decay=0.1, backend=backend)
    gen = torch.Generator().manual_seed(1)
    for t in range(6):
        x, y = torch.randn(8, 128, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad(set_to_none=t % 3 == 0)
        torch.nn.functional.mse_loss(ddp(x.to(ONE_RANK_DEVICE)), y.to(ONE_RANK_DEVICE)).backward()
        opt.step()
    grads_share_a_bucket = len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == 1
    return [p.detach().cpu() for p in model.parameters()], grads_share_a_bucket


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_ddp_gradients_as_views_of_its_bucket_match_the_reference(one_rank, path, name):
    """DDP(gradient_as_bucket_view=True), a common memory saving: every gradient is a view
    into one flat bucket (at offsets that are not all 16-byte aligned: 31 hidden units), and
    set_to_none=True makes DDP hand out the views again. The steps match the reference."""
    got, grads_share_a_bucket = _one_rank_ddp_training(name, path, as_bucket_views=True)
    expected, _ = _one_rank_ddp_training(name, "reference", as_bucket_views=False)
    assert grads_share_a_bucket
    for p, q in zip(got, expected):
        torch.testing.assert_close(p, q)


def _one_rank_fsdp2_training(name, backend):
    """Two steps of an FSDP2 model, then model.double().float() (FSDP2 then gives every
    parameter a new local shard), then two more. Returns the parameters and how many times
    the optimizer built its kernel lists."""
    model, (xs, ys) = _one_rank_model()
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, weight_decay=0.1, backend=backend)
    builds = count_batch_builds(opt)
    _train(model, opt, xs, ys, range(2))
    shards = [p.to_local() for p in model.parameters()]
    model.double().float()
    assert all(p._local_tensor is not s for p, s in zip(model.parameters(), shards))
    _train(model, opt, xs, ys, range(2, STEPS))
    return [p.full_tensor().detach().cpu() for p in model.parameters()], len(builds)


@needs_one_rank_fsdp2
@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_fsdp2_steps_hold_their_shards_and_follow_new_ones(one_rank, path, name):
    """With FSDP2 the fast paths build their lists of local shards once and hold them, as
    for plain tensors (a DTensor step cost ~10 µs a parameter in Python before), checking
    at every step that each parameter still has the shard held: after model.to(...) FSDP2
    gives each a new one, and the steps follow it. They match the reference throughout."""
    got, builds = _one_rank_fsdp2_training(name, path)
    expected, _ = _one_rank_fsdp2_training(name, "reference")
    for p, q in zip(got, expected):
        torch.testing.assert_close(p, q)
    if path != "foreach":  # the flat backends' lists, built before and after the new shards
        assert builds == 2


@needs_one_rank_fsdp2
@pytest.mark.parametrize("path", FAST_PATHS + ["reference"], indirect=True)
def test_fsdp2_a_local_shard_made_a_lazy_negative_view_is_refused_before_any_change(one_rank,
                                                                                     path):
    """A DTensor parameter whose local shard (what the kernels take) reads as its memory
    negated (`_local_tensor.data = ...`): refused naming the parameter, as a plain tensor
    is, before any parameter or state changes (foreach stepped counters, then refused)."""
    model, (xs, ys) = _one_rank_model()
    params = list(model.parameters())
    opt = OPTIMIZERS["AdaPNM"](params, lr=1e-2, backend=path)
    _train(model, opt, xs, ys, range(3))
    shard = params[-1]._local_tensor
    shard.data = torch._neg_view(-shard.data)
    before = _one_rank_values(opt, params)
    with pytest.raises(RuntimeError, match=rf"params'\]\[{len(params) - 1}\] \(shape .*\) is an "
                                           "unresolved negative view"):
        _train(model, opt, xs, ys, range(3, 4))
    _assert_one_rank_values(opt, params, before)


def _one_rank_values(opt, params):
    """The parameters and their state on one rank (local shards: a state shard unlike its
    parameter's cannot be gathered)."""
    return [(p.detach().full_tensor().clone(),
             {k: v.to_local().clone() if hasattr(v, "to_local") else v.clone()
              for k, v in opt.state[p].items()}) for p in params]


def _assert_one_rank_values(opt, params, before):
    for p, (value, state) in zip(params, before):
        assert torch.equal(p.detach().full_tensor(), value)
        for k, v in state.items():
            now = opt.state[p][k]
            assert torch.equal(now.to_local() if hasattr(now, "to_local") else now, v)


@needs_one_rank_fsdp2
@pytest.mark.parametrize("path", FAST_PATHS + ["reference"], indirect=True)
def test_fsdp2_state_whose_local_shard_is_another_ranks_is_refused_before_any_change(one_rank,
                                                                                     path):
    """A state DTensor placed as its parameter, of its global shape, whose local shard has
    another shape (another rank's state_dict loaded): refused naming the parameter and key
    before any parameter or state changes (foreach and the reference stepped counters and
    buffers, then failed on a broadcast naming nothing)."""
    from torch.distributed.tensor import DTensor

    model, (xs, ys) = _one_rank_model()
    params = list(model.parameters())
    opt = OPTIMIZERS["AdaPNM"](params, lr=1e-2, backend=path)
    _train(model, opt, xs, ys, range(3))
    last = params[-1]
    local = last.to_local()
    opt.state[last]["exp_avg_sq"] = DTensor.from_local(
        torch.zeros(local.numel() + 3, device=local.device), last.device_mesh, last.placements,
        shape=last.shape, stride=last.stride())
    before = _one_rank_values(opt, params)
    with pytest.raises(RuntimeError, match=rf"params'\]\[{len(params) - 1}\] .*'exp_avg_sq' "
                                           "has a local shard of shape"):
        _train(model, opt, xs, ys, range(3, 4))
    _assert_one_rank_values(opt, params, before)


@needs_one_rank_fsdp2
@pytest.mark.parametrize("mode", [dict(state_dtype=torch.bfloat16), dict(state_dtype=torch.int8),
                                  dict(bf16_stochastic_round=True)],
                         ids=["bf16-state", "int8-state", "bf16-sr"])
@pytest.mark.parametrize("when", ["made", "switched"])
@pytest.mark.parametrize("path", FAST_PATHS + ["reference"], indirect=True)
def test_random_bits_on_a_dtensor_sharded_along_another_dim_are_refused_naming_it(one_rank, path,
                                                                                   mode, when):
    """An element's random bits follow its index in the whole parameter, which a shard's
    first element's gives for dim-0 shards only: any other split (Shard(1)) would give two
    ranks' elements the same bits, so a step drawing them is refused naming the parameter,
    also after a dim-0 one of the same dtype (the check is each DTensor's), before any
    change, also where the group is switched to it after steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(ONE_RANK_DEVICE, (1,))
    dtype = torch.bfloat16 if "bf16_stochastic_round" in mode else torch.float32
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(4, 256, dtype=dtype), mesh,
                                                   [Shard(d)])) for d in (0, 1)]
    opt = OPTIMIZERS["PNM"](params, lr=1e-2, backend=path, **(mode if when == "made" else {}))
    for p in params:
        p.grad = torch.ones_like(p)
    if when == "switched":
        opt.step()
        opt.param_groups[0].update(mode)
    before = [p.detach().full_tensor().clone() for p in params]
    def steps():
        return [float(opt.state[p]["step"]) if "step" in dict(opt.state[p]) else None
                for p in params]

    steps_before = steps()
    with pytest.raises(ValueError, match=r"params'\]\[1\] .*needs a DTensor sharded along dim 0 "
                                         r"only .*Shard\(dim=1\)"):
        opt.step()
    assert all(torch.equal(p.detach().full_tensor(), b) for p, b in zip(params, before))
    assert steps() == steps_before


def _one_rank_fsdp2_steps_with_odd_gradients(name, backend):
    """Three steps, then one where a gradient's local shard is not contiguous, then one where
    a gradient is a plain tensor (a DTensor parameter's gradient set by hand), then two more.
    (One oddity a step: a plain gradient sends the whole step down the per-parameter path,
    which would hide a transposed shard let through by the check without a Python loop.)"""
    from torch.distributed.tensor import DTensor

    model, (xs, ys) = _one_rank_model()
    params = list(model.parameters())
    opt = OPTIMIZERS[name](params, lr=1e-2, weight_decay=0.1, backend=backend)
    _train(model, opt, xs, ys, range(3))
    gen = torch.Generator().manual_seed(5)

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(ONE_RANK_DEVICE)

    def dtensor_grads():
        for p in params:
            p.grad = DTensor.from_local(randn(*p.shape), p.device_mesh, p.placements)

    dtensor_grads()
    weight = params[2]
    transposed = randn(*reversed(weight.shape)).t()
    weight.grad = DTensor.from_local(transposed, weight.device_mesh, weight.placements)
    opt.step()
    dtensor_grads()
    params[1].grad = randn(*params[1].shape)
    opt.step()
    _train(model, opt, xs, ys, range(2))
    return [p.full_tensor().detach().cpu() for p in params]


@needs_one_rank_fsdp2
@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_fsdp2_gradients_unlike_their_shards_are_taken_as_the_reference_takes_them(
        one_rank, path, name):
    """The gradients of DTensor parameters are checked without a Python loop where they are
    DTensors laid out like their parameters' shards; a gradient that is not (a transposed
    local shard, a plain tensor) is looked at closely and stepped as by the reference."""
    got = _one_rank_fsdp2_steps_with_odd_gradients(name, path)
    expected = _one_rank_fsdp2_steps_with_odd_gradients(name, "reference")
    for p, q in zip(got, expected):
        torch.testing.assert_close(p, q)


def _one_rank_fsdp2_steps_with_random_events(name, backend, seed, steps=40):
    """Steps of a three-layer FSDP2 model in two param groups in which, at random, a fifth of
    the gradients are missing and, now and then, a user_event happens or every parameter is
    given a new shard (model.double().float())."""
    from torch.distributed.tensor import DTensor

    events = random.Random(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3),
                                torch.nn.Linear(3, 2)).to(ONE_RANK_DEVICE)
    _shard(model, device_type=ONE_RANK_DEVICE, ranks=1)
    params = list(model.parameters())
    opt = OPTIMIZERS[name]([dict(params=params[:3]), dict(params=params[3:], weight_decay=0.1)],
                           lr=1e-2, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            local = torch.randn(p.shape, generator=gen).to(ONE_RANK_DEVICE)
            p.grad = None if events.random() < 0.2 else DTensor.from_local(
                local, p.device_mesh, p.placements)
        event, _ = user_event(opt, params, events, name)
        if 0.24 <= event < 0.32:
            grads = [p.grad for p in params]
            model.double().float()  # new shards; the conversion drops the gradients
            for p, grad in zip(params, grads):
                p.grad = grad
        opt.step()
    return [p.full_tensor().detach().cpu() for p in params]


@needs_one_rank_fsdp2
@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@pytest.mark.parametrize("seed", [0, 5])
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_fsdp2_any_sequence_of_user_events_gives_the_references_steps(one_rank, path, name,
                                                                       seed):
    """Whatever happens between FSDP2 steps, in whatever order, the fast paths (their held
    shard lists included) give what the reference gives."""
    got = _one_rank_fsdp2_steps_with_random_events(name, path, seed)
    expected = _one_rank_fsdp2_steps_with_random_events(name, "reference", seed)
    for p, q in zip(got, expected):
        torch.testing.assert_close(p, q)

