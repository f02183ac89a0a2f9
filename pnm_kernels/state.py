"""optimizer.state as the fast paths need it: every change made from outside counted.

Steps reuse the tensor lists they built from the state (the batch cache, the repeated step:
docs/design.md §5), so a change made from outside — a moment reset by hand, a new step
counter, a whole state put back — must be seen, and the next step reads the state again, as
torch's optimizers, which read it every step, would. The optimizers' own writes (put) are
not counted: the lists built before stay valid."""
import numbers
import sys
from collections import defaultdict
from typing import Callable, Optional

import torch

from . import quantization
from .backends.base import STEP_DTYPE
from .counters import (as_seed, as_step, convertible_step, count_problem, is_one_number,
                       seed_problem)
from .layout import LAZY_VIEW_ADVICE, is_dense, lazy_view, same_dense_layout

# How often anyone but the optimizers changed which tensors a state holds. One counter for
# the process: a state entry may be shared between optimizers (opt2.state = opt1.state), and
# an increment is all a change costs.
_changes = 0


def _counted(change):
    def counted(self, *args, **kwargs):
        global _changes
        _changes += 1
        return change(self, *args, **kwargs)
    counted.__name__ = change.__name__
    return counted


class _CountsChanges:
    """Every way of putting in, replacing or taking out an entry, counted."""
    __slots__ = ()
    __setitem__ = _counted(dict.__setitem__)
    __delitem__ = _counted(dict.__delitem__)
    __ior__ = _counted(dict.__ior__)
    clear = _counted(dict.clear)
    pop = _counted(dict.pop)
    popitem = _counted(dict.popitem)
    setdefault = _counted(dict.setdefault)
    update = _counted(dict.update)


class ParamState(_CountsChanges, dict):
    """One parameter's state, its changes from outside counted."""
    __slots__ = ()

    def __setitem__(self, key, value) -> None:
        # A counter set by hand as a number (the authors' checkpoints hold ints) is made a
        # tensor at once, as load_state_dict makes it: torch.compile reads `.is_cpu` of every
        # state["step"] before any code of ours runs (an internal dynamo error on an int).
        # One past a float's range stays as it is, for the step to refuse naming it.
        if key == "step" and isinstance(value, numbers.Real) and not isinstance(value, bool) \
                and convertible_step(value):
            value = torch.tensor(float(value), dtype=STEP_DTYPE)
        super().__setitem__(key, value)


class OptimizerState(_CountsChanges, defaultdict):
    """optimizer.state: a defaultdict of ParamState, entries replaced or deleted counted."""
    __slots__ = ()

    def __missing__(self, param):  # optimizer.state[p] before p has state, as in torch
        # Not counted: an empty entry is no state (a step treats p as without state, and
        # what is put into the entry is counted), so reading it costs no planned step.
        entry = ParamState()
        put(self, param, entry)
        return entry


def count_replacement() -> None:
    """The optimizer replaced a tensor of a state entry (converting it): counted as a change,
    so that every optimizer sharing the entry builds its lists again."""
    global _changes
    _changes += 1


def put(state: dict, key, value) -> None:
    """The optimizer's own write into its state: not counted as a change."""
    dict.__setitem__(state, key, value)


def _register_as_dicts() -> None:
    """Pytree walks over optimizer.state go through our dict subclasses as through dicts.
    torch.compile marks torch's optimizers' state tensors static that way (mode=
    "reduce-overhead" then keeps the step's CUDA graph and updates them in place); as
    leaves, one parameter's state became graph inputs copied in, and the graph was skipped
    for "mutated inputs"."""
    from torch.utils import _pytree as pytree

    def flatten(d):
        return list(d.values()), list(d.keys())

    def flatten_with_keys(d):
        return [(pytree.MappingKey(k), v) for k, v in d.items()], list(d.keys())

    pytree.register_pytree_node(
        ParamState, flatten, lambda values, keys: ParamState(zip(keys, values)),
        flatten_with_keys_fn=flatten_with_keys)
    pytree.register_pytree_node(
        OptimizerState, flatten, lambda values, keys: OptimizerState(None, zip(keys, values)),
        flatten_with_keys_fn=flatten_with_keys)


_register_as_dicts()


