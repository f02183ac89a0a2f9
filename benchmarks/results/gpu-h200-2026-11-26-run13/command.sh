#!/usr/bin/env bash
# Run 13 (the session's third lease call, ~4.4 minutes of device time left): fp32 chunks of
# 4,096 and "auto" = fused (commit 2131419) under the CUDA, backend and op tests, and a sample.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; t0=$SECONDS; git log --oneline -1 > $OUT/commit.txt
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
echo "build $((SECONDS-t0)) s"
timeout -k 3 100 python3 -m pytest tests/test_cuda.py tests/test_backends.py tests/test_ops.py -q -rfEs --tb=short -n 8 --dist load --timeout 80 -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests exit $? at $((SECONDS-t0)) s"; tail -2 $OUT/tests.log; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
timeout -k 3 45 python3 benchmarks/bench_step.py --device cuda --no-compiled --rounds 7 --sets transformer,gpt2-124m,flat256M --out $OUT > $OUT/bench.log 2>&1
echo "bench exit $? at $((SECONDS-t0)) s"
grep -hE "\[(fused|triton)\]|torch.*fused" $OUT/bench_step-cuda-float32.md | cut -c1-75
