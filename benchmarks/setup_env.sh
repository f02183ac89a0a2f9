#!/usr/bin/env bash
# Installs what the package, its tests and benchmarks need, then builds and installs the
# package with its compiled extension (pnm_kernels._C). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q torch==2.14.1   # a CUDA 13.0 build, with triton
fi
python -m pip install -q ninja pybind11 pytest pytest-benchmark numpy matplotlib scikit-learn
# --no-build-isolation: build against the torch installed above, not a downloaded one.
# --use-pep517: where `wheel` is installed, pip would otherwise run `setup.py develop`, which
# newer setuptools hands back to pip *with* build isolation (no torch there: the build fails).
MAX_JOBS="${MAX_JOBS:-2}" python -m pip install -q --no-build-isolation --use-pep517 -e .
python -c "import pnm_kernels; print('pnm_kernels', pnm_kernels.__version__, 'backends on cpu:', pnm_kernels.available_backends('cpu'))"
