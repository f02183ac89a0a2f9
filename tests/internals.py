"""Every place where a test reaches into pnm_kernels' internals, as small named helpers.

The tests observe a few things no public API shows (whether a step planned or repeated the
last one, a kernel refusing a step, an install without the compiled extension, a CUDA graph
capture simulated on the CPU, the Triton launch tables). They do it only through this
module, so that a rewrite of the package's internals updates this one file; each helper
says what it observes and which internal it touches.

No import of conftest here: tests/_triton_compile_check.py imports this module in a process
that must not set TRITON_INTERPRET. pnm_kernels.triton_kernels is imported lazily, where
triton is needed.
"""
from pnm_kernels import _backends


def _triton_kernels():
    from pnm_kernels import triton_kernels

    return triton_kernels


# --- the optimizer's step paths (pnm_kernels/optimizers.py) --------------------------------

def count_planned_steps(opt, monkeypatch):
    """A list that grows by one at each step of `opt` that plans (a repeated step, which
    reuses the last step's plan and held lists, does not). Wraps `opt._plan`."""
    plans = []
    plan = opt._plan
    monkeypatch.setattr(opt, "_plan", lambda *a, **k: plans.append(1) or plan(*a, **k))
    return plans


def record_repeated_steps(opt, monkeypatch):
    """A list that gets, at each step of `opt`, whether it repeated the last step (True) or
    had to plan (False). Wraps `opt._repeat_step`, which every step tries first."""
    repeated, repeat_step = [], opt._repeat_step
    monkeypatch.setattr(opt, "_repeat_step",
                        lambda *a: repeated.append(repeat_step(*a)) or repeated[-1])
    return repeated


def never_remember_steps(opt):
    """`opt` with every step planned: the step it remembers (to repeat it) is forgotten at
    once. The yardstick for "repeated steps give what planned ones give". Replaces
    `opt._remember_step` on the instance."""
    opt._remember_step = lambda plan, batches: None
    return opt


def count_batch_builds(opt):
    """A list that grows by one each time `opt` builds a batch (the tensor lists a kernel
    steps). Wraps `opt._build_batch` on the instance, for as long as `opt` lives."""
    builds = []
    build = opt._build_batch
    opt._build_batch = lambda *a, **k: builds.append(1) or build(*a, **k)
    return builds


# --- the backends (pnm_kernels/_backends.py) ----------------------------------------------

def refuse_next_held_fused_step(monkeypatch):
    """The next fused step on held lists (the one that takes the gradients itself) is
    refused by its kernel, as before anything is written; later ones run. Returns a list
    that gets one entry per refusal. Wraps `_backends.run_fused_own_grads`."""
    run = _backends.run_fused_own_grads
    refusals = []

    def refuse_once(*args):
        if not refusals:
            refusals.append(1)
            raise RuntimeError("refused (test)")
        return run(*args)

    monkeypatch.setattr(_backends, "run_fused_own_grads", refuse_once)
    return refusals


def extension_unavailable(monkeypatch, reason):
    """The backends see no compiled extension (pnm_kernels._C), for `reason`; nothing else
    changes. Sets `_backends.extension_error`."""
    monkeypatch.setattr(_backends, "extension_error", lambda: reason)


def python_gradient_checks(monkeypatch):
    """The gradients are checked in Python, as without the compiled extension, instead of
    by its native check. Sets `_backends.first_mismatched_grad` to None."""
    monkeypatch.setattr(_backends, "first_mismatched_grad", None)


def triton_only_install(monkeypatch):
    """As on an install with triton but without pnm_kernels._C: the extension is missing
    and every check of gradients and held lists is the Python one. Sets
    `_backends.extension_error` and `_backends.first_mismatched_grad`."""
    extension_unavailable(monkeypatch, "not built, for the test")
    python_gradient_checks(monkeypatch)


def extension_is_built():
    """Whether the backends find the compiled extension. Calls `_backends.extension_error`."""
    return _backends.extension_error() is None


def simulate_cuda_graph_capture(monkeypatch):
    """Every step sees a CUDA graph capture under way (on CPU tensors too), as the backends
    ask before a host-reading step. Sets `_backends.capturing`; monkeypatch.undo() ends it."""
    monkeypatch.setattr(_backends, "capturing", lambda device: True)


def resolve_auto_backend(device, dtype):
    """The backend "auto" picks for parameters of `dtype` on `device`. Calls
    `_backends.resolve_backend`."""
    return _backends.resolve_backend("auto", device, dtype)


def kernels_take_only_their_own_dtypes(monkeypatch):
    """The fused and the Triton kernels count as available (a CUDA device without one
    present) for exactly the dtypes each is built for. Sets
    `_backends.triton_unavailable_reason` and `_backends.fused_unavailable_reason` from
    `_backends.TRITON_DTYPES` and `_backends.FUSED_DTYPES`."""
    def takes(dtypes):
        return lambda device, dtype: None if dtype in dtypes else "dtype"

    monkeypatch.setattr(_backends, "triton_unavailable_reason", takes(_backends.TRITON_DTYPES))
    monkeypatch.setattr(_backends, "fused_unavailable_reason", takes(_backends.FUSED_DTYPES))


def fused_kernels_unavailable(monkeypatch, reason="no CUDA"):
    """The fused kernels count as unavailable for every device and dtype. Sets
    `_backends.fused_unavailable_reason`."""
    monkeypatch.setattr(_backends, "fused_unavailable_reason", lambda device, dtype: reason)


def make_batch(params, grads, buffers, steps):
    """One batch as the backends hand it to a kernel: parameters, gradients, the state
    buffer lists and the step counters; its `buffers`, `steps` and `grads` lists may be
    edited. Builds a `_backends.Batch`."""
    return _backends.Batch(params, grads, buffers, steps)


# --- the Triton kernels (pnm_kernels/triton_kernels.py) -----------------------------------

def run_triton_step(adaptive, batch, hp, grad_scale=None, found_inf=None):
    """One Triton step of a batch from make_batch, `hp` the hyper-parameters as a dict
    (lr, beta1, beta2, beta0, eps, weight_decay, amsgrad, decoupled, maximize). Calls
    `triton_kernels.step`."""
    return _triton_kernels().step(adaptive, batch, hp, grad_scale, found_inf)


def simulate_triton_graph_capture(monkeypatch):
    """The Triton step sees a CUDA graph capture under way. Sets `triton_kernels.capturing`."""
    monkeypatch.setattr(_triton_kernels(), "capturing", lambda device: True)


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

