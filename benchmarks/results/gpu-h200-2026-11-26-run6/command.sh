# H200 run 6 (2026-11-26 13:33-13:36 UTC, the session's second device call, at commit adb8b79):
# ran as `bash exp/run.sh` with the two JSON files in exp/; copied here, paths updated.
# bf16 flat sets, bench_step.py five times in a row: the shipped Triton launch
# configuration, then two candidates (--triton-configs), then each again.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $W/versions.txt
git log -1 --format=%H >> $W/versions.txt
t0=$SECONDS
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace > $W/build.log 2>&1 || { tail -20 $W/build.log; exit 1; }
echo "build $((SECONDS-t0)) s"
for v in shipped w32 run4 shipped2 w32b; do
  cfg=""; case $v in w32*|run4) cfg="--triton-configs benchmarks/results/gpu-h200-2026-11-26-run6/${v%b}.json";; esac
  t0=$SECONDS
  timeout 75 python3 benchmarks/bench_step.py --device cuda --dtype bfloat16 --sets flat64M,flat256M,flat1024M --rounds 7 --no-compiled-reference --out $W/$v $cfg > $W/$v.log 2>&1
  echo "== $v ($cfg) rc=$? $((SECONDS-t0)) s"; head -1 $W/$v/bench_step-cuda-bfloat16.md
  grep -E "\[(fused|triton)\]" $W/$v/bench_step-cuda-bfloat16.md | cut -c1-90
  tar -czf $OUT/exp.tgz -C $W .
done
