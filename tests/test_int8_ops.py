"""The int8 step ops themselves (torch.ops.pnm_kernels.*int8_step_, the fused CPU kernel and
the CUDA kernel's CPU emulation; docs/design.md §8): they pass torch.library.opcheck, a shard
whose indices cross 2^32 takes the reference's random bits, and bad arguments raise naming
the culprit before anything is written. (The optimizers with int8 state:
tests/test_int8_state.py.)"""
import pytest
import torch

from pnm_kernels import _ops, reference
from pnm_kernels.quantization import BLOCK, NEAREST_BITS, quantize

needs_extension = pytest.mark.skipif(_ops.extension_error() is not None,
                                     reason="pnm_kernels._C is not built")


def _int8_op_args(adaptive, shapes=((2, 300), (3, 128))):
    """The int8 ops' positional arguments: params, grads, codes per buffer, steps, seeds,
    offsets and the scales, buffer after buffer."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    dtypes = [torch.int8, torch.int8] + ([torch.uint8, torch.uint8] if adaptive else [])
    codes = [[torch.zeros(s, dtype=d) for s in shapes] for d in dtypes]
    scales = [torch.zeros(s[0], -(-s[1] // BLOCK)) for _ in dtypes for s in shapes]
    steps = [torch.zeros((), dtype=torch.float64) for _ in shapes]
    seeds = [torch.tensor(i, dtype=torch.int64) for i, _ in enumerate(shapes)]
    return [params, grads, *codes, steps, seeds, [0, 600], scales]


_PNM_KW = dict(lr=1e-2, beta1=0.9, beta0=1.0, weight_decay=0.0, decoupled=True, maximize=False)
_ADA_KW = dict(_PNM_KW, beta2=0.999, eps=1e-8, amsgrad=True)


@needs_extension
@pytest.mark.parametrize("prefix", ["", "emulated_cuda_"], ids=["cpu", "emulated-cuda"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["pnm", "adapnm"])
def test_opcheck_int8_ops(adaptive, prefix):
    op = getattr(torch.ops.pnm_kernels, prefix + ("adapnm_int8_step_" if adaptive else "pnm_int8_step_"))
    torch.library.opcheck(op.default, _int8_op_args(adaptive), _ADA_KW if adaptive else _PNM_KW)


@needs_extension
@pytest.mark.parametrize("op", ["pnm_int8_step_", "emulated_cuda_pnm_int8_step_"])
def test_a_shard_whose_indices_cross_2_to_32_takes_the_references_bits(op):
    """A shard whose elements' indices in the whole parameter cross 2^32 (offset 2^32 - 200,
    inside a block): the kernels change the key where the index's high bits change, as the
    reference does."""
    offset = 2**32 - 200
    p0, g = torch.randn(3, 300), torch.randn(3, 300)
    codes, scales = quantize(torch.randn(3, 300), NEAREST_BITS, signed=True)
    state = dict(step=torch.zeros((), dtype=torch.float64), seed=torch.tensor(9),
                 pos_momentum=codes, pos_momentum_scale=scales,
                 neg_momentum=codes.clone(), neg_momentum_scale=scales.clone())
    expected, expected_state = p0.clone(), {k: v.clone() for k, v in state.items()}
    reference.pnm_step(expected, g, expected_state, state_dtype=torch.int8, offset=offset,
                       **_PNM_KW)
    param = p0.clone()
    getattr(torch.ops.pnm_kernels, op)(
        [param], [g], [state["pos_momentum"]], [state["neg_momentum"]], [state["step"]],
        [state["seed"]], [offset], [state["pos_momentum_scale"], state["neg_momentum_scale"]],
        **_PNM_KW)
    assert torch.equal(state["neg_momentum"], expected_state["neg_momentum"])  # only read
    torch.testing.assert_close(state["pos_momentum_scale"], expected_state["pos_momentum_scale"])
    # float32 maths to rounding may move a code by one in a rare element; another key past
    # 2^32 would move about a third of the 700 elements there
    differs = state["pos_momentum"].int() - expected_state["pos_momentum"].int()
    assert differs.abs().max() <= 1 and (differs != 0).sum() <= 5, (differs != 0).sum()
    torch.testing.assert_close(param, expected)


INT8_BAD_CALLS = [
    ("short rows", lambda a: a.__setitem__(0, [torch.randn(2, 300), torch.randn(3, 64)]),
     r"params\[1\] \(shape \[3, 64\]\) cannot keep int8 state"),
    ("float codes", lambda a: a[2].__setitem__(0, torch.zeros(2, 300)),
     r"pos_momentums\[0\] must hold Char codes"),
    ("scales shape", lambda a: a[7].__setitem__(1, torch.zeros(3, 2)),
     r"scales\[1\] \(pos_momentums\[1\]'s\) must be a contiguous float32 tensor of shape \[3, 1\]"),
    ("missing scales", lambda a: a[7].pop(), r"3 scales for 2 params with 2 buffers each"),
    ("no seeds", lambda a: a.__setitem__(5, []), r"0 seeds and 2 offsets for 2 params"),
]


@needs_extension
@pytest.mark.parametrize("case,mutate,message", INT8_BAD_CALLS, ids=[c[0] for c in INT8_BAD_CALLS])
def test_bad_int8_op_arguments_raise_naming_the_culprit_and_write_nothing(case, mutate, message):
    args = _int8_op_args(adaptive=False)
    mutate(args)
    before = [t.clone() for t in args[0]] + [t.clone() for t in args[7]]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pnm_kernels.pnm_int8_step_(*args, **_PNM_KW)
    for t, b in zip(args[0] + args[7], before):
        assert torch.equal(t, b)
