"""Builds pnm_kernels._C: fused CPU kernels (g++) and CUDA kernels (nvcc).

Environment:
  PNM_KERNELS_NO_CUDA=1   build without the CUDA sources (no nvcc needed); automatic where
                          nvcc is absent or torch is a CPU-only build
  TORCH_CUDA_ARCH_LIST    CUDA architectures (default "8.0;9.0+PTX")
  MAX_JOBS                parallel compile jobs (default: 2)
Install with `pip install --no-build-isolation [-e] .` so the build uses the installed torch
(why: pyproject.toml); without torch in sight it stops at once and says so.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup

# torch derives CUDA_HOME from the nvcc on PATH; where that is a wrapper outside the toolkit
# (as /usr/local/bin/nvcc is on our machines) the toolkit's libraries would not be found.
if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

try:
    import torch
except ModuleNotFoundError:  # pip's default, isolated build: a fresh environment without torch
    raise SystemExit("pnm_kernels builds against your installed torch, which this isolated build "
                     "cannot see: install torch first, then run `pip install --no-build-isolation .` "
                     "(or `pip install --no-build-isolation -e .`, or "
                     "`python -m build --wheel --no-isolation`).") from None
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

os.environ.setdefault("MAX_JOBS", "2")
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")

# CUDA kernels need nvcc and a CUDA build of torch (a CPU-only torch has no CUDA libraries to
# link against, and cpp_extension then refuses a CUDAExtension even with nvcc on PATH).
with_cuda = (
    os.environ.get("PNM_KERNELS_NO_CUDA", "0") != "1"
    and torch.version.cuda is not None
    and (shutil.which("nvcc") is not None or bool(os.environ.get("CUDA_HOME")))
)

# No contraction into FMA: the CPU kernel is bitwise equal to the emulated CUDA block body
# (AVX-512 targets enable FMA in GCC, which would contract by default). No trapping maths:
# the kernels read no floating-point exception flags, and without it GCC would not turn the
# int8 kernel's comparisons into vector selects (values unchanged either way).
cxx_flags = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp"]


def torch_libstdcxx():
    """The shared libstdc++ this process (torch) has loaded, as a path; None if not found."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


# The C++ runtime must be torch's own shared libstdc++: a compiler that finds only a static
# libstdc++.a (as the GPU image's /opt/gcc/bin/g++ did, even asked for -lstdc++ -Bdynamic)
# gives the extension a private copy whose locale facets clash with torch's, and formatting
# an error message then crashes.
# Naming the loaded library by its path, before anything the driver appends, binds every
# C++ runtime symbol to it; `-lstdc++` would pick whichever libstdc++ the compiler finds.
libstdcxx = torch_libstdcxx() or "-lstdc++"
link_flags = ["-fopenmp", "-Wl,--push-state,--no-as-needed", libstdcxx, "-Wl,--pop-state"]
# The C++ sources, CPU-only and CUDA builds alike. All take cxx_flags: -ffp-contract=off must
# hold wherever element maths is compiled (the cpu_*kernel.cpp files, emulated_cuda.cpp).
sources = [
    "csrc/ops.cpp",  # schemas, registration, test hooks, PyInit__C
    "csrc/step_call.cpp",  # argument checks, kernel arguments
    "csrc/step_lists.cpp",  # the StepLists custom class
    "csrc/written_memory.cpp",  # the WrittenMemory custom class
    "csrc/traced_checks.cpp",  # the checks inside a torch.compile'd step
    "csrc/cpu_kernel.cpp",  # the fused CPU kernel
    "csrc/cpu_state_kernel.cpp",  # the same with state in a dtype of its own
    "csrc/cpu_int8_kernel.cpp",  # the same with int8 state
    "csrc/emulated_cuda.cpp",  # the CUDA kernels' code on the host
]
# Headers: rebuild when they change (MANIFEST.in puts them in the sdist).
headers = sorted(glob.glob("csrc/*.h"))
if with_cuda:
    sources.append("csrc/pnm_cuda.cu")
    extension = CUDAExtension(
        "pnm_kernels._C",
        sources,
        extra_compile_args={
            "cxx": cxx_flags,
            # Kernel arguments above 4 KiB (our launch tables) need CUDA >= 12.1.
            "nvcc": ["-O3", "--expt-relaxed-constexpr", "-lineinfo"],
        },
        extra_link_args=link_flags,
        depends=headers,
    )
else:
    extension = CppExtension(
        "pnm_kernels._C",
        sources,
        extra_compile_args=cxx_flags,
        extra_link_args=link_flags,
        depends=headers,
    )

setup(
    name="pnm_kernels",
    version="0.1.0",
    description="Fused CUDA/Triton/CPU kernels for the Positive-Negative Momentum optimizers",
    packages=find_packages(include=["pnm_kernels", "pnm_kernels.*"]),
    package_data={"pnm_kernels": ["py.typed"]},  # typed: type checkers read its hints
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=["torch>=2.6"],  # see docs/testing.md, "Versions"
)
