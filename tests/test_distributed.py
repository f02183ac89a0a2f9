"""DDP (also with ZeroRedundancyOptimizer) and FSDP2 (DTensor parameters) with 2 ranks, over
gloo on the CPU and over NCCL on two GPUs: training matches single-process training, the
optimizer updates local shards without gathering, and torch.distributed.checkpoint saves and
restores PNM/AdaPNM state so training resumes exactly."""
import os
import random
import sys
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import FAST_PATHS, user_event
from internals import count_batch_builds, element_offset
from pnm_kernels import PNM, AdaPNM

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")

WORLD = 2
STEPS = 4
OPTIMIZERS = {"PNM": PNM, "AdaPNM": AdaPNM}
# The one-rank tests run on every device there is (FAST_PATHS is the device's too).
ONE_RANK_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# FSDP2 on the CPU records events on torch.cpu.Stream, which torch 2.6 cannot (it fails inside
# torch: "'Stream' object has no attribute 'record_event'").
CPU_FSDP2 = hasattr(torch.cpu.Stream, "record_event")
needs_cpu_fsdp2 = pytest.mark.skipif(not CPU_FSDP2, reason="this torch has no FSDP2 on the CPU")
needs_one_rank_fsdp2 = pytest.mark.skipif(ONE_RANK_DEVICE == "cpu" and not CPU_FSDP2,
                                          reason="this torch has no FSDP2 on the CPU")


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 8, 128, generator=gen), torch.randn(STEPS, 8, 4, generator=gen)


class _Tiled(torch.nn.Module):
    def forward(self, x):
        return x.expand(*x.shape[:-1], 4)


def _model(state_dtype=None):
    """31 hidden units: FSDP2 shards them unevenly over two ranks (16 and 15 rows, the
    second shard padded). 128 inputs: the first weight's rows are one int8 block each. With
    int8 state a weight of one row of one block too, whose shard on rank 1 holds no rows."""
    torch.manual_seed(0)
    if state_dtype == torch.int8:
        return torch.nn.Sequential(torch.nn.Linear(128, 31), torch.nn.Tanh(),
                                   torch.nn.Linear(31, 128), torch.nn.Tanh(),
                                   torch.nn.Linear(128, 1), _Tiled())
    return torch.nn.Sequential(torch.nn.Linear(128, 31), torch.nn.Tanh(), torch.nn.Linear(31, 4))


def _make_opt(name, params, device="cpu", zero=False, state_dtype=None):
    """The optimizer, or with zero=True torch's ZeroRedundancyOptimizer wrapping it (each rank
    keeps the state of its share of the parameters and broadcasts them after its step)."""
    kwargs = dict(lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, backend="auto"
                  if state_dtype is not None else "fused"
                  if "fused" in __import__("pnm_kernels").available_backends(device)
                  else "foreach")
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(params, optimizer_class=OPTIMIZERS[name], **kwargs)
    return OPTIMIZERS[name](params, **kwargs)


def _train(model, opt, xs, ys, steps, rank=None):
    """Each rank takes its half of the batch; one process (rank None) forms the gradient as the
    ranks' reduction does, the mean of the halves' gradients (the mean over the whole batch
    differs in the last bits, which int8 state's stochastic rounding can turn into a whole
    code step)."""
    for t in steps:
        opt.zero_grad()
        for half in range(WORLD) if rank is None else [rank]:
            x, y = xs[t][half * 4:(half + 1) * 4], ys[t][half * 4:(half + 1) * 4]
            torch.nn.functional.mse_loss(model(x), y).backward()
        if rank is None:
            for p in model.parameters():
                p.grad.div_(WORLD)
        opt.step()


def _state_dtype(mode):
    """Modes ending in -bf16-state keep bfloat16 state (docs/design.md §7), -int8-state int8
    state (§8)."""
    return {"-bf16-state": torch.bfloat16, "-int8-state": torch.int8}.get(mode[-11:])


