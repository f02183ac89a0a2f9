"""state_dtype: the state kept in a dtype of its own (docs/design.md §7). bfloat16 buffers
are written with stochastic rounding whose random bits are counter-based: foreach gives the
reference's parameters and state bitwise (the same ops), the fused kernel gives them to
rounding (its float32 arithmetic unfused, as for float32 state) and the same bits on every
instruction set; the state travels in a plain state_dict and converts between state dtypes,
and what cannot be done is refused before anything is touched. That it trains as float32
state does: test_state_dtype_trains.py."""
import copy

import pytest
import torch

from cases import OPTIMIZERS, STATE_MODES, STATE_DTYPE_PATHS, parametrize
from conftest import assert_same_bits, assert_states_close, round_trip
from pnm_kernels import PNM, AdaPNM, _ops, quantization, reference
from pnm_kernels.rounding import (element_hash, element_index, mix32, mix32_int,
                                  random_bits, round_bf16_stochastic)

STEPS = 12
INTERPRETER_STEPS = 6  # the Triton interpreter takes a second or so a step: both parities, thrice


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(37, 5), (11,), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _run(optimizer, params, steps, first=0):
    for t in range(first, first + steps):
        for p, g in zip(params, _grads(params, t)):
            p.grad = g
        optimizer.step()



_VARIANTS = {"decoupled": dict(weight_decay=0.1),
             "l2-max": dict(weight_decay=0.1, decoupled=False, maximize=True),
             "plain": dict(amsgrad=False)}


def _state_cases():
    """Every (optimizer, path, parameter dtype, mode, variant) the modes apply to."""
    cases = []
    for mode, (_, dtypes) in STATE_MODES.items():
        for dtype in dtypes:
            for variant in _VARIANTS:
                names = ["AdaPNM"] if variant == "plain" else list(OPTIMIZERS)
                for case in parametrize(STATE_DTYPE_PATHS, optimizers=names, dtypes=(dtype,),
                                        modes=(mode,), args=("name", "path", "dtype",
                                                             "mode")).args[1]:
                    cases.append(pytest.param(*case.values, variant, marks=case.marks,
                                              id=f"{case.id}-{variant}"))
    return cases


@pytest.mark.parametrize("name,path,dtype,mode,variant", _state_cases(), indirect=["path"])
def test_state_in_its_own_dtype_steps_as_the_reference(name, path, dtype, mode, variant):
    kwargs = STATE_MODES[mode][0]
    runs = []
    for b in ("reference", path):
        params = _params(dtype)
        opt = OPTIMIZERS[name](params, lr=1e-2, backend=b, **kwargs, **_VARIANTS[variant])
        _run(opt, params, INTERPRETER_STEPS if path == "triton" else STEPS)
        runs.append((opt, params))
    if path == "foreach":
        assert_same_bits(*runs[0], *runs[1])
    else:  # a rare element may round the other way: within a bf16 ulp
        assert_states_close(*runs[1], *runs[0])
    state_dtype = kwargs.get("state_dtype") or dtype
    for key, value in runs[0][0].state[runs[0][1][0]].items():
        if key not in ("step", "seed"):
            assert value.dtype == state_dtype, key


@parametrize(STATE_DTYPE_PATHS)
def test_a_nan_in_bfloat16_state_has_the_references_bits(name, path):
    """A NaN gradient makes NaN state: every path writes bf16's quiet NaN 0x7FC0 where the
    reference does (torch's own conversion would give 0xFFFF on an AVX-512 CPU)."""
    runs = []
    for b in ("reference", path):
        params = _params(torch.float32)
        opt = OPTIMIZERS[name](params, lr=1e-2, backend=b, state_dtype=torch.bfloat16)
        for t in range(2):  # both momentum buffers
            for p, g in zip(params, _grads(params, t)):
                g[::3] = float("nan") if t == 0 else -float("nan")
                p.grad = g
            opt.step()
        runs.append(opt.state[params[0]])
    for key, value in runs[0].items():
        if value.dtype == torch.bfloat16:
            bits = value.view(torch.int16)
            assert torch.isnan(value).any(), key
            assert (bits[torch.isnan(value)] == 0x7FC0).all(), key
            assert torch.equal(torch.isnan(runs[1][key]), torch.isnan(value)), key
            assert torch.equal(runs[1][key].view(torch.int16)[torch.isnan(value)],
                               bits[torch.isnan(value)]), key


