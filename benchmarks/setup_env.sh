#!/usr/bin/env bash
# Installs what the package, its tests and benchmarks need, then builds and installs the
# package with its compiled extension (pnm_kernels._C) in editable mode. Safe to run again:
# when nothing the build reads has changed since the last set-up of this checkout (setup.py,
# pyproject.toml, MANIFEST.in, csrc/, the interpreter, torch's version, the build switches),
# the extension imports and the dependencies are there, it skips pip in a few seconds; the
# stamp is build/setup_env.stamp (ignored by git; delete it, or SETUP_ENV_FORCE=1, to redo).
#   --dry-run   say whether it would install and build, and do nothing
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
STAMP=build/setup_env.stamp

# Prints the fingerprint of what the build depends on, if this checkout is set up with it
# (pnm_kernels._C imports from this checkout with this torch, the dependencies are found);
# prints nothing otherwise. One interpreter start: about 2 s, most of it importing torch.
fingerprint() {
  python - 2>/dev/null <<'EOF' || true
import hashlib, importlib.util, os, sys
h = hashlib.sha256()
files = ["setup.py", "pyproject.toml", "MANIFEST.in"] + sorted(
    os.path.join(d, f) for d, _, names in os.walk("csrc") for f in names)
for name in files:
    if os.path.isfile(name):
        with open(name, "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
for var in ("PNM_KERNELS_NO_CUDA", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME"):
    h.update(f"{var}={os.environ.get(var, '')}\0".encode())
import torch
h.update(f"{sys.executable}\0{torch.__version__}".encode())
if any(importlib.util.find_spec(m) is None for m in
       ("ninja", "pybind11", "pytest", "pytest_benchmark", "numpy", "matplotlib", "sklearn")):
    sys.exit(1)
import pnm_kernels._C  # noqa: F401  (built, and loads with this torch)
if os.path.dirname(os.path.abspath(pnm_kernels.__file__)) != os.path.abspath("pnm_kernels"):
    sys.exit(1)  # another checkout's package
print(h.hexdigest())
EOF
}

# The CUDA kernels serve only a machine with a GPU; nvcc compiling them for two architectures
# is most of the build (tests/test_cuda_ptx.py still compiles them for sm_90 where nvcc is).
# PNM_KERNELS_NO_CUDA=0 builds them anyway. Decided before the stamp is compared (the
# fingerprint includes the switch) and again once torch is installed.
cuda_switch() {
  if [ -z "${PNM_KERNELS_NO_CUDA:-}" ] && \
     [ "$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)" = 0 ]; then
    export PNM_KERNELS_NO_CUDA=1
  fi
}
cuda_switch

if [ "${SETUP_ENV_FORCE:-0}" != 1 ] && [ -f "$STAMP" ]; then
  now="$(fingerprint)"
  if [ -n "$now" ] && [ "$now" = "$(cat "$STAMP")" ]; then
    echo "setup_env.sh: nothing changed since the last set-up ($STAMP): install and build skipped"
    exit 0
  fi
fi
if [ "$DRY_RUN" = 1 ]; then
  echo "setup_env.sh: would install the dependencies and build pnm_kernels._C"
  exit 0
fi
if ! python -c "import torch" 2>/dev/null; then
  echo "setup_env.sh: installing torch 2.14.1 (a CUDA 13.0 build with triton: a download of some GB)"
  python -m pip install -q torch==2.14.1
fi
cuda_switch
[ "${PNM_KERNELS_NO_CUDA:-}" = 1 ] && \
  echo "setup_env.sh: no GPU visible: building without the CUDA kernels (PNM_KERNELS_NO_CUDA=0 builds them)"
echo "setup_env.sh: installing the test and benchmark dependencies"
python -m pip install -q ninja pybind11 pytest pytest-benchmark numpy matplotlib scikit-learn
# --no-build-isolation: build against the torch installed above, not a downloaded one
# (pyproject.toml says why).
echo "setup_env.sh: building pnm_kernels._C against torch $(python -c 'import torch; print(torch.__version__)')" \
     "(about a minute on 2 cores; more with CUDA)"
MAX_JOBS="${MAX_JOBS:-2}" python -m pip install -q --no-build-isolation -e .
python -c "import pnm_kernels; print('pnm_kernels', pnm_kernels.__version__, 'backends on cpu:', pnm_kernels.available_backends('cpu'))"
mkdir -p build
fp="$(fingerprint)"
if [ -n "$fp" ]; then
  echo "$fp" > "$STAMP"
else
  rm -f "$STAMP"  # set up, yet the check fails (e.g. the extension does not import): redo next time
fi
