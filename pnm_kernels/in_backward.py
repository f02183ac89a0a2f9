"""The step inside the backward pass (docs/design.md §9): each gradient is consumed as soon as
autograd has accumulated it, and freed, so that a model never holds all its gradients at
once. Parameters whose gradients are ready are stepped together, a bucket of about
`bucket_mib` at a time, by the ordinary fused multi-tensor step (not one launch per
parameter), so the result is the ordinary step's: bitwise on the fused backends.

What cannot be applied to gradients that are already gone is found out before anything is
stepped inside backward: the first step after `step_in_backward` that follows a backward
pass is an ordinary one (a probe), and the training loop around it shows whether it scales
the loss (GradScaler), changes the gradients between backward and step (clipping, unscaling
by hand) or runs several backward passes a step (accumulation: `handle.accumulating()` says
so). Each of those is refused then, before any parameter moved, naming it.

Under DDP a gradient is averaged over the ranks only after autograd's hooks: DDP's parameters
step in its communication hook instead (in_backward_ddp.py), a bucket once its all-reduce is
done (waited for when the next bucket is reduced, or at the end of the backward pass), and
their gradients are dropped at the end of the backward pass, after DDP has written them."""
import contextlib
import weakref

import torch

from .in_backward_ddp import ReducedBuckets, managed_by
from .params import local


