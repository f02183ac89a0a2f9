#!/usr/bin/env bash
# The main job: sets up, then benchmarks PNM/AdaPNM against torch.optim on this machine's
# device (CUDA if present, else CPU), ending in a table and a plot under benchmarks/results/.
# Extra arguments go to bench_step.py (e.g. --quick, --device cpu, --dtype bfloat16).
set -euo pipefail
cd "$(dirname "$0")/.."
bash benchmarks/setup_env.sh
python benchmarks/bench_step.py "$@"
