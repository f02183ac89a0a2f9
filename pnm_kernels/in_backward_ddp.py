"""The step inside backward under DistributedDataParallel (docs/design.md §9): DDP averages a
bucket's gradients after autograd's hooks have run, so the step cannot run in them; it runs
in DDP's communication hook instead, after the bucket's all-reduce. DDP takes one hook per
model, once, for good: `ReducedBuckets` is that hook, kept on the model, and reduces exactly
as DDP's built-in reduction does, whether or not an optimizer's `ReducedSteps` is attached to
it now (one per optimizer of the model's parameters).

The gradients are left as DDP leaves them (its buckets hold them anyway): what the ordinary
loop's zero_grad and the next backward pass do with them is then unchanged, and with it the
reduction's bits. The parameters stepped inside backward are set aside from step()."""
import weakref

import torch
import torch.distributed as dist

from .fingerprints import fingerprint
from .in_backward_passes import backward_pass
from .params import local


# DDP(static_graph=True) reduces zeros for a parameter no rank used but leaves its gradient
# None; a bucket's step cannot tell those zeros from a gradient.
NOT_GIVEN_BY_DDP = (
    "step_in_backward(ddp=model): {} has no gradient at step(), though DDP reduced a bucket "
    "holding it: DDP(static_graph=True) leaves a parameter no rank's forward used without one "
    "(its bucket holds zeros for it, which the ordinary step skips and a bucket's step cannot "
    "tell from a gradient, as with find_unused_parameters=True), or it was set to None by "
    "hand between backward and step. Nothing was stepped. Freeze a parameter the model does "
    "not use (requires_grad_(False) before wrapping the model in DDP), or use the ordinary "
    "step")


class ReducedBuckets:
    """DDP's communication hook for a model whose optimizer steps inside backward. Hands each
    bucket, with the future of its all-reduce, to the attached `ReducedSteps` (one per
    optimizer), each of which steps its optimizer's parameters in it; with none attached it
    only reduces."""

    def __init__(self, ddp) -> None:
        self.handles: list = []  # the ReducedSteps stepping these buckets
        group = ddp.process_group if ddp.process_group is not None else dist.group.WORLD
        assert group is not None  # DDP was constructed: torch.distributed is initialised
        self._group = group
        self._ddp = weakref.ref(ddp)
        # Where autograd accumulated each gradient this pass: in its bucket view already (DDP
        # then divides it in place) or elsewhere (DDP copies it, times the reciprocal).
        self._accumulated_at: dict = {}
        managed = managed_by(ddp)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated)
                       for p in ddp.module.parameters() if id(p) in managed]

    def _accumulated(self, p) -> None:
        self._accumulated_at[id(p)] = p.grad.data_ptr()

    @staticmethod
    def check(ddp, where: str) -> None:
        """Raises, naming it, if this model's buckets cannot step."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"{where}: ddp must be the torch.nn.parallel.DistributedDataParallel "
                            f"module wrapping the parameters (or a list of them), got "
                            f"{type(ddp).__name__}")
        if getattr(ddp, "find_unused_parameters", False):
            raise RuntimeError(
                f"{where}: DDP(find_unused_parameters=True) is not supported: a bucket holds "
                "zeros for parameters no rank used, which the ordinary step skips (they have "
                "no gradient) and a bucket's step cannot tell from the used ones. Construct "
                "DDP without it, or use the ordinary step")
        for name, p in ddp.module.named_parameters():
            if p.requires_grad and p.is_complex():
                raise RuntimeError(
                    f"{where}: the DDP model's parameter {name!r} is complex, whose gradient a "
                    "communication hook cannot see whole (GradBucket.gradients() gives half "
                    "its real view); use the ordinary step")
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
        """DDP's average of the bucket, handed to the attached handles. The built-in
        reduction's bits: it multiplies a gradient by the reciprocal of the world size as it
        copies it into the bucket, but divides one that already is its bucket view (DDP's
        gradient_as_bucket_view, once a gradient was kept) in place; a hook gets the copies
        undivided, so each gradient is scaled here as DDP would have, then all summed."""
        ddp = self._ddp()
        join = getattr(ddp, "_join_config", None)
        if (join is not None and join.enable
                and not getattr(ddp, "_divide_by_initial_world_size", True)):
            # Raised by every rank (each is in the Join), before any all-reduce.
            raise RuntimeError(
                "step_in_backward(ddp=model) under Join(divide_by_initial_world_size=False): "
                "DDP divides by the ranks not yet joined, which its hook cannot know; use "
                "divide_by_initial_world_size=True, or the ordinary step")
        ranks = self._group.size()
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            if self._accumulated_at.pop(id(p), None) == grad.data_ptr():
                grad.div_(ranks)
            else:
                grad.mul_(1.0 / ranks)
        reduced = dist.all_reduce(bucket.buffer(), group=self._group, async_op=True).get_future()
        for handle in self.handles:
            handle.bucket(bucket, reduced)
        return reduced.then(lambda done: done.value()[0])


class ReducedSteps:
    """One optimizer's side of a DDP model's ReducedBuckets: its parameters in each bucket
    step once the bucket's all-reduce is done, waited for when the next bucket comes (the
    last one in step()), through the handle's ordinary bucket step. The gradients stay: step()
    sets the parameters already stepped aside (their gradients hidden for its ordinary step,
    then put back), so the ordinary step steps only the rest."""

    def __init__(self, handle) -> None:
        self._handle = handle
        self._pending: tuple = ()  # (the optimizer's (param, gradient) pairs, the future)
        self._stepped: dict = {}  # id(p) -> p, stepped inside backward since the last step()
        self._set_aside: list = []  # (p, its gradient) while step() runs
        self._sums: list = []  # the probe's: futures of the averaged gradients' bit sums

    def bucket(self, bucket, reduced) -> None:
        """DDP is all-reducing this bucket (`reduced`: its future)."""
        handle = self._handle
        if backward_pass() == -1:  # a joined rank's shadow all-reduce (Join): no gradient
            return
        mine = [(p, g) for p, g in zip(bucket.parameters(), bucket.gradients())
                if handle.watches(p)]
        # One taken out of the optimizer is whoever steps it now's, as in _ready.
        kept = {id(p) for p in handle.still_stepped([p for p, _ in mine])}
        mine = [(p, g) for p, g in mine if id(p) in kept]
        if not mine:
            return
        handle.pass_came()
        if handle.summing():  # reduced and kept, as the ordinary loop's
            return
        if handle.probing():
            for p, _ in mine:
                handle.record(p, None, None)  # a pass reached it; its bits once reduced:
            self._sums.append(reduced.then(
                lambda _: [(p, fingerprint(g)[1]) for p, g in mine]))
            return
        handle.check_reduced_pass()
        if self._pending:
            self._step(*self._pending)
        self._pending = (mine, reduced)

    def _step(self, mine, reduced) -> None:
        reduced.wait()  # on a GPU: the current stream waits for the all-reduce
        kept = {id(p) for p in self._handle.still_stepped(p for p, _ in mine)}
        mine = [(p, g) for p, g in mine if id(p) in kept]
        swapped = [(p, p.grad) for p, g in mine if not _same_memory(p.grad, g)]
        try:
            for p, g in mine:  # the average: the bucket's (DDP copies it into .grad later)
                p.grad = g
            stepped = self._handle.step_bucket([p for p, _ in mine])
        finally:
            for p, grad in swapped:
                p.grad = grad
        self._stepped.update((id(p), p) for p in stepped)

    def pending(self) -> bool:
        """DDP's last bucket is reduced but not stepped: step() steps it."""
        return bool(self._pending)

    def before_step(self) -> None:
        """step() after a backward pass: its last bucket steps, then what stepped inside
        backward is set aside from the ordinary step."""
        if self._pending:
            pending, self._pending = self._pending, ()
            self._step(*pending)
        stepped, self._stepped = self._stepped, {}
        self._set_aside = [(p, p.grad) for p in stepped.values() if p.grad is not None]
        for p, _ in self._set_aside:
            p.grad = None

    def after_step(self) -> None:
        for p, grad in self._set_aside:
            p.grad = grad
        self._set_aside = []

    def zeroing(self) -> None:
        """zero_grad() before any step(): a pass (failed, or whose step was skipped) leaves
        its last bucket unstepped, as the ordinary loop would; a probe's pass is forgotten."""
        self._pending, self._stepped, self._sums = (), {}, []

    def probed(self) -> None:
        """The probe's step: the bit sums of the averages DDP reduced (which it copies into
        the gradients, bumping their versions) as what the gradients should still hold."""
        sums, self._sums = self._sums, []
        for done in torch.futures.wait_all(sums):
            for p, bits in done:
                self._handle.saw_reduced(p, bits)


