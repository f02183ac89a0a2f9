"""Random training loops (seeded, reproducible) run by an ordinary optimizer and by the same
optimizer stepping inside backward (`step_in_backward`, docs/design.md §9), side by side: a
small model over two param groups (weight decay decoupled or L2, AMSGrad on or off; a head
added later as a third group; its last layers inside reentrant checkpoints or not), PNM and
AdaPNM, float32 parameters with float32, bfloat16 or int8 state, bfloat16 parameters rounded
stochastically, in buckets of one parameter, of a few, or one for all.

An iteration: events between step() and the next pass (BETWEEN_STEPS); the loop's zeroing
(the optimizer's zero_grad(), set_to_none True or False and switched now and then, or the
model's in a loop that zeroes through the model, or once in a while the other way); events
before the pass (BEFORE_PASS: a pass that fails before any gradient or midway, its batch
skipped, maybe a checkpoint loaded; a pass scaled by GradScaler); micro-batches, all but the
last inside `handle.accumulating()`, that skip layers at random; an event between backward
and step() (BETWEEN_BACKWARD_AND_STEP); step() or step(closure) with a closure running no
pass, maybe again, the LR scheduler. At the
end the handle is removed and one ordinary iteration follows.

Promised: after each iteration both hold the same parameters and state, bit for bit. Each
refusal is one §9 lists, with its message, and the refused call changes nothing; the loop
then skips the batch (or, past the probe, steps on) as §9 says. A pass (or the probe's step)
after the model's zero_grad() may be refused saying the model's zero_grad() is not seen,
where the loop zeroed through the optimizer too. What §9 says stays stepped (buckets a failed
pass stepped) the ordinary side takes over; it is said by the optimizer's zero_grad()
skipping the batch or, skipped through the model, at the next pass's first gradient. No other
error or warning comes. Left out, as §9 says they are not seen: the model's
zero_grad() to None after the optimizer's set_to_none=False (it passes for gradients the step
freed); clipping or editing between backward and step() past the probe."""
import contextlib
import copy
import random
import re
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from conftest import requires_extension
from pnm_kernels import PNM, AdaPNM
from test_in_backward_failed_passes import _FailsInBackward

CONFIGS = {"PNM": (PNM, torch.float32, {}),
           "AdaPNM": (AdaPNM, torch.float32, {}),
           "AdaPNM-int8": (AdaPNM, torch.float32, dict(state_dtype=torch.int8)),
           "PNM-bf16-state": (PNM, torch.float32, dict(state_dtype=torch.bfloat16)),
           "AdaPNM-bf16-sr-int8": (AdaPNM, torch.bfloat16,
                                   dict(state_dtype=torch.int8, bf16_stochastic_round=True))}
UNSEEN = r"the model's zero_grad\(\) is not seen"
NAMES = ("l0.weight", "l1.bias", "l2.weight", "l3.bias")


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = (torch.nn.Linear(6, 8), torch.nn.Linear(8, 8),
                                     torch.nn.Linear(8, 8))
        self.l3, self.head = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

    def forward(self, x, skip=(), fail=None, head=False, segments=()):
        """`segments`: the layers run inside a reentrant checkpoint each (l2; l3 with the
        head), whose backward is a nested pass: one failing midway fails after it ended."""
        h = torch.tanh(self.l0(x))
        h = h if "l1" in skip else torch.tanh(self.l1(h))
        h = _FailsInBackward.apply(h) if fail == "midway" else h
        if "l2" not in skip:
            h = _segment(lambda h: torch.tanh(self.l2(h)), h, "l2" in segments)
        out = _segment(lambda h: self.l3(h) + (self.head(h) if head and "head" not in skip
                                               else 0), h, "l3" in segments)
        loss = out.float().square().mean()
        return _FailsInBackward.apply(loss) if fail == "early" else loss


def _segment(run, h, checkpointed):
    return checkpoint(run, h, use_reentrant=True) if checkpointed else run(h)


