export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; W=$OUT/r; mkdir -p $W; S=$SECONDS
st(){ n=$1; l=$2; shift 2; timeout -k 5 $l "$@" > $W/$n.log 2>&1; echo "$n: exit $? after $((SECONDS-S)) s" | tee -a $W/summary.txt; tar czf $OUT/run4.tgz -C $W .; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)"; echo "command: this session's second device call (see summary.txt)"; } > $W/versions.txt 2>&1
st build 100 env TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 setup.py build_ext --inplace
st tests 75 python3 -m pytest tests -q -rfE --tb=short -k triton -n 8 -p no:cacheprovider
tail -2 $W/tests.log
st tune 100 python3 benchmarks/tune_triton.py --numels 67108864,268435456 --out $W/tune_triton.json
grep -A5 ^best $W/tune.log
T=(); [ -s $W/tune_triton.json ] && T=(--triton-configs $W/tune_triton.json)
st bench_bf16 45 python3 benchmarks/bench_step.py --device cuda --dtype bfloat16 --sets transformer,flat64M,flat256M,flat1024M --rounds 9 --no-compiled-reference "${T[@]}" --out $W
st bench_fp32 35 python3 benchmarks/bench_step.py --device cuda --sets transformer,flat64M,flat256M --rounds 9 --no-compiled-reference "${T[@]}" --out $W
grep -hE "Device|Triton launch|\[(fused|triton)\]" $W/bench_step-cuda-*.md | cut -c1-120
