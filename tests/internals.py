"""Every place where a test reaches into an optimizer's or a backend's internals, as small
named helpers.

The tests observe a few things no public API shows (whether a step planned or repeated the
last one, a kernel refusing a step, an install without the compiled extension, a CUDA graph
capture simulated on the CPU, the Triton launch tables, the buckets stepped inside
backward). They do it only through this module, so that a rewrite of the package's internals
updates this one file; each helper says what it observes and which internal it touches.
(Tests of a module's own functions, such as quantization's, rounding's, aliasing's or the
ops in _ops, import that module: its functions are what they specify.)

No import of conftest here: tests/_triton_compile_check.py imports this module in a process
that must not set TRITON_INTERPRET. pnm_kernels.backends.triton_kernels is imported lazily,
where triton is needed.
"""
import torch

import pnm_kernels.backends as backends
from pnm_kernels import aliasing, batching, plan, traced
from pnm_kernels.backends import base, fused
from pnm_kernels.backends import triton_tables
from pnm_kernels.hyper import Hyper


def _triton_kernels():
    from pnm_kernels.backends import triton_kernels

    return triton_kernels


# --- the optimizer's step paths (pnm_kernels/optimizers.py) --------------------------------

def count_planned_steps(opt, monkeypatch):
    """A list that grows by one at each step of `opt` that plans (a repeated step, which
    reuses the last step's plan and held lists, does not). Wraps `opt._planner.plan`."""
    plans = []
    planner = opt._planner
    original = planner.plan
    monkeypatch.setattr(planner, "plan", lambda *a, **k: plans.append(1) or original(*a, **k))
    return plans


def record_repeated_steps(opt, monkeypatch):
    """A list that gets, at each step of `opt`, whether it repeated the last step (True) or
    had to plan (False). Wraps `opt._repeat.run`, which every step tries first."""
    repeated, repeat = [], opt._repeat
    run = repeat.run
    monkeypatch.setattr(repeat, "run", lambda *a: repeated.append(run(*a)) or repeated[-1])
    return repeated


def never_remember_steps(opt):
    """`opt` with every step planned: the step it remembers (to repeat it) is forgotten at
    once. The yardstick for "repeated steps give what planned ones give". Replaces
    `opt._repeat.remember` on the instance."""
    opt._repeat.remember = lambda *a, **k: None
    return opt


def count_batch_builds(opt):
    """A list that grows by one each time `opt` builds a batch (the tensor lists a kernel
    steps). Wraps `opt._batches.build` on the instance, for as long as `opt` lives."""
    builds = []
    cache = opt._batches
    build = cache.build
    cache.build = lambda *a, **k: builds.append(1) or build(*a, **k)
    return builds


def state_buffer_names(opt):
    """The names of the state buffers `opt` keeps for each parameter, in the kernels' order
    (PNM's two momenta; AdaPNM's adds the second moment and its maximum): `opt._buffer_names`."""
    return opt._buffer_names


# --- the step inside backward (pnm_kernels/in_backward.py) ----------------------------------

def record_bucket_steps(opt):
    """A list that gets, for each bucket `opt` steps by itself, (how many parameters, inside a
    backward pass?). Wraps `opt._step_only` on the instance."""
    calls = []
    step_only = opt._step_only

    def counted(params, **kwargs):
        calls.append((len(params), torch._C._current_graph_task_id() != -1))
        step_only(params, **kwargs)
    opt._step_only = counted
    return calls


# --- the backends (pnm_kernels/backends/) ---------------------------------------------

def refuse_next_held_fused_step(monkeypatch):
    """The next fused step on held lists (the one that takes the gradients itself) is
    refused by its kernel, as before anything is written; later ones run. Returns a list
    that gets one entry per refusal. Wraps `FusedBackend.prepare_repeat`'s launch."""
    prepare = fused.FusedBackend.prepare_repeat
    refusals = []

    def prepare_refusing_once(self, *args):
        launch = prepare(self, *args)

        def refuse_once(scaling):
            if not refusals:
                refusals.append(1)
                raise RuntimeError("refused (test)")
            return launch(scaling)
        return refuse_once

    monkeypatch.setattr(fused.FusedBackend, "prepare_repeat", prepare_refusing_once)
    return refusals


def extension_unavailable(monkeypatch, reason):
    """The backends see no compiled extension (pnm_kernels._C), for `reason`; nothing else
    changes. Sets `extension_error` wherever the package reads it."""
    for module in (base, fused, aliasing, batching, backends, traced):
        monkeypatch.setattr(module, "extension_error", lambda: reason)


def python_gradient_checks(monkeypatch):
    """The gradients are checked in Python, as without the compiled extension, instead of
    by its native check. Sets `plan._native_check` to None."""
    monkeypatch.setattr(plan, "_native_check", None)


def triton_only_install(monkeypatch):
    """As on an install with triton but without pnm_kernels._C: the extension is missing
    and every check of gradients and held lists is the Python one."""
    extension_unavailable(monkeypatch, "not built, for the test")
    python_gradient_checks(monkeypatch)


def extension_is_built():
    """Whether the backends find the compiled extension."""
    return base.extension_error() is None


def simulate_cuda_graph_capture(monkeypatch):
    """Every step sees a CUDA graph capture under way (on CPU tensors too), as the backends
    ask before a host-reading step. Sets `capturing` where the backends read it;
    monkeypatch.undo() ends it."""
    for module in (backends, base):
        monkeypatch.setattr(module, "capturing", lambda device: True)