class Side:
    """A model and its optimizer: the ordinary one, or (bucket_mib) one stepping in backward."""

    def __init__(self, config, seed, bucket_mib=None):
        opt_class, self.dtype, kwargs = CONFIGS[config]
        torch.manual_seed(seed)
        self.model = m = _Net().to(self.dtype)
        rng = random.Random(seed)
        second = dict(params=[*m.l2.parameters(), *m.l3.parameters()], lr=3e-3,
                      weight_decay=0.1, decoupled=rng.random() < 0.5)
        if opt_class is AdaPNM:
            second["amsgrad"] = rng.random() < 0.5
        self.opt = opt_class([dict(params=[*m.l0.parameters(), *m.l1.parameters()]), second],
                             lr=1e-2, **kwargs)
        self.scheduler = torch.optim.lr_scheduler.ExponentialLR(self.opt, gamma=0.9)
        self.bucket_mib, self.head, self.checkpoint = bucket_mib, False, None
        self.segments = random.Random(seed + 1).choice([(), (), ("l2",), ("l2", "l3")])
        if bucket_mib:
            self.opt.step_in_backward(bucket_mib=bucket_mib)

    def remove(self):
        if self.opt.step_in_backward_handle is not None:
            self.opt.step_in_backward_handle.remove()

    def backward(self, x, skip=(), fail=None, accumulating=False, scaler=None):
        handle = self.opt.step_in_backward_handle
        loss = self.model(x.to(self.dtype), skip, fail, self.head, self.segments)
        with handle.accumulating() if accumulating and handle else contextlib.nullcontext():
            (scaler.scale(loss) if scaler else loss).backward()

    def snapshot(self):
        """Parameters and every state value (tensors cloned), by name."""
        out = {}
        for name, p in self.model.named_parameters():
            out[name] = p.detach().clone()
            for key, value in self.opt.state.get(p, {}).items():
                out[f"{name}.{key}"] = value.detach().clone() if torch.is_tensor(value) else value
        return out


def _differences(a, b):
    def same(x, y):
        return (torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
                if torch.is_tensor(x) else x == y)
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or not same(a[k], b[k]))


class Loop:
    """The two sides (A ordinary, B in backward), the random choices, the log of events."""

    def __init__(self, config, seed):
        self.rng = random.Random(seed)
        bucket_mib = self.rng.choice([1e-6, 2e-4, 100.0])
        self.A, self.B = Side(config, seed), Side(config, seed, bucket_mib)
        self.batches = torch.Generator().manual_seed(seed)
        self.through_model = self.rng.random() < 0.15  # zeroing to None
        self.set_to_none = self.through_model or self.rng.random() < 0.6
        self.zero_filled = False  # the optimizer's last zero_grad() kept zeros
        self.flipped = False  # this iteration zeroes the other way
        self.optimizer_zeroed = False  # optimizer.zero_grad() since the handle was attached
        self.unseen = False  # the model's zero_grad() that may be refused this iteration
        self.failure_unsaid = False  # a failed pass stepped, its batch skipped through the model
        self.log = [f"{config} seed={seed} bucket_mib={bucket_mib} "
                    f"set_to_none={self.set_to_none} through_model={self.through_model} "
                    f"segments={self.A.segments}"]

    def report(self, what):
        return "\n    ".join([what, self.log[0], "...", *self.log[-20:]])

    def attached(self):
        return self.B.opt.step_in_backward_handle is not None

    def probing(self):
        return self.attached() and self.B.opt.step_in_backward_handle.probing()

    def batch(self):
        return torch.randn(4, 6, generator=self.batches)

    def both(self, what, fn):
        self.log.append(what)
        fn(self.A), fn(self.B)

    def check(self, where, before=None):
        d = _differences(before or self.A.snapshot(), self.B.snapshot())
        assert not d, self.report(f"{where}: {'B changed' if before else 'A and B differ'} "
                                  f"in {d[:6]}")

    def refused(self, what, fn, match):
        """fn(B) raises a RuntimeError saying `match`, B unchanged."""
        self.log.append(f"{what} (refused)")
        before = self.B.snapshot()
        try:
            fn(self.B)
        except RuntimeError as e:
            assert re.search(match, str(e)), self.report(f"{what}: {e}")
        else:
            raise AssertionError(self.report(f"{what}: not refused"))
        self.check(f"refused {what}", before)

    def on_b(self, fn):
        """fn(B), where a pass's first gradient may say (once) that the buckets a failed pass
        stepped stay stepped, its batch skipped through the model."""
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                return fn(self.B)
            finally:
                said = [str(w.message) for w in said]
                assert (self.failure_unsaid or not said) and all(
                    "a backward pass after one that failed midway" in w for w in said), \
                    self.report(f"warned {said}")
                self.failure_unsaid &= not said

    def unseen_refused(self, what, fn):
        """fn(B); after the model's zero_grad() it may be refused saying that it is not seen
        (B unchanged), and then the batch is skipped as the message says: True."""
        before = self.B.snapshot() if self.unseen else None
        try:
            self.on_b(fn)
            return False
        except RuntimeError as e:
            if not self.unseen or not re.search(UNSEEN, str(e)):
                raise AssertionError(self.report(f"{what}: {e}")) from e
        self.log.append(f"{what} (refused: the model's zero_grad() is not seen)")
        self.check(f"refused {what}", before)
        # as the refusal says: optimizer.zero_grad(), to None (kept zeros would keep the
        # gradients the model's unseen zeroing dropped, which the ordinary loop has not)
        self.skip_batch(to_none=True)
        return True

    def zero_grad(self):
        """The optimizer's or (through_model != flipped) the model's, as the optimizer's last
        zeroed: to None after it kept zeros passes for the step's freeing (§9, not seen)."""
        self.unseen = False
        if self.through_model != self.flipped:
            to_none = not self.zero_filled
            self.both(f"model.zero_grad({to_none})", lambda s: s.model.zero_grad(to_none))
            self.unseen = self.optimizer_zeroed
        else:
            self.both(f"zero_grad(set_to_none={self.set_to_none})",
                      lambda s: s.opt.zero_grad(set_to_none=self.set_to_none))
            self.optimizer_zeroed, self.zero_filled = True, not self.set_to_none
        self.flipped = False

    def skip_batch(self, through_model=False, failed=None, to_none=None):
        """A failed or refused pass's batch skipped by zero_grad() (to None, or as the loop
        zeroes). The one warning allowed says that buckets stepped before a failure stay
        stepped; then (and where the model's zero_grad() leaves them unsaid) the ordinary
        side takes them over."""
        to_none = self.set_to_none if to_none is None else to_none
        if through_model:
            self.both("model.zero_grad() (batch skipped)", lambda s: s.model.zero_grad())
            self.unseen = True
            stepped = bool(_differences(self.A.snapshot(), self.B.snapshot()))
            self.failure_unsaid |= stepped
        else:
            self.log.append(f"zero_grad(set_to_none={to_none}) (batch skipped)")
            self.A.opt.zero_grad(set_to_none=to_none)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                self.B.opt.zero_grad(set_to_none=to_none)
            said = [str(w.message) for w in said]
            assert all("failed midway: the buckets it stepped" in w for w in said), \
                self.report(f"zero_grad() warned {said}")
            stepped, self.optimizer_zeroed, self.zero_filled = bool(said), True, not to_none
        assert not (stepped and failed == "early"), self.report("stepped with no gradient")
        if stepped:
            self.log.append("  (stepped before failing, stays stepped: A takes B's)")
            with torch.no_grad():
                for p, q in zip(self.A.model.parameters(), self.B.model.parameters()):
                    p.copy_(q)
            self.A.opt.load_state_dict(copy.deepcopy(self.B.opt.state_dict()))
        self.check("the batch skipped")


