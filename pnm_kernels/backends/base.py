"""What every backend takes and the one protocol they are called through.

A backend steps one batch: the parameters of one param group on one device and of one dtype,
their gradients, state buffers (in kernel table order: PNM pos_momentum, neg_momentum; AdaPNM
exp_avg, neg_exp_avg, exp_avg_sq[, max_exp_avg_sq]) and step counters. Backends that hold a
batch's lists in C++ between steps (fused, Triton) can also repeat a step from those lists,
reading each parameter's gradient there (see pnm_kernels/repeat.py)."""
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from .._ops import extension_error
from ..hyper import Hyper
from ..layout import fits

EMULATE_ENV = "PNM_KERNELS_EMULATE_CUDA"
PNM_BUFFERS: tuple[str, ...] = ("pos_momentum", "neg_momentum")
ADAPNM_BUFFERS: tuple[str, ...] = ("exp_avg", "neg_exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# Step counters: float64, exact to 2^53 steps. (torch's capturable and fused optimizers keep
# float32 ones, which stop at 2^24 = 16.8 M: PNM would stop alternating its buffers there.)
STEP_DTYPE = torch.float64


@dataclass
class HeldLists:
    """What a backend derives once from a cached batch's lists (parameters, buffers and
    counters stay the same from step to step) and keeps until the batch is dropped."""
    shards: bool = False  # the parameters are DTensors; the lists hold their local shards
    step_lists: Any = None  # the C++ copy of the lists (pnm_kernels._C StepLists)
    triton_tables: list = field(default_factory=list)  # [(key, pointers, device tables)]
    triton_blocks_done: Optional[torch.Tensor] = None  # the Triton launch's ticket counter
    # State in a dtype of its own (docs/design.md §7, §8): its kernels take seeds and scales
    # too, so no StepLists and no repeated step; `layouts` (hold_layouts) confirms the cached
    # lists before each step. The fused backend's C++ copies of its lists (StateLists), by
    # the kind of step they were made for.
    own_state: bool = False
    layouts: Any = None
    state_lists: dict = field(default_factory=dict)
    memory: Optional[list] = None  # held_memory, without the extension (else in StepLists)
    params: Any = None  # aliasing.held_params, for BatchCache.grad_in_written


@dataclass
class Batch:
    params: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    buffers: list = field(default_factory=list)  # one list per buffer name
    steps: list = field(default_factory=list)
    held: Optional[HeldLists] = None  # for a cached batch
    # bfloat16 state (docs/design.md §7): each parameter's seed (int64 tensor) and the
    # elements of the whole parameter before its shard (0 where it is not sharded).
    seeds: list = field(default_factory=list)
    offsets: list = field(default_factory=list)
    # int8 state (pnm_kernels/quantization.py): one list per buffer name, like buffers, of
    # each parameter's block scales (None where its buffer is bfloat16).
    scales: list = field(default_factory=list)


@dataclass(frozen=True)
class Scaling:
    """GradScaler's tensors (optimizer.grad_scale / found_inf), on the batch's device: the
    step divides gradients by grad_scale and writes nothing where found_inf is nonzero."""
    grad_scale: Optional[torch.Tensor] = None
    found_inf: Optional[torch.Tensor] = None

    @staticmethod
    def of(optimizer) -> "Scaling":
        """optimizer.grad_scale and found_inf as torch.amp.GradScaler sets them (float32, one
        element), checked before anything is touched: every backend then reads them alike."""
        tensors = []
        for name in ("grad_scale", "found_inf"):
            t = getattr(optimizer, name, None)
            if t is not None and not (isinstance(t, torch.Tensor) and t.dtype == torch.float32
                                      and t.numel() == 1):
                what = (f"a {t.dtype} tensor of shape {tuple(t.shape)}"
                        if isinstance(t, torch.Tensor) else type(t).__name__)
                raise ValueError(f"optimizer.{name} must be a float32 tensor of one element (as "
                                 f"torch.amp.GradScaler sets it), not {what}")
            tensors.append(t if t is None or t.dim() == 0 else t.reshape(()))
        return Scaling(*tensors)

    def named(self) -> list:
        """(name, tensor) of each one set: read while the step writes, as a tensor lr is."""
        return [(name, t) for name, t in (("grad_scale", self.grad_scale),
                                          ("found_inf", self.found_inf)) if t is not None]

    def to(self, device: torch.device) -> "Scaling":
        if self.grad_scale is None and self.found_inf is None:
            return self
        return Scaling(*(None if t is None else t.to(device, non_blocking=True)
                         for t in (self.grad_scale, self.found_inf)))


# A repeated step prepared and ready to run: returns False when it declined, having done
# nothing (a gradient missing or laid out unlike its parameter).
Launch = Callable[[Scaling], bool]


class Backend(Protocol):
    name: str
    flat: bool  # its kernels walk raw memory: every tensor dense and laid out like its param
    holds_lists: bool  # keeps a batch's lists in C++ and can repeat a step from them
    reads_host: bool  # reads step counts on the host in an eager step: not capturable

    def step(self, batch: Batch, hyper: Hyper, scaling: Scaling) -> None:
        """One step over the batch."""

    def prepare_repeat(self, held: HeldLists, device: torch.device, dtype: torch.dtype,
                       hyper: Hyper, use_taken: bool) -> Optional[Launch]:
        """A step over a held batch with its parameters' own gradients (or, with use_taken,
        those its StepLists.take_own_grads() took), ready to launch; None, having done
        nothing, when it cannot be repeated."""


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the device's current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def emulating(device: torch.device) -> bool:
    """Whether the CUDA kernels' code runs emulated on this device's (CPU) tensors."""
    return device.type == "cpu" and os.environ.get(EMULATE_ENV) == "1"


def split_lr(lr, device, keep_float64=False):
    """(float lr, lr tensor or None) as the kernels take them: a tensor lr stays a tensor,
    on the params' device or on the CPU (read there without a device synchronisation), in
    float32; with keep_float64 (the fused ops, which read a float64 lr in full), a float64
    one stays float64, so float64 parameters get all its digits."""
    if not isinstance(lr, torch.Tensor):
        return float(lr), None
    if lr.device != device and lr.device.type != "cpu":
        lr = lr.to(device)
    if keep_float64 and lr.dtype == torch.float64:
        return 0.0, lr
    return 0.0, lr.to(torch.float32)


def dispatch_mode_active() -> bool:
    """Whether a TorchDispatchMode sees the ops run now (allow_mutation_on_saved_tensors',
    a FlopCounterMode)."""
    return torch._C._len_torch_dispatch_stack() > 0


def show_writes(tensors) -> None:
    """Triton's kernels write through raw pointers, past torch's dispatcher: a dispatch mode
    that must see a write before it happens (allow_mutation_on_saved_tensors clones a tensor
    autograd saved before an op writes it) is shown one: each tensor's first element copied
    onto itself, at the tensor's address (where such a mode looks a tensor up; an empty view
    has none). Without a mode, nothing."""
    if not torch.compiler.is_compiling() and dispatch_mode_active():
        firsts = [t.detach().as_strided((1,), (1,)) for t in tensors if t.numel()]
        torch._foreach_copy_(firsts, firsts)


def new_blocks_done(device: torch.device) -> Optional[torch.Tensor]:
    """A batch's ticket counter for steps that increment their step counters in their own
    launch: one int32, zero between steps. None inside a CUDA-graph capture, where its zeroing
    would only be recorded; a batch without one keeps a second launch for its counters."""
    if capturing(device):
        return None
    return torch.zeros(1, dtype=torch.int32, device=device)


def step_lists(batch: Batch):
    """The C++ copy (pnm_kernels._C's StepLists) of a cached batch's parameters, buffers and
    counters, made on first use; None for a batch that is not cached, or without the
    extension. It also holds the batch's blocks_done counter, with which each CUDA launch
    increments the step counters itself (csrc/multi_tensor_apply.h; see new_blocks_done)."""
    if batch.held is None or batch.held.own_state or extension_error() is not None:
        return None
    lists = batch.held.step_lists
    if lists is None:
        buffers = list(batch.buffers) + [[]] * (4 - len(batch.buffers))
        lists = batch.held.step_lists = torch.classes.pnm_kernels.StepLists(
            batch.params, *buffers, batch.steps, new_blocks_done(batch.params[0].device))
    return lists


def counter_fits(step, device: torch.device) -> bool:
    """A held step counter the kernels can read and write: STEP_DTYPE of shape () (as the
    planned step leaves every counter: counters.as_step) on the parameters' device, counting
    whole steps (counts_whole_steps)."""
    return (isinstance(step, torch.Tensor) and step.dtype == STEP_DTYPE
            and step.device == device and step.dim() == 0 and counts_whole_steps(step))


def counts_whole_steps(step: torch.Tensor) -> bool:
    """A counter that may be filled in place between steps (`step.fill_(-1)`, no version
    bump a cache could see) holds a count the kernels may advance: on the CPU, read at every
    step, a whole number >= 0 (csrc/step_call.h says why); one on a device is not read."""
    return step.device.type != "cpu" or is_whole_count(step.item())


def is_whole_count(value: float) -> bool:
    """A number of steps a counter may hold: whole and >= 0 (at -1 AdaPNM divides by a bias
    correction of 0; at 2.5 the kernels' bias corrections use 3.5, the reference's 3)."""
    number = float_or_none(value)  # a Python int past a float's range is no count
    return number is not None and math.isfinite(number) and number >= 0 and number == int(number)


def float_or_none(value) -> Optional[float]:
    """A real number as a float; None past a float's range (a Python int of 400 digits)."""
    try:
        return float(value)
    except OverflowError:
        return None


def held_lists_ok(batch: Batch) -> bool:
    """Whether a cached batch's tensors still fit each other: a parameter, a buffer or a
    counter given new data (t.data = ...) changes under the held lists, and a kernel must
    never write through a pointer whose tensor was not confirmed for this step."""
    if own_state(batch):
        return layouts_unchanged(batch.held.layouts)  # type: ignore[union-attr]
    lists = step_lists(batch)
    if lists is not None:
        return lists.held_lists_ok()
    # Without the extension (a Triton-only install), the same checks in Python.
    if not batch.params:
        return True
    device = batch.params[0].device
    return (all(fits(b, p) for buffers in batch.buffers for p, b in zip(batch.params, buffers))
            and all(counter_fits(s, device) for s in batch.steps)
            and batch.held.memory == held_memory(batch))  # type: ignore[union-attr]


def held_memory(batch: Batch) -> list:
    """Where each of a batch's parameters, buffers and counters is (StepLists.memory_unchanged
    in csrc/step_lists.h says why), for held_lists_ok without the extension."""
    return [(t.data_ptr(), t.is_neg()) for t in (*batch.params,
                                                 *(b for bs in batch.buffers for b in bs),
                                                 *batch.steps)]


def own_state(batch: Batch) -> bool:
    """Whether a cached batch keeps state in a dtype of its own (HeldLists.own_state)."""
    return batch.held is not None and batch.held.own_state


def hold_layouts(batch: Batch):
    """The layouts of every tensor of a batch of state in a dtype of its own (its gradients
    aside), for layouts_unchanged: the C++ HeldLayouts (a check over thousands of tensors
    costs ~1 ms there), or without the extension the same in Python."""
    tensors = [*batch.params, *(b for buffers in batch.buffers for b in buffers), *batch.steps,
               *batch.seeds, *(s for scales in batch.scales for s in scales if s is not None)]
    return tensor_layouts(tensors, list(batch.steps))


def tensor_layouts(tensors: list, counters: tuple | list = ()):
    """hold_layouts of any tensors (the counters among them read again by layouts_unchanged)."""
    if extension_error() is None:
        return torch.classes.pnm_kernels.HeldLayouts(tensors, list(counters))
    return tensors, [_layout(t) for t in tensors], counters


def layouts_unchanged(layouts) -> bool:
    """Whether every tensor is laid out as when held, and every counter still counts whole
    steps (read again: it may have been filled in place)."""
    if not isinstance(layouts, tuple):
        return layouts.unchanged()
    tensors, was, counters = layouts
    return (all(_layout(t) == w for t, w in zip(tensors, was))
            and all(map(counts_whole_steps, counters)))


def _layout(t: torch.Tensor) -> tuple:
    return t.dtype, t.device, t.layout, t.shape, t.stride(), t.data_ptr(), t.is_neg()


def int8_parts(batch: Batch) -> tuple:
    """The indices into an int8-state batch of (the parameters with codes, those whose rows
    are too short for a block and keep bfloat16 state)."""
    coded = [i for i, scales in enumerate(batch.scales[0]) if scales is not None]
    rest = [i for i, scales in enumerate(batch.scales[0]) if scales is None]
    return coded, rest


def split_int8(batch: Batch) -> tuple:
    """An int8-state batch as (the parameters with codes, those whose rows are too short for
    a block and keep bfloat16 state), each a Batch or None where there are none."""
    coded, rest = int8_parts(batch)
    return (_pick(batch, coded) if coded else None), (_pick(batch, rest) if rest else None)


def _pick(batch: Batch, indices: list) -> Batch:
    """The batch of these parameters (all of them: the batch itself)."""
    if len(indices) == len(batch.params):
        return batch
    take = lambda items: [items[i] for i in indices]  # noqa: E731
    return Batch(params=take(batch.params), grads=take(batch.grads),
                 buffers=[take(b) for b in batch.buffers], steps=take(batch.steps),
                 seeds=take(batch.seeds), offsets=take(batch.offsets),
                 scales=[take(s) for s in batch.scales])
