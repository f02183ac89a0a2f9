"""State no step can use, whether given new data, shared, set by hand or loaded, is refused
at the step naming the parameter (and the key), before anything is touched: no parameter,
state buffer or step counter changes, in any group (docs/edits.md)."""
import copy
import re

import pytest
import torch

import cases
from cases import FAST_PATHS
from conftest import (DEVICE, OPTIMIZERS, assert_same_bits, assert_same_entry,
                      assert_states_close, clone_params, grads_for_step, make_params, train,
                      with_reference)
from internals import state_buffer_names, triton_only_install


def _assert_step_refused_untouched(opt, params, match):
    """The next step (gradients of ones) raises `match`, and no parameter or step counter
    has changed."""
    values = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].clone() if torch.is_tensor(opt.state[p].get("step"))
             else None for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    for p, v, s in zip(params, values, steps):
        assert torch.equal(p, v)
        assert s is None or s.is_meta or torch.allclose(opt.state[p]["step"], s, rtol=0,
                                                        atol=0, equal_nan=True)


@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_parameter_given_data_of_another_shape_raises_before_any_change(path, name):
    """State cannot follow a new shape: the step raises, naming the parameter, before any
    batch (here the float32 one ahead of it) has stepped."""
    params = make_params([(5,), (3, 2)]) + make_params([(4,)], dtype=torch.bfloat16)
    opt = OPTIMIZERS[name](params, backend=path)
    train(opt, params, 3)
    params[2].data = torch.zeros(9, dtype=torch.bfloat16, device=DEVICE)
    _assert_step_refused_untouched(opt, params, r"params'\]\[2\].*another shape")


def _share_state(opt, params, what):
    """Puts one tensor (or the whole entry) of params[0]'s state under params[2]'s (the
    bfloat16 parameter's batch) as a hand-made reset or copy would."""
    first, other = opt.state[params[0]], opt.state[params[2]]
    if what == "entry":
        opt.state[params[2]] = first
    elif what == "counter":
        counter = torch.zeros((), dtype=first["step"].dtype, device=DEVICE)
        first["step"] = other["step"] = counter
    else:
        other[what] = first[what]


@pytest.mark.parametrize("what", ["counter", "buffer", "entry"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_state_shared_between_parameters_raises_naming_both_before_any_change(path, name,
                                                                             what):
    """Each backend would step a shared counter or buffer another way (twice, once, or with
    the last writer winning): refused, naming both parameters, before any batch (here the
    float32 one ahead) has stepped."""
    params = make_params([(4,), (3, 2)]) + make_params([(4,)], dtype=torch.bfloat16)
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=torch.float32)
    train(opt, params, 3)
    buffer = "exp_avg" if name == "AdaPNM" else "pos_momentum"
    _share_state(opt, params, buffer if what == "buffer" else what)
    _assert_step_refused_untouched(opt, params, r"params'\]\[2\].* the very tensor of "
                                                r"param_groups\[0\]\['params'\]\[0\]")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_one_tensor_under_two_keys_of_a_state_raises_naming_both_before_any_change(
        path, name, state_dtype):
    """Both momenta reset with one zero tensor (`st[a] = st[b] = zeros`): the reference steps
    the momentum of the step's parity into the other too, a kernel reads them apart. Refused,
    naming the parameter and both keys, before the other parameter (ahead of it) steps."""
    params = make_params([(4,), (3, 200)])
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=state_dtype)
    train(opt, params, 3)
    state = opt.state[params[1]]
    first, second = ("exp_avg", "neg_exp_avg") if name == "AdaPNM" else ("pos_momentum",
                                                                          "neg_momentum")
    state[first] = state[second] = torch.zeros_like(state[first])
    _assert_step_refused_untouched(opt, params, rf"params'\]\[1\].* state '{second}' is the "
                                                rf"very tensor of its own state '{first}'")


