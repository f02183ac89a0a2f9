"""Edits a user can make between steps, each checked against backend="reference" (parameters
and every state buffer, after every step): the fast paths never step stale or foreign
memory, and a step that raises has changed nothing."""
import collections
import copy

import pytest
import torch

import cases
from cases import FAST_PATHS
from conftest import (DEVICE, OPTIMIZERS, assert_same_bits, assert_states_close, clone_params,
                      grads_for_step, make_params, train)
from internals import triton_only_install

EVERY_PATH = FAST_PATHS + ["reference"]


def _side_by_side(name, path, shapes, groups=None, **kwargs):
    """(fast optimizer, its params, reference optimizer, its params), the same start."""
    params = make_params(shapes)
    ref = clone_params(params)

    def build(ps, backend):
        if groups is None:
            return OPTIMIZERS[name](ps, lr=0.1, backend=backend, **kwargs)
        return OPTIMIZERS[name]([dict(g, params=[ps[i] for i in g["params"]]) for g in groups],
                                lr=0.1, backend=backend, **kwargs)
    return build(params, path), params, build(ref, "reference"), ref


def _step_both(fast, params, ref, ref_params, t):
    for ps in (params, ref_params):
        for p, g in zip(ps, grads_for_step(ps, t)):
            p.grad = g
    fast.step()
    ref.step()
    assert_states_close(fast, params, ref, ref_params)


@cases.parametrize(FAST_PATHS)
def test_an_earlier_state_object_put_back_is_the_one_stepped(path, name):
    """opt.state = an earlier state object is what the next step reads, not the lists built
    from the state it replaced."""
    fast, params, ref, ref_params = _side_by_side(name, path, [(5,), (4, 3)])
    for t in range(3):
        _step_both(fast, params, ref, ref_params, t)
    saved = fast.state, ref.state
    fast.state, ref.state = collections.defaultdict(dict), collections.defaultdict(dict)
    _step_both(fast, params, ref, ref_params, 3)
    fast.state, ref.state = saved
    for t in range(4, 7):
        _step_both(fast, params, ref, ref_params, t)
    assert fast.state[params[0]]["step"].item() == 6


@cases.parametrize(FAST_PATHS)
def test_another_optimizers_state_assigned_is_the_one_stepped(path, name):
    """opt_b.state = opt_a.state: opt_b steps opt_a's tensors from then on."""
    params = make_params([(5,), (4, 3)])
    ref_params = clone_params(params)
    fast_a, fast_b, ref_a, ref_b = (OPTIMIZERS[name](ps, lr=0.1, backend=backend)
                                    for ps, backend in ((params, path), (params, path),
                                                        (ref_params, "reference"),
                                                        (ref_params, "reference")))
    for t in range(3):
        _step_both(fast_a, params, ref_a, ref_params, t)
    for t in range(3, 5):
        _step_both(fast_b, params, ref_b, ref_params, t)
    fast_b.state, ref_b.state = fast_a.state, ref_a.state
    for t in range(5, 8):
        _step_both(fast_b, params, ref_b, ref_params, t)
    assert fast_b.state[params[0]]["step"].item() == 6


NEW_DATA = {
    "float64 buffer": lambda t: t.double(),
    "bfloat16 buffer": lambda t: t.to(torch.bfloat16),
    "transposed buffer": lambda t: t.t().contiguous().t(),  # the parameter edited is 2-d
}


@cases.parametrize(FAST_PATHS)
@pytest.mark.parametrize("change", sorted(NEW_DATA))
@pytest.mark.parametrize("which", [0, -1])
def test_a_buffer_given_new_data_is_converted_and_stepped_in_every_group(path, name, change,
                                                                         which):
    """buf.data = ... of another dtype or layout: the state follows its parameter, as the
    reference's, in every group (no group steps while another refuses)."""
    fast, params, ref, ref_params = _side_by_side(
        name, path, [(6,), (8, 4)], groups=[dict(params=[0]), dict(params=[1], lr=0.05)])
    for t in range(3):
        _step_both(fast, params, ref, ref_params, t)
    for opt, ps in ((fast, params), (ref, ref_params)):
        state = opt.state[ps[1]]
        key = sorted(k for k in state if k != "step")[which]
        state[key].data = NEW_DATA[change](state[key].data)
    for t in range(3, 6):
        _step_both(fast, params, ref, ref_params, t)


