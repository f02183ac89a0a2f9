#!/usr/bin/env bash
# Run 15 (the session's second lease call, ~6 minutes of device time left): the float64 device
# lr fix (commit 816efaf) under the CUDA, op, fp64 and lr tests; compute-sanitizer on fp64 steps
# with a float64 lr on the GPU; the chunk sweep for fp32 and fp64.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; echo 816efaf > $OUT/commit.txt; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > $OUT/versions.txt; (TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1) || { tail -20 $OUT/build.log; exit 1; }; timeout 100 python3 -m pytest tests/test_cuda.py tests/test_ops.py tests/test_compile.py tests/test_backends.py -k "test_cuda.py or test_ops.py or float64 or lr" -q -rfEs -n 8 --dist load -p no:cacheprovider --timeout 90 > $OUT/tests.log 2>&1; tail -8 $OUT/tests.log; timeout 30 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -c "
import torch
from pnm_kernels import AdaPNM
p=[torch.randn(s,dtype=torch.float64,device='cuda',requires_grad=True) for s in (70001,3,4097)]
o=AdaPNM(p,lr=torch.tensor(1e-3,dtype=torch.float64,device='cuda'),backend='fused')
for _ in range(3):
    for q in p: q.grad=torch.randn_like(q)
    o.step()
torch.cuda.synchronize(); print('sanitized fp64 step with a device float64 lr ran')" > $OUT/memcheck.log 2>&1; tail -3 $OUT/memcheck.log; timeout 70 python3 benchmarks/chunk_sweep.py --sets transformer,flat64M,flat256M --dtypes float32,float64 --rounds 7 --out $OUT > $OUT/chunk_sweep.log 2>&1; tail -14 $OUT/chunk_sweep.log
