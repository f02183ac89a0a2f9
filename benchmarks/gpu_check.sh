#!/usr/bin/env bash
# One call on a lent GPU machine (see the device tool's README): build for the chip, run the
# test suite on CUDA tensors, compute-sanitizer memcheck on a small step, then the benchmark.
# Everything worth keeping lands in $OUT (default benchmarks/results/gpu): copy it into
# benchmarks/results/ and commit it with the device, versions and this command.
#   bash benchmarks/gpu_check.sh [all|tests|bench|full-bench]
# "all" (default) = tests then the quick benchmark; each stage builds first (a no-op when the
# extension is already built). Split the stages across calls if one call's time limit is short.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-all}"
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/versions.txt"

echo "== build (sm_90)"
TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS="${MAX_JOBS:-16}" python3 -m pip install -q --no-build-isolation -e . \
  > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }

if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
echo "== tests on CUDA"
python3 -m pytest tests -q --maxfail=20 -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests exit code $?"; tail -3 "$OUT/tests.log"

echo "== compute-sanitizer memcheck"
cat > "$OUT/sanitize_step.py" <<'PY'
import torch
from pnm_kernels import PNM, AdaPNM
for dtype in (torch.float32, torch.bfloat16):
    for opt_cls in (PNM, AdaPNM):
        for backend in ("fused", "triton"):
            ps = [torch.randn(s, device="cuda", dtype=dtype).requires_grad_() for s in [(1,), (3,), (4097,), (70001,), (33, 5)]]
            odd = torch.randn(1001, device="cuda", dtype=dtype)[1:].requires_grad_()  # misaligned
            opt = opt_cls(ps + [odd], lr=1e-3, backend=backend)
            for _ in range(3):
                for p in ps + [odd]:
                    p.grad = torch.randn_like(p)
                opt.step()
torch.cuda.synchronize()
print("sanitized step ran")
PY
compute-sanitizer --tool memcheck --error-exitcode 3 python3 "$OUT/sanitize_step.py" > "$OUT/memcheck.log" 2>&1
echo "memcheck exit code $?"; tail -3 "$OUT/memcheck.log"
fi
[ "$MODE" = tests ] && exit 0

echo "== benchmark"
if [ "$MODE" = full-bench ]; then
  python3 benchmarks/bench_step.py --device cuda --out "$OUT" 2> "$OUT/bench.err"
else
  python3 benchmarks/bench_step.py --device cuda --sets tiny2000,small2000,transformer,gpt2-124m,flat64M,flat256M,flat1024M --rounds 5 --no-compiled-reference --out "$OUT" 2> "$OUT/bench.err"
fi
python3 benchmarks/bench_step.py --device cuda --dtype bfloat16 --sets transformer,flat256M --rounds 5 --no-compiled-reference --out "$OUT" 2>> "$OUT/bench.err" | tail -25
