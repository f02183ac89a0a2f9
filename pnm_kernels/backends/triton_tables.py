"""The device tables that Triton programs read (tensor addresses, sizes, chunk maps), shared by
triton.py and triton_state.py: built on the host, copied to the device once, and cached under
everything they were built from, so a step over the same tensors copies nothing."""
from collections import OrderedDict

import torch

from .base import capturing

_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_CACHE_SIZE = 16


def refuse_in_capture(device) -> None:
    """Tables cannot be copied to the GPU inside a CUDA graph capture."""
    if capturing(device):
        raise RuntimeError(
            "pnm_kernels (backend='triton'): the step's tensors are at addresses not seen "
            "before the CUDA graph capture, and their tables cannot be copied to the GPU "
            "inside a capture. Keep gradients between steps (zero_grad(set_to_none=False)) "
            "so the warm-up steps build the tables, or use backend='fused', whose tables "
            "travel as kernel arguments.")


def cached(key: tuple, device, build):
    """The tables under `key` (which names everything `build` reads), built on a miss."""
    try:  # one call each: an optimizer stepping in another thread may evict the key
        _CACHE.move_to_end(key)
        return _CACHE[key]
    except KeyError:
        pass
    refuse_in_capture(device)
    tables = _CACHE[key] = build()
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return tables


def as_device(values, dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device)


def chunk_map(counts, chunk):
    """(tensor, start) of every chunk of `chunk` units of tensors of these sizes: the chunk a
    program steps."""
    tensor, start = [], []
    for i, n in enumerate(counts):
        for s in range(0, n, chunk):
            tensor.append(i)
            start.append(s)
    return tensor, start
