"""Host time of a Triton step, measurable without a GPU: the step's Python and C++ work (plan
or repeat, checks, pointer tables, arguments) with the two Triton kernels replaced by no-ops,
beside the fused CPU step (which also does the arithmetic) over the same tensors. On a GPU a
launch adds its own host time on top (Triton's launcher). Best of 5 loops of --steps steps.

    python benchmarks/experiments/triton_host.py [--tensors 1,76,2000] [--numel 16] [--steps 50]
"""
import argparse
import os
import time

import torch

from pnm_kernels import PNM, AdaPNM
from pnm_kernels.backends import triton_kernels


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def host_us(opt_cls, backend, tensors, numel, steps):
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel)
    opt = opt_cls(params, lr=1e-3, backend=backend)
    for _ in range(5):
        opt.step()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps):
            opt.step()
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", default="1,76,2000")
    parser.add_argument("--numel", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    kernels = triton_kernels._step_kernel, triton_kernels._increment_steps_kernel
    triton_kernels._step_kernel = triton_kernels._increment_steps_kernel = _NoLaunch()
    interpret = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the Triton path; nothing runs
    try:
        print(f"| tensors of {args.numel} | optimizer | Triton host µs (no launch) | fused CPU step µs |")
        print("|---|---|---|---|")
        for tensors in (int(n) for n in args.tensors.split(",")):
            for opt_cls in (PNM, AdaPNM):
                row = [host_us(opt_cls, b, tensors, args.numel, args.steps)
                       for b in ("triton", "fused")]
                print(f"| {tensors} | {opt_cls.__name__} | {row[0]:.0f} | {row[1]:.0f} |")
    finally:
        triton_kernels._step_kernel, triton_kernels._increment_steps_kernel = kernels
        if interpret is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = interpret


if __name__ == "__main__":
    main()
