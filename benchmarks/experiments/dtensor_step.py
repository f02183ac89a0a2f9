"""Step time over FSDP2's DTensor parameters, where the step is mostly host work: AdaPNM
(fused) against torch.optim.Adam(amsgrad=True), fused and foreach, on a model of many small
Linear layers, each its own FSDP2 unit, in a process group of this process alone.

    python benchmarks/experiments/dtensor_step.py [--layers 100] [--width 8] [--steps 20] [--device cuda]
                                      [--missing 0.2]

--missing F: at each step a fresh random fraction F of the parameters has no gradient (as
when a model skips a different part each step), the gradients being set inside the timed
loop for every contender alike.
"""
import argparse
import random
import time

import torch
import torch.distributed as dist

from pnm_kernels import AdaPNM


def step_ms(make_opt, layers, width, steps, device, missing=0.0):
    """Median over five rounds of the mean step time, ms (without `missing`, gradients set
    once: the optimizer's step alone is timed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    mesh = init_device_mesh(torch.device(device).type, (1,))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model.to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    grads = [DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh, p.placements)
             for p in params]
    for p, grad in zip(params, grads):
        p.grad = grad
    opt = make_opt(params)
    draws = random.Random(0)

    def step():
        if missing:
            for p, grad in zip(params, grads):
                p.grad = None if draws.random() < missing else grad
        opt.step()

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(3):
        step()
    rounds = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        rounds.append((time.perf_counter() - start) / steps * 1e3)
    return sorted(rounds)[2]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--missing", type=float, default=0.0,
                        help="fraction of parameters without a gradient, drawn afresh each step")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda:  # set_device refuses "cuda" without an index
        torch.cuda.set_device(torch.device(args.device).index or 0)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        where = (torch.cuda.get_device_name(args.device) if cuda
                 else f"CPU, {torch.get_num_threads()} threads")
        print(f"{where}, torch {torch.__version__}; {2 * args.layers} DTensor parameters "
              f"(FSDP2, one rank), Linear({args.width}, {args.width}) layers"
              + (f"; {args.missing:.0%} of them without a gradient, drawn afresh each step"
                 if args.missing else ""))
        print("| optimizer | ms a step |\n|---|---|")
        contenders = {
            "AdaPNM fused": lambda ps: AdaPNM(ps, lr=1e-3, backend="fused"),
            "torch Adam-AMSGrad fused": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True,
                                                                    fused=True),
            "torch Adam-AMSGrad foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True,
                                                                      foreach=True),
        }
        for name, make_opt in contenders.items():
            ms = step_ms(make_opt, args.layers, args.width, args.steps, args.device,
                         args.missing)
            print(f"| {name} | {ms:.2f} |")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
