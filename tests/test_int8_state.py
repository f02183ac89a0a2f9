"""state_dtype=torch.int8 (pnm_kernels/quantization.py, docs/design.md §8): block-wise codes
with one float32 scale per block, written with stochastic rounding. foreach gives the
reference's parameters, codes and scales bitwise, the kernels (fused, emulated CUDA, Triton)
the same to rounding (a code one step away in at most one element in a thousand); the codes
are unbiased; blocks
lie within dim-0 rows, so sharded parameters quantise as whole ones; the state travels in a
plain state_dict, converts to and from other state dtypes, and what does not fit is refused
naming it before anything is touched. (Training as well as float32 state and the drift test:
tests/test_state_dtype_trains.py; dim-0 shards: tests/test_state_dtype.py; both over both
compressed dtypes.)"""

import pytest
import torch

from cases import INT8_PATHS, OPTIMIZERS, parametrize
from conftest import assert_close_codes, assert_same_bits, round_trip
from internals import ensure_state, resolve_auto_backend
from pnm_kernels import PNM, AdaPNM, _ops, quantization
from pnm_kernels.quantization import BLOCK, NEAREST_BITS, dequantize, quantize, scale_name

# Rows of 300 (blocks of 128, 128 and 44), a 1-D bias (bfloat16 state), rows of 256 in a 3-D
# tensor, one row of exactly one block.
SHAPES = [(6, 300), (11,), (3, 4, 64), (1, 128)]
STEPS = 12
INTERPRETER_STEPS = 6  # the Triton interpreter takes a second or so a step: both parities, thrice
VARIANTS = {"decoupled": dict(weight_decay=0.1),
            "l2-max": dict(weight_decay=0.1, decoupled=False, maximize=True),
            "plain": dict(amsgrad=False)}


