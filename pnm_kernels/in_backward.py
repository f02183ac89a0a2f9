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
done, and keep their gradients, as with the ordinary step (DDP's buckets hold them anyway)."""
import contextlib
import warnings
import weakref

import torch

from .in_backward_ddp import (NOT_GIVEN_BY_DDP, ReducedBuckets, ReducedSteps, managed_by,
                              refuse_ddp)
from .fingerprints import (ADDED_TO_HELD, added_to_the_probes, any_nonzero, fingerprint,
                           refuse_changed_at_the_probe)
from .in_backward_freed import FreedGradients
from .in_backward_hypers import CHANGED, HypersAtBackward
from .in_backward_owners import refuse_stepped_elsewhere
from .in_backward_params import WatchedParams
from .in_backward_passes import PassEnds
from .params import describe, describe_in, local


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
                               "(remove() its handle first: optimizer.step_in_backward_handle)")
        models = list(ddp) if isinstance(ddp, (list, tuple)) else [] if ddp is None else [ddp]
        models = list({id(model): model for model in models}.values())  # each hooked once
        for model in models:
            ReducedBuckets.check(model, "step_in_backward")
        self._reduced_here = set().union(*map(managed_by, models))
        self._optimizer = optimizer
        self.refuse_params((f"param_groups[{gi}]['params'][{pi}]", p)
                           for gi, group in enumerate(optimizer.param_groups)
                           for pi, p in enumerate(group["params"]))
        # DDP's parameters step in its communication hook (registered now, kept on the model).
        self._reduced = [ReducedBuckets.of(model, "step_in_backward") for model in models]
        self._bucket_bytes = bucket_mib * 2**20
        self._probing = True  # the first step is an ordinary one (see the module's docstring)
        self._accumulating = 0
        self._pending: list = []
        self._pending_bytes = 0
        self._seen: dict = {}  # probe: id(p) -> (p, passes, gradient, its fingerprint)
        # probe: id(p) -> the sum of p's bit patterns as its gradient came (not its version:
        # parameters made of views of one buffer share one counter, and `p.data.clamp_()`
        # bumps none that p has)
        self._param_bits: dict = {}
        # To find hyper-parameters set between backward and step(), which the buckets stepped
        # without.
        self._hypers = HypersAtBackward(optimizer)
        # zero_grad(set_to_none=False) keeps a zero gradient for every parameter that ever had
        # one, and the ordinary step steps it: the gradients freed here say which (and what
        # remove() gives back).
        self._zero_filled = False
        self._freed = FreedGradients(self._reduced_here)
        # What the ordinary loop would hold that the buckets freed: a step() since the last
        # zero_grad() (a backward pass now would add to its gradients), gradients freed since
        # it (a step() now would step them again). Whether the loop calls zero_grad() between
        # step() and the next backward is learnt at the first pass after the probe: the
        # probe's step freed no gradient (weak references to them here), and one summed into
        # is a loop that does not zero; None: not learnt yet.
        self._stepped_since_zeroing = False
        self._freed_since_zeroing = False
        self._loaded_after_failure = False  # see before_load
        self._pass_stepped = False  # a bucket stepped inside backward since the last step()
        self._loop_zeroes: bool | None = None
        self._probe_grads: dict = {}
        # Plain gradients held when enabled (an earlier micro-batch's?) that the probe's first
        # pass adds to: it would not see the loop's passes a step. Zeros are no pass's.
        held = [p for g in optimizer.param_groups for p in g["params"]
                if type(getattr(p, "grad", None)) is torch.Tensor and not p.grad.is_meta]
        self._held_at_start = {id(p): (weakref.ref(p), weakref.ref(p.grad), p.grad._version)
                               for p, nonzero in zip(held, any_nonzero(held)) if nonzero}
        self._added_to_held: str | None = None  # how, where it did
        # The passes that came and their ends, where the pending bucket steps (a nested pass,
        # a reentrant checkpoint's, steps what is ready when it ends, its outer pass the rest).
        self._passes = PassEnds(self._step_pending)
        self._params = WatchedParams(optimizer, self._ready, self._reduced_here)
        try:
            self.watch(p for group in optimizer.param_groups for p in group["params"])
        except BaseException:  # a refused call leaves nothing hooked or registered
            self._params.remove_hooks()
            raise
        # DDP's parameters: stepped in its communication hook, bucket by bucket.
        self.reduced_steps = ReducedSteps(self) if self._reduced else None
        for reduced in self._reduced:
            reduced.handles.append(self.reduced_steps)
        optimizer._in_backward = self

    def watch(self, params) -> None:
        """Hooks on these parameters: optimizer.add_param_group calls it for those it adds."""
        self._params.watch(params)

    def watches(self, p) -> bool:
        return self._params.watches(p)

    def still_stepped(self, params) -> list:
        """Those of params still the optimizer's (in_backward_params.py)."""
        return self._params.still_stepped(params)

    def refuse_params(self, named_params) -> None:
        """Refuses, naming it, a parameter that cannot step inside backward here: a
        plain-tensor one that several ranks would step before reducing its gradient (no DDP
        model given to step_in_backward reduces it), or one stepping inside backward in
        another optimizer. `named_params`: (where, parameter) pairs."""
        named_params = list(named_params)
        for where, p in named_params:
            if isinstance(p, torch.Tensor) and torch.nn.parameter.is_lazy(p):
                raise ValueError(
                    f"step_in_backward: {where} is an uninitialized parameter (a lazy "
                    "module's), which no gradient hook can be put on: run a forward pass "
                    "first (a dry run), then make the optimizer and call step_in_backward()")
        refuse_stepped_elsewhere(self._optimizer, named_params)
        refuse_ddp(((where, p) for where, p in named_params if id(p) not in self._reduced_here),
                   ddp_given=self._reduced_here != set())

    # -- the user's side -------------------------------------------------------------------

    def remove(self, _refuse_given: bool = True) -> None:
        """The ordinary step again (gradients kept until optimizer.step()); the gradients
        freed here that the ordinary loop would hold are given back as zeros. Between a
        backward pass that stepped inside it and step(), the pass's step is completed first
        as far as it can be (DDP's last bucket steps; a parameter that stepped has no gradient
        until that step() is done, so that it steps only the others)."""
        if _refuse_given and not self._probing:  # that step() would step it again
            self._refuse_given_again("The handle was not removed")
        self._params.remove_hooks()
        self._pending = []
        for reduced in self._reduced:  # DDP keeps the hook: it reduces
            if self.reduced_steps in reduced.handles:
                reduced.handles.remove(self.reduced_steps)
        if self.reduced_steps is not None and not self._probing:
            self.reduced_steps.before_step()  # the gradients set aside are not put back
        if not self._probing:
            self._freed.give_back(self._optimizer, self.still_stepped, self._zero_filled,
                                  self._stepped_since_zeroing)
        if getattr(self._optimizer, "_in_backward", None) is self:
            self._optimizer._in_backward = None

    def __enter__(self) -> "StepInBackward":
        return self

    def __exit__(self, *exc) -> None:
        # Leaving the block through an error (that refusal at step(), say) removes the handle
        # all the same: the block's end is the ordinary step's, as promised.
        self.remove(_refuse_given=exc[0] is None)

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
        if grad is None or not self.still_stepped([p]):
            return  # taken out of the optimizer: its gradient is whoever steps it now's
        self.pass_came()
        if self._stepped_since_zeroing and not self._probing:
            self._check_zeroed(p, grad)
        if self._accumulating:
            return
        if self._probing:
            kept, self._held_at_start = self._held_at_start, {}
            self._added_to_held = self._added_to_held or (kept and added_to_the_probes(
                kept, p, grad, "held when step_in_backward() was called")) or None
            self._record(p)
            return
        if id(p) in self._freed.since_step:
            raise RuntimeError(_TWICE.format(
                f"a second gradient was made for a parameter of shape {tuple(p.shape)} after "
                "it had stepped inside backward, before the next step()"))
        self._pending.append(p)
        self._pending_bytes += local(grad).numel() * grad.element_size()  # a shard's own
        if self._pending_bytes >= self._bucket_bytes:
            self._step_pending()  # the rest at the pass's end

    def pass_came(self) -> None:
        """A gradient or a DDP bucket of a backward pass is here: its end is awaited, and a
        pass before it that failed unseen is dealt with."""
        if self._passes.came():
            self._after_unseen_failure()

    def _after_unseen_failure(self) -> None:
        """A backward pass raised midway and the next came with no optimizer.zero_grad()
        between (the model's does not reach here): what it left is forgotten, as that
        zero_grad() would (its pending bucket steps anew with this pass's gradients)."""
        self._forget_pending()
        if self._pass_stepped and not self._probing:
            warnings.warn("step_in_backward: a backward pass after one that failed midway, with "
                          "no optimizer.zero_grad() between (the model's is not seen): the "
                          "buckets it stepped before failing stay stepped (the ordinary loop, "
                          "skipping the batch, would step none)", stacklevel=2)
        self._pass_stepped = self._loaded_after_failure = False
        self._freed.zeroed(set_to_none=False, failed=True)
        if self.reduced_steps is not None:
            self.reduced_steps.zeroing()
        if self._probing:  # the probe starts again with this pass
            self._seen, self._param_bits = {}, {}

    def _check_zeroed(self, p, grad) -> None:
        """A backward pass after step() with no optimizer.zero_grad() since, its first
        gradient `grad` (p's): the ordinary loop would add it to the gradients of the pass
        that stepped (or drop it at zero_grad()), which are gone. Refused before this pass
        steps where the loop is seen not to do so: one that zeroes between step() and the
        next pass, or one that summed into the gradients the probe's step left."""
        if self._loop_zeroes is None:
            kept, self._probe_grads = self._probe_grads, {}
            added = added_to_the_probes(kept, p, grad)
            if added:
                raise RuntimeError(_UNZEROED.format(added))
            self._loop_zeroes = False  # zeroed another way (model.zero_grad()): not seen
        elif self._loop_zeroes:
            raise RuntimeError(_UNZEROED.format(
                "a backward pass came after step() before zero_grad(), which this loop "
                "calls between them otherwise"))
        self._stepped_since_zeroing = False

    def check_reduced_pass(self) -> None:
        """_check_zeroed for a bucket DDP reduced, before it steps: where the loop is seen to
        zero between step() and the next pass. (DDP keeps its gradients: a loop that does
        not zero sums into them, and the bucket steps the sum, as the ordinary step would.)"""
        if self._stepped_since_zeroing and self._loop_zeroes:
            raise RuntimeError(_UNZEROED.format(
                "a backward pass came after step() before zero_grad(), which this loop "
                "calls between them otherwise"))

    def _step_pending(self) -> None:
        params, self._pending, self._pending_bytes = self._pending, [], 0
        self._pass_stepped |= bool(self._step_and_free(params))

    def _step_and_free(self, params, free: bool = True) -> list:
        """Steps those of params still the optimizer's and frees their gradients (with free);
        returns them."""
        params = self.still_stepped(params)
        if params:
            self._hypers.note()
            self._optimizer._step_only(params, first_of_pass=not self._pass_stepped)
        for p in params if free else ():
            p.grad = None
            self._freed_since_zeroing = True
        self._freed.stepped(params)
        return params

    def _forget_pending(self) -> None:
        """What a backward pass that failed left pending (its end never came): not stepped
        here, its gradients left where they are."""
        self._pending, self._pending_bytes = [], 0

    def _record(self, p) -> None:
        """The probe saw p's gradient made: how often before the step, and what it was."""
        self.record(p, p.grad, fingerprint(p.grad))

    def record(self, p, grad, bits) -> None:
        """The probe's record of p's gradient: one more backward pass reached it, and at its
        end the gradient was `grad` (None: whichever p holds) of these bits (a fingerprint)."""
        self._hypers.note()
        _, passes, _, _ = self._seen.get(id(p), (p, 0, None, None))
        self._seen[id(p)] = (p, passes + 1, grad, bits)
        self._param_bits[id(p)] = fingerprint(p.detach())[1]

    def saw_reduced(self, p, bits) -> None:
        """The probe's DDP parameter p: its gradient should hold these bits (of DDP's average)
        at the step, whichever tensor holds them."""
        if p.grad is None:  # before any step: the probe's step has not begun
            self._seen, self._param_bits = {}, {}  # a refused probe is retried afresh
            raise RuntimeError(NOT_GIVEN_BY_DDP.format(describe_in(self._optimizer.param_groups,
                                                                   p)))
        p, passes, grad, _ = self._seen[id(p)]
        self._seen[id(p)] = (p, passes, grad, (None, bits))

    def probing(self) -> bool:
        return self._probing

    def summing(self) -> bool:
        """Inside accumulating(): backward passes sum their gradients, stepping nothing."""
        return self._accumulating > 0

    def step_bucket(self, params) -> list:
        """A bucket DDP has reduced: steps those of params still the optimizer's, their
        gradients kept (DDP holds them); returns them."""
        stepped = self._step_and_free(params, free=False)
        self._pass_stepped |= bool(stepped)
        return stepped

    @property
    def _unended(self) -> bool:
        """A backward pass whose gradients came here has not ended since: if no step() or
        zero_grad() came, it raised midway (an OOM, say): a pass's end never comes then."""
        return self._passes.unended()

    @property
    def _awaiting_step(self) -> bool:
        """A pass past the probe stepped inside itself and ended: step() should come next."""
        return self._pass_stepped and not self._unended and not self._probing

    def zeroing(self, set_to_none: bool) -> None:
        """optimizer.zero_grad(set_to_none) was called."""
        failed = self._unended
        if self._awaiting_step:
            # Said, not prevented: nothing showed that this pass would not step.
            raise RuntimeError(
                "step_in_backward: zero_grad() after a backward pass that no step() followed "
                f"({_AFTER_STEP if self._stepped_since_zeroing else 'a step skipped'}): the "
                "ordinary loop would drop that pass's gradients here, but they stepped inside "
                "backward as they were made. Skip a batch before its backward pass, measure "
                "with torch.autograd.grad, freeze parameters a pass should not step "
                "(requires_grad_(False)), or use the ordinary step")
        self._forget_pending()  # a failed pass's bucket: its gradients are zeroed
        self._passes.forget()
        if failed and self._pass_stepped and not self._probing:
            warnings.warn("step_in_backward: zero_grad() after a backward pass that failed "
                          "midway: the buckets it stepped before failing stay stepped (the "
                          "ordinary loop, skipping the batch, would step none)", stacklevel=3)
        if failed:
            self._pass_stepped = False
        if self._probing:  # the gradients the probe saw are gone: it starts again
            self._seen, self._param_bits, self._added_to_held = {}, {}, None
        elif self._stepped_since_zeroing and self._loop_zeroes is None:
            self._loop_zeroes = True
        self._stepped_since_zeroing = self._freed_since_zeroing = False
        self._loaded_after_failure = False
        self._probe_grads, self._held_at_start = {}, {}
        self._hypers.forget()
        if self.reduced_steps is not None:
            self.reduced_steps.zeroing()
        self._zero_filled = not set_to_none
        self._freed.zeroed(set_to_none, failed)

    def before_load(self) -> None:
        """optimizer.load_state_dict() is called: refused between a backward pass that stepped
        inside it and step() (the ordinary step would step the loaded state with the pass's
        gradients); a failed pass's (recovery from a checkpoint) is not."""
        # A failed pass's buckets stepped with the state before: the ordinary step would step
        # the loaded one with their gradients, unless zero_grad() skips the batch first.
        self._loaded_after_failure |= self._pass_stepped and self._unended
        if self._awaiting_step:
            raise RuntimeError(
                "step_in_backward: load_state_dict() between a backward pass and its step(): "
                "the ordinary step would step the loaded state with this pass's gradients, "
                "but they stepped inside backward as they were made. Nothing was loaded; load "
                "between step() and the next backward pass, or use the ordinary step")

    # -- optimizer.step() --------------------------------------------------------------------

    def refuse_scaling(self, scaling) -> None:
        """GradScaler's scale or inf flag given to step(): refused (also before a closure)."""
        if scaling.grad_scale is not None or scaling.found_inf is not None:
            self._seen = {}
            for name in ("grad_scale", "found_inf"):  # GradScaler drops them only after a step
                self._optimizer.__dict__.pop(name, None)  # that returned: not to stay behind
            raise RuntimeError(
                "step_in_backward does not work with torch.amp.GradScaler: an inf found in one "
                "bucket's gradients cannot undo the buckets stepped before it. Train with "
                "bfloat16 autocast (no loss scaling needed), or use the ordinary step")

    def before_step(self) -> None:
        """What optimizer.step() does now, after refuse_scaling() and its closure if it has
        one, before the ordinary step (the probe, or gradients that no hook consumed) runs:
        refuses what cannot be applied."""
        if self._loaded_after_failure and not self._probing:
            raise RuntimeError(
                "step_in_backward: step() after a backward pass that failed midway and a "
                "load_state_dict(), with no zero_grad() between: the ordinary step would step "
                "the loaded state with all that pass's gradients, but the buckets it stepped "
                "before failing used theirs already. Call zero_grad() after a failed pass "
                "(skipping its batch)")
        if not self._probing:
            self._refuse_given_again("Nothing was stepped in step()")
        self._forget_pending()  # a failed pass's bucket keeps its gradients: stepped below
        self._passes.forget()
        if not self._probing and not self._pass_stepped and self._freed_since_zeroing:
            raise RuntimeError(
                "step_in_backward: step() again with no backward pass since the last one "
                "and no zero_grad(): the ordinary step would step the last pass's gradients "
                "again, but they stepped inside backward and were freed. Call step() once "
                "a backward pass, or use the ordinary step")
        changed = self._hypers.changed()
        if not self._probing:
            self._stepped_since_zeroing = True
            # what the ordinary step would step with a zero gradient
            missing = (self._freed.zero_filled_missing(self.still_stepped)
                       if self._zero_filled else [])
            if changed is not None:  # stepped already: said, not refused mid-training
                now = missing or self._left_to_step()
                warnings.warn(CHANGED.format(changed, "the buckets stepped inside backward used "
                              "the value before" + (", what step() steps now (gradients no "
                              "bucket took: DDP's last bucket, zero gradients kept, sums of "
                              "micro-batches the last pass missed) the new one" if now else
                              "; the new one applies from the next backward pass")),
                              stacklevel=3)
            if missing:
                for p in missing:
                    p.grad = torch.zeros_like(p)
                self._step_and_free(missing)
            self._freed.step_done()
            if self.reduced_steps is not None:  # DDP's last bucket; what stepped kept aside
                self.reduced_steps.before_step()
            self._pass_stepped = False
            self._hypers.forget()  # noted by the steps just above, not in backward
            return  # the ordinary step steps what still has a gradient (none, usually)
        if self.reduced_steps is not None:
            self.reduced_steps.probed()  # the sums of the gradients DDP reduced
        seen, self._seen = self._seen, {}  # a refused probe is retried afresh (zero_grad())
        param_bits, self._param_bits = self._param_bits, {}
        if not seen:  # no backward pass before this step (a step before training, DCP's
            return  # state initialisation): the probe is the next one
        if changed is not None:
            raise RuntimeError(CHANGED.format(changed, "nothing was stepped"))
        if self._added_to_held:
            raise RuntimeError(_TWICE.format(ADDED_TO_HELD.format(self._added_to_held)))
        for p, passes, _, _ in seen.values():
            if passes > 1:
                raise RuntimeError(_TWICE.format(
                    f"{passes} backward passes reached a parameter of shape {tuple(p.shape)} "
                    "before this step"))
        refuse_changed_at_the_probe(seen, param_bits)
        self._probing = False
        params = [p for group in self._optimizer.param_groups for p in group["params"]]
        self._freed.probe_stepped(p for p in params if p.grad is not None)
        self._stepped_since_zeroing = True
        self._probe_grads = {id(p): (weakref.ref(p), weakref.ref(p.grad), p.grad._version)
                             for p in params if p.grad is not None}

    def _refuse_given_again(self, nothing_done: str) -> None:
        """A gradient set by hand between backward and step() for a parameter that stepped
        inside backward (zeros for every parameter that has none, say): the ordinary step
        would step it with that gradient, but it stepped with the pass's already."""
        given = {id(p) for p in self._freed.given_again()}
        for gi, group in enumerate(self._optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) in given:
                    raise RuntimeError(
                        f"step_in_backward: {describe(p, gi, pi)} was given a gradient between "
                        "backward and step(), after it had stepped inside backward with the "
                        "one the pass made: the ordinary step would step it with the new one; "
                        f"stepped again, it would step twice. {nothing_done}. Change gradients "
                        "in a hook registered before step_in_backward(), or use the ordinary "
                        "step")

    def _left_to_step(self) -> bool:
        """Gradients no bucket took, which step() steps (DDP's keep theirs: not those)."""
        return ((self.reduced_steps is not None and self.reduced_steps.pending())
                or any(p.grad is not None and id(p) not in self._reduced_here
                       for group in self._optimizer.param_groups for p in group["params"]))

    def after_step(self) -> None:
        """optimizer.step() is done (or raised): DDP's gradients kept aside are back."""
        if self.reduced_steps is not None:
            self.reduced_steps.after_step()