def _references(holder: dict, key) -> int:
    return sys.getrefcount(dict.get(holder, key))


# What _references counts for an object only its holder holds (calibrated, not assumed:
# the count of a call's own references differs between Python versions).
_HELD_ONLY_THERE = _references({0: {}}, 0)


def held_only_by(holder: dict, key) -> bool:
    return _references(holder, key) == _HELD_ONLY_THERE


def counted_entry(state: dict, p):
    """p's entry in an optimizer state, made a ParamState if it is a plain dict no one else
    holds (load_state_dict's, or optimizer.state[p] = {} by hand), so that its parameter's
    lists may be reused. A plain dict the user still holds stays as it is: their edits
    through it are then seen, its group being read afresh at every step."""
    if type(state.get(p)) is dict and held_only_by(state, p):
        put(state, p, ParamState(state[p]))
    return state.get(p)


def tracked(state) -> OptimizerState:
    """optimizer.state made counted (load_state_dict's, or one set by hand: optimizer.state
    = defaultdict(dict) to restart); its entries are made counted as they are read (see
    counted_entry). Built by dict's own update, which counts nothing."""
    return OptimizerState(None, state)


def is_plain(t) -> bool:
    """A plain tensor or Parameter, not a subclass such as DTensor."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def is_dtensor(t) -> bool:
    """A DTensor (FSDP2): its state is sharded as it is. Not every tensor that is not plain
    (a library's own Parameter subclass is not). DTensor is looked up, not imported:
    importing torch.distributed.tensor costs ~0.3 s, and a program with DTensors has
    imported it."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def buffer_fits(buffer: torch.Tensor, p: torch.Tensor, dtype: Optional[torch.dtype] = None) -> bool:
    """Whether a state buffer still matches its parameter: dtype (the parameter's, or the
    state_dtype asked for), device, shape and the layout zeros_like gives it (which the
    kernels that walk raw memory rely on)."""
    if (buffer.dtype != (dtype or p.dtype) or buffer.device != p.device
            or buffer.shape != p.shape):
        return False
    if not is_plain(p):
        return True
    if p.is_contiguous():
        return buffer.is_contiguous()
    if is_dense(p):
        return same_dense_layout(buffer, p)
    # A parameter with gaps is copied into its buffers' layout for the step: the one
    # zeros_like gives it.
    return buffer.stride() == torch.empty_like(p, device="meta").stride()


class BufferShapeError(RuntimeError):
    pass


class CodesWithoutScalesError(RuntimeError):
    """A buffer of int8 codes whose scales are missing (args: the buffer's name)."""


class StateValueError(RuntimeError):
    """A value of a parameter's state that no step can use (args: its key, what is wrong)."""


# What int8 state's buffers hold: signed (momenta) and unsigned (second moments) codes.
CODE_DTYPES = (torch.int8, torch.uint8)
# Marks an entry a refused load had written into (saved_codes.py): no step takes it.
REFUSED_LOAD = "written_by_refused_load"


def inference_tensors_writable() -> bool:
    """Whether a step run here may write inference tensors: while compiling (dynamo traces
    neither question), or inside torch.inference_mode() (a step there leaves it only where
    it may: Optimizer.step)."""
    return torch.compiler.is_compiling() or torch.is_inference_mode_enabled()


def check_state(state: dict, p, names, inference_ok: bool) -> None:
    """Raises what ensure_state would raise for p's state (BufferShapeError,
    CodesWithoutScalesError, StateValueError), touching nothing: a step checks every
    parameter's state this way before it converts any (another group's state_dtype
    switched, say). `inference_ok`: inference_tensors_writable(), asked once for many."""
    entry = state.get(p)
    if not entry:
        return
    if REFUSED_LOAD in entry:
        raise StateValueError(REFUSED_LOAD, entry[REFUSED_LOAD])
    check_resolved(state, p, names)
    for key in ("step", "seed"):
        value = entry.get(key)
        if value is None:
            continue
        if is_one_number(value):
            problem = (count_problem if key == "step" else seed_problem)(value)
            if problem:
                raise StateValueError(key, problem)
            continue
        if torch.is_tensor(value) and value.numel() != 1:
            raise StateValueError(key, f"has {value.numel()} elements, not one")
        what = f"a tensor of {value.dtype}" if torch.is_tensor(value) else type(value).__name__
        raise StateValueError(key, f"is {what}, not a real number")
    for name in names:
        if entry.get(name) is not None:
            _check_buffer(entry, name, p)
    for key in keys_read(names):
        value = entry.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if _local(value).is_meta and not _local(p).is_meta:  # a dry run on a meta model's
            raise StateValueError(key, "is on the meta device (no data), beside a "
                                  "parameter with data")
        if _local(value).is_inference() and not inference_ok:
            raise StateValueError(key, "is an inference tensor (made under "
                                  "torch.inference_mode()), which the step, run outside that "
                                  "mode, cannot write: give it a copy made outside it "
                                  "(`.clone()`)")


def check_resolved(state: dict, p, names) -> None:
    """Raises StateValueError where a tensor of p's state that the step reads is a lazy
    negative or conjugate view (layout.lazy_view)."""
    for key in keys_read(names):
        value = (state.get(p) or {}).get(key)
        lazy = lazy_view(_local(value)) if isinstance(value, torch.Tensor) else None
        if lazy:
            raise StateValueError(key, f"is an unresolved {lazy} view (from .conj() or "
                                  f"similar): {LAZY_VIEW_ADVICE}")


def keys_read(names) -> tuple:
    """The keys of a parameter's state that a step with buffers `names` reads: the counter,
    the seed, the buffers and their int8 scales. Any other key is a user's own."""
    return ("step", "seed", *names, *(quantization.scale_name(n) for n in names))


def claim_state(state: dict, p, claims, names) -> None:
    """Adds the tensors of p's state that the step reads (a buffer of `names`, its scales,
    the counter, the seed) to `claims` (aliasing.MemoryClaims), each owned by p and its key: one
    that another parameter's state or another key holds too, or that shares memory with
    either, is refused there. A user's own keys may hold anything."""
    entry = state.get(p)
    if not entry:
        return
    for key in keys_read(names):
        claims.add(entry.get(key), p, key)


def _check_buffer(entry: dict, name: str, p) -> None:
    """The one place of what makes a buffer unusable for p, whichever state_dtype it goes
    to: another shape (BufferShapeError), int8 codes without scales that fit
    (CodesWithoutScalesError, or BufferShapeError for the scales). check_state, ensure_state
    and the decoding of codes all ask here."""
    buffer = entry[name]
    if not isinstance(buffer, torch.Tensor):
        raise StateValueError(name, f"is a {type(buffer).__name__}, not a tensor")
    if buffer.shape != p.shape:
        raise BufferShapeError(name, buffer, p.shape)
    _check_sharded_like(name, buffer, p)
    if buffer.dtype in CODE_DTYPES:
        if buffer.dtype != quantization.code_dtype(name):
            kind = "signed (int8)" if quantization.SIGNED[name] else "unsigned (uint8)"
            raise StateValueError(name, f"holds {buffer.dtype} codes where its codes are "
                                  f"{kind}")
        if quantization.row_length(p.shape) is None:
            raise StateValueError(name, "holds int8 codes, which this parameter does not keep: "
                                  f"its rows are shorter than a block of {quantization.BLOCK} "
                                  "(it keeps bfloat16 state)")
        key = quantization.scale_name(name)
        scales = entry.get(key)
        if scales is None:
            raise CodesWithoutScalesError(name)
        if not (isinstance(scales, torch.Tensor) and scales.is_floating_point()):
            what = scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise StateValueError(key, f"is {what}, not a floating tensor of block scales")
        if scales.device != buffer.device:
            raise StateValueError(key, f"is on {scales.device}, its codes on {buffer.device}")
        if scales.shape != quantization.scales_shape(p.shape):
            raise BufferShapeError(key, scales, quantization.scales_shape(p.shape))
        _check_sharded_like(key, scales, p)
    elif not (buffer.is_floating_point() or buffer.is_complex()):
        raise StateValueError(name, f"is of dtype {buffer.dtype}: a buffer holds floating "
                              "values, or int8 codes with their scales")


def _check_sharded_like(key: str, t: torch.Tensor, p) -> None:
    """A DTensor parameter's state is placed as it is, a plain one's plain (full_state_dict
    loads put the keys the loading optimizer lacked, int8 scales, whole beside shards)."""
    def placed(x):
        return f"a DTensor placed {list(x.placements)}" if is_dtensor(x) else "a plain tensor"
    mesh = getattr(p, "device_mesh", None)
    if placed(t) != placed(p) or getattr(t, "device_mesh", None) != mesh:
        raise StateValueError(key, f"is {placed(t)} where its parameter is {placed(p)}: "
                              "state sharded otherwise than its parameter (loaded so?)")
    # Placed alike, a buffer's shard may still be another's (another rank's state_dict
    # loaded): the kernels step the local shards (int8 scales: a row a parameter's row).
    alike = (lambda s: s) if t.shape == p.shape else (lambda s: s[:1])
    if is_dtensor(t) and alike(_local(t).shape) != alike(_local(p).shape):
        raise StateValueError(key, f"has a local shard of shape {tuple(_local(t).shape)} "
                              f"where its parameter's is {tuple(_local(p).shape)}: another "
                              "rank's state (loaded so?)")


def ensure_state(state: dict, p, names, dtype: Optional[torch.dtype] = None,
                 seed: Optional[Callable[[], int]] = None) -> tuple[dict, bool]:
    """p's state with these buffers (of `dtype`, p's own by default) and a step counter: made
    where missing, converted where p was given new data since (as load_state_dict converts
    state to its parameter) or the state_dtype changed. With `seed` (bfloat16 state), a seed
    for the random bits too, `seed()` where there is none. Returns the entry and whether an
    existing tensor was replaced (lists built before are stale). Raises
    BufferShapeError(name, buffer, the shape it needs) for a buffer of another shape."""
    entry = counted_entry(state, p)
    if entry is None:
        entry = ParamState()
        put(state, p, entry)
    replaced = False
    step = entry.get("step")
    if step is None:
        put(entry, "step", torch.zeros((), dtype=STEP_DTYPE, device=p.device))
    else:
        counter = as_step(step, p)
        if counter is not step:
            put(entry, "step", counter)
            replaced = True
    if seed is not None:
        known = entry.get("seed")
        counter = as_seed(seed() if known is None else known, p)
        if counter is not known:
            put(entry, "seed", counter)
            replaced |= known is not None
    if dtype == torch.int8:
        return entry, _ensure_int8_buffers(entry, p, names) or replaced
    dtype = dtype or p.dtype
    for name in names:
        buffer = entry.get(name)
        if buffer is None:  # e.g. amsgrad switched on mid-run
            put(entry, name, torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format))
        elif buffer.dtype in CODE_DTYPES:  # int8 codes into another dtype
            put(entry, name, torch.empty_like(p, dtype=dtype).copy_(_decoded(entry, name, p)))
            _pop(entry, quantization.scale_name(name))
            replaced = True
        elif not buffer_fits(buffer, p, dtype):
            _check_buffer(entry, name, p)
            # Into another state_dtype: rounded to nearest, once (docs/design.md §7).
            put(entry, name, torch.empty_like(p, dtype=dtype).copy_(buffer))
            replaced = True
    return entry, replaced