def unchecked_scaling(monkeypatch):
    """optimizer.step() hands optimizer.grad_scale/found_inf to the backends as they are,
    without the check that they are float32 tensors of one element (Scaling.of), so that
    the kernels' own checks can be reached."""
    monkeypatch.setattr(base.Scaling, "of", staticmethod(
        lambda opt: base.Scaling(getattr(opt, "grad_scale", None),
                                 getattr(opt, "found_inf", None))))


def resolve_auto_backend(device, dtype, int8=False):
    """The backend "auto" picks for parameters of `dtype` on `device` (with int8 state)."""
    return backends.resolve_backend("auto", device, dtype, int8=int8)


def kernels_take_only_their_own_dtypes(monkeypatch):
    """The fused and the Triton kernels count as available (a CUDA device without one
    present) for exactly the dtypes each is built for. Sets the backends'
    `triton_unavailable_reason` and `fused_unavailable_reason` from their DTYPES."""
    def takes(dtypes):
        return lambda device, dtype: None if dtype in dtypes else "dtype"

    monkeypatch.setattr(backends, "triton_unavailable_reason", takes(backends.TRITON_DTYPES))
    monkeypatch.setattr(backends, "fused_unavailable_reason", takes(backends.FUSED_DTYPES))


def fused_kernels_unavailable(monkeypatch, reason="no CUDA"):
    """The fused kernels count as unavailable for every device and dtype."""
    monkeypatch.setattr(backends, "fused_unavailable_reason", lambda device, dtype: reason)


def make_batch(params, grads, buffers, steps):
    """One batch as the backends hand it to a kernel: parameters, gradients, the state
    buffer lists and the step counters; its `buffers`, `steps` and `grads` lists may be
    edited. Builds a `backends.base.Batch`."""
    return base.Batch(params, grads, buffers, steps)


# --- the Triton backend (pnm_kernels/backends/triton.py, triton_kernels.py) -----------------

def run_triton_step(adaptive, batch, hp, grad_scale=None, found_inf=None):
    """One Triton step of a batch from make_batch, `hp` the hyper-parameters as a dict
    (lr, beta1, beta2, beta0, eps, weight_decay, amsgrad, decoupled, maximize)."""
    hyper = Hyper(adaptive=adaptive, **hp)
    return backends.REGISTRY["triton"].step(batch, hyper, base.Scaling(grad_scale, found_inf))


def simulate_triton_graph_capture(monkeypatch):
    """The Triton step sees a CUDA graph capture under way. Sets `capturing` where the Triton
    backends' tables read it (triton_tables.py)."""
    monkeypatch.setattr(triton_tables, "capturing", lambda device: True)


class _Recorder:
    """Stands in for a Triton kernel: launches it and records (kind, args, kwargs)."""

    def __init__(self, kernel, kind, launched):
        self.kernel, self.kind, self.launched = kernel, kind, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append((self.kind, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def record_triton_launches(monkeypatch):
    """A list that gets (kind, args, kwargs) for every Triton kernel launched, kind "step"
    or "increment" (the separate step counter kernel). Wraps
    `triton_kernels._step_kernel` and `triton_kernels._increment_steps_kernel`."""
    kernels = _triton_kernels()
    launched = []
    for attr, kind in (("_step_kernel", "step"), ("_increment_steps_kernel", "increment")):
        monkeypatch.setattr(kernels, attr, _Recorder(getattr(kernels, attr), kind, launched))
    return launched


def launch_ticket_counter(args):
    """The batch's ticket counter (the programs that finished, re-zeroed by the last one)
    among the positional arguments of a recorded step launch: the step kernel's 11th."""
    return args[10]


def triton_step_kernel():
    """The Triton step kernel itself (a triton.jit function): `triton_kernels._step_kernel`."""
    return _triton_kernels()._step_kernel


def triton_increment_steps_kernel():
    """The Triton kernel that increments step counters alone:
    `triton_kernels._increment_steps_kernel`."""
    return _triton_kernels()._increment_steps_kernel


def triton_launch_config(device, dtype, adaptive):
    """The launch configuration a Triton step uses on `device` for `dtype` storage.
    Calls `triton_kernels.launch_config`."""
    return _triton_kernels().launch_config(device, dtype, adaptive)


def triton_launch_config_type():
    """The launch configuration type (block, iters, num_warps):
    `triton_kernels.LaunchConfig`."""
    return _triton_kernels().LaunchConfig


def set_triton_launch_config(config):
    """Forces a launch configuration: one for every launch, a dict {(dtype, adaptive):
    config} for some, or None for the shipped tables. Calls `triton_kernels.set_launch_config`."""
    _triton_kernels().set_launch_config(config)


def shipped_triton_launch_configs():
    """The shipped launch tables: (by GPU generation, with an "interpreter" entry; per
    (generation, storage bytes, adaptive) for the pairs tuned apart; the default for
    unknown GPUs). Reads `triton_kernels._CONFIGS`, `_PER_OPTIMIZER_CONFIGS` and
    `_DEFAULT_CONFIG`."""
    kernels = _triton_kernels()
    return kernels._CONFIGS, kernels._PER_OPTIMIZER_CONFIGS, kernels._DEFAULT_CONFIG



# --- state in a dtype of its own (pnm_kernels/state.py, params.py) ---------------------------

def ensure_state(state, param, names, dtype=None, seed=None):
    """What a step does to a parameter's state entry before stepping it: the buffers `names`
    made, or converted to `dtype` where they have another (pnm_kernels.state.ensure_state);
    returns the entry and whether it was replaced."""
    from pnm_kernels.state import ensure_state as ensure

    return ensure(state, param, names, dtype, seed=seed)


def element_offset(param):
    """The elements of the whole parameter before this rank's shard: the offset of the index
    that picks each element's random bits (pnm_kernels.params.element_offset)."""
    from pnm_kernels.params import element_offset as offset

    return offset(param)
