"""Whether a gradient or parameter changed between the end of a backward pass and the step,
or a gradient since the probe's step (the probe of the step inside backward, docs/design.md
§9), and the probe's refusals of such changes."""
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


def refuse_changed_at_the_probe(seen: dict, param_bits: dict) -> None:
    """The probe's step: refused where a parameter or its gradient changed between the end of
    backward and the step (`seen`: id -> the parameter, how many passes reached it, its
    gradient then, that gradient's fingerprint; `param_bits`: id -> the parameter's bits),
    which a step inside backward, coming before, could not follow."""
    for p, _, grad, seen_bits in seen.values():
        if not same((None, param_bits.get(id(p))), fingerprint(p.detach())):
            raise RuntimeError(
                "step_in_backward: a parameter (of shape "
                f"{tuple(p.shape)}) was changed in place between backward and step "
                "(weight clipping, `p.clamp_()`, a manual decay), which the ordinary "
                "step would step from but a step inside backward came before: edit "
                "parameters after optimizer.step() (before the next backward), or use "
                "the ordinary step")
        now = p.grad
        if (now is None or (grad is not None and now is not grad)
                or not same(seen_bits, fingerprint(now))):
            raise RuntimeError(
                "step_in_backward: a gradient (of a parameter of shape "
                f"{tuple(p.shape)}) was changed between backward and step (gradient "
                "clipping, unscaling or editing by hand; a post-accumulate-grad hook "
                "registered after step_in_backward(), which runs after its own; or the model "
                "is DDP's, and step_in_backward(ddp=model) was not given it), which a step "
                "inside backward cannot do: it steps each gradient as soon as it is made. "
                "Register such a hook before step_in_backward(), or use the ordinary step")


def added_to_the_probes(kept: dict, p, grad, whose: str = "of the step before") -> str | None:
    """At the first gradient (p's) of the first pass after the probe's step: does the pass add
    to the gradients that step left (`kept`: id -> its parameter, gradient, version; `whose`
    they are, for the message: those held when step_in_backward() was called, at the probe's
    first pass)? Says how, or None. Another parameter's, which this pass has not reached yet,
    is still the tensor left, unwritten since (zeroing in place writes it); with none other,
    p's own was written once since, by autograd's in-place sum (a hook of the user's may have
    written it again)."""
    others = [(q(), g(), version) for key, (q, g, version) in kept.items() if key != id(p)]
    others = [(q, g, version) for q, g, version in others if q is not None and g is not None]
    if others:
        unwritten = [g for q, g, version in others if q.grad is g and g._version == version]
        if not unwritten:
            return None
        if not any(bool(local(g).any()) for g in unwritten):  # read on the way to refusing
            return (f"the gradients {whose} were zeroed where no version counts "
                    "(`p.grad.data.zero_()`: zero with `p.grad.zero_()`), so this pass looks "
                    "like one adding its gradients to them")
        return _ADDED.format(whose)
    if id(p) not in kept:
        return None
    _, g, version = kept[id(p)]
    return _ADDED.format(whose) if g() is grad and grad._version <= version + 1 else None


def any_nonzero(params) -> list:
    """Whether each parameter's gradient holds a nonzero element: read back once a device
    (not a synchronisation a parameter)."""
    by_device: dict = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.grad.device, []).append(i)
    found = [False] * len(params)
    for places in by_device.values():
        flags = torch.stack([params[i].grad.any() for i in places]).tolist()
        for i, flag in zip(places, flags):
            found[i] = flag
    return found


_ADDED = ("this backward pass added its gradients to those {}, as no zero_grad() came "
          "between")

# The probe's first pass added to gradients held when step_in_backward() was called (how).
ADDED_TO_HELD = ("{}: the probe cannot tell the loop's passes a step (nothing was stepped; "
                 "call step_in_backward() right after zero_grad(), or after step() in a loop "
                 "that calls zero_grad() before its next pass)")