def _pop(state: dict, key) -> None:
    """The optimizer's own removal of an entry: not counted as a change."""
    dict.pop(state, key)


def int8_buffer_dtype(p, name: str) -> torch.dtype:
    """The dtype of a buffer of p's state under state_dtype=torch.int8: its codes', or
    bfloat16 where p's rows are shorter than a block (quantization.py)."""
    if quantization.row_length(p.shape) is None:
        return torch.bfloat16
    return quantization.code_dtype(name)


def _decoded(entry: dict, name: str, p) -> torch.Tensor:
    """A buffer's values in float32, shaped like p: int8 codes decoded with their scales."""
    _check_buffer(entry, name, p)
    local_codes = _local(entry[name])
    local_scales = _local(entry[quantization.scale_name(name)])
    values = quantization.dequantize(local_codes, local_scales, quantization.SIGNED[name])
    return _like(p, values)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _like(p, local_values: torch.Tensor) -> torch.Tensor:
    """A tensor of p's kind (a DTensor sharded as p is) holding these local values."""
    if not is_dtensor(p):
        return local_values
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local_values, p.device_mesh, p.placements, shape=p.shape,
                              stride=p.stride())


def _zero_scales(p) -> torch.Tensor:
    shape = quantization.scales_shape(p.shape)
    if not is_dtensor(p):
        return torch.zeros(shape, dtype=torch.float32, device=p.device)
    from torch.distributed.tensor import zeros
    return zeros(shape, dtype=torch.float32, device_mesh=p.device_mesh, placements=p.placements)