# A value no step can use, put into int8 state (of a momentum, or its block scales), and what
# the refusal says of it.
BAD_STATE_VALUES = {
    "step of two elements": (lambda st, m: st.__setitem__("step", torch.zeros(2)),
                             r"'step' has 2 elements, not one"),
    "seed of two elements": (lambda st, m: st.__setitem__("seed", st["seed"].repeat(2)),
                             r"'seed' has 2 elements, not one"),
    "buffer of a list": (lambda st, m: st.__setitem__(m, st[m].tolist()),
                         r"'{m}' is a list, not a tensor"),
    "int64 buffer": (lambda st, m: st.__setitem__(m, st[m].long()),
                     r"'{m}' is of dtype torch.int64: a buffer holds floating values"),
    "uint8 codes of a momentum": (lambda st, m: st.__setitem__(m, st[m].view(torch.uint8)),
                                  r"'{m}' holds torch.uint8 codes where its codes are signed"),
    "int64 scales": (lambda st, m: st.__setitem__(f"{m}_scale", st[f"{m}_scale"].long()),
                     r"'{m}_scale' is torch.int64, not a floating tensor of block scales"),
    "a float for scales": (lambda st, m: st.__setitem__(f"{m}_scale", 1.0),
                           r"'{m}_scale' is float, not a floating tensor of block scales"),
    "codes on another device": (lambda st, m: st.__setitem__(m, st[m].to("meta")),
                                r"'{m}_scale' is on \S+, its codes on meta"),
    "a bool step": (lambda st, m: st.__setitem__("step", torch.tensor(True)),
                    r"'step' is a tensor of torch.bool, not a real number"),
    "a negative step": (lambda st, m: st.__setitem__("step", -1),
                        r"'step' is -1.0, not a whole number of steps >= 0"),
    "a fractional step": (lambda st, m: st.__setitem__("step", torch.tensor(2.5)),
                          r"'step' is 2.5, not a whole number of steps >= 0"),
    # A seed loaded as a float: float16 holds no more than 65504.
    "an infinite seed": (lambda st, m: st.__setitem__("seed", torch.tensor(float("inf"))),
                         r"'seed' is inf, not a whole number within int64"),
    "a NaN seed": (lambda st, m: st.__setitem__("seed", float("nan")),
                   r"'seed' is nan, not a whole number within int64"),
    "a seed past int64": (lambda st, m: st.__setitem__("seed", 2**70),
                          r"'seed' is 1180591620717411303424, not a whole number within int64"),
    "a fractional seed": (lambda st, m: st.__setitem__("seed", torch.tensor(2.5)),
                          r"'seed' is 2.5, not a whole number within int64"),
    # Only AdaPNM keeps a second moment, in unsigned codes.
    "int8 codes of a second moment": (
        lambda st, m: st.__setitem__("exp_avg_sq", st["exp_avg_sq"].view(torch.int8)),
        r"'exp_avg_sq' holds torch.int8 codes where its codes are unsigned"),
    # State made by a dry run on a meta model.
    "a counter on the meta device": (lambda st, m: st.__setitem__("step", st["step"].to("meta")),
                                     r"'step' is on the meta device \(no data\)"),
    "a seed on the meta device": (lambda st, m: st.__setitem__("seed", st["seed"].to("meta")),
                                  r"'seed' is on the meta device \(no data\)"),
    "a buffer on the meta device": (
        lambda st, m: st.update({m: st[m].to("meta"), f"{m}_scale": st[f"{m}_scale"].to("meta")}),
        r"'{m}' is on the meta device \(no data\), beside a parameter with data"),
}


@pytest.mark.parametrize("how", ["by-hand", "loaded"])
@pytest.mark.parametrize("bad", list(BAD_STATE_VALUES))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_state_no_step_can_use_is_refused_naming_it_before_any_change(path, name, bad, how):
    """Set by hand, or in a state_dict loaded (the load itself never stops half way: every
    other entry is restored, its codes int8): the step refuses it naming the parameter and
    the key, before any parameter or state has changed."""
    if ("another device" in bad or "meta" in bad) and how == "loaded":
        pytest.skip("load_state_dict moves every tensor to its parameter's device")
    if "second moment" in bad and name == "PNM":
        pytest.skip("PNM keeps no second moment")
    momentum = "exp_avg" if name == "AdaPNM" else "pos_momentum"
    edit, culprit = BAD_STATE_VALUES[bad]
    params = make_params([(3, 200), (2, 128)])
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=torch.int8)
    train(opt, params, 2)
    if how == "by-hand":
        edit(opt.state[params[0]], momentum)
    else:
        saved = copy.deepcopy(opt.state_dict())
        edit(saved["state"][0], momentum)
        params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = OPTIMIZERS[name](params, backend=path, state_dtype=torch.int8)
        opt.load_state_dict(saved)
        assert opt.state[params[1]][momentum].dtype == torch.int8
    other_state = copy.deepcopy(dict(opt.state[params[1]]))
    _assert_step_refused_untouched(opt, params,
                                   r"params'\]\[0\].* state " + culprit.format(m=momentum))
    for key, value in other_state.items():
        assert torch.equal(opt.state[params[1]][key], value), key


