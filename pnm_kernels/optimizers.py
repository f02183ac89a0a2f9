"""PNM and AdaPNM as torch.optim.Optimizer subclasses. A step chooses its path and hands
over: under torch.compile the traced step (traced.py); else the last step repeated from the
lists held in C++ (repeat.py) where nothing it depends on changed; else a planned step
(plan.py), which checks everything before any backend touches a tensor."""
import contextlib
import functools
import weakref
from collections import OrderedDict
from typing import Optional

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from . import plan as planning
from . import saved_codes, saved_state, traced
from .backends.base import ADAPNM_BUFFERS, PNM_BUFFERS, Scaling
from .batching import BatchCache
from .hyper import (ADAPNM_KEYS, BACKEND_NAMES, PNM_KEYS, saved_state_dtype,
                    state_dtype_from_saved, validate_group)
from .in_backward import StepInBackward
from .params import local
from .plan import Planner
from .repeat import RepeatedStep
from .counters import as_step, convertible_step
from .state import REFUSED_LOAD, OptimizerState, ParamState, put, tracked

BACKENDS = BACKEND_NAMES
# The group keys load_state_dict keeps from the loading optimizer (how it runs).
_KEPT_ON_LOAD = ("state_dtype", "backend")
# torch's __setstate__ adds its own flags to the defaults; the step has no use for them, so
# they stay out of the groups (and of every state_dict a reloaded optimizer saves).
_TORCH_ADDED_DEFAULTS = ("differentiable",)


def _outside_inference_mode(method):
    """Runs `method` outside torch.inference_mode() where it is called inside: the state it
    makes would be inference tensors, which no later step outside the mode may write (torch's
    optimizers leave them so). Asked after is_compiling: dynamo cannot trace the question.
    (inference_mode(False) enables grad; the caller had none.)"""
    @functools.wraps(method)
    def run(*args, **kwargs):
        if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():
                return method(*args, **kwargs)
        return method(*args, **kwargs)
    return run


