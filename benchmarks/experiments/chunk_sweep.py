"""The fused CUDA step's chunk size (elements a block updates), side by side in one process.

    python benchmarks/experiments/chunk_sweep.py [--chunks 4096,8192,16384,32768] [--sets ...]
                                     [--dtypes float32,bfloat16] [--rounds 11] [--out DIR]

One optimizer per (set, dtype, optimizer) steps the same parameters at every chunk size in
turn (the launch planner reads the chunk size at every call: pnm_kernels._ops.set_launch_limits),
round by round, the order reversed every other round; the Triton step of the same optimizer
runs in the same rounds, for the question whether "auto" should prefer it. Ratios are medians
of per-round paired ratios to the shipped chunk size, so drift in the machine's speed cancels.
Writes chunk_sweep.md (also printed) and chunk_sweep.json.
"""
import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..")]  # bench_common, the checkout
from bench_common import SETS, machine_info, timed  # noqa: E402
from pnm_kernels import PNM, AdaPNM, available_backends  # noqa: E402
from pnm_kernels.backends import TRITON_DTYPES  # noqa: E402
from pnm_kernels._ops import cuda_chunk_size, set_launch_limits  # noqa: E402

FACTORIES = {"PNM": lambda ps, b: PNM(ps, lr=1e-3, betas=(0.9, 1.0), backend=b),
             "AdaPNM": lambda ps, b: AdaPNM(ps, lr=1e-3, amsgrad=True, backend=b)}


def sweep(shapes, dtype, family, chunks, rounds, steps, with_triton, device="cuda"):
    """{contender: [seconds a step, one a round]}: contender is a chunk size or "triton"."""
    params = [torch.randn(s, device=device, dtype=dtype).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    fused = FACTORIES[family](params, "fused")
    runs = [(c, fused) for c in chunks]
    if with_triton:
        runs.append(("triton", FACTORIES[family](params, "triton")))
    times = {c: [] for c, _ in runs}
    try:
        for c, opt in runs:  # warm-up: state, Triton compilation
            set_launch_limits(chunk_size=c if c != "triton" else 0)
            for _ in range(3):
                opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        for r in range(rounds):
            for c, opt in (runs if r % 2 == 0 else runs[::-1]):
                set_launch_limits(chunk_size=c if c != "triton" else 0)
                times[c].append(timed(opt.step, device, steps)[0])
    finally:
        set_launch_limits()
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", default="4096,8192,16384,32768")
    parser.add_argument("--sets", default="resnet50,transformer,gpt2-124m,llama-1b,flat16M,"
                                          "flat64M,flat256M,flat1024M")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=10, help="steps a timed round")
    parser.add_argument("--out", default=".")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: only a smoke run of this script (the CPU kernel has no chunks)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    chunks += sorted({cuda_chunk_size(d) for d in dtypes} - set(chunks))  # the ratios' baselines
    with_triton = args.device == "cuda" and "triton" in available_backends("cuda")
    info = machine_info(args.device, args)
    rows = []
    for name in args.sets.split(","):
        shapes = SETS[name]()
        for dtype in dtypes:
            for family in FACTORIES:
                times = sweep(shapes, dtype, family, chunks, args.rounds, args.steps,
                              with_triton and dtype in TRITON_DTYPES, args.device)
                base = times[cuda_chunk_size(dtype)]
                rows.append(dict(
                    set=name, dtype=str(dtype).removeprefix("torch."), optimizer=family,
                    shipped=cuda_chunk_size(dtype),
                    ms={str(c): statistics.median(t) * 1e3 for c, t in times.items()},
                    vs_shipped={str(c): statistics.median(a / b for a, b in zip(t, base))
                                for c, t in times.items()},
                    times_ms={str(c): [x * 1e3 for x in t] for c, t in times.items()}))
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                print(name, rows[-1]["dtype"], family, {c: round(v, 4) for c, v in rows[-1]["ms"].items()},
                      flush=True)
    keys = [str(c) for c in chunks] + (["triton"] if with_triton else [])
    lines = [f"Device: {info.get('gpu', info['cpu'])}, torch "
             f"{torch.__version__}; fused CUDA step, ms a step (median of {args.rounds} rounds of "
             f"{args.steps} steps) and, in brackets, the median paired ratio to the chunk size "
             f"shipped for the dtype (" + ", ".join(
                 f"{str(d).removeprefix('torch.')} {cuda_chunk_size(d)}" for d in dtypes) + ")",
             "", "| set | dtype | optimizer | " + " | ".join(
                 f"chunk {k}" if k != "triton" else "Triton step" for k in keys) + " |",
             "|---|---|---|" + "---|" * len(keys)]
    for r in rows:
        lines.append(f"| {r['set']} | {r['dtype']} | {r['optimizer']} | " + " | ".join(
            f"{r['ms'][k]:.3f} ({r['vs_shipped'][k]:.3f})" if k in r["ms"] else "–"
            for k in keys) + " |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chunk_sweep.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "chunk_sweep.json"), "w") as f:
        json.dump(dict(machine=info, chunks=chunks, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
