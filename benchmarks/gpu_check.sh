#!/usr/bin/env bash
# One call on a lent GPU machine (docs/testing.md, "On a lent GPU"; its image has pytest-xdist
# and pytest-timeout): build for the chip, run the
# test suite on CUDA tensors, the benchmarks, Triton launch configurations
# (benchmarks/experiments/tune_triton.py), compute-sanitizer memcheck on a small step and the GPT/FSDP2
# example. Every stage has a time limit inside one overall deadline, so the call always ends
# with its logs packed: $OUT/gpu_check.tgz (default OUT=benchmarks/results/gpu, ignored by git).
# Commit only what lasts: the bench_step-cuda-* tables over the old ones, and a short
# benchmarks/results/gpu-<card>-<date>.md (what ran, versions, headline figures, test counts);
# the logs stay out of the tree.
#   bash benchmarks/gpu_check.sh [DEADLINE_SECONDS]   (default 575)
# SKIP_STAGES="gpt_fsdp2 tune_triton" leaves out stages by name (to fit a short lease).
set -uo pipefail
cd "$(dirname "$0")/.."
DEADLINE=$((SECONDS + ${1:-575}))
DEST="${OUT:-benchmarks/results/gpu}"
WORK="$(mktemp -d)"
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1

pack() { tar -czf "$DEST/gpu_check.tgz" -C "$WORK" . ; }
# stage NAME LIMIT COMMAND...: runs COMMAND with its output in NAME.log, for at most LIMIT
# seconds and never past the deadline; records its exit code and time in summary.txt.
stage() {
  local name=$1 limit=$2; shift 2
  if [[ " ${SKIP_STAGES:-} " == *" $name "* ]]; then echo "$name: skipped" | tee -a "$WORK/summary.txt"; return 0; fi
  local left=$((DEADLINE - SECONDS))
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then echo "$name: not run (deadline)" | tee -a "$WORK/summary.txt"; return 1; fi
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$WORK/summary.txt"
  pack
  return $rc
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 --version
  nvcc --version | tail -2
  echo "CXX=${CXX:-} ($("${CXX:-g++}" --version | head -1))"
  echo "command: SKIP_STAGES=\"${SKIP_STAGES:-}\" bash benchmarks/gpu_check.sh $*"
} > "$WORK/versions.txt" 2>&1
cat "$WORK/versions.txt"

# In place, not `pip install -e`: the device image's pip 24 runs `setup.py develop`, which
# newer setuptools hands back to pip with build isolation, which needs the (absent) internet.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
stage build 200 env TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS=16 python3 setup.py build_ext --inplace \
  || { tail -30 "$WORK/build.log"; exit 1; }

# --dist load: with loadfile, a crashed worker once ended the whole run in an xdist error.
# -v: a line per test as it ends, so a run cut off by the stage's limit still names what
# failed (the -rfEs summary comes only at the end).
stage tests 230 python3 -m pytest tests -v -rfEs --tb=short -n 8 --dist load --max-worker-restart 100 \
  --timeout 150 -p no:cacheprovider
tail -4 "$WORK/tests.log"

SETS_F32=tiny2000,small2000,resnet50,transformer,gpt2-124m,llama-1b,flat1M,flat16M,flat64M,flat256M,flat1024M
stage bench_fp32 150 python3 benchmarks/bench_step.py --device cuda --sets "$SETS_F32" --rounds 9 \
  --out "$WORK"
# The fp32 table measures the shipped launch shapes. The fused step's chunk sizes side by side
# in one process (the shipped 4,096 for fp32 and 16,384 for 16-bit types were chosen on an
# H200: docs/performance.md): on another card (an H100) this says whether they hold there too.
# A chunk size the sweep sets holds for every step, so its flat1M rows time 4,096 as two
# launches (the step, then the counters) and 16,384 as one, which is what a step of 0.54M-2.2M
# 4- or 8-byte elements ships with (step_chunk_size in csrc/multi_tensor_apply.h).
stage chunk_sweep 60 python3 benchmarks/experiments/chunk_sweep.py --sets flat1M,transformer,gpt2-124m,flat64M,flat256M \
  --dtypes float32,bfloat16,float64 --rounds 9 --out "$WORK"
# Host time of a launch by the size of its argument (the fused step's table is about 30 KB at
# any step size): whether a table sized to the step would cut a small step's host time.
stage launch_params 30 bash -c 'nvcc -O2 -std=c++17 -arch=sm_90 benchmarks/experiments/launch_params.cu \
  -o "$1/launch_params" && "$1/launch_params"' _ "$WORK"
stage bench_bf16 70 python3 benchmarks/bench_step.py --device cuda --dtype bfloat16 \
  --sets small2000,transformer,flat64M,flat256M,flat1024M --rounds 9 \
  --out "$WORK"
# The fp64 kernels (fused only). 40 s is too little: the tables get written, but the process
# is still ending when the limit strikes.
stage bench_fp64 60 python3 benchmarks/bench_step.py --device cuda --dtype float64 \
  --sets small2000,transformer,flat64M,flat256M --rounds 9 --out "$WORK"

# bfloat16 state (csrc/state_block.h): its CUDA kernel's time and bytes beside float32 state's
# and torch's fused optimizers.
mkdir -p "$WORK/bf16_state"
stage bench_bf16_state 60 python3 benchmarks/bench_step.py --device cuda --state-dtype bfloat16 \
  --sets transformer,flat64M,flat256M --rounds 9 --out "$WORK/bf16_state"
# int8 state (csrc/int8_block.h): the transformer and GPT-2 sets (their weights are 2-D: the
# flat sets' 1-D tensors would keep bfloat16 state), with torchao's AdamW8bit where installed.
mkdir -p "$WORK/int8_state"
stage bench_int8_state 60 python3 benchmarks/bench_step.py --device cuda --state-dtype int8 \
  --sets transformer,gpt2-124m,llama-1b --rounds 9 --out "$WORK/int8_state"

