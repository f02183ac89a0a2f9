"""Random sequences of user events between steps (hyper-parameters changed, gradients
missing, state deleted, replaced or reloaded, parameters given new data: conftest's
user_event), over groups of several dtypes and backends: the fast paths, with their cached
and repeated steps (test_held_lists.py), give what the reference, or steps planned afresh
every time, give."""
import random

import pytest
import torch

import cases
from cases import FAST_PATHS, KERNEL_PATHS, OVER_OPTIMIZERS
from conftest import (DEVICE, HAS_TRITON, OPTIMIZERS, assert_states_close, grads_for_step,
                      user_event)
from internals import extension_is_built, never_remember_steps
from test_held_lists import MIXED


def _steps_with_random_events(name, backends, seed, steps=80, missing=0.25,
                              dtypes=(torch.float32,), repeat=True):
    """Steps over three groups (on `backends`, one each, or one for all) in which, at
    random, a fraction `missing` of the gradients are missing and, now and then, a
    user_event happens (hyper-parameters changed, state deleted, replaced or reloaded: see
    conftest) or a parameter is given new data. The parameters take `dtypes` in turn;
    without `repeat` every step is planned."""
    events = random.Random(seed)
    torch.manual_seed(seed)
    shapes = [(events.randint(1, 40),) for _ in range(7)] + [(3, 5), (2, 2, 3)]
    params = [torch.randn(s, device=DEVICE).to(dtypes[i % len(dtypes)]).requires_grad_()
              for i, s in enumerate(shapes)]
    backends = [backends] * 3 if isinstance(backends, str) else backends
    opt = OPTIMIZERS[name]([dict(params=params[:4], backend=backends[0]),
                            dict(params=params[4:7], weight_decay=0.1, backend=backends[1]),
                            dict(params=params[7:], lr=3e-3, backend=backends[2])], lr=1e-2)
    if not repeat:
        never_remember_steps(opt)
    for t in range(steps):
        for p, g in zip(params, grads_for_step(params, t, seed)):
            p.grad = None if events.random() < missing else g
        event, k = user_event(opt, params, events, name)
        if 0.24 <= event < 0.27:
            params[k].data = params[k].data.clone()
        opt.step()
    return opt, params


@pytest.mark.parametrize("seed", [0, 1])
@cases.parametrize(FAST_PATHS)
def test_any_sequence_of_user_events_gives_the_references_steps(path, name, seed):
    """Whatever a user does between steps, in whatever order, the fast paths (with their
    cached and repeated steps) give what the reference gives, state included."""
    opt, params = _steps_with_random_events(name, path, seed)
    ref, ref_params = _steps_with_random_events(name, "reference", seed)
    assert_states_close(opt, params, ref, ref_params)


@pytest.mark.parametrize("seed", [0, 1])
@cases.parametrize(KERNEL_PATHS)
def test_user_events_over_groups_of_several_dtypes_repeat_as_planned_steps_step(path, name,
                                                                                seed):
    """The same over parameters of three dtypes, each group one batch per dtype: the steps,
    repeated where they can be, give bit for bit what steps planned afresh every time give."""
    opt, params = _steps_with_random_events(name, path, seed, dtypes=MIXED, missing=0.1)
    planned, planned_params = _steps_with_random_events(name, path, seed, dtypes=MIXED,
                                                        missing=0.1, repeat=False)
    assert_states_close(opt, params, planned, planned_params, rtol=0, atol=0)


@pytest.mark.parametrize("backends", [("triton",) * 3, ("fused", "triton", "triton"),
                                      ("triton", "fused", "fused")], ids="-".join)
@pytest.mark.parametrize("seed", [0, 1])
@OVER_OPTIMIZERS
def test_user_events_over_groups_on_several_backends_between_repeated_steps(backends, name,
                                                                            seed):
    """The same with one gradient in fifty missing, so that most steps have every gradient
    and repeat (fused and Triton groups side by side) between the events."""
    if not extension_is_built() or not HAS_TRITON:
        pytest.skip("needs pnm_kernels._C and triton")
    opt, params = _steps_with_random_events(name, backends, seed, missing=0.02)
    ref, ref_params = _steps_with_random_events(name, "reference", seed, missing=0.02)
    assert_states_close(opt, params, ref, ref_params)