# --- events: each a function of the loop ---------------------------------------------------

def _hyper_parameter_set(L):
    gi = L.rng.randrange(len(L.A.opt.param_groups))
    group, r = L.A.opt.param_groups[gi], L.rng
    key = r.choice(["lr", "weight_decay", "betas"] + ["amsgrad"] * ("amsgrad" in group))
    value = {"lr": lambda: group["lr"] * r.choice([0.5, 1.5]),
             "weight_decay": lambda: r.choice([0.0, 0.05, 0.2]),
             "betas": lambda: (r.choice([0.8, 0.9]), *[r.choice([0.99, 0.999])]
                               * (len(group["betas"]) == 3), r.choice([1.0, 0.5])),
             "amsgrad": lambda: not group["amsgrad"]}[key]()
    L.both(f"param_groups[{gi}][{key!r}] = {value}",
           lambda s: s.opt.param_groups[gi].__setitem__(key, value))


def _on_a_parameter(what, edit, names=NAMES):
    """An edit of one parameter (or its state, or its group) on both sides."""
    def event(L):
        name = L.rng.choice(names)
        L.both(f"{what}: {name}", lambda s: edit(s, s.model.get_parameter(name)))
    return event


def _clamped(s, p):
    with torch.no_grad():
        p.clamp_(-0.5 * float(p.abs().max()), 0.5 * float(p.abs().max()))  # changes bits


def _state_replaced(s, p):
    state = s.opt.state.get(p, {})
    keys = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point())
    for key in keys[:1]:
        state[key] = state[key] * 0.5


def _moved_to_the_next_group(s, p):
    groups = s.opt.param_groups
    gi = next(i for i, g in enumerate(groups) if any(q is p for q in g["params"]))
    groups[gi]["params"] = [q for q in groups[gi]["params"] if q is not p]
    groups[(gi + 1) % len(groups)]["params"] = groups[(gi + 1) % len(groups)]["params"] + [p]
    s.checkpoint = None  # of other groups


