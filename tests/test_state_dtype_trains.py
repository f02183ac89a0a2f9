"""Compressed state (bfloat16, int8) and bf16 parameters rounded stochastically train as
float32 does (docs/design.md §7, §8): the averages and the parameters do not stall where
round-to-nearest does (displacement within 3 % of float32's), and over three seeds the loss
curves stay closer to float32 state's than two seeds' float32 curves are to each other."""
import pytest
import torch

from pnm_kernels import PNM, AdaPNM, _ops, quantization


def _displacement(cls, betas, state_dtype=None, nearest=None, steps=2000, shape=(16, 128)):
    """The parameters after `steps` steps from 0, with one constant gradient per element
    but the first of each row: 50 for 100 steps, then 0 (an outlier that decays, setting its
    int8 block's scale). `nearest` (bfloat16 or int8): float32 state rounded to nearest that
    dtype after every step."""
    g = torch.linspace(0.1, 1.0, shape[0] * shape[1]).reshape(shape)
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = cls([p], lr=1e-3, betas=betas, state_dtype=state_dtype,
              backend="reference" if nearest else "foreach")
    for t in range(steps):
        g[:, 0] = 50.0 if t < 100 else 0.0
        p.grad = g
        opt.step()
        for key, value in opt.state[p].items() if nearest else ():
            if key == "step":
                continue
            if nearest == torch.int8:
                signed = quantization.SIGNED[key]
                codes, scales = quantization.quantize(value, quantization.NEAREST_BITS, signed)
                value.copy_(quantization.dequantize(codes, scales, signed))
            else:
                value.copy_(value.bfloat16())
    return p.detach()


@pytest.mark.parametrize("backend", ["foreach", "fused"])
def test_bfloat16_parameters_rounded_stochastically_move_as_float32_ones(backend):
    """Pure-bf16 training: every update is below half a bf16 ulp of the parameter (near
    1.0, where the ulp is 2^-8 to 2^-7). Rounded to nearest the parameters never move; with
    bf16_stochastic_round they move as float32 parameters do: on average over the 2,048
    elements (whose rounding errors are independent) within 3 %."""
    if backend == "fused" and _ops.extension_error() is not None:
        pytest.skip("pnm_kernels._C is not built")
    g = torch.linspace(0.1, 1.0, 2048)
    moved = {}
    for dtype, stochastic in ((torch.float32, False), (torch.bfloat16, False),
                              (torch.bfloat16, True)):
        p = torch.nn.Parameter(torch.ones(2048, dtype=dtype))
        opt = PNM([p], lr=1e-3, backend=backend if dtype == torch.bfloat16 else "foreach",
                  state_dtype=torch.float32, bf16_stochastic_round=stochastic)
        for _ in range(1000):
            p.grad = g.to(dtype)
            opt.step()
        moved[(dtype, stochastic)] = 1 - p.detach().float()
    exact = moved[(torch.float32, False)]
    assert exact.min() > 0.01  # each update below 2^-8, yet hundreds of them add up
    assert torch.equal(moved[(torch.bfloat16, False)], torch.zeros(2048))
    stochastic = moved[(torch.bfloat16, True)]
    assert abs(stochastic.mean() / exact.mean() - 1) < 0.03


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("cls,betas", [(PNM, (0.999, 1.0)), (AdaPNM, (0.999, 0.999, 1.0))],
                         ids=["PNM", "AdaPNM"])
def test_compressed_state_moves_the_parameters_as_far_as_float32_state(cls, betas, state_dtype):
    """Constant gradients, b1 = 0.999 (PNM's buffers decay by b1^2 a step): the averages'
    updates are far below half a bf16 ulp (or an int8 code's step: the outlier's decay
    shrinks the block's scale by 0.2 % a step, a quarter of a code near the top) of their
    values. With stochastic rounding the displacement is float32 state's within 3 % on
    average over the other 2,032 elements (and element by element in bfloat16: int8's
    stored averages are noisier, unbiased); rounded to nearest the buffers stall (PNM's
    bfloat16 ones at about a third of their value) or, in int8, shrink with their block's
    scale, and the parameters fall far behind."""
    exact = _displacement(cls, betas)[:, 1:]
    stochastic = _displacement(cls, betas, state_dtype)[:, 1:]
    nearest = _displacement(cls, betas, nearest=state_dtype)[:, 1:]
    error = lambda d: ((d - exact).norm() / exact.norm()).item()  # noqa: E731
    bias = lambda d: (d.sum() / exact.sum()).item() - 1  # noqa: E731
    assert abs(bias(stochastic)) < 0.03
    if state_dtype == torch.bfloat16:
        assert error(stochastic) < 0.03
    else:
        assert bias(nearest) < -0.3
    assert error(nearest) > 0.03


def _loss_curve(cls, seed, param_dtype, state_dtype, lr, steps=250):
    """Minibatch training of a small MLP on a noisy teacher's labels; the loss per step,
    smoothed over 20 steps. The seed picks the data, the initialisation and the batches."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 128, generator=gen)
    y = (x @ torch.randn(128, 10, generator=gen) + 0.5 * torch.randn(1024, 10, generator=gen)).argmax(1)
    torch.manual_seed(seed)
    # Rows of 128: int8 state quantises both weights (quantization.BLOCK), biases in bf16.
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 10)).to(param_dtype)
    opt = cls(model.parameters(), lr=lr, state_dtype=state_dtype)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, 1024, (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[batch].to(param_dtype)).float(), y[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.nn.functional.avg_pool1d(torch.tensor(losses)[None, None], 20, 1)[0, 0]


def _nmse(a, b):
    return (((a - b) ** 2).mean() / (b - b.mean()).pow(2).mean()).item()


def _correlation(a, b):
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("cls,lr", [(PNM, 0.3), (AdaPNM, 3e-3)], ids=["PNM", "AdaPNM"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_compressed_state_trains_as_float32_state_over_three_seeds(cls, lr, param_dtype,
                                                                    state_dtype):
    """Training equivalence: over three seeds, compressed state's loss curve stays closer to
    float32 state's of the same seed than float32 state's curves of two seeds are to each
    other (normalised mean squared error below, correlation above, the smallest seed-to-seed
    spread): the compression moves training less than a change of seed does."""
    seeds = range(3)
    exact = [_loss_curve(cls, s, param_dtype, torch.float32, lr) for s in seeds]
    compressed = [_loss_curve(cls, s, param_dtype, state_dtype, lr) for s in seeds]
    pairs = [(a, b) for a in seeds for b in seeds if a != b]
    nmse_between_seeds = min(_nmse(exact[a], exact[b]) for a, b in pairs)
    correlation_between_seeds = min(_correlation(exact[a], exact[b]) for a, b in pairs)
    for s in seeds:
        assert _nmse(compressed[s], exact[s]) < nmse_between_seeds
        assert _correlation(compressed[s], exact[s]) > correlation_between_seeds
    assert exact[0][-1] < exact[0][0] - 0.1  # it learns
