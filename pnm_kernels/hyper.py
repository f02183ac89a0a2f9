"""A param group's hyper-parameters: validated once, frozen, and the coefficients every
Python and Triton step derives from them, computed in one place (docs/design.md §1)."""
import math
import numbers
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

from .layout import LAZY_VIEW_ADVICE
from .reference import needs_seed, noise_norm, steps_in_float32

BACKEND_NAMES = ("auto", "fused", "triton", "foreach", "reference")
# The group keys that decide a step (a group's other keys are the user's own, carried along).
PNM_KEYS = ("lr", "betas", "weight_decay", "decoupled", "maximize", "backend", "state_dtype",
            "bf16_stochastic_round")
# What state_dtype may be (docs/design.md §7): None keeps the parameter's dtype.
STATE_DTYPES = (None, torch.float32, torch.bfloat16, torch.int8)
ADAPNM_KEYS = PNM_KEYS + ("eps", "amsgrad")


def saved_state_dtype(value):
    """state_dtype as a state_dict holds it: by name ("bfloat16"), as torch's distributed
    state_dict utilities (full_state_dict, cpu_offload) take no torch.dtype value."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def state_dtype_from_saved(value):
    """A saved state_dtype as the groups hold it: a name made a dtype again (a checkpoint
    holding the dtype itself loads as well); anything else as it is, for validate_group."""
    if isinstance(value, str):
        for dtype in STATE_DTYPES[1:]:
            if value == saved_state_dtype(dtype):
                return dtype
    return value


def _is_real_number(x) -> bool:
    # float and int first: an isinstance check against the numbers.Real ABC costs ~0.2 µs,
    # and a scheduler's new lr has a group validated again at each step.
    return type(x) in (float, int) or (isinstance(x, numbers.Real) and not isinstance(x, bool))


# The largest a hyper-parameter, or a factor the step derives from them, may be: the kernels
# compute in float32 (float64 parameters aside), and past it a factor is inf (NaN in the step)
# or, in torch ops on float32 tensors, an overflow error midway through the step.
LARGEST = float(torch.finfo(torch.float32).max)


def _nan_or_infinite(value) -> bool:
    try:
        return not math.isfinite(value)
    except OverflowError:  # an int past a float's range: finite, too large (said so)
        return False


def shown(value) -> str:
    """A number for a message: an int of hundreds of digits by its size."""
    text = repr(value)
    return text if len(text) <= 40 else f"an integer of {len(str(abs(value)))} digits"


def _check_real(where, name, value, *, low, high=LARGEST, high_open=False):
    if not _is_real_number(value) or _nan_or_infinite(value):
        raise ValueError(f"{where}: invalid {name} {value!r}; need a finite real number")
    if abs(value) > LARGEST:
        raise ValueError(f"{where}: invalid {name} {shown(value)}; need a magnitude at most "
                         f"{LARGEST:.4g} (the step's factors are float32)")
    if value < low or value > high or (high_open and value == high):
        upper = f"< {high}" if high_open else ("" if high == LARGEST else f"<= {high}")
        raise ValueError(f"{where}: invalid {name} {value!r}; need {low} <= {name} {upper}".rstrip())


def validate_lr(lr, where: str, group: Optional[dict] = None, adaptive: bool = False) -> None:
    """With `group`: the factors of the lr and the group's other hyper-parameters too."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"{where}: a tensor lr must be a floating-point tensor with one "
                             f"element, got {lr.dtype} with shape {tuple(lr.shape)}")
        if lr.is_neg():  # the kernels read its memory, not its value
            raise ValueError(f"{where}: the tensor lr is an unresolved negative view (from "
                             f"z.conj().imag or similar): {LAZY_VIEW_ADVICE}")
        if lr.is_meta:
            raise ValueError(f"{where}: the tensor lr is on the meta device, which holds no "
                             "value to step with")
        if lr.device.type != "cpu":  # a device lr is not read back: that would synchronise
            return
        lr = float(lr.detach())
    _check_real(where, "lr", lr, low=0.0)
    if group is None:
        return
    for name, factor in _lr_factors(lr, group, adaptive):
        if factor > LARGEST:
            raise ValueError(f"{where}: {name} is {factor:.4g} (lr {lr!r}, weight_decay "
                             f"{group['weight_decay']!r}, betas {group['betas']!r}); need at "
                             f"most {LARGEST:.4g} (the step's factors are float32)")


