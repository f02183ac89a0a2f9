"""Which parameters and gradients a step takes, as torch's optimizers take them: several dtypes,
complex, transposed, channels_last, strided, 0-dim and empty parameters in one group,
gradients laid out unlike their parameters, the meta device; and what backend "auto" picks
for them."""
import pytest
import torch

import cases
from cases import FAST_PATHS, OVER_OPTIMIZERS
from conftest import (DEVICE, OPTIMIZERS, assert_same_bits, assert_states_close, make_params,
                      train, with_reference)
from internals import resolve_auto_backend
from pnm_kernels import available_backends


@cases.parametrize(FAST_PATHS)
def test_mixed_dtypes_complex_and_odd_layouts_in_one_group(path, name):
    """fp32/fp16/bf16, complex, transposed, channels_last, a strided slice, 0-dim, empty."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(8, 12, generator=gen)
    tensors = [
        torch.randn(10, generator=gen),
        torch.randn(9, generator=gen).half(),
        torch.randn(6, 2, generator=gen).bfloat16(),
        torch.randn(5, generator=gen, dtype=torch.complex64),
        torch.randn(6, 4, generator=gen).t(),                                   # transposed
        torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last),
        base.to(DEVICE)[:, ::3],                                 # not dense (sliced on the device)
        torch.randn((), generator=gen),
        torch.randn(0, generator=gen),
    ]
    if path == "triton":
        tensors[3] = torch.randn(5, generator=gen)  # complex is tested for fused/foreach
    params = [t.to(DEVICE).requires_grad_() for t in tensors]
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    for group in (params, ref_params):
        for p in group:
            assert p.is_leaf
    opt = OPTIMIZERS[name](params, lr=1e-2, weight_decay=0.1, backend=path)
    ref = OPTIMIZERS[name](ref_params, lr=1e-2, weight_decay=0.1, backend="reference")
    for t in range(6):
        for ps in (params, ref_params):
            gen_t = torch.Generator().manual_seed(t)
            for p in ps:
                g = torch.randn(p.shape, generator=gen_t, dtype=p.dtype if p.is_complex() else torch.float32)
                # a gradient laid out differently from its parameter
                p.grad = g.to(p.dtype).to(DEVICE).contiguous()
        opt.step()
        ref.step()
    # This test is about layouts and mixing; precision has its own test (test_backends.py).
    # fp32/complex members must match at default tolerances; fp16/bf16 members differ from
    # the reference by its per-op roundings (a few ulps after six steps).
    low = {1, 2}
    full = [i for i in range(len(params)) if i not in low]
    assert_states_close(opt, [params[i] for i in full], ref, [ref_params[i] for i in full])
    assert_states_close(opt, [params[i] for i in low], ref, [ref_params[i] for i in low],
                        atol=4e-2, rtol=2e-2)
    assert params[6].stride() == (12, 3)  # the strided slice was updated in place


@cases.parametrize(FAST_PATHS)
def test_gradients_laid_out_unlike_their_parameters_after_cached_steps(path, name):
    """A transposed gradient for a contiguous parameter, arriving after the tensor lists were
    cached, is copied densely for the kernels; later contiguous gradients use the cache."""
    opt, params, ref, ref_params = with_reference(name, path, [(4, 6), (5,), (3, 2)])
    for t in range(8):
        for ps in (params, ref_params):
            gen = torch.Generator().manual_seed(t)
            grads = [torch.randn(p.shape, generator=gen) for p in ps]
            if 3 <= t < 6:  # same values, other layout
                grads[0] = grads[0].t().contiguous().t()
            for p, g in zip(ps, grads):
                p.grad = g.to(DEVICE)
        assert (params[0].grad.is_contiguous()) == (not 3 <= t < 6)
        opt.step()
        ref.step()
    assert_states_close(opt, params, ref, ref_params)


class _LibraryParameter(torch.nn.Parameter):
    """A library's own Parameter subclass (a tag, say): neither plain nor a DTensor."""


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.int8])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_parameter_subclass_steps_as_a_plain_parameter(path, name, state_dtype):
    """Bitwise, whatever the state's dtype: its int8 codes and scales are made as a plain
    parameter's (not a DTensor's, sharded); rows of 128 hold a block, rows of 3 do not."""
    def run(kind):
        params = [kind(p.detach()) for p in make_params([(2, 128), (4, 3)])]
        opt = OPTIMIZERS[name](params, backend=path, lr=1e-2, state_dtype=state_dtype)
        train(opt, params, 3)
        return opt, params

    assert_same_bits(*run(_LibraryParameter), *run(torch.nn.Parameter))


@pytest.mark.parametrize("backend", ["auto", "foreach", "reference"])
@OVER_OPTIMIZERS
def test_meta_parameters_step_like_torchs_optimizers(name, backend):
    """On the meta device (shapes without data) a step makes the state and counts, the
    reference's too (its per-parameter step reads the counter's value, which meta has not)."""
    p = torch.nn.Parameter(torch.empty(3, 2, device="meta"))
    p.grad = torch.empty(3, 2, device="meta")
    opt = OPTIMIZERS[name]([p], backend=backend)
    opt.step()
    opt.step()
    assert opt.state[p]["step"].device.type == "meta"
    assert all(b.shape == p.shape for k, b in opt.state[p].items() if k != "step")


def _wrapping_subclass():
    from torch.testing._internal.two_tensor import TwoTensor
    t = torch.randn(4, 3)
    return TwoTensor(t, t.clone()), "a TwoTensor, a tensor subclass wrapping other tensors"


def _nested():
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)],
                                        layout=torch.jagged)
    return nested, "a nested tensor"


@pytest.mark.parametrize("make", [_wrapping_subclass, _nested], ids=["TwoTensor", "nested"])
@cases.parametrize(["reference"] + FAST_PATHS)
def test_a_parameter_wrapping_other_tensors_is_refused_naming_it_untouched(path, name, make):
    """Which memory a wrapper subclass (not DTensor) or a nested tensor steps is no plain
    tensor's: refused naming it (not as memory shared with its gradient), nothing stepped."""
    data, kind = make()
    plain = torch.nn.Parameter(torch.ones(3))
    odd = torch.nn.Parameter(data)
    opt = OPTIMIZERS[name]([plain, odd], lr=0.1, backend=path)
    plain.grad, odd.grad = torch.ones(3), data.clone()
    with pytest.raises(RuntimeError, match=rf"param_groups\[0\]\['params'\]\[1\].* is {kind}"):
        opt.step()
    assert torch.equal(plain, torch.ones(3)) and not opt.state


def test_auto_backend_picks_fused_on_cpu_when_built():
    expected = "fused" if "fused" in available_backends("cpu") else "foreach"
    assert resolve_auto_backend(torch.device("cpu"), torch.float32) == expected
    assert resolve_auto_backend(torch.device("cpu"), torch.float64) == expected


@OVER_OPTIMIZERS
def test_auto_picks_again_when_every_parameter_moves_to_another_dtype(name):
    """model.double() mid-run: "auto" plans the parameters' steps again (the fused kernels'
    float64 build where there is one), their state following them to float64."""
    opt, params, ref, ref_params = with_reference(name, "auto", [(5,), (3, 2)])
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        for p in ps:
            p.data = p.data.double()
        train(o, ps, 3, start=3)
    assert all(buffer.dtype == torch.float64 for p in params
               for key, buffer in opt.state[p].items() if key != "step")
    assert_states_close(opt, params, ref, ref_params)
