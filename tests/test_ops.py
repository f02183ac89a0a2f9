"""The compiled ops themselves: schemas and fake kernels (opcheck), argument checks in C++,
and the CUDA launch planner, exercised through its CPU emulation. (The CPU kernel's
instruction sets: test_cpu_isa.py.)"""
import shutil
import subprocess

import pytest
import torch

from conftest import make_params, requires_extension
from pnm_kernels._ops import cuda_chunk_size, set_launch_limits

# The ops' step counters: float64 (exact to 2^53 steps; docs/edits.md, "Step counters")
STEP = torch.float64

pytestmark = requires_extension


def pnm_args(n=3, dtype=torch.float32, device="cpu"):
    shapes = [(5,), (130,), (2, 3)][:n]
    gen = torch.Generator().manual_seed(0)
    mk = lambda: [torch.randn(s, generator=gen).to(dtype).to(device) for s in shapes]  # noqa: E731
    zeros = lambda: [torch.zeros(s, dtype=dtype, device=device) for s in shapes]  # noqa: E731
    steps = [torch.tensor(float(i), dtype=STEP, device=device) for i in range(len(shapes))]
    return [mk(), mk(), zeros(), zeros(), steps]


def pnm_kwargs(**over):
    kw = dict(lr=1e-2, beta1=0.9, beta0=1.0, weight_decay=0.1, decoupled=True, maximize=False)
    kw.update(over)
    return kw


# The fused step ops' ticket counter (blocks_done), a list of none or one: none, the counters
# stepped by a launch of their own.
NO_TICKETS = dict(blocks_done=[])


def adapnm_args(amsgrad=True, dtype=torch.float32):
    params, grads, m, m_other, steps = pnm_args(dtype=dtype)
    v = [torch.zeros_like(p) for p in params]
    v_max = [torch.zeros_like(p) for p in params] if amsgrad else []
    return [params, grads, m, m_other, v, v_max, steps]


def adapnm_kwargs(**over):
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, beta0=1.0, eps=1e-8, weight_decay=0.1,
              amsgrad=True, decoupled=False, maximize=True)
    kw.update(over)
    return kw


