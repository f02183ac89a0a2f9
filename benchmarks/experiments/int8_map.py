"""Which int8 map and block size (pnm_kernels/quantization.py): each candidate trains the same
small MLP on sklearn's digits with AdaPNM (AMSGrad) and PNM, three seeds, and reports the
final training loss beside fp32 state's (its gap, and the loss curves' normalised mean
squared error), plus the drift test of tests/test_state_dtype.py (b1 = 0.999, mean
displacement over fp32 state's, minus 1). Run: python benchmarks/experiments/int8_map.py"""
import torch
from sklearn.datasets import load_digits

from pnm_kernels import PNM, AdaPNM, quantization

X, Y = load_digits(return_X_y=True)
X = torch.tensor(X / 16.0, dtype=torch.float32)
Y = torch.tensor(Y)


def train(cls, state_dtype, seed, steps=300, **kw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = cls(model.parameters(), state_dtype=state_dtype, backend="foreach", **kw)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(X), (128,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(X[idx]), Y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        full = torch.nn.functional.cross_entropy(model(X), Y).item()
    return full, torch.tensor(losses)


def drift(cls, state_dtype, **kw):
    """Mean displacement of constant-gradient elements beside an outlier that decays (50
    for 100 steps, then 0: it sets each row's scale), b1 = 0.999, 2,000 steps."""
    p = torch.nn.Parameter(torch.zeros(16, 128))
    grad = torch.linspace(0.1, 1.0, p.numel()).reshape(p.shape)
    opt = cls([p], lr=1e-3, state_dtype=state_dtype, backend="foreach", **kw)
    for t in range(2000):
        grad[:, 0] = 50.0 if t < 100 else 0.0
        p.grad = grad
        opt.step()
    return p.detach()[:, 1:].clone()


def _drift_kw(kw):
    betas = (0.999,) + tuple(kw["betas"][1:])
    return {**{k: v for k, v in kw.items() if k != "lr"}, "betas": betas}


def main():
    configs = {"PNM": (PNM, dict(lr=0.1, betas=(0.9, 1.0))),
               "AdaPNM": (AdaPNM, dict(lr=1e-3, betas=(0.999, 0.999, 1.0), amsgrad=True))}
    base = {}
    for name, (cls, kw) in configs.items():
        base[name] = [train(cls, None, s, **kw) for s in range(3)]
        base[name + "drift"] = drift(cls, None, **_drift_kw(kw))
        print(name, "fp32 final loss", [round(b[0], 4) for b in base[name]])
    candidates = [(2, 4, 128), (1, 4, 128), (2, 2, 128), (1, 1, 128), (2, 4, 64), (2, 4, 256)]
    for m_power, v_power, block in candidates:
        quantization.MOMENTUM_POWER, quantization.SECOND_MOMENT_POWER = m_power, v_power
        quantization.BLOCK = block
        row = []
        for name, (cls, kw) in configs.items():
            if name == "PNM" and v_power != 4:
                continue
            runs = [train(cls, torch.int8, s, **kw) for s in range(3)]
            gap = sum(r[0] - b[0] for r, b in zip(runs, base[name])) / 3
            curve = sum(((r[1] - b[1]) ** 2).mean() / b[1].var() for r, b in zip(runs, base[name])) / 3
            d = drift(cls, torch.int8, **_drift_kw(kw))
            ratio = (d.sum() / base[name + "drift"].sum()).item()
            row.append(f"{name}: final-loss gap {gap:+.4f} curve nmse {curve:.3f} "
                       f"drift {ratio - 1:+.4f}")
        print(f"momentum^{m_power} v^{v_power} block {block}: " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