def _head_added(s):
    s.opt.add_param_group(dict(params=list(s.model.head.parameters()), lr=5e-3,
                               weight_decay=0.02))
    s.head = True


def _reattached(L):
    L.both("step_in_backward() again",
           lambda s: s.bucket_mib and s.opt.step_in_backward(bucket_mib=s.bucket_mib))
    L.optimizer_zeroed = False


def _checkpoint_loaded(L):
    if L.A.checkpoint and len(L.A.checkpoint[1]["param_groups"]) == len(L.A.opt.param_groups):
        L.both("checkpoint loaded", lambda s: (
            s.model.load_state_dict(s.checkpoint[0]),
            s.opt.load_state_dict(copy.deepcopy(s.checkpoint[1]))))


def _failed_pass(fail, recover=False):
    def event(L):
        x = L.batch()
        L.log.append(f"a backward pass that fails {fail}")
        for on in (lambda fn: fn(L.A), L.on_b):  # or refused after the model's zero_grad()
            with pytest.raises(RuntimeError, match="simulated failure" + f"|{UNSEEN}" * L.unseen):
                on(lambda s: s.backward(x, fail=fail))
        L.skip_batch(through_model=L.through_model, failed=fail)
        if recover:
            _checkpoint_loaded(L)
    return event


def _scaled_pass(L):
    """Refused at scaler.step() in the probe's iteration (nothing stepped, the scale not left
    behind), the batch skipped; detached, both step. (Past the probe GradScaler finds no
    gradient to unscale.)"""
    if not L.attached() or L.probing():
        x, scalers = L.batch(), {"A": torch.amp.GradScaler("cpu", init_scale=16.0),
                                 "B": torch.amp.GradScaler("cpu", init_scale=16.0)}
        L.log.append("a pass scaled by GradScaler")
        L.A.backward(x, scaler=scalers["A"])
        L.on_b(lambda s: s.backward(x, scaler=scalers["B"]))
        if L.attached():
            L.refused("scaler.step()", lambda s: scalers["B"].step(s.opt), "GradScaler")
        else:
            L.both("scaler.step()", lambda s: scalers["A" if s is L.A else "B"].step(s.opt))
        L.skip_batch()


def _set_to_none_switched(L):
    if not L.through_model:
        L.set_to_none = not L.set_to_none
        L.log.append(f"set_to_none = {L.set_to_none}")


BETWEEN_STEPS = {
    "hyper-parameter set": _hyper_parameter_set,
    "state_dict reloaded": lambda L: L.both("state_dict reloaded", lambda s: (
        s.opt.load_state_dict(copy.deepcopy(s.opt.state_dict())))),
    "checkpoint saved": lambda L: L.both("checkpoint saved", lambda s: setattr(
        s, "checkpoint", copy.deepcopy((s.model.state_dict(), s.opt.state_dict())))),
    "checkpoint loaded": _checkpoint_loaded,
    "requires_grad toggled": _on_a_parameter("requires_grad toggled",
                                             lambda s, p: p.requires_grad_(not p.requires_grad)),
    "head added": lambda L: L.A.head or L.both("add_param_group(head)", _head_added),
    "handle removed": lambda L: L.attached() and L.both("handle.remove()", Side.remove),
    "step_in_backward again": lambda L: L.attached() or _reattached(L),
    "parameter clamped": _on_a_parameter("clamped", _clamped),
    "state replaced": _on_a_parameter("state replaced", _state_replaced),
    "moved to the next group": _on_a_parameter("moved", _moved_to_the_next_group, NAMES[1:]),
    "set_to_none switched": _set_to_none_switched,
    "zeroed the other way": lambda L: setattr(L, "flipped", True),
}

BEFORE_PASS = {"failed early": _failed_pass("early"), "failed midway": _failed_pass("midway"),
               "failed, checkpoint loaded": _failed_pass("midway", recover=True),
               "scaled by GradScaler": _scaled_pass}


def _refused_by_the_probe(what, edit, match):
    """Refused by the probe, nothing stepped, the batch skipped; detached, both edit and step
    (past the probe not seen, §9: left out). Returns whether the iteration is done."""
    def event(L):
        if not L.attached() or L.probing():
            L.both(what, edit(L))
            return L.attached() and (L.refused("step()", lambda s: s.opt.step(), match)
                                     or L.skip_batch() or True)
    return event