@pytest.mark.skipif(_ops.extension_error() is not None, reason="pnm_kernels._C is not built")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_the_fused_kernel_gives_the_same_bits_on_every_instruction_set(name, dtype, state_dtype):
    runs = []
    try:
        for isa in _ops.cpu_isas():
            _ops.set_cpu_isa(isa)
            gen = torch.Generator().manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(70000, generator=gen).to(dtype)),
                      torch.nn.Parameter(torch.randn(300, 200, generator=gen).to(dtype))]
            params += _params(dtype)
            opt = OPTIMIZERS[name](params, lr=1e-2, backend="fused", state_dtype=state_dtype)
            _run(opt, params, 5)
            runs.append((opt, params))
    finally:
        _ops.set_cpu_isa()
    for other in runs[1:]:
        assert_same_bits(*runs[0], *other)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bfloat16_state_holds_half_the_bytes(name):
    params = _params(torch.float32)
    opt = OPTIMIZERS[name](params, backend="foreach", state_dtype=torch.bfloat16)
    _run(opt, params, 1)
    elements = sum(p.numel() for p in params)
    buffer_bytes = sum(v.numel() * v.element_size() for p in params
                       for k, v in opt.state[p].items() if k not in ("step", "seed"))
    assert buffer_bytes / elements == (4 if name == "PNM" else 8)  # AdaPNM with AMSGrad


# -- the rounding itself ------------------------------------------------------------------

def test_mix32_on_tensors_is_the_hash_of_each_value():
    values = [0, 1, 2, 0x9E3779B9, 0xFFFFFFFF, 0x12345678, 0x80000000]
    got = mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [mix32_int(v) for v in values]
    assert mix32_int(1) != 1 and len(set(got)) == len(values)  # a bijection that mixes


def test_random_bits_differ_with_seed_step_and_index_above_2_to_32():
    index = torch.arange(4096, dtype=torch.int64)
    base = element_hash(7, 3, index)
    assert base.min() >= 0 and base.max() < 2**32
    for other in (element_hash(8, 3, index), element_hash(7, 4, index),
                  element_hash(7, 3, index + 2**32)):
        assert (other != base).float().mean() > 0.99
    # each half of the hash roughly uniform: each of 16 bins gets its share of 4096 draws,
    # and the two halves (two buffers' bits) uncorrelated
    for shift in (16, 0):
        bits = random_bits(7, 3, shift, index)
        assert torch.equal(bits, (base >> shift) & 0xFFFF)
        counts = torch.bincount(bits >> 12, minlength=16).float()
        assert (counts - 256).abs().max() < 4 * 16  # 4 sigma of a binomial(4096, 1/16)
    high, low = (base >> 16).double(), (base & 0xFFFF).double()
    assert abs(torch.corrcoef(torch.stack([high, low]))[0, 1]) < 4 / 64  # 4 sigma