@pytest.mark.parametrize("how", ["by-hand", "loaded"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_int8_codes_of_a_parameter_whose_rows_hold_no_block_are_refused_naming_it(path, name,
                                                                                   how):
    """A parameter whose rows are shorter than a block keeps bfloat16 state: int8 codes and
    scales put there (by hand, or in an edited checkpoint) are refused naming it, before any
    change."""
    momentum = "exp_avg" if name == "AdaPNM" else "pos_momentum"
    params = make_params([(3, 200), (5,)])
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=torch.int8)
    train(opt, params, 2)
    state = opt.state[params[1]] if how == "by-hand" else copy.deepcopy(opt.state_dict())
    entry = state if how == "by-hand" else state["state"][1]
    entry[momentum] = torch.zeros(5, dtype=torch.int8)
    entry[f"{momentum}_scale"] = torch.ones(5, 1)
    if how == "loaded":
        params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = OPTIMIZERS[name](params, backend=path, state_dtype=torch.int8)
        opt.load_state_dict(state)
    _assert_step_refused_untouched(opt, params, rf"params'\]\[1\].* state '{momentum}' holds "
                                                r"int8 codes, which this parameter does not "
                                                r"keep: its rows are shorter than a block")


@pytest.mark.parametrize("scale", [-1.0, float("-inf")])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_checkpoint_with_negative_int8_scales_is_refused_by_the_load_nothing_loaded(name,
                                                                                       scale):
    """No quantisation makes a negative block scale (a block's scale is its largest
    magnitude): decoded, a momentum would change sign and a second moment have no root.
    load_state_dict refuses it, naming the entry and key, with nothing loaded."""
    params = make_params([(3, 200)])
    opt = OPTIMIZERS[name](params, state_dtype=torch.int8)
    train(opt, params, 2)
    saved = copy.deepcopy(opt.state_dict())
    key = "exp_avg_sq_scale" if name == "AdaPNM" else "neg_momentum_scale"
    saved["state"][0][key][1, 0] = scale
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"state_dict\['state'\]\[0\]\['{key}'\] holds a "
                                         r"negative block scale .*Nothing was loaded"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert all(torch.equal(v, after["state"][0][k]) for k, v in before["state"][0].items())
    saved["state"][0][key][1, 0] = float("nan")  # diverged state loads as saved
    opt.load_state_dict(saved)


# A count no step can use, filled in place into a counter between steps, and what the
# refusal says of it.
COUNTS_FILLED_IN = {"-1": (-1.0, r"'step' is -1.0, not a whole number of steps >= 0"),
                    "2.5": (2.5, r"'step' is 2.5, not a whole number of steps >= 0"),
                    "nan": (float("nan"), r"'step' is nan, not a whole number of steps >= 0")}
STATE_DTYPES = {"own-dtype-state": None, "bf16-state": torch.bfloat16, "int8-state": torch.int8}


def _counter_filled_in_place(path, name, value, batches, state_dtype):
    params = make_params([(5,), (3, 200)])
    if batches == "two":  # the counter's batch steps after the float32 one
        params += make_params([(2, 128)], dtype=torch.bfloat16)
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=STATE_DTYPES[state_dtype])
    train(opt, params, 3)
    fill, culprit = COUNTS_FILLED_IN[value]
    opt.state[params[-1]]["step"].fill_(fill)
    _assert_step_refused_untouched(opt, params,
                                   rf"params'\]\[{len(params) - 1}\].* state " + culprit)


@pytest.mark.parametrize("state_dtype", list(STATE_DTYPES))
@pytest.mark.parametrize("batches", ["one", "two"])
@pytest.mark.parametrize("value", list(COUNTS_FILLED_IN))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_counter_filled_in_place_with_no_count_of_steps_is_refused_before_any_change(
        path, name, value, batches, state_dtype):
    """`state["step"].fill_(-1)` bumps no version a cache could see, but the held lists read
    every CPU counter again before a step (at -1 AdaPNM's kernels divided by a bias
    correction of 0): refused naming the parameter, as the reference refuses it, before any
    batch stepped."""
    _counter_filled_in_place(path, name, value, batches, state_dtype)


@pytest.mark.parametrize("value", list(COUNTS_FILLED_IN))
@cases.parametrize(["triton"])
def test_a_counter_filled_in_place_without_the_compiled_extension(path, name, value,
                                                                   monkeypatch):
    """The same on a Triton-only install, whose held lists are checked in Python."""
    triton_only_install(monkeypatch)
    _counter_filled_in_place(path, name, value, "two", "bf16-state")


@pytest.mark.parametrize("state_dtype", ["own-dtype-state", "bf16-state"])
@cases.parametrize(FAST_PATHS)
def test_a_counter_filled_in_place_with_a_count_steps_from_it_as_the_reference(path, name,
                                                                            state_dtype):
    """A whole count filled in place (a schedule's warm-up skipped by hand) is read by the
    held lists: the bias corrections and PNM's alternation follow it as the reference's do."""
    params = make_params([(5,), (3, 200)])
    ref_params = clone_params(params)
    opt, ref = (OPTIMIZERS[name](ps, backend=backend, state_dtype=STATE_DTYPES[state_dtype])
                for ps, backend in ((params, path), (ref_params, "reference")))
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        o.state[ps[1]]["step"].fill_(100)
        train(o, ps, 3, start=3)
    assert float(opt.state[params[1]]["step"]) == 103
    assert_states_close(opt, params, ref, ref_params)