def _ensure_int8_buffers(entry: dict, p, names) -> bool:
    """The buffers of int8 state (quantization.py): codes and scales where p's rows hold a
    block, bfloat16 elsewhere; made where missing, converted (rounded to nearest, once)
    where they are of another kind. Returns whether an existing tensor was replaced."""
    replaced = False
    for name in names:
        dtype = int8_buffer_dtype(p, name)
        key = quantization.scale_name(name)
        buffer, scales = entry.get(name), entry.get(key)
        if dtype == torch.bfloat16:  # rows too short for a block
            if buffer is not None and buffer.dtype in CODE_DTYPES:
                put(entry, name, torch.empty_like(p, dtype=dtype).copy_(_decoded(entry, name, p)))
                _pop(entry, key)
                replaced = True
                continue
            if scales is not None:  # scales beside a bfloat16 buffer (put there by hand): no
                _pop(entry, key)    # codes to scale, and the kernels would take them as codes
            if buffer is None:
                put(entry, name, torch.zeros_like(p, dtype=dtype))
            elif not buffer_fits(buffer, p, dtype):
                _check_buffer(entry, name, p)
                put(entry, name, torch.empty_like(p, dtype=dtype).copy_(buffer))
                replaced = True
            continue
        if buffer is None:
            put(entry, name, torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format))
            put(entry, key, _zero_scales(p))
            continue
        _check_buffer(entry, name, p)
        if scales is not None and codes_fit(buffer, scales, p, dtype):
            continue
        if buffer.dtype in CODE_DTYPES:  # codes of another kind (a moved parameter's)
            values = _local(_decoded(entry, name, p))
        else:  # a float buffer (fp32 or bf16 state, a checkpoint's) into codes
            values = _local(buffer).float()
        codes, new_scales = quantization.quantize(
            values.to(_local(p).device), quantization.NEAREST_BITS, quantization.SIGNED[name])
        put(entry, name, _like(p, codes))
        put(entry, key, _like_scales(p, new_scales))
        replaced = True
    return replaced


