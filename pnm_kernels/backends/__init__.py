"""The step implementations behind ``backend=``, each one a Backend (base.py) called the same
way: ``step(batch, hyper, scaling)``, and for those that hold lists, ``prepare_repeat``."""
from typing import Optional

import torch

from .._ops import extension_error
from . import fused, triton
from .base import Backend, capturing
from .foreach import ForeachBackend
from .fused import FusedBackend
from .reference import ReferenceBackend
from .triton import TritonBackend

# Every backend object by its name (the public pnm_kernels.BACKENDS: the names, "auto" too).
REGISTRY: dict[str, Backend] = {b.name: b for b in (
    ReferenceBackend(), ForeachBackend(), FusedBackend(), TritonBackend())}

# Parameter dtypes (complex ones go in as real views): the reference and foreach ops and the
# fused kernels take all four, the Triton kernels no float64.
REFERENCE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FUSED_DTYPES = fused.DTYPES
TRITON_DTYPES = triton.DTYPES

fused_unavailable_reason = fused.unavailable_reason
triton_unavailable_reason = triton.unavailable_reason


# "auto": the fused kernels wherever they run (float32, float64, float16 and bfloat16 on CPU
# and CUDA), else on CUDA the Triton step (an install without the extension's CUDA kernels;
# not float64), else foreach ops (other devices, an install without the extension). On an
# H200 the fused step took the Triton step's time within 0.5 % on every fp32 set from 2^26
# elements and less below, spends less host time a step, repeats where a parameter with state
# lacks a gradient, and runs inside any CUDA-graph capture (docs/performance.md, "auto").
def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype,
                    compressed: bool = False, int8: bool = False) -> str:
    """The backend that runs a batch: the one asked for, or for "auto" the fastest available
    as measured (see above). `compressed`: the step runs in float32 with its own rounding
    (state_dtype, bf16_stochastic_round); `int8`: int8 state. Every backend keeps both;
    "auto" picks as for other state. Raises RuntimeError/ValueError saying why a requested
    backend cannot run."""
    if (compressed or int8) and requested in ("auto", "fused", "triton"):
        fused_reason = fused_unavailable_reason(device, dtype, True, int8=int8)
        if requested == "auto":
            if fused_reason is None:
                return "fused"
            if device.type == "cuda" and triton_unavailable_reason(device, dtype) is None:
                return "triton"
            return resolve_backend("foreach", device, dtype)
        reason = fused_reason if requested == "fused" else triton_unavailable_reason(device, dtype)
        if reason is not None:
            what = "int8 state (state_dtype=torch.int8)" if int8 else \
                "state in a dtype of its own (state_dtype, bf16_stochastic_round)"
            raise RuntimeError(f"backend={requested!r} cannot keep {what} for {dtype} tensors "
                               f"on {device}: {reason}; use backend='auto' or 'foreach'")
        return requested
    if requested in ("reference", "foreach"):
        if dtype not in REFERENCE_DTYPES:
            raise ValueError(f"unsupported parameter dtype {dtype}")
        return requested
    if requested == "fused":
        reason = fused_unavailable_reason(device, dtype, compressed)
    elif requested == "triton":
        reason = triton_unavailable_reason(device, dtype)
    else:  # auto: see above
        if fused_unavailable_reason(device, dtype) is None:
            return "fused"
        if device.type == "cuda" and triton_unavailable_reason(device, dtype) is None:
            return "triton"
        return resolve_backend("foreach", device, dtype)
    if reason is not None:
        raise RuntimeError(f"backend={requested!r} is unavailable for {dtype} tensors on "
                           f"{device}: {reason}")
    return requested


def traceable(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that runs a batch under torch.compile. Dynamo cannot trace the Triton
    step (its kernels read pointer tables): the same maths over the same state runs traced
    in the fused kernels, or in foreach ops without the extension (a Triton-only install).
    Decided where dynamo does not trace (the optimizer's _init_group)."""
    if backend == "triton":
        return "fused" if fused_unavailable_reason(device, dtype) is None else "foreach"
    return backend


def check_capturable(backend: str, device: torch.device) -> None:
    """Refuses, before anything is touched, an eager step that a CUDA-graph capture would
    break halfway (as torch's optimizers refuse one without capturable=True)."""
    if REGISTRY[backend].reads_host and capturing(device):
        raise RuntimeError(
            f"pnm_kernels: backend='{backend}' reads each parameter's step count on the host, "
            "which a CUDA graph capture cannot record; capture the step with backend='fused' "
            "or 'triton' (what 'auto' picks on CUDA where the extension is built), or "
            "compile it (torch.compile traces the foreach step without host reads)")


def native_grad_check() -> Optional[object]:
    """The C++ check of a batch's gradients (index of the first that is not a dense tensor of
    its parameter's shape, dtype and device, else -1); None without the extension."""
    if extension_error() is not None:
        return None
    return torch.ops.pnm_kernels._first_mismatched_grad
