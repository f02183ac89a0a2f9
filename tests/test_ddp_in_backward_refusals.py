"""What optimizer.step_in_backward(ddp=model) refuses under DDP (docs/design.md §9), each
before anything moves, naming the culprit: a model it cannot step in (not DDP's, DDP's
find_unused_parameters, a complex parameter, a hook of its own), a parameter DDP does not
reduce, gradient clipping, a parameter static_graph DDP leaves without a gradient, Join
dividing by the ranks left. One rank over gloo (or NCCL with a GPU)."""
import pytest
import torch
import torch.distributed as dist

from pnm_kernels import PNM
# one_rank: the fixture, used by name
from test_distributed import _data, _model
from test_one_rank_distributed import ONE_RANK_DEVICE, one_rank  # noqa: F401

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")


def _ddp_stepping_in_backward():
    """A DDP model whose PNM steps inside backward, its parameters as they start, the data."""
    model = _model().to(ONE_RANK_DEVICE)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = PNM(ddp.parameters(), lr=1e-2)
    opt.step_in_backward(ddp=ddp)
    before = [p.detach().clone() for p in model.parameters()]
    return model, ddp, opt, before, [t.to(ONE_RANK_DEVICE) for t in _data()]


def test_ddp_gradient_clipping_is_refused_in_backward_before_anything_moves(one_rank):
    """The probe compares the gradients with the bits of the averages DDP reduced."""
    model, ddp, opt, before, (xs, ys) = _ddp_stepping_in_backward()
    torch.nn.functional.mse_loss(ddp(xs[0]), ys[0]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="gradient clipping"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not opt.state


class _WithAnUnusedLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 2), torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.used(x)


def test_a_parameter_static_graph_ddp_leaves_without_a_gradient_is_refused_naming_it(one_rank):
    """DDP(static_graph=True) reduces zeros in a bucket for a parameter no rank's forward used
    and leaves its .grad None, so the ordinary step skips it; a bucket's step cannot tell it
    from a used one (find_unused_parameters=True is refused when enabling, for that)."""
    model = _WithAnUnusedLayer().to(ONE_RANK_DEVICE)
    ddp = torch.nn.parallel.DistributedDataParallel(model, static_graph=True)
    opt = PNM(ddp.parameters(), lr=1e-2)
    opt.step_in_backward(ddp=ddp)
    before = [p.detach().clone() for p in model.parameters()]
    ddp(torch.randn(5, 4, device=ONE_RANK_DEVICE)).sum().backward()
    with pytest.raises(RuntimeError, match=r"params'\]\[2\] \(shape \(3, 3\).*no gradient.*"
                                           r"static_graph=True.*no rank's forward used"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not opt.state
    opt.step()  # again, no zero_grad(): the ordinary step, as for any refused probe
    assert sorted(tuple(p.shape) for p in opt.state) == [(2,), (2, 4)]
    opt.zero_grad()
    ddp(torch.randn(5, 4, device=ONE_RANK_DEVICE)).sum().backward()
    with pytest.raises(RuntimeError, match="no rank's forward used"):
        opt.step()  # the next pass is the probe again


def test_what_ddp_cannot_step_in_backward_is_refused_naming_it(one_rank):
    model = _model().to(ONE_RANK_DEVICE)
    with pytest.raises(TypeError, match="ddp must be the torch.nn.parallel.Distributed"):
        PNM(model.parameters()).step_in_backward(ddp=model)
    unused = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    with pytest.raises(RuntimeError, match="find_unused_parameters=True"):
        PNM(model.parameters()).step_in_backward(ddp=unused)
    complex_model = torch.nn.Linear(2, 2, bias=False).to(ONE_RANK_DEVICE)
    complex_model.weight.data = complex_model.weight.data.to(torch.complex64)
    with_complex = torch.nn.parallel.DistributedDataParallel(complex_model)
    with pytest.raises(RuntimeError, match="parameter 'weight' is complex"):
        PNM(with_complex.parameters()).step_in_backward(ddp=with_complex)
    hooked = torch.nn.parallel.DistributedDataParallel(_model().to(ONE_RANK_DEVICE))
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    hooked.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match="already has a communication hook"):
        PNM(hooked.parameters()).step_in_backward(ddp=hooked)


def test_under_several_ranks_only_a_ddp_models_parameters_step_in_backward(one_rank,
                                                                            monkeypatch):
    """A parameter no DDP model given reduces would step before any all-reduce: refused,
    naming it, before the hook is registered on the model given."""
    ddp = torch.nn.parallel.DistributedDataParallel(_model().to(ONE_RANK_DEVICE))
    stray = torch.nn.Parameter(torch.zeros(3, device=ONE_RANK_DEVICE))
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    opt = PNM([{"params": ddp.parameters()}, {"params": [stray]}])
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[0\] .*DDP"):
        opt.step_in_backward(ddp=ddp)
    assert not getattr(ddp, "_comm_hooks", None)
    handle = PNM(ddp.parameters()).step_in_backward(ddp=ddp)
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[0\] .*DDP"):
        handle._optimizer.add_param_group({"params": [stray]})


def test_ddp_join_dividing_by_the_ranks_left_is_refused_by_every_rank_before_reducing(one_rank):
    """Join(divide_by_initial_world_size=False): DDP divides by the ranks not yet joined,
    which its communication hook cannot know; refused at the first bucket, on every rank
    before its all-reduce (none waits for another), before anything steps."""
    from torch.distributed.algorithms.join import Join

    model, ddp, _, before, (xs, ys) = _ddp_stepping_in_backward()
    with pytest.raises(RuntimeError, match=r"divide_by_initial_world_size=False"):
        with Join([ddp], divide_by_initial_world_size=False):
            torch.nn.functional.mse_loss(ddp(xs[0]), ys[0]).backward()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
