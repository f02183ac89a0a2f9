#!/usr/bin/env bash
# The benchmark: sets up (skipped in a few seconds when nothing changed), then benchmarks
# PNM/AdaPNM against torch.optim on this machine's device (CUDA if present, else CPU), ending
# in a table, a JSON and a figure under benchmarks/out/ (ignored by git). Under 1.5 minutes
# on an idle 2-core CPU once set up. Extra arguments go to bench_step.py: e.g. --quick (two
# sets on a CPU, three on a GPU), --compiled (adds the torch.compile'd contenders: minutes more), --dtype bfloat16,
# --device cpu, --out DIR; --help lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash benchmarks/setup_env.sh
echo "run.sh: set-up done in ${SECONDS} s; benchmarking (python benchmarks/bench_step.py $*)"
start=$SECONDS
python benchmarks/bench_step.py "$@"
echo "run.sh: benchmark $((SECONDS - start)) s, in all ${SECONDS} s"
