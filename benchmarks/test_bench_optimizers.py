"""pytest-benchmark comparisons of one optimizer step, run only on request:

    python -m pytest benchmarks/test_bench_optimizers.py --benchmark-only [--benchmark-json out.json]

(tests/ is the default test run; nothing here is collected by it.) Same contenders as
bench_step.py, on a transformer-shaped set, on 2,000 small tensors and on 2,000 tiny ones
(host time), on CUDA when present.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONTENDERS = {label: factory for label, _, factory in bench_step.contenders(DEVICE)
              if "torch.compile" not in label}


@pytest.fixture(scope="module", params=["transformer", "small2000", "tiny2000"])
def shapes(request):
    return bench_step.SETS[request.param]()


@pytest.mark.parametrize("label", sorted(CONTENDERS))
def test_step(benchmark, shapes, label):
    params = [torch.randn(s, device=DEVICE).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt = CONTENDERS[label](params)
    for _ in range(3):
        opt.step()

    def step():
        opt.step()
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    benchmark.pedantic(step, rounds=10, iterations=3, warmup_rounds=1)
