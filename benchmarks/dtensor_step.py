"""Step time over FSDP2's DTensor parameters, where the step is mostly host work: AdaPNM
(fused) against torch.optim.Adam(amsgrad=True), fused and foreach, on a model of many small
Linear layers, each its own FSDP2 unit, in a process group of this process alone.

    python benchmarks/dtensor_step.py [--layers 100] [--width 8] [--steps 20] [--device cuda]
"""
import argparse
import time

import torch
import torch.distributed as dist

from pnm_kernels import AdaPNM


def step_ms(make_opt, layers, width, steps, device):
    """Median over five rounds of the mean step time, ms (gradients set once: the
    optimizer's step alone is timed)."""
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
    for p in params:
        p.grad = DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh, p.placements)
    opt = make_opt(params)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(3):
        opt.step()
    rounds = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            opt.step()
        sync()
        rounds.append((time.perf_counter() - start) / steps * 1e3)
    return sorted(rounds)[2]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
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
              f"(FSDP2, one rank), Linear({args.width}, {args.width}) layers")
        print("| optimizer | ms a step |\n|---|---|")
        contenders = {
            "AdaPNM fused": lambda ps: AdaPNM(ps, lr=1e-3, backend="fused"),
            "torch Adam-AMSGrad fused": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True,
                                                                    fused=True),
            "torch Adam-AMSGrad foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True,
                                                                      foreach=True),
        }
        for name, make_opt in contenders.items():
            ms = step_ms(make_opt, args.layers, args.width, args.steps, args.device)
            print(f"| {name} | {ms:.2f} |")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
