#!/usr/bin/env bash
# Run 12 (the session's second lease call): build, then benchmarks/chunk_sweep.py with its
# defaults (chunks 4096,8192,16384,32768; resnet50, transformer, gpt2-124m, llama-1b,
# flat16M-flat1024M; fp32 and bf16; 11 rounds of 10 steps).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; (TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS=16 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }); git log --oneline -1 > $OUT/commit.txt; timeout 200 python3 benchmarks/chunk_sweep.py --out $OUT 2>&1 | tee $OUT/chunk_sweep.log
