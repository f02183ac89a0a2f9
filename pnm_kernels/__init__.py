"""Fused CUDA, Triton and CPU kernels for the Positive-Negative Momentum optimizers
(PNM and AdaPNM, Xie et al., ICML 2021)."""
import torch

from . import _ops  # noqa: F401  (loads the compiled extension when it is built)
from .backends import resolve_backend
from .in_backward_owners import stepping_in_backward
from .optimizers import BACKENDS, PNM, AdaPNM

__all__ = ["PNM", "AdaPNM", "BACKENDS", "available_backends", "stepping_in_backward"]
__version__ = "0.1.0"


def available_backends(device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None) -> list[str]:
    """The backends that can run tensors of ``dtype`` (default float32) on ``device``."""
    device, dtype = torch.device(device), dtype or torch.float32
    found = []
    for name in BACKENDS[1:]:
        try:
            resolve_backend(name, device, dtype)
            found.append(name)
        except (RuntimeError, ValueError):
            pass
    return found
