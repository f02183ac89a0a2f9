"""torch.distributed.checkpoint and its state_dict utilities (get_/set_optimizer_state_dict,
their StateDictOptions) in one process: every layout they offer resumes bitwise with every
state_dtype; int8 codes read through the state of another state_dtype are refused naming the
entry, and the entries DCP had already written them into refuse to step. On two FSDP2 ranks:
tests/test_distributed.py. (docs/design.md §8, docs/training.md.)"""
import copy
import io

import pytest
import torch

from cases import OPTIMIZERS
from conftest import assert_same_bits, assert_same_entry, round_trip
from pnm_kernels import PNM

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.state_dict import (StateDictOptions,  # noqa: E402
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# Rows of one and of three int8 blocks, and a bias (bfloat16 state under int8).
SHAPES = [(6, 300), (3, 4, 64), (11,)]
STATE_DTYPES = {"param-dtype": None, "fp32": torch.float32, "bf16": torch.bfloat16,
                "int8": torch.int8}
# The layouts the utilities offer. (flatten_optimizer_state_dict with full_state_dict fails
# inside torch for its own optimizers too.)
LAYOUTS = {
    "nested": StateDictOptions(),
    "flattened": StateDictOptions(flatten_optimizer_state_dict=True),
    "full": StateDictOptions(full_state_dict=True),
    "full-cpu-offload": StateDictOptions(full_state_dict=True, cpu_offload=True),
}


def _params(seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _run(optimizer, params, steps, first=0):
    for t in range(first, first + steps):
        gen = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()


def _module_of(params):
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)
    return module


def _continue_alike(into, into_params, opt, params, steps):
    """A loaded optimizer (its parameters given the saved run's values) and the run it was
    saved from, from step 4 on: bitwise alike, state included."""
    for p, q in zip(into_params, params):
        p.data.copy_(q)
    _run(opt, params, steps, first=4)
    _run(into, into_params, steps, first=4)
    assert_same_bits(into, into_params, opt, params)


def _saved(name, state_dtype, options, checkpoint, steps=4, **kwargs):
    """An optimizer trained `steps` steps, saved through DCP in this layout."""
    params = _params()
    opt = OPTIMIZERS[name](params, lr=1e-2, state_dtype=state_dtype, **kwargs)
    _run(opt, params, steps)
    dcp.save({"optim": get_optimizer_state_dict(_module_of(params), opt, options=options)},
             checkpoint_id=checkpoint)
    return opt, params


def _read_into(name, state_dtype, options, checkpoint):
    """A fresh optimizer (stepped once: state to load into, as get_state_dict makes it) and
    the checkpoint read by DCP into its state_dict, not yet set."""
    params = _params(seed=1)
    model = _module_of(params)
    opt = OPTIMIZERS[name](params, lr=1e-2, state_dtype=state_dtype)
    _run(opt, params, 1)
    loaded = {"optim": get_optimizer_state_dict(model, opt, options=options)}
    dcp.load(loaded, checkpoint_id=checkpoint)
    return model, opt, params, loaded["optim"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("state_dtype", list(STATE_DTYPES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_layout_resumes_bitwise(name, state_dtype, layout, tmp_path):
    """Saved after 4 steps and loaded into a fresh model and optimizer, 3 more steps: bitwise
    the run that was never stopped. (A torch.dtype in a group, as state_dtype is, stopped
    full_state_dict and cpu_offload: a state_dict holds it by name.)"""
    dtype, options = STATE_DTYPES[state_dtype], LAYOUTS[layout]
    opt, params = _saved(name, dtype, options, str(tmp_path))
    model, into, into_params, loaded = _read_into(name, dtype, options, str(tmp_path))
    set_optimizer_state_dict(model, into, loaded, options=options)
    _continue_alike(into, into_params, opt, params, steps=3)


@pytest.mark.parametrize("saved_as", ["name", "torch.dtype"])
def test_state_dtype_is_saved_by_name_and_loads_in_either_form(saved_as):
    params = _params()
    opt = PNM(params, lr=1e-2, state_dtype=torch.bfloat16)
    _run(opt, params, 2)
    saved = round_trip(opt.state_dict())
    assert saved["param_groups"][0]["state_dtype"] == "bfloat16"
    if saved_as == "torch.dtype":  # as a checkpoint of an earlier version holds it
        saved["param_groups"][0]["state_dtype"] = torch.bfloat16
    into_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    into = PNM(into_params, lr=1e-2, state_dtype=torch.bfloat16)
    into.load_state_dict(saved)
    assert into.param_groups[0]["state_dtype"] is torch.bfloat16
    # groups made from the saved ones, as code that rebuilds an optimizer does
    rebuilt = PNM([{**group, "params": into_params} for group in saved["param_groups"]])
    assert rebuilt.param_groups[0]["state_dtype"] is torch.bfloat16
    _run(opt, params, 2, first=2)
    _run(into, into_params, 2, first=2)
    assert_same_bits(into, into_params, opt, params)


def _groups(params, layout):
    """The same parameters listed as one group or, in another order, in two."""
    if layout == "saved":
        return [dict(params=[params[2]]), dict(params=[params[0], params[1]])]
    return [dict(params=[params[1], params[0], params[2]])]


@pytest.mark.parametrize("layout", ["nested", "full"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_int8_codes_are_known_by_their_parameter_in_another_grouping(name, layout, tmp_path):
    """DCP keys the state by parameter name, and the loading optimizer may list the same
    parameters in other groups and another order: each saved entry says which of its
    buffers hold codes. Read through float32 state they are refused naming the entry (they
    were let through as momenta of 127); read through int8 state they resume bitwise (they
    were refused, naming a bfloat16 buffer that never held codes)."""
    options = LAYOUTS[layout]
    params = _params()
    opt = OPTIMIZERS[name](_groups(params, "saved"), lr=1e-2, state_dtype=torch.int8)
    _run(opt, params, 4)
    dcp.save({"optim": get_optimizer_state_dict(_module_of(params), opt, options=options)},
             checkpoint_id=str(tmp_path))
    for state_dtype in (None, torch.int8):
        into_params = _params(seed=1)
        model = _module_of(into_params)
        into = OPTIMIZERS[name](_groups(into_params, "loading"), lr=1e-2,
                                state_dtype=state_dtype)
        _run(into, into_params, 1)
        loaded = {"optim": get_optimizer_state_dict(model, into, options=options)}
        dcp.load(loaded, checkpoint_id=str(tmp_path))
        if state_dtype is None:
            with pytest.raises(ValueError, match=r"state_dict\['state'\]\['p[01]'\]\['\w+'\] is "
                                                 r"torch.float32, yet it was saved holding int8"):
                set_optimizer_state_dict(model, into, loaded["optim"], options=options)
        else:
            set_optimizer_state_dict(model, into, loaded["optim"], options=options)
            _continue_alike(into, into_params, opt, params, steps=2)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_checkpoint_saved_before_the_entries_were_marked_is_still_refused_through_floats(
        name, tmp_path):
    """A DCP checkpoint of an earlier version has its groups' places and no entry marks: read
    with allow_partial_load (DCP misses the key otherwise), each entry keeps the loading
    optimizer's own mark (none, for float state), and the groups' places decide."""
    from pnm_kernels.saved_codes import KEY

    params = _params()
    opt = OPTIMIZERS[name](params, lr=1e-2, state_dtype=torch.int8)
    _run(opt, params, 2)
    saved = get_optimizer_state_dict(_module_of(params), opt)
    for entry in saved["state"].values():
        del entry[KEY]
    dcp.save({"optim": saved}, checkpoint_id=str(tmp_path))
    into_params = _params(seed=1)
    model = _module_of(into_params)
    into = OPTIMIZERS[name](into_params, lr=1e-2)
    _run(into, into_params, 1)
    loaded = {"optim": get_optimizer_state_dict(model, into)}
    dcp.load(loaded, checkpoint_id=str(tmp_path),
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    with pytest.raises(ValueError, match=r"\['p0'\]\['\w+'\] is torch.float32, yet it was saved "
                                         r"holding int8 codes \(param_groups\[0\]"):
        set_optimizer_state_dict(model, into, loaded["optim"])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_entry_marks_cast_to_floats_by_a_converter_still_say_codes(name):
    params = _params()
    opt = OPTIMIZERS[name](params, lr=1e-2, state_dtype=torch.int8)
    _run(opt, params, 2)
    saved = opt.state_dict()
    saved["state"] = {i: {k: v.float() if torch.is_tensor(v) else v for k, v in entry.items()}
                      for i, entry in saved["state"].items()}
    into = OPTIMIZERS[name](_params(seed=1), lr=1e-2)
    with pytest.raises(ValueError, match=r"yet it was saved holding int8 codes"):
        into.load_state_dict(saved)


@pytest.mark.parametrize("layout", ["nested", "flattened"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_int8_checkpoint_read_by_dcp_through_float_state_is_refused_named(name, layout,
                                                                             tmp_path):
    """DCP loads into the keys and dtypes of the loading optimizer's state_dict: codes read
    through float32 state come as floats (127.0). Refused naming the entry, the parameters
    untouched; read through int8 state and switched to float32, they convert as
    load_state_dict converts them."""
    options = LAYOUTS[layout]
    opt, params = _saved(name, torch.int8, options, str(tmp_path))
    model, into, into_params, loaded = _read_into(name, None, options, str(tmp_path))
    before = [p.detach().clone() for p in into_params]
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\['p0'\]\['\w+'\] is "
                                         r"torch.float32, yet it was saved holding int8 codes"):
        set_optimizer_state_dict(model, into, loaded, options=options)
    for p, value in zip(into_params, before):
        assert torch.equal(p, value)
    model, into, into_params, loaded = _read_into(name, torch.int8, options, str(tmp_path))
    set_optimizer_state_dict(model, into, loaded, options=options)
    into.param_groups[0]["state_dtype"] = None
    expected_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    expected = OPTIMIZERS[name](expected_params, lr=1e-2)
    expected.load_state_dict(round_trip(opt.state_dict()))
    _continue_alike(into, into_params, expected, expected_params, steps=1)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_entries_a_refused_load_wrote_into_refuse_to_step_until_deleted_or_loaded(name,
                                                                                 tmp_path):
    """dcp.load writes into the tensors of the state_dict it is given, the loading
    optimizer's own: when load_state_dict refuses, the entries saved holding codes already
    hold them as floats, the others the checkpoint's values. Every entry so written is
    marked, and a step refuses it naming the parameter, touching nothing; deleted, a
    parameter starts afresh; a state_dict loaded, through DCP too, clears the marks (which
    state_dict() leaves out: DCP would ask the checkpoint for them)."""
    options, mark = LAYOUTS["nested"], "written_by_refused_load"
    _saved(name, torch.int8, options, str(tmp_path / "int8"))
    model, into, into_params, loaded = _read_into(name, torch.bfloat16, options,
                                                  str(tmp_path / "int8"))
    with pytest.raises(ValueError, match="it wrote into this optimizer's own state"):
        set_optimizer_state_dict(model, into, loaded, options=options)
    assert all(mark in into.state[p] for p in into_params)
    assert not any(mark in entry for entry in into.state_dict()["state"].values())
    before = [(p.detach().clone(), copy.deepcopy(dict(into.state[p]))) for p in into_params]
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\] .*: a load "
                                           r"refused for this optimizer had already written"):
        _run(into, into_params, 1, first=1)
    for p, (value, entry) in zip(into_params, before):
        assert torch.equal(p, value)
        assert_same_entry(into.state[p], entry)
    deleted = into.state.pop(into_params[0])  # the next marked entry is refused
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[1\]"):
        _run(into, into_params, 1, first=1)
    into.state[into_params[0]] = deleted  # for DCP's template: every entry
    opt, params = _saved(name, torch.bfloat16, options, str(tmp_path / "bf16"))
    loaded = {"optim": get_optimizer_state_dict(model, into, options=options)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "bf16"))
    set_optimizer_state_dict(model, into, loaded["optim"], options=options)
    assert not any(mark in into.state[p] for p in into_params)
    _continue_alike(into, into_params, opt, params, steps=2)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_refused_load_of_its_own_state_dict_with_codes_made_floats_marks_nothing(name):
    """optimizer.state_dict() holds the optimizer's own tensors, as torch's does: with one
    buffer's codes replaced by new float tensors (decoded by hand, say) its load is refused,
    yet nothing was written, and the optimizer steps on as before (no entry marked)."""
    params = _params()
    opt = OPTIMIZERS[name](params, lr=1e-2, state_dtype=torch.int8)
    _run(opt, params, 2)
    expected_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    expected = OPTIMIZERS[name](expected_params, lr=1e-2, state_dtype=torch.int8)
    expected.load_state_dict(round_trip(opt.state_dict()))
    own = opt.state_dict()
    for entry in own["state"].values():
        codes = [key for key, value in entry.items() if value.dtype == torch.int8]
        if codes:
            entry[codes[0]] = entry[codes[0]].float()
    with pytest.raises(ValueError, match=r"yet it was saved holding int8 codes"):
        opt.load_state_dict(own)
    assert not any("written_by_refused_load" in opt.state[p] for p in params)
    _run(opt, params, 2, first=2)
    _run(expected, expected_params, 2, first=2)
    assert_same_bits(opt, params, expected, expected_params)


@pytest.mark.parametrize("copied", ["deepcopy", "pickle"])
def test_the_saved_form_survives_a_copy_of_the_optimizer(copied):
    """torch pickles (and deep-copies) an optimizer without its hooks: a copy's state_dict
    still holds plain entries (torch.load(weights_only=True) reads them), state_dtype by
    name and the int8 codes' mark."""
    params = _params()
    opt = PNM(params, lr=1e-2, state_dtype=torch.int8)
    _run(opt, params, 2)
    if copied == "deepcopy":
        copy_params, copy_opt = copy.deepcopy((params, opt))
    else:
        copy_params, copy_opt = round_trip_pickle((params, opt))
    saved = round_trip(copy_opt.state_dict())
    assert saved["param_groups"][0]["state_dtype"] == "int8"
    assert saved["param_groups"][0]["saved_int8_codes"] == (
        "0:pos_momentum,0:neg_momentum,1:pos_momentum,1:neg_momentum")
    original = round_trip(opt.state_dict())
    # (torch's unpickling gives the groups its own "differentiable": False)
    assert [{k: v for k, v in g.items() if k != "differentiable"}
            for g in saved["param_groups"]] == original["param_groups"]
    assert saved["state"].keys() == original["state"].keys()
    for key, entry in saved["state"].items():
        assert_same_entry(entry, original["state"][key])
    _run(copy_opt, copy_params, 1, first=2)
    _run(opt, params, 1, first=2)
    assert_same_bits(copy_opt, copy_params, opt, params)


def round_trip_pickle(obj):
    """Through torch.save and torch.load of whole objects, as a pickled optimizer goes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("layout,appended_by_hand", [("nested", False), ("flattened", False),
                                                     ("flattened", True)],
                         ids=["nested", "flattened", "flattened-group-appended-by-hand"])
def test_codes_of_a_group_partly_converted_are_refused_through_float_state(
        layout, appended_by_hand, tmp_path):
    """A group switched to int8 converts a parameter's state at its next step: one that had
    no gradient since keeps float state beside the other's codes. DCP's read through float
    state is refused for the entry holding codes, also where the loading optimizer's group
    was appended to its param_groups by hand (no add_param_group)."""
    options = LAYOUTS[layout]
    params = _params(shapes=[(4, 256), (4, 256)])
    opt = PNM(params, lr=1e-2)
    _run(opt, params, 2)
    opt.param_groups[0]["state_dtype"] = torch.int8
    params[1].grad = None
    _run(opt, params[:1], 2, first=2)
    assert opt.state_dict()["param_groups"][0]["saved_int8_codes"] == "0:pos_momentum,0:neg_momentum"
    dcp.save({"optim": get_optimizer_state_dict(_module_of(params), opt, options=options)},
             checkpoint_id=str(tmp_path))
    into_params = _params(seed=1, shapes=[(4, 256), (4, 256)])
    into = PNM(into_params, lr=1e-2)
    if appended_by_hand:
        into.param_groups = [dict(group) for group in into.param_groups]
        del into.param_groups[0]["saved_int8_codes"]
    _run(into, into_params, 1)
    model = _module_of(into_params)
    loaded = {"optim": get_optimizer_state_dict(model, into, options=options)}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\['p0'\]\['pos_momentum'\] is "
                                         r"torch.float32, yet it was saved holding int8 codes"):
        set_optimizer_state_dict(model, into, loaded["optim"], options=options)
