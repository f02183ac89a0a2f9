"""Host time of the memory checks (docs/edits.md; pnm_kernels/aliasing.py): a step that
builds its lists again (after an edit of the state: every parameter, gradient and state
tensor claimed and swept), and a repeated step (each held tensor's memory compared in the
op's own pass). AdaPNM-AMSGrad, fused, many small tensors: host work, not memory traffic.
Run it once per build to compare (the .so of each build in turn), alternating builds.

    python benchmarks/experiments/memory_checks.py [--tensors 10000] [--numel 64] [--rounds 60]
"""
import argparse
import time

import torch

from pnm_kernels import AdaPNM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=10000)
    parser.add_argument("--numel", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = [torch.randn(args.numel, requires_grad=True) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = AdaPNM(params, lr=1e-3, backend="fused")
    for _ in range(5):
        opt.step()
    repeated = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(5):
            opt.step()
        repeated.append((time.perf_counter() - start) / 5)
    rebuilt = []
    for _ in range(7):
        state = opt.state[params[0]]
        state["step"] = state["step"].clone()  # a counted edit: the lists are built again
        start = time.perf_counter()
        opt.step()
        rebuilt.append(time.perf_counter() - start)
    repeated.sort()
    rebuilt.sort()
    print(f"{args.tensors} x {args.numel}: repeated step best {repeated[0] * 1e3:.3f} ms, "
          f"10th percentile {repeated[len(repeated) // 10] * 1e3:.3f} ms; step that builds "
          f"its lists, median {rebuilt[3] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