def _single_process(name, state_dtype=None):
    model = _model(state_dtype)
    opt = _make_opt(name, model.parameters(), state_dtype=state_dtype)
    _train(model, opt, *_data(), range(STEPS))
    return [p.detach() for p in model.parameters()]


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, mode, name, workdir, port):
    nccl = mode.endswith("-nccl")  # one GPU a rank: NCCL refuses two ranks on one GPU
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD)
    try:
        xs, ys = (t.to(device) for t in _data())
        model = _model(_state_dtype(mode)).to(device)
        if mode.startswith("ddp"):
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[rank] if nccl else None)
            zero = mode.startswith("ddp-zero")
            opt = _make_opt(name, model.parameters(), device, zero=zero)
            if mode == "ddp-zero-resumed":
                opt = _zero_checkpoint_round_trip(model, opt, name, xs, ys, rank, workdir)
                _train(model, opt, xs, ys, range(STEPS // 2, STEPS), rank)
            else:
                _train(model, opt, xs, ys, range(STEPS), rank)
            if zero:  # this rank's optimizer holds state for its share only
                assert 0 < len(opt.optim.state) < len(list(model.parameters()))
                # the plain dicts ZeRO loaded were made counted: the steps could repeat
                assert all(type(e).__name__ == "ParamState" for e in opt.optim.state.values())
            full = [p.detach().cpu() for p in model.parameters()]
        else:
            _shard(model, offload=mode == "fsdp-offload", device_type=device.type)
            opt = _make_opt(name, model.parameters(), device, state_dtype=_state_dtype(mode))
            if "-in-backward" in mode:  # FSDP2 calls the shards' hooks after reduce-scatter
                opt.step_in_backward(bucket_mib=2**-10)
            if _state_dtype(mode) is not None:  # rank 1's rows 16..30 take the random bits
                assert element_offset(model[0].weight) == rank * 16 * 128  # of the whole's
            half = STEPS // 2
            _train(model, opt, xs, ys, range(half), rank)
            shard = next(model.parameters())
            state = opt.state[shard]
            # the optimizer state is sharded like its parameter: local shards only
            assert type(state["exp_avg" if name == "AdaPNM" else "pos_momentum"]).__name__ == "DTensor"
            assert state["step"].item() == half
            if mode.startswith("fsdp-dcp"):
                model, opt = _checkpoint_round_trip(model, opt, name, workdir,
                                                    _state_dtype(mode))
            elif mode.startswith("fsdp-full"):
                model, opt = _full_checkpoint_round_trip(model, opt, name, workdir, rank,
                                                         _state_dtype(mode))
            _train(model, opt, xs, ys, range(half, STEPS), rank)
            if "-in-backward" in mode:  # every reduced gradient was stepped and freed
                assert all(p.grad is None for p in model.parameters())
            full = [p.full_tensor().detach().cpu() for p in model.parameters()]
        torch.save(full, os.path.join(workdir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears down while another is still in a collective
    finally:
        dist.destroy_process_group()
    # Seen here about once in ten runs under pytest: after both ranks saved their results and
    # destroyed the process group, a child aborts in interpreter teardown ("terminate called
    # without an active exception": a std::thread still joinable in a static destructor of
    # torch's distributed runtime). The work is done and saved by then; skip the teardown.
    sys.stderr.flush()
    os._exit(0)


def _shard(model, offload=False, device_type="cpu", ranks=WORLD):
    """FSDP2 per Linear layer and at the root; with offload, the sharded parameters, their
    gradients and the optimizer step live on the CPU (ZeRO-Offload style: the step runs in
    the fused CPU kernel). Pinned memory needs a GPU driver, so it is off here."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    # The mesh's device named explicitly: by default FSDP2 puts it on the accelerator when
    # one exists, and the gloo ranks keep their model on the CPU.
    mesh = init_device_mesh(device_type, (ranks,))
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    policy["mesh"] = mesh
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **policy)
    fully_shard(model, **policy)


def _zero_checkpoint_round_trip(model, opt, name, xs, ys, rank, workdir):
    """Half the steps, then ZeroRedundancyOptimizer's consolidated state_dict saved by rank
    0 and loaded by every rank into a fresh one (it puts each entry of its share into the
    PNM/AdaPNM state as a plain dict), which it returns."""
    _train(model, opt, xs, ys, range(STEPS // 2), rank)
    opt.consolidate_state_dict(to=0)
    path = os.path.join(workdir, "zero.pt")
    if rank == 0:
        torch.save(opt.state_dict(), path)
    dist.barrier()
    fresh = _make_opt(name, model.parameters(), xs.device, zero=True)
    fresh.load_state_dict(torch.load(path))
    return fresh


def _checkpoint_round_trip(model, opt, name, workdir, state_dtype=None):
    """Save model and optimizer with DCP, then continue in a fresh model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{workdir}/ckpt")
    fresh = _model(state_dtype)
    _shard(fresh)
    fresh_opt = _make_opt(name, fresh.parameters(), state_dtype=state_dtype)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=f"{workdir}/ckpt")
    set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
    p = next(fresh.parameters())
    assert fresh_opt.state[p]["step"].item() == STEPS // 2
    return fresh, fresh_opt


def _full_state_dicts(model, opt, workdir, rank):
    """The whole (unsharded) state, saved by rank 0 with torch.save (full_state_dict,
    cpu_offload: the other ranks get none), and read back by rank 0 alone."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model_sd, optim_sd = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    path = os.path.join(workdir, "full.pt")
    if rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, path)
    dist.barrier()
    return torch.load(path) if rank == 0 else {"model": {}, "optim": {}}


def _full_checkpoint_round_trip(model, opt, name, workdir, rank, state_dtype=None):
    """The whole state saved by rank 0 and broadcast into fresh shards (broadcast_from_rank0),
    training then continuing in them."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    loaded = _full_state_dicts(model, opt, workdir, rank)
    fresh = _model(state_dtype)
    _shard(fresh)
    fresh_opt = _make_opt(name, fresh.parameters(), state_dtype=state_dtype)
    # Apart: set_state_dict takes an empty model state_dict (the other ranks') for "no model"
    # and would leave rank 0 alone in the model's broadcast.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(fresh, loaded["model"], options=options)
    set_optimizer_state_dict(fresh, fresh_opt, loaded["optim"], options=options)
    assert fresh_opt.state[next(fresh.parameters())]["step"].item() == STEPS // 2
    return fresh, fresh_opt


@pytest.mark.parametrize("mode", ["ddp", "ddp-zero", "ddp-zero-resumed"] + [
    pytest.param(m, marks=needs_cpu_fsdp2) for m in (
        "fsdp", "fsdp-dcp", "fsdp-offload", "fsdp-bf16-state", "fsdp-dcp-bf16-state",
        "fsdp-int8-state", "fsdp-dcp-int8-state", "fsdp-full-bf16-state",
        "fsdp-full-int8-state", "fsdp-in-backward",
        "fsdp-in-backward-int8-state")] + [
    "ddp-nccl", "fsdp-nccl"])
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_two_ranks_match_single_process_training(mode, name):
    if mode.endswith("-nccl") and not (dist.is_nccl_available()
                                       and torch.cuda.device_count() >= WORLD):
        pytest.skip("NCCL with 2 ranks needs 2 GPUs (a communicator takes one GPU a rank)")
    expected = _single_process(name, _state_dtype(mode))
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_worker, args=(mode, name, workdir, _free_port()), nprocs=WORLD, join=True)
        for rank in range(WORLD):
            got = torch.load(os.path.join(workdir, f"rank{rank}.pt"))
            for p, q in zip(got, expected):
                torch.testing.assert_close(p, q)
        if mode.startswith("fsdp-dcp"):  # the two ranks' checkpoint, resharded into one process
            got = _resumed_in_one_process(name, _state_dtype(mode), workdir)
            for p, q in zip(got, expected):
                torch.testing.assert_close(p, q)


def _int8_read_through_bf16_worker(rank, name, workdir, port):
    """Each rank writes what it saw of the whole int8 state read into bfloat16-state shards:
    broadcast from rank 0 (refused when loaded), or given to every rank (torch puts the
    scales beside the shards whole: refused by the step, touching nothing)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    seen = {}
    try:
        xs, ys = _data()
        model = _model(torch.int8)
        _shard(model)
        opt = _make_opt(name, model.parameters(), state_dtype=torch.int8)
        _train(model, opt, xs, ys, range(STEPS // 2), rank)
        loaded = _full_state_dicts(model, opt, workdir, rank)
        for broadcast in (True, False):
            if not broadcast:
                loaded = {"optim": torch.load(os.path.join(workdir, "full.pt"))["optim"]}
            fresh = _model(torch.int8)
            _shard(fresh)
            fresh_opt = _make_opt(name, fresh.parameters(), state_dtype=torch.bfloat16)
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
            try:
                set_optimizer_state_dict(fresh, fresh_opt, loaded["optim"], options=options)
                before = [p.full_tensor().clone() for p in fresh.parameters()]
                _train(fresh, fresh_opt, xs, ys, range(STEPS // 2, STEPS), rank)
                seen[broadcast] = "stepped"
            except (ValueError, RuntimeError) as e:
                seen[broadcast] = str(e)
                if not broadcast:  # the step refused: no parameter moved
                    assert all(torch.equal(p.full_tensor(), q)
                               for p, q in zip(fresh.parameters(), before))
            dist.barrier()
        # Sharded through DCP, which loads into the bfloat16 state's own tensors: refused,
        # and each entry written into refuses to step, on every rank; rank 1 holds no rows of
        # the one int8 weight (its empty shards were written into all the same).
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        one_row = _model(torch.int8)[4]
        _shard(torch.nn.Sequential(one_row))
        opt = _make_opt(name, one_row.parameters(), state_dtype=torch.int8)
        _train(one_row, opt, xs, ys[..., :1], range(2), rank)
        dcp.save({"optim": get_optimizer_state_dict(one_row, opt)},
                 checkpoint_id=f"{workdir}/sharded")
        fresh = _model(torch.int8)[4]
        _shard(torch.nn.Sequential(fresh))
        fresh_opt = _make_opt(name, fresh.parameters(), state_dtype=torch.bfloat16)
        loaded = {"optim": get_optimizer_state_dict(fresh, fresh_opt)}
        dcp.load(loaded, checkpoint_id=f"{workdir}/sharded")
        for what, call in (("dcp", lambda: set_optimizer_state_dict(fresh, fresh_opt,
                                                                    loaded["optim"])),
                           ("dcp-step", lambda: _train(fresh, fresh_opt, xs, ys[..., :1],
                                                       range(1), rank))):
            try:
                call()
                seen[what] = "done"
            except (ValueError, RuntimeError) as e:
                seen[what] = str(e)
        dist.barrier()
        torch.save(seen, os.path.join(workdir, f"seen{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)


@needs_cpu_fsdp2
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_whole_int8_state_read_into_bfloat16_shards_is_refused_on_every_rank(name):
    """A whole (full_state_dict) int8 checkpoint read into an optimizer of bfloat16 state:
    broadcast from rank 0, every rank refuses the load naming the entry (rank 0 alone got
    the scales; the ranks must not part ways); given to every rank, the step refuses the
    scales put beside the shards whole, naming them. A sharded one read through DCP: every
    rank refuses the load, and then the step, a rank of empty shards too."""
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_int8_read_through_bf16_worker, args=(name, workdir, _free_port()),
                 nprocs=WORLD, join=True)
        for rank in range(WORLD):
            seen = torch.load(os.path.join(workdir, f"seen{rank}.pt"))
            assert "yet it was saved holding int8 codes" in seen[True], seen[True]
            assert ("_scale' is a plain tensor where its parameter is a DTensor placed "
                    "[Shard(dim=0)]") in seen[False], seen[False]
            assert "yet it was saved holding int8 codes" in seen["dcp"], seen["dcp"]
            assert "a load refused for this optimizer had already written" in seen["dcp-step"]


def _resumed_in_one_process(name, state_dtype, workdir):
    """The DCP checkpoint the two FSDP2 ranks saved halfway (_checkpoint_round_trip) loaded
    into one unsharded model and optimizer in this process (another sharding: every int8
    block and scale row, and each seed, where one process keeps them), trained to the end."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _model(state_dtype)
    opt = _make_opt(name, model.parameters(), state_dtype=state_dtype)
    model_sd, optim_sd = get_state_dict(model, opt)
    loaded = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():  # "torch.distributed is disabled": loading in one process
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(loaded, checkpoint_id=f"{workdir}/ckpt")
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert opt.state[next(model.parameters())]["step"].item() == STEPS // 2
    _train(model, opt, *_data(), range(STEPS // 2, STEPS))
    return [p.detach() for p in model.parameters()]


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

