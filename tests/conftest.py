"""Shared helpers. Without a GPU, Triton kernels run under the interpreter on CPU tensors;
TRITON_INTERPRET must be set before triton.jit decorates them, so it is set here."""
import copy
import io
import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import cases  # noqa: E402
from pnm_kernels._ops import extension_error, set_launch_limits  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
requires_extension = pytest.mark.skipif(extension_error() is not None,
                                        reason="pnm_kernels._C is not built")
try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_configure(config):
    # The interpreter evaluates the Triton kernels in numpy, masked-off lanes included, and an
    # all-zero int8 block divides by its zero scale by design (its codes are 0, as on every
    # path): numpy's floating-point warnings from there say nothing about a result.
    config.addinivalue_line("filterwarnings",
                            "ignore::RuntimeWarning:triton.runtime.interpreter")
# nvcc, for the checks that compile CUDA code without a GPU (on our machines /usr/local/bin/nvcc
# is a wrapper; the toolkit's own is the fallback).
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                if os.path.exists("/usr/local/cuda/bin/nvcc") else None)

# Every fast path this machine runs ("emulated" only without a GPU), from the table of
# cases (tests/cases.py).
FAST_PATHS = cases.FAST_PATHS


@pytest.fixture
def path(request, monkeypatch):
    """Selects a fast path; returns the backend name to pass to the optimizer."""
    name = request.param
    if name in ("fused", "emulated") and extension_error() is not None:
        pytest.skip("pnm_kernels._C is not built")
    if name == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    if name == "emulated":
        monkeypatch.setenv("PNM_KERNELS_EMULATE_CUDA", "1")
        return "fused"
    monkeypatch.delenv("PNM_KERNELS_EMULATE_CUDA", raising=False)
    return name


@pytest.fixture
def small_launches():
    """Tiny CUDA launch tables, so small tensors cross chunk and launch boundaries."""
    if extension_error() is None:
        set_launch_limits(chunk_size=64, max_tensors=3, max_blocks=4)
    yield
    if extension_error() is None:
        set_launch_limits()


OPTIMIZERS = cases.OPTIMIZERS


