"""Whether a gradient changed between the end of a backward pass and the step (the probe of
the step inside backward, docs/design.md §9)."""
import torch

from .params import local


def fingerprint(grad):
    """What tells whether a gradient changed: its version counter and the sum of its bit
    patterns. The bits, because in-place foreach ops on a DTensor, as clip_grad_norm_ runs
    them under FSDP2, bump no counter; not the local shard's counter, which FSDP2's shards
    share with the other views of one reduce-scatter's output (accumulating into the next
    parameter's bumps it). The sum is None for a layout without bits."""
    data = local(grad)
    if data.layout != torch.strided or data.device.type == "meta":
        return grad._version, None
    if data.is_complex():
        data = torch.view_as_real(data)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[data.element_size()]
    return grad._version, data.view(as_int).sum(dtype=torch.int64)


def same(a, b) -> bool:
    """Fingerprints alike; a version of None (DDP's averages, which DDP copies into the
    gradient after the probe saw them) compares the bits alone."""
    if a is None:  # nothing was seen to compare with
        return True
    return (a[0] is None or a[0] == b[0]) and (a[1] is None or torch.equal(a[1], b[1]))
