"""optimizer.step_in_backward() under FSDP2 (docs/design.md §9), on one rank over gloo (or
NCCL with a GPU). FSDP2 calls its sharded parameters' post-accumulate-grad hooks once it has
reduce-scattered their gradients, so the shards step in backward: bitwise the ordinary step,
the gradients freed; micro-batches accumulate; clipping is refused before anything moves. Two
ranks: the fsdp-in-backward mode of test_distributed.py."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from conftest import FAST_PATHS
from pnm_kernels import PNM, available_backends
# one_rank: the fixture, used by name
from test_distributed import OPTIMIZERS, STEPS
from test_one_rank_distributed import (ONE_RANK_DEVICE, _one_rank_model,  # noqa: F401
                                       needs_one_rank_fsdp2, one_rank)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")


def _one_rank_fsdp2_training_in_backward(name, backend, state_dtype, in_backward):
    """Eight steps of an FSDP2 model, stepping inside backward (buckets of about 1 KiB: each
    weight alone, the biases together) or not. Returns the model, the optimizer and whether
    any parameter held a gradient after a backward pass."""
    model, (xs, ys) = _one_rank_model()
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, weight_decay=0.1, backend=backend,
                           state_dtype=state_dtype)
    if in_backward:
        opt.step_in_backward(bucket_mib=2**-10)
    grads_kept = False
    for t in list(range(STEPS)) * 2:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
        grads_kept |= any(p.grad is not None for p in model.parameters())
        opt.step()
    return model, opt, grads_kept


@needs_one_rank_fsdp2
@pytest.mark.parametrize("state_dtype", [None, torch.int8], ids=["plain", "int8-state"])
@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_fsdp2_steps_in_backward_as_the_ordinary_step_bitwise(one_rank, path, name, state_dtype):
    """FSDP2 calls its sharded parameters' post-accumulate-grad hooks once it has
    reduce-scattered their gradients (the first layer's in its end-of-backward callback): the
    shards step in backward, their gradients are freed there (after the ordinary first step,
    the probe, none is left), and parameters and state are the ordinary step's bits."""
    if path == "triton" and state_dtype is not None:
        pytest.skip("the Triton interpreter's int8 step is covered in test_step_in_backward.py")
    ordinary, ordinary_opt, _ = _one_rank_fsdp2_training_in_backward(name, path, state_dtype,
                                                                    False)
    model, opt, grads_kept = _one_rank_fsdp2_training_in_backward(name, path, state_dtype, True)
    assert grads_kept  # the probe's (the ordinary step's) gradients
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), ordinary.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
        for key, value in opt.state[p].items():
            expected = ordinary_opt.state[q][key]
            assert torch.equal(getattr(value, "_local_tensor", value),
                               getattr(expected, "_local_tensor", expected)), key


def _one_rank_fsdp2_accumulation(name, how):
    """Four steps of two micro-batches each: summed by FSDP2's reduce-scatters ("ordinary",
    the ordinary step; "accumulating", stepping in backward with the first micro-batch inside
    handle.accumulating()), or summed unsharded with FSDP2's gradient sync off for the first
    ("no-sync", stepping in backward: FSDP2 calls no hook until it reduces)."""
    model, (xs, ys) = _one_rank_model()
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, weight_decay=0.1, backend="fused")
    handle = opt.step_in_backward(bucket_mib=2**-10) if how != "ordinary" else None
    for t in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            first = micro == 0
            accumulating = handle.accumulating() if how == "accumulating" and first \
                else contextlib.nullcontext()
            model.set_requires_gradient_sync(not (how == "no-sync" and first))
            with accumulating:
                x, y = xs[t][micro * 4:(micro + 1) * 4], ys[t][micro * 4:(micro + 1) * 4]
                torch.nn.functional.mse_loss(model(x), y).backward()
        if handle is not None and t > 0:  # after the probe: stepped and freed in backward
            assert all(p.grad is None for p in model.parameters())
        opt.step()
    return [p.full_tensor().detach().cpu() for p in model.parameters()]


@needs_one_rank_fsdp2
@pytest.mark.parametrize("how", ["accumulating", "no-sync"])
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_fsdp2_accumulates_micro_batches_in_backward_as_the_ordinary_step(one_rank, name, how):
    if "fused" not in available_backends(ONE_RANK_DEVICE):
        pytest.skip("pnm_kernels._C is not built")
    got = _one_rank_fsdp2_accumulation(name, how)
    expected = _one_rank_fsdp2_accumulation(name, "ordinary")
    for p, q in zip(got, expected):
        assert torch.equal(p, q)


@needs_one_rank_fsdp2
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_fsdp2_gradient_clipping_is_refused_in_backward_before_anything_moves(one_rank, clip):
    """clip_grad_norm_/clip_grad_value_ scale FSDP2's DTensor gradients with in-place foreach
    ops, which bump no version counter: the probe sees the changed bits and refuses."""
    model, (xs, ys) = _one_rank_model()
    opt = PNM(model.parameters(), lr=1e-2)
    opt.step_in_backward()
    before = [p.to_local().clone() for p in model.parameters()]
    torch.nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    if clip == "norm":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    else:
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)
    with pytest.raises(RuntimeError, match="gradient clipping"):
        opt.step()
    assert all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))
    assert not opt.state


def _one_rank_fsdp2_zeroing_after_step(in_backward, zero_in_place):
    """backward, step(), then the gradients zeroed in place through the model, or never."""
    model, (xs, ys) = _one_rank_model()
    opt = OPTIMIZERS["AdaPNM"](model.parameters(), lr=1e-2)
    if in_backward:
        opt.step_in_backward(bucket_mib=2**-10)
    for t in range(STEPS):
        torch.nn.functional.mse_loss(model(xs[t]), ys[t]).backward()
        opt.step()
        if zero_in_place:
            model.zero_grad(set_to_none=False)
    return model, opt


@needs_one_rank_fsdp2
def test_fsdp2_gradients_zeroed_in_place_step_as_the_ordinary_loop_never_zeroed_refused(one_rank):
    """FSDP2 sums into a gradient's local tensor, which bumps no version of the DTensor's,
    where zero_() does: a loop zeroing through the model steps as the ordinary one, one that
    never zeroes is refused at the first pass after the probe."""
    model, opt = _one_rank_fsdp2_zeroing_after_step(True, True)
    ordinary, ordinary_opt = _one_rank_fsdp2_zeroing_after_step(False, True)
    for p, q in zip(model.parameters(), ordinary.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
        assert torch.equal(opt.state[p]["exp_avg"].to_local(),
                           ordinary_opt.state[q]["exp_avg"].to_local())
    with pytest.raises(RuntimeError, match="added its gradients to those of the step before"):
        _one_rank_fsdp2_zeroing_after_step(True, False)