def _lr_factors(lr, group: dict, adaptive: bool) -> list:
    """The factors of the lr a step computes: the decoupled decay's and AdaPNM's first step
    size (1 - beta1^t is smallest at t = 1)."""
    factors = [("lr * weight_decay", lr * group["weight_decay"])] if group["decoupled"] else []
    return factors + ([("lr / (1 - beta1)", lr / (1 - group["betas"][0]))] if adaptive else [])


def lr_bound(group: dict, adaptive: bool) -> float:
    """The largest lr validate_lr accepts for the group (its other keys validated): as a
    bound of constants, for the checks inside a traced step."""
    per_unit_lr = [factor for _, factor in _lr_factors(1.0, group, adaptive) if factor > 0]
    return min([LARGEST] + [LARGEST / factor for factor in per_unit_lr])


def assert_lr_in_graph(lr, where: str, group: dict, adaptive: bool) -> None:
    """validate_lr's check of a CPU tensor lr's value, as an op of a traced step: dynamo
    does not guard that value, so a check at tracing would see only the lr the step was
    traced with (one filled with NaN later stepped every parameter to NaN). A device lr is
    not checked, as in eager (a failed device assert also ends the process)."""
    if (isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and lr.numel() == 1
            and lr.is_floating_point()):
        # The bound is not in the message: under dynamic=True it is symbolic (traced from the
        # group's floats), and dynamo cannot format it. The factors' names are constants.
        factors = ", ".join(["lr"] + [name for name, _ in _lr_factors(1.0, group, adaptive)])
        torch._assert_async((lr >= 0) & (lr <= lr_bound(group, adaptive)),
                            f"{where}: invalid lr (a tensor now NaN, negative, or so large "
                            f"that the step's float32 factors ({factors}) pass float32's "
                            "range); need a finite real number >= 0")


def check_float16_factors(hyper: "Hyper", where: str) -> None:
    """The reference and foreach step float16 parameters in float16 torch ops, which refuse
    a scalar past float16's largest midway through a step: refused before it (the kernels
    compute in float32)."""
    lr = float(hyper.lr)  # a device lr is read: float16 on these backends is the CPU's
    factors = [("lr", lr), ("1 + |beta0|", 1 + abs(hyper.beta0)),
               ("weight_decay", hyper.weight_decay), ("eps", hyper.eps),
               ("lr * weight_decay", 1 + lr * hyper.weight_decay if hyper.decoupled else 0.0),
               ("lr / (1 - beta1)", lr / (1 - hyper.beta1) if hyper.adaptive else 0.0)]
    largest = torch.finfo(torch.float16).max
    for name, factor in factors:
        if factor > largest:
            raise ValueError(f"{where}: {name} is {factor:.4g}, past float16's largest "
                             f"({largest:.0f}), which the float16 parameters' step on this "
                             "backend computes in; use backend='fused' (float32 arithmetic) "
                             "or state_dtype=torch.float32")


