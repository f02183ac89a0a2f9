"""Learning with noisy labels, in miniature (the paper's Section 5 experiment, on a dataset
that ships with scikit-learn): with 40 % symmetric label noise, does PNM with a large b0
memorise fewer noisy labels and reach a higher test accuracy than SGD with momentum?

    python benchmarks/examples/noisy_labels.py [--seeds 2] [--epochs 150] [--noise 0.4] [--out DIR]
        [--optimizers SGD,SGD-slow,PNM] [--state-dtypes none,bfloat16]

--state-dtypes runs PNM once per state dtype (state_dtype; "none": the parameters' float32).

Learning rates follow the paper's convention: PNM gets SGD's lr, converted from torch's
summed momentum (a step of lr/(1-b1) times the averaged gradient) to PNM's averaged (EMA)
momentum, i.e. lr/(1-b1). PNM divides its step by noise_norm = sqrt((1+b0)^2 + b0^2), so its
drift is smaller and its gradient noise relatively larger; "SGD-slow" is the control that
asks whether a smaller drift alone explains the result: SGD with lr / noise_norm.
Everything else (model, data order, noise) is identical per seed.
Prints the final accuracies per optimizer and seed, and saves a PNG of the curves.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from pnm_kernels import PNM  # noqa: E402
from pnm_kernels.reference import noise_norm  # noqa: E402


def load_data(noise, seed):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    gen = torch.Generator().manual_seed(1234)  # the same split for every seed
    order = torch.randperm(len(y), generator=gen)
    test, train = order[:500], order[500:]
    y_train = y[train].clone()
    gen = torch.Generator().manual_seed(seed)
    flip = torch.rand(len(train), generator=gen) < noise
    # symmetric noise: a flipped label becomes one of the 9 other classes, uniformly
    offset = torch.randint(1, 10, (len(train),), generator=gen)
    y_train[flip] = (y_train[flip] + offset[flip]) % 10
    return x[train], y_train, y[train], flip, x[test], y[test]


def make_optimizer(name, params, lr, b1, b0, state_dtype=None):
    if name == "SGD":
        return torch.optim.SGD(params, lr=lr, momentum=b1, weight_decay=5e-4)
    if name == "SGD-slow":  # control: SGD whose drift equals PNM's (lr divided by noise_norm)
        return torch.optim.SGD(params, lr=lr / noise_norm(b0), momentum=b1, weight_decay=5e-4)
    return PNM(params, lr=lr / (1 - b1), betas=(b1, b0), weight_decay=5e-4, decoupled=False,
               state_dtype=state_dtype)


def run(name, seed, args, device, state_dtype=None):
    x, y_noisy, y_clean, flipped, x_test, y_test = load_data(args.noise, seed)
    x, y_noisy, x_test, y_test = (t.to(device) for t in (x, y_noisy, x_test, y_test))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(device)
    opt = make_optimizer(name, model.parameters(), args.lr, 0.9, args.b0, state_dtype)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    gen = torch.Generator().manual_seed(seed)
    curves = {"test": [], "memorised": []}
    for _ in range(args.epochs):
        model.train()
        for idx in torch.randperm(len(x), generator=gen).split(args.batch):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y_noisy[idx]).backward()
            opt.step()
        sched.step()
        model.eval()
        with torch.no_grad():
            pred_test = model(x_test).argmax(1)
            pred_train = model(x).argmax(1).cpu()
        curves["test"].append((pred_test == y_test).float().mean().item())
        # memorisation: share of the mislabelled training samples predicted as their wrong label
        curves["memorised"].append((pred_train[flipped] == y_noisy.cpu()[flipped]).float().mean().item())
    return curves


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--noise", type=float, default=0.4)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's lr (PNM: lr/(1-b1))")
    parser.add_argument("--b0", type=float, default=3.0, help="PNM's positive-negative coefficient")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--optimizers", default="SGD,SGD-slow,PNM")
    parser.add_argument("--state-dtypes", default="none",
                        help="comma-separated state dtypes PNM runs with: none, float32, bfloat16")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out"),
                        help="where noisy_labels.{md,png} go (benchmarks/out/, ignored by git; "
                             "the kept ones: --out benchmarks/results)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # (optimizer, state dtype) pairs: PNM once per --state-dtypes entry
    state_dtypes = [None if d == "none" else getattr(torch, d) for d in args.state_dtypes.split(",")]
    runs = [(name, sd) for name in args.optimizers.split(",")
            for sd in (state_dtypes if name == "PNM" else [None])]
    results = {r: [] for r in runs}
    total, done, start = len(runs) * args.seeds, 0, time.time()
    for seed in range(args.seeds):
        for name, sd in runs:
            results[(name, sd)].append(run(name, seed, args, device, sd))
            done += 1
            sys.stderr.write(f"\r[{'#' * (20 * done // total):<20}] {done}/{total} runs "
                             f"{time.time() - start:4.0f}s")
    sys.stderr.write("\n")
    lines = [f"digits, {args.noise:.0%} symmetric label noise, {args.epochs} epochs, device {device}",
             "",
             "| optimizer | seed | final test acc | best test acc | noisy labels memorised |",
             "|---|---|---|---|---|"]
    for name, sd in runs:
        label = {"SGD": "SGD", "SGD-slow": f"SGD, lr/{noise_norm(args.b0):.2f}",
                 "PNM": f"PNM (b0={args.b0})"}[name]
        if sd is not None:
            label += f", {str(sd).replace('torch.', '')} state"
        curves = results[(name, sd)]
        for seed, c in enumerate(curves):
            lines.append(f"| {label} | {seed} | {c['test'][-1]:.3f} | {max(c['test']):.3f} | {c['memorised'][-1]:.3f} |")
        mean = lambda k: sum(c[k][-1] for c in curves) / len(curves)  # noqa: E731
        lines.append(f"| {label} | mean | {mean('test'):.3f} | | {mean('memorised'):.3f} |")
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "noisy_labels.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    results = {name: results[(name, None)] for name, sd in runs if sd is None}
    plot(results, args, os.path.join(args.out, "noisy_labels.png"))
    print(f"wrote {args.out}/noisy_labels.md and noisy_labels.png")
    return results


def plot(results, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, color in (("SGD", "tab:blue"), ("SGD-slow", "tab:green"), ("PNM", "tab:red")):
        for i, c in enumerate(results.get(name, [])):
            label = {"SGD": "SGD", "SGD-slow": "SGD, lr/noise_norm", "PNM": f"PNM b0={args.b0}"}[name]
            kw = dict(color=color, alpha=0.8, label=label if i == 0 else None)
            axes[0].plot(c["test"], **kw)
            axes[1].plot(c["memorised"], **kw)
    axes[0].set_title("test accuracy (clean labels)")
    axes[1].set_title("mislabelled training samples memorised")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"digits, {args.noise:.0%} symmetric label noise", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