cat > "$WORK/sanitize_step.py" <<'PY'
import torch
from pnm_kernels import PNM, AdaPNM
for dtype in (torch.float32, torch.bfloat16, torch.float64):
    for opt_cls in (PNM, AdaPNM):
        for backend in ("fused", "triton") if dtype != torch.float64 else ("fused",):
            ps = [torch.randn(s, device="cuda", dtype=dtype).requires_grad_()
                  for s in [(1,), (3,), (4097,), (70001,), (33, 5)]]
            odd = torch.randn(1001, device="cuda", dtype=dtype)[1:].requires_grad_()  # misaligned
            opt = opt_cls(ps + [odd], lr=1e-3, backend=backend)
            opt_state = opt_cls([p.detach().clone().requires_grad_() for p in ps + [odd]],
                                lr=1e-3, backend=backend, state_dtype=torch.bfloat16,
                                bf16_stochastic_round=True) if dtype != torch.float64 else None
            # the int8 kernel (int8_block.h): rows ending in a short block, one-block rows
            rows = [torch.randn(s, device="cuda", dtype=dtype).requires_grad_()
                    for s in [(7, 300), (3, 129), (2, 128), (5, 3, 50)]]
            opt_int8 = opt_cls(rows, lr=1e-3, backend=backend, state_dtype=torch.int8) \
                if dtype != torch.float64 else None
            for _ in range(3):
                for p in ps + [odd]:
                    p.grad = torch.randn_like(p)
                opt.step()
                for extra in (opt_state, opt_int8):  # the state kernels too
                    if extra is not None:
                        for p in extra.param_groups[0]["params"]:
                            p.grad = torch.randn_like(p)
                        extra.step()
torch.cuda.synchronize()
print("sanitized step ran")
PY
SANITIZER="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
stage memcheck 80 "$SANITIZER" --tool memcheck --error-exitcode 3 python3 "$WORK/sanitize_step.py"
stage missing_grads 40 python3 benchmarks/experiments/missing_grads.py --device cuda --steps 30
stage dtensor_step 30 python3 benchmarks/experiments/dtensor_step.py --device cuda
# The torch.compile'd contenders (the reference, PNM/AdaPNM in foreach ops, torch's SGD/Adam), apart from
# the main tables: compiling takes a while, and a stage cut short writes no table, so one set.
mkdir -p "$WORK/compiled"
stage bench_compiled 120 python3 benchmarks/bench_step.py --device cuda --sets transformer \
  --rounds 5 --compiled --out "$WORK/compiled"
# Unchanged by most commits, so after the new measurements.
stage gpt_fsdp2 100 python3 benchmarks/examples/gpt_fsdp2.py --steps 20 --warmup 3
stage gpt_fsdp2_bf16_state 100 python3 benchmarks/examples/gpt_fsdp2.py --steps 20 --warmup 3 \
  --state-dtype bfloat16
# The step inside backward's memory: peak memory and bytes per parameter beyond the
# activations, the ordinary fused step against bf16 parameters + int8 state + that step.
stage gpt_in_backward 100 python3 benchmarks/examples/gpt_fsdp2.py --steps 20 --warmup 3 \
  --optimizers "AdamW[fused],PNM,AdaPNM" --no-fsdp
stage gpt_in_backward_int8 100 python3 benchmarks/examples/gpt_fsdp2.py --steps 20 --warmup 3 \
  --optimizers "AdamW[fused],PNM,AdaPNM" --param-dtype bfloat16 --state-dtype int8 \
  --step-in-backward --no-fsdp
# The same under FSDP2 (world size 1: its hooks step the shards after each reduce-scatter).
stage gpt_in_backward_fsdp2 100 python3 benchmarks/examples/gpt_fsdp2.py --steps 20 --warmup 3 \
  --optimizers "PNM,AdaPNM" --param-dtype bfloat16 --state-dtype int8 --step-in-backward
# Last, within what is left of the deadline. Its ranking is a hint: a choice is adopted only
# after bench_step.py --triton-configs times it side by side with the shipped table
# (docs/performance.md, Triton launch configurations).
stage tune_triton 120 python3 benchmarks/experiments/tune_triton.py --numels 67108864,268435456 \
  --out "$WORK/tune_triton.json"

echo "== summary"
cat "$WORK/summary.txt"
grep -E "passed|failed" "$WORK/tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$WORK/tests.log" | head -30
for f in "$WORK"/bench_step-cuda-*.md; do
  [ -f "$f" ] && head -1 "$f" && grep -E "\[(fused|triton)\]" "$f" | cut -c1-150
done
grep -E "\[fused\]|torch.compile\]" "$WORK/compiled/bench_step-cuda-float32.md" 2>/dev/null | cut -c1-150
grep -F "[fused" "$WORK/bf16_state/"*.md 2>/dev/null | cut -c1-150
grep -F "int8" "$WORK/int8_state/"*.md 2>/dev/null | cut -c1-150
tail -6 "$WORK/gpt_fsdp2_bf16_state.log" 2>/dev/null
cat "$WORK/chunk_sweep.md" 2>/dev/null
cat "$WORK/launch_params.log" 2>/dev/null
grep -A6 "^best" "$WORK/tune_triton.log" 2>/dev/null
tail -6 "$WORK/gpt_fsdp2.log" 2>/dev/null
tail -6 "$WORK/gpt_in_backward.log" "$WORK/gpt_in_backward_int8.log" \
  "$WORK/gpt_in_backward_fsdp2.log" 2>/dev/null
tail -3 "$WORK/memcheck.log" 2>/dev/null
pack