# New data for a counter at 3, from the counter's own: new tensors, or its own memory seen
# through one dimension (the held lists' memory unchanged).
NEW_COUNTER = {"int64": lambda _: torch.tensor(3), "1-d": lambda _: torch.tensor([3.0]),
               "float64": lambda _: torch.tensor(3.0, dtype=torch.float64),
               "1-d-view-of-itself": lambda counter: counter.reshape(1)}


@cases.parametrize(FAST_PATHS)
@pytest.mark.parametrize("counter", NEW_COUNTER)
def test_a_step_counter_given_new_data_is_converted_and_counts_on(path, name, counter):
    """Counted on as the reference counts, in the shape () it leaves every counter in."""
    fast, params, ref, ref_params = _side_by_side(
        name, path, [(6,), (8, 4)], groups=[dict(params=[0]), dict(params=[1], lr=0.05)])
    for t in range(3):
        _step_both(fast, params, ref, ref_params, t)
    for opt, ps in ((fast, params), (ref, ref_params)):
        step = opt.state[ps[1]]["step"]
        step.data = NEW_COUNTER[counter](step.data)
    for t in range(3, 6):
        for ps in (params, ref_params):
            for p, g in zip(ps, grads_for_step(ps, t)):
                p.grad = g
        fast.step()
        ref.step()
        for a, b in zip(params, ref_params):
            torch.testing.assert_close(a.detach(), b.detach())
        assert fast.state[params[1]]["step"].item() == ref.state[ref_params[1]]["step"].item()
        assert fast.state[params[1]]["step"].shape == ref.state[ref_params[1]]["step"].shape


@cases.parametrize(FAST_PATHS)
def test_a_buffer_given_data_of_another_shape_raises_before_any_group_steps(path, name):
    params = make_params([(6,), (8, 4)])
    opt = OPTIMIZERS[name]([dict(params=[params[0]]), dict(params=[params[1]], lr=0.05)],
                           lr=0.1, backend=path)
    for t in range(3):
        for p, g in zip(params, grads_for_step(params, t)):
            p.grad = g
        opt.step()
    buffer = next(iter(v for k, v in opt.state[params[1]].items() if k != "step"))
    buffer.data = torch.zeros(5)
    before = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].item() for p in params]
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[0\].*shape \(5,\)"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    assert [opt.state[p]["step"].item() for p in params] == steps


@cases.parametrize(EVERY_PATH)
def test_step_counters_count_exactly_past_2_to_the_24(path, name):
    """A float32 counter stops at 2^24 (PNM then stops alternating its buffers); counters
    count exactly far beyond any run, also from an authors'-format Python int."""
    start = 2**24 + 1
    fast, params, ref, ref_params = _side_by_side(name, path, [(3,)])
    _step_both(fast, params, ref, ref_params, 0)
    for opt, ps in ((fast, params), (ref, ref_params)):
        opt.state[ps[0]]["step"] = start
    for t in range(1, 4):
        _step_both(fast, params, ref, ref_params, t)
    assert fast.state[params[0]]["step"].item() == start + 3


