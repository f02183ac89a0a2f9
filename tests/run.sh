#!/usr/bin/env bash
# Sets up (dependencies, build of the extension) and runs the test suite. Extra arguments go
# to pytest. Without a GPU the CUDA kernels run through their CPU emulation and the Triton
# kernels under TRITON_INTERPRET=1; GPU-only tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash benchmarks/setup_env.sh
python -m pytest tests -q "$@"
