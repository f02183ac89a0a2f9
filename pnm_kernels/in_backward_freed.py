"""The gradients a step inside backward freed, against what the ordinary loop would still hold
(docs/design.md §9): which parameters stepped since the last step() (a second gradient for one
is refused), which had a gradient freed since the last zero_grad(set_to_none=True) (under
zero_grad(set_to_none=False) the ordinary loop keeps a zero gradient for each, and its step
steps those the loss no longer reaches), and what is given back, as zeros, when the handle is
removed."""
import weakref

import torch


class FreedGradients:
    """One handle's record of the gradients it freed; DDP's parameters (`reduced_here`, ids)
    keep theirs, as DDP does."""

    def __init__(self, reduced_here: set) -> None:
        self._reduced_here = reduced_here
        self.ever: dict = {}  # id(p) -> p: freed since the last zero_grad(set_to_none=True)
        self.since_step: set = set()  # ids stepped inside backward since the last step()
        self._last_pass: list = []  # those the last step() completed the pass of

    def stepped(self, params) -> None:
        """These stepped inside backward (their gradients freed, or DDP's kept)."""
        self.ever.update((id(p), p) for p in params)
        self.since_step.update(id(p) for p in params)

    def probe_stepped(self, params) -> None:
        """The probe's ordinary step stepped these, freeing nothing."""
        self.ever, self.since_step, self._last_pass = {id(p): p for p in params}, set(), []

    def step_done(self) -> None:
        """step() past the probe completed the pass (gradients it steps itself first go
        through stepped())."""
        self._last_pass = [self.ever[key] for key in self.since_step if key in self.ever]
        self.since_step = set()

    def given_again(self) -> list:
        """Those stepped inside backward since the last step() that hold a gradient again (set
        by hand between backward and step()); DDP's keep theirs: not those."""
        return [self.ever[key] for key in self.since_step
                if key in self.ever and self.ever[key].grad is not None
                and key not in self._reduced_here]

    def zeroed(self, set_to_none: bool, failed: bool) -> None:
        """optimizer.zero_grad(set_to_none); `failed`: after a pass that failed midway."""
        self._last_pass = []
        if failed:  # its batch skipped: what stepped stays stepped, the next pass steps anew
            self.since_step = set()
        if set_to_none:  # no gradient left for the ordinary step to step with zeros later
            self.ever = {}

    def zero_filled_missing(self, still_stepped) -> list:
        """Those the ordinary loop would hold a gradient for under
        zero_grad(set_to_none=False) (a zero one, or the last step()'s) but that hold none:
        freed here, not since the last step(), still the optimizer's (`still_stepped`)."""
        return still_stepped(p for key, p in self.ever.items()
                             if key not in self.since_step and self._freed(p))

    def give_back(self, optimizer, still_stepped, zero_filled: bool,
                  since_step_unzeroed: bool) -> None:
        """The handle is removed (past the probe): the gradients freed here that the ordinary
        loop would hold, given back as zeros, which either zero_grad() leaves as it would:
        under zero_grad(set_to_none=False) (`zero_filled`) every one freed; otherwise, where
        neither zero_grad() nor a backward pass came since the last step()
        (`since_step_unzeroed`), those of the pass it completed. A pass that awaits its step()
        gets its own after that step (which must not step them again)."""
        if zero_filled:
            given = self.zero_filled_missing(still_stepped)
        elif since_step_unzeroed:
            given = still_stepped(p for p in self._last_pass if self._freed(p))
        else:
            given = []
        for p in given:
            p.grad = torch.zeros_like(p)
        _ZerosAfterStep(optimizer, still_stepped(
            self.ever[key] for key in self.since_step
            if key in self.ever and self._freed(self.ever[key])))
        self.ever, self.since_step, self._last_pass = {}, set(), []

    def _freed(self, p) -> bool:
        return p.grad is None and id(p) not in self._reduced_here


class _ZerosAfterStep:
    """After the step() of the pass the handle was removed in: a zero gradient for each
    parameter that stepped in it, where the ordinary loop would still hold its gradient."""

    def __init__(self, optimizer, params) -> None:
        self._owed = [weakref.ref(p) for p in params]
        self._hook = optimizer.register_step_post_hook(self) if params else None

    def __call__(self, *_) -> None:
        if self._hook is not None:
            self._hook.remove()
        for p in (ref() for ref in self._owed):
            if p is not None and p.grad is None:
                p.grad = torch.zeros_like(p)


__all__ = ["FreedGradients"]