def make_params(shapes, dtype=torch.float32, device=DEVICE, seed=0, misaligned=False):
    """Leaf parameters with random values; misaligned ones start one element into a buffer."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        value = torch.randn(shape, generator=gen).to(dtype)
        if misaligned:
            numel = value.numel()
            storage = torch.zeros(numel + 1, dtype=dtype, device=device)
            p = storage[1:].view(shape).copy_(value)
        else:
            p = value.to(device)
        params.append(p.requires_grad_())
    return params


def clone_params(params):
    return [p.detach().clone().requires_grad_() for p in params]


def with_reference(name, backend, shapes, lr=1e-2):
    """(optimizer, params, reference optimizer, its params): the same starting parameters,
    one run on `backend`, one on the reference, to be compared after the same steps."""
    params = make_params(shapes)
    ref_params = clone_params(params)
    return (OPTIMIZERS[name](params, lr=lr, backend=backend), params,
            OPTIMIZERS[name](ref_params, lr=lr, backend="reference"), ref_params)


def grads_for_step(params, step, seed=1, skip_every=0):
    """Deterministic gradients; with skip_every, some parameters get none on some steps."""
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    grads = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.dtype).to(p.device)
        if p.is_complex():
            g = torch.complex(g.real, torch.randn(p.shape, generator=gen).to(g.real.dtype).to(p.device))
        skip = skip_every and (step + i) % skip_every == 0
        grads.append(None if skip else g)
    return grads


def train(opt, params, steps, seed=1, skip_every=0, start=0, like_params=False):
    """Steps with grads_for_step's gradients: contiguous, or with like_params laid out like
    their parameters, as autograd lays them out."""
    for t in range(start, start + steps):
        for p, g in zip(params, grads_for_step(params, t, seed, skip_every)):
            p.grad = torch.empty_like(p).copy_(g) if like_params and g is not None else g
        opt.step()


def assert_states_close(opt_a, params_a, opt_b, params_b, **tol):
    """Parameters and every state buffer (step included) agree."""
    for i, (pa, pb) in enumerate(zip(params_a, params_b)):
        torch.testing.assert_close(pa.detach(), pb.detach(), msg=lambda m: f"param {i}: {m}", **tol)
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert sa.keys() == sb.keys(), f"param {i}: state keys {sa.keys()} vs {sb.keys()}"
        for key in sa:
            torch.testing.assert_close(sa[key], sb[key], msg=lambda m: f"param {i} {key}: {m}", **tol)


def assert_close_codes(opt_a, params_a, opt_b, params_b):
    """Parameters and floating state agree to rounding; int8 codes are alike but where one
    side rounded the other way (one step away, in one element of a thousand at most)."""
    for p, q in zip(params_a, params_b):
        torch.testing.assert_close(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for key, value in opt_a.state[p].items():
            other = opt_b.state[q][key]
            assert value.dtype == other.dtype, key
            if value.is_floating_point():
                torch.testing.assert_close(value, other, msg=key)
            else:
                differs = value.int() != other.int()
                assert differs.float().mean() <= 1e-3, key
                assert (value.int() - other.int()).abs().max() <= 1, key


def made_under_inference_mode(value):
    """A tensor's copy made under torch.inference_mode() (an inference tensor); anything
    else as it is."""
    if not torch.is_tensor(value):
        return value
    with torch.inference_mode():
        return value.clone()


def assert_same_bits(opt_a, params_a, opt_b, params_b):
    """Parameters and every state tensor bitwise equal, dtypes included."""
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q)
        assert_same_entry(opt_a.state[p], opt_b.state[q])


def assert_same_entry(entry, other):
    """Two parameters' state entries: the same keys, each tensor bitwise, dtypes included
    (anything else equal)."""
    assert entry.keys() == other.keys()
    for key, value in entry.items():
        if not torch.is_tensor(value):
            assert value == other[key], key
            continue
        assert value.dtype == other[key].dtype and torch.equal(value, other[key]), key


def round_trip(state_dict):
    """Through torch.save and torch.load(weights_only=True), as a checkpoint goes."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def second_parameter_restarted_after_three_steps(name, path, restart):
    """Three steps, restart(opt, params) on both runs, three more: the second parameter has
    fresh state (3 steps), the others carry on (6), and the fast path matches the reference."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        restart(o, ps)
        train(o, ps, 3, start=3)
    assert opt.state[params[1]]["step"].item() == 3 and opt.state[params[0]]["step"].item() == 6
    assert_states_close(opt, params, ref, ref_params)



def user_event(opt, params, events, name):
    """One thing users do between steps, drawn at random from `events` (or nothing): an lr
    scaled or switched between a float and a tensor, AMSGrad, decoupled decay or maximize
    switched, weight decay or b0 changed, a parameter's state deleted or a buffer of it
    replaced, the state_dict reloaded. Returns the draw in [0, 1) and the parameter index
    drawn, for the caller's own events, which take draws from 0.24 up."""
    event, k = events.random(), events.randrange(len(params))
    group = opt.param_groups[events.randrange(len(opt.param_groups))]
    if event < 0.05:
        group["lr"] *= 0.7
    elif event < 0.08 and name == "AdaPNM":
        group["amsgrad"] = not group["amsgrad"]
    elif event < 0.10:
        opt.state.pop(params[k], None)
    elif event < 0.12:
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    elif event < 0.14:
        group["decoupled"] = not group["decoupled"]
    elif event < 0.16 and opt.state.get(params[k]):
        state = opt.state[params[k]]
        key = events.choice(sorted(state.keys() - {"step"}))
        state[key] = state[key] * 0.5
    elif 0.16 <= event < 0.18:
        group["weight_decay"] = events.choice([0.0, 0.05, 0.2])
    elif event < 0.20:
        group["maximize"] = not group["maximize"]
    elif event < 0.22:
        group["betas"] = (*group["betas"][:-1], events.choice([1.0, 0.0, -0.4, 2.0]))
    elif event < 0.24:
        lr = group["lr"]
        group["lr"] = float(lr) if torch.is_tensor(lr) else torch.tensor(lr)
    return event, k
