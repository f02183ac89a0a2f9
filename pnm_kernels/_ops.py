"""Loads the compiled extension and gives its ops fake (meta) implementations, so they trace
under torch.compile and pass torch.library.opcheck (the ops mutate their inputs in place and
return nothing, so the fakes only have to accept the arguments); the CPU kernel's
instruction set (chosen at import: `set_cpu_isa`), the CUDA kernels' chunk size and the test
hooks that lower the launch limits."""
from typing import Optional

import torch

_EXTENSION_ERROR: Optional[str] = None
try:
    from . import _C  # type: ignore[attr-defined]  # noqa: F401  (registers the ops)
except ImportError as e:  # a Triton-only or pure-Python install is legitimate
    _EXTENSION_ERROR = str(e)


def extension_error() -> Optional[str]:
    """None when pnm_kernels._C is loaded, else why it is not."""
    return _EXTENSION_ERROR


def _fake_step(*args, **kwargs) -> None:
    return None


if _EXTENSION_ERROR is None:
    for _name in ("pnm_step_", "adapnm_step_", "emulated_cuda_pnm_step_",
                  "emulated_cuda_adapnm_step_", "pnm_state_step_", "adapnm_state_step_",
                  "emulated_cuda_pnm_state_step_", "emulated_cuda_adapnm_state_step_",
                  "pnm_int8_step_", "adapnm_int8_step_", "emulated_cuda_pnm_int8_step_",
                  "emulated_cuda_adapnm_int8_step_", "check_step_counts",
                  "check_traced_tensors"):
        torch.library.register_fake(f"pnm_kernels::{_name}")(_fake_step)

# Every dtype's code as the compiled step's check of layouts (traced.py) carries it: c10's
# numbering where the C++ check reads it, else the Python check's own.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
DTYPE_CODES: dict = {
    dtype: (torch.ops.pnm_kernels._dtype_code(dtype) if _EXTENSION_ERROR is None else code)
    for code, dtype in enumerate(_DTYPES)}


def cuda_chunk_size(dtype: torch.dtype) -> int:
    """Elements each block of the fused CUDA step updates for parameters of this dtype
    (csrc/multi_tensor_apply.h's default_chunk_size; a test checks the two agree). A step
    that fits one launch only with 16,384-element chunks takes those (step_chunk_size)."""
    return 4096 if dtype.itemsize >= 4 else 16384


def set_launch_limits(chunk_size: int = 0, max_tensors: int = 0, max_blocks: int = 0,
                      max_single_launch_blocks: int = 0) -> None:
    """Test hook for the CUDA launch planner (and its CPU emulation): smaller chunks and
    launch tables make chunk and launch boundaries reachable with small tensors, and
    max_single_launch_blocks caps the steps run as one launch (by default the GPU's SM count,
    and no cap in the emulation). Zeros restore the defaults."""
    torch.ops.pnm_kernels._set_launch_limits(chunk_size, max_tensors, max_blocks,
                                             max_single_launch_blocks)


def cpu_isas() -> list:
    """The instruction sets the fused CPU kernel can run with on this CPU, best last."""
    return list(torch.ops.pnm_kernels._cpu_isas())


def cpu_isa() -> str:
    """The instruction set the fused CPU kernel runs with now."""
    return torch.ops.pnm_kernels._cpu_isa()


def default_cpu_isa() -> str:
    """The level torch's own CPU kernels run at (torch.backends.cpu.get_cpu_capability(), which
    the ATEN_CPU_CAPABILITY environment variable caps), within what this CPU and build have."""
    # "NO AVX": how torch 2.6 names the baseline level.
    levels = {"DEFAULT": "baseline", "NO AVX": "baseline", "AVX2": "avx2"}
    wanted = levels.get(torch.backends.cpu.get_cpu_capability())
    have = cpu_isas()
    return wanted if wanted is not None and wanted in have else have[-1]


def set_cpu_isa(isa: Optional[str] = None) -> str:
    """Runs the fused CPU kernel with "baseline" (SSE2), "avx2" or "avx512" (a test and
    benchmark hook); None restores default_cpu_isa(). Returns the one now active."""
    return torch.ops.pnm_kernels._set_cpu_isa(default_cpu_isa() if isa is None else isa)


if _EXTENSION_ERROR is None:
    set_cpu_isa()
