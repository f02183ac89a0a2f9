"""The fused CPU int8 step of two builds side by side (docs/performance.md, "int8 state"):
run it once per checkout, alternating, e.g.

    for i in 1 2 3; do python int8_cpu_builds.py /tmp/old; python int8_cpu_builds.py .; done

Each run imports pnm_kernels from the given checkout (its built extension in place) and
prints the median of 7 steps of PNM and AdaPNM-AMSGrad with int8 state over a transformer
layer stack's weights: 4 x (4 x 768x768, 3072x768, 768x3072), 28.3M elements."""
import sys
import time

import torch

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")
import pnm_kernels  # noqa: E402
from pnm_kernels import PNM, AdaPNM  # noqa: E402

SHAPES = ([(768, 768)] * 4 + [(3072, 768), (768, 3072)]) * 4


def median_step_ms(cls) -> float:
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = cls(params, lr=1e-3, backend="fused", state_dtype=torch.int8)
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return sorted(times)[3] * 1e3


if __name__ == "__main__":
    torch.manual_seed(0)
    print(pnm_kernels.__file__, {c.__name__: round(median_step_ms(c), 1) for c in (PNM, AdaPNM)})