OPS = ["pnm_step_", "emulated_cuda_pnm_step_"]
ADA_OPS = ["adapnm_step_", "emulated_cuda_adapnm_step_"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_pnm(op, dtype):
    torch.library.opcheck(getattr(torch.ops.pnm_kernels, op).default,
                          pnm_args(dtype=dtype), pnm_kwargs(**NO_TICKETS))
    torch.library.opcheck(getattr(torch.ops.pnm_kernels, op).default, pnm_args(),
                          pnm_kwargs(lr_tensor=torch.tensor(0.1), grad_scale=torch.tensor(4.0),
                                     found_inf=torch.tensor(0.0),
                                     blocks_done=[torch.zeros(1, dtype=torch.int32)]))


def state_args(adaptive, dtype=torch.float32, state_dtype=torch.bfloat16):
    """The state ops' arguments: the buffers in state_dtype, a seed and offset a tensor."""
    args = adapnm_args(dtype=dtype) if adaptive else pnm_args(dtype=dtype)
    for lst in range(2, len(args) - 1):
        args[lst] = [t.to(state_dtype) for t in args[lst]]
    seeds = [torch.tensor(i, dtype=torch.int64) for i in range(len(args[0]))]
    return args + [seeds, [0, 10, 1 << 33][:len(args[0])]]


@pytest.mark.parametrize("adaptive", [False, True], ids=["pnm", "adapnm"])
@pytest.mark.parametrize("dtype,state_dtype,stochastic", [
    (torch.float32, torch.bfloat16, False), (torch.bfloat16, torch.float32, True),
    (torch.bfloat16, torch.bfloat16, True)])
def test_opcheck_state_ops(adaptive, dtype, state_dtype, stochastic):
    op = torch.ops.pnm_kernels.adapnm_state_step_ if adaptive else torch.ops.pnm_kernels.pnm_state_step_
    kwargs = adapnm_kwargs() if adaptive else pnm_kwargs()
    torch.library.opcheck(op.default, state_args(adaptive, dtype, state_dtype),
                          dict(kwargs, bf16_stochastic_round=stochastic))


STATE_BAD_CALLS = [
    ("no seeds", lambda a: a.__setitem__(5, []), r"0 seeds and 3 offsets for 3 params"),
    ("seed dtype", lambda a: a[5].__setitem__(1, torch.tensor(1.0)),
     r"seeds\[1\] must be an int64 tensor"),
    ("negative offset", lambda a: a[6].__setitem__(2, -1), r"offsets\[2\] is negative"),
    ("float16 state", lambda a: [a.__setitem__(i, [t.half() for t in a[i]]) for i in (2, 3)],
     r"pos_momentums\[0\] has dtype Half beside Float parameters"),
    ("mixed state", lambda a: a[3].__setitem__(0, a[3][0].float()),
     r"neg_momentums\[0\] has dtype Float but pos_momentums\[0\] has BFloat16"),
]


@pytest.mark.parametrize("case,mutate,message", STATE_BAD_CALLS, ids=[c[0] for c in STATE_BAD_CALLS])
def test_bad_state_op_arguments_raise_naming_the_culprit_and_write_nothing(case, mutate, message):
    args = state_args(adaptive=False)
    mutate(args)
    before = [t.clone() for t in args[0]]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pnm_kernels.pnm_state_step_(*args, **pnm_kwargs())
    for t, b in zip(args[0], before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("op", ADA_OPS)
@pytest.mark.parametrize("amsgrad", [True, False])
def test_opcheck_adapnm(op, amsgrad):
    torch.library.opcheck(getattr(torch.ops.pnm_kernels, op).default, adapnm_args(amsgrad),
                          adapnm_kwargs(amsgrad=amsgrad, **NO_TICKETS))


def test_found_inf_skips_everything_including_the_step_counter():
    for op in OPS:
        args = pnm_args()
        before = [[t.clone() for t in lst] for lst in args]
        getattr(torch.ops.pnm_kernels, op)(*args, **pnm_kwargs(found_inf=torch.tensor(1.0)),
                                           **NO_TICKETS)
        for lst, old in zip(args, before):
            for t, o in zip(lst, old):
                assert torch.equal(t, o)


@pytest.mark.parametrize("op", ADA_OPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_float64_lr_tensor_is_read_in_full(op, dtype):
    """A float64 lr tensor is read as it is (here by the kernel, as it is on the params'
    device; read on the host from the CPU for GPU params: tests/test_cuda.py): the step is
    bitwise the step with the same lr as a float argument, which a float32 lr tensor rounds
    (an lr of 0.1 in float32 is 0.1 + 1.5e-9). One of several elements is refused."""
    lr = 0.1
    lr64 = torch.tensor(lr, dtype=torch.float64)
    fn = getattr(torch.ops.pnm_kernels, op)
    runs = {}
    for how, kwargs in (("float", adapnm_kwargs(lr=lr)),
                        ("float64 tensor", adapnm_kwargs(lr=0.0, lr_tensor=lr64)),
                        ("float32 tensor", adapnm_kwargs(lr=0.0, lr_tensor=torch.tensor(lr)))):
        args = adapnm_args(dtype=dtype)
        fn(*args, **kwargs, **NO_TICKETS)
        runs[how] = args[0]
    assert all(torch.equal(a, b) for a, b in zip(runs["float"], runs["float64 tensor"]))
    if dtype == torch.float64:
        assert not all(torch.equal(a, b) for a, b in zip(runs["float"], runs["float32 tensor"]))
    two = torch.tensor([lr, lr], dtype=torch.float64)
    with pytest.raises(RuntimeError,
                       match="lr_tensor must be a float32 or float64 tensor with one element"):
        fn(*adapnm_args(dtype=dtype), **adapnm_kwargs(lr_tensor=two), **NO_TICKETS)


@pytest.mark.parametrize("op", OPS)
def test_grad_scale_unscales_in_the_kernel(op):
    a, b = pnm_args(), pnm_args()
    b[1] = [g * 1024 for g in b[1]]
    fn = getattr(torch.ops.pnm_kernels, op)
    fn(*a, **pnm_kwargs(), **NO_TICKETS)
    fn(*b, **pnm_kwargs(grad_scale=torch.tensor(1024.0)), **NO_TICKETS)
    for x, y in zip(a[0] + a[2] + a[4], b[0] + b[2] + b[4]):
        torch.testing.assert_close(x, y)


BAD_CALLS = [
    ("list lengths", lambda a: a[1].pop(), "grads has 2 tensors but params has 3"),
    ("shape", lambda a: a[1].__setitem__(1, torch.zeros(131)), r"grads\[1\] has shape"),
    ("dtype", lambda a: a[2].__setitem__(0, torch.zeros(5, dtype=torch.float64)),
     r"pos_momentums\[0\] has dtype"),
    ("layout", lambda a: a[3].__setitem__(2, torch.zeros(3, 2).t()),
     r"neg_momentums\[2\] must be dense and laid out like params\[2\]"),
    ("not dense", lambda a: a[1].__setitem__(1, torch.zeros(260)[::2]),
     r"grads\[1\] must be dense"),
    ("step dtype", lambda a: a[4].__setitem__(0, torch.tensor(1, dtype=torch.int64)),
     r"steps\[0\] must be a float64"),
    ("param dtype", lambda a: a.__setitem__(0, [t.to(torch.float8_e4m3fn) for t in a[0]]),
     "params\\[0\\] has dtype Float8_e4m3fn"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case,mutate,message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_raise_naming_the_culprit_and_write_nothing(op, case, mutate, message):
    args = pnm_args()
    mutate(args)
    before = [t.clone() for t in args[0]]
    with pytest.raises(RuntimeError, match=message):
        getattr(torch.ops.pnm_kernels, op)(*args, **pnm_kwargs(), **NO_TICKETS)
    for t, b in zip(args[0], before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("kw,message", [(dict(lr=-1.0), "invalid lr -1$"),
                                        (dict(beta1=1.0), "invalid beta1 1$"),
                                        (dict(beta0=float("nan")), "invalid beta0 nan$"),
                                        (dict(weight_decay=-1.0), "invalid weight_decay -1$")])
def test_bad_scalars_raise_in_cpp(kw, message):
    """The value is in the message too: a build whose C++ runtime does not match torch's (a
    statically linked libstdc++) formats numbers wrongly or crashes here, and must not pass."""
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pnm_kernels.pnm_step_(*pnm_args(), **pnm_kwargs(**kw), **NO_TICKETS)


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_the_extension_carries_no_copy_of_the_cpp_runtime():
    """Every libstdc++ symbol is bound to the shared library torch loaded: a private copy in
    _C (a compiler that finds only libstdc++.a) is what made the error messages above crash
    on a GPU image. Checked on the built library, whatever compiler built it."""
    import pnm_kernels._C as ext
    defined = subprocess.run(["nm", "-D", "--defined-only", "-C", ext.__file__],
                             capture_output=True, text=True, check=True).stdout
    runtime = [line for line in defined.splitlines()
               if " std::basic_ostream" in line or " std::locale::" in line]
    assert not runtime, f"{ext.__file__} defines C++ runtime symbols: {runtime[:3]}"


@pytest.mark.parametrize("counters", ["second-launch", "single-launch", "capped"])
@pytest.mark.parametrize("limits", [(64, 1, 1), (64, 2, 3), (128, 400, 2), (64, 0, 0), (0, 0, 0)],
                         ids=["one-block-launches", "small-tables", "split-tensor",
                              "small-chunks-one-table", "defaults"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_emulated_launches_agree_with_the_cpu_kernel_across_launch_boundaries(limits, dtype,
                                                                                counters):
    """Many tensors per launch, tensors cut across launches, vector and masked paths: the
    CUDA block body gives bitwise what the fused CPU kernel gives (same maths header).
    Step counters are incremented by a second launch, or, given a blocks_done counter and a
    step that fits one launch (at most max_single_launch_blocks blocks: "capped" allows 2),
    by the block that takes the last ticket: every other block of every tensor must have read
    its old count by then (its parity and bias corrections would differ otherwise), and an
    empty tensor's counter still counts."""
    shapes = [(1,), (3,), (8,), (1000,), (0,), (64,), (65,), (517,), (9, 7), (0,)]
    params = [p.detach() for p in make_params(shapes, dtype=dtype, device="cpu")]
    params.append(torch.zeros(1001, dtype=dtype)[1:].copy_(params[3]))  # misaligned
    blocks_done = None if counters == "second-launch" else torch.zeros(1, dtype=torch.int32)
    set_launch_limits(*limits, max_single_launch_blocks=2 if counters == "capped" else 0)
    try:
        emulated, fused, steps = _emulated_beside_the_cpu_kernel(params, 6, blocks_done,
                                                                 decoupled=True)
    finally:
        set_launch_limits()
    assert all(torch.equal(x, y) for x, y in zip(emulated, fused))
    assert steps == [6.0] * len(params)


def _emulated_beside_the_cpu_kernel(params, num_steps, blocks_done, **hyper):
    """AdaPNM steps of params by the emulated CUDA op and of a copy by the fused CPU kernel,
    with the same gradients: each side's parameters, buffers and counters, then the emulated
    side's step counts. A blocks_done counter must be left at zero after every step."""
    sides = []
    for p in (params, [p.clone() for p in params]):
        sides.append((p, [[torch.zeros_like(q) for q in p] for _ in range(4)],
                      [torch.zeros((), dtype=STEP) for _ in p]))
    for _ in range(num_steps):
        grads = [torch.randn(p.shape).to(p.dtype) for p in params]
        for (ps, buffers, steps), op in zip(sides, ("emulated_cuda_adapnm_step_", "adapnm_step_")):
            getattr(torch.ops.pnm_kernels, op)(
                ps, grads, *buffers, steps, **adapnm_kwargs(**hyper),
                blocks_done=[] if blocks_done is None else [blocks_done])
        if blocks_done is not None:
            assert blocks_done.item() == 0  # left ready for the next step
    flat = [ps + sum(buffers, []) + steps for ps, buffers, steps in sides]
    return flat[0], flat[1], [s.item() for s in sides[0][2]]


@pytest.mark.parametrize("limits", [(64, 1, 1), (0, 0, 0)], ids=["one-block-launches", "defaults"])
def test_single_launch_counters_skip_a_found_inf_step_and_count_empty_params(limits):
    """With blocks_done, a found_inf step still changes nothing (no block takes a ticket, so
    the counter stays zero), and a step of nothing but empty tensors still counts them: as a
    single launch of one block without a chunk, or (tables of one tensor) by the counter
    launch."""
    op = torch.ops.pnm_kernels.emulated_cuda_pnm_step_
    blocks_done = torch.zeros(1, dtype=torch.int32)
    set_launch_limits(*limits)
    try:
        args = pnm_args()
        before = [[t.clone() for t in lst] for lst in args]
        op(*args, **pnm_kwargs(found_inf=torch.tensor(1.0)), blocks_done=[blocks_done])
        for lst, old in zip(args, before):
            for t, o in zip(lst, old):
                assert torch.equal(t, o)
        assert blocks_done.item() == 0
        empty = [[torch.zeros(0)] * 2 for _ in range(4)] + [[torch.zeros((), dtype=STEP), torch.ones((), dtype=STEP)]]
        op(*empty, **pnm_kwargs(), blocks_done=[blocks_done])
        assert [s.item() for s in empty[4]] == [1.0, 2.0] and blocks_done.item() == 0
    finally:
        set_launch_limits()


@pytest.mark.parametrize("blocks_done,message", [
    (torch.zeros(1), "blocks_done must be an int32 tensor with one element, got Float"),
    (torch.zeros(2, dtype=torch.int32), "blocks_done must be an int32 tensor with one element"),
    (torch.ones(1, dtype=torch.int32), "blocks_done must be zero when a step starts, got 1"),
], ids=["dtype", "size", "not-zero"])
def test_a_bad_blocks_done_counter_raises_and_writes_nothing(blocks_done, message):
    args = pnm_args()
    before = [[t.clone() for t in lst] for lst in args]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pnm_kernels.emulated_cuda_pnm_step_(*args, **pnm_kwargs(),
                                                      blocks_done=[blocks_done])
    for lst, old in zip(args, before):
        for t, o in zip(lst, old):
            assert torch.equal(t, o)


def _plan(numels, dtype=torch.float32, sms=0):
    """(table, tensor, chunk) a block; sms: as a step with a blocks_done counter on a GPU with
    that many SMs, whose single launch may have a block per SM."""
    flat = torch.ops.pnm_kernels._launch_plan(numels, dtype.itemsize, sms)
    return [tuple(flat[i:i + 3]) for i in range(0, len(flat), 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limits", [(0, 0, 0), (64, 3, 4), (1024, 2, 1)],
                         ids=["defaults", "small-tables", "one-block-launches"])
def test_launch_plan_covers_every_chunk_once_in_order(limits, dtype):
    numels = [1, 0, 5000, 64, 65, 3, 200000, 7]
    set_launch_limits(*limits)
    try:
        plan = _plan(numels, dtype)
        chunk = limits[0] or cuda_chunk_size(dtype)
    finally:
        set_launch_limits()
    expected = [(i, c) for i, n in enumerate(numels) for c in range((n + chunk - 1) // chunk)]
    assert [(t, c) for _, t, c in plan] == expected
    tables = [table for table, _, _ in plan]
    assert tables == sorted(tables)
    for table in set(tables):
        blocks = [b for b in plan if b[0] == table]
        if limits[2]:
            assert len(blocks) <= limits[2]
        assert len({t for _, t, _ in blocks}) <= (limits[1] or 535)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_the_python_chunk_size_is_the_kernels(dtype):
    """4,096 elements a block for 4- and 8-byte types, 16,384 for 16-bit ones."""
    chunk = cuda_chunk_size(dtype)
    assert chunk == (16384 if dtype.itemsize == 2 else 4096)
    assert _plan([chunk], dtype) == [(0, 0, 0)]
    assert _plan([chunk + 1], dtype) == [(0, 0, 0), (0, 0, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_step_that_fits_one_launch_only_with_larger_chunks_takes_them(dtype):
    """With a blocks_done counter a step is one launch if it has at most a block per SM. A
    step of 4-byte (or 8-byte) elements that 4,096-element chunks make too many blocks for
    that, but 16,384-element ones do not, takes 16,384-element chunks (one launch, not the
    step and the counter launches: host time less on these host-bound sizes); one too large
    for either, or one that fits already, keeps 4,096; so does every step without a counter
    and a chunk size set through the test hook. 132 SMs: an H100 or H200."""
    sms = 132
    blocks = lambda numels, **kw: len(_plan(numels, dtype, **kw))  # noqa: E731
    assert blocks([1 << 20], sms=sms) == 64 and blocks([1 << 20]) == 256
    assert blocks([sms * 4096], sms=sms) == sms
    assert blocks([sms * 4096 + 1], sms=sms) == 34
    assert blocks([sms * 16384 + 1], sms=sms) == sms * 4 + 1
    assert blocks([30000, 30000, 3], sms=3) == 8 + 8 + 1  # 16,384 would make 5 blocks
    assert blocks([16000, 20000, 3], sms=4) == 4
    assert [c for _, _, c in _plan([40000], dtype, sms=3)] == [0, 1, 2]
    set_launch_limits(chunk_size=4096)
    try:
        assert blocks([1 << 20], sms=sms) == 256
    finally:
        set_launch_limits()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_single_launch_with_larger_chunks_steps_as_the_cpu_kernel(dtype):
    """The emulated single launch of such a step (16,384-element chunks, the block that takes
    the last ticket incrementing the counters) gives bitwise what the fused CPU kernel gives,
    step counters included, and leaves blocks_done at zero."""
    assert len(_plan([40000, 3], dtype, sms=4)) == 4
    params = [p.detach() for p in make_params([(40000,), (3,)], dtype=dtype, device="cpu")]
    set_launch_limits(max_single_launch_blocks=4)
    try:
        emulated, fused, steps = _emulated_beside_the_cpu_kernel(
            params, 3, torch.zeros(1, dtype=torch.int32))
    finally:
        set_launch_limits()
    assert all(torch.equal(x, y) for x, y in zip(emulated, fused))
    assert steps == [3.0, 3.0]


def test_launch_plan_for_a_tensor_beyond_2_to_the_31_elements():
    """Chunk offsets are 64-bit: a 2^31 + 5 element tensor gets 2^31 / 4,096 + 1 chunks, its
    last one holding the 5 elements past 2^31, in the same launch as its neighbours."""
    plan = _plan([3, 2**31 + 5, 9])
    chunk = cuda_chunk_size(torch.float32)
    big = [c for table, t, c in plan if t == 1]
    assert big == list(range(2**31 // chunk + 1))
    assert big[-1] * chunk == 2**31
    assert {table for table, _, _ in plan} == {0}
    assert plan[-1][1:] == (2, 0)


def test_a_large_model_is_one_launch_and_many_tensors_are_few():
    """Launches are cut by tensor slots only (535 a table for PNM), never by chunk count: a
    Llama-1B-sized fp32 step of 146 tensors, 299,018 chunks, is one launch; 2,000 tensors
    are four."""
    llama = _plan([2**23] * 146 + [2**13 * 5])
    assert len(llama) == 146 * 2048 + 10 and {table for table, _, _ in llama} == {0}
    many = _plan([16] * 2000)
    assert [table for table, _, _ in many] == sorted(i // 535 for i in range(2000))