# State made, by hand, a view of memory the step writes elsewhere: (which parameter's state,
# which key, the view) beside a float32 params[0], float32 params[1] and bfloat16 params[2]
# (its float32 state kept apart: §7), and what the refusal says.
SHARED_MEMORY = {
    "a view of its other momentum": (
        lambda opt, ps, a, b: (1, b, opt.state[ps[1]][a][:]),
        r"params'\]\[1\].* state '{b}' shares memory with its own state '{a}'"),
    "a slice of another parameter's buffer": (
        lambda opt, ps, a, b: (1, a, opt.state[ps[0]][a][2:8].view(3, 2)),
        r"params'\]\[1\].* state '{a}' shares memory with param_groups\[0\]\['params'\]\[0\] "
        r"\(.*\)'s state '{a}'"),
    "its parameter's data": (
        lambda opt, ps, a, b: (1, a, ps[1].data),
        r"params'\]\[1\].* state '{a}' shares memory with the parameter itself"),
    "another parameter's data": (
        lambda opt, ps, a, b: (1, a, ps[0].data[:6].view(3, 2)),
        r"params'\]\[1\].* state '{a}' shares memory with param_groups\[0\]\['params'\]\[0\] "
        r"\(shape \(8,\), torch.float32, \S+\):"),
    "a view of its other momentum, bf16 parameter": (
        lambda opt, ps, a, b: (2, b, opt.state[ps[2]][a][:]),
        r"params'\]\[2\].* state '{b}' shares memory with its own state '{a}'"),
}


@pytest.mark.parametrize("batches", ["one", "two"])
@pytest.mark.parametrize("how", ["put", "data"])
@pytest.mark.parametrize("edit", list(SHARED_MEMORY))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_state_sharing_memory_with_what_the_step_writes_is_refused_before_any_change(
        path, name, edit, how, batches):
    """Each backend steps aliased memory another way (the reference a tensor after another,
    the kernels all at once): a state tensor that is a view of another's memory, or of a
    parameter's, is refused naming both, before any batch has stepped. Put under the key,
    or given as the key's tensor's new data (`.data = view`: no change the state counts, but
    the held lists see the memory moved; one batch, whose kernel makes the other checks,
    and two, whose lists are confirmed before either steps)."""
    if batches == "one" and "bf16" in edit:
        pytest.skip("the bfloat16 parameter is the second batch")
    params = make_params([(8,), (3, 2)])
    if batches == "two":
        params += make_params([(4,)], dtype=torch.bfloat16)
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=torch.float32)
    train(opt, params, 3)
    a, b = ("exp_avg", "neg_exp_avg") if name == "AdaPNM" else ("pos_momentum", "neg_momentum")
    share, match = SHARED_MEMORY[edit]
    i, key, view = share(opt, params, a, b)
    if how == "put":
        opt.state[params[i]][key] = view
    else:
        opt.state[params[i]][key].data = view
    _assert_step_refused_untouched(opt, params, match.format(a=a, b=b))