def _params(dtype, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _run(optimizer, params, steps, first=0):
    for t in range(first, first + steps):
        gen = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
        optimizer.step()




# -- every path steps as the reference ----------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@parametrize(INT8_PATHS, args=("name", "path"))
def test_int8_state_steps_as_the_reference(name, path, dtype, variant):
    if variant == "plain" and name == "PNM":
        pytest.skip("PNM has no AMSGrad")
    runs = []
    for backend in ("reference", path):
        params = _params(dtype)
        opt = OPTIMIZERS[name](params, lr=1e-2, backend=backend, state_dtype=torch.int8,
                               **VARIANTS[variant])
        _run(opt, params, INTERPRETER_STEPS if path == "triton" else STEPS)
        runs.append((opt, params))
    if path == "foreach":  # the reference's own functions: bitwise
        assert_same_bits(*runs[0], *runs[1])

    else:  # the kernel's float32 maths to rounding: codes alike but where one rounded the other way
        assert_close_codes(*runs[1], *runs[0])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_momenta_are_signed_codes_second_moments_unsigned_and_short_rows_bfloat16(name):
    params = _params(torch.float32)
    opt = OPTIMIZERS[name](params, state_dtype=torch.int8)
    _run(opt, params, 1)
    names = ("exp_avg", "neg_exp_avg", "exp_avg_sq", "max_exp_avg_sq") if name == "AdaPNM" \
        else ("pos_momentum", "neg_momentum")
    for p in params:
        state = opt.state[p]
        for key in names:
            if p.dim() == 1:  # a row of one element: no block to share a scale
                assert state[key].dtype == torch.bfloat16 and scale_name(key) not in state
                continue
            assert state[key].dtype == (torch.int8 if "sq" not in key else torch.uint8)
            rows, length = p.shape[0], p[0].numel()
            assert state[scale_name(key)].shape == (rows, -(-length // BLOCK))
            assert state[scale_name(key)].dtype == torch.float32


@pytest.mark.parametrize("name,most", [("PNM", 2.1), ("AdaPNM", 4.2)])
def test_state_bytes_per_element_on_a_transformer_layer(name, most):
    """GPT-2's layer shapes (weights 768 wide, biases and norms): scales included, PNM
    keeps at most 2.1 bytes an element and AdaPNM with AMSGrad at most 4.2."""
    shapes = [(2304, 768), (2304,), (768, 768), (768,), (3072, 768), (3072,), (768, 3072),
              (768,), (768,), (768,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = OPTIMIZERS[name](params, state_dtype=torch.int8)
    _run(opt, params, 1)
    elements = sum(p.numel() for p in params)
    state_bytes = sum(v.numel() * v.element_size() for p in params
                      for k, v in opt.state[p].items() if k not in ("step", "seed"))
    assert state_bytes / elements <= most


# -- the codes ----------------------------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_unbiased_over_their_random_bits(signed):
    """Each of 65,536 draws of the 16 bits, for one block of values spread over six decades:
    the average decoded value is the value itself, to within 2^-16 of the gap between the
    two codes around it."""
    gen = torch.Generator().manual_seed(0)
    x = torch.logspace(-6, 0, BLOCK) * (torch.randint(0, 2, (BLOCK,), generator=gen) * 2 - 1
                                        if signed else 1)
    bits = torch.arange(65536).repeat_interleave(BLOCK).reshape(65536, BLOCK)
    codes, scales = quantize(x.expand(65536, BLOCK), bits, signed)
    values = dequantize(codes, scales, signed).double()
    assert (codes.int().amax(0) - codes.int().amin(0)).max() <= 1  # two neighbours only
    gap = values.amax(0) - values.amin(0)
    bias = (values.mean(0) - x.double()).abs()
    assert (bias <= gap / 65536 + 1e-7 * x.abs().double()).all()


def test_the_largest_magnitude_is_kept_exactly_and_zero_blocks_stay_zero():
    x = torch.randn(3, 2 * BLOCK)
    x[1, :BLOCK] = 0.0
    codes, scales = quantize(x, NEAREST_BITS, True)
    values = dequantize(codes, scales, True)
    assert torch.equal(scales[1, 0], torch.tensor(0.0)) and torch.equal(values[1, :BLOCK], x[1, :BLOCK])
    blocks = x.reshape(3, 2, BLOCK)
    top = blocks.abs().argmax(-1, keepdim=True)
    assert torch.equal(values.reshape(3, 2, BLOCK).gather(-1, top), blocks.gather(-1, top))


@pytest.mark.parametrize("signed", [True, False])
def test_a_block_of_subnormal_values_gets_the_codes_of_the_same_values_lifted_to_normal(signed):
    """1 / scale overflows for a subnormal scale (below 2^-126): such a block is encoded at
    2^24 times its values and scale, which is exact, so its codes are those of the lifted
    values (each value rounded to a neighbouring code, unbiased), not all the block's largest."""
    gen = torch.Generator().manual_seed(0)
    steps = torch.randint(1, 2**20, (3, 2 * BLOCK), generator=gen).float()  # k * 2^-149: exact
    if signed:
        steps *= torch.randint(0, 2, steps.shape, generator=gen) * 2 - 1
    subnormal, lifted = steps * 2.0**-149, steps * 2.0**-125
    assert (subnormal.abs() < 2.0**-126).all()
    bits = torch.randint(0, 2**16, steps.shape, generator=gen)
    codes, scales = quantize(subnormal, bits, signed)
    lifted_codes, lifted_scales = quantize(lifted, bits, signed)
    assert torch.equal(codes, lifted_codes) and torch.equal(scales * 2.0**24, lifted_scales)
    assert (codes.int().abs() < codes.int().abs().amax()).any()  # not every value the largest


@parametrize(INT8_PATHS, args=("name", "path"))
def test_every_path_codes_a_subnormal_momentum_as_the_reference(name, path):
    """A momentum of subnormal gradients (beta1 = 0: the gradient itself), lr 0: every path
    writes the reference's codes and scales, bitwise."""
    betas = (0.0, 1.0) if name == "PNM" else (0.0, 0.999, 1.0)
    runs = []
    for backend in ("reference", path):
        torch.manual_seed(0)  # the same seed for each parameter's random bits
        params = [torch.nn.Parameter(torch.zeros(4, 300))]
        opt = OPTIMIZERS[name](params, lr=0.0, betas=betas, backend=backend,
                               state_dtype=torch.int8)
        gen = torch.Generator().manual_seed(1)
        params[0].grad = torch.randint(-2**20, 2**20, (4, 300), generator=gen) * 2.0**-149
        opt.step()
        runs.append(opt.state[params[0]])
    momentum = "pos_momentum" if name == "PNM" else "exp_avg"
    for key in (momentum, scale_name(momentum)):
        assert torch.equal(runs[1][key], runs[0][key]), key
    assert runs[0][momentum].int().abs().amax() == 127
    assert (runs[0][momentum].int().abs() < 100).any()


def test_a_block_holding_a_non_finite_value_reads_nan_and_the_others_stay():
    x = torch.randn(2, 2 * BLOCK)
    x[0, 5] = float("inf")
    codes, scales = quantize(x, NEAREST_BITS, True)
    values = dequantize(codes, scales, True)
    assert values[0, :BLOCK].isnan().all()
    assert torch.allclose(values[0, BLOCK:], x[0, BLOCK:], rtol=0.05, atol=0.05 * x.abs().max())
    assert not values[1].isnan().any()


# -- checkpoints --------------------------------------------------------------------------

@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_saved_int8_state_resumes_bitwise(name, param_dtype):
    """Through torch.save and torch.load(weights_only=True): codes, float32 scales (torch
    would cast them to bfloat16 parameters' dtype) and the seed come back as they were."""
    cls = OPTIMIZERS[name]
    params = _params(param_dtype)
    opt = cls(params, lr=1e-2, state_dtype=torch.int8)
    _run(opt, params, 5)
    saved, saved_params = round_trip(opt.state_dict()), [p.detach().clone() for p in params]
    _run(opt, params, 5, first=5)
    resumed = [torch.nn.Parameter(p) for p in saved_params]
    opt2 = cls(resumed, lr=1e-2, state_dtype=torch.int8)
    opt2.load_state_dict(saved)
    _run(opt2, resumed, 5, first=5)
    assert_same_bits(opt, params, opt2, resumed)


@parametrize(INT8_PATHS, args=("name", "path"))
def test_an_int8_checkpoint_resumes_across_backends(name, path):
    """A state_dict taken on one backend resumes on another: the reference's checkpoint on
    this path, and this path's in the reference, each then stepping as the other does (to
    rounding; foreach bitwise)."""
    cls = OPTIMIZERS[name]
    for source, target in (("reference", path), (path, "reference")):
        params = _params(torch.float32)
        opt = cls(params, lr=1e-2, backend=source, state_dtype=torch.int8, weight_decay=0.1)
        _run(opt, params, 4)
        saved, saved_params = round_trip(opt.state_dict()), [p.detach().clone() for p in params]
        _run(opt, params, 4, first=4)
        resumed = [torch.nn.Parameter(p) for p in saved_params]
        opt2 = cls(resumed, lr=1e-2, backend=target, state_dtype=torch.int8, weight_decay=0.1)
        opt2.load_state_dict(saved)
        _run(opt2, resumed, 4, first=4)
        if path == "foreach":
            assert_same_bits(opt, params, opt2, resumed)
        else:
            assert_close_codes(opt2, resumed, opt, params)


@pytest.mark.parametrize("other", [torch.float32, torch.bfloat16])
def test_state_converts_to_int8_codes_rounded_to_nearest_and_back_decoded(other):
    """ensure_state, as a step meets a buffer of another dtype: float values become the
    codes rounded to nearest (no random bits: once), codes become their decoded values."""
    p = torch.nn.Parameter(torch.randn(6, 300))
    momentum = torch.randn(6, 300).to(other)
    state = {p: {"step": torch.zeros((), dtype=torch.float64), "pos_momentum": momentum.clone(),
                 "neg_momentum": momentum.clone()}}
    entry, replaced = ensure_state(state, p, ["pos_momentum", "neg_momentum"], torch.int8,
                                   seed=lambda: 0)
    codes, scales = quantize(momentum.float(), NEAREST_BITS, True)
    assert replaced and torch.equal(entry["pos_momentum"], codes)
    assert torch.equal(entry[scale_name("pos_momentum")], scales)
    entry, replaced = ensure_state(state, p, ["pos_momentum", "neg_momentum"], other)
    assert replaced and scale_name("pos_momentum") not in entry
    assert torch.equal(entry["pos_momentum"], dequantize(codes, scales, True).to(other))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_float32_checkpoint_loads_into_int8_state_and_back(name):
    cls = OPTIMIZERS[name]
    params = _params(torch.float32)
    opt = cls(params, lr=1e-2)
    _run(opt, params, 4)
    into = [torch.nn.Parameter(p.detach().clone()) for p in params]
    compressed = cls(into, lr=1e-2, state_dtype=torch.int8)
    compressed.load_state_dict(round_trip(opt.state_dict()))
    _run(compressed, into, 1, first=4)
    key = "exp_avg_sq" if name == "AdaPNM" else "pos_momentum"
    assert compressed.state[into[0]][key].dtype == quantization.code_dtype(key)
    assert "seed" in compressed.state[into[0]]
    back = [torch.nn.Parameter(p.detach().clone()) for p in into]
    plain = cls(back, lr=1e-2)
    plain.load_state_dict(round_trip(compressed.state_dict()))
    _run(plain, back, 1, first=5)
    assert plain.state[back[0]][key].dtype == torch.float32
    assert scale_name(key) not in plain.state[back[0]]


def test_conversion_rounds_each_value_to_a_neighbouring_code():
    x = torch.randn(4, 300)
    codes, scales = quantize(x, NEAREST_BITS, True)
    values = dequantize(codes, scales, True)
    step = scales.repeat_interleave(BLOCK, dim=1)[:, :300] * (2 / 127)  # the widest gap
    assert ((values - x).abs() <= step / 2 + 1e-7).all()


# -- refusals -----------------------------------------------------------------------------

@pytest.mark.parametrize("edit,culprit", [
    (lambda s: s.pop(scale_name("exp_avg")), r"'exp_avg' holds int8 codes but no 'exp_avg_scale'"),
    (lambda s: s.__setitem__(scale_name("exp_avg"), torch.zeros(6, 2)),
     r"'exp_avg_scale' has shape \(6, 2\), not \(6, 3\)"),
])
def test_a_checkpoint_whose_codes_and_scales_do_not_fit_is_refused_naming_them(edit, culprit):
    params = _params(torch.float32)
    opt = AdaPNM(params, lr=1e-2, state_dtype=torch.int8)
    _run(opt, params, 2)
    saved = round_trip(opt.state_dict())
    edit(saved["state"][0])
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = AdaPNM(fresh, lr=1e-2, state_dtype=torch.int8)
    opt2.load_state_dict(saved)
    before = [p.detach().clone() for p in fresh]
    for p in fresh:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=rf"params'\]\[0\].*{culprit}"):
        opt2.step()
    assert all(torch.equal(p, b) for p, b in zip(fresh, before))


def test_every_kernel_cuts_rows_into_blocks_of_the_references_length():
    pytest.importorskip("triton")
    from pnm_kernels.backends import triton_state_kernels

    assert triton_state_kernels.INT8_BLOCK.value == BLOCK == 128  # csrc: kInt8Block


def test_a_backend_that_cannot_run_says_so_before_any_step(monkeypatch):
    """Triton on CPU tensors without the interpreter: refused naming int8 state and why."""
    monkeypatch.delenv("TRITON_INTERPRET")
    p = torch.nn.Parameter(torch.randn(4, 128))
    opt = PNM([p], backend="triton", state_dtype=torch.int8)
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match=r"backend='triton' cannot keep int8 state.*CUDA"):
        opt.step()
    assert torch.equal(p, before) and not opt.state


@pytest.mark.parametrize("dtype,culprit", [(torch.float64, "float64"), (torch.complex64, "complex")])
def test_int8_state_for_a_dtype_without_it_is_refused_naming_the_parameter(dtype, culprit):
    good = torch.nn.Parameter(torch.randn(2, 128))
    bad = torch.nn.Parameter(torch.randn(2, 128, dtype=dtype))
    opt = AdaPNM([good, bad], state_dtype=torch.int8)
    good.grad, bad.grad = torch.ones_like(good), torch.ones_like(bad)
    with pytest.raises(ValueError, match=rf"params'\]\[1\].*{culprit}"):
        opt.step()
    assert not opt.state


# -- torch.compile ------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_compiled_step_with_int8_state_has_no_graph_break_and_steps_as_eager(name):
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        params = _params(torch.float32)
        opt = OPTIMIZERS[name](params, lr=1e-2, state_dtype=torch.int8, weight_decay=0.1)
        step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
        _run(type("Step", (), {"step": staticmethod(step)})(), params, 4)
        runs.append((opt, params))
    for p, q in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("switched", ["both groups", "the second group"])
@pytest.mark.parametrize("backend", ["fused", "foreach"])
def test_a_compiled_step_converts_int8_state_of_a_later_group_switched_to_bfloat16(backend,
                                                                                  switched):
    """A later group's state_dtype switched from int8 between compiled steps drops its
    scales' keys: every group's state is converted before dynamo maps the first group's
    (it maps every group's state by the keys' places; a later conversion left them stale,
    an IndexError). The step then gives what the eager step gives: bitwise on the fused
    op; the traced foreach ops round an ulp apart from eager's, as without the switch."""
    runs = []
    for compiled in (True, False):
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(3, 200, generator=gen).requires_grad_(),
                  torch.randn(2, 130, generator=gen).requires_grad_()]
        opt = AdaPNM([dict(params=params[:1]), dict(params=params[1:])], lr=torch.tensor(1e-2),
                     backend=backend, state_dtype=torch.int8)
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        for t in range(4):
            if t == 2:
                for group in opt.param_groups[1 if switched == "the second group" else 0:]:
                    group["state_dtype"] = torch.bfloat16
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            step()
        runs.append((opt, params))
    (opt, params), (eager, eager_params) = runs
    if backend == "fused":
        assert_same_bits(opt, params, eager, eager_params)
    else:
        for p, q in zip(params, eager_params):
            torch.testing.assert_close(p, q)
    assert opt.state[params[1]]["exp_avg"].dtype == torch.bfloat16
    assert scale_name("exp_avg") not in opt.state[params[1]]


needs_extension = pytest.mark.skipif(_ops.extension_error() is not None,
                                     reason="pnm_kernels._C is not built")


@needs_extension
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype,options", [
    (torch.float32, dict(weight_decay=0.1)),
    (torch.bfloat16, dict(bf16_stochastic_round=True)),
    (torch.float16, dict(weight_decay=0.1, decoupled=False, maximize=True)),
], ids=["float32", "bfloat16-sr", "float16-l2-max"])
def test_the_cuda_int8_kernel_gives_the_cpu_kernels_bits(name, dtype, options, monkeypatch):
    """The CUDA kernel's code (csrc/int8_block.h: a warp a block, the block's scale reduced
    over its lanes), run emulated, against the fused CPU kernel: parameters, codes and scales
    bitwise, over chunk and launch boundaries (one-block chunks, two tensors a launch), rows
    ending in a short block, and a seed set by hand."""
    runs = []
    for emulate in ("0", "1"):
        monkeypatch.setenv("PNM_KERNELS_EMULATE_CUDA", emulate)
        _ops.set_launch_limits(chunk_size=128, max_tensors=2)
        try:
            params = _params(dtype, shapes=[(6, 300), (11,), (3, 4, 64), (1, 128), (5, 129)])
            opt = OPTIMIZERS[name](params, lr=1e-2, backend="fused", state_dtype=torch.int8,
                                   **options)
            _run(opt, params, 3)
            opt.state[params[0]]["seed"].fill_(12345)
            _run(opt, params, 4, first=3)
            runs.append((opt, params))
        finally:
            _ops.set_launch_limits()
    assert_same_bits(*runs[0], *runs[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["fused", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_gpu_kernels_step_int8_state_as_the_reference(name, dtype, backend):
    """On a GPU, "auto" picks the CUDA int8 kernel; it and the Triton kernel step as the
    reference to rounding (the element maths may differ by a rounding; a code's rounding
    decision never contracts into an FMA)."""
    assert resolve_auto_backend(torch.device("cuda"), dtype, int8=True) == "fused"
    runs = []
    for b in ("reference", backend):
        params = [torch.nn.Parameter(p.cuda()) for p in _params(dtype)]
        opt = OPTIMIZERS[name](params, lr=1e-2, backend=b, state_dtype=torch.int8,
                               weight_decay=0.1)
        _run(opt, params, STEPS)
        runs.append((opt, params))
    assert_close_codes(*runs[1], *runs[0])


# Parameters laid out otherwise than row-major: the kernels step a row-major copy (their rows
# are the codes' blocks), and every random bit, the parameter's too, is indexed row-major.
LAYOUTS = {"transposed": lambda x: x.t().contiguous().t(),  # dense, column-major
           "gapped": lambda x: torch.cat([x, x], dim=1)[:, ::2]}  # every other element


@pytest.mark.parametrize("layout", list(LAYOUTS))
@parametrize(INT8_PATHS, args=("name", "path"))
def test_a_parameter_laid_out_otherwise_steps_as_the_reference(name, path, layout):
    """bfloat16 parameters rounded stochastically, in a layout of their own, a seed set by
    hand: every int8 path against the reference."""
    runs = []
    for backend in ("reference", path):
        x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)).bfloat16()
        params = [torch.nn.Parameter(LAYOUTS[layout](x))]
        opt = OPTIMIZERS[name](params, lr=1e-2, backend=backend, state_dtype=torch.int8,
                               bf16_stochastic_round=True)
        _run(opt, params, 2)
        opt.state[params[0]]["seed"].fill_(2**40 + 7)
        _run(opt, params, 2, first=2)
        runs.append((opt, params))
    assert runs[1][1][0].stride() == runs[0][1][0].stride() != (300, 1)
    if path == "foreach":
        assert_same_bits(*runs[0], *runs[1])
    else:
        assert_close_codes(*runs[1], *runs[0])
