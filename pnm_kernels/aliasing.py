"""The memory a step writes is its own (docs/edits.md): no tensor of a parameter's state
that the step reads (a buffer, its int8 scales, the counter, the seed) may be, or share memory
with, another such tensor, a parameter, a gradient or a tensor lr of the step; no parameter
or state tensor may have elements that share memory (an expanded view). Gradients (and a
tensor lr) are only read: two of them may share memory, or one its own elements. Each
backend would step aliased memory another way (the reference one tensor after another, the
kernels all at once), so a state tensor put under two keys or parameters by hand, or made a
view of another's memory, is refused before anything is touched.

The claims element by element (MemoryClaims) are checked where a step's lists are built
(after any edit of the state), not at every step; what a step writes is kept as spans
(written_memory, WrittenSpans, held_params), against which each step's gradients and tensor
lr are looked up (extents_meet, also inside a compiled step)."""
import bisect

import torch

from ._ops import extension_error
from .params import local

# What a tensor is to its parameter, besides one of its state's keys.
PARAMETER = "parameter"
GRADIENT = "gradient"
# A group's tensor lr (its owner: the group): only read, as a gradient is.
LR = "lr"
# GradScaler's grad_scale or found_inf (its owner: that name): only read too.
SCALING = "scaling"
_READ_ONLY = (GRADIENT, LR, SCALING)

# Two strided tensors whose spans meet are compared run by run (a run: elements contiguous
# in memory); past this many runs in either (elements interleaved with another tensor's, in
# a tensor this large) they are taken as apart rather than compared: a false refusal would
# stop a training run, and such layouts are made on purpose.
_MAX_RUNS = 1 << 22


class SharedMemoryError(RuntimeError):
    """args: the owners (parameter, key) of two tensors that share memory, and whether they
    are the very same tensor."""


class MemoryClaims:
    """The tensors a step will read and write, each with its owner (a parameter and a key);
    `add` them, then `check`: SharedMemoryError for the first two that share memory. A build
    of 10,000 parameters' lists adds some 70,000, so each is kept in flat lists of plain
    values: a tuple a claim gave the garbage collector so much to walk that its passes cost
    as much as the claims)."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # first byte
        self._ends: list[int] = []  # past the last byte
        self._dense: list[bool] = []  # covers every byte between once
        self._tensors: list = []
        self._params: list = []
        self._keys: list = []
        self._overlapping: list[int] = []  # claims whose own elements share memory

    def add(self, tensor, param, key) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        t = tensor if type(tensor) in _PLAIN else local(tensor)
        n = t.numel()
        if n == 0 or t.layout != torch.strided or t.is_meta:  # no memory of its own
            return
        if t.is_contiguous():
            extent, dense = n, True
        else:
            extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
            dense = extent == n
        try:
            start = t.data_ptr()
        except RuntimeError:  # a tensor without storage (a fake tensor, say): nothing to alias
            return
        if not dense and key not in _READ_ONLY and _overlaps_itself(t, extent):
            self._overlapping.append(len(self._starts))
        self._starts.append(start)
        self._ends.append(start + extent * t.element_size())
        self._dense.append(dense)
        self._tensors.append(tensor)
        self._params.append(param)
        self._keys.append(key)

    def check(self) -> None:
        """A sweep over the spans in address order: O(n log n), and disjoint memory keeps one
        span open. (Addresses are unique across devices, but compared only on one.) A tensor
        whose own elements share memory is refused first, as shared with itself. Of several
        shared pairs, the one whose later claim came first is named: addresses differ from
        run to run, the order of the claims does not."""
        if self._overlapping:
            i = self._overlapping[0]
            owner = (self._params[i], self._keys[i])
            raise SharedMemoryError(owner, owner, False)
        starts, ends = self._starts, self._ends
        open_spans: list[int] = []
        open_end = -1
        first: tuple[int, int] | None = None
        for i in sorted(range(len(starts)), key=starts.__getitem__):
            if starts[i] >= open_end:
                open_spans, open_end = [i], ends[i]
                continue
            open_spans = [j for j in open_spans if ends[j] > starts[i]]
            for j in open_spans:
                pair = (max(i, j), min(i, j))
                if (first is None or pair < first) and self._shared(*pair):
                    first = pair
            open_spans.append(i)
            open_end = max(open_end, ends[i])
        if first is not None:
            i, j = first
            raise SharedMemoryError((self._params[i], self._keys[i]),
                                    (self._params[j], self._keys[j]),
                                    self._tensors[i] is self._tensors[j])

    def _shared(self, i: int, j: int) -> bool:
        if self._params[i] is self._params[j] and self._keys[i] == self._keys[j]:
            return False  # one tensor added twice for one owner
        if self._keys[i] in _READ_ONLY and self._keys[j] in _READ_ONLY:
            return False  # only read
        a_local, b_local = local(self._tensors[i]), local(self._tensors[j])
        return a_local.device == b_local.device and (
            (self._dense[i] and self._dense[j]) or _bytes_overlap(a_local, b_local))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def written_memory():
    """Where the tensors held between steps lie (every cached batch's parameters, buffers,
    counters), to find a gradient put into that memory since (`p.grad = q.data`) on a step
    that builds no lists: csrc/written_memory.h's WrittenMemory, or the same in Python
    without the extension."""
    if extension_error() is None:
        return torch.classes.pnm_kernels.WrittenMemory()
    return WrittenSpans()


def held_params(params):
    """A cached batch's parameters as written_memory's lookups take them (HeldParams: their
    gradients read in C++)."""
    if extension_error() is None:
        return torch.classes.pnm_kernels.HeldParams(params)
    return list(params)


class WrittenSpans:
    """WrittenMemory in Python (a Triton-only install): each tensor's whole extent."""

    def __init__(self) -> None:
        self._spans: list[tuple[int, int]] = []
        self._merged: list[list[int]] = []
        self._starts: list[int] = []
        # The same from each storage's start, by storage: a storage's memory can move with
        # no tensor of it changing (`t.share_memory_()`), leaving a span where it was.
        self._in_storage: dict[int, list[tuple[int, int]]] = {}

    def add(self, tensors) -> None:
        tensors = list(tensors)
        self._spans += filter(None, map(_extent_of, tensors))
        self._merged = []  # sorted and disjoint (so their ends sorted too), made when read
        for storage, start, end in filter(None, map(_extent_in_storage, tensors)):
            self._in_storage.setdefault(storage, []).append((start, end))

    def clear(self) -> None:
        self._spans, self._merged, self._in_storage = [], [], {}

    def params_grads_met(self, params) -> bool:
        return self.grads_met(p.grad for p in params)

    def grads_met(self, grads) -> bool:
        if not self._merged:
            for start, end in sorted(self._spans):
                if self._merged and start <= self._merged[-1][1]:
                    self._merged[-1][1] = max(self._merged[-1][1], end)
                else:
                    self._merged.append([start, end])
            self._starts = [start for start, _ in self._merged]
        for grad in grads:
            span = _extent_of(grad)
            if span is None:
                continue
            k = bisect.bisect_left(self._starts, span[1])  # the spans starting before its end
            if k and self._merged[k - 1][1] > span[0]:
                return True
            if self._in_storage:
                storage, start, end = _extent_in_storage(grad)
                if any(s < end and start < e for s, e in self._in_storage.get(storage, ())):
                    return True
        return False


