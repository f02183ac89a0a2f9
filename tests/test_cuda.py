"""GPU-only checks (skipped without CUDA): the CUDA and Triton kernels on device tensors are
also covered by every test parametrised over FAST_PATHS; these add what only a GPU has."""
import pytest
import torch

from conftest import OPTIMIZERS, assert_states_close, clone_params, make_params, requires_cuda, train
from pnm_kernels._ops import cuda_chunk_size

pytestmark = requires_cuda


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.int8],
                         ids=["own-dtype", "bf16-state", "int8-state"])
@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("backend", ["fused", "triton"])
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_cuda_graph_capture_of_a_training_step_matches_eager(backend, name, set_to_none,
                                                             state_dtype):
    """set_to_none=True is torch's own recipe (gradients allocated inside the capture); the
    Triton tables would need a copy inside the capture there and it refuses, saying so.
    Compressed state too: its random bits come from the counters on the device. The first
    layer's rows hold 128 elements (int8 codes), the second's 64 (bfloat16 state)."""
    if backend == "triton" and set_to_none:
        pytest.skip("Triton: gradients must persist across a capture (see triton_kernels)")
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x, y = torch.randn(32, 128, device="cuda"), torch.randn(32, 8, device="cuda")
    opts = [OPTIMIZERS[name](m.parameters(), lr=torch.tensor(1e-2, device="cuda"), backend=backend,
                             state_dtype=state_dtype)
            for m in models]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]

    def train_step(model, opt):
        opt.zero_grad(set_to_none=set_to_none)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: state, tables and autotuning happen outside capture
            train_step(models[0], opts[0])
            train_step(models[1], opts[1])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step(models[0], opts[0])
    for _ in range(6):
        graph.replay()
        train_step(models[1], opts[1])
        for s in scheds:
            s.step()
    torch.cuda.synchronize()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("backend", ["foreach", "reference"])