@pytest.mark.parametrize("start", [2**24 + 1, 2**53 - 4], ids=["2^24+1", "2^53-4"])
@cases.parametrize(EVERY_PATH)
def test_an_authors_format_checkpoint_of_a_long_run_loads_its_counters_exactly(path, name,
                                                                             start):
    """The authors' optimizers save step as a Python int: loaded, a count past 2^24 (which a
    float32 tensor rounds, to 2^24 at 2^24 + 1) becomes a float64 counter of that very count,
    and counts on exactly, as the reference does, up to 2^53."""
    fast, params, ref, ref_params = _side_by_side(name, path, [(3,), (4, 2)])
    _step_both(fast, params, ref, ref_params, 0)
    for opt, ps in ((fast, params), (ref, ref_params)):
        saved = copy.deepcopy(opt.state_dict())
        for entry in saved["state"].values():
            entry["step"] = start
        opt.load_state_dict(saved)
        counter = opt.state[ps[0]]["step"]
        assert counter.dtype == torch.float64 and counter.item() == start
    for t in range(1, 4):
        _step_both(fast, params, ref, ref_params, t)
    assert [fast.state[p]["step"].item() for p in params] == [start + 3] * 2


@cases.parametrize(EVERY_PATH)
@pytest.mark.parametrize("where", ["same group", "another group"])
def test_a_parameter_appended_twice_by_hand_is_refused_before_anything_is_touched(
        path, name, where):
    params = make_params([(3,), (4,)])
    opt = OPTIMIZERS[name]([dict(params=[params[0]]), dict(params=[params[1]])], lr=0.1,
                           backend=path)
    for t in range(2):
        for p, g in zip(params, grads_for_step(params, t)):
            p.grad = g
        opt.step()
    opt.param_groups[0 if where == "same group" else 1]["params"].append(params[0])
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"param_groups\[\d\]\['params'\]\[\d\] .* same tensor "
                                         r"as param_groups\[0\]\['params'\]\[0\]"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    assert opt.state[params[0]]["step"].item() == 2


@cases.parametrize(EVERY_PATH)
def test_parameters_without_gradients_taken_out_or_put_back_leave_the_others_stepped(
        path, name):
    """Parameters 1 and 2 of a group step, 0 and 3 have no gradient. Parameter 0 taken out
    of the group (the stepped ones each one place earlier), then put back at its end: every
    step steps parameters 1 and 2 as the reference does."""
    fast, params, ref, ref_params = _side_by_side(name, path, [(3,), (4, 3), (5, 2), (2,)])
    edits = {2: lambda ps: ps[1:], 4: lambda ps: ps[1:] + ps[:1]}
    for t in range(6):
        for opt, ps in ((fast, params), (ref, ref_params)):
            if t in edits:
                opt.param_groups[0]["params"] = edits[t](ps)
            for p, g in zip(ps, grads_for_step(ps, t)):
                p.grad = g
            ps[0].grad = ps[3].grad = None
            opt.step()
        assert_states_close(fast, params, ref, ref_params)
    assert fast.state[params[1]]["step"].item() == 6 and params[0] not in fast.state


@cases.parametrize(EVERY_PATH)
def test_a_parameter_moved_into_a_second_groups_list_seen_before_is_refused(path, name):
    """Both groups' lists were stepped before, each alone stepping every parameter once (the
    planner's groupings are cached): put together they step one parameter twice. Refused,
    naming both places, with nothing touched."""
    a, b, c = make_params([(5,), (5,), (5,)])
    opt = OPTIMIZERS[name]([dict(params=[b]), dict(params=[c, a])], lr=0.1, backend=path)
    first, second = opt.param_groups
    for edit in range(3):
        if edit == 1:
            first["params"], second["params"] = [a, b], [c]
        elif edit == 2:
            second["params"] = [c, a]  # the list of the first step again: a in both groups
        for p, g in zip((a, b, c), grads_for_step([a, b, c], edit)):
            p.grad = g
        if edit < 2:
            opt.step()
    before = [p.detach().clone() for p in (a, b, c)]
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\] .* same tensor as "
                                         r"param_groups\[0\]\['params'\]\[0\]"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip((a, b, c), before))
    assert opt.state[a]["step"].item() == 2


