"""The optimizer's state as torch's optimizers keep it: state_dict round trips and loading
(an earlier state, the authors' format, weights_only), state edited, replaced or deleted by
hand between steps, buffers made when needed, and torch.utils._pytree's walk of it."""
import collections
import copy
import io

import pytest
import torch

import cases
from cases import FAST_PATHS, OVER_OPTIMIZERS
from conftest import (OPTIMIZERS, assert_states_close, clone_params, grads_for_step,
                      make_params, second_parameter_restarted_after_three_steps, train,
                      with_reference)
from internals import state_buffer_names
from pnm_kernels import PNM, AdaPNM
from pnm_kernels.saved_codes import KEY as CODES_MARK  # each saved entry's: which hold codes


@cases.parametrize(FAST_PATHS)
def test_state_dict_round_trip_mid_run_is_bitwise(path, name):
    params = make_params([(50,), (3, 3)])
    straight = clone_params(params)
    opt_straight = OPTIMIZERS[name](straight, lr=1e-2, backend=path)
    train(opt_straight, straight, 9)

    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path)
    train(opt, params, 5)
    saved = copy.deepcopy(opt.state_dict())
    resumed = clone_params(params)
    opt2 = OPTIMIZERS[name](resumed, lr=1e-2, backend=path)
    opt2.load_state_dict(saved)
    train(opt2, resumed, 4, start=5)
    for p, q in zip(resumed, straight):
        assert torch.equal(p, q)
    assert_states_close(opt2, resumed, opt_straight, straight, atol=0, rtol=0)


@cases.parametrize(FAST_PATHS)
def test_loading_an_earlier_state_into_the_same_optimizer_rewinds_it(path, name):
    """The kernels' cached tensor lists follow load_state_dict: the loaded buffers and
    counters are the ones stepped, not those held from before."""
    params = make_params([(50,), (3, 3)])
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path)
    train(opt, params, 3)
    saved_params = [p.detach().clone() for p in params]
    saved = copy.deepcopy(opt.state_dict())
    train(opt, params, 4, start=3)
    after_seven = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, saved_params):
            p.copy_(v)
    opt.load_state_dict(saved)
    train(opt, params, 4, start=3)
    for p, v in zip(params, after_seven):
        assert torch.equal(p, v)


@OVER_OPTIMIZERS
def test_loading_keeps_this_optimizers_backend_and_state_dtype(name):
    """How the saved run stepped is not how this one steps: a checkpoint of a GPU's Triton run
    with bfloat16 state, loaded into a float32-state optimizer on the reference backend,
    steps there (its state converted), as a fresh optimizer loaded with it would."""
    params = make_params([(20,), (4,)])
    opt = OPTIMIZERS[name](params, lr=1e-2, backend="reference")
    train(opt, params, 2)
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        group["backend"], group["state_dtype"] = "triton", torch.bfloat16
    resumed = clone_params(params)
    opt2 = OPTIMIZERS[name](resumed, lr=1e-2, backend="reference", state_dtype=torch.float32)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["backend"] == "reference"
    assert opt2.param_groups[0]["state_dtype"] == torch.float32
    train(opt2, resumed, 2, start=2)
    train(opt, params, 2, start=2)
    for p, q in zip(resumed, params):
        assert torch.equal(p, q)


@OVER_OPTIMIZERS
def test_loads_a_checkpoint_in_the_authors_format(name):
    """The authors' optimizers store step as a Python int and know no maximize/backend."""
    params = make_params([(20,), (4,)])
    straight = clone_params(params)
    opt_straight = OPTIMIZERS[name](straight, lr=1e-2)
    train(opt_straight, straight, 7)

    opt = OPTIMIZERS[name](params, lr=1e-2)
    train(opt, params, 4)
    saved = copy.deepcopy(opt.state_dict())
    for state in saved["state"].values():
        state["step"] = int(state["step"].item())
    for group in saved["param_groups"]:
        del group["maximize"], group["backend"]
    resumed = clone_params(params)
    opt2 = OPTIMIZERS[name](resumed, lr=1e-2)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["maximize"] is False
    assert opt2.state[resumed[0]]["step"].dtype == torch.float64
    train(opt2, resumed, 3, start=4)
    for p, q in zip(resumed, straight):
        assert torch.equal(p, q)


