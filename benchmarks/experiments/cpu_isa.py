"""The fused CPU step under each instruction set this CPU has (SSE2 baseline, AVX2, AVX-512),
interleaved round by round in one process: PNM and AdaPNM, fp32/bf16/fp16, one tensor of
2^20 elements (in cache) and of 23.6M (the transformer set's size, out of cache).

    python benchmarks/experiments/cpu_isa.py
"""
import statistics
import time

import torch

from pnm_kernels import PNM, AdaPNM
from pnm_kernels._ops import cpu_isas, set_cpu_isa


def optimizer(cls, numel, dtype):
    param = torch.nn.Parameter(torch.randn(numel, dtype=dtype))
    param.grad = torch.randn(numel, dtype=dtype)
    opt = cls([param], lr=1e-3, backend="fused")
    opt.step()  # state allocated
    return opt


def main():
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; "
          "ms per step, median of interleaved rounds (3 steps each)")
    isas = cpu_isas()
    print("| dtype | optimizer | elements | " + " | ".join(isas) + " |")
    print("|---|---|---|" + "---|" * len(isas))
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for numel in (1 << 20, 23_600_000):
                for cls in (PNM, AdaPNM):
                    opt = optimizer(cls, numel, dtype)
                    times = {isa: [] for isa in isas}
                    for _ in range(40 if numel < 10**7 else 8):
                        for isa in isas:
                            set_cpu_isa(isa)
                            start = time.perf_counter()
                            for _ in range(3):
                                opt.step()
                            times[isa].append((time.perf_counter() - start) / 3 * 1e3)
                    cells = " | ".join(f"{statistics.median(times[isa]):.3f}" for isa in isas)
                    print(f"| {str(dtype).removeprefix('torch.')} | {cls.__name__} | {numel} | "
                          f"{cells} |", flush=True)
    finally:
        set_cpu_isa()


if __name__ == "__main__":
    main()