@pytest.mark.parametrize("container", [set, lambda ps: dict.fromkeys(ps).keys(), torch.stack],
                         ids=["set", "dict-keys", "tensor"])
@cases.parametrize(EVERY_PATH)
def test_params_set_by_hand_as_no_list_are_refused_naming_the_group(path, name, container):
    """A set (or dict keys) has no order to step by (the fused step repeated from its lists
    where it iterated in their order, and failed where not); a tensor would step its rows."""
    fast, params, ref, ref_params = _side_by_side(name, path, [(5,), (5,)])
    _step_both(fast, params, ref, ref_params, 0)
    fast.param_groups[0]["params"] = container([p for p in params])
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\] is a .*; it must be a "
                                        "list of parameters"):
        fast.step()
    fast.param_groups[0]["params"] = tuple(params)  # a tuple steps as the list would
    _step_both(fast, params, ref, ref_params, 1)


@pytest.mark.parametrize("lr_device", ["cpu", DEVICE] if DEVICE != "cpu" else ["cpu"])
@pytest.mark.parametrize("learned", [False, True], ids=["lr-tensor", "lr-requiring-grad"])
@cases.parametrize(EVERY_PATH)
def test_an_lr_tensor_given_new_data_is_what_the_next_step_takes(path, name, learned,
                                                                 lr_device):
    """`lr.data = ...` bumps no version counter; a learned lr (requires_grad) is held
    detached, which keeps the old memory: the step still reads the new value (here 0: the
    parameters stay), and validates it (a NaN is refused; a device lr's value is not read
    back, so there its new memory is what tells it changed)."""
    lrs = [torch.tensor(0.1, requires_grad=learned, device=lr_device) for _ in range(2)]
    fast, params, ref, ref_params = _side_by_side(name, path, [(5,), (4, 3)])
    fast.param_groups[0]["lr"], ref.param_groups[0]["lr"] = lrs
    for t in range(4):
        if t == 2:
            for lr in lrs:
                lr.data = torch.tensor(0.0, device=lr_device)
            stopped = [p.detach().clone() for p in params]
        _step_both(fast, params, ref, ref_params, t)
    assert all(torch.equal(p, q) for p, q in zip(params, stopped))
    if lr_device == "cpu":
        lrs[0].data = torch.tensor(float("nan"))
        with pytest.raises(ValueError, match="lr"):
            fast.step()


@cases.parametrize(EVERY_PATH)
def test_an_extra_group_key_holding_tensors_may_change_between_steps(path, name):
    """torch's optimizers carry a group's extra keys along whatever they hold."""
    fast, params, ref, ref_params = _side_by_side(name, path, [(3,)])
    for t in range(4):
        for opt in (fast, ref):
            opt.param_groups[0]["masks"] = [torch.ones(3) * t]
        _step_both(fast, params, ref, ref_params, t)


@pytest.mark.parametrize("state_dtype", [None, torch.float32, torch.int8],
                         ids=["bf16-state", "fp32-state", "int8-state"])
@cases.parametrize(FAST_PATHS)
def test_stochastic_rounding_switched_between_steps_is_followed(path, name, state_dtype):
    """A group's bf16_stochastic_round turned on and off between steps (bfloat16 parameters):
    each step rounds as the group says then, its lists (cached, or held for a repeated step)
    rebuilt with seeds or without. Each step equals, bit for bit, the step of a fresh
    optimizer (nothing cached or held) loaded with the state before it."""
    params = [p.detach().bfloat16().requires_grad_() for p in make_params([(4, 256), (3, 128)])]
    opt = OPTIMIZERS[name](params, lr=0.1, backend=path, state_dtype=state_dtype)
    for t, rounding in enumerate([False, False, True, True, False, True]):
        fresh_params = clone_params(params)
        fresh = OPTIMIZERS[name](fresh_params, lr=0.1, backend=path, state_dtype=state_dtype)
        if t:
            fresh.load_state_dict(copy.deepcopy(opt.state_dict()))  # not the live tensors
        for o, ps in ((opt, params), (fresh, fresh_params)):
            o.param_groups[0]["bf16_stochastic_round"] = rounding
            for p, g in zip(ps, grads_for_step(ps, t)):
                p.grad = g
            o.step()
        assert_same_bits(opt, params, fresh, fresh_params)