def test_stochastic_rounding_rounds_up_as_often_as_the_fraction_says():
    down = torch.tensor(1.0 + 2**-7)  # a bf16 value; the next one up is 1 + 2^-6
    for fraction in (0.0, 0.1, 0.5, 0.9):
        x = torch.full((20000,), float(down + fraction * 2**-7), dtype=torch.float32)
        bits = random_bits(3, 1, 16, torch.arange(x.numel()))
        rounded = round_bf16_stochastic(x, bits).float()
        assert set(rounded.unique().tolist()) <= {float(down), float(down + 2**-7)}
        up = (rounded > down).float().mean().item()
        assert abs(up - fraction) < 0.015, (fraction, up)
        assert abs(rounded.mean().item() - x[0].item()) < 0.015 * 2**-7
    # exactly representable values, signs, zero, infinities and NaN
    special = torch.tensor([0.0, -0.0, 1.5, -3.25, float("inf"), float("-inf"), float("nan")])
    out = round_bf16_stochastic(special, torch.full((7,), 0xFFFF))
    assert torch.equal(out[:6].float(), special[:6])
    assert torch.signbit(out[1]) and torch.isnan(out[6])
    # NaN of either sign is bf16's quiet NaN, as the kernels write it, on every machine
    nans = torch.tensor([float("nan"), -float("nan")]).repeat(20)
    assert (round_bf16_stochastic(nans, torch.zeros(40, dtype=torch.int64))
            .view(torch.int16) == 0x7FC0).all()
    # past the largest bf16, rounding up gives infinity, as rounding to nearest does
    big = torch.tensor([torch.finfo(torch.bfloat16).max * (1 + 2**-9)])
    assert torch.isinf(round_bf16_stochastic(big, torch.tensor([0xFFFF]))).all()


def test_element_index_is_memory_order_plus_the_offset():
    t = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    index = element_index(t, offset=10)
    assert index.flatten().sort().values.tolist() == list(range(10, 130))
    assert index.stride() == t.stride() or index.as_strided(t.shape, t.stride()) is not None
    assert int(index[0, 1, 0, 0]) == 10 + 1  # channels are adjacent in memory


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.int8])
def test_dim0_shards_with_their_offsets_step_as_the_whole_parameter(state_dtype):
    """FSDP2 shards along dim 0, unevenly: each shard stepped with the elements before it as
    its offset gives bitwise the whole parameter's step (parameters and state: bfloat16, or
    int8 codes and their block scales, rows of 200 being two blocks)."""
    rows, length = 31, 200
    whole = torch.randn(rows, length)
    grads = [torch.randn(rows, length) for _ in range(6)]
    common = dict(lr=1e-2, beta1=0.9, beta2=0.999, beta0=1.0, eps=1e-8, weight_decay=0.1,
                  amsgrad=True, decoupled=True, maximize=False, state_dtype=state_dtype)
    names = ("exp_avg", "neg_exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def fresh_state(n):
        if state_dtype == torch.int8:
            state = {name: torch.zeros(n, length, dtype=quantization.code_dtype(name))
                     for name in names}
            state.update({quantization.scale_name(name): torch.zeros(n, 2) for name in names})
        else:
            state = {name: torch.zeros(n, length, dtype=state_dtype) for name in names}
        state.update(step=torch.zeros((), dtype=torch.float64), seed=torch.tensor(5))
        return state

    param, state = whole.clone(), fresh_state(rows)
    shards = [(0, 16), (16, rows)]
    shard_params = [whole[a:b].clone() for a, b in shards]
    shard_states = [fresh_state(b - a) for a, b in shards]
    for g in grads:
        reference.adapnm_step(param, g, state, **common)
        for (a, b), p, s in zip(shards, shard_params, shard_states):
            reference.adapnm_step(p, g[a:b], s, offset=a * length, **common)
    assert torch.equal(torch.cat(shard_params), param)
    for key in state:
        if key not in ("step", "seed"):
            assert torch.equal(torch.cat([s[key] for s in shard_states]), state[key]), key


# -- checkpoints --------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("param_dtype,state_dtype", [(torch.float32, torch.bfloat16),
                                                     (torch.bfloat16, torch.float32),
                                                     (torch.bfloat16, torch.bfloat16)])
