"""State no step can use, whether given new data, shared, set by hand or loaded, is refused
at the step naming the parameter (and the key), before anything is touched: no parameter,
state buffer or step counter changes, in any group (docs/edits.md). State sharing memory with
what the step writes: test_memory_the_step_writes.py."""
import copy

import pytest
import torch

import cases
from cases import FAST_PATHS
from conftest import (DEVICE, OPTIMIZERS, assert_states_close, clone_params,
                      made_under_inference_mode, make_params, train)
from internals import triton_only_install


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
    the last writer winning): refused, naming both parameters and the key, before any batch
    (here the float32 one ahead) has stepped."""
    params = make_params([(4,), (3, 2)]) + make_params([(4,)], dtype=torch.bfloat16)
    opt = OPTIMIZERS[name](params, backend=path, state_dtype=torch.float32)
    train(opt, params, 3)
    buffer = "exp_avg" if name == "AdaPNM" else "pos_momentum"
    _share_state(opt, params, buffer if what == "buffer" else what)
    # A shared entry shares every key; the first in the state's order is named, in any run.
    key = {"counter": "step", "buffer": buffer, "entry": "step"}[what]
    _assert_step_refused_untouched(opt, params, rf"params'\]\[2\].*: its state '{key}' is the "
                                                r"very tensor of param_groups\[0\]\['params'\]"
                                                rf"\[0\] .*'s state '{key}'")


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
    # Past a float's range: no conversion to float may raise on the way (a load half done).
    "a seed past a float": (lambda st, m: st.__setitem__("seed", 10**400),
                            r"'seed' is an integer of 401 digits, not a whole number within "
                            r"int64"),
    "a counter past a float": (lambda st, m: st.__setitem__("step", 10**400),
                               r"'step' is an integer of 401 digits, not a whole number of "
                               r"steps >= 0"),
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
    # Made under torch.inference_mode(): nothing outside it may write them.
    "an inference-mode counter": (lambda st, m: st.__setitem__("step", made_under_inference_mode(st["step"])),
                                  r"'step' is an inference tensor"),
    "inference-mode codes": (lambda st, m: st.__setitem__(m, made_under_inference_mode(st[m])),
                             r"'{m}' is an inference tensor"),
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
        pytest.skip("load_state_dict moves every tensor to its parameter's device, and "
                    "refuses a meta one (next test)")
    if "inference" in bad and how == "loaded":
        pytest.skip("load_state_dict copies an inference tensor (test_torch_optim_contract)")
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


@pytest.mark.parametrize("key", ["step", "seed", "{m}", "{m}_scale"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_checkpoint_with_a_meta_tensor_is_refused_by_the_load_nothing_loaded(name, key):
    """A state_dict of a dry run on a meta model, loaded beside parameters with data: torch's
    loader cannot copy a meta buffer, nor the step counters' conversion after it a meta
    counter, so either would stop half way (every later entry's codes left cast to floats).
    Refused first, naming the entry and key."""
    key = key.format(m="exp_avg" if name == "AdaPNM" else "pos_momentum")
    params = make_params([(3, 200), (2, 128)])
    opt = OPTIMIZERS[name](params, lr=0.01, state_dtype=torch.int8)
    train(opt, params, 2)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0][key] = saved["state"][0][key].to("meta")
    saved["param_groups"][0]["lr"] = 0.5
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"state_dict\['state'\]\[0\]\['{key}'\] is on the "
                                         r"meta device .*Nothing was loaded"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, entry in before["state"].items():
        for k, value in entry.items():
            assert value.dtype == after["state"][i][k].dtype
            assert torch.equal(value, after["state"][i][k]), (i, k)


@pytest.mark.parametrize("entry", [[1, 2], torch.zeros(3)], ids=["list", "tensor"])
def test_a_checkpoint_entry_that_is_no_dict_is_refused_by_the_load_naming_it(entry):
    params = make_params([(3, 200)])
    opt = OPTIMIZERS["AdaPNM"](params)
    train(opt, params, 1)
    saved = opt.state_dict()
    saved["state"][0] = entry
    with pytest.raises(ValueError, match=rf"state_dict\['state'\]\[0\] is "
                                         rf"{type(entry).__name__}, not a dict"):
        opt.load_state_dict(saved)
    assert opt.state[params[0]]["step"] == 1


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