class _PositiveNegativeMomentum(Optimizer):
    _adaptive = False
    _buffer_names: tuple[str, ...] = PNM_BUFFERS
    _keys: tuple[str, ...] = PNM_KEYS
    # GradScaler then hands over grad_scale/found_inf instead of unscaling on the host.
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults):
        validate_group(dict(defaults, params=[]), self._adaptive, "defaults")
        super().__init__(params, defaults)
        self.state = OptimizerState()
        self._new_step_paths()
        self._own_state_dict_hooks()

    def _own_state_dict_hooks(self) -> None:
        """What state_dict() needs of ours (plain entries, state_dtype by name, the int8
        codes' mark), where missing: torch's pickling (deepcopy too) keeps no hook."""
        post = self._optimizer_state_dict_post_hooks.values()
        for hook in (_plain_state_entries, _state_dtypes_by_name, saved_codes.mark):
            if hook not in post:
                self.register_state_dict_post_hook(hook, prepend=True)
        if saved_codes.hold_key_pre_hook not in self._optimizer_state_dict_pre_hooks.values():
            self.register_state_dict_pre_hook(saved_codes.hold_key_pre_hook)

    def _new_step_paths(self) -> None:
        """What the step keeps between steps, each part owning its cache: the planner (each
        group's batches and validated hyper-parameters), the lists built for each batch, and
        the last step as held in C++. Not part of the optimizer's pickled state."""
        self._planner = Planner(self._adaptive, self._keys)
        self._batches = BatchCache()
        # The StepInBackward handle while the step runs in backward.
        self._in_backward: Optional[StepInBackward] = None
        self._repeat = RepeatedStep()
        # This optimizer, as a wrapper that copies its __dict__ (older Lightning's
        # LightningOptimizer, whose step() calls it) finds it: step_in_backward, zero_grad.
        self._wrapped = weakref.ref(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.state = tracked(self.state)
        handle = getattr(self, "_in_backward", None)  # load_state_dict comes here too
        self._new_step_paths()
        self._in_backward = handle
        self._own_state_dict_hooks()
        for key in _TORCH_ADDED_DEFAULTS:  # nor into a group added later
            self.defaults.pop(key, None)
        for group in self.param_groups:  # groups saved before a key existed get its default
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        saved_codes.hold_key(self.param_groups)

    @_outside_inference_mode  # what it converts is then made of ordinary tensors
    def load_state_dict(self, state_dict: dict) -> None:
        # The hooks run where torch runs them around its loading, here around ours: the
        # pre-hooks first (a user's converter of another optimizer's checkpoint is checked
        # as it returns it), the post-hooks once this optimizer's state is final.
        handle = self.step_in_backward_handle
        if handle is not None:
            handle.before_load()
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if isinstance(state_dict.get("param_groups"), list):
            state_dict["param_groups"] = [
                {**group, "state_dtype": state_dtype_from_saved(group["state_dtype"])}
                if isinstance(group, dict) and "state_dtype" in group else group
                for group in state_dict["param_groups"]]
        # Checked before anything is replaced: a state_dict of another optimizer (AdamW's
        # two betas) is refused here, not at the next step with the groups already loaded.
        for gi, group in enumerate(state_dict.get("param_groups", [])):
            validate_group({**self.defaults, **group}, self._adaptive,
                           f"state_dict['param_groups'][{gi}]")
        saved_state.refuse_malformed_entries(state_dict)
        saved_state.refuse_foreign_state(state_dict, self._buffer_names, self._keys,
                                         type(self).__name__,
                                         bool(self._optimizer_load_state_dict_pre_hooks))
        saved_state.refuse_negative_scales(state_dict, self._buffer_names)
        saved_state.refuse_meta_state(state_dict, self.param_groups)
        state_dict = saved_codes.refuse_codes_read_as_values(self, state_dict)
        saved = saved_state.saved_tensors(state_dict, self.param_groups)
        # state_dtype and backend say how this optimizer stores its state and steps, not how
        # the saved run did: a checkpoint's state converts to it (docs/design.md §7), as its
        # tensors move to the parameters' device, and a checkpoint of a GPU's Triton run
        # steps on the CPU's fused kernel.
        kept = [{key: group[key] for key in _KEPT_ON_LOAD} for group in self.param_groups]
        with _load_hooks_set_aside(self):
            super().load_state_dict(state_dict)  # its state made counted by __setstate__
        for group, own in zip(self.param_groups, kept):
            group.update(own)
        saved_codes.hold_key(self.param_groups)
        self._batches.drop()
        loaded = [(p, self.state[p]) for group in self.param_groups for p in group["params"]
                  if self.state.get(p)]
        for p, state in loaded:
            # torch casts every floating state tensor to its parameter's dtype: float32
            # state beside bfloat16 parameters would lose its digits, a seed its value.
            # Each keeps its own dtype; the step converts it to the group's state_dtype.
            # The saved tensor itself is kept where it is on the parameter's device, as
            # torch keeps those it does not cast: every key of an entry then shares
            # alike (int8 codes beside their scales), none copied twice.
            for key, value in saved.get(p, {}).items():
                if key in state and torch.is_tensor(state[key]) and state[key].dtype != value.dtype:
                    put(state, key, value.to(device=state[key].device))
            # Tensors made under torch.inference_mode() (a checkpoint read there), which no
            # step outside it may write, are copied.
            for key, value in list(state.items()):
                if torch.is_tensor(value) and local(value).is_inference():
                    put(state, key, value.clone())
        for p, state in loaded:
            # Step counters as the backends take them, once every entry has its own dtypes
            # back; one that cannot be (no number, past a float) is left for the step to
            # refuse, naming it: a load that raised here would be half done.
            if convertible_step(state.get("step")):
                put(state, "step", as_step(state["step"], p))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def add_param_group(self, param_group: dict) -> None:
        where = f"param_groups[{len(self.param_groups)}]"
        # A group made from a saved one names its state_dtype (the keyword takes a dtype).
        if "state_dtype" in param_group:
            param_group["state_dtype"] = state_dtype_from_saved(param_group["state_dtype"])
        validate_group({**self.defaults, **param_group}, self._adaptive, where)
        params = param_group.get("params")
        if not isinstance(params, (torch.Tensor, set, type(None))):
            param_group["params"] = params = list(params)  # a generator can be read once
            first: dict[int, int] = {}
            for i, item in enumerate(params):
                tensor = item[1] if isinstance(item, tuple) else item  # (name, tensor) too
                if id(tensor) in first:
                    # torch's optimizers warn that this will be an error; here the backends
                    # would each do something else with it.
                    raise ValueError(
                        f"{where}['params'][{i}] is the same tensor as "
                        f"{where}['params'][{first[id(tensor)]}]; a parameter may appear "
                        "only once")
                first[id(tensor)] = i
        handle = self.step_in_backward_handle
        if handle is not None:  # refused before it is added
            items = [params] if isinstance(params, torch.Tensor) else params or []
            handle.refuse_params((f"{where}['params'][{i}]",
                                  item[1] if isinstance(item, tuple) else item)
                                 for i, item in enumerate(items))
        super().add_param_group(param_group)
        saved_codes.hold_key(self.param_groups[-1:])
        if handle is not None:  # its parameters step in backward too
            handle.watch(self.param_groups[-1]["params"])

    @torch.no_grad()
    @_outside_inference_mode
    def step(self, closure=None):  # typed by Optimizer.step's overloads, as torch's own
        """Performs one optimization step. ``closure`` re-evaluates the model and returns the
        loss. Under torch.amp.GradScaler, grad_scale/found_inf are applied in the step."""
        scaling = Scaling.of(self)  # raises, naming it, before anything is touched
        handle = self._in_backward
        if handle is None:
            return self._step(closure, scaling)
        handle.refuse_scaling(scaling)  # before a closure's backward steps anything
        loss = None
        if closure is not None:  # Lightning's: its backward steps inside, step() then finishes
            with torch.enable_grad():
                loss = closure()
        handle.before_step()  # refuses what a step in backward cannot apply
        try:
            self._step(None, scaling)
            return loss
        finally:
            handle.after_step()

    def _step(self, closure, scaling: Scaling):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if torch.compiler.is_compiling():
            traced.step(self, scaling)
            return loss
        names, planner, cache = self._buffer_names, self._planner, self._batches
        if self._repeat.run(self, scaling, planner, cache, names):
            return loss
        self._repeat.forget()  # remembered again only after a step like it
        plan = planner.plan(self, cache, names)  # raises before anything is touched
        if plan and plan[0].origin is not None:  # its gradients are checked by the kernel
            try:
                self._run(plan, scaling)
                return loss
            except RuntimeError as e:
                refusal = e
            # Outside the handler: an error naming the culprit is not chained to the refusal.
            if not planning.refusal_explained(self, plan[0], planner, cache, names):
                raise refusal
            plan = planner.plan(self, cache, names, defer=False)
        self._run(plan, scaling)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        handle = self.step_in_backward_handle  # a wrapper copying __dict__: the optimizer's
        if handle is not None:
            handle.zeroing(set_to_none)
        super().zero_grad(set_to_none)

    def step_in_backward(self, bucket_mib: float = 25.0, ddp=None) -> StepInBackward:
        """Steps each parameter inside backward as soon as its gradient is accumulated, then
        frees the gradient (docs/design.md §9): a model never holds all its gradients. Ready
        parameters are stepped together, about `bucket_mib` MiB of gradients at a time, by
        the ordinary fused step; the result is the ordinary step's.

        The first step after this call is an ordinary one, which refuses what cannot be
        applied to gradients that are gone: GradScaler, gradients changed between backward
        and step (clipping), hyper-parameters set between them (a scheduler stepped before
        ``step()``), several backward passes a step (accumulate inside
        ``handle.accumulating()`` instead). Afterwards ``optimizer.step()`` and
        ``zero_grad()`` in the training loop are harmless (nothing is left to step);
        ``step(closure)`` (Lightning's) runs the closure, whose backward steps, then finishes.
        FSDP2's sharded parameters step once their gradients are reduce-scattered. Under
        DDP pass the model (``ddp=model``, or a list of models): its parameters then step in
        DDP's communication hook, each of DDP's buckets once its all-reduce is done (DDP's
        buckets, sized by its ``bucket_cap_mb``; the gradients kept, as DDP's buckets hold
        them anyway); plain tensors under several ranks that no DDP model given reduces are
        refused (the step would come before the all-reduce).

        Returns the handle: ``handle.remove()``, or ``with opt.step_in_backward(): ...``,
        restores the ordinary step (``opt.step_in_backward_handle`` gives it again). Called on
        a wrapper that copied this optimizer's ``__dict__`` (Lightning's), the handle is the
        wrapped optimizer's, whose step() the wrapper calls.
        """
        wrapped = getattr(self, "_wrapped", lambda: None)()
        if wrapped is not None and wrapped is not self:
            return wrapped.step_in_backward(bucket_mib, ddp)
        return StepInBackward(self, bucket_mib, ddp)

    @property
    def step_in_backward_handle(self) -> Optional[StepInBackward]:
        """The handle of ``step_in_backward()`` while this optimizer steps inside backward
        (None otherwise), to ``remove()`` where the returned one was not kept."""
        wrapped = getattr(self, "_wrapped", lambda: None)()
        # (None while __init__ adds the first groups)
        return getattr(wrapped if wrapped is not None else self, "_in_backward", None)

    @torch.no_grad()
    @_outside_inference_mode
    def _step_only(self, params, first_of_pass: bool = False) -> None:
        """An ordinary step of these parameters alone (a bucket of the step in backward; the
        first of a backward pass checked against all others' memory where any moved)."""
        names, planner, cache = self._buffer_names, self._planner, self._batches
        self._repeat.forget()  # the repeated step stands for a whole step, not a bucket
        if first_of_pass:
            cache.drop_if_moved(self)
        plan = planner.plan(self, cache, names, defer=False, only={id(p) for p in params})
        planning.run(self, plan, planner, cache, names, Scaling(), bucket=True)

    def _run(self, plan, scaling: Scaling) -> None:
        names, planner, cache = self._buffer_names, self._planner, self._batches
        batches = planning.run(self, plan, planner, cache, names, scaling)
        self._repeat.remember(self, plan, batches, planner, cache, names)

    # Never compiled as a frame of its own: when a graph break leaves the traced step running
    # eagerly, dynamo compiled this alone and specialised its state lookups on the first
    # parameter, unguarded (every group got the first one's state). torch's own way of
    # disabling dynamo, imported when first called.
    @torch._disable_dynamo
    def _init_group(self, group, gi, params, grads, buffer0, buffer1, buffer2, buffer3, steps,
                    seeds, scale0, scale1, scale2, scale3):
        """For torch.compile, which runs this untraced as it runs torch's optimizers' own
        (see traced.init_group)."""
        return traced.init_group(self, group, gi, params, grads, buffer0, buffer1, buffer2,
                                 buffer3, steps, seeds, [scale0, scale1, scale2, scale3])


def _plain_state_entries(optimizer, state_dict) -> None:
    """state_dict post-hook: plain dicts, which torch.load(weights_only=True) accepts, without
    REFUSED_LOAD (DCP would ask a checkpoint for it, and the load that mends the entry fail)."""
    state_dict["state"] = {
        key: {k: v for k, v in entry.items() if k != REFUSED_LOAD}
        if isinstance(entry, dict) and REFUSED_LOAD in entry
        else dict(entry) if isinstance(entry, ParamState) else entry
        for key, entry in state_dict["state"].items()}


def _state_dtypes_by_name(optimizer, state_dict) -> None:
    """state_dict post-hook: each saved group's state_dtype by name (hyper.saved_state_dtype)."""
    for saved in state_dict["param_groups"]:
        saved["state_dtype"] = saved_state_dtype(saved.get("state_dtype"))


@contextlib.contextmanager
def _load_hooks_set_aside(optimizer):
    """torch's load_state_dict without the load hooks, which the caller runs itself."""
    pre, post = (optimizer._optimizer_load_state_dict_pre_hooks,
                 optimizer._optimizer_load_state_dict_post_hooks)
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()
    try:
        yield
    finally:
        optimizer._optimizer_load_state_dict_pre_hooks = pre
        optimizer._optimizer_load_state_dict_post_hooks = post


class PNM(_PositiveNegativeMomentum):
    r"""Positive-Negative Momentum (Xie et al., ICML 2021, Algorithm 2): SGD with momentum
    whose gradient noise is enlarged on purpose, which finds flatter minima.

    Two momentum buffers take alternate steps' gradients, each an average decaying by
    ``beta1**2`` a step. The step goes along ``(1+b0) * m_now - b0 * m_other``, divided by
    the noise norm ``sqrt((1+b0)**2 + b0**2)`` (2.24 at the default ``b0 = 1``), so that the
    step's size stays that of ordinary momentum; the noise it carries is enlarged.

    Args:
        params: parameters, or param groups (dicts) with their own hyper-parameters.
        lr: learning rate (float or one-element tensor, e.g. for a compiled step). The
            momentum is an average, not torch SGD's sum: ``lr/(1-beta1)`` gives the step of
            ``SGD(lr, momentum=beta1)``, before the noise normalisation.
        betas: ``(beta1, beta0)``: ``beta1`` in [0, 1) is the momentum coefficient;
            ``beta0`` (any real) is the positive-negative coefficient, how strongly the
            other buffer is subtracted. ``beta0 = -beta1/(1+beta1)`` is ordinary EMA momentum
            up to the normalisation; the paper's default is 1.
        weight_decay: weight-decay coefficient.
        decoupled: decoupled (AdamW-style) weight decay, ``p *= 1 - lr*weight_decay``;
            False adds ``weight_decay * p`` to the gradient (L2), without writing ``p.grad``.
        maximize: maximize the objective instead of minimizing it.
        backend: "auto" (the fastest available), "fused" (compiled CPU/CUDA kernels),
            "triton", "foreach" or "reference" (pnm_kernels/reference.py, the ground truth).
        state_dtype: the dtype of the momentum buffers: None (the parameter's), torch.float32,
            torch.bfloat16 (half the memory; written with stochastic rounding, so the
            averages do not stall; docs/design.md §7) or torch.int8 (block-wise codes, a
            float32 scale per 128 elements of a row, codes rounded stochastically: about
            2.06 bytes a parameter; §8). The arithmetic is float32 for all three.
        bf16_stochastic_round: write bfloat16 parameters (and any bfloat16 buffer) with
            stochastic rounding: pure-bf16 training without float32 master weights, where
            rounding to nearest loses updates smaller than half a bf16 ulp. Other dtypes are
            unaffected.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> opt = PNM(model.parameters(), lr=0.1, betas=(0.9, 1.0), weight_decay=5e-4)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    _adaptive = False
    _buffer_names = PNM_BUFFERS

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 1.0), weight_decay: float = 0.0,
                 decoupled: bool = True, maximize: bool = False, backend: str = "auto",
                 state_dtype: torch.dtype | None = None,
                 bf16_stochastic_round: bool = False) -> None:
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, decoupled=decoupled,
                        maximize=maximize, backend=backend, state_dtype=state_dtype,
                        bf16_stochastic_round=bf16_stochastic_round)
        super().__init__(params, defaults)


class AdaPNM(_PositiveNegativeMomentum):
    r"""Adaptive Positive-Negative Momentum (Xie et al., ICML 2021, Algorithm 3): AdamW with
    positive-negative momentum, and AMSGrad by default.

    As Adam, the step is the first moment over the square root of the second, both
    bias-corrected; the first moment is PNM's: two buffers taking alternate steps' gradients,
    combined as ``(1+b0) * m_now - b0 * m_other`` and divided by the noise norm
    ``sqrt((1+b0)**2 + b0**2)`` (2.24 at the default ``b0 = 1``). So where the gradient
    holds steady, a step is 1/2.24 of Adam's at equal ``lr``, while the gradient noise it
    carries is enlarged relative to that (the point of the method).

    Args:
        params: parameters, or param groups (dicts) with their own hyper-parameters.
        lr: learning rate (float or one-element tensor).
        betas: ``(beta1, beta2, beta0)``: ``beta1`` in [0, 1), the first moment's decay
            (per two steps, as ``beta1**2`` a step, since each buffer takes every other
            gradient); ``beta2`` in [0, 1), the second moment's; ``beta0`` (any real), the
            positive-negative coefficient. ``beta0 = -beta1/(1+beta1)`` with
            ``amsgrad=False`` is Adam(W), up to the noise normalisation.
        eps: added to the denominator after bias correction.
        weight_decay: weight-decay coefficient.
        amsgrad: divide by the running maximum of the second moment (the paper's default).
        decoupled: decoupled (AdamW-style) weight decay, ``p *= 1 - lr*weight_decay``;
            False adds ``weight_decay * p`` to the gradient (L2), without writing ``p.grad``.
        maximize: maximize the objective instead of minimizing it.
        backend: "auto" (the fastest available), "fused" (compiled CPU/CUDA kernels),
            "triton", "foreach" or "reference" (pnm_kernels/reference.py, the ground truth).
        state_dtype: the dtype of all four buffers: None (the parameter's), torch.float32,
            torch.bfloat16 (half the memory; written with stochastic rounding;
            docs/design.md §7) or torch.int8 (block-wise codes with a float32 scale per 128
            elements of a row, the second moments on their own map; §8). The arithmetic is
            float32 for all three.
        bf16_stochastic_round: write bfloat16 parameters (and any bfloat16 buffer) with
            stochastic rounding, as for PNM.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> opt = AdaPNM(model.parameters(), lr=1e-3, betas=(0.9, 0.999, 1.0),
        ...              weight_decay=0.01)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> opt.zero_grad()
    """

    _adaptive = True
    _buffer_names = ADAPNM_BUFFERS
    _keys = ADAPNM_KEYS

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float, float] = (0.9, 0.999, 1.0), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = True, decoupled: bool = True,
                 maximize: bool = False, backend: str = "auto",
                 state_dtype: torch.dtype | None = None,
                 bf16_stochastic_round: bool = False) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        decoupled=decoupled, maximize=maximize, backend=backend,
                        state_dtype=state_dtype, bf16_stochastic_round=bf16_stochastic_round)
        super().__init__(params, defaults)
