#!/usr/bin/env bash
# Run 10 (the session's second lease call, ~4 minutes of device time left): the adopted launch
# shapes (fused CUDA chunks of 16,384 elements; fp32 AdaPNM Triton 4096 x 4, 16 warps) and the
# 2^26 "auto" threshold under the CUDA tests, and a second sample of their timings.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; t0=$SECONDS
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
echo "build $((SECONDS - t0)) s"
timeout -k 3 95 python3 -m pytest tests/test_cuda.py tests/test_backends.py -q -rfEs --tb=short -n 8 --dist load --timeout 80 -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests exit $? at $((SECONDS - t0)) s"; tail -2 $OUT/tests.log; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
timeout -k 3 40 python3 benchmarks/bench_step.py --device cuda --no-compiled --rounds 7 --sets transformer,gpt2-124m,flat64M --out $OUT > $OUT/bench.log 2>&1
echo "bench exit $? at $((SECONDS - t0)) s"
grep -hE "\[(fused|triton|auto)\]|torch.*fused" $OUT/bench_step-cuda-float32.md | cut -c1-75