# A parameter whose gradient is made twice between steps would step twice, each time with a
# part of its gradient.
_TWICE = ("step_in_backward: {} (a parameter steps once, with its "
          "whole gradient, as soon as it is made): to accumulate gradients over micro-batches, "
          "run all but the last inside `with handle.accumulating():`; a parameter reached in "
          "two reentrant checkpoint segments (or inside one and outside it) gets one gradient "
          "from each nested backward pass: checkpoint with use_reentrant=False")

_AFTER_STEP = "a pass after step(), DDP's, or once the loop zeroed through the model"

# A backward pass after step() whose gradients the ordinary loop would add to the last ones.
_UNZEROED = ("step_in_backward: {}: the ordinary step would step the sum, but the last "
             "pass's gradients stepped inside backward and were freed. Call "
             "optimizer.zero_grad() between step() and the next backward pass (the model's "
             "zero_grad() is not seen; a pass that only measures something: "
             "torch.autograd.grad, which fills no .grad; a pass not meant to step these "
             "parameters, as a GAN's generator pass reaching its discriminator: freeze them "
             "during it with requires_grad_(False); an optimizer replaced without "
             "handle.remove() keeps stepping inside backward through its hooks: "
             "pnm_kernels.stepping_in_backward(model.parameters()) finds its handle)")

__all__ = ["StepInBackward"]
