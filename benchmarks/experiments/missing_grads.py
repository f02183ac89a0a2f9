"""Step time when some parameters have no gradient, a different subset each step (mixture-
of-experts layers, unused branches), against torch's fused Adam: AdaPNM (fused, "auto") and
torch.optim.Adam(amsgrad=True, fused=True) over 2,000 tensors of 256 elements, a fraction of
them without a gradient each step (drawn per step, the same draws for both).

    python benchmarks/experiments/missing_grads.py [--steps 50] [--fractions 0,0.1,0.5] [--frozen 0.95]
                                       [--device cuda]
"""
import argparse
import random
import time

import torch

from pnm_kernels import AdaPNM


def step_ms(make_opt, fraction, steps, device="cpu", frozen=False, tensors=2000, numel=256):
    """Mean step time, ms. frozen: the same tensors lack a gradient at every step (a model
    passed whole to the optimizer with most of it frozen, as in LoRA fine-tuning)."""
    params = [torch.randn(numel, device=device, requires_grad=True) for _ in range(tensors)]
    grads = [torch.randn(numel, device=device) for _ in range(tensors)]
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    opt = make_opt(params)
    rng = random.Random(0)
    draws = [[rng.random() < fraction for _ in params] for _ in range(steps + 5)]
    if frozen:
        draws = [draws[0]] * len(draws)

    def one(k):
        for p, g, missing in zip(params, grads, draws[k]):
            p.grad = None if missing and (k > 0 or frozen) else g
        opt.step()

    for k in range(5):  # the first with every gradient: the steady state, all state made
        one(k)
    sync()
    start = time.perf_counter()
    for k in range(steps):
        one(k + 5)
    sync()
    return (time.perf_counter() - start) / steps * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--fractions", default="0,0.1,0.5")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--frozen", type=float, default=0.95,
                        help="a last row where this fraction never has a gradient")
    args = parser.parse_args(argv)
    where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
             else f"CPU, {torch.get_num_threads()} threads")
    print(f"{where}, torch {torch.__version__}; 2,000 x 256 fp32")
    print("| no gradient | AdaPNM ms | torch fused Adam-AMSGrad ms |\n|---|---|---|")
    rows = [(float(f), False) for f in args.fractions.split(",")] + [(args.frozen, True)]
    for fraction, frozen in rows:
        ours = step_ms(lambda ps: AdaPNM(ps, lr=1e-3), fraction, args.steps, args.device,
                       frozen)
        torch_ms = step_ms(lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, fused=True),
                           fraction, args.steps, args.device, frozen)
        label = f"{fraction:.0%}" + (", always the same (frozen)" if frozen else "")
        print(f"| {label} | {ours:.2f} | {torch_ms:.2f} |")


if __name__ == "__main__":
    main()