def test_a_saved_state_resumes_bitwise(name, param_dtype, state_dtype):
    """Through torch.save and torch.load(weights_only=True): the state keeps its dtype (torch
    would cast float32 state to bfloat16 parameters' dtype) and the seed its value."""
    cls = OPTIMIZERS[name]
    params = _params(param_dtype)
    opt = cls(params, lr=1e-2, backend="foreach", state_dtype=state_dtype)
    _run(opt, params, 5)
    saved, saved_params = round_trip(opt.state_dict()), [p.detach().clone() for p in params]
    _run(opt, params, 5, first=5)
    resumed = [torch.nn.Parameter(p) for p in saved_params]
    opt2 = cls(resumed, lr=1e-2, backend="foreach", state_dtype=state_dtype)
    opt2.load_state_dict(saved)
    _run(opt2, resumed, 5, first=5)
    assert_same_bits(opt, params, opt2, resumed)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_checkpoint_converts_between_state_dtypes(name):
    """float32 state loads into a bfloat16-state optimizer (rounded to nearest, once) and
    bfloat16 state into a float32-state one (exactly); the step goes on from it."""
    cls = OPTIMIZERS[name]
    params = _params(torch.float32)
    opt = cls(params, lr=1e-2, backend="foreach")
    _run(opt, params, 4)
    into = [torch.nn.Parameter(p.detach().clone()) for p in params]
    compressed = cls(into, lr=1e-2, backend="foreach", state_dtype=torch.bfloat16)
    compressed.load_state_dict(round_trip(opt.state_dict()))
    _run(compressed, into, 1, first=4)
    key = "exp_avg_sq" if name == "AdaPNM" else "pos_momentum"
    assert compressed.state[into[0]][key].dtype == torch.bfloat16
    assert "seed" in compressed.state[into[0]]
    back = [torch.nn.Parameter(p.detach().clone()) for p in into]
    plain = cls(back, lr=1e-2, backend="foreach")
    plain.load_state_dict(round_trip(compressed.state_dict()))
    _run(plain, back, 1, first=5)
    assert plain.state[back[0]][key].dtype == torch.float32


# -- refusals -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [torch.float16, torch.uint8, "bfloat16", 2])
def test_an_unknown_state_dtype_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="state_dtype"):
        PNM(_params(torch.float32), state_dtype=bad)


@pytest.mark.parametrize("dtype,culprit", [(torch.float64, "float64"),
                                           (torch.complex64, "complex")])
def test_a_parameter_that_cannot_keep_such_state_is_named_before_any_step(dtype, culprit):
    good = torch.nn.Parameter(torch.randn(4))
    bad = torch.nn.Parameter(torch.randn(3, dtype=dtype))
    opt = AdaPNM([good, bad], backend="foreach", state_dtype=torch.bfloat16)
    good.grad, bad.grad = torch.ones(4), torch.ones_like(bad)
    before = good.detach().clone()
    with pytest.raises(ValueError, match=rf"params'\]\[1\].*{culprit}"):
        opt.step()
    assert torch.equal(good, before) and not opt.state


def test_a_backend_that_cannot_run_says_so_before_any_step(monkeypatch):
    """Triton on CPU tensors without the interpreter: refused naming the state and why."""
    monkeypatch.delenv("TRITON_INTERPRET")
    p = torch.nn.Parameter(torch.randn(4))
    opt = PNM([p], backend="triton", state_dtype=torch.bfloat16)
    p.grad = torch.ones(4)
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match=r"backend='triton' cannot keep state in a dtype "
                                           r"of its own.*CUDA"):
        opt.step()
    assert torch.equal(p, before) and not opt.state