# Another optimizer's state_dict, trained a step on the same parameter, and what the refusal
# of its load names: AdamW's groups (two betas), or state holding none of our buffers.
FOREIGN = {
    "AdamW into AdaPNM": ("AdaPNM", lambda ps: torch.optim.AdamW(ps),
                          r"state_dict\['param_groups'\]\[0\]: betas must be"),
    "SGD into PNM": ("PNM", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                     r"state_dict\['state'\]\[0\] holds 'momentum_buffer' and none of PNM's"),
    "RMSprop into AdaPNM": ("AdaPNM", lambda ps: torch.optim.RMSprop(ps),
                            r"state_dict\['state'\]\[0\] holds 'square_avg' and none of AdaPNM's"),
    "Adagrad into AdaPNM": ("AdaPNM", lambda ps: torch.optim.Adagrad(ps),
                            r"state_dict\['state'\]\[0\] holds 'sum' and none of AdaPNM's"),
    "Adamax into PNM": ("PNM", lambda ps: torch.optim.Adamax(ps),
                        r"holds 'exp_avg', 'exp_inf' and none of PNM's"),
}


@pytest.mark.parametrize("case", list(FOREIGN))
def test_loading_another_optimizers_state_dict_raises_before_changing_anything(case):
    """Refused, naming the group or the state entry, and the optimizer goes on as it was
    (not: another optimizer's step counter carried over onto fresh buffers)."""
    name, foreign, culprit = FOREIGN[case]
    params = make_params([(4,)])
    other = foreign(params)
    opt = OPTIMIZERS[name](params, lr=0.05)
    train(opt, params, 2)
    other.step()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=culprit):
        opt.load_state_dict(other.state_dict())
    assert opt.param_groups[0]["lr"] == 0.05
    assert opt.param_groups[0]["betas"] == before["param_groups"][0]["betas"]
    assert opt.state[params[0]].keys() == before["state"][0].keys() - {CODES_MARK}
    for key, value in opt.state[params[0]].items():
        assert torch.equal(value, before["state"][0][key]), key
    train(opt, params, 1, start=2)


# A never-stepped optimizer's state_dict (no entry to tell), and the refusal's words.
FOREIGN_GROUPS = {
    "AdamW into PNM": ("PNM", torch.optim.AdamW, r"\[0\] has an 'eps', unlike PNM's groups"),
    "SGD into PNM": ("PNM", torch.optim.SGD, r"\[0\] has no 'betas', unlike PNM's groups"),
    "RMSprop into AdaPNM": ("AdaPNM", torch.optim.RMSprop,
                            r"\[0\] has no 'betas', unlike AdaPNM's groups"),
}


@pytest.mark.parametrize("case", list(FOREIGN_GROUPS))
def test_a_never_stepped_optimizers_groups_are_refused_unless_a_pre_hook_converts(case):
    """Its groups alone would load, read as this optimizer's (AdamW's beta2 as PNM's beta0);
    a user's load pre-hook is trusted to have converted them."""
    name, foreign, culprit = FOREIGN_GROUPS[case]
    params = make_params([(4,)])
    saved = foreign(params, lr=0.01).state_dict()
    opt = OPTIMIZERS[name](params, lr=0.05)
    train(opt, params, 2)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"state_dict\['param_groups'\]{culprit}"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.05
    assert opt.param_groups[0]["betas"] == before["param_groups"][0]["betas"]
    assert len(opt.state) == 1
    opt.register_load_state_dict_pre_hook(
        lambda _, sd: {**sd, "param_groups": [{k: v for k, v in g.items() if k != "eps"}
                                              for g in sd["param_groups"]]})
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.01 and not opt.state


def test_a_pnm_group_holding_a_users_own_eps_round_trips():
    """Keys of the user's own in a group are carried along: an eps in PNM's groups is one
    (only another optimizer's groups, without this optimizer's keys, are refused for it)."""
    params = make_params([(4,)])
    opt = PNM(params, lr=0.05)
    opt.param_groups[0]["eps"] = 1e-8
    train(opt, params, 2)
    fresh = PNM(clone_params(params), lr=0.05)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.param_groups[0]["eps"] == 1e-8


@cases.parametrize(FAST_PATHS)
def test_a_users_own_key_may_hold_a_tensor_without_storage(path, name):
    """A sparse tensor beside the buffers (only the keys a step reads are checked or
    located) steps as without it."""
    params = make_params([(8, 8)])
    ref_params = clone_params(params)
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path)
    ref = OPTIMIZERS[name](ref_params, lr=1e-2, backend=path)
    train(opt, params, 1)
    train(ref, ref_params, 1)
    opt.state[params[0]]["my_mask"] = torch.eye(8).to_sparse()
    train(opt, params, 3, start=1)
    train(ref, ref_params, 3, start=1)
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


