"""State no step can use, whether given new data, shared, set by hand or loaded, is refused
at the step naming the parameter (and the key), before anything is touched: no parameter,
state buffer or step counter changes, in any group (docs/design.md §5)."""
import copy

import pytest
import torch

import cases
from cases import FAST_PATHS
from conftest import DEVICE, OPTIMIZERS, make_params, train


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
        assert s is None or torch.equal(opt.state[p]["step"], s)


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
}


@pytest.mark.parametrize("how", ["by-hand", "loaded"])
@pytest.mark.parametrize("bad", list(BAD_STATE_VALUES))
@cases.parametrize(FAST_PATHS + ["reference"])
def test_state_no_step_can_use_is_refused_naming_it_before_any_change(path, name, bad, how):
    """Set by hand, or in a state_dict loaded (the load itself never stops half way: every
    other entry is restored, its codes int8): the step refuses it naming the parameter and
    the key, before any parameter or state has changed."""
    if bad == "codes on another device" and how == "loaded":
        pytest.skip("load_state_dict moves every tensor to its parameter's device")
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