def validate_group(group: dict, adaptive: bool, where: str) -> None:
    """Checks every hyper-parameter of a group (docs/design.md §1 "Valid hyper-parameters")."""
    betas = group["betas"]
    names = ("beta1", "beta2", "beta0") if adaptive else ("beta1", "beta0")
    if not isinstance(betas, (tuple, list)) or len(betas) != len(names):
        raise ValueError(f"{where}: betas must be a tuple ({', '.join(names)}), got {betas!r}")
    for i, (name, value) in enumerate(zip(names, betas)):
        label = f"{name} (betas[{i}])"
        if name == "beta0":
            _check_real(where, label, value, low=-math.inf)
        else:
            _check_real(where, label, value, low=0.0, high=1.0, high_open=True)
    _check_real(where, "weight_decay", group["weight_decay"], low=0.0)
    validate_lr(group["lr"], where, group, adaptive)
    flags = ("decoupled", "maximize", "bf16_stochastic_round") + (("amsgrad",) if adaptive else ())
    if adaptive:
        _check_real(where, "eps", group["eps"], low=0.0)
    for flag in flags:
        if not isinstance(group[flag], bool):
            raise ValueError(f"{where}: {flag} must be a bool, got {group[flag]!r}")
    state_dtype = group["state_dtype"]
    if not (state_dtype is None or (isinstance(state_dtype, torch.dtype)
                                    and state_dtype in STATE_DTYPES)):
        raise ValueError(f"{where}: state_dtype must be one of {STATE_DTYPES}, "
                         f"got {group['state_dtype']!r}")
    if group["backend"] not in BACKEND_NAMES:
        raise ValueError(f"{where}: backend must be one of {BACKEND_NAMES}, "
                         f"got {group['backend']!r}")


def _value_signature(v):
    # A tensor by identity, version and memory (`lr.data = ...` bumps no version, and a Hyper
    # holds a detached lr that keeps the old memory), and a CPU one by its value too
    # (`lr.data.fill_(-1)` bumps none either; a device lr is not read back: validate_lr); a
    # list (betas given as one) by its values: the list itself would equal itself after an
    # edit in place, which then went unvalidated. Anything else with its type: `amsgrad = 1`
    # where it was True is equal, yet refused where given first.
    if isinstance(v, torch.Tensor):
        value = v.detach().item() if v.device.type == "cpu" and v.numel() == 1 else None
        return id(v), v._version, v.data_ptr(), v.is_neg(), value
    return (list, tuple(v)) if type(v) is list else (type(v), v)


def signature(group: dict, keys: tuple) -> tuple:
    """The group's hyper-parameters as they are now, lr first. Only the keys that decide a
    step: a user's own keys may hold anything (tensors too), as torch's optimizers allow."""
    return tuple(_value_signature(group[k]) for k in keys)


Lr = Union[float, torch.Tensor]


@dataclass(frozen=True)
class Hyper:
    """A validated group's hyper-parameters as every backend takes them: Python floats (a
    numpy scalar reached the Triton kernels as a type they refuse, and the reference computed
    in its precision); a tensor lr stays a tensor (detached: its value only)."""
    lr: Lr
    beta1: float
    beta0: float
    weight_decay: float
    decoupled: bool
    maximize: bool
    adaptive: bool = False
    beta2: float = 0.0
    eps: float = 0.0
    amsgrad: bool = False
    state_dtype: Optional[torch.dtype] = None
    bf16_stochastic_round: bool = False

    @staticmethod
    def from_group(group: dict, adaptive: bool) -> "Hyper":
        """From a group validate_group accepted."""
        betas = group["betas"]
        extra = {}
        if adaptive:
            extra = dict(beta2=float(betas[1]), eps=float(group["eps"]),
                         amsgrad=group["amsgrad"])
        return Hyper(lr=plain_lr(group["lr"]), beta1=float(betas[0]), beta0=float(betas[-1]),
                     weight_decay=float(group["weight_decay"]), decoupled=group["decoupled"],
                     maximize=group["maximize"], adaptive=adaptive,
                     state_dtype=group["state_dtype"],
                     bf16_stochastic_round=group["bf16_stochastic_round"], **extra)

    def with_lr(self, lr: Lr) -> "Hyper":
        return replace(self, lr=plain_lr(lr))

    def in_float32(self, param_dtype: torch.dtype) -> bool:
        """Whether parameters of this dtype step in float32 with their own rounding
        (reference.steps_in_float32)."""
        return steps_in_float32(self.state_dtype, self.bf16_stochastic_round, param_dtype)

    @property
    def num_buffers(self) -> int:
        """How many state buffers a step reads (in the kernels' list order: backends/base.py)."""
        if not self.adaptive:
            return 2
        return 4 if self.amsgrad else 3


