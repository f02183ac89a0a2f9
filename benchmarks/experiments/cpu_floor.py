"""How close each fused CPU step comes to the bare loop of its own access pattern, and what
the bare loops allow the PNM ÷ SGD-momentum and AdaPNM ÷ Adam-AMSGrad ratios to be.

    python benchmarks/experiments/cpu_floor.py [--set transformer|flat] [--numel N] [--rounds 15]

Builds the bare loops of `benchmarks/experiments/cpu_streams.cpp` (g++, the same flags as our kernel:
-O3 -fno-math-errno -ffp-contract=off, for this CPU) and times, interleaved round by round in
this one process: each bare loop over flat fp32 arrays, our fused PNM/AdaPNM step and
torch's fused SGD-momentum/Adam-AMSGrad step over fp32 parameters of the same total size, as
one flat tensor (--set flat) or as the transformer set of bench_common.py (--set transformer,
the default; the bare loops then cover its total element count). A bare loop does an
optimizer's reads, writes and arithmetic with nothing else (no per-tensor set-up, no
dispatch), so it is the floor that optimizer's step can reach here.
Ratios are medians of per-round paired ratios (the shared machine drifts).
"""
import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..")]  # bench_common, the checkout
from pnm_kernels import PNM, AdaPNM  # noqa: E402
from bench_common import BYTES_PER_ELEMENT, transformer_shapes  # noqa: E402


def build_loops(workdir):
    """cpu_streams.cpp as a shared library, loaded with ctypes."""
    path = os.path.join(workdir, "cpu_streams.so")
    subprocess.run(["g++", "-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off",
                    "-fopenmp", "-shared", "-fPIC", "-DCPU_STREAMS_LIBRARY",
                    os.path.join(HERE, "cpu_streams.cpp"), "-o", path], check=True)
    return ctypes.CDLL(path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=("transformer", "flat"), default="transformer",
                        help="the fused steps' parameters: the transformer set, or one tensor "
                             "of its size")
    parser.add_argument("--numel", type=int, default=None,
                        help="with --set flat: elements (default: the transformer set's)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    shapes = transformer_shapes()
    n = sum(torch.Size(shape).numel() for shape in shapes)
    if args.set == "flat":
        n = args.numel or n
        shapes = [(n,)]
    elif args.numel is not None:
        parser.error("--numel goes with --set flat")

    def array(shape=(n,)):
        return torch.rand(shape) * 0.01 + 1e-3  # positive: no sqrt of a negative

    def fused(make):
        params = [torch.nn.Parameter(array(shape)) for shape in shapes]
        for param in params:
            param.grad = array(param.shape)
        opt = make(params)
        opt.step()  # state allocated and touched
        return opt.step

    with tempfile.TemporaryDirectory() as workdir:
        loops = build_loops(workdir)
        # Each bare loop has arrays of its own, as each fused step has its own tensors: with
        # shared ones, a --numel small enough to fit the last-level cache left one loop's
        # arrays cached for the next, and the bare loops were no floor.
        held = []

        def arrays(count):
            held.extend(array() for _ in range(count))
            return [ctypes.c_void_p(t.data_ptr()) for t in held[-count:]]

        count = ctypes.c_long(n)
        sgd_arrays, pnm_arrays, adam_arrays, adapnm_arrays = (arrays(k) for k in (3, 4, 5, 6))
        # (family, label, step): a bare loop and the fused steps of the same family.
        contenders = [
            ("SGD-momentum", "bare loop", lambda: loops.sgd_momentum(*sgd_arrays, count)),
            ("SGD-momentum", "torch fused", fused(
                lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True))),
            ("PNM", "bare loop", lambda: loops.pnm(*pnm_arrays, count)),
            ("PNM", "pnm_kernels fused", fused(
                lambda ps: PNM(ps, lr=1e-3, betas=(0.9, 1.0), backend="fused"))),
            ("Adam-amsgrad", "bare loop", lambda: loops.adam_amsgrad(*adam_arrays, count)),
            ("Adam-amsgrad", "torch fused", fused(
                lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, fused=True))),
            ("AdaPNM", "bare loop", lambda: loops.adapnm_amsgrad(*adapnm_arrays, count)),
            ("AdaPNM", "pnm_kernels fused", fused(
                lambda ps: AdaPNM(ps, lr=1e-3, amsgrad=True, backend="fused"))),
        ]
        times = {(family, label): [] for family, label, _ in contenders}
        for _ in range(args.rounds):
            for family, label, step in contenders:
                start = time.perf_counter()
                for _ in range(3):
                    step()
                times[family, label].append((time.perf_counter() - start) / 3)

    def gbps(family, t):
        return BYTES_PER_ELEMENT[family] * n / t / 1e9

    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, {n} fp32 elements "
          f"({args.set} set: {len(shapes)} tensors for the fused steps, flat arrays for the "
          f"bare loops), {args.rounds} interleaved rounds of 3 steps")
    print("| optimizer | step | ms | effective GB/s | time ÷ its bare loop |")
    print("|---|---|---|---|---|")
    for family, label, _ in contenders:
        t = times[family, label]
        floor = times[family, "bare loop"]
        ratio = statistics.median(a / b for a, b in zip(t, floor))
        print(f"| {family} | {label} | {statistics.median(t) * 1e3:.3f} | "
              f"{gbps(family, statistics.median(t)):.1f} | {ratio:.3f} |")
    print()
    for ours, theirs in (("PNM", "SGD-momentum"), ("AdaPNM", "Adam-amsgrad")):
        cells = []
        for label, our_step, their_step in (("bare loop", "bare loop", "bare loop"),
                                            ("fused steps", "pnm_kernels fused", "torch fused")):
            ratio = statistics.median(
                gbps(ours, a) / gbps(theirs, b)
                for a, b in zip(times[ours, our_step], times[theirs, their_step]))
            cells.append(f"{label} {ratio:.3f}")
        print(f"{ours} ÷ {theirs}, effective GB/s: " + ", ".join(cells))

if __name__ == "__main__":
    main()