def test_a_host_reading_backend_refuses_a_cuda_graph_capture(backend):
    """backend="foreach" and "reference" read each step count on the host: captured, the
    step raises saying so before it issues any work, and the parameters and state stay as
    they were (tests/test_bad_input.py simulates this on the CPU)."""
    params = make_params([(64,), (3,)], device="cuda")
    opt = OPTIMIZERS["AdaPNM"](params, lr=1e-3, backend=backend)
    train(opt, params, 2)
    for p in params:
        p.grad = torch.randn_like(p)
    before = [t.clone() for p in params for t in [p.detach(), *opt.state[p].values()]]
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="cannot record"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            opt.step()
    torch.cuda.synchronize()
    after = [t for p in params for t in [p.detach(), *opt.state[p].values()]]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_a_step_compiled_in_reduce_overhead_mode_replays_as_a_cuda_graph(name):
    """torch.compile(opt.step, mode="reduce-overhead"): inductor records the step as a CUDA
    graph (no cudagraph skip) and replays it; with a device lr halved in place every other
    step (what a replayed graph reads) it matches an eager optimizer."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")
    lrs = [torch.tensor(1e-2, device="cuda") for _ in models]
    opts = [OPTIMIZERS[name](m.parameters(), lr=lr, backend="fused") for m, lr in zip(models, lrs)]
    steps = [torch.compile(opts[0].step, mode="reduce-overhead"), opts[1].step]
    for t in range(8):
        for model, opt, step in zip(models, opts, steps):
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.mse_loss(model(x), y).backward()
            step()
        if t % 2:
            for lr in lrs:
                lr.mul_(0.5)
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == 0, "see TORCH_LOGS=perf_hints for why"
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_cpu_grad_for_a_cuda_param_raises_clearly(name):
    p = torch.zeros(4, device="cuda", requires_grad=True)
    opt = OPTIMIZERS[name]([p], backend="fused")
    p.grad = torch.zeros(4, device="cuda")
    p.grad.data = torch.zeros(4)
    with pytest.raises(RuntimeError, match="does not match"):
        opt.step()


def _kernels_launched_by(fn):
    """The kinds of the kernels fn launches, in order: "single", "step", "increment"."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kinds = {"single_launch_step_kernel": "single", "increment_kernel": "increment",
             "step_kernel": "step"}
    return [next((v for k, v in kinds.items() if k in name), name) for name in names]


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_a_step_of_at_most_one_block_per_sm_is_a_single_launch(name):
    """An eager fused step whose chunks fit one block per SM is one kernel that also
    increments the step counters, with 16,384-element chunks where fp32's 4,096 would not fit
    (tests/test_ops.py plans it); a larger one is the step kernel plus the counter kernel,
    however many chunks it has (2,000 here: launches were once cut at 1,280). All agree with
    the reference, counters included."""
    if not _kernels_launched_by(lambda: torch.ones(4, device="cuda").mul_(2)):
        pytest.skip("the profiler records no CUDA kernels here (CUPTI unavailable)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chunk = cuda_chunk_size(torch.float32)
    for numel, expected in (((sms - 1) * chunk, ["single"]),  # with the (3,): sms blocks
                            (sms * chunk, ["single"]),  # sms + 1 of 4,096; sms / 4 + 1 larger
                            (sms * 16384, ["step", "increment"]),  # sms + 1 even of 16,384
                            (1999 * chunk, ["step", "increment"])):
        params = make_params([(numel,), (3,)], device="cuda")
        ref_params = clone_params(params)
        opt = OPTIMIZERS[name](params, lr=1e-3, backend="fused")
        ref = OPTIMIZERS[name](ref_params, lr=1e-3, backend="reference")
        train(opt, params, 2)
        train(ref, ref_params, 2)
        assert _kernels_launched_by(opt.step) == expected
        ref.step()
        assert_states_close(opt, params, ref, ref_params)


def test_a_blocks_done_counter_on_another_device_raises():
    p = [torch.zeros(4, device="cuda")]
    with pytest.raises(RuntimeError, match="blocks_done is on cpu but params are on cuda:0"):
        torch.ops.pnm_kernels.pnm_step_(p, [torch.zeros(4, device="cuda")], [torch.zeros(4, device="cuda")],
                                        [torch.zeros(4, device="cuda")],
                                        [torch.zeros((), dtype=torch.float64, device="cuda")],
                                        lr=0.1, beta1=0.9, beta0=1.0, weight_decay=0.0, decoupled=True,
                                        maximize=False, blocks_done=[torch.zeros(1, dtype=torch.int32)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_float64_lr_on_the_gpu_or_the_cpu_is_read_in_full(dtype):
    """A float64 lr tensor on the GPU is read by the kernel, one on the CPU on the host;
    either way the step is bitwise the step with the same lr as a float argument, which a
    float32 lr tensor rounds (float64 parameters see the difference)."""
    def step(**kw):
        z = lambda: [torch.zeros(5, dtype=dtype, device="cuda")]  # noqa: E731
        p = [torch.ones(5, dtype=dtype, device="cuda")]
        torch.ops.pnm_kernels.pnm_step_(p, [torch.ones(5, dtype=dtype, device="cuda")], z(), z(),
                                        [torch.zeros((), dtype=torch.float64, device="cuda")], [],
                                        beta1=0.9, beta0=1.0,
                                        weight_decay=0.0, decoupled=True, maximize=False, **kw)
        return p[0]

    by_float = step(lr=0.1)
    for device in ("cuda", "cpu"):
        lr64 = torch.tensor(0.1, dtype=torch.float64, device=device)
        assert torch.equal(by_float, step(lr=0.0, lr_tensor=lr64)), device
    lr32 = torch.tensor(0.1, device="cuda")
    assert torch.equal(by_float, step(lr=0.0, lr_tensor=lr32)) == (dtype == torch.float32)


@pytest.mark.parametrize("backend", ["fused", "triton"])
def test_large_set_on_gpu_matches_reference(backend):
    params = make_params([(1 << 22,), (4097,), (3,)], device="cuda")
    ref_params = clone_params(params)
    opt = OPTIMIZERS["AdaPNM"](params, lr=1e-3, backend=backend)
    ref = OPTIMIZERS["AdaPNM"](ref_params, lr=1e-3, backend="reference")
    train(opt, params, 5)
    train(ref, ref_params, 5)
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_fsdp2_cpu_offload_steps_on_the_cpu_and_matches_gpu_training(name):
    """ZeRO-Offload style: parameters sharded and offloaded to pinned CPU memory, the step in
    the fused CPU kernel; the result matches plain GPU training."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    # One rank, an in-process store: no TCP port for two test workers to fight over (GPU run
    # 13 failed once with EADDRINUSE when both parametrizations ran at the same time).
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda()
        offloaded = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda()
        offloaded.load_state_dict(plain.state_dict())
        fully_shard(offloaded, offload_policy=CPUOffloadPolicy())
        opts = [OPTIMIZERS[name](m.parameters(), lr=1e-2) for m in (plain, offloaded)]
        x = torch.randn(16, 32, device="cuda")
        for _ in range(4):
            for m, o in zip((plain, offloaded), opts):
                o.zero_grad()
                m(x).pow(2).mean().backward()
                o.step()
        p = next(offloaded.parameters())
        assert p.to_local().device.type == "cpu"
        for a, b in zip(plain.parameters(), offloaded.parameters()):
            torch.testing.assert_close(a.detach().cpu(), b.full_tensor().detach().cpu())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["fused", "triton"])
def test_a_tensor_past_2_31_elements_is_updated_to_its_end(backend):
    """64-bit offsets: a PNM step over 2^31 + 5 elements (34 GB with its state) writes
    the elements past 2^31 as the reference computes them (the maths is per element, so the
    ends are compared with reference steps on copies of those ends)."""
    numel = 2**31 + 5
    if torch.cuda.mem_get_info()[0] < 40 * 2**30:
        pytest.skip("needs 40 GiB of free GPU memory")
    param = torch.empty(numel, device="cuda").normal_().requires_grad_()
    param.grad = torch.empty_like(param).normal_()
    ends = [slice(0, 4096), slice(2**31 - 4096, numel)]
    ref_params = [param.detach()[s].clone().requires_grad_() for s in ends]
    for rp, s in zip(ref_params, ends):
        rp.grad = param.grad[s].clone()
    opt = OPTIMIZERS["PNM"]([param], lr=1e-2, backend=backend)
    ref = OPTIMIZERS["PNM"](ref_params, lr=1e-2, backend="reference")
    for _ in range(2):  # an odd and an even step
        opt.step()
        ref.step()
    for rp, s in zip(ref_params, ends):
        torch.testing.assert_close(param.detach()[s], rp.detach())
        for key in ("pos_momentum", "neg_momentum"):
            torch.testing.assert_close(opt.state[param][key][s], ref.state[rp][key])
    del opt, param
    torch.cuda.empty_cache()
