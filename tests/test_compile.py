"""torch.compile: the optimizer step traces without graph breaks (custom ops with fake
kernels, no host reads) and gives what eager gives: every backend, mixed dtypes, complex and
odd layouts, float64, one graph with fullgraph, eager and compiled steps alternating, static
inputs. What it refuses, as eager does: test_compile_refusals.py."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

import cases
from conftest import (DEVICE, HAS_TRITON, OPTIMIZERS, assert_same_bits, assert_states_close,
                      requires_extension)

pytestmark = requires_extension


def _models(n=2):
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(DEVICE)
              for _ in range(n)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return models


@cases.parametrize(["fused", "foreach", "triton"], args=["name", "backend"])
def test_compiled_step_has_no_graph_break(name, backend):
    """Also with backend="triton", which runs the fused kernels when traced (on a GPU,
    deciding that inside the traced step once broke the graph), and with backend="foreach",
    whose traced step reads parity and bias corrections on the device, not the host."""
    model = _models(1)[0]
    opt = OPTIMIZERS[name](model.parameters(), lr=torch.tensor(1e-2), backend=backend)
    model(torch.randn(8, 16, device=DEVICE)).sum().backward()
    opt.step()
    explain = torch._dynamo.explain(opt.step)()
    assert explain.graph_break_count == 0, explain.break_reasons


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16], ids=["own-state", "bf16-state"])
@pytest.mark.parametrize("lr", ["tensor", "float"])
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_compiled_training_step_matches_eager_and_compiles_once(name, lr, state_dtype):
    """A compiled training step (forward, backward, optimizer step) with an LR scheduler
    gives what eager gives bitwise, state included (a float lr enters the kernels with the
    eager step's float64 digits), and compiles its graphs once: as with torch's optimizers,
    new gradients each step and a new lr (a tensor's value, or a float, after one
    recompile) reuse them. Two groups, one of them without weight decay."""
    torch._dynamo.reset()
    eager, compiled = _models()
    opts = []
    for m in (eager, compiled):
        first, *rest = list(m.parameters())
        start = torch.tensor(1e-2) if lr == "tensor" else 1e-2
        opts.append(OPTIMIZERS[name]([dict(params=[first]), dict(params=rest, weight_decay=0.0)],
                                     lr=start, weight_decay=0.1, backend="fused",
                                     state_dtype=state_dtype))
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9) for o in opts]
    x, y = torch.randn(32, 16, device=DEVICE), torch.randn(32, 4, device=DEVICE)

    def train_step(model, opt):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    counter = CompileCounter()
    compiled_step = torch.compile(train_step, backend=counter)
    frames = []
    for _ in range(8):
        train_step(eager, opts[0])
        compiled_step(compiled, opts[1])
        for s in scheds:
            s.step()
        frames.append(counter.frame_count)
    assert frames[2] == frames[-1], frames  # a graph per step would hit the recompile limit
    assert_same_bits(opts[1], list(compiled.parameters()), opts[0], list(eager.parameters()))


@pytest.mark.parametrize("backend", ["fused", "foreach"])
def test_a_step_counter_set_by_hand_as_a_number_is_taken_by_the_compiled_step(backend):
    """As by the eager step (the authors' checkpoints hold ints): the next compiled step
    continues from it (torch.compile reads every counter's device before our code runs)."""
    torch._dynamo.reset()
    runs = []
    for compiled in (True, False):
        p = torch.nn.Parameter(torch.arange(6.0))
        opt = OPTIMIZERS["AdaPNM"]([p], lr=1e-2, backend=backend)
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        p.grad = torch.ones_like(p)
        step()
        opt.state[p]["step"] = 7
        p.grad = torch.full_like(p, 0.5)
        step()
        runs.append((p, opt))
    (p, opt), (q, eager) = runs
    assert int(opt.state[p]["step"]) == 8
    assert torch.equal(p, q)
    assert all(torch.equal(value, eager.state[q][k]) for k, value in opt.state[p].items())


@pytest.mark.parametrize("backend", ["fused", "foreach"])
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_a_compiled_step_takes_mixed_dtypes_complex_and_odd_layouts(name, backend):
    """fp32/fp16/bf16, complex, transposed, channels_last, a strided slice, 0-dim and empty
    parameters in one group, a second group and groups with no parameter: the compiled step
    makes one graph (fullgraph) and gives what the eager step gives, and the strided slice is
    updated in place; also where the step runs foreach ops (what an install without the
    extension traces)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(10, generator=gen), torch.randn(9, generator=gen).half(),
               torch.randn(6, 2, generator=gen).bfloat16(),
               torch.randn(5, generator=gen, dtype=torch.complex64),
               torch.randn(6, 4, generator=gen).t(),
               torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last),
               torch.randn(8, 12, generator=gen).to(DEVICE)[:, ::3],
               torch.randn((), generator=gen), torch.randn(0, generator=gen)]
    runs = []
    for compile_step in (False, True):
        # Copies that keep each layout (the slice: a fresh slice of a copy of its base).
        params = [t.to(DEVICE).clone() for t in tensors]
        params[6] = tensors[6]._base.clone()[:, ::3]
        params = [p.requires_grad_() for p in params]
        # Groups without parameters too (a decay/no-decay split with one side empty).
        opt = OPTIMIZERS[name]([dict(params=[]), dict(params=params[:7]), dict(params=[]),
                                dict(params=params[7:], lr=3e-3)],
                               lr=1e-2, weight_decay=0.1, backend=backend)
        step = (torch.compile(opt.step, backend=CompileCounter(), fullgraph=True)
                if compile_step else opt.step)
        for t in range(4):
            gen_t = torch.Generator().manual_seed(t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen_t, dtype=p.dtype).to(DEVICE)
            step()
        runs.append((opt, params))
    if backend == "fused":  # the same kernels, traced or not
        assert_states_close(*runs[1], *runs[0])
    else:  # foreach ops round 16-bit values otherwise than their traced form (docs/design.md
        # §4): those agree to a few roundings of the tensor's largest magnitude over 4 steps
        (opt, params), (eager, eager_params) = runs[1], runs[0]
        for p, q in zip(params, eager_params):
            for a, b in [(p.detach(), q.detach()), *((v, eager.state[q][k])
                                                     for k, v in opt.state[p].items())]:
                low = b.dtype in (torch.float16, torch.bfloat16) and b.numel()
                tol = dict(rtol=0, atol=8 * torch.finfo(b.dtype).eps * float(b.abs().max())
                           ) if low else {}
                torch.testing.assert_close(a, b, **tol)
    assert runs[1][1][6].stride() == (12, 3)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_a_compiled_step_with_the_triton_backend_runs_the_same_maths_traced(name):
    """Dynamo cannot trace the Triton step (pointer tables); under torch.compile a group
    asking for backend="triton" steps through the fused kernels instead, over the same
    state, and agrees with the reference."""
    torch._dynamo.reset()
    params = [torch.randn(s, device=DEVICE, requires_grad=True) for s in (5, 130)]
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    opt = OPTIMIZERS[name](params, lr=1e-2, weight_decay=0.1, backend="triton")
    ref = OPTIMIZERS[name](ref_params, lr=1e-2, weight_decay=0.1, backend="reference")
    step = torch.compile(opt.step, backend=CompileCounter())
    for t in range(4):
        gen = torch.Generator().manual_seed(t)
        for p, q in zip(params, ref_params):
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            q.grad = p.grad.clone()
        step()
        ref.step()
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_eager_and_compiled_steps_can_alternate(name):
    """Eager steps (which hold their lists between steps), then compiled ones (which make
    state for a parameter that gets its first gradient there), then eager ones again: the
    same as eager throughout, state included."""
    torch._dynamo.reset()
    runs = []
    for switch in (False, True):
        torch.manual_seed(0)
        params = [torch.randn(s, device=DEVICE, requires_grad=True) for s in (7, (3, 4), 5)]
        opt = OPTIMIZERS[name]([dict(params=params[:2]), dict(params=params[2:], lr=3e-3)],
                               lr=1e-2, backend="fused")
        compiled = torch.compile(opt.step, backend=CompileCounter())
        for t in range(9):
            gen = torch.Generator().manual_seed(t)
            for i, p in enumerate(params):
                late = i == 2 and t < 4  # the last parameter's first gradient comes at step 4
                p.grad = None if late else torch.randn(p.shape, generator=gen).to(DEVICE)
            (compiled if switch and 3 <= t < 6 else opt.step)()
        runs.append((opt, params))
    assert_states_close(*runs[1], *runs[0])


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_the_step_compiles_into_one_graph_with_fullgraph(name):
    """torch.compile(opt.step, fullgraph=True) works (torch's own optimizers break the graph
    on purpose and refuse it): two groups, a tensor lr changed between steps, new gradients
    each step, one graph for every step."""
    torch._dynamo.reset()
    params = [torch.randn(5, device=DEVICE, requires_grad=True),
              torch.randn(3, 2, device=DEVICE, requires_grad=True)]
    opt = OPTIMIZERS[name]([dict(params=params[:1]), dict(params=params[1:], lr=1e-3)],
                           lr=torch.tensor(1e-2))
    counter = CompileCounter()
    step = torch.compile(opt.step, backend=counter, fullgraph=True)
    for t in range(4):
        for p in params:
            p.grad = torch.randn_like(p)
        step()
        opt.param_groups[0]["lr"].mul_(0.5)
    assert counter.frame_count == 1
    assert [opt.state[p]["step"].item() for p in params] == [4, 4]


def _step_beside(step, ref, params, ref_params, steps):
    """`steps` steps of `step` over params and of the reference optimizer over its copies,
    with the same new gradients each time."""
    for t in range(steps):
        gen = torch.Generator().manual_seed(t)
        for p, q in zip(params, ref_params):
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype).to(DEVICE)
            q.grad = p.grad.clone()
        step()
        ref.step()


@pytest.mark.parametrize("decoupled", [True, False], ids=["decoupled", "L2"])
@pytest.mark.parametrize("backend", ["auto", "foreach"])
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_float64_parameters_compile_into_one_graph_and_step_as_the_reference(name, backend,
                                                                            decoupled):
    """float64 parameters, on the fused kernels' float64 build ("auto") or on foreach ops:
    traced, the foreach ops take each tensor's parity and bias corrections from its step
    counter on the device, so torch.compile(fullgraph=True) takes the step (a host read of
    the counters refused it), compiles it once for every step, and it agrees with the
    reference over both parities, state included. (A Triton-only install's batches trace
    the same way.)"""
    torch._dynamo.reset()
    extra = dict(amsgrad=True) if name == "AdaPNM" else {}
    params = [torch.randn(s, dtype=torch.float64, device=DEVICE, requires_grad=True)
              for s in (7, (3, 5), ())]
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    kwargs = dict(lr=1e-2, weight_decay=0.1, decoupled=decoupled, **extra)
    opt = OPTIMIZERS[name](params, backend=backend, **kwargs)
    ref = OPTIMIZERS[name](ref_params, backend="reference", **kwargs)
    counter = CompileCounter()
    step = torch.compile(opt.step, backend=counter, fullgraph=True)
    _step_beside(step, ref, params, ref_params, steps=7)
    assert counter.frame_count == 1
    assert_states_close(opt, params, ref, ref_params, rtol=1e-14, atol=1e-14)


def test_float64_adapnm_compiled_by_inductor_steps_as_the_reference():
    """The foreach ops' traced maths through inductor's generated code (the test above
    traces only)."""
    torch._dynamo.reset()
    params = [torch.randn(s, dtype=torch.float64, device=DEVICE, requires_grad=True)
              for s in (33, (4, 3))]
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    opt = OPTIMIZERS["AdaPNM"](params, lr=1e-2, weight_decay=0.1, backend="foreach")
    ref = OPTIMIZERS["AdaPNM"](ref_params, lr=1e-2, weight_decay=0.1, backend="reference")
    step = torch.compile(opt.step, fullgraph=True)
    _step_beside(step, ref, params, ref_params, steps=3)
    assert_states_close(opt, params, ref, ref_params, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("backend", ["fused", "foreach"])
@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_complex_parameters_compiled_through_functionalization_step_as_eager(name, backend,
                                                                             compiler):
    """Complex parameters through AOT autograd's functionalization and inductor (the tests
    above trace only): torch rebuilds the real view an op writes as_strided over the complex
    base, which fails, and inductor fails on a custom op taking complex tensors. The fused
    kernels take real copies written back through the views: bitwise eager."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    shapes = [(5,), (4, 3)]
    values = [torch.randn(s, generator=gen, dtype=torch.complex64) for s in shapes]
    values.append(torch.randn(3, 4, generator=gen, dtype=torch.complex64).t())  # transposed
    runs = []
    for compile_step in (False, True):
        params = [v.to(DEVICE).clone().requires_grad_() for v in values[:2]]
        params.append(values[2].t().to(DEVICE).clone().t().requires_grad_())
        opt = OPTIMIZERS[name](params, lr=1e-2, weight_decay=0.1, backend=backend)
        step = torch.compile(opt.step, backend=compiler, fullgraph=True) if compile_step \
            else opt.step
        for t in range(3):
            gen_t = torch.Generator().manual_seed(t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen_t, dtype=p.dtype).to(DEVICE)
            step()
        runs.append((opt, params))
    # foreach ops decomposed (AOT autograd) or generated (inductor) round otherwise at times
    tol = {} if backend == "foreach" else dict(atol=0, rtol=0)
    assert_states_close(*runs[1], *runs[0], **tol)


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_the_compiled_step_takes_parameters_and_state_as_static_inputs(name):
    """What mode="reduce-overhead" needs to keep its CUDA graph (tests/test_cuda.py replays
    one): every tensor the step writes, parameters and all their state, is static to the
    graph, as torch's optimizers' are; only the gradients and the lr are copied in. State
    made by eager steps before, two groups, amsgrad's extra buffer."""
    torch._dynamo.reset()
    model = _models(1)[0]
    first, *rest = list(model.parameters())
    extra = dict(amsgrad=True) if name == "AdaPNM" else {}
    opt = OPTIMIZERS[name]([dict(params=[first]), dict(params=rest, lr=1e-3)],
                           lr=torch.tensor(1e-2, device=DEVICE), backend="fused", **extra)
    copied_in = []

    def backend(gm, example_inputs):  # static as recorded when the input was traced
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        copied_in.extend(x for node, x in zip(inputs, example_inputs, strict=True)
                         if isinstance(x, torch.Tensor) and "_dynamo_static_input_type"
                         not in node.meta.get("tensor_dict", {}))
        return gm

    step = torch.compile(opt.step, backend=backend)
    x = torch.randn(8, 16, device=DEVICE)
    for t in range(3):
        opt.zero_grad(set_to_none=False)
        model(x).square().sum().backward()
        (step if t else opt.step)()
    written = list(model.parameters()) + [v for s in opt.state.values() for v in s.values()]
    assert len(written) == 4 * (6 if name == "AdaPNM" else 4)  # each parameter and its state
    addresses = {t.data_ptr() for t in written}
    assert copied_in and not [t for t in copied_in if t.data_ptr() in addresses]
    grads_and_lr = {p.grad.data_ptr() for p in model.parameters()} | {opt.param_groups[0]["lr"].data_ptr()}
    assert {t.data_ptr() for t in copied_in} <= grads_and_lr


@cases.parametrize(["reference", "foreach", "fused", "triton"], args=["name", "backend"])
def test_a_compiled_step_gives_what_eager_gives_with_every_backend(name, backend):
    """torch.compile(opt.step) over two groups, state included, with every backend. The
    reference breaks the graph (it reads each step count on the host), and dynamo then
    compiles the step's inner functions as frames of their own: compiled alone, _init_group
    once gave every group the first parameter's state (silently, 2026-11-26)."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        params = [torch.randn(s, device=DEVICE, requires_grad=True) for s in (7, (3, 4), 5, 6)]
        opt = OPTIMIZERS[name]([dict(params=params[:2]), dict(params=params[2:], lr=3e-3)],
                               lr=1e-2, weight_decay=0.1, backend=backend)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for t in range(4):
            gen = torch.Generator().manual_seed(t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            step()
        runs.append((opt, params))
    assert_states_close(*runs[1], *runs[0])


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_the_reference_compiled_by_inductor_writes_stochastic_bfloat16_as_eager(name):
    """The reference runs eagerly inside a compiled step: traced, its step count became a
    symbol from the second step, and inductor compiled the random bits' integer hash as
    float ops, failing midway through the step (parameter and counter moved, momentum not)."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        params = [torch.randn(64, requires_grad=True)]
        opt = OPTIMIZERS[name](params, lr=1e-2, backend="reference", state_dtype=torch.bfloat16)
        step = torch.compile(opt.step) if compiled else opt.step
        for t in range(3):
            params[0].grad = torch.randn(64, generator=torch.Generator().manual_seed(t))
            step()
        runs.append((opt, params))
    assert_states_close(*runs[1], *runs[0], rtol=0, atol=0)