def _first_buffer(state):
    return sorted(k for k in state if k not in ("step", "seed") and not k.endswith("_scale"))[0]


# Edits of compressed state (its lists are cached between steps, docs/design.md §5).
COMPRESSED_EDITS = {
    "buffer float64": lambda state: setattr(state[_first_buffer(state)], "data",
                                            state[_first_buffer(state)].data.double()),
    "buffer transposed": lambda state: setattr(
        state[_first_buffer(state)], "data", state[_first_buffer(state)].data.t().contiguous().t()),
    "seed int32": lambda state: setattr(state["seed"], "data", state["seed"].data.int()),
    "counter int64": lambda state: setattr(state["step"], "data", state["step"].data.long()),
    "scale shorter": lambda state: setattr(
        state[_first_buffer(state) + "_scale"], "data",
        state[_first_buffer(state) + "_scale"].data[:, :1].clone()),
}


@pytest.mark.parametrize("edit", sorted(COMPRESSED_EDITS))
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
@cases.parametrize(FAST_PATHS)
def test_compressed_state_given_new_data_steps_as_a_fresh_optimizer(path, name, state_dtype,
                                                                    edit):
    """A tensor of compressed state given new data (t.data = ...) under the cached lists:
    the next step is, bit for bit, that of a fresh optimizer (nothing cached) loaded with the
    edited state; or both refuse, naming the parameter, and nothing moved."""
    if edit == "scale shorter" and state_dtype != torch.int8:
        pytest.skip("bfloat16 state has no scales")
    _compressed_edit_against_a_fresh_optimizer(path, name, state_dtype, edit)


@pytest.mark.parametrize("edit", ["buffer float64", "seed int32", "scale shorter"])
@cases.parametrize(["triton"])
def test_compressed_state_given_new_data_without_the_compiled_extension(path, name, edit,
                                                                        monkeypatch):
    """The same on a Triton-only install, whose cached lists are confirmed in Python."""
    triton_only_install(monkeypatch)
    _compressed_edit_against_a_fresh_optimizer(path, name, torch.int8, edit)


def _compressed_edit_against_a_fresh_optimizer(path, name, state_dtype, edit):
    params = make_params([(4, 256), (3, 128)])
    opt = OPTIMIZERS[name](params, lr=0.1, backend=path, state_dtype=state_dtype)
    for t in range(3):
        for p, g in zip(params, grads_for_step(params, t)):
            p.grad = g
        opt.step()
    COMPRESSED_EDITS[edit](opt.state[params[1]])
    fresh_params = clone_params(params)
    fresh = OPTIMIZERS[name](fresh_params, lr=0.1, backend=path, state_dtype=state_dtype)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    before = clone_params(params)
    outcomes = []
    for o, ps in ((opt, params), (fresh, fresh_params)):
        for p, g in zip(ps, grads_for_step(ps, 3)):
            p.grad = g
        try:
            o.step()
            outcomes.append(None)
        except RuntimeError as e:
            outcomes.append(str(e))
    if outcomes[1] is not None:  # the fresh optimizer refused the edited state: so does this one
        assert outcomes[0] == outcomes[1]
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        return
    assert outcomes[0] is None
    assert_same_bits(opt, params, fresh, fresh_params)


@pytest.mark.parametrize("state_dtypes", [(torch.bfloat16, torch.int8), (None, torch.bfloat16)],
                         ids=["bf16-and-int8", "fp32-and-bf16"])