def extents_meet(written, read) -> bool:
    """Whether two of `written` share a byte of their extents, or one of `read` meets one
    of them (csrc/written_memory.h's extents_meet, or the same in Python without the
    extension). A screen: MemoryClaims says whether elements meet."""
    if extension_error() is None:
        return torch.ops.pnm_kernels._extents_meet(written, read)
    spans = sorted(filter(None, map(_extent_of, written)))
    if any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])):
        return True
    memory = WrittenSpans()
    memory.add(written)
    return memory.grads_met(read)


def _extent_of(t):
    """The bytes [start, end) a strided tensor's elements span; None without memory."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.layout != torch.strided:
        return None
    try:
        start = t.data_ptr()
    except RuntimeError:
        return None
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + extent * t.element_size()


def _extent_in_storage(t):
    """(its storage, and the bytes [start, end) of it t's elements span from its start); None
    without memory."""
    span = _extent_of(t)
    if span is None:
        return None
    storage = t.untyped_storage()
    start = span[0] - storage.data_ptr()
    return storage._cdata, start, start + span[1] - span[0]


def _overlaps_itself(t: torch.Tensor, extent: int) -> bool:
    """Whether two elements of t (not dense) share memory. Fewer places than elements must
    (an expanded view); where each dimension, by stride, steps past all the smaller ones
    none can (a slice, a column block); otherwise its runs are compared (past _MAX_RUNS, it
    is taken as apart)."""
    if extent < t.numel():
        return True
    span = 1  # elements the dimensions so far reach
    for size, stride in sorted((d for d in zip(t.shape, t.stride()) if d[0] > 1),
                               key=lambda d: d[1]):
        if stride < span:
            runs = _runs(t)
            return runs is not None and bool((runs[0][1:] < runs[1][:-1]).any())
        span += (size - 1) * stride
    return False


def _bytes_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors with gaps (strided views: the column blocks of a fused weight,
    say) whose spans meet cover a byte in common, from their contiguous runs: a binary search
    of b's runs among a's, O(runs log runs)."""
    a_runs, b_runs = _runs(a), _runs(b)
    if a_runs is None or b_runs is None:
        return False
    (a_starts, a_ends), (b_starts, b_ends) = a_runs, b_runs
    before = torch.searchsorted(a_starts, b_starts, right=True) - 1  # a's run at or before
    hit = (before >= 0) & (a_ends[before.clamp(min=0)] > b_starts)
    after = before + 1  # a's next run
    hit |= (after < len(a_starts)) & (a_starts[after.clamp(max=len(a_starts) - 1)] < b_ends)
    return bool(hit.any())


def _runs(t: torch.Tensor):
    """The byte intervals [start, end) of t's contiguous runs, sorted; None past _MAX_RUNS."""
    run = 1  # elements a run: the innermost dimensions that are contiguous together
    outer: list[tuple[int, int]] = []  # the other dimensions: (size, stride)
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if not outer and stride == run:
            run *= size
        else:
            outer.append((size, stride))
    count = 1
    for size, _ in outer:
        count *= size
    if count > _MAX_RUNS:
        return None
    starts = torch.zeros((), dtype=torch.int64)
    for size, stride in outer:
        starts = starts.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    starts = starts.flatten().sort().values * t.element_size() + t.data_ptr()
    return starts, starts + run * t.element_size()
