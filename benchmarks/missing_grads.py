"""Step time when some parameters have no gradient, a different subset each step (mixture-
of-experts layers, unused branches), against torch's fused Adam: AdaPNM (fused, "auto") and
torch.optim.Adam(amsgrad=True, fused=True) over 2,000 tensors of 256 elements, a fraction of
them without a gradient each step (drawn per step, the same draws for both).

    python benchmarks/missing_grads.py [--steps 50] [--fractions 0,0.1,0.5]
"""
import argparse
import random
import time

import torch

from pnm_kernels import AdaPNM


def step_ms(make_opt, fraction, steps, tensors=2000, numel=256):
    params = [torch.randn(numel, requires_grad=True) for _ in range(tensors)]
    grads = [torch.randn(numel) for _ in range(tensors)]
    opt = make_opt(params)
    rng = random.Random(0)
    draws = [[rng.random() < fraction for _ in params] for _ in range(steps + 5)]

    def one(k):
        for p, g, missing in zip(params, grads, draws[k]):
            p.grad = None if missing else g
        opt.step()

    for k in range(5):  # state for (nearly) every parameter, and the lists held
        one(k)
    start = time.perf_counter()
    for k in range(steps):
        one(k + 5)
    return (time.perf_counter() - start) / steps * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--fractions", default="0,0.1,0.5")
    args = parser.parse_args(argv)
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; 2,000 x 256 fp32")
    print("| no gradient | AdaPNM ms | torch fused Adam-AMSGrad ms |\n|---|---|---|")
    for fraction in map(float, args.fractions.split(",")):
        ours = step_ms(lambda ps: AdaPNM(ps, lr=1e-3), fraction, args.steps)
        torch_ms = step_ms(lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, fused=True),
                           fraction, args.steps)
        print(f"| {fraction:.0%} | {ours:.2f} | {torch_ms:.2f} |")


if __name__ == "__main__":
    main()