def plain_lr(lr) -> Lr:
    if isinstance(lr, torch.Tensor):
        return lr.detach() if lr.requires_grad else lr  # float() of it then quiet
    return float(lr)


@dataclass(frozen=True)
class Coefficients:
    """What the foreach and Triton steps compute from the hyper-parameters (the C++ kernels
    do the same in csrc/pnm_math.h's make_coeffs). Per-step factors (bias corrections) depend
    on each parameter's step count and are computed where it is read."""
    b1_sq: float             # beta1^2: PNM's momentum decays over two steps
    one_minus_b1_sq: float
    pos_coef: float          # 1 + beta0, on the buffer this step updates
    neg_coef: float          # -beta0, on the other one
    inv_noise_norm: float    # 1 / sqrt((1+b0)^2 + b0^2)
    b2: float
    one_minus_b2: float
    log_b1: float            # for bias corrections computed in the kernel: b^t = exp(t log b)
    log_b2: float
    grad_sign: float         # -1 to maximize


def coefficients(h: Hyper) -> Coefficients:
    log = lambda b: math.log(b) if b > 0 else -math.inf  # noqa: E731
    return Coefficients(
        b1_sq=h.beta1**2, one_minus_b1_sq=1 - h.beta1**2, pos_coef=1 + h.beta0,
        neg_coef=-h.beta0, inv_noise_norm=1 / noise_norm(h.beta0), b2=h.beta2,
        one_minus_b2=1 - h.beta2, log_b1=log(h.beta1), log_b2=log(h.beta2),
        grad_sign=-1.0 if h.maximize else 1.0)


def check_state_dtype(state_dtype, param: torch.Tensor) -> None:
    """Raises ValueError when a parameter cannot keep its state in state_dtype (the caller
    names the parameter): float64 parameters keep float64 state, and complex parameters
    their own dtype (there is no complex bfloat16). A DTensor's sharding: check_sharding."""
    if state_dtype is None or state_dtype == param.dtype:
        return
    if param.is_complex():
        raise ValueError(f"state_dtype={state_dtype} is not supported for complex parameters "
                         "(their state keeps their dtype: state_dtype=None)")
    if param.dtype == torch.float64:
        raise ValueError(f"state_dtype={state_dtype} is not supported for float64 parameters "
                         "(their state stays float64: state_dtype=None)")


def check_sharding(state_dtype, bf16_stochastic_round: bool, param) -> None:
    """Raises ValueError where a DTensor parameter's step draws random bits but its local
    shard holds no run of whole rows: an element's bits are picked by its index in the whole
    parameter, the shard's first element's plus its index in the shard, which holds for
    dim-0 shards only (another split would give elements of two ranks the same bits, and
    the step would differ from one process's)."""
    if type(param) in (torch.Tensor, torch.nn.Parameter) or _rows_whole(param):
        return
    if needs_seed(state_dtype, bf16_stochastic_round, param.dtype):
        what = (f"state_dtype={state_dtype}" if state_dtype in (torch.bfloat16, torch.int8)
                else "bf16_stochastic_round=True")
        raise ValueError(f"{what} needs a DTensor sharded along dim 0 only (FSDP2's Shard(0)) "
                         f"or replicated, got placements {getattr(param, 'placements', None)}")


def _rows_whole(param) -> bool:
    """Whether a DTensor's local shards hold whole rows (its int8 blocks lie within rows, and
    its elements' indices in the whole parameter follow from the first's)."""
    from torch.distributed.tensor import Replicate, Shard
    return all(isinstance(place, Replicate) or (isinstance(place, Shard) and place.dim == 0)
               for place in getattr(param, "placements", ()))


__all__ = ["Hyper", "Coefficients", "coefficients", "validate_group", "validate_lr",
           "assert_lr_in_graph", "lr_bound", "check_float16_factors", "signature",
           "noise_norm", "BACKEND_NAMES", "PNM_KEYS", "ADAPNM_KEYS",
           "STATE_DTYPES", "check_state_dtype", "check_sharding",
           "steps_in_float32", "needs_seed"]
