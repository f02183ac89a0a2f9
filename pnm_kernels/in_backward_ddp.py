"""The step inside backward under DistributedDataParallel (docs/design.md §9): DDP averages a
bucket's gradients after autograd's hooks have run, so the step cannot run in them; it runs
in DDP's communication hook instead, after the bucket's all-reduce. DDP takes one hook per
model, once, for good: `ReducedBuckets` is that hook, kept on the model, and reduces exactly
as DDP's built-in reduction does (each gradient times 1 / world size, then summed: the same
bits), whether or not a StepInBackward handle is attached to it now (one per optimizer of
the model's parameters)."""
import torch
import torch.distributed as dist


class ReducedBuckets:
    """DDP's communication hook for a model whose optimizer steps inside backward. Hands each
    bucket, with the future of its all-reduce, to the attached handles (`StepInBackward`),
    each of which steps its optimizer's parameters in it; with none attached it only
    reduces."""

    def __init__(self, ddp) -> None:
        self.handles: list = []  # the StepInBackward handles stepping these buckets
        group = ddp.process_group if ddp.process_group is not None else dist.group.WORLD
        assert group is not None  # DDP was constructed: torch.distributed is initialised
        self._group = group

    @staticmethod
    def check(ddp, where: str) -> None:
        """Raises, naming it, if this model's buckets cannot step."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"{where}: ddp must be the torch.nn.parallel.DistributedDataParallel "
                            f"module wrapping the parameters, got {type(ddp).__name__}")
        if getattr(ddp, "find_unused_parameters", False):
            raise RuntimeError(
                f"{where}: DDP(find_unused_parameters=True) is not supported: a bucket holds "
                "zeros for parameters no rank used, which the ordinary step skips (they have "
                "no gradient) and a bucket's step cannot tell from the used ones. Construct "
                "DDP without it, or use the ordinary step")
        hook = getattr(ddp, "_pnm_reduced_buckets", None)
        if hook is None and getattr(ddp, "_comm_hooks", None):
            raise RuntimeError(
                f"{where}: this DDP model already has a communication hook, and DDP takes one, "
                "once: the step in backward needs its own (which reduces as DDP's built-in "
                "all-reduce does)")

    @classmethod
    def of(cls, ddp, where: str) -> "ReducedBuckets":
        """The hook of this DistributedDataParallel model (checked), registered on first use."""
        cls.check(ddp, where)
        hook = getattr(ddp, "_pnm_reduced_buckets", None)
        if hook is None:
            hook = cls(ddp)
            try:  # a bound method: DDP logs the hook's __qualname__
                ddp.register_comm_hook(None, hook.reduce)
            except RuntimeError as e:
                raise RuntimeError(
                    f"{where}: this DDP model already has a communication hook (DDP takes one, "
                    f"once), and the step in backward needs its own: {e}") from None
            ddp._pnm_reduced_buckets = hook
        return hook

    def reduce(self, state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's average of the bucket (the built-in reduction's bits: times the reciprocal of
        the world size, then an all-reduce sum), handed to the attached handle."""
        buffer = bucket.buffer()
        buffer.mul_(1.0 / self._group.size())
        reduced = dist.all_reduce(buffer, group=self._group, async_op=True).get_future()
        for handle in self.handles:
            handle.bucket_reducing(bucket, reduced)
        return reduced.then(lambda done: done.value()[0])


def managed_by(ddp) -> set:
    """The ids of the parameters whose gradients this DDP model reduces."""
    ignored = getattr(ddp, "parameters_to_ignore", ()) or ()
    return {id(p) for name, p in ddp.module.named_parameters()
            if p.requires_grad and name not in ignored}


__all__ = ["ReducedBuckets", "managed_by"]
