"""Times the Triton step under several launch configurations (elements per program per
iteration, iterations per program, warps), to choose triton_kernels._CONFIGS from measurements.

    python benchmarks/experiments/tune_triton.py [--numels 67108864,268435456] [--dtypes float32,bfloat16]
                                     [--out F]

On a GPU: CUDA events, median of --repeats steps after a warm-up, effective GB/s and the
fraction of the copy bandwidth measured in the same run. For each dtype and optimizer the
"best" configuration is the one whose slowest size (as a fraction of copy bandwidth) is
fastest; `bench_step.py --triton-configs F` (bench_common.load_triton_configs) runs the Triton backend with those. Without a GPU
it runs under the Triton interpreter on a small size, as a smoke test with no meaning for speed.
"""
import argparse
import json
import os
import statistics
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..")]  # bench_common, the checkout
from pnm_kernels import PNM, AdaPNM  # noqa: E402
from pnm_kernels.backends.triton_kernels import LaunchConfig, set_launch_config  # noqa: E402

from bench_common import BYTES_PER_ELEMENT, copy_bandwidth, timed_steps  # noqa: E402

CANDIDATES = [LaunchConfig(2048, 8, 8), LaunchConfig(4096, 4, 8), LaunchConfig(4096, 4, 16),
              LaunchConfig(1024, 16, 4), LaunchConfig(2048, 4, 4), LaunchConfig(8192, 2, 16),
              LaunchConfig(8192, 2, 32), LaunchConfig(8192, 4, 16), LaunchConfig(2048, 4, 8),
              # ptxas for sm_90a, bf16: 16 elements a thread take 121-240 registers or spill, 8 a
              # thread take 40-80 and fit 1-6 programs an SM: try both
              LaunchConfig(8192, 1, 16), LaunchConfig(4096, 2, 16), LaunchConfig(4096, 8, 16),
              LaunchConfig(2048, 2, 8), LaunchConfig(4096, 2, 8), LaunchConfig(16384, 2, 32)]


def time_step(opt, device, repeats, steps):
    """Median over `repeats` samples of the time per step over `steps` back-to-back steps, as
    bench_step times a round. One step alone would also time the host issuing it (~0.1 ms
    for Triton, a large share of a step over 2^26 elements), and a ranking by single steps
    ranks that bias (docs/performance.md, Triton launch configurations)."""
    return statistics.median(timed_steps(opt, device, steps)[0] for _ in range(repeats))


def best_configs(rows):
    """{(dtype, optimizer): the row of the configuration whose lowest copy fraction over the
    sizes tried is highest}."""
    worst = {}
    for r in rows:
        key = (r["dtype"], r["optimizer"], r["block"], r["iters"], r["num_warps"])
        worst[key] = min(worst.get(key, float("inf")), r["copy_fraction"])
    best = {}
    for (dtype, family, *config), fraction in worst.items():
        if (dtype, family) not in best or fraction > best[(dtype, family)]["worst_copy_fraction"]:
            best[(dtype, family)] = dict(dtype=dtype, optimizer=family, block=config[0],
                                         iters=config[1], num_warps=config[2],
                                         worst_copy_fraction=fraction)
    return list(best.values())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numels", default=None, help="comma-separated sizes (one tensor each)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed sample")
    parser.add_argument("--out", default=None, help="write the rows and best choices as JSON here")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    numels = ([int(n) for n in args.numels.split(",")] if args.numels else
              [64 << 20, 256 << 20] if device == "cuda" else [40000])
    copy_gbps = copy_bandwidth(device, max(numels))
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        scale = dtype.itemsize / 4
        for numel in numels:
            param = torch.randn(numel, device=device).to(dtype).requires_grad_()
            param.grad = torch.randn_like(param) * 1e-2
            for family, make in (("PNM", lambda ps: PNM(ps, lr=1e-3, backend="triton")),
                                 ("AdaPNM", lambda ps: AdaPNM(ps, lr=1e-3, backend="triton"))):
                opt = make([param])
                for config in CANDIDATES:
                    set_launch_config(config)
                    try:
                        time_step(opt, device, 1, 3)  # compiles this configuration, tables
                        t = time_step(opt, device, args.repeats, args.steps)
                    finally:
                        set_launch_config(None)
                    gbps = BYTES_PER_ELEMENT[family] * scale * numel / t / 1e9
                    rows.append(dict(dtype=dtype_name, optimizer=family, numel=numel,
                                     block=config.block, iters=config.iters,
                                     num_warps=config.num_warps, ms=t * 1e3, gbps=gbps,
                                     copy_fraction=gbps / copy_gbps))
                del opt
            del param
    best = best_configs(rows)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter)"
    print(f"{name}, copy bandwidth {copy_gbps:.0f} GB/s")
    print("| dtype | optimizer | elements | block | iters | warps | ms | GB/s | % of copy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['optimizer']} | {r['numel']} | {r['block']} | {r['iters']} | "
              f"{r['num_warps']} | {r['ms']:.3f} | {r['gbps']:.0f} | {100 * r['copy_fraction']:.0f}% |")
    print("\nbest (highest lowest-fraction over the sizes):")
    for b in best:
        print(f"  {b['dtype']} {b['optimizer']}: {b['block']} x {b['iters']}, {b['num_warps']} "
              f"warps ({100 * b['worst_copy_fraction']:.0f}% of copy at its slowest size)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=name, numels=numels, copy_gbps=copy_gbps, rows=rows, best=best),
                      f, indent=1)


if __name__ == "__main__":
    main()