def _like_scales(p, local_scales: torch.Tensor) -> torch.Tensor:
    if not is_dtensor(p):
        return local_scales
    from torch.distributed.tensor import DTensor
    shape = torch.Size(quantization.scales_shape(p.shape))
    return DTensor.from_local(local_scales, p.device_mesh, p.placements, shape=shape,
                              stride=(shape[1], 1))


def codes_fit(codes: torch.Tensor, scales: torch.Tensor, p, dtype: torch.dtype) -> bool:
    """Whether int8 codes and their scales still match their parameter (dtype, device,
    shape; dense row-major, as the block layout reads them)."""
    if (codes.dtype != dtype or codes.shape != p.shape or codes.device != p.device
            or scales.dtype != torch.float32 or scales.device != p.device
            or scales.shape != quantization.scales_shape(p.shape)):
        return False
    return _local(codes).is_contiguous() and _local(scales).is_contiguous()


class StateWatch:
    """Tells whether the lists built from an optimizer's state may still be reused: its
    version changes when the state object itself is replaced (by any other object, one used
    before included) and when any state is changed from outside (counted)."""

    def __init__(self) -> None:
        self._watched: Optional[dict] = None  # the state object the lists were built from
        self._epoch = 0

    def drop(self) -> None:
        """Forget every list built so far."""
        self._epoch += 1

    def version(self, optimizer) -> object:
        if type(optimizer.state) is not OptimizerState:  # optimizer.state = ... by hand
            # (No local name for it before this check: that would be a reference too.)
            if not held_only_by(optimizer.__dict__, "state"):
                # The user still holds it, and may change it unseen: no list is reused.
                return object()
            optimizer.state = tracked(optimizer.state)
        state = optimizer.state
        if state is not self._watched:
            self._watched = state
            self._epoch += 1
        return self._epoch, _changes