def _same_memory(a, b) -> bool:
    return (a is not None and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
            and a.shape == b.shape and a.stride() == b.stride())


def managed_by(ddp) -> set:
    """The ids of the parameters whose gradients this DDP model reduces."""
    ignored = getattr(ddp, "parameters_to_ignore", ()) or ()
    delayed = {id(p) for p in getattr(ddp, "_delay_all_reduce_params", ()) or ()}
    return {id(p) for name, p in ddp.module.named_parameters()
            if p.requires_grad and name not in ignored and id(p) not in delayed}


__all__ = ["NOT_GIVEN_BY_DDP", "ReducedBuckets", "ReducedSteps", "managed_by"]


def refuse_ddp(named_params, ddp_given: bool = False) -> None:
    """Under several ranks a plain-tensor parameter's gradient is this rank's own until DDP
    all-reduces it, after autograd's hooks: stepped in them, each rank would step its own
    gradient (step_in_backward(ddp=model) steps DDP's in its communication hook instead).
    FSDP2's (DTensor) parameters are fine: FSDP2 calls their hooks itself once it has
    reduce-scattered their gradients. `named_params`: (where, parameter) pairs."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    ranks = torch.distributed.get_world_size()
    if ranks == 1:
        return
    for where, p in named_params:
        if local(p) is p and ddp_given:
            raise RuntimeError(
                f"step_in_backward: {where} is a plain tensor that the DDP model given does "
                f"not reduce in its buckets (parameters_to_ignore, delay_all_reduce_named_params,"
                f" or another model's) while torch.distributed runs {ranks} ranks: stepped in "
                "backward, each rank would step its own gradient. Use the ordinary step")
        if local(p) is p:
            raise RuntimeError(
                f"step_in_backward: {where} is a plain tensor while torch.distributed runs "
                f"{ranks} ranks: under DDP its gradient would be stepped before DDP "
                "all-reduces it. Pass the DDP model wrapping it (step_in_backward(ddp=model)), "
                "whose buckets then step once reduced, or use FSDP2 (fully_shard), whose "
                "sharded parameters step in backward")
