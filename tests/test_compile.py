"""torch.compile: the optimizer step traces without graph breaks (custom ops with fake
kernels, no host reads) and gives what eager gives."""
import pytest
import torch
import torch._dynamo

from conftest import DEVICE, OPTIMIZERS, requires_extension

pytestmark = requires_extension


def _models(n=2):
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(DEVICE)
              for _ in range(n)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return models


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_compiled_step_has_no_graph_break(name):
    model = _models(1)[0]
    opt = OPTIMIZERS[name](model.parameters(), lr=torch.tensor(1e-2), backend="fused")
    model(torch.randn(8, 16, device=DEVICE)).sum().backward()
    opt.step()
    explain = torch._dynamo.explain(opt.step)()
    assert explain.graph_break_count == 0, explain.break_reasons


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_compiled_training_step_matches_eager(name):
    torch._dynamo.reset()
    eager, compiled = _models()
    opts = [OPTIMIZERS[name](m.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1, backend="fused")
            for m in (eager, compiled)]
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9) for o in opts]
    x, y = torch.randn(32, 16, device=DEVICE), torch.randn(32, 4, device=DEVICE)

    def train_step(model, opt):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    compiled_step = torch.compile(train_step)
    for _ in range(6):
        train_step(eager, opts[0])
        compiled_step(compiled, opts[1])
        for s in scheds:
            s.step()
    for p, q in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(p, q)
    for p, q in zip(eager.parameters(), compiled.parameters()):
        for key, value in opts[0].state[p].items():
            torch.testing.assert_close(opts[1].state[q][key], value)
