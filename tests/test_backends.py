"""Every fast path computes what reference.py computes: parameters and every state buffer,
over many odd and even steps, awkward sizes, both weight-decay modes, AMSGrad on and off,
several b0, several param groups, and parameters that skip steps (docs/design.md §4)."""
import pytest
import torch

import cases
from cases import FAST_PATHS, FLOAT64_FAST_PATHS, OVER_OPTIMIZERS
from conftest import (DEVICE, HAS_CUDA, OPTIMIZERS, assert_close_codes, assert_states_close,
                      clone_params, make_params, train, with_reference)
from internals import (fused_kernels_unavailable, kernels_take_only_their_own_dtypes,
                       launch_ticket_counter, make_batch, record_triton_launches,
                       resolve_auto_backend, run_triton_step, set_triton_launch_config,
                       shipped_triton_launch_configs, triton_launch_config,
                       triton_launch_config_type)

B1 = 0.9
B0_VALUES = [1.0, 0.0, -B1 / (1 + B1), 3.0]
# numel 1, 3, 4, a 0-dim and an empty tensor, odd 2-D shapes, and sizes that are not
# multiples of any vector width. The interpreter gets smaller ones to stay fast.
SHAPES = {"large": [(1,), (3,), (4,), (), (0,), (7, 9), (4097,), (65537,), (33, 2, 5)],
          "small": [(1,), (3,), (4,), (), (0,), (7, 9), (129,), (300,)]}
STEPS = 50


def shapes_for(backend):
    return SHAPES["small"] if backend == "triton" else SHAPES["large"]


def groups(params, b0, adaptive, **extra):
    """Two groups with different hyper-parameters."""
    betas0 = (B1, 0.999, b0) if adaptive else (B1, b0)
    betas1 = (0.8, 0.99, b0) if adaptive else (0.8, b0)
    return [dict(params=params[0::2], lr=1e-2, betas=betas0, weight_decay=0.1, **extra),
            dict(params=params[1::2], lr=3e-3, betas=betas1, weight_decay=0.0, **extra)]


CONFIGS = ([("PNM", dict(decoupled=d)) for d in (True, False)]
           + [("AdaPNM", dict(decoupled=d, amsgrad=a)) for d in (True, False)
              for a in (True, False)])