def test_keys_of_the_users_own_beside_the_buffers_load_and_stay():
    """As torch's optimizers keep them; one may even hold a buffer's own tensor."""
    params = make_params([(4,)])
    opt = PNM(params, lr=0.05)
    train(opt, params, 2)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["my_ema"] = torch.ones(4)
    opt.load_state_dict(saved)
    opt.state[params[0]]["my_view"] = opt.state[params[0]]["pos_momentum"]
    train(opt, params, 1, start=2)
    assert torch.equal(opt.state[params[0]]["my_ema"], torch.ones(4))


@pytest.mark.parametrize("name", ["PNM", "AdaPNM"])
def test_a_parameter_holding_only_keys_of_the_users_own_round_trips_and_then_steps(name):
    """A note put on a parameter not stepped yet is in the state_dict alone; our own
    checkpoint loads back (it is not another optimizer's), and the parameter's first step
    starts its state afresh beside the note, as without the round trip."""
    runs = []
    for round_trip in (False, True):
        params = make_params([(4,), (3,)])
        opt = OPTIMIZERS[name](params, lr=0.05)
        opt.state[params[1]]["my_note"] = torch.ones(1)
        train(opt, params[:1], 2)
        if round_trip:
            saved = copy.deepcopy(opt.state_dict())
            assert saved["state"][1].keys() == {"my_note", CODES_MARK}
            opt = OPTIMIZERS[name](params, lr=0.05)
            opt.load_state_dict(saved)
        train(opt, params, 2, start=2)
        runs.append((params, opt))
    (params, opt), (loaded_params, loaded) = runs
    assert_states_close(opt, params, loaded, loaded_params, rtol=0, atol=0)
    assert torch.equal(loaded.state[loaded_params[1]]["my_note"], torch.ones(1))


def test_a_load_pre_hook_converting_an_adamw_checkpoint_runs_before_anything_is_checked():
    """torch runs the pre-hooks first: a user's converter of another optimizer's checkpoint
    (AdamW's two betas made three, its buffers renamed) is what gets checked and loaded."""
    p = torch.nn.Parameter(torch.randn(4))
    adamw = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(4)
    adamw.step()

    def from_adamw(opt, saved):
        state = {i: dict(step=s["step"], exp_avg=s["exp_avg"],
                         neg_exp_avg=torch.zeros_like(s["exp_avg"]), exp_avg_sq=s["exp_avg_sq"],
                         max_exp_avg_sq=s["exp_avg_sq"].clone())
                 for i, s in saved["state"].items()}
        groups = [dict(g, betas=(*g["betas"], 1.0)) for g in saved["param_groups"]]
        return {"state": state, "param_groups": groups}

    opt = AdaPNM([p], lr=1e-3)
    opt.register_load_state_dict_pre_hook(from_adamw)
    opt.load_state_dict(adamw.state_dict())
    assert opt.param_groups[0]["betas"] == (0.9, 0.999, 1.0)
    assert torch.equal(opt.state[p]["exp_avg"], adamw.state[p]["exp_avg"])
    train(opt, [p], 1, start=1)


@cases.parametrize(["reference", "foreach", "fused"])
def test_load_hooks_edit_what_is_loaded_and_what_was_loaded(path, name):
    """bfloat16 parameters with float32 state, whose loading puts each saved tensor back in
    its own dtype: a pre-hook's edit of the state_dict (a momentum reset on resume) is what
    loads, and a post-hook runs once the state is final (its dtypes), its edits kept."""
    params = [torch.nn.Parameter(torch.randn(6).bfloat16())]
    opt = OPTIMIZERS[name](params, lr=1e-2, backend=path, state_dtype=torch.float32)
    train(opt, params, 3)
    saved = opt.state_dict()
    first = state_buffer_names(opt)[0]

    def reset_first(opt, saved):
        state = {i: {k: torch.zeros_like(v) if k == first else v for k, v in s.items()}
                 for i, s in saved["state"].items()}
        return {"state": state, "param_groups": saved["param_groups"]}

    seen = []

    def fill_second(opt):
        entry = opt.state[params[0]]
        seen.append(entry[first].dtype)
        entry[state_buffer_names(opt)[1]].fill_(0.5)
        opt.param_groups[0]["state_dtype"] = torch.bfloat16

    fresh = OPTIMIZERS[name](params, lr=1e-2, backend=path, state_dtype=torch.float32)
    fresh.register_load_state_dict_pre_hook(reset_first)
    fresh.register_load_state_dict_post_hook(fill_second)
    fresh.load_state_dict(saved)
    entry = fresh.state[params[0]]
    assert seen == [torch.float32]
    assert entry[first].dtype == torch.float32 and not entry[first].any()
    assert bool((entry[state_buffer_names(fresh)[1]] == 0.5).all())
    assert fresh.param_groups[0]["state_dtype"] == torch.bfloat16