@pytest.mark.skipif(_ops.extension_error() is not None, reason="pnm_kernels._C is not built")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", list(STATE_MODES))
def test_the_cuda_kernels_give_the_cpu_kernels_bits(name, mode, monkeypatch):
    """The CUDA kernels' code (csrc/state_block.h), run emulated, against the fused CPU
    kernel: parameters and state bitwise, over launch and chunk boundaries (small chunks
    and tables), a seed set by hand included."""
    kwargs, dtypes = STATE_MODES[mode]
    runs = []
    for emulate in ("0", "1"):
        monkeypatch.setenv("PNM_KERNELS_EMULATE_CUDA", emulate)
        _ops.set_launch_limits(chunk_size=64, max_tensors=2)
        try:
            params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator()
                                                     .manual_seed(i)).to(dtypes[-1]))
                      for i, s in enumerate([(300,), (7, 9), (1,), (129,)])]
            opt = OPTIMIZERS[name](params, lr=1e-2, backend="fused", weight_decay=0.1, **kwargs)
            _run(opt, params, 2)
            if "seed" in opt.state[params[0]]:
                opt.state[params[0]]["seed"].fill_(12345)
            _run(opt, params, 3, first=2)
            runs.append((opt, params))
        finally:
            _ops.set_launch_limits()
    assert_same_bits(*runs[0], *runs[1])


@pytest.mark.skipif(_ops.extension_error() is not None, reason="pnm_kernels._C is not built")
@pytest.mark.parametrize("op", ["pnm_state_step_", "emulated_cuda_pnm_state_step_"])
def test_indices_crossing_2_to_32_take_the_references_bits(op):
    """A shard whose elements' indices in the whole parameter cross 2^32 (offset 2^32 - 100):
    the kernels change the key where the index's high bits change, as the reference does."""
    offset = 2**32 - 100
    p0, g = torch.randn(300), torch.randn(300)
    state = dict(step=torch.zeros((), dtype=torch.float64), seed=torch.tensor(9),
                 pos_momentum=torch.randn(300).bfloat16(), neg_momentum=torch.randn(300).bfloat16())
    hyper = dict(lr=1e-2, beta1=0.9, beta0=1.0, weight_decay=0.0, decoupled=True, maximize=False)
    expected, expected_state = p0.clone(), {k: v.clone() for k, v in state.items()}
    reference.pnm_step(expected, g, expected_state, state_dtype=torch.bfloat16, offset=offset,
                       **hyper)
    param = p0.clone()
    getattr(torch.ops.pnm_kernels, op)([param], [g], [state["pos_momentum"]],
                                       [state["neg_momentum"]], [state["step"]], [state["seed"]],
                                       [offset], **hyper)
    assert torch.equal(state["pos_momentum"], expected_state["pos_momentum"])
    torch.testing.assert_close(param, expected)
    # the bits do change at 2^32: another key for the last 200 elements
    before = element_hash(9, 1, torch.arange(offset, offset + 300))
    assert not torch.equal(before[100:], element_hash(9, 1, torch.arange(offset, offset + 300) - 2**32)[100:])


def test_switching_state_dtype_mid_run_converts_the_state():
    params = _params(torch.float32)
    opt = PNM(params, lr=1e-2, backend="foreach")
    _run(opt, params, 3)
    opt.param_groups[0]["state_dtype"] = torch.bfloat16
    _run(opt, params, 2, first=3)
    assert opt.state[params[0]]["pos_momentum"].dtype == torch.bfloat16
    expected = copy.deepcopy(opt.state[params[0]]["seed"])
    assert int(expected) == 0  # the first parameter's seed: its place in param_groups


# -- torch.compile ------------------------------------------------------------------------

@pytest.mark.parametrize("name,backend", [("PNM", "auto"), ("AdaPNM", "auto"), ("PNM", "foreach")])
def test_a_compiled_step_with_bfloat16_state_has_no_graph_break_and_steps_as_eager(name, backend):
    """fullgraph=True: the fused state op traces through its fake kernel; foreach's rounding
    traces as tensor ops, its bits computed from the counters on the device."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        params = _params(torch.float32)
        opt = OPTIMIZERS[name](params, lr=1e-2, backend=backend, state_dtype=torch.bfloat16,
                               weight_decay=0.1)
        step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
        for t in range(4):
            for p, g in zip(params, _grads(params, t)):
                p.grad = g
            step()
        runs.append((opt, params))
    assert_states_close(*runs[1], *runs[0])
