"""The fused CPU kernel's instruction sets (baseline x86-64, AVX2, AVX-512, picked at run time
as torch picks its own): each gives bitwise the emulated CUDA kernel's result, special values
and low-precision rounding included, and the work is split between threads without gaps."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import make_params, requires_extension
from pnm_kernels._ops import cpu_isa, cpu_isas, default_cpu_isa, set_cpu_isa
from test_ops import ADA_OPS, STEP, adapnm_kwargs, pnm_kwargs

pytestmark = requires_extension


@pytest.fixture(params=["baseline", "avx2", "avx512"])
def each_cpu_isa(request):
    """Runs the fused CPU kernel with one instruction set (skipped where the CPU lacks it)."""
    if request.param not in cpu_isas():
        pytest.skip(f"this CPU has no {request.param}")
    set_cpu_isa(request.param)
    yield request.param
    set_cpu_isa()


def test_the_cpu_kernel_runs_at_torchs_cpu_level_and_refuses_unknown_isas():
    assert cpu_isas()[0] == "baseline"
    assert cpu_isa() == default_cpu_isa()
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert cpu_isa() == "avx512"
    with pytest.raises(RuntimeError, match="unknown CPU ISA 'neon'"):
        set_cpu_isa("neon")
    assert cpu_isa() == default_cpu_isa()


@pytest.mark.parametrize("capability, isa", [("default", "baseline"), ("avx2", "avx2")])
def test_aten_cpu_capability_caps_the_cpu_kernel_as_it_caps_torch(capability, isa):
    if isa not in cpu_isas():
        pytest.skip(f"this CPU has no {isa}")
    code = "import pnm_kernels._ops as ops; print(ops.cpu_isa())"
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("algo", ["pnm", "pnm-l2", "adapnm", "adapnm-decoupled-no-amsgrad"])
def test_every_cpu_isa_gives_bitwise_the_emulated_cuda_result(each_cpu_isa, algo, dtype):
    """The fused CPU kernel is compiled for SSE2, AVX2 and AVX-512 and picks one at run time.
    Each, vector bodies and scalar tails alike, across a CPU chunk boundary (2^15 elements),
    gives bit for bit what the CUDA block body (emulated) gives: no FMA contraction, the same
    fp16/bf16 conversions, both parities."""
    shapes = [(1,), (15,), (16,), (17,), (33,), (1000,), (2**15 + 19,)]
    params = {op: [p.detach() for p in make_params(shapes, dtype=dtype, device="cpu")]
              for op in ("fused", "emulated")}
    adaptive = algo.startswith("adapnm")
    amsgrad = algo == "adapnm"
    n_buffers = (4 if amsgrad else 3) if adaptive else 2
    state = {op: ([[torch.zeros_like(p) for p in ps] for _ in range(n_buffers)],
                  [torch.zeros((), dtype=STEP) for _ in ps]) for op, ps in params.items()}
    kwargs = (adapnm_kwargs(amsgrad=amsgrad, decoupled=algo.endswith("no-amsgrad"))
              if adaptive else pnm_kwargs(decoupled=algo == "pnm"))
    name = "adapnm_step_" if adaptive else "pnm_step_"
    for step in range(5):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        for op, prefix in (("fused", ""), ("emulated", "emulated_cuda_")):
            buffers, steps = state[op]
            if adaptive and not amsgrad:
                buffers = buffers + [[]]
            getattr(torch.ops.pnm_kernels, prefix + name)(params[op], grads, *buffers, steps,
                                                          [], **kwargs)
    flat = lambda op: params[op] + sum(state[op][0], []) + state[op][1]  # noqa: E731
    for x, y in zip(flat("fused"), flat("emulated"), strict=True):
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("shapes", [[(0,), (40000,), (0,), (7,), (25000,), (0,), (1,), (30000,)],
                                    [(2**15,), (0,), (2**15,)]],
                         ids=["splits-inside-tensors", "split-on-a-boundary-beside-an-empty-one"])
def test_the_cpu_kernel_splits_elements_between_threads_without_gaps_or_overlaps(shapes, threads):
    """The CPU kernel splits the batch's elements evenly between threads, across tensor
    boundaries: every element is updated exactly once (bitwise the emulated CUDA result)."""
    params = {op: [p.detach() for p in make_params(shapes, device="cpu")]
              for op in ("pnm_step_", "emulated_cuda_pnm_step_")}
    state = {op: ([[torch.zeros_like(p) for p in ps] for _ in range(2)],
                  [torch.zeros((), dtype=STEP) for _ in ps]) for op, ps in params.items()}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            grads = [torch.randn(s, generator=gen) for s in shapes]
            for op, ps in params.items():
                getattr(torch.ops.pnm_kernels, op)(ps, grads, *state[op][0], state[op][1],
                                                   [], **pnm_kwargs())
    finally:
        torch.set_num_threads(previous)
    for op in params:
        assert [s.item() for s in state[op][1]] == [3.0] * len(shapes)
    for x, y in zip(params["pnm_step_"], params["emulated_cuda_pnm_step_"], strict=True):
        assert torch.equal(x, y)
    for xs, ys in zip(state["pnm_step_"][0], state["emulated_cuda_pnm_step_"][0], strict=True):
        for x, y in zip(xs, ys, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_rounding_and_special_values_match_c10_bitwise(dtype, each_cpu_isa):
    """The CPU kernel converts fp16/bf16 with its own vectorised code; the emulated CUDA body
    uses c10's conversions. Ties, overflow to inf, subnormals, NaN and inf come out the same
    bit for bit."""
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), info.max, -info.max,
                             info.tiny, info.tiny / 4, 0.0, -0.0, 1.0, 1 + info.eps / 2, 3e38])
    gen = torch.Generator().manual_seed(0)
    grads = [torch.cat([specials, torch.randn(500, generator=gen) * 1e4]).to(dtype)]
    runs = {}
    for op in ("pnm_step_", "emulated_cuda_pnm_step_"):
        params = [torch.randn(512, generator=torch.Generator().manual_seed(1)).to(dtype)]
        bufs = [[torch.zeros_like(params[0])], [torch.ones_like(params[0])]]
        steps = [torch.zeros((), dtype=STEP)]
        for _ in range(3):
            getattr(torch.ops.pnm_kernels, op)(params, grads, *bufs, steps, [],
                                               **pnm_kwargs(lr=1e3, beta1=0.5))
        runs[op] = [params[0], bufs[0][0], bufs[1][0]]
    for x, y in zip(runs["pnm_step_"], runs["emulated_cuda_pnm_step_"]):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    assert runs["pnm_step_"][0].isnan().any()  # the specials did reach the stored values


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_adapnm_special_values_in_every_lane_match_the_emulated_cuda_body(dtype, each_cpu_isa):
    """AdaPNM-AMSGrad with the same specials: the running maximum keeps its larger old values
    and NaNs and takes every new NaN (torch.maximum's rule), in the vector lanes and the scalar
    tail alike, bit for bit as the emulated CUDA body (520 elements: 32 vectors of 16 and a
    tail of 8)."""
    info = torch.finfo(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), info.max, -info.max,
                             info.tiny, info.tiny / 4, 0.0, -0.0, 1.0, 1 + info.eps / 2, 3e38])
    gen = torch.Generator().manual_seed(0)
    grads = [torch.cat([torch.randn(500, generator=gen), specials, specials[:8]]).to(dtype)]
    runs = {}
    for op in ADA_OPS:
        params = [torch.randn(520, generator=torch.Generator().manual_seed(1)).to(dtype)]
        old_max = torch.rand(520, generator=torch.Generator().manual_seed(2)) * 3
        old_max[[3, 100, 517]] = float("nan")  # a NaN maximum stays, whatever v is
        bufs = [[torch.zeros_like(params[0])], [torch.ones_like(params[0])],
                [torch.zeros_like(params[0])], [old_max.to(dtype)]]
        steps = [torch.zeros((), dtype=STEP)]
        for _ in range(3):
            getattr(torch.ops.pnm_kernels, op)(params, grads, *bufs, steps, [],
                                               **adapnm_kwargs(beta2=0.5))
        runs[op] = [params[0]] + [b[0] for b in bufs]
    for x, y in zip(runs[ADA_OPS[0]], runs[ADA_OPS[1]], strict=True):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    v, v_max = runs[ADA_OPS[0]][3], runs[ADA_OPS[0]][4]
    assert v_max.isnan().any() and (v_max > v).any()  # NaNs taken, larger old maxima kept