def _lr_set_after_the_probe(L):
    """Said by a warning at step(), applied from the next pass (the ordinary loop sets it after
    its step); only where step() steps nothing (or it would apply there too)."""
    if L.zero_filled or L.through_model or any(p.grad is not None for p in L.B.model.parameters()):
        return False
    group_a, group_b = L.rng.choice(list(zip(L.A.opt.param_groups, L.B.opt.param_groups)))
    L.log.append("lr doubled, past the probe: said at step()")
    group_b["lr"] *= 2
    L.A.opt.step()
    with pytest.warns(UserWarning, match="changed between backward and step"):
        L.B.opt.step()
    group_a["lr"] *= 2
    return True


def _zero_grad_between(L):
    if not L.attached() or L.probing():
        return L.skip_batch() or True
    L.refused("zero_grad()", lambda s: s.opt.zero_grad(),
              r"zero_grad\(\) after a backward pass that no step\(\) followed")
    L.both("step() instead (the pass stepped)", lambda s: s.opt.step())
    return L.skip_batch() or True


BETWEEN_BACKWARD_AND_STEP = {
    "gradients clipped": _refused_by_the_probe("clip_grad_norm_", lambda L: lambda s: (
        torch.nn.utils.clip_grad_norm_([p for p in s.model.parameters() if p.grad is not None],
                                       1e-3)),
        r"gradient .* was changed between backward and step"),
    "parameter clamped": _refused_by_the_probe("clamped: l3.weight", lambda L: lambda s: _clamped(
        s, s.model.l3.weight), r"parameter .* was changed in place"),
    "lr set": lambda L: (_refused_by_the_probe("lr doubled", lambda L: lambda s: (
        s.opt.param_groups[0].__setitem__("lr", s.opt.param_groups[0]["lr"] * 2)),
        r"param_groups\[0\]\['lr'\]")(L) if not L.attached() or L.probing()
        else _lr_set_after_the_probe(L)),
    "state_dict loaded": lambda L: (
        L.both if not L.attached() or L.probing() else lambda what, fn: (
            L.refused(what, fn, r"load_state_dict\(\) between a backward pass and its step")))(
        "state_dict loaded", lambda s: s.opt.load_state_dict(copy.deepcopy(s.opt.state_dict()))),
    "handle removed": lambda L: (L.attached() and L.both("handle.remove()", Side.remove)
                                 or "removed"),
    "zero_grad()": _zero_grad_between,
}


def _iteration(L, t):
    L.log.append(f"-- iteration {t} (attached={L.attached()}, probing={L.probing()})")
    for event in BETWEEN_STEPS.values():
        if L.rng.random() < 0.08:
            event(L)
    L.check("the events between steps")
    L.zero_grad()
    for event in BEFORE_PASS.values():
        if L.rng.random() < 0.05:
            event(L)
    micro_batches = L.rng.choice([1, 1, 1, 2, 3])
    for i in range(micro_batches):
        skip, x, last = tuple(n for n in ("l1", "l2", "head") if L.rng.random() < 0.15), \
            L.batch(), i == micro_batches - 1
        L.log.append(f"backward(skip={skip}){'' if last else ' accumulating'}")
        L.A.backward(x, skip)
        if L.unseen_refused("backward", lambda s: s.backward(x, skip, accumulating=not last)):
            return
    done = L.rng.random() < 0.25 and L.rng.choice(list(BETWEEN_BACKWARD_AND_STEP.values()))(L)
    if done is True:
        return L.check("the event between backward and step")
    probing = L.probing() or not L.attached()
    # step(closure) with a closure that runs no pass is step(): its closure runs first
    what, step = L.rng.choice([("step()", lambda s: s.opt.step())] * 3 + [
        ("step(closure)", lambda s: s.opt.step(lambda: None))])
    L.log.append(what)
    if L.unseen_refused(what, step):  # the probe's
        return
    step(L.A)
    if L.rng.random() < 0.1 and done != "removed":  # after remove(), §9: not seen
        if probing:
            L.both(f"{what} again", step)
        else:
            L.refused(f"{what} again", step, r"step\(\) again with no backward")
    if L.rng.random() < 0.5:
        L.both("scheduler.step()", lambda s: s.scheduler.step())
    L.check(f"the step of iteration {t}")


def run_loop(config, seed, iterations=12):
    """The loop of the module's docstring; raises AssertionError with the events' log."""
    L = Loop(config, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in range(iterations):
            _iteration(L, t)
        L.both("handle.remove() (the end)", Side.remove)
        L.check("the handle removed")
        L.zero_grad()
        x = L.batch()
        L.both("backward, step() (ordinary)", lambda s: (s.backward(x), s.opt.step()))
        L.check("an ordinary step after the handle was removed")


@requires_extension
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_random_training_loop_steps_in_backward_as_the_ordinary_one(config, seed):
    run_loop(config, seed)