@pytest.mark.parametrize("path", FAST_PATHS, indirect=True)
@pytest.mark.parametrize("b0", B0_VALUES, ids=lambda b: f"b0={b:.3g}")
@pytest.mark.parametrize("name,options", CONFIGS,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                              for n, o in CONFIGS])
def test_matches_reference_over_many_steps(path, b0, name, options, small_launches):
    opt_cls = OPTIMIZERS[name]
    adaptive = name == "AdaPNM"
    params = make_params(shapes_for(path))
    ref_params = clone_params(params)
    opt = opt_cls(groups(params, b0, adaptive, **options), backend=path)
    ref = opt_cls(groups(ref_params, b0, adaptive, **options), backend="reference")
    train(opt, params, STEPS, skip_every=5)
    train(ref, ref_params, STEPS, skip_every=5)
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("path", FLOAT64_FAST_PATHS, indirect=True)
@pytest.mark.parametrize("b0", [1.0, -B1 / (1 + B1)], ids=lambda b: f"b0={b:.3g}")
@pytest.mark.parametrize("name,options", CONFIGS,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                              for n, o in CONFIGS])
def test_float64_matches_the_reference_to_float64_precision(path, b0, name, options,
                                                            small_launches):
    """float64 parameters (fused and foreach; Triton takes none) are stepped in float64
    arithmetic: over 50 steps they and their state stay within 1e-14 of the reference (a
    float32 step of the same maths would be ~1e-7 off)."""
    opt_cls = OPTIMIZERS[name]
    adaptive = name == "AdaPNM"
    params = make_params(shapes_for(path), dtype=torch.float64)
    ref_params = clone_params(params)
    opt = opt_cls(groups(params, b0, adaptive, **options), backend=path)
    ref = opt_cls(groups(ref_params, b0, adaptive, **options), backend="reference")
    train(opt, params, STEPS, skip_every=5)
    train(ref, ref_params, STEPS, skip_every=5)
    assert all(buffer.dtype == torch.float64 for p in params
               for key, buffer in opt.state[p].items() if key != "step")
    assert_states_close(opt, params, ref, ref_params, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("lr_on", ["cpu", "params' device"])
@cases.parametrize(FLOAT64_FAST_PATHS)
def test_float64_steps_take_a_float64_lr_tensor_in_full(path, name, lr_on):
    """An lr given as a float64 tensor (a scheduler's, a new value every step), on the CPU or
    on the parameters' device, reaches float64 parameters with all its digits: within 1e-14
    of the reference, as a float lr."""
    params = make_params(shapes_for(path), dtype=torch.float64)
    ref_params = clone_params(params)
    lr = torch.tensor(1e-2, dtype=torch.float64,
                      device="cpu" if lr_on == "cpu" else params[0].device)
    opt = OPTIMIZERS[name](params, lr=lr, weight_decay=0.1, backend=path)
    ref = OPTIMIZERS[name](ref_params, lr=lr.clone(), weight_decay=0.1, backend="reference")
    for t in range(12):
        for o in (opt, ref):
            o.param_groups[0]["lr"].fill_(1e-2 / 3 * (1 + t % 4))  # not a float32 value
        train(opt, params, 1, start=t)
        train(ref, ref_params, 1, start=t)
    assert_states_close(opt, params, ref, ref_params, rtol=1e-14, atol=1e-14)


@cases.parametrize(FAST_PATHS)
def test_maximize_and_misaligned_storage(path, name):
    params = make_params(shapes_for(path), misaligned=True)
    ref_params = clone_params(params)
    opt = OPTIMIZERS[name](params, lr=1e-2, weight_decay=0.05, maximize=True, backend=path)
    ref = OPTIMIZERS[name](ref_params, lr=1e-2, weight_decay=0.05, maximize=True,
                           backend="reference")
    train(opt, params, 12)
    train(ref, ref_params, 12)
    assert_states_close(opt, params, ref, ref_params)


@cases.parametrize(FAST_PATHS)
def test_default_launch_limits(path, name):
    """The production chunking (no test limits) on a tensor that spans several chunks."""
    shapes = [(70001,), (5,)] if path != "triton" else [(1000,), (5,)]
    opt, params, ref, ref_params = with_reference(name, path, shapes)
    train(opt, params, 4)
    train(ref, ref_params, 4)
    assert_states_close(opt, params, ref, ref_params)


# (dtype, absolute slack). The fused error against an fp64 reference may be at most twice
# the error of the reference itself run in the same low precision, plus the slack.
LOW_PRECISION = [(torch.float16, 1e-6), (torch.bfloat16, 1e-6)]


@pytest.mark.parametrize("path", [p for p in FAST_PATHS if p != "foreach"], indirect=True)
@pytest.mark.parametrize("dtype,slack", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("name,options", CONFIGS,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                              for n, o in CONFIGS])
def test_low_precision_is_at_least_as_accurate_as_the_reference(path, dtype, slack, name,
                                                                 options, small_launches):
    opt_cls = OPTIMIZERS[name]
    shapes = shapes_for(path)
    exact = make_params(shapes, dtype=torch.float64)
    fast = [p.detach().to(dtype).requires_grad_() for p in exact]
    low_ref = clone_params(fast)
    exact_ref = [p.detach().to(dtype).double().requires_grad_() for p in exact]  # same start
    runs = [(fast, path), (low_ref, "reference"), (exact_ref, "reference")]
    # eps = 1e-8 is 0 in float16, where the low-precision reference then divides 0 by 0:
    # an eps the storage dtype can hold keeps the yardstick finite.
    if name == "AdaPNM":
        options = dict(options, eps=1e-3)
    opts = []
    for params, backend in runs:
        opt = opt_cls(params, lr=1e-2, weight_decay=0.05, backend=backend, **options)
        train(opt, params, 20)
        opts.append(opt)
    # Judged over the whole parameter set: one 0-dim tensor's error is a single sample.
    flat = lambda ps: torch.cat([p.detach().double().flatten() for p in ps])  # noqa: E731
    truth = flat(exact_ref)
    err_fast = (flat(fast) - truth).abs().max()
    err_ref = (flat(low_ref) - truth).abs().max()
    assert err_fast <= 2 * err_ref + slack, (err_fast.item(), err_ref.item())


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_auto_on_cuda_is_the_fused_step_at_every_size(capability, monkeypatch):
    """On CUDA "auto" is the fused step for every dtype it takes, however large the batch:
    with 4,096-element fp32 chunks it took the Triton step's time within 0.5 % on an H200
    from 2^26 elements, and less below (see pnm_kernels' backend choice). Without its CUDA
    kernels, Triton, and for float64, which Triton does not take, foreach."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    kernels_take_only_their_own_dtypes(monkeypatch)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        assert resolve_auto_backend(cuda, dtype) == "fused"
    fused_kernels_unavailable(monkeypatch, "no CUDA")
    assert resolve_auto_backend(cuda, torch.float32) == "triton"
    assert resolve_auto_backend(cuda, torch.float64) == "foreach"


def test_triton_launch_configuration_by_generation_and_its_override(monkeypatch):
    """One configuration per GPU generation, and on Hopper one per optimizer for 2-byte
    storage and one for float32 AdaPNM; set_launch_config overrides every launch, or only those of the (dtype, adaptive)
    pairs it names (how bench_step.py runs tuned ones)."""
    pytest.importorskip("triton")
    configs, per_optimizer, default = shipped_triton_launch_configs()
    LaunchConfig = triton_launch_config_type()
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert triton_launch_config(cuda, torch.float32, False) == configs[9]
    assert triton_launch_config(cuda, torch.float32, True) == per_optimizer[(9, 4, True)]
    assert per_optimizer[(9, 4, True)] != configs[9]
    for dtype in (torch.bfloat16, torch.float16):
        for adaptive in (False, True):
            expected = per_optimizer[(9, 2, adaptive)]
            assert triton_launch_config(cuda, dtype, adaptive) == expected
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert triton_launch_config(cuda, torch.bfloat16, True) == configs[8]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert triton_launch_config(cuda, torch.float32, True) == default
    assert triton_launch_config(torch.device("cpu"), torch.float32, True) == configs["interpreter"]

    other = LaunchConfig(block=256, iters=2, num_warps=2)
    try:
        set_triton_launch_config({(torch.float32, False): other})
        assert triton_launch_config(cuda, torch.float32, False) == other
        assert triton_launch_config(cuda, torch.float32, True) == default
        assert triton_launch_config(cuda, torch.bfloat16, False) == default
        set_triton_launch_config(other)
        assert triton_launch_config(torch.device("cpu"), torch.bfloat16, True) == other
    finally:
        set_triton_launch_config(None)
    assert triton_launch_config(cuda, torch.float32, False) == default


def _shipped_launch_configs():
    try:
        by_generation, per_optimizer, _ = shipped_triton_launch_configs()
    except ImportError:
        return []
    configs = [c for k, c in by_generation.items() if k != "interpreter"]
    configs = sorted(set(configs + list(per_optimizer.values())), key=repr)
    if HAS_CUDA:
        return configs
    # The interpreter ignores num_warps: one configuration per chunk layout is enough there.
    return list({(c.block, c.iters): c for c in configs}.values())


@pytest.mark.parametrize("config", _shipped_launch_configs(), ids=repr)
@cases.parametrize(["triton"], dtypes=[torch.float32, torch.bfloat16], args=["name", "dtype"])
def test_every_shipped_triton_launch_configuration_steps_as_the_reference(config, dtype, name):
    """Each configuration of the GPU table, forced on every launch, across its chunk
    boundaries: one element short of a chunk, one over, two chunks and a bit, and a tensor
    smaller than a block. Chunking changes no element's arithmetic, so the result is bitwise
    that of chunks of 2,048 elements, and (fp32) matches the reference. (Without a GPU the
    interpreter runs it: it ignores num_warps but walks the same chunk map.)"""
    pytest.importorskip("triton")
    chunk = config.block * config.iters
    params = make_params([(chunk - 1,), (chunk + 1,), (2 * chunk + 3,), (5,)], dtype=dtype)
    runs = {}
    small = triton_launch_config_type()(block=1024, iters=2, num_warps=4)  # the interpreter's own: slow here
    for label, forced in (("shipped", config), ("small chunks", small), ("reference", None)):
        ps = clone_params(params)
        opt = OPTIMIZERS[name](ps, lr=1e-2, weight_decay=0.1,
                               backend="reference" if forced is None else "triton")
        set_triton_launch_config(forced)
        try:
            train(opt, ps, 3)
        finally:
            set_triton_launch_config(None)
        runs[label] = (opt, ps)
    shipped, small = runs["shipped"], runs["small chunks"]
    assert_states_close(*shipped, *small, atol=0, rtol=0)
    if dtype == torch.float32:
        assert_states_close(*shipped, *runs["reference"])


@OVER_OPTIMIZERS
def test_a_triton_step_is_one_launch_that_also_counts_the_steps(name, monkeypatch):
    """Each Triton step of a cached batch is one launch: the program that finishes last
    increments every step counter and re-zeroes the batch's ticket counter, and a step skipped
    for found_inf takes no ticket. Over many programs, parameters that skip steps and a
    skipped AMP step, parameters and state agree with the reference."""
    pytest.importorskip("triton")
    launched = record_triton_launches(monkeypatch)
    opt, params, ref, ref_params = with_reference(name, "triton", SHAPES["small"])
    train(opt, params, 5, skip_every=3)
    train(ref, ref_params, 5, skip_every=3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.grad_scale = torch.tensor(8.0, device=DEVICE)
    opt.found_inf = torch.tensor(1.0, device=DEVICE)
    opt.step()  # skipped: changes nothing, takes no ticket
    del opt.grad_scale, opt.found_inf
    train(opt, params, 4, start=5)
    train(ref, ref_params, 4, start=5)
    assert_states_close(opt, params, ref, ref_params)
    assert [kind for kind, _, _ in launched] == ["step"] * 10
    assert all(kwargs["COUNT_STEPS"] for _, _, kwargs in launched)
    # one counter per cached batch (steps that skip parameters make other batches)
    assert all(launch_ticket_counter(args).tolist() == [0] for _, args, _ in launched)


@pytest.mark.parametrize("missing", ["a buffer list", "a step counter", "a gradient"])
def test_the_triton_step_refuses_lists_it_would_read_past(missing):
    """The Triton kernels check nothing and read every list through one table of pointers:
    a batch lacking a list or an entry (a bug upstream) is refused before any launch,
    instead of reading memory past the table."""
    pytest.importorskip("triton")
    params = [torch.zeros(5, device=DEVICE), torch.zeros(3, device=DEVICE)]
    like = lambda: [torch.zeros_like(p) for p in params]  # noqa: E731
    batch = make_batch(params, like(), [like(), like(), like(), like()],
                       [torch.zeros((), device=DEVICE) for _ in params])
    if missing == "a buffer list":
        batch.buffers.pop()  # AMSGrad's
    elif missing == "a step counter":
        batch.steps.pop()
    else:
        batch.grads.pop()
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, beta0=1.0, eps=1e-8, weight_decay=0.0,
              amsgrad=True, decoupled=True, maximize=False)
    with pytest.raises(RuntimeError, match="needs as many gradients, step counters and 4"):
        run_triton_step(True, batch, hp, None, None)
    assert all(not p.any() for p in params)


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.int8],
                         ids=["param-dtype-state", "bf16-state", "int8-state"])
@cases.parametrize(FAST_PATHS, optimizers=("AdaPNM",))
def test_a_gradient_whose_square_overflows_float32_steps_as_the_reference(path, name,
                                                                          state_dtype):
    """A gradient of 2e19: its square overflows float32, the reference's addcmul ((1 - b2) g,
    then times g) does not. Every kernel multiplies in that order, so the second moment stays
    finite and the parameter moves (with int8 state an inf would turn its block's scale, and
    the block's 128 parameters, to NaN)."""
    runs = []
    for backend in ("reference", path):
        params = make_params([(2, 128)])
        opt = OPTIMIZERS[name](params, lr=1e-2, backend=backend, state_dtype=state_dtype)
        for t in range(4):
            grad = torch.randn(2, 128, generator=torch.Generator().manual_seed(t))
            grad[0, 5] = 2e19
            params[0].grad = grad.to(params[0].device)
            opt.step()
        runs.append((opt, params))
    assert torch.isfinite(runs[1][1][0]).all()
    assert_close_codes(*runs[1], *runs[0])


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("name,options", CONFIGS,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                              for n, o in CONFIGS])
def test_foreach_on_the_cpu_is_the_references_maths_bit_for_bit(name, options, weight_decay):
    """The foreach backend batches the reference's torch ops in the reference's order, so on
    the CPU it gives the reference's bits, inf, NaN and -0.0 parameters included; the decay
    pass it skips when the factor is exactly 1 changes none of them."""
    torch.manual_seed(0)
    start = [torch.randn(s) for s in [(7,), (300, 5), (1,), ()]]
    start[0][2], start[1][0, 0], start[1][1, 1] = float("inf"), float("nan"), -0.0
    runs = {}
    for backend in ("foreach", "reference"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = OPTIMIZERS[name](params, lr=1e-2, weight_decay=weight_decay, backend=backend,
                               **options)
        for t in range(6):
            gen = torch.Generator().manual_seed(t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs[backend] = params + [v for p in params for v in opt.state[p].values()]
    for x, y in zip(runs["foreach"], runs["reference"], strict=True):
        assert torch.equal(x.reshape(-1).view(torch.int32), y.reshape(-1).view(torch.int32))