@pytest.mark.parametrize("kind", ["numpy-int64", "numpy-float32", "one-element-tensor"])
@OVER_OPTIMIZERS
def test_a_step_counter_set_as_any_real_number_counts_on(name, kind):
    """numpy's numbers (a checkpoint made with them) and a one-element tensor of any real
    dtype are counters as a Python int is."""
    import numpy

    as_kind = {"numpy-int64": numpy.int64, "numpy-float32": numpy.float32,
               "one-element-tensor": lambda v: torch.tensor([v], dtype=torch.int32)}[kind]
    params, ref_params = make_params([(4,)]), make_params([(4,)])
    opt, ref = OPTIMIZERS[name](params, lr=0.05), OPTIMIZERS[name](ref_params, lr=0.05)
    train(opt, params, 2)
    train(ref, ref_params, 2)
    opt.state[params[0]]["step"] = as_kind(2)
    train(opt, params, 2, start=2)
    train(ref, ref_params, 2, start=2)
    assert_states_close(opt, params, ref, ref_params)


@OVER_OPTIMIZERS
def test_a_state_dict_loads_with_weights_only(name):
    """torch.load's default (weights_only=True) accepts the state_dict: plain containers,
    however the optimizer keeps its state."""
    params = make_params([(5,), (2, 3)])
    opt = OPTIMIZERS[name](params)
    train(opt, params, 2)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    twin = OPTIMIZERS[name](clone_params(params))
    twin.load_state_dict(loaded)
    assert all(type(entry) is dict for entry in loaded["state"].values())
    step = twin.state[twin.param_groups[0]["params"][1]]["step"]
    assert torch.equal(step.cpu(), torch.tensor(2.0))  # (a fast path keeps it on the GPU)


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16, torch.int8],
                         ids=["own-dtype", "bfloat16", "int8"])
@OVER_OPTIMIZERS
def test_loading_keeps_the_saved_tensors_themselves_for_every_state_dtype(name, state_dtype):
    """As torch's optimizers do, load_state_dict makes the saved tensors (on the parameters'
    device) the optimizer's state, not copies, and every key alike: int8 codes beside their
    scales, bfloat16 buffers beside their counter. (Codes copied beside shared scales let two
    optimizers loaded from one live state_dict decode their codes with each other's scales.)
    Loading one state_dict into two optimizers that step apart takes a deep copy each."""
    params = make_params([(4, 256), (7,)])
    opt = OPTIMIZERS[name](params, lr=1e-2, state_dtype=state_dtype)
    train(opt, params, 3)
    saved = opt.state_dict()
    twin_params = clone_params(params)
    twin = OPTIMIZERS[name](twin_params, lr=1e-2, state_dtype=state_dtype)
    twin.load_state_dict(saved)
    for i, q in enumerate(twin_params):
        loaded, kept = saved["state"][i], twin.state[q]
        assert kept.keys() == loaded.keys() - {CODES_MARK}
        assert all(kept[key] is loaded[key] for key in kept), f"params[{i}]"
    if state_dtype == torch.int8:
        assert any(value.dtype == torch.int8 for value in twin.state[twin_params[0]].values())
    apart_params = clone_params(params)
    apart = OPTIMIZERS[name](apart_params, lr=1e-2, state_dtype=state_dtype)
    apart.load_state_dict(copy.deepcopy(saved))
    train(opt, params, 2, start=3)  # steps the tensors twin holds too, not apart's
    train(apart, apart_params, 2, start=3)
    assert float(twin.state[twin_params[0]]["step"]) == 5
    assert all(torch.equal(p, q) for p, q in zip(params, apart_params))


def _edit_state(how, o, ps):
    """One way of changing the second parameter's state by hand between steps. Returns a
    plain dict put in by hand, which the user may go on editing."""
    state = o.state[ps[1]]
    buffer = next(key for key in state if key != "step")
    if how == "a buffer replaced":  # a moment reset
        state[buffer] = torch.ones_like(state[buffer])
    elif how == "the counter replaced":
        state["step"] = torch.tensor(1.0)
    elif how == "the counter as an int":
        state["step"] = 1
    elif how == "update()":
        state.update({key: value * 0.5 for key, value in state.items() if key != "step"})
    elif how == "a buffer deleted":  # made again, zero
        del state[buffer]
    elif how == "a plain dict":
        kept = o.state[ps[1]] = {key: value.clone() for key, value in state.items()}
        return kept
    elif how == "a new optimizer.state":
        o.state = collections.defaultdict(dict, {p: dict(s) for p, s in o.state.items()})
        return o.state[ps[1]]
    return None