@pytest.mark.parametrize("when", ["first step", "after steps"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_gradient_in_its_parameters_memory_is_refused_before_any_change(path, name, when):
    """The reference and foreach steps would read it after writing the parameter, the
    kernels before: refused, naming it, where the step's lists are built and, past that,
    where a held or repeated step checks its gradients (`p.grad = p.detach()`)."""
    params = make_params([(8,), (3, 2)])
    opt = OPTIMIZERS[name](params, backend=path)
    if when == "after steps":
        train(opt, params, 3)
    before = [p.detach().clone() for p in params]
    params[0].grad = torch.ones_like(params[0])
    params[1].grad = params[1].data
    with pytest.raises(RuntimeError, match=r"params'\]\[1\].*: its gradient shares memory "
                                           "with the parameter itself"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    steps = 0 if when == "first step" else 3
    assert not opt.state or all(int(opt.state[p]["step"]) == steps for p in opt.state)


# A gradient put, between steps, into memory the step writes that is not its own parameter's
# (that one: the test above).
def _first_buffer(opt, p):
    return next(t for k, t in opt.state[p].items() if k not in ("step", "seed"))


def _where(gi, pi):
    return f"param_groups[{gi}]['params'][{pi}]"


# (the parameter given the gradient, the gradient, the places the refusal names)
GRADIENT_PLACES = {
    "another parameter of its group":
        (0, lambda opt, params: params[1].data, (_where(0, 0), _where(0, 1))),
    "another parameter's state buffer":
        (0, lambda opt, params: _first_buffer(opt, params[1]), (_where(0, 0), _where(0, 1))),
    "its own state buffer":
        (1, lambda opt, params: _first_buffer(opt, params[1]), (_where(0, 1),)),
    "a parameter of another group":
        (2, lambda opt, params: params[0].data, (_where(1, 0), _where(0, 0))),
    "a parameter of a group never held":
        (0, lambda opt, params: params[3].data, (_where(0, 0), _where(2, 0))),
    "a held parameter, from a group never held":
        (3, lambda opt, params: params[2].data, (_where(2, 0), _where(1, 0))),
}


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16], ids=["own-dtype-state",
                                                                      "bf16-state"])
@pytest.mark.parametrize("place", list(GRADIENT_PLACES))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_gradient_put_into_memory_the_step_writes_is_refused_before_any_change(
        path, name, place, state_dtype):
    """`p.grad = q.data` (or a buffer of q's state, or of p's own) after steps whose lists
    are held, and repeated (state in the parameters' dtype, every group held) or planned each
    step (bfloat16 state, or beside a group whose lists are built every step: foreach's), in one
    group, across groups, and across a group never held and a held one:
    each backend would read it before or after writing it, so every one refuses it, naming
    both, as the reference does."""
    _gradient_put_into_written_memory(path, name, place, state_dtype)


@pytest.mark.parametrize("place", list(GRADIENT_PLACES))
@cases.parametrize(["triton"])
def test_a_gradient_put_into_memory_the_step_writes_without_the_compiled_extension(
        path, name, place, monkeypatch):
    """The same on a Triton-only install, whose held batches' memory is kept in Python."""
    triton_only_install(monkeypatch)
    _gradient_put_into_written_memory(path, name, place, torch.bfloat16)


def _gradient_put_into_written_memory(path, name, place, state_dtype):
    if state_dtype is not None and "state buffer" in place:
        pytest.skip("a bfloat16 buffer cannot be a float32 parameter's gradient")
    params = make_params([(8,), (8,), (8,), (8,)])
    third = "foreach" if "never held" in place else path  # else all held: the step repeats
    opt = OPTIMIZERS[name]([dict(params=params[:2]), dict(params=params[2:3]),
                            dict(params=params[3:], backend=third)],
                           backend=path, state_dtype=state_dtype)
    train(opt, params, 3)
    i, target, named = GRADIENT_PLACES[place]
    values = [p.detach().clone() for p in params]
    steps = [opt.state[p]["step"].clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    params[i].grad = target(opt, params)
    with pytest.raises(RuntimeError, match="gradient") as refused:
        opt.step()
    assert all(where in str(refused.value) for where in named), refused.value
    for p, v, s in zip(params, values, steps):
        assert torch.equal(p, v) and torch.equal(opt.state[p]["step"], s)


# A tensor lr put, between steps, into memory the step writes: (the place, the parameter
# the refusal names with the group's lr).
LR_PLACES = {
    "a parameter of its group": (lambda opt, params: params[0].data[:1], _where(0, 0)),
    "a parameter of another group": (lambda opt, params: params[2].data[3:4], _where(1, 0)),
    "another parameter's state buffer":
        (lambda opt, params: _first_buffer(opt, params[1])[:1], _where(0, 1)),
}


def _lr_put_into_written_memory(path, name, place, how):
    params = make_params([(8,), (8,), (8,)])
    lr = torch.tensor(1e-2, device=DEVICE)
    opt = OPTIMIZERS[name]([dict(params=params[:2], lr=lr), dict(params=params[2:])],
                           backend=path)
    train(opt, params, 3)
    target, named = LR_PLACES[place]
    view = target(opt, params).view(())
    view.fill_(1e-2)  # a valid lr, so that only where it lies is refused
    if how == "a new tensor":
        opt.param_groups[0]["lr"] = view
    else:
        lr.data = view
    values = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['lr'\] \(a tensor\) shares "
                                           "memory with " + re.escape(named)):
        opt.step()
    for p, v, state in zip(params, values, states):
        assert torch.equal(p, v)
        assert all(torch.equal(opt.state[p][k], t) for k, t in state.items())


@pytest.mark.parametrize("how", ["a new tensor", "lr.data ="])
@pytest.mark.parametrize("place", list(LR_PLACES))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_tensor_lr_put_into_memory_the_step_writes_is_refused_before_any_change(
        path, name, place, how):
    """The step reads the lr while it writes that memory, each backend in another order (the
    CUDA kernels and Triton read it after some blocks were written): refused, naming the
    group's lr and what it shares, before anything is touched, also where the lists are
    held and the step repeats."""
    _lr_put_into_written_memory(path, name, place, how)


@pytest.mark.parametrize("place", list(LR_PLACES))
@cases.parametrize(["triton"])
def test_a_tensor_lr_put_into_memory_the_step_writes_without_the_compiled_extension(
        path, name, place, monkeypatch):
    """The same on a Triton-only install, whose held batches' memory is kept in Python."""
    triton_only_install(monkeypatch)
    _lr_put_into_written_memory(path, name, place, "a new tensor")


@cases.parametrize(FAST_PATHS)
def test_a_gradient_in_memory_of_a_parameter_that_does_not_step_steps_as_the_reference(
        path, name):
    """Not refused: a parameter without a gradient writes nothing, so another's gradient may
    be its memory (`p.grad = frozen.data`). The repeated step, whose lists hold the parameter
    without a gradient too, and the planned one agree with the reference."""
    opt, params, ref, ref_params = with_reference(name, path, [(8,), (8,), (5,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        for t in range(3):
            ps[0].grad, ps[1].grad, ps[2].grad = ps[1].detach(), None, torch.full((5,), 0.5)
            o.step()
    assert_states_close(opt, params, ref, ref_params)


# Two parameters that are columns of one tensor: every other one, or a block each (a fused
# q/k weight split).
COLUMNS = {"interleaved": (slice(None, None, 2), slice(1, None, 2)),
           "blocks": (slice(None, 6), slice(6, None))}


def _interleaved_training(path, name, shared_storage, columns):
    """Two parameters that are columns of one tensor, and state moved after the first step
    into slices of one flat tensor (or each its own copy)."""
    base = torch.randn(8, 12, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    views = [base[:, cols] for cols in COLUMNS[columns]]
    params = [torch.nn.Parameter(v if shared_storage else v.clone()) for v in views]
    opt = OPTIMIZERS[name](params, backend=path, lr=1e-2, weight_decay=0.1)
    train(opt, params, 1)
    if shared_storage:
        keys = [(p, k) for p in params for k, v in opt.state[p].items() if v.dim() > 0]
        flat = torch.cat([opt.state[p][k].flatten() for p, k in keys])
        for i, (p, k) in enumerate(keys):
            opt.state[p][k] = flat[i * 48:(i + 1) * 48].view(8, 6)
    train(opt, params, 4, start=1)
    return opt, params


@cases.parametrize(FAST_PATHS + ["reference"])
@pytest.mark.parametrize("columns", list(COLUMNS))
def test_storage_shared_without_shared_memory_steps_as_separate_tensors_do(path, name,
                                                                          columns):
    """Not refused: parameters that are columns of one tensor, state in slices of one flat
    tensor. Bitwise what separate tensors give."""
    assert_same_bits(*_interleaved_training(path, name, True, columns),
                     *_interleaved_training(path, name, False, columns))


@cases.parametrize(FAST_PATHS + ["reference"])
def test_interleaved_parameters_past_the_runs_compared_step_as_separate_tensors_do(path, name):
    """Two parameters that are every other element of one tensor, each of more runs (here
    single elements) than aliasing compares, 2^22: their spans meet but they are taken as
    apart, not refused (a false refusal would stop a training run, and such layouts are made
    on purpose). Bitwise what separate tensors give."""
    if path == "triton" and DEVICE == "cpu":
        pytest.skip("8M elements a step: too slow under the Triton interpreter")
    n = (1 << 22) + 1

    def run(shared):
        base = torch.randn(n, 2, generator=torch.Generator().manual_seed(0)).to(DEVICE)
        params = [torch.nn.Parameter(v if shared else v.clone()) for v in (base[:, 0],
                                                                            base[:, 1])]
        opt = OPTIMIZERS[name](params, backend=path, lr=1e-2, weight_decay=0.1)
        train(opt, params, 2)
        return opt, params

    assert_same_bits(*run(shared=True), *run(shared=False))


@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_tensor_lr_in_a_gradients_memory_steps_as_the_reference(path, name):
    """Not refused: a tensor lr is only read, as a gradient is, so it may be an element of
    a gradient (here of another group's parameter), given anew before each step: the steps
    agree with the reference."""
    opt, params, ref, ref_params = with_reference(name, path, [(8,), (8,), (5,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        o.param_groups[0]["params"] = ps[:2]
        o.add_param_group(dict(params=ps[2:]))
        train(o, ps, 2)
        for t in range(4):
            for p, g in zip(ps, grads_for_step(ps, t)):
                p.grad = g.abs() * 1e-2  # its elements are valid lrs
            o.param_groups[0]["lr"] = ps[2].grad[t]
            o.step()
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("first", ["with the other", "alone"])
@pytest.mark.parametrize("second", ["held", "never held"])
@pytest.mark.parametrize("edit", ["buffer", "parameter"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_memory_shared_across_batches_by_new_data_is_refused_before_any_change(path, name,
                                                                              edit, second,
                                                                              first):
    """The second group's buffer, or parameter, given the first group's memory (`.data =`,
    which no version counts): the first group's batch, confirmed before the edit was seen,
    is built or checked again with the second's. Also where the second group's lists are
    built every step (foreach's: never held), and where it first steps alone after the edit
    (checked alone: nothing shared within that step) and the two step together after."""
    params = make_params([(8,), (8,)])
    backend = path if second == "held" else "foreach"
    opt = OPTIMIZERS[name]([dict(params=params[:1]), dict(params=params[1:], backend=backend)],
                           backend=path)
    train(opt, params, 3)
    key = "exp_avg" if name == "AdaPNM" else "pos_momentum"
    if edit == "buffer":
        opt.state[params[1]][key].data = opt.state[params[0]][key]
        match = rf"params'\]\[0\].* state '{key}' shares memory with param_groups\[\d\]"
    else:
        params[1].data = params[0].data
        match = r"param_groups\[\d\]\['params'\]\[0\].* shares memory with param_groups"
    if first == "alone":
        params[0].grad, params[1].grad = None, torch.ones_like(params[1])
        opt.step()
    _assert_step_refused_untouched(opt, params, match)


def _add_by(how, opt, new):
    if how == "add_param_group":
        opt.add_param_group(dict(params=[new]))
    elif how == "appended to a group's list":
        opt.param_groups[1]["params"].append(new)
    else:  # "group appended by hand"
        opt.param_groups.append({**opt.param_groups[1], "params": [new]})


@pytest.mark.parametrize("overlaps", ["parameter", "buffer"])
@pytest.mark.parametrize("how", ["add_param_group", "appended to a group's list",
                                 "group appended by hand"])
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_parameter_new_to_the_step_sharing_a_stepped_batchs_memory_is_refused(path, name,
                                                                               how, overlaps):
    """A parameter added after steps whose memory is a row of a parameter (or a state
    buffer) of a batch held since: the held batch is checked again with the new one, as
    when both were built together."""
    params = make_params([(3, 8), (2, 8)])
    opt = OPTIMIZERS[name]([dict(params=params[:1]), dict(params=params[1:])], backend=path)
    train(opt, params, 2)
    key = "exp_avg" if name == "AdaPNM" else "pos_momentum"
    new = torch.nn.Parameter(torch.zeros(1, 8, device=DEVICE))
    new.data = (params[0] if overlaps == "parameter" else opt.state[params[0]][key]).data[:1]
    _add_by(how, opt, new)
    if overlaps == "parameter":  # the two named in the order the check met them
        match = (r"shape \((1|3), 8\)[^:]* shares memory with param_groups\[\d\]\['params'\]"
                 r"\[\d\] \(shape \((3|1), 8\)")
    else:
        match = (rf"param_groups\[0\]\['params'\]\[0\][^:]*: its state '{key}' shares memory "
                 r"with param_groups\[\d\]\['params'\]\[\d\] \(shape \(1, 8\)")
    _assert_step_refused_untouched(opt, params + [new], match)


# Parameters whose own elements share memory: made so, or given such data after some steps.
SELF_OVERLAPPING = {
    "expanded": lambda: torch.zeros(1, device=DEVICE).expand(6),
    "rows over one another": lambda: torch.zeros(120, device=DEVICE).as_strided((2, 5), (0, 20)),
    "overlapping windows": lambda: torch.zeros(40, device=DEVICE).as_strided((4, 8), (4, 1)),
}


@pytest.mark.parametrize("when", ["first step", "after steps"])
@pytest.mark.parametrize("data", list(SELF_OVERLAPPING))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_parameter_whose_elements_share_memory_is_refused_before_any_change(path, name,
                                                                             data, when):
    """A step writes each element in place: elements at one address would be written
    twice, each backend in another order (torch's in-place ops refuse only some layouts,
    after the others had stepped). Refused naming it, before any parameter (here the one
    ahead of it) or state changes."""
    overlapping = SELF_OVERLAPPING[data]()
    params = make_params([(5,), tuple(overlapping.shape)])
    opt = OPTIMIZERS[name](params, backend=path)
    if when == "after steps":
        train(opt, params, 3)
    params[1].data = overlapping
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in opt.state}
    _assert_step_refused_untouched(
        opt, params, r"params'\]\[1\].* has elements that share memory \(an expanded")
    for p, entry in before.items():
        assert_same_entry(entry, opt.state[p])


@pytest.mark.parametrize("how", ["put", "data"])
@pytest.mark.parametrize("data", list(SELF_OVERLAPPING))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_state_buffer_whose_elements_share_memory_is_refused_before_any_change(path, name,
                                                                                 data, how):
    """As a parameter's: a state buffer whose own elements share memory (an expanded view,
    windows over one another), put under its key or given as its tensor's data after steps
    (the lists held), would have elements written twice. Refused naming the parameter and
    the key, before any parameter (here the one ahead of it) or state changes."""
    overlapping = SELF_OVERLAPPING[data]()
    params = make_params([(5,), tuple(overlapping.shape)])
    opt = OPTIMIZERS[name](params, backend=path)
    train(opt, params, 3)
    key = state_buffer_names(opt)[0]
    if how == "put":
        opt.state[params[1]][key] = overlapping
    else:
        opt.state[params[1]][key].data = overlapping
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in opt.state}
    _assert_step_refused_untouched(
        opt, params, rf"params'\]\[1\].*: its state '{key}' has elements that share memory "
                     r"\(an expanded")
    for p, entry in before.items():
        assert_same_entry(entry, opt.state[p])


GRADIENTS_SHARING_MEMORY = {
    "one tensor": lambda grads: [grads[0], grads[0]],
    "views of one scalar": lambda grads: [grads[0][:1].expand(6), grads[0][:1].expand(6)],
}


@pytest.mark.parametrize("when", ["first step", "after steps"])
@pytest.mark.parametrize("share", list(GRADIENTS_SHARING_MEMORY))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_gradients_sharing_memory_step_as_separate_copies_do(path, name, share, when):
    """Gradients are only read: two parameters given one gradient tensor, or views of one
    element, step bitwise as with a copy each, on the first step and on repeated ones."""
    def run(copies):
        params = make_params([(6,), (6,)])
        opt = OPTIMIZERS[name](params, backend=path)
        if when == "after steps":
            train(opt, params, 3)
        for t in range(2):
            shared = GRADIENTS_SHARING_MEMORY[share](
                [torch.full((6,), 0.5 + t, device=DEVICE)])
            for p, g in zip(params, shared):
                p.grad = g.clone() if copies else g
            opt.step()
        return opt, params

    assert_same_bits(*run(copies=False), *run(copies=True))


def _negative_view(t):
    """`t`'s values as a lazy negative view of new memory (-t read through the negative bit):
    what `z.conj().imag` of a complex tensor gives a user, contiguous here."""
    return torch._neg_view(-t.detach())


def _negative_in_state(key):
    def edit(opt, params):
        entry = opt.state[params[1]]
        entry[key(opt)] = _negative_view(entry[key(opt)])
    return edit


def _first_buffer_name(opt):
    return state_buffer_names(opt)[0]


# Edits after steps that leave a tensor of the step a lazy negative view, each with the state
# dtype it needs and what the refusal names. The fused kernels, Triton and the foreach ops
# read and write the memory itself; the refusal comes where the view is first met.
LAZY_VIEW_EDITS = {
    "parameter": (None, lambda opt, params: setattr(params[1], "data",
                                                    _negative_view(params[1])),
                  r"params'\]\[1\] \(shape .*\) is an unresolved negative view"),
    "parameter, its own memory": (
        None, lambda opt, params: setattr(params[1], "data", torch._neg_view(params[1].data)),
        r"params'\]\[1\] \(shape .*\) is an unresolved negative view"),
    "gradient": (None, lambda opt, params: setattr(params[1], "grad",
                                                   _negative_view(params[1].grad)),
                 r"params'\]\[1\] \(shape .*\)'s gradient is an unresolved negative view"),
    "buffer": (None, _negative_in_state(_first_buffer_name),
               r"params'\]\[1\] .*: its state '(exp_avg|pos_momentum)' is an unresolved "
               "negative view"),
    "buffer, through .data": (
        None, lambda opt, params: setattr(opt.state[params[1]][_first_buffer_name(opt)], "data",
                                          torch._neg_view(
                                              opt.state[params[1]][_first_buffer_name(opt)].data)),
        r"params'\]\[1\] .*: its state '(exp_avg|pos_momentum)' is an unresolved negative view"),
    "counter": (None, _negative_in_state(lambda opt: "step"),
                r"params'\]\[1\] .*: its state 'step' is an unresolved negative view"),
    "lr": (None, lambda opt, params: opt.param_groups[0].update(
        lr=_negative_view(opt.param_groups[0]["lr"])),
           r"param_groups\[0\]: the tensor lr is an unresolved negative view"),
    "bfloat16 buffer": (torch.bfloat16, _negative_in_state(_first_buffer_name),
                        r"params'\]\[1\] .*: its state '(exp_avg|pos_momentum)' is an "
                        "unresolved negative view"),
    "seed": (torch.bfloat16, _negative_in_state(lambda opt: "seed"),
             r"params'\]\[1\] .*: its state 'seed' is an unresolved negative view"),
    "int8 scales": (torch.int8, _negative_in_state(lambda opt: f"{_first_buffer_name(opt)}_scale"),
                    r"params'\]\[1\] .*: its state '(exp_avg|pos_momentum)_scale' is an "
                    "unresolved negative view"),
}


def _assert_lazy_view_refused(path, name, edit):
    state_dtype, apply, match = LAZY_VIEW_EDITS[edit]
    params = make_params([(2, 256), (2, 256)])
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=state_dtype,
                           lr=torch.tensor(1e-2))
    train(opt, params, 3)  # the lists held
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    apply(opt, params)
    values = [p.detach().clone() for p in params]
    before = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises((RuntimeError, ValueError), match=match):
        opt.step()
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    for p, entry in zip(params, before):
        assert_same_entry(entry, opt.state[p])


@pytest.mark.parametrize("edit", list(LAZY_VIEW_EDITS))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_a_lazy_negative_view_given_after_steps_is_refused_naming_it_before_any_change(
        path, name, edit):
    """A parameter, gradient, state tensor or tensor lr that reads as its memory negated
    (torch's lazy negative bit, as `z.conj().imag` sets it) cannot be stepped by kernels that
    read and write memory: refused as on the first step, naming it, before anything changes,
    also where the lists held between steps saw the same memory (`.data =` a negative view
    of it)."""
    _assert_lazy_view_refused(path, name, edit)


@pytest.mark.parametrize("edit", list(LAZY_VIEW_EDITS))
@cases.parametrize(["triton"])
def test_a_lazy_negative_view_given_after_steps_is_refused_without_the_compiled_extension(
        path, name, edit, monkeypatch):
    """As above on a Triton-only install, whose held lists are confirmed in Python."""
    triton_only_install(monkeypatch)
    _assert_lazy_view_refused(path, name, edit)
