"""Host time of a step with compressed state over many small tensors (docs/performance.md,
"Host time"): AdaPNM-AMSGrad, fused, 2,000 parameters of 16 x 16, state_dtype None (held and
repeated), bfloat16 and int8; the median of 15 steps after 3. Run it in each checkout to
compare, alternating:

    for i in 1 2 3; do python compressed_state_host.py /tmp/old; python compressed_state_host.py .; done
"""
import sys
import time

import torch

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")
from pnm_kernels import AdaPNM  # noqa: E402


def median_step_ms(state_dtype) -> float:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(2000)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = AdaPNM(params, lr=1e-3, backend="fused", state_dtype=state_dtype)
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return sorted(times)[7] * 1e3


if __name__ == "__main__":
    print(sys.argv[1:], {str(d): round(median_step_ms(d), 2)
                         for d in (None, torch.bfloat16, torch.int8)})