@pytest.mark.parametrize("how", ["a buffer replaced", "the counter replaced",
                                 "the counter as an int", "update()", "a buffer deleted",
                                 "a plain dict", "a new optimizer.state"])
@cases.parametrize(FAST_PATHS)
def test_state_changed_by_hand_is_what_the_next_step_reads(path, name, how):
    """The fast paths reuse the tensor lists they built (cached and repeated steps), yet a
    step reads the state as it is now, as torch's optimizers do: after an entry is replaced
    by hand (a Python int counter made a tensor, as load_state_dict makes it), and after a
    plain dict is put in by hand and then edited through the user's own reference to it."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        kept = _edit_state(how, o, ps)
        train(o, ps, 2, start=3)
        if kept is not None:
            kept["step"] = torch.tensor(10.0)
            train(o, ps, 2, start=5)
            # Still the user's dict (not a copy the optimizer made), edits and steps seen.
            assert o.state[ps[1]] is kept and kept["step"].item() == 12
    assert_states_close(opt, params, ref, ref_params)


@cases.parametrize(FAST_PATHS)
def test_a_held_plain_dict_of_a_parameter_that_skips_steps_is_read_when_it_steps(path, name):
    """Steps in which one parameter of a group has no gradient repeat with lists of every
    parameter with state (see _lists_with_state). A parameter whose state is a plain dict the
    user still holds is kept out of them: while it skips steps the user replaces a buffer
    through their dict, and its next step reads the new one."""
    opt, params, ref, ref_params = with_reference(name, path, [(50,), (3, 3), (7,)])
    for o, ps in ((opt, params), (ref, ref_params)):
        train(o, ps, 3)
        kept = o.state[ps[2]] = dict(o.state[ps[2]])
        for t in range(3, 7):  # ps[2] skips these steps
            for p, g in zip(ps, grads_for_step(ps, t)):
                p.grad = None if p is ps[2] else g
            o.step()
            if t == 4:
                buffer = next(key for key in kept if key != "step")
                kept[buffer] = torch.full_like(kept[buffer], 0.5)
        train(o, ps, 2, start=7)
        assert o.state[ps[2]] is kept and kept["step"].item() == 5
    assert_states_close(opt, params, ref, ref_params)


@cases.parametrize(FAST_PATHS)
def test_deleting_a_parameters_state_restarts_it(path, name):
    """`del opt.state[p]` (as after re-initialising a layer) gives p fresh state at its next
    step, as with torch's optimizers; the other parameters carry on."""
    def restart(o, ps):
        del o.state[ps[1]]

    second_parameter_restarted_after_three_steps(name, path, restart)


def test_amsgrad_switched_on_mid_run_creates_its_buffer():
    params = make_params([(5,)])
    opt = AdaPNM(params, amsgrad=False)
    train(opt, params, 2)
    assert "max_exp_avg_sq" not in opt.state[params[0]]
    opt.param_groups[0]["amsgrad"] = True
    train(opt, params, 1, start=2)
    assert "max_exp_avg_sq" in opt.state[params[0]]


@OVER_OPTIMIZERS
def test_pytree_walks_the_state_as_torchs_dict_state(name):
    """torch.utils._pytree goes through optimizer.state and each entry as through torch's
    plain dicts (torch.compile marks state tensors static that way), and maps back to the
    same kinds of containers."""
    from torch.utils import _pytree as pytree

    params = make_params([(5,), (2, 3)])
    opt = OPTIMIZERS[name](params)
    train(opt, params, 2)
    leaves, spec = pytree.tree_flatten(opt.state)
    assert len(leaves) == sum(len(entry) for entry in opt.state.values()) > len(params)
    assert all(isinstance(leaf, torch.Tensor) for leaf in leaves)
    doubled = pytree.tree_map(lambda t: t * 2, opt.state)
    assert type(doubled) is type(opt.state) and list(doubled) == list(opt.state)
    for p in params:
        assert type(doubled[p]) is type(opt.state[p])
        for key, value in opt.state[p].items():
            assert torch.equal(doubled[p][key], value * 2)
    paths = [path for path, _ in pytree.tree_flatten_with_path(opt.state)[0]]
    assert [(path[0].key, path[1].key) for path in paths] == [
        (p, key) for p in opt.state for key in opt.state[p]]