@cases.parametrize(FAST_PATHS)
def test_a_state_shared_by_optimizers_of_other_state_dtypes_is_stepped_where_it_is(
        path, name, state_dtypes):
    """opt_b.state = opt_a.state with another state_dtype: b's step converts the shared
    buffers; a's next step takes them as they are now (converting them back), never the
    tensors its lists held before (cached, or held for a repeated step): as a fresh
    optimizer loaded with that state, bit for bit."""
    params = make_params([(4, 256)])
    a = OPTIMIZERS[name](params, lr=0.05, backend=path, state_dtype=state_dtypes[0])
    b = OPTIMIZERS[name](params, lr=0.05, backend=path, state_dtype=state_dtypes[1])
    for t in range(2):
        params[0].grad = grads_for_step(params, t)[0]
        a.step()
    b.state = a.state
    params[0].grad = grads_for_step(params, 2)[0]
    b.step()
    fresh_params = clone_params(params)
    fresh = OPTIMIZERS[name](fresh_params, lr=0.05, backend=path, state_dtype=state_dtypes[0])
    fresh.load_state_dict(copy.deepcopy(a.state_dict()))
    for o, ps in ((a, params), (fresh, fresh_params)):
        ps[0].grad = grads_for_step(ps, 3)[0]
        o.step()
    assert_same_bits(a, params, fresh, fresh_params)


@cases.parametrize(FAST_PATHS)
def test_scales_put_beside_a_bfloat16_buffer_of_int8_state_are_dropped(path, name):
    """int8 state keeps bfloat16 buffers where rows are shorter than a block; scales put
    beside one by hand (a checkpoint of another model, say) are dropped at the next step,
    which steps every parameter as a fresh optimizer does."""
    params = make_params([(2, 256), (4, 3), (5, 3)])
    opt = OPTIMIZERS[name](params, lr=0.05, backend=path, state_dtype=torch.int8)
    for t in range(2):
        for p, g in zip(params, grads_for_step(params, t)):
            p.grad = g
        opt.step()
    short = opt.state[params[1]]
    for key in [k for k in short if k not in ("step", "seed")]:
        short[key + "_scale"] = torch.ones(4, 1)
    fresh_params = clone_params(params)
    fresh = OPTIMIZERS[name](fresh_params, lr=0.05, backend=path, state_dtype=torch.int8)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for o, ps in ((opt, params), (fresh, fresh_params)):
        for p, g in zip(ps, grads_for_step(ps, 2)):
            p.grad = g
        o.step()
    assert not any(k.endswith("_scale") for k in opt.state[params[1]])
    assert_same_bits(opt, params, fresh, fresh_params)


@cases.parametrize(EVERY_PATH)
def test_a_step_refused_for_one_group_converts_no_state_of_another(path, name):
    """Group 0's state_dtype switched to int8 and group 1's parameter given data of another
    shape in the same step: the step refuses, naming group 1's parameter, before group 0's
    state is converted (an int8 round trip would lose digits); put right, the steps go on
    as if the refused one had never been tried."""
    runs = []
    for refused_first in (True, False):
        params = make_params([(2, 256), (4, 256)])
        opt = OPTIMIZERS[name]([dict(params=[params[0]]), dict(params=[params[1]])], lr=0.05,
                               backend=path, state_dtype=torch.bfloat16)
        train(opt, params, 2)
        if refused_first:
            before = copy.deepcopy(opt.state_dict())
            opt.param_groups[0]["state_dtype"] = torch.int8
            kept = params[1].data
            params[1].data = torch.randn(8, 128)
            with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[0\]"):
                train(opt, params, 1, start=2)
            after = opt.state_dict()
            for key, value in before["state"][0].items():
                assert torch.equal(after["state"][0][key], value), key
            opt.param_groups[0]["state_dtype"] = torch.bfloat16
            params[1].data = kept
        train(opt, params, 2, start=2)
        runs.append((opt, params))
    assert_same_bits(*runs[0], *runs[1])