class StepInBackward:
    """The handle `optimizer.step_in_backward()` returns: `remove()` (or leaving its `with`
    block) restores the ordinary step; `accumulating()` marks backward passes whose
    gradients are to be summed, not stepped."""

    def __init__(self, optimizer, bucket_mib: float, ddp=None) -> None:
        if not (isinstance(bucket_mib, (int, float)) and bucket_mib > 0):
            raise ValueError(f"step_in_backward: bucket_mib must be a positive number of MiB, "
                             f"got {bucket_mib!r}")
        if getattr(optimizer, "_in_backward", None) is not None:
            raise RuntimeError("step_in_backward: this optimizer already steps inside backward "
                               "(remove() its handle first)")
        if ddp is not None:
            ReducedBuckets.check(ddp, "step_in_backward")
        self._reduced_here = managed_by(ddp) if ddp is not None else set()
        self.refuse_unreduced((f"param_groups[{gi}]['params'][{pi}]", p)
                              for gi, group in enumerate(optimizer.param_groups)
                              for pi, p in enumerate(group["params"]))
        # DDP's parameters step in its communication hook (registered now, kept on the model).
        self._reduced = ReducedBuckets.of(ddp, "step_in_backward") if ddp is not None else None
        self._optimizer = optimizer
        self._bucket_bytes = bucket_mib * 2**20
        self._probing = True  # the first step is an ordinary one (see the module's docstring)
        self._accumulating = 0
        self._pending: list = []
        self._pending_bytes = 0
        self._flush_queued = False
        self._pass = None  # the backward pass (graph task) whose end will flush the bucket
        self._seen: dict = {}  # probe: id(p) -> (p, passes, gradient, its _fingerprint)
        # zero_grad(set_to_none=False) keeps a zero gradient for every parameter that ever had
        # one, and the ordinary step steps it: the parameters ever stepped, and those since the
        # last step(), to step the others with zeros as it would.
        self._zero_filled = False
        self._ever: dict = {}
        self._since_step: set = set()
        self._hooks: list = []
        # DDP's buckets: the last one reduced, stepped once the next is (or at the pass's end),
        # and the parameters stepped in this pass, whose gradients DDP writes at its end.
        self._watched: dict = {}  # id(p) -> weakref(p): the parameters hooked (or DDP's)
        self._reduced_pending: tuple = ()
        self._reduced_stepped: list = []
        self._probed: list = []  # the probe's DDP parameters reduced in this pass
        self._queued: dict = {}  # callback name -> the backward pass it was queued in
        self.watch(p for group in optimizer.param_groups for p in group["params"])
        if self._reduced is not None:
            self._reduced.handles.append(self)
        optimizer._in_backward = self

    def watch(self, params) -> None:
        """Hooks on these parameters (those requiring gradients: autograd hooks no other; DDP's
        step in its communication hook); optimizer.add_param_group calls it for the parameters
        it adds."""
        new = [p for p in params if not self._is_watched(p)]  # moved between groups: once
        self._watched.update((id(p), weakref.ref(p)) for p in new)
        self._hooks += [p.register_post_accumulate_grad_hook(self._ready)
                        for p in new if p.requires_grad and id(p) not in self._reduced_here]

    def _is_watched(self, p) -> bool:
        ref = self._watched.get(id(p))
        return ref is not None and ref() is p

    def _still_stepped(self, params) -> list:
        """Those of params that are still the optimizer's: one taken out of its groups
        keeps its hook (autograd's cannot be removed one by one) but neither steps here nor
        loses its gradient, which is left to whoever steps it now."""
        owned = {id(p) for group in self._optimizer.param_groups for p in group["params"]}
        return [p for p in params if id(p) in owned]

    def refuse_unreduced(self, named_params) -> None:
        """Refuses, naming it, a plain-tensor parameter that several ranks would step before
        reducing its gradient: one that no DDP model given to step_in_backward reduces."""
        refuse_ddp((where, p) for where, p in named_params if id(p) not in self._reduced_here)

    # -- the user's side -------------------------------------------------------------------

    def remove(self) -> None:
        """The ordinary step again (gradients kept until optimizer.step())."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._pending = []
        self._reduced_pending, self._reduced_stepped, self._probed = (), [], []
        if self._reduced is not None and self in self._reduced.handles:
            self._reduced.handles.remove(self)  # DDP keeps the hook, which only reduces now
        if getattr(self._optimizer, "_in_backward", None) is self:
            self._optimizer._in_backward = None

    def __enter__(self) -> "StepInBackward":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    @contextlib.contextmanager
    def accumulating(self):
        """Backward passes inside this block sum their gradients and step nothing; the next
        backward pass outside it steps the sums (gradient accumulation over micro-batches)."""
        self._accumulating += 1
        try:
            yield self
        finally:
            self._accumulating -= 1

    # -- autograd's side -------------------------------------------------------------------

    def _ready(self, p: torch.Tensor) -> None:
        grad = p.grad
        if self._accumulating or grad is None:
            return
        if self._probing:
            self._record(p)
            return
        this_pass = _backward_pass()
        if self._flush_queued and this_pass != self._pass:
            # The pass that queued the flush failed (autograd dropped its callback): what it
            # left pending is not stepped, as the ordinary loop skips the step of a failed
            # backward (its gradients are the user's zero_grad's to clear).
            self._pending, self._pending_bytes, self._flush_queued = [], 0, False
        self._pending.append(p)
        self._pending_bytes += local(grad).numel() * grad.element_size()  # a shard's own
        if not self._flush_queued:  # the rest once the whole backward pass is done
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            self._flush_queued = True
            self._pass = this_pass
        if self._pending_bytes >= self._bucket_bytes:
            self._step_pending()

    def _flush(self) -> None:
        self._flush_queued = False
        self._step_pending()

    def _step_pending(self) -> None:
        params, self._pending, self._pending_bytes = self._pending, [], 0
        self._step_and_free(params)

    def _step_and_free(self, params, free: bool = True) -> list:
        """Steps those of params still the optimizer's and frees their gradients (with free);
        returns them."""
        params = self._still_stepped(params)
        if params:
            self._optimizer._step_only(params)
        for p in params:
            if free:
                p.grad = None
            self._ever[id(p)] = p
            self._since_step.add(id(p))
        return params

    def _record(self, p) -> None:
        """The probe saw p's gradient made: how often before the step, and what it was."""
        _, passes, _, _ = self._seen.get(id(p), (p, 0, None, None))
        self._seen[id(p)] = (p, passes + 1, p.grad, _fingerprint(p.grad))

    def _at_end_of_pass(self, name: str, callback) -> bool:
        """Queues callback for the end of this backward pass, after DDP's own end-of-backward
        callback (which writes the averaged gradients), unless it is queued already; True if
        it was queued now (what a failed pass left behind is then stale). DDP queues its
        callback once the last bucket is reduced, after every hook's call: ours queues the
        callback from a callback, to run after all those queued before."""
        this_pass = _backward_pass()
        if name in self._queued and self._queued[name] == this_pass:
            return False
        self._queued[name] = this_pass
        queue = torch.autograd.Variable._execution_engine.queue_callback
        queue(lambda: queue(callback))
        return True

    # -- DDP's side (its communication hook, in_backward_ddp.py) ------------------------------

    def bucket_reducing(self, bucket, reduced) -> None:
        """DDP is all-reducing this bucket (`reduced`: its future). Its parameters of this
        optimizer step once it is done: when the next bucket comes, or at the end of the
        backward pass, which DDP's own end-of-backward callback (queued before any bucket was
        ready) precedes; the gradients it writes there are then dropped."""
        mine = [(p, g) for p, g in zip(bucket.parameters(), bucket.gradients())
                if self._is_watched(p)]
        if not mine or self._accumulating:
            return
        if self._probing:
            if self._at_end_of_pass("probe", self._probe_recorded):
                self._probed = []
            self._probed += [p for p, _ in mine]
            return
        if self._at_end_of_pass("reduced", self._reduced_end):
            # A pass that failed left these (its callback dropped): not stepped, as the
            # ordinary loop skips the step of a failed backward.
            self._reduced_pending, self._reduced_stepped = (), []
        if self._reduced_pending:
            self._step_reduced(*self._reduced_pending)
        self._reduced_pending = (mine, reduced)

    def _step_reduced(self, mine, reduced) -> None:
        reduced.wait()  # on a GPU: the current stream waits for the all-reduce
        kept = {id(p) for p in self._still_stepped(p for p, _ in mine)}
        mine = [(p, g) for p, g in mine if id(p) in kept]
        for p, g in mine:
            if p.grad is not g:  # without gradient_as_bucket_view the average is the bucket's
                p.grad = g
        # DDP writes the gradients at its end: dropped after that (_reduced_end).
        self._reduced_stepped += self._step_and_free([p for p, _ in mine], free=False)

    def _reduced_end(self) -> None:
        self._queued.pop("reduced", None)
        pending, self._reduced_pending = self._reduced_pending, ()
        if pending:
            self._step_reduced(*pending)
        stepped, self._reduced_stepped = self._reduced_stepped, []
        for p in stepped:
            p.grad = None

    def _probe_recorded(self) -> None:
        self._queued.pop("probe", None)
        probed, self._probed = self._probed, []
        for p in probed:  # the gradients DDP wrote
            self._record(p)

    def zeroing(self, set_to_none: bool) -> None:
        """optimizer.zero_grad(set_to_none) was called."""
        self._zero_filled = not set_to_none
        if set_to_none:  # no gradient left for the ordinary step to step with zeros later
            self._ever = {}

    # -- optimizer.step() --------------------------------------------------------------------

    def before_step(self, closure, scaling) -> bool:
        """What optimizer.step() does now: True to run the ordinary step (the probe, or
        gradients that no hook consumed), having refused what cannot be applied."""
        if closure is not None:
            self._seen = {}
            raise RuntimeError("step_in_backward: step(closure) would run backward again, which "
                               "steps inside it already; call backward, then step()")
        if scaling.grad_scale is not None or scaling.found_inf is not None:
            self._seen = {}
            raise RuntimeError(
                "step_in_backward does not work with torch.amp.GradScaler: an inf found in one "
                "bucket's gradients cannot undo the buckets stepped before it. Train with "
                "bfloat16 autocast (no loss scaling needed), or use the ordinary step")
        if not self._probing:
            if self._zero_filled:  # what the ordinary step would step with a zero gradient
                missing = self._still_stepped(p for key, p in self._ever.items()
                                              if key not in self._since_step and p.grad is None)
                for p in missing:
                    p.grad = torch.zeros_like(p)
                self._step_and_free(missing)
            self._since_step = set()
            return True  # steps only what still has a gradient (none, in the usual loop)
        seen, self._seen = self._seen, {}  # a refused probe is retried afresh
        if not seen:  # no backward pass before this step (a step before training, DCP's
            return True  # state initialisation): the probe is the next one
        for p, passes, grad, fingerprint in seen.values():
            if passes > 1:
                raise RuntimeError(
                    f"step_in_backward: {passes} backward passes reached a parameter of shape "
                    f"{tuple(p.shape)} before this step: to accumulate gradients, run all "
                    "micro-batches but the last inside `with handle.accumulating():`")
            if p.grad is not grad or not _same(fingerprint, _fingerprint(grad)):
                raise RuntimeError(
                    "step_in_backward: a gradient (of a parameter of shape "
                    f"{tuple(p.shape)}) was changed between backward and step (gradient "
                    "clipping, unscaling or editing by hand), which a step inside backward "
                    "cannot do: it steps each gradient as soon as it is made. Use the "
                    "ordinary step")
        self._probing = False
        params = (p for group in self._optimizer.param_groups for p in group["params"])
        self._ever = {id(p): p for p in params if p.grad is not None}  # the probe steps these
        self._since_step = set()
        return True


def refuse_ddp(named_params) -> None:
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
        if local(p) is p:
            raise RuntimeError(
                f"step_in_backward: {where} is a plain tensor while torch.distributed runs "
                f"{ranks} ranks: under DDP its gradient would be stepped before DDP "
                "all-reduces it. Pass the DDP model wrapping it (step_in_backward(ddp=model)), "
                "whose buckets then step once reduced, or use FSDP2 (fully_shard), whose "
                "sharded parameters step in backward")


def _fingerprint(grad):
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


def _same(a, b) -> bool:
    return a[0] == b[0] and (a[1] is None or torch.equal(a[1], b[1]))


def _backward_pass():
    """Which backward pass is running (autograd's graph task id), None where torch has no
    such query."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else current()


__all__ = ["StepInBackward", "refuse_ddp"]
