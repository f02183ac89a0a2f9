"""A parameter's state that is one number: its step counter and its random-bits seed, as
they may come (a Python number in the authors' checkpoints, a tensor of any real dtype set by
hand or cast by a loader), whether a step can use them, and as the backends take them."""
import math
import numbers
from typing import Optional

import torch

from .backends.base import STEP_DTYPE, float_or_none, is_whole_count
from .hyper import shown


def is_one_number(value) -> bool:
    """A step counter or seed as it may come: a real number, or a real tensor of one element
    (as_step and as_seed take either)."""
    if torch.is_tensor(value):
        return value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's too


def count_problem(step) -> Optional[str]:
    """What keeps a step from advancing this counter, or None: a whole number of steps >= 0
    (at -1 the next step divides by a bias correction of 0; at 2.5 the kernels' bias
    corrections use 3.5, the reference's 3). One on a device is not read back: that would
    synchronise."""
    if torch.is_tensor(step):
        if step.device.type != "cpu":
            return None
        step = step.item()
    if not is_whole_count(step):
        return f"is {shown(step)}, not a whole number of steps >= 0"
    return None


def seed_problem(seed) -> Optional[str]:
    """What keeps as_seed from taking this seed, or None: a whole number within int64 (one
    loaded as a float may be NaN, infinite or past it: float16 holds no more than 65504). An
    integer tensor is one; a meta one is refused by state.check_state."""
    if isinstance(seed, torch.Tensor):
        if seed.is_meta or (not seed.is_floating_point() and seed.dtype != torch.uint64):
            return None
        seed = seed.item()  # as as_seed reads it
    if isinstance(seed, numbers.Integral):  # exact, however large
        if not -2**63 <= int(seed) < 2**63:
            return f"is {shown(seed)}, not a whole number within int64"
        return None
    if not (math.isfinite(seed) and seed == int(seed) and -2**63 <= int(seed) < 2**63):
        return f"is {seed!r}, not a whole number within int64"
    return None


def convertible_step(step) -> bool:
    """A step counter as_step converts (whether or not a step can use it): one number with
    data, within a float's range."""
    if not is_one_number(step):
        return False
    if torch.is_tensor(step):
        return not step.is_meta
    return float_or_none(step) is not None


def as_step(step, p) -> torch.Tensor:
    """A step counter as the backends take it: a STEP_DTYPE tensor on its parameter's device
    (a Python int in the authors' checkpoints; one set by hand may be anything numeric)."""
    if torch.is_tensor(step):
        if step.dim() != 0:  # a one-element tensor of another shape, set by hand
            step = step.detach().reshape(())
        return step.to(device=p.device, dtype=STEP_DTYPE)  # itself where it is one already
    return torch.as_tensor(float(step), dtype=STEP_DTYPE).to(p.device)


def as_seed(seed, p) -> torch.Tensor:
    """A random-bits seed as the backends take it: an int64 tensor on its parameter's device
    (torch's load_state_dict casts it to the parameter's dtype: exact below 2^24)."""
    if torch.is_tensor(seed):
        if seed.dtype == torch.int64 and seed.device == p.device and seed.dim() == 0:
            return seed
        seed = int(seed.detach().reshape(()).item())
    return torch.tensor(int(seed), dtype=torch.int64, device=p.device)
